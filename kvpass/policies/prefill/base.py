"""``PrefillEviction``: the frame shared by the policies that compress the prompt's cache once.

**Budget.** ``budget`` is the total number of entries each global attention layer keeps per KV head
after prefill, the observation window included (the same unit as ``streamingllm``'s budget, so
policies compare at equal memory). It must exceed ``window``. A prompt no longer than the budget is
kept whole, which makes ``budget >= prompt length`` identical to ``full``. PyramidKV overrides
``layer_budget`` to give each layer its own.

**When.** Eviction happens at prefill only (the first call on an empty cache). Decode and append
calls append to what was kept; their graphs are still planned as evicting (``cache_update`` +
``attention_pos`` + ``compact``) so that masks come from the kept entries' true positions and
positions derived from the shortened cache are corrected (``kvpass.compiler.rewrite``).

**What.** Subclasses implement ``priority``: a score per candidate (real, non-window entries); the
window and then the highest priorities are kept (``scoring.keep_top``). ``ranking`` hands out the three
(priority, forced entries, real entries), which a scorer with entries of its own to force overrides
(``expected_attention``'s sinks) and a policy that reranks a scorer's choice reads
(``criticalkv``). A scorer that reads no
window votes (``knorm``, ``keydiff``) may declare ``window`` from 0: no token is then kept for its
position alone. Left padding is never kept over a real token. Sliding-window layers are bounded
by their window and left to the model, as ``streamingllm`` does.
"""

from __future__ import annotations

import torch

from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, param, shrinking_plan
from kvpass.policies.prefill import scoring


class PrefillEviction(Policy):
    """Base class: budget/window checks, planning, the shape contract and the selection frame."""

    # on a SlotCache: the kept prompt, then every decoded token in the next free slot; decode steps append
    needs = Needs(evicts=True, decode_appends=True, slot_rule="append")
    budget: int = param(
        2048, 2, 1 << 24, "entries kept per layer and KV head after prefill, observation window included"
    )
    window: int = param(32, 1, 1 << 16, "observation window: last prompt tokens, always kept")

    def check_config(self) -> None:
        if self.budget <= self.window:
            raise ConfigError(
                f"policy '{self.name}': parameter 'budget' must be > window ({self.window}), got "
                f"{self.budget}; the budget includes the window (the last {self.window} prompt tokens, always "
                f"kept), so pass a larger budget or a smaller window"
            )

    def plan(self, site) -> SitePlan | Refusal:
        return shrinking_plan(site)

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        return min(max_length, self.slot_budget(layer, layers) + max_new_tokens)

    def slot_budget(self, layer: int, layers: int) -> int:
        """The most entries layer ``layer`` of ``layers`` keeps from any prompt."""
        return self.budget

    def layer_budget(self, site) -> int:
        """Entries this site keeps after a prefill longer than it."""
        return self.budget

    def kept(self, site, total):
        """Entries this site keeps from a ``total``-entry prompt (SymInt-safe)."""
        return torch.sym_min(total, self.layer_budget(site))

    def stored_length(self, site, total):
        if site.phase != "prefill":
            return total  # decode / append: nothing is evicted
        return self.kept(site, total)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, **inputs):
        n = kv_pos.shape[-1]
        keep = self.kept(site, n)
        if n != q_pos.shape[1] or n <= keep:  # not a prefill, or nothing to evict
            return None
        return scoring.keep_top(*self.ranking(site, q, k, v, kv_pos, q_pos, keep, **inputs), keep)

    def ranking(self, site, q, k, v, kv_pos, q_pos, keep, tokens=None, votes=None):
        """``(priority, forced, valid)`` ``[B, H_kv, N]`` of a prefill that keeps ``keep`` entries: the score of each
        entry (higher = kept first; read on candidates only), the entries kept whatever their score (the window) and
        the real ones (left padding is not). ``select``'s optional inputs arrive as keywords."""
        valid, forced = scoring.window_layout(kv_pos, self.window)
        extra = {} if votes is None else {"votes": votes}  # a plan with layer_votes (chunkkv)
        priority = self.priority(site, q, k, kv_pos, q_pos, valid & ~forced, keep - self.window, tokens, **extra)
        return priority, forced, valid

    def score_scale(self, q, k) -> int:
        """How many attention weights one of this scorer's scores adds up: the factor between its scores and the
        same scores averaged over the queries and query heads that cast them (1 for a scorer whose scores are such
        an average, or no attention at all). ``criticalkv`` adds its ``epsilon`` on the averaged scale."""
        return 1

    def check_kernel(self) -> None:
        """The pooling kernel of a policy that pools window votes (``kernel`` field) must be odd."""
        if self.kernel % 2 == 0:
            raise ConfigError(
                f"policy '{self.name}': parameter 'kernel' must be an odd int in [1, 1025], got {self.kernel}"
            )

    def pooled_votes(self, site, q, k, kv_pos, q_pos, cand, mode: str):
        """SnapKV's priority: the window's votes (``scoring.window_scores``), pooled over the candidates."""
        return scoring.pool(scoring.window_scores(site, q, k, kv_pos, q_pos, self.window), cand, self.kernel, mode)

    def priority(self, site, q, k, kv_pos, q_pos, cand, quota, tokens):
        """Score ``[B, H_kv, N]`` of every candidate (higher = kept first); ``quota`` candidates are
        kept in rows long enough to evict."""
        raise NotImplementedError
