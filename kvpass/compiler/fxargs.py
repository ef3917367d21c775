"""Reading a call's arguments in an FX graph, whether they were passed by position or by keyword."""

from __future__ import annotations

from typing import Any

from torch import fx


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument ``name`` of the call ``node``: its keyword if given, else its ``index``-th positional
    argument if there are that many, else ``default``."""
    if name in node.kwargs:
        return node.kwargs[name]
    if len(node.args) > index:
        return node.args[index]
    return default


def leading(node: fx.Node, names: tuple[str, ...]) -> list[Any]:
    """The call's first arguments, ``names`` in schema order, each by keyword or by position (``arg``)."""
    return [arg(node, i, name) for i, name in enumerate(names)]
