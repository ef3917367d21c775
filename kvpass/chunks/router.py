"""``ChunkFusion``: requests whose prefill reuses stored chunk KV (A^3 and its baselines).

    store = kvpass.ChunkStore("/data/kv", model, tokenizer=tok)
    fusion = kvpass.ChunkFusion(model, store, policy="a3")            # ratio=0.15
    out = fusion.generate(system="You answer questions.", chunks=[doc1, doc2, doc3],
                          question="Who ...?", max_new_tokens=32)     # model.generate's output ids

    # or prepare the cache and call HF generation yourself
    fused = fusion.prepare(system=..., chunks=[...], question=...)
    out = model.generate(fused.input_ids, attention_mask=fused.attention_mask,
                         cache=fused.cache, max_new_tokens=32)   # past_key_values= before transformers 5.24

A request is ``[S, D1 .. Dk, Q]``. ``prepare``:

1. loads every segment's KV (S and each chunk) from the store, computing and storing the unseen
   ones; keys are stored before RoPE;
2. builds the merged cache: per layer the segments' keys rotated to their positions in the request
   (``full_reuse``: to their own positions ``0..n-1``) by ``kvpass::rope_rotate`` with the layer's
   own rotary tables, values concatenated, plus empty slots for the question but its last token;
3. picks the recompute set Re (the policy: by the question's layer-1 attention for ``a3``, by
   layer-1 key deviation for ``cacheblend``, from a selection pass of the first two layers on all
   tokens; a fixed rule for ``legolink``; nothing for ``pie``/``full_reuse``);
4. runs the compiled model on [Re, Q without its last token] at their true positions: every site
   writes their K/V over their slots (``cache_overwrite``) and attends with the exact causal mask of
   true positions (``attention_pos``);
5. ``a3+evict`` only: compacts each layer to S, Q and the documents that the question's attention
   in the recompute pass ranks highest (at most ``capacity - 1`` entries).

The returned cache holds one entry per position of the request but the last (``a3+evict``: its
kept entries), so ``prefill`` or HF's ``generate`` computes the last question token and goes on
decoding as usual. A cache shorter than the request (``a3+evict``) must decode through
``ChunkFusion.forward`` / ``prefill`` / ``generate``, which continue positions from the request's
length. Batch size 1.

With ``cache="slot"`` the fused entries are then loaded into a ``kvpass.SlotCache`` with room for
``max_new_tokens`` more (its ``get_seq_length`` counts the request's tokens, so ``generate`` feeds only
the last one, ``a3+evict`` included), and every decode step is one device-resident graph: the
SlotCache's append rule, compiled with ``mode="reduce-overhead"`` (CUDA graphs) on a CUDA model
under Inductor (``ChunkFusion.decode_forward``)::

    fusion = kvpass.ChunkFusion(model, store, policy="a3+evict", capacity=2048, cache="slot")
    out = fusion.generate(chunks=[doc1, doc2], question="...", max_new_tokens=64)
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor
from transformers import Cache

from kvpass.cache.argument import with_cache
from kvpass.chunks.chunkstore import ChunkStore
from kvpass.chunks.rope import rotate
from kvpass.compiler.backend import Backend
from kvpass.compiler.backend import backend as _backend
from kvpass.policies import ConfigError, make_policy
from kvpass.policies.chunk_fusion.base import SELECT_LAYER, ChunkFusionPolicy, FusionRequest
from kvpass.policies.contract import FusionPolicy

_SHARED = "_kvpass_chunk_fusion"  # attribute of the model: lives and dies with it


class _Router(ChunkFusionPolicy):
    """The policy a model's shared fusion backend compiles with. Every fusion policy plans the same
    graphs (selection prefill with layer 1 as the scoring site, recompute graph, decode graph), so one
    compiled forward serves them all; ``select`` is handed to the policy of the request being run."""

    name = "chunk_fusion"
    summary = "graphs shared by the chunk-fusion policies"
    needs_probe = True
    collects_votes = True
    drives_graphs = True

    def __init__(self) -> None:
        super().__init__()
        self.active: ChunkFusionPolicy | None = None
        self.first_layers = None

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        if self.active is None:
            return None
        return self.active.select(site, q, k, v, kv_pos, q_pos, layer_state)


@dataclass
class _Shared:
    """One kvpass backend per (model, compiler), shared by every ``ChunkFusion`` of that model: the
    compiled forward of the fusion passes (three graphs in all, whatever the policies) and, built on
    first use, the forward that decodes on a SlotCache."""

    backend: Backend
    forward: Callable
    router: _Router
    model_forward: Callable
    decode: Callable | None = None

    def decode_forward(self):
        if self.decode is None:
            cuda = next(self.router.first_layers.parameters()).device.type == "cuda"
            mode = {"mode": "reduce-overhead"} if cuda and self.backend.compiler == "inductor" else {}
            self.decode = torch.compile(self.model_forward, backend=self.backend, fullgraph=True, **mode)
        return self.decode


def _shared(model, compiler: str) -> _Shared:
    per_model = model.__dict__.setdefault(_SHARED, {})
    if compiler not in per_model:
        router = _Router()
        be = _backend(router, compiler=compiler)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
        router.first_layers = torch.nn.ModuleList(list(model.get_decoder().layers)[: SELECT_LAYER + 1])
        per_model[compiler] = _Shared(be, fwd, router, model.forward)
    return per_model[compiler]


@dataclass
class FusedPrompt:
    """A prepared request: the full ``input_ids`` and a cache that holds all of them but the last."""

    input_ids: Tensor  # [1, N]
    attention_mask: Tensor  # [1, N]
    cache: Cache  # DynamicCache with N - 1 entries per layer (a3+evict: at most C - 1),
    # or a kvpass.SlotCache holding them (cache="slot")
    recompute: Tensor  # positions recomputed (Re), ascending
    spans: dict  # "system", "chunks" [(start, end)], "question"
    timings: dict = field(default_factory=dict)  # seconds: load, merge, select, recompute (, evict)
    sources: dict = field(default_factory=dict)  # segments from memory / disk / computed
    kept: list = field(default_factory=list)  # per layer: positions the cache holds [1, H_kv, K]

    def __repr__(self) -> str:
        t = ", ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.timings.items())
        return (
            f"FusedPrompt(tokens={self.input_ids.shape[1]}, recomputed={self.recompute.numel()}, "
            f"sources={self.sources}, {t})"
        )


class ChunkFusion:
    """Chunk-fusion requests for one model, one store and one fusion policy.

    Args:
        model: an HF decoder (global-attention layers, RoPE in HF's ``rotate_half`` form or none).
        store: the ``ChunkStore`` of this model.
        policy: ``"a3"``, ``"cacheblend"``, ``"legolink"``, ``"pie"`` or ``"full_reuse"`` (or a policy object).
        compiler: the inner compiler of the kvpass backend (``"inductor"``, ``"aot_eager"``, ``"eager"``).
            All ``ChunkFusion`` objects of one model and compiler share one backend and one compiled
            forward (``self.backend``, ``self.forward``): the policies differ only at run time.
        cache: ``"dynamic"`` (default: the fused cache is a DynamicCache) or ``"slot"`` (it is loaded into
            a ``kvpass.SlotCache``, and decode runs as one device-resident graph; see the module docstring).
        **params: the policy's parameters (``ratio`` for a3/cacheblend, ``prefix`` for legolink).
    """

    def __init__(
        self, model, store: ChunkStore, policy="a3", *, compiler: str = "inductor", cache: str = "dynamic", **params
    ) -> None:
        if cache not in ("dynamic", "slot"):
            raise ConfigError(f"parameter 'cache' must be 'dynamic' or 'slot', got {cache!r}")
        pol = make_policy(policy, **params)
        if not isinstance(pol, FusionPolicy):
            raise ConfigError(
                f"parameter 'policy' must be a chunk-fusion policy (a3, cacheblend, legolink, pie, "
                f"full_reuse), got {pol.name!r}"
            )
        if not isinstance(store, ChunkStore):
            raise ConfigError(f"parameter 'store' must be a kvpass.ChunkStore, got {type(store).__name__}")
        if store.model is not model:
            raise ConfigError("parameter 'store' belongs to another model object; build the ChunkStore with this model")
        self.model = model
        self.store = store
        self.policy = pol
        self.cache = cache
        self._shared = _shared(model, compiler)
        self.backend, self.forward, self._router = self._shared.backend, self._shared.forward, self._shared.router
        decoder = model.get_decoder()
        self._decoder = decoder
        self._layers = decoder.layers
        self._first = self._router.first_layers

    # -- public API -------------------------------------------------------------------------------

    @property
    def decode_forward(self):
        """The compiled forward that decodes on this object's caches: on a SlotCache (``cache="slot"``)
        one graph per step, with CUDA graphs on a CUDA model under Inductor; else ``self.forward``."""
        return self._shared.decode_forward() if self.cache == "slot" else self.forward

    def prepare(
        self, chunks, question, system=None, max_new_tokens: int = 256, max_length: int | None = None
    ) -> FusedPrompt:
        """Build the fused cache of ``[system, chunks..., question]`` (texts or token ids); with
        ``cache="slot"``, a SlotCache with room for the last question token and ``max_new_tokens``, or,
        when ``max_length`` is given, for the tokens up to that total length (prompt included, as
        ``generate``'s ``max_length``; at least one new token)."""
        for name, value in (("max_new_tokens", max_new_tokens), ("max_length", max_length)):
            if self.cache == "slot" and value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"parameter '{name}' must be an int >= 0, got {value!r}")
        timings: dict[str, float] = {}
        dev = self.store._device()
        t0 = self._clock()
        tok = self.store.tokenizer
        if system is None or (isinstance(system, (list, str)) and len(system) == 0):
            sys_ids = None
        elif isinstance(system, str):
            if tok is None:
                raise ConfigError("parameter 'tokenizer' must be given to the ChunkStore to pass texts")
            sys_ids = torch.tensor(tok.encode(system, add_special_tokens=True), dtype=torch.long)
        else:
            sys_ids = self.store.ids(system)
        if isinstance(chunks, (str, Tensor)):
            chunks = [chunks]
        if not chunks:
            raise ConfigError("parameter 'chunks' must hold at least one chunk, got none")
        q_ids = self.store.ids(question)
        segments = ([sys_ids] if sys_ids is not None else []) + [self.store.ids(c) for c in chunks]
        kvs = [self.store.get_or_compute(s) for s in segments]
        sources: dict[str, int] = {}
        for kv in kvs:
            sources[kv.source] = sources.get(kv.source, 0) + 1
        timings["load"] = self._clock() - t0

        # layout
        starts, pos = [], 0
        for s in segments:
            starts.append(pos)
            pos += s.numel()
        ctx, nq = pos, q_ids.numel()
        n = ctx + nq
        ids = torch.cat(segments + [q_ids])[None].to(dev)
        doc = torch.zeros(n, dtype=torch.bool)
        first_doc = 1 if sys_ids is not None else 0
        doc[starts[first_doc] : ctx] = True
        spans = {
            "system": (0, starts[first_doc]) if sys_ids is not None else None,
            "chunks": [(a, a + s.numel()) for a, s in zip(starts[first_doc:], segments[first_doc:])],
            "question": (ctx, n),
        }

        # merged cache: re-rotated stored keys, values; empty slots for Q[:-1]
        t1 = self._clock()
        if self.policy.recover_positions:
            rot_pos = torch.arange(n - 1)
        else:
            rot_pos = torch.cat([torch.arange(s.numel()) for s in segments] + [torch.arange(ctx, n - 1)])
        cache, layer1 = self._merged_cache(kvs, rot_pos, nq - 1)
        timings["merge"] = self._clock() - t1

        req = FusionRequest(
            length=n, question=nq, doc=doc, chunk_starts=starts, cached_keys=layer1 if self.policy.needs_probe else None
        )
        t2 = self._clock()
        if self.policy.needs_probe:
            self._select(ids, req)
        recompute = self.policy.recompute(req).long().cpu()
        if nq == 1 and recompute.numel() == 1:
            # a recompute pass needs two tokens (a one-token graph is a decode step): add a neighbour
            p = int(recompute[0])
            extra = p + 1 if p + 1 < ctx and doc[p + 1] else p - 1
            recompute = torch.tensor(sorted({p, extra}), dtype=torch.long)
        timings["select"] = self._clock() - t2

        t3 = self._clock()
        new = torch.cat([recompute, torch.arange(ctx, n - 1)])
        state = self.backend.runtime.state
        state.reset()
        votes = self.policy.needs_votes
        if votes and (nq < 2 or new.numel() < 2):
            raise ConfigError(
                f"policy '{self.policy.name}' ranks the documents by the question's attention in the "
                f"recompute pass: it needs a question of at least 2 tokens (got {nq}) and at least "
                f"2 recomputed tokens (got {new.numel()}; raise 'ratio')"
            )
        state.fusion_window = nq - 1 if votes else 0
        try:
            if new.numel() == 1 and int(new[0]) == n - 2:
                # only Q[0] (of a two-token question): an ordinary one-token append, exact
                cache.crop(n - 2)
                self._run(ids[:, n - 2 : n - 1], cache, positions=None)
            elif new.numel() > 0:
                self._run(ids[:, new.to(dev)], cache, positions=new)
        finally:
            state.fusion_window = 0
        timings["recompute"] = self._clock() - t3
        t4 = self._clock()
        kept = self._keep(cache, req, n - 1)
        if votes:
            timings["evict"] = self._clock() - t4
        if self.cache == "slot":
            t5 = self._clock()
            cache = self._slots(cache, kept, n - 1, max_new_tokens if max_length is None else max(max_length - n, 1))
            timings["slots"] = self._clock() - t5
        mask = torch.ones_like(ids)
        return FusedPrompt(ids, mask, cache, recompute, spans, timings, sources, kept)

    def prefill(self, chunks, question, system=None) -> tuple[Tensor, FusedPrompt]:
        """``prepare`` plus the last question token: the logits ``[1, vocab]`` of the first new token
        (time to first token ends here) and the prompt, whose cache now holds every token."""
        fused = self.prepare(chunks, question, system)
        t0 = self._clock()
        # one token: logits_to_keep changes nothing; without it, and with a contiguous token (a slice of the
        # prompt has another stride), a SlotCache's decode steps reuse this call's graph
        keep = {} if self.cache == "slot" else {"logits_to_keep": 1}
        with torch.no_grad():
            last = fused.input_ids[:, -1:].clone(memory_format=torch.contiguous_format)
            out = self.decode_forward(input_ids=last, **with_cache(self.model, fused.cache), use_cache=True, **keep)
        fused.timings["last_token"] = self._clock() - t0
        return out.logits[:, -1], fused

    def generate(self, chunks, question, system=None, **generate_kwargs) -> Tensor:
        """``prepare`` then ``model.generate`` on the fused cache; returns the generated ids (prompt included,
        as ``generate`` does). ``generate_kwargs`` go to ``model.generate``.

        ``a3+evict`` leaves a DynamicCache shorter than the prompt, which ``model.generate`` would misread
        as tokens still to compute: its requests decode greedily through this object's compiled forward
        (which continues positions from the prompt's length), with ``max_new_tokens``,
        ``eos_token_id`` and ``do_sample=False`` as the only options. A SlotCache (``cache="slot"``)
        counts the prompt's tokens, so every policy decodes through ``model.generate`` with any options,
        its steps run by ``decode_forward``."""
        if self.cache == "slot":  # the slots hold what generate may produce, resolved as generate resolves it
            config = generate_kwargs.get("generation_config") or self.model.generation_config
            new = generate_kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
            total = None if new is not None else generate_kwargs.get("max_length", getattr(config, "max_length", None))
            fused = self.prepare(chunks, question, system, max_new_tokens=20 if new is None else new, max_length=total)
            with self._decoding():
                return self.model.generate(
                    fused.input_ids,
                    attention_mask=fused.attention_mask,
                    **with_cache(self.model, fused.cache),
                    **generate_kwargs,
                )
        if self.policy.needs_votes:
            unknown = sorted(set(generate_kwargs) - {"max_new_tokens", "eos_token_id", "do_sample"})
            if unknown or generate_kwargs.get("do_sample"):
                raise ConfigError(
                    f"policy '{self.policy.name}' decodes greedily through ChunkFusion: "
                    f"generate() takes max_new_tokens, eos_token_id and do_sample=False, got "
                    f"{unknown or ['do_sample=True']}"
                )
            return self._greedy(
                chunks,
                question,
                system,
                generate_kwargs.get("max_new_tokens", 20),
                generate_kwargs.get("eos_token_id", self.model.config.eos_token_id),
            )
        fused = self.prepare(chunks, question, system)
        return self.model.generate(
            fused.input_ids,
            attention_mask=fused.attention_mask,
            **with_cache(self.model, fused.cache),
            **generate_kwargs,
        )

    def _greedy(self, chunks, question, system, max_new_tokens: int, eos) -> Tensor:
        logits, fused = self.prefill(chunks, question, system)
        stop = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        out = [int(logits.argmax(-1))]
        with torch.no_grad():
            while len(out) < max_new_tokens and out[-1] not in stop:
                ids = torch.tensor([[out[-1]]], device=fused.input_ids.device)
                step = self.forward(
                    input_ids=ids, **with_cache(self.model, fused.cache), use_cache=True, logits_to_keep=1
                )
                out.append(int(step.logits[0, -1].argmax(-1)))
        return torch.cat([fused.input_ids, torch.tensor([out], device=fused.input_ids.device)], dim=1)

    def __repr__(self) -> str:
        return f"kvpass.ChunkFusion(policy={self.policy!r}, store={self.store!r}, cache={self.cache!r})"

    # -- steps ------------------------------------------------------------------------------------

    def _keep(self, cache, req: FusionRequest, length: int) -> list[Tensor]:
        """After fusion: each layer's kept slots (``a3+evict``: compacted to them with ``gather_kv``;
        the others keep all ``length``), recorded as the layers' true positions, so decode graphs
        continue positions from ``length`` however short the cache is. Returns the kept positions
        per layer ``[1, H_kv, K]``."""
        state = self.backend.runtime.state
        kept = []
        for i, layer in enumerate(cache.layers):
            b, hkv = layer.keys.shape[:2]
            idx = None
            if self.policy.needs_votes:
                votes = state.fusion_votes.pop(i, None)
                if votes is None:
                    raise RuntimeError(
                        f"kvpass: the recompute pass left no votes for layer {i} (policy "
                        f"'{self.policy.name}'); was the model compiled by this ChunkFusion?"
                    )
                idx = self.policy.keep_after_fusion(votes, req)
            if idx is None:  # an expanded view: no [H_kv, L] positions materialised per layer
                idx = torch.arange(length, device=layer.keys.device).expand(b, hkv, length)
            else:
                idx = idx.contiguous()
                layer.keys, layer.values = torch.ops.kvpass.gather_kv(layer.keys, layer.values, idx)
            state.set_layer(i, idx, length, fresh=True)
            kept.append(idx)
        return kept

    def _slots(self, cache, kept: list[Tensor], seen: int, max_new_tokens: int):
        """The fused DynamicCache's entries loaded into a SlotCache with room for the last question token
        and ``max_new_tokens`` (every layer as long as the longest kept)."""
        from kvpass.cache.slots import SlotCache

        longest = max(int(k.shape[-1]) for k in kept)
        slots = SlotCache(self.model, self.backend, max_length=longest + 1 + max_new_tokens, _driver=True)
        for lay, src, pos in zip(slots.layers, cache.layers, kept):
            lay.fill(src.keys, src.values, pos, seen, limit=seen + 1 + max_new_tokens)
        return slots

    @contextlib.contextmanager
    def _decoding(self):
        """``model.generate`` calls ``model.forward``: route it to ``decode_forward`` meanwhile."""
        had = "forward" in self.model.__dict__
        before = self.model.__dict__.get("forward")
        self.model.forward = self.decode_forward
        try:
            yield
        finally:
            if had:
                self.model.forward = before
            else:
                del self.model.forward

    def _clock(self) -> float:
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _merged_cache(self, kvs, rot_pos: Tensor, q_slots: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        rotary = self.store.rotary
        tables: dict = {}
        layer1 = None
        for i in range(len(kvs[0].k)):
            rot = rotary.layers[i]
            if rot not in tables:
                tables[rot] = rot.tables(rot_pos)
            k = [kv.k[i] for kv in kvs]
            v = [kv.v[i] for kv in kvs]
            if q_slots > 0:
                k.append(k[0].new_zeros(k[0].shape[:-2] + (q_slots, k[0].shape[-1])))
                v.append(v[0].new_zeros(v[0].shape[:-2] + (q_slots, v[0].shape[-1])))
            keys = rotate(torch.cat(k, dim=-2), tables[rot])[None]
            values = torch.cat(v, dim=-2)[None]
            cache.update(keys, values, i)
            if i == SELECT_LAYER:
                layer1 = keys
        return cache, layer1

    @contextlib.contextmanager
    def _first_layers(self):
        """The model restricted to layers 0..SELECT_LAYER (one ModuleList object, so Dynamo's guards hold)."""
        self._decoder.layers = self._first
        try:
            yield
        finally:
            self._decoder.layers = self._layers

    def _checked(self, before: int) -> None:
        for r in self.backend.reports[before:]:
            if r.problems:
                raise RuntimeError(f"kvpass: chunk fusion could not compile this model: {r.problems[0]}")

    def _select(self, ids: Tensor, req: FusionRequest) -> None:
        from transformers import DynamicCache

        self.policy.request = req
        self._router.active = self.policy
        before = len(self.backend.reports)
        try:
            with self._first_layers(), torch.no_grad():
                self.forward(
                    input_ids=ids,
                    **with_cache(self.model, DynamicCache(config=self.model.config)),
                    use_cache=True,
                    logits_to_keep=1,
                )
        finally:
            self.policy.request = None
            self._router.active = None
        self._checked(before)
        if req.scores is None:
            raise RuntimeError(
                f"kvpass: the selection pass of policy '{self.policy.name}' produced no scores "
                f"(layer {SELECT_LAYER} was not planned as a selection site)"
            )

    def _run(self, ids: Tensor, cache, positions: Tensor | None) -> None:
        state = self.backend.runtime.state
        state.fusion = positions
        before = len(self.backend.reports)
        try:
            with torch.no_grad():
                kw = {} if positions is None else {"position_ids": positions[None].to(ids.device)}
                self.forward(input_ids=ids, **with_cache(self.model, cache), use_cache=True, logits_to_keep=1, **kw)
        finally:
            state.fusion = None
        self._checked(before)
