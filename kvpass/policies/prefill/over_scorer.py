"""``OverScorer``: the frame of a policy that builds on another's ranking (``criticalkv``, ``adakv``).

The base scorer is built from the policy's ``scorer`` name (one of the subclass's ``SCORERS``) with the policy's
``budget`` and ``window`` (``-1``: the scorer's own default) and the scorer's defaults otherwise (a subclass's
``SCORER_DEFAULTS`` may set some); its plan is honoured (its refusals, the inputs its ranking reads), and its
configuration and source are part of the policy's identity (``uuid``).
"""

from __future__ import annotations

import hashlib
import inspect
from typing import ClassVar

from kvpass.policies.contract import ConfigError, Refusal, SitePlan, param
from kvpass.policies.prefill.base import PrefillEviction


class OverScorer(PrefillEviction):
    SCORERS: ClassVar[dict] = {}           # name -> PrefillEviction class whose ranking the policy reads
    SCORER_DEFAULTS: ClassVar[dict] = {}   # name -> parameters the policy builds that scorer with
    window: int = param(-1, -1, 1 << 16, "the scorer's window: last prompt tokens always kept (-1: the scorer's "
                        "default)")

    def check_config(self) -> None:
        if self.scorer not in self.SCORERS:
            raise ConfigError(f"policy '{self.name}': parameter 'scorer' must be one of {', '.join(self.SCORERS)}, "
                              f"got {self.scorer!r}")
        params = {"budget": self.budget, **({"window": self.window} if self.window >= 0 else {}),
                  **self.SCORER_DEFAULTS.get(self.scorer, {})}
        try:
            self.base = self.SCORERS[self.scorer](**params)
        except ConfigError as err:
            raise ConfigError(f"policy '{self.name}' with scorer '{self.scorer}': {err}") from None

    def plan(self, site) -> SitePlan | Refusal:
        """The base scorer's plan (a refusal or a plan that does not evict is passed on as it is)."""
        plan = self.base.plan(site)
        return Refusal(plan) if isinstance(plan, str) else plan

    def uuid(self) -> str:
        """Hash of the configuration, this class's source and the base scorer's."""
        src = inspect.getsource(type(self))
        return hashlib.sha256((self.key() + src + self.base.uuid()).encode()).hexdigest()
