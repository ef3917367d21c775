"""LongBench v2: 503 four-choice questions (A-D) over contexts of 8k to 2M words, read from the dataset's own file.

Where the data comes from
    https://github.com/THUDM/LongBench (the repository root is v2), Hub id ``THUDM/LongBench-v2`` (split ``train``), or
    its ``data.json`` (one JSON list). ``path`` is that file (or a ``.jsonl`` / ``.parquet`` with the same rows), a
    folder holding ``data.json`` (or ``data.jsonl`` / ``data.parquet``), or a Hub id.

Row formats, told apart by the keys of each row
    * LongBench v2's own: ``_id``, ``domain``, ``sub_domain``, ``difficulty`` ("easy" / "hard"), ``length``
      ("short" / "medium" / "long"), ``question``, ``choice_A`` ... ``choice_D``, ``answer`` (the letter),
      ``context``.
    * kvpress's (https://github.com/NVIDIA/kvpress, ``evaluation/benchmarks/longbenchv2``, Hub id
      ``simonjegou/LongBench-v2``, config ``0shot``, split ``test``): the same row with ``context`` and ``question``
      already templated (the question carries the choices), ``answer_prefix`` ("") and ``max_new_tokens`` (16). Its
      prompt is kvpress's (``_io.kvpress_prompt``: with a chat template, context and question as one user turn cut
      at the context's end, the generation prompt, ``answer_prefix``; without one, ``bos_token + context`` then
      ``question + "\\n" + answer_prefix``; ``meta["context_tokens"]`` and ``meta["chat"]`` as in ``ruler``) and its
      ``max_new_tokens`` column is used.

Subsets
    The six task categories of the ``domain`` field, in the paper's order, named by the domain in snake case:
    single_document_qa, multi_document_qa, long_in_context_learning, long_dialogue_history_understanding,
    code_repository_understanding, long_structured_data_understanding (the domain strings themselves are accepted
    in ``subsets`` too). ``limit`` takes the first rows of each.

The prompt
    LongBench v2's zero-shot template (``prompts/0shot.txt``: ``$DOC$``, ``$Q$``, ``$C_A$`` ... ``$C_D$``, each value
    stripped) is read from ``path``, ``path/prompts`` or the parent folder and its ``prompts/`` when present:
    published numbers need it; it asks for the reply "The correct answer is (X)" and ends there, so the output is
    scored as it is. Without it kvpass's own template is used (document, question, the four choices, the reply
    format in kvpass's words) and the prompt ends with the cue "The correct answer is", which the metric puts back in
    front of the output (``meta["answer_prefix"]``). 128 tokens are generated, as ``pred.py`` does without
    chain-of-thought. No chat template is applied to LongBench v2's own rows (kvpass prompts are completion style;
    LongBench v2 queries chat models). Prompts of either format longer than ``max_length`` tokens are cut in the
    middle (``_io.cut_middle``), as ``pred.py`` cuts them.

Metric ``longbench_v2_choice``
    The letter chosen, found as ``pred.py``'s ``extract_answer`` finds it: asterisks removed, the first "The correct
    answer is (X)", else the first "The correct answer is X", X in A-D; 1 if it is the answer, else 0 (no letter
    found: 0). ``meta`` keeps ``choices`` (the letters), ``domain``, ``sub_domain``, ``difficulty`` and
    ``length_category`` to average by, as ``result.py`` reports overall / easy / hard / short / medium / long.

Deliberate differences from the official code
    * The template's placeholders are filled in one pass (``pred.py`` replaces them one after another, so a
      "$Q$" inside a document would be replaced too).
    * kvpress's ``calculate_metrics`` accepts either phrase anywhere in the output; the first match is used here,
      as LongBench's own ``extract_answer`` does.

Read: https://github.com/THUDM/LongBench (README.md, pred.py, result.py, prompts/0shot.txt),
https://github.com/NVIDIA/kvpress/tree/main/evaluation (evaluate_registry.py,
benchmarks/longbenchv2/create_huggingface_dataset.py and calculate_metrics.py).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvpass.eval.benchmarks import _io
from kvpass.eval.tasks._core import Task

DOMAINS = (
    "Single-Document QA",
    "Multi-Document QA",
    "Long In-context Learning",
    "Long-dialogue History Understanding",
    "Code Repository Understanding",
    "Long Structured Data Understanding",
)


def slug(domain: str) -> str:
    """A domain as a subset name: lowercase, every run of other characters one underscore."""
    return re.sub(r"[^a-z0-9]+", "_", domain.lower()).strip("_")


SUBSET_OF_DOMAIN = {d: slug(d) for d in DOMAINS}
SUBSETS = {"longbench_v2": tuple(SUBSET_OF_DOMAIN.values())}
CHOICES = ("A", "B", "C", "D")
MAX_NEW_TOKENS = 128
ANSWER_CUE = "The correct answer is"

# kvpass's own template (used when LongBench v2's prompts/0shot.txt is not beside the data)
TEMPLATE = (
    "Read the document below, then answer the multiple-choice question that follows it.\n\n"
    "<document>\n$DOC$\n</document>\n\nQuestion: $Q$\n\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    'Reply with the letter of the right choice, as "The correct answer is (X)".\n\n' + ANSWER_CUE
)

# Hub ids whose split / config differ from _io's defaults
_HUB = {
    "THUDM/LongBench-v2": (None, "train"),
    "zai-org/LongBench-v2": (None, "train"),
    "simonjegou/LongBench-v2": ("0shot", "test"),
}
_OFFICIAL_KEYS = ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "domain")
_KVPRESS_KEYS = ("context", "question", "answer_prefix", "answer", "domain")
_FIELD = {
    "$DOC$": "context",
    "$Q$": "question",
    "$C_A$": "choice_A",
    "$C_B$": "choice_B",
    "$C_C$": "choice_C",
    "$C_D$": "choice_D",
}


def _rows(path) -> tuple[list[dict], str]:
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("data", "longbench_v2", "LongBench-v2", "test", "train"):
            file = _io.data_file(p, name)
            if file is not None:
                return _io.records(file), str(file)
        raise FileNotFoundError(
            f"{p}: no data.json (LongBench v2's file), data.jsonl or data.parquet there; "
            f"download data.json from the Hub dataset THUDM/LongBench-v2, or pass the file"
        )
    if p.is_file():
        return _io.records(p), str(p)
    subset, split = _HUB.get(str(path), (None, "test"))
    return _io.records(path, subset, split=split), str(path)


def fill(template: str, row: dict) -> str:
    """``template`` with ``$DOC$``, ``$Q$``, ``$C_A$`` ... ``$C_D$`` replaced by the row's stripped fields."""
    return re.sub(r"\$(?:DOC|Q|C_[ABCD])\$", lambda m: str(row[_FIELD[m.group(0)]]).strip(), template)


def load(path, tokenizer, *, subsets=None, limit=None, max_length=None) -> list[Task]:
    """LongBench v2's tasks from ``path`` (see the module docstring): ``subsets`` (None: all six domains, in
    published order; names or the domain strings), the first ``limit`` rows of each, prompts cut in the middle to
    ``max_length`` tokens."""
    names = _io.wanted(subsets, SUBSETS["longbench_v2"], "LongBench v2", SUBSET_OF_DOMAIN, keep_order=True)
    rows, where = _rows(path)
    template_file = _io.config_file(path, "0shot.txt", folder="prompts")
    template = template_file.read_text(encoding="utf-8") if template_file else TEMPLATE
    by_subset: dict[str, list[tuple[int, dict, str]]] = {n: [] for n in names}
    for i, row in enumerate(rows):
        fmt = _io.official_or_kvpress(row, where, "LongBench v2", _OFFICIAL_KEYS, _KVPRESS_KEYS)
        domain = str(row["domain"])
        if domain not in SUBSET_OF_DOMAIN:
            raise ValueError(
                f"{where}: row {i} has unknown domain {domain!r}; known: {', '.join(DOMAINS)}. Pass "
                f"LongBench v2's own data.json"
            )
        subset = SUBSET_OF_DOMAIN[domain]
        if subset in by_subset and (limit is None or len(by_subset[subset]) < limit):
            by_subset[subset].append((i, row, fmt))
    out = []
    for subset, picked in by_subset.items():
        for i, row, fmt in picked:
            answer = str(row["answer"]).strip()
            if answer not in CHOICES:
                raise ValueError(
                    f"{where}: row {i} has answer {row['answer']!r}; LongBench v2's answers are one of "
                    f"{', '.join(CHOICES)}"
                )
            if fmt == "kvpress":
                cue, kind, new = (
                    str(row["answer_prefix"] or ""),
                    "kvpress",
                    int(row.get("max_new_tokens") or MAX_NEW_TOKENS),
                )
                prompt = row  # the row itself: kvpress's rule builds its prompt
            else:
                cue = "" if template_file else ANSWER_CUE
                kind, new = (f"official ({template_file})" if template_file else "builtin"), MAX_NEW_TOKENS
                prompt = fill(template, row)
            ids, cut, built = _io.tokenized(tokenizer, prompt, max_length)
            out.append(
                _io.task(
                    "longbench_v2",
                    subset,
                    row.get("_id", f"{subset}-{i}"),
                    ids,
                    [answer],
                    "longbench_v2_choice",
                    new,
                    cut,
                    choices=list(CHOICES),
                    answer_prefix=cue,
                    domain=row["domain"],
                    sub_domain=row.get("sub_domain"),
                    difficulty=row.get("difficulty"),
                    length_category=row.get("length"),
                    format=fmt,
                    template=kind,
                    **built,
                )
            )
    return out


def extract_choice(text: str) -> str | None:
    """The letter chosen in ``text`` as LongBench v2's ``extract_answer`` finds it: asterisks removed, the first
    "The correct answer is (X)", else the first "The correct answer is X" (X in A-D); None when neither occurs."""
    text = text.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", text) or re.search(r"The correct answer is ([A-D])", text)
    return m.group(1) if m else None


def choice_score(answers, output: str, meta: dict) -> float:
    """1.0 if the letter ``extract_choice`` finds in ``meta["answer_prefix"] + output`` is among ``answers``."""
    answers = [a.strip() for a in _io.expected(answers, "longbench_v2_choice")]
    letter = extract_choice(str((meta or {}).get("answer_prefix") or "") + output)
    return float(letter is not None and letter in answers)


LOADERS = {"longbench_v2": load}
METRICS = {"longbench_v2_choice": choice_score}

__all__ = [
    "CHOICES",
    "DOMAINS",
    "LOADERS",
    "METRICS",
    "SUBSETS",
    "TEMPLATE",
    "choice_score",
    "extract_choice",
    "fill",
    "load",
    "slug",
]
