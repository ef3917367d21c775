"""``raas``: page-timestamp eviction during long decodes (seed paper: RaaS), on a fixed page pool.

Storage. Each global layer's cache is a page pool: ``pages = prompt pages + budget/16 + 1``, page ``p`` in slots
``16p .. 16p+15``. Prompt pages hold the prompt in order and are never evicted; the rest are decode pages. Empty
slots carry position -1, so attention never sees them; a decode step attends to every resident entry exactly.
The pool is allocated once, at the prefill: memory is flat from there on, and every eviction frees a page that
the next token's allocation reuses.

Page tables (``slot_state``), per (sequence, KV head): which pages are resident (``live``), each page's
timestamp (``ts``) and allocation step (``born``), its element-wise min / max keys, and ``meta``: the current
page, how many tokens it holds, the first decode page and the page planned for eviction.

A decode step, per layer, is three functions both caches run (on a ``kvpass.SlotCache`` as tensor code inside
the compiled decode graph, on a DynamicCache from ``kvpass::pool_write``, whose pool is the stored K/V):

* ``slot_place``: the page planned for eviction after the previous step leaves (its slots are emptied) and the
  token's slot ``16 cur + fill`` is returned; the cache writes the token there (``write_slots``);
* ``slot_stamp`` (``kvpass::raas_stamp``: two Triton launches on CUDA): fold the token into its page's min /
  max keys; stamp ``ts = tokens seen`` on the decode pages whose softmax share of Quest's upper bound (over the
  resident pages) exceeds ``alpha`` for some query head of the KV group; plan the next token: the current page
  while it has room, else the lowest free decode page, else (every decode page full) the one with the oldest
  timestamp (ties: the earliest allocated), evicted at the next step's write, where the new token takes its
  place before that step's attention (memory never exceeds the pool).

After a prefill ``slot_pool`` lays out the tables from the stored prompt. Positions stay true: every slot's
token index is stored, and RoPE continues from the tokens seen. Batch > 1 works with per-(sequence, KV head)
page tables. Graphs that append several tokens to a filled cache are refused at compile time.

Default ``alpha = 0.02``, chosen by a sweep on the long-decode task (docs/policies/raas.md, ``bench/sweep_raas.py``,
``bench/results/raas_sweep_smollm2_cpu/``: SmolLM2-135M, 512-token prompt, 256 new tokens, budget 64):
perplexity of ``full``'s continuation 1.0842 / 1.0834 / 1.0812 / 1.0837 / 1.0835 for alpha 0.005 / 0.01 /
0.02 / 0.05 / 0.1, greedy agreement 0.992 then 0.996. A small alpha stamps almost every page every step, so
timestamps stop ranking pages and eviction becomes oldest-allocated-first; 0.02 was the best value measured (a
trend of one token in 256 on one prompt, not significant). Alpha is compared with a softmax share over the
resident pages, so its natural scale is ``1 / resident pages`` (1/37 in the sweep).
"""

from __future__ import annotations

import torch

from kvpass.cache.slots import FILLED, PLACED, SEEN, write_slots
from kvpass.errors import device_assert
from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, SlotHooks, param
from kvpass.policies.pages.quest import page_bounds

PAGE = 16
NO_LIMIT = 1 << 62  # a DynamicCache pool's MAX_LENGTH counter: it grows with no max_length


class RaaS(Policy):
    name = "raas"
    summary = "decode-time page eviction by attention timestamps, constant memory (page pool of budget/16 + 1)"
    needs = Needs(evicts=True, slot_rule="placed")
    budget: int = param(
        1024,
        PAGE,
        1 << 24,
        "decode tokens kept per layer and KV head (a multiple of 16), besides the prompt and the current page",
    )
    alpha: float = param(0.02, 0.0, 1.0, "softmax share above which a page's timestamp is refreshed")

    def check_config(self) -> None:
        if self.budget % PAGE:
            raise ConfigError(
                f"policy 'raas': parameter 'budget' must be a multiple of {PAGE} in "
                f"[{PAGE}, {1 << 24}], got {self.budget}"
            )

    @property
    def decode_pages(self) -> int:
        """Decode pages in the pool: budget/16 full pages plus the current partial page."""
        return self.budget // PAGE + 1

    # on a kvpass.SlotCache: the pool is the layer's slots, its page tables are layer state
    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        # pages of any prompt P <= max_length - new plus its decode pages (at most budget/16 + 1, at most what
        # the new tokens fill); over every split of max_length that is never more than max_length/16 + 2
        whole = -(-max_length // PAGE) + 2
        if max_new_tokens >= max_length:
            return whole * PAGE
        return min(whole, -(-(max_length - max_new_tokens) // PAGE) + self.decode_pages) * PAGE

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        pages = capacity // PAGE
        return {
            "kmin": ((pages, head_dim), None, 0),
            "kmax": ((pages, head_dim), None, 0),
            "live": ((pages,), torch.bool, False),
            "ts": ((pages,), torch.int64, 0),
            "born": ((pages,), torch.int64, -1),
            "meta": ((4,), torch.int64, 0),  # current page, its fill, first decode page, page to evict
            "seen": ((), torch.int64, -1),
        }  # tokens seen when the tables were last updated

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
            return Refusal(
                f"layer {site.layer}: raas keeps its page pool in a DynamicCache; this graph uses a {site.cache} cache"
            )
        if site.phase == "decode":
            from kvpass.policies.contract import decode_read_problem

            why = decode_read_problem(site)
            if why is not None:
                return Refusal(
                    f"layer {site.layer}: raas decode steps write into the page pool and read it for one token; {why}"
                )
            return SitePlan(attention=True, pool=True)
        if site.phase != "prefill":
            raise NotImplementedError(
                f"policy 'raas' supports prefill graphs and one-token decode graphs; layer {site.layer} is in a "
                f"'{site.phase}' graph (several tokens appended to a filled cache, e.g. continuing a generation, or a "
                f"dynamic query length); continuing a raas generation is not supported yet: start a new cache"
            )
        return SitePlan(attention=True, evict=True)

    def stored_length(self, site, total):
        return ((total + PAGE - 1) // PAGE + self.decode_pages) * PAGE  # the prefill lays out the pool

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        """The prefill on a DynamicCache: the prompt in the pool's first slots, and as the layer's bookkeeping
        the page tables ``slot_pool`` lays out and the counters ``write_slots`` keeps (as a SlotCache's)."""
        if site.cache == "slot":  # the slots keep the prompt in order; slot_pool builds the tables in the graph
            return None
        b, hkv, n, d = k.shape
        if kv_pos.shape[-1] != q_pos.shape[1]:
            raise RuntimeError(
                "policy 'raas': a decode step reached compact; raas decode steps write into the pool (pool_write)"
            )
        slots = self.stored_length(site, n)
        idx = torch.arange(slots, device=k.device)
        keep = torch.where(idx < n, idx, -1).expand(b, hkv, slots).contiguous()
        count = torch.tensor([n, n, 0, NO_LIMIT, 0], device=k.device).repeat(b, 1)  # SEEN .. MAX_LENGTH, CACHE 0
        tables = [
            torch.full((b, hkv, *shape), fill, dtype=dtype or k.dtype, device=k.device)
            for shape, dtype, fill in self.slot_state(slots, d).values()
        ]
        pad = slots - n
        slot_pool(
            torch.nn.functional.pad(k, (0, 0, 0, pad)),
            torch.nn.functional.pad(kv_pos, (0, pad), value=-1),
            count,
            tables,
            self.decode_pages,
            self.alpha,
        )
        return keep, {"tables": tables, "count": count}

    def write(self, site, q, k_pool, v_pool, k_new, v_new, q_pos, layer_state):
        """A decode step on a DynamicCache: the SlotCache's decode step on the pool (the stored K/V, written in
        place); returns the slots' positions after the write. The tables and counters a step starts from are
        kept, so a replay of the same step (the same tokens seen) starts from them again and writes the same
        slot: no host sync, one copy of the tables per step."""
        extra = layer_state.extra if layer_state is not None else {}
        if "tables" not in extra or layer_state.pos.shape[-1] != k_pool.shape[2]:
            raise RuntimeError(
                "policy 'raas': a decode step found no page table for its cache (the cache "
                "was not filled by a raas prefill with this backend)"
            )
        now = q_pos[:, -1] + 1
        start = [*extra["tables"], extra["count"], layer_state.pos]
        if "last" in extra:  # the step before, and what it started from
            again = (extra["last"][0] == now).all()
            start = [torch.where(again, before, t) for t, before in zip(start, extra["last"][1])]
        *tables, count, pos = (t.clone() for t in start)
        slot = slot_place(pos, count, tables, self.decode_pages, self.alpha)
        write_slots(k_pool, v_pool, pos, count, k_new, v_new, PLACED, 0, slot)
        slot_stamp(q, k_pool, pos, count, tables, k_new, self.decode_pages, self.alpha)
        extra.update(tables=tables, count=count, last=(now, start))
        return pos


# -- the decode step, per layer: tensor code both caches run ----------------------------------------------


def slot_pool(keys, pos, count, state: list, decode_pages: int, alpha: float) -> None:
    """The page tables after a prefill (the prompt in slots ``0 .. n-1``; a SlotCache's refresh, a DynamicCache's
    ``select``): the prompt's pages are the prefill pages, page ``ceil(n / 16)`` the first decode page and the
    current one."""
    kmin, kmax, live, ts, born, meta, seen = state
    pages = kmin.shape[2]
    n_pre = (count[:, FILLED] + PAGE - 1) // PAGE  # [B]: each row's prompt pages
    device_assert(
        (n_pre < pages).all(),
        "kvpass raas: the prompt leaves no decode page in the SlotCache; build it with a larger max_length",
    )
    new_min, new_max, new_live = page_bounds(keys, pos >= 0, pages)
    kmin.copy_(torch.where(new_live[..., None], new_min, 0))
    kmax.copy_(torch.where(new_live[..., None], new_max, 0))
    idx = torch.arange(pages, device=keys.device)
    now, first = count[:, SEEN, None, None], n_pre[:, None, None]
    live.copy_(new_live | (idx == first))
    ts.copy_(torch.where(idx <= first, now, 0).expand_as(ts))
    born.copy_(torch.where(idx < first, idx, torch.where(idx == first, now, -1)).expand_as(born))
    meta.copy_(
        torch.stack([n_pre, torch.zeros_like(n_pre), n_pre, torch.full_like(n_pre, -1)], -1)[:, None].expand_as(meta)
    )
    seen.copy_(count[:, SEEN, None].expand_as(seen))


def slot_place(pos, count, state: list, decode_pages: int, alpha: float):
    """Before a decode step's write: the page planned for eviction by the last step leaves (its slots are
    emptied) and the token's slot ``16 cur + fill`` is returned ``[B, H_kv, 1]``. Tables that are behind
    the slots (a cache written without this backend) fail a device-side assert."""
    _, _, _, _, _, meta, seen = state
    device_assert(
        (seen == count[:, SEEN, None]).all(),
        "kvpass raas: the cache's page tables do not match its "
        "slots: it was written without this backend, or the sequence "
        "is longer than the SlotCache's max_length (no decode page "
        "left to evict)",
    )
    b, hkv, _ = pos.shape
    gone = meta[..., 3]
    at = gone.clamp_min(0)[..., None] * PAGE + torch.arange(PAGE, device=pos.device)  # [B, H_kv, 16]
    rows = torch.arange(b, device=pos.device)[:, None, None]
    heads = torch.arange(hkv, device=pos.device)[None, :, None]
    pos.index_put_((rows, heads, at), torch.where(gone[..., None] >= 0, -1, pos.gather(2, at)))
    slot = (meta[..., 0] * PAGE + meta[..., 1])[..., None]
    meta[..., 3] = -1
    return slot


def slot_stamp(q, keys, pos, count, state: list, k_new, decode_pages: int, alpha: float) -> None:
    """After a decode step's write (slot ``16 cur + fill``): fold the token into its page's bounds, stamp
    the decode pages whose softmax share of the bound (over all resident pages) exceeds ``alpha`` for some
    query head of the group, and plan the next token's slot (the module docstring's rules), all in
    ``kvpass::raas_stamp`` (``kvpass.kernels.raas_stamp``: two Triton launches per layer on CUDA,
    where the same rules as tensor code took about fifteen). Prompt pages are never evicted, so their timestamps are
    left as the prefill set them; the free / evict / oldest rules run over the decode pages only."""
    torch.ops.kvpass.raas_stamp(q[:, :, -1], k_new[:, :, -1], count, *state, decode_pages, alpha)
