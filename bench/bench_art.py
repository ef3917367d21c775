"""ART (early-terminating decode attention) on recorded attention, and its end-to-end decode speed.

ART stops reading a row's keys once the rest cannot change the output; random keys never let it stop, so
its savings and errors are measured on attention recorded from a real model.

2. ``captured``: Q/K/V of one decode step recorded from SmolLM2-135M (``kvpass.eval.models``) after long
   prompts cut from the Paul Graham essays, one batch row per (prompt, layer). Random keys make
   attention uniform and never converge, so only recorded attention says anything about early
   termination. For each threshold setting: blocks read, relative L2 error of the output against
   exact attention (fp32), and the time against PyTorch SDPA (best exact form) in the same process.
3. ``e2e``: decode tokens per second of SmolLM2 (Llama architecture) at batch 64 on a 16k-token
   prompt, compiled with Inductor through ``kvpass.backend``, ``full`` against ``art`` in one run.
   The cache is a StaticCache (written in place; a DynamicCache would copy the whole cache on every
   step and hide attention's share of the time), prefilled in chunks; every row holds the same prompt.

    python bench/bench_art.py --out bench/results            # on a GPU

Results: ``bench/results/art_captured.md`` / ``.json`` (SmolLM2-135M: captured and e2e) and
``bench/results/art_gemma3_h200/`` (Gemma-3-270M, captured).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from kvpass.eval import (
    models,  # noqa: E402
    tasks,
)
from kvpass.kernels import decode_attention as K  # noqa: E402

SETTINGS = [  # (tau, phi, patience, block, horizon)
    (1e-5, 1e-3, 5, 64, 0),
    (1e-5, 1e-3, 5, 128, 0),
    (1e-4, 1e-3, 5, 128, 0),
    (1e-3, 1e-2, 3, 128, 0),
    (1e-5, 1e-3, 5, 128, 16),
    (1e-4, 1e-3, 5, 128, 8),
    (1e-4, 1e-3, 5, 128, 16),
    (1e-4, 1e-3, 5, 128, 32),
    (1e-3, 1e-2, 3, 128, 16),
    (1e-2, 1e-1, 2, 64, 0),
]
NEVER = 1e-30  # thresholds no step meets: ART's full cost without stopping


def timed(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3


def prompts(tok, length: int, n: int) -> list[list[int]]:
    ids = tok(tasks.haystack_text(), add_special_tokens=False).input_ids
    step = max(1, (len(ids) - length) // max(1, n))
    return [ids[i * step : i * step + length] for i in range(n)]


@torch.no_grad()
def capture(model, ids: list[int]) -> list[tuple]:
    """(q, k, v) of every layer for the decode step after ``ids``."""
    from transformers import AttentionInterface, DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def record(module, query, key, value, *args, **kwargs):
        if query.shape[2] == 1:
            seen.append((query.clone(), key.clone(), value.clone()))
        return original(module, query, key, value, *args, **kwargs)

    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids], device=dev)
    logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
    AttentionInterface.register("sdpa", record)
    try:
        model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    finally:
        AttentionInterface.register("sdpa", original)
    return seen


def sdpa_best(q, k, v):
    b, h, _, d = q.shape
    hkv = k.shape[1]
    forms = [
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        lambda: F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), k, v),
    ]
    return min(timed(f) for f in forms)


def captured(model, tok, lengths, batch) -> list[dict]:
    rows = []
    for length in lengths:
        # Only layers that see the whole context count (sliding-window layers store their window).
        first = prompts(tok, length, 1)[0]
        seen = capture(model, first)
        full_len = max(k.shape[2] for _, k, _ in seen)
        n_full = sum(k.shape[2] == full_len for _, k, _ in seen)
        rows_qkv = []
        for ids in prompts(tok, length, -(-batch // n_full)):
            rows_qkv += [t for t in capture(model, ids) if t[1].shape[2] == full_len]
        q, k, v = (torch.cat([t[i] for t in rows_qkv[:batch]]) for i in range(3))
        del seen, rows_qkv
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        t_sdpa = sdpa_best(q, k, v)
        t_full = timed(lambda: K.decode_attention_triton(q, k, v))
        base = dict(
            context=int(k.shape[2]),
            batch=int(q.shape[0]),
            heads=int(q.shape[1]),
            kv_heads=int(k.shape[1]),
            head_dim=int(q.shape[-1]),
            sdpa_ms=t_sdpa * 1e3,
            full_read_ms=t_full * 1e3,
        )
        t_unsplit = timed(lambda: K.decode_attention_triton(q, k, v, split=False))
        base.update(unsplit_read_ms=t_unsplit * 1e3)
        tune = {}
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                kw = dict(tau=NEVER, phi=NEVER, num_warps=warps, num_stages=stages)
                tune[(warps, stages)] = timed(lambda: K.decode_attention_triton(q, k, v, **kw))
        warps, stages = min(tune, key=tune.get)
        print("ART launch sweep (warps, stages) -> ms:", {f"{a},{b}": round(t * 1e3, 3) for (a, b), t in tune.items()})
        base.update(num_warps=warps, num_stages=stages)
        # What the stop rule costs when it never fires, against the same kernel without it
        overhead = {}
        for block in (64, 128):
            for chunk in (4, 8):
                kw = dict(tau=NEVER, phi=NEVER, block=block, chunk=chunk, num_warps=warps, num_stages=stages)
                overhead[f"block{block}_chunk{chunk}"] = timed(lambda: K.decode_attention_triton(q, k, v, **kw)) * 1e3
            t_b = timed(lambda: K.decode_attention_triton(q, k, v, block=block, split=False)) * 1e3
            overhead[f"block{block}_no_art"] = t_b
        print("never-stopping ART vs the same read without it (ms):", overhead, flush=True)
        base.update(never_stop_ms=overhead)
        chunk = min((4, 8), key=lambda c: overhead[f"block64_chunk{c}"])
        for tau, phi, patience, block, horizon in SETTINGS:
            kw = dict(
                tau=tau,
                phi=phi,
                patience=patience,
                block=block,
                horizon=horizon,
                chunk=chunk,
                num_warps=warps,
                num_stages=stages,
            )
            out, vis = K.decode_attention_triton(q, k, v, **kw)
            t = timed(lambda: K.decode_attention_triton(q, k, v, **kw))
            err = ((out.float() - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-6)).mean().item()
            nb = -(-k.shape[2] // block)
            rows.append(
                dict(
                    base,
                    tau=tau,
                    phi=phi,
                    patience=patience,
                    block=block,
                    horizon=horizon,
                    chunk=chunk,
                    blocks_read=vis.float().mean().item() / nb,
                    rel_err=err,
                    art_ms=t * 1e3,
                    speedup_vs_sdpa=t_sdpa / t,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def e2e(model, tok, length, batch, steps, policies) -> list[dict]:
    from transformers import StaticCache

    dev = next(model.parameters()).device
    ids = torch.tensor([prompts(tok, length, 1)[0]], device=dev).expand(batch, -1)
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    chunk = 1024  # prefill in chunks: a [batch, 1, length, cache] mask at once would not fit
    for s in range(0, length, chunk):
        part = ids[:, s : s + chunk]
        model(
            input_ids=part,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(s, s + part.shape[1], device=dev),
        )
    tok_in = torch.full((batch, 1), 42, device=dev)
    out = []
    for name, params in policies:
        # A StaticCache layer writes at its own running length (``cumulative_length``), whatever
        # cache_position says: rewind it, so every policy decodes from the same prompt.
        for layer in cache.layers:
            layer.cumulative_length.fill_(length)
        torch._dynamo.reset()
        be = kvpass.backend(name, **params)
        fwd = torch.compile(model.forward, backend=be, fullgraph=True)

        def step(t):
            pos = length + t
            return fwd(
                input_ids=tok_in,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([pos], device=dev),
                position_ids=torch.full((batch, 1), pos, device=dev),
            )

        t0 = time.perf_counter()
        for t in range(3):
            step(t)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        times = []
        for t in range(3, steps):
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            step(t)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t1)
        times.sort()
        med = times[len(times) // 2]
        out.append(
            dict(
                policy=name,
                params=params,
                step_ms=med * 1e3,
                tokens_per_s=batch / med,
                compile_s=compile_s,
                decode_graphs=sum(r.phase == "decode" for r in be.reports),
            )
        )
        print(json.dumps(out[-1]), flush=True)
    full = out[0]["tokens_per_s"]
    for r in out:
        r["ratio_vs_full"] = r["tokens_per_s"] / full
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--e2e-length", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: captured,e2e")
    args = ap.parse_args()
    model, tok = models.load(args.model, dtype=torch.bfloat16, device="cuda")
    skip = set(args.skip.split(","))
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        model=args.model,
        dtype="bfloat16",
    )
    res = dict(meta=meta)
    if "captured" not in skip:
        res["captured"] = captured(model, tok, [int(x) for x in args.lengths.split(",")], args.batch)
    if "e2e" not in skip:
        pols = [
            ("full", {}),
            ("art", {}),
            ("art", dict(horizon=16)),
            ("art", dict(tau=1e-4, horizon=16)),
            ("art", dict(tau=1e-3, phi=1e-2, patience=3, horizon=16)),
        ]
        res["e2e"] = e2e(model, tok, args.e2e_length, args.batch, args.steps, pols)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"art_{args.model}.json").write_text(json.dumps(res, indent=2))
    lines = [f"# ART on {args.model}, {meta['gpu']}, {meta['date']}", "", f"torch {meta['torch']}, bf16.", ""]
    if "captured" in res:
        lines += [
            "## Captured decode attention (batch = (prompt, layer) rows)",
            "",
            "| context | tau | phi | p | block | horizon | blocks read | rel. L2 error | SDPA ms | ART ms "
            "| speedup vs SDPA |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["captured"]:
            lines.append(
                f"| {r['context']} | {r['tau']:g} | {r['phi']:g} | {r['patience']} | {r['block']} | {r['horizon']} | "
                f"{r['blocks_read']:.0%} | "
                f"{r['rel_err']:.1e} | {r['sdpa_ms']:.3f} | {r['art_ms']:.3f} | {r['speedup_vs_sdpa']:.2f} |"
            )
    if "captured" in res:
        lines += [
            "",
            "### The stop rule's cost when it never fires (ms; same process)",
            "",
            "| context | SDPA | read, no ART, unsplit | " + " | ".join(res["captured"][0]["never_stop_ms"]) + " |",
            "|---|---|---|" + "---|" * len(res["captured"][0]["never_stop_ms"]),
        ]
        for r in {r["context"]: r for r in res["captured"]}.values():
            lines.append(
                f"| {r['context']} | {r['sdpa_ms']:.3f} | {r['unsplit_read_ms']:.3f} | "
                + " | ".join(f"{t:.3f}" for t in r["never_stop_ms"].values())
                + " |"
            )
    if "e2e" in res:
        lines += [
            "",
            f"## End to end: batch {args.batch}, {args.e2e_length}-token prompt, StaticCache, Inductor",
            "",
            "| policy | params | step ms | tokens/s | ratio vs full |",
            "|---|---|---|---|---|",
        ]
        for r in res["e2e"]:
            lines.append(
                f"| {r['policy']} | {r['params']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['ratio_vs_full']:.2f} |"
            )
    (args.out / f"art_{args.model}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
