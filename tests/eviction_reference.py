"""Plain-Python references of the prefill eviction scorers, written from their docstrings with loops.

They work on one row (one sequence and KV head) at a time, in float64, and share nothing with
``kvpass.policies.prefill.scoring`` except the window votes they are given (whose own reference,
``votes_naive``, is checked against the operator separately). Ties go to the earlier token or
block, as the policies document.
"""

from __future__ import annotations

import math

import torch


def votes_naive(q, k, kv_pos, q_pos, scale, softcap=0.0):
    """[B, H_kv, N] float64: softmax over visible keys per (head, window query), summed over the
    window queries and the group's heads, one query row at a time."""
    b, h, w, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = h // hkv
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            for i in range(w):
                vis = [j for j in range(n) if 0 <= int(kv_pos[bi, kv, j]) <= int(q_pos[bi, i])]
                if not vis:
                    continue
                s = (k[bi, kv, vis].double() @ q[bi, hi, i].double()) * scale
                if softcap > 0:
                    s = torch.tanh(s / softcap) * softcap
                out[bi, kv, vis] += torch.softmax(s, 0)
    return out


def votes_from_attentions(attentions, hkv: int, window: int):
    """Window votes [B, H_kv, N] from a layer's eager attention probabilities [B, H, N, N]."""
    b, h, _, n = attentions.shape
    return attentions[:, :, -window:, :].double().sum(2).reshape(b, hkv, h // hkv, n).sum(2)


def layout(pos: list[int], window: int) -> tuple[list[bool], list[bool]]:
    """(valid, forced) of one row: real entries, and the last `window` real ones."""
    valid = [p >= 0 for p in pos]
    real = [j for j, ok in enumerate(valid) if ok]
    last = set(real[-window:]) if window > 0 else set()
    return valid, [j in last for j in range(len(pos))]


def keep_order(priority: list[float], valid: list[bool], forced: list[bool], keep: int) -> list[int]:
    """Window, then real candidates by priority (descending), then padding; ties: earlier index."""

    def rank(j):
        tier = 0 if forced[j] else (1 if valid[j] else 2)
        return (tier, -priority[j] if tier == 1 else 0.0, j)

    return sorted(sorted(range(len(priority)), key=rank)[:keep])


def pool_naive(x: list[float], cand: list[bool], kernel: int, mode: str) -> list[float]:
    vals = [x[j] if cand[j] else 0.0 for j in range(len(x))]
    r = kernel // 2
    out = []
    for j in range(len(vals)):
        win = [vals[i] if 0 <= i < len(vals) else (None if mode == "max" else 0.0) for i in range(j - r, j + r + 1)]
        win = [v for v in win if v is not None]
        out.append(max(win) if mode == "max" else sum(win) / kernel)
    return out


def snapkv_naive(votes, kv_pos, window, keep, kernel=7, mode="max") -> list[list[list[int]]]:
    """Kept indices [B][H_kv] -> list."""
    out = []
    for bi in range(votes.shape[0]):
        rows = []
        for g in range(votes.shape[1]):
            pos = kv_pos[bi, g].tolist()
            valid, forced = layout(pos, window)
            cand = [v and not f for v, f in zip(valid, forced)]
            pri = pool_naive(votes[bi, g].double().tolist(), cand, kernel, mode)
            rows.append(keep_order(pri, valid, forced, keep))
        out.append(rows)
    return out


def fill_naive(scores: list[float], members: list[int], size: int, quota: int) -> list[int]:
    """Best blocks of `size` (cut from the first member) until `quota` tokens, last block trimmed."""
    blocks = [members[i : i + size] for i in range(0, len(members), size)]
    blocks.sort(key=lambda blk: (-sum(scores[j] for j in blk), blk[0]))
    chosen = []
    for blk in blocks:
        room = quota - len(chosen)
        if room <= 0:
            break
        chosen += sorted(blk, key=lambda j: (-scores[j], j))[:room]
    return sorted(chosen)


def chunkkv_naive(votes, kv_pos, window, keep, chunk=10) -> list[list[int]]:
    """Kept indices per batch row (shared by every KV head)."""
    out = []
    for bi in range(votes.shape[0]):
        pos = kv_pos[bi, 0].tolist()
        valid, forced = layout(pos, window)
        n = len(pos)
        if n <= keep:
            out.append(list(range(n)))
            continue
        score = votes[bi].double().sum(0).tolist()
        cand = [j for j in range(n) if valid[j] and not forced[j]]
        chosen = set(fill_naive(score, cand, chunk, keep - window))
        pri = [1.0 if j in chosen else 0.0 for j in range(n)]
        out.append(keep_order(pri, valid, forced, keep))
    return out


def sablock_row(
    s: list[float], cand: list[int], punct: set[int], quota: int, lam, beta, eps, theta, sizes=(9, 7, 5, 3, 1)
) -> tuple[list[int], dict]:
    """SABlock on one row: chosen candidates and, per segment (tuple of members), quota and size."""
    segs, cur = [], []
    for j in cand:
        cur.append(j)
        if j in punct:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    means = [sum(s[j] for j in seg) / len(seg) for seg in segs]
    best = max(means) if means and max(means) > 0 else 1.0
    weight, seg_mean = {}, {}
    for seg, mean in zip(segs, means):
        total = sum(s[j] for j in seg)
        n = len(seg)
        p = [(1 - eps) * (s[j] / total if total > 0 else 1.0 / n) + eps / n for j in seg]
        entropy = -sum(x * math.log(x) for x in p if x > 0)
        w = lam * (mean / best) + (1 - lam) * math.exp(entropy) / n
        for j in seg:
            weight[j], seg_mean[j] = w, mean
    adjusted = {j: s[j] + beta * weight[j] * seg_mean[j] for j in cand}
    top = set(sorted(cand, key=lambda j: (-adjusted[j], j))[:quota])
    chosen, detail = [], {}
    for seg in segs:
        b = sum(1 for j in seg if j in top)
        best_b = sum(s[j] for j in fill_naive(s, seg, 1, b))
        for size in sizes:
            if 1 < size and b < size:
                continue  # a block larger than the quota cannot be kept whole
            pick = fill_naive(s, seg, size, b)
            got = sum(s[j] for j in pick)
            if (got / best_b if best_b > 0 else 1.0) >= theta:
                break
        chosen += pick
        detail[tuple(seg)] = (b, size)
    return sorted(chosen), {"segments": detail, "adjusted": adjusted}


def sablock_naive(votes, kv_pos, tokens, punct_ids, window, keep, lam, beta, eps, theta) -> list[list[list[int]]]:
    """Kept indices [B][H_kv]; ``votes`` are already the mean over each group's heads."""
    out = []
    for bi in range(votes.shape[0]):
        rows = []
        punct = {j for j, t in enumerate(tokens[bi].tolist()) if t in set(punct_ids)}
        for g in range(votes.shape[1]):
            pos = kv_pos[bi, g].tolist()
            valid, forced = layout(pos, window)
            cand = [j for j in range(len(pos)) if valid[j] and not forced[j]]
            chosen, _ = sablock_row(votes[bi, g].double().tolist(), cand, punct, keep - window, lam, beta, eps, theta)
            chosen = set(chosen)
            pri = [1.0 if j in chosen else 0.0 for j in range(len(pos))]
            rows.append(keep_order(pri, valid, forced, keep))
        out.append(rows)
    return out
