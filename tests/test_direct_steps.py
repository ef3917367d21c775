"""``kvpass.compile(..., direct_steps=True)``: decode steps that call the compiled graph without Dynamo's frame.

* they generate what the usual steps generate (greedy and sampled, one row and two, an appending, an evicting, a
  ring and a paged cache, Inductor's path through AOTAutograd and the eager one), and they do run: every step
  after the two watched;
* they are refused, with one warning, and every step runs the usual way, where a step stores a tensor on a
  module (a side effect of Dynamo's frame, which a direct call would not replay) or a forward hook would run;
* the plan's own refusals on two watched steps (a graph break, different graphs, an argument that changes but is
  not one of the step's inputs) and a direct step's (an input of another shape);
* ``"auto"``, the default, takes them in a plain call and not in one that runs a stopping criterion of the
  caller's own between steps (``True`` does), without a warning either way; a change of torch's global state
  between steps stops them;
* a bad ``direct_steps`` is a ConfigError naming it.
Two ranks (tensor parallelism) run ``full`` with direct steps in ``tests/test_tensor_parallel.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers.generation import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.modeling_outputs import CausalLMOutputWithPast

import kvpass
from conformance import CONFORMANCE
from families import build
from kvpass.compiler.recording import recorded
from kvpass.errors import ConfigError, KVPassWarning
from kvpass.generate.direct_steps import DirectSteps, callers_code

NEW = 12  # decode steps: the first (no mask to reuse yet), two watched, then 8 direct


def ids_of(n: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (rows, n), generator=torch.Generator().manual_seed(n))


def generate(model, policy: str, direct: bool, compiler: str, rows: int = 1, sample: bool = False, **kw):
    """``model`` through ``kvpass.compile`` for one ``generate`` call of ``NEW`` tokens (``kw``: more of its
    arguments), given back uncompiled: the tokens and the backend."""
    torch._dynamo.reset()
    be = kvpass.compile(
        model,
        policy,
        compiler=compiler,
        direct_steps=direct,
        **({} if policy == "full" else CONFORMANCE[policy].demanding),
    )
    try:
        if sample:
            torch.manual_seed(0)
        out = model.generate(ids_of(23, rows), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=sample, **kw)
    finally:
        del model.forward, model.generate  # kvpass.compile set both on the instance
    return out, be


@pytest.mark.parametrize(
    "policy, compiler, rows, sample",
    [
        ("full", "aot_eager", 1, False),
        ("full", "eager", 2, True),
        ("snapkv", "eager", 1, False),
        ("streamingllm", "eager", 2, False),
        ("raas", "aot_eager", 1, False),
    ],
)
def test_direct_steps_generate_the_usual_tokens(policy, compiler, rows, sample):
    model = build("llama")
    usual, _ = generate(model, policy, False, compiler, rows, sample)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVPassWarning)  # direct steps ran throughout: nothing to say
        direct, be = generate(model, policy, True, compiler, rows, sample)
    assert torch.equal(usual, direct), f"{policy}: direct steps changed the tokens"
    steps = be.last_direct_steps
    assert steps.refused is None and steps.direct == NEW - 4, steps  # every step after the two watched
    assert steps.plan is None and steps.cache is None and "closed" in repr(steps)  # the call let go of its cache


def test_direct_steps_stop_where_the_usual_steps_stop():
    """Two rows, an end token that one row reaches after a few direct steps: the same tokens and padding as the
    usual steps (the loop reads the finished flag one step late and undoes the extra step either way)."""
    model = build("llama")
    free, _ = generate(model, "full", False, "eager", rows=2)
    eos = int(free[0, 23 + 7])  # row 0's eighth new token
    model.generation_config.pad_token_id = 0
    outs = []
    for direct in (False, True):
        torch._dynamo.reset()
        be = kvpass.compile(model, "full", compiler="eager", direct_steps=direct)
        try:
            outs.append(model.generate(ids_of(23, 2), max_new_tokens=NEW, do_sample=False, eos_token_id=eos))
        finally:
            del model.forward, model.generate
    assert torch.equal(outs[0], outs[1]) and (outs[1][0, 23 + 8 :] == 0).all(), outs
    assert be.last_direct_steps.direct > 0


def test_a_step_that_stores_a_tensor_on_a_module_is_never_called_directly():
    """The final norm keeps its last input (a side effect Dynamo replays after the graph): direct calls would leave
    it at the second watched step's. Refused, so every step runs the usual way."""
    model = build("llama")
    norm = model.model.norm
    norm.last = None
    forward = norm.forward

    def keeping(x):
        norm.last = x
        return forward(x)

    norm.forward = keeping
    be = kvpass.compile(model, "full", compiler="eager", direct_steps=True)
    with pytest.warns(KVPassWarning, match="direct_steps not used in this generate call: a step changed Python state"):
        model.generate(ids_of(23), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    steps = be.last_direct_steps
    assert steps.direct == 0 and "side effects" in steps.refused, steps
    assert norm.last is not None and norm.last.shape[1] == 1  # a decode step's


@pytest.mark.parametrize("everyone", [False, True])
def test_a_model_with_a_forward_hook_is_never_called_directly(everyone):
    """A hook of the model's own, or one registered for every module: it runs in ``model(...)``, outside the
    compiled forward, at every step."""
    model = build("llama")
    calls = []
    hook = (torch.nn.modules.module.register_module_forward_hook if everyone else model.register_forward_hook)(
        lambda m, a, o: calls.append(1) if m is model else None
    )
    try:
        be = kvpass.compile(model, "full", compiler="eager", direct_steps=True)
        with pytest.warns(KVPassWarning, match="direct_steps not used .*forward hooks"):
            model.generate(ids_of(23), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        hook.remove()
    assert be.last_direct_steps.direct == 0 and "hooks" in be.last_direct_steps.refused
    assert len(calls) == NEW  # the prefill and every decode step ran the hook


def test_steps_without_a_reused_mask_say_why():
    """After a list of prompts (a RequestQueue, whose decode graph reads the attention mask), a batch's decode steps
    build their mask anew through Dynamo, so none is direct; ``be.last_direct_steps`` says why. A call on a
    DynamicCache passed in runs transformers' own loop: None, not the call before's."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(23, rows=2)
    model.generate(list(ids), max_new_tokens=4, do_sample=False)
    model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    steps = be.last_direct_steps
    assert steps.direct == 0 and "reads the attention mask" in steps.refused, steps
    model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert be.last_direct_steps is None
    torch._dynamo.reset()


class _Cache:
    layers = ()


LOGITS = torch.zeros(1, 1, 4)


def _step(steps: DirectSteps, graphs: list, inputs: dict) -> None:
    """One watched step: each ``(graph, args)`` called; the output holds ``LOGITS`` (every fake graph returns it)."""
    with steps.watch() as calls:
        for fn, args in graphs:
            fn(*args)
    steps.saw(inputs, CausalLMOutputWithPast(logits=LOGITS, past_key_values=steps.cache), calls)


def test_the_plan_refuses_what_two_steps_do_not_agree_on():
    weight, model = torch.ones(2), torch.nn.Linear(2, 2)
    g, h = (recorded(lambda *args: [LOGITS], "decode") for _ in range(2))

    def watched(*per_step) -> DirectSteps:
        """Two watched steps; ``per_step``: the step's input ids -> the graphs it calls."""
        steps = DirectSteps(model, _Cache())
        with torch.no_grad():  # as the loop runs: the plan keeps torch's global state of its steps
            for graphs in per_step:
                ids = torch.zeros(1, 1, dtype=torch.long)
                _step(steps, graphs(ids), {"input_ids": ids, "use_cache": True})
        return steps

    same = lambda ids: [(g, (ids, weight))]  # noqa: E731
    assert "graph break" in watched(lambda ids: [(g, (ids, weight)), (g, (ids, weight))], same).refused
    assert "different graphs" in watched(same, lambda ids: [(h, (ids, weight))]).refused
    fresh = lambda ids: [(g, (ids, torch.ones(2)))]  # noqa: E731  (a new tensor that is no input of the step)
    assert "argument 1" in watched(fresh, fresh).refused
    steps = watched(same, same)
    assert steps.refused is None and steps.plan is not None
    assert steps.step({"input_ids": torch.ones(1, 1, dtype=torch.long), "use_cache": True}) is None
    assert "gradients" in steps.refused  # the loop runs without them; a direct step checks
    steps = watched(same, same)
    with torch.no_grad():
        out = steps.step({"input_ids": torch.ones(1, 1, dtype=torch.long), "use_cache": True})
        assert out.logits is LOGITS and out.past_key_values is steps.cache and steps.direct == 1
        assert steps.step({"input_ids": torch.zeros(1, 2, dtype=torch.long), "use_cache": True}) is None
    assert "shape" in steps.refused and steps.plan is None  # and no direct step for the rest of the call
    assert steps.step({"input_ids": torch.ones(1, 1, dtype=torch.long), "use_cache": True}) is None


def test_direct_steps_must_be_a_bool_or_auto():
    with pytest.raises(ConfigError, match="'direct_steps' must be True, False or 'auto'"):
        kvpass.compile(build("llama"), "full", compiler="eager", direct_steps="yes")


class Counting(StoppingCriteria):
    """A stopping criterion of the caller's own: never stops, counts its calls."""

    calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_auto_is_the_default_and_stays_out_of_calls_with_the_callers_own_code():
    """``"auto"``: direct steps in a plain call, silently; none in a call with a stopping criterion of the caller's
    own (it runs between steps), silently, with the reason recorded; ``True`` takes them there too."""
    model = build("llama")
    usual, _ = generate(model, "full", False, "eager")
    torch._dynamo.reset()
    be = kvpass.compile(model, "full", compiler="eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", KVPassWarning)
            plain = model.generate(ids_of(23), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert be.direct_steps == "auto" and be.last_direct_steps.direct == NEW - 4
            counting = Counting()
            own = model.generate(
                ids_of(23),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([counting]),
            )
        steps = be.last_direct_steps
        assert steps.direct == 0 and "stopping criterion of its own between steps (Counting)" in steps.refused, steps
        be.direct_steps = True
        again = Counting()
        forced = model.generate(
            ids_of(23),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([again]),
        )
        assert be.last_direct_steps.direct == NEW - 4 and again.calls == counting.calls
    finally:
        del model.forward, model.generate
    assert torch.equal(usual, plain) and torch.equal(usual, own) and torch.equal(usual, forced)


def test_callers_code_names_what_is_not_transformers_own():
    from transformers.generation import MinNewTokensLengthLogitsProcessor, PrefixConstrainedLogitsProcessor

    ours = [MinNewTokensLengthLogitsProcessor(3, 2, [1])]
    assert callers_code(ours, StoppingCriteriaList()) is None
    prefix = PrefixConstrainedLogitsProcessor(lambda batch, ids: [5], num_beams=1)  # calls the caller's function
    assert "logits processor of its own between steps (PrefixConstrainedLogitsProcessor)" in callers_code(
        ours + [prefix], []
    )
    assert "(Counting)" in callers_code(ours, [Counting()])


class Noop(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Changes(LogitsProcessor):
    """At its ``at``-th call, changes what Dynamo's frame guards between two steps: torch's global state
    (deterministic algorithms on) or the active torch function modes (one entered)."""

    def __init__(self, what: str, at: int = 7) -> None:
        self.what, self.at, self.calls, self.mode = what, at, 0, Noop()

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            if self.what == "global state":
                torch.use_deterministic_algorithms(True, warn_only=True)
            else:
                self.mode.__enter__()
        return scores

    def undo(self) -> None:
        torch.use_deterministic_algorithms(False)
        if self.what != "global state" and self.calls >= self.at:
            self.mode.__exit__(None, None, None)


@pytest.mark.parametrize(
    "what, says",
    [
        ("global state", r"global state changed \(deterministic"),
        ("mode", "a torch function or dispatch mode was entered"),
    ],
)
def test_a_change_of_torchs_global_state_or_modes_stops_direct_steps(what, says):
    model = build("llama")
    usual, _ = generate(model, "full", False, "eager")
    change = Changes(what)
    try:
        with pytest.warns(KVPassWarning, match=f"stopped after 3 direct steps .*{says}"):
            out, be = generate(model, "full", True, "eager", logits_processor=LogitsProcessorList([change]))
    finally:
        change.undo()
    assert torch.equal(usual, out) and be.last_direct_steps.direct == 3


@pytest.mark.parametrize("direct", ["auto", True])
def test_a_forward_wrapped_after_compile_runs_at_every_step(direct):
    """``model.forward`` replaced after ``kvpass.compile`` (a wrapper of the caller's around the compiled one): a
    direct step would skip it, so none is taken (``True`` says why)."""
    model = build("llama")
    torch._dynamo.reset()
    be = kvpass.compile(model, "full", compiler="eager", direct_steps=direct)
    compiled, calls = model.forward, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    model.forward = wrapper
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model.generate(ids_of(23), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    finally:
        del model.forward, model.generate
    said = [str(w.message) for w in seen if issubclass(w.category, KVPassWarning)]
    assert len(calls) == NEW and be.last_direct_steps.direct == 0, (len(calls), be.last_direct_steps)
    assert "model.forward was replaced after kvpass.compile" in be.last_direct_steps.refused
    assert bool(said) == (direct is True), said
