"""``fastkv``: token-selective propagation at a fixed layer (FastKV, Jo et al., 2025).

The ASL machinery (``kvpass.policies.gated.asl``, ``kvpass.compiler.gate``) with the selection layer fixed: every
prompt token runs through layers ``0..layer`` (default ``L // 2``); after that layer's attention its
window scores (the last ``window`` queries, summed over queries and heads, average-pooled with
``kernel``) pick ``budget - window`` tokens plus the window, and only those continue to the deeper
layers, at their original positions. Layers up to the selection layer keep a SnapKV-compressed cache
of ``budget`` entries per KV head (FastKV's decoupled KV budget, here equal to the propagation
budget); deeper layers store the selected tokens. Decode appends; positions continue from the
prompt length. ``budget >= prompt length`` computes and keeps everything (equal to ``full``).
"""

from __future__ import annotations

from kvpass.policies.contract import param
from kvpass.policies.gated.base import GatedSelection


class FastKV(GatedSelection):
    name = "fastkv"
    summary = "fixed selection layer (default L/2): deeper layers compute only the selected tokens"
    layer: int = param(-1, -1, 1 << 16, "the selection layer (-1: layers // 2)")

    def gate_layers(self, n_layers: int):
        layer = self.layer if self.layer >= 0 else n_layers // 2
        return ([layer], [layer]) if layer < n_layers - 1 else ([], [])

    def gate_fires(self, layer, history, keep, ctx) -> bool:
        return True
