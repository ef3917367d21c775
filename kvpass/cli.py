"""The ``kvpass`` command.

    kvpass compare --model smollm2-135m --policies full,streamingllm --budget 256 --task niah --lengths 1k,2k
    kvpass eval    --model smollm2-135m --policy streamingllm --budget 128 --task niah --lengths 1k,2k,4k
    kvpass explain --model smollm2-135m [--policy streamingllm --budget 128]
    kvpass models
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NoReturn

import torch


def parse_length(text: str) -> int:
    t = text.strip().lower()
    try:
        return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a length is like 512, 1k or 4k; got {text!r}") from None


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


LENGTHS_HELP = ("prompt lengths in tokens, comma-separated: a number of tokens or a number with k "
                "(1k = 1024 tokens), e.g. 512,1k,2k (default 1k,2k)")


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
    """The policy names, read from the registry at runtime (and the planned ones, which the run reports
    unavailable)."""
    try:
        from kvpass.policies import PLANNED, available
        names = ", ".join(available())
        return names + (f" (planned, reported unavailable: {', '.join(PLANNED)})" if PLANNED else "")
    except Exception:  # noqa: BLE001  (the help must print even if a policy module is broken)
        return "see kvpass.policies.available()"


def _policies_epilog() -> str:
    """One line per policy for ``--help``: its name, what it does, its parameters and their defaults."""
    try:
        from kvpass.policies import POLICIES, available
        lines = ["policies (combine two with '+', e.g. snapkv+art; set parameters with --budget / --param):"]
        for name in available():
            cls = POLICIES[name]
            params = ", ".join(f"{p.name}={p.default}" for p in cls.params if p.name != "tokenizer")
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


def _common(p: argparse.ArgumentParser) -> None:
    from kvpass.eval import models
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a registry model ({', '.join(models.available())}; see `kvpass models`), a local "
                        f"Hugging Face folder, a local .gguf file or a Hugging Face Hub id (default smollm2-135m)")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default_device,
                   help=f"torch device the model runs on: cpu, cuda or cuda:N (default: cuda when a GPU is "
                        f"visible, else cpu; here {default_device})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights and activations dtype (default: bfloat16 on CUDA, float32 on CPU)")


def _run_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--budget", type=int, default=None,
                   help="KV entries kept per layer, for the policies that take a budget (each policy's own "
                        "default otherwise; policies without one, such as full, ignore it)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other policy parameter, e.g. --param sinks=4 (repeat for several; the "
                        "parameters of each policy are listed below)")
    p.add_argument("--task", type=parse_list, default=["niah"], metavar="T[,T...]",
                   help=f"task families, comma-separated: {_task_names()} (default niah)")
    p.add_argument("--lengths", type=lambda s: [parse_length(x) for x in parse_list(s)], default=[1024, 2048],
                   metavar="N[,N...]", help=LENGTHS_HELP)
    p.add_argument("--depths", type=lambda s: [float(x) for x in parse_list(s)], default=None,
                   metavar="D[,D...]",
                   help="NIAH needle depths in [0, 1], comma-separated (default 0,0.25,0.5,0.75,1)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="at most this many tasks per family and length (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="override every task's generation length (default: each task's own)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks (default 0)")
    p.add_argument("--compiler", default=None, choices=["inductor", "aot_eager", "eager"],
                   help="what compiles the rewritten graph (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--out", type=Path, default=None, metavar="FOLDER",
                   help="folder the results go to: results.json, results.csv and NIAH heatmap PNGs "
                        "(default: a new folder kvpass-results/<YYYYmmdd-HHMMSS> in the current directory)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpass", description="Compare KV-cache policies on real models.",
                                 epilog="Run `kvpass COMMAND --help` for the options of each command.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    names, epilog = _policy_names(), _policies_epilog()
    fmt = _HelpFormatter  # keeps the epilog's one line per policy
    c = sub.add_parser("compare", help="run several policies on the same tasks, one table",
                       description="Run several policies on the same tasks and print one table; the "
                                   "results are written to --out.", epilog=epilog, formatter_class=fmt)
    c.add_argument("--policies", type=parse_list, default=["full", "streamingllm"], metavar="P[,P...]",
                   help=f"policies to compare, comma-separated (default full,streamingllm); one of: {names}")
    _run_args(c)
    e = sub.add_parser("eval", help="run one policy",
                       description="Run one policy on the tasks; the results are written to --out.",
                       epilog=epilog, formatter_class=fmt)
    e.add_argument("--policy", default="full", help=f"the policy to run (default full); one of: {names}")
    _run_args(e)
    x = sub.add_parser("explain", help="per-layer detection table of a model",
                       description="Trace the model once on a short prompt and print what kvpass finds "
                                   "at each attention layer and what the policy would do there.",
                       epilog=epilog, formatter_class=fmt)
    _common(x)
    x.add_argument("--policy", default="full",
                   help=f"the policy whose plan is shown (default full); one of: {names}")
    x.add_argument("--budget", type=int, default=None,
                   help="KV entries kept per layer, for the policies that take a budget (an error for "
                        "policies without one, such as full)")
    x.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other policy parameter, e.g. --param sinks=4 (repeat for several)")
    x.add_argument("--tp", action="store_true",
                   help="split the model with transformers' tensor-parallel plan (tp_plan='auto'); run under "
                        "torchrun, e.g. torchrun --nproc_per_node 2 -m kvpass.cli explain --tp ...: each rank "
                        "prints its local heads and the collectives kvpass inserted")
    sub.add_parser("models", help="list the registry models: installed? converted? where?",
                   description="List the registry models, whether each one's pip package is installed and "
                               "whether it has been converted into the kvpass cache folder.")
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
    print(f"converted: the model's GGUF has been dequantized into its cache folder (under {models.cache_dir()};\n"
          f"  $KVPASS_CACHE moves it). An installed model is converted once on first use (tens of seconds),\n"
          f"  e.g. by `kvpass eval --model NAME`; later loads read the folder in about a second.")


def _dtype(args) -> torch.dtype:
    name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return getattr(torch, name)


def _usage_error(msg: str) -> NoReturn:
    """A bad command line found by kvpass rather than argparse: said on stderr, exit status 2 (as argparse)."""
    print(f"kvpass: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_policies(specs: list[str], params: dict, *, param_keys=(), compiler: str = "eager",
                   flag: str = "--policies") -> None:
    """Every policy name and ``--param`` checked before any model loads, as the run will check them.

    Each spec is built with ``kvpass.backend`` on the parameters ``Runner.compile`` gives it (the
    subset of ``params`` it declares), so a bad value fails here with the library's own ``ConfigError``
    message. Planned policies (``h2o``) pass: the run reports them unavailable, as before. A key of
    ``param_keys`` (those given with ``--param``) that none of the policies declares is an error too:
    the run would silently drop it. Errors exit with status 2.
    """
    import kvpass
    from kvpass.eval.runner import policy_params
    from kvpass.policies import PLANNED, POLICIES, ConfigError, available

    declared: set[str] = set()
    checked = 0
    for spec in specs:
        names = [spec.strip()] if spec.strip() in POLICIES else [n.strip() for n in spec.split("+")]
        unknown = [n for n in names if n and n not in POLICIES and n not in PLANNED]
        if unknown:
            _usage_error(f"unknown policy '{unknown[0]}' in {flag} {','.join(specs)}; "
                         f"known policies: {', '.join(available())}")
        if any(n in PLANNED for n in names):
            continue
        checked += 1
        declared |= set(policy_params(spec, dict.fromkeys(param_keys)))
        # sablock takes its punctuation ids from the model's tokenizer, which is not loaded yet: a stand-in
        # here (a --param punctuation_ids wins, and is checked)
        trial = policy_params(spec, {"stats": True, "punctuation_ids": [0], **params})
        try:
            kvpass.backend(spec, compiler=compiler, **trial)
        except ConfigError as e:
            _usage_error(str(e))
    for key in param_keys:
        if checked and key not in declared:
            _usage_error(f"--param {key}: none of the policies ({', '.join(specs)}) has a parameter '{key}'")


def _prepare_out(out: Path) -> list[Path]:
    """Create ``out`` and check that a file can be written in it, before anything runs; returns the
    folders created (innermost first) so that a run that fails can remove them again."""
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
        raise SystemExit(f"kvpass: --out {out}: cannot write there ({e.strerror or e})") from None
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


def check_tasks(names: list[str]) -> None:
    """Unknown ``--task`` names are a usage error, before the model loads."""
    from kvpass.eval import tasks as T
    unknown = [n for n in names if n not in T.FAMILIES]
    if unknown:
        _usage_error(f"unknown task '{unknown[0]}' in --task {','.join(names)}; known tasks: "
                     f"{', '.join(sorted(T.FAMILIES))}")


def _tasks(args, tokenizer):
    from kvpass.eval import tasks as T
    out = []
    for family in args.task:
        options = {"depths": args.depths} if (family == "niah" and args.depths) else {}
        for length in args.lengths:
            batch = T.build(family, tokenizer, [length], seed=args.seed, **options)
            out += batch[: args.limit] if args.limit else batch
    if args.max_new_tokens:
        for t in out:
            t.max_new_tokens = args.max_new_tokens
    return out


def run_comparison(args, policies: list[str]) -> int:
    """Run the policies and write the results; the exit status is 1 when a policy failed mid-run."""
    from kvpass.eval import compare, report

    params = parse_params(args.param)
    if args.budget is not None:
        params["budget"] = args.budget
    compiler = args.compiler or ("inductor" if args.device.startswith("cuda") else "eager")
    # Everything that can be checked without the model is checked before it loads.
    check_policies(policies, params, param_keys=parse_params(args.param), compiler=compiler,
                   flag="--policies" if args.cmd == "compare" else "--policy")
    check_tasks(args.task)
    out = args.out or Path("kvpass-results") / time.strftime("%Y%m%d-%H%M%S")
    created = _prepare_out(out)
    try:
        model, tokenizer = _load(args)
        tasks = _tasks(args, tokenizer)
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(tasks) * len(policies), desc="tasks", unit="task", file=sys.stderr)
            step = bar.update
        except ImportError:  # pragma: no cover
            bar, step = None, None
        t0 = time.perf_counter()
        results = compare(model, tokenizer, policies, tasks, params, compiler=compiler, device=args.device,
                          progress=step)
        if bar is not None:
            bar.close()
    except BaseException:
        _remove_empty(created)  # no empty results folder left behind
        raise
    wall = time.perf_counter() - t0
    meta = {**report.environment(args.device), "model": args.model, "policies": policies, "params": params,
            "tasks": args.task, "lengths": args.lengths, "seed": args.seed, "compiler": compiler,
            "wall_s": round(wall, 1), "n_tasks": len(tasks)}
    title = (f"{args.model} | {', '.join(args.task)} | lengths {','.join(map(str, args.lengths))} | "
             f"{len(tasks)} tasks | {args.device} | {wall:.0f}s")
    report.print_table(results, title)
    paths = report.write(results, out, meta)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    # A policy that raised during its tasks (Runner.run: reason "failed on task ...") is a failed run,
    # unlike one that is unavailable by configuration (planned, or not applicable to this model).
    failed = [r for r in results if not r.available and (r.reason or "").startswith("failed on task")]
    for r in failed:
        print(f"kvpass: {r.policy} {r.reason}", file=sys.stderr)
    if failed:
        print(f"kvpass: {len(failed)} of {len(results)} policies failed; the others' results are in {out}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "models":
        print_models()
        return 0
    if args.cmd == "explain":
        import kvpass
        params = parse_params(args.param)
        if args.budget is not None:
            params["budget"] = args.budget
        check_policies([args.policy], params, param_keys=parse_params(args.param), flag="--policy")
        from kvpass.eval.runner import policy_params
        if args.budget is not None and not policy_params(args.policy, {"budget": args.budget}):
            _usage_error(f"--budget: policy '{args.policy}' has no parameter 'budget' (it keeps every entry)")
        model, tokenizer = _load(args)
        params = {**policy_params(args.policy, {"tokenizer": tokenizer}), **params}  # sablock's punctuation
        ids = tokenizer("kvpass explains what it finds in this model.", return_tensors="pt").input_ids
        kvpass.explain(model, {"input_ids": ids.to(args.device), "use_cache": True}, policy=args.policy, **params)
        return 0
    from kvpass.policies import ConfigError
    try:
        return run_comparison(args, args.policies if args.cmd == "compare" else [args.policy])
    except ConfigError as e:
        raise SystemExit(f"kvpass: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
