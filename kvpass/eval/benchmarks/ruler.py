"""RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654): its 13 tasks at 4k-128k, from RULER's real data.

Unlike ``kvpass.eval.tasks.ruler`` (kvpass's own RULER-style generator), this module reads data that RULER's
generator wrote, in either of two formats; the format is told from each file's row keys.

**kvpress's dataset**, the one behind kvpress's leaderboard (https://huggingface.co/spaces/nvidia/kvpress-leaderboard;
``evaluation/leaderboard.sh`` runs ``Qwen/Qwen3-8B`` on config ``4096`` at compression ratios 0.25-0.875). Hugging
Face id ``simonjegou/ruler``, one config (a folder of parquet files, split ``test``) per context length:
``4096``, ``8192``, ``16384`` (kvpress evaluates ``load_dataset("simonjegou/ruler", data_dir="4096", split="test")``).
Columns: ``context``, ``question``, ``answer_prefix``, ``answer`` (list of expected strings), ``task`` (one of the 13
names below), ``max_new_tokens`` (RULER's gen length: niah 128, vt 30, cwe 120, fwe 50, qa 32). kvpress made it
from RULER's jsonl (``evaluation/benchmarks/ruler/create_huggingface_dataset.py`` in
https://github.com/NVIDIA/kvpress): RULER's ``input`` split at the task's question into context / question /
answer prefix, tokenizer Llama-3.1-8B, ``base`` template, 500 rows per task. The prompt is built as kvpress's
pipeline builds it (``KVPressTextGenerationPipeline.preprocess`` in ``kvpress/pipeline.py``), see
``_io.kvpress_prompt``: with a chat template, one user turn holding ``context + question``, the generation prompt
(``enable_thinking=False``), then ``answer_prefix``; without one, ``bos_token + context``, then
``question + "\\n" + answer_prefix``. Context and question are tokenized apart (``add_special_tokens=False``) and
the ids joined, as kvpress does: checked equal to kvpress 0.5.5's ``preprocess`` ids, with and without a chat
template, on the fixture rows with SmolLM2's tokenizer.

**RULER's generator output** (https://github.com/NVIDIA/RULER, ``scripts/data/prepare.py``): one
``<task>/validation.jsonl`` per task (the task is the folder name), rows ``index``, ``input`` (the prompt with the
model template RULER was told to apply), ``outputs`` (expected strings), ``length`` (prompt tokens plus the gen
length), and, since May 2025, ``answer_prefix`` (older files keep it at the end of ``input``). The prompt is
``input + answer_prefix`` tokenized as one text with the tokenizer's special tokens (RULER's HF client does the
same); no chat template is added (RULER bakes its template into ``input``). The gen length is RULER's
``tokens_to_generate`` per task family (``scripts/data/synthetic/constants.py``): the numbers above.

Paths: a file, a folder (searched recursively: files named ``<task>.*`` or under a ``<task>/`` folder hold that
task, others must carry a ``task`` column; a numeric folder name, e.g. ``4096/``, is the context length, so a
folder of length folders loads every length, in increasing order), or a Hub id with its config
(``simonjegou/ruler/4096`` or ``simonjegou/ruler:4096``; needs ``datasets``). Subsets are the 13 task names,
``limit`` the first rows of each (length, task).

**Metrics** (RULER's ``scripts/eval/synthetic/constants.py``, the same in kvpress's ``calculate_metrics.py``), per
row in [0, 1] (RULER averages them and reports x100): ``ruler_string_match_all`` = the fraction of expected
strings found in the output, ``ruler_string_match_part`` = 1 if any is found; a plain case-insensitive substring
test (so "7" is found in "17", unlike kvpass's ``scoring.found``). The qa tasks use ``part``, all others ``all``.
The output is first stripped and its control characters (``\\x00-\\x1f``) handled as each source does: RULER turns
them into newlines, kvpress deletes them (``meta["postprocess"]``).

**What differs from kvpress**: kvpress prefills and compresses the context only (its question, question suffix
and answer prefix are fed afterwards, uncompressed; ``query_aware`` moves the question into the compressed part);
a kvpass Task is one prompt, so kvpass compresses the whole prompt, question and answer prefix included
(``meta["context_tokens"]`` says where kvpress's compressed part ends): closest to kvpress's ``query_aware`` runs,
though there the question suffix and answer prefix still stay uncompressed. Without compression the prompt ids are
the same. kvpress cuts a too-long context to its first ``max_context_length`` tokens; kvpass's ``max_length`` cuts the
whole prompt in the middle (``_io.cut_middle``). kvpress groups the rows that share a context and answers
them one after the other on the same cache; kvpass runs each row alone (the answers are the same: kvpress removes
each answer from the cache before the next).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvpass.eval.benchmarks import _io

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
SUBSETS = {"ruler": TASKS}

KVPRESS_DATASET = "simonjegou/ruler"
KVPRESS_FIELDS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")
RULER_FIELDS = ("input", "outputs")  # plus index, length and (newer RULER) answer_prefix when present

GEN_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}  # RULER's tokens_to_generate per family


def family(task: str) -> str:
    """The RULER task family of ``task``: "niah", "vt", "cwe", "fwe" or "qa"."""
    return task.split("_")[0]


# --------------------------------------------------------------------------------------------
# Reading

_FIX = (
    f"Point at kvpress's dataset ({KVPRESS_DATASET}: {', '.join(KVPRESS_FIELDS)}) or at RULER's "
    f"generator output (<task>/validation.jsonl: index, {', '.join(RULER_FIELDS)}, length, answer_prefix)."
)
_FORMATS = {"kvpress": ("context", "question"), "ruler": RULER_FIELDS}


def _length_of(file: Path, root: Path) -> int | None:
    return next((int(part) for part in _io.folders_up(file, root) if part.isdigit()), None)


def _groups(path, names: list[str], limit: int | None) -> tuple[dict, set]:
    """(context length, task) -> [(row, source, format)] for the tasks ``names``, and every task seen."""
    groups: dict = {}
    present: set = set()
    hub = _io.hub_id(path)
    if hub is not None:
        repo, config = hub
        if config is None:
            raise ValueError(
                f"{path}: not a local file or folder; as a Hub dataset, name the context length as its "
                f"config, e.g. {repo}/4096 ({KVPRESS_DATASET} has 4096, 8192 and 16384)"
            )
        source = f"{repo}/{config}"
        for row in _io.records(repo, config):
            _add(groups, present, row, int(config) if config.isdigit() else None, None, source, names)
        return groups, present
    root = Path(path).expanduser()
    owner: dict = {}
    for file in _io.data_files(path):
        task, length = _io.named(file, root, TASKS), _length_of(file, root)
        if task is not None:
            present.add(task)
            if task not in names:
                continue
            if (length, task) in owner:
                raise ValueError(
                    f"{owner[length, task]} and {file} both hold RULER task {task!r}"
                    f"{f' at {length}' if length else ''}: point at one of them"
                )
            owner[length, task] = file
        for row in _io.read_rows(file, limit if task is not None else None):
            _add(groups, present, row, length, task, str(file), names)
    return groups, present


def _add(groups: dict, present: set, row: dict, length, task, source: str, names: list[str]) -> None:
    fmt = _io.row_format(row, source, _FORMATS, "RULER", _FIX)
    name = _io.row_task(
        row,
        task,
        source,
        "RULER",
        TASKS,
        f"neither the file nor a folder above it is named for a "
        f"RULER task ({', '.join(TASKS)}). Keep RULER's layout (<task>/validation.jsonl)",
    )
    present.add(name)
    if name in names:
        groups.setdefault((length, name), []).append((row, source, fmt))


# --------------------------------------------------------------------------------------------
# Tasks


def _build(tokenizer, row: dict, fmt: str, task: str, length, position: int, source: str, max_length):
    metric = "ruler_string_match_part" if family(task) == "qa" else "ruler_string_match_all"
    if fmt == "kvpress":
        _io.need(row, KVPRESS_FIELDS[:4] + KVPRESS_FIELDS[5:], source, "kvpress RULER", _FIX)
        ids, cut, prompt = _io.kvpress_ids(tokenizer, row, max_length)
        return _io.task(
            "ruler",
            task,
            position,
            ids,
            _io.answers_of(row["answer"]),
            metric,
            int(row["max_new_tokens"]),
            cut,
            format="kvpress",
            context_length=length,
            **prompt,
            postprocess="delete_control",
        )
    _io.need(row, RULER_FIELDS, source, "RULER generator", _FIX)
    ids, cut = _io.prompt_ids(tokenizer, row["input"] + (row.get("answer_prefix") or ""), max_length)
    return _io.task(
        "ruler",
        task,
        row.get("index", position),
        ids,
        _io.answers_of(row["outputs"]),
        metric,
        GEN_TOKENS[family(task)],
        cut,
        format="ruler",
        context_length=length,
        ruler_length=row.get("length"),
        postprocess="control_to_newline",
    )


def load(path, tokenizer, *, subsets=None, limit: int | None = None, max_length: int | None = None):
    """RULER tasks from ``path`` (see the module docstring for formats and layouts): for each context length found
    (increasing), each task of ``subsets`` (None: every task present) in RULER's order, its first ``limit`` rows.
    ``max_length`` cuts longer prompts in the middle."""
    names = _io.wanted(subsets, TASKS, "RULER")
    groups, present = _groups(path, names, limit)
    _io.check_found(path, "RULER", subsets, names, {task for _, task in groups}, [t for t in TASKS if t in present])
    out = []
    for length, task in sorted(groups, key=lambda k: (k[0] or 0, TASKS.index(k[1]))):
        rows = groups[length, task][:limit] if limit is not None else groups[length, task]
        for position, (row, source, fmt) in enumerate(rows):
            out.append(_build(tokenizer, row, fmt, task, length, position, source, max_length))
    return out


LOADERS = {"ruler": load}


# --------------------------------------------------------------------------------------------
# Metrics

_CONTROL = re.compile(r"[\x00-\x1f]")


def _prediction(output: str, meta: dict) -> str:
    text = output.strip()
    if meta.get("postprocess") == "delete_control":  # kvpress
        return _CONTROL.sub("", text).strip()
    return _CONTROL.sub("\n", text).strip()  # RULER


def _hits(answers, output: str, meta: dict) -> list[bool]:
    answers = _io.expected(answers, "a RULER metric")
    pred = _prediction(output, meta or {}).lower()
    return [a.lower() in pred for a in answers]


def string_match_all(answers, output: str, meta: dict) -> float:
    """RULER's string_match_all for one row: the fraction of ``answers`` found (case-insensitive substring)."""
    hits = _hits(answers, output, meta)
    return sum(hits) / len(hits)


def string_match_part(answers, output: str, meta: dict) -> float:
    """RULER's string_match_part for one row: 1.0 if any of ``answers`` is found (case-insensitive substring)."""
    return float(any(_hits(answers, output, meta)))


METRICS = {"ruler_string_match_all": string_match_all, "ruler_string_match_part": string_match_part}

__all__ = [
    "GEN_TOKENS",
    "KVPRESS_DATASET",
    "LOADERS",
    "METRICS",
    "SUBSETS",
    "TASKS",
    "family",
    "load",
    "string_match_all",
    "string_match_part",
]
