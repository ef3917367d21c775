"""kvzip: the repeat passes' scores against the model's own attention, the entries kept, memory, batches, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
from kvpass.generate import reconstruct
from kvpass.policies import make_policy
from tests.families import build

N, NEW = 40, 5


class Tok:
    """A stand-in tokenizer: a few ids per text, the same for the same text."""

    name_or_path = "tok"

    def encode(self, text, add_special_tokens=False):
        return [10 + ord(c) % 80 for c in text.strip()[:4]] or [11]


def prompt(n: int = N, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(10, 90, (rows, n), generator=torch.Generator().manual_seed(seed))


def compiled(policy="kvzip", **params):
    model = build("llama")
    params = {"tokenizer": Tok(), **params} if policy == "kvzip" else params
    return model, kvpass.compile(model, policy, compiler="eager", **params)


def pass_scores(model, be, ids: torch.Tensor, mask=None, forward=None) -> dict[int, torch.Tensor]:
    """The repeat passes' scores of prompt ``ids`` per layer: a SlotCache prefill inside kvpass.repeat_passes, the
    scores read as its forward returns (the passes have run; the block's end gives them back)."""
    cache = kvpass.SlotCache(model, be, max_length=ids.shape[1] + NEW, max_new_tokens=NEW)
    with torch.no_grad(), reconstruct.repeat_passes(model, be, ids, mask, forward=forward):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        return {k: v.clone() for k, v in be.runtime.state.scores.items()}


def reference_scores(policy, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """KVzip's scores from the uncompiled model's own attention weights: each pass run on the prompt followed by
    the pass (one sequence: the same keys and positions as a pass on the prompt's cache), its queries' weights
    renormalised over the sinks, the chunk and the pass (KVzip's softmax), the most over queries and group."""
    ref = build("llama", attn="eager")
    b, n = ids.shape
    out: dict[int, torch.Tensor] = {}
    for start, end, pass_ids, _ in policy.passes(ids, None):
        r = pass_ids.shape[1]
        with torch.no_grad():
            att = ref(torch.cat([ids, pass_ids], 1), output_attentions=True).attentions
        sink = min(policy.sinks, start)
        cols = torch.cat([torch.arange(sink), torch.arange(start, end), torch.arange(n, n + r)])
        for layer, a in enumerate(att):
            p = a[:, :, n:][..., cols]
            p = p / p.sum(-1, keepdim=True)
            hkv = ref.config.num_key_value_heads
            s = p[..., sink : sink + end - start].reshape(b, hkv, -1, end - start).amax(2)
            out.setdefault(layer, torch.zeros(b, hkv, n))[..., start:end] = s
    return out


def test_the_passes_scores_are_the_models_attention_renormalised():
    model, be = compiled(budget=16, chunk_size=16, sinks=3, overlap=4)
    ids = prompt()
    got = pass_scores(model, be, ids)
    assert not be.runtime.state.scores and be.runtime.state.deferred is None  # given back after the prefill
    want = reference_scores(be.policy, ids)
    assert sorted(got) == sorted(want) == [0, 1]
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-4)


def test_the_passes_score_through_the_window_kernel_as_the_model_attends(monkeypatch):
    """On a GPU the passes score with the window kernel (``reduce="max"``, their columns laid out by positions);
    here it runs in Triton's interpreter, its query rows padded, against the model's own attention."""
    from kvpass.kernels import window_scores as W
    from kvpass.policies.prefill import kvzip

    if W.triton is None:
        pytest.skip("needs Triton")
    calls = []

    def kernel(*args, **kw):
        calls.append(args[0].shape)
        return W.window_scores_triton(*args, **kw, block=16)

    monkeypatch.setattr(kvzip, "window_scores_eager", kernel)
    model, be = compiled(budget=16, chunk_size=16, sinks=3, overlap=4)
    ids = prompt()
    got = pass_scores(model, be, ids)
    want = reference_scores(be.policy, ids)
    assert calls and all(shape[2] == kvzip.ROW_BUCKET for shape in calls)  # the padded rows
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-4)


def test_padding_scores_alike_in_the_kernel_and_the_reference(monkeypatch):
    """Padding in the prompt and the pass (``valid``): the kernel's position layout gives the reference's scores,
    and a padding entry gets none."""
    from kvpass.kernels import window_scores as W
    from kvpass.policies.prefill import kvzip

    if W.triton is None:
        pytest.skip("needs Triton")
    policy = make_policy("kvzip", budget=8, sinks=3, tokenizer=Tok())
    g = torch.Generator().manual_seed(1)
    n, r = 30, 9
    q, k = torch.randn(2, 4, r, 16, generator=g), torch.randn(2, 2, n + r, 16, generator=g)
    valid = torch.ones(2, n + r, dtype=torch.bool)
    valid[1, :10] = False  # a left-padded row: its first two entries of the chunk are padding
    valid[1, n : n + 2] = False  # its pass's first tokens padding too
    want = policy.repeat_scores(q, k, valid, (8, 20), 0.0)
    monkeypatch.setattr(kvzip, "window_scores_eager", lambda *a, **kw: W.window_scores_triton(*a, **kw, block=16))
    got = policy.repeat_scores(q, k, valid, (8, 20), 0.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert want.shape == (2, 2, 12) and want[1, :, :2].eq(0).all() and want[1, :, 2:].gt(0).all()


def test_the_prompt_is_prefilled_once_and_its_passes_take_no_mask():
    """The passes run on the entries of the caller's own prefill (no prefill of their own), and an all-ones mask
    (what ``generate`` passes) is dropped: with it transformers builds each pass an [r, n + r] mask (31 GiB at 130k
    tokens for the prompt's own); the scores equal those of a call without a mask."""
    model, be = compiled(budget=16, chunk_size=16, sinks=3, overlap=4)
    ids = prompt()
    seen = []

    def forward(**kw):
        seen.append((kw["input_ids"].shape[1], "attention_mask" in kw))
        return model(**kw)

    got = pass_scores(model, be, ids, mask=torch.ones_like(ids), forward=forward)
    assert seen == [(p.shape[1], False) for _, _, p, _ in be.policy.passes(ids, None)]  # the passes alone
    want = pass_scores(model, be, ids)
    assert sorted(got) == sorted(want) == [0, 1]
    for layer in want:
        torch.testing.assert_close(got[layer], want[layer])


def test_passes_follow_kvzips_prompts():
    _, be = compiled(budget=16, chunk_size=16, overlap=4)
    ids = prompt()
    assert compiled(budget=N, chunk_size=16)[1].policy.passes(ids, None) == []  # a prompt within the budget: none
    passes = be.policy.passes(ids, None)
    first, later, suffix = (torch.tensor(t) for t in be.policy._ids)
    assert [(s, e) for s, e, _, _ in passes] == [(0, 16), (16, 32), (32, 40)]
    assert torch.equal(passes[0][2][0], torch.cat([first, suffix, ids[0, :16]]))
    assert torch.equal(passes[1][2][0], torch.cat([later, ids[0, 12:16], suffix, ids[0, 16:32]]))
    mask = torch.ones(1, N, dtype=torch.long)
    mask[0, :3] = 0
    got = be.policy.passes(ids, mask)[1][3]
    assert got.shape[1] == N + passes[1][2].shape[1] and got[0, :N].tolist() == mask[0].tolist()


def held(cache, layer: int, below: int) -> list[set[int]]:
    """Per KV head of row 0, the prompt positions layer ``layer`` of a SlotCache holds."""
    lay = cache.layers[layer]
    flat, ranges = lay.pos[0].reshape(-1), lay.state[0][0]
    return [{int(p) for p in flat[s : s + n] if 0 <= p < below} for s, n in ranges[:, :2].tolist()]


def test_generate_keeps_each_layers_best_entries_over_its_heads():
    budget, sinks = 12, 2
    model, be = compiled(budget=budget, chunk_size=16, sinks=sinks)
    ids = prompt()
    model.generate(ids, max_new_tokens=NEW, do_sample=False)
    cache = next(iter(model.generate.caches.values()))
    for layer, scores in reference_scores(be.policy, ids).items():
        hkv = scores.shape[1]
        key = scores[0].clone()
        key[:, :sinks] = float("inf")
        top = key.reshape(-1).topk(hkv * budget).indices
        want = [{int(i) % N for i in top if int(i) // N == h} for h in range(hkv)]
        assert held(cache, layer, N) == want
    assert be.state.evicted_tokens > 0


def test_the_plain_backend_on_a_slot_cache_keeps_what_kvpass_compile_does():
    """``kvpass.backend`` with a loop of one's own (as `kvpass compare` runs it): the passes around a SlotCache's
    prefill keep the same entries per head and decode the same tokens as ``kvpass.compile``'s generate."""
    ids = prompt()
    model, _ = compiled(budget=12, chunk_size=16)
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, N:].tolist()
    slot = next(iter(model.generate.caches.values()))
    plain = build("llama")
    be = kvpass.backend("kvzip", budget=12, chunk_size=16, tokenizer=Tok(), compiler="eager")
    fwd = torch.compile(plain.forward, backend=be, dynamic=True)
    cache, got = kvpass.SlotCache(plain, be, max_length=N + NEW, max_new_tokens=NEW), []
    with torch.no_grad():
        with kvpass.repeat_passes(plain, be, ids, forward=fwd):
            logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(NEW):
            got.append(int(logits.argmax(-1)))
            logits = fwd(input_ids=torch.tensor([[got[-1]]]), past_key_values=cache, use_cache=True).logits[:, -1]
    assert got == want
    for layer in range(2):
        assert held(cache, layer, N) == held(slot, layer, N)


def test_the_layers_keep_as_the_prefill_returns():
    """Under kvpass.compile the passes run as the prefill's forward returns: inside the block, before any decode
    step, every layer holds its kept entries (the same as generate's) and nothing waits."""
    model, be = compiled(budget=12, chunk_size=16)
    ids = prompt()
    model.generate(ids, max_new_tokens=NEW, do_sample=False)
    want = [held(next(iter(model.generate.caches.values())), layer, N) for layer in range(2)]
    cache = kvpass.SlotCache(model, be, max_length=N + NEW, max_new_tokens=NEW)
    with torch.no_grad(), kvpass.repeat_passes(model, be, ids):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert be.runtime.state.deferred is None
        assert [int(lay.count[0, 0]) for lay in cache.layers] == [N, N]  # seen
        assert [held(cache, layer, N) for layer in range(2)] == want


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_graph_that_hands_the_prefill_copies_keeps_the_same(compiler):
    """AOTAutograd may run the prefill's slot operator on copies of the cache's tensors (written back as the graph
    ends): the held layers keep into the cache itself, found by their counts' tag, as under the eager compiler,
    and ``be.state`` reports that cache (the operator's own note of it named a copy)."""
    ids = prompt()
    model, be = compiled(budget=12, chunk_size=16)
    want = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    kept = [held(next(iter(model.generate.caches.values())), layer, N) for layer in range(2)]
    other = build("llama")
    be_other = kvpass.compile(other, "kvzip", budget=12, chunk_size=16, tokenizer=Tok(), compiler=compiler)
    assert torch.equal(other.generate(ids, max_new_tokens=NEW, do_sample=False), want)
    assert [held(next(iter(other.generate.caches.values())), layer, N) for layer in range(2)] == kept
    want_state = (N + NEW - 1, {0: 16, 1: 16})  # the last new token is never fed back
    assert (be_other.state.seen, be_other.state.stored) == (be.state.seen, be.state.stored) == want_state


def test_a_prefill_in_pieces_or_a_decode_before_the_passes_is_refused_by_name():
    """The passes score the whole prompt: a prefill of part of it is refused; on a forward of one's own the passes
    run as the block ends, so a decode step inside the block is refused there; either way nothing is left held."""
    ids = prompt()
    plain = build("llama")
    be = kvpass.backend("kvzip", budget=12, chunk_size=16, tokenizer=Tok(), compiler="eager")
    fwd = torch.compile(plain.forward, backend=be, dynamic=True)
    with torch.no_grad():
        cache = kvpass.SlotCache(plain, be, max_length=N + NEW, max_new_tokens=NEW)
        with pytest.raises(kvpass.ConfigError, match="whole 40-token prompt.*in one call"):
            with kvpass.repeat_passes(plain, be, ids, forward=fwd):
                fwd(input_ids=ids[:, :30], past_key_values=cache, use_cache=True)
        cache = kvpass.SlotCache(plain, be, max_length=N + NEW, max_new_tokens=NEW)
        with pytest.raises(kvpass.ConfigError, match="written again before the repeat passes ran"):
            with kvpass.repeat_passes(plain, be, ids, forward=fwd):
                fwd(input_ids=ids, past_key_values=cache, use_cache=True)
                fwd(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    state = be.runtime.state
    assert state.deferred is None and state.repeat is None and not state.scores and not state.passes


def test_a_budget_over_the_prompt_equals_the_uncompiled_model():
    ids = prompt()
    ref = build("llama").generate(ids, max_new_tokens=NEW, do_sample=False)
    model, _ = compiled(budget=1000, chunk_size=16)
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False), ref)


def test_a_slot_cache_of_kvzip_costs_what_adakvs_does():
    model = build("llama")
    caches = [
        kvpass.SlotCache(model, kvpass.backend(p, budget=16, **extra), max_length=N + NEW, max_new_tokens=NEW)
        for p, extra in (("kvzip", {"tokenizer": Tok()}), ("adakv", {"window": 4}))
    ]
    assert caches[0].kv_bytes() == caches[1].kv_bytes()


def test_a_request_queue_equals_each_prompt_alone():
    model, _ = compiled(budget=12, chunk_size=16)
    prompts = [prompt(N, 1)[0], prompt(N - 9, 2)[0], prompt(N + 7, 3)[0]]
    alone = [model.generate(p[None], max_new_tokens=NEW, do_sample=False)[0] for p in prompts]
    together = model.generate(prompts, max_new_tokens=NEW, do_sample=False, max_batch=2)
    for a, t in zip(alone, together):
        assert torch.equal(a, t)


def test_a_left_padded_row_with_one_chunk_equals_the_row_alone():
    model, _ = compiled(budget=12, chunk_size=64)
    short = prompt(N - 6, 4)
    alone = model.generate(short, max_new_tokens=NEW, do_sample=False)[0, -NEW:]
    ids = torch.cat([prompt(N, 5), torch.cat([torch.zeros(1, 6, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    both = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(both[1, -NEW:], alone)


def test_bad_configuration_is_refused_by_name():
    with pytest.raises(kvpass.ConfigError, match="parameter 'tokenizer'"):
        kvpass.backend("kvzip", budget=16)
    with pytest.raises(kvpass.ConfigError, match="parameter 'tokenizer'"):  # a name, not the tokenizer
        kvpass.backend("kvzip", budget=16, tokenizer="HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(kvpass.ConfigError, match="chunk_size"):
        kvpass.backend("kvzip", budget=16, tokenizer=Tok(), chunk_size=0)


def test_transformers_generate_on_a_dynamic_cache_says_it_keeps_everything():
    """Without passes and a SlotCache, kvzip keeps every entry (one shape contract per graph) and says so."""
    model = build("llama")
    be = kvpass.backend("kvzip", budget=12, tokenizer=Tok(), compiler="eager")
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    with pytest.warns(kvpass.KVPassWarning, match="keeps every entry, as 'full'"):
        out = model.generate(prompt(), max_new_tokens=3, do_sample=False)
    assert torch.equal(out, build("llama").generate(prompt(), max_new_tokens=3, do_sample=False))


def test_a_graph_of_several_tokens_outside_the_passes_says_it_keeps_everything():
    """A bare forward of several tokens on a filled DynamicCache (a chat turn) runs the append graph, whose operator
    scores only inside kvpass.repeat_passes: outside them kvzip keeps every entry and says so, once (families whose
    one graph serves prefill and decode alike never compile a one-token decode graph, which says it at compile)."""
    model = build("llama")
    be = kvpass.backend("kvzip", budget=12, tokenizer=Tok(), compiler="eager")
    fwd = torch.compile(model.forward, backend=be, dynamic=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        fwd(input_ids=prompt(), past_key_values=cache, use_cache=True)
        with pytest.warns(kvpass.KVPassWarning, match="on this dynamic cache it keeps every entry, as 'full'"):
            fwd(input_ids=prompt(6, seed=1), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == N + 6 and be.runtime.state.passes is False


def test_opcheck_repeat_scores():
    """The operator passes the attention output through and, inside a pass, records the same scores on a replay."""
    be = kvpass.backend("kvzip", budget=8, tokenizer=Tok(), compiler="eager")
    g = torch.Generator().manual_seed(3)
    out, q, k = (torch.randn(*s, generator=g) for s in ((1, 4, 6, 16), (1, 4, 6, 16), (1, 2, 30, 16)))
    be.runtime.state.repeat = (4, 20)
    torch.library.opcheck(torch.ops.kvpass.repeat_scores.default, (out, q, k, None, 0.25, 0.0, be.runtime.handle, 0))
    scores = be.runtime.state.scores[0]
    assert scores.shape == (1, 2, 24) and bool((scores[..., 4:20] > 0).all()) and not scores[..., :4].any()


def test_a_slot_cache_prefill_without_the_passes_is_refused_by_name():
    model = build("llama")
    be = kvpass.backend("kvzip", budget=12, tokenizer=Tok(), compiler="eager")
    fwd = torch.compile(model.forward, backend=be, dynamic=True)
    cache = kvpass.SlotCache(model, be, max_length=N + NEW, max_new_tokens=NEW)
    with pytest.raises(Exception, match="no repeat passes ran.*kvpass.repeat_passes"):
        fwd(input_ids=prompt(), past_key_values=cache, use_cache=True)
