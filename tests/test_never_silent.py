"""Never silently wrong: ``kvpass.compile``'s ``generate`` and ``kvpass.RequestQueue`` give the uncompiled model's
tokens, or an error that names what failed and keeps what did not:

* a list of prompts samples with every default of the generation config, transformers' own (``top_k=50``) and the
  model's (a ``max_length``): the options are merged in one place, as ``generate`` merges them;
* float token ids (``[5.7, 6.2]``) are refused, not truncated, and so is an id outside the vocabulary, when the
  prompt is added: one check that every entry point shares;
* a request added while ``run`` decodes waits for the next ``run``: ``run`` returns only what it ran;
* ``run`` after a failure decodes the interrupted requests from their prompts;
* a failing request is named by ``RequestFailed``, which keeps what finished;
* a caller's stopping criterion and logits processor are called as often as transformers calls them.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import kvpass
from families import build
from test_requests import alone, prompts


@pytest.fixture(scope="module")
def models():
    """A tiny Llama through ``kvpass.compile`` (``full``, eager) and the same model uncompiled, shared by the tests
    here: its graphs compile once."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    yield model, ref
    torch._dynamo.reset()


def failing_forward(model, when):
    """Make ``model``'s compiled forward raise where ``when(input_ids)`` holds; returns a function that undoes it."""
    forward = model.forward

    def run(*args, **kwargs):
        if when(kwargs["input_ids"]):
            raise RuntimeError("injected failure")
        return forward(*args, **kwargs)

    model.forward = run

    def undo():
        model.forward = forward

    return undo


def test_a_list_of_prompts_samples_with_the_generation_configs_defaults(models):
    """Sampling a list of prompts draws what ``generate`` on one prompt draws (same seed): transformers' default
    ``top_k=50`` applies (without it, the first token here differs), and a ``max_length`` in the model's generation
    config is the total length there too, not 20 new tokens."""
    model, ref = models
    p = torch.randint(3, 90, (12,), generator=torch.Generator().manual_seed(1))
    outs = []
    for call in (
        lambda: ref.generate(p[None], do_sample=True, max_new_tokens=6)[0],
        lambda: model.generate(p[None], do_sample=True, max_new_tokens=6)[0],
        lambda: model.generate([p], do_sample=True, max_new_tokens=6, max_batch=1)[0],
    ):
        torch.manual_seed(0)
        outs.append(call().tolist())
    assert outs[1] == outs[0] and outs[2] == outs[0]
    queue = kvpass.RequestQueue(model, max_batch=1, do_sample=True, max_new_tokens=6)
    queue.add(p)
    torch.manual_seed(0)
    assert queue.run(progress=False)[0].tolist() == outs[0]
    try:
        for m in (model, ref):
            m.generation_config.max_length = 17
        want = ref.generate(p[None], do_sample=False, eos_token_id=None)[0]
        assert len(want) == 17
        assert model.generate([p], do_sample=False, eos_token_id=None)[0].tolist() == want.tolist()
    finally:
        for m in (model, ref):
            m.generation_config.max_length = None


def test_float_token_ids_are_refused_not_truncated(models):
    """``[5.7, 6.2, 7.9]`` is not run as ``[5, 6, 7]``: transformers refuses a float tensor of ids, and every kvpass
    entry point refuses float ids (``token_ids``), as well as an id outside the vocabulary (else a bare
    ``IndexError`` mid-run, a device assert on a GPU)."""
    model, ref = models
    with pytest.raises(RuntimeError, match="Long, Int"):  # transformers' own refusal of a float tensor
        ref.generate(torch.tensor([[5.7, 6.2, 7.9]]), max_new_tokens=2)
    with pytest.raises(
        kvpass.ConfigError,
        match=r"over a list of prompts \(a kvpass.RequestQueue\), prompt 0: parameter 'ids' must hold integer",
    ):
        model.generate([[5.7, 6.2, 7.9]], max_new_tokens=2)
    queue = kvpass.RequestQueue(model)
    for bad in ([5.0, 6.0], torch.tensor([5.0, 6.0]), [True, False]):
        with pytest.raises(kvpass.ConfigError, match="integer token ids"):
            queue.add(bad)
    with pytest.raises(
        kvpass.ConfigError,
        match=r"token id 500 at position 1, outside the model's vocabulary "
        r"of 96 ids",
    ):
        queue.add([5, 500, 7])
    assert len(queue) == 0
    from kvpass.generate.token_ids import token_ids

    ids = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    assert token_ids(ids, "here").tolist() == [5, 6, 7] and token_ids((5, 6), "here").dtype == torch.long
    with pytest.raises(kvpass.ConfigError, match="here: parameter 'chunk' must be a non-empty 1-D"):
        token_ids([], "here", "chunk")


def test_a_request_added_while_run_decodes_waits_for_the_next_run(models):
    """A request added from another thread while ``run`` decodes is not in that run's result (not as its prompt
    alone, ``stopped=None``): it waits, and the next ``run`` returns it alone, with its tokens."""
    model, _ = models
    ps = prompts()
    want = [alone(model, p, 5, min_new_tokens=5).tolist() for p in ps[:3]]
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for p in ps[:2]:
        queue.add(p, max_new_tokens=5)
    steps = []

    def add_late(ids):
        if ids.shape[1] == 1:
            steps.append(1)
            if len(steps) == 2:  # the second decode step: another thread adds a request
                adder = threading.Thread(target=queue.add, args=(ps[2],), kwargs={"max_new_tokens": 5})
                adder.start()
                adder.join()
        return False

    undo = failing_forward(model, add_late)
    try:
        got = queue.run(progress=False)
    finally:
        undo()
    assert [g.tolist() for g in got] == want[:2] and len(queue) == 3
    assert queue.requests[2].stopped is None and queue.waiting == [queue.requests[2]]
    assert [g.tolist() for g in queue.run(progress=False)] == want[2:]
    assert queue.run(progress=False) == []  # nothing waits


def test_run_after_a_failure_decodes_the_interrupted_requests_from_their_prompts(models):
    """After a run fails mid-way, the next ``run`` decodes the requests it interrupted from their prompts (not
    prefilled again and appended to their old tokens), and not the request that failed."""
    model, _ = models
    ps = prompts()[:3]  # 20, 33, 27 tokens: request 1's prefill fails while request 0 holds a row
    want = [alone(model, p, 6, min_new_tokens=6).tolist() for p in ps]
    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for p in ps:
        queue.add(p, max_new_tokens=6)
    undo = failing_forward(model, lambda ids: ids.shape[1] == 33)
    try:
        with pytest.raises(RuntimeError):
            queue.run(progress=False)
    finally:
        undo()
    after = [(list(r.tokens), r.stopped) for r in queue.requests]
    got = queue.run(progress=False)
    assert [g.tolist() for g in got] == [want[0], want[2]]
    assert after == [([], None), ([], "failed"), ([], None)]  # request 0's first token, made before, dropped
    assert queue.waiting == []
    assert [r.stopped for r in queue.requests] == ["length", "failed", "length"]


def test_a_failing_request_is_named_and_the_finished_ones_are_kept(models):
    """A request whose prefill fails ends the run with ``RequestFailed`` (not the bare error, naming no
    request): the message names the request, its index and prompt length; ``results`` holds what finished, equal
    to the uncompiled model's tokens; the error raised is the cause. A decode step that fails names the requests
    of the batch."""
    model, ref = models
    ps = prompts()[:3]
    queue = kvpass.RequestQueue(model, max_batch=1, eos_token_id=None)
    for p in ps:
        queue.add(p, max_new_tokens=4)
    undo = failing_forward(model, lambda ids: ids.shape[1] == 33)
    try:
        with pytest.raises(Exception) as info:
            queue.run(progress=False)
    finally:
        undo()
    e = info.value
    assert type(e).__name__ == "RequestFailed", repr(e)
    assert "kvpass.RequestQueue.run: request 1 (a 33-token prompt, max_new_tokens=4) failed in its prefill" in str(e)
    assert "RuntimeError: injected failure" in str(e) and "add it again" in str(e)
    assert isinstance(e.__cause__, RuntimeError) and e.failed == [queue.requests[1]]
    first = ref.generate(ps[0][None], max_new_tokens=4, min_new_tokens=4, do_sample=False)[0]
    assert e.results[0].tolist() == first.tolist() and e.results[1:] == [None, None]
    assert [g.tolist() for g in queue.run(progress=False)] == [alone(model, ps[2], 4, min_new_tokens=4).tolist()]

    queue = kvpass.RequestQueue(model, max_batch=2, eos_token_id=None)
    for p in ps[:2]:
        queue.add(p, max_new_tokens=4)
    decodes = []
    undo = failing_forward(model, lambda ids: ids.shape[1] == 1 and (decodes.append(1) or len(decodes) == 2))
    try:
        with pytest.raises(
            Exception,
            match=r"request 0 \(a 20-token prompt, max_new_tokens=4\), request 1 \(a "
            r"33-token prompt, max_new_tokens=4\) failed in a decode step",
        ) as info:
            queue.run(progress=False)
    finally:
        undo()
    assert info.value.results == [None, None] and queue.waiting == []


class Counting(StoppingCriteria):
    """The caller's criterion: every row done at its ``stop``-th call; counts its calls."""

    def __init__(self, stop: int) -> None:
        self.stop, self.calls = stop, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls == self.stop)


class CountingProcessor(LogitsProcessor):
    """The caller's processor: leaves the scores as they are; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def test_a_callers_stopping_criterion_is_called_as_often_as_by_transformers(models):
    """kvpass's loop reads "every row finished" one step late; the step queued meanwhile is undone before its
    logits reach the caller's processor or criterion (each is called as often as transformers calls it, not once
    more), and its random draw is not taken."""
    model, ref = models
    ids = prompts()[0][None]
    counts, outs = [], []
    for m in (ref, model):
        criterion, processor = Counting(stop=4), CountingProcessor()
        torch.manual_seed(0)
        outs.append(
            m.generate(
                ids,
                max_new_tokens=8,
                do_sample=True,
                logits_processor=LogitsProcessorList([processor]),
                stopping_criteria=StoppingCriteriaList([criterion]),
            )
        )
        counts.append((criterion.calls, processor.calls, torch.rand(3).tolist()))  # and the generator after
    assert counts[0][:2] == (4, 4) and counts[1] == counts[0] and torch.equal(outs[1], outs[0])


OPTIONS = {  # generate's options a user passes with a list of prompts; each gives generate's tokens or is refused
    "greedy": dict(do_sample=False),
    "temperature": dict(do_sample=True, temperature=0.7),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.8),
    "eos": dict(do_sample=False, eos_token_id=[7, 11]),
    "pad_token_id": dict(do_sample=False, pad_token_id=0),
    "min_p": dict(do_sample=True, min_p=0.05),
    "typical_p": dict(do_sample=True, typical_p=0.9),
    "epsilon_cutoff": dict(do_sample=True, epsilon_cutoff=3e-4),
    "repetition_penalty": dict(do_sample=False, repetition_penalty=1.3),
    "no_repeat_ngram_size": dict(do_sample=False, no_repeat_ngram_size=2),
    "min_new_tokens": dict(do_sample=False, min_new_tokens=6, eos_token_id=7),
    "bad_words_ids": dict(do_sample=False, bad_words_ids=[[5], [9, 10]]),
    "suppress_tokens": dict(do_sample=True, suppress_tokens=[3, 4, 5]),
    "begin_suppress_tokens": dict(do_sample=False, begin_suppress_tokens=[3, 4]),
    "sequence_bias": dict(do_sample=False, sequence_bias={(6,): 5.0}),
}
RUN = ("greedy", "temperature", "top_k", "top_p", "eos", "pad_token_id")  # the others are refused by name


@pytest.mark.parametrize("option", OPTIONS)
def test_a_list_of_prompts_gives_generates_tokens_or_refuses_the_option(models, option):
    """Each option, on a list of prompts one at a time (``max_batch=1``, as ``generate`` on one row), gives
    ``generate``'s tokens on each prompt with the same seed; the queue runs greedy search, sampling with
    temperature, top-k and top-p, and end tokens, and refuses every other option that changes tokens, naming it.
    Nothing is run differently without a word."""
    model, ref = models
    kw = dict(OPTIONS[option], max_new_tokens=6)
    ps = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    if option not in RUN:
        with pytest.raises(
            kvpass.ConfigError, match=rf"generate\(\) over a list of prompts \(a kvpass.RequestQueue\): \['{option}'\]"
        ):
            model.generate(ps, max_batch=1, **kw)
        return
    for p in ps:
        torch.manual_seed(0)
        want = ref.generate(p[None], **kw)[0].tolist()
        torch.manual_seed(0)
        assert model.generate([p], max_batch=1, **kw)[0].tolist() == want, option
