"""Every ``kvpass::`` operator by name: the one registry.

A module that defines operators registers them here (``register(name=op, ...)``): the core operators
(``kvpass.ops``), the SlotCache's (``kvpass.cache.slots``), a policy family's (``kvpass.policies.pages.ops``,
``kvpass.policies.chunk_fusion.ops``) and the compiler's position shift (``kvpass.compiler.positions``). It sits
in the lowest layer so that any of them can extend it; ``tests/test_ops.py`` checks that it holds every operator
the package defines and that each has an ``opcheck`` test. Graphs call the operators as ``torch.ops.kvpass.*``;
``tests/test_layout.py`` checks that no layer calls one a higher layer defines.
"""

from __future__ import annotations

OPS: dict[str, object] = {}


def register(**ops: object) -> None:
    """Add operators by name; a name already taken by another operator is an error."""
    for name, op in ops.items():
        if OPS.get(name, op) is not op:
            raise ValueError(f"kvpass operator {name!r} is registered twice")
        OPS[name] = op
