"""Tensor parallelism on two GPUs (NCCL): ``tests/test_tensor_parallel.py``'s checks with each rank on its GPU.

The same worker (``tests/tp_worker.py --device cuda``) generates with every plain policy on a DynamicCache
and a kvpass.SlotCache, split over two GPUs (fp32, so one process and two ranks differ only in rounding) and
on one GPU; the checks are those of the CPU test, imported. Needs two GPUs (nvidia-h200-x2 / h100-x2); run
with ``NCCL_NVLS_ENABLE=0``.
"""

from __future__ import annotations

import pytest
import torch

import test_tensor_parallel as cpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module", params=cpu.FAMILIES)
def ranks(request, tmp_path_factory):
    return cpu.two_ranks(tmp_path_factory.mktemp(f"tp_gpu_{request.param}"), request.param, "cuda")


test_two_ranks_decide_as_one_process = cpu.test_two_ranks_decide_as_one_process
test_gathers_only_where_decisions_span_heads = cpu.test_gathers_only_where_decisions_span_heads
test_inductor_compiles_the_gathers = cpu.test_inductor_compiles_the_gathers
test_chunk_fusion_on_two_ranks_fuses_as_one_process = cpu.test_chunk_fusion_on_two_ranks_fuses_as_one_process
test_explain_shows_the_local_heads_and_the_gathers = cpu.test_explain_shows_the_local_heads_and_the_gathers
test_kvpass_compile_on_two_ranks_compiles_once_for_every_length = (
    cpu.test_kvpass_compile_on_two_ranks_compiles_once_for_every_length
)
