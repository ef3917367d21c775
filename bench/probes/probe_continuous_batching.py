"""Probe: what kvpass sees in transformers' continuous batching (`generate_batch`).

A random 2-layer Llama (CPU, sdpa) decodes three short prompts with `model.generate_batch`, once plain and
once with a kvpass backend given as the backend of the ContinuousBatchingConfig's varlen CompileConfig (on
CPU the block-table decode path, and with it `decode_compile_config`, is off: it needs flash-attn on
CUDA/XPU). Prints whether the tokens match the plain run, each graph kvpass was handed (phase, sites, cache
kind), `Backend.plans()` and the KVPassWarnings.

What it shows on transformers 5.24 / torch 2.13: `PagedAttentionCache.update` is `@torch.compiler.disable`d,
so the step breaks into ~9 graphs; the attention's K/V arrive as graph inputs (cache "none"), one graph
after the update serves every layer (every site reads "layer 0"), and a packed step of many requests
reads as a "prefill". `full` is rewritten (exact); evicting policies are refused. `--trace-update` lifts
the decorator (monkeypatch): one graph per step, every layer's `index_copy_` into the flat paged cache and
`index_select` by `read_index`, still cache "none" to kvpass. `--dynamic` compiles with dynamic=True (what
`default_compile_level=1` uses): the head counts after the graph break become symbols and detection
refuses the site.

    python bench/probes/probe_continuous_batching.py [--policy streamingllm] [--dynamic] [--trace-update]
"""

import argparse
import warnings

import torch
from transformers import CompileConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache

import kvpass

PARAMS = {"streamingllm": dict(budget=16, sinks=2), "quest": dict(dense_layers=0)}


def run(model, prompts, backend=None, dynamic=None):
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    compile_config = None if backend is None else CompileConfig(backend=backend, mode="default", dynamic=dynamic)
    cb = ContinuousBatchingConfig(
        num_blocks=16, page_size=16, max_batch_tokens=64, varlen_compile_config=compile_config
    )
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    return [out[k].generated_tokens for k in sorted(out)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="full")
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--trace-update", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    prompts = [[1, 5, 9, 13, 17], [2, 4, 6], [7, 8, 9, 10, 11, 12, 13]]
    plain = run(model, prompts)
    if args.trace_update:
        cb_cache.PagedAttentionCache.update = cb_cache.PagedAttentionCache.update.__wrapped__
    torch._dynamo.config.recompile_limit = 64
    be = kvpass.backend(args.policy, compiler="eager", **PARAMS.get(args.policy, {}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kvpass.KVPassWarning)
        tokens = run(model, prompts, be, dynamic=True if args.dynamic else None)
    print(f"policy {args.policy}: tokens equal to the plain run: {tokens == plain}")
    print(f"graphs handed to kvpass: {len(be.reports)} {be.graph_counts()}")
    for i, r in enumerate(be.reports):
        if r.sites or r.problems:
            sites = [(s["layer"], s["attention"], s["cache"], s["heads"], s["kv_heads"]) for s in r.sites]
            print(f"  graph {i}: phase {r.phase}, sites (layer, attention, cache, heads, kv_heads) {sites}")
    print("plans:", be.plans())
    for w in caught:
        if issubclass(w.category, kvpass.KVPassWarning):
            print("KVPassWarning:", w.message)


if __name__ == "__main__":
    main()
