"""``tova``: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

A global layer keeps at most ``budget`` entries. Each decode step adds its token and, on a full layer, drops
the entry the step's query attends to least: the paper's rule, with the attention averaged over the layer's
heads, so every head gives up the same token (``per_head=True`` lets each KV head choose its own). Scores are
not accumulated: only the latest query's attention counts. A prompt longer than the budget keeps the tokens its
last query attends to most. ``budget >= prompt + new tokens`` equals ``full``. The machinery (prefill cut,
victim, both caches) is ``kvpass.policies.scored``.
"""

from __future__ import annotations

from kvpass.policies.contract import Refusal, param
from kvpass.policies.scored import ScoredEviction


class TOVA(ScoredEviction):
    name = "tova"
    summary = "drops the entry the latest query attends to least, one per decode step (heads averaged)"
    per_head: bool = param(False, doc="each KV head drops its own entry (the paper averages over the heads)")
    accumulate = False

    @property
    def shared(self) -> bool:
        return not self.per_head

    def plan(self, site):
        if self.shared and site.tp is not None:
            return Refusal(
                f"layer {site.layer}: tova averages its scores over all KV heads of a layer, and under "
                f"tensor parallelism each rank holds part of them; pass per_head=True (each head decides "
                f"alone, the same on every rank) or run on one device"
            )
        return super().plan(site)
