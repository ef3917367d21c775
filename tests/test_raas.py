"""RaaS page-timestamp eviction on its page pool (kvpass/policies/raas.py, kvpass/kernels/page_scores.py).

* a budget that never evicts equals ``full`` (bare forward, batch 2);
* a 2,000-token decode on a tiny model never holds more than prefill + budget/16 + 1 pages, and the
  stored tensors keep the pool's size (memory flat);
* driven step by step: a page is evicted only when every decode page is full and it is the oldest;
  timestamps follow a hand-computed trace; representative keys bound every key of their page
  (hypothesis);
* the Triton scoring kernel equals its reference under the interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.kernels import page_scores as PS
from kvpass.policies import ConfigError, make_policy
from kvpass.state import GenerationState, LayerState

SITE = SimpleNamespace(layer=0, phase="decode", sliding_window=None, cache="dynamic")


def decode(policy: str, ids: torch.Tensor, steps: int, family: str = "llama", dynamic=None, **params):
    """Greedy bare-forward decode; returns the logits of every call, the backend and the cache."""
    model = build(family, "sdpa")
    be = kvpass.backend(policy, compiler="eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic)
    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        lg = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        logits.append(lg)
        for _ in range(steps):
            lg = fwd(input_ids=lg.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
            logits.append(lg)
    return torch.stack(logits), be, cache


def test_budget_above_length_equals_full():
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    full, _, _ = decode("full", ids, 20)
    raas, be, cache = decode("raas", ids, 20, budget=32)
    torch.testing.assert_close(raas, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(raas.argmax(-1), full.argmax(-1))
    assert cache.layers[0].keys.shape[-2] == (1 + 2 + 1) * 16  # one prompt page + budget/16 + 1
    assert be.state.seen == 33
    assert be.state.evicted_tokens == 0  # the pool's empty slots hold no token (they were counted negative)


@pytest.mark.parametrize("policy,family,dynamic,params", [
    ("raas+art", "llama", None, dict(tau=0.0, phi=0.0, block=16)),   # ART's kernel reads the pool's slots
    ("raas", "gemma3", True, {}),                                    # sliding layers left to the model
])
def test_composition_and_families_equal_full(policy, family, dynamic, params):
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    full, _, _ = decode("full", ids, 8, family=family)
    got, _, _ = decode(policy, ids, 8, family=family, dynamic=dynamic, budget=16, **params)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_long_decode_memory_bound():
    """2,000 decode tokens: allocated pages <= prefill pages + budget/16 + 1; stored size constant."""
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(2))
    model = build("llama", "sdpa")
    be = kvpass.backend("raas", compiler="eager", budget=32)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    bound, evictions = 2 + 32 // 16 + 1, 0
    with torch.no_grad():
        tok = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(2000):
            tok = fwd(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            for layer in be.state.layers.values():
                assert int(layer.extra["live"].sum(-1).max()) <= bound
                evictions += int((layer.extra["evicted"] >= 0).sum())
            assert {layer.keys.shape[-2] for layer in cache.layers} == {bound * 16}
    assert be.state.seen == 2020 and evictions > 0


# -- driving the policy directly --------------------------------------------------------------------


def drive(policy, k_prompt: torch.Tensor, qs, ks):
    """Run the policy as Runtime.compact does; yields (previous extra, new extra, stored K, positions)."""
    b, hkv, n, _ = k_prompt.shape
    pos = torch.arange(n).expand(b, hkv, n)
    keep, extra = policy.select(SITE, None, k_prompt, k_prompt, pos,
                                torch.arange(n).expand(b, n), None)
    stored = k_prompt.gather(2, keep.clamp_min(0)[..., None].expand(-1, -1, -1, k_prompt.shape[-1]))
    pos = pos.gather(2, keep.clamp_min(0)).masked_fill(keep < 0, -1)
    state = LayerState(pos=pos, seen=n, extra=extra)
    for q, k_new in zip(qs, ks):
        k_all = torch.cat([stored, k_new], 2)
        kv_pos = torch.cat([pos, torch.full((b, hkv, 1), state.seen)], 2)
        keep, extra = policy.select(SITE, q, k_all, k_all, kv_pos, torch.full((b, 1), state.seen), state)
        stored = k_all.gather(2, keep.clamp_min(0)[..., None].expand(-1, -1, -1, k_all.shape[-1]))
        pos = kv_pos.gather(2, keep.clamp_min(0)).masked_fill(keep < 0, -1)
        prev, state = state.extra, LayerState(pos=pos, seen=state.seen + 1, extra=extra)
        yield prev, extra, stored, pos


def test_timestamps_follow_hand_trace():
    """One head, q = (1, 0): a page's bound is the largest first key coordinate among its tokens.

    Prompt: 16 zero keys (page 0). Decode token 1 has key (5, 0), all others zero; budget 16
    (two decode pages), alpha 0.3. Page 1 (tokens 1-16) then takes ~99% of the share every step and
    is stamped each step; page 2 (tokens 17-32) never passes alpha, so at token 33 (both decode
    pages full) page 2 is the oldest and is evicted, although page 1 was allocated first."""
    pol = make_policy("raas", budget=16, alpha=0.3)
    steps = 33
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    ks = [torch.zeros(1, 1, 1, 2) for _ in range(steps)]
    ks[0] = torch.tensor([5.0, 0.0]).view(1, 1, 1, 2)
    trace = {}
    for i, (_, extra, _, pos) in enumerate(drive(pol, torch.zeros(1, 1, 16, 2), [q] * steps, ks), start=1):
        trace[i] = (extra["ts"][0, 0].tolist(), int(extra["evicted"][0, 0]), pos[0, 0])
    assert trace[1][:2] == ([17, 17, 0], -1)     # page 0 was the only live page: share 1; page 1 allocated
    assert trace[2][:2] == ([17, 18, 0], -1)     # page 1: e^5 / (1 + e^5) > 0.3; page 0 below
    assert trace[16][:2] == ([17, 32, 0], -1)    # page 1 full
    assert trace[17][:2] == ([17, 33, 33], -1)   # page 2 allocated from the free list, no eviction
    assert trace[18][:2] == ([17, 34, 33], -1)   # page 2's share 1 / (2 + e^5) < 0.3
    assert trace[32][:2] == ([17, 48, 33], -1)
    assert trace[33][:2] == ([17, 49, 49], 2)    # both full: page 2 (ts 33) evicted, reused at once
    pos = trace[33][2]
    assert pos[16:32].tolist() == list(range(16, 32))            # page 1 kept, true positions
    assert pos[32].item() == 48 and (pos[33:] == -1).all()       # page 2 holds only the new token
    gen = GenerationState()
    gen.layers[0] = LayerState(pos=pos.view(1, 1, -1), seen=49)
    assert gen.evicted_tokens == 16                              # page 2's tokens 32-47 are gone


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), steps=st.integers(1, 60),
       budget=st.sampled_from([16, 32]), alpha=st.sampled_from([0.0, 0.05, 0.5]), b=st.integers(1, 2))
def test_pages_invariants(seed, n, steps, budget, alpha, b):
    """Evict only when every decode page is full, the oldest (ts, then allocation); keys in bounds."""
    gen = torch.Generator().manual_seed(seed)
    hkv, h, d = 2, 4, 4
    pol = make_policy("raas", budget=budget, alpha=alpha)
    qs = [torch.randn(b, h, 1, d, generator=gen) for _ in range(steps)]
    ks = [torch.randn(b, hkv, 1, d, generator=gen) * 3 for _ in range(steps)]
    bound = -(-n // 16) + budget // 16 + 1
    for (prev, extra, stored, pos), q in zip(drive(pol, torch.randn(b, hkv, n, d, generator=gen), qs, ks), qs):
        n_pre = extra["n_pre"]
        ub, ts = PS.page_scores_reference(q[:, :, 0], prev["kmin"], prev["kmax"], prev["live"], prev["ts"],
                                          alpha, int(extra["seen"]))
        full = prev["fill"] == 16 and bool(prev["live"][:, :, n_pre:].all())
        assert bool((extra["evicted"] >= 0).all()) == full and bool((extra["evicted"] >= 0).any()) == full
        if full:
            key = ts[:, :, n_pre:] * (1 << 32) + prev["born"][:, :, n_pre:]
            assert torch.equal(extra["evicted"], key.argmin(-1) + n_pre)
        assert int(extra["live"].sum(-1).max()) <= bound
        assert bool(extra["live"][:, :, :n_pre].eq(prev["live"][:, :, :n_pre]).all())  # prompt pages stay
        # representative keys bound every key in their page
        pages = stored.view(b, hkv, -1, 16, d)
        filled = (pos >= 0).view(b, hkv, -1, 16, 1)
        live = extra["live"][..., None, None]
        assert bool(((pages >= extra["kmin"][:, :, :, None] - 1e-6) | ~filled | ~live).all())
        assert bool(((pages <= extra["kmax"][:, :, :, None] + 1e-6) | ~filled | ~live).all())
        assert bool(((pos >= 0).view(b, hkv, -1, 16).any(-1) == extra["live"]).all())


@pytest.mark.parametrize("b,h,hkv,pages,d", [(2, 4, 2, 37, 16), (1, 3, 1, 5, 8), (1, 2, 2, 16, 32)])
def test_kernel_equals_reference(b, h, hkv, pages, d):
    gen = torch.Generator().manual_seed(pages)
    q = torch.randn(b, h, d, generator=gen)
    x, y = torch.randn(b, hkv, pages, d, generator=gen), torch.randn(b, hkv, pages, d, generator=gen)
    live = torch.rand(b, hkv, pages, generator=gen) > 0.3
    ts = torch.randint(0, 50, (b, hkv, pages), generator=gen)
    args = (q, torch.minimum(x, y), torch.maximum(x, y), live, ts, 0.05, 99)
    ub, ts_ref = PS.page_scores_reference(*args)
    ub_k, ts_k = PS.page_scores_triton(*args)
    torch.testing.assert_close(ub_k, ub, atol=1e-5, rtol=1e-5)
    assert torch.equal(ts_k, ts_ref) and bool((ts_ref == 99).any())


def test_compiled_step_equals_eager():
    """The decode step that CUDA runs compiled by Inductor equals the eager one (which CPU runs), step by
    step through page allocation and eviction, and also on a replayed call."""
    from kvpass.policies import raas

    pol = make_policy("raas", budget=16, alpha=0.05)
    gen = torch.Generator().manual_seed(0)
    b, hkv, h, d, n = 2, 2, 4, 8, 20
    k = torch.randn(b, hkv, n, d, generator=gen)
    pos = torch.arange(n).expand(b, hkv, n)
    _, extra = pol.select(SITE, torch.randn(b, h, n, d, generator=gen), k, k, pos, torch.arange(n).expand(b, n), None)
    compiled = raas._compiled_step()
    evictions = 0
    for i in range(40):
        now = torch.tensor(n + i + 1)
        args = (torch.randn(b, h, d, generator=gen), torch.randn(b, hkv, 1, d, generator=gen), now, pol.alpha,
                extra["n_pre"], extra["slots"], extra["seen"], [extra[key] for key in raas.STATE],
                [extra["base"][key] for key in raas.STATE])
        want, got = raas._step(*args), compiled(*args)
        assert torch.equal(want[0], got[0]), f"keep, step {i}"
        for name, w, g in zip(raas.STATE, want[1] + want[2], got[1] + got[2]):
            assert torch.equal(w, g.to(w.dtype)), f"{name}, step {i}"
        if i == 30:  # the same call again: it starts from the state before it, so it gives the same result
            again = raas._step(*args[:6], now, want[1], want[2])
            assert all(torch.equal(x, y) for x, y in zip(again[1], want[1]))
        evictions += int((want[1][-1] >= 0).sum())
        extra = dict(extra, **dict(zip(raas.STATE, want[1])), seen=now, base=dict(zip(raas.STATE, want[2])))
    assert evictions > 0 and raas._COMPILED is not raas._step  # evicted, and Inductor built the step


def test_configuration_errors():
    with pytest.raises(ConfigError, match="'budget' must be a multiple of 16"):
        make_policy("raas", budget=40)
    with pytest.raises(ConfigError, match="'alpha'"):
        make_policy("raas", alpha=2.0)
    with pytest.raises(ConfigError, match="'budget'"):
        make_policy("raas", budget=8)
