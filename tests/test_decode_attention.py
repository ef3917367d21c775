"""The ART decode-attention kernel against its reference, and the properties ART promises.

Without a GPU the Triton kernel runs in Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), called directly at tiny shapes. The interpreter computes bf16 dots wrongly,
so the kernel upcasts to fp32 there; inputs still come in fp16 / bf16 / fp32.

Kernel == reference is checked on exact outputs and on the blocks each program read. ART decisions
compare tiny float differences with thresholds, so the cases with ART on run in fp32 (where both
sides agree to ~1e-7) and draw thresholds far from any knife edge only by chance; the reduced
precisions run without termination.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpass import ops
from kvpass.kernels import decode_attention as K

pytestmark = pytest.mark.skipif(K.triton is None, reason="needs Triton")
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# interpreted Triton kernels on the CPU: few examples each (CI time; tests/gpu runs the kernels at size)
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def qkv(b, h, hkv, length, d, dtype, seed, structured=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g)
    k = torch.randn(b, hkv, length, d, generator=g)
    v = torch.randn(b, hkv, length, d, generator=g)
    if structured:  # a few keys aligned with the query dominate: attention that converges early
        hot = torch.randint(0, length, (3,), generator=g)
        k[:, :, hot] += 4 * q.reshape(b, hkv, h // hkv, d).mean(2, keepdim=True)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run_both(q, k, v, split=None, **kw):
    out_k, vis_k = K.decode_attention_triton(q, k, v, split=split, **kw)
    out_r, vis_r = K.decode_attention_reference(q, k, v, **kw)
    return out_k, vis_k, out_r, vis_r


def exact(q, k, v, mask=None, scale=None):
    return ops.attention_reference(q, k, v, mask, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))


shapes = st.tuples(
    st.integers(1, 2),
    st.sampled_from([(1, 1), (4, 2), (6, 2), (8, 1)]),
    st.integers(1, 150),
    st.sampled_from([16, 32, 24]),
)


@SETTINGS
@given(
    shape=shapes,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    block=st.sampled_from([16, 32]),
    order=st.sampled_from([0, 1]),
    split=st.booleans(),
    softcap=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 10_000),
)
def test_kernel_equals_reference_full_read(shape, dtype, block, order, split, softcap, seed):
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, dtype, seed)
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, split=split, block=block, order=order, softcap=softcap)
    assert out_k.dtype == dtype and out_k.shape == (b, h, 1, d)
    torch.testing.assert_close(out_k.float(), out_r.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(vis_k, vis_r) and (vis_r == -(-length // block)).all()


@SETTINGS
@given(
    shape=shapes,
    block=st.sampled_from([16, 32]),
    tau=st.sampled_from([1e-3, 1e-2, 0.1, 0.5]),
    phi=st.sampled_from([1e-4, 1e-2, 0.3]),
    patience=st.integers(1, 3),
    structured=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_kernel_equals_reference_with_termination(shape, block, tau, phi, patience, structured, seed):
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured)
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, block=block, tau=tau, phi=phi, patience=patience)
    assert torch.equal(vis_k, vis_r)
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(
    shape=shapes,
    tau=st.sampled_from([1e-2, 0.1, 0.5]),
    patience=st.integers(1, 3),
    horizon=st.integers(1, 6),
    structured=st.booleans(),
    parallel=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_horizon_kernel_equals_reference(shape, tau, patience, horizon, structured, parallel, seed):
    """The horizon launch (stop rule over the first steps, the rest split-KV and merged) equals the
    sequential reference with the same horizon, with the horizon read serially or one block per
    program and scanned."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured)
    kw = dict(block=16, tau=tau, phi=0.3, patience=patience, horizon=horizon)
    out_k, vis_k = K.decode_attention_triton(q, k, v, parallel_horizon=parallel, **kw)
    out_r, vis_r = K.decode_attention_reference(q, k, v, **kw)
    assert torch.equal(vis_k, vis_r)
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-5)


@settings(SETTINGS, max_examples=6)
@given(
    shape=shapes,
    combine=st.sampled_from([2, 4]),
    sms=st.sampled_from([2, 5]),
    horizon=st.integers(0, 4),
    seed=st.integers(0, 10_000),
)
def test_combine_merges_parts_in_blocks(shape, combine, sms, horizon, seed):
    """The combine merges its parts ``COMBINE_BLOCK`` at a time: blocks that end past the last part, empty
    splits, and a first part after the horizon's steps give the reference's output."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "COMBINE_BLOCK", combine)
        mp.setattr(K, "_sms", lambda device: sms)
        mp.setattr(K, "_split_slots", lambda device: 4 * sms)
        kw = dict(block=16, tau=0.1, phi=0.3, patience=2, horizon=horizon) if horizon else dict(block=16)
        out_k, vis_k, out_r, vis_r = run_both(q, k, v, **kw)
    assert torch.equal(vis_k, vis_r)
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-5)


@SETTINGS
@given(shape=shapes, tau=st.sampled_from([1e-2, 0.1, 0.5]), horizon=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_horizon_stops_as_art_or_reads_everything(shape, tau, horizon, seed):
    """With a horizon a read either stops where sequential ART stops (inside the horizon) or reads
    every block; a horizon past the last block is plain ART."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    kw = dict(block=16, tau=tau, phi=0.3, patience=2)
    _, seq = K.decode_attention_reference(q, k, v, **kw)
    _, hor = K.decode_attention_reference(q, k, v, horizon=horizon, **kw)
    n = -(-length // 16)
    assert torch.where(seq <= horizon, hor == seq, hor == n).all(), (seq, hor)
    _, beyond = K.decode_attention_reference(q, k, v, horizon=n, **kw)
    assert torch.equal(beyond, seq)


@SETTINGS
@given(
    b=st.integers(1, 3),
    length=st.integers(20, 120),
    window=st.sampled_from([0, 9, 40]),
    seed=st.integers(0, 10_000),
    pad=st.integers(0, 7),
)
def test_positions_lengths_and_masks(b, length, window, seed, pad):
    """kv_pos/q_pos visibility (evicted gaps, padding, a sliding window), kv_len and an additive
    mask give what exact attention gives with the equivalent boolean mask."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = qkv(b, 4, 2, length, 16, torch.float32, seed)
    kv_pos = torch.sort(torch.randperm(3 * length, generator=g)[:length]).values.expand(b, 2, length).clone()
    kv_pos[:, :, :pad] = -1  # left padding
    q_pos = kv_pos[:, 0, -1:].clone().view(b, 1) + 1
    kv_len = torch.randint(1, length + 1, (b,), generator=g)
    add = torch.randn(b, 1, 1, length, generator=g)
    vis, _ = K.visibility(b, 2, length, "cpu", None, kv_pos, q_pos, kv_len, window)
    want = exact(q, k, v, mask=torch.where(vis[:, :, None, :].repeat_interleave(2, 1), add, float("-inf")))
    out_k, vis_k, out_r, vis_r = run_both(
        q, k, v, mask=add, kv_pos=kv_pos, q_pos=q_pos, kv_len=kv_len, window=window, block=16
    )
    torch.testing.assert_close(out_r, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_k, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(vis_k, vis_r) and torch.equal(vis_k[:, 0], (-(-kv_len // 16)).int())


@SETTINGS
@given(
    b=st.integers(1, 2),
    pages=st.integers(1, 6),
    page=st.sampled_from([8, 16]),
    seed=st.integers(0, 10_000),
    tau=st.sampled_from([0.0, 0.2]),
)
def test_paged_equals_contiguous(b, pages, page, seed, tau):
    """A paged cache (shuffled pool pages, ragged lengths) reads like its contiguous gather."""
    g = torch.Generator().manual_seed(seed)
    pool = 2 * b * pages + 1
    q = torch.randn(b, 4, 1, 16, generator=g)
    kp, vp = torch.randn(pool, 2, page, 16, generator=g), torch.randn(pool, 2, page, 16, generator=g)
    table = torch.randperm(pool, generator=g)[: b * pages].view(b, pages).int()
    kv_len = torch.randint(1, pages * page + 1, (b,), generator=g)
    kw = dict(kv_len=kv_len, block=16, tau=tau, phi=tau, patience=1)
    out_p, vis_p = K.decode_attention_triton(q, kp, vp, page_table=table, **kw)
    kc, vc = K._logical(kp, table), K._logical(vp, table)
    out_c, vis_c = K.decode_attention_reference(q, kc, vc, **kw)
    torch.testing.assert_close(out_p, out_c, atol=2e-5, rtol=2e-5)
    assert torch.equal(vis_p, vis_c)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_no_termination_is_exact_attention(shape, seed):
    """tau = phi = 0 (and either alone at 0) never stops: the result is exact attention."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    want = exact(q, k, v)
    for tau, phi in ((0.0, 0.0), (0.0, 0.9), (0.9, 0.0)):
        out, vis = K.decode_attention_reference(q, k, v, block=16, tau=tau, phi=phi, patience=1)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        assert (vis == -(-length // 16)).all()
    out, _ = K.decode_attention_triton(q, k, v, block=16, tau=0.0, phi=0.0)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 10_000))
def test_block_order_does_not_matter_without_skipping(shape, seed):
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed)
    nb = -(-length // 16)
    perm = (
        torch.stack([torch.randperm(nb, generator=torch.Generator().manual_seed(seed + i)) for i in range(b * hkv)])
        .view(b, hkv, nb)
        .int()
    )
    base, _ = K.decode_attention_triton(q, k, v, block=16, order=K.ORDER_NATURAL)
    for kw in (dict(order=K.ORDER_RECENCY), dict(block_map=perm)):
        out, vis = K.decode_attention_triton(q, k, v, block=16, **kw)
        torch.testing.assert_close(out, base, atol=2e-5, rtol=2e-5)
        out_r, _ = K.decode_attention_reference(q, k, v, block=16, **kw)
        torch.testing.assert_close(out_r, base, atol=2e-5, rtol=2e-5)


@SETTINGS
@given(shape=shapes, tau=st.sampled_from([0.05, 0.3, 0.9]), patience=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_output_is_exact_attention_over_the_blocks_read(shape, tau, patience, seed):
    """Block 0 first, then recency: after v visits the output is exact attention over blocks
    {0, n-1, ..., n-v+1} -- block 0 is always among them."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    out, vis = K.decode_attention_triton(q, k, v, block=16, tau=tau, phi=tau, patience=patience)
    nb = -(-length // 16)
    assert (vis >= 1).all()
    for bi in range(b):
        for g in range(hkv):
            n = int(vis[bi, g])
            blocks = [0] + list(range(nb - 1, nb - n, -1))
            read = torch.zeros(length, dtype=torch.bool)
            for j in blocks:
                read[16 * j : 16 * (j + 1)] = True
            heads = slice(g * (h // hkv), (g + 1) * (h // hkv))
            want = exact(
                q[bi : bi + 1, heads],
                k[bi : bi + 1, g : g + 1],
                v[bi : bi + 1, g : g + 1],
                mask=read.view(1, 1, 1, length),
            )
            torch.testing.assert_close(out[bi : bi + 1, heads], want, atol=2e-5, rtol=2e-5)


@settings(SETTINGS, max_examples=6)  # five interpreted kernel runs per example (CI time)
@given(shape=shapes, seed=st.integers(0, 10_000), structured=st.booleans())
def test_raising_thresholds_never_reads_more(shape, seed, structured):
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured)
    last = None
    for tau, phi in ((1e-3, 1e-3), (1e-2, 1e-3), (1e-2, 1e-1), (0.3, 0.1), (0.3, 0.5)):
        _, vis = K.decode_attention_triton(q, k, v, block=16, tau=tau, phi=phi, patience=2)
        if last is not None:
            assert (vis <= last).all()
        last = vis


def test_real_skipping_happens_on_converging_attention():
    """A concentrated attention pattern stops early: the test above cannot pass vacuously."""
    q, k, v = qkv(1, 4, 2, 400, 16, torch.float32, 0)
    q = q[:, [0, 0, 2, 2]]  # the heads of a group agree ...
    k *= 0.1  # ... attention is flat everywhere ...
    k[:, :, :4] = 2 * q[:, ::2]  # ... but sinks in block 0 dominate
    _, vis = K.decode_attention_triton(q, k, v, block=16, tau=0.05, phi=0.01, patience=2)
    assert (vis < 10).all() and (vis >= 3).all(), vis


def test_few_programs_take_enough_splits_to_fill_the_gpu(monkeypatch):
    """A tensor-parallel rank's share at batch 1 (4 KV heads, or 1) still launches about one program per SM
    at 128k (132 on an H200) and never a partial second wave (a few programs as long as the first wave's),
    never past the cap; the many-split launch, empty splits included, is exact."""
    monkeypatch.setattr(K, "_split_slots", lambda device: 132)
    for blocks in (131072 // 128, 16, 1):
        for programs in (1, 2, 3, 4, 8, 32, 132, 200):
            splits = K.num_splits(programs, torch.device("cpu"))
            used = -(-blocks // -(-blocks // splits))  # splits that read anything
            assert 1 <= splits <= K.MAX_SPLITS and programs * splits <= max(132, programs), (programs, splits)
            assert programs * splits >= min(132 - programs + 1, programs * K.MAX_SPLITS), (programs, splits)
            assert programs * used >= 0.9 * min(132, programs * blocks, programs * K.MAX_SPLITS), (programs, blocks)
    assert [K.num_splits(p, torch.device("cpu")) for p in (4, 8, 16, 32)] == [33, 16, 8, 4]
    # one program over 38 blocks of 4: 8 splits of 5 (the last one of 3) with 8 slots, 38 of 1 with 132
    q, k, v = qkv(1, 4, 1, 150, 16, torch.float32, 5)
    for slots in (132, 8):
        monkeypatch.setattr(K, "_split_slots", lambda device, n=slots: n)
        out_k, vis_k, out_r, vis_r = run_both(q, k, v, split=True, block=4)
        torch.testing.assert_close(out_k, out_r, atol=TOL[torch.float32], rtol=TOL[torch.float32])
        assert torch.equal(vis_k, vis_r)


def test_split_with_termination_needs_a_horizon():
    q, k, v = qkv(1, 2, 1, 40, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="horizon"):
        K.decode_attention_triton(q, k, v, tau=0.1, phi=0.1, split=True)


def test_op_is_the_reference_on_cpu():
    q, k, v = qkv(1, 4, 2, 50, 16, torch.float32, 1)
    out, vis = torch.ops.kvpass.decode_attention(
        q, k, v, None, None, None, None, None, None, 0.25, 0.0, 0, 0.1, 0.1, 2, 16, 1, 0, 0
    )
    ref, vref = K.decode_attention_reference(q, k, v, scale=0.25, tau=0.1, phi=0.1, patience=2, block=16)
    assert torch.equal(out, ref) and torch.equal(vis, vref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_masked_tail_never_ends_the_read(dtype):
    """A static cache's unfilled tail (masked with the dtype's minimum, HF style) is read first in
    recency order; empty blocks must be neutral, or ART would stop after block 0."""
    q, k, v = qkv(1, 4, 2, 160, 16, torch.float32, 5)
    keep = torch.arange(160) < 60
    mask = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype).view(1, 1, 1, 160)
    kw = dict(mask=mask, block=16, tau=0.99, phi=0.99, patience=2)
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, **kw)
    assert torch.equal(vis_k, vis_r) and (vis_k >= 1 + 6 + 2).all()  # block 0, six empty, two real
    full, _ = K.decode_attention_reference(q, k, v, mask=mask, block=16)
    torch.testing.assert_close(full, exact(q, k, v, mask=keep.view(1, 1, 1, 160)), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_k, out_r, atol=2e-5, rtol=2e-5)


def selection(b, hkv, nb, steps, seed):
    """A map of ``steps`` columns per (sequence, KV head): a random subset of the blocks (at most
    ``steps``, possibly none) first, then -1 padding, with a -1 also placed inside some rows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b * hkv):
        n = int(torch.randint(0, min(steps, nb) + 1, (1,), generator=g))
        row = torch.full((steps,), -1, dtype=torch.int32)
        row[:n] = torch.randperm(nb, generator=g)[:n].int()
        if n >= 2 and bool(torch.rand(1, generator=g) < 0.5):  # a hole inside the selection
            row[1:n] = torch.cat([torch.tensor([-1], dtype=torch.int32), row[1 : n - 1]])
        rows.append(row)
    return torch.stack(rows).view(b, hkv, steps)


@SETTINGS
@given(shape=shapes, steps=st.integers(1, 6), split=st.booleans(), positions=st.booleans(), seed=st.integers(0, 10_000))
def test_block_map_reads_only_the_selected_blocks(shape, steps, split, positions, seed):
    """A map with fewer steps than blocks and -1 padding: kernel == reference == exact attention over
    the selected blocks of each KV head, and ``visited`` counts the selected blocks only."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    nb = -(-length // 16)
    bmap = selection(b, hkv, nb, steps, seed)
    kw = dict(block=16, block_map=bmap)
    read = torch.zeros(b, hkv, length, dtype=torch.bool)
    for bi in range(b):
        for g in range(hkv):
            for j in bmap[bi, g].tolist():
                if j >= 0:
                    read[bi, g, 16 * j : 16 * (j + 1)] = True
    if positions:  # the evicting path's masks: a few entries hidden by position -1
        kv_pos = torch.arange(length).expand(b, hkv, length).clone()
        kv_pos[:, :, ::7] = -1
        kw.update(kv_pos=kv_pos, q_pos=torch.full((b, 1), length - 1))
        read &= kv_pos >= 0
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, split=split, **kw)
    torch.testing.assert_close(out_k, out_r, atol=2e-5, rtol=2e-5)
    assert torch.equal(vis_k, vis_r) and torch.equal(vis_r, (bmap >= 0).sum(-1).int())
    g_ = h // hkv
    want = ops.attention_reference(q, k, v, read.repeat_interleave(g_, dim=1)[:, :, None, :], 1 / math.sqrt(d))
    torch.testing.assert_close(out_r, want, atol=2e-5, rtol=2e-5)


@SETTINGS
@given(
    shape=shapes,
    steps=st.integers(1, 6),
    tau=st.sampled_from([1e-2, 0.3]),
    patience=st.integers(1, 2),
    seed=st.integers(0, 10_000),
)
def test_block_map_with_termination_equals_reference(shape, steps, tau, patience, seed):
    """ART over a selection: skipped (-1) steps are neutral for the stop rule, in both implementations."""
    b, (h, hkv), length, d = shape
    q, k, v = qkv(b, h, hkv, length, d, torch.float32, seed, structured=True)
    bmap = selection(b, hkv, -(-length // 16), steps, seed)
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, block=16, block_map=bmap, tau=tau, phi=tau, patience=patience)
    assert torch.equal(vis_k, vis_r) and (vis_r <= (bmap >= 0).sum(-1)).all()
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-5)


def test_block_map_op_on_cpu_and_opcheck():
    """The op with a short map (fewer steps than blocks) is the reference on CPU, and opcheck passes."""
    q, k, v = qkv(2, 4, 2, 70, 16, torch.float32, 3)
    bmap = torch.tensor([[[4, 0, -1], [-1, -1, -1]], [[2, 3, 1], [1, -1, -1]]], dtype=torch.int32)
    args = (q, k, v, None, None, None, None, None, bmap, 0.25, 0.0, 0, 0.0, 0.0, 5, 16, 2, 0, 0)
    out, vis = torch.ops.kvpass.decode_attention(*args)
    ref, vref = K.decode_attention_reference(q, k, v, block_map=bmap, scale=0.25, block=16)
    assert torch.equal(out, ref) and vis.tolist() == [[2, 0], [3, 1]] and torch.equal(vis, vref)
    assert (out[0, 2:] == 0).all()  # a KV head with nothing selected reads nothing: zeros
    torch.library.opcheck(torch.ops.kvpass.decode_attention_ref.default, args)
    torch.library.opcheck(torch.ops.kvpass.decode_attention.default, args)


# ------------------------------------------------------------------------------------------------
# ragged heads: per-head ranges in a pool a row's KV heads share (per-head budgets)
# ------------------------------------------------------------------------------------------------


def ragged_pool(b, hkv, d, lengths, seed, slack=3):
    """A row pool ``[B, 1, S, D]`` holding each head's ``lengths[b][g]`` entries from a start of its own: the
    heads in a shuffled order, each range followed by ``slack`` unfilled slots (position -1, garbage keys)."""
    g = torch.Generator().manual_seed(seed)
    size = max(sum(row) for row in lengths) + hkv * slack
    k, v = torch.randn(b, 1, size, d, generator=g), torch.randn(b, 1, size, d, generator=g)
    pos = torch.full((b, 1, size), -1, dtype=torch.int32)
    start = torch.zeros(b, hkv, dtype=torch.int32)
    for r in range(b):
        at = 0
        for head in torch.randperm(hkv, generator=g).tolist():
            n = lengths[r][head]
            start[r, head] = at
            pos[r, 0, at : at + n] = torch.sort(torch.randperm(4 * size, generator=g)[:n]).values.int()
            at += n + slack
    return k, v, pos, start, torch.tensor(lengths, dtype=torch.int32)


def heads_alone(q, k, v, pos, start, kv_len, q_pos):
    """Each head over its own entries, by exact attention (the ragged layout's meaning)."""
    b, h, _, d = q.shape
    hkv = start.shape[1]
    out = torch.zeros(b, h, 1, d)
    for r in range(b):
        for head in range(hkv):
            s, n = int(start[r, head]), int(kv_len[r, head])
            rows = slice(head * (h // hkv), (head + 1) * (h // hkv))
            see = (pos[r, 0, s : s + n] >= 0) & (pos[r, 0, s : s + n] <= q_pos[r])
            if see.any():
                out[r, rows] = exact(
                    q[r : r + 1, rows],
                    k[r : r + 1, :, s : s + n],
                    v[r : r + 1, :, s : s + n],
                    mask=see.view(1, 1, 1, n),
                )[0]
    return out


@SETTINGS
@given(
    b=st.integers(1, 3),
    heads=st.sampled_from([(2, 2), (4, 2), (8, 4), (3, 1)]),
    d=st.sampled_from([16, 24]),
    data=st.data(),
    block=st.sampled_from([8, 16]),
    order=st.sampled_from([K.ORDER_NATURAL, K.ORDER_RECENCY]),
    split=st.sampled_from([None, False]),
    scale=st.sampled_from([1, 3]),
    floor=st.sampled_from([1, 4]),
    seed=st.integers(0, 10_000),
)
def test_ragged_heads_read_each_heads_own_range(b, heads, d, data, block, order, split, scale, floor, seed):
    """Heads of one row keep different counts (one at 8x another, one at its floor of a single entry, one with
    none visible): kernel == reference == each head's exact attention over its own entries, and each program
    reads the blocks of its own range alone, at the kernel's split count and at a multiple of it, with a floor of
    splits per head slot or none (``RAGGED_SPLIT_SCALE`` and ``RAGGED_MIN_HEAD_SPLITS``, which the kernel benchmark
    sweeps)."""
    h, hkv = heads
    lengths = data.draw(st.lists(st.lists(st.integers(0, 60), min_size=hkv, max_size=hkv), min_size=b, max_size=b))
    lengths[0][0] = 1  # a head at its floor
    if hkv > 1:
        lengths[0][1] = 8 * max(lengths[0][1], 4)  # one far above the others
    k, v, pos, start, kv_len = ragged_pool(b, hkv, d, lengths, seed)
    q = torch.randn(b, h, 1, d, generator=torch.Generator().manual_seed(seed + 1))
    q_pos = torch.full((b,), 1 << 20, dtype=torch.int32)
    kw = dict(kv_pos=pos, q_pos=q_pos, kv_len=kv_len, kv_start=start, block=block, order=order)
    before = K.RAGGED_SPLIT_SCALE, K.RAGGED_MIN_HEAD_SPLITS
    K.RAGGED_SPLIT_SCALE, K.RAGGED_MIN_HEAD_SPLITS = scale, floor
    try:
        out_k, vis_k = K.decode_attention_triton(q, k, v, split=split, **kw)
    finally:
        K.RAGGED_SPLIT_SCALE, K.RAGGED_MIN_HEAD_SPLITS = before
    out_r, vis_r = K.decode_attention_reference(q, k, v, **kw)
    want = heads_alone(q, k, v, pos, start, kv_len, q_pos)
    torch.testing.assert_close(out_r, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_k, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(vis_k, vis_r) and torch.equal(vis_k, (-(-kv_len // block)).int())


@settings(SETTINGS, max_examples=6)
@given(
    heads=st.sampled_from([(4, 2), (8, 4)]),
    tau=st.sampled_from([1e-2, 0.1, 0.5]),
    patience=st.integers(1, 3),
    horizon=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_ragged_heads_with_termination_equal_reference(heads, tau, patience, horizon, seed):
    """ART over ragged heads (serial, and with a horizon then split-KV): the kernel stops where the reference
    does, counting blocks from each head's first entry."""
    h, hkv = heads
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, 90, (hkv,), generator=g).tolist() for _ in range(2)]
    k, v, pos, start, kv_len = ragged_pool(2, hkv, 16, lengths, seed)
    q = torch.randn(2, h, 1, 16, generator=g)
    kw = dict(
        kv_pos=pos,
        q_pos=torch.full((2,), 1 << 20),
        kv_len=kv_len,
        kv_start=start,
        block=8,
        tau=tau,
        phi=tau,
        patience=patience,
        horizon=horizon,
    )
    out_k, vis_k, out_r, vis_r = run_both(q, k, v, **kw)
    torch.testing.assert_close(out_k, out_r, atol=1e-5, rtol=1e-5)
    assert torch.equal(vis_k, vis_r)


def test_ragged_heads_op_opcheck_and_layout_errors():
    """The op with ragged heads is the reference on CPU and passes opcheck; a ragged read without per-head
    lengths, or over a pool with a head dimension of its own, is refused with the layout it needs."""
    k, v, pos, start, kv_len = ragged_pool(2, 2, 16, [[5, 40], [0, 17]], 4)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(5))
    q_pos = torch.full((2,), 1 << 20, dtype=torch.int32)
    args = (q, k, v, None, pos, q_pos, None, kv_len, None, 0.25, 0.0, 0, 0.0, 0.0, 5, 16, 1, 0, 0, start)
    out, vis = torch.ops.kvpass.decode_attention(*args)
    ref, vref = K.decode_attention_reference(
        q, k, v, kv_pos=pos, q_pos=q_pos, kv_len=kv_len, scale=0.25, block=16, kv_start=start
    )
    assert torch.equal(out, ref) and torch.equal(vis, vref) and vis.tolist() == [[1, 3], [0, 2]]
    assert (out[1, :2] == 0).all()  # a head that keeps nothing reads nothing: zeros
    torch.library.opcheck(torch.ops.kvpass.decode_attention_ref.default, args)
    torch.library.opcheck(torch.ops.kvpass.decode_attention.default, args)
    for bad in (dict(kv_len=kv_len[:, 0]), dict(k=k.expand(2, 2, -1, -1).contiguous())):
        kw = {**dict(k=k, v=v, kv_pos=pos, q_pos=q_pos, kv_len=kv_len, kv_start=start), **bad}
        with pytest.raises(ValueError, match=r"kv_start \[B, H_kv\].*kv_len \[B, H_kv\]"):
            K.decode_attention_triton(q, **kw)
        with pytest.raises(ValueError, match=r"kv_start \[B, H_kv\]"):
            K.decode_attention_reference(q, **kw)
