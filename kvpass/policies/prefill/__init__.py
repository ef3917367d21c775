"""Prefill eviction: policies that compress the prompt's cache once, at prefill (``snapkv``, ``pyramidkv``,
``chunkkv``, ``sablock``, ``knorm``, ``keydiff``, ``expected_attention``, ``criticalkv``, ``adakv``,
``duoattention``, ``kvzip``). ``base`` holds their shared frame (budget, observation window, the selection),
``scoring`` the window scores, pooling and block selection they rank tokens with."""

from kvpass.policies.prefill.adakv import AdaKV
from kvpass.policies.prefill.chunkkv import ChunkKV
from kvpass.policies.prefill.criticalkv import CriticalKV
from kvpass.policies.prefill.duoattention import DuoAttention
from kvpass.policies.prefill.expected_attention import ExpectedAttention
from kvpass.policies.prefill.keydiff import KeyDiff
from kvpass.policies.prefill.knorm import KNorm
from kvpass.policies.prefill.kvzip import KVzip
from kvpass.policies.prefill.pyramidkv import PyramidKV
from kvpass.policies.prefill.sablock import SABlock
from kvpass.policies.prefill.snapkv import SnapKV

# the family's policies, in the order `kvpass.policies.POLICIES` lists them (adding one: its file, this tuple and
# its tests/conformance.py entry)
FAMILY = (
    SnapKV,
    PyramidKV,
    ChunkKV,
    SABlock,
    KNorm,
    KeyDiff,
    ExpectedAttention,
    CriticalKV,
    AdaKV,
    DuoAttention,
    KVzip,
)
