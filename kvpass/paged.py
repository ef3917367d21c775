"""A paged KV store: fixed-size pages in one preallocated pool, addressed through page tables.

Page-granular policies (RaaS page eviction, Quest page selection) build on this store. It keeps
the keys and values of a batch of sequences the way a paged-attention kernel expects them:

* **One pool per K and V**, allocated once: ``k_pool`` / ``v_pool`` of shape
  ``[num_pages, kv_heads, page_size, head_dim]``. The pool never grows; memory comes and goes
  page by page through a free list.
* **A page table per sequence**: the ids of the pages the sequence holds, in token order. A page
  holds ``page_size`` consecutive entries of one sequence, for every KV head at once.
* **Only the last page of a sequence is partly filled.** ``append`` fills the last page and then
  takes new pages from the free list; ``free_page`` can drop any page (the first, a middle one,
  the last), after which the next ``append`` starts a new page.
* **True positions**: ``page_pos[page, slot]`` is the token index of the entry in that slot
  (``-1`` for an empty slot, or for padding when the caller says so). Freeing a page removes
  its tokens and leaves every other position as it was, so eviction never renumbers tokens and
  RoPE positions and causal masks stay exact.
* **Representative keys**: ``page_min`` / ``page_max`` of shape ``[num_pages, kv_heads,
  head_dim]`` are the elementwise min and max over the filled keys of each page, per KV head
  (Quest's upper bound on ``q . k`` for a page). They are updated on every append and reset when
  a page is freed (an empty page has ``min = +inf``, ``max = -inf``).

Everything that decides control flow (page tables, fill counts, free list) lives in Python lists,
so appending and freeing never wait on the device; the tensors hold only data.

    cache = PagedKVCache(num_pages=64, page_size=16, kv_heads=2, head_dim=64, batch=1)
    cache.append(k, v)              # k, v: [1, 2, n, 64]
    cache.free_page(0, 3)           # evict the 4th page of sequence 0
    k, v = cache.gather(0)          # [2, L, 64], the resident entries in token order
    pos = cache.positions(0)        # [L], their true token indices
"""

from __future__ import annotations

import torch
from torch import Tensor


class PoolExhaustedError(RuntimeError):
    """An append needs more pages than the pool has free."""


class PagedKVCache:
    """A fixed pool of KV pages shared by the sequences of one batch.

    Args:
        num_pages: pages in the pool; the pool holds ``num_pages * page_size`` entries in all.
        page_size: entries (tokens) per page.
        kv_heads: KV heads per entry; every page stores all of them.
        head_dim: size of one key or value vector.
        dtype: dtype of the pool (a floating type); appended K/V are cast to it.
        device: where the pool lives.
        batch: number of sequences; ``append`` takes K/V for all of them at once.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 batch: int = 1) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("batch", batch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"PagedKVCache: dtype must be a floating type, got {dtype}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch = batch

        # -- the pool: data, positions and representatives of every page ---------------------------
        pool_shape = (num_pages, kv_heads, page_size, head_dim)
        self.k_pool = torch.zeros(pool_shape, dtype=dtype, device=self.device)
        self.v_pool = torch.zeros(pool_shape, dtype=dtype, device=self.device)
        self.page_pos = torch.full((num_pages, page_size), -1, dtype=torch.long, device=self.device)
        self.page_min = torch.full((num_pages, kv_heads, head_dim), float("inf"), dtype=dtype, device=self.device)
        self.page_max = torch.full((num_pages, kv_heads, head_dim), float("-inf"), dtype=dtype, device=self.device)

        # -- bookkeeping, on the host -----------------------------------------------------------------
        self.page_fill: list[int] = [0] * num_pages            # filled slots of each page
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() -> lowest id first
        self.page_tables: list[list[int]] = [[] for _ in range(batch)]
        self.seen: list[int] = [0] * batch                       # tokens appended per sequence

    # ------------------------------------------------------------------------------------------
    # writing
    # ------------------------------------------------------------------------------------------

    def append(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> None:
        """Append ``n`` new entries to every sequence.

        Args:
            k, v: ``[batch, kv_heads, n, head_dim]``.
            positions: ``[batch, n]`` true token index of each new entry (``-1`` marks padding).
                Defaults to the next ``n`` indices of each sequence, ``seen[b] + arange(n)``.

        Raises:
            PoolExhaustedError: the pool has too few free pages; nothing is written then.
        """
        n = self._check_kv(k, v)
        if positions is None:
            positions = torch.tensor(self.seen, device=self.device)[:, None] + torch.arange(n, device=self.device)
        elif tuple(positions.shape) != (self.batch, n):
            raise ValueError(f"PagedKVCache.append: positions must be [batch={self.batch}, n={n}], "
                             f"got {list(positions.shape)}")
        needed = sum(self._pages_needed(seq, n) for seq in range(self.batch))
        if needed > len(self._free):
            raise PoolExhaustedError(
                f"PagedKVCache: page pool exhausted: appending {n} entries to {self.batch} sequence(s) "
                f"needs {needed} new page(s) of {self.page_size} entries, but only {len(self._free)} of "
                f"{self.num_pages} pages are free. Free pages first (free_page / free_sequence) or "
                f"build the cache with a larger num_pages.")
        k = k.to(device=self.device, dtype=self.dtype)
        v = v.to(device=self.device, dtype=self.dtype)
        positions = positions.to(device=self.device, dtype=torch.long)
        for seq in range(self.batch):
            self._append_one(seq, k[seq], v[seq], positions[seq])
            self.seen[seq] += n

    def _append_one(self, seq: int, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """Write one sequence's new entries ``k``, ``v`` [H_kv, n, D] page by page."""
        done, n = 0, k.shape[1]
        while done < n:
            page = self._page_with_room(seq)
            fill = self.page_fill[page]
            take = min(n - done, self.page_size - fill)
            src, dst = slice(done, done + take), slice(fill, fill + take)
            self.k_pool[page, :, dst] = k[:, src]
            self.v_pool[page, :, dst] = v[:, src]
            self.page_pos[page, dst] = pos[src]
            self.page_min[page] = torch.minimum(self.page_min[page], k[:, src].amin(dim=1))
            self.page_max[page] = torch.maximum(self.page_max[page], k[:, src].amax(dim=1))
            self.page_fill[page] = fill + take
            done += take

    def _page_with_room(self, seq: int) -> int:
        """The last page of ``seq`` if it has a free slot, else a newly allocated page."""
        table = self.page_tables[seq]
        if table and self.page_fill[table[-1]] < self.page_size:
            return table[-1]
        page = self._free.pop()  # append() checked that enough pages are free
        table.append(page)
        return page

    def _pages_needed(self, seq: int, n: int) -> int:
        table = self.page_tables[seq]
        room = self.page_size - self.page_fill[table[-1]] if table else 0
        return -(-max(0, n - room) // self.page_size)  # ceil division

    # ------------------------------------------------------------------------------------------
    # freeing
    # ------------------------------------------------------------------------------------------

    def free_page(self, seq: int, logical_page_index: int) -> int:
        """Drop page ``logical_page_index`` (an index into ``resident_pages(seq)``, negative ones
        count from the end) of sequence ``seq`` and return its id to the pool. The tokens of the
        other pages keep their positions. Returns the freed page id; the next allocation reuses it.
        """
        table = self._table(seq)
        if not -len(table) <= logical_page_index < len(table):
            raise IndexError(f"PagedKVCache.free_page: sequence {seq} holds {len(table)} page(s), "
                             f"no logical page {logical_page_index}")
        page = table.pop(logical_page_index)
        self._release(page)
        return page

    def free_sequence(self, seq: int) -> None:
        """Free every page of ``seq`` and start it afresh (``seen`` back to 0)."""
        table = self._table(seq)
        while table:
            self._release(table.pop())
        self.seen[seq] = 0

    def _release(self, page: int) -> None:
        """Return ``page`` to the free list. Its K/V data is left in place, unreachable until overwritten."""
        self.page_fill[page] = 0
        self.page_pos[page] = -1
        self.page_min[page] = float("inf")
        self.page_max[page] = float("-inf")
        self._free.append(page)

    # ------------------------------------------------------------------------------------------
    # reading
    # ------------------------------------------------------------------------------------------

    def resident_pages(self, seq: int) -> list[int]:
        """Page ids held by ``seq``, in token order (a copy)."""
        return list(self._table(seq))

    def resident_tokens(self, seq: int) -> int:
        """Entries stored for ``seq`` (all its pages are full except possibly the last)."""
        return sum(self.page_fill[p] for p in self._table(seq))

    def gather(self, seq: int) -> tuple[Tensor, Tensor]:
        """Contiguous K and V ``[kv_heads, L, head_dim]`` of the resident entries of ``seq``, in order."""
        return self._gather(self.k_pool, seq), self._gather(self.v_pool, seq)

    def positions(self, seq: int) -> Tensor:
        """True token index ``[L]`` of every entry ``gather(seq)`` returns."""
        pages = self._page_ids(seq)
        return self.page_pos[pages].reshape(-1)[: self.resident_tokens(seq)].contiguous()

    def representatives(self, seq: int) -> tuple[Tensor, Tensor]:
        """``page_min`` and ``page_max`` of the resident pages of ``seq``: ``[P, kv_heads, head_dim]``."""
        pages = self._page_ids(seq)
        return self.page_min[pages], self.page_max[pages]

    def _gather(self, pool: Tensor, seq: int) -> Tensor:
        pages = self._page_ids(seq)
        length = self.resident_tokens(seq)
        slots = len(pages) * self.page_size
        entries = pool[pages].transpose(0, 1).reshape(self.kv_heads, slots, self.head_dim)  # [H, P * S, D]
        return entries[:, :length].contiguous()  # only the last page may be partly filled

    def _page_ids(self, seq: int) -> Tensor:
        return torch.tensor(self._table(seq), dtype=torch.long, device=self.device)

    def _table(self, seq: int) -> list[int]:
        if not 0 <= seq < self.batch:
            raise IndexError(f"PagedKVCache: no sequence {seq}; batch is {self.batch}")
        return self.page_tables[seq]

    def _check_kv(self, k: Tensor, v: Tensor) -> int:
        want = (self.batch, self.kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want:
                raise ValueError(f"PagedKVCache.append: {name} must be [batch={self.batch}, kv_heads="
                                 f"{self.kv_heads}, n, head_dim={self.head_dim}], got {list(t.shape)}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"PagedKVCache.append: k has {k.shape[2]} entries, v has {v.shape[2]}")
        return k.shape[2]

    # ------------------------------------------------------------------------------------------
    # accounting
    # ------------------------------------------------------------------------------------------

    @property
    def allocated_pages(self) -> int:
        """Pages held by some sequence."""
        return self.num_pages - len(self._free)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V data in one page."""
        return 2 * self.kv_heads * self.page_size * self.head_dim * self.k_pool.element_size()

    def bytes_allocated(self) -> int:
        """Bytes of K/V data in allocated pages (positions and representatives not counted)."""
        return self.allocated_pages * self.page_bytes

    def bytes_reserved(self) -> int:
        """Bytes of the K/V pools, allocated or not: the memory the cache holds on its device."""
        return self.num_pages * self.page_bytes

    def __repr__(self) -> str:
        tokens = [self.resident_tokens(s) for s in range(self.batch)]
        return (f"PagedKVCache({self.allocated_pages}/{self.num_pages} pages allocated "
                f"({_size(self.bytes_allocated())} of {_size(self.bytes_reserved())}), "
                f"page_size={self.page_size}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, device={self.device}, batch={self.batch}, "
                f"resident_tokens={tokens}, seen={self.seen})")


def _size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    unit = "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if n < 1024:
            break
        n, unit = n / 1024, bigger
    return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"


__all__ = ["PagedKVCache", "PoolExhaustedError"]
