"""A decode step's projections, one layer of the Llama-3.1-8B shape: seven matmuls as the model runs them against
the q/k/v and gate/up weights fused into one matmul each (four in all), on one GPU and at a tensor-parallel
rank's share.

Why: on two H200s a rank's matmuls took 0.62x one GPU's (not 0.5x; ``bench/results/tp_h200x2_2026-11-28``,
18:13 UTC), and the small
projections (k and v at 4 MB a rank) read far below the copy bandwidth. Fusing them is the lever not built
(it needs the weights concatenated once, in place); this measures what it would save before building it. The
matmuls are ATen's (cuBLAS: what Inductor's decode graph calls for them), replayed as one CUDA graph of
``--reps`` layers, bf16, weights from N(0, 0.02); TB/s counts the weight bytes read.

    python bench/probes/bench_projections.py --batches 1,4 --shares 1,2 --out proj.json
    python bench/probes/bench_projections.py --tiny            # a CPU smoke run (no CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336


def weights(share: int, tiny: bool, device, dtype) -> dict:
    """One layer's projection weights at ``1 / share`` of the heads and of the MLP (a rank's columns / rows)."""
    scale = 32 if tiny else 1
    h, q, kv, inter = (
        HIDDEN // scale,
        HEADS * HEAD_DIM // share // scale,
        KV_HEADS * HEAD_DIM // share // scale,
        INTER // share // scale,
    )
    g = torch.Generator(device=device).manual_seed(0)

    def w(n, k):
        return torch.empty(n, k, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)

    ws = {
        "q": w(q, h),
        "k": w(kv, h),
        "v": w(kv, h),
        "o": w(h, q),
        "gate": w(inter, h),
        "up": w(inter, h),
        "down": w(h, inter),
    }
    ws["qkv"] = torch.cat([ws["q"], ws["k"], ws["v"]])  # once, as a fused model would hold them
    ws["gate_up"] = torch.cat([ws["gate"], ws["up"]])
    return ws


def separate(x, ws):
    q = F.linear(x, ws["q"])
    F.linear(x, ws["k"]), F.linear(x, ws["v"])  # unused here: a CUDA graph keeps every launch
    o = F.linear(q, ws["o"])  # (q stands in for the attention's output)
    return F.linear(F.linear(o, ws["gate"]) * F.linear(o, ws["up"]), ws["down"])


def fused(x, ws):
    qkv = F.linear(x, ws["qkv"])
    q = qkv[:, : ws["q"].shape[0]]
    o = F.linear(q, ws["o"])
    gate, up = F.linear(o, ws["gate_up"]).chunk(2, -1)
    return F.linear(gate * up, ws["down"])


def timed(fn, x, ws, reps: int, iters: int) -> float:
    """Seconds per layer: ``reps`` layers captured in one CUDA graph (on a GPU), replayed ``iters`` times."""
    cuda = x.device.type == "cuda"
    for _ in range(3):
        fn(x, ws)
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn(x, ws)
        graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / (iters * reps)
    t = time.perf_counter()
    for _ in range(iters * reps):
        fn(x, ws)
    return (time.perf_counter() - t) / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--shares", default="1,2", help="1: one GPU's layer; 2: a rank's share on two GPUs")
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for share in (int(s) for s in args.shares.split(",")):
        ws = weights(share, args.tiny, device, dtype)
        read = sum(ws[k].numel() * ws[k].element_size() for k in ("q", "k", "v", "o", "gate", "up", "down"))
        for b in (int(s) for s in args.batches.split(",")):
            x = torch.randn(b, ws["q"].shape[1], device=device, dtype=dtype)
            a, b_ = fused(x, ws).float(), separate(x, ws).float()  # bf16 rounds the chains apart: a relative norm
            assert (a - b_).norm() <= 2e-2 * b_.norm(), f"fused and separate differ: {(a - b_).norm() / b_.norm():.3g}"
            t_sep, t_fused = (timed(fn, x, ws, args.reps, args.iters) for fn in (separate, fused))
            row = {
                "share": share,
                "batch": b,
                "weight_MB": read / 1e6,
                "separate_us": t_sep * 1e6,
                "fused_us": t_fused * 1e6,
                "saved_us_per_layer": (t_sep - t_fused) * 1e6,
                "separate_TBps": read / t_sep / 1e12,
                "fused_TBps": read / t_fused / 1e12,
                "device": str(device) if device == "cpu" else torch.cuda.get_device_name(),
                "torch": torch.__version__,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
