"""Where a SlotCache prefill spends its time and memory (written when a SlotCache prefill
took 3x HF's TTFT at 32k and 77 GiB at 128k).

One prefill of the 8B shape (``--layers``) on a SlotCache, compiled as the decode benchmark does: the
CUDA kernels by total time (torch.profiler) and the largest live allocations at the peak with the
Python frames that made them (the allocator's memory history), and every allocation of 64 MiB or more
alive when the traced peak was reached. Prints one JSON object.

    python bench/probes/diag_prefill.py --layers 8 --context 32768 --policy full
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kvpass  # noqa: E402
from bench_decode_step import llama8b  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True)")
    ap.add_argument(
        "--generate",
        action="store_true",
        help="kvpass.compile and generate(ids, max_new_tokens=1), as a user calls it, instead of "
        "the forward compiled by hand (which at 128k builds the model's L x L masks)",
    )
    args = ap.parse_args()
    model = llama8b(args.layers)
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the benchmark's kvpass rows
    params = {} if args.policy in ("full", "art") else {"budget": args.budget}
    ids = torch.randint(10, 128000, (1, args.context), device="cuda")
    if args.generate:
        kvpass.compile(model, args.policy, **params)

        def prefill():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
    else:
        be = kvpass.backend(args.policy, **params)
        fwd = torch.compile(model.forward, backend=be, mode="reduce-overhead", dynamic=args.dynamic or None)

        def prefill():
            cache = kvpass.SlotCache(model, be, max_length=args.context + 64, max_new_tokens=64)
            with torch.no_grad():
                fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()

    prefill()  # compiles
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    t = time.perf_counter()
    prefill()
    wall = time.perf_counter() - t
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    allocs, live, total, top, at_peak = [], {}, 0, 0, []
    for trace in snap.get("device_traces", [[]])[0]:  # replayed: what was alive when the peak was reached
        size, action = trace.get("size", 0), trace.get("action")
        if action == "alloc":
            frames = [
                f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
                for f in trace.get("frames", [])
                if f["filename"].endswith(".py")
                and ("site-packages/torch/" not in f["filename"] or "transformers" in f["filename"])
            ]
            if size >= 256 << 20:
                allocs.append({"GiB": size / 2**30, "frames": frames[:8]})
            live[trace["addr"]] = (size, frames[:6])
            total += size
            if total > top:
                top = total
                at_peak = [v for v in live.values() if v[0] >= 64 << 20]
        elif action in ("free_requested", "free") and trace.get("addr") in live:
            total -= live.pop(trace["addr"])[0]
    allocs.sort(key=lambda a: -a["GiB"])
    at_peak = [
        {"GiB": round(size / 2**30, 3), "frames": frames} for size, frames in sorted(at_peak, key=lambda v: -v[0])
    ]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        prefill()
    kernels = [
        {"name": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]
    ]
    print(
        json.dumps(
            {
                "policy": args.policy,
                "context": args.context,
                "layers": args.layers,
                "wall_s": wall,
                "peak_over_base_GiB": (torch.cuda.max_memory_allocated() - base) / 2**30,
                "traced_peak_GiB": top / 2**30,
                "live_at_peak_GiB": sum(a["GiB"] for a in at_peak),
                "live_at_peak": at_peak[:40],
                "largest_allocs": allocs[:12],
                "kernels": kernels,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
