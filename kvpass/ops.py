"""kvpass operators: the nodes the graph pass writes into a compiled graph.

Each operator is a ``torch.library`` custom op with a pure-PyTorch reference implementation (used
on CPU and as the ground truth in tests) and a fake implementation that gives output shapes to
Dynamo / AOT autograd. CUDA implementations and Inductor lowerings are registered in
``kvpass.lowerings``.

Operators
---------
``kvpass::attention(q, k, v, mask?, scale, causal, softcap)``
    Exact attention with the semantics of ``F.scaled_dot_product_attention`` plus optional
    logit softcapping. ``causal`` is ``CAUSAL_NONE`` (0), ``CAUSAL_TOP_LEFT`` (1: SDPA's
    ``is_causal``, query i sees keys j <= i) or ``CAUSAL_BOTTOM_RIGHT`` (2: queries are the last
    Lq positions, query i sees keys j <= Lk - Lq + i; the KV-cache meaning, equal to 1 when
    Lq == Lk and to no mask when Lq == 1). GQA is packed: ``q`` has ``H`` heads, ``k``/``v`` have ``H_kv`` heads and
    query head ``h`` reads KV head ``h // (H // H_kv)``. ``mask`` is boolean (True = attend) or
    additive, broadcastable to ``[B, H, Lq, Lk]``. Fully masked rows give zeros.

``kvpass::attention_pos(q, k, v, q_pos, kv_pos, scale, softcap, window)``
    The same attention with the mask derived from true token indices: key ``j`` of KV head ``g``
    is visible to query ``i`` when ``0 <= kv_pos[b, g, j] <= q_pos[b, i]`` and, for a sliding layer
    (``window > 0``), ``q_pos[b, i] - kv_pos[b, g, j] < window``. Used once a policy has changed
    which entries a cache holds, so the mask always matches the kept entries.

``kvpass::cache_update(k_past, v_past, k_new, v_new, mask?, handle, site)``
    Appends the new K/V to the stored ones and returns ``(k, v, kv_pos, q_pos)``; positions come
    from the generation state (see ``kvpass.state``). Reads the state, never writes it.

``kvpass::compact(q, k, v, kv_pos, q_pos, handle, site, tokens?)``
    Runs the policy's eviction for one site and returns the K/V to store, physically smaller.
    Records the kept positions in the generation state (idempotent for equal inputs). ``q`` comes
    with the softmax scale folded in (``q . k`` is the logit, before softcapping); ``tokens`` (the
    call's input ids) is passed when the policy's plan asks for it (SABlock's punctuation).

``kvpass::window_scores(q, k, kv_pos, q_pos, scale, softcap) -> [B, H_kv, N] fp32``
    Attention that the window queries ``q [B, H, W, D]`` give each key, summed over the window
    and over the query heads of each KV group (``kvpass.kernels.window_scores``); the scorer of the
    SnapKV family. A ``triton_op``: Triton on CUDA, ``kvpass::window_scores_ref`` elsewhere.

``kvpass::gather_kv(k, v, idx) -> (k_kept, v_kept)``
    Compaction of the kept entries ``idx [B, H_kv, n]`` into fresh contiguous tensors
    (``kvpass.kernels.gather``). A ``triton_op``: Triton on CUDA, ``kvpass::gather_kv_ref`` elsewhere.

``kvpass::decode_attention(q, k, v, mask?, kv_pos?, q_pos?, page_table?, kv_len?, block_map?, scale,
softcap, window, tau, phi, patience, block, order, probe, horizon) -> (out, visited)``
    One-token decode attention read block by block with ART early termination, over a contiguous
    or paged cache (``kvpass.kernels.decode_attention``). A ``triton_op``: compiled CUDA graphs
    launch its Triton kernel directly; elsewhere it runs ``kvpass::decode_attention_ref``.

``kvpass::page_scores(q, kmin, kmax, live, ts, alpha, now) -> (ub [B, H_kv, P] fp32, ts_new)``
    Quest's page upper bounds from the pages' min/max keys and RaaS's timestamp update
    (``kvpass.kernels.page_scores``). A ``triton_op``: Triton on CUDA, ``kvpass::page_scores_ref``
    elsewhere.

``kvpass::page_bounds(q, kmin, kmax) -> ub [B, H, P] fp32``
    Quest's page upper bounds alone, per query head (``page_bounds_reference``), read by the SlotCache
    decode steps of Quest and RaaS; its kernel is parallel over blocks of pages
    (``kvpass.kernels.page_scores``). A ``triton_op``: Triton on CUDA, ``kvpass::page_bounds_ref``
    elsewhere.

``kvpass::raas_stamp(q, k_new, count, kmin, kmax, live, ts, born, meta, seen, decode_pages, alpha)``
    RaaS's per-layer decode update of its page tables on a SlotCache, in place (fold the token into its
    page's bounds, stamp the decode pages, plan the next slot; ``kvpass.kernels.raas_stamp``). A
    ``triton_op``: two Triton launches on CUDA, ``kvpass::raas_stamp_ref`` elsewhere.

``kvpass::top_pages(ub, top) -> idx [..., top] int32``
    The ``top`` best pages of each row of scores ``ub [..., P]`` (``-inf`` = not eligible), in
    ascending index order, -1 padded; ties go to the lower index (``top_pages_reference``). Quest's
    page choice on a SlotCache; its kernel selects without sorting (``kvpass.kernels.top_pages``).
    A ``triton_op``: Triton on CUDA (rows up to ``MAX_PAGES``), ``kvpass::top_pages_ref`` elsewhere.

``kvpass::count_visits(out, visited, k, block, handle, site)``
    Pass-through of ``out`` that adds the blocks read to the run's statistics.

``kvpass::page_select(q, k, handle, site) -> block_map [B, H_kv, steps] int32``
    The pages (blocks of 16) a page-selecting policy's decode step reads, -1 = none (Quest's top
    pages by upper bound and the current page); ``k`` is the cache with the new token last, which the
    policy folds into its page bounds first (stateful like ``compact``, idempotent for equal inputs).
    Feeds ``decode_attention``'s ``block_map``.

``kvpass::rope_rotate(x, cos, sin) -> x_rotated`` and ``kvpass::scatter_rows(dst, idx, src)``
    RoPE rotation of ``x [M, L, D]`` by per-position tables (the model's own rotary module computes
    them) and a copy of ``dst [M, N, D]`` with rows ``idx`` replaced by ``src``
    (``kvpass.kernels.rope``): chunk fusion re-rotates stored pre-RoPE keys with the first and
    writes recomputed K/V over stored ones with the second. ``triton_op``s: Triton on CUDA, the
    ``*_ref`` operators elsewhere.

``kvpass::step_position(k_pool, handle, site) -> q_pos [B, 1]`` and
``kvpass::pool_write(k_pool!, v_pool!, k_new, v_new, q, q_pos, handle, site) -> kv_pos``
    The decode step of a pool site (``SitePlan.pool``, raas): the new token's true position (read
    from the layer's record), then the policy writes the token's K/V into a slot of the stored pool
    in place (the graph stores the mutated pool; nothing is concatenated or gathered) and returns
    every slot's position after the write. The write depends only on its inputs and the policy's
    plan for the step, so a replayed call writes the same slot.

``kvpass::cache_overwrite(k_past, v_past, k_new, v_new, handle, site) -> (k, v, kv_pos, q_pos)``
    Chunk fusion's cache update: the new tokens are written over the cache slots named by the
    generation state's ``fusion`` slots (their true positions: a merged cache is stored in position
    order, one slot per token) instead of being appended, so ``k`` is as long as ``k_past``;
    ``kv_pos`` is every slot's position and ``q_pos`` the new tokens'. Reads the state only.

``kvpass::attention_slots(q, k, v, q_pos, scale, softcap)``
    ``attention_pos`` over a merged cache whose slot ``j`` holds position ``j`` (chunk fusion's
    recompute graph): key ``j`` is visible to query ``i`` when ``j <= q_pos[b, i]``
    (``kvpass.kernels.slot_attention``). A ``triton_op``: on CUDA a FlashAttention-style Triton kernel
    that derives the mask from ``q_pos`` and skips the slots past each query tile,
    ``kvpass::attention_slots_ref`` elsewhere.

``kvpass::true_positions(pos, handle)``
    Replaces position ids that the model derived from the (compressed) cache length with the
    true token count, so RoPE positions stay exact after eviction.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvpass import runtime
from kvpass.kernels import decode_attention as _decode
from kvpass.kernels import gather as _gather
from kvpass.kernels import page_scores as _pscores
from kvpass.kernels import raas_stamp as _stamp
from kvpass.kernels import rope as _rope
from kvpass.kernels import slot_attention as _slots
from kvpass.kernels import top_pages as _top
from kvpass.kernels import window_scores as _wscores
from kvpass.runtime import past_length

# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------


def _grouped_scores(q: Tensor, k: Tensor, scale: float, softcap: float) -> Tensor:
    """fp32 scores laid out [B, H_kv, group, Lq, Lk] without repeating K."""
    b, h, lq, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    qg = q.float().reshape(b, hkv, h // hkv, lq, d)
    s = torch.einsum("bkgqd,bkld->bkgql", qg, k.float()) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    return s


def _softmax_pv(s: Tensor, v: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Safe softmax over the last dim (all-masked rows -> 0) and the product with V."""
    b, hkv, g, lq, _ = s.shape
    row_max = s.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(s - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bkgql,bkld->bkgqd", p, v.float())
    return out.reshape(b, hkv * g, lq, v.shape[-1]).to(out_dtype).contiguous()


def _group_view(t: Tensor, b: int, h: int, hkv: int, lq: int, lk: int) -> Tensor:
    """Broadcast a mask-like tensor [B|1, H|1, Lq|1, Lk] to [B, H_kv, group, Lq, Lk]."""
    return t.expand(b, h, lq, lk).reshape(b, hkv, h // hkv, lq, lk)


CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def causal_mask(causal: int, lq: int, lk: int, device) -> Tensor | None:
    """Boolean [Lq, Lk] visibility for a causal mode, or None for CAUSAL_NONE."""
    if causal == CAUSAL_NONE:
        return None
    if causal not in (CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT):
        raise ValueError(f"causal must be 0 (none), 1 (top-left) or 2 (bottom-right), got {causal}")
    offset = 0 if causal == CAUSAL_TOP_LEFT else lk - lq
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=offset)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                        scale: float | None = None, causal: int = CAUSAL_NONE,
                        softcap: float = 0.0) -> Tensor:
    """Reference for ``kvpass::attention`` (fp32 math, output in ``q.dtype``)."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = _grouped_scores(q, k, scale, softcap)
    cm = causal_mask(int(causal), lq, lk, q.device)
    if cm is not None:
        s = s.masked_fill(~cm, float("-inf"))
    if mask is not None:
        m = _group_view(mask, b, h, hkv, lq, lk)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, float("-inf"))
        else:
            s = s + m.float()
    return _softmax_pv(s, v, q.dtype)


def position_mask(q_pos: Tensor, kv_pos: Tensor, window: int = 0) -> Tensor:
    """Boolean visibility [B, H_kv, Lq, Lk] from true token indices (see ``attention_pos``)."""
    qp = q_pos[:, None, :, None]
    kp = kv_pos[:, :, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window > 0:
        visible &= (qp - kp) < window
    return visible


def attention_pos_reference(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor,
                            scale: float, softcap: float = 0.0, window: int = 0) -> Tensor:
    """Reference for ``kvpass::attention_pos``."""
    s = _grouped_scores(q, k, scale, softcap)
    visible = position_mask(q_pos, kv_pos, window)[:, :, None]  # [B, H_kv, 1, Lq, Lk]
    s = s.masked_fill(~visible, float("-inf"))
    return _softmax_pv(s, v, q.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kvpass::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
              causal: int, softcap: float) -> Tensor:
    return attention_reference(q, k, v, mask, scale, causal, softcap)


@attention.register_fake
def _(q, k, v, mask, scale, causal, softcap):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.custom_op("kvpass::attention_pos", mutates_args=())
def attention_pos(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor, scale: float,
                  softcap: float, window: int) -> Tensor:
    return attention_pos_reference(q, k, v, q_pos, kv_pos, scale, softcap, window)


@attention_pos.register_fake
def _(q, k, v, q_pos, kv_pos, scale, softcap, window):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _dense(t: Tensor) -> Tensor:
    """A fresh contiguous copy: every kvpass op returns contiguous tensors, as its fake promises."""
    return t.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("kvpass::cache_update", mutates_args=())
def cache_update(k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor,
                 mask: Tensor | None, handle: int, site: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rt = runtime.get(handle)
    kv_pos, q_pos = rt.positions(site, k_past, k_new, mask)
    if past_length(k_past) == 0:  # DynamicCache starts from torch.tensor([])
        return _dense(k_new), _dense(v_new), kv_pos, q_pos
    k = torch.cat([k_past.to(k_new.dtype), k_new], dim=-2)
    v = torch.cat([v_past.to(v_new.dtype), v_new], dim=-2)
    return k, v, kv_pos, q_pos


@cache_update.register_fake
def _(k_past, v_past, k_new, v_new, mask, handle, site):
    b, hkv, ln = k_new.shape[:3]
    lp = past_length(k_past)
    k = k_new.new_empty((b, hkv, lp + ln, k_new.shape[-1]))
    v = v_new.new_empty((b, hkv, lp + ln, v_new.shape[-1]))
    kv_pos = k_new.new_empty((b, hkv, lp + ln), dtype=torch.long)
    q_pos = k_new.new_empty((b, ln), dtype=torch.long)
    return k, v, kv_pos, q_pos


@torch.library.custom_op("kvpass::compact", mutates_args=())
def compact(q: Tensor, k: Tensor, v: Tensor, kv_pos: Tensor, q_pos: Tensor, handle: int,
            site: int, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    k_out, v_out = runtime.get(handle).compact(site, q, k, v, kv_pos, q_pos, tokens)
    return k_out.contiguous(), v_out.contiguous()


@compact.register_fake
def _(q, k, v, kv_pos, q_pos, handle, site, tokens=None):
    keep = runtime.get(handle).stored_length(site, k.shape[2])
    b, hkv = k.shape[:2]
    return k.new_empty((b, hkv, keep, k.shape[-1])), v.new_empty((b, hkv, keep, v.shape[-1]))


@torch.library.custom_op("kvpass::true_positions", mutates_args=())
def true_positions(pos: Tensor, handle: int) -> Tensor:
    return runtime.get(handle).true_positions(pos).contiguous()


@true_positions.register_fake
def _(pos, handle):
    return torch.empty_like(pos, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvpass::note_positions", mutates_args=())
def note_positions(pos: Tensor, handle: int) -> Tensor:
    """Position ids passed into an appending or evicting graph after the prefill (true already): checked
    against the tokens seen, and the state learns how far the sequence reached (``Runtime.note_positions``)."""
    runtime.get(handle).note_positions(pos)
    return pos.clone(memory_format=torch.contiguous_format)


@note_positions.register_fake
def _(pos, handle):
    return torch.empty_like(pos, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvpass::decode_attention_ref", mutates_args=())
def decode_attention_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kv_pos: Tensor | None,
                         q_pos: Tensor | None, page_table: Tensor | None, kv_len: Tensor | None,
                         block_map: Tensor | None, scale: float, softcap: float, window: int, tau: float,
                         phi: float, patience: int, block: int, order: int,
                         probe: int, horizon: int) -> tuple[Tensor, Tensor]:
    return _decode.decode_attention_reference(q, k, v, mask, kv_pos, q_pos, page_table, kv_len, block_map,
                                              scale, softcap, window, tau, phi, patience, block, order, probe,
                                              horizon)


@decode_attention_ref.register_fake
def _(q, k, v, mask, kv_pos, q_pos, page_table, kv_len, block_map, scale, softcap, window, tau, phi,
      patience, block, order, probe, horizon):
    b, h = q.shape[:2]
    return (q.new_empty((b, h, 1, v.shape[-1])),
            q.new_empty((b, k.shape[1]), dtype=torch.int32))


@torch.library.triton_op("kvpass::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kv_pos: Tensor | None,
                     q_pos: Tensor | None, page_table: Tensor | None, kv_len: Tensor | None,
                     block_map: Tensor | None, scale: float, softcap: float, window: int, tau: float,
                     phi: float, patience: int, block: int, order: int, probe: int,
                     horizon: int) -> tuple[Tensor, Tensor]:
    """Decode attention with ART termination; see ``kvpass.kernels.decode_attention``.

    A ``triton_op``: under ``torch.compile`` Inductor traces into it and the compiled CUDA graph
    launches ``_kvpass_decode_kernel`` itself. On other devices it is the reference operator.
    """
    if q.device.type == "cuda" and _decode.triton is not None:
        return _decode.decode_attention_triton(q, k, v, mask, kv_pos, q_pos, page_table, kv_len, block_map,
                                               scale, softcap, window, tau, phi, patience, block, order,
                                               probe, horizon, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.decode_attention_ref(q, k, v, mask, kv_pos, q_pos, page_table, kv_len, block_map,
                                                 scale, softcap, window, tau, phi, patience, block, order, probe,
                                                 horizon)


@torch.library.custom_op("kvpass::window_scores_ref", mutates_args=())
def window_scores_ref(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float,
                      softcap: float) -> Tensor:
    return _wscores.window_scores_reference(q, k, kv_pos, q_pos, scale, softcap)


@window_scores_ref.register_fake
def _(q, k, kv_pos, q_pos, scale, softcap):
    return q.new_empty((q.shape[0], k.shape[1], k.shape[2]), dtype=torch.float32)


@torch.library.triton_op("kvpass::window_scores", mutates_args=())
def window_scores(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float) -> Tensor:
    """Window attention per key, summed over window queries and group heads; see
    ``kvpass.kernels.window_scores``. Triton on CUDA, the reference operator elsewhere."""
    if q.device.type == "cuda" and _wscores.triton is not None:
        return _wscores.window_scores_triton(q, k, kv_pos, q_pos, scale, softcap, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.window_scores_ref(q, k, kv_pos, q_pos, scale, softcap)


@torch.library.custom_op("kvpass::gather_kv_ref", mutates_args=())
def gather_kv_ref(k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    return _gather.gather_reference(k, idx), _gather.gather_reference(v, idx)


@gather_kv_ref.register_fake
def _(k, v, idx):
    n = idx.shape[-1]
    return k.new_empty(k.shape[:2] + (n, k.shape[-1])), v.new_empty(v.shape[:2] + (n, v.shape[-1]))


@torch.library.triton_op("kvpass::gather_kv", mutates_args=())
def gather_kv(k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """K and V rows at ``idx [B, H_kv, n]`` as fresh contiguous tensors; see ``kvpass.kernels.gather``.
    Triton on CUDA, the reference operator elsewhere."""
    if k.device.type == "cuda" and _gather.triton is not None:
        wrap = torch.library.wrap_triton
        return _gather.gather_triton(k, idx, launch=wrap), _gather.gather_triton(v, idx, launch=wrap)
    return torch.ops.kvpass.gather_kv_ref(k, v, idx)


@torch.library.custom_op("kvpass::page_scores_ref", mutates_args=())
def page_scores_ref(q: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor, alpha: float,
                    now: int) -> tuple[Tensor, Tensor]:
    return _pscores.page_scores_reference(q, kmin, kmax, live, ts, alpha, now)


@page_scores_ref.register_fake
def _(q, kmin, kmax, live, ts, alpha, now):
    return kmin.new_empty(kmin.shape[:3], dtype=torch.float32), ts.new_empty(ts.shape, dtype=torch.int64)


@torch.library.triton_op("kvpass::page_scores", mutates_args=())
def page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor, alpha: float,
                now: int) -> tuple[Tensor, Tensor]:
    """Page upper bounds (max over the group) and RaaS timestamps stamped ``now`` where a query head's
    softmax share of a live page exceeds ``alpha``; see ``kvpass.kernels.page_scores``. Triton on
    CUDA, the reference operator elsewhere."""
    if q.device.type == "cuda" and _pscores.triton is not None:
        return _pscores.page_scores_triton(q, kmin, kmax, live, ts, alpha, now, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.page_scores_ref(q, kmin, kmax, live, ts, alpha, now)


@torch.library.custom_op("kvpass::page_bounds_ref", mutates_args=())
def page_bounds_ref(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    return _pscores.page_bounds_reference(q, kmin, kmax)


@page_bounds_ref.register_fake
def _(q, kmin, kmax):
    return q.new_empty((q.shape[0], q.shape[1], kmin.shape[2]), dtype=torch.float32)


@torch.library.triton_op("kvpass::page_bounds", mutates_args=())
def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest's upper bound ``[B, H, P]`` (fp32) of every page for every query head; see
    ``kvpass.kernels.page_scores``. Triton on CUDA, the reference operator elsewhere."""
    if q.device.type == "cuda" and _pscores.triton is not None:
        return _pscores.page_bounds_triton(q, kmin, kmax, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.page_bounds_ref(q, kmin, kmax)


_TABLES = ("kmin", "kmax", "live", "ts", "born", "meta", "seen")


@torch.library.custom_op("kvpass::raas_stamp_ref", mutates_args=_TABLES)
def raas_stamp_ref(q: Tensor, k_new: Tensor, count: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor,
                   born: Tensor, meta: Tensor, seen: Tensor, decode_pages: int, alpha: float) -> None:
    _stamp.raas_stamp_reference(q, k_new, count, kmin, kmax, live, ts, born, meta, seen, decode_pages, alpha)


@torch.library.triton_op("kvpass::raas_stamp", mutates_args=_TABLES)
def raas_stamp(q: Tensor, k_new: Tensor, count: Tensor, kmin: Tensor, kmax: Tensor, live: Tensor, ts: Tensor,
               born: Tensor, meta: Tensor, seen: Tensor, decode_pages: int, alpha: float) -> None:
    """RaaS's decode update of one layer's page tables, in place; see ``kvpass.kernels.raas_stamp``.
    Triton on CUDA (contiguous tables, as a SlotCache allocates them), the reference operator elsewhere."""
    tables = (kmin, kmax, live, ts, born, meta, seen)
    if q.device.type == "cuda" and _stamp.triton is not None and all(t.is_contiguous() for t in tables):
        return _stamp.raas_stamp_triton(q, k_new, count, *tables, decode_pages, alpha, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.raas_stamp_ref(q, k_new, count, *tables, decode_pages, alpha)


@torch.library.custom_op("kvpass::top_pages_ref", mutates_args=())
def top_pages_ref(ub: Tensor, top: int) -> Tensor:
    return _top.top_pages_reference(ub, top)


@top_pages_ref.register_fake
def _(ub, top):
    return ub.new_empty((*ub.shape[:-1], top), dtype=torch.int32)


@torch.library.triton_op("kvpass::top_pages", mutates_args=())
def top_pages(ub: Tensor, top: int) -> Tensor:
    """The ``top`` best pages of each row of ``ub`` in index order, -1 padded; see
    ``kvpass.kernels.top_pages``. Triton on CUDA, the reference operator elsewhere."""
    if ub.device.type == "cuda" and _top.triton is not None and ub.shape[-1] <= _top.MAX_PAGES:
        return _top.top_pages_triton(ub, top, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.top_pages_ref(ub, top)


@torch.library.custom_op("kvpass::count_visits", mutates_args=())
def count_visits(out: Tensor, visited: Tensor, k: Tensor, block: int, handle: int, site: int) -> Tensor:
    """Passes ``out`` through and adds ``visited`` (blocks read per KV group) to the run statistics.

    Written after ``decode_attention`` when a policy asks for statistics; taking and returning the
    attention output keeps it alive in the compiled graph.
    """
    runtime.get(handle).count_visits(site, visited, -(-k.shape[2] // block))
    return out.clone()


@count_visits.register_fake
def _(out, visited, k, block, handle, site):
    return torch.empty_like(out)


def _pager(policy):
    """The policy (or member of a composition) that selects pages for decode reads."""
    for m in getattr(policy, "members", [policy]):
        if hasattr(type(m), "page_map"):
            return m
    raise RuntimeError(f"kvpass: policy '{policy.name}' selects no pages (kvpass::page_select)")


@torch.library.custom_op("kvpass::page_select", mutates_args=())
def page_select(q: Tensor, k: Tensor, handle: int, site: int) -> Tensor:
    rt = runtime.get(handle)
    return _pager(rt.policy).page_map(rt.sites[site], q, k, rt.state.layer(site))


@page_select.register_fake
def _(q, k, handle, site):
    steps = _pager(runtime.get(handle).policy).map_steps
    return k.new_empty((k.shape[0], k.shape[1], steps), dtype=torch.int32)


@torch.library.custom_op("kvpass::rope_rotate_ref", mutates_args=())
def rope_rotate_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rope.rotate_reference(x, cos, sin)


@rope_rotate_ref.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.triton_op("kvpass::rope_rotate", mutates_args=())
def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [M, L, D]`` rotated by ``cos, sin [L, R]`` (``x * cos + rotate_half(x) * sin`` on the first
    ``R`` dims); see ``kvpass.kernels.rope``. Triton on CUDA, the reference operator elsewhere."""
    if x.device.type == "cuda" and _rope.triton is not None:
        return _rope.rotate_triton(x, cos, sin, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.rope_rotate_ref(x, cos, sin)


@torch.library.custom_op("kvpass::scatter_rows_ref", mutates_args=())
def scatter_rows_ref(dst: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    return _rope.scatter_reference(dst, idx, src)


@scatter_rows_ref.register_fake
def _(dst, idx, src):
    return torch.empty_like(dst, memory_format=torch.contiguous_format)


@torch.library.triton_op("kvpass::scatter_rows", mutates_args=())
def scatter_rows(dst: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    """A copy of ``dst [M, N, D]`` with rows ``idx [n]`` replaced by ``src [M, n, D]``; see
    ``kvpass.kernels.rope``. Triton on CUDA, the reference operator elsewhere."""
    if dst.device.type == "cuda" and _rope.triton is not None:
        return _rope.scatter_triton(dst, idx, src, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.scatter_rows_ref(dst, idx, src)


@torch.library.custom_op("kvpass::cache_overwrite", mutates_args=())
def cache_overwrite(k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor, handle: int,
                    site: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    slots = runtime.get(handle).state.fusion
    b, hkv, ln = k_new.shape[:3]
    lp = past_length(k_past)
    if slots is None or slots.numel() != ln or lp == 0:
        raise RuntimeError("kvpass: a chunk-fusion policy writes new tokens over a merged cache; run it "
                           "through kvpass.ChunkFusion (got a call on a cache it did not prepare)")
    idx = slots.to(k_new.device)
    out = []
    for past, new in ((k_past, k_new), (v_past, v_new)):
        d = past.shape[-1]
        merged = torch.ops.kvpass.scatter_rows(past.reshape(b * hkv, lp, d), idx,
                                               new.to(past.dtype).reshape(b * hkv, ln, d))
        out.append(merged.view(b, hkv, lp, d))
    kv_pos = torch.arange(lp, device=k_new.device).expand(b, hkv, lp).contiguous()
    q_pos = idx.expand(b, ln).contiguous()
    return out[0], out[1], kv_pos, q_pos


@cache_overwrite.register_fake
def _(k_past, v_past, k_new, v_new, handle, site):
    b, hkv, ln = k_new.shape[:3]
    lp = k_past.shape[-2]
    return (k_past.new_empty((b, hkv, lp, k_past.shape[-1])), v_past.new_empty((b, hkv, lp, v_past.shape[-1])),
            k_new.new_empty((b, hkv, lp), dtype=torch.long), k_new.new_empty((b, ln), dtype=torch.long))


@torch.library.custom_op("kvpass::step_position", mutates_args=())
def step_position(k_pool: Tensor, handle: int, site: int) -> Tensor:
    return runtime.get(handle).step_position(site, k_pool)


@step_position.register_fake
def _(k_pool, handle, site):
    return k_pool.new_empty((k_pool.shape[0], 1), dtype=torch.long)


@torch.library.custom_op("kvpass::pool_write", mutates_args=("k_pool", "v_pool"))
def pool_write(k_pool: Tensor, v_pool: Tensor, k_new: Tensor, v_new: Tensor, q: Tensor, q_pos: Tensor,
               handle: int, site: int) -> Tensor:
    return runtime.get(handle).pool_write(site, q, k_pool, v_pool, k_new, v_new, q_pos)


@pool_write.register_fake
def _(k_pool, v_pool, k_new, v_new, q, q_pos, handle, site):
    return k_pool.new_empty(k_pool.shape[:3], dtype=torch.long)


@torch.library.custom_op("kvpass::fusion_votes", mutates_args=())
def fusion_votes(out: Tensor, q: Tensor, k: Tensor, q_pos: Tensor, scale: float, softcap: float, handle: int,
                 site: int) -> Tensor:
    """Passes ``out`` (a recompute pass's attention output) through and, when the request asks for
    votes (``state.fusion_window`` > 0, ``a3+evict``), keeps the SnapKV votes of the last
    ``fusion_window`` query rows (the question) for every merged-cache slot: ``state.fusion_votes[site]``
    ``[B, H_kv, L]`` fp32, from ``kvpass::window_scores`` (slot ``j`` holds position ``j``)."""
    st = runtime.get(handle).state
    w = min(st.fusion_window, q.shape[2])
    if w > 0:
        b, hkv, lk = k.shape[:3]
        kv_pos = torch.arange(lk, device=k.device).expand(b, hkv, lk).contiguous()
        st.fusion_votes[site] = torch.ops.kvpass.window_scores(q[:, :, -w:], k, kv_pos, q_pos[:, -w:].contiguous(),
                                                               scale, softcap)
    return out.clone()


@fusion_votes.register_fake
def _(out, q, k, q_pos, scale, softcap, handle, site):
    return torch.empty_like(out)


def attention_slots_reference(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float,
                              softcap: float = 0.0) -> Tensor:
    """Reference for ``kvpass::attention_slots``: ``attention_pos`` with slot ``j`` at position ``j``."""
    b, hkv, lk = k.shape[:3]
    kv_pos = torch.arange(lk, device=k.device).expand(b, hkv, lk)
    return attention_pos_reference(q, k, v, q_pos, kv_pos, scale, softcap, 0)


@torch.library.custom_op("kvpass::attention_slots_ref", mutates_args=())
def attention_slots_ref(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, softcap: float) -> Tensor:
    return _slots.slot_attention_reference(q, k, v, q_pos, scale, softcap)


@attention_slots_ref.register_fake
def _(q, k, v, q_pos, scale, softcap):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.triton_op("kvpass::attention_slots", mutates_args=())
def attention_slots(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, softcap: float) -> Tensor:
    """Attention of queries at true positions ``q_pos`` over a merged cache whose slot ``j`` holds
    position ``j``; see ``kvpass.kernels.slot_attention``. Triton on CUDA (a FlashAttention-style
    kernel that skips the slots past each query tile and builds no mask), the reference operator
    elsewhere."""
    if q.device.type == "cuda" and _slots.triton is not None and scale > 0:
        return _slots.slot_attention_triton(q, k, v, q_pos, scale, softcap, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.attention_slots_ref(q, k, v, q_pos, scale, softcap)


OPS = {
    "attention": attention,
    "attention_pos": attention_pos,
    "cache_update": cache_update,
    "compact": compact,
    "true_positions": true_positions,
    "note_positions": note_positions,
    "decode_attention": decode_attention,
    "decode_attention_ref": decode_attention_ref,
    "count_visits": count_visits,
    "window_scores": window_scores,
    "window_scores_ref": window_scores_ref,
    "gather_kv": gather_kv,
    "gather_kv_ref": gather_kv_ref,
    "page_scores": page_scores,
    "page_scores_ref": page_scores_ref,
    "page_bounds": page_bounds,
    "page_bounds_ref": page_bounds_ref,
    "raas_stamp": raas_stamp,
    "raas_stamp_ref": raas_stamp_ref,
    "top_pages": top_pages,
    "top_pages_ref": top_pages_ref,
    "page_select": page_select,
    "rope_rotate": rope_rotate,
    "rope_rotate_ref": rope_rotate_ref,
    "scatter_rows": scatter_rows,
    "scatter_rows_ref": scatter_rows_ref,
    "cache_overwrite": cache_overwrite,
    "step_position": step_position,
    "pool_write": pool_write,
    "attention_slots": attention_slots,
    "attention_slots_ref": attention_slots_ref,
    "fusion_votes": fusion_votes,
}
