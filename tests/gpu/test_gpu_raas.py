"""GPU checks of RaaS (marked ``gpu``; skipped without CUDA).

* the page-bounds kernel (quest's ranking on both caches) equals ``page_bounds_reference`` at real
  sizes, with a strided query, and through ``kvpass::page_bounds`` on CUDA;
* a long decode on CUDA keeps the stored pool size constant and the allocated pages within
  prefill pages + budget/16 + 1, and a no-evict budget equals ``full``;
* RaaS's per-layer SlotCache update (``kvpass::raas_stamp``, two Triton launches) leaves the tables as
  its reference does at 32k / 128k-sized pools, batch 1 and 16, with and without an eviction;
* quest's page selection kernel (``kvpass::top_pages``) equals its reference at real sizes, with ties;
* quest: the decode kernel with a short ``block_map`` (-1 padded) equals its reference at real sizes,
  a budget at least the length equals ``full`` through Inductor, and a long decode reads exactly the
  selected pages.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
import kvpass.ops.lowerings  # noqa: F401  (torch.ops.kvpass and their CUDA implementations; `import kvpass` loads lazily)
import kvpass.policies.pages.ops  # noqa: F401  (the page operators)
from families import build
from kvpass.kernels import decode_attention as DA
from kvpass.kernels import page_bounds as PB

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("b,h,hkv,pages,d", [(1, 32, 8, 8192, 128), (8, 16, 2, 1000, 64), (2, 24, 8, 3001, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bounds_kernel_equals_reference(b, h, hkv, pages, d, dtype):
    g = torch.Generator(device=DEV).manual_seed(pages)
    q = (torch.randn(b, h, 1, d, device=DEV, generator=g) * d**-0.5)[:, :, -1]  # strided, as slot_pages passes it
    x = torch.randn(b, hkv, pages, d, device=DEV, generator=g).to(dtype)
    y = torch.randn(b, hkv, pages, d, device=DEV, generator=g).to(dtype)
    kmin, kmax = torch.minimum(x, y), torch.maximum(x, y)
    ub = PB.page_bounds_reference(q, kmin, kmax)
    ub_k = PB.page_bounds_triton(q, kmin, kmax)
    torch.testing.assert_close(ub_k, ub, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.ops.kvpass.page_bounds(q, kmin, kmax), ub_k)


@pytest.mark.parametrize(
    "rows,pages,top", [(8, 2048, 128), (8, 8192, 128), (128, 2048, 128), (2, 16384, 1000), (3, 300, 500)]
)
@pytest.mark.parametrize("ties", [False, True])
def test_top_pages_kernel_equals_reference(rows, pages, top, ties):
    """Quest's selection kernel at real sizes (32k and 128k caches at batch 1 and 16, the row limit, fewer
    pages than top), with ties at the cut and pages that may not be chosen; through the op on CUDA too."""
    from kvpass.kernels.top_pages import top_pages_reference, top_pages_triton

    g = torch.Generator(device=DEV).manual_seed(pages + top)
    ub = torch.randn(rows, pages, device=DEV, generator=g)
    if ties:
        ub = ub.mul(4).round()
    ub[torch.rand(rows, pages, device=DEV, generator=g) < 0.1] = float("-inf")
    ref = top_pages_reference(ub, top)
    assert torch.equal(top_pages_triton(ub, top), ref)
    assert torch.equal(torch.ops.kvpass.top_pages(ub.view(rows, 1, pages), top)[:, 0], ref)


@pytest.mark.parametrize(
    "b,h,hkv,pages,window,d",
    [(1, 32, 8, 2177, 129, 128), (16, 32, 8, 2177, 129, 128), (1, 32, 8, 8321, 129, 128), (2, 24, 8, 300, 65, 96)],
)
@pytest.mark.parametrize("fill", [7, 15])
def test_raas_stamp_kernels_equal_reference(b, h, hkv, pages, window, d, fill):
    """Prompt pages then a full decode window; ``fill = 15`` makes every row evict its oldest page."""
    from kvpass.kernels import raas_stamp as RS

    g = torch.Generator(device=DEV).manual_seed(pages + fill)
    first = pages - window
    x = torch.randn(b, hkv, pages, d, device=DEV, generator=g).bfloat16()
    y = torch.randn(b, hkv, pages, d, device=DEV, generator=g).bfloat16()
    born = torch.arange(pages, device=DEV).repeat(b, hkv, 1)
    born[..., first:] = first + torch.rand(b, hkv, window, device=DEV, generator=g).argsort(-1)  # allocation order
    meta = torch.tensor([pages - 1, fill, first, -1], device=DEV).repeat(b, hkv, 1)
    tables = dict(
        kmin=torch.minimum(x, y),
        kmax=torch.maximum(x, y),
        live=torch.ones(b, hkv, pages, dtype=torch.bool, device=DEV),
        ts=torch.randint(0, 5000, (b, hkv, pages), device=DEV, generator=g),
        born=born,
        meta=meta,
        seen=torch.full((b, hkv), 4999, device=DEV),
    )
    q = (torch.randn(b, h, 1, d, device=DEV, generator=g) * 2 * d**-0.5).bfloat16()[:, :, -1]
    k_new = torch.randn(b, hkv, d, device=DEV, generator=g).bfloat16()
    args = (q, k_new, torch.tensor([[5000 + i, 0, 0, 1 << 40, 0] for i in range(b)], device=DEV))  # rows' own counts
    ref, got, op = ({k: v.clone() for k, v in tables.items()} for _ in range(3))
    RS.raas_stamp_reference(*args, *ref.values(), window, 1e-3)
    RS.raas_stamp_triton(*args, *got.values(), window, 1e-3)
    torch.ops.kvpass.raas_stamp(*args, *op.values(), window, 1e-3)
    assert all(torch.equal(op[k], got[k]) for k in tables)
    assert torch.equal(got["kmin"], ref["kmin"]) and torch.equal(got["kmax"], ref["kmax"])
    assert bool((ref["ts"] >= 5000).any())  # some pages were stamped
    flips = (got["ts"] != ref["ts"]).sum().item()  # a share within rounding of alpha may flip
    assert flips <= max(2, ref["ts"].numel() // 10000)
    if flips == 0:
        assert all(torch.equal(got[k], ref[k]) for k in tables)
    if fill == 15:
        assert bool((ref["meta"][..., 3] >= first).all()) and bool((ref["meta"][..., 0] == ref["meta"][..., 3]).all())


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
                for layer in be.state.layers.values():  # each layer's page tables: live is the third
                    pages = max(pages, int(layer.extra["tables"][2].sum(-1).max()))
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


@pytest.mark.parametrize("b,h,hkv,length,d", [(4, 32, 8, 16384, 128), (1, 9, 3, 17408, 64), (8, 16, 2, 4000, 64)])
@pytest.mark.parametrize("split", [None, False])
def test_block_map_kernel_equals_reference(b, h, hkv, length, d, split):
    """Quest's read: 65 of the pages (block 16) per KV head, some rows shorter (-1 padded)."""
    g = torch.Generator(device=DEV).manual_seed(length)
    q = torch.randn(b, h, 1, d, device=DEV, generator=g).bfloat16()
    k = torch.randn(b, hkv, length, d, device=DEV, generator=g).bfloat16()
    v = torch.randn(b, hkv, length, d, device=DEV, generator=g).bfloat16()
    pages = -(-length // 16)
    bmap = torch.rand(b, hkv, pages, device=DEV, generator=g).argsort(-1)[..., :65].sort(-1).values.int()
    bmap[0, 0, 40:] = -1
    out, vis = DA.decode_attention_triton(q, k, v, block_map=bmap, block=16, split=split)
    ref, vref = DA.decode_attention_reference(q, k, v, block_map=bmap, block=16)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(vis, vref) and int(vis[0, 0]) == 40
    op, _ = torch.ops.kvpass.decode_attention(
        q, k, v, None, None, None, None, None, bmap, d**-0.5, 0.0, 0, 0.0, 0.0, 5, 16, 2, 0, 0
    )
    torch.testing.assert_close(op.float(), ref.float(), atol=2e-2, rtol=2e-2)
    if split is None:  # the same automatic split choice as the operator's: the same kernel launch
        torch.testing.assert_close(op, out)


def test_quest_budget_above_length_equals_full():
    full, _, _ = _decode("full", 200)
    got, _, _ = _decode("quest", 200, budget=512, dense_layers=0)
    torch.testing.assert_close(got, full, atol=2e-3, rtol=2e-3)


def test_quest_long_decode_reads_the_selection():
    """1,500 steps after a 100-token prompt at budget 256 (top 16 pages + the current one)."""
    model = build("llama", "sdpa").to(DEV)
    be = kvpass.backend("quest", budget=256, dense_layers=0, stats=True)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 90, (2, 100), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    with torch.no_grad():
        tok = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(1500):
            tok = fwd(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    lengths = range(101, 1601)
    want = sum(min(17, -(-n // 16)) for n in lengths) / sum(-(-n // 16) for n in lengths)
    assert be.runtime.blocks_read() == pytest.approx(want, rel=1e-6)
    assert cache.layers[0].keys.shape[-2] == 1600
