"""``GatedGraph``: the callable the backend returns for a gated prefill graph. It runs the segments in
order; after a candidate layer it asks the policy (``GatedPolicy``) whether the gate fires and, when it does,
carries the selected tokens into the deeper segments (their short versions, compiled on first use), or
prefills again from layer 0 with them (a two-pass policy); then it records the true positions of what every
deeper layer stored."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, fx

from kvpass.cache.runtime import layer_of
from kvpass.cache.slots import DROPPED, SEEN
from kvpass.compiler.detect import val
from kvpass.compiler.fxargs import arg
from kvpass.compiler.gate.checks import places, same
from kvpass.compiler.gate.partition import (
    Segment,
    after_fix,
    build,
    carry,
    free_after,
    insert_scores,
    outputs_from,
    split,
)
from kvpass.compiler.gate.take import masked_positions, renumber, take, true_of
from kvpass.compiler.maskcheck import site_mask


@dataclass
class GateInfo:
    """What the gate did in the last prefill (``Backend.gate_info``)."""

    layer: int | None  # the selection layer, None when nothing was pruned
    length: int  # prompt length L
    kept: int  # tokens the deeper layers computed (L when nothing was pruned)
    candidates: tuple  # layers after which the gate could fire
    ratios: dict  # ASL: layer -> var / var0 per row (list), for the record
    passes: int = 1  # 2: the selected tokens were prefilled again from layer 0
    shift: int = 0  # gemfilter: decode positions passed in are moved back by this much

    def as_dict(self) -> dict:
        return {
            "selection_layer": self.layer,
            "length": self.length,
            "kept": self.kept,
            "candidates": list(self.candidates),
            "ratios": self.ratios,
            "passes": self.passes,
        }


class GatedGraph:
    """The callable the backend returns for a gated prefill graph (see the package docstring)."""

    def __init__(self, gm, sites, policy, rt, observe, cuts, compile_segment) -> None:
        self.gm, self.policy, self.runtime = gm, policy, rt
        self.sites = {s.layer: s for s in sites}
        self.observe, self.cuts = tuple(observe), tuple(cuts)
        self.compile_segment = compile_segment
        self.compiled: dict = {}
        self.segments: list[Segment] = []
        self.length = None
        self.reductions: list[str] = []  # collectives inserted for decisions across heads (kvpass.compiler.tp)

    # -- construction -----------------------------------------------------------------------------
    def prepare(self) -> str | None:
        """Insert the score nodes, split the graph and classify crossing values; a str = why not."""
        graph, sites = self.gm.graph, self.sites
        why = places(list(sites.values()), self.cuts)
        if why:
            return why
        length = sites[self.cuts[0]].q_len
        self.two_pass, self.renumber = self.policy.needs.two_pass, self.policy.needs.renumber
        # a two-pass policy sets the RoPE positions of its second pass: the position tensors derived
        # inside the graph end a segment of their own, so the runner can replace their value
        self.pos_nodes = list(dict.fromkeys(after_fix(s.positions) for s in sites.values() if s.positions is not None))
        if self.two_pass and not self.pos_nodes:
            return "no position tensor behind the RoPE of any layer (a second pass could not place its tokens)"
        pos_cuts = [p for p in self.pos_nodes if p.op != "placeholder"] if self.two_pass else []
        scores = insert_scores(graph, sites, self.observe, int(self.policy.window), self.reductions)
        if isinstance(scores, str):
            return scores
        cut_nodes = [sites[layer].residual for layer in self.cuts]
        order = {n: i for i, n in enumerate(graph.nodes)}
        if pos_cuts and max(order[p] for p in pos_cuts) > order[cut_nodes[0]]:
            return "a position tensor is computed after the first candidate layer"
        masks = {m for c in self.cuts if isinstance(m := site_mask(sites[c])[0], fx.Node)}  # the runner reads them
        parts = split(graph, sorted(set(pos_cuts), key=order.__getitem__) + cut_nodes, self.cuts, scores, masks)
        carried = carry(parts, length)
        if isinstance(carried, str):
            return carried
        self.transform, self.ph_dims = carried
        self.placeholders, self.output, self.seg_of = parts.placeholders, parts.output, parts.seg_of
        self.tokens = next((s.tokens for s in sites.values() if s.tokens is not None), None)
        # the graph outputs that hold each sliding layer's stored K/V (after the rewrite's compact)
        self.out_nodes = set(self.output.all_input_nodes)
        compacts = {
            layer_of(arg(node, 6, "key")): node
            for node in graph.nodes
            if node.target is torch.ops.kvpass.compact.default
        }
        self.stored = {
            layer: outputs_from(node, self.out_nodes)
            for layer, node in compacts.items()
            if sites.get(layer) is not None and sites[layer].sliding_window
        }
        # a kvpass.SlotCache: each layer's slot positions and counts (inputs the segments write in place)
        self.slots = {
            layer_of(arg(node, 10, "key")): (arg(node, 2, "pos"), arg(node, 3, "count"))
            for node in graph.nodes
            if node.target is torch.ops.kvpass.slot_prefill.default
        }
        if any(p.op != "placeholder" or c.op != "placeholder" for p, c in self.slots.values()):
            return "the SlotCache's positions are not graph inputs (the gate could not record true positions)"
        # graph outputs and the position tensors a second pass reads stay to the end
        self.free_after = free_after(parts, self.out_nodes | set(self.pos_nodes))
        self.length = length
        self.segments = parts.segments
        for seg in self.segments:
            seg.gm = build(self.gm, seg)
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
        wide = [
            i
            for i, (f, x) in enumerate(zip(seg.fakes, ins))
            if isinstance(f, Tensor)
            and isinstance(x, Tensor)
            and f.dim() > 0
            and isinstance(f.shape[0], int)
            and f.shape[0] == 1
            and x.shape[0] != 1
        ]
        if not wide:
            return None
        key = ("widened", seg.index, tuple(int(ins[i].shape[0]) for i in wide))
        if key not in self.compiled:
            fakes = list(seg.fakes)
            for i in wide:
                with fakes[i].fake_mode:
                    b = next(
                        (
                            f.shape[0]
                            for f, x in zip(seg.fakes, ins)
                            if isinstance(f, Tensor)
                            and f.dim() > 0
                            and isinstance(x, Tensor)
                            and isinstance(f.shape[0], torch.SymInt)
                            and x.shape[0] == ins[i].shape[0]
                        ),
                        int(ins[i].shape[0]),
                    )
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
                seg.short[n] = build(self.gm, seg, (length, n))
            gm = seg.short[n]
        key = (
            seg.index,
            n,
            tuple(
                tuple(x.shape) if isinstance(x, Tensor) else x if isinstance(x, (int, float)) else type(x).__name__
                for x in ins
            ),
        )
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
            raise ValueError(
                f"kvpass SlotCache: layer {self.runtime.overflow} keeps the whole prompt (the "
                f"selection layer did not fire) but holds fewer slots; build the cache with a larger "
                f"max_length"
            )
        if length is None:
            length = int(self.length)
        shift = length - n if self.two_pass and self.renumber and sel is not None else 0
        self.runtime.gate = GateInfo(
            gate_layer,
            length,
            n or length,
            self.cuts,
            ctx.get("ratios", {}),
            2 if self.two_pass and sel is not None else 1,
            shift,
        )
        if sel is not None and self.two_pass:
            env, orig = self._second_pass(args, env, sel, n, length), {}
        if sel is not None:
            true = ctx["kv_pos"].gather(1, sel)
            if self.two_pass:
                true = torch.arange(n, device=sel.device).expand_as(sel) if self.renumber else true
                self._record(-1, true, n if self.renumber else length, length, env, ctx["kv_pos"], shift)
            else:
                self._record(gate_layer, true, length, length, env, ctx["kv_pos"])
        return fx.node.map_aggregate(
            self.output.args[0], lambda x: orig.get(x, env[x]) if isinstance(x, fx.Node) else x
        )

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
                ctx["kv_pos"] = masked_positions(
                    env[mask] if isinstance(mask, fx.Node) else None,
                    history[seg.cut].shape[0],
                    length,
                    history[seg.cut].device,
                )
            if policy.gate_fires(seg.cut, history, keep, ctx):
                sel = policy.gate_select(history[seg.cut], keep, ctx)
                gate_layer, n = seg.cut, keep
                if self.two_pass:
                    break
                later = {x for s in self.segments[seg.index + 1 :] for x in s.inputs if self.seg_of[x] <= seg.index}
                for x in later:
                    t = self.transform.get(x, ("keep",))
                    if t[0] == "keep":
                        continue
                    if x in self.out_nodes:  # the graph returns it at full length
                        orig[x] = env[x]
                    env[x] = n if t[0] == "length" else take(env[x], sel, t[1])
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
                env[ph] = take(x, sel, dims)
            else:
                env[ph] = renumber(ph.name, x, sel, dims, length)
        originals = {
            p: take(first[p], sel, self.ph_dims.get(p) or self.transform_dims(p))
            for p in self.pos_nodes
            if not self.renumber
        }
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
            if v is None and node.args:  # an op the rewrite inserted (true_positions): its input's shape
                v = val(node.args[0])
            return tuple(d for d in range(v.dim()) if same(v.shape[d], self.length))
        return t[1]

    def _record(
        self, gate_layer: int, true: Tensor, seen: int, length: int, env: dict, prompt: Tensor, shift: int = 0
    ) -> None:
        """Deeper layers stored (some of) the selected tokens: what each recorded is an index among the
        ``n`` tokens it computed (all of them, or a sliding layer's last ``W - 1``); record their true
        positions ``true [B, n]`` (-1 = padding) and ``seen`` (renumbered: the positions are ``0..n-1``;
        a SlotCache counts the ``seen + shift`` tokens of the prompt, as ``generate`` does, and moves
        positions back by ``shift`` on the device, see ``shift_slot_positions``; ``prompt``: the prompt's
        positions, -1 = padding). HF sizes every sliding
        layer's decode mask for ``min(L, W - 1)`` entries (from the count of tokens seen), so a sliding
        layer that stored fewer gets empty slots in front, in its K/V outputs (``env``) and its record
        (position -1: never visible, dropped first)."""
        st = self.runtime.state
        for layer in sorted(self.sites):
            if layer <= gate_layer:
                continue
            if layer in self.slots:  # a SlotCache layer: its slots hold local indices 0..n-1 in order
                pos, count = (env[x] for x in self.slots[layer])
                pos.copy_(true_of(pos, true))
                count[:, SEEN], count[:, DROPPED] = seen + shift, shift
                continue
            ls = st.layer(layer)
            if ls is None:
                continue
            b, hkv, m = ls.pos.shape
            pos = true_of(ls.pos, true).contiguous()
            extra = min(length, self.sites[layer].sliding_window - 1) - m if layer in self.stored else 0
            if extra > 0:
                for x in self.stored[layer]:
                    t = env[x]
                    env[x] = torch.cat([t.new_zeros(*t.shape[:-2], extra, t.shape[-1]), t], -2)
                pos = torch.cat([pos.new_full((b, hkv, extra), -1), pos], -1)
            self.runtime.refuse_uneven_padded(layer, self.sites[layer].sliding_window, pos.shape[-1], prompt)
            st.set_layer(layer, pos, seen, fresh=True)


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
