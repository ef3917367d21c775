"""``expected_attention`` against a reference written here in float64 from the queries before RoPE, the keys and
values after it and RoPE's ``inv_freq`` (the paper's and kvpress's definition, the rotation averaged explicitly
over the future positions), without the graph.

* ``select`` keeps the reference's choice: the sinks (and window), then the highest expected attention, ties to the
  earlier entry, padding last, exactly ``budget`` per row and KV head; over rotary fractions, GQA, parameters,
  attention factors and position offsets; a prompt within the budget is kept whole;
* a left-padded row keeps what the same prompt keeps alone, whether the rows share one RoPE table (positions
  counting the padding) or have their own (positions from each row's first real token);
* compiled on tiny models (Llama, Qwen3's q norm, Phi-3's partial rotary, GPT-2 without rotation): each layer
  keeps the reference's choice for the model's own queries, keys, values and ``inv_freq``;
* the frequencies derived from the RoPE tables the graph hands ``select`` equal the model's ``inv_freq`` (and
  the attention factor its ``attention_scaling``) for default, linear, dynamic, YaRN, llama3 and LongRoPE
  scaling; the tables are read before their cast to the activations' dtype;
* a query transform the pass does not recognise (GPT-J's interleaved rotation) is refused, the graph compiled
  unchanged with the reason; bad parameters: ``tests/test_eviction_scoring.py``.

The conformance loop (``tests/conformance.py``) runs it on the model: no-op = ``full``, bytes, resets, SlotCache =
DynamicCache, a left-padded batch.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.errors import _WARNED
from kvpass.policies import make_policy
from kvpass.policies.prefill.expected_attention import ExpectedAttention, rope_frequencies
from test_slot_cache import assert_logits_close, left_padded

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GQA = [(1, 1), (2, 1), (4, 2), (4, 4)]


def site(rotated: bool):
    return SimpleNamespace(
        layer=0,
        softcap=0.0,
        sliding_window=None,
        cache="dynamic",
        phase="prefill",
        global_layers=(0,),
        tokens=None,
        tp=None,
        q_rope=SimpleNamespace(cos="cos" if rotated else None, problem=None),
    )


# ---------------------------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------------------------


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def rope_tables(inv_freq, positions, factor=1.0):
    """cos / sin ``[B, L, 2 len(inv_freq)]`` (fp32) of ``positions [B, L]``, as transformers builds them."""
    angle = positions[..., None].double() * inv_freq.double()
    angle = torch.cat([angle, angle], -1)
    return (angle.cos() * factor).float(), (angle.sin() * factor).float()


def apply_rope(x, cos, sin):
    """``x [B, H, L, D]`` rotated on its first ``r`` dims by tables ``[B, L, r]``, the rest passed through."""
    r = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x[..., :r] * c + rotate_half(x[..., :r]) * s, x[..., r:]], -1)


def reference_scores(
    q_pre,
    k,
    v,
    inv_freq,
    *,
    last,
    scale,
    n_sink,
    future,
    factor=1.0,
    covariance=True,
    vnorm=True,
    epsilon=0.0,
    stats=None,
):
    """One prompt's scores ``[H_kv, L]`` (float64; the sinks' entries -inf) from its real tokens only: the queries
    before RoPE ``q_pre [H, L, D]``, the keys after it ``k [H_kv, L, D]``, the values ``v``, RoPE's ``inv_freq``
    (rotary dims ``2 len(inv_freq)``; None: no rotation), its attention factor, the position of the prompt's last
    token ``last`` and the attention's ``scale``. ``stats``: other queries ``[H, W, D]`` to take the statistics
    from, all of them (a decode-time cut's), instead of the prompt's after its sinks."""
    q, k, v = q_pre.double(), k.double(), v.double()
    heads, n, d = q.shape[0], k.shape[1], k.shape[-1]
    group = heads // k.shape[0]
    x = q[:, n_sink:] if stats is None else stats.double()
    mu = x.mean(1)
    centred = x - mu[:, None]
    sigma = centred.transpose(1, 2) @ centred / x.shape[1]
    r_bar = torch.eye(d, dtype=torch.float64)
    if inv_freq is not None:
        half = inv_freq.numel()
        r = 2 * half
        p = torch.zeros(r, r, dtype=torch.float64)
        p[:half, half:], p[half:, :half] = -torch.eye(half), torch.eye(half)
        t = torch.arange(last + 1, last + 1 + future, dtype=torch.float64)
        angle = t[:, None] * inv_freq.double()
        angle = torch.cat([angle, angle], -1)  # [F, r]
        rs = torch.eye(d, dtype=torch.float64).repeat(future, 1, 1)
        rs[:, :r, :r] = factor * (torch.diag_embed(angle.cos()) + torch.diag_embed(angle.sin()) @ p)
        r_bar = rs.mean(0)
    mu = mu @ r_bar.T
    sigma = r_bar @ sigma @ r_bar.T
    out = torch.full((k.shape[0], n), float("-inf"), dtype=torch.float64)
    for g in range(k.shape[0]):
        keys = k[g, n_sink:]
        probs = []
        for h in range(g * group, (g + 1) * group):
            logit = scale * keys @ mu[h]
            if covariance:
                logit = logit + scale**2 * torch.einsum("jd,de,je->j", keys, sigma[h], keys) / 2
            probs.append(torch.softmax(logit, 0))
        score = torch.stack(probs).mean(0)
        if vnorm:
            score = (score + epsilon) * v[g, n_sink:].norm(dim=-1)
        out[g, n_sink:] = score
    return out


def reference_keep(scores, real: list[int], n_sink: int, window: int, budget: int, length: int) -> list[int]:
    """One row and KV head: the kept indices into a row of ``length`` entries whose real ones are ``real``
    (``scores`` over them): the first ``n_sink`` and last ``window`` real entries, then by score, the earlier on a
    tie, then padding."""
    forced = set(real[:n_sink]) | (set(real[len(real) - window :]) if window else set())
    rest = sorted((j for i, j in enumerate(real) if j not in forced), key=lambda j: (-scores[real.index(j)], j))
    pads = [j for j in range(length) if j not in real]
    return sorted((sorted(forced) + rest + pads)[:budget])


def assert_same_choice(got: list[int], want: list[int], scores, real: list[int]) -> None:
    """``got == want``, but for entries whose reference scores tie (to 1e-6) with the last one kept: float32
    against float64 may order a near tie either way."""
    if got == want:
        return
    score = {j: float(scores[i]) for i, j in enumerate(real)}
    kept = [score[j] for j in want if score.get(j, float("inf")) != float("inf")]
    line = min(kept) if kept else 0.0
    tol = 1e-6 * max(abs(s) for s in score.values() if s != float("-inf")) + 1e-12
    for j in set(got) ^ set(want):
        assert j in score and abs(score[j] - line) <= tol, (got, want, j, score.get(j), line)


# ---------------------------------------------------------------------------------------------------------------
# select against the reference
# ---------------------------------------------------------------------------------------------------------------


def make_prompt(b, h, hkv, n, d, rotary, pads, shared, offset, factor, seed):
    """A prefill's inputs: queries before RoPE ``[b, h, n, d]``, keys after RoPE (before it when ``rotary`` is 0),
    values, the RoPE tables of positions starting at ``offset`` (``shared``: one table for the batch, counting the
    padding; else per row from its first real token; None when ``rotary`` is 0), those positions ``[b, n]``,
    ``kv_pos`` with -1 on each row's ``pads`` leading entries, and ``inv_freq``."""
    g = torch.Generator().manual_seed(seed)
    q_pre = torch.randn(b, h, n, d, generator=g) + torch.randn(1, h, 1, d, generator=g)  # a mean to find
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g) * torch.rand(b, hkv, n, 1, generator=g)
    base = 10.0 ** (1 + 5 * torch.rand((), generator=g).item())
    inv_freq = base ** (-torch.arange(0, max(rotary, 2), 2, dtype=torch.float64) / max(rotary, 2))
    index = torch.arange(n).expand(b, n)
    positions = (index if shared else (index - torch.tensor(pads)[:, None]).clamp_min(0)) + offset
    cos = sin = None
    if rotary:
        cos, sin = rope_tables(inv_freq, positions[:1] if shared else positions, factor)
        k = apply_rope(k, cos.expand(b, n, rotary), sin.expand(b, n, rotary))
    kv_pos = torch.arange(n).expand(b, hkv, n).clone()
    for row, p in enumerate(pads):
        kv_pos[row, :, :p] = -1
    return q_pre, k, v, cos, sin, positions, kv_pos, inv_freq


@SETTINGS
@given(
    b=st.integers(1, 2),
    heads=st.sampled_from(GQA),
    n=st.integers(2, 40),
    budget=st.integers(2, 36),
    n_sink=st.integers(0, 5),
    window=st.integers(0, 3),
    d=st.sampled_from([8, 16]),
    rotary=st.sampled_from(["all", "half", "none"]),
    future=st.sampled_from([1, 5, 512]),
    covariance=st.booleans(),
    vnorm=st.booleans(),
    epsilon=st.sampled_from([0.0, 0.1]),
    factor=st.sampled_from([1.0, 1.2]),
    offset=st.sampled_from([0, 3, 1000]),
    pads=st.lists(st.integers(0, 8), min_size=2, max_size=2),
    shared=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_select_keeps_the_reference_choice(
    b,
    heads,
    n,
    budget,
    n_sink,
    window,
    d,
    rotary,
    future,
    covariance,
    vnorm,
    epsilon,
    factor,
    offset,
    pads,
    shared,
    seed,
):
    """Per row and KV head the kept indices are the reference's (up to float ties), exactly ``budget`` of them;
    a prompt within the budget is kept whole."""
    h, hkv = heads
    n_sink = min(n_sink, budget - 1)
    window = min(window, budget - 1 - n_sink)
    pads = [min(p, n - 1) for p in pads[:b]]
    r = {"all": d, "half": d // 2, "none": 0}[rotary]
    q_pre, k, v, cos, sin, positions, kv_pos, inv_freq = make_prompt(
        b, h, hkv, n, d, r, pads, shared, offset, factor, seed
    )
    scale = d**-0.5
    pol = make_policy(
        "expected_attention",
        budget=budget,
        n_sink=n_sink,
        window=window,
        n_future_positions=future,
        use_covariance=covariance,
        use_vnorm=vnorm,
        epsilon=epsilon,
    )
    q = q_pre * scale if cos is None else apply_rope(q_pre, cos.expand(b, n, r), sin.expand(b, n, r)) * scale
    extra = {} if cos is None else dict(q_pre=q_pre * scale, cos=cos, sin=sin)
    keep = pol.select(site(cos is not None), q, k, v, kv_pos, torch.arange(n).expand(b, n), None, **extra)
    if n <= budget:
        assert keep is None
        return
    assert keep.shape == (b, hkv, budget) and keep.dtype == torch.long
    for row in range(b):
        real = [j for j in range(n) if kv_pos[row, 0, j] >= 0]
        if len(real) <= n_sink:  # no statistics to take: every real entry is a sink, all kept
            assert set(real) <= set(keep[row, 0].tolist())
            continue
        scores = reference_scores(
            q_pre[row][:, real],
            k[row][:, real],
            v[row][:, real],
            None if cos is None else inv_freq,
            last=int(positions[row, -1]),
            scale=scale,
            n_sink=n_sink,
            future=future,
            factor=factor,
            covariance=covariance,
            vnorm=vnorm,
            epsilon=epsilon,
        )
        for g in range(hkv):
            want = reference_keep(scores[g].tolist(), real, n_sink, window, budget, n)
            assert_same_choice(keep[row, g].tolist(), want, scores[g].tolist(), real)


@SETTINGS
@given(
    n=st.integers(8, 40),
    budget=st.integers(6, 30),
    pad=st.integers(1, 10),
    shared=st.booleans(),
    rotary=st.sampled_from([8, 4, 0]),
    seed=st.integers(0, 10_000),
)
def test_left_padded_row_keeps_what_the_prompt_keeps_alone(n, budget, pad, shared, rotary, seed):
    """Row 0: a prompt after ``pad`` padding entries of loud queries, keys and values; row 1: another prompt of
    the full length. Row 0 keeps the real entries the prompt keeps alone, at positions counting the padding (one
    table for both rows) or from its first real token (a table per row), or without rotation."""
    hkv, h, d = 2, 4, 8
    q_pre, k, v, cos, sin, positions, kv_pos, inv_freq = make_prompt(
        2, h, hkv, n + pad, d, rotary, [pad, 0], shared, 0, 1.0, seed
    )
    for x in (q_pre, k, v):
        x[0, :, :pad] *= 50.0
    pol = make_policy("expected_attention", budget=budget)
    scale = d**-0.5
    q_pos = torch.arange(n + pad).expand(2, n + pad)
    extra = {} if cos is None else dict(q_pre=q_pre * scale, cos=cos, sin=sin)
    got = pol.select(site(cos is not None), q_pre * scale, k, v, kv_pos, q_pos, None, **extra)
    # alone: the same queries, keys and values, the keys turned back from the row's positions to 0..n-1
    k1, extra = k[:1, :, pad:], {}
    if rotary:
        back = rope_tables(inv_freq, (torch.arange(n) - positions[0, pad:])[None])
        k1 = apply_rope(k1, *back)
        cos1, sin1 = rope_tables(inv_freq, torch.arange(n)[None])
        extra = dict(q_pre=q_pre[:1, :, pad:] * scale, cos=cos1, sin=sin1)
    solo = pol.select(
        site(cos is not None),
        q_pre[:1, :, pad:] * scale,
        k1,
        v[:1, :, pad:],
        torch.arange(n).expand(1, hkv, n),
        torch.arange(n)[None],
        None,
        **extra,
    )
    for g in range(hkv):
        padded = list(range(n)) if got is None else [j - pad for j in got[0, g].tolist() if j >= pad]
        want = list(range(n)) if solo is None else solo[0, g].tolist()
        assert padded == want, (g, padded, want)


def test_rotation_tables_of_another_query_are_refused_at_run_time():
    """A rotated query scored without its tables (or the reverse) raises rather than scoring it unrotated."""
    q_pre, k, v, cos, sin, _, kv_pos, _ = make_prompt(1, 2, 1, 12, 8, 8, [0], True, 0, 1.0, 0)
    pol = make_policy("expected_attention", budget=6)
    with pytest.raises(RuntimeError, match="rotated by RoPE, but select was not given RoPE tables"):
        pol.select(site(True), q_pre, k, v, kv_pos, torch.arange(12)[None], None)
    with pytest.raises(RuntimeError, match="not rotated by RoPE, but select was given RoPE tables"):
        pol.select(site(False), q_pre, k, v, kv_pos, torch.arange(12)[None], None, q_pre=q_pre, cos=cos, sin=sin)


# ---------------------------------------------------------------------------------------------------------------
# compiled models
# ---------------------------------------------------------------------------------------------------------------


def _gpt2():
    cfg = tf.GPT2Config(
        vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).eval()


def _pre_rope_queries(family: str, model) -> tuple[list, list]:
    """Hooks that record each layer's queries before RoPE ``[B, H, L, D]``, and the list they fill."""
    cfg, out, hooks = model.config, [], []
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads

    def keep(module, args, result):
        x = result[..., : heads * d] if family in ("phi3", "gpt2") else result
        out.append(x.reshape(x.shape[0], x.shape[1], heads, d).transpose(1, 2).detach())

    layers = model.transformer.h if family == "gpt2" else model.model.layers
    for layer in layers:
        module = {
            "llama": lambda a: a.q_proj,
            "qwen3": lambda a: a.q_norm,
            "phi3": lambda a: a.qkv_proj,
            "gpt2": lambda a: a.c_attn,
        }[family](layer.attn if family == "gpt2" else layer.self_attn)
        hooks.append(module.register_forward_hook(keep))
    return out, hooks


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gpt2"])
def test_compiled_model_keeps_the_reference_choice(family):
    """Each layer keeps the reference's choice for the model's own queries before RoPE (after Qwen3's q norm; of
    Phi-3's fused projection), keys, values and ``inv_freq`` (Phi-3: half the dims rotate; GPT-2: none)."""
    model = _gpt2() if family == "gpt2" else build(family)
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(3))
    queries, hooks = _pre_rope_queries(family, model)
    with torch.no_grad():
        cache = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    for hook in hooks:
        hook.remove()
    rotary = None if family == "gpt2" else model.model.rotary_emb
    budget, sink = 16, 4
    be = kvpass.backend("expected_attention", budget=budget, compiler="eager")
    with torch.no_grad():
        torch.compile(model.forward, backend=be)(
            input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True
        )
    assert be.reports[-1].evicting == list(range(len(queries)))
    real = list(range(40))
    for layer, q_pre in enumerate(queries):
        k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        scores = reference_scores(
            q_pre[0],
            k,
            v,
            None if rotary is None else rotary.inv_freq,
            last=39,
            scale=q_pre.shape[-1] ** -0.5,
            n_sink=sink,
            future=512,
            factor=1.0 if rotary is None else rotary.attention_scaling,
        )
        for g in range(k.shape[0]):
            want = reference_keep(scores[g].tolist(), real, sink, 0, budget, 40)
            assert_same_choice(be.state.layer(layer).pos[0, g].tolist(), want, scores[g].tolist(), real)


class Recorded(ExpectedAttention):
    """The policy, noting the RoPE tables its ``select`` receives."""

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, q_pre=None, cos=None, sin=None):
        if kv_pos.shape[-1] == q_pos.shape[1]:
            TABLES.append((cos, sin, kv_pos[:, 0] >= 0))
        return super().select(site, q, k, v, kv_pos, q_pos, layer_state, q_pre=q_pre, cos=cos, sin=sin)


TABLES: list = []
ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),  # past max_position_embeddings (32)
    "yarn": dict(rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=8),
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        rope_theta=500000.0,
        original_max_position_embeddings=8,
    ),
    "longrope": dict(
        rope_type="longrope",
        short_factor=[1.0, 1.5, 2.0, 1.0, 3.0, 1.0, 1.0, 4.0],
        long_factor=[2.0, 1.0, 5.0, 2.0, 1.0, 8.0, 3.0, 1.0],
        rope_theta=10000.0,
        original_max_position_embeddings=8,
    ),
}


@pytest.mark.parametrize(
    "rope,dtype,pad",
    [(name, torch.float32, 0) for name in ROPES] + [("yarn", torch.bfloat16, 0), ("llama3", torch.float32, 5)],
)
def test_frequencies_from_the_graph_tables_are_the_models(rope, dtype, pad):
    """The tables the graph hands ``select`` give back the model's ``inv_freq`` for each column pair and its
    ``attention_scaling``, for every RoPE scaling transformers builds; a bf16 model's tables are read in fp32
    (before their cast); a left-padded row (positions from its first real token) gives the same."""
    cfg = tf.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_parameters=ROPES[rope],
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(dtype).eval()
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    TABLES.clear()
    be = kvpass.backend(Recorded(budget=16), compiler="eager")
    with torch.no_grad():
        torch.compile(model.forward, backend=be)(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            position_ids=(mask.cumsum(-1) - 1).clamp_min(0),
            past_key_values=DynamicCache(config=model.config),
        )
    # (dynamic scaling breaks the forward into graphs at its length check: the attention is in the last but one)
    assert len(TABLES) == 2 and [r.evicting for r in be.reports if r.evicting] == [[0, 1]]
    rotary = model.model.rotary_emb
    for cos, sin, real in TABLES:
        assert cos.dtype == sin.dtype == torch.float32
        freq, last = rope_frequencies(cos, sin, real)
        half = rotary.inv_freq.numel()
        for row in range(2):
            torch.testing.assert_close(freq[row, :half], rotary.inv_freq.double(), rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(freq[row, half:], rotary.inv_freq.double(), rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(
                last[row].abs(), torch.full_like(last[row].abs(), rotary.attention_scaling), rtol=1e-6, atol=0.0
            )


# ---------------------------------------------------------------------------------------------------------------
# refusals and parameters
# ---------------------------------------------------------------------------------------------------------------


def test_an_unrecognised_query_transform_is_refused():
    """GPT-J rotates its queries pairwise (interleaved, not rotate-half): the pass cannot read them before RoPE,
    so the graph is compiled unchanged with a warning naming the node, and the model's output is its own."""
    _WARNED.clear()
    cfg = tf.GPTJConfig(
        vocab_size=96,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        n_positions=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = tf.GPTJForCausalLM(cfg).eval()
    ids = torch.randint(3, 90, (1, 30))
    be = kvpass.backend("expected_attention", budget=16, compiler="eager")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model.forward, backend=be)(
            input_ids=ids, past_key_values=DynamicCache(config=cfg), use_cache=True
        ).logits
        want = model(input_ids=ids, past_key_values=DynamicCache(config=cfg), use_cache=True).logits
    msg = " ".join(str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning))
    assert "compiling a graph unchanged" in msg and "its scores need the queries before RoPE" in msg, msg
    assert "recognises neither as transformers' rotate-half RoPE" in msg, msg
    assert be.reports[-1].rewritten == 0
    torch.testing.assert_close(got, want)


def test_defaults_are_kvpress():
    assert make_policy("expected_attention").config == {
        "budget": 2048,
        "window": 0,
        "n_sink": 4,
        "n_future_positions": 512,
        "use_covariance": True,
        "use_vnorm": True,
        "epsilon": 0.0,
        "decode_interval": 0,  # kvpass's ExpectedAttentionPress alone; its DecodingPress cuts every 512 steps
        "decode_queries": 256,  # DecodingPress's hidden_states_buffer_size
    }


# ---------------------------------------------------------------------------------------------------------------
# decode-time cuts (decode_interval)
# ---------------------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    gqa=st.sampled_from(GQA),
    rotary=st.sampled_from([0, 4, 8]),
    steps=st.integers(2, 12),
    ring=st.integers(2, 8),
    n=st.integers(8, 30),
    keep=st.integers(4, 8),
    window=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_decode_cut_keeps_the_reference_choice(gqa, rotary, steps, ring, n, keep, window, seed):
    """``observe`` fed one decode query at a time (before RoPE, with its tables), then ``cut_keep`` over the stored
    entries: the reference's choice, with the statistics of the last ``decode_queries`` queries (the ring wrapped
    when there were more) rotated over the positions after the latest one, for every row and KV head."""
    from kvpass.policies.prefill.expected_attention import decode_state, observe

    heads, hkv = gqa
    b, d, n_sink = 2, 8, 2
    policy = make_policy("expected_attention", budget=keep + 4, n_sink=n_sink, window=window, decode_queries=ring)
    g = torch.Generator().manual_seed(seed)
    inv_freq = None if not rotary else 1.0 / (10000 ** (torch.arange(0, rotary, 2).double() / rotary))
    state = [
        torch.full((b, hkv, *shape), fill, dtype=dtype or torch.float32)
        for shape, dtype, fill in decode_state(heads // hkv, ring, d).values()
    ]
    start = torch.tensor([[5], [11]])  # each row's first decode position
    queries = torch.randn(b, heads, steps, d, generator=g)
    for i in range(steps):
        cos = sin = None
        if rotary:
            cos, sin = rope_tables(inv_freq, start + i)
        observe(queries[:, :, i : i + 1], cos, sin, state)
    k, v = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    pos = torch.arange(n).expand(b, hkv, n)
    got = policy.cut_keep(k, v, pos, state, keep, rotary)
    for row in range(b):
        scores = reference_scores(
            queries[row],
            k[row],
            v[row],
            inv_freq,
            last=int(start[row]) + steps - 1,
            scale=1.0,
            n_sink=n_sink,
            future=policy.n_future_positions,
            stats=queries[row, :, -ring:],
        )
        for h in range(hkv):
            want = reference_keep(scores[h], list(range(n)), n_sink, window, keep, n)
            assert_same_choice(got[row, h].tolist(), want, scores[h], list(range(n)))


def _cut_run(model, cache, ids, mask, steps, tokens=None, **params):
    from test_slot_cache import run

    torch._dynamo.reset()
    be = kvpass.backend("expected_attention", compiler="eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = cache(be)
    fed, logits = run(fwd, cache, ids, steps, tokens, mask=mask)
    return be, cache, fed, logits


@pytest.mark.parametrize("family", ["llama"])  # partial rotary: test_decode_cut_keeps_the_reference_choice
def test_decode_cuts_on_both_caches_and_through_generate(family):
    """Every ``decode_interval`` tokens each layer goes back to its budget: on a DynamicCache its length follows
    ``budget + (n - budget) % decode_interval``; a SlotCache of ``budget + decode_interval + 2`` slots, cut between
    steps, gives the same logits at every step (a left-padded batch), the padded row the
    logits of its prompt alone, and ``generate`` through ``kvpass.compile`` the same tokens. Without the cuts the
    logits differ."""
    model = build(family)
    params = dict(budget=16, n_sink=2, decode_interval=16, decode_queries=8)
    ids, mask, short, _ = left_padded(30, 22, seed=3)
    steps = 34  # cuts after the 16th and the 32nd
    be, dyn, fed, ref = _cut_run(model, lambda be: DynamicCache(config=model.config), ids, mask, steps, **params)
    n = 16 + steps  # the prompt cut to the budget, then the decoded tokens
    assert all(st.pos.shape[-1] == 16 + (n - 16) % 16 for st in be.state.layers.values())
    _, slots, _, got = _cut_run(
        model,
        lambda be: kvpass.SlotCache(model, be, max_length=30 + steps, batch_size=2),
        ids,
        mask,
        steps,
        fed,
        **params,
    )
    assert {layer.capacity for layer in slots.layers} == {16 + 16 + 2}
    assert_logits_close(got, ref)
    _, _, _, alone = _cut_run(
        model, lambda be: DynamicCache(config=model.config), short, None, steps, [t[:1] for t in fed], **params
    )
    assert_logits_close([t[:1] for t in ref], alone)
    _, _, _, uncut = _cut_run(
        model, lambda be: DynamicCache(config=model.config), ids, mask, steps, fed, **{**params, "decode_interval": 0}
    )
    assert not torch.allclose(uncut[-1], ref[-1], atol=1e-3)
    greedy = build(family)
    fast = kvpass.compile(greedy, "expected_attention", compiler="eager", **params)
    out = greedy.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
    assert "a cut of the layers that reach 32 entries" in fast.plans()["decode"][0]  # kvpass explain says so
    _, _, _, want = _cut_run(model, lambda be: DynamicCache(config=model.config), ids, mask, steps - 1, **params)
    assert out[:, 30:].tolist() == torch.stack([w.argmax(-1) for w in want], 1).tolist()


def test_decode_cuts_in_a_request_queue_give_each_request_its_tokens_alone():
    """Requests admitted into rows at different steps reach their cuts at different steps (one a step after the
    other included): each row is cut when it is due, so every request gets the tokens ``generate`` gives it alone."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(
        model, "expected_attention", compiler="eager", budget=16, n_sink=2, decode_interval=16, decode_queries=8
    )
    prompts = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 33, 27, 41, 25)]
    news = (40, 25, 37, 30, 20)
    want = [
        model.generate(p[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)[0] for p, n in zip(prompts, news)
    ]
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for p, n in zip(prompts, news):
        queue.add(p, max_new_tokens=n)
    assert [g.tolist() for g in queue.run(progress=False)] == [w.tolist() for w in want]


def test_decode_cuts_refuse_an_append_graph_and_bad_intervals():
    """Several tokens on a filled cache are refused by name (the cut counts one-token steps); an interval between 0
    and 16 is a configuration error naming the parameter."""
    policy = make_policy("expected_attention", budget=16, decode_interval=16)
    refused = policy.plan(SimpleNamespace(**{**vars(site(True)), "phase": "append", "cache": "slot"}))
    assert "one-token decode steps" in str(refused.reason)
    with pytest.raises(kvpass.ConfigError, match="decode_interval"):
        make_policy("expected_attention", decode_interval=8)
