"""The kvpass operators against PyTorch, and ``torch.library.opcheck`` on every one of them.

* ``kvpass::attention`` is compared with ``F.scaled_dot_product_attention(..., enable_gqa=True)``
  over batch, query/key lengths, GQA ratio, head dim (including an odd one), dtype, masks
  (boolean, additive, several broadcast shapes) and ``is_causal``; softcapping is compared with a
  hand-written reference, since SDPA has none.
* ``kvpass::attention_pos`` is compared with ``kvpass::attention`` (and SDPA) under the boolean mask
  its ``q_pos`` / ``kv_pos`` / ``window`` arguments describe, padding entries (-1) included.
* Fully masked rows must come out as exact zeros, for every dtype and mask kind.
* ``opcheck`` runs every operator in ``kvpass.ops.OPS``; the stateful ones run against a real
  runtime (``kvpass.backend("streamingllm", budget=8, sinks=2)``), with an empty past (the 1-D
  ``tensor([])`` DynamicCache starts from) and a non-empty one.
"""

from __future__ import annotations

import math
import pathlib
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpass
from kvpass.kernels.page_bounds import page_bounds_reference
from kvpass.kernels.top_pages import top_pages_reference, top_pages_triton
from kvpass.ops import OPS

OP = torch.ops.kvpass
PROPERTY = settings(max_examples=40, deadline=None)


def _cpu_has_fp16_sdpa() -> bool:
    try:
        x = torch.ones(1, 1, 2, 8, dtype=torch.float16)
        F.scaled_dot_product_attention(x, x, x)
        return True
    except RuntimeError:  # pragma: no cover - depends on the CPU build
        return False


DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if _cpu_has_fp16_sdpa() else [])
# kvpass computes in fp32 and rounds once; SDPA in low precision may round differently, so the
# tolerance is about one ulp of the output dtype at |x| ~ 2-4.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=3e-3),
}
HEAD_DIMS = [8, 16, 24, 32]  # 24: not a power of two
GQA_RATIOS = [1, 2, 4]
MASK_SHAPES = ["b1qk", "bhqk", "11qk", "qk", "b11k"]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _randn(shape, gen, dtype, mult=1.0):
    return (torch.randn(shape, generator=gen) * mult).to(dtype)


def _mask_shape(kind: str, b: int, h: int, lq: int, lk: int) -> tuple[int, ...]:
    return {
        "b1qk": (b, 1, lq, lk),
        "bhqk": (b, h, lq, lk),
        "11qk": (1, 1, lq, lk),
        "qk": (lq, lk),
        "b11k": (b, 1, 1, lk),
    }[kind]


def _make_mask(kind: str | None, shape, keep: float, gen, dtype):
    """(mask passed to the op, boolean visibility of the same mask) or (None, None)."""
    if kind is None:
        return None, None
    visible = torch.rand(shape, generator=gen) < keep
    if kind == "bool":
        return visible, visible
    bias = -3.0 * torch.rand(shape, generator=gen)  # an additive mask: finite biases and -inf
    return bias.masked_fill(~visible, float("-inf")).to(dtype), visible


def _visibility(visible, causal: bool, b: int, h: int, lq: int, lk: int):
    """[B, H, Lq, Lk] boolean: which keys each query row may attend to."""
    vis = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if causal:
        vis &= torch.ones(lq, lk, dtype=torch.bool).tril()
    if visible is not None:
        vis &= visible.expand(b, h, lq, lk)
    return vis


def _assert_dead_rows_zero(out, vis):
    dead = ~vis.any(-1)  # [B, H, Lq]
    if dead.any():
        assert (out[dead] == 0).all(), "a fully masked query row must give zeros"


def softcap_reference(q, k, v, mask, scale, is_causal, softcap):
    """Hand-written attention with logit softcapping: tanh(s / c) * c, then masking, then softmax."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    lq, lk = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(nan=0.0)  # a fully masked row: NaN -> 0
    return (p @ v).to(q.dtype)


def positions_mask(q_pos, kv_pos, group: int, window: int):
    """[B, H, Lq, Lk] boolean from true token indices, written out loop by loop (no broadcasting)."""
    b, lq = q_pos.shape
    _, hkv, lk = kv_pos.shape
    mask = torch.zeros(b, hkv * group, lq, lk, dtype=torch.bool)
    for bi in range(b):
        for h in range(hkv * group):
            for i in range(lq):
                for j in range(lk):
                    kp, qp = int(kv_pos[bi, h // group, j]), int(q_pos[bi, i])
                    ok = 0 <= kp <= qp and (window == 0 or qp - kp < window)
                    mask[bi, h, i, j] = ok
    return mask


# ----------------------------------------------------------------------------------------------
# kvpass::attention vs SDPA
# ----------------------------------------------------------------------------------------------


@st.composite
def attention_cases(draw):
    causal = draw(st.booleans())
    lq = draw(st.integers(1, 9))
    lk = draw(st.integers(lq, 12)) if causal else draw(st.integers(1, 12))
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        b=draw(st.integers(1, 3)),
        lq=lq,
        lk=lk,
        hkv=hkv,
        h=hkv * draw(st.sampled_from(GQA_RATIOS)),
        d=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=causal,
        mask=draw(st.sampled_from([None, "bool", "float"])),
        mask_shape=draw(st.sampled_from(MASK_SHAPES)),
        keep=draw(st.sampled_from([0.15, 0.5, 0.9, 1.0])),
        scale=draw(st.sampled_from([None, 0.05, 0.5, 1.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _qkv(c, gen):
    """q [B, H, Lq, D] and k, v [B, H_kv, Lk, D] for a drawn case."""
    b, h, hkv, lq, lk, d, dt = c["b"], c["h"], c["hkv"], c["lq"], c["lk"], c["d"], c["dtype"]
    return _randn((b, h, lq, d), gen, dt), _randn((b, hkv, lk, d), gen, dt), _randn((b, hkv, lk, d), gen, dt)


@PROPERTY
@given(attention_cases())
def test_attention_matches_sdpa(c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, h, lq, lk, d, dt = c["b"], c["h"], c["lq"], c["lk"], c["d"], c["dtype"]
    q, k, v = _qkv(c, gen)
    shape = _mask_shape(c["mask_shape"], b, h, lq, lk)
    mask, visible = _make_mask(c["mask"], shape, c["keep"], gen, dt)
    scale = 1.0 / math.sqrt(d) if c["scale"] is None else c["scale"]

    out = OP.attention(q, k, v, mask, scale, c["causal"], 0.0)

    assert out.shape == (b, h, lq, d) and out.dtype == dt
    vis = _visibility(visible, c["causal"], b, h, lq, lk)
    # SDPA rejects attn_mask together with is_causal: give it the combined mask instead.
    sdpa_mask, sdpa_causal = mask, c["causal"]
    if mask is not None and c["causal"]:
        sdpa_mask, sdpa_causal = vis, False
        if mask.dtype != torch.bool:
            sdpa_mask = mask.expand(b, h, lq, lk).float().masked_fill(~vis, float("-inf")).to(dt)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=sdpa_mask, is_causal=sdpa_causal, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(out, expected, **TOL[dt])
    # and against fp32 SDPA: kvpass rounds only once, at the end
    m32 = sdpa_mask.float() if sdpa_mask is not None and sdpa_mask.dtype != torch.bool else sdpa_mask
    exp32 = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=m32, is_causal=sdpa_causal, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(out.float(), exp32, **TOL[dt])
    _assert_dead_rows_zero(out, vis)


@PROPERTY
@given(attention_cases(), st.sampled_from([1.0, 5.0, 30.0]))
def test_attention_softcap_matches_reference(c, softcap):
    gen = torch.Generator().manual_seed(c["seed"])
    b, h, hkv, lq, lk, d, dt = c["b"], c["h"], c["hkv"], c["lq"], c["lk"], c["d"], c["dtype"]
    # large logits, so the cap really bends them
    q = _randn((b, h, lq, d), gen, dt, mult=3.0)
    k, v = _randn((b, hkv, lk, d), gen, dt, mult=3.0), _randn((b, hkv, lk, d), gen, dt)
    mask, visible = _make_mask(c["mask"], _mask_shape(c["mask_shape"], b, h, lq, lk), c["keep"], gen, dt)
    scale = 1.0 / math.sqrt(d) if c["scale"] is None else c["scale"]

    out = OP.attention(q, k, v, mask, scale, c["causal"], softcap)

    expected = softcap_reference(q, k, v, mask, scale, c["causal"], softcap)
    torch.testing.assert_close(out, expected, **TOL[dt])
    _assert_dead_rows_zero(out, _visibility(visible, c["causal"], b, h, lq, lk))


# ----------------------------------------------------------------------------------------------
# kvpass::attention_pos vs attention with the equivalent boolean mask
# ----------------------------------------------------------------------------------------------


@st.composite
def position_cases(draw):
    hkv = draw(st.sampled_from([1, 2]))
    return dict(
        b=draw(st.integers(1, 3)),
        lq=draw(st.integers(1, 9)),
        lk=draw(st.integers(1, 14)),
        hkv=hkv,
        h=hkv * draw(st.sampled_from(GQA_RATIOS)),
        d=draw(st.sampled_from(HEAD_DIMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        window=draw(st.sampled_from([0, 1, 3, 8])),
        softcap=draw(st.sampled_from([0.0, 0.0, 5.0])),
        pad=draw(st.integers(0, 4)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _positions(b, hkv, lq, lk, pad, gen):
    """q_pos [B, Lq]: the new tokens after `seen` earlier ones; kv_pos [B, H_kv, Lk]: an ascending
    subset of the tokens seen so far (what an eviction policy kept, different per head), left
    padding (-1) on the first `pad` entries of batch row 0, then the new tokens themselves."""
    q_pos = torch.empty(b, lq, dtype=torch.long)
    kv_pos = torch.full((b, hkv, lk), -1, dtype=torch.long)
    for bi in range(b):
        seen = int(torch.randint(0, 20, (1,), generator=gen))
        q_pos[bi] = seen + torch.arange(lq)
        for g in range(hkv):
            pool = torch.cat([torch.arange(seen), q_pos[bi]])
            pick = torch.randperm(len(pool), generator=gen)[:lk].sort().values
            kv_pos[bi, g, : len(pick)] = pool[pick]
    if pad:
        kv_pos[0, :, :pad] = -1
    return q_pos, kv_pos


@PROPERTY
@given(position_cases())
def test_attention_pos_matches_masked_attention(c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, h, hkv, lq, lk, d, dt = c["b"], c["h"], c["hkv"], c["lq"], c["lk"], c["d"], c["dtype"]
    q, k, v = _qkv(c, gen)
    q_pos, kv_pos = _positions(b, hkv, lq, lk, c["pad"], gen)
    scale = 1.0 / math.sqrt(d)

    out = OP.attention_pos(q, k, v, q_pos, kv_pos, scale, c["softcap"], c["window"])

    mask = positions_mask(q_pos, kv_pos, h // hkv, c["window"])
    expected = OP.attention(q, k, v, mask, scale, False, c["softcap"])
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same math, the same mask
    if c["softcap"] == 0:
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        torch.testing.assert_close(out, sdpa, **TOL[dt])
    _assert_dead_rows_zero(out, mask)


# ----------------------------------------------------------------------------------------------
# fully masked rows, written out
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_are_zero(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn((2, 4, 3, 16), gen, dtype), _randn((2, 2, 5, 16), gen, dtype), _randn((2, 2, 5, 16), gen, dtype)
    keep = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    keep[0, :, 1] = False  # row 1 of batch 0 sees nothing
    keep[1] = False  # batch 1 sees nothing at all
    additive = torch.zeros(2, 1, 3, 5, dtype=dtype).masked_fill(~keep, float("-inf"))
    for mask in (keep, additive):
        for softcap in (0.0, 10.0):
            out = OP.attention(q, k, v, mask, 0.25, False, softcap)
            assert torch.isfinite(out).all()
            assert (out[0, :, 1] == 0).all() and (out[1] == 0).all()
            assert (out[0, :, 0].abs().sum() > 0) and (out[0, :, 2].abs().sum() > 0)

    q_pos = torch.tensor([[7, 8, 9], [0, 1, 2]])
    kv_pos = torch.tensor([[[5, 6, 7, 8, 9]] * 2, [[-1] * 5] * 2])  # batch 1: only padding
    out = OP.attention_pos(q, k, v, q_pos, kv_pos, 0.25, 0.0, 0)
    assert (out[1] == 0).all() and (out[0].abs().sum(-1) > 0).all()
    out = OP.attention_pos(q, k, v, q_pos + 10, kv_pos, 0.25, 0.0, 3)  # window: everything too old
    assert (out == 0).all()


# ----------------------------------------------------------------------------------------------
# opcheck on every operator
# ----------------------------------------------------------------------------------------------

SITE = 0
B, H, HKV, D = 2, 4, 2, 8
BUDGET, SINKS = 8, 2


def opcheck(name: str, args) -> None:
    torch.library.opcheck(OPS[name], args)


@pytest.fixture
def rt():
    """A real runtime (eviction policy with budget 8) and one global DynamicCache site."""
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    be.runtime.sites[SITE] = SimpleNamespace(sliding_window=None, cache="dynamic", layer=SITE)
    yield be.runtime  # held by `be` until the test ends (the registry is weak)


def _prefill(rt, n: int, mask=None):
    """cache_update + compact of an n-token prompt on an empty DynamicCache layer."""
    gen = torch.Generator().manual_seed(n)
    k_new, v_new, q = (
        _randn((B, HKV, n, D), gen, torch.float32),
        _randn((B, HKV, n, D), gen, torch.float32),
        _randn((B, H, n, D), gen, torch.float32),
    )
    empty = torch.tensor([])
    k, v, kv_pos, q_pos = OP.cache_update(empty, empty, k_new, v_new, mask, rt.handle, SITE)
    k_st, v_st = OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    return k_st, v_st


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal,softcap,ratio,d", [(True, 0.0, 2, 8), (False, 30.0, 4, 24), (False, 0.0, 1, 16)])
def test_opcheck_attention(dtype, mask, causal, softcap, ratio, d):
    gen = torch.Generator().manual_seed(1)
    q = _randn((2, 2 * ratio, 3, d), gen, dtype)
    k, v = _randn((2, 2, 5, d), gen, dtype), _randn((2, 2, 5, d), gen, dtype)
    m, _ = _make_mask(mask, (2, 1, 3, 5), 0.6, gen, dtype)
    opcheck("attention", (q, k, v, m, d**-0.5, causal, softcap))


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (0, 20.0)])
def test_opcheck_attention_pos(window, softcap):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        _randn((B, H, 3, D), gen, torch.float32),
        _randn((B, HKV, 6, D), gen, torch.float32),
        _randn((B, HKV, 6, D), gen, torch.float32),
    )
    q_pos = torch.tensor([[10, 11, 12], [4, 5, 6]])
    kv_pos = torch.tensor(
        [[[0, 1, 8, 10, 11, 12], [0, 3, 9, 10, 11, 12]], [[-1, -1, 3, 4, 5, 6], [-1, -1, 2, 4, 5, 6]]]
    )
    opcheck("attention_pos", (q, k, v, q_pos, kv_pos, D**-0.5, softcap, window))


def _hf_padding_mask(lq: int, lk: int, pad: int) -> torch.Tensor:
    """An HF-style additive causal mask [B, 1, Lq, Lk] with `pad` left-padding keys in batch row 1."""
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).expand(B, 1, lq, lk).clone()
    allowed[1, :, :, :pad] = False
    return torch.zeros(B, 1, lq, lk).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("mask", [None, "hf"])
def test_opcheck_cache_update_empty_past(rt, mask):
    gen = torch.Generator().manual_seed(3)
    k_new, v_new = _randn((B, HKV, 5, D), gen, torch.float32), _randn((B, HKV, 5, D), gen, torch.float32)
    m = _hf_padding_mask(5, 5, pad=2) if mask else None
    empty = torch.tensor([])
    assert empty.dim() == 1  # what DynamicCache starts from
    opcheck("cache_update", (empty, empty, k_new, v_new, m, rt.handle, SITE))
    _, _, kv_pos, q_pos = OP.cache_update(empty, empty, k_new, v_new, m, rt.handle, SITE)
    assert q_pos.tolist() == [[0, 1, 2, 3, 4]] * B
    if mask:
        assert kv_pos[1, :, :2].eq(-1).all() and kv_pos[0].ge(0).all()


@pytest.mark.parametrize("prompt", [5, 12])  # kept whole / evicted down to the budget
def test_opcheck_cache_update_nonempty_past(rt, prompt):
    k_past, v_past = _prefill(rt, prompt)
    gen = torch.Generator().manual_seed(4)
    k_new, v_new = _randn((B, HKV, 1, D), gen, torch.float32), _randn((B, HKV, 1, D), gen, torch.float32)
    opcheck("cache_update", (k_past, v_past, k_new, v_new, None, rt.handle, SITE))
    k, _, kv_pos, q_pos = OP.cache_update(k_past, v_past, k_new, v_new, None, rt.handle, SITE)
    assert k.shape[2] == min(prompt, BUDGET) + 1
    assert q_pos.tolist() == [[prompt]] * B
    assert kv_pos[..., -1].eq(prompt).all()


def test_opcheck_cache_update_foreign_past(rt):
    """A non-empty cache kvpass did not write (no state): its entries are tokens 0..L-1."""
    gen = torch.Generator().manual_seed(5)
    k_past, v_past = _randn((B, HKV, 4, D), gen, torch.float32), _randn((B, HKV, 4, D), gen, torch.float32)
    k_new, v_new = _randn((B, HKV, 2, D), gen, torch.float32), _randn((B, HKV, 2, D), gen, torch.float32)
    m = _hf_padding_mask(2, 6, pad=1)
    opcheck("cache_update", (k_past, v_past, k_new, v_new, m, rt.handle, SITE))
    _, _, kv_pos, q_pos = OP.cache_update(k_past, v_past, k_new, v_new, m, rt.handle, SITE)
    assert q_pos.tolist() == [[4, 5]] * B
    assert kv_pos[0, 0].tolist() == [0, 1, 2, 3, 4, 5] and kv_pos[1, 0].tolist() == [-1, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("prompt", [5, 12])
def test_opcheck_compact_empty_past(rt, prompt):
    gen = torch.Generator().manual_seed(6)
    k_new, v_new, q = (
        _randn((B, HKV, prompt, D), gen, torch.float32),
        _randn((B, HKV, prompt, D), gen, torch.float32),
        _randn((B, H, prompt, D), gen, torch.float32),
    )
    empty = torch.tensor([])
    k, v, kv_pos, q_pos = OP.cache_update(empty, empty, k_new, v_new, None, rt.handle, SITE)
    opcheck("compact", (q, k, v, kv_pos, q_pos, rt.handle, SITE))
    k_st, _ = OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    # opcheck replayed it several times: the state is what one call leaves
    st = rt.state.layer(SITE)
    assert k_st.shape[2] == min(prompt, BUDGET) and st.seen == prompt
    expected = list(range(prompt)) if prompt <= BUDGET else [0, 1] + list(range(prompt - BUDGET + SINKS, prompt))
    assert st.pos[0, 0].tolist() == expected


def test_opcheck_compact_nonempty_past(rt):
    k_past, v_past = _prefill(rt, 12)
    gen = torch.Generator().manual_seed(7)
    k_new, v_new, q = (
        _randn((B, HKV, 1, D), gen, torch.float32),
        _randn((B, HKV, 1, D), gen, torch.float32),
        _randn((B, H, 1, D), gen, torch.float32),
    )
    k, v, kv_pos, q_pos = OP.cache_update(k_past, v_past, k_new, v_new, None, rt.handle, SITE)
    opcheck("compact", (q, k, v, kv_pos, q_pos, rt.handle, SITE))
    k_st, v_st = OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    assert k_st.shape[2] == BUDGET
    assert rt.state.layer(SITE).pos[1, 1].tolist() == [0, 1, 7, 8, 9, 10, 11, 12]
    assert rt.state.layer(SITE).seen == 13
    torch.testing.assert_close(k_st[..., -1, :], k_new[..., -1, :])  # the newest token is kept


def test_opcheck_true_positions(rt):
    opcheck("true_positions", (torch.arange(6)[None], rt.handle, True))  # prefill: unchanged
    _prefill(rt, 12)  # seen 12, stored 8
    derived = torch.tensor([[BUDGET]])  # the model's guess: stored length
    opcheck("true_positions", (derived, rt.handle))
    assert OP.true_positions(derived, rt.handle).tolist() == [[12]]
    derived = torch.arange(BUDGET, BUDGET + 3).view(1, 3, 1)  # another layout, 3 new tokens
    opcheck("true_positions", (derived, rt.handle))
    assert OP.true_positions(derived, rt.handle).flatten().tolist() == [12, 13, 14]
    opcheck("true_positions", (torch.zeros(1, 0, dtype=torch.long), rt.handle))


def test_true_positions_learn_the_first_position_in_the_prefill(rt):
    """OPT looks positions up at +2 and pads from the mask: a left-padded prefill row starts lower. The
    prefill teaches the first position (2), so a decode step's derived ``2 + stored`` becomes ``2 + seen``."""
    padded = torch.tensor([[1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert OP.true_positions(padded, rt.handle, True).tolist() == padded.tolist()
    _prefill(rt, 12)  # seen 12, stored 8
    assert OP.true_positions(torch.tensor([[2 + BUDGET]] * 2), rt.handle).tolist() == [[14]] * 2


def test_opcheck_note_positions(rt):
    """Passed positions of an appending graph: unchanged, and the state counts the appended tokens;
    tokens that start below the tokens seen (generate re-feeding an evicted cache, or positions derived from
    the stored length outside the rewritten graph) are refused."""
    opcheck("note_positions", (torch.tensor([[12]]), rt.handle))  # (repeated calls: before a prefill)
    _prefill(rt, 12)  # seen 12, stored 8
    assert OP.note_positions(torch.tensor([[12]]), rt.handle).tolist() == [[12]]
    with pytest.raises(ValueError, match="this step's position is 8"):
        OP.note_positions(torch.tensor([[BUDGET]]), rt.handle)  # one token at the stored length
    assert OP.note_positions(torch.tensor([[13, 14]]), rt.handle).tolist() == [[13, 14]]
    assert rt.state.seen == 15 and rt.state.stored_tokens()[SITE] == BUDGET + 3
    with pytest.raises(ValueError, match="feeds again the tokens from position 13"):
        OP.note_positions(torch.tensor([[13, 14, 15]]), rt.handle)
    opcheck("note_positions", (torch.zeros(1, 0, dtype=torch.long), rt.handle))


def _decode_args(q, k, v, **kw):
    base = dict(
        mask=None,
        kv_pos=None,
        q_pos=None,
        page_table=None,
        kv_len=None,
        block_map=None,
        scale=0.25,
        softcap=0.0,
        window=0,
        tau=0.1,
        phi=0.1,
        patience=2,
        block=16,
        order=1,
        probe=0,
        horizon=0,
    )
    return (q, k, v, *{**base, **kw}.values())


def _opcheck_decode(op, with_positions):
    gen = torch.Generator().manual_seed(12)
    q, k, v = (
        _randn((B, H, 1, D), gen, torch.float32),
        _randn((B, HKV, 37, D), gen, torch.float32),
        _randn((B, HKV, 37, D), gen, torch.float32),
    )
    kw = {}
    if with_positions:
        kw = dict(
            kv_pos=torch.arange(37).expand(B, HKV, 37).contiguous(),
            q_pos=torch.full((B, 1), 37),
            mask=torch.zeros(B, 1, 1, 37),
            window=20,
            horizon=2,
        )
    opcheck(op, _decode_args(q, k, v, **kw))


@pytest.mark.parametrize("with_positions", [False, True])
def test_opcheck_decode_attention(with_positions):
    """A triton_op: its fake is its own body, which on CPU calls ``decode_attention_ref``."""
    _opcheck_decode("decode_attention", with_positions)


@pytest.mark.parametrize("with_positions", [False, True])
def test_opcheck_decode_attention_ref(with_positions):
    _opcheck_decode("decode_attention_ref", with_positions)


def test_opcheck_count_visits(rt):
    gen = torch.Generator().manual_seed(13)
    out, k = _randn((B, H, 1, D), gen, torch.float32), _randn((B, HKV, 37, D), gen, torch.float32)
    visited = torch.tensor([[2, 3], [1, 3]], dtype=torch.int32)[:B, :HKV]
    opcheck("count_visits", (out, visited, k, 16, rt.handle, SITE))
    assert rt.blocks_read() is not None


def _window_args(softcap: float):
    gen = torch.Generator().manual_seed(14)
    q, k = _randn((B, H, 5, D), gen, torch.float32), _randn((B, HKV, 23, D), gen, torch.float32)
    kv_pos = torch.arange(23).expand(B, HKV, 23).clone()
    kv_pos[1, :, :4] = -1  # left padding in row 1
    return q, k, kv_pos, torch.arange(18, 23).expand(B, 5).contiguous(), D**-0.5, softcap


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_opcheck_window_scores(softcap):
    """A triton_op: its fake is its own body, which on CPU calls ``window_scores_ref``."""
    opcheck("window_scores", _window_args(softcap))


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_opcheck_window_scores_ref(softcap):
    opcheck("window_scores_ref", _window_args(softcap))


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_opcheck_accumulated_scores(softcap):
    """A triton_op (H2O's prompt scoring); same arguments as window_scores."""
    opcheck("accumulated_scores", _window_args(softcap))


@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_opcheck_accumulated_scores_ref(softcap):
    opcheck("accumulated_scores_ref", _window_args(softcap))


def _gather_args():
    gen = torch.Generator().manual_seed(15)
    k, v = _randn((B, HKV, 19, D), gen, torch.float32), _randn((B, HKV, 19, 2 * D), gen, torch.float32)
    idx = torch.stack([torch.randperm(19, generator=gen)[:7].sort().values for _ in range(B * HKV)])
    return k, v, idx.view(B, HKV, 7)


def test_opcheck_gather_kv():
    opcheck("gather_kv", _gather_args())


def test_opcheck_gather_kv_ref():
    opcheck("gather_kv_ref", _gather_args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 3])
def test_opcheck_attention_lse(dtype, ratio):
    gen = torch.Generator().manual_seed(ratio)
    q = _randn((2, 2 * ratio, 9, D), gen, dtype)
    k, v = _randn((2, 2, 9, D), gen, dtype), _randn((2, 2, 9, D), gen, dtype)
    torch.library.opcheck(torch.ops.kvpass.attention_lse.default, (q, k, v, 0.3))


def test_the_registry_holds_every_operator():
    """``kvpass.op_registry.OPS`` (``kvpass.ops.OPS``) is the one registry: every ``kvpass::`` operator the package
    defines (found in the sources, ``tests/test_layout.py``) is in it once kvpass is imported, and nothing else."""
    import kvpass  # noqa: F401  (imports every family, the registry fills)
    import kvpass.compiler.positions  # noqa: F401
    from test_layout import operators

    defined = set(operators()[0])
    assert set(OPS) == defined, (sorted(defined - set(OPS)), sorted(set(OPS) - defined))


def test_every_op_is_opchecked():
    """Every registered operator gets an ``opcheck`` test: a ``test_opcheck_<name>...`` here, or an opcheck
    of ``torch.ops.kvpass.<name>`` in the test file of its family."""
    tests = [name for name in globals() if name.startswith("test_opcheck_")]
    elsewhere = set()
    for path in pathlib.Path(__file__).parent.glob("test_*.py"):
        elsewhere |= set(re.findall(r"opcheck\(\s*torch\.ops\.kvpass\.(\w+)", path.read_text()))
    missing = [op for op in OPS if op not in elsewhere and not any(t.startswith(f"test_opcheck_{op}") for t in tests)]
    assert not missing, f"no opcheck test for: {missing}"


def test_compact_replay_leaves_state_unchanged(rt):
    gen = torch.Generator().manual_seed(8)
    k_new, v_new, q = (
        _randn((B, HKV, 12, D), gen, torch.float32),
        _randn((B, HKV, 12, D), gen, torch.float32),
        _randn((B, H, 12, D), gen, torch.float32),
    )
    empty = torch.tensor([])
    k, v, kv_pos, q_pos = OP.cache_update(empty, empty, k_new, v_new, None, rt.handle, SITE)
    OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    once = rt.state.evicted_tokens
    assert once == B * HKV * (12 - BUDGET)
    OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    assert rt.state.evicted_tokens == once


@settings(max_examples=30, deadline=None)
@given(lq=st.integers(1, 6), extra=st.integers(0, 6), group=st.sampled_from([1, 2, 4]), with_mask=st.booleans())
def test_attention_bottom_right_causal(lq, extra, group, with_mask):
    """causal=2: queries are the last Lq positions; equals an explicit end-aligned tril mask."""
    from kvpass.ops import CAUSAL_BOTTOM_RIGHT

    gen = torch.Generator().manual_seed(lq * 31 + extra)
    lk, hkv, d = lq + extra, 2, 8
    q = torch.randn(1, hkv * group, lq, d, generator=gen)
    k, v = torch.randn(1, hkv, lk, d, generator=gen), torch.randn(1, hkv, lk, d, generator=gen)
    end_aligned = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    mask = torch.rand(1, 1, lq, lk, generator=gen) > 0.3 if with_mask else None
    full_mask = end_aligned if mask is None else (mask & end_aligned)
    got = torch.ops.kvpass.attention(q, k, v, mask, d**-0.5, CAUSAL_BOTTOM_RIGHT, 0.0)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=full_mask | ~full_mask.any(-1, keepdim=True), scale=d**-0.5, enable_gqa=True
    )
    expected = expected.masked_fill(~full_mask.any(-1, keepdim=True), 0.0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if lq == lk:  # equals SDPA's top-left is_causal
        torch.testing.assert_close(
            torch.ops.kvpass.attention(q, k, v, None, d**-0.5, CAUSAL_BOTTOM_RIGHT, 0.0),
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True),
            atol=1e-5,
            rtol=1e-5,
        )


def _bounds_args(seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 1, 24, generator=gen)[:, :, -1]  # strided, GQA group 3, head dim 24
    a, c = torch.randn(2, 2, 5, 24, generator=gen).to(dtype), torch.randn(2, 2, 5, 24, generator=gen).to(dtype)
    return q, torch.minimum(a, c), torch.maximum(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_page_bounds(dtype):
    args = _bounds_args(dtype=dtype)
    opcheck("page_bounds", args)
    torch.testing.assert_close(OP.page_bounds(*args), page_bounds_reference(*args), atol=0, rtol=0)


def test_opcheck_page_bounds_ref():
    opcheck("page_bounds_ref", _bounds_args(1))


def _stamp_args(fill: int):
    """One layer's RaaS tables: 5 pages, prompt page 0, decode window 1-4 all live; ``fill = 15`` evicts."""
    gen = torch.Generator().manual_seed(fill)
    a, c = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    meta = torch.tensor([2, fill, 1, -1]).repeat(2, 2, 1)
    return (
        torch.randn(2, 4, 8, generator=gen),
        torch.randn(2, 2, 8, generator=gen),
        torch.tensor([[40, 0, 0, 1 << 40, 0], [41, 0, 0, 1 << 40, 0]]),
        torch.minimum(a, c),
        torch.maximum(a, c),
        torch.ones(2, 2, 5, dtype=torch.bool),
        torch.randint(0, 40, (2, 2, 5), generator=gen),
        torch.arange(5).repeat(2, 2, 1),
        meta,
        torch.full((2, 2), 39),
        4,
        0.1,
    )


@pytest.mark.parametrize("fill", [3, 15])
def test_opcheck_raas_stamp(fill):
    opcheck("raas_stamp", _stamp_args(fill))


@pytest.mark.parametrize("fill", [3, 15])
def test_opcheck_raas_stamp_ref(fill):
    opcheck("raas_stamp_ref", _stamp_args(fill))


def _top_args(top: int):
    ub = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(top))
    ub[0, 1, :5] = float("-inf")  # fewer eligible pages than top
    return ub, top


@pytest.mark.parametrize("top", [4, 9])
def test_opcheck_top_pages(top):
    opcheck("top_pages", _top_args(top))
    assert torch.equal(OP.top_pages(*_top_args(top)), top_pages_reference(*_top_args(top)))
    zeros = torch.tensor([[-0.0, 0.0, -0.0, 0.0, 1.0]])  # -0.0 ties with +0.0: the lower index wins
    assert top_pages_triton(zeros, 2).tolist() == [[0, 4]]


def test_opcheck_top_pages_ref():
    opcheck("top_pages_ref", _top_args(3))


def test_opcheck_page_select():
    """Quest's page selection, on a runtime whose state a quest prefill filled (tests/test_quest.py)."""
    be = kvpass.backend("quest", compiler="eager", budget=48, dense_layers=0)
    site = SimpleNamespace(layer=SITE, phase="decode", sliding_window=None, cache="dynamic")
    be.runtime.sites[SITE] = site
    gen = torch.Generator().manual_seed(9)
    k = torch.randn(B, HKV, 90, D, generator=gen)
    pos = torch.arange(89).expand(B, HKV, 89)
    _, extra = be.policy.select(site, None, k[:, :, :-1], None, pos, pos[:, 0], None)
    be.runtime.state.set_layer(SITE, pos, 89, fresh=True).extra = extra
    opcheck("page_select", (torch.randn(B, H, 1, D, generator=gen), k, be.runtime.handle, SITE))


def _rope_args():
    gen = torch.Generator().manual_seed(11)
    ang = torch.rand(7, 4, generator=gen) * 20
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return torch.randn(3, 7, 12, generator=gen), cos, sin  # partial rotary: 8 of 12 dims


def test_opcheck_rope_rotate():
    opcheck("rope_rotate", _rope_args())


def test_opcheck_rope_rotate_ref():
    opcheck("rope_rotate_ref", _rope_args())


def _scatter_args():
    gen = torch.Generator().manual_seed(12)
    return torch.randn(3, 9, D, generator=gen), torch.tensor([7, 0, 4]), torch.randn(3, 3, D, generator=gen)


def test_opcheck_scatter_rows():
    opcheck("scatter_rows", _scatter_args())


def test_opcheck_scatter_rows_ref():
    opcheck("scatter_rows_ref", _scatter_args())


def _raas_pool(steps: int):
    """A raas runtime after a 20-token prefill of one layer and ``steps`` decode steps (budget 16)."""
    be = kvpass.backend("raas", compiler="eager", budget=16, alpha=0.05)
    site = SimpleNamespace(layer=SITE, phase="decode", sliding_window=None, cache="dynamic")
    be.runtime.sites[SITE] = site
    gen = torch.Generator().manual_seed(15)
    k_new, v_new = _randn((B, HKV, 20, D), gen, torch.float32), _randn((B, HKV, 20, D), gen, torch.float32)
    k, v, kv_pos, q_pos = OP.cache_update(
        torch.tensor([]), torch.tensor([]), k_new, v_new, None, be.runtime.handle, SITE
    )
    k_pool, v_pool = OP.compact(_randn((B, H, 20, D), gen, torch.float32), k, v, kv_pos, q_pos, be.runtime.handle, SITE)
    for _ in range(steps):
        q_pos = OP.step_position(k_pool, be.runtime.handle, SITE)
        OP.pool_write(
            k_pool,
            v_pool,
            _randn((B, HKV, 1, D), gen, torch.float32),
            _randn((B, HKV, 1, D), gen, torch.float32),
            _randn((B, H, 1, D), gen, torch.float32),
            q_pos,
            be.runtime.handle,
            SITE,
        )
    return be, k_pool, v_pool, gen


def test_opcheck_step_position():
    be, k_pool, _, _ = _raas_pool(3)
    opcheck("step_position", (k_pool, be.runtime.handle, SITE))
    assert OP.step_position(k_pool, be.runtime.handle, SITE).tolist() == [[23]] * B


@pytest.mark.parametrize("steps", [0, 27])  # 27: the pool's decode pages are full, the step evicts
def test_opcheck_pool_write(steps):
    """The in-place write of a raas decode step: opcheck replays it; a replay writes the same slot."""
    be, k_pool, v_pool, gen = _raas_pool(steps)
    handle = be.runtime.handle
    q_pos = OP.step_position(k_pool, handle, SITE)
    args = (
        k_pool,
        v_pool,
        _randn((B, HKV, 1, D), gen, torch.float32),
        _randn((B, HKV, 1, D), gen, torch.float32),
        _randn((B, H, 1, D), gen, torch.float32),
        q_pos,
        handle,
        SITE,
    )
    opcheck("pool_write", args)
    before = k_pool.clone()
    pos = OP.pool_write(*args)
    slot = (pos == 20 + steps).nonzero()
    assert slot.shape[0] == B * HKV  # one slot per (row, head) holds the token
    assert torch.equal(k_pool[slot[:, 0], slot[:, 1], slot[:, 2]], args[2].reshape(B * HKV, D))
    changed = (k_pool != before).any(-1)
    assert int(changed.sum()) <= B * HKV  # nothing else was written
    assert torch.equal(OP.pool_write(*args), pos)  # a replay of the step


def test_opcheck_cache_overwrite():
    import kvpass

    be = kvpass.backend("pie", compiler="eager")  # chunk fusion: new tokens overwrite their slots
    be.runtime.state.fusion = torch.tensor([1, 6, 8])
    gen = torch.Generator().manual_seed(13)
    args = (
        _randn((B, HKV, 9, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
        _randn((B, HKV, 3, D), gen, torch.float32),
        _randn((B, HKV, 3, D), gen, torch.float32),
        be.runtime.handle,
        SITE,
    )
    opcheck("cache_overwrite", args)


def test_opcheck_attention_slots():
    gen = torch.Generator().manual_seed(14)
    q, k, v = (
        _randn((B, H, 3, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
    )
    q_pos = torch.tensor([[1, 6, 8], [0, 4, 5]])
    opcheck("attention_slots", (q, k, v, q_pos, 0.3, 0.0))
    kv_pos = torch.arange(9).expand(B, HKV, 9)
    torch.testing.assert_close(
        OPS["attention_slots"](q, k, v, q_pos, 0.3, 0.0), OPS["attention_pos"](q, k, v, q_pos, kv_pos, 0.3, 0.0, 0)
    )


def test_opcheck_attention_slots_ref():
    gen = torch.Generator().manual_seed(16)
    q, k, v = (
        _randn((B, H, 4, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
    )
    q_pos = torch.tensor([[-1, 2, 6, 8], [0, 4, 5, 12]])  # a row that sees nothing, one past the cache
    opcheck("attention_slots_ref", (q, k, v, q_pos, 0.3, 2.5))
    kv_pos = torch.arange(9).expand(B, HKV, 9)
    torch.testing.assert_close(
        OPS["attention_slots_ref"](q, k, v, q_pos, 0.3, 2.5), OPS["attention_pos"](q, k, v, q_pos, kv_pos, 0.3, 2.5, 0)
    )


def test_opcheck_fusion_votes():
    """Passes the attention output through; with a question window set, keeps that window's votes."""
    import kvpass

    be = kvpass.backend("a3+evict", compiler="eager")
    st = be.runtime.state
    gen = torch.Generator().manual_seed(15)
    out, q, k = (
        _randn((B, H, 3, D), gen, torch.float32),
        _randn((B, H, 3, D), gen, torch.float32),
        _randn((B, HKV, 9, D), gen, torch.float32),
    )
    q_pos = torch.tensor([[1, 6, 8], [0, 4, 5]])
    args = (out, q, k, q_pos, 0.3, 0.0, be.runtime.handle, SITE)
    opcheck("fusion_votes", args)
    assert SITE not in st.fusion_votes  # no window: nothing kept
    st.fusion_window = 2
    torch.testing.assert_close(OPS["fusion_votes"](*args), out)
    kv_pos = torch.arange(9).expand(B, HKV, 9).contiguous()
    want = OPS["window_scores"](q[:, :, -2:], k, kv_pos, q_pos[:, -2:].contiguous(), 0.3, 0.0)
    torch.testing.assert_close(st.fusion_votes[SITE], want)


def test_opcheck_heads_update():
    """A per-head layer (adakv, budget 8): the prompt whole with each head's range, then a decode step whose entry
    follows each head's range in the pool compact laid out."""
    from kvpass.cache import ragged

    be = kvpass.backend("adakv", compiler="eager", budget=BUDGET, window=SINKS)
    rt = be.runtime
    rt.sites[SITE] = SimpleNamespace(
        sliding_window=None, cache="dynamic", layer=SITE, softcap=0.0, phase="prefill", kv_heads=HKV, tp=None
    )
    gen = torch.Generator().manual_seed(8)
    n = 12
    k_new, v_new = _randn((B, HKV, n, D), gen, torch.float32), _randn((B, HKV, n, D), gen, torch.float32)
    q = _randn((B, H, n, D), gen, torch.float32)
    empty = torch.tensor([])
    opcheck("heads_update", (empty, empty, k_new, v_new, None, rt.handle, SITE))
    k, v, kv_pos, q_pos, start, length = OP.heads_update(empty, empty, k_new, v_new, None, rt.handle, SITE)
    assert start.tolist() == [[0, n]] * B and length.tolist() == [[n, n]] * B
    k_st, v_st = OP.compact(q, k, v, kv_pos, q_pos, rt.handle, SITE)
    assert k_st.shape == (B, HKV, BUDGET, D)
    before = rt.state.layer(SITE).extra["heads"].clone()
    assert before[..., ragged.LENGTH].sum(-1).tolist() == [HKV * BUDGET] * B
    k1, v1 = _randn((B, HKV, 1, D), gen, torch.float32), _randn((B, HKV, 1, D), gen, torch.float32)
    opcheck("heads_update", (k_st, v_st, k1, v1, None, rt.handle, SITE))
    k2, _, kv_pos2, q_pos2, start2, length2 = OP.heads_update(k_st, v_st, k1, v1, None, rt.handle, SITE)
    assert k2.shape == (B, HKV, BUDGET + 1, D) and q_pos2.tolist() == [[n]] * B
    assert torch.equal(length2, before[..., ragged.LENGTH] + 1)
    pool, pos = k2.reshape(B, -1, D), kv_pos2.reshape(B, -1)
    for b in range(B):
        for g in range(HKV):
            last = int(start2[b, g] + length2[b, g]) - 1
            assert torch.equal(pool[b, last], k1[b, g, 0]) and int(pos[b, last]) == n
