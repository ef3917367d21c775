"""A rewritten prefill graph split at its gates: the score nodes after each observed layer's attention
(``insert_scores``), the segments between the cuts with their inputs and outputs (``split``), how each value
that crosses a gate reaches the shorter segments (``carry``), and each segment as a GraphModule of its own
(``build``, with a literal prompt length replaced for a static graph's short version)."""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import fx

from kvpass.compiler import positions as _positions  # noqa: F401  (registers kvpass::shift_positions)
from kvpass.compiler import tp as _tp
from kvpass.compiler.detect import val
from kvpass.compiler.gate.checks import mentions, same
from kvpass.compiler.maskcheck import site_mask


@dataclass
class Segment:
    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    gm: fx.GraphModule | None = None
    cut: int | None = None  # layer whose gate closes this segment
    scores: dict[int, fx.Node] = field(default_factory=dict)  # observed layer -> its score node
    short: dict = field(default_factory=dict)  # n -> GraphModule (static graphs)
    compiled: Callable | None = None  # compiled at backend time with the graph's fake inputs
    fakes: list | None = None  # ... those inputs


def insert_scores(graph: fx.Graph, sites: dict, observe, window: int, reductions: list) -> dict | str:
    """After each observed layer's attention, before its residual add: its ``[B, N]`` window scores summed
    over every head of the layer (``kvpass::layer_scores``; a split model gathers the heads of every rank
    first). Returns ``{layer: score node}``, or why not."""
    score_nodes = {}
    for layer in observe:
        s = sites[layer]
        if s.residual is None or s.k_new is None:
            return f"layer {layer}: no residual add / new keys to score"
        with graph.inserting_before(s.residual):
            q, scale = s.q, s.scale
            if isinstance(scale, fx.Node):
                q = graph.call_function(operator.mul, (q, scale))
                scale = 1.0
            per_head = graph.call_function(
                torch.ops.kvpass.layer_scores.default,
                (q, s.k_new, site_mask(s)[0], float(scale), float(s.softcap), window),
            )
        every_head = _tp.gather_heads(graph, per_head, s.tp, f"layer {layer}: layer_scores", reductions)
        with graph.inserting_after(every_head):
            score_nodes[layer] = graph.call_function(torch.sum, (every_head, 1))
    return score_nodes


@dataclass
class Partition:
    """The graph's nodes in segments: segment ``k`` holds the nodes after cut ``k - 1`` up to and including cut
    ``k``; ``seg_of`` maps a node to its segment (-1: a placeholder); ``needed_later`` to the last segment that
    reads it (``len(segments)``: the graph's output)."""

    segments: list[Segment]
    seg_of: dict
    placeholders: list[fx.Node]
    output: fx.Node
    needed_later: dict


def split(graph: fx.Graph, cut_nodes: list, cuts, score_nodes: dict, masks: set) -> Partition:
    """Partition ``graph`` after each of ``cut_nodes`` (in graph order; the last ``len(cuts)`` are the
    candidate layers' residual adds) and give each segment its inputs and outputs: what a later segment or
    the graph's output reads, the score nodes, and the masks the runner reads at a cut."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    cut_order = [order[c] for c in cut_nodes]
    seg_of: dict[fx.Node, int] = {}
    segs = [Segment(i, [], [], []) for i in range(len(cut_nodes) + 1)]
    placeholders, output = [], None
    for n in graph.nodes:
        if n.op == "placeholder":
            placeholders.append(n)
            seg_of[n] = -1
        elif n.op == "output":
            output = n
        else:
            k = bisect.bisect_left(cut_order, order[n])
            seg_of[n] = k
            segs[k].nodes.append(n)
    for k, layer in enumerate(cuts):
        segs[k + len(cut_nodes) - len(cuts)].cut = layer
    for layer, node in score_nodes.items():
        segs[seg_of[node]].scores[layer] = node
    for seg in segs:
        seg.inputs = list(dict.fromkeys(a for n in seg.nodes for a in n.all_input_nodes if seg_of[a] != seg.index))
    needed_later: dict[fx.Node, int] = {}
    for seg in segs:
        for a in seg.inputs:
            needed_later[a] = max(needed_later.get(a, -1), seg.index)
    for a in output.all_input_nodes:
        needed_later[a] = len(segs)
    for seg in segs:
        outs = [n for n in seg.nodes if needed_later.get(n, -1) > seg.index]
        outs += [n for n in seg.scores.values() if n not in outs]
        outs += [n for n in seg.nodes if n in masks and n not in outs]
        seg.outputs = outs
    return Partition(segs, seg_of, placeholders, output, needed_later)


def carry(parts: Partition, length) -> tuple[dict, dict] | str:
    """How each value that can cross a gate reaches the shorter segments, and each input's token dims:
    ``(transform, input_dims)``, or why the gate cannot tell. ``transform[node]`` is ``("gather", dims)``
    (restrict dims to the selected tokens), ``("length",)`` (the token count itself) or ``("keep",)``;
    ``input_dims[placeholder]`` the dims along the prompt (``"length"``: the count)."""
    transform = {}
    for n in {a for seg in parts.segments[1:] for a in seg.inputs}:
        v = val(n)
        if v is None and n.op == "call_function" and n.target in SHAPE_OF_INPUT and n.args:
            v = val(n.args[0])  # an op the rewrite inserted: same shape as its input
        if v is None and n.op != "placeholder":
            return f"'{n.name}' crosses a gate without a recorded shape; the gate cannot tell its token dims"
        if isinstance(v, torch.Tensor):
            if any(mentions(d, length) and not same(d, length) for d in v.shape):
                return f"'{n.name}' has a size derived from the prompt length ({tuple(v.shape)})"
            dims = tuple(d for d in range(v.dim()) if same(v.shape[d], length))
            transform[n] = ("gather", dims) if dims else ("keep",)
        elif same(v, length):
            transform[n] = ("length",)
        elif mentions(v, length):
            return f"'{n.name}' = {v} is derived from the prompt length; the gate cannot carry it"
        else:
            transform[n] = ("keep",)
    input_dims = {}
    for n in parts.placeholders:
        v = val(n)
        if isinstance(v, torch.Tensor):
            if any(mentions(d, length) and not same(d, length) for d in v.shape):
                return f"input '{n.name}' has a size derived from the prompt length ({tuple(v.shape)})"
            input_dims[n] = tuple(d for d in range(v.dim()) if same(v.shape[d], length))
        elif same(v, length):
            input_dims[n] = "length"
        elif mentions(v, length):
            return f"input '{n.name}' = {v} is derived from the prompt length"
    return transform, input_dims


def free_after(parts: Partition, keep: set) -> list[list[fx.Node]]:
    """Per segment, the values the runner drops after it: each after the last segment that reads it (a
    residual stream per layer boundary is 1 GiB at 128k tokens), except those in ``keep``."""
    out: list[list[fx.Node]] = [[] for _ in parts.segments]
    for seg in parts.segments:
        for x in seg.outputs:
            if x not in keep:
                out[max(parts.needed_later.get(x, -1), seg.index)].append(x)
    return out


def build(root: fx.GraphModule, seg: Segment, subst: tuple | None = None) -> fx.GraphModule:
    """A standalone GraphModule for ``seg``; ``subst=(L, n)`` replaces the literal int ``L`` by ``n``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in seg.inputs:
        env[x] = g.placeholder(f"in_{x.name}")
        env[x].meta = dict(x.meta)

    def swap(a):
        if subst is None:
            return a
        if isinstance(a, bool):
            return a
        if isinstance(a, int):
            return subst[1] if a == subst[0] else a
        if isinstance(a, slice):
            return slice(swap(a.start), swap(a.stop), swap(a.step))
        if isinstance(a, tuple):
            return tuple(swap(x) for x in a)
        if isinstance(a, list):
            return [swap(x) for x in a]
        if isinstance(a, dict):
            return {k: swap(v) for k, v in a.items()}
        return a

    for node in seg.nodes:
        new = g.node_copy(node, lambda x: env[x])
        # kvpass ops take no length literal (lengths come from their tensors); their ints are the
        # runtime handle, the layer and constants, which may equal L by chance and must stay
        if subst is not None and getattr(node.target, "namespace", None) != "kvpass":
            new.args, new.kwargs = swap(new.args), swap(new.kwargs)
        env[node] = new
    g.output(tuple(env[x] for x in seg.outputs))
    return fx.GraphModule(root, g)


def outputs_from(node: fx.Node, outputs: set) -> list[fx.Node]:
    """The graph outputs reached from ``node`` through ``getitem`` / slicing only."""
    found, todo, seen = [], [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in outputs and n is not node:
            found.append(n)
        todo += [u for u in n.users if u.op == "call_function" and u.target is operator.getitem]
    return found


SHAPE_OF_INPUT = (torch.ops.kvpass.true_positions.default, torch.ops.kvpass.shift_positions.default)


def after_fix(pos: fx.Node) -> fx.Node:
    """The position tensor RoPE reads: ``true_positions(pos)`` when the rewrite routed it through one
    (it would move replaced positions by ``seen - first``), else ``pos`` itself."""
    for u in pos.users:
        if u.op == "call_function" and u.target is torch.ops.kvpass.true_positions.default:
            return u
    return pos
