"""``h2o``: heavy hitters plus a recent window, by accumulated attention (Zhang et al., 2023, "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").

Every stored entry carries the attention it has received so far, summed over every query that saw it
(prompt queries at prefill, then each decode token) and over the query heads of its KV group: one score
per entry and **KV head**, the granularity the cache is stored at. Each global attention layer keeps at
most ``budget`` entries per KV head: the ``recent = budget - round(heavy * budget)`` latest tokens always,
and of the older ones the heavy hitters, those with the largest accumulated attention. The paper's setting
splits the cache evenly between the two (its 10 % heavy + 10 % recent of the sequence), hence ``heavy=0.5``.

When. A prompt longer than the budget is cut at prefill (its queries' attention, causal, accumulated over
all of them); then every decode step adds its token, adds its attention to every kept entry and, once the
layer holds ``budget + 1`` entries, evicts the one with the least accumulated attention outside the recent
window (the paper's greedy one-per-step eviction). Left padding is evicted before any real token; among
equal scores the later entry goes (the earlier is kept, as everywhere in kvpass). ``budget >= prompt +
new tokens`` never evicts: equal to ``full``. Sliding-window layers are left to the model.

Where. ``select`` scores and keeps (the prefill, and every step on a DynamicCache) and returns the kept
entries' scores as bookkeeping: on a DynamicCache they stay beside the stored positions, on a
``kvpass.SlotCache`` ``slot_prefill`` writes them into the layer's ``acc [B, H_kv, budget + 1]`` (fp32).
There two pieces of tensor code in the decode graph keep it: ``place`` picks the slot of the new token (a
free slot, else the victim) and ``update`` adds the step's attention (``kvpass::window_scores`` over the
slots, one query). The victim is chosen one step later than on a DynamicCache, from the same scores, so
both caches keep the same entries.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvpass.cache.slots import FILLED, next_positions
from kvpass.policies.contract import ConfigError, Needs, Policy, param, SitePlan, SlotHooks, shrinking_plan
from kvpass.policies.prefill.scoring import keep_top, window_layout


def accumulated(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, softcap: float,
                lse: Tensor | None = None) -> Tensor:
    """``[B, H_kv, N]`` fp32: the attention every key receives from the queries ``q [B, H, L, D]`` (scale
    folded in), causal by true position, summed over the queries and the query heads of each KV group.
    One ``kvpass::accumulated_scores`` call: on CUDA two flash-style Triton passes that never hold the
    ``[H, L, N]`` scores (one, given the prefill attention's row log-sum-exp ``lse``), on CPU its reference
    (chunked over queries)."""
    return torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, 1.0, float(softcap), lse)


class H2O(Policy):
    name = "h2o"
    summary = "heavy hitters by accumulated attention + a recent window, one eviction per decode step"
    budget: int = param(2048, 2, 1 << 24, "entries kept per layer and KV head (heavy hitters + recent)")
    heavy: float = param(0.5, 0.0, 0.99, "share of the budget for heavy hitters (the rest: recent tokens)")
    needs = Needs(evicts=True, slot_rule="placed")

    @property
    def recent(self) -> int:
        return self.budget - round(self.heavy * self.budget)

    def check_config(self) -> None:
        if self.recent < 1:
            raise ConfigError(f"policy 'h2o': parameter 'heavy' must leave at least one recent entry of the budget "
                              f"({self.budget}), got {self.heavy}")

    def plan(self, site) -> SitePlan | str:
        if site.cache == "slot" and site.phase not in ("prefill", "decode") and not site.sliding_window:
            return (f"layer {site.layer}: h2o on a SlotCache runs prefills and one-token decode steps; this "
                    f"'{site.phase}' graph appends several tokens to a filled cache")
        plan = shrinking_plan(site)
        # a plainly causal prefill's attention hands its row log-sum-exp to the scoring (one pass, not two)
        return dataclasses.replace(plan, lse=True) if isinstance(plan, SitePlan) and plan.evict else plan

    # -- DynamicCache: the scores are the layer's bookkeeping -------------------------------------------
    def stored_length(self, site, total):
        return torch.sym_min(total, self.budget)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, lse=None):
        n, new = kv_pos.shape[-1], q_pos.shape[1]
        acc = accumulated(q, k, kv_pos, q_pos, site.softcap, lse)
        if n > new:  # entries stored before this call carry their scores
            old = layer_state.extra.get("acc") if layer_state is not None else None
            if old is None or old.shape[-1] != n - new:
                raise RuntimeError("policy 'h2o': the cache holds entries without accumulated attention (it was "
                                   "not filled by this backend's h2o); start a new cache")
            acc = torch.cat([acc[..., :n - new] + old, acc[..., n - new:]], -1)
        if n <= self.budget:
            return None, {"acc": acc}
        valid, recent = window_layout(kv_pos, self.recent)
        keep = keep_top(acc, recent, valid, self.budget)
        return keep, {"acc": acc.gather(-1, keep)}

    # -- SlotCache: the scores are a layer tensor, kept by tensor code in the graphs ---------------------
    def slot_capacity(self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1) -> int:
        return min(max_length, self.budget + 1)  # the kept entries and the token being decoded

    def slot_state(self, capacity: int, head_dim: int) -> dict:
        return {"acc": ((capacity,), torch.float32, 0.0)}

    def slot_hooks(self, site) -> SlotHooks | None:
        if site.sliding_window:
            return None
        return SlotHooks(place=slot_victim, update=slot_attend,
                         args=(float(site.softcap), self.recent))


def slot_victim(pos, count, state: list, softcap: float, recent: int):
    """Before a decode step's write: the slot ``[B, H_kv, 1]`` of the new token. While the layer has a free
    slot, the next one; else the entry ``select`` would have evicted after the last step: padding first,
    then the least accumulated attention outside the ``recent`` latest tokens, the latest such on a tie."""
    (acc,) = state
    cap = pos.shape[-1]
    nxt = next_positions(count, 1)[:, :, None]       # each row's new token's position
    held = pos.long()
    old = (held >= 0) & (held < nxt - recent)      # evictable real entries (the recent window stays)
    score = torch.where(held < 0, float("-inf"), torch.where(old, acc, float("inf")))
    low = score.amin(-1, keepdim=True)
    tied = score == low
    victim = torch.where(tied, held, torch.iinfo(torch.int64).min).argmax(-1, keepdim=True)  # the latest
    filled = count[:, FILLED, None, None]
    slot = torch.where(filled < cap, filled.expand_as(victim), victim)
    acc.scatter_(-1, slot, 0.0)                      # the new token starts with no attention received
    return slot


def slot_attend(q, keys, pos, count, state: list, k_new, softcap: float, recent: int) -> None:
    """After a decode step's write: every slot's score gains the attention the step's token gave it."""
    (acc,) = state
    q_pos = next_positions(count, 1) - 1              # the token just written
    acc.add_(torch.ops.kvpass.window_scores(q, keys, pos.long(), q_pos, 1.0, softcap))
