"""RaaS page-timestamp eviction on its page pool (kvpass/policies/pages/raas.py and its kernels).

* a budget that never evicts equals ``full`` (bare forward, batch 2);
* a 2,000-token decode on a tiny model never holds more than prefill + budget/16 + 1 pages, and the
  stored tensors keep the pool's size (memory flat);
* driven step by step on a DynamicCache's pool (the decode step both caches run): a page is evicted only
  when every decode page is full and it is the oldest; timestamps follow a hand-computed trace;
  representative keys bound every key of their page (hypothesis);
* the Triton page-bounds kernel (the SlotCache decode of quest and raas) equals ``page_bounds_reference``
  under the interpreter (hypothesis: batch, GQA group incl. 3, head dim incl. 24, page counts around the
  block size, fp32/bf16 bounds, strided query and bounds);
* the two Triton kernels of ``kvpass::raas_stamp`` (RaaS's per-layer SlotCache update) leave every table
  as the reference does under the interpreter (hypothesis: page counts, windows past the pool, full
  and partial pages, live / free mixes, tied timestamps, alpha 0 and 1, rows with no live page), and
  the reference evicts the oldest decode page in a hand-built case.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvpass
from families import build, symbolic_lengths
from kvpass.cache.state import GenerationState, LayerState
from kvpass.kernels import page_bounds as PB
from kvpass.kernels import raas_stamp as RS
from kvpass.policies import ConfigError, make_policy

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
        if dynamic is None:
            symbolic_lengths(cache)
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


@pytest.mark.parametrize(
    "policy,family,dynamic,params",
    [
        ("raas+art", "llama", None, dict(tau=0.0, phi=0.0, block=16)),  # ART's kernel reads the pool's slots
        ("raas", "gemma3", True, {}),  # sliding layers left to the model
    ],
)
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
                tables = tables_of(layer.extra)
                assert int(tables["live"].sum(-1).max()) <= bound
                evictions += int((tables["evicted"] >= 0).sum())
            assert {layer.keys.shape[-2] for layer in cache.layers} == {bound * 16}
    assert be.state.seen == 2020 and evictions > 0


# -- driving the policy directly --------------------------------------------------------------------


def tables_of(extra: dict) -> dict:
    """A copy of a layer's page tables by name (``meta`` split into the current page, its fill, the first
    decode page and the page planned for eviction)."""
    kmin, kmax, live, ts, born, meta, _ = (t.clone() for t in extra["tables"])
    return dict(
        kmin=kmin, kmax=kmax, live=live, ts=ts, born=born, cur=meta[..., 0], fill=meta[..., 1], evicted=meta[..., 3]
    )


def prefill(policy, layer: int, k_prompt: torch.Tensor):
    """Lay a prompt out as the layer's pool, as Runtime.compact does; returns (stored K, layer state)."""
    b, hkv, n, d = k_prompt.shape
    pos = torch.arange(n).expand(b, hkv, n)
    keep, extra = policy.select(
        SimpleNamespace(layer=layer, cache="dynamic"), None, k_prompt, k_prompt, pos, torch.arange(n).expand(b, n), None
    )
    stored = k_prompt.gather(2, keep.clamp_min(0)[..., None].expand(-1, -1, -1, d))
    return stored, LayerState(pos=pos.gather(2, keep.clamp_min(0)).masked_fill(keep < 0, -1), seen=n, extra=extra)


def step(policy, layer: int, stored: torch.Tensor, state: LayerState, q, k_new) -> LayerState:
    """One decode step of one layer, as Runtime.pool_write does: ``stored`` (K and V alike) is written
    in place; returns the layer's new state."""
    q_pos = torch.full((stored.shape[0], 1), state.seen)
    pos = policy.write(SimpleNamespace(layer=layer, cache="dynamic"), q, stored, stored, k_new, k_new, q_pos, state)
    return LayerState(pos=pos, seen=state.seen + 1, extra=state.extra)


def drive(policy, k_prompt: torch.Tensor, qs, ks):
    """A one-layer model's prefill and decode steps; yields (the page tables before the step, after
    it, stored K, positions)."""
    stored, state = prefill(policy, 0, k_prompt)
    for q, k_new in zip(qs, ks):
        prev = tables_of(state.extra)
        state = step(policy, 0, stored, state, q, k_new)
        yield prev, tables_of(state.extra), stored.clone(), state.pos


def test_timestamps_follow_hand_trace():
    """One head, q = (1, 0): a page's bound is the largest first key coordinate among its tokens.

    Prompt: 16 zero keys (page 0). Decode token 1 has key (5, 0), all others zero; budget 16
    (two decode pages), alpha 0.3. Page 1 (tokens 16-31) then takes ~99% of the share every step and
    is stamped each step; page 0 and page 2 (tokens 32-47) never pass alpha. After step 32 both
    decode pages are full: page 2 (ts 32, its allocation) is the oldest and is evicted, although page
    1 was allocated first; its tokens leave at step 33's write, where token 48 takes its first slot
    (before step 33's attention reads the pool)."""
    pol = make_policy("raas", budget=16, alpha=0.3)
    steps = 33
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    ks = [torch.zeros(1, 1, 1, 2) for _ in range(steps)]
    ks[0] = torch.tensor([5.0, 0.0]).view(1, 1, 1, 2)
    trace = {}
    for i, (_, extra, _, pos) in enumerate(drive(pol, torch.zeros(1, 1, 16, 2), [q] * steps, ks), start=1):
        trace[i] = (extra["ts"][0, 0].tolist(), int(extra["evicted"][0, 0]), pos[0, 0])
    assert trace[1][:2] == ([16, 17, 0], -1)  # page 1: e^5 / (1 + e^5) > 0.3 -> stamped; page 0 not
    assert trace[2][:2] == ([16, 18, 0], -1)
    assert trace[16][:2] == ([16, 32, 32], -1)  # page 1 full: page 2 taken from the free list (ts 32)
    assert trace[17][:2] == ([16, 33, 32], -1)  # page 2's share 1 / (2 + e^5) < 0.3
    assert trace[32][:2] == ([16, 48, 48], 2)  # both full: page 2 (ts 32) evicted, current again
    assert (trace[32][2][32:48] >= 0).all()  # its tokens are still stored until the next step
    assert trace[33][:2] == ([16, 49, 48], -1)
    pos = trace[33][2]
    assert pos[16:32].tolist() == list(range(16, 32))  # page 1 kept, true positions
    assert pos[32].item() == 48 and (pos[33:] == -1).all()  # page 2 holds only the new token
    gen = GenerationState()
    gen.layers[0] = LayerState(pos=pos.view(1, 1, -1), seen=49)
    assert gen.evicted_tokens == 16  # page 2's tokens 32-47 are gone


def stamped(q, kmin, kmax, live, ts, alpha: float, now: int):
    """RaaS's stamp, from its definition: ``ts = now`` on the live pages whose softmax share of Quest's bound
    (over the live pages) exceeds ``alpha`` for some query head of the KV group."""
    b, h, _ = q.shape
    hkv, pages = live.shape[1], live.shape[2]
    ub = PB.page_bounds_reference(q, kmin, kmax).masked_fill(~live.repeat_interleave(h // hkv, 1), float("-inf"))
    hit = (ub.softmax(-1).nan_to_num(0.0) > alpha).view(b, hkv, h // hkv, pages).any(2) & live
    return torch.where(hit, now, ts)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 40),
    steps=st.integers(1, 60),
    budget=st.sampled_from([16, 32]),
    alpha=st.sampled_from([0.0, 0.05, 0.5]),
    b=st.integers(1, 2),
)
def test_pages_invariants(seed, n, steps, budget, alpha, b):
    """The token lands where it was planned; evict only when every decode page is full, the oldest
    (ts after this step's stamps, then allocation); keys in bounds; live pages are the filled ones."""
    gen = torch.Generator().manual_seed(seed)
    hkv, h, d = 2, 4, 4
    pol = make_policy("raas", budget=budget, alpha=alpha)
    qs = [torch.randn(b, h, 1, d, generator=gen) for _ in range(steps)]
    ks = [torch.randn(b, hkv, 1, d, generator=gen) * 3 for _ in range(steps)]
    bound = -(-n // 16) + budget // 16 + 1
    n_pre = -(-n // 16)
    for t, ((prev, new, stored, pos), q) in enumerate(
        zip(drive(pol, torch.randn(b, hkv, n, d, generator=gen), qs, ks), qs)
    ):
        slot = prev["cur"] * 16 + prev["fill"]
        assert bool((pos.gather(2, slot[..., None]) == n + t).all())  # the token is where it was planned
        full = (prev["fill"] + 1 == 16) & prev["live"][:, :, n_pre:].all(-1)
        assert torch.equal(new["evicted"] >= 0, full)
        ts = stamped(q[:, :, 0], new["kmin"], new["kmax"], prev["live"], prev["ts"], alpha, n + t + 1)
        key = ts[:, :, n_pre:] * (1 << 32) + prev["born"][:, :, n_pre:]
        assert torch.equal(torch.where(full, key.argmin(-1) + n_pre, -1), new["evicted"])
        assert int(new["live"].sum(-1).max()) <= bound
        assert bool(new["live"][:, :, :n_pre].eq(prev["live"][:, :, :n_pre]).all())  # prompt pages stay
        # representative keys bound every key in their page
        pages = stored.view(b, hkv, -1, 16, d)
        filled = (pos >= 0).view(b, hkv, -1, 16, 1)
        live = new["live"][..., None, None]
        assert bool(((pages >= new["kmin"][:, :, :, None] - 1e-6) | ~filled | ~live).all())
        assert bool(((pages <= new["kmax"][:, :, :, None] + 1e-6) | ~filled | ~live).all())
        fresh = (torch.arange(new["live"].shape[-1]) == new["cur"][..., None]) & (new["fill"] == 0)[..., None]
        assert bool(((pos >= 0).view(b, hkv, -1, 16).any(-1) | fresh).eq(new["live"]).all())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    g=st.sampled_from([1, 2, 4, 3]),
    d=st.sampled_from([8, 16, 24]),
    pages=st.sampled_from([1, 5, 16, 17, 31, 32, 33, 70]),
    block_p=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    q_layout=st.sampled_from(["slot", "dense", "transposed"]),
    sliced=st.booleans(),
)
def test_page_bounds_kernel_equals_reference(seed, b, hkv, g, d, pages, block_p, dtype, q_layout, sliced):
    """``ub [B, H, P]`` of the parallel page-bounds kernel equals the reference for every head and page."""
    gen = torch.Generator().manual_seed(seed)
    h = hkv * g
    if q_layout == "slot":  # q[:, :, -1] of the decode query [B, H, 1, D], as slot_pages passes it
        q = torch.randn(b, h, 3, d, generator=gen)[:, :, -1]
    elif q_layout == "transposed":  # last dim not unit-stride: copied by the launcher
        q = torch.randn(b, d, h, generator=gen).transpose(1, 2)
    else:
        q = torch.randn(b, h, d, generator=gen)
    x = torch.randn(b, hkv, pages + 7, d, generator=gen).to(dtype)
    y = torch.randn(b, hkv, pages + 7, d, generator=gen).to(dtype)
    kmin, kmax = torch.minimum(x, y), torch.maximum(x, y)
    if sliced:  # the first pages of a larger page buffer, read in place; a read past them meets inf
        kmin[:, :, pages:], kmax[:, :, pages:] = float("inf"), float("inf")
        kmin, kmax = kmin[:, :, :pages], kmax[:, :, :pages]
    else:
        kmin, kmax = kmin[:, :, :pages].contiguous(), kmax[:, :, :pages].contiguous()
    ub = PB.page_bounds_reference(q, kmin, kmax)
    ub_k = PB.page_bounds_triton(q, kmin, kmax, block_p=block_p)
    assert ub_k.shape == (b, h, pages) and ub_k.dtype == torch.float32
    torch.testing.assert_close(ub_k, ub, atol=1e-5, rtol=1e-5)


def _stamp_tables(gen, b, hkv, g, d, pages, first, fill, live_p, dtype):
    """Random page tables as a SlotCache holds them after some decode steps (``cur`` a live window page)."""
    h = hkv * g
    q = torch.randn(b, h, 3, d, generator=gen)[:, :, -1]  # strided, as slot_stamp passes q[:, :, -1]
    k_new = torch.randn(b, hkv, 2, d, generator=gen)[:, :, -1].to(dtype)
    x, y = torch.randn(b, hkv, pages, d, generator=gen), torch.randn(b, hkv, pages, d, generator=gen)
    live = torch.rand(b, hkv, pages, generator=gen) < live_p
    now = 1000
    ts = torch.randint(998, 1000, (b, hkv, pages), generator=gen)  # two values: ties decided by born
    born = torch.randint(0, 2, (b, hkv, pages), generator=gen)  # ties on both: the lower page
    cur = (first + torch.randint(0, 3, (b, hkv), generator=gen)).clamp_max(pages - 1)
    live.scatter_(2, cur[..., None], True)
    meta = torch.stack([cur, torch.full_like(cur, fill), torch.full_like(cur, first), torch.full_like(cur, -1)], -1)
    return dict(
        q=q,
        k_new=k_new,
        count=torch.tensor([[now + i, 0, 0, 1 << 40, 0] for i in range(b)]),
        kmin=torch.minimum(x, y).to(dtype),
        kmax=torch.maximum(x, y).to(dtype),
        live=live,
        ts=ts,
        born=born,
        meta=meta,
        seen=torch.full((b, hkv), 999),
    )


TABLES = ("kmin", "kmax", "live", "ts", "born", "meta", "seen")


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    g=st.sampled_from([1, 2, 3, 4]),
    d=st.sampled_from([8, 24]),
    pages=st.sampled_from([3, 16, 33, 70]),
    first=st.integers(0, 40),
    window=st.sampled_from([1, 2, 5, 17, 40]),
    fill=st.sampled_from([0, 7, 15]),
    live_p=st.sampled_from([0.0, 0.5, 1.0]),
    alpha=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
    block_p=st.sampled_from([16, 32]),
    block_w=st.sampled_from([16, 256]),
    block_b=st.sampled_from([16, 0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    parts=st.booleans(),
)
@example(
    seed=0,
    b=1,
    hkv=1,
    g=2,
    d=8,
    pages=70,
    first=3,
    window=40,
    fill=15,
    live_p=1.0,
    alpha=1.0,
    block_p=16,
    block_w=16,
    block_b=16,
    dtype=torch.float32,
    parts=True,
)  # an eviction whose oldest key ties across the window's three blocks
@example(
    seed=0,
    b=1,
    hkv=1,
    g=2,
    d=8,
    pages=70,
    first=3,
    window=40,
    fill=7,
    live_p=1.0,
    alpha=0.02,
    block_p=16,
    block_w=256,
    block_b=16,
    dtype=torch.float32,
    parts=True,
)  # the log-sum-exp over five blocks, shares near alpha
@example(
    seed=0,
    b=1,
    hkv=1,
    g=2,
    d=8,
    pages=70,
    first=3,
    window=40,
    fill=7,
    live_p=1.0,
    alpha=0.02,
    block_p=16,
    block_w=256,
    block_b=16,
    dtype=torch.float32,
    parts=False,
)  # the same from every page's bound
def test_raas_stamp_kernels_equal_reference(
    seed, b, hkv, g, d, pages, first, window, fill, live_p, alpha, block_p, block_w, block_b, dtype, parts
):
    """Every table after ``raas_stamp_triton`` equals the reference's, bit for bit (bounds, live pages,
    timestamps, allocation steps, the planned slot and eviction, the overflow mark)."""
    gen = torch.Generator().manual_seed(seed)
    first = min(first, pages - 1)
    ref = _stamp_tables(gen, b, hkv, g, d, pages, first, fill, live_p, dtype)
    got = {k: v.clone() for k, v in ref.items()}
    before = {k: ref[k].clone() for k in TABLES}
    RS.raas_stamp_reference(*ref.values(), window, alpha)
    RS.raas_stamp_triton(*got.values(), window, alpha, block_p=block_p, block_w=block_w, block_b=block_b, parts=parts)
    for name in TABLES:
        assert torch.equal(got[name], ref[name]), name
    if fill == 15:  # a new page every row: the planned page is live, stamped and born now
        cur = ref["meta"][..., 0]
        assert bool(ref["live"].gather(2, cur[..., None]).all()) and bool((ref["meta"][..., 1] == 0).all())
    else:
        assert torch.equal(ref["meta"][..., 0], before["meta"][..., 0])


def test_raas_stamp_reference_evicts_the_oldest_decode_page():
    """A hand-built layer: prompt pages 0-1, decode window 2-4 all live, the current page 4 full after this
    token. Page 3 has the oldest timestamp, so it is planned for eviction and becomes the current page;
    prompt page 0, older still, is never a candidate. Page 2 is stamped (the only page the query likes)."""
    b, hkv, pages, d = 1, 1, 6, 4
    kmin = torch.full((b, hkv, pages, d), -0.1)
    kmax = torch.full((b, hkv, pages, d), 0.1)
    kmin[:, :, 2], kmax[:, :, 2] = 5.0, 5.0  # q . k = 20 on page 2: its share is about 1
    tables = dict(
        kmin=kmin,
        kmax=kmax,
        live=torch.tensor([[[True] * 5 + [False]]]),
        ts=torch.tensor([[[1, 9, 7, 3, 8, 0]]]),
        born=torch.tensor([[[0, 1, 5, 6, 7, -1]]]),
        meta=torch.tensor([[[4, 15, 2, -1]]]),
        seen=torch.tensor([[99]]),
    )
    RS.raas_stamp_reference(
        torch.ones(b, 1, d), torch.zeros(b, hkv, d), torch.tensor([[100, 0, 0, 1 << 40, 0]]), *tables.values(), 3, 0.5
    )
    assert tables["ts"].tolist() == [[[1, 9, 100, 100, 8, 0]]]  # page 2 stamped, page 3 taken now
    assert tables["born"].tolist() == [[[0, 1, 5, 100, 7, -1]]]
    assert tables["meta"].tolist() == [[[3, 0, 2, 3]]] and tables["seen"].tolist() == [[100]]
    tables["live"][..., 5], tables["meta"][..., 1] = True, 15  # page 3 full too, the pool has no free page
    RS.raas_stamp_reference(
        torch.ones(b, 1, d), torch.zeros(b, hkv, d), torch.tensor([[101, 0, 0, 1 << 40, 0]]), *tables.values(), 5, 0.5
    )  # a window of 5 from page 2 runs past the 6-page pool
    assert tables["seen"].tolist() == [[RS.OVERFLOW]]  # an eviction from 4 of 5 decode pages: marked


def test_configuration_errors():
    with pytest.raises(ConfigError, match="'budget' must be a multiple of 16"):
        make_policy("raas", budget=40)
    with pytest.raises(ConfigError, match="'alpha'"):
        make_policy("raas", alpha=2.0)
    with pytest.raises(ConfigError, match="'budget'"):
        make_policy("raas", budget=8)
