"""The frame shared by every chunk-fusion policy: ``FusionRequest``, ``ChunkFusionPolicy`` and ``TopRatio``.

A request is ``[S, D1 .. Dk, Q]``: a system part, document chunks whose KV comes from a
``kvpass.ChunkStore`` (keys stored before RoPE) and a question. ``kvpass.ChunkFusion`` drives it;
these policies say which document tokens are recomputed and how the compiled graphs look.

How this maps onto kvpass (no mid-graph gate, see docs/ARCHITECTURE.md):

* **Selection pass** (a3, cacheblend): the model restricted to its first two layers runs all tokens
  of the request as an ordinary prefill (layer 0 fresh on all tokens, as in the paper); the
  layer-1 site is planned as an evicting site, so ``compact`` receives layer 1's queries and fresh
  keys, and ``select`` scores the tokens (keeping everything).
* **Recompute pass**: the full model runs only [Re, Q] with explicit true position ids over a
  DynamicCache that holds the merged, re-rotated chunk KV (one slot per position, question slots
  empty). Every site is planned ``overwrite``: ``cache_overwrite`` writes the new K/V into their
  slots and ``attention_pos`` masks by true positions. Layer 0 of the document tokens is not
  recomputed here: a layer-0 key or value depends only on its token and position, so the stored,
  re-rotated one *is* the fresh one.

Decode graphs append through the model's own cache update, with positions fixed from the records
``ChunkFusion`` writes after fusion (``a3+evict`` leaves fewer entries than tokens; for the others
the cache is an ordinary cache in position order and the fix is the identity). With
``ChunkFusion(..., cache="slot")`` the fused entries are then loaded into a ``kvpass.SlotCache`` and
decode is the SlotCache's append rule: one device-resident graph, capturable by CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, param

SELECT_LAYER = 1  # the layer whose attention (a3) or key deviation (cacheblend) picks Re


@dataclass
class FusionRequest:
    """What the policy knows about the request being fused (set by ``kvpass.ChunkFusion``)."""

    length: int  # tokens of the whole request (S, chunks, Q)
    question: int  # tokens of Q (the last ones)
    doc: Tensor  # [length] bool: document tokens (candidates for Re)
    chunk_starts: list[int]  # start position of every stored segment (S first when present)
    cached_keys: Tensor | None = None  # layer-1 keys of the merged cache [B, H_kv, L, D] (cacheblend)
    scores: Tensor | None = None  # [length] fp32 priority of each token, set by the selection pass
    info: dict = field(default_factory=dict)


class ChunkFusionPolicy(Policy):
    """Base of the chunk-fusion policies: planning, the selection hook and the recompute rule."""

    recover_positions: ClassVar[bool] = True  # rotate stored keys to their concatenated positions
    needs_probe: ClassVar[bool] = False  # run the two-layer selection pass first
    needs_votes: ClassVar[bool] = False  # evicts after fusion by the question's attention (a3+evict)
    collects_votes: ClassVar[bool] = False  # plans fusion_votes into recompute graphs (the shared router)
    drives_graphs: ClassVar[bool] = False  # the policy a ChunkFusion backend compiles (the shared router), not a
    #                                   user-facing fusion policy, whose plain forward is refused
    # decode graphs keep the model's cache update; positions come from the layers' records, which
    # ChunkFusion writes after every request (a3+evict's cache is shorter than the request)
    # on a kvpass.SlotCache (ChunkFusion(..., cache="slot") loads the fused entries into its slots):
    # decode and append graphs write the next free slot, in one device-resident graph
    needs = Needs(decode_appends=True, slot_rule="append", slot_prefill=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.request: FusionRequest | None = None

    def plan(self, site) -> SitePlan | Refusal:
        if not self.drives_graphs:  # a plain forward under a fusion name: ``select`` refuses it when it runs
            if site.cache in ("dynamic", "slot"):
                return SitePlan(attention=True, evict=True)
            return Refusal(
                f"'{self.name}' is a chunk-fusion policy: run requests through kvpass.ChunkFusion(model, "
                f"store, '{self.name}'); this graph uses a {site.cache} cache"
            )
        if site.sliding_window:
            return Refusal(
                f"layer {site.layer}: chunk fusion needs global attention layers; a sliding-window "
                f"layer (window {site.sliding_window}) cannot hold a merged cache"
            )
        if site.cache == "slot" and site.phase in ("decode", "append"):
            return SitePlan(attention=True)  # the fused entries are in the slots: decode appends
        if site.cache != "dynamic":
            return Refusal(
                f"layer {site.layer}: chunk fusion prepares a DynamicCache (a SlotCache is filled after "
                f"it by ChunkFusion(..., cache='slot')); this {site.phase} graph uses a {site.cache} cache"
            )
        if site.phase == "prefill":
            if self.needs_probe and site.layer == SELECT_LAYER:
                return SitePlan(attention=True, evict=True)  # compact sees layer 1's q and fresh k
            return SitePlan(attention=True)
        if site.phase == "decode":
            return SitePlan(attention=True, evict=True)  # append (Needs.decode_appends; kvpass.compiler.plan)
        return SitePlan(overwrite=True, votes=self.collects_votes)  # a recompute pass (kvpass.ChunkFusion)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        req = self.request
        if req is None:
            raise ConfigError(
                f"policy '{self.name}' is a chunk-fusion policy: run requests through "
                f"kvpass.ChunkFusion(model, store, '{self.name}'); a plain prefill has no stored "
                f"chunks to fuse"
            )
        if site.layer == SELECT_LAYER and kv_pos.shape[-1] == req.length:
            # every head's score (a split model: every rank's, kvpass.compiler.tp), summed over the heads
            per_head = self.score(site, q, k, kv_pos, q_pos, req)
            if site.tp is not None:
                per_head = site.tp.all_heads(per_head)
            req.scores = per_head.sum(dim=1)[0].float()[: req.length]
        return None  # the selection pass keeps everything

    def score(self, site, q, k, kv_pos, q_pos, req: FusionRequest) -> Tensor:
        """Priority ``[B, H_kv, L]`` of every token of the request per KV head of this device (the selection
        pass, layer 1); ``select`` sums it over all heads of the layer."""
        raise NotImplementedError

    def keep_after_fusion(self, votes: Tensor, req: FusionRequest) -> Tensor | None:
        """Ascending slots ``[B, H_kv, K]`` a layer keeps after fusion, from the question's votes
        ``[B, H_kv, L]`` over the merged cache's slots; None keeps everything."""
        return None

    def recompute(self, req: FusionRequest) -> Tensor:
        """Ascending positions of the document tokens to recompute (Re)."""
        return torch.zeros(0, dtype=torch.long)


class TopRatio(ChunkFusionPolicy):
    """Recompute the ``ratio`` share of the document tokens that the policy's ``score`` ranks highest, found by
    the two-layer selection pass (a3: the question's attention; cacheblend: the layer-1 key deviation)."""

    ratio: float = param(0.15, 0.0, 1.0, "share r of the document tokens recomputed")
    needs_probe = True

    def top_ratio(self, req: FusionRequest) -> Tensor:
        """The ``ceil(ratio * n)`` document tokens of highest ``req.scores`` (ties: earlier), ascending."""
        doc = req.doc.nonzero().reshape(-1)
        n = doc.numel()
        take = min(n, math.ceil(self.ratio * n - 1e-9))
        if take <= 0:
            return torch.zeros(0, dtype=torch.long)
        if take == n:
            return doc
        s = req.scores.cpu()[doc]
        order = torch.sort(-s, stable=True).indices[:take]
        return doc[order].sort().values

    def recompute(self, req: FusionRequest) -> Tensor:
        return self.top_ratio(req)
