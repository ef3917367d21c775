"""Tensor parallelism: every policy decides on two ranks what it decides on one process.

Two processes (``torchrun``, gloo on the CPU, ``tests/tp_worker.py``) load a tiny model with transformers'
tensor-parallel plan (``tp_plan="auto"``: each rank holds half the heads) and generate with the plain policies'
demanding settings (``tests/conformance.py``; on the CPU those whose decisions span a layer's heads (the gated
family by three of its five) and one per-head policy of each rewrite kind, on two GPUs every one), then run the
same on one process (half each). Two
families: the conformance Llama (4 query heads, 2 KV heads: one KV head per rank), on a DynamicCache and on a
kvpass.SlotCache, and a Qwen3 (q/k norms) with 8 query heads on 2 KV heads, a GQA ratio (4) above the rank
count, on a DynamicCache (the SlotCache path is the same code per rank; one family keeps CI's time).

Checked per policy and cache: the tokens equal the single process's token for token, both ranks agree, each
rank's KV heads hold the positions the same heads hold on one process (the decision itself), each layer stores
half the KV heads; the pass reports the rank's share of the heads, and
the policies whose decisions span a layer's heads (chunkkv's chunk ranking, the gated policies' selection
layer and tokens) get an all_gather inserted while per-head policies get none. Chunk fusion (``kvpass.ChunkFusion``,
``FUSION_ON_CPU`` on the CPU, every fusion policy on two GPUs; one store shared by the ranks) recomputes the same
tokens, keeps the same positions per head and generates the same tokens as on one process. ``kvpass.explain`` on a rank
shows its local heads and the gathers. chunkkv also runs under Inductor (the gathers compiled with the graph).
``kvpass.compile``'s fast path
on two ranks compiles one prefill and one decode graph for prompts of four lengths and generates the
single process's tokens, alone and admitted into a ``RequestQueue`` of two rows, each rank's caches holding half
the KV heads.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers as tf

from conformance import CONFORMANCE
from families import COMMON, build, skip_uneven_layers_on_old_stacks
from tp_worker import FUSION_RUNS

HERE = os.path.dirname(__file__)
PLAIN = sorted(n for n, e in CONFORMANCE.items() if not e.driver)
SPANNING = {"chunkkv", "asl", "asl_fullkv", "asl_2pass", "fastkv", "gemfilter"}  # decisions over a layer's heads
# on the CPU (CI time): the gated family's selection is one code path; asl_fullkv and fastkv are asl with another
# layer kept whole or a fixed gate, so asl, asl_2pass (two passes) and gemfilter (renumbered positions) stand for it
SPANNING_ON_CPU = SPANNING - {"asl_fullkv", "fastkv"}
PER_HEAD = {"snapkv"}  # the second family's share of the per-head policies (the llama runs the rest)
# the llama's per-head policies on the CPU (CI time): one of each rewrite kind (append, evict at prefill, ring,
# placed by a score, pages read, page pool), criticalkv, which reads its rank's shard of the output projection,
# adakv and duoattention, whose ranks keep their heads' ranges in one pool (duoattention's heads of different
# counts: a SlotCache sized for the rank whose share needs most); every per-head policy decides on its rank's
# heads alone through the same path (art's stop rule runs inside the decode attention of each head, as quest's
# page reads do), and the GPU run (device "cuda") runs them all
LOCAL = {"full", "snapkv", "streamingllm", "h2o", "quest", "raas", "criticalkv", "adakv", "duoattention"}
SPANNING_FUSION = ("a3",)  # the second family's fusion: a recompute set summed over every head (the llama: all)
# on a SlotCache (CI time): an evicting prefill, pages read, a gate, a decision over heads, heads of different
# counts (duoattention); the others' slot writes (an append, a ring, pages evicted) are the same rules on each
# rank's heads (tests/test_conformance.py covers them all on one process)
ON_SLOTS = ("snapkv", "quest", "asl", "chunkkv", "duoattention")
FAMILIES = ("llama", "qwen3_gqa4")
COMPILED = ("full", "snapkv")  # through kvpass.compile (the llama only; on the CPU snapkv alone: CI time)
# chunk fusion on the CPU (CI time): a recompute with eviction on both caches, a recompute spanning heads, a reuse
# of a prefix; the GPU run fuses with every FUSION_RUNS entry
FUSION_ON_CPU = ("a3+evict", "a3+evict:slot", "cacheblend", "legolink")

# one xdist worker runs the module (--dist loadfile): its fixture is built once per family, each build two processes
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


def _qwen3_gqa4():
    cfg = tf.Qwen3Config(**{**COMMON, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16})
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharp logits: greedy tokens stable (tests/families.py)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=FAMILIES)
def ranks(request, tmp_path_factory):
    """(rank 0's results, rank 1's results) of one family's two-process run."""
    family = request.param
    return two_ranks(tmp_path_factory.mktemp(f"tp_{family}"), family, "cpu")


def two_ranks(root, family: str, device: str):
    """Run ``tests/tp_worker.py`` on two ranks for ``family`` (``device`` cpu: gloo; cuda: NCCL, two GPUs)."""
    (build("llama") if family == "llama" else _qwen3_gqa4()).save_pretrained(root / "model")
    # CI time: the second family (GQA 4 over 2 ranks) runs the policies whose decisions span a layer's heads, one
    # that decides per head, and the fusion policies whose recompute set spans the heads; the llama runs all
    full = family == "llama" or device == "cuda"
    spanning = SPANNING if device == "cuda" else SPANNING_ON_CPU
    plain = PLAIN if device == "cuda" else sorted(spanning | LOCAL)
    names = plain + (["chunkkv@inductor"] if family == "llama" else []) if full else sorted(spanning | PER_HEAD)
    caches = "dynamic,slot" if full else "dynamic"
    fusion = ("all" if device == "cuda" else ",".join(FUSION_ON_CPU)) if full else ",".join(SPANNING_FUSION)
    compiled = (COMPILED if device == "cuda" else COMPILED[1:]) if full else ()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        os.path.join(HERE, "tp_worker.py"),
        "--model",
        str(root / "model"),
        "--out",
        str(root),
        "--policies",
        ",".join(names),
        "--caches",
        caches,
        "--device",
        device,
        "--fusion",
        fusion,
        "--compiled",
        ",".join(compiled),
    ] + (["--slot-policies", ",".join(ON_SLOTS)] if device == "cpu" else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    r0, r1 = (json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1))
    if "skip" in r0:  # the model cannot be compiled as one graph on this transformers (the worker says why)
        pytest.skip(r0["skip"])
    for part in ("single", "single_fusion", "single_compiled"):  # each rank ran half of the one-process references
        r0[part].update(r1[part])
    return r0, r1


def _runs(
    ranks,
    key,
    part="tp",
    single="single",
    why="the llama runs LOCAL and SPANNING_ON_CPU on a DynamicCache and "
    "ON_SLOTS on a SlotCache, the second family the policies whose decisions span heads",
):
    """Rank 0's, rank 1's and the one-process run of ``key`` in ``part``, none of them an error."""
    r0, r1 = ranks
    cache, _, policy = key.partition(":")
    if cache == "dynamic":
        skip_uneven_layers_on_old_stacks(policy)  # the GPU machine's transformers 5.17: the model's own trace fails
    if key not in r0[part]:
        pytest.skip(f"{key}: not run for this family (CI time: {why})")
    tp0, tp1, one = r0[part][key], r1[part][key], r0[single][key]
    for what, run in (("rank 0", tp0), ("rank 1", tp1), ("one process", one)):
        assert "error" not in run, f"{key} on {what}: {run.get('error')}"
    return tp0, tp1, one


@pytest.mark.parametrize("cache", ["dynamic", "slot"])
@pytest.mark.parametrize("policy", PLAIN)
def test_two_ranks_decide_as_one_process(ranks, policy, cache):
    tp0, tp1, one = _runs(ranks, f"{cache}:{policy}")
    assert tp0["tokens"] == one["tokens"], f"{policy} on a {cache} cache: tokens differ from one process"
    assert tp1["tokens"] == tp0["tokens"], f"{policy}: the two ranks generated different tokens"
    if not one["per_head"]:  # a per-head layout's rows are not heads: its heads are compared one by one below
        assert tp0["kept"] == one["kept"] == tp1["kept"], f"{policy}: entries kept per layer differ"
    assert [2 * h for h in tp0["kv_heads"]] == one["kv_heads"], "each rank stores half the KV heads"
    for rank, tp in enumerate((tp0, tp1)):  # each rank's heads hold what the same heads hold on one process
        for layer, (mine, whole) in enumerate(zip(tp["positions"], one["positions"])):
            h = tp["kv_heads"][layer]
            assert mine == (None if whole is None else whole[rank * h : (rank + 1) * h]), (
                f"{policy} on a {cache} cache, rank {rank}, layer {layer}: other positions kept than one process"
            )
    assert not tp0["problems"] and not one["problems"], tp0["problems"] or one["problems"]
    assert tp0["tp"] and all(line.startswith("tensor parallel: rank 0 of 2") for line in tp0["tp"]), tp0["tp"]
    assert one["tp"] == [""]


@pytest.mark.parametrize("policy", PLAIN)
def test_gathers_only_where_decisions_span_heads(ranks, policy):
    tp0, _, one = _runs(ranks, f"dynamic:{policy}")
    if policy in SPANNING:
        assert tp0["reductions"] and all("all_gather over 2 ranks" in r for r in tp0["reductions"])
    else:
        assert tp0["reductions"] == [], f"{policy} decides per KV head; no collective is needed"
    assert one["reductions"] == []


def test_inductor_compiles_the_gathers(ranks):
    tp0, tp1, one = _runs(ranks, "dynamic:chunkkv@inductor")
    assert tp0["tokens"] == tp1["tokens"] == one["tokens"] == ranks[0]["single"]["dynamic:chunkkv"]["tokens"]
    assert tp0["reductions"]


@pytest.mark.parametrize("policy", FUSION_RUNS)
def test_chunk_fusion_on_two_ranks_fuses_as_one_process(ranks, policy):
    r0, r1 = ranks
    tp0, tp1, one = _runs(ranks, policy, "fusion", "single_fusion", "the llama fuses FUSION_ON_CPU on the CPU")
    # the recompute set spans the heads (a3: the question's attention, cacheblend: key deviation, summed over
    # every head of every rank); a3+evict's kept documents are per KV head
    assert tp0["recompute"] == tp1["recompute"] == one["recompute"], f"{policy}: another recompute set"
    assert tp0["tokens"] == tp1["tokens"] == one["tokens"], f"{policy}: tokens differ from one process"
    for rank, tp in enumerate((tp0, tp1)):
        for layer, (mine, whole) in enumerate(zip(tp["positions"], one["positions"])):
            h = tp["kv_heads"][layer]
            assert 2 * h == one["kv_heads"][layer], "each rank stores half the KV heads"
            assert mine == whole[rank * h : (rank + 1) * h], f"{policy}, rank {rank}, layer {layer}: other positions"
    assert tp0["stored"] >= 2 * one["stored"] > 0, "each rank stores its own heads' chunk KV under its own key"
    assert r0["pinned"] != r1["pinned"], "a pinned fingerprint must still tell the ranks' entries apart"


@pytest.mark.parametrize("policy", COMPILED)
def test_kvpass_compile_on_two_ranks_compiles_once_for_every_length(ranks, policy):
    tp0, tp1, one = _runs(ranks, policy, "compiled", "single_compiled", "the llama compiles snapkv on the CPU")
    assert tp0["tokens"] == tp1["tokens"] == one["tokens"], f"{policy}: tokens differ from one process"
    assert tp0["queued"] == tp1["queued"] == one["queued"], f"{policy}: a RequestQueue's tokens differ"
    assert tp0["graphs"] == tp1["graphs"] == one["graphs"] == {"prefill": 1, "decode": 1}, (
        tp0["graphs"],
        one["graphs"],
    )
    assert tp0["graphs_with_queue"] == one["graphs_with_queue"] == {"prefill": 2, "decode": 2}  # its batch of two
    assert [2 * h for h in tp0["kv_heads"]] == one["kv_heads"], "each rank's caches hold half the KV heads"
    # the split weights reach the compiler as local tensors whose specs the callable checks: Dynamo's per-call
    # spec guards are dropped on the ranks (one process has no DTensor)
    assert tp0["spec_guards_dropped"] > 0 and tp1["spec_guards_dropped"] > 0 and one["spec_guards_dropped"] == 0
    # direct steps (the default): each rank called its decode graph without Dynamo's frame (after two steps
    # watched per call) as often as one process, with one process's tokens (tests/test_direct_steps.py: a
    # process's direct steps give its usual tokens)
    assert tp0["direct_steps"] == tp1["direct_steps"] == one["direct_steps"] > 0, (tp0["direct_steps"], one)


def test_explain_shows_the_local_heads_and_the_gathers(ranks):
    for rank, r in enumerate(ranks):
        text = r["explain"]
        assert f"tensor parallel: rank {rank} of 2" in text and "(heads and kv_heads above are this rank's)" in text
        assert "reductions: layer 0: selection votes all_gather over 2 ranks" in text, text


@pytest.mark.parametrize(
    "name, module, unwrapped",
    [
        ("from_local", "torch.distributed.tensor._api", True),  # torch 2.13's Dynamo: the function itself
        ("prim from_local", "torch._dynamo.variables.torch", True),  # torch 2.11's: a closure over it, so named
        ("from_local", "user_code", False),
    ],
)  # someone else's function of that name
def test_token_ids_are_found_behind_either_traced_from_local(name, module, unwrapped):
    """The token ids a rank's embedding reads are a graph input behind ``DTensor.from_local`` (transformers 5.24
    wraps them so, Llama and Qwen3), however Dynamo named the call; the gate's second prefill gathers them by
    that (under torch 2.11 it refused them as an input it could not tell)."""
    from kvpass.compiler.detect import _token_ids

    def wrap(x):
        return x

    wrap.__name__, wrap.__module__ = name, module
    g = torch.fx.Graph()
    ids, weight = g.placeholder("ids"), g.placeholder("weight")
    ids.meta["example_value"] = torch.zeros(1, 4, dtype=torch.long)
    emb = g.call_function(torch.nn.functional.embedding, (g.call_function(wrap, (ids,)), weight))
    g.output(emb)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert (_token_ids(gm) is ids) == unwrapped
