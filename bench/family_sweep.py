#!/usr/bin/env python
"""Sweep kvpass over every causal-LM model type transformers ships.

kvpass rewrites the attention it finds in a traced graph, and every family writes its attention its own way;
the sweep shows, family by family, whether kvpass applies a policy exactly or says that it did not (never a
silent wrong answer).

What it measures: for each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny randomly initialised
model (built from the type's config class, its sizes shrunk; no download) greedily generates NEW_TOKENS tokens
from a fixed random prompt uncompiled, then once per (path, policy) compiled through kvpass at a setting that
evicts nothing (a budget far above the sequence). The compiled tokens must equal the uncompiled ones. Paths:

    plain   model.forward = torch.compile(model.forward, backend=kvpass.backend(policy, compiler="eager"),
                                          dynamic=True); model.generate(...)
    fast    kvpass.compile(model, policy, compiler="eager"); model.generate(...)

Verdict per (type, path, policy):

    exact      tokens equal, at least one attention site rewritten by the policy, no KVPassWarning
    warned     a KVPassWarning was raised, or kvpass refused (ConfigError / a message starting "kvpass"),
               and the tokens (where it ran) equal the uncompiled ones
    unapplied  tokens equal, no warning, no site rewritten (kvpass found nothing to apply the policy to)
    wrong      tokens differ (with or without a warning: a warning means "compiled unchanged")
    crash      any other exception, or the type's subprocess timed out / died
    skip       (per type) the type does not build, is not a decoder-only model taking input_ids, or cannot
               generate uncompiled

Each type runs in its own subprocess (``--timeout`` seconds for all its runs), so a hang or a crash costs one
type. Output under ``--out``: ``results.jsonl`` (one record per type/path/policy, plus skip records) and
``results.md`` (counts per policy and path, a row per type, the detail of every verdict other than exact).

    python bench/family_sweep.py                                  # every type, one process at a time
    python bench/family_sweep.py --types llama,gpt2 --policies full,snapkv --paths plain

The per-type core, ``run_type(model_type, policies, paths)``, runs in-process; tests/test_family_sweep.py
calls it on a fixed sample of families.

Results: ``bench/results/family_sweep_2026-12-04/``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# -------------------------------------------------------------------------------------------------------
# what runs
# -------------------------------------------------------------------------------------------------------


class StandInTokenizer:
    """kvzip's repeat prompts as a few ids per text, inside any tiny vocabulary (ids 3..22, in the prompt's range)."""

    name_or_path = "stand-in"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % 20 for c in text.strip()[:4]] or [4]


BUDGET = 100_000  # far above PROMPT_LEN + NEW_TOKENS: no policy evicts anything
POLICIES = {  # one policy of each kind kvpass has, at a setting that evicts nothing
    "full": {},  # identity: exact attention through kvpass's operator
    "snapkv": {"budget": BUDGET},  # prefill eviction
    "h2o": {"budget": BUDGET},  # decode-time eviction
    # page policy; dense_layers=0: its default (2) keeps every layer of a 2-layer model dense (quest = full)
    "quest": {"budget": BUDGET, "dense_layers": 0},
    # gated prefill; layer=0: its default (layers // 2) is the last layer of a 2-layer model (no gate placed)
    "fastkv": {"budget": BUDGET, "layer": 0},
    # prefill evictions whose plans read more of the graph: the query before RoPE and the RoPE tables
    # (expected_attention), the output projection's weight (criticalkv); refused where it is not matched
    "expected_attention": {"budget": BUDGET},
    "criticalkv": {"budget": BUDGET},
    # per-head prefill eviction by repeat passes over the prompt, which kvpass.compile runs (the plain path keeps
    # every entry and says so); its repeat prompts are text, tokenized by a stand-in
    "kvzip": {"budget": BUDGET, "tokenizer": StandInTokenizer()},
    # expected_attention cutting during decoding: its decode graphs run the selection on a DynamicCache and fold the
    # query before RoPE into the state on a SlotCache, whose calls kvpass wraps for the cuts (none comes here)
    "expected_attention@decode": {"budget": BUDGET, "decode_interval": 16},
}

PATHS = ("plain", "fast")
VERDICTS = ("exact", "warned", "unapplied", "wrong", "crash")
PROMPT_LEN, NEW_TOKENS, SEED = 24, 8, 0
HEAD_SCALE = 8.0  # output head sharpened, so greedy decoding is not tie-prone (as tests/families.py)

# -------------------------------------------------------------------------------------------------------
# shrinking a config: generic rules over the config's own field names
# -------------------------------------------------------------------------------------------------------

NEW_LAYERS = 2  # at least; more where the per-layer lists have more kinds of layer (at most MAX_LAYERS)
MAX_LAYERS = 4
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_blocks",
)
SIZES = {  # field -> (new value, applied only when the field's value is larger)
    **dict.fromkeys(
        (
            "hidden_size",
            "n_embd",
            "d_model",
            "emb_dim",
            "embedding_dim",
            "embed_dim",
            "dim",
            "attention_hidden_size",
            "lru_width",
            "input_embedding_size",
            "output_embedding_size",
            "embedding_size",
            "backbone_hidden_size",
        ),
        64,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "n_heads",
            "attention_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "swa_num_attention_heads",
            "linear_num_heads",
            "linear_num_value_heads",
            "index_n_heads",
        ),
        4,
    ),
    **dict.fromkeys(
        (
            "num_key_value_heads",
            "num_kv_heads",
            "n_kv_heads",
            "n_head_kv",
            "multi_query_group_num",
            "num_query_groups",
            "swa_num_key_value_heads",
            "linear_num_key_heads",
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "head_dim",
            "d_head",
            "attention_head_size",
            "dim_head",
            "kv_channels",
            "attention_head_dim",
            "swa_head_dim",
            "global_head_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_head_dim",
            "index_head_dim",
            "v_head_dim",
            "qk_head_dim",
        ),
        16,
    ),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),  # MLA: qk_head_dim = nope + rope
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 32),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "zero_expert_num"), 4),
    **dict.fromkeys(
        ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts", "num_selected_experts"),
        2,
    ),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group"), 1),  # expert groups: one group
    **dict.fromkeys(
        ("vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "unpadded_vocab_size", "output_vocab_size"),
        128,
    ),
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "max_target_positions",
            "context_length",
            "model_max_length",
            "original_max_position_embeddings",
        ),
        512,
    ),
    **dict.fromkeys(
        (
            "sliding_window",
            "window_size",
            "attention_window_size",
            "sliding_window_size",
            "local_attention_window_len",
            "attention_chunk_size",
        ),
        8,
    ),  # shorter than the prompt
    "hidden_size_per_layer_input": 16,
    "rotary_dim": 8,
    "index_num_heads": 2,
    "index_n_heads": 2,
    "mamba_d_state": 16,
    "state_size": 16,
    "mamba_d_head": 16,
    "mamba_headdim": 16,
    "time_step_rank": 8,
    # leading dense layers / layer periods: the two layers keep one of each kind
    **dict.fromkeys(
        (
            "first_k_dense_replace",
            "num_dense_layers",
            "num_dense_blocks",
            "moe_layer_start_index",
            "num_kv_shared_layers",
        ),
        1,
    ),
    **dict.fromkeys(
        (
            "sliding_window_pattern",
            "_sliding_window_pattern",
            "global_attn_every_n_layers",
            "global_attention_every_n_layers",
            "no_rope_layer_interval",
            "interleave_moe_layer_step",
            "attn_layer_period",
            "expert_layer_period",
            "decoder_sparse_step",
            "moe_layer_interval",
        ),
        2,
    ),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), 1),
}
INTERMEDIATE, MOE_INTERMEDIATE = 96, 32
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
# a default some configs leave unset (None) although their model cannot be built without it
NONE_DEFAULTS = {"head_dim": 16, "num_key_value_heads": 2, "num_experts_per_tok": 2}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
PROMPT_HIGH = 100  # prompt tokens are drawn from [3, PROMPT_HIGH); other special token ids go above it

# The few fields the generic rules cannot guess, per model type. Keep it short; say why for each.
OVERRIDES: dict[str, dict] = {
    # the attention block reads the hidden state concatenated with the embeddings: twice hidden_size
    "zamba": {"attention_hidden_size": 128, "attention_head_dim": 32},
    "zamba2": {"attention_hidden_size": 128, "attention_head_dim": 32},
    # block_types is a pattern cycled over the layers (not one entry per layer): two layers need both kinds
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # the defaults leave the MoE unsized (no expert count) or the layer kinds unset
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # hybrids whose defaults have no attention layer at all (and so no KV cache for kvpass)
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
}


def _is_sub(v) -> bool:
    """A nested config, as ``to_dict`` writes it (text_config, vision_config, ...)."""
    return isinstance(v, dict) and "model_type" in v


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _index_list(k: str, v, old: int) -> bool:
    """A list of layer indices (``mlp_only_layers``, ``hybrid_layer_ids``...), not one entry per layer."""
    return (
        isinstance(v, list)
        and bool(v)
        and len(v) != old
        and re.search(r"layer|idx|ids|indices", k) is not None
        and all(_int(x) and 0 <= x < old for x in v)
    )


def _layer_keyed(v, old: int) -> bool:
    """A dict keyed by layer index (``per_layer_config``: ``{"05": {...}}``)."""
    return (
        isinstance(v, dict)
        and bool(v)
        and not _is_sub(v)
        and all((_int(x) or isinstance(x, str) and x.isdigit()) and 0 <= int(x) < old for x in v)
    )


def _layer_choice(d: dict, old: int) -> list[int]:
    """The layers kept of ``old``: layer 0, then the first layer of every kind a per-layer list names (a list
    of a few distinct values: layer_types, mlp_layer_types...), and the first layer an index list or a
    layer-keyed dict names, so a sliding + global, dense + MoE or hybrid model keeps one of each kind."""
    chosen = [0]
    for v in d.values():
        if isinstance(v, list) and len(v) == old and len({repr(x) for x in v}) <= MAX_LAYERS:
            for i, x in enumerate(v):
                if repr(x) not in {repr(v[j]) for j in chosen}:
                    chosen.append(i)
    chosen += [v[0] for k, v in d.items() if _index_list(k, v, old)]
    chosen += [min(int(x) for x in v) for v in d.values() if _layer_keyed(v, old)]
    chosen = sorted(set(chosen))[:MAX_LAYERS]
    i = 1
    while len(chosen) < min(NEW_LAYERS, old):
        if i not in chosen:
            chosen.append(i)
        i += 1
    return sorted(chosen)


def _select_layers(d: dict, old: int) -> None:
    """Keep the layers ``_layer_choice`` picks: counts, per-layer lists, index lists, layer-keyed dicts."""
    chosen = _layer_choice(d, old)
    where = {o: n for n, o in enumerate(chosen)}
    for k, v in list(d.items()):
        if k in LAYER_KEYS and v == old:
            d[k] = len(chosen)
        elif isinstance(v, list) and len(v) == old:
            d[k] = [v[i] for i in chosen]
        elif _index_list(k, v, old):
            d[k] = [where[x] for x in v if x in where]
        elif _layer_keyed(v, old):
            width = max((len(x) for x in v if isinstance(x, str)), default=0)
            d[k] = {
                (f"{where[int(x)]:0{width}d}" if isinstance(x, str) else where[x]): _fields(y)
                for x, y in v.items()
                if int(x) in where
            }
        elif k == "moe_layer_end_index" and _int(v):
            d[k] = len(chosen) - 1


def _fields(d, special: dict | None = None):
    """The size rules applied to the fields of ``d`` (one config level, or a per-layer override dict)."""
    if not isinstance(d, dict):
        return d
    special = {} if special is None else special
    orig, d = d, dict(d)
    for k, v in list(d.items()):
        if isinstance(v, bool):
            continue
        if v is None and k in NONE_DEFAULTS:
            d[k] = NONE_DEFAULTS[k]  # a default left unset, which the model cannot build without
        elif v is None:
            continue
        elif k in SIZES and _int(v) and v > SIZES[k]:
            d[k] = SIZES[k]
        elif k in SIZES and isinstance(v, list) and v and all(_int(x) for x in v):
            d[k] = [min(x, SIZES[k]) for x in v]  # a per-layer size list
        elif re.search(r"intermediate|ffn|n_inner|^dff$|^d_inner$|^dim_ff$", k) and not re.search(r"mult|factor", k):
            new = MOE_INTERMEDIATE if re.search(r"moe|expert", k) and "shared" not in k else INTERMEDIATE
            if _int(v) and v > new:
                d[k] = new
            elif isinstance(v, list) and v and all(_int(x) for x in v):
                d[k] = [min(x, new) for x in v]
        elif k in TOKEN_IDS:
            d[k] = [TOKEN_IDS[k]] if isinstance(v, list) else TOKEN_IDS[k]
        elif re.search(r"_token_(id|index)$", k) and _int(v) and v >= PROMPT_HIGH:
            # a distinct id above the prompt's range, inside the vocabulary; the same old id maps to the same new
            d[k] = special.setdefault(v, 127 - len(special))
    heads = next((k for k in ("num_attention_heads", "n_head", "num_heads", "n_heads") if _int(orig.get(k))), None)
    if heads and _int(orig.get("num_key_value_heads")) and orig["num_key_value_heads"] == orig[heads]:
        d["num_key_value_heads"] = d[heads]  # multi-head attention stays so (MLA requires it)
    return d


def shrink_dict(d: dict, special: dict | None = None) -> dict:
    """``d`` (a ``config.to_dict()``) at tiny size, nested configs too (see the module's rules)."""
    special = {} if special is None else special
    orig = d
    d = dict(d)
    old = next((d[k] for k in LAYER_KEYS if _int(d.get(k))), None)
    if old is not None and old > NEW_LAYERS:
        _select_layers(d, old)
    d = _fields(d, special)
    for k, v in list(d.items()):
        if _is_sub(v):
            d[k] = shrink_dict(v, special)
    # dimensions the field rules cannot set one by one:
    if _int(orig.get("qk_rope_head_dim")) and orig.get("head_dim") == orig["qk_rope_head_dim"]:
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: head_dim names the rotary part
    if _int(orig.get("rotary_dim")) and _int(orig.get("head_dim")) and orig["rotary_dim"] == orig["head_dim"]:
        d["rotary_dim"] = d["head_dim"]
    expand = d.get("mamba_expand", d.get("expand"))
    ssm_dim = next((k for k in ("mamba_d_head", "mamba_headdim", "head_dim") if _int(d.get(k))), None)
    ssm_heads = next((k for k in ("mamba_n_heads", "n_mamba_heads", "num_heads") if _int(d.get(k))), None)
    if isinstance(expand, (int, float)) and ssm_dim and ssm_heads and _int(d.get("hidden_size")):
        # SSM: heads * head dim = its inner size = expand * hidden
        d[ssm_heads] = max(1, int(expand * d["hidden_size"]) // d[ssm_dim])
        if _int(d.get("mamba_d_ssm")):
            d["mamba_d_ssm"] = d[ssm_heads] * d[ssm_dim]
    if _int(d.get("num_experts_per_tok")) and any(_int(d.get(k)) for k in EXPERT_KEYS):
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], *(d[k] for k in EXPERT_KEYS if _int(d.get(k))))
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        # multimodal RoPE sections sum to the rotary half-dimension: scaled to the new head_dim
        sec, half = rope["mrope_section"], (d.get("head_dim") or 16) // 2
        new = [max(1, s * half // sum(sec)) for s in sec]
        new[0] += half - sum(new)
        d["rope_parameters" if d.get("rope_parameters") is rope else "rope_scaling"] = {**rope, "mrope_section": new}
    if "tie_word_embeddings" in d:
        d["tie_word_embeddings"] = False
    if "is_decoder" in d:
        d["is_decoder"] = True  # BERT-like types: their causal LM head needs it
    if "use_cache" in d:
        d["use_cache"] = True
    d["dtype"] = "float32"
    return d


def tiny_config(model_type: str):
    """The config of ``model_type`` at tiny size, with the OVERRIDES of that type applied on top."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = AutoConfig.for_model(model_type)
    d = shrink_dict(base.to_dict())
    d.update(OVERRIDES.get(model_type, {}))
    for k in ("transformers_version", "architectures", "model_type"):
        d.pop(k, None)
    return CONFIG_MAPPING[model_type](**d)


def build(model_type: str):
    """The tiny model of ``model_type``: fp32, eval, seeded, output head sharpened; returns (model, attn)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    if getattr(cfg, "is_encoder_decoder", False):
        raise Unsupported("an encoder-decoder model")
    model, attn, error = None, None, None
    for attn in ("sdpa", "eager"):
        torch.manual_seed(SEED)
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
            break
        except Exception as e:  # noqa: BLE001  (sdpa unsupported: eager next; eager's failure is a skip)
            error = e
    if model is None:
        raise error
    model = model.float().eval()
    if "input_ids" not in inspect.signature(type(model).forward).parameters:
        raise Unsupported(f"{type(model).__name__}.forward takes no input_ids")
    if getattr(model.config, "is_encoder_decoder", False):
        raise Unsupported("an encoder-decoder model")
    head = model.get_output_embeddings()
    if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor):
        with torch.no_grad():
            head.weight.mul_(HEAD_SCALE)
    return model, attn


class Unsupported(Exception):
    """A type this sweep does not run (a skip, with the reason)."""


# -------------------------------------------------------------------------------------------------------
# one type: uncompiled reference, then every (path, policy)
# -------------------------------------------------------------------------------------------------------


def prompt(vocab: int):
    import torch

    g = torch.Generator().manual_seed(SEED)
    return torch.randint(3, min(PROMPT_HIGH, vocab), (1, PROMPT_LEN), generator=g)


def generate(model, ids) -> list[int]:
    import torch

    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    seq = out.sequences if hasattr(out, "sequences") else out
    return seq[0, ids.shape[1] :].tolist()


def first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from (Dynamo wraps a backend's error), outermost first."""
    out: list[BaseException] = []
    while e is not None and all(e is not x for x in out):
        out.append(e)
        # Dynamo's BackendCompilerFailed holds the backend's error as inner_exception (not always as the cause)
        e = getattr(e, "inner_exception", None) or e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return out


def kvpass_frame(e: BaseException) -> str:
    """The last frame inside kvpass of the innermost exception that has one, as ``path:line in function``."""
    for x in reversed(_chain(e)):
        for fs in reversed(traceback.extract_tb(x.__traceback__)):
            parts = Path(fs.filename).parts
            if "kvpass" in parts:
                return f"{'/'.join(parts[parts.index('kvpass') :])}:{fs.lineno} in {fs.name}"
    return ""


def describe_error(e: BaseException) -> dict:
    chain = _chain(e)
    root = chain[-1]
    kind = type(e).__name__ if root is e else f"{type(e).__name__} <- {type(root).__name__}"
    return {"error": kind, "message": first_line(root) or first_line(e), "frame": kvpass_frame(e)}


def is_refusal(e: BaseException) -> bool:
    """kvpass refused: a ConfigError, an error of kvpass's own whose message starts with "kvpass" (not a
    "kvpass bug: ..." assertion), or the model's own error with kvpass's note naming the way on (the model's code
    cannot run on kvpass.compile's static-shape SlotCache)."""
    import kvpass

    for x in _chain(e):
        if isinstance(x, kvpass.ConfigError):
            return True
        if any(str(n).startswith("kvpass:") for n in getattr(x, "__notes__", ())):
            return True
        msg = str(x).lstrip()
        if msg.startswith("kvpass") and not msg.startswith("kvpass bug"):
            return True
    return False


def graph_summary(reports) -> str:
    """Per graph: phase and rewritten/sites (and 'unchanged' where the pass found a problem)."""
    parts = []
    for r in reports:
        s = f"{r.phase}:{r.rewritten}/{len(r.sites)}"
        parts.append(s + ("(unchanged)" if r.problems else ""))
    return " ".join(parts)


def run_one(model, ids, ref: list[int], path: str, policy: str, params: dict) -> dict:
    """One (path, policy) on ``model``: compile, generate, compare with ``ref``, undo the compile."""
    import torch

    import kvpass

    torch._dynamo.reset()
    rec: dict = {"path": path, "policy": policy}
    be, tokens, error = None, None, None
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            name = policy.split("@")[0]  # "expected_attention@decode": the policy at other parameters
            if path == "plain":
                be = kvpass.backend(name, compiler="eager", **params)
                model.forward = torch.compile(type(model).forward.__get__(model), backend=be, dynamic=True)
            else:
                be = kvpass.compile(model, name, compiler="eager", **params)
            tokens = generate(model, ids)
        except Exception as e:  # noqa: BLE001  (every failure is a verdict)
            error = e
        finally:
            model.__dict__.pop("forward", None)  # both paths set forward on the instance
            model.__dict__.pop("generate", None)  # kvpass.compile's FastGenerate
            torch._dynamo.reset()
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    warned = [str(w.message) for w in caught if issubclass(w.category, kvpass.KVPassWarning)]
    reports = list(be.reports) if be is not None else []
    rec["graphs"] = graph_summary(reports)
    rewritten = sum(r.rewritten for r in reports)
    if warned:
        rec["warning"] = warned[0][:200]
    if error is not None:
        rec.update(describe_error(error))
        rec["verdict"] = "warned" if is_refusal(error) else "crash"
        if rec["verdict"] == "warned":
            rec["warning"] = rec.get("warning") or rec["message"][:200]
        return rec
    rec["tokens_equal"] = tokens == ref
    if tokens != ref:
        rec["verdict"] = "wrong"
        rec["tokens"], rec["expected"] = tokens, ref
    elif warned:
        rec["verdict"] = "warned"
    elif rewritten > 0:
        rec["verdict"] = "exact"
    else:
        rec["verdict"] = "unapplied"
    return rec


def run_type(model_type: str, policies=tuple(POLICIES), paths=PATHS, emit=None) -> list[dict]:
    """Every (path, policy) of ``model_type``, in this process: a skip record, or one record per run.
    ``emit(record)`` is called as each record is made (the subprocess streams them to its parent)."""
    import torch

    emit = emit or (lambda rec: None)
    records: list[dict] = []

    def out(rec):
        rec = {"type": model_type, **rec}
        records.append(rec)
        emit(rec)

    t0 = time.perf_counter()
    try:
        model, attn = build(model_type)
    except Exception as e:  # noqa: BLE001  (does not build: a skip)
        out({"verdict": "skip", "detail": f"build: {type(e).__name__}: {first_line(e)}"})
        return records
    vocab = model.get_input_embeddings().weight.shape[0] if model.get_input_embeddings() is not None else 128
    ids = prompt(vocab)
    info = {"model": type(model).__name__, "attn": attn}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                ref = generate(model, ids)
    except Exception as e:  # noqa: BLE001  (cannot generate uncompiled: a skip)
        out({**info, "verdict": "skip", "detail": f"generate: {type(e).__name__}: {first_line(e)}"})
        return records
    if len(ref) != NEW_TOKENS:
        out({**info, "verdict": "skip", "detail": f"generate gave {len(ref)} new tokens, not {NEW_TOKENS}"})
        return records
    info["build_s"] = round(time.perf_counter() - t0, 2)
    for path in paths:
        for policy in policies:
            emit({"type": model_type, "start": f"{path}/{policy}"})
            with torch.no_grad():
                out({**info, **run_one(model, ids, ref, path, policy, POLICIES[policy])})
    return records


# -------------------------------------------------------------------------------------------------------
# one type in its own subprocess
# -------------------------------------------------------------------------------------------------------


def worker(model_type: str, policies: list[str], paths: list[str], threads: int) -> None:
    """``--worker``: run_type, one JSON line per record on stdout."""
    import torch

    torch.set_num_threads(threads)
    import transformers

    transformers.logging.set_verbosity_error()

    def emit(rec):
        sys.stdout.write("@@REC " + json.dumps(rec) + "\n")
        sys.stdout.flush()

    run_type(model_type, policies, paths, emit)


def run_type_subprocess(
    model_type: str, policies: list[str], paths: list[str], timeout: float, threads: int = 1
) -> list[dict]:
    """``run_type`` in a fresh Python process, killed after ``timeout`` seconds; the runs it did not finish
    are crash records (timeout / died)."""
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")  # no GPU: kvpass's Triton kernels run interpreted (as the tests)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        model_type,
        "--policies",
        ",".join(policies),
        "--paths",
        ",".join(paths),
        "--threads",
        str(threads),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        why = None if proc.returncode == 0 else f"died (exit code {proc.returncode})"
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        why = f"timeout after {timeout:g} s"
    records, running, info = [], None, {}
    for line in stdout.splitlines():
        if not line.startswith("@@REC "):
            continue
        rec = json.loads(line[6:])
        if "start" in rec:
            running = rec["start"]
            continue
        running = None
        records.append(rec)
        info = {k: rec[k] for k in ("model", "attn") if k in rec}
    if why is not None:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] if stderr.strip() else []
        if not records or records[-1]["verdict"] != "skip":
            done = {(r["path"], r["policy"]) for r in records}
            for path in paths:
                for policy in policies:
                    if (path, policy) in done:
                        continue
                    if running == f"{path}/{policy}" or (running is None and not done and not records):
                        detail = f"{why}" + (f"; stderr: {tail[0][:200]}" if tail else "")
                    else:
                        detail = (
                            f"not run: the subprocess {why.split(' (')[0].split(' after')[0]} during "
                            f"{running or 'the build or the uncompiled generate'}"
                        )
                    records.append(
                        {
                            "type": model_type,
                            **info,
                            "path": path,
                            "policy": policy,
                            "verdict": "crash",
                            "error": why.split()[0],
                            "message": detail,
                            "frame": "",
                        }
                    )
    for rec in records:
        rec.setdefault("type_s", round(time.perf_counter() - t0, 1))
    return records


# -------------------------------------------------------------------------------------------------------
# the report
# -------------------------------------------------------------------------------------------------------


def header(argv: list[str]) -> list[str]:
    import torch
    import transformers

    return [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- command: `{' '.join([os.path.relpath(sys.argv[0]) if sys.argv else 'family_sweep.py', *argv])}`",
        f"- prompt {PROMPT_LEN} random token ids, {NEW_TOKENS} new tokens greedy, fp32, CPU, "
        f"compiler='eager', budget={BUDGET} (nothing evicted)",
    ]


def detail(rec: dict) -> str:
    if rec["verdict"] == "skip":
        return rec.get("detail", "")
    parts = []
    if rec.get("error"):
        parts.append(f"{rec['error']}: {rec.get('message', '')}" + (f" [{rec['frame']}]" if rec.get("frame") else ""))
    if rec.get("warning") and not (rec.get("error") and rec["warning"] == rec.get("message", "")[:200]):
        parts.append(f"warning: {rec['warning']}")
    if rec["verdict"] == "wrong":
        parts.append(f"tokens {rec.get('tokens')} vs {rec.get('expected')}")
    if rec.get("graphs"):
        parts.append(f"graphs (phase:rewritten/sites): {rec['graphs']}")
    return "; ".join(parts).replace("|", "\\|").replace("\n", " ")


def write_markdown(records: list[dict], path: Path, argv: list[str], policies, paths) -> None:
    types = list(dict.fromkeys(r["type"] for r in records))
    cols = [(p, q) for p in paths for q in policies]
    by = {(r["type"], r.get("path"), r.get("policy")): r for r in records}
    skips = {r["type"]: r for r in records if r["verdict"] == "skip"}
    lines = [
        "# kvpass family sweep",
        "",
        *header(argv),
        "",
        f"{len(types)} types: {len(types) - len(skips)} ran, {len(skips)} skipped.",
        "",
        "## Verdicts per path and policy",
        "",
        "| path | policy | " + " | ".join(VERDICTS) + " |",
        "|---|---|" + "---:|" * len(VERDICTS),
    ]
    for p, q in cols:
        n = {
            v: sum(1 for r in records if r.get("path") == p and r.get("policy") == q and r["verdict"] == v)
            for v in VERDICTS
        }
        lines.append(f"| {p} | {q} | " + " | ".join(str(n[v]) for v in VERDICTS) + " |")
    lines += [
        "",
        "## Per type",
        "",
        "| type | model | attn | " + " | ".join(f"{p}/{q}" for p, q in cols) + " | s |",
        "|---|---|---|" + "---|" * len(cols) + "---:|",
    ]
    for t in types:
        if t in skips:
            lines.append(f"| {t} | {skips[t].get('model', '')} | | skip" + " |" * len(cols) + " |")
            continue
        row = [by.get((t, p, q), {}).get("verdict", "-") for p, q in cols]
        any_rec = next((r for r in records if r["type"] == t), {})
        lines.append(
            f"| {t} | {any_rec.get('model', '')} | {any_rec.get('attn', '')} | "
            + " | ".join(row)
            + f" | {any_rec.get('type_s', '')} |"
        )
    lines += [
        "",
        "## Every verdict other than exact",
        "",
        "| type | path/policy | verdict | detail |",
        "|---|---|---|---|",
    ]
    for r in records:
        if r["verdict"] != "exact":
            where = f"{r['path']}/{r['policy']}" if r.get("path") else ""
            lines.append(f"| {r['type']} | {where} | {r['verdict']} | {detail(r)} |")
    path.write_text("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------------------------------
# command line
# -------------------------------------------------------------------------------------------------------


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--types",
        type=_csv,
        help="comma-separated model types (default: every type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)",
    )
    ap.add_argument(
        "--policies",
        type=_csv,
        default=list(POLICIES),
        help=f"comma-separated policies, of {', '.join(POLICIES)} (default: all)",
    )
    ap.add_argument("--paths", type=_csv, default=list(PATHS), help="plain, fast or both (default: both)")
    ap.add_argument("--timeout", type=float, default=180, help="seconds per type, all its runs (default 180)")
    ap.add_argument("--jobs", type=int, default=1, help="types run in parallel subprocesses (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per subprocess (default 1)")
    ap.add_argument("--out", type=Path, help="output folder (default bench/results/family_sweep_<date>/)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for p in args.policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")
    for p in args.paths:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}; one of {', '.join(PATHS)}")
    if args.worker:
        worker(args.worker, args.policies, args.paths, args.threads)
        return 0
    types = args.types or all_types()
    out = args.out or Path(__file__).resolve().parent / "results" / f"family_sweep_{datetime.date.today().isoformat()}"
    out.mkdir(parents=True, exist_ok=True)
    jsonl, md = out / "results.jsonl", out / "results.md"
    jsonl.write_text("")
    records: list[dict] = []
    lock = threading.Lock()
    done = [0]

    def one(t: str) -> None:
        t0 = time.perf_counter()
        recs = run_type_subprocess(t, args.policies, args.paths, args.timeout, args.threads)
        with lock:
            records.extend(recs)
            with jsonl.open("a") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
            done[0] += 1
            verdicts = (
                "skip: " + recs[0].get("detail", "")[:100]
                if recs and recs[0]["verdict"] == "skip"
                else " ".join(f"{r['path']}/{r['policy']}={r['verdict']}" for r in recs)
            )
            print(
                f"[{done[0]}/{len(types)}] {t}: {verdicts} ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            order = {t: i for i, t in enumerate(types)}
            records.sort(key=lambda r: order.get(r["type"], 0))
            write_markdown(records, md, argv, args.policies, args.paths)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(one, types))
    write_markdown(records, md, argv, args.policies, args.paths)
    print(f"wrote {jsonl} and {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
