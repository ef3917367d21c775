"""``streamingllm``: attention sinks plus a recent window (Xiao et al., 2023).

After every forward call, each global attention layer keeps the first ``sinks`` real tokens of
each sequence and the most recent ``budget - sinks`` entries; everything else is dropped from the
cache, so the stored tensors are at most ``budget`` long. Prefill attends over the whole prompt;
later tokens attend over what is kept plus themselves. Sliding-window layers are already bounded
by their window and are left to the model.

It is the foundation's proof policy: real eviction (the stored tensors shrink), exact RoPE
positions after eviction, and a mask built from the kept entries' true positions.
"""

from __future__ import annotations

import torch

from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, param, shrinking_plan


class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "keep `sinks` first tokens + a recent window, `budget` entries per layer"
    needs = Needs(evicts=True, slot_rule="ring")
    budget: int = param(2048, 2, 1 << 24, "entries kept per layer and KV head")
    sinks: int = param(4, 0, 1 << 20, "first tokens always kept (attention sinks)")

    def check_config(self) -> None:
        if self.sinks >= self.budget:
            raise ConfigError(
                f"policy 'streamingllm': parameter 'sinks' must be < budget ({self.budget}), "
                f"got {self.sinks}"
                + (" (its default); pass a smaller sinks or a larger budget" if self.sinks == 4 else "")
            )

    # on a SlotCache: the budget plus the slot of the token being decoded (a step attends over the kept
    # entries and itself, as on a DynamicCache), the sinks in the first slots, the rest a ring
    @property
    def slot_protect(self) -> int:
        return self.sinks

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        return min(max_length, self.budget + 1)

    def plan(self, site) -> SitePlan | Refusal:
        return shrinking_plan(site)

    def stored_length(self, site, total):
        return torch.sym_min(total, self.budget)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        length = kv_pos.shape[-1]
        if length <= self.budget:
            return None
        valid = kv_pos >= 0
        rank = valid.long().cumsum(-1) - 1  # rank among real tokens
        n_valid = valid.long().sum(-1, keepdim=True)
        recent = self.budget - self.sinks
        wanted = valid & ((rank < self.sinks) | (rank >= n_valid - recent))
        # priority: wanted first, then real tokens, then later entries; ties broken by index
        order = torch.arange(length, device=kv_pos.device)
        score = (wanted.long() * 2 + valid.long()) * (length + 1) + order
        keep = score.topk(self.budget, dim=-1).indices
        return keep.sort(dim=-1).values
