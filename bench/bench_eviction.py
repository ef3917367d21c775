"""Issue 5's benchmark: decode speed (TPOT) and peak GPU memory of prefill-time eviction at long context.

For each context length (32k, 64k, 128k by default) every policy prefills the same prompt (Paul
Graham essays, repeated to length) through ``torch.compile(model.forward, backend=kvpass.backend(...))``
with Inductor, then decodes ``--new-tokens`` greedy tokens. All policies run in one process on the
same GPU; each policy compiles once (``Runner.compile`` warms up on a short prompt, so compile time
never leaks into the timings) and then serves every length. Reported per (policy, length):

* TPOT: mean wall time of a decode step (synchronised);
* TTFT: prefill time;
* peak GPU memory: the allocator's high-water mark from the start of prefill to the last token;
* KV bytes: what the cache stores after generation (eviction frees memory; it does not mask it).

The model is a real Llama-architecture model (SmolLM2-135M by default). Its trained context is 8k:
beyond it the generated text means nothing, but the cost of a step does not depend on that.

    python bench/bench_eviction.py --out bench/results/eviction_smollm2_h200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpass import models, tasks  # noqa: E402
from kvpass.eval.runner import Runner, cache_bytes  # noqa: E402


def prompt_ids(tok, length: int) -> list[int]:
    ids = tok(tasks.haystack_text(), add_special_tokens=False).input_ids
    return (ids * (-(-length // len(ids))))[:length]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("bench/results/eviction"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--policies", default="full,snapkv,sablock")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--compiler", default="inductor")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tok = models.load(args.model, dtype=dtype, device=args.device)
    runner = Runner(model, tok, args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for spec in args.policies.split(","):
        params = {} if spec == "full" else {"budget": args.budget}
        be, fwd, compile_s = runner.compile(spec, params, args.compiler)
        for n in lengths:
            ids = prompt_ids(tok, n)
            tokens, ttft, tpot, _, cache, peak = runner.generate(fwd, ids, args.new_tokens, stop_at_eos=False)
            rows.append(dict(policy=spec, budget=params.get("budget"), context=n, new_tokens=len(tokens),
                             ttft_s=ttft, tpot_ms=tpot * 1e3, peak_gib=None if peak is None else peak / 2**30,
                             kv_mib=cache_bytes(cache) / 2**20, compile_s=compile_s))
            print(json.dumps(rows[-1]), flush=True)
            del cache
            if args.device == "cuda":
                torch.cuda.empty_cache()
    full = {r["context"]: r for r in rows if r["policy"] == "full"}
    for r in rows:
        f = full.get(r["context"])
        if f is not None:
            r["tpot_speedup_vs_full"] = f["tpot_ms"] / r["tpot_ms"]
            if r["peak_gib"] is not None:
                r["peak_reduction_vs_full"] = 1 - r["peak_gib"] / f["peak_gib"]
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), model=args.model, dtype=str(dtype),
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                batch=1, new_tokens=args.new_tokens, compiler=args.compiler)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eviction.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [f"# Prefill-time eviction at long context: {args.model}, {meta['device']}, {meta['date']}", "",
             f"torch {meta['torch']}, {meta['dtype']}, batch 1, {args.new_tokens} new tokens, {args.compiler}. "
             "Speedup = full's TPOT / the policy's TPOT; reduction = 1 - peak / full's peak (same context).", "",
             "| policy | budget | context | TTFT s | TPOT ms | TPOT speedup | peak GiB | peak reduction | KV MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        red = f"{r['peak_reduction_vs_full']:.0%}" if "peak_reduction_vs_full" in r else "-"
        lines.append(f"| {r['policy']} | {r['budget'] or '-'} | {r['context']} | {r['ttft_s']:.2f} | {r['tpot_ms']:.2f} | "
                     f"{r.get('tpot_speedup_vs_full', float('nan')):.2f} | {peak} | {red} | {r['kv_mib']:.1f} |")
    (args.out / "eviction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
