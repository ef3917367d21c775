"""``keydiff``: keep the keys least like the prompt's mean key (Park et al., 2025).

KeyDiff ("Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments") keeps the distinctive keys: those far, in angle, from the
others. Per row and **KV head** the anchor is the mean of the prompt's keys scaled to unit length,
taken over the real tokens only (left padding does not move it, so a padded row keeps what the same
prompt keeps alone; the window's keys count too). Each entry's score is minus the cosine similarity
of its key to the anchor (keys as the cache stores them, after RoPE, in fp32), and each layer and KV
head keeps its ``budget`` best entries, in their original order, ties to the earlier entry. Like
``knorm`` it reads no attention.

Parameters: ``budget`` (2048) is the frame's (entries kept per layer and KV head, the window
included; a prompt no longer than it is kept whole, which equals ``full``). ``window`` (0) is the
number of last prompt tokens kept whatever their score; 0, the default, keeps none by position.

kvpress 0.5.5's ``KeyDiffPress`` uses the same anchor and score per KV head and keeps its top entries
with no window, which is ``window=0`` here; its mean runs over every key of the batch row, padding
included, where this one skips padding (the same on an unpadded prompt). It sizes the cut by
``compression_ratio`` where kvpass counts entries (``budget``). The paper evicts while a long prompt
is processed block by block; here, as in kvpress, the whole prompt is scored once at prefill.
Decode steps append (see ``kvpass.policies.prefill.base``).
"""

from __future__ import annotations

import torch.nn.functional as F

from kvpass.policies.contract import param
from kvpass.policies.prefill.base import PrefillEviction


class KeyDiff(PrefillEviction):
    name = "keydiff"
    summary = "keys least similar (cosine) to the prompt's mean key are kept, per layer and KV head"
    window: int = param(0, 0, 1 << 16, "last prompt tokens always kept (0: none, as kvpress's KeyDiffPress)")

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        unit = F.normalize(k.float(), dim=-1)  # [B, H_kv, N, D]
        real = (kv_pos >= 0).unsqueeze(-1).float()  # padding: weight 0
        anchor = (unit * real).sum(2, keepdim=True) / real.sum(2, keepdim=True).clamp_min(1.0)
        return -F.cosine_similarity(unit, anchor, dim=-1)  # [B, H_kv, N]
