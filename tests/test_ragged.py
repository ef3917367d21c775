"""Per-head budgets: AdaKV's allocation over a layer's heads and the ragged layout the heads share.

``scoring.keep_top_heads`` against a plain ranking written out pair by pair, and its no-op (a floor of the whole
budget is ``keep_top`` per head); ``kvpass.cache.ragged``'s pool holds exactly each head's kept entries (plus
its room), ``append`` and ``grow`` add one entry per head, and decode attention over the pool
(``kv_start``) is each head's attention over its own entries.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpass.cache import ragged
from kvpass.kernels import decode_attention as K
from kvpass.policies.prefill import scoring

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def layer(b, h, n, window, pad, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    priority = torch.randint(0, 4, (b, h, n), generator=g).float() if ties else torch.rand(b, h, n, generator=g)
    kv_pos = torch.arange(n).expand(b, h, n).clone()
    for r in range(b):
        kv_pos[r, :, : min(pad * r, n - 1)] = -1  # row r: left padding
    valid, forced = scoring.window_layout(kv_pos, window)
    return priority, forced, valid, kv_pos


def plain_allocation(priority, forced, valid, keep, floor):
    """The allocation pair by pair: per head its floor (forced first, then real by priority, then the earlier
    entry),
    then every pair of the layer by (floor or forced, real, priority, lower head x N + entry)."""
    b, h, n = priority.shape
    out = []
    for r in range(b):
        tier = {}
        for g in range(h):
            mine = sorted(
                range(n),
                key=lambda j: (
                    not forced[r, g, j],
                    not valid[r, g, j],
                    -float(priority[r, g, j]) if valid[r, g, j] else 0,
                    j,
                ),
            )
            for j in range(n):
                tier[g * n + j] = 0 if (j in mine[:floor] or forced[r, g, j]) else (1 if valid[r, g, j] else 2)
        pairs = sorted(tier, key=lambda f: (tier[f], -float(priority[r, f // n, f % n]) if tier[f] == 1 else 0, f))
        out.append(sorted(pairs[: h * keep]))
    return out


@SETTINGS
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    n=st.integers(2, 40),
    data=st.data(),
    pad=st.integers(0, 6),
    ties=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_allocation_equals_the_plain_ranking(b, h, n, data, pad, ties, seed):
    window = data.draw(st.integers(0, n - 1))
    keep = data.draw(st.integers(window + 1, n)) if window < n else n
    floor = data.draw(st.integers(1, keep))
    priority, forced, valid, _ = layer(b, h, n, window, pad, seed, ties)
    sel, counts = scoring.keep_top_heads(priority, forced, valid, keep, floor)
    assert sel.tolist() == plain_allocation(priority, forced, valid, keep, floor)
    assert counts.sum(-1).tolist() == [h * keep] * b
    for r in range(b):
        for g in range(h):
            mine = [int(f) % n for f in sel[r] if int(f) // n == g]
            assert len(mine) == counts[r, g]
            assert set(forced[r, g].nonzero().flatten().tolist()) <= set(mine)  # the window is kept
            assert len([j for j in mine if valid[r, g, j]]) >= min(floor, int(valid[r, g].sum()))


@SETTINGS
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    n=st.integers(2, 40),
    data=st.data(),
    pad=st.integers(0, 6),
    seed=st.integers(0, 10_000),
)
def test_a_floor_of_the_whole_budget_is_the_uniform_selection(b, h, n, data, pad, seed):
    """adakv's no-op: every head's floor is the budget, so each head keeps what ``keep_top`` keeps."""
    window = data.draw(st.integers(0, n - 1))
    keep = data.draw(st.integers(window + 1, n))
    priority, forced, valid, _ = layer(b, h, n, window, pad, seed)
    sel, counts = scoring.keep_top_heads(priority, forced, valid, keep, keep)
    uniform = scoring.keep_top(priority, forced, valid, keep)
    assert torch.equal(sel, (uniform + n * torch.arange(h)[:, None]).reshape(b, h * keep))
    assert (counts == keep).all()


def packed(b, h, n, d, keep, floor, room, seed):
    priority, forced, valid, kv_pos = layer(b, h, n, 3, 2, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    sel, counts = scoring.keep_top_heads(priority, forced, valid, keep, floor)
    return k, v, kv_pos, sel, counts, ragged.pack(k, v, kv_pos, ragged.Kept(sel, counts), room)


def held(pool, ranges, r, g):
    s, n = int(ranges[r, g, ragged.START]), int(ranges[r, g, ragged.LENGTH])
    return pool.reshape(pool.shape[0], -1, *pool.shape[3:])[r, s : s + n]


@SETTINGS
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    n=st.integers(5, 40),
    data=st.data(),
    room=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_the_pool_holds_each_heads_kept_entries_and_its_room(b, h, n, data, room, seed):
    keep = data.draw(st.integers(4, n))
    floor = data.draw(st.integers(1, keep))
    k, v, kv_pos, sel, counts, (keys, values, pos, ranges) = packed(b, h, n, 8, keep, floor, room, seed)
    assert keys.shape == (b, h, keep + room, 8)  # stored: the kept entries and the room, no more
    assert all(t._base is None for t in (keys, values, pos))  # tensors of their own (a graph guards on a view's base)
    assert torch.equal(ranges[..., ragged.LENGTH], counts.int())
    for r in range(b):
        for g in range(h):
            mine = sorted((int(f) % n for f in sel[r] if int(f) // n == g), key=lambda j: (kv_pos[r, g, j] < 0, j))
            mine = torch.tensor(mine, dtype=torch.long)  # real entries in order, then the head's left padding
            assert torch.equal(held(keys, ranges, r, g), k[r, g, mine])
            assert torch.equal(held(values, ranges, r, g), v[r, g, mine])
            assert torch.equal(held(pos, ranges, r, g), kv_pos[r, g, mine].int())
            end = int(ranges[r, g, ragged.START] + ranges[r, g, ragged.LENGTH])
            assert (pos.reshape(b, -1)[r, end : end + room] == -1).all()


@SETTINGS
@given(b=st.integers(1, 3), h=st.integers(1, 4), steps=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_append_in_place_and_grow_by_copy_hold_the_same_entries(b, h, steps, seed):
    """A preallocated pool written in place and a pool grown by a copy hold, per head, the kept entries and
    then each step's token; attention over either (``kv_start``) is each head's attention over its own."""
    _, _, _, sel, counts, slot = packed(b, h, 30, 8, 12, 2, steps, seed)
    _, _, _, _, _, grown = packed(b, h, 30, 8, 12, 2, 0, seed)
    grown = (*(t.reshape(b, 1, -1, *t.shape[3:]) for t in grown[:3]), grown[3])  # the flat pool ragged.grow takes
    slot = [t.clone() for t in slot]
    shaped = [t.view(b, h, -1, *t.shape[3:]) for t in slot[:3]]  # stored as a SlotCache layer's [B, H_kv, C, D]
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(b, 2 * h, 1, 8, generator=g)
    for t in range(steps):
        k_new, v_new = torch.randn(b, h, 1, 8, generator=g), torch.randn(b, h, 1, 8, generator=g)
        q_pos = torch.full((b, 1), 30 + t)
        ragged.append(*shaped, slot[3], k_new, v_new, q_pos)
        grown = ragged.grow(*grown, k_new, v_new, q_pos)
    assert grown[0].shape[2] == h * (12 + steps)
    for r in range(b):
        for head in range(h):
            for i in range(3):
                assert torch.equal(held(slot[i], slot[3], r, head), held(grown[i], grown[3], r, head))
    outs = [
        K.decode_attention_reference(
            q,
            keys,
            values,
            kv_pos=pos,
            q_pos=torch.full((b,), 99),
            kv_len=ranges[..., ragged.LENGTH],
            kv_start=ranges[..., ragged.START],
            block=8,
        )[0]
        for keys, values, pos, ranges in ((*(t.reshape(b, 1, -1, *t.shape[3:]) for t in slot[:3]), slot[3]), grown)
    ]
    torch.testing.assert_close(outs[0], outs[1])


def test_a_head_past_its_room_fails_loudly():
    """A SlotCache built for fewer new tokens than a generation decodes: the write past a head's room (into the next
    head's range) fails its assert instead of overwriting the neighbour."""
    _, _, _, _, _, slot = packed(1, 2, 20, 8, 6, 1, 1, 0)
    keys, values, pos, ranges = (t.clone() for t in slot)
    new = torch.zeros(1, 2, 1, 8)
    ragged.append(keys, values, pos, ranges, new, new, torch.tensor([[20]]))  # the room's one slot
    with pytest.raises(RuntimeError, match="decode room is full"):
        ragged.append(keys, values, pos, ranges, new, new, torch.tensor([[21]]))
