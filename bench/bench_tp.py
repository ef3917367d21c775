"""kvpass policies on a model split over two GPUs (transformers' tensor parallelism) against the same model
on one GPU, in one job.

A policy must decide the same on each rank's half of the heads as on the whole model; this measures the step
time and memory per GPU on two GPUs against one, and whether the kept entries and greedy tokens agree.

A random-weight Llama-3.1-8B shape (32 layers, bf16) is saved once (``save``); ``run`` loads it whole on one
GPU, or under ``torchrun --nproc_per_node 2`` with ``tp_plan="auto"`` (each rank holds half the heads and half
the MLP), and for every policy and context prefills a random prompt on a ``kvpass.SlotCache`` (once: it
compiles; ``mode="reduce-overhead"``: decode steps replay CUDA graphs per rank), then decodes greedily. Per row:
the first call's time (prefill and compilation), TPOT (mean of ``--steps`` steps after 8 warm-up steps), peak
memory and KV bytes of each GPU, and the
decisions: a digest of the positions every (layer, KV head) holds after the last step (gathered over the ranks in
head order) and the greedy tokens. ``compare`` writes the ratios (two GPUs / one GPU) and how many digests agree.
With ``--profile`` (GPU) each row also profiles a few more steps: the device time per step by kind of kernel
(NCCL's all-reduce, kvpass's attention, matmuls, the rest), which ``compare`` lists beside the step's wall time.

    python bench/bench_tp.py save --dir /tmp/llama8b
    python bench/bench_tp.py run --dir /tmp/llama8b --out one_gpu.json
    torchrun --nproc_per_node 2 bench/bench_tp.py run --dir /tmp/llama8b --out two_gpu.json
    python bench/bench_tp.py compare one_gpu.json two_gpu.json --out tp.md

Results: ``bench/results/tp_h200x2_2026-11-26/``, ``tp_h200x2_2026-11-28/``, ``tp_h200x2_2026-11-29/`` and
``direct_steps_h200_2026-11-29/`` (one GPU, ``--generate``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpass  # noqa: E402
from bench_decode_step import PROFILE_STEPS, policy_of, profile_steps  # noqa: E402
from kvpass.generate.fastpath import compile_options  # noqa: E402
from llama_shape import copy_bandwidth, llama8b_config, random_llama  # noqa: E402

WARMUP = 8
SKIP = 4  # --generate: the steps of a call not timed (two watched before direct steps begin)
HOST_STEPS = 16  # --profile: steps under cProfile (host_profile), then as many waited for one by one (host_synced)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs a tiny smoke test of this script (gloo)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if DEV == "cuda" else 0


def save(args) -> None:
    model = random_llama(llama8b_config(args.layers, tiny=args.tiny, small=args.small), DEV, torch.bfloat16)
    t = time.perf_counter()
    model.save_pretrained(args.dir, max_shard_size="8GB")
    print(json.dumps({"saved": args.dir, "layers": args.layers, "save_s": time.perf_counter() - t}), flush=True)


def load(path: str, tp: bool):
    from kvpass.eval.models import tensor_parallel_kwargs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if tp:
            model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **tensor_parallel_kwargs())
        else:
            model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV)
    return model.eval()


def digests(cache, tp: bool) -> list[int]:
    """One number per (layer, KV head): a weighted sum of the sorted positions the head holds (-1 = empty)."""
    out = []
    for layer in cache.layers:
        pos = layer.pos.sort(dim=-1).values + 2  # [B, H_kv(local), C]
        w = torch.arange(1, pos.shape[-1] + 1, device=pos.device, dtype=torch.int64) * 1000003 % 998244353
        d = (pos * w).sum(-1).flatten(0)  # [B * H_kv]
        if tp:
            parts = [torch.empty_like(d) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, d)
            d = torch.stack(parts, 0).flatten()  # rank order = head order (batch 1)
        out += [int(x) for x in d.tolist()]
    return out


def params_of(name: str, budget: int) -> tuple[str, dict]:
    """A row's policy and its parameters: ``--budget`` for a compressing policy, and the ``@key=value`` extras."""
    policy, extra = policy_of(name)
    return policy, ({} if policy in ("full", "art") else {"budget": budget}) | extra


@torch.no_grad()
def run_one(
    model,
    name: str,
    ids,
    steps: int,
    budget: int,
    tp: bool,
    compiler: str,
    profile: bool = False,
    dynamic: bool | None = True,
) -> dict:
    policy, params = params_of(name, budget)
    torch._dynamo.reset()
    be = kvpass.backend(policy, compiler=compiler, **params)
    mode = "reduce-overhead" if compiler == "inductor" else None
    # as kvpass.compile compiles it (the mode's settings, and the guard filter for the weights' specs)
    fwd = torch.compile(model.forward, backend=be, dynamic=dynamic, options=compile_options(be, mode))
    n_new = WARMUP + steps + 2 + (PROFILE_STEPS + 3 * HOST_STEPS if profile else 0)  # the cache holds every step
    ctx = ids.shape[1]

    def new_cache():
        return kvpass.SlotCache(model, be, max_length=ctx + n_new, max_new_tokens=n_new)

    def prefill(cache):
        return fwd(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    # one prefill (a 32-layer prefill of 128k tokens takes seconds): its time includes compiling both graphs'
    # first use, so it is reported as the first call, not as TTFT; the peak counts the device's memory only
    sync()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cache = new_cache()
    if tp:
        dist.barrier()
    sync()
    t = time.perf_counter()
    logits = prefill(cache)
    sync()
    ttft = time.perf_counter() - t
    nxt = logits.argmax(-1, keepdim=True)
    pos = torch.full((1, 1), ctx, device=DEV, dtype=torch.long)
    tokens = [nxt]
    host = 0.0  # the host's own time per step (the call returns once its work is queued): near TPOT, host-bound
    for i in range(WARMUP + steps):
        if i == WARMUP:
            sync()
            t = time.perf_counter()
        h = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        nxt = (
            fwd(input_ids=nxt, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
            .logits[:, -1]
            .argmax(-1, keepdim=True)
        )
        host += (time.perf_counter() - h) if i >= WARMUP else 0.0
        tokens.append(nxt)
        pos = pos + 1
    sync()
    tpot = (time.perf_counter() - t) / steps
    kernels = None
    if profile and DEV == "cuda":  # PROFILE_STEPS more steps under torch.profiler (CUDA-graph replays included)

        def step(nxt, pos, cache):
            torch.compiler.cudagraph_mark_step_begin()
            return fwd(input_ids=nxt, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
                :, -1
            ]

        kernels = profile_steps(step, nxt, pos, cache, top=1000)
        host_top = host_profile(step, nxt, pos, cache)
        host_sync = host_synced(step, nxt, pos, cache)
        spans = dynamo_spans(step, nxt, pos, cache)
    row = {
        "config": name,
        "context": ctx,
        "first_call_s": ttft,
        "tpot_ms": tpot * 1e3,
        "host_ms": host / steps * 1e3,
        "peak_GiB": peak_bytes() / 2**30,
        "kv_GiB": cache.kv_bytes() / 2**30,
        "tokens": torch.cat(tokens, 1)[0].tolist(),
        "digests": digests(cache, tp),
        "graphs": [(r.phase, r.cudagraphs) for r in be.reports],
        "plans": be.plans(),
        "tp": sorted({r.tp for r in be.reports}),
        "reductions": sorted({x for r in be.reports for x in r.reductions}),
    }
    if kernels is not None:
        row["kernels"], row["device_ms_by_kind"], row["host_top"] = kernels[:25], kinds_of(kernels), host_top
        row["host_synced_ms"], row["dynamo_spans_ms"] = host_sync, spans
    if be.gate_info:
        row["gate"] = {k: be.gate_info[k] for k in ("selection_layer", "kept")}
    if tp:  # every rank's peak and KV bytes, TPOT and host time (rank 0's NCCL kernels include its wait for rank 1)
        mine = torch.tensor(
            [row["peak_GiB"], row["kv_GiB"], row["tpot_ms"], row["host_ms"], row.get("host_synced_ms", -1.0)],
            device=DEV,
            dtype=torch.float64,
        )
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        for k, name in enumerate(("peak_GiB", "kv_GiB", "tpot_ms", "host_ms", "host_synced_ms")):
            row[f"{name}_per_rank"] = [float(p[k]) for p in parts]
    return row


def generate_tpot(model, name: str, ids, budget: int, new: int, tp: bool, compiler: str) -> dict:
    """The user's TPOT: ``model.generate`` through ``kvpass.compile`` (its decoding loop, which reads each step's
    finished flag one step late, and HF's input preparation per step), greedy, with no end token, ``new`` tokens
    a call. A call's steps are timed on the host's clock at each step (``bench_fastpath.StepClock``, prefill and
    the first ``SKIP`` steps excluded: the difference of two calls' wall times carried the prefill's noise, 0.23 ms
    a step at 128k over 64 steps on one H200, 2026-11-29). After one call that compiles, two rounds of a usual call
    and one with ``direct_steps`` (the decode graph called without Dynamo's frame once two steps agree; the same
    compiled graphs), alternated so that drift hits both; each is reported as the lower of its two. The model is
    given back uncompiled afterwards."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    from bench_fastpath import StepClock

    policy, params = params_of(name, budget)
    torch._dynamo.reset()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # a random model's end token must not stop a call early
    be = kvpass.compile(model, policy, compiler=compiler, **params)

    def clocked() -> float:
        if tp:
            dist.barrier()
        clock = StepClock()
        sync()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, stopping_criteria=StoppingCriteriaList([clock]))
        sync()
        assert out.shape[1] == ids.shape[1] + new, f"generate stopped early: {out.shape[1] - ids.shape[1]} of {new}"
        return clock.tpot(skip=SKIP) * 1e3

    try:
        t = time.perf_counter()
        clocked()
        first = time.perf_counter() - t
        rounds = {False: [], True: []}
        for _ in range(2):
            for direct in (False, True):
                be.direct_steps = direct
                rounds[direct].append(clocked())
        steps = be.last_direct_steps
    finally:
        del model.forward, model.generate  # kvpass.compile set both on the instance
        model.generation_config.eos_token_id = eos
    return {
        "generate_tpot_ms": min(rounds[False]),
        "generate_direct_tpot_ms": min(rounds[True]),
        "generate_rounds_ms": {"usual": rounds[False], "direct": rounds[True]},
        "generate_direct": repr(steps),
        "generate_new": new,
        "generate_first_s": first,
        "generate_peak_GiB": peak_bytes() / 2**30,
        "generate_graphs": be.graph_counts(),
    }


def host_synced(step, nxt, pos, cache, n: int = HOST_STEPS) -> float:
    """The host's time per call in ms over ``n`` more steps, each one waited for before the next (no queue to
    wait on: the host's own work, where ``host_ms`` of queued steps also counts waiting for room to queue)."""
    total = 0.0
    for i in range(n):
        sync()
        h = time.perf_counter()
        step(nxt, pos + PROFILE_STEPS + HOST_STEPS + i, cache)
        total += time.perf_counter() - h
    sync()
    return total / n * 1e3


def dynamo_spans(step, nxt, pos, cache, n: int = HOST_STEPS) -> dict:
    """The host's ms per step in Dynamo's own profiler spans over ``n`` more steps, each waited for: "TorchDynamo
    Cache Lookup" (the frame's guards, evaluated in C++ where cProfile cannot see them) and the compiled region
    (everything the compiled code does, the replay included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(n):
            step(nxt, pos + PROFILE_STEPS + 2 * HOST_STEPS + i, cache)
            sync()
    return {
        e.key: e.cpu_time_total / n / 1e3
        for e in prof.key_averages()
        if "Dynamo" in e.key or "Compiled Region" in e.key
    }


def host_profile(step, nxt, pos, cache, n: int = HOST_STEPS, top: int = 30) -> list[str]:
    """cProfile of ``n`` more steps (host only; each step waits for the device, so the device's time shows as
    the wait): the ``top`` functions by own time, as lines "ms per step, calls per step, function"."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for i in range(n):
        step(nxt, pos + PROFILE_STEPS + i, cache)
        sync()
    pr.disable()
    stats = pstats.Stats(pr).stats  # {(file, line, name): (calls, primitive calls, own time, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        f"{own / n * 1e3:.3f} ms  {calls / n:g}x  {Path(f).name}:{line}({fn})  cum {cum / n * 1e3:.3f}"
        for (f, line, fn), (calls, _, own, cum, _) in rows
    ]


KINDS = (
    ("all_reduce (NCCL, one-shot)", ("nccl", "all_reduce", "allreduce")),
    ("attention (kvpass)", ("decode_attention", "kvpass")),
    ("matmul", ("gemm", "gemv", "cutlass", "nvjet", "sm90", "splitk")),
)


def kinds_of(kernels: list) -> dict:
    """A profile's device time per step (ms) by kind of kernel: NCCL's all-reduce, kvpass's attention kernels,
    matrix multiplies, the rest (Inductor's fused elementwise kernels, copies); ``kernels[0]`` is the total, the
    others every kernel of the profile. Kernel time on two GPUs overlaps nothing, so ``all kernels`` against the
    step's wall time is the device's idle share."""
    out = {name: 0.0 for name, _ in KINDS} | {"other": 0.0}
    for k in kernels[1:]:
        name = k["kernel"].lower()
        kind = next((n for n, keys in KINDS if any(x in name for x in keys)), "other")
        out[kind] += k["us_per_step"] / 1e3
    out["all kernels"] = kernels[0]["us_per_step"] / 1e3
    return out


def run(args) -> None:
    tp = "RANK" in os.environ
    if tp:
        if DEV == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo")
    rank = dist.get_rank() if tp else 0
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    t = time.perf_counter()
    model = load(args.dir, tp)
    if tp and args.one_shot:  # Inductor lowers small all_reduces to symmetric memory's one-shot (P2P, no multicast)
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        from torch.distributed.tensor import DTensor

        mesh = next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh
        enable_symm_mem_for_group(mesh.get_group().group_name)
        torch._inductor.config._collective.auto_select = True
    if args.blas:  # which BLAS library ATen's mm calls (cuBLAS picks split-K kernels for a rank's half-width GEMVs)
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.mm_autotune:  # Inductor times its Triton mm templates against ATen's per shape and keeps the faster
        torch._inductor.config.max_autotune_gemm = True
        torch._inductor.config.max_autotune_gemm_backends = "ATEN,TRITON"
    result = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else platform.processor() or "cpu",
        "gpus": dist.get_world_size() if tp else 1,
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": model.config.num_hidden_layers,
        "budget": args.budget,
        "steps": args.steps,
        "load_s": time.perf_counter() - t,
        "copy_bandwidth_GBps": copy_bandwidth(DEV) / 1e9,
        "compiler": args.compiler,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "one_shot_all_reduce": bool(args.one_shot),
        "static_batch": bool(args.static_batch),
        "blas": str(torch.backends.cuda.preferred_blas_library()),
        "mm_autotune": bool(args.mm_autotune),
        "rows": [],
    }
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for ctx in (int(c) for c in args.contexts.split(",")):
        vocab = model.config.vocab_size
        ids = torch.randint(10, vocab, (1, ctx), device=DEV, generator=torch.Generator(device=DEV).manual_seed(ctx))
        for name in args.configs.split(","):
            t0 = time.perf_counter()
            try:
                row = run_one(
                    model,
                    name,
                    ids,
                    args.steps,
                    args.budget,
                    tp,
                    args.compiler,
                    args.profile,
                    None if args.static_batch else True,
                )
                if args.generate:
                    if DEV == "cuda":
                        torch.cuda.empty_cache()
                    row |= generate_tpot(model, name, ids, args.budget, args.generate, tp, args.compiler)
            except Exception as e:  # a failed row is reported, the others go on
                row = {"config": name, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:600]}"}
            row["wall_s"] = time.perf_counter() - t0
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "digests")}), flush=True)
                result["rows"].append(row)
                Path(args.out).write_text(json.dumps(result, indent=1))
            if DEV == "cuda":
                torch.cuda.empty_cache()
    if tp:
        dist.barrier()
        dist.destroy_process_group()


def compare(args) -> None:
    one, two = (json.loads(Path(p).read_text()) for p in (args.one, args.two))
    key = lambda r: (r["config"], r["context"])  # noqa: E731
    base = {key(r): r for r in one["rows"] if "error" not in r}
    lines = [
        f"# Tensor parallelism: {two['gpus']} x {two['device']} against 1 GPU ({one['device']})",
        "",
        f"{one['layers']} layers, Llama-3.1-8B shape, bf16, batch 1, budget {one['budget']}, kvpass.SlotCache, "
        f"reduce-overhead; torch {two['torch']}, transformers {two['transformers']}; {two['date']}; "
        f"NCCL_NVLS_ENABLE={two.get('nccl_nvls_enable')}",
        "",
        "| policy | context | TPOT 1 GPU ms | TPOT 2 GPUs ms | ratio | KV GiB 1 GPU | KV GiB per GPU (2) | "
        "peak GiB 1 GPU | peak GiB per GPU (2) | first call 1 / 2 s | digests equal | tokens equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for r in two["rows"]:
        b = base.get(key(r))
        if "error" in r or b is None:
            lines.append(f"| {r['config']} | {r['context']} | {(r.get('error') or 'no 1-GPU row')[:300]} |" + " |" * 9)
            continue
        same = sum(x == y for x, y in zip(b["digests"], r["digests"]))
        toks = sum(x == y for x, y in zip(b["tokens"], r["tokens"]))
        ratio = r["tpot_ms"] / b["tpot_ms"]
        lines.append(
            f"| {r['config']} | {r['context']} | {b['tpot_ms']:.3f} | {r['tpot_ms']:.3f} | {ratio:.2f} | "
            f"{b['kv_GiB']:.2f} | {' / '.join(f'{x:.2f}' for x in r['kv_GiB_per_rank'])} | "
            f"{b['peak_GiB']:.1f} | {' / '.join(f'{x:.1f}' for x in r['peak_GiB_per_rank'])} | "
            f"{b['first_call_s']:.1f} / {r['first_call_s']:.1f} | {same}/{len(b['digests'])} | "
            f"{toks}/{len(b['tokens'])} |"
        )
        summary.append(
            {
                "config": r["config"],
                "context": r["context"],
                "tpot_ratio": ratio,
                "kv_ratio_per_gpu": max(r["kv_GiB_per_rank"]) / b["kv_GiB"],
                "digests_equal": same / len(b["digests"]),
                "tokens_equal": toks / len(b["tokens"]),
            }
        )
        if "generate_tpot_ms" in r and "generate_tpot_ms" in b:
            summary[-1]["generate_tpot_ratio"] = r["generate_tpot_ms"] / b["generate_tpot_ms"]
            summary[-1]["generate_direct_tpot_ratio"] = r["generate_direct_tpot_ms"] / b["generate_direct_tpot_ms"]
    users = [
        (r, base[key(r)]) for r in two["rows"] if "generate_tpot_ms" in r and "generate_tpot_ms" in base.get(key(r), {})
    ]
    if users:  # --generate: a decode step as model.generate through kvpass.compile pays it
        lines += [
            "",
            "TPOT of `model.generate` through `kvpass.compile` (`--generate`: the user's step, HF's input "
            "preparation and kvpass's decoding loop included), beside the queued step above:",
            "",
            "| policy | context | steps | generate TPOT 1 GPU ms | 2 GPUs ms | ratio | queued step 1 GPU / 2 GPUs ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r, b in users:
            for kind, k in (("usual", "generate_tpot_ms"), ("direct", "generate_direct_tpot_ms")):
                lines.append(
                    f"| {r['config']} | {r['context']} | {kind} | {b[k]:.3f} | {r[k]:.3f} | {r[k] / b[k]:.2f} | "
                    f"{b['tpot_ms']:.3f} / {r['tpot_ms']:.3f} |"
                )
    profiled = [
        (r, base[key(r)])
        for r in two["rows"]
        if "device_ms_by_kind" in r and "device_ms_by_kind" in base.get(key(r), {})
    ]
    if profiled:  # --profile: device time per step by kind of kernel, one GPU against rank 0 of two
        lines += [
            "",
            "Device time per step (ms) by kind of kernel (`--profile`; two GPUs: rank 0), beside the step:",
            "",
            "| policy | context | kind | 1 GPU | 2 GPUs |",
            "|---|---|---|---|---|",
        ]
        for r, b in profiled:
            for kind, ms in r["device_ms_by_kind"].items():
                lines.append(
                    f"| {r['config']} | {r['context']} | {kind} | {b['device_ms_by_kind'][kind]:.3f} | {ms:.3f} |"
                )
            lines.append(f"| {r['config']} | {r['context']} | step (wall) | {b['tpot_ms']:.3f} | {r['tpot_ms']:.3f} |")
            if "host_ms" in r and "host_ms" in b:
                ranks = " / ".join(f"{x:.3f}" for x in r.get("host_ms_per_rank", []))
                lines.append(
                    f"| {r['config']} | {r['context']} | host per step | {b['host_ms']:.3f} | {r['host_ms']:.3f}"
                    f"{f' (ranks: {ranks})' if ranks else ''} |"
                )
            if "host_synced_ms" in r and "host_synced_ms" in b:
                lines.append(
                    f"| {r['config']} | {r['context']} | host per step, each step waited for | "
                    f"{b['host_synced_ms']:.3f} | {r['host_synced_ms']:.3f} |"
                )
            for span in sorted(set(b.get("dynamo_spans_ms", {})) & set(r.get("dynamo_spans_ms", {}))):
                lines.append(
                    f'| {r["config"]} | {r["context"]} | host in "{span}" | '
                    f"{b['dynamo_spans_ms'][span]:.3f} | {r['dynamo_spans_ms'][span]:.3f} |"
                )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(summary))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--dir", required=True)
    s.add_argument("--layers", type=int, default=32)
    s.add_argument("--tiny", action="store_true", help="the same layout at test size (a CPU smoke test)")
    s.add_argument(
        "--small",
        action="store_true",
        help="SmolLM2-135M's widths (30 layers with --layers 30): on one GPU a step the host can outlast",
    )
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--contexts", default="131072,32768")
    r.add_argument("--configs", default="full,snapkv,raas,asl@layer=8")
    r.add_argument("--steps", type=int, default=64)
    r.add_argument("--budget", type=int, default=2048)
    r.add_argument("--out", required=True)
    r.add_argument("--compiler", default="inductor", help="eager: the CPU smoke test")
    r.add_argument(
        "--one-shot",
        action="store_true",
        help="two GPUs: let Inductor lower the decode step's small all_reduces to symmetric memory's "
        "one-shot all-reduce (torch._inductor.config._collective.auto_select); needs --static-batch",
    )
    r.add_argument(
        "--static-batch",
        action="store_true",
        help="torch.compile(dynamic=None): the batch stays static (the slots' capacity is symbolic either "
        "way); Inductor's one-shot lowering compares the all-reduce's size with a threshold and failed "
        "on a symbolic batch (torch 2.11, 2026-11-28)",
    )
    r.add_argument(
        "--blas",
        choices=("cublas", "cublaslt"),
        default=None,
        help="torch.backends.cuda.preferred_blas_library for ATen's matmuls (default: torch's choice)",
    )
    r.add_argument(
        "--mm-autotune",
        action="store_true",
        help="Inductor's max_autotune_gemm with Triton templates beside ATen (longer compile)",
    )
    r.add_argument(
        "--generate",
        type=int,
        default=None,
        metavar="NEW",
        help="also time model.generate through kvpass.compile, NEW tokens a call, usual and with "
        "direct_steps (the user's TPOT on the host's clock at each step; compiles the policy once more)",
    )
    r.add_argument(
        "--profile",
        action="store_true",
        help="on a GPU: a kernel table of a few more steps per row and its device time by kind "
        "(all-reduce, attention, matmul, other), to see where a two-GPU step loses",
    )
    c = sub.add_parser("compare")
    c.add_argument("one")
    c.add_argument("two")
    c.add_argument("--out", required=True)
    args = ap.parse_args()
    {"save": save, "run": run, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
