"""Top-k page selection for Quest's decode step: Triton kernel and PyTorch reference.

Given page scores ``ub [..., P]`` (fp32; ``-inf`` marks a page that may not be chosen), return the
indices of the ``top`` highest-scoring pages **in ascending index order**, ``-1`` padded at the end
where fewer than ``top`` pages may be chosen. Ties at the cut are broken towards the lower index.
A NaN score counts as ``-inf``.

Quest reads the chosen pages in index order (the decode kernel's block map), so the order of the
scores among the chosen pages is never needed: a selection, not a sort. ``torch.topk`` cost about
20 us per sparse layer at 32k (2,048 pages, 8 rows at batch 1, H100, 2026-11-25), a sort-based
select launching several kernels over rows that fill eight of 132 SMs.

The kernel runs one program per row, in passes over blocks of ``BLOCK`` pages (a constant: a kernel whose
block followed the row's length made Inductor guard on the page count, so a SlotCache of another capacity
compiled another decode graph). Scores become order-preserving
integer keys (the IEEE bits, flipped for negatives, in ``[0, 2^32)``; excluded pages ``-1``); the
``top``-th largest key ``t`` is found from the top bit down, two bits per pass (the three candidate
counts of a pass are packed into one int64 sum, so each pass is one reduction per block: 16 passes);
then every key above ``t`` is chosen, and of the keys equal to ``t`` the first ``top - #above`` by index;
a prefix sum over the chosen flags, carried from block to block, gives each its output column. Rows of more than
``MAX_PAGES`` pages (a 256k-token cache) use the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.kernels.decode_attention import pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - kvpass runs its references without Triton
    triton = None

MAX_PAGES = 16384  # the packed counts need P < 2^16


def top_pages_reference(ub: Tensor, top: int) -> Tensor:
    """``[..., top]`` int32: the ``top`` best pages of each row of ``ub [..., P]``, ascending, -1 padded."""
    p = ub.shape[-1]
    ub = ub.float().masked_fill(ub.isnan(), float("-inf"))
    order = torch.sort(ub, dim=-1, descending=True, stable=True).indices[..., :top]  # ties: lower index first
    idx = torch.where(ub.gather(-1, order) > float("-inf"), order, p).sort(-1).values
    idx = torch.where(idx >= p, -1, idx).int()
    if top > p:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], top - p), -1)], -1)
    return idx.contiguous()


BLOCK = 2048  # pages per pass over a row: a constant, so the compiled kernel does not follow the row's length

if triton is not None:

    @triton.jit
    def _page_keys(Ub, row, p, n_pages):
        """Order-preserving int64 keys of the scores at ``p`` (-1: excluded, -inf, NaN or past the row)."""
        x = tl.load(Ub + row + p, mask=p < n_pages, other=float("-inf"))
        ok = x > float("-inf")  # False for NaN too
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 ties with +0.0, as in a sort
        bits = x.to(tl.int32, bitcast=True).to(tl.int64)
        return tl.where(ok, tl.where(bits >= 0, bits + 2147483647 + 1, -1 - bits), -1)

    @triton.jit(do_not_specialize=["n_pages", "top"])
    def _kvpass_top_pages(Ub, Out, n_pages, top, s_row, BLOCK: tl.constexpr, T_PAD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        row = r * s_row
        lanes = tl.arange(0, BLOCK)
        t = tl.zeros([], tl.int64)  # the largest t with #(key >= t) >= top, built two bits at a time
        one = tl.full([], 1, tl.int64)
        for shift in tl.static_range(30, -2, -2):
            c1 = t + (one << shift)
            c2 = t + (one << (shift + 1))
            c3 = c1 + (one << (shift + 1))
            packed = tl.zeros([], tl.int64)
            for p0 in range(0, n_pages, BLOCK):
                key = _page_keys(Ub, row, p0 + lanes, n_pages)
                packed += tl.sum(
                    (key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 16) + ((key >= c3).to(tl.int64) << 32), 0
                )
            t = tl.where(
                (packed >> 32) >= top,
                c3,
                tl.where(((packed >> 16) & 65535) >= top, c2, tl.where((packed & 65535) >= top, c1, t)),
            )
        above = tl.zeros([], tl.int32)
        for p0 in range(0, n_pages, BLOCK):
            above += tl.sum((_page_keys(Ub, row, p0 + lanes, n_pages) > t).to(tl.int32), 0)
        need = top - above
        ties = tl.zeros([], tl.int32)  # ties at t seen in earlier passes
        written = tl.zeros([], tl.int32)  # pages chosen in earlier passes
        for p0 in range(0, n_pages, BLOCK):
            p = p0 + lanes
            key = _page_keys(Ub, row, p, n_pages)
            tie = (key >= 0) & (key == t)
            chosen = (key > t) | (tie & (ties + tl.cumsum(tie.to(tl.int32), 0) <= need))
            col = written + tl.cumsum(chosen.to(tl.int32), 0) - 1
            tl.store(Out + r * top + col, p.to(tl.int32), mask=chosen)
            ties += tl.sum(tie.to(tl.int32), 0)
            written += tl.sum(chosen.to(tl.int32), 0)
        j = tl.arange(0, T_PAD)
        tl.store(Out + r * top + j, tl.full([T_PAD], -1, tl.int32), mask=(j >= written) & (j < top))


def top_pages_triton(ub: Tensor, top: int, num_warps: int | None = None, launch=None, block: int = BLOCK) -> Tensor:
    """Launch the selection kernel; arguments and result as ``top_pages_reference`` (rows of at most
    ``MAX_PAGES`` pages); ``block``: pages per pass (a power of two; tests use small ones)."""
    if triton is None:  # pragma: no cover
        raise RuntimeError("kvpass top pages need Triton")
    wrap = launch or (lambda fn: fn)
    p = ub.shape[-1]
    if p > MAX_PAGES:
        raise ValueError(f"top_pages_triton takes rows of at most {MAX_PAGES} pages, got {p}")
    rows = ub.reshape(-1, p)
    if rows.stride(-1) != 1 or rows.dtype != torch.float32:
        rows = rows.float().contiguous()
    out = torch.empty((*ub.shape[:-1], top), dtype=torch.int32, device=ub.device)
    if out.numel() == 0:
        return out
    wrap(_kvpass_top_pages)[(rows.shape[0],)](
        rows, out, p, top, rows.stride(0), BLOCK=block, T_PAD=pow2(top), num_warps=num_warps or 8
    )
    return out
