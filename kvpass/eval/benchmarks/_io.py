"""What the benchmark loaders share, each written once: reading a dataset, building and cutting a prompt, the Task.

Reading
    * ``records(path, subset)``: a dataset's rows as dicts, from a ``.jsonl`` / ``.json`` file, a folder of them (one
      file per subset, ``<subset>.jsonl``), a ``.parquet`` file (``pandas``), or a Hugging Face Hub id where
      ``datasets`` is installed and the machine reaches the Hub. Nothing here downloads unless given a Hub id.
    * ``read_rows``, ``data_file``, ``data_files``, ``hub_id``, ``named`` / ``folders_up``: a file's first rows, the
      file of a subset, the data files under a folder, a path that names a Hub dataset, the task a file's name or
      folders name.
    * ``rows_by_subset``: subset -> rows for the benchmarks laid out as one file per subset (LongBench, LooGLE).
    * ``OfficialConfig``: a benchmark's own template / generation-length files found beside its data.
Checking
    * ``wanted`` (the subsets asked for), ``row_format`` / ``official_or_kvpress`` (which of a benchmark's formats a
      row is in), ``row_task`` (the task a row is of), ``need`` (the fields that format needs), ``check_found``
      (every subset asked for has rows), ``answers_of`` / ``as_list`` / ``expected`` (a row's or a metric's
      answers). Each error names the file, the field, the known values and the fix.
Prompts
    * ``kvpress_prompt`` / ``kvpress_ids``: the prompt kvpress's pipeline builds for a row in kvpress's format
      (``context``, ``question``, ``answer_prefix``), with or without the tokenizer's chat template; ``tokenized``
      takes either such a row or a prompt text.
    * ``cut_middle(ids, max_length)``: the one cutting rule: a prompt longer than ``max_length`` keeps its first and
      last halves (instructions and questions sit at the ends), as LongBench and InfiniteBench cut theirs.
      ``prompt_ids(tokenizer, text, max_length)`` tokenizes a text and cuts it by that rule.
    * ``task(...)``: a ``kvpass.eval.tasks.Task`` whose ``meta`` records the benchmark, subset, row id and whether the
      prompt was cut.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvpass.eval.tasks._core import Task

SUFFIXES = (".jsonl", ".json", ".parquet")


# --------------------------------------------------------------------------------------------
# Reading


def records(path: str | Path, subset: str | None = None, split: str = "test") -> list[dict]:
    """Rows of ``subset`` (None: the one file ``path`` names) from a local file or folder, else a Hub dataset id
    (``datasets.load_dataset(path, subset, split=split)``)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if subset is None:
            raise ValueError(f"{p} is a folder: name the subset to read from it")
        found = data_file(p, subset)
        if found is None:
            raise FileNotFoundError(f"no {subset}.jsonl, .json or .parquet in {p}")
        p = found
    if p.is_file():
        return _read(p)
    if p.exists() or str(path).startswith((".", "/", "~")):
        raise FileNotFoundError(f"{path}: no such file or folder")
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(
            f"{path}: not a local file or folder, and reading it from the Hugging Face Hub needs "
            f"the optional 'datasets' package (pip install datasets)"
        ) from None
    return [dict(r) for r in datasets.load_dataset(str(path), subset, split=split)]


def read_rows(file: Path, limit: int | None = None) -> list[dict]:
    """``file``'s rows (as ``records`` reads them); a ``.jsonl`` is read only as far as its first ``limit`` rows."""
    return _read(file, limit)


def _read(p: Path, limit: int | None = None) -> list[dict]:
    if p.suffix == ".jsonl":
        rows = []
        with p.open(encoding="utf-8") as fh:
            for line in fh:
                if limit is not None and len(rows) >= limit:
                    break
                if line.strip():
                    rows.append(json.loads(line))
        return rows
    if p.suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        return data if isinstance(data, list) else data.get("data", [data])
    if p.suffix == ".parquet":
        try:
            import pandas
        except ImportError:
            raise ImportError(
                f"{p}: reading .parquet files needs pandas (pip install 'kvpass[benchmarks]'), or "
                f"convert the file to .jsonl"
            ) from None
        return pandas.read_parquet(p).to_dict("records")
    raise ValueError(f"{p}: read .jsonl, .json or .parquet files")


def data_file(folder: Path, stem: str) -> Path | None:
    """The first of ``stem`` + .jsonl / .json / .parquet in ``folder`` (the file ``records(folder, stem)`` reads),
    else None."""
    return next((folder / f"{stem}{s}" for s in SUFFIXES if (folder / f"{stem}{s}").is_file()), None)


def data_files(path, *, empty_ok: bool = False) -> list[Path]:
    """The data files (``.jsonl``, ``.json``, ``.parquet``) under the local ``path``, recursively, hidden ones left
    out, in path order; ``path`` itself when it is a file. FileNotFoundError when ``path`` does not exist, or
    (unless ``empty_ok``) holds no data file."""
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if root.is_file():
        return [root]
    files = sorted(
        f
        for f in root.rglob("*")
        if f.is_file() and f.suffix in SUFFIXES and not any(part.startswith(".") for part in f.relative_to(root).parts)
    )
    if not files and not empty_ok:
        raise FileNotFoundError(f"{path}: no .jsonl, .json or .parquet file in it")
    return files


def hub_id(path) -> tuple[str, str | None] | None:
    """``(repo, config)`` when ``path`` names a Hugging Face dataset rather than a local path: ``owner/name``,
    ``owner/name/config`` or ``owner/name:config``; None for a local path (existing or not)."""
    text = str(path)
    if Path(text).expanduser().exists() or text.startswith((".", "/", "~")):
        return None
    m = re.fullmatch(r"([\w.-]+/[\w.-]+)(?:[/:]([\w.-]+))?", text)
    return (m.group(1), m.group(2)) if m else None


def folders_up(file: Path, root: Path, depth: int = 3) -> list[str]:
    """The names of ``file``'s folders, nearest first: those up to ``root``, or ``depth`` of them when ``file`` is
    ``root``."""
    if file == root:
        return [p.name for p in list(file.parents)[:depth]]
    return [p.name for p in file.parents if p == root or root in p.parents]


def named(file: Path, root: Path, names, depth: int = 3) -> str | None:
    """The nearest of ``file``'s stem and folders (``folders_up``) that is one of ``names``."""
    return next((part for part in [file.stem, *folders_up(file, root, depth)] if part in names), None)


def rows_by_subset(
    path,
    names: list[str],
    known: tuple[str, ...],
    what: str,
    *,
    suffix: str = "",
    fields: tuple[str, ...] = ("task",),
    grouped: tuple[str, ...] | None = None,
    rename=None,
    inner: tuple[str, ...] = (),
    fix: str = "",
) -> dict[str, tuple[list[dict], str]]:
    """subset -> (rows, where they came from) for the subsets ``names`` of a benchmark laid out one file per subset.

    * ``path`` a file: its rows grouped by the first of ``fields`` they have, else the file's name, ``rename(name)``
      applied when given; a group that is not one of ``grouped`` (default ``known``) is an error.
    * ``path`` a folder: ``<subset><suffix>.jsonl`` / ``.json`` / ``.parquet`` from it, or from the first of its
      subfolders ``inner`` that holds any of them (else any subset of ``known``); a missing one is an error listing
      the subsets of ``known`` present there, then ``fix``.
    * otherwise a Hub id, config ``<subset><suffix>``.
    """
    p = Path(path).expanduser()
    if p.is_file():
        groups: dict[str, list[dict]] = {}
        for row in records(p):
            name = str(next((row[f] for f in fields if row.get(f)), None) or p.stem)
            groups.setdefault(rename(name) if rename else name, []).append(row)
        allowed = known if grouped is None else grouped
        unknown = [g for g in groups if g not in allowed]
        if unknown:
            raise ValueError(
                f"{p}: rows of unknown {what} subset {unknown[0]!r} (from their "
                f"{' / '.join(map(repr, fields))} field or the file name); known: {', '.join(allowed)}. "
                f"Name the file <subset>.jsonl or set each row's {fields[0]!r} field"
            )
        return {n: (groups.get(n, []), str(p)) for n in names}
    if not p.is_dir():
        return {n: (records(path, n + suffix), f"{path}:{n}{suffix}") for n in names}
    folders = (p, *(p / i for i in inner))
    folder = next(
        (f for f in folders if any(data_file(f, n + suffix) for n in names)),
        next((f for f in folders if any(data_file(f, k + suffix) for k in known)), p),
    )
    out = {}
    for n in names:
        try:
            out[n] = (records(folder, n + suffix), str(data_file(folder, n + suffix)))
        except FileNotFoundError as e:
            present = [k for k in known if data_file(folder, k + suffix)]
            raise FileNotFoundError(
                f"{e} ({what} subset {n!r}); subsets present there: {', '.join(present) or 'none'}"
                f". Pass subsets=[...] to read only those{fix}"
            ) from None
    return out


def config_file(path, *names: str, folder: str = "config") -> Path | None:
    """The first of ``names`` found in ``path``, ``path/<folder>``, the parent folder or its ``<folder>/`` (``path``
    a folder or a file), else None."""
    p = Path(path).expanduser()
    if not p.exists():
        return None
    base = p if p.is_dir() else p.parent
    for where in (base, base / folder, base.parent, base.parent / folder):
        for name in names:
            if (where / name).is_file():
                return where / name
    return None


@dataclass
class OfficialConfig:
    """A benchmark's own prompt templates (``{subset: str.format template}``) and generation lengths (``{subset:
    tokens}``), read from the JSON files found beside its data (``config_file``); each None when absent."""

    prompts: dict | None
    prompts_file: Path | None
    maxlen: dict | None

    @classmethod
    def find(cls, path, prompts_name: str, maxlen_name: str) -> OfficialConfig:
        """The files ``prompts_name`` and ``maxlen_name`` beside ``path``, read when found."""
        prompts_file, maxlen_file = config_file(path, prompts_name), config_file(path, maxlen_name)
        prompts = json.loads(prompts_file.read_text(encoding="utf-8")) if prompts_file else None
        maxlen = json.loads(maxlen_file.read_text(encoding="utf-8")) if maxlen_file else None
        return cls(prompts, prompts_file, maxlen)

    def template(self, subset: str, builtin: dict) -> tuple[str, str]:
        """``(template, kind)``: ``subset``'s template from the official file when there is one (a ValueError naming
        the file when it lacks the subset: no silent fallback), kind ``"official (<file>)"``; else ``builtin``'s,
        kind ``"builtin"``."""
        if self.prompts is None:
            return builtin[subset], "builtin"
        if subset not in self.prompts:
            raise ValueError(
                f"{self.prompts_file}: no template for subset {subset!r}; it has "
                f"{', '.join(self.prompts)}. Add it, or remove the file to use kvpass's own"
            )
        return self.prompts[subset], f"official ({self.prompts_file})"

    def max_new_tokens(self, subset: str, default: dict) -> int:
        """``subset``'s generation length from the official file when it has one, else ``default[subset]``."""
        return int(self.maxlen[subset]) if self.maxlen is not None and subset in self.maxlen else default[subset]


def fill_template(template: str, fields: dict, what: str) -> str:
    """``template.format(**fields)``; a ValueError starting with ``what`` when a named field is missing or the
    template's braces are malformed."""
    try:
        return template.format(**fields)
    except KeyError as e:
        raise ValueError(
            f"{what} names field {e.args[0]!r}, which the row lacks; it has {', '.join(sorted(fields))}"
        ) from None
    except (IndexError, ValueError) as e:
        raise ValueError(f"{what} is not a str.format template over the row's fields: {e}") from None


# --------------------------------------------------------------------------------------------
# Checking


def wanted(
    subsets, known: tuple[str, ...], what: str, aliases: dict | None = None, keep_order: bool = False
) -> list[str]:
    """``subsets`` checked against ``known`` (None: all of ``known``), each once, in ``known``'s order (``keep_order``:
    in the order given); ``aliases`` maps other accepted names (or their lower case) to known ones."""
    if subsets is None:
        return list(known)
    if isinstance(subsets, str):
        subsets = [subsets]
    aliases = aliases or {}
    chosen: list[str] = []
    for s in subsets:
        name = aliases.get(s, aliases.get(str(s).lower(), s))
        if name not in known:
            alias_note = f" (or {', '.join(sorted(aliases))})" if aliases else ""
            raise ValueError(
                f"unknown {what} subset {s!r}; known: {', '.join(known)}{alias_note}. Pass subsets from "
                f"that list (or None for all)"
            )
        if name not in chosen:
            chosen.append(name)
    return chosen if keep_order else [k for k in known if k in chosen]


def row_format(row: dict, source: str, formats: dict[str, tuple[str, ...]], what: str, fix: str) -> str:
    """The first format of ``formats`` (name -> the fields that mark a row as in it; ``()`` marks every row) whose
    fields ``row`` has; a ValueError naming ``source``, the row's fields, ``what`` and ``fix`` when none."""
    keys = set(row)
    for name, marks in formats.items():
        if set(marks) <= keys:
            return name
    raise ValueError(
        f"{source}: rows with fields {', '.join(sorted(map(str, keys)))} are in no {what} format kvpass reads. {fix}"
    )


def official_or_kvpress(row: dict, source: str, what: str, official: tuple[str, ...], kvpress: tuple[str, ...]) -> str:
    """ "kvpress" when ``row`` has kvpress's ``answer_prefix`` column, else "official" (the benchmark's own rows);
    a ValueError (``need``) naming ``source``, the missing field and both formats' fields when the row lacks one
    that its format needs."""
    fmt, fields = ("kvpress", kvpress) if "answer_prefix" in row else ("official", official)
    need(
        row,
        fields,
        source,
        f"{fmt} {what}",
        f"{what}'s own rows have {', '.join(official)}; kvpress's have "
        f"{', '.join(kvpress)}. Fix the file, or pass the dataset's own files",
    )
    return fmt


def check_found(path, what: str, asked, names, found, present) -> None:
    """The end of a loader's search: a ValueError naming ``path`` when a subset of ``names`` that the caller
    ``asked`` for is not in ``found`` (listing those ``present``), or when nothing was found."""
    if asked is not None:
        missing = [n for n in names if n not in found]
        if missing:
            raise ValueError(
                f"{path}: no rows for {what} task(s) {', '.join(missing)}; tasks found: {', '.join(present) or 'none'}"
            )
    if not found:
        raise ValueError(f"{path}: no {what} rows found")


def row_task(row: dict, task: str | None, source: str, what: str, known, hint: str, aliases: dict | None = None) -> str:
    """The task a row belongs to: its ``task`` field (through ``aliases``), else ``task`` (what its file's name or
    folders say); a ValueError naming ``source`` when neither says (then ``hint``), or when the task is not one of
    ``known``."""
    name = row.get("task", task)
    if name is None:
        raise ValueError(f"{source}: its rows have no 'task' field and {hint}")
    name = (aliases or {}).get(name, name)
    if name not in known:
        raise ValueError(f"{source}: unknown {what} task {name!r}; known: {', '.join(known)}")
    return name


def need(row: dict, fields, source: str, what: str, fix: str) -> None:
    """Raise a ValueError naming ``source``, the first of ``fields`` that ``row`` lacks, the fields the ``what``
    format needs, the fields the row has and ``fix``."""
    for f in fields:
        if f not in row:
            raise ValueError(
                f"{source}: a row has no field {f!r}, which the {what} format needs "
                f"({', '.join(fields)}); its fields: {', '.join(sorted(map(str, row)))}. {fix}"
            )


def as_list(value) -> list:
    """A row's list field as a list, items kept as they are: None gives [], a string or a number one item, a list,
    tuple or array (parquet) its items."""
    if value is None:
        return []
    if isinstance(value, (str, int, float)):
        return [value]
    return list(value)


def answers_of(value) -> list[str]:
    """A row's expected answers as strings (``as_list``'s items, each ``str``)."""
    return [str(v) for v in as_list(value)]


def expected(answers, what: str) -> list[str]:
    """A metric's expected answers as strings; a ValueError saying that ``what`` needs one when there is none."""
    answers = answers_of(answers)
    if not answers:
        raise ValueError(f"{what} needs at least one expected answer")
    return answers


# --------------------------------------------------------------------------------------------
# Prompts


def encode(tokenizer, text: str) -> list[int]:
    """``text``'s ids without special tokens."""
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def has_chat(tokenizer) -> bool:
    """Whether ``tokenizer`` has a chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def kvpress_prompt(
    tokenizer, context: str, question: str, answer_prefix: str = "", enable_thinking: bool = False
) -> tuple[list[int], int]:
    """``(ids, context_tokens)``: the prompt kvpress's pipeline (``KVPressTextGenerationPipeline.preprocess``) feeds
    for one row, context ids then question ids, each tokenized without special tokens; ``context_tokens`` is how
    many of the ids kvpress compresses.

    With a chat template: ``context + question`` is one user turn followed by the generation prompt
    (``enable_thinking`` passed to the template, False as in kvpress's evaluation); the turn is cut where the
    context ends, the generation prompt goes after the question, then ``answer_prefix``. Without one:
    ``bos_token + context``, then ``question + "\\n" + answer_prefix``.
    """
    if not has_chat(tokenizer):
        bos = getattr(tokenizer, "bos_token", None)
        if isinstance(bos, str) and bos:
            context_ids = encode(tokenizer, bos + context)
        else:  # no BOS text: its id, if the tokenizer has one
            bos_id = getattr(tokenizer, "bos_token_id", None)
            context_ids = ([bos_id] if bos_id is not None else []) + encode(tokenizer, context)
        suffix = "\n"
    else:
        mark, n = "<<kvpass-question>>", 0
        while mark in context:  # a marker the context does not hold
            n += 1
            mark = f"<<kvpass-question-{n}>>"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + mark}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=enable_thinking,
        )
        parts = text.split(mark)
        if len(parts) != 2:
            raise ValueError(
                f"the chat template did not keep the user turn's text as given (marker {mark!r} found "
                f"{len(parts) - 1} times): kvpress's prompt cannot be built with it"
            )
        context_ids = encode(tokenizer, parts[0])
        suffix = parts[1]
    return context_ids + encode(tokenizer, question + suffix + answer_prefix), len(context_ids)


def cut_middle(ids: list[int], max_length: int | None) -> tuple[list[int], bool]:
    """``(ids, cut)``: prompt ids cut in the middle to ``max_length`` when longer (the first ``max_length // 2`` and
    the last ``max_length - max_length // 2`` kept), the rule every loader's ``max_length`` applies."""
    ids = list(ids)
    if max_length is None or len(ids) <= max_length:
        return ids, False
    half = max_length // 2
    return ids[:half] + ids[len(ids) - (max_length - half) :], True


def prompt_ids(tokenizer, text: str, max_length: int | None = None) -> tuple[list[int], bool]:
    """``(ids, cut)``: ``text`` tokenized (the tokenizer's special tokens included, as a chat or a BOS needs), cut by
    ``cut_middle``."""
    return cut_middle(tokenizer(text).input_ids, max_length)


def kvpress_ids(tokenizer, row: dict, max_length: int | None) -> tuple[list[int], bool, dict]:
    """``(ids, cut, meta)`` for a row in kvpress's format: ``kvpress_prompt`` over its ``context``, ``question`` and
    ``answer_prefix``, cut by ``cut_middle``; ``meta`` holds ``context_tokens`` (before any cut) and ``chat``."""
    ids, context_tokens = kvpress_prompt(tokenizer, row["context"], row["question"], row["answer_prefix"] or "")
    ids, cut = cut_middle(ids, max_length)
    return ids, cut, {"context_tokens": context_tokens, "chat": has_chat(tokenizer)}


def tokenized(tokenizer, prompt: str | dict, max_length: int | None) -> tuple[list[int], bool, dict]:
    """``(ids, cut, meta)`` for ``prompt``: a row in kvpress's format (a dict: ``kvpress_ids``), or a prompt text
    (``prompt_ids``; ``meta`` empty)."""
    if isinstance(prompt, dict):
        return kvpress_ids(tokenizer, prompt, max_length)
    ids, cut = prompt_ids(tokenizer, prompt, max_length)
    return ids, cut, {}


def task(
    benchmark: str,
    subset: str,
    row_id,
    ids: list[int],
    answers: list[str],
    metric: str,
    max_new_tokens: int,
    cut: bool = False,
    **meta,
) -> Task:
    """A ``Task`` named ``<benchmark>/<subset>``; ``meta`` keeps ``length``, ``id``, ``cut`` and the rest given."""
    return Task(
        family=benchmark,
        name=f"{benchmark}/{subset}",
        input_ids=ids,
        answers=[str(a) for a in answers],
        metric=metric,
        max_new_tokens=max_new_tokens,
        meta={"length": len(ids), "id": row_id, "cut": cut, "benchmark": benchmark, "subset": subset, **meta},
    )
