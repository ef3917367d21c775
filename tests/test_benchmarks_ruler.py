"""kvpass.eval.benchmarks' RULER, InfiniteBench and reasoning (AIME 2025, MATH-500) loaders and metrics: fixtures in
each dataset's own format (tests/data/benchmarks/{ruler,infinitebench,reasoning}), the whitespace WordTokenizer, no
model and no download."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from benchmark_tokenizer import WordTokenizer
from kvpass.eval.benchmarks import _io, reasoning, ruler
from kvpass.eval.benchmarks import infinitebench as ib

DATA = Path(__file__).parent / "data" / "benchmarks"
RULER_KV, RULER_RAW = DATA / "ruler" / "kvpress", DATA / "ruler" / "official"
IB_RAW, IB_KV = DATA / "infinitebench" / "official", DATA / "infinitebench" / "kvpress"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def words(text: str) -> str:
    """What WordTokenizer.decode gives back for ``text``."""
    return " ".join(text.split())


class ChatWordTokenizer(WordTokenizer):
    """WordTokenizer with a chat template: "<|user|> {content} <|end|> " per message, "<|assistant|> " to generate."""

    chat_template = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        assert tokenize is False
        self.calls.append(kwargs)
        text = "".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in messages)
        return text + ("<|assistant|> " if add_generation_prompt else "")


def check_cut(load, path, tok_factory, cut_to: int, **kw):
    """Loading with ``max_length`` keeps the first and last halves of each full prompt."""
    full_tok, tok = tok_factory(), tok_factory()
    full = load(path, full_tok, **kw)
    short = load(path, tok, max_length=cut_to, **kw)
    assert len(full) == len(short)
    for f, s in zip(full, short):
        if f.meta["length"] <= cut_to:
            assert s.meta["cut"] is False and full_tok.decode(f.input_ids) == tok.decode(s.input_ids)
            continue
        assert s.meta["cut"] is True and s.meta["length"] == len(s.input_ids) == cut_to
        head, tail = cut_to // 2, cut_to - cut_to // 2
        assert tok.decode(s.input_ids[:head]) == full_tok.decode(f.input_ids[:head])
        assert tok.decode(s.input_ids[head:]) == full_tok.decode(f.input_ids[-tail:])


# ============================================================================================
# RULER


def test_ruler_kvpress_format_prompt_without_chat_template():
    tok = WordTokenizer()
    tasks = ruler.load(RULER_KV / "4096", tok)
    source = rows(RULER_KV / "4096" / "test.jsonl")
    assert [t.name for t in tasks] == [
        "ruler/niah_single_1",
        "ruler/niah_single_1",
        "ruler/niah_multivalue",
        "ruler/vt",
        "ruler/qa_1",
        "ruler/qa_1",
    ]  # RULER's task order
    by_task = {}
    for r in source:
        by_task.setdefault(r["task"], []).append(r)
    ordered = [r for name in ruler.TASKS for r in by_task.get(name, [])]
    for t, r in zip(tasks, ordered):
        # kvpress without a chat template: BOS + context | question + "\n" + answer_prefix
        assert t.input_ids[0] == tok.bos_token_id
        assert tok.decode(t.input_ids) == words(f"{r['context']} {r['question']}\n{r['answer_prefix']}")
        assert t.meta["context_tokens"] == 1 + len(r["context"].split())
        assert t.meta["length"] == len(t.input_ids) and t.meta["cut"] is False
        assert t.meta["format"] == "kvpress" and t.meta["context_length"] == 4096 and t.meta["chat"] is False
        assert t.answers == r["answer"] and t.max_new_tokens == r["max_new_tokens"]
        assert t.metric == ("ruler_string_match_part" if r["task"] == "qa_1" else "ruler_string_match_all")
    text = tok.decode(tasks[0].input_ids)
    assert text.index("hidden") < text.index("7391042") < text.index("What") < text.index("mentioned in the text is")


def test_ruler_kvpress_format_prompt_with_chat_template():
    tok = ChatWordTokenizer()
    task = ruler.load(RULER_KV / "4096", tok, subsets=["vt"])[0]
    r = next(r for r in rows(RULER_KV / "4096" / "test.jsonl") if r["task"] == "vt")
    # one user turn holds context + question; the generation prompt, then the answer prefix, follow the question
    assert tok.decode(task.input_ids) == words(
        f"<|user|> {r['context']} {r['question']} <|end|> <|assistant|> {r['answer_prefix']}"
    )
    assert task.input_ids[0] != tok.bos_token_id  # the template carries any BOS, not the loader
    assert task.meta["context_tokens"] == 1 + len(r["context"].split())  # "<|user|>" + the context
    assert task.meta["chat"] is True and tok.calls == [{"enable_thinking": False}]


def test_ruler_official_format_prompt_and_gen_length():
    tok = WordTokenizer()
    tasks = ruler.load(RULER_RAW, tok)
    assert [t.name for t in tasks] == ["ruler/niah_single_1", "ruler/niah_single_1", "ruler/cwe", "ruler/qa_2"]
    niah = rows(RULER_RAW / "4096" / "niah_single_1" / "validation.jsonl")
    for t, r in zip(tasks[:2], niah):
        assert t.input_ids[0] == tok.bos_token_id
        assert tok.decode(t.input_ids) == words(r["input"] + r["answer_prefix"])  # input, then answer_prefix
        assert t.meta["id"] == r["index"] and t.meta["ruler_length"] == r["length"]
        assert t.meta["format"] == "ruler" and t.meta["context_length"] == 4096
        assert t.max_new_tokens == 128 and t.answers == r["outputs"] and t.metric == "ruler_string_match_all"
    cwe, qa = tasks[2], tasks[3]
    assert cwe.max_new_tokens == 120 and cwe.answers == ["kettle", "maple", "violin"]
    # older RULER output: no answer_prefix field, the prefix ends the input
    (old,) = rows(RULER_RAW / "4096" / "qa_2" / "validation.jsonl")
    assert "answer_prefix" not in old and tok.decode(qa.input_ids) == words(old["input"])
    assert qa.max_new_tokens == 32 and qa.metric == "ruler_string_match_part"


def test_ruler_lengths_subsets_limit():
    tok = WordTokenizer()
    both = ruler.load(RULER_KV, tok, subsets=["niah_single_1"])
    assert [t.meta["context_length"] for t in both] == [4096, 4096, 8192]
    assert [t.answers for t in both] == [["7391042"], ["5520913"], ["2048731"]]
    assert [t.meta["id"] for t in both] == [0, 1, 0]
    one = ruler.load(RULER_KV, tok, subsets=["niah_single_1", "qa_1"], limit=1)
    assert [(t.name, t.meta["context_length"]) for t in one] == [
        ("ruler/niah_single_1", 4096),
        ("ruler/qa_1", 4096),
        ("ruler/niah_single_1", 8192),
    ]
    single_file = ruler.load(RULER_RAW / "4096" / "cwe" / "validation.jsonl", tok)
    assert [t.name for t in single_file] == ["ruler/cwe"] and single_file[0].meta["context_length"] == 4096
    with pytest.raises(ValueError, match=r"unknown RULER subset 'niah_single_9'.*known: niah_single_1"):
        ruler.load(RULER_KV, tok, subsets=["niah_single_9"])
    with pytest.raises(ValueError, match=r"no rows for RULER task\(s\) fwe.*tasks found: niah_single_1, cwe, qa_2"):
        ruler.load(RULER_RAW, tok, subsets=["fwe"])


def test_ruler_middle_truncation_keeps_both_ends():
    check_cut(ruler.load, RULER_KV / "4096", WordTokenizer, 20)
    check_cut(ruler.load, RULER_RAW, WordTokenizer, 17)


def test_ruler_errors_name_the_file_and_the_field(tmp_path):
    folder = tmp_path / "4096" / "vt"
    folder.mkdir(parents=True)
    (folder / "validation.jsonl").write_text(json.dumps({"index": 0, "input": "x", "length": 3}) + "\n")
    with pytest.raises(ValueError, match=r"validation.jsonl: rows with fields index, input, length are in no RULER"):
        ruler.load(tmp_path, WordTokenizer())
    (folder / "validation.jsonl").write_text(
        json.dumps({"context": "c", "question": "q", "answer": ["a"], "answer_prefix": "A:", "task": "vt"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"validation.jsonl: a row has no field 'max_new_tokens'.*kvpress RULER"):
        ruler.load(tmp_path, WordTokenizer())
    loose = tmp_path / "loose.jsonl"
    loose.write_text(json.dumps({"index": 0, "input": "x", "outputs": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"loose.jsonl: its rows have no 'task' field"):
        ruler.load(loose, WordTokenizer())
    with pytest.raises(ValueError, match=r"name the context length.*simonjegou/ruler/4096"):
        ruler.load("simonjegou/ruler", WordTokenizer())


def test_ruler_metrics_all_vs_part():
    m = ruler.METRICS
    answers = ["1180345", "6624017"]
    assert m["ruler_string_match_all"](answers, " The numbers are 1180345 and 9999999.", {}) == 0.5
    assert m["ruler_string_match_part"](answers, " The numbers are 1180345 and 9999999.", {}) == 1.0
    assert m["ruler_string_match_all"](answers, "6624017, 1180345", {}) == 1.0
    assert m["ruler_string_match_part"](answers, "none of them", {}) == 0.0
    assert m["ruler_string_match_all"](["KQWLE", "PZMTA"], "kqwle pzmta", {}) == 1.0  # case-insensitive
    assert m["ruler_string_match_all"](["7"], "17", {}) == 1.0  # a plain substring test
    # control characters: RULER turns them into newlines, kvpress deletes them
    assert m["ruler_string_match_all"](["ab"], "a\tb", {"postprocess": "control_to_newline"}) == 0.0
    assert m["ruler_string_match_all"](["ab"], "a\tb", {"postprocess": "delete_control"}) == 1.0
    task = ruler.load(RULER_KV / "4096", WordTokenizer(), subsets=["niah_multivalue"])[0]
    assert m[task.metric](task.answers, "1180345 and 6624017", task.meta) == 1.0


def test_kvpress_prompt_marker_and_cut_middle():
    tok = ChatWordTokenizer()
    ids, n = _io.kvpress_prompt(tok, "ctx <<kvpass-question>> more", "q?", "A:")
    assert tok.decode(ids) == "<|user|> ctx <<kvpass-question>> more q? <|end|> <|assistant|> A:" and n == 4
    assert _io.cut_middle(list(range(10)), 4) == ([0, 1, 8, 9], True)
    assert _io.cut_middle(list(range(3)), 4) == ([0, 1, 2], False)
    # a text is cut by the same rule once tokenized
    assert _io.prompt_ids(WordTokenizer(), "a b c d e f g h i", 4) == ([1, 3, 10, 11], True)


# ============================================================================================
# InfiniteBench


def fill(template: str, **fields) -> str:
    return template.format(**fields)


def test_infinitebench_official_prompts_in_order():
    tok = WordTokenizer()
    tasks = ib.load(IB_RAW, tok)
    assert [t.name.split("/")[1] for t in tasks] == [
        "longbook_sum_eng",
        "longbook_qa_eng",
        "longbook_choice_eng",
        "longdialogue_qa_eng",
        "longbook_qa_chn",
        "code_debug",
        "code_run",
        "math_calc",
        "math_find",
        "passkey",
        "passkey",
        "number_string",
        "kv_retrieval",
    ]
    by = {}
    for t in tasks:
        by.setdefault(t.meta["subset"], []).append(t)
    for name, ts in by.items():
        for t, r in zip(ts, rows(IB_RAW / f"{name}.jsonl")):
            fields = {"context": r["context"], "input": r["input"], "question": r["input"]}
            fields.update({f"OPTION_{c}": o for c, o in zip("ABCD", r["options"])})
            fields.update(
                func="func_1", func_call="func_1(4)", prefix="Find the largest number in the list of numbers below."
            )
            assert t.input_ids[0] == tok.bos_token_id
            assert tok.decode(t.input_ids) == words(fill(ib.PROMPTS[name], **fields)), name
            assert t.max_new_tokens == ib.MAX_NEW_TOKENS[name] and t.metric == ib.METRIC[name]
            assert t.meta["template"] == "kvpass" and t.meta["format"] == "official"
            assert t.meta["display"] == ib.DISPLAY[name] and t.meta["length"] == len(t.input_ids)
    choice = by["longbook_choice_eng"][0]
    assert choice.answers == ["Walking the dog", "B"]  # the option's text and its letter
    assert choice.meta["options"] == ["Baking bread", "Walking the dog", "Reading letters", "Feeding hens"]
    text = tok.decode(choice.input_ids)
    assert text.index("Mara") < text.index("Question:") < text.index("A. Baking") < text.index("D. Feeding")
    assert by["code_debug"][0].answers == ["gamma", "C"]
    assert by["math_calc"][0].answers == ["3", "7", "5", "15"]
    assert by["math_find"][0].answers == ["88"] and by["code_run"][0].answers == ["14"]
    assert by["passkey"][1].meta["id"] == 1


def test_infinitebench_templates_file_subsets_limit(tmp_path):
    for name in ("passkey", "math_find", "code_run"):
        shutil.copy(IB_RAW / f"{name}.jsonl", tmp_path)
    templates = {
        "passkey": "PK-HEAD {context} PK-ASK {input} PK-LEAD",
        "math_find": "{prefix} {context} {input}",
        "math_find_prefix": "Which is {target}?",
        "code_run": "RUN {func} {context} CALL {func_call} IS",
    }
    (tmp_path / "templates.json").write_text(json.dumps(templates))
    tok = WordTokenizer()
    tasks = ib.load(tmp_path, tok, subsets=["Retrieve.PassKey", "math_find", "code_run"], limit=1)
    assert [t.meta["subset"] for t in tasks] == ["code_run", "math_find", "passkey"]  # README order, 1 row each
    run, find, pk = tasks
    r = rows(IB_RAW / "passkey.jsonl")[0]
    assert tok.decode(pk.input_ids) == words(f"PK-HEAD {r['context']} PK-ASK {r['input']} PK-LEAD")
    assert pk.meta["template"] == "official"
    # {target} is what create_prompt takes from "The largest number of the list is:"
    assert tok.decode(find.input_ids).startswith("Which is the largest number? [31, 7, 88, 12, 54] What is")
    assert tok.decode(run.input_ids).startswith("RUN func_1 def func_1(x):") and "CALL func_1(4) IS" in tok.decode(
        run.input_ids
    )
    (tmp_path / "templates.json").write_text(json.dumps({"passkey": "no context here"}))
    with pytest.raises(ValueError, match=r"templates.json: the template for 'passkey' must be a string holding"):
        ib.load(tmp_path, tok)
    with pytest.raises(ValueError, match=r"unknown InfiniteBench subset 'En.Poem'; known: longbook_sum_eng"):
        ib.load(IB_RAW, tok, subsets=["En.Poem"])


def test_infinitebench_kvpress_format():
    tok = WordTokenizer()
    tasks = ib.load(IB_KV, tok)
    assert [t.meta["subset"] for t in tasks] == ["longbook_choice_eng", "passkey"]
    for t in tasks:
        (r,) = rows(IB_KV / t.meta["subset"] / "test.jsonl")
        assert tok.decode(t.input_ids) == words(f"{r['context']} {r['question']}\n{r['answer_prefix']}")
        assert t.max_new_tokens == r["max_new_tokens"] and t.answers == r["answer"] and t.meta["format"] == "kvpress"
    assert tasks[0].metric == "infinitebench_choice_kvpress" and tasks[1].metric == "infinitebench_first_int"
    check_cut(ib.load, IB_KV, WordTokenizer, 12)
    check_cut(ib.load, IB_RAW, WordTokenizer, 15)


def test_infinitebench_missing_field(tmp_path):
    (tmp_path / "passkey.jsonl").write_text(json.dumps({"id": 0, "context": "c", "input": "q", "options": []}) + "\n")
    with pytest.raises(ValueError, match=r"passkey.jsonl: a row has no field 'answer'.*InfiniteBench format"):
        ib.load(tmp_path, WordTokenizer())
    (tmp_path / "passkey.jsonl").write_text(json.dumps({"text": "c", "label": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"passkey.jsonl: rows with fields label, text are in no InfiniteBench"):
        ib.load(tmp_path, WordTokenizer())


def test_infinitebench_metrics():
    m = ib.METRICS
    # En.QA: "the cat sat" -> [cat, sat] vs [cat, sat, down]: P 1, R 2/3, F1 0.8; the best answer counts
    assert m["infinitebench_qa_f1"](["a cat sat down", "dog"], "The cat sat.", {}) == pytest.approx(0.8)
    assert m["infinitebench_qa_f1"](["dog"], "The cat sat.", {}) == 0.0
    # Zh.QA on characters: 河边 vs 在河边。 -> P 2/3, R 1, F1 0.8
    assert m["infinitebench_qa_f1_zh"](["河边"], "在河边。", {}) == pytest.approx(0.8)
    # the punctuation list is compute_scores.py's (LongBench's too): “ goes, the low quote ‚ (U+201A) stays
    assert m["infinitebench_qa_f1_zh"](["河边"], "“河边\u201a", {}) == pytest.approx(0.8)
    # En.MC: first letter, an answer prefix, a lone letter
    labels = ["Walking the dog", "B"]
    assert m["infinitebench_choice"](labels, "B. Walking the dog", {}) == 1.0
    assert m["infinitebench_choice"](labels, "C", {}) == 0.0
    assert m["infinitebench_choice"](labels, "I think the answer is: B", {}) == 1.0
    assert m["infinitebench_choice"](labels, "Walking the dog", {}) == 1.0
    assert m["infinitebench_choice"](labels, "so it is B here", {}) == 1.0  # the first lone A-D word
    assert m["infinitebench_choice"](labels, "", {}) == 0.0
    # kvpress's version first takes the last lone A-D of the first line that has one
    assert m["infinitebench_choice"](["B"], "so not A but B", {}) == 0.0  # the first lone letter: A
    assert m["infinitebench_choice_kvpress"](["B"], "so not A but B", {}) == 1.0
    # En.Dia: the first answer among the upper-cased words / kvpress: any answer as a substring
    assert m["infinitebench_dialogue"](["ANNA", "ANNA LEE"], "It is Anna.", {}) == 1.0
    assert m["infinitebench_dialogue"](["ANNA", "ANNA LEE"], "Annabel", {}) == 0.0
    assert m["infinitebench_dialogue_kvpress"](["ANNA", "ANNA LEE"], "Annabel", {}) == 1.0
    # Code.Debug: "<letter>." at the start, or after an answer prefix the letter or the function's name
    assert m["infinitebench_code_debug"](["gamma", "C"], "C. gamma", {}) == 1.0
    assert m["infinitebench_code_debug"](["gamma", "C"], "The correct option is: gamma", {}) == 1.0
    assert m["infinitebench_code_debug"](["gamma", "C"], "C", {}) == 0.0  # no "C." / "C:": the repo's rule
    assert m["infinitebench_code_debug"](["gamma", "C"], "B. beta", {}) == 0.0
    assert m["infinitebench_code_debug_kvpress"](["C"], "C", {}) == 1.0
    # Code.Run: the last word as an integer
    assert m["infinitebench_code_run"](["14"], "func_1(4) returns 14.", {}) == 1.0
    assert m["infinitebench_code_run"](["14"], "14 is the value", {}) == 0.0
    # Math.Calc: leading values right, up to the first wrong one
    answers = ["3", "7", "5", "15"]
    assert m["infinitebench_math_calc"](answers, "[3, 7, 5, 15]", {}) == 1.0
    assert m["infinitebench_math_calc"](answers, "[3, 7, 6, 15]", {}) == 0.5
    assert m["infinitebench_math_calc"](["[3, 7, 5, 15]"], "[3, 7]", {}) == 0.5
    # Math.Find: the first number, by value; PassKey / Number: the first run of digits; KV: a word
    assert m["infinitebench_math_find"](["88"], " 88, the largest", {}) == 1.0
    assert m["infinitebench_math_find"](["88"], "88.0", {}) == 1.0
    assert m["infinitebench_math_find"](["88"], "31 then 88", {}) == 0.0
    assert m["infinitebench_first_int"](["48213"], "The pass key is 48213.", {}) == 1.0
    assert m["infinitebench_first_int"](["48213"], "Key 1: 48213", {}) == 0.0
    assert m["infinitebench_kv_retrieval"](["1b8f9e0d-bbbb"], 'is: "1b8f9e0d-bbbb".', {}) == 1.0
    assert m["infinitebench_kv_retrieval"](["1b8f9e0d-bbbb"], "1b8f9e0d-bbbbX", {}) == 0.0


def test_infinitebench_rouge_lsum():
    # one sentence each: LCS of [a b c d] and [a c e] is [a c]: P 2/3, R 2/4, F1 4/7
    assert ib.rouge_lsum("a b c d", "a c e") == pytest.approx(4 / 7)
    # two reference sentences, union LCS per sentence, tokens counted once: 3 hits of 5 reference / 3 output tokens
    assert ib.rouge_lsum("Mara leaves.\nShe bakes bread.", "she bakes\nMara") == pytest.approx(2 * 1 * 0.6 / 1.6)
    assert ib.rouge_lsum("x y", "") == 0.0
    assert ib.METRICS["infinitebench_rouge_lsum"](["p q", "a b c d"], "a c e", {}) == pytest.approx(4 / 7)
    if importlib.util.find_spec("rouge_score") is not None:  # the reference implementation, when installed
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rougeLsum"])
        for ref, out in [
            ("Mara leaves the farm.\nShe works at a bakery.", "She works.\nMara leaves a farm"),
            ("a b a b c\nc a b", "b a c a\nb b c"),
        ]:
            assert ib.rouge_lsum(ref, out) == pytest.approx(scorer.score(ref, out)["rougeLsum"].fmeasure)


# ============================================================================================
# AIME 2025 and MATH-500


def test_reasoning_loaders_prompts():
    tok = WordTokenizer()
    aime = reasoning.LOADERS["aime25"](DATA / "reasoning" / "aime25", tok)
    source = rows(DATA / "reasoning" / "aime25" / "aime2025-I.jsonl") + rows(
        DATA / "reasoning" / "aime25" / "aime2025-II.jsonl"
    )
    assert [t.answers for t in aime] == [["401"], ["12"]]  # part I, then part II
    for t, r in zip(aime, source):
        assert t.name == "aime25/test" and t.metric == "aime25_integer" and t.max_new_tokens == 32768
        assert tok.decode(t.input_ids) == words(f"{r['question']}\n\n{reasoning.INSTRUCTION}\n\nSolution:")
        assert t.input_ids[0] == tok.bos_token_id and t.meta["chat"] is False
    math = reasoning.LOADERS["math500"](DATA / "reasoning" / "math500" / "test.jsonl", tok, limit=1)
    assert len(math) == 1 and math[0].meta["id"] == "test/prealgebra/9001.json"
    assert math[0].meta["subject"] == "Prealgebra" and math[0].meta["level"] == 1
    chat = ChatWordTokenizer()
    t = reasoning.LOADERS["math500"](DATA / "reasoning" / "math500", chat, subsets=["test"])[1]
    assert chat.decode(t.input_ids) == words(
        f"<|user|> Find the positive $x$ with $x^2 = 18$.\n\n{reasoning.INSTRUCTION} <|end|> <|assistant|>"
    )
    assert t.meta["chat"] is True and chat.calls[-1] == {}  # the template's own thinking default
    kv = reasoning.LOADERS["math500"](DATA / "reasoning" / "kvpress" / "math500.jsonl", tok)[0]
    assert tok.decode(kv.input_ids) == words("What is $3 \\cdot 4$?\n") and kv.max_new_tokens == 4096
    assert kv.meta["format"] == "kvpress" and kv.input_ids[0] == tok.bos_token_id
    check_cut(reasoning.LOADERS["math500"], DATA / "reasoning" / "math500", WordTokenizer, 9)
    with pytest.raises(ValueError, match=r"unknown AIME 2025 subset 'II'; known: test"):
        reasoning.LOADERS["aime25"](DATA / "reasoning" / "aime25", tok, subsets=["II"])


def test_reasoning_errors(tmp_path):
    bad = tmp_path / "aime.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "3/4"}) + "\n")
    with pytest.raises(ValueError, match=r"aime.jsonl: row 0 answers \['3/4'\], not an integer 0-999"):
        reasoning.LOADERS["aime25"](bad, WordTokenizer())
    bad.write_text(json.dumps({"question": "q", "solution": "s"}) + "\n")
    with pytest.raises(ValueError, match=r"aime.jsonl: a row has no field 'answer'"):
        reasoning.LOADERS["aime25"](bad, WordTokenizer())


def test_last_boxed():
    assert reasoning.last_boxed("first \\boxed{1}, then \\boxed{\\frac{1}{\\sqrt{2}}}.") == "\\frac{1}{\\sqrt{2}}"
    assert reasoning.last_boxed("$\\boxed{\\left\\{ 1, 2 \\right\\}}$") == "\\left\\{ 1, 2 \\right\\}"
    assert reasoning.last_boxed("so \\boxed 5$ done") == "5"
    assert reasoning.last_boxed("\\fbox{7}") == "7"
    assert reasoning.last_boxed("\\boxed{2} and a cut \\boxed{3") == "2"  # the last complete box
    assert reasoning.last_boxed("no box: 42") is None


def test_math_normalization_and_equivalence():
    n = reasoning.normalize
    assert n("\\dfrac12") == n("\\frac{1}{2}") == "\\frac{1}{2}"
    assert n("\\tfrac{3}{4}") == n("3/4") == "\\frac{3}{4}"
    assert n("\\left( 3, \\frac{\\pi}{2} \\right)") == "(3,\\frac{\\pi}{2})"
    assert n("$4$") == n("4.0") == n("4.00") == n("x = 4") == n("4.") == "4"
    assert n("2.50") == "2.5" and n(".5") == "0.5" and n("1,000") == "1000"
    assert n("90^\\circ") == n("90^{\\circ}") == "90" and n("10\\%") == "10"
    assert n("12\\text{ cm}") == n("12 cm") == n("12 square units") == "12"
    assert n("\\text{(C)}") == "(C)" and n("\\sqrt3") == "\\sqrt{3}" and n("\\$18.90") == "18.9"
    eq = reasoning.math_equiv
    assert eq("\\dfrac12", "\\frac{1}{2}") and eq("0.5", "\\frac12") and eq("-\\frac{6}{4}", "-1.5")
    assert not eq("\\frac{1}{3}", "0.33") and not eq("2", "3") and not eq("(1,2)", "(2,1)")
    if importlib.util.find_spec("sympy") is not None:
        assert eq("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}") and eq("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}")
        assert eq("2\\pi", "\\pi \\cdot 2") and not eq("\\sqrt{2}", "1.414")


def test_reasoning_metrics():
    aime, math = reasoning.METRICS["aime25_integer"], reasoning.METRICS["math500_equiv"]
    assert aime(["70"], "... so the answer is \\boxed{070}.", {}) == 1.0
    assert aime(["70"], "\\boxed{70} wait, no: \\boxed{71}", {}) == 0.0  # the last box counts
    assert aime(["70"], "\\boxed{70.5}", {}) == 0.0 and aime(["70"], "70", {}) == 0.0
    assert aime(["401"], "$\\boxed{401^\\circ}$", {}) == 1.0
    assert math(["\\frac{3}{4}"], "Adding: $\\boxed{\\dfrac34}$", {}) == 1.0
    assert math(["3\\sqrt{2}"], "$\\boxed{3\\sqrt2}$", {}) == 1.0
    assert math(["\\text{(C)}"], "\\boxed{\\textbf{(C)}}", {}) == 1.0
    assert math(["\\frac{3}{4}"], "the answer is 3/4", {}) == 0.0  # no box, no score
