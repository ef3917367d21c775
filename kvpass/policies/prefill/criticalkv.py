"""``criticalkv``: a scorer's choice, completed by each entry's effect on the attention output (Feng et al., 2025).

"Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective" bounds how much dropping an
entry perturbs the attention output by its attention weight times the norm of its value *after the output
projection*, ``W_o^h v_j``: a value that the projection shrinks matters less than its attention says. The selection
runs in two stages on a base scorer's scores (``scorer``):

1. the base scorer scores every prompt entry per layer and **KV head**; its forced entries (the observation window,
   ``expected_attention``'s sinks) and its best entries, ``first_stage_ratio`` of the entries kept in all
   (``int(first_stage_ratio * kept)``, at least one when the ratio is above 0, forced entries counted), are kept
   whatever follows;
2. every other entry's score becomes ``(score + epsilon) * ||W_o v_j||_1`` (``epsilon`` on the scale of a score
   averaged over the queries and query heads that cast it: snapkv's summed window votes add ``epsilon`` times their
   window and group size, ``PrefillEviction.score_scale``): per query head ``h`` of the KV group,
   the value ``v_j [Dv]`` times the head's slice of the layer's output projection, ``W_o[:, h Dv:(h+1) Dv]``, a
   hidden-size vector whose L1 norm is averaged over the group's heads; the rest of the budget goes to the highest.

Each layer and KV head keeps ``budget`` entries, in their original order, ties to the earlier entry, left padding
last. A prompt no longer than ``budget`` is kept whole, which equals ``full``. Decode steps append
(``kvpass.policies.prefill.base``).

Parameters: ``scorer`` (``"snapkv"``; also ``"expected_attention"``, ``"knorm"``, ``"keydiff"``, each optionally with
its own parameters, ``"snapkv:kernel=5,pool=avg"``): the base scorer, built with this policy's ``budget`` and
``window`` (``-1``, the default, leaves the scorer's own: 32 for snapkv, 0
for the others) and its own defaults for every other parameter (snapkv's pooling kernel 7, expected_attention's 4
sinks and 512 future positions), except that ``expected_attention`` runs without its value-norm weighting
(``use_vnorm=False``, as kvpress advises: stage 2 weighs the values itself). The base's plan is honoured
(expected_attention's queries before RoPE, or its refusal). ``budget`` (2048, 2..2^24; entries kept per layer and
KV head, the base's forced entries included), ``first_stage_ratio`` (0.5, 0..1: 1 keeps the base's choice, 0
ranks every unforced entry by stage 2), ``epsilon`` (1e-4, >= 0).

**The output projection, read off the graph.** The pass follows each attention output through the heads'
transpose, the reshape to ``[..., H * Dv]`` and casts to the ``linear`` (``addmm``, ``matmul``) that reads it, and
hands ``select`` that projection's weight as the graph reads it (``kvpass.compiler.detect.out_projection``): no
model-name branch and no module lookup. A site whose output reaches anything else first (a gate, a norm, another
reshape of the heads) is refused, and the graph is compiled unchanged with the reason. Under tensor parallelism the
graph reads each rank's own shard of the row-parallel projection, the columns of its local heads (checked: the
weight has the rank's ``H * Dv`` columns), so a rank decides for its KV heads what one device decides, with no
collective; a DTensor weight in the graph is refused.

**Against kvpress 0.5.5's ``CriticalKVPress``.** The same two stages, projected L1 norms, group mean, ``epsilon``
(on kvpress's averaged scores: with snapkv, kvpress's score is kvpass's divided by window x group, so kvpass adds
``epsilon`` times that factor) and first-stage share, with these differences: kvpass counts kept entries
(``budget``) where kvpress drops a ``compression_ratio`` of each prompt (the stage-1 share is of the entries kept in
both); the base scorer's forced entries are kept outright, where kvpress's SnapKV gives its window the highest score
(so it leads stage 1 there too); the scorers are kvpass's (``docs/policies/snapkv.md`` and the others say how they
differ from kvpress's); kvpress applies the product to a signed score as well (knorm's minus key norm, keydiff's
minus cosine), and so does kvpass, so a larger projected value lowers such an entry; the weight is the graph's
(Qwen2's or GPT-2's layouts alike, where kvpress reads ``module.o_proj``); padding is handled. Computation: scores,
projections and norms in fp32, every query head at once over as many tokens as keep the projection's temporary
within 128 MiB.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvpass.policies.contract import Refusal, SitePlan, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.expected_attention import ExpectedAttention
from kvpass.policies.prefill.keydiff import KeyDiff
from kvpass.policies.prefill.knorm import KNorm
from kvpass.policies.prefill.over_scorer import OverScorer
from kvpass.policies.prefill.snapkv import SnapKV

PROJECTED = 1 << 25  # elements of the [B, H, tokens, hidden] fp32 projection computed at a time (128 MiB)


def projected_norms(v: Tensor, weight: Tensor, heads: int) -> Tensor:
    """``[B, H_kv, N]`` fp32: per entry, the L1 norm of its value ``v [B, H_kv, N, Dv]`` projected by each query
    head's columns of the output projection ``weight [hidden, heads * Dv]``, averaged over the heads of its KV group
    (query head ``h`` reads KV head ``h // (heads / H_kv)``). Every head at once, a slice of tokens at a time."""
    b, hkv, n, dv = v.shape
    hidden, group = weight.shape[0], heads // hkv
    w = weight.t().reshape(heads, dv, hidden).float()  # head h's [Dv, hidden]
    kv_of = torch.arange(heads, device=v.device) // group
    step = max(1, PROJECTED // (b * heads * hidden))
    parts = []
    for i in range(0, n, step):
        x = v[:, :, i : i + step].float().index_select(1, kv_of) @ w  # [B, H, tokens, hidden]
        parts.append(torch.linalg.vector_norm(x, ord=1, dim=-1))
    return torch.cat(parts, -1).view(b, hkv, group, n).mean(2)


class CriticalKV(OverScorer):
    name = "criticalkv"
    summary = "a scorer's best entries, the rest by score times the value's norm through the output projection"
    SCORERS = {cls.name: cls for cls in (SnapKV, ExpectedAttention, KNorm, KeyDiff)}
    SCORER_DEFAULTS = {"expected_attention": {"use_vnorm": False}}  # stage 2 weighs the values (kvpress's advice)
    scorer: str = param(
        "snapkv",
        doc="base scorer: 'snapkv', 'expected_attention', 'knorm' or 'keydiff' (built "
        "with budget and window, its own defaults otherwise)",
    )
    first_stage_ratio: float = param(0.5, 0.0, 1.0, "share of the kept entries chosen by the scorer alone")
    epsilon: float = param(1e-4, 0.0, None, "added to the scorer's score before the projected value norm weighs it")

    def plan(self, site) -> SitePlan | Refusal:
        plan = super().plan(site)
        if not isinstance(plan, SitePlan) or not plan.evict:
            return plan
        if site.o_proj.problem:
            return Refusal(
                f"layer {site.layer}: criticalkv weighs values by the layer's output projection, and "
                f"{site.o_proj.problem}"
            )
        return dataclasses.replace(plan, out_proj=True)

    def ranking(self, site, q, k, v, kv_pos, q_pos, keep, out_proj=None, **inputs):
        """Stage 1's choice forced, every other entry ranked by stage 2's product."""
        heads = q.shape[1]
        if out_proj is None or out_proj.dim() != 2 or out_proj.shape[1] != heads * v.shape[-1]:
            got = "none" if out_proj is None else f"a weight of shape {tuple(out_proj.shape)}"
            raise RuntimeError(
                f"policy '{self.name}': layer {site.layer}'s selection needs the output projection's "
                f"weight [hidden, {heads} * {v.shape[-1]}], got {got}"
            )
        score, forced, valid = self.base.ranking(site, q, k, v, kv_pos, q_pos, keep, **inputs)
        first = max(1, int(self.first_stage_ratio * keep)) if self.first_stage_ratio > 0 else 0
        chosen = torch.zeros_like(valid)
        if first:
            chosen.scatter_(-1, scoring.keep_top(score, forced, valid, min(first, kv_pos.shape[-1])), True)
        second = (score.float() + self.epsilon * self.base.score_scale(q, k)) * projected_norms(v, out_proj, heads)
        return second, forced | (chosen & valid), valid
