"""The page family: policies that score or evict the cache by pages of 16 tokens (``quest``, ``raas``), with their
operators (``ops``: page bounds, RaaS's stamp, the top-pages choice, the pool-site step) and Triton kernels
(``kernels/``), each next to its pure-PyTorch reference."""

from kvpass.policies.pages import ops as _ops  # noqa: F401  (registers the family's torch.ops.kvpass.*)
from kvpass.policies.pages.quest import Quest
from kvpass.policies.pages.raas import RaaS

# the family's policies, in the order `kvpass.policies.POLICIES` lists them (adding one: its file, this tuple and
# its tests/conformance.py entry)
FAMILY = (RaaS, Quest)
