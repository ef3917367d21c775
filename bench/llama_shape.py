"""The benchmarks' model and bandwidth, without kvpass: the random-weight Llama-3.1-8B shape and the
device-to-device copy bandwidth that the decode benchmarks' roofline divides by.

``bench_decode_step.py`` (kvpass, the newest transformers) and ``bench_kvpress.py`` (kvpress on transformers
5.2, which kvpass refuses) import it, so both build the same model from the same seed and measure the
roofline's bandwidth the same way; ``bench_fastpath.py``, ``bench_prefill.py``, ``bench_throughput.py`` and
``bench_tp.py`` use it too. It writes no results folder of its own; run alone it prints the copy bandwidth of
one device (what a roofline in those folders was divided by).

    python bench/llama_shape.py                 # the first GPU, else the CPU
    python bench/llama_shape.py --device cpu
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64
)  # the small model of the eval (30 layers): a host-bound step


def llama8b_config(layers: int, tiny: bool = False, small: bool = False):
    """Llama-3.1-8B's shape with ``layers`` of its 32 layers; ``tiny``: the same layout at test size; ``small``:
    SmolLM2-135M's widths (a step short enough on a GPU that the host's work per step shows)."""
    if small:
        dims = SMOLLM2_135M
    elif tiny:
        dims = dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    else:
        dims = dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        )
    return tf.LlamaConfig(
        num_hidden_layers=layers,
        max_position_embeddings=262144,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **dims,
    )


def random_llama(cfg, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """A LlamaForCausalLM with weights drawn from N(0, 0.02) (seed 0) and norms at 1, built without an
    fp32 copy on the host (meta, then allocated on ``device``)."""
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    rotary = model.model.rotary_emb  # its inv_freq buffer was left on meta
    try:
        rotary.__init__(cfg, device=device)
    except TypeError:  # transformers >= 5.2x: no device argument
        rotary.__init__(cfg)
        rotary.to(device)
    return model.eval()


def uncompiled(model) -> None:
    """A benchmark's previous configuration undone on ``model``: the class's own forward and generate (what
    ``kvpass.compile`` replaced), Dynamo reset, and the caches it held freed (they sit in reference cycles:
    without a collection the next configuration's memory cap still held them)."""
    import gc

    torch._dynamo.reset()
    for attr in ("forward", "generate"):
        model.__dict__.pop(attr, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes read + written per second by a device-to-device copy (1 GiB; 64 MiB off CUDA)."""
    x = torch.empty(1 << (30 if str(device).startswith("cuda") else 26), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 20 / (time.perf_counter() - t)


class ByteTokenizer:
    """kvzip's repeat prompts on a model without a tokenizer (random weights): one id per byte of the text."""

    name_or_path = "bytes"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def __repr__(self) -> str:  # as a result row's parameter (the rows are written with default=str)
        return "ByteTokenizer()"


def policy_params(policy: str, budget: int, config) -> dict:
    """A policy's parameters in the benchmarks: ``budget`` where it has one; duoattention a head pattern of
    random scores for this model (seeded), half its KV heads streaming at the defaults; kvzip byte ids for its
    repeat prompts."""
    if policy in ("full", "art"):
        return {}
    if policy == "kvzip":
        return {"budget": budget, "tokenizer": ByteTokenizer()}
    if policy == "duoattention":
        g = torch.Generator().manual_seed(0)
        scores = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=g)
        path = Path(tempfile.gettempdir()) / f"duo_pattern_{scores.shape[0]}x{scores.shape[1]}.tsv"
        path.write_text("\n".join("\t".join(f"{x:.4f}" for x in row) for row in scores.tolist()) + "\n")
        return {"pattern": str(path)}
    return {"budget": budget}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(f"copy bandwidth on {args.device}: {copy_bandwidth(args.device) / 1e9:.1f} GB/s (read + written)")
