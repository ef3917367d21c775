"""GPU checks of ART decode attention (marked ``gpu``; skipped without CUDA).

* the Triton kernel equals its reference at real sizes (batch up to 128, context up to 128k,
  head_dim 64/128/256), contiguous and paged, split-KV and ART;
* a function calling ``kvpass::decode_attention`` compiled by Inductor launches the kvpass Triton
  kernel from its generated code;
* a compiled model with ``art`` and thresholds at 0 equals ``full`` and the uncompiled model.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kvpass
import kvpass.ops.lowerings  # noqa: F401  (torch.ops.kvpass and their CUDA implementations; `import kvpass` loads lazily)
from families import build
from kvpass.kernels import decode_attention as K

pytestmark = pytest.mark.gpu
DEV = "cuda"


def tensors(b, h, hkv, length, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, h, 1, d, device=DEV, generator=g)
    k = torch.randn(b, hkv, length, d, device=DEV, generator=g)
    v = torch.randn(b, hkv, length, d, device=DEV, generator=g)
    # concentrated attention so that ART can stop: sinks aligned with the group's mean query
    k[:, :, :4] += 3 * q.view(b, hkv, h // hkv, d).mean(2, keepdim=True)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize(
    "b,h,hkv,length,d",
    [
        (1, 32, 8, 131072, 128),
        (128, 32, 8, 4096, 128),
        (8, 8, 1, 16384, 256),
        (64, 9, 3, 8192, 64),
        (3, 4, 4, 1000, 64),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_read_equals_reference(b, h, hkv, length, d, dtype):
    q, k, v = tensors(b, h, hkv, length, d, dtype)
    ref, vis_r = K.decode_attention_reference(q, k, v)
    for split in (None, False):
        out, vis = K.decode_attention_triton(q, k, v, split=split)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(vis, vis_r)


@pytest.mark.parametrize("b,h,hkv,length,d", [(16, 32, 8, 32768, 128), (64, 9, 3, 8192, 64), (4, 8, 2, 16384, 256)])
@pytest.mark.parametrize("chunk", [4, 8])
def test_termination_equals_reference_fp32(b, h, hkv, length, d, chunk):
    """ART decisions in fp32 (ieee dots): the kernel stops where the reference stops, and the blocks
    a chunk reads past the stop are discarded."""
    q, k, v = tensors(b, h, hkv, length, d, torch.float32, seed=1)
    kw = dict(tau=1e-2, phi=1e-3, patience=3, block=64)
    out, vis = K.decode_attention_triton(q, k, v, chunk=chunk, **kw)
    ref, vis_r = K.decode_attention_reference(q, k, v, **kw)
    same = vis == vis_r
    assert same.float().mean() >= 0.99, (vis, vis_r)
    assert (vis < vis_r.max()).any(), "nothing terminated early: the case does not test ART"
    rows = same.repeat_interleave(h // hkv, 1)
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("b,h,hkv,length,d", [(1, 32, 8, 131072, 128), (16, 32, 8, 32768, 128), (2, 9, 3, 8192, 64)])
@pytest.mark.parametrize("parallel", [True, False])
def test_horizon_equals_reference_fp32(b, h, hkv, length, d, parallel):
    """The horizon launch, read serially or one block per program and scanned, stops where the
    sequential reference with the same horizon stops and otherwise reads everything."""
    q, k, v = tensors(b, h, hkv, length, d, torch.float32, seed=2)
    kw = dict(tau=1e-2, phi=1e-3, patience=3, block=64, horizon=16)
    out, vis = K.decode_attention_triton(q, k, v, parallel_horizon=parallel, **kw)
    ref, vis_r = K.decode_attention_reference(q, k, v, **kw)
    same = vis == vis_r
    assert same.float().mean() >= 0.99, (vis, vis_r)
    assert (vis_r < -(-length // 64)).any(), "nothing stopped inside the horizon: the case does not test it"
    rows = same.repeat_interleave(h // hkv, 1)
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-4, rtol=1e-4)


def test_paged_real_size():
    b, pages, page = 32, 256, 16
    g = torch.Generator(device=DEV).manual_seed(2)
    pool = b * pages + 7
    q = torch.randn(b, 32, 1, 128, device=DEV, generator=g, dtype=torch.bfloat16)
    kp = torch.randn(pool, 8, page, 128, device=DEV, generator=g, dtype=torch.bfloat16)
    vp = torch.randn(pool, 8, page, 128, device=DEV, generator=g, dtype=torch.bfloat16)
    table = torch.randperm(pool, device=DEV, generator=g)[: b * pages].view(b, pages).int()
    kv_len = torch.randint(1, pages * page + 1, (b,), device=DEV, generator=g)
    out, vis = K.decode_attention_triton(q, kp, vp, page_table=table, kv_len=kv_len)
    ref, vis_r = K.decode_attention_reference(q, kp, vp, page_table=table, kv_len=kv_len)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(vis, vis_r)


def test_inductor_launches_the_kvpass_kernel():
    q, k, v = tensors(4, 8, 2, 3000, 64, torch.bfloat16)

    def f(q, k, v):
        out, _ = torch.ops.kvpass.decode_attention(
            q * 2, k, v, None, None, None, None, None, None, 0.125, 0.0, 0, 1e-5, 1e-3, 5, 64, 1, 0, 0
        )
        return out + 1

    got, codes = run_and_get_code(torch.compile(f, backend="inductor"), q, k, v)
    assert any("_kvpass_decode_kernel" in c for c in codes), "Inductor did not launch the kvpass kernel"
    want = f(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_compiled_art_without_termination_equals_full(family):
    model = build(family, "sdpa").to(DEV)
    ids = torch.randint(3, 90, (2, 300), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    be = kvpass.backend("art", tau=0.0, phi=0.0)  # real Inductor
    model.forward = torch.compile(type(model).forward.__get__(model), backend=be, fullgraph=True)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-3, rtol=1e-3)
    assert any(r.phase == "decode" and r.rewritten for r in be.reports)
