"""InfiniteBench (Zhang et al., 2024, https://arxiv.org/abs/2402.13718): 12 tasks over 100k+ token contexts.

**Data** (https://github.com/OpenBMB/InfiniteBench; Hugging Face ``xinrongzhang2022/InfiniteBench``, one split per
task): one ``<task>.jsonl`` per task, rows ``id``, ``context``, ``input`` (the question, or the line that asks it),
``answer`` (a string, a list of strings, an int, or for Math.Calc a list of ints) and ``options`` (the four choices of
En.MC and Code.Debug, else empty). The tasks, in the README's order (subsets take either name):

    longbook_sum_eng En.Sum       longbook_qa_chn Zh.QA      math_find Math.Find
    longbook_qa_eng En.QA         code_debug Code.Debug      passkey Retrieve.PassKey
    longbook_choice_eng En.MC     code_run Code.Run          number_string Retrieve.Number
    longdialogue_qa_eng En.Dia    math_calc Math.Calc        kv_retrieval Retrieve.KV

**Prompts.** InfiniteBench's prompts are templates in its repo (``src/prompt.py``, ``yarn_mistral_templates`` for
open models), filled by ``src/eval_utils.py``'s ``create_prompt``. kvpass does not ship them: put them in a
``templates.json`` next to the data (``{task: template}``, InfiniteBench's placeholders: ``{context}``, ``{input}``,
``{question}``, ``{OPTION_A}``..``{OPTION_D}``, ``{func}``, ``{func_call}``, ``{prefix}``; plus
``"math_find_prefix"``, the sentence ``create_prompt`` builds for ``{prefix}``, with ``{target}`` where it puts "the
largest number" and the like) and kvpass fills them as ``create_prompt`` does. Without the file kvpass uses
prompts of its own wording (``PROMPTS``): same inputs and answer lead-ins in spirit, but published numbers need the
official templates (``meta["template"]`` says which was used). The prompt is tokenized as one text with the
tokenizer's special tokens and no chat template, as the repo runs open models (``eval_yarn_mistral.py``); the repo
cuts prompts in the middle to 128k tokens: pass ``max_length=131072`` to do the same. Gen lengths are the repo's
(``DATA_NAME_TO_MAX_NEW_TOKENS``): passkey 6, number_string 12, kv_retrieval 50, longbook_sum_eng 1200, the
longbook/longdialogue QA and choice tasks 40, math_find 3, math_calc 30000, code_run 5, code_debug 5.

**kvpress's format** (kvpress evaluates InfiniteBench on Hugging Face ``MaxJeblick/InfiniteBench``, one config per
task, split ``test``; ``evaluation/benchmarks/infinite_bench/create_huggingface_dataset.py`` in
https://github.com/NVIDIA/kvpress): columns ``context`` (template head and context), ``question`` (with the options),
``answer_prefix``, ``answer`` (a list of strings; the letter alone for En.MC and Code.Debug), ``task``,
``max_new_tokens`` (the repo's plus 20). The prompt is kvpress's (``_io.kvpress_prompt``: chat template when the
tokenizer has one) and the gen length the row's.

**Metrics**, per row in [0, 1], as InfiniteBench's ``src/compute_scores.py`` scores (its quirks kept, so numbers
compare): En.QA ``infinitebench_qa_f1`` (token F1 after lower-casing and removing punctuation and articles, best
over the answers); Zh.QA ``infinitebench_qa_f1_zh`` (the same on characters, Chinese punctuation removed); En.Sum
``infinitebench_rouge_lsum`` (ROUGE-Lsum F1 of the 🤗 ``evaluate`` / ``rouge_score`` defaults: lower-cased ``[a-z0-9]+``
tokens, no stemming, sentences split at newlines, summary-level union LCS; implemented here, no dependency); En.MC
``infinitebench_choice``; En.Dia ``infinitebench_dialogue`` (the first answer, upper-cased, among the output's
words); Code.Debug ``infinitebench_code_debug``; Code.Run ``infinitebench_code_run`` (the output's last word as an
integer); Math.Calc ``infinitebench_math_calc`` (the share of leading values right, up to the first wrong one;
numbers read without their sign, as the repo reads them); Math.Find ``infinitebench_math_find`` (the first number
of the output); PassKey and Number ``infinitebench_first_int`` (the first run of digits equals the answer);
Retrieve.KV ``infinitebench_kv_retrieval`` (the answer is one of the output's words). Rows in kvpress's format are
scored with kvpress's adaptations where kvpress changed the rule: ``infinitebench_choice_kvpress`` (first the last
standalone A-D), ``infinitebench_dialogue_kvpress`` (any answer as a substring), ``infinitebench_code_debug_kvpress``
(kvpress's own scorer indexes a second label that its dataset lacks and fails; kvpass scores the letter).
Deliberate differences: Math.Find compares numbers by value (the repo raises on "88.0" for the answer 88), and
Code.Run / Math.Find read the answer as a number in both formats (kvpress's dataset stores answers as strings, which
its copy of the repo's scorer compares with an int, so Code.Run scores 0 and Math.Find raises there).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from kvpass.eval.benchmarks import _io, _text

TASKS = (
    "longbook_sum_eng",
    "longbook_qa_eng",
    "longbook_choice_eng",
    "longdialogue_qa_eng",
    "longbook_qa_chn",
    "code_debug",
    "code_run",
    "math_calc",
    "math_find",
    "passkey",
    "number_string",
    "kv_retrieval",
)
SUBSETS = {"infinitebench": TASKS}
DISPLAY = {
    "longbook_sum_eng": "En.Sum",
    "longbook_qa_eng": "En.QA",
    "longbook_choice_eng": "En.MC",
    "longdialogue_qa_eng": "En.Dia",
    "longbook_qa_chn": "Zh.QA",
    "code_debug": "Code.Debug",
    "code_run": "Code.Run",
    "math_calc": "Math.Calc",
    "math_find": "Math.Find",
    "passkey": "Retrieve.PassKey",
    "number_string": "Retrieve.Number",
    "kv_retrieval": "Retrieve.KV",
}
ALIASES = {**{v: k for k, v in DISPLAY.items()}, **{v.lower(): k for k, v in DISPLAY.items()}}

MAX_NEW_TOKENS = {
    "passkey": 6,
    "number_string": 12,
    "kv_retrieval": 50,
    "longbook_sum_eng": 1200,
    "longbook_choice_eng": 40,
    "longbook_qa_eng": 40,
    "longbook_qa_chn": 40,
    "longdialogue_qa_eng": 40,
    "math_find": 3,
    "math_calc": 30000,
    "code_run": 5,
    "code_debug": 5,
}

METRIC = {
    "longbook_sum_eng": "infinitebench_rouge_lsum",
    "longbook_qa_eng": "infinitebench_qa_f1",
    "longbook_choice_eng": "infinitebench_choice",
    "longdialogue_qa_eng": "infinitebench_dialogue",
    "longbook_qa_chn": "infinitebench_qa_f1_zh",
    "code_debug": "infinitebench_code_debug",
    "code_run": "infinitebench_code_run",
    "math_calc": "infinitebench_math_calc",
    "math_find": "infinitebench_math_find",
    "passkey": "infinitebench_first_int",
    "number_string": "infinitebench_first_int",
    "kv_retrieval": "infinitebench_kv_retrieval",
}
KVPRESS_METRIC = {
    **METRIC,
    "longbook_choice_eng": "infinitebench_choice_kvpress",
    "longdialogue_qa_eng": "infinitebench_dialogue_kvpress",
    "code_debug": "infinitebench_code_debug_kvpress",
}

OFFICIAL_FIELDS = ("context", "input", "answer")
KVPRESS_FIELDS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")
TEMPLATES_FILE = "templates.json"

# kvpass's own prompts (used without a templates.json): InfiniteBench's placeholders, kvpass's wording.
PROMPTS = {
    "passkey": "The text below hides a pass key among a great deal of filler. Find the pass key and keep it in mind: "
    "a question about it follows.\n\n{context}\n\n{input}\n\nThe pass key is",
    "number_string": "The text below hides a long sequence of digits among a great deal of filler. Find it and keep "
    "it in mind: a question about it follows.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Below is a JSON object that maps keys to values. Look up the value stored under the key you are "
    "asked about.\n\n{context}\n\n{input}",
    "longbook_sum_eng": "Write a summary of the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book below, then answer the multiple-choice question about it.\n\n{context}\n\n"
    "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
    "Reply with the letter of the right option.\nAnswer:",
    "longbook_qa_eng": "Read the book below, then answer the question about it in as few words as possible.\n\n"
    "{context}\n\nQuestion: {question}\nAnswer:",
    "longbook_qa_chn": "请阅读下面这本书，然后尽量简短地回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Work out the running value of the arithmetic expression below: after each operation, write the "
    "result so far, all in one list.\n\nExpression: 2 + 5 - 1\nValues: [2, 7, 6]\n\n"
    "Expression: 9 - 4 - 3 + 6\nValues: [9, 5, 2, 8]\n\nExpression: {context}\nValues:",
    "code_run": "The Python code below defines a function named {func}, among many others.\n\n{context}\n\n"
    "What does {func_call} return? Give its exact value.\nThe value of {func_call} is",
    "code_debug": "In the Python code below, exactly one function or method has a deliberate bug that makes it "
    "crash.\n\n{context}\n\nWhich one is it?\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\n"
    'D. {OPTION_D}\n\nReply with the letter and the name, as in "A. name".\nAnswer:',
    "longdialogue_qa_eng": "Below is a script in which one mention of a character's name has been replaced by "
    '"$$MASK$$". Work out which character it is.\n\n{context}\n\nWhich character is '
    '"$$MASK$$"? Reply with the name only.\nAnswer:',
}
MATH_FIND_PREFIX = "Find {target} in the list of numbers below."  # kvpass's wording of {prefix}

_PLACEHOLDER = re.compile(r"\{(context|input|question|OPTION_[ABCD]|func|func_call|prefix)\}")


# --------------------------------------------------------------------------------------------
# Reading


def _fix(fmt: str) -> str:
    if fmt == "kvpress":
        return (
            f"kvpress's InfiniteBench (MaxJeblick/InfiniteBench, one config per task) has "
            f"{', '.join(KVPRESS_FIELDS)} and task."
        )
    return (
        "InfiniteBench's jsonl (xinrongzhang2022/InfiniteBench, <task>.jsonl) has id, context, input, answer, options."
    )


_FORMATS = {"kvpress": ("context", "question"), "official": ("context", "input")}


def _format(row: dict, source: str) -> str:
    return _io.row_format(row, source, _FORMATS, "InfiniteBench", f"{_fix('official')} {_fix('kvpress')}")


def _hub_rows(repo: str, config: str | None, task: str) -> list[dict]:
    if repo.lower() == "xinrongzhang2022/infinitebench":  # one split per task; answers need a declared type
        try:
            import datasets
        except ImportError:
            raise FileNotFoundError(
                f"{repo}: reading it from the Hugging Face Hub needs the optional 'datasets' "
                f"package (pip install datasets), or download <task>.jsonl files"
            ) from None
        features = datasets.Features(
            {
                "id": datasets.Value("int64"),
                "context": datasets.Value("string"),
                "input": datasets.Value("string"),
                "answer": datasets.Sequence(datasets.Value("string")),
                "options": datasets.Sequence(datasets.Value("string")),
            }
        )
        return [dict(r) for r in datasets.load_dataset(repo, split=task, features=features)]
    return _io.records(repo, config or task)  # kvpress's MaxJeblick/InfiniteBench: config = task


def _groups(path, names: list[str], limit: int | None) -> tuple[dict, dict]:
    """task -> [(row, source)], and the templates read from a templates.json (else {})."""
    groups: dict = {}
    hub = _io.hub_id(path)
    if hub is not None:
        for task in names:
            groups[task] = [(row, f"{path}:{task}") for row in _hub_rows(hub[0], hub[1], task)]
        return groups, {}
    files, root = _io.data_files(path, empty_ok=True), Path(path).expanduser()
    templates = _templates(root if root.is_dir() else root.parent)
    seen: dict = {}
    for file in files:
        if file.name == TEMPLATES_FILE:
            continue
        task = _io.named(file, root, TASKS)
        if task is not None and task not in names:
            continue
        if task is not None and seen.setdefault(task, file).parent != file.parent:  # shards share a folder
            raise ValueError(f"{seen[task]} and {file} both hold InfiniteBench task {task!r}: point at one of them")
        for row in _io.read_rows(file, limit if task is not None else None):
            name = _io.row_task(
                row,
                task,
                str(file),
                "InfiniteBench",
                TASKS,
                f"the file is not named for an "
                f"InfiniteBench task ({', '.join(TASKS)}). Keep InfiniteBench's names (<task>.jsonl)",
                ALIASES,
            )
            if name in names:
                groups.setdefault(name, []).append((row, str(file)))
    return groups, templates


def _templates(folder: Path) -> dict:
    file = folder / TEMPLATES_FILE
    if not file.is_file():
        return {}
    found = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(found, dict):
        raise ValueError(f"{file}: expected a JSON object {{task: template}}")
    for key, value in found.items():
        if key != "math_find_prefix" and key not in TASKS:
            raise ValueError(f"{file}: unknown key {key!r}; use task names ({', '.join(TASKS)}) and math_find_prefix")
        if not isinstance(value, str) or (key in TASKS and "{context}" not in value):
            raise ValueError(f"{file}: the template for {key!r} must be a string holding {{context}}")
    if "math_find" in found and "math_find_prefix" not in found:
        raise ValueError(
            f"{file}: a math_find template needs math_find_prefix too (the sentence that fills "
            f"{{prefix}}, with {{target}})"
        )
    return found


# --------------------------------------------------------------------------------------------
# Prompts and answers


def _options(row: dict, task: str, source: str) -> list[str]:
    options = _io.answers_of(row.get("options"))
    if len(options) < 4:
        raise ValueError(
            f"{source}: a {task} row (id {row.get('id')}) needs 4 'options', has {len(options)}. {_fix('official')}"
        )
    return options


def _fields(row: dict, task: str, source: str) -> dict:
    fields = {"context": row["context"], "input": row["input"], "question": row["input"]}
    if task in ("longbook_choice_eng", "code_debug"):
        for letter, option in zip("ABCD", _options(row, task, source)):
            fields[f"OPTION_{letter}"] = option
    if task == "code_run":
        call = re.search(r"func_[0-9]+\(-?[0-9]+\)", row["input"])
        if call is None:
            raise ValueError(f"{source}: a code_run row (id {row.get('id')}) has no call like func_12(3) in 'input'")
        fields["func_call"], fields["func"] = call.group(0), call.group(0).split("(")[0]
    if task == "math_find":
        ask = re.findall(r"The .+ of", row["input"])
        if not ask:
            raise ValueError(
                f"{source}: a math_find row (id {row.get('id')}) does not say which number it asks for "
                f"('The ... of' in 'input')"
            )
        fields["target"] = ask[0].lower()[:-3]  # "the largest number", as create_prompt takes it
    return fields


def _fill(template: str, fields: dict) -> str:
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], template)


def _answers(row: dict, task: str, source: str) -> list[str]:
    answer = row["answer"]
    if task in ("longbook_choice_eng", "code_debug"):
        options = _options(row, task, source)
        given = _io.answers_of(answer)
        if len(given) == 2 and given[1] in ("A", "B", "C", "D"):
            return given  # already [option, letter]
        if not given or given[0] not in options:
            raise ValueError(f"{source}: a {task} row (id {row.get('id')}) answers {given!r}, not one of its options")
        return [given[0], "ABCD"[options.index(given[0])]]
    if task == "math_calc":
        values = list(answer) if not isinstance(answer, str) else [answer]
        if len(values) == 1 and not isinstance(values[0], (int, str)):
            values = list(values[0])  # [[...]]: one list of values
        return [str(v) for v in values]
    return _io.answers_of(answer)


def _build(tokenizer, row: dict, fmt: str, task: str, position: int, source: str, templates: dict, max_length):
    if fmt == "kvpress":
        _io.need(row, KVPRESS_FIELDS, source, "kvpress InfiniteBench", _fix("kvpress"))
        ids, cut, prompt = _io.kvpress_ids(tokenizer, row, max_length)
        return _io.task(
            "infinitebench",
            task,
            row.get("id", position),
            ids,
            _io.answers_of(row["answer"]),
            KVPRESS_METRIC[task],
            int(row["max_new_tokens"]),
            cut,
            format="kvpress",
            display=DISPLAY[task],
            **prompt,
        )
    _io.need(row, OFFICIAL_FIELDS, source, "InfiniteBench", _fix("official"))
    official = task in templates
    fields = _fields(row, task, source)
    if task == "math_find":
        fields["prefix"] = (templates["math_find_prefix"] if official else MATH_FIND_PREFIX).format(
            target=fields["target"]
        )
    prompt = _fill(templates[task] if official else PROMPTS[task], fields)
    ids, cut = _io.prompt_ids(tokenizer, prompt, max_length)
    meta = {"format": "official", "display": DISPLAY[task], "template": "official" if official else "kvpass"}
    if task in ("longbook_choice_eng", "code_debug"):
        meta["options"] = _options(row, task, source)[:4]
    return _io.task(
        "infinitebench",
        task,
        row.get("id", position),
        ids,
        _answers(row, task, source),
        METRIC[task],
        MAX_NEW_TOKENS[task],
        cut,
        **meta,
    )


def load(path, tokenizer, *, subsets=None, limit: int | None = None, max_length: int | None = None):
    """InfiniteBench tasks from ``path`` (a folder of ``<task>.jsonl``, a file, a kvpress snapshot folder of
    ``<task>/`` parquet folders, or a Hub id): each task of ``subsets`` (None: every task present; task or display
    names) in the README's order, its first ``limit`` rows; ``max_length`` cuts longer prompts in the middle."""
    names = _io.wanted(subsets, TASKS, "InfiniteBench", ALIASES)
    groups, templates = _groups(path, names, limit)
    _io.check_found(path, "InfiniteBench", subsets, names, groups, [t for t in TASKS if t in groups])
    out = []
    for task in (t for t in TASKS if t in groups):
        rows = groups[task][:limit] if limit is not None else groups[task]
        for position, (row, source) in enumerate(rows):
            out.append(_build(tokenizer, row, _format(row, source), task, position, source, templates, max_length))
    return out


LOADERS = {"infinitebench": load}


# --------------------------------------------------------------------------------------------
# Metrics (InfiniteBench's src/compute_scores.py, rewritten; kvpress's adaptations where noted)


def _need(answers) -> list[str]:
    return _io.expected(answers, "an InfiniteBench metric")


def qa_f1(answers, output: str, meta: dict) -> float:
    """En.QA: the best token F1 between the output and an answer, both lower-cased, without punctuation and
    articles (``_text.qa_f1``)."""
    return max(_text.qa_f1(output, a) for a in _need(answers))


def qa_f1_zh(answers, output: str, meta: dict) -> float:
    """Zh.QA: the best character F1 between the output and an answer, without punctuation and whitespace
    (``_text.normalize_zh``; one character one token, where LongBench's Chinese F1 takes words)."""
    pred = list(_text.normalize_zh(output))
    return max(_text.token_f1(pred, list(_text.normalize_zh(a))) for a in _need(answers))


def _rouge_tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def rouge_lsum(reference: str, output: str) -> float:
    """ROUGE-Lsum F1 as Google's ``rouge_score`` computes it by default, the scorer InfiniteBench's
    ``compute_scores.py`` calls through 🤗 ``evaluate``: sentences split at newlines, tokens ``[a-z0-9]+`` of the
    lower-cased text, for each reference sentence the union of its LCS with every output sentence
    (``_text.lcs_indices``, rouge_score's tie rule), each token counted at most as often as it occurs on both sides.

    Not ``_text.rouge_l``: that is the ``rouge`` package's ROUGE-L (LongBench's and LooGLE's scorer), which splits
    sentences at ".", keeps punctuation inside words and counts distinct words; using it here would not give
    InfiniteBench's numbers."""
    refs = [t for t in (_rouge_tokens(s) for s in reference.split("\n") if s) if t]
    cands = [t for t in (_rouge_tokens(s) for s in output.split("\n") if s) if t]
    m, n = sum(map(len, refs)), sum(map(len, cands))
    if not m or not n:
        return 0.0
    left_r = Counter(t for s in refs for t in s)
    left_c = Counter(t for s in cands for t in s)
    hits = 0
    for ref in refs:
        for i in sorted(set().union(*(_text.lcs_indices(ref, c, ties="a") for c in cands))):
            token = ref[i]
            if left_r[token] > 0 and left_c[token] > 0:
                hits += 1
                left_r[token] -= 1
                left_c[token] -= 1
    precision, recall = hits / n, hits / m
    return 0.0 if hits == 0 else 2 * precision * recall / (precision + recall)


def rouge_lsum_metric(answers, output: str, meta: dict) -> float:
    """En.Sum: the best ROUGE-Lsum F1 of the output against an answer (🤗 evaluate's ``rougeLsum``)."""
    return max(rouge_lsum(a, output) for a in _need(answers))


def _spaced(text: str, chars) -> str:
    for c in chars:
        text = text.replace(c, " ")
    return text


def _squeeze(text: str) -> str:
    while "  " in text:
        text = text.replace("  ", " ")
    return text


def _choice(labels: list[str], pred: str) -> bool:
    pred = pred.strip()
    if not pred:
        return False
    if pred[0] in "ABCD":
        return pred[0] in labels
    if pred in labels:
        return True
    pred = _squeeze(_spaced(pred, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]))
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        at = pred.find(prefix)
        if at < 0:
            continue
        rest = pred[at + len(prefix) + 1 :]
        return len(pred) >= at + len(prefix) + 1 and any(rest.startswith(label) for label in labels)
    for word in pred.split():
        if word in "ABCD":
            return word in labels
    return False


def choice(answers, output: str, meta: dict) -> float:
    """En.MC: the output's first character if it is A-D, else the output equal to an answer, else the text after
    "answer is:" / "answer:" / "answer is" / "option is", else its first word that is A-D, checked against the
    answers (the right option's text and letter)."""
    return float(_choice(_need(answers), output))


_LAST_AD = re.compile(r"\b[A-D]\b(?!.*\b[A-D]\b)")
_LAST_AJ = re.compile(r"\b[A-J]\b(?!.*\b[A-J]\b)")


def choice_kvpress(answers, output: str, meta: dict) -> float:
    """En.MC as kvpress scores it: first the last standalone A-D of the output's first line that has one, then
    ``choice``'s rules."""
    labels = _need(answers)
    found = _LAST_AD.search(output.strip())
    if found and found.group(0) in labels:
        return 1.0
    return float(_choice(labels, output))


def dialogue(answers, output: str, meta: dict) -> float:
    """En.Dia: the first answer is one of the output's words, upper-cased, punctuation split off."""
    words = _spaced(output.strip(), ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()
    return float(_need(answers)[0] in [w.upper() for w in words])


def dialogue_kvpress(answers, output: str, meta: dict) -> float:
    """En.Dia as kvpress scores it: any answer, upper-cased, is a substring of the upper-cased output."""
    pred = output.strip().upper()
    return float(any(a.upper() in pred for a in _need(answers)))


def _code_debug(letter: str, name: str | None, pred: str) -> bool:
    pred = _squeeze(_spaced(pred.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"]))
    for prefix in ("answer is:", "is:", "answer:", "correct option is:"):
        at = pred.find(prefix)
        if at < 0:
            continue
        if len(pred) < at + len(prefix) + 1:
            return False
        rest = pred[at + len(prefix) + 1 :]
        return rest.startswith(letter) or (name is not None and rest.startswith(name))
    return False


def code_debug(answers, output: str, meta: dict) -> float:
    """Code.Debug: the output starts with "<letter>." or "<letter>:", or the text after "answer is:" / "is:" /
    "answer:" / "correct option is:" starts with the letter or the function's name (answers: [name, letter])."""
    labels = _need(answers)
    letter, name = labels[-1], (labels[0] if len(labels) > 1 else None)
    pred = output.strip()
    return float(pred[:2] in (f"{letter}.", f"{letter}:") or _code_debug(letter, name, pred))


def code_debug_kvpress(answers, output: str, meta: dict) -> float:
    """Code.Debug as kvpress adapted it: the last standalone A-J of the output's first line that has one, else the
    output starting with the letter or the name, else the answer-prefix rule of ``code_debug``."""
    labels = _need(answers)
    letter, name = labels[-1], (labels[0] if len(labels) > 1 else None)
    pred = output.strip()
    found = _LAST_AJ.search(pred)
    if found and found.group(0) == letter:
        return 1.0
    squeezed = _squeeze(_spaced(pred, ["\n", "`", "'", '"', "-", "*", "Option", "option"]))
    if squeezed.startswith(letter) or (name is not None and squeezed.startswith(name)):
        return 1.0
    return float(_code_debug(letter, name, pred))


def code_run(answers, output: str, meta: dict) -> float:
    """Code.Run: the output's last word (after removing newlines, dots, backticks, quotes and colons) is the
    answer's integer."""
    words = _spaced(output.strip(), ["\n", ".", "`", "'", '"', ":"]).split()
    try:
        return float(bool(words) and int(words[-1]) == int(_need(answers)[0]))
    except ValueError:
        return 0.0


def _values(answers) -> list[int]:
    answers = _need(answers)
    if len(answers) == 1 and answers[0].lstrip().startswith("["):  # a list kept as one string
        answers = re.findall(r"-?\d+", answers[0])
    return [int(a) for a in answers]


def math_calc(answers, output: str, meta: dict) -> float:
    """Math.Calc: the share of the expected values the output gets right in order, up to the first wrong one;
    the output's numbers are its runs of digits (signs are not read, as in the repo)."""
    labels = _values(answers)
    preds = [int(x) for x in re.split(r"[^0-9]", output) if x]
    right = 0
    for want, got in zip(labels, preds):
        if want != got:
            break
        right += 1
    return right / len(labels)


def math_find(answers, output: str, meta: dict) -> float:
    """Math.Find: the output's first number (``\\d+\\.\\d+`` or ``\\d+``) equals the answer, by value."""
    first = re.search(r"\d+\.\d+|\d+", output)
    return float(first is not None and float(first.group(0)) == float(_need(answers)[0]))


def first_int(answers, output: str, meta: dict) -> float:
    """Retrieve.PassKey and Retrieve.Number: the output's first run of digits equals the answer."""
    first = next((x for x in re.split(r"[^0-9]", output) if x), "")
    return float(first == _need(answers)[0])


def kv_retrieval(answers, output: str, meta: dict) -> float:
    """Retrieve.KV: the answer is one of the output's words (split at whitespace and at \\n : " ' . , ? ! { })."""
    words = _spaced(output, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()
    return float(_need(answers)[0] in words)


METRICS = {
    "infinitebench_qa_f1": qa_f1,
    "infinitebench_qa_f1_zh": qa_f1_zh,
    "infinitebench_rouge_lsum": rouge_lsum_metric,
    "infinitebench_choice": choice,
    "infinitebench_choice_kvpress": choice_kvpress,
    "infinitebench_dialogue": dialogue,
    "infinitebench_dialogue_kvpress": dialogue_kvpress,
    "infinitebench_code_debug": code_debug,
    "infinitebench_code_debug_kvpress": code_debug_kvpress,
    "infinitebench_code_run": code_run,
    "infinitebench_math_calc": math_calc,
    "infinitebench_math_find": math_find,
    "infinitebench_first_int": first_int,
    "infinitebench_kv_retrieval": kv_retrieval,
}

__all__ = ["DISPLAY", "LOADERS", "MAX_NEW_TOKENS", "METRICS", "PROMPTS", "SUBSETS", "TASKS", "load", "rouge_lsum"]
