"""Tiny randomly initialised decoders of many HF families, built from configs (no downloads).

Every config is shrunk to 2-4 layers, hidden 64, 4 query heads and 2 KV heads where the family
allows GQA, so a full compile of one model takes seconds on a CPU. The families are chosen to
exercise different graph shapes: fused qkv (Phi3, GPT-NeoX), partial rotary (GPT-NeoX, StableLM,
Phi3), q/k norms (OLMo2, Qwen3), logit softcapping and sliding layers (Gemma2), sliding plus
global layers (Gemma3, Cohere2, where the global layers carry no RoPE), scale multipliers (Granite).
"""

from __future__ import annotations

import torch
import transformers as tf

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _cfg(cls, **over):
    kw = dict(COMMON)
    kw.update(over)
    return cls(**kw)


def _gemma3():
    cfg = _cfg(
        tf.Gemma3TextConfig,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    return cfg, tf.Gemma3ForCausalLM


FAMILIES = {
    "llama": lambda: (_cfg(tf.LlamaConfig), tf.LlamaForCausalLM),
    "mistral": lambda: (_cfg(tf.MistralConfig, sliding_window=None), tf.MistralForCausalLM),
    "qwen2": lambda: (_cfg(tf.Qwen2Config), tf.Qwen2ForCausalLM),
    "qwen3": lambda: (_cfg(tf.Qwen3Config, head_dim=16), tf.Qwen3ForCausalLM),
    "gemma2": lambda: (
        _cfg(
            tf.Gemma2Config,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
        tf.Gemma2ForCausalLM,
    ),
    "gemma3": _gemma3,
    "phi3": lambda: (_cfg(tf.Phi3Config, partial_rotary_factor=0.5), tf.Phi3ForCausalLM),
    "gpt_neox": lambda: (_cfg(tf.GPTNeoXConfig, rotary_pct=0.5), tf.GPTNeoXForCausalLM),
    "olmo2": lambda: (_cfg(tf.Olmo2Config), tf.Olmo2ForCausalLM),
    "granite": lambda: (
        _cfg(
            tf.GraniteConfig,
            attention_multiplier=0.2,
            residual_multiplier=0.5,
            embedding_multiplier=2.0,
            logits_scaling=2.0,
        ),
        tf.GraniteForCausalLM,
    ),
    "stablelm": lambda: (_cfg(tf.StableLmConfig, partial_rotary_factor=0.25), tf.StableLmForCausalLM),
    "cohere2": lambda: (
        _cfg(
            tf.Cohere2Config,
            num_hidden_layers=4,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        ),
        tf.Cohere2ForCausalLM,
    ),
}


def build(family: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32, seed: int = 0, **config):
    """Build the tiny model of `family` with attention implementation `attn`, in eval mode; ``config``: fields of
    its config to set (``num_hidden_layers=4``)."""
    cfg, cls = FAMILIES[family]()
    for name, value in config.items():
        setattr(cfg, name, value)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    # Random init gives near-uniform logits, which makes greedy decoding tie-prone. Scaling the
    # output head sharpens the distribution so greedy tokens are stable under fp32 noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def skip_uneven_layers_on_old_stacks(policy: str) -> None:
    """Skip a decode test of a policy whose layers keep different cache lengths (pyramidkv, asl_fullkv:
    ``UNEVEN`` in ``tests/conformance.py``; any other policy runs) where transformers adds a decode mask
    sized by layer 0 to every layer under torch.compile (transformers < 5.23, or torch < 2.13, whose Dynamo reports
    every compile as an export): Dynamo cannot trace that model code (docs/policies/pyramidkv.md)."""
    import pytest
    from packaging.version import Version

    from conformance import CONFORMANCE, UNEVEN

    if getattr(CONFORMANCE.get(policy), "unpadded", None) != UNEVEN:
        return  # its layers keep one length
    if Version(tf.__version__) < Version("5.23") or Version(torch.__version__.split("+")[0]) < Version("2.13"):
        pytest.skip(
            f"transformers {tf.__version__} with torch {torch.__version__} sizes the decode mask by "
            f"layer 0: {policy}'s uneven layers cannot be traced (docs/policies/pyramidkv.md)"
        )


def symbolic_lengths(cache, mask=None) -> None:
    """After a prefill, mark a DynamicCache's sequence lengths (and a growing 2-D mask) as dynamic where the
    graph allows it, so a test's first decode step compiles the graph every later step runs. Left alone, Dynamo
    compiles the first step for its length and the second again with the length symbolic: a third compile per
    run (CI's time; the first-step graph stays covered by test_equivalence's decode scenario and the tests that
    decode through ``generate``)."""
    from transformers import DynamicCache

    for layer in cache.layers if isinstance(cache, DynamicCache) else ():
        for t in (layer.keys, layer.values):
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 2)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        torch._dynamo.maybe_mark_dynamic(mask, 1)
