"""Requests admitted into a running batch on CUDA: ``kvpass.RequestQueue`` under ``kvpass.compile``'s
default mode (Inductor, the decode step a CUDA graph) gives every request of many lengths, in a batch of fewer
rows than requests, the tokens the same policy gives it alone under the eager compiler; the batch's decode
step is compiled once and replayed while rows are refilled."""

from __future__ import annotations

import pytest
import torch
from test_gpu_slot_cache import model

import kvpass

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

CASES = [
    ("full", {}),
    ("streamingllm", dict(budget=64, sinks=4)),
    ("snapkv", dict(budget=64, window=8)),
    ("pyramidkv", dict(budget=64, window=8)),
    ("quest", dict(budget=64, dense_layers=1)),
    ("raas", dict(budget=64)),
    ("h2o", dict(budget=64)),
    ("asl", dict(budget=64, window=8, layer=1)),
    ("art", dict(tau=0.5, phi=0.5, patience=1)),
]


@pytest.mark.parametrize("policy,params", CASES, ids=[c[0] for c in CASES])
def test_queue_under_cuda_graphs_gives_every_request_its_tokens_alone(policy, params):
    lengths, news = (90, 151, 120, 200, 75, 133), (40, 12, 30, 25, 8, 33)
    prompts = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).cuda() for n in lengths]
    ref = model()
    torch._dynamo.reset()
    kvpass.compile(ref, policy, compiler="eager", **params)
    want = [
        ref.generate(p[None], max_new_tokens=n, min_new_tokens=n, do_sample=False)[0] for p, n in zip(prompts, news)
    ]
    m = model()
    be = kvpass.compile(m, policy, **params)
    queue = kvpass.RequestQueue(m, max_batch=3, eos_token_id=None)
    for p, n in zip(prompts, news):
        queue.add(p, max_new_tokens=n)
    got = queue.run(progress=False)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [r.phase for r in be.reports] == ["prefill", "decode"], [r.phase for r in be.reports]
    assert be.reports[-1].cudagraphs
