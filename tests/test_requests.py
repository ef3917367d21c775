"""``kvpass.RequestQueue`` and ``generate`` over a list of prompts: requests of different lengths
decoded in a batch of fewer rows than requests, each admitted into a row another one freed, give every request
the tokens ``generate`` gives it alone, for one policy of each mechanism (``conformance.one_per_mechanism``);
and the queue refuses what it does not run.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import kvpass
from conformance import CONFORMANCE, one_per_mechanism
from families import build

SLOT = one_per_mechanism([n for n, e in CONFORMANCE.items() if not e.driver])  # conformance.py
LENGTHS, NEWS = (20, 33, 27, 41, 25), (12, 5, 9, 7, 3)


def prompts() -> list[torch.Tensor]:
    return [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]


def alone(model, ids, new, **kw) -> torch.Tensor:
    return model.generate(ids[None], max_new_tokens=new, do_sample=False, **kw)[0]


@pytest.mark.parametrize("policy", SLOT)
def test_queue_gives_every_request_its_tokens_alone(policy):
    """Five requests through two rows: rows are refilled while the other decodes, an idle row decodes a copy at
    the end; each output equals ``generate`` on that prompt alone, and the batch compiles one decode graph."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, policy, compiler="eager", **CONFORMANCE[policy].demanding)
    want = [alone(model, p, n, min_new_tokens=n) for p, n in zip(prompts(), NEWS)]
    decode_graphs = be.graph_counts().get("decode", 0)
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for p, n in zip(prompts(), NEWS):
        queue.add(p, max_new_tokens=n)
    got = queue.run(progress=False)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [r.stopped for r in queue.requests] == ["length"] * 5
    assert queue.stats["new_tokens"] == sum(NEWS) and queue.stats["requests"] == 5
    assert be.graph_counts().get("decode", 0) <= decode_graphs + 1  # the 2-row step: one graph more at most
    assert all(not r.problems for r in be.reports), be.plans()


def test_a_request_stops_at_its_end_token_and_its_row_is_refilled():
    """The end-of-sequence token a request emits ends it (kept, as ``generate`` keeps it); its row takes the
    next request, which still gets its tokens alone. ``be.state`` is then the batch's cache, where the requests
    decoded (the one-row staging cache holds a prefill's budget and no decoded token)."""
    from kvpass.cache.slots import SlotCacheState

    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "snapkv", compiler="eager", budget=16, window=4)
    ps = prompts()
    free = alone(model, ps[0], 12, min_new_tokens=12)[20:].tolist()
    eos = free[3]  # request 0 emits it as its 4th new token
    cut = free[: free.index(eos) + 1]
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=eos)
    for p, n in zip(ps, NEWS):
        queue.add(p, max_new_tokens=n)
    got = queue.run(progress=False)
    state = be.state
    assert isinstance(state, SlotCacheState) and min(state.stored.values()) > 16, state
    assert state.stored_tokens() == state.stored
    assert got[0][20:].tolist() == cut and queue.requests[0].stopped == "eos"
    for p, n, g in zip(ps[1:], NEWS[1:], got[1:]):
        want = alone(model, p, n, eos_token_id=eos)
        assert g.tolist() == want[: len(g)].tolist() and (len(g) == len(want) or want[len(g)] == eos)


def test_idle_rows_are_no_requests_in_be_state():
    """One request through four rows: the three idle rows decode copies of it, emptied when the run ends, so
    ``be.state`` counts the request's tokens once (evicted_tokens grew with the rows before)."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "snapkv", compiler="eager", budget=16, window=4)
    counts = []
    for rows in (1, 4):
        queue = kvpass.RequestQueue(model, max_batch=rows, max_new_tokens=5, eos_token_id=None)
        queue.add(prompts()[0])
        queue.run(progress=False)
        counts.append(be.state.evicted_tokens)
    assert counts[0] == counts[1] > 0, counts


def test_generate_over_a_list_is_the_queue():
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "quest", compiler="eager", budget=16, dense_layers=0)
    ps = prompts()
    outs = model.generate(ps, max_new_tokens=6, max_batch=3, do_sample=False, eos_token_id=None)
    assert [o.tolist() for o in outs] == [alone(model, p, 6, min_new_tokens=6).tolist() for p in ps]
    sampled = model.generate(
        [p.tolist() for p in ps[:2]], max_new_tokens=4, do_sample=True, top_k=5, temperature=0.7, eos_token_id=None
    )
    assert [len(o) for o in sampled] == [LENGTHS[0] + 4, LENGTHS[1] + 4]
    config = transformers.GenerationConfig(max_new_tokens=3, do_sample=False)
    assert [len(o) for o in model.generate(ps[:2], generation_config=config, eos_token_id=None)] == [
        LENGTHS[0] + 3,
        LENGTHS[1] + 3,
    ]


def test_queue_refuses_what_it_does_not_run():
    torch._dynamo.reset()
    model = build("llama")
    with pytest.raises(kvpass.ConfigError, match="compiled with kvpass.compile"):
        kvpass.RequestQueue(model)
    kvpass.compile(model, "full", compiler="eager")
    with pytest.raises(kvpass.ConfigError, match="'max_batch' must be an int in 1..4096"):
        kvpass.RequestQueue(model, max_batch=0)
    with pytest.raises(kvpass.ConfigError, match=r"\['repetition_penalty'\] \(given, or from"):
        kvpass.RequestQueue(model, repetition_penalty=1.2)
    with pytest.raises(kvpass.ConfigError, match=r"\['streamer'\] are not run by the queue"):
        kvpass.RequestQueue(model, streamer=object())
    with pytest.raises(kvpass.ConfigError, match="takes no attention_mask"):
        model.generate(prompts(), attention_mask=torch.ones(5, 20))
    with pytest.raises(kvpass.ConfigError, match=r"max_batch=...\) batches a list of prompts"):
        model.generate(prompts()[0][None], max_batch=2)
    # generate over a list names itself, and the prompt, where the queue it builds refuses
    with pytest.raises(
        kvpass.ConfigError,
        match=r"^kvpass.compile: generate\(\) over a list of prompts \(a kvpass.RequestQueue\): .*max_batch",
    ):
        model.generate(prompts(), max_batch=0)
    with pytest.raises(
        kvpass.ConfigError,
        match=r"^kvpass.compile: generate\(\) over a list of prompts \(a kvpass.RequestQueue\), prompt 1: ",
    ):
        model.generate([[5, 6], [5, 6.5]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokenz") as typo:  # transformers' check, without kvpass's cache note
        model.generate(prompts()[0][None], max_new_tokens=2, max_new_tokenz=3)
    assert "SlotCache" not in "".join(getattr(typo.value, "__notes__", []))
    queue = kvpass.RequestQueue(model, max_length=30)
    with pytest.raises(kvpass.ConfigError, match="exceeds max_length=30"):
        queue.add(prompts()[1], max_new_tokens=5)
    with pytest.raises(kvpass.ConfigError, match="'ids' must be a non-empty 1-D"):
        queue.add(torch.zeros(2, 3, dtype=torch.long))
    model.generation_config.repetition_penalty = 1.3
    with pytest.raises(kvpass.ConfigError, match=r"\['repetition_penalty'\] \(given, or from the model's"):
        kvpass.RequestQueue(model)
    assert "kvpass.RequestQueue(policy='full', max_batch=8, requests=0, done=0)" == repr(
        kvpass.RequestQueue(model, repetition_penalty=1.0)
    )


def test_a_batch_of_one_keeps_its_staging_cache_apart():
    """``max_batch=1``: the staging cache and the batch are two caches (one would reset the other), and
    ``max_length`` sizes them exactly."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "streamingllm", compiler="eager", budget=16, sinks=2)
    ps = prompts()[:3]
    queue = kvpass.RequestQueue(model, max_batch=1, max_length=50, eos_token_id=None)
    for p in ps:
        queue.add(p, max_new_tokens=4)
    got = queue.run(progress=False)
    assert [g.tolist() for g in got] == [alone(model, p, 4, min_new_tokens=4).tolist() for p in ps]
    lengths = sorted(c.max_length for c in model.generate.caches.values())
    assert "(staging)" in repr(model.generate) and 50 in lengths


def test_max_length_sizes_the_caches_for_the_queues_max_new_tokens():
    """With ``max_length``, a queue is sized for its own ``max_new_tokens`` (or a request's, if more): a short
    warm-up request then the real ones run on the same caches, even for raas, whose capacity splits the prompt's
    entries from the new tokens' pool (the warm-up's 3 new tokens once sized a prompt-sized cache, and the
    benchmark's next queue ran out of memory)."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "raas", compiler="eager", **CONFORMANCE["raas"].demanding)
    kept = []
    for new in (3, 30):
        queue = kvpass.RequestQueue(model, max_batch=2, max_length=60, max_new_tokens=30, eos_token_id=None)
        queue.add(prompts()[0], max_new_tokens=new)
        queue.run(progress=False)
        kept.append({k: (id(c), c.max_new_tokens, c.capacities) for k, c in model.generate.caches.items()})
    assert kept[0] == kept[1] and all(room == 30 for _, room, _ in kept[0].values())
    # a prompt that leaves less than the queue's max_new_tokens keeps its room: sized by its own new tokens
    queue = kvpass.RequestQueue(model, max_batch=2, max_length=60, max_new_tokens=30, eos_token_id=None)
    queue.add(prompts()[3], max_new_tokens=5)  # 41 tokens
    assert queue.run(progress=False)[0].tolist() == alone(model, prompts()[3], 5, min_new_tokens=5).tolist()
