"""Device implementations of the kvpass operators.

On CPU every operator runs its pure-PyTorch reference (``kvpass.ops``). On CUDA:

* a decode step (one query token, at most a ``[B, 1, 1, L]`` mask) of ``attention`` or
  ``attention_pos`` runs kvpass's Triton decode kernel with ART off (exact attention, split-KV for
  small batches): PyTorch's SDPA builds a new cuDNN plan for every new key length, which costs
  about 25 ms per step on torch 2.11 / H200 (``bench/results/sdpa_decode_probe.md``);
* everything else dispatches to PyTorch's fused SDPA kernels where the semantics match exactly
  (no softcapping; masks converted so fully masked rows give zeros, as the reference does), and to
  the reference otherwise.

Inductor keeps these custom operators as extern calls in the compiled graph.
``kvpass::decode_attention`` (ART) needs no entry here: it is a ``torch.library.triton_op``
(``kvpass.ops``), so Inductor traces into it and its generated code launches the Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpass import ops
from kvpass.kernels import accumulated_scores as _accumulated
from kvpass.kernels import decode_attention as _decode_attention


def _sdpa(q, k, v, mask, scale, is_causal=False):
    if k.shape[1] != q.shape[1]:
        # GQA by expanding K/V, as HF does: with enable_gqa and cuDNN SDPA off (torch 2.11), SDPA fell back
        # to its math kernel and asked for a [B, H, L, L] fp32 score matrix (128 GiB at 32k, 8B shape)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if mask is not None and mask.dtype == torch.bool:
        # SDPA gives NaN for rows with nothing visible; the reference gives zeros.
        empty = ~mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, scale=scale, is_causal=is_causal)
        return out.masked_fill(empty, 0.0).contiguous()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal).contiguous()


def _decode(q, k, v, mask) -> bool:
    """One query token against a cache, with at most a [B|1, 1, 1, L] mask: the decode kernel's case.

    SDPA is not used there: on torch 2.11 / H200 it builds a new cuDNN plan for every new key
    length, about 25 ms per decode step (``bench/results/sdpa_decode_probe.md``)."""
    return (
        q.shape[2] == 1
        and _decode_attention.triton is not None
        and q.shape[-1] == v.shape[-1]
        and (mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))
    )


def _flash_serves(q, v) -> bool:
    """PyTorch's flash attention kernel takes these inputs: half precision, equal q/k and v head sizes, a head
    size it has (at most 256, a multiple of 8), an Ampere or newer GPU."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and d <= 256
        and d % 8 == 0
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )


def _flash_causal(q, k, v, scale) -> tuple:
    """``(out, lse)`` of causal attention by flash attention's own kernel.
    Its causal mask is aligned to the bottom-right corner: with ``Lq < Lk`` query i sees keys j <= Lk - Lq + i
    (``CAUSAL_BOTTOM_RIGHT``, the KV-cache meaning, which ``torch.nn.attention.bias.causal_lower_right`` also
    runs on this kernel); with ``Lq == Lk`` that is plain causal attention. GQA is the kernel's own (its key and
    value heads divide the query heads; SDPA's ``enable_gqa`` runs the same kernel unexpanded), so K and V are
    read as stored, not copied ``H / H_kv`` times (kvzip's repeat passes: a GiB a layer and pass at 130k)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, True, False, scale=scale
    )[:2]
    return out.contiguous(), lse


@ops.attention.register_kernel("cuda")
def _attention_cuda(q, k, v, mask, scale, causal, softcap):
    if causal != ops.CAUSAL_TOP_LEFT and _decode(q, k, v, mask):
        return _decode_attention.decode_attention_triton(q, k, v, mask, scale=scale, softcap=softcap)[0]
    if softcap > 0 or (mask is not None and mask.dtype != torch.bool and not mask.is_floating_point()):
        return ops.attention_reference(q, k, v, mask, scale, causal, softcap)
    lq, lk = q.shape[2], k.shape[2]
    if causal == ops.CAUSAL_BOTTOM_RIGHT and mask is None and 1 < lq < lk and _flash_serves(q, v):
        # several tokens after a cache (a chunk of a prefill, kvzip's repeat passes): flash attention's causal
        # kernel, where SDPA with is_causal would align the mask top-left and a materialised [Lq, Lk] mask
        # would take the slower memory-efficient kernel
        return _flash_causal(q, k, v, scale)[0]
    if causal == ops.CAUSAL_BOTTOM_RIGHT and lq == lk:
        causal = ops.CAUSAL_TOP_LEFT
    if causal == ops.CAUSAL_BOTTOM_RIGHT and lq == 1:
        causal = ops.CAUSAL_NONE
    cm = None if mask is None and causal == ops.CAUSAL_TOP_LEFT else ops.causal_mask(causal, lq, lk, q.device)
    if cm is not None:  # SDPA takes is_causal or a mask, not both: fold the causal part into the mask
        if mask is None:
            mask = cm
        elif mask.dtype == torch.bool:
            mask = mask & cm
        else:
            mask = mask.masked_fill(~cm, float("-inf"))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return _sdpa(q, k, v, mask, scale, is_causal=mask is None and causal == ops.CAUSAL_TOP_LEFT)


@ops.attention_lse.register_kernel("cuda")
def _attention_lse_cuda(q, k, v, scale):
    """Flash attention's own kernel returns the row log-sum-exp with the output; where it does not serve (fp32, a
    head size it lacks), the attention and the reference's log-sum-exp."""
    if _flash_serves(q, v):
        out, lse = _flash_causal(q, k, v, scale)
        return out, lse.float().contiguous()
    return _attention_cuda(q, k, v, None, scale, ops.CAUSAL_TOP_LEFT, 0.0), _accumulated.causal_lse_reference(
        q, k, scale
    )


MASK_ELEMENTS = 1 << 30  # the most mask entries one SDPA call of attention_pos materialises


def _plain_causal(q_pos, kv_pos, window) -> bool:
    """Positions are 0..L-1 for every row and head (a prefill without padding or eviction), so the
    position mask is plain causal attention and SDPA's causal kernel serves it without a mask."""
    lq, lk = q_pos.shape[-1], kv_pos.shape[-1]
    if window or lq != lk:
        return False
    ar = torch.arange(lk, device=kv_pos.device)
    return bool(((kv_pos == ar).all() & (q_pos == ar).all()).item())


@ops.attention_pos.register_kernel("cuda")
def _attention_pos_cuda(q, k, v, q_pos, kv_pos, scale, softcap, window):
    if _decode(q, k, v, None):
        return _decode_attention.decode_attention_triton(
            q, k, v, kv_pos=kv_pos, q_pos=q_pos, scale=scale, softcap=softcap, window=window
        )[0]
    if softcap > 0:
        return ops.attention_pos_reference(q, k, v, q_pos, kv_pos, scale, softcap, window)
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    if lq > 1 and _plain_causal(q_pos, kv_pos, window):
        return _sdpa(q, k, v, None, scale, is_causal=True)
    # The mask is [B, H, rows, Lk]: cut the queries into row chunks so that it stays bounded
    # (a 128k-token prefill would otherwise need a 128k x 128k mask per head).
    rows = max(1, MASK_ELEMENTS // max(1, b * h * lk))
    outs = []
    for s in range(0, lq, rows):
        visible = ops.position_mask(q_pos[:, s : s + rows], kv_pos, window)  # [B, H_kv, rows, Lk]
        mask = visible.repeat_interleave(h // hkv, dim=1)
        outs.append(_sdpa(q[:, :, s : s + rows], k, v, mask, scale, False))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
