"""AIME 2025 and MATH-500: short prompts, long generations, for policies that compress the cache while decoding.

**Data.** AIME 2025 (the 30 problems of AIME 2025 I and II): Hugging Face ``opencompass/AIME2025`` (configs
``AIME2025-I`` / ``AIME2025-II``, files ``aime2025-I.jsonl`` / ``aime2025-II.jsonl``, rows ``question``, ``answer``)
or copies with ``problem`` / ``answer`` (``id`` or ``problem_idx`` kept as the row id); the answer is an integer
0-999. MATH-500 (the 500-problem test subset of MATH from "Let's Verify Step by Step",
https://github.com/openai/prm800k): Hugging Face ``HuggingFaceH4/MATH-500``, ``test.jsonl``, rows ``problem``,
``solution``, ``answer``, ``subject``, ``level``, ``unique_id``. kvpress's copies (``alessiodevoto/aime25``,
``alessiodevoto/math500``, listed in kvpress's ``evaluation/evaluate_registry.py``) are read too: rows ``context``,
``question``, ``answer_prefix``, ``answer``, ``max_new_tokens``, turned into kvpress's prompt
(``_io.kvpress_prompt``, ``enable_thinking=False`` as kvpress runs them) with the row's gen length. A path is a
file, a folder (every data file in it, in path order: AIME I then II), or a Hub id (``owner/name`` or
``owner/name/config``, split ``test``). One subset each, ``test``; ``limit`` takes the first rows.

**Prompt** (kvpass's wording; neither benchmark publishes one): the problem, then "Work through the problem step by
step, then write the final answer as \\boxed{answer}." as the user turn of the tokenizer's chat template with the
generation prompt (the template's own defaults, so a thinking model thinks); without a chat template, the same text
followed by "Solution:". Gen length 32768 tokens, the budget DeepSeek-R1's evaluation gave reasoning models
(https://arxiv.org/abs/2501.12948); ``max_length`` cuts a longer prompt in the middle.

**Metrics.** The answer is the content of the output's last complete ``\\boxed{...}`` (braces matched, so
``\\boxed{\\frac{1}{\\sqrt{2}}}`` gives ``\\frac{1}{\\sqrt{2}}``; also ``\\fbox{}`` and ``\\boxed 5``); no box scores 0.
``aime25_integer``: the boxed answer, normalized (below), must be the same integer 0-999 as the reference ("070" is
70). ``math500_equiv``: the boxed answer and the reference, normalized, are equal as strings, or as numbers
(integers, decimals, ``\\frac{a}{b}``: "0.5" equals "\\frac12"), or, when sympy is importable (torch installs it),
as expressions whose difference sympy simplifies to 0 (only for plain expressions: digits, + - * / ^, \\frac,
\\sqrt, \\pi, one-letter variables; ``\\frac{\\sqrt{3}}{2}`` equals ``\\frac{1}{2}\\sqrt{3}``). Normalization
(``normalize``, written for kvpass after the MATH paper's answer checking, https://arxiv.org/abs/2103.03874): drops
``$``, ``\\(``/``\\)``, ``\\left``/``\\right``, ``\\!``, ``\\,`` and other spacing, ``\\displaystyle``, all whitespace,
``^\\circ`` and ``%``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\text{..}``/``\\mbox{..}``/``\\mathrm{..}`` -> their
content, a trailing unit (``\\text{ cm}``, "cm", "inches", "degrees", "dollars", "square units", ...) after a number
dropped; "x=" / "y =" prefixes of one or two characters dropped; ``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt3`` ->
``\\sqrt{3}``, ``a/b`` of integers -> ``\\frac{a}{b}``; "1,000" -> "1000", ".5" -> "0.5", "5.0" / "5.00" -> "5",
"2.50" -> "2.5". Case is kept.

**Difference from kvpress**: kvpress's scorers take the text between "boxed{" and the next "}" (math500 the first
box, aime25 the last) and compare it exactly with the reference, so nested braces and equivalent forms fail there;
kvpass's numbers for these are therefore not kvpress's.
"""

from __future__ import annotations

import re
from fractions import Fraction

from kvpass.eval.benchmarks import _io

SUBSETS = {"aime25": ("test",), "math500": ("test",)}
MAX_NEW_TOKENS = 32768
INSTRUCTION = "Work through the problem step by step, then write the final answer as \\boxed{answer}."
KVPRESS_FIELDS = ("context", "question", "answer_prefix", "answer", "max_new_tokens")
_METRIC = {"aime25": "aime25_integer", "math500": "math500_equiv"}
_NAMES = {"aime25": "AIME 2025", "math500": "MATH-500"}
_FORMATS = {"kvpress": ("context", "question"), "problem": ()}


# --------------------------------------------------------------------------------------------
# Loading


def _fix(benchmark: str) -> str:
    raw = (
        "question (or problem) and answer, as opencompass/AIME2025"
        if benchmark == "aime25"
        else "problem and answer, as HuggingFaceH4/MATH-500"
    )
    return f"Rows need {raw}; or kvpress's format ({', '.join(KVPRESS_FIELDS)})."


def _rows(path) -> list[tuple[dict, str]]:
    hub = _io.hub_id(path)
    if hub is not None:
        return [(row, str(path)) for row in _io.records(hub[0], hub[1])]
    return [(row, str(file)) for file in _io.data_files(path) for row in _io.records(file)]


def _integer(text) -> int | None:
    """The integer 0-999 that ``text`` states after normalization, else None."""
    value = normalize(str(text)).lstrip("+")
    return int(value) if re.fullmatch(r"\d+", value) and int(value) <= 999 else None


def _prompt(tokenizer, problem: str, max_length):
    user = f"{problem}\n\n{INSTRUCTION}"
    if not _io.has_chat(tokenizer):
        ids, cut = _io.prompt_ids(tokenizer, f"{user}\n\nSolution:", max_length)
        return ids, cut, False
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
    )
    ids, cut = _io.cut_middle(_io.encode(tokenizer, text), max_length)
    return ids, cut, True


def _build(benchmark: str, tokenizer, row: dict, position: int, source: str, max_length):
    row_id = next((row[k] for k in ("unique_id", "id", "problem_idx", "idx") if row.get(k) is not None), position)
    if _io.row_format(row, source, _FORMATS, _NAMES[benchmark], _fix(benchmark)) == "kvpress":
        _io.need(row, KVPRESS_FIELDS, source, f"kvpress {_NAMES[benchmark]}", _fix(benchmark))
        ids, cut, prompt = _io.kvpress_ids(tokenizer, row, max_length)
        answers, max_new, meta = (
            _io.answers_of(row["answer"]),
            int(row["max_new_tokens"]),
            {"format": "kvpress", **prompt},
        )
    else:
        problem = row.get("problem", row.get("question"))
        if problem is None or "answer" not in row:
            missing = "answer" if problem is not None else "problem"
            raise ValueError(
                f"{source}: a row has no field {missing!r}; its fields: "
                f"{', '.join(sorted(map(str, row)))}. {_fix(benchmark)}"
            )
        ids, cut, chat = _prompt(tokenizer, problem, max_length)
        answers, max_new = _io.answers_of(row["answer"]), MAX_NEW_TOKENS
        meta = {"format": "problem", "chat": chat}
        meta.update({k: row[k] for k in ("subject", "level") if k in row})
    if benchmark == "aime25" and (not answers or _integer(answers[0]) is None):
        raise ValueError(f"{source}: row {row_id!r} answers {answers!r}, not an integer 0-999 as AIME's are")
    if not answers or not answers[0].strip():
        raise ValueError(f"{source}: row {row_id!r} has an empty answer")
    return _io.task(benchmark, "test", row_id, ids, answers, _METRIC[benchmark], max_new, cut, **meta)


def _loader(benchmark: str):
    def load(path, tokenizer, *, subsets=None, limit: int | None = None, max_length: int | None = None):
        """The benchmark's tasks from ``path`` (replaced below by the benchmark's own line)."""
        _io.wanted(subsets, SUBSETS[benchmark], _NAMES[benchmark])  # checks the names: one subset, "test"
        rows = _rows(path)
        if not rows:
            raise ValueError(f"{path}: no {_NAMES[benchmark]} rows found")
        rows = rows[:limit] if limit is not None else rows
        return [_build(benchmark, tokenizer, row, i, source, max_length) for i, (row, source) in enumerate(rows)]

    load.__name__ = f"load_{benchmark}"
    load.__doc__ = (
        f"{_NAMES[benchmark]} tasks from ``path`` (see the module docstring): the first ``limit`` "
        f"problems; ``max_length`` cuts longer prompts in the middle."
    )
    return load


LOADERS = {"aime25": _loader("aime25"), "math500": _loader("math500")}


# --------------------------------------------------------------------------------------------
# The boxed answer


def last_boxed(text: str) -> str | None:
    """The content of ``text``'s last complete ``\\boxed{...}`` or ``\\fbox{...}`` (braces matched), or of a
    ``\\boxed 5`` (the word after it); None when there is none."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)", text))):
        rest = text[m.end() :]
        if rest.lstrip().startswith("{"):
            start = m.end() + rest.index("{")
            end = _closing(text, start)
            if end is not None:
                return text[start + 1 : end]
            continue  # cut off before its closing brace
        word = re.match(r"\s+([^\s$]+)", rest)
        if word:
            return word.group(1)
    return None


_UNITS = (
    r"(?:square\s+|sq\.?\s*|cubic\s+)?(?:units?|cm|centimeters?|mm|millimeters?|meters?|km|kilometers?|inches|"
    r"inch|feet|foot|ft|yards?|miles?|mph|degrees?|dollars?|cents?|seconds?|minutes?|hours?|days?|weeks?|"
    r"months?|years?|ways|pounds?|ounces?|liters?|gallons?)(?:\^\{?[23]\}?)?\.?"
)
_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textnormal|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")


def _closing(s: str, i: int) -> int | None:
    """The index of the brace that closes the ``{`` at ``s[i]``; None when ``s`` ends first."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return None


def _group(s: str, i: int) -> tuple[str, int]:
    """The argument of a command at ``s[i]``: a ``{...}`` group (without its braces) or one character; and the
    index after it."""
    if i < len(s) and s[i] == "{":
        j = _closing(s, i)
        return (s[i + 1 :], len(s)) if j is None else (s[i + 1 : j], j + 1)
    return s[i : i + 1], i + 1


def _fix_fracs(s: str) -> str:
    out, i = [], 0
    while True:
        k = s.find("\\frac", i)
        if k < 0:
            return "".join(out) + s[i:]
        num, j = _group(s, k + 5)
        den, j = _group(s, j)
        out.append(s[i:k] + "\\frac{" + _fix_fracs(num) + "}{" + _fix_fracs(den) + "}")
        i = j


def _number(match: re.Match) -> str:
    whole, frac = match.group(1), match.group(2).rstrip("0")
    return whole + ("." + frac if frac else "")


def normalize(answer: str) -> str:
    """``answer`` in a canonical form for comparing final answers (see the module docstring for each rule)."""
    s = str(answer).strip()
    s = s.replace("\n", " ").replace("\\!", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")
    s = re.sub(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])", "", s)
    s = s.replace("\\displaystyle", "").replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{\s+[^{}]*\}\s*$", "", s)  # "5\text{ cm}": a unit
    while _WRAPPERS.search(s):
        s = _WRAPPERS.sub(r"\1", s)
    s = re.sub(r"(?<=[\d}])\s*" + _UNITS + r"\s*$", "", s, flags=re.IGNORECASE)
    s = re.sub(r"\\[,;:> ]|\\q?quad|~", "", s)
    s = "".join(s.split())
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(?![{\[])(\w)", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    s = re.sub(r"(?<![\d.])(\d+)\.(\d*)(?![\d.])", _number, s)
    while len(s) > 1 and s[0] == "{" and _group(s, 0)[1] == len(s):
        s = s[1:-1]
    return re.sub(r"(?<!\.)\.$", "", s)  # a full stop after the answer


def _value(s: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m and int(m.group(3)) != 0:
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    if re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return Fraction(s)
    return None


def _latex_to_python(s: str) -> str | None:
    """A plain LaTeX expression as Python-syntax text for sympy, or None for anything else."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _group(s, i + 5)
            den, i = _group(s, i)
            num, den = _latex_to_python(num), _latex_to_python(den)
            if num is None or den is None:
                return None
            out.append(f"(({num})/({den}))")
        elif s.startswith("\\sqrt", i):
            root = None
            i += 5
            if i < len(s) and s[i] == "[":
                end = s.find("]", i)
                if end < 0:
                    return None
                root, i = _latex_to_python(s[i + 1 : end]), end + 1
            arg, i = _group(s, i)
            arg = _latex_to_python(arg)
            if arg is None:
                return None
            out.append(f"sqrt({arg})" if root is None else f"(({arg})**(1/({root})))")
        elif s.startswith("\\pi", i):
            out.append("pi")
            i += 3
        elif s.startswith(("\\cdot", "\\times"), i):
            out.append("*")
            i += 5 if s.startswith("\\cdot", i) else 6
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        elif s[i] == "^":
            out.append("**")
            i += 1
        elif s[i] == "\\":
            return None
        else:
            out.append(s[i])
            i += 1
    text = "".join(out)
    if not re.fullmatch(r"[0-9a-z+\-*/(). ]*", text) or re.search(r"\d{13,}|\*\*\(?\d{4,}", text):
        return None
    if any(len(w) > 1 and w not in ("sqrt", "pi") for w in re.findall(r"[a-z]+", text)):
        return None
    return text


def _sympy_equal(a: str, b: str) -> bool:
    if len(a) > 100 or len(b) > 100 or any(c in a + b for c in ",[]<>=|;:!"):
        return False
    pa, pb = _latex_to_python(a), _latex_to_python(b)
    if not pa or not pb:
        return False
    try:
        from sympy import simplify
        from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations
    except ImportError:
        return False
    rules = standard_transformations + (implicit_multiplication_application,)
    try:
        return simplify(parse_expr(pa, transformations=rules) - parse_expr(pb, transformations=rules)) == 0
    except Exception:  # anything sympy cannot read or compare: not equal
        return False


def math_equiv(answer: str, reference: str) -> bool:
    """Whether ``answer`` states ``reference``: equal after ``normalize``, or equal numbers, or (sympy importable)
    expressions whose difference simplifies to 0."""
    a, b = normalize(answer), normalize(reference)
    if a == b:
        return True
    va, vb = _value(a), _value(b)
    if va is not None and vb is not None:
        return va == vb
    return _sympy_equal(a, b)


def aime_integer(answers, output: str, meta: dict) -> float:
    """AIME: 1.0 if the output's last boxed answer is the reference's integer (0-999), else 0.0."""
    want = _integer(_io.expected(answers, "aime25_integer")[0])
    boxed = last_boxed(output)
    return float(boxed is not None and want is not None and _integer(boxed) == want)


def math_answer(answers, output: str, meta: dict) -> float:
    """MATH-500: 1.0 if the output's last boxed answer is equivalent (``math_equiv``) to a reference, else 0.0."""
    references = _io.expected(answers, "math500_equiv")
    boxed = last_boxed(output)
    return float(boxed is not None and any(math_equiv(boxed, r) for r in references))


METRICS = {"aime25_integer": aime_integer, "math500_equiv": math_answer}

__all__ = [
    "INSTRUCTION",
    "LOADERS",
    "MAX_NEW_TOKENS",
    "METRICS",
    "SUBSETS",
    "aime_integer",
    "last_boxed",
    "math_answer",
    "math_equiv",
    "normalize",
]
