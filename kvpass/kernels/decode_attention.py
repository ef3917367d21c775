"""Decode attention with ART early termination: the Triton kernel and its PyTorch reference.

One query token per sequence (a decode step) attends over a KV cache that is either contiguous
(``k``/``v`` of shape ``[B, H_kv, L, D]``) or paged (pools ``[P, H_kv, page, D]`` plus a page table
``[B, pages]`` and per-sequence lengths). The cache is read in blocks of ``block`` entries with a
streaming (online) softmax, in one of three orders:

* ``ORDER_NATURAL``: blocks 0, 1, ..., n-1;
* ``ORDER_RECENCY``: block 0 first, then the most recent block and backwards (0, n-1, n-2, ..., 1),
  the order ART uses: sinks, then recent context, then the distant middle;
* ``ORDER_MAP``: ``block_map[b, g, i]`` is the block read at step ``i`` (a caller's ranking).
  The map has ``steps <= blocks`` columns and only its steps are read; a negative entry is a step
  that reads nothing. A caller that selects blocks (Quest's top pages) lists them first and pads
  the row with -1, so a program reads its selection and no other entry.

**ART termination** (Attention Run-time Termination). After each block the program measures the
change of a probe vector ``x``: the running normalised output ``acc / l`` restricted to every
``head_dim // probe``-th element. With ``x_t`` after step ``t``::

    d_scale = ||x_t - x_{t-1}|| / ||x_t||          (relative: the same tau works for any model)
    d_dir   = 1 - cos(x_t, x_{t-1})

A step is stable when ``d_scale < tau`` and ``d_dir < phi`` hold for **every query head of the KV
group**: one program reads each K/V block once for all heads of its group (GQA packing), so the
group stops together, and only when no head still moves. The first block read is never stable (it
has nothing to compare with). After ``patience`` consecutive stable steps the remaining blocks are
skipped. ``tau = 0`` or ``phi = 0`` never stops (both tests are strict), which is exact attention.

Choices the ART paper leaves open, and why:

* block 128 by default: on captured attention it reads fewer blocks at lower error than block 64
  for the same thresholds, and the stop rule's per-step reductions cost less per entry read;
* probe = every element by default (``probe = head_dim``): the probe lives in registers, and the
  norms cost ``G x D`` flops per block against ``2 x G x block x D`` for the block itself, so a
  subset saves nothing measurable on a GPU; ``probe`` picks a strided subset when asked;
* relative ``d_scale``: the absolute change depends on the norm of the values, which differs by
  model and layer; relative change makes the defaults portable;
* per-group decisions with all heads required stable (see above).

**Ragged heads** (per-head budgets). With ``kv_start [B, H_kv]`` the KV heads of a row share one pool
(``k``/``v`` ``[B, 1, S, D]``, ``kv_pos`` ``[B, 1, S]``) and head ``g`` holds the ``kv_len[b, g]`` entries from
``kv_start[b, g]``: its program reads its own range and no other entry, so a head that keeps 8 entries reads 8
however many its neighbours keep. Blocks, orders and ART count from the head's first entry. Split-KV cuts the
row's pool into ``H_kv`` times the splits of one head, each split a fixed number of blocks, so a head gets splits in
proportion to its length and a long head does not hold up the step.

**Masking.** Entry ``j`` is read when it is inside the sequence (``j < kv_len[b]``, or ``kv_len[b, g]`` per
head, when lengths are given) and, with positions, ``0 <= kv_pos[j] <= q_pos[b]`` and (sliding layers)
``q_pos[b] - kv_pos[j] < window``. An additive or boolean ``mask`` of shape ``[B|1, 1, 1, L]`` is
applied too (additive values at the dtype's minimum count as masked). A row with nothing visible
gives zeros. A block with nothing visible (padding, the unfilled tail of a static cache) leaves
the output unchanged and is neutral for ART: it neither counts as a stable step nor resets the
count, so an empty region can never end the read early.

**Split-KV.** When ART is off and ``B x H_kv`` programs cannot fill the GPU, each program reads a
contiguous range of steps and a second kernel merges the partial softmax states. Plain ART is never
split: a split cannot know whether the steps before it have already converged. With a ``horizon``
the stop rule may fire only within the first ``horizon`` steps (one program per sequence and KV
head); where it has not, the remaining steps are read split-KV and merged. A read then either
stops where sequential ART stops or reads everything.

The statistics output ``visited[b, g]`` counts the blocks each program group read (steps with a
negative ``block_map`` entry are not counted).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

ORDER_NATURAL, ORDER_RECENCY, ORDER_MAP = 0, 1, 2
ORDERS = {"natural": ORDER_NATURAL, "recency": ORDER_RECENCY, "map": ORDER_MAP}
_LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None


# ----------------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------------


def _logical(t: Tensor, page_table: Tensor | None) -> Tensor:
    """Pool [P, H, page, ...] + table [B, n] -> [B, H, n * page, ...]; contiguous input unchanged."""
    if page_table is None:
        return t
    g = t[page_table.long()]  # [B, n, H, page, ...]
    g = g.movedim(2, 1)  # [B, H, n, page, ...]
    return g.reshape(g.shape[0], g.shape[1], g.shape[2] * g.shape[3], *g.shape[4:])


def visibility(
    b: int,
    hkv: int,
    length: int,
    device,
    mask: Tensor | None,
    kv_pos: Tensor | None,
    q_pos: Tensor | None,
    kv_len: Tensor | None,
    window: int,
) -> tuple[Tensor, Tensor | None]:
    """(visible [B, H_kv, L] bool, additive mask [B, 1, L] fp32 or None) in the logical layout."""
    vis = torch.ones(b, hkv, length, dtype=torch.bool, device=device)
    if kv_len is not None:
        vis &= torch.arange(length, device=device) < kv_len.view(b, -1, 1)  # per sequence or per KV head
    if kv_pos is not None:
        qp = q_pos.view(b, 1, 1)
        vis &= (kv_pos >= 0) & (kv_pos <= qp)
        if window > 0:
            vis &= (qp - kv_pos) < window
    add = None
    if mask is not None:
        add = mask_row(mask)[:, None, :].expand(b, 1, length)
        vis &= add > float("-inf")
    return vis, add


def mask_row(mask: Tensor) -> Tensor:
    """The decode query's row of a ``[B|1, 1, 1, L]`` mask as fp32 additive ``[B|1, L]``."""
    return additive(mask.reshape(mask.shape[0], -1, mask.shape[-1])[:, -1, :])


def additive(mask: Tensor) -> Tensor:
    """A boolean or additive mask as fp32 additive, with every "masked" value (HF fills masked
    entries with the dtype's minimum) turned into -inf, so masked entries are recognisable."""
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, float("-inf"))
    return torch.where(mask > torch.finfo(mask.dtype).min / 2, mask.float(), float("-inf"))


def decode_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    kv_pos: Tensor | None = None,
    q_pos: Tensor | None = None,
    page_table: Tensor | None = None,
    kv_len: Tensor | None = None,
    block_map: Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    tau: float = 0.0,
    phi: float = 0.0,
    patience: int = 5,
    block: int = 128,
    order: int = ORDER_RECENCY,
    probe: int = 0,
    horizon: int = 0,
    kv_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-wise streaming-softmax decode attention with ART, in fp32 PyTorch.

    Same arguments and semantics as the kernel (see the module docstring); returns
    ``(out [B, H, 1, D] in q.dtype, visited [B, H_kv] int32)``.
    """
    b, h, lq, d = q.shape
    if lq != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {lq}")
    if kv_start is not None:
        k, v, kv_pos = ragged_heads(k, v, kv_pos, kv_start, kv_len, page_table)
    k, v = _logical(k, page_table), _logical(v, page_table)
    if kv_pos is not None and page_table is not None:
        kv_pos = _logical(kv_pos[:, None, :], page_table).expand(b, k.shape[1], -1)
    hkv, length = k.shape[1], k.shape[2]
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    vis, add = visibility(b, hkv, length, q.device, mask, kv_pos, q_pos, kv_len, window)

    s = torch.einsum("bkgd,bkld->bkgl", q.float().reshape(b, hkv, g, d), k.float()) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if add is not None:
        s = s + add[:, :, None, :]
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))

    nb = -(-length // block)
    pad = nb * block - length
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf")).reshape(b, hkv, g, nb, block)
    vf = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).reshape(b, hkv, nb, block, v.shape[-1])
    if kv_len is not None:  # a sequence has only cdiv(len, block) blocks; the order is over those
        nb_row = ((kv_len.long() + block - 1) // block).clamp(max=nb).view(b, -1).expand(b, hkv)
    else:
        nb_row = torch.full((b, hkv), nb, device=q.device, dtype=torch.long)
    if block_map is not None:  # a map may list fewer steps than blocks; -1 = a step that reads nothing
        idx = block_map.long()
        nb_steps = min(nb, idx.shape[-1])
    else:
        nb_steps = nb
        steps = torch.arange(nb, device=q.device).expand(b, hkv, nb)
        idx = steps if order == ORDER_NATURAL else torch.where(steps == 0, steps, nb_row[..., None] - steps)
    in_range = torch.arange(nb_steps, device=q.device) < nb_row[..., None]  # [B, H_kv, steps]

    dv = v.shape[-1]
    m = torch.full((b, hkv, g), float("-inf"), device=q.device)
    l = torch.zeros(b, hkv, g, device=q.device)
    acc = torch.zeros(b, hkv, g, dv, device=q.device)
    prev = torch.zeros_like(acc)
    probe_mask = _probe_mask(dv, probe, q.device)
    stable = torch.zeros(b, hkv, dtype=torch.long, device=q.device)
    active = torch.ones(b, hkv, dtype=torch.bool, device=q.device)
    visited = torch.zeros(b, hkv, dtype=torch.int32, device=q.device)
    art = tau > 0 and phi > 0
    for i in range(nb_steps):
        active = active & in_range[..., i]
        j = idx[..., i].clamp(0, nb - 1)
        took = idx[..., i] >= 0
        sb = s.gather(3, j.view(b, hkv, 1, 1, 1).expand(b, hkv, g, 1, block)).squeeze(3)
        sb = sb.masked_fill(~took.view(b, hkv, 1, 1), float("-inf"))
        vb = vf.gather(2, j.view(b, hkv, 1, 1, 1).expand(b, hkv, 1, block, dv)).squeeze(2)
        m_new = torch.maximum(m, sb.amax(-1))
        m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(sb - m_safe[..., None])
        on = active[..., None]
        l = torch.where(on, l * alpha + p.sum(-1), l)
        acc = torch.where(on[..., None], acc * alpha[..., None] + torch.einsum("bkgn,bknd->bkgd", p, vb), acc)
        m = torch.where(on, m_new, m)
        visited += (active & took).int()
        if art:
            x = torch.where(l[..., None] > 0, acc / l[..., None].clamp_min(1e-38), 0.0) * probe_mask
            ok = _stable(x, prev, tau, phi).all(dim=-1) & (i > 0)
            live = torch.isfinite(sb).any(-1).any(-1)  # a block with nothing visible changes nothing
            stable = torch.where(active & live, torch.where(ok, stable + 1, 0), stable)
            prev = torch.where(on[..., None], x, prev)
            if horizon == 0 or i < horizon:  # past the horizon the read goes to the end
                active = active & (stable < patience)
    out = torch.where(l[..., None] > 0, acc / l[..., None].clamp_min(1e-38), 0.0)
    return out.reshape(b, h, 1, dv).to(q.dtype), visited


def ragged_heads(
    k: Tensor, v: Tensor, kv_pos: Tensor | None, kv_start: Tensor, kv_len: Tensor | None, page_table: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """A pool its KV heads share (``k``/``v`` ``[B, 1, S, D]``, ``kv_pos`` ``[B, 1, S]``), head ``g`` of row ``b``
    holding entries ``kv_start[b, g] .. + kv_len[b, g] - 1``, as one ``[B, H_kv, S, ...]`` view per head whose
    entry ``i`` is the pool's ``kv_start + i`` (entries past a head's length are cut by ``kv_len``)."""
    check_ragged(k, kv_start, kv_len, page_table)
    b, hkv, n = k.shape[0], kv_start.shape[1], k.shape[2]
    idx = (kv_start.long()[..., None] + torch.arange(n, device=k.device)).clamp(max=n - 1)  # [B, H_kv, S]

    def take(t):
        return t.expand(b, hkv, *t.shape[2:]).gather(
            2, idx.view(*idx.shape, *[1] * (t.dim() - 3)).expand(b, hkv, n, *t.shape[3:])
        )

    return take(k), take(v), None if kv_pos is None else take(kv_pos)


def check_ragged(k: Tensor, kv_start: Tensor, kv_len: Tensor | None, page_table: Tensor | None) -> None:
    if kv_len is None or kv_len.shape != kv_start.shape or page_table is not None or k.shape[1] != 1:
        raise ValueError(
            "ragged heads (kv_start [B, H_kv]) read a contiguous pool [B, 1, S, D] with per-head "
            f"lengths kv_len [B, H_kv]; got k {tuple(k.shape)}, kv_len "
            f"{None if kv_len is None else tuple(kv_len.shape)}, page_table {page_table is not None}"
        )


def _probe_mask(d: int, probe: int, device) -> Tensor:
    stride = max(1, d // probe) if probe > 0 else 1
    return (torch.arange(d, device=device) % stride == 0).float()


def _stable(x: Tensor, prev: Tensor, tau: float, phi: float) -> Tensor:
    """Per-head stability of one step (the same formulas as the kernel)."""
    nx = x.norm(dim=-1)
    npv = prev.norm(dim=-1)
    d_scale = (x - prev).norm(dim=-1) / nx.clamp_min(1e-30)
    d_dir = 1.0 - (x * prev).sum(-1) / (nx * npv).clamp_min(1e-30)
    return (d_scale < tau) & (d_dir < phi)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _sum3(a0, a1, a2, b0, b1, b2):
        return a0 + b0, a1 + b1, a2 + b2

    @triton.jit
    def _read_block(
        i,
        nb,
        limit,
        base,
        m,
        l,
        acc,
        q,
        b,
        hk,
        qp,
        d,
        dmask,
        K,
        V,
        Mask,
        KvPos,
        Table,
        Map,
        scale,
        qk_scale,
        softcap,
        window,
        sk_0,
        sk_h,
        sk_l,
        sv_0,
        sv_h,
        sv_l,
        sm_b,
        sm_l,
        sp_0,
        sp_h,
        sp_l,
        st_b,
        smap_b,
        smap_h,
        BLOCK: tl.constexpr,
        PAGE: tl.constexpr,
        ORDER: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HAS_POS: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Step ``i``: read one block (in the chosen order) into the streaming-softmax state.

        Entries at or past ``limit`` (the sequence's or the head's length) are outside the cache; a negative map
        entry reads nothing. ``base``: the first entry of the head's range in a pool its heads share (0 when
        each head has its own rows). Also returns whether the block had any visible entry (ART's neutral
        empty blocks) and whether the step read a block at all."""
        if ORDER == 0:
            j = i
        elif ORDER == 1:
            j = tl.where(i == 0, 0, nb - i)
        else:
            j = tl.load(Map + b * smap_b + hk * smap_h + i).to(tl.int32)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        valid = (offs < limit) & (offs >= 0)
        if PAGE > 0:
            page = tl.load(Table + b * st_b + offs // PAGE, mask=valid, other=0).to(tl.int64)
            rows_k = page * sk_0 + hk * sk_h + (offs % PAGE) * sk_l
            rows_v = page * sv_0 + hk * sv_h + (offs % PAGE) * sv_l
            rows_p = page * sp_0 + hk * sp_h + (offs % PAGE) * sp_l
        else:
            at = (base + offs).to(tl.int64)
            rows_k = b * sk_0 + hk * sk_h + at * sk_l
            rows_v = b * sv_0 + hk * sv_h + at * sv_l
            rows_p = b * sp_0 + hk * sp_h + at * sp_l
        if HAS_POS:
            kp = tl.load(KvPos + rows_p, mask=valid, other=-1)
            seen = (kp >= 0) & (kp <= qp)
            if window > 0:
                seen = seen & ((qp - kp) < window)
            valid = valid & seen
        if HAS_MASK:
            add = tl.load(Mask + b * sm_b + offs * sm_l, mask=valid, other=float("-inf"))
            valid = valid & (add != float("-inf"))
        kt = tl.load(K + rows_k[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        vt = tl.load(V + rows_v[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        if SOFTCAP:
            s = s * scale
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
        else:
            s = s * qk_scale
        s = s.to(tl.float32)  # Inductor may pass float scalars as fp64
        if HAS_MASK:
            s += tl.where(valid, add, 0.0)[None, :] * 1.4426950408889634
        s = tl.where(valid[None, :], s, float("-inf"))
        row_max = tl.max(s, 1)
        live = tl.max(row_max, 0) > float("-inf")  # a block with nothing visible changes nothing
        m_new = tl.maximum(m, row_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m = m_new
        return m, l, acc, live, (j >= 0).to(tl.int32)

    @triton.jit
    def _art_watch(
        not_first,
        m,
        l,
        acc,
        live,
        took,
        prev,
        npv,
        stable,
        count,
        m_s,
        l_s,
        acc_s,
        probe,
        g,
        tau,
        phi,
        patience,
        GROUP: tl.constexpr,
    ):
        """ART's stop rule after one step: the probe's change against the last step, the run of stable
        steps, the blocks counted, and the state kept at the patience-th stable step. Returns the new
        ``(prev, ||prev||, stable, count, m_s, l_s, acc_s)``."""
        x = acc * tl.where(l > 0, 1.0 / l, 0.0)[:, None]
        x = tl.where(probe[None, :], x, 0.0)
        diff = x - prev
        # one reduction over head_dim for all three sums (each is a cross-warp exchange)
        sxx, sdd, sxp = tl.reduce((x * x, diff * diff, x * prev), 1, _sum3)
        nx = tl.sqrt(sxx)
        d_scale = tl.sqrt(sdd) / tl.maximum(nx, 1e-30)
        d_dir = 1.0 - sxp / tl.maximum(nx * npv, 1e-30)
        ok = ((d_scale < tau) & (d_dir < phi)) | (g >= GROUP)
        all_ok = tl.min(ok.to(tl.int32), 0) > 0
        running = stable < patience
        stable = tl.where(running & live, tl.where(all_ok & not_first, stable + 1, 0), stable)
        count += running.to(tl.int32) * took
        done = running & (stable >= patience)
        m_s = tl.where(done, m, m_s)
        l_s = tl.where(done, l, l_s)
        acc_s = tl.where(done, acc, acc_s)
        return x, nx, stable, count, m_s, l_s, acc_s

    @triton.jit
    def _merge(m, l, acc, ms, ls, a):
        """Merge a partial softmax state ``(ms, ls, a)`` into ``(m, l, acc)`` (exp2 domain)."""
        m_new = tl.maximum(m, ms)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.exp2(m - m_safe)
        w_new = tl.exp2(ms - m_safe)
        return m_new, l * w_old + ls * w_new, acc * w_old[:, None] + a * w_new[:, None]

    # lengths change every decode step: specialising on their values (== 1, divisible by 16) would
    # compile new variants while the cache grows
    @triton.jit(
        do_not_specialize=["window", "patience", "length", "n_blocks", "step0", "blocks_per_split", "part0", "n_parts"]
    )
    def _kvpass_decode_kernel(
        Q,
        K,
        V,
        Out,
        Mask,
        KvPos,
        QPos,
        Table,
        KvLen,
        KvStart,
        Map,
        Visited,
        PartAcc,
        PartM,
        PartL,
        Stopped,
        scale,
        softcap,
        tau,
        phi,
        window,
        patience,
        length,
        n_blocks,
        step0,
        blocks_per_split,
        part0,
        n_parts,
        sq_b,
        sq_h,
        sk_0,
        sk_h,
        sk_l,
        sv_0,
        sv_h,
        sv_l,
        sm_b,
        sm_l,
        sp_0,
        sp_h,
        sp_l,
        st_b,
        smap_b,
        smap_h,
        sl_b,
        sl_h,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        PAGE: tl.constexpr,
        ORDER: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HAS_POS: tl.constexpr,
        HAS_LEN: tl.constexpr,
        HAS_START: tl.constexpr,
        SOFTCAP: tl.constexpr,
        ART: tl.constexpr,
        PROBE_STRIDE: tl.constexpr,
        SPLIT: tl.constexpr,
        UPCAST: tl.constexpr,
        CHUNK: tl.constexpr,
        AFTER_ART: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        sp = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        dmask = d < D
        heads = hk * GROUP + g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 domain

        limit = length  # entries past a sequence's length are outside its cache
        if HAS_LEN:  # per sequence (sl_h 0) or per (sequence, KV head)
            limit = tl.load(KvLen + b * sl_b + hk * sl_h).to(tl.int32)
        base = 0
        if HAS_START:  # ragged heads: this head's range starts here in the pool its heads share
            base = tl.load(KvStart + b * sl_b + hk * sl_h).to(tl.int32)
        nb = tl.minimum(tl.cdiv(limit, BLOCK), n_blocks)
        qp = 0
        if HAS_POS:
            qp = tl.load(QPos + b)
        # blocks_per_split 0: this sequence's or head's own blocks shared by the splits, so a short head (or row)
        # keeps every split busy rather than the few whose ranges of the longest one it reaches
        per = tl.where(blocks_per_split > 0, blocks_per_split, tl.cdiv(tl.maximum(nb - step0, 0), tl.num_programs(2)))
        start = step0 + sp * per
        stop = tl.minimum(start + per, nb)
        if AFTER_ART:  # the rest of a horizon read: nothing left to read where ART has stopped
            stop = tl.where(tl.load(Stopped + b * tl.num_programs(1) + hk) != 0, start, stop)

        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        if ART:
            # The read runs on, and the stop rule watches it: after each block the probe's change
            # is measured, and when the patience-th stable step in a row arrives, the state at that
            # step is kept (m_s, l_s, acc_s). Nothing on the read's own dependency chain waits for
            # the decision, so the loads and dots of the next blocks overlap the stability math.
            # The outer while loop leaves at the first chunk boundary after the stop; the few blocks
            # read past it inside a chunk are discarded, so the result is the sequential rule's.
            prev = tl.zeros([G_PAD, D_PAD], tl.float32)
            npv = tl.zeros([G_PAD], tl.float32)  # ||prev||
            probe = (d % PROBE_STRIDE == 0) & dmask
            stable = tl.full([], 0, tl.int32)
            count = tl.full([], 0, tl.int32)
            m_s, l_s, acc_s = m, l, acc
            c = start
            while (c < stop) & (stable < patience):
                for i in range(c, tl.minimum(c + CHUNK, stop)):
                    m, l, acc, live, took = _read_block(
                        i,
                        nb,
                        limit,
                        base,
                        m,
                        l,
                        acc,
                        q,
                        b,
                        hk,
                        qp,
                        d,
                        dmask,
                        K,
                        V,
                        Mask,
                        KvPos,
                        Table,
                        Map,
                        scale,
                        qk_scale,
                        softcap,
                        window,
                        sk_0,
                        sk_h,
                        sk_l,
                        sv_0,
                        sv_h,
                        sv_l,
                        sm_b,
                        sm_l,
                        sp_0,
                        sp_h,
                        sp_l,
                        st_b,
                        smap_b,
                        smap_h,
                        BLOCK,
                        PAGE,
                        ORDER,
                        HAS_MASK,
                        HAS_POS,
                        SOFTCAP,
                        UPCAST,
                    )
                    prev, npv, stable, count, m_s, l_s, acc_s = _art_watch(
                        i > start,
                        m,
                        l,
                        acc,
                        live,
                        took,
                        prev,
                        npv,
                        stable,
                        count,
                        m_s,
                        l_s,
                        acc_s,
                        probe,
                        g,
                        tau,
                        phi,
                        patience,
                        GROUP,
                    )
                c += CHUNK
            stopped = stable >= patience
            if SPLIT:
                tl.store(Stopped + b * tl.num_programs(1) + hk, stopped.to(tl.int32))
            m = tl.where(stopped, m_s, m)
            l = tl.where(stopped, l_s, l)
            acc = tl.where(stopped, acc_s, acc)
        else:  # a for loop, which Triton pipelines (loads of the next block overlap this one)
            count = tl.full([], 0, tl.int32)
            for i in range(start, stop):
                m, l, acc, live, took = _read_block(
                    i,
                    nb,
                    limit,
                    base,
                    m,
                    l,
                    acc,
                    q,
                    b,
                    hk,
                    qp,
                    d,
                    dmask,
                    K,
                    V,
                    Mask,
                    KvPos,
                    Table,
                    Map,
                    scale,
                    qk_scale,
                    softcap,
                    window,
                    sk_0,
                    sk_h,
                    sk_l,
                    sv_0,
                    sv_h,
                    sv_l,
                    sm_b,
                    sm_l,
                    sp_0,
                    sp_h,
                    sp_l,
                    st_b,
                    smap_b,
                    smap_h,
                    BLOCK,
                    PAGE,
                    ORDER,
                    HAS_MASK,
                    HAS_POS,
                    SOFTCAP,
                    UPCAST,
                )
                count += took

        heads64 = heads.to(tl.int64)
        tl.store(Visited + (b * tl.num_programs(1) + hk) * n_parts + part0 + sp, count)
        if SPLIT:
            part = (b * tl.num_programs(1) * GROUP + heads64) * n_parts + part0 + sp
            tl.store(PartAcc + part[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
            tl.store(PartM + part, m, mask=gmask)
            tl.store(PartL + part, l, mask=gmask)
        else:
            out = acc * tl.where(l > 0, 1.0 / l, 0.0)[:, None]
            row = (b * tl.num_programs(1) * GROUP + heads64) * D
            tl.store(
                Out + row[:, None] + d[None, :], out.to(Out.dtype.element_ty), mask=gmask[:, None] & dmask[None, :]
            )

    @triton.jit
    def _scan_part(PartAcc, PartM, PartL, Visited, rows, vrow, i, steps, gmask, gd, d, D: tl.constexpr):
        """Horizon step ``i``'s part (nothing past ``steps``)."""
        there = i < steps
        # per head, not a scalar: Triton 3.9's interpreter gives `vector & scalar` int32 data, which a load refuses
        live = gmask & ((rows * 0 + i) < steps)
        ms = tl.load(PartM + rows + i, mask=live, other=float("-inf"))
        ls = tl.load(PartL + rows + i, mask=live, other=0.0)
        a = tl.load(PartAcc + (rows + i)[:, None] * D + d[None, :], mask=gd & live[:, None], other=0.0)
        took = tl.load(Visited + vrow + i, mask=there, other=0)
        return ms, ls, a, took

    @triton.jit(do_not_specialize=["patience", "steps", "n_parts"])
    def _kvpass_art_scan(
        PartAcc,
        PartM,
        PartL,
        Visited,
        Stopped,
        tau,
        phi,
        patience,
        steps,
        n_parts,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        PROBE_STRIDE: tl.constexpr,
        S_PAD: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        """The parallel horizon's stop rule: parts ``0 .. steps-1`` (``steps <= S_PAD``) hold one step's
        block each (read in parallel); merge them in step order with the serial kernel's rule and write the
        state it keeps to part ``steps``, whether it stopped to ``Stopped``, and the blocks it counts to
        ``Visited``. With ``PREFETCH`` the next step's part is loaded before this step's merge, so the
        walk does not wait on one global load per step."""
        b = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        nh = tl.num_programs(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gmask = g < GROUP
        gd = gmask[:, None] & (d < D)[None, :]
        rows = (b * nh * GROUP + (hk * GROUP + g).to(tl.int64)) * n_parts  # [G_PAD] first part of each head
        vrow = (b * nh + hk) * n_parts
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        prev = tl.zeros([G_PAD, D_PAD], tl.float32)
        npv = tl.zeros([G_PAD], tl.float32)
        probe = (d % PROBE_STRIDE == 0) & (d < D)
        stable = tl.full([], 0, tl.int32)
        count = tl.full([], 0, tl.int32)
        m_s, l_s, acc_s = m, l, acc
        nm, nl, na, nt = _scan_part(PartAcc, PartM, PartL, Visited, rows, vrow, 0, steps, gmask, gd, d, D)
        for i in range(0, steps):
            if PREFETCH:
                ms, ls, a, took = nm, nl, na, nt
                nm, nl, na, nt = _scan_part(PartAcc, PartM, PartL, Visited, rows, vrow, i + 1, steps, gmask, gd, d, D)
            else:
                ms, ls, a, took = _scan_part(PartAcc, PartM, PartL, Visited, rows, vrow, i, steps, gmask, gd, d, D)
            live = tl.max(ms, 0) > float("-inf")  # a block with nothing visible changes nothing
            m, l, acc = _merge(m, l, acc, ms, ls, a)
            prev, npv, stable, count, m_s, l_s, acc_s = _art_watch(
                i > 0,
                m,
                l,
                acc,
                live,
                took,
                prev,
                npv,
                stable,
                count,
                m_s,
                l_s,
                acc_s,
                probe,
                g,
                tau,
                phi,
                patience,
                GROUP,
            )
        s = tl.arange(0, S_PAD)
        tl.store(Visited + vrow + s, tl.zeros([S_PAD], tl.int32), mask=s < steps)  # counted in part `steps`
        stopped = stable >= patience
        tl.store(Stopped + b * nh + hk, stopped.to(tl.int32))
        tl.store(PartM + rows + steps, tl.where(stopped, m_s, m), mask=gmask)
        tl.store(PartL + rows + steps, tl.where(stopped, l_s, l), mask=gmask)
        tl.store(PartAcc + (rows + steps)[:, None] * D + d[None, :], tl.where(stopped, acc_s, acc), mask=gd)
        tl.store(Visited + vrow + steps, count)

    @triton.jit(do_not_specialize=["n_parts", "first"])
    def _kvpass_decode_combine(
        PartAcc,
        PartM,
        PartL,
        Out,
        Visited,
        VisitedOut,
        n_parts,
        first,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        P_BLOCK: tl.constexpr,
    ):
        """Merge parts ``first .. n_parts-1`` of each query head and normalise, ``P_BLOCK`` parts per load: one
        program per query head walked its parts one at a time, a chain of dependent loads that took 24 us a
        layer at a tensor-parallel rank's 132 splits (H200, 2026-11-28), a quarter of its decode kernel's time.
        The first query head of each KV group also sums the group's block counts over every part into
        ``VisitedOut [B, H_kv]`` (a reduction kernel of its own otherwise, each layer of each step)."""
        row = tl.program_id(0).to(tl.int64)  # b * H + h
        d = tl.arange(0, D_PAD)
        dmask = d < D
        p = tl.arange(0, P_BLOCK)
        if row % GROUP == 0:
            kv = row // GROUP  # b * H_kv + h // GROUP
            seen = tl.zeros([P_BLOCK], tl.int32)
            for s0 in range(0, n_parts, P_BLOCK):
                seen += tl.load(Visited + kv * n_parts + s0 + p, mask=s0 + p < n_parts, other=0)
            tl.store(VisitedOut + kv, tl.sum(seen, 0))
        m = tl.full([1], float("-inf"), tl.float32)
        l = tl.zeros([1], tl.float32)
        acc = tl.zeros([1, D_PAD], tl.float32)
        for s0 in range(first, n_parts, P_BLOCK):
            s = s0 + p
            pmask = s < n_parts
            ms = tl.load(PartM + row * n_parts + s, mask=pmask, other=float("-inf"))
            ls = tl.load(PartL + row * n_parts + s, mask=pmask, other=0.0)
            a = tl.load(
                PartAcc + (row * n_parts + s)[:, None] * D + d[None, :], mask=pmask[:, None] & dmask[None, :], other=0.0
            )
            top = tl.max(ms, 0)
            w = tl.exp2(ms - tl.where(top == float("-inf"), 0.0, top))  # empty parts (-inf) weigh 0
            one = tl.zeros([1], tl.float32)
            m, l, acc = _merge(m, l, acc, top + one, tl.sum(ls * w, 0) + one, tl.sum(a * w[:, None], 0)[None, :])
        out = acc * tl.where(l > 0, 1.0 / l, 0.0)[:, None]
        tl.store(Out + row * D + d[None, :], out.to(Out.dtype.element_ty), mask=dmask[None, :])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= ``n`` and >= ``lo`` (Triton block and padding sizes); the kvpass
    kernels all size their ``*_PAD`` extents with it."""
    return max(lo, 1 << (max(int(n), 1) - 1).bit_length())


def _cdiv(a, b):
    return (a + b - 1) // b


def _sms(device) -> int:
    """Streaming multiprocessors of ``device`` (2 off CUDA and in the interpreter, so that tiny test
    shapes take the parallel launch shapes)."""
    if device.type != "cuda" or interpreting():
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_SPLITS = 256
COMBINE_BLOCK = 64  # parts the combine merges per load (64 x head dim fp32 per program)
PROGRAMS_PER_SM = 1  # split-KV programs a launch aims at per SM
# a ragged row's splits per head slot: at least RAGGED_MIN_HEAD_SPLITS (times RAGGED_SPLIT_SCALE, 1; the kernel
# benchmark sweeps both). 1: num_splits's count as it is. A floor of 4 cuts a long skewed head finer at batch 16
# (32k per head: 1.05x the uniform layout's time against 1.22x) but costs budget-sized heads 1.56-1.84x at 2k per
# head, batches 8-55, against 1.08-1.31x; a floor of 2 sits between (bench/results/gpu_h100_2026-12-07/ragged).
# The count may not follow the length (num_splits says why), so the common case, heads of a budget, decides.
RAGGED_MIN_HEAD_SPLITS = 1
RAGGED_SPLIT_SCALE = 1


def _split_slots(device) -> int:
    """Split-KV programs that fill ``device``: ``PROGRAMS_PER_SM`` per SM on a GPU; 8 off CUDA and in the
    interpreter, so that tiny test shapes are still cut into several splits."""
    if device.type != "cuda" or interpreting():
        return 8
    return PROGRAMS_PER_SM * _sms(device)


def num_splits(programs, device) -> int:
    """How many KV splits fill the GPU in one wave: as many as fit ``programs`` into ``_split_slots`` (about one
    program per SM), rounded down, at least 1 and at most ``MAX_SPLITS``.

    Few (sequence, KV head) programs take many splits: a tensor-parallel rank's share of an 8-KV-head layer at
    batch 1 is 4 programs, 33 splits on an H200's 132 SMs. One program per SM with long runs beat four with
    short ones (the kernel alone on an H200, batch 1, ``bench/results/tp_h200x2_2026-11-28``): 16 query / 4 KV
    heads read 3.97 TB/s at 128k in 32 splits against 3.45 in 132, and 2.82 against 2.04 at 32k. Rounding up
    instead left a second wave of a few programs, each as long as the first's: 32 / 8 heads at 128k in 17
    splits (136 programs) read 3.00 TB/s, against 4.09 in 32; batch 4 in 5 or 9 splits read 2.7-3.1 TB/s
    against SDPA's 4.0-4.5. The cap only bounds the partial buffers (``MAX_SPLITS`` x query heads x head
    dim, fp32). The count does not follow the cache's length: a min/max of the symbolic length let Inductor
    specialize the graph to a range of lengths, a guard that its on-disk cache brought back in the next
    process (a second decode graph outside it)."""
    return max(1, min(_split_slots(device) // programs, MAX_SPLITS))


def decode_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    kv_pos: Tensor | None = None,
    q_pos: Tensor | None = None,
    page_table: Tensor | None = None,
    kv_len: Tensor | None = None,
    block_map: Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int = 0,
    tau: float = 0.0,
    phi: float = 0.0,
    patience: int = 5,
    block: int = 128,
    order: int = ORDER_RECENCY,
    probe: int = 0,
    horizon: int = 0,
    split: bool | None = None,
    parallel_horizon: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    chunk: int = 8,
    launch=None,
    kv_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the Triton kernels; arguments as ``decode_attention_reference``.

    Three shapes of launch:

    * ART off, split-KV (``split`` None with a small batch, or True): the steps are cut into
      ranges read in parallel, and ``_kvpass_decode_combine`` merges the partial softmax states;
    * ART off, unsplit, or ART with ``horizon = 0``: one program per (sequence, KV head) reads its
      steps in order (ART's stop rule on the way);
    * ART with a ``horizon``: the stop rule runs over the first ``horizon`` steps; where it has not
      stopped, the remaining steps are read in parallel ranges (split-KV) and everything is merged.
      The horizon is read serially, one program per (sequence, KV head), stopping where the rule
      fires; or, when those programs cannot fill the GPU (``parallel_horizon``, by default when
      ``B x H_kv`` is below the SM count: batch 1 is 8 programs on 132 SMs), one program per
      horizon step reads its block, and ``_kvpass_art_scan`` merges them in step order with the same
      rule. The parallel horizon loads every horizon block even where the rule stops early (at most
      ``horizon x block`` entries; ``visited`` counts the blocks in the output, as the serial read);
      the serial one cost 41 us per layer and step over ``full``'s read at 128k (8 programs walking
      16 blocks; H100, 2026-11-25).

    ``launch`` wraps each kernel before its launch (``torch.library.wrap_triton`` inside a
    ``triton_op``; identity when called directly).
    """
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass decode attention needs Triton")
    wrap = launch or (lambda fn: fn)
    b, h, lq, d = q.shape
    if lq != 1:
        raise ValueError(f"decode attention takes one query token per sequence, got {lq}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if q_pos is not None:  # one position per sequence, read as q_pos[b]
        q_pos = q_pos.reshape(b).contiguous()
    if kv_start is not None:  # ragged heads: the shared pool seen once per head (stride 0), each from its start
        check_ragged(k, kv_start, kv_len, page_table)
        hkv = kv_start.shape[1]
        k, v = k.expand(b, hkv, *k.shape[2:]), v.expand(b, hkv, *v.shape[2:])
        kv_pos = None if kv_pos is None else kv_pos.expand(b, hkv, kv_pos.shape[-1])
        kv_start, kv_len = kv_start.contiguous(), kv_len.contiguous()
    hkv = k.shape[1]
    dv = v.shape[-1]
    if dv != d:
        raise ValueError(f"decode attention needs equal q/k and v head sizes, got {d} and {dv}")
    page = int(k.shape[2]) if page_table is not None else 0
    length = page_table.shape[1] * page if page_table is not None else k.shape[2]
    n_blocks = _cdiv(length, block)
    if block_map is not None:  # only the map's steps are read (a selection may list fewer than all blocks)
        n_blocks = torch.sym_min(n_blocks, block_map.shape[-1])
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    art = tau > 0 and phi > 0
    if split and art and not horizon:
        raise ValueError(
            "split-KV cannot run ART termination without a horizon "
            "(a split cannot see whether the blocks before it converged)"
        )
    if split is None:
        split = not art or horizon > 0
    after_art = bool(split and art)  # the horizon launch shape
    rest = torch.sym_max(n_blocks - horizon, 1) if after_art else n_blocks
    n_splits = num_splits(b * hkv, q.device) if split else 1
    if split and kv_start is not None and not after_art:
        # ragged heads: H_kv times the splits, each a fixed share of the row's pool, so a head takes splits in
        # proportion to its length and a long head does not hold up the step (docs/ARCHITECTURE.md, per-head
        # budgets); most of a short head's splits are empty
        n_splits = min(MAX_SPLITS, max(n_splits, RAGGED_MIN_HEAD_SPLITS) * hkv * RAGGED_SPLIT_SCALE)
        per_split = _cdiv(rest, n_splits)
    else:
        # a short cache leaves the last splits empty (they store an empty state); with lengths, each head (or row)
        # splits its own blocks
        per_split = 0 if kv_len is not None else _cdiv(rest, n_splits)
    if parallel_horizon is None:
        parallel_horizon = b * hkv < _sms(q.device)
    # parts: [horizon steps, one each, when parallel] + [the horizon's kept state] + [the rest's splits];
    # the combine starts at the kept state (part h_steps)
    h_steps = torch.sym_min(horizon, n_blocks) if after_art and parallel_horizon else 0
    n_parts = h_steps + n_splits + 1 if after_art else n_splits

    dummy = q.new_empty(1)
    if mask is not None:
        mask = mask_row(mask)
        mask = mask.expand(b, mask.shape[-1])
    pos = kv_pos if kv_pos is not None else dummy
    if kv_pos is not None and page_table is not None:
        p_strides = (kv_pos.stride(0), 0, kv_pos.stride(1))  # [P, page] shared by heads
    elif kv_pos is not None:
        p_strides = (kv_pos.stride(0), kv_pos.stride(1), kv_pos.stride(2))
    else:
        p_strides = (0, 0, 0)
    out = q.new_empty((b, h, 1, dv))
    # per part, or (one part) the result itself: the kernel writes part p of (b, g) at (b * H_kv + g) * n_parts + p
    visited = torch.empty((b, hkv, n_parts) if split else (b, hkv), dtype=torch.int32, device=q.device)
    if split:
        part_acc = torch.empty((b, h, n_parts, dv), dtype=torch.float32, device=q.device)
        part_m = torch.empty((b, h, n_parts), dtype=torch.float32, device=q.device)
        part_l = torch.empty((b, h, n_parts), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = dummy
    stopped = torch.empty((b, hkv), dtype=torch.int32, device=q.device) if after_art else dummy
    upcast = q.dtype == torch.float32 or interpreting()
    tile = block * d * q.element_size()  # bytes of one K (or V) tile
    if tile > 32 * 1024:  # wide tiles (head_dim 256, fp32): three stages overflow shared memory
        num_stages = min(num_stages, 2 if tile <= 64 * 1024 else 1)
    common = (
        q,
        k,
        v,
        out,
        mask if mask is not None else dummy,
        pos,
        q_pos if q_pos is not None else dummy,
        page_table if page_table is not None else dummy,
        kv_len if kv_len is not None else dummy,
        kv_start if kv_start is not None else dummy,
        block_map if block_map is not None else dummy,
        visited,
        part_acc,
        part_m,
        part_l,
        stopped,
        float(scale),
        float(softcap),
        float(tau),
        float(phi),
        int(window),
        int(patience) if art else 1 << 30,
        length,
        n_blocks,
    )
    strides = (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        mask.stride(0) if mask is not None else 0,
        mask.stride(1) if mask is not None else 0,
        *p_strides,
        page_table.stride(0) if page_table is not None else 0,
        block_map.stride(0) if block_map is not None else 0,
        block_map.stride(1) if block_map is not None else 0,
        kv_len.stride(0) if kv_len is not None else 0,
        kv_len.stride(1) if kv_len is not None and kv_len.dim() == 2 else 0,
    )
    meta = dict(
        GROUP=h // hkv,
        G_PAD=pow2(h // hkv),
        D=d,
        D_PAD=pow2(d),
        BLOCK=block,
        PAGE=page,
        ORDER=ORDER_MAP if block_map is not None else order,
        HAS_MASK=mask is not None,
        HAS_POS=kv_pos is not None,
        HAS_LEN=kv_len is not None,
        HAS_START=kv_start is not None,
        SOFTCAP=softcap > 0,
        PROBE_STRIDE=max(1, d // probe) if probe > 0 else 1,
        UPCAST=upcast,
        CHUNK=chunk,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    kernel = wrap(_kvpass_decode_kernel)
    if after_art and parallel_horizon:  # one block per horizon step, then the stop rule over them in order
        kernel[(b, hkv, h_steps)](*common, 0, 1, 0, n_parts, *strides, ART=False, SPLIT=True, AFTER_ART=False, **meta)
        # the scan's launch settings: the fastest that bench/probes/tune_small_kernels.py found, 7.6 us on an H200
        # (``bench/results/decode_step_h200_2026-11-26_r``)
        wrap(_kvpass_art_scan)[(b, hkv)](
            part_acc,
            part_m,
            part_l,
            visited,
            stopped,
            float(tau),
            float(phi),
            int(patience),
            h_steps,
            n_parts,
            GROUP=h // hkv,
            G_PAD=pow2(h // hkv),
            D=d,
            D_PAD=pow2(d),
            PROBE_STRIDE=meta["PROBE_STRIDE"],
            S_PAD=pow2(horizon, 1),
            PREFETCH=True,
            num_warps=4,
        )
    elif after_art:  # the stop rule over the first `horizon` steps, serially: the part before the rest's
        kernel[(b, hkv, 1)](*common, 0, horizon, 0, n_parts, *strides, ART=True, SPLIT=True, AFTER_ART=False, **meta)
    if after_art:
        kernel[(b, hkv, n_splits)](
            *common, horizon, per_split, h_steps + 1, n_parts, *strides, ART=False, SPLIT=True, AFTER_ART=True, **meta
        )
    else:
        kernel[(b, hkv, n_splits)](
            *common, 0, per_split, 0, n_parts, *strides, ART=art, SPLIT=bool(split), AFTER_ART=False, **meta
        )
    if not split:
        return out, visited
    seen = torch.empty((b, hkv), dtype=torch.int32, device=q.device)
    wrap(_kvpass_decode_combine)[(b * h,)](
        part_acc,
        part_m,
        part_l,
        out,
        visited,
        seen,
        n_parts,
        h_steps,
        GROUP=h // hkv,
        D=dv,
        D_PAD=pow2(dv),
        P_BLOCK=COMBINE_BLOCK,
    )
    return out, seen
