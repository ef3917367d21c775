"""The kvpass decode kernel reading everything (ART off) against PyTorch SDPA.

Every decode-time policy reads the cache through this kernel, so it must not be slower than SDPA where it
reads what SDPA reads; this measures its time and achieved bandwidth per (batch, context).

Shapes: Hq=32, Hkv=8, D=128, bf16, one query token, batch 1/8/32/64/128, context 4k/16k/32k/128k.
The SDPA baseline is the faster of two exact forms, timed in the same process:
``sdpa(q, k, v, enable_gqa=True)`` and the grouped form that folds each KV group's query heads into
the query length (``q.view(B, Hkv, G, D)``), which lets the flash kernel read K/V once per group.
Achieved bandwidth counts the bytes of K, V, q and the output once. Times are CUDA-graph replays
(GPU time; no Python launch overhead on either side). A small sweep of block size and
warps runs first and is reported too.

    python bench/bench_decode_kernel.py --out bench/results
    # a tensor-parallel rank's share of the 8B shape (16 query heads, 4 KV heads), the split cap as it was
    python bench/bench_decode_kernel.py --heads 16,4 --batches 1 --contexts 131072 --max-splits 64 --no-sweep
    # ragged heads (per-head budgets) against the uniform layout at the same total: ragged_heads.json/.md
    python bench/bench_decode_kernel.py --ragged --batches 1,16 --contexts 32768,131072 --no-sweep
    # ... and the ragged rows at 2x and 4x the kernel's split count (K.RAGGED_SPLIT_SCALE)
    python bench/bench_decode_kernel.py --ragged --ragged-scales 1,2,4 --batches 1,16 --contexts 32768,131072 --no-sweep
    # ... and with 1 and 4 splits at least per head slot (K.RAGGED_MIN_HEAD_SPLITS) at budget-sized heads, batch 55
    python bench/bench_decode_kernel.py --ragged --ragged-floors 1,4 --batches 16,55 --contexts 2048,32768 --no-sweep

Results: ``bench/results/decode_kernel.md`` / ``.json``; ``--ragged``: ``bench/results/gpu_h100_2026-12-05/``
(``ragged_heads.*``, and ``proportional_splits/``); the split counts of a tensor-parallel rank's share
(``--heads 16,4``) and of the whole shape: ``bench/results/tp_h200x2_2026-11-28/`` (``s56_K2/``, ``s56_K3/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpass.kernels import decode_attention as K  # noqa: E402

HQ, HKV, D = 32, 8, 128


def bench(fn) -> float:
    """Median GPU time of one call, replayed from a CUDA graph so that Python launch overhead
    (different for a Triton launcher and an ATen call) is not measured for either side."""
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e-3


def sdpa_time(q, k, v) -> tuple[float, str]:
    b = q.shape[0]
    forms = {
        "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "grouped": lambda: F.scaled_dot_product_attention(q.view(b, HKV, HQ // HKV, D), k, v),
    }
    times = {name: bench(fn) for name, fn in forms.items()}
    best = min(times, key=times.get)
    return times[best], best


def main() -> None:
    global HQ, HKV
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="4096,16384,32768,131072")
    ap.add_argument("--heads", default=f"{HQ},{HKV}", help="query heads,KV heads")
    ap.add_argument("--max-splits", type=int, default=K.MAX_SPLITS, help="the kernel's split cap (K.MAX_SPLITS)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block/warps sweep: block 128, 4 warps")
    ap.add_argument(
        "--ragged",
        action="store_true",
        help="time ragged heads (one pool a row, per-head ranges) against the uniform layout holding "
        "the same entries; contexts are the mean entries per KV head",
    )
    ap.add_argument(
        "--ragged-scales",
        default="1",
        help="with --ragged: the ragged rows' split counts to time, as multiples of the kernel's "
        "(K.RAGGED_SPLIT_SCALE), e.g. 1,2,4",
    )
    ap.add_argument(
        "--ragged-floors",
        default=str(K.RAGGED_MIN_HEAD_SPLITS),
        help="with --ragged: the floors of splits per head slot to time (K.RAGGED_MIN_HEAD_SPLITS), e.g. 1,4: "
        "at budget-sized heads and large batches the floor leaves most splits empty",
    )
    args = ap.parse_args()
    HQ, HKV = (int(x) for x in args.heads.split(","))
    K.MAX_SPLITS = args.max_splits
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    free = torch.cuda.mem_get_info()[0]

    def make(b, n):
        q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16)
        k = torch.empty(b, HKV, n, D, device=dev, dtype=torch.bfloat16).normal_()
        v = torch.empty(b, HKV, n, D, device=dev, dtype=torch.bfloat16).normal_()
        return q, k, v

    sweep = []
    for b, n in () if args.no_sweep else ((1, 32768), (8, 16384), (64, 16384)):
        q, k, v = make(b, n)
        for block in (32, 64, 128):
            for warps in (4, 8):
                t = bench(lambda: K.decode_attention_triton(q, k, v, block=block, num_warps=warps))
                sweep.append(dict(batch=b, context=n, block=block, num_warps=warps, ms=t * 1e3))
                print(f"sweep b={b} n={n} block={block} warps={warps}: {t * 1e3:.3f} ms", flush=True)
        del q, k, v
    best = (
        min(
            sweep,
            key=lambda r: sum(s["ms"] for s in sweep if (s["block"], s["num_warps"]) == (r["block"], r["num_warps"])),
        )
        if sweep
        else dict(block=128, num_warps=4)
    )
    block, warps = best["block"], best["num_warps"]

    if args.ragged:
        return ragged(args, dev, props, block, warps)
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            kv_bytes = 2 * b * HKV * n * D * 2
            if kv_bytes > 0.8 * free:
                rows.append(dict(batch=b, context=n, skipped=f"K+V need {kv_bytes / 2**30:.0f} GiB"))
                continue
            q, k, v = make(b, n)
            t_sdpa, form = sdpa_time(q, k, v)
            t_ours = bench(lambda: K.decode_attention_triton(q, k, v, block=block, num_warps=warps))
            out, _ = K.decode_attention_triton(q, k, v, block=block, num_warps=warps)
            ref = F.scaled_dot_product_attention(q.view(b, HKV, HQ // HKV, D), k, v).view(b, HQ, 1, D)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            moved = kv_bytes + 2 * b * HQ * D * 2
            splits = int(K.num_splits(b * HKV, dev))
            rows.append(
                dict(
                    batch=b,
                    context=n,
                    sdpa_ms=t_sdpa * 1e3,
                    sdpa_form=form,
                    kvpass_ms=t_ours * 1e3,
                    ratio_vs_sdpa=t_sdpa / t_ours,
                    kvpass_tbps=moved / t_ours / 1e12,
                    sdpa_tbps=moved / t_sdpa / 1e12,
                    splits=splits,
                    rel_err=err,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            del q, k, v
            torch.cuda.empty_cache()

    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        shapes=f"Hq={HQ} Hkv={HKV} D={D} bf16",
        max_splits=K.MAX_SPLITS,
        block=block,
        num_warps=warps,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_kernel.json").write_text(json.dumps(dict(meta=meta, sweep=sweep, rows=rows), indent=2))
    lines = [
        f"# Decode kernel (ART off) vs PyTorch SDPA, {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['shapes']}, block {block}, {warps} warps; "
        "ratio = SDPA time / kvpass time (>1: kvpass faster). Target: >= 0.9 at batch >= 8, >= 0.7 at batch 1.",
        "",
        "| batch | context | SDPA ms (form) | kvpass ms | ratio | kvpass TB/s | SDPA TB/s | splits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['sdpa_ms']:.3f} ({r['sdpa_form']}) | {r['kvpass_ms']:.3f} | "
            f"{r['ratio_vs_sdpa']:.2f} | {r['kvpass_tbps']:.2f} | {r['sdpa_tbps']:.2f} | {r['splits']} |"
        )
    (args.out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def skews(n: int) -> dict[str, list[int]]:
    """Per-KV-head lengths with mean ``n``: even, and skewed (one head at half the row's total, one at a floor of
    n/32, the rest sharing what is left), as AdaKV's allocation leaves them."""
    floor = max(n // 32, 1)
    heavy = HKV * n // 2
    rest = (HKV * n - heavy - floor) // (HKV - 2)
    skewed = [heavy, floor] + [rest] * (HKV - 2)
    skewed[-1] += HKV * n - sum(skewed)
    return {"even": [n] * HKV, "skewed": skewed}


def ragged(args, dev, props, block: int, warps: int) -> None:
    """Ragged heads against the uniform layout: bytes of the kept entries read per second. ``uniform`` is
    ``[B, H_kv, n, D]`` (every head n entries), ``uniform_len`` the same with a per-head ``kv_len``; the ragged
    rows hold one ``[B, 1, H_kv x n, D]`` pool a row with ``kv_start``/``kv_len`` per head, even or skewed."""
    rows, scales = [], [int(x) for x in args.ragged_scales.split(",")]
    floors = [int(x) for x in args.ragged_floors.split(",")]
    settings = [(s, f) for s in scales for f in floors]
    for n in [int(x) for x in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16)
            k = torch.empty(b, HKV, n, D, device=dev, dtype=torch.bfloat16).normal_()
            v = torch.empty(b, HKV, n, D, device=dev, dtype=torch.bfloat16).normal_()
            full = torch.full((b, HKV), n, device=dev, dtype=torch.int32)
            forms = {"uniform": dict(k=k, v=v), "uniform_len": dict(k=k, v=v, kv_len=full)}
            pk, pv = k.reshape(b, 1, HKV * n, D), v.reshape(b, 1, HKV * n, D)
            for scale, floor in settings:
                for name, lengths in skews(n).items():
                    lens = torch.tensor(lengths, device=dev, dtype=torch.int32)
                    start = torch.cumsum(lens, 0) - lens
                    tag = (f"@{scale}" if len(scales) > 1 else "") + (f"@floor{floor}" if len(floors) > 1 else "")
                    forms[f"ragged_{name}{tag}"] = dict(
                        k=pk,
                        v=pv,
                        kv_len=lens.expand(b, HKV).contiguous(),
                        kv_start=start.to(torch.int32).expand(b, HKV).contiguous(),
                        scale=scale,
                        floor=floor,
                    )
            base = None
            for name, kw in forms.items():
                K.RAGGED_SPLIT_SCALE = kw.pop("scale", 1)
                K.RAGGED_MIN_HEAD_SPLITS = kw.pop("floor", floors[0])
                t = bench(lambda: K.decode_attention_triton(q, block=block, num_warps=warps, **kw))
                moved = 2 * b * HKV * n * D * 2 + 2 * b * HQ * D * 2
                base = base or t
                rows.append(
                    dict(
                        batch=b,
                        mean_per_head=n,
                        form=name,
                        ms=t * 1e3,
                        tbps=moved / t / 1e12,
                        over_uniform=t / base,
                        split_scale=K.RAGGED_SPLIT_SCALE,
                        min_head_splits=K.RAGGED_MIN_HEAD_SPLITS,
                        lengths=skews(n)[name.split("_")[1].split("@")[0]] if name.startswith("ragged") else [n] * HKV,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
            del q, k, v, pk, pv, forms
            torch.cuda.empty_cache()
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=props.name,
        torch=torch.__version__,
        triton=triton.__version__,
        shapes=f"Hq={HQ} Hkv={HKV} D={D} bf16",
        block=block,
        num_warps=warps,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ragged_heads.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [
        f"# Ragged heads against the uniform layout, {meta['gpu']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['shapes']}; the same total entries in every "
        "form of a row; over_uniform = time / the uniform layout's time.",
        "",
        "| batch | mean per head | form | ms | TB/s | over uniform |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['mean_per_head']} | {r['form']} | {r['ms']:.3f} | {r['tbps']:.2f} | "
        f"{r['over_uniform']:.2f} |"
        for r in rows
    ]
    (args.out / "ragged_heads.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
