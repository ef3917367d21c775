"""Every ``kvpass::`` operator by name: the one registry.

A module that defines operators registers them here (``register(name=op, ...)``): the core operators
(``kvpass.ops``), the SlotCache's (``kvpass.cache.slots``), a policy family's (``kvpass.policies.pages.ops``,
``kvpass.policies.chunk_fusion.ops``) and the compiler's position shift (``kvpass.compiler.positions``). It sits
in the lowest layer so that any of them can extend it; ``tests/test_ops.py`` checks that it holds every operator
the package defines and that each has an ``opcheck`` test. Graphs call the operators as ``torch.ops.kvpass.*``;
``tests/test_layout.py`` checks that no layer calls one a higher layer defines.

kvpass is for inference: no operator has a gradient. Registering one gives it a backward that says so, by name
(torch's own says only that no formula was registered): the ``loss.backward()`` of a model compiled with kvpass
raises it, and under AOTAutograd (Inductor, ``aot_eager``), which traces the backward when the forward runs with
grad enabled, the forward does. Operators that write their inputs take no autograd formula (torch refuses one);
a loss reaches a functional operator (the attention) before any of them.
"""

from __future__ import annotations

from kvpass.errors import ConfigError

OPS: dict[str, object] = {}

NO_GRADIENT = (
    "kvpass: backward through kvpass::{name}: kvpass is for inference and its operators have no gradient. "
    "Run the compiled model under torch.no_grad() or torch.inference_mode() (generate() does), or, to "
    "train, compile the model without kvpass (torch.compile with its default backend)"
)


def register(**ops: object) -> None:
    """Add operators by name; a name already taken by another operator is an error."""
    for name, op in ops.items():
        if OPS.get(name, op) is not op:
            raise ValueError(f"kvpass operator {name!r} is registered twice")
        if name not in OPS:
            _inference_only(name, op)
        OPS[name] = op


def _inference_only(name: str, op) -> None:
    """Give a functional custom operator the backward that refuses with ``NO_GRADIENT``."""
    schema = getattr(getattr(op, "_opoverload", None), "_schema", None)
    if schema is None or schema.is_mutable or not hasattr(op, "register_autograd"):
        return

    def backward(ctx, *grads):
        raise ConfigError(NO_GRADIENT.format(name=name))

    op.register_autograd(backward)
