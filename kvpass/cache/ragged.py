"""The per-head layout: a layer's KV heads keep different counts and store only what they keep.

A per-head policy (AdaKV's allocation over a scorer, ``kvpass.policies.prefill.scoring.keep_top_heads``) gives
each KV head of a layer its own number of entries. Padding every head to the largest would store the
largest head's count for every head; instead each row's heads share one pool:

* ``keys`` / ``values`` ``[B, 1, S, D]``: the row's pool, head-major: head 0's entries, its free room, head 1's,
  and so on (each head's entries in position order);
* ``pos`` ``[B, 1, S]`` int32: the true position of each stored entry, -1 for a free slot;
* ``start`` / ``length`` ``[B, H_kv]`` int32: where each head's range begins in the pool and how many entries
  it holds.

The decode attention kernel reads head ``g`` of row ``b`` from ``start[b, g]`` for ``length[b, g]`` entries
(``kvpass.kernels.decode_attention``, ``kv_start``), so a head is read as far as it holds, whatever its
neighbours hold. A dense ``[B, H_kv, L, D]`` cache is this layout with every head at ``L`` (``uniform``), and
the pool of a layer that keeps ``H_kv x L`` entries in all can be stored as ``[B, H_kv, L, D]`` (the same bytes,
the head dimension no longer a head): the shape a ``DynamicCache`` and ``transformers`` expect. ``pack`` builds the layout from a prefill's kept (head, entry) pairs with ``room`` free slots
after each head: 0 for a cache that grows by a copy every step (as a ``DynamicCache`` does), the decode steps
to come for a preallocated one (``kvpass.SlotCache``, whose decode graph writes in place). ``append`` adds one
token per head in place; ``grow`` returns the layout with ``q`` more entries per head (a copy, as ``torch.cat``
does for a ``DynamicCache``); ``by_head`` views it per head for attention by position over several queries. Stored bytes are the kept entries' plus the room: ``S = sum(counts) +
H_kv x room``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.errors import device_assert


def pack(k: Tensor, v: Tensor, kv_pos: Tensor, sel: Tensor, counts: Tensor, room: int = 0):
    """The pool of a prefill's kept pairs (flat ``[B, 1, S, ...]``; ``view`` it as a cache stores it): ``k``/``v`` ``[B, H_kv, N, D]``, ``kv_pos [B, H_kv, N]``, ``sel
    [B, n]`` flat ``head x N + entry`` indices ascending (each row keeps ``n`` pairs), ``counts [B, H_kv]``
    per head. Returns ``(keys, values, pos, start, length)`` in the module's layout, ``room`` free slots after
    each head's entries."""
    b, h, n, d = k.shape
    length = counts.to(torch.int32)
    span = counts.long() + room
    start = span.cumsum(-1) - span                                          # exclusive: the heads in order
    size = sel.shape[1] + h * room
    head = sel // n
    first = counts.long().cumsum(-1) - counts.long()                        # each head's first index in sel
    rank = torch.arange(sel.shape[1], device=sel.device) - first.gather(1, head)
    at = start.gather(1, head) + rank                                       # [B, n] slot of each kept pair
    flat = lambda t: t.reshape(b, h * n, *t.shape[3:])
    keys, values = (flat(t).gather(1, sel[..., None].expand(b, sel.shape[1], d)) for t in (k, v))
    pos = flat(kv_pos).gather(1, sel).to(torch.int32)
    if room:
        out_k, out_v = k.new_zeros(b, size, d), v.new_zeros(b, size, d)
        out_p = torch.full((b, size), -1, dtype=torch.int32, device=k.device)
        out_k.scatter_(1, at[..., None].expand(b, at.shape[1], d), keys)
        out_v.scatter_(1, at[..., None].expand(b, at.shape[1], d), values)
        keys, values, pos = out_k, out_v, out_p.scatter_(1, at, pos)
    return keys[:, None], values[:, None], pos[:, None], start.to(torch.int32), length


def append(keys: Tensor, values: Tensor, pos: Tensor, start: Tensor, length: Tensor, k_new: Tensor,
           v_new: Tensor, q_pos: Tensor) -> None:
    """``q`` tokens per head written in place (``k_new`` / ``v_new`` ``[B, H_kv, q, D]`` at positions ``q_pos [B, q]``):
    head ``g``'s into slots ``start + length ..``, then ``length += q``. The pool may be stored in any shape
    ``[B, X, C, D]`` with ``X x C = S`` (a SlotCache layer's ``[B, H_kv, C, D]``); a head's tokens must fit before the
    next head's start (its room; the last head's ends at ``S``), or a device-side assert fails. ``index_put_``, so
    Inductor writes in place (``kvpass.cache.slots._put`` says why)."""
    b, h = start.shape
    q, cap = k_new.shape[2], keys.shape[2]
    size = keys.shape[1] * cap
    at = (start + length).long()[..., None] + torch.arange(q, device=keys.device)        # [B, H_kv, q]
    nxt = torch.cat([start[:, 1:].long(), torch.full_like(start[:, :1], size).long()], 1)
    end = torch.where(nxt > start.long(), nxt, size)      # an empty row (every start 0) writes within the pool
    device_assert((at < end[..., None]).all(), "kvpass: a head's decode room is full (the per-head cache was built "
                                               "for fewer new tokens than this generation decodes)")
    rows = torch.arange(b, device=keys.device)[:, None, None]
    part, slot = at // cap, at % cap
    keys.index_put_((rows, part, slot), k_new.to(keys.dtype))
    values.index_put_((rows, part, slot), v_new.to(values.dtype))
    pos.index_put_((rows, part, slot), q_pos[:, None, :].expand(b, h, q).to(pos.dtype))
    length += q


def grown(start: Tensor, length: Tensor, q: int) -> tuple[Tensor, Tensor]:
    """``(start, length)`` after ``grow`` adds ``q`` entries to every head of a pool with no room."""
    h = start.shape[-1]
    return (start + q * torch.arange(h, device=start.device, dtype=start.dtype)), length + q


def grow(keys: Tensor, values: Tensor, pos: Tensor, start: Tensor, length: Tensor, k_new: Tensor, v_new: Tensor,
         q_pos: Tensor):
    """The layout with ``q`` more entries per head (``k_new`` / ``v_new`` ``[B, H_kv, q, D]``, at positions
    ``q_pos [B, q]``), a copy of a pool with no room whose heads are in order: head ``g``'s new entries follow
    its range, so every later head moves ``q`` slots on per earlier head. Returns ``(keys, values, pos, start,
    length)``."""
    b, _, size, d = keys.shape
    h, q = start.shape[1], k_new.shape[2]
    slot = torch.arange(size, device=keys.device).expand(b, size)
    owner = torch.searchsorted(start.long().contiguous(), slot.contiguous(), right=True) - 1   # each slot's head
    moved = slot + q * owner      # an entry of head g moves q slots on for each earlier head's new entries
    new_start, new_length = grown(start, length, q)
    tail = ((new_start + length).long()[..., None] + torch.arange(q, device=keys.device)).reshape(b, h * q)
    out_k, out_v = keys.new_empty(b, size + h * q, d), values.new_empty(b, size + h * q, d)
    out_p = pos.new_empty(b, size + h * q)
    for out, old, new in ((out_k, keys[:, 0], k_new), (out_v, values[:, 0], v_new)):
        out.scatter_(1, moved[..., None].expand(b, size, d), old)
        out.scatter_(1, tail[..., None].expand(b, h * q, d), new.reshape(b, h * q, d).to(out.dtype))
    out_p.scatter_(1, moved, pos[:, 0])
    out_p.scatter_(1, tail, q_pos.reshape(b, 1, q).expand(b, h, q).reshape(b, h * q).to(pos.dtype))
    return out_k[:, None], out_v[:, None], out_p[:, None], new_start, new_length


def by_head(keys: Tensor, values: Tensor, pos: Tensor, start: Tensor, length: Tensor):
    """Each head's entries as one ``[B, H_kv, S, ...]`` view per head, positions -1 past its length: what
    attention by position (``kvpass::attention_pos``) reads for several queries at once (a decode step reads the
    pool itself). ``S`` entries per head: a temporary ``H_kv`` times the pool."""
    from kvpass.kernels.decode_attention import ragged_heads
    k, v, p = ragged_heads(keys, values, pos, start, length, None)
    inside = torch.arange(p.shape[-1], device=p.device) < length[..., None]
    return k, v, torch.where(inside, p, torch.full_like(p, -1))


def everything(b: int, h: int, n: int, device) -> "Kept":
    """The selection that keeps every entry of an ``n``-entry prompt (each head all of its own)."""
    sel = torch.arange(h * n, device=device).expand(b, h * n)
    return Kept(sel, torch.full((b, h), n, dtype=torch.long, device=device))


# a kvpass.SlotCache layer's state for this layout (``Policy.slot_state``): each head's (start, length)
SLOT_STATE = {"heads": ((2,), torch.int32, 0)}


def slot_fill(keys: Tensor, values: Tensor, pos: Tensor, ranges: Tensor, k: Tensor, v: Tensor, kv_pos: Tensor,
              kept: "Kept") -> None:
    """A SlotCache layer (``[B, H_kv, C, D]`` slots, ``ranges [B, H_kv, 2]``) filled with a prefill's kept pairs:
    the pool of ``pack`` with the slots left over shared out as room, ``C - n`` per head."""
    b, h, cap = pos.shape
    keep = kept.sel.shape[1] // h
    kp, vp, pp, start, length = pack(k, v, kv_pos, kept.sel, kept.counts, room=cap - keep)
    keys.copy_(kp.view(keys.shape))
    values.copy_(vp.view(values.shape))
    pos.copy_(pp.view(pos.shape))
    ranges.copy_(torch.stack([start, length], -1))


def slot_write(keys: Tensor, values: Tensor, pos: Tensor, count: Tensor, ranges: Tensor, k_new: Tensor,
               v_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A decode or append call on a SlotCache layer of this layout, as plain tensor code the rewrite places in the
    graph (no host sync: capturable): each head's new tokens after its range (``append``), the counters advanced.
    Returns ``(q_pos [B, q], start, length)``, the heads' ranges after the write."""
    from kvpass.cache.slots import LIMIT, MAX_LENGTH, SEEN, next_positions
    q = k_new.shape[2]
    q_pos = next_positions(count, q)
    device_assert((count[:, SEEN] + q <= count[:, MAX_LENGTH]).all(), LIMIT)
    length = ranges[..., 1]
    append(keys, values, pos, ranges[..., 0], length, k_new, v_new, q_pos)
    count[:, SEEN:SEEN + 2].add_(q)   # seen and filled
    return q_pos, ranges[..., 0].contiguous(), ranges[..., 1].contiguous()


class Kept:
    """A per-head selection (``Policy.select``'s answer for the per-head layout): ``sel [B, n]`` flat ``head x N +
    entry`` indices ascending and ``counts [B, H_kv]`` (``kvpass.policies.prefill.scoring.keep_top_heads``)."""

    def __init__(self, sel: Tensor, counts: Tensor) -> None:
        self.sel, self.counts = sel, counts


def uniform(b: int, h: int, length: int, device) -> tuple[Tensor, Tensor]:
    """``(start, length)`` of a dense ``[B, H_kv, L, D]`` cache read as this layout: each head ``L`` entries."""
    start = (length * torch.arange(h, device=device, dtype=torch.int32)).expand(b, h).contiguous()
    return start, torch.full((b, h), length, dtype=torch.int32, device=device)
