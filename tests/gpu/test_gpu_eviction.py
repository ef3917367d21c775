"""GPU checks of prefill eviction (marked ``gpu``; skipped without CUDA).

* the window-scoring kernel equals its reference at long context (up to 128k keys), for bf16 /
  fp16 / fp32, GQA ratios 1-8, head_dim 64-256, padding and softcapping, and its peak memory stays
  far below the ``[heads, window, N]`` fp32 scores the reference materialises; as kvzip's pass scorer
  (``reduce="max"``) at a 2k chunk;
* the accumulated-attention kernel (h2o's prefill scorer) equals its reference at 4k-16k prompts, bf16, GQA 4,
  with padding and softcapping, without materialising the ``[heads, L, N]`` scores;
* ``attention_lse`` gives flash attention's row statistics, and the one-pass scoring that takes them equals
  the two-pass scoring;
* the gather kernel equals ``torch.gather`` at real cache sizes, contiguous and strided;
* under Inductor, functions calling ``kvpass::window_scores`` / ``kvpass::gather_kv`` launch the
  kvpass Triton kernels;
* the four policies on a CUDA model compiled by Inductor keep what the reference picks (from the
  model's own attention, CPU fp32) and continue exactly like a hand-evicting reference.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import DynamicCache

import kvpass
import kvpass.ops.lowerings  # noqa: F401  (torch.ops.kvpass and their CUDA implementations; `import kvpass` loads lazily)
from families import build, skip_uneven_layers_on_old_stacks
from kvpass.kernels import accumulated_scores as A
from kvpass.kernels import gather as G
from kvpass.kernels import window_scores as W

pytestmark = pytest.mark.gpu
DEV = "cuda"


def window_case(b, h, hkv, w, n, d, dtype, pad=0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, h, w, d, device=DEV, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, device=DEV, generator=g).to(dtype)
    # a few keys aligned with the window's queries: peaked attention, as in real models
    hot = torch.randint(0, n, (16,), device=DEV, generator=g)
    k[:, :, hot] += 2 * q.view(b, hkv, h // hkv, w, d).mean((2, 3))[:, :, None].to(dtype)
    kv_pos = torch.arange(n, device=DEV).expand(b, hkv, n).clone()
    kv_pos[0, :, :pad] = -1
    return q, k, kv_pos, torch.arange(n - w, n, device=DEV).expand(b, w).contiguous()


@pytest.mark.parametrize(
    "b,h,hkv,w,n,d",
    [
        (1, 32, 8, 32, 32768, 128),
        (2, 8, 1, 32, 32768, 64),
        (1, 16, 16, 32, 8192, 128),
        (4, 12, 4, 17, 5000, 64),
        (1, 8, 2, 32, 16384, 256),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_window_kernel_equals_reference(b, h, hkv, w, n, d, dtype):
    q, k, kv_pos, q_pos = window_case(b, h, hkv, w, n, d, dtype, pad=n // 7)
    for softcap in (0.0, 30.0):
        want = W.window_scores_reference(q, k, kv_pos, q_pos, d**-0.5, softcap)
        got = torch.ops.kvpass.window_scores(q, k, kv_pos, q_pos, d**-0.5, softcap)
        # products of bf16/fp16 values are exact in the fp32 accumulator: only summation order differs
        torch.testing.assert_close(got, want, atol=1e-5 * w * (h // hkv), rtol=1e-3)
        # what the policies use: the same top-1024 per KV head (up to near-ties)
        top_g, top_w = got.topk(1024, -1).indices.sort(-1).values, want.topk(1024, -1).indices.sort(-1).values
        same = torch.isin(top_g.flatten(1), top_w.flatten(1)).float().mean()
        assert same > 0.99, same


def test_window_kernel_at_128k_without_materialising_scores():
    b, h, hkv, w, n, d = 1, 32, 8, 32, 131072, 128
    q, k, kv_pos, q_pos = window_case(b, h, hkv, w, n, d, torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = W.window_scores_triton(q, k, kv_pos, q_pos, d**-0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_scores = b * h * w * n * 4  # what the reference would hold, 512 MiB here
    assert extra < full_scores / 12, f"kernel used {extra / 2**20:.1f} MiB"  # ~20 MiB: block statistics
    want = W.window_scores_reference(q, k, kv_pos, q_pos, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5 * w * (h // hkv), rtol=1e-3)


def test_kvzip_pass_scores_by_the_kernel_equal_the_reference(monkeypatch):
    """A kvzip repeat pass at the 8B shape (a 2k chunk of a 32k prompt, bf16): the window kernel's most-attention
    scores (``reduce="max"``) against the reference's, and the same entries kept."""
    from kvpass.policies import make_policy
    from kvpass.policies.prefill import kvzip

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    policy = make_policy("kvzip", budget=1024, tokenizer=Tok())
    n, r = 32768, 2048 + 60
    q, k, _, _ = window_case(1, 32, 8, r, n + r, 128, torch.bfloat16)
    q = q * 128**-0.5
    got = policy.repeat_scores(q, k, None, (4096, 6144), 0.0)
    monkeypatch.setattr(kvzip, "window_scores_eager", W.window_scores_reference)
    want = policy.repeat_scores(q, k, None, (4096, 6144), 0.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-3)
    top_g, top_w = got.topk(256, -1).indices.sort(-1).values, want.topk(256, -1).indices.sort(-1).values
    assert torch.isin(top_g.flatten(1), top_w.flatten(1)).float().mean() > 0.99


@pytest.mark.parametrize("b,n,pad,softcap", [(1, 4096, 0, 0.0), (2, 8192, 1500, 0.0), (1, 16384, 0, 30.0)])
def test_accumulated_kernel_equals_reference(b, n, pad, softcap):
    h, hkv, d = 16, 4, 128
    g = torch.Generator(device=DEV).manual_seed(n)
    q = torch.randn(b, h, n, d, device=DEV, generator=g).to(torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device=DEV, generator=g).to(torch.bfloat16)
    k[:, :, :4] += 2 * q.view(b, hkv, h // hkv, n, d).mean((2, 3))[:, :, None]  # a few heavy hitters
    kv_pos = torch.arange(n, device=DEV).expand(b, hkv, n).clone()
    kv_pos[-1, :, :pad] = -1  # left padding, last row
    q_pos = torch.arange(n, device=DEV).expand(b, n).contiguous()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, d**-0.5, softcap)  # the Triton passes
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 4 * b * h * n * 4 + (8 << 20), f"kernel used {extra / 2**20:.1f} MiB"  # row statistics
    want = A.accumulated_scores_reference(q, k, kv_pos, q_pos, d**-0.5, softcap)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    real = got[-1, :, pad:]
    torch.testing.assert_close(real.sum(-1), torch.full_like(real[:, 0], (h // hkv) * (n - pad)), rtol=1e-4, atol=0)
    top_g, top_w = got.topk(1024, -1).indices.sort(-1).values, want.topk(1024, -1).indices.sort(-1).values
    assert torch.isin(top_g.flatten(1), top_w.flatten(1)).float().mean() > 0.99


@pytest.mark.parametrize(
    "dtype,n,h,hkv", [(torch.bfloat16, 8192, 16, 4), (torch.float16, 3000, 8, 8), (torch.float32, 1000, 8, 2)]
)
def test_attention_lse_gives_flash_statistics_for_one_pass_scoring(dtype, n, h, hkv):
    """``attention_lse`` on CUDA (flash attention's own row log-sum-exp; fp32 through the reference) equals its
    reference, and the scoring that takes it (pass 2 only) equals the two-pass scoring."""
    from kvpass import ops

    d = 128
    g = torch.Generator(device=DEV).manual_seed(n)
    q, k, v = (torch.randn(1, x, n, d, device=DEV, generator=g).to(dtype) for x in (h, hkv, hkv))
    # the CUDA implementation (kvpass.ops.lowerings) is what runs, not the reference compared with itself
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kvpass::attention_lse", "CUDA")
    out, lse = torch.ops.kvpass.attention_lse(q, k, v, d**-0.5)
    assert lse.shape == (1, h, n) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, A.causal_lse_reference(q, k, d**-0.5), atol=2e-3, rtol=1e-4)
    want_out = ops.attention_reference(q, k, v, None, d**-0.5, ops.CAUSAL_TOP_LEFT)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    kv_pos = torch.arange(n, device=DEV).expand(1, hkv, n).contiguous()
    q_pos = torch.arange(n, device=DEV).expand(1, n).contiguous()
    one = torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, d**-0.5, 0.0, lse)
    two = torch.ops.kvpass.accumulated_scores(q, k, kv_pos, q_pos, d**-0.5, 0.0)
    torch.testing.assert_close(one, two, atol=1e-3 * (h // hkv), rtol=1e-3)


def test_inductor_launches_the_accumulated_kernels():
    q = torch.randn(1, 8, 3000, 64, device=DEV).to(torch.bfloat16)
    k = torch.randn(1, 2, 3000, 64, device=DEV).to(torch.bfloat16)
    kv_pos = torch.arange(3000, device=DEV).expand(1, 2, -1).contiguous()
    q_pos = torch.arange(3000, device=DEV).expand(1, -1).contiguous()

    def f(q, k, kv_pos, q_pos):
        return torch.ops.kvpass.accumulated_scores(q * 2, k, kv_pos, q_pos, 0.0625, 0.0) + 1

    got, codes = run_and_get_code(torch.compile(f, backend="inductor"), q, k, kv_pos, q_pos)
    assert any("_kvpass_accumulated_cols_kernel" in c for c in codes), "Inductor did not launch the kernel"
    torch.testing.assert_close(got, f(q, k, kv_pos, q_pos), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "b,hkv,n,keep,d",
    [(1, 8, 131072, 1024, 128), (4, 8, 32768, 2048, 128), (2, 2, 20000, 777, 256), (16, 4, 4096, 1024, 64)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_kernel_equals_reference(b, hkv, n, keep, d, dtype):
    g = torch.Generator(device=DEV).manual_seed(1)
    src = torch.randn(b, hkv, n, d, device=DEV, generator=g).to(dtype)
    idx = torch.rand(b, hkv, n, device=DEV, generator=g).topk(keep, -1).indices.sort(-1).values
    k_out, v_out = torch.ops.kvpass.gather_kv(src, src.transpose(1, 2).contiguous().transpose(1, 2), idx)
    want = G.gather_reference(src, idx)
    assert torch.equal(k_out, want) and torch.equal(v_out, want) and k_out.is_contiguous()


def test_inductor_launches_the_kvpass_kernels():
    q, k, kv_pos, q_pos = window_case(1, 8, 2, 32, 3000, 64, torch.bfloat16)
    idx = torch.arange(0, 3000, 3, device=DEV).expand(1, 2, -1).contiguous()

    def f(q, k, kv_pos, q_pos, idx):
        s = torch.ops.kvpass.window_scores(q * 2, k, kv_pos, q_pos, 0.125, 0.0)
        kk, vv = torch.ops.kvpass.gather_kv(k, k + 1, idx)
        return s + 1, kk, vv

    got, codes = run_and_get_code(torch.compile(f, backend="inductor"), q, k, kv_pos, q_pos, idx)
    assert any("_kvpass_window_scores_kernel" in c for c in codes), "Inductor did not launch window scoring"
    assert any("_kvpass_gather_kernel" in c for c in codes), "Inductor did not launch the gather kernel"
    for a, b in zip(got, f(q, k, kv_pos, q_pos, idx)):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "chunkkv", "sablock"])
def test_policy_on_gpu_matches_hand_eviction(policy):
    from test_eviction_models import PARAMS, expected_kept, hand_evicted_decode, layer_budgets, prompt

    if policy == "pyramidkv":
        skip_uneven_layers_on_old_stacks(policy)
    budget, window, steps = 64, 16, 12
    model = build("llama")
    ids = prompt(300, seed=7)
    want = expected_kept(policy, model, ids, budget, window)
    model = model.to(DEV)
    ids = ids.to(DEV)
    be = kvpass.backend(policy, budget=budget, window=window, **PARAMS[policy])  # real Inductor
    model_c = build("llama").to(DEV)
    fwd = torch.compile(model_c.forward, backend=be, fullgraph=True)
    # The bare forward, without an attention mask: transformers 5.17 materialises a decode mask
    # sized from layer 0's cache and adds it to every layer's scores unsliced, which cannot
    # broadcast once PyramidKV's layers hold different lengths (docs/policies/pyramidkv.md).
    cache, tokens, nxt = DynamicCache(config=model_c.config), [], ids
    with torch.no_grad():
        for _ in range(steps):
            logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
            tokens.append(int(logits.argmax()))
            nxt = torch.tensor([[tokens[-1]]], device=DEV)
    budgets = layer_budgets(policy, [0, 1], budget, window)
    kept = {i: be.state.layer(i).pos[..., :keep] for i, keep in budgets.items()}
    for i, keep in budgets.items():
        got = torch.tensor(want[i], device=DEV)
        assert torch.isin(kept[i].flatten(1), got.flatten(1)).float().mean() > 0.97, f"layer {i}"
        assert be.state.stored_tokens()[i] == keep + steps - 1  # decode appended steps - 1 tokens
    ref = hand_evicted_decode(model, ids, kept, tokens)
    assert [int(x.argmax()) for x in ref[:-1]] == tokens
