"""Triton kernels, each next to its pure-PyTorch reference.

* ``decode_attention``: one-token decode attention over a contiguous or paged cache, GQA-packed,
  with block orders, split-KV and ART early termination (``kvpass::decode_attention``).

* ``window_scores``: the attention the observation window gives every key, summed over window
  queries and GQA groups, in two passes without the ``[heads, window, N]`` scores
  (``kvpass::window_scores``; SnapKV family and SABlock).
* ``gather``: compaction of the kept KV entries into fresh contiguous tensors (``kvpass::gather_kv``).

* ``page_scores``: Quest's page upper bounds and RaaS's softmax-share timestamps (``kvpass::page_scores``,
  ``kvpass::page_bounds``).
* ``top_pages``: Quest's page choice, the top pages of a row in index order without sorting
  (``kvpass::top_pages``).
* ``raas_stamp``: RaaS's per-layer page-table update on a SlotCache, bounds, stamps and the next slot
  (``kvpass::raas_stamp``).

* ``slot_attention``: chunk fusion's recompute attention, queries at true positions over a merged
  cache whose slot j holds position j (``kvpass::attention_slots``).
* ``rope``: RoPE re-rotation of stored keys and the scatter of recomputed rows (``kvpass::rope_rotate``,
  ``kvpass::scatter_rows``).
"""
