"""The interface proof: a sink + window eviction that really shortens the cache.

Checks that positions stay exact after eviction (against a reference that evicts by hand and
passes explicit positions), on both HF paths (bare forward derives positions from the cache
length; generate carries them), with left-padded batches, and that the stored tensors shrink.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
from families import build

BUDGET, SINKS = 8, 2


def hand_evict(cache: DynamicCache) -> None:
    """Reference eviction: keep the first SINKS and the last BUDGET-SINKS entries of global layers."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            continue
        n = layer.keys.shape[-2]
        if n > BUDGET:
            keep = list(range(SINKS)) + list(range(n - (BUDGET - SINKS), n))
            layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]


def reference_greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        hand_evict(cache)
        tokens, all_logits, n = [], [logits[:, -1]], ids.shape[1]
        for _ in range(steps):
            nxt = all_logits[-1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            logits = model(
                input_ids=nxt,
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[n]], device=ids.device),
            ).logits
            hand_evict(cache)
            all_logits.append(logits[:, -1])
            n += 1
    return tokens, all_logits


@pytest.mark.parametrize(
    "family,attn,dynamic",
    [
        ("llama", "sdpa", False),
        ("qwen3", "eager", False),
        ("gemma3", "sdpa", False),
        ("gpt_neox", "sdpa", False),
        ("cohere2", "eager", False),
        ("llama", "sdpa", True),
        ("gemma3", "eager", True),
    ],
)
def test_bare_forward_matches_hand_eviction(family, attn, dynamic):
    """position_ids=None: the model derives positions from the shortened cache; kvpass fixes them.

    With dynamic=True the derived positions also depend on input_ids.size(1), a shape edge to an
    integer input, which must not be mistaken for positions passed in."""
    model = build(family, attn)
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    ref_tokens, ref_logits = reference_greedy(model, ids, steps=6)
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic or None)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        torch.testing.assert_close(logits, ref_logits[0], atol=1e-4, rtol=1e-4)
        for step, tok in enumerate(ref_tokens):
            logits = fwd(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[:, -1]
            torch.testing.assert_close(logits, ref_logits[step + 1], atol=1e-4, rtol=1e-4)
    evicting = [r for r in be.reports if r.evicting]
    assert evicting and all(r.positions_fixed or family == "cohere2" for r in evicting)
    # memory is real: every evicting layer stores exactly BUDGET entries
    stored = {i: layer.keys.shape[-2] for i, layer in enumerate(cache.layers)}
    for i in evicting[-1].evicting:
        assert stored[i] == BUDGET
    assert be.state.seen == ids.shape[1] + len(ref_tokens)


def test_generate_matches_hand_eviction():
    """generate carries position_ids; the compiled streaming model generates the reference tokens."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(2))
    ref_tokens, _ = reference_greedy(model, ids, steps=16)
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    out = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert out[0, ids.shape[1] :].tolist() == ref_tokens
    assert any(r.evicting for r in be.reports)


def test_cache_memory_shrinks():
    model = build("llama")
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    ids = torch.randint(3, 90, (1, 40))
    full, small = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
        fwd(input_ids=ids, past_key_values=small, use_cache=True)

    def nbytes(c):
        return sum(
            lay.keys.numel() * lay.keys.element_size() + lay.values.numel() * lay.values.element_size()
            for lay in c.layers
        )

    assert nbytes(small) * 40 == nbytes(full) * BUDGET
    # the kept tensors are compact copies, not views that pin the full prompt's storage
    for layer in small.layers:
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()


def test_left_padded_batch_equals_single_runs():
    """Batch 2 with left padding: each row continues exactly as when run alone."""
    model = build("llama")
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 90, (1, 14), generator=g)
    short = torch.randint(3, 90, (1, 10), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    model_c = build("llama")
    model_c.forward = torch.compile(model_c.forward, backend=be, fullgraph=True)
    out = model_c.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    for row, ids in ((0, short), (1, long)):
        ref_tokens, _ = reference_greedy(model, ids, steps=8)
        assert out[row, batch.shape[1] :].tolist() == ref_tokens, f"row {row}"
    # padding entries were never kept once enough real tokens existed
    for st in be.state.layers.values():
        assert (st.pos >= 0).all()


def test_noop_budget_equals_full():
    """budget >= length: streamingllm must equal full (and full equals eager)."""
    model = build("qwen2")
    ids = torch.randint(3, 90, (2, 9))
    outs = []
    for policy in ("full", "streamingllm"):
        torch._dynamo.reset()
        params = {"budget": 64} if policy == "streamingllm" else {}
        be = kvpass.backend(policy, compiler="eager", **params)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits]
            for _ in range(3):
                steps.append(fwd(input_ids=steps[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
        outs.append(steps)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_new_prefill_resets_state():
    model = build("llama")
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    with torch.no_grad():
        for n in (20, 11):
            cache = DynamicCache(config=model.config)
            fwd(input_ids=torch.randint(3, 90, (1, n)), past_key_values=cache, use_cache=True)
            assert be.state.seen == n
            for st in be.state.layers.values():
                assert st.pos.max().item() == n - 1


@pytest.mark.inductor
def test_streaming_through_inductor():
    """Real Inductor: the fake shapes/strides of every op hold, and eviction still matches by hand."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    ref_tokens, _ = reference_greedy(model, ids, steps=4)
    be = kvpass.backend("streamingllm", compiler="inductor", budget=BUDGET, sinks=SINKS)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    tokens = []
    with torch.no_grad():
        logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits
        for _ in range(4):
            tokens.append(int(logits[0, -1].argmax()))
            logits = fwd(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits
    assert tokens == ref_tokens
    assert all(layer.keys.shape[-2] == BUDGET for layer in cache.layers)
