"""kvpass.eval.benchmarks: the LongBench / LongBench-E, LongBench v2 and LooGLE loaders on small fixture files in each
dataset's own format (and kvpress's), with a whitespace tokenizer; the metrics on known answers, values by hand.
No download, no model."""

from __future__ import annotations

import importlib
import json
import math
import random
import shutil
from pathlib import Path

import pytest

from benchmark_tokenizer import WordTokenizer
from kvpass.eval.benchmarks import _text
from kvpass.eval.benchmarks import longbench as lb
from kvpass.eval.benchmarks import longbench_v2 as v2
from kvpass.eval.benchmarks import loogle as lg

DATA = Path(__file__).parent / "data" / "benchmarks"
LB, V2, LG = DATA / "longbench", DATA / "longbench_v2", DATA / "loogle"


@pytest.fixture
def tok():
    return WordTokenizer()


def text(tok, task) -> str:
    return tok.decode(task.input_ids)


def in_order(haystack: str, *parts: str) -> bool:
    """Each part occurs in ``haystack`` after the previous one."""
    at = 0
    for p in parts:
        k = haystack.find(p, at)
        if k < 0:
            return False
        at = k + len(p)
    return True


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_rows(path: Path, data: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")


def official_layout(root: Path, data: Path, folder: str, files: dict) -> None:
    """``data`` copied into ``root/folder`` and each of ``files`` (name -> JSON) written into ``root/config``."""
    (root / folder).mkdir()
    shutil.copy(data, root / folder / data.name)
    (root / "config").mkdir()
    for name, content in files.items():
        (root / "config" / name).write_text(json.dumps(content))


def words(s: str) -> str:
    """What WordTokenizer.decode gives back for ``s``."""
    return " ".join(s.split())


def check_kvpress_prompt(tok, task, row: dict) -> None:
    """``task``'s prompt is kvpress's for ``row`` without a chat template: BOS + context, then question + "\\n" +
    answer_prefix, each tokenized alone."""
    assert task.input_ids == [tok.bos_token_id] + tok.encode(row["context"], add_special_tokens=False) + tok.encode(
        row["question"] + "\n" + row["answer_prefix"], add_special_tokens=False
    )
    assert task.meta["context_tokens"] == 1 + len(row["context"].split()) and task.meta["chat"] is False
    assert task.meta["format"] == "kvpress" and task.max_new_tokens == row["max_new_tokens"]


# ------------------------------------------------------------------------------------------------
# the interface
# ------------------------------------------------------------------------------------------------


def test_interface_of_the_three_modules():
    for mod, names in ((lb, {"longbench", "longbench_e"}), (v2, {"longbench_v2"}), (lg, {"loogle"})):
        assert set(mod.LOADERS) == names == set(mod.SUBSETS)
        for name, fn in mod.METRICS.items():
            assert name.startswith(("longbench_", "loogle_")) and callable(fn) and fn.__doc__
    assert len(lb.SUBSETS["longbench"]) == 21 and len(lb.SUBSETS["longbench_e"]) == 13
    assert set(lb.SUBSETS["longbench_e"]) <= set(lb.SUBSETS["longbench"])
    assert set(lb.SUBSET_METRIC.values()) == set(lb.METRICS)
    assert set(lb.MAX_NEW_TOKENS) == set(lb.SUBSETS["longbench"]) == set(lb.TEMPLATES)
    assert v2.SUBSETS["longbench_v2"] == (
        "single_document_qa",
        "multi_document_qa",
        "long_in_context_learning",
        "long_dialogue_history_understanding",
        "code_repository_understanding",
        "long_structured_data_understanding",
    )
    assert lg.SUBSETS["loogle"] == ("shortdep_qa", "shortdep_cloze", "longdep_qa", "longdep_summarization")
    assert set(lg.SUBSET_METRIC.values()) <= set(lg.METRICS)
    names = [n for mod in (lb, v2, lg) for n in mod.METRICS]
    assert len(names) == len(set(names))


def test_metric_names_unique_across_kvpass():
    from kvpass.eval import benchmarks
    from kvpass.eval.tasks import SCORERS

    mods = []
    for m in benchmarks.MODULES:
        try:
            mods.append(importlib.import_module(f"kvpass.eval.benchmarks.{m}"))
        except ModuleNotFoundError:
            continue
    names = [n for mod in mods for n in mod.METRICS] + list(SCORERS)
    assert len(names) == len(set(names))


# ------------------------------------------------------------------------------------------------
# LongBench: loading
# ------------------------------------------------------------------------------------------------


def test_longbench_prompt_builtin_template(tok):
    tasks = lb.load_longbench(LB, tok, subsets=["hotpotqa"])
    assert [t.meta["id"] for t in tasks] == ["hq-0001", "hq-0002", "hq-0003"]
    t, row = tasks[0], rows(LB / "hotpotqa.jsonl")[0]
    s = text(tok, t)
    assert t.input_ids[0] == tok.bos_token_id and t.meta["length"] == len(t.input_ids)
    assert in_order(s, "Passages:", words(row["context"]), "Question: " + row["input"]) and s.endswith("Answer:")
    assert (t.family, t.name, t.metric, t.max_new_tokens) == ("longbench", "longbench/hotpotqa", "longbench_qa_f1", 32)
    assert t.answers == ["the river Tessel"] and tasks[1].answers == ["Edda Voss", "Edda Voss and her brother"]
    assert t.meta["template"] == "builtin" and t.meta["format"] == "official" and t.meta["cut"] is False
    assert t.meta["dataset_length"] == 31 and t.meta["language"] == "en" and t.meta["first_line"] is False


def test_longbench_few_shot_code_chinese_prompts(tok):
    trec, lcc, zh = lb.load_longbench(LB, tok, subsets=["trec", "lcc", "multifieldqa_zh"])
    assert in_order(text(tok, trec), "Type: Individual", "How many moons does the planet have?") and text(
        tok, trec
    ).endswith("Type:")
    assert trec.meta["all_classes"][-2:] == ["Number of something", "Other number"] and trec.meta["first_line"]
    assert trec.metric == "longbench_classification" and trec.max_new_tokens == 64
    assert text(tok, lcc).endswith("result = width * height") and lcc.metric == "longbench_code_sim"
    assert in_order(text(tok, zh), "河上的石桥", "问题：这座桥是哪一年建成的？") and text(tok, zh).endswith("答案：")
    assert zh.metric == "longbench_qa_f1_zh"


def test_longbench_middle_truncation(tok):
    full = lb.load_longbench(LB, tok, subsets=["hotpotqa"], limit=1)[0]
    cut = lb.load_longbench(LB, tok, subsets=["hotpotqa"], limit=1, max_length=11)[0]
    assert len(full.input_ids) > 11
    assert cut.input_ids == full.input_ids[:5] + full.input_ids[-6:]
    assert cut.meta["cut"] is True and cut.meta["length"] == 11
    s = text(tok, cut)
    assert s.startswith("Use the passages below") and s.endswith("Answer:") and "Ellingford" not in s


def test_longbench_limit_and_subsets(tok):
    tasks = lb.load_longbench(LB, tok, subsets=["passage_retrieval_en", "hotpotqa"], limit=2)
    assert [t.name for t in tasks] == ["longbench/passage_retrieval_en", "longbench/hotpotqa", "longbench/hotpotqa"]
    assert len(lb.load_longbench(LB, tok, subsets=["hotpotqa"], limit=0)) == 0
    with pytest.raises(ValueError, match=r"unknown LongBench subset 'hotpot'.*narrativeqa, qasper"):
        lb.load_longbench(LB, tok, subsets=["hotpot"])
    with pytest.raises(ValueError, match="unknown LongBench-E subset 'narrativeqa'"):  # not a LongBench-E subset
        lb.load_longbench_e(LB, tok, subsets=["narrativeqa"])
    with pytest.raises(FileNotFoundError, match=r"narrativeqa.*subsets present there: .*hotpotqa.*subsets=\["):
        lb.load_longbench(LB, tok)  # the fixture holds a few subsets, not all 21


def test_longbench_e_buckets(tok):
    tasks = lb.load_longbench_e(LB, tok, subsets=["qasper"])
    assert [t.name for t in tasks] == ["longbench_e/qasper"] * 2 and tasks[0].family == "longbench_e"
    assert [t.meta["length_bucket"] for t in tasks] == ["0-4k", "8k+"]
    assert [lb.length_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    assert tasks[0].max_new_tokens == 128 and tasks[0].metric == "longbench_qa_f1"


def test_longbench_single_file_groups_by_dataset_field(tok):
    tasks = lb.load_longbench(LB / "hotpotqa.jsonl", tok, limit=2)
    assert [t.name for t in tasks] == ["longbench/hotpotqa"] * 2
    # a LongBench-E file's rows say dataset "qasper_e": read as the qasper subset
    assert [t.name for t in lb.load_longbench_e(LB / "qasper_e.jsonl", tok)] == ["longbench_e/qasper"] * 2


def test_longbench_kvpress_format(tok):
    (t,) = lb.load_longbench(LB / "kvpress" / "hotpotqa.jsonl", tok)
    check_kvpress_prompt(tok, t, rows(LB / "kvpress" / "hotpotqa.jsonl")[0])
    assert text(tok, t).endswith("Question: Which river flows past the birthplace of Mara Quill? Answer:")
    assert t.max_new_tokens == 52 and t.meta["template"] == "kvpress"


class InstTokenizer(WordTokenizer):
    """WordTokenizer with a chat template: "[INST] {content} [/INST]" per user turn (no BOS of its own)."""

    chat_template = "[INST]"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        return "".join(f"[INST] {m['content']} [/INST] " for m in messages)


@pytest.mark.parametrize(
    "load, path",
    [
        (lb.load_longbench, LB / "kvpress" / "hotpotqa.jsonl"),
        (v2.load, V2 / "kvpress.jsonl"),
        (lg.load, LG / "kvpress.jsonl"),
    ],
)
def test_kvpress_rows_get_kvpress_chat_prompt(load, path):
    # kvpress's rule: context + question one user turn, cut where the context ends; the rest of the turn and the
    # generation prompt after the question, then the answer prefix; each part tokenized without special tokens
    tok = InstTokenizer()
    tasks = load(path, tok)
    assert len(tasks) == len(rows(path))
    for t, row in zip(tasks, rows(path)):
        head = tok.encode("[INST] " + row["context"], add_special_tokens=False)
        tail = tok.encode(row["question"] + " [/INST] " + row["answer_prefix"], add_special_tokens=False)
        assert t.input_ids == head + tail and t.meta["context_tokens"] == len(head) and t.meta["chat"] is True
        assert t.meta["format"] == "kvpress" and t.max_new_tokens == row["max_new_tokens"]
    cut = load(path, InstTokenizer(), max_length=6)[0]
    assert cut.input_ids == tasks[0].input_ids[:3] + tasks[0].input_ids[-3:] and cut.meta["cut"] is True


def test_longbench_official_config_files(tok, tmp_path):
    # data.zip's layout (data/<subset>.jsonl) beside config/ with the template files
    prompts = {"hotpotqa": "CTX {context} Q {input} A:"}
    official_layout(
        tmp_path,
        LB / "hotpotqa.jsonl",
        "data",
        {"dataset2prompt.json": prompts, "dataset2maxlen.json": {"hotpotqa": 7}},
    )
    t = lb.load_longbench(tmp_path, tok, subsets=["hotpotqa"], limit=1)[0]
    row = rows(LB / "hotpotqa.jsonl")[0]
    assert text(tok, t) == words(f"CTX {row['context']} Q {row['input']} A:")
    assert t.max_new_tokens == 7 and t.meta["template"].startswith("official (")
    # a template file without the subset asked for is an error, not a silent fallback
    (tmp_path / "data" / "trec.jsonl").write_text((LB / "trec.jsonl").read_text())
    with pytest.raises(ValueError, match=r"dataset2prompt.json: no template for subset 'trec'.*hotpotqa"):
        lb.load_longbench(tmp_path, tok, subsets=["trec"])
    (tmp_path / "config" / "dataset2prompt.json").write_text(json.dumps({"hotpotqa": "{context} {query}"}))
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl: the hotpotqa template .* names field 'query'"):
        lb.load_longbench(tmp_path, tok, subsets=["hotpotqa"])


def test_longbench_errors_name_file_and_field(tok, tmp_path):
    good = rows(LB / "hotpotqa.jsonl")[0]
    write_rows(tmp_path / "hotpotqa.jsonl", [{k: v for k, v in good.items() if k != "answers"}])
    with pytest.raises(
        ValueError,
        match=r"hotpotqa.jsonl: a row has no field 'answers', which the official LongBench "
        r"format needs \(input, context, answers\)",
    ):
        lb.load_longbench(tmp_path, tok, subsets=["hotpotqa"])
    trec = rows(LB / "trec.jsonl")[0]
    write_rows(tmp_path / "trec.jsonl", [{**trec, "all_classes": None}])
    with pytest.raises(ValueError, match=r"trec.jsonl: row 0 of trec has no 'all_classes'"):
        lb.load_longbench(tmp_path, tok, subsets=["trec"])
    write_rows(tmp_path / "other.jsonl", [{**good, "dataset": "mystery"}])
    with pytest.raises(ValueError, match=r"other.jsonl: rows of unknown LongBench subset 'mystery'"):
        lb.load_longbench(tmp_path / "other.jsonl", tok)
    kv = rows(LB / "kvpress" / "hotpotqa.jsonl")[0]
    write_rows(tmp_path / "kv" / "hotpotqa.jsonl", [{k: v for k, v in kv.items() if k != "question"}])
    with pytest.raises(ValueError, match=r"a row has no field 'question', which the kvpress LongBench format"):
        lb.load_longbench(tmp_path / "kv", tok, subsets=["hotpotqa"])


# ------------------------------------------------------------------------------------------------
# LongBench: metrics
# ------------------------------------------------------------------------------------------------

M = lb.METRICS


def test_qa_f1_by_hand():
    # "The Tessel river, near Ellingford." -> tessel river near ellingford (4); "the river Tessel" -> river tessel (2)
    # shared 2: P = 2/4, R = 2/2, F1 = 2/3
    assert M["longbench_qa_f1"](["the river Tessel"], "The Tessel river, near Ellingford.", {}) == pytest.approx(2 / 3)
    # the max over answers: vs "edda voss" F1 1/3; vs "edda voss and her brother" P = 4/4, R = 4/5 -> 8/9
    assert M["longbench_qa_f1"](
        ["Edda Voss", "Edda Voss and her brother"], "Voss and her brother", {}
    ) == pytest.approx(8 / 9)
    assert M["longbench_qa_f1"](["the river Tessel"], "An answer elsewhere", {}) == 0.0
    assert _text.normalize_en("The  Cat's (an) hat!") == "cats hat"


def test_qa_f1_zh_character_fallback(monkeypatch):
    monkeypatch.setattr(lb, "JIEBA", False)
    assert lb.zh_words("1921年建成, ok") == ["1921", "年", "建", "成", ",", "ok"]
    # "1921年建成。" -> 1921 年 建 成 (4, the full stop removed); "1921年" -> 1921 年: P = 2/4, R = 1, F1 = 2/3
    assert M["longbench_qa_f1_zh"](["1921年"], "1921年建成。", {}) == pytest.approx(2 / 3)
    assert _text.normalize_zh("《红楼梦》，Ａ Ｂ！") == "《红楼梦ａｂ"  # LongBench lists 》 but not 《


def test_rouge_l_by_hand(monkeypatch):
    # one sentence each: LCS the cat on mat (4); distinct words: reference 6, output 5 -> R 4/6, P 4/5, F 8/11
    assert M["longbench_rouge_l"](["the cat lay on a mat"], "the cat sat on the mat", {}) == pytest.approx(8 / 11)
    # summary level: the union of the LCS words of each (reference sentence, output sentence) pair:
    # "the dog sat" vs "the cat sat" -> {the, sat}; vs "the dog ran" -> {the, dog}; union 3 of 3 reference words,
    # 5 distinct output words: R 1, P 3/5, F 0.75
    assert _text.rouge_l("the cat sat. the dog ran", "the dog sat")["f"] == pytest.approx(0.75)
    assert _text.rouge_l("the cat sat. the dog ran", "the dog sat")["r"] == pytest.approx(1.0)
    assert M["longbench_rouge_l"](["a summary"], "", {}) == 0.0 and _text.rouge_l("...", "x") is None
    # ROUGE-N on sets of n-grams: reference bigrams 4, output's 2, shared (born, in): R 1/4, P 1/2
    assert _text.rouge_n("born in Venice", "She was born in Carrow", 2)["r"] == pytest.approx(0.25)
    assert _text.rouge_n("born in Venice", "She was born in Carrow", 2)["p"] == pytest.approx(0.5)
    monkeypatch.setattr(lb, "JIEBA", False)
    # characters: 会 议 讨 论 了 预 算 vs 会 议 讨 论 预 算: LCS 6, distinct 7 and 6 -> R 1, P 6/7, F 12/13
    assert M["longbench_rouge_l_zh"](["会议讨论预算"], "会议讨论了预算", {}) == pytest.approx(12 / 13, abs=1e-7)


def test_classification_score():
    meta = {
        "all_classes": ["Abbreviation", "Animal", "Date", "City", "Individual", "Number of something", "Other number"],
        "first_line": True,
    }
    f = M["longbench_classification"]
    assert f(["Number of something"], "Number of something", meta) == 1.0
    assert f(["Number of something"], "Date or Number of something", meta) == 0.5  # two labels named
    assert f(["Number of something"], "\nNumber of something\nDate, City", meta) == 1.0  # first line only
    assert f(["Number of something"], "Animal", meta) == 0.0
    # labels inside the true label are dropped, but LongBench's loop skips the one after each drop:
    # found [ab, b, c, abc] -> drop ab (skip b) -> drop c -> [b, abc]: 1/2
    assert lb.classification("ab b abc", "abc", ["ab", "b", "c", "abc"]) == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        f(["Date"], "Date", {})


def test_retrieval_count_scores():
    assert M["longbench_retrieval"](["Paragraph 2"], "Paragraph 2", {}) == 1.0
    assert M["longbench_retrieval"](["Paragraph 2"], "Paragraph 2 or Paragraph 12", {}) == 0.5
    assert M["longbench_retrieval"](["Paragraph 2"], "I cannot tell", {}) == 0.0
    assert M["longbench_retrieval_zh"](["段落3"], "答案是段落3", {}) == 1.0
    assert M["longbench_count"](["4"], "There are 4 unique paragraphs, not 5", {}) == 0.5
    with pytest.raises(ValueError, match="no 'Paragraph' number"):
        lb.retrieval("1", "Section 1")


def test_code_similarity():
    f = M["longbench_code_sim"]
    assert f(["    return result"], "    return result\n", {}) == 1.0
    # fences and comments skipped; "    return res" vs "    return result": LCS 14, lengths 14 + 17 -> 28/31 -> 0.90
    assert f(["    return result"], "```python\n# the result\n    return res\n```", {}) == 0.90
    assert lb.levenshtein_ratio("", "") == 1.0 and lb.levenshtein_ratio("", "x") == 0.0
    assert lb.first_code_line("// c\n`x`\n") == ""


def _lcs_dp(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def test_lcs_length_matches_dynamic_programming():
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("abc d") for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice("abcx ") for _ in range(rng.randint(0, 30)))
        assert lb.lcs_length(a, b) == _lcs_dp(a, b)


def test_longbench_metrics_score_loaded_tasks(tok):
    (t,) = lb.load_longbench(LB, tok, subsets=["passage_retrieval_en"])
    assert lb.METRICS[t.metric](t.answers, "Paragraph 2", t.meta) == 1.0
    (trec,) = lb.load_longbench(LB, tok, subsets=["trec"])
    assert lb.METRICS[trec.metric](trec.answers, " Number of something\nQuestion: next", trec.meta) == 1.0
    with pytest.raises(ValueError, match="at least one expected answer"):
        lb.METRICS["longbench_qa_f1"]([], "x", {})


# ------------------------------------------------------------------------------------------------
# LongBench v2
# ------------------------------------------------------------------------------------------------


def test_v2_prompt_builtin(tok):
    tasks = v2.load(V2, tok)
    assert [(t.name, t.meta["id"]) for t in tasks] == [
        ("longbench_v2/single_document_qa", "v2-0001"),
        ("longbench_v2/single_document_qa", "v2-0003"),
        ("longbench_v2/code_repository_understanding", "v2-0002"),
    ]
    t = tasks[0]
    s = text(tok, t)
    assert in_order(
        s,
        "<document> The narrator owes",
        "night ferry . </document>",
        "Question: Why does the narrator leave the harbour town?",
        "(A) To find her brother",
        "(B) To sell the boat",
        "(C) To escape a debt",
        "(D) To study medicine",
    )
    assert s.endswith("The correct answer is") and t.meta["answer_prefix"] == "The correct answer is"
    assert t.answers == ["C"] and t.metric == "longbench_v2_choice" and t.max_new_tokens == 128
    assert t.meta["choices"] == ["A", "B", "C", "D"] and t.meta["length"] == len(t.input_ids)
    assert (t.meta["difficulty"], t.meta["length_category"], t.meta["domain"]) == (
        "easy",
        "short",
        "Single-Document QA",
    )
    # the output continues the cue
    assert v2.choice_score(t.answers, " (C).", t.meta) == 1.0 and v2.choice_score(t.answers, " B", t.meta) == 0.0


def test_v2_subsets_limit_truncation(tok):
    assert [t.meta["id"] for t in v2.load(V2, tok, limit=1)] == ["v2-0001", "v2-0002"]
    by_domain = v2.load(V2, tok, subsets=["Code Repository Understanding"])
    assert [t.meta["id"] for t in by_domain] == ["v2-0002"]
    assert [
        t.meta["id"] for t in v2.load(V2, tok, subsets=["code_repository_understanding", "single_document_qa"])
    ] == ["v2-0002", "v2-0001", "v2-0003"]
    with pytest.raises(ValueError, match=r"unknown LongBench v2 subset 'code'.*single_document_qa"):
        v2.load(V2, tok, subsets=["code"])
    full = v2.load(V2, tok, limit=1)[0]
    cut = v2.load(V2, tok, limit=1, max_length=9)[0]
    assert cut.input_ids == full.input_ids[:4] + full.input_ids[-5:] and cut.meta["cut"]
    assert text(tok, cut).endswith("The correct answer is")


def test_v2_official_template_and_kvpress(tok, tmp_path):
    shutil.copy(V2 / "data.json", tmp_path / "data.json")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "0shot.txt").write_text("DOC: $DOC$\nQ: $Q$\nA) $C_A$ B) $C_B$ C) $C_C$ D) $C_D$\nEnd.")
    t = v2.load(tmp_path, tok, limit=1)[0]
    assert text(tok, t) == (
        "DOC: The narrator owes the harbour master a large sum and slips away on the night ferry "
        ". Q: Why does the narrator leave the harbour town? A) To find her brother B) To sell "
        "the boat C) To escape a debt D) To study medicine End."
    )
    assert t.meta["answer_prefix"] == "" and t.meta["template"].startswith("official (")
    assert v2.choice_score(t.answers, "The correct answer is (C)", t.meta) == 1.0
    (k,) = v2.load(V2 / "kvpress.jsonl", tok)
    check_kvpress_prompt(tok, k, rows(V2 / "kvpress.jsonl")[0])
    assert k.max_new_tokens == 16 and k.meta["answer_prefix"] == ""


def test_v2_errors(tok, tmp_path):
    data = json.loads((V2 / "data.json").read_text())
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "data.json").write_text(json.dumps([{k: v for k, v in data[0].items() if k != "choice_B"}]))
    with pytest.raises(ValueError, match=r"data.json: a row has no field 'choice_B'"):
        v2.load(tmp_path / "a", tok)
    (tmp_path / "b.json").write_text(json.dumps([{**data[0], "answer": "E"}]))
    with pytest.raises(ValueError, match=r"b.json: row 0 has answer 'E'"):
        v2.load(tmp_path / "b.json", tok)
    (tmp_path / "c.json").write_text(json.dumps([{**data[0], "domain": "Poetry"}]))
    with pytest.raises(ValueError, match=r"unknown domain 'Poetry'.*Single-Document QA"):
        v2.load(tmp_path / "c.json", tok)
    with pytest.raises(FileNotFoundError, match="no data.json"):
        v2.load(tmp_path, tok)


@pytest.mark.parametrize(
    "output, letter",
    [
        ("The correct answer is (C).", "C"),
        ("**The correct answer is (B)**", "B"),
        ("The correct answer is D because the text says so", "D"),
        ("The correct answer is **(A)**", "A"),
        ("I think (C) is right", None),
        ("the correct answer is (C)", None),  # the phrase is case-sensitive
        ("The correct answer is (A). On reflection, The correct answer is (C).", "A"),  # the first one counts
        ("The correct answer is B. No: The correct answer is (C)", "C"),  # the "(X)" phrase is looked for first
        ("The correct answer is E", None),
    ],
)
def test_v2_letter_extraction(output, letter):
    assert v2.extract_choice(output) == letter
    assert v2.choice_score(["C"], output, {}) == float(letter == "C")


# ------------------------------------------------------------------------------------------------
# LooGLE
# ------------------------------------------------------------------------------------------------


def test_loogle_prompts_one_task_per_question(tok):
    tasks = lg.load(LG, tok)
    assert [(t.name, t.meta["id"]) for t in tasks] == [
        ("loogle/shortdep_qa", "Orla Fenwick#0"),
        ("loogle/shortdep_qa", "Orla Fenwick#1"),
        ("loogle/shortdep_cloze", "Blue Anchor#0"),
        ("loogle/longdep_qa", "Orla Fenwick#0"),
        ("loogle/longdep_summarization", "2301.00001"),
    ]
    qa, _, cloze, longdep, summ = tasks
    assert in_order(
        text(tok, qa), "Orla Fenwick was born in Carrow", "closed in 1950 .", "Question: Where was Orla Fenwick born?"
    ) and text(tok, qa).endswith("Answer:")
    assert qa.answers == ["She was born in Carrow."] and qa.metric == "loogle_rouge_l" and qa.max_new_tokens == 300
    assert qa.meta["length"] == len(qa.input_ids)
    assert in_order(text(tok, cloze), "Inspector Hale questions Mina Roth", "Passage: <mask-0> questions <mask-1>")
    assert json.loads(cloze.answers[0]) == {
        "<mask-0>": "Inspector Hale",
        "<mask-1>": "Mina Roth",
        "<mask-2>": "Portlow",
    }
    assert cloze.metric == "loogle_cloze_exact" and cloze.meta["n_masks"] == 3 and cloze.max_new_tokens == 50
    assert longdep.meta["type"] == "computation" and longdep.max_new_tokens == 500
    assert text(tok, summ).endswith("learned sparse encoder . Summary:") and summ.answers[0].startswith("The paper")


def test_loogle_limit_subsets_truncation(tok):
    assert [t.meta["id"] for t in lg.load(LG, tok, subsets=["shortdep_qa"], limit=1)] == ["Orla Fenwick#0"]
    assert [t.name for t in lg.load(LG, tok, subsets=["longdep_summarization", "shortdep_cloze"])] == [
        "loogle/longdep_summarization",
        "loogle/shortdep_cloze",
    ]
    with pytest.raises(ValueError, match=r"unknown LooGLE subset 'cloze'.*shortdep_qa, shortdep_cloze"):
        lg.load(LG, tok, subsets=["cloze"])
    full = lg.load(LG, tok, subsets=["shortdep_qa"], limit=1)[0]
    cut = lg.load(LG, tok, subsets=["shortdep_qa"], limit=1, max_length=8)[0]
    assert cut.input_ids == full.input_ids[:4] + full.input_ids[-4:] and cut.meta["cut"]
    assert text(tok, cut).endswith("born? Answer:")


def test_loogle_official_config_and_kvpress(tok, tmp_path):
    official_layout(
        tmp_path,
        LG / "shortdep_qa.jsonl",
        "LooGLE-testdata",
        {"task2prompt.json": {"shortdep_qa": "T {input} Q {Q} A:"}, "task2maxlen.json": {"shortdep_qa": 9}},
    )
    t = lg.load(tmp_path, tok, subsets=["shortdep_qa"], limit=1)[0]
    assert text(tok, t).startswith("T Orla Fenwick") and text(tok, t).endswith("Q Where was Orla Fenwick born? A:")
    assert t.max_new_tokens == 9 and t.meta["template"].startswith("official (")
    kv = lg.load(LG / "kvpress.jsonl", tok)
    assert [t.name for t in kv] == ["loogle/shortdep_qa", "loogle/shortdep_cloze"]
    for t, row in zip(kv, rows(LG / "kvpress.jsonl")):
        check_kvpress_prompt(tok, t, row)
    assert kv[1].meta["n_masks"] == 2 and kv[1].max_new_tokens == 50


def test_loogle_errors(tok, tmp_path):
    good = rows(LG / "shortdep_qa.jsonl")[0]
    write_rows(tmp_path / "shortdep_qa.jsonl", [{**good, "qa_pairs": "[{'Q': 'x', "}])
    with pytest.raises(ValueError, match=r"shortdep_qa.jsonl: row 0: 'qa_pairs' is not a list literal"):
        lg.load(tmp_path, tok, subsets=["shortdep_qa"])
    write_rows(tmp_path / "shortdep_qa.jsonl", [{**good, "qa_pairs": str([{"Q": "x", "S": "y"}])}])
    with pytest.raises(ValueError, match=r"no field 'A' in the qa pair"):
        lg.load(tmp_path, tok, subsets=["shortdep_qa"])
    write_rows(tmp_path / "longdep_qa.jsonl", [{"input": "text"}])
    with pytest.raises(ValueError, match=r"longdep_qa.jsonl: a row has no field 'qa_pairs'.*\(input, qa_pairs\)"):
        lg.load(tmp_path, tok, subsets=["longdep_qa"])
    with pytest.raises(FileNotFoundError, match=r"shortdep_cloze.*subsets present there: shortdep_qa, longdep_qa"):
        lg.load(tmp_path, tok)


def test_loogle_metrics_by_hand():
    M2 = lg.METRICS
    ans = ["She was born in Carrow."]
    # reference words She was born in Carrow (5); LCS with "born in Venice": born in -> recall 2/5
    assert M2["loogle_rouge_l"](ans, "born in Venice", {}) == pytest.approx(0.4)
    assert M2["loogle_rouge_l"](ans, "She was born in Carrow in 1902", {}) == pytest.approx(1.0)
    assert M2["loogle_rouge_1"](ans, "born in Venice", {}) == pytest.approx(0.4)
    assert M2["loogle_rouge_2"](ans, "born in Venice", {}) == pytest.approx(0.25)  # (born, in) of 4 bigrams
    assert M2["loogle_rouge_l"](ans, "", {}) == 0.0  # scored as "None"
    # BLEU-1: 2 of 3 output words clipped-match; brevity penalty exp(1 - 5/3)
    assert M2["loogle_bleu1"](ans, "born in Venice", {}) == pytest.approx(2 / 3 * math.exp(-2 / 3))
    assert M2["loogle_bleu1"](ans, "She was born in Carrow. Yes", {}) == pytest.approx(5 / 6)  # longer: no penalty
    assert M2["loogle_bleu4"](ans, "born in Venice", {}) == 0.0
    # 4-grams of "She was born in Carrow." (2) vs the output's (3): 2 shared -> 2/3, no penalty
    assert M2["loogle_bleu4"](ans, "She was born in Carrow. Yes", {}) == pytest.approx(2 / 3)


def test_loogle_cloze_metrics():
    ans = [json.dumps({"<mask-0>": "Inspector Hale", "<mask-1>": "Mina Roth", "<mask-2>": "Portlow"})]
    out = "{'<mask-0>': 'Inspector Hale', '<mask-1>': 'Mina', '<mask-2>': 'Portlow'}"
    assert lg.METRICS["loogle_cloze_exact"](ans, out, {}) == pytest.approx(2 / 3)
    assert lg.METRICS["loogle_cloze_partial"](ans, out, {}) == 1.0
    assert lg.METRICS["loogle_cloze_exact"](ans, '\n {"<mask-0>": "Inspector Hale"}\n', {}) == pytest.approx(1 / 3)
    assert lg.METRICS["loogle_cloze_exact"](ans, "Hale and Roth", {}) == 0.0
    assert lg.METRICS["loogle_cloze_partial"](ans, "Answer: {'<mask-0>': 'Hale'}", {}) == 0.0  # not a dict literal
    assert lg.parse_dict("{'a': true}") is None and lg.parse_dict('{"a": true}') == {"a": True}
    with pytest.raises(ValueError, match="not a dict"):
        lg.METRICS["loogle_cloze_exact"](["Portlow"], "{}", {})


def test_loogle_metrics_score_loaded_tasks(tok):
    tasks = {t.name: t for t in lg.load(LG, tok, limit=1)}
    cloze = tasks["loogle/shortdep_cloze"]
    out = "{'<mask-0>': 'Inspector Hale', '<mask-1>': 'Mina Roth', '<mask-2>': 'Portlow'}"
    assert lg.METRICS[cloze.metric](cloze.answers, out, cloze.meta) == 1.0
    summ = tasks["loogle/longdep_summarization"]
    assert 0.0 < lg.METRICS[summ.metric](summ.answers, "The paper uses a sparse encoder.", summ.meta) < 1.0
