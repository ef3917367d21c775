"""``kvpass.compile``'s ``generate`` under options a user passes, found by probing as a user (2026-11-28): each
gave wrong tokens without a word, or an error that blamed the wrong thing.

* a cache returned in the output (``return_dict_in_generate``) is the caller's: the next call no longer resets
  and refills it under them (continuing the first conversation gave other tokens);
* continuing a returned cache past its size names the size and the way on; continuing it with a hole in the
  attention mask (a pad token inside the text) is refused: the SlotCache reads its slots without the mask;
* a ``cache_implementation`` in the model's own generation config (hub models ship one) no longer makes every
  call fail in transformers: kvpass's SlotCache replaces that default;
* chunked prefill with a policy that keeps part of the prompt is refused up front (the cache overflowed);
* an assistant model given ``kvpass.compile`` is refused by name when transformers crops its SlotCache;
* a forward without a cache no longer makes the sliding layers unknown to later prefills (gemma2).
"""

from __future__ import annotations

import re

import pytest
import torch

import kvpass
from families import build


def ids_of(n: int, b: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 90, (b, n), generator=torch.Generator().manual_seed(n + 1000 * seed))


def test_a_returned_cache_is_the_callers():
    """Two calls with ``return_dict_in_generate``: the first output's cache stays as the first call left it, and
    continuing from it gives the uncompiled model's tokens (before: the second call had reset and refilled the
    same object, and the continuation differed with no error). A call that returns no cache still reuses the
    kept one."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    first = model.generate(ids_of(12), **kw)
    second = model.generate(ids_of(15), **kw)
    assert first.past_key_values is not second.past_key_values
    assert isinstance(first.past_key_values, kvpass.SlotCache) and first.past_key_values.seen == 15
    more = torch.cat([first.sequences, ids_of(3, seed=1)], 1)
    got = model.generate(more, past_key_values=first.past_key_values, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, ref.generate(more, max_new_tokens=3, do_sample=False))
    model.generate(ids_of(9), max_new_tokens=3, do_sample=False)
    (kept,) = model.generate.caches.values()
    model.generate(ids_of(10), max_new_tokens=3, do_sample=False)
    assert next(iter(model.generate.caches.values())) is kept
    torch._dynamo.reset()


def test_continuing_past_a_returned_cache_names_its_size_and_the_way_on():
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "full", compiler="eager")
    out = model.generate(ids_of(20), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    size = out.past_key_values.max_length
    more = torch.cat([out.sequences, ids_of(size - 20, seed=2)], 1)
    with pytest.raises(kvpass.ConfigError, match=rf"built for {size} tokens.*without the cache"):
        model.generate(more, past_key_values=out.past_key_values, max_new_tokens=4, do_sample=False)
    torch._dynamo.reset()


@pytest.mark.parametrize("shipped", ["static", "dynamic"])
def test_a_cache_implementation_the_model_ships_gives_way_to_the_slot_cache(shipped):
    """A model whose generation config carries ``cache_implementation`` (as hub models ship it): every call
    failed in transformers ("Passing both cache_implementation ... and cache"). The SlotCache replaces the
    default, the tokens are the uncompiled model's, and the model's config is left as it was. A caller's own
    ``cache_implementation`` still runs transformers' cache."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    model.generation_config.cache_implementation = shipped
    ids = ids_of(14)
    got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=5, do_sample=False))
    assert model.generate.caches and model.generation_config.cache_implementation == shipped
    model.generation_config.cache_implementation = None
    got = model.generate(
        ids, max_new_tokens=5, do_sample=False, cache_implementation="dynamic", return_dict_in_generate=True
    )
    assert not isinstance(got.past_key_values, kvpass.SlotCache)
    torch._dynamo.reset()


def test_chunked_prefill_is_refused_where_the_policy_keeps_part_of_the_prompt():
    """``prefill_chunk_size`` with snapkv: the first chunk was taken as the prompt and the later ones overflowed
    the cache ("the cache is full"). Refused up front, naming the option; ``full`` keeps every token and runs
    chunked, with the uncompiled model's tokens."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "snapkv", compiler="eager", budget=32, window=8)
    with pytest.raises(kvpass.ConfigError, match=r"prefill_chunk_size=16.*'snapkv' keeps only part"):
        model.generate(ids_of(60), max_new_tokens=4, do_sample=False, prefill_chunk_size=16)
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(60)
    assert torch.equal(
        model.generate(ids, max_new_tokens=4, do_sample=False, prefill_chunk_size=16),
        ref.generate(ids, max_new_tokens=4, do_sample=False),
    )
    torch._dynamo.reset()


def test_an_assistant_given_kvpass_compile_is_refused_by_name():
    """Assisted decoding crops the assistant's cache to drop rejected drafts; an assistant compiled with
    ``kvpass.compile`` decodes on a SlotCache, which failed inside transformers ("'SlotLayer' object has no
    attribute 'crop'"). The SlotCache now refuses the crop and says what to give the assistant."""
    torch._dynamo.reset()
    model, assistant = build("llama"), build("llama", seed=1)  # other weights: its drafts get rejected
    kvpass.compile(assistant, "full", compiler="eager")
    ids = ids_of(16)
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=assistant)
    except kvpass.ConfigError as e:  # transformers 5.2x: the assistant's generate runs on its SlotCache
        assert re.search("cannot crop.*give the assistant an uncompiled model", str(e)), e
    else:  # transformers 5.14 gives the assistant a cache of its own: the fast path is not taken
        assert not assistant.generate.caches
        assert torch.equal(got, model.generate(ids, max_new_tokens=8, do_sample=False))
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_continuing_with_a_hole_in_the_mask_is_refused(family):
    """Continuing a returned SlotCache with a 0 inside the attention mask, passed or inferred by transformers from a
    pad token in the ids: the appended tokens read the slots by position, without the mask, and gave other tokens
    than transformers' continuation, silently (gemma3's sliding layers, qwen3, cohere2; on llama the logits moved
    by 0.17). Refused; a continuation whose mask has no hole gives the uncompiled model's tokens."""
    torch._dynamo.reset()
    model, ref = build(family), build(family)
    kvpass.compile(model, "full", compiler="eager")
    out = model.generate(ids_of(12), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([out.sequences, ids_of(6, seed=5)], 1)
    holed = torch.ones_like(more)
    holed[0, 19] = 0
    with pytest.raises(kvpass.ConfigError, match="a 0 after a row's first token"):
        model.generate(
            more, attention_mask=holed, past_key_values=out.past_key_values, max_new_tokens=4, do_sample=False
        )
    padded = more.clone()
    padded[0, 19] = 0  # the pad id: transformers infers the hole
    with pytest.raises(kvpass.ConfigError, match="a 0 after a row's first token"):
        model.generate(padded, past_key_values=out.past_key_values, max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = model.generate(
        more,
        attention_mask=torch.ones_like(more),
        past_key_values=out.past_key_values,
        max_new_tokens=4,
        do_sample=False,
    )
    assert torch.equal(got, ref.generate(more, attention_mask=torch.ones_like(more), max_new_tokens=4, do_sample=False))
    torch._dynamo.reset()


def test_a_forward_without_a_cache_leaves_the_sliding_layers_known():
    """gemma2 (sliding window 8): a ``use_cache=False`` forward between two ``generate`` calls compiled a graph whose
    sites knew no window, and it replaced what the cache's graphs had registered: every later prompt longer than the
    window was refused ("layer 0 keeps 9 entries ... the cache holds 8 slots"). Now the later calls give the
    uncompiled model's tokens."""
    torch._dynamo.reset()
    model, ref = build("gemma2", attn="eager"), build("gemma2", attn="eager")
    kvpass.compile(model, "full", compiler="eager")
    model.generate(ids_of(6), max_new_tokens=6, do_sample=False)
    model(ids_of(6), use_cache=False)
    for n in (9, 20):
        ids = ids_of(n, seed=3)
        assert torch.equal(
            model.generate(ids, max_new_tokens=6, do_sample=False), ref.generate(ids, max_new_tokens=6, do_sample=False)
        ), n
    torch._dynamo.reset()
