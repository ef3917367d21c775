"""Compile a tiny Llama with a kvpass policy, generate, and show what the pass did.

    python examples/quickstart.py [--policy streamingllm] [--budget 48]

Runs in well under a minute on a laptop CPU; no downloads (the model is randomly initialised).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpass
from kvpass.eval.report import takes_budget

# Policies this script cannot run as it is: chunk fusion needs prompts of stored chunks (kvpass.ChunkFusion),
# duoattention a head pattern for the model (kvpass.duo_pattern), kvzip the model's tokenizer (this random model has
# none).
NEEDS_MORE = {"a3", "a3+evict", "cacheblend", "legolink", "pie", "full_reuse", "duoattention", "kvzip"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    policies = [p for p in kvpass.available_policies() if p not in NEEDS_MORE]
    ap.add_argument("--policy", default="streamingllm", choices=policies, metavar="POLICY", help=", ".join(policies))
    ap.add_argument(
        "--budget",
        type=int,
        default=48,
        help="KV entries kept per layer (policies with a budget; above 32 for "
        "the prefill policies, whose 32-token window the budget includes)",
    )
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len))

    print("What kvpass finds in the model:")
    kvpass.explain(model, {"input_ids": ids, "use_cache": True}, policy="full")

    params = {"budget": args.budget} if takes_budget(args.policy) else {}
    be = kvpass.backend(args.policy, compiler="eager", **params)
    print(f"\nbackend: {be!r}")
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    dt = time.perf_counter() - t0
    print(f"generated {out.shape[1] - ids.shape[1]} tokens in {dt:.1f}s (compile included)")
    print(f"tokens: {out[0, ids.shape[1] :].tolist()}")
    state = be.state
    print(f"state after generation: {state}")
    # seen: the prompt plus every generated token fed back (the last one is never fed back), e.g.
    # 96 + 31 = 127. stored: cache entries each layer holds now (per KV head and batch row).
    # evicted_tokens: tokens seen that the cache no longer holds, summed over layers, KV heads and batch
    # rows. With streamingllm and --budget 48 on this 4-layer model with 2 KV heads:
    # (127 seen - 48 kept) = 79 per layer and KV head, x 4 layers x 2 KV heads x 1 batch row = 632.
    stored = state.stored_tokens()
    kv_heads, rows = cfg.num_key_value_heads, ids.shape[0]
    dropped = {layer: state.seen - n for layer, n in stored.items()}
    if stored and len(set(dropped.values())) == 1:
        per = next(iter(dropped.values()))
        derived = per * len(stored) * kv_heads * rows
        print(
            f"evicted_tokens = tokens seen - tokens kept, summed over layers, KV heads and batch rows: "
            f"({state.seen} seen - {state.seen - per} kept) = {per} per layer and KV head, x {len(stored)} "
            f"layers x {kv_heads} KV heads x {rows} batch row{'s' if rows != 1 else ''} = {derived}"
            + ("" if derived == state.evicted_tokens else f" (the state counts {state.evicted_tokens})")
        )
    else:
        print("evicted_tokens = tokens seen - tokens kept, summed over layers, KV heads and batch rows")
    for i, report in enumerate(be.reports):
        print(
            f"graph {i}: phase={report.phase} rewritten={report.rewritten} evicting={report.evicting} "
            f"positions_fixed={report.positions_fixed}"
        )


if __name__ == "__main__":
    main()
