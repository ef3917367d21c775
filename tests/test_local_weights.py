"""``kvpass.compiler.local_weights``: a compiled graph's DTensor inputs taken as their local tensors.

One process, a gloo group of one rank: a module whose weight is a DTensor, compiled by a backend that applies
``local_weights`` before AOTAutograd, computes what the uncompiled module does, and hands AOTAutograd plain
tensors, at compile time and on every call (so its runtime wrapper has no DTensor to unwrap). ``undo`` gives
the graph back, and kvpass's backend falls back to it, warning, when the changed graph fails to compile. The
two-rank checks of every policy run with it in ``tests/test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvpass.compiler.local_weights import local_weights

tensor = pytest.importorskip("torch.distributed.tensor")
DTensor, Replicate = tensor.DTensor, tensor.Replicate


@pytest.fixture(scope="module")
def mesh():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    if own:
        dist.destroy_process_group()


class Projection(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
        self.w = torch.nn.Parameter(DTensor.from_local(w, mesh, [Replicate()]), requires_grad=False)
        self.b = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(1)), requires_grad=False)

    def forward(self, x):
        y = torch.nn.functional.linear(DTensor.from_local(x, self.w.device_mesh, [Replicate()]), self.w)
        return y.to_local().relu() + self.b


def _compiled(model, local: bool, compiled_inputs: list, call_inputs: list):
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        wrap = lambda compiled: compiled  # noqa: E731
        if local:
            example_inputs, wrap, _ = local_weights(gm, example_inputs)
        compiled_inputs.extend(example_inputs)
        inner = lookup_backend("aot_eager")(gm, example_inputs)

        def spy(*args):  # what AOTAutograd's compiled function is called with on every call
            call_inputs.append([type(a) for a in args])
            return inner(*args)

        return wrap(spy)

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.parametrize("local", [True, False])
def test_dtensor_weights_reach_the_compiler_as_local_tensors(mesh, local):
    model = Projection(mesh)
    compiled_inputs, call_inputs = [], []
    compiled = _compiled(model, local, compiled_inputs, call_inputs)
    with torch.no_grad():
        for s in range(4):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(compiled(x), model(x))
    assert len(call_inputs) == 4
    had_dtensor = [any(issubclass(t, DTensor) for t in types) for types in call_inputs]
    if local:  # the compiler and every call see plain tensors: nothing for AOTAutograd to unwrap per call
        assert not any(isinstance(t, DTensor) for t in compiled_inputs) and not any(had_dtensor)
    else:  # without it: what the test catches (the weight reaches AOTAutograd as a DTensor on every call)
        assert any(isinstance(t, DTensor) for t in compiled_inputs) and all(had_dtensor)


def test_undo_gives_the_graph_back(mesh):
    """A failed compile falls back to the graph as Dynamo gave it (``Backend._inner``): ``undo`` restores it."""
    codes = []

    def backend(gm, example_inputs):
        before = gm.code
        inputs, _, undo = local_weights(gm, example_inputs)
        changed = gm.code
        undo()
        codes.append((before, changed, gm.code, inputs is example_inputs))
        return gm.forward

    torch._dynamo.reset()
    model = Projection(mesh)
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend, fullgraph=True)(x), model(x))
    ((before, changed, after, same),) = codes
    assert changed != before and after == before and not same


def test_graphs_without_dtensors_are_left_alone():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    example = [torch.randn(1, 4)]
    code = gm.code
    out_example, wrap, undo = local_weights(gm, example)
    undo()
    assert out_example is example and wrap(len) is len and gm.code == code


def test_a_failed_compile_falls_back_to_the_dtensor_graph_with_a_warning(mesh, monkeypatch):
    import kvpass

    be = kvpass.backend("full", compiler="aot_eager")
    real = type(be)._compile

    def fails_on_locals(self, gm, example_inputs, *args):
        if not any(isinstance(t, DTensor) for t in example_inputs):
            raise RuntimeError("cannot trace from_local here")
        return real(self, gm, example_inputs, *args)

    monkeypatch.setattr(type(be), "_compile", fails_on_locals)
    torch._dynamo.reset()
    model = Projection(mesh)
    x = torch.randn(3, 6)
    with pytest.warns(UserWarning, match="weights as local tensors failed .*cannot trace from_local"), torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=be, fullgraph=True)(x), model(x))


def _kvpass_compiled(model, be, spy: list):
    """``model`` compiled as ``kvpass.compile`` compiles a forward: ``be.spec_guards`` as the guard filter (each
    call's guard entries and answers recorded in ``spy``)."""

    def keep(entries):
        answers = be.spec_guards(entries)
        spy.extend(zip([e.guard_type for e in entries], answers))
        return answers

    torch._dynamo.reset()
    return torch.compile(model, backend=be, fullgraph=True, options={"guard_filter_fn": keep})


def test_the_compiled_callable_checks_the_specs_whose_guards_kvpass_drops(mesh):
    """Dynamo's guard on each weight's spec (a Python comparison per weight per call) is dropped for the weights
    the compiled callable checks itself, and only those: the same weights give the same outputs without a
    recompile, and a weight re-sharded after the compile is an error, never a graph run for the old placement."""
    import kvpass

    be = kvpass.backend("full", compiler="aot_eager")
    model = Projection(mesh)
    spy = []
    compiled = _kvpass_compiled(model, be, spy)
    with torch.no_grad():
        for s in range(3):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(s))
            torch.testing.assert_close(compiled(x), model(x))
    spec_guards = [keep for kind, keep in spy if kind == "DTENSOR_SPEC_MATCH"]
    assert spec_guards and not any(spec_guards), spy  # the weight's spec guard, dropped
    assert any(keep for kind, keep in spy if kind != "DTENSOR_SPEC_MATCH")  # every other guard kept
    assert len(be.reports) == 1
    # the same placement in a new spec object (a weight loaded again): checked equal, no recompile
    model.w = torch.nn.Parameter(
        DTensor.from_local(model.w.to_local().clone(), mesh, [Replicate()]), requires_grad=False
    )
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert len(be.reports) == 1
    model.w = torch.nn.Parameter(DTensor.from_local(model.w.to_local(), mesh, [tensor.Shard(0)]), requires_grad=False)
    with pytest.raises(RuntimeError, match="changed its placement since it was compiled"), torch.no_grad():
        compiled(x)


@pytest.mark.parametrize("compiler, filtered", [("aot_eager", False), ("eager", True)])
def test_where_no_callable_checks_the_spec_dynamo_keeps_its_guard(mesh, compiler, filtered):
    """The contrasts: a backend used through plain ``torch.compile`` (no guard filter), and a graph compiled
    eagerly under the filter (``prefill_compiler="eager"`` does so: no callable checks its DTensors), keep
    Dynamo's guard on the spec, which recompiles the frame for a re-sharded weight."""
    import kvpass

    be = kvpass.backend("full", compiler=compiler)
    model, spy = Projection(mesh), []
    if filtered:
        compiled = _kvpass_compiled(model, be, spy)
    else:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=be, fullgraph=True)
    x = torch.randn(3, 6)
    with torch.no_grad():
        compiled(x)
        model.w = torch.nn.Parameter(
            DTensor.from_local(model.w.to_local(), mesh, [tensor.Shard(0)]), requires_grad=False
        )
        torch.testing.assert_close(compiled(x), model(x))
    assert len(be.reports) == 2
    if filtered:
        assert [keep for kind, keep in spy if kind == "DTENSOR_SPEC_MATCH"][:1] == [True]


def test_the_filter_drops_a_spec_guard_only_for_the_frame_that_checks_it(mesh):
    """The filter decides per frame (Dynamo calls it once per frame, after the backend compiled the frame's
    graphs): a spec checked by one frame's callable keeps its guard in the next frame, and in a frame where
    another graph takes the same DTensor unchecked (compiled eagerly, or after a fallback)."""
    from types import SimpleNamespace

    from kvpass.compiler.local_weights import SpecGuards

    w = Projection(mesh).w
    entry = SimpleNamespace(guard_type="DTENSOR_SPEC_MATCH", has_value=True, value=w._spec)
    other = SimpleNamespace(guard_type="TENSOR_MATCH", has_value=True, value=w)
    guards = SpecGuards()
    guards.checked([w._spec])
    assert guards([entry, other]) == [False, True]  # this frame checks it
    assert guards([entry, other]) == [True, True]  # the next frame compiled nothing that checks it
    guards.checked([w._spec])
    guards.unchecked([w, torch.zeros(1)])  # and a graph of the same frame takes it as it is
    assert guards([entry]) == [True]
