"""Prefill eviction: policies that compress the prompt's cache once, at prefill (``snapkv``, ``pyramidkv``,
``chunkkv``, ``sablock``). ``base`` holds their shared frame (budget, observation window, the selection),
``scoring`` the window scores, pooling and block selection they rank tokens with."""
