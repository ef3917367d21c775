"""A tensor-parallel graph's DTensor inputs handed to Inductor as their local tensors.

Under transformers' tensor-parallel plan the projections' weights are DTensors, and Dynamo passes them to the
compiled graph on every call. AOTAutograd's runtime wrapper then unwraps each one into its local tensor in
Python (``runtime_unwrap_tensor_subclasses``: 57 weights at 8 layers of the Llama-3.1-8B shape), on every decode
step. On two H200s a rank's host took 1.9-2.1 ms a step at 8 layers against 0.4-0.8 on one GPU, as long as the
device's step or longer, so a small-cache policy decoded slower on two GPUs than on one
(``bench/results/tp_h200x2_2026-11-28``).

``local_weights`` moves that unwrapping to the graph's edge, once: each DTensor placeholder becomes a plain
placeholder for its local tensor, rebuilt into the same DTensor (mesh, placements, shape, stride) by
``DTensor.from_local`` as the graph's first use of it, which AOTAutograd traces away at compile time. The callable
it wraps reads ``_local_tensor`` off those arguments (an attribute each) before calling the compiled graph. The
placeholders keep their Dynamo sources, so weights stay static inputs (CUDA graphs do not copy them).

Dynamo also guards each DTensor's spec (mesh, placements) on every call, in Python (``DTENSOR_SPEC_MATCH``: 57
``DTensorSpec._check_equals`` a step at 8 layers, a quarter of the host's excess after the change above). The
callable checks the specs itself: the same spec object as at compile time (an identity test), else an equal one,
else an error that says so. ``SpecGuards``, the ``guard_filter_fn`` ``kvpass.compile`` gives ``torch.compile``,
then drops Dynamo's guard on a spec where the frame's compiled callables check it, and only there (a graph of the
frame that takes the DTensor unchecked keeps the guard).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from torch import fx

from kvpass.compiler.tp import dtensor_type

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec


def _rebuilder(mesh, placements: tuple, shape: tuple, stride: tuple):
    """A graph op: one input's local tensor as the DTensor it was taken from (traced away by AOTAutograd)."""

    def rebuild(local):
        return dtensor_type().from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    rebuild.__name__ = "kvpass_rebuild_dtensor"  # the FX code names it so (Dynamo's from_local is built alike)
    return rebuild


def local_weights(gm: fx.GraphModule, example_inputs: list):
    """``(example_inputs, wrap, undo)``: ``gm`` changed in place so that every DTensor input (of static size) is
    taken as its local tensor, the inputs to compile it with, ``wrap(compiled)`` (the compiled graph called with
    the DTensor arguments' local tensors, their specs checked; ``wrap(compiled).specs`` lists the specs it
    checks) and ``undo()``, which gives ``gm`` back as it was. Where no input is such a DTensor, the same
    ``example_inputs`` list, and ``wrap`` and ``undo`` do nothing."""
    dtensor = dtensor_type()
    idx = (
        []
        if dtensor is None
        else [
            i
            for i, x in enumerate(example_inputs)
            if isinstance(x, dtensor) and all(type(n) is int for n in (*x.shape, *x.stride()))
        ]
    )  # a weight's: a symbolic size stays as it was
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not idx or len(placeholders) != len(example_inputs):
        return example_inputs, lambda compiled: compiled, lambda: None
    inputs, done = list(example_inputs), []
    for i in idx:
        ph, d = placeholders[i], example_inputs[i]
        users = list(ph.users)
        with gm.graph.inserting_after(placeholders[-1]):
            whole = gm.graph.call_function(
                _rebuilder(d.device_mesh, tuple(d.placements), tuple(d.shape), tuple(d.stride())), (ph,)
            )
        for u in users:
            u.replace_input_with(ph, whole)
        done.append((ph, whole, {k: ph.meta[k] for k in ("example_value", "val") if k in ph.meta}))
        inputs[i] = d._local_tensor
        ph.meta.update({k: inputs[i] for k in done[-1][2]})
    gm.recompile()

    def undo():
        for ph, whole, meta in done:
            whole.replace_all_uses_with(ph)
            gm.graph.erase_node(whole)
            ph.meta.update(meta)
        gm.recompile()

    specs = [example_inputs[i]._spec for i in idx]
    return inputs, lambda compiled: _taking_locals(compiled, idx, specs), undo


def _taking_locals(compiled, idx: list[int], specs: list):
    """``compiled`` called with the arguments at ``idx`` replaced by their local tensors (Dynamo calls a
    backend's callable with the graph's arguments, unboxed), each argument's spec checked against the one it
    was compiled with (``specs``): the same object, or else equal to a copy taken now (as Dynamo's guard
    compares), or an error."""
    expected = [copy.deepcopy(s) for s in specs]

    def call(*args):
        args = list(args)
        for i, spec, want in zip(idx, specs, expected):
            a = args[i]
            if a._spec is not spec and not a._spec._check_equals(want, skip_shapes=True):
                raise RuntimeError(
                    f"kvpass: a tensor-parallel weight of this compiled graph (input {i}) changed its placement "
                    f"since it was compiled ({want.placements} on {want.mesh} -> {a._spec.placements} on "
                    f"{a._spec.mesh}); kvpass.compile checks the weights' placements itself instead of Dynamo's "
                    f"guards. Compile the model again after re-sharding it (torch._dynamo.reset())"
                )
            args[i] = a._local_tensor
        return compiled(*args)

    call.specs = specs
    return call


class SpecGuards:
    """A ``torch.compile`` ``guard_filter_fn``: keeps every guard but Dynamo's ``DTENSOR_SPEC_MATCH`` on a spec that
    the frame's compiled callables check themselves. Dynamo builds a frame's guards after the backend has compiled
    its graphs, so the backend notes each graph's DTensor specs as it compiles (``checked``: a callable of
    ``local_weights`` checks them; ``unchecked``: a graph that takes the DTensors as they are, compiled eagerly or
    after a fallback), and the filter, called next, drops the guard on a spec only when it was checked and no
    graph took it unchecked, then starts the next frame's notes. Specs are held while noted, so an identity is
    never reused."""

    def __init__(self) -> None:
        self.seen: dict[int, DTensorSpec] = {}
        self.bare: dict[int, DTensorSpec] = {}
        self.dropped = 0  # guards dropped so far, over every frame

    def checked(self, specs) -> None:
        self.seen.update((id(s), s) for s in specs)

    def unchecked(self, example_inputs) -> None:
        dtensor = dtensor_type()
        if dtensor is not None:
            self.bare.update((id(x._spec), x._spec) for x in example_inputs if isinstance(x, dtensor))

    def __call__(self, entries) -> list[bool]:
        keep = [
            not (
                e.guard_type == "DTENSOR_SPEC_MATCH"
                and e.has_value
                and self.seen.get(id(e.value)) is e.value
                and id(e.value) not in self.bare
            )
            for e in entries
        ]
        self.seen, self.bare = {}, {}
        self.dropped += keep.count(False)
        return keep

    def __repr__(self) -> str:
        return f"SpecGuards(dropped={self.dropped}, pending checked={len(self.seen)}, unchecked={len(self.bare)})"
