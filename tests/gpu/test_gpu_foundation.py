"""GPU checks of the foundation (marked ``gpu``; skipped without CUDA).

* the CUDA implementations of the attention operators equal their references at real sizes;
* compiled-with-``full`` (real Inductor) equals the uncompiled model per family, and Inductor's
  output code calls the kvpass operators;
* ``streamingllm`` generates the same tokens as a hand-evicting reference on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import DynamicCache

import kvpass
from families import build
from kvpass.ops import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, attention_pos_reference, attention_reference, lowerings

FLASH_CAUSAL = lowerings._flash_causal

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "b,h,hkv,lq,lk,d",
    [
        (1, 32, 8, 1, 8192, 128),
        (4, 16, 4, 1, 4096, 64),
        (2, 8, 8, 512, 512, 128),
        (1, 12, 4, 64, 2048, 64),
        (2, 32, 8, 300, 4396, 128),
    ],
)
def test_attention_cuda_matches_reference(dtype, b, h, hkv, lq, lk, d, monkeypatch):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(b, h, lq, d, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(b, hkv, lk, d, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(b, hkv, lk, d, device=DEV, dtype=dtype, generator=g)
    mask = torch.rand(b, 1, lq, lk, device=DEV, generator=g) > 0.2
    mask[0, 0, 0] = False  # a fully masked row must give zeros
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=2e-4, rtol=2e-4)
    # no causal mask, then the KV-cache one (bottom-right: several tokens after a cache take flash attention's
    # causal kernel in half precision, counted)
    flash = []
    monkeypatch.setattr(lowerings, "_flash_causal", lambda *a: flash.append(1) or FLASH_CAUSAL(*a))
    for causal, m in [
        (CAUSAL_NONE, None),
        (CAUSAL_NONE, mask),
        (CAUSAL_BOTTOM_RIGHT, None),
        (CAUSAL_BOTTOM_RIGHT, mask),
    ]:
        got = torch.ops.kvpass.attention(q, k, v, m, d**-0.5, causal, 0.0)
        ref = attention_reference(q, k, v, m, d**-0.5, causal, 0.0)
        torch.testing.assert_close(got, ref, **tol)
    assert len(flash) == (dtype != torch.float32 and 1 < lq < lk)
    q_pos = (lk - lq + torch.arange(lq, device=DEV)).expand(b, lq)
    kv_pos = torch.arange(lk, device=DEV).expand(b, hkv, lk).clone()
    kv_pos[:, :, :3] = -1
    got = torch.ops.kvpass.attention_pos(q, k, v, q_pos, kv_pos, d**-0.5, 0.0, 1024)
    ref = attention_pos_reference(q, k, v, q_pos, kv_pos, d**-0.5, 0.0, 1024)
    torch.testing.assert_close(got, ref, **tol)


FAMILIES = ["llama", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox", "olmo2", "cohere2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_inductor_matches_eager(family):
    attn = "eager" if family == "gemma2" else "sdpa"
    model = build(family, attn).to(DEV)
    be = kvpass.backend("full")
    fwd = torch.compile(model.forward, backend=be, fullgraph=True)
    ids = torch.randint(3, 90, (2, 24), device=DEV)
    with torch.no_grad():
        c_ref, c_got = DynamicCache(config=model.config), DynamicCache(config=model.config)
        ref = model(input_ids=ids, past_key_values=c_ref, use_cache=True).logits
        got, codes = run_and_get_code(lambda: fwd(input_ids=ids, past_key_values=c_got, use_cache=True).logits)
        torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
        nxt = ref[:, -1:].argmax(-1)
        for _ in range(3):
            r = model(input_ids=nxt, past_key_values=c_ref, use_cache=True).logits
            g = fwd(input_ids=nxt, past_key_values=c_got, use_cache=True).logits
            torch.testing.assert_close(g, r, atol=1e-3, rtol=1e-3)
            nxt = r[:, -1:].argmax(-1)
    assert any("kvpass.attention" in c for c in codes), "Inductor output does not call the kvpass op"
    assert all(r.rewritten == model.config.num_hidden_layers for r in be.reports if r.sites)


def test_streamingllm_generate_on_gpu():
    from test_streaming import BUDGET, SINKS, reference_greedy

    model = build("llama").to(DEV)
    ids = torch.randint(3, 90, (1, 40), device=DEV)
    cpu_ref, _ = reference_greedy(model, ids, steps=16)
    be = kvpass.backend("streamingllm", budget=BUDGET, sinks=SINKS)
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    out = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert out[0, ids.shape[1] :].tolist() == cpu_ref
    assert max(st.stored for st in be.state.layers.values()) == BUDGET
