"""The prefill eviction scorers against plain-Python references, without a model.

* ``kvpass::window_scores`` (the votes) against a one-row-at-a-time softmax, over lengths, window
  sizes, GQA ratios, padding and softcapping;
* ``snapkv`` / ``pyramidkv`` / ``chunkkv`` / ``sablock`` ``select`` against their references
  (``tests/eviction_reference.py``) over lengths, budgets, windows, GQA ratios and left padding:
  the same kept indices, exactly ``budget`` per layer and KV head, the window always kept, padding
  never kept over a real token;
* PyramidKV's schedule; SABlock's block search behaviour (larger blocks under larger budgets,
  token-level selection under tiny ones, order inside a segment preserved);
* punctuation ids from a tokenizer, configuration errors, ``opcheck`` of ``compact`` with tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpass
from eviction_reference import chunkkv_naive, fill_naive, sablock_naive, sablock_row, snapkv_naive, votes_naive
from kvpass.cache import runtime
from kvpass.kernels.window_scores import window_scores_reference
from kvpass.policies import make_policy
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.pyramidkv import pyramid
from kvpass.policies.prefill.sablock import block_search, choose, segments

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GQA = [(1, 1), (2, 1), (4, 2), (6, 2), (4, 4)]


def site(layer=0, layers=(0,), softcap=0.0):
    return SimpleNamespace(
        layer=layer,
        scale=0.25,
        softcap=softcap,
        sliding_window=None,
        cache="dynamic",
        phase="prefill",
        global_layers=layers,
        tokens=None,
    )


def prefill(b, h, hkv, n, pads, seed, d=8):
    """q/k of a prefill with left padding `pads[b]` per row, true positions as the runtime gives them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g) * 0.5  # compact receives q with the scale folded in
    k = torch.randn(b, hkv, n, d, generator=g)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    for bi, p in enumerate(pads):
        kv_pos[bi, :, :p] = -1
    return q, k, kv_pos, torch.arange(n).expand(b, n).contiguous()


def check_kept(keep, kv_pos, budget, window):
    """Exactly `budget` ascending entries per row and head, the last `window` real ones among them,
    and no padding while real tokens are left out."""
    assert keep.shape == kv_pos.shape[:2] + (budget,)
    assert (keep.diff(dim=-1) > 0).all()
    for bi in range(kv_pos.shape[0]):
        for g in range(kv_pos.shape[1]):
            real = [j for j in range(kv_pos.shape[-1]) if kv_pos[bi, g, j] >= 0]
            kept = set(keep[bi, g].tolist())
            assert set(real[-window:]) <= kept
            assert len(kept & set(real)) == min(len(real), budget)


shapes = st.tuples(
    st.integers(1, 2),
    st.sampled_from(GQA),
    st.integers(2, 60),
    st.integers(1, 12),
    st.lists(st.integers(0, 15), min_size=2, max_size=2),
)


@SETTINGS
@given(shape=shapes, softcap=st.sampled_from([0.0, 2.0]), seed=st.integers(0, 10_000))
def test_window_scores_reference_is_per_row_softmax(shape, softcap, seed):
    b, (h, hkv), n, w, pads = shape
    w = min(w, n)
    q, k, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], seed)
    got = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 0.3, softcap)
    want = votes_naive(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 0.3, softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # every window query that sees a key spends exactly one unit of attention
    seen = ((kv_pos[:, :1, None, :] >= 0) & (kv_pos[:, :1, None, :] <= q_pos[:, None, -w:, None])).any(-1)
    torch.testing.assert_close(got.sum(-1), seen.sum(-1).double().expand(b, hkv).float() * (h // hkv))


@SETTINGS
@given(
    shape=shapes,
    budget=st.integers(2, 50),
    kernel=st.sampled_from([1, 3, 7]),
    mode=st.sampled_from(["max", "avg"]),
    seed=st.integers(0, 10_000),
)
def test_snapkv_select_equals_reference(shape, budget, kernel, mode, seed):
    b, (h, hkv), n, window, pads = shape
    window = min(window, budget - 1) if budget > 1 else 1
    budget = max(budget, window + 1)
    pol = make_policy("snapkv", budget=budget, window=window, kernel=kernel, pool=mode)
    q, k, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], seed)
    keep = pol.select(site(), q, k, None, kv_pos, q_pos, None)
    if n <= budget:
        assert keep is None  # kept whole: the no-op that equals full
        return
    check_kept(keep, kv_pos, budget, window)
    w = min(window, n)
    votes = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 1.0)
    assert keep.tolist() == snapkv_naive(votes, kv_pos, window, budget, kernel, mode)


@SETTINGS
@given(
    shape=shapes,
    budget=st.integers(8, 40),
    layers=st.integers(1, 6),
    steep=st.sampled_from([1, 4, 20]),
    seed=st.integers(0, 10_000),
)
def test_pyramidkv_select_is_snapkv_at_the_layer_budget(shape, budget, layers, steep, seed):
    b, (h, hkv), n, window, pads = shape
    window = min(window, budget - 1)
    pol = make_policy("pyramidkv", budget=budget, window=window, steepness=steep)
    budgets = pyramid(budget, window, layers, steep)
    q, k, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], seed)
    w = min(window, n)
    votes = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 1.0)
    for layer in range(layers):
        s = site(layer=2 * layer, layers=tuple(range(0, 2 * layers, 2)))  # sliding layers in between
        assert pol.layer_budget(s) == budgets[layer]
        assert pol.stored_length(s, n) == (n if n <= budget else min(n, budgets[layer]))
        keep = pol.select(s, q, k, None, kv_pos, q_pos, None)
        if n <= budgets[layer] or n <= budget:  # prompts within the mean budget are kept whole
            assert keep is None
            continue
        check_kept(keep, kv_pos, budgets[layer], window)
        assert keep.tolist() == snapkv_naive(votes, kv_pos, window, budgets[layer])


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(2, 5000), window=st.integers(1, 64), n=st.integers(1, 80), steep=st.integers(1, 40))
def test_pyramid_schedule(budget, window, n, steep):
    """Mean exactly `budget`, non-increasing with depth, every layer keeps more than its window."""
    if budget <= window:
        return
    b = pyramid(budget, window, n, steep)
    assert len(b) == n and sum(b) == n * budget
    assert all(x >= y for x, y in zip(b, b[1:])) and min(b) > window
    if n > 1 and steep > 1 and budget - window >= 2:
        assert b[0] > budget > b[-1]


@SETTINGS
@given(shape=shapes, budget=st.integers(2, 50), chunk=st.sampled_from([1, 3, 10]), seed=st.integers(0, 10_000))
def test_chunkkv_select_equals_reference(shape, budget, chunk, seed):
    b, (h, hkv), n, window, pads = shape
    window = min(window, budget - 1) if budget > 1 else 1
    budget = max(budget, window + 1)
    pol = make_policy("chunkkv", budget=budget, window=window, chunk=chunk)
    q, k, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], seed)
    keep = pol.select(site(), q, k, None, kv_pos, q_pos, None)
    if n <= budget:
        assert keep is None
        return
    check_kept(keep, kv_pos, budget, window)
    assert (keep == keep[:, :1]).all()  # one index set shared by every KV head
    w = min(window, n)
    votes = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 1.0)
    assert keep[:, 0].tolist() == chunkkv_naive(votes, kv_pos, window, budget, chunk)


PUNCT = (3, 7)


@SETTINGS
@given(
    shape=shapes,
    budget=st.integers(2, 50),
    lam=st.sampled_from([0.0, 0.7, 1.0]),
    beta=st.sampled_from([0.0, 1.0, 5.0]),
    eps=st.sampled_from([0.0, 0.01, 0.5]),
    theta=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    density=st.sampled_from([0.05, 0.2, 0.5]),
    seed=st.integers(0, 10_000),
)
def test_sablock_select_equals_reference(shape, budget, lam, beta, eps, theta, density, seed):
    b, (h, hkv), n, window, pads = shape
    window = min(window, budget - 1) if budget > 1 else 1
    budget = max(budget, window + 1)
    pol = make_policy(
        "sablock",
        budget=budget,
        window=window,
        lam=lam,
        beta=beta,
        epsilon=eps,
        theta=theta,
        punctuation_ids=list(PUNCT),
    )
    q, k, kv_pos, q_pos = prefill(b, h, hkv, n, [min(p, n - 1) for p in pads[:b]], seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.where(
        torch.rand(b, n, generator=g) < density,
        torch.tensor(PUNCT[seed % 2]),
        torch.randint(10, 50, (b, n), generator=g),
    )
    keep = pol.select(site(), q, k, None, kv_pos, q_pos, None, tokens=tokens)
    if n <= budget:
        assert keep is None
        return
    check_kept(keep, kv_pos, budget, window)
    w = min(window, n)
    votes = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 1.0) / (h // hkv)
    assert keep.tolist() == sablock_naive(votes, kv_pos, tokens, PUNCT, window, budget, lam, beta, eps, theta)


@SETTINGS
@given(
    n=st.integers(1, 70),
    sizes=st.sampled_from([1, 2, 5, 9]),
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(0, 69), max_size=6),
)
def test_block_fill_equals_reference(n, sizes, seed, cuts):
    """Blocks cut per segment, best blocks first, the last trimmed: exactly the quota per segment."""
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(2, n, generator=g, dtype=torch.float64) ** 3
    punct = torch.zeros(2, n, dtype=torch.bool)
    punct[:, [c for c in cuts if c < n]] = True
    cand = torch.ones(2, n, dtype=torch.bool)
    cand[1, : n // 3] = False  # a padded row
    seg = segments(cand, punct)
    quota = torch.zeros(2, n, dtype=torch.long)
    for r in range(2):
        for s in range(int(seg[r].max()) + 1):
            size = int((seg[r] == s).sum())
            quota[r, s] = torch.randint(0, size + 1, (1,), generator=g).item()
    chosen = scoring.block_fill(score, seg, sizes, quota)
    for r in range(2):
        for s in range(int(seg[r].max()) + 1):
            members = (seg[r] == s).nonzero().flatten().tolist()
            want = fill_naive(score[r].tolist(), members, sizes, int(quota[r, s]))
            assert (
                chosen[r].nonzero().flatten()[torch.isin(chosen[r].nonzero().flatten(), torch.tensor(members))].tolist()
                == want
            )
    assert not chosen[~cand].any()


# ----------------------------------------------------------------------------------------------
# SABlock's block search: the behaviour the paper states
# ----------------------------------------------------------------------------------------------


def one_segment(n=40, seed=0, spikes=(3, 17, 31)):
    """One 40-token segment: low background, a few strong tokens far apart, a smooth bump."""
    g = torch.Generator().manual_seed(seed)
    s = 0.01 + 0.02 * torch.rand(1, n, generator=g, dtype=torch.float64)
    s[0, list(spikes)] = 1.0
    s[0, 20:26] += 0.3
    return s, torch.zeros(1, n, dtype=torch.long)


def test_larger_budgets_choose_larger_blocks():
    s, seg = one_segment()
    sizes = []
    for quota in (1, 2, 3, 10, 20, 30, 40):
        _, size = block_search(s, seg, torch.tensor([[quota] + [0] * 39]), theta=0.9)
        sizes.append(int(size[0, 0]))
    assert sizes == sorted(sizes), sizes  # never smaller blocks for a larger budget
    assert sizes[0] == 1 and sizes[-1] == 9, sizes


def test_tiny_budgets_select_token_level():
    """With quotas of a few tokens, blocks cannot hold the spikes together: token-level top-b."""
    s, seg = one_segment()
    for quota in (1, 2, 3):
        chosen, size = block_search(s, seg, torch.tensor([[quota] + [0] * 39]), theta=0.9)
        assert int(size[0, 0]) == 1
        assert chosen[0].nonzero().flatten().tolist() == sorted([3, 17, 31][:quota])


def test_segment_weight_preserves_order_inside_segments():
    """Adjusted scores keep the order of raw scores inside every segment, and kept entries keep
    their original order in the cache."""
    g = torch.Generator().manual_seed(5)
    s = torch.rand(3, 2, 80, generator=g) ** 4
    punct = torch.rand(3, 1, 80, generator=g) < 0.15
    cand = torch.ones(3, 2, 80, dtype=torch.bool)
    cand[..., -8:] = False
    chosen, info = choose(s, cand, punct, 30, lam=0.7, beta=3.0, epsilon=0.01, theta=0.9)
    seg, adj = info["segments"], info["adjusted"]
    for idx in torch.cartesian_prod(torch.arange(3), torch.arange(2)).tolist():
        x, a, sg = s[idx[0], idx[1]].double(), adj[idx[0], idx[1]], seg[idx[0], idx[1]]
        for v in sg.unique().tolist():
            if v < 0:
                continue
            m = sg == v
            assert torch.equal(torch.argsort(x[m], stable=True), torch.argsort(a[m], stable=True))
    assert int(chosen.sum(-1).min()) == int(chosen.sum(-1).max()) == 30


def test_block_search_row_reference_agrees_on_sizes():
    """The reference's accepted size per segment equals the implementation's."""
    g = torch.Generator().manual_seed(9)
    s = (torch.rand(1, 1, 120, generator=g) ** 3).double()
    punct = torch.rand(1, 1, 120, generator=g) < 0.08
    cand = torch.ones(1, 1, 120, dtype=torch.bool)
    chosen, info = choose(s, cand, punct, 50, 0.7, 1.0, 0.01, 0.9)
    want, detail = sablock_row(
        s[0, 0].tolist(), list(range(120)), set(punct[0, 0].nonzero().flatten().tolist()), 50, 0.7, 1.0, 0.01, 0.9
    )
    assert chosen[0, 0].nonzero().flatten().tolist() == want
    want_sizes = [size for _, size in detail["segments"].values()]
    assert [int(info["size"][0, i]) for i in range(len(want_sizes))] == want_sizes
    assert [int(info["quota"][0, i]) for i in range(len(want_sizes))] == [b for b, _ in detail["segments"].values()]
    assert len(set(want_sizes)) > 1, "the case should mix block sizes"


# ----------------------------------------------------------------------------------------------
# punctuation ids, configuration, opcheck of compact with tokens
# ----------------------------------------------------------------------------------------------


def tiny_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {
        "<pad>": 0,
        "<s>": 1,
        "</s>": 2,
        "hello": 3,
        ".": 4,
        ",": 5,
        "\n": 6,
        "end.": 7,
        "\u3002": 8,
        "x:": 9,
        "a.b": 10,
        "?!  ": 11,
        "\uff0c": 12,
        ".x": 13,
        "<sep.>": 14,
        ";\n ": 15,
    }
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", additional_special_tokens=["<sep.>"]
    )


def test_punctuation_from_tokenizer():
    pol = make_policy("sablock", budget=64, tokenizer=tiny_tokenizer())
    assert pol.punctuation_ids == (4, 5, 6, 7, 8, 9, 11, 12, 15)  # not 'a.b', '.x', nor the special '<sep.>'
    assert isinstance(pol.config["tokenizer"], str)  # the config stays printable and hashable
    both = make_policy("sablock", budget=64, tokenizer=tiny_tokenizer(), punctuation_ids=[4])
    assert both.punctuation_ids == (4,) and isinstance(both.config["tokenizer"], str)  # explicit ids win
    explicit = make_policy("sablock", budget=64, punctuation_ids="4, 5,6")
    assert explicit.punctuation_ids == (4, 5, 6)
    assert make_policy("sablock", budget=64, punctuation_ids=[6, 4, 4]).punctuation_ids == (4, 6)
    assert make_policy("sablock", budget=64, punctuation_ids=13).punctuation_ids == (13,)  # --param x=13


@pytest.mark.parametrize(
    "policy,params,fragments",
    [
        ("snapkv", dict(budget=32), ["'budget' must be > window (32)", "got 32", "the budget includes the window"]),
        ("chunkkv", dict(budget=8, window=8), ["'budget' must be > window (8)"]),
        ("pyramidkv", dict(budget=1), ["'budget' must be int in [2, 16777216]", "got 1"]),
        ("snapkv", dict(budget=64, kernel=4), ["'kernel' must be an odd int in [1, 1025]", "got 4"]),
        ("snapkv", dict(budget=64, pool="mean"), ["'pool' must be 'max' or 'avg'", "got 'mean'"]),
        ("pyramidkv", dict(budget=64, steepness=0), ["'steepness' must be int in [1, 1048576]"]),
        ("chunkkv", dict(budget=64, chunk=0), ["'chunk' must be int in [1, 65536]"]),
        ("sablock", dict(budget=64), ["needs the model's punctuation token ids", "tokenizer=", "punctuation_ids="]),
        ("sablock", dict(budget=64, tokenizer="gpt2"), ["'tokenizer' must be a Hugging Face tokenizer", "got str"]),
        ("sablock", dict(budget=64, punctuation_ids=[1, -2]), ["'punctuation_ids' must be a list of ints >= 0"]),
        ("sablock", dict(budget=64, punctuation_ids="1,a"), ["'punctuation_ids' must be a list of ints"]),
        ("sablock", dict(budget=64, punctuation_ids=[1], theta=1.5), ["'theta' must be float in [0.0, 1.0]"]),
        ("sablock", dict(budget=64, punctuation_ids=[1], lam=-0.1), ["'lam' must be float in [0.0, 1.0]"]),
        ("snapkv+sablock", dict(budget=64, punctuation_ids=[1]), ["snapkv and sablock both evict"]),
        (
            "knorm",
            dict(budget=8, window=8),
            ["'budget' must be > window (8)", "got 8", "the budget includes the window"],
        ),
        ("keydiff", dict(budget=4, window=9), ["'budget' must be > window (9)", "got 4"]),
        ("knorm", dict(budget=1), ["'budget' must be int in [2, 16777216]", "got 1"]),
        ("keydiff", dict(window=-1), ["'window' must be int in [0, 65536]", "got -1"]),
        ("knorm", dict(window=1 << 17), ["'window' must be int in [0, 65536]"]),
        ("keydiff", dict(budget=64.0), ["'budget' must be int", "got float"]),
        ("knorm", dict(kernel=3), ["'kernel'", "budget", "window"]),
        ("knorm+keydiff", dict(budget=64), ["knorm and keydiff both evict"]),
        (
            "criticalkv",
            dict(scorer="h2o"),
            ["'scorer' must be one of snapkv, expected_attention, knorm, keydiff", "got 'h2o'"],
        ),
        ("criticalkv", dict(scorer=3), ["'scorer' must be str", "got int 3"]),
        ("criticalkv", dict(budget=32), ["scorer 'snapkv'", "'budget' must be > window (32)", "got 32"]),
        ("criticalkv", dict(window=0), ["scorer 'snapkv'", "'window' must be int in [1, 65536]", "got 0"]),
        ("criticalkv", dict(scorer="expected_attention", budget=6, window=2), ["(4 + 2)", "got 6"]),
        ("criticalkv", dict(window=-2), ["'window' must be int in [-1, 65536]", "got -2"]),
        ("criticalkv", dict(first_stage_ratio=1.5), ["'first_stage_ratio' must be float in [0.0, 1.0]", "got 1.5"]),
        ("criticalkv", dict(epsilon=-1e-3), ["'epsilon' must be float in [0.0, inf]", "got -0.001"]),
        ("criticalkv", dict(kernel=3), ["has no parameter 'kernel'", "first_stage_ratio", "scorer"]),
        ("expected_attention", dict(budget=4), ["'budget' must be > n_sink + window (4 + 0)", "got 4"]),
        ("expected_attention", dict(budget=10, n_sink=4, window=6), ["(4 + 6)", "got 10"]),
        ("expected_attention", dict(n_sink=-1), ["'n_sink' must be int in [0, 65536]", "got -1"]),
        (
            "expected_attention",
            dict(n_future_positions=0),
            ["'n_future_positions' must be int in [1, 1048576]", "got 0"],
        ),
        ("expected_attention", dict(epsilon=-0.5), ["'epsilon' must be float in [0.0, inf]", "got -0.5"]),
        ("expected_attention", dict(use_covariance=1), ["'use_covariance' must be bool", "got int 1"]),
        ("expected_attention", dict(use_vnorm="yes"), ["'use_vnorm' must be bool", "got str"]),
        ("expected_attention", dict(window=-1), ["'window' must be int in [0, 65536]"]),
        ("expected_attention", dict(kernel=7), ["has no parameter 'kernel'", "n_future_positions"]),
    ],
)
def test_configuration_errors(policy, params, fragments):
    before = dict(runtime._RUNTIMES)
    with pytest.raises(kvpass.ConfigError) as err:
        kvpass.backend(policy, **params)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert runtime._RUNTIMES == before


def test_sablock_plan_needs_token_ids():
    pol = make_policy("sablock", budget=64, punctuation_ids=[1])
    s = site()
    assert "needs its token ids" in pol.plan(s).reason
    s.tokens = object()
    plan = pol.plan(s)
    assert plan.evict and plan.tokens
    s.sliding_window = 8
    assert not pol.plan(s).evict


def test_opcheck_compact_with_tokens():
    be = kvpass.backend("sablock", compiler="eager", budget=8, window=3, punctuation_ids=[5])
    be.runtime.sites[0] = site()
    gen = torch.Generator().manual_seed(1)
    k_new, v_new = torch.randn(2, 2, 14, 8, generator=gen), torch.randn(2, 2, 14, 8, generator=gen)
    q = torch.randn(2, 4, 14, 8, generator=gen)
    tokens = torch.randint(3, 9, (2, 14), generator=gen)
    empty = torch.tensor([])
    k, v, kv_pos, q_pos = torch.ops.kvpass.cache_update(empty, empty, k_new, v_new, None, be.runtime.handle, 0)
    torch.library.opcheck(torch.ops.kvpass.compact.default, (q, k, v, kv_pos, q_pos, be.runtime.handle, 0, tokens))
    k_st, _ = torch.ops.kvpass.compact(q, k, v, kv_pos, q_pos, be.runtime.handle, 0, tokens)
    assert k_st.shape == (2, 2, 8, 8) and be.state.layer(0).pos.shape == (2, 2, 8)
