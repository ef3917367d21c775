"""h2o's prefill scoring kernel (``kvpass::accumulated_scores``): its tiles, against the prefill's own attention.

Shape: Llama-3-8B attention (H=32, H_kv=8, D=128), bf16, batch 1, a plain prompt of ``L`` tokens (positions
0..L-1, causal). For each ``L``:

* ``sdpa``: ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``, the attention the prefill runs
  in the same layer (what the scoring is compared with: the target is a scoring of at most half the
  prefill's own time);
* pass 1 (row log-sum-exp) over ``PASS1`` with pass 2 fixed (both passes timed), then pass 2 (column sums) alone
  over ``PASS2``, given the rows' log-sum-exp from ``kvpass::attention_lse`` (h2o's one-pass scoring of a plain
  prompt); each the median of ``triton.testing.do_bench``;
* the best pair's two kernels timed apart by the profiler, and its result against the fp32 reference at 8k.

    python bench/probes/tune_accumulated.py --out $OUT/tune_accumulated.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kvpass.ops.lowerings  # noqa: E402,F401  (torch.ops.kvpass with their CUDA implementations: attention_lse is flash)
from kvpass.kernels import accumulated_scores as A  # noqa: E402

H, HKV, D = 32, 8, 128
PASS1 = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 128, 8, 3),
    (64, 128, 4, 3),
    (128, 32, 4, 3),
]
PASS2 = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (32, 128, 4, 3),
    (64, 256, 8, 3),
]


def inputs(length: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, length, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, HKV, length, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    pos = torch.arange(length, device="cuda")
    return q, k, v, pos.expand(1, HKV, length).contiguous(), pos.expand(1, length).contiguous()


def ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, scale = [], D**-0.5
    for length in map(int, args.lengths.split(",")):
        q, k, v, kv_pos, q_pos = inputs(length)
        sdpa = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        row = dict(length=length, sdpa_ms=sdpa, pass1=[], pass2=[])
        best1 = A.TILES[0]
        for cfg in PASS1:
            try:
                t = ms(lambda: A.accumulated_scores_triton(q, k, kv_pos, q_pos, scale, tiles=(cfg, A.TILES[1])))
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses (shared memory) is reported
                t = None
                print(f"L={length} pass1 {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            row["pass1"].append(dict(tiles=cfg, ms=t))
            print(f"L={length} pass1 {cfg}: {t} ms (sdpa {sdpa:.2f})", flush=True)
        best1 = min((r for r in row["pass1"] if r["ms"]), key=lambda r: r["ms"])["tiles"]
        lse = torch.ops.kvpass.attention_lse(q, k, v, scale)[1]
        for cfg in PASS2:
            try:
                t = ms(lambda: A.accumulated_scores_triton(q, k, kv_pos, q_pos, scale, tiles=(best1, cfg), lse=lse))
            except Exception as e:  # noqa: BLE001
                t = None
                print(f"L={length} pass2 {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            row["pass2"].append(dict(tiles=cfg, ms=t))
            print(f"L={length} pass2 {cfg}: {t} ms", flush=True)
        best = min((r for r in row["pass2"] if r["ms"]), key=lambda r: r["ms"])
        row.update(best=(best1, best["tiles"]), one_pass_ms=best["ms"], one_pass_to_sdpa=best["ms"] / sdpa)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                A.accumulated_scores_triton(q, k, kv_pos, q_pos, scale, tiles=row["best"])
            torch.cuda.synchronize()
        row["kernels_ms"] = {e.key: e.device_time / 1e3 for e in prof.key_averages() if "kvpass" in e.key}
        print(json.dumps({key: val for key, val in row.items() if key not in ("pass1", "pass2")}), flush=True)
        rows.append(row)
        del q, k, v, kv_pos, q_pos
    q, k, _, kv_pos, q_pos = inputs(8192)
    for tiles in {tuple(r["best"]) for r in rows}:
        got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, scale, tiles=tiles)
        want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, scale)
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"tiles {tiles}: max error / max score at 8k = {err:.2e}", flush=True)
        rows.append(dict(check_tiles=tiles, rel_error_8k=err))
    Path(args.out).write_text(
        json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1)
    )


if __name__ == "__main__":
    main()
