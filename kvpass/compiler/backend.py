"""The kvpass ``torch.compile`` backend: detect -> plan -> rewrite -> inner compiler.

    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy="streamingllm", budget=512))

The whole pipeline is ``KVPass.__call__`` below; the pieces live in ``detect``, the policy's
``plan``, ``rewrite`` and ``ops`` / ``lowerings``.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch
from torch import fx

from kvpass import ops as _ops  # noqa: F401  (registers torch.ops.kvpass.*)
from kvpass import settings as _settings
from kvpass.cache import runtime as _runtime
from kvpass.cache import slots as _cache
from kvpass.compiler import cuts as _cuts
from kvpass.compiler import detect as _detect
from kvpass.compiler import gate as _gate
from kvpass.compiler import holds as _holds
from kvpass.compiler import layers as _layers
from kvpass.compiler import local_weights as _local_weights
from kvpass.compiler import plan as _plan
from kvpass.compiler import positions as _positions
from kvpass.compiler import rewrite as _rewrite
from kvpass.compiler import tp as _tp
from kvpass.compiler.maskcheck import mask_is_read
from kvpass.compiler.recording import recorded
from kvpass.errors import ConfigError, SlotCacheUnrewritten, warn_once
from kvpass.ops import lowerings as _lowerings  # noqa: F401  (device implementations)
from kvpass.policies import Policy, Refusal, SitePlan, make_policy

try:  # Inductor's base class for custom passes: uuid() keys its caches
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover
    CustomGraphPass = object

COMPILERS = ("inductor", "aot_eager", "eager")


@dataclass
class GraphReport:
    """What the pass did to one compiled graph."""

    phase: str
    sites: list[dict]
    plans: dict[int, str]
    problems: list[str]
    rewritten: int = 0
    evicting: list[int] = field(default_factory=list)
    appending: list[int] = field(default_factory=list)  # sites left to the model's cache update (SitePlan.append)
    positions_fixed: list[str] = field(default_factory=list)
    gate: _gate.GatedGraph | None = None  # the prefill runs split at the gates (ASL, FastKV)
    slots: list[int] = field(default_factory=list)  # kvpass.SlotCache sites (kvpass.cache.slots)
    cudagraphs: bool = False  # compiled with Inductor's CUDA graphs (mode="reduce-overhead")
    tp: str = ""  # tensor parallel: this rank's share of the heads (kvpass.compiler.tp)
    reductions: list[str] = field(default_factory=list)  # collectives the pass inserted (decisions across heads)
    reads_mask: bool = True  # the graph reads the model's attention mask (maskcheck.mask_is_read)
    shared_layers: int = 0  # decoder layers compiled once and called per layer (kvpass.compiler.layers)
    # where the first DynamicCache layer's stored keys enter and leave the graph (kvpass.compiler.holds)
    holds: tuple[int | None, int] | None = None
    cuts: list[_cuts.CutPoint] = field(default_factory=list)  # SlotCache cuts between decode steps


def _runtime_op(node: fx.Node) -> bool:
    """A kvpass operator that calls back into a policy's Python runtime (it takes a ``handle``)."""
    t = node.target
    return (
        node.op == "call_function"
        and isinstance(t, torch._ops.OpOverload)
        and t.namespace == "kvpass"
        and any(a.name == "handle" for a in t._schema.arguments)
    )


def mark_cacheable(gm: fx.GraphModule, key: str) -> None:
    """Let AOTAutograd's cache keep a graph that calls kvpass's own tensor functions (``write_slots``, a
    policy's ``SlotHooks``). It refuses any Python function it does not know (a second process then traced
    a 32-layer decode graph again: 30 s); torch's ``unsafe_marked_cacheable_functions`` names the ones a
    caller vouches for, with a string that joins the cache key: here kvpass's pass key (``KVPass.uuid``,
    which hashes the policy, the compiler's, ops' and cache's sources) and the function's own source.
    Process-wide, as the setting is (``kvpass.settings.mark_cacheable``); it names kvpass functions only."""
    for node in gm.graph.nodes:
        fn = node.target
        if node.op == "call_function" and inspect.isfunction(fn) and fn.__module__.startswith("kvpass."):
            _settings.mark_cacheable(fn, key)


def _phase(found: _detect.Detection) -> str:
    if not found.sites:
        return "none"
    s = found.sites[0]
    if s.cache == "slot":  # a SlotCache prefill attends over the new K/V, later calls over the slots
        if s.k is s.k_new:
            return "prefill"
        return "decode" if s.q_len == 1 else "append"
    past = _detect.val(s.k_past)
    if s.k_past is not None and isinstance(past, torch.Tensor) and past.numel() == 0:
        return "prefill"
    q_len = s.q_len
    if isinstance(q_len, int):
        if s.k_past is None and s.cache != "static":
            return "prefill"
        return "decode" if q_len == 1 else "append"
    return "dynamic"


class KVPass(CustomGraphPass):
    """The graph pass: rewrites a Dynamo FX graph in place for one policy."""

    def __init__(self, policy: Policy, rt: _runtime.Runtime, compile_segment=None) -> None:
        self.policy = policy
        self.runtime = rt
        self.compile_segment = compile_segment  # compiles one segment of a gated graph (kvpass.compiler.gate)

    def __call__(self, graph: fx.Graph) -> GraphReport:
        """The passes, in order; each fills its part of the report, and the first problem stops the rewrite
        (the graph compiles unchanged, the reason warned once)."""
        gm = graph.owning_module
        found = _detect.detect(gm)  # 1. sites: attention + cache update
        if foreign := _plan.foreign_cache(self.policy, found.sites):
            raise ConfigError(foreign)  #    a cache filled by another policy
        report = GraphReport(phase=_phase(found), sites=[], plans={}, problems=[str(p) for p in found.problems])
        tp = self._tensor_parallel(gm, found, report)  # 2. the rank's share of the heads
        plans = self._plan(found, tp, report)  # 3. policy.plan per site -> SitePlan
        report.sites = [s.row() for s in found.sites]
        gates = self.policy.needs.gates and report.phase == "prefill"
        if gates and not report.problems and (why := _gate.check(found.sites, self.policy)):
            report.problems.append(f"policy '{self.policy.name}' (gate): {why}")  # 4. can the gate be placed
        self._follow_prefill(report.phase, report.problems)  # 5. decode follows an unchanged prefill
        if not found.sites and not report.problems and self.policy.name != "full":  # nothing to apply it to: said
            warn_once(
                f"kvpass: a compiled graph has no attention site: policy "  # once per backend
                f"'{self.policy.name}' does nothing in it. A model without attention (a state-space model) "
                f"is not changed by kvpass; where the model's forward breaks into several graphs, its attention "
                f"may be in another one (kvpass.explain shows what each graph holds)",
                self,
            )
        cuts = _cuts.points(gm, found.sites, plans) if report.phase == "decode" and not report.problems else []
        if isinstance(cuts, str):  #    the cuts between decode steps need the slots as inputs
            report.problems.append(cuts)
        if report.problems:
            if any(map(_detect.is_slot_append, gm.graph.nodes)):  # a SlotCache: only kvpass's attention reads it
                raise SlotCacheUnrewritten(report.problems[0])
            warn_once(
                f"kvpass: compiling a graph unchanged ({len(found.sites)} attention sites found): {report.problems[0]}",
                self,
            )
            return report
        report.holds, report.cuts = _holds.holds(gm, found.sites), cuts  # (before the rewrite replaces them)
        self._rewrite(gm, found, plans, report)  # 6. REWRITES[plan.rewrite_kind] per site
        if self.policy.needs.renumber and report.phase != "prefill":  # 7. a renumbering gate's positions
            report.positions_fixed += (
                _positions.shift_slot_positions(gm, found.sites)
                if report.slots
                else _positions.shift_passed_positions(gm, found.sites, self.runtime.handle)
            )
        if gates:
            self._gate(gm, found, report)  # 8. split the prefill at the gates
        return report

    def _tensor_parallel(self, gm, found, report: GraphReport):
        """``TensorParallel`` when the graph is one rank of a head-split model, else None (a problem when the
        split is one kvpass cannot follow); ``report.tp`` says the rank's share."""
        tp = None if report.problems else _tp.find(gm, found.sites)
        if isinstance(tp, str):
            report.problems.append(tp)
            return None
        if isinstance(tp, _tp.TensorParallel):
            report.tp = tp.describe(found.sites[0].heads, found.sites[0].kv_heads)
        return tp

    def _plan(self, found, tp, report: GraphReport) -> dict[int, SitePlan]:
        """The policy's plan of every site (``report.plans`` in words); the first site it refuses is the
        graph's problem."""
        plans: dict[int, SitePlan] = {}
        if report.problems:
            return plans
        for site in found.sites:
            site.phase, site.tp = report.phase, tp
        if whole := self.policy.graph_refusal(found.sites):
            report.problems.append(f"policy '{self.policy.name}': {whole}")
            return plans
        if idle := self.policy.idle_reason(found.sites):
            warn_once(f"kvpass: {idle}", self)
        for site in found.sites:
            plan = _plan.plan_site(self.policy, site)
            if isinstance(plan, Refusal):
                report.problems.append(f"policy '{self.policy.name}': {plan.reason}")
                return {}
            plans[site.layer] = plan
            report.plans[site.layer] = plan.describe(report.phase)
        self.runtime.add_graph(found.sites)  # the keys this graph's operators name their sites by
        return plans

    def _rewrite(self, gm, found, plans: dict[int, SitePlan], report: GraphReport) -> None:
        done = _rewrite.rewrite(gm, found, plans, self.runtime.handle)
        report.rewritten = done.rewritten
        report.evicting = done.evicting
        report.appending = done.appending
        report.positions_fixed = done.positions_fixed
        report.slots = done.slots
        report.reductions = done.reductions

    def _gate(self, gm, found, report: GraphReport) -> None:
        """A gated prefill's runner (``report.gate``); after the rewrite, a gate that cannot be built leaves the
        graph evicting but computing every token, said once."""
        gated = _gate.plan(gm, found.sites, self.policy, self.runtime, self.compile_segment)
        if isinstance(gated, str):
            warn_once(
                f"kvpass: policy '{self.policy.name}': the gate is not applied, the prefill computes "
                f"every token in every layer: {gated}",
                self,
            )
            return
        report.gate = gated
        report.reductions += gated.reductions
        for layer in gated.cuts:
            report.plans[layer] += " + gate candidate"

    def _follow_prefill(self, phase: str, problems: list[str]) -> None:
        """Decode steps follow their prefill: when a prefill graph of an evicting policy was compiled unchanged,
        its decode and append graphs are too (they read positions and state only a rewritten prefill records;
        rewritten over an unchanged prefill's cache they were wrong without a word)."""
        if phase == "prefill":
            self.runtime.unchanged_prefill = problems[0] if problems else ""
        elif (
            phase in ("decode", "append")
            and not problems
            and self.runtime.unchanged_prefill
            and self.policy.needs.evicts
        ):
            problems.append(
                f"the prefill graph was compiled unchanged ({self.runtime.unchanged_prefill}), so "
                f"its {phase} steps run unchanged too"
            )

    def uuid(self) -> str:
        h = hashlib.sha256(self.policy.uuid().encode())
        for mod in (_detect, _plan, _rewrite, _ops, _runtime, _gate, _cache, _tp):
            h.update(inspect.getsource(mod).encode())
        return h.hexdigest()


def _module_being_compiled():
    """The ``model`` argument of the ``torch.compile`` call on the stack, or None (read from its frame:
    torch hands a backend nothing else; anything unexpected reads as None)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "compile" and frame.f_globals.get("__name__") == "torch":
            model = frame.f_locals.get("model")
            return model if isinstance(model, torch.nn.Module) else None
        frame = frame.f_back
    return None


def _cache_entries() -> int | None:
    """Dynamo's cached entries of the frame it is compiling (None where its internals do not say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return len(_debug_get_cache_entry_list(tx.f_code)) if tx is not None else None
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return None


def _recompile_reason() -> str | None:
    """Dynamo's reason for the recompile under way (the first failed guard), where this torch records it."""
    try:
        from torch._dynamo.utils import get_metrics_context

        reason = get_metrics_context()._metrics.get("recompile_reason")
    except (ImportError, AttributeError):  # pragma: no cover - a torch without the metrics context
        return None
    # the failed guard, on one line (Dynamo follows it with the source line and the user's stack)
    return " ".join(str(reason).strip().splitlines()[0].split()) if reason else None


class Backend:
    """A ``torch.compile`` backend that applies a kvpass policy. Build it with ``kvpass.backend``."""

    def __init__(
        self,
        policy: str | Policy = "full",
        *,
        compiler: str = "inductor",
        prefill_compiler: str | None = None,
        share_layers: bool = True,
        **params,
    ) -> None:
        for name, value in (("compiler", compiler), ("prefill_compiler", prefill_compiler or compiler)):
            if value not in COMPILERS:
                raise ConfigError(f"parameter '{name}' must be one of {', '.join(COMPILERS)}, got {value!r}")
        self.policy = make_policy(policy, **params)
        self.compiler, self.prefill_compiler = compiler, prefill_compiler or compiler
        if not isinstance(share_layers, bool):
            raise ConfigError(f"parameter 'share_layers' must be True or False, got {share_layers!r}")
        self.share_layers = share_layers
        for member in self.policy.members:  # a composition (kvpass.policies.compose)
            if member.needs.gates:
                raise ConfigError(
                    f"policy '{self.policy.name}': {member.name} changes the token count inside the "
                    f"prefill graph and does not compose with other policies yet; use it alone"
                )
        self.runtime = _runtime.Runtime(self.policy)
        # the DTensor specs the frame's compiled callables check themselves (tensor parallel: local_weights);
        # kvpass.compile passes it to torch.compile as guard_filter_fn, which drops Dynamo's guard on those specs
        self.spec_guards = _local_weights.SpecGuards()
        self.kvpass = KVPass(self.policy, self.runtime, self._compile_segment)
        self.reports: list[GraphReport] = []
        # per Dynamo frame id: the compiles that gave a graph, and the last of them (``_frame_graphs_before``)
        self._frame_graphs: dict[int, tuple[int, int]] = {}
        # kvpass.compile(..., direct_steps="auto" or True) sets it: its decoding loop calls a decode graph without
        # Dynamo's frame once two steps agree (kvpass.generate.direct_steps); the last generate call's DirectSteps
        self.direct_steps, self.last_direct_steps = False, None
        # the process-wide Dynamo settings kvpass's graphs rely on (kvpass.settings says which and why)
        _settings.apply()

    @property
    def state(self):
        """The state of the last generation: on the model's own cache (a DynamicCache) the ``GenerationState``
        (true positions, stored lengths), on a ``kvpass.SlotCache`` that cache's ``state()`` (the same counts;
        the cache also gives ``positions(layer)`` and ``kv_bytes()``)."""
        return self.runtime.last_state()

    def plans(self) -> dict[str, list[str]]:
        """Per graph phase ("prefill", "decode", ...), the distinct site plans of the graphs compiled
        so far; a graph compiled unchanged shows as "unchanged: <reason>". Benchmarks record it so a
        timing says which rewrite kind ran (e.g. a decode step that appends or one that evicts)."""
        out: dict[str, set] = {}
        for r in self.reports:
            seen = out.setdefault(r.phase, set())
            seen.update(r.plans.values() if not r.problems else [f"unchanged: {r.problems[0]}"])
        return {phase: sorted(p) for phase, p in out.items()}

    @property
    def gate_info(self) -> dict | None:
        """Gated policies (asl, fastkv): the selection layer, prompt length and tokens kept of the last
        prefill, or None."""
        info = self.runtime.gate
        return info.as_dict() if info is not None else None

    def uuid(self) -> str:
        return self.kvpass.uuid()

    def graph_counts(self) -> dict[str, int]:
        """Graphs compiled so far per phase ("prefill", "decode", ...): one each for any prompt length."""
        counts: dict[str, int] = {}
        for r in self.reports:
            counts[r.phase] = counts.get(r.phase, 0) + 1
        return counts

    def decode_ignores_mask(self, layers: int) -> bool:
        """Whether every graph compiled so far other than a prefill is a whole decode step over ``layers``
        SlotCache layers (no graph break between them, where eager code would run) that reads no attention
        mask (it reads the slots by position): kvpass's decoding loop then passes each decode step the mask
        transformers built for the first."""
        steps = [r for r in self.reports if r.phase != "prefill"]
        return bool(steps) and all(not r.reads_mask and len(r.slots) == layers for r in steps)

    def recompile_advice(self, reason: str | None = None) -> str:
        """What to tell a user whose forward reaches Dynamo's recompile limit under this backend; ``reason``:
        Dynamo's reason for the recompile that reached it."""
        why = f" Dynamo recompiled because: {reason}." if reason else ""
        return (
            f"kvpass: the model's forward reached Dynamo's recompile_limit ({torch._dynamo.config.recompile_limit}; "
            f"graphs so far per phase: {self.graph_counts()}).{why} kvpass compiles one prefill and one decode "
            f"graph for any prompt length, cache size and batch of two or more rows (a batch of one, a "
            f"left-padded batch and inputs_embeds have their own); each new dtype or cache kind, and each other "
            f"model of the same class compiled with torch.compile in this process (they share one forward), adds "
            f"graphs. With torch.compile(model.forward, backend=kvpass.backend(...)) pass dynamic=True: without it "
            f"Dynamo compiles static graphs first, and a new length or batch size recompiles (kvpass.compile "
            f"marks those sizes itself). Call torch._dynamo.reset() between models, or raise the limit: "
            f"torch._dynamo.config.recompile_limit = 64."
        )

    def __call__(self, gm: fx.GraphModule, example_inputs, **compile_kwargs):
        # torch.compile passes mode=/options= to a callable backend when they are set (HF's
        # CompileConfig defaults to mode="reduce-overhead").
        cid = torch._guards.CompileContext.current_compile_id()
        before = self._frame_graphs_before(cid)
        if before + 1 >= torch._dynamo.config.recompile_limit:
            # the graph that fills the limit is refused here, where kvpass can still say why: the next recompile
            # would fail inside Dynamo with its bare FailOnRecompileLimitHit (kvpass sets that flag: past the limit
            # a decode step would run uncompiled, outside the policy, on the cache a kvpass prefill evicted)
            raise ConfigError(self.recompile_advice(_recompile_reason()))
        fn = self._rewrite_and_compile(gm, example_inputs, compile_kwargs)
        if cid is not None and cid.frame_id is not None:
            self._frame_graphs[cid.frame_id] = (before + 1, cid.frame_compile_id or 0)
        return fn

    def _frame_graphs_before(self, cid) -> int:
        """The cached entries of the frame Dynamo compiles now: what its recompile limit counts. Read from Dynamo's
        cache where it can be (a compile whose frame gave no graph, which never reached this backend, holds an
        entry too); else the compiles of the frame that gave a graph here. Dynamo's own count
        (``frame_compile_id``) also counts compiles that failed before a graph came (``kvpass.compile``'s forward
        compiles again after a call that raised, ``fastpath.compiled_forward``), and is the lower one after a
        ``torch._dynamo.reset()``, which numbers frames from 0 again."""
        if cid is None or cid.frame_id is None:
            return 0
        attempt = cid.frame_compile_id or 0
        entries = _cache_entries()
        if entries is not None:
            return min(attempt, entries)
        graphs, last = self._frame_graphs.get(cid.frame_id, (0, -1))
        return min(attempt, graphs - (last == attempt))  # a second graph of one compile is not another entry

    def _rewrite_and_compile(self, gm: fx.GraphModule, example_inputs, compile_kwargs: dict):
        """The pass over ``gm`` (its report kept), then the graph compiled by the phase's compiler."""
        report = self.kvpass(gm.graph)
        report.reads_mask = report.phase == "prefill" or mask_is_read(gm)
        self.reports.append(report)
        # the runtime's state follows the DynamicCache each call runs on, where the graph's operators read it
        follows = report.holds is not None and any(_runtime_op(n) for n in gm.graph.nodes)
        if report.gate is not None:
            report.gate.precompile(
                example_inputs
            )  # each segment with the inner compiler (short static versions: on first use)
            # runs the segments, gathering the selected tokens at the gate
            return _holds.following(report.gate, self.runtime, report.holds) if follows else report.gate
        compiler = self.prefill_compiler if report.phase == "prefill" else self.compiler
        patches = self._mode_patches(gm, report, compile_kwargs.get("mode"), compile_kwargs.get("options"), compiler)
        report.cudagraphs = bool(patches.get("triton.cudagraphs"))
        fn = self._inner(gm, example_inputs, patches, compiler, report)
        if report.cuts:
            fn = _cuts.cutting(fn, report.cuts)
        return recorded(_holds.following(fn, self.runtime, report.holds) if follows else fn, report.phase)

    def _mode_patches(self, gm: fx.GraphModule, report: GraphReport, mode, options, compiler: str) -> dict:
        """Inductor settings of a ``torch.compile`` mode / options for this graph. CUDA graphs replay
        device work only, so they are applied to graphs whose kvpass operators keep no Python-side state
        (a decode step on a ``kvpass.SlotCache``; ``full``/``art`` attention-only graphs); a graph whose
        operators call back into the policy's runtime (``handle``) compiles without them, said once."""
        if mode in (None, "default") and not options:
            return {}
        if compiler != "inductor":
            if self.compiler != "inductor":  # not said for a prefill that runs without Inductor by choice
                warn_once(
                    f"kvpass: torch.compile mode={mode!r} options={options} apply to compiler='inductor' only; "
                    f"this backend compiles with {self.compiler!r}",
                    self,
                )
            return {}
        from torch._inductor import list_mode_options

        patches = {**(list_mode_options(mode) if mode not in (None, "default") else {}), **(options or {})}
        stateful = (
            sorted({n.target.name() for n in gm.graph.nodes if _runtime_op(n)})
            if patches.get("triton.cudagraphs")
            else []
        )
        if stateful:
            patches["triton.cudagraphs"] = False
            if report.slots and report.phase == "prefill":
                return patches  # by design: a SlotCache prefill runs once per prompt, outside CUDA graphs
            warn_once(
                f"kvpass: CUDA graphs are not applied to this {report.phase} graph of policy "
                f"'{self.policy.name}': {stateful[0]} updates Python-side policy state, which a replay "
                f"would skip (a decode step on a kvpass.SlotCache has none)",
                self,
            )
        return patches

    @property
    def __name__(self) -> str:
        """The name ``torch.compile`` gives this backend; reading it is the one moment torch.compile shows a
        backend the object it compiles (torch hands a callable backend nothing else). ``torch.compile(model,
        backend=...)`` compiles calls of the module it returns, while ``.generate()`` (also reached through
        it) calls the uncompiled model: the policy would silently not apply there, so kvpass warns."""
        model = _module_being_compiled()
        if model is not None and hasattr(model, "generate"):
            warn_once(
                f"kvpass: torch.compile({type(model).__name__}, backend=kvpass.backend({self.policy.name!r})) "
                f"applies the policy to calls of the module it returns, not to .generate(), which runs the "
                f"uncompiled forward (torch's rule). Use kvpass.compile(model, {self.policy.name!r}), "
                f"model.compile(backend=...) or model.forward = torch.compile(model.forward, backend=...)",
                self,
            )
        return f"kvpass_{self.policy.name}"

    def __deepcopy__(self, memo):
        # HF's CompileConfig.to_dict() deep-copies its backend; a copy would split reports and the
        # runtime (compile-time sites on the copy, run-time lookups by handle on the original).
        return self

    def _compile_segment(self, gm, example_inputs):
        """A segment of a gated prefill (``kvpass.compiler.gate``), with the prefill's compiler."""
        return self._inner(gm, example_inputs, None, self.prefill_compiler)

    def _inner(self, gm, example_inputs, patches: dict | None, compiler: str, report: GraphReport | None = None):
        if compiler == "eager":
            self.spec_guards.unchecked(example_inputs)  # Dynamo keeps its guard on these DTensors' specs
            return gm.forward
        inputs, wrap, undo = _local_weights.local_weights(gm, example_inputs)  # tensor parallel: DTensor weights
        if inputs is example_inputs:
            self.spec_guards.unchecked(example_inputs)
            return self._compile(gm, example_inputs, patches, compiler, report)
        try:
            compiled = wrap(self._compile(gm, inputs, patches, compiler, report))
        except torch._dynamo.exc.RestartAnalysis:
            raise
        except Exception as e:  # noqa: BLE001  (any failure: the graph as Dynamo gave it, as before)
            undo()
            warn_once(
                f"kvpass: compiling the tensor-parallel weights as local tensors failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); compiling them as DTensors (same result; "
                f"torch unwraps each one on every call, slower on the host)",
                self,
            )
            self.spec_guards.unchecked(example_inputs)
            return self._compile(gm, example_inputs, patches, compiler, report)
        self.spec_guards.checked(compiled.specs)
        return compiled

    def _compile(self, gm, example_inputs, patches: dict | None, compiler: str, report: GraphReport | None):
        if compiler == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        mark_cacheable(gm, self.kvpass.uuid())
        shared, count = _layers.shared_copy(gm) if self.share_layers and report is not None else (None, 0)
        if shared is not None:
            try:
                compiled = compile_fx(shared, example_inputs, config_patches=patches or None)
            except torch._dynamo.exc.RestartAnalysis:
                raise  # Dynamo's own control flow (AOT specializing a float restarts the frame's analysis), no failure
            except Exception as e:  # noqa: BLE001  (any failure: compile the layers inline, as before)
                warn_once(
                    f"kvpass: compiling the decoder's {count} repeated layers once failed "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); compiling "
                    f"every layer instead (slower to compile, same result). "
                    f"kvpass.backend(..., share_layers=False) skips the attempt",
                    self,
                )
            else:
                report.shared_layers = count
                return compiled
        return compile_fx(gm, example_inputs, config_patches=patches or None)

    def __repr__(self) -> str:
        graphs = len(self.reports)
        prefill = f", prefill_compiler={self.prefill_compiler!r}" if self.prefill_compiler != self.compiler else ""
        return f"kvpass.Backend(policy={self.policy!r}, compiler={self.compiler!r}{prefill}, graphs_compiled={graphs})"


def backend(
    policy: str | Policy = "full",
    *,
    compiler: str = "inductor",
    prefill_compiler: str | None = None,
    share_layers: bool = True,
    **params,
) -> Backend:
    """Return a ``torch.compile`` backend that applies the KV-cache ``policy``.

    Args:
        policy: a policy name (``kvpass.policies.available()``), a composition ``"a+b"``, or a
            ``Policy`` object.
        compiler: what compiles the rewritten graph: ``"inductor"`` (default), ``"aot_eager"`` or
            ``"eager"`` (fast to compile; for tests and debugging).
        prefill_compiler: what compiles prefill graphs, when not ``compiler`` (one of the same three). A
            prefill runs once per prompt and is mostly large matmuls and the attention; its Inductor compile
            is about half of a first call's compile time (32 layers: ``bench/results/``), which
            ``"eager"`` saves for a slower first token.
        share_layers: with Inductor, compile a graph's repeated decoder layers once and call that code
            per layer (``kvpass.compiler.layers``), instead of lowering the same layer for every layer of
            the model. On by default; ``False`` compiles every layer inline.
        **params: the policy's parameters, e.g. ``budget=1024``. Every value is checked here, before
            anything is compiled; a bad one raises ``ConfigError`` naming the parameter and its range.
    """
    return Backend(policy, compiler=compiler, prefill_compiler=prefill_compiler, share_layers=share_layers, **params)
