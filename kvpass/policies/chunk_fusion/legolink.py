"""``legolink``: chunk fusion that recomputes the first tokens of every chunk after the first.

Position recovery as ``pie``; the recompute set is the first ``prefix`` (16) tokens of every stored
segment that does not start the sequence (the segment at position 0, the system part when there is
one, is exact as stored). These are the tokens that acted as each chunk's attention sink when it was
computed alone. See ``kvpass.policies.chunk_fusion.a3`` for the machinery.
"""

from __future__ import annotations

import torch

from kvpass.policies.chunk_fusion.base import ChunkFusionPolicy
from kvpass.policies.contract import param


class LegoLink(ChunkFusionPolicy):
    name = "legolink"
    summary = "chunk fusion: recompute the first 16 tokens of every chunk after the first"
    prefix: int = param(16, 0, 1 << 20, "tokens recomputed at the start of every chunk after the first")

    def recompute(self, req):
        ends = req.chunk_starts[1:] + [req.length - req.question]
        picks = [torch.arange(s, min(s + self.prefix, e)) for s, e in zip(req.chunk_starts[1:], ends[1:])]
        if not picks:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(picks).long()
