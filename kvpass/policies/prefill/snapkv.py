"""``snapkv``: keep what the observation window attends to (Li et al., 2024).

At prefill the last ``window`` prompt tokens (32) score every earlier token by the attention they
give it (softmax over keys, causal inside the window, fp32), summed over the window queries and
over the query heads of each KV group: one score per token and **KV head**, the granularity the
cache is stored at (GQA groups share one index set, never one per query head). The scores are
max-pooled (``kernel`` 7, stride 1) so that a kept token brings its neighbours, and each layer and
KV head keeps the window plus its ``budget - window`` best tokens, in their original order.

``budget`` counts the window (see ``kvpass.policies.prefill.base``). Decode steps append.
"""

from __future__ import annotations

from kvpass.policies.contract import ConfigError, param
from kvpass.policies.prefill.base import PrefillEviction


class SnapKV(PrefillEviction):
    name = "snapkv"
    summary = "window attention (pooled) picks the prompt tokens each layer and KV head keeps"
    kernel: int = param(7, 1, 1025, "pooling kernel over token scores (odd; 1 = no pooling)")
    pool: str = param("max", doc="pooling: 'max' (SnapKV's choice here) or 'avg'")

    def check_config(self) -> None:
        super().check_config()
        self.check_kernel()
        if self.pool not in ("max", "avg"):
            raise ConfigError(f"policy '{self.name}': parameter 'pool' must be 'max' or 'avg', got {self.pool!r}")

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        return self.pooled_votes(site, q, k, kv_pos, q_pos, cand, self.pool)

    def score_scale(self, q, k) -> int:
        """The window's votes are summed over its queries and each KV group's query heads."""
        return min(self.window, q.shape[2]) * (q.shape[1] // k.shape[1])
