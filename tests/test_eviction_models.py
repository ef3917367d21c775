"""Prefill eviction policies in compiled models, against references that evict by hand.

* the kept entries of every layer and KV head are the ones the plain-Python reference picks from
  the uncompiled model's own attention probabilities (``output_attentions=True``): the compiled
  pass hands the policy the right queries (after RoPE, scaled) and keys;
* exactly the layer's budget is stored per layer and KV head, and the bytes shrink as computed;
* positions after eviction are exact: decode steps equal a reference that evicts the same entries
  by hand and passes explicit positions (bare ``forward``, where kvpass fixes the derived
  positions, and ``generate``, which carries them);
* ``budget >= prompt length`` equals ``full``; a left-padded batch equals its rows run alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
from eviction_reference import chunkkv_naive, sablock_naive, snapkv_naive, votes_from_attentions
from families import build, skip_uneven_layers_on_old_stacks
from kvpass.policies.prefill.pyramidkv import pyramid

BUDGET, WINDOW = 20, 6
PUNCT = [5, 7]
PARAMS = {"snapkv": {}, "pyramidkv": {}, "chunkkv": {"chunk": 4}, "sablock": {"punctuation_ids": PUNCT}}


def prompt(n: int, seed: int, b: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 90, (b, n), generator=g)
    ids[torch.rand(b, n, generator=g) < 0.15] = PUNCT[seed % 2]  # sentence ends for sablock
    return ids


def backend(policy: str, compiler: str = "eager", **over):
    return kvpass.backend(policy, compiler=compiler, **{"budget": BUDGET, "window": WINDOW, **PARAMS[policy], **over})


def global_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return [i for i, t in enumerate(types) if t != "sliding_attention"]


def layer_budgets(policy: str, layers: list[int], budget: int = BUDGET, window: int = WINDOW) -> dict[int, int]:
    if policy == "pyramidkv":
        return dict(zip(layers, pyramid(budget, window, len(layers), 20)))
    return {i: budget for i in layers}


def expected_kept(policy: str, model, ids: torch.Tensor, budget: int = BUDGET, window: int = WINDOW) -> dict[int, list]:
    """Per global layer, the kept indices [B][H_kv] the reference picks from eager attention."""
    eager = build(model.config.model_type if model.config.model_type != "gemma3_text" else "gemma3", "eager")
    with torch.no_grad():  # on the CPU, in fp32, whatever device the model under test runs on
        attn = eager(input_ids=ids.cpu(), output_attentions=True, use_cache=False).attentions
    hkv, n = model.config.num_key_value_heads, ids.shape[1]
    kv_pos = torch.arange(n).expand(ids.shape[0], hkv, n)
    out = {}
    for layer, keep in layer_budgets(policy, global_layers(model), budget, window).items():
        votes = votes_from_attentions(attn[layer], hkv, window)
        if policy == "chunkkv":
            out[layer] = [[row] * hkv for row in chunkkv_naive(votes, kv_pos, window, keep, 4)]
        elif policy == "sablock":
            group = model.config.num_attention_heads // hkv
            out[layer] = sablock_naive(votes / group, kv_pos, ids.cpu(), PUNCT, window, keep, 0.7, 1.0, 0.01, 0.9)
        else:
            out[layer] = snapkv_naive(votes, kv_pos, window, keep)
    return out


def hand_evicted_decode(model, ids, kept: dict[int, torch.Tensor], tokens: list[int]):
    """Reference: full prefill, keep `kept[layer]` ([B, H_kv, n] indices) by hand, then decode the
    given tokens with explicit positions. Returns the logits of the prefill and of every step."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        for layer, idx in kept.items():
            lay = cache.layers[layer]
            ix = idx[..., None].expand(-1, -1, -1, lay.keys.shape[-1])
            lay.keys, lay.values = lay.keys.gather(2, ix), lay.values.gather(2, ix)
        n = ids.shape[1]
        for step, tok in enumerate(tokens):
            out = model(
                input_ids=torch.tensor([[tok]], device=ids.device),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[n + step]], device=ids.device),
            )
            logits.append(out.logits[:, -1])
    return logits


def nbytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.mark.parametrize(
    "family,policy,dynamic",
    [
        ("llama", "snapkv", False),
        ("llama", "pyramidkv", False),
        ("llama", "chunkkv", False),
        ("llama", "sablock", True),
        ("gemma3", "snapkv", False),
    ],
)
def test_bare_forward_matches_hand_eviction(family, policy, dynamic):
    if policy == "pyramidkv":
        skip_uneven_layers_on_old_stacks(policy)
    model = build(family)
    ids = prompt(40, seed=1)
    want = expected_kept(policy, model, ids)
    be = backend(policy)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic or None)
    cache = DynamicCache(config=model.config)
    budgets = layer_budgets(policy, global_layers(model))
    with torch.no_grad():
        logits = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        kept = {i: be.state.layer(i).pos.clone() for i in budgets}
        # the chosen entries, the budget per layer and KV head, real bytes
        for i, keep in budgets.items():
            assert kept[i].tolist() == want[i], f"layer {i}"
            assert cache.layers[i].keys.shape[-2] == keep == kept[i].shape[-1]
            assert cache.layers[i].keys.untyped_storage().nbytes() == cache.layers[i].keys.nbytes
        if family == "llama":
            d = model.config.hidden_size // model.config.num_attention_heads
            assert nbytes(cache) == sum(2 * model.config.num_key_value_heads * b * d * 4 for b in budgets.values())
        tokens = []
        for _ in range(5):
            tokens.append(int(logits[-1].argmax()))
            logits.append(
                fwd(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[:, -1]
            )
    ref = hand_evicted_decode(model, ids, kept, tokens)
    for step, (a, b) in enumerate(zip(logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    for i, keep in budgets.items():
        assert cache.layers[i].keys.shape[-2] == keep + len(tokens)  # decode steps append
    assert be.state.seen == ids.shape[1] + len(tokens)
    assert all(r.positions_fixed for r in be.reports if r.evicting or r.appending) or family == "gemma3"
    assert any(r.appending for r in be.reports) or family == "gemma3"  # decode kept the model's cache update


def test_appending_then_exact_steps_keep_positions():
    """Decode steps that only append (bare forward: the model's own cache update, no per-layer record)
    followed by steps with an attention mask (the exact eviction rewrite, which must extend each layer's
    record by the appended tokens) equal a run whose every step takes the exact rewrite."""
    model = build("llama")
    ids = prompt(40, seed=3)
    runs = []
    for masked_from in (3, 0):
        torch._dynamo.reset()
        be = backend("snapkv")
        fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            for step in range(6):
                kw = {}
                if step >= masked_from:  # a mask that is not provably causal: the exact shape
                    kw["attention_mask"] = torch.ones(1, ids.shape[1] + step + 1, dtype=torch.long)
                out.append(
                    fwd(input_ids=out[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True, **kw).logits[
                        :, -1
                    ]
                )
        assert be.state.seen == 46 and set(be.state.stored_tokens().values()) == {BUDGET + 6}
        assert torch.equal(be.state.positions(0)[0, 0, -6:], torch.arange(40, 46))
        runs.append((torch.stack(out), be))
    (mixed, be_mixed), (exact, be_exact) = runs
    assert any(r.appending for r in be_mixed.reports) and not any(r.appending for r in be_exact.reports)
    assert [p.split(":")[0] for p in be_mixed.plans()["decode"]] == ["append", "evict"]  # both shapes ran
    torch.testing.assert_close(mixed, exact, atol=1e-5, rtol=1e-5)


def test_generate_matches_hand_eviction():
    """generate carries position_ids; sablock's continuation equals the hand-evicting reference."""
    model = build("llama")
    ids = prompt(36, seed=2)
    be = backend("sablock")
    model_c = build("llama")
    model_c.forward = torch.compile(model_c.forward, backend=be, fullgraph=True)
    out = model_c.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    tokens = out[0, ids.shape[1] :].tolist()
    kept = {i: st.pos[..., :BUDGET] for i, st in be.state.layers.items()}
    assert kept[0].tolist() == expected_kept("sablock", model, ids)[0]
    ref = hand_evicted_decode(model, ids, kept, tokens)
    assert [int(x.argmax()) for x in ref[:-1]] == tokens


def test_noop_budget_equals_full():
    """budget >= prompt length keeps everything: every policy equals full (batch 2, GQA, decode)."""
    model = build("qwen2")
    ids = prompt(9, seed=3, b=2)
    outs = {}
    for policy in ("full", "snapkv", "pyramidkv", "chunkkv", "sablock"):
        torch._dynamo.reset()
        be = kvpass.backend("full", compiler="eager") if policy == "full" else backend(policy, budget=64)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits]
            for _ in range(3):
                steps.append(fwd(input_ids=steps[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
        outs[policy] = steps
        if policy != "full":
            assert any(r.evicting for r in be.reports) and be.state.evicted_tokens == 0
    for policy, steps in outs.items():
        for a, b in zip(steps, outs["full"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=policy)


@pytest.mark.parametrize("policy", ["sablock", "chunkkv"])
def test_left_padded_batch_equals_single_runs(policy):
    """A row keeps what it keeps alone (segments and chunks start at its first real token); a row
    shorter than the budget keeps all its tokens plus padding, which stays masked."""
    model = build("llama")
    long, short = prompt(34, seed=4), prompt(22, seed=5)
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    be = backend(policy, budget=24)
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    kept = {i: st.pos[..., :24].clone() for i, st in be.state.layers.items()}
    for i in kept:
        assert (kept[i][0] >= 0).sum(-1).eq(22).all()  # every real token of the short row
    for row, ids in ((0, short), (1, long)):
        single = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert out[row, batch.shape[1] :].tolist() == single[0, ids.shape[1] :].tolist(), f"row {row}"
        if row == 1:
            for i, st in be.state.layers.items():
                assert torch.equal(kept[i][1], st.pos[0, :, :24]), f"layer {i}"


@pytest.mark.inductor
def test_snapkv_through_inductor():
    """Real Inductor: the shape contract (evict at prefill, append at decode) holds in compiled code."""
    model = build("llama")
    ids = prompt(40, seed=6)
    tokens = {}
    for compiler in ("eager", "inductor"):
        torch._dynamo.reset()
        be = backend("snapkv", compiler=compiler)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config)
        out = []
        with torch.no_grad():
            logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits
            for _ in range(4):
                out.append(int(logits[0, -1].argmax()))
                logits = fwd(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
        tokens[compiler] = out
        assert all(layer.keys.shape[-2] == BUDGET + 4 for layer in cache.layers)
    assert tokens["inductor"] == tokens["eager"]
