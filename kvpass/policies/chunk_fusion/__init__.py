"""Chunk fusion's policies (``a3`` and its baselines ``cacheblend``, ``legolink``, ``pie``, ``full_reuse``,
``a3+evict``): what a fused prompt recomputes and keeps. ``kvpass.ChunkFusion`` (``kvpass.chunks``) drives them.
Their operators (``ops``: merged-cache overwrite, recompute attention, RoPE re-rotation) and Triton kernels
(``kernels/``) sit here, each kernel next to its reference."""

from kvpass.policies.chunk_fusion import ops as _ops  # noqa: F401  (registers the family's torch.ops.kvpass.*)
from kvpass.policies.chunk_fusion.a3 import A3
from kvpass.policies.chunk_fusion.a3_evict import A3Evict
from kvpass.policies.chunk_fusion.cacheblend import CacheBlend
from kvpass.policies.chunk_fusion.full_reuse import FullReuse
from kvpass.policies.chunk_fusion.legolink import LegoLink
from kvpass.policies.chunk_fusion.pie import PIE

# the family's policies, in the order `kvpass.policies.POLICIES` lists them (adding one: its file, this tuple and
# its tests/conformance.py entry)
FAMILY = (A3, A3Evict, PIE, FullReuse, CacheBlend, LegoLink)
