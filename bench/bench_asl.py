"""TTFT, TPOT and peak memory of layer-gated prefill (asl, fastkv, gemfilter) against ``full``.

Layer-gated policies run the prompt through the first layers only and keep the tokens a selection layer
picks for the rest; this measures what that saves in prefill time and memory at long context.

A random-weight Llama-architecture model (``--preset``: SmolLM2-1.7B's shape by default, or
Llama-3.1-8B's) runs in bf16 on one GPU through ``torch.compile(model.forward,
backend=kvpass.backend(...), dynamic=True)`` with Inductor. For each context length (16k, 32k, 64k,
128k) every policy (``full``, ``asl``, ``fastkv``, ``gemfilter``, ``asl_fullkv`` by default) prefills
the same random prompt and decodes ``--new-tokens`` greedy tokens:

* TTFT: median prefill time over ``--reps`` runs (synchronised), after one untimed run per length;
* TPOT: median decode step;
* peak GPU memory from the start of prefill to the last token;
* ratios of each to ``full`` at the same length.

With random weights the adaptive rule's choice means nothing (on this model its rank variance never
falls), so ``asl`` runs with the selection layer forced to ``--asl-layer`` (set it to the layer the
rule chose on the real model; the default, floor(L/3) + 2, is a placeholder and is written into the
results). The rule's own cost is timed separately: ``kvpass::layer_scores`` for every observed layer
plus the rank-variance test at every candidate layer, on random q/k at each length (``rule_ms``, and as
a fraction of full's TTFT). ``asl@rule`` in ``--policies`` runs the adaptive rule end to end (it pays
every layer at full length plus the rule; on random weights it never selects).

    python bench/bench_asl.py --out bench/results/asl_h100

Results: ``bench/results/asl_h200_2026-11-22/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
import kvpass.ops  # noqa: E402,F401  (registers torch.ops.kvpass; `import kvpass` loads lazily)
from kvpass.policies import make_policy  # noqa: E402

PRESETS = {
    # SmolLM2-1.7B's shape (Llama architecture, MHA), with a long-context RoPE base
    "smollm2-1.7b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
    ),
    # Llama-3.1-8B's shape (GQA 4)
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    # a smoke test of the script itself (CPU: --device cpu --preset tiny --lengths 256,512 --budget 64)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
}
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def build(preset: str, device: str):
    cfg = transformers.LlamaConfig(
        **PRESETS[preset], max_position_embeddings=262144, rope_theta=500000.0, tie_word_embeddings=False
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


@torch.no_grad()
def prefill_decode(fwd, model, ids, new_tokens: int):
    cache = DynamicCache(config=model.config)
    reset_peak()
    sync()
    t0 = time.perf_counter()
    logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    sync()
    ttft, steps = time.perf_counter() - t0, []
    for _ in range(new_tokens - 1):
        nxt = logits.argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        sync()
        steps.append(time.perf_counter() - t1)
    peak = peak_bytes()
    kv = max(layer.keys.shape[-2] for layer in cache.layers)
    del cache
    return ttft, sorted(steps)[len(steps) // 2] if steps else float("nan"), peak, kv


@torch.no_grad()
def rule_cost(model, n: int, budget: int, window: int, reps: int = 3) -> float:
    """Seconds the adaptive rule adds to a prefill of ``n`` tokens: layer_scores on every observed layer
    and the rank-variance test at every candidate layer (random q/k of the model's shape)."""
    cfg = model.config
    pol = make_policy("asl", budget=budget, window=window)
    observe, cuts = pol.gate_layers(cfg.num_hidden_layers)
    d = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, cfg.num_attention_heads, n, d, device=DEVICE, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, cfg.num_key_value_heads, n, d, device=DEVICE, generator=g, dtype=torch.bfloat16)
    times = []
    for _ in range(reps):
        ctx = {"kv_pos": torch.arange(n, device=DEVICE)[None]}
        history = {}
        sync()
        t0 = time.perf_counter()
        for layer in observe:
            history[layer] = torch.ops.kvpass.layer_scores(q, k, None, d**-0.5, 0.0, window)
            if layer in cuts:
                pol.gate_fires(layer, history, min(budget, n), ctx)  # syncs once per layer, as in a prefill
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="smollm2-1.7b", choices=sorted(PRESETS))
    ap.add_argument("--lengths", default="16384,32768,65536,131072")
    ap.add_argument("--policies", default="full,asl,fastkv,gemfilter,asl_fullkv")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--asl-layer", type=int, default=-1, help="forced selection layer of asl (-1: floor(L/3) + 2)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the script)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    model = build(args.preset, DEVICE)
    n_layers = model.config.num_hidden_layers
    asl_layer = args.asl_layer if args.asl_layer >= 0 else n_layers // 3 + 2
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = model.config.vocab_size
    prompts = {
        n: torch.randint(10, vocab - 10, (1, n), generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in lengths
    }
    rows = []
    for spec in args.policies.split(","):
        name, _, mode = spec.partition("@")
        params = {} if name == "full" else {"budget": args.budget}
        if name in ("asl", "asl_fullkv", "asl_2pass", "fastkv"):
            params["window"] = args.window  # gemfilter keeps its own (last token, no pooling)
        if name in ("asl", "asl_fullkv", "asl_2pass") and mode != "rule":
            params["layer"] = asl_layer
        torch._dynamo.reset()
        be = kvpass.backend(name, compiler=args.compiler, **params)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
        t0 = time.perf_counter()
        prefill_decode(fwd, model, prompts[lengths[0]][:, : 2 * args.budget + 64], 3)  # compile, untimed
        compile_s = time.perf_counter() - t0
        for n in lengths:
            # one untimed run per length first: a new length may still pay a Dynamo guard miss
            runs = [prefill_decode(fwd, model, prompts[n], args.new_tokens) for _ in range(args.reps + 1)][1:]
            ttft = sorted(r[0] for r in runs)[(len(runs) - 1) // 2]
            tpot = sorted(r[1] for r in runs)[(len(runs) - 1) // 2]
            peak = max(r[2] for r in runs)
            gate = be.gate_info or {}
            rows.append(
                dict(
                    policy=spec,
                    params=params,
                    context=n,
                    ttft_s=ttft,
                    tpot_ms=tpot * 1e3,
                    peak_gib=peak / 2**30,
                    max_cache_entries=runs[-1][3],
                    selection_layer=gate.get("selection_layer"),
                    kept=gate.get("kept"),
                    compile_s=compile_s,
                    plans=be.plans(),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    full = {r["context"]: r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get(r["context"])
        if f is not None:
            r["ttft_ratio"] = r["ttft_s"] / f["ttft_s"]
            r["tpot_ratio"] = r["tpot_ms"] / f["tpot_ms"]
            r["peak_ratio"] = r["peak_gib"] / f["peak_gib"] if f["peak_gib"] else float("nan")
    rule = []
    for n in lengths:
        s = rule_cost(model, n, args.budget, args.window)
        f = full.get(n)
        rule.append(dict(context=n, rule_ms=s * 1e3, of_full_ttft=s / f["ttft_s"] if f else None))
        print(json.dumps(rule[-1]), flush=True)
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        preset=args.preset,
        config=PRESETS[args.preset],
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        dtype="bfloat16",
        budget=args.budget,
        window=args.window,
        asl_layer=asl_layer,
        asl_layer_note="forced; random weights make the adaptive choice meaningless",
        fastkv_layer=n_layers // 2,
        gemfilter_layer=(13 * n_layers) // 32,
        new_tokens=args.new_tokens,
        reps=args.reps,
        compiler=args.compiler,
        targets="asl TTFT <= 0.75x full at 128k; asl TPOT <= 0.05x full",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "asl.json").write_text(json.dumps(dict(meta=meta, rows=rows, rule=rule), indent=2))
    lines = [
        f"# Layer-gated prefill: {args.preset} (random weights), {meta['device']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, bf16, Inductor, budget {args.budget}, "
        f"window {args.window}; asl's selection layer forced to {asl_layer} of {n_layers}, fastkv's "
        f"{n_layers // 2}, gemfilter's {(13 * n_layers) // 32} (window 1, two passes). "
        f"TTFT = (lower) median of {args.reps} prefills after a warm-up run, TPOT = median decode step of "
        f"{args.new_tokens} tokens; ratios to full at the same length. Targets: {meta['targets']}.",
        "",
        "| policy | context | TTFT s | TTFT / full | TPOT ms | TPOT / full | peak GiB | peak / full | "
        "selection layer | max cache entries |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['context']} | {r['ttft_s']:.3f} | {r.get('ttft_ratio', float('nan')):.3f} "
            f"| {r['tpot_ms']:.2f} | {r.get('tpot_ratio', float('nan')):.3f} | {r['peak_gib']:.2f} | "
            f"{r.get('peak_ratio', float('nan')):.3f} | {r['selection_layer']} | {r['max_cache_entries']} |"
        )
    lines += [
        "",
        "Adaptive rule's own cost (layer_scores on every observed layer + rank-variance test at every "
        "candidate layer, random q/k):",
        "",
        "| context | rule ms | of full's TTFT |",
        "|---|---|---|",
    ]
    for r in rule:
        frac = "-" if r["of_full_ttft"] is None else f"{r['of_full_ttft']:.1%}"
        lines.append(f"| {r['context']} | {r['rule_ms']:.2f} | {frac} |")
    (args.out / "asl.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
