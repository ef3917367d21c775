"""One compile for every prompt length, through ``generate`` as a user calls it.

``kvpass.compile`` promises one prefill and one decode graph for every prompt length and a ``generate`` as
fast as the compiled step; this measures compile counts and times, and TPOT as a user pays it.

One process, one GPU, a random-weight Llama-3.1-8B shape (``--layers`` of its 32, bf16). Per policy,
``be = kvpass.compile(model, policy, budget=...)`` (``dynamic=True``, ``mode="reduce-overhead"``), then
``model.generate(ids, max_new_tokens=--new)`` on prompts of every ``--lengths`` in turn (no cache
sized by hand). Reported per policy:

* per prompt length: the call's wall time (the first includes the compile), the graphs the backend
  compiled so far per phase, and Dynamo's unique graphs;
* TPOT as the user pays it: at the last length, the time per step of a warm ``generate`` of ``4 * new``
  tokens (kvpass's decoding loop), read off the host's clock at each step (``StepClock``), and the same
  through HF's own loop (``_sample``, which waits for every step: ``return_dict_in_generate=True`` calls
  run it); beside them the device's: the same
  compiled forward, called with ``generate``'s arguments on the kept cache, 64 steps queued with one sync,
  and with a sync after each step;
* the first token's time (``generate`` of one token, warm) and the peak memory of that call;
* with ``--few-prefills`` (a policy whose prefill takes minutes: kvzip at 32 layers), three prefills at the
  last length instead of eight: its call takes ``4 * new`` tokens and sizes the cache, the first token's time
  comes from the timed ``generate`` (the host's clock at its first step), the queued loop follows one
  2-token call, and HF's loop and the synced loop are not timed;
* HF's own path for the same prompts (``cache_implementation="static"``, which HF compiles with its
  default ``CompileConfig``): wall time per length;
* peak memory, the roofline (weight bytes + the K/V a step must read, over the copy bandwidth measured in
  this process; ``bench_decode_step.read_entries``), Dynamo/Inductor's compile-time breakdown, and with
  ``--profile`` the host's top operators over 16 ``generate`` steps (where the time between steps goes).

cuDNN SDPA is off for every row (on torch 2.11 it re-plans for every new key length).

    python bench/bench_fastpath.py --layers 8 --lengths 2000,4500,9000,17000,33000 --out results.json

Results: ``bench/results/fastpath_h200_2026-11-26/``, ``fastpath_decode_loop_2026-11-27/`` (its
``h100_before_decode_loop/``: 32 layers on an H100 before the decoding loop) and
``gpu_h100_2026-12-05/proportional_splits/`` (``decode_l8_130k``).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers as tf
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from bench_decode_step import policy_of, read_entries  # noqa: E402
from llama_shape import copy_bandwidth, llama8b_config, policy_params, random_llama, uncompiled  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1000, 100000, (1, n), generator=torch.Generator().manual_seed(seed + n)).cuda()


class StepClock(StoppingCriteria):
    """A stopping criterion that never stops and notes the host's clock each time ``generate`` asks it: once
    per decode step, in kvpass's loop and in HF's. Steps are host-paced only where the host is the slower
    side; otherwise the host waits for the device each step, so the intervals are the user's time per token,
    without the prefill (the difference of two calls' wall times carried the prefill's noise: at 130k,
    1 % of a 4.4 s prefill is 0.46 ms per step over 96 steps)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.no = None

    def __call__(self, input_ids, scores, **kwargs):
        if not self.times:  # kvpass's loop asks with the first token queued, not yet computed: wait for it
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if self.no is None or self.no.shape[0] != input_ids.shape[0]:
            self.no = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.no

    def tpot(self, skip: int = 2) -> float:
        """Seconds per step over the steps after the first ``skip`` (the first steps follow the prefill)."""
        t = self.times[skip:]
        return (t[-1] - t[0]) / (len(t) - 1)


def clocked_tpot(model, ids, new: int, **kw) -> tuple[float, float]:
    """Seconds per decode step of one warm ``generate`` of ``new`` tokens (``StepClock``), and seconds to its
    first token."""
    torch.cuda.synchronize()
    clock = StepClock()
    gen(model, ids, new, stopping_criteria=StoppingCriteriaList([clock]), **kw)
    return clock.tpot(), clock.times[0] - clock.start


def gen(model, ids, new: int, **kw):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw
    )


def decode_kwargs(model, ids) -> dict:
    """The keyword arguments ``generate`` passed to the forward at its last decode step of a 2-token call
    (the kept cache, reset and prefilled with ``ids``), moved on by one token: what the next step takes."""
    seen = {}
    compiled = model.forward

    @functools.wraps(compiled)  # HF reads the forward's signature to choose what it passes
    def record(*a, **kw):
        seen.update(kw)
        return compiled(*a, **kw)

    model.forward = record
    try:
        out = gen(model, ids, 2)
    finally:
        model.forward = compiled
    return step_on(seen, out[:, -1:].clone(memory_format=torch.contiguous_format))


def step_on(kw: dict, token: torch.Tensor) -> dict:
    """``kw`` for the next token: ``input_ids`` is ``token``, positions move by one, the 2-D mask grows."""
    kw = dict(kw, input_ids=token)
    for name in ("position_ids", "cache_position"):
        if isinstance(kw.get(name), torch.Tensor):
            kw[name] = kw[name] + 1
    if isinstance(kw.get("attention_mask"), torch.Tensor) and kw["attention_mask"].dim() == 2:
        kw["attention_mask"] = torch.cat([kw["attention_mask"], kw["attention_mask"][:, -1:]], 1)
    return kw


@torch.no_grad()
def bare_loops(model, ids, steps: int = 64, few: bool = False) -> tuple[float, float | None]:
    """Seconds per decode step of the compiled forward alone, called with the arguments ``generate`` passes
    (so it runs ``generate``'s decode graph, compiling nothing), continuing on the kept cache after a
    2-token ``generate`` of ``ids``: ``steps`` queued with one sync, then ``steps`` with a sync after each.
    Each loop starts from a fresh 2-token call: a policy's capacity (snapkv: budget + the bucket of new
    tokens) holds one loop's steps, not both. A first call of as many new tokens as a loop takes sizes the kept
    cache for a loop (a prompt just under a capacity bucket would otherwise leave room for fewer steps).
    ``few``: the queued loop alone, on the cache an earlier call of at least as many tokens sized."""
    if not few:
        gen(model, ids, 8 + steps + 2)
    out = []
    for sync_each in (False,) if few else (False, True):
        kw = decode_kwargs(model, ids)
        for i in range(8 + steps):
            if i == 8:
                torch.cuda.synchronize()
                t = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            kw = step_on(kw, model(**kw).logits[:, -1].argmax(-1, keepdim=True))
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / steps)
    return out[0], (out[1] if len(out) > 1 else None)


def host_profile(model, ids, new: int) -> str:
    """The top host operators (self CPU time) over one ``generate`` of ``new`` steps, as a table."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen(model, ids, new)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)


def meta_of(args, lengths, bw: float) -> dict:
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "copy_bandwidth_GBps": round(bw / 1e9, 1),
        "triton": getattr(__import__("triton"), "__version__", "?"),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": args.layers,
        "shape": "Llama-3.1-8B (random weights), bf16, batch 1",
        "lengths": lengths,
        "new": args.new,
        "budget": args.budget,
        "cudnn_sdpa": False,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", default="2000,4500,9000,17000,33000")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--policies", default="full,snapkv,quest,streamingllm")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--hf", action="store_true", help="also HF generate on a StaticCache")
    ap.add_argument("--profile", action="store_true", help="a host profile of 16 generate steps per policy")
    ap.add_argument("--prefill-compiler", default=None, help="kvpass.compile's prefill_compiler (default: Inductor)")
    ap.add_argument(
        "--no-share-layers",
        action="store_true",
        help="kvpass.compile(..., share_layers=False): Inductor lowers every layer (no shared layers)",
    )
    ap.add_argument(
        "--few-prefills",
        action="store_true",
        help="three prefills at the last length instead of eight (no HF loop or synced loop): for slow prefills",
    )
    ap.add_argument("--out", default="fastpath.json")
    args = ap.parse_args()
    if args.few_prefills and 4 * args.new < 8 + 64 + 2:
        ap.error("--few-prefills sizes the cache with the 4 * --new tokens of one call: the queued loop takes 74 steps")
    torch.backends.cuda.enable_cudnn_sdp(False)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = random_llama(llama8b_config(args.layers), "cuda", torch.bfloat16)
    model.generation_config.pad_token_id = 0
    bw = copy_bandwidth()
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    cfg = model.config
    per_entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    rows = []
    for policy in args.policies.split(","):
        uncompiled(model)  # the previous policy's compile undone, its caches freed
        torch._dynamo.utils.counters.clear()
        name, extra = policy_of(policy)  # "expected_attention@decode_interval=64": a parameter beside the defaults
        params = {**policy_params(name, args.budget, model.config), **extra}
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        be = kvpass.compile(
            model, name, prefill_compiler=args.prefill_compiler, share_layers=not args.no_share_layers, **params
        )
        calls = []
        few = args.few_prefills
        for n in lengths:
            new = 4 * args.new if few and n == lengths[-1] else args.new  # --few-prefills: this call sizes the cache
            dt, _ = timed(lambda: gen(model, prompt(n), new))
            calls.append(
                {
                    "prompt": n,
                    "new": new,
                    "seconds": round(dt, 3),
                    "graphs": be.graph_counts(),
                    "dynamo_unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                }
            )
            print(policy, calls[-1], flush=True)
        ids = prompt(lengths[-1])
        # a cache that holds 4 * new tokens is built (and its CUDA graphs recorded) before any timing: the
        # next calls reuse it (an earlier version let the timed 4 * new call build it for the policies whose
        # capacity follows the new tokens, snapkv's budget + new, which paid that inside its TPOT)
        if few:
            peak = torch.cuda.max_memory_allocated() / 2**30  # since the compile: every call above
            torch.cuda.reset_peak_memory_stats()
            user, ttft = clocked_tpot(model, ids, 4 * args.new)
            prefill_peak = torch.cuda.max_memory_allocated() / 2**30  # the timed call's (prefill and decode)
            hf_loop = None
        else:
            gen(model, ids, 4 * args.new)
            user, _ = clocked_tpot(model, ids, 4 * args.new)
            # HF's own loop on the same compiled forward and cache (kvpass's loop hands it return_dict calls)
            hf_loop, _ = clocked_tpot(model, ids, 4 * args.new, return_dict_in_generate=True)
            peak = torch.cuda.max_memory_allocated() / 2**30  # since the compile, every call above included
            torch.cuda.reset_peak_memory_stats()
            ttft, _ = timed(lambda: gen(model, ids, 1))
            prefill_peak = torch.cuda.max_memory_allocated() / 2**30
        queued, synced = bare_loops(model, ids, few=few)
        graphs_after = be.graph_counts()
        roof = (weights + per_entry * read_entries(policy, lengths[-1], args.budget, args.layers)) / bw
        row = {
            "policy": policy,
            "params": params,
            "calls": calls,
            "first_call_s": calls[0]["seconds"],
            "later_calls_s": [c["seconds"] for c in calls[1:]],
            "graphs": graphs_after,
            "shared_layers": {r.phase: r.shared_layers for r in be.reports},
            "generate_tpot_ms": round(user * 1e3, 3),
            "queued_tpot_ms": round(queued * 1e3, 3),
            "hf_loop_tpot_ms": None if hf_loop is None else round(hf_loop * 1e3, 3),
            "ttft_s": round(ttft, 3),
            "prefill_peak_gib": round(prefill_peak, 2),
            "prefill_compiler": be.prefill_compiler,
            "cache_counters": {k: dict(torch._dynamo.utils.counters[k]) for k in ("inductor", "aot_autograd")},
            "synced_tpot_ms": None if synced is None else round(synced * 1e3, 3),
            "generate_over_queued": round(user / queued, 3),
            "roofline_ms": round(roof * 1e3, 3),
            "queued_over_roofline": round(queued / roof, 3),
            "peak_gib": round(peak, 2),
            "caches": repr(model.generate),
            "total_s": round(time.perf_counter() - t0, 1),
            "compile_times": torch._dynamo.utils.compile_times(repr="str"),
            "plans": be.plans(),
        }
        if args.profile:
            row["host_profile"] = host_profile(model, ids, 16)
            print(row["host_profile"], flush=True)
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("calls", "plans", "host_profile")}, flush=True)
        Path(args.out).write_text(json.dumps({"meta": meta_of(args, lengths, bw), "rows": rows}, indent=1, default=str))
    if args.hf:
        torch._dynamo.reset()
        hf = random_llama(llama8b_config(args.layers), "cuda", torch.bfloat16)
        hf.generation_config.pad_token_id = 0
        calls = []
        for n in lengths:
            dt, _ = timed(lambda: gen(hf, prompt(n), args.new, cache_implementation="static"))
            calls.append(
                {
                    "prompt": n,
                    "seconds": round(dt, 3),
                    "dynamo_unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
                }
            )
            print("hf_static", calls[-1], flush=True)
        rows.append(
            {
                "policy": "hf_static",
                "calls": calls,
                "first_call_s": calls[0]["seconds"],
                "later_calls_s": [c["seconds"] for c in calls[1:]],
                "note": "HF generate, cache_implementation='static', HF's own compile of the decode step",
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "calls"}, flush=True)
        Path(args.out).write_text(json.dumps({"meta": meta_of(args, lengths, bw), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
