"""The slot-attention kernel (chunk fusion's recompute attention) against its reference.

Without a GPU the Triton kernel runs in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), called directly at tiny shapes; the interpreter computes bf16 dots wrongly,
so the kernel upcasts there while inputs still come in fp16 / bf16 / fp32. The reference itself is
checked against ``kvpass.policies.chunk_fusion.ops.attention_slots_reference`` (``attention_pos`` with slot j at
position j) and against SDPA's causal attention.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpass.kernels import slot_attention as S
from kvpass.policies.chunk_fusion.ops import attention_slots_reference

pytestmark = pytest.mark.skipif(S.triton is None, reason="needs Triton")
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# kernel and reference both compute in fp32 and round once: about one ulp of the output dtype
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1e-2),
}


def slot_case(b, h, hkv, lq, lk, d, dtype, seed, sort=True, blind=0, dv=None):
    """q, k, v and positions in [0, Lk) (distinct when Lq <= Lk), ``blind`` rows per batch at -1."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, lq, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g).to(dtype)
    rows = []
    for _ in range(b):
        p = torch.randperm(lk, generator=g)[:lq] if lq <= lk else torch.randint(0, lk, (lq,), generator=g)
        p = p.sort().values if sort else p
        p[torch.randperm(lq, generator=g)[:blind]] = -1
        rows.append(p)
    return q, k, v, torch.stack(rows)


def check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@SETTINGS
@given(
    b=st.integers(1, 2),
    gqa=st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]),
    lq=st.integers(1, 40),
    lk=st.integers(1, 150),
    d=st.sampled_from([16, 24, 32]),
    dtype=st.sampled_from(list(TOL)),
    softcap=st.sampled_from([0.0, 3.0]),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
    sort=st.booleans(),
    blind=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_slot_kernel_equals_reference(b, gqa, lq, lk, d, dtype, softcap, block_m, block_n, sort, blind, seed):
    h, hkv = gqa
    q, k, v, q_pos = slot_case(b, h, hkv, lq, lk, d, dtype, seed, sort, min(blind, lq))
    want = S.slot_attention_reference(q, k, v, q_pos, 0.3, softcap)
    got = S.slot_attention_triton(q, k, v, q_pos, 0.3, softcap, block_m=block_m, block_n=block_n)
    check(got, want, dtype)
    assert got[(q_pos < 0)[:, None].expand(b, h, lq)].eq(0).all()


@pytest.mark.parametrize("softcap", [0.0, 2.5])
@pytest.mark.parametrize("sort", [True, False])
def test_reference_equals_ops_reference(softcap, sort):
    """The kernel module's reference is ``attention_pos`` with slot j at position j."""
    q, k, v, q_pos = slot_case(2, 6, 2, 30, 70, 24, torch.float32, 5, sort, blind=2)
    q_pos[0, -1] = 90  # past the cache: sees all
    want = attention_slots_reference(q, k, v, q_pos, 0.3, softcap)
    torch.testing.assert_close(S.slot_attention_reference(q, k, v, q_pos, 0.3, softcap), want, atol=1e-6, rtol=1e-6)
    kv_pos = torch.arange(70).expand(2, 2, 70)
    torch.testing.assert_close(
        torch.ops.kvpass.attention_slots(q, k, v, q_pos, 0.3, softcap),
        torch.ops.kvpass.attention_pos(q, k, v, q_pos, kv_pos, 0.3, softcap, 0),
    )


@pytest.mark.parametrize("dtype", list(TOL))
def test_rows_that_see_nothing_are_zero(dtype):
    """Rows at position -1 (or below) give exact zeros, in a tile with rows that see a lot."""
    q, k, v, _ = slot_case(2, 4, 2, 20, 60, 16, dtype, 1)
    q_pos = torch.arange(40, 60).expand(2, 20).clone()
    q_pos[0, ::3] = -1
    q_pos[1] = -5  # batch 1: nothing at all
    got = S.slot_attention_triton(q, k, v, q_pos, 0.25, block_m=16, block_n=16)
    check(got, S.slot_attention_reference(q, k, v, q_pos, 0.25), dtype)
    assert got[0, :, ::3].eq(0).all() and got[1].eq(0).all()
    assert got[0, :, 1::3].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("gqa", [(4, 4), (8, 2)])
def test_dense_positions_equal_sdpa_causal(gqa):
    """q_pos = arange with Lq == Lk is ordinary causal self-attention."""
    h, hkv = gqa
    q, k, v, _ = slot_case(1, h, hkv, 45, 45, 32, torch.float32, 2)
    q_pos = torch.arange(45)[None]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(S.slot_attention_reference(q, k, v, q_pos, 0.2), want, atol=2e-5, rtol=2e-5)
    got = S.slot_attention_triton(q, k, v, q_pos, 0.2, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_strided_inputs_and_value_dim():
    """q/k/v views of [B, L, H, D] storage and int32 strided positions are read through their
    strides; a value dim other than the key dim; positions past the cache see every slot."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 25, 4, 24, generator=g).transpose(1, 2)
    k = torch.randn(2, 50, 2, 24, generator=g).transpose(1, 2)
    v = torch.randn(2, 50, 2, 40, generator=g)[..., :20].transpose(1, 2)  # Dv = 20, strided rows
    pos = torch.randint(0, 60, (25, 2), generator=g, dtype=torch.int32).t()  # some >= Lk, strided
    want = S.slot_attention_reference(q.contiguous(), k.contiguous(), v.contiguous(), pos.contiguous(), 0.3)
    got = S.slot_attention_triton(q, k, v, pos, 0.3, block_m=16, block_n=16)
    assert got.shape == (2, 4, 25, 20)
    check(got, want, torch.float32)


def test_default_config_and_small_head_dim():
    """Default launch parameters (bigger tiles than the rows and keys), head dim 8 (padded to 16)."""
    q, k, v, q_pos = slot_case(1, 2, 1, 10, 33, 8, torch.bfloat16, 4)
    check(S.slot_attention_triton(q, k, v, q_pos), S.slot_attention_reference(q, k, v, q_pos), torch.bfloat16)


def test_op_is_the_reference_on_cpu():
    q, k, v, q_pos = slot_case(1, 4, 2, 6, 30, 16, torch.float32, 6, blind=1)
    got = torch.ops.kvpass.attention_slots(q, k, v, q_pos, 0.25, 0.0)
    assert torch.equal(got, S.slot_attention_reference(q, k, v, q_pos, 0.25))
