"""LooGLE: long-document QA, cloze and summarization (short- and long-dependency), read from the dataset's own files.

Where the data comes from
    https://github.com/bigai-nlco/LooGLE (sample files in ``LooGLE-testdata/``), Hub id ``bigainlco/LooGLE`` (configs
    shortdep_qa, shortdep_cloze, longdep_qa, longdep_summarization; split ``test``). ``path`` is a folder with
    ``<subset>.jsonl`` files (or the folder holding ``LooGLE-testdata/``), one ``.jsonl`` / ``.json`` / ``.parquet``
    file (rows grouped by their ``task`` field, else the file name), or a Hub id.

Row formats, told apart by the keys of each row
    * LooGLE's own: one document per row: ``input`` (the long text), ``title``, ``qa_pairs`` (a Python-literal string
      of a list of ``{"Q", "A", "S"}``, ``"type"`` too in longdep_qa; cloze answers ``A`` are dicts from "<mask-n>"
      to the entity; the string "none" for summarization), ``output`` (the reference summary for summarization).
      Each question becomes one task. ``qa_pairs`` is parsed with ``ast.literal_eval`` (LooGLE uses ``eval``).
    * kvpress's (https://github.com/NVIDIA/kvpress, ``evaluation/benchmarks/loogle``, Hub id ``simonjegou/loogle``,
      configs as above): one question per row: ``context`` (instruction and document), ``question`` (templated),
      ``answer_prefix``, ``answer`` (cloze: the dict as a JSON string), ``task``, ``max_new_tokens``. Its prompt is
      kvpress's (``_io.kvpress_prompt``: with a chat template, context and question as one user turn cut at the
      context's end, the generation prompt, ``answer_prefix``; without one, ``bos_token + context`` then
      ``question + "\\n" + answer_prefix``; ``meta["context_tokens"]`` and ``meta["chat"]`` as in ``ruler``) and its
      ``max_new_tokens`` column is used.

Subsets and limit
    shortdep_qa, shortdep_cloze, longdep_qa, longdep_summarization (the README's order); generation lengths from
    LooGLE's ``config/task2maxlen.json`` (300, 50, 500, 500). ``limit`` takes the first N tasks (questions) of each
    subset: one LooGLE row holds several questions about one document.

The prompt
    LooGLE's templates (``config/task2prompt.json``, Python ``str.format`` with ``input`` and ``Q``) and lengths
    (``config/task2maxlen.json``) are read from ``path`` / ``path/config`` or the parent folder and its ``config/``
    when present: published numbers need them. Without them kvpass's own templates are used (instruction, document,
    question, answer cue, in kvpass's words; ``meta["template"]`` says which). No chat template is applied to
    LooGLE's own rows. Prompts of either format longer than ``max_length`` tokens are cut in the middle
    (``_io.cut_middle``), as LooGLE's ``pred`` scripts cut them.

Metrics (those of LooGLE's ``Evaluation/automatic_metrics.py`` that need no model, which kvpress's
``calculate_metrics`` reports too; an empty output is scored as "None", as ``automatic_eval.py`` does)
    ``loogle_rouge_l``  ROUGE-L recall (LooGLE passes ``metric="r"``), the ``rouge`` package's computation
                        (``_text.rouge_l``, as LongBench's): the task metric of the QA and summarization subsets
    ``loogle_rouge_1``, ``loogle_rouge_2``  ROUGE-1 / ROUGE-2 recall
    ``loogle_bleu1``, ``loogle_bleu4``  NLTK's ``sentence_bleu`` with weights (1, 0, 0, 0) / (0, 0, 0, 1), no
                        smoothing, over whitespace tokens: the clipped n-gram precision times the brevity penalty
    ``loogle_cloze_exact``  the share of the masks whose predicted entity equals the answer's: the task metric of
                        shortdep_cloze; the output must be a dict literal (Python or JSON), else 0
    ``loogle_cloze_partial``  the share of the masks whose predicted entity shares a word with the answer's
    LooGLE sums cloze matches over all masks before dividing; ``meta["n_masks"]`` is each task's count, to weight by.

Deliberate differences from the official code
    * Not computed: METEOR (needs NLTK's WordNet data), BERTScore and the GPT-4 judge (need a model).
    * The cloze output is parsed with ``ast.literal_eval`` after stripping surrounding whitespace, then as JSON,
      never ``eval``: outputs that only ``eval`` accepts score 0; a non-string entity is compared by ``str``.
    * BLEU-4 without a matching 4-gram is 0 (NLTK returns the smallest float, about 2e-308).
    * LooGLE's ``pred_opensource_models.py`` generates with ``repetition_penalty=2``; kvpass decodes greedily.

Read: https://github.com/bigai-nlco/LooGLE (README.md, config/task2prompt.json, config/task2maxlen.json,
Prediction/pred_opensource_models.py, Evaluation/automatic_eval.py, Evaluation/automatic_metrics.py,
LooGLE-testdata/), https://github.com/NVIDIA/kvpress/tree/main/evaluation (evaluate_registry.py,
benchmarks/loogle/create_huggingface_dataset.py and calculate_metrics.py), NLTK's nltk/translate/bleu_score.py.
"""

from __future__ import annotations

import ast
import json
import math
from collections import Counter

from kvpass.eval.benchmarks import _io
from kvpass.eval.benchmarks._text import rouge_l, rouge_n
from kvpass.eval.tasks._core import Task

SUBSETS = {"loogle": ("shortdep_qa", "shortdep_cloze", "longdep_qa", "longdep_summarization")}
MAX_NEW_TOKENS = {"shortdep_qa": 300, "shortdep_cloze": 50, "longdep_qa": 500, "longdep_summarization": 500}
SUBSET_METRIC = {
    "shortdep_qa": "loogle_rouge_l",
    "shortdep_cloze": "loogle_cloze_exact",
    "longdep_qa": "loogle_rouge_l",
    "longdep_summarization": "loogle_rouge_l",
}

# kvpass's own templates (used when LooGLE's config/task2prompt.json is not beside the data): str.format with
# {input} (the document) and {Q} (the question); literal braces doubled
_QA = "Answer the question using the text below.\n\n{input}\n\nQuestion: {Q}\nAnswer:"
TEMPLATES = {
    "shortdep_qa": _QA,
    "longdep_qa": _QA,
    "shortdep_cloze": "Read the text below. In the passage that follows it, each placeholder <mask-n> stands for a "
    "person, place or organization named in the text, and equal placeholders stand for the same "
    "one. Reply with a JSON object from each placeholder to its name, such as "
    '{{"<mask-0>": "Alice", "<mask-1>": "Paris"}}.\n\n{input}\n\nPassage: {Q}\nAnswer:',
    "longdep_summarization": "Write a summary of the paper below.\n\n{input}\n\nSummary:",
}

_OFFICIAL_KEYS = ("input", "qa_pairs")
_KVPRESS_KEYS = ("context", "question", "answer_prefix", "answer")


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


def _qa_pairs(row: dict, where: str, i: int) -> list[dict] | None:
    """The row's questions, or None for a summarization row ("none")."""
    pairs = row["qa_pairs"]
    if isinstance(pairs, str):
        if pairs.strip().lower() == "none":
            return None
        try:
            pairs = ast.literal_eval(pairs)
        except (ValueError, SyntaxError) as e:
            raise ValueError(
                f"{where}: row {i}: 'qa_pairs' is not a list literal ({e}); LooGLE writes it as a "
                f"Python list of {{'Q', 'A', 'S'}} dicts, or 'none'"
            ) from None
    pairs = list(pairs) if pairs is not None else None
    for k, pair in enumerate(pairs or []):
        missing = [f for f in ("Q", "A") if f not in pair]
        if missing:
            raise ValueError(
                f"{where}: row {i}, question {k}: no field {missing[0]!r} in the qa pair (it has "
                f"{', '.join(sorted(pair))}); LooGLE's pairs carry Q, A and S"
            )
    return pairs


def _masks(answer) -> int:
    ref = parse_dict(answer) if isinstance(answer, str) else answer
    return len(ref) if isinstance(ref, dict) else 0


def load(path, tokenizer, *, subsets=None, limit=None, max_length=None) -> list[Task]:
    """LooGLE's tasks from ``path`` (see the module docstring): ``subsets`` (None: all four, in published order),
    the first ``limit`` questions of each, prompts cut in the middle to ``max_length`` tokens."""
    names = _io.wanted(subsets, SUBSETS["loogle"], "LooGLE", keep_order=True)
    config = _io.OfficialConfig.find(path, "task2prompt.json", "task2maxlen.json")
    out = []
    by_subset = _io.rows_by_subset(path, names, SUBSETS["loogle"], "LooGLE", inner=("LooGLE-testdata",))
    for subset, (rows, where) in by_subset.items():
        metric, mine = SUBSET_METRIC[subset], []
        for i, row in enumerate(rows):
            if limit is not None and len(mine) >= limit:
                break
            fmt = _io.official_or_kvpress(row, where, "LooGLE", _OFFICIAL_KEYS, _KVPRESS_KEYS)
            if fmt == "kvpress":  # the row itself: kvpress's rule builds its prompt (_io.tokenized)
                new = int(row.get("max_new_tokens") or MAX_NEW_TOKENS[subset])
                mine.append((row, str(row["answer"]), f"{subset}-{i}", new, "kvpress", {}))
                continue
            template, kind = config.template(subset, TEMPLATES)
            new = config.max_new_tokens(subset, MAX_NEW_TOKENS)
            title = row.get("title", f"{subset}-{i}")
            pairs = _qa_pairs(row, where, i)
            if pairs is None:  # summarization: the document alone, the reference summary in 'output'
                if "output" not in row:
                    raise ValueError(
                        f"{where}: summarization row {i} has no 'output' (the reference summary); "
                        f"its fields: {', '.join(sorted(row))}"
                    )
                text = _io.fill_template(template, {"input": row["input"], "Q": ""}, f"{where}: the {subset} template")
                mine.append((text, str(row["output"]), str(title), new, kind, {}))
                continue
            for k, pair in enumerate(pairs):
                answer = pair["A"]
                answer = json.dumps(answer, ensure_ascii=False) if isinstance(answer, dict) else str(answer)
                extra = {"type": pair["type"]} if "type" in pair else {}
                text = _io.fill_template(
                    template, {"input": row["input"], "Q": pair["Q"]}, f"{where}: the {subset} template"
                )
                mine.append((text, answer, f"{title}#{k}", new, kind, extra))
        for prompt, answer, row_id, new, kind, extra in mine[:limit] if limit is not None else mine:
            if subset == "shortdep_cloze":
                extra = {**extra, "n_masks": _masks(answer)}
                if not extra["n_masks"]:
                    raise ValueError(
                        f"{where}: cloze question {row_id} has answer {answer[:80]!r}, not a dict from "
                        f"'<mask-n>' to the entity"
                    )
            ids, cut, built = _io.tokenized(tokenizer, prompt, max_length)
            out.append(
                _io.task(
                    "loogle",
                    subset,
                    row_id,
                    ids,
                    [answer],
                    metric,
                    new,
                    cut,
                    format="kvpress" if kind == "kvpress" else "official",
                    template=kind,
                    **extra,
                    **built,
                )
            )
    return out


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------


def _hyp(output: str) -> str:
    return output if output != "" else "None"  # automatic_eval.py scores an empty output as "None"


def _recall(which):
    def metric(answers, output: str, meta: dict) -> float:
        best = 0.0
        for a in _io.expected(answers, f"loogle_{which}"):
            s = rouge_l(_hyp(output), a) if which == "rouge_l" else rouge_n(_hyp(output), a, int(which[-1]))
            best = max(best, 0.0 if s is None else s["r"])
        return best

    metric.__name__ = f"loogle_{which}"
    metric.__doc__ = (
        f"``loogle_{which}(answers, output, meta)``: {which.replace('_', '-').upper()} recall as LooGLE "
        f"reports it (the ``rouge`` package's), the max over ``answers``; 0 when the answer is empty."
    )
    return metric


def bleu(output: str, reference: str, n: int) -> float:
    """NLTK's ``sentence_bleu([reference], output, weights)`` with all the weight on ``n``-grams, no smoothing,
    newlines as spaces and whitespace tokens: 0 without a shared word, else the clipped n-gram precision (0 without
    a shared n-gram) times the brevity penalty exp(1 - r/c) when the output is shorter than the reference."""
    hyp, ref = output.replace("\n", " ").split(), reference.replace("\n", " ").split()

    def clipped(k):
        h = Counter(tuple(hyp[i : i + k]) for i in range(len(hyp) - k + 1))
        r = Counter(tuple(ref[i : i + k]) for i in range(len(ref) - k + 1))
        return sum(min(c, r[g]) for g, c in h.items()), max(1, sum(h.values()))

    if not hyp or clipped(1)[0] == 0:
        return 0.0
    num, den = clipped(n)
    if num == 0:
        return 0.0
    bp = 1.0 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return bp * num / den


def _bleu(n):
    def metric(answers, output: str, meta: dict) -> float:
        return max(bleu(_hyp(output), a, n) for a in _io.expected(answers, f"loogle_bleu{n}"))

    metric.__name__ = f"loogle_bleu{n}"
    metric.__doc__ = f"``loogle_bleu{n}(answers, output, meta)``: ``bleu(output, answer, {n})``, the max over answers."
    return metric


def parse_dict(text: str) -> dict | None:
    """``text`` (surrounding whitespace stripped) as a dict literal, Python (``ast.literal_eval``) or JSON; None
    when it is neither."""
    text = text.strip()
    for parse in (ast.literal_eval, json.loads):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


def _cloze(partial: bool):
    def metric(answers, output: str, meta: dict) -> float:
        answers = _io.as_list(answers)  # items kept: an answer may be the dict itself
        if not answers:
            raise ValueError(f"{name} needs at least one expected answer (the dict from '<mask-n>' to the entity)")
        best = 0.0
        for a in answers:
            ref = parse_dict(a) if isinstance(a, str) else a
            if not isinstance(ref, dict) or not ref:
                raise ValueError(f"cloze answer {str(a)[:80]!r} is not a dict from '<mask-n>' to the entity")
            hyp = parse_dict(output) or {}
            if partial:
                hit = sum(k in hyp and bool(set(str(v).split()) & set(str(hyp[k]).split())) for k, v in ref.items())
            else:
                hit = sum(k in hyp and hyp[k] == v for k, v in ref.items())
            best = max(best, hit / len(ref))
        return best

    name = "loogle_cloze_partial" if partial else "loogle_cloze_exact"
    metric.__name__ = name
    metric.__doc__ = (
        f"``{name}(answers, output, meta)``: the share of the answer's masks whose entity the output's "
        f"dict {'shares a word with' if partial else 'equals'}; 0 when the output is not a dict."
    )
    return metric


LOADERS = {"loogle": load}
METRICS = {
    "loogle_rouge_l": _recall("rouge_l"),
    "loogle_rouge_1": _recall("rouge_1"),
    "loogle_rouge_2": _recall("rouge_2"),
    "loogle_bleu1": _bleu(1),
    "loogle_bleu4": _bleu(4),
    "loogle_cloze_exact": _cloze(partial=False),
    "loogle_cloze_partial": _cloze(partial=True),
}

__all__ = [
    "LOADERS",
    "MAX_NEW_TOKENS",
    "METRICS",
    "SUBSETS",
    "SUBSET_METRIC",
    "TEMPLATES",
    "bleu",
    "load",
    "parse_dict",
]
