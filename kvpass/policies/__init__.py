"""Policy registry: ``make_policy("a+b", **params)`` builds and validates a policy."""

from __future__ import annotations

from kvpass.policies.chunk_fusion.a3 import A3
from kvpass.policies.chunk_fusion.a3_evict import A3Evict
from kvpass.policies.art import ART
from kvpass.policies.gated.asl import ASL, ASL2Pass, ASLFullKV
from kvpass.policies.contract import ConfigError, DecodeRead, Needs, Param, Policy, SitePlan
from kvpass.policies.chunk_fusion.cacheblend import CacheBlend
from kvpass.policies.prefill.chunkkv import ChunkKV
from kvpass.policies.compose import Composed
from kvpass.policies.gated.fastkv import FastKV
from kvpass.policies.full import Full
from kvpass.policies.h2o import H2O
from kvpass.policies.gated.gemfilter import GemFilter
from kvpass.policies.chunk_fusion.full_reuse import FullReuse
from kvpass.policies.chunk_fusion.legolink import LegoLink
from kvpass.policies.chunk_fusion.pie import PIE
from kvpass.policies.prefill.pyramidkv import PyramidKV
from kvpass.policies.pages.quest import Quest
from kvpass.policies.pages.raas import RaaS
from kvpass.policies.prefill.sablock import SABlock
from kvpass.policies.prefill.snapkv import SnapKV
from kvpass.policies.streamingllm import StreamingLLM

# chunk fusion (kvpass.ChunkFusion drives these; their frame: kvpass/policies/chunk_fusion/base.py)
FUSION = (A3, A3Evict, PIE, FullReuse, CacheBlend, LegoLink)

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, StreamingLLM, ART, SnapKV, PyramidKV, ChunkKV,
                                                                SABlock, RaaS, Quest, ASL, ASLFullKV, FastKV, ASL2Pass,
                                                                GemFilter, H2O) + FUSION}

# Named on the roadmap, not implemented yet: asking for one is a clear error (none at present).
PLANNED: tuple[str, ...] = ()


def available() -> list[str]:
    return sorted(POLICIES)


def make_policy(spec: str | Policy, **params) -> Policy:
    """Build a policy from a name (``"full"``, ``"streamingllm"``, ``"a+b"``) and its parameters."""
    if isinstance(spec, Policy):
        if params:
            raise ConfigError("pass parameters to the Policy object itself, not to backend()")
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"policy must be a non-empty string such as 'full', got {spec!r}; "
                          f"known policies: {', '.join(available())}")
    if spec.strip() in POLICIES:  # a name that contains '+' itself (a3+evict) is one policy
        return POLICIES[spec.strip()](**params)
    names = [n.strip() for n in spec.split("+")]
    for n in names:
        if not n:
            raise ConfigError(f"policy '{spec}' has an empty name around '+'; write e.g. 'snapkv+art'")
        if n not in POLICIES:
            if n in PLANNED:
                raise ConfigError(f"policy '{n}' is planned but not implemented yet; "
                                  f"available policies: {', '.join(available())}")
            raise ConfigError(f"unknown policy '{n}'; known policies: {', '.join(available())}")
    classes = [POLICIES[n] for n in names]
    if len(classes) == 1:
        return classes[0](**params)
    declared = {p.name for c in classes for p in c.params}
    unknown = sorted(set(params) - declared)
    if unknown:
        raise ConfigError(f"policy '{spec}' has no parameter '{unknown[0]}'; its parameters are: "
                          f"{', '.join(sorted(declared)) or 'none'}")
    members = [c(**{k: v for k, v in params.items() if k in {p.name for p in c.params}}) for c in classes]
    return Composed(members)


__all__ = ["ConfigError", "DecodeRead", "Needs", "Param", "Policy", "SitePlan", "POLICIES", "PLANNED", "available", "make_policy"]
