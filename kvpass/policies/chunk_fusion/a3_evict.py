"""``a3+evict``: A^3's chunk fusion, then a cache of at most ``capacity`` entries (the paper's extension).

After ``a3``'s fusion (re-rotated stored KV, the top ``ratio`` document tokens recomputed), every
layer keeps, per KV head:

* the system prompt S and the question Q (never evicted),
* the SnapKV top ``capacity - |S| - |Q|`` document tokens by the question's attention at that layer:
  softmax of Q's queries (all question tokens but the last, which the first generation step
  computes) over the merged cache, summed over those queries and the heads of the KV group, then
  max-pooled over the document tokens with ``kernel`` (SnapKV's pooling, 7).

So a layer stores ``capacity`` entries once the last question token has joined (``capacity`` = C =
1024 as in the paper), or ``|S| + |Q|`` when that is more. The votes come from the recompute
graph itself (``kvpass::fusion_votes`` after each layer's ``attention_slots``), the compaction is
``kvpass::gather_kv``, and the kept entries' true positions go to the backend's state, so decoding
continues from the request's length, not from the shorter cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.policies.chunk_fusion.a3 import A3
from kvpass.policies.chunk_fusion.base import FusionRequest
from kvpass.policies.contract import ConfigError, param
from kvpass.policies.prefill.scoring import keep_top, pool


class A3Evict(A3):
    name = "a3+evict"
    summary = "a3, then keep S, Q and the SnapKV top (capacity - |S| - |Q|) document tokens per layer and KV head"
    capacity: int = param(1024, 2, 1 << 24, "entries each layer keeps per KV head after fusion (C)")
    kernel: int = param(7, 1, 63, "SnapKV max-pooling width over the document tokens (odd)")
    needs_votes = True

    def check_config(self) -> None:
        if self.kernel % 2 == 0:
            raise ConfigError(f"policy 'a3+evict': parameter 'kernel' must be odd in [1, 63], got {self.kernel}")

    def keep_after_fusion(self, votes: Tensor, req: FusionRequest) -> Tensor:
        b, hkv, length = votes.shape
        kept_always = int((~req.doc[:length]).sum())  # S and Q (req.doc is on the CPU: no device sync)
        keep = min(length, max(self.capacity - 1, kept_always))  # Q's last token comes next
        doc = req.doc[:length].to(votes.device).expand(b, hkv, length)
        priority = pool(votes, doc, self.kernel, "max")
        return keep_top(priority, ~doc, torch.ones_like(doc), keep)
