"""Accumulated attention for H2O: the Triton kernel and its PyTorch reference.

Every prompt query votes for the keys it attends to, and every vote is kept. With queries
``q [B, H, L, D]``, keys ``k [B, H_kv, N, D]`` and true positions, the score of key ``j`` of KV head ``g``
is::

    acc[b, g, j] = sum over query heads h of group g, queries i of  softmax_j(s[b, h, i, :])[j]
    s[b, h, i, j] = scale * q[b, h, i] . k[b, g, j]      (softcapped when softcap > 0)

over the keys a query may see: ``0 <= kv_pos[b, g, j] <= q_pos[b, i]`` (causal by true position, left
padding ``kv_pos = -1`` never seen). A query row that sees nothing contributes nothing. Query head ``h``
reads KV head ``h // (H / H_kv)``; the group's heads are summed, the granularity the cache is stored at.
It is ``kvpass::window_scores`` with every query of the prompt as the window, but its cost is that of a
prefill's attention, not of a 32-query window, so it has its own kernel.

Reference. ``accumulated_scores_reference`` materialises the fp32 scores of a chunk of query rows at a time
(``[B, H, rows, N]``, at most ``ELEMENTS`` of them), never ``[B, H, L, N]``. Its cost is ``O(B H L N D)``
like the kernel's, on the CPU.

Kernel. Two passes in the manner of FlashAttention, the scores never stored:

1. ``_kvpass_accumulated_lse_kernel``: one program per (sequence, query head, block of ``BLOCK_M`` queries)
   walks the key blocks its rows may see, ``tl.dot`` for the ``BLOCK_M x BLOCK_N`` scores, an online max and
   sum, and writes each row's log-sum-exp (log2 domain, ``+inf`` for a row that sees nothing):
   ``[B, H, L]`` fp32, the only intermediate.
2. ``_kvpass_accumulated_cols_kernel``: one program per (sequence, KV head, block of ``BLOCK_N`` keys) loads
   its key block once, walks the query blocks that may see it, and for each of the group's query heads
   recomputes the scores, ``p = exp2(s - lse)`` (masked) and adds the column sums: ``acc[b, g, block]`` is
   written once by one program, no atomics, deterministic.

Given row statistics. A prefill's own attention can return each query's log-sum-exp
(``kvpass::attention_lse``: flash attention computes it anyway); given it as ``lse``, pass 1 does not run and
the scoring costs one ``QK^T`` pass (H2O's prefill on a plain prompt).

Which tiles a pass visits comes from the positions, without a host synchronisation: per key block the least
visible position, per query block the greatest query position; a tile can contribute only when the first is
at most the second. A few PyTorch reductions (cumulative min / max, ``searchsorted``) turn these into one
range of key blocks per query block (pass 1) and one range of query blocks per key block (pass 2), the
first and the last tile that can contribute; inside a range the position mask decides per element. For a
plain prompt (positions ``0..L-1``) the ranges are the causal triangle: pass 1 stops at the diagonal, pass 2
starts there, so about half of the ``L x N`` tiles are visited. The same reductions over the greatest key
position of a block (without padding) and the least query position find the tiles whose every query sees every
key: each pass walks them in a loop of its own that skips the position mask, so only the diagonal tiles
compute it. Left padding only moves the ranges' ends; an
evicted cache (ascending positions with gaps) is still cut by the diagonal of its positions.

Cost. Each pass computes the visited scores once with ``tl.dot`` and one ``exp2`` per score: together about
the matmul work of one causal attention forward (``QK^T`` twice, where attention does ``QK^T`` and ``PV``)
and twice its exponentials. Memory beyond the inputs and output: ``4 B H L`` bytes of row statistics and
four small range tensors. Pass 2 sums the column of each key over all ``G x L`` rows in fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpass.kernels.decode_attention import interpreting, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None

ELEMENTS = 1 << 24  # the most fp32 scores one chunk of the reference holds (64 MiB)
_NONE = 1 << 62  # the least visible position of a key block that holds only padding
LOG2E = 1.4426950408889634
# (block_m, block_n, num_warps, num_stages) of pass 1 and of pass 2 (bench/probes/tune_accumulated.py)
TILES = ((128, 64, 4, 3), (64, 128, 8, 3))  # H200, 2026-11-27: 529 ms at 128k where (64, 64, 4, 2) twice took 689


def _masked_logits(
    q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float | None, softcap: float, rows: int | None
):
    """``(start, logits)`` per chunk of ``rows`` query rows: fp32 ``[B, H_kv, G, rows, N]`` scores, softcapped,
    ``-inf`` where the query may not see the key (``0 <= kv_pos <= q_pos``); the references' common part."""
    b, h, lq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if rows is None:
        rows = max(1, ELEMENTS // max(1, b * h * n))
    kf = k.float()
    kp = kv_pos[:, :, None, None, :]  # [B, H_kv, 1, 1, N]
    for start in range(0, lq, rows):
        qc = q[:, :, start : start + rows].float().reshape(b, hkv, h // hkv, -1, d)
        logits = torch.einsum("bgxid,bgnd->bgxin", qc, kf) * scale  # [B, H_kv, G, rows, N]
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        qp = q_pos[:, None, None, start : start + rows, None]  # [B, 1, 1, rows, 1]
        yield start, logits.masked_fill(~((kp >= 0) & (kp <= qp)), float("-inf"))


def accumulated_scores_reference(
    q: Tensor,
    k: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    scale: float | None = None,
    softcap: float = 0.0,
    rows: int | None = None,
    lse: Tensor | None = None,
) -> Tensor:
    """Attention received by every key from every query, summed over the queries and the group's heads.

    ``q [B, H, L, D]``, ``k [B, H_kv, N, D]``, ``kv_pos [B, H_kv, N]``, ``q_pos [B, L]`` -> ``[B, H_kv, N]``
    fp32 (see the module docstring). ``rows`` query rows are scored at a time (default: as many as keep
    the chunk's scores within ``ELEMENTS``). ``lse [B, H, L]`` (fp32, natural log), when given, is every
    row's log-sum-exp over the keys it sees, computed elsewhere (the prefill's own attention,
    ``kvpass::attention_lse``); the weights are then ``exp(s - lse)``."""
    b, h = q.shape[:2]
    hkv, n = k.shape[1], k.shape[2]
    total = torch.zeros((b, hkv, n), dtype=torch.float32, device=q.device)
    for start, logits in _masked_logits(q, k, kv_pos, q_pos, scale, softcap, rows):
        if lse is not None:
            given = lse[:, :, start : start + logits.shape[3]].float().reshape(b, hkv, h // hkv, -1, 1)
            total += (logits - given).exp().sum(dim=(2, 3))
            continue
        peak = logits.amax(-1, keepdim=True)
        peak = torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)
        weights = (logits - peak).exp()
        norm = weights.sum(-1, keepdim=True)
        weights = weights / torch.where(norm > 0, norm, torch.ones_like(norm))
        total += weights.sum(dim=(2, 3))
    return total


def causal_lse_reference(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """``[B, H, L]`` fp32: every query row's log-sum-exp (natural log) over the keys a plain causal prompt lets it
    see (query ``i`` sees keys ``0..i``); ``q [B, H, L, D]``, ``k [B, H_kv, L, D]``, GQA packed. Chunked over
    rows as the scores' reference."""
    b, h, lq = q.shape[:3]
    pos = torch.arange(lq, device=q.device)
    chunks = _masked_logits(q, k, pos.expand(b, k.shape[1], lq), pos.expand(b, lq), scale, 0.0, None)
    return torch.cat([logits.logsumexp(-1).reshape(b, h, -1) for _, logits in chunks], -1)


class Ranges(NamedTuple):
    """Which tiles the passes visit (int32, half-open, empty when ``lo >= hi``): pass 1 walks key blocks
    ``[k_lo, k_hi)`` ``[B, H_kv, M]`` for every query block, of which ``[k_lo, k_full)`` need no position mask;
    pass 2 walks query blocks ``[q_lo, q_hi)`` ``[B, H_kv, NB]`` for every key block, of which ``[q_full, q_hi)``
    need none."""

    k_lo: Tensor
    k_hi: Tensor
    k_full: Tensor
    q_lo: Tensor
    q_hi: Tensor
    q_full: Tensor


def block_ranges(kv_pos: Tensor, q_pos: Tensor, block_m: int, block_n: int) -> Ranges:
    """The tiles that can contribute and those that need no mask (``Ranges``). A tile (query block m, key
    block n) can contribute only if ``kmin[n] <= qmax[m]``, where ``kmin`` is the least visible key position of
    the block and ``qmax`` the greatest query position; every query of the tile sees every key when
    ``kmax[n] <= qmin[m]``, where ``kmax`` is the greatest key position of a block without padding (a block with
    any, or past the end, always takes the mask) and ``qmin`` the least query position."""
    b, hkv, n = kv_pos.shape
    lq = q_pos.shape[1]
    n_blocks, m_blocks = _cdiv(n, block_n), _cdiv(lq, block_m)
    kp = F.pad(kv_pos.long(), (0, n_blocks * block_n - n), value=-1).view(b, hkv, n_blocks, block_n)
    kmin = torch.where(kp >= 0, kp, torch.full_like(kp, _NONE)).amin(-1)
    kmax = torch.where((kp >= 0).all(-1), kp.amax(-1), torch.full_like(kmin, _NONE))
    qp = q_pos.long()
    qmax = F.pad(qp, (0, m_blocks * block_m - lq), value=-1).view(b, m_blocks, block_m).amax(-1)
    qmin = F.pad(qp, (0, m_blocks * block_m - lq), value=_NONE).view(b, m_blocks, block_m).amin(-1)
    qmax, qmin = (x[:, None, :].expand(b, hkv, m_blocks).contiguous() for x in (qmax, qmin))
    # pass 1: key blocks n with kmin[n] <= qmax[m]; the first is where the running min reaches qmax[m],
    # the last where the min of the rest stops reaching it; unmasked: the leading blocks whose running max
    # of kmax stays within qmin[m]
    first_min = kmin.cummin(-1).values  # non-increasing
    rest_min = kmin.flip(-1).cummin(-1).values.flip(-1)  # non-decreasing
    k_lo = torch.searchsorted(-first_min, -qmax, side="left", out_int32=True)
    k_hi = torch.searchsorted(rest_min, qmax, side="right", out_int32=True)
    k_full = torch.searchsorted(kmax.cummax(-1).values, qmin, side="right", out_int32=True)
    # pass 2: query blocks m with qmax[m] >= kmin[n], the same way with running maxima; unmasked: the
    # trailing blocks whose least qmin (of them and all after) reaches kmax[n]
    first_max = qmax.cummax(-1).values  # non-decreasing
    rest_max = qmax.flip(-1).cummax(-1).values.flip(-1)  # non-increasing
    q_lo = torch.searchsorted(first_max, kmin, side="left", out_int32=True)
    q_hi = torch.searchsorted(-rest_max, -kmin, side="right", out_int32=True)
    q_full = torch.searchsorted(qmin.flip(-1).cummin(-1).values.flip(-1), kmax, side="left", out_int32=True)
    return Ranges(
        k_lo,
        k_hi,
        torch.maximum(torch.minimum(k_full, k_hi), k_lo),
        q_lo,
        q_hi,
        torch.maximum(torch.minimum(q_full, q_hi), q_lo),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:

    @triton.jit
    def _kvpass_accumulated_logits(
        q, k, qp, kp, scale, softcap, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr
    ):
        """Scores ``[BLOCK_M, BLOCK_N]`` of a query tile against a key tile, in the log2 domain; with ``MASKED``,
        ``-inf`` where the query may not see the key (a tile whose queries all see all its keys skips it)."""
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = s.to(tl.float32) * scale
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
            s = (s * 1.4426950408889634).to(tl.float32)  # Inductor passes float scalars as fp64
        else:
            s = (s.to(tl.float32) * (scale * 1.4426950408889634)).to(tl.float32)  # one multiply
        if MASKED:
            seen = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
            s = tl.where(seen, s, float("-inf"))
        return s

    @triton.jit
    def _kvpass_accumulated_lse_step(
        q,
        qp,
        top,
        total,
        nb,
        K,
        KvPos,
        k_base,
        p_base,
        d,
        dmask,
        n_keys,
        sk_n,
        sp_n,
        scale,
        softcap,
        BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """One key block of pass 1: the rows' running maximum and sum of ``exp2`` (online softmax)."""
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n_keys
        k = tl.load(
            K + k_base + cols[:, None].to(tl.int64) * sk_n + d[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0
        )
        kp = tl.load(KvPos + p_base + cols.to(tl.int64) * sp_n, mask=cmask, other=-1)
        s = _kvpass_accumulated_logits(q, k, qp, kp, scale, softcap, SOFTCAP, UPCAST, MASKED)
        new_top = tl.maximum(top, tl.max(s, 1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # rows that saw nothing yet stay 0
        total = total * tl.exp2(top - shift) + tl.sum(tl.exp2(s - shift[:, None]), 1)
        return new_top, total

    @triton.jit
    def _kvpass_accumulated_lse_kernel(
        Q,
        K,
        KvPos,
        QPos,
        KLo,
        KHi,
        KFull,
        Lse,
        scale,
        softcap,
        n_queries,
        n_keys,
        m_blocks,
        sq_b,
        sq_h,
        sq_l,
        sk_b,
        sk_h,
        sk_n,
        sp_b,
        sp_h,
        sp_n,
        sqp_b,
        sqp_l,
        H: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Pass 1: the log-sum-exp (log2) of every query row of one head and query block over its keys: the
        key blocks every row sees whole first, without the mask, then the rest with it."""
        bh = tl.program_id(0)
        mb = m_blocks - 1 - tl.program_id(1)  # the longest rows first
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        g = h // (H // HKV)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < n_queries
        q = tl.load(
            Q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_l + d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )
        qp = tl.load(QPos + b * sqp_b + rows.to(tl.int64) * sqp_l, mask=rmask, other=-1)
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        span = (b * HKV + g) * m_blocks + mb
        k_base, p_base = b * sk_b + g * sk_h, b * sp_b + g * sp_h
        full = tl.load(KFull + span)
        for nb in range(tl.load(KLo + span), full):
            top, total = _kvpass_accumulated_lse_step(
                q,
                qp,
                top,
                total,
                nb,
                K,
                KvPos,
                k_base,
                p_base,
                d,
                dmask,
                n_keys,
                sk_n,
                sp_n,
                scale,
                softcap,
                BLOCK_N,
                SOFTCAP,
                UPCAST,
                False,
            )
        for nb in range(full, tl.load(KHi + span)):
            top, total = _kvpass_accumulated_lse_step(
                q,
                qp,
                top,
                total,
                nb,
                K,
                KvPos,
                k_base,
                p_base,
                d,
                dmask,
                n_keys,
                sk_n,
                sp_n,
                scale,
                softcap,
                BLOCK_N,
                SOFTCAP,
                UPCAST,
                True,
            )
        seen = total > 0
        lse = tl.where(seen, top + tl.log2(tl.where(seen, total, 1.0)), float("inf"))  # +inf: adds 0 in pass 2
        tl.store(Lse + bh.to(tl.int64) * n_queries + rows, lse, mask=rmask)

    @triton.jit
    def _kvpass_accumulated_cols_step(
        acc,
        t,
        k,
        kp,
        Q,
        QPos,
        Lse,
        b,
        g,
        d,
        dmask,
        n_queries,
        sq_b,
        sq_h,
        sq_l,
        sqp_b,
        sqp_l,
        scale,
        softcap,
        HKV: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """One (query block, head of the group) of pass 2, ``t = block * GROUP + head``: the attention its rows
        give the key block, added to ``acc``."""
        rows = (t // GROUP) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = g * GROUP + t % GROUP
        rmask = rows < n_queries
        qp = tl.load(QPos + b * sqp_b + rows.to(tl.int64) * sqp_l, mask=rmask, other=-1)
        q = tl.load(
            Q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_l + d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )
        lse = tl.load(Lse + (b * (HKV * GROUP) + h) * n_queries + rows, mask=rmask, other=float("inf"))
        s = _kvpass_accumulated_logits(q, k, qp, kp, scale, softcap, SOFTCAP, UPCAST, MASKED)
        return acc + tl.sum(tl.exp2(s - lse[:, None]), 0)  # unseen (s = -inf) and empty rows add 0

    @triton.jit
    def _kvpass_accumulated_cols_kernel(
        Q,
        K,
        KvPos,
        QPos,
        QLo,
        QHi,
        QFull,
        Lse,
        Out,
        scale,
        softcap,
        n_queries,
        n_keys,
        n_blocks,
        sq_b,
        sq_h,
        sq_l,
        sk_b,
        sk_h,
        sk_n,
        sp_b,
        sp_h,
        sp_n,
        sqp_b,
        sqp_l,
        HKV: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Pass 2: the attention one key block receives from every query row of the group's heads; one flat
        loop over (query block, head) that the compiler can pipeline, the masked blocks (the diagonal) first,
        then those whose rows all see the whole key block."""
        bg = tl.program_id(0)
        nb = tl.program_id(1)
        b = (bg // HKV).to(tl.int64)
        g = (bg % HKV).to(tl.int64)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n_keys
        k = tl.load(
            K + b * sk_b + g * sk_h + cols[:, None].to(tl.int64) * sk_n + d[None, :],
            mask=cmask[:, None] & dmask[None, :],
            other=0.0,
        )
        kp = tl.load(KvPos + b * sp_b + g * sp_h + cols.to(tl.int64) * sp_n, mask=cmask, other=-1)
        acc = tl.zeros([BLOCK_N], tl.float32)
        span = bg.to(tl.int64) * n_blocks + nb
        full = tl.load(QFull + span) * GROUP
        for t in range(tl.load(QLo + span) * GROUP, full):
            acc = _kvpass_accumulated_cols_step(
                acc,
                t,
                k,
                kp,
                Q,
                QPos,
                Lse,
                b,
                g,
                d,
                dmask,
                n_queries,
                sq_b,
                sq_h,
                sq_l,
                sqp_b,
                sqp_l,
                scale,
                softcap,
                HKV,
                GROUP,
                BLOCK_M,
                SOFTCAP,
                UPCAST,
                True,
            )
        for t in range(full, tl.load(QHi + span) * GROUP):
            acc = _kvpass_accumulated_cols_step(
                acc,
                t,
                k,
                kp,
                Q,
                QPos,
                Lse,
                b,
                g,
                d,
                dmask,
                n_queries,
                sq_b,
                sq_h,
                sq_l,
                sqp_b,
                sqp_l,
                scale,
                softcap,
                HKV,
                GROUP,
                BLOCK_M,
                SOFTCAP,
                UPCAST,
                False,
            )
        tl.store(Out + bg.to(tl.int64) * n_keys + cols, acc, mask=cmask)


def accumulated_scores_triton(
    q: Tensor,
    k: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    scale: float | None = None,
    softcap: float = 0.0,
    block_m: int | None = None,
    block_n: int | None = None,
    tiles: tuple | None = None,
    lse: Tensor | None = None,
    launch=None,
) -> Tensor:
    """Launch the two passes; arguments and result as ``accumulated_scores_reference``.

    ``tiles``: ``((block_m, block_n, num_warps, num_stages) of pass 1, the same of pass 2)``, default
    ``TILES``; ``block_m`` / ``block_n`` replace the block sizes of both (tests use small ones). ``lse`` (as
    the reference's) replaces pass 1: only the column sums run. ``launch``
    wraps each kernel before its launch (``torch.library.wrap_triton`` inside a ``triton_op``; identity when
    called directly)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass accumulated scoring needs Triton")
    wrap = launch or (lambda fn: fn)
    b, h, lq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    out = torch.zeros((b, hkv, n), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lq == 0:
        return out
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    (m1, n1, w1, s1), (m2, n2, w2, s2) = (
        (block_m or bm, block_n or bn, warps, stages) for bm, bn, warps, stages in (tiles or TILES)
    )
    cols = block_ranges(kv_pos, q_pos, m2, n2)
    given = lse is not None
    lse = (lse.float() * LOG2E).contiguous() if given else torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    strides = (
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        kv_pos.stride(0),
        kv_pos.stride(1),
        kv_pos.stride(2),
        q_pos.stride(0),
        q_pos.stride(1),
    )
    meta = dict(HKV=hkv, D=d, D_PAD=pow2(d), SOFTCAP=softcap > 0, UPCAST=q.dtype == torch.float32 or interpreting())
    if not given:
        rows = block_ranges(kv_pos, q_pos, m1, n1)
        wrap(_kvpass_accumulated_lse_kernel)[(b * h, _cdiv(lq, m1))](
            q,
            k,
            kv_pos,
            q_pos,
            rows.k_lo,
            rows.k_hi,
            rows.k_full,
            lse,
            float(scale),
            float(softcap),
            lq,
            n,
            _cdiv(lq, m1),
            *strides,
            H=h,
            BLOCK_M=m1,
            BLOCK_N=n1,
            num_warps=w1,
            num_stages=s1,
            **meta,
        )
    wrap(_kvpass_accumulated_cols_kernel)[(b * hkv, _cdiv(n, n2))](
        q,
        k,
        kv_pos,
        q_pos,
        cols.q_lo,
        cols.q_hi,
        cols.q_full,
        lse,
        out,
        float(scale),
        float(softcap),
        lq,
        n,
        _cdiv(n, n2),
        *strides,
        GROUP=h // hkv,
        BLOCK_M=m2,
        BLOCK_N=n2,
        num_warps=w2,
        num_stages=s2,
        **meta,
    )
    return out
