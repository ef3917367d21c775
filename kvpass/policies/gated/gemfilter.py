"""``gemfilter``: select at a fixed filter layer, then prefill only the selected tokens again (GemFilter,
Shi et al., 2024).

The first pass runs the prompt through layers ``0..layer`` (default ``13 L / 32``, the paper's layer 13
of Llama-3.1-8B's 32) and stops there: that layer's attention from the last ``window`` queries (default
1: the last token, as in the paper), summed over heads and pooled with ``kernel`` (default 1: none),
picks ``budget - window`` tokens plus the window. The second pass is an ordinary prefill of only those
tokens from layer 0, with **renumbered, contiguous positions** ``0..n-1`` (the selected tokens as a new,
shorter prompt), so every layer's cache holds ``n = budget`` entries. Decode continues from ``n``. On a
DynamicCache a bare ``forward`` derives it from the cache, and position ids passed in by ``generate``
(which counts the whole prompt) are moved back by ``L - n`` (``kvpass::shift_positions``). A
``kvpass.SlotCache`` counts the whole prompt (so ``generate`` can continue it) and keeps ``L - n`` in its
counters: every position, passed or derived, moves back on the device
(``kvpass.compiler.positions.shift_slot_positions``).

Both passes run in the same compiled prefill graph's segments (``kvpass.compiler.gate``); the second pass uses
their short versions. Batch 1 or unpadded batches: a left-padded batch's position inputs are refused
with an error rather than guessed. ``asl_2pass`` (``kvpass.policies.gated.asl``) is the same second pass
after ASL's adaptive layer, keeping the original positions.
"""

from __future__ import annotations

from kvpass.policies.contract import Needs, param
from kvpass.policies.gated.base import GatedSelection


class GemFilter(GatedSelection):
    name = "gemfilter"
    summary = "filter layer picks tokens; a second prefill of only those, positions renumbered 0..n-1"
    window: int = param(1, 1, 1 << 16, "last prompt tokens that score the others, always kept")
    kernel: int = param(1, 1, 1025, "average-pooling kernel over token scores (odd; 1 = none)")
    layer: int = param(-1, -1, 1 << 16, "the filter layer (-1: 13 layers / 32)")
    needs = Needs(evicts=True, decode_appends=True, gates=True, two_pass=True, renumber=True, slot_rule="append")
    compress = False

    def gate_layers(self, n_layers: int):
        layer = self.layer if self.layer >= 0 else (13 * n_layers) // 32
        return ([layer], [layer]) if layer < n_layers - 1 else ([], [])

    def gate_fires(self, layer, history, keep, ctx) -> bool:
        return True
