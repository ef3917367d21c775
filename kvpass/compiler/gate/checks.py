"""Whether a gate can be placed in a prefill graph: the policy's candidate layers, each with a residual add
``[batch, tokens, hidden]`` after its attention, in layer order, and a prompt length that no literal of a
static graph could be confused with."""

from __future__ import annotations

import torch

from kvpass.compiler.detect import val
from kvpass.policies.contract import GatedPolicy, forced_layer_problem


def same(a, b) -> bool:
    """Equal sizes: ints by value, symbolic sizes by expression."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)):
            return False
        return a.node.expr == b.node.expr
    return isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a == b


def mentions(x, length) -> bool:
    """A symbolic int whose expression contains the sequence symbol (but is not just it)."""
    if not isinstance(x, torch.SymInt) or not isinstance(length, torch.SymInt):
        return False
    return bool(x.node.expr.free_symbols & length.node.expr.free_symbols)


def places(sites, cuts) -> str | None:
    """Structural checks that need no rewrite: the gate's places, lengths, ambiguity, layer order."""
    by_layer = {s.layer: s for s in sites}
    cut_nodes = []
    for layer in cuts:
        res = by_layer[layer].residual
        if res is None:
            return f"layer {layer}: no residual add after the attention output (the gate's place)"
        v = val(res)
        if not (isinstance(v, torch.Tensor) and v.dim() == 3 and same(v.shape[1], by_layer[layer].q_len)):
            return f"layer {layer}: the residual stream at '{res.name}' is not [batch, tokens, hidden]"
        cut_nodes.append(res)
    length = by_layer[cuts[0]].q_len
    for s in sites:
        if not same(s.q_len, length):
            return f"layer {s.layer}: query length differs from layer {cuts[0]}'s"
    graph = cut_nodes[0].graph
    if not isinstance(length, torch.SymInt):
        clash = {s.heads for s in sites} | {s.kv_heads for s in sites} | {s.head_dim for s in sites}
        clash.add(val(cut_nodes[0]).shape[0])
        for n in graph.nodes:
            v = val(n)
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.is_floating_point():
                clash |= {d for d in v.shape if isinstance(d, int)}
        if length in clash:
            return (
                f"static graph whose prompt length {length} equals a model dimension, so its literal sizes "
                f"are ambiguous; compile with dynamic=True or use another prompt length"
            )
    order = {n: i for i, n in enumerate(graph.nodes)}
    cut_order = [order[c] for c in cut_nodes]
    if cut_order != sorted(cut_order):
        return "the candidate layers' residual adds are not in layer order"
    for layer, c in zip(cuts, cut_order):
        later = [s for s in sites if s.layer > layer]
        if later and min(order[s.q] for s in later) < c:
            return f"layer {layer + 1}'s attention starts before layer {layer}'s residual add"
        if by_layer[layer].out in order and order[by_layer[layer].out] > c:
            return f"layer {layer}'s attention output comes after its residual add"
    return None


def check(sites, policy) -> str | None:
    """Before the rewrite: why the policy's gate cannot be placed in this graph, or None."""
    if not sites:
        return "no attention sites"
    if not isinstance(policy, GatedPolicy):
        return (
            f"policy '{policy.name}' declares Needs(gates=True) without the GatedPolicy protocol "
            f"(kvpass.policies.contract: budget, window, layer, gate_layers, gate_fires, gate_select)"
        )
    observe, cuts = policy.gate_layers(len(sites))
    if not cuts:
        if forced := forced_layer_problem(policy, len(sites)):
            return forced
        return (
            f"no candidate selection layer in a {len(sites)}-layer model (a gate after the last layer prunes nothing)"
        )
    return places(sites, cuts)
