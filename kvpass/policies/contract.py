"""The policy contract: what every kvpass policy declares and answers, and parameter validation.

A policy is a class with a ``name``, its parameters (``Param``, checked when ``kvpass.backend(...)`` builds it,
before anything compiles) and a ``needs`` descriptor (``Needs``): whether it evicts, whether its decode only
appends after the prefill, whether it gates the prefill, how a ``kvpass.SlotCache`` places its tokens. The
compiler, the runtime and the cache read ``needs``; they never branch on a policy's name.

It answers at compile time ``plan(site)``: a ``SitePlan`` for one attention site (``site.phase`` says whether
the graph is a prefill, a decode step, an append, or shape-dynamic), whose ``rewrite_kind`` names one of the
rewrites of ``kvpass.compiler.rewrite``; or a ``Refusal`` saying why the site cannot be planned (the graph
is then compiled unchanged, with a warning). At run time, from inside the operators: ``stored_length`` (the
shape contract of ``compact``, SymInt-safe), ``select`` (which entries to keep), ``write`` (a pool site's
decode step), and on a SlotCache its ``slot_state`` / ``slot_hooks`` (device tensor code captured with
the graph).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch
from torch import fx

from kvpass.cache.site_facts import SiteFacts
from kvpass.errors import ConfigError


@dataclass(frozen=True)
class Param:
    name: str
    kind: type
    default: Any
    lo: float | None = None
    hi: float | None = None
    doc: str = ""

    def range_text(self) -> str:
        if self.kind not in (int, float):
            return self.kind.__name__
        lo = "-inf" if self.lo is None else self.lo
        hi = "inf" if self.hi is None else self.hi
        return f"{self.kind.__name__} in [{lo}, {hi}]"

    def check(self, policy: str, value: Any) -> Any:
        if value is None and self.default is None:
            return None  # an optional parameter left unset (the policy's check_config decides)
        ok_type = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok_type = float(value), True
        if self.kind is str and isinstance(value, os.PathLike):  # a path given as a Path (kvpass.duo_pattern's)
            value, ok_type = os.fspath(value), True
        # a parameter without a usable default (duoattention's pattern) is required: no "leave it out" then
        default = "" if self.default in ("", None) else f" or leave it out for the default ({self.default!r})"
        if not ok_type:
            raise ConfigError(
                f"kvpass: policy '{policy}': parameter '{self.name}' must be {self.range_text()}, "
                f"got {type(value).__name__} {value!r}; pass {self.name}=<{self.kind.__name__}>{default}"
            )
        if value != value or (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ConfigError(
                f"kvpass: policy '{policy}': parameter '{self.name}' must be {self.range_text()}, got {value!r}"
                f"{f' ({self.name}: {self.doc})' if self.doc else ''}; pass a value in that range{default}"
            )
        return value


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


def _kind(annotation) -> type:
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return _KINDS.get(name, object)


def param(default: Any, lo: float | None = None, hi: float | None = None, doc: str = "") -> Any:
    """A policy parameter: a dataclass field of the policy class, its range and meaning in the field's
    metadata. ``budget: int = param(2048, 2, 1 << 24, "entries kept per layer and KV head")``: the value is
    checked against the annotation's type and ``[lo, hi]`` when the policy is built (``ConfigError``)."""
    return field(default=default, metadata={"lo": lo, "hi": hi, "doc": doc})


@dataclass(frozen=True)
class DecodeRead:
    """How a decode step reads the cache: ``kvpass::decode_attention`` settings (ART)."""

    tau: float = 0.0
    phi: float = 0.0
    patience: int = 5
    block: int = 128
    order: int = 1  # kvpass.kernels.decode_attention.ORDER_*
    probe: int = 0  # probe elements (0: all of head_dim)
    horizon: int = 0  # steps within which ART may stop (0: all); past it the rest is read split-KV
    stats: bool = False  # count blocks read (kvpass::count_visits)
    pages: bool = False  # read only the blocks the policy's ``page_map`` picks (kvpass::page_select; quest)


@dataclass(frozen=True)
class SitePlan:
    """What the rewrite does at one site."""

    attention: bool = True  # route the attention call through a kvpass operator
    evict: bool = False  # rewrite the cache update so the policy decides what is stored
    read: DecodeRead | None = None  # decode steps read the cache with ART decode attention
    tokens: bool = False  # compact receives the call's input token ids (select(..., tokens=...))
    # the graph only appends to a cache the policy already shrank: the model updates its own cache and
    # only positions are fixed (no per-layer kvpass operator); a site with a padding mask still evicts
    append: bool = False
    # a decode step writes the new token into a slot of the stored pool in place (``kvpass::pool_write``,
    # ``Policy.write``) and reads the pool; nothing is concatenated or compacted (raas)
    pool: bool = False
    # a kvpass.SlotCache site: (rule, protected slots) of kvpass.cache.slots.write_slots, set by the backend
    slot: tuple[int, int] | None = None
    slot_hooks: SlotHooks | None = None  # the policy's SlotCache state code at this site (set with ``slot``)
    # chunk fusion's recompute graphs: the new tokens overwrite their slots of a merged cache (``cache_overwrite``,
    # ``attention_slots``); ``votes`` adds ``fusion_votes`` (the question's attention, for a3+evict)
    overwrite: bool = False
    votes: bool = False
    # a prefill's selection reads the window votes of every KV head of the layer (``kvpass::layer_scores`` of
    # this observation window, passed as ``select(..., votes=)``; gathered over a tensor-parallel group): ChunkKV
    layer_votes: int = 0
    # a prefill's selection reads every query row's log-sum-exp from the prefill's own attention (``select(...,
    # lse=)``, ``kvpass::attention_lse``), given only where that attention is plainly causal: H2O
    lse: bool = False
    # a prefill's selection reads the queries before RoPE, scaled like ``q``, and the cos / sin tables that rotate
    # them (``select(..., q_pre=, cos=, sin=)``; none of them where the query is not rotated: ``q`` is the same):
    # expected_attention
    rope: bool = False
    # a prefill's selection reads the weight ``[hidden, H * D]`` of the layer's output projection, as the graph
    # reads it (``select(..., out_proj=)``; ``Site.o_proj``; a tensor-parallel rank's own heads' columns): criticalkv
    out_proj: bool = False
    # the per-head layout (``Needs.heads``, ``kvpass.cache.ragged``): the cache update is ``heads_update`` (each
    # head's new entries after its range, the heads' ranges as tensors) and later graphs attend over each head's
    # range (decode attention's ``kv_start``); set with ``evict``. ``heads_ring``: the slots of a head that keeps a
    # window (sinks + recent: DuoAttention's streaming heads), a ring on a SlotCache; 0 when no head does
    heads: bool = False
    heads_ring: int = 0
    # the attention's queries score the prompt's entries while a repeat pass runs (``kvpass::repeat_scores`` after
    # the attention, ``Policy.repeat_scores``; kvzip on the DynamicCache its passes read); idle in any other call
    repeat_scores: bool = False

    @property
    def rewrite_kind(self) -> str:
        """The rewrite this plan selects (``kvpass.compiler.rewrite.REWRITES``): ``slot``, ``overwrite``,
        ``pool``, ``evict``, ``append``, ``attention`` or ``unchanged``."""
        if self.slot is not None:
            return "slot"
        for name in ("overwrite", "pool", "evict", "append", "attention"):
            if getattr(self, name):
                return name
        return "unchanged"

    @property
    def replaces_mask(self) -> bool:
        """Whether the rewrite stops reading the model's mask somewhere (it masks by true position after
        eviction, in a slot cache, in a pool, over a merged cache): only a boolean mask survives that."""
        return self.rewrite_kind not in ("attention", "unchanged")

    def describe(self, phase: str = "") -> str:
        """One line for reports; ``phase`` is the graph's (a prefill's eviction rewrite keeps ``attention``
        with the model's own mask, later graphs use ``attention_pos``)."""
        r = self.read
        read = (
            f"decode_attention(tau={r.tau:g}, phi={r.phi:g}, p={r.patience}, block={r.block}, horizon={r.horizon})"
            if r is not None
            else None
        )
        if self.slot is not None:
            hooks = self.slot_hooks or SlotHooks()
            if self.heads:  # the per-head layout (kvpass.cache.ragged)
                if phase == "prefill":
                    return "slot (per-head layout): attention (the model's mask) + slot_prefill (each head's range)"
                read = "decode_attention over each head's range" if phase == "decode" else "attention_pos by head"
                return f"slot (per-head layout): each head's token after its range, in place + {read}"
            if phase == "prefill":
                return "slot: attention (the model's mask) + slot_prefill (the policy keeps, slots written)" + (
                    f" + {hooks.refresh.__name__}" if hooks.refresh is not None else ""
                )
            rule = ("append", f"ring (first {self.slot[1]} kept)", "placed")[self.slot[0]]
            if hooks.place is not None:
                rule += f" at {hooks.place.__name__}"
            if hooks.update is not None:
                rule += f" + {hooks.update.__name__}"
            read = read or "decode_attention (exact)"
            if hooks.select is not None:
                read += f" over the blocks of {hooks.select.__name__} (block {hooks.block})"
            more = f" + {hooks.observe.__name__} (the query before RoPE)" if hooks.observe is not None else ""
            if hooks.cut is not None and phase == "decode":
                more += f"; between steps, a cut of the layers that reach {hooks.due} entries"
            return f"slot: write_slots {rule} in place + {read} by position{more}"
        if self.overwrite:
            return (
                "overwrite: cache_overwrite + attention_slots"
                + (" + fusion_votes" if self.votes else "")
                + " (chunk fusion)"
            )
        if self.pool:
            return f"pool: step_position + pool_write (in place) + {read or 'decode_attention (exact)'}"
        if self.evict:
            att = "attention (the model's mask)" if phase == "prefill" else "attention_pos"
            votes = (
                " + layer_scores (the layer's votes)" if self.layer_votes and phase in ("prefill", "dynamic") else ""
            )
            reads = [
                what
                for flag, what in ((self.rope, "the pre-RoPE queries"), (self.out_proj, "the output projection"))
                if flag
            ]
            rope = f" (with {' and '.join(reads)})" if reads and phase in ("prefill", "dynamic") else ""
            if self.heads:  # the per-head layout: each head's range read (kvpass.cache.ragged)
                att = (
                    att
                    if phase == "prefill"
                    else ("decode_attention over each head's range" if phase == "decode" else "attention_pos by head")
                )
                return f"evict (per-head layout): heads_update + {att}{votes} + compact{rope}"
            return f"evict: cache_update + {read or att}{votes} + compact{rope}"
        if self.append:
            return f"append: the model's cache update + {read or 'attention op'}, true positions"
        if self.repeat_scores:
            return "attention op (exact) + repeat_scores (a repeat pass's scores of the prompt)"
        return (read or "attention op (exact)") if self.attention else "unchanged"


@dataclass(frozen=True)
class Refusal:
    """Why a site cannot be planned: the answer of ``plan(site)`` when the policy cannot rewrite the site."""

    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Needs:
    """What a policy needs from the compiler and the cache, declared once per policy class. The pass, the
    rewrite, the SlotCache and the runtime read it; none of them branches on a policy's name.

    * ``evicts``: it changes which entries the cache stores (at most one member of a composition may);
    * ``decode_appends``: after its prefill it never evicts, so decode and append graphs keep the model's own
      cache update and only positions are fixed (``SitePlan.append``);
    * ``gates``: its prefill is split at a selection layer (``kvpass.compiler.gate``), ``two_pass``: the
      selected tokens are prefilled again from layer 0, ``renumber``: at positions ``0..n-1``;
    * ``slot_rule``: how a decode step on a ``kvpass.SlotCache`` picks a new token's slot (``"append"``: the
      next free slot; ``"ring"``: an empty slot, else the oldest past ``slot_protect``; ``"placed"``: the
      policy's ``SlotHooks.place``), or None: no fixed-capacity decode (a SlotCache refuses it);
    * ``slot_prefill``: its own prefill runs on a SlotCache (False: a driver fills one, as
      ``kvpass.ChunkFusion(..., cache="slot")`` does);
    * ``plain_prefill``: its prefill keeps every token in the append layout with no per-layer state, so a
      forward the pass did not rewrite writes what its compiled prefill would (``full``, ``art``);
    * ``heads``: each KV head of a layer keeps its own count, its entries in a pool the row's heads share
      (``kvpass.cache.ragged``): its ``select`` answers ``ragged.Kept``, its decode steps read each head's range
      (``SitePlan.heads``); on a SlotCache its ``slot_state`` starts with ``ragged.SLOT_STATE`` (the ranges);
    * ``reconstructs``: its prefill's ``select`` reads the scores of repeat passes over the prompt (``select(...,
      scores=)``), which ``kvpass.generate.reconstruct`` runs before the prefill (kvzip; the policy answers
      ``passes`` and ``repeat_scores``).
    """

    evicts: bool = False
    decode_appends: bool = False
    gates: bool = False
    two_pass: bool = False
    renumber: bool = False
    slot_rule: str | None = None
    slot_prefill: bool = True
    plain_prefill: bool = False
    heads: bool = False
    reconstructs: bool = False

    def __post_init__(self) -> None:
        if self.slot_rule not in (None, "append", "ring", "placed"):
            raise ValueError(f"Needs.slot_rule must be None, 'append', 'ring' or 'placed', got {self.slot_rule!r}")
        if (self.two_pass or self.renumber) and not self.gates:
            raise ValueError("Needs.two_pass / renumber describe a gated prefill: set gates=True")


@runtime_checkable
class GatedPolicy(Protocol):
    """The protocol of a policy whose ``Needs.gates`` is set (``kvpass.policies.gated``): all that
    ``kvpass.compiler.gate`` reads of it. The gate keeps ``budget`` tokens, the last ``window`` of them always;
    ``layer >= 0`` forces the selection layer. After each layer of ``gate_layers(n)[0]`` the graph records
    ``[B, N]`` window scores (``kvpass::layer_scores``, summed over heads) in ``history``; after each layer
    of ``gate_layers(n)[1]`` the runner asks ``gate_fires`` and, when it does, takes ``gate_select``'s
    ascending token indices ``[B, keep]`` for the deeper layers (``ctx["kv_pos"]``: the prompt's positions,
    -1 for padding)."""

    budget: int
    window: int
    layer: int

    def gate_layers(self, n_layers: int) -> tuple[list[int], list[int]]: ...

    def gate_fires(self, layer: int, history: dict, keep: int, ctx: dict) -> bool: ...

    def gate_select(self, scores: torch.Tensor, keep: int, ctx: dict) -> torch.Tensor: ...


def forced_layer_problem(policy: GatedPolicy, n_layers: int) -> str | None:
    """Why ``policy``'s forced selection layer (``layer >= 0``) is not one of an ``n_layers``-layer model's (its
    ``gate_layers`` gives no cut), or None: said where the model is first known (``check_model``) and by the gate's
    placement in a compiled graph."""
    if policy.layer < 0 or policy.gate_layers(n_layers)[1]:
        return None
    return (
        f"parameter 'layer' = {policy.layer} is not a selection layer of this {n_layers}-layer model (allowed: 0 to "
        f"{n_layers - 2}, or -1 for the policy's rule; a gate after the last layer prunes nothing)"
    )


@runtime_checkable
class PagePolicy(Protocol):
    """The protocol of a policy that picks the pages a decode step reads on a DynamicCache
    (``kvpass::page_select``, ``kvpass.policies.pages``: quest): ``map_steps`` columns of the block map and
    ``page_map``, which returns them ``[B, H_kv, map_steps]`` int32 (-1 = none) for a step's query ``q`` and keys
    ``k`` (the new token last) from the layer's bookkeeping ``layer_state``."""

    map_steps: int

    def page_map(self, site: SiteFacts, q: torch.Tensor, k: torch.Tensor, layer_state) -> torch.Tensor: ...


@runtime_checkable
class FusionPolicy(Protocol):
    """The protocol of a chunk-fusion policy (``kvpass.policies.chunk_fusion``): all that the driver
    ``kvpass.ChunkFusion`` reads of it. ``recover_positions``: rotate stored keys to their positions in the
    request (else to their own ``0..n-1``); ``needs_probe``: run the two-layer selection pass first, whose
    ``select`` sets ``request.scores``; ``recompute(request)``: the ascending positions recomputed ``[R]``;
    ``needs_votes``: after the recompute pass, ``keep_after_fusion(votes, request)`` gives each layer's kept
    entries (``None`` keeps all). The driver sets ``request`` for the selection pass and clears it after."""

    recover_positions: bool
    needs_probe: bool
    needs_votes: bool
    request: Any

    def recompute(self, request) -> torch.Tensor: ...

    def keep_after_fusion(self, votes: torch.Tensor, request) -> torch.Tensor | None: ...


@runtime_checkable
class ReconstructPolicy(Protocol):
    """The protocol of a policy whose ``Needs.reconstructs`` is set (kvzip): all that ``kvpass.generate.reconstruct``
    and the runtime read of it. ``passes(ids, mask)``: the repeat passes of a prompt, ``(start, end, pass_ids,
    pass_mask)`` per chunk; ``repeat_scores(q, k, valid, (start, end), softcap)``: one layer's scores ``[B, H_kv, end -
    start]`` of the chunk its pass repeats; ``unscored(cache)``: why it keeps every entry of a ``cache`` cache that no
    pass scores."""

    def passes(self, ids: torch.Tensor, mask: torch.Tensor | None) -> list: ...

    def repeat_scores(
        self, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor | None, span: tuple, softcap: float
    ) -> torch.Tensor: ...

    def unscored(self, cache: str) -> str: ...


@dataclass(frozen=True)
class SlotHooks:
    """Tensor code a policy runs on its ``kvpass.SlotCache`` layer state (``Policy.slot_state``), placed by
    the rewrite inside the compiled graphs (so it is captured with them: no Python per step). Each is a
    module-level function; ``state`` is the layer's state tensors in ``slot_state`` order, ``args`` the
    policy's constants:

    * ``refresh(keys, pos, count, state, *args)``: after a prefill or an append wrote the slots, rebuild
      the state from them (in place);
    * ``place(pos, count, state, *args) -> slot [B, H_kv, 1]``: before a decode step's write, the slot
      its token goes into (the ``"placed"`` slot rule; the hook may empty the slots it evicts);
    * ``update(q, keys, pos, count, state, k_new, *args)``: after a decode step wrote its token (``count``
      already counts it; ``q`` is the step's query with the softmax scale applied), fold it in (in place);
    * ``select(q, pos, count, state, *args) -> block_map [B, H_kv, steps]`` int32: the blocks of
      ``block`` slots the decode step reads (``decode_attention``'s ``ORDER_MAP``; -1 reads nothing);
    * ``observe(q_pre, cos, sin, state, *args)``: in a decode step, the step's query before RoPE (scaled like
      ``q``; ``q`` itself, and no tables, where the query is not rotated) and RoPE's ``cos`` / ``sin`` tables
      (``SitePlan.rope``), folded into the state (in place);
    * ``cut(keys, values, pos, count, state, *args)``: between two decode steps, outside the compiled graph,
      shrink the rows whose layer is due (``kvpass.cache.cuts``: expected_attention's periodic cut); ``due`` is the
      number of filled slots at which a row is.
    """

    refresh: Callable | None = None
    place: Callable | None = None
    update: Callable | None = None
    select: Callable | None = None
    observe: Callable | None = None
    cut: Callable | None = None
    due: int = 0
    args: tuple = ()
    block: int = 128


def shrinking_plan(site: SiteFacts) -> SitePlan | Refusal:
    """The plan of a policy that evicts from global layers: sliding-window layers are already
    bounded and are left to the model (attention op only); eviction needs a cache that can shrink."""
    if site.sliding_window:
        return SitePlan(attention=True, evict=False)
    if site.cache not in ("dynamic", "slot"):
        return Refusal(
            f"layer {site.layer}: eviction needs a cache that can shrink (DynamicCache); "
            f"this graph uses a {site.cache} cache"
        )
    return SitePlan(attention=True, evict=True)


def decode_read_problem(site: SiteFacts) -> str | None:
    """Why ``decode_attention`` cannot serve this site's decode step, or None when it can."""
    mask = site.mask.meta.get("example_value") if isinstance(site.mask, fx.Node) else None
    if site.q_len != 1:
        return f"query length {site.q_len} (decode attention reads for one token)"
    if site.causal == 1:
        return "a top-left causal mask on a single query"
    q, v = (n.meta.get("example_value") if isinstance(n, fx.Node) else None for n in (site.q, site.v))
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.shape[-1] != v.shape[-1]:
        return f"query head size {q.shape[-1]} != value head size {v.shape[-1]}"
    if isinstance(mask, torch.Tensor) and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1):
        return f"a mask of shape {tuple(mask.shape)} (needs [B, 1, 1, L])"
    return None


class Policy:
    """Base class. A subclass sets ``name``, ``summary`` and ``needs``, declares its parameters as fields
    (``budget: int = param(...)``: every subclass is a keyword-only dataclass) and overrides the hooks it
    needs. ``params`` lists the parameters (``Param`` records, for the CLI, composition and reports)."""

    name: ClassVar[str] = "?"
    params: ClassVar[tuple[Param, ...]] = ()
    summary: ClassVar[str] = ""
    needs: ClassVar[Needs] = Needs()
    members: ClassVar[tuple] = ()  # a composition's policies (kvpass.policies.compose); empty for one policy

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        old = sorted(set(vars(cls)) & (set(Needs.__dataclass_fields__) | {"params"}))
        if old:  # the attributes before Needs and parameter fields: ignored now, so refused, not silently dropped
            raise TypeError(
                f"policy class {cls.__name__}: declare {', '.join(old)} as Needs fields or parameter "
                f"fields (needs = Needs(...); budget: int = param(...)), not as class attributes"
            )
        own_init = "__init__" in vars(cls)
        dataclass(cls, kw_only=True, repr=False, eq=False)
        cls.params = tuple(
            Param(
                f.name, _kind(f.type), f.default, f.metadata.get("lo"), f.metadata.get("hi"), f.metadata.get("doc", "")
            )
            for f in fields(cls)
        )
        if not own_init:  # an unknown keyword is a ConfigError naming the parameters, not a TypeError
            cls.__init__ = _checked_init(cls, cls.__init__)

    def __post_init__(self) -> None:
        for p in self.params:
            setattr(self, p.name, p.check(self.name, getattr(self, p.name)))
        self.check_config()

    @property
    def config(self) -> dict[str, Any]:
        """The parameters' values, by name."""
        return {p.name: getattr(self, p.name) for p in self.params}

    @property
    def slot_protect(self) -> int:
        """Leading slots a "ring" never evicts."""
        return 0

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        """Slots layer ``layer`` of ``layers`` needs in a SlotCache for sequences of at most ``max_length``
        tokens of which at most ``max_new_tokens`` are decoded (never more than ``max_length`` unless the
        policy's layout needs it: raas rounds to pages). ``ranks``: the tensor-parallel ranks the layer's KV heads
        are split over, each holding a contiguous share; every rank's cache gets the slots its share needs."""
        return max_length

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict[str, tuple[tuple[int, ...], Any, Any]]:
        """Per-layer decode state a SlotCache allocates beside the slots: ``{name: (shape after [B, H_kv],
        dtype or None for the cache's dtype, fill value)}``, in the order ``SlotHooks`` receive it. ``groups``:
        the query heads of each KV head."""
        return {}

    def slot_hooks(self, site: SiteFacts) -> SlotHooks | None:
        """The tensor code that keeps ``slot_state`` at ``site`` (None: the slots alone suffice)."""
        return None

    def check_config(self) -> None:
        """Cross-parameter checks; raise ConfigError."""

    def check_model(self, config) -> None:
        """Checks against a model's config where the model is known before anything compiles (``kvpass.compile``,
        ``kvpass.SlotCache``); raise ConfigError. A graph compiled through ``kvpass.backend`` meets the same
        mismatch in ``plan`` (a ``Refusal``: the graph compiled unchanged, with the reason)."""

    # -- compile time ---------------------------------------------------------------------------
    def plan(self, site: SiteFacts) -> SitePlan | Refusal:
        """What the rewrite does at ``site``, or a ``Refusal`` saying why it cannot be planned."""
        return SitePlan(attention=True)

    def graph_refusal(self, sites) -> str | None:
        """Why a graph with these attention ``sites`` cannot be planned as a whole (the graph then compiles
        unchanged, with the reason), or None. Per-site reasons belong in ``plan``."""
        return None

    def idle_reason(self, sites) -> str | None:
        """Why these parameters change nothing on a model with these attention ``sites`` (said once as a
        warning, naming the parameter), or None."""
        return None

    # -- run time, evicting policies --------------------------------------------------------------
    def stored_length(self, site: SiteFacts, total):
        """Entries stored after ``compact`` given ``total`` (stored + new); SymInt-safe."""
        return total

    def select(self, site: SiteFacts, q, k, v, kv_pos, q_pos, layer_state):
        """Indices [B, H_kv, stored_length] (ascending) of entries to keep, or None to keep all.

        A policy whose plan sets ``SitePlan.tokens`` also receives ``tokens=`` (the input ids of the
        call, ``[B, L_new]``) and must accept that keyword."""
        return None

    def write(self, site: SiteFacts, q, k_pool, v_pool, k_new, v_new, q_pos, layer_state):
        """Decode step of a site planned ``SitePlan.pool``: write ``k_new`` / ``v_new`` ``[B, H_kv, 1, D]``
        into a slot of the stored ``k_pool`` / ``v_pool`` in place and return the positions of every
        slot after the write (``[B, H_kv, slots]``, -1 = empty); ``q`` is the step's scaled query and
        ``q_pos [B, 1]`` the new token's true position. Calling it twice for the same step must give
        the same result (operators are replayed)."""
        raise NotImplementedError(f"policy '{self.name}' plans no pool sites")

    # -- identity -------------------------------------------------------------------------------
    def key(self) -> str:
        return self.name + "(" + ",".join(f"{k}={v!r}" for k, v in sorted(self.config.items())) + ")"

    def uuid(self) -> str:
        """Hash of the configuration and of the policy's source code."""
        src = inspect.getsource(type(self))
        return hashlib.sha256((self.key() + src).encode()).hexdigest()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{type(self).__name__}({args})"


def unknown_parameter(policy: str, params: tuple[Param, ...], values) -> None:
    """Raise ``ConfigError`` when ``values`` names a parameter ``params`` does not declare."""
    known = {p.name for p in params}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"policy '{policy}' has no parameter '{unknown[0]}'; its parameters are: "
            f"{', '.join(sorted(known)) or 'none'}"
        )


def _checked_init(cls, init):
    @functools.wraps(init)
    def checked(self, **values):
        unknown_parameter(cls.name, cls.params, values)
        init(self, **values)

    return checked
