"""Positions after eviction: position ids the model derived from the cache's (shortened) length are routed
through ``kvpass::true_positions``, so RoPE and absolute positions stay the true token indices. Absolute
positions are found by structure: an integer tensor derived in the graph that looks rows up in a float table
(``embedding``: GPT-2, OPT, BioGPT; indexing: CTRL's sinusoids). ``derived`` tells derived position ids from
ones passed in, ``view_root`` finds the tensor several RoPEs read views of. Used by the rewrite and by the
gate (a gated prefill's segments). After a renumbering prefill (``gemfilter``: the cache holds the selected
tokens at ``0..n-1``) the decode graphs' positions move back by what it dropped: ``shift_passed_positions``
(a DynamicCache: ``kvpass::shift_positions``) and ``shift_slot_positions`` (a SlotCache: its counters)."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from kvpass.cache import runtime as _runtime
from kvpass.cache.slots import DROPPED
from kvpass.compiler.detect import Site, is_fn, upstream
from kvpass.compiler.fxargs import arg
from kvpass.op_registry import register

OPS = torch.ops.kvpass


def derived(pos: fx.Node) -> bool:
    """True when position ids were computed inside the graph (from the cache length), not passed in.

    Only tensor values count as "passed in": an integer tensor input reached through data edges (a model's
    own integer buffer, such as BERT-style ``position_ids``, is not an input: the model reads it at the cache's
    length). Shape edges (``input_ids.size(1)`` under dynamic shapes) carry lengths, not positions.
    """
    stack, seen = [pos], set()
    while stack:
        n = stack.pop()
        ex = n.meta.get("example_value")
        if not isinstance(ex, torch.Tensor):
            continue  # a SymInt / int: shape information
        if n.op == "placeholder":
            if not ex.is_floating_point() and not _model_tensor(n):
                return False
            continue
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return True


def _model_tensor(node: fx.Node) -> bool:
    """A placeholder that is one of the model's own parameters or buffers (Dynamo marks those static)."""
    return "_dynamo_static_input_type" in node.meta.get("tensor_dict", {})


def _float(node: fx.Node) -> bool:
    ex = node.meta.get("example_value")
    return not isinstance(ex, torch.Tensor) or ex.is_floating_point()


_VIEWS = {"unsqueeze", "view", "reshape", "expand", "__getitem__"}


def view_root(pos: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(the integer tensor ``pos`` is a view of, through indexing / unsqueeze / view / expand; the
    node on that path that reads it, None when ``pos`` is its own root)."""
    child = None
    while True:
        src = pos.args[0] if pos.args and isinstance(pos.args[0], fx.Node) else None
        view = (pos.op == "call_function" and pos.target is operator.getitem) or (
            pos.op == "call_method" and pos.target in _VIEWS
        )
        ex = src.meta.get("example_value") if src is not None else None
        if not view or not isinstance(ex, torch.Tensor) or ex.is_floating_point():
            return pos, child
        pos, child = src, pos


_RANKS = {"topk", "sort", "argsort", "argmax", "argmin", "nonzero", "multinomial", "kthvalue"}


def from_ranking(index: fx.Node) -> bool:
    """Whether ``index`` is computed (through data edges) from a ranking or selection of values: ``topk``,
    ``sort``, ``argmax``, ``nonzero`` ... A mixture-of-experts router's token order is; positions (an ``arange``
    from the cache's length, a cumulative sum of the attention mask, an integer input) never are."""
    return upstream(index, lambda n: _call_name(n) in _RANKS) is not None


_COUNTS = {"arange", "cumsum"}
_PICKS = {"gather", "index_select", "take", "take_along_dim"}  # values from their first argument


def counts_tokens(index: fx.Node) -> bool:
    """Whether the values of ``index`` count tokens, as derived absolute positions do: they come (through
    arithmetic and views) from an ``arange`` (from the cache's length on), a ``cumsum`` (of the attention
    mask) or a window of the model's own integer table read from the cache's length (BERT-style
    ``position_ids[:, past:past + q]``). Token type ids do not, whether built as ``zeros`` or picked from a
    buffer of zeros at those positions: a lookup takes its values from the table, not from its index."""

    def values_from(n):
        picks = n.op in ("call_function", "call_method") and (n.target is operator.getitem or _call_name(n) in _PICKS)
        return [arg(n, 0, "input")] if picks else n.all_input_nodes

    return upstream(index, lambda n: _call_name(n) in _COUNTS or _table_window(n), values_from) is not None


def _call_name(n: fx.Node):
    return getattr(n.target, "__name__", n.target) if n.op in ("call_function", "call_method") else None


def _table_window(n: fx.Node) -> bool:
    """``table[..., start:stop]`` of a model's integer buffer from a start past 0: the cache's length (a
    constant where the graph is specialized to it). A window from 0 is not told apart from a table of token
    type ids read the same way, and needs no fixing: nothing was evicted before the first token."""
    if not (
        n.op == "call_function"
        and n.target is operator.getitem
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op == "placeholder"
        and _model_tensor(n.args[0])
    ):
        return False
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    return any(isinstance(i, slice) and (isinstance(i.start, fx.Node) or (i.start or 0) > 0) for i in index)


def table_lookups(graph: fx.Graph, embedding: bool = True) -> list[fx.Node]:
    """Integer tensors that pick rows of a float table: ``embedding(ids, table)`` (unless not ``embedding``:
    token ids are looked up that way too) or ``table[ids]``, where the index is not a ranking's (a
    mixture-of-experts layer indexes its routing weights with the experts' token order, which is not a
    position)."""
    found = []
    for n in graph.nodes:
        if embedding and is_fn(n, {F.embedding, torch.embedding}):
            index, table_ok = arg(n, 0, "input"), True
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            index = n.args[1]
            index = next((i for i in index if isinstance(i, fx.Node)), None) if isinstance(index, tuple) else index
            table = n.args[0].meta.get("example_value")
            table_ok = isinstance(table, torch.Tensor) and table.is_floating_point()
        else:
            continue
        if table_ok and isinstance(index, fx.Node) and not _float(index) and not from_ranking(index):
            found.append(index)
    return found


def fix_positions(graph: fx.Graph, sites: list[Site], handle: int, prefill: bool) -> list[str]:
    """Route derived position ids through ``true_positions`` (``prefill``: the graph starts from an empty
    cache, where they are true and the operator learns the model's first position). Several RoPEs (Gemma 3:
    local and global) read views of one position tensor: that tensor is fixed once, since every
    ``true_positions`` of a graph must see the state of the call's start, and Inductor may run a second one
    after layers of the same call recorded their new count (it moved Gemma 3's global layers by one position)."""
    fixed = []
    # RoPE's positions, and absolute positions looked up in a table (token ids are passed in: not derived;
    # token type ids built as zeros are derived but count nothing)
    absolute = [p for p in table_lookups(graph) if counts_tokens(p)]
    found = [p for p in dict.fromkeys([s.positions for s in sites if s.positions is not None] + absolute) if derived(p)]
    paths = [view_root(p) for p in found]
    if len({root for root, _ in paths}) == 1 and len(found) > 1:
        # one op on the shared tensor, read through it only by the views that lead to the RoPEs
        root, readers = paths[0][0], {child for _, child in paths}
        targets = [(root, None if None in readers else (lambda u: u in readers))]
    else:
        targets = [(p, None) for p in found]
    for pos, only in targets:
        with graph.inserting_after(pos):
            tp = graph.call_function(OPS.true_positions.default, (pos, handle, prefill))
        pos.replace_all_uses_with(tp, delete_user_cb=lambda u, only=only: u is not tp and (only is None or only(u)))
        fixed.append(pos.name)
    return fixed


# ----------------------------------------------------------------------------------------------
# the position operators of a renumbering (two-pass) prefill
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kvpass::shift_positions", mutates_args=())
def shift_positions(pos: Tensor, handle: int) -> Tensor:
    """Position ids passed in after a renumbering prefill (``gemfilter``): ``generate`` counts the whole
    prompt, the cache holds its ``n`` selected tokens at positions ``0..n-1``; move them back by ``L - n``."""
    info = _runtime.get(handle).gate
    shift = info.shift if info is not None else 0
    return (pos - shift).contiguous() if shift else pos.clone(memory_format=torch.contiguous_format)


@shift_positions.register_fake
def _(pos, handle):
    return torch.empty_like(pos, memory_format=torch.contiguous_format)


register(shift_positions=shift_positions)


def shift_passed_positions(gm: fx.GraphModule, sites, handle: int) -> list[str]:
    """Decode/append graphs of a renumbering policy: route position ids that were passed in (not derived
    from the cache length, which ``true_positions`` already fixes) through ``shift_positions``."""

    done = []
    graph = gm.graph
    for pos in dict.fromkeys(s.positions for s in sites if s.positions is not None):
        if derived(pos):
            continue
        with graph.inserting_after(pos):
            sp = graph.call_function(torch.ops.kvpass.shift_positions.default, (pos, handle))
        pos.replace_all_uses_with(sp, delete_user_cb=lambda u: u is not sp)
        done.append(pos.name)
    if done:
        graph.lint()
        gm.recompile()
    return done


def row_shift(count: Tensor, positions: Tensor) -> Tensor:
    """The positions a renumbering prefill dropped (``count[:, DROPPED]``), shaped to move ``positions``: per row
    for ``[B, q]`` position ids, else the first row's (a batch prefilled together shares it)."""
    if positions.dim() == 2 and positions.shape[0] == count.shape[0]:
        return count[:, DROPPED, None]
    return count[0, DROPPED]


def shift_slot_positions(gm: fx.GraphModule, sites) -> list[str]:
    """Decode/append graphs of a renumbering policy on a ``kvpass.SlotCache``: the cache counts every
    token of the prompt (``generate`` and a bare ``forward`` derive positions from it) and holds the
    prefill's tokens at ``0..n-1``; RoPE's positions, passed in or derived, move back by the shift the
    prefill left in ``count[:, DROPPED]``, on the device (the counters of the graph's first slot write: every
    layer's hold the same shift)."""
    from kvpass.cache.slots import pending_positions, write_slots

    count = next(
        (
            arg(n, 3, "count") if n.target is write_slots else arg(n, 1, "count")
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (write_slots, pending_positions)
        ),
        None,
    )
    if count is None:
        return []
    done = []
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    # once per position tensor: several RoPEs (Gemma 3: local and global) may read views of one
    for pos in dict.fromkeys(view_root(s.positions)[0] for s in sites if s.positions is not None):
        # (passed-in positions are an input that may come before the counters' input)
        with graph.inserting_after(max(pos, count, key=order.__getitem__)):
            shift = graph.call_function(row_shift, (count, pos))
        with graph.inserting_after(shift):
            moved = graph.call_function(operator.sub, (pos, shift))
        pos.replace_all_uses_with(moved, delete_user_cb=lambda u: u not in (moved, shift))
        done.append(pos.name)
    if done:
        graph.lint()
        gm.recompile()
    return done
