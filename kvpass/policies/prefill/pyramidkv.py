"""``pyramidkv``: SnapKV's scorer with a budget that shrinks with depth (Cai et al., 2024).

Lower layers attend broadly and keep more; upper layers attend to a few tokens and keep fewer.
Schedule (PyramidKV's linear one): over the ``n`` global attention layers of the model in graph
order, with ``c = budget - window`` candidate entries on average,

    c_min = max(1, c // steepness)        c_max = 2 c - c_min
    c_i   = c_min + floor((c_max - c_min) (n - 1 - i) / (n - 1))      (i = 0 .. n-1)

plus the rounding remainder, one entry each, on the first layers, so that ``sum_i c_i = n c``
exactly: the **mean** layer budget is ``budget`` (window included), the first layer keeps about
``2 budget``, the last ``window + c / steepness``. ``steepness`` 20 is PyramidKV's beta. A model with
one global layer keeps ``budget``. Sliding-window layers are not counted (left to the model).

As in PyramidKV's code, a prompt no longer than ``budget`` is kept whole in every layer (so
``budget >= prompt length`` equals ``full``); the schedule applies to longer prompts. Under
``dynamic=True`` this puts a guard on the prompt length at ``budget`` (one graph each side).

Scoring is SnapKV's (it is a ``SnapKV`` with a per-layer budget): window votes summed over the GQA group per
KV head, max-pooled.
"""

from __future__ import annotations

import torch

from kvpass.policies.contract import param
from kvpass.policies.prefill.snapkv import SnapKV


def pyramid(budget: int, window: int, n: int, steepness: int) -> list[int]:
    """Per-layer budgets (window included) of ``n`` layers, mean exactly ``budget``, non-increasing."""
    c = budget - window
    if n <= 1:
        return [budget] * n
    lo = max(1, c // steepness)
    hi = 2 * c - lo
    cand = [lo + (hi - lo) * (n - 1 - i) // (n - 1) for i in range(n)]
    for i in range(n * c - sum(cand)):
        cand[i] += 1
    return [window + x for x in cand]


class PyramidKV(SnapKV):
    name = "pyramidkv"
    summary = "SnapKV scoring, budgets decreasing linearly with depth (mean = budget)"
    steepness: int = param(20, 1, 1 << 20, "first/last layer budget ratio is about 2*steepness")

    def kept(self, site, total):
        if total <= self.budget:  # PyramidKV compresses only prompts longer than the budget
            return total
        return torch.sym_min(total, self.layer_budget(site))

    def slot_budget(self, layer: int, layers: int) -> int:
        # a prompt up to the budget is kept whole in every layer, a longer one cut to the layer's budget
        return max(self.budget, pyramid(self.budget, self.window, layers, self.steepness)[layer])

    def layer_budget(self, site) -> int:
        layers = site.global_layers or (site.layer,)
        budgets = pyramid(self.budget, self.window, len(layers), self.steepness)
        return budgets[layers.index(site.layer)] if site.layer in layers else self.budget
