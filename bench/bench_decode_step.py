"""The decode step of every SlotCache policy against what a user runs instead (HF eager, HF StaticCache).

A policy that keeps fewer entries must also make the step faster, not only the cache smaller; this measures
TPOT, TTFT, peak memory and the step's distance from its memory roofline.

One process, one GPU, one model: a random-weight Llama-3.1-8B shape (``--layers`` of its 32, bf16).
Per context length, every configuration prefills the same random prompt (twice: the first call
compiles) and then decodes greedily; reported per row:

* TTFT: the second prefill's wall time; TPOT: mean step over ``--steps`` steps after 8 warm-up steps
  (one sync at each end, so host overhead shows where the host is the bottleneck); with ``--decode-to N``
  the warm-up decodes until the timed steps end at ``N`` tokens (a long generation after the prompt);
* peak: the allocator's high-water mark from the prefill to the last step; KV bytes: what the cache
  holds (a SlotCache: every slot, empty or not);
* with ``--profile``: the device kernels of 8 more steps, the 24 longest per step;
* roofline: (weight bytes read per step, the input embedding excepted, + KV bytes a step must read)
  over the device-to-device copy bandwidth measured in this process; ratio = TPOT / roofline.

Configurations: ``hf_eager`` (DynamicCache, SDPA, cuDNN SDPA off), ``hf_eager_cudnn`` (on),
``hf_static`` (StaticCache, decode compiled with ``mode="reduce-overhead"``, prefill eager as
``generate`` does), ``kvpass_dynamic:<policy>`` (the DynamicCache path), and ``<policy>`` (a kvpass
policy on a SlotCache, ``mode="reduce-overhead"``; ``autotune:<policy>`` the same with ``mode="max-autotune"``,
for a comparison in one process); ``<policy>@k=v@k=v`` sets parameters beyond the
budget (``asl@layer=2`` forces the selection layer: on random weights the adaptive rule may not fire).

    python bench/bench_decode_step.py --layers 8 --batch 1 --contexts 32768,131072 --out results.json

Results: every ``bench/results/decode_step_*`` folder, ``dynamic_cache_case7_h100_2026-11-25/``
(``kvpass_dynamic:`` rows), ``h2o_h200_2026-11-26/`` and the kvpass rows of ``kvpress_h200_2026-11-26/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from llama_shape import copy_bandwidth, llama8b_config, random_llama  # noqa: E402

WARMUP = 8
PROFILE, PROFILE_STEPS = False, 8  # --profile: a kernel table of 8 more steps per row
MODE = "reduce-overhead"  # --mode: the torch.compile mode of the compiled rows (CUDA graphs in both choices)


def llama8b(layers: int):
    return random_llama(llama8b_config(layers), "cuda", torch.bfloat16)


def kv_bytes(cache) -> int:
    if isinstance(cache, kvpass.SlotCache):
        return cache.kv_bytes()
    return sum(
        t.numel() * t.element_size()
        for lay in cache.layers
        for t in (lay.keys, lay.values)
        if isinstance(t, torch.Tensor)
    )


@torch.no_grad()
def run(prefill, step, cache_fn, ids, steps):
    """Two prefills (the first compiles), warm-up steps, then ``steps`` timed steps."""
    cache = cache_fn()
    prefill(ids, cache)
    del cache
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cache = cache_fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    logits = prefill(ids, cache)
    torch.cuda.synchronize()
    ttft = time.perf_counter() - t
    nxt = logits.argmax(-1, keepdim=True)
    pos = torch.full((ids.shape[0], 1), ids.shape[1], device="cuda", dtype=torch.long)
    for i in range(WARMUP + steps):
        if i == WARMUP:
            torch.cuda.synchronize()
            t = time.perf_counter()
        nxt = step(nxt, pos, cache).argmax(-1, keepdim=True)
        pos = pos + 1
    torch.cuda.synchronize()
    tpot = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated()
    kernels = profile_steps(step, nxt, pos, cache) if PROFILE else None
    return ttft, tpot, peak, kv_bytes(cache), kernels


def device_kernels(call) -> list[tuple[str, float, int]]:
    """The device kernels ``call()`` launches (CUDA-graph replays included), the longest first: ``(name, total µs,
    launches)`` per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((e.key[:120], us, e.count))
    return sorted(rows, key=lambda r: -r[1])


def profile_steps(step, nxt, pos, cache, steps: int = PROFILE_STEPS, top: int = 24) -> list:
    """Device kernels of ``steps`` more steps (CUDA-graph replays included): the ``top`` by time, per step."""

    def run():
        nonlocal nxt, pos
        for _ in range(steps):
            nxt = step(nxt, pos, cache).argmax(-1, keepdim=True)
            pos = pos + 1

    rows = [
        {"kernel": name, "us_per_step": us / steps, "calls_per_step": n / steps} for name, us, n in device_kernels(run)
    ]
    total = sum(r["us_per_step"] for r in rows)
    return [
        {"kernel": "(all kernels)", "us_per_step": total, "calls_per_step": sum(r["calls_per_step"] for r in rows)}
    ] + rows[:top]


def policy_of(name: str) -> tuple[str, dict]:
    """``kvpass_dynamic:asl@layer=2`` -> ``("asl", {"layer": 2})``."""
    policy, *extra = name.split(":", 1)[-1].split("@")
    return policy, {k: (float(v) if "." in v else int(v)) for k, v in (e.split("=", 1) for e in extra)}


def read_entries(name: str, ctx: int, budget: int, layers: int, decoded: int = 0) -> float:
    """K/V entries a decode step must read per layer (mean over layers) at the policy's defaults, after
    ``decoded`` tokens past the ``ctx``-token prompt (0 unless ``--decode-to``: the few warm-up tokens are
    left out, as in the earlier result files)."""
    policy = policy_of(name)[0]
    seq = ctx + decoded
    if policy in ("full", "art", "asl_fullkv") or name.startswith("hf_"):  # asl_fullkv: bound by all layers
        return seq
    if policy == "quest":  # dense layers read all; the others budget + the current page + the
        from kvpass.policies.pages.quest import Quest  # page bounds (kmin + kmax: 2/16 of the keys = seq/16 entries)

        dense = min(layers, Quest(budget=budget).dense_layers)
        return (dense * seq + (layers - dense) * (min(seq, budget + 16) + seq / 16)) / layers
    if policy == "raas":  # the prompt's pages are never evicted, decode tokens live in budget/16 + 1
        pool = ctx + min(decoded, budget + 16)  # pages; the page bounds are read to stamp
        return pool + pool / 16
    if policy == "streamingllm":  # a ring of the budget
        return min(seq, budget)
    if policy == "h2o":  # budget + 1 slots, and one fp32 score per slot read and written (8 of 512 bytes)
        return min(seq, budget + 1) * (1 + 8 / 512)
    if policy == "duoattention":  # retrieval heads read everything, streaming heads their sinks and window
        from kvpass.policies.prefill.duoattention import DuoAttention

        p = DuoAttention.__dataclass_fields__
        share, window = p["streaming"].default, p["sinks"].default + p["recent"].default
        return (1 - share) * seq + share * min(seq, window + 1)
    if policy == "pyramidkv":
        from kvpass.policies.prefill.pyramidkv import PyramidKV, pyramid

        p = PyramidKV(budget=budget)
        return sum(min(ctx, b) for b in pyramid(budget, p.window, layers, p.steepness)) / layers + decoded
    return min(ctx, budget) + decoded  # a prefill-time eviction, then every decoded token appended


def configs(model, args, ctx):
    b, n_new = args.batch, WARMUP + args.steps + 2 + (PROFILE_STEPS if PROFILE else 0)

    def hf_prefill(ids, cache):
        return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def hf_step(fwd):
        def step(nxt, pos, cache):
            torch.compiler.cudagraph_mark_step_begin()
            return fwd(input_ids=nxt, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
                :, -1
            ]

        return step

    dyn = lambda: tf.DynamicCache(config=model.config)  # noqa: E731
    for name in args.configs.split(","):
        torch._dynamo.reset()
        torch.backends.cuda.enable_cudnn_sdp(name == "hf_eager_cudnn")
        if name in ("hf_eager", "hf_eager_cudnn"):
            yield name, hf_prefill, hf_step(model.forward), dyn, None
        elif name == "hf_static":
            fwd = torch.compile(model.forward, mode=MODE, fullgraph=True)
            yield (
                name,
                hf_prefill,
                hf_step(fwd),
                (lambda: tf.StaticCache(config=model.config, max_cache_len=ctx + n_new)),
                None,
            )
        else:
            policy, extra = policy_of(name)
            params = {} if policy in ("full", "art") else {"budget": args.budget}
            be = kvpass.backend(policy, **params, **extra)
            if name.startswith("kvpass_dynamic:"):
                fwd = torch.compile(model.forward, backend=be, dynamic=True)
                cache_fn = dyn
            else:
                # dynamic=True: one prefill graph for every prompt length, whose causal mask kvpass can
                # check (a static 32k graph's mask is too large to check, and kept)
                mode = "max-autotune" if name.startswith("autotune:") else MODE
                fwd = torch.compile(model.forward, backend=be, mode=mode, dynamic=True)

                def cache_fn(be=be):
                    return kvpass.SlotCache(model, be, max_length=ctx + n_new, max_new_tokens=n_new, batch_size=b)

            def pre(ids, cache, fwd=fwd):
                return fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

            yield name, pre, hf_step(fwd), cache_fn, be


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--configs", default="hf_eager,hf_eager_cudnn,hf_static,full,snapkv,streamingllm,art")
    ap.add_argument("--out", required=True)
    ap.add_argument("--profile", action="store_true", help="add each row's device kernels per step (top 24)")
    ap.add_argument(
        "--decode-to",
        type=int,
        default=0,
        help="decode (untimed) until the timed steps end at this many tokens: a long generation "
        "after a short prompt, where decode-time eviction (raas, streamingllm) has evicted",
    )
    ap.add_argument(
        "--mode",
        default="reduce-overhead",
        choices=["reduce-overhead", "max-autotune"],
        help="torch.compile mode of hf_static and the kvpass rows (max-autotune: Inductor also "
        "times Triton templates against cuBLAS for every matmul)",
    )
    args = ap.parse_args()
    global PROFILE, MODE, WARMUP
    PROFILE, MODE = args.profile, args.mode
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    model = llama8b(args.layers)
    bw = copy_bandwidth()
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    cfg = model.config
    per_entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * args.batch
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": args.layers,
        "batch": args.batch,
        "budget": args.budget,
        "steps": args.steps,
        "mode": MODE,
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_bytes": weights,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for ctx in (int(c) for c in args.contexts.split(",")):
        # --decode-to: decode (untimed) until the timed steps end at that many tokens
        WARMUP = max(8, args.decode_to - ctx - args.steps)
        decoded = WARMUP + args.steps // 2 if args.decode_to else 0  # mean over the timed steps
        ids = torch.randint(
            10, 128000, (args.batch, ctx), device="cuda", generator=torch.Generator(device="cuda").manual_seed(ctx)
        )
        for name, pre, step, cache_fn, be in configs(model, args, ctx):
            t0 = time.perf_counter()
            try:
                ttft, tpot, peak, kvb, kernels = run(pre, step, cache_fn, ids, args.steps)
            except Exception as e:  # a row that fails is reported, the others go on
                row = {"config": name, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:400]}"}
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                torch.cuda.empty_cache()
                continue
            roof = (weights + per_entry * read_entries(name, ctx, args.budget, args.layers, decoded)) / bw
            row = {
                "config": name,
                "context": ctx,
                "decoded_before_timing": WARMUP,
                "ttft_s": ttft,
                "tpot_ms": tpot * 1e3,
                "peak_GiB": peak / 2**30,
                "kv_GiB": kvb / 2**30,
                "roofline_ms": roof * 1e3,
                "ratio": tpot / roof,
                "wall_s": time.perf_counter() - t0,
            }
            if be is not None:
                row["graphs"] = [(r.phase, r.cudagraphs) for r in be.reports]
                row["plans"] = be.plans()
            print(json.dumps(row), flush=True)
            if kernels:
                row["kernels"] = kernels
                print(
                    "  "
                    + "\n  ".join(
                        f"{k['us_per_step']:8.1f} us {k['calls_per_step']:5.1f}x {k['kernel'][:90]}"
                        for k in kernels[:12]
                    ),
                    flush=True,
                )
            result["rows"].append(row)
            out.write_text(json.dumps(result, indent=1))
            torch.cuda.empty_cache()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
