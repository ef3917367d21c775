"""A value restricted to the gate's selected tokens: gathered along its token dims (``take``), an integer
input of a second prefill renumbered (``renumber``), local indices mapped back to true positions
(``true_of``), and the prompt's positions with padding as -1 (``masked_positions``)."""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import runtime as _runtime


def true_of(local: Tensor, true: Tensor) -> Tensor:
    """``local [B, H_kv, m]`` indices among the tokens a deeper layer computed (-1 = empty) -> their true
    positions ``true [B, n]``, on ``local``'s device and dtype (-1 stays -1)."""
    b = local.shape[0]
    idx = local.clamp_min(0).reshape(b, -1).long().to(true.device)
    pos = true.expand(b, -1).gather(1, idx).view(local.shape).to(local.device, local.dtype)
    return pos.masked_fill(local < 0, -1)


def take(x, sel: Tensor, dims: tuple) -> Tensor:
    """``x`` restricted to the selected tokens ``sel [B, n]`` along each of its token dims."""
    b, n = sel.shape
    sel = sel.to(x.device)
    for d in dims:
        if d == 0 or x.dim() == 1:
            if b > 1 and not bool((sel == sel[:1]).all()):
                raise RuntimeError("kvpass gate: a batch-shared token tensor cannot take per-row selections")
            x = x.index_select(d, sel[0])
            continue
        if x.shape[0] == 1 and b > 1:
            x = x.expand(b, *x.shape[1:])
        shape = [b] + [1] * (x.dim() - 1)
        shape[d] = n
        idx = sel.view(shape).expand(*[x.shape[i] if i != d else n for i in range(x.dim())])
        x = x.gather(d, idx)
    return x


def renumber(name: str, x: Tensor, sel: Tensor, dims: tuple, length: int) -> Tensor:
    """An integer input along the prompt: positions / cache indices ``0..L-1`` become ``0..n-1``;
    a 0/1 attention mask is gathered; anything else is refused (never guessed)."""
    if len(dims) == 1:
        d = dims[0]
        ar = torch.arange(length, device=x.device)
        shape = [1] * x.dim()
        shape[d] = length
        if bool((x == ar.view(shape)).all()):
            shape[d] = sel.shape[1]
            return (
                torch.arange(sel.shape[1], device=x.device, dtype=x.dtype)
                .view(shape)
                .expand(*[s if i != d else sel.shape[1] for i, s in enumerate(x.shape)])
                .contiguous()
            )
    if bool(((x == 0) | (x == 1)).all()):
        return take(x, sel, dims)
    raise RuntimeError(
        f"kvpass gate: the second prefill cannot tell what input '{name}' is (neither "
        f"positions 0..L-1 nor a 0/1 mask; left-padded positions are not supported)"
    )


def masked_positions(mask, b: int, length: int, device) -> Tensor:
    pos = torch.arange(length, device=device).expand(b, length)
    valid = _runtime.key_validity(mask, b, length)
    return pos if valid is None else torch.where(valid, pos, torch.full_like(pos, -1))
