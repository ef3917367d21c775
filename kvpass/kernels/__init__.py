"""Triton kernels, each next to its pure-PyTorch reference.

* ``decode_attention``: one-token decode attention over a contiguous or paged cache, GQA-packed,
  with block orders, split-KV and ART early termination (``kvpass::decode_attention``).

Window scoring (SnapKV family) and page scoring (Quest / RaaS) kernels land with their policies.
"""
