"""The ``art`` policy in compiled models: no-op equivalence, composition, statistics, errors."""

from __future__ import annotations

import pytest
import torch

import kvpass
from families import build

NEW = 6


def greedy(model, ids, backend=None):
    if backend is not None:
        model.forward = torch.compile(type(model).forward.__get__(model), backend=backend, fullgraph=True)
    try:
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        model.__dict__.pop("forward", None)
    return out.sequences, torch.stack(out.logits)


def prompt(b=2, n=40, seed=1):
    return torch.randint(3, 90, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "family,attn", [("llama", "sdpa"), ("gemma2", "eager"), ("qwen3", "eager"), ("phi3", "sdpa"), ("gemma3", "sdpa")]
)
def test_no_termination_equals_full(family, attn):
    """tau = phi = 0: every decode step reads every block through decode_attention == full."""
    model = build(family, attn)
    ids = prompt()
    ref_seq, ref_logits = greedy(model, ids)
    be = kvpass.backend("art", compiler="eager", tau=0.0, phi=0.0, block=16, stats=True)
    seq, logits = greedy(model, ids, be)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    decode = [r for r in be.reports if r.phase == "decode"]
    prefill = [r for r in be.reports if r.phase == "prefill"]
    assert decode and all("decode_attention" in p for r in decode for p in r.plans.values())
    assert prefill and all(p == "attention op (exact)" for r in prefill for p in r.plans.values())  # full's
    assert be.runtime.blocks_read() == 1.0


def test_composes_with_eviction():
    """streamingllm+art with ART off equals streamingllm; with ART on it still evicts."""
    model = build("llama", "sdpa")
    ids = prompt()
    base_seq, base_logits = greedy(model, ids, kvpass.backend("streamingllm", compiler="eager", budget=24))
    be = kvpass.backend("streamingllm+art", compiler="eager", budget=24, tau=0.0, phi=0.0, block=16)
    seq, logits = greedy(model, ids, be)
    assert torch.equal(seq, base_seq)
    torch.testing.assert_close(logits, base_logits, atol=1e-4, rtol=1e-4)
    assert any("decode_attention" in p and "compact" in p for r in be.reports for p in r.plans.values())
    assert max(be.state.stored_tokens().values()) <= 24


def test_termination_reads_less_and_counts_it():
    model = build("llama", "sdpa")
    be = kvpass.backend("art", compiler="eager", tau=0.9, phi=0.9, patience=1, block=16, stats=True)
    greedy(model, prompt(n=80), be)
    frac = be.runtime.blocks_read()
    assert frac is not None and frac < 1.0


@pytest.mark.parametrize(
    "params,match",
    [
        (dict(block=48), "'block' must be a power of two"),
        (dict(order="random"), "'order' must be 'recency' or 'natural'"),
        (dict(tau=2.0), "'tau' must be float in \\[0.0, 1.0\\]"),
        (dict(patience=0), "'patience' must be int"),
        (dict(phi="x"), "'phi' must be float"),
    ],
)
def test_bad_config(params, match):
    with pytest.raises(kvpass.ConfigError, match=match):
        kvpass.backend("art", **params)
