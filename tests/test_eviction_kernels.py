"""The eviction kernels (window scoring, KV gather) against their references.

Without a GPU the Triton kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), called directly at tiny shapes; the interpreter computes bf16 dots
wrongly, so the kernels upcast there while inputs still come in fp16 / bf16 / fp32.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpass.ops  # noqa: F401  (registers torch.ops.kvpass, which test_ops_are_the_references_on_cpu calls)
from kvpass.kernels import gather as G
from kvpass.kernels import window_scores as W

pytestmark = pytest.mark.skipif(W.triton is None, reason="needs Triton")
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}


def window_case(b, h, hkv, w, n, d, dtype, pads, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, w, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    for bi, p in enumerate(pads):
        kv_pos[bi, :, :p] = -1
    return q, k, kv_pos, torch.arange(n - w, n).expand(b, w).contiguous()


@SETTINGS
@given(
    b=st.integers(1, 2),
    gqa=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]),
    w=st.integers(1, 20),
    n=st.integers(20, 150),
    d=st.sampled_from([16, 24, 32]),
    dtype=st.sampled_from(list(TOL)),
    softcap=st.sampled_from([0.0, 3.0]),
    block=st.sampled_from([16, 32]),
    rows=st.sampled_from([16, 64]),
    pads=st.lists(st.integers(0, 30), min_size=2, max_size=2),
    merge=st.sampled_from([1, 2, 64]),
    reduce=st.sampled_from(W.REDUCTIONS),
    seed=st.integers(0, 10_000),
)
def test_window_kernel_equals_reference(b, gqa, w, n, d, dtype, softcap, block, rows, pads, merge, reduce, seed):
    h, hkv = gqa
    q, k, kv_pos, q_pos = window_case(b, h, hkv, w, n, d, dtype, pads[:b], seed)
    want = W.window_scores_reference(q, k, kv_pos, q_pos, 0.3, softcap, reduce)
    got = W.window_scores_triton(
        q, k, kv_pos, q_pos, 0.3, softcap, block=block, rows=rows, merge_blocks=merge, reduce=reduce
    )
    assert got.dtype == torch.float32 and got.shape == (b, hkv, n)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * w, rtol=TOL[dtype])
    if reduce == "max":  # no row gives a key more than all of its attention
        assert got.le(1 + 1e-5).all()


def test_window_scores_max_is_the_most_one_row_gives():
    """``reduce="max"`` differs from the sum (a test that cannot tell them apart would pass either kernel)."""
    q, k, kv_pos, q_pos = window_case(1, 4, 2, 6, 30, 16, torch.float32, [0], 1)
    most = W.window_scores_triton(q, k, kv_pos, q_pos, 0.25, block=16, reduce="max")
    total = W.window_scores_triton(q, k, kv_pos, q_pos, 0.25, block=16)
    assert most.le(total + 1e-6).all() and not torch.allclose(most, total)
    with pytest.raises(ValueError, match="reduce must be one of"):
        W.window_scores_reference(q, k, kv_pos, q_pos, 0.25, reduce="mean")


def test_window_kernel_rows_that_see_nothing():
    """Window queries that see no key (padding queries of a row shorter than the window) add 0."""
    q, k, kv_pos, q_pos = window_case(1, 4, 2, 8, 40, 16, torch.float32, [35], 0)
    want = W.window_scores_reference(q, k, kv_pos, q_pos, 0.25)
    # the merge's first step folds two blocks of padding only: its rows stay unseen until the third block
    got = W.window_scores_triton(q, k, kv_pos, q_pos, 0.25, block=16, merge_blocks=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[..., :35].eq(0).all()
    torch.testing.assert_close(got.sum(-1), torch.full((1, 2), 2.0 * 5))  # 5 rows see something, 2 heads


def test_window_kernel_strided_window_queries():
    """The policies pass ``q[:, :, -w:]``, a strided view of the prefill's queries."""
    g = torch.Generator().manual_seed(3)
    q_all, k = torch.randn(2, 4, 50, 16, generator=g), torch.randn(2, 2, 50, 16, generator=g)
    kv_pos = torch.arange(50).expand(2, 2, 50).contiguous()
    q_pos = torch.arange(42, 50).expand(2, 8).contiguous()
    want = W.window_scores_reference(q_all[:, :, -8:].contiguous(), k, kv_pos, q_pos, 0.25)
    got = W.window_scores_triton(q_all[:, :, -8:], k, kv_pos, q_pos, 0.25, block=16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    n=st.integers(1, 90),
    d=st.sampled_from([8, 16, 40]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    frac=st.floats(0.0, 1.0),
    block=st.sampled_from([16, 64]),
    seed=st.integers(0, 10_000),
)
def test_gather_kernel_equals_reference(b, hkv, n, d, dtype, frac, block, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    keep = max(1, int(n * frac))
    idx = torch.stack([torch.randperm(n, generator=g)[:keep].sort().values for _ in range(b * hkv)])
    idx = idx.view(b, hkv, keep)
    got = G.gather_triton(src, idx, block=block)
    assert got.is_contiguous() and torch.equal(got, G.gather_reference(src, idx))


def test_gather_kernel_strided_source():
    """A cache tensor that is a view (e.g. K of a fused projection) is read through its strides."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(2, 30, 3, 16, generator=g)  # [B, N, H_kv, D] storage
    src = base.transpose(1, 2)  # [B, H_kv, N, D] view
    idx = torch.tensor([0, 3, 4, 29]).expand(2, 3, 4).contiguous()
    assert torch.equal(G.gather_triton(src, idx, block=16), G.gather_reference(src, idx))


def test_ops_are_the_references_on_cpu():
    q, k, kv_pos, q_pos = window_case(1, 4, 2, 5, 30, 16, torch.float32, [3], 1)
    got = torch.ops.kvpass.window_scores(q, k, kv_pos, q_pos, 0.25, 0.0)
    assert torch.equal(got, W.window_scores_reference(q, k, kv_pos, q_pos, 0.25))
    idx = torch.tensor([[[1, 5, 9], [0, 2, 29]]])
    k_out, v_out = torch.ops.kvpass.gather_kv(k, k * 2, idx)
    assert torch.equal(k_out, G.gather_reference(k, idx)) and torch.equal(v_out, 2 * k_out)
