"""``sablock``: semantic-aware eviction with an adaptive block size (seed paper: SABlock).

At prefill, per layer and KV head, the prompt before the observation window (``window`` = 32 last
tokens, always kept) is compressed to ``budget - window`` entries (``budget`` counts the window, as
for every prefill policy, see ``kvpass.policies.prefill.base``):

1. **Token scores** ``s_j``: window attention to token ``j``, summed over the window queries, mean
   over the query heads of the KV group (``kvpass::window_scores``). ``sum_j s_j <= window``.
2. **Segments**: the candidates are cut after every punctuation token (``.``, ``,``, ``;``, ``:``,
   ``!``, ``?``, newline and their CJK forms; ids from the tokenizer, ``kvpass.policies.prefill.punctuation``).
3. **Segment weight** of a segment ``S`` of ``n`` tokens::

       importance  I_S = mean_{j in S} s_j / max_{S'} mean_{j in S'} s_j           in [0, 1]
       p_j         = (1 - epsilon) s_j / sum_S s + epsilon / n                     (uniform if sum_S s = 0)
       diversity   D_S = exp(-sum_j p_j log p_j) / n                               in (0, 1]
       weight      w_S = lam I_S + (1 - lam) D_S                                   in [0, 1]

   ``D_S`` is the perplexity of the segment's score distribution over its length: the share of its
   tokens that carry its attention (1: spread evenly, a phrase the window reads as a whole; 1/n:
   one token). ``I_S`` is relative to the layer-head's best segment, so ``w`` is scale-free.
4. **Adjusted scores** ``s'_j = s_j + beta w_S m_S`` with ``m_S`` the segment's mean score: every
   token is credited with a share ``beta w_S`` of its segment's average attention. The lift is the
   same for all tokens of a segment, so their order never changes. The global top
   ``budget - window`` of ``s'`` gives each segment its quota ``b_S`` (how many of its tokens survive).
5. **Block search** per segment, for sizes 9, 7, 5, 3, 1 in turn, skipping sizes above ``b_S`` (a
   block larger than the quota cannot be kept whole): cut the segment into blocks of that size
   from its first token, take the blocks with the highest score sums until ``b_S`` tokens are
   covered, trim the last block to its best tokens. Accept the first size whose kept score is at
   least ``theta`` times the score of the segment's token-level top ``b_S``; size 1 is the
   token-level top ``b_S`` itself, so a size is always found and every quota is met exactly.

The paper's formulas and values were not available to us; these are the choices, and why:

* ``lam = 0.7``: importance is the signal that SnapKV-style eviction has shown to work, so it
  leads; diversity breaks ties between comparably important segments in favour of those whose
  attention is spread over the segment (a needle sentence whose digits all matter) over those with
  one hot token, which token-level top-k already keeps.
* ``beta = 1`` and an additive lift: a token of the most important segment (``w_S`` near 1) counts at
  least as much as an average token of that segment, so the function words and the digits of a
  sentence the window reads (a needle: "The pass key is 37909.") survive together, while a weak
  segment (small ``m_S`` and ``w_S``) is lifted by almost nothing. A multiplicative boost
  ``s_j (1 + beta w_S)`` was tried first and cannot do this: window attention is heavy-tailed, a token
  the window ignores stays ignored whatever the factor; on SmolLM2 NIAH 1k it kept no needle whole
  and scored 0/6 at budgets 96 and 160, against 2/6 and 3/6 for the additive lift (SnapKV: 0/6, 3/6).
  ``beta`` 2 and 4 scored the same as 1 there; 1 is the mildest that works.
* ``epsilon = 0.01``: mixes 1 % of the uniform distribution into each segment's scores: entropy is
  defined for zero scores (fp underflow, masked tokens), and negligible differences between tokens
  that receive almost no attention do not read as concentration. It changes ``D_S`` by a few
  percent at most for segments of up to a few hundred tokens.
* ``theta = 0.9``: a block may give up at most 10 % of the attention mass the token-level choice
  would keep. Larger blocks keep the neighbours of important tokens (local syntax, RoPE locality),
  which the scores cannot see but generation needs; 10 % is the price paid for that. With large
  quotas blocks cover the important tokens at almost no loss and size 9 wins; with small quotas a
  few blocks cannot reach scattered important tokens, and the search falls back to token-level
  selection (always below a quota of 3).
* block sizes 9, 7, 5, 3, 1: odd sizes centred like SnapKV's pooling kernel of 7,
  the largest a little above it.

The sensitivity of accuracy to ``lam``, ``beta`` and ``theta`` is in docs/policies/sablock.md and
``docs/sweeps/sablock_smollm2_cpu_1k/`` (``beta`` matters most; each default sits on a plateau).

Punctuation ids come from ``tokenizer=`` (a HF tokenizer; ``kvpass compare`` passes the model's) or
``punctuation_ids=`` (ints, or a comma-separated string from ``--param``). The graph must receive
token ids (``input_ids``); a model called with ``inputs_embeds`` is compiled unchanged, with a warning.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.policies.contract import ConfigError, Refusal, SitePlan, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.base import PrefillEviction
from kvpass.policies.prefill.punctuation import punctuation_ids

SIZES = (9, 7, 5, 3, 1)
HOW_TO_PASS = (
    "pass tokenizer=<the model's Hugging Face tokenizer> (kvpass.backend('sablock', tokenizer=tok); "
    "`kvpass compare` passes the model's own) or punctuation_ids=[int, ...] "
    "(--param punctuation_ids=13,30,...)"
)


def segments(cand: Tensor, punct: Tensor) -> Tensor:
    """Segment index of each candidate (0, 1, ... in position order, a segment ends with its
    punctuation token), -1 elsewhere."""
    p = (punct & cand).long()
    return torch.where(cand, p.cumsum(-1) - p, -1)


def segment_weights(x: Tensor, seg: Tensor, lam: float, epsilon: float) -> tuple[Tensor, Tensor]:
    """(``w_S``, mean score ``m_S``), each ``[R, N + 1]`` (last column: the non-candidates' dummy
    segment), for scores ``x [R, N]``."""
    r, n = x.shape
    cand = seg >= 0
    segd = torch.where(cand, seg, n)
    x = x.masked_fill(~cand, 0.0)
    cnt = torch.zeros(r, n + 1, dtype=x.dtype, device=x.device).scatter_add(1, segd, cand.to(x.dtype))
    tot = torch.zeros_like(cnt).scatter_add(1, segd, x)
    mean = tot / cnt.clamp_min(1)
    best = mean[:, :n].amax(1, keepdim=True)
    importance = mean / torch.where(best > 0, best, torch.ones_like(best))
    n_tok, t_tok = cnt.gather(1, segd).clamp_min(1), tot.gather(1, segd)
    share = torch.where(t_tok > 0, x / torch.where(t_tok > 0, t_tok, torch.ones_like(t_tok)), 1.0 / n_tok)
    p = (1.0 - epsilon) * share + epsilon / n_tok
    plogp = torch.where(cand & (p > 0), p * torch.log(p.clamp_min(1e-300)), torch.zeros_like(p))
    entropy = -torch.zeros_like(cnt).scatter_add(1, segd, plogp)
    diversity = torch.exp(entropy) / cnt.clamp_min(1)
    return lam * importance + (1.0 - lam) * diversity, mean


def segment_quota(adjusted: Tensor, seg: Tensor, quota: int) -> Tensor:
    """Tokens per segment ``[R, N]`` among the global top ``quota`` adjusted scores."""
    r, n = adjusted.shape
    cand = seg >= 0
    key = adjusted.masked_fill(~cand, float("-inf"))
    top = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :quota]
    sel = torch.zeros_like(cand).scatter(1, top, True) & cand
    segd = torch.where(cand, seg, n)
    return torch.zeros(r, n + 1, dtype=torch.long, device=seg.device).scatter_add(1, segd, sel.long())[:, :n]


def block_search(
    x: Tensor, seg: Tensor, quota_seg: Tensor, theta: float, sizes: tuple[int, ...] = SIZES
) -> tuple[Tensor, Tensor]:
    """(chosen [R, N] bool, accepted block size per segment [R, N]) by step 5 of the module docstring."""
    r, n = x.shape
    cand = seg >= 0
    segd = torch.where(cand, seg, n)
    x = x.masked_fill(~cand, 0.0)

    def covered(chosen: Tensor) -> Tensor:
        return torch.zeros(r, n + 1, dtype=x.dtype, device=x.device).scatter_add(1, segd, x * chosen)[:, :n]

    token_level = covered(scoring.block_fill(x, seg, 1, quota_seg))
    picks, accepted = [], []
    for size in sizes:
        chosen = scoring.block_fill(x, seg, size, quota_seg)
        ratio = torch.where(token_level > 0, covered(chosen) / torch.where(token_level > 0, token_level, 1.0), 1.0)
        picks.append(chosen)
        accepted.append((ratio >= theta) & ((quota_seg >= size) | (size == 1)))
    accepted.append(torch.ones_like(accepted[0]))  # never needed when 1 is among the sizes
    first = torch.stack(accepted).int().argmax(0).clamp(max=len(sizes) - 1)  # [R, N]: first accepted size
    stacked = torch.stack(picks)
    tok_pick = torch.cat([first, torch.zeros_like(first[:, :1])], 1).gather(1, segd)
    chosen = stacked.gather(0, tok_pick[None]).squeeze(0) & cand
    return chosen, torch.tensor(sizes, device=x.device)[first]


def choose(
    scores: Tensor,
    cand: Tensor,
    punct: Tensor,
    quota: int,
    lam: float,
    beta: float,
    epsilon: float,
    theta: float,
    sizes: tuple[int, ...] = SIZES,
) -> tuple[Tensor, dict]:
    """SABlock's selection for scores ``[..., N]``: (chosen candidates, details for inspection)."""
    shape = scores.shape
    x = scores.reshape(-1, shape[-1]).double()
    seg = segments(cand, punct.expand_as(cand)).reshape(x.shape)
    w, mean = segment_weights(x, seg, lam, epsilon)
    segd = torch.where(seg >= 0, seg, x.shape[-1])
    adjusted = x + beta * (w * mean).gather(1, segd)
    quota_seg = segment_quota(adjusted, seg, quota)
    chosen, size = block_search(x, seg, quota_seg, theta, sizes)
    info = {
        "segments": seg.reshape(shape),
        "weights": w,
        "adjusted": adjusted.reshape(shape),
        "quota": quota_seg,
        "size": size,
    }
    return chosen.reshape(shape), info


def _parse_ids(value) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]  # --param punctuation_ids=13
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    try:
        ids = [int(v) for v in value]
        if any(isinstance(v, (float, bool)) for v in value) or any(i < 0 for i in ids):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(
            f"policy 'sablock': parameter 'punctuation_ids' must be a list of ints >= 0 or a string "
            f"like '13,30', got {value!r}"
        ) from None
    return tuple(sorted(set(ids)))


class SABlock(PrefillEviction):
    name = "sablock"
    summary = "segments at punctuation, segment-weighted scores, adaptive block size per segment"
    lam: float = param(0.7, 0.0, 1.0, "segment weight: share of importance (rest: diversity)")
    beta: float = param(1.0, 0.0, 1e6, "tokens gain beta * w_S times their segment's mean score")
    epsilon: float = param(0.01, 0.0, 1.0, "uniform share mixed into a segment's score distribution")
    theta: float = param(0.9, 0.0, 1.0, "accept a block size keeping >= theta of the token-level score")
    tokenizer: object = param(None, doc="the model's HF tokenizer (punctuation ids are derived from it)")
    punctuation_ids: object = param(None, doc="explicit punctuation token ids (instead of a tokenizer)")

    def check_config(self) -> None:
        super().check_config()
        tok, ids = self.tokenizer, self.punctuation_ids
        if tok is None and ids is None:
            raise ConfigError(f"policy 'sablock' needs the model's punctuation token ids: {HOW_TO_PASS}")
        if ids is None:
            if not (hasattr(tok, "batch_decode") and hasattr(tok, "__len__")):
                raise ConfigError(
                    f"policy 'sablock': parameter 'tokenizer' must be a Hugging Face tokenizer "
                    f"(with batch_decode), got {type(tok).__name__}"
                )
            ids = punctuation_ids(tok)
        if tok is not None:  # explicit ids win; the config keeps a printable, hashable name
            self.tokenizer = getattr(tok, "name_or_path", "") or type(tok).__name__
        self.punctuation_ids = _parse_ids(ids)
        self._ids: dict = {}

    def plan(self, site) -> SitePlan | Refusal:
        plan = super().plan(site)
        if isinstance(plan, Refusal) or not plan.evict:
            return plan
        if site.tokens is None:
            return Refusal(
                f"layer {site.layer}: sablock segments the prompt at punctuation and needs its token ids, "
                "but this graph has no input_ids (call the model with input_ids, not inputs_embeds)"
            )
        return SitePlan(attention=True, evict=True, tokens=True)

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        if tokens is None or tokens.shape[-1] != kv_pos.shape[-1]:
            raise RuntimeError("kvpass sablock: the prefill's token ids did not reach compact")
        votes = scoring.window_scores(site, q, k, kv_pos, q_pos, self.window) / (q.shape[1] // k.shape[1])
        ids = self._ids.get(tokens.device)
        if ids is None:
            ids = self._ids[tokens.device] = torch.tensor(self.punctuation_ids, dtype=torch.long, device=tokens.device)
        punct = torch.isin(tokens, ids)[:, None, :]
        chosen, _ = choose(votes, cand, punct, quota, self.lam, self.beta, self.epsilon, self.theta)
        return chosen.float()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items() if k != "punctuation_ids")
        return f"SABlock({args}, punctuation_ids=<{len(self.punctuation_ids)} ids>)"
