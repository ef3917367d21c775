"""``kvpass.SlotCache``: the fixed-capacity cache, against the DynamicCache paths already proven.

* ``full`` / ``art`` (tau = phi = 0) on a SlotCache equal the uncompiled model on a DynamicCache, with
  derived and with explicit positions; sliding-window layers are rings of their window;
* the evicting policies (streamingllm: a ring that evicts every step; snapkv, chunkkv, sablock: a
  prefill eviction, then appends) equal the same policy on a DynamicCache, a left-padded batch too;
* ``generate`` works on it (and a chat continuation through the append graph), ``get_seq_length``
  answers tokens seen, not slots stored;
* memory is real (the slots never grow, they hold exactly the sinks and the most recent tokens),
  the decode step compiles once, the victim rule of ``write_slots`` is the documented one;
* the refusals and capacity errors are loud; ``opcheck`` on ``slot_append`` / ``slot_prefill``.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvpass
from families import build, skip_uneven_layers_on_old_stacks, symbolic_lengths
from kvpass.cache.slots import APPEND, CACHE, RING, write_slots

BUDGET, SINKS = 8, 2
PUNCT = [5, 7]


def prompt(n: int, seed: int, b: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 90, (b, n), generator=g)
    ids[torch.rand(b, n, generator=g) < 0.15] = PUNCT[seed % 2]  # sentence ends for sablock
    return ids


def run(fwd, cache, ids, steps: int, tokens=None, explicit: bool = False, mask=None, on_prefill=None):
    """Prefill then ``steps`` decode steps; greedy, or feeding ``tokens`` [steps, B] when given. With
    ``explicit`` (or a ``mask``: position ids from its cumsum, as ``generate`` does) the positions
    are passed, else the model derives them from the cache; ``on_prefill()`` runs between the prefill
    and the first step. Returns (tokens fed, last logits per call)."""
    kw = {}
    if mask is not None:
        pid = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        kw = dict(attention_mask=mask, position_ids=pid)
    elif explicit:
        kw = dict(position_ids=torch.arange(ids.shape[1])[None])
    fed, logits = [], []
    with torch.no_grad():
        logits.append(fwd(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits[:, -1])
        if on_prefill is not None:
            on_prefill()
        symbolic_lengths(cache, kw.get("attention_mask"))
        for step in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[step]
            fed.append(nxt)
            if "position_ids" in kw:
                kw["position_ids"] = kw["position_ids"][:, -1:] + 1
            if mask is not None:
                kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(nxt)], 1)
            logits.append(fwd(input_ids=nxt, past_key_values=cache, use_cache=True, **kw).logits[:, -1])
    return fed, logits


def assert_logits_close(got, ref, atol=1e-5):
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol, msg=lambda m, s=step: f"call {s}: {m}")


def left_padded(n_long: int, n_short: int, seed: int):
    """A batch of 2: row 0 a short prompt left-padded to the long one's length, row 1 the long prompt.
    Returns (ids, attention mask, the short row alone, the long row alone)."""
    g = torch.Generator().manual_seed(seed)
    long, short = torch.randint(3, 90, (1, n_long), generator=g), torch.randint(3, 90, (1, n_short), generator=g)
    pad = n_long - n_short
    ids = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask, short, long


def slot_run(model, policy, ids, steps, tokens=None, max_length=40, max_new_tokens=None, dynamic=None, **kw):
    """``policy`` compiled with the eager compiler on a fresh SlotCache: (backend, cache, logits)."""
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler=kw.pop("compiler", "eager"), **kw)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic)
    cache = kvpass.SlotCache(model, be, max_length=max_length, batch_size=ids.shape[0], max_new_tokens=max_new_tokens)
    _, logits = run(fwd, cache, ids, steps, tokens)
    return be, cache, logits


def dynamic_run(model, policy, ids, steps, mask=None, **kw):
    """``policy`` compiled with the eager compiler on a DynamicCache (the path the other tests check
    against hand-evicting references): (backend, tokens, logits, positions kept by the prefill)."""
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **kw)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = DynamicCache(config=model.config)
    kept = {}
    tokens, logits = run(
        fwd,
        cache,
        ids,
        steps,
        mask=mask,
        on_prefill=lambda: kept.update({i: st.pos.clone() for i, st in be.state.layers.items()}),
    )
    return be, tokens, logits, kept


# ------------------------------------------------------------------------------------------------
# full / art equal the uncompiled model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,attn,explicit",
    [
        ("llama", "sdpa", False),
        ("llama", "sdpa", True),
        ("qwen3", "eager", False),
        ("gpt_neox", "sdpa", False),
        ("granite", "sdpa", False),
        ("phi3", "sdpa", False),
        ("phi3", "eager", True),
    ],
)
def test_full_equals_uncompiled_dynamic_cache(family, attn, explicit):
    """``full`` on a SlotCache (prefill: slot_prefill keeps everything; decode: write_slots appends and
    decode_attention reads by position) is the model itself: 8 greedy steps, logits at 1e-5."""
    model = build(family, attn)
    if family == "gpt_neox":  # no GQA: the fixture's shared num_key_value_heads=2 is an unused extra there
        del model.config.num_key_value_heads
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    tokens, ref = run(model, DynamicCache(config=model.config), ids, 8, explicit=explicit)
    torch._dynamo.reset()
    be = kvpass.backend("full", compiler="eager")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=24)
    _, got = run(fwd, cache, ids, 8, tokens, explicit=explicit)
    assert_logits_close(got, ref)
    assert be.reports and all(r.slots == list(range(model.config.num_hidden_layers)) for r in be.reports)
    assert cache.seen == 13 + 8
    assert cache.positions(0)[0, 0].tolist() == list(range(21)) + [-1] * 3


def test_art_noop_equals_full_and_composes_with_snapkv():
    """``art`` with tau = phi = 0 reads every slot (block 16 over 40 slots: 3 blocks): it equals the
    model. ``snapkv+art`` runs on the slots with the evictor's rule and capacity and equals snapkv on a
    DynamicCache."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    tokens, ref = run(model, DynamicCache(config=model.config), ids, 8)
    be, cache, got = slot_run(model, "art", ids, 8, tokens, tau=0.0, phi=0.0, block=16)
    assert_logits_close(got, ref)
    assert any("decode_attention(tau=0" in p for p in be.plans()["decode"])
    assert cache.capacity == 40

    _, tokens, ref, _ = dynamic_run(model, "snapkv", ids, 8, budget=BUDGET, window=2)
    be, cache, got = slot_run(
        model,
        "snapkv+art",
        ids,
        8,
        torch.stack(tokens),
        max_new_tokens=8,
        budget=BUDGET,
        window=2,
        tau=0.0,
        phi=0.0,
        block=16,
    )
    assert_logits_close(got, ref)
    assert cache.capacity == BUDGET + 8
    assert be.plans()["decode"] == [
        "slot: write_slots append in place + decode_attention(tau=0, phi=0, p=5, block=16, horizon=16) by position"
    ]


# ------------------------------------------------------------------------------------------------
# evicting policies equal their DynamicCache path
# ------------------------------------------------------------------------------------------------

EVICTORS = [
    ("streamingllm", dict(budget=BUDGET, sinks=SINKS), 13),
    ("snapkv", dict(budget=12, window=4), 24),
    ("chunkkv", dict(budget=12, window=4, chunk=4), 24),
    ("sablock", dict(budget=12, window=4, punctuation_ids=PUNCT), 24),
]


@pytest.mark.parametrize("policy,params,n", EVICTORS, ids=[e[0] for e in EVICTORS])
def test_evicting_policy_equals_dynamic_cache(policy, params, n):
    """Same policy, same tokens, 10 decode steps: the SlotCache logits equal the DynamicCache ones.
    streamingllm evicts at every step (a 13-token prompt, budget 8: the ring overwrites from the first
    decode step); the prefill evictors keep the same entries as on the DynamicCache and then fill their
    capacity (budget + max_new_tokens) exactly."""
    model = build("llama")
    ids = prompt(n, seed=2)
    _, tokens, ref, kept = dynamic_run(model, policy, ids, 10, **params)
    be, cache, got = slot_run(model, policy, ids, 10, torch.stack(tokens), max_new_tokens=10, **params)
    assert_logits_close(got, ref)
    budget = params["budget"]
    assert cache.capacity == (budget + 1 if policy == "streamingllm" else budget + 10)
    assert cache.seen == n + 10
    for layer in range(model.config.num_hidden_layers):
        pos = cache.positions(layer)
        assert pos.shape[-1] == cache.capacity
        if policy == "streamingllm":
            recent = budget + 1 - SINKS
            assert (
                pos.sort(-1).values == torch.tensor([0, 1] + list(range(n + 10 - recent, n + 10)), dtype=pos.dtype)
            ).all()
        else:  # the prefill kept what the DynamicCache path kept, then every decoded token
            assert torch.equal(pos[..., :budget].sort(-1).values.long(), kept[layer].sort(-1).values.long())
            assert (pos[..., budget:] == torch.arange(n, n + 10, dtype=pos.dtype)).all()
            assert kept[layer].shape[-1] == budget < n  # (it did evict)


def test_pyramidkv_per_layer_capacity_equals_dynamic_cache():
    """pyramidkv keeps a different number of entries per layer (19 and 5 of a 24-token prompt at budget
    12 on two layers): each SlotCache layer gets its own capacity (the most it keeps from any prompt, the
    budget or its pyramid budget, plus the decode steps), and 10 steps equal the DynamicCache path."""
    skip_uneven_layers_on_old_stacks("pyramidkv")
    model = build("llama")
    ids = prompt(24, seed=2)
    params = dict(budget=12, window=4)
    _, tokens, ref, kept = dynamic_run(model, "pyramidkv", ids, 10, **params)
    be, cache, got = slot_run(model, "pyramidkv", ids, 10, torch.stack(tokens), max_new_tokens=10, **params)
    assert_logits_close(got, ref)
    assert [kept[i].shape[-1] for i in range(2)] == [19, 5]
    assert cache.capacities == [19 + 10, 12 + 10] and [lay.keys.shape[2] for lay in cache.layers] == [29, 22]
    for layer, n in enumerate((19, 5)):
        pos = cache.positions(layer)
        assert torch.equal(pos[..., :n].long(), kept[layer].long().sort(-1).values)
        assert (pos[..., n : n + 10] == torch.arange(24, 34, dtype=pos.dtype)).all() and (
            pos[..., n + 10 :] == -1
        ).all()
    assert "capacity=[29, 22]" in repr(cache)


def test_left_padded_batch_equals_dynamic_cache():
    """Batch 2, row 0 left-padded (9 pads, 5 real tokens: fewer than the budget), row 1 not: the
    SlotCache streamingllm equals the DynamicCache one for 12 steps, which evict in both rows. After the
    prefill the empty slots (and only they) hold -1, and they are the last ones: the protected first
    slots hold each row's first real tokens, the sinks, not its padding."""
    model = build("llama")
    ids, mask, _, _ = left_padded(14, 5, seed=3)
    params = dict(budget=BUDGET, sinks=SINKS)
    _, tokens, ref, _ = dynamic_run(model, "streamingllm", ids, 12, mask=mask, **params)

    torch._dynamo.reset()
    be = kvpass.backend("streamingllm", compiler="eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=40, batch_size=2)

    def after_prefill():
        for layer in range(model.config.num_hidden_layers):
            pos = cache.positions(layer)
            assert (pos[0] == torch.tensor([9, 10, 11, 12, 13, -1, -1, -1, -1], dtype=pos.dtype)).all()
            assert (pos[1] == torch.tensor([0, 1, 8, 9, 10, 11, 12, 13, -1], dtype=pos.dtype)).all()

    _, got = run(fwd, cache, ids, 12, torch.stack(tokens), mask=mask, on_prefill=after_prefill)
    assert_logits_close(got, ref)
    seen = ids.shape[1] + 12
    expect = {0: [9, 10], 1: [0, 1]}
    for row, sinks in expect.items():
        stored = sorted(cache.positions(0)[row, 0].tolist())
        assert stored == sinks + list(range(seen - (BUDGET + 1 - SINKS), seen))
        assert cache.positions(0)[row, 0, :SINKS].tolist() == sinks


# ------------------------------------------------------------------------------------------------
# sliding-window layers: a ring of the window per layer
# ------------------------------------------------------------------------------------------------

SLIDING = [("gemma3", "sdpa"), ("gemma2", "eager"), ("cohere2", "sdpa")]  # window 8; softcapping in gemma2
SLIDING_PARAMS = dict(
    snapkv=dict(budget=12, window=2),
    streamingllm=dict(budget=10, sinks=2),
    quest=dict(budget=16, dense_layers=0),
    raas=dict(budget=16),
)
# each family runs one or two of them (CI time): every policy leaves sliding layers to the same ring
ON_SLIDING = dict(gemma3=("raas",), gemma2=("streamingllm", "quest"), cohere2=("snapkv", "streamingllm"))


@pytest.mark.parametrize("family,attn", SLIDING, ids=[f[0] for f in SLIDING])
def test_sliding_layers_are_rings(family, attn):
    """A sliding layer's SlotLayer is a ring of ``window`` slots whatever the policy (the policies leave
    sliding layers to the model): ``full`` equals the uncompiled model over a 21-token prompt and 12
    steps (the rings wrap in the prefill and in decode); two SlotCache policies (``ON_SLIDING``) with their
    eviction in the global layers equal their DynamicCache paths. The sliding layers hold exactly the last 8
    positions."""
    model = build(family, attn)
    ids = prompt(21, seed=1)
    tokens, ref = run(model, DynamicCache(config=model.config), ids, 12)
    _, cache, got = slot_run(model, "full", ids, 12, torch.stack(tokens), max_length=40)
    assert_logits_close(got, ref, atol=1e-4)
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert sliding and all(cache.capacities[i] == 8 for i in sliding)
    for i in sliding:
        assert sorted(cache.positions(i)[0, 0].tolist()) == list(range(33 - 8, 33))
    for policy in ON_SLIDING[family]:
        kw = SLIDING_PARAMS[policy]
        _, tokens, ref, _ = dynamic_run(model, policy, ids, 12, **kw)
        _, _, got = slot_run(model, policy, ids, 12, torch.stack(tokens), max_length=40, **kw)
        assert_logits_close(got, ref, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# quest: page bounds as layer state beside the slots
# ------------------------------------------------------------------------------------------------

QUEST = dict(budget=48, dense_layers=0)  # top 3 pages + the current one, over 5-6 pages


def test_quest_equals_dynamic_cache_and_reads_pages():
    """quest on a SlotCache (bounds rebuilt by slot_bounds after the prefill, folded by slot_fold, pages
    ranked by slot_pages, all tensor code in the graphs) equals quest on a DynamicCache for 20 steps over
    a 70-token prompt (pages 0-5 of which it reads 4 at most), and differs from ``full``: the selection
    is real. The bounds state of every layer is the one computed from the slots."""
    from kvpass.policies.pages.quest import PAGE

    model = build("llama")
    ids = prompt(70, seed=2)
    _, tokens, ref, _ = dynamic_run(model, "quest", ids, 20, **QUEST)
    _, _, full, _ = dynamic_run(model, "full", ids, 20)
    be, cache, got = slot_run(model, "quest", ids, 20, torch.stack(tokens), max_length=96, **QUEST)
    assert_logits_close(got, ref)
    assert max((a - b).abs().max().item() for a, b in zip(got[1:], full[1:])) > 1e-2
    assert be.plans()["decode"] == [
        "slot: write_slots append + slot_fold in place + decode_attention (exact) over "
        "the blocks of slot_pages (block 16) by position"
    ]
    assert be.plans()["prefill"][0].endswith("+ slot_bounds")
    for lay in cache.layers:
        kmin, kmax, live, covered = lay.state
        seen = 90
        pages = -(-seen // PAGE)
        keys = torch.nn.functional.pad(lay.keys[:, :, :seen], (0, 0, 0, pages * PAGE - seen), value=float("nan"))
        keys = keys.view(1, 2, pages, PAGE, -1)
        assert torch.equal(kmin[:, :, :pages], keys.nan_to_num(float("inf")).amin(3))
        assert torch.equal(kmax[:, :, :pages], keys.nan_to_num(float("-inf")).amax(3))
        assert live[..., :pages].all() and not live[..., pages:].any() and (covered == seen).all()


def test_quest_noop_equals_full_and_append_turn():
    """A budget that covers the whole sequence reads every page: quest equals ``full``. With a small
    budget a chat turn (the append graph: exact attention over the slots, then slot_bounds) followed by
    decode steps equals the DynamicCache path, whose appends are folded in by the next step."""
    model = build("llama")
    ids = prompt(40, seed=4)
    _, tokens, full, _ = dynamic_run(model, "full", ids, 8)
    _, _, got = slot_run(model, "quest", ids, 8, torch.stack(tokens), max_length=64, budget=64, dense_layers=0)
    assert_logits_close(got, full)

    turn = prompt(7, seed=5)
    results = []
    for kind in ("dynamic", "slot"):
        torch._dynamo.reset()
        be = kvpass.backend("quest", compiler="eager", **QUEST)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config) if kind == "dynamic" else kvpass.SlotCache(model, be, max_length=96)
        _, logits = run(fwd, cache, ids, 6, torch.stack(tokens[:6]))
        with torch.no_grad():
            logits.append(fwd(input_ids=turn, past_key_values=cache, use_cache=True).logits[:, -1])
            for step in range(6):
                logits.append(fwd(input_ids=tokens[step], past_key_values=cache, use_cache=True).logits[:, -1])
        results.append((be, logits))
    (_, ref), (be, got) = results
    assert_logits_close(got, ref)
    assert sorted(be.plans()) == ["append", "decode", "prefill"]


def test_quest_stale_bounds_fail():
    """The uncompiled model refuses to fill a quest SlotCache; filled by a plain append anyway (the layers'
    policy name cleared by hand: slot_append leaves the bounds empty), the compiled quest decode fails the
    device-side assert instead of ranking empty pages."""
    model = build("llama")
    ids = prompt(40, seed=4)
    torch._dynamo.reset()
    be = kvpass.backend("quest", compiler="eager", **QUEST)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=64)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="did not rewrite .* policy 'quest'"):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.reset()
        for lay in cache.layers:
            lay.policy = ""  # a plain append, as if no policy had built the cache
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="page bounds do not cover"):
            fwd(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


def _generate(model, ids, new, **kw):
    out = model.generate(
        ids,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_full_and_chat_continuation(family):
    """``generate`` with the compiled forward on a SlotCache gives the model's own tokens and logits;
    a second ``generate`` that continues the returned cache with more input (its first call appends 6
    tokens to a filled cache: the "append" graph) equals the model fed the whole conversation. On
    gemma3 the sliding layers' rings (8 slots) wrap in the prefill, the decode and the append."""
    ref, model = build(family), build(family)
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    be = kvpass.backend("full", compiler="eager")
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=40)
    seq, logits = _generate(model, ids, 6, past_key_values=cache)
    ref_seq, ref_logits = _generate(ref, ids, 6, past_key_values=DynamicCache(config=ref.config))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert int(cache.get_seq_length()) == 13 + 6 - 1  # generate never feeds its last token

    chat = torch.cat([seq, torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(2))], 1)
    seq2, logits2 = _generate(model, chat, 6, past_key_values=cache)
    ref_seq2, ref_logits2 = _generate(ref, chat, 6, past_key_values=DynamicCache(config=ref.config))
    assert torch.equal(seq2, ref_seq2)
    torch.testing.assert_close(logits2, ref_logits2, atol=1e-5, rtol=1e-5)
    assert int(cache.get_seq_length()) == chat.shape[1] + 6 - 1
    assert sorted(be.plans()) == ["append", "decode", "prefill"]


def test_deepcopy_of_a_prefilled_cache_continues_on_its_own():
    """transformers' prompt reuse: a prompt prefilled once into a SlotCache, ``copy.deepcopy`` of it for each of two
    continuations. Each copy continues as a cache that prefilled the prompt itself would, the original keeps the
    prompt alone, and each copy has an identity of its own in its counts (the runtime and the policy are shared,
    not copied: a copied runtime held the compiled graphs' tensors and failed to copy)."""
    model = build("llama")
    prompt = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)

    def prefilled():
        cache = kvpass.SlotCache(model, be, max_length=40)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        return cache

    cache = prefilled()
    for seed in (2, 3):
        ids = torch.cat([prompt, torch.randint(3, 90, (1, 4), generator=torch.Generator().manual_seed(seed))], 1)
        mine = copy.deepcopy(cache)
        assert mine.ident != cache.ident and mine._runtime is cache._runtime
        assert all(int(lay.count[0, CACHE]) == mine.ident for lay in mine.layers)
        seq, logits = _generate(model, ids, 5, past_key_values=mine)
        ref_seq, ref_logits = _generate(model, ids, 5, past_key_values=prefilled())
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, atol=0, rtol=0)
        assert int(mine.get_seq_length()) == 17 + 5 - 1 and cache.seen == 13
        assert all(int(lay.count[0, CACHE]) == cache.ident for lay in cache.layers)


def test_generate_streamingllm_seq_length_and_continuation():
    """streamingllm through ``generate``: ``get_seq_length`` answers the tokens seen (prompt + new - 1),
    not the 9 slots stored, so generate's positions stay true; tokens and logits equal streamingllm on a
    DynamicCache. Then a chat turn of 6 tokens on the full ring (the "append" graph: the tokens attend
    over what the cache keeps between calls, budget entries, and evict inside the call) and a decode
    step equal the DynamicCache path. (Fed by direct calls: ``generate`` cannot continue a compressed
    DynamicCache, whose ``get_seq_length`` is the stored length.)"""
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    turn = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(2))
    results = []
    for kind in ("dynamic", "slot"):
        torch._dynamo.reset()
        model = build("llama")
        be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
        model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = DynamicCache(config=model.config) if kind == "dynamic" else kvpass.SlotCache(model, be, max_length=64)
        seq, logits = _generate(model, ids, 10, past_key_values=cache)
        if kind == "slot":  # generate never feeds its last token
            assert int(cache.get_seq_length()) == 13 + 10 - 1 and cache.layers[0].keys.shape[2] == BUDGET + 1
        with torch.no_grad():
            chat = model(input_ids=turn, past_key_values=cache, use_cache=True).logits
            step = model(input_ids=chat[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        results.append((seq, logits, chat, step))
    (seq, logits, chat, step), (s_seq, s_logits, s_chat, s_step) = results
    assert torch.equal(seq, s_seq)
    torch.testing.assert_close(s_logits, logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chat, chat, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_step, step, atol=1e-5, rtol=1e-5)
    assert sorted(be.plans()) == ["append", "decode", "prefill"]
    assert int(cache.get_seq_length()) == 13 + 9 + 6 + 1 and cache.capacity == BUDGET + 1
    assert sorted(cache.positions(0)[0, 0].tolist()) == [0, 1] + list(range(29 - (BUDGET + 1 - SINKS), 29))
    assert cache.layers[0].keys.shape[2] == BUDGET + 1


# ------------------------------------------------------------------------------------------------
# memory, recompilation, the victim rule
# ------------------------------------------------------------------------------------------------


def test_streamingllm_slots_fixed_and_hold_sinks_and_recent():
    """30 decode steps: every layer's slot tensors stay [1, 2, budget + 1, D] at the same address, and
    after every step they hold exactly the sinks and the budget + 1 - sinks most recent tokens."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=100)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    shape = (1, model.config.num_key_value_heads, BUDGET + 1, head_dim)
    ptrs = [(lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr()) for lay in cache.layers]
    nbytes = cache.kv_bytes()
    with torch.no_grad():
        logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for step in range(31):
            seen = 13 + step
            for i, lay in enumerate(cache.layers):
                assert tuple(lay.keys.shape) == shape and tuple(lay.values.shape) == shape
                assert (lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr()) == ptrs[i]
                want = [0, 1] + list(range(seen - (BUDGET - SINKS) - (step > 0), seen))
                if step == 0:
                    want.append(-1)  # the prefill kept the budget
                got = cache.positions(i).sort(-1).values
                assert (got == torch.tensor(sorted(want), dtype=got.dtype)).all(), (step, got[0, 0].tolist())
                assert cache.positions(i)[..., :SINKS].tolist() == [[[0, 1]] * shape[1]]
            assert cache.seen == seen
            if step < 30:
                logits = fwd(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[
                    :, -1
                ]
    assert cache.kv_bytes() == nbytes
    per_layer = 2 * shape[0] * shape[1] * shape[2] * shape[3] * 4 + shape[0] * shape[1] * shape[2] * 4 + 5 * 8
    assert nbytes == per_layer * model.config.num_hidden_layers


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("policy,params", [("full", {}), ("streamingllm", dict(budget=BUDGET, sinks=SINKS))])
def test_decode_compiles_once(dynamic, policy, params):
    """20 decode steps compile two graphs in all (prefill, decode): the counters live on the device and
    ``get_seq_length`` is a tensor, so no decode step guards on a Python int that changes."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    be, cache, _ = slot_run(model, policy, ids, 20, dynamic=dynamic, **params)
    assert [r.phase for r in be.reports] == ["prefill", "decode"]
    assert cache.seen == 33


def test_write_slots_ring_rule():
    """The ring's victim per (row, KV head): the lowest empty slot, else the oldest slot past the
    protected ones (even when a protected slot is older); several tokens take several victims."""
    cap, protect, d = 6, 2, 3
    pos = torch.tensor(
        [[[0, 1, 5, 3, -1, 4], [0, 1, 5, 3, 7, 4]], [[-1, -1, -1, -1, -1, -1], [2, 0, 6, 9, 8, 7]]], dtype=torch.int32
    )
    keys, values = torch.zeros(2, 2, cap, d), torch.zeros(2, 2, cap, d)
    count = torch.tensor([[20, cap, 0, 1 << 40, 0]] * 2)
    k_new, v_new = torch.ones(2, 2, 1, d), torch.full((2, 2, 1, d), 2.0)
    p = pos.clone()
    q_pos, kv_len = write_slots(keys, values, p, count, k_new, v_new, RING, protect)
    victims = [[4, 3], [0, 2]]
    for b in range(2):
        for h in range(2):
            v = victims[b][h]
            expect = pos[b, h].clone()
            expect[v] = 20
            assert p[b, h].tolist() == expect.tolist(), (b, h)
            assert keys[b, h, v].eq(1).all() and values[b, h, v].eq(2).all()
            assert keys[b, h].sum() == d  # nothing else written
    assert (
        q_pos.tolist() == [[20], [20]] and kv_len.tolist() == [cap, cap] and count[:, :3].tolist() == [[21, cap, 0]] * 2
    )
    # two tokens at once: (row 0, head 0) takes its empty slot and then the oldest (pos 3)
    p = pos.clone()
    write_slots(
        keys,
        values,
        p,
        torch.tensor([[20, cap, 0, 1 << 40, 0]] * 2),
        torch.ones(2, 2, 2, d),
        torch.ones(2, 2, 2, d),
        RING,
        protect,
    )
    assert sorted(p[0, 0].tolist()) == [0, 1, 4, 5, 20, 21] and p[0, 0, :2].tolist() == [0, 1]
    assert sorted(p[1, 1].tolist()) == [0, 2, 8, 9, 20, 21] and p[1, 1, :2].tolist() == [2, 0]
    # the append rule: the next free slot, whatever the positions say; a renumbering prefill's shift
    # (count[2]) moves the token's position back and stays
    p = torch.full((1, 1, cap), -1, dtype=torch.int32)
    keys, count = torch.zeros(1, 1, cap, d), torch.tensor([[7, 2, 3, 1 << 40, 0]])
    q_pos, _ = write_slots(keys, keys.clone(), p, count, torch.ones(1, 1, 1, d), torch.ones(1, 1, 1, d), APPEND, 0)
    assert p[0, 0].tolist() == [-1, -1, 4, -1, -1, -1] and keys[0, 0, 2].eq(1).all()
    assert q_pos.tolist() == [[4]] and count[0, :3].tolist() == [8, 3, 3]


# ------------------------------------------------------------------------------------------------
# raas: the page pool in the slots, its tables as layer state
# ------------------------------------------------------------------------------------------------

RAAS = dict(budget=32, alpha=0.02)  # 3 decode pages: the pool is full after 32 decode tokens


def test_raas_equals_dynamic_cache_and_evicts():
    """raas on a SlotCache (slot_pool after the prefill; per step slot_place empties the planned victim
    page and names the slot, slot_stamp folds, stamps and plans: tensor code in the graphs) equals raas
    on a DynamicCache over 70 steps on a 37-token prompt, which evict decode pages. The slots never
    grow: prompt pages + 3 decode pages; the prompt's entries are all kept, and at most 48 decode
    entries are."""
    model = build("llama")
    ids = prompt(37, seed=5)
    steps = 70
    _, tokens, ref, _ = dynamic_run(model, "raas", ids, steps, **RAAS)
    be, cache, got = slot_run(
        model, "raas", ids, steps, torch.stack(tokens), max_length=37 + steps, max_new_tokens=steps, **RAAS
    )
    assert_logits_close(got, ref)
    assert cache.capacity == (3 + 3) * 16  # ceil(37/16) prompt pages + budget/16 + 1
    assert be.plans()["decode"] == [
        "slot: write_slots placed at slot_place + slot_stamp in place + decode_attention (exact) by position"
    ]
    for layer in range(model.config.num_hidden_layers):
        kept = cache.positions(layer)[cache.positions(layer) >= 0].view(2, -1)
        for row in kept:
            real = sorted(row.tolist())
            assert real[:37] == list(range(37))  # the prompt pages are never evicted
            decoded = real[37:]
            assert 32 <= len(decoded) <= 48 and decoded[-1] == 37 + steps - 1
            assert len(decoded) < steps  # pages were evicted
    kmin, kmax, live, ts, born, meta, seen = cache.layers[0].state
    assert (seen == 37 + steps).all() and (meta[..., 2] == 3).all() and live[..., :6].all()
    _, _, got = slot_run(
        model,
        "raas+art",
        ids,
        steps,
        torch.stack(tokens),
        max_length=37 + steps,
        max_new_tokens=steps,
        tau=0.0,
        phi=0.0,
        block=16,
        **RAAS,
    )
    assert_logits_close(got, ref)  # ART's no-op on raas's pool


def test_raas_left_padded_batch_equals_rows_alone():
    """Batch 2, row 0 left-padded by 11: its real tokens sit in the first slots (padding after them), so
    its pages hold the tokens a run of the row alone puts in them; both rows equal their own batch-1
    runs over 40 steps that evict."""
    model = build("llama")
    ids, mask, short, long = left_padded(30, 19, seed=8)
    steps, params = 40, dict(budget=16)
    torch._dynamo.reset()
    be = kvpass.backend("raas", compiler="eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    tokens, got = run(fwd, kvpass.SlotCache(model, be, max_length=80, batch_size=2), ids, steps, mask=mask)
    for row, alone in ((0, short), (1, long)):
        _, _, ref = slot_run(
            model, "raas", alone, steps, torch.stack(tokens)[:, row : row + 1], max_length=80, **params
        )
        assert_logits_close([x[row : row + 1] for x in got], ref, atol=1e-4)


def test_raas_noop_equals_full_and_capacity():
    """A budget that holds every decode token evicts nothing: raas equals ``full``. Without
    max_new_tokens the pool is sized for any prompt length (max_length/16 + 2 pages); a sequence longer
    than max_length, which would evict from fewer decode pages than the policy's, fails a device-side
    assert."""
    model = build("llama")
    ids = prompt(30, seed=6)
    _, tokens, ref, _ = dynamic_run(model, "full", ids, 12)
    _, cache, got = slot_run(model, "raas", ids, 12, torch.stack(tokens), max_length=64, budget=64)
    assert_logits_close(got, ref)
    assert cache.capacity == (4 + 2) * 16
    _, cache, _ = slot_run(model, "raas", prompt(60, seed=6), 4, max_length=64, max_new_tokens=4, budget=64)
    assert cache.capacity == 6 * 16  # 4 prompt pages, room for 2 of the 5 decode pages
    with pytest.raises(RuntimeError, match="longer than the max_length the cache was built for"):
        slot_run(model, "raas", prompt(60, seed=6), 5, max_length=64, max_new_tokens=4, budget=64)


# ------------------------------------------------------------------------------------------------
# the gated policies: a prefill split at the gate, then appends
# ------------------------------------------------------------------------------------------------

# (CI time) fastkv is asl at a fixed layer, and gemfilter runs here on gemma3; both run on the two-layer llama in
# the conformance loop (tests/test_conformance.py: SlotCache equal to DynamicCache)
GATED = [
    ("llama", "asl", dict(layer=2), None),
    ("llama", "asl", dict(layer=-1, tau=0.99), True),
    ("llama", "asl_fullkv", dict(layer=3), True),
    ("llama", "asl_2pass", dict(layer=2), None),
    ("gemma3", "asl", dict(layer=2), None),
    ("cohere2", "asl_fullkv", dict(layer=3), None),
    ("gemma3", "gemfilter", dict(layer=2), True),
]


@pytest.mark.inductor
def test_gated_batch_under_inductor_equals_rows_alone():
    """asl at batch 2 on a SlotCache through Inductor, shapes dynamic: the segments after the gate read
    the RoPE tables of ``position_ids [1, L]`` gathered per row (``[2, n, D]``), which the segment compiled
    from the trace (``[1, L, D]``) refused with a size assert (Llama-8B shape, batch 16, H200, 2026-11-26);
    they are compiled again for the widened inputs. Each row equals its own batch-1 run."""
    from test_asl import build as build_deep

    model = build_deep("llama", layers=4)  # two layers after the gate: the widened segments compile again
    ids = torch.cat([prompt(40, seed=1), prompt(40, seed=2)])
    params = dict(layer=2, budget=10, window=4)
    steps = 4
    _, cache, got = slot_run(
        model, "asl", ids, steps, max_length=50, max_new_tokens=steps, dynamic=True, compiler="inductor", **params
    )
    tokens = torch.stack([x.argmax(-1, keepdim=True) for x in got[:-1]])
    for row in (0, 1):  # the eager compiler: the same graphs, without Inductor's size checks
        _, _, ref = slot_run(
            model,
            "asl",
            ids[row : row + 1],
            steps,
            tokens[:, row : row + 1],
            max_length=50,
            max_new_tokens=steps,
            dynamic=True,
            **params,
        )
        assert_logits_close([x[row : row + 1] for x in got], ref, atol=1e-4)


@pytest.mark.parametrize("family,policy,params,dynamic", GATED, ids=[f"{g[0]}-{g[1]}-{i}" for i, g in enumerate(GATED)])
def test_gated_policies_equal_dynamic_cache(family, policy, params, dynamic):
    """asl / asl_fullkv / asl_2pass / gemfilter on a SlotCache (the gated prefill's deeper segments run
    on the selected tokens and write them into their slots; the runner then records their true
    positions in the slots and the tokens seen in ``count``; decode appends) equal the DynamicCache
    path for 10 steps over a 40-token prompt on 6 layers, the same selection layer included; every
    global layer's slots hold the positions the DynamicCache path kept. The adaptive rule (tau 0.99)
    selects too. asl_fullkv's layers keep the whole prompt (capacity max_length). gemfilter's second
    pass renumbers: its slots hold positions ``0..n-1`` and decode continues at ``n`` while the cache
    still counts every token seen."""
    from test_asl import build as build_deep

    if policy == "asl_fullkv":  # layers before the gate keep the prompt, deeper ones the selection
        skip_uneven_layers_on_old_stacks(policy)
    model = build_deep(family, layers=6)
    ids = prompt(40, seed=1)
    params = dict(budget=10, window=4, **params)
    dyn, tokens, ref, kept = dynamic_run(model, policy, ids, 10, **params)
    be, cache, got = slot_run(
        model, policy, ids, 10, torch.stack(tokens), max_length=60, max_new_tokens=10, dynamic=dynamic, **params
    )
    assert_logits_close(got, ref)
    assert be.gate_info == dyn.gate_info and be.gate_info["selection_layer"] is not None
    assert cache.seen == 50
    sliding = {i for i, t in enumerate(getattr(model.config, "layer_types", None) or []) if t == "sliding_attention"}
    for i in range(6):
        if i in sliding:
            assert cache.capacities[i] == 8
            continue
        assert cache.capacities[i] == (60 if policy == "asl_fullkv" else 20)
        n = kept[i].shape[-1]
        assert torch.equal(cache.positions(i)[..., :n].long(), kept[i].long())
        first = n if policy == "gemfilter" else 40
        assert (cache.positions(i)[..., n : n + 10] == torch.arange(first, first + 10, dtype=torch.int32)).all()


@pytest.mark.inductor
def test_gated_inductor_dynamic_equals_eager():
    """The gated segments compiled by Inductor as a user compiles (``dynamic=True``, no ``fullgraph``:
    Dynamo then hands the backend fake inputs of its own backend mode, and an unspecialized float
    attribute, the embedding's ``norm_type``, is a 0-d tensor read with ``item()`` that only those
    fakes answer; the segments were compiled with the graph's meta values instead, failed, and Dynamo
    broke the graph into pieces that ran without the policy) equal the eager compiler's run."""
    from test_asl import build as build_deep

    model = build_deep("llama", layers=4)
    ids = prompt(40, seed=2)
    params = dict(budget=10, window=4, layer=1)
    ref_be, ref_cache, ref = slot_run(model, "asl", ids, 4, max_length=60, max_new_tokens=10, dynamic=True, **params)
    torch._dynamo.reset()
    be = kvpass.backend("asl", **params)
    fwd = torch.compile(model.forward, backend=be, dynamic=True)
    cache = kvpass.SlotCache(model, be, max_length=60, max_new_tokens=10)
    # (a kvpass backend specializes floats; a user may turn that off again, and then the floats reach it)
    with torch._dynamo.config.patch(specialize_float=False):
        _, got = run(fwd, cache, ids, 4, torch.stack([x.argmax(-1, keepdim=True) for x in ref[:-1]]))
    # each phase is compiled twice (AOT's tensorify pass restarts Dynamo's analysis once, specializing
    # the float attributes it left unspecialized); a failed compile would add graph pieces with problems
    assert {r.phase for r in be.reports} == {"prefill", "decode"} and not any(r.problems for r in be.reports)
    assert_logits_close(got, ref)
    assert be.gate_info == ref_be.gate_info and cache.seen == ref_cache.seen == 44


def test_each_phase_compiles_once_under_dynamic_shapes():
    """A kvpass backend specializes float attributes (RMSNorm's eps): with them unspecialized AOT's
    tensorify pass restarted the analysis of every graph, which was then traced and compiled twice."""
    model = build("llama")
    ids = prompt(20, seed=1)
    phases = {}
    for specialize in (None, False):
        torch._dynamo.reset()
        be = kvpass.backend("full", compiler="aot_eager")
        with torch._dynamo.config.patch(**({} if specialize is None else {"specialize_float": specialize})):
            run(
                torch.compile(model.forward, backend=be, dynamic=True),
                kvpass.SlotCache(model, be, max_length=40),
                ids,
                3,
            )
        phases[specialize] = [r.phase for r in be.reports]
    assert phases[None] == ["prefill", "decode"]
    assert phases[False] == ["prefill", "prefill", "decode"]  # what it was before


def test_gated_two_pass_first_pass_overflow_is_skipped_not_written():
    """asl_2pass with a forced layer: the first pass computes the whole prompt in layers 0..layer, more
    than their 20 slots; those writes are skipped (the second pass writes every layer) instead of failing."""
    from test_asl import build as build_deep

    model = build_deep("llama", layers=4)
    ids = prompt(40, seed=3)
    be, cache, _ = slot_run(model, "asl_2pass", ids, 2, max_length=60, max_new_tokens=10, budget=10, window=4, layer=1)
    assert be.gate_info["passes"] == 2 and cache.capacity == 20
    assert all((cache.positions(i)[..., 10:12] == torch.tensor([40, 41], dtype=torch.int32)).all() for i in range(4))


def test_gemfilter_generate_and_continuation():
    """gemfilter through ``generate`` (position ids passed in, counting the whole prompt): the SlotCache
    moves them back on the device by the ``L - n`` its prefill renumbered away and equals the DynamicCache
    path (moved back by the host op); ``get_seq_length`` counts every token, so a second ``generate``
    continues the cache with only the new turn, placed at the renumbered positions ``n + ...``: equal to
    feeding that turn by hand to the DynamicCache path at the positions a bare forward derives."""
    from test_asl import build as build_deep

    ids = prompt(40, seed=4)
    turn = torch.randint(3, 90, (1, 5), generator=torch.Generator().manual_seed(5))
    params = dict(budget=10, layer=2)
    results = []
    for kind in ("dynamic", "slot"):
        torch._dynamo.reset()
        model = build_deep("llama", layers=4)
        be = kvpass.backend("gemfilter", compiler="eager", **params)
        model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = (
            DynamicCache(config=model.config)
            if kind == "dynamic"
            else kvpass.SlotCache(model, be, max_length=64, max_new_tokens=20)
        )
        seq, logits = _generate(model, ids, 6, past_key_values=cache)
        if kind == "slot":
            assert int(cache.get_seq_length()) == 40 + 6 - 1 and be.gate_info["kept"] == 10
            assert cache.positions(3)[0, 0, :16].tolist() == list(range(15)) + [-1]
            seq2, logits2 = _generate(model, torch.cat([seq, turn], 1), 4, past_key_values=cache)
            results.append((seq, logits, seq2[:, seq.shape[1] + 5 :], logits2))
        else:
            with torch.no_grad():  # the turn and 4 greedy steps by hand: positions from the cache (n + ...)
                chat = [
                    model(input_ids=torch.cat([seq[:, -1:], turn], 1), past_key_values=cache, use_cache=True).logits[
                        :, -1
                    ]
                ]
                for _ in range(3):
                    chat.append(
                        model(
                            input_ids=chat[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True
                        ).logits[:, -1]
                    )
            results.append((seq, logits, torch.stack([c.argmax(-1) for c in chat], 1), torch.stack(chat)))
    (seq, logits, new, chat), (s_seq, s_logits, s_new, s_chat) = results
    assert torch.equal(s_seq, seq)
    torch.testing.assert_close(s_logits, logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(s_new, new)
    torch.testing.assert_close(s_chat, chat, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def test_policy_without_slot_rule_refused():
    """Every built-in policy has a slot rule; a user's policy that names none is refused by name. (A
    chunk-fusion policy's SlotCache is built by kvpass.ChunkFusion: tests/test_fusion_slots.py.)"""
    from kvpass.policies.contract import Policy

    class Mine(Policy):
        name = "mine"

    with pytest.raises(kvpass.ConfigError, match="policy 'mine' has no fixed-capacity decode.*DynamicCache"):
        kvpass.SlotCache(build("llama"), kvpass.backend(Mine(), compiler="eager"), max_length=32)


def test_bad_construction_refused():
    """max_length must be an int >= 1, and at least max_new_tokens (it counts the prompt and the new tokens)."""
    model = build("llama")
    be = kvpass.backend("full", compiler="eager")
    for bad in (0, -3, 8.0):
        with pytest.raises(kvpass.ConfigError, match="max_length"):
            kvpass.SlotCache(model, be, max_length=bad)
    with pytest.raises(
        kvpass.ConfigError, match=r"^kvpass: SlotCache: parameter 'max_new_tokens' must be <= max_length"
    ):
        kvpass.SlotCache(model, be, max_length=8, max_new_tokens=16)


def test_a_model_without_attention_heads_is_refused_by_name():
    """A recurrent model (RWKV) has no key/value cache: a ConfigError naming the config and the way on, not an
    AttributeError from inside the cache (``kvpass.compile``'s generate builds one)."""
    cfg = transformers.RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, context_length=64)
    model = transformers.RwkvForCausalLM(cfg).eval()
    be = kvpass.backend("full", compiler="eager")
    with pytest.raises(kvpass.ConfigError, match=r"RwkvConfig\) names no attention heads.*without kvpass.compile"):
        kvpass.SlotCache(model, be, max_length=16)


def test_capacity_errors():
    """A prompt longer than a ``full`` cache's max_length fails the prefill with a message naming it; a
    decode step past it fails the device-side assert (a RuntimeError on the CPU)."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    be = kvpass.backend("full", compiler="eager")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    with torch.no_grad():
        with pytest.raises(Exception, match="a 13-token prompt on a cache built for max_length=10.*max_length >="):
            fwd(input_ids=ids, past_key_values=kvpass.SlotCache(model, be, max_length=10), use_cache=True)
        cache = kvpass.SlotCache(model, be, max_length=14)
        fwd(input_ids=ids, past_key_values=cache, use_cache=True)
        fwd(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # slot 13: the last one
        with pytest.raises(RuntimeError, match="longer than the max_length the cache was built for"):
            fwd(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_uncompiled_model_on_compressed_cache_fails():
    """After streamingllm compressed the slots, the model's own update (slot_append) would read slots as
    positions: it fails loudly, naming the fix. On an uncompressed cache (full) it is HF's StaticCache and
    may go on."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    for policy, params, fails in (("streamingllm", dict(budget=BUDGET, sinks=SINKS), True), ("full", {}, False)):
        torch._dynamo.reset()
        be = kvpass.backend(policy, compiler="eager", **params)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)
        cache = kvpass.SlotCache(model, be, max_length=40)
        with torch.no_grad():
            fwd(input_ids=ids, past_key_values=cache, use_cache=True)
            if fails:
                with pytest.raises(RuntimeError, match="kvpass backend did not rewrite .* policy 'streamingllm'"):
                    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
            else:
                out = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).logits
                ref = DynamicCache(config=model.config)
                model(input_ids=ids, past_key_values=ref, use_cache=True)
                torch.testing.assert_close(
                    out, model(input_ids=ids[:, :1], past_key_values=ref, use_cache=True).logits, atol=1e-5, rtol=1e-5
                )


def test_a_graph_kvpass_leaves_unchanged_is_refused_on_a_slot_cache():
    """Falcon with ALiBi: kvpass cannot re-index its additive bias and would compile the prefill unchanged, but a
    SlotCache's slots are read right only by kvpass's rewritten attention, so the graph is refused with the reason
    and the way out (the model's own cache), before any token is computed. (A gated policy's selection layer past
    the model no longer gets this far: the SlotCache refuses the policy as it is built.)"""
    from test_hostile import falcon

    model = falcon("eager")
    torch._dynamo.reset()
    be = kvpass.backend("streamingllm", compiler="eager", budget=16, sinks=2)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=40, max_new_tokens=4)
    with pytest.raises(Exception, match=r"cannot run on a kvpass.SlotCache.*ALiBi.*DynamicCache") as e:
        run(fwd, cache, prompt(36, seed=3), 1)
    assert isinstance(e.value.inner_exception, kvpass.ConfigError)  # Dynamo wraps what a backend raises
    assert int(cache.layers[0].count[0, 0]) == 0  # nothing was written


@pytest.mark.parametrize(
    "policy,params",
    [
        ("snapkv", dict(budget=BUDGET, window=4)),
        ("streamingllm", dict(budget=BUDGET, sinks=SINKS)),
        ("full", {}),
        ("art", dict(tau=0.0)),
    ],
)
def test_prefill_outside_the_backend_is_refused(policy, params):
    """generate(..., compile_config=CompileConfig(backend=be)) compiles only the decode steps: its prefill
    ran uncompiled and appended the whole prompt into a snapkv SlotCache, so the generation was `full`'s,
    without a word. The cache's own update now refuses unless the policy's prefill is a plain append
    (`full`, `art`), naming the fix; with those the generation equals the uncompiled model's (art with
    tau = 0 is exact)."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = build("llama")
    ids = prompt(20, seed=4)
    be = kvpass.backend(policy, compiler="eager", **params)
    cc = CompileConfig(backend=be, fullgraph=False, mode="default")
    cc._compile_all_devices = True  # generate auto-compiles only on accelerators otherwise
    cache = kvpass.SlotCache(model, be, max_length=40)
    if policy not in ("full", "art"):
        with pytest.raises(RuntimeError, match=f"did not rewrite .* policy '{policy}'.*model.forward = torch.compile"):
            model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, compile_config=cc)
        return
    got = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, compile_config=cc)
    want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=4, do_sample=False)
    assert got.tolist() == want.tolist() and be.reports, "generate did not run the compiled decode"


def test_static_long_prompt_mask_warns_dynamic_checks_it():
    """A static-shape prefill of 2,100 tokens: the model's causal mask (4.4M entries) is too large to check,
    so it is kept, and kvpass says so once, naming dynamic=True; compiled with dynamic=True the mask is
    checked at small probe sizes and the prefill attention runs in the causal mode (no mask)."""
    from kvpass.errors import _WARNED

    model = build("llama", "eager")  # eager attention: transformers always materialises the mask
    ids = torch.randint(3, 90, (1, 2100), generator=torch.Generator().manual_seed(1))
    for dynamic in (False, True):
        torch._dynamo.reset()
        _WARNED.clear()
        be = kvpass.backend("full", compiler="eager")
        masks = []
        inner = be._inner

        def spy(gm, ex, *rest):
            masks.extend(n.args[3] for n in gm.graph.nodes if n.target is torch.ops.kvpass.attention.default)
            return inner(gm, ex, *rest)

        be._inner = spy
        fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            fwd(
                input_ids=ids,
                past_key_values=kvpass.SlotCache(model, be, max_length=2101),
                use_cache=True,
                logits_to_keep=1,
            )
        said = [str(w.message) for w in caught if "too large to check" in str(w.message)]
        assert masks and (all(m is not None for m in masks) if not dynamic else all(m is None for m in masks))
        assert len(said) == (0 if dynamic else 1) and all("dynamic=True" in m for m in said)


def test_repr():
    model = build("llama")
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    text = repr(kvpass.SlotCache(model, be, max_length=40, batch_size=2))
    assert "policy='streamingllm'" in text and f"capacity={BUDGET + 1}" in text and "batch=2" in text


# ------------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------------

B, HKV, H, D = 2, 2, 4, 8


def _slots(cap: int):
    return (
        torch.zeros(B, HKV, cap, D),
        torch.zeros(B, HKV, cap, D),
        torch.full((B, HKV, cap), -1, dtype=torch.int32),
        torch.tensor([[0, 0, 0, 1 << 40, 0]] * B),
    )


def test_opcheck_slot_append():
    """The cache's own update; opcheck replays it (each replay appends), so the slots are roomy."""
    gen = torch.Generator().manual_seed(0)
    keys, values, pos, count = _slots(64)
    k_new, v_new = torch.randn(B, HKV, 3, D, generator=gen), torch.randn(B, HKV, 3, D, generator=gen)
    torch.library.opcheck(torch.ops.kvpass.slot_append, (keys, values, pos, count, k_new, v_new, [torch.zeros(3)]))
    keys, values, pos, count = _slots(8)
    torch.ops.kvpass.slot_append(keys, values, pos, count, k_new, v_new, [])
    torch.ops.kvpass.slot_append(keys, values, pos, count, k_new[:, :, :1], v_new[:, :, :1], [])
    assert (count[:, :3] == torch.tensor([4, 4, 0])).all() and pos[0, 0].tolist() == [0, 1, 2, 0 + 3, -1, -1, -1, -1]
    assert torch.equal(keys[:, :, :3], k_new) and torch.equal(values[:, :, 3], v_new[:, :, 0])


@pytest.fixture
def rt():
    """A real runtime (streamingllm, budget 8, sinks 2) and one SlotCache site."""
    be = kvpass.backend("streamingllm", compiler="eager", budget=BUDGET, sinks=SINKS)
    be.runtime.sites[0] = SimpleNamespace(sliding_window=None, cache="slot", layer=0)
    yield be.runtime  # held by `be` until the test ends (the registry is weak)


@pytest.mark.parametrize("padded", [False, True])
def test_opcheck_slot_prefill(rt, padded):
    """The policy keeps entries of a 13-token prompt and they fill the first slots, real ones first in
    position order; opcheck replays it (a replay rewrites the same slots and counters)."""
    gen = torch.Generator().manual_seed(1)
    n = 13
    q = torch.randn(B, H, n, D, generator=gen)
    k_new, v_new = torch.randn(B, HKV, n, D, generator=gen), torch.randn(B, HKV, n, D, generator=gen)
    mask = None
    if padded:  # row 1: 9 pads, 4 real tokens (an HF additive causal mask)
        allowed = torch.ones(n, n, dtype=torch.bool).tril().expand(B, 1, n, n).clone()
        allowed[1, :, :, :9] = False
        mask = torch.zeros(B, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    keys, values, pos, count = _slots(BUDGET + 1)
    args = (keys, values, pos, count, [], q, k_new, v_new, mask, rt.handle, 0)
    torch.library.opcheck(torch.ops.kvpass.slot_prefill, args)
    torch.ops.kvpass.slot_prefill(*args)
    assert (count[:, :3] == torch.tensor([n, BUDGET, 0])).all()
    assert pos[0, 0].tolist() == [0, 1] + list(range(n - BUDGET + SINKS, n)) + [-1]
    assert torch.equal(keys[0, :, :SINKS], k_new[0, :, :SINKS]) and torch.equal(values[0, :, 2:BUDGET], v_new[0, :, 7:])
    if padded:
        assert pos[1, 0].tolist() == [9, 10, 11, 12] + [-1] * 5
        assert torch.equal(keys[1, :, :4], k_new[1, :, 9:])


# ------------------------------------------------------------------------------------------------
# Inductor
# ------------------------------------------------------------------------------------------------


@pytest.mark.inductor
@pytest.mark.parametrize(
    "policy,params",
    [("streamingllm", dict(budget=BUDGET, sinks=SINKS)), ("full", {}), ("quest", QUEST), ("raas", RAAS)],
)
def test_decode_writes_slots_in_place(policy, params):
    """Inductor's decode graph writes the new token into the slots (and a page's bounds into the policy's
    state) in place: no buffer of their shape is allocated (a ring written with scatter_ was copied whole,
    then copied back, at every step)."""
    from torch._inductor.utils import run_and_get_code

    model = build("llama")
    ids = prompt(40, seed=4)
    torch._dynamo.reset()
    be = kvpass.backend(policy, **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    cache = kvpass.SlotCache(model, be, max_length=64)
    with torch.no_grad():
        fwd(input_ids=ids, past_key_values=cache, use_cache=True)
        _, codes = run_and_get_code(fwd, input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    assert [r.phase for r in be.reports] == ["prefill", "decode"]
    lay = cache.layers[0]
    for t in (lay.keys, *(t for t in lay.state if t.dim() == 4)):  # the slots, and page bounds beside them
        shape = str(tuple(t.shape))
        assert codes and not any(f"empty_strided_cpu({shape}" in c for c in codes), shape


@pytest.mark.inductor
def test_inductor_equals_eager_compiler():
    """Real Inductor compiles write_slots into the decode graph (and checks the ops' fake shapes): full and
    streamingllm over 6 steps equal the eager compiler's logits."""
    model = build("llama")
    ids = torch.randint(3, 90, (1, 13), generator=torch.Generator().manual_seed(1))
    for policy, params in (
        ("full", {}),
        ("streamingllm", dict(budget=BUDGET, sinks=SINKS)),
        ("quest", QUEST),
        ("raas", dict(budget=16)),
    ):
        _, _, ref = slot_run(model, policy, ids, 6, **params)
        tokens = torch.stack([r.argmax(-1, keepdim=True) for r in ref[:-1]])
        be, cache, got = slot_run(model, policy, ids, 6, tokens, compiler="inductor", **params)
        assert_logits_close(got, ref, atol=1e-4)
        assert [r.phase for r in be.reports] == ["prefill", "decode"]
        assert cache.seen == 13 + 6


def test_a_write_longer_than_the_cache_fails_on_the_host():
    """More new tokens than the cache has slots is known from the shapes: the model's own update refuses on the
    host, naming both counts, before the device assert (which on a GPU ends the process: a two-GPU Qwen3 run
    died so when a policy's graph compiled unchanged)."""
    b, h, cap, d, q = 1, 2, 4, 8, 6
    keys, values = torch.zeros(b, h, cap, d), torch.zeros(b, h, cap, d)
    pos = torch.full((b, h, cap), -1, dtype=torch.long)
    count = torch.tensor([[0, 0, 0, 100, 0]], dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"longer than the cache's capacity.*\(6 new tokens, 4 slots\)"):
        torch.ops.kvpass.slot_append(keys, values, pos, count, torch.ones(b, h, q, d), torch.ones(b, h, q, d), [])
    assert int(count[0, 1]) == 0 and bool((pos == -1).all())  # nothing written


@pytest.mark.parametrize("policy", ["quest", "raas"])
def test_a_slot_graph_leaves_the_dynamic_graphs_sites_alone(policy):
    """One backend, one compiled forward, a DynamicCache generation, then a SlotCache one (its graphs compiled
    second), then a DynamicCache again: the last equals the first. The page policies read the site's cache kind
    when they select; before each graph's operators named their own graph's sites, the slot graphs replaced the
    layers' sites and the DynamicCache prefill took the slot branch."""
    model = build("llama")
    ids = prompt(40, seed=4)
    torch._dynamo.reset()
    params = QUEST if policy == "quest" else dict(budget=32)
    be = kvpass.backend(policy, compiler="eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    tokens, first = run(fwd, DynamicCache(config=model.config), ids, 6)
    run(fwd, kvpass.SlotCache(model, be, max_length=64), ids, 6, torch.stack(tokens))
    _, again = run(fwd, DynamicCache(config=model.config), ids, 6, torch.stack(tokens))
    assert_logits_close(again, first)
    torch._dynamo.reset()
