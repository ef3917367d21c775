"""Chunk fusion's driver: ``chunkstore`` (``kvpass.ChunkStore``: precomputed chunk caches, stored pre-RoPE),
``rope`` (re-rotating stored keys to new positions with the model's own rotary module) and ``router``
(``kvpass.ChunkFusion``: merges chunks into one cache, runs a fusion policy's recompute through a kvpass
backend, then decodes)."""
