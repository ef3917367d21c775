"""Quest's page bounds (quest's page ranking, and the share RaaS stamps by): Triton kernel and PyTorch reference.

For one decode step, per sequence ``b``, query head ``h`` (of KV group ``g``) and page ``p`` with
representative keys ``kmin[b, g, p]`` / ``kmax[b, g, p]`` (element-wise min and max of the page's keys),
Quest's upper bound on the page's logits is

    ub[b, h, p] = sum_d max(q[b, h, d] * kmax[d], q[b, h, d] * kmin[d])

(``q`` carries the softmax scale). The kernel runs one program per (sequence, KV head, block of ``BLOCK_P``
pages): it loads the block's ``kmin`` / ``kmax`` once, upcast to fp32, and writes the bound of every query
head of the group, one head at a time (a ``[G, BLOCK_P, D]`` product spills registers at D = 128), so the
pages spread over the GPU and the bounds are read once for the whole group. ``_kvpass_head_bound`` (one
head's bound of one block) is shared with ``raas_stamp``'s kernels.
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


def page_bounds_reference(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Per query head upper bounds ``[B, H, P]`` (fp32) from ``q [B, H, D]`` and ``[B, H_kv, P, D]`` keys."""
    b, h, d = q.shape
    hkv = kmin.shape[1]
    qg = q.float().reshape(b, hkv, h // hkv, 1, d)
    hi = qg * kmax.float()[:, :, None]
    lo = qg * kmin.float()[:, :, None]
    return torch.maximum(hi, lo).sum(-1).reshape(b, h, -1)


if triton is not None:

    @triton.jit
    def _kvpass_head_bound(q, kx, kn):
        """One query head's bound ``[BLOCK_P]`` from ``q [D]`` and a block's fp32 ``kmax`` / ``kmin``
        ``[BLOCK_P, D]``: of ``q * kmax`` and ``q * kmin`` the larger is kmax's where ``q > 0`` and kmin's
        elsewhere (``q = 0`` gives 0 either way), so one select and one multiply-add per element, not two
        products and a max (the same products: equal bounds up to the order of the sum)."""
        return tl.sum(q[None, :] * tl.where(q[None, :] > 0, kx, kn), axis=1)

    @triton.jit
    def _kvpass_page_bounds_kernel(
        Q,
        Kmin,
        Kmax,
        Ub,
        n_pages,
        sq_b,
        sq_h,
        sk_b,
        sk_h,
        sk_p,
        HKV: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        pi = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        d = tl.arange(0, D_PAD)
        pm = pi < n_pages
        km = pm[:, None] & (d < D)[None, :]
        row = b * sk_b + h * sk_h  # 64-bit row base, 32-bit offsets within the row (pages * D < 2^31)
        off = pi[:, None] * sk_p + d[None, :]
        kx = tl.load(Kmax + row + off, mask=km, other=0.0).to(tl.float32)
        kn = tl.load(Kmin + row + off, mask=km, other=0.0).to(tl.float32)
        # one query head at a time: a [G, BLOCK_P, D] product spills registers
        for j in tl.static_range(G):
            q = tl.load(Q + b * sq_b + (h * G + j) * sq_h + d, mask=d < D, other=0.0).to(tl.float32)
            ub = _kvpass_head_bound(q, kx, kn)
            tl.store(Ub + (bh.to(tl.int64) * G + j) * n_pages + pi, ub, mask=pm)  # Ub [B, H, P], head h * G + j


def page_bounds_triton(q: Tensor, kmin: Tensor, kmax: Tensor, block_p: int = 32, launch=None) -> Tensor:
    """Launch the page-bounds kernel: ``ub [B, H, P]`` fp32, as ``page_bounds_reference``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass page bounds need Triton")
    wrap = launch or (lambda fn: fn)
    b, h, d = q.shape
    hkv, n_pages = kmin.shape[1], kmin.shape[2]
    if q.stride(-1) != 1:  # q[:, :, -1] of a [B, H, 1, D] query is read in place
        q = q.contiguous()
    if kmin.stride() != kmax.stride() or kmin.stride(-1) != 1:  # slices of page buffers are read in place
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    ub = torch.empty((b, h, n_pages), device=q.device, dtype=torch.float32)
    g = h // hkv
    grid = (b * hkv, triton.cdiv(n_pages, block_p))
    wrap(_kvpass_page_bounds_kernel)[grid](
        q,
        kmin,
        kmax,
        ub,
        n_pages,
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        kmin.stride(2),
        HKV=hkv,
        G=g,
        D=d,
        D_PAD=pow2(d),
        BLOCK_P=block_p,
    )
    return ub
