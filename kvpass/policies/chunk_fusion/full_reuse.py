"""``full_reuse``: chunk fusion without position recovery (the naive baseline).

Stored chunks keep the rotation of their own positions ``0..n-1`` (as if each chunk started the
sequence); they are concatenated in request order and masked causally by their concatenated
positions. Only the question is computed, at its true positions. See ``kvpass.policies.chunk_fusion.a3``.
"""

from __future__ import annotations

from kvpass.policies.chunk_fusion.base import ChunkFusionPolicy


class FullReuse(ChunkFusionPolicy):
    name = "full_reuse"
    summary = "chunk fusion: stored KV concatenated as computed (no position recovery), nothing recomputed"
    recover_positions = False
