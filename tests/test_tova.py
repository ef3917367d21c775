"""``tova`` against a plain-Python reference of the paper's rule: a layer over its budget drops the entry the
latest query attends to least, the attention averaged over the layer's heads (or per KV head with
``per_head=True``); the newest token stays; padding goes first, the later entry on a tie. The conformance loop
(``tests/conformance.py``) checks the rest: no-op = ``full``, bytes, resets, SlotCache = DynamicCache, left
padding."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpass.policies import Refusal, make_policy
from test_h2o import attention_received

SITE = SimpleNamespace(softcap=0.0, layer=0, sliding_window=0, cache="dynamic", phase="decode", tp=None)


def reference_keep(score, kv_pos, budget):
    """Ascending kept indices of one row: the newest real entry, then the best scores (ties: the earlier
    entry), padding last."""
    n = len(kv_pos)
    if n <= budget:
        return list(range(n))
    real = [j for j in range(n) if kv_pos[j] >= 0]
    rest = sorted(real[:-1], key=lambda j: (-score[j], j))
    pads = [j for j in range(n) if kv_pos[j] < 0]
    return sorted(([real[-1]] + rest + pads)[:budget])


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(3, 30),
    budget=st.integers(2, 24),
    per_head=st.booleans(),
    group=st.sampled_from([1, 2]),
    pad=st.integers(0, 3),
    prefill=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_keeps_what_the_latest_query_attends_to_most(n, budget, per_head, group, pad, prefill, seed):
    """A prompt (every query given, only the last counts) or a decode step on a full layer (one query over
    ``budget + 1`` entries): the entries kept are the reference's, in order, for every row and KV head; with
    heads averaged every head keeps the same entries."""
    policy = make_policy("tova", budget=budget, per_head=per_head)
    g = torch.Generator().manual_seed(seed)
    b, hkv, d = 2, 2, 8
    n = n if prefill else budget + 1
    pad = min(pad, n - 1)
    lq = n if prefill else 1
    q = torch.randn(b, hkv * group, lq, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    kv_pos[1, :, :pad] = -1  # row 1 left-padded
    q_pos = torch.arange(n - lq, n).expand(b, lq)
    state = None if prefill else SimpleNamespace(extra={"score": torch.zeros(b, hkv, n - 1)})
    keep, book = policy.select(SITE, q, k, k, kv_pos, q_pos, state)
    got = attention_received(q[:, :, -1:], k, kv_pos, q_pos[:, -1:])
    for row in range(b):
        score = {(gg, j): got.get((row, gg, j), 0.0) for gg in range(hkv) for j in range(n)}
        mean = {j: sum(score[(gg, j)] for gg in range(hkv)) / hkv for j in range(n)}
        for gg in range(hkv):
            per = mean if not per_head else {j: score[(gg, j)] for j in range(n)}
            pos = kv_pos[row, gg].tolist()
            want = reference_keep(per, pos, budget)
            have = list(range(n)) if keep is None else keep[row, gg].tolist()
            # which padding entry stays is no decision (none is visible): the real ones and the count are
            assert len(have) == len(want) and [j for j in have if pos[j] >= 0] == [j for j in want if pos[j] >= 0], (
                row,
                gg,
                have,
                want,
            )


def test_heads_averaged_refuse_a_tensor_parallel_site():
    """Averaged over a layer's heads, the decision needs every rank's heads: refused by name, with the fix;
    each head alone runs."""
    site = SimpleNamespace(**{**vars(SITE), "tp": object()})
    why = make_policy("tova").plan(site)
    assert isinstance(why, Refusal) and "per_head=True" in why.reason
    assert not isinstance(make_policy("tova", per_head=True).plan(site), Refusal)
