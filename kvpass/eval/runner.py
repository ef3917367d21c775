"""Run KV-cache policies over tasks and measure accuracy, KV memory and speed in one process.

Every policy in a comparison runs on the same model object, the same tasks and the same device, one
after the other, so the numbers are ratios taken in one run. Per policy:

* the model's forward is compiled with ``kvpass.backend(policy, ...)`` and ``dynamic=True``, then
  warmed up on a short prompt (prefill + decode), so compile time is reported on its own
  (``compile_s``) and never leaks into TTFT / TPOT;
* each task is a greedy generation with a fresh ``DynamicCache`` (a ``kvpass.SlotCache`` for a policy that
  selects at a SlotCache's prefill after repeat passes: kvzip): TTFT is the prefill's wall time (the passes
  included), TPOT the mean wall time of a decode step;
* ``kv_bytes`` is the size of the tensors the cache stores after the generation (what eviction
  really frees), ``peak_mem`` the device allocator's high-water mark during the task (CUDA only;
  CPU has no per-task allocator statistics, reported as None);
* ``agreement`` tasks (long decode) are teacher-forced on the ``full`` policy's continuation:
  the score is the fraction of steps whose greedy token equals it, and ``ppl`` the perplexity of
  that continuation under the policy;
* policies with ART report ``blocks_read``, the fraction of KV blocks their decode steps read
  (counted by ``kvpass::count_visits``, which adds a small cost to TPOT; ``bench/`` times the
  kernel without it).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvpass.cache.argument import with_cache
from kvpass.cache.slots import SlotCache
from kvpass.compiler.backend import backend
from kvpass.generate import reconstruct
from kvpass.policies import POLICIES, ConfigError

WARMUP_TOKENS = 48


@dataclass
class TaskResult:
    task: str
    family: str
    length: int
    depth: float | None
    score: float
    kv_bytes: int
    peak_mem: int | None
    ttft_s: float
    tpot_s: float | None
    new_tokens: int
    output: str
    ppl: float | None = None
    gated: bool = False  # the policy has a gate (asl, fastkv, ...)
    selection_layer: int | None = None  # where its prefill selected (None: it never did)

    def row(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PolicyResult:
    policy: str
    params: dict
    available: bool = True
    reason: str | None = None
    compile_s: float = 0.0
    blocks_read: float | None = None  # ART: fraction of KV blocks decode attention read
    tasks: list[TaskResult] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """The policy raised during its tasks (:meth:`Runner.run`), unlike one unavailable by
        configuration (planned, or not applicable to this model); ``tasks`` holds those done before."""
        return not self.available and (self.reason or "").startswith("failed on task")

    def summary(self) -> dict:
        """Means over tasks (None where not measured)."""

        def mean(vals):
            vals = [v for v in vals if v is not None]
            return sum(vals) / len(vals) if vals else None

        t = self.tasks
        return {
            "policy": self.policy,
            "available": self.available,
            "failed": self.failed,
            "reason": self.reason,
            "tasks": len(t),
            "accuracy": mean([r.score for r in t]),
            "kv_bytes": mean([r.kv_bytes for r in t]),
            "peak_mem": mean([r.peak_mem for r in t]),
            "ttft_s": mean([r.ttft_s for r in t]),
            "tpot_s": mean([r.tpot_s for r in t]),
            "compile_s": self.compile_s,
            "ppl": mean([r.ppl for r in t]),
            "blocks_read": self.blocks_read,
            "selection_layers": dict(
                sorted(
                    Counter(r.selection_layer for r in t if r.gated).items(), key=lambda kv: (kv[0] is None, kv[0] or 0)
                )
            ),
        }


def cache_bytes(cache) -> int:
    """Bytes of every K/V tensor a cache holds; on a ``kvpass.SlotCache`` (kvzip's), the bytes of the slots that
    hold an entry, so that it reads as a cache that grows (its empty room for later tokens is not counted)."""
    if isinstance(cache, SlotCache):
        return sum(
            int((lay.pos >= 0).sum())
            * (lay.keys.shape[-1] * lay.keys.element_size() + lay.values.shape[-1] * lay.values.element_size())
            for lay in cache.layers
        )
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def policy_params(spec: str, params: dict) -> dict:
    """The subset of ``params`` that the named policy (or any member of ``a+b``) declares."""
    declared = set()
    for name in spec.split("+"):
        cls = POLICIES.get(name.strip())
        if cls is not None:
            declared |= {p.name for p in cls.params}
    return {k: v for k, v in params.items() if k in declared}


class Runner:
    """Greedy generation through a compiled forward, with timing and memory accounting."""

    def __init__(self, model, tokenizer, device: str = "cpu") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos = tokenizer.eos_token_id

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _step(self, fwd, ids: torch.Tensor, cache) -> torch.Tensor:
        # logits of the last position only: a 128k-token prefill would otherwise materialise
        # [128k, vocab] logits, gigabytes that would dominate the peak memory being measured
        return (
            fwd(input_ids=ids, **with_cache(self.model, cache), use_cache=True, logits_to_keep=1).logits[:, -1].float()
        )

    @torch.no_grad()
    def generate(
        self,
        fwd,
        input_ids: list[int],
        max_new_tokens: int,
        forced: list[int] | None = None,
        stop_at_eos: bool = True,
        be=None,
    ):
        """Greedy decode (or teacher-forced on ``forced``) through ``fwd``, compiled with backend ``be``; returns
        tokens, timings, NLLs, cache."""
        ids = torch.tensor([input_ids], device=self.device)
        if be is not None and be.policy.needs.reconstructs:  # kvzip selects at a SlotCache's prefill only
            cache = SlotCache(
                self.model,
                be,
                max_length=len(input_ids) + max_new_tokens,
                max_new_tokens=max_new_tokens,
                device=self.device,
            )
        else:
            cache = DynamicCache(config=self.model.config)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._sync()
        t0 = time.perf_counter()
        with reconstruct.repeat_passes(self.model, be, ids, forward=fwd):  # kvzip's repeat passes, else nothing
            logits = self._step(fwd, ids, cache)
        self._sync()
        ttft = time.perf_counter() - t0
        tokens, nll, steps = [], [], []
        n = len(forced) if forced is not None else max_new_tokens
        for i in range(n):
            greedy = int(logits.argmax(-1))
            nxt = forced[i] if forced is not None else greedy
            if forced is not None:
                nll.append(float(-torch.log_softmax(logits, -1)[0, nxt]))
            tokens.append(greedy)
            if forced is None and stop_at_eos and nxt == self.eos:
                break
            if i == n - 1:
                break
            t1 = time.perf_counter()
            logits = self._step(fwd, torch.tensor([[nxt]], device=self.device), cache)
            self._sync()
            steps.append(time.perf_counter() - t1)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        tpot = sum(steps) / len(steps) if steps else None
        return tokens, ttft, tpot, nll, cache, peak

    def compile(self, spec: str, params: dict, compiler: str):
        # ART counts the blocks decode attention reads unless told not to; SABlock derives its
        # punctuation ids from the model's tokenizer (both dropped for policies that do not declare them).
        params = policy_params(spec, {"stats": True, "tokenizer": self.tokenizer, **params})
        be = backend(spec, compiler=compiler, **params)
        # Every policy compiles the same model.forward: drop the previous policy's graphs, or
        # they pile up against Dynamo's recompile limit.
        torch._dynamo.reset()
        fwd = torch.compile(self.model.forward, backend=be, fullgraph=True, dynamic=True)
        warm = list(range(10, 10 + WARMUP_TOKENS))
        t0 = time.perf_counter()
        self.generate(fwd, warm, max_new_tokens=3, be=be)
        be.runtime.visits.clear()
        return be, fwd, time.perf_counter() - t0

    def run(
        self,
        spec: str,
        params: dict,
        tasks,
        *,
        compiler: str = "inductor",
        references: dict | None = None,
        progress=None,
        done: dict | None = None,
        record=None,
    ) -> PolicyResult:
        """Run one policy over ``tasks``; ``references`` maps a task's key (``task_key``) to its full-cache tokens.
        ``done`` maps ``(policy_key, task_key)`` to a result an earlier run recorded (``--resume``): that task is
        not run again (the policy is compiled only if some task is left); ``record(policy_key, task_key, row,
        tokens, compile_s)`` is called after each task that ran."""
        from kvpass.eval.tasks import score

        result = PolicyResult(policy=spec, params=policy_params(spec, params))
        pkey, done = policy_key(spec, result.params), done or {}
        be = fwd = None
        for i, task in enumerate(tasks):
            key = task_key(task)
            saved = done.get((pkey, key))
            if saved is not None:  # recorded by an interrupted run of the same policy and task
                result.tasks.append(TaskResult(**saved["row"]))
                result.compile_s = saved.get("compile_s", result.compile_s)
                if references is not None and task.metric == "agreement" and key not in references:
                    references[key] = saved["tokens"]
                if progress is not None:
                    progress()
                continue
            if be is None:
                try:
                    be, fwd, result.compile_s = self.compile(spec, params, compiler)
                except ConfigError as e:
                    result.available, result.reason = False, str(e).removeprefix("kvpass: ")
                    for _ in range(len(tasks) - i) if progress is not None else ():  # keep the total honest
                        progress()
                    return result
            forced = None
            if task.metric == "agreement":
                forced = (references or {}).get(key)
            try:
                tokens, ttft, tpot, nll, cache, peak = self.generate(
                    fwd,
                    task.input_ids,
                    task.max_new_tokens,
                    forced=forced,
                    stop_at_eos=not task.meta.get("ignore_eos", False),
                    be=be,
                )
            except Exception as e:  # one policy failing must not cost the others their results
                first = (str(e).strip().splitlines() or [""])[0][:300]
                result.available = False
                result.reason = (
                    f"failed on task {task.name} ({len(task.input_ids)} tokens) after "
                    f"{len(result.tasks)} tasks: {type(e).__name__}: {first}"
                )
                warnings.warn(f"kvpass compare: {spec} {result.reason}", stacklevel=2)
                for _ in range(len(tasks) - i) if progress is not None else ():
                    progress()
                return result
            if task.metric == "agreement":
                if forced is None:  # this is the reference run itself
                    value, ppl = 1.0, None
                else:
                    value = sum(int(a == b) for a, b in zip(tokens, forced)) / max(1, len(forced))
                    ppl = math.exp(sum(nll) / max(1, len(nll)))
            else:
                value, ppl = score(task, self.tokenizer.decode(tokens, skip_special_tokens=True)), None
            gate = be.gate_info  # this task's prefill (gated policies), else None
            result.tasks.append(
                TaskResult(
                    task=task.name,
                    family=task.family,
                    length=len(task.input_ids),
                    depth=task.meta.get("depth"),
                    score=value,
                    kv_bytes=cache_bytes(cache),
                    peak_mem=peak,
                    ttft_s=ttft,
                    tpot_s=tpot,
                    new_tokens=len(tokens),
                    output=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    ppl=ppl,
                    gated=gate is not None,
                    selection_layer=gate["selection_layer"] if gate is not None else None,
                )
            )
            if references is not None and task.metric == "agreement" and forced is None:
                references[key] = tokens
            if record is not None:
                record(pkey, key, result.tasks[-1].row(), tokens, result.compile_s)
            if progress is not None:
                progress()
        if be is not None:
            result.blocks_read = be.runtime.blocks_read()
        return result


def task_key(task) -> str:
    """A task's identity across runs: its name, length, generation length and a digest of its prompt ids."""
    digest = hashlib.sha1(",".join(map(str, task.input_ids)).encode()).hexdigest()[:16]
    return f"{task.name}@{len(task.input_ids)}@{task.max_new_tokens}@{digest}"


def policy_key(spec: str, params: dict) -> str:
    """A policy run's identity across runs: its spec and the parameters it takes (objects by their text)."""
    return f"{spec} {json.dumps(params, sort_keys=True, default=str)}"


def compare(
    model,
    tokenizer,
    policies: list[str],
    tasks,
    params: dict | None = None,
    *,
    compiler: str = "inductor",
    device: str = "cpu",
    progress=None,
    finished=None,
    done: dict | None = None,
    record=None,
) -> list[PolicyResult]:
    """Run every policy over the same tasks; ``full`` runs first and provides the references. ``finished`` is
    called with each policy's result as it completes, so a caller interrupted mid-run keeps those; ``done`` and
    ``record`` as ``Runner.run`` takes them (a run resumed from its progress file)."""
    params = params or {}
    order = sorted(policies, key=lambda p: p != "full")
    runner = Runner(model, tokenizer, device)
    refs: dict = {}
    results = {}
    for spec in order:
        if spec != "full" and any(t.metric == "agreement" for t in tasks) and not refs:
            results["full"] = runner.run(
                "full", params, tasks, compiler=compiler, references=refs, done=done, record=record
            )
        results[spec] = runner.run(
            spec, params, tasks, compiler=compiler, references=refs, progress=progress, done=done, record=record
        )
        if finished is not None:
            finished(results[spec])
    return [results[p] for p in policies]
