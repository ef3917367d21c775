"""The cache and the state kvpass keeps between calls: ``slots`` (``kvpass.SlotCache``, the fixed-capacity cache
whose decode step is one device-resident graph), ``state`` (true positions and per-layer records of a
generation on a DynamicCache) and ``runtime`` (the bridge from a compiled graph's operators, by integer
handle, to one backend's policy and state)."""
