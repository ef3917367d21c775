"""Uses outside the tested matrix that gave wrong output with no warning, or crashed.

Each test reproduces one case at small scale on CPU and checks that it is now exact or refused
loudly (a ``KVPassWarning`` with the graph left unchanged, or an error naming the way out). The
8B-shape GPU cases (raas's fake kernel at 4,096 tokens, art's 128k prefill memory) are not here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

import kvpass
from families import build

PROMPT = torch.randint(10, 90, (1, 40), generator=torch.Generator().manual_seed(0))


def kvpass_warnings(fn):
    """Run ``fn()``; return (its result, the kvpass warnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning)]


def greedy(fwd, model, ids, steps: int, cache=None, positions: bool = False):
    """Bare-forward prefill + greedy decode; the last logits of every call."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    out = []
    with torch.no_grad():
        kw = dict(position_ids=torch.arange(ids.shape[1])[None]) if positions else {}
        lg = fwd(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits[:, -1]
        out.append(lg)
        for i in range(steps):
            kw = dict(position_ids=torch.tensor([[ids.shape[1] + i]])) if positions else {}
            lg = fwd(input_ids=lg.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True, **kw).logits[:, -1]
            out.append(lg)
    return torch.stack(out)


# 1. continuing a generation over an evicted DynamicCache -------------------------------------------


@pytest.mark.parametrize("policy,params", [("streamingllm", dict(budget=16)), ("snapkv", dict(budget=16, window=4))])
def test_continuing_an_evicted_dynamic_cache_is_refused(policy, params):
    """generate, then generate again on the returned cache with more input: transformers counts the
    stored entries, so it would feed tokens already seen a second time (streamingllm: seen 86 for 57
    true tokens). Its positions start at the stored length, below the tokens seen: refused with an error
    that names the SlotCache, whose count is tokens seen. (A bare forward of only the new tokens, whose
    derived positions kvpass corrects, stays exact: tests/test_slot_cache.py compares against it.)"""
    torch._dynamo.reset()
    model = build("llama")
    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy, compiler="eager", **params))
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, torch.randint(10, 90, (1, 9))], 1)
    with pytest.raises(ValueError, match="kvpass.SlotCache"):
        model.generate(more, past_key_values=out.past_key_values, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("seed", [1, 2])  # refused on one token behind (1), on several drafts (2)
def test_prompt_lookup_decoding_after_eviction_is_refused(seed):
    """Prompt-lookup (assisted) decoding crops the drafts it rejects and counts positions from what is left,
    after the policy evicted real tokens for them: the output differed from plain streamingllm with 5 of 8
    entries left. Refused whichever call finds it first (several draft tokens, or one token behind the
    tokens seen); ``full`` evicts nothing and equals plain generate."""
    ids = torch.randint(10, 90, (1, 20), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([ids, ids[:, :8]], 1)  # a repeat, so lookup finds drafts
    model = build("llama")
    fwd = model.forward
    for policy, params in (("full", {}), ("streamingllm", dict(budget=8)))[seed - 1 :]:
        torch._dynamo.reset()
        model.forward = torch.compile(fwd, backend=kvpass.backend(policy, compiler="eager", **params))
        if policy == "full":
            got = model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
            torch.testing.assert_close(got, model.generate(ids, max_new_tokens=12, do_sample=False))
            continue
        with pytest.raises(ValueError, match="prompt-lookup decoding"):
            model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)


def test_a_cache_cropped_after_eviction_is_refused():
    """Entries removed behind kvpass (``DynamicCache.crop``, as assisted decoding does) after an eviction:
    the next bare forward cannot tell which tokens are left; refused, not read as tokens 0..n-1."""
    torch._dynamo.reset()
    model = build("llama")
    fwd = torch.compile(model.forward, backend=kvpass.backend("streamingllm", budget=16, compiler="eager"))
    cache = DynamicCache(config=model.config)
    greedy(fwd, model, PROMPT, 3, cache=cache)
    cache.crop(-4)  # 16 kept -> 12
    with pytest.raises(ValueError, match="now holds 12 entries: something removed entries behind kvpass"):
        with torch.no_grad():
            fwd(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)


TURNS = [  # policies whose records on a DynamicCache differ in kind: positions, scores, per-head ranges, pages
    ("streamingllm", dict(budget=16)),
    ("snapkv", dict(budget=16, window=4)),
    ("h2o", dict(budget=16)),
    ("tova", dict(budget=16)),
    ("adakv", dict(budget=16, window=4)),
    ("quest", dict(budget=16, dense_layers=0)),
    ("raas", dict(budget=16)),
]


STEPS = 20  # past a page of 16 decoded tokens (raas evicts pages of them)


def steps_alone(fwd, model, ids, steps):
    return greedy(fwd, model, ids, steps, positions=True)


@pytest.mark.parametrize("policy,params", TURNS, ids=[p for p, _ in TURNS])
def test_dynamic_caches_decoded_in_turn_each_continue_from_their_own_records(policy, params):
    """One backend, two DynamicCaches: A prefilled (40 tokens), B prefilled (50), then decode steps of A and B in
    turn. The backend's records follow the cache each call holds (``kvpass.compiler.holds``), so every step equals
    the same sequence decoded alone (records shared by the two caches would run A's steps on B's positions and
    scores: refused, or wrong where the counts agree)."""
    torch._dynamo.reset()
    model = build("llama")
    other = torch.randint(10, 90, (1, 50), generator=torch.Generator().manual_seed(1))
    fwd = torch.compile(model.forward, backend=kvpass.backend(policy, compiler="eager", **params))
    want = [steps_alone(fwd, model, ids, STEPS) for ids in (PROMPT, other)]
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    got = [[], []]
    with torch.no_grad():
        for r, ids in enumerate((PROMPT, other)):
            pos = torch.arange(ids.shape[1])[None]
            got[r].append(fwd(input_ids=ids, past_key_values=caches[r], use_cache=True, position_ids=pos).logits[:, -1])
        for i in range(STEPS):
            for r, ids in enumerate((PROMPT, other)):
                tok = got[r][-1].argmax(-1, keepdim=True)
                pos = torch.tensor([[ids.shape[1] + i]])
                got[r].append(
                    fwd(input_ids=tok, past_key_values=caches[r], use_cache=True, position_ids=pos).logits[:, -1]
                )
    for r in range(2):
        torch.testing.assert_close(torch.stack(got[r]), want[r], atol=1e-5, rtol=1e-5)


def test_beam_search_reordering_an_evicted_dynamic_cache_warns():
    """Beam search reorders the cache's rows behind kvpass (``reorder_cache``); h2o's per-row scores do not follow,
    so a beam could read another beam's: said once, naming the cause and num_beams=1. Greedy decoding says
    nothing (the keys each call holds are the ones the last graph returned)."""
    torch._dynamo.reset()
    model = build("llama")
    model.forward = torch.compile(model.forward, backend=kvpass.backend("h2o", budget=16, compiler="eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvpass.KVPassWarning)
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    with pytest.warns(kvpass.KVPassWarning, match="no kvpass graph returned.*reorder_cache.*num_beams=1"):
        model.generate(PROMPT, max_new_tokens=4, do_sample=False, num_beams=3)


def first_turn_on_a_slot_cache(policy: str):
    """A chat's first turn (8 new tokens after ``PROMPT``) on a SlotCache under ``policy`` with budget 16: the
    model, the cache, and the second turn's input (the conversation so far and 9 new tokens)."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend(policy, budget=16, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be)
    cache = kvpass.SlotCache(model, be, max_length=64)
    out = model.generate(PROMPT, past_key_values=cache, max_new_tokens=8, do_sample=False)
    return model, cache, torch.cat([out, torch.randint(10, 90, (1, 9))], 1)


def test_continuing_h2o_on_a_slot_cache_names_the_missing_append_graph():
    """h2o has no append graph on a SlotCache: a second turn (several new tokens) after it evicted is refused when
    its graph compiles, naming that case (it used to say "run it through the backend that filled it", though it
    was)."""
    model, cache, more = first_turn_on_a_slot_cache("h2o")
    with pytest.raises(RuntimeError, match=r"cannot run on a kvpass.SlotCache.*'append' graph appends several tokens"):
        model.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False)


def test_continuing_on_a_slot_cache_counts_tokens_seen():
    """The same chat on a kvpass.SlotCache: get_seq_length is the tokens seen, so the second turn feeds
    exactly the new tokens (47 + 9 + 4 = 60 seen)."""
    model, cache, more = first_turn_on_a_slot_cache("streamingllm")
    model.generate(more, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.seen == 40 + 7 + 9 + 4 - 1 + 1  # generate's last token is never fed back


@pytest.mark.parametrize(
    "policy,params,layers,seen",
    [
        ("snapkv", dict(budget=16, window=4), 2, 40 + 7 + 7),
        ("gemfilter", dict(budget=10, layer=1), 4, 10 + 7 + 7),
        ("gemfilter", dict(budget=10, layer=1), 2, 40 + 7 + 7),  # no selection layer: unchanged, no SlotCache
    ],
)
def test_bare_forward_after_generate_continues_at_the_tokens_seen(policy, params, layers, seen):
    """generate (position ids passed in; snapkv's and gemfilter's decode graphs only append, so no layer
    records), then a bare forward of only the new tokens on the same DynamicCache: its derived positions
    must move to the tokens seen *after* the appended ones. The offset was taken from the layers' last
    record (the prefill's count), so the turn sat 7 positions early (gemfilter: 5); and when no layer had
    recorded at all (gemfilter's layer is the last, so its gate never fires) the turn was put at position 0.
    Equal to the same turn on a kvpass.SlotCache, which counts tokens on the device. (The state counts
    gemfilter's renumbered tokens.) Where gemfilter's layer is past the model, kvpass leaves the graph unchanged,
    and a SlotCache (only kvpass's attention reads its slots) refuses the policy as it is built."""
    from test_asl import build as build_layers

    turn = torch.randint(10, 90, (1, 6), generator=torch.Generator().manual_seed(3))
    got = []
    for kind in ("dynamic", "slot"):
        torch._dynamo.reset()
        model = build_layers("llama", layers)
        be = kvpass.backend(policy, compiler="eager", **params)
        model.forward = torch.compile(model.forward, backend=be)
        if kind == "slot" and layers <= params.get("layer", 0) + 1:
            with pytest.raises(kvpass.ConfigError, match="'layer' = 1 is not a selection layer of this 2-layer"):
                kvpass.SlotCache(model, be, max_length=64)
            return
        cache = DynamicCache(config=model.config) if kind == "dynamic" else kvpass.SlotCache(model, be, max_length=64)
        seq = model.generate(PROMPT, past_key_values=cache, max_new_tokens=8, do_sample=False)
        with torch.no_grad():
            got.append(model(input_ids=torch.cat([seq[:, -1:], turn], 1), past_key_values=cache, use_cache=True).logits)
        assert be.state.seen == seen or kind == "slot"
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)


# 2. Dynamo's recompile limit ---------------------------------------------------------------------------


def test_decode_past_the_recompile_limit_fails_instead_of_running_uncompiled():
    """Past the limit Dynamo runs the frame uncompiled: a decode step after a kvpass prefill would run
    outside the policy on the cache it evicted. A kvpass backend makes that a hard error (it refuses the graph
    that would fill the limit: here 2, the prefill compiles and the decode step is refused)."""
    torch._dynamo.reset()
    model = build("llama")
    with torch._dynamo.config.patch(recompile_limit=2):
        be = kvpass.backend("streamingllm", budget=16, compiler="eager")
        fwd = torch.compile(model.forward, backend=be)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            logits = fwd(input_ids=PROMPT, past_key_values=cache, use_cache=True).logits[:, -1]
            with pytest.raises(Exception, match="recompile_limit"):
                fwd(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
    torch._dynamo.reset()


# 3. encoder-decoder cross-attention --------------------------------------------------------------------


def test_cross_attention_is_refused_not_evicted():
    """T5: the cross-attention cache holds the encoder's states; it was evicted from 24 to 16 entries.
    Cross-attention is found by structure (keys projected from other states than the queries) and the
    graph is left unchanged, with a warning; the output equals the uncompiled model's."""
    torch._dynamo.reset()
    cfg = tf.T5Config(
        vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    be = kvpass.backend("streamingllm", budget=16, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be)
    out, said = kvpass_warnings(
        lambda: model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    )
    # (transformers < 5.17 adds T5's position bias to the scores in a form detection refuses earlier, as
    # unrecognized attention: also loud, also unchanged)
    assert any("cross-attention" in w or "cannot be applied to this model's attention" in w for w in said), said
    assert torch.equal(out.sequences, want)
    cross = out.past_key_values.cross_attention_cache
    assert all(cross.layers[i].keys.shape[-2] == 24 for i in range(2))
    assert be.state.seen == 0


# 4. absolute positions ---------------------------------------------------------------------------------

ABSOLUTE = {  # every decoder-only family transformers ships whose positions are absolute (a table or sinusoids)
    "gpt2": lambda a: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, **a)),
    "gpt_bigcode": lambda a: tf.GPTBigCodeForCausalLM(
        tf.GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=100, **a)
    ),
    # OPT and BioGPT derive positions from the mask and look them up at +2 (the first two rows are unused)
    "opt": lambda a: tf.OPTForCausalLM(
        tf.OPTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            vocab_size=100,
            word_embed_proj_dim=64,
            **a,
        )
    ),
    "biogpt": lambda a: tf.BioGptForCausalLM(
        tf.BioGptConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=100, **a
        )
    ),
    # decoders of encoder-decoder families as causal LMs: BART's table from 2, Pegasus's sinusoids
    "bart": lambda a: tf.BartForCausalLM(
        tf.BartConfig(
            decoder_layers=2,
            d_model=64,
            decoder_ffn_dim=128,
            vocab_size=100,
            decoder_attention_heads=4,
            is_decoder=True,
            **a,
        )
    ),
    "pegasus": lambda a: tf.PegasusForCausalLM(
        tf.PegasusConfig(
            decoder_layers=2,
            d_model=64,
            decoder_ffn_dim=128,
            decoder_attention_heads=4,
            vocab_size=100,
            is_decoder=True,
            **a,
        )
    ),
    # CTRL indexes a sinusoid buffer; a Dynamo graph break (its buffer assignment) computes the ids outside
    "ctrl": lambda a: tf.CTRLLMHeadModel(tf.CTRLConfig(n_layer=2, n_embd=64, n_head=4, dff=128, vocab_size=100, **a)),
    # BERT-style decoders (RemBERT's attention is eager only, and recognised) read their own position_ids buffer at the
    # cache's length, and build token type ids (zeros; RoCBert picks them from a buffer at those positions) that are
    # looked up like positions but are not
    "rembert": lambda a: tf.RemBertForCausalLM(
        tf.RemBertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            vocab_size=100,
            is_decoder=True,
            input_embedding_size=64,
            output_embedding_size=64,
            **{**a, "attn_implementation": "eager"},
        )
    ),
    "roc_bert": lambda a: tf.RoCBertForCausalLM(
        tf.RoCBertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            vocab_size=100,
            is_decoder=True,
            shape_vocab_size=8,
            pronunciation_vocab_size=8,
            bos_token_id=1,
            eos_token_id=2,
            **a,
        )
    ),
    # eager attention only: kvpass does not recognise it, warns and compiles unchanged
    "gpt_neo": lambda a: tf.GPTNeoForCausalLM(
        tf.GPTNeoConfig(
            num_layers=2, attention_types=[[["global"], 2]], hidden_size=64, num_heads=4, vocab_size=100, **a
        )
    ),
    "xglm": lambda a: tf.XGLMForCausalLM(
        tf.XGLMConfig(num_layers=2, d_model=64, ffn_dim=128, attention_heads=4, vocab_size=100, **a)
    ),
}


@pytest.mark.parametrize("family", ABSOLUTE)
def test_absolute_positions_are_true_after_eviction_or_refused(family):
    """After streamingllm evicts, a bare forward whose positions the model derives (from the stored length)
    equals one given the true positions: GPT-2 and GPTBigCode look them up from 0, OPT and BioGPT from 2 (the
    operator learns the first position in the prefill; a fixed offset of 0 moved them by 2). CTRL derives
    them in a graph without attention on transformers 5.2x (a graph break), so kvpass sees them as passed in:
    refused at the first step behind the tokens seen (5.14 traces them in one graph: exact). Eager-only
    families compile unchanged, with a warning."""
    eager = family in ("gpt_neo", "xglm")
    torch.manual_seed(0)
    model = ABSOLUTE[family](dict(attn_implementation="eager" if eager else "sdpa")).eval()
    runs = []
    for positions in (True, False):
        torch._dynamo.reset()
        be = kvpass.backend("streamingllm", budget=16, compiler="eager")
        fwd = torch.compile(model.forward, backend=be)
        try:
            out, said = kvpass_warnings(lambda: greedy(fwd, model, PROMPT, 6, positions=positions))
        except ValueError as e:  # CTRL on transformers 5.2x: a graph break computes its positions outside
            assert family == "ctrl" and not positions, e
            assert "this step's position is 16: positions were counted from the entries stored" in str(e)
            return
        runs.append(out)
        if eager:
            assert be.state.seen == 0 and said, said
            torch.testing.assert_close(out, greedy(model.forward, model, PROMPT, 6), atol=1e-5, rtol=1e-5)
            return
        assert be.state.seen == 46 and max(be.state.stored_tokens().values()) == 16
        assert positions or any(r.positions_fixed for r in be.reports)  # derived ids are fixed
    torch.testing.assert_close(runs[1], runs[0], atol=1e-5, rtol=1e-5)


# 5. ALiBi / 6. attention kvpass does not recognise ------------------------------------------------------


def falcon(attn: str, alibi: bool = True):
    torch.manual_seed(0)
    return tf.FalconForCausalLM(
        tf.FalconConfig(
            alibi=alibi,
            new_decoder_architecture=False,
            multi_query=False,
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            vocab_size=100,
            attn_implementation=attn,
        )
    ).eval()


@pytest.mark.parametrize(
    "policy,params", [("streamingllm", dict(budget=1000)), ("snapkv", dict(budget=1000)), ("raas", dict(budget=1024))]
)
def test_alibi_mask_bias_is_refused(policy, params):
    """Falcon with ALiBi (SDPA): the bias rides in the float mask, which an evicting policy replaces by
    position masks; a no-op budget gave decode logits off by up to 12. Refused by the mask's structure
    (float arithmetic, not constants chosen by booleans): warned, unchanged, equal to the model."""
    model = falcon("sdpa")
    want = greedy(model.forward, model, PROMPT, 4)
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="eager", **params)
    got, said = kvpass_warnings(lambda: greedy(torch.compile(model.forward, backend=be), model, PROMPT, 4))
    assert any("bias" in w for w in said), said
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_plain_mask_built_from_a_constant_tensor_is_not_a_bias():
    """transformers 5.17's eager masks select ``torch.tensor(min_dtype)`` by a boolean: a constant, so a
    policy still applies (the first version of the bias check refused qwen3 eager there)."""
    from torch import fx

    from kvpass.compiler.detect import mask_bias

    g = fx.Graph()
    allowed = g.placeholder("allowed")
    allowed.meta["example_value"] = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    low = g.call_function(torch.tensor, (-1e9,))
    low.meta["example_value"] = torch.tensor(-1e9)
    zero = g.call_function(torch.tensor, (0.0,))
    zero.meta["example_value"] = torch.tensor(0.0)
    mask = g.call_function(torch.where, (allowed, zero, low))
    mask.meta["example_value"] = torch.zeros(1, 1, 4, 4)
    assert mask_bias(mask) is None
    biased = g.call_function(torch.add, (mask, zero))
    biased.meta["example_value"] = torch.zeros(1, 1, 4, 4)
    assert "bias" in mask_bias(biased)


def test_alibi_full_is_exact():
    model = falcon("sdpa")
    want = greedy(model.forward, model, PROMPT, 4)
    torch._dynamo.reset()
    got = greedy(torch.compile(model.forward, backend=kvpass.backend("full", compiler="eager")), model, PROMPT, 4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_unrecognized_attention_warns(family):
    """Bloom eager and Falcon-ALiBi eager: no attention site was found, so the policy was silently never
    applied. A softmax whose probabilities weigh values now says it is attention kvpass cannot read."""
    if family == "bloom":
        torch.manual_seed(0)
        model = tf.BloomForCausalLM(
            tf.BloomConfig(n_layer=2, hidden_size=64, n_head=4, vocab_size=100, attn_implementation="eager")
        ).eval()
    else:
        model = falcon("eager")
    torch._dynamo.reset()
    be = kvpass.backend("streamingllm", budget=8, compiler="eager")
    _, said = kvpass_warnings(lambda: greedy(torch.compile(model.forward, backend=be), model, PROMPT, 1))
    # transformers 5.25's Falcon attention is recognized, and then refused for the ALiBi bias in its mask
    assert any("does not recognize" in w or family == "falcon" and "additive bias (ALiBi)" in w for w in said), said
    assert be.state.seen == 0


# 7. art's prefill (the GPU case: 49 GiB and 7x full's TTFT at 128k) -----------------------------------------


def test_art_prefill_reads_attention_like_full():
    """art left its prefill to the model's SDPA, which read a materialised causal mask (at 128k: 49 GiB
    against full's 21 GiB). Its prefill now takes full's plan: the kvpass attention op, whose proven-causal
    mask becomes the causal mode (no mask tensor read)."""
    plans, masks = {}, {}
    for policy in ("full", "art"):
        torch._dynamo.reset()
        model = build("llama", "eager")  # eager attention: transformers materialises the mask
        be = kvpass.backend(policy, compiler="eager")
        inner, seen = be._inner, []

        def spy(gm, ex, *rest, inner=inner, seen=seen):
            seen.extend(n.args[3] for n in gm.graph.nodes if n.target is torch.ops.kvpass.attention.default)
            return inner(gm, ex, *rest)

        be._inner = spy
        be.kvpass.compile_segment = spy
        greedy(torch.compile(model.forward, backend=be, dynamic=True), model, PROMPT, 0)
        plans[policy], masks[policy] = be.plans()["prefill"], seen
    assert plans["art"] == plans["full"]
    assert masks["art"] and all(m is None for m in masks["art"])


# 8. raas continuation ----------------------------------------------------------------------------------


def test_raas_continuation_is_refused():
    """raas's preallocated pool is longer than the sequence, so transformers passed zero new tokens and
    Dynamo failed inside a view; now the continuation is refused by name (on a SlotCache too)."""
    torch._dynamo.reset()
    model = build("llama")
    model.forward = torch.compile(model.forward, backend=kvpass.backend("raas", budget=32, compiler="eager"))
    out = model.generate(PROMPT, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, torch.randint(10, 90, (1, 5))], 1)
    with pytest.raises(Exception, match="continuing a raas generation is not supported"):
        model.generate(more, past_key_values=out.past_key_values, max_new_tokens=2, do_sample=False)


# 9. the state after generate ------------------------------------------------------------------------------


def test_state_counts_tokens_appended_with_passed_positions():
    """generate passes position ids, so the appending decode graphs (snapkv: the model's own cache update)
    told the state nothing: it said seen 40, stored 16 while the cache held 23 entries of 47 tokens."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend("snapkv", budget=16, window=4, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be)
    out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    stored = out.past_key_values.layers[0].keys.shape[-2]
    assert be.state.seen == 47 and set(be.state.stored_tokens().values()) == {stored} and stored == 23


# 10. parameters that make a policy idle, named ---------------------------------------------------------


def test_quest_dense_layers_covering_the_model_warns():
    torch._dynamo.reset()
    model = build("llama")  # 2 layers: the default dense_layers=2 leaves quest nothing to skip
    be = kvpass.backend("quest", budget=16, compiler="eager")
    _, said = kvpass_warnings(lambda: greedy(torch.compile(model.forward, backend=be), model, PROMPT, 1))
    assert any("'dense_layers'" in w for w in said), said


def test_gate_layer_out_of_range_names_the_parameter():
    """The plain backend meets the model at its first compile (warned, the graph unchanged); ``kvpass.compile``
    knows it before anything compiles and refuses."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend("fastkv", budget=36, layer=999, compiler="eager")
    _, said = kvpass_warnings(lambda: greedy(torch.compile(model.forward, backend=be), model, PROMPT, 1))
    assert any("parameter 'layer' = 999" in w and "allowed: 0 to 0" in w for w in said), said
    for policy in ("fastkv", "asl", "gemfilter"):
        with pytest.raises(kvpass.ConfigError, match=rf"'{policy}': parameter 'layer' = 1 .* 2-layer .* 0 to 0"):
            kvpass.compile(build("llama"), policy, budget=36, layer=1, compiler="eager")


# 12. one warning per compiled function -------------------------------------------------------------------


def test_each_backend_warns_once():
    """Two models with the same problem, each compiled with its own backend: both are told (the warning
    was once per process), each once."""
    said = []
    for _ in range(2):
        torch._dynamo.reset()
        model = falcon("eager")
        be = kvpass.backend("streamingllm", budget=8, compiler="eager")
        fwd = torch.compile(model.forward, backend=be)
        said.append(kvpass_warnings(lambda: greedy(fwd, model, PROMPT, 2))[1])
    assert all(len([w for w in s if "compiling a graph unchanged" in w]) == 1 for s in said), said


# 8. every way of calling the compiler the docs show ----------------------------------------------


def test_torch_compile_of_the_module_warns_that_generate_is_not_compiled():
    """``torch.compile(model, backend=be)`` compiles calls of the module it returns; ``.generate()`` runs the
    uncompiled forward (torch's rule: 27 entries kept under budget 8, no kvpass graph). kvpass warns when
    torch.compile is given such a model; the forms that apply the policy to generate do not warn."""
    model = build("llama")
    be = kvpass.backend("streamingllm", budget=8, compiler="eager")
    _, said = kvpass_warnings(lambda: torch.compile(model, backend=be))
    assert any("not to .generate()" in w and "kvpass.compile(model, 'streamingllm')" in w for w in said), said
    for form in (lambda: model.compile(backend=be), lambda: torch.compile(model.forward, backend=be)):
        _, said = kvpass_warnings(form)
        assert not any(".generate()" in w for w in said), said


def test_compile_config_on_a_slot_cache_is_refused():
    """``generate(compile_config=CompileConfig(backend=be))`` compiles decode steps only (transformers' rule),
    so the prefill would write every token into the policy's cache: the SlotCache refuses, naming the fix.
    (On the default cache transformers skips compiling and says so; kvpass is never called there.)"""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend("streamingllm", budget=8, compiler="eager")
    with pytest.raises(RuntimeError, match=r"did not rewrite wrote into the cache .* kvpass.compile\(model"):
        model.generate(
            PROMPT,
            max_new_tokens=3,
            do_sample=False,
            past_key_values=kvpass.SlotCache(model, be, 64),
            compile_config=tf.CompileConfig(backend=be, fullgraph=False),
        )


def test_output_attentions_on_a_slot_cache_names_the_graph_break():
    """``output_attentions=True`` under SDPA makes transformers 5.2x capture attentions outside the graph, so
    the forward breaks between the attention and the cache write: the SlotCache refuses and says so."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend("streamingllm", budget=8, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be)
    with pytest.raises(RuntimeError, match="output_attentions=True does"):
        model.generate(
            PROMPT,
            max_new_tokens=3,
            do_sample=False,
            past_key_values=kvpass.SlotCache(model, be, 64),
            output_attentions=True,
            return_dict_in_generate=True,
        )
