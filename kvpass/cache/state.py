"""Per-generation state that policies keep between calls of a compiled model.

One ``GenerationState`` belongs to one ``kvpass.backend(...)`` object. It holds, per layer (``layers``, keyed by
layer index), the true token index of every entry the cache stores (``LayerState.pos``), how many tokens that layer
has seen, and a free-form ``extra`` dict a policy uses for its own bookkeeping (page tables, timestamps,
representative keys, chunk metadata). It describes the DynamicCache the backend's
graphs last ran on; the runtime keeps the description of every other live cache aside (``take``, ``put``;
``kvpass.cache.runtime.Runtime.follow``), so caches decoded in turn each continue from their own.

Rules the operators follow:

* A new prefill (the stored cache is empty) starts the layer afresh: ``reset_layer`` replaces
  everything, so a previous generation never leaks into the next one.
* Positions are sacred: ``pos`` counts tokens as the model saw them (padding included, marked -1),
  never the compressed length, and ``seen`` is the number of tokens seen, not the number stored.
* Batch > 1 keeps per-sequence rows in every tensor; lengths are shared across the batch (the
  cache tensors are rectangular), which entries are kept is not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpass.cache import ragged


@dataclass
class LayerState:
    """What one layer's cache keeps between calls."""

    pos: Tensor  # [B, H_kv, L_stored] true token index of each stored entry, -1 = padding
    # tokens this layer has seen so far (true length): a 0-d tensor on the cache's device when set by
    # ``compact`` (reading it back there would stall the GPU once per layer and step); ``int()`` it
    seen: int | Tensor
    extra: dict = field(default_factory=dict)

    @property
    def stored(self) -> int:
        """The most entries a (row, KV head) holds: the stored length, or in the per-head layout (``extra``'s
        ``heads`` ranges, ``kvpass.cache.ragged``) the most a head holds of the pool."""
        heads = self.extra.get("heads")
        if heads is None:
            return self.pos.shape[-1]
        return int(ragged.held(self.pos, heads).max())

    def extended(self, n: int) -> tuple[Tensor, int | Tensor]:
        """``(pos, seen)`` after ``n`` more tokens were appended past this record by a graph that only
        appends: they are the latest tokens, in order."""
        if not n:
            return self.pos, self.seen
        b, h, _ = self.pos.shape
        tail = (self.seen + torch.arange(n, device=self.pos.device)).expand(b, h, n)
        return torch.cat([self.pos, tail], -1), self.seen + n


TICKS = itertools.count(1)  # orders generations that start on a DynamicCache and on a kvpass.SlotCache


class GenerationState:
    """The state of one generation (one prompt batch and its continuation)."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerState] = {}
        # chunk fusion (kvpass.chunks.router): true positions [n] of the tokens of the current call, which
        # kvpass::cache_overwrite writes over a merged cache (slot == position); None otherwise
        self.fusion: Tensor | None = None
        # a3+evict: how many query rows of a recompute call are the question (0: no votes), and the
        # votes kvpass::fusion_votes kept per layer
        self.fusion_window = 0
        self.fusion_votes: dict[int, Tensor] = {}
        # kvpass::true_positions: ``records`` counts set_layer calls; ``offset`` (true minus derived
        # position) was taken when ``records`` was ``anchor_at``; ``tail`` is the true count after the
        # tokens of the last call (a 0-d tensor), set when ``records`` was ``tail_at``. Graphs that only
        # append record no layer, so ``tail`` is how far the cache got past the layers' records.
        self.records = 0
        self.anchor_at = -1
        self.offset: int | Tensor = 0
        self.tail: Tensor | None = None
        self.tail_at = -1
        self.latest: int | Tensor = 0  # ``seen`` of the last layer recorded (the latest count a record holds)
        self.base: int | Tensor = 0  # the model's first derived position (OPT's learned table: 2)
        self.fresh_at = 0  # TICKS when the last fresh record was set
        # a reconstructing policy's repeat passes (kvzip; kvpass.generate.reconstruct sets ``repeat`` for a pass and
        # clears it after): the prompt range ``(start, end)`` the running pass repeats, and per layer the scores
        # ``[B, H_kv, n]`` (fp32) of the prompt's entries so far, which the next prefill's ``select`` reads
        self.repeat: tuple[int, int] | None = None
        self.scores: dict[int, Tensor] = {}
        self.passes = False  # inside kvpass.repeat_passes (the prefill it serves and its passes)
        # inside kvpass.repeat_passes, until its passes run: what they need and the prefill's held layers
        # (kvpass.generate.reconstruct.Deferred; SlotCache prefills hand their entries to it)
        self.deferred = None

    # the fields that describe one cache (its layers' records and the counts around them); the others steer the
    # calls of a run (chunk fusion's positions and votes, a reconstructing policy's passes)
    CACHE_FIELDS = ("layers", "records", "anchor_at", "offset", "tail", "tail_at", "latest", "base", "fresh_at")

    def take(self) -> dict:
        """Hand over what describes the current cache (``CACHE_FIELDS``) and start empty, for another cache."""
        held = {name: getattr(self, name) for name in self.CACHE_FIELDS}
        self.layers, self.records, self.fresh_at = {}, 0, 0
        self._start_counts()
        return held

    def put(self, held: dict) -> None:
        """Describe again the cache ``take`` handed over (the current one's fields are replaced)."""
        for name in self.CACHE_FIELDS:
            setattr(self, name, held[name])

    def layer(self, layer: int) -> LayerState | None:
        return self.layers.get(layer)

    def set_layer(self, layer: int, pos: Tensor, seen: int | Tensor, fresh: bool) -> LayerState:
        """Record what layer ``layer`` stores after a call; ``fresh`` (a new prefill) drops the policy's extra
        state and the previous generation's ``tail`` (it would count that generation's tokens as seen)."""
        old = self.layers.get(layer)
        if fresh:
            self.tail, self.tail_at = None, -1
            self.fresh_at = next(TICKS)
        extra = {} if fresh or old is None else old.extra
        st = LayerState(pos=pos, seen=seen, extra=extra)
        self.layers[layer] = st
        self.records += 1
        self.latest = seen
        return st

    def appended(self, s: LayerState) -> int:
        """Tokens appended to a layer's cache after its last record (by a graph that only appends)."""
        return max(0, int(self.tail) - int(s.seen)) if self.tail is not None else 0

    def positions(self, layer: int) -> Tensor:
        """True token index of every entry a layer's cache holds now: its record plus the tokens
        appended after it (the latest ones, in order)."""
        s = self.layers[layer]
        return s.extended(self.appended(s))[0]

    @property
    def seen(self) -> int:
        """True number of tokens seen (the same for every layer between forward calls)."""
        return max((int(s.seen) + self.appended(s) for s in self.layers.values()), default=0)

    def seen_now(self) -> int | Tensor:
        """``seen`` without a device sync (an int or a 0-d tensor), for operators: the count of the last
        record, unless graphs that only append (``tail``, set after the last record) took the sequence
        further. Not the first layer's count: a decode graph may append to some layers and record others
        (a global layer 0 appends, a deeper sliding layer records its ring), and the first then lags."""
        if self.tail is not None and self.tail_at == self.records:
            return self.tail
        return self.latest if self.layers else 0

    def note_tail(self, tail: Tensor) -> None:
        """The true count after the tokens of this call (a 0-d tensor)."""
        self.tail, self.tail_at = tail, self.records

    @property
    def evicted_tokens(self) -> int:
        """Tokens seen that the cache no longer holds, summed over layers, KV heads and batch rows:
        ``seen`` minus the stored entries with a true position (``pos >= 0``); tokens appended since a
        layer's record are both seen and held, so they do not count. Empty slots of a page
        pool (raas) and padding hold no token, so they never count as kept; left padding counts as not
        held. Derived, so replays of an operator never double count."""
        return sum(
            s.pos.shape[0] * s.pos.shape[1] * int(s.seen) - int((s.pos >= 0).sum()) for s in self.layers.values()
        )

    def stored_tokens(self) -> dict[int, int]:
        """Per recorded layer, the most entries a (row, KV head) holds now (``stored``)."""
        return {i: s.stored + self.appended(s) for i, s in sorted(self.layers.items())}

    @property
    def stored(self) -> dict[int, int]:
        """Per recorded layer, the most entries a (row, KV head) holds now: what ``SlotCacheState.stored`` says
        of a SlotCache, so code that reads ``be.state`` reads either the same way."""
        return self.stored_tokens()

    def reset(self) -> None:
        self.layers.clear()
        self.fusion_votes.clear()
        self.scores.clear()
        self.repeat = None
        self._start_counts()

    def _start_counts(self) -> None:
        """The counts around the layers' records as before any call (``__init__``'s values)."""
        self.anchor_at, self.offset, self.tail, self.tail_at, self.latest, self.base = -1, 0, None, -1, 0, 0

    def __repr__(self) -> str:
        # an empty state says why: nothing ran yet, or the policy left the model's DynamicCache to transformers
        # (full and art write no cache through kvpass there; a kvpass.SlotCache records every policy)
        why = "" if self.layers else "; no layer recorded: no generation yet, or no cache written through kvpass"
        return (
            f"GenerationState(seen={self.seen}, layers={len(self.layers)}, "
            f"stored={self.stored_tokens()}, evicted_tokens={self.evicted_tokens}{why})"
        )
