"""Layer-gated token propagation: deeper layers of a prefill compute only the selected tokens.

ASL, FastKV and GemFilter-style policies keep running the prompt through the first layers on every
token, pick the tokens that matter after some layer's attention (the *selection layer*), and let
the deeper layers compute only those. In a Dynamo graph that is a sequence-length change in the
middle of the graph: with static shapes the length is a literal in every ``view``/``reshape`` of
the deeper layers, with dynamic shapes it is the input's symbol, and for ASL the layer where it
happens is only known at run time.

How kvpass carries it (docs/ARCHITECTURE.md section 3, "Layer-gated propagation"): the rewritten
prefill graph is **split at the gates** (the residual add after each candidate layer's attention)
into segments, and the backend returns a small Python runner instead of one compiled graph. The
runner executes the segments in order; after a candidate layer it asks the policy whether this is
the selection layer; if so it gathers every value that crosses into the deeper segments along its
token dimensions (residual stream, RoPE cos/sin at dim -2, position ids, 4-D masks by rows and
columns), and runs the deeper segments in a *short version* built for ``n`` tokens:

* static graphs: a copy of the segment whose literal sequence lengths (``L`` in ``view``,
  ``reshape``, ``arange``, slices) are replaced by ``n``; kvpass refuses when ``L`` equals a model
  dimension (head count, head size, a weight dimension), where a literal would be ambiguous;
* dynamic graphs: the same segment, fed ``n`` for every symbolic integer equal to the sequence
  symbol (sizes computed inside the segment follow the gathered tensors by themselves).

Each segment version is compiled by the inner compiler (Inductor on GPU) on first use with the
real inputs and cached by input shapes, so the deeper layers really run at ``n`` tokens. Decode
graphs are not split. A graph the gate does not understand is left as an evicting graph without
gating and kvpass warns why; it is never silently pruned wrong.

Masks of the deeper layers are exact: the gathered tokens keep their order, so the model's causal
(and padding) mask restricted to their rows and columns is the mask of their true positions, and
``is_causal`` SDPA over them is the same thing. RoPE uses the gathered original positions. After
the prefill the runner records in the generation state the true positions of what every deeper
layer stored, so decode (``cache_update`` + ``attention_pos``) continues from the prompt length.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx

from kvpass.cache import runtime as _runtime
from kvpass.compiler.detect import val
from kvpass.compiler import positions as _positions  # noqa: F401  (registers kvpass::shift_positions)
from kvpass.compiler import tp as _tp
from kvpass.compiler.maskcheck import site_mask
from kvpass.policies.contract import GatedPolicy


# ----------------------------------------------------------------------------------------------
# analysis
# ----------------------------------------------------------------------------------------------


def _same(a, b) -> bool:
    """Equal sizes: ints by value, symbolic sizes by expression."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)):
            return False
        return a.node.expr == b.node.expr
    return isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a == b


def _mentions(x, length) -> bool:
    """A symbolic int whose expression contains the sequence symbol (but is not just it)."""
    if not isinstance(x, torch.SymInt) or not isinstance(length, torch.SymInt):
        return False
    return bool(x.node.expr.free_symbols & length.node.expr.free_symbols)


@dataclass
class Segment:
    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    gm: fx.GraphModule | None = None
    cut: int | None = None            # layer whose gate closes this segment
    scores: dict[int, fx.Node] = field(default_factory=dict)   # observed layer -> its score node
    short: dict = field(default_factory=dict)                    # n -> GraphModule (static graphs)
    compiled: object = None          # compiled at backend time with the graph's fake inputs
    fakes: list | None = None        # ... those inputs


def _build(root: fx.GraphModule, seg: Segment, subst: tuple | None = None) -> fx.GraphModule:
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


@dataclass
class GateInfo:
    """What the gate did in the last prefill (``Backend.gate_info``)."""

    layer: int | None        # the selection layer, None when nothing was pruned
    length: int              # prompt length L
    kept: int                # tokens the deeper layers computed (L when nothing was pruned)
    candidates: tuple        # layers after which the gate could fire
    ratios: dict             # ASL: layer -> var / var0 per row (list), for the record
    passes: int = 1          # 2: the selected tokens were prefilled again from layer 0
    shift: int = 0           # gemfilter: decode positions passed in are moved back by this much

    def as_dict(self) -> dict:
        return {"selection_layer": self.layer, "length": self.length, "kept": self.kept,
                "candidates": list(self.candidates), "ratios": self.ratios, "passes": self.passes}


class GatedGraph:
    """The callable the backend returns for a gated prefill graph (see the module docstring)."""

    def __init__(self, gm, sites, policy, rt, observe, cuts, compile_segment) -> None:
        self.gm, self.policy, self.runtime = gm, policy, rt
        self.sites = {s.layer: s for s in sites}
        self.observe, self.cuts = tuple(observe), tuple(cuts)
        self.compile_segment = compile_segment
        self.compiled: dict = {}
        self.segments: list[Segment] = []
        self.placeholders: list[fx.Node] = []
        self.transform: dict[fx.Node, tuple] = {}
        self.length = None
        self.output = None
        self.reductions: list[str] = []   # collectives inserted for decisions across heads (kvpass.compiler.tp)

    # -- construction -----------------------------------------------------------------------------
    def prepare(self) -> str | None:
        """Insert the score nodes, split the graph and classify crossing values; a str = why not."""
        graph = self.gm.graph
        sites = self.sites
        why = _check(list(sites.values()), self.cuts)
        if why:
            return why
        cut_nodes = [sites[layer].residual for layer in self.cuts]
        length = sites[self.cuts[0]].q_len
        self.two_pass = self.policy.needs.two_pass
        self.renumber = self.policy.needs.renumber
        # a two-pass policy sets the RoPE positions of its second pass: the position tensors derived
        # inside the graph end a segment of their own, so the runner can replace their value
        self.pos_nodes = list(dict.fromkeys(_after_fix(s.positions) for s in sites.values() if s.positions is not None))
        if self.two_pass and not self.pos_nodes:
            return "no position tensor behind the RoPE of any layer (a second pass could not place its tokens)"
        pos_cuts = [p for p in self.pos_nodes if p.op != "placeholder"] if self.two_pass else []
        # score nodes after each observed layer's attention, before its residual add
        score_nodes = {}
        for layer in self.observe:
            s = sites[layer]
            if s.residual is None or s.k_new is None:
                return f"layer {layer}: no residual add / new keys to score"
            with graph.inserting_before(s.residual):
                q = s.q
                scale = s.scale
                if isinstance(scale, fx.Node):
                    q = graph.call_function(operator.mul, (q, scale))
                    scale = 1.0
                per_head = graph.call_function(torch.ops.kvpass.layer_scores.default, (
                    q, s.k_new, site_mask(s)[0], float(scale), float(s.softcap), int(self.policy.window)))
            # the whole layer's heads on every rank
            every_head = _tp.gather_heads(graph, per_head, s.tp, f"layer {layer}: layer_scores", self.reductions)
            with graph.inserting_after(every_head):
                score_nodes[layer] = graph.call_function(torch.sum, (every_head, 1))
        order = {n: i for i, n in enumerate(graph.nodes)}
        if pos_cuts and max(order[p] for p in pos_cuts) > order[cut_nodes[0]]:
            return "a position tensor is computed after the first candidate layer"
        cut_nodes = sorted(set(pos_cuts), key=order.__getitem__) + cut_nodes
        cut_order = [order[c] for c in cut_nodes]
        # partition: segment k holds the nodes after cut k-1 up to and including cut k
        seg_of: dict[fx.Node, int] = {}
        segs = [Segment(i, [], [], []) for i in range(len(cut_nodes) + 1)]
        for n in graph.nodes:
            if n.op == "placeholder":
                self.placeholders.append(n)
                seg_of[n] = -1
            elif n.op == "output":
                self.output = n
            else:
                k = bisect.bisect_left(cut_order, order[n])
                seg_of[n] = k
                segs[k].nodes.append(n)
        for k, layer in enumerate(self.cuts):
            segs[k + len(cut_nodes) - len(self.cuts)].cut = layer
        for layer, node in score_nodes.items():
            segs[seg_of[node]].scores[layer] = node
        for seg in segs:
            ins: dict[fx.Node, None] = {}
            for n in seg.nodes:
                for a in n.all_input_nodes:
                    if seg_of[a] != seg.index:
                        ins[a] = None
            seg.inputs = list(ins)
        needed_later: dict[fx.Node, int] = {}
        for seg in segs:
            for a in seg.inputs:
                needed_later[a] = max(needed_later.get(a, -1), seg.index)
        for a in self.output.all_input_nodes:
            needed_later[a] = len(segs)
        masks = {m for c in self.cuts if isinstance(m := site_mask(sites[c])[0], fx.Node)}  # the runner reads them
        for seg in segs:
            outs = [n for n in seg.nodes if needed_later.get(n, -1) > seg.index]
            outs += [n for n in seg.scores.values() if n not in outs]
            outs += [n for n in seg.nodes if n in masks and n not in outs]
            seg.outputs = outs
        # how each value that can cross a gate is carried to the shorter segments
        for n in {a for seg in segs[1:] for a in seg.inputs}:
            v = val(n)
            if v is None and n.op == "call_function" and n.target in _SHAPE_OF_INPUT and n.args:
                v = val(n.args[0])     # an op the rewrite inserted: same shape as its input
            if v is None and n.op != "placeholder":
                return f"'{n.name}' crosses a gate without a recorded shape; the gate cannot tell its token dims"
            if isinstance(v, torch.Tensor):
                if any(_mentions(d, length) and not _same(d, length) for d in v.shape):
                    return f"'{n.name}' has a size derived from the prompt length ({tuple(v.shape)})"
                dims = tuple(d for d in range(v.dim()) if _same(v.shape[d], length))
                self.transform[n] = ("gather", dims) if dims else ("keep",)
            elif _same(v, length):
                self.transform[n] = ("length",)
            elif _mentions(v, length):
                return f"'{n.name}' = {v} is derived from the prompt length; the gate cannot carry it"
            else:
                self.transform[n] = ("keep",)
        self.seg_of = seg_of
        self.tokens = next((s.tokens for s in sites.values() if s.tokens is not None), None)
        self.ph_dims = {}
        for n in self.placeholders:
            v = val(n)
            if isinstance(v, torch.Tensor):
                if any(_mentions(d, length) and not _same(d, length) for d in v.shape):
                    return f"input '{n.name}' has a size derived from the prompt length ({tuple(v.shape)})"
                self.ph_dims[n] = tuple(d for d in range(v.dim()) if _same(v.shape[d], length))
            elif _same(v, length):
                self.ph_dims[n] = "length"
            elif _mentions(v, length):
                return f"input '{n.name}' = {v} is derived from the prompt length"
        # the graph outputs that hold each sliding layer's stored K/V (after the rewrite's compact)
        self.stored = {}
        out_nodes = set(self.output.all_input_nodes)
        for node in graph.nodes:
            if node.target is torch.ops.kvpass.compact.default and sites.get(node.args[6]) is not None \
                    and sites[node.args[6]].sliding_window:
                self.stored[node.args[6]] = _outputs_from(node, out_nodes)
        # a kvpass.SlotCache: each layer's slot positions and counts (inputs the segments write in place)
        self.slots = {node.args[10]: (node.args[2], node.args[3]) for node in graph.nodes
                      if node.target is torch.ops.kvpass.slot_prefill.default}
        if any(p.op != "placeholder" or c.op != "placeholder" for p, c in self.slots.values()):
            return "the SlotCache's positions are not graph inputs (the gate could not record true positions)"
        # the runner drops each value after the last segment that reads it (a residual stream per layer boundary
        # is 1 GiB at 128k tokens); graph outputs and the position tensors a second pass reads stay
        self.out_nodes = out_nodes
        keep = out_nodes | set(self.pos_nodes)
        self.free_after: list[list[fx.Node]] = [[] for _ in segs]
        for seg in segs:
            for x in seg.outputs:
                if x not in keep:
                    self.free_after[max(needed_later.get(x, -1), seg.index)].append(x)
        self.length = length
        self.segments = segs
        for seg in segs:
            seg.gm = _build(self.gm, seg)
        return None

    # -- run time ----------------------------------------------------------------------------------
    def precompile(self, example_inputs) -> None:
        """Compile every segment now, inside the backend call, with the graph's own fake inputs: a
        dynamic graph's segments are then compiled once for all lengths, and serve the gathered
        tokens too (the length symbol is an input). Segments whose inputs lack fake values, and the
        short versions of static graphs, are compiled on first use with the real inputs instead.
        The graph's inputs are Dynamo's ``example_inputs`` (its backend fake mode: a float attribute
        Dynamo left unspecialized is a 0-d tensor whose ``item()`` only that mode's fake can answer)."""
        given = dict(zip(self.placeholders, example_inputs))
        for seg in self.segments:
            fakes = [given[x] if x in given else val(x) for x in seg.inputs]
            if all(isinstance(f, (Tensor, int, float, torch.SymInt, torch.SymFloat)) for f in fakes):
                seg.compiled, seg.fakes = self.compile_segment(seg.gm, fakes), fakes

    def _widened(self, seg: Segment, ins: list):
        """``seg``'s compiled function for inputs that a gather widened: a tensor shared by the batch
        (batch dim 1 in the trace, e.g. the RoPE tables of ``position_ids [1, L]``) becomes one row per
        sequence once each row keeps its own tokens. The segment is compiled again (once per batch size)
        with those inputs' fakes widened, the batch dim taken from an input that has it; ``None`` when
        nothing was widened (the precompiled function serves)."""
        wide = [i for i, (f, x) in enumerate(zip(seg.fakes, ins)) if isinstance(f, Tensor) and isinstance(x, Tensor)
                and f.dim() > 0 and isinstance(f.shape[0], int) and f.shape[0] == 1 and x.shape[0] != 1]
        if not wide:
            return None
        key = ("widened", seg.index, tuple(int(ins[i].shape[0]) for i in wide))
        if key not in self.compiled:
            fakes = list(seg.fakes)
            for i in wide:
                with fakes[i].fake_mode:
                    b = next((f.shape[0] for f, x in zip(seg.fakes, ins) if isinstance(f, Tensor) and f.dim() > 0
                              and isinstance(x, Tensor) and isinstance(f.shape[0], torch.SymInt)
                              and x.shape[0] == ins[i].shape[0]), int(ins[i].shape[0]))
                    fakes[i] = fakes[i].new_empty((b, *fakes[i].shape[1:]))
            self.compiled[key] = self.compile_segment(seg.gm, fakes)
        return self.compiled[key], [x.contiguous() if i in wide else x for i, x in enumerate(ins)]

    def _run(self, seg: Segment, n: int | None, length: int, ins: list):
        dynamic = isinstance(self.length, torch.SymInt)
        if (n is None or dynamic) and seg.compiled is not None:
            widened = self._widened(seg, ins)
            if widened is not None:
                fn, ins = widened
                return fn(*ins)
            return seg.compiled(*ins)
        if n is None or dynamic:
            gm = seg.gm
        else:
            if n not in seg.short:
                seg.short[n] = _build(self.gm, seg, (length, n))
            gm = seg.short[n]
        key = (seg.index, n, tuple(tuple(x.shape) if isinstance(x, Tensor) else x if isinstance(x, (int, float))
                                   else type(x).__name__ for x in ins))
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = self.compile_segment(gm, ins)
        return fn(*ins)  # compile_fx's result takes positional inputs (it sets _boxed_call for Dynamo's wrapper)

    def __call__(self, *args):
        env: dict[fx.Node, object] = dict(zip(self.placeholders, args))
        orig: dict[fx.Node, object] = {}
        history: dict[int, Tensor] = {}
        ctx: dict = {}
        # a SlotCache layer may not hold what the first pass of a two-pass policy computes: its second
        # pass rewrites every layer's slots (kvpass.cache.slots.slot_prefill skips a write that overflows)
        self.runtime.first_pass, self.runtime.overflow = self.two_pass, None
        try:
            sel, n, gate_layer, length = self._first_pass(env, orig, history, ctx)
        finally:
            self.runtime.first_pass = False
        if sel is None and self.runtime.overflow is not None:
            raise ValueError(f"kvpass SlotCache: layer {self.runtime.overflow} keeps the whole prompt (the "
                             f"selection layer did not fire) but holds fewer slots; build the cache with a larger "
                             f"max_length")
        if length is None:
            length = int(self.length)
        shift = length - n if self.two_pass and self.renumber and sel is not None else 0
        self.runtime.gate = GateInfo(gate_layer, length, n or length, self.cuts, ctx.get("ratios", {}),
                                     2 if self.two_pass and sel is not None else 1, shift)
        if sel is not None and self.two_pass:
            env, orig = self._second_pass(args, env, sel, n, length), {}
        if sel is not None:
            true = ctx["kv_pos"].gather(1, sel)
            if self.two_pass:
                true = torch.arange(n, device=sel.device).expand_as(sel) if self.renumber else true
                self._record(-1, true, n if self.renumber else length, length, env, shift)
            else:
                self._record(gate_layer, true, length, length, env)
        return fx.node.map_aggregate(self.output.args[0],
                                     lambda x: orig.get(x, env[x]) if isinstance(x, fx.Node) else x)

    def _first_pass(self, env: dict, orig: dict, history: dict, ctx: dict):
        """Run the segments, gathering the selected tokens at the gate when it fires (a two-pass policy
        stops there); ``env`` / ``orig`` / ``history`` / ``ctx`` are filled in place. Returns
        ``(selected indices or None, tokens kept or None, selection layer or None, prompt length)``."""
        policy = self.policy
        n = sel = gate_layer = length = None
        for seg in self.segments:
            for x in self.free_after[seg.index - 1] if seg.index else ():
                env.pop(x, None)
            outs = self._run(seg, n, length, [env[x] for x in seg.inputs])
            env.update(zip(seg.outputs, outs))
            del outs
            if seg.cut is None or n is not None:
                continue
            if length is None:
                length = int(env[self.sites[seg.cut].residual].shape[1])
                keep = min(policy.budget, length)
            for layer in sorted(seg.scores):
                history[layer] = env[seg.scores[layer]]
            if keep >= length:
                continue  # everything fits the budget: nothing to prune
            if "kv_pos" not in ctx:
                mask = site_mask(self.sites[seg.cut])[0]
                ctx["kv_pos"] = _masked_positions(env[mask] if isinstance(mask, fx.Node) else None,
                                                  history[seg.cut].shape[0], length, history[seg.cut].device)
            if policy.gate_fires(seg.cut, history, keep, ctx):
                sel = policy.gate_select(history[seg.cut], keep, ctx)
                gate_layer, n = seg.cut, keep
                if self.two_pass:
                    break
                later = {x for s in self.segments[seg.index + 1:] for x in s.inputs
                         if self.seg_of[x] <= seg.index}
                for x in later:
                    t = self.transform.get(x, ("keep",))
                    if t[0] == "keep":
                        continue
                    if x in self.out_nodes:   # the graph returns it at full length
                        orig[x] = env[x]
                    env[x] = n if t[0] == "length" else _take(env[x], sel, t[1])
        return sel, n, gate_layer, length

    def _second_pass(self, args, first: dict, sel: Tensor, n: int, length: int) -> dict:
        """Prefill again from layer 0 with only the selected tokens (GemFilter): token ids, masks and
        embeddings gathered; position and cache-index inputs become 0..n-1 (cache indices of the new,
        shorter cache); the RoPE positions are the original ones (``asl_2pass``) or 0..n-1
        (``gemfilter``, renumbered)."""
        env: dict = {}
        for ph, x in zip(self.placeholders, args):
            dims = self.ph_dims.get(ph, ())
            if dims == "length":
                env[ph] = n
            elif not dims or not isinstance(x, Tensor):
                env[ph] = x
            elif ph is self.tokens or x.is_floating_point() or x.dtype == torch.bool:
                env[ph] = _take(x, sel, dims)
            else:
                env[ph] = _renumber(ph.name, x, sel, dims, length)
        originals = {p: _take(first[p], sel, self.ph_dims.get(p) or self.transform_dims(p))
                     for p in self.pos_nodes if not self.renumber}
        for p in self.pos_nodes:
            if p.op == "placeholder" and p in originals:
                env[p] = originals[p]
        for seg in self.segments:
            outs = self._run(seg, n, length, [env[x] for x in seg.inputs])
            env.update(zip(seg.outputs, outs))
            for p in originals:
                if p in env and p.op != "placeholder" and self.seg_of.get(p) == seg.index:
                    env[p] = originals[p]
        return env

    def transform_dims(self, node) -> tuple:
        t = self.transform.get(node)
        if t is None or t[0] != "gather":
            v = val(node)
            if v is None and node.args:   # an op the rewrite inserted (true_positions): its input's shape
                v = val(node.args[0])
            return tuple(d for d in range(v.dim()) if _same(v.shape[d], self.length))
        return t[1]

    def _record(self, gate_layer: int, true: Tensor, seen: int, length: int, env: dict, shift: int = 0) -> None:
        """Deeper layers stored (some of) the selected tokens: what each recorded is an index among the
        ``n`` tokens it computed (all of them, or a sliding layer's last ``W - 1``); record their true
        positions ``true [B, n]`` (-1 = padding) and ``seen`` (renumbered: the positions are ``0..n-1``;
        a SlotCache counts the ``seen + shift`` tokens of the prompt, as ``generate`` does, and moves
        positions back by ``shift`` on the device, see ``shift_slot_positions``). HF sizes every sliding
        layer's decode mask for ``min(L, W - 1)`` entries (from the count of tokens seen), so a sliding
        layer that stored fewer gets empty slots in front, in its K/V outputs (``env``) and its record
        (position -1: never visible, dropped first)."""
        st = self.runtime.state
        for layer in sorted(self.sites):
            if layer <= gate_layer:
                continue
            if layer in self.slots:    # a SlotCache layer: its slots hold local indices 0..n-1 in order
                pos, count = (env[x] for x in self.slots[layer])
                pos.copy_(_true_of(pos, true))
                count[:, 0], count[:, 2] = seen + shift, shift
                continue
            ls = st.layer(layer)
            if ls is None:
                continue
            b, hkv, m = ls.pos.shape
            pos = _true_of(ls.pos, true).contiguous()
            extra = min(length, self.sites[layer].sliding_window - 1) - m if layer in self.stored else 0
            if extra > 0:
                for x in self.stored[layer]:
                    t = env[x]
                    env[x] = torch.cat([t.new_zeros(*t.shape[:-2], extra, t.shape[-1]), t], -2)
                pos = torch.cat([pos.new_full((b, hkv, extra), -1), pos], -1)
            st.set_layer(layer, pos, seen, fresh=True)


def _true_of(local: Tensor, true: Tensor) -> Tensor:
    """``local [B, H_kv, m]`` indices among the tokens a deeper layer computed (-1 = empty) -> their true
    positions ``true [B, n]``, on ``local``'s device and dtype (-1 stays -1)."""
    b = local.shape[0]
    idx = local.clamp_min(0).reshape(b, -1).long().to(true.device)
    pos = true.expand(b, -1).gather(1, idx).view(local.shape).to(local.device, local.dtype)
    return pos.masked_fill(local < 0, -1)


def _outputs_from(node: fx.Node, outputs: set) -> list[fx.Node]:
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


def _take(x, sel: Tensor, dims: tuple) -> Tensor:
    """``x`` restricted to the selected tokens ``sel [B, n]`` along each of its token dims."""
    b, n = sel.shape
    sel = sel.to(x.device)
    for d in dims:
        if d == 0 or x.dim() == 1:
            if b > 1 and not bool((sel == sel[:1]).all()):
                raise RuntimeError("kvpass gate: a batch-shared token tensor cannot take per-row selections")
            x = x.index_select(d, sel[0])
            continue
        if x.shape[0] == 1 and b > 1:
            x = x.expand(b, *x.shape[1:])
        shape = [b] + [1] * (x.dim() - 1)
        shape[d] = n
        idx = sel.view(shape).expand(*[x.shape[i] if i != d else n for i in range(x.dim())])
        x = x.gather(d, idx)
    return x


_SHAPE_OF_INPUT = (torch.ops.kvpass.true_positions.default, torch.ops.kvpass.shift_positions.default)


def _after_fix(pos: fx.Node) -> fx.Node:
    """The position tensor RoPE reads: ``true_positions(pos)`` when the rewrite routed it through one
    (it would move replaced positions by ``seen - first``), else ``pos`` itself."""
    for u in pos.users:
        if u.op == "call_function" and u.target is torch.ops.kvpass.true_positions.default:
            return u
    return pos


def _renumber(name: str, x: Tensor, sel: Tensor, dims: tuple, length: int) -> Tensor:
    """An integer input along the prompt: positions / cache indices ``0..L-1`` become ``0..n-1``;
    a 0/1 attention mask is gathered; anything else is refused (never guessed)."""
    if len(dims) == 1:
        d = dims[0]
        ar = torch.arange(length, device=x.device)
        shape = [1] * x.dim()
        shape[d] = length
        if bool((x == ar.view(shape)).all()):
            shape[d] = sel.shape[1]
            return torch.arange(sel.shape[1], device=x.device, dtype=x.dtype).view(shape).expand(
                *[s if i != d else sel.shape[1] for i, s in enumerate(x.shape)]).contiguous()
    if bool(((x == 0) | (x == 1)).all()):
        return _take(x, sel, dims)
    raise RuntimeError(f"kvpass gate: the second prefill cannot tell what input '{name}' is (neither "
                       f"positions 0..L-1 nor a 0/1 mask; left-padded positions are not supported)")


def _masked_positions(mask, b: int, length: int, device) -> Tensor:
    pos = torch.arange(length, device=device).expand(b, length)
    valid = _runtime.key_validity(mask, b, length)
    return pos if valid is None else torch.where(valid, pos, torch.full_like(pos, -1))




def _check(sites, cuts) -> str | None:
    """Structural checks that need no rewrite: the gate's places, lengths, ambiguity, layer order."""
    by_layer = {s.layer: s for s in sites}
    cut_nodes = []
    for layer in cuts:
        res = by_layer[layer].residual
        if res is None:
            return f"layer {layer}: no residual add after the attention output (the gate's place)"
        v = val(res)
        if not (isinstance(v, torch.Tensor) and v.dim() == 3 and _same(v.shape[1], by_layer[layer].q_len)):
            return f"layer {layer}: the residual stream at '{res.name}' is not [batch, tokens, hidden]"
        cut_nodes.append(res)
    length = by_layer[cuts[0]].q_len
    for s in sites:
        if not _same(s.q_len, length):
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
            return (f"static graph whose prompt length {length} equals a model dimension, so its literal sizes "
                    f"are ambiguous; compile with dynamic=True or use another prompt length")
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
        return (f"policy '{policy.name}' declares Needs(gates=True) without the GatedPolicy protocol "
                f"(kvpass.policies.contract: budget, window, layer, gate_layers, gate_fires, gate_select)")
    observe, cuts = policy.gate_layers(len(sites))
    if not cuts:
        forced = policy.layer
        if forced >= 0:
            return (f"parameter 'layer' = {forced} is not a selection layer of this {len(sites)}-layer model "
                    f"(allowed: 0 to {len(sites) - 2}; a gate after the last layer prunes nothing)")
        return (f"no candidate selection layer in a {len(sites)}-layer model (a gate after the last layer "
                f"prunes nothing)")
    return _check(sites, cuts)


def plan(gm, sites, policy, rt, compile_segment) -> GatedGraph | str:
    """Build the gated runner for a rewritten prefill graph, or say why not."""
    layers = [s.layer for s in sites]
    if not layers:
        return "no attention sites"
    observe, cuts = policy.gate_layers(len(layers))
    if not cuts:
        return "the policy has no candidate layer in this model"
    gated = GatedGraph(gm, sites, policy, rt, observe, cuts, compile_segment)
    why = gated.prepare()
    return why if why else gated
