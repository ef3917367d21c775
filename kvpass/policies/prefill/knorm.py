"""``knorm``: keep the keys of lowest L2 norm (Devoto et al., 2024).

"A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" observes that a key with a
small L2 norm tends to draw a large share of the attention, so the norm alone, without any query,
ranks the entries. At prefill each layer scores every prompt entry by minus the L2 norm of its key
(the key as the cache stores it, after RoPE, computed in fp32): one score per token and **KV head**,
and each layer and KV head keeps its ``budget`` best entries, in their original order, ties to the
earlier entry. No attention is read, so the scorer costs one pass over the keys.

Parameters: ``budget`` (2048) is the frame's (entries kept per layer and KV head, the window
included; a prompt no longer than it is kept whole, which equals ``full``). ``window`` (0) is the
number of last prompt tokens kept whatever their norm; 0, the default, keeps none by position.

kvpress 0.5.5's ``KnormPress`` ranks by the same score per KV head and keeps its top entries with no
window, which is ``window=0`` here. It sizes the cut by ``compression_ratio`` (a fraction of each
prompt dropped) where kvpass counts entries (``budget``), the unit the whole family shares.
Decode steps append (see ``kvpass.policies.prefill.base``).
"""

from __future__ import annotations

from kvpass.policies.contract import param
from kvpass.policies.prefill.base import PrefillEviction


class KNorm(PrefillEviction):
    name = "knorm"
    summary = "keys of lowest L2 norm are kept, per layer and KV head (no attention read)"
    window: int = param(0, 0, 1 << 16, "last prompt tokens always kept (0: none, as kvpress's KnormPress)")

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        return -k.float().norm(dim=-1)  # [B, H_kv, N]: the smaller the norm, the higher the priority
