"""The core Triton kernels, each next to its pure-PyTorch reference.

* ``decode_attention``: one-token decode attention over a contiguous or paged cache, GQA-packed, with block
  orders, split-KV and ART early termination (``kvpass::decode_attention``).
* ``window_scores``: the attention the observation window gives every key, summed over window queries and GQA
  groups, in two passes without the ``[heads, window, N]`` scores (``kvpass::window_scores``).
* ``accumulated_scores``: the attention every prompt query gives every key, causal, summed over queries and GQA
  groups, in two flash-style passes without the ``[heads, L, N]`` scores (``kvpass::accumulated_scores``, H2O).
* ``gather``: compaction of the kept KV entries into fresh contiguous tensors (``kvpass::gather_kv``).

The page family's (quest, raas):

* ``page_bounds``: Quest's page upper bounds per query head (``kvpass::page_bounds``).
* ``top_pages``: Quest's page choice, the top pages of a row in index order without sorting (``kvpass::top_pages``).
* ``raas_stamp``: RaaS's per-layer page-table update (both caches): bounds, stamps and the next slot
  (``kvpass::raas_stamp``).

Chunk fusion's:

* ``slot_attention``: the recompute attention, queries at true positions over a merged cache whose slot j holds
  position j (``kvpass::attention_slots``).
* ``rope_rotate``: RoPE re-rotation of stored keys and the scatter of recomputed rows (``kvpass::rope_rotate``,
  ``kvpass::scatter_rows``).

Every kernel is a ``triton_op`` registered in ``kvpass.ops`` (the core ones) or in its family's ``ops.py``
(``kvpass.policies.pages.ops``, ``kvpass.policies.chunk_fusion.ops``).
"""
