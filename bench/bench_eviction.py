"""Decode speed (TPOT) and peak GPU memory of prefill-time eviction at long context.

Prefill eviction (snapkv, sablock, ...) keeps a budget of the prompt's entries; this measures whether that
frees GPU memory and speeds up decoding against ``full`` on the same prompts.

For each context length (32k, 64k, 128k by default) every policy prefills the same prompt (Paul
Graham essays, repeated to length) through ``torch.compile(model.forward, backend=kvpass.backend(...))``
with Inductor, then decodes ``--new-tokens`` greedy tokens. All policies run in one process on the
same GPU; each policy compiles once (``Runner.compile`` warms up on a short prompt, so compile time
never leaks into the timings) and then serves every length. Reported per (policy, length):

* TPOT: median wall time of a decode step (synchronised), batch rows in lockstep;
* TTFT: prefill time;
* peak GPU memory: the allocator's high-water mark from the start of prefill to the last token;
* KV bytes: what the cache stores after generation (eviction frees memory; it does not mask it).

The model is a real Llama-architecture model (SmolLM2-135M by default). Its trained context is 8k:
beyond it the generated text means nothing, but the cost of a step does not depend on that.

    python bench/bench_eviction.py --out bench/results/eviction_smollm2_h200 --batches 1,8

Results: ``bench/results/eviction_smollm2_h200/``, ``eviction_sablock_smollm2_h200/`` and
``eviction_llama3_8b_shape_h200/`` (``--skeleton``: a random-weight Llama-3-8B shape).
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
from kvpass.eval import (
    models,  # noqa: E402
    tasks,
)
from kvpass.eval.runner import Runner, cache_bytes  # noqa: E402


def prompt_ids(tok, length: int) -> list[int]:
    ids = tok(tasks.haystack_text(), add_special_tokens=False).input_ids
    return (ids * (-(-length // len(ids))))[:length]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def timed_decode(fwd, model, ids: torch.Tensor, new_tokens: int):
    """Prefill ``ids [B, N]`` then ``new_tokens - 1`` greedy steps, every row in lockstep.

    No attention mask is passed (rows are equal, nothing is padded), so the decode path is the
    same on every transformers version. Returns TTFT (s), TPOT (s), peak bytes, KV bytes, tokens.
    """
    cache = DynamicCache(config=model.config)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    sync()
    ttft, steps, out = time.perf_counter() - t0, [], []
    for _ in range(new_tokens - 1):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        t1 = time.perf_counter()
        logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        sync()
        steps.append(time.perf_counter() - t1)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    # the median step: the first decode step of a new (batch, length) may pay a Dynamo guard miss
    tpot = sorted(steps)[len(steps) // 2] if steps else float("nan")
    return ttft, tpot, peak, cache_bytes(cache), len(out) + 1


def skeleton_model(folder: Path, dtype, device):
    """The architecture and tokenizer of a converted model, with random weights."""
    cfg = transformers.AutoConfig.from_pretrained(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/eviction"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--skeleton",
        type=Path,
        default=None,
        help="a folder with the model's config and tokenizer but no weights: the model is built "
        "with random weights (timings do not depend on them; which tokens are kept does)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes (rows repeat the prompt)")
    ap.add_argument("--policies", default="full,snapkv,sablock")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=1 << 20,
        help="skip (batch, length) pairs with more prompt tokens than this (prefill memory)",
    )
    ap.add_argument(
        "--report", action="store_true", help="only rebuild eviction.json/.md from --out's meta.json and rows.jsonl"
    )
    args = ap.parse_args()
    if args.report:
        rows = [json.loads(x) for x in (args.out / "rows.jsonl").read_text().splitlines() if x.strip()]
        write_report(rows, json.loads((args.out / "meta.json").read_text()), args.out)
        return
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.skeleton is not None:
        model, tok = skeleton_model(args.skeleton, dtype, args.device)
        args.model = f"{args.skeleton.name} (random weights)"
    else:
        model, tok = models.load(args.model, dtype=dtype, device=args.device)
    runner = Runner(model, tok, args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    meta = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        model=args.model,
        dtype=str(dtype),
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        new_tokens=args.new_tokens,
        compiler=args.compiler,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta.json").write_text(json.dumps(meta))
    rows = []
    for spec in args.policies.split(","):
        params = {} if spec == "full" else {"budget": args.budget}
        be, fwd, compile_s = runner.compile(spec, params, args.compiler)
        for b in batches:
            # a new batch size may compile new graphs: warm them on a short prompt, untimed
            warm = torch.tensor([prompt_ids(tok, 2 * args.budget)] * b, device=args.device)
            timed_decode(fwd, model, warm, 3)
            for n in lengths:
                if b * n > args.max_tokens:
                    continue
                ids = torch.tensor([prompt_ids(tok, n)] * b, device=args.device)
                ttft, tpot, peak, kv, made = timed_decode(fwd, model, ids, args.new_tokens)
                rows.append(
                    dict(
                        policy=spec,
                        budget=params.get("budget"),
                        batch=b,
                        context=n,
                        new_tokens=made,
                        ttft_s=ttft,
                        tpot_ms=tpot * 1e3,
                        peak_gib=None if peak is None else peak / 2**30,
                        kv_mib=kv / 2**20,
                        compile_s=compile_s,
                        plans=be.plans(),
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
                with open(args.out / "rows.jsonl", "a") as f:  # kept if a later row dies or times out
                    f.write(json.dumps(rows[-1]) + "\n")
                del ids
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    write_report(rows, meta, args.out)


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    """eviction.json and eviction.md from the measured rows, with ratios to ``full`` at the same
    batch and context."""
    full = {(r["batch"], r["context"]): r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get((r["batch"], r["context"]))
        if f is not None:
            r["tpot_speedup_vs_full"] = f["tpot_ms"] / r["tpot_ms"]
            if r["peak_gib"] is not None:
                r["peak_reduction_vs_full"] = 1 - r["peak_gib"] / f["peak_gib"]
    (out / "eviction.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [
        f"# Prefill-time eviction at long context: {meta['model']}, {meta['device']}, {meta['date']}",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['dtype']}, {meta['new_tokens']} new "
        f"tokens, {meta['compiler']}. TPOT = median decode step. Speedup = full's TPOT / the policy's TPOT; "
        "reduction = 1 - peak / full's peak (same batch and context).",
        "",
        *([meta["note"], ""] if meta.get("note") else []),
        "| policy | budget | batch | context | TTFT s | TPOT ms | TPOT speedup | peak GiB | peak reduction | KV MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        red = f"{r['peak_reduction_vs_full']:.0%}" if "peak_reduction_vs_full" in r else "-"
        lines.append(
            f"| {r['policy']} | {r['budget'] or '-'} | {r['batch']} | {r['context']} | {r['ttft_s']:.2f} | "
            f"{r['tpot_ms']:.2f} | {r.get('tpot_speedup_vs_full', float('nan')):.2f} | {peak} | {red} | "
            f"{r['kv_mib']:.1f} |"
        )
    (out / "eviction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
