"""``quest``: query-aware page selection for decode steps (seed paper: Quest), the baseline of RaaS.

Nothing is evicted: the cache keeps every token. The cache is cut into pages of 16 entries
(page ``p`` is entries ``16p .. 16p+15``), and for every page and KV head the policy keeps the
element-wise min and max of the page's keys (``kmin``, ``kmax``). Each decode step ranks the
complete pages by Quest's upper bound on their logits,

    ub[p] = max over the group's query heads of  sum_d max(q_d * kmax[p, d], q_d * kmin[p, d])

(``kvpass::page_bounds`` per query head, then the max over the group) and attends to the top
``max(3, budget/16)`` pages of each KV head plus the current page, the one holding the new token
(its bounds are still growing, and it holds the most recent context). That is ``budget/16 + 1``
pages read per step; a budget at least the cache length reads every page, which is ``full``.

Both caches run the same decisions: ``page_bounds`` (a page's min and max over its entries), ``fold`` (a
decode token into its page's bounds) and ``chosen_pages`` (the ranking and the block map). They differ in
storage: on a DynamicCache the bounds are the layer's bookkeeping, grown by doubling (``extend_bounds``); on
a ``kvpass.SlotCache`` they are layer state the cache allocates (``slot_state``), rebuilt from the slots
after a prefill or an append (``slot_bounds``) and kept by tensor code inside the compiled decode graph
(``slot_fold``, ``slot_pages``). The slots hold the prompt in the append layout (a left-padded row's
padding after its real tokens), so pages are the DynamicCache's pages for an unpadded row.

Choices, and why:

* no extra sink or recent pages: Quest's bound already ranks a page by the largest logit it can
  hold, so attention sinks (large logits) and relevant recent pages are selected when they matter,
  and the budget stays the number of pages Quest itself reads (the current page, always read, is
  the only page outside the top-k, as in the Quest paper's implementation);
* layers 0 and 1 stay dense (``dense_layers``), as in Quest: their attention is spread out and a
  bound cannot rank it; sliding-window layers are left to the model;
* the bounds are stored in the cache's dtype: the min and max of bf16 keys are bf16 values, so
  nothing is rounded, and the metadata costs 2 x 1/16 of the keys' memory;
* GQA: one selection per KV head (the bound is the max over its query heads), because the read
  is per KV head.

Where it runs. On a DynamicCache the prefill goes through the evicting rewrite with a ``compact`` that keeps
everything and computes the prompt's page bounds (left padding excluded); it also starts the layer's state
afresh for a new generation. A decode step keeps the model's own cache update; ``kvpass::page_select``
(before attention) folds the new token into its page's bounds and returns ``chosen_pages`` as the block map
of ``kvpass::decode_attention`` with block 16, which reads only the selected pages. Appends of several tokens
run exact attention and are folded in by the next decode step. The bound update is idempotent (it records
how many entries the bounds cover), so a replayed call changes nothing. Nothing is evicted, so the model's
own positions and cache length stay true.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache.slots import FILLED
from kvpass.errors import device_assert
from kvpass.policies.contract import ConfigError, DecodeRead, Needs, Policy, Refusal, SitePlan, SlotHooks, param

PAGE = 16


def page_bounds(k: Tensor, ok: Tensor, pages: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per page of 16 (``pages`` pages, the last one padded): the element-wise min and max of the entries
    of ``k [B, H_kv, N, D]`` that ``ok [B, H_kv, N]`` marks (+inf / -inf where the page has none), and
    whether the page has one (``[B, H_kv, pages]``)."""
    b, hkv, n, d = k.shape
    pad = pages * PAGE - n
    k = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(b, hkv, pages, PAGE, d)
    ok = torch.nn.functional.pad(ok, (0, pad), value=False).view(b, hkv, pages, PAGE, 1)
    hi = torch.tensor(float("inf"), dtype=k.dtype, device=k.device)
    return torch.where(ok, k, hi).amin(3), torch.where(ok, k, -hi).amax(3), ok.any(3)[..., 0]


def extend_bounds(st: dict, k: Tensor, valid: Tensor | None = None) -> dict:
    """Fold entries ``st["n"] .. L-1`` of ``k [B, H_kv, L, D]`` into the page bounds kept in ``st``.

    ``st`` holds ``n`` (entries covered), ``kmin`` / ``kmax`` ``[B, H_kv, cap, D]`` (cache dtype) and
    ``live [B, H_kv, cap]`` (the page holds a valid entry), with capacity doubling. ``valid [B, H_kv,
    L]`` marks padding (False); entries without it are valid. Only the pages of the new entries are
    touched; covering the same entries again is a no-op. Updates ``st`` in place and returns it."""
    b, hkv, length, d = k.shape
    n = st.get("n", 0)
    if n == length:
        return st
    if n > length or (n > 0 and tuple(st["kmin"].shape[:2]) != (b, hkv)):
        raise RuntimeError(
            f"policy 'quest': page bounds cover {n} entries but the cache holds {length} "
            "(the cache was not filled through this backend)"
        )
    if n > 0 and length == n + 1 and valid is None and n // PAGE < st["kmin"].shape[2]:  # a decode step
        page = torch.full((b, hkv), n // PAGE, dtype=torch.long, device=k.device)
        fold(st["kmin"], st["kmax"], st["live"], page, k[:, :, -1])
        st["n"] = length
        return st
    p0, p1 = n // PAGE, -(-length // PAGE)
    dev = k.device
    ok = (torch.arange(p0 * PAGE, length, device=dev) >= n).expand(b, hkv, -1)
    if valid is not None:
        ok = ok & valid[:, :, p0 * PAGE : length]
    new_min, new_max, new_live = page_bounds(k[:, :, p0 * PAGE : length], ok, p1 - p0)
    cap = st["kmin"].shape[2] if "kmin" in st else 0
    if p1 > cap:  # grow by doubling: the copy is amortised over many pages
        grown = max(p1, 2 * cap, 64)
        for name, fill in (("kmin", 0), ("kmax", 0), ("live", False)):
            shape = (b, hkv, grown) + ((d,) if name != "live" else ())
            buf = torch.full(shape, fill, dtype=k.dtype if name != "live" else torch.bool, device=dev)
            if cap:
                buf[:, :, :cap] = st[name]
            st[name] = buf
    old = st["live"][:, :, p0:p1, None]
    st["kmin"][:, :, p0:p1] = torch.where(
        old, torch.minimum(st["kmin"][:, :, p0:p1], new_min), torch.where(new_live[..., None], new_min, 0)
    )
    st["kmax"][:, :, p0:p1] = torch.where(
        old, torch.maximum(st["kmax"][:, :, p0:p1], new_max), torch.where(new_live[..., None], new_max, 0)
    )
    st["live"][:, :, p0:p1] |= new_live
    st["n"] = length
    return st


def slot_bounds(keys: Tensor, pos: Tensor, count: Tensor, state: list[Tensor], *_) -> None:
    """SlotCache refresh (after a prefill or an append wrote the slots): every page's bounds, empty
    slots excluded, and the entries each row's bounds cover (``count[b, FILLED]``)."""
    kmin, kmax, live, covered = state
    new_min, new_max, new_live = page_bounds(keys, pos >= 0, kmin.shape[2])
    kmin.copy_(torch.where(new_live[..., None], new_min, 0))
    kmax.copy_(torch.where(new_live[..., None], new_max, 0))
    live.copy_(new_live)
    covered.copy_(count[:, FILLED, None].expand_as(covered))


def slot_fold(q: Tensor, keys: Tensor, pos: Tensor, count: Tensor, state: list[Tensor], k_new: Tensor, *_) -> None:
    """SlotCache decode step: fold the token just written (each row's slot ``count[b, FILLED] - 1``) into its
    page's bounds. Bounds that do not cover the slots before it (a cache filled without this backend) fail
    a device-side assert instead of ranking pages wrongly."""
    kmin, kmax, live, covered = state
    device_assert(
        (covered == count[:, FILLED, None] - 1).all(),
        "kvpass quest: the SlotCache's page bounds do not cover its slots (it was filled without this backend)",
    )
    page = ((count[:, FILLED] - 1) // PAGE)[:, None].expand(live.shape[:2])
    fold(kmin, kmax, live, page, k_new[:, :, -1])
    covered.add_(1)


def slot_pages(q: Tensor, pos: Tensor, count: Tensor, state: list[Tensor], top: int) -> Tensor:
    """SlotCache decode step: the block map of the pages read (``chosen_pages``), each row's current page
    the one holding its last slot written."""
    kmin, kmax, live, _ = state
    return chosen_pages(q, kmin, kmax, live, ((count[:, FILLED] - 1) // PAGE)[:, None, None], top)


def fold(kmin: Tensor, kmax: Tensor, live: Tensor, page: Tensor, knew: Tensor) -> None:
    """Fold one new key per row and KV head (``knew [B, H_kv, D]``) into the bounds of its page (``page
    [B, H_kv]``), in place."""
    b, hkv = live.shape[:2]
    rows = torch.arange(b, device=live.device)[:, None]
    heads = torch.arange(hkv, device=live.device)[None, :]
    old = live[rows, heads, page][..., None]
    knew = knew.to(kmin.dtype)
    kmin.index_put_((rows, heads, page), torch.where(old, torch.minimum(kmin[rows, heads, page], knew), knew))
    kmax.index_put_((rows, heads, page), torch.where(old, torch.maximum(kmax[rows, heads, page], knew), knew))
    live.index_put_((rows, heads, page), torch.ones((), dtype=torch.bool, device=live.device))


def chosen_pages(q: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, cur: Tensor | int, top: int) -> Tensor:
    """The block map ``[B, H_kv, top + 1]`` int32 a decode step reads: the ``top`` complete pages (those
    before ``cur``, the current page: an int or ``[B, 1, 1]``) with the highest Quest bound, in order, then
    the current page, -1 padded."""
    b, hkv, pages, _ = kmin.shape
    ok = live & (torch.arange(pages, device=kmin.device) < cur)
    # page_bounds' kernel runs one program per block of 32 pages and reads each block once for the whole group
    # (Inductor's reduction of page_bounds_reference re-reads the bounds once per query head)
    ub = torch.ops.kvpass.page_bounds(q[:, :, -1], kmin, kmax).view(b, hkv, -1, pages).amax(2)
    return with_current(torch.ops.kvpass.top_pages(ub.masked_fill(~ok, float("-inf")), top), cur)


def with_current(chosen: Tensor, cur) -> Tensor:
    """The block map ``[B, H_kv, top + 1]`` int32: ``chosen`` pages (ascending, -1 padded, all before
    ``cur``) with the current page ``cur`` after them."""
    n = (chosen >= 0).sum(-1, keepdim=True)
    col = torch.arange(chosen.shape[-1] + 1, device=chosen.device)
    padded = torch.nn.functional.pad(chosen, (0, 1), value=-1)
    return torch.where(col == n, cur, padded).int().contiguous()


class Quest(Policy):
    name = "quest"
    summary = "query-aware decode attention over the top budget/16 pages by Quest's bound (keeps every page)"
    budget: int = param(
        1024,
        PAGE,
        1 << 24,
        "tokens a decode step reads per layer and KV head (a multiple of "
        "16): the top max(3, budget/16) pages by upper bound, plus the current page",
    )
    dense_layers: int = param(2, 0, 1 << 16, "the first layers that read every page")
    stats: bool = param(False, doc="count pages read (Backend.runtime.blocks_read())")

    def check_config(self) -> None:
        if self.budget % PAGE:
            raise ConfigError(
                f"policy 'quest': parameter 'budget' must be a multiple of {PAGE} in "
                f"[{PAGE}, {1 << 24}], got {self.budget}"
            )

    # on a SlotCache: every token kept (the append layout), the pages' bounds as layer state
    needs = Needs(slot_rule="append")

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        pages = -(-capacity // PAGE)
        return {
            "kmin": ((pages, head_dim), None, 0),
            "kmax": ((pages, head_dim), None, 0),
            "live": ((pages,), torch.bool, False),
            "covered": ((), torch.int64, 0),
        }

    def slot_hooks(self, site) -> SlotHooks | None:
        if site.sliding_window or site.layer < self.dense_layers:
            return None
        return SlotHooks(refresh=slot_bounds, update=slot_fold, select=slot_pages, args=(self.top_pages,), block=PAGE)

    @property
    def top_pages(self) -> int:
        return max(3, self.budget // PAGE)

    @property
    def map_steps(self) -> int:
        """Columns of the block map: the top pages and the current page."""
        return self.top_pages + 1

    def idle_reason(self, sites) -> str | None:
        last = max((s.layer for s in sites if not s.sliding_window), default=-1)
        if sites and last < self.dense_layers:
            return (
                f"policy 'quest': parameter 'dense_layers' = {self.dense_layers} keeps every global layer of "
                f"this {len(sites)}-layer model dense, so no page is ever skipped (quest equals full); pass "
                f"dense_layers < {max(last, 0) + 1}"
            )
        return None

    def plan(self, site) -> SitePlan | Refusal:
        from kvpass.kernels.decode_attention import ORDER_MAP
        from kvpass.policies.contract import decode_read_problem

        if site.sliding_window or site.layer < self.dense_layers:
            return SitePlan(attention=True)
        if site.cache == "slot":  # the slot hooks select the pages
            return SitePlan(attention=True, read=DecodeRead(stats=True) if self.stats else None)
        if site.cache != "dynamic":
            return Refusal(
                f"layer {site.layer}: quest reads the new token at the end of a DynamicCache; "
                f"this graph uses a {site.cache} cache"
            )
        if site.phase == "prefill":  # exact attention; compact keeps everything and computes the bounds
            return SitePlan(attention=True, evict=True)
        if site.phase == "decode" and decode_read_problem(site) is None:
            return SitePlan(attention=True, read=DecodeRead(block=PAGE, order=ORDER_MAP, stats=self.stats, pages=True))
        # appends, shape-dynamic graphs, decode sites the kernel cannot serve: exact attention over the
        # model's own cache; the next page_select folds every entry added since into the bounds
        return SitePlan(attention=True)

    def stored_length(self, site, total):
        return total

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        if site.cache == "slot":  # keeps everything; slot_bounds computes the bounds in the graph
            return None
        fresh = kv_pos.shape[-1] == q_pos.shape[1] or layer_state is None
        st = {} if fresh else layer_state.extra
        return None, extend_bounds(st, k, kv_pos >= 0)

    def page_map(self, site, q: Tensor, k: Tensor, layer_state) -> Tensor:
        """The pages a decode step reads, ``[B, H_kv, top_pages + 1]`` int32 (-1 = none), after folding
        the new token (the last entry of ``k``) into the bounds."""
        if layer_state is None or "n" not in layer_state.extra:
            raise RuntimeError(
                "policy 'quest': a decode step found no page bounds for its cache (the cache "
                "was not filled by a quest prefill with this backend)"
            )
        st = extend_bounds(layer_state.extra, k)
        cur = (k.shape[2] - 1) // PAGE  # the current page: always read
        return chosen_pages(q, *(st[n][:, :, : cur + 1] for n in ("kmin", "kmax", "live")), cur, self.top_pages)
