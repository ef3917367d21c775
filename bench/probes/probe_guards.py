"""What Dynamo's guards cost a decode step, and what skipping them would buy, one GPU.

On a random-weight Llama-3.1-8B shape (``--layers``, bf16, batch 1) compiled by ``kvpass.compile``
(reduce-overhead, prefill without Inductor), warm, at one prompt length, per policy:

* each compiled entry's guard evaluation in microseconds (torch's ``profile_guard_manager`` over the frame's
  locals at compile time, ``--iters`` runs): every guard, and the differentiating guards alone (what
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` still runs), with the guard count;
* ``generate`` TPOT (``bench_fastpath.StepClock``) as it is, then with the whole call under that stance, and
  whether the tokens are the same. The stance is unsafe in general (a stale graph may run); this probe only
  measures what it would save.

    python bench/probes/probe_guards.py --layers 8 --length 2000 --policies full,streamingllm --out guards.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch._dynamo.guards as dynamo_guards

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from probe_host import each_policy, probe_args, save  # noqa: E402

from bench_fastpath import clocked_tpot, gen  # noqa: E402

_built: list = []  # (CheckFunctionManager, the frame's locals) of every entry compiled since the last clear


def _record_guards() -> None:
    init = dynamo_guards.CheckFunctionManager.__init__

    def recording(self, code, output_graph, *a, **kw):
        init(self, code, output_graph, *a, **kw)
        _built.append((self, dict(output_graph.local_scope)))

    dynamo_guards.CheckFunctionManager.__init__ = recording


def guard_costs(iters: int) -> list[dict]:
    rows = []
    for manager, scope in _built:
        gm = manager.guard_manager
        diff = gm.diff_guard_root
        rows.append(
            {
                "guards": len(gm.code_parts),
                "all_us": round(dynamo_guards.profile_guard_manager(gm.root, scope, iters), 1),
                "differentiating_us": None
                if diff is None
                else round(dynamo_guards.profile_guard_manager(diff, scope, iters), 1),
                "differentiating_sources": len(gm.diff_guard_sources),
            }
        )
    return rows


def main() -> None:
    ap = probe_args(128, "full,streamingllm", "guards.json")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    _record_guards()
    rows = []
    for model, policy, ids in each_policy(args):
        _built.clear()  # the entries compiled for this policy only (each_policy reset Dynamo)
        gen(model, ids, 2 * args.new)  # compiles, builds the cache, records the CUDA graphs
        row = {"policy": policy, "entries": guard_costs(args.iters)}
        tpot, skip = [], []
        for _ in range(3):  # alternated: the host's noise falls on both
            tpot.append(clocked_tpot(model, ids, args.new)[0])
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                skip.append(clocked_tpot(model, ids, args.new)[0])
        want = gen(model, ids, 32)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            got = gen(model, ids, 32)
        row.update(
            generate_tpot_ms=round(min(tpot) * 1e3, 3),
            skip_guards_tpot_ms=round(min(skip) * 1e3, 3),
            same_tokens=bool(torch.equal(want, got)),
        )
        rows.append(row)
        print(row, flush=True)
        save(args, rows)


if __name__ == "__main__":
    main()
