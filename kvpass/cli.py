"""The ``kvpass`` command.

kvpass compare --model smollm2-135m --policies full,streamingllm --budget 256 --task niah --lengths 1k,2k
kvpass eval    --model smollm2-135m --policy streamingllm --budget 128 --task niah --lengths 1k,2k,4k
kvpass compare --model smollm2-135m --policies full,snapkv --budget 1024 --task longbench --data PATH
kvpass leaderboard RESULTS_FOLDER [RESULTS_FOLDER ...] --out FOLDER
kvpass explain --model smollm2-135m [--policy streamingllm --budget 128]
kvpass models
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, NoReturn

# torch, transformers and the policy registry (which imports torch) are imported inside the functions that
# need them: `kvpass --help`, `kvpass models` and a mistyped command line answer in well under a second.


def parse_length(text: str) -> int:
    """``512`` -> 512, ``1k`` -> 1024, ``1.5k`` -> 1536; a positive number of tokens."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length is like 512, 1k or 4k; got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"a length is a positive number of tokens; got {text!r}")
    return n


def positive_int(text: str) -> int:
    """An integer >= 1 (budgets, limits, token counts)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def parse_depths(text: str) -> list[float]:
    """``0,0.5,1`` -> [0.0, 0.5, 1.0]; each depth in [0, 1] (0: the needle first, 1: just before the question)."""
    try:
        depths = [float(x) for x in parse_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths are numbers in [0, 1] like 0,0.5,1; got {text!r}") from None
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad or not depths:
        raise argparse.ArgumentTypeError(
            f"each depth must be in [0, 1] (0: start of the text, 1: its end); got {text!r}"
        )
    return depths


def did_you_mean(name: str, choices) -> str:
    """ " (did you mean 'x'?)" for the closest of ``choices`` to a mistyped ``name``, else ""."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_params(items: list[str]) -> dict:
    """``--param key=value`` -> {key: int | float | bool | str}."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"kvpass: --param expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        for conv in (int, float):
            try:
                out[k] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


LENGTHS_HELP = (
    "prompt lengths in tokens, comma-separated: a number of tokens or a number with k "
    "(1k = 1024 tokens), e.g. 512,1k,2k (default 1k,2k)"
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose texts that need the policy registry (and so torch) are filled in by
    ``lazy_help`` only when this parser's own help is printed: `kvpass --help` stays fast."""

    lazy_help: Callable[[argparse.ArgumentParser], None] | None = None

    def format_help(self) -> str:
        fill, self.lazy_help = self.lazy_help, None
        if fill is not None:
            fill(self)
        return super().format_help()


POLICY_NAMES = "<policy names>"  # in a help text, replaced by the registry's names when the help is printed


def _fill_policy_help(parser: argparse.ArgumentParser) -> None:
    """The policy names and one line per policy in a command's help; the device a run would take here."""
    names = _policy_names()
    parser.epilog = _policies_epilog()
    for action in parser._actions:
        if action.help and POLICY_NAMES in action.help:
            action.help = action.help.replace(POLICY_NAMES, names)
        if action.dest == "device":
            action.help = action.help.rstrip(")") + f"; here {_default_device()})"


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions as argparse does, but keeps a text with its own line breaks (the list of
    policies) line for line, and wraps option help without breaking words at hyphens."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _split_lines(self, text, width):  # never break kvpass-results/... at its hyphen
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _policy_names() -> str:
    """The policy names, read from the registry at runtime."""
    try:
        from kvpass.policies import available

        return ", ".join(available())
    except Exception:  # noqa: BLE001  (the help must print even if a policy module is broken)
        return "see kvpass.policies.available()"


def _policies_epilog() -> str:
    """One line per policy for ``--help``: its name, what it does, its parameters and their defaults."""
    try:
        from kvpass.policies import POLICIES, available

        lines = ["policies (combine two with '+', e.g. snapkv+art; set parameters with --budget / --param):"]
        for name in available():
            cls = POLICIES[name]
            params = ", ".join(
                f"{p.name}={p.default!r}" if isinstance(p.default, str) else f"{p.name}={p.default}"
                for p in cls.params
                if p.name != "tokenizer"
            )
            lines.append(f"  {name:13s} {cls.summary}" + (f" [{params}]" if params else ""))
        return "\n".join(lines)
    except Exception:  # noqa: BLE001
        return ""


def _task_names() -> str:
    try:
        from kvpass.eval import tasks as T

        return ", ".join(sorted(T.FAMILIES))
    except Exception:  # noqa: BLE001
        return "niah, ruler, long_decode, chunk_qa"


def _benchmark_names() -> str:
    try:
        from kvpass.eval import benchmarks  # no torch: the loaders import it only when they tokenize

        return ", ".join(sorted(benchmarks.loaders()))
    except Exception:  # noqa: BLE001
        return "the benchmarks of kvpass.eval.benchmarks"


def parse_data(values: list[str]) -> dict[str, str]:
    """``--data`` values: ``PATH`` (every benchmark of ``--task``) or ``NAME=PATH`` -> {name or "": path}."""
    out = {}
    for v in values:
        name, eq, path = v.partition("=")
        out[name.strip() if eq else ""] = (path if eq else v).strip()
    return out


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _common(p: argparse.ArgumentParser) -> None:
    from kvpass.eval import models

    p.add_argument(
        "--model",
        default="smollm2-135m",
        help=f"a registry model ({', '.join(models.available())}; see `kvpass models`), a local "
        f"Hugging Face folder, a local .gguf file or a Hugging Face Hub id (default smollm2-135m)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="torch device the model runs on: cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="KV entries kept per layer and KV head, for the policies that take a budget (each policy's own "
        "default otherwise; policies without one, full and art, ignore it and the table "
        "says so)",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other policy parameter, e.g. --param sinks=4 (repeat for several; the "
        "parameters of each policy are listed below)",
    )
    p.add_argument(
        "--task",
        type=parse_list,
        default=["niah"],
        metavar="T[,T...]",
        help=f"task families, comma-separated: {_task_names()} (default niah), generated at --lengths; "
        f"or published benchmarks read from --data: {_benchmark_names()}",
    )
    p.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="where a benchmark of --task is: its own files (a folder or a .jsonl/.json/.parquet file), "
        "or a Hugging Face Hub id when the 'datasets' package is installed; NAME=PATH for one "
        "benchmark of several (repeat). With --data, --task ruler reads RULER's own data",
    )
    p.add_argument(
        "--subsets",
        type=parse_list,
        default=None,
        metavar="S[,S...]",
        help="benchmark subsets to run, e.g. qasper,hotpotqa or longbench/qasper (a bare name applies to "
        "each benchmark that has it; default: all of each)",
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        metavar="N",
        help="benchmark prompts longer than N tokens are cut in the middle, as LongBench cuts them (default: none)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the (policy, task) pairs already done in --out (its progress.jsonl), e.g. after an interrupted run",
    )
    p.add_argument(
        "--lengths",
        type=lambda s: [parse_length(x) for x in parse_list(s)],
        default=[1024, 2048],
        metavar="N[,N...]",
        help=LENGTHS_HELP,
    )
    p.add_argument(
        "--depths",
        type=parse_depths,
        default=None,
        metavar="D[,D...]",
        help="NIAH needle depths in [0, 1], comma-separated (default 0,0.25,0.5,0.75,1)",
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="at most this many tasks per family and length (default: all)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="override every task's generation length (default: each task's own)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks (default 0)")
    p.add_argument(
        "--compiler",
        default=None,
        choices=["inductor", "aot_eager", "eager"],
        help="what compiles the rewritten graph (default: inductor on CUDA, eager on CPU)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="folder the results go to: results.json, results.csv and NIAH heatmap PNGs "
        "(default: a new folder kvpass-results/<YYYYmmdd-HHMMSS> in the current directory)",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="kvpass",
        description="Compare KV-cache policies on real models.",
        epilog="Run `kvpass COMMAND --help` for the options of each command.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    names, epilog = POLICY_NAMES, None  # filled in by _fill_policy_help when a command's help is printed
    fmt = _HelpFormatter  # keeps the epilog's one line per policy
    c = sub.add_parser(
        "compare",
        help="run several policies on the same tasks, one table",
        description="Run several policies on the same tasks and print one table; the results are written to --out.",
        epilog=epilog,
        formatter_class=fmt,
    )
    c.add_argument(
        "--policies",
        type=parse_list,
        default=["full", "streamingllm"],
        metavar="P[,P...]",
        help=f"policies to compare, comma-separated (default full,streamingllm); one of: {names}",
    )
    _run_args(c)
    c.lazy_help = _fill_policy_help
    e = sub.add_parser(
        "eval",
        help="run one policy",
        description="Run one policy on the tasks; the results are written to --out.",
        epilog=epilog,
        formatter_class=fmt,
    )
    e.add_argument("--policy", default="full", help=f"the policy to run (default full); one of: {names}")
    _run_args(e)
    e.lazy_help = _fill_policy_help
    x = sub.add_parser(
        "explain",
        help="per-layer detection table of a model",
        description="Trace the model once on a short prompt and print what kvpass finds "
        "at each attention layer and what the policy would do there.",
        epilog=epilog,
        formatter_class=fmt,
    )
    _common(x)
    x.add_argument("--policy", default="full", help=f"the policy whose plan is shown (default full); one of: {names}")
    x.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="KV entries kept per layer and KV head, for the policies that take a budget (an error for "
        "policies without one, such as full)",
    )
    x.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other policy parameter, e.g. --param sinks=4 (repeat for several)",
    )
    x.add_argument(
        "--tp",
        action="store_true",
        help="split the model with transformers' tensor-parallel plan (tp_plan='auto'); run under "
        "torchrun, e.g. torchrun --nproc_per_node 2 -m kvpass.cli explain --tp ...: each rank "
        "prints its local heads and the collectives kvpass inserted",
    )
    x.lazy_help = _fill_policy_help
    lb = sub.add_parser(
        "leaderboard",
        help="methods x compression ratios from compare results, per benchmark",
        description="Read the results folders of `kvpass compare` runs (one per budget) and write "
        "leaderboard.md (per benchmark: policies x measured compression ratios, scores "
        "x100), leaderboard.csv and leaderboard.png (score against compression ratio).",
    )
    lb.add_argument("folders", nargs="+", type=Path, metavar="FOLDER", help="results folders of kvpass compare")
    lb.add_argument(
        "--out",
        type=Path,
        default=Path("."),
        metavar="FOLDER",
        help="where the leaderboard files go (default: the current folder)",
    )
    sub.add_parser(
        "models",
        help="list the registry models: installed? converted? where?",
        description="List the registry models, whether each one's pip package is installed and "
        "whether it has been converted into the kvpass cache folder.",
    )
    return ap


def print_models() -> None:
    """``kvpass models``: one row per registry model (installed, converted, cache folder; the install
    command only where the package is missing), then what each model is."""
    from kvpass.eval import models

    rows = models.status()
    table = [["model", "installed", "converted", "cache folder"]]
    for r in rows:
        table.append([r.name, "yes" if r.installed else "no", "yes" if r.converted else "no", str(r.folder)])
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    for i, t in enumerate(table):
        line = "  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[3]
        if i and not rows[i - 1].installed:
            line += f"  (install: {rows[i - 1].install_cmd})"
        print(line.rstrip())
    print()
    for r in rows:
        print(f"{r.name}: {r.description}")
    print(
        f"converted: the model's GGUF has been dequantized into its cache folder (under {models.cache_dir()};\n"
        f"  $KVPASS_CACHE moves it). An installed model is converted once on first use (about 20 s on 2 cores),\n"
        f"  e.g. by `kvpass eval --model NAME`; later loads read the folder in about a second."
    )


def _dtype(args):
    import torch

    name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return getattr(torch, name)


def _usage_error(msg: str) -> NoReturn:
    """A bad command line found by kvpass rather than argparse: said on stderr, exit status 2 (as argparse)."""
    print(f"kvpass: error: {msg.removeprefix('kvpass: ')}", file=sys.stderr)
    raise SystemExit(2)


def _note(msg: str) -> None:
    print(f"kvpass: note: {msg}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# what is checked before the model loads
# ------------------------------------------------------------------------------------------------


class _StandInTokenizer:
    """The model's tokenizer while the policies are checked before the model loads (kvzip's repeat prompts)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0]


def check_policies(
    specs: list[str], params: dict, *, param_keys=(), compiler: str = "eager", flag: str = "--policies"
) -> None:
    """Every policy name and ``--param`` checked before any model loads, as the run will check them.

    Each spec is built with ``kvpass.backend`` on the parameters ``Runner.compile`` gives it (the
    subset of ``params`` it declares), so a bad value fails here with the library's own ``ConfigError``
    message. A key of ``param_keys`` (those given with ``--param``) that none of the policies declares is
    an error too: the run would silently drop it. Errors exit with status 2; a mistyped name gets "did you
    mean".
    """
    import kvpass
    from kvpass.eval.runner import policy_params
    from kvpass.policies import POLICIES, ConfigError, available

    if not specs:
        _usage_error(
            f"{flag}: no policy given; pass at least one, e.g. {flag} full,streamingllm; known policies: "
            f"{', '.join(available())}"
        )
    twice = next((p for i, p in enumerate(specs) if p in specs[:i]), None)
    if twice is not None:
        _usage_error(
            f"{flag}: policy '{twice}' is given twice in {','.join(specs)} (it would run twice, "
            f"under one name in the table)"
        )
    declared: set[str] = set()
    every: set[str] = set()  # every parameter the policies have, for "did you mean"
    checked = 0
    for spec in specs:
        names = [spec.strip()] if spec.strip() in POLICIES else [n.strip() for n in spec.split("+")]
        unknown = [n for n in names if n and n not in POLICIES]
        if unknown:
            _usage_error(
                f"unknown policy '{unknown[0]}' in {flag} {','.join(specs)}"
                f"{did_you_mean(unknown[0], available())}; known policies: {', '.join(available())}"
            )
        checked += 1
        declared |= set(policy_params(spec, dict.fromkeys(param_keys)))
        every |= {p.name for n in names for p in POLICIES[n].params}
        # sablock and kvzip take ids from the model's tokenizer, which is not loaded yet: stand-ins here (a --param
        # punctuation_ids wins, and is checked)
        trial = policy_params(spec, {"stats": True, "punctuation_ids": [0], "tokenizer": _StandInTokenizer(), **params})
        try:
            kvpass.backend(spec, compiler=compiler, **trial)
        except ConfigError as e:
            _usage_error(str(e))
    for key in param_keys:
        if checked and key not in declared:
            _usage_error(
                f"--param {key}: none of the policies ({', '.join(specs)}) has a parameter '{key}'"
                f"{did_you_mean(key, every)}"
            )


def check_tasks(names: list[str], data: dict[str, str] | None = None) -> None:
    """Unknown ``--task`` names are a usage error (with "did you mean"), before the model loads; so are a benchmark
    without ``--data``, and a ``--data NAME=`` for a benchmark not in ``--task``."""
    from kvpass.eval import benchmarks
    from kvpass.eval import tasks as T

    data = data or {}
    bench = benchmarks.loaders()
    known = sorted(set(T.FAMILIES) | set(bench))
    unknown = [n for n in names if n not in known]
    if unknown:
        _usage_error(
            f"unknown task '{unknown[0]}' in --task {','.join(names)}{did_you_mean(unknown[0], known)}; "
            f"known tasks: {', '.join(sorted(T.FAMILIES))}; benchmarks (with --data): "
            f"{', '.join(sorted(bench))}"
        )
    for n in names:
        if n in bench and n not in T.FAMILIES and not (data.get(n) or data.get("")):
            _usage_error(
                f"--task {n} reads the benchmark's own files: pass --data PATH (a folder or a .jsonl / "
                f".json / .parquet file in its format, or a Hugging Face Hub id with 'datasets' installed)"
            )
    stray = [k for k in data if k and k not in names]
    if stray:
        _usage_error(f"--data {stray[0]}=...: '{stray[0]}' is not in --task {','.join(names)}")


def subsets_of(benchmark: str, names: list[str] | None) -> list[str] | None:
    """The ``--subsets`` entries that belong to ``benchmark``: ``NAME/SUBSET`` for it, or a bare subset it has
    (None when none does: all of its subsets run)."""
    from kvpass.eval import benchmarks

    if not names:
        return None
    known = benchmarks.subsets(benchmark)
    mine = [n.split("/", 1)[1] for n in names if n.startswith(benchmark + "/")]
    mine += [n for n in names if "/" not in n and n in known]
    return mine or None


def check_subsets(names: list[str] | None, tasks: list[str], data: dict[str, str]) -> None:
    """Every ``--subsets`` entry names a subset of a benchmark in ``--task`` (exit status 2 with the known ones)."""
    from kvpass.eval import benchmarks

    read = [t for t in tasks if benchmark_path(t, data) is not None]
    for n in names or ():
        bench, _, sub = n.rpartition("/")
        owners = [b for b in read if (not bench or bench == b) and sub in benchmarks.subsets(b)]
        if not owners:
            known = "; ".join(f"{b}: {', '.join(benchmarks.subsets(b))}" for b in read) or "none (no --data)"
            _usage_error(f"--subsets {n}: not a subset of the benchmarks read from --data; their subsets: {known}")


def benchmark_path(name: str, data: dict[str, str]) -> str | None:
    """The ``--data`` path of benchmark ``name`` (its own, else the one given for every benchmark), or None: the
    task is generated (``ruler`` without data is kvpass's RULER-style generator)."""
    from kvpass.eval import benchmarks

    if name not in benchmarks.loaders():
        return None
    return data.get(name) or data.get("")


def check_model(name: str) -> int | None:
    """Check ``--model`` without loading it; returns its context in tokens where known without loading.

    A registry model must be installed (or already converted): else the install line, exit status 1. An
    existing local folder's context comes from its ``config.json``. A name that is neither, but close to
    a registry name, is a usage error with "did you mean"; any other name is left to the loader (a Hub id).
    """
    from kvpass.eval import models

    spec = models.MODELS.get(name)
    if spec is not None:
        if not spec.installed and not models.status()[models.available().index(name)].converted:
            raise SystemExit(
                f"kvpass: model '{name}' needs the package '{spec.package}', which is not "
                f"installed. Install it (as install.sh does) with:\n    {spec.install_cmd}"
            )
        return spec.context
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        try:
            return models.context_length(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError):
            return None  # the loader says what is wrong with it
    if not path.exists() and models.close_matches(name):
        _usage_error(
            f"--model {name}: not a registry model or a local path"
            f"{did_you_mean(name, models.available())}; registry models: {', '.join(models.available())} "
            f"(`kvpass models` says which are installed)"
        )
    return None


def new_tokens_needed(families: list[str], max_new_tokens: int | None) -> int:
    """The most tokens a task of these families generates after its prompt (``--max-new-tokens`` when given)."""
    if max_new_tokens:
        return max_new_tokens
    from kvpass.eval import tasks as T

    most = 0
    for family in families:
        budget = getattr(getattr(T, family, None), "MAX_NEW_TOKENS", 0)
        most = max(most, max(budget.values()) if isinstance(budget, dict) else budget)
    return most


def check_lengths(lengths: list[int], context: int | None, model: str, new_tokens: int) -> None:
    """Each prompt length plus the tokens generated after it must fit the model's context (exit status 2)."""
    if context is None:
        return
    longest = context - new_tokens
    too_long = [n for n in lengths if n > longest]
    if too_long:
        _usage_error(
            f"--lengths {too_long[0]}: {model}'s context is {context} tokens (max_position_embeddings) and "
            f"a task generates up to {new_tokens} tokens after its prompt, so each length must be "
            f"between 1 and {longest}; pass shorter lengths, e.g. --lengths 1k,{longest}"
        )


def check_budget_taken(args, policies: list[str]) -> None:
    """``eval --budget`` for a policy without a budget (full, art) is a usage error: it would be ignored.
    (``compare`` runs policies with and without one together; its table says which ignored it.)"""
    if args.cmd != "eval" or args.budget is None:
        return
    from kvpass.eval.report import takes_budget

    if not takes_budget(policies[0]):
        _usage_error(
            f"--budget: policy '{policies[0]}' has no parameter 'budget' (it keeps every entry); drop --budget"
        )


# Policies whose budget counts decode tokens kept besides the prompt, not prompt entries (raas keeps every
# prompt entry): a budget above the prompt does not make them keep everything.
_BUDGET_BESIDES_PROMPT = frozenset({"raas"})


def budget_notes(policies: list[str], params: dict, lengths: list[int]) -> list[str]:
    """Notes for policies whose budget (given or default) is not below any prompt length: they keep or read
    every prompt entry there, so they equal ``full``; the run goes on (a no-op setting is a valid check)."""
    from kvpass.eval.report import budget_text
    from kvpass.policies import POLICIES

    notes = []
    for spec in policies:
        members = [spec] if spec in POLICIES else [n.strip() for n in spec.split("+")]
        text = budget_text(spec, params)
        if not text.startswith("budget ") or any(m in _BUDGET_BESIDES_PROMPT for m in members):
            continue
        budget = int(text.split()[1])
        if budget >= max(lengths):
            notes.append(
                f"{spec}'s {text} is not below any of --lengths {','.join(map(str, lengths))}: it keeps "
                f"every prompt entry and gives what full gives; pass --budget below {max(lengths)}"
            )
    return notes


def check_device(device: str) -> None:
    """``--device cuda`` on a machine without a visible GPU is a usage error, before the model loads."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        _usage_error(
            f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False); pass --device cpu"
        )


def _prepare_out(out: Path) -> list[Path]:
    """Create ``out`` and check that a file can be written in it, before anything runs; returns the
    folders created (innermost first) so that a run that fails can remove them again. A folder that
    cannot be made or written is a usage error (status 2)."""
    if out.exists() and not out.is_dir():
        _usage_error(
            f"--out {out}: cannot write there (it is a file, not a folder); pass a folder's path, "
            f"e.g. --out {out.with_name(out.name + '-results')}"
        )
    created = []
    for folder in (out, *out.parents):
        if folder.exists() or folder.is_symlink():
            break
        created.append(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvpass-write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        _remove_empty(created)
        _usage_error(f"--out {out}: cannot write there ({e.strerror or e}); pass a folder you can write to")
    return created


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # innermost first; stop at the first that holds something
        try:
            folder.rmdir()
        except OSError:
            break


def _load(args):
    from kvpass.eval import models

    try:
        return models.load(args.model, dtype=_dtype(args), device=args.device, tp=getattr(args, "tp", False))
    except models.ModelNotAvailable as e:
        raise SystemExit(f"kvpass: {e}") from None


# ------------------------------------------------------------------------------------------------
# what is checked once the model is loaded, before a task runs
# ------------------------------------------------------------------------------------------------


def _tasks(args, tokenizer):
    from kvpass.eval import benchmarks
    from kvpass.eval import tasks as T

    out = []
    data = parse_data(args.data)
    for family in args.task:
        path = benchmark_path(family, data)
        if path is not None:  # a published benchmark, read from its own files
            try:
                out += benchmarks.load(
                    family,
                    path,
                    tokenizer,
                    subsets=subsets_of(family, args.subsets),
                    limit=args.limit,
                    max_length=args.max_length,
                )
            except (OSError, ValueError, ImportError) as e:
                _usage_error(f"--task {family} --data {path}: {e}")
            continue
        options = {"depths": args.depths} if (family == "niah" and args.depths) else {}
        for length in args.lengths:
            try:
                batch = T.build(family, tokenizer, [length], seed=args.seed, **options)
            except ValueError as e:  # e.g. "length 64 is too short for niah/passkey"
                _usage_error(f"--lengths {length}: {e}; pass longer lengths (a few hundred tokens at least)")
            out += batch[: args.limit] if args.limit else batch
    if args.max_new_tokens:
        for t in out:
            t.max_new_tokens = args.max_new_tokens
    return out


def check_tasks_fit(tasks, context: int | None, model: str) -> None:
    """Every built task, prompt plus generation, fits the loaded model's context (exit status 2)."""
    if context is None:
        return
    for t in tasks:
        if len(t.input_ids) + t.max_new_tokens <= context:
            continue
        if "benchmark" in t.meta:  # read from files: --max-length cuts it, --lengths does not apply
            _usage_error(
                f"--task {t.family}: a prompt of {t.name} has {len(t.input_ids)} tokens and "
                f"{t.max_new_tokens} are generated after it, beyond {model}'s context of {context}; pass "
                f"--max-length {context - t.max_new_tokens} (cut in the middle) or --max-new-tokens"
            )
        else:
            _usage_error(
                f"--lengths {len(t.input_ids)}: {model}'s context is {context} tokens "
                f"(max_position_embeddings) and {t.name} generates {t.max_new_tokens} tokens after its "
                f"prompt; each length must be between 1 and {context - t.max_new_tokens}"
            )


def describe_tasks(tasks) -> str:
    """What one policy runs, e.g. ``12 tasks (niah: 2 lengths x 3 depths x 2 needle kinds)``."""
    parts = []
    for family in dict.fromkeys(t.family for t in tasks):
        mine = [t for t in tasks if t.family == family]
        lengths = len({len(t.input_ids) for t in mine})
        depths = len({t.meta.get("depth") for t in mine if t.meta.get("depth") is not None})
        kinds = len({t.name for t in mine})
        axes = [f"{lengths} length{'s' * (lengths != 1)}"]
        if depths:
            axes.append(f"{depths} depth{'s' * (depths != 1)}")
        axes.append(f"{kinds} {'needle kind' if family == 'niah' else 'task'}{'s' * (kinds != 1)}")
        product = lengths * max(depths, 1) * kinds
        parts.append(f"{family}: {' x '.join(axes)}" + ("" if product == len(mine) else f", {len(mine)} in all"))
    return f"{len(tasks)} task{'s' * (len(tasks) != 1)} ({'; '.join(parts)})"


# ------------------------------------------------------------------------------------------------
# compare / eval
# ------------------------------------------------------------------------------------------------


def _progress_bar(n_policies: int, n_tasks: int):
    """One bar over every (policy, task) run, labelled as such; returns (bar, step) or (None, None)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None, None
    bar = tqdm(total=n_policies * n_tasks, desc=f"{n_policies} policies x {n_tasks} tasks", unit="run", file=sys.stderr)
    return bar, bar.update


def _finish(results, out: Path, created: list[Path], meta: dict) -> int:
    """Write the results of the policies that ran and say what failed; the exit status (1: a policy failed).

    A policy that raised during its tasks is a failed run (unlike one unavailable by configuration). When
    no policy completed, nothing is written and a results folder this run created is removed."""
    from kvpass.eval import report

    failed = [r for r in results if r.failed]
    complete = [r for r in results if r.available]
    for r in failed:
        print(f"kvpass: {r.policy} {r.reason}", file=sys.stderr)
    if failed and not complete:
        _remove_empty(created)
        print(f"kvpass: all {len(failed)} policies that ran failed; no results written", file=sys.stderr)
        return 1
    paths = report.write(results, out, meta)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    if failed:
        print(
            f"kvpass: {len(failed)} of {len(results)} policies failed ({', '.join(r.policy for r in failed)}); "
            f"the results of {', '.join(r.policy for r in complete)} are in {out} (results.json has the "
            f"failures' errors)",
            file=sys.stderr,
        )
        return 1
    return 0


class Progress:
    """``--out``'s ``progress.jsonl``: a line per (policy, task) as it finishes, so that ``--resume`` skips what an
    interrupted run did. The first line is the run's setting (model, dtype, compiler, device); a resumed run must
    have the same. Without ``--resume`` the file starts afresh."""

    def __init__(self, path: Path, setting: dict, resume: bool) -> None:
        self.path, self.setting, self.done = path, setting, {}
        lines = path.read_text().splitlines() if resume and path.is_file() else []
        if lines:
            first = json.loads(lines[0]).get("setting")
            if first != setting:
                _usage_error(
                    f"--resume: {path} was written by a run of another setting ({first}); this run is "
                    f"{setting}: pass the same --model, --dtype, --compiler and --device, or another --out"
                )
            for line in lines[1:]:
                try:
                    got = json.loads(line)
                except json.JSONDecodeError:  # the line a kill cut short
                    continue
                self.done[(got["policy"], got["task"])] = got
            _note(f"--resume: {len(self.done)} (policy, task) results from {path} are kept; the rest run")
        elif resume:
            _note(f"--resume: {path} does not exist, so every task runs")
        if not resume and path.is_file():
            path.unlink()  # an earlier run's records: not this run's to resume from
        self.fresh = not lines  # the file is written from the first task on (a run that did none leaves none)

    def record(self, policy: str, task: str, row: dict, tokens: list[int], compile_s: float) -> None:
        if self.fresh:
            self.path.write_text(json.dumps({"setting": self.setting}) + "\n")
            self.fresh = False
        with self.path.open("a") as fh:
            fh.write(
                json.dumps({"policy": policy, "task": task, "row": row, "tokens": tokens, "compile_s": compile_s})
                + "\n"
            )


INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (SIGINT), as a shell reports it


def _interrupted(finished, policies: list[str], out: Path, created: list[Path], meta: dict) -> int:
    """Ctrl-C during a run: write the results of the policies that finished, say where and what did not finish;
    the exit status is 130. With none finished, nothing is written and a results folder this run created is
    removed."""
    from kvpass.eval import report

    done = [r for p in policies for r in finished if r.policy == p]
    if not done:
        _remove_empty(created)
        kept = (out / "progress.jsonl").is_file()
        print(
            "kvpass: interrupted before any policy finished; no results written"
            + (
                f" (the tasks done are in {out / 'progress.jsonl'}: the same command with --resume goes on from them)"
                if kept
                else ""
            ),
            file=sys.stderr,
        )
        return INTERRUPTED
    rest = [p for p in policies if p not in {r.policy for r in done}]
    paths = report.write(done, out, {**meta, "interrupted": True, "not_finished": rest})
    print(f"wrote {', '.join(str(p) for p in paths)}")
    print(
        f"kvpass: interrupted: the results of {', '.join(r.policy for r in done)} are in {out}; not finished: "
        f"{', '.join(rest)}; the same command with --resume goes on from the tasks done",
        file=sys.stderr,
    )
    return INTERRUPTED


def _params(args) -> dict:
    """``--param`` values with ``--budget`` as ``budget``; both naming the budget is a usage error."""
    params = parse_params(args.param)
    if args.budget is not None:
        if "budget" in params and params["budget"] != args.budget:
            _usage_error(f"--budget {args.budget} and --param budget={params['budget']} disagree; pass one of them")
        params["budget"] = args.budget
    return params


def run_comparison(args, policies: list[str]) -> int:
    """Check everything that can be checked, run the policies and write the results; the exit status is
    1 when a policy failed mid-run, 130 when the run was interrupted (Ctrl-C: ``_interrupted``)."""
    from kvpass.eval import compare, report

    params = _params(args)
    compiler = args.compiler or ("inductor" if args.device.startswith("cuda") else "eager")
    # Everything that can be checked without the model is checked before it loads.
    check_policies(
        policies,
        params,
        param_keys=parse_params(args.param),
        compiler=compiler,
        flag="--policies" if args.cmd == "compare" else "--policy",
    )
    data = parse_data(args.data)
    check_tasks(args.task, data)
    check_subsets(args.subsets, args.task, data)
    generated = [t for t in args.task if benchmark_path(t, data) is None]
    check_budget_taken(args, policies)
    context = check_model(args.model)
    if generated:
        check_lengths(args.lengths, context, args.model, new_tokens_needed(generated, args.max_new_tokens))
    check_device(args.device)
    for note in budget_notes(policies, params, args.lengths):
        _note(note)
    if args.resume and args.out is None:
        _usage_error("--resume continues the run whose results folder --out names: pass --out FOLDER")
    out = args.out or Path("kvpass-results") / time.strftime("%Y%m%d-%H%M%S")
    created = _prepare_out(out)
    meta = {
        **report.environment(args.device),
        "model": args.model,
        "dtype": args.dtype,
        "policies": policies,
        "params": params,
        "tasks": args.task,
        "lengths": args.lengths,
        "seed": args.seed,
        "compiler": compiler,
        "max_new_tokens": args.max_new_tokens,
    }
    if data:
        meta.update(data=data, subsets=args.subsets, max_length=args.max_length)
    progress = Progress(
        out / "progress.jsonl",
        {"model": args.model, "dtype": args.dtype, "compiler": compiler, "device": args.device},
        resume=args.resume,
    )
    finished, bar, t0 = [], None, time.perf_counter()
    try:
        model, tokenizer = _load(args)
        from kvpass.eval import models

        tasks = _tasks(args, tokenizer)
        check_tasks_fit(tasks, models.context_length(getattr(model, "config", None)), args.model)
        bar, step = _progress_bar(len(policies), len(tasks))
        t0 = time.perf_counter()
        results = compare(
            model,
            tokenizer,
            policies,
            tasks,
            params,
            compiler=compiler,
            device=args.device,
            progress=step,
            finished=finished.append,
            done=progress.done,
            record=progress.record,
        )
        if bar is not None:
            bar.close()
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        return _interrupted(finished, policies, out, created, {**meta, "wall_s": round(time.perf_counter() - t0, 1)})
    except BaseException:
        _remove_empty(created)  # no empty results folder left behind
        raise
    wall = time.perf_counter() - t0
    meta.update(wall_s=round(wall, 1), n_tasks=len(tasks))
    lengths = f"lengths {','.join(map(str, args.lengths))} | " if generated else ""  # generated tasks' lengths
    title = (
        f"{args.model} | {lengths}{describe_tasks(tasks)} x "
        f"{len(policies)} polic{'ies' if len(policies) != 1 else 'y'} | {args.device}, {compiler} compiler | "
        f"{wall:.0f}s"
    )
    report.print_table(results, title, params)
    return _finish(results, out, created, meta)


def explain(args) -> int:
    """``kvpass explain``: the per-layer detection table of the model under a policy."""
    import kvpass
    from kvpass.eval.runner import policy_params

    params = _params(args)
    check_policies([args.policy], params, param_keys=parse_params(args.param), flag="--policy")
    if args.budget is not None and not policy_params(args.policy, {"budget": args.budget}):
        _usage_error(f"--budget: policy '{args.policy}' has no parameter 'budget' (it keeps every entry)")
    check_model(args.model)
    check_device(args.device)
    model, tokenizer = _load(args)
    params = {**policy_params(args.policy, {"tokenizer": tokenizer}), **params}  # sablock's punctuation
    ids = tokenizer("kvpass explains what it finds in this model.", return_tensors="pt").input_ids
    kvpass.explain(model, {"input_ids": ids.to(args.device), "use_cache": True}, policy=args.policy, **params)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``kvpass`` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    if args.cmd == "models":
        print_models()
        return 0
    if args.cmd == "leaderboard":
        from kvpass.eval import leaderboard

        try:
            paths = leaderboard.write(args.folders, args.out)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"kvpass leaderboard: {e}") from None
        print(f"wrote {', '.join(str(p) for p in paths)}")
        return 0
    try:
        args.device = args.device or _default_device()
        if args.cmd == "explain":
            return explain(args)
        from kvpass.policies import ConfigError

        try:
            return run_comparison(args, args.policies if args.cmd == "compare" else [args.policy])
        except ConfigError as e:
            raise SystemExit(str(e)) from None  # a ConfigError starts with "kvpass"
    except KeyboardInterrupt:  # before a run started (a run says what it kept: _interrupted)
        print("kvpass: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
