"""Shared test setup: tests/ on sys.path (for `families`), a fresh Dynamo per test, GPU marker."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's interpreter (tests call them directly, at tiny
# shapes). The switch is read when a kernel is decorated, so it is set before kvpass is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # All HF models share wrapper code objects; without a reset, tests pile up cache entries
    # until Dynamo's recompile limit turns fullgraph compiles into hard failures.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
