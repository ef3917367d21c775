"""Where a ``generate`` decode step's host time goes, one GPU, one process.

Per policy, on a random-weight Llama-3.1-8B shape (``--layers``, bf16, batch 1) compiled by ``kvpass.compile``
(reduce-overhead, prefill without Inductor), warm, at one prompt length:

* TPOT through ``generate`` (kvpass's loop, ``bench_fastpath.StepClock``), the compiled step queued and
  synced (``bench_fastpath``'s measures), so the rows say which steps are host-bound;
* the host's time per step in each part of kvpass's decoding loop (``sections``: HF's input preparation and
  keyword update, the compiled forward's call, the wait for the step before; a part that holds a hidden sync
  shows the device's step time);
* a torch.profiler table (CPU and CUDA) over one ``generate`` of ``--new`` tokens: syncs, launches, copies;
* a cProfile table over the same call: the Python functions (HF's loop, cudagraph trees, kvpass).

    python bench/probes/probe_host.py --layers 8 --length 2000 --policies full,snapkv,art --out host.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from bench_fastpath import bare_loops, clocked_tpot, gen, prompt  # noqa: E402
from kvpass.generate import decode_loop  # noqa: E402
from llama_shape import llama8b_config, random_llama, uncompiled  # noqa: E402


def sections(model, ids, new: int) -> dict[str, float]:
    """Milliseconds of host time per decode step in each part of one warm ``generate`` of ``new`` tokens (the
    parts wrapped for this call only; ``step`` is the step clock's time per step, ``rest`` what no part holds:
    sampling, stopping criteria, launches of the small ops between steps)."""
    spent: dict[str, list[float]] = {}

    def timed(label, fn):
        @functools.wraps(fn)  # HF reads the forward's signature
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent.setdefault(label, []).append(time.perf_counter() - t)

        return run

    parts = {
        "prepare_inputs": (model, "prepare_inputs_for_generation"),
        "update_kwargs": (model, "_update_model_kwargs_for_generation"),
        "forward": (model, "forward"),
        "wait_step_before": (decode_loop.Late, "read"),
    }
    saved = {label: getattr(obj, name) for label, (obj, name) in parts.items()}
    own = {label: name in vars(obj) for label, (obj, name) in parts.items()}  # else a class attribute shadowed
    for label, (obj, name) in parts.items():
        setattr(obj, name, timed(label, saved[label]))
    try:
        step, _ = clocked_tpot(model, ids, new)
    finally:
        for label, (obj, name) in parts.items():
            if own[label]:
                setattr(obj, name, saved[label])
            else:
                delattr(obj, name)
    # each part's mean per call, its first call left out (the prefill's forward and input preparation)
    out = {label: round(sum(t[1:]) / max(len(t) - 1, 1) * 1e3, 3) for label, t in spent.items()}
    out["step"] = round(step * 1e3, 3)
    out["rest"] = round(out["step"] - sum(v for k, v in out.items() if k not in ("step", "wait_step_before")), 3)
    return out


def probe_args(new: int, policies: str, out: str) -> argparse.ArgumentParser:
    """The options the probes share (``--layers``, ``--length``, ``--new``, ``--policies``, ``--budget``,
    ``--out``), with these defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--new", type=int, default=new)
    ap.add_argument("--policies", default=policies)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--out", default=out)
    return ap


def each_policy(args):
    """Yields (model, policy, prompt) per policy of ``args.policies``: the random-weight model of ``args.layers``
    compiled by ``kvpass.compile`` (reduce-overhead, prefill without Inductor) with that policy, the one before
    undone."""
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = random_llama(llama8b_config(args.layers), "cuda", torch.bfloat16)
    model.generation_config.pad_token_id = 0
    for policy in args.policies.split(","):
        uncompiled(model)
        params = {} if policy in ("full", "art") else {"budget": args.budget}
        kvpass.compile(model, policy, prefill_compiler="eager", **params)
        yield model, policy, prompt(args.length)


def save(args, rows: list[dict]) -> None:
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "length": args.length,
        "new": args.new,
        "budget": args.budget,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> None:
    args = probe_args(32, "full,snapkv,art", "host.json").parse_args()
    rows = []
    for model, policy, ids in each_policy(args):
        gen(model, ids, 4 * args.new)  # the cache for 4 * new tokens built before any timing
        queued, synced = bare_loops(model, ids)
        row = {
            "policy": policy,
            "generate_tpot_ms": round(clocked_tpot(model, ids, 4 * args.new)[0] * 1e3, 3),
            "queued_tpot_ms": round(queued * 1e3, 3),
            "synced_tpot_ms": round(synced * 1e3, 3),
            "host_ms_per_step": sections(model, ids, 4 * args.new),
        }
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(model, ids, args.new)
            torch.cuda.synchronize()
        row["torch_profile"] = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60
        )
        pr = cProfile.Profile()
        pr.enable()
        gen(model, ids, args.new)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
        row["cprofile"] = s.getvalue()
        rows.append(row)
        print({k: v for k, v in row.items() if k not in ("torch_profile", "cprofile")}, flush=True)
        print(row["torch_profile"], row["cprofile"], sep="\n", flush=True)
        save(args, rows)


if __name__ == "__main__":
    main()
