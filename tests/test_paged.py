"""kvpass.paged.PagedKVCache: round trips, page reuse, representative keys, exhaustion, positions.

The property tests drive the cache with random interleavings of appends and page frees and check
it against a plain model: per sequence, a Python list of (position, key, value) entries.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass.paged import PagedKVCache, PoolExhaustedError

PROPERTY = settings(max_examples=40, deadline=None)


def make(num_pages=8, page_size=4, kv_heads=2, head_dim=3, batch=1, dtype=torch.float32):
    return PagedKVCache(num_pages, page_size, kv_heads=kv_heads, head_dim=head_dim, batch=batch, dtype=dtype)


def kv(cache: PagedKVCache, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (cache.batch, cache.kv_heads, n, cache.head_dim)
    return torch.randn(shape, generator=gen).to(cache.dtype), torch.randn(shape, generator=gen).to(cache.dtype)


def check_representatives(cache: PagedKVCache) -> None:
    """Every resident page's min/max bound its filled keys and are attained; free pages are empty."""
    resident = {p for s in range(cache.batch) for p in cache.resident_pages(s)}
    for page in range(cache.num_pages):
        fill = cache.page_fill[page]
        if page not in resident:
            assert fill == 0
            assert cache.page_min[page].eq(float("inf")).all() and cache.page_max[page].eq(float("-inf")).all()
            continue
        keys = cache.k_pool[page, :, :fill]  # [H, fill, D]
        assert fill > 0
        assert (cache.page_min[page][:, None] <= keys).all() and (keys <= cache.page_max[page][:, None]).all()
        assert torch.equal(cache.page_min[page], keys.amin(dim=1))
        assert torch.equal(cache.page_max[page], keys.amax(dim=1))


# ----------------------------------------------------------------------------------------------
# round trip
# ----------------------------------------------------------------------------------------------


@PROPERTY
@given(batch=st.integers(1, 3), page_size=st.sampled_from([1, 3, 4, 16]), kv_heads=st.sampled_from([1, 2]),
       head_dim=st.sampled_from([3, 8]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       chunks=st.lists(st.integers(0, 40), min_size=1, max_size=6))
def test_append_gather_round_trip(batch, page_size, kv_heads, head_dim, dtype, chunks):
    num_pages = batch * sum(-(-c // page_size) + 1 for c in chunks)  # always enough
    cache = make(num_pages, page_size, kv_heads, head_dim, batch, dtype)
    ks, vs = [], []
    for i, n in enumerate(chunks):
        k, v = kv(cache, n, seed=i)
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    total = sum(chunks)
    for seq in range(batch):
        k, v = cache.gather(seq)
        assert k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, k_all[seq]) and torch.equal(v, v_all[seq])
        assert torch.equal(cache.positions(seq), torch.arange(total))
        assert cache.resident_tokens(seq) == total and cache.seen[seq] == total
        assert len(cache.resident_pages(seq)) == -(-total // page_size)
    assert cache.allocated_pages == batch * -(-total // page_size)
    assert cache.bytes_allocated() == cache.allocated_pages * 2 * kv_heads * page_size * head_dim * k_all.element_size()
    check_representatives(cache)


def test_empty_cache_gathers_nothing():
    cache = make(batch=2)
    k, v = cache.gather(1)
    assert k.shape == v.shape == (2, 0, 3) and cache.positions(1).shape == (0,)
    cache.append(*kv(cache, 0))  # appending nothing allocates nothing
    assert cache.allocated_pages == 0 and cache.bytes_allocated() == 0


# ----------------------------------------------------------------------------------------------
# freeing and reuse
# ----------------------------------------------------------------------------------------------


def test_freed_page_is_reused_and_the_pool_never_grows():
    cache = make(num_pages=4, page_size=4)
    pools = [(t.data_ptr(), tuple(t.shape)) for t in (cache.k_pool, cache.v_pool)]
    cache.append(*kv(cache, 12, seed=1))                 # pages 0, 1, 2, all full
    assert cache.resident_pages(0) == [0, 1, 2] and cache.allocated_pages == 3

    assert cache.free_page(0, 1) == 1                    # evict the middle page
    assert cache.allocated_pages == 2 and cache.free_pages == 2
    k_new, v_new = kv(cache, 4, seed=2)
    cache.append(k_new, v_new)                           # needs one new page: the freed one
    assert cache.resident_pages(0) == [0, 2, 1]
    assert cache.allocated_pages == 3
    assert [(t.data_ptr(), tuple(t.shape)) for t in (cache.k_pool, cache.v_pool)] == pools

    k, v = cache.gather(0)
    assert torch.equal(k[:, -4:], k_new[0]) and torch.equal(v[:, -4:], v_new[0])   # old data gone
    assert cache.positions(0).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15]
    check_representatives(cache)                         # page 1's min/max describe its new keys only


def test_free_the_partial_last_page_then_append_starts_a_new_page():
    cache = make(num_pages=4, page_size=4)
    cache.append(*kv(cache, 6))                          # pages 0 (full), 1 (2 of 4)
    assert cache.free_page(0, -1) == 1
    cache.append(*kv(cache, 1, seed=3))
    assert cache.resident_pages(0) == [0, 1] and cache.page_fill[1] == 1
    assert cache.positions(0).tolist() == [0, 1, 2, 3, 6]


def test_free_sequence_returns_all_pages_and_restarts_positions():
    cache = make(num_pages=6, page_size=4, batch=2)
    cache.append(*kv(cache, 9))
    cache.free_sequence(1)
    assert cache.resident_pages(1) == [] and cache.allocated_pages == 3 and cache.seen == [9, 0]
    cache.append(*kv(cache, 1))
    assert cache.positions(0).tolist() == list(range(10)) and cache.positions(1).tolist() == [0]


@PROPERTY
@given(page_size=st.sampled_from([1, 2, 4, 5]), batch=st.integers(1, 2),
       ops=st.lists(st.one_of(st.tuples(st.just("append"), st.integers(0, 12)),
                              st.tuples(st.just("free"), st.integers(0, 1), st.integers(-4, 6))),
                     min_size=1, max_size=25),
       seed=st.integers(0, 2**16))
def test_matches_a_list_model_under_appends_and_frees(page_size, batch, ops, seed):
    """Random appends and frees: contents, positions, page accounting and representatives stay right."""
    num_pages = 12
    cache = make(num_pages, page_size, kv_heads=2, head_dim=4, batch=batch)
    model = [[] for _ in range(batch)]  # per sequence: [(position, key [H, D], value [H, D])]
    for step, op in enumerate(ops):
        if op[0] == "append":
            n = op[1]
            k, v = kv(cache, n, seed=seed + step)
            try:
                cache.append(k, v)
            except PoolExhaustedError:
                assert sum(cache._pages_needed(s, n) for s in range(batch)) > cache.free_pages
                continue
            for s in range(batch):
                start = cache.seen[s] - n
                model[s] += [(start + i, k[s, :, i], v[s, :, i]) for i in range(n)]
        else:
            s, index = op[1] % batch, op[2]
            pages = cache.resident_pages(s)
            if not -len(pages) <= index < len(pages):
                with pytest.raises(IndexError, match="logical page"):
                    cache.free_page(s, index)
                continue
            i = index % len(pages)
            first = i * page_size  # every page but the last is full
            fill = cache.page_fill[pages[i]]
            assert cache.free_page(s, index) == pages[i]
            del model[s][first:first + fill]
        for s in range(batch):
            k, v = cache.gather(s)
            assert cache.positions(s).tolist() == [p for p, _, _ in model[s]]
            if model[s]:
                assert torch.equal(k, torch.stack([e[1] for e in model[s]], dim=1))
                assert torch.equal(v, torch.stack([e[2] for e in model[s]], dim=1))
            pages = cache.resident_pages(s)
            assert all(cache.page_fill[p] == page_size for p in pages[:-1])
        held = [p for s in range(batch) for p in cache.resident_pages(s)]
        assert len(held) == len(set(held)) == cache.allocated_pages == num_pages - cache.free_pages
        check_representatives(cache)


# ----------------------------------------------------------------------------------------------
# representative keys
# ----------------------------------------------------------------------------------------------


@PROPERTY
@given(page_size=st.sampled_from([1, 3, 8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       chunks=st.lists(st.integers(1, 20), min_size=1, max_size=5), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       seed=st.integers(0, 2**16))
def test_representatives_bound_every_key_in_their_page(page_size, dtype, chunks, scale, seed):
    num_pages = 2 * -(-sum(chunks) // page_size)
    cache = make(num_pages, page_size=page_size, kv_heads=2, head_dim=5, batch=2, dtype=dtype)
    for i, n in enumerate(chunks):
        k, v = kv(cache, n, seed=seed + i)
        cache.append((k.float() * scale).to(dtype), v)
        check_representatives(cache)
    lo, hi = cache.representatives(1)
    assert lo.shape == hi.shape == (len(cache.resident_pages(1)), 2, 5)
    if len(cache.resident_pages(1)) > 1:
        cache.free_page(1, 0)
        check_representatives(cache)


# ----------------------------------------------------------------------------------------------
# positions
# ----------------------------------------------------------------------------------------------


def test_positions_survive_freeing_a_middle_page():
    cache = make(num_pages=8, page_size=16, kv_heads=2, head_dim=8)
    k_all, v_all = kv(cache, 40)
    cache.append(k_all, v_all)                           # pages: [0..15] [16..31] [32..39]
    cache.free_page(0, 1)
    kept = list(range(16)) + list(range(32, 40))
    assert cache.positions(0).tolist() == kept
    k, v = cache.gather(0)
    assert torch.equal(k, k_all[0][:, kept]) and torch.equal(v, v_all[0][:, kept])

    cache.append(*kv(cache, 10, seed=1))                 # 8 fill the last page, 2 go to a new one
    assert cache.positions(0).tolist() == kept + list(range(40, 50))
    assert cache.seen == [50] and cache.resident_tokens(0) == 34
    cache.free_page(0, 0)                                # and the first page: nothing renumbered
    assert cache.positions(0).tolist() == list(range(32, 50))


def test_explicit_positions_and_padding():
    cache = make(num_pages=4, page_size=4, batch=2)
    pos = torch.tensor([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4]])   # row 0 is left-padded
    cache.append(*kv(cache, 5), positions=pos)
    assert cache.positions(0).tolist() == [-1, -1, 0, 1, 2]
    assert cache.seen == [5, 5]                           # seen counts entries, padding included
    with pytest.raises(ValueError, match="positions must be"):
        cache.append(*kv(cache, 2), positions=torch.zeros(2, 3, dtype=torch.long))


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def test_exhausting_the_pool_raises_and_writes_nothing():
    cache = make(num_pages=3, page_size=4, batch=2)
    cache.append(*kv(cache, 4))                          # 2 pages, one per sequence
    before = (cache.allocated_pages, [cache.resident_pages(s) for s in range(2)], list(cache.seen),
              cache.k_pool.clone(), cache.page_pos.clone())
    with pytest.raises(PoolExhaustedError, match=r"needs 2 new page\(s\) of 4 entries, but only 1 of 3"):
        cache.append(*kv(cache, 1, seed=5))              # each sequence needs a page; one is free
    after = (cache.allocated_pages, [cache.resident_pages(s) for s in range(2)], list(cache.seen))
    assert after == before[:3]
    assert torch.equal(cache.k_pool, before[3]) and torch.equal(cache.page_pos, before[4])
    assert isinstance(PoolExhaustedError("x"), RuntimeError)

    cache.free_page(1, 0)                                # room again: the same append succeeds
    cache.append(*kv(cache, 1, seed=5))
    assert cache.allocated_pages == 3


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_pages must be a positive int"):
        PagedKVCache(0, kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="floating"):
        PagedKVCache(4, kv_heads=1, head_dim=8, dtype=torch.int32)
    cache = make(batch=2)
    with pytest.raises(ValueError, match=r"k must be \[batch=2, kv_heads=2, n, head_dim=3\]"):
        cache.append(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    with pytest.raises(ValueError, match="k has 2 entries, v has 1"):
        cache.append(torch.zeros(2, 2, 2, 3), torch.zeros(2, 2, 1, 3))
    with pytest.raises(IndexError, match="no sequence 2; batch is 2"):
        cache.gather(2)
    with pytest.raises(IndexError, match="holds 0 page"):
        cache.free_page(0, 0)


def test_repr_and_accounting():
    cache = make(num_pages=8, page_size=16, kv_heads=2, head_dim=64, batch=2, dtype=torch.bfloat16)
    cache.append(*kv(cache, 20))
    page = 2 * 2 * 16 * 64 * 2
    assert cache.page_bytes == page
    assert cache.bytes_allocated() == 4 * page and cache.bytes_reserved() == 8 * page
    text = repr(cache)
    assert text.startswith("PagedKVCache(4/8 pages allocated (32.0 KiB of 64.0 KiB)")
    assert "page_size=16" in text and "resident_tokens=[20, 20]" in text and "bfloat16" in text
