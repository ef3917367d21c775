"""``raas``: page-timestamp eviction during long decodes (seed paper: RaaS), on a fixed page pool.

Storage. The cache tensors the model stores are the page pool itself: after the prefill each
global layer's K/V become ``[B, H_kv, pages * 16, D]`` with ``pages = prefill pages + budget/16 +
1``, page ``p`` in slots ``16p .. 16p+15``. Prefill pages hold the prompt in order; the rest are
decode pages. Empty slots carry position -1, so ``attention_pos`` never sees them; a decode step
attends to every resident entry exactly. The pool is allocated once, at the prefill: memory is flat
from there on, and every eviction frees a page that the next token's allocation reuses.

Page tables. Per (layer, sequence, KV head): which pages are resident (``live``), each page's
timestamp and allocation step, its element-wise min / max keys, the page the next token goes to
(``cur``) and how many tokens it holds (``fill``). One ``PagePool`` holds them for all of a
generation's global layers, stacked as ``[L * B, H_kv, ...]``; each layer's ``LayerState.extra``
points at the pool and its row (``pool.layer_view(i)`` gives one layer's tables).

A decode step:

* at each layer, before its attention (``write``, through ``kvpass::pool_write``): the new token's
  K/V are written in place into slot ``16 cur + fill`` of the pool, planned after the previous
  step, and a page evicted then leaves now (its slots become empty; the new token takes the first
  one). Attention then reads the pool by position (``kvpass::decode_attention``). The layer's query
  and new key are kept for the update below. No scoring happens here: a few small device ops, and
  no copy of the pool (the first version concatenated the token and compacted the result back,
  two copies and about ten more launches per layer: 31.6 ms per step against quest's 25.8 ms on
  SmolLM2, H200, ``bench/results/raas_quest_h200/batched_1024``).
* after the last global layer, once for all layers (``_update``, compiled by Inductor on CUDA):
  1. fold the new token into its page's min / max keys;
  2. score: ``kvpass::page_scores`` computes Quest's upper bound of every resident page for every
     query head, its softmax share over the resident pages, and stamps ``ts = tokens seen`` on the
     pages whose share exceeds ``alpha`` for some query head of the KV group;
  3. plan the next token: the current page while it has room; otherwise the lowest free decode
     page; when all ``budget/16 + 1`` decode pages are full, the one with the oldest timestamp (ties:
     the earliest allocated) is evicted and becomes the current page. Prefill pages and the current
     partial page are never evicted.

So timestamps and evictions are batched across layers after each step: one stacked
``page_scores`` launch and one fused update per step, where a per-layer update launched about ten
kernels per layer (47.5 ms per step against quest's 29.2 ms on SmolLM2's 30 layers, H200,
``bench/results/raas_quest_h200/per_layer_1024``). The eviction planned after step t uses the
attention of steps up to t; the evicted page's entries leave at step t+1's write, where the new
token takes their place, before step t+1's attention (memory never exceeds the pool). The update
is one pure function of tensors with no branch on device values and no host sync;
``test_compiled_update_equals_eager`` checks the compiled and eager versions agree.

Default ``alpha = 0.02``, chosen by a sweep on the long-decode task (README, ``bench/sweep_raas.py``,
``bench/results/raas_sweep_smollm2_cpu/``: SmolLM2-135M, 512-token prompt, 256 new tokens, budget
64): perplexity of ``full``'s continuation 1.0842 / 1.0834 / 1.0812 / 1.0837 / 1.0835 for alpha
0.005 / 0.01 / 0.02 / 0.05 / 0.1, greedy agreement 0.992 then 0.996. A small alpha stamps almost
every page every step, so timestamps stop ranking pages and eviction becomes oldest-allocated-first;
0.02 was the best value measured (a trend of one token in 256 on one prompt, not significant; the
sweep predates the batched update). Alpha is compared with a softmax share over the resident pages,
so its natural scale is ``1 / resident pages`` (1/37 in the sweep).

On a ``kvpass.SlotCache`` the pool is the layer's slots (``slot_capacity``: the prompt's pages plus the
decode pages) and the page tables are its layer state (``slot_state``); the same rules run per layer
as tensor code inside the compiled graphs (``slot_pool`` after the prefill, ``slot_place`` and
``slot_stamp`` at each step), so the decode step is captured whole (docs/ARCHITECTURE.md, 6b).

Positions stay true: every slot's token index is in ``LayerState.pos`` and RoPE continues from the
tokens seen. Batch > 1 works with per-(sequence, KV head) page tables. Graphs that append several
tokens to a filled cache are not supported (a clear error at compile time).
"""

from __future__ import annotations

import torch

from kvpass.cache.slots import FILLED, SEEN
from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, SlotHooks, param
from kvpass.policies.pages.quest import page_bounds
from kvpass.errors import device_assert

PAGE = 16
_STAMP = -2  # page_scores writes this where a page passes alpha; replaced by the token count on the device
STATE = ("fill", "cur", "live", "ts", "born", "kmin", "kmax", "evicted", "next")


class RaaS(Policy):
    name = "raas"
    summary = "decode-time page eviction by attention timestamps, constant memory (page pool of budget/16 + 1)"
    needs = Needs(evicts=True, slot_rule="placed")
    budget: int = param(1024, PAGE, 1 << 24, "decode tokens kept per layer and KV head (a multiple of 16), "
                        "besides the prompt and the current page")
    alpha: float = param(0.02, 0.0, 1.0, "softmax share above which a page's timestamp is refreshed")

    def check_config(self) -> None:
        if self.budget % PAGE:
            raise ConfigError(f"policy 'raas': parameter 'budget' must be a multiple of {PAGE} in "
                              f"[{PAGE}, {1 << 24}], got {self.budget}")

    @property
    def decode_pages(self) -> int:
        """Decode pages in the pool: budget/16 full pages plus the current partial page."""
        return self.budget // PAGE + 1

    # on a kvpass.SlotCache: the pool is the layer's slots, its page tables are layer state
    def slot_capacity(self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1) -> int:
        # pages of any prompt P <= max_length - new plus its decode pages (at most budget/16 + 1, at most what
        # the new tokens fill); over every split of max_length that is never more than max_length/16 + 2
        whole = -(-max_length // PAGE) + 2
        if max_new_tokens >= max_length:
            return whole * PAGE
        return min(whole, -(-(max_length - max_new_tokens) // PAGE) + self.decode_pages) * PAGE

    def slot_state(self, capacity: int, head_dim: int) -> dict:
        pages = capacity // PAGE
        return {"kmin": ((pages, head_dim), None, 0), "kmax": ((pages, head_dim), None, 0),
                "live": ((pages,), torch.bool, False), "ts": ((pages,), torch.int64, 0),
                "born": ((pages,), torch.int64, -1),
                "meta": ((4,), torch.int64, 0),   # current page, its fill, first decode page, page to evict
                "seen": ((), torch.int64, -1)}    # tokens seen when the tables were last updated

    def slot_hooks(self, site) -> SlotHooks | None:
        if site.sliding_window:
            return None
        return SlotHooks(refresh=slot_pool, place=slot_place, update=slot_stamp, args=(self.decode_pages, self.alpha))

    def plan(self, site) -> SitePlan | Refusal:
        if site.sliding_window:
            return SitePlan(attention=True, evict=False)
        if site.cache == "slot" and site.phase in ("prefill", "decode"):
            return SitePlan(attention=True)  # the slot hooks keep the pool (a prefill keeps every token)
        if site.cache not in ("dynamic", "slot"):
            return Refusal(f"layer {site.layer}: raas keeps its page pool in a DynamicCache; "
                           f"this graph uses a {site.cache} cache")
        if site.phase == "decode":
            from kvpass.policies.contract import decode_read_problem
            why = decode_read_problem(site)
            if why is not None:
                return Refusal(f"layer {site.layer}: raas decode steps write into the page pool and read it for "
                               f"one token; {why}")
            return SitePlan(attention=True, pool=True)
        if site.phase != "prefill":
            raise NotImplementedError(
                f"policy 'raas' supports prefill graphs and one-token decode graphs; layer {site.layer} is in a "
                f"'{site.phase}' graph (several tokens appended to a filled cache, e.g. continuing a generation, or a "
                f"dynamic query length); continuing a raas generation is not supported yet: start a new cache")
        return SitePlan(attention=True, evict=True)

    def stored_length(self, site, total):
        return ((total + PAGE - 1) // PAGE + self.decode_pages) * PAGE  # the prefill lays out the pool

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        """The prefill: lay the prompt out as the pool's prefill pages and register the layer."""
        if getattr(site, "cache", None) == "slot":  # the slots keep the prompt in order; slot_pool builds the tables
            return None
        if kv_pos.shape[-1] != q_pos.shape[1]:
            raise RuntimeError("policy 'raas': a decode step reached compact; raas decode steps write into "
                               "the pool (pool_write)")
        pool = getattr(self, "_filling", None)
        if pool is None or (site.layer in pool.layers and site.layer != pool.layers[-1]):
            pool = self._filling = PagePool(self.alpha, self.decode_pages)  # a new generation's prefill
        keep, row = pool.add(site.layer, k, kv_pos, q_pos[0, -1] + 1)
        return keep, {"pool": pool, "row": row}

    def write(self, site, q, k_pool, v_pool, k_new, v_new, q_pos, layer_state):
        extra = layer_state.extra if layer_state is not None else {}
        pool = extra.get("pool")
        if pool is None or pool.slots != k_pool.shape[2]:
            raise RuntimeError("policy 'raas': a decode step found no page table for its cache (the cache "
                               "was not filled by a raas prefill with this backend)")
        return pool.write(extra["row"], q[:, :, -1], k_pool, v_pool, k_new, v_new, q_pos, layer_state.pos)


class PagePool:
    """The page tables of one generation's global layers, stacked ``[L * B, H_kv, ...]`` (layer-major).

    ``add`` registers a layer at the prefill; ``write`` places a layer's new token at a decode step
    and, after the last layer of the step, runs the batched update."""

    def __init__(self, alpha: float, decode_pages: int) -> None:
        self.alpha, self.decode_pages = alpha, decode_pages
        self.layers: list[int] = []       # graph-order layer ids, one row block each
        self.first: list[dict] = []       # each layer's tables after the prefill, stacked at the first step
        self.state: dict | None = None    # STATE name -> stacked tensor
        self.base: dict | None = None     # the state before the last update (a replayed step starts there)
        self.seen = None                  # tokens seen when the last update ran (0-d tensor)
        self.pending: dict[int, tuple] = {}
        self.n_pre = self.slots = 0

    def __repr__(self) -> str:
        return (f"PagePool(layers={len(self.layers)}, prefill_pages={self.n_pre}, "
                f"decode_pages={self.decode_pages}, alpha={self.alpha})")

    # -- prefill ----------------------------------------------------------------------------------
    def add(self, layer: int, k, kv_pos, now):
        b, hkv, n, d = k.shape
        n_pre = -(-n // PAGE)
        pages = n_pre + self.decode_pages
        slots = pages * PAGE
        dev = k.device
        pad = n_pre * PAGE - n
        valid = torch.nn.functional.pad(kv_pos >= 0, (0, pad), value=False).view(b, hkv, n_pre, PAGE, 1)
        kp = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(b, hkv, n_pre, PAGE, d)
        live = torch.zeros(b, hkv, pages, dtype=torch.bool, device=dev)
        live[:, :, :n_pre] = valid.any(3)[..., 0]
        live[:, :, n_pre] = True  # the first decode page, current from the first decode token on
        zeros = torch.zeros(b, hkv, self.decode_pages, d, device=dev)
        kmin = torch.where(valid, kp, float("inf")).amin(3)
        kmax = torch.where(valid, kp, float("-inf")).amax(3)
        kmin = torch.cat([torch.where(live[:, :, :n_pre, None], kmin, 0.0), zeros], 2)
        kmax = torch.cat([torch.where(live[:, :, :n_pre, None], kmax, 0.0), zeros], 2)
        ts = torch.zeros(b, hkv, pages, dtype=torch.long, device=dev)
        ts[:, :, :n_pre + 1] = now
        born = torch.arange(pages, device=dev).expand(b, hkv, pages).clone()
        born[:, :, n_pre:] = -1
        born[:, :, n_pre] = now
        idx = torch.arange(slots, device=dev)
        keep_now = torch.where(idx < n, idx, -1).expand(b, hkv, slots).contiguous()
        nxt = torch.tensor([n_pre * PAGE, -1], device=dev).expand(b, hkv, 2).contiguous()  # slot, evicted page
        first = dict(fill=torch.zeros(b, hkv, dtype=torch.long, device=dev),
                     cur=torch.full((b, hkv), n_pre, device=dev), live=live, ts=ts, born=born, kmin=kmin,
                     kmax=kmax, evicted=torch.full((b, hkv), -1, device=dev), next=nxt)
        if self.layers and self.layers[-1] == layer:  # the same prefill call again: replace it
            self.layers.pop(), self.first.pop()
        self.layers.append(layer)
        self.first.append(first)
        self.state = self.base = self.seen = None
        self.n_pre, self.slots, self.pending = n_pre, slots, {}
        self.page_of = idx // PAGE
        return keep_now, len(self.layers) - 1

    # -- decode -----------------------------------------------------------------------------------
    def write(self, row: int, q, k_pool, v_pool, k_new, v_new, q_pos, pos):
        """Layer ``row``'s decode step: the new token goes into its planned slot of ``k_pool`` / ``v_pool``
        (in place), the page evicted for it (if any) leaves; returns the slots' positions after the
        write (``pos`` before it). After the last layer of the step, the batched update."""
        now = q_pos[0, -1] + 1  # tokens seen, a 0-d device tensor: int() would sync the GPU per layer and step
        if self.state is None:  # the first decode step: stack the layers' prefill tables
            self.state = self.prefill_state()
            self.base, self.seen, self.first = self.state, torch.zeros_like(now) - 1, []
        b, hkv, _, d = k_pool.shape
        rows = slice(row * b, (row + 1) * b)
        # a replay (this step's update already ran: seen == now) uses the plan made before it
        nxt = torch.where(self.seen == now, self.base["next"][rows], self.state["next"][rows])
        slot, evicted = nxt[..., :1], nxt[..., 1:]
        at = slot[..., None].expand(b, hkv, 1, d)
        k_pool.scatter_(2, at, k_new.to(k_pool.dtype))
        v_pool.scatter_(2, at, v_new.to(v_pool.dtype))
        pos = torch.where(self.page_of == evicted, -1, pos).scatter_(2, slot, q_pos[:, None].expand(b, hkv, 1))
        self.pending[row] = (q, k_new)
        if len(self.pending) == len(self.layers):
            qs, ks = zip(*(self.pending[i] for i in range(len(self.layers))))
            step = _compiled_update() if q.is_cuda else _update
            new, old = step(torch.cat(qs), torch.cat(ks), now, self.alpha, self.n_pre, self.seen,
                            [self.state[key] for key in STATE], [self.base[key] for key in STATE])
            self.state, self.base, self.seen, self.pending = dict(zip(STATE, new)), dict(zip(STATE, old)), now, {}
        return pos

    def prefill_state(self) -> dict:
        """Every layer's tables after the prefill, stacked (``STATE`` name -> ``[L * B, H_kv, ...]``)."""
        return {key: torch.cat([f[key] for f in self.first]) for key in STATE}

    def layer_view(self, row: int) -> dict:
        """One layer's page tables (``STATE`` name -> ``[B, H_kv, ...]``), as of the last update."""
        state = self.state if self.state is not None else self.prefill_state()
        b = state["fill"].shape[0] // len(self.layers)
        return {key: t[row * b:(row + 1) * b] for key, t in state.items()}


# -- the batched update: a pure function of tensors, compiled by Inductor on CUDA ------------------

def _update(q, knew, now, alpha: float, n_pre: int, seen, st: list, base: list):
    """One step's page-table update for every layer at once, without a branch on device values.

    ``q [R, H, D]`` are the step's (scaled) queries and ``knew [R, H_kv, 1, D]`` its new keys, one row
    per (layer, sequence); ``now`` the tokens seen (0-d); ``st`` / ``base`` the STATE tensors after and
    before the previous update. A replay of the same step (``seen == now``) starts again from ``base``.
    The token was written at slot ``16 cur + fill``; fold it into its page's bounds, stamp by
    ``kvpass::page_scores``, and plan the next token's page ("room in the current page" and "take a
    page, evicting the oldest full decode page when none is free" are both computed and selected).
    Returns (new STATE, the STATE it started from)."""
    old = [torch.where(seen == now, before, after) for after, before in zip(st, base)]
    fill, cur, live, ts, born, kmin, kmax, _, _ = old
    r, hkv, pages = live.shape
    d = knew.shape[-1]
    dev = knew.device
    knew = knew.float()
    c = cur[..., None]
    cd = c[..., None].expand(r, hkv, 1, d)
    first = (fill == 0)[..., None, None]  # the page's first token sets its bounds
    kmin = kmin.scatter(2, cd, torch.where(first, knew, torch.minimum(kmin.gather(2, cd), knew)))
    kmax = kmax.scatter(2, cd, torch.where(first, knew, torch.maximum(kmax.gather(2, cd), knew)))
    fill = fill + 1
    _, ts = torch.ops.kvpass.page_scores(q, kmin, kmax, live, ts, alpha, _STAMP)
    ts = torch.where(ts == _STAMP, now, ts)  # the operator marks the pages to stamp; `now` stays on the device
    new_page = fill >= PAGE
    dec = torch.arange(pages, device=dev) >= n_pre  # decode pages; prompt pages are never evicted
    free = ~live & dec
    evict = new_page & ~free.any(-1)
    key = torch.where(live & dec, ts * (1 << 32) + born, torch.iinfo(torch.long).max)
    victim = key.argmin(-1)  # the oldest timestamp, then the earliest allocated
    nxt = torch.where(new_page, torch.where(evict, victim, free.long().argmax(-1)), cur)[..., None]
    live = live.scatter(2, nxt, True)
    ts = ts.scatter(2, nxt, torch.where(new_page[..., None], now, ts.gather(2, nxt)))
    born = born.scatter(2, nxt, torch.where(new_page[..., None], now, born.gather(2, nxt)))
    evicted = torch.where(evict, victim, -1)
    fill = torch.where(new_page, 0, fill)
    plan = torch.stack([nxt[..., 0] * PAGE + fill, evicted], -1)  # the next token's slot, the page it evicts
    return [fill, nxt[..., 0], live, ts, born, kmin, kmax, evicted, plan], old


_COMPILED = None


def _compiled_update():
    """``_update`` compiled once per process (shapes dynamic); falls back to eager, with one warning,
    if Inductor cannot build it."""
    global _COMPILED
    if _COMPILED is None:
        compiled = torch.compile(_update, dynamic=True, fullgraph=True)

        def run(*args):
            global _COMPILED
            try:
                return compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compile failure: the eager update is exact
                from kvpass.errors import warn_once

                warn_once(f"kvpass: raas's compiled page update failed ({type(exc).__name__}: {exc}); "
                          "running it eagerly (slower, same result)")
                _COMPILED = _update
                return _update(*args)
        _COMPILED = run
    return _COMPILED


# -- on a SlotCache: the same pool and rules, per layer, as tensor code inside the compiled graphs ---------

def slot_pool(keys, pos, count, state: list, decode_pages: int, alpha: float) -> None:
    """SlotCache refresh after the prefill (the prompt in slots ``0 .. n-1``): the prompt's pages are the
    prefill pages, page ``ceil(n / 16)`` the first decode page and the current one; as ``PagePool.add``."""
    kmin, kmax, live, ts, born, meta, seen = state
    pages = kmin.shape[2]
    n_pre = (count[:, FILLED] + PAGE - 1) // PAGE                   # [B]: each row's prompt pages
    device_assert((n_pre < pages).all(), "kvpass raas: the prompt leaves no decode page in the SlotCache; build "
                                         "it with a larger max_length")
    new_min, new_max, new_live = page_bounds(keys, pos >= 0, pages)
    kmin.copy_(torch.where(new_live[..., None], new_min, 0))
    kmax.copy_(torch.where(new_live[..., None], new_max, 0))
    idx = torch.arange(pages, device=keys.device)
    now, first = count[:, SEEN, None, None], n_pre[:, None, None]
    live.copy_(new_live | (idx == first))
    ts.copy_(torch.where(idx <= first, now, 0).expand_as(ts))
    born.copy_(torch.where(idx < first, idx, torch.where(idx == first, now, -1)).expand_as(born))
    meta.copy_(torch.stack([n_pre, torch.zeros_like(n_pre), n_pre, torch.full_like(n_pre, -1)], -1)[:, None]
               .expand_as(meta))
    seen.copy_(count[:, SEEN, None].expand_as(seen))


def slot_place(pos, count, state: list, decode_pages: int, alpha: float):
    """Before a decode step's write: the page planned for eviction by the last step leaves (its slots are
    emptied) and the token's slot ``16 cur + fill`` is returned ``[B, H_kv, 1]``. Tables that are behind
    the slots (a cache written without this backend) fail a device-side assert."""
    _, _, _, _, _, meta, seen = state
    device_assert((seen == count[:, SEEN, None]).all(), "kvpass raas: the SlotCache's page tables do not match its slots: "
                                            "it was written without this backend, or the sequence is longer "
                                            "than the SlotCache's max_length (no decode page left to evict)")
    b, hkv, _ = pos.shape
    gone = meta[..., 3]
    at = gone.clamp_min(0)[..., None] * PAGE + torch.arange(PAGE, device=pos.device)      # [B, H_kv, 16]
    rows = torch.arange(b, device=pos.device)[:, None, None]
    heads = torch.arange(hkv, device=pos.device)[None, :, None]
    pos.index_put_((rows, heads, at), torch.where(gone[..., None] >= 0, -1, pos.gather(2, at)))
    slot = (meta[..., 0] * PAGE + meta[..., 1])[..., None]
    meta[..., 3] = -1
    return slot


def slot_stamp(q, keys, pos, count, state: list, k_new, decode_pages: int, alpha: float) -> None:
    """After a decode step's write (slot ``16 cur + fill``): fold the token into its page's bounds, stamp
    the decode pages whose softmax share of the bound (over all resident pages) exceeds ``alpha`` for some
    query head of the group, and plan the next token's slot (``_update``'s rules, for one layer), all in
    ``kvpass::raas_stamp`` (``kvpass.policies.pages.kernels.raas_stamp``: two Triton launches per layer on CUDA, where the
    same rules as tensor code took about fifteen). Prompt pages are never evicted, so their timestamps are
    left as the prefill set them; the free / evict / oldest rules run over the decode pages only."""
    torch.ops.kvpass.raas_stamp(q[:, :, -1], k_new[:, :, -1], count, *state, decode_pages, alpha)
