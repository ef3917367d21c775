"""The generation runtime: ``kvpass.compile``'s ``generate`` (``fastpath``: a reused SlotCache, one compile for
every prompt length), its decoding loop (``decode_loop``), decode steps called without Dynamo's frame
(``direct_steps``), the request queue (``requests``) and the token-id check every entry point shares
(``token_ids``). It runs models the graph pass (``kvpass.compiler``) compiled; nothing there imports it."""
