"""Compile a tiny Llama with a kvpass policy, generate, and show what the pass did.

    python examples/quickstart.py [--policy streamingllm] [--budget 32]

Runs in well under a minute on a laptop CPU; no downloads (the model is randomly initialised).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="streamingllm", help=f"one of {kvpass.available_policies()}")
    ap.add_argument("--budget", type=int, default=32, help="KV entries kept per layer (eviction policies)")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len))

    print("What kvpass finds in the model:")
    kvpass.explain(model, {"input_ids": ids, "use_cache": True}, policy="full")

    params = {"budget": args.budget} if args.policy != "full" else {}
    be = kvpass.backend(args.policy, compiler="eager", **params)
    print(f"\nbackend: {be!r}")
    model.forward = torch.compile(model.forward, backend=be, fullgraph=True)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
    dt = time.perf_counter() - t0
    print(f"generated {out.shape[1] - ids.shape[1]} tokens in {dt:.1f}s (compile included)")
    print(f"tokens: {out[0, ids.shape[1]:].tolist()}")
    print(f"state after generation: {be.state}")
    for i, report in enumerate(be.reports):
        print(f"graph {i}: phase={report.phase} rewritten={report.rewritten} evicting={report.evicting} "
              f"positions_fixed={report.positions_fixed}")


if __name__ == "__main__":
    main()
