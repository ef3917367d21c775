"""Where a first compile's AOTAutograd time goes with the layers shared, one GPU, one process.

On 2026-11-28 the 32-layer decode frame's AOTAutograd took 19.5 s outside Inductor on an H200 with the
layers compiled once, against about 2 s on the CPU for 16 test-size layers. The CPU runs kvpass's reference
operators; on CUDA ``kvpass::decode_attention`` (and the other kernels) are ``triton_op``s, and torch learns
which arguments a Triton kernel writes by generating its TTIR and reading it, at every call it traces
(``triton_kernel_wrap.identify_mutated_tensors``, no cache in torch 2.11). This probe counts those calls and
their time during ``kvpass.compile`` + the first ``generate`` (2k prompt, prefill without Inductor), and with
``--memo`` answers repeated calls (same kernel, same argument kinds and values) from a memo, to measure
what such a cache would save.

Result (2026-11-28, H200, 32 layers, `full`): 0 calls, with or without the memo (55.6 / 55.8 s): the hypothesis
is refuted. AOTAutograd's 25.5 s are its metadata pass (6.9 s), fake-tensor runs of the shared subgraph (4.0 s),
Inductor (9.2 s) and its functionalized trace (``bench/results/fastpath_decode_loop_2026-11-27``, the section of
2026-11-28 04:20 UTC).
The probe stays for its compile-time breakdown (``compile_times`` in the JSON).

    python bench/probes/probe_compile.py --layers 32 --policy full [--memo] --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch._higher_order_ops.triton_kernel_wrap as tkw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvpass  # noqa: E402
from bench_fastpath import gen, prompt  # noqa: E402
from llama_shape import llama8b_config, random_llama  # noqa: E402

calls = {"n": 0, "seconds": 0.0, "memo_hits": 0}


def _kind(v):
    if isinstance(v, torch.Tensor):
        return ("T", v.dtype, v.device.type, v.dim())
    if isinstance(v, torch.SymInt):
        return ("S", v.node.hint)
    return ("V", repr(v))


def instrument(memo: bool) -> None:
    real = tkw.identify_mutated_tensors
    seen: dict = {}

    def counted(kernel, kwargs, *rest):
        key = (id(kernel), tuple(sorted((k, _kind(v)) for k, v in kwargs.items())), repr(rest))
        if memo and key in seen:
            calls["memo_hits"] += 1
            return list(seen[key])
        t = time.perf_counter()
        out = real(kernel, kwargs, *rest)
        calls["n"] += 1
        calls["seconds"] += time.perf_counter() - t
        seen[key] = list(out)
        return out

    tkw.identify_mutated_tensors = counted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--memo", action="store_true")
    ap.add_argument("--out", default="probe_compile.json")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    instrument(args.memo)
    model = random_llama(llama8b_config(args.layers), "cuda", torch.bfloat16)
    model.generation_config.pad_token_id = 0
    params = {} if args.policy in ("full", "art") else {"budget": 2048}
    t0 = time.perf_counter()
    be = kvpass.compile(model, args.policy, prefill_compiler="eager", **params)
    gen(model, prompt(2000), 32)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    row = {
        "policy": args.policy,
        "layers": args.layers,
        "memo": args.memo,
        "first_call_s": round(total, 2),
        "identify_mutated_tensors": {
            "calls": calls["n"],
            "seconds": round(calls["seconds"], 2),
            "memo_hits": calls["memo_hits"],
        },
        "shared_layers": {r.phase: r.shared_layers for r in be.reports},
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "compile_times": torch._dynamo.utils.compile_times(repr="str", aggregate=True),
    }
    print(json.dumps({k: v for k, v in row.items() if k != "compile_times"}), flush=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
