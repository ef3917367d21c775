"""kvpass operators: the nodes the graph pass writes into a compiled graph.

Each operator is a ``torch.library`` custom op with a pure-PyTorch reference implementation (used
on CPU and as the ground truth in tests) and a fake implementation that gives output shapes to
Dynamo / AOT autograd. CUDA implementations and Inductor lowerings are registered in
``kvpass.ops.lowerings``.

``key`` in these operators names one compiled graph's attention site (``Site.key``: the graph and the layer,
``kvpass.cache.runtime``): each graph's operators read their own graph's site.

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

``kvpass::attention_lse(q, k, v, scale) -> (out, lse)``
    ``attention`` of a plain causal prompt (``Lq == Lk``, no mask, no softcap) that also returns every query
    row's log-sum-exp ``[B, H, L]`` (fp32, natural log), which flash attention computes anyway: H2O's prefill
    scoring takes it instead of a pass of its own (``SitePlan.lse``).

``kvpass::attention_pos(q, k, v, q_pos, kv_pos, scale, softcap, window)``
    The same attention with the mask derived from true token indices: key ``j`` of KV head ``g``
    is visible to query ``i`` when ``0 <= kv_pos[b, g, j] <= q_pos[b, i]`` and, for a sliding layer
    (``window > 0``), ``q_pos[b, i] - kv_pos[b, g, j] < window``. Used once a policy has changed
    which entries a cache holds, so the mask always matches the kept entries.

``kvpass::cache_update(k_past, v_past, k_new, v_new, mask?, handle, key)``
    Appends the new K/V to the stored ones and returns ``(k, v, kv_pos, q_pos)``; positions come
    from the generation state (see ``kvpass.cache.state``). Reads the state, never writes it.

``kvpass::heads_update(k_past, v_past, k_new, v_new, mask?, handle, key) -> (k, v, kv_pos, q_pos, start, length)``
    ``cache_update`` for a per-head layer (``Needs.heads``, ``kvpass.cache.ragged``): each head's new entries
    follow its range in the row's pool (stored as ``[B, H_kv, L, D]``), and ``start`` / ``length`` ``[B, H_kv]``
    give each head's range of the result. Reads the state, never writes it.

``kvpass::compact(q, k, v, kv_pos, q_pos, handle, key, tokens?, votes?, lse?, q_pre?, cos?, sin?, out_proj?)``
    Runs the policy's eviction for one site and returns the K/V to store, physically smaller.
    Records the kept positions in the generation state (idempotent for equal inputs). ``q`` comes
    with the softmax scale folded in (``q . k`` is the logit, before softcapping); ``tokens`` (the
    call's input ids) is passed when the policy's plan asks for it (SABlock's punctuation), ``votes`` (the
    ``layer_scores`` of every KV head of the layer) when the plan's ``layer_votes`` does (ChunkKV), ``lse``
    (``attention_lse``'s row statistics) when the plan's ``lse`` does and the prefill is plainly causal (H2O),
    ``q_pre`` / ``cos`` / ``sin`` (the query before RoPE, scaled like ``q``, and the tables that rotate it) when
    the plan's ``rope`` does and the query is rotated (expected_attention), ``out_proj`` (the weight ``[hidden,
    H * D]`` of the layer's output projection, as the graph reads it) when the plan's ``out_proj`` does (criticalkv).

``kvpass::window_scores(q, k, kv_pos, q_pos, scale, softcap) -> [B, H_kv, N] fp32``
    Attention that the window queries ``q [B, H, W, D]`` give each key, summed over the window
    and over the query heads of each KV group (``kvpass.kernels.window_scores``); the scorer of the
    SnapKV family. A ``triton_op``: Triton on CUDA, ``kvpass::window_scores_ref`` elsewhere.

``kvpass::accumulated_scores(q, k, kv_pos, q_pos, scale, softcap) -> [B, H_kv, N] fp32``
    Attention that every query of ``q [B, H, L, D]`` gives each key, causal by true position, summed over
    the queries and over the query heads of each KV group (``kvpass.kernels.accumulated_scores``); H2O's
    scorer at prefill, whose cost is a prefill's attention rather than a window's. A ``triton_op``: two
    flash-style Triton passes on CUDA, ``kvpass::accumulated_scores_ref`` elsewhere.

``kvpass::layer_scores(q, k, mask?, scale, softcap, window) -> [B, H_kv, N] fp32``
    ``window_scores`` for a prefill, positions from the model's mask: the votes of a layer's last ``window``
    queries per KV head. Gated policies read their sum over heads after every observed layer, ChunkKV's
    selection reads it per layer (``SitePlan.layer_votes``); under tensor parallelism the graph gathers it
    over the ranks first (``kvpass.compiler.tp``).

``kvpass::gather_kv(k, v, idx) -> (k_kept, v_kept)``
    Compaction of the kept entries ``idx [B, H_kv, n]`` into fresh contiguous tensors
    (``kvpass.kernels.gather``). A ``triton_op``: Triton on CUDA, ``kvpass::gather_kv_ref`` elsewhere.

``kvpass::decode_attention(q, k, v, mask?, kv_pos?, q_pos?, page_table?, kv_len?, block_map?, scale,
softcap, window, tau, phi, patience, block, order, probe, horizon, kv_start?) -> (out, visited)``
    One-token decode attention read block by block with ART early termination, over a contiguous or paged cache, or a
    pool shared by ragged heads (``kv_start``, ``kv_len`` per head) (``kvpass.kernels.decode_attention``). A
    ``triton_op``: compiled CUDA graphs launch its Triton kernel directly; elsewhere it runs
    ``kvpass::decode_attention_ref``.

``kvpass::count_visits(out, visited, k, block, handle, key)``
    Pass-through of ``out`` that adds the blocks read to the run's statistics.

``kvpass::repeat_scores(out, q, k, mask?, scale, softcap, handle, key)``
    Pass-through of ``out`` (the attention's output) that, while a repeat pass runs, scores the prompt's entries
    the pass repeats by its queries' attention (``Runtime.repeat_scores``: kvzip).

``kvpass::true_positions(pos, handle, prefill)``
    Replaces position ids that the model derived from the (compressed) cache length with the
    true token count, so RoPE and learned positions stay exact after eviction. In a prefill it
    learns the model's first position (0, or 2 for OPT's learned table) and changes nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvpass.cache import runtime
from kvpass.cache.runtime import past_length
from kvpass.kernels import accumulated_scores as _accumulated
from kvpass.kernels import decode_attention as _decode
from kvpass.kernels import gather as _gather
from kvpass.kernels import window_scores as _wscores
from kvpass.op_registry import OPS, register  # noqa: F401  (OPS: re-exported, the one registry)

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


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    causal: int = CAUSAL_NONE,
    softcap: float = 0.0,
) -> Tensor:
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


def attention_pos_reference(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor, scale: float, softcap: float = 0.0, window: int = 0
) -> Tensor:
    """Reference for ``kvpass::attention_pos``."""
    s = _grouped_scores(q, k, scale, softcap)
    visible = position_mask(q_pos, kv_pos, window)[:, :, None]  # [B, H_kv, 1, Lq, Lk]
    s = s.masked_fill(~visible, float("-inf"))
    return _softmax_pv(s, v, q.dtype)


# ----------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("kvpass::attention", mutates_args=())
def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: int, softcap: float
) -> Tensor:
    return attention_reference(q, k, v, mask, scale, causal, softcap)


@attention.register_fake
def _(q, k, v, mask, scale, causal, softcap):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


@torch.library.custom_op("kvpass::attention_lse", mutates_args=())
def attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    return (attention_reference(q, k, v, None, scale, CAUSAL_TOP_LEFT), _accumulated.causal_lse_reference(q, k, scale))


@attention_lse.register_fake
def _(q, k, v, scale):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],)), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kvpass::attention_pos", mutates_args=())
def attention_pos(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor, scale: float, softcap: float, window: int
) -> Tensor:
    return attention_pos_reference(q, k, v, q_pos, kv_pos, scale, softcap, window)


@attention_pos.register_fake
def _(q, k, v, q_pos, kv_pos, scale, softcap, window):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _dense(t: Tensor) -> Tensor:
    """A fresh contiguous copy: every kvpass op returns contiguous tensors, as its fake promises."""
    return t.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("kvpass::cache_update", mutates_args=())
def cache_update(
    k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor, mask: Tensor | None, handle: int, key: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rt = runtime.get(handle)
    kv_pos, q_pos = rt.positions(key, k_past, k_new, mask)
    if past_length(k_past) == 0:  # DynamicCache starts from torch.tensor([])
        return _dense(k_new), _dense(v_new), kv_pos, q_pos
    k = torch.cat([k_past.to(k_new.dtype), k_new], dim=-2)
    v = torch.cat([v_past.to(v_new.dtype), v_new], dim=-2)
    return k, v, kv_pos, q_pos


@cache_update.register_fake
def _update_shapes(k_past, v_past, k_new, v_new, mask, handle, key: int):
    b, hkv, ln = k_new.shape[:3]
    lp = past_length(k_past)
    k = k_new.new_empty((b, hkv, lp + ln, k_new.shape[-1]))
    v = v_new.new_empty((b, hkv, lp + ln, v_new.shape[-1]))
    kv_pos = k_new.new_empty((b, hkv, lp + ln), dtype=torch.long)
    q_pos = k_new.new_empty((b, ln), dtype=torch.long)
    return k, v, kv_pos, q_pos


@torch.library.custom_op("kvpass::heads_update", mutates_args=())
def heads_update(
    k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor, mask: Tensor | None, handle: int, key: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    k, v, kv_pos, q_pos, start, length = runtime.get(handle).heads_update(key, k_past, v_past, k_new, v_new, mask)
    return _dense(k), _dense(v), _dense(kv_pos), _dense(q_pos), start.clone(), length.clone()


@heads_update.register_fake
def _(k_past, v_past, k_new, v_new, mask, handle, key: int):
    b, hkv = k_new.shape[:2]
    ranges = tuple(k_new.new_empty((b, hkv), dtype=torch.int32) for _ in range(2))
    return (*_update_shapes(k_past, v_past, k_new, v_new, mask, handle, key), *ranges)


@torch.library.custom_op("kvpass::compact", mutates_args=())
def compact(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_pos: Tensor,
    q_pos: Tensor,
    handle: int,
    key: int,
    tokens: Tensor | None = None,
    votes: Tensor | None = None,
    lse: Tensor | None = None,
    q_pre: Tensor | None = None,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    out_proj: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    k_out, v_out = runtime.get(handle).compact(
        key, q, k, v, kv_pos, q_pos, tokens, votes, lse, q_pre, cos, sin, out_proj
    )
    return k_out.contiguous(), v_out.contiguous()


@compact.register_fake
def _(
    q,
    k,
    v,
    kv_pos,
    q_pos,
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
    keep = runtime.get(handle).stored_length(key, k.shape[2])
    b, hkv = k.shape[:2]
    return k.new_empty((b, hkv, keep, k.shape[-1])), v.new_empty((b, hkv, keep, v.shape[-1]))


@torch.library.custom_op("kvpass::layer_scores", mutates_args=())
def layer_scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float, softcap: float, window: int) -> Tensor:
    """Attention ``[B, H_kv, N]`` (fp32) that the last ``window`` queries give each prompt token, summed over
    those queries and over the query heads of each KV group; causal inside the window, padding keys (from a
    4-D model mask) get nothing. ``q [B, H, N, D]``, ``k [B, H_kv, N, D]``. The graph sums it over the KV
    heads (after gathering every rank's heads under tensor parallelism: ``kvpass.compiler.tp``).
    Runs ``kvpass::window_scores`` (Triton on CUDA: no ``[H, W, N]`` score tensor)."""
    b, _, n, _ = q.shape
    w = min(window, n)
    pos = torch.arange(n, device=q.device).expand(b, n)
    valid = runtime.key_validity(mask, b, n)
    if valid is not None:
        pos = torch.where(valid, pos, torch.full_like(pos, -1))
    kv_pos = pos[:, None, :].expand(b, k.shape[1], n).contiguous()
    q_pos = torch.arange(n - w, n, device=q.device).expand(b, w).contiguous()
    return torch.ops.kvpass.window_scores(q[:, :, n - w :], k, kv_pos, q_pos, float(scale), float(softcap))


@layer_scores.register_fake
def _(q, k, mask, scale, softcap, window):
    return q.new_empty((q.shape[0], k.shape[1], q.shape[2]), dtype=torch.float32)


@torch.library.custom_op("kvpass::true_positions", mutates_args=())
def true_positions(pos: Tensor, handle: int, prefill: bool = False) -> Tensor:
    return runtime.get(handle).true_positions(pos, prefill).contiguous()


@true_positions.register_fake
def _(pos, handle, prefill=False):
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
def decode_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    kv_pos: Tensor | None,
    q_pos: Tensor | None,
    page_table: Tensor | None,
    kv_len: Tensor | None,
    block_map: Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    tau: float,
    phi: float,
    patience: int,
    block: int,
    order: int,
    probe: int,
    horizon: int,
    kv_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return _decode.decode_attention_reference(
        q,
        k,
        v,
        mask,
        kv_pos,
        q_pos,
        page_table,
        kv_len,
        block_map,
        scale,
        softcap,
        window,
        tau,
        phi,
        patience,
        block,
        order,
        probe,
        horizon,
        kv_start,
    )


@decode_attention_ref.register_fake
def _(
    q,
    k,
    v,
    mask,
    kv_pos,
    q_pos,
    page_table,
    kv_len,
    block_map,
    scale,
    softcap,
    window,
    tau,
    phi,
    patience,
    block,
    order,
    probe,
    horizon,
    kv_start=None,
):
    b, h = q.shape[:2]
    return (
        q.new_empty((b, h, 1, v.shape[-1])),
        q.new_empty((b, k.shape[1] if kv_start is None else kv_start.shape[1]), dtype=torch.int32),
    )


@torch.library.triton_op("kvpass::decode_attention", mutates_args=())
def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    kv_pos: Tensor | None,
    q_pos: Tensor | None,
    page_table: Tensor | None,
    kv_len: Tensor | None,
    block_map: Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    tau: float,
    phi: float,
    patience: int,
    block: int,
    order: int,
    probe: int,
    horizon: int,
    kv_start: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decode attention with ART termination; see ``kvpass.kernels.decode_attention``.

    A ``triton_op``: under ``torch.compile`` Inductor traces into it and the compiled CUDA graph
    launches ``_kvpass_decode_kernel`` itself. On other devices it is the reference operator.
    """
    if q.device.type == "cuda" and _decode.triton is not None:
        return _decode.decode_attention_triton(
            q,
            k,
            v,
            mask,
            kv_pos,
            q_pos,
            page_table,
            kv_len,
            block_map,
            scale,
            softcap,
            window,
            tau,
            phi,
            patience,
            block,
            order,
            probe,
            horizon,
            launch=torch.library.wrap_triton,
            kv_start=kv_start,
        )
    return torch.ops.kvpass.decode_attention_ref(
        q,
        k,
        v,
        mask,
        kv_pos,
        q_pos,
        page_table,
        kv_len,
        block_map,
        scale,
        softcap,
        window,
        tau,
        phi,
        patience,
        block,
        order,
        probe,
        horizon,
        kv_start,
    )


@torch.library.custom_op("kvpass::window_scores_ref", mutates_args=())
def window_scores_ref(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float) -> Tensor:
    return _wscores.window_scores_reference(q, k, kv_pos, q_pos, scale, softcap)


@window_scores_ref.register_fake
def _(q, k, kv_pos, q_pos, scale, softcap):
    return q.new_empty((q.shape[0], k.shape[1], k.shape[2]), dtype=torch.float32)


@torch.library.triton_op("kvpass::window_scores", mutates_args=())
def window_scores(q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float) -> Tensor:
    """Window attention per key, summed over window queries and group heads; see
    ``kvpass.kernels.window_scores``. Triton on CUDA, the reference operator elsewhere."""
    if _wscores.kernel_serves(q):
        return _wscores.window_scores_triton(q, k, kv_pos, q_pos, scale, softcap, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.window_scores_ref(q, k, kv_pos, q_pos, scale, softcap)


@torch.library.custom_op("kvpass::accumulated_scores_ref", mutates_args=())
def accumulated_scores_ref(
    q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float, lse: Tensor | None = None
) -> Tensor:
    return _accumulated.accumulated_scores_reference(q, k, kv_pos, q_pos, scale, softcap, lse=lse)


@accumulated_scores_ref.register_fake
def _(q, k, kv_pos, q_pos, scale, softcap, lse=None):
    return q.new_empty((q.shape[0], k.shape[1], k.shape[2]), dtype=torch.float32)


@torch.library.triton_op("kvpass::accumulated_scores", mutates_args=())
def accumulated_scores(
    q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, scale: float, softcap: float, lse: Tensor | None = None
) -> Tensor:
    """Attention per key from every query, causal by position, summed over queries and group heads; see
    ``kvpass.kernels.accumulated_scores``. ``lse``: the rows' log-sum-exp from the prefill's attention
    (``attention_lse``), which spares the first pass. Triton on CUDA, the reference operator elsewhere."""
    if q.device.type == "cuda" and _accumulated.triton is not None:
        return _accumulated.accumulated_scores_triton(
            q, k, kv_pos, q_pos, scale, softcap, lse=lse, launch=torch.library.wrap_triton
        )
    return torch.ops.kvpass.accumulated_scores_ref(q, k, kv_pos, q_pos, scale, softcap, lse)


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


@torch.library.custom_op("kvpass::count_visits", mutates_args=())
def count_visits(out: Tensor, visited: Tensor, k: Tensor, block: int, handle: int, key: int) -> Tensor:
    """Passes ``out`` through and adds ``visited`` (blocks read per KV group) to the run statistics.

    Written after ``decode_attention`` when a policy asks for statistics; taking and returning the
    attention output keeps it alive in the compiled graph.
    """
    runtime.get(handle).count_visits(key, visited, -(-k.shape[2] // block))
    return out.clone()


@count_visits.register_fake
def _(out, visited, k, block, handle, key: int):
    return torch.empty_like(out)


@torch.library.custom_op("kvpass::repeat_scores", mutates_args=())
def repeat_scores(
    out: Tensor, q: Tensor, k: Tensor, mask: Tensor | None, scale: float, softcap: float, handle: int, key: int
) -> Tensor:
    """Passes ``out`` through; while a repeat pass runs, ``Runtime.repeat_scores`` scores the chunk it repeats
    from ``q`` (scaled here) and ``k`` (the cache after the call's update). Taking and returning the attention
    output keeps it alive in the compiled graph."""
    runtime.get(handle).repeat_scores(key, q * scale, k, mask, softcap)
    return out.clone()


@repeat_scores.register_fake
def _(out, q, k, mask, scale, softcap, handle, key: int):
    return torch.empty_like(out)


# the core operators in the one registry (kvpass.op_registry; OPS is that registry, every family's included)
register(
    attention=attention,
    attention_lse=attention_lse,
    attention_pos=attention_pos,
    cache_update=cache_update,
    heads_update=heads_update,
    compact=compact,
    true_positions=true_positions,
    note_positions=note_positions,
    layer_scores=layer_scores,
    decode_attention=decode_attention,
    decode_attention_ref=decode_attention_ref,
    count_visits=count_visits,
    repeat_scores=repeat_scores,
    window_scores=window_scores,
    window_scores_ref=window_scores_ref,
    accumulated_scores=accumulated_scores,
    accumulated_scores_ref=accumulated_scores_ref,
    gather_kv=gather_kv,
    gather_kv_ref=gather_kv_ref,
)
