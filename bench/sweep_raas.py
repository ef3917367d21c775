"""Accuracy of decode-time policies on the long-decode task, and RaaS's alpha sweep, in one process.

Through ``kvpass.eval.Runner`` (what ``kvpass compare`` runs): ``full`` generates each reference
continuation once; every other configuration is teacher-forced on it and scored by greedy-token
agreement and the perplexity of the reference continuation. Unlike one ``kvpass compare`` per
budget, ``full`` runs only once for all configurations, which matters on a CPU.

Configurations: ``--policies`` at every ``--budgets`` (alpha at its default), then ``raas`` at
``--alpha-budget`` for every ``--alphas``. Results are written after every configuration
(``results.json``, ``summary.md``), so a partial run is usable.

    # the committed CPU run (rows split over processes with --configs, merged afterwards)
    python bench/sweep_raas.py --length 512 --new-tokens 256 --seeds 0 --budgets 64 \\
        --alphas 0.005,0.01,0.02,0.05,0.1 --alpha-budget 64 --out bench/results/raas_sweep_smollm2_cpu
    # the full grid on a GPU (bf16, Inductor)
    python bench/sweep_raas.py --device cuda --length 1024 --new-tokens 1024 --seeds 0,1,2 \\
        --budgets 128,256,512,1024 --alphas 0.005,0.01,0.02,0.05,0.1 --alpha-budget 128 \\
        --out bench/results/raas_sweep_smollm2_gpu

Results: ``bench/results/raas_sweep_smollm2_cpu/`` and ``bench/results/raas_sweep_smollm2_h200/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvpass.eval import models, report
from kvpass.eval.runner import Runner
from kvpass.eval.tasks import long_decode
from kvpass.policies import POLICIES


def configs(args) -> list[tuple[str, dict]]:
    if args.configs:  # explicit policy@budget list, alpha at its default
        return [(c.split("@")[0], {"budget": int(c.split("@")[1])}) for c in args.configs.split(",")]
    out = []
    # the alpha sweep first (the default's choice depends on it), then the policies by budget
    default_alpha = next(p.default for p in POLICIES["raas"].params if p.name == "alpha")
    for a in args.alphas:
        out.append(("raas", {"budget": args.alpha_budget, "alpha": a}))
    for b in args.budgets:
        for p in args.policies:
            cfg = {"budget": b}
            if p == "raas" and (b, default_alpha) in {(c[1]["budget"], c[1].get("alpha")) for c in out}:
                continue
            if p == "raas" and (b // 16 + 1) * 16 >= args.new_tokens:
                continue  # the decode pages hold every new token: nothing is evicted, raas equals full
            out.append((p, cfg))
    return out


def row(spec: str, params: dict, res) -> dict:
    s = res.summary()
    return {
        "policy": spec,
        **params,
        "agreement": s["accuracy"],
        "ppl": s["ppl"],
        "kv_bytes": s["kv_bytes"],
        "tpot_s": s["tpot_s"],
        "blocks_read": s["blocks_read"],
        "tasks": s["tasks"],
        "per_task": [{"task": t.task, "seed_agreement": t.score, "ppl": t.ppl} for t in res.tasks],
    }


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# Long-decode accuracy: {meta['model']}, {meta['length']}-token prompt, {meta['new_tokens']} "
        f"new tokens, seeds {meta['seeds']} ({meta['device']}, {meta['torch']})",
        "",
        "Agreement: fraction of steps whose greedy token equals `full`'s (teacher-forced on `full`'s "
        "continuation); ppl: perplexity of that continuation. KV: bytes the cache stores at the end.",
        "",
        "raas rows are left out where budget/16 + 1 decode pages hold every new token (nothing is "
        "evicted, so raas equals full by construction).",
        "",
        "| policy | budget | alpha | agreement | ppl | KV MiB | pages read | TPOT s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        lines.append(
            f"| {r['policy']} | {r.get('budget', '')} | {r.get('alpha', '')} | {fmt(r['agreement'], '.4f')} "
            f"| {fmt(r['ppl'], '.4f')} | {fmt(r['kv_bytes'] and r['kv_bytes'] / 2**20, '.1f')} "
            f"| {fmt(r['blocks_read'], '.2f')} | {fmt(r['tpot_s'], '.3f')} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--policies", default="raas,quest,streamingllm")
    ap.add_argument("--budgets", default="128,256,512,1024")
    ap.add_argument("--alphas", default="0.005,0.01,0.02,0.05,0.1")
    ap.add_argument("--alpha-budget", type=int, default=128)
    ap.add_argument("--configs", default="", help="instead of the grid: policy@budget,... (e.g. quest@64)")
    ap.add_argument("--nice", action="store_true", help="one CPU thread (a shared machine)")
    ap.add_argument("--compiler", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.policies = args.policies.split(",")
    args.budgets = [int(b) for b in args.budgets.split(",") if b]
    args.alphas = [float(a) for a in args.alphas.split(",") if a]
    if args.nice:
        torch.set_num_threads(1)
    compiler = args.compiler or ("inductor" if args.device.startswith("cuda") else "eager")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, tok = models.load(args.model, dtype=dtype, device=args.device)
    tasks = [long_decode.continuation(tok, args.length, s, args.new_tokens) for s in args.seeds]
    for t in tasks:
        t.max_new_tokens = args.new_tokens
    runner = Runner(model, tok, args.device)
    meta = {
        **report.environment(args.device),
        "model": args.model,
        "length": args.length,
        "new_tokens": args.new_tokens,
        "seeds": args.seeds,
        "compiler": compiler,
    }
    refs: dict = {}
    t0 = time.perf_counter()
    full = runner.run("full", {}, tasks, compiler=compiler, references=refs)
    rows = [row("full", {}, full)]
    write(args.out, meta, rows)
    for spec, params in configs(args):
        t1 = time.perf_counter()
        res = runner.run(spec, params, tasks, compiler=compiler, references=refs)
        rows.append(row(spec, params, res))
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        write(args.out, meta, rows)
        r = rows[-1]
        print(
            f"{spec} {params}: agreement {r['agreement']:.4f} ppl {r['ppl']:.4f} ({time.perf_counter() - t1:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
