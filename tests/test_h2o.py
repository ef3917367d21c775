"""``h2o`` against a plain-Python reference of the paper's greedy rule: every entry accumulates the
attention it receives (summed over the queries and the query heads of its KV group), the ``recent`` latest
tokens stay, and a layer over its budget drops the least-attended older entry (padding first; on a tie the
later one). The conformance loop (``tests/conformance.py``) checks the rest: no-op = ``full``, bytes, resets,
SlotCache = DynamicCache, left padding."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvpass.policies.h2o import H2O

SITE = SimpleNamespace(softcap=0.0, layer=0, sliding_window=0)


def attention_received(q, k, kv_pos, q_pos):
    """``{(b, g, j): attention key j of KV head g received}`` from every query, by explicit loops."""
    b_, h, lq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    out = {}
    for b in range(b_):
        for head in range(h):
            g = head // (h // hkv)
            for i in range(lq):
                seen = [j for j in range(n) if 0 <= kv_pos[b, g, j] <= q_pos[b, i]]
                if not seen:
                    continue
                logits = {j: float(q[b, head, i] @ k[b, g, j]) for j in seen}
                top = max(logits.values())
                z = sum(math.exp(v - top) for v in logits.values())
                for j in seen:
                    out[(b, g, j)] = out.get((b, g, j), 0.0) + math.exp(logits[j] - top) / z
    return out


def reference_keep(acc, kv_pos, budget, recent):
    """Ascending kept indices of one (b, g) row: the last ``recent`` real entries, then the best scores
    (ties: the earlier entry), padding last."""
    n = len(kv_pos)
    real = [j for j in range(n) if kv_pos[j] >= 0]
    forced = set(real[-recent:])
    rest = sorted((j for j in real if j not in forced), key=lambda j: (-acc[j], j))
    pads = [j for j in range(n) if kv_pos[j] < 0]
    return sorted((sorted(forced) + rest + pads)[:budget]) if n > budget else list(range(n))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(4, 40),
    budget=st.integers(2, 24),
    heavy=st.sampled_from([0.0, 0.25, 0.5, 0.75]),
    group=st.sampled_from([1, 2]),
    pad=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_prefill_keeps_the_heavy_hitters_and_the_recent_tokens(n, budget, heavy, group, pad, seed):
    assume(budget - round(heavy * budget) >= 1)  # at least one recent entry (else a ConfigError)
    policy = H2O(budget=budget, heavy=heavy)
    g = torch.Generator().manual_seed(seed)
    b, hkv, d = 2, 2, 8
    q = torch.randn(b, hkv * group, n, d, generator=g) * 0.7
    k = torch.randn(b, hkv, n, d, generator=g)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    kv_pos[1, :, : min(pad, n - 1)] = -1  # row 1 left-padded
    q_pos = torch.arange(n).expand(b, n).contiguous()
    keep, book = policy.select(SITE, q, k, k, kv_pos, q_pos, None)
    acc = attention_received(q, k, kv_pos, q_pos)
    for bb in range(b):
        for gg in range(hkv):
            row = [acc.get((bb, gg, j), 0.0) for j in range(n)]
            want = reference_keep(row, kv_pos[bb, gg].tolist(), budget, policy.recent)
            got = list(range(n)) if keep is None else keep[bb, gg].tolist()
            assert got == want
            torch.testing.assert_close(
                book["score"][bb, gg], torch.tensor([row[j] for j in want]), atol=1e-5, rtol=1e-5
            )


def test_decode_steps_evict_one_least_attended_older_entry_each():
    """Ten decode steps after a 12-token prompt at budget 8 (4 heavy + 4 recent): each step's kept positions
    are the reference's, whose scores carry over from step to step."""
    policy = H2O(budget=8, heavy=0.5)
    g = torch.Generator().manual_seed(3)
    d, total = 8, 22
    qs, ks = torch.randn(1, 2, total, d, generator=g), torch.randn(1, 1, total, d, generator=g)
    # the prefill
    kv_pos = torch.arange(12).view(1, 1, 12)
    keep, book = policy.select(SITE, qs[:, :, :12], ks[:, :, :12], None, kv_pos, torch.arange(12).view(1, 12), None)
    held = keep[0, 0].tolist()
    ref = {j: s for j, s in zip(held, book["score"][0, 0].tolist())}
    state = SimpleNamespace(extra=book)
    for t in range(12, total):
        kv_pos = torch.tensor(held + [t]).view(1, 1, -1)
        k = ks[:, :, kv_pos[0, 0]]
        keep, book = policy.select(SITE, qs[:, :, t : t + 1], k, None, kv_pos, torch.tensor([[t]]), state)
        state = SimpleNamespace(extra=book)
        # the reference: the new token's attention over what is held, then one greedy eviction
        for h in range(2):
            s = {p: float(qs[0, h, t] @ ks[0, 0, p]) for p in held + [t]}
            top = max(s.values())
            z = sum(math.exp(v - top) for v in s.values())
            for p in s:
                ref[p] = ref.get(p, 0.0) + math.exp(s[p] - top) / z
        held = held + [t]
        if len(held) > 8:
            old = [p for p in held if p <= t - 4]
            victim = min(old, key=lambda p: (ref[p], -p))
            held.remove(victim)
            del ref[victim]
        got = kv_pos[0, 0].tolist() if keep is None else kv_pos[0, 0, keep[0, 0]].tolist()
        assert got == held, f"step {t}"
        torch.testing.assert_close(book["score"][0, 0], torch.tensor([ref[p] for p in held]), atol=1e-5, rtol=1e-5)
