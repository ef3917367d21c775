"""Decode steps that call their compiled graph directly, without Dynamo's frame (``kvpass.compile(...,
direct_steps=...)``: ``"auto"`` by default, ``True`` or ``False``).

Every call of a compiled forward first runs Dynamo's frame: the guards of the frame (in C++), the bytecode that
gathers the graph's inputs, then the compiled graph, then the bytecode that builds the output and replays the
frame's Python side effects. On a model split with transformers' tensor-parallel plan the frame grows with the
modules the plan wraps (on CPU with transformers 5.24, about 50 guards each, and each DTensor weight fetched
through ``nn.Module.__getattr__``):
at 32 layers of the Llama-3.1-8B shape on two H200s a rank's host took 6.7 ms of a 7.6 ms decode step, against
0.76 on one GPU (``bench/results/tp_h200x2_2026-11-29``), so the two-GPU step runs at the host's pace.

Within one ``generate`` call of kvpass's decoding loop the frame does the same thing at every step: the same
compiled graph, the same weights and cache buffers, new tensors only for the step's inputs. ``DirectSteps``
watches two consecutive steps run the usual way and then calls the graph itself, with the new step's input
tensors in the places where they went before, and builds the output from the graph's logits. It does so only
where both steps showed that:

- each step ran exactly one compiled graph of the backend (no graph break, no eager frame), a decode graph, and
  the same one;
- every argument of the graph was the same object both times, an equal number, or the tensor that the step's
  inputs held under one name (``input_ids``, ``position_ids``, ...) both times;
- the output held the logits, which the graph returned in the same place, and the cache (under the names
  the model gives it), and nothing else;
- the second step changed no Python state of the cache, of its layers or of the model's modules (attributes,
  parameters, buffers): the frame's side effects, which a direct call does not replay, were none there;
- the model has no forward hooks of its own and none is registered for every module (they run outside the
  compiled forward).

Each direct step checks again that its inputs are those names with the same shapes, strides, dtypes and
devices, that every other input is the object (or the value) it was, that gradients are off, that torch's
global state is what it was when the plan was made (Dynamo's own global-state guard: grad mode, autocast,
deterministic algorithms, default dtype, ...) with as many torch function and dispatch modes active, and that
``model.forward`` is still the forward ``kvpass.compile`` compiled (not a wrapper set since); any difference,
and every later step of the call, goes back to the usual call. What a direct call skips and no check covers:
Dynamo's guards on state that nothing of the frame changes and something between two steps of the call could
(module attributes, module-level globals), and a side effect of the frame on a module-level global, which is
not replayed (transformers' output-capturing context variable is set and reset within the frame).

Between two steps of kvpass's decoding loop only the loop and the logits processors and stopping criteria of
the call run. ``"auto"`` (the default) therefore takes direct steps only where all of those are transformers'
own (``callers_code``): a processor or criterion of the caller's own could change what the frame's guards
check, so such a call runs the usual way unless ``direct_steps=True``. ``True`` also warns once when direct
steps stop or never begin; ``"auto"`` only records why in ``be.last_direct_steps``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from kvpass.compiler.recording import recording
from kvpass.errors import warn_once

try:  # where entering a compiled frame counts CUDA graph trees' generations (torch 2.x)
    from torch._dynamo.mutation_guard import GenerationTracker
except ImportError:  # pragma: no cover
    GenerationTracker = None
try:  # Dynamo's guard on torch's global settings, checked in C++
    from torch._C._dynamo.guards import GlobalStateGuard
except ImportError:  # pragma: no cover
    GlobalStateGuard = None


def callers_code(logits_processor, stopping_criteria) -> str | None:
    """What of the caller's own code a ``generate`` call runs between its steps: the first logits processor or
    stopping criterion that is not one of transformers' (a ``prefix_allowed_tokens_fn`` counts: transformers'
    processor calls it), or None."""
    for kind, items in (("logits processor", logits_processor), ("stopping criterion", stopping_criteria)):
        for x in items or ():
            cls = type(x)
            if not cls.__module__.startswith("transformers.") or cls.__name__ == "PrefixConstrainedLogitsProcessor":
                return f"the call runs a {kind} of its own between steps ({cls.__name__})"
    return None


def _fingerprint(obj) -> dict:
    """An object's Python state, one level deep: a tensor or another object by identity, a number or string by
    value, a list, tuple or dict by the identities of what it holds."""

    def one(v):
        if isinstance(v, (bool, int, float, str, type(None))):
            return v
        if isinstance(v, (list, tuple)):
            return (type(v), tuple(id(x) for x in v))
        if isinstance(v, dict):
            return (dict, tuple((k, id(x)) for k, x in v.items()))
        return id(v)

    return {k: one(v) for k, v in getattr(obj, "__dict__", {}).items()}


def _state(cache, model) -> list:
    objs = [cache, *getattr(cache, "layers", ()), *model.modules()]
    return [_fingerprint(o) for o in objs]


def _same(x, y) -> bool:
    """The same object, or (not a tensor) an equal value."""
    return x is y or (
        not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and type(x) is type(y) and x == y
    )


def _modes() -> tuple:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


class _Plan(NamedTuple):
    graph: Callable  # the compiled decode graph (as ``recorded`` wraps it)
    args: list  # its arguments at the second step watched
    subs: dict  # {argument index: the input name whose tensor goes there each step}
    logits_at: int  # the logits' place among the graph's outputs
    output: tuple  # (the model's output class, its names for the cache)
    same: dict  # the inputs that stay: {name: object or value}
    fresh: dict  # the step's new tensors: {name: (shape, stride, dtype, device)}
    torch_state: GlobalStateGuard  # torch's global settings when the plan was made
    modes: tuple  # how many torch function and dispatch modes were active then (Dynamo guards them too)


class DirectSteps:
    """One ``generate`` call's direct decode steps (see the module's docstring): ``watch`` the usual steps until two
    agree, then ``step`` calls the graph; ``refused`` says why direct steps stopped or never began."""

    def __init__(self, model, cache, owner=None, asked: bool = True, refused: str | None = None, forward=None) -> None:
        self.model, self.cache, self.owner = model, cache, owner  # owner: the backend, which warns once
        # the compiled forward kvpass.compile set on the model: a direct step would skip a wrapper set after it
        self.forward = forward if forward is not None else model.__dict__.get("forward")
        self.asked = asked  # direct_steps=True (warn when they stop or never begin), not "auto"
        # the steps watched, at most two: (inputs, [(graph, arguments)], the logits' place among the graph's
        # outputs or None, (output class, the output's names for the cache))
        self.seen: list = []
        self.plan: _Plan | None = None
        self.refused: str | None = refused
        self.direct = 0  # steps called directly so far
        self._before = None  # the Python state before the second step watched
        everyone = torch.nn.modules.module  # hooks registered for every module (register_module_forward_hook)
        if (
            model._forward_hooks
            or model._forward_pre_hooks
            or everyone._global_forward_hooks
            or everyone._global_forward_pre_hooks
        ):
            self.refused = "the model has forward hooks, which run outside its compiled forward"
        if model.__dict__.get("forward") is not self.forward:
            self.refused = "model.forward was replaced after kvpass.compile (a direct step would skip the new one)"
        if GenerationTracker is None or GlobalStateGuard is None:  # pragma: no cover
            self.refused = "this torch lacks Dynamo's GenerationTracker or GlobalStateGuard"

    @contextlib.contextmanager
    def watch(self):
        """Around a usual step: yields a list that gets the step's compiled calls. The second step watched is also
        checked for Python side effects (its state before is kept)."""
        if self.refused is not None or self.plan is not None:
            yield None
            return
        before = _state(self.cache, self.model) if len(self.seen) == 1 else None
        calls, outer = [], recording.calls
        recording.calls = calls
        try:
            yield calls
        finally:
            recording.calls = outer
        self._before = before

    def saw(self, inputs: dict, outputs, calls) -> None:
        """A watched step's inputs, outputs and compiled calls; after the second, the plan or the refusal. Only
        the step's inputs, its graphs and their arguments are kept: a graph's outputs held past the step would
        keep a CUDA graph from replaying into the same memory."""
        if calls is None:
            return
        at = [j for j, o in enumerate(calls[0][2]) if o is outputs.logits] if len(calls) == 1 else []
        cache_keys = tuple(k for k in outputs.keys() if k != "logits")  # past_key_values, or cache (5.24)
        fits = all(outputs[k] is self.cache for k in cache_keys)
        self.seen.append(
            (inputs, [(fn, args) for fn, args, _ in calls], at[0] if at and fits else None, (type(outputs), cache_keys))
        )
        calls.clear()
        if len(self.seen) == 2:
            if self._before != _state(self.cache, self.model):
                self.refused = "a step changed Python state of the cache or the model (Dynamo's side effects)"
            else:
                self.refused = self._plan()
            self.seen, self._before = [], None  # the plan keeps what it needs

    def _plan(self) -> str | None:
        (in1, c1, at1, _), (in2, c2, at2, kind) = self.seen
        if len(c1) != 1 or len(c2) != 1:
            return f"a step ran {max(len(c1), len(c2))} compiled graphs (a graph break) or none"
        (fn, a1), (fn2, a2) = c1[0], c2[0]
        if fn is not fn2 or getattr(fn, "phase", None) != "decode" or len(a1) != len(a2):
            return "the two steps ran different graphs, or not a decode graph"
        if at1 is None or at1 != at2 or self.seen[0][3] != kind:
            return "the output holds more than the logits and the cache, or the logits are not the graph's"
        if in1.keys() != in2.keys():
            return "the two steps had different inputs"
        fresh = {}  # the step's new tensors, by name: their shape, stride, dtype and device
        for k, v in in2.items():
            if not _same(in1[k], v):
                if not (isinstance(v, torch.Tensor) and isinstance(in1[k], torch.Tensor) and _meta(v) == _meta(in1[k])):
                    return f"input {k!r} changed between steps"
                fresh[k] = _meta(v)
        subs = {}
        for i, (x, y) in enumerate(zip(a1, a2)):
            names = [k for k in fresh if in1[k] is x and in2[k] is y]
            if names:
                subs[i] = names[0]
            elif not _same(x, y):
                return f"argument {i} of the graph changed between steps and is not one of the step's inputs"
        same = {k: v for k, v in in2.items() if k not in fresh}
        self.plan = _Plan(fn, list(a2), subs, at2, kind, same, fresh, GlobalStateGuard(), _modes())
        return None

    def step(self, inputs: dict):
        """The step's output from the graph called directly, or None (the usual call; direct steps stop for the
        rest of this call) where the inputs are not as the plan expects."""
        if self.plan is None:
            return None
        fn, args, subs, at, kind, same, fresh, torch_state, modes = self.plan
        if inputs.keys() != same.keys() | fresh.keys() or not all(_same(inputs[k], v) for k, v in same.items()):
            return self._stop("an input other than the step's new tensors changed")
        for name, meta in fresh.items():
            t = inputs[name]
            if not isinstance(t, torch.Tensor) or _meta(t) != meta:
                return self._stop(f"input {name!r} changed its shape, stride, dtype or device")
        if torch.is_grad_enabled():
            return self._stop("gradients are on")
        if not torch_state.check():
            return self._stop(f"torch's global state changed ({torch_state.reason()})")
        if _modes() != modes:
            return self._stop("a torch function or dispatch mode was entered or left")
        if self.model.__dict__.get("forward") is not self.forward:
            return self._stop("model.forward was replaced during the call")
        args = list(args)
        for i, name in subs.items():
            args[i] = inputs[name]
        # what entering a compiled frame does first: Inductor's CUDA graph trees begin a new generation there (the
        # last step's outputs, freed by the loop, are not kept alive against a replay)
        GenerationTracker.generation += 1
        self.direct += 1
        cls, cache_keys = kind
        return cls(logits=fn(*args)[at], **dict.fromkeys(cache_keys, self.cache))

    def close(self) -> None:
        """The call is over: say once per backend and reason why direct steps stopped or never began (they were
        asked for), and drop the plan and what it holds (the graph's arguments: the cache's buffers, which
        ``be.last_direct_steps`` would otherwise keep alive after the call gives the cache up)."""
        if self.refused is not None and self.asked:
            done = f"stopped after {self.direct} direct steps" if self.direct else "not used"
            warn_once(
                f"kvpass: direct_steps {done} in this generate call: {self.refused}; the other steps ran the "
                f"usual way (the same tokens)",
                self.owner,
            )
        self.plan, self.seen, self._before = None, [], None
        self.model = self.cache = None

    def stop(self, why: str) -> None:
        """No direct step for the rest of the call, for the reason ``why`` (the first reason given is kept)."""
        if self.refused is None:
            self._stop(why)

    def _stop(self, why: str):
        self.plan, self.refused = None, why
        return None

    def __repr__(self) -> str:
        state = (
            f"refused: {self.refused}"
            if self.refused
            else "ready"
            if self.plan is not None
            else "closed"
            if self.cache is None
            else "watching"
        )
        return f"DirectSteps({state}, direct steps={self.direct})"
