"""Scorers: how well a generated text matches a task's expected answers, in [0, 1].

Matching is tolerant of case and whitespace: both sides are lower-cased and runs of whitespace
become one space. An answer only counts where it is not glued to a letter or digit on either side,
so "7" is not found in "17", "-7", "7.5" or "7,000", and "42" not in "4213", but "71432." and
"(71432)" match "71432". Every scorer takes ``(answers, output_text)``.

- ``contains``:     1.0 if every answer appears, else 0.0 (RULER's string_match_all, all-or-nothing)
- ``contains_any``: 1.0 if at least one answer appears
- ``recall``:       the fraction of answers that appear (RULER's string_match_all, partial credit)
- ``agreement``:    greedy-token agreement with the full-cache generation; needs the reference
                    generation and the model, so the harness computes it. Calling it raises.
"""

from __future__ import annotations

import re


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def found(answer: str, output: str) -> bool:
    """Whether ``answer`` occurs in ``output`` (case/whitespace-insensitive, not inside a longer word/number)."""
    a = normalize(answer)
    if not a:
        raise ValueError("empty expected answer")
    before = r"(?<![0-9a-z])" + (r"(?<![-.])" if a[0].isdigit() else "")  # "3" is not found in "-3" or "0.3"
    after = r"(?![0-9a-z])" + (r"(?![.,]\d)" if a[-1].isdigit() else "")  # nor in "3.5" or "3,000"
    pattern = before + re.escape(a) + after
    return re.search(pattern, normalize(output)) is not None


def _need(answers) -> list[str]:
    if isinstance(answers, str):
        answers = [answers]
    answers = list(answers)
    if not answers:
        raise ValueError("this metric needs at least one expected answer")
    return answers


def contains(answers, output: str) -> float:
    return float(all(found(a, output) for a in _need(answers)))


def contains_any(answers, output: str) -> float:
    return float(any(found(a, output) for a in _need(answers)))


def recall(answers, output: str) -> float:
    answers = _need(answers)
    return sum(found(a, output) for a in answers) / len(answers)


def agreement(answers, output: str) -> float:
    raise ValueError(
        "metric 'agreement' is computed by the harness: compare the policy's greedy tokens "
        "with the full-cache greedy tokens (and the perplexity of that reference continuation); "
        "score() cannot compute it from text"
    )


SCORERS = {"contains": contains, "contains_any": contains_any, "recall": recall, "agreement": agreement}


def cut_at_stop(output: str, stop) -> str:
    """``output`` up to the first occurrence of any stop string (if any)."""
    for s in stop or ():
        k = output.find(s)
        if k >= 0:
            output = output[:k]
    return output


def score(task, output_text: str) -> float:
    """Score one generation for ``task`` with ``SCORERS[task.metric]`` (or a published benchmark's metric,
    ``kvpass.eval.benchmarks.metrics()``), in [0, 1].

    If ``task.meta["stop"]`` lists stop strings, the output is first cut at the earliest one (the
    few-shot arithmetic tasks stop at a newline, so a model that goes on to invent the next
    question is not credited for numbers in it).
    """
    if task.metric not in SCORERS:  # a published benchmark's metric (kvpass.eval.benchmarks)
        from kvpass.eval import benchmarks

        published = benchmarks.metrics()
        if task.metric not in published:
            raise ValueError(f"unknown metric {task.metric!r}; known: {sorted(SCORERS) + sorted(published)}")
        return published[task.metric](task.answers, output_text, task.meta)
    if task.metric == "agreement":
        agreement(task.answers, output_text)
    return SCORERS[task.metric](task.answers, cut_at_stop(output_text, task.meta.get("stop")))
