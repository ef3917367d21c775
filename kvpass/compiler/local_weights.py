"""A tensor-parallel graph's DTensor inputs handed to Inductor as their local tensors.

Under transformers' tensor-parallel plan the projections' weights are DTensors, and Dynamo passes them to the
compiled graph on every call. AOTAutograd's runtime wrapper then unwraps each one into its local tensor in
Python (``runtime_unwrap_tensor_subclasses``: 57 weights at 8 layers of the Llama-3.1-8B shape), on every decode
step. On two H200s a rank's host took 1.9-2.1 ms a step at 8 layers against 0.4-0.8 on one GPU, as long as the
device's step or longer, so a small-cache policy decoded slower on two GPUs than on one
(``bench/results/tp_h200x2_2026-11-28``, call H8).

``local_weights`` moves that unwrapping to the graph's edge, once: each DTensor placeholder becomes a plain
placeholder for its local tensor, rebuilt into the same DTensor (mesh, placements, shape, stride) by
``DTensor.from_local`` as the graph's first use of it, which AOTAutograd traces away at compile time. The callable
it wraps reads ``_local_tensor`` off those arguments (an attribute each) before calling the compiled graph. The
placeholders keep their Dynamo sources, so weights stay static inputs (CUDA graphs do not copy them).
"""

from __future__ import annotations

from torch import fx

from kvpass.compiler.tp import dtensor_type


def _rebuilder(mesh, placements: tuple, shape: tuple, stride: tuple):
    """A graph op: one input's local tensor as the DTensor it was taken from (traced away by AOTAutograd)."""
    def rebuild(local):
        return dtensor_type().from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    rebuild.__name__ = "kvpass_rebuild_dtensor"   # the FX code names it so (Dynamo's from_local is built alike)
    return rebuild


def local_weights(gm: fx.GraphModule, example_inputs: list):
    """``(example_inputs, wrap, undo)``: ``gm`` changed in place so that every DTensor input (of static size) is
    taken as its local tensor, the inputs to compile it with, ``wrap(compiled)`` (the compiled graph called with
    the DTensor arguments' local tensors) and ``undo()``, which gives ``gm`` back as it was. Where no input is
    such a DTensor, the same ``example_inputs`` list, and ``wrap`` and ``undo`` do nothing."""
    dtensor = dtensor_type()
    idx = [] if dtensor is None else [
        i for i, x in enumerate(example_inputs) if isinstance(x, dtensor)
        and all(type(n) is int for n in (*x.shape, *x.stride()))]   # a weight's: a symbolic size stays as it was
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if not idx or len(placeholders) != len(example_inputs):
        return example_inputs, lambda compiled: compiled, lambda: None
    inputs, done = list(example_inputs), []
    for i in idx:
        ph, d = placeholders[i], example_inputs[i]
        users = list(ph.users)
        with gm.graph.inserting_after(placeholders[-1]):
            whole = gm.graph.call_function(_rebuilder(d.device_mesh, tuple(d.placements), tuple(d.shape),
                                                      tuple(d.stride())), (ph,))
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
    return inputs, lambda compiled: _taking_locals(compiled, idx), undo


def _taking_locals(compiled, idx: list[int]):
    """``compiled`` called with the arguments at ``idx`` replaced by their local tensors (Dynamo calls a
    backend's callable with the graph's arguments, unboxed)."""
    def call(*args):
        args = list(args)
        for i in idx:
            args[i] = args[i]._local_tensor
        return compiled(*args)
    return call
