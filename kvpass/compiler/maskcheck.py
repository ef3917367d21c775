"""Is a model's attention mask exactly the causal mask? Checked on the graph, at compile time.

Transformers materialises a ``[B, 1, N, N]`` mask for eager attention, and for SDPA too under
torch.compile on some versions (on torch 2.11 its ``_ignore_causal_mask_sdpa`` does not skip while
Dynamo traces): 16 GiB of bool at 128k tokens, before SDPA converts it. When that mask is plain
causal attention, kvpass's ``attention`` op can take the causal mode instead and the mask's
computation becomes dead code.

``is_causal_mask(node)`` says so only when it has checked it:

1. the mask depends on no tensor's values, only on sizes, SymInts and constants (a padding mask,
   position ids or a bias buffer among its inputs rule it out);
2. the mask's own subgraph, evaluated at two probe sizes, equals bottom-right causal attention
   exactly (additive masks: 0 where visible, at most -1e30 where not; any other value, e.g. a
   position bias, rules it out). The probes are larger than every integer constant of the subgraph
   plus a margin, so a sliding window or an attention chunk written as a constant shows up; in a
   graph specialised to static sizes there is nothing to substitute and the check runs at those
   sizes, which are the only ones that graph ever sees.

Anything the check cannot evaluate (an op that fails on concrete inputs, probe masks over
``MAX_PROBE`` entries) answers False: the model's mask is kept. A static-shape graph too large to
check (a long prompt compiled without ``dynamic=True``) says so once.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from kvpass.ops import CAUSAL_BOTTOM_RIGHT

METADATA = {"size", "dim", "shape", "device", "dtype", "numel"}
MAX_PROBE = 1 << 22  # entries of one probe mask


def _example(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _is_metadata(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in METADATA
    return n.op == "call_function" and (
        (n.target is getattr and n.args[1] in METADATA)
        or n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)
    )


def _subgraph(node: fx.Node):
    """The mask's ancestors, in graph order, and its leaves (SymInt inputs and metadata reads);
    None when a tensor's values are among its inputs."""
    seen, todo, leaves = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            return None
        if n.op == "placeholder":
            if isinstance(_example(n), torch.Tensor):
                return None
            leaves.add(n)
            continue
        if _is_metadata(n):
            leaves.add(n)
            continue
        todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__), leaves


def _concrete(value, subs: dict):
    """A leaf's example value (SymInt, int, torch.Size, tuple) at the substituted symbol values."""
    if isinstance(value, torch.SymInt):
        return int(value.node.expr.xreplace(subs))
    if isinstance(value, (tuple, list, torch.Size)):
        out = [_concrete(v, subs) for v in value]
        return torch.Size(out) if isinstance(value, torch.Size) else type(value)(out)
    return value


def _flat(value) -> list:
    if isinstance(value, (tuple, list, torch.Size)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _symbols(values) -> set:
    return {s for v in values for x in _flat(v) if isinstance(x, torch.SymInt) for s in x.node.expr.free_symbols}


def _literals(nodes) -> list[int]:
    flat = []
    for n in nodes:
        fx.node.map_aggregate((n.args, n.kwargs), lambda x: flat.append(x) or x)
    return [abs(x) for x in flat if isinstance(x, int) and not isinstance(x, bool)]


def _evaluate(nodes, leaves, target: fx.Node, subs: dict):
    env = {}
    for n in nodes:
        if n in leaves:
            env[n] = _concrete(_example(n), subs)
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            raise ValueError(n.op)
    return env[target]


def _causal(mask: torch.Tensor) -> bool:
    if mask.dim() != 4:
        return False
    q, kv = mask.shape[-2:]
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.is_floating_point():
        if not ((mask == 0) | (mask <= -1e30)).all():
            return False
        visible = mask == 0
    else:
        return False
    want = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(kv - q)
    return bool((visible == want).all())


def is_causal_mask(node: fx.Node | None) -> bool:
    """True when ``node`` (an attention mask in a Dynamo graph) is checked to be exactly the
    bottom-right causal mask at every size the graph can run with (see the module docstring).
    The answer is kept in the node's meta: every layer of a model shares one mask node."""
    if node is None or not isinstance(_example(node), torch.Tensor):
        return False
    if _CACHED not in node.meta:
        node.meta[_CACHED] = _check(node)
    return node.meta[_CACHED]


_CACHED = "kvpass_causal_mask"


def _check(node: fx.Node) -> bool:
    found = _subgraph(node)
    if found is None:
        return False
    nodes, leaves = found
    syms = sorted(_symbols([_example(n) for n in leaves] + [_example(node).shape]), key=str)
    base = max(_literals(nodes), default=0) + 5
    probes = (
        [{s: sympy.Integer(base + step * i + shift) for i, s in enumerate(syms)} for step, shift in ((3, 0), (7, 11))]
        if syms
        else [{}]
    )
    try:
        for subs in probes:
            shape = _concrete(_example(node).shape, subs)
            if shape.numel() > MAX_PROBE:
                if not syms:
                    from kvpass.errors import warn_once

                    warn_once(
                        f"kvpass: the model's attention mask {tuple(shape)} in a static-shape graph is too large "
                        f"to check for plain causality, so it is kept (it costs memory and time in the "
                        f"prefill: 16 GiB at 128k tokens); compile with torch.compile(..., dynamic=True)"
                    )
                return False
            with torch.no_grad():
                if not _causal(_evaluate(nodes, leaves, node, subs)):
                    return False
    except Exception:  # an op the probe cannot run concretely: keep the model's mask
        return False
    return True


def site_mask(site) -> tuple:
    """The mask and causal mode an exact ``attention`` of this site uses: the causal mode in place
    of a materialised mask that is checked to be exactly causal (``kvpass.compiler.maskcheck``), else the
    model's own."""
    if site.mask is not None and is_causal_mask(site.mask):
        return None, CAUSAL_BOTTOM_RIGHT
    return site.mask, site.causal


_OPERATOR_IN_PLACE = {
    "setitem",
    "delitem",
    "iadd",
    "iand",
    "iconcat",
    "ifloordiv",
    "ilshift",
    "imod",
    "imul",
    "imatmul",
    "ior",
    "ipow",
    "irshift",
    "isub",
    "itruediv",
    "ixor",
}


def _has_effect(n: fx.Node) -> bool:
    """Whether a node does something beyond computing its value: the output, an in-place method or function
    (``x[i] = v``, ``out=``), a module call, a mutating or non-aten operator (kvpass's own, whose Python side a
    graph may call), a Python function of its own (``write_slots``). Only torch's and ``operator``'s pure
    functions are not."""
    if n.op in ("output", "call_module"):
        return True
    if n.op == "call_method":
        return n.target.endswith("_")
    if n.op != "call_function":
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverloadPacket):  # torch.ops.ns.op as Dynamo records a direct call
        return t._qualified_op_name.split("::")[0] != "aten" or n.is_impure()
    if isinstance(t, torch._ops.OpOverload):
        return t.namespace != "aten" or n.is_impure()
    module, name = getattr(t, "__module__", None) or "", getattr(t, "__name__", "")
    if module in ("_operator", "operator"):
        return name in _OPERATOR_IN_PLACE
    if module.startswith("torch") and not module.startswith("torch._ops"):
        return n.is_impure() or name.endswith("_") or "out" in n.kwargs
    return True


def mask_is_read(gm: fx.GraphModule) -> bool:
    """Whether the model's attention mask reaches anything the graph does: True unless the graph has the
    mask among its inputs (a placeholder named for ``attention_mask``, one per key of a dict of masks) and
    every use left of it is dead (after kvpass's slot rewrite, a decode step reads the slots by position)."""
    masks = [n for n in gm.graph.nodes if n.op == "placeholder" and "attention_mask" in n.name.lower()]
    if not masks:
        return True  # the mask is not where this check can see it: assume it is read
    live: set[fx.Node] = set()
    for n in reversed(gm.graph.nodes):
        if _has_effect(n) or any(u in live for u in n.users):
            live.add(n)
    return any(m in live for m in masks)
