"""``kvpass::accumulated_scores`` (H2O's prefill scorer): its Triton kernel against its reference, and the
reference against what h2o computed before it, ``kvpass::window_scores`` over chunks of the prompt's queries.

Without a GPU the kernel runs in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) at
tiny shapes and blocks of 16 or 32, so that a prompt spans several query and key blocks; the interpreter
computes bf16 dots wrongly, so the kernel upcasts there while inputs still come in fp16 / bf16 / fp32.

Positions come in five kinds: ``causal`` (a prompt, ``0..L-1``), ``padded`` (kvpass's left padding: the
first keys of a row at -1, positions unshifted), ``shifted`` (padding at -1 and the real tokens renumbered
from 0, so the padding queries have negative positions), ``evicted`` (a cache that kept an ascending subset
of the tokens, queried by the last few) and ``scrambled`` (positions in no order, which only the masks
handle: the block ranges must still cover every tile that can contribute).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpass  # noqa: F401  (registers the kvpass:: operators)
from kvpass.kernels import accumulated_scores as A
from kvpass.policies.scored import received as accumulated

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}
KINDS = ["causal", "padded", "shifted", "evicted", "scrambled"]


def case(b, hkv, group, n, d, dtype, kind, pads, seed, queries=None):
    """``(q, k, kv_pos, q_pos)``; ``pads[i]`` padding entries in row ``i``; ``queries`` for evicted caches."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hkv * group, n if queries is None else queries, d, generator=g) * 1.5).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    q_pos = torch.arange(n).expand(b, n).clone()
    if kind in ("padded", "shifted"):
        for row, p in enumerate(pads):
            p = min(p, n)
            kv_pos[row, :, :p] = -1
            if kind == "shifted":
                kv_pos[row, :, p:] -= p
                q_pos[row] -= p
    elif kind == "evicted":  # n kept of `seen` tokens, ascending, per row and head; the last queries ask
        lq = q.shape[2]
        seen = n + 3 * n // 2
        q_pos = torch.arange(seen - lq, seen).expand(b, lq).clone()
        for row in range(b):
            for head in range(hkv):  # older entries kept at random, then the queries' own keys
                older = torch.randperm(seen - lq, generator=g)[: n - lq].sort().values
                kv_pos[row, head] = torch.cat([older, q_pos[row]])
    elif kind == "scrambled":
        kv_pos = torch.stack([torch.randperm(n, generator=g) for _ in range(b * hkv)]).view(b, hkv, n)
        kv_pos[kv_pos < pads[0] // 3] = -1
        q_pos = torch.stack([torch.randperm(n, generator=g) for _ in range(b)])
    return q, k, kv_pos, q_pos.contiguous()


def window_accumulated(q, k, kv_pos, q_pos, scale, softcap, rows=5):
    """h2o's scoring before ``accumulated_scores``: ``kvpass::window_scores`` summed over chunks of queries."""
    total = 0
    for s in range(0, q.shape[2], rows):
        total = total + torch.ops.kvpass.window_scores(
            q[:, :, s : s + rows], k, kv_pos, q_pos[:, s : s + rows].contiguous(), scale, softcap
        )
    return total


shapes = dict(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 4),
    n=st.integers(1, 70),
    dtype=st.sampled_from(list(TOL)),
    softcap=st.sampled_from([0.0, 2.5]),
    kind=st.sampled_from(KINDS),
    pads=st.lists(st.integers(0, 40), min_size=2, max_size=2),
    seed=st.integers(0, 10_000),
)


@SETTINGS
@given(d=st.sampled_from([16, 32]), blocks=st.sampled_from([(16, 16), (16, 32), (32, 16)]), **shapes)
def test_kernel_equals_reference(b, hkv, group, n, d, dtype, softcap, kind, pads, seed, blocks):
    queries = max(1, n // 3) if kind == "evicted" else None
    q, k, kv_pos, q_pos = case(b, hkv, group, n, d, dtype, kind, pads[:b], seed, queries)
    want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.3, softcap)
    got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.3, softcap, block_m=blocks[0], block_n=blocks[1])
    assert got.dtype == torch.float32 and got.shape == (b, hkv, n)
    torch.testing.assert_close(got, want, atol=TOL[dtype] * group * q.shape[2] ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_equals_reference_over_many_blocks(kind):
    """The largest shape of the hypothesis test, every kind of positions: 5 x 5 blocks, GQA 4, bf16."""
    q, k, kv_pos, q_pos = case(2, 2, 4, 70, 32, torch.bfloat16, kind, [13, 40], 7, 20 if kind == "evicted" else None)
    for softcap in (0.0, 2.5):
        want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.2, softcap)
        got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.2, softcap, block_m=16, block_n=16)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([8, 16]), **shapes)
def test_reference_equals_chunked_window_scores(b, hkv, group, n, d, dtype, softcap, kind, pads, seed):
    """Same semantics as h2o's scoring before this operator (a sum of window scores over query chunks)."""
    queries = max(1, n // 3) if kind == "evicted" else None
    q, k, kv_pos, q_pos = case(b, hkv, group, n, d, dtype, kind, pads[:b], seed, queries)
    want = window_accumulated(q, k, kv_pos, q_pos, 0.3, softcap)
    got = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.3, softcap, rows=7)
    torch.testing.assert_close(got, want, atol=1e-5 * group * q.shape[2] ** 0.5, rtol=1e-5)
    # h2o calls the operator (the reference on CPU) with the scale folded into q
    torch.testing.assert_close(accumulated(q.float() * 0.3, k, kv_pos, q_pos, softcap), got, atol=1e-4, rtol=1e-4)


def test_reference_chunking_does_not_change_the_result():
    q, k, kv_pos, q_pos = case(2, 2, 3, 45, 16, torch.float32, "padded", [0, 9], 1)
    whole = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.25)
    for rows in (1, 4, 44):
        torch.testing.assert_close(A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.25, rows=rows), whole)


def test_rows_that_see_nothing_add_nothing():
    """Every row that sees a key hands out exactly one unit per query head; padding is never scored."""
    b, hkv, group, n, pad = 2, 2, 3, 40, 11
    q, k, kv_pos, q_pos = case(b, hkv, group, n, 16, torch.float32, "shifted", [pad, 0], 2)
    got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.25, block_m=16, block_n=16)
    torch.testing.assert_close(got, A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.25), atol=1e-5, rtol=1e-5)
    assert got[0, :, :pad].eq(0).all()
    want = torch.tensor([[group * (n - pad)] * hkv, [group * n] * hkv], dtype=torch.float32)
    torch.testing.assert_close(got.sum(-1), want)
    # the last key of a plain prompt is seen by its own query alone
    q, k, kv_pos, q_pos = case(1, 1, 2, 33, 16, torch.float32, "causal", [0], 3)
    got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.25, block_m=16, block_n=16)
    want = torch.softmax(q[0, :, -1].float() @ k[0, 0].float().T * 0.25, -1)[:, -1].sum()
    torch.testing.assert_close(got[0, 0, -1], want)


def test_plain_prompt_visits_the_causal_triangle():
    """Positions 0..L-1: pass 1 stops at the diagonal, pass 2 starts there, and only the diagonal tiles take
    the position mask; a block of padding only is never visited, a block with any padding always masked."""
    n, bm, bn = 64, 16, 16
    kv_pos = torch.arange(n).expand(1, 2, n).clone()
    q_pos = torch.arange(n).expand(1, n).contiguous()
    r = A.block_ranges(kv_pos, q_pos, bm, bn)
    blocks = torch.arange(n // bm, dtype=torch.int32).expand(1, 2, -1)
    assert r.k_lo.eq(0).all() and torch.equal(r.k_hi, blocks + 1) and torch.equal(r.k_full, blocks)
    assert torch.equal(r.q_lo, blocks) and r.q_hi.eq(n // bm).all() and torch.equal(r.q_full, blocks + 1)
    kv_pos[0, 1, :20] = -1  # head 1: its first key block holds only padding, its second some
    r = A.block_ranges(kv_pos, q_pos, bm, bn)
    assert r.q_lo[0, 1, 0] >= r.q_hi[0, 1, 0]  # no query visits key block 0
    assert r.k_lo[0, 1, 0] >= r.k_hi[0, 1, 0]  # query block 0 sees nothing at all
    assert r.k_lo[0, 1, 1:].eq(1).all() and torch.equal(r.k_hi[0, 1, 1:], torch.tensor([2, 3, 4], dtype=torch.int32))
    assert torch.equal(r.k_full[0, 1], r.k_lo[0, 1])  # pass 1 meets block 1 first: all masked
    assert r.q_full[0, 1, 1] == r.q_hi[0, 1, 1]  # block 1 is masked for every query block
    assert torch.equal(r.q_full[0, 1, 2:], torch.tensor([3, 4], dtype=torch.int32))
    # a ragged end: the last key block is partial, so it is always masked
    r = A.block_ranges(torch.arange(40).expand(1, 1, 40), torch.arange(40).expand(1, 40), 16, 16)
    assert r.q_full[0, 0, 2] == r.q_hi[0, 0, 2] and torch.equal(
        r.k_full[0, 0], torch.tensor([0, 1, 2], dtype=torch.int32)
    )


def test_strided_queries_and_keys():
    """q and k as the model hands them over: views of ``[B, L, H, D]`` projections."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 50, 4, 16, generator=g).transpose(1, 2)
    k = torch.randn(2, 50, 2, 16, generator=g).transpose(1, 2)
    kv_pos = torch.arange(50).expand(2, 2, 50)  # a broadcast view: stride 0 over batch and heads
    q_pos = torch.arange(50).expand(2, 50)
    want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.25)
    got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.25, block_m=16, block_n=32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 4),
    n=st.integers(1, 70),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 10_000),
)
def test_given_row_statistics_replace_the_first_pass(b, hkv, group, n, dtype, seed):
    """A plain prompt's rows' log-sum-exp from the prefill's attention (``kvpass::attention_lse``, here its
    reference) in place of pass 1: the same scores, in the kernel and in the reference."""
    q, k, kv_pos, q_pos = case(b, hkv, group, n, 16, dtype, "causal", [0, 0], seed)
    _, lse = torch.ops.kvpass.attention_lse(q, k, k, 0.3)
    want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.3)
    tol = dict(atol=TOL[dtype] * group * n**0.5, rtol=1e-4)
    torch.testing.assert_close(A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.3, lse=lse, rows=9), want, **tol)
    got = A.accumulated_scores_triton(q, k, kv_pos, q_pos, 0.3, block_m=16, block_n=16, lse=lse)
    torch.testing.assert_close(got, want, **tol)
    # every row hands out one unit per query head: the statistics were those of the keys it sees
    torch.testing.assert_close(got.sum(-1), torch.full((b, hkv), float(group * n)), atol=1e-3 * n, rtol=1e-4)


def test_attention_lse_is_attention_and_its_log_sum_exp():
    from kvpass import ops

    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 6, 21, 16, generator=g),
        torch.randn(2, 2, 21, 16, generator=g),
        torch.randn(2, 2, 21, 16, generator=g),
    )
    out, lse = torch.ops.kvpass.attention_lse(q, k, v, 0.3)
    torch.testing.assert_close(out, ops.attention_reference(q, k, v, None, 0.3, ops.CAUSAL_TOP_LEFT))
    logits = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3
    visible = torch.ones(21, 21, dtype=torch.bool).tril()
    torch.testing.assert_close(lse, logits.masked_fill(~visible, float("-inf")).logsumexp(-1))


def test_op_is_the_reference_on_cpu():
    q, k, kv_pos, q_pos = case(1, 2, 2, 30, 16, torch.float32, "padded", [3], 1)
    got = torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, 0.25, 0.0)
    assert torch.equal(got, A.accumulated_scores_reference(q, k, kv_pos, q_pos, 0.25))


@pytest.mark.parametrize("op", ["accumulated_scores", "accumulated_scores_ref"])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_opcheck(op, softcap):
    """A triton_op: its fake is its own body, which on CPU calls ``accumulated_scores_ref``."""
    q, k, kv_pos, q_pos = case(2, 2, 2, 23, 8, torch.float32, "padded", [0, 4], 6)
    torch.library.opcheck(getattr(torch.ops.kvpass, op).default, (q, k, kv_pos, q_pos, 0.35, softcap))
    q, k, kv_pos, q_pos = case(2, 2, 2, 23, 8, torch.float32, "causal", [0, 0], 6)
    lse = torch.ops.kvpass.attention_lse(q, k, k, 0.35)[1]
    torch.library.opcheck(getattr(torch.ops.kvpass, op).default, (q, k, kv_pos, q_pos, 0.35, softcap, lse))
