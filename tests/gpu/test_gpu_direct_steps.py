"""``kvpass.compile(..., direct_steps=True)`` on CUDA with Inductor and ``mode="reduce-overhead"``: decode steps
that call the compiled graph without Dynamo's frame (Inductor's CUDA graph replayed inside it) generate the usual
tokens over 96 steps, greedy and sampled, one row and two, for an appending, an evicting and a paged cache, with
one graph per phase, and a call takes no longer than the usual one (a CUDA graph recorded again per step would)."""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

import kvpass

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 96


def model():
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
    m = tf.LlamaForCausalLM(cfg).cuda().eval()
    m.generation_config.eos_token_id = None
    return m


def run(m, be, ids, sample: bool, direct: bool):
    be.direct_steps = direct
    torch.manual_seed(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = m.generate(ids, max_new_tokens=NEW, do_sample=sample)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


@pytest.mark.parametrize(
    "policy, params", [("full", {}), ("snapkv", dict(budget=64, window=8)), ("raas", dict(budget=64))]
)
@pytest.mark.parametrize("rows, sample", [(1, False), (2, True)])
def test_direct_steps_replay_the_graph_and_generate_the_usual_tokens(policy, params, rows, sample):
    torch._dynamo.reset()
    m = model()
    be = kvpass.compile(m, policy, **params)
    ids = torch.randint(3, 250, (rows, 200), generator=torch.Generator().manual_seed(rows)).cuda()
    run(m, be, ids, sample, False)  # compiles and records the CUDA graphs
    usual, t_usual = run(m, be, ids, sample, False)
    direct, t_direct = run(m, be, ids, sample, True)
    assert torch.equal(usual, direct), f"{policy}: direct steps changed the tokens"
    steps = be.last_direct_steps
    assert steps.refused is None and steps.direct == NEW - 4, steps
    assert be.graph_counts() == {"prefill": 1, "decode": 1}
    assert all(r.cudagraphs for r in be.reports if r.phase == "decode")
    assert t_direct <= 1.1 * t_usual, (t_direct, t_usual)
