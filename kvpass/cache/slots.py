"""``SlotCache``: a fixed-capacity ``transformers`` cache whose decode step is one device-resident graph.

Every layer owns, allocated once at construction and never reallocated:

* ``keys`` / ``values`` ``[B, H_kv, C, D]``: the slots;
* ``pos`` ``[B, H_kv, C]`` int32: the true position of the token in each slot, -1 = empty
  (left padding and evicted slots too);
* ``count`` ``[B, 5]`` int64, per row, its columns named ``SEEN``, ``FILLED``, ``DROPPED``, ``MAX_LENGTH``, ``CACHE``:
  tokens seen (padding included, the index HF's masks count in), slots filled in order (the append
  layout's next free slot), the positions a renumbering prefill dropped (``gemfilter``: ``L - n``, else
  0): the row's next token's position is ``count[b, SEEN] - count[b, DROPPED]``; and the cache's
  ``max_length``: a write past it fails loudly, whatever the policy's rule (a ring would otherwise wrap
  over entries its policy keeps); and the cache's identity (``SlotCache.ident``, written at construction and
  by ``admit`` into the row it fills), by which ``slot_prefill`` names the cache it wrote even where a compiler
  hands it copies of the cache's tensors (AOTAutograd's functionalization). ``generate`` keeps the rows of a
  batch at one length; the counts are per row so that a row can be emptied and refilled on its own.

* ``state``: the policy's own per-layer tensors (``Policy.slot_state``, e.g. quest's page bounds),
  kept by tensor code the rewrite places in the graphs (``Policy.slot_hooks``).

``C`` is the layer's capacity (``Policy.slot_capacity``): the whole sequence for ``full``, the budget
plus the decode steps for a policy that evicts at prefill only (pyramidkv: its layer's budget), the
budget plus one for a policy that evicts at every step, raas's page pool. A sliding-window layer (the
config's ``layer_types``) is a ring of ``window`` slots whatever the policy. All of
them are static addresses (``torch._dynamo.mark_static_address``), so a decode graph that writes them in place can be
replayed as a CUDA graph; the host learns nothing per step. ``get_seq_length()`` answers the tokens seen (a 0-d device
tensor, as HF's ``StaticLayer`` does), so ``generate`` and a bare ``forward`` derive true positions however much was
evicted.

The cache's own ``update`` calls ``kvpass::slot_append``: the append layout (token ``i`` in slot
``i``), which with HF's own attention and mask is exactly HF's ``StaticCache``. The kvpass pass finds
that call (``detect``: cache kind ``"slot"``) and replaces it with the policy's write:

* prefill (the cache is empty): attention over the prompt with the model's mask, then
  ``kvpass::slot_prefill`` asks the policy which entries to keep and writes them into the slots;
* decode / append: ``write_slots`` (plain tensor code, compiled and fused by Inductor) puts each
  new token into a victim slot chosen on the device by the policy's rule (``APPEND``: the next free
  slot; ``RING``: an empty slot, else the oldest unprotected one), and ``decode_attention`` reads
  every slot by position (``kv_pos``, ``kv_len``).

``slot_append`` itself runs only where the pass did not rewrite the call: an uncompiled forward (as
``generate``'s prefill with a ``compile_config``) or another backend's graph (a graph kvpass would compile
unchanged refuses a SlotCache: ``kvpass.errors.SlotCacheUnrewritten``). For a policy whose prefill is not a
plain append (all but ``full`` and ``art``) it then refuses, naming the fix, where it would have kept every
token without the policy.
A cache a policy has compressed no longer has the append layout: ``slot_append`` then fails loudly
(a device-side assert) instead of letting HF's mask read the slots as positions.

``key`` in these operators names one compiled graph's attention site (``Site.key``, ``kvpass.cache.runtime``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass.cache import ragged
from kvpass.errors import ConfigError, device_assert
from kvpass.kernels.gather import gather_pair
from kvpass.op_registry import register

try:
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover
    Cache = CacheLayerMixin = object

APPEND, RING, PLACED = 0, 1, 2
_reuse = threading.local()


class MaskReused(RuntimeError):
    """A SlotCache layer was updated outside a compiled graph while the decoding loop passed an earlier step's
    attention mask (``reused_mask``): the model's own attention would read it. Raised before anything is
    written; the loop reruns the step with the mask built anew."""


@contextlib.contextmanager
def reused_mask():
    """While open (in this thread), a SlotCache layer refuses an update made outside a compiled graph
    (``MaskReused``): kvpass's decoding loop passes a compiled decode graph, which reads the slots by position,
    an earlier step's attention mask, which uncompiled code (a frame Dynamo skips, a graph break) would read."""
    before = getattr(_reuse, "on", False)
    _reuse.on = True
    try:
        yield
    finally:
        _reuse.on = before


SEEN, FILLED, DROPPED, MAX_LENGTH, CACHE = range(5)  # the columns of a layer's ``count`` (the module docstring)
LIMIT = (
    "kvpass SlotCache: the sequence is longer than the max_length the cache was built for; build it with "
    "max_length >= prompt + new tokens (kvpass.compile sizes it for each generate call), and reset() it "
    "before a new prompt"
)
TOO_LONG = "kvpass SlotCache: the sequence is longer than the cache's capacity: build it with a larger max_length"
RULES = {"append": APPEND, "ring": RING, "placed": PLACED}
_IDENTS = itertools.count(1)  # SlotCache.ident


# ------------------------------------------------------------------------------------------------
# operators
# ------------------------------------------------------------------------------------------------


@torch.library.custom_op("kvpass::slot_append", mutates_args=("keys", "values", "pos", "count"))
def slot_append(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    count: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    state: list[Tensor],
    window: int = 0,
    policy: str = "",
    spec: str = "",
) -> None:
    """The cache's own update: ``k_new`` / ``v_new`` ``[B, H_kv, q, D]`` go into slots ``seen .. seen+q-1``.
    Valid only while the layout is the append layout (no eviction yet) and the tokens fit. ``state`` (the
    policy's per-layer tensors) and ``window`` (a sliding-window layer's window, 0 for a global layer)
    are not used here: they are passed so the kvpass pass finds them in the graph, as is ``spec``, the
    configuration the cache was built for (``Policy.key``), which a kvpass graph of another policy refuses.

    A kvpass-compiled graph never runs this: the pass replaces it with the policy's write, or refuses the graph
    (``kvpass.errors.SlotCacheUnrewritten``). It runs in an uncompiled forward or a graph another backend
    compiled; for a
    policy whose prefill is not a plain append (``policy`` names it; empty for ``full`` and ``art``, see
    ``Needs.plain_prefill``) the tokens would be kept without the policy, so it refuses, naming the fix."""
    check_heads(keys, values, k_new, v_new)  # first: a cache of the wrong sizes is the deeper problem
    if policy:
        raise RuntimeError(
            f"kvpass SlotCache: a forward that the kvpass backend did not rewrite wrote into the cache of policy "
            f"'{policy}'; the policy runs only inside graphs the kvpass backend compiles, so this call would keep "
            f"every token without it. Compile model.forward itself with the backend the cache was built with "
            f"(model.forward = torch.compile(model.forward, backend=be, ...), or kvpass.compile(model, ...)): "
            f"generate()'s compile_config compiles only the decode steps, and its prefill runs uncompiled. A "
            f"forward that was compiled so gets here when its graph broke between the attention and the cache "
            f"write (output_attentions=True does on transformers 5.2x; pass fullgraph=True to torch.compile to "
            f"see where)."
        )
    b, hkv, q = k_new.shape[:3]
    cap = keys.shape[2]
    if q > cap:  # known on the host: an error the process survives, where the device assert below ends it on a GPU
        raise RuntimeError(f"{TOO_LONG} ({q} new tokens, {cap} slots)")
    seen, filled = count[:, SEEN], count[:, FILLED]
    device_assert(
        (seen == filled).all(),
        "kvpass SlotCache: a kvpass policy compressed this cache and this call "
        "was not rewritten by it: several new tokens for a policy without an "
        "append graph (h2o, raas), or a forward compiled without the cache's "
        "backend",
    )
    device_assert((filled + q <= cap).all(), TOO_LONG)
    device_assert((seen + q <= count[:, MAX_LENGTH]).all(), LIMIT)
    ar = torch.arange(q, device=keys.device)
    idx = (filled[:, None, None] + ar).expand(b, hkv, q)
    _put(keys, values, pos, idx, k_new, v_new, (seen[:, None, None] + ar).expand(b, hkv, q))
    count[:, SEEN:DROPPED].add_(q)  # seen and filled


@slot_append.register_fake
def _(keys, values, pos, count, k_new, v_new, state, window=0, policy="", spec=""):
    return None


def check_heads(keys: Tensor, values: Tensor, k_new: Tensor, v_new: Tensor) -> None:
    """The model's attention writes as many KV heads of the sizes the cache was built with (from the config:
    ``num_key_value_heads``, ``head_dim``), or a ``ValueError`` names kvpass and the way on. A config flag such
    as Falcon's ``multi_query`` (before transformers 5.25) or a latent attention whose keys and values have sizes
    of their own (``qk_rope_head_dim``, ``v_head_dim``) is not what the cache read."""
    want = (keys.shape[1], keys.shape[3], values.shape[3])
    got = (k_new.shape[1], k_new.shape[3], v_new.shape[3])
    if got != want:
        raise ValueError(
            f"kvpass SlotCache: the model's attention writes {got[0]} KV heads per layer of key size "
            f"{got[1]} and value size {got[2]}; the cache was sized for {want[0]} of {want[1]} and "
            f"{want[2]} from the model's config (num_key_value_heads, or num_attention_heads without it; "
            f"head_dim, or hidden_size / num_attention_heads), which does not describe this attention. "
            f"Use the model's own cache (a DynamicCache) with kvpass.backend"
        )


@torch.library.custom_op("kvpass::slot_prefill", mutates_args=("keys", "values", "pos", "count", "state"))
def slot_prefill(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    count: Tensor,
    state: list[Tensor],
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    mask: Tensor | None,
    handle: int,
    key: int,
    tokens: Tensor | None = None,
    votes: Tensor | None = None,
    lse: Tensor | None = None,
    q_pre: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    out_proj: Tensor | None = None,
) -> None:
    """A prefill on an empty slot cache: the policy keeps entries of the prompt (``Policy.select``, as
    ``compact`` does on a DynamicCache) and they are written into the first slots, in position order;
    the other slots are emptied. A policy's ``select`` may return ``(keep, bookkeeping)``: a bookkeeping
    entry named like one of its ``slot_state`` tensors holds a value per kept entry (``[B, H_kv, n]``, in
    ``keep``'s order, or per prompt entry when ``keep`` is None), written into that state tensor in slot
    order (0 past the kept entries): h2o's accumulated attention. Runs once per prompt, outside any CUDA
    graph."""
    from kvpass.cache import runtime

    rt = runtime.get(handle)
    first = count[0].tolist()  # one read to the host: the cache's identity and max_length
    rt.slot_prefilled(first[CACHE])  # by value: ``count`` may be a copy of the cache's (aot_eager)
    layer = runtime.layer_of(key)
    b, hkv, length, _ = k_new.shape
    if b != keys.shape[0]:
        raise ValueError(
            f"kvpass SlotCache: a batch of {b} rows on a cache built for {keys.shape[0]}; build it with batch_size={b}"
        )
    check_heads(keys, values, k_new, v_new)
    if length > first[MAX_LENGTH]:
        raise ValueError(
            f"kvpass SlotCache: a {length}-token prompt on a cache built for max_length="
            f"{first[MAX_LENGTH]}; build it with max_length >= prompt + new tokens"
        )
    kv_pos = torch.arange(length, device=k_new.device).expand(b, hkv, length)
    valid = runtime.key_validity(mask, b, length)
    if valid is not None:
        kv_pos = torch.where(valid[:, None, :], kv_pos, torch.full_like(kv_pos, -1))
    q_pos = torch.arange(length, device=k_new.device).expand(b, length)
    extra = runtime.selection_inputs(tokens, votes, lse, q_pre, cos, sin, out_proj, rt.state.scores.get(layer))
    job = rt.state.deferred
    if job is not None:  # inside kvpass.repeat_passes: its passes score these entries before the layer keeps
        job.cache.update(k_new, v_new, layer)  # the passes' cache copies them (this graph's buffers may be reused)
        if not rt.sites[key].sliding_window:
            # the layer waits: its count says so with the job's tag, which also finds the cache again (the graph may
            # have handed this operator copies of the cache's tensors, written back as it ends: AOTAutograd's)
            count[:, SEEN], count[:, FILLED], count[:, DROPPED] = -job.tag, 0, 0
            job.keeps[layer] = (key, kv_pos, q_pos, extra)
            return
    _keep(rt, key, keys, values, pos, count, state, q, k_new, v_new, kv_pos, q_pos, extra)


def keep_held(rt, lay: "SlotLayer", held: tuple, k: Tensor, v: Tensor, scores: Tensor | None) -> None:
    """The rest of a ``slot_prefill`` that ``kvpass.repeat_passes`` held for its passes, on the cache layer ``lay``
    itself: it keeps entries of ``k`` / ``v`` (the prompt's, as the prefill computed them) by the passes' ``scores``
    (None: no pass scored the layer, which ``select`` refuses by name)."""
    key, kv_pos, q_pos, extra = held
    extra = {**extra, "scores": scores}
    _keep(rt, key, lay.keys, lay.values, lay.pos, lay.count, lay.state, None, k, v, kv_pos, q_pos, extra)


def _keep(rt, key, keys, values, pos, count, state, q, k_new, v_new, kv_pos, q_pos, extra: dict) -> None:
    """``slot_prefill``'s choice and writes, given the prompt's entries and the policy's inputs: the policy keeps
    (a sliding layer its window's latest), the kept entries are written into the first slots."""
    from kvpass.cache import runtime

    layer = runtime.layer_of(key)
    b, hkv, length, _ = k_new.shape
    cap = keys.shape[2]
    if rt.sites[key].sliding_window:  # a sliding layer's ring holds the window's most recent entries
        idx = kv_pos.topk(cap, dim=-1).indices if length > cap else None
        kept_pos, kept_state = (kv_pos if idx is None else kv_pos.gather(2, idx)), None
    else:  # what the policy keeps, as on a DynamicCache; its bookkeeping: per-entry values of its slot state
        idx, kept_pos, kept_state = runtime.choose(
            rt.policy,
            rt.sites[key],
            q,
            k_new,
            v_new,
            kv_pos,
            q_pos,
            None,
            extra,
        )
    if rt.policy.needs.heads and not rt.sites[key].sliding_window:  # the per-head layout (kvpass.cache.ragged)
        kept = idx if idx is not None else ragged.everything(b, hkv, length, k_new.device)
        if kept.sel.shape[1] > hkv * cap:
            raise ValueError(
                f"kvpass SlotCache: layer {layer} keeps {kept.sel.shape[1] // hkv} entries per KV head of "
                f"a {length}-token prompt under policy '{rt.policy.name}', but the cache holds {cap} "
                f"slots per head; build the cache with a larger max_length"
            )
        names = list(rt.policy.slot_state(cap, keys.shape[-1]))
        ragged.slot_fill(keys, values, pos, state[names.index("heads")], k_new, v_new, kv_pos, kept, layer)
        count[:, SEEN], count[:, FILLED], count[:, DROPPED] = length, kept.sel.shape[1] // hkv, 0
        return
    # real entries first (in position order), empty ones (left padding) last: a "ring" rule protects the
    # first slots (StreamingLLM's sinks must be a padded row's first real tokens, not its padding)
    order = torch.where(kept_pos < 0, torch.iinfo(torch.int64).max, kept_pos.long()).argsort(dim=-1, stable=True)
    kept_pos = kept_pos.gather(2, order)
    kept_k, kept_v = gather_pair(k_new, v_new, order if idx is None else idx.gather(2, order))
    n = kept_pos.shape[-1]
    if n > cap and rt.first_pass:
        rt.overflow = layer  # a two-pass policy's first pass: its second pass, if it runs, rewrites every slot
        return
    if n > cap:
        raise ValueError(
            f"kvpass SlotCache: layer {layer} keeps {n} entries of a {length}-token prompt under "
            f"policy '{rt.policy.name}', but the cache holds {cap} slots per layer; build the cache "
            f"with a larger max_length"
        )
    keys[:, :, :n].copy_(kept_k)
    values[:, :, :n].copy_(kept_v)
    pos.fill_(-1)
    pos[:, :, :n].copy_(kept_pos)
    if isinstance(kept_state, dict) and kept_state:
        for name, tensor in zip(rt.policy.slot_state(cap, keys.shape[-1]), state):
            if name in kept_state:
                tensor.zero_()
                tensor[:, :, :n].copy_(kept_state[name].gather(2, order).to(tensor.dtype))
    count[:, SEEN], count[:, FILLED], count[:, DROPPED] = length, n, 0


@slot_prefill.register_fake
def _(
    keys,
    values,
    pos,
    count,
    state,
    q,
    k_new,
    v_new,
    mask,
    handle,
    key: int,
    tokens=None,
    votes=None,
    lse=None,
    q_pre=None,
    cos=None,
    sin=None,
    out_proj=None,
):
    return None


register(slot_append=slot_append, slot_prefill=slot_prefill)


def next_positions(count: Tensor, q: int) -> Tensor:
    """``[B, q]``: the true positions of each row's next ``q`` tokens (tokens seen, less a renumbering
    prefill's shift)."""
    return (count[:, SEEN] - count[:, DROPPED])[:, None] + torch.arange(q, device=count.device)


def ring_victims(pos: Tensor, protect: int, q: int) -> Tensor:
    """``[B, H_kv, q]`` slots a ``RING`` writes ``q`` new tokens over: empty slots first (lowest index
    first), then the unprotected slots (index >= ``protect``) holding the oldest positions, protected
    slots last."""
    cap = pos.shape[-1]
    idx = torch.arange(cap, device=pos.device)
    age = torch.where(idx < protect, torch.iinfo(torch.int64).max // 2, pos.long())
    age = torch.where(pos < 0, idx - cap, age)
    return age.topk(q, dim=-1, largest=False).indices if q > 1 else age.argmin(-1, keepdim=True)


def pending_positions(pos: Tensor, count: Tensor, k_new: Tensor, rule: int, protect: int) -> tuple[Tensor, Tensor]:
    """Before an append call's write (several tokens on a filled slot cache): the new tokens' true
    positions ``[B, q]`` and the positions of the slots followed by the new tokens ``[B, H_kv, C + q]``.
    A full ``RING`` holds one entry more than the policy keeps between calls (the slot a decode step
    writes its token over, ``capacity = budget + 1``): its next victim is already evicted for these
    tokens (-1), as on a DynamicCache."""
    b, hkv, q = k_new.shape[:3]
    q_pos = next_positions(count, q)
    kv_pos = pos.long()
    if rule == RING:
        idx = torch.arange(pos.shape[-1], device=pos.device)
        evicted = (idx == ring_victims(pos, protect, 1)) & (pos >= 0).all(-1, keepdim=True)
        kv_pos = kv_pos.masked_fill(evicted, -1)
    return q_pos, torch.cat([kv_pos, q_pos[:, None, :].expand(b, hkv, q)], -1)


def write_slots(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    count: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    rule: int,
    protect: int,
    slot: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode / append on a slot cache, as plain tensor code (the rewrite calls it from the graph, so
    Inductor compiles and fuses it; no host sync, capturable). Each of the ``q`` new tokens goes into a
    victim slot chosen on the device:

    * ``APPEND``: slots ``count[FILLED] ..`` in order (a policy that no longer evicts); a full cache fails a
      device-side assert rather than overwrite a token;
    * ``RING``: per (row, KV head) the empty slots first, then the unprotected slot (index >= ``protect``:
      StreamingLLM's sinks are the first slots) holding the oldest position;
    * ``PLACED``: the slots ``slot [B, H_kv, q]`` the policy chose (``SlotHooks.place``: RaaS's page pool).

    Returns ``(q_pos [B, q], kv_len [B])``: the true positions of the tokens written and the slots a
    read must cover."""
    b, hkv, q, d = k_new.shape
    cap = keys.shape[2]
    ar = torch.arange(q, device=pos.device)
    q_pos = next_positions(count, q)
    device_assert((count[:, SEEN] + q <= count[:, MAX_LENGTH]).all(), LIMIT)
    if rule == APPEND:
        device_assert(
            (count[:, FILLED] + q <= cap).all(),
            "kvpass SlotCache: the cache is full; build it with a larger max_length (or max_new_tokens)",
        )
        slot = (count[:, FILLED, None, None] + ar).clamp_max(cap - 1).expand(b, hkv, q)
    elif rule == RING:
        torch._check(q <= cap - protect, lambda: "kvpass SlotCache: more new tokens in one call than ring slots")
        slot = ring_victims(pos, protect, q)
    _put(keys, values, pos, slot, k_new, v_new, q_pos[:, None, :].expand(b, hkv, q))
    count[:, SEEN:DROPPED].add_(q)  # seen and filled
    if rule == RING:  # slots in use stop at the capacity; seen keeps counting (so slot_append sees the eviction)
        count[:, FILLED : FILLED + 1].clamp_(max=cap)
    elif rule == PLACED:  # the read covers every slot up to the highest one written
        count[:, FILLED] = torch.maximum(count[:, FILLED] - q, slot.amax(dim=(1, 2)) + 1)
    return q_pos, count[:, FILLED].to(torch.int32)


def write_heads(
    keys: Tensor,
    values: Tensor,
    pos: Tensor,
    count: Tensor,
    ranges: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    window: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """A decode or append call on a SlotCache layer of the per-head layout (``kvpass.cache.ragged``), as plain
    tensor code the rewrite places in the graph (no host sync: capturable): each head's new tokens written
    (``ragged.append``; ``window``: the ring size of the heads that keep one, 0 when none does), the counters
    advanced. Returns ``(q_pos [B, q], start, length)``, the heads' ranges after the write."""
    q = k_new.shape[2]
    q_pos = next_positions(count, q)
    device_assert((count[:, SEEN] + q <= count[:, MAX_LENGTH]).all(), LIMIT)
    ragged.append(keys, values, pos, ranges, k_new, v_new, q_pos, window)
    count[:, SEEN : SEEN + 2].add_(q)  # seen and filled
    return q_pos, ranges[..., ragged.START].contiguous(), ranges[..., ragged.LENGTH].contiguous()


def _put(
    keys: Tensor, values: Tensor, pos: Tensor, slot: Tensor, k_new: Tensor, v_new: Tensor, new_pos: Tensor
) -> None:
    """Write the new tokens ``[B, H_kv, q, D]`` into ``slot [B, H_kv, q]`` of each (row, KV head), with
    their positions. ``index_put_`` (not ``scatter_``): Inductor writes it in place, where a ``scatter_``
    became a copy of every slot."""
    b, hkv = slot.shape[:2]
    rows = torch.arange(b, device=pos.device)[:, None, None]
    heads = torch.arange(hkv, device=pos.device)[None, :, None]
    keys.index_put_((rows, heads, slot), k_new.to(keys.dtype))
    values.index_put_((rows, heads, slot), v_new.to(values.dtype))
    pos.index_put_((rows, heads, slot), new_pos.to(pos.dtype))


# ------------------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------------------


def layer_windows(cfg) -> list[int]:
    """Per layer, its sliding window (0: global attention), read from the config as transformers' own
    caches read it: ``layer_types`` where the config has them, else every layer slides when the config
    sets ``sliding_window`` (Mistral 7B v0.1, Phi-3). Attention a slot cannot hold exactly (chunked,
    linear, shared KV) is refused, naming the layer."""
    layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        kind = (
            "sliding_attention"
            if window is not None
            else "chunked_attention"
            if getattr(cfg, "attention_chunk_size", None) is not None
            else "full_attention"
        )
        types = [kind] * layers
    windows = []
    for i, kind in enumerate(types[:layers]):
        if kind == "sliding_attention" and window:
            windows.append(int(window))
        elif kind == "full_attention":
            windows.append(0)
        else:
            raise ConfigError(
                f"SlotCache: layer {i} of this model has '{kind}' attention (config.layer_types"
                f"{'' if getattr(cfg, 'layer_types', None) else ', inferred as transformers does'}, "
                f"sliding_window={window}); a kvpass.SlotCache holds global and sliding-window layers "
                f"only: use the model's default cache (DynamicCache)"
            )
    return windows


def state_tensors(spec: dict, batch: int, kv_heads: int, dtype: torch.dtype, device) -> list[Tensor]:
    """A layer's policy state from its ``Policy.slot_state`` form (name -> (shape after ``[B, H_kv]``, dtype or None
    for ``dtype``, fill value)), in that order."""
    return [
        torch.full((batch, kv_heads, *shape), fill, dtype=dt or dtype, device=device)
        for shape, dt, fill in spec.values()
    ]


def capacity_dims(policy, capacity: int, head_dim: int, groups: int = 1) -> list[tuple[int, ...]]:
    """Per tensor of ``policy.slot_state``: the dimensions whose size follows the capacity (quest's
    pages), found by asking for the state at another capacity; the others are static."""
    here, there = (policy.slot_state(c, head_dim, groups) for c in (capacity, capacity + 64 * 16))
    return [tuple(2 + i for i, (a, b) in enumerate(zip(here[name][0], there[name][0])) if a != b) for name in here]


class SlotLayer(CacheLayerMixin):
    """One layer's fixed slots (see the module docstring)."""

    is_compileable = True
    is_croppable = False

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype,
        device,
        state: dict | None = None,
        window: int = 0,
        state_dims: list[tuple[int, ...]] | None = None,
        limit: int = 1 << 62,
        ident: int = 0,
    ) -> None:
        super().__init__()
        self.capacity = capacity
        # a sliding-window layer (``window`` > 0) is a ring of ``window`` slots whatever the
        # policy: the token at position p overwrites p - window, which no later query sees
        self.window = window
        self.is_sliding = window > 0
        # slots the model's own attention is given after the prefill: HF builds one mask for all layers,
        # so a cache whose layers differ in capacity (pyramidkv) gives each the shortest one's length; the
        # kvpass rewrite reads every slot by position (the model's own read is what an unchanged graph
        # does, and slot_append then refuses the compressed cache)
        self.read_length = capacity
        self.policy = ""  # the cache's policy, unless its prefill is a plain append (SlotCache sets it)
        self.spec = ""  # the policy configuration the cache was built for (Policy.key; SlotCache sets it)
        self.keys = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, kv_heads, capacity, v_head_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, kv_heads, capacity), -1, dtype=torch.int32, device=device)
        # ``ident``: the SlotCache's identity, its CACHE column (0: a layer of no SlotCache)
        self.count = torch.tensor([[0, 0, 0, limit, ident]] * batch, dtype=torch.int64, device=device)
        # the policy's decode state (Policy.slot_state): name -> (shape after [B, H_kv], dtype, fill)
        self._fills = [fill for _shape, _dt, fill in (state or {}).values()]
        self.state_names = list(state or {})
        self.state = state_tensors(state or {}, batch, kv_heads, dtype, device)
        self.device = self.keys.device
        self.filled = False  # host flag: Dynamo compiles one prefill graph and one decode graph
        self.is_initialized = True
        for t in (self.keys, self.values, self.pos, self.count, *self.state):
            torch._dynamo.mark_static_address(t)
        # Shapes: KV heads and head size are static (the decode site reads its KV heads off the slots). The
        # rows are symbolic (one graph serves every batch of two or more rows; Dynamo specializes a batch of
        # one), and so are a global layer's capacity and the state dimensions that follow it (quest's pages):
        # one compiled graph serves every capacity, a cache sized for another prompt compiles nothing new. A
        # sliding layer's ring (its window) is static: it is the same for every cache of the model.
        for t, symbolic in zip(
            (self.keys, self.values, self.pos, self.count, *self.state),
            [(2,), (2,), (2,), (), *(state_dims or [()] * len(self.state))],
        ):
            for dim in range(t.dim()):
                if dim == 0 or dim in symbolic and not window:
                    torch._dynamo.maybe_mark_dynamic(t, dim)  # symbolic from the first compile on, whatever
                else:  # torch.compile's dynamic= says
                    torch._dynamo.mark_static(t, dim)

    def fill(self, keys: Tensor, values: Tensor, pos: Tensor, seen: int, limit: int) -> None:
        """Load ``K`` entries a driver computed outside the compiled graphs (chunk fusion's merged cache):
        ``keys`` / ``values`` ``[B, H_kv, K, D]`` into the first slots, their true positions ``pos``
        ``[B, H_kv, K]``, and ``seen`` tokens counted; the next token goes into slot ``K``. ``limit``: the
        most tokens the sequence may see (``seen`` counts the tokens the driver did not keep too)."""
        k = keys.shape[2]
        if k > self.capacity:
            raise ValueError(f"kvpass SlotCache: {k} entries do not fit a layer of {self.capacity} slots")
        self.keys[:, :, :k].copy_(keys)
        self.values[:, :, :k].copy_(values)
        self.pos.fill_(-1)
        self.pos[:, :, :k].copy_(pos)
        self.count[:, :CACHE].copy_(torch.tensor([seen, k, 0, limit]))  # every row
        self.filled = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # allocated at construction

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not torch.compiler.is_compiling() and getattr(_reuse, "on", False):  # folded away in a traced graph
            raise MaskReused(
                "kvpass SlotCache: updated outside a compiled graph while the attention mask was an earlier step's"
            )
        if key_states.dtype != self.keys.dtype or key_states.device != self.keys.device:
            raise ConfigError(
                f"kvpass SlotCache: the model computes {key_states.dtype} keys on "
                f"{key_states.device}, the cache holds {self.keys.dtype} on {self.keys.device}; "
                f"build the SlotCache after model.to(...), with the model's dtype and device "
                f"(the defaults)"
            )
        torch.ops.kvpass.slot_append(
            self.keys,
            self.values,
            self.pos,
            self.count,
            key_states,
            value_states,
            self.state,
            self.window,
            self.policy,
            self.spec,
        )
        if not self.filled:  # a prefill attends over the prompt alone (get_mask_sizes sized its mask so)
            self.filled = True
            return key_states, value_states
        # always sliced, also where read_length is the whole capacity: a branch on the two specialized the decode
        # graph on which is larger (a short prompt, where every pyramidkv layer holds the whole bucket, compiled a
        # second decode graph for a long one, where they do not)
        return self.keys[:, :, : self.read_length], self.values[:, :, : self.read_length]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return (query_length if not self.filled else self.read_length), 0

    def get_seq_length(self) -> Tensor | int:
        return self.count[0, SEEN] if self.filled else 0  # generate's rows share one length

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.pos.fill_(-1)
        self.count[:, :MAX_LENGTH].zero_()  # seen, filled, dropped
        for t, fill in zip(self.state, self._fills):
            t.fill_(fill)
        self.filled = False

    def tensors(self) -> tuple[Tensor, ...]:
        """Every per-row tensor of the layer: slots, positions, counters, the policy's state."""
        return (self.keys, self.values, self.pos, self.count, *self.state)

    def reset_row(self, row: int) -> None:
        """Empty one row (positions -1, counters 0, the policy's state at its fill); the others keep theirs."""
        self.pos[row].fill_(-1)
        self.count[row, :MAX_LENGTH].zero_()
        for t, fill in zip(self.state, self._fills):
            t[row].fill_(fill)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError("kvpass SlotCache does not support beam search yet")

    def __repr__(self) -> str:
        return f"SlotLayer(capacity={self.capacity}, shape={tuple(self.keys.shape)}, dtype={self.keys.dtype})"


@dataclass(frozen=True)
class SlotCacheState:
    """``SlotCache.state()``: the counts ``GenerationState`` reports, read off a SlotCache: tokens ``seen`` (the most
    a row has seen), ``layers``, per layer the most entries a (row, KV head) holds (``stored``), and the tokens seen
    but not held, summed over layers, rows and KV heads (``evicted_tokens``)."""

    seen: int
    layers: int
    stored: dict
    evicted_tokens: int

    def stored_tokens(self) -> dict[int, int]:
        """``stored``, under ``GenerationState``'s method name."""
        return dict(self.stored)


class SlotCache(Cache):
    """A fixed-capacity KV cache for a kvpass policy; pass it to ``generate`` or ``forward``.

    Example::

        be = kvpass.backend("streamingllm", budget=2048)
        model.forward = torch.compile(model.forward, backend=be, mode="reduce-overhead")
        cache = kvpass.SlotCache(model, be, max_length=prompt_len + 256)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=256)

    Args:
        model: the HF model (its config gives layers, KV heads and head size; its first parameter
            the dtype and device unless given). A model split by transformers' tensor parallelism
            (``tp_plan="auto"``) gets a cache of this rank's KV heads.
        backend: the ``kvpass.backend(...)`` the model is compiled with; its policy sizes the slots.
        max_length: the most tokens a sequence will see (prompt + new tokens).
        batch_size: rows of the batch.
        max_new_tokens: decode steps a prefill-evicting policy must hold beyond its budget (default:
            ``max_length``, i.e. no tighter bound known).
    """

    def __init__(
        self,
        model,
        backend,
        max_length: int,
        batch_size: int = 1,
        max_new_tokens: int | None = None,
        dtype: torch.dtype | None = None,
        device=None,
        *,
        _driver: bool = False,
    ) -> None:
        policy = getattr(backend, "policy", None)
        if not hasattr(policy, "needs"):
            raise ConfigError(
                f"SlotCache: parameter 'backend' must be the kvpass.backend(...) the model is compiled "
                f"with, got {type(backend).__name__}"
            )
        for name, value, lo in (
            ("max_length", max_length, 1),
            ("batch_size", batch_size, 1),
            ("max_new_tokens", max_new_tokens, 0),
        ):
            if (value is not None or name != "max_new_tokens") and (
                not isinstance(value, int) or isinstance(value, bool) or value < lo
            ):
                raise ConfigError(
                    f"SlotCache: parameter '{name}' must be an int >= {lo}"
                    f"{' or None' if name == 'max_new_tokens' else ''}, got {value!r}"
                )
        if max_new_tokens is not None and max_new_tokens > max_length:
            raise ConfigError(
                f"SlotCache: parameter 'max_new_tokens' must be <= max_length ({max_length}), got {max_new_tokens}; "
                f"max_length counts the prompt and the new tokens, so pass max_length=prompt + max_new_tokens"
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ConfigError(f"SlotCache: parameter 'dtype' must be a torch.dtype or None, got {dtype!r}")
        if policy.needs.slot_rule is None:
            raise ConfigError(
                f"SlotCache: policy '{policy.name}' has no fixed-capacity decode (its slot_rule is "
                f"None); use it with a DynamicCache (the default cache)"
            )
        if not policy.needs.slot_prefill and not _driver:
            raise ConfigError(
                f"SlotCache: policy '{policy.name}' is a chunk-fusion policy; its SlotCache is built "
                f"and filled by kvpass.ChunkFusion(model, store, '{policy.name}', cache='slot')"
            )
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        policy.check_model(cfg)
        heads = getattr(cfg, "num_attention_heads", None)
        if not heads:
            raise ConfigError(
                f"SlotCache: the model's config ({type(cfg).__name__}) names no attention heads "
                f"(num_attention_heads), so it has no key/value cache for kvpass to hold (a state-space or "
                f"recurrent model); generate with the model's own cache: call generate on the model without "
                f"kvpass.compile"
            )
        windows = layer_windows(cfg)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        ranks = getattr(model, "tp_size", None) or 1  # transformers' tensor parallelism: this rank's heads
        if kv_heads % ranks:
            raise ConfigError(f"SlotCache: {kv_heads} KV heads do not split over {ranks} tensor-parallel ranks")
        kv_heads //= ranks
        groups = heads // (kv_heads * ranks)  # query heads per KV head
        p = next(model.parameters())
        dtype, device = dtype or p.dtype, device or p.device
        self._policy, self._windows, self._ranks = policy, windows, ranks
        self.ident = next(_IDENTS)  # written into every layer's ``count[:, CACHE]``: the prefill names the cache by it
        self.capacities = self._capacities(max_length, max_length if max_new_tokens is None else max_new_tokens)
        self.capacity = max(self.capacities)
        self.policy_name = policy.name
        super().__init__(
            layers=[
                SlotLayer(
                    batch_size,
                    kv_heads,
                    cap,
                    head_dim,
                    head_dim,
                    dtype,
                    device,
                    {} if w else policy.slot_state(cap, head_dim, groups),
                    w,
                    None if w else capacity_dims(policy, cap, head_dim, groups),
                    max_length,
                    self.ident,
                )
                for cap, w in zip(self.capacities, windows)
            ]
        )
        self.max_length, self.max_new_tokens = max_length, max_new_tokens
        self._runtime = getattr(backend, "runtime", None)
        if self._runtime is not None:
            self._runtime.slot_caches.add(self)  # so be.state can name the cache a prefill ran on
        shortest = min(c for c, w in zip(self.capacities, windows) if not w) if not all(windows) else None
        for lay in self.layers:
            lay.read_length = lay.capacity if lay.is_sliding else shortest
            lay.policy = "" if policy.needs.plain_prefill else policy.name
            lay.spec = policy.key()

    def _capacities(self, max_length: int, max_new_tokens: int) -> list[int]:
        layers, new = len(self._windows), min(max_new_tokens, max_length)
        # per layer: pyramidkv keeps more in lower layers; a sliding layer its window
        return [
            w or self._policy.slot_capacity(max_length, new, i, layers, self._ranks)
            for i, w in enumerate(self._windows)
        ]

    def fits(self, max_length: int, max_new_tokens: int, batch_size: int) -> bool:
        """Whether a generation of ``batch_size`` rows, at most ``max_length`` tokens of which
        ``max_new_tokens`` new, fits this cache (after ``reset()``): a cache can serve any shorter one."""
        return (
            batch_size == self.layers[0].keys.shape[0]
            and max_length <= self.max_length
            and all(need <= have for need, have in zip(self._capacities(max_length, max_new_tokens), self.capacities))
        )

    def holds_all(self, max_length: int, max_new_tokens: int) -> bool:
        """Whether every global layer keeps every token of such a generation (no eviction: ``full``, ``art``, a
        budget above ``max_length``); sliding-window layers keep their window whatever the policy."""
        return all(
            c >= max_length for c, w in zip(self._capacities(max_length, max_new_tokens), self._windows) if not w
        )

    def crop(self, max_length: int) -> None:
        """Refused: transformers crops a cache to give back rejected draft tokens (assisted and prompt-lookup
        decoding), and a SlotCache's slots are placed by the policy, not in sequence order."""
        raise ConfigError(
            f"kvpass.SlotCache cannot crop to {max_length} tokens: transformers crops a cache in "
            f"assisted and prompt-lookup decoding, to drop rejected drafts. An assistant model given "
            f"kvpass.compile decodes on a SlotCache: give the assistant an uncompiled model (or one "
            f"compiled with torch.compile and the 'full' backend on its DynamicCache)"
        )

    def admit(self, row: int, other: "SlotCache", source: int = 0) -> None:
        """Row ``row`` takes row ``source`` of ``other``, a cache of the same policy configuration and
        capacities whose prefill has run (a batch-1 cache that prefilled one request): its slots, positions,
        counters and the policy's state are copied in place (static addresses: a recorded CUDA graph of this
        cache's decode step stays valid), and the other rows keep theirs. After it this cache decodes
        (``forward`` with one token per row and each row's own ``position_ids``: ``row_positions``)."""
        mine, theirs = self.layers[0], other.layers[0]
        if not 0 <= row < mine.keys.shape[0]:
            raise ConfigError(f"SlotCache.admit: parameter 'row' must be in 0..{mine.keys.shape[0] - 1}, got {row}")
        if (
            other.capacities != self.capacities
            or mine.spec != theirs.spec
            or other.max_length != self.max_length
            or mine.keys.dtype != theirs.keys.dtype
            or mine.keys.shape[1:] != theirs.keys.shape[1:]
        ):
            raise ConfigError(
                "SlotCache.admit: the two caches differ (policy configuration, capacities, max_length, "
                "dtype or heads); build both for the same model and backend with the same max_length "
                "and max_new_tokens"
            )
        if not theirs.filled:
            raise ConfigError("SlotCache.admit: the source cache has not been prefilled")
        for a, b in zip(self.layers, other.layers):
            for mine_t, theirs_t in zip(a.tensors(), b.tensors()):
                mine_t[row].copy_(theirs_t[source])
            a.count[row, CACHE] = self.ident  # the row is this cache's now
            a.filled = True
        if self._runtime is not None:  # be.state: the batch a request joined is what the generation runs on
            self._runtime.slot_cache_prefilled(self)

    def reset_row(self, row: int) -> None:
        """Empty row ``row`` of every layer (the others keep decoding)."""
        for lay in self.layers:
            lay.reset_row(row)

    def row_positions(self) -> Tensor:
        """``[B, 1]`` int64 on the device: each row's next position as the model counts it (tokens seen,
        padding included), the ``position_ids`` of a decode step whose rows have different lengths."""
        return self.layers[0].count[:, SEEN : SEEN + 1].clone()

    @property
    def seen(self) -> int:
        """Tokens seen, the most any row has (a ``generate`` batch's rows share one length, a RequestQueue's
        differ); a host sync, for inspection, not for the decode loop."""
        return int(self.layers[0].count[:, SEEN].max())

    def positions(self, layer: int) -> Tensor:
        """``[B, H_kv, C]`` true position of each slot of ``layer`` (-1 = empty)."""
        return self.layers[layer].pos

    def state(self) -> "SlotCacheState":
        """What the cache holds now, as ``Backend.state`` reports a DynamicCache generation: tokens seen (the most
        a row has seen), per layer the most entries a (row, KV head) holds, and the tokens seen but not held (summed
        over layers, rows and KV heads). ``be.state`` returns it when this cache had the backend's last prefill."""
        stored, evicted = {}, 0
        for i, lay in enumerate(self.layers):
            if "heads" in lay.state_names and not lay.is_sliding:  # the per-head layout: heads' ranges of a pool
                held = ragged.held(lay.pos, lay.state[lay.state_names.index("heads")])
            else:
                held = (lay.pos >= 0).sum(-1)  # [B, H_kv]
            stored[i] = int(held.max())
            evicted += int((lay.count[:, SEEN : SEEN + 1] - held).clamp_min(0).sum())
        return SlotCacheState(self.seen, len(self.layers), stored, evicted)

    def kv_bytes(self) -> int:
        """Bytes of every layer's slots, positions and policy state: the cache's whole footprint."""
        return sum(t.numel() * t.element_size() for lay in self.layers for t in lay.tensors())

    def reset(self) -> None:
        for lay in self.layers:
            lay.reset()

    def __deepcopy__(self, memo: dict) -> "SlotCache":
        """An independent cache with the same entries (transformers' prompt reuse: ``copy.deepcopy`` of a
        prefilled cache, then ``generate`` on the copy): its slots and counts are copied, the backend's runtime and
        the policy are shared, and the copy has an identity of its own, so ``be.state`` tells the two apart."""
        memo[id(self._runtime)], memo[id(self._policy)] = self._runtime, self._policy
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        new.ident = next(_IDENTS)
        for lay in new.layers:
            lay.count[:, CACHE] = new.ident
        if new._runtime is not None:
            new._runtime.slot_caches.add(new)
        return new

    def __repr__(self) -> str:
        lay = self.layers[0]
        return (
            f"kvpass.SlotCache(policy={self.policy_name!r}, layers={len(self.layers)}, "
            f"capacity={self.capacity if len(set(self.capacities)) == 1 else self.capacities}, "
            f"batch={lay.keys.shape[0]}, kv_heads={lay.keys.shape[1]}, "
            f"dtype={lay.keys.dtype}, kv_bytes={self.kv_bytes()})"
        )
