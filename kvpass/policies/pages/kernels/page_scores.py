"""Page scoring for page-granular decode policies (RaaS, Quest): Triton kernel and PyTorch reference.

For one decode step, per sequence ``b``, query head ``h`` (of KV group ``g``) and resident page
``p`` with representative keys ``kmin[b, g, p]`` / ``kmax[b, g, p]`` (element-wise min and max of
the page's keys), Quest's upper bound on the page's logits is

    ub[b, h, p] = sum_d max(q[b, h, d] * kmax[d], q[b, h, d] * kmin[d])

(``q`` carries the softmax scale). ``share[b, h, p] = softmax_p(ub[b, h, :])`` over the resident
pages (``live``) is the page's estimated attention share. RaaS stamps every page that some query
head of its group gives more than ``alpha``: ``ts[b, g, p] = now`` where ``max_h share > alpha``.
The outputs are ``ub`` reduced over the group by max (Quest ranks pages with it) and the new
timestamps; pages that are not live get ``ub = -inf`` and keep their timestamp.

The kernel runs one program per (sequence, KV head): pass 1 streams the pages in blocks of
``BLOCK_P`` and keeps each query head's running max and ``sum exp`` (online softmax, fp32) and
writes ``ub``; pass 2 recomputes the bound, normalises and writes the timestamps. The group's
queries are padded to a power of two; padded rows read zeros and are ignored.

``ub`` alone, per query head (``page_bounds_reference``, what the SlotCache decode steps of Quest and
RaaS rank and softmax), has its own kernel: one program per (sequence, KV head, block of ``BLOCK_P``
pages) loads the block's ``kmin`` / ``kmax`` once, upcast to fp32, and writes the bound of every query
head of the group, one head at a time (a ``[G, BLOCK_P, D]`` product spills registers at D = 128). The
scoring kernel above walks all pages of a KV head serially (too few programs at batch 1), and Inductor's
reduction of the reference re-reads the bounds once per query head; this grid spreads the pages over the
GPU and reads the bounds once.
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


def page_scores_reference(q: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor, alpha: float,
                          now: int) -> tuple[Tensor, Tensor]:
    """``(ub [B, H_kv, P] fp32, ts_new [B, H_kv, P] int64)``; see the module docstring."""
    b, h, _ = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    live_h = live.bool().repeat_interleave(h // hkv, dim=1)
    ub = page_bounds_reference(q, kmin, kmax).masked_fill(~live_h, float("-inf"))
    share = torch.softmax(ub, dim=-1).nan_to_num(0.0)  # a row with no live page: no share anywhere
    hit = (share > alpha).reshape(b, hkv, h // hkv, p).any(2) & live.bool()
    ub_g = ub.reshape(b, hkv, h // hkv, p).amax(2)
    return ub_g, torch.where(hit, torch.full_like(ts, now), ts).to(torch.int64)


if triton is not None:

    @triton.jit
    def _kvpass_head_bound(q, kx, kn):
        """One query head's bound ``[BLOCK_P]`` from ``q [D]`` and a block's fp32 ``kmax`` / ``kmin``
        ``[BLOCK_P, D]``: of ``q * kmax`` and ``q * kmin`` the larger is kmax's where ``q > 0`` and kmin's
        elsewhere (``q = 0`` gives 0 either way), so one select and one multiply-add per element, not two
        products and a max (the same products: equal bounds up to the order of the sum)."""
        return tl.sum(q[None, :] * tl.where(q[None, :] > 0, kx, kn), axis=1)

    @triton.jit
    def _kvpass_page_ub(Q, Kmin, Kmax, b, h, p0, n_pages, sq_b, sq_h, sk_b, sk_h, sk_p,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_P: tl.constexpr):
        gi = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        pi = p0 + tl.arange(0, BLOCK_P)
        qm = (gi < G)[:, None] & (d < D)[None, :]
        q = tl.load(Q + b * sq_b + (h * G + gi)[:, None] * sq_h + d[None, :], mask=qm, other=0.0).to(tl.float32)
        km = (pi < n_pages)[:, None] & (d < D)[None, :]
        off = b * sk_b + h * sk_h + pi[:, None].to(tl.int64) * sk_p + d[None, :]
        kx = tl.load(Kmax + off, mask=km, other=0.0).to(tl.float32)
        kn = tl.load(Kmin + off, mask=km, other=0.0).to(tl.float32)
        hi = q[:, None, :] * kx[None, :, :]
        lo = q[:, None, :] * kn[None, :, :]
        return tl.sum(tl.maximum(hi, lo), axis=2)  # [G_PAD, BLOCK_P]

    @triton.jit
    def _kvpass_page_scores_kernel(Q, Kmin, Kmax, Live, Ts, Ub, TsOut, n_pages, alpha, now,
                                   sq_b, sq_h, sk_b, sk_h, sk_p,
                                   HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                                   D_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        gi = tl.arange(0, G_PAD)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s = tl.zeros([G_PAD], tl.float32)
        for p0 in range(0, n_pages, BLOCK_P):
            pi = p0 + tl.arange(0, BLOCK_P)
            row = bh.to(tl.int64) * n_pages + pi
            ok = tl.load(Live + row, mask=pi < n_pages, other=0) != 0
            ub = _kvpass_page_ub(Q, Kmin, Kmax, b, h, p0, n_pages, sq_b, sq_h, sk_b, sk_h, sk_p,
                                 G, G_PAD, D, D_PAD, BLOCK_P)
            ub = tl.where(ok[None, :] & (gi < G)[:, None], ub, float("-inf"))
            tl.store(Ub + row, tl.max(ub, axis=0), mask=pi < n_pages)
            m_new = tl.maximum(m, tl.max(ub, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(ub - m_safe[:, None]), axis=1)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s_safe = tl.where(s > 0, s, 1.0)
        for p0 in range(0, n_pages, BLOCK_P):
            pi = p0 + tl.arange(0, BLOCK_P)
            row = bh.to(tl.int64) * n_pages + pi
            ok = tl.load(Live + row, mask=pi < n_pages, other=0) != 0
            ub = _kvpass_page_ub(Q, Kmin, Kmax, b, h, p0, n_pages, sq_b, sq_h, sk_b, sk_h, sk_p,
                                 G, G_PAD, D, D_PAD, BLOCK_P)
            ub = tl.where(ok[None, :] & (gi < G)[:, None], ub, float("-inf"))
            share = tl.exp(ub - m_safe[:, None]) / s_safe[:, None]
            hit = (tl.max(tl.where(share > alpha, 1, 0), axis=0) > 0) & ok
            old = tl.load(Ts + row, mask=pi < n_pages, other=0)
            tl.store(TsOut + row, tl.where(hit, now, old).to(tl.int64), mask=pi < n_pages)


    @triton.jit
    def _kvpass_page_bounds_kernel(Q, Kmin, Kmax, Ub, n_pages, sq_b, sq_h, sk_b, sk_h, sk_p,
                                   HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                                   BLOCK_P: tl.constexpr):
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
        # one query head at a time: a [G, BLOCK_P, D] product (_kvpass_page_ub) spills registers
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
        q, kmin, kmax, ub, n_pages, q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        HKV=hkv, G=g, D=d, D_PAD=pow2(d), BLOCK_P=block_p)
    return ub


def page_scores_triton(q: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor, alpha: float, now: int,
                       block_p: int = 16, launch=None) -> tuple[Tensor, Tensor]:
    """Launch the page-scoring kernel; arguments and results as ``page_scores_reference``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass page scoring needs Triton")
    wrap = launch or (lambda fn: fn)
    b, h, d = q.shape
    hkv, n_pages = kmin.shape[1], kmin.shape[2]
    q = q.contiguous()
    if kmin.stride() != kmax.stride() or kmin.stride(-1) != 1:  # slices of page buffers are read in place
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    live8 = live.to(torch.int8).contiguous()
    ts = ts.to(torch.int64).contiguous()
    ub = torch.empty((b, hkv, n_pages), device=q.device, dtype=torch.float32)
    ts_out = torch.empty_like(ts)
    g = h // hkv
    wrap(_kvpass_page_scores_kernel)[(b * hkv,)](
        q, kmin, kmax, live8, ts, ub, ts_out, n_pages, float(alpha), int(now),
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        HKV=hkv, G=g, G_PAD=pow2(g, 1), D=d, D_PAD=pow2(d), BLOCK_P=block_p)
    return ub, ts_out
