"""Chunk fusion's policies (``a3`` and its baselines ``cacheblend``, ``legolink``, ``pie``, ``full_reuse``,
``a3+evict``): what a fused prompt recomputes and keeps. ``kvpass.ChunkFusion`` (``kvpass.chunks``) drives them.
Their operators (``ops``: merged-cache overwrite, recompute attention, RoPE re-rotation) and Triton kernels
(``kernels/``) sit here, each kernel next to its reference."""

from kvpass.policies.chunk_fusion import ops as _ops  # noqa: F401  (registers the family's torch.ops.kvpass.*)
