"""``criticalkv`` against a reference written here in float64 (the paper's and kvpress's two stages), without the
graph, and the output projection the pass reads off compiled models.

* ``select`` keeps the reference's choice: the base scorer's forced entries and its best ``first_stage_ratio`` of
  the kept entries, then the highest ``(score + epsilon) * ||W_o^h v||_1`` (L1 norm of each query head's projection
  of the value, averaged over the KV group's heads), ties to the earlier entry, padding last, exactly ``budget`` per
  row and KV head; for random queries, keys, values and projections, GQA, left padding and every scorer (snapkv's
  window votes and knorm's norms computed here; keydiff's and expected_attention's scores are their policies',
  checked against their own references in their files); a prompt within the budget is kept whole;
* ``first_stage_ratio=1`` keeps the scorer's own choice; unpadded, with no forced entry, the choice is kvpress's
  ``CriticalKVPress.score`` formulas' top-k;
* compiled tiny models hand ``select`` the weight of each layer's output projection as the model holds it (Llama's
  ``o_proj`` under SDPA and eager attention, GPT-2's ``c_proj``, an ``addmm`` operand, transposed), and each layer
  keeps the reference's choice for the model's own keys, values and weight;
* a site whose output reaches something else than the projection first (a norm over the heads' outputs) is refused,
  the graph compiled unchanged with the reason; bad parameters: ``tests/test_eviction_scoring.py``.

The conformance loop (``tests/conformance.py``) runs it on the model: no-op = ``full``, bytes, resets, SlotCache =
DynamicCache, a left-padded batch.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvpass
from eviction_reference import pool_naive
from families import build
from kvpass.errors import _WARNED
from kvpass.kernels.window_scores import window_scores_reference
from kvpass.policies import make_policy
from kvpass.policies.prefill.criticalkv import CriticalKV

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GQA = [(1, 1), (2, 1), (4, 2), (4, 4)]
SITE = SimpleNamespace(
    layer=0,
    softcap=0.0,
    sliding_window=None,
    cache="dynamic",
    phase="prefill",
    global_layers=(0,),
    tokens=None,
    tp=None,
    q_rope=SimpleNamespace(cos=None, problem=None),
    o_proj=SimpleNamespace(weight="w", transposed=False, problem=None),
)
SINKS = 4  # expected_attention's default


# ---------------------------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------------------------


def norms_reference(v, w, heads: int):
    """``[H_kv, N]`` float64 for one row: per query head ``h``, its columns of the output projection
    ``w [hidden, heads * Dv]`` times each value ``v [H_kv, N, Dv]`` of its KV head, the L1 norm of that
    hidden-size vector, averaged over the heads of each KV group."""
    hkv, n, dv = v.shape
    group = heads // hkv
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for h in range(heads):
        w_h = w[:, h * dv : (h + 1) * dv].double()  # [hidden, Dv]
        for j in range(n):
            out[h // group, j] += (w_h @ v[h // group, j].double()).abs().sum() / group
    return out


def forced_of(scorer: str, real: list[int], window: int) -> set[int]:
    """The entries the scorer keeps whatever their score: its window's last real entries, expected_attention's
    first real ones (its sinks)."""
    forced = set(real[len(real) - window :]) if window else set()
    return forced | (set(real[:SINKS]) if scorer == "expected_attention" else set())


def reference_keep(
    base: dict, norm: dict, real: list[int], forced: set[int], n: int, budget: int, ratio: float, eps: float
) -> tuple[list[int], bool]:
    """One row and KV head: (the kept indices, whether a float near-tie sits at a cut). ``base`` and ``norm``: the
    scorer's score and the projected norm of each real entry. Stage 1: the forced entries, then real entries by
    score (the earlier on a tie), ``first`` in all; stage 2: the others by ``(score + eps) * norm``; padding last."""
    first = max(1, int(ratio * budget)) if ratio > 0 else 0
    by_base = sorted((j for j in real if j not in forced), key=lambda j: (-base[j], j))
    take = max(0, first - len(forced))
    stage1 = forced | set(by_base[:take])
    second = {j: (base[j] + eps) * norm[j] for j in real}
    rest = sorted((j for j in real if j not in stage1), key=lambda j: (-second[j], j))
    room = budget - len(stage1)
    pads = [j for j in range(n) if j not in real]
    kept = sorted((sorted(stage1) + rest + pads)[:budget])

    def near(values: list[float], cut: int) -> bool:
        if cut <= 0 or cut >= len(values):
            return False
        scale = max(abs(x) for x in values) + 1e-30
        return any(0 < abs(x - c) <= 1e-5 * scale for x in values for c in (values[cut - 1], values[cut]))

    return kept, near([base[j] for j in by_base], take) or near([second[j] for j in rest], room)


def make_prompt(b, h, hkv, n, d, hidden, pads, seed):
    """Queries (scaled), keys, values ``[b, *, n, d]`` with loud, varied value norms, an output projection
    ``[hidden, h * d]`` whose heads differ in gain, ``kv_pos`` with -1 on each row's ``pads`` leading entries and
    the query positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g) * d**-0.5
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g) * torch.rand(b, hkv, n, 1, generator=g) * 3
    w = torch.randn(hidden, h * d, generator=g) * torch.rand(1, h * d, generator=g)
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    for row, p in enumerate(pads):
        kv_pos[row, :, :p] = -1
    return q, k, v, w, kv_pos, torch.arange(n).expand(b, n).contiguous()


def base_scores(pol: CriticalKV, q, k, v, kv_pos, q_pos, window: int):
    """``[B, H_kv, N]`` float64 scores of the policy's scorer: snapkv's pooled window votes (the window scores'
    reference, pooled here) and knorm's minus key norm computed here; keydiff's and expected_attention's from the
    scorer itself (their files check them against references)."""
    b, hkv, n, _ = k.shape
    if pol.scorer == "knorm":
        return -k.double().norm(dim=-1)
    if pol.scorer == "snapkv":
        w = min(window, n)
        votes = window_scores_reference(q[:, :, -w:], k, kv_pos, q_pos[:, -w:], 1.0)
        out = torch.zeros(b, hkv, n, dtype=torch.float64)
        for row in range(b):
            for g in range(hkv):
                real = [j for j in range(n) if kv_pos[row, g, j] >= 0]
                forced = set(real[len(real) - window :])
                cand = [j in real and j not in forced for j in range(n)]
                out[row, g] = torch.tensor(pool_naive(votes[row, g].double().tolist(), cand, 7, "max"))
        return out
    return pol.base.ranking(SITE, q, k, v, kv_pos, q_pos, pol.budget)[0].double()


# ---------------------------------------------------------------------------------------------------------------
# select against the reference
# ---------------------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    scorer=st.sampled_from(["snapkv", "knorm", "keydiff", "expected_attention"]),
    b=st.integers(1, 2),
    heads=st.sampled_from(GQA),
    n=st.integers(2, 40),
    budget=st.integers(2, 36),
    window=st.integers(0, 4),
    ratio=st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]),
    eps=st.sampled_from([1e-4, 0.5]),
    hidden=st.sampled_from([8, 24]),
    pads=st.lists(st.integers(0, 8), min_size=2, max_size=2),
    seed=st.integers(0, 10_000),
)
def test_select_keeps_the_reference_choice(scorer, b, heads, n, budget, window, ratio, eps, hidden, pads, seed):
    """Per row and KV head the kept indices are the reference's, exactly ``budget`` of them; a prompt within the
    budget is kept whole."""
    h, hkv = heads
    window = max(window, 1) if scorer == "snapkv" else window
    budget = max(budget, window + 1 + (SINKS if scorer == "expected_attention" else 0))
    pads = [min(p, n - 1) for p in pads[:b]]
    d = 8
    q, k, v, w, kv_pos, q_pos = make_prompt(b, h, hkv, n, d, hidden, pads, seed)
    pol = make_policy("criticalkv", scorer=scorer, budget=budget, window=window, first_stage_ratio=ratio, epsilon=eps)
    keep = pol.select(SITE, q, k, v, kv_pos, q_pos, None, out_proj=w)
    if n <= budget:
        assert keep is None
        return
    assert keep.shape == (b, hkv, budget) and keep.dtype == torch.long
    base = base_scores(pol, q, k, v, kv_pos, q_pos, window)
    # epsilon on the scale of averaged scores: snapkv's votes are sums over the window's queries and each group's heads
    scaled = eps * min(window, n) * (h // hkv) if scorer == "snapkv" else eps
    for row in range(b):
        real = [j for j in range(n) if kv_pos[row, 0, j] >= 0]
        norms = norms_reference(v[row], w, h)
        for g in range(hkv):
            want, tied = reference_keep(
                {j: float(base[row, g, j]) for j in real},
                {j: float(norms[g, j]) for j in real},
                real,
                forced_of(scorer, real, window),
                n,
                budget,
                ratio,
                scaled,
            )
            assume(not tied)  # float32 against float64 may order a near tie either way
            assert keep[row, g].tolist() == want, (row, g)


@pytest.mark.parametrize("scorer,window", [("snapkv", 4), ("knorm", 0), ("keydiff", 2), ("expected_attention", 0)])
def test_first_stage_alone_is_the_scorers_choice(scorer, window):
    """``first_stage_ratio=1``: every kept entry is the scorer's (expected_attention without its value norms)."""
    q, k, v, w, kv_pos, q_pos = make_prompt(2, 4, 2, 40, 8, 16, [5, 0], 3)
    pol = make_policy("criticalkv", scorer=scorer, budget=16, window=window, first_stage_ratio=1.0)
    alone = make_policy(
        scorer, budget=16, window=window, **({"use_vnorm": False} if scorer == "expected_attention" else {})
    )
    assert torch.equal(
        pol.select(SITE, q, k, v, kv_pos, q_pos, None, out_proj=w), alone.select(SITE, q, k, v, kv_pos, q_pos, None)
    )


@pytest.mark.parametrize("ratio", [0.0, 0.5, 0.75])
def test_without_forced_entries_or_padding_it_is_kvpress(ratio):
    """knorm as the scorer, no window, unpadded: the kept set is the top ``budget`` of kvpress's
    ``CriticalKVPress.score`` formulas (its stage-1 top-k raised to the dtype's maximum, ``(score + epsilon)`` times
    the mean over the group of ``||V_h @ Wo_h||_1`` with ``Wo = o_proj.weight.T.view(H, D, hidden)``)."""
    g = torch.Generator().manual_seed(11)
    b, h, hkv, n, d, hidden, budget, eps = 2, 8, 2, 64, 16, 32, 20, 1e-4
    k = torch.randn(b, hkv, n, d, generator=g) * torch.rand(b, hkv, n, 1, generator=g) * 3
    v = torch.randn(b, hkv, n, d, generator=g)
    weight = torch.randn(hidden, h * d, generator=g)
    scores = -k.norm(dim=-1)
    first = max(1, int(budget * ratio)) if ratio > 0 else 0
    top = scores.topk(first, dim=-1, sorted=True).indices
    wo = weight.transpose(0, 1).view(h, d, hidden)
    rep = v[:, :, None].expand(b, hkv, h // hkv, n, d).reshape(b, h, n, d)
    norms = torch.stack([torch.norm(rep[:, i] @ wo[i][None], p=1, dim=-1) for i in range(h)], 1)
    scores = (scores + eps) * norms.view(b, hkv, h // hkv, n).mean(2)
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    want = scores.topk(budget, dim=-1).indices.sort(dim=-1).values
    pol = make_policy("criticalkv", scorer="knorm", budget=budget, window=0, first_stage_ratio=ratio, epsilon=eps)
    kv_pos, q_pos = torch.arange(n).expand(b, hkv, n), torch.arange(n).expand(b, n)
    got = pol.select(SITE, torch.randn(b, h, n, d), k, v, kv_pos, q_pos, None, out_proj=weight)
    assert torch.equal(got, want)


@pytest.mark.parametrize("scorer", ["snapkv", "knorm"])
def test_left_padded_row_keeps_what_the_prompt_keeps_alone(scorer):
    """Row 0: a prompt after 7 padding entries of loud keys and values; row 1 another prompt. Row 0 keeps the real
    entries the prompt keeps alone."""
    n, pad, hkv, h, d = 30, 7, 2, 4, 8
    q, k, v, w, kv_pos, q_pos = make_prompt(2, h, hkv, n + pad, d, 16, [pad, 0], 5)
    for x in (k, v):
        x[0, :, :pad] *= 50.0
    pol = make_policy("criticalkv", scorer=scorer, budget=12, window=3)
    both = pol.select(SITE, q, k, v, kv_pos, q_pos, None, out_proj=w)
    solo = pol.select(
        SITE,
        q[:1, :, pad:],
        k[:1, :, pad:],
        v[:1, :, pad:],
        torch.arange(n).expand(1, hkv, n),
        torch.arange(n)[None],
        None,
        out_proj=w,
    )
    for g in range(hkv):
        assert [j - pad for j in both[0, g].tolist() if j >= pad] == solo[0, g].tolist()


def test_a_missing_or_misshaped_projection_is_an_error_at_run_time():
    """``select`` never ranks a prefill without the projection its plan asked for, or with another layer's."""
    q, k, v, w, kv_pos, q_pos = make_prompt(1, 4, 2, 20, 8, 16, [0], 0)
    pol = make_policy("criticalkv", budget=8, window=2)
    with pytest.raises(RuntimeError, match=r"needs the output projection's weight \[hidden, 4 \* 8\], got none"):
        pol.select(SITE, q, k, v, kv_pos, q_pos, None)
    with pytest.raises(RuntimeError, match=r"got a weight of shape \(16, 24\)"):
        pol.select(SITE, q, k, v, kv_pos, q_pos, None, out_proj=w[:, :24])


def test_compact_hands_select_the_weight():
    """``kvpass::compact`` passes its ``out_proj`` argument to ``select`` (its schema, fake and replay checked by
    ``opcheck``), and stores what ``select`` keeps with that weight."""
    be = kvpass.backend("criticalkv", budget=8, window=2, compiler="eager")
    be.runtime.sites[0] = SITE
    q, k, v, w, _, _ = make_prompt(2, 4, 2, 20, 8, 16, [0, 0], 9)
    empty, op = torch.tensor([]), torch.ops.kvpass
    k_all, v_all, kv_pos, q_pos = op.cache_update(empty, empty, k, v, None, be.runtime.handle, 0)
    args = (q, k_all, v_all, kv_pos, q_pos, be.runtime.handle, 0, None, None, None, None, None, None, w)
    torch.library.opcheck(op.compact.default, args)
    k_st, _ = op.compact(*args)
    keep = be.policy.select(SITE, q, k_all, v_all, kv_pos, q_pos, None, out_proj=w)
    assert torch.equal(k_st, k_all.gather(2, keep[..., None].expand(-1, -1, -1, 8)))


# ---------------------------------------------------------------------------------------------------------------
# compiled models
# ---------------------------------------------------------------------------------------------------------------


class Recorded(CriticalKV):
    """The policy, noting the projection weight its ``select`` receives per layer."""

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, out_proj=None, **inputs):
        if kv_pos.shape[-1] == q_pos.shape[1]:
            WEIGHTS[site.layer] = out_proj
        return super().select(site, q, k, v, kv_pos, q_pos, layer_state, out_proj=out_proj, **inputs)


WEIGHTS: dict = {}


def _gpt2():
    cfg = tf.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa")])
def test_compiled_model_passes_its_projection_and_keeps_the_reference_choice(family, attn):
    """Each layer's ``select`` receives its output projection's weight ``[hidden, H * D]`` (Llama's ``o_proj``;
    GPT-2's ``c_proj``, whose Conv1D weight is the transpose) and keeps the reference's choice for the model's own
    keys, values and weight (knorm as the scorer: no query read)."""
    model = _gpt2() if family == "gpt2" else build(family, attn=attn)
    if family == "gpt2":
        model.config._attn_implementation = attn
    # distinct tokens: a repeated one has the same key norm at every position (RoPE rotates), a float tie
    ids = (torch.randperm(87, generator=torch.Generator().manual_seed(3))[:40] + 3)[None]
    with torch.no_grad():
        cache = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    budget = 16
    WEIGHTS.clear()
    be = kvpass.backend(Recorded(scorer="knorm", budget=budget, window=0), compiler="eager")
    with torch.no_grad():
        torch.compile(model.forward, backend=be)(
            input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True
        )
    layers = model.transformer.h if family == "gpt2" else model.model.layers
    assert be.reports[-1].evicting == list(range(len(layers)))
    assert "compact (with the output projection)" in be.reports[-1].plans[0]
    for i, layer in enumerate(layers):
        want = (layer.attn.c_proj.weight.t() if family == "gpt2" else layer.self_attn.o_proj.weight).detach()
        assert torch.equal(WEIGHTS[i], want)
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]
        norms = norms_reference(v, want, WEIGHTS[i].shape[1] // v.shape[-1])
        base = -k.double().norm(dim=-1)
        real = list(range(40))
        for g in range(k.shape[0]):
            kept, tied = reference_keep(
                {j: float(base[g, j]) for j in real},
                {j: float(norms[g, j]) for j in real},
                real,
                set(),
                40,
                budget,
                0.5,
                1e-4,
            )
            assert not tied
            assert be.state.layer(i).pos[0, g].tolist() == kept


class NormedProjection(torch.nn.Module):
    """A norm over the heads' outputs before the output projection (as models with a sub-layer norm there)."""

    def __init__(self, proj: torch.nn.Linear):
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(proj.in_features), proj

    def forward(self, x):
        return self.proj(self.norm(x))


def test_an_unrecognised_output_path_is_refused():
    """A norm between the attention output and its projection: the pass cannot tell which weight projects the
    heads, so the graph is compiled unchanged with a warning naming the node, and the model's output is its own."""
    _WARNED.clear()
    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn.o_proj = NormedProjection(layer.self_attn.o_proj)
    ids = torch.randint(3, 90, (1, 30))
    be = kvpass.backend("criticalkv", budget=16, window=4, compiler="eager")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model.forward, backend=be)(
            input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config)
        ).logits
        want = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
    msg = " ".join(str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning))
    assert "compiling a graph unchanged" in msg and "weighs values by the layer's output projection" in msg, msg
    assert (
        "layer_norm" in msg and "neither as the heads' transpose, reshape or cast nor as the output projection" in msg
    ), msg
    assert be.reports[-1].rewritten == 0
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------------


def test_defaults():
    """snapkv as the scorer with its own window (32) and defaults; half the budget by the scorer alone;
    kvpress's epsilon. expected_attention as the scorer runs without its value norms."""
    pol = make_policy("criticalkv")
    assert pol.config == {"budget": 2048, "window": -1, "scorer": "snapkv", "first_stage_ratio": 0.5, "epsilon": 1e-4}
    assert pol.base.config == {"budget": 2048, "window": 32, "kernel": 7, "pool": "max"}
    ea = make_policy("criticalkv", scorer="expected_attention", budget=64).base
    assert ea.config == {**make_policy("expected_attention", budget=64).config, "use_vnorm": False}
