"""Compile a decoder's repeated layers once: each layer of a graph becomes a call of one shared subgraph.

Dynamo hands the backend a decode step with every decoder layer inlined: at 32 layers of the Llama-3.1-8B
shape, AOTAutograd and Inductor spent 72 of the first compile's 102 s (H100) lowering the same layer 32
times. ``share_layers`` finds the layers in the graph by the module each node came from (the container
whose numbered children own the most nodes, e.g. ``model.layers``), checks that they are the same graph
(the same operations on inputs of the same kinds), and replaces each layer's nodes with
``torch.ops.higher_order.invoke_subgraph(layer, name, *inputs)``, one subgraph module shared by all layers
of one form. AOTAutograd traces that subgraph once per name and Inductor lowers and generates its code
once; the step calls it once per layer. (This is what ``torch.compiler.nested_compile_region`` does for a
function marked in model code; here the backend marks the layers itself, so no model code changes.)

A layer whose form differs (a dense first layer, a gate layer, another capacity pattern) gets its own
subgraph, or stays inline if it is the only one of its form. A layer that writes through a custom operator
(``_blocking``: raas's page stamp), or that writes a tensor (its cache) that a node outside it reads
(``_read_outside``), stays inline. The kvpass operators a rewrite inserts carry
no module of their own; they belong to the layer around them. A graph whose layers are not contiguous
runs of nodes, or that holds module attributes, is left as it is (``share_layers`` returns 0).
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

_INDEXED = re.compile(r"(.*?)(?:\.(\d+)|\[(\d+)\])")


def _owners(node: fx.Node) -> list[tuple[str, int]]:
    """(container path, child number) of every numbered module on the node's module stack."""
    out = []
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = _INDEXED.fullmatch(str(path))
        if m:
            out.append((m.group(1), int(m.group(2) or m.group(3))))
    return out


def _layer_tags(nodes: list[fx.Node]) -> list[int | None]:
    """Each node's layer number under the container whose numbered children own the most nodes (a decoder's
    ``model.layers``, not the experts of one layer's MoE block, which has more children), or None."""
    owned: dict[str, int] = {}
    children: dict[str, set[int]] = {}
    owners = [_owners(n) for n in nodes]
    for own in owners:
        for path, i in own:
            owned[path] = owned.get(path, 0) + 1
            children.setdefault(path, set()).add(i)
    if not owned:
        return [None] * len(nodes)
    container = max(owned, key=lambda p: (len(children[p]) > 1, owned[p]))
    if len(children[container]) < 2:
        return [None] * len(nodes)
    tags: list[int | None] = [next((i for p, i in own if p == container), None) for own in owners]
    # nodes with no module (the kvpass operators a rewrite inserted) belong to the layer around them
    for k, n in enumerate(nodes):
        if tags[k] is None and not n.meta.get("nn_module_stack"):
            before = next((t for t in reversed(tags[:k]) if t is not None), None)
            after = next((t for t in tags[k + 1 :] if t is not None), None)
            if before is not None and before == after:
                tags[k] = before
    return tags


def _runs(nodes: list[fx.Node], tags: list[int | None]) -> dict[int, list[fx.Node]] | None:
    """Each layer's nodes, if every layer is one contiguous run of the graph's order."""
    runs: dict[int, list[fx.Node]] = {}
    last = None
    for n, t in zip(nodes, tags):
        if t is not None:
            if t != last and t in runs:
                return None  # layer t resumes after other nodes
            runs.setdefault(t, []).append(n)
        last = t
    return runs


def _value(n: fx.Node):
    return n.meta.get("example_value", n.meta.get("val"))


def _kind(v, symbols: dict) -> tuple:
    """What an input must share with another layer's for one subgraph to serve both: dtype, device,
    static sizes, strides and storage offset, which of them are the same symbol (numbered by first
    appearance), and the value of anything else (the subgraph is traced with the first layer's)."""

    def dim(s):
        if isinstance(s, torch.SymInt):
            return ("s", symbols.setdefault(str(s.node.expr), len(symbols)))
        return int(s)

    if isinstance(v, torch.Tensor):
        return (
            "t",
            v.dtype,
            str(v.device),
            tuple(dim(s) for s in v.shape),
            tuple(dim(s) for s in v.stride()),
            dim(v.storage_offset()),
            v.requires_grad,
        )
    if isinstance(v, torch.SymInt):
        return ("i", dim(v))
    return ("v", type(v).__name__, repr(v))


class _Layer:
    """One layer's run of nodes, its inputs (values from outside, in order of first use), its outputs
    (its values used outside) and its form (equal forms can share one subgraph)."""

    def __init__(self, run: list[fx.Node]):
        inside = set(run)
        self.run = run
        self.inputs: list[fx.Node] = []
        index: dict[fx.Node, tuple] = {}
        for k, n in enumerate(run):
            index[n] = ("r", k)

        def ref(a):
            if a not in index:
                index[a] = ("in", len(self.inputs))
                self.inputs.append(a)
            return index[a]

        steps = []
        for n in run:
            args = fx.node.map_aggregate(n.args, lambda a: ref(a) if isinstance(a, fx.Node) else a)
            kwargs = fx.node.map_aggregate(n.kwargs, lambda a: ref(a) if isinstance(a, fx.Node) else a)
            steps.append((n.op, n.target, repr(args), repr(kwargs)))
        self.outputs = [n for n in run if any(u not in inside for u in n.users)]
        symbols: dict = {}
        kinds = tuple(_kind(_value(a), symbols) for a in self.inputs)
        self.form = (tuple(steps), kinds, tuple(index[o] for o in self.outputs))


def _blocking(n: fx.Node, mutating: set[str]) -> bool:
    """A node that writes through a custom (non-ATen) operator keeps its layer inline: AOTAutograd refuses such
    an operator inside a subgraph ("a custom (non-ATen) operator whose output has alias annotations", torch 2.11
    and 2.13; a ``triton_op`` too, and raas's page stamp is one). Sharing the layer's parts around the node fails
    in Inductor instead (its fake-tensor update after reinplacing the node wants every call of a subgraph to
    have the same size symbols, and each layer's cache has its own). The operator is either the node's target
    or called by name from a Python function the rewrite put in the graph (a policy's slot hook); a name shared
    by another operator only keeps a layer inline, which is always correct."""
    fn = n.target
    if isinstance(fn, torch._ops.OpOverload):
        return fn._schema.is_mutable and fn.namespace != "aten"
    code = getattr(fn, "__code__", None)
    return code is not None and bool(set(_names_used(code)) & mutating)


def _written(layer: _Layer) -> list[int]:
    """Positions of the inputs the layer may write in place (its cache): an input shares its storage with a
    tensor that a node of the layer writes (``_writes``). Read from the example values Dynamo attached, which
    keep views on their input's storage; nothing is run."""
    inputs: dict = {}
    for k, a in enumerate(layer.inputs):
        v = _value(a)
        if isinstance(v, torch.Tensor):
            inputs.setdefault(_storage(v), []).append(k)
    out: set[int] = set()
    for n in layer.run:
        for v in _writes(n):
            out.update(inputs.get(_storage(v), ()))
    return sorted(out)


def _storage(v: torch.Tensor):
    return StorageWeakRef(v.untyped_storage())


def _writes(n: fx.Node) -> list[torch.Tensor]:
    """The tensors a node may write: an in-place method's or function's first argument (``x.add_``,
    ``torch.Tensor.copy_``, ``x[i] = y``), an ``out=``, an operator's arguments its schema marks written, and
    every tensor passed to a Python function of no torch namespace (the rewrite's cache writes and policy
    hooks, whose effects nothing declares)."""

    def tensors(a):
        found = []
        fx.node.map_aggregate(a, lambda x: found.append(_value(x)) if isinstance(x, fx.Node) else None)
        return [v for v in found if isinstance(v, torch.Tensor)]

    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")  # add_, copy_, not __setitem__
    first = tensors(n.args[:1])
    if n.op == "call_method":
        return first if in_place else []
    if n.op != "call_function":
        return []
    written = tensors(n.kwargs.get("out"))
    if isinstance(t, torch._ops.OpOverload):
        for k, arg in enumerate(t._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += tensors(n.args[k] if k < len(n.args) else n.kwargs.get(arg.name))
        return written
    if t is operator.setitem or in_place:
        return written + first
    module = getattr(t, "__module__", None) or ""
    if module.split(".")[0] in ("torch", "_operator", "operator", "builtins", "math"):
        return written
    return tensors((n.args, n.kwargs))


def _read_outside(layer: _Layer, written: list[int]) -> bool:
    """Whether a tensor the layer writes is also read by a node outside the layer (e.g. the position of the
    step taken from layer 0's token count). Such a layer stays inline: Inductor does not see the writes
    inside a subgraph call, and may compute that outside read after the call (torch 2.11 and 2.13; on the
    Gemma-3 shape the global layer's RoPE then used the next position)."""
    run = set(layer.run)
    return any(u not in run for k in written for u in layer.inputs[k].users)


def _mutating_kvpass_ops() -> set[str]:
    """Short names of kvpass's registered operators that write to an argument."""
    out = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualified.partition("::")
        if ns == "kvpass":
            op = getattr(getattr(torch.ops.kvpass, name.split(".")[0], None), "default", None)
            if op is not None and op._schema.is_mutable:
                out.add(name.split(".")[0])
    return out


def _names_used(code) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names += _names_used(const)
    return names


def _subgraph(layer: _Layer) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(layer.inputs):
        p = g.placeholder(f"in_{k}")
        p.meta = dict(a.meta)
        env[a] = p
    for n in layer.run:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] for o in layer.outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def shared_copy(gm: fx.GraphModule) -> tuple[fx.GraphModule | None, int]:
    """A copy of ``gm`` whose repeated layers call shared subgraphs, and how many do; (None, 0) where no
    layer repeats (``gm`` itself is never changed: the caller compiles it as it is if the copy fails)."""
    copy = _copy(gm)
    count = share_layers(copy)
    return (copy, count) if count else (None, 0)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a copy of its graph, keeping what Dynamo attached to the module and its placeholders
    (``meta["dynamo_compile_id"]``, ``_param_name_to_source``, each input's ``_dynamo_source``).
    AOTAutograd reads them to tell parameters and static-address caches from other inputs; without them
    CUDA graphs copied every weight and cache into their own buffers at each replay (H200, 32 layers:
    18.9 ms a step against 7.2)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    for name, value in vars(gm).items():
        if name not in vars(copy):
            setattr(copy, name, value)
    return copy


def share_layers(gm: fx.GraphModule) -> int:
    """Replace every repeated layer of ``gm`` by a call of its form's shared subgraph (see the module's
    docstring). Returns how many layers now call a shared subgraph (0: the graph is unchanged)."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module", "get_attr")]
    if any(n.op in ("call_module", "get_attr") for n in nodes):
        return 0
    runs = _runs(nodes, _layer_tags(nodes))
    if not runs or len(runs) < 2:
        return 0
    mutating = _mutating_kvpass_ops()
    layers = [_Layer(run) for _, run in sorted(runs.items()) if not any(_blocking(n, mutating) for n in run)]
    forms: dict[tuple, list[_Layer]] = {}
    for lay in layers:
        forms.setdefault(lay.form, []).append(lay)
    groups = []
    for group in forms.values():
        if len(group) < 2:
            continue
        written = _written(group[0])
        group = [lay for lay in group if not _read_outside(lay, written)]
        if len(group) > 1:
            groups.append(group)
    # every subgraph is built before any layer is replaced: a replacement rewires the next layer's nodes
    for k, group in enumerate(groups):
        gm.register_module(f"kvpass_layer_{k}", _subgraph(group[0]))
    shared, moved = 0, {}
    for k, group in enumerate(groups):
        for lay in group:
            _replace(graph, lay, f"kvpass_layer_{k}", moved)
            shared += 1
    if shared:
        graph.lint()
        gm.recompile()
    return shared


def _replace(graph: fx.Graph, lay: _Layer, name: str, moved: dict) -> None:
    """Put the call in place of the layer's nodes; ``moved`` maps the outputs of layers replaced before
    (an earlier layer's output is this one's input) to the call's results."""
    with graph.inserting_before(lay.run[0]):
        sub = graph.get_attr(name)
        inputs = [moved.get(a, a) for a in lay.inputs]
        call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (sub, name, *inputs))
        call.meta["example_value"] = tuple(_value(o) for o in lay.outputs)
        outs = []
        for j, o in enumerate(lay.outputs):
            get = graph.call_function(operator.getitem, (call, j))
            get.meta = dict(o.meta)
            outs.append(get)
    run = set(lay.run)
    for o, new in zip(lay.outputs, outs):
        o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in run)
        moved[o] = new
    for n in reversed(lay.run):
        graph.erase_node(n)
