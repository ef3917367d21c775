"""Layer-gated prefill: policies that stop propagating part of the prompt at a selection layer (``asl``,
``asl_fullkv``, ``asl_2pass``, ``fastkv``, ``gemfilter``); ``kvpass.compiler.gate`` runs their prefill as
segments split at the gate."""

from kvpass.policies.gated.asl import ASL, ASL2Pass, ASLFullKV
from kvpass.policies.gated.fastkv import FastKV
from kvpass.policies.gated.gemfilter import GemFilter

# the family's policies, in the order `kvpass.policies.POLICIES` lists them (adding one: its file, this tuple and
# its tests/conformance.py entry)
FAMILY = (ASL, ASLFullKV, FastKV, ASL2Pass, GemFilter)
