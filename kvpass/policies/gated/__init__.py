"""Layer-gated prefill: policies that stop propagating part of the prompt at a selection layer (``asl``,
``asl_fullkv``, ``asl_2pass``, ``fastkv``, ``gemfilter``); ``kvpass.compiler.gate`` runs their prefill as
segments split at the gate."""
