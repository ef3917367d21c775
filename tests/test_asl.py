"""ASL, asl_fullkv and FastKV: layer-gated token propagation in compiled models (CPU).

* no-op settings equal ``full``: ``budget >= prompt length`` (all three, batch 2, decode too) and
  ``tau = 0`` (ASL never selects: the prefill is ``full``'s; ``asl_fullkv`` equals ``full`` throughout);
* a forced selection layer equals a hand-written reference that runs the uncompiled model and, from
  the next layer on, gathers the hidden states, RoPE cos/sin and position ids of the selected tokens
  (forward pre-hooks), then decodes with explicit positions; the selected tokens are the ones the
  window's attention (from the eager model's own probabilities) picks; deeper layers' queries
  really have ``budget`` tokens;
* the rank-variance rule equals a plain-Python reference on drawn score tensors (hypothesis);
* ``kvpass::layer_scores`` against eager attention, and ``opcheck``;
* every family of ``tests/families.py`` runs ``asl`` prefill + decode without graph breaks; on the
  sliding-window families (Gemma 2/3, Cohere 2) a forced layer equals the reference with sliding layers
  masked by true positions; configuration errors.
"""

from __future__ import annotations

import statistics
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx
from transformers import DynamicCache

import kvpass
import kvpass.compiler.backend
from families import FAMILIES, skip_uneven_layers_on_old_stacks, symbolic_lengths
from kvpass.errors import _WARNED, KVPassWarning
from kvpass.policies import ConfigError, make_policy

BUDGET, WINDOW, KERNEL = 20, 6, 7


def build(family: str, layers: int = 6, attn: str = "sdpa", seed: int = 0):
    cfg, cls = FAMILIES[family]()
    cfg.num_hidden_layers = layers
    types = getattr(cfg, "layer_types", None)
    if types is not None:  # keep the family's sliding/global pattern, stretched to `layers`
        cfg.layer_types = [types[i % len(types)] for i in range(layers)]
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def prompt(n: int, seed: int, b: int = 1) -> torch.Tensor:
    return torch.randint(10, 90, (b, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, be, steps: int = 3, dynamic=None):
    """Bare-forward prefill + greedy decode; returns (last-token logits per call, cache)."""
    fwd = torch.compile(model.forward, backend=be, fullgraph=True, dynamic=dynamic)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
        if dynamic is None:
            symbolic_lengths(cache)
        for _ in range(steps):
            logits.append(
                fwd(input_ids=logits[-1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
            )
    return logits, cache


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------


def avg_pool(x: list[float], kernel: int) -> list[float]:
    h = kernel // 2
    return [sum(x[j] for j in range(i - h, i + h + 1) if 0 <= j < len(x)) / kernel for i in range(len(x))]


def pooled_candidates(votes: list[float], window: int, kernel: int) -> list[float]:
    n = len(votes)
    cand = [v if i < n - window else 0.0 for i, v in enumerate(votes)]
    return [p if i < n - window else float("-inf") for i, p in enumerate(avg_pool(cand, kernel))]


def select_naive(votes: list[float], keep: int, window: int, kernel: int) -> list[int]:
    n = len(votes)
    p = pooled_candidates(votes, window, kernel)
    best = sorted(range(n - window), key=lambda i: (-p[i], i))[: keep - window]
    return sorted(best + list(range(n - window, n)))


def ranks_naive(p: list[float]) -> list[int]:
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    r = [0] * len(p)
    for k, i in enumerate(order):
        r[i] = k + 1
    return r


def selection_layer_naive(
    votes: dict[int, list[float]], first: int, l_obs: int, tau: float, keep: int, window: int, kernel: int, last: int
):
    """ASL's rank-variance rule, written out plainly."""
    rk = {i: ranks_naive(pooled_candidates(v, window, kernel)) for i, v in votes.items()}
    var0 = None
    for layer in range(first, last + 1):
        recent = [rk[i] for i in sorted(rk) if layer - l_obs < i <= layer]
        union = {j for r in recent for j, x in enumerate(r) if x <= keep - window}
        var = statistics.fmean([statistics.pvariance([r[j] for r in recent]) for j in union]) if union else 0.0
        if var0 is None:
            var0 = var
        ratio = var / var0 if var0 > 0 else float("inf")
        if ratio < tau:
            return layer
    return None


def window_votes(model, ids, layer: int, window: int = WINDOW) -> list[float]:
    """Window attention each token receives at `layer`, summed over window queries and all heads,
    from the eager model's own probabilities."""
    eager = build_like(model, "eager")
    with torch.no_grad():
        attn = eager(input_ids=ids, output_attentions=True, use_cache=False).attentions[layer]
    return attn[0, :, -window:, :].sum((0, 1)).tolist()


def build_like(model, attn: str):
    m = type(model)(model.config.__class__.from_dict(model.config.to_dict())).eval()
    m.config._attn_implementation = attn
    m.load_state_dict(model.state_dict())
    return m


def sliding_windows(model) -> dict[int, int]:
    """Layer -> window of the model's sliding-window layers (from its config's layer types)."""
    types = getattr(model.config, "layer_types", None) or []
    return {i: model.config.sliding_window for i, t in enumerate(types) if t == "sliding_attention"}


def cache_lengths(model, n: int) -> list[int]:
    """Entries each cache layer holds once a global layer holds ``n``: a sliding layer its W - 1."""
    windows = sliding_windows(model)
    return [windows[i] - 1 if i in windows else n for i in range(model.config.num_hidden_layers)]


def gathered_reference(model, ids, layer: int, sel: list[int], kept: dict[int, torch.Tensor], tokens: list[int]):
    """Uncompiled model; from `layer + 1` on every decoder layer sees only the tokens `sel` (hidden
    states, cos/sin, position ids and masks gathered by forward pre-hooks). Then each global cache layer
    is cut to the positions `kept[i]` ([H_kv, n] original indices, as the compiled run stored them) and
    the tokens are decoded with explicit positions. A sliding layer keeps what HF's own cache keeps (its
    last W - 1 entries); its decode mask is rebuilt from the true positions of those entries (visible when
    ``q - p < W``), where HF's would assume they are the last consecutive positions. Returns the
    last-token logits of the prefill and each step."""
    n = ids.shape[1]
    idx = torch.tensor(sel)
    layers = model.model.layers
    windows = sliding_windows(model)

    def gather(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if h.shape[1] == n:
            h = h[:, idx]
        kwargs = dict(kwargs)
        cos, sin = kwargs["position_embeddings"]
        kwargs["position_embeddings"] = (cos[:, idx], sin[:, idx])
        for key in ("position_ids",):
            if kwargs.get(key) is not None and kwargs[key].shape[-1] == n:
                kwargs[key] = kwargs[key][..., idx]
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = kwargs["attention_mask"][..., idx, :][..., idx]
        if args:
            return (h,) + tuple(args[1:]), kwargs
        kwargs["hidden_states"] = h
        return args, kwargs

    hooks = [layers[i].register_forward_pre_hook(gather, with_kwargs=True) for i in range(layer + 1, len(layers))]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
    finally:
        for h in hooks:
            h.remove()
    held = {}  # sliding layer -> true positions of its entries
    for i, w in windows.items():
        held[i] = (sel if i > layer else list(range(n)))[-(w - 1) :]
        assert cache.layers[i].keys.shape[-2] == len(held[i])
    step_pos = []

    def sliding_mask(i):
        def hook(mod, args, kwargs):
            q = step_pos[-1]
            pos = torch.tensor(held[i] + [q])
            visible = (pos <= q) & (q - pos < windows[i])
            old = kwargs.get("attention_mask")
            if model.config._attn_implementation == "eager" or (old is not None and old.dtype != torch.bool):
                mask = torch.zeros(pos.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
            else:
                mask = visible
            return args, dict(kwargs, attention_mask=mask.view(1, 1, 1, -1))

        return hook

    with torch.no_grad():
        for i, pos in kept.items():
            if i in windows:
                continue
            lay = cache.layers[i]
            where = pos if i <= layer else torch.searchsorted(idx, pos)  # deeper caches hold `sel` in order
            ix = where[None, ..., None].expand(1, -1, -1, lay.keys.shape[-1])
            lay.keys, lay.values = lay.keys.gather(2, ix), lay.values.gather(2, ix)
        hooks = [layers[i].register_forward_pre_hook(sliding_mask(i), with_kwargs=True) for i in windows]
        try:
            for step, tok in enumerate(tokens):
                step_pos.append(n + step)
                out = model(
                    input_ids=torch.tensor([[tok]]),
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.tensor([[n + step]]),
                )
                logits.append(out.logits[:, -1])
                for i, w in windows.items():
                    held[i] = (held[i] + [n + step])[-(w - 1) :]
        finally:
            for h in hooks:
                h.remove()
    return logits


class QueryShapes:
    """Wraps the backend's segment compiler: records the token count of every query the segments compute."""

    def __init__(self, be) -> None:
        self.inner = be.kvpass.compile_segment
        be.kvpass.compile_segment = self
        self.shapes: list[tuple] = []

    def __call__(self, gm, example_inputs):
        rec = self

        class Spy(fx.Interpreter):
            def run_node(self, node):
                out = super().run_node(node)
                if node.target is torch.ops.kvpass.attention.default:
                    rec.shapes.append(tuple(out.shape))
                return out

        return lambda *a: Spy(gm).run(*a)


# ----------------------------------------------------------------------------------------------
# no-op settings
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_budget_at_least_length_equals_full(family):
    """Nothing is pruned; on gemma3 the sliding layers' own path (last W - 1 entries, window by position)
    runs past the window (8) and equals HF's sliding cache."""
    model = build(family, layers=4)
    ids = prompt(12, seed=3, b=2)
    ref, _ = run(model, ids, kvpass.backend("full", compiler="eager"))
    for policy in ("asl", "asl_fullkv", "fastkv", "gemfilter"):
        torch._dynamo.reset()
        be = kvpass.backend(policy, compiler="eager", budget=64, window=WINDOW if policy != "gemfilter" else 1)
        got, cache = run(model, ids, be)
        assert be.gate_info["selection_layer"] is None and be.gate_info["kept"] == 12
        assert [layer.keys.shape[-2] for layer in cache.layers] == cache_lengths(model, 12 + 3)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=policy)


def test_tau_zero_never_selects():
    model = build("llama", layers=6)
    ids = prompt(40, seed=4)
    ref, _ = run(model, ids, kvpass.backend("full", compiler="eager"))
    torch._dynamo.reset()
    be = kvpass.backend("asl_fullkv", compiler="eager", budget=BUDGET, window=WINDOW, tau=0.0)
    got, cache = run(model, ids, be)
    assert be.gate_info["selection_layer"] is None and list(be.gate_info["ratios"]) == [2, 3, 4]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    be = kvpass.backend("asl", compiler="eager", budget=BUDGET, window=WINDOW, tau=0.0)
    got, cache = run(model, ids, be, steps=1)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)  # prefill: every token, every layer
    assert [layer.keys.shape[-2] for layer in cache.layers] == [BUDGET + 1] * 6  # SnapKV-compressed cache


# ----------------------------------------------------------------------------------------------
# a forced selection layer against the hand-written reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy,layer,dynamic,attn",
    [
        ("asl_fullkv", 2, None, "sdpa"),
        ("asl_fullkv", 3, True, "sdpa"),
        ("fastkv", -1, None, "sdpa"),
        ("asl", 1, True, "sdpa"),
        ("asl", 2, None, "eager"),
    ],
)
def test_forced_layer_matches_gathering_reference(policy, layer, dynamic, attn):
    if policy == "asl_fullkv":  # layers before the gate keep the prompt, deeper ones the selection
        skip_uneven_layers_on_old_stacks(policy)
    model = build("llama", layers=6, attn=attn)
    ids = prompt(40, seed=1)
    be = kvpass.backend(policy, compiler="eager", budget=BUDGET, window=WINDOW, layer=layer)
    spy = QueryShapes(be)
    got, cache = run(model, ids, be, steps=4, dynamic=dynamic)
    gate = layer if layer >= 0 else 3
    assert be.gate_info["selection_layer"] == gate and be.gate_info["kept"] == BUDGET
    # the deeper layers really computed BUDGET tokens: one query shape per layer of the prefill
    assert [s[2] for s in spy.shapes] == [40] * (gate + 1) + [BUDGET] * (5 - gate)
    sel = select_naive(window_votes(model, ids, gate), BUDGET, WINDOW, KERNEL)
    kept = {i: be.state.positions(i)[0, :, :-4].clone() for i in range(6)}
    for i in range(gate + 1, 6):
        assert kept[i].tolist() == [sel] * 2, f"layer {i}"
        assert cache.layers[i].keys.shape[-2] == BUDGET + 4
    for i in range(gate + 1):
        assert cache.layers[i].keys.shape[-2] == (40 if policy == "asl_fullkv" else BUDGET) + 4
    assert be.state.seen == 44
    tokens = [int(x.argmax()) for x in got[:-1]]
    ref = gathered_reference(model, ids, gate, sel, kept, tokens)
    for step, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("policy", ["asl", "asl_fullkv"])
def test_the_runner_drops_each_value_after_its_last_segment(policy, monkeypatch):
    """The gated prefill's runner holds a segment's outputs only until the last segment that reads them: when a
    segment runs, at most two earlier full-length residual streams are alive (its input, and one the graph
    returns), not one per layer boundary (1 GiB each at 128k tokens on the 8B shape)."""
    import weakref

    from kvpass.compiler import gate

    n, hidden, alive = 40, None, []
    made: list[weakref.ref] = []
    run_segment = gate.GatedGraph._run

    def spy(self, seg, short, length, ins):
        alive.append(sum(r() is not None for r in made))
        outs = run_segment(self, seg, short, length, ins)
        made.extend(weakref.ref(t) for t in outs if isinstance(t, torch.Tensor) and tuple(t.shape) == (1, n, hidden))
        return outs

    monkeypatch.setattr(gate.GatedGraph, "_run", spy)
    model = build("llama", layers=8)
    hidden = model.config.hidden_size
    # the adaptive rule: a cut (a segment boundary) after every candidate layer from l_min on
    be = kvpass.backend(policy, compiler="eager", budget=BUDGET, window=WINDOW)
    run(model, prompt(n, seed=1), be, steps=1, dynamic=True)
    assert len(alive) >= 5, alive
    assert max(alive) <= 2, alive


@pytest.mark.parametrize(
    "family,attn,policy,gate,budget",
    [
        ("gemma3", "sdpa", "asl", 2, 10),
        ("cohere2", "sdpa", "asl_fullkv", 3, 10),
        ("gemma2", "eager", "asl", 3, 10),
        ("gemma3", "sdpa", "fastkv", 2, 5),
    ],
)
def test_forced_layer_on_sliding_families_matches_reference(family, attn, policy, gate, budget):
    """Sliding-window layers after the gate hold the last W - 1 selected tokens, whose positions are not
    consecutive: their decode attention masks by true positions (the reference rebuilds that mask; HF's
    own would show every held entry). Layers before the gate hold the last W - 1 prompt tokens. The gate
    is a global layer: the reference takes its votes from the model's own attention probabilities, and a
    sliding layer's would ignore the tokens outside its window (kvpass scores every token there). With
    ``budget < W - 1`` the deeper sliding layers get empty slots in front, up to the W - 1 entries HF
    sizes their decode mask for; decode pushes them out."""
    if policy == "asl_fullkv":
        skip_uneven_layers_on_old_stacks(policy)
    model = build(family, layers=6, attn=attn)
    windows = sliding_windows(model)
    assert gate not in windows and any(i > gate for i in windows) and any(i < gate for i in windows)
    ids = prompt(40, seed=4)
    window = 2
    be = kvpass.backend(policy, compiler="eager", budget=budget, window=window, layer=gate)
    got, cache = run(model, ids, be, steps=6)
    assert be.gate_info["selection_layer"] == gate and be.gate_info["kept"] == budget
    sel = select_naive(window_votes(model, ids, gate, window), budget, window, KERNEL)
    for i, w in windows.items():  # the record follows each sliding layer's last W - 1 entries
        held = ((sel if i > gate else list(range(40))) + list(range(40, 46)))[-(w - 1) :]
        assert be.state.positions(i)[0, 0].tolist() == held, f"layer {i}"
        assert cache.layers[i].keys.shape[-2] == w - 1
    if (
        budget < min(windows.values()) - 1
    ):  # after the prefill alone, the deeper sliding layers hold empty slots in front
        torch._dynamo.reset()
        pre = kvpass.backend(policy, compiler="eager", budget=budget, window=window, layer=gate)
        _, pcache = run(model, ids, pre, steps=0)
        for i, w in windows.items():
            want = [-1] * (w - 1 - budget) + sel if i > gate else list(range(40 - w + 1, 40))
            assert pre.state.positions(i)[0, 0].tolist() == want and pcache.layers[i].keys.shape[-2] == w - 1
            if i > gate:
                assert (pcache.layers[i].keys[:, :, : w - 1 - budget] == 0).all()
    # a deeper sliding layer holds a selected token farther than W from the first decode step: the test
    # would pass with HF's consecutive-position mask otherwise
    assert any(p <= 40 - w for i, w in windows.items() if i > gate for p in (sel[-(w - 1) :]))
    kept = {i: be.state.positions(i)[0, :, :-6].clone() for i in range(6) if i not in windows}
    tokens = [int(x.argmax()) for x in got[:-1]]
    ref = gathered_reference(model, ids, gate, sel, kept, tokens)
    for step, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_generate_after_gate():
    """generate carries position_ids; the continuation equals the gathering reference's greedy tokens."""
    skip_uneven_layers_on_old_stacks("asl_fullkv")
    model = build("llama", layers=6)
    ids = prompt(40, seed=2)
    be = kvpass.backend("asl_fullkv", compiler="eager", budget=BUDGET, window=WINDOW, layer=2)
    compiled = build_like(model, "sdpa")
    compiled.forward = torch.compile(compiled.forward, backend=be, fullgraph=True)
    out = compiled.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    tokens = out[0, 40:].tolist()
    assert be.gate_info["selection_layer"] == 2
    sel = select_naive(window_votes(model, ids, 2), BUDGET, WINDOW, KERNEL)
    kept = {i: be.state.positions(i)[0, :, :-5].clone() for i in range(6)}
    ref = gathered_reference(model, ids, 2, sel, kept, tokens)
    assert [int(x.argmax()) for x in ref[:-1]] == tokens


def test_adaptive_rule_fires_and_matches_forced():
    """With tau = 1 the rule fires at the first layer whose rank variance falls; the run equals the
    same layer forced, and the layer is the reference rule's on the model's own window votes."""
    model = build("llama", layers=8, seed=5)
    ids = prompt(48, seed=7)
    votes = {i: window_votes(model, ids, i) for i in range(7)}
    want = selection_layer_naive(votes, 2, 8, 1.0, BUDGET, WINDOW, KERNEL, 6)
    be = kvpass.backend("asl", compiler="eager", budget=BUDGET, window=WINDOW, tau=1.0)
    got, _ = run(model, ids, be, steps=2)
    assert be.gate_info["selection_layer"] == want
    if want is None:
        pytest.skip("the rule does not fire on this random model")
    torch._dynamo.reset()
    forced = kvpass.backend("asl", compiler="eager", budget=BUDGET, window=WINDOW, layer=want)
    ref, _ = run(model, ids, forced, steps=2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def second_pass_reference(model, ids, sel: list[int], tokens: list[int], renumber: bool):
    """Plain HF: prefill only `ids[:, sel]` (positions 0..n-1 when `renumber`, else the original ones),
    then decode `tokens` (positions continue from n, or from the prompt length)."""
    idx = torch.tensor(sel)
    n, length = len(sel), ids.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        pos = None if renumber else idx[None]
        logits = [model(input_ids=ids[:, idx], past_key_values=cache, use_cache=True, position_ids=pos).logits[:, -1]]
        for step, tok in enumerate(tokens):
            p = (n if renumber else length) + step
            logits.append(
                model(
                    input_ids=torch.tensor([[tok]]),
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.tensor([[p]]),
                ).logits[:, -1]
            )
    return logits


@pytest.mark.parametrize(
    "policy,dynamic,family,budget",
    [
        ("gemfilter", None, "llama", BUDGET),
        ("gemfilter", True, "llama", BUDGET),
        ("asl_2pass", None, "llama", BUDGET),
        ("gemfilter", None, "gemma3", 5),
    ],
)
def test_second_pass_matches_plain_prefill_of_selected_tokens(policy, dynamic, family, budget):
    """gemfilter / asl_2pass: the selected tokens prefilled again from layer 0 equal HF run on those
    tokens alone (renumbered or original positions); decode continues from n or from L. On gemma3 with
    ``budget < W - 1`` the sliding layers hold empty slots in front (HF sizes their decode mask for the
    W - 1 entries of a 40-token prompt); renumbered positions are consecutive, so HF's own run is exact."""
    model = build(family, layers=6)
    windows = sliding_windows(model)
    ids = prompt(40, seed=12)
    window, kernel = (1, 1) if policy == "gemfilter" else (WINDOW, KERNEL)
    be = kvpass.backend(policy, compiler="eager", budget=budget, window=window, kernel=kernel, layer=2)
    spy = QueryShapes(be)
    got, cache = run(model, ids, be, steps=4, dynamic=dynamic)
    assert be.gate_info["selection_layer"] == 2 and be.gate_info["passes"] == 2
    assert [s[2] for s in spy.shapes] == [40] * 3 + [budget] * 6  # first pass stops at the filter layer
    assert [layer.keys.shape[-2] for layer in cache.layers] == cache_lengths(model, budget + 4)
    sel = select_naive(window_votes(model, ids, 2, window), budget, window, kernel)
    renumber = policy == "gemfilter"
    layer = next(i for i in range(6) if i not in windows and i > 2)
    assert be.state.layer(layer).pos[0, 0, :budget].tolist() == (list(range(budget)) if renumber else sel)
    tokens = [int(x.argmax()) for x in got[:-1]]
    ref = second_pass_reference(model, ids, sel, tokens, renumber)
    for step, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_inductor_keeps_the_call_positions_of_both_ropes():
    """Gemma 3 reads positions for two RoPEs; with one ``true_positions`` per RoPE, Inductor ran the
    second after the first sliding layers had recorded the step's count, which moved the global
    layers' positions by one from the second decode step on (caught on the GPU: gemfilter, budget < W - 1).
    The shared position tensor is now fixed once."""
    model = build("gemma3", layers=6)
    ids = prompt(200, seed=5)
    runs = []
    for compiler in ("eager", "inductor"):
        torch._dynamo.reset()
        be = kvpass.backend("gemfilter", compiler=compiler, budget=5, layer=2)
        runs.append([int(x.argmax()) for x in run(model, ids, be, steps=4)[0]])
        assert all(len(r.positions_fixed) == 1 for r in be.reports)  # one true_positions per graph
    assert runs[0] == runs[1]


def test_gemfilter_generate_continues_from_kept_count():
    """generate counts the whole prompt in its position ids; gemfilter moves them back to n + step."""
    model = build("llama", layers=6)
    ids = prompt(40, seed=13)
    be = kvpass.backend("gemfilter", compiler="eager", budget=BUDGET, layer=2)
    compiled = build_like(model, "sdpa")
    compiled.forward = torch.compile(compiled.forward, backend=be, fullgraph=True)
    out = compiled.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    tokens = out[0, 40:].tolist()
    sel = select_naive(window_votes(model, ids, 2, 1), BUDGET, 1, 1)
    ref = second_pass_reference(model, ids, sel, tokens, True)
    assert [int(x.argmax()) for x in ref[:-1]] == tokens
    assert any(r.positions_fixed for r in be.reports if r.phase == "decode")


# ----------------------------------------------------------------------------------------------
# the rule and the scoring op
# ----------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    n=st.integers(12, 40),
    layers=st.integers(3, 10),
    l_obs=st.integers(1, 5),
    window=st.integers(1, 4),
    kernel=st.sampled_from([1, 3, 7]),
    tau=st.floats(0.0, 1.0),
)
def test_rank_variance_rule_matches_reference(data, n, layers, l_obs, window, kernel, tau):
    keep = data.draw(st.integers(window + 1, n - 1))
    first = data.draw(st.integers(0, layers - 2))
    values = st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 3.0])  # small alphabet: ties happen
    votes = {i: data.draw(st.lists(values, min_size=n, max_size=n)) for i in range(layers - 1)}
    want = selection_layer_naive(votes, first, l_obs, tau, keep, window, kernel, layers - 2)
    pol = make_policy(
        "asl", budget=max(keep, window + 1), window=window, kernel=kernel, tau=tau, l_obs=l_obs, l_min=first
    )
    observe, cuts = pol.gate_layers(layers)
    assert cuts == list(range(first, layers - 1))
    assert observe == list(range(max(0, first - l_obs + 1), layers - 1))
    ctx = {"kv_pos": torch.arange(n)[None]}
    history, got = {}, None
    for layer in range(layers - 1):
        history[layer] = torch.tensor([votes[layer]])
        if layer in cuts and pol.gate_fires(layer, history, keep, ctx):
            got = layer
            break
    assert got == want
    if got is not None:
        sel = pol.gate_select(history[got], keep, ctx)
        assert sel[0].tolist() == select_naive(votes[got], keep, window, kernel)


def test_layer_scores_op():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
    mask[1, ..., :3] = False  # left padding of row 1
    got = torch.ops.kvpass.layer_scores(q, k, mask, 0.3, 0.0, 4)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    want = s.softmax(-1)[:, :, -4:].sum(2).unflatten(1, (2, 2)).sum(2)  # per KV head: its group's queries
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (2, 2, 10) and (got[1, :, :3] == 0).all()
    torch.library.opcheck(torch.ops.kvpass.layer_scores.default, (q, k, mask, 0.3, 0.0, 4))
    torch.library.opcheck(torch.ops.kvpass.layer_scores.default, (q, k, None, 0.3, 5.0, 16))


def test_shift_positions_op():
    be = kvpass.backend("gemfilter", compiler="eager", budget=BUDGET)
    pos = torch.tensor([[40, 41]])
    handle = be.runtime.handle
    assert torch.equal(torch.ops.kvpass.shift_positions(pos, handle), pos)  # no gated prefill yet
    from kvpass.compiler.gate import GateInfo

    be.runtime.gate = GateInfo(2, 40, 20, (2,), {}, 2, 20)
    assert torch.ops.kvpass.shift_positions(pos, handle).tolist() == [[20, 21]]
    torch.library.opcheck(torch.ops.kvpass.shift_positions.default, (pos, handle))


# ----------------------------------------------------------------------------------------------
# families, batches, configuration
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,attn", [(f, "eager" if f == "gemma2" else "sdpa") for f in sorted(FAMILIES)] + [("llama", "eager")]
)
def test_families_run_or_fall_back(family, attn):
    _WARNED.clear()
    model = build(family, layers=4, attn=attn)
    ids = prompt(40, seed=8)
    be = kvpass.backend("asl", compiler="eager", budget=BUDGET, window=WINDOW, layer=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cache = run(model, ids, be, steps=2)
    reasons = [str(w.message) for w in caught if issubclass(w.category, KVPassWarning)]
    assert all(torch.isfinite(x).all() for x in got)
    assert not reasons, reasons  # every family gates (sliding-window ones included): no fallback left
    assert be.gate_info["selection_layer"] == 2
    assert [layer.keys.shape[-2] for layer in cache.layers] == cache_lengths(model, BUDGET + 2)


def test_batch_rows_select_their_own_tokens():
    """Rows share the selection layer; each keeps its own tokens: a batch equals its rows run alone."""
    model = build("llama", layers=6)
    ids = torch.cat([prompt(40, seed=9), prompt(40, seed=10)])
    be = kvpass.backend("fastkv", compiler="eager", budget=BUDGET, window=WINDOW)
    got, _ = run(model, ids, be, steps=2)
    rows = be.state.layer(5).pos[:, 0, :BUDGET]
    assert not torch.equal(rows[0], rows[1])
    for r in range(2):
        torch._dynamo.reset()
        single = kvpass.backend("fastkv", compiler="eager", budget=BUDGET, window=WINDOW)
        alone, _ = run(model, ids[r : r + 1], single, steps=0)
        torch.testing.assert_close(got[0][r], alone[0][0], atol=1e-4, rtol=1e-4)
        assert torch.equal(single.state.layer(5).pos[0, 0], rows[r])


def test_left_padded_batch_through_generate_equals_single_runs():
    """Padding is scored 0 and never kept over a real token; each row's continuation and kept tokens
    equal its own run (indices shifted by its padding)."""
    model = build("llama", layers=6)
    long, short, pad = prompt(40, seed=4), prompt(30, seed=5), 10
    batch = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    runs = []
    for ids, attn in ((batch, mask), (short, None), (long, None)):
        torch._dynamo.reset()
        be = kvpass.backend("fastkv", compiler="eager", budget=BUDGET, window=WINDOW)
        m = build_like(model, "sdpa")
        m.forward = torch.compile(m.forward, backend=be, fullgraph=True)
        out = m.generate(ids, attention_mask=attn, max_new_tokens=5, do_sample=False, min_new_tokens=5)
        runs.append((out[:, ids.shape[1] :], be.state.layer(5).pos[:, 0, :BUDGET]))
    (both, kept), (s_out, s_kept), (l_out, l_kept) = runs
    assert both[0].tolist() == s_out[0].tolist() and both[1].tolist() == l_out[0].tolist()
    assert kept[0].tolist() == (s_kept[0] + pad).tolist() and kept[1].tolist() == l_kept[0].tolist()


def test_static_length_equal_to_a_model_dimension_falls_back():
    model = build("llama", layers=6)
    ids = prompt(64, seed=11)  # 64 = hidden size: literal sizes would be ambiguous
    _WARNED.clear()
    be = kvpass.backend("fastkv", compiler="eager", budget=BUDGET, window=WINDOW)
    with pytest.warns(KVPassWarning, match="equals a model dimension"):
        got, _ = run(model, ids, be, steps=1)
    assert be.gate_info is None


def test_config_errors():
    with pytest.raises(ConfigError, match="'kernel' must be an odd int"):
        kvpass.backend("asl", kernel=4)
    with pytest.raises(ConfigError, match=r"'tau' must be float in \[0.0, 1.0\]"):
        kvpass.backend("asl", tau=1.5)
    with pytest.raises(ConfigError, match="'budget' must be > window"):
        kvpass.backend("fastkv", budget=16, window=32)
    with pytest.raises(ConfigError, match="does not compose"):
        kvpass.backend("asl+art")
    with pytest.raises(ConfigError, match="has no parameter 'tau'"):
        kvpass.backend("fastkv", tau=0.5)
    with pytest.raises(ConfigError, match="has no parameter 'tau'"):
        kvpass.backend("gemfilter", tau=0.5)
    assert make_policy("gemfilter").gate_layers(32) == ([13], [13])
    assert make_policy("fastkv").gate_layers(24) == ([12], [12])
    assert make_policy("asl").gate_layers(30) == (list(range(3, 29)), list(range(10, 29)))


def test_short_segments_keep_kvpass_constants_that_equal_the_length(monkeypatch):
    """A static graph's short segments replace the literal prompt length L by n. A kvpass op's
    runtime handle (or layer) that happens to equal L must stay as it is: it was swapped to n, which
    made the first prefill fail with "no runtime with handle n" whenever a worker had created
    exactly L backends before (an order-dependent CI failure)."""
    import itertools

    from kvpass.cache import runtime

    ordinary = next(runtime._NEXT) + 1  # the handle an unpatched backend gets next
    length = next(n for n in range(40, 200) if n not in runtime._RUNTIMES and n != ordinary)
    model = build("llama", layers=4)
    ids = prompt(length, seed=3)
    outs = []
    for handles in (itertools.count(length), None):  # the handle equal to L, then an ordinary one
        if handles is not None:
            monkeypatch.setattr(runtime, "_NEXT", handles)
        be = kvpass.backend("fastkv", compiler="eager", budget=BUDGET, window=WINDOW)
        assert (be.runtime.handle == length) == (handles is not None)
        monkeypatch.undo()
        torch._dynamo.reset()
        outs.append(run(model, ids, be, steps=1)[0])
        assert be.gate_info["kept"] == BUDGET
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)


def test_a_gated_policy_without_the_gated_protocol_compiles_unchanged():
    """The gate reads a policy only through ``GatedPolicy`` (kvpass.policies.contract): a policy that declares
    ``Needs(gates=True)`` without it is named in a warning and its graph compiled unchanged (the model's
    tokens), not half-run on attributes the gate hoped for."""
    from kvpass.policies.contract import GatedPolicy, Needs, Policy, SitePlan, param

    class NoProtocol(Policy):
        name = "no_protocol"
        summary = "declares a gate, brings none of its methods"
        budget: int = param(16, 1, 1 << 20, "tokens kept")
        needs = Needs(evicts=True, gates=True)

        def plan(self, site):
            return SitePlan(attention=True, evict=True)

    assert not isinstance(NoProtocol(), GatedPolicy) and isinstance(make_policy("asl"), GatedPolicy)
    cfg, cls = FAMILIES["llama"]()
    torch.manual_seed(0)
    model = cls(cfg).eval()
    ids = torch.randint(3, 90, (1, 30))
    torch._dynamo.reset()
    _WARNED.clear()
    fwd = torch.compile(model.forward, backend=kvpass.backend(NoProtocol(), compiler="eager"))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fwd(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
        want = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
    assert any("GatedPolicy protocol" in str(w.message) for w in caught), [str(w.message) for w in caught]
    torch.testing.assert_close(got, want)
