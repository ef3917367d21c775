"""``duoattention``: retrieval heads keep everything, streaming heads their sinks and a recent window (Xiao et al.,
2024).

"DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads": few KV heads need the whole
context (retrieval heads); the others attend to the first tokens and the latest ones and lose little when they keep
only those (streaming heads). The paper learns a score per layer and KV head (a gate optimised on synthetic passkey
retrieval); the heads of lowest score become streaming heads.

**The pattern** (``pattern``): a text file of per-layer, per-KV-head scores, one line per layer of the model, its KV
heads' scores separated by tabs, spaces or commas: the DuoAttention repository's ``full_attention_heads.tsv``, or a
folder holding one. The ``streaming`` share of the model's KV heads with the lowest scores (over every layer, the
earlier (layer, head) on a tie) become streaming heads. A pattern for another model (other layer or KV head counts)
is a ``ConfigError`` from ``kvpass.compile`` and ``kvpass.SlotCache`` before anything compiles; a graph compiled
through ``kvpass.backend`` alone refuses it (compiled unchanged, with the reason). ``kvpass.duo_pattern(model)``
measures one on the user's own model (``kvpass.eval.duo_calibration``: the paper's synthetic passkey task, the
attention each head gives the passkey's first occurrence while the model reads its copy) and caches it.

**What each head keeps.** At prefill a retrieval head keeps the whole prompt; a streaming head its first ``sinks``
real tokens and its last ``recent`` ones. Decode steps append to a retrieval head; a streaming head keeps its
sinks and its ``recent`` latest positions between steps, and a step's query sees those and its own token (as
``streamingllm`` keeps its budget); in a call of several tokens the window counts back from the call's last one:

* on a ``kvpass.SlotCache`` (``kvpass.compile``'s cache) a streaming head owns ``sinks + recent + 1`` slots, a
  ring each step writes over its oldest non-sink entry; its memory is constant;
* on a ``DynamicCache`` every head's range grows one slot a step (the shape transformers' cache keeps: a layer's
  pool is stored as ``[B, H_kv, L, D]``) and a streaming head's entry that falls out of its window is emptied
  (position -1, never read), so its attention is the SlotCache's; its prompt entries past the window are freed.

Each layer stores its heads' kept entries in one pool per row (``kvpass.cache.ragged``), and each decode step reads
each head's own range (decode attention's ``kv_start``). Sliding-window layers are left to the model.

Parameters: ``pattern`` (a path, required), ``streaming`` (0.5, 0..1: 0 keeps every head whole, the no-op that
equals ``full``; 1 makes every head a streaming head, which is ``streamingllm`` with ``sinks`` and a budget of
``sinks + recent``), ``sinks`` (64, 0..2^16), ``recent`` (256, 1..2^24).

**Against kvpress 0.5.5's ``DuoAttentionPress``.** The same head split (``head_compression_ratio`` there, the lowest
scores over the whole model) and the same prefill rule; kvpress masks the streaming heads' dropped entries in its
attention patch and keeps their memory, and compresses the prefill only (its streaming heads see every decoded
token); kvpass frees them and keeps the window while decoding. kvpress fetches the patterns of six checkpoints from
the DuoAttention repository over the network; kvpass reads a file.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from kvpass.cache import ragged
from kvpass.policies.contract import ConfigError, Needs, Policy, Refusal, SitePlan, param, shrinking_plan
from kvpass.policies.prefill import scoring

PATTERN_FILE = "full_attention_heads.tsv"  # the DuoAttention repository's name, inside a pattern folder


def read_pattern(path: str) -> list[list[float]]:
    """Per layer, the KV heads' scores of a pattern file (or of a folder's ``full_attention_heads.tsv``)."""
    where = Path(path).expanduser()
    if where.is_dir():
        where = where / PATTERN_FILE
    fix = (
        "pass the path of a head pattern: a text file with one line per layer of the model and one score per KV "
        "head (tab, space or comma separated), such as the DuoAttention repository's full_attention_heads.tsv, or "
        "its folder"
    )
    if not where.is_file():
        raise ConfigError(
            f"policy 'duoattention': parameter 'pattern' names {str(where)!r}, which is not a file; {fix}"
        )
    rows = []
    for number, line in enumerate(where.read_text().splitlines(), 1):
        cells = line.replace(",", " ").split()
        if not cells:
            continue
        try:
            rows.append([float(c) for c in cells])
            if not all(math.isfinite(x) for x in rows[-1]):
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"policy 'duoattention': parameter 'pattern': line {number} of {str(where)!r} holds "
                f"something that is not a finite number ({line[:60]!r}); {fix}"
            ) from None
    if not rows or len({len(r) for r in rows}) != 1:
        raise ConfigError(
            f"policy 'duoattention': parameter 'pattern': {str(where)!r} needs the same number of "
            f"scores (one per KV head) on each of its lines (one per layer), got "
            f"{sorted({len(r) for r in rows})}; {fix}"
        )
    return rows


class DuoAttention(Policy):
    name = "duoattention"
    summary = "retrieval heads keep the whole context, streaming heads their sinks and a recent window (a pattern file)"
    needs = Needs(evicts=True, heads=True, slot_rule="append")
    pattern: str = param(
        "", doc="path of the per-layer, per-KV-head score file (DuoAttention's full_attention_heads.tsv, or its folder)"
    )
    streaming: float = param(0.5, 0.0, 1.0, "share of the model's KV heads made streaming heads (lowest scores)")
    sinks: int = param(64, 0, 1 << 16, "first tokens a streaming head keeps")
    recent: int = param(256, 1, 1 << 24, "latest tokens a streaming head keeps between steps")

    def check_config(self) -> None:
        scores = read_pattern(self.pattern) if self.pattern else None
        if scores is None:
            raise ConfigError(
                "policy 'duoattention': parameter 'pattern' is required: the path of a head pattern "
                "(one line per layer, one score per KV head: the DuoAttention repository's "
                "full_attention_heads.tsv, or its folder)"
            )
        flat = torch.tensor(scores, dtype=torch.float64)
        order = torch.sort(flat.flatten(), stable=True).indices[: round(self.streaming * flat.numel())]
        self.streaming_heads = torch.zeros(flat.numel(), dtype=torch.bool).scatter_(0, order, True).view(flat.shape)
        self.streaming_counts = self.streaming_heads.int().tolist()  # the same as Python numbers (stored_length)

    @property
    def layers(self) -> int:
        return self.streaming_heads.shape[0]

    def check_model(self, config) -> None:
        layers = config.num_hidden_layers
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if (layers, kv) != tuple(self.streaming_heads.shape):
            raise ConfigError(
                f"policy 'duoattention': parameter 'pattern' ({self.pattern!r}) has "
                f"{self.streaming_heads.shape[0]} layers x {self.streaming_heads.shape[1]} KV heads, and "
                f"this model {layers} x {kv}: it was made for another model; pass this model's pattern"
            )

    def window(self) -> int:
        """Entries a streaming head keeps between steps (a step's query also sees its own token)."""
        return self.sinks + self.recent

    def heads_of(self, site) -> torch.Tensor:
        """``[H_kv]`` bool: which of this site's KV heads (a tensor-parallel rank's own) are streaming heads."""
        return self.streaming_heads[site.layer, self._own(site)]

    @staticmethod
    def _own(site) -> slice:
        """The pattern's KV heads of this site (a tensor-parallel rank's share)."""
        first = site.tp.rank * site.kv_heads if site.tp is not None else 0
        return slice(first, first + site.kv_heads)

    def graph_refusal(self, sites) -> str | None:
        """A graph with another count of attention layers than the pattern: a pattern for another model (or a
        forward split into several graphs, whose layers each graph counts from 0), either way not this graph's."""
        layers = max((s.layer for s in sites), default=-1) + 1
        if layers and layers != self.layers:
            return (
                f"the graph has {layers} attention layers and the head pattern {self.pattern!r} {self.layers} (a "
                f"pattern for another model, or a forward split into several graphs); pass this model's pattern"
            )
        return None

    def plan(self, site) -> SitePlan | Refusal:
        plan = shrinking_plan(site)
        if not isinstance(plan, SitePlan) or not plan.evict:
            return plan
        total = site.kv_heads * (site.tp.size if site.tp is not None else 1)
        if total != self.streaming_heads.shape[1]:  # the layers' count: graph_refusal, before any site's plan
            return Refusal(
                f"layer {site.layer} with {total} KV heads: the head pattern {self.pattern!r} has "
                f"{self.layers} layers x {self.streaming_heads.shape[1]} KV heads (a pattern for another "
                f"model)"
            )
        return dataclasses.replace(plan, heads=True, heads_ring=self.window() + 1)  # and a decode step's token

    def stored_length(self, site, total):
        """After a prefill: the layer's kept entries over its KV heads, rounded up to a multiple of them."""
        if site.phase != "prefill":
            return total
        # Python numbers, not a tensor op: this runs under the fake tensor mode of a compile (the operator's
        # fake kernel), where an op on the real pattern tensor is an error
        streaming = sum(self.streaming_counts[site.layer][self._own(site)])
        kept = (site.kv_heads - streaming) * total + streaming * torch.sym_min(total, self.window())
        return -(-kept // site.kv_heads)

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, **inputs):
        b, h, n = kv_pos.shape
        if n != q_pos.shape[1]:  # not a prefill: nothing evicted here (the window keeps itself)
            return None
        streaming = self.heads_of(site).to(kv_pos.device)
        valid = kv_pos >= 0
        before = valid.long().cumsum(-1)  # real entries up to and including this one
        after = valid.flip(-1).long().cumsum(-1).flip(-1)  # real entries from this one on
        forced = valid & ((before <= self.sinks) | (after <= self.recent))
        keep = scoring.keep_top(
            torch.zeros_like(kv_pos, dtype=torch.float32), forced, forced, min(n, self.window())
        )  # [B, H_kv, w]: the window (padding after it)
        mine = torch.zeros_like(valid).scatter_(-1, keep, True)
        mine = torch.where(streaming[None, :, None], mine, torch.ones_like(mine))
        sel = (mine.view(b, h * n).nonzero()[:, 1]).view(b, -1)  # every row keeps the same number per head
        counts = mine.sum(-1)
        first = torch.where(valid[:, 0], kv_pos[:, 0], kv_pos.new_full((), 1 << 40)).amin(-1)  # the first real token
        recent = torch.where(streaming, self.recent + 1, 0).expand(b, h)  # a step's query sees its own token too
        sink = torch.where(streaming[None, :], (first + self.sinks)[:, None], 0)
        return ragged.Kept(sel, counts, recent, self.sinks, sink)

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        """A layer's slots per KV head: its retrieval heads' whole sequence and its streaming heads' rings (sinks +
        recent + 1, the ring's fixed size, even where the sequence is shorter), over the KV heads of one
        tensor-parallel rank's share (the most any rank's share needs)."""
        heads = self.streaming_heads[layer] if layer < self.layers else torch.zeros(ranks, dtype=torch.bool)
        window = self.window() + 1
        return max(
            -(-(int((~share).sum()) * max_length + int(share.sum()) * window) // share.numel())
            for share in heads.chunk(ranks)
        )

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return dict(ragged.SLOT_STATE)
