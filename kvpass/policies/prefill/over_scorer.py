"""``OverScorer``: the frame of a policy that builds on another's ranking (``criticalkv``, ``adakv``).

The base scorer is built from the policy's ``scorer`` name (one of the subclass's ``SCORERS``) with the policy's
``budget`` and ``window`` (``-1``: the scorer's own default), the scorer's own parameters given after its name
(``"snapkv:kernel=5,pool=avg"``) and its defaults otherwise (a subclass's ``SCORER_DEFAULTS`` may set some); its
plan is honoured (its refusals, the inputs its ranking reads), and its configuration and source are part of the
policy's identity (``uuid``).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import ClassVar

from kvpass.policies.contract import ConfigError, Refusal, SitePlan, param
from kvpass.policies.prefill.base import PrefillEviction


def scorer_options(policy: str, cls, text: str) -> dict:
    """``"kernel=5,pool=avg"`` as the scorer class's parameters, each converted to its declared type (its range is
    checked when the scorer is built); budget and window are the policy's own."""
    kinds = {p.name: p.kind for p in cls.params}
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        own = [k for k in kinds if k not in ("budget", "window")]
        if not eq or key not in own:
            raise ConfigError(
                f"policy '{policy}': parameter 'scorer' sets '{item}'; the options after '{cls.name}:' "
                f"are name=value pairs of its parameters ({', '.join(own) or 'none'}); budget and "
                f"window are {policy}'s own"
            )
        kind, value = kinds[key], value.strip()
        try:
            out[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(value)
        except ValueError:
            raise ConfigError(
                f"policy '{policy}': parameter 'scorer' sets {key}={value!r}, which is not of type {kind.__name__}"
            ) from None
    return out


class OverScorer(PrefillEviction):
    SCORERS: ClassVar[dict] = {}  # name -> PrefillEviction class whose ranking the policy reads
    SCORER_DEFAULTS: ClassVar[dict] = {}  # name -> parameters the policy builds that scorer with
    window: int = param(
        -1, -1, 1 << 16, "the scorer's window: last prompt tokens always kept (-1: the scorer's default)"
    )

    def check_config(self) -> None:
        name, _, options = self.scorer.partition(":")
        if name not in self.SCORERS:
            raise ConfigError(
                f"policy '{self.name}': parameter 'scorer' must be one of {', '.join(self.SCORERS)}, "
                f"optionally with the scorer's own parameters ('snapkv:kernel=5,pool=avg'), got "
                f"{self.scorer!r}"
            )
        cls = self.SCORERS[name]
        params = {
            "budget": self.budget,
            **({"window": self.window} if self.window >= 0 else {}),
            **self.SCORER_DEFAULTS.get(name, {}),
            **scorer_options(self.name, cls, options),
        }
        try:
            self.base = cls(**params)
        except ConfigError as err:
            raise ConfigError(
                f"kvpass: policy '{self.name}' with scorer '{self.scorer}': {str(err).removeprefix('kvpass: ')}"
            ) from None

    def plan(self, site) -> SitePlan | Refusal:
        """The base scorer's plan (a refusal or a plan that does not evict is passed on as it is)."""
        plan = self.base.plan(site)
        return Refusal(plan) if isinstance(plan, str) else plan

    def uuid(self) -> str:
        """Hash of the configuration, this class's source and the base scorer's."""
        src = inspect.getsource(type(self))
        return hashlib.sha256((self.key() + src + self.base.uuid()).encode()).hexdigest()
