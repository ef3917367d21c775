"""The frame of the gated policies (``asl``, ``fastkv``, ``gemfilter``): ``GatedSelection`` and its scoring helpers.

A gated policy declares where its gate may fire and whether it fires (the ``GatedPolicy`` protocol of
``kvpass.policies.contract``: ``gate_layers``, ``gate_fires``, ``gate_select``); ``kvpass.compiler.gate`` splits
the prefill graph at those layers and runs it as segments. The layers up to the selection layer keep a
SnapKV-compressed cache (window votes, average-pooled); a sliding-window layer keeps its last ``W - 1`` entries.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvpass.errors import ConfigError
from kvpass.policies.contract import Needs, Refusal, SitePlan, forced_layer_problem, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.base import PrefillEviction


def pooled(scores: Tensor, kv_pos: Tensor, window: int, kernel: int) -> Tensor:
    """Candidates' pooled scores ``[B, N]``; the window and padding get -inf (they rank last)."""
    valid, forced = scoring.window_layout(kv_pos, window)
    cand = valid & ~forced
    return scoring.pool(scores, cand, kernel, "avg").masked_fill(~cand, float("-inf"))


def last_entries(kv_pos: Tensor, keep: int) -> Tensor | None:
    """Indices ``[B, H_kv, keep]`` of the last ``keep`` entries (what HF's sliding layer stores), or None
    when there are no more than that."""
    n = kv_pos.shape[-1]
    if n <= keep:
        return None
    return torch.arange(n - keep, n, device=kv_pos.device).expand(*kv_pos.shape[:2], keep)


def ranks(priority: Tensor) -> Tensor:
    """Rank ``[B, N]`` of every entry, 1 = highest priority, ties to the earlier entry."""
    order = torch.sort(priority, dim=-1, descending=True, stable=True).indices
    r = torch.empty_like(order)
    r.scatter_(-1, order, torch.arange(1, priority.shape[-1] + 1, device=priority.device).expand_as(order))
    return r


def rank_variance(layer_ranks: list[Tensor], top: int) -> Tensor:
    """Mean over the union U of each layer's top-``top`` tokens of the population variance of each
    token's rank across the layers; ``layer_ranks`` holds ``[B, N]`` ranks per layer -> ``[B]``."""
    r = torch.stack(layer_ranks).double()  # [T, B, N]
    in_u = (r <= top).any(0)
    var = r.var(0, unbiased=False)
    return (var * in_u).sum(-1) / in_u.sum(-1).clamp_min(1)


class GatedSelection(PrefillEviction):
    """The frame of the gated policies (asl, fastkv, gemfilter): the gate's token choice, the compressed cache
    of the layers up to the selection layer, planning. A subclass says where the gate may fire
    (``gate_layers``) and whether it fires (``gate_fires``)."""

    kernel: int = param(7, 1, 1025, "average-pooling kernel over token scores (odd; 1 = none)")
    layer: int = param(-1, -1, 1 << 16, "force the selection layer (-1: the policy's rule)")
    needs = Needs(evicts=True, decode_appends=True, gates=True, slot_rule="append")
    compress: ClassVar[bool] = True  # layers up to the selection layer keep a SnapKV-compressed cache

    def check_config(self) -> None:
        super().check_config()
        self.check_kernel()

    def check_model(self, config) -> None:
        """A forced selection layer (``layer``) must leave a layer after it: refused here where the model is known,
        not left to the first compile (where the graph would compile unchanged, warned, and the policy do nothing)."""
        super().check_model(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n = getattr(text, "num_hidden_layers", None)
        if isinstance(n, int) and (problem := forced_layer_problem(self, n)):
            raise ConfigError(f"kvpass: policy '{self.name}': {problem}; pass layer=-1 or a layer below {n - 1}")

    # -- compile time ----------------------------------------------------------------------------
    def plan(self, site) -> SitePlan | Refusal:
        if site.cache not in ("dynamic", "slot"):
            return Refusal(
                f"layer {site.layer}: {self.name} needs a cache that can shrink (DynamicCache) or "
                f"a kvpass.SlotCache; this graph uses a {site.cache} cache"
            )
        return SitePlan(attention=True, evict=True)  # sliding layers too: see "Sliding-window layers"

    def gate_layers(self, n_layers: int) -> tuple[list[int], list[int]]:
        """(layers whose scores are recorded, layers after which the gate may fire)."""
        raise NotImplementedError

    def gate_fires(self, layer: int, history: dict, keep: int, ctx: dict) -> bool:
        """Whether the gate fires after ``layer`` (``history``: the scores recorded so far)."""
        raise NotImplementedError

    def gate_select(self, scores: Tensor, keep: int, ctx: dict) -> Tensor:
        """Ascending token indices ``[B, keep]``: the window plus the best pooled candidates."""
        kv_pos = ctx["kv_pos"]
        valid, forced = scoring.window_layout(kv_pos, self.window)
        return scoring.keep_top(pooled(scores, kv_pos, self.window, self.kernel), forced, valid, keep)

    # -- run time: the cache of the layers up to the selection layer -----------------------------
    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, tokens=None):
        if site.sliding_window:
            return last_entries(kv_pos, site.sliding_window - 1)
        return super().select(site, q, k, v, kv_pos, q_pos, layer_state, tokens=tokens) if self.compress else None

    def stored_length(self, site, total):
        if site.sliding_window:
            return torch.sym_min(total, site.sliding_window - 1)
        return super().stored_length(site, total) if self.compress else total

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        return self.pooled_votes(site, q, k, kv_pos, q_pos, cand, "avg")
