"""Gather / compaction of kept KV entries: the Triton kernel and its PyTorch reference.

After an eviction policy has chosen, per sequence and KV head, the ascending indices
``idx [B, H_kv, n]`` of the entries to keep, the cache is rebuilt as fresh contiguous tensors
``out[b, g, t] = src[b, g, idx[b, g, t]]`` for K and V. The old tensors are then released by the
cache, which is what makes eviction free memory rather than mask it.

The kernel copies ``BLOCK`` rows of one (sequence, KV head) per program; each row is one
contiguous ``D``-element load and store, so the copy runs at memory bandwidth whatever the
source strides (a ``[B, H_kv, N, D]`` cache with any layout whose last dim is dense).
"""

from __future__ import annotations

from torch import Tensor

from kvpass.kernels.decode_attention import pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None


def gather_reference(src: Tensor, idx: Tensor) -> Tensor:
    """``src [B, H_kv, N, D]`` rows at ``idx [B, H_kv, n]`` -> contiguous ``[B, H_kv, n, D]``."""
    return src.gather(2, idx.long()[..., None].expand(-1, -1, -1, src.shape[-1])).contiguous()


if triton is not None:

    @triton.jit
    def _kvpass_gather_kernel(
        Src,
        Idx,
        Out,
        n_keep,
        s_b,
        s_h,
        s_n,
        i_b,
        i_h,
        i_n,
        HKV: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        tmask = t < n_keep
        d = tl.arange(0, D_PAD)
        mask = tmask[:, None] & (d < D)[None, :]
        rows = tl.load(Idx + b * i_b + h * i_h + t.to(tl.int64) * i_n, mask=tmask, other=0).to(tl.int64)
        x = tl.load(Src + b * s_b + h * s_h + rows[:, None] * s_n + d[None, :], mask=mask)
        dst = (bh.to(tl.int64) * n_keep + t)[:, None] * D + d[None, :]
        tl.store(Out + dst, x, mask=mask)


def gather_triton(src: Tensor, idx: Tensor, block: int = 64, num_warps: int = 4, launch=None) -> Tensor:
    """Launch the gather kernel; arguments and result as ``gather_reference``."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass gather needs Triton")
    wrap = launch or (lambda fn: fn)
    if src.stride(-1) != 1:
        src = src.contiguous()
    b, hkv, _, d = src.shape
    n = idx.shape[-1]
    out = src.new_empty((b, hkv, n, d))
    if out.numel() == 0:
        return out
    wrap(_kvpass_gather_kernel)[(b * hkv, (n + block - 1) // block)](
        src,
        idx,
        out,
        n,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        idx.stride(0),
        idx.stride(1),
        idx.stride(2),
        HKV=hkv,
        D=d,
        D_PAD=pow2(d),
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


def gather_pair(k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """K and V rows at ``idx`` as fresh contiguous tensors: Triton on CUDA, the reference elsewhere. What the
    ``kvpass::gather_kv`` operator runs, for code that is itself inside an operator (the cache layer's
    compaction and slot prefill, below the operators' layer)."""
    if k.device.type == "cuda" and triton is not None:
        return gather_triton(k, idx), gather_triton(v, idx)
    return gather_reference(k, idx), gather_reference(v, idx)
