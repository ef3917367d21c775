"""Tensor parallelism: the group a graph's attention heads are sharded over, and the gathers across it.

A model loaded with transformers' tensor-parallel plan (``from_pretrained(..., tp_plan="auto")`` under
``torchrun``) runs on every rank with only that rank's share of the heads: its q/k/v projections are split by
output rows (``colwise``), so the attention the pass finds has the rank's *local* heads, contiguous and in rank
order (rank ``r`` of ``N`` holds KV heads ``r * H_kv / N ..``, with their whole GQA groups), and the output
projection (``rowwise``) ends in an ``all_reduce`` over the group that Dynamo records as a functional
collective (``_c10d_functional.all_reduce``).

``find`` reads that from the graph, with no model name: every attention output must reach such an
``all_reduce`` through one linear layer, and every one must use the same group; otherwise the pass cannot
tell how heads are split and the graph is compiled unchanged (warned, never guessed).

Decisions that are per KV head (SnapKV, H2O, Quest, RaaS, ART, StreamingLLM, ...) need nothing: each rank
decides for its own heads what one device would. A decision that spans the heads of a layer reads a
statistic of *every* head: ``gather_heads`` inserts an ``all_gather`` (a functional collective Inductor
compiles, no host round trip) that puts the per-head statistic of all ranks, in head order, on every rank. The
reduction over heads then runs on the same tensor, in the same order, as on one device, so every rank takes
the same decision as a single device does (a sum of per-rank partial sums would round differently).

One decision is a host decision by construction: chunk fusion's recompute set (``kvpass.ChunkFusion``), whose
size shapes the next pass's input, so its scores go to the host anyway. Its selection callback gathers the
per-head scores with ``TensorParallel.all_heads`` (the same collectives, run eagerly) before they leave the
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from kvpass.compiler.detect import val
from kvpass.compiler.fxargs import arg

_C10D = getattr(torch.ops, "_c10d_functional")
_VIEWS = {"view", "reshape", "transpose", "contiguous", "permute", "flatten", "to"}
_LINEAR = {F.linear, torch._C._nn.linear}


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel group of a graph's attention heads: its c10d name, size and this rank."""

    group: str
    size: int
    rank: int

    def describe(self, heads: int, kv_heads: int) -> str:
        return (
            f"tensor parallel: rank {self.rank} of {self.size} (group '{self.group}'), local heads "
            f"{heads} of {heads * self.size}, KV heads {kv_heads} of {kv_heads * self.size}"
        )

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Eagerly, ``x [B, h, ...]`` (this rank's heads) of every rank: ``[B, h * N, ...]`` in head order.
        Every rank of the group must call it (the host-side selection of chunk fusion)."""
        if self.size == 1:
            return x
        gathered = _C10D.all_gather_into_tensor.default(_heads_first(x), self.size, self.group)
        return _heads_back(_C10D.wait_tensor.default(gathered))

    def __repr__(self) -> str:
        return f"TensorParallel(group={self.group!r}, size={self.size}, rank={self.rank})"


def _is(node: fx.Node, packet) -> bool:
    return node.op == "call_function" and node.target in (packet, packet.default)


def dtensor_type():
    """torch's DTensor class, or None in a torch without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover  (a torch without distributed)
        return None
    return DTensor


def _dtensor(x) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def _reduced_over(out: fx.Node, depth: int = 12) -> set[str]:
    """The groups of the ``all_reduce`` calls ``out`` reaches through views and at most one linear layer."""
    groups: set[str] = set()
    frontier, seen = [(out, False)], {out}
    for _ in range(depth):
        nxt = []
        for node, through_linear in frontier:
            for u in node.users:
                if u in seen:
                    continue
                seen.add(u)
                if _is(u, _C10D.all_reduce):
                    groups.add(arg(u, 2, "group_name"))
                elif u.op == "call_method" and u.target in _VIEWS:
                    nxt.append((u, through_linear))
                elif u.op == "call_function" and u.target in _LINEAR and not through_linear:
                    nxt.append((u, True))
        frontier = nxt
    return groups


def find(gm: fx.GraphModule, sites) -> TensorParallel | None | str:
    """The group the sites' heads are sharded over; None on one device; a str says why the pass cannot tell."""
    reduces = [n for n in gm.graph.nodes if _is(n, _C10D.all_reduce)]
    sharded = any(_dtensor(val(n)) for n in gm.graph.nodes if n.op == "placeholder")
    if not reduces and not sharded:
        return None
    if not sites:
        return None
    groups = set()
    for s in sites:
        reached = _reduced_over(s.out)
        if len(reached) != 1:
            return (
                f"tensor parallel: layer {s.layer}'s attention output reaches "
                f"{'no all_reduce' if not reached else 'all_reduces over several groups'} through its "
                f"output projection, so kvpass cannot tell how the heads are split across ranks"
            )
        groups |= reached
    if len(groups) != 1:
        return f"tensor parallel: the layers' attention outputs are reduced over different groups {sorted(groups)}"
    group = groups.pop()
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group)
    return TensorParallel(group=group, size=pg.size(), rank=dist.get_rank(pg))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(1, 0).contiguous()


def _heads_back(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(0, 1)


def gather_heads(graph: fx.Graph, x: fx.Node, tp: TensorParallel | None, what: str, reductions: list) -> fx.Node:
    """A node holding ``x [B, h, ...]`` (this rank's heads) of every rank: ``[B, h * N, ...]`` in head order.
    Inserted right after ``x``, and said in ``reductions`` (``what`` names it); on one device (``tp`` None) it is
    ``x`` itself."""
    if tp is None or tp.size == 1:
        return x
    reductions.append(f"{what} all_gather over {tp.size} ranks")
    with graph.inserting_after(x):
        first = graph.call_function(_heads_first, (x,))
    with graph.inserting_after(first):
        gathered = graph.call_function(_C10D.all_gather_into_tensor.default, (first, tp.size, tp.group))
    with graph.inserting_after(gathered):
        done = graph.call_function(_C10D.wait_tensor.default, (gathered,))
    with graph.inserting_after(done):
        return graph.call_function(_heads_back, (done,))
