"""The core Triton kernels, each next to its pure-PyTorch reference.

* ``decode_attention``: one-token decode attention over a contiguous or paged cache, GQA-packed, with block
  orders, split-KV and ART early termination (``kvpass::decode_attention``).
* ``window_scores``: the attention the observation window gives every key, summed over window queries and GQA
  groups, in two passes without the ``[heads, window, N]`` scores (``kvpass::window_scores``).
* ``accumulated_scores``: the attention every prompt query gives every key, causal, summed over queries and GQA
  groups, in two flash-style passes without the ``[heads, L, N]`` scores (``kvpass::accumulated_scores``, H2O).
* ``gather``: compaction of the kept KV entries into fresh contiguous tensors (``kvpass::gather_kv``).

A policy family's own kernels sit with the family: ``kvpass.policies.pages.kernels``,
``kvpass.policies.chunk_fusion.kernels``.
"""
