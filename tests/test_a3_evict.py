"""``a3+evict`` (A^3 with a bounded cache) through kvpass.ChunkFusion on a tiny Llama.

* capacity >= the request: equals ``a3`` (with r = 1: a full prefill, and greedy generation equals
  HF's on the whole prompt);
* a small capacity: every layer stores exactly C - 1 entries after fusion (C once the last question
  token joins), S and Q are always kept, and the memory really shrinks;
* the kept document tokens are SnapKV's choice from the question's attention at that layer: a
  reference from HF's own attention weights (eager attention, ``output_attentions``);
* positions after eviction are exact: the compiled decode equals HF run by hand on the compacted
  cache with explicit position ids.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import families
import kvpass
from kvpass import ConfigError
from kvpass.policies import make_policy


@pytest.fixture(scope="module")
def model():
    return families.build("llama")


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(1)
    system = [1] + torch.randint(3, 90, (4,), generator=g).tolist()
    chunks = [torch.randint(3, 90, (16,), generator=g).tolist() for _ in range(3)]
    question = torch.randint(3, 90, (5,), generator=g).tolist()
    return system, chunks, question


def _fusion(model, tmp_path, **params):
    return kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), "a3+evict", compiler="eager", **params)


def test_capacity_above_the_request_equals_a3(model, parts, tmp_path):
    system, chunks, question = parts
    ids = system + sum(chunks, []) + question
    big = _fusion(model, tmp_path, ratio=1.0, capacity=4096)
    logits, fused = big.prefill(chunks, question, system=system)
    a3 = kvpass.ChunkFusion(model, big.store, "a3", compiler="eager", ratio=1.0)
    ref_logits, ref = a3.prefill(chunks, question, system=system)
    torch.testing.assert_close(logits, ref_logits)
    for mine, theirs in zip(fused.cache.layers, ref.cache.layers):
        torch.testing.assert_close(mine.keys, theirs.keys)
    assert all(k.shape[-1] == len(ids) - 1 for k in fused.kept)
    # greedy generation through the compiled forward equals HF on the whole prompt (r = 1: a full prefill)
    out = big.generate(chunks, question, system=system, max_new_tokens=5, do_sample=False)
    hf = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=5, do_sample=False
    )
    assert out.tolist() == hf.tolist()


def _reference_keep(model, ids, n_system, n_question, capacity, kernel=7):
    """Per layer, the slots SnapKV keeps from HF's own attention weights of the full prompt (r = 1)."""
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        att = ref(torch.tensor([ids[:-1]]), output_attentions=True).attentions
    length, ctx = len(ids) - 1, len(ids) - n_question
    doc = torch.zeros(length, dtype=torch.bool)
    doc[n_system:ctx] = True
    keep = []
    for a in att:  # [1, H, L, L]
        h, hkv = a.shape[1], model.config.num_key_value_heads
        votes = a[0, :, ctx:].sum(1).reshape(hkv, h // hkv, length).sum(1)  # question rows, group heads
        pooled = F.max_pool1d(votes.masked_fill(~doc, 0)[:, None], kernel, 1, kernel // 2)[:, 0]
        take = capacity - 1 - int((~doc).sum())
        # max-pooling makes plateaus: ties go to the earlier token
        top = torch.sort(torch.where(doc, pooled, float("-inf")), dim=-1, descending=True, stable=True).indices[
            :, :take
        ]
        keep.append(torch.cat([(~doc).nonzero()[:, 0].expand(hkv, -1), top], -1).sort(-1).values)
    return keep


def test_small_capacity_keeps_system_question_and_snapkv_top(model, parts, tmp_path):
    system, chunks, question = parts
    ids = system + sum(chunks, []) + question
    cap = 24
    fusion = _fusion(model, tmp_path, ratio=1.0, capacity=cap)
    fused = fusion.prepare(chunks, question, system=system)
    hkv, d = model.config.num_key_value_heads, model.config.head_dim
    for layer, kept, want in zip(
        fused.cache.layers, fused.kept, _reference_keep(model, ids, len(system), len(question), cap)
    ):
        assert layer.keys.shape == (1, hkv, cap - 1, d) == layer.values.shape
        assert kept.shape == (1, hkv, cap - 1)
        assert kept[0].tolist() == want.tolist()
    assert "evict" in fused.timings
    # one more token: every layer holds C entries
    fusion.forward(input_ids=torch.tensor([[ids[-1]]]), past_key_values=fused.cache, use_cache=True)
    assert {layer.keys.shape[2] for layer in fused.cache.layers} == {cap}
    assert fusion.backend.runtime.state.seen == len(ids)


def test_positions_after_eviction_are_exact(model, parts, tmp_path):
    """The compiled decode on the compacted cache equals HF run by hand on a copy of it with the true
    position ids (the request's length, then one more), over two steps."""
    system, chunks, question = parts
    ids = system + sum(chunks, []) + question
    fusion = _fusion(model, tmp_path, ratio=0.25, capacity=20)
    fused = fusion.prepare(chunks, question, system=system)
    ref_cache = copy.deepcopy(fused.cache)
    tok = ids[-1]
    for step in range(2):
        pos = len(ids) - 1 + step
        with torch.no_grad():
            mine = fusion.forward(input_ids=torch.tensor([[tok]]), past_key_values=fused.cache, use_cache=True).logits
            ref = model(
                input_ids=torch.tensor([[tok]]),
                past_key_values=ref_cache,
                use_cache=True,
                position_ids=torch.tensor([[pos]]),
            ).logits
        torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)
        tok = int(ref[0, -1].argmax())
    # and HF with the positions the short cache implies would differ: the fix is not a no-op
    with torch.no_grad():
        wrong = model(
            input_ids=torch.tensor([[ids[-1]]]),
            past_key_values=copy.deepcopy(fusion.prepare(chunks, question, system=system).cache),
            use_cache=True,
        ).logits
    assert not torch.allclose(wrong, fusion.prefill(chunks, question, system=system)[0][:, None], atol=1e-4)


def test_configuration(model, tmp_path):
    with pytest.raises(ConfigError, match="'kernel' must be odd"):
        _fusion(model, tmp_path, kernel=4)
    with pytest.raises(ConfigError, match="'capacity'"):
        _fusion(model, tmp_path, capacity=1)
    fusion = _fusion(model, tmp_path)
    with pytest.raises(ConfigError, match="question of at least 2 tokens"):
        fusion.prepare([[5, 6, 7, 8]], [9])
    with pytest.raises(ConfigError, match=r"max_new_tokens, eos_token_id and do_sample=False, got \['num_beams'\]"):
        fusion.generate([[5, 6, 7, 8]], [9, 10], num_beams=2)
    with pytest.raises(ConfigError, match="do_sample=True"):
        fusion.generate([[5, 6, 7, 8]], [9, 10], do_sample=True)
    # the name holds a '+', yet it is one policy, not a composition of 'a3' and 'evict'
    assert repr(make_policy("a3+evict", capacity=512)) == "A3Evict(ratio=0.15, capacity=512, kernel=7)"
