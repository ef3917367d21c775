"""The multi-family equivalence matrix: with the ``full`` policy the pass must change nothing.

Every tiny family of ``tests/families.py`` is crossed with {sdpa, eager} attention, {DynamicCache,
StaticCache} and {prefill, decode, batch 2 with left padding}, where the StaticCache half runs on the families
whose static layers differ (sliding windows) and on the Llama, which stands for the rest (a full-attention
family's StaticCache is transformers' one StaticLayer, whatever the model; its attention is the DynamicCache
half's). In every case

* every graph handed to the inner compiler was really rewritten: one detected site per layer, one
  kvpass attention operator per layer, none of the model's own attention calls left, no problems
  (so these tests fail when the pass is switched off or silently bails out);
* the logits equal those of the uncompiled model (fp32: atol = rtol = 1e-4) at every step;
* greedy ``generate`` of 16 tokens gives the same tokens (and the same per-step logits).

The matrix runs the pass with the cheap ``compiler="eager"`` behind it; a few cases go through
real Inductor (``-m inductor``). The four ways of compiling a model with ``fullgraph=True`` --
``torch.compile(model.forward)``, ``torch.compile(model)``, ``model.compile()`` and ``generate``
with a ``CompileConfig`` -- are checked on llama/sdpa (every family goes through the first in the matrix).

Budget: every compiled graph costs 1-2.5 s of Dynamo tracing on a CPU, so each case keeps to the
graphs it needs (short prompts, a few decode steps; generate only in the generate test, which
is also where a left-padded batch is decoded).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import CompileConfig, DynamicCache, StaticCache

import kvpass
import kvpass.ops  # noqa: F401  (registers torch.ops.kvpass; `import kvpass` loads lazily)
from families import FAMILIES, build

ATOL = RTOL = 1e-4
PAD = 0  # families.COMMON["pad_token_id"]
PREFILL_LEN = 10  # longer than the sliding windows (8) of gemma2 / gemma3 / cohere2
DECODE_PROMPT = 6  # ... and decode crosses the window: positions 6..9
DECODE_STEPS = 4
PAD_ROW0 = 3  # pad tokens on the left of the first row of a batch of 2
GEN_PROMPT, GEN_NEW = 8, 16

ATTNS = ("sdpa", "eager")
CACHES = ("dynamic", "static")
SCENARIOS = ("prefill", "decode", "leftpad")
KVPASS_OPS = {torch.ops.kvpass.attention.default, torch.ops.kvpass.attention_pos.default}
MODEL_ATTENTION = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention, torch.softmax, F.softmax}

# A KVPassWarning means a graph was compiled unchanged: always a failure here.
pytestmark = pytest.mark.filterwarnings("error::kvpass.KVPassWarning")


@pytest.fixture(autouse=True)
def _strict_recompiles():
    """Past Dynamo's recompile limit a frame silently runs eagerly; make that an error here."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield


def _unsupported(family: str, attn: str) -> str | None:
    if family == "gemma2" and attn == "sdpa":
        return "transformers has no SDPA attention for Gemma2 (attention logit softcapping): eager only"
    return None


def _sliding(family: str) -> bool:
    return getattr(FAMILIES[family]()[0], "sliding_window", None) is not None


# CI time: a StaticCache of full-attention layers is one transformers class (StaticLayer) whatever the family, and
# each family's attention runs on the DynamicCache; the Llama stands for the full-attention families there, the
# families with sliding layers (a static sliding layer of their own) run it all
STATIC_FAMILIES = {f for f in FAMILIES if f == "llama" or _sliding(f)}


def matrix(*axes, drop=(), keep=()):
    """pytest params for family x attn x axes..., with ids like ``llama-sdpa-dynamic-decode``; ``drop``: the
    (attn, cache) pairs left out, except on the families of ``keep`` and those without SDPA; the StaticCache on
    ``STATIC_FAMILIES`` only."""
    combos = [(f, a) for f in FAMILIES for a in ATTNS]
    for axis in axes:
        combos = [c + (x,) for c in combos for x in axis]
    combos = [c for c in combos if len(c) < 3 or c[2] != "static" or c[0] in STATIC_FAMILIES]
    combos = [c for c in combos if tuple(c[1:3]) not in drop or c[0] in keep or _unsupported(c[0], "sdpa")]
    params = []
    for c in combos:
        why = _unsupported(c[0], c[1])
        params.append(pytest.param(*c, id="-".join(c), marks=[pytest.mark.skip(reason=why)] if why else []))
    return params


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def make_backend(compiler: str = "eager") -> kvpass.Backend:
    """``kvpass.backend("full")`` that also records what each graph handed to the inner compiler
    contains: kvpass operators and any attention call of the model's own that is left."""
    be = kvpass.backend("full", compiler=compiler)
    graph_ops: list[dict] = []
    inner = be._inner

    def recording_inner(gm, example_inputs, *rest):
        nodes = list(gm.graph.nodes)
        graph_ops.append(
            {
                "kvpass": sum(n.op == "call_function" and n.target in KVPASS_OPS for n in nodes),
                "model_attention": sum(
                    (n.op == "call_function" and n.target in MODEL_ATTENTION)
                    or (n.op == "call_method" and n.target == "softmax")
                    for n in nodes
                ),
            }
        )
        return inner(gm, example_inputs, *rest)

    be._inner = recording_inner
    be.graph_ops = graph_ops  # a plain list: survives a deepcopy of the backend by reference
    return be


def check_graph_ops(graph_ops: list[dict], layers: int, min_graphs: int) -> None:
    assert len(graph_ops) >= min_graphs, f"expected >= {min_graphs} compiled graphs, got {graph_ops}"
    for ops in graph_ops:
        assert ops == {"kvpass": layers, "model_attention": 0}, ops


def check_reports(be: kvpass.Backend, model, attn: str, cache: str | None, min_graphs: int = 1) -> None:
    """Every compiled graph was rewritten at every layer, with no problems."""
    layers = model.config.num_hidden_layers
    assert len(be.reports) >= min_graphs, f"expected >= {min_graphs} compiled graphs, got {be.reports}"
    assert len(be.graph_ops) == len(be.reports)
    for rep in be.reports:
        assert rep.problems == [], rep.problems
        assert len(rep.sites) == layers, (rep.phase, rep.sites)
        assert rep.rewritten == layers, rep
        assert [r["layer"] for r in rep.sites] == list(range(layers))
        assert {r["attention"] for r in rep.sites} == {attn}, rep.sites
        if cache is not None:
            kinds = [r["cache"] for r in rep.sites]
            if cache == "dynamic":
                assert set(kinds) == {"dynamic"}, rep.sites
            else:
                # A static sliding layer whose prefill already overflows its window attends to the
                # new K/V directly (transformers then stores the window): no cache read in the graph.
                assert "static" in kinds and set(kinds) <= {"static", "none"}, rep.sites
    check_graph_ops(be.graph_ops, layers, min_graphs)


def token_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padded(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 whose first row is left-padded with PAD_ROW0 pad tokens, and its mask."""
    ids = token_ids(2, length, seed)
    mask = torch.ones_like(ids)
    ids[0, :PAD_ROW0] = PAD
    mask[0, :PAD_ROW0] = 0
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as ``generate`` builds them for a (left-padded) attention mask."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


def new_cache(kind: str, model, max_len: int):
    if kind == "dynamic":
        return DynamicCache(config=model.config)
    return StaticCache(config=model.config, max_cache_len=max_len)


def assert_logits(actual, expected, where: str, valid=None, atol=ATOL, rtol=RTOL) -> None:
    """Compare logits [B, L, V]; with ``valid`` [B, L] only where it is nonzero (non-pad tokens)."""
    if valid is not None:
        actual, expected = actual[valid.bool()], expected[valid.bool()]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")


def run_steps(prefill, step, model, cache_kind: str, ids, mask, tokens):
    """``prefill(ids)`` then one ``step`` call per column of ``tokens`` [B, n]; all logits.

    With a ``mask`` the calls get ``attention_mask`` and ``position_ids`` as ``generate`` builds
    them; without, the model derives positions from the cache length (the bare-forward path).
    """
    cache = new_cache(cache_kind, model, ids.shape[1] + tokens.shape[1] + 1)
    kw = {} if mask is None else dict(attention_mask=mask, position_ids=positions_from_mask(mask))
    with torch.no_grad():
        out = [prefill(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits]
        for i in range(tokens.shape[1]):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:])
            out.append(step(input_ids=tokens[:, i : i + 1], past_key_values=cache, use_cache=True, **kw).logits)
    return out


def reference_run(model, cache_kind, ids, mask, steps):
    """The uncompiled model, greedy: (logits per call, the tokens it fed)."""
    cache = new_cache(cache_kind, model, ids.shape[1] + steps + 1)
    kw = {} if mask is None else dict(attention_mask=mask, position_ids=positions_from_mask(mask))
    out, fed = [], []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits
        out.append(logits)
        for _ in range(steps):
            tok = logits[:, -1:].argmax(-1)
            fed.append(tok)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                kw = dict(attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:])
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True, **kw).logits
            out.append(logits)
    return out, torch.cat(fed, dim=1) if fed else ids[:, :0]


def greedy(model, ids, mask, cache: str, **kw):
    """Greedy generation of exactly GEN_NEW tokens: (sequences, logits [B, GEN_NEW, V])."""
    if cache == "static":
        kw.setdefault("cache_implementation", "static")
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=GEN_NEW,
            min_new_tokens=GEN_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return out.sequences, torch.stack(out.logits, dim=1)


def assert_same_generation(actual, expected, atol=ATOL, rtol=RTOL) -> None:
    seq, logits = actual
    ref_seq, ref_logits = expected
    assert seq.shape[1] == ref_seq.shape[1] and seq.shape[1] > GEN_NEW
    assert torch.equal(seq, ref_seq), f"\ncompiled: {seq.tolist()}\nplain:    {ref_seq.tolist()}"
    torch.testing.assert_close(logits, ref_logits, atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------
# the matrix: logits
# ------------------------------------------------------------------------------------------------


def check_forward(family, attn, cache, scenario, compiler="eager", dtype=torch.float32, atol=ATOL, rtol=RTOL):
    """One scenario of the logits matrix through ``torch.compile(model.forward, fullgraph=True)``.

    prefill: a compiled prompt longer than the sliding windows.
    decode:  an uncompiled prefill, then single-token steps through the compiled forward, with
             positions derived from the cache length (the bare-forward path), crossing the windows.
    leftpad: batch 2, the first row left-padded, with its attention mask and position ids;
             compiled prefill, compared at the non-pad positions. (Decoding a padded batch is
             covered by the generate test, which runs exactly that.)
    """
    model = build(family, attn, dtype=dtype)
    be = make_backend(compiler)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    if scenario == "prefill":
        ids, mask, steps, prefill, graphs = token_ids(1, PREFILL_LEN, seed=1), None, 0, fwd, 1
    elif scenario == "decode":
        ids, mask, steps, prefill, graphs = token_ids(1, DECODE_PROMPT, seed=2), None, DECODE_STEPS, model, 1
    else:
        (ids, mask), steps, prefill, graphs = left_padded(PREFILL_LEN, seed=3), 0, fwd, 1
    expected, fed = reference_run(model, cache, ids, mask, steps)
    actual = run_steps(prefill, fwd, model, cache, ids, mask, fed)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_logits(a, e, f"{scenario} call {i}", valid=mask if i == 0 else None, atol=atol, rtol=rtol)
    check_reports(be, model, attn, cache, min_graphs=graphs)


# CI time: eager attention on a StaticCache on the Llama and where there is no SDPA (Gemma2): eager attention's
# pattern is the same on either cache (the DynamicCache half), and the static layers' reads run under SDPA
@pytest.mark.parametrize(
    "family,attn,cache,scenario", matrix(CACHES, SCENARIOS, drop={("eager", "static")}, keep={"llama"})
)
def test_logits_match(family, attn, cache, scenario):
    check_forward(family, attn, cache, scenario)


# CI time: a StaticCache with eager attention generates in neither a graph nor a loop of its own (its prefill and
# decode graphs are test_logits_match's static-eager cases; generate's loop runs with SDPA on a StaticCache, and
# eager where the family has no SDPA)
GENERATE = matrix(CACHES, drop={("eager", "static")})


def test_logits_match_bf16():
    """bf16 weights: kvpass attention computes in fp32, the model's own in bf16 -> bf16 tolerance."""
    check_forward("llama", "sdpa", "dynamic", "decode", dtype=torch.bfloat16, atol=5e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# the matrix: greedy generate
# ------------------------------------------------------------------------------------------------


def check_generate(family, attn, cache, compiler="eager"):
    """Batch of 2 (row 0 left-padded, row 1 not): 16 greedy tokens, compiled vs uncompiled model."""
    ids, mask = left_padded(GEN_PROMPT, seed=5)
    expected = greedy(build(family, attn), ids, mask, cache)
    model = build(family, attn)
    be = make_backend(compiler)
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    assert_same_generation(greedy(model, ids, mask, cache), expected)
    check_reports(be, model, attn, cache, min_graphs=2)  # prefill + decode


@pytest.mark.parametrize("family,attn,cache", GENERATE)
def test_greedy_generate_identical(family, attn, cache):
    check_generate(family, attn, cache)


# ------------------------------------------------------------------------------------------------
# real Inductor
# ------------------------------------------------------------------------------------------------


@pytest.mark.inductor
@pytest.mark.parametrize(
    "family,attn,cache,scenario",
    [
        pytest.param("llama", "sdpa", "dynamic", "decode", id="llama-sdpa-dynamic-decode"),
        pytest.param("gemma2", "eager", "static", "decode", id="gemma2-eager-static-decode"),
    ],
)
def test_inductor_logits_match(family, attn, cache, scenario):
    check_forward(family, attn, cache, scenario, compiler="inductor")


@pytest.mark.inductor
def test_inductor_greedy_generate_identical():
    check_generate("gemma3", "sdpa", "static", compiler="inductor")


# ------------------------------------------------------------------------------------------------
# the four ways to compile a model
# ------------------------------------------------------------------------------------------------

# the forms are the entry points, one family (CI time): every family and both attentions run through
# torch.compile(model.forward) in the matrix above
FORM_FAMILIES = [pytest.param("llama", "sdpa", id="llama-sdpa")]


@pytest.mark.parametrize("form", ["forward", "module", "model_compile"])
@pytest.mark.parametrize("family,attn", FORM_FAMILIES)
def test_compile_forms(family, attn, form):
    """``torch.compile(model.forward)``, ``torch.compile(model)`` and ``model.compile()``, fullgraph.

    Prefill plus decode steps against the uncompiled model and, where the form makes ``generate``
    run compiled (not for the ``OptimizedModule`` wrapper, whose ``generate`` is the original
    model's), 16 greedy tokens.
    """
    ref = build(family, attn)
    model = build(family, attn)
    be = make_backend()
    if form == "forward":
        model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
        fn = model.forward
    elif form == "module":  # kvpass warns that this form's .generate() runs uncompiled
        with pytest.warns(kvpass.KVPassWarning, match=r"not to \.generate\(\)"):
            fn = torch.compile(model, backend=be, fullgraph=True)
    else:
        model.compile(backend=be, fullgraph=True)
        fn = model
    ids = token_ids(1, DECODE_PROMPT, seed=6)
    expected, fed = reference_run(ref, "dynamic", ids, None, DECODE_STEPS)
    actual = run_steps(fn, fn, model, "dynamic", ids, None, fed)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_logits(a, e, f"{form} call {i}")
    check_reports(be, model, attn, "dynamic", min_graphs=2)
    if form != "module":
        n = len(be.reports)
        ids = token_ids(1, GEN_PROMPT, seed=7)
        mask = torch.ones_like(ids)
        assert_same_generation(greedy(model, ids, mask, "dynamic"), greedy(ref, ids, mask, "dynamic"))
        assert len(be.reports) > n, "generate did not run the compiled model"
        check_reports(be, model, attn, "dynamic")


def compile_config(be, **kw) -> CompileConfig:
    cc = CompileConfig(backend=be, fullgraph=True, **kw)
    cc._compile_all_devices = True  # generate auto-compiles only on accelerators otherwise
    return cc


@pytest.mark.parametrize("family,attn", FORM_FAMILIES)
def test_generate_compile_config(family, attn):
    """``generate(..., compile_config=CompileConfig(backend=kvpass.backend(...), fullgraph=True))``.

    generate compiles ``model.__call__`` for the decode steps when the cache is compileable
    (StaticCache).
    """
    ids, mask = left_padded(GEN_PROMPT, seed=8)
    expected = greedy(build(family, attn), ids, mask, "static")
    model = build(family, attn)
    be = make_backend()
    actual = greedy(model, ids, mask, "static", compile_config=compile_config(be, mode="default"))
    assert_same_generation(actual, expected)
    check_graph_ops(be.graph_ops, model.config.num_hidden_layers, min_graphs=1)
    check_reports(be, model, attn, "static")


@pytest.mark.filterwarnings("default::kvpass.KVPassWarning")
def test_generate_compile_config_default_mode():
    """CompileConfig's default mode ("reduce-overhead") reaches the backend as mode=: with the eager
    inner compiler it does not apply, said once, and the generation is still exact."""
    from kvpass.errors import _WARNED

    _WARNED.clear()
    ids = token_ids(1, GEN_PROMPT, seed=9)
    expected = greedy(build("llama", "sdpa"), ids, torch.ones_like(ids), "static")
    model = build("llama", "sdpa")
    be = make_backend()
    with pytest.warns(kvpass.KVPassWarning, match="apply to compiler='inductor' only"):
        actual = greedy(model, ids, torch.ones_like(ids), "static", compile_config=compile_config(be))
    assert_same_generation(actual, expected)
    check_graph_ops(be.graph_ops, model.config.num_hidden_layers, min_graphs=1)


def test_generate_compile_config_reports_on_user_backend():
    """CompileConfig.to_dict() deep-copies its backend: the copy must be the user's object."""
    model = build("llama", "sdpa")
    be = make_backend()
    ids = token_ids(1, GEN_PROMPT, seed=10)
    greedy(model, ids, torch.ones_like(ids), "static", compile_config=compile_config(be, mode="default"))
    assert be.graph_ops, "the decode graph was not compiled at all"
    check_reports(be, model, "sdpa", "static")


@pytest.mark.parametrize("attn", ATTNS)
def test_dynamic_true_is_rewritten(attn):
    """``torch.compile(..., dynamic=True)`` (what ``CompileConfig(dynamic=True)`` asks for) turns the
    attention ``scaling`` float into a SymFloat; the sites must still be found and rewritten."""
    model = build("llama", attn)
    be = make_backend()
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
    ids = token_ids(1, DECODE_PROMPT, seed=11)
    expected, fed = reference_run(model, "dynamic", ids, None, 2)
    actual = run_steps(fwd, fwd, model, "dynamic", ids, None, fed)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_logits(a, e, f"call {i}")
    check_reports(be, model, attn, "dynamic")
