"""Device implementations of the kvpass operators.

On CPU every operator runs its pure-PyTorch reference (``kvpass.ops``). On CUDA, the attention
operators dispatch to PyTorch's fused SDPA kernels where the semantics match exactly (no
softcapping; masks converted so fully masked rows give zeros, as the reference does), and to the
reference otherwise. Inductor keeps these custom operators as extern calls in the compiled graph.

Triton kernels replace these implementations as the policy issues land; each sits in
``kvpass.kernels`` next to its reference. The first, decode attention with ART termination, needs
no entry here: ``kvpass::decode_attention`` is a ``torch.library.triton_op`` (``kvpass.ops``), so
Inductor traces into it and its generated code launches the Triton kernel itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpass import ops


def _sdpa(q, k, v, mask, scale, is_causal=False):
    if mask is not None and mask.dtype == torch.bool:
        # SDPA gives NaN for rows with nothing visible; the reference gives zeros.
        empty = ~mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, scale=scale,
                                             is_causal=is_causal, enable_gqa=True)
        return out.masked_fill(empty, 0.0).contiguous()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                          enable_gqa=True).contiguous()


@ops.attention.register_kernel("cuda")
def _attention_cuda(q, k, v, mask, scale, causal, softcap):
    if softcap > 0 or (mask is not None and mask.dtype != torch.bool and not mask.is_floating_point()):
        return ops.attention_reference(q, k, v, mask, scale, causal, softcap)
    lq, lk = q.shape[2], k.shape[2]
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
        visible = ops.position_mask(q_pos[:, s:s + rows], kv_pos, window)  # [B, H_kv, rows, Lk]
        mask = visible.repeat_interleave(h // hkv, dim=1)
        outs.append(_sdpa(q[:, :, s:s + rows], k, v, mask, scale, False))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
