"""Scoring and selection shared by the prefill-time eviction policies (SnapKV family, SABlock).

Everything works on one prefill's cache ``[B, H_kv, N]`` with true positions ``kv_pos`` (-1 marks
left padding) and returns plain tensors, so each policy file only says how it ranks tokens:

* ``window_layout``: which entries are real, and which form the observation window (the last
  ``window`` real tokens of each row: always kept, and their queries vote for the rest);
* ``window_scores``: the votes (``kvpass::window_scores``, a Triton kernel on CUDA);
* ``pool``: SnapKV's 1-D pooling of the votes over the candidates (never across the window);
* ``block_fill``: per segment, keep the best blocks of a fixed size until the segment's quota is
  covered, trimming the last block to its best tokens (ChunkKV's chunks, SABlock's block search);
* ``keep_top``: the final index set: window first, then the policy's priority, real tokens always
  before padding, ties to the earlier entry, ascending, exactly ``keep`` entries;
* ``keep_top_heads``: AdaKV's allocation of a layer's ``H_kv x keep`` entries over its KV heads (each head
  its own count, at least a floor), for the per-head layout of ``kvpass.cache.ragged``.

Padding never outranks a real token and never shifts a boundary (chunks and segments start at the
first real token), so a left-padded row keeps what the same prompt keeps alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def window_layout(kv_pos: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """(valid, forced) ``[B, H_kv, N]`` booleans: real entries, and the last ``window`` real ones (none
    for ``window`` 0)."""
    valid = kv_pos >= 0
    after = valid.flip(-1).long().cumsum(-1).flip(-1)  # real entries at or after j
    return valid, valid & (after <= window)


def window_scores(site, q: Tensor, k: Tensor, kv_pos: Tensor, q_pos: Tensor, window: int) -> Tensor:
    """Attention ``[B, H_kv, N]`` (fp32) from the last ``window`` queries to every key, summed over
    those queries and over the query heads of each KV group. Causal inside the window; padding
    keys get nothing, padding queries (only in rows shorter than the window) give nothing. ``q`` is
    what ``compact`` receives: the scale is folded in, so ``q . k`` is the logit. A window of 0 has no
    queries, so no votes: zeros (``q[:, :, -0:]`` would be every query)."""
    w = min(window, q.shape[2])
    if w <= 0:
        return q.new_zeros(k.shape[:3], dtype=torch.float32)
    return torch.ops.kvpass.window_scores(q[:, :, -w:], k, kv_pos, q_pos[:, -w:].contiguous(), 1.0, float(site.softcap))


def pool(scores: Tensor, cand: Tensor, kernel: int, mode: str) -> Tensor:
    """1-D pooling (stride 1, same length) of the candidates' scores; other entries count as 0.

    ``mode`` is ``"max"`` or ``"avg"`` (zeros at the borders count, as in SnapKV). ``kernel`` is odd."""
    x = scores.float().masked_fill(~cand, 0.0)
    if kernel <= 1:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    if mode == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out.reshape(x.shape)


def keep_top(priority: Tensor, forced: Tensor, valid: Tensor, keep: int) -> Tensor:
    """Ascending indices ``[..., keep]``: forced entries, then real entries by ``priority``
    (descending), then padding; ties go to the earlier entry."""
    key = torch.where(forced, float("inf"), torch.where(valid, priority.float(), float("-inf")))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :keep]
    return order.sort(dim=-1).values


def keep_top_heads(priority: Tensor, forced: Tensor, valid: Tensor, keep: int, floor: int) -> tuple[Tensor, Tensor]:
    """AdaKV's allocation (Feng et al., 2024): a layer's ``H_kv x keep`` entries go to its KV heads by one ranking
    over the layer's (head, entry) pairs, so that a head whose scores are spread keeps more than one whose scores
    are concentrated, and the layer's total stays what ``keep_top`` keeps. Each head first keeps its ``floor``
    best entries (the safeguard: ``floor <= keep``), forced entries before any other; then the rest go by
    priority over every head, real entries before padding, ties to the lower (head, entry). A floor of ``keep``
    is ``keep_top`` per head (the uniform budget).

    Returns ``(sel [B, H_kv x keep], counts [B, H_kv])``: the kept pairs as flat indices ``head x N + entry``,
    ascending (head-major, each head's entries in order), and how many each head keeps."""
    b, h, n = priority.shape
    key = torch.where(forced, float("inf"), torch.where(valid, priority.float(), float("-inf")))
    # a head's floor is what keep_top would keep of it (padding only in a row shorter than the floor, which keeps
    # every real entry anyway), so a floor of the whole budget is keep_top per head
    best = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :floor]
    safe = torch.zeros_like(forced).scatter_(-1, best, True)
    real = key.clamp_min(torch.finfo(torch.float32).min)  # a real entry scored -inf still outranks padding
    rank = torch.where(safe, float("inf"), torch.where(valid, real, float("-inf")))
    top = torch.sort(rank.reshape(b, h * n), dim=-1, descending=True, stable=True).indices[:, : h * keep]
    sel = top.sort(dim=-1).values
    counts = torch.zeros(b, h, dtype=torch.long, device=sel.device).scatter_add_(1, sel // n, torch.ones_like(sel))
    return sel, counts


def _sorted_by(primary: Tensor, secondary_desc: Tensor) -> Tensor:
    """Permutation ordering each row by ``primary`` ascending, then ``secondary_desc`` descending,
    then index (two stable sorts)."""
    order = torch.sort(secondary_desc, dim=-1, descending=True, stable=True).indices
    again = torch.sort(primary.gather(-1, order), dim=-1, stable=True).indices
    return order.gather(-1, again)


def block_fill(score: Tensor, seg: Tensor, size: int, quota: Tensor) -> Tensor:
    """Per segment, the best blocks of ``size`` tokens until ``quota`` tokens are covered.

    ``score [R, N]`` (any float), ``seg [R, N]``: segment index (0..S-1, contiguous runs in position
    order) of each candidate, -1 elsewhere; ``quota [R, S]``: tokens to keep per segment (at most
    its size). Blocks are cut from each segment's first token; they are taken by score sum
    (ties: earlier block), the last one trimmed to its best tokens (ties: earlier token). Returns
    the chosen candidates ``[R, N]`` bool: exactly ``quota`` per segment.
    """
    r, n = score.shape
    s = quota.shape[1]
    cand = seg >= 0
    segd = torch.where(cand, seg, s)  # non-candidates: a dummy segment, quota 0
    x = score.masked_fill(~cand, 0.0)
    idx = torch.arange(n, device=score.device).expand(r, n)
    start = torch.full((r, s + 1), n, device=score.device, dtype=torch.long)
    start = start.scatter_reduce(1, segd, idx, "amin")
    pos_in = idx - start.gather(1, segd)
    first = torch.ones_like(cand[:, :1])
    new_block = (pos_in % size == 0) | torch.cat([first, segd[:, 1:] != segd[:, :-1]], 1)
    blk = new_block.long().cumsum(1) - 1  # block id, increasing with position
    bsum = torch.zeros_like(x).scatter_add(1, blk, x)
    bsize = torch.zeros(r, n, device=score.device, dtype=torch.long).scatter_add(1, blk, torch.ones_like(blk))
    bseg = torch.full((r, n), s + 1, device=score.device, dtype=torch.long).scatter(1, blk, segd)
    # blocks ranked inside their segment: tokens of the better blocks come first
    order = _sorted_by(bseg, bsum)
    sz = bsize.gather(1, order)
    seg_size = torch.zeros(r, s + 2, device=score.device, dtype=torch.long).scatter_add(1, bseg, bsize)
    seg_off = seg_size.cumsum(1) - seg_size
    before = sz.cumsum(1) - sz - seg_off.gather(1, bseg.gather(1, order))
    blk_before = torch.empty_like(before).scatter(1, order, before)
    # rank of each token inside its block (best first)
    tok = _sorted_by(blk, x)
    bstart = bsize.cumsum(1) - bsize
    rank_sorted = torch.arange(n, device=score.device).expand(r, n) - bstart.gather(1, blk.gather(1, tok))
    rank = torch.empty_like(rank_sorted).scatter(1, tok, rank_sorted)
    q_tok = torch.cat([quota, torch.zeros_like(quota[:, :1])], 1).gather(1, segd)
    return cand & (blk_before.gather(1, blk) + rank < q_tok)
