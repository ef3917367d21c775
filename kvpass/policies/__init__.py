"""Policy registry: ``make_policy("a+b", **params)`` builds and validates a policy."""

from __future__ import annotations

from kvpass.policies import chunk_fusion, gated, pages, prefill
from kvpass.policies.art import ART
from kvpass.policies.compose import Composed
from kvpass.policies.contract import ConfigError, DecodeRead, Needs, Param, Policy, Refusal, SitePlan
from kvpass.policies.full import Full
from kvpass.policies.h2o import H2O
from kvpass.policies.streamingllm import StreamingLLM
from kvpass.policies.tova import TOVA

# chunk fusion (kvpass.ChunkFusion drives these; their frame: kvpass/policies/chunk_fusion/base.py)
FUSION = chunk_fusion.FAMILY

# the single-file policies, then each family's (a family folder lists its own in its FAMILY)
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, ART) + prefill.FAMILY + pages.FAMILY + gated.FAMILY + (H2O, TOVA) + FUSION
}


def available() -> list[str]:
    return sorted(POLICIES)


def make_policy(spec: str | Policy, **params) -> Policy:
    """Build a policy from a name (``"full"``, ``"streamingllm"``, ``"a+b"``) and its parameters."""
    if isinstance(spec, Policy):
        if params:
            raise ConfigError("pass parameters to the Policy object itself, not to backend()")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            f"policy must be a non-empty string such as 'full', got {spec!r}; known policies: {', '.join(available())}"
        )
    if spec.strip() in POLICIES:  # a name that contains '+' itself (a3+evict) is one policy
        return POLICIES[spec.strip()](**params)
    names = [n.strip() for n in spec.split("+")]
    for n in names:
        if not n:
            raise ConfigError(f"policy '{spec}' has an empty name around '+'; write e.g. 'snapkv+art'")
        if n not in POLICIES:
            raise ConfigError(f"unknown policy '{n}'; known policies: {', '.join(available())}")
    classes = [POLICIES[n] for n in names]
    if len(classes) == 1:
        return classes[0](**params)
    declared = {p.name for c in classes for p in c.params}
    unknown = sorted(set(params) - declared)
    if unknown:
        raise ConfigError(
            f"policy '{spec}' has no parameter '{unknown[0]}'; its parameters are: "
            f"{', '.join(sorted(declared)) or 'none'}"
        )
    members = [c(**{k: v for k, v in params.items() if k in {p.name for p in c.params}}) for c in classes]
    return Composed(members)


__all__ = [
    "ConfigError",
    "DecodeRead",
    "Needs",
    "Param",
    "Policy",
    "Refusal",
    "SitePlan",
    "POLICIES",
    "available",
    "make_policy",
]
