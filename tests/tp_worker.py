"""One rank of ``tests/test_tensor_parallel.py`` (run by ``torchrun``, gloo on the CPU; ``--device cuda``: NCCL,
``tests/gpu/test_gpu_tp.py``).

Loads the saved model at ``--model`` with transformers' tensor-parallel plan (``tp_plan="auto"``), generates
with every listed policy (its conformance ``demanding`` setting) on a DynamicCache and on a SlotCache, and
writes what it saw to ``--out``/rank<r>.json: tokens, kept entries per layer, the positions each KV head holds,
KV heads per layer, the pass's
tensor-parallel line and the collectives it inserted. Then each rank runs half of the same generations on one
process (the model loaded whole, no collectives) as the reference. Both ranks also run every chunk-fusion
policy (``kvpass.ChunkFusion``, one store directory shared by the ranks) and record what ``kvpass.explain``
prints, and ``kvpass.compile``'s fast path (``--compiled``): ``generate`` and a ``RequestQueue`` on prompts of
several lengths, the tokens and the graphs compiled per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import transformers  # noqa: E402

import kvpass  # noqa: E402
from conformance import CONFORMANCE, NEW, PROMPT, PUNCT  # noqa: E402
from families import symbolic_lengths  # noqa: E402
from kvpass.generate.fastpath import backward_hooked  # noqa: E402

DEVICE = "cpu"  # --device cuda: NCCL, each rank on its GPU (tests/gpu/test_gpu_tp.py)


def load(path: str, tp: bool):
    from transformers import AutoModelForCausalLM

    from kvpass.eval.models import tensor_parallel_kwargs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **(tensor_parallel_kwargs() if tp else {}))
    return (model if tp else model.to(DEVICE)).eval()


def prompt() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 90, (1, PROMPT), generator=g)
    ids[torch.rand(1, PROMPT, generator=g) < 0.15] = PUNCT[0]
    return ids.to(DEVICE)


def parameters(policy: str) -> dict:
    """The policy's conformance setting on ranks (``Entry.parallel`` where it has one, else ``demanding``)."""
    return CONFORMANCE[policy].parallel or CONFORMANCE[policy].demanding


def head_positions(pos: torch.Tensor, ranges: torch.Tensor | None) -> list[list[int]]:
    """Row 0's sorted true positions of each KV head: its row of ``pos [H_kv, L]``, or under a per-head layout
    (``ranges [B, H_kv, 4]``, ``kvpass.cache.ragged``) its range of the row's pool (empty entries left out)."""
    if ranges is None:
        return pos.sort(-1).values.tolist()
    flat = pos.reshape(-1)
    return [sorted(p for p in flat[s : s + n].tolist() if p >= 0) for s, n in ranges[0, :, :2].tolist()]


def generate(model, name: str, cache_kind: str) -> dict:
    """Greedy prefill + NEW steps under ``name`` (``policy`` or ``policy@compiler``)."""
    from transformers import DynamicCache

    policy, _, compiler = name.partition("@")
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler=compiler or "eager", **parameters(policy))
    cache = (
        kvpass.SlotCache(model, be, max_length=PROMPT + NEW, max_new_tokens=NEW)
        if cache_kind == "slot"
        else DynamicCache(config=model.config)
    )
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    ids, tokens = prompt(), []
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        symbolic_lengths(cache)
        for _ in range(NEW):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
    names = list(be.policy.slot_state(1, 1))
    if cache_kind == "slot":
        kept = [int(layer.count[0, 1]) for layer in cache.layers]
        held = [layer.pos for layer in cache.layers]
        ranges = [
            layer.state[names.index("heads")] if "heads" in names and layer.state else None for layer in cache.layers
        ]
    else:
        kept = [int(layer.keys.shape[-2]) for layer in cache.layers]
        states = [be.state.layer(i) for i in range(len(cache.layers))]
        held = [None if st is None else st.pos for st in states]
        ranges = [None if st is None else st.extra.get("heads") for st in states]
    # the decision itself: the sorted true positions each KV head holds (row 0), per layer
    positions = [None if p is None else head_positions(p[0], r) for p, r in zip(held, ranges)]
    return {
        "tokens": tokens,
        "kept": kept,
        "per_head": any(r is not None for r in ranges),
        "kv_heads": [int(layer.keys.shape[1]) for layer in cache.layers],
        "positions": positions,
        "tp": sorted({r.tp for r in be.reports}),
        "reductions": [x for r in be.reports for x in r.reductions],
        "problems": [p for r in be.reports for p in r.problems],
        "warnings": sorted({str(w.message)[:300] for w in caught if "kvpass" in str(w.message)}),
    }


def run_all(model, names: list[str], caches: list[str], share: slice = slice(None), on_slots=None) -> dict:
    """Every (cache, policy) run; ``on_slots``: the policies also run on a SlotCache (None: all)."""
    runs = [
        f"{c}:{n}"
        for c in caches
        for n in names
        if not (c == "slot" and ("@" in n or (on_slots is not None and n not in on_slots)))
    ]
    return recorded(lambda key: generate(model, key.partition(":")[2], key.partition(":")[0]), runs[share])


def recorded(fn, keys) -> dict:
    """``fn(key)`` for every key; a run that raises is recorded as its error (the test names the run and the
    error) and the others go on."""
    out = {}
    for key in keys:
        print(f"tp_worker: {key}", flush=True)  # a run that kills the process (a device-side assert) is the last named
        start = time.perf_counter()
        try:
            out[key] = fn(key)
        except Exception as e:
            traceback.print_exc()  # the whole trace on stderr; the test shows its tail
            out[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        print(f"tp_worker: {key} took {time.perf_counter() - start:.1f} s", flush=True)
    return out


def explained(model) -> str:
    """What ``kvpass.explain`` prints for chunkkv on this rank (its local heads and the gathers)."""
    torch._dynamo.reset()
    return str(
        kvpass.explain(
            model,
            {"input_ids": prompt(), "use_cache": True},
            "chunkkv",
            verbose=False,
            **CONFORMANCE["chunkkv"].demanding,
        )
    )


LENGTHS = (11, 17, 26, 40)  # prompts through kvpass.compile's generate: three capacity buckets


def compile_once(path: str, tp: bool, policy: str) -> dict:
    """``kvpass.compile`` (AOTAutograd's eager compiler: the backend's path to Inductor, local weights and the
    spec guard filter included) on a fresh copy of the model, then ``generate`` on prompts of every ``LENGTHS``
    and the same prompts through a ``RequestQueue`` of two rows: the new tokens of each, the graphs the backend
    compiled per phase, how many of Dynamo's DTensor spec guards the filter dropped and how many decode steps
    called their graph directly (``direct_steps``' default)."""
    model = load(path, tp)
    torch._dynamo.reset()
    be = kvpass.compile(model, policy, compiler="aot_eager", **parameters(policy))
    tokens, direct = [], 0
    for n in LENGTHS:
        ids = torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(n)).to(DEVICE)
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        tokens.append(out[0, n:].tolist())
        direct += be.last_direct_steps.direct if be.last_direct_steps is not None else 0
    graphs = be.graph_counts()
    # the same prompts admitted into a running batch of two rows (kvpass.RequestQueue: a graph per phase for its
    # batch of two)
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for n in LENGTHS:
        queue.add(torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE), max_new_tokens=NEW)
    queued = [t[-NEW:].tolist() for t in queue.run(progress=False)]
    return {
        "tokens": tokens,
        "queued": queued,
        "graphs": graphs,
        "graphs_with_queue": be.graph_counts(),
        "spec_guards_dropped": be.spec_guards.dropped,
        "direct_steps": direct,
        "kv_heads": sorted({int(c.layers[0].keys.shape[1]) for c in model.generate.caches.values()}),
    }


FUSION = {
    "a3": {"ratio": 0.3},
    "a3+evict": {"ratio": 0.3, "capacity": 24},
    "cacheblend": {"ratio": 0.3},
    "legolink": {"prefix": 4},
    "pie": {},
    "full_reuse": {},
}
FUSION_RUNS = list(FUSION) + ["a3+evict:slot"]  # ``policy`` or ``policy:cache``


def fusion_request():
    g = torch.Generator().manual_seed(3)
    system = [1] + torch.randint(3, 90, (5,), generator=g).tolist()
    chunks = [torch.randint(3, 90, (12,), generator=g).tolist() for _ in range(3)]
    return system, chunks, torch.randint(3, 90, (4,), generator=g).tolist()


def fuse(model, store_dir: str, name: str) -> dict:
    """One chunk-fusion request (``policy`` or ``policy:slot``): its recompute set, the positions each KV head
    keeps per layer, the tokens generated, and the store's work (each rank stores its own heads)."""
    policy, _, cache = name.partition(":")
    torch._dynamo.reset()
    system, chunks, question = fusion_request()
    fusion = kvpass.ChunkFusion(
        model, kvpass.ChunkStore(store_dir, model), policy, compiler="eager", cache=cache or "dynamic", **FUSION[policy]
    )
    fused = fusion.prepare(chunks, question, system=system, max_new_tokens=NEW)
    out = fusion.generate(chunks, question, system=system, max_new_tokens=NEW, do_sample=False)
    return {
        "recompute": fused.recompute.tolist(),
        "positions": [p[0].tolist() for p in fused.kept],
        "kv_heads": [int(p.shape[1]) for p in fused.kept],
        "tokens": out[0, -NEW:].tolist(),
        "stored": fusion.store.stats()["disk_entries"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policies", required=True)
    ap.add_argument("--caches", default="dynamic,slot")
    ap.add_argument(
        "--slot-policies", default="", help="the policies run on a SlotCache, comma-separated (default all)"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--fusion", default="all", help="the FUSION_RUNS to run, comma-separated, or 'all'")
    ap.add_argument("--compiled", default="", help="policies run through kvpass.compile, comma-separated")
    args = ap.parse_args()
    runs = FUSION_RUNS if args.fusion == "all" else [r for r in args.fusion.split(",") if r]
    names, caches = args.policies.split(","), args.caches.split(",")
    on_slots = set(args.slot_policies.split(",")) if args.slot_policies else None
    global DEVICE
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        DEVICE = f"cuda:{os.environ['LOCAL_RANK']}"
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    model = load(args.model, tp=True)
    hooked = backward_hooked(model)
    if hooked is not None:  # transformers 5.17's plan for Qwen3's q_norm / k_norm: Dynamo breaks the graph there
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(
                {
                    "skip": f"transformers {transformers.__version__}'s tensor-parallel plan puts a module-level "
                    f"backward hook on {hooked}: Dynamo cannot compile the model as one graph "
                    f"(kvpass.compile refuses it); later versions use parameter hooks"
                },
                f,
            )
        dist.barrier()
        dist.destroy_process_group()
        return
    result = {"tp": run_all(model, names, caches, on_slots=on_slots)}
    split = load(args.model, tp=True)
    result["explain"] = explained(split)
    result["fusion"] = recorded(
        lambda r: fuse(split, os.path.join(args.out, "store_tp"), r), runs
    )  # one store, both ranks
    result["pinned"] = kvpass.ChunkStore(os.path.join(args.out, "store_tp"), split, fingerprint="pinned").fingerprint
    compiled = [p for p in args.compiled.split(",") if p]
    result["compiled"] = recorded(lambda p: compile_once(args.model, True, p), compiled)
    result["single_compiled"] = recorded(lambda p: compile_once(args.model, False, p), compiled[rank::2])
    whole = load(args.model, tp=False)
    result["single"] = run_all(whole, names, caches, slice(rank, None, 2), on_slots)
    result["single_fusion"] = recorded(lambda r: fuse(whole, os.path.join(args.out, f"store_{rank}"), r), runs[rank::2])
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
