"""Detection: find every attention site and its KV-cache update in a Dynamo FX graph.

Works on the torch-level graph Dynamo hands a backend, where SDPA, eager attention and the cache
updates look the same on every device. Nothing here matches a model by name: a site is recognised
from the graph's structure.

* SDPA sites are ``scaled_dot_product_attention`` calls.
* Eager sites are found from each ``softmax``: walk up to ``q @ k^T`` (through mask add, logit
  softcapping and scaling) and down to ``p @ v`` (through dtype casts and dropout).
* K/V are followed back through ``repeat_kv`` (index/expand/reshape) and slices to the cache
  update: a ``torch.cat`` along the sequence dim (DynamicCache; a slice of the cat that becomes the
  stored tensor marks a sliding-window layer) or a buffer written by ``index_copy_`` (StaticCache).
* Per site the RoPE producer (the ``cos`` feeding the new keys), the position-id tensor behind it,
  the residual add that consumes the attention output, how the query is positioned
  (``QueryRope``: transformers' rotate-half RoPE with its tables, no rotation, or not recognised)
  and the output projection's weight (``OutProj``: the ``linear`` the heads' outputs reach, or why
  not) are recorded.

Anything unexpected becomes a ``Problem`` naming the node and the failed assumption; the backend
then warns and compiles the graph unchanged.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from kvpass.cache import slots as _cache  # noqa: F401  (registers kvpass::slot_append)
from kvpass.cache.site_facts import CacheKind, HeadSplit, Phase
from kvpass.compiler.fxargs import arg, leading
from kvpass.ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT

SLOT_APPEND = torch.ops.kvpass.slot_append
SLOT_APPEND_ARGS = ("keys", "values", "pos", "count", "k_new", "v_new", "state")  # its first arguments, by name


def is_slot_append(node: fx.Node) -> bool:
    """Whether ``node`` is a ``kvpass.SlotCache``'s own append (``kvpass.cache.slots.slot_append``)."""
    return node.op == "call_function" and node.target in (SLOT_APPEND, SLOT_APPEND.default)


SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention}
SOFTMAX_FUNCS = {F.softmax, torch.softmax}
MATMUL_FUNCS = {torch.matmul, operator.matmul}
ADD_FUNCS = {operator.add, torch.add, operator.iadd}
MUL_FUNCS = {operator.mul, torch.mul}
DIV_FUNCS = {operator.truediv, torch.div}


@dataclass
class Problem:
    """Why a graph was left alone: which node, which assumption failed."""

    node: str
    reason: str

    def __str__(self) -> str:
        return f"node '{self.node}': {self.reason}"


@dataclass(frozen=True)
class QueryRope:
    """How a site's query is positioned before attention reads it (``query_rope``). Rotated as transformers'
    rotate-half RoPE does, ``pre * cos + rotate_half(pre) * sin`` on its first ``cos.shape[-1]`` dims (the others
    passed through): ``pre`` is the query before the rotation (``[B, H, L, D]``, as attention reads ``q``), ``cos``
    / ``sin`` the tables above their casts (``[B or 1, (1,) L, rotary dims]``, in the dtype the model computed
    them in). Not rotated: ``cos`` is None and ``pre`` is ``q`` (it comes from its projection through reshapes,
    casts and constant scalings only). Neither: ``problem`` says which node kvpass does not recognise."""

    pre: fx.Node | None = None
    cos: fx.Node | None = None
    sin: fx.Node | None = None
    problem: str | None = None

    @property
    def rotary(self) -> int:
        """The dims the rotation turns (the tables' width; 0 where the query is not rotated)."""
        return 0 if self.cos is None else int(val(self.cos).shape[-1])


@dataclass(frozen=True)
class OutProj:
    """The weight of a site's output projection (``out_projection``): the ``linear`` (or ``addmm`` / ``matmul``)
    that the attention output reaches through the heads' transpose, reshapes and casts. ``weight`` is the node the
    projection reads, a plain tensor ``[hidden, H * Dv]`` (``transposed``: ``[H * Dv, hidden]``, an ``addmm`` or
    ``matmul`` operand), its column ``h * Dv + d`` the value dim ``d`` of query head ``h``; it comes from a graph
    input or attribute through casts only. Under tensor parallelism it is the rank's shard, the columns of its
    local heads. Not found: ``problem`` says which node kvpass does not recognise."""

    weight: fx.Node | None = None
    transposed: bool = False
    problem: str | None = None


@dataclass
class Site:
    """One attention call and the KV-cache update that feeds it."""

    layer: int  # index in graph order
    attention: str  # "sdpa" | "eager" | "flash"
    out: fx.Node  # node producing the attention output [B, H, Lq, Dv]
    q: fx.Node
    k: fx.Node  # full K as attention reads it, before repeat_kv
    v: fx.Node
    mask: fx.Node | None
    scale: float | fx.Node  # a node when Dynamo made the float dynamic (dynamic=True)
    causal: int  # ops.CAUSAL_NONE / CAUSAL_TOP_LEFT / CAUSAL_BOTTOM_RIGHT
    softcap: float
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int | torch.SymInt
    cache: CacheKind
    sliding_window: int | None = None
    k_past: fx.Node | None = None
    v_past: fx.Node | None = None
    k_new: fx.Node | None = None
    v_new: fx.Node | None = None
    cache_layer: int | None = None  # layer index read off the cache tensor's source, if any
    rope: str | None = None  # name of the cos node feeding the new keys
    positions: fx.Node | None = None  # integer position tensor behind the RoPE producer
    residual: fx.Node | None = None
    phase: Phase = "unknown"
    tokens: fx.Node | None = None  # the graph's input token ids (the embedding's input), if any
    slot: fx.Node | None = None  # a SlotCache's kvpass::slot_append call (k_past/v_past: its slots)
    slot_spec: str = ""  # the policy configuration that SlotCache was built for (Policy.key)
    global_layers: tuple = ()  # layers (graph order) of the graph's non-sliding sites
    tp: HeadSplit | None = None  # kvpass.compiler.tp.TensorParallel: heads/kv_heads are this rank's share
    key: int = -1  # the operators' name for this site (Runtime.add_graph): graph and layer
    erase: list[fx.Node] = field(default_factory=list)  # eager: nodes replaced by the op

    @functools.cached_property
    def q_rope(self) -> QueryRope:
        """How the query is positioned (``query_rope``), matched the first time a policy asks (expected_attention's
        plan, before any rewrite)."""
        return query_rope(self.q)

    @functools.cached_property
    def o_proj(self) -> OutProj:
        """The output projection's weight (``out_projection``), matched the first time a policy asks (criticalkv's
        plan, before any rewrite)."""
        return out_projection(self)

    @property
    def kind(self) -> str:
        return "sliding" if self.sliding_window else "global"

    def row(self) -> dict:
        """Plain-data summary used by ``explain`` and the tests."""
        return {
            "layer": self.layer,
            "phase": self.phase,
            "attention": self.attention,
            "kind": self.kind,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "scale": self.scale.name if isinstance(self.scale, fx.Node) else round(self.scale, 6),
            "softcap": self.softcap,
            "cache": self.cache,
            "sliding_window": self.sliding_window,
            "cache_layer": self.cache_layer,
            "rope": self.rope,
            "positions": self.positions.name if self.positions is not None else None,
            "residual": self.residual.name if self.residual is not None else None,
        }


@dataclass
class Detection:
    sites: list[Site]
    problems: list[Problem]


# ----------------------------------------------------------------------------------------------
# small graph helpers
# ----------------------------------------------------------------------------------------------


def val(node):
    """The example (fake) tensor Dynamo recorded for a node, or None."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value")
    return None


# how Dynamo names a traced ``DTensor.from_local``: the function itself (torch 2.13), or a closure over it that
# torch 2.11's Dynamo defines in torch._dynamo.variables.torch and names "prim from_local" (on the GPU machine's
# torch 2.11 the token ids were not found behind it, and the gate's second prefill refused them)
_FROM_LOCAL = {("from_local", "torch.distributed"), ("prim from_local", "torch._dynamo")}


def local_of(node):
    """The local tensor a ``DTensor.from_local`` wraps (tensor parallelism wraps the token ids before the
    embedding), else ``node``."""
    t = getattr(node, "target", None)
    name, module = getattr(t, "__name__", ""), getattr(t, "__module__", "") or ""
    if (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and any(name == n and module.startswith(m) for n, m in _FROM_LOCAL)
    ):
        return arg(node, 0, "local_tensor", node)
    return node


def is_fn(node, fns) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in fns


def is_method(node, *names) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def upstream(node: fx.Node, found, inputs=lambda n: n.all_input_nodes, limit: int | None = None) -> fx.Node | None:
    """The first node where ``found(n)`` holds, walking up from ``node`` (itself included) through
    ``inputs(n)`` (its data inputs), visiting at most ``limit`` nodes; None if there is none."""
    todo, seen = [node], {node}
    while todo and (limit is None or len(seen) <= limit):
        n = todo.pop()
        if found(n):
            return n
        for a in inputs(n):
            if isinstance(a, fx.Node) and a not in seen:
                seen.add(a)
                todo.append(a)
    return None


def _full_slice(s) -> bool:
    return isinstance(s, slice) and s.start is None and s.stop is None and s.step is None


def strip_repeat_kv(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """Undo HF's ``repeat_kv`` (x[:, :, None].expand(...).reshape(...)); returns base and the chain."""
    if is_method(node, "reshape", "view") and isinstance(node.args[0], fx.Node):
        exp = node.args[0]
        if is_method(exp, "expand") and is_fn(exp.args[0], {operator.getitem}):
            idx = exp.args[0].args[1]
            if (
                isinstance(idx, tuple)
                and len(idx) == 5
                and idx[2] is None
                and all(_full_slice(s) for i, s in enumerate(idx) if i != 2)
            ):
                return exp.args[0].args[0], [node, exp, exp.args[0]]
    return node, []


def seq_slice(node: fx.Node):
    """If node is x[:, :, a:b(, :)] (a slice of the sequence dim only), return (x, slice)."""
    if is_fn(node, {operator.getitem}) and isinstance(node.args[1], tuple):
        idx = node.args[1]
        if (
            len(idx) in (3, 4)
            and isinstance(idx[2], slice)
            and all(_full_slice(s) for i, s in enumerate(idx) if i != 2)
            and idx[2].step in (None, 1)
        ):
            return node.args[0], idx[2]
    return None


def _source_layer(node: fx.Node) -> int | None:
    """Layer index from the cache tensor's Dynamo source, e.g. ``...layers[3].keys``."""
    grapharg = node.meta.get("grapharg")
    src = getattr(grapharg, "source", None)
    name = src.name() if callable(getattr(src, "name", None)) else getattr(src, "name", None)
    if not isinstance(name, str):
        return None
    marker = ".layers["
    if marker not in name:
        return None
    tail = name.rsplit(marker, 1)[1]
    digits = tail.split("]", 1)[0]
    return int(digits) if digits.isdigit() else None


# ----------------------------------------------------------------------------------------------
# cache update
# ----------------------------------------------------------------------------------------------


def _slot_of(site: Site) -> Problem | None | bool:
    """A ``kvpass.SlotCache`` layer: attention reads the new K/V (a prefill) or the slots the layer's
    ``slot_append`` just wrote (decode / append), or their first entries (a cache whose layers differ in
    capacity gives every layer the shortest one's length, the length HF's mask is built for). Fills the
    cache fields (a sliding layer's window is ``slot_append``'s ``window``); False when it is none."""
    k, v = (_slot_read(n) for n in (site.k, site.v))
    for u in k.users:
        if is_slot_append(u):
            keys, values, _pos, _count, k_new, v_new = leading(u, SLOT_APPEND_ARGS[:6])
            if k not in (keys, k_new) or v not in (values, v_new) or (k is keys) != (v is values):
                return Problem(u.name, "attention reads K and V from different places of a SlotCache layer")
            site.cache, site.slot = "slot", u
            site.k_past, site.v_past, site.k_new, site.v_new = keys, values, k_new, v_new
            site.cache_layer = _source_layer(keys) if keys.op == "placeholder" else None
            window = arg(u, 7, "window", 0)
            site.slot_spec = arg(u, 9, "spec", "")
            site.sliding_window = _concrete_int(window) or None  # the layer says it is a sliding ring
            return None
    return False


def _slot_read(node: fx.Node) -> fx.Node:
    """``x`` for ``x[:, :, :n]`` (the leading slots of a SlotCache layer), else the node itself."""
    sliced = seq_slice(node)
    return sliced[0] if sliced is not None and sliced[1].start in (None, 0) else node


def _cache_of(site: Site) -> Problem | None:
    """Fill the cache fields of a site from the K/V nodes; return a Problem if unsure."""
    slot = _slot_of(site)
    if slot is not False:
        return slot
    k, v = site.k, site.v
    if is_fn(k, {torch.cat}) and is_fn(v, {torch.cat}):
        dim = arg(k, 1, "dim", 0)
        k_parts, v_parts = arg(k, 0, "tensors"), arg(v, 0, "tensors")
        if dim not in (-2, 2) or arg(v, 1, "dim", 0) != dim or len(k_parts) != 2:
            return Problem(k.name, "torch.cat feeding attention is not a 2-way concat along the sequence dim")
        site.k_past, site.k_new = k_parts
        site.v_past, site.v_new = v_parts
        site.cache = "dynamic"
        for user in k.users:  # a stored slice x[:, :, -(w-1):] marks a sliding-window layer
            sl = seq_slice(user)
            start = _concrete_int(sl[1].start) if sl else None
            if start is not None and start < 0 and sl[1].stop is None:
                site.sliding_window = 1 - start
        if seq_slice(site.k_past) is not None or _written_inplace(site.k_past):
            site.cache = "static"  # static sliding layer once full: cat(buffer[:, :, 1:], new)
        src = site.k_past
        site.cache_layer = _source_layer(src) if src.op == "placeholder" else None
        return None
    base = k
    sl = seq_slice(k)
    if sl is not None:
        base = sl[0]
    if _written_inplace(base):
        site.cache = "static"
        site.cache_layer = _source_layer(base) if base.op == "placeholder" else None
        for user in base.users:
            if is_method(user, "index_copy_"):
                site.k_new = arg(user, 3, "source")
        return None
    site.cache = "none"
    return None


def _concrete_int(x) -> int | None:
    """An int, or the value behind a symbolic int node (a model constant Dynamo made dynamic)."""
    if isinstance(x, int):
        return x
    ex = val(x)
    if isinstance(ex, int):
        return ex
    if isinstance(ex, torch.SymInt):
        hint = getattr(ex.node, "hint", None)
        return int(hint) if hint is not None else None
    return None


def _written_inplace(node: fx.Node) -> bool:
    return any(is_method(u, "index_copy_", "copy_", "__setitem__") or is_fn(u, {operator.setitem}) for u in node.users)


# ----------------------------------------------------------------------------------------------
# RoPE and residual
# ----------------------------------------------------------------------------------------------


_PASS_THROUGH = (
    "unsqueeze",
    "to",
    "type_as",
    "float",
    "half",
    "bfloat16",
    "reshape",
    "view",
    "expand",
    "contiguous",
    "transpose",
    "repeat_interleave",
    "clone",
)


def _cos_above(node, steps: int = 12) -> fx.Node | None:
    """Follow a single-input chain of views/casts/scalings up from node to a cos node."""
    for _ in range(steps):
        if not isinstance(node, fx.Node):
            return None
        if is_method(node, "cos") or is_fn(node, {torch.cos}):
            return node
        if is_method(node, *_PASS_THROUGH) or is_fn(node, {operator.getitem, torch.unsqueeze}):
            node = arg(node, 0, "input")
        elif is_fn(node, MUL_FUNCS):  # cos * attention_scaling (a constant, or a SymFloat node)
            tensors = [a for a in node.args[:2] if isinstance(val(a), torch.Tensor)]
            if len(tensors) != 1:
                return None
            node = tensors[0]
        else:
            return None
    return None


def _int_tensor_above(node: fx.Node, limit: int = 200) -> fx.Node | None:
    """Nearest integer tensor (the position ids) above ``node``, following tensor-valued edges only
    (shape edges such as ``size()`` under dynamic shapes lead to token ids, not positions)."""
    frontier, seen = [node], {node}
    while frontier and len(seen) < limit:
        nxt = []
        for n in frontier:
            for a in n.all_input_nodes:
                ex = val(a)
                if a in seen or not isinstance(ex, torch.Tensor):
                    continue
                if ex.dtype in (torch.int64, torch.int32):
                    return a
                seen.add(a)
                nxt.append(a)
        frontier = nxt
    return None


def _rope_of(k_new: fx.Node | None, depth: int = 0) -> tuple[str | None, fx.Node | None]:
    """The cos node rotating the new keys (k*cos + rot(k)*sin) and the integer positions behind it."""
    if not isinstance(k_new, fx.Node) or depth > 3:
        return None, None
    if is_fn(k_new, {torch.cat}):  # partial rotary: cat([rotated, pass-through], -1)
        for a in arg(k_new, 0, "tensors"):
            found = _rope_of(a, depth + 1)
            if found[0]:
                return found
        return None, None
    if is_method(k_new, *_PASS_THROUGH):
        return _rope_of(k_new.args[0], depth + 1)
    if not is_fn(k_new, ADD_FUNCS):
        return None, None
    for term in k_new.args[:2]:
        if is_fn(term, MUL_FUNCS):
            for a in term.args[:2]:
                cos = _cos_above(a)
                if cos is not None:
                    return cos.name, _int_tensor_above(cos)
    return None, None


_CASTS = ("to", "type_as", "float", "half", "bfloat16", "contiguous", "clone")
_LAYOUT = _CASTS + ("view", "reshape", "transpose", "permute", "split", "chunk", "unflatten")


def _uncast(node):
    """``node`` above the casts and copies that change neither its values' meaning nor its layout."""
    while is_method(node, *_CASTS) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _last_dim_slice(node) -> tuple[fx.Node, int | None, int | None] | None:
    """``(x, start, stop)`` for ``x[..., start:stop]`` (a slice of the last dim only, integer bounds), else None."""
    if not is_fn(node, {operator.getitem}) or not isinstance(node.args[1], tuple) or not node.args[1]:
        return None
    x, idx = node.args
    ex, last = val(x), idx[-1]
    if not isinstance(ex, torch.Tensor) or not isinstance(last, slice) or last.step not in (None, 1):
        return None
    if idx[:-1] != (Ellipsis,) and not (len(idx) == ex.dim() and all(_full_slice(s) for s in idx[:-1])):
        return None
    if not all(b is None or isinstance(b, int) for b in (last.start, last.stop)):
        return None
    return x, last.start, last.stop


def _rotate_half_of(node) -> fx.Node | None:
    """``x`` for ``cat((-x[..., h:], x[..., :h]), -1)``, ``h`` half of x's last dim (transformers' ``rotate_half``)."""
    parts = arg(node, 0, "tensors") if is_fn(node, {torch.cat}) else None
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not is_fn(parts[0], {operator.neg, torch.neg}):
        return None
    hi, lo = _last_dim_slice(arg(parts[0], 0, "input")), _last_dim_slice(parts[1])
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    ex = val(hi[0])
    d = ex.shape[-1]
    if not isinstance(d, int) or d % 2 or arg(node, 1, "dim", 0) not in (-1, ex.dim() - 1):
        return None
    h = d // 2
    return hi[0] if hi[1:] in ((h, None), (h, d)) and lo[1:] in ((None, h), (0, h)) else None


def _rotation(node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(x, cos, sin)`` for ``x * cos + rotate_half(x) * sin``, operands in either order, else None."""
    terms = node.args if is_fn(node, ADD_FUNCS) and not node.kwargs else ()
    if len(terms) != 2 or not all(is_fn(t, MUL_FUNCS) for t in terms):
        return None
    a, b = terms
    for plain, turned in ((a, b), (b, a)):
        for x, cos in (plain.args[:2], plain.args[1::-1]):
            for half, sin in (turned.args[:2], turned.args[1::-1]):
                if isinstance(x, fx.Node) and _rotate_half_of(half) is x:
                    return x, cos, sin
    return None


def _table(node, pre: torch.Tensor, rot: int) -> fx.Node | None:
    """The RoPE table behind ``node`` (the cos or sin operand of the rotation of ``pre``'s first ``rot`` dims),
    above its unsqueezes and casts: ``[B or 1, (1,) L, rot]``; None if it is not of that form."""
    while is_method(node, "unsqueeze", *_CASTS) or is_fn(node, {torch.unsqueeze}):
        node = node.args[0]
    ex = val(node)
    if not isinstance(ex, torch.Tensor) or not ex.is_floating_point() or not 2 <= ex.dim() <= 4:
        return None
    lead = ex.shape[:-2]
    rows = lead[0] if lead else 1
    ok = (
        ex.shape[-1] == rot
        and statically_known_true(ex.shape[-2] == pre.shape[2])
        and all(statically_known_true(s == 1) for s in lead[1:])
        and (statically_known_true(rows == 1) or statically_known_true(rows == pre.shape[0]))
    )
    return node if ok else None


def _plain_index(idx) -> bool:
    """An index that picks a split's part or slices (no tensor: nothing that depends on positions)."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def _rotary(top: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """``(pre, rotated, cos, sin)`` when ``top`` is transformers' rotate-half RoPE of ``pre``: the rotation of all of
    it, or (partial rotary) ``cat([rotation of pre[..., :r], pre[..., r:]], -1)``; ``rotated`` is what the
    rotation turned (``pre`` or its first ``r`` dims). None otherwise."""
    found = _rotation(top)
    if found is not None:
        return found[0], found[0], found[1], found[2]
    parts = arg(top, 0, "tensors") if is_fn(top, {torch.cat}) else None
    found = _rotation(parts[0]) if isinstance(parts, (list, tuple)) and len(parts) == 2 else None
    head, tail = (_last_dim_slice(found[0]), _last_dim_slice(parts[1])) if found else (None, None)
    if head and tail and head[0] is tail[0] and head[1] in (None, 0) and tail[1] == head[2] and tail[2] is None:
        return head[0], found[0], found[1], found[2]
    return None


def query_rope(q: fx.Node, limit: int = 24) -> QueryRope:
    """How the query ``q`` of a site is positioned (see ``QueryRope``): transformers' rotate-half RoPE, whole or
    partial, followed by casts only; else no rotation when ``q`` comes from a ``linear`` / ``addmm`` projection
    through reshapes, splits, casts and constant scalings only."""
    top = _uncast(q)
    rotary = _rotary(top)
    if rotary is not None:
        pre, rotated, cos, sin = rotary
        ex, qv = val(pre), val(q)
        if not (
            isinstance(ex, torch.Tensor)
            and isinstance(qv, torch.Tensor)
            and ex.dim() == qv.dim() == 4
            and all(statically_known_true(a == b) for a, b in zip(ex.shape, qv.shape))
        ):
            return QueryRope(
                problem=f"the query's RoPE ('{top.name}') rotates a tensor of another layout than attention reads"
            )
        tables = _table(cos, ex, val(rotated).shape[-1]), _table(sin, ex, val(rotated).shape[-1])
        if None in tables:
            return QueryRope(
                problem=f"the query's RoPE ('{top.name}') reads cos / sin tables that are not "
                f"[batch, length, rotary dims]"
            )
        return QueryRope(pre, *tables)
    node = q
    for _ in range(limit):
        if is_fn(node, _LINEAR | {torch.addmm}):
            return QueryRope(pre=q)
        if is_fn(node, MUL_FUNCS) and len(node.args) == 2 and any(isinstance(a, (int, float)) for a in node.args):
            node = next((a for a in node.args if isinstance(a, fx.Node)), node)  # a constant scaling (OPT's)
        elif isinstance(node.args[0] if node.args else None, fx.Node) and (
            is_method(node, *_LAYOUT)
            or is_fn(node, {torch.reshape, torch.transpose, torch.split, torch.chunk})
            or is_fn(node, {operator.getitem})
            and _plain_index(node.args[1])
        ):
            node = node.args[0]
        else:
            break
    return QueryRope(
        problem=f"the query reaches attention through '{node.name}' "
        f"({getattr(node.target, '__name__', node.target)}), which kvpass recognises neither "
        f"as transformers' rotate-half RoPE nor as its projection's reshape"
    )


_OUT_CASTS = ("to", "type_as", "float", "half", "bfloat16", "contiguous", "clone")
# what may stand between a projection's parameter and the projection: casts, a tensor-parallel rank's local shard
_WEIGHT_STEPS = ("to", "float", "half", "bfloat16", "contiguous", "detach", "to_local", "t")


def _dims(node: fx.Node, rank: int) -> tuple[int, ...] | None:
    """The permutation a ``transpose`` / ``permute`` / ``swapaxes`` node applies to a ``rank``-dim tensor, else None."""
    if not (
        is_method(node, "transpose", "swapaxes", "permute")
        or is_fn(node, {torch.transpose, torch.swapaxes, torch.permute})
    ):
        return None
    rest = list(node.args[1:]) or list(node.kwargs.values())
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    if not all(isinstance(d, int) for d in rest):
        return None
    rest = [d % rank for d in rest]
    if getattr(node.target, "__name__", node.target) == "permute":
        return tuple(rest) if sorted(rest) == list(range(rank)) else None
    if len(rest) != 2:
        return None
    perm = list(range(rank))
    perm[rest[0]], perm[rest[1]] = perm[rest[1]], perm[rest[0]]
    return tuple(perm)


def _same_shape(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dim() == b.dim()
        and all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))
    )


def _shape_read(node: fx.Node) -> bool:
    """A node that reads a tensor's shape, not its values (``size()``, ``dim()``, a traced ``.shape``)."""
    ex = val(node)
    sizes = ex if isinstance(ex, (tuple, list)) else (ex,)
    return is_method(node, "size", "dim") or (ex is not None and all(isinstance(x, (int, torch.SymInt)) for x in sizes))


def _parameter(weight: fx.Node, limit: int = 6) -> fx.Node | None:
    """The graph input or attribute ``weight`` is read from through casts and ``to_local`` only, else None."""
    node = weight
    for _ in range(limit):
        if not isinstance(node, fx.Node):
            return None
        if node.op in ("placeholder", "get_attr"):
            return node
        if not (is_method(node, *_WEIGHT_STEPS) or is_fn(node, {torch.t})):
            return None
        node = node.args[0] if node.args else None
    return None


def out_projection(site: Site, limit: int = 12) -> OutProj:
    """The output projection of ``site`` (see ``OutProj``): from the attention output ``[B, H, L, Dv]`` down through
    one swap of the head and token dims, the reshape that merges heads and value dims into ``H * Dv`` columns (head
    major), reshapes that keep that last dim, and casts, to the one ``linear`` (``addmm``, ``matmul``) that reads it
    with a weight from a graph input or attribute."""
    out, v = val(site.out), val(site.v)
    if not (isinstance(out, torch.Tensor) and out.dim() == 4 and isinstance(v, torch.Tensor)):
        return OutProj(problem=f"the attention output '{site.out.name}' is not a [batch, heads, length, dim] tensor")
    width = site.heads * v.shape[-1]
    node, layout = site.out, "heads"  # heads: [B, H, L, Dv]; tokens: [B, L, H, Dv]; flat: [..., H * Dv]
    for _ in range(limit):
        users = [u for u in node.users if not _shape_read(u)]
        if len(users) != 1:
            return OutProj(
                problem=f"the attention output reaches {len(users)} nodes after '{node.name}', where "
                f"kvpass looks for one projection"
            )
        u = users[0]
        weight = transposed = None
        if is_fn(u, _LINEAR) and arg(u, 0, "input") is node:
            weight, transposed = arg(u, 1, "weight"), False
        elif is_fn(u, {torch.addmm}) and arg(u, 1, "mat1") is node:
            weight, transposed = arg(u, 2, "mat2"), True
        elif (is_fn(u, MATMUL_FUNCS) or is_method(u, "matmul")) and arg(u, 0, "input") is node:
            weight, transposed = arg(u, 1, "other"), True
        if transposed is not None:
            return _weight_of(u, weight, transposed, width, layout)
        ex, before = val(u), val(node)
        reshape = isinstance(ex, torch.Tensor) and (
            is_method(u, "reshape", "view", "flatten") or is_fn(u, {torch.reshape, torch.flatten})
        )
        if layout == "heads" and _dims(u, 4) == (0, 2, 1, 3):
            layout = "tokens"
        elif is_method(u, *_OUT_CASTS) and isinstance(ex, torch.Tensor):
            pass
        elif reshape and layout in ("tokens", "flat") and statically_known_true(ex.shape[-1] == width):
            layout = "flat"
        elif reshape and _same_shape(ex, before):
            pass  # transformers' SDPA output reshaped to its own shape [B, H, L, Dv]
        else:
            return OutProj(
                problem=f"the attention output reaches '{u.name}' "
                f"({getattr(u.target, '__name__', u.target)}), which kvpass recognises neither as "
                f"the heads' transpose, reshape or cast nor as the output projection"
            )
        node = u
    return OutProj(problem=f"no output projection within {limit} nodes of the attention output")


def _is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover  (a torch without distributed)
        return False
    return isinstance(x, DTensor)


def _weight_of(proj: fx.Node, weight, transposed: bool, width: int, layout: str) -> OutProj:
    """``OutProj`` of the projection node ``proj`` that reads the attention output with ``weight``."""
    w = val(weight)
    if layout != "flat":
        return OutProj(
            problem=f"the output projection '{proj.name}' reads the attention output before its heads "
            f"are merged into [..., heads * dim]"
        )
    if not isinstance(weight, fx.Node) or not isinstance(w, torch.Tensor) or w.dim() != 2:
        return OutProj(problem=f"the output projection '{proj.name}' has no 2-D weight tensor")
    if _is_dtensor(w):
        return OutProj(
            problem=f"the output projection '{proj.name}' reads a DTensor weight (sharded across ranks); "
            f"kvpass reads a rank's local weight only"
        )
    if not statically_known_true(w.shape[0 if transposed else 1] == width):
        return OutProj(
            problem=f"the output projection '{proj.name}' has a weight of shape {tuple(w.shape)}, whose "
            f"{'rows' if transposed else 'columns'} are not the attention's {width} "
            f"(heads * value dim)"
        )
    if _parameter(weight) is None:
        return OutProj(
            problem=f"the output projection '{proj.name}' reads a weight computed in the graph "
            f"('{weight.name}'), not a parameter"
        )
    return OutProj(weight=weight, transposed=transposed)


def _residual_of(out: fx.Node, order: dict[fx.Node, int], limit: int = 80) -> fx.Node | None:
    """First add downstream of the attention output whose other operand is independent of it."""
    downstream, frontier = {out}, [out]
    visited = 0
    while frontier and visited < limit:
        frontier.sort(key=order.__getitem__)
        n = frontier.pop(0)
        visited += 1
        for u in sorted(n.users, key=order.__getitem__):
            if u in downstream:
                continue
            if is_fn(u, ADD_FUNCS) and all(isinstance(a, fx.Node) for a in u.args[:2]):
                a, b = u.args[:2]
                if (a in downstream) != (b in downstream) and isinstance(val(u), torch.Tensor):
                    return u
            downstream.add(u)
            frontier.append(u)
    return None


# ----------------------------------------------------------------------------------------------
# attention forms
# ----------------------------------------------------------------------------------------------


def _sdpa_site(node: fx.Node) -> Site | Problem:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    mask = arg(node, 3, "attn_mask")
    dropout = arg(node, 4, "dropout_p", 0.0)
    is_causal = arg(node, 5, "is_causal", False)
    scale = arg(node, 6, "scale")
    if dropout not in (0, 0.0):
        return Problem(node.name, f"SDPA with dropout_p={dropout} (training graphs are not rewritten)")
    if scale is not None and not (isinstance(scale, (int, float)) or _is_sym_scalar(scale)):
        return Problem(node.name, f"SDPA scale is neither a constant nor a symbolic float ({scale})")
    if isinstance(is_causal, bool):
        causal = CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE
    elif is_fn(is_causal, {operator.gt}) and is_causal.args[1] == 1 and mask is None:
        # Dynamic shapes: HF's `is_causal = q_len > 1` (mask None). True only for a prefill, where
        # Lq == Lk and bottom-right equals SDPA's top-left; False for Lq == 1, where bottom-right
        # is no mask. Bottom-right is exact in both cases.
        causal = CAUSAL_BOTTOM_RIGHT
    else:
        return Problem(node.name, f"SDPA is_causal is a symbolic expression kvpass does not know ({is_causal})")
    k_base, k_chain = strip_repeat_kv(k)
    v_base, v_chain = strip_repeat_kv(v)
    return _make_site(node, "sdpa", q, k_base, v_base, mask, scale, causal, 0.0, k_chain + v_chain)


def _eager_site(sm: fx.Node) -> Site | Problem | None:
    """Match softmax-centred eager attention; None if this softmax is not attention at all."""
    chain = [sm]
    x = arg(sm, 0, "input")
    mask = None
    softcap = 0.0
    if is_fn(x, ADD_FUNCS):
        a, b = x.args[:2]
        chain.append(x)
        x, mask = a, b
        if not isinstance(mask, fx.Node):
            return None
    scale = 1.0
    # softcap: tanh(s / c) * c
    t, cap = (arg(x, 0, "input"), arg(x, 1, "other")) if is_fn(x, MUL_FUNCS) else (None, None)
    if is_fn(t, {torch.tanh}) and isinstance(cap, (int, float)):
        d = arg(t, 0, "input")
        div = arg(d, 1, "other") if is_fn(d, DIV_FUNCS) else None
        if isinstance(div, (int, float)) and div == cap:
            softcap = float(cap)
            chain += [x, t, d]
            x = arg(d, 0, "input")
        else:
            return None
    while is_fn(x, MUL_FUNCS | DIV_FUNCS):
        factor = arg(x, 1, "other")
        if not (isinstance(factor, (int, float)) or _is_sym_scalar(factor)):
            break
        if isinstance(factor, fx.Node):  # a dynamic float: keep it as a graph value
            if isinstance(scale, fx.Node) or x.target not in MUL_FUNCS or scale != 1.0:
                return Problem(x.name, "attention scaling mixes several symbolic factors")
            scale = factor
        else:
            scale = scale * factor if x.target in MUL_FUNCS else scale / factor
        chain.append(x)
        x = arg(x, 0, "input")
    if not is_fn(x, MATMUL_FUNCS):
        return None
    qk = x
    chain.append(qk)
    q, kt = arg(qk, 0, "input"), arg(qk, 1, "other")
    dims = (arg(kt, 1, "dim0"), arg(kt, 2, "dim1")) if is_method(kt, "transpose") else None
    if dims not in {(2, 3), (-2, -1), (3, 2), (-1, -2)}:
        return None
    chain.append(kt)
    k_base, k_chain = strip_repeat_kv(kt.args[0])
    # downstream: .to(...)/.type_as/float -> dropout -> matmul(p, v)
    p = sm
    while len(p.users) == 1:
        (u,) = p.users
        if is_method(u, "to", "float", "type_as", "type") or is_fn(u, {F.dropout, torch.dropout}):
            if is_fn(u, {F.dropout, torch.dropout}) and arg(u, 1, "p", 0.0) not in (0, 0.0):
                return Problem(u.name, "attention dropout is active (training graphs are not rewritten)")
            chain.append(u)
            p = u
            continue
        break
    pv = next(iter(p.users)) if len(p.users) == 1 else None
    if pv is None or not is_fn(pv, MATMUL_FUNCS) or arg(pv, 0, "input") is not p:
        return Problem(
            sm.name, "attention probabilities are used outside p @ v (output_attentions or an unknown pattern)"
        )
    v_base, v_chain = strip_repeat_kv(arg(pv, 1, "other"))
    for n in chain[1:]:
        if len(n.users) != 1:
            return Problem(n.name, "an eager-attention intermediate has other users")
    return _make_site(
        pv, "eager", q, k_base, v_base, mask, scale, CAUSAL_NONE, softcap, [pv] + chain + k_chain + v_chain
    )


_MASK_VIEWS = {
    "to",
    "type",
    "type_as",
    "float",
    "half",
    "bfloat16",
    "expand",
    "view",
    "reshape",
    "contiguous",
    "clone",
    "unsqueeze",
    "__getitem__",
}
_MASK_CONSTS = {
    torch.full,
    torch.zeros,
    torch.ones,
    torch.scalar_tensor,
    torch.tensor,
    torch.as_tensor,
    torch.full_like,
    torch.zeros_like,
    torch.ones_like,
}


def mask_bias(mask, limit: int = 64) -> str | None:
    """Why an attention mask may carry values other than "visible" and "masked" (an additive bias such
    as ALiBi's), or None when it is boolean or its floating-point values come only from constants
    selected by boolean conditions (``where`` / ``masked_fill``) through casts and views. A bias cannot
    be re-indexed by position once a policy moves or drops cache entries."""
    if not isinstance(mask, fx.Node):
        return None
    todo, seen = [mask], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        ex = val(n)
        if not isinstance(ex, torch.Tensor) or not ex.is_floating_point() or n.op in ("placeholder", "get_attr"):
            continue
        if is_fn(n, {torch.where}):
            todo += [a for a in (arg(n, 1, "input"), arg(n, 2, "other")) if isinstance(a, fx.Node)]
        elif (
            is_fn(n, {torch.masked_fill})
            or is_method(n, "masked_fill", "masked_fill_")
            or is_method(n, *_MASK_VIEWS)
            or is_fn(n, {operator.getitem, torch.reshape})
        ):
            src = arg(n, 0, "input")
            todo += [src] if isinstance(src, fx.Node) else []
        elif not is_fn(n, _MASK_CONSTS):
            return (
                f"the attention mask is computed with '{n.name}' ({getattr(n.target, '__name__', n.target)}), "
                f"so it may carry an additive bias (ALiBi) that kvpass cannot re-index after moving or "
                f"dropping cache entries"
            )
    return None


def mask_chunks(mask, limit: int = 256) -> str | None:
    """Why an attention mask is not a window over positions: it is computed from a floor division of integer
    tensors (positions grouped into chunks: chunked attention, as Llama 4's local layers). A mask rebuilt
    from positions (causal, or a sliding window) would let a token see the previous chunk. None otherwise."""

    def floor_division(n) -> bool:
        ex = val(n)
        return (
            isinstance(ex, torch.Tensor)
            and not ex.is_floating_point()
            and (
                is_fn(n, {operator.floordiv, torch.floor_divide})
                or is_method(n, "floor_divide", "__floordiv__")
                or ((is_fn(n, {torch.div}) or is_method(n, "div")) and n.kwargs.get("rounding_mode") == "floor")
            )
        )

    n = upstream(mask, floor_division, limit=limit) if isinstance(mask, fx.Node) else None
    return (
        None
        if n is None
        else (
            f"the attention mask groups positions into chunks ('{n.name}': a floor division), "
            f"as chunked attention does; kvpass rebuilds masks from positions as causal or "
            f"sliding windows only"
        )
    )


_LINEAR = {F.linear, torch._C._nn.linear}


def _projected_from(node: fx.Node, limit: int = 80) -> set[fx.Node]:
    """The activations whose linear projections ``node`` is computed from: walking up through reshapes,
    RoPE, norms and the like, stopping at each ``linear`` / ``addmm`` (its input is recorded)."""
    found, todo, seen = set(), [node], set()
    while todo and len(seen) < limit:
        n = todo.pop(0)
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if is_fn(n, _LINEAR):
            found.add(arg(n, 0, "input"))
        elif is_fn(n, {torch.addmm}):
            found.add(arg(n, 1, "mat1"))
        else:
            todo += n.all_input_nodes
    return found


def cross_attention(site) -> bool:
    """Whether the new keys are projected from other activations than the queries (an encoder's states:
    cross-attention), judged where both projections are found."""
    if site.k_new is None:
        return False
    q_from, k_from = _projected_from(site.q), _projected_from(site.k_new)
    return bool(q_from and k_from) and not (q_from & k_from)


def _weighs_values(sm: fx.Node, limit: int = 6) -> bool:
    """Whether softmax ``sm``'s output reaches the first operand of a matrix product through casts,
    dropout and reshapes: probabilities times values, the shape of attention."""
    p = sm
    for _ in range(limit):
        if len(p.users) != 1:
            return False
        (u,) = p.users
        if (
            is_fn(u, MATMUL_FUNCS | {torch.bmm, torch.einsum})
            and p in u.args[:2]
            or is_method(u, "matmul", "bmm")
            and u.args[0] is p
        ):
            return True
        if not (
            is_method(u, "to", "float", "type_as", "type", "view", "reshape", "contiguous")
            or is_fn(u, {F.dropout, torch.dropout, torch.reshape})
        ):
            return False
        p = u
    return False


def _is_sym_scalar(node) -> bool:
    """A graph value that is a Python scalar (SymFloat/SymInt), e.g. a float Dynamo made dynamic."""
    ex = val(node)
    return isinstance(node, fx.Node) and isinstance(ex, (torch.SymFloat, torch.SymInt, float, int))


def _make_site(out, kind, q, k, v, mask, scale, causal, softcap, erase) -> Site | Problem:
    qv, kv_, vv = val(q), val(k), val(v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (qv, kv_, vv)):
        return Problem(out.name, "q/k/v are not 4-D [batch, heads, seq, head_dim] tensors")
    # a size Dynamo traced as a SymInt of a constant (a cache's head dimension under dynamic=True) is that int
    heads, kv_heads = (int(n) if is_concrete_int(n) else n for n in (qv.shape[1], kv_.shape[1]))
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return Problem(
            out.name,
            f"the head counts are symbolic in this graph (query heads {heads!r}, KV heads "
            f"{kv_heads!r}): the cache's tensors were traced with a dynamic head dimension (e.g. "
            f"transformers' StaticCache under torch.compile(dynamic=True)); a kvpass.SlotCache "
            f"keeps them static",
        )
    if heads % kv_heads:
        return Problem(out.name, f"query heads {heads} are not a multiple of kv heads {kv_heads}")
    head_dim = qv.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, fx.Node):
        scale = float(scale)
    return Site(
        layer=-1,
        attention=kind,
        out=out,
        q=q,
        k=k,
        v=v,
        mask=mask,
        scale=scale,
        causal=causal,
        softcap=softcap,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_len=qv.shape[2],
        cache="none",
        erase=erase,
    )


def _is_flash(node: fx.Node) -> bool:
    t = node.target
    name = getattr(t, "__name__", "") or str(t)
    mod = getattr(t, "__module__", "") or ""
    return node.op == "call_function" and (
        "flash_attn" in mod or "flash_attn" in str(t) or name.startswith("flash_attn")
    )


def detect(gm: fx.GraphModule) -> Detection:
    """Find all attention sites of a Dynamo graph, in graph order."""
    sites: list[Site] = []
    problems: list[Problem] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        found = None
        if is_fn(n, SDPA_TARGETS):
            found = _sdpa_site(n)
        elif is_fn(n, SOFTMAX_FUNCS) or is_method(n, "softmax"):
            found = _eager_site(n)
        elif _is_flash(n):
            found = Problem(
                n.name,
                "flash-attn call found; kvpass does not rewrite flash-attn sites yet "
                "(load the model with attn_implementation='sdpa' or 'eager')",
            )
        if found is None:
            if (is_fn(n, SOFTMAX_FUNCS) or is_method(n, "softmax")) and _weighs_values(n):
                problems.append(
                    Problem(
                        n.name,
                        "a softmax whose probabilities weigh values (attention) in a form "
                        "kvpass does not recognize (its scores are not q @ k^T with an "
                        "optional scale, softcap and additive mask); the policy cannot "
                        "be applied to this model's attention",
                    )
                )
            continue
        if isinstance(found, Problem):
            problems.append(found)
            continue
        prob = _cache_of(found)
        if prob:
            problems.append(prob)
            continue
        found.layer = len(sites)
        if found.cache_layer is not None and found.cache_layer != found.layer:
            problems.append(
                Problem(n.name, f"attention #{found.layer} in graph order reads the cache of layer {found.cache_layer}")
            )
            continue
        if cross_attention(found):
            problems.append(
                Problem(
                    n.name,
                    f"attention #{found.layer} is cross-attention (its keys are projected "
                    f"from other states than its queries, e.g. an encoder's); kvpass "
                    f"policies manage self-attention caches only",
                )
            )
            continue
        found.rope, found.positions = _rope_of(found.k_new)
        found.residual = _residual_of(found.out, order)
        sites.append(found)
    if not sites and not problems and (seen := _attention_like(gm)) is not None:
        problems.append(
            Problem(
                seen.name,
                "no attention site in a form kvpass recognizes, beside a softmax or an "
                "attention operator it cannot read (attention with sinks, flex "
                "attention, a kernel of the model's own); the policy cannot be "
                "applied to this model's attention",
            )
        )
    tokens = _token_ids(gm)
    global_layers = tuple(s.layer for s in sites if not s.sliding_window)
    for s in sites:
        s.tokens, s.global_layers = tokens, global_layers
    return Detection(sites, problems)


def _attention_like(gm: fx.GraphModule) -> fx.Node | None:
    """The first softmax, or call of an operator named like attention, of a graph: where detection found no site
    beside one, the model's attention is in a form kvpass cannot read (said, never silently left unapplied)."""
    for n in gm.graph.nodes:
        if is_fn(n, SOFTMAX_FUNCS) or is_method(n, "softmax"):
            return n
        if n.op == "call_function" and "attention" in str(getattr(n.target, "__name__", n.target)).lower():
            return n
    return None


def _token_ids(gm: fx.GraphModule) -> fx.Node | None:
    """The integer ids fed to the first embedding lookup, when they are a graph input."""
    for n in gm.graph.nodes:
        if is_fn(n, {F.embedding, torch.embedding}):
            ids = local_of(arg(n, 0, "input"))
            ex = val(ids)
            if (
                isinstance(ids, fx.Node)
                and ids.op == "placeholder"
                and isinstance(ex, torch.Tensor)
                and not ex.is_floating_point()
            ):
                return ids
            return None
    return None
