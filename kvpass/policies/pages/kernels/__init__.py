"""The page family's Triton kernels, each next to its pure-PyTorch reference.

* ``page_bounds``: Quest's page upper bounds per query head (``kvpass::page_bounds``).
* ``top_pages``: Quest's page choice, the top pages of a row in index order without sorting
  (``kvpass::top_pages``).
* ``raas_stamp``: RaaS's per-layer page-table update (both caches): bounds, stamps and the next slot
  (``kvpass::raas_stamp``).
"""
