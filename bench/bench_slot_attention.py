"""Chunk fusion's recompute attention (``kvpass::attention_slots``): the Triton slot-attention kernel
against the SDPA path it replaces.

The recompute pass is the largest part of a chunk-fusion prefill (``bench_a3.py`` reports its share), so this
kernel sets much of chunk fusion's speedup over a full prefill.

Shape: Llama-3-8B attention (H=32, H_kv=8, D=128), bf16, batch 1. For each cache length Lk the
recompute pass has Lq = ceil(0.15 * Lk) + 32 query rows: 15% of the earlier positions, distinct,
sorted, drawn at random, then the last 32 positions (the question). Timed, per call of one layer:

* ``sdpa_masked``: the former CUDA implementation, written out here: K/V repeated to every query
  head, one additive ``[B, 1, rows, Lk]`` mask from the positions, SDPA's fused masked kernels;
* ``slot_triton``: ``kvpass.kernels.slot_attention.slot_attention_triton`` for a small grid of
  (block_m, block_n, num_warps, num_stages); the best configuration (least total time over the
  contexts) is checked against the fp32 reference on a slice of rows (first and last 256).

Times: CUDA events around each call, after warm-up; the median of ``--reps`` calls. TFLOP/s counts
the useful work only: 4 * H * D * sum over rows of the visible keys (q_pos + 1).

    python bench/bench_slot_attention.py --out bench/results/slot_attention_h200

Results: ``bench/results/slot_attention_h200/``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpass.kernels import slot_attention as S  # noqa: E402

H, HKV, D = 32, 8, 128
RATIO, QUESTION = 0.15, 32
CONFIGS = [  # (block_m, block_n, num_warps, num_stages)
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (128, 32, 8, 3),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
]
MASK_ELEMENTS = 1 << 28  # as the former path: mask entries one SDPA call materialises


def sdpa_masked(q, k, v, q_pos, scale):
    """The former ``_attention_slots_cuda`` (no softcap): one additive mask shared by all heads, K/V
    repeated to the query heads, rows chunked so one mask holds at most MASK_ELEMENTS entries."""
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if h != hkv:
        k = k[:, :, None].expand(b, hkv, h // hkv, lk, k.shape[-1]).reshape(b, h, lk, k.shape[-1])
        v = v[:, :, None].expand(b, hkv, h // hkv, lk, v.shape[-1]).reshape(b, h, lk, v.shape[-1])
    slots = torch.arange(lk, device=q.device)
    rows = max(1, MASK_ELEMENTS // max(1, b * lk))
    outs = []
    for s in range(0, lq, rows):
        visible = slots[None, None, :] <= q_pos[:, s : s + rows, None]
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        outs.append(F.scaled_dot_product_attention(q[:, :, s : s + rows], k, v, attn_mask=bias[:, None], scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.contiguous()


def time_ms(fn, reps: int, warmup: int) -> float:
    """Median of ``reps`` calls, each between two CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def make_case(lk: int, gen: torch.Generator, dev):
    lq = math.ceil(RATIO * lk) + QUESTION
    doc = torch.randperm(lk - QUESTION, generator=gen)[: lq - QUESTION].sort().values
    q_pos = torch.cat([doc, torch.arange(lk - QUESTION, lk)])[None].to(dev)
    q = torch.randn(1, H, lq, D, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(1, HKV, lk, D, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(1, HKV, lk, D, generator=gen).to(dev, torch.bfloat16)
    return q, k, v, q_pos


def max_err(out, q, k, v, q_pos, scale) -> float:
    """Max abs error against the fp32 reference on the first and last 256 rows (the reference
    materialises [H, rows, Lk] fp32 scores)."""
    lq = q.shape[2]
    idx = torch.unique(torch.cat([torch.arange(min(256, lq)), torch.arange(max(0, lq - 256), lq)])).to(q.device)
    want = S.slot_attention_reference(q[:, :, idx].float(), k.float(), v.float(), q_pos[:, idx], scale)
    return (out[:, :, idx].float() - want).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/slot_attention_h200"))
    ap.add_argument("--contexts", default="4192,8288,16480,32864")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    scale = D**-0.5
    contexts = [int(x) for x in args.contexts.split(",")]
    cases = {lk: make_case(lk, gen, dev) for lk in contexts}

    rows, sweep = [], []
    for lk, (q, k, v, q_pos) in cases.items():
        lq = q.shape[2]
        flops = 4 * H * D * float((q_pos.clamp(-1, lk - 1) + 1).sum())
        t_old = time_ms(lambda: sdpa_masked(q, k, v, q_pos, scale), args.reps, args.warmup)
        row = dict(lk=lk, lq=lq, sdpa_masked_ms=t_old, sdpa_masked_tflops=flops / t_old / 1e9, configs={})
        for cfg in CONFIGS:
            bm, bn, w, st = cfg
            name = f"{bm}x{bn} w{w} s{st}"
            try:
                t = time_ms(
                    lambda: S.slot_attention_triton(
                        q, k, v, q_pos, scale, block_m=bm, block_n=bn, num_warps=w, num_stages=st
                    ),
                    args.reps,
                    args.warmup,
                )
            except Exception as exc:  # e.g. out of shared memory for one configuration
                print(f"Lk={lk} {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                continue
            row["configs"][name] = t
            sweep.append(dict(lk=lk, block_m=bm, block_n=bn, num_warps=w, num_stages=st, ms=t))
            print(f"Lk={lk} Lq={lq} {name}: {t:.3f} ms (sdpa_masked {t_old:.3f} ms)", flush=True)
        rows.append(row)

    totals = {}
    for name in CONFIGS:
        key = f"{name[0]}x{name[1]} w{name[2]} s{name[3]}"
        if all(key in r["configs"] for r in rows):
            totals[key] = sum(r["configs"][key] for r in rows)
    best_name = min(totals, key=totals.get)
    best = CONFIGS[[f"{c[0]}x{c[1]} w{c[2]} s{c[3]}" for c in CONFIGS].index(best_name)]
    default = S.default_config(D, torch.bfloat16)
    default_name = f"{default['block_m']}x{default['block_n']} w{default['num_warps']} s{default['num_stages']}"
    for r, (lk, (q, k, v, q_pos)) in zip(rows, cases.items()):
        flops = 4 * H * D * float((q_pos.clamp(-1, lk - 1) + 1).sum())
        t = r["configs"][best_name]
        out = S.slot_attention_triton(
            q, k, v, q_pos, scale, block_m=best[0], block_n=best[1], num_warps=best[2], num_stages=best[3]
        )
        r.update(
            best_ms=t,
            best_tflops=flops / t / 1e9,
            speedup=r["sdpa_masked_ms"] / t,
            default_ms=r["configs"].get(default_name),
            best_max_abs_err=max_err(out, q, k, v, q_pos, scale),
            sdpa_masked_max_abs_err=max_err(sdpa_masked(q, k, v, q_pos, scale), q, k, v, q_pos, scale),
            per_context_best=min(r["configs"], key=r["configs"].get),
        )
        torch.cuda.empty_cache()

    props = torch.cuda.get_device_properties(dev)
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        shape=f"B=1 H={H} H_kv={HKV} D={D} bf16, Lq = ceil({RATIO} Lk) + {QUESTION}",
        reps=args.reps,
        warmup=args.warmup,
        best_config=best_name,
        default_config=default_name,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "slot_attention.json").write_text(json.dumps(dict(meta=meta, rows=rows, sweep=sweep), indent=2))
    lines = [
        f"# Slot attention (chunk-fusion recompute) vs masked SDPA, {meta['gpu']}, {meta['date']}",
        "",
        (
            f"torch {meta['torch']}, triton {meta['triton']}, {meta['shape']}; median of {args.reps} calls "
            f"(CUDA events). Best config over all contexts: **{best_name}** (kernel default: {default_name}). "
            "TFLOP/s counts visible keys only. Error: max |out - fp32 reference| on the first and last 256 rows."
        ),
        "",
        (
            "| Lk | Lq | sdpa_masked ms | slot_triton ms (best) | speedup | default cfg ms | best cfg here "
            "| TFLOP/s sdpa / triton | max err triton / sdpa |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dflt = f"{r['default_ms']:.3f}" if r["default_ms"] is not None else "-"
        lines.append(
            f"| {r['lk']} | {r['lq']} | {r['sdpa_masked_ms']:.3f} | {r['best_ms']:.3f} | {r['speedup']:.1f}x "
            f"| {dflt} | {r['per_context_best']} | {r['sdpa_masked_tflops']:.0f} / {r['best_tflops']:.0f} "
            f"| {r['best_max_abs_err']:.2e} / {r['sdpa_masked_max_abs_err']:.2e} |"
        )
    names = [f"{c[0]}x{c[1]} w{c[2]} s{c[3]}" for c in CONFIGS]
    lines += [
        "",
        "## Sweep (ms)",
        "",
        "| config | " + " | ".join(f"Lk={r['lk']}" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for name in names:
        cells = [f"{r['configs'][name]:.3f}" if name in r["configs"] else "failed" for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (args.out / "slot_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
