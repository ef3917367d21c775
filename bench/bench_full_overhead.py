"""Cost of the pass itself: a model compiled with kvpass `full` vs plain Inductor, same process.

`full` routes every attention through the kvpass operator (PyTorch's fused SDPA on CUDA today), so
the ratio should be ~1.0; anything else is overhead of the rewrite. Also times the bare operator
against `F.scaled_dot_product_attention` for decode shapes. Random weights: this measures speed
only (attention distributions do not matter for exact attention).

    python bench/bench_full_overhead.py --out bench/results

Results: ``bench/results/full_overhead.md`` / ``.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvpass
import kvpass.ops  # noqa: F401  (registers torch.ops.kvpass; `import kvpass` loads lazily)
from kvpass.eval.report import environment


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def model_rows(ctx: int, batch: int) -> dict:
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=ctx + 64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (batch, ctx), device="cuda")
    out = {}
    for name, backend in (("inductor", "inductor"), ("kvpass_full", kvpass.backend("full"))):
        torch._dynamo.reset()
        fwd = torch.compile(model.forward, backend=backend, fullgraph=True)
        with torch.no_grad():
            t0 = time.perf_counter()
            cache = DynamicCache(config=cfg)
            fwd(input_ids=ids, past_key_values=cache, use_cache=True)
            tok = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            fwd(input_ids=tok, past_key_values=cache, use_cache=True)
            fwd(input_ids=tok, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0

            def prefill():
                fwd(input_ids=ids, past_key_values=DynamicCache(config=cfg), use_cache=True)

            ttft = timed(prefill, 3)
            steps = []
            for _ in range(16):
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                fwd(input_ids=tok, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
                steps.append(time.perf_counter() - t1)
        out[name] = {"compile_s": compile_s, "ttft_s": ttft, "tpot_s": sorted(steps)[len(steps) // 2]}
    out["ratio_ttft"] = out["kvpass_full"]["ttft_s"] / out["inductor"]["ttft_s"]
    out["ratio_tpot"] = out["kvpass_full"]["tpot_s"] / out["inductor"]["tpot_s"]
    return out


def op_rows(batch: int, ctx: int) -> dict:
    h, hkv, d = 32, 8, 128
    q = torch.randn(batch, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True), 50)
    op = timed(lambda: torch.ops.kvpass.attention(q, k, v, None, d**-0.5, 0, 0.0), 50)
    bytes_read = 2 * k.numel() * k.element_size()
    return {"sdpa_ms": sdpa * 1e3, "kvpass_ms": op * 1e3, "ratio": op / sdpa, "kvpass_GBps": bytes_read / op / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    res = {"env": environment("cuda"), "model": {}, "op": {}}
    for ctx, batch in ((4096, 1), (4096, 8)):
        res["model"][f"ctx{ctx}_b{batch}"] = model_rows(ctx, batch)
        print(ctx, batch, res["model"][f"ctx{ctx}_b{batch}"], flush=True)
    for batch, ctx in ((1, 4096), (1, 32768), (8, 8192), (32, 4096)):
        res["op"][f"b{batch}_ctx{ctx}"] = op_rows(batch, ctx)
        print(batch, ctx, res["op"][f"b{batch}_ctx{ctx}"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "full_overhead.json").write_text(json.dumps(res, indent=2))
    lines = [
        f"# kvpass `full` vs plain Inductor ({res['env'].get('gpu')}, torch {res['env']['torch']}, "
        f"transformers {res['env']['transformers']}, {res['env']['date']})",
        "",
        "8-layer Llama-shaped model (hidden 1024, 16 heads, 4 KV heads, bf16, random weights), same process.",
        "",
        "| shape | inductor TTFT | kvpass TTFT | ratio | inductor TPOT | kvpass TPOT | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in res["model"].items():
        lines.append(
            f"| {key} | {r['inductor']['ttft_s'] * 1e3:.2f} ms | {r['kvpass_full']['ttft_s'] * 1e3:.2f} ms | "
            f"{r['ratio_ttft']:.3f} | {r['inductor']['tpot_s'] * 1e3:.2f} ms | "
            f"{r['kvpass_full']['tpot_s'] * 1e3:.2f} ms | {r['ratio_tpot']:.3f} |"
        )
    lines += [
        "",
        "Decode attention operator alone (32 heads, 8 KV heads, head_dim 128, bf16):",
        "",
        "| shape | SDPA | kvpass.attention | ratio | kvpass GB/s (K+V read) |",
        "|---|---|---|---|---|",
    ]
    for key, r in res["op"].items():
        lines.append(
            f"| {key} | {r['sdpa_ms']:.3f} ms | {r['kvpass_ms']:.3f} ms | {r['ratio']:.3f} | {r['kvpass_GBps']:.0f} |"
        )
    (args.out / "full_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
