"""Reach: ordinary sequences of calls on one compiled model, families the other tests do not name, and what a user
sees at Dynamo's recompile limit.

* one ``kvpass.compile``d model through 100 varied ``generate`` calls (batch 1-16, padded and not, prompts of
  1-300 tokens, greedy and sampled, logits processors, ``return_dict_in_generate``, ``num_return_sequences``,
  ``inputs_embeds``): every output equals the uncompiled model's, and the graphs stay few (the batch is a
  symbolic dimension; Dynamo specializes a batch of one);
* models of one class compiled one after another do not share a recompile budget (``fastpath.own_code``);
* a mixture-of-experts layer's routing order is not mistaken for token positions (it was "corrected" as an
  absolute position lookup and indexed out of bounds);
* the recompile limit, on the plain ``torch.compile`` path too, is an error that names kvpass, Dynamo's reason
  and how to raise the limit;
* kvpass's own calls raise no deprecation warning of transformers.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import transformers as tf

import kvpass
from families import COMMON, build


def _equal(got, expected) -> bool:
    got = got.sequences if hasattr(got, "sequences") else got
    expected = expected.sequences if hasattr(expected, "sequences") else expected
    return torch.equal(got, expected)


def _ordinary_calls(n: int, seed: int = 0) -> list[dict]:
    """``n`` generate calls as a service sees them: varied batch, padding, length and options."""
    rnd = random.Random(seed)
    calls = []
    for i in range(n):
        rows = rnd.choice([1, 1, 2, 3, 4, 5, 8, 16])
        length = rnd.choice([1, 2, 5, 17, 40, 64, 120, 300])
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(3, 90, (rows, length), generator=g)
        kw: dict = dict(max_new_tokens=rnd.choice([1, 3, 6]), pad_token_id=0)
        if rows > 1 and length > 2 and rnd.random() < 0.3:  # left padding, with its mask
            mask = torch.ones_like(ids)
            pad = torch.randint(0, length - 1, (rows,), generator=g)
            for r, p in enumerate(pad.tolist()):
                ids[r, :p], mask[r, :p] = 0, 0
            kw["attention_mask"] = mask
        option = rnd.choice(["greedy", "sample", "penalty", "scores", "returns", "embeds", "min_new", "mask"])
        if option == "sample":
            kw.update(do_sample=True, top_k=rnd.choice([None, 5]), temperature=rnd.choice([0.7, 1.0]))
        elif option == "penalty":
            kw.update(repetition_penalty=1.3)
        elif option == "scores":
            kw.update(return_dict_in_generate=True, output_scores=True)
        elif option == "returns" and rows <= 4:
            kw.update(num_return_sequences=rnd.choice([2, 3]), do_sample=True)
        elif option == "min_new":
            kw.update(min_new_tokens=kw["max_new_tokens"])
        elif option == "mask" and "attention_mask" not in kw:
            kw["attention_mask"] = torch.ones_like(ids)
        if option == "embeds" and "attention_mask" not in kw:
            kw["embeds"] = True
        kw["input_ids"] = ids
        calls.append(kw)
    return calls


def _run(model, kw: dict, seed: int):
    kw = dict(kw)
    if kw.pop("embeds", False):
        kw["inputs_embeds"] = model.get_input_embeddings()(kw.pop("input_ids"))
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(**kw)


def test_a_hundred_ordinary_calls_compile_a_few_graphs_and_equal_the_uncompiled_model():
    """100 calls on one compiled model: the uncompiled tokens every time, no recompile-limit error, one decode
    graph per batch kind (one row, which Dynamo specializes; two or more) and one prefill graph per batch kind
    and kind of prompt (tokens; left-padded tokens, which read a mask the unpadded prefill does not build;
    embeddings; a single token). Before, every batch size compiled both graphs again and the tenth call failed."""
    torch._dynamo.reset()
    model, ref = (build("llama", max_position_embeddings=512) for _ in range(2))
    be = kvpass.compile(model, "full", compiler="eager")
    for i, kw in enumerate(_ordinary_calls(100)):
        got, expected = _run(model, kw, seed=i), _run(ref, kw, seed=i)
        assert _equal(got, expected), (i, {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)})
    counts = be.graph_counts()
    assert counts.get("decode", 0) <= 2, counts
    # per batch kind (one row; two or more) and kind of prompt (tokens, left-padded tokens, embeddings, a single
    # token): these calls reach 9; a new prompt length or batch size adds none
    assert counts.get("prefill", 0) <= 9, counts
    torch._dynamo.reset()


def test_an_evicting_policy_keeps_its_graphs_across_batch_sizes():
    """snapkv at a no-op budget through batches of 2, 3, 5 and 8 rows after one of 1: two decode graphs (the
    batch of one and the symbolic one), the uncompiled tokens."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    be = kvpass.compile(model, "snapkv", compiler="eager", budget=1000, window=4)
    for rows in (1, 2, 3, 5, 8):
        ids = torch.randint(3, 90, (rows, 30), generator=torch.Generator().manual_seed(rows))
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw)), rows
    assert be.graph_counts() == {"prefill": 2, "decode": 2}, be.plans()
    torch._dynamo.reset()


def test_models_of_one_class_compiled_in_turn_do_not_share_a_recompile_budget(monkeypatch):
    """Three Llamas, each ``kvpass.compile``d and called with batch 1 and 2 (four graphs and the entries of their
    guards each), under Dynamo's default limit of 8: before each compiled forward had a code object of its own,
    the third model's graphs reached it."""
    from kvpass.generate import fastpath

    torch._dynamo.reset()
    monkeypatch.setattr(fastpath, "RECOMPILE_LIMIT", 8)  # a kvpass constant (torch's settings: config.patch)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=8):
        for seed in range(3):
            model = build("llama", seed=seed)
            kvpass.compile(model, "full", compiler="eager")
            model.generate(ids[:1], max_new_tokens=2, do_sample=False)
            model.generate(ids, max_new_tokens=2, do_sample=False)
    torch._dynamo.reset()


def test_the_recompile_limit_on_the_plain_path_names_kvpass_the_reason_and_the_fix():
    """``torch.compile(model.forward, backend=kvpass.backend(...))``: the graph that would fill Dynamo's
    recompile limit is refused with kvpass's error, which carries Dynamo's reason and how to raise the limit
    (before: torch's bare "Hard failure due to fail_on_recompile_limit_hit")."""
    torch._dynamo.reset()
    model = build("llama")
    model.forward = torch.compile(model.forward, backend=kvpass.backend("full", compiler="eager"), dynamic=True)
    with torch._dynamo.config.patch(recompile_limit=3):
        model.generate(torch.randint(3, 90, (1, 12)), max_new_tokens=2, do_sample=False)  # prefill, decode
        with pytest.raises(Exception) as info:
            model.generate(torch.randint(3, 90, (2, 12)), max_new_tokens=2, do_sample=False)
    text = str(info.value)
    assert "kvpass: the model's forward reached Dynamo's recompile_limit" in text, text
    assert "Dynamo recompiled because:" in text and "input_ids" in text, text
    assert "torch._dynamo.config.recompile_limit = 64" in text and "pass dynamic=True" in text, text
    torch._dynamo.reset()


def _moe(kind: str):
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **{**COMMON, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        )
        return tf.Qwen3MoeForCausalLM, cfg
    cfg = tf.MixtralConfig(**{**COMMON, "num_local_experts": 4, "num_experts_per_tok": 2})
    return tf.MixtralForCausalLM, cfg


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("policy", ["streamingllm", "snapkv"])
def test_a_mixture_of_experts_routing_order_is_not_taken_for_positions(kind, policy):
    """The experts' token order (``topk`` of the router's scores, then an index into the routing weights)
    looks like a position lookup in a float table; it was routed through ``true_positions`` and the decode step
    indexed out of bounds. At a budget that evicts nothing the tokens equal the uncompiled model's, and no
    position is "fixed" in the prefill (the model passes none it derived from a table)."""
    torch._dynamo.reset()
    cls, cfg = _moe(kind)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    be = kvpass.backend(policy, budget=1000, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)
    assert all(not r.problems for r in be.reports), be.plans()
    assert all(r.evicting for r in be.reports if r.phase == "prefill"), be.plans()
    torch._dynamo.reset()


def test_a_chunked_attention_mask_is_not_rebuilt_as_a_sliding_window():
    """Llama 4's local layers attend within chunks of ``attention_chunk_size`` tokens (their mask floor-divides
    positions), and their cache is a ring of that size. A gated prefill (fastkv) evicts on every layer and
    masks by position after it: a chunked layer was masked as a sliding window, wrong from the first decode
    step at a budget that evicts nothing. Refused by the mask's structure, named, equal to the model."""
    torch._dynamo.reset()
    cfg = tf.Llama4TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        attention_chunk_size=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    ids = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    be = kvpass.backend("fastkv", budget=1000, layer=0, compiler="eager")
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    with pytest.warns(kvpass.KVPassWarning, match="groups positions into chunks"):
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected)
    torch._dynamo.reset()


class _Deprecations(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record):
        if "deprecated" in record.getMessage():
            self.seen.append(record.getMessage())


def test_kvpass_calls_raise_no_transformers_deprecation():
    """transformers >= 5.24 renames the cache argument (``past_key_values`` -> ``cache``) and warns once per
    process where the old name is used; kvpass's own calls and reads use the model's current name."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "snapkv", compiler="eager", budget=8, window=4)
    seen = _Deprecations()
    logger = logging.getLogger("transformers")
    logger.addHandler(seen)
    from transformers.utils.logging import warning_once

    warning_once.cache_clear()  # else said once per process, perhaps before this test
    try:
        ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(0))
        model.generate(ids, max_new_tokens=3, do_sample=False)
        model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True)
        model.generate([ids[0], ids[1, :7]], max_new_tokens=3, do_sample=False)
    finally:
        logger.removeHandler(seen)
    assert not seen.seen, seen.seen
    torch._dynamo.reset()


def test_a_softmax_without_an_attention_site_is_said():
    """A graph whose only softmax kvpass cannot read as attention (here a softmax that weighs nothing: attention
    with sinks drops the sink column before the values, flex attention is an operator of its own) is a problem,
    so the graph is compiled unchanged with a warning instead of the policy silently never applying."""
    from kvpass.compiler import detect

    class Probe(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=-1)[..., :-1].sum(-1)

    found = detect.detect(torch.fx.symbolic_trace(Probe()))
    assert not found.sites and found.problems, found
    assert "no attention site in a form kvpass recognizes" in str(found.problems[0])

    class Plain(torch.nn.Module):  # no softmax, no attention: nothing to say
        def forward(self, x):
            return x.relu() * 2

    assert not detect.detect(torch.fx.symbolic_trace(Plain())).problems


def test_a_latent_attention_on_the_slot_cache_is_refused_by_name_and_exact_on_its_own_cache():
    """DeepSeek-V3's attention does not store keys and values of the config's ``head_dim`` (its latent, or keys of
    ``qk_nope_head_dim + qk_rope_head_dim``): the SlotCache sized from the config failed deep in an index_put. It now
    says what the attention writes and what the cache holds, and the model's own cache gives the uncompiled tokens."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    cfg = tf.DeepseekV3Config(
        **{
            **COMMON,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "head_dim": 8,
            "first_k_dense_replace": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        }
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    kvpass.compile(model, "full", compiler="eager")
    # (what it writes moves between transformers versions: 5.25 caches the latent itself, one head)
    with pytest.raises(
        Exception,
        match=r"kvpass SlotCache: the model's attention writes \d+ KV heads per layer of "
        r"key size \d+ and value size \d+; the cache was sized for 4 of 8 and 8",
    ):
        model.generate(ids, max_new_tokens=4, do_sample=False)
    got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=cfg))
    assert torch.equal(got, expected)
    torch._dynamo.reset()


def test_a_model_without_attention_is_told_the_policy_does_nothing():
    """A state-space model (Mamba) has no attention for a policy to act on: compiled through kvpass it gives the
    uncompiled tokens and one warning that the policy does nothing (it was silent: "unapplied")."""
    torch._dynamo.reset()
    cfg = tf.MambaConfig(
        vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    model = tf.MambaForCausalLM(cfg).eval()
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=2, do_sample=False)
    model.forward = torch.compile(
        model.forward, backend=kvpass.backend("snapkv", budget=8, window=4, compiler="eager"), dynamic=True
    )
    with pytest.warns(kvpass.KVPassWarning, match="has no attention site: policy 'snapkv' does nothing in it"):
        got = model.generate(ids, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, expected)
    torch._dynamo.reset()
