"""adakv: per-head budgets on a DynamicCache, each KV head storing what it keeps and no more.

The allocation itself is checked against a pair-by-pair ranking in ``tests/test_ragged.py``; here the policy runs in
a model: ``alpha=1`` (each head's floor the whole budget) is snapkv's uniform choice and gives snapkv's logits; a
prompt no longer than the budget gives ``full``'s; with the paper's ``alpha`` the heads keep different counts, the
layer stores exactly ``H_kv x budget`` prompt entries plus one per head and step, and the logits of prefill, decode
steps and a several-token append equal those of the uncompiled model keeping every entry but masking, per layer and
KV head, the prompt entries that head evicted (an attention function of the test's own, registered with
transformers).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvpass
from families import build, skip_uneven_layers_on_old_stacks
from kvpass.cache import ragged
from kvpass.errors import ConfigError

PROMPT, BUDGET, WINDOW = 70, 40, 8
DROPPED: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, PROMPT] True where the head evicted the entry


def prompt_ids(n=PROMPT, b=1, seed=2):
    return torch.randint(3, 90, (b, n), generator=torch.Generator().manual_seed(seed))


def calls(fwd, cache, ids, steps=3, append=4, more=2):
    """Logits of a prefill, ``steps`` greedy decode steps, one call of ``append`` tokens, ``more`` steps."""
    out, g = [], torch.Generator().manual_seed(9)
    with torch.no_grad():
        out.append(fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1])
        for i in range(steps + 1 + more):
            x = (
                torch.randint(3, 90, (ids.shape[0], append), generator=g)
                if i == steps
                else out[-1].argmax(-1, keepdim=True)
            )
            out.append(fwd(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1])
    return out


def compiled(model, policy, **kw):
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **kw)
    return be, torch.compile(model.forward, backend=be, fullgraph=True)


def masked_heads(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with the prompt entries each KV head evicted (``DROPPED``) masked out after the prefill."""
    b, h, q, d = query.shape
    group = h // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    s = (query @ k.transpose(2, 3)) * (scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:
        s = s + attention_mask[:, :, :, : k.shape[2]]
    else:  # transformers leaves out a mask that is only causal (SDPA's is_causal): bottom-right causal
        n = k.shape[2]
        s = s.masked_fill(torch.arange(n) > torch.arange(n - q, n)[:, None], float("-inf"))
    drop = DROPPED.get(module.layer_idx)
    if drop is not None and k.shape[2] > drop.shape[-1]:  # after the prefill (which attends over the whole prompt)
        gone = torch.zeros(b, h, k.shape[2], dtype=torch.bool)
        gone[:, :, : drop.shape[-1]] = drop.repeat_interleave(group, 1)
        s = s.masked_fill(gone[:, :, None, :], float("-inf"))
    return (torch.softmax(s.float(), -1).to(v.dtype) @ v).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("kvpass_test_masked_heads", masked_heads)


def test_alpha_one_is_snapkv_and_a_short_prompt_is_full():
    model = build("llama")
    ids = prompt_ids()
    snap = calls(compiled(model, "snapkv", budget=BUDGET, window=WINDOW)[1], DynamicCache(config=model.config), ids)
    be, fwd = compiled(model, "adakv", budget=BUDGET, window=WINDOW, alpha=1.0)
    ada = calls(fwd, DynamicCache(config=model.config), ids)
    for a, s in zip(ada, snap):
        torch.testing.assert_close(a, s, atol=1e-5, rtol=1e-5)
    assert be.plans()["decode"] == [
        "evict (per-head layout): heads_update + decode_attention over each head's range + compact"
    ]
    full = calls(compiled(model, "full")[1], DynamicCache(config=model.config), ids)
    whole = calls(compiled(model, "adakv", budget=PROMPT)[1], DynamicCache(config=model.config), ids)
    for a, f in zip(whole, full):
        torch.testing.assert_close(a, f, atol=1e-5, rtol=1e-5)


def test_alpha_one_over_expected_attention_is_expected_attention():
    """The scorer's plan reaches adakv's selection: expected_attention's queries before RoPE and their tables."""
    model = build("llama")
    ids = prompt_ids()
    ref = calls(
        compiled(model, "expected_attention", budget=BUDGET)[1],
        DynamicCache(config=model.config),
        ids,
        steps=2,
        append=1,
        more=0,
    )
    be, fwd = compiled(model, "adakv", budget=BUDGET, scorer="expected_attention", alpha=1.0)
    for a, r in zip(calls(fwd, DynamicCache(config=model.config), ids, steps=2, append=1, more=0), ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_ragged_heads_store_what_they_keep_and_attend_as_masked_heads(scorer="snapkv"):
    model = build("llama")
    ids = prompt_ids()
    be, fwd = compiled(model, "adakv", budget=BUDGET, window=WINDOW, scorer=scorer)
    cache = DynamicCache(config=model.config)
    got = calls(fwd, cache, ids)
    hkv, new = model.config.num_key_value_heads, 3 + 4 + 2
    counts = []
    for layer, st in be.state.layers.items():
        start, length = st.extra["heads"][..., ragged.START], st.extra["heads"][..., ragged.LENGTH]
        pool = st.pos.reshape(-1)
        held = [pool[int(start[0, g]) : int(start[0, g] + length[0, g])] for g in range(hkv)]
        prompt_kept = [h[h < PROMPT].tolist() for h in held]
        counts.append([len(p) for p in prompt_kept])
        # stored: the layer's H_kv x budget prompt entries and one entry per head and new token, no more
        assert sum(counts[-1]) == hkv * BUDGET and length[0].tolist() == [c + new for c in counts[-1]]
        assert tuple(cache.layers[layer].keys.shape) == (1, hkv, BUDGET + new, 16)
        assert all(h[-new:].tolist() == list(range(PROMPT, PROMPT + new)) for h in held)
        DROPPED[layer] = torch.tensor([[[p not in kept for p in range(PROMPT)] for kept in prompt_kept]])
    assert any(len(set(c)) > 1 for c in counts), f"no layer's heads kept different counts: {counts}"
    try:
        ref = calls(build("llama", "kvpass_test_masked_heads").forward, DynamicCache(config=model.config), ids)
    finally:
        DROPPED.clear()
    assert len(got) == len(ref)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def test_decode_steps_after_a_per_head_prefill_share_one_graph():
    """The prefill's per-head pool is stored as tensors of its own: were it a view, the first decode graph would
    guard on the view's base, which the next step's cache (the decode graph's output) lacks, and every generation
    would compile a second decode graph (Dynamo's recompile limit within a few calls)."""
    model = build("llama")
    torch._dynamo.reset()
    be = kvpass.backend("adakv", compiler="eager", budget=BUDGET, window=WINDOW)
    fwd = torch.compile(model.forward, backend=be, dynamic=True)
    calls(fwd, DynamicCache(config=model.config), prompt_ids(), steps=3, append=1, more=0)
    assert [r.phase for r in be.reports] == ["prefill", "decode"]


def test_configuration_errors_name_the_parameter():
    with pytest.raises(
        ConfigError,
        match=r"'adakv'.*'scorer' must be one of snapkv, pyramidkv, expected_attention, "
        r"criticalkv, optionally with the scorer's own parameters",
    ):
        kvpass.backend("adakv", scorer="knorm")
    with pytest.raises(ConfigError, match=r"'alpha'"):
        kvpass.backend("adakv", alpha=1.5)
    with pytest.raises(ConfigError, match=r"adakv' with scorer 'snapkv'.*'budget' must be > window"):
        kvpass.backend("adakv", budget=16)
    with pytest.raises(
        ConfigError,
        match=r"'scorer' sets 'kernell=5'; the options after 'snapkv:' are name=value "
        r"pairs of its parameters \(kernel, pool\)",
    ):
        kvpass.backend("adakv", scorer="snapkv:kernell=5")


def test_explain_shows_each_heads_count():
    model = build("llama")
    e = kvpass.explain(
        model, {"input_ids": prompt_ids(), "use_cache": True}, "adakv", budget=BUDGET, window=WINDOW, verbose=False
    )
    assert sorted(e.head_budgets) == [0, 1] and all(sum(n) == 2 * BUDGET for n in e.head_budgets.values())
    assert "kept per KV head after this prefill (row 0): layer 0: " in str(e)
    assert all("per-head layout" in r["plan"] for r in e.rows)


def test_over_pyramidkv_each_layer_keeps_the_pyramids_total():
    """Head-wise PyramidKV (scorer='pyramidkv'): each layer keeps H_kv times pyramidkv's budget for it, shared out
    among its heads; alpha=1 gives pyramidkv's logits."""
    model = build("llama")
    ids = prompt_ids()
    skip_uneven_layers_on_old_stacks("pyramidkv")
    steps = dict(steps=3, append=1, more=0)  # pyramidkv's several-token append: a known limit (UNEVEN)
    pyr = calls(
        compiled(model, "pyramidkv", budget=BUDGET, window=WINDOW)[1], DynamicCache(config=model.config), ids, **steps
    )
    be, fwd = compiled(model, "adakv", budget=BUDGET, window=WINDOW, scorer="pyramidkv", alpha=1.0)
    for a, p in zip(calls(fwd, DynamicCache(config=model.config), ids, **steps), pyr):
        torch.testing.assert_close(a, p, atol=1e-5, rtol=1e-5)
    be, fwd = compiled(model, "adakv", budget=BUDGET, window=WINDOW, scorer="pyramidkv")
    cache = DynamicCache(config=model.config)
    calls(fwd, cache, ids, steps=1, append=1, more=0)
    budgets = [be.policy.base.layer_budget(be.runtime.sites[i]) for i in range(2)]
    assert budgets[0] > BUDGET > budgets[1]
    for i, budget in enumerate(budgets):
        assert int(be.state.layer(i).extra["heads"][..., ragged.LENGTH].sum()) == 2 * (min(budget, PROMPT) + 2)


@pytest.mark.inductor
def test_inductor_decodes_the_per_head_slots_as_the_eager_compiler():
    """kvpass.compile's SlotCache path under Inductor (each head's in-place write and ranges compiled into the decode
    graph), a batch of two rows: the eager compiler's tokens."""
    ids = torch.randint(3, 90, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    out = {}
    for compiler in ("eager", "inductor"):
        torch._dynamo.reset()
        model = build("llama")
        be = kvpass.compile(model, "adakv", compiler=compiler, budget=BUDGET, window=WINDOW)
        out[compiler] = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert be.graph_counts() == {"prefill": 1, "decode": 1}
    assert torch.equal(out["eager"], out["inductor"])


def test_a_slot_cache_of_per_head_budgets_costs_what_snapkvs_does():
    """At the same budget a SlotCache of adakv holds the bytes of snapkv's: the same slots per layer (the heads share
    H_kv x (budget + room)), plus each head's ranges row (16 bytes), so a memory cap fits as many rows of it."""
    model = build("llama")
    sizes = {}
    for policy in ("snapkv", "adakv"):
        be = kvpass.backend(policy, compiler="eager", budget=BUDGET, window=WINDOW)
        cache = kvpass.SlotCache(model, be, max_length=PROMPT + 16, max_new_tokens=16, batch_size=4)
        sizes[policy] = [
            (lay.keys.nbytes + lay.values.nbytes, sum(t.nbytes for t in lay.state) + lay.pos.nbytes)
            for lay in cache.layers
        ]
    hkv = model.config.num_key_value_heads
    assert [kv for kv, _ in sizes["adakv"]] == [kv for kv, _ in sizes["snapkv"]]
    assert [rest for _, rest in sizes["adakv"]] == [rest + 4 * hkv * 16 for _, rest in sizes["snapkv"]]
