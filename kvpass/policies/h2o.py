"""``h2o``: heavy hitters plus a recent window, by accumulated attention (Zhang et al., 2023, "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").

Every entry carries the attention it has received so far, summed over every query that saw it (the prompt's
at prefill, then each decode token's) and over the query heads of its KV group. A global layer keeps at most
``budget`` entries per KV head: the ``recent = budget - round(heavy * budget)`` latest tokens always, and of
the older ones the heavy hitters, those with the most attention. The paper's setting splits the cache evenly
between the two (its 10 % heavy + 10 % recent of the sequence), hence ``heavy=0.5``. Each decode step evicts
one entry, the paper's greedy rule. The machinery (prefill cut, victim, both caches) is
``kvpass.policies.scored``.
"""

from __future__ import annotations

from kvpass.policies.contract import ConfigError, param
from kvpass.policies.scored import ScoredEviction


class H2O(ScoredEviction):
    name = "h2o"
    summary = "heavy hitters by accumulated attention + a recent window, one eviction per decode step"
    budget: int = param(2048, 2, 1 << 24, "entries kept per layer and KV head (heavy hitters + recent)")
    heavy: float = param(0.5, 0.0, 0.99, "share of the budget for heavy hitters (the rest: recent tokens)")

    @property
    def recent(self) -> int:
        return self.budget - round(self.heavy * self.budget)

    def check_config(self) -> None:
        if self.recent < 1:
            raise ConfigError(
                f"policy 'h2o': parameter 'heavy' must leave at least one recent entry of the budget "
                f"({self.budget}), got {self.heavy}"
            )
