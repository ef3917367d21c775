"""Window scoring for the SnapKV family: the Triton kernel and its PyTorch reference.

The last ``W`` prompt tokens (the observation window) vote for the keys they attend to. With
queries ``q [B, H, W, D]`` (the window's rows of every query head), keys ``k [B, H_kv, N, D]`` and
true positions, the score of key ``j`` of KV head ``g`` is::

    score[b, g, j] = sum over query heads h of group g, window queries i of  softmax_j(s[b, h, i, :])[j]
    s[b, h, i, j]  = scale * q[b, h, i] . k[b, g, j]      (softcapped when softcap > 0)

over the keys the query may see: ``0 <= kv_pos[b, g, j] <= q_pos[b, i]`` (causal inside the window,
left padding ``kv_pos = -1`` never seen). A query row that sees nothing contributes nothing. GQA is
packed: query head ``h`` reads KV head ``h // (H / H_kv)``, the group's scores are summed (the
granularity the cache is stored at), never kept per query head. Math in fp32. With ``reduce="max"`` a key
gets the most any of those rows gives it instead of the sum (kvzip's repeat passes).

The reference materialises ``[B, H, W, N]`` fp32 scores; at 128k context and 32 heads that is half a
gigabyte. The kernel never does. One program owns one KV head and one block of ``BLOCK`` keys, loads
the key block once and walks the group's ``G x W`` query rows in chunks of ``ROWS``:

1. pass 1 writes, per key block and query row, the block's row maximum and ``sum exp(s - max)``
   (``[B * H_kv, n_blocks, G * W]``, 1/``BLOCK`` of the score matrix);
2. one merge program per KV head (and chunk of rows) folds them into each row's softmax max and
   1 / denominator, online over the blocks;
3. pass 2 recomputes the block's scores, normalises them and sums every column over the rows (or takes
   its maximum), writing ``score[b, g, block]`` directly: no atomics, deterministic, every block in parallel.

Three launches, whatever the shape. The merge is a kernel rather than PyTorch reductions because the
decode steps of h2o and tova score one query against ``budget + 1`` keys every layer: there, the merge
written as reductions and element-wise steps runs as ten small ATen kernels a layer, more time than both
passes (the profiles in ``bench/results/gpu_h100_2026-12-06``).

Scores are computed twice, the price of not storing them; at ``W = 32`` both passes together cost
about as much as one decode step per window query, far below the prefill that precedes them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvpass.kernels.decode_attention import interpreting, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None

_LOG2E = 1.4426950408889634


REDUCTIONS = ("sum", "max")


def window_scores_reference(
    q: Tensor,
    k: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    scale: float | None = None,
    softcap: float = 0.0,
    reduce: str = "sum",
) -> Tensor:
    """Window attention received by every key, summed (``reduce="max"``: the most) over window queries and the
    group's heads.

    ``q [B, H, W, D]``, ``k [B, H_kv, N, D]``, ``kv_pos [B, H_kv, N]``, ``q_pos [B, W]`` ->
    ``[B, H_kv, N]`` fp32 (see the module docstring)."""
    _check_reduce(reduce)
    b, h, w, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(b, hkv, h // hkv, w, d)
    s = torch.einsum("bkgwd,bknd->bkgwn", qg, k.float()) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    kp = kv_pos[:, :, None, None, :]
    visible = (kp >= 0) & (kp <= q_pos[:, None, None, :, None])
    s = s.masked_fill(~visible, float("-inf"))
    top = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return p.amax(dim=(2, 3)) if reduce == "max" else p.sum(dim=(2, 3))


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"kvpass window scores: reduce must be one of {REDUCTIONS}, got {reduce!r}")


def kernel_serves(q: Tensor) -> bool:
    """The Triton kernel scores ``q``'s window: a CUDA tensor, with Triton installed (``kvpass::window_scores`` and
    ``window_scores_eager`` both ask)."""
    return q.is_cuda and triton is not None


def window_scores_eager(
    q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float = 0.0, reduce: str = "sum"
) -> Tensor:
    """Outside a compiled graph (inside another operator's Python): the kernel where it serves (``kernel_serves``),
    the reference elsewhere. Arguments and result as ``window_scores_reference``."""
    if kernel_serves(q):
        return window_scores_triton(q, k, kv_pos, q_pos, scale, softcap, reduce=reduce)
    return window_scores_reference(q, k, kv_pos, q_pos, scale, softcap, reduce)


if triton is not None:

    @triton.jit
    def _block_scores(
        q_ptr,
        k,
        kp,
        b,
        hk,
        r,
        rmask,
        d,
        dmask,
        QPos,
        scale,
        softcap,
        sq_b,
        sq_h,
        sq_w,
        sqp_b,
        sqp_w,
        GROUP: tl.constexpr,
        W: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """log2-domain scores [ROWS, BLOCK] of query rows ``r`` (head-major, window-minor) against a
        key block, -inf where a row may not see a key."""
        head = hk * GROUP + r // W
        i = r % W
        q = tl.load(
            q_ptr + b * sq_b + head[:, None].to(tl.int64) * sq_h + i[:, None] * sq_w + d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )
        qp = tl.load(QPos + b * sqp_b + i * sqp_w, mask=rmask, other=-1)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s.to(tl.float32) * scale
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = (s * 1.4426950408889634).to(tl.float32)  # Inductor passes float scalars as fp64
        visible = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def _kvpass_window_scores_kernel(
        Q,
        K,
        KvPos,
        QPos,
        M,
        L,
        Out,
        scale,
        softcap,
        n_keys,
        n_blocks,
        sq_b,
        sq_h,
        sq_w,
        sk_b,
        sk_h,
        sk_n,
        sp_b,
        sp_h,
        sp_n,
        sqp_b,
        sqp_w,
        HKV: tl.constexpr,
        GROUP: tl.constexpr,
        W: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        SECOND: tl.constexpr,
        MOST: tl.constexpr,
    ):
        """Pass 1 (``SECOND`` false): per-block row max / sum into M, L. Pass 2: column sums (``MOST``: column
        maxima) into Out."""
        bh = tl.program_id(0)
        blk = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        hk = (bh % HKV).to(tl.int64)
        d = tl.arange(0, D_PAD)
        dmask = d < D
        n = blk * BLOCK + tl.arange(0, BLOCK)
        nmask = n < n_keys
        kp = tl.load(KvPos + b * sp_b + hk * sp_h + n.to(tl.int64) * sp_n, mask=nmask, other=-1)
        k = tl.load(
            K + b * sk_b + hk * sk_h + n[:, None].to(tl.int64) * sk_n + d[None, :],
            mask=nmask[:, None] & dmask[None, :],
            other=0.0,
        )
        col = tl.zeros([BLOCK], tl.float32)
        for r0 in range(0, GROUP * W, ROWS):
            r = r0 + tl.arange(0, ROWS)
            rmask = r < GROUP * W
            s = _block_scores(
                Q,
                k,
                kp,
                b,
                hk,
                r,
                rmask,
                d,
                dmask,
                QPos,
                scale,
                softcap,
                sq_b,
                sq_h,
                sq_w,
                sqp_b,
                sqp_w,
                GROUP,
                W,
                SOFTCAP,
                UPCAST,
            )
            stat = (bh.to(tl.int64) * n_blocks + blk) * (GROUP * W) + r
            if SECOND:
                m = tl.load(M + bh.to(tl.int64) * (GROUP * W) + r, mask=rmask, other=float("-inf"))
                inv = tl.load(L + bh.to(tl.int64) * (GROUP * W) + r, mask=rmask, other=0.0)
                p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]) * inv[:, None]
                p = tl.where(rmask[:, None], p, 0.0)
                if MOST:
                    col = tl.maximum(col, tl.max(p, 0))
                else:
                    col += tl.sum(p, 0)
            else:
                m = tl.max(s, 1)
                p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
                tl.store(M + stat, m, mask=rmask)
                tl.store(L + stat, tl.sum(p, 1), mask=rmask)
        if SECOND:
            tl.store(Out + bh.to(tl.int64) * n_keys + n, col, mask=nmask)

    @triton.jit
    def _kvpass_window_merge_kernel(
        M, L, MOut, InvOut, n_blocks, N_ROWS: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr
    ):
        """Rows ``ROWS`` of one KV head: fold pass 1's per-block max ``M`` and sum ``L`` (``[B * H_kv, n_blocks,
        N_ROWS]``, log2 domain) into the row's max (``MOut``) and 1 / its denominator (``InvOut``; 0 for a row
        that sees nothing)."""
        bh = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        rmask = r < N_ROWS
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        for j0 in range(0, n_blocks, BLOCKS):
            j = j0 + tl.arange(0, BLOCKS)
            at = (bh * n_blocks + j[:, None]) * N_ROWS + r[None, :]
            ok = (j[:, None] < n_blocks) & rmask[None, :]
            pm = tl.load(M + at, mask=ok, other=float("-inf"))
            pl = tl.load(L + at, mask=ok, other=0.0)
            top = tl.maximum(m, tl.max(pm, 0))
            shift = tl.where(top == float("-inf"), 0.0, top)  # a row unseen so far: every term is 0
            total = total * tl.exp2(m - shift) + tl.sum(tl.exp2(pm - shift[None, :]) * pl, 0)
            m = top
        tl.store(MOut + bh * N_ROWS + r, m, mask=rmask)
        tl.store(InvOut + bh * N_ROWS + r, tl.where(total > 0, 1.0 / tl.maximum(total, 1e-38), 0.0), mask=rmask)


def window_scores_triton(
    q: Tensor,
    k: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    scale: float | None = None,
    softcap: float = 0.0,
    block: int = 64,
    rows: int = 64,
    num_warps: int = 4,
    launch=None,
    merge_blocks: int = 64,
    reduce: str = "sum",
) -> Tensor:
    """Launch the two passes and their merge; arguments and result as ``window_scores_reference``.
    ``merge_blocks``: the key blocks' statistics the merge folds in per step (tests use few).

    ``launch`` wraps each kernel before its launch (``torch.library.wrap_triton`` inside a
    ``triton_op``; identity when called directly)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass window scoring needs Triton")
    _check_reduce(reduce)
    wrap = launch or (lambda fn: fn)
    b, h, w, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    group = h // hkv
    n_rows = group * w
    rows = min(pow2(n_rows), pow2(rows))
    n_blocks = (n + block - 1) // block
    part_m = torch.empty((b * hkv, n_blocks, n_rows), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    out = torch.empty((b, hkv, n), dtype=torch.float32, device=q.device)  # pass 2 writes every column
    upcast = q.dtype == torch.float32 or interpreting()
    args = (
        float(scale),
        float(softcap),
        n,
        n_blocks,
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
    meta = dict(
        HKV=hkv,
        GROUP=group,
        W=w,
        D=d,
        D_PAD=pow2(d),
        BLOCK=block,
        ROWS=rows,
        SOFTCAP=softcap > 0,
        UPCAST=upcast,
        MOST=reduce == "max",
        num_warps=num_warps,
    )
    grid = (b * hkv, n_blocks)
    wrap(_kvpass_window_scores_kernel)[grid](q, k, kv_pos, q_pos, part_m, part_l, out, *args, SECOND=False, **meta)
    m = torch.empty((b * hkv, n_rows), dtype=torch.float32, device=q.device)
    inv = torch.empty_like(m)
    wrap(_kvpass_window_merge_kernel)[(b * hkv, triton.cdiv(n_rows, rows))](
        part_m, part_l, m, inv, n_blocks, N_ROWS=n_rows, ROWS=rows, BLOCKS=pow2(merge_blocks, 1), num_warps=num_warps
    )
    wrap(_kvpass_window_scores_kernel)[grid](q, k, kv_pos, q_pos, m, inv, out, *args, SECOND=True, **meta)
    return out
