"""The cost of a decode step's all-reduces under tensor parallelism: 64 all_reduces of one token's hidden state
(4096 bf16, two per layer of a 32-layer model) launched eagerly and replayed as one CUDA graph, per rank.

    torchrun --nproc_per_node 2 bench/probes/allreduce_latency.py
"""

import json
import os
import time

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)


def step():
    for _ in range(64):
        dist.all_reduce(x)


for _ in range(5):
    step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    step()
torch.cuda.synchronize()
eager = (time.perf_counter() - t) / 20
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    step()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    step()
for _ in range(5):
    g.replay()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    g.replay()
torch.cuda.synchronize()
graph = (time.perf_counter() - t) / 20
if dist.get_rank() == 0:
    print(
        json.dumps(
            {
                "all_reduces_per_step": 64,
                "eager_ms": eager * 1e3,
                "cuda_graph_ms": graph * 1e3,
                "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            }
        ),
        flush=True,
    )
dist.destroy_process_group()
