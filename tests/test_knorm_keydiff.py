"""``knorm`` and ``keydiff`` against references written here, one entry at a time in float64, without a model.

* the scores: ``knorm`` minus each key's L2 norm; ``keydiff`` minus each key's cosine similarity to the mean of
  the unit-length keys of the row's real tokens (per KV head);
* ``select`` keeps the reference's choice: the last ``window`` real entries, then the best scores, ties to the
  earlier entry, padding last, ascending, exactly ``budget`` per row and KV head; a prompt within the budget is
  kept whole (``None``, the no-op that equals ``full``);
* with no window and no padding, the choice is the top-k of kvpress's formulas for the same scores;
* a left-padded row keeps what the same prompt keeps alone, whatever the padding's keys.

The conformance loop (``tests/conformance.py``) runs both on the model: no-op = ``full``, bytes, resets,
SlotCache = DynamicCache, a left-padded batch; ``tests/test_eviction_scoring.py`` their configuration errors.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpass.policies import make_policy
from kvpass.policies.prefill import scoring

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SITE = SimpleNamespace(
    layer=0,
    softcap=0.0,
    sliding_window=None,
    cache="dynamic",
    phase="prefill",
    global_layers=(0,),
    tokens=None,
    tp=None,
)
GQA = [(1, 1), (2, 1), (4, 2), (4, 4)]


def knorm_reference(key: list[float], real_keys: list[list[float]]) -> float:
    """Minus the key's Euclidean length."""
    return -math.sqrt(sum(x * x for x in key))


def keydiff_reference(key: list[float], real_keys: list[list[float]]) -> float:
    """Minus the cosine of the key with the anchor: the mean of the real keys, each divided by its length."""

    def unit(v):
        n = math.sqrt(sum(x * x for x in v))
        return [x / n for x in v] if n > 0 else [0.0] * len(v)

    units = [unit(v) for v in real_keys]
    anchor = [sum(u[i] for u in units) / len(units) for i in range(len(key))]
    na, nk = math.sqrt(sum(x * x for x in anchor)), math.sqrt(sum(x * x for x in key))
    if na == 0 or nk == 0:
        return 0.0
    return -sum(a * b for a, b in zip(anchor, key)) / (na * nk)


REFERENCES = {"knorm": knorm_reference, "keydiff": keydiff_reference}


def reference_keep(policy: str, keys, pos: list[int], window: int, budget: int) -> list[int]:
    """One row and KV head: ascending kept indices (the last `window` real entries, then real entries by score,
    the earlier on a tie, then padding)."""
    rows = keys.double().tolist()
    real = [j for j, p in enumerate(pos) if p >= 0]
    score = {j: REFERENCES[policy](rows[j], [rows[i] for i in real]) for j in real}
    forced = real[len(real) - window :] if window > 0 else []
    rest = sorted((j for j in real if j not in forced), key=lambda j: (-score[j], j))
    pads = [j for j, p in enumerate(pos) if p < 0]
    return sorted((forced + rest + pads)[:budget])


def make_keys(b, hkv, n, d, grid, repeats, seed):
    """Keys ``[b, hkv, n, d]``: standard normal, or small integers (``grid``: exact ties of norms); ``repeats``
    entries copied over others (exact ties for both scores)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-2, 3, (b, hkv, n, d), generator=g).float() if grid else torch.randn(b, hkv, n, d, generator=g)
    for _ in range(repeats):
        src, dst = torch.randint(0, n, (2,), generator=g).tolist()
        k[:, :, dst] = k[:, :, src]
    return k


def prefill(b, h, hkv, n, pads, k):
    """Queries (neither scorer reads them), true positions with ``pads[row]`` padding entries, query positions."""
    q = torch.randn(b, h, n, k.shape[-1], generator=torch.Generator().manual_seed(n))
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    for row, p in enumerate(pads):
        kv_pos[row, :, :p] = -1
    return q, kv_pos, torch.arange(n).expand(b, n).contiguous()


@SETTINGS
@given(
    policy=st.sampled_from(["knorm", "keydiff"]),
    b=st.integers(1, 2),
    heads=st.sampled_from(GQA),
    n=st.integers(2, 48),
    budget=st.integers(2, 40),
    window=st.integers(0, 6),
    pads=st.lists(st.integers(0, 12), min_size=2, max_size=2),
    grid=st.booleans(),
    repeats=st.integers(0, 4),
    seed=st.integers(0, 10_000),
)
def test_select_keeps_the_reference_top_k(policy, b, heads, n, budget, window, pads, grid, repeats, seed):
    """Per row and KV head the kept indices are the reference's, in order; exactly ``budget`` of them; a prompt
    within the budget is kept whole."""
    h, hkv = heads
    window = min(window, budget - 1)
    grid = grid and policy == "knorm"  # small-integer keys: exact norm ties (a cosine is never exact)
    k = make_keys(b, hkv, n, 8, grid, repeats, seed)
    q, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], k)
    keep = make_policy(policy, budget=budget, window=window).select(SITE, q, k, k, kv_pos, q_pos, None)
    if n <= budget:
        assert keep is None
        return
    assert keep.shape == (b, hkv, budget) and keep.dtype == torch.long
    for row in range(b):
        for g in range(hkv):
            want = reference_keep(policy, k[row, g], kv_pos[row, g].tolist(), window, budget)
            assert keep[row, g].tolist() == want, (row, g)


@SETTINGS
@given(
    policy=st.sampled_from(["knorm", "keydiff"]),
    n=st.integers(3, 40),
    budget=st.integers(2, 30),
    pad=st.integers(1, 10),
    window=st.integers(0, 3),
    lure=st.sampled_from(["zeros", "cluster", "noise"]),
    seed=st.integers(0, 10_000),
)
def test_left_padded_row_keeps_what_the_prompt_keeps_alone(policy, n, budget, pad, window, lure, seed):
    """A batch of two: row 0 the prompt after ``pad`` padding entries whose keys would lure a scorer that saw
    them (zero norm, many copies of one key pulling keydiff's mean, or loud noise), row 1 another prompt of the
    full length. Row 0 keeps the real entries the prompt keeps alone."""
    hkv, d = 2, 8
    window = min(window, budget - 1)
    g = torch.Generator().manual_seed(seed)
    alone = torch.randn(1, hkv, n, d, generator=g)
    filler = {
        "zeros": torch.zeros(1, hkv, pad, d),
        "noise": torch.randn(1, hkv, pad, d, generator=g) * 5,
        "cluster": torch.randn(1, hkv, 1, d, generator=g).expand(1, hkv, pad, d) * 3,
    }[lure]
    other = torch.randn(1, hkv, n + pad, d, generator=g)
    k = torch.cat([torch.cat([filler, alone], 2), other])
    q, kv_pos, q_pos = prefill(2, hkv, hkv, n + pad, [pad, 0], k)
    pol = make_policy(policy, budget=budget, window=window)
    both = pol.select(SITE, q, k, k, kv_pos, q_pos, None)
    solo = pol.select(
        SITE, q[:1, :, pad:], alone, alone, torch.arange(n).expand(1, hkv, n), torch.arange(n)[None], None
    )
    assert both is not None or n + pad <= budget
    for head in range(hkv):
        padded = list(range(n)) if both is None else [j - pad for j in both[0, head].tolist() if j >= pad]
        want = list(range(n)) if solo is None else solo[0, head].tolist()
        assert padded == want, (head, padded, want)


@pytest.mark.parametrize("policy", ["knorm", "keydiff"])
def test_without_window_or_padding_it_is_kvpress_top_k(policy):
    """Unpadded, ``window=0``: the kept set is the top ``budget`` of kvpress's score for the press of the same
    name (``-keys.norm(dim=-1)``; ``-cosine(keys, mean of the unit keys)``), per KV head."""
    g = torch.Generator().manual_seed(7)
    b, hkv, n, d, budget = 2, 4, 64, 16, 20
    k = torch.randn(b, hkv, n, d, generator=g) * torch.rand(b, hkv, n, 1, generator=g) * 3
    if policy == "knorm":
        score = -k.norm(dim=-1)
    else:
        score = -F.cosine_similarity(k, F.normalize(k, dim=-1).mean(dim=2, keepdim=True), dim=-1)
    want = score.topk(budget, dim=-1).indices.sort(dim=-1).values
    q, kv_pos, q_pos = prefill(b, hkv, hkv, n, [0] * b, k)
    keep = make_policy(policy, budget=budget).select(SITE, q, k, k, kv_pos, q_pos, None)
    assert torch.equal(keep, want)


def test_window_votes_of_no_window_are_zero():
    """``scoring.window_scores`` with a window of 0 gives no votes (not every query's, as ``q[:, :, -0:]``
    would)."""
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    kv_pos, q_pos = torch.arange(10).expand(2, 2, 10), torch.arange(10).expand(2, 10)
    votes = scoring.window_scores(SITE, q, k, kv_pos, q_pos, 0)
    assert votes.shape == (2, 2, 10) and votes.dtype == torch.float32 and not votes.any()


@pytest.mark.parametrize("policy", ["knorm", "keydiff"])
def test_defaults_and_window_zero_layout(policy):
    """The defaults: ``budget`` 2048 and no window, as kvpress's presses; the window layout forces nothing."""
    pol = make_policy(policy)
    assert pol.config == {"budget": 2048, "window": 0}
    kv_pos = torch.tensor([[[-1, -1, 0, 1, 2]]])
    valid, forced = scoring.window_layout(kv_pos, 0)
    assert valid.tolist() == [[[False, False, True, True, True]]] and not forced.any()
