"""Time the small per-layer kernels of the decode step at batch-1 shapes, one JSON line per variant.

* ``_kvpass_art_scan`` (ART's parallel horizon: 16 parts merged in order) by warps and prefetch;
* ``kvpass::top_pages`` (quest's page choice) by warps, beside ``torch.topk`` + sort, the step it replaced;
* ``kvpass::raas_stamp`` (raas's per-layer page-table update, two launches) by the bounds kernel's pages per
  program and warps, with and without its partial log-sum-exps (``parts``), at 32k and 128k pools (batch 1)
  and 32k at batch 16.

Each time is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), so launch cost is
left out; shapes are Llama-3.1-8B's (32 query heads, 8 KV heads, head_dim 128).

    python bench/probes/tune_small_kernels.py --out results.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench_cudagraph

from kvpass.kernels import decode_attention as DA
from kvpass.kernels import raas_stamp as RS
from kvpass.kernels.top_pages import top_pages_reference, top_pages_triton


def scan_rows(out, b=1, h=32, hkv=8, d=128, steps=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_parts = steps + 1 + 8
    acc = torch.randn(b, h, n_parts, d, device="cuda", generator=g)
    m = torch.randn(b, h, n_parts, device="cuda", generator=g)
    denom = torch.rand(b, h, n_parts, device="cuda", generator=g) + 1
    visited = torch.ones(b, hkv, n_parts, dtype=torch.int32, device="cuda")
    stopped = torch.zeros(b, hkv, dtype=torch.int32, device="cuda")
    ref = None
    fill_us = do_bench_cudagraph(lambda: visited.fill_(1)) * 1e3  # each timed run refills the counts first
    for prefetch in (False, True):
        for warps in (1, 2, 4, 8):

            def run():
                visited.fill_(1)
                DA._kvpass_art_scan[(b, hkv)](
                    acc,
                    m,
                    denom,
                    visited,
                    stopped,
                    1e-5,
                    1e-3,
                    5,
                    steps,
                    n_parts,
                    GROUP=h // hkv,
                    G_PAD=DA.pow2(h // hkv),
                    D=d,
                    D_PAD=DA.pow2(d),
                    PROBE_STRIDE=1,
                    S_PAD=DA.pow2(steps, 1),
                    PREFETCH=prefetch,
                    num_warps=warps,
                )

            run()
            got = acc[:, :, steps].clone()
            if ref is None:
                ref = got
            same = bool(torch.equal(got, ref))
            us = do_bench_cudagraph(run) * 1e3
            row = dict(
                kernel="art_scan",
                b=b,
                hkv=hkv,
                steps=steps,
                prefetch=prefetch,
                warps=warps,
                us=round(us - fill_us, 2),
                same_as_first=same,
            )
            print(json.dumps(row), flush=True)
            out.append(row)


def top_rows(out):
    for rows, pages, top in ((8, 2048, 128), (8, 8192, 128), (128, 2048, 128)):
        g = torch.Generator(device="cuda").manual_seed(pages)
        ub = torch.randn(rows, pages, device="cuda", generator=g)

        def topk():
            val, idx = ub.topk(top, dim=-1)
            return torch.where(val > float("-inf"), idx, pages).sort(-1).values

        row = dict(kernel="topk+sort", rows=rows, pages=pages, top=top, us=round(do_bench_cudagraph(topk) * 1e3, 2))
        print(json.dumps(row), flush=True)
        out.append(row)
        ref = top_pages_reference(ub, top)
        for warps in (1, 2, 4, 8, 16):
            same = bool(torch.equal(top_pages_triton(ub, top, num_warps=warps), ref))
            us = do_bench_cudagraph(lambda: top_pages_triton(ub, top, num_warps=warps)) * 1e3
            row = dict(
                kernel="top_pages", rows=rows, pages=pages, top=top, warps=warps, us=round(us, 2), equal_reference=same
            )
            print(json.dumps(row), flush=True)
            out.append(row)


def stamp_rows(out, h=32, hkv=8, d=128, window=129):
    for b, pages in ((1, 2177), (1, 8321), (16, 2177)):  # 32k / 128k prompts plus budget 2048's decode pages
        g = torch.Generator(device="cuda").manual_seed(pages)
        x = torch.randn(b, hkv, pages, d, device="cuda", generator=g).bfloat16()
        y = torch.randn(b, hkv, pages, d, device="cuda", generator=g).bfloat16()
        first = pages - window
        tables = dict(
            kmin=torch.minimum(x, y),
            kmax=torch.maximum(x, y),
            live=torch.ones(b, hkv, pages, dtype=torch.bool, device="cuda"),
            ts=torch.randint(0, 5000, (b, hkv, pages), device="cuda", generator=g),
            born=torch.arange(pages, device="cuda").repeat(b, hkv, 1),
            meta=torch.tensor([pages - 1, 3, first, -1], device="cuda").repeat(b, hkv, 1),
            seen=torch.full((b, hkv), 4999, device="cuda"),
        )
        q = (torch.randn(b, h, d, device="cuda", generator=g) * d**-0.5).bfloat16()
        args = (
            q,
            torch.randn(b, hkv, d, device="cuda", generator=g).bfloat16(),
            torch.tensor([[5000, 0, 0, 1 << 40, 0]] * b, device="cuda"),  # [B, 5] counts (kvpass.cache.slots)
        )
        from kvpass.kernels.page_bounds import (
            page_bounds_triton,
        )  # quest's bounds alone (no fold, no live mask)

        row = dict(
            kernel="page_bounds",
            b=b,
            pages=pages,
            us=round(do_bench_cudagraph(lambda: page_bounds_triton(q, tables["kmin"], tables["kmax"])) * 1e3, 2),
        )
        print(json.dumps(row), flush=True)
        out.append(row)
        first_ts = None
        for parts, block_p, warps in [(p, bp, w) for p in (True, False) for bp in (16, 32, 64) for w in (2, 4)]:
            opts = dict(block_p=block_p, warps=warps, parts=parts)
            t = {k: v.clone() for k, v in tables.items()}
            RS.raas_stamp_triton(*args, *t.values(), window, 1e-3, **opts)
            first_ts = t["ts"].clone() if first_ts is None else first_ts
            same = bool(torch.equal(t["ts"], first_ts))
            row = dict(kernel="raas_stamp", b=b, pages=pages, **opts, stamps_as_first=same)
            plan = RS._kvpass_raas_plan
            for part in ("both", "bounds"):  # the bounds kernel alone: the plan's launch made a no-op
                RS._kvpass_raas_plan = plan if part == "both" else _NoLaunch()
                row[f"{part}_us"] = round(
                    do_bench_cudagraph(lambda: RS.raas_stamp_triton(*args, *t.values(), window, 1e-3, **opts)) * 1e3, 2
                )
            RS._kvpass_raas_plan = plan
            print(json.dumps(row), flush=True)
            out.append(row)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the rows")
    ap.add_argument("--only", choices=["scan", "top", "stamp"], help="one kernel's rows")
    args = ap.parse_args()
    out = [dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)]
    print(json.dumps(out[0]), flush=True)
    for name, rows in (("scan", scan_rows), ("top", top_rows), ("stamp", stamp_rows)):
        if args.only in (None, name):
            rows(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
