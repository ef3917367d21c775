"""Backend object: identity (uuid), repr, the pass's own checks, and the compile forms' plumbing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.errors import _WARNED


def test_uuid_depends_on_policy_config_only():
    a, b = kvpass.backend("streamingllm", budget=64), kvpass.backend("streamingllm", budget=64)
    assert a.uuid() == b.uuid()
    assert a.uuid() != kvpass.backend("streamingllm", budget=65).uuid()
    assert a.uuid() != kvpass.backend("full").uuid()
    assert isinstance(a.kvpass, torch._inductor.custom_graph_pass.CustomGraphPass)


def test_repr_and_state_are_informative():
    be = kvpass.backend("streamingllm", budget=64, sinks=2, compiler="eager")
    assert "StreamingLLM(budget=64, sinks=2)" in repr(be) and "eager" in repr(be)
    assert "seen=0" in repr(be.state)
    assert repr(kvpass.backend("full")).startswith("kvpass.Backend(policy=Full()")


def _cache_source_mismatch_model():
    """Layers executed in reverse order: attention #0 in the graph reads cache layer 1."""
    model = build("llama")
    model.model.layers = nn.ModuleList(list(model.model.layers)[::-1])
    return model


def test_layer_index_is_checked_against_the_cache():
    _WARNED.clear()
    model = _cache_source_mismatch_model()
    be = kvpass.backend("full", compiler="eager")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fwd(input_ids=torch.randint(3, 90, (1, 6)), past_key_values=cache, use_cache=True)
        fwd(input_ids=torch.randint(3, 90, (1, 1)), past_key_values=cache, use_cache=True)
    msgs = [str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning)]
    assert any("reads the cache of layer 1" in m for m in msgs), msgs
    assert be.reports[-1].rewritten == 0


@torch.library.custom_op("flash_attn::_kvpass_test_flash_forward", mutates_args=())
def _fake_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (
        torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        .transpose(1, 2)
        .contiguous()
    )


@_fake_flash.register_fake
def _(q, k, v):
    return torch.empty_like(q)


def test_flash_attn_calls_are_detected_and_left_unchanged():
    _WARNED.clear()
    be = kvpass.backend("full", compiler="eager")
    q = torch.randn(1, 5, 2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(
            lambda q: torch.ops.flash_attn._kvpass_test_flash_forward(q, q, q), backend=be, fullgraph=True
        )(q)
    msgs = [str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning)]
    assert any("flash-attn" in m for m in msgs)
    torch.testing.assert_close(out, _fake_flash(q, q, q))


def test_compilers_agree():
    model = build("mistral")
    ids = torch.randint(3, 90, (1, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for compiler in ("eager", "aot_eager"):
            torch._dynamo.reset()
            be = kvpass.backend("full", compiler=compiler)
            got = torch.compile(model.forward, backend=be, fullgraph=True)(input_ids=ids).logits
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            assert be.reports[-1].rewritten == 2


def test_composition_runs_and_routes_parameters():
    """'full+streamingllm' evicts like streamingllm alone (full adds nothing) and routes budget."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 20))
    outs = []
    for spec in ("streamingllm", "full+streamingllm"):
        torch._dynamo.reset()
        be = kvpass.backend(spec, compiler="eager", budget=8, sinks=2)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            logits = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits]
            logits.append(fwd(input_ids=logits[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
        assert [lay.keys.shape[-2] for lay in cache.layers] == [8, 8]
        outs.append(logits)
    assert repr(be.policy) == "Full() + StreamingLLM(budget=8, sinks=2)"
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    assert [s["phase"] for s in be.reports[0].sites] == ["prefill", "prefill"]
    assert be.reports[-1].phase == "decode"


def _compiled_nodes(be, call, op):
    """Run ``call`` and return every ``op`` node of the graphs (and gated segments) the backend compiled."""
    graphs = []
    inner = be._inner
    be._inner = lambda gm, ex, *rest: (graphs.append(gm), inner(gm, ex, *rest))[1]
    call()
    return [n for gm in graphs for n in gm.graph.nodes if n.target is op]


def _attention_masks(be, call):
    """Run ``call`` and return (mask, causal) of every kvpass attention op the backend compiled."""
    return [(n.args[3], n.args[5]) for n in _compiled_nodes(be, call, torch.ops.kvpass.attention.default)]


@pytest.mark.parametrize("policy", ["full", "snapkv"])
def test_a_mask_built_from_shapes_alone_becomes_the_causal_mode(policy):
    """Eager attention always gets HF's [B, 1, N, N] mask, computed from shapes only: the op runs
    bottom-right causal instead, so the mask is never materialised; a padding mask is kept."""
    from transformers import DynamicCache

    from kvpass.ops import CAUSAL_BOTTOM_RIGHT

    model = build("llama", attn="eager")
    ids = torch.randint(3, 90, (2, 40))
    pad = torch.ones_like(ids)
    pad[1, :3] = 0
    with torch.no_grad():
        for mask_in, dropped in ((None, True), (pad, False)):
            torch._dynamo.reset()
            be = kvpass.backend(policy, compiler="eager", **({} if policy == "full" else dict(budget=16, window=4)))
            fwd = torch.compile(model.forward, backend=be, fullgraph=True)
            kw = dict(input_ids=ids, attention_mask=mask_in, use_cache=True)
            got = []
            sites = _attention_masks(
                be, lambda: got.append(fwd(**kw, past_key_values=DynamicCache(config=model.config)).logits)
            )
            assert sites and all((m is None and c == CAUSAL_BOTTOM_RIGHT) == dropped for m, c in sites), sites
            want = model(**kw, past_key_values=DynamicCache(config=model.config)).logits
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "policy,params",
    [
        ("asl", dict(budget=16, window=4, layer=0)),
        ("gemfilter", dict(budget=16, window=4, layer=0)),
        ("chunkkv", dict(budget=16, window=4)),
    ],
)
def test_window_scoring_never_keeps_a_plain_causal_mask(policy, params):
    """The prefill's window scoring (``layer_scores``) takes no mask where the model's is shapes-only causal,
    so the [B, 1, N, N] mask is never materialised (at 128k it was 16 GiB, asl's prefill peak 1.7x full's);
    with a padding mask it keeps it. Both runs give the same tokens when the padding mask is all ones."""
    from transformers import DynamicCache

    model = build("llama", attn="eager")
    ids = torch.randint(3, 90, (1, 40))
    outs = []
    with torch.no_grad():
        for mask_in, dropped in ((None, True), (torch.ones_like(ids), False)):
            torch._dynamo.reset()
            be = kvpass.backend(policy, compiler="eager", **params)
            fwd = torch.compile(model.forward, backend=be)
            kw = dict(input_ids=ids, attention_mask=mask_in, use_cache=True)
            scoring = _compiled_nodes(
                be,
                lambda: outs.append(fwd(**kw, past_key_values=DynamicCache(config=model.config)).logits),
                torch.ops.kvpass.layer_scores.default,
            )
            assert scoring and all((n.args[2] is None) == dropped for n in scoring), scoring
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("slots", [False, True])
def test_a_plain_prompt_hands_its_attention_statistics_to_h2o(slots):
    """h2o's prefill scoring takes the rows' log-sum-exp from the prefill's own attention (``attention_lse``:
    one scoring pass, not two) where the attention is plainly causal, on a DynamicCache and on a SlotCache;
    a left-padded batch keeps its mask and scores alone. The next step's logits equal those of h2o scoring
    in two passes (its plan without ``lse``)."""
    import dataclasses

    from kvpass.policies.h2o import H2O

    class TwoPass(H2O):
        def plan(self, site):
            plan = super().plan(site)
            return dataclasses.replace(plan, lse=False) if not isinstance(plan, str) else plan

    model = build("llama")
    ids = torch.randint(3, 90, (2, 40))
    pad = torch.ones_like(ids)
    pad[1, :5] = 0
    for mask_in, fused in ((None, True), (pad, False)):
        steps = []
        for policy in (H2O(budget=16), TwoPass(budget=16)):
            torch._dynamo.reset()
            be = kvpass.backend(policy, compiler="eager")
            fwd = torch.compile(model.forward, backend=be)
            cache = (
                kvpass.SlotCache(model, be, max_length=48, batch_size=2) if slots else DynamicCache(config=model.config)
            )
            logits = []

            def run():
                first = fwd(input_ids=ids, attention_mask=mask_in, past_key_values=cache, use_cache=True).logits
                nxt = first[:, -1:].argmax(-1)
                more = None if mask_in is None else torch.cat([mask_in, torch.ones_like(nxt)], -1)
                logits.append(fwd(input_ids=nxt, attention_mask=more, past_key_values=cache, use_cache=True).logits)

            with torch.no_grad():
                nodes = _compiled_nodes(be, run, torch.ops.kvpass.attention_lse.default)
            assert bool(nodes) == (fused and not isinstance(policy, TwoPass)), nodes
            steps.append(logits[0])
        torch.testing.assert_close(steps[0], steps[1], atol=1e-5, rtol=1e-5)


def test_a_window_mask_is_never_taken_for_causal():
    """A sliding-window mask whose cache does not slice (DynamicCache() without the config), traced
    dynamically at a prompt shorter than the window: it looks causal there, but the check probes
    sizes past every constant of the mask's graph, so the mask is kept and longer prompts stay exact."""
    from transformers import DynamicCache

    from families import FAMILIES

    cfg, cls = FAMILIES["mistral"]()
    cfg.sliding_window, cfg._attn_implementation = 8, "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    be = kvpass.backend("full", compiler="eager")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
    masks = _attention_masks(
        be, lambda: fwd(input_ids=torch.randint(3, 90, (1, 6)), past_key_values=DynamicCache(), use_cache=True)
    )
    assert masks and all(m is not None for m, _ in masks), masks
    with torch.no_grad():
        for n in (6, 20):
            ids = torch.randint(3, 90, (1, n))
            got = fwd(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).logits
            want = model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
