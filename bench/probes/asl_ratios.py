"""Where would ASL's rule fire? The rank-variance ratio ``var / var0`` per layer on a real model.

Runs only the prefill of ``asl`` with ``tau = 0`` (the rule never fires, so every candidate layer
computes its ratio on the whole prompt) over NIAH + RULER-style prompts, and records each layer's
ratio from ``Backend.gate_info``. The selection layer at a threshold ``tau`` is the first candidate
layer whose ratio is below it, so one pass gives the selection-layer distribution for every tau:

    python bench/probes/asl_ratios.py --lengths 2k,4k --out bench/results/asl_ratios_smollm2_cpu

Writes ``ratios.json`` (per task: every layer's ratio) and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kvpass  # noqa: E402
from kvpass.cli import parse_length
from kvpass.eval import models
from kvpass.eval import tasks as T

TAUS = (0.3, 0.5, 0.7, 0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="niah,ruler")
    ap.add_argument("--lengths", default="2k,4k")
    ap.add_argument("--depths", default="0,0.5,1")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model, tok = models.load(
        args.model, dtype=torch.float32 if args.device == "cpu" else torch.bfloat16, device=args.device
    )
    depths = [float(d) for d in args.depths.split(",")]
    tasks = [
        t
        for family in args.task.split(",")
        for n in args.lengths.split(",")
        for t in T.build(family, tok, [parse_length(n)], **({"depths": depths} if family == "niah" else {}))
    ]
    be = kvpass.backend("asl", compiler="eager", budget=args.budget, tau=0.0)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)
    rows = []
    t0 = time.perf_counter()
    for i, task in enumerate(tasks):
        with torch.no_grad():
            fwd(input_ids=torch.tensor([task.input_ids], device=args.device), logits_to_keep=1)
        info = be.gate_info
        ratios = {int(k): v[0] for k, v in (info or {}).get("ratios", {}).items()}
        rows.append(dict(task=task.name, length=len(task.input_ids), ratios=ratios))
        print(
            f"[{i + 1}/{len(tasks)}] {task.name} {len(task.input_ids)}: min ratio "
            f"{min(ratios.values(), default=float('nan')):.3f} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ratios.json").write_text(
        json.dumps(dict(model=args.model, budget=args.budget, rows=rows, torch=torch.__version__), indent=1)
    )
    lines = [
        f"# ASL's rank-variance ratio per layer: {args.model}, budget {args.budget}, {len(rows)} prompts "
        f"({args.task} at {args.lengths}; {args.device}, torch {torch.__version__})",
        "",
        "The rule selects the first candidate layer whose ratio var/var0 is below tau (prompts no longer "
        "than the budget have no ratios: nothing to select).",
        "",
        "| tau | prompts that select | selection layers |",
        "|---|---|---|",
    ]
    with_ratios = [r for r in rows if r["ratios"]]
    for tau in TAUS:
        layers = Counter(
            next((layer for layer, x in sorted(r["ratios"].items()) if x < tau), None) for r in with_ratios
        )
        fired = sum(v for k, v in layers.items() if k is not None)
        lines.append(
            f"| {tau} | {fired} / {len(with_ratios)} | "
            + ", ".join(
                f"{'none' if k is None else k} x{v}"
                for k, v in sorted(layers.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
            )
            + " |"
        )
    per_layer = {}
    for r in with_ratios:
        for layer, x in r["ratios"].items():
            per_layer.setdefault(layer, []).append(x)
    lines += ["", "| layer | min ratio | median ratio | max ratio |", "|---|---|---|---|"]
    for layer, xs in sorted(per_layer.items()):
        xs = sorted(xs)
        lines.append(f"| {layer} | {xs[0]:.3f} | {xs[len(xs) // 2]:.3f} | {xs[-1]:.3f} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
