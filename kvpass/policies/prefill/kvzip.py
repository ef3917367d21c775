"""``kvzip``: entries scored by how much the model reads them to repeat its context (Kim et al., 2025).

"KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction": after the prompt is prefilled, the
model is fed a prompt asking it to repeat the context, followed by the context itself (teacher forcing), in
chunks of ``chunk_size`` tokens. An entry's score is the most attention any query of its chunk's repeat pass gives
it, over the query heads of its KV group; the softmax of that pass spans the first ``sinks`` entries, the chunk
being repeated and the pass's own tokens (causal). The entries repeated earliest need no question to be found
again, so the scores hold for whatever is asked later. Each layer keeps ``H_kv x budget`` entries, shared out over
its KV heads by one ranking of the layer's (head, entry) scores (the per-head layout of ``kvpass.cache.ragged``,
as ``adakv`` keeps them), the first ``sinks`` real entries always and the last ``window`` (0) too.

**How it runs.** ``kvpass.compile``'s ``generate``, ``kvpass.RequestQueue`` and ``kvpass compare`` run the repeat
passes over the prefill that fills a ``kvpass.SlotCache`` (``kvpass.repeat_passes``): that prefill hands each layer's
entries to a ``DynamicCache`` that keeps the whole prompt and holds its choice; as its forward returns
(``kvpass.compile``'s; on a forward of one's own, as the ``repeat_passes`` block ends), each pass
reads that cache (``kvpass::repeat_scores`` beside the attention of every layer) and leaves it as it was, and each
layer's ``select`` keeps the best entries by the passes' scores. The SlotCache holds the budget only, and the
scoring cache is given back before the first decode step. A prompt is prefilled once, plus the repeat passes
(about two prefills' attention: each chunk's queries read the whole prompt). On any other cache kvzip keeps every
entry (a ``DynamicCache`` under transformers' ``generate``, with a warning): only a SlotCache's prefill selects, so
that every compiled graph keeps one shape contract.

**Repeat prompts** are text, so the policy needs ``tokenizer`` (any object with ``encode(text,
add_special_tokens=False)``): ``first`` before the first chunk, ``later`` before each later chunk (followed by its
previous chunk's last ``overlap`` tokens), then ``suffix`` (kvpress's texts for a model without a chat template).

**Against kvpress 0.5.5's ``KVzipPress``.** The same scores (kvpress's ``prefix_length`` is 0 here: kvpass gets
token ids, not a chat template) and kvpress's ``layerwise=True`` allocation: each layer keeps the same total, which a
fixed-size cache needs; kvpress's default ranks all layers' scores together, so a layer's size would depend on the
prompt. kvpress masks the dropped entries and keeps their memory; kvpass stores only the kept ones.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvpass.cache import ragged
from kvpass.kernels.window_scores import window_scores_eager
from kvpass.policies.contract import ConfigError, Needs, Refusal, SitePlan, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.base import PrefillEviction

ROW_BUCKET = 256  # a repeat pass's queries are scored in multiples of this many rows


class KVzip(PrefillEviction):
    name = "kvzip"
    summary = "entries scored by the attention of passes that repeat the context; per-head budgets"
    needs = Needs(evicts=True, heads=True, slot_rule="append", reconstructs=True)
    window: int = param(0, 0, 1 << 16, "last prompt tokens always kept (0: none, as KVzip)")
    sinks: int = param(4, 0, 1 << 16, "first prompt tokens always kept and in every pass's softmax (KVzip's n_sink)")
    chunk_size: int = param(2048, 1, 1 << 24, "context tokens each repeat pass reconstructs")
    overlap: int = param(8, 0, 1 << 16, "tokens of the previous chunk that a later pass repeats first")
    tokenizer: object = param(
        None, doc="the model's tokenizer (encode(text, add_special_tokens=False)), for the repeat prompts"
    )
    first: str = param("\n\nRepeat the previous context exactly.", doc="the prompt before the first chunk")
    later: str = param(
        "\n\nRepeat the part of the previous context exactly, starting with", doc="the prompt before each later chunk"
    )
    suffix: str = param("\n", doc="text between a prompt and its chunk")

    def check_config(self) -> None:
        super().check_config()
        tok = self.tokenizer
        if tok is None or isinstance(tok, str) or not callable(getattr(tok, "encode", None)):
            raise ConfigError(
                f"policy 'kvzip': parameter 'tokenizer' must be the model's tokenizer (an object with "
                f"encode()), got {type(tok).__name__}; the repeat prompts are text: pass "
                f"tokenizer=AutoTokenizer.from_pretrained(...)"
            )
        self._ids = tuple(tuple(int(i) for i in _encode(tok, text)) for text in (self.first, self.later, self.suffix))
        # the configuration keeps a printable, hashable name (as sablock's)
        self.tokenizer = getattr(tok, "name_or_path", "") or type(tok).__name__

    def plan(self, site) -> SitePlan | Refusal:
        if site.cache == "slot":  # the budget-sized cache: the prefill keeps by the passes' scores, per head
            plan = super().plan(site)
            return dataclasses.replace(plan, heads=True) if isinstance(plan, SitePlan) and plan.evict else plan
        # the scoring cache (kvpass.generate.reconstruct): it keeps the prompt whole; the passes' graph scores it (a
        # graph of several tokens on any other cache gets the op too, idle outside a pass; one-token decode does not)
        return SitePlan(attention=True, repeat_scores=site.phase in ("append", "dynamic") and not site.sliding_window)

    def idle_reason(self, sites) -> str | None:
        if any(s.cache != "slot" and s.phase == "decode" for s in sites):
            return self.unscored(sites[0].cache)
        return None

    def unscored(self, cache: str) -> str:
        """Why this policy keeps every entry of a ``cache`` cache: said when a decode graph compiles on it, or when
        a graph that serves prefill and decode alike (a ``dynamic`` phase) runs outside the repeat passes."""
        return (
            f"policy '{self.name}' selects at a kvpass.SlotCache's prefill, from repeat passes that "
            f"kvpass.compile's generate, kvpass.RequestQueue and `kvpass compare` run over it; on this "
            f"{cache} cache it keeps every entry, as 'full'"
        )

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return dict(ragged.SLOT_STATE)

    # -- the repeat passes (kvpass.generate.reconstruct runs them) ----------------------------------------------

    def passes(self, ids: Tensor, mask: Tensor | None) -> list[tuple[int, int, Tensor, Tensor | None]]:
        """The repeat passes of a prompt ``ids [B, n]`` (``mask [B, n]``, 1 = real token, or None): per chunk
        ``(start, end, pass_ids [B, r], pass_mask [B, n + r] or None)``; none for a prompt no longer than the budget
        (every layer keeps it whole)."""
        if ids.shape[1] <= self.budget:
            return []
        first, later, suffix = (torch.tensor(t, dtype=ids.dtype, device=ids.device) for t in self._ids)
        rows, out = ids.shape[0], []
        for start in range(0, ids.shape[1], self.chunk_size):
            end = min(start + self.chunk_size, ids.shape[1])
            lead = (first if start == 0 else later).expand(rows, -1)
            back = max(0, start - self.overlap)  # the previous chunk's last tokens
            parts = [lead, ids[:, back:start], suffix.expand(rows, -1), ids[:, start:end]]
            pass_ids = torch.cat(parts, 1)
            pass_mask = None
            if mask is not None:

                def ones(t):
                    return mask.new_ones(rows, t.shape[1])

                pass_mask = torch.cat([mask, ones(lead), mask[:, back:start], ones(parts[2]), mask[:, start:end]], 1)
            out.append((start, end, pass_ids, pass_mask))
        return out

    def repeat_scores(
        self, q: Tensor, k: Tensor, valid: Tensor | None, span: tuple[int, int], softcap: float
    ) -> Tensor:
        """``[B, H_kv, end - start]`` fp32: each entry of the chunk ``span`` the most attention a query of its repeat
        pass gives it, over the query heads of its KV group. ``q [B, H, r, D]`` (scaled), ``k [B, H_kv, n + r, D]``
        (the prompt's entries, then the pass's), ``valid [B, n + r]`` (False: padding) or None. The softmax spans
        the first ``min(sinks, start)`` entries, the chunk and the pass's own entries (causal); a padding query
        casts nothing.

        It is window scoring (``kvpass.kernels.window_scores``, the Triton kernel on a GPU: no ``[H, r, cols]``
        score tensor) over those columns with the most instead of the sum: the prompt's columns at position 0,
        which every query of the pass sees, the pass's own entry i and query i at position i + 1 (causal),
        padding at -1 (nothing sees it, it sees nothing). The queries are padded to a multiple of
        ``ROW_BUCKET`` rows that see nothing, so the kernel, which specialises on the row count, compiles once
        for most prompt lengths."""
        start, end = span
        b, _, r, _ = q.shape
        hkv, n = k.shape[1], k.shape[2] - r
        sink = min(self.sinks, start)
        dev = k.device
        cols = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + r)]).to(dev)
        keys = k.index_select(2, cols)
        own = torch.arange(1, r + 1, device=dev)
        kv_pos = torch.cat([own.new_zeros(sink + end - start), own]).expand(b, -1)
        q_pos = own.expand(b, -1)
        if valid is not None:
            kv_pos = kv_pos.masked_fill(~valid.index_select(1, cols), -1)
            q_pos = q_pos.masked_fill(~valid[:, n:], -1)
        rows = -(-r // ROW_BUCKET) * ROW_BUCKET
        q = torch.cat([q, q.new_zeros(*q.shape[:2], rows - r, q.shape[3])], 2)
        q_pos = torch.cat([q_pos, q_pos.new_full((b, rows - r), -1)], 1)
        kv_pos = kv_pos[:, None].expand(b, hkv, -1).contiguous()
        most = window_scores_eager(q, keys, kv_pos, q_pos.contiguous(), 1.0, softcap, reduce="max")
        return most[..., sink : sink + end - start]

    # -- the selection (the SlotCache's prefill, given the passes' scores) -------------------------------------------

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, scores=None, **inputs):
        n = kv_pos.shape[-1]
        keep = self.kept(site, n)
        if n != q_pos.shape[1] or n <= keep:  # not a prefill, or nothing to evict
            return None
        if scores is None or tuple(scores.shape) != tuple(kv_pos.shape):
            got = "no repeat passes ran" if scores is None else f"the passes scored {scores.shape[-1]} tokens"
            raise ConfigError(
                f"policy 'kvzip': this {n}-token prefill of layer {site.layer} keeps entries by the "
                f"scores of repeat passes over the same prompt, and {got}. Prefill inside "
                f"kvpass.repeat_passes(model, backend, input_ids, forward=...) with the prompt you "
                f"prefill, or generate with kvpass.compile(model, 'kvzip', ...)"
            )
        valid, forced = scoring.window_layout(kv_pos, self.window)
        real = valid.long().cumsum(-1)
        forced = forced | valid & (real <= self.sinks)  # the first real entries: the sinks
        sel, counts = scoring.keep_top_heads(scores.to(kv_pos.device), forced, valid, keep, 0)
        return ragged.Kept(sel, counts)


def _encode(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)
