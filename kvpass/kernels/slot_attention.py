"""Attention over a merged cache whose slot ``j`` holds position ``j``: the Triton kernel and its reference.

Chunk fusion (``kvpass.chunks.router``) recomputes a scattered subset of a long request's tokens. Their
queries ``q [B, H, Lq, D]`` sit at true positions ``q_pos [B, Lq]`` and attend over the merged cache
``k, v [B, H_kv, Lk, D]``, in which slot ``j`` holds position ``j``::

    out[b, h, i] = sum over j <= q_pos[b, i] of  softmax_j(s[b, h, i, :])[j] * v[b, g, j]
    s[b, h, i, j] = scale * q[b, h, i] . k[b, g, j]     (softcap * tanh(s / softcap) when softcap > 0)

with ``g = h // (H / H_kv)`` (GQA packed), math in fp32, the result in ``q.dtype``. A row that sees
nothing (``q_pos < 0``) gives zeros. Positions past the cache (``q_pos >= Lk``) see every slot.

The kernel is a FlashAttention-2 style forward that never builds the ``[Lq, Lk]`` mask (the old CUDA
path materialised it as an additive bias and repeated K/V to every query head for SDPA):

* **Tiling.** One program per (batch, query head, tile of ``BLOCK_M`` query rows). It keeps its
  ``[BLOCK_M, D]`` queries in registers and streams the KV head's keys and values in blocks of
  ``BLOCK_N`` slots, with an online softmax in fp32 (base-2: ``exp2`` with ``log2 e`` folded into the
  scale, one FMA per score, hence ``scale > 0``) and an fp32 ``[BLOCK_M, Dv]`` accumulator, normalised
  once at the end. The grid is (batch x head, tile) with heads fastest and tiles in reverse order: with
  ascending positions every head's longest tile starts first (less tail at the end of the grid), and
  the heads of a KV group, which read the same keys, run side by side (L2 reuse).
* **Block skipping.** Slots past the tile's largest position (``max q_pos + 1``) are seen by no row of
  the tile: the loop stops there and never loads them. Recomputed positions are scattered through
  the whole request, so a tile of rows covers a band of positions and this is the causal saving of
  the dense case (about half the work at ``Lq = Lk``, more when the recomputed rows are sparse).
* **Mask only where needed.** Key blocks that end at or below the tile's smallest position are
  seen in full by every row (rows with ``q_pos < 0`` aside, zeroed at the end), so the first loop runs
  them without any mask; a second loop covers the band between the tile's smallest and largest
  position with the per-element test ``slot <= q_pos[row]``. With ascending positions the band is
  about ``BLOCK_M / density`` slots wide, a few blocks; unsorted positions only cost speed (every
  block becomes a band block), never correctness.
* **Shapes.** ``D`` and ``Dv`` need not be powers of two (padded to ``D_PAD``/``DV_PAD`` with masked
  loads), ``Lq``/``Lk`` need not be multiples of the blocks, and ``q``/``k``/``v``/``q_pos`` are read
  through their strides (the last dim of q/k/v must be contiguous; it is made so otherwise).
  Offsets that can pass 2^31 (batch/head/row bases at long context) are int64; in-tile offsets are
  int32 and the key pointers advance by ``BLOCK_N`` rows per step.

Under Triton's interpreter (CPU tests) bf16/fp16 dots come out wrong, so the kernel upcasts there
(``UPCAST``), as it does for fp32 inputs (exact fp32 dots, no TF32).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvpass.kernels.decode_attention import interpreting, pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None

_LOG2E = 1.4426950408889634


def slot_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float | None = None, softcap: float = 0.0
) -> Tensor:
    """Attention of ``q [B, H, Lq, D]`` at positions ``q_pos [B, Lq]`` over ``k [B, H_kv, Lk, D]``,
    ``v [B, H_kv, Lk, Dv]`` with slot ``j`` at position ``j`` -> ``[B, H, Lq, Dv]`` in ``q.dtype``
    (fp32 math; see the module docstring). Equal to ``kvpass.policies.chunk_fusion.ops.attention_slots_reference``."""
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(b, hkv, h // hkv, lq, d)
    s = torch.einsum("bkgqd,bkld->bkgql", qg, k.float()) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    slots = torch.arange(lk, device=k.device)
    visible = slots[None, None, :] <= q_pos[:, :, None]  # [B, Lq, Lk]
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bkgql,bkld->bkgqd", p, v.float())
    return out.reshape(b, h, lq, v.shape[-1]).to(q.dtype).contiguous()


if triton is not None:

    @triton.jit
    def _slot_blocks(
        acc,
        l_i,
        m_i,
        q,
        k_ptrs,
        v_ptrs,
        qp,
        start,
        stop,
        sk_n,
        sv_n,
        qk_scale,
        cap_in,
        dmask,
        dvmask,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        EVEN_D: tl.constexpr,
        EVEN_DV: tl.constexpr,
    ):
        """Online-softmax steps over key blocks ``[start, stop)``; ``k_ptrs``/``v_ptrs`` point at
        ``start``. ``MASKED``: apply ``slot <= qp[row]`` and guard loads past ``stop``; otherwise every
        row sees every slot of these blocks (blocks below the tile's smallest position)."""
        offs_n = tl.arange(0, BLOCK_N)
        for start_n in range(start, stop, BLOCK_N):
            n = start_n + offs_n
            if MASKED:
                nmask = n < stop
                k = tl.load(k_ptrs, mask=nmask[:, None] & dmask[None, :], other=0.0)
            elif EVEN_D:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=dmask[None, :], other=0.0)
            if UPCAST:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:  # tanh(scale * s / softcap) = 2 sigmoid(2 scale s / softcap) - 1; qk_scale holds softcap
                s = 2.0 * tl.sigmoid(s * cap_in) - 1.0
            if MASKED:
                s = tl.where(n[None, :] <= qp[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if MASKED:  # a row may still have seen nothing: keep exp2 away from -inf - -inf
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s * qk_scale - m_use[:, None])  # one FMA per score
            l_i = l_i * alpha + tl.sum(p, 1)
            if MASKED:
                v = tl.load(v_ptrs, mask=nmask[:, None] & dvmask[None, :], other=0.0)
            elif EVEN_DV:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=dvmask[None, :], other=0.0)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
            k_ptrs += BLOCK_N * sk_n
            v_ptrs += BLOCK_N * sv_n
        return acc, l_i, m_i

    # Lq / Lk change with every request: specialising on them (== 1, divisible by 16) would compile
    # new variants for nothing (they only bound loops and masks)
    @triton.jit(do_not_specialize=["Lq", "Lk"])
    def _kvpass_slot_attention_kernel(
        Q,
        K,
        V,
        QPos,
        Out,
        scale,
        softcap,
        Lq,
        Lk,
        sq_b,
        sq_h,
        sq_m,
        sk_b,
        sk_h,
        sk_n,
        sv_b,
        sv_h,
        sv_n,
        sp_b,
        sp_m,
        so_b,
        so_h,
        so_m,
        H: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One (batch, query head, tile of BLOCK_M rows): unmasked blocks below the tile's smallest
        position, then the masked band up to its largest, then the normalised store."""
        tile = tl.cdiv(Lq, BLOCK_M) - 1 - tl.program_id(1)  # longest tiles (ascending positions) first
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        hk = h // GROUP
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < Lq
        d = tl.arange(0, D_PAD)
        dmask = d < D
        dv = tl.arange(0, DV_PAD)
        dvmask = dv < DV

        qp = tl.load(QPos + b * sp_b + rows.to(tl.int64) * sp_m, mask=rmask, other=-1)
        qp = tl.minimum(qp, Lk - 1).to(tl.int32)  # past the cache: sees every slot
        live = rmask & (qp >= 0)
        hi = tl.max(tl.where(live, qp, -1), 0) + 1  # slots >= hi: no row of the tile sees them
        lo = tl.min(tl.where(live, qp, Lk), 0) + 1  # slots < lo: every live row sees them
        full = (tl.minimum(lo, hi) // BLOCK_N) * BLOCK_N  # end of the unmasked blocks

        q = tl.load(
            Q + b * sq_b + h * sq_h + rows[:, None].to(tl.int64) * sq_m + d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_ptrs = K + b * sk_b + hk * sk_h + offs_n[:, None] * sk_n + d[None, :]
        v_ptrs = V + b * sv_b + hk * sv_h + offs_n[:, None] * sv_n + dv[None, :]
        # scores in the log2 domain (exp2 instead of exp) are s * qk_scale, with s the raw dot product,
        # or tanh(scale * dot / softcap) when softcapping; fp32 (Inductor may pass float scalars as fp64)
        if SOFTCAP:
            qk_scale = tl.cast(softcap * 1.4426950408889634, tl.float32)
            cap_in = tl.cast(2.0 * scale / softcap, tl.float32)
        else:
            qk_scale = tl.cast(scale * 1.4426950408889634, tl.float32)
            cap_in = qk_scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        acc, l_i, m_i = _slot_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            qp,
            0,
            full,
            sk_n,
            sv_n,
            qk_scale,
            cap_in,
            dmask,
            dvmask,
            BLOCK_N,
            False,
            SOFTCAP,
            UPCAST,
            D == D_PAD,
            DV == DV_PAD,
        )
        k_ptrs += full.to(tl.int64) * sk_n
        v_ptrs += full.to(tl.int64) * sv_n
        acc, l_i, m_i = _slot_blocks(
            acc,
            l_i,
            m_i,
            q,
            k_ptrs,
            v_ptrs,
            qp,
            full,
            hi,
            sk_n,
            sv_n,
            qk_scale,
            cap_in,
            dmask,
            dvmask,
            BLOCK_N,
            True,
            SOFTCAP,
            UPCAST,
            D == D_PAD,
            DV == DV_PAD,
        )
        seen = (qp >= 0) & (l_i > 0)
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        out = tl.where(seen[:, None], out, 0.0)
        tl.store(
            Out + b * so_b + h * so_h + rows[:, None].to(tl.int64) * so_m + dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=rmask[:, None] & dvmask[None, :],
        )


def default_config(d: int, dtype: torch.dtype) -> dict:
    """Launch parameters by head dim and element size (H100/H200, bf16/fp16 at D = 128: 128 x 64 tiles,
    8 warps, 3 stages); ``bench/bench_slot_attention.py`` sweeps the alternatives."""
    if dtype == torch.float32 or d > 128:  # fp32 (exact dots) or wide heads: smaller tiles fit
        return dict(block_m=64, block_n=32, num_warps=4 if d <= 64 else 8, num_stages=2)
    if d <= 64:
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=64, num_warps=8, num_stages=3)


def slot_attention_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float | None = None,
    softcap: float = 0.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    launch=None,
) -> Tensor:
    """Launch the kernel; arguments and result as ``slot_attention_reference`` (``[B, H, Lq, Dv]``,
    ``q.dtype``, contiguous). Unset launch parameters come from ``default_config``.

    ``launch`` wraps the kernel before its launch (``torch.library.wrap_triton`` inside a
    ``triton_op``; identity when called directly). No value of a tensor is read on the host, so it
    traces with fake tensors and symbolic lengths."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass slot attention needs Triton")
    wrap = launch or (lambda fn: fn)
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dv = v.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    if k.shape[-1] != d or v.shape[:3] != k.shape[:3] or q_pos.shape != (b, lq):
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"q_pos {tuple(q_pos.shape)}"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if not scale > 0:
        raise ValueError(f"the kernel folds the scale into the softmax maximum and needs scale > 0, got {scale}")
    cfg = default_config(max(d, dv), q.dtype)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    out = q.new_empty((b, h, lq, dv))
    upcast = q.dtype == torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype or interpreting()
    grid = (b * h, (lq + block_m - 1) // block_m)  # heads fastest: every head's longest tile first
    wrap(_kvpass_slot_attention_kernel)[grid](
        q,
        k,
        v,
        q_pos,
        out,
        float(scale),
        float(softcap),
        lq,
        lk,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        q_pos.stride(0),
        q_pos.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H=h,
        GROUP=h // hkv,
        D=d,
        D_PAD=pow2(d),
        DV=dv,
        DV_PAD=pow2(dv),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SOFTCAP=softcap > 0,
        UPCAST=upcast,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
