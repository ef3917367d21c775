"""Output of a comparison: a terminal table, JSON + CSV files, and NIAH depth x length heatmaps."""

from __future__ import annotations

import csv
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_s(x) -> str:
    return "-" if x is None else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


def environment(device: str) -> dict:
    import transformers

    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def table_rows(results, params: dict | None = None) -> list[list[str]]:
    """One row per policy; ``params`` are the run's (a ``budget`` that a policy other than ``full`` does not
    take, such as ``art``'s, is noted)."""
    full = next((r.summary() for r in results if r.policy == "full" and r.available), None)
    rows = []
    for r in results:
        s = r.summary()
        if not r.available:
            rows.append([r.policy, "failed" if r.failed else "unavailable", "-", "-", "-", "-", "-", r.reason or ""])
            continue
        kv = fmt_bytes(s["kv_bytes"])
        if full and full["kv_bytes"] and s["kv_bytes"] is not None and r.policy != "full":
            kv += f" ({s['kv_bytes'] / full['kv_bytes']:.0%})"
        acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
        notes = [f"ppl {s['ppl']:.2f}"] if s["ppl"] is not None else []
        if (params or {}).get("budget") is not None and r.policy != "full" and not takes_budget(r.policy):
            notes.append("no budget: --budget not used, keeps every entry")
        if s["blocks_read"] is not None:
            notes.append(f"read {s['blocks_read']:.0%} of KV blocks")
        if s["selection_layers"]:
            notes.append(
                "selected at "
                + ", ".join(f"{'none' if k is None else f'layer {k}'} x{n}" for k, n in s["selection_layers"].items())
            )
        rows.append(
            [
                r.policy,
                acc,
                kv,
                fmt_bytes(s["peak_mem"]),
                fmt_s(s["ttft_s"]),
                fmt_s(s["tpot_s"]),
                fmt_s(s["compile_s"]),
                "; ".join(notes),
            ]
        )
    return rows


HEADER = ["policy", "accuracy", "KV cache (mean)", "peak mem", "TTFT", "TPOT", "compile", "notes"]


def footnote(results) -> str:
    """What the table's means are over: tasks of every length together."""
    lengths = sorted({t.length for r in results for t in r.tasks if t.length is not None})
    over = (
        f"tasks of lengths {', '.join(map(str, lengths))} tokens together"
        if len(lengths) > 1
        else f"tasks ({lengths[0]} tokens)"
        if lengths
        else "tasks"
    )
    return (
        f"accuracy, KV cache, peak mem, TTFT and TPOT: mean over {over}; KV cache: bytes the cache "
        f"holds after a task's generation (x%: of full's); per task: results.csv"
    )


def print_table(results, title: str, params: dict | None = None) -> None:
    """The comparison table on the terminal (rich when installed), under ``title``, with its footnote."""
    rows = table_rows(results, params)
    note = footnote(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
        print(title)
        for r in [HEADER] + rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        print(note)
        return
    table = Table(title=title, caption=note, caption_justify="left")
    for h in HEADER:
        table.add_column(h, justify="left" if h in ("policy", "notes") else "right", no_wrap=h != "notes")
    for r in rows:
        table.add_row(*r)
    console = Console()
    if not console.is_terminal:  # pipes and logs: don't squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)


def write(results, out_dir: Path, meta: dict) -> list[Path]:
    """results.json (everything, failed policies with their error and the tasks done before it),
    results.csv (one row per policy x task) and heatmap PNGs (one per policy and heatmaps.png with all of
    them side by side); a policy that failed mid-run has no rows or heatmap, as it has no complete result. The
    folder's other heatmaps (an earlier run's) are removed: every figure there is of these results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "meta": meta,
        "summary": [r.summary() for r in results],
        "tasks": {r.policy: [t.row() for t in r.tasks] for r in results},
    }
    complete = [r for r in results if not r.failed]
    paths = [out_dir / "results.json", out_dir / "results.csv"]
    paths[0].write_text(json.dumps(data, indent=2))
    with paths[1].open("w", newline="") as f:
        fields = [
            "policy",
            "task",
            "family",
            "length",
            "depth",
            "score",
            "kv_bytes",
            "peak_mem",
            "ttft_s",
            "tpot_s",
            "new_tokens",
            "ppl",
            "selection_layer",
            "output",
        ]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in complete:
            for t in r.tasks:
                w.writerow({"policy": r.policy, **{k: v for k, v in t.row().items() if k in fields}})
    for r in complete:
        p = heatmap(r, out_dir, meta)
        if p:
            paths.append(p)
    p = heatmaps(complete, out_dir, meta)
    if p:
        paths.append(p)
    for stale in {*out_dir.glob("heatmap_*.png"), out_dir / "heatmaps.png"} - set(paths):
        stale.unlink(missing_ok=True)  # an earlier run's figure beside results that no longer hold its policy
    return paths


def _niah_cells(result) -> dict[tuple[float, int], list[float]]:
    cells: dict[tuple[float, int], list[float]] = {}
    for t in result.tasks:
        if t.family == "niah" and t.depth is not None:
            cells.setdefault((t.depth, t.length), []).append(t.score)
    return cells


def _samples_text(cells: dict) -> str:
    counts = sorted({len(v) for v in cells.values()})
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{n} sample{'s' if counts[-1] != 1 else ''} per cell"


def takes_budget(policy: str) -> bool:
    """Whether the policy (or a member of ``a+b``) declares a ``budget``; ``full`` and ``art`` do not."""
    return not budget_text(policy, None).startswith("no budget")


def budget_text(policy: str, params: dict | None) -> str:
    """The budget a policy ran with: the one given, else its default; "no budget" for policies
    (``full``) that keep every entry."""
    from kvpass.policies import POLICIES

    for name in policy.split("+") if policy.strip() not in POLICIES else [policy.strip()]:
        cls = POLICIES.get(name.strip())
        declared = {p.name: p.default for p in cls.params} if cls is not None else {}
        if "budget" in declared:
            given = (params or {}).get("budget")
            return f"budget {given}" if given is not None else f"budget {declared['budget']} (default)"
    return "no budget (keeps all)"


def _params(result, meta: dict) -> dict | None:
    """The parameters a policy ran with (its own, else the run's)."""
    own = getattr(result, "params", None)
    return own if own is not None else meta.get("params")


def _plot_grid(ax, cells: dict, depths: list, lengths: list):
    grid = [
        [(sum(cells[(d, n)]) / len(cells[(d, n)])) if (d, n) in cells else float("nan") for n in lengths]
        for d in depths
    ]
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    return im


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(result, out_dir: Path, meta: dict | None = None) -> Path | None:
    """NIAH accuracy over depth (rows) x context length (columns) for one policy; the title names the
    model, the budget and the samples per cell (``meta``: the run's, with ``model`` and ``params``)."""
    cells = _niah_cells(result)
    if not cells:
        return None
    plt = _pyplot()
    meta = meta or {}
    depths = sorted({d for d, _ in cells})
    lengths = sorted({n for _, n in cells})
    fig, ax = plt.subplots(figsize=(max(4.2, 1.2 + 1.1 * len(lengths)), 1.5 + 0.5 * len(depths)))
    im = _plot_grid(ax, cells, depths, lengths)
    ax.set_ylabel("needle depth")
    model = f"{meta['model']} | " if meta.get("model") else ""
    ax.set_title(
        f"NIAH accuracy: {result.policy}\n{model}{budget_text(result.policy, _params(result, meta))} | "
        f"{_samples_text(cells)}",
        fontsize=9,
    )
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    path = out_dir / f"heatmap_{result.policy.replace('+', '_')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmaps(results, out_dir: Path, meta: dict | None = None) -> Path | None:
    """heatmaps.png: the NIAH heatmaps of all policies side by side, on the same depth x length axes
    and colour scale; the title names the model and the samples per cell, each panel its budget."""
    panels = [(r, _niah_cells(r)) for r in results]
    panels = [(r, c) for r, c in panels if c]
    if not panels:
        return None
    plt = _pyplot()
    meta = meta or {}
    depths = sorted({d for _, c in panels for d, _ in c})
    lengths = sorted({n for _, c in panels for _, n in c})
    width = max(3.0, 0.9 + 1.0 * len(lengths))
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(width * len(panels) + 1.0, 2.0 + 0.5 * len(depths)),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    im = None
    for ax, (r, cells) in zip(axes[0], panels):
        im = _plot_grid(ax, cells, depths, lengths)
        ax.set_title(f"{r.policy}\n{budget_text(r.policy, _params(r, meta))}", fontsize=9)
    axes[0][0].set_ylabel("needle depth")
    samples = sorted({n for _, c in panels for n in [len(v) for v in c.values()]})
    n = str(samples[0]) if len(samples) == 1 else f"{samples[0]}-{samples[-1]}"
    model = f"{meta['model']} | " if meta.get("model") else ""
    fig.suptitle(f"NIAH accuracy | {model}{n} sample{'s' if samples[-1] != 1 else ''} per cell", fontsize=10)
    fig.colorbar(im, ax=list(axes[0]), shrink=0.9)
    path = out_dir / "heatmaps.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
