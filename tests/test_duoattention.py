"""duoattention: retrieval heads keep the whole context, streaming heads their sinks and recent window.

Against independent references: every head a retrieval head is ``full``; every head a streaming head is
``streamingllm`` with ``sinks`` and a budget of ``sinks + recent``, on both caches; a mixed pattern gives, through
prefill, decode steps and a one-token append, the logits of the uncompiled model with each streaming head's keys
outside its window masked (an attention function of the test's own, registered with transformers), and the same on
a SlotCache, where a streaming head is a ring of ``sinks + recent + 1`` slots. A bad pattern is a ConfigError
naming the parameter before anything compiles.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.cache import ragged
from kvpass.errors import ConfigError, KVPassWarning
from kvpass.policies import make_policy
from test_adakv import PROMPT, calls, compiled, prompt_ids

PATTERN = os.path.join(os.path.dirname(__file__), "data", "duo_pattern_llama.tsv")  # layers x KV heads
SINKS, RECENT = 4, 16
STEPS = dict(steps=3, append=1, more=2)
STREAMING: dict[int, list[int]] = {}  # layer -> its streaming KV heads (the reference below masks them)


def windowed_heads(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention; after the prefill a streaming head's query sees its sinks and the latest ``RECENT + 1``
    positions of the call (its own included)."""
    b, h, q, d = query.shape
    group = h // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    n = k.shape[2]
    s = (query @ k.transpose(2, 3)) * (scaling if scaling is not None else d**-0.5)
    s = s.masked_fill(torch.arange(n) > torch.arange(n - q, n)[:, None], float("-inf"))  # causal
    if n > PROMPT:
        j = torch.arange(n)
        out = (j >= SINKS) & (j <= n - 1 - (RECENT + 1))
        heads = torch.zeros(h, dtype=torch.bool)
        for kv in STREAMING.get(module.layer_idx, []):
            heads[kv * group : (kv + 1) * group] = True
        s = s.masked_fill(heads[None, :, None, None] & out, float("-inf"))
    return (torch.softmax(s.float(), -1).to(v.dtype) @ v).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("kvpass_test_windowed_heads", windowed_heads)


def duo(model, streaming, cache="dynamic"):
    be, fwd = compiled(model, "duoattention", pattern=PATTERN, streaming=streaming, sinks=SINKS, recent=RECENT)
    store = (
        DynamicCache(config=model.config)
        if cache == "dynamic"
        else kvpass.SlotCache(model, be, max_length=PROMPT + 8, max_new_tokens=8)
    )
    return be, store, calls(fwd, store, prompt_ids(), **STEPS)


def close(got, ref):
    assert len(got) == len(ref)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "slot"])
def test_all_retrieval_is_full_and_all_streaming_is_streamingllm(cache):
    model = build("llama")
    full = calls(compiled(model, "full")[1], DynamicCache(config=model.config), prompt_ids(), **STEPS)
    close(duo(model, 0.0, cache)[2], full)
    stream = calls(
        compiled(model, "streamingllm", budget=SINKS + RECENT, sinks=SINKS)[1],
        DynamicCache(config=model.config),
        prompt_ids(),
        **STEPS,
    )
    be, store, got = duo(model, 1.0, cache)
    close(got, stream)
    if cache == "slot":  # each streaming head: a ring of sinks + recent + 1 slots, full after the steps
        for lay in store.layers:
            assert lay.state[0][0, :, ragged.LENGTH].tolist() == [SINKS + RECENT + 1] * 2


@pytest.mark.parametrize("cache", ["dynamic", "slot"])
def test_mixed_heads_attend_as_the_windowed_reference(cache):
    """The pattern (layer 0: 0.9 0.1; layer 1: 0.2 0.8) at streaming=0.5: head 1 of layer 0 and head 0 of layer 1
    stream."""
    model = build("llama")
    be, store, got = duo(model, 0.5, cache)
    STREAMING.update({0: [1], 1: [0]})
    try:
        ref = calls(
            build("llama", "kvpass_test_windowed_heads").forward,
            DynamicCache(config=model.config),
            prompt_ids(),
            **STEPS,
        )
    finally:
        STREAMING.clear()
    close(got, ref)
    new = 3 + 1 + 2
    if cache == "dynamic":  # the retrieval head holds the prompt and the new tokens, the streaming one its window
        for layer, streaming in ((0, 1), (1, 0)):
            ranges = be.state.layer(layer).extra["heads"][0]
            assert ranges[1 - streaming, ragged.LENGTH] == PROMPT + new
            assert ranges[streaming, ragged.LENGTH] == SINKS + RECENT + new  # a slot a step, emptied
            pos = be.state.layer(layer).pos.reshape(-1)
            start = int(ranges[streaming, ragged.START])
            live = pos[start : start + SINKS + RECENT + new]
            assert int((live >= 0).sum()) == SINKS + RECENT + 1
            assert tuple(store.layers[layer].keys.shape[2:]) == (-(-(PROMPT + SINKS + RECENT + 2 * new) // 2), 16)
    else:
        assert store.layers[0].state[0][0, :, ragged.LENGTH].tolist() == [PROMPT + new, SINKS + RECENT + 1]
    # the state reports the most entries a head holds (the retrieval head's), not a stretch of the pool
    stored = be.state.stored if cache == "slot" else be.state.stored_tokens()
    assert stored == {0: PROMPT + new, 1: PROMPT + new}


def test_the_plain_backend_runs_under_aot_autograd():
    """``torch.compile(model.forward, backend=kvpass.backend(...))`` with AOTAutograd behind the pass (Inductor's
    front half): the operators' fake kernels ask the policy for the stored length under fake tensors, where the
    pattern is read as Python numbers. A ``Path`` pattern (what ``kvpass.duo_pattern`` returns) is taken."""
    from pathlib import Path

    model = build("llama")
    _, _, ref = duo(model, 0.5)
    torch._dynamo.reset()
    be = kvpass.backend(
        "duoattention", compiler="aot_eager", pattern=Path(PATTERN), streaming=0.5, sinks=SINKS, recent=RECENT
    )
    assert be.policy.pattern == PATTERN
    got = calls(torch.compile(model.forward, backend=be), DynamicCache(config=model.config), prompt_ids(), **STEPS)
    close(got, ref)


def test_a_window_longer_than_the_cache_keeps_everything():
    """Streaming heads whose sinks + recent (64 + 256) exceed the cache's length (78) keep every token, as ``full``
    does; on a SlotCache each streaming head keeps its ring's fixed size (before, the layer was sized for the
    sequence and the rings overflowed it at the prefill)."""
    model = build("llama")
    full = calls(compiled(model, "full")[1], DynamicCache(config=model.config), prompt_ids(), **STEPS)
    be, fwd = compiled(model, "duoattention", pattern=PATTERN, streaming=1.0)
    close(calls(fwd, kvpass.SlotCache(model, be, max_length=PROMPT + 8, max_new_tokens=8), prompt_ids(), **STEPS), full)


def test_a_slot_cache_holds_the_rank_whose_share_needs_most():
    """Layer 0 of the pattern: KV head 0 retrieves, head 1 streams. One device: (40 + window) / 2 slots per head;
    over two tensor-parallel ranks (a head each), rank 0's retrieval head needs the whole 40, so every rank gets 40
    (the whole layer's average overflowed rank 0 at its prefill)."""
    policy = make_policy("duoattention", pattern=PATTERN, sinks=SINKS, recent=RECENT)
    window = SINKS + RECENT + 1
    assert policy.slot_capacity(40, 8, 0, 2) == -(-(40 + window) // 2)
    assert policy.slot_capacity(40, 8, 0, 2, ranks=2) == 40
    assert policy.slot_capacity(40, 8, 1, 2, ranks=2) == 40  # layer 1: head 0 streams, head 1 retrieves


def test_bad_patterns_are_refused_before_compiling(tmp_path):
    with pytest.raises(ConfigError, match=r"'duoattention': parameter 'pattern' is required"):
        kvpass.backend("duoattention")
    with pytest.raises(ConfigError, match=r"parameter 'pattern' names .*nowhere.tsv', which is not a file"):
        kvpass.backend("duoattention", pattern=str(tmp_path / "nowhere.tsv"))
    bad = tmp_path / "bad.tsv"
    bad.write_text("0.5\t0.1\n0.3\n")
    with pytest.raises(ConfigError, match=r"the same number of scores .* got \[1, 2\]"):
        kvpass.backend("duoattention", pattern=str(bad))
    bad.write_text("0.5\tx\n")
    with pytest.raises(ConfigError, match=r"line 1 .* not a finite number"):
        kvpass.backend("duoattention", pattern=str(bad))
    bad.write_text("0.5\tnan\n")
    with pytest.raises(ConfigError, match=r"line 1 .* not a finite number"):
        kvpass.backend("duoattention", pattern=str(bad))
    folder = tmp_path / "pattern"
    folder.mkdir()
    (folder / "full_attention_heads.tsv").write_text("0.5 0.1 0.7\n0.3 0.2 0.9\n")  # a folder: its tsv
    model = build("llama")
    for policy in ("duoattention", "duoattention+art"):  # a composition checks each member against the model
        with pytest.raises(ConfigError, match=r"has 2 layers x 3 KV heads, and this model 2 x 2: it was made for"):
            kvpass.compile(model, policy, pattern=str(folder))
    be = kvpass.backend("duoattention", pattern=str(folder))
    with pytest.raises(ConfigError, match=r"2 layers x 3 KV heads"):
        kvpass.SlotCache(model, be, max_length=64)


@pytest.mark.parametrize("lines,policy", [(1, "duoattention"), (3, "duoattention"), (3, "duoattention+art")])
def test_a_pattern_of_another_depth_compiles_the_graph_unchanged(tmp_path, lines, policy):
    """Through the plain backend (no model to check before compiling) a pattern with fewer or more layers than the
    graph's attention layers is refused for the graph as a whole, composed too: compiled unchanged, warned, nothing
    evicted."""
    pattern = tmp_path / "deeper.tsv"
    pattern.write_text("0.5\t0.1\n" * lines)
    model, ref = build("llama"), build("llama")
    be = kvpass.backend(policy, compiler="eager", pattern=str(pattern), streaming=1.0, sinks=2, recent=4)
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    with pytest.warns(KVPassWarning, match=rf"the graph has 2 attention layers and the head pattern .* {lines} "):
        got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False))
    assert all(not r.rewritten for r in be.reports) and not be.state.layers


def test_layers_of_different_lengths_decode_a_prompt_without_padding_and_refuse_a_padded_batch(tmp_path):
    """Layers with different streaming counts end at different lengths: one prompt decodes on a DynamicCache (the
    pool's empty slots are no padding), a left-padded batch is refused at the prefill by name (transformers sizes
    its padding mask by layer 0's cache)."""
    pattern = tmp_path / "uneven.tsv"
    pattern.write_text("0.1\t0.9\n0.2\t0.3\n")  # streaming=0.75: layer 0 one streaming head, layer 1 two
    model = build("llama")
    be = kvpass.backend("duoattention", compiler="eager", pattern=str(pattern), streaming=0.75, sinks=2, recent=4)
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    model.generate(ids[:1], max_new_tokens=3, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert be.state.stored[0] != be.state.stored[1], be.state
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with pytest.raises(ConfigError, match=r"keeps \d+ entries in layer 1 .* left-padded batch .* kvpass.SlotCache"):
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            past_key_values=DynamicCache(config=model.config),
        )


def test_calibration_writes_a_pattern_the_policy_takes(tmp_path, monkeypatch, capsys):
    """``kvpass.duo_pattern`` on the model itself: one score in [0, 1] per layer and KV head, cached per model and
    settings (a second call reads nothing), the model's attention implementation restored; duoattention runs on
    the pattern. (Random weights attend evenly: each head's share of the passkey is about its length over the
    prompt's.)"""
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    model = build("llama")
    path = kvpass.duo_pattern(model, samples=2, length=128, needle=8)
    assert path.parent == tmp_path / "duo" and capsys.readouterr().out.count("kvpass.duo_pattern: sample") == 2
    rows = [[float(x) for x in line.split("\t")] for line in path.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r) == 2 and all(0 < x < 0.2 for x in r) for r in rows)
    assert model.config._attn_implementation == "sdpa"
    assert kvpass.duo_pattern(model, samples=2, length=128, needle=8, progress=False) == path
    assert capsys.readouterr().out == ""
    kvpass.compile(model, "duoattention", compiler="eager", pattern=str(path), sinks=2, recent=8)
    out = model.generate(prompt_ids(), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, PROMPT + 4)
    with pytest.raises(ConfigError, match=r"'needle' \(64\) must be at most a quarter of 'length' \(128\)"):
        kvpass.duo_pattern(model, length=128, needle=64)
