"""Graphs kvpass does not fully understand are compiled unchanged, with one warning saying why."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import StaticCache

import kvpass
from families import build
from kvpass.errors import _WARNED


@pytest.fixture(autouse=True)
def fresh_warnings():
    _WARNED.clear()
    yield


def _compile_and_run(model, be, **inputs):
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fwd(**inputs)
    return out, [w for w in caught if issubclass(w.category, kvpass.KVPassWarning)]


def test_attention_probabilities_used_elsewhere_fall_back():
    """Eager attention whose probabilities leave the block (output_attentions) cannot become an op."""

    def attn(q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1)
        return torch.matmul(p, v), p

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    be = kvpass.backend("full", compiler="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, probs = torch.compile(attn, backend=be, fullgraph=True)(q, k, v)
    warned = [w for w in caught if issubclass(w.category, kvpass.KVPassWarning)]
    assert len(warned) == 1
    msg = str(warned[0].message)
    assert "compiling a graph unchanged" in msg and "probabilities are used outside" in msg
    assert be.reports[-1].rewritten == 0
    ref_out, ref_p = attn(q, k, v)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(probs, ref_p)


def test_plain_eager_attention_block_is_rewritten():
    """The same block without the extra use is a site: the pass is not simply always falling back."""

    def attn(q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3, dim=-1)
        return torch.matmul(p, v)

    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    be = kvpass.backend("full", compiler="eager")
    out = torch.compile(attn, backend=be, fullgraph=True)(q, k, v)
    assert be.reports[-1].rewritten == 1
    torch.testing.assert_close(out, attn(q, k, v))


def test_eviction_on_static_cache_falls_back():
    model = build("llama")
    ids = torch.randint(3, 90, (1, 7))
    be = kvpass.backend("streamingllm", compiler="eager", budget=4, sinks=1)
    cache = StaticCache(config=model.config, max_cache_len=16)
    out, warned = _compile_and_run(model, be, input_ids=ids, past_key_values=cache, use_cache=True)
    assert len(warned) == 1 and "can shrink" in str(warned[0].message)
    with torch.no_grad():
        ref = model(input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=16), use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits)


def test_warns_once_per_reason():
    model = build("llama")
    be = kvpass.backend("streamingllm", compiler="eager", budget=4, sinks=1)
    fwd = torch.compile(model.forward, backend=be)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (7, 9):  # two compiled graphs, the same reason
            fwd(
                input_ids=torch.randint(3, 90, (1, n)),
                use_cache=True,
                past_key_values=StaticCache(config=model.config, max_cache_len=16),
            )
    assert len(be.reports) == 2
    assert sum(issubclass(w.category, kvpass.KVPassWarning) for w in caught) == 1


def test_training_dropout_falls_back():
    """SDPA with dropout (a training graph) is not an inference attention site."""

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)

    be = kvpass.backend("full", compiler="eager")
    q = torch.randn(1, 2, 4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(f, backend=be, fullgraph=True)(q, q, q)
    assert any("dropout" in str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning))
    assert be.reports[-1].rewritten == 0


def test_graph_without_attention_is_left_alone_silently():
    """`full` has nothing to apply anywhere, so a graph without attention is no news under it (an evicting
    policy says so: tests/test_reach.py, the Mamba case)."""
    be = kvpass.backend("full", compiler="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda x: x.relu() + 1, backend=be, fullgraph=True)(torch.randn(3))
    assert out.shape == (3,)
    assert not [w for w in caught if issubclass(w.category, kvpass.KVPassWarning)]
    assert be.reports[-1].sites == [] and be.reports[-1].rewritten == 0


def test_explain_reports_every_layer():
    model = build("gemma3", "sdpa")
    ex = kvpass.explain(
        model,
        {"input_ids": torch.randint(3, 90, (1, 9)), "use_cache": True},
        policy="streamingllm",
        budget=4,
        sinks=1,
        verbose=False,
    )
    assert [r["layer"] for r in ex.rows] == [0, 1, 2]
    assert [r["kind"] for r in ex.rows] == ["sliding", "sliding", "global"]
    assert ex.rows[0]["sliding_window"] == 8 and ex.rows[2]["sliding_window"] is None
    assert all(r["rope"] and r["residual"] for r in ex.rows)
    assert ex.rows[2]["plan"].startswith("evict") and ex.rows[0]["plan"].startswith("attention")
    assert "layer" in ex.table() and repr(ex).startswith("Explanation(")
