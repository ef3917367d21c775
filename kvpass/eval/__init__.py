"""Evaluation harness: run policies over tasks on a real model and compare them with ``full``.

The runner's names are imported on first use, so ``kvpass.eval.models`` and ``kvpass.eval.tasks`` (what
the command line checks before a model loads) do not import the compiler or torch.
"""

from __future__ import annotations

import importlib

__all__ = ["compare", "Runner", "PolicyResult", "TaskResult", "cache_bytes"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("kvpass.eval.runner"), name)
    raise AttributeError(f"module 'kvpass.eval' has no attribute {name!r}")
