"""``ScoredEviction``: the frame of the decode-time policies that keep ``budget`` entries per KV head by a
score each entry carries, and give up one victim per decode step (h2o).

**Score.** The attention an entry receives (``received``: summed over the query heads of its KV group), added
to what it had over every query that saw it (``accumulate``: h2o), or the latest query's alone (TOVA). With
``shared`` the score is the mean over the layer's KV heads, so every head of a layer gives up the same token.

**When.** A prompt longer than the budget is cut at prefill: the ``recent`` latest tokens, then the highest
scores (``scoring.keep_top``). Each decode step adds its token and its attention; a layer holding
``budget + 1`` entries gives up its ``victim``: left padding first, then the lowest score outside the
``recent`` latest tokens, the later entry on a tie. ``budget >= prompt + new tokens`` never evicts: equal to
``full``. Sliding-window layers are left to the model.

**Both caches run these functions.** On a DynamicCache ``select`` scores the stored entries and the new
token and drops the victim at once (the scores are the layer's bookkeeping beside the stored positions). On
a ``kvpass.SlotCache`` the layer holds ``budget + 1`` slots and a ``score`` tensor; in the decode graph
``slot_victim`` picks the slot of the next token (a free one, else the victim) and ``slot_score`` folds in
the step's attention. The victim leaves one step later there, chosen from the same scores: both caches keep
the same entries.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from kvpass.cache.slots import FILLED, next_positions
from kvpass.policies.contract import Needs, Policy, Refusal, SitePlan, SlotHooks, param, shrinking_plan
from kvpass.policies.prefill.scoring import keep_top, window_layout


def received(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, softcap: float, lse: Tensor | None = None) -> Tensor:
    """``[B, H_kv, N]`` fp32: the attention every key receives from the queries ``q [B, H, L, D]`` (scale
    folded in), causal by true position, summed over the queries and the query heads of each KV group. One
    query: ``kvpass::window_scores``; several: ``kvpass::accumulated_scores``, which on CUDA never holds the
    ``[H, L, N]`` scores (one pass given the prefill attention's row log-sum-exp ``lse``, else two)."""
    if q.shape[2] == 1 and lse is None:
        return torch.ops.kvpass.window_scores(q, k, kv_pos, q_pos, 1.0, float(softcap))
    return torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, 1.0, float(softcap), lse)


def across(score: Tensor, shared: bool) -> Tensor:
    """``score [B, H_kv, N]`` as a decision reads it: per KV head, or with ``shared`` the mean over the layer's KV
    heads (every decision then the same for every head, entry ``j`` holds the same token in each)."""
    return score.mean(1, keepdim=True).expand_as(score) if shared else score


def victim(pos: Tensor, score: Tensor, nxt: Tensor, recent: int) -> Tensor:
    """``[B, H_kv, 1]``: the entry a full layer gives up before the token at position ``nxt [B, 1, 1]``:
    padding first, then the lowest score outside the ``recent`` latest tokens, the latest such on a tie."""
    held = pos.long()
    old = (held >= 0) & (held < nxt - recent)
    rank = torch.where(held < 0, float("-inf"), torch.where(old, score, float("inf")))
    tied = rank == rank.amin(-1, keepdim=True)
    return torch.where(tied, held, torch.iinfo(torch.int64).min).argmax(-1, keepdim=True)


def slot_victim(pos, count, state: list, softcap: float, recent: int, accumulate: bool, shared: bool):
    """Before a decode step's write on a SlotCache: the slot ``[B, H_kv, 1]`` of the new token, a free one
    while the layer has one, else the ``victim`` (its score starts again from zero)."""
    (score,) = state
    filled = count[:, FILLED, None, None]
    gone = victim(pos, score, next_positions(count, 1)[:, :, None], recent)
    slot = torch.where(filled < pos.shape[-1], filled.expand_as(gone), gone)
    score.scatter_(-1, slot, 0.0)
    return slot


def slot_score(
    q, keys, pos, count, state: list, k_new, softcap: float, recent: int, accumulate: bool, shared: bool
) -> None:
    """After a decode step's write on a SlotCache: fold the attention the step's token gave every slot into
    its score."""
    (score,) = state
    now = across(received(q, keys, pos.long(), next_positions(count, 1) - 1, softcap), shared)
    if accumulate:
        score.add_(now)
    else:
        score.copy_(now)


class ScoredEviction(Policy):
    """Base class: planning, the DynamicCache selection and the SlotCache state and hooks. A subclass sets
    ``name``, ``summary``, ``accumulate``, ``shared`` and, when some latest tokens always stay, ``recent``."""

    needs = Needs(evicts=True, slot_rule="placed")
    accumulate: ClassVar[bool] = True
    shared: ClassVar[bool] = False
    budget: int = param(2048, 2, 1 << 24, "entries kept per layer and KV head")

    @property
    def recent(self) -> int:
        return 1  # the token being decoded stays

    def plan(self, site) -> SitePlan | Refusal:
        if site.cache == "slot" and site.phase not in ("prefill", "decode") and not site.sliding_window:
            return Refusal(
                f"layer {site.layer}: {self.name} on a SlotCache runs prefills and one-token decode "
                f"steps; this '{site.phase}' graph appends several tokens to a filled cache"
            )
        plan = shrinking_plan(site)
        # a plainly causal prefill's attention hands its row log-sum-exp to the scoring of every query
        return (
            dataclasses.replace(plan, lse=True)
            if isinstance(plan, SitePlan) and plan.evict and self.accumulate
            else plan
        )

    def stored_length(self, site, total):
        return torch.sym_min(total, self.budget)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, lse=None):
        n, new = kv_pos.shape[-1], q_pos.shape[1]
        if not self.accumulate:  # the latest query's attention alone
            q, q_pos, lse = q[:, :, -1:], q_pos[:, -1:], None
        score = across(received(q, k, kv_pos, q_pos, site.softcap, lse), self.shared)
        if n > new:  # entries stored before this call carry their scores
            old = layer_state.extra.get("score") if layer_state is not None else None
            if old is None or old.shape[-1] != n - new:
                raise RuntimeError(
                    f"policy '{self.name}': the cache holds entries without scores (it was not "
                    f"filled by this backend's {self.name}); start a new cache"
                )
            if self.accumulate:
                score = torch.cat([score[..., : n - new] + old, score[..., n - new :]], -1)
        if n <= self.budget:
            return None, {"score": score}
        if new == 1 and n == self.budget + 1:  # a decode step on a full layer: its victim goes
            gone = victim(kv_pos, score, q_pos[:, :, None] + 1, self.recent)
            keep = torch.arange(n - 1, device=score.device).expand(*score.shape[:2], n - 1)
            keep = keep + (keep >= gone)
        else:
            valid, recent = window_layout(kv_pos, self.recent)
            keep = keep_top(score, recent, valid, self.budget)
        return keep, {"score": score.gather(-1, keep)}

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        return min(max_length, self.budget + 1)  # the kept entries and the token being decoded

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return {"score": ((capacity,), torch.float32, 0.0)}

    def slot_hooks(self, site) -> SlotHooks | None:
        if site.sliding_window:
            return None
        return SlotHooks(
            place=slot_victim, update=slot_score, args=(float(site.softcap), self.recent, self.accumulate, self.shared)
        )
