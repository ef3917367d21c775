"""Leaderboard tables from ``kvpass compare`` results: methods x compression ratios, one benchmark per table.

kvpress publishes its leaderboard as a score per press and compression ratio (the fraction of the KV cache
dropped), one benchmark at a time. ``kvpass leaderboard FOLDER...`` reads the ``results.json`` of runs at different
budgets (each ``kvpass compare`` run is one budget) and writes the same shape:

* ``leaderboard.md``: per benchmark (a task family: ``ruler``, ``longbench``, ``niah``, ...) a table whose rows are
  the policies and whose columns are the runs' budgets; a cell is the score (x100), the mean over the benchmark's
  subsets of each subset's mean (the macro average RULER and LongBench report), and the measured compression ratio
  (a policy's ratio at one budget is its own: per-head and decode-time policies store differently). One context
  length per run: subsets of several lengths would be averaged together;
* ``leaderboard.csv``: one row per (benchmark, policy, budget) with its ratio, score and tasks;
* ``leaderboard.png``: per benchmark, score against compression ratio, a line per policy (matplotlib, when
  installed).

The compression ratio is measured, not nominal: ``1 - kv_bytes / kv_bytes of full`` on the same tasks (``full``
from the same folder, else from another folder with the same model and tasks), so a budget above a prompt counts
as no compression and per-head or decode-time policies count what they really store after the last step.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path


def collect(folders: list[Path]) -> list[dict]:
    """One record per (folder, benchmark, policy): model, budget, score, kv bytes, tasks, the ratio (None until
    ``ratios`` fills it)."""
    out = []
    for folder in folders:
        path = Path(folder) / "results.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no results.json (pass folders that `kvpass compare --out` wrote)")
        data = json.loads(path.read_text())
        meta = data.get("meta", {})
        for policy, rows in data.get("tasks", {}).items():
            by_family: dict[str, list[dict]] = defaultdict(list)
            for r in rows:
                by_family[r["family"]].append(r)
            for family, rs in by_family.items():
                subsets: dict[str, list[float]] = defaultdict(list)
                for r in rs:
                    subsets[r["task"]].append(r["score"])
                out.append(
                    {
                        "folder": str(folder),
                        "model": meta.get("model"),
                        "benchmark": family,
                        "policy": policy,
                        "setting": (meta.get("dtype"), meta.get("max_new_tokens")),
                        "budget": (meta.get("params") or {}).get("budget"),
                        "score": 100 * sum(sum(v) / len(v) for v in subsets.values()) / len(subsets),
                        "kv_bytes": sum(r["kv_bytes"] for r in rs) / len(rs),
                        "tasks": len(rs),
                        "keys": sorted((r["task"], r["length"]) for r in rs),
                        "ratio": None,
                    }
                )
    ratios(out)
    return out


def ratios(records: list[dict]) -> None:
    """Each record's compression ratio against ``full`` on the same model and tasks (its own folder's first)."""
    for rec in records:
        fulls = [
            r
            for r in records
            if r["policy"] == "full"
            and r["model"] == rec["model"]
            and r["setting"] == rec["setting"]
            and r["benchmark"] == rec["benchmark"]
            and r["keys"] == rec["keys"]
        ]
        fulls.sort(key=lambda r: r["folder"] != rec["folder"])
        if fulls and fulls[0]["kv_bytes"]:
            rec["ratio"] = max(0.0, 1.0 - rec["kv_bytes"] / fulls[0]["kv_bytes"])


def markdown(records: list[dict]) -> str:
    """One table per benchmark: policies x budgets (one column per run), each cell the score x100 and the measured
    compression ratio."""
    lines = [
        "# Leaderboard",
        "",
        "Score (x100, the mean of the benchmark's subset means) and, in brackets, the measured compression ratio "
        "(1 - KV bytes / full's KV bytes on the same tasks, model, dtype and generation length; `?`: no such "
        "`full` run), one column per budget.",
        "",
    ]
    for bench in sorted({r["benchmark"] for r in records}):
        rows = [r for r in records if r["benchmark"] == bench]
        cols = sorted({r["budget"] for r in rows}, key=lambda b: (b is not None, b or 0))
        models = sorted({str(r["model"]) for r in rows})
        lines += [
            f"## {bench} ({', '.join(models)})",
            "",
            "| policy | " + " | ".join("no budget" if c is None else f"budget {c}" for c in cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for policy in sorted({r["policy"] for r in rows}, key=lambda p: (p != "full", p)):
            cells: dict = {}
            for r in rows:
                if r["policy"] == policy:
                    ratio = "?" if r["ratio"] is None else f"{r['ratio']:.2f}"
                    cells.setdefault(r["budget"], []).append(f"{r['score']:.1f} ({ratio})")
            lines.append(f"| {policy} | " + " | ".join(", ".join(cells.get(c, [])) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> Path | None:
    """Score against compression ratio, a line per policy, a panel per benchmark; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    benches = sorted({r["benchmark"] for r in records})
    fig, axes = plt.subplots(1, len(benches), figsize=(5 * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        rows = [r for r in records if r["benchmark"] == bench and r["ratio"] is not None]
        for policy in sorted({r["policy"] for r in rows}):
            pts = sorted((r["ratio"], r["score"]) for r in rows if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set(title=bench, xlabel="compression ratio", ylabel="score", xlim=(-0.02, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(folders: list[Path], out: Path) -> list[Path]:
    """``leaderboard.md``, ``leaderboard.csv`` and (with matplotlib) ``leaderboard.png`` in ``out``."""
    records = collect(folders)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "leaderboard.md", out / "leaderboard.csv"]
    paths[0].write_text(markdown(records))
    with paths[1].open("w", newline="") as fh:
        fields = ["benchmark", "model", "policy", "budget", "ratio", "score", "tasks", "kv_bytes", "folder"]
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(sorted(records, key=lambda r: (r["benchmark"], r["policy"], r["ratio"] or 0)))
    png = plot(records, out / "leaderboard.png")
    return paths + ([png] if png else [])
