"""The page family's Triton kernels, each next to its pure-PyTorch reference.

* ``page_scores``: Quest's page upper bounds and RaaS's softmax-share timestamps (``kvpass::page_scores``,
  ``kvpass::page_bounds``).
* ``top_pages``: Quest's page choice, the top pages of a row in index order without sorting
  (``kvpass::top_pages``).
* ``raas_stamp``: RaaS's per-layer page-table update on a SlotCache: bounds, stamps and the next slot
  (``kvpass::raas_stamp``).
"""
