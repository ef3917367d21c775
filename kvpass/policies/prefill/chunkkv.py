"""``chunkkv``: keep whole chunks of consecutive tokens (Liu et al., 2025).

The prompt before the observation window is cut into fixed chunks of ``chunk`` tokens (10),
counted from the first real token, so padding never moves a boundary. A chunk's score is the
window attention its tokens receive, summed over the window queries and over **all** query heads of
the layer (the graph computes these votes, ``SitePlan.layer_votes``, and gathers them over the ranks of a
tensor-parallel model, so every rank ranks the chunks of the whole layer): one ranking, hence one index
set shared by every KV head of the layer (what ChunkKV keeps is semantic units, which do not depend on the
head). The best chunks are kept until the
layer's ``budget - window`` candidate entries are covered; the last chunk taken is trimmed to its
best tokens so the budget is exact. No pooling: the chunk sum already aggregates neighbours.

``budget`` counts the window (see ``kvpass.policies.prefill.base``). Decode steps append.
"""

from __future__ import annotations

import dataclasses

import torch

from kvpass.policies.contract import Refusal, SitePlan, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.base import PrefillEviction


class ChunkKV(PrefillEviction):
    name = "chunkkv"
    summary = "fixed chunks of 10 tokens ranked by window attention, one index set per layer"
    chunk: int = param(10, 1, 1 << 16, "tokens per chunk")

    def plan(self, site) -> SitePlan | Refusal:
        plan = super().plan(site)
        if isinstance(plan, Refusal) or not plan.evict:
            return plan
        return dataclasses.replace(plan, layer_votes=self.window)  # the layer's votes, every head (and rank)

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens, votes=None):
        if votes is None:  # a select outside a planned graph: this device's heads are all the heads
            if getattr(site, "tp", None) is not None:
                raise RuntimeError(
                    f"kvpass chunkkv: layer {site.layer} selects without the votes of the other "
                    f"tensor-parallel ranks (its graph was not planned with layer_votes)"
                )
            votes = scoring.window_scores(site, q, k, kv_pos, q_pos, self.window)
        shared = cand.all(dim=1)  # [B, N]: the same tokens in every head
        score = votes.sum(dim=1).masked_fill(~shared, 0.0)  # all heads of the layer (every rank's)
        seg = torch.where(shared, 0, -1)  # one segment: the whole candidate region
        quota_t = torch.full((score.shape[0], 1), quota, device=score.device, dtype=torch.long)
        chosen = scoring.block_fill(score.double(), seg, self.chunk, quota_t)
        return chosen[:, None, :].expand_as(cand).float()
