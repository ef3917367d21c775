"""Every policy's prefill peak memory against ``full``'s, and its time to the first token.

A policy's prefill (scoring, eviction) must not need much more memory or time than ``full``'s, or it costs
batch size at a fixed memory; this measures both through ``generate``.

One process, one GPU, the random-weight Llama-3.1-8B shape (``--layers`` of its 32, bf16). Per policy:
``kvpass.compile(model, policy, budget=...)``, then per ``--lengths`` prompt ``generate(ids, max_new_tokens=1)``
twice, as a user calls it (the SlotCache allocated by ``generate`` is counted: it is what the user pays); the
first call compiles and warms, the second is measured: ``ttft_s`` (its wall time) and ``peak_gib`` (the
allocator's peak during it, weights included) and ``over_weights_gib`` (the peak less the weights). Each row
gives both as a ratio of ``full``'s at the same length (run ``full`` first). The targets: peak <= 1.1x ``full``'s,
h2o's scoring (its TTFT less ``full``'s) <= 0.5x ``full``'s TTFT. cuDNN SDPA off.

    python bench/bench_prefill.py --layers 8 --lengths 32768,131072 --policies full,snapkv,h2o,asl --out p.json

With ``--profile``, one more call per row runs under torch's profiler: the device kernels of that prefill, the
30 longest (``kernels``), to show where a prefill above ``full``'s spends its time.

Results: the prefill files of ``bench/results/throughput_2026-11-27/`` (``*_prefill_*.json``).
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
from bench_decode_step import device_kernels  # noqa: E402
from bench_fastpath import gen, prompt, timed  # noqa: E402
from llama_shape import llama8b_config, policy_params, random_llama, uncompiled  # noqa: E402

GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--policies", default="full,snapkv,pyramidkv,streamingllm,h2o,raas,quest,asl")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--prefill-compiler", default=None, help="kvpass.compile's prefill_compiler (default: Inductor)")
    ap.add_argument("--profile", action="store_true", help="the device kernels of one more prefill per row")
    ap.add_argument("--out", default="prefill.json")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = random_llama(llama8b_config(args.layers), "cuda", torch.bfloat16)
    model.generation_config.pad_token_id = 0
    weights = torch.cuda.memory_allocated()
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": args.layers,
        "shape": "Llama-3.1-8B (random weights), bf16, batch 1",
        "budget": args.budget,
        "weights_gib": round(weights / GIB, 2),
        "cudnn_sdpa": False,
    }
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, full = [], {}
    for policy in args.policies.split(","):
        uncompiled(model)  # the previous policy's compile undone, its caches freed
        params = policy_params(policy, args.budget, model.config)
        try:
            kvpass.compile(model, policy, prefill_compiler=args.prefill_compiler, **params)
            for n in lengths:
                ids = prompt(n)
                warm, _ = timed(lambda: gen(model, ids, 1))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                ttft, _ = timed(lambda: gen(model, ids, 1))
                peak = torch.cuda.max_memory_allocated()
                row = {
                    "policy": policy,
                    "params": {
                        k: v if isinstance(v, (int, float, str)) else type(v).__name__ for k, v in params.items()
                    },
                    "context": n,
                    "ttft_s": round(ttft, 3),
                    "first_call_s": round(warm, 2),
                    "peak_gib": round(peak / GIB, 2),
                    "over_weights_gib": round((peak - weights) / GIB, 2),
                }
                if policy == "full":
                    full[n] = row
                elif n in full:
                    row["peak_over_full"] = round(peak / GIB / full[n]["peak_gib"], 3)
                    row["ttft_over_full"] = round(ttft / full[n]["ttft_s"], 3)
                    row["extra_over_full_ttft"] = round((ttft - full[n]["ttft_s"]) / full[n]["ttft_s"], 3)
                if args.profile:
                    row["kernels"] = kernel_table(lambda: gen(model, ids, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        except Exception as e:  # one policy's failure (out of memory, say) is a row, the others still run
            rows.append({"policy": policy, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def kernel_table(call, top: int = 30) -> list:
    """The device kernels of one ``call``: all of them summed, then the ``top`` longest (ms, launches)."""
    rows = [{"kernel": name, "ms": round(us / 1e3, 2), "launches": n} for name, us, n in device_kernels(call)]
    total = {
        "kernel": "(all kernels)",
        "ms": round(sum(r["ms"] for r in rows), 1),
        "launches": sum(r["launches"] for r in rows),
    }
    return [total] + rows[:top]


if __name__ == "__main__":
    main()
