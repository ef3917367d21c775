"""RaaS's per-layer decode update (both caches): two Triton kernels and the PyTorch reference.

After a decode step wrote its token into slot ``16 cur + fill`` of a layer's page pool, RaaS
(``kvpass.policies.pages.raas``) updates the layer's page tables, per (sequence, KV head):

1. fold the token's key into page ``cur``'s element-wise bounds ``kmin`` / ``kmax`` (the page's
   first token sets them);
2. Quest's upper bound of every resident page for every query head of the group
   (``kvpass.kernels.page_bounds``), its softmax share over the resident pages, and the timestamp
   ``ts = now`` (tokens seen) on every decode page (``first .. first + decode_pages - 1``, the
   window) whose share exceeds ``alpha`` for some query head; prompt pages are never evicted, so
   their timestamps are not kept up to date;
3. plan the next token's slot: page ``cur`` while it has room; then the lowest free window page;
   when the window is full, the live window page with the oldest timestamp (ties: the earliest
   allocated, then the lowest page) is evicted and becomes ``cur``. The new page is marked live,
   stamped and born ``now``; ``meta = [cur, fill, first, evicted page or -1]``, ``seen = now``.

A window that runs past the pool (a SlotCache built for a shorter sequence) and has to evict sets
``seen = -2``, which the next step's placement check (``raas.slot_place``) reports; the planned
slots are then meaningless, and the check stops the generation before they are used.

The reference is the tensor code (about fifteen Inductor kernels per layer; 0.2 ms a step over
streamingllm's for a 2k prompt decoded to 32k, 8 layers, H200,
``bench/results/decode_step_h200_2026-11-26_u/b1_2k_decode_to_32k_tensor_code.json``). The Triton version is two
launches per layer:

* ``_kvpass_raas_bounds``, one program per (sequence, KV head, block of pages): the block's bounds
  with the token folded into page ``cur`` (the program holding ``cur`` writes its bounds back),
  every query head's bound (fp32, ``-inf`` where the page is not live), and per query head the block's
  share of the log-sum-exp (its max and the sum of ``exp`` below it, ``[B, H, pages / block]``); only
  the window's bounds are stored (``[B, H, W]``);
* ``_kvpass_raas_plan``, one program per (sequence, KV head): each query head's log-sum-exp from the
  blocks' partial sums, then the window in blocks: shares, stamps, and the running first free
  page and oldest live page; after a barrier (the window's stamp stores and the new page's stores
  may hit the same address from different threads) the new page and the metadata.

The partial sums (``parts``, chosen for up to 32 (sequence, KV head) rows) replaced, at small batches, a
plan that read every page's bound: its one program per (sequence, KV head), eight at batch 1, walked 8,321
pages per query head at a 128k prompt, serially, in every layer, which with the bounds put raas's generate
step 1.14x ``full``'s at 32 layers (1.11x with the partial sums; ``bench/results/fastpath_decode_loop_2026-11-27``).
Wider batches keep that plan, which is faster there (``bench/probes/tune_small_kernels.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.decode_attention import pow2
from kvpass.kernels.page_bounds import page_bounds_reference

try:
    import triton
    import triton.language as tl

    from kvpass.kernels.page_bounds import _kvpass_head_bound
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None

PAGE = 16
OVERFLOW = -2  # ``seen`` after an eviction the pool has no window for


def raas_stamp_reference(
    q: Tensor,
    k_new: Tensor,
    count: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    live: Tensor,
    ts: Tensor,
    born: Tensor,
    meta: Tensor,
    seen: Tensor,
    decode_pages: int,
    alpha: float,
) -> None:
    """In place, as the module docstring: ``q [B, H, D]`` (the step's queries), ``k_new [B, H_kv, D]``,
    ``count`` the SlotCache's counters ``[B, 5]`` (``count[b, 0]`` tokens row ``b`` has seen), tables
    ``[B, H_kv, P(, D)]``."""
    b, hkv, pages, _ = kmin.shape
    g = q.shape[1] // hkv
    cur, fill, first = meta[..., 0], meta[..., 1], meta[..., 2]
    rows = torch.arange(b, device=q.device)[:, None]
    heads = torch.arange(hkv, device=q.device)[None, :]
    knew = k_new.to(kmin.dtype)
    fresh = (fill == 0)[..., None]
    kmin.index_put_((rows, heads, cur), torch.where(fresh, knew, torch.minimum(kmin[rows, heads, cur], knew)))
    kmax.index_put_((rows, heads, cur), torch.where(fresh, knew, torch.maximum(kmax[rows, heads, cur], knew)))
    fill = fill + 1
    now = count[:, 0, None, None]  # [B, 1, 1]
    ub = page_bounds_reference(q, kmin, kmax).masked_fill(~live.repeat_interleave(g, 1), float("-inf"))
    share = (ub - torch.logsumexp(ub, -1, keepdim=True)).exp()  # NaN for a row with no live page: no stamp
    idx = torch.arange(pages, device=q.device)
    dec = (idx >= first[..., None]) & (idx < first[..., None] + decode_pages)
    stamped = torch.where((share > alpha).view(b, hkv, g, pages).any(2) & live & dec, now, ts)
    span = first[..., None] + torch.arange(decode_pages, device=q.device)  # the window [B, H_kv, W]
    win, inside = span.clamp_max(pages - 1), span < pages
    resident = live.gather(2, win)
    live_w, free = resident & inside, ~resident & inside
    new_page = fill >= PAGE
    evict = new_page & ~free.any(-1)
    key = torch.where(live_w, stamped.gather(2, win) * (1 << 32) + born.gather(2, win), torch.iinfo(torch.long).max)
    victim = win.gather(2, key.argmin(-1, keepdim=True))[..., 0]
    first_free = win.gather(2, free.long().argmax(-1, keepdim=True))[..., 0]
    nxt = torch.where(new_page, torch.where(evict, victim, first_free), cur)
    take = new_page[..., None] & (idx == nxt[..., None])
    live.logical_or_(take)
    ts.copy_(torch.where(take, now, stamped))
    born.copy_(torch.where(take, now, born))
    meta.copy_(torch.stack([nxt, torch.where(new_page, 0, fill), first, torch.where(evict, victim, -1)], -1))
    seen.copy_(torch.where(evict & (first + decode_pages > pages), OVERFLOW, now[..., 0]))


if triton is not None:

    @triton.jit(do_not_specialize=["n_pages"])
    def _kvpass_raas_bounds(
        Q,
        Knew,
        Kmin,
        Kmax,
        Live,
        Meta,
        Ub,
        PartM,
        PartS,
        n_pages,
        sq_b,
        sq_h,
        sn_b,
        sn_h,
        sk_b,
        sk_h,
        sk_p,
        W: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_P: tl.constexpr,
        PARTS: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // HKV, bh % HKV
        blk = tl.program_id(1)
        pi = blk * BLOCK_P + tl.arange(0, BLOCK_P)
        d = tl.arange(0, D_PAD)
        pm = pi < n_pages
        km = pm[:, None] & (d < D)[None, :]
        Kmax += b * sk_b + h * sk_h  # the row; 32-bit offsets within it (pages * D < 2^31)
        Kmin += b * sk_b + h * sk_h
        off = pi[:, None] * sk_p + d[None, :]
        kx = tl.load(Kmax + off, mask=km, other=0.0).to(tl.float32)
        kn = tl.load(Kmin + off, mask=km, other=0.0).to(tl.float32)
        cur = tl.load(Meta + bh * 4)
        first = tl.load(Meta + bh * 4 + 2)
        if (cur >= blk * BLOCK_P) & (cur < blk * BLOCK_P + BLOCK_P):  # this program holds page cur: fold the token
            fresh = tl.load(Meta + bh * 4 + 1) == 0
            # in fp32, exact for the cache's dtype (the bound is one of the two values; the new key is rounded to
            # the cache's dtype first): Triton 3.9's interpreter compares bf16 by its bits in maximum / minimum
            x = tl.load(Kmax + cur * sk_p + d, mask=d < D)
            n = tl.load(Kmin + cur * sk_p + d, mask=d < D)
            knew = tl.load(Knew + b * sn_b + h * sn_h + d, mask=d < D).to(x.dtype).to(tl.float32)
            x = tl.where(fresh, knew, tl.maximum(x.to(tl.float32), knew))
            n = tl.where(fresh, knew, tl.minimum(n.to(tl.float32), knew))
            tl.store(Kmax + cur * sk_p + d, x.to(Kmax.dtype.element_ty), mask=d < D)
            tl.store(Kmin + cur * sk_p + d, n.to(Kmin.dtype.element_ty), mask=d < D)
            at = (pi == cur)[:, None]
            kx = tl.where(at, x[None, :], kx)
            kn = tl.where(at, n[None, :], kn)
        ok = tl.load(Live + bh * n_pages + pi, mask=pm, other=0) != 0
        wi = pi - first
        win = pm & (wi >= 0) & (wi < W)  # the window's bounds are kept for the plan, the others only summed
        for j in tl.static_range(G):  # one query head at a time (a [G, BLOCK_P, D] product spills)
            q = tl.load(Q + b * sq_b + (h * G + j) * sq_h + d, mask=d < D, other=0.0).to(tl.float32)
            ub = tl.where(ok, _kvpass_head_bound(q, kx, kn), float("-inf"))
            if PARTS:  # this block's share of the head's log-sum-exp: its max and sum of exp below it
                mj = tl.max(ub, axis=0)
                tl.store(PartM + (bh * G + j) * n_pages + blk, mj)  # rows of n_pages, the first pages/BLOCK_P used
                tl.store(
                    PartS + (bh * G + j) * n_pages + blk,
                    tl.sum(tl.exp(ub - tl.where(mj == float("-inf"), 0.0, mj)), axis=0),
                )
                tl.store(Ub + (bh * G + j) * W + wi, ub, mask=win)
            else:
                tl.store(Ub + (bh * G + j) * n_pages + pi, ub, mask=pm)

    @triton.jit(do_not_specialize=["n_pages"])
    def _kvpass_raas_plan(
        Ub,
        PartM,
        PartS,
        Count,
        Live,
        Ts,
        Born,
        Meta,
        Seen,
        n_pages,
        alpha,
        W: tl.constexpr,
        HKV: tl.constexpr,
        COUNT_ROW: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_P: tl.constexpr,
        PARTS: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        gi = tl.arange(0, G_PAD)
        # each query head's log-sum-exp over all pages (online, fp32): from the bounds programs' partial
        # sums (PARTS: one per BLOCK_P pages), or from every page's bound (a partial of one page: its max, sum 1)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s = tl.zeros([G_PAD], tl.float32)
        n = tl.cdiv(n_pages, BLOCK_P) if PARTS else n_pages
        rows = (bh * G + gi) * n_pages
        for p0 in range(0, n, BLOCK_B):
            pi = p0 + tl.arange(0, BLOCK_B)
            at = rows[:, None] + pi[None, :]
            there = (gi < G)[:, None] & (pi < n)[None, :]
            if PARTS:
                pm = tl.load(PartM + at, mask=there, other=float("-inf"))
                ps = tl.load(PartS + at, mask=there, other=0.0)
            else:
                pm = tl.load(Ub + at, mask=there, other=float("-inf"))
                ps = tl.where(pm == float("-inf"), 0.0, 1.0)
            m_new = tl.maximum(m, tl.max(pm, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(ps * tl.exp(pm - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(m == float("-inf"), float("inf"), m + tl.log(tl.maximum(s, 1.0)))  # no live page: shares 0
        now = tl.load(Count + (bh // HKV) * COUNT_ROW)  # the row's tokens seen
        cur = tl.load(Meta + bh * 4)
        fill = tl.load(Meta + bh * 4 + 1) + 1
        first = tl.load(Meta + bh * 4 + 2)
        big: tl.constexpr = 1 << 62
        oldest = tl.full([], 9223372036854775807, tl.int64)
        oldest_at = tl.full([], 0, tl.int64)
        free_at = tl.full([], big, tl.int64)
        for w0 in range(0, W, BLOCK_W):
            wi = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
            page = first + wi
            inside = (wi < W) & (page < n_pages)
            if PARTS:  # the bounds kept for the window only
                at = ((bh * G + gi) * W)[:, None] + wi[None, :]
            else:
                at = rows[:, None] + page[None, :]
            ub = tl.load(Ub + at, mask=(gi < G)[:, None] & inside[None, :], other=float("-inf"))
            hit = tl.max(tl.where(tl.exp(ub - lse[:, None]) > alpha, 1, 0), axis=0) > 0
            ok = tl.load(Live + bh * n_pages + page, mask=inside, other=0) != 0
            t = tl.load(Ts + bh * n_pages + page, mask=inside, other=0)
            t = tl.where(hit & ok, now, t)
            tl.store(Ts + bh * n_pages + page, t, mask=inside)
            key = tl.where(
                ok & inside,
                t * 4294967296 + tl.load(Born + bh * n_pages + page, mask=inside, other=0),
                9223372036854775807,
            )
            k_min = tl.min(key, axis=0)
            k_at = tl.min(tl.where(key == k_min, wi, big), axis=0)
            better = k_min < oldest
            oldest_at = tl.where(better, k_at, oldest_at)
            oldest = tl.where(better, k_min, oldest)
            free_at = tl.minimum(free_at, tl.min(tl.where(inside & ~ok, wi, big), axis=0))
        new_page = fill >= 16
        evict = new_page & (free_at == big)
        victim = tl.minimum(first + oldest_at, n_pages - 1)
        first_free = tl.minimum(first + tl.where(free_at == big, 0, free_at), n_pages - 1)
        nxt = tl.where(new_page, tl.where(evict, victim, first_free), cur)
        tl.debug_barrier()  # the window's stamps are stored before the new page's
        tl.store(Live + bh * n_pages + nxt, 1, mask=new_page)
        tl.store(Ts + bh * n_pages + nxt, now, mask=new_page)
        tl.store(Born + bh * n_pages + nxt, now, mask=new_page)
        tl.store(Meta + bh * 4, nxt)
        tl.store(Meta + bh * 4 + 1, tl.where(new_page, 0, fill))
        tl.store(Meta + bh * 4 + 3, tl.where(evict, victim, -1))
        tl.store(Seen + bh, tl.where(evict & (first + W > n_pages), -2, now))


def raas_stamp_triton(
    q: Tensor,
    k_new: Tensor,
    count: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    live: Tensor,
    ts: Tensor,
    born: Tensor,
    meta: Tensor,
    seen: Tensor,
    decode_pages: int,
    alpha: float,
    block_p: int = 16,
    warps: int = 2,
    block_w: int = 256,
    block_b: int = 0,
    parts: bool | None = None,
    launch=None,
) -> None:
    """Launch the two kernels; arguments and effects as ``raas_stamp_reference``. The tables must be
    contiguous (a SlotCache allocates them so); ``q`` and ``k_new`` are read through their strides.
    ``block_p`` pages per bounds program (``warps`` warps; the defaults won ``bench/probes/tune_small_kernels.py``
    on an H200); with ``parts`` each bounds program also leaves its pages' share of every query head's
    log-sum-exp (max and sum of exp) and the bounds of the window's pages only, so the plan (one program per
    sequence and KV head) merges ``pages / block_p`` partial sums, not every page's bound. ``None``: parts
    when there are at most 32 (sequence, KV head) rows, where the plan's few programs walking every page were
    the cost (H200, 8 rows: 22 us against 32 us per layer at a 128k pool); at 128 rows the plan runs wide
    anyway and the partial sums only slow the bounds (78 us against 59 us at 32k). ``block_b`` values per
    step of the plan's merge (0: 2,048 over the group's heads) and ``block_w`` window pages per step of its
    window loop. Nothing is sized by the pool but its own page count (the partial sums' rows are
    ``n_pages`` long): an expression of it would be a new symbol for Inductor to guard on, and a SlotCache
    of another capacity compiled another decode graph."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass raas_stamp needs Triton")
    wrap = launch or (lambda fn: fn)
    b, h, d = q.shape
    hkv, n_pages = kmin.shape[1], kmin.shape[2]
    g = h // hkv
    parts = b * hkv <= 32 if parts is None else parts
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    ub = torch.empty((b, h, decode_pages if parts else n_pages), device=q.device, dtype=torch.float32)
    part_m, part_s = (
        (torch.empty((b, h, n_pages), device=q.device, dtype=torch.float32) for _ in range(2)) if parts else (ub, ub)
    )
    wrap(_kvpass_raas_bounds)[(b * hkv, triton.cdiv(n_pages, block_p))](
        q,
        k_new,
        kmin,
        kmax,
        live,
        meta,
        ub,
        part_m,
        part_s,
        n_pages,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        kmin.stride(2),
        W=decode_pages,
        HKV=hkv,
        G=g,
        D=d,
        D_PAD=pow2(d),
        BLOCK_P=block_p,
        PARTS=parts,
        num_warps=warps,
    )
    g_pad = pow2(g, 1)
    wrap(_kvpass_raas_plan)[(b * hkv,)](
        ub,
        part_m,
        part_s,
        count,
        live,
        ts,
        born,
        meta,
        seen,
        n_pages,
        float(alpha),
        W=decode_pages,
        HKV=hkv,
        COUNT_ROW=count.stride(0),
        G=g,
        G_PAD=g_pad,
        BLOCK_B=block_b or max(16, min(1024, 2048 // g_pad)),
        BLOCK_W=min(block_w, pow2(decode_pages)),
        BLOCK_P=block_p,
        PARTS=parts,
    )
