"""One loop of checks over every registered policy (the entries of ``tests/conformance.py``).

A policy's checks share its runs (a module-level memo; a test file runs in one worker), so the loop
costs about five compiled generations per policy.

For each policy with its cheap (``noop``) and demanding setting, on the tiny two-layer Llama:

* the no-op setting gives ``full``'s logits at every call (prefill and each greedy decode step);
* the demanding setting stores at most ``kept(P, T)`` entries per layer, in bytes of the cache's tensors;
* on a ``kvpass.SlotCache`` the demanding setting gives the DynamicCache's logits, fed the same tokens;
* a left-padded batch, run by the backend that ran the long prompt before, gives each row what the row gives
  alone with a fresh backend (so state also resets between prompts; a policy that skips the padded batch checks
  the reset on its own);
* the no-op setting equals the uncompiled model on sliding-window layers, spelled with and without
  ``layer_types``, on a DynamicCache and on a SlotCache (one policy per mechanism: a no-op never scores; each
  policy both spellings, one per cache, every pair of them by half the mechanisms);
* a chunk-fusion policy outside ``kvpass.ChunkFusion`` is refused with a message naming it.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

import kvpass
from conformance import CONFORMANCE, NEW, PROMPT, PUNCT, UNEVEN, one_per_mechanism
from families import build, skip_uneven_layers_on_old_stacks, symbolic_lengths
from kvpass.policies import POLICIES

PLAIN = sorted(n for n, e in CONFORMANCE.items() if not e.driver)
FUSION = sorted(n for n, e in CONFORMANCE.items() if e.driver == "fusion")


@pytest.fixture(scope="module")
def model():
    return build("llama")


def prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 90, (1, n), generator=g)
    ids[torch.rand(1, n, generator=g) < 0.15] = PUNCT[seed % 2]
    return ids


def decode(model, be, ids, cache, tokens=None, mask=None):
    """Prefill ``ids`` then ``NEW`` steps (greedy from row 0's logits per row, or feeding ``tokens``); returns
    (tokens fed ``[NEW, B, 1]``, logits of every call)."""
    fwd = model.forward if be == "eager-uncompiled" else torch.compile(model.forward, backend=be, fullgraph=True)
    kw = {} if mask is None else dict(attention_mask=mask)
    fed, logits = [], []
    with torch.no_grad():
        logits.append(fwd(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits[:, -1])
        symbolic_lengths(cache, kw.get("attention_mask"))
        for step in range(NEW):
            nxt = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[step]
            fed.append(nxt)
            if mask is not None:
                kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(nxt)], 1)
            logits.append(fwd(input_ids=nxt, past_key_values=cache, use_cache=True, **kw).logits[:, -1])
    return torch.stack(fed), logits


def dynamic(model, policy, ids, params, **kw):
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **params)
    cache = DynamicCache(config=model.config)
    fed, logits = decode(model, be, ids, cache, **kw)
    return be, cache, fed, logits


LONG, SHORT = prompt(PROMPT, seed=2), prompt(PROMPT - 7, seed=4)
_RUNS: dict = {}


def memo(model, policy, which: str):
    """The runs several checks share: ``full`` and the demanding setting on ``LONG`` and ``SHORT``."""
    key = (policy, which)
    if key not in _RUNS:
        params = {} if policy == "full" else CONFORMANCE[policy].demanding
        _RUNS[key] = dynamic(model, policy, LONG if which == "long" else SHORT, params)
    return _RUNS[key]


def close(got, ref):
    for call, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, c=call: f"call {c}: {m}")


def test_every_policy_has_an_entry():
    assert set(CONFORMANCE) == set(POLICIES), "add the policy to tests/conformance.py"


@pytest.mark.parametrize("policy", PLAIN)
def test_noop_equals_full(model, policy):
    skip_uneven_layers_on_old_stacks(policy)
    _, _, fed, ref = memo(model, "full", "long")
    _, _, _, got = dynamic(model, policy, LONG, CONFORMANCE[policy].noop, tokens=fed)
    close(got, ref)


@pytest.mark.parametrize("policy", PLAIN)
def test_budget_is_respected_in_bytes(model, policy):
    skip_uneven_layers_on_old_stacks(policy)
    _, cache, _, _ = memo(model, policy, "long")
    cfg = model.config
    per_entry = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K and V, fp32
    bound = CONFORMANCE[policy].kept(PROMPT, NEW)
    for i, layer in enumerate(cache.layers):
        stored = layer.keys.nbytes + layer.values.nbytes
        assert stored <= bound * per_entry, f"layer {i}: {stored} bytes, bound {bound} entries of {per_entry} bytes"
    if bound < PROMPT:  # the demanding setting evicts: the memory is freed, not masked
        assert all(layer.keys.shape[-2] < PROMPT for layer in cache.layers)


@pytest.mark.parametrize("policy", [n for n in PLAIN if CONFORMANCE[n].unpadded])
def test_state_resets_between_prompts(model, policy):
    """A backend reused for a second prompt gives what a fresh one gives (the left-padded batch below checks this
    too, with the backend of the long prompt, for every policy it runs)."""
    skip_uneven_layers_on_old_stacks(policy)
    be, _, _, _ = memo(model, policy, "long")
    torch._dynamo.reset()
    _, reused = decode(model, be, SHORT, DynamicCache(config=model.config))
    close(reused, memo(model, policy, "short")[3])


@pytest.mark.parametrize("policy", PLAIN)
def test_slot_cache_equals_dynamic_cache(model, policy):
    skip_uneven_layers_on_old_stacks(policy)
    _, _, fed, ref = memo(model, policy, "long")
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **CONFORMANCE[policy].demanding)
    cache = kvpass.SlotCache(model, be, max_length=PROMPT + NEW, max_new_tokens=NEW)
    _, got = decode(model, be, LONG, cache, tokens=fed)
    close(got, ref)
    assert cache.seen == PROMPT + NEW


@pytest.mark.parametrize("policy", PLAIN)
def test_left_padded_batch_equals_rows_alone(model, policy):
    """A left-padded batch gives each row what it gives alone; a policy whose layers store different lengths is
    refused by name at the prefill (transformers sizes the decode step's padding mask by layer 0's cache, and the
    next step would fail inside Dynamo's trace of the model)."""
    uneven = CONFORMANCE[policy].unpadded == UNEVEN
    if CONFORMANCE[policy].unpadded and not uneven:
        pytest.skip(CONFORMANCE[policy].unpadded)
    pad = PROMPT - SHORT.shape[1]
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), SHORT], 1), LONG])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    if uneven:
        be = kvpass.backend(policy, compiler="eager", **CONFORMANCE[policy].demanding)
        with pytest.raises(
            kvpass.ConfigError, match=f"policy '{policy}' keeps .* of this left-padded batch on a DynamicCache"
        ):
            decode(model, be, ids, DynamicCache(config=model.config), mask=mask)
        return
    skip_uneven_layers_on_old_stacks(policy)
    be = memo(model, policy, "long")[0]  # reused after the long prompt: its state must reset for this one
    torch._dynamo.reset()
    _, both = decode(model, be, ids, DynamicCache(config=model.config), mask=mask)
    for row, which in ((0, "short"), (1, "long")):  # greedy per row: the rows pick their own tokens
        close([x[row : row + 1] for x in both], memo(model, policy, which)[3])


SPELLINGS = {  # a sliding window as configs spell it: no layer_types (Mistral 7B v0.1, Phi-3), and layer_types
    "sliding_window": lambda: tf.MistralConfig(**SMALL, sliding_window=8),
    "layer_types": lambda: tf.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=1),
}
SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def sliding_models():
    """Per spelling: a tiny model whose layers slide over 8 tokens (all of them, or the second), and the
    uncompiled model's logits for ``LONG`` (40 tokens, five windows) and greedy tokens after it."""
    out = {}
    for name, make in SPELLINGS.items():
        cfg = make()
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        m = (tf.MistralForCausalLM if name == "sliding_window" else tf.Qwen2ForCausalLM)(cfg).eval()
        with torch.no_grad():
            m.get_output_embeddings().weight.mul_(8.0)
        fed, ref = decode(m, "eager-uncompiled", LONG, DynamicCache(config=m.config))
        out[name] = (m, fed, ref)
    return out


def sliding_cases():
    # at the no-op setting nothing is evicted, so a scorer on a shared frame never scores: one per mechanism; each
    # policy runs both spellings, one per cache, the pairing alternating from policy to policy, so every (spelling,
    # cache) pair runs half the mechanisms (CI time; the errors this found were the caches', not a policy's)
    spellings = list(SPELLINGS)
    for i, policy in enumerate(one_per_mechanism([n for n, e in CONFORMANCE.items() if not e.driver])):
        for j, cache in enumerate(("dynamic", "slot")):
            spelling = spellings[(i + j) % 2]
            yield pytest.param(policy, spelling, cache, id=f"{policy}-{spelling}-{cache}")


@pytest.mark.parametrize("policy,spelling,cache", list(sliding_cases()))
def test_noop_equals_uncompiled_on_sliding_windows(sliding_models, policy, spelling, cache):
    """Every mechanism's no-op setting equals the uncompiled model on a model whose layers slide, however the
    config spells it, on both caches. It found three silent errors: a SlotCache read ``layer_types`` only (under a
    Mistral-style config even ``full`` diverged from the second new token on); an evicting policy's decode
    graphs rewritten over a prefill compiled unchanged (fastkv without a gate); and the gated policies on the
    ``layer_types`` model's DynamicCache (a global layer 0 that appends, a sliding layer 1 that records its ring)
    took the tokens seen from layer 0's stale record, so RoPE positions stopped moving from the second step."""
    skip_uneven_layers_on_old_stacks(policy)
    m, fed, ref = sliding_models[spelling]
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **CONFORMANCE[policy].noop)
    kv = (
        DynamicCache(config=m.config)
        if cache == "dynamic"
        else kvpass.SlotCache(m, be, max_length=PROMPT + NEW, max_new_tokens=NEW)
    )
    _, got = decode(m, be, LONG, kv, tokens=fed)
    close(got, ref)


@pytest.mark.parametrize("policy", FUSION)
def test_fusion_policy_outside_chunk_fusion_is_refused(model, policy):
    """Compiled on its own, a chunk-fusion policy has nothing to fuse: its prefill raises, naming
    kvpass.ChunkFusion, never a silent run that looks like the policy's (pie, legolink and full_reuse ran as
    ``full`` before this loop)."""
    be = kvpass.backend(policy, compiler="eager")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    with pytest.raises(kvpass.ConfigError, match="run requests through kvpass.ChunkFusion"):
        with torch.no_grad():
            fwd(input_ids=LONG, past_key_values=DynamicCache(config=model.config), use_cache=True)


def test_decode_follows_a_prefill_compiled_unchanged(sliding_models):
    """fastkv at its default layer (L // 2: the two-layer model's last, so no gate) compiles its prefill
    unchanged, with a warning; its decode graphs must follow (they read state only a rewritten prefill
    records). Rewritten over the unchanged prefill's sliding cache they left the model from the second step."""
    m, fed, ref = sliding_models["sliding_window"]
    torch._dynamo.reset()
    be = kvpass.backend("fastkv", compiler="eager", budget=1000, window=4)
    with pytest.warns(kvpass.KVPassWarning, match="no candidate selection layer"):
        _, got = decode(m, be, LONG, DynamicCache(config=m.config), tokens=fed)
    close(got, ref)
    assert be.plans()["decode"] == [
        f"unchanged: the prefill graph was compiled unchanged ({be.reports[0].problems[0]}),"
        f" so its decode steps run unchanged too"
    ]
