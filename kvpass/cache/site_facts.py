"""What an attention site of a compiled graph tells the code that runs it: ``SiteFacts``.

The graph pass finds each site (``kvpass.compiler.detect.Site``, layer 4); the runtime that serves the site's
operators (``kvpass.cache.runtime``, layer 1) and the policies that plan and decide for it (layer 3) read its facts.
Both sit below the compiler, so they name the facts by this protocol, which ``Site`` satisfies, and never import the
compiler. The FX nodes among them (``q``, ``v``, ``mask``, ``tokens``) are for compile-time hooks (``plan``); at
run time a site is read for its plain facts (layer, cache kind, window, heads).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import fx

# the cache a site's keys and values come from: transformers' DynamicCache, a StaticCache (a buffer written in
# place), a kvpass.SlotCache, or none (use_cache=False)
CacheKind = Literal["dynamic", "static", "slot", "none"]
# the graph a site is in (set per graph by the backend; "unknown" until then)
Phase = Literal["unknown", "prefill", "decode", "append", "dynamic"]


class HeadSplit(Protocol):
    """A tensor-parallel split of a layer's heads (``kvpass.compiler.tp.TensorParallel``)."""

    size: int
    rank: int

    def all_heads(self, x: torch.Tensor) -> torch.Tensor: ...


class QueryFacts(Protocol):
    """How a site's query is rotated before attention reads it (``kvpass.compiler.detect.QueryRope``)."""

    pre: fx.Node | None
    cos: fx.Node | None
    sin: fx.Node | None
    problem: str | None

    @property
    def rotary(self) -> int: ...


class OutputFacts(Protocol):
    """The weight of a site's output projection (``kvpass.compiler.detect.OutProj``)."""

    weight: fx.Node | None
    transposed: bool
    problem: str | None


class SiteFacts(Protocol):
    """One attention site: its layer, the cache it reads, its heads, and the graph nodes a plan may inspect."""

    layer: int  # index in graph order
    key: int  # the operators' name for this site (``Runtime.add_graph``): graph and layer
    phase: Phase
    cache: CacheKind
    sliding_window: int | None
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int | torch.SymInt
    causal: int
    softcap: float
    global_layers: tuple
    tp: HeadSplit | None
    q: fx.Node
    v: fx.Node
    mask: fx.Node | None
    tokens: fx.Node | None

    @property
    def q_rope(self) -> QueryFacts: ...

    @property
    def o_proj(self) -> OutputFacts: ...
