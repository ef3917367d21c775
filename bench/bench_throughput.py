"""Tokens per second at a fixed memory cap, many requests through one GPU (or two).

At a fixed memory a smaller cache per request buys a larger batch; this measures what that gives in
throughput through ``kvpass.RequestQueue`` against HF's StaticCache ``generate`` and continuous batching.

One process, one GPU, the random-weight Llama-3.1-8B shape (``--layers`` of its 32, bf16). The memory is
capped for every row alike (``torch.cuda.set_per_process_memory_fraction``: weights + ``--kv-gib`` +
``--workspace-gib``). Per kvpass configuration: ``kvpass.compile(model, policy, budget=...)``, then a
``kvpass.RequestQueue`` of ``--requests`` prompts of ``--context`` tokens, ``--new`` new tokens each (greedy,
no end token), at the largest ``max_batch`` whose rows fit ``--kv-gib`` beside the one-row staging cache the
queue prefills in (the rows' bytes are the SlotCache's own: slots, positions, policy state). A warm-up queue of
one short request compiles both graphs and records the CUDA graph on the same caches first; its seconds are
``compile_s``.

Baselines in the same process, at the largest batch whose KV fits the same ``--kv-gib``:
* ``hf_static``: ``generate`` on ``cache_implementation="static"`` (HF compiles its decode step), the requests
  in waves of that batch (prompts of one length: no padding), after one wave that compiles at the same shape;
  fewer rows where a wave's prefill (all its prompts at once) does not fit the cap;
* ``hf_continuous``: transformers' continuous batching (``generate_batch``, its paged cache sized to
  ``--kv-gib``), no compile.

Rows: ``{config, workload, context, new_tokens, requests, max_batch, tokens_per_s, decode_tokens_per_s,
peak_gib, kv_row_mib, compile_s, prefill_s, wall_s}``; ``tokens_per_s`` counts new tokens over the whole run
(prefill included), ``decode_tokens_per_s`` over the time outside prefills. cuDNN SDPA is off.

    python bench/bench_throughput.py --layers 8 --context 32768 --new 256 --requests 16 --kv-gib 4 --out t.json

Two GPUs: the model saved once by ``bench/bench_tp.py save --dir D``, then
``torchrun --nproc_per_node 2 bench/bench_throughput.py --dir D ...``: each rank loads it with transformers'
tensor-parallel plan (half the heads and half the MLP per GPU), caps its own GPU the same way (its share of the
weights + ``--kv-gib`` + ``--workspace-gib``) and runs the same queue; rank 0 writes the rows. ``--dir`` without
torchrun loads the same saved model on one GPU, for the comparison in the same job.

Results: ``bench/results/throughput_2026-11-27/``; on two GPUs, ``bench/results/tp_h200x2_2026-11-28/``
(``s57_D/P/``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from llama_shape import llama8b_config, policy_params, random_llama, uncompiled  # noqa: E402

GIB = 2**30
CUDA = torch.cuda.is_available()  # off CUDA (a smoke run with --tiny): no memory cap, no peaks


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def empty_cache() -> None:
    if CUDA:
        torch.cuda.empty_cache()


def reset_peak() -> None:
    if CUDA:
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / GIB, 2) if CUDA else 0.0


VOCAB = 100000


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter (a DTensor), or the parameter itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def prompts(n: int, length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(VOCAB // 100, VOCAB, (length,), generator=g) for _ in range(n)]


def run_requests(args, rows: int) -> int:
    """The requests a configuration runs: all of them, or ``--max-waves`` batches' worth where its batch is
    smaller. Every prompt has one length and no end token stops a request early, so the rows refill in
    lockstep and a few waves give the rate of all of them (the row's ``requests_run`` says how many ran)."""
    return args.requests if args.max_waves is None else min(args.requests, rows * args.max_waves)


def row_bytes(model, be, args) -> int:
    """The bytes of one request's row of a SlotCache under ``be``: slots, positions and the policy's state."""
    return kvpass.SlotCache(
        model, be, max_length=args.context + args.new, batch_size=1, max_new_tokens=args.new
    ).kv_bytes()


def fitting_rows(one: int, args, kv_bytes: int) -> int:
    """The batch whose rows of ``one`` byte fit ``kv_bytes`` beside the staging cache (one row more)."""
    return max(1, min(args.requests, kv_bytes // one - 1))


def kvpass_row(model, policy: str, args, kv_bytes: int) -> dict:
    params = policy_params(policy, args.budget, model.config)
    be = kvpass.compile(model, policy, prefill_compiler=args.prefill_compiler, **params)
    length = args.context + args.new
    one = row_bytes(model, be, args)
    rows = fitting_rows(one, args, kv_bytes)
    reqs = run_requests(args, rows)
    t = time.perf_counter()
    warm = kvpass.RequestQueue(model, max_batch=rows, max_length=length, max_new_tokens=args.new, eos_token_id=None)
    warm.add(prompts(1, min(512, args.context))[0], max_new_tokens=4)
    warm.run(progress=False)
    sync()
    compile_s = time.perf_counter() - t
    reset_peak()
    queue = kvpass.RequestQueue(model, max_batch=rows, max_length=length, max_new_tokens=args.new, eos_token_id=None)
    for p in prompts(reqs, args.context):
        queue.add(p, max_new_tokens=args.new)
    queue.run(progress=False)
    sync()
    s = queue.stats
    return {
        "config": policy,
        "params": params,
        "max_batch": rows,
        "requests_run": reqs,
        "tokens_per_s": s["tokens_per_s"],
        "decode_tokens_per_s": s["decode_tokens_per_s"],
        "peak_gib": peak_gib(),
        "kv_row_mib": round(one / 2**20, 1),
        "compile_s": round(compile_s, 1),
        "prefill_s": s["prefill_s"],
        "wall_s": s["wall_s"],
        "steps": s["steps"],
        "graphs": be.graph_counts(),
    }


def hf_static_row(model, args, kv_bytes: int, per_token: int) -> dict:
    rows = max(1, min(args.requests, kv_bytes // (per_token * (args.context + args.new))))

    def wave(batch):
        ids = torch.stack(batch).to(model.device)
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            cache_implementation="static",
        )

    while True:  # HF prefills a wave's prompts together: fewer rows when their prefill does not fit the cap
        try:
            t = time.perf_counter()
            wave(prompts(rows, args.context))  # compiles HF's decode step for this batch and this cache's shape
            sync()
            compile_s = time.perf_counter() - t
            reset_peak()
            reqs = prompts(run_requests(args, rows), args.context)
            t = time.perf_counter()
            made = 0
            for i in range(0, len(reqs), rows):
                made += (wave(reqs[i : i + rows]).shape[1] - args.context) * len(reqs[i : i + rows])
            sync()
            wall = time.perf_counter() - t
            break
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
            rows -= 1
            empty_cache()
    return {
        "config": "hf_static",
        "max_batch": rows,
        "requests_run": len(reqs),
        "tokens_per_s": round(made / wall, 1),
        "decode_tokens_per_s": None,
        "peak_gib": peak_gib(),
        "compile_s": round(compile_s, 1),
        "wall_s": round(wall, 3),
        "note": "waves of max_batch (the most rows whose KV fits, fewer where a wave's prefill did not fit the cap)",
    }


def hf_continuous_row(model, args, kv_bytes: int, per_token: int) -> dict:
    import inspect
    import logging

    logging.getLogger("transformers.generation.continuous_batching").setLevel(logging.INFO)  # its progress
    page = 256
    blocks = kv_bytes // (per_token * page)
    gen = tf.GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kw = {}
    if "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        fields = inspect.signature(ContinuousBatchingConfig).parameters  # the page's name moved (5.17: block_size)
        size = "page_size" if "page_size" in fields else "block_size"
        tokens = {"max_batch_tokens": 4096} if "max_batch_tokens" in fields else {}  # its logits' rows
        kw["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=blocks, **{size: page}, **tokens)
    else:  # transformers <= 5.2x: the paged cache's sizes on the generation config
        gen.num_blocks, gen.block_size, gen.max_batch_tokens = blocks, page, 4096
    fits = max(1, kv_bytes // (per_token * (args.context + args.new)))  # sequences its pages hold at once
    reqs = [p.tolist() for p in prompts(run_requests(args, fits), args.context)]
    reset_peak()
    t = time.perf_counter()
    out = model.generate_batch(reqs, generation_config=gen, **kw)
    sync()
    wall = time.perf_counter() - t
    made = sum(len(o.generated_tokens) for o in out.values())
    return {
        "config": "hf_continuous",
        "max_batch": None,
        "requests_run": len(reqs),
        "tokens_per_s": round(made / wall, 1),
        "decode_tokens_per_s": None,
        "peak_gib": peak_gib(),
        "wall_s": round(wall, 3),
        "kv_blocks": blocks,
        "page": page,
        "attn_implementation": model.config._attn_implementation,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workload", default="long_context")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--workspace-gib", type=float, default=6.0)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument(
        "--max-waves",
        type=int,
        default=None,
        help="run at most this many batches of requests per configuration (all by default)",
    )
    ap.add_argument("--policies", default="full,snapkv,pyramidkv,streamingllm,h2o,raas,quest,asl")
    ap.add_argument("--baselines", default="hf_static,hf_continuous")
    ap.add_argument("--prefill-compiler", default=None)
    ap.add_argument(
        "--stacks-after",
        type=float,
        default=None,
        help="print every thread's stack every this many seconds (where a slow baseline waits)",
    )
    ap.add_argument("--tiny", action="store_true", help="the same layout at test size (a smoke run, CPU too)")
    ap.add_argument("--dir", default=None, help="a model saved by bench/bench_tp.py save (needed under torchrun)")
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args()
    if args.stacks_after:
        faulthandler.dump_traceback_later(args.stacks_after, repeat=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    tp = "RANK" in os.environ  # under torchrun: this rank's half of a model saved with --dir
    if tp:
        if CUDA:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if CUDA else "gloo")
    if args.dir:
        from kvpass.eval.models import tensor_parallel_kwargs

        model = tf.AutoModelForCausalLM.from_pretrained(
            args.dir, dtype=torch.bfloat16 if CUDA else torch.float32, **(tensor_parallel_kwargs() if tp else {})
        ).eval()
        if not tp:
            model.to("cuda" if CUDA else "cpu")
    elif tp:
        raise SystemExit("bench_throughput.py under torchrun needs --dir (a model saved by bench/bench_tp.py save)")
    else:
        model = random_llama(
            llama8b_config(args.layers, tiny=args.tiny),
            "cuda" if CUDA else "cpu",
            torch.bfloat16 if CUDA else torch.float32,
        )
    world = dist.get_world_size() if tp else 1
    rank = dist.get_rank() if tp else 0
    model.generation_config.pad_token_id = 0
    cfg = model.config
    global VOCAB
    VOCAB = min(VOCAB, cfg.vocab_size)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 // world  # this GPU's share
    weights = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    cap = weights + (args.kv_gib + args.workspace_gib) * GIB
    if CUDA:
        dev = torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.get_device_properties(dev).total_memory))
    kv_bytes = int(args.kv_gib * GIB)
    meta = {
        "device": torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "triton": getattr(__import__("triton"), "__version__", "?"),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": args.layers,
        "shape": "Llama-3.1-8B (random weights), bf16",
        "workload": args.workload,
        "context": args.context,
        "new_tokens": args.new,
        "requests": args.requests,
        "budget": args.budget,
        "cap_gib": round(cap / GIB, 2),
        "weights_gib": round(weights / GIB, 2),
        "kv_gib": args.kv_gib,
        "workspace_gib": args.workspace_gib,
        "cudnn_sdpa": False,
        "gpus": world,
        "model": args.dir or "random_llama",
    }
    rows = []
    runs = [(p, lambda p=p: kvpass_row(model, p, args, kv_bytes)) for p in args.policies.split(",") if p]
    runs += [
        (
            b,
            {
                "hf_static": lambda: hf_static_row(model, args, kv_bytes, per_token),
                "hf_continuous": lambda: hf_continuous_row(model, args, kv_bytes, per_token),
            }[b],
        )
        for b in args.baselines.split(",")
        if b
    ]
    for name, fn in runs:
        try:
            row = fn()
        except Exception as e:  # an out-of-memory row says so and the others still run
            row = {"config": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc()
        row = {"workload": args.workload, "context": args.context, "new_tokens": args.new, **row}
        uncompiled(model)
        if CUDA:  # what the next row starts from: the weights alone, or a leak
            row["left_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 2)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row, default=str), flush=True)  # default: a kvzip row names its tokenizer object
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if tp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
