"""``pie``: chunk fusion with position recovery only.

Every stored key is rotated to its position in the concatenated input (the chunk's own RoPE undone,
the request's applied, with the model's rotary module); no document token is recomputed. Only the
question is computed, over the merged cache. See ``kvpass.policies.chunk_fusion.a3`` for the machinery.
"""

from __future__ import annotations

from kvpass.policies.chunk_fusion.base import ChunkFusionPolicy


class PIE(ChunkFusionPolicy):
    name = "pie"
    summary = "chunk fusion: stored KV re-rotated to its concatenated positions, nothing recomputed"
