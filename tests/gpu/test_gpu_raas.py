"""GPU checks of RaaS (marked ``gpu``; skipped without CUDA).

* the page-scoring Triton kernel equals its reference at real sizes (1k-8k pages, head_dim 64/128,
  GQA groups 1-8, batch up to 8) and through ``kvpass::page_scores`` on CUDA;
* a long decode on CUDA keeps the stored pool size constant and the allocated pages within
  prefill pages + budget/16 + 1, and a no-evict budget equals ``full``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.kernels import page_scores as PS

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("b,h,hkv,pages,d", [(1, 32, 8, 8192, 128), (8, 16, 2, 1024, 64), (4, 8, 8, 3000, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_scores_kernel_equals_reference(b, h, hkv, pages, d, dtype):
    g = torch.Generator(device=DEV).manual_seed(pages)
    q = torch.randn(b, h, d, device=DEV, generator=g).to(dtype) * d ** -0.5
    x = torch.randn(b, hkv, pages, d, device=DEV, generator=g).to(dtype)
    y = torch.randn(b, hkv, pages, d, device=DEV, generator=g).to(dtype)
    live = torch.rand(b, hkv, pages, device=DEV, generator=g) > 0.2
    ts = torch.randint(0, 1000, (b, hkv, pages), device=DEV, generator=g)
    args = (q, torch.minimum(x, y), torch.maximum(x, y), live, ts, 1e-3, 5000)
    ub, ts_ref = PS.page_scores_reference(*args)
    ub_k, ts_k = PS.page_scores_triton(*args)
    torch.testing.assert_close(ub_k, ub, atol=1e-3, rtol=1e-4)
    # a share within rounding of alpha may flip; allow a handful
    assert (ts_k != ts_ref).sum().item() <= max(2, ts_ref.numel() // 10000)
    ub_op, ts_op = torch.ops.kvpass.page_scores(*args)
    assert torch.equal(ub_op, ub_k) and torch.equal(ts_op, ts_k)


def _decode(policy, steps, **params):
    model = build("llama", "sdpa").to(DEV)
    be = kvpass.backend(policy, **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 90, (2, 100), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    logits, sizes, pages = [], set(), 0
    with torch.no_grad():
        lg = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            logits.append(lg)
            lg = fwd(input_ids=lg.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
            sizes |= {layer.keys.shape[-2] for layer in cache.layers}
            if policy.startswith("raas"):
                pages = max(pages, max(int(s.extra["live"].sum(-1).max()) for s in be.state.layers.values()))
    return torch.stack(logits), sizes, pages


def test_long_decode_pool_is_flat():
    _, sizes, pages = _decode("raas", 3000, budget=256)
    bound = 7 + 256 // 16 + 1
    assert sizes == {bound * 16} and pages <= bound


@pytest.mark.parametrize("policy", ["raas", "raas+art"])
def test_no_evict_budget_equals_full(policy):
    full, _, _ = _decode("full", 200)
    extra = dict(tau=0.0, phi=0.0) if policy == "raas+art" else {}
    got, _, _ = _decode(policy, 200, budget=256, **extra)
    torch.testing.assert_close(got, full, atol=2e-3, rtol=2e-3)
