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
neighbours hold. ``pack`` builds the layout from a prefill's kept (head, entry) pairs with ``room`` free slots
after each head: 0 for a cache that grows by a copy every step (as a ``DynamicCache`` does), the decode steps
to come for a preallocated one (``kvpass.SlotCache``, whose decode graph writes in place). ``append`` adds one
token per head in place; ``grow`` returns the layout with one more entry per head (a copy, as ``torch.cat``
does for a ``DynamicCache``). Stored bytes are the kept entries' plus the room: ``S = sum(counts) +
H_kv x room``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.errors import device_assert


def pack(k: Tensor, v: Tensor, kv_pos: Tensor, sel: Tensor, counts: Tensor, room: int = 0):
    """The pool of a prefill's kept pairs: ``k``/``v`` ``[B, H_kv, N, D]``, ``kv_pos [B, H_kv, N]``, ``sel
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
           v_new: Tensor, q_pos: Tensor, room_end: Tensor) -> None:
    """One decode token per head written in place: head ``g``'s ``k_new[b, g, 0]`` into slot ``start + length``
    (which must be below ``room_end[b, g]``, the head's first slot past its room), ``length`` + 1."""
    b, h = start.shape
    at = (start + length).long()
    device_assert((at < room_end).all(), "kvpass: a head's decode room is full (the per-head cache was built for "
                                         "fewer new tokens than this generation decodes)")
    d = keys.shape[-1]
    keys[:, 0].scatter_(1, at[..., None].expand(b, h, d), k_new[:, :, 0])
    values[:, 0].scatter_(1, at[..., None].expand(b, h, d), v_new[:, :, 0])
    pos[:, 0].scatter_(1, at, q_pos.reshape(b, 1).expand(b, h).to(pos.dtype))
    length += 1


def grow(keys: Tensor, values: Tensor, pos: Tensor, start: Tensor, length: Tensor, k_new: Tensor, v_new: Tensor,
         q_pos: Tensor):
    """The layout with one more entry per head, a copy (a pool with no room, heads in order): head ``g``'s new
    entry follows its range, so every later head moves ``g + 1`` slots on. Returns ``(keys, values, pos,
    start, length)``."""
    b, _, size, d = keys.shape
    h = start.shape[1]
    slot = torch.arange(size, device=keys.device).expand(b, size)
    owner = torch.searchsorted(start.long().contiguous(), slot.contiguous(), right=True) - 1   # each slot's head
    moved = slot + owner          # an entry of head g moves one slot on for each earlier head's new entry
    new_start = start.long() + torch.arange(h, device=keys.device)
    tail = new_start + length.long()                                                          # the new entries' slots
    out_k, out_v = keys.new_empty(b, size + h, d), values.new_empty(b, size + h, d)
    out_p = pos.new_empty(b, size + h)
    for out, old, new in ((out_k, keys[:, 0], k_new[:, :, 0]), (out_v, values[:, 0], v_new[:, :, 0])):
        out.scatter_(1, moved[..., None].expand(b, size, d), old)
        out.scatter_(1, tail[..., None].expand(b, h, d), new)
    out_p.scatter_(1, moved, pos[:, 0])
    out_p.scatter_(1, tail, q_pos.reshape(b, 1).expand(b, h).to(pos.dtype))
    return out_k[:, None], out_v[:, None], out_p[:, None], new_start.to(torch.int32), length + 1
