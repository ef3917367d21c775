"""LongBench (v1) and LongBench-E: 21 English / Chinese / code subsets, read from the dataset's own files.

Where the data comes from
    https://github.com/THUDM/LongBench (folder ``LongBench/``), Hub id ``THUDM/LongBench`` (configs ``<subset>`` and
    ``<subset>_e``), or its ``data.zip``: one ``<subset>.jsonl`` per subset and ``<subset>_e.jsonl`` per LongBench-E
    subset. ``path`` is that folder (or the folder holding ``data/``), one ``.jsonl`` / ``.json`` / ``.parquet`` file
    (its rows are grouped by their ``dataset`` / ``task`` field, else the file name), or a Hub id.

Two row formats, told apart by the keys of each row
    * LongBench's own: ``input`` (the question / query, for few-shot subsets ending in its cue such as "Type:"),
      ``context``, ``answers`` (a list), ``length`` (words, or characters for Chinese), ``dataset``, ``language``,
      ``all_classes`` (the label set of trec / lsht, else null), ``_id``.
    * kvpress's (https://github.com/NVIDIA/kvpress, ``evaluation/benchmarks/longbench``, Hub id
      ``Xnhyacinth/LongBench``, configs ``<subset>`` and ``<subset>_e``): the same row with ``context`` already
      wrapped in the instruction, ``question`` (the templated question, renamed from ``input``), ``answer_prefix``,
      ``task`` and ``max_new_tokens`` (dataset2maxlen + 20). Its prompt is built as kvpress's pipeline builds every
      benchmark's (``_io.kvpress_prompt``): with a chat template, ``context + question`` as one user turn cut where
      the context ends, the generation prompt, then ``answer_prefix``; without one, ``bos_token + context``, then
      ``question + "\\n" + answer_prefix``; ``meta["context_tokens"]`` is the number of leading ids that are the
      context (what kvpress compresses) and ``meta["chat"]`` whether a chat template was used. Its
      ``max_new_tokens`` column is used.

The prompt
    LongBench's per-subset templates (``config/dataset2prompt.json``, Python ``str.format`` over the row) and
    generation lengths (``config/dataset2maxlen.json``) are read from ``path`` / ``path/config`` (or the parent folder
    and its ``config/``) when present: published numbers need them. Without them, kvpass's own templates are used
    (the same layout in kvpass's words: instruction, context, question, answer cue; ``meta["template"]`` says
    which) and the published dataset2maxlen values. No chat template is applied to LongBench's own rows (kvpass
    prompts are completion style); LongBench's ``pred.py`` wraps the prompt in the model's chat format except for
    trec, triviaqa, samsum, lsht, lcc and repobench-p. Prompts of either format longer than ``max_length`` tokens
    are cut in the middle (``_io.cut_middle``; LongBench cuts the same halves, then decodes and re-tokenizes them).

Metrics (LongBench's ``metrics.py`` / ``eval.py``, re-implemented, the pieces InfiniteBench and LooGLE share in
``_text``; the score of a row is the max over its answers)
    ``longbench_qa_f1``          token F1 after SQuAD normalisation (lowercase, no punctuation, no a/an/the)
    ``longbench_qa_f1_zh``       token F1 over Chinese words (jieba when installed, else the character-level
                                 fallback below), punctuation and spaces removed
    ``longbench_rouge_l``        ROUGE-L F as the ``rouge`` package (pltrdy/rouge 1.0.1) computes it: sentences
                                 split at ".", summary-level union LCS over sets of words, recall and precision
                                 over distinct words
    ``longbench_rouge_l_zh``     the same over Chinese words joined by spaces
    ``longbench_classification`` 1 / (number of labels found in the output) when the true label is among them
    ``longbench_retrieval`` / ``longbench_retrieval_zh``  the share of numbers in the output equal to the answer's
                                 paragraph number ("Paragraph N" / "段落N")
    ``longbench_count``          the share of numbers in the output equal to the answer
    ``longbench_code_sim``       the Levenshtein (indel) ratio of the output's first line that is not a comment or
                                 a code fence to the answer, rounded to a whole percent as ``fuzzywuzzy`` does
    For trec, triviaqa, samsum and lsht only the output's first line is scored (``meta["first_line"]``).
    LongBench-E rows carry ``meta["length_bucket"]`` ("0-4k", "4-8k", "8k+" by the row's ``length``) to average by.

Deliberate differences from the official code
    * Chinese words: jieba (``pip install jieba``) when it is installed, as LongBench does; without it each CJK
      character, each run of ASCII letters / digits and each other non-space character is one word, so
      ``longbench_qa_f1_zh`` and ``longbench_rouge_l_zh`` then differ from published numbers (set ``JIEBA = False``
      to force the fallback, ``True`` to require jieba).
    * ``longbench_code_sim``: ``fuzzywuzzy.fuzz.ratio`` uses python-Levenshtein's ratio when that is installed
      (computed here) and difflib's ``SequenceMatcher`` otherwise, which can score a little lower.
    * ROUGE: the ``rouge`` package reconstructs each LCS recursively and gives 0 when a sentence pair is longer than
      Python's recursion limit allows (about 1000 words together, e.g. a Chinese summary without any "."); here it
      is scored.
    * An empty ``answers`` list is an error here (LongBench would score the row 0).

Read: https://github.com/THUDM/LongBench/tree/main/LongBench (README.md, pred.py, eval.py, metrics.py, config/),
https://github.com/NVIDIA/kvpress/tree/main/evaluation (evaluate.py, evaluate_registry.py,
benchmarks/longbench/create_huggingface_dataset.py and calculate_metrics.py), https://github.com/pltrdy/rouge
(rouge.py, rouge_score.py), https://github.com/seatgeek/fuzzywuzzy (fuzz.ratio, utils).
"""

from __future__ import annotations

import re

from kvpass.eval.benchmarks import _io
from kvpass.eval.benchmarks._text import normalize_zh, qa_f1, rouge_l, token_f1
from kvpass.eval.tasks._core import Task

LONGBENCH = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)
LONGBENCH_E = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
SUBSETS = {"longbench": LONGBENCH, "longbench_e": LONGBENCH_E}

# LongBench's dataset2maxlen: tokens generated per subset
MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

SUBSET_METRIC = {
    "narrativeqa": "longbench_qa_f1",
    "qasper": "longbench_qa_f1",
    "multifieldqa_en": "longbench_qa_f1",
    "multifieldqa_zh": "longbench_qa_f1_zh",
    "hotpotqa": "longbench_qa_f1",
    "2wikimqa": "longbench_qa_f1",
    "musique": "longbench_qa_f1",
    "dureader": "longbench_rouge_l_zh",
    "gov_report": "longbench_rouge_l",
    "qmsum": "longbench_rouge_l",
    "multi_news": "longbench_rouge_l",
    "vcsum": "longbench_rouge_l_zh",
    "trec": "longbench_classification",
    "triviaqa": "longbench_qa_f1",
    "samsum": "longbench_rouge_l",
    "lsht": "longbench_classification",
    "passage_count": "longbench_count",
    "passage_retrieval_en": "longbench_retrieval",
    "passage_retrieval_zh": "longbench_retrieval_zh",
    "lcc": "longbench_code_sim",
    "repobench-p": "longbench_code_sim",
}

FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})  # scored on the output's first line only

# kvpass's own templates (used when LongBench's dataset2prompt.json is not beside the data); {context} and {input}
# are the row's fields. Few-shot subsets (trec, triviaqa, samsum, lsht) carry their answer cue inside ``input``.
_QA_MULTI = (
    "Use the passages below to answer the question. Reply with the answer alone.\n\nPassages:\n{context}\n\n"
    "Question: {input}\nAnswer:"
)
TEMPLATES = {
    "narrativeqa": "Read the story below, then answer the question about it with a short phrase and no explanation."
    "\n\nStory:\n{context}\n\nQuestion: {input}\nAnswer:",
    "qasper": "Read the scientific paper below, then answer the question with a short phrase or sentence and no "
    'explanation. If the paper does not say, reply "unanswerable"; to a yes/no question reply "yes", '
    '"no" or "unanswerable".\n\nPaper:\n{context}\n\nQuestion: {input}\nAnswer:',
    "multifieldqa_en": "Read the text below, then answer the question briefly.\n\n{context}\n\n"
    "Question: {input}\nAnswer:",
    "multifieldqa_zh": "阅读下面的文本，然后用中文简要回答问题。\n\n{context}\n\n问题：{input}\n答案：",
    "hotpotqa": _QA_MULTI,
    "2wikimqa": _QA_MULTI,
    "musique": _QA_MULTI,
    "dureader": "根据下面的文章回答问题。\n\n文章：\n{context}\n\n问题：{input}\n答案：",
    "gov_report": "Below is a report from a government agency. Summarize it in about one page.\n\n"
    "Report:\n{context}\n\nSummary:",
    "qmsum": "Below is a meeting transcript, then a query about it. Respond to the query in one or more sentences."
    "\n\nTranscript:\n{context}\n\nQuery: {input}\nAnswer:",
    "multi_news": "Below are several news articles. Summarize them together in about one page.\n\n"
    "Articles:\n{context}\n\nSummary:",
    "vcsum": "下面是一份会议记录。请阅读后概括会议的主要内容。\n\n会议记录：\n{context}\n\n总结：",
    "trec": "Classify the last question by the type of answer it asks for. Labelled examples come first.\n\n"
    "{context}\n{input}",
    "triviaqa": "Answer the last question from its passage, giving the answer alone. Worked examples come first.\n\n"
    "{context}\n\n{input}",
    "samsum": "Summarize the last dialogue in a few short sentences. Worked examples come first.\n\n"
    "{context}\n\n{input}",
    "lsht": "判断最后一则新闻属于哪个类别。前面是带有类别的例子。\n\n{context}\n{input}",
    "passage_count": "Below are paragraphs taken from Wikipedia; some of them appear more than once. Count the "
    "distinct paragraphs, each repeated one counted once.\n\n{context}\n\nReply with the number "
    "alone.\nNumber of distinct paragraphs:",
    "passage_retrieval_en": "Below are 30 paragraphs from Wikipedia, then a summary written from one of them. Say "
    "which paragraph it was.\n\n{context}\n\nSummary:\n{input}\n\nReply in the form "
    '"Paragraph N".\nAnswer:',
    "passage_retrieval_zh": "下面是若干段文字，然后是根据其中一段写成的摘要。请指出摘要出自哪一段。\n\n{context}\n\n"
    "摘要：\n{input}\n\n请按“段落N”的格式作答。\n答案：",
    "lcc": "Continue the code below with its next line.\n\n{context}",
    "repobench-p": "Continue the code below with its next line.\n\n{context}{input}",
}

JIEBA: bool | None = None  # None: use jieba for Chinese words when installed; False: never; True: require it

_OFFICIAL_KEYS = ("input", "context", "answers")
_KVPRESS_KEYS = ("context", "question", "answer_prefix", "answers")
_NAME = {"longbench": "LongBench", "longbench_e": "LongBench-E"}


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


def load_longbench(path, tokenizer, *, subsets=None, limit=None, max_length=None) -> list[Task]:
    """LongBench's tasks from ``path`` (see the module docstring): ``subsets`` (None: all 21, in published order),
    the first ``limit`` rows of each, prompts cut in the middle to ``max_length`` tokens."""
    return _load("longbench", path, tokenizer, subsets, limit, max_length)


def load_longbench_e(path, tokenizer, *, subsets=None, limit=None, max_length=None) -> list[Task]:
    """LongBench-E's tasks (the 13 subsets re-sampled evenly over 0-4k / 4-8k / 8k+ words, files
    ``<subset>_e.jsonl``); as ``load_longbench`` otherwise, with ``meta["length_bucket"]``."""
    return _load("longbench_e", path, tokenizer, subsets, limit, max_length)


def _subset_name(name: str) -> str:
    """A row's ``dataset`` as a subset: LongBench-E's "qasper_e" (or "qasper-e") is "qasper"."""
    for tail in ("_e", "-e"):
        if name.endswith(tail) and name[: -len(tail)] in LONGBENCH:
            name = name[: -len(tail)]
    return name


def length_bucket(length) -> str | None:
    """LongBench-E's length interval of a row's ``length``: "0-4k", "4-8k" or "8k+"."""
    if length is None:
        return None
    n = float(length)
    return "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"


def _load(benchmark, path, tokenizer, subsets, limit, max_length) -> list[Task]:
    names = _io.wanted(subsets, SUBSETS[benchmark], _NAME[benchmark], keep_order=True)
    config = _io.OfficialConfig.find(path, "dataset2prompt.json", "dataset2maxlen.json")
    by_subset = _io.rows_by_subset(
        path,
        names,
        SUBSETS[benchmark],
        "LongBench",
        suffix="_e" if benchmark == "longbench_e" else "",
        fields=("dataset", "task"),
        grouped=LONGBENCH,
        rename=_subset_name,
        inner=("data",),
        fix=", or unpack LongBench's data.zip there",
    )
    out = []
    for subset, (rows, where) in by_subset.items():
        for i, row in enumerate(rows[:limit] if limit is not None else rows):
            fmt = _io.official_or_kvpress(row, where, "LongBench", _OFFICIAL_KEYS, _KVPRESS_KEYS)
            if fmt == "kvpress":  # the row itself: kvpress's rule builds its prompt
                prompt, template = row, "kvpress"
                new = int(row.get("max_new_tokens") or MAX_NEW_TOKENS[subset])
            else:
                fmt_str, template = config.template(subset, TEMPLATES)
                prompt = _io.fill_template(fmt_str, row, f"{where}: the {subset} template ({template})")
                new = config.max_new_tokens(subset, MAX_NEW_TOKENS)
            answers = _io.answers_of(row["answers"])
            if not answers:
                raise ValueError(f"{where}: row {i} has an empty 'answers' list; every LongBench row needs one")
            classes = _io.answers_of(row.get("all_classes")) or None
            metric = SUBSET_METRIC[subset]
            if metric == "longbench_classification" and not classes:
                raise ValueError(
                    f"{where}: row {i} of {subset} has no 'all_classes' (the label set the "
                    f"classification score needs); use LongBench's own files, which carry it"
                )
            ids, cut, built = _io.tokenized(tokenizer, prompt, max_length)
            meta = {
                "all_classes": classes,
                "language": row.get("language"),
                "dataset_length": row.get("length"),
                "first_line": subset in FIRST_LINE,
                "format": fmt,
                "template": template,
                **built,
            }
            if benchmark == "longbench_e":
                meta["length_bucket"] = length_bucket(row.get("length"))
            out.append(
                _io.task(benchmark, subset, row.get("_id", f"{subset}-{i}"), ids, answers, metric, new, cut, **meta)
            )
    return out


LOADERS = {"longbench": load_longbench, "longbench_e": load_longbench_e}


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------


def _jieba():
    if JIEBA is False:
        return None
    try:
        import jieba
    except ImportError:
        if JIEBA:
            raise ImportError("longbench.JIEBA = True needs jieba (pip install jieba)") from None
        return None
    return jieba


def zh_words(text: str) -> list[str]:
    """Chinese text as words: jieba's precise mode when installed (see ``JIEBA``), else each CJK character, each
    run of ASCII letters / digits and each other non-space character."""
    jieba = _jieba()
    if jieba is not None:
        return list(jieba.cut(text, cut_all=False))
    return re.findall(r"[A-Za-z0-9]+|\S", text)


def qa_f1_zh(output: str, truth: str) -> float:
    """LongBench's qa_f1_zh_score: token F1 over Chinese words (``zh_words``) normalised by ``_text.normalize_zh``
    (InfiniteBench's Zh.QA takes characters instead: ``infinitebench.qa_f1_zh``)."""

    def words(text):
        return [w for w in (normalize_zh(t) for t in zh_words(text)) if w]

    return token_f1(words(output), words(truth))


def rouge_l_f(output: str, truth: str) -> float:
    """LongBench's rouge_score: ROUGE-L F as the ``rouge`` package (pltrdy/rouge) computes it (``_text.rouge_l``,
    not InfiniteBench's rouge_score ROUGE-Lsum), 0 for an empty output."""
    s = rouge_l(output, truth)
    return 0.0 if s is None else s["f"]


def rouge_l_f_zh(output: str, truth: str) -> float:
    """LongBench's rouge_zh_score: ROUGE-L F over Chinese words (``zh_words``) joined by spaces."""
    return rouge_l_f(" ".join(zh_words(output)), " ".join(zh_words(truth)))


def classification(output: str, truth: str, classes: list[str]) -> float:
    """LongBench's classification_score: the labels of ``classes`` found in ``output``; those that are part of the
    true label (but not it) are dropped; 1 / (labels left) if the true label is among them, else 0."""
    found = [c for c in classes if c in output]
    # the official loop removes items from the list it iterates over, so the label right after a removed one is
    # never looked at; this walk keeps that behaviour
    i = 0
    while i < len(found):
        if found[i] != truth and found[i] in truth:
            del found[i]
        i += 1
    return 1.0 / len(found) if truth in found else 0.0


def _share_of_numbers(output: str, number: str) -> float:
    numbers = re.findall(r"\d+", output)
    return sum(n == number for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(output: str, truth: str, marker: str = "Paragraph ") -> float:
    """LongBench's retrieval_score: the share of the numbers in ``output`` equal to the paragraph number in
    ``truth`` ("Paragraph 12"; Chinese: "段落12")."""
    m = re.search(re.escape(marker) + r"(\d+)", truth)
    if m is None:
        raise ValueError(f"retrieval answer {truth!r} has no {marker.strip()!r} number")
    return _share_of_numbers(output, m.group(1))


def count(output: str, truth: str) -> float:
    """LongBench's count_score: the share of the numbers in ``output`` equal to ``truth``."""
    return _share_of_numbers(output, str(truth))


def lcs_length(a: str, b: str) -> int:
    """Length of a longest common subsequence of two strings (bit-parallel, one big integer per row)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def levenshtein_ratio(a: str, b: str) -> float:
    """python-Levenshtein's ``ratio``: (|a| + |b| - indel distance) / (|a| + |b|) = 2 LCS / (|a| + |b|); 1 for
    equal strings (two empty ones included), 0 when only one is empty."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))


def first_code_line(output: str) -> str:
    """The first line of ``output`` (leading newlines skipped) without a backtick, "#" or "//", else ""."""
    for line in output.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(output: str, truth: str) -> float:
    """LongBench's code_sim_score: ``levenshtein_ratio`` of ``first_code_line(output)`` and the answer, rounded
    to a whole percent as ``fuzz.ratio`` rounds it."""
    return int(round(100 * levenshtein_ratio(first_code_line(output), truth))) / 100


def _scorer(fn):
    def metric(answers, output: str, meta: dict) -> float:
        answers = _io.expected(answers, "a LongBench metric")
        meta = meta or {}
        if meta.get("first_line", meta.get("subset") in FIRST_LINE):
            output = output.lstrip("\n").split("\n")[0]
        return max(float(fn(output, a, meta)) for a in answers)

    return metric


def _classification(output, truth, meta):
    """the classification score over ``meta['all_classes']``"""
    classes = meta.get("all_classes")
    if not classes:
        raise ValueError("longbench_classification needs meta['all_classes'] (the subset's label set)")
    return classification(output, truth, list(classes))


METRICS = {
    "longbench_qa_f1": _scorer(lambda o, t, m: qa_f1(o, t)),
    "longbench_qa_f1_zh": _scorer(lambda o, t, m: qa_f1_zh(o, t)),
    "longbench_rouge_l": _scorer(lambda o, t, m: rouge_l_f(o, t)),
    "longbench_rouge_l_zh": _scorer(lambda o, t, m: rouge_l_f_zh(o, t)),
    "longbench_classification": _scorer(_classification),
    "longbench_retrieval": _scorer(lambda o, t, m: retrieval(o, t, "Paragraph ")),
    "longbench_retrieval_zh": _scorer(lambda o, t, m: retrieval(o, t, "段落")),
    "longbench_count": _scorer(lambda o, t, m: count(o, t)),
    "longbench_code_sim": _scorer(lambda o, t, m: code_sim(o, t)),
}
for _name, _fn in METRICS.items():
    _fn.__name__ = _name
    _fn.__doc__ = (
        f"``{_name}(answers, output, meta)``: see the module docstring; the max over ``answers``, the "
        f"output cut to its first line when ``meta['first_line']``."
    )
del _name, _fn

__all__ = [
    "FIRST_LINE",
    "LOADERS",
    "MAX_NEW_TOKENS",
    "METRICS",
    "SUBSETS",
    "SUBSET_METRIC",
    "TEMPLATES",
    "classification",
    "code_sim",
    "count",
    "first_code_line",
    "lcs_length",
    "length_bucket",
    "levenshtein_ratio",
    "load_longbench",
    "load_longbench_e",
    "qa_f1_zh",
    "retrieval",
    "rouge_l_f",
    "rouge_l_f_zh",
    "zh_words",
]
