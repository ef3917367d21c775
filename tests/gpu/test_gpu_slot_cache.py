"""SlotCache on CUDA: the decode step captured as a CUDA graph (``mode="reduce-overhead"``) equals the
same kvpass path run eagerly, token for token, over 256 decode steps that evict all along; the decode
graph is compiled once and replayed, never recompiled as the sequence grows."""

from __future__ import annotations

import os

import pytest
import torch
import transformers as tf

import kvpass

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

STEPS = 256
CASES = [
    ("full", {}),
    ("art", {}),
    ("streamingllm", dict(budget=64, sinks=4)),
    ("snapkv", dict(budget=64, window=8)),
    ("chunkkv", dict(budget=64, window=8)),
    ("snapkv+art", dict(budget=64, window=8)),
    ("streamingllm+art", dict(budget=64, sinks=4)),
    ("pyramidkv", dict(budget=64, window=8)),
    ("quest", dict(budget=64, dense_layers=1)),
    ("snapkv+quest", dict(budget=64, window=8, dense_layers=1)),
    ("raas", dict(budget=64)),
    ("raas+art", dict(budget=64)),
    ("asl", dict(budget=64, window=8, layer=1)),
    ("fastkv", dict(budget=64, window=8)),
    ("asl_2pass", dict(budget=64, window=8, layer=1)),
    ("gemfilter", dict(budget=64, layer=1)),
    ("h2o", dict(budget=64)),
    ("h2o+art", dict(budget=64)),
    ("tova", dict(budget=64)),
    ("knorm", dict(budget=64, window=0)),
    ("keydiff", dict(budget=64, window=0)),
    ("expected_attention", dict(budget=64)),
    # cuts between the replays every 64 steps (kvpass.compiler.cuts), in place on the graph's static slots
    ("expected_attention", dict(budget=64, decode_interval=64, decode_queries=32)),
    ("criticalkv", dict(budget=64, window=8)),
    ("adakv", dict(budget=64, window=8)),  # per-head layouts: ragged heads, a ring per streaming head
    (
        "duoattention",
        dict(
            pattern=os.path.join(os.path.dirname(__file__), "..", "data", "duo_pattern_gpu_llama4.tsv"),
            sinks=4,
            recent=32,
        ),
    ),
]


def model(sliding: bool = False):
    if sliding:  # Gemma-3 style: two sliding layers (window 64) per global layer, softcap-free, GQA
        cfg = tf.Gemma3TextConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=4096,
        )
        torch.manual_seed(0)
        return tf.Gemma3ForCausalLM(cfg).cuda().eval()
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).cuda().eval()


@torch.no_grad()
def decode(m, be, ids, mode=None):
    torch._dynamo.reset()
    fwd = torch.compile(m.forward, backend=be, mode=mode)
    cache = kvpass.SlotCache(
        m, be, max_length=ids.shape[1] + STEPS + 1, max_new_tokens=STEPS + 1, batch_size=ids.shape[0]
    )
    logits = fwd(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    toks, all_logits = [], [logits]
    for _ in range(STEPS):
        nxt = logits.argmax(-1, keepdim=True)
        toks.append(nxt)
        torch.compiler.cudagraph_mark_step_begin()
        logits = fwd(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].clone()
        all_logits.append(logits)
    return torch.cat(toks, -1).tolist(), all_logits, cache


def replay_equals_eager(m, policy, params):
    """Greedy decode of a 2 x 200 prompt with the eager compiler, then with Inductor + CUDA graphs: the
    same tokens, logits within 2e-3 (fp32 model), one decode graph replayed. Returns the cache."""
    ids = torch.randint(3, 250, (2, 200), generator=torch.Generator().manual_seed(1)).cuda()
    want, want_logits, _ = decode(m, kvpass.backend(policy, compiler="eager", **params), ids)
    be = kvpass.backend(policy, **params)
    got, got_logits, cache = decode(m, be, ids, mode="reduce-overhead")
    assert got == want
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
    phases = [r.phase for r in be.reports]
    assert phases == ["prefill", "decode"], phases  # one decode graph for all 256 steps
    assert be.reports[-1].cudagraphs and not be.reports[0].cudagraphs
    assert cache.seen == 200 + STEPS
    return cache


@pytest.mark.parametrize("policy,params", CASES, ids=[c[0] for c in CASES])
def test_cuda_graph_replay_equals_eager_kvpass(policy, params):
    cache = replay_equals_eager(model(), policy, params)
    if "budget" in params and policy != "quest":  # real memory: the slots are the capacity
        assert cache.layers[0].keys.shape[2] == cache.capacity < 200 + STEPS


@pytest.mark.parametrize(
    "policy,params",
    [("full", {}), ("snapkv", dict(budget=64, window=8)), ("raas", dict(budget=64))],
    ids=["full", "snapkv", "raas"],
)
def test_sliding_layers_cuda_graph_replay(policy, params):
    """Gemma-3 shape: the sliding layers are rings of 64 slots (wrapped by the 200-token prompt and by every
    decode step); replay equals the eager kvpass path, one decode graph."""
    cache = replay_equals_eager(model(sliding=True), policy, params)
    assert cache.capacities[:2] == [64, 64]


@pytest.mark.parametrize(
    "policy,params",
    [
        ("full", {}),
        ("streamingllm", dict(budget=64, sinks=4)),
        ("snapkv", dict(budget=64, window=8)),
        ("quest", dict(budget=64)),
        ("raas", dict(budget=64)),
        ("h2o", dict(budget=64)),
        ("art", dict(tau=0.5, phi=0.5, patience=1)),
        ("asl", dict(budget=64, window=8, layer=1)),
    ],
    ids=["full", "streamingllm", "snapkv", "quest", "raas", "h2o", "art", "asl"],
)
def test_compile_once_for_every_prompt_length(policy, params):
    """``kvpass.compile`` on CUDA (Inductor, CUDA graphs): seven prompt lengths over four capacity buckets
    through ``generate`` give the tokens of the same policy under the eager compiler, with one prefill and
    one decode graph for all of them (the capacity is symbolic; a new bucket re-records a CUDA graph)."""
    m, ref = model(), model()
    torch._dynamo.reset()
    be = kvpass.compile(m, policy, **params)
    want_be = kvpass.compile(ref, policy, compiler="eager", **params)
    for n in (40, 51, 90, 130, 200, 333, 100):
        ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(n)).cuda()
        got = m.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        want = ref.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
        assert got.tolist() == want.tolist(), n
    assert [r.phase for r in be.reports] == ["prefill", "decode"], [r.phase for r in be.reports]
    assert be.reports[-1].cudagraphs
    assert [r.phase for r in want_be.reports] == ["prefill", "decode"]


@pytest.mark.parametrize(
    "policy,params",
    [("full", {}), ("snapkv", dict(budget=64, window=8)), ("quest", dict(budget=64))],
    ids=["full", "snapkv", "quest"],
)
def test_decode_loop_equals_hf_loop_under_cuda_graphs(policy, params):
    """kvpass's decoding loop (queues the next CUDA-graph replay before it reads the stop flag, undoes the extra
    step) gives HF's loop's tokens (``return_dict_in_generate`` runs HF's), batch 2, when end-of-sequence
    tokens stop one row and then the other before ``max_new_tokens``."""
    m = model()
    torch._dynamo.reset()
    kvpass.compile(m, policy, **params)
    ids = torch.randint(3, 250, (2, 120), generator=torch.Generator().manual_seed(7)).cuda()
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
    free = m.generate(ids, **kw)
    assert torch.equal(free, m.generate(ids, **kw, return_dict_in_generate=True).sequences)
    eos = [int(free[0, 125]), int(free[1, 140])]
    ours = m.generate(ids, eos_token_id=eos, **kw)
    hf = m.generate(ids, eos_token_id=eos, **kw, return_dict_in_generate=True).sequences
    assert ours.shape[1] <= 141 and torch.equal(ours, hf), (ours, hf)


def test_decode_loop_sampled_stop_and_a_returned_cache_under_cuda_graphs():
    """On CUDA graphs: a sampled call stopped early by end-of-sequence tokens gives HF's loop's tokens and leaves
    the device's generator where HF's loop leaves it (the undone step's draw given back); a cache returned with
    ``return_dict_in_generate`` stays the caller's through a later call (which builds, and records, another)
    and continuing from it gives what a fresh prefill of the whole sequence gives."""
    m = model()
    torch._dynamo.reset()
    kvpass.compile(m, "full")
    ids = torch.randint(3, 250, (2, 120), generator=torch.Generator().manual_seed(9)).cuda()
    kw = dict(max_new_tokens=40, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(3)
    free = m.generate(ids, **kw)
    eos = [int(free[0, 125]), int(free[1, 140])]

    def sampled(**extra):
        torch.manual_seed(3)
        out = m.generate(ids, eos_token_id=eos, **kw, **extra)
        return getattr(out, "sequences", out), torch.rand(4, device="cuda")

    (ours, after_ours), (hf, after_hf) = sampled(), sampled(return_dict_in_generate=True)
    assert ours.shape[1] <= 141 and torch.equal(ours, hf), (ours, hf)
    assert torch.equal(after_ours, after_hf)
    greedy = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True)  # a 160-token bucket
    first = m.generate(ids[:1], **greedy)
    second = m.generate(ids[1:], **greedy)
    assert first.past_key_values is not second.past_key_values and first.past_key_values.seen == 139
    more = torch.cat([first.sequences, ids[1:, :5]], 1)
    got = m.generate(more, past_key_values=first.past_key_values, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, m.generate(more, max_new_tokens=6, do_sample=False))


class _Bytes:
    """kvzip's repeat prompts as byte ids (the random model has no tokenizer)."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_kvzip_through_generate_replays_what_eager_decodes():
    """kvzip's repeat passes over its SlotCache prefill, then the budget-sized cache decoded under CUDA graphs: the
    tokens of the same path compiled eagerly, a batch of two, three passes."""
    ids = torch.randint(3, 250, (2, 200), generator=torch.Generator().manual_seed(1)).cuda()
    outs = []
    for compiler in ("eager", "inductor"):
        torch._dynamo.reset()
        m = model()
        kvpass.compile(m, "kvzip", budget=64, chunk_size=80, tokenizer=_Bytes(), compiler=compiler)
        outs.append(m.generate(ids, max_new_tokens=64, do_sample=False))
    assert torch.equal(outs[0], outs[1])
