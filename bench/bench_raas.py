"""KV memory, GPU memory and TPOT over a long generation, ``full`` against ``quest`` and ``raas``.

RaaS keeps a fixed pool of pages during decoding; this measures whether its memory and step time stay flat
over thousands of decode steps while ``full``'s and ``quest``'s grow.

One process, one GPU, one model: each policy compiles ``model.forward`` with
``kvpass.backend(policy, budget=...)`` (Inductor, ``dynamic=True`` as ``kvpass compare`` does), is
warmed up on a short prompt (prefill + a few decode steps, so compilation never enters the timings),
then prefills a ``--prompt``-token prompt and decodes ``--steps`` greedy tokens at batch 1 through a
``DynamicCache``. Every ``--every`` steps it records:

* ``kv_bytes``: the K/V tensors the cache holds (what the model stores: raas's page pool, the
  whole history for full and quest), and ``state_bytes``: the policy's own tensors (page tables,
  min/max keys, positions) in the generation state;
* ``allocated``: ``torch.cuda.memory_allocated()``; ``peak``: the allocator's high-water mark over
  the interval since the previous record (the interval's reset), and ``peak_total`` since prefill;
* TPOT: mean, median and max wall time of the interval's decode steps (each step synchronised).

The model is a Llama-architecture decoder with random weights built from a ``LlamaConfig``
(``--preset``): ``smollm2-135m`` has SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV
heads, head_dim 64, vocab 49152), ``llama-1b`` Llama-3.2-1B's (16 layers, hidden 2048, 32 / 8 heads,
head_dim 64, vocab 128256). Weights do not change the cost of a step; random weights need no
download. ``max_position_embeddings`` is set past prompt + steps.

Targets, evaluated in ``summary.md``: raas's memory flat within 1% after the budget is
reached while full's and quest's grow linearly; raas's TPOT flat and at most quest's.

    python bench/bench_raas.py --steps 2048 --out /tmp/raas_short          # a short run first
    python bench/bench_raas.py --out bench/results/raas_memory_h100        # 16,384 steps

``--policies`` runs a subset; with ``--merge`` the records already in ``--out/results.json`` for other
policies are kept (for runs split over several commands), and the summary and plot cover them all.

Results: ``bench/results/raas_quest_h200/`` (1,024 steps) and ``raas_16k_h200/`` (16,384 steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from kvpass.eval import report  # noqa: E402
from kvpass.eval.runner import cache_bytes  # noqa: E402

PRESETS = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=True,
    ),  # smoke tests
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
}


def build_model(preset: str, max_len: int, dtype, device):
    cfg = LlamaConfig(
        **PRESETS[preset], max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval(), cfg


def state_bytes(be) -> int:
    """Bytes of every tensor the policy keeps in the generation state (positions, page tables, bounds)."""
    total, ptrs = 0, set()
    for layer in be.state.layers.values():
        seen, todo = [layer.pos], list(layer.extra.values())
        while todo:  # raas keeps its page tables in lists, and the ones its last step started from in a tuple
            v = todo.pop()
            if isinstance(v, torch.Tensor):
                seen.append(v)
            elif isinstance(v, (list, tuple)):
                todo += v
        for t in seen:
            if t.data_ptr() not in ptrs:
                ptrs.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def mem(fn) -> int:
    """A CUDA allocator statistic; 0 on CPU (``--device cpu`` is a smoke test of the script only)."""
    return getattr(torch.cuda, fn)() if CUDA else 0


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def run_policy(
    model,
    policy: str,
    params: dict,
    prompt: torch.Tensor,
    steps: int,
    every: int,
    log,
    deadline: float = float("inf"),
    warm_steps: int = 64,
) -> dict:
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler="inductor" if CUDA else "eager", **params)
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=True)

    def step(ids, cache):
        return fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    t0 = time.perf_counter()
    # Compile (and let Triton build) every graph the run will use before timing it: the prompt at its
    # real length (a 64-token warm-up left 44-49 s of first-use work in the H200 run's TTFT) and
    # `warm_steps` decode steps (quest recompiled once in mid-decode, a 52 s step).
    warm = DynamicCache(config=model.config)
    tok = step(prompt, warm).argmax(-1, keepdim=True)
    for _ in range(warm_steps):
        tok = step(tok, warm).argmax(-1, keepdim=True)
    del warm
    sync()
    compile_s = time.perf_counter() - t0

    cache = DynamicCache(config=model.config)
    if CUDA:
        torch.cuda.empty_cache()
    reset_peak()
    sync()
    t0 = time.perf_counter()
    tok = step(prompt, cache).argmax(-1, keepdim=True)
    sync()
    ttft = time.perf_counter() - t0
    peak_total = mem("max_memory_allocated")
    reset_peak()
    records, times = [], []
    for i in range(1, steps + 1):
        t1 = time.perf_counter()
        tok = step(tok, cache).argmax(-1, keepdim=True)
        sync()
        times.append(time.perf_counter() - t1)
        if i % every == 0 or i == steps:
            peak = mem("max_memory_allocated")
            peak_total = max(peak_total, peak)
            records.append(
                dict(
                    step=i,
                    cache_len=int(cache.layers[-1].keys.shape[-2]),
                    kv_bytes=cache_bytes(cache),
                    state_bytes=state_bytes(be),
                    allocated=mem("memory_allocated"),
                    peak=peak,
                    peak_total=peak_total,
                    tpot_mean=statistics.fmean(times),
                    tpot_median=statistics.median(times),
                    tpot_max=max(times),
                )
            )
            reset_peak()
            times = []
            if i % (every * 16) == 0 or i == steps:
                r = records[-1]
                log(
                    f"{policy} step {i}: KV {r['kv_bytes'] / 2**20:.1f} MiB, allocated {r['allocated'] / 2**20:.1f} "
                    f"MiB, TPOT {r['tpot_mean'] * 1e3:.2f} ms"
                )
            if time.time() > deadline:  # keep what was measured; the summary states the steps reached
                log(f"{policy}: --deadline reached at step {i} of {steps}")
                break
    return dict(policy=policy, params=params, compile_s=compile_s, ttft_s=ttft, records=records, plans=be.plans())


# -- summary --------------------------------------------------------------------------------------


def _rel_spread(vals) -> float:
    return (max(vals) - min(vals)) / min(vals) if vals and min(vals) > 0 else float("nan")


def _fit(xs, ys):
    """Least-squares slope and R^2 of ys against xs."""
    n = len(xs)
    if n < 3:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx if sxx else float("nan")
    r2 = sxy * sxy / (sxx * syy) if sxx and syy else float("nan")
    return slope, r2


def analyse(runs: dict, budget: int) -> dict:
    """Per policy: memory spread / growth after the budget is reached, TPOT early vs late."""
    out = {}
    for name, run in runs.items():
        recs = [r for r in run["records"] if r["step"] > budget + 16]  # the decode pages are full
        if not recs:
            recs = run["records"]
        kv = [r["kv_bytes"] + r["state_bytes"] for r in recs]
        steps = [r["step"] for r in recs]
        slope, r2 = _fit(steps, kv)
        q = max(1, len(recs) // 4)
        early = statistics.fmean(r["tpot_mean"] for r in recs[:q])
        late = statistics.fmean(r["tpot_mean"] for r in recs[-q:])
        out[name] = dict(
            kv_first=kv[0],
            kv_last=kv[-1],
            kv_spread=_rel_spread(kv),
            kv_slope_per_token=slope,
            kv_r2=r2,
            allocated_spread=_rel_spread([r["allocated"] for r in recs]),
            peak_spread=_rel_spread([r["peak"] for r in recs]),
            peak_max=max(r["peak_total"] for r in recs),
            tpot_early_ms=early * 1e3,
            tpot_late_ms=late * 1e3,
            tpot_late_over_early=late / early,
            tpot_mean_ms=statistics.fmean(r["tpot_mean"] for r in recs) * 1e3,
            compile_s=run["compile_s"],
            ttft_s=run["ttft_s"],
        )
    return out


def write_summary(out: Path, meta: dict, runs: dict, stats: dict) -> None:
    mib = 2**20
    reached = {p: r["records"][-1]["step"] for p, r in runs.items() if r["records"]}
    short = {p: n for p, n in reached.items() if n < (meta["steps"] or 0)}
    lines = [
        f"# RaaS memory and TPOT over {meta['steps']} decode steps ({meta['device_name']})",
        "",
        *(
            [
                "**Stopped early** (--deadline): steps reached "
                + ", ".join(f"{p} {n}" for p, n in short.items())
                + ".",
                "",
            ]
            if short
            else []
        ),
        *([meta["note"], ""] if meta.get("note") else []),
        f"Model: Llama architecture, random weights, preset `{meta['preset']}` ({meta['layers']} layers, "
        f"{meta['kv_heads']} KV heads x head_dim {meta['head_dim']}, {meta['dtype']}); prompt "
        f"{meta['prompt']} tokens; batch 1; budget {meta['budget']}; torch {meta['torch']}, transformers "
        f'{meta["transformers"]}. Records every {meta["every"]} steps; "after the budget" = steps > '
        f"budget + 16 (raas's decode pages are full).",
        "",
        "| policy | KV+state first MiB | KV+state last MiB | spread | growth B/token (R^2) | allocated spread "
        "| interval-peak spread | peak MiB | TPOT early ms | TPOT late ms | late/early |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(
            f"| {name} | {s['kv_first'] / mib:.1f} | {s['kv_last'] / mib:.1f} | {s['kv_spread'] * 100:.2f}% "
            f"| {s['kv_slope_per_token']:.0f} ({s['kv_r2']:.4f}) | {s['allocated_spread'] * 100:.2f}% "
            f"| {s['peak_spread'] * 100:.2f}% | {s['peak_max'] / mib:.1f} | {s['tpot_early_ms']:.2f} "
            f"| {s['tpot_late_ms']:.2f} | {s['tpot_late_over_early']:.2f} |"
        )
    lines += ["", "## Targets", ""]
    r, qs = stats.get("raas"), stats.get("quest")
    if r is not None:
        ok = r["kv_spread"] <= 0.01 and r["allocated_spread"] <= 0.01
        lines.append(
            f"- raas memory flat within 1% after the budget: KV+state spread {r['kv_spread'] * 100:.3f}%, "
            f"allocated spread {r['allocated_spread'] * 100:.3f}% -> **{'met' if ok else 'missed'}**"
        )
    for name in ("full", "quest"):
        s = stats.get(name)
        if s is not None:
            lines.append(
                f"- {name} grows linearly: {s['kv_slope_per_token']:.0f} bytes per token, R^2 "
                f"{s['kv_r2']:.4f}, {s['kv_first'] / mib:.1f} -> {s['kv_last'] / mib:.1f} MiB"
            )
    if r is not None:
        lines.append(
            f"- raas TPOT flat: late/early {r['tpot_late_over_early']:.3f} (early {r['tpot_early_ms']:.2f} ms, "
            f"late {r['tpot_late_ms']:.2f} ms)"
        )
    if r is not None and qs is not None:
        ok = r["tpot_late_ms"] <= qs["tpot_late_ms"] and r["tpot_mean_ms"] <= qs["tpot_mean_ms"]
        lines.append(
            f"- raas TPOT <= quest's: mean {r['tpot_mean_ms']:.2f} vs {qs['tpot_mean_ms']:.2f} ms, last "
            f"quarter {r['tpot_late_ms']:.2f} vs {qs['tpot_late_ms']:.2f} ms -> **{'met' if ok else 'missed'}**"
        )
    if meta.get("plot_note"):
        lines += ["", meta["plot_note"]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def plot(out: Path, runs: dict, budget: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed (`pip install matplotlib`, then rerun with --merge --steps 0)."
    mib = 2**20
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, run in runs.items():
        xs = [r["step"] for r in run["records"]]
        axes[0].plot(xs, [(r["kv_bytes"] + r["state_bytes"]) / mib for r in run["records"]], label=name)
        axes[1].plot(xs, [r["peak"] / mib for r in run["records"]], label=name)
        axes[2].plot(xs, [r["tpot_mean"] * 1e3 for r in run["records"]], label=name)
    for ax, title in zip(
        axes, ("KV cache + policy state (MiB)", "peak GPU memory per interval (MiB)", "TPOT (ms, interval mean)")
    ):
        ax.set_title(title)
        ax.set_xlabel("decode step")
        ax.axvline(budget, color="grey", linestyle=":", linewidth=1)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "memory_tpot.png", dpi=120)
    return None


def join_reports(files: list[Path], out: Path) -> int:
    """One report from runs measured by separate processes (the first file's metadata, noted)."""
    meta, runs = None, {}
    for f in files:
        data = json.loads(Path(f).read_text())
        meta = meta or data["meta"]
        for policy, run in data["runs"].items():
            runs.setdefault(policy, run)  # the first file that measured a policy wins
    meta["note"] = (
        f"Joined from {len(files)} processes (one policy each, bench/calls/lanes.sh lanes on one machine); "
        "compare TPOT across policies with that in mind."
    )
    out.mkdir(parents=True, exist_ok=True)
    finish(out, meta, runs)
    return 0


def finish(out: Path, meta: dict, runs: dict) -> None:
    """Analysis, plot, results.json and summary.md of the runs (ordered full, quest, raas)."""
    order = {p: i for i, p in enumerate(("full", "quest", "raas"))}
    runs = dict(sorted(runs.items(), key=lambda kv: order.get(kv[0], 9)))
    stats = analyse(runs, meta["budget"])
    meta["plot_note"] = plot(out, runs, meta["budget"])
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs, "analysis": stats}, indent=1))
    write_summary(out, meta, runs, stats)
    print((out / "summary.md").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2-135m")
    ap.add_argument("--policies", default="full,quest,raas")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16384, help="decode steps (0 with --merge: redo summary and plot)")
    ap.add_argument("--every", type=int, default=64, help="record every N steps")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--merge", action="store_true", help="keep other policies' records already in --out")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (no memory statistics)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--warm-steps", type=int, default=64, help="untimed decode steps after the untimed prefill")
    ap.add_argument(
        "--deadline",
        type=float,
        default=float("inf"),
        help="a Unix time after which decoding stops at the next record and the results are written",
    )
    ap.add_argument(
        "--report-from",
        type=Path,
        nargs="+",
        default=None,
        help="no measuring: join the runs of these results.json files (policies measured in "
        "parallel processes) into --out's results, summary and plot",
    )
    args = ap.parse_args(argv)
    if args.report_from:
        return join_reports(args.report_from, args.out)
    if args.device == "cuda" and not CUDA:
        raise SystemExit("bench_raas.py measures GPU memory and needs CUDA")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    old = json.loads(path.read_text()) if args.merge and path.exists() else {"runs": {}}
    runs = old["runs"]
    dtype = getattr(torch, args.dtype)
    model, cfg = build_model(args.preset, args.prompt + args.steps + 256, dtype, args.device)
    meta = {
        **report.environment(args.device),
        "device_name": torch.cuda.get_device_name() if CUDA else "cpu",
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "dtype": args.dtype,
        "prompt": args.prompt,
        "steps": args.steps or old.get("meta", {}).get("steps"),
        "every": args.every,
        "budget": args.budget,
        "transformers": transformers.__version__,
    }
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=gen).to(args.device)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    for policy in [p for p in args.policies.split(",") if p] if args.steps else []:
        params = {} if policy == "full" else {"budget": args.budget}
        runs[policy] = run_policy(
            model, policy, params, prompt, args.steps, args.every, log, args.deadline, args.warm_steps
        )
        path.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    finish(args.out, meta, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
