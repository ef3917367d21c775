"""Probe: PyTorch SDPA decode time when the key length changes every call (as in decoding).

q [1, 9, 1, 64], K/V [1, 3, L, 64] bf16 (SmolLM2's attention shape), L = 32768 (+ i when growing),
with and without a boolean mask, each call synchronised and timed; then kvpass's decode kernel on the
growing length. Prints the first six times and the median (ms).

    python bench/probes/probe_sdpa_decode.py
"""

import time

import torch
import torch.nn.functional as F

dev = "cuda"


def run(L0, n, grow, mask):
    k = torch.randn(1, 3, L0 + n, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 9, 1, 64, device=dev, dtype=torch.bfloat16)
    ts = []
    for i in range(n):
        L = L0 + i if grow else L0
        m = torch.ones(1, 1, 1, L, dtype=torch.bool, device=dev) if mask else None
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, k[:, :, :L], v[:, :, :L], attn_mask=m, enable_gqa=True)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return [round(x, 2) for x in ts[:6]], round(sorted(ts)[len(ts) // 2], 3)


for grow in (False, True):
    for mask in (False, True):
        print("grow", grow, "mask", mask, run(32768, 30, grow, mask), flush=True)
import kvpass.kernels.decode_attention as K  # noqa: E402 (after the SDPA timings, which must not see it)

k = torch.randn(1, 3, 32768 + 30, 64, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
q = torch.randn(1, 9, 1, 64, device=dev, dtype=torch.bfloat16)
ts = []
for i in range(30):
    torch.cuda.synchronize()
    t = time.perf_counter()
    K.decode_attention_triton(q, k[:, :, : 32768 + i], v[:, :, : 32768 + i])
    torch.cuda.synchronize()
    ts.append((time.perf_counter() - t) * 1e3)
print("kvpass kernel grow", [round(x, 2) for x in ts[:6]], round(sorted(ts)[15], 3))
