"""GPU checks of chunk fusion (marked ``gpu``; skipped without CUDA).

* the RoPE rotation kernel equals its reference at real sizes (layers x KV heads up to 256 rows,
  16k-32k positions, head_dim 64/128, partial rotary, fp32/bf16) and through ``kvpass::rope_rotate``;
* the scatter kernel equals its reference at real sizes and through ``kvpass::scatter_rows``;
* ``kvpass::attention_slots`` (the recompute pass's attention,
  ``kvpass.kernels.slot_attention``) on CUDA equals its reference;
* under ``torch.compile`` Inductor launches the three kernels itself (``triton_op``);
* ``ChunkFusion`` on CUDA with Inductor: a3 with r = 1 equals a full prefill, and a3 at r = 0.15
  on a longer request keeps the cache's shape and the store's entries on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import DynamicCache

import kvpass
import kvpass.ops.lowerings  # noqa: F401  (torch.ops.kvpass and their CUDA implementations; `import kvpass` loads lazily)
from families import build
from kvpass.kernels import rope_rotate as K
from kvpass.policies.chunk_fusion.ops import attention_slots_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _tables(length, r, scale=1.0):
    pos = torch.arange(length, device=DEV, dtype=torch.float32)
    inv = 1.0 / (500000.0 ** (torch.arange(0, r, 2, device=DEV, dtype=torch.float32) / r))
    ang = pos[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos() * scale, emb.sin() * scale


@pytest.mark.parametrize("m,length,d,r", [(256, 16384, 128, 128), (128, 32768, 64, 64), (96, 4099, 128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_kernel_equals_reference(m, length, d, r, dtype):
    x = torch.randn(m, length, d, device=DEV, generator=torch.Generator(device=DEV).manual_seed(m)).to(dtype)
    cos, sin = _tables(length, r, 1.1)
    ref = K.rotate_reference(x, cos, sin)
    out = K.rotate_triton(x, cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(torch.ops.kvpass.rope_rotate(x, cos, sin), out)
    back = K.rotate_triton(out.float(), *K.rope_inverse_tables(cos, sin))
    torch.testing.assert_close(back, x.float(), atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=1e-3)


@pytest.mark.parametrize("m,n,k,d", [(8, 32768, 5000, 128), (256, 4096, 600, 64), (16, 1000, 1000, 128)])
def test_scatter_kernel_equals_reference(m, n, k, d):
    g = torch.Generator(device=DEV).manual_seed(n)
    dst = torch.randn(m, n, d, device=DEV, generator=g, dtype=torch.bfloat16)
    idx = torch.randperm(n, device=DEV, generator=g)[:k]
    src = torch.randn(m, k, d, device=DEV, generator=g, dtype=torch.bfloat16)
    out = K.scatter_triton(dst, idx, src)
    assert torch.equal(out, K.scatter_reference(dst, idx, src))
    assert torch.equal(torch.ops.kvpass.scatter_rows(dst, idx, src), out)


@pytest.mark.parametrize("h,hkv,lq,lk,d", [(32, 8, 4900, 32800, 128), (32, 8, 700, 4200, 64), (8, 8, 33, 1000, 128)])
def test_attention_slots_cuda_equals_reference(h, hkv, lq, lk, d):
    """The recompute pass's attention (the Triton slot-attention kernel) at real sizes."""
    g = torch.Generator(device=DEV).manual_seed(lq)
    q = torch.randn(1, h, lq, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, lk, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, lk, d, device=DEV, generator=g, dtype=torch.bfloat16)
    q_pos = torch.randperm(lk, device=DEV, generator=g)[:lq].sort().values[None]
    got = torch.ops.kvpass.attention_slots(q, k, v, q_pos, d**-0.5, 0.0)
    rows = slice(0, min(lq, 512))  # the fp32 reference materialises [H, Lq, Lk] scores: check a slice
    want = attention_slots_reference(q[:, :, rows], k, v, q_pos[:, rows], d**-0.5, 0.0)
    torch.testing.assert_close(got[:, :, rows].float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.isfinite(got).all()


def test_inductor_launches_the_kernels():
    x = torch.randn(64, 2048, 128, device=DEV, dtype=torch.bfloat16)
    cos, sin = _tables(2048, 128)
    idx = torch.arange(0, 2048, 7, device=DEV)

    q_pos = idx[None]

    def f(x, cos, sin, idx, q_pos):
        y = torch.ops.kvpass.rope_rotate(x, cos, sin)
        kv = torch.ops.kvpass.scatter_rows(y, idx, x[:, : idx.numel()] * 2)
        att = torch.ops.kvpass.attention_slots(
            kv[None, :32, : idx.numel()], kv[None, :8], kv[None, 8:16], q_pos, 0.08, 0.0
        )
        return kv, att

    (got, att), codes = run_and_get_code(torch.compile(f, backend="inductor"), x, cos, sin, idx, q_pos)
    assert any("_kvpass_rope_kernel" in c for c in codes), "Inductor did not launch the rotation kernel"
    assert any("_kvpass_scatter_kernel" in c for c in codes), "Inductor did not launch the scatter kernel"
    assert any("_kvpass_slot_attention_kernel" in c for c in codes), "Inductor did not launch slot attention"
    want = K.scatter_reference(K.rotate_reference(x, cos, sin), idx, x[:, : idx.numel()] * 2)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    want_att = attention_slots_reference(
        want[None, :32, : idx.numel()], want[None, :8], want[None, 8:16], q_pos, 0.08, 0.0
    )
    torch.testing.assert_close(att.float(), want_att.float(), atol=2e-2, rtol=2e-2)


def _request(n_chunks, chunk, seed=0):
    g = torch.Generator().manual_seed(seed)
    system = [1] + torch.randint(3, 90, (7,), generator=g).tolist()
    chunks = [torch.randint(3, 90, (chunk,), generator=g).tolist() for _ in range(n_chunks)]
    return system, chunks, torch.randint(3, 90, (9,), generator=g).tolist()


def test_a3_ratio_one_equals_full_prefill_inductor(tmp_path):
    model = build("llama").to(DEV)
    system, chunks, q = _request(4, 40)
    ids = torch.tensor([system + sum(chunks, []) + q], device=DEV)
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path, model), "a3", ratio=1.0)
    logits, fused = fusion.prefill(chunks, q, system=system)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    for got, want in zip(fused.cache.layers, cache.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)


def test_a3_long_request_on_cuda(tmp_path):
    model = build("llama", dtype=torch.bfloat16).to(DEV)
    model.config.max_position_embeddings = 8192
    system, chunks, q = _request(8, 512, seed=1)
    store = kvpass.ChunkStore(tmp_path, model)
    fusion = kvpass.ChunkFusion(model, store, "a3")
    logits, fused = fusion.prefill(chunks, q, system=system)
    graphs = len(fusion.backend.reports)
    logits, fused = fusion.prefill(chunks, q, system=system)  # every segment from the memory tier
    assert len(fusion.backend.reports) == graphs  # and no new graph
    n = len(system) + 8 * 512 + len(q)
    assert fused.sources == {"memory": 9} and fused.recompute.numel() == -(-15 * 8 * 512 // 100)
    assert all(layer.keys.shape[-2] == n and layer.keys.device.type == "cuda" for layer in fused.cache.layers)
    assert torch.isfinite(logits).all()
    phases = {r.phase for r in fusion.backend.reports}
    assert "prefill" in phases and "decode" in phases  # selection, recompute and decode graphs


def test_a3_evict_on_cuda_inductor(tmp_path):
    """a3+evict under Inductor: capacity above the request equals a3; at C = 1024 on a 4k request every
    layer stores C - 1 entries after fusion, and the compiled decode continues from the request's
    length (equal to HF on a copy of the compacted cache with explicit positions)."""
    import copy

    model = build("llama").to(DEV)
    system, chunks, q = _request(4, 40, seed=2)
    store = kvpass.ChunkStore(tmp_path, model)
    big = kvpass.ChunkFusion(model, store, "a3+evict", capacity=8192)
    logits, _ = big.prefill(chunks, q, system=system)
    ref, _ = kvpass.ChunkFusion(model, store, "a3").prefill(chunks, q, system=system)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

    model = build("llama", dtype=torch.bfloat16).to(DEV)
    model.config.max_position_embeddings = 8192
    system, chunks, q = _request(8, 512, seed=3)
    fusion = kvpass.ChunkFusion(model, kvpass.ChunkStore(tmp_path / "b", model), "a3+evict", capacity=1024)
    fused = fusion.prepare(chunks, q, system=system)
    assert {layer.keys.shape[-2] for layer in fused.cache.layers} == {1023}
    n = len(system) + 8 * 512 + len(q)
    ref_cache = copy.deepcopy(fused.cache)
    last = torch.tensor([[q[-1]]], device=DEV)
    with torch.no_grad():
        mine = fusion.forward(input_ids=last, past_key_values=fused.cache, use_cache=True).logits
        want = model(
            input_ids=last, past_key_values=ref_cache, use_cache=True, position_ids=torch.tensor([[n - 1]], device=DEV)
        ).logits
    torch.testing.assert_close(mine.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("policy,params", [("a3", {}), ("a3+evict", dict(capacity=1024))])
def test_slot_decode_cuda_graphs_equal_dynamic_cache(tmp_path, policy, params):
    """``cache="slot"`` under Inductor: the fused entries loaded into a SlotCache decode 64 greedy steps
    as one CUDA graph (``decode_forward``, mode="reduce-overhead"), the same tokens as the DynamicCache
    path and logits within bf16 tolerance; a3+evict's slots hold 1023 kept entries + 1 + 256 new tokens."""
    model = build("llama", dtype=torch.bfloat16).to(DEV)
    model.config.max_position_embeddings = 8192
    system, chunks, q = _request(8, 512, seed=4)
    store = kvpass.ChunkStore(tmp_path, model)
    runs, tokens = [], None
    for cache in ("dynamic", "slot"):  # the slot run is fed the DynamicCache run's greedy tokens
        fusion = kvpass.ChunkFusion(model, store, policy, cache=cache, **params)
        with torch.no_grad():
            logits, fused = fusion.prefill(chunks, q, system=system)
            out = [logits.clone()]  # a CUDA graph's output is overwritten by its next replay
            for i in range(64):
                torch.compiler.cudagraph_mark_step_begin()
                nxt = out[-1].argmax(-1, keepdim=True) if tokens is None else tokens[i]
                step = fusion.decode_forward(input_ids=nxt, past_key_values=fused.cache, use_cache=True)
                out.append(step.logits[:, -1].clone())
        out = torch.stack(out)
        tokens = out.argmax(-1, keepdim=True) if tokens is None else tokens
        runs.append((fusion, fused, out))
    (_, _, ref), (fusion, fused, got) = runs
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=5e-2)
    decode = [r for r in fusion.backend.reports if r.phase == "decode" and r.slots]
    assert len(decode) == 1 and decode[0].cudagraphs  # the last question token and every step
    if policy == "a3+evict":
        assert fused.cache.capacity == 1023 + 1 + 256
