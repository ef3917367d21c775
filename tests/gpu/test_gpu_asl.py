"""GPU checks of layer-gated prefill (asl, asl_fullkv, fastkv, gemfilter, asl_2pass; marked ``gpu``).

* ``kvpass::layer_scores`` on CUDA (the window-scoring Triton kernel inside) equals its CPU reference
  at long context, and its peak memory stays far below the ``[heads, window, N]`` scores;
* a tiny Llama compiled by Inductor on CUDA with a forced selection layer generates the same tokens
  as the same policy on the CPU (eager compiler) and stores ``budget`` entries in every layer (the
  whole prompt before the selection layer for ``asl_fullkv``), in one or two passes;
* the sliding-window families (Gemma 3, Cohere 2) under Inductor on CUDA generate the CPU run's tokens,
  with the deeper sliding layers padded to the W - 1 entries HF's decode mask is sized for;
* a dynamic graph's segments are compiled once and serve every prompt length (no recompilation);
* the adaptive rule runs end to end under Inductor on CUDA and reports its layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpass
import kvpass.ops.lowerings  # noqa: F401  (torch.ops.kvpass and their CUDA implementations; `import kvpass` loads lazily)
from families import skip_uneven_layers_on_old_stacks
from test_asl import build, cache_lengths, prompt

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize(
    "n,h,hkv,d,dtype",
    [
        (32768, 32, 8, 128, torch.bfloat16),
        (131072, 32, 32, 64, torch.bfloat16),
        (4096, 8, 2, 64, torch.float16),
        (8192, 4, 4, 256, torch.float32),
    ],
)
def test_layer_scores_cuda_equals_reference(n, h, hkv, d, dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(1, h, 64, d, device=DEV, generator=g).to(dtype)  # only the last 32 rows are used
    k = torch.randn(1, hkv, n, d, device=DEV, generator=g).to(dtype)
    qf = torch.cat([torch.zeros(1, h, n - 64, d, device=DEV, dtype=dtype), q], 2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = torch.ops.kvpass.layer_scores(qf, k, None, d**-0.5, 0.0, 32)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < h * 32 * n * 4 / 4, f"{extra / 2**20:.1f} MiB: the [heads, window, N] scores were materialised"
    if n <= 32768:  # the CPU reference materialises [heads, window, N]: only at moderate lengths
        ref = torch.ops.kvpass.layer_scores(qf.cpu().float(), k.cpu().float(), None, d**-0.5, 0.0, 32)
        torch.testing.assert_close(got.cpu(), ref, atol=2e-2 * h, rtol=2e-2)
    # [B, H_kv, N] since the scores stay per KV head (tensor parallelism gathers them): every window query's row
    # sums to 1, so the whole is 32 queries x h heads
    torch.testing.assert_close(got.sum((1, 2)).cpu(), torch.full((1,), 32.0 * h), atol=1e-2 * h, rtol=1e-3)


def _run(model, ids, be, steps, dynamic=None):
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic)
    cache = DynamicCache(config=model.config)
    tokens = []
    with torch.no_grad():
        logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = fwd(
                input_ids=torch.tensor([[tokens[-1]]], device=ids.device), past_key_values=cache, use_cache=True
            ).logits[:, -1]
    return tokens, cache


@pytest.mark.parametrize(
    "policy,layer", [("fastkv", -1), ("asl", 2), ("asl_fullkv", 1), ("gemfilter", 2), ("asl_2pass", 2)]
)
def test_inductor_cuda_matches_cpu(policy, layer):
    if policy == "asl_fullkv":
        skip_uneven_layers_on_old_stacks(policy)
    model = build("llama", layers=6)
    ids = prompt(200, seed=3)
    kw = {} if policy == "gemfilter" else {"window": 16}
    cpu = kvpass.backend(policy, compiler="eager", budget=64, layer=layer, **kw)
    want, _ = _run(model, ids, cpu, 8)
    torch._dynamo.reset()
    gpu = kvpass.backend(policy, compiler="inductor", budget=64, layer=layer, **kw)
    got, cache = _run(model.to(DEV), ids.to(DEV), gpu, 8)
    assert got == want
    gate = layer if layer >= 0 else 3
    assert gpu.gate_info["selection_layer"] == gate and gpu.gate_info["kept"] == 64
    assert gpu.gate_info["passes"] == (2 if policy in ("gemfilter", "asl_2pass") else 1)
    for i, lay in enumerate(cache.layers):
        full = policy == "asl_fullkv" and i <= gate
        assert lay.keys.shape[-2] == (200 if full else 64) + 8
    assert gpu.state.layer(5).pos.device.type == DEV


@pytest.mark.parametrize(
    "family,policy,layer,budget", [("gemma3", "asl", 2, 5), ("gemma3", "gemfilter", 2, 5), ("cohere2", "fastkv", 3, 40)]
)
def test_sliding_family_inductor_cuda_matches_cpu(family, policy, layer, budget):
    model = build(family, layers=6)
    ids = prompt(200, seed=5)
    kw = {} if policy == "gemfilter" else {"window": 2}
    cpu = kvpass.backend(policy, compiler="eager", budget=budget, layer=layer, **kw)
    want, _ = _run(model, ids, cpu, 8)
    torch._dynamo.reset()
    gpu = kvpass.backend(policy, compiler="inductor", budget=budget, layer=layer, **kw)
    got, cache = _run(model.to(DEV), ids.to(DEV), gpu, 8)
    assert got == want
    assert gpu.gate_info["selection_layer"] == layer and gpu.gate_info["kept"] == budget
    assert [lay.keys.shape[-2] for lay in cache.layers] == cache_lengths(model, budget + 8)


def test_dynamic_graph_compiles_segments_once():
    model = build("llama", layers=6).to(DEV)
    be = kvpass.backend("fastkv", compiler="inductor", budget=64, window=16)
    graphs = None
    for n in (160, 300, 517):
        _run(model, prompt(n, seed=n).to(DEV), be, 2, dynamic=True)
        assert be.gate_info["length"] == n and be.gate_info["kept"] == 64
        graphs = graphs if graphs is not None else len(be.reports)
    assert len(be.reports) == graphs  # no graph compiled for the later lengths
    # (Inductor may restart Dynamo's analysis once while compiling, so count the last gated graph)
    gated = [r.gate for r in be.reports if r.gate is not None][-1]
    assert all(s.compiled is not None for s in gated.segments)
    assert not gated.compiled  # no segment compiled per length


def test_adaptive_rule_under_inductor():
    model = build("llama", layers=9, seed=5).to(DEV)
    be = kvpass.backend("asl", compiler="inductor", budget=64, window=16, tau=1.0)
    _run(model, prompt(300, seed=7).to(DEV), be, 3)
    info = be.gate_info
    assert info["candidates"] == [3, 4, 5, 6, 7] and set(info["ratios"]) <= set(info["candidates"])
    assert info["selection_layer"] is None or info["kept"] == 64
