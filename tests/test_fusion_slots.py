"""Chunk fusion decoding on a ``kvpass.SlotCache`` (``ChunkFusion(..., cache="slot")``), tiny Llama.

* every fusion policy: the fused entries loaded into the slots decode exactly as the DynamicCache path
  (the last question token, then greedy steps), with ``a3+evict``'s short cache included, and the
  slots hold the kept positions;
* ``generate`` on the SlotCache counts the request's tokens, so ``a3+evict`` decodes through
  ``model.generate`` too (the DynamicCache path needs its own greedy loop);
* the slots are sized by what is kept plus the new tokens, not by the request;
* a SlotCache built by hand for a fusion policy is refused; ``cache`` is checked.
"""

from __future__ import annotations

import pytest
import torch

import families
import kvpass
from kvpass import ConfigError
from kvpass.cache.argument import with_cache

POLICIES = [
    ("a3", dict(ratio=0.25)),
    ("a3+evict", dict(ratio=0.25, capacity=24)),
    ("cacheblend", dict(ratio=0.25)),
    ("full_reuse", {}),
    ("legolink", {}),
    ("pie", {}),
]


@pytest.fixture(scope="module")
def model():
    return families.build("llama")


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(2)
    system = [1] + torch.randint(3, 90, (4,), generator=g).tolist()
    chunks = [torch.randint(3, 90, (12,), generator=g).tolist() for _ in range(3)]
    question = torch.randint(3, 90, (4,), generator=g).tolist()
    return system, chunks, question


def _decode(fusion, parts, steps: int):
    """prefill (the last question token) + greedy steps through ``decode_forward``: logits per call."""
    system, chunks, question = parts
    logits, fused = fusion.prefill(chunks, question, system=system)
    out = [logits]
    with torch.no_grad():
        for _ in range(steps):
            # the cache by the name the model's forward takes, as ChunkFusion's own prefill passes it (the other name
            # would compile a second decode graph)
            step = fusion.decode_forward(
                input_ids=out[-1].argmax(-1, keepdim=True), **with_cache(fusion.model, fused.cache), use_cache=True
            )
            out.append(step.logits[:, -1])
    return torch.stack(out), fused


@pytest.mark.parametrize("policy,params", POLICIES, ids=[p for p, _ in POLICIES])
def test_slot_decode_equals_dynamic_cache(model, parts, tmp_path, policy, params):
    store = kvpass.ChunkStore(tmp_path, model)
    ref, ref_fused = _decode(kvpass.ChunkFusion(model, store, policy, compiler="eager", **params), parts, 6)
    fusion = kvpass.ChunkFusion(model, store, policy, compiler="eager", cache="slot", **params)
    before = len(fusion.backend.reports)  # (one backend per model: the other cases' graphs are listed too)
    got, fused = _decode(fusion, parts, 6)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    n = fused.input_ids.shape[1]
    cache = fused.cache
    assert isinstance(cache, kvpass.SlotCache) and cache.seen == n + 6
    for i, kept in enumerate(ref_fused.kept):
        k = kept.shape[-1]
        assert torch.equal(cache.positions(i)[..., :k].long(), kept.long())
        assert (cache.positions(i)[..., k : k + 7] == torch.arange(n - 1, n + 6, dtype=torch.int32)).all()
    longest = max(k.shape[-1] for k in ref_fused.kept)
    assert cache.capacity == longest + 1 + 256  # prepare's default max_new_tokens
    if policy == "a3+evict":
        assert longest == 23 < n - 1
    # one decode graph, the SlotCache's append rule (no Python-side state), for the last question token
    # and every step
    decode = [r for r in fusion.backend.reports[before:] if r.phase == "decode" and r.slots]
    assert len(decode) <= 1 and all("write_slots append" in p for r in decode for p in r.plans.values())


@pytest.mark.parametrize("policy,params", [POLICIES[0], POLICIES[1]], ids=["a3", "a3+evict"])
def test_generate_on_slots(model, parts, tmp_path, policy, params):
    """``model.generate`` on the SlotCache equals the DynamicCache path's generation (``model.generate``
    for a3, ChunkFusion's greedy loop for a3+evict, whose short DynamicCache generate would misread)."""
    system, chunks, question = parts
    store = kvpass.ChunkStore(tmp_path, model)
    ref = kvpass.ChunkFusion(model, store, policy, compiler="eager", **params).generate(
        chunks, question, system=system, max_new_tokens=6, do_sample=False
    )
    fusion = kvpass.ChunkFusion(model, store, policy, compiler="eager", cache="slot", **params)
    got = fusion.generate(chunks, question, system=system, max_new_tokens=6, do_sample=False)
    assert got.tolist() == ref.tolist()
    assert "forward" not in model.__dict__  # generate's forward is restored
    # generate's max_length (prompt included) sizes the slots too: 30 new tokens where 20 (the default
    # max_new_tokens) used to be allocated, which overflowed the cache (a device-side assert)
    n = fusion.prepare(chunks, question, system=system).input_ids.shape[1]
    long = fusion.generate(chunks, question, system=system, max_length=n + 30, do_sample=False, eos_token_id=None)
    assert long.shape[1] == n + 30 and long[:, : got.shape[1]].tolist() == got.tolist()


def test_configuration(model, tmp_path):
    store = kvpass.ChunkStore(tmp_path, model)
    with pytest.raises(ConfigError, match="parameter 'cache' must be 'dynamic' or 'slot'"):
        kvpass.ChunkFusion(model, store, "a3", cache="static")
    with pytest.raises(ConfigError, match="'max_new_tokens' must be an int >= 0"):
        kvpass.ChunkFusion(model, store, "pie", compiler="eager", cache="slot").prepare(
            [[5, 6, 7]], [8, 9], max_new_tokens=-1
        )
    with pytest.raises(ConfigError, match="'max_length' must be an int >= 0"):
        kvpass.ChunkFusion(model, store, "pie", compiler="eager", cache="slot").prepare(
            [[5, 6, 7]], [8, 9], max_length=2.5
        )
    with pytest.raises(ConfigError, match="kvpass.ChunkFusion.*cache='slot'"):
        kvpass.SlotCache(model, kvpass.backend("a3", compiler="eager"), max_length=32)
    assert "cache='slot'" in repr(kvpass.ChunkFusion(model, store, "pie", compiler="eager", cache="slot"))
