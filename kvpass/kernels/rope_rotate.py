"""RoPE (re-)rotation of stored keys and the scatter of recomputed K/V: Triton kernels + references.

**Rotation.** HF decoders rotate keys with the ``rotate_half`` convention: with ``R`` rotary dims
(``R <= D``, partial rotary leaves ``x[..., R:]`` alone) and per-position tables ``cos, sin [L, R]``
(which the model's own rotary module computes, scaling type and attention factor included)::

    out[..., :R/2]  = x[..., :R/2] * cos[:, :R/2] - x[..., R/2:R] * sin[:, :R/2]
    out[..., R/2:R] = x[..., R/2:R] * cos[:, R/2:] + x[..., :R/2] * sin[:, R/2:]
    out[..., R:]    = x[..., R:]

i.e. ``x * cos + rotate_half(x) * sin`` on the rotary part. ``x`` is ``[M, L, D]`` (any leading
rows: layers x KV heads), the tables are shared by all rows. The inverse rotation is the same
formula with ``cos / (cos^2 + sin^2)`` and ``-sin / (cos^2 + sin^2)`` (``rope_inverse_tables``),
which also undoes an attention factor folded into the tables (YaRN, LongRoPE).

The kernel runs one program per (row block of ``M``, block of ``BLOCK`` positions) and reads each
element once, math in fp32, the result in ``x.dtype``.

**Scatter.** ``scatter_rows(dst [M, N, D], idx [n], src [M, n, D])`` returns a copy of ``dst`` with
rows ``idx`` replaced by ``src`` (recomputed K/V written over the stored ones of a merged cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.decode_attention import pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [M, L, D]`` rotated by ``cos, sin [L, R]`` (``R`` even, ``R <= D``); fp32 math, ``x.dtype`` out."""
    r = cos.shape[-1]
    h = r // 2
    xf = x.float()
    c, s = cos.float(), sin.float()
    x1, x2 = xf[..., :h], xf[..., h:r]
    out = torch.cat([x1 * c[:, :h] - x2 * s[:, :h], x2 * c[:, h:] + x1 * s[:, h:], xf[..., r:]], dim=-1)
    return out.to(x.dtype).contiguous()


def rope_inverse_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Tables whose rotation undoes the rotation by ``(cos, sin)`` (attention factor included)."""
    c, s = cos.float(), sin.float()
    norm = c * c + s * s
    return c / norm, -s / norm


def scatter_reference(dst: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    """A copy of ``dst [M, N, D]`` with rows ``idx [n]`` (distinct) replaced by ``src [M, n, D]``."""
    return dst.index_copy(1, idx.long(), src.to(dst.dtype)).contiguous()


if triton is not None:

    @triton.jit
    def _kvpass_rope_kernel(
        X,
        Cos,
        Sin,
        Out,
        M,
        L,
        s_m,
        s_l,
        c_l,
        HALF: tl.constexpr,
        D: tl.constexpr,
        HALF_PAD: tl.constexpr,
        PASS_PAD: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        m0 = tl.program_id(0) * ROWS
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tmask = t < L
        t64 = t.to(tl.int64)
        j = tl.arange(0, HALF_PAD)
        jmask = tmask[:, None] & (j < HALF)[None, :]
        # tables: loaded once per program, reused for ROWS rows of M
        ca = tl.load(Cos + t64[:, None] * c_l + j[None, :], mask=jmask, other=0.0).to(tl.float32)
        cb = tl.load(Cos + t64[:, None] * c_l + HALF + j[None, :], mask=jmask, other=0.0).to(tl.float32)
        sa = tl.load(Sin + t64[:, None] * c_l + j[None, :], mask=jmask, other=0.0).to(tl.float32)
        sb = tl.load(Sin + t64[:, None] * c_l + HALF + j[None, :], mask=jmask, other=0.0).to(tl.float32)
        p = tl.arange(0, PASS_PAD)
        pmask = tmask[:, None] & (p < D - 2 * HALF)[None, :]
        for r in range(ROWS):
            m = m0 + r
            if m < M:
                src = X + m.to(tl.int64) * s_m + t64[:, None] * s_l
                dst = Out + (m.to(tl.int64) * L + t64[:, None]) * D
                x1 = tl.load(src + j[None, :], mask=jmask, other=0.0).to(tl.float32)
                x2 = tl.load(src + HALF + j[None, :], mask=jmask, other=0.0).to(tl.float32)
                tl.store(dst + j[None, :], (x1 * ca - x2 * sa).to(Out.dtype.element_ty), mask=jmask)
                tl.store(dst + HALF + j[None, :], (x2 * cb + x1 * sb).to(Out.dtype.element_ty), mask=jmask)
                if D > 2 * HALF:
                    xp = tl.load(src + 2 * HALF + p[None, :], mask=pmask, other=0.0)
                    tl.store(dst + 2 * HALF + p[None, :], xp, mask=pmask)

    @triton.jit
    def _kvpass_scatter_kernel(
        Src, Idx, Out, n, s_m, s_n, o_m, o_n, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr
    ):
        m = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tmask = t < n
        d = tl.arange(0, D_PAD)
        mask = tmask[:, None] & (d < D)[None, :]
        rows = tl.load(Idx + t, mask=tmask, other=0).to(tl.int64)
        x = tl.load(Src + m * s_m + t.to(tl.int64)[:, None] * s_n + d[None, :], mask=mask)
        tl.store(Out + m * o_m + rows[:, None] * o_n + d[None, :], x.to(Out.dtype.element_ty), mask=mask)


def rotate_triton(
    x: Tensor, cos: Tensor, sin: Tensor, block: int = 32, rows: int = 4, num_warps: int = 4, launch=None
) -> Tensor:
    """Launch the rotation kernel; arguments and result as ``rotate_reference``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass RoPE rotation needs Triton")
    wrap = launch or (lambda fn: fn)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    m, length, d = x.shape
    half = cos.shape[-1] // 2
    out = x.new_empty((m, length, d))
    if out.numel() == 0:
        return out
    grid = ((m + rows - 1) // rows, (length + block - 1) // block)
    wrap(_kvpass_rope_kernel)[grid](
        x,
        cos,
        sin,
        out,
        m,
        length,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        HALF=half,
        D=d,
        HALF_PAD=pow2(half),
        PASS_PAD=pow2(d - 2 * half),
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


def scatter_triton(dst: Tensor, idx: Tensor, src: Tensor, block: int = 64, num_warps: int = 4, launch=None) -> Tensor:
    """Launch the scatter kernel on a copy of ``dst``; arguments and result as ``scatter_reference``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass scatter needs Triton")
    wrap = launch or (lambda fn: fn)
    out = dst.clone(memory_format=torch.contiguous_format)
    if src.stride(-1) != 1:
        src = src.contiguous()
    m, _, d = out.shape
    n = idx.shape[0]
    if n == 0 or m == 0:
        return out
    idx = idx.contiguous()
    wrap(_kvpass_scatter_kernel)[(m, (n + block - 1) // block)](
        src,
        idx,
        out,
        n,
        src.stride(0),
        src.stride(1),
        out.stride(0),
        out.stride(1),
        D=d,
        D_PAD=pow2(d),
        BLOCK=block,
        num_warps=num_warps,
    )
    return out
