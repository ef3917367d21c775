"""``asl``, ``asl_fullkv``: adaptive selection layer with layer-gated token propagation (ASL).

**Prefill.** Every layer runs on the whole prompt until the *selection layer*; from there on only
the selected tokens travel through the deeper layers (``kvpass.compiler.gate``: the graph is split at the
residual add after each candidate layer's attention, the residual stream, original position ids,
RoPE cos/sin and masks are gathered, and the deeper segments run at ``budget`` tokens).

**The rule**. After each observed layer's attention, the last ``window``
prompt tokens score every token: softmax(q k^T / sqrt d) in fp32, causal inside the window, summed
over the window queries and over all query heads (``kvpass::layer_scores``), then average-pooled
(``kernel`` 7, stride 1, zero padding) over the candidates (tokens before the window; the window and
left padding count as 0 and rank last). Each layer ranks the candidates (1 = best, ties to the earlier
token). At layer ``l`` from ``L_min`` (``l_min``, default floor(L/3)) on, over the last ``l_obs`` (8)
layers up to ``l`` (fewer when the model has fewer before it): ``U`` = union of each layer's
top-(budget - window) candidates, ``var`` = mean over ``U`` of the population variance of each token's
rank across those layers. ``var0`` is the value at ``L_min``; the first layer with ``var / var0 < tau``
(0.3) is the selection layer (a zero ``var0`` never selects). Selected = its top-(budget - window)
candidates plus the window, in order. If the ratio never drops below ``tau`` nothing is pruned, so
``tau = 0`` computes the whole prompt in every layer. ``layer >= 0`` forces the selection layer (the
benchmark's way to time a model whose random weights make the rule meaningless).

**Cache.** ``asl``: layers up to the selection layer keep a SnapKV-compressed cache of ``budget``
entries per KV head (window queries' attention per KV head, average-pooled with the same kernel);
deeper layers store the ``budget`` selected tokens. ``asl_fullkv``: layers up to the selection layer
keep everything. Decode appends to every layer; positions continue from the prompt length.

**Batch.** Rows share the selection layer (the first layer where every row's ratio is below ``tau``:
the cache tensors are rectangular, so every row must stop computing tokens at the same layer); each
row selects its own tokens. Left padding is scored 0 and never preferred to a real token.

**Sliding-window layers** (Gemma 2/3, Cohere 2). They are candidate and observed layers like the others
(their scores use plain causal attention inside the window, as for global layers). Their cache update is
rewritten too: each stores the last ``W - 1`` entries it was given, exactly what HF's sliding layer keeps
(the model's own slice of the stored tensors is then a no-op), and its attention masks by *true* positions
with the window (``attention_pos``). That matters after the gate: a deeper sliding layer holds the last
``W - 1`` *selected* tokens, whose positions are not consecutive, and HF's decode mask assumes they are.
In the prefill the gathered sliding mask is already the mask of the selected tokens' true positions.

**SlotCache** (``kvpass.SlotCache``, the CUDA-graph decode). The gated prefill still runs as segments
(its length changes at the gate); each layer's ``slot_prefill`` writes what it was given into its slots and
the runner then records the selected tokens' true positions there. Layers keep ``budget +
max_new_tokens`` slots (``asl_fullkv``: the whole ``max_length``; ``asl_2pass`` with the adaptive rule:
``max_length``, since the rule may not fire). Decode then appends, one graph.

**Limits.** HF static caches are refused (the deeper caches must shrink). Gating does not compose with other
policies (``asl+art`` raises ``ConfigError``).
"""

from __future__ import annotations

import torch

from kvpass.policies.contract import Needs, param
from kvpass.policies.gated.base import GatedSelection, pooled, rank_variance, ranks


class ASL(GatedSelection):
    name = "asl"
    summary = "adaptive selection layer: deeper layers compute only the selected tokens (rank-variance rule)"
    tau: float = param(0.3, 0.0, 1.0, "select at the first layer where var / var0 < tau (0 = never)")
    l_obs: int = param(8, 1, 1024, "layers whose rank variance is measured")
    l_min: int = param(-1, -1, 1 << 16, "first candidate layer (-1: floor(layers / 3))")

    def first_layer(self, n_layers: int) -> int:
        return self.l_min if self.l_min >= 0 else n_layers // 3

    def gate_layers(self, n_layers: int) -> tuple[list[int], list[int]]:
        if self.layer >= 0:
            return ([self.layer], [self.layer]) if self.layer < n_layers - 1 else ([], [])
        first = self.first_layer(n_layers)
        cuts = list(range(first, n_layers - 1))
        return list(range(max(0, first - self.l_obs + 1), n_layers - 1)), cuts

    # -- run time: the rule ----------------------------------------------------------------------
    def gate_fires(self, layer: int, history: dict, keep: int, ctx: dict) -> bool:
        if self.layer >= 0:
            return layer == self.layer
        r = ctx.setdefault("ranks", {})
        for i, s in history.items():
            if i not in r:
                r[i] = ranks(pooled(s, ctx["kv_pos"], self.window, self.kernel))
        recent = [r[i] for i in sorted(r) if layer - self.l_obs < i <= layer]
        var = rank_variance(recent, keep - self.window)
        if "var0" not in ctx:
            ctx["var0"] = var
        var0 = ctx["var0"]
        ratio = torch.where(var0 > 0, var / var0.clamp_min(1e-300), torch.full_like(var, float("inf")))
        ctx.setdefault("ratios", {})[layer] = [round(float(x), 6) for x in ratio]
        return bool((ratio < self.tau).all())


class ASLFullKV(ASL):
    name = "asl_fullkv"
    summary = "asl without compression before the selection layer (those layers keep the whole prompt)"
    compress = False

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        return max_length  # any layer up to the (adaptive) selection layer keeps the whole prompt


class ASL2Pass(ASL):
    """The adaptive layer picks the tokens; then they are prefilled again from layer 0 at their
    original positions (GemFilter's second pass with ASL's rule); every layer stores them."""

    name = "asl_2pass"
    summary = "asl's layer picks tokens; a second prefill of only those from layer 0 (original positions)"
    compress = False
    needs = Needs(evicts=True, decode_appends=True, gates=True, two_pass=True, slot_rule="append")

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        # every layer stores the selected tokens, unless the adaptive rule never fires (the whole prompt)
        return max_length if self.layer < 0 else super().slot_capacity(max_length, max_new_tokens, layer, layers, ranks)
