"""``adakv``: a scorer's ranking over a layer's heads, each KV head keeping its own share (Feng et al., 2024).

"Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation": a uniform budget gives every head the same
count, though some heads attend to a few entries and others spread their attention. AdaKV ranks the layer's
(head, entry) pairs together by a base scorer's scores and keeps the best ``H_kv x budget`` of them, so a
concentrated head gives up entries that a spread one takes; a safeguard first keeps each head's ``alpha x budget``
best entries (``kvpass.policies.prefill.scoring.keep_top_heads``). The scorer's forced entries (snapkv's
observation window) are kept in every head before anything else.

**Real memory.** Each layer stores exactly its ``H_kv x budget`` kept entries: a row's heads share one pool, each
head's entries in a range of their own (``kvpass.cache.ragged``), and decode steps read each head's range alone
(decode attention's ``kv_start``). On a ``DynamicCache`` the pool is stored as ``[B, H_kv, budget, D]``, the shape
a uniform budget stores (the head dimension holds the pool in ``H_kv`` equal parts, not one head each), so
``transformers`` sees the length it expects; each decode step adds one entry per head after its range (a copy, as
``torch.cat`` makes for any ``DynamicCache``). On a ``kvpass.SlotCache`` (``kvpass.compile``'s cache) a layer's
``[B, H_kv, C, D]`` slots hold the pool, each head's kept entries followed by room for the decode steps (``C`` less
the budget, at least ``max_new_tokens``), and each step writes every head's token in place after its range: one
device-resident graph, as for a uniform budget.

Parameters: ``scorer`` (``"snapkv"``; also ``"pyramidkv"``, whose budgets decrease with depth: head-wise PyramidKV,
the paper's Ada-Pyramid; ``"expected_attention"`` and ``"criticalkv"``; each optionally with its own parameters,
``"snapkv:kernel=5,pool=avg"``), built with this policy's ``budget`` and ``window`` (``-1``: the scorer's own) and
its own defaults otherwise; a layer keeps ``H_kv`` times the scorer's budget for that layer; ``budget`` (2048,
entries kept per KV head on average: the layer keeps ``H_kv x budget``); ``alpha`` (0.2, 0..1: each head's floor,
``max(1, int(alpha x budget))`` entries; 1 keeps the scorer's uniform choice, the no-op against the scorer; 0 no
floor beyond the scorer's forced entries). A prompt no longer than ``budget`` is kept whole (``full``).

**Against kvpress 0.5.5's ``AdaKVPress``.** The same allocation (one ranking over the layer's pairs after a floor
of ``int(alpha x kept)`` per head, at least one), counted in kept entries where kvpress drops a
``compression_ratio``; kvpress masks the dropped pairs in its attention patch and keeps their memory ("does not
reduce peak memory"), kvpass stores only the kept ones.
"""

from __future__ import annotations

import dataclasses

from kvpass.cache import ragged
from kvpass.policies.contract import Needs, Refusal, SitePlan, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.criticalkv import CriticalKV
from kvpass.policies.prefill.expected_attention import ExpectedAttention
from kvpass.policies.prefill.over_scorer import OverScorer
from kvpass.policies.prefill.pyramidkv import PyramidKV
from kvpass.policies.prefill.snapkv import SnapKV


class AdaKV(OverScorer):
    name = "adakv"
    summary = "a scorer's ranking over the layer's heads: each KV head keeps its own share of the layer's budget"
    needs = Needs(evicts=True, heads=True, slot_rule="append")
    SCORERS = {cls.name: cls for cls in (SnapKV, PyramidKV, ExpectedAttention, CriticalKV)}
    scorer: str = param(
        "snapkv",
        doc="base scorer: 'snapkv', 'pyramidkv' (its layer budgets: head-wise PyramidKV), "
        "'expected_attention' or 'criticalkv' (built with budget and window, its own "
        "defaults otherwise)",
    )
    alpha: float = param(
        0.2, 0.0, 1.0, "each head's floor as a share of the budget (AdaKV's safeguard; 1: the scorer's uniform choice)"
    )

    def plan(self, site) -> SitePlan | Refusal:
        plan = super().plan(site)
        if not isinstance(plan, SitePlan) or not plan.evict:
            return plan
        return dataclasses.replace(plan, heads=True)

    # the layer's total is the scorer's: pyramidkv's budgets decrease with depth (Ada-Pyramid in the paper)
    def kept(self, site, total):
        return self.base.kept(site, total)

    def layer_budget(self, site) -> int:
        return self.base.layer_budget(site)

    def slot_budget(self, layer: int, layers: int) -> int:
        return self.base.slot_budget(layer, layers)

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return dict(ragged.SLOT_STATE)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, **inputs):
        n = kv_pos.shape[-1]
        keep = self.kept(site, n)
        if n != q_pos.shape[1] or n <= keep:  # not a prefill, or nothing to evict
            return None
        floor = max(1, int(self.alpha * keep)) if self.alpha > 0 else 0
        sel, counts = scoring.keep_top_heads(
            *self.base.ranking(site, q, k, v, kv_pos, q_pos, keep, **inputs), keep, floor
        )
        return ragged.Kept(sel, counts)
