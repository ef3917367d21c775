"""Chunk fusion (a3, cacheblend, legolink, pie, full_reuse) through kvpass.ChunkFusion on tiny models.

* a3 with r = 1 (and cacheblend with r = 1) equals a full prefill: logits, every layer's K/V, greedy
  generation through ``model.generate`` on the fused cache;
* pie with one chunk at offset 0 equals a full prefill;
* the recompute pass is exact: a hand reference with plain HF (the merged cache built from each
  segment computed alone at its true positions, the recomputed tokens appended with an explicit
  additive mask that hides their stale copies and every later position) gives the same logits and
  K/V, so a recomputed token never sees a later position;
* what each baseline stores and recomputes; store reuse; configuration errors.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import families
import kvpass
from kvpass import ConfigError
from kvpass.chunks.rope import layer_keys


@pytest.fixture(scope="module")
def model():
    return families.build("llama")


@pytest.fixture(scope="module")
def request_parts():
    g = torch.Generator().manual_seed(0)
    system = [1] + torch.randint(3, 90, (5,), generator=g).tolist()
    chunks = [torch.randint(3, 90, (12,), generator=g).tolist() for _ in range(3)]
    question = torch.randint(3, 90, (4,), generator=g).tolist()
    return system, chunks, question


def _full(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[:, -1]
    return logits, layer_keys(model, torch.tensor([ids]), torch.arange(len(ids))[None])


def _close(a, b, tol=2e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=1e-4)


@pytest.mark.parametrize("policy,compiler", [("a3", "aot_eager"), ("cacheblend", "eager")])
def test_ratio_one_equals_full_prefill(model, request_parts, tmp_path, policy, compiler):
    system, chunks, question = request_parts
    ids = system + sum(chunks, []) + question
    ref_logits, ref_kv = _full(model, ids)
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), policy, compiler=compiler, ratio=1.0)
    logits, fused = fusion.prefill(chunks, question, system=system)
    assert fused.recompute.tolist() == list(range(len(system), len(system) + 36))
    _close(logits, ref_logits)
    for i, (k, v) in enumerate(ref_kv):
        _close(fused.cache.layers[i].keys, k)
        _close(fused.cache.layers[i].values, v)
    plans = [p for r in fusion.backend.reports for p in r.plans.values()]
    assert any(p.startswith("overwrite") for p in plans) and any(p.startswith("evict") for p in plans)
    if policy == "a3":  # HF generation on the fused cache continues exactly like the full prompt
        out = fusion.generate(chunks, question, system=system, max_new_tokens=4, do_sample=False)
        ref = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=4,
            do_sample=False,
        )
        assert out.tolist() == ref.tolist()


def test_pie_single_chunk_at_offset_zero_equals_full_prefill(model, request_parts, tmp_path):
    _, chunks, question = request_parts
    ids = chunks[0] + question
    ref_logits, ref_kv = _full(model, ids)
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), "pie", compiler="eager")
    logits, fused = fusion.prefill([chunks[0]], question)
    assert fused.recompute.numel() == 0 and fused.spans["question"] == (12, 16)
    _close(logits, ref_logits)
    for i, (k, v) in enumerate(ref_kv):
        _close(fused.cache.layers[i].keys, k)
        _close(fused.cache.layers[i].values, v)


def _hand_reference(model, segments, question, recompute):
    """Plain HF: the merged cache from each segment alone at its true positions, then [Re, Q] appended
    with an explicit mask (stale copies of Re hidden, causal by true position)."""
    starts, pos = [], 0
    for s in segments:
        starts.append(pos)
        pos += len(s)
    ctx = pos
    cache = DynamicCache(config=model.config)
    per_seg = [layer_keys(model, torch.tensor([s]), (torch.arange(len(s)) + a)[None]) for s, a in zip(segments, starts)]
    for i in range(model.config.num_hidden_layers):
        cache.update(torch.cat([p[i][0] for p in per_seg], 2), torch.cat([p[i][1] for p in per_seg], 2), i)
    ids = sum(segments, []) + question
    new = torch.cat([recompute, torch.arange(ctx, ctx + len(question))])
    qp = new[:, None]
    slot_ok = (torch.arange(ctx)[None, :] <= qp) & ~torch.isin(torch.arange(ctx), recompute)[None, :]
    new_ok = new[None, :] <= qp
    visible = torch.cat([slot_ok, new_ok], 1)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids])[:, new],
            position_ids=new[None],
            past_key_values=cache,
            attention_mask=mask,
            use_cache=True,
        )
    return out.logits[:, -1], cache, ctx, new


def test_recompute_pass_is_exact(request_parts, tmp_path):
    model = families.build("llama", attn="eager")  # the hand reference needs an explicit 4-D mask
    system, chunks, question = request_parts
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), "a3", compiler="eager", ratio=0.3)
    logits, fused = fusion.prefill(chunks, question, system=system)
    re = fused.recompute
    assert re.numel() == 11 and bool((re >= len(system)).all())  # ceil(0.3 * 36) document tokens
    ref_logits, ref_cache, ctx, new = _hand_reference(model, [system] + chunks, question, re)
    _close(logits, ref_logits)
    keep = torch.tensor([j for j in range(ctx) if j not in set(re.tolist())])
    for i in range(model.config.num_hidden_layers):
        for got, want in (
            (fused.cache.layers[i].keys, ref_cache.layers[i].keys),
            (fused.cache.layers[i].values, ref_cache.layers[i].values),
        ):
            _close(got[:, :, keep], want[:, :, keep])  # reused entries: stored, re-rotated
            _close(got[:, :, new], want[:, :, ctx:])  # recomputed entries: the exact mask's
    # the mask itself: no recomputed token sees a later position, each sees all earlier ones
    from kvpass.ops import position_mask

    vis = position_mask(new[None], torch.arange(len(fused.input_ids[0]))[None, None])[0, 0]
    assert torch.equal(vis, torch.arange(vis.shape[1])[None, :] <= new[:, None])


def test_later_chunks_never_change_earlier_entries(model, request_parts, tmp_path):
    """legolink recomputes the first tokens of chunks 2 and 3; replacing chunk 3 leaves every entry
    before it unchanged (recomputed ones included), and changes the question's entries after it."""
    system, chunks, question = request_parts
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), "legolink", compiler="eager", prefix=4)
    a = fusion.prepare(chunks, question)
    other = chunks[:2] + [list(reversed(chunks[2]))]
    b = fusion.prepare(other, question)
    assert a.recompute.tolist() == [12, 13, 14, 15, 24, 25, 26, 27]  # first chunk (position 0) is exact
    for i in range(model.config.num_hidden_layers):
        assert torch.equal(a.cache.layers[i].keys[:, :, :24], b.cache.layers[i].keys[:, :, :24])
        if i > 0:  # (layer 0's K/V depend on the token and its position only)
            assert not torch.equal(a.cache.layers[i].keys[:, :, 36:], b.cache.layers[i].keys[:, :, 36:])


def test_baselines_store_what_they_say(model, request_parts, tmp_path):
    system, chunks, question = request_parts
    store = kvpass.ChunkStore(tmp_path, model)
    segs = [system] + chunks
    starts = [0, 6, 18, 30]
    alone0 = [layer_keys(model, torch.tensor([s]), torch.arange(len(s))[None]) for s in segs]
    alone_true = [layer_keys(model, torch.tensor([s]), (torch.arange(len(s)) + a)[None]) for s, a in zip(segs, starts)]
    for policy, expect in (("full_reuse", alone0), ("pie", alone_true)):
        fusion = kvpass.ChunkFusion(model, store, policy, compiler="eager")
        fused = fusion.prepare(chunks, question, system=system)
        assert fused.recompute.numel() == 0 and fused.cache.get_seq_length() == 45
        for i in range(model.config.num_hidden_layers):
            for (a, _), e in zip(zip(starts, segs), expect):
                n = e[i][0].shape[2]
                _close(fused.cache.layers[i].keys[:, :, a : a + n], e[i][0])
                _close(fused.cache.layers[i].values[:, :, a : a + n], e[i][1])
    assert fused.sources == {"memory": 4}  # every segment came from the store
    s = store.stats()
    assert s["computed"] == 4 and s["disk_entries"] == 4


def test_configuration_errors(model, tmp_path):
    store = kvpass.ChunkStore(tmp_path, model)
    with pytest.raises(ConfigError, match="chunk-fusion policy"):
        kvpass.ChunkFusion(model, store, "snapkv")
    with pytest.raises(ConfigError, match="'ratio' must be float in \\[0.0, 1.0\\]"):
        kvpass.ChunkFusion(model, store, "a3", ratio=1.5)
    with pytest.raises(ConfigError, match="'prefix'"):
        kvpass.ChunkFusion(model, store, "legolink", prefix=-1)
    with pytest.raises(ConfigError, match="another model"):
        kvpass.ChunkFusion(families.build("llama", seed=3), store, "pie")
    with pytest.raises(ConfigError, match="at least one chunk"):
        kvpass.ChunkFusion(model, store, "pie", compiler="eager").prepare([], [5, 6])


def test_plain_backend_refuses_fusion_policies(model):
    """kvpass.backend("a3") in an ordinary generation would be a full prefill under a fusion name: it
    raises instead (the eval runner reports the policy unavailable with this reason)."""
    fwd = torch.compile(model.forward, backend=kvpass.backend("a3", compiler="eager"), fullgraph=True)
    with pytest.raises(ConfigError, match="kvpass.ChunkFusion"):
        fwd(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=DynamicCache(config=model.config), use_cache=True)
