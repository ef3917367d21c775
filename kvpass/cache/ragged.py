"""The per-head layout: a layer's KV heads keep different counts and store only what they keep.

A per-head policy (AdaKV's allocation over a scorer, ``kvpass.policies.prefill.scoring.keep_top_heads``) gives
each KV head of a layer its own number of entries. Padding every head to the largest would store the
largest head's count for every head; instead each row's heads share one pool:

* ``keys`` / ``values`` ``[B, 1, S, D]``: the row's pool, head-major: head 0's entries, its free room, head 1's,
  and so on (each head's entries in position order);
* ``pos`` ``[B, 1, S]`` int32: the true position of each stored entry, -1 for a free slot;
* ``ranges`` ``[B, H_kv, 4]`` int32, per head: ``START`` (where its range begins in the pool), ``LENGTH`` (how many
  entries it holds) and, for a head that keeps a window, ``RECENT`` and ``SINK`` (below).

The decode attention kernel reads head ``g`` of row ``b`` from ``START`` for ``LENGTH`` entries
(``kvpass.kernels.decode_attention``, ``kv_start``), so a head is read as far as it holds, whatever its neighbours
hold. A dense ``[B, H_kv, L, D]`` cache is this layout with every head at ``L`` (``uniform``), and the pool of a layer
that keeps ``H_kv x L`` entries in all can be stored as ``[B, H_kv, L, D]`` (the same bytes, the head dimension no
longer a head): the shape a ``DynamicCache`` and ``transformers`` expect (a layer whose total is not a multiple of
``H_kv`` leaves fewer than ``H_kv`` slots empty at the end). ``pack`` builds the layout, in that stored shape, from a
prefill's kept (head, entry) pairs with ``room`` free slots after each head: 0 for a cache that grows by a copy every
step (as a ``DynamicCache`` does), the decode steps to come for a preallocated one (``kvpass.SlotCache``, whose decode
graph writes in place). ``append`` adds one token per head in place; ``grow`` returns the layout with ``q`` more
entries per head (a copy, as ``torch.cat`` does for a ``DynamicCache``); ``by_head`` views it per head for attention
by position over several queries. A head may keep a window instead of everything (``RECENT``: DuoAttention's streaming
heads): its sinks and its latest entries, a ring of its own slots on a SlotCache. Stored bytes are the kept entries'
plus the room: ``S = sum(counts) + sum(room)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.errors import device_assert

# the columns of a layer's ``ranges [B, H_kv, 4]`` int32: where each head's range starts in the pool, how many
# entries it holds, and for a head that keeps a window (DuoAttention's streaming heads) the recent entries it keeps
# and the position before which its entries are its sinks (0, 0: the head keeps everything it is given)
START, LENGTH, RECENT, SINK = range(4)


class Kept:
    """A per-head selection (``Policy.select``'s answer for the per-head layout): ``sel [B, n]`` flat ``head x N +
    entry`` indices ascending, ``counts [B, H_kv]``; for heads that keep a window from here on, ``recent [B, H_kv]``
    (0: the head keeps everything) with ``sinks`` protected entries, the first real ones (``sink [B, H_kv]``: the
    position before which a head's entries are its sinks)."""

    def __init__(
        self, sel: Tensor, counts: Tensor, recent: Tensor | None = None, sinks: int = 0, sink: Tensor | None = None
    ) -> None:
        self.sel, self.counts = sel, counts
        zero = torch.zeros_like(counts)
        self.recent = zero if recent is None else recent
        self.sinks, self.sink = sinks, zero if sink is None else sink


def everything(b: int, h: int, n: int, device) -> Kept:
    """The selection that keeps every entry of an ``n``-entry prompt (each head all of its own)."""
    sel = torch.arange(h * n, device=device).expand(b, h * n)
    return Kept(sel, torch.full((b, h), n, dtype=torch.long, device=device))


def uniform(b: int, h: int, length: int, device) -> Tensor:
    """The ``ranges`` of a dense ``[B, H_kv, L, D]`` cache read as this layout: each head ``L`` entries."""
    out = torch.zeros(b, h, 4, dtype=torch.int32, device=device)
    out[..., START] = length * torch.arange(h, device=device, dtype=torch.int32)
    out[..., LENGTH] = length
    return out


def pack(k: Tensor, v: Tensor, kv_pos: Tensor, kept: Kept, room: int | Tensor = 0, size: int | None = None):
    """The pool of a prefill's kept pairs, ``S`` slots stored as a cache stores them, ``[B, H_kv, S / H_kv, ...]``
    (tensors of their own, not views: a compiled graph that reads them back guards on a view's base): ``k``/``v``
    ``[B, H_kv, N, D]``, ``kv_pos [B, H_kv, N]``, the selection ``kept``; each head's real entries in position
    order, then its left padding (a head keeps padding only where a row is shorter than what it keeps), then
    ``room`` free slots (an int, or per head ``[B, H_kv]``); ``size`` (default: just what that takes, rounded up to
    a multiple of ``H_kv``) leaves the slots past the last head's room empty. Returns ``(keys, values, pos,
    ranges)``."""
    b, h, n, d = k.shape
    sel, counts = kept.sel, kept.counts.long()

    def flat(t):
        return t.reshape(b, h * n, *t.shape[3:])

    pad = flat(kv_pos).gather(1, sel) < 0
    sel = sel.gather(1, (sel // n * 2 * n + pad * n + sel % n).argsort(dim=1))  # per head: real, then padding
    room = torch.as_tensor(room, device=k.device).long().expand(b, h)
    span = counts + room
    start = span.cumsum(-1) - span  # exclusive: the heads in order
    size = int(span.sum(-1).max()) if size is None else size
    size = -(-size // h) * h
    head = sel // n
    first = counts.cumsum(-1) - counts  # each head's first index in sel
    at = start.gather(1, head) + torch.arange(sel.shape[1], device=sel.device) - first.gather(1, head)
    keys, values = (k.new_zeros(b, h, size // h, d), v.new_zeros(b, h, size // h, d))
    pos = torch.full((b, h, size // h), -1, dtype=torch.int32, device=k.device)
    where = at[..., None].expand(b, at.shape[1], d)
    keys.view(b, size, d).scatter_(1, where, flat(k).gather(1, sel[..., None].expand(-1, -1, d)))
    values.view(b, size, d).scatter_(1, where, flat(v).gather(1, sel[..., None].expand(-1, -1, d)))
    pos.view(b, size).scatter_(1, at, flat(kv_pos).gather(1, sel).to(torch.int32))
    ranges = torch.stack([start, counts, kept.recent.long().expand(b, h), kept.sink.long().expand(b, h)], -1)
    return keys, values, pos, ranges.to(torch.int32)


def _ends(ranges: Tensor, size: int) -> Tensor:
    """``[B, H_kv]``: the first slot past each head's room (the next head's start; the pool's end for the last, and
    for every head of an empty row, whose starts are all 0)."""
    start = ranges[..., START].long()
    nxt = torch.cat([start[:, 1:], torch.full_like(start[:, :1], size)], 1)
    return torch.where(nxt > start, nxt, size)


def append(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    ranges: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    q_pos: Tensor,
    window: int = 0,
) -> None:
    """``q`` tokens per head written in place (``k_new`` / ``v_new`` ``[B, H_kv, q, D]`` at positions ``q_pos
    [B, q]``), one token at a time: a head that keeps everything writes after its range (``LENGTH`` + 1; its room
    must hold it, or a device-side assert fails); a head with a window (``RECENT`` > 0, a range of ``window`` slots,
    its sinks + recent entries) writes into an empty slot of its range, else over its oldest entry that is not a
    sink. The pool may be stored in any shape ``[B, X, C, D]`` with ``X x C = S`` (a SlotCache layer's
    ``[B, H_kv, C, D]``). ``index_put_``, so Inductor writes in place (``kvpass.cache.slots._put`` says why)."""
    b, h = ranges.shape[:2]
    q, cap = k_new.shape[2], keys.shape[2]
    size = keys.shape[1] * cap
    rows = torch.arange(b, device=keys.device)[:, None]
    ring = ranges[..., RECENT] > 0
    end = _ends(ranges, size)
    for j in range(q):
        start, length = ranges[..., START].long(), ranges[..., LENGTH]
        at = start + length.long()
        grows = torch.ones_like(ring)
        if window:  # the heads that keep a window: an empty slot of the range first, else the oldest non-sink
            idx = (start[..., None] + torch.arange(window, device=keys.device)).clamp_max(size - 1)
            held = pos.reshape(b, size).gather(1, idx.reshape(b, -1)).view(b, h, window).long()
            age = torch.where(held < 0, -1, torch.where(held < ranges[..., SINK, None], 1 << 62, held))
            victim = idx.gather(2, age.argmin(-1, keepdim=True))[..., 0]
            at = torch.where(ring, victim, at)
            grows = ~ring | (held.gather(2, age.argmin(-1, keepdim=True))[..., 0] < 0)
        device_assert(
            (ring | (at < end)).all(),
            "kvpass: a head's decode room is full (the per-head cache was "
            "built for fewer new tokens than this generation decodes)",
        )
        part, slot = at // cap, at % cap
        keys.index_put_((rows, part, slot), k_new[:, :, j].to(keys.dtype))
        values.index_put_((rows, part, slot), v_new[:, :, j].to(values.dtype))
        pos.index_put_((rows, part, slot), q_pos[:, j, None].expand(b, h).to(pos.dtype))
        length += grows.to(length.dtype)


def grown(ranges: Tensor, q: int) -> Tensor:
    """The ``ranges`` after ``grow`` adds ``q`` entries to every head of a pool with no room."""
    out = ranges.clone()
    out[..., START] += (q * torch.arange(ranges.shape[1], device=ranges.device)).to(out.dtype)
    out[..., LENGTH] += q
    return out


def grow(keys: Tensor, values: Tensor, pos: Tensor, ranges: Tensor, k_new: Tensor, v_new: Tensor, q_pos: Tensor):
    """The layout with ``q`` more entries per head (``k_new`` / ``v_new`` ``[B, H_kv, q, D]``, at positions ``q_pos
    [B, q]``), a copy of a pool with no room whose heads are in order: head ``g``'s new entries follow its range, so
    every later head moves ``q`` slots on per earlier head (empty slots past the last head move to the end). A head
    with a window then holds its sinks and its ``RECENT`` latest positions; what fell out of the window is emptied
    (position -1: every head of a DynamicCache grows a slot a step, the shape transformers' cache keeps). Returns
    ``(keys, values, pos, ranges)``."""
    b, _, size, d = keys.shape
    h, q = ranges.shape[1], k_new.shape[2]
    start, length = ranges[..., START].long(), ranges[..., LENGTH].long()
    slot = torch.arange(size, device=keys.device).expand(b, size)
    owner = torch.searchsorted(start.contiguous(), slot.contiguous(), right=True) - 1  # each slot's head
    owner = torch.where(slot >= (start + length)[:, -1:], h, owner)  # past the last head: after every new entry
    moved = slot + q * owner  # an entry of head g moves q slots on for each earlier head's new entries
    out = grown(ranges, q)
    tail = (out[..., START] + ranges[..., LENGTH]).long()[..., None] + torch.arange(q, device=keys.device)
    tail = tail.reshape(b, h * q)
    out_k, out_v = keys.new_empty(b, size + h * q, d), values.new_empty(b, size + h * q, d)
    out_p = pos.new_empty(b, size + h * q)
    for dst, old, new in ((out_k, keys[:, 0], k_new), (out_v, values[:, 0], v_new)):
        dst.scatter_(1, moved[..., None].expand(b, size, d), old)
        dst.scatter_(1, tail[..., None].expand(b, h * q, d), new.reshape(b, h * q, d).to(dst.dtype))
    out_p.scatter_(1, moved, pos[:, 0])
    out_p.scatter_(1, tail, q_pos.reshape(b, 1, q).expand(b, h, q).reshape(b, h * q).to(pos.dtype))
    # the windows (no host sync to ask whether there are any): sinks, and the latest RECENT positions
    slot = torch.arange(size + h * q, device=keys.device).expand(b, -1)
    mine = (torch.searchsorted(out[..., START].long().contiguous(), slot.contiguous(), right=True) - 1).clamp(0)
    recent, sink = (out[..., c].long().gather(1, mine) for c in (RECENT, SINK))
    p = out_p.long()
    gone = (recent > 0) & (p >= sink) & (p <= q_pos[:, -1:].long() - recent)
    out_p = torch.where(gone, torch.full_like(out_p, -1), out_p)
    return out_k[:, None], out_v[:, None], out_p[:, None], out


def by_head(keys: Tensor, values: Tensor, pos: Tensor, start: Tensor, length: Tensor):
    """Each head's entries as one ``[B, H_kv, S, ...]`` view per head, positions -1 past its length: what
    attention by position (``kvpass::attention_pos``) reads for several queries at once (a decode step reads the
    pool itself). ``S`` entries per head: a temporary ``H_kv`` times the pool."""
    from kvpass.kernels.decode_attention import ragged_heads

    k, v, p = ragged_heads(keys, values, pos, start, length, None)
    inside = torch.arange(p.shape[-1], device=p.device) < length[..., None]
    return k, v, torch.where(inside, p, torch.full_like(p, -1))


def held(pos: Tensor, ranges: Tensor) -> Tensor:
    """``[B, H_kv]``: the entries each head holds (a true position inside its range of the pool ``pos [B, H_kv,
    N]``), for inspection (``Backend.state``): a row of ``pos`` is a stretch of the pool, not a head."""
    b, h, n = pos.shape
    slot = torch.arange(h * n, device=pos.device)
    start, length = ranges[..., START, None].long(), ranges[..., LENGTH, None].long()
    inside = (slot >= start) & (slot < start + length)  # [B, H_kv, H_kv x N]
    return (inside & (pos.reshape(b, 1, h * n) >= 0)).sum(-1)


# a kvpass.SlotCache layer's state for this layout (``Policy.slot_state``): each head's ``ranges`` row
SLOT_STATE = {"heads": ((4,), torch.int32, 0)}


def slot_fill(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    ranges: Tensor,
    k: Tensor,
    v: Tensor,
    kv_pos: Tensor,
    kept: Kept,
    layer: int = 0,
) -> None:
    """A SlotCache layer (``[B, H_kv, C, D]`` slots, ``ranges [B, H_kv, 4]``) filled with a prefill's kept pairs
    (``pack``): a head with a window gets the slots its sinks and recent entries take, the other heads share out
    what is left as room for their decode steps."""
    b, h, cap = pos.shape
    counts = kept.counts.long()
    ring = kept.recent > 0
    room = torch.where(ring, kept.sinks + kept.recent.long() - counts, 0)
    free = h * cap - counts.sum(-1, keepdim=True) - room.sum(-1, keepdim=True)
    others = (~ring).sum(-1, keepdim=True).clamp_min(1)
    room = torch.where(ring, room, free // others)
    if bool((room < 0).any()):
        raise ValueError(
            f"kvpass SlotCache: layer {layer}'s {h} x {cap} slots do not hold what its heads keep "
            f"({counts.sum(-1).max().item()} entries and their rooms); build the cache with a larger "
            f"max_length"
        )
    kp, vp, pp, got = pack(k, v, kv_pos, kept, room, size=h * cap)
    keys.copy_(kp)
    values.copy_(vp)
    pos.copy_(pp)
    ranges.copy_(got)
