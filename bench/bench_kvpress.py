"""kvpress 0.5.5 presses on the decode-step benchmark's model and protocol, for a comparison with kvpass.

The rows sit beside ``bench_decode_step.py``'s kvpass rows: the same model, prompts and timing, with each
press run as kvpress runs it.

kvpress 0.5.5 needs transformers < 5.3 and kvpass needs >= 5.14.1, so this runs in a second process with
transformers 5.2 (and kvpress and what they need) installed from carried wheels and put first on
PYTHONPATH; it imports neither kvpass nor ``bench_decode_step`` (which imports kvpass), only the model
and bandwidth both share (``llama_shape.py``). Everything else follows ``bench_decode_step.py``: the
random-weight Llama-3.1-8B shape (``--layers`` of its 32, bf16, the same seeds), batch 1, the same
random prompt per context, cuDNN SDPA off, TTFT = the second prefill's wall time, TPOT = mean of
``--steps`` greedy steps after 8 warm-up steps, peak memory from the second prefill to the last step, KV
bytes after the last step, and the roofline from the device-to-device copy bandwidth measured in this
process (so compare ratios, or rows of this file, with the other file's rows only through the
``hf_eager`` row that both files hold).

Configurations: ``hf_eager`` (DynamicCache, SDPA: the in-process baseline) and ``kvpress:<Press>``
(e.g. ``kvpress:SnapKVPress``, ``kvpress:StreamingLLMPress``; ``@k=v`` sets a press field, as in
``kvpress:SnapKVPress@window_size=32``). A press is used as kvpress documents it and as its pipeline
does: the prompt is prefilled inside ``with press(model):`` into a DynamicCache, which the press's
forward hooks prune layer by layer to ``--budget`` tokens (compression_ratio = 1 - budget / context),
and the greedy steps then run outside the press on that cache, at positions that go on from the
prompt's length. kvpress's pipeline prefills one context and decodes one sequence: batch 1 only.
``import kvpress`` wraps transformers' attention functions (for its head-wise presses), so every row
here, ``hf_eager`` too, runs through that thin wrapper, as a kvpress user's model does.

    # the wheels in .whl/ (see the K case of bench/calls/decode_calls.sh) installed to /tmp/site:
    PYTHONPATH=/tmp/site python3 bench/bench_kvpress.py --layers 8 --contexts 32768,131072 --out kvpress.json
    python bench/bench_kvpress.py --device cpu --tiny --layers 2 --contexts 512 --budget 128 --steps 4 --out t.json

Results: ``bench/results/kvpress_h200_2026-11-26/`` (``b1_kvpress*.json``; its kvpass rows come from
``bench_decode_step.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import time
from pathlib import Path

import torch
import transformers as tf

try:
    import kvpress
    from kvpress.utils import compute_n_kept
except ImportError:  # --help works without it; a run stops in main()
    kvpress = compute_n_kept = None
from llama_shape import copy_bandwidth, llama8b_config, random_llama, sync

WARMUP = 8  # as bench_decode_step.WARMUP
PRESS_PREFIX = "kvpress:"


def cache_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    )


def cache_lengths(cache) -> list[int]:
    return [layer.keys.shape[-2] if isinstance(layer.keys, torch.Tensor) else 0 for layer in cache.layers]


def parse_value(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def press_class(name: str):
    """``kvpress:SnapKVPress@window_size=32`` -> (kvpress.SnapKVPress, {"window_size": 32}); None if none."""
    cls_name, *extra = name[len(PRESS_PREFIX) :].split("@")
    cls = getattr(kvpress, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
        return None, {}
    return cls, {k: parse_value(v) for k, v in (e.split("=", 1) for e in extra)}


def make_press(name: str, ctx: int, budget: int):
    """The press ``name`` names, set to keep ``budget`` of a ``ctx``-token prompt."""
    cls, params = press_class(name)
    ratio = max(0.0, 1.0 - budget / ctx)
    if ratio > 0 and compute_n_kept(ctx, ratio) != budget:  # int() of a product that fell just short
        ratio = 1.0 - (budget + 0.5) / ctx
    return cls(compression_ratio=ratio, **params)


def kvpress_version() -> str:
    return importlib.metadata.version("kvpress")


@torch.no_grad()
def run(model, press, ids, steps: int, device: str):
    """Two prefills (the first warms up), warm-up steps, then ``steps`` timed steps."""
    on_cuda = device.startswith("cuda")

    def prefill(cache):
        if press is None:
            return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        with press(model):
            return model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]

    def step(nxt, pos, cache):
        return model(input_ids=nxt, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]

    new_cache = lambda: tf.DynamicCache(config=model.config)  # noqa: E731
    cache = new_cache()
    prefill(cache)
    del cache
    sync(device)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    cache = new_cache()
    sync(device)
    t = time.perf_counter()
    logits = prefill(cache)
    sync(device)
    ttft = time.perf_counter() - t
    kept = cache_lengths(cache)
    nxt = logits.argmax(-1, keepdim=True)
    pos = torch.full((ids.shape[0], 1), ids.shape[1], device=device, dtype=torch.long)  # the prompt's length
    for i in range(WARMUP + steps):
        if i == WARMUP:
            sync(device)
            t = time.perf_counter()
        nxt = step(nxt, pos, cache).argmax(-1, keepdim=True)
        pos = pos + 1
    sync(device)
    tpot = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated() if on_cuda else None
    return ttft, tpot, peak, cache_bytes(cache), kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="tokens a press keeps of each prompt")
    ap.add_argument("--configs", default="hf_eager,kvpress:SnapKVPress,kvpress:StreamingLLMPress")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a test-size model (hidden 64, vocab 1024) in float32")
    args = ap.parse_args()
    if kvpress is None:
        raise SystemExit("bench_kvpress.py needs kvpress 0.5.5 importable (see this script's --help)")
    if args.batch != 1:
        ap.error(
            f"--batch {args.batch}: kvpress {kvpress_version()}'s pipeline prefills one context and decodes "
            "one sequence, and this baseline runs a press as that pipeline does: batch 1 only"
        )
    names = args.configs.split(",")
    for name in names:
        if name != "hf_eager" and not (name.startswith(PRESS_PREFIX) and press_class(name)[0] is not None):
            ap.error(f"unknown config {name!r}: hf_eager or {PRESS_PREFIX}<a press of kvpress {kvpress_version()}>")
    contexts = [int(c) for c in args.contexts.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = args.device
    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)

    cfg = llama8b_config(args.layers, args.tiny)
    model = random_llama(cfg, device, torch.float32 if args.tiny else torch.bfloat16)
    bw = copy_bandwidth(device)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    per_entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize * args.batch
    result = {
        "device": torch.cuda.get_device_name() if on_cuda else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "transformers": tf.__version__,
        "kvpress": kvpress_version(),
        "transformers_from": str(Path(tf.__file__).parent),
        "process": (
            f"a second process: kvpress {kvpress_version()} needs transformers < 5.3, so "
            f"transformers {tf.__version__} came from carried wheels ahead of the machine's "
            "own on PYTHONPATH; compare with bench_decode_step.py's rows through hf_eager"
        ),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "layers": args.layers,
        "batch": args.batch,
        "budget": args.budget,
        "steps": args.steps,
        "tiny": args.tiny,
        "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled() if on_cuda else None,
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_bytes": weights,
        "rows": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)

    for ctx in contexts:
        gen = torch.Generator(device=device).manual_seed(ctx)
        ids = torch.randint(10, min(128000, cfg.vocab_size), (args.batch, ctx), device=device, generator=gen)
        for name in names:
            t0 = time.perf_counter()
            row = {"config": name, "context": ctx}
            press = None
            try:
                if name != "hf_eager":
                    press = make_press(name, ctx, args.budget)
                    row["press"] = {"class": type(press).__name__, **dataclasses.asdict(press)}
                ttft, tpot, peak, kvb, kept = run(model, press, ids, args.steps, device)
            except Exception as e:  # a row that fails is reported, the others go on
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                if on_cuda:
                    torch.cuda.empty_cache()
                continue
            read = ctx if press is None else min(ctx, args.budget)  # entries a step reads per layer
            roof = (weights + per_entry * read) / bw
            row.update(
                {
                    "ttft_s": ttft,
                    "tpot_ms": tpot * 1e3,
                    "peak_GiB": None if peak is None else peak / 2**30,
                    "kv_GiB": kvb / 2**30,
                    "kept_tokens": sorted(set(kept)),
                    "roofline_ms": roof * 1e3,
                    "ratio": tpot / roof,
                    "wall_s": time.perf_counter() - t0,
                }
            )
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            out.write_text(json.dumps(result, indent=1))
            if on_cuda:
                torch.cuda.empty_cache()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
