"""Accuracy by budget: one table from several ``kvpass compare`` runs (one run per budget), as the sweeps
``bench/calls/eviction_accuracy.sh`` and ``bench/calls/asl_accuracy.sh`` write them.

A policy's accuracy is only meaningful beside ``full``'s on the same tasks and against its own budget; this
puts every budget of a sweep in one table with ``full``, so the point where a policy falls off shows at once.

    python bench/accuracy_table.py bench/results/eviction_accuracy_smollm2_h200 > .../summary.md

Rows: policies; columns: budgets; cells: mean score over the run's tasks. A policy that failed
mid-run shows its score over the tasks it finished and how many; the reasons are listed below the
table. Then the mean score per task family (``niah/...``, ``ruler/...``) and, for gated policies,
the selection layers that ``kvpass compare`` recorded.

Results: the ``summary.md`` of ``bench/results/eviction_accuracy_smollm2_h200/``,
``eviction_accuracy_gemma3_h200/``, ``asl_accuracy_smollm2_h200/`` and ``asl_accuracy_gemma3_h200/``.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> dict[str, dict]:
    """``{run name: results.json}`` for every sub-folder with a results.json, full first, then by budget."""
    runs = {p.parent.name: json.loads(p.read_text()) for p in folder.glob("*/results.json")}
    budget = lambda name: (runs[name]["meta"].get("params") or {}).get("budget") or 0  # noqa: E731
    return {n: runs[n] for n in sorted(runs, key=lambda n: (n != "full", budget(n)))}


def mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def table(folder: Path) -> str:
    runs = load(folder)
    cols = []  # (label, run)
    cells: dict[str, dict[str, str]] = defaultdict(dict)
    families: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    notes, layers = [], []
    for name, run in runs.items():
        params = run["meta"].get("params") or {}
        label = str(params.get("budget") or name)
        if label not in cols:
            cols.append(label)
        # a run with other parameters (asl at tau 0.9 beside its default) gets rows of its own
        other = ", ".join(f"{k}={v}" for k, v in sorted(params.items()) if k != "budget")
        n_tasks = run["meta"]["n_tasks"]
        for s in run["summary"]:
            done = run["tasks"].get(s["policy"], [])
            s = dict(s, policy=f"{s['policy']} ({other})" if other else s["policy"])
            score = mean(t["score"] for t in done)
            text = "-" if score is None else f"{score:.3f}"
            if not s["available"]:
                text = f"{text} ({len(done)}/{n_tasks} tasks)" if done else "failed"
                notes.append(f"- {s['policy']} at {label}: {s['reason']}")
            cells[s["policy"]][label] = text
            by_family = defaultdict(list)
            for t in done:
                by_family[t["task"].split("/")[0] + "/" + t["task"].split("/")[1]].append(t["score"])
            for fam, xs in by_family.items():
                families[(s["policy"], fam)][label] = mean(xs)
            if s.get("selection_layers"):
                layers.append(
                    f"- {s['policy']} at {label}: "
                    + ", ".join(
                        f"{'none' if k in (None, 'None', 'null') else 'layer ' + str(k)} x{v}"
                        for k, v in s["selection_layers"].items()
                    )
                )
    meta = next(iter(runs.values()))["meta"]
    out = [
        f"# Accuracy by budget: {meta.get('model')}, tasks {', '.join(meta['tasks'])} at "
        f"{', '.join(str(x) for x in meta['lengths'])} tokens ({meta.get('gpu') or meta['device']}, torch "
        f"{meta['torch']}, transformers {meta['transformers']}, {meta['date'][:10]})",
        "",
        "Mean task score (NIAH: the needle recovered; RULER-style: the task's own metric). `full` keeps every token.",
        "",
        "| policy | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for policy, row in cells.items():
        out.append(f"| {policy} | " + " | ".join(row.get(c, "") for c in cols) + " |")
    out += ["", "## By task", "", "| policy | task | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for (policy, fam), row in sorted(families.items()):
        out.append(
            f"| {policy} | {fam} | " + " | ".join("" if row.get(c) is None else f"{row[c]:.3f}" for c in cols) + " |"
        )
    if layers:
        out += ["", "## Selection layers (tasks per layer; none: the rule never fired)", "", *layers]
    if notes:
        out += ["", "## Failures", "", *notes]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a sweep's folder: one sub-folder of kvpass compare results per budget")
    print(table(ap.parse_args().folder), end="")
