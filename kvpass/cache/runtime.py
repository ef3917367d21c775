"""The bridge between compiled graphs and Python-side policy state.

A rewritten graph calls kvpass operators with an integer ``handle``; the handle names the
``Runtime`` of one ``kvpass.backend(...)`` object, which holds the policy, the detected sites and
the generation state. Operators never mutate anything but the generation state, and every
mutation is a pure function of the operator's inputs, so replaying a call gives the same result.

Why a table of handles: the pass rewrites a graph whose inputs Dynamo fixed, so an operator can reach per-backend
Python state only through a constant in the graph. An integer is the constant every supported torch accepts; an
opaque Python object as an operator argument needs ``torch._library``'s private opaque-object API, which changed
between torch 2.13 and 2.15. A ``kvpass.SlotCache`` decode step needs no handle: its state is tensors of the cache,
which Dynamo makes graph inputs.

``key`` in these methods names one compiled graph's attention site (``Site.key``: ``graph x KEY_STRIDE + layer``).
Each graph's operators read the ``SiteFacts`` of their own graph (``Runtime.sites[key]``), never one a later graph of
the same layer wrote; the layer's state is shared by the graphs that read and write that layer's cache
(``layer_of(key)``).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from kvpass.cache import ragged
from kvpass.cache.site_facts import SiteFacts
from kvpass.cache.state import TICKS, GenerationState
from kvpass.errors import ConfigError, device_assert, warn_once
from kvpass.kernels.gather import gather_pair

# Weak: a runtime lives as long as its backend object (which torch.compile keeps alive for as
# long as the compiled function exists).
_RUNTIMES: "weakref.WeakValueDictionary[int, Runtime]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(rt: "Runtime") -> int:
    handle = next(_NEXT)
    _RUNTIMES[handle] = rt
    return handle


def get(handle: int) -> "Runtime":
    try:
        return _RUNTIMES[handle]
    except KeyError:
        raise RuntimeError(
            f"kvpass: no runtime with handle {handle}; its backend is gone (a runtime lives as long as "
            f"its kvpass.backend object)"
        ) from None


KEY_STRIDE = 1 << 16  # site keys: graph number x KEY_STRIDE + layer index


def layer_of(key: int) -> int:
    """The layer index of a site key."""
    return key % KEY_STRIDE


def past_length(k_past: Tensor) -> int:
    """Stored length of a cache tensor; an empty DynamicCache layer is a 1-D ``tensor([])``."""
    return k_past.shape[-2] if k_past.dim() == 4 else 0


def selection_inputs(
    tokens: Tensor | None,
    votes: Tensor | None,
    lse: Tensor | None = None,
    q_pre: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    out_proj: Tensor | None = None,
    scores: Tensor | None = None,
) -> dict:
    """The optional inputs of ``Policy.select``: only policies whose plan asks for them get them (``tokens``:
    the call's input ids; ``votes``: the window votes of every KV head of the layer; ``lse``: the prefill
    attention's row log-sum-exp; ``q_pre``, ``cos``, ``sin``: the query before RoPE, scaled like ``q``, and the
    RoPE tables; ``out_proj``: the weight ``[hidden, H * D]`` of the layer's output projection; ``scores``: the
    layer's scores from repeat passes over this prompt, ``GenerationState.scores``)."""
    named = (
        ("tokens", tokens),
        ("votes", votes),
        ("lse", lse),
        ("q_pre", q_pre),
        ("cos", cos),
        ("sin", sin),
        ("out_proj", out_proj),
        ("scores", scores),
    )
    return {k: v for k, v in named if v is not None}


def choose(
    policy, info, q: Tensor, k: Tensor, v: Tensor, kv_pos: Tensor, q_pos: Tensor, layer_state, extra: dict
) -> tuple[Tensor | None, Tensor, dict | None]:
    """What a layer keeps of ``k``/``v`` under ``policy.select``, on either cache: ``(idx, kept_pos, bookkeeping)``
    with ``idx [B, H_kv, n]`` the entries to gather (None: every entry, as stored), ``kept_pos`` their true
    positions (-1 for an empty slot of a preallocated pool, which ``select`` marks with index -1) and the
    policy's bookkeeping for the layer (a ``select`` may return ``(keep, bookkeeping)``), or None."""
    keep = policy.select(info, q, k, v, kv_pos, q_pos, layer_state, **extra)
    book = None
    if isinstance(keep, tuple):
        keep, book = keep
    if keep is None or isinstance(keep, ragged.Kept):  # every entry; or a per-head selection (Runtime.compact)
        return keep, kv_pos, book
    idx = keep.clamp_min(0)
    return idx, kv_pos.gather(2, idx).masked_fill(keep < 0, -1), book


def key_validity(mask: Tensor | None, b: int, length: int) -> Tensor | None:
    """[B, L] True where a key is visible to at least one query (False = padding), from an HF mask."""
    if mask is None or mask.dim() != 4 or mask.shape[-1] != length:
        return None
    if mask.dtype == torch.bool:
        vis = mask
    else:
        vis = mask > torch.finfo(mask.dtype).min / 2
    # the query dimension first: [B, 1, L, L] reduced over its size-1 head dimension first would copy it
    return vis.any(dim=-2).any(dim=1).expand(b, length)


class Runtime:
    """Policy + sites + state for one backend object."""

    def __init__(self, policy) -> None:
        self.policy = policy
        self.state = GenerationState()
        self.sites: dict[int, SiteFacts] = {}  # site key -> that graph's site (kvpass.compiler.detect.Site)
        self._graphs = itertools.count()
        self.visits: dict[int, tuple] = {}  # layer -> (blocks read, blocks present), decode attention
        # a two-pass gated prefill's first pass (kvpass.compiler.gate): SlotCache writes that overflow are skipped,
        # the last such layer noted in ``overflow``
        self.first_pass: bool = False
        self.overflow: int | None = None
        self.unchanged_prefill = ""  # why the last prefill graph was compiled unchanged (compiler.backend)
        # the last gated prefill's GateInfo (selection layer, prompt length, tokens kept); set by that prefill's
        # runner (kvpass.compiler.gate.runner), None until one runs
        self.gate = None
        # the kvpass.SlotCaches built for this backend, and (TICKS, the one the last SlotCache prefill wrote)
        self.slot_caches: weakref.WeakSet = weakref.WeakSet()
        self.slot_view: tuple | None = None
        # DynamicCaches, told apart by the tensor each holds for its first kvpass layer (a graph's output, which the
        # cache stores and the next call passes back in): the one ``state`` describes, and the others' descriptions
        self._holder: weakref.ref | None = None
        self._held_shape: tuple = ()  # its shape (a reordered copy replaces it, and it dies)
        self._aside: dict[int, tuple[weakref.ref, dict]] = {}  # id(tensor) -> (that tensor, GenerationState.take())
        self.handle = register(self)

    def add_graph(self, sites: list[SiteFacts]) -> None:
        """Give one compiled graph's sites their keys (``site.key``) and keep them: that graph's operators name
        their site by its key, so a later graph of the same layers (another phase or cache, ``use_cache=False``)
        changes nothing they read."""
        first = next(self._graphs) * KEY_STRIDE
        for site in sites:
            site.key = first + site.layer
            self.sites[site.key] = site

    def follow(self, held: Tensor | None) -> None:
        """Before a DynamicCache graph runs: make ``state`` describe the cache whose first kvpass layer holds
        ``held`` (None or empty: a new cache, which the graph's prefill fills). The current description goes aside
        while its cache lives; a cache set aside earlier gets its own back. A tensor no graph of this backend
        returned (a cache filled or cropped behind kvpass) leaves ``state`` as it is, and the operators' checks
        refuse what does not match."""
        holder = self._holder() if self._holder is not None else None
        if held is not None and held is holder:
            return
        back = self._aside.pop(id(held), None) if held is not None else None
        if back is not None and back[0]() is not held:
            back = None  # a dead tensor's id, reused
        if held is not None and held.numel() and back is None:
            # rows of a batch reordered (a cache of one row that kvpass built itself, chunk fusion's, is not)
            reordered = held.shape == self._held_shape and held.shape[0] > 1
            if self.state.layers and not self.state.passes and reordered:
                warn_once(
                    f"kvpass: a call runs on DynamicCache keys that no kvpass graph returned, shaped as the cache "
                    f"policy '{self.policy.name}' keeps records for: beam or contrastive search reordering the "
                    f"cache's rows (reorder_cache), or a copy of the cache. The records do not follow such a "
                    f"change, so where they differ between rows (scores of the attention each entry received, "
                    f"page bounds) a row reads another row's. Decode with num_beams=1 under an evicting policy "
                    f"on a DynamicCache",
                    self.handle,
                )
            return
        if holder is not None and self.state.layers:
            self._aside = {k: v for k, v in self._aside.items() if v[0]() is not None}
            self._aside[id(holder)] = (self._holder, self.state.take())
        if back is not None:
            self.state.put(back[1])
        self._holder = None

    def held_by(self, out: Tensor) -> None:
        """After a DynamicCache graph ran: ``out`` is what the cache now holds for its first kvpass layer."""
        self._holder, self._held_shape = weakref.ref(out), tuple(out.shape)

    def slot_prefilled(self, ident: int) -> None:
        """A SlotCache prefill wrote a layer of the cache whose ``ident`` is given: note that cache as the last
        one."""
        for cache in list(self.slot_caches):
            if cache.ident == ident:
                self.slot_cache_prefilled(cache)
                return

    def slot_cache_prefilled(self, cache) -> None:
        """A prefill wrote the SlotCache ``cache``: note it as the last one."""
        self.slot_view = (next(TICKS), weakref.ref(cache))

    def last_state(self):
        """The state of the last generation: this runtime's (a DynamicCache) or, when a SlotCache prefill came
        after its last fresh record, that cache's ``state()``."""
        if self.slot_view is not None and self.slot_view[0] > self.state.fresh_at:
            cache = self.slot_view[1]()
            if cache is not None:
                return cache.state()
        return self.state

    # -- called from operators ------------------------------------------------------------------

    def positions(self, key: int, k_past: Tensor, k_new: Tensor, mask: Tensor | None):
        """True token indices of the stored + new entries, and of the new (query) tokens."""
        b, hkv, ln = k_new.shape[:3]
        lp = past_length(k_past)
        dev = k_new.device
        layer = layer_of(key)
        st = self.state.layer(layer)
        if lp > 0 and st is not None and tuple(st.pos.shape[:2]) == (b, hkv) and st.pos.shape[2] <= lp:
            # entries past the record were added by a graph that only appends (SitePlan.append)
            past_pos, seen = st.extended(lp - st.pos.shape[2])
            past_pos, valid = past_pos.to(dev), None
        elif 0 < lp < (m := st.pos.shape[2] if st is not None else 0) and int(st.seen) > m:
            raise ValueError(
                f"kvpass: policy '{self.policy.name}' evicted from layer {layer}'s cache ({int(st.seen)} tokens seen, "
                f"{m} kept), and it now holds {lp} entries: something removed entries behind kvpass (assisted or "
                f"prompt-lookup decoding crops rejected drafts; the tokens evicted for them cannot come back). "
                f"Decode without an assistant with this policy, or start a new cache with this backend's prefill"
            )
        else:  # a new prefill, or a cache kvpass did not write: entries are the tokens 0..lp-1
            past_pos = torch.arange(lp, device=dev).expand(b, hkv, lp)
            seen, valid = lp, key_validity(mask, b, lp + ln)
        q_pos = (seen + torch.arange(ln, device=dev)).expand(b, ln).contiguous()
        kv_pos = torch.cat([past_pos, q_pos[:, None, :].expand(b, hkv, ln)], dim=-1)
        if valid is not None:
            kv_pos = torch.where(valid[:, None, :], kv_pos, torch.full_like(kv_pos, -1))
        return kv_pos.contiguous(), q_pos

    def compact(
        self,
        key: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_pos: Tensor,
        q_pos: Tensor,
        tokens: Tensor | None = None,
        votes: Tensor | None = None,
        lse: Tensor | None = None,
        q_pre: Tensor | None = None,
        cos: Tensor | None = None,
        sin: Tensor | None = None,
        out_proj: Tensor | None = None,
    ):
        layer = layer_of(key)
        idx, pos, book = choose(
            self.policy,
            self.sites[key],
            q,
            k,
            v,
            kv_pos,
            q_pos,
            self.state.layer(layer),
            selection_inputs(tokens, votes, lse, q_pre, cos, sin, out_proj),
        )
        fresh = kv_pos.shape[-1] == q_pos.shape[1]  # nothing was stored before: a new prefill
        b, h, n = kv_pos.shape
        heads = None
        if isinstance(idx, ragged.Kept):  # the per-head layout: the row's pool, stored as [B, H_kv, L, D]
            kept = -(-idx.sel.shape[1] // h)  # L: a total that is not a multiple of H_kv leaves the last slots empty
            k_out, v_out, pos, heads = ragged.pack(k, v, kv_pos, idx, size=h * kept)
            pos = pos.to(kv_pos.dtype)
        elif idx is None:
            k_out, v_out, pos = (t.clone(memory_format=torch.contiguous_format) for t in (k, v, kv_pos))
            if self.policy.needs.heads:  # heads_update laid the entries out: the ranges it made
                heads = self.head_ranges(layer, b, h, n - q_pos.shape[1], kv_pos, q_pos, fresh)
        else:
            k_out, v_out = gather_pair(k, v, idx)  # Triton compaction on CUDA
        if fresh and not self.policy.needs.gates:  # (a gated prefill: GatedGraph._record, after its rings' padding)
            self.refuse_uneven_padded(layer, self.sites[key].sliding_window, k_out.shape[2], kv_pos)
        seen = q_pos[0, -1] + 1  # a device tensor: int() here would sync the GPU once per layer and step
        st = self.state.set_layer(layer, pos, seen, fresh=fresh)
        if book is not None:  # the policy's bookkeeping for the layer (a paged policy's page tables)
            st.extra = book
        if heads is not None:
            st.extra = {**st.extra, "heads": heads}
        return k_out, v_out

    def refuse_uneven_padded(self, layer: int, window: int | None, stored: int, prompt: Tensor) -> None:
        """A left-padded prefill (``prompt``: the prompt's positions, ``[B, n]`` or ``[B, H_kv, n]``, -1 = padding)
        that leaves ``layer`` of a DynamicCache holding ``stored`` entries where the first layer of its kind (global,
        or sliding over ``window``) holds another count cannot decode: transformers sizes the decode step's
        attention mask by that layer's cache and hands it to every layer of the kind, so Dynamo's trace of the model
        fails on the others with a shape error. Refused here, by name, before that (one host read, only where the
        counts differ). A layer kvpass did not record holds what the model's cache keeps of the prompt."""
        earlier = sorted(s.layer for s in self.sites.values() if s.layer < layer and s.sliding_window == window)
        if not earlier:
            return
        first, n = self.state.layers.get(earlier[0]), prompt.shape[-1]
        other = first.pos.shape[2] if first is not None else n if window is None else min(n, window - 1)
        if other == stored or not bool((prompt < 0).any()):
            return
        raise ConfigError(
            f"kvpass: policy '{self.policy.name}' keeps {stored} entries in layer {layer} and {other} in layer "
            f"{earlier[0]} of this left-padded batch on a DynamicCache; transformers sizes the decode step's attention "
            f"mask by the first layer's cache, so no step could decode it (Dynamo's trace of the model fails). Use a "
            f"kvpass.SlotCache (kvpass.compile's generate without past_key_values), or batch prompts of one length "
            f"without padding"
        )

    def head_ranges(self, layer: int, b: int, h: int, stored: int, kv_pos: Tensor, q_pos: Tensor, fresh: bool):
        """``ranges [B, H_kv, 4]`` of a per-head layer (``kvpass.cache.ragged``) after a call's ``q`` entries per
        head joined its ``stored``: the prompt of a new prefill kept whole, else the recorded ranges grown as
        ``heads_update`` grew them (a layer kvpass did not lay out holds ``stored / H_kv`` per head)."""
        if fresh:
            return ragged.uniform(b, h, q_pos.shape[1], kv_pos.device)
        return ragged.grown(self._ranges(layer, b, h, stored, kv_pos.device), q_pos.shape[1])

    def _ranges(self, layer: int, b: int, h: int, stored: int, device) -> Tensor:
        st = self.state.layer(layer)
        got = None if st is None else st.extra.get("heads")
        return got if got is not None else ragged.uniform(b, h, stored, device)

    def heads_update(self, key: int, k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor, mask: Tensor | None):
        """``cache_update`` for a per-head layer: ``(k, v, kv_pos, q_pos, start, length)``, each head's new entries
        after its range in the row's pool (``ragged.grow``; stored as ``[B, H_kv, L, D]``), and the heads' ranges."""
        b, h, ln = k_new.shape[:3]
        lp = past_length(k_past)
        layer = layer_of(key)
        st = self.state.layer(layer)
        if lp == 0:  # a new prefill: the prompt, every head its whole
            kv_pos, q_pos = self.positions(key, k_past, k_new, mask)
            ranges = ragged.uniform(b, h, ln, k_new.device)
            return k_new, v_new, kv_pos, q_pos, ranges[..., ragged.START], ranges[..., ragged.LENGTH]
        if st is None or st.pos.shape[2] != lp:
            raise ValueError(
                f"kvpass: policy '{self.policy.name}' keeps a per-head layout in layer {layer}'s cache, "
                f"and the cache holds {lp} entries per head where kvpass recorded "
                f"{None if st is None else st.pos.shape[2]}: something wrote the cache behind kvpass "
                f"(a cache filled without this backend, or cropped by assisted decoding). Start a new "
                f"cache with this backend's prefill"
            )
        q_pos = (st.seen + torch.arange(ln, device=k_new.device)).expand(b, ln).contiguous()

        def flat(t):
            return t.reshape(b, 1, h * lp, *t.shape[3:])

        keys, values, pos, ranges = ragged.grow(
            flat(k_past.to(k_new.dtype)),
            flat(v_past.to(v_new.dtype)),
            flat(st.pos.to(k_new.device)),
            self._ranges(layer, b, h, lp, k_new.device),
            k_new,
            v_new,
            q_pos,
        )
        n = lp + ln
        return (
            keys.view(b, h, n, k_new.shape[-1]),
            values.view(b, h, n, v_new.shape[-1]),
            pos.view(b, h, n),
            q_pos,
            ranges[..., ragged.START],
            ranges[..., ragged.LENGTH],
        )

    def step_position(self, key: int, k_pool: Tensor) -> Tensor:
        """``[B, 1]``: the true position of a pool site's new token (the tokens its layer has seen)."""
        st = self.state.layer(layer_of(key))
        if st is None or tuple(st.pos.shape) != (k_pool.shape[0], k_pool.shape[1], k_pool.shape[2]):
            raise RuntimeError(
                f"policy '{self.policy.name}': a decode step found no page pool for its cache "
                "(the cache was not filled by this policy's prefill with this backend)"
            )
        seen = torch.as_tensor(st.seen, device=k_pool.device)
        return seen.reshape(1, 1).expand(k_pool.shape[0], 1).contiguous()

    def pool_write(
        self, key: int, q: Tensor, k_pool: Tensor, v_pool: Tensor, k_new: Tensor, v_new: Tensor, q_pos: Tensor
    ) -> Tensor:
        """A pool site's decode step: the policy writes the new token into the pool in place; the layer
        records the pool's positions after the write and the tokens seen."""
        st = self.state.layer(layer_of(key))
        pos = self.policy.write(self.sites[key], q, k_pool, v_pool, k_new, v_new, q_pos, st)
        self.state.set_layer(layer_of(key), pos, q_pos[0, -1] + 1, fresh=False)
        return pos

    def repeat_scores(self, key: int, q: Tensor, k: Tensor, mask: Tensor | None, softcap: float) -> None:
        """While a repeat pass runs (``state.repeat``): the scores its queries ``q [B, H, r, D]`` (scaled) give the
        chunk of the prompt it repeats, from the keys ``k [B, H_kv, n + r, D]`` (the prompt's, then the pass's),
        into the layer's ``state.scores [B, H_kv, n]``. Nothing outside a pass; outside ``kvpass.repeat_passes``
        (a graph of several tokens on a cache kvpass does not fill by passes) the policy says, once, that it keeps
        every entry."""
        span = self.state.repeat
        if span is None:
            if not self.state.passes:  # the plain backend on a cache of its own: no pass will score this prompt
                warn_once(f"kvpass: {self.policy.unscored(self.sites[key].cache)}", self.handle)
            return
        b, hkv, total = k.shape[:3]
        n = total - q.shape[2]
        layer = layer_of(key)
        held = self.state.scores.get(layer)
        if held is None or tuple(held.shape) != (b, hkv, n):
            held = self.state.scores[layer] = torch.zeros(b, hkv, n, dtype=torch.float32, device=k.device)
        held[..., span[0] : span[1]] = self.policy.repeat_scores(q, k, key_validity(mask, b, total), span, softcap)

    def count_visits(self, key: int, visited: Tensor, n_blocks: int) -> None:
        """Accumulate blocks read / blocks present of one decode attention call (ART statistics)."""
        read, total = self.visits.get(layer_of(key), (0, 0))
        self.visits[layer_of(key)] = (read + visited.sum(), total + visited.numel() * n_blocks)

    def blocks_read(self) -> float | None:
        """Fraction of KV blocks that decode attention read since the last reset, or None."""
        total = sum(t for _, t in self.visits.values())
        return float(sum(r for r, _ in self.visits.values())) / total if total else None

    def stored_length(self, key: int, total):
        return self.policy.stored_length(self.sites[key], total)

    def note_positions(self, pos: Tensor) -> None:
        """Position ids passed into a graph that appends to a cache: true already, unless they were counted
        from the *stored* length, which eviction shortened: ``generate`` continuing a cache with
        past_key_values, assisted or prompt-lookup decoding (it crops rejected drafts and counts what is
        left), or a model that computes positions before a graph break (CTRL). Such positions start behind
        the tokens seen: refused (one sync per call of several tokens; a device assert for one token per
        row on a GPU). Otherwise the state learns how far the sequence reached."""
        st = self.state
        if pos.numel() == 0 or not st.layers:
            return
        rows = pos.reshape(pos.shape[0], -1)
        # the row that reaches furthest (unpadded) must start at the tokens seen
        if rows.shape[1] > 1:
            first = int(rows[rows.max(-1).values.argmax()].min())
            if first < st.seen:
                raise ValueError(self._behind(f"this call feeds again the tokens from position {first}", st.seen))
        elif pos.device.type == "cpu":
            if int(pos.max()) < st.seen:
                raise ValueError(self._behind(f"this step's position is {int(pos.max())}", st.seen))
        else:
            # (torch caps a device assert's message at 255 characters; the CPU's message says more)
            device_assert(
                pos.max() >= torch.as_tensor(st.seen_now(), device=pos.device),
                "kvpass: the policy evicted from this cache, and a decode position passed in is behind "
                "the tokens seen (assisted decoding? generate continuing? a graph break?): see "
                "kvpass.cache.runtime.Runtime.note_positions",
            )
        st.note_tail(pos.max() + 1)

    def _behind(self, what: str, seen: int) -> str:
        return (
            f"kvpass: this cache has seen {seen} tokens under policy '{self.policy.name}', and {what}: "
            f"positions were counted from the entries stored, which are fewer after an eviction or after "
            f"transformers cropped the cache. transformers counts so when generate continues with "
            f"past_key_values, and crops in assisted and prompt-lookup decoding (the rejected drafts, which "
            f"'{self.policy.name}' has already seen and cannot give back); a model counts so when it computes "
            f"positions before a graph break. Continue on a kvpass.SlotCache (it counts tokens seen), decode "
            f"without an assistant or prompt lookup (or use policy 'full'), pass position_ids, or start a new "
            f"cache"
        )

    def true_positions(self, pos: Tensor, prefill: bool = False) -> Tensor:
        """Position ids the model derived from the stored length -> the true token count.

        Derived positions are ``base + stored + arange(q)`` in any layout (``[1, q]``, ``[B, q]``,
        ``[1, q, 1]``): ``base`` is the model's first position (0 for RoPE and GPT-2's table, 2 for OPT's
        and BioGPT's), learned in the prefill (``prefill``: the cache was empty, nothing changes). After an
        eviction ``stored`` lags the tokens seen; the true positions are ``base + seen + arange(q)``."""
        if pos.numel() == 0:
            return pos.clone()
        st = self.state
        if prefill:
            # the largest position is the last token's in an unpadded row (padded rows of OPT's
            # mask-derived positions start lower), so the first is largest + 1 - q
            q = max(pos.shape[1:], default=pos.shape[0]) if pos.dim() > 1 else pos.shape[0]
            st.base = pos.max() + 1 - q  # a 0-d tensor: no device sync (the layers' fresh records set the count)
            return pos.clone()
        if st.anchor_at != st.records:
            # A layer recorded its count since the last call: the distance between true and derived
            # positions is taken there. Graphs that only append (SitePlan.append) record nothing, and
            # add as many tokens to the stored length as to the true count, so the distance holds.
            # (No record at all: nothing was evicted, derived positions are true.)
            st.offset = (st.seen_now() + st.base - pos.min()) if st.layers else 0
            st.anchor_at = st.records
        true = pos + st.offset
        st.note_tail(true.max() + 1 - st.base)
        return true
