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

# pytest-xdist runs a worker per core (-n auto) and torch gives each worker a thread per core: the machine is
# oversubscribed, and the tiny test models gain little from intra-op threads. One core's share per worker, on a
# 2-core machine of CI's size: tests/test_requests.py + test_fastpath.py 126 -> 111 s, test_hostile.py +
# test_eviction_models.py 126 -> 109 s, ci/floor.sh 602 -> 552 s; the whole main run within its noise (1,697 s
# before, 1,738 s after: the tensor-parallel ranks and the GGUF models use the cores either way).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # All HF models share wrapper code objects; without a reset, tests pile up cache entries
    # until Dynamo's recompile limit turns fullgraph compiles into hard failures.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    # pytest's monkeypatch.setattr on a torch config module deletes the setting when it undoes (it read the value
    # through the module's __getattr__): every later test that reads it failed with an AttributeError. Patch
    # torch's settings with their own config.patch; this fails the test that did not
    assert hasattr(torch._dynamo.config, "recompile_limit"), \
        "a test deleted torch._dynamo.config.recompile_limit: use torch._dynamo.config.patch, not monkeypatch"


# the longest files start first, so that no worker is left running one of them alone at the end (--dist loadfile)
_FIRST = ("test_tensor_parallel.py", "test_slot_cache.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _FIRST)   # stable: the order within each group stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
