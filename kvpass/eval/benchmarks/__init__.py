"""Published long-context benchmarks, read from their own files, with their published metrics.

    from kvpass.eval import benchmarks
    tasks = benchmarks.load("longbench", "data/longbench", tokenizer, subsets=["qasper"], limit=20)
    benchmarks.score(tasks[0], output_text)          # the benchmark's metric, in [0, 1]

One module per benchmark family; each has ``LOADERS`` (benchmark name -> ``load(path, tokenizer, *, subsets=None,
limit=None, max_length=None) -> list[Task]``), ``SUBSETS`` (benchmark name -> its subsets, in order) and ``METRICS``
(metric name -> ``fn(answers, output, meta) -> float`` in [0, 1]). ``path`` is a local file or folder in the
dataset's own format (``_io.records``), or a Hub id where ``datasets`` is installed. No loader downloads anything
unless given a Hub id; the tests read small fixture files in each dataset's format (``tests/data/benchmarks``).

Rows in kvpress's format (``context``, ``question``, ``answer_prefix``) get kvpress's prompt in every module
(``_io.kvpress_prompt``), and every prompt is cut to ``max_length`` by one rule (``_io.cut_middle``). What the
loaders share is in ``_io``; the text-scoring pieces several metrics share (normalisation, token F1, LCS, the
``rouge`` package's ROUGE) are in ``_text``.
"""

from __future__ import annotations

import importlib

from kvpass.eval.tasks._core import Task

MODULES = ("ruler", "longbench", "longbench_v2", "infinitebench", "loogle", "reasoning")


def _modules():
    return [importlib.import_module(f"kvpass.eval.benchmarks.{m}") for m in MODULES]


def loaders() -> dict:
    """Benchmark name -> its loader."""
    return {name: fn for mod in _modules() for name, fn in mod.LOADERS.items()}


def subsets(name: str) -> tuple[str, ...]:
    """The subsets of benchmark ``name`` in their published order."""
    for mod in _modules():
        if name in mod.SUBSETS:
            return tuple(mod.SUBSETS[name])
    raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(sorted(loaders()))}")


def metrics() -> dict:
    """Metric name -> ``fn(answers, output, meta)``, every benchmark's."""
    return {name: fn for mod in _modules() for name, fn in mod.METRICS.items()}


def load(
    name: str,
    path,
    tokenizer,
    *,
    subsets: list[str] | None = None,
    limit: int | None = None,
    max_length: int | None = None,
) -> list[Task]:
    """Tasks of benchmark ``name`` read from ``path`` (see the module docstring); ``limit`` rows per subset;
    ``max_length``: prompts longer than it are cut in the middle (``_io.cut_middle``)."""
    found = loaders()
    if name not in found:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(sorted(found))}")
    return found[name](path, tokenizer, subsets=subsets, limit=limit, max_length=max_length)


def score(task: Task, output: str) -> float:
    """``task``'s metric on ``output``, in [0, 1]."""
    return metrics()[task.metric](task.answers, output, task.meta)


__all__ = ["MODULES", "load", "loaders", "metrics", "score", "subsets"]
