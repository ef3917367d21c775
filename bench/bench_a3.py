"""Time to first token of chunk fusion (a3 and its baselines) against a full prefill, and its accuracy.

Chunk fusion reuses the K/V of chunks prefilled earlier (documents of a RAG prompt) and recomputes a few of
their rows; this measures how much of a full prefill that saves and what it costs in answers.

**TTFT** (default mode). A Llama-architecture model with random weights (``--preset``: the shape of
Llama-3.1-8B by default, or Llama-3.2-1B; bf16 on CUDA) serves requests ``[S, D1 .. Dk, Q]`` of
4k, 8k, 16k and 32k tokens: ``S`` 64 tokens, ``k = length / 512`` chunks of 512 tokens, ``Q`` 32
tokens (random ids; the cost of a prefill does not depend on them). In one process and on one GPU:

* ``full``: the whole request as one prefill through ``torch.compile`` with ``kvpass.backend("full")``
  (Inductor, ``dynamic=True``), and ``hf``: the same through the uncompiled HF forward;
* every fusion policy: ``ChunkFusion.prefill`` (segments from the store's memory tier, merge with
  re-rotation, selection, recompute, last question token), chunks **warm in the store**.

Every measurement is synchronised and the median of ``--reps`` runs after one untimed warm-up per
length (compilation never counts). All fusion policies share one compiled forward (selection,
recompute and decode graphs), so the run compiles four large graphs in all, ``full`` included. Reported per
(policy, length): TTFT, its parts (load, merge, select, recompute, last token), speedup over ``full``, top-1
agreement and cosine of the first token's logits with ``full`` (random weights: a sanity check, not accuracy).

**Disk load cost**, reported separately: the memory tier is emptied and every chunk of the longest
request is read back from disk (``ChunkStore.get``: read, CRC, parse, copy to the GPU); per chunk
time and bandwidth. The files are in the OS page cache after being written (not a cold disk).

**Accuracy** (``--accuracy``): chunked multi-document QA (``kvpass.eval.tasks.chunk_qa``) on an embedded
model (``--model``, SmolLM2-135M by default): the task's system part, chunks and question go through
each policy, greedy answer, scored as the task says; ``full`` is the whole prompt through
``model.generate``.

    python bench/bench_a3.py --out bench/results/a3_h100                      # TTFT, all policies
    python bench/bench_a3.py --accuracy --lengths 2048,4096 --out bench/results/a3_accuracy

Results: ``bench/results/a3_ttft_slot_h200/`` (``before_slot_attention/`` in it) and ``a3_evict_ttft_h200/`` (TTFT),
``a3_accuracy_smollm2_cpu/`` and ``a3_evict_accuracy_smollm2_cpu/`` (``--accuracy``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402

PRESETS = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "llama3-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=4096,
    ),  # smoke tests on a CPU
}
FUSION = ("a3", "a3+evict", "cacheblend", "legolink", "pie", "full_reuse")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_llama(preset: str, device: str, dtype: torch.dtype, layers: int | None):
    shape = dict(PRESETS[preset])
    if layers:
        shape["num_hidden_layers"] = layers
    shape.setdefault("vocab_size", 128256)
    cfg = transformers.LlamaConfig(
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        **shape,
    )
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def request(length: int, chunk: int, system: int, question: int, vocab: int):
    """Deterministic random ids: the chunks of a shorter request are the first chunks of a longer one."""
    g = torch.Generator().manual_seed(1234)
    sys_ids = torch.randint(1000, vocab - 1000, (system,), generator=g).tolist()
    pool = torch.randint(1000, vocab - 1000, (65536 // chunk + 1, chunk), generator=g)
    q = torch.randint(1000, vocab - 1000, (question,), generator=g).tolist()
    return sys_ids, [pool[i].tolist() for i in range(length // chunk)], q


def timed(fn, reps: int):
    fn()  # warm-up: compiles, fills caches
    out, times = None, []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def ttft_mode(args) -> tuple[dict, list[dict], dict]:
    dev, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    model = random_llama(args.preset, dev, dtype, args.layers)
    store = kvpass.ChunkStore(
        args.store or tempfile.mkdtemp(prefix="kvpass_a3_"),
        model,
        memory_bytes=args.memory_gib << 30,
        max_bytes=args.disk_gib << 30,
    )
    lengths = [int(x) for x in args.lengths.split(",")]
    policies = args.policies.split(",")
    full_fwd = torch.compile(
        model.forward, backend=kvpass.backend("full", compiler=args.compiler), fullgraph=True, dynamic=True
    )

    def full_prefill(fwd, ids):
        with torch.no_grad():
            return (
                fwd(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
                .logits[:, -1]
                .float()
            )

    fusions = {p: kvpass.ChunkFusion(model, store, p, compiler=args.compiler) for p in policies if p in FUSION}
    rows = []
    for n in lengths:
        sys_ids, chunks, q = request(n, args.chunk, args.system, args.question, model.config.vocab_size)
        ids = torch.tensor([sys_ids + sum(chunks, []) + q], device=dev)
        t0 = time.perf_counter()
        store.put([sys_ids] + chunks)  # warm: on disk and in the memory tier
        sync()
        fill_s = time.perf_counter() - t0
        base = {}
        for name, fwd in (("full", full_fwd), ("hf", model.forward)):
            if name not in policies:
                continue
            t, logits = timed(lambda fwd=fwd: full_prefill(fwd, ids), args.reps)
            base[name] = logits
            rows.append(dict(policy=name, context=ids.shape[1], chunks=len(chunks), ttft_s=t))
            print(json.dumps(rows[-1]), flush=True)
        ref = base.get("full", base.get("hf"))
        for p, fusion in fusions.items():
            t, (logits, fused) = timed(lambda fusion=fusion: fusion.prefill(chunks, q, system=sys_ids), args.reps)
            row = dict(
                policy=p,
                context=ids.shape[1],
                chunks=len(chunks),
                ttft_s=t,
                recomputed=int(fused.recompute.numel()),
                sources=fused.sources,
                **{f"{k}_s": v for k, v in fused.timings.items()},
                store_fill_s=fill_s,
            )
            if ref is not None:
                lf = logits.float()
                row["top1_match"] = bool((lf.argmax(-1) == ref.argmax(-1)).all())
                row["logit_cos"] = float(torch.nn.functional.cosine_similarity(lf, ref, dim=-1).mean())
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            del fused
        del ids
        if dev == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        f = next((x for x in rows if x["policy"] == "full" and x["context"] == r["context"]), None)
        if f is not None:
            r["speedup_vs_full"] = f["ttft_s"] / r["ttft_s"]
    # disk load cost of one chunk (memory tier emptied; files in the OS page cache)
    store.clear(memory_only=True)
    sys_ids, chunks, q = request(max(lengths), args.chunk, args.system, args.question, model.config.vocab_size)
    before = store.stats()
    times = []
    for c in chunks:
        sync()
        t0 = time.perf_counter()
        kv = store.get(c)
        sync()
        times.append(time.perf_counter() - t0)
        assert kv is not None and kv.source == "disk"
    after = store.stats()
    nbytes = (after["loaded_bytes"] - before["loaded_bytes"]) / max(1, len(chunks))
    compute = store.stats()["compute_s"] / max(1, store.stats()["computed"])
    disk = dict(
        chunk_tokens=args.chunk,
        chunks=len(chunks),
        bytes_per_chunk=nbytes,
        load_ms_median=statistics.median(times) * 1e3,
        load_ms_mean=statistics.mean(times) * 1e3,
        read_crc_parse_ms_mean=(after["load_s"] - before["load_s"]) / len(chunks) * 1e3,
        gb_per_s=nbytes / statistics.median(times) / 1e9,
        compute_ms_per_chunk=compute * 1e3,
    )
    print(json.dumps(dict(disk=disk)), flush=True)
    cfg = model.config
    meta = dict(
        preset=args.preset,
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
    )
    return meta, rows, disk


def accuracy_mode(args) -> tuple[dict, list[dict], dict]:
    from kvpass.eval import models, tasks
    from kvpass.eval.tasks import chunk_qa

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tok = models.load(args.model, dtype=dtype, device=args.device)
    store = kvpass.ChunkStore(
        args.store or tempfile.mkdtemp(prefix="kvpass_a3_"),
        model,
        tokenizer=tok,
        memory_bytes=args.memory_gib << 30,
        max_bytes=args.disk_gib << 30,
    )
    policies = args.policies.split(",")
    fusions = {p: kvpass.ChunkFusion(model, store, p, compiler=args.compiler) for p in policies if p in FUSION}
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        for seed in range(args.seeds):
            for task in chunk_qa.generate(tok, n, seed=seed, targets=args.targets):
                ids, sp = task.input_ids, task.meta["spans"]
                system = ids[sp["system"][0] : sp["system"][1]]
                chunks = [ids[a:b] for a, b in sp["chunks"]]
                q = ids[sp["question"][0] : sp["question"][1]]
                for p in policies:
                    if p in ("full", "hf"):
                        t = torch.tensor([ids], device=args.device)
                        with torch.no_grad():
                            out = model.generate(
                                t,
                                attention_mask=torch.ones_like(t),
                                do_sample=False,
                                max_new_tokens=task.max_new_tokens,
                            )
                    elif p in fusions:
                        with torch.no_grad():
                            out = fusions[p].generate(
                                chunks, q, system=system, do_sample=False, max_new_tokens=task.max_new_tokens
                            )
                    else:
                        continue
                    text = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
                    rows.append(
                        dict(
                            policy=p,
                            context=len(ids),
                            seed=seed,
                            target=task.meta["target_chunk"],
                            score=tasks.score(task, text),
                            output=text,
                        )
                    )
                    print(json.dumps(rows[-1]), flush=True)
    return dict(model=args.model, targets=args.targets, seeds=args.seeds), rows, {}


def write(args, meta, rows, disk) -> None:
    meta.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        torch=torch.__version__,
        transformers=transformers.__version__,
        compiler=args.compiler,
        reps=args.reps,
        device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "a3_accuracy" if args.accuracy else "a3_ttft"
    (args.out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, disk=disk), indent=2))
    if args.accuracy:
        lines = [
            f"# Chunked multi-document QA: {meta['model']}, {meta['device']}, {meta['date']}",
            "",
            "| policy | context | tasks | accuracy |",
            "|---|---|---|---|",
        ]
        keys = sorted({(r["policy"], r["context"]) for r in rows}, key=lambda k: (k[1], k[0]))
        for p, n in keys:
            rs = [r["score"] for r in rows if r["policy"] == p and r["context"] == n]
            lines.append(f"| {p} | {n} | {len(rs)} | {sum(rs) / len(rs):.2f} |")
    else:
        lines = [
            f"# Chunk fusion TTFT: random-weight Llama ({meta['preset']}, {meta['layers']} layers), "
            f"{meta['device']}, {meta['date']}",
            "",
            f"torch {meta['torch']}, transformers {meta['transformers']}, {args.compiler}, median of {args.reps}. "
            f"Requests: {args.system}-token system part + 512-token chunks + {args.question}-token question; "
            "chunks warm in the store (memory tier). Speedup = full's TTFT / the policy's TTFT.",
            "",
            "| policy | context | TTFT ms | speedup | recomputed | load | merge | select | recompute | last token "
            "| top-1 = full | logit cos |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:

            def ms(k):
                return f"{r[k] * 1e3:.1f}" if k in r else "-"

            lines.append(
                f"| {r['policy']} | {r['context']} | {r['ttft_s'] * 1e3:.1f} | "
                f"{r.get('speedup_vs_full', float('nan')):.2f} | {r.get('recomputed', '-')} | {ms('load_s')} | "
                f"{ms('merge_s')} | {ms('select_s')} | {ms('recompute_s')} | {ms('last_token_s')} | "
                f"{r.get('top1_match', '-')} | {r.get('logit_cos', float('nan')):.4f} |"
            )
        if disk:
            lines += [
                "",
                "Disk load cost (memory tier emptied; files in the OS page cache): "
                f"{disk['bytes_per_chunk'] / 2**20:.1f} MiB per {disk['chunk_tokens']}-token chunk, "
                f"median {disk['load_ms_median']:.1f} ms per chunk ({disk['gb_per_s']:.2f} GB/s; read + CRC + "
                f"parse {disk['read_crc_parse_ms_mean']:.1f} ms, the rest is the copy to the device); "
                f"computing a chunk: {disk['compute_ms_per_chunk']:.1f} ms.",
            ]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    # every policy compiles model.forward with its own backend (selection, recompute and decode graphs):
    # more entries than Dynamo's default limit of 8 per code object
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 1024
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/a3"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--policies", default="full,hf,a3,cacheblend,legolink,pie,full_reuse")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--system", type=int, default=64)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--store", default=None, help="store directory (default: a fresh temporary one)")
    ap.add_argument("--memory-gib", type=int, default=24)
    ap.add_argument("--disk-gib", type=int, default=32)
    ap.add_argument("--accuracy", action="store_true", help="chunked multi-document QA instead of TTFT")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--targets", default="ends")
    args = ap.parse_args()
    meta, rows, disk = accuracy_mode(args) if args.accuracy else ttft_mode(args)
    write(args, meta, rows, disk)


if __name__ == "__main__":
    main()
