"""Compile once for every prompt length, and the SlotCache's misuse refusals.

* ``kvpass.compile`` + ``generate`` over 30 prompt lengths: one prefill and one decode graph for one
  policy of each mechanism (``conformance.one_per_mechanism``), whatever the lengths, and ``full``'s tokens equal
  the uncompiled model;
* the cache is kept and reused while it fits, a bucket of a quarter octave;
* a SlotCache built for another policy configuration, a sequence past ``max_length`` (a ring too), a cache of
  another dtype, bad constructor arguments, a model compiled twice: refused, naming kvpass and the fix;
* Dynamo's recompile limit under ``kvpass.compile`` becomes a ConfigError that says what to do;
* the decoding loop: HF's tokens when rows stop early, its device work per step counted, the attention mask
  transformers built for the first decode step passed again only where no code reads it (``mask_is_read``, a
  step that would compile, a forward run outside the compiled graph).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings

import pytest
import torch

import kvpass
from conformance import CONFORMANCE, one_per_mechanism
from families import build
from kvpass.generate.fastpath import bucket

SLOT = one_per_mechanism([n for n, e in CONFORMANCE.items() if not e.driver])  # conformance.py
LENGTHS = [10 + 3 * i for i in range(30)]
EVERY_LENGTH = ("full", "snapkv", "raas")  # an append, an evicting and a paged cache; the others take every
# third length (10, still past Dynamo's recompile limit of 8), for CI's time


def ids_of(n: int, b: int = 1) -> torch.Tensor:
    return torch.randint(3, 90, (b, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("policy", SLOT)
def test_one_prefill_and_one_decode_graph_for_every_prompt_length(policy):
    """30 distinct prompt lengths (10..97, 3..9 new tokens; 10 of them for most policies) through ``generate``:
    the backend compiles one prefill and one decode graph, and Dynamo no more (before: every length compiled
    both again and the fifth hit the recompile limit). The demanding setting, so evicting policies evict."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build("llama")
    be = kvpass.compile(model, policy, compiler="eager", **CONFORMANCE[policy].demanding)
    for n in LENGTHS if policy in EVERY_LENGTH else LENGTHS[::3]:
        new = 3 + n % 7
        out = model.generate(ids_of(n), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert out.shape[1] == n + new
    assert be.graph_counts() == {"prefill": 1, "decode": 1}, be.plans()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert all(not r.problems for r in be.reports), be.plans()


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_layers_of_unequal_capacity_after_equal_ones_compile_no_second_decode_graph(compiler):
    """pyramidkv gives lower layers more slots: after a short prompt every layer holds the whole bucket (the
    capacities equal the read length), after a long one they differ. The first decode graph must serve both.
    Two causes, each a second decode graph on an H100 at 130k: the cache's read branched on read length against
    capacity (eager), and the rewrite left the model's dead view of the slots' leading entries in the graph,
    whose contiguity AOT's tracing guarded on (aot_eager, Inductor)."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "pyramidkv", compiler=compiler, budget=64)
    capacities = []
    for n in (20, 300, 40):
        model.generate(ids_of(n), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        (cache,) = model.generate.caches.values()
        capacities.append([lay.capacity for lay in cache.layers])
        assert be.graph_counts() == {"prefill": 1, "decode": 1}, (n, capacities)
    assert len(set(capacities[0])) == 1 and len(set(capacities[1])) > 1, capacities


def test_full_through_compile_equals_the_model_and_reuses_its_cache():
    """``full`` through ``kvpass.compile`` gives the uncompiled model's tokens on every length; one cache per
    row count is kept: reused while it fits (same object, reset), replaced by a larger bucket when not."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    be = kvpass.compile(model, "full", compiler="eager")
    seen = []
    for n in (12, 20, 30, 90, 14):
        ids = ids_of(n)
        got = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert torch.equal(got, ref.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)), n
        seen.append(model.generate.caches[(1, torch.float32, torch.device("cpu"), False)])
    assert seen[0] is seen[1] is seen[2] and seen[3] is not seen[2] and seen[4] is seen[3]
    assert seen[0].max_length == 64 and seen[3].max_length == bucket(96) == 96
    assert "full" in repr(model.generate) and be.reports


def test_bucket_is_a_quarter_octave():
    assert [bucket(n) for n in (1, 64, 65, 80, 81, 1000, 1025, 40000)] == [64, 64, 80, 80, 96, 1024, 1280, 40960]
    assert all(n <= bucket(n) < 1.26 * n for n in range(65, 5000))


def test_batch_and_padding_through_compile():
    """A left-padded batch of two through ``kvpass.compile``: each row gets what it gets alone, on a cache of
    two rows."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "streamingllm", compiler="eager", budget=16, sinks=2)
    short, long = ids_of(11), ids_of(25)
    alone = [
        model.generate(x, max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, x.shape[1] :] for x in (short, long)
    ]
    ids = torch.cat([torch.cat([torch.zeros(1, 14, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(ids)
    mask[0, :14] = 0
    both = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False)[:, 25:]
    assert both[0].tolist() == alone[0].tolist() and both[1].tolist() == alone[1].tolist()
    assert (2, torch.float32, torch.device("cpu"), False) in model.generate.caches


@pytest.mark.parametrize("sample", [False, True])
def test_decode_loop_equals_hf_loop_when_rows_stop_early(sample, monkeypatch):
    """kvpass's decoding loop (it reads "every row finished" one step late and undoes the extra step) gives HF's
    loop's tokens when end-of-sequence tokens stop one row, then the other, before max_new_tokens, and when
    max_new_tokens stops them; greedy and sampled (same seed), and the random generator is left where HF's loop
    leaves it (the undone step's draw given back: a next sampling call drew one draw further on). HF's loop runs
    through ``return_dict_in_generate``, which kvpass's loop hands to it."""
    from kvpass.generate import decode_loop

    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "snapkv", compiler="eager", budget=16, window=4)
    ids = ids_of(20, b=2)
    kw = dict(max_new_tokens=12, do_sample=sample, top_k=20 if sample else None, pad_token_id=0)
    reads = []
    monkeypatch.setattr(
        decode_loop.Late, "read", lambda self, read=decode_loop.Late.read: reads.append(1) or read(self)
    )

    def ours_and_hf(**extra):
        torch.manual_seed(1)
        ours = model.generate(ids, **kw, **extra)
        after = torch.rand(4)  # the generator after the call: the undone step gives its draw back
        torch.manual_seed(1)
        hf = model.generate(ids, **kw, **extra, return_dict_in_generate=True).sequences
        assert torch.equal(after, torch.rand(4))
        return ours, hf

    free, hf = ours_and_hf()
    assert reads and free.shape[1] == 32 and torch.equal(free, hf)
    eos = [int(free[0, 23]), int(free[1, 26])]  # row 0 stops by its 4th new token, row 1 by its 7th
    ours, hf = ours_and_hf(eos_token_id=eos)
    assert ours.shape[1] <= 27 and torch.equal(ours, hf), (ours, hf)


def test_decode_loop_device_work_per_step_is_small():
    """kvpass's loop adds at most 9 device operations per step around the compiled forward, end-of-sequence
    tokens checked (logits copy, argmax, padding, the token's column, the EOS check, the finished flags and
    their copy to the host): no new sequence tensor, no max-length check on the device, no pinned allocation
    per step. HF's input preparation runs at most 4 (a SlotCache decode graph reads no attention mask, so the
    first step's 4-D mask is passed again instead of built: about 20 operations). Each launch costs the host
    10-40 us on a GPU, where a short step is host-bound."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(20)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=[1, 2])
    want = model.generate(ids, max_new_tokens=24, **kw, return_dict_in_generate=True).sequences  # HF's loop
    assert be.decode_ignores_mask(2)
    ops, where = [], ["loop"]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if where[-1] != "hf" and not func.is_view:
                ops.append(where[-1])
            return func(*args, **(kwargs or {}))

    def part(fn, label):
        @functools.wraps(fn)  # HF reads the forward's signature
        def run(*a, **k):
            where.append(label)
            try:  # HF's own parts and the forward run outside the mode (under it, Dynamo runs the forward eagerly)
                with _disable_current_modes() if label == "hf" else contextlib.nullcontext():
                    return fn(*a, **k)
            finally:
                where.pop()

        return run

    for name, label in (
        ("forward", "hf"),
        ("_update_model_kwargs_for_generation", "hf"),
        ("prepare_inputs_for_generation", "prepare"),
    ):
        setattr(model, name, part(getattr(model, name), label))
    counts = []
    for new in (8, 24):  # the difference is the steps' (generate's set-up costs the same in both)
        ops.clear()
        with Count():
            out = model.generate(ids, max_new_tokens=new, **kw)
        assert out.shape[1] == 20 + new  # no EOS drawn: every step ran
        counts.append({label: ops.count(label) for label in ("loop", "prepare")})
    assert torch.equal(out, want)
    per_step = {label: (counts[1][label] - counts[0][label]) / 16 for label in counts[0]}
    assert per_step["loop"] <= 9 and per_step["prepare"] <= 4, per_step


def test_decode_loop_rebuilds_the_mask_when_a_step_would_compile(monkeypatch):
    """A step that passes the first step's attention mask again runs under ``fail_on_recompile``: when it would
    compile a graph (here Dynamo's caches are emptied mid-call), it is refused before it runs and rerun with the
    mask transformers builds (one mask more than a call without the interruption builds: the prefill's and the
    first decode step's); the tokens are those of a call without it."""
    import transformers.generation.utils as hf_generation
    from transformers import LogitsProcessor, LogitsProcessorList

    builds = []
    real = hf_generation.create_masks_for_generate
    monkeypatch.setattr(hf_generation, "create_masks_for_generate", lambda *a, **k: builds.append(1) or real(*a, **k))
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "snapkv", compiler="eager", budget=16, window=4)
    ids, kw = ids_of(25), dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    model.generate(ids, **kw)
    builds.clear()
    want = model.generate(ids, **kw)
    assert len(builds) == 2  # the prefill's and the first decode step's: the later steps reuse the latter
    compiled = len(be.reports)

    class ResetAt(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 5:
                torch._dynamo.reset()
            return scores

    builds.clear()
    got = model.generate(ids, **kw, logits_processor=LogitsProcessorList([ResetAt()]))
    assert torch.equal(got, want) and len(builds) == 3
    assert [r.phase for r in be.reports[compiled:]] == ["decode"]  # the decode graph compiled again, once


def test_decode_loop_never_hands_a_reused_mask_to_uncompiled_attention():
    """Under a torch dispatch mode Dynamo runs the forward eagerly: the model's own attention then reads the
    mask, so a step given the first step's mask again is refused by the SlotCache before it writes (``MaskReused``)
    and rerun with the mask built anew: the tokens are HF's loop's (they diverged after 10 steps without it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "full", compiler="eager")
    ids, kw = ids_of(20), dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = model.generate(ids, **kw, return_dict_in_generate=True).sequences  # HF's loop, masks built
    with Passthrough():
        got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_prefill_compiler_compiles_only_the_prefill():
    """``prefill_compiler="eager"`` runs the rewritten prefill graph as it is and compiles the decode graph with
    ``compiler``; the tokens are those of one compiler for both (a bad name is refused, naming the parameter)."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kw = dict(budget=16, window=4)
    be = kvpass.compile(model, "snapkv", compiler="aot_eager", prefill_compiler="eager", **kw)
    kvpass.compile(ref, "snapkv", compiler="eager", **kw)
    ids = ids_of(30)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False))
    assert be.graph_counts() == {"prefill": 1, "decode": 1} and "prefill_compiler='eager'" in repr(be)
    with pytest.raises(kvpass.ConfigError, match="'prefill_compiler' must be one of"):
        kvpass.backend("full", prefill_compiler="tvm")


def test_compile_refusals():
    model = build("llama")
    with pytest.raises(
        kvpass.ConfigError,
        match=r"^kvpass: policy 'snapkv': parameter 'budget' .* got -1 \(budget: entries kept .*\); pass a",
    ):
        kvpass.compile(model, "snapkv", compiler="eager", budget=-1)
    with pytest.raises(kvpass.ConfigError, match=r"parameter 'model' must be a transformers model .* got str 'llama'"):
        kvpass.compile("llama", "full")
    with pytest.raises(kvpass.ConfigError, match="ChunkFusion"):
        kvpass.compile(model, "a3", compiler="eager")
    kvpass.compile(model, "full", compiler="eager")
    with pytest.raises(kvpass.ConfigError, match="already compiled"):
        kvpass.compile(model, "full", compiler="eager")


def test_compile_refuses_a_module_backward_hook():
    """transformers 5.17's tensor-parallel plan puts a full backward hook on Qwen3's q_norm / k_norm. Dynamo breaks
    the graph there (it needs compiled autograd), kvpass then sees fragments and the SlotCache overflowed on the GPU
    (a device-side assert): kvpass.compile refuses such a model up front, naming the module."""
    model = build("llama")
    handle = model.model.layers[1].self_attn.register_full_backward_hook(lambda *a: None)
    with pytest.raises(kvpass.ConfigError, match=r"module 'model\.layers\.1\.self_attn' .*backward hook"):
        kvpass.compile(model, "full", compiler="eager")
    handle.remove()
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None)  # a global one: every module
    try:
        with pytest.raises(kvpass.ConfigError, match=r"every module \(a global backward hook"):
            kvpass.compile(model, "full", compiler="eager")
    finally:
        handle.remove()
    kvpass.compile(model, "full", compiler="eager")


def test_ordinary_generate_options_give_the_uncompiled_tokens():
    """Calls a user makes that the fast path got wrong without a word: without a cache every step reran the whole
    sequence into the SlotCache (wrong tokens from the second step); a list of prompts took ``max_length`` as the
    queue's capacity (each output shorter than asked); no length at all, or a length only in the generation config,
    failed with a TypeError. Each now equals the uncompiled model."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(5)
    for kw in ({"max_new_tokens": 4, "use_cache": False}, {}, {"max_length": 12}):
        want = ref.generate(ids, do_sample=False, **kw)
        assert torch.equal(model.generate(ids, do_sample=False, **kw), want), kw
    prompts = [ids_of(5)[0], ids_of(4)[0]]
    outs = model.generate(prompts, max_length=26, do_sample=False)
    for p, out in zip(prompts, outs):
        assert torch.equal(out, ref.generate(p[None], max_length=26, do_sample=False)[0])
    assert model.generate([], max_new_tokens=3) == []  # no prompts, no outputs (was transformers' AttributeError)
    with pytest.raises(kvpass.ConfigError, match="max_new_tokens >= 1"):
        model.generate(ids, max_new_tokens=0)
    with pytest.raises(kvpass.ConfigError, match="leaves no new token"):
        model.generate(prompts, max_length=5)
    with pytest.raises(kvpass.ConfigError, match="output_attentions=True"):
        model.generate(ids, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True)
    torch._dynamo.reset()


def test_stops_lengths_and_threads_give_the_uncompiled_tokens():
    """Calls a user makes that were silently wrong or failed:
    * a generation whose every row finished one step before ``max_new_tokens`` (an EOS, or a criterion of the
      caller's) got one more column (the loop, which reads "every row finished" one step late, broke at the
      length limit before reading it);
    * ``max_new_tokens`` in the generation config beside a ``max_length`` keyword: transformers takes the
      former, kvpass sized the cache from the latter and refused the sequence;
    * two threads' ``generate`` calls wrote into one kept cache (wrong tokens in both).
    Each now equals the uncompiled model."""
    import threading

    from transformers import StoppingCriteria, StoppingCriteriaList

    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(13)
    free = ref.generate(ids, max_new_tokens=12, do_sample=False)[0, 13:].tolist()
    k = next(i for i in range(10, 0, -1) if free[i] not in free[:i])  # a token first drawn at new token k
    for rows in (ids, torch.cat([ids, ids])):
        kw = dict(max_new_tokens=k + 2, eos_token_id=free[k], do_sample=False)  # drawn at the step before last
        want = ref.generate(rows, **kw)
        assert want.shape[1] == 13 + k + 1
        assert torch.equal(model.generate(rows, **kw), want)

    class AtLength(StoppingCriteria):  # the caller's own criterion: every row done at new token k + 1
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 13 + k + 1)

    kw = dict(max_new_tokens=k + 2, do_sample=False, stopping_criteria=StoppingCriteriaList([AtLength()]))
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    for m in (model, ref):
        m.generation_config.max_new_tokens = 30
    try:
        assert torch.equal(
            model.generate(ids, max_length=20, do_sample=False), ref.generate(ids, max_length=20, do_sample=False)
        )
    finally:
        for m in (model, ref):
            m.generation_config.max_new_tokens = None
    model.generate(ids_of(120), max_new_tokens=2)  # a kept cache large enough for both threads' sequences
    prompts = [ids_of(14), ids_of(15)]
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want, got = [ref.generate(p, **kw) for p in prompts], [None, None]

    def run(i):
        got[i] = model.generate(prompts[i], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "flags", [dict(multi_query=True, alibi=False), dict(multi_query=False, alibi=True)], ids=["multi_query", "alibi"]
)
def test_a_model_that_cannot_run_on_the_slot_cache_says_so(flags):
    """Falcon's ``multi_query`` config flag gives its attention one KV head where the config's head counts say
    four (the SlotCache is sized from those: the error blamed the batch size); its ALiBi builds its bias from a 2-D
    mask, which a static-shape cache's 4-D mask breaks (transformers' own error). Both now say what kvpass's fast
    path is and how to generate without it, and that way equals the uncompiled model. ALiBi's mask is one kvpass
    leaves unchanged (it may carry a bias), so generate now takes the model's own cache by itself, warned."""
    from transformers import DynamicCache, FalconConfig, FalconForCausalLM

    torch._dynamo.reset()
    cfg = FalconConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **flags,
    )
    cfg._attn_implementation = "sdpa"
    model, ref = (FalconForCausalLM(cfg).eval() for _ in range(2))
    ref.load_state_dict(model.state_dict())
    kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(10)
    expected = ref.generate(ids, max_new_tokens=4, do_sample=False)
    try:
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    except Exception as e:  # noqa: BLE001 - the error is checked below
        if flags["multi_query"]:
            assert "writes 1 KV heads per layer" in str(e) and "sized for 4" in str(e)
        if hasattr(e, "add_note"):
            assert any("kvpass.compile's fast path" in n for n in e.__notes__)
    else:  # transformers >= 5.25 gives a multi_query config its one KV head, which the SlotCache is sized from;
        # ALiBi's graph is left unchanged, so generate ran the model's own cache
        assert torch.equal(got, expected)
        assert flags["multi_query"] or model.generate.own_cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ALiBi: the graph is compiled unchanged, said once
        got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache(config=cfg))
    assert torch.equal(got, expected)
    torch._dynamo.reset()


def test_a_model_kvpass_leaves_unchanged_generates_on_its_own_cache():
    """GPT-Neo's eager attention is one kvpass does not recognise (the graph stays unchanged), and its local layers
    slice a causal buffer by the stored length: on a SlotCache (a StaticCache's layout) the prompt's logits were
    wrong, without a word. generate now refuses the SlotCache for such a graph, says so once and runs the model's
    own cache: the uncompiled tokens, at the first call and the next."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch._dynamo.reset()
    cfg = GPTNeoConfig(
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=16,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model, ref = (GPTNeoForCausalLM(cfg).eval() for _ in range(2))
    ref.load_state_dict(model.state_dict())
    kvpass.compile(model, "snapkv", budget=24, window=4, compiler="eager")
    for n in (40, 33):
        ids = ids_of(n)
        want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), n
        own = [str(w.message) for w in said if "runs on the model's own cache" in str(w.message)]
        assert len(own) == (n == 40) and "does not recognize" in model.generate.own_cache, own
    assert not model.generate.caches and "the model's own cache: node" in repr(model.generate)
    # a list of prompts, after that call and as a fresh model's first call: each alone, on the model's own cache
    prompts = [ids_of(12)[0], ids_of(20)[0].tolist()]
    torch._dynamo.reset()
    fresh = GPTNeoForCausalLM(cfg).eval()
    fresh.load_state_dict(model.state_dict())
    kvpass.compile(fresh, "snapkv", budget=24, window=4, compiler="eager")
    for m in (model, fresh):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = m.generate(prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for p, g in zip(prompts, got):
            p = torch.as_tensor(p)[None]
            assert torch.equal(g, ref.generate(p, max_new_tokens=4, do_sample=False, pad_token_id=0)[0])
    assert fresh.generate.own_cache
    torch._dynamo.reset()


def test_a_filled_slot_cache_and_a_shorter_prompt_is_refused():
    """A SlotCache of one's own passed again with a new, shorter prompt failed deep in the model (a reshape of
    0 elements): transformers took the prompt as a continuation. Refused with the fix (``reset``); a real
    continuation, and the reset cache, give the uncompiled tokens."""
    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    be = kvpass.compile(model, "full", compiler="eager")
    cache = kvpass.SlotCache(model, be, max_length=40, max_new_tokens=8)
    out = model.generate(ids_of(20), max_new_tokens=6, do_sample=False, past_key_values=cache)
    with pytest.raises(kvpass.ConfigError, match=r"already holds 25 tokens and a 12-token prompt.*reset\(\)"):
        model.generate(ids_of(12), max_new_tokens=6, do_sample=False, past_key_values=cache)
    more = torch.cat([out, ids_of(3)], 1)
    assert torch.equal(
        model.generate(more, max_new_tokens=4, do_sample=False, past_key_values=cache),
        ref.generate(more, max_new_tokens=4, do_sample=False),
    )
    cache.reset()
    assert torch.equal(
        model.generate(ids_of(12), max_new_tokens=6, do_sample=False, past_key_values=cache),
        ref.generate(ids_of(12), max_new_tokens=6, do_sample=False),
    )
    torch._dynamo.reset()


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_backend_state_follows_the_last_generation_on_either_cache(compiler):
    """``be.state`` (docs/guide.md's inspection line) reports the cache the last generation wrote, whichever kind:
    the SlotCache of ``kvpass.compile``'s generate, a DynamicCache passed in, the SlotCache again, a SlotCache of
    the user's own on a forward of their own; also under aot_eager, which hands the operators copies of the
    SlotCache's tensors (the prefill names its cache by the identity in its counts)."""
    from transformers import DynamicCache

    from kvpass.cache.slots import SlotCacheState

    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "streamingllm", compiler=compiler, budget=8, sinks=2)
    model.generate(ids_of(13), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    state = be.state
    assert isinstance(state, SlotCacheState) and state.seen == 20 and state.layers == 2
    assert all(n <= 9 for n in state.stored.values()) and state.evicted_tokens > 0
    model.generate(
        ids_of(13),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        past_key_values=DynamicCache(config=model.config),
    )
    assert not isinstance(be.state, SlotCacheState) and be.state.seen == 20
    assert be.state.stored_tokens() == be.state.stored == {0: 8, 1: 8}  # a SlotCacheState's name too
    model.generate(ids_of(5), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert isinstance(be.state, SlotCacheState) and be.state.seen == 7
    mine = kvpass.SlotCache(model, be, max_length=32)
    with torch.no_grad():
        model(ids_of(11), past_key_values=mine, use_cache=True)
    assert isinstance(be.state, SlotCacheState) and be.state.seen == 11
    torch._dynamo.reset()


def test_a_static_cache_under_dynamic_shapes_is_rewritten_not_refused():
    """transformers' StaticCache passed to a ``kvpass.compile``d model (``dynamic=True``): Dynamo traces its head
    dimension as a SymInt of a constant, which the pass took for a symbolic head count and refused with a
    nonsense reason ("query heads 4 are not a multiple of kv heads 2", graph unchanged). It is that int: the
    graph is rewritten, with no warning, and gives the uncompiled tokens."""
    from transformers import StaticCache

    torch._dynamo.reset()
    model, ref = build("llama"), build("llama")
    be = kvpass.compile(model, "full", compiler="eager")
    ids = ids_of(12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvpass.KVPassWarning)
        got = model.generate(
            ids, max_new_tokens=5, do_sample=False, past_key_values=StaticCache(config=model.config, max_cache_len=64)
        )
    assert torch.equal(got, ref.generate(ids, max_new_tokens=5, do_sample=False))
    assert all(not r.problems for r in be.reports)
    torch._dynamo.reset()


def test_recompile_limit_names_kvpass_and_the_fix(monkeypatch):
    """At Dynamo's recompile limit (here 3, and generate's own floor lowered to it: batch 1 takes two graphs,
    batch 2 needs more), the error says kvpass, what compiles graphs, why Dynamo recompiled and what to do,
    instead of torch's bare FailOnRecompileLimitHit."""
    from kvpass.generate import fastpath

    torch._dynamo.reset()
    monkeypatch.setattr(fastpath, "RECOMPILE_LIMIT", 3)
    model = build("llama")
    kvpass.compile(model, "full", compiler="eager")
    with torch._dynamo.config.patch(recompile_limit=3):
        model.generate(ids_of(12), max_new_tokens=3, do_sample=False)
        with pytest.raises(kvpass.ConfigError, match=r"kvpass: .*recompile_limit.*because.*torch._dynamo.reset\(\)"):
            model.generate(ids_of(12, b=2), max_new_tokens=3, do_sample=False)
    torch._dynamo.reset()


def test_generate_runs_with_a_recompile_limit_of_its_own_floor():
    """A generate call runs with Dynamo's recompile limit at least ``RECOMPILE_LIMIT`` (the graphs of ordinary
    use), the user's own where higher; the process's setting is left as it was."""
    from kvpass.generate import fastpath

    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "full", compiler="eager")
    seen = []
    forward = model.forward
    model.forward = lambda *a, **k: seen.append(torch._dynamo.config.recompile_limit) or forward(*a, **k)
    with torch._dynamo.config.patch(recompile_limit=4):
        model.generate(ids_of(12), max_new_tokens=2, do_sample=False)
        assert set(seen) == {fastpath.RECOMPILE_LIMIT} and torch._dynamo.config.recompile_limit == 4
    seen.clear()
    with torch._dynamo.config.patch(recompile_limit=100):
        model.generate(ids_of(12), max_new_tokens=2, do_sample=False)
        assert set(seen) == {100}
    torch._dynamo.reset()


def test_a_plain_forward_runs_under_generates_recompile_floor():
    """``model(ids)`` on a kvpass.compile'd model runs under generate's floor of the recompile limit: after generate
    calls of other shapes its graph is not refused at the process's lower limit (here 2), which stays as it was."""
    torch._dynamo.reset()
    model = build("llama")
    kvpass.compile(model, "full", compiler="eager")
    with torch._dynamo.config.patch(recompile_limit=2):
        model.generate(ids_of(12), max_new_tokens=2, do_sample=False)
        model.generate(ids_of(12, b=3), max_new_tokens=2, do_sample=False)
        with torch.no_grad():
            assert model(ids_of(9, b=2)).logits.shape[:2] == (2, 9)
        assert torch._dynamo.config.recompile_limit == 2
    torch._dynamo.reset()


def test_a_prompt_the_model_cannot_run_is_refused_before_dynamo_sees_it():
    """A mask of another shape than the prompt, an empty prompt, float or uint8 ids, 1-D ids or ids outside the
    vocabulary: kvpass's ConfigError, and the next call runs the graphs it had. (Dynamo's own failure on such a call
    marked the forward's frame as skipped: every later call compiled the layers piecemeal, with the policy on some of
    them, and gave other tokens; an id outside the vocabulary aborted the process in the compiled embedding's bounds
    check.)"""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "h2o", compiler="eager", budget=16)
    ids, kw = ids_of(30, b=2), dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    first = model.generate(ids, **kw)
    with pytest.raises(kvpass.ConfigError, match=r"'attention_mask' must have the prompt's shape \(2, 30\)"):
        model.generate(ids, attention_mask=torch.ones(2, 25, dtype=torch.long), **kw)
    with pytest.raises(kvpass.ConfigError, match="empty prompt"):
        model.generate(ids[:, :0], **kw)
    with pytest.raises(kvpass.ConfigError, match="'input_ids' must hold integer token ids, got dtype torch.float32"):
        model.generate(ids.float(), **kw)
    with pytest.raises(kvpass.ConfigError, match="'input_ids' must be torch.long .* got torch.uint8"):
        model.generate(ids.to(torch.uint8), **kw)
    with pytest.raises(kvpass.ConfigError, match=r"'input_ids' must be a \[batch, length\] tensor, got shape \(30,\)"):
        model.generate(ids[0], **kw)
    vocab = model.config.vocab_size
    for bad, value in [(vocab, vocab), (-1, -1)]:
        wrong = ids.clone()
        wrong[1, 7] = bad
        with pytest.raises(kvpass.ConfigError, match=rf"token id {value} at position \(1, 7\), outside .* {vocab} ids"):
            model.generate(wrong, **kw)
    assert torch.equal(model.generate(ids, **kw), first)
    assert be.graph_counts() == {"prefill": 1, "decode": 1}
    wrong = ids.clone()
    wrong[0, 3] = vocab + 2
    with pytest.raises(kvpass.ConfigError, match=r"model.forward\(\).*token id %d at position \(0, 3\)" % (vocab + 2)):
        model(wrong)  # a bare forward of a prompt (the compiled embedding's bounds check ended the process)
    with pytest.raises(kvpass.ConfigError, match="outside the model's vocabulary"):
        model(input_ids=wrong)
    with pytest.raises(kvpass.ConfigError, match=r"token id %d at position \(0, 0\)" % vocab):
        model(torch.tensor([[vocab]]))  # one token: checked on a CPU, where the bounds check ends the process
    assert torch.equal(model.generate(ids, **kw), first)
    torch._dynamo.reset()


def test_a_call_that_fails_inside_dynamo_leaves_the_forward_compiled():
    """An argument that fails inside Dynamo's trace (position ids of another length than the prompt) raises, each
    time, and the next valid call runs the graphs it had and gives the same tokens: Dynamo had marked the forward's
    frame as skipped, every later call compiled the layers piecemeal (graph counts 1/1 -> 4/2 and 10 without a
    site) and ran the model's own cache: other tokens. The failed compiles do not use up the recompile limit."""
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "h2o", compiler="eager", budget=16)
    ids, kw = ids_of(30, b=2), dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    first = model.generate(ids, **kw)
    for _ in range(2):
        with pytest.raises(Exception, match="position|size|shape"):
            model.generate(ids, position_ids=torch.zeros(2, 7, dtype=torch.long), **kw)
        assert torch.equal(model.generate(ids, **kw), first)
        assert {k: n for k, n in be.graph_counts().items() if k != "none"} == {"prefill": 1, "decode": 1}
    # failed compiles do not count against the recompile limit (16 while generate runs): a new kind of call compiles
    for _ in range(16):
        with pytest.raises(Exception, match="position|size|shape"):
            model.generate(ids, position_ids=torch.zeros(2, 7, dtype=torch.long), **kw)
    assert model.generate(ids[:1], **kw).shape == (1, 36)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# SlotCache misuse: each was a wrong answer or an error that named neither kvpass nor the fix
# ------------------------------------------------------------------------------------------------


def compiled(policy, **params):
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.backend(policy, compiler="eager", **params)
    model.forward = torch.compile(model.forward, backend=be, dynamic=True)
    return model, be


@pytest.mark.parametrize(
    "model_policy,cache_policy",
    [
        (("streamingllm", dict(budget=8)), ("full", {})),
        (("full", {}), ("streamingllm", dict(budget=8))),
        (("snapkv", dict(budget=8, window=4)), ("streamingllm", dict(budget=8))),
        (("streamingllm", dict(budget=8)), ("streamingllm", dict(budget=16))),
    ],
)
def test_cache_built_for_another_policy_is_refused(model_policy, cache_policy):
    """A SlotCache knows the configuration it was built for; a graph of another refuses, naming both (a
    ``full`` cache under streamingllm kept 15 entries where 8 were asked, a streamingllm cache under ``full``
    advised a larger max_length)."""
    model, _ = compiled(*model_policy[:1], **model_policy[1])
    other = kvpass.backend(cache_policy[0], compiler="eager", **cache_policy[1])
    cache = kvpass.SlotCache(model, other, max_length=40)
    with pytest.raises(
        Exception,
        match=r"kvpass: layer 0's kvpass.SlotCache was built for policy "
        rf"{cache_policy[0]}\(.*compiled with a kvpass backend of policy "
        rf"{model_policy[0]}\(.*kvpass.SlotCache\(model, be",
    ):
        model.generate(ids_of(20), past_key_values=cache, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize(
    "policy,params",
    [
        ("full", {}),
        ("snapkv", dict(budget=64, window=4)),
        ("streamingllm", dict(budget=64)),
        ("h2o", dict(budget=64)),
        ("raas", dict(budget=64)),
    ],
)
def test_past_max_length_fails_loudly_for_every_rule(policy, params):
    """A 20-token prompt and 24 new tokens on a cache built for 30 (budget 64: a no-op): every policy fails
    at the 11th token, rings too (streamingllm and h2o wrapped without a word and left the model's output
    from token 33 / 40 on), with a message naming max_length."""
    model, be = compiled(policy, **params)
    cache = kvpass.SlotCache(model, be, max_length=30, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="longer than the max_length the cache was built for"):
        model.generate(ids_of(20), past_key_values=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    cache = kvpass.SlotCache(model, be, max_length=30, max_new_tokens=4)
    with pytest.raises(ValueError, match="a 40-token prompt on a cache built for max_length=30"):
        model.generate(ids_of(40), past_key_values=cache, max_new_tokens=2, do_sample=False)


def test_cache_of_another_dtype_is_named():
    """A SlotCache built before ``model.to(bfloat16)``: the error names the cache and the fix (it was Dynamo's
    'Expected query, key, and value to have the same dtype')."""
    model, be = compiled("full")
    cache = kvpass.SlotCache(model, be, max_length=40)
    model.to(torch.bfloat16)
    with pytest.raises(
        Exception,
        match=r"kvpass SlotCache: the model computes torch.bfloat16 keys .* holds "
        r"torch.float32 .*build the SlotCache after model.to",
    ):
        model.generate(ids_of(20), past_key_values=cache, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(batch_size=0), "'batch_size' must be an int >= 1, got 0"),
        (dict(batch_size=2.0), "'batch_size' must be an int >= 1, got 2.0"),
        (dict(max_new_tokens=-5), "'max_new_tokens' must be an int >= 0 or None"),
        (dict(max_length=True), "'max_length' must be an int >= 1, got True"),
        (dict(dtype="bf16"), "'dtype' must be a torch.dtype"),
    ],
)
def test_slot_cache_arguments_are_checked(kw, match):
    model = build("llama")
    be = kvpass.backend("full", compiler="eager")
    args = {"max_length": 40, **kw}
    with pytest.raises(kvpass.ConfigError, match=match):
        kvpass.SlotCache(model, be, **args)
    with pytest.raises(kvpass.ConfigError, match="'backend' must be the kvpass.backend"):
        kvpass.SlotCache(model, "full", max_length=40)


def test_chunked_attention_config_is_refused():
    """A layer kind a slot cannot hold exactly (Llama 4's chunked attention, inferred as transformers infers it)
    is refused by name, not run as global attention."""
    model = build("llama")
    model.config.attention_chunk_size = 8
    with pytest.raises(kvpass.ConfigError, match="layer 0 of this model has 'chunked_attention' attention"):
        kvpass.SlotCache(model, kvpass.backend("full", compiler="eager"), max_length=40)


def test_mask_is_read_follows_the_mask_to_what_the_graph_does():
    """``maskcheck.mask_is_read``: a mask whose only uses are dead is not read; one that reaches the output, an
    in-place method, an item assignment, a non-aten operator (packet or overload) or a Python function of its own
    is; a graph without a mask input is assumed to read one."""
    from torch import fx

    from kvpass.compiler.maskcheck import mask_is_read

    def own(x, m):  # a Python function the check cannot see into
        return x

    def dead(x, attention_mask):
        attention_mask[:, 0] + 1
        return x * 2

    def read(x, attention_mask):
        return x + attention_mask[:, :1]

    def in_place(x, attention_mask):
        x.add_(attention_mask.sum())
        return x * 2

    def kvpass_op(x, attention_mask):
        torch.ops.kvpass.slot_append(x, x, attention_mask, attention_mask, x, x, [], 0, "", "")
        return x * 2

    def no_mask(x, y):
        return x + y

    got = {f.__name__: mask_is_read(fx.symbolic_trace(f)) for f in (dead, read, in_place, kvpass_op, no_mask)}
    g = fx.Graph()  # a call of a Python function of its own (kvpass's write_slots is one), as Dynamo records it
    x, m = g.placeholder("x"), g.placeholder("l_attention_mask_")
    g.call_function(own, (x, g.call_method("float", (m,))))
    g.output(g.call_function(torch.mul, (x, 2)))
    got["python_fn"] = mask_is_read(fx.GraphModule(torch.nn.Module(), g))
    g = fx.Graph()  # y = x * 2; y[0] = mask[0]; return y (symbolic_trace cannot record an item assignment)
    x, m = g.placeholder("x"), g.placeholder("l_attention_mask_")
    y = g.call_function(torch.mul, (x, 2))
    g.call_function(operator.setitem, (y, 0, g.call_function(operator.getitem, (m, 0))))
    g.output(y)
    got["set_item"] = mask_is_read(fx.GraphModule(torch.nn.Module(), g))
    assert got == {
        "dead": False,
        "read": True,
        "in_place": True,
        "kvpass_op": True,
        "set_item": True,
        "python_fn": True,
        "no_mask": True,
    }


@pytest.mark.parametrize("family", ["gemma3", "cohere2"])
def test_reused_mask_on_sliding_window_layers_equals_the_model(family):
    """Sliding-window families get a dict of masks (one per layer type) that changes every step as the window
    moves; the SlotCache decode reads neither (its sliding layers are rings read by position), so the first
    step's are passed again: 40 new tokens wrap the 8-slot rings five times and equal the uncompiled model's."""
    torch._dynamo.reset()
    model, ref = build(family), build(family)
    be = kvpass.compile(model, "full", compiler="eager")
    ids, kw = ids_of(30), dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    got = model.generate(ids, **kw)
    (cache,) = model.generate.caches.values()
    assert be.decode_ignores_mask(len(cache.layers))  # the reuse was on
    assert torch.equal(got, ref.generate(ids, **kw))
