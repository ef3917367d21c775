"""Chunk fusion's Triton kernels, each next to its pure-PyTorch reference.

* ``slot_attention``: the recompute attention, queries at true positions over a merged cache whose slot j holds
  position j (``kvpass::attention_slots``).
* ``rope``: RoPE re-rotation of stored keys and the scatter of recomputed rows (``kvpass::rope_rotate``,
  ``kvpass::scatter_rows``).
"""
