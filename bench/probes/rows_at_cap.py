"""The requests each policy's ``kvpass.RequestQueue`` fits at ``bench_throughput.py``'s KV cap, on a CPU.

``bench_throughput.py`` runs each policy at the largest batch whose SlotCache rows fit ``--kv-gib`` beside its
one-row staging cache; a row's bytes (slots, positions, the policy's state) follow from the KV geometry alone:
layers, KV heads, head size, dtype and each layer's capacity under the policy. This builds that geometry with
narrow projections (Llama-3.1-8B's 32 layers of 8 KV heads of 128, bf16; hidden size 256), sizes one row per
policy with the benchmark's own functions and prints the batch, so the memory side of a throughput row (per-head
methods fit as many requests as snapkv at the same budget) is checked without a GPU.

    python bench/probes/rows_at_cap.py --policies full,snapkv,adakv,kvzip --context 32768 --new 256 --kv-gib 16

A name may carry parameters: ``expected_attention@decode_interval=512``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from bench_decode_step import policy_of  # noqa: E402
from bench_throughput import fitting_rows, row_bytes  # noqa: E402
from llama_shape import llama8b_config, policy_params  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="full,snapkv,adakv,kvzip,duoattention,expected_attention,criticalkv,tova")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--budget", type=int, default=2048)
    args = ap.parse_args()
    cfg = llama8b_config(args.layers)
    cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size = 256, 64, 256  # the KV geometry alone sets the bytes
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"{args.layers} layers, {args.context} + {args.new} tokens, {args.kv_gib} GiB of KV, budget {args.budget}")
    print("| policy | KV row MiB | requests at the cap |\n|---|---|---|")
    for policy in args.policies.split(","):
        name, extra = policy_of(policy)  # "expected_attention@decode_interval=512": a parameter beside the defaults
        be = kvpass.backend(name, **{**policy_params(name, args.budget, cfg), **extra})
        one = row_bytes(model, be, args)
        print(f"| {policy} | {one / 2**20:.1f} | {fitting_rows(one, args, int(args.kv_gib * 2**30))} |", flush=True)


if __name__ == "__main__":
    main()
