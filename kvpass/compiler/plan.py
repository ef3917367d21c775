"""The one place a site's rewrite is decided: the policy's plan, completed from its ``Needs`` and the site.

``plan_site`` asks the policy (``Policy.plan``), then:

* on a ``kvpass.SlotCache`` site, adds the device-side slot rule the policy declares (``Needs.slot_rule``)
  and its slot hooks; a sliding-window layer is a ring of its window whatever the policy;
* on a decode or append graph of a policy that only appends after its prefill (``Needs.decode_appends``),
  turns an evicting plan into ``append`` (the model's own cache update, positions fixed), unless the site's
  mask is not plainly causal: a padding mask is sized by true lengths, not by what the shrunk cache stores,
  so such a site keeps the evicting rewrite, which masks by true position;
* refuses a plan that stops reading the model's mask where that mask may carry a bias (ALiBi) or groups
  positions into chunks (chunked attention).

The rewrite (``kvpass.compiler.rewrite``) then runs ``plan.rewrite_kind`` and decides nothing.
"""

from __future__ import annotations

import dataclasses

from kvpass.cache import slots as _slots
from kvpass.compiler.detect import mask_bias, mask_chunks
from kvpass.compiler.maskcheck import site_mask
from kvpass.policies.contract import Policy, Refusal, SitePlan


def foreign_cache(policy: Policy, sites) -> str | None:
    """Why a graph must not be compiled for ``policy``: a ``kvpass.SlotCache`` built for another policy
    configuration (its slots are sized and its decode rule chosen for that one), or None."""
    for site in sites:
        if site.cache == "slot" and site.slot_spec and site.slot_spec != policy.key():
            return (
                f"kvpass: layer {site.layer}'s kvpass.SlotCache was built for policy {site.slot_spec}, but this "
                f"model is compiled with a kvpass backend of policy {policy.key()}; build the cache with the "
                f"backend the model is compiled with: kvpass.SlotCache(model, be, ...)"
            )
    return None


def plan_site(policy: Policy, site) -> SitePlan | Refusal:
    """The plan of ``site`` (its ``phase`` set), or a ``Refusal`` saying why it cannot be planned (a policy
    whose ``plan`` answers a bare string refuses with that string)."""
    plan = policy.plan(site)
    if isinstance(plan, str):
        return Refusal(plan)
    if isinstance(plan, Refusal):
        return plan
    needs = policy.needs
    if site.cache == "slot":
        if needs.slot_rule is None:
            return Refusal("no fixed-capacity decode for this policy (its Needs.slot_rule is None); use a DynamicCache")
        if site.sliding_window:  # a ring of the window's slots, whatever the policy (it leaves sliding layers be)
            plan = SitePlan(attention=True, slot=(_slots.RING, 0))
        else:
            plan = dataclasses.replace(
                plan, slot=(_slots.RULES[needs.slot_rule], policy.slot_protect), slot_hooks=policy.slot_hooks(site)
            )
    elif (
        plan.evict
        and needs.decode_appends
        and site.phase in ("decode", "append")
        and not site.sliding_window
        and site_mask(site)[0] is None
    ):
        plan = dataclasses.replace(plan, evict=False, tokens=False, append=True)
    if plan.replaces_mask and (why := mask_bias(site.mask) or mask_chunks(site.mask)):
        return Refusal(f"layer {site.layer}: {why}")
    return plan
