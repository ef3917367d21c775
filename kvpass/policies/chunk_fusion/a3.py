"""``a3``: attention-aware chunk fusion (A^3).

**a3.** Position recovery: every stored key is rotated to its position in the concatenated input.
The recompute set Re is the top ``ratio * n`` document tokens (``ratio`` = r = 0.15, n = number of
document tokens) by the attention the question gives them at layer 1: softmax over all keys,
summed over the question's tokens and over all query heads. Then only [Re, Q] are computed, at
their true positions, in every layer; their K/V are written over the stored ones and they attend
over the merged cache with the exact causal mask of their true positions.

The frame it runs in (selection pass, recompute pass, decode): ``kvpass.policies.chunk_fusion.base``.
"""

from __future__ import annotations

import torch

from kvpass.policies.chunk_fusion.base import TopRatio


class A3(TopRatio):
    name = "a3"
    summary = "chunk fusion: re-rotated stored KV, recompute the top r document tokens by the question's attention"

    def score(self, site, q, k, kv_pos, q_pos, req):
        w = req.question
        return torch.ops.kvpass.window_scores(
            q[:, :, -w:], k, kv_pos, q_pos[:, -w:].contiguous(), 1.0, float(site.softcap)
        )  # [B, H_kv, L], summed over Q and group
