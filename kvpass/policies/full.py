"""``full``: the identity policy.

Every attention site runs through the kvpass attention operator with exact attention and the
model's own mask; the cache is left to the model. It is the reference every other policy is
compared with, and the proof that the pass itself changes nothing.
"""

from __future__ import annotations

from kvpass.policies.contract import Needs, Policy, SitePlan


class Full(Policy):
    name = "full"
    summary = "exact attention through the kvpass operator; the cache is untouched"
    needs = Needs(slot_rule="append", plain_prefill=True)

    def plan(self, site) -> SitePlan:
        return SitePlan(attention=True, evict=False)
