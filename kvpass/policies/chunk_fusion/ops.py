"""Chunk fusion's operators, registered on import; their kernels sit in ``kvpass.kernels``.

``key`` in these operators names one compiled graph's attention site (``Site.key``, ``kvpass.cache.runtime``).

``kvpass::rope_rotate(x, cos, sin) -> x_rotated`` and ``kvpass::scatter_rows(dst, idx, src)``
    RoPE rotation of ``x [M, L, D]`` by per-position tables (the model's own rotary module computes
    them) and a copy of ``dst [M, N, D]`` with rows ``idx`` replaced by ``src``
    (``kvpass.kernels.rope_rotate``): chunk fusion re-rotates stored pre-RoPE keys with the first and
    writes recomputed K/V over stored ones with the second. ``triton_op``s: Triton on CUDA, the
    ``*_ref`` operators elsewhere.

``kvpass::cache_overwrite(k_past, v_past, k_new, v_new, handle, key) -> (k, v, kv_pos, q_pos)``
    Chunk fusion's cache update: the new tokens are written over the cache slots named by the
    generation state's ``fusion`` slots (their true positions: a merged cache is stored in position
    order, one slot per token) instead of being appended, so ``k`` is as long as ``k_past``;
    ``kv_pos`` is every slot's position and ``q_pos`` the new tokens'. Reads the state only.

``kvpass::attention_slots(q, k, v, q_pos, scale, softcap)``
    ``attention_pos`` over a merged cache whose slot ``j`` holds position ``j`` (chunk fusion's
    recompute graph): key ``j`` is visible to query ``i`` when ``j <= q_pos[b, i]``
    (``kvpass.kernels.slot_attention``). A ``triton_op``: on CUDA a FlashAttention-style
    Triton kernel that derives the mask from ``q_pos`` and skips the slots past each query tile,
    ``kvpass::attention_slots_ref`` elsewhere.

"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import runtime
from kvpass.cache.runtime import past_length
from kvpass.kernels import rope_rotate as _rope
from kvpass.kernels import slot_attention as _slots
from kvpass.op_registry import register
from kvpass.ops import attention_pos_reference


@torch.library.custom_op("kvpass::rope_rotate_ref", mutates_args=())
def rope_rotate_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rope.rotate_reference(x, cos, sin)


@rope_rotate_ref.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.triton_op("kvpass::rope_rotate", mutates_args=())
def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [M, L, D]`` rotated by ``cos, sin [L, R]`` (``x * cos + rotate_half(x) * sin`` on the first
    ``R`` dims); see ``kvpass.kernels.rope_rotate``. Triton on CUDA, the reference operator elsewhere."""
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
    ``kvpass.kernels.rope_rotate``. Triton on CUDA, the reference operator elsewhere."""
    if dst.device.type == "cuda" and _rope.triton is not None:
        return _rope.scatter_triton(dst, idx, src, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.scatter_rows_ref(dst, idx, src)


@torch.library.custom_op("kvpass::cache_overwrite", mutates_args=())
def cache_overwrite(
    k_past: Tensor, v_past: Tensor, k_new: Tensor, v_new: Tensor, handle: int, key: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    slots = runtime.get(handle).state.fusion
    b, hkv, ln = k_new.shape[:3]
    lp = past_length(k_past)
    if slots is None or slots.numel() != ln or lp == 0:
        raise RuntimeError(
            "kvpass: a chunk-fusion policy writes new tokens over a merged cache; run it "
            "through kvpass.ChunkFusion (got a call on a cache it did not prepare)"
        )
    idx = slots.to(k_new.device)
    out = []
    for past, new in ((k_past, k_new), (v_past, v_new)):
        d = past.shape[-1]
        merged = torch.ops.kvpass.scatter_rows(
            past.reshape(b * hkv, lp, d), idx, new.to(past.dtype).reshape(b * hkv, ln, d)
        )
        out.append(merged.view(b, hkv, lp, d))
    kv_pos = torch.arange(lp, device=k_new.device).expand(b, hkv, lp).contiguous()
    q_pos = idx.expand(b, ln).contiguous()
    return out[0], out[1], kv_pos, q_pos


@cache_overwrite.register_fake
def _(k_past, v_past, k_new, v_new, handle, key: int):
    b, hkv, ln = k_new.shape[:3]
    lp = k_past.shape[-2]
    return (
        k_past.new_empty((b, hkv, lp, k_past.shape[-1])),
        v_past.new_empty((b, hkv, lp, v_past.shape[-1])),
        k_new.new_empty((b, hkv, lp), dtype=torch.long),
        k_new.new_empty((b, ln), dtype=torch.long),
    )


@torch.library.custom_op("kvpass::fusion_votes", mutates_args=())
def fusion_votes(
    out: Tensor, q: Tensor, k: Tensor, q_pos: Tensor, scale: float, softcap: float, handle: int, key: int
) -> Tensor:
    """Passes ``out`` (a recompute pass's attention output) through and, when the request asks for
    votes (``state.fusion_window`` > 0, ``a3+evict``), keeps the SnapKV votes of the last
    ``fusion_window`` query rows (the question) for every merged-cache slot: ``state.fusion_votes[layer]``
    ``[B, H_kv, L]`` fp32, from ``kvpass::window_scores`` (slot ``j`` holds position ``j``)."""
    st = runtime.get(handle).state
    w = min(st.fusion_window, q.shape[2])
    if w > 0:
        b, hkv, lk = k.shape[:3]
        kv_pos = torch.arange(lk, device=k.device).expand(b, hkv, lk).contiguous()
        st.fusion_votes[runtime.layer_of(key)] = torch.ops.kvpass.window_scores(
            q[:, :, -w:], k, kv_pos, q_pos[:, -w:].contiguous(), scale, softcap
        )
    return out.clone()


@fusion_votes.register_fake
def _(out, q, k, q_pos, scale, softcap, handle, key: int):
    return torch.empty_like(out)


def attention_slots_reference(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, softcap: float = 0.0
) -> Tensor:
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


register(
    rope_rotate=rope_rotate,
    rope_rotate_ref=rope_rotate_ref,
    scatter_rows=scatter_rows,
    scatter_rows_ref=scatter_rows_ref,
    cache_overwrite=cache_overwrite,
    fusion_votes=fusion_votes,
    attention_slots=attention_slots,
    attention_slots_ref=attention_slots_ref,
)
