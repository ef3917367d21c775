"""RULER-style synthetic long-context tasks (Hsieh et al., 2024), rebuilt for exact token lengths.

What they measure, beyond plain needle retrieval: retrieval among distractor needles (multikey),
retrieving several values (multivalue, multiquery), multi-hop tracing (vt), and aggregation over
the whole context, where no single position holds the answer (cwe, fwe): an eviction policy that
keeps "important" tokens can pass the first kind and still fail the last.

Tasks (names are "ruler/<task>"):

    niah_single_1   noise haystack ("The grass is green. The sky is blue. ..." repeated), one needle
                    "One of the special magic numbers for {key} is: {7 digits}."; asked for that key.
    niah_single_2   the same needle in Paul Graham essays.
    niah_single_3   essays, the value is a UUID ("special magic uuid").
    niah_multikey   essays, 4 needles with different keys; asked for one of them (3 distractors).
    niah_multivalue essays, 4 needles with the same key and different values; asked for all 4
                    (metric recall).
    niah_multiquery essays, 4 needles with different keys; asked for all 4 keys' values (recall).
    vt              variable tracking: noise haystack with a chain "VAR ABCDE = 12345." then
                    "VAR FGHIJ = VAR ABCDE." ... (4 hops, in text order); asked for every variable
                    holding 12345 (5 names, recall).
    cwe             common words extraction: a numbered list of words in which 10 words appear
                    freq_cw times each and the others freq_ucw times (freq_cw grows with length, from
                    2 up to RULER's 30); asked for the 10 most common words (recall).
    fwe             frequent words extraction: "coded text" of made-up words drawn from a Zipf
                    distribution (alpha 2); asked for the 3 most frequent words (recall). The top 3
                    are checked to be strictly more frequent than the 4th.

Keys are adjective-noun pairs ("quiet-walnut"); values, keys, needle depths (uniform in [0, 1],
at sentence boundaries) and word lists come from a RNG seeded by (task, length, seed, sample).
Prompts follow RULER's templates, ending with the start of the answer sentence. RULER's one-shot
example for vt is left out (it would eat into short contexts).
"""

from __future__ import annotations

import re
import uuid
from functools import lru_cache

from kvpass.eval.tasks._core import (
    Prompt,
    Task,
    bos_ids,
    check_length,
    encode,
    encode_many,
    find_all,
    haystack_text,
    key_phrases,
    plant,
    random_number,
    rng_for,
    start_sentence,
    units_for,
)

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)

MAX_NEW_TOKENS = {
    "niah_single_1": 24,
    "niah_single_2": 24,
    "niah_single_3": 48,
    "niah_multikey": 24,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "vt": 32,
    "cwe": 64,
    "fwe": 32,
}


def _finish(tok, p: Prompt, name: str, length: int, seed: int, sample: int, answers, metric, **meta) -> Task:
    task = Task(
        family="ruler",
        name=f"ruler/{name}",
        input_ids=p.ids,
        answers=list(answers),
        metric=metric,
        max_new_tokens=MAX_NEW_TOKENS[name],
        meta=dict(length=length, seed=seed, sample=sample, spans=p.spans, bos=bool(bos_ids(tok)), **meta),
    )
    return check_length(task)


# --------------------------------------------------------------------------------------------
# Needles in a haystack

NIAH = {  # name: (haystack corpus, value type, number of keys, values per key, keys asked)
    "niah_single_1": ("noise", "number", 1, 1, 1),
    "niah_single_2": ("essay", "number", 1, 1, 1),
    "niah_single_3": ("essay", "uuid", 1, 1, 1),
    "niah_multikey": ("essay", "number", 4, 1, 1),
    "niah_multivalue": ("essay", "number", 1, 4, 1),
    "niah_multiquery": ("essay", "number", 4, 1, 4),
}


def _value(rng, kind: str, avoid: str) -> str:
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return random_number(rng, 7, avoid=avoid)


def _join(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def niah(tok, name: str, length: int, seed: int, sample: int) -> Task:
    corpus, vtype, n_keys, n_values, n_queries = NIAH[name]
    rng = rng_for("ruler", name, length, seed, sample)
    text = haystack_text()
    keys = key_phrases(rng, n_keys)
    needles, values = [], {}
    for k in keys:
        values[k] = [_value(rng, vtype, text) for _ in range(n_values)]
        needles += [(k, v) for v in values[k]]
    rng.shuffle(needles)
    queried = keys[:n_queries]  # keys are random: the first ones will do
    answers = [v for k in queried for v in values[k]]
    plural = n_values > 1 or n_queries > 1
    vname = f"{vtype}s" if plural else vtype

    units = units_for(tok, corpus)
    start = start_sentence(units, rng_for("ruler/haystack", corpus, length, seed, sample), paragraph=corpus == "essay")
    p = Prompt(tok)
    p.add(
        f"Some special magic {vtype}s are hidden within the following text. Make sure to memorize them. "
        f"I will quiz you about the {vtype}s afterwards.\n\n",
        "header",
    )
    if plural:
        question = (
            f"\n\nWhat are all the special magic {vname} for {_join(queried)} mentioned in the provided "
            f"text? The special magic {vname} for {_join(queried)} mentioned in the provided text are"
        )
    else:
        question = (
            f"\n\nWhat is the special magic {vname} for {queried[0]} mentioned in the provided text? "
            f"The special magic {vname} for {queried[0]} mentioned in the provided text is"
        )
    q_ids = encode(tok, question)
    sentences = [f"One of the special magic {vtype}s for {k} is: {v}." for k, v in needles]
    depths = [rng.random() for _ in needles]
    ids, spans, needle_ids, info = plant(tok, units, start, length - len(p) - len(q_ids), sentences, depths)
    ctx = p.add(ids, "context")
    p.add(q_ids, "question")
    spans = [(ctx[0] + a, ctx[0] + b) for a, b in spans]
    for nid, sp in zip(needle_ids, spans):
        assert find_all(p.ids, nid) == [sp[0]], "needle ids must occur exactly once"
    return _finish(
        tok,
        p,
        name,
        length,
        seed,
        sample,
        answers,
        "contains" if len(answers) == 1 else "recall",
        keys=keys,
        queried=queried,
        needles=sentences,
        needle_spans=spans,
        needle_ids=needle_ids,
        depths=depths,
        depths_actual=info["depths_actual"],
        haystack=corpus,
    )


# --------------------------------------------------------------------------------------------
# Variable tracking


def _var_names(rng, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in out:
            out.append(v)
    return out


def vt(tok, length: int, seed: int, sample: int, hops: int = 4, chains: int = 1) -> Task:
    rng = rng_for("ruler", "vt", length, seed, sample)
    names = _var_names(rng, chains * (hops + 1))
    values = [random_number(rng, 5) for _ in range(chains)]
    while len(set(values)) < chains:
        values = [random_number(rng, 5) for _ in range(chains)]
    statements, depths = [], []
    for c in range(chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        ds = sorted(rng.random() for _ in chain)  # a chain is stated in order
        statements.append(f"VAR {chain[0]} = {values[c]}.")
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths += ds
    answers = names[: hops + 1]  # chain 0 is asked about

    units = units_for(tok, "noise")
    p = Prompt(tok)
    p.add("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n", "header")
    q_ids = encode(
        tok,
        f"\n\nQuestion: Find all variables that are assigned the value {values[0]} in the text "
        f"above. Answer: According to the chain(s) of variable assignment in the text above, "
        f"{hops + 1} variables are assigned the value {values[0]}, they are:",
    )
    start = rng_for("ruler/haystack", "noise", length, seed, sample).randrange(len(units))
    ids, spans, needle_ids, info = plant(tok, units, start, length - len(p) - len(q_ids), statements, depths)
    ctx = p.add(ids, "context")
    p.add(q_ids, "question")
    spans = [(ctx[0] + a, ctx[0] + b) for a, b in spans]
    return _finish(
        tok,
        p,
        "vt",
        length,
        seed,
        sample,
        answers,
        "recall",
        value=values[0],
        chain=answers,
        statements=statements,
        needle_spans=spans,
        depths_actual=info["depths_actual"],
        hops=hops,
        chains=chains,
    )


# --------------------------------------------------------------------------------------------
# Word lists (cwe, fwe)


@lru_cache(maxsize=1)
def essay_vocabulary() -> tuple[str, ...]:
    """Distinct lower-case alphabetic words of 4 to 10 letters from the essays, sorted."""
    words = re.findall(r"(?<![a-z'])[a-z]{4,10}(?![a-z'])", haystack_text().lower())  # no "wasn" from "wasn't"
    return tuple(sorted(set(words)))


class _Costs:
    """Token counts of word pieces and of list-index pieces, computed in batches on demand."""

    def __init__(self, tok):
        self.tok = tok
        self.word: dict[str, list[int]] = {}
        self.index: list[list[int]] = [[]]

    def words(self, ws):
        new = [w for w in dict.fromkeys(ws) if w not in self.word]
        for w, ids in zip(new, encode_many(self.tok, [" " + w for w in new])):
            self.word[w] = ids
        return [self.word[w] for w in ws]

    def idx(self, k: int) -> list[int]:  # "1." opens the list, then "\n2." ...
        while len(self.index) <= k:
            n = len(self.index)
            more = range(n, max(2 * n, n + 256))
            self.index += encode_many(self.tok, [f"{i}." if i == 1 else f"\n{i}." for i in more])
        return self.index[k]


def cwe(tok, length: int, seed: int, sample: int, num_cw: int = 10) -> Task:
    rng = rng_for("ruler", "cwe", length, seed, sample)
    pool = list(essay_vocabulary())
    rng.shuffle(pool)
    common, rare = pool[:num_cw], pool[num_cw:]
    costs = _Costs(tok)

    p = Prompt(tok)
    p.add(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n\n",
        "header",
    )
    q_ids = encode(
        tok,
        f"\n\nQuestion: What are the {num_cw} most common words in the above list? Answer: The "
        f"top {num_cw} words that appear most often in the list are:",
    )
    budget = length - len(p) - len(q_ids)

    # Frequencies grow with the list: roughly 30% of the entries are common words, as in RULER at 4k.
    entry = len(costs.idx(max(2, budget // 8))) + sum(map(len, costs.words(pool[:200]))) / 200
    freq_cw = int(max(2, min(30, round(0.3 * budget / entry / num_cw))))
    freq_ucw = max(1, freq_cw // 10)
    words: list[str] = []
    total = 0  # tokens of the entries in `words`

    def cost(ws):  # tokens that appending these words would take, index pieces included
        n = len(words)
        return sum(map(len, costs.words(ws))) + sum(len(costs.idx(n + 1 + j)) for j in range(len(ws)))

    total = cost(common * freq_cw)
    words.extend(common * freq_cw)
    if total > budget:
        raise ValueError(f"length {length} is too short for ruler/cwe")
    # Rare words in groups of freq_ucw while a group fits, then single rare words, then a cut entry.
    r = 0
    for group_size in (freq_ucw, 1):
        while r < len(rare):
            group = [rare[r]] * group_size
            c = cost(group)
            if total + c > budget:
                break
            words.extend(group)
            total, r = total + c, r + 1
    if r >= len(rare):
        raise ValueError(f"length {length} needs more distinct words than the essays have")
    rng.shuffle(words)
    pieces = []
    for k, w in enumerate(words, 1):
        pieces += costs.idx(k) + costs.word[w]
    rest = budget - len(pieces)
    assert 0 <= rest
    tail = (costs.idx(len(words) + 1) + costs.words([rare[r]])[0])[:rest] if rest else []
    p.add(pieces + tail, "context")
    p.add(q_ids, "question")
    counts = {w: words.count(w) for w in common}
    assert min(counts.values()) == freq_cw and freq_cw > freq_ucw
    return _finish(
        tok,
        p,
        "cwe",
        length,
        seed,
        sample,
        common,
        "recall",
        freq_cw=freq_cw,
        freq_ucw=freq_ucw,
        entries=len(words),
        cut_entry=bool(tail),
    )


def fwe(tok, length: int, seed: int, sample: int, alpha: float = 2.0, vocab: int = 200) -> Task:
    rng = rng_for("ruler", "fwe", length, seed, sample)
    coded: list[str] = []
    while len(coded) < vocab + 8:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
        if w not in coded:
            coded.append(w)
    spares, coded = coded[vocab:], coded[:vocab]
    weights = [1 / (r + 1) ** alpha for r in range(vocab)]
    costs = _Costs(tok)
    costs.words(coded + spares)

    p = Prompt(tok)
    p.add(
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words.\n\n",
        "header",
    )
    q_ids = encode(
        tok,
        "\n\nQuestion: What are the three most frequently appeared words in the above coded text? "
        "Answer: According to the coded text above, the three most frequently appeared words are:",
    )
    budget = length - len(p) - len(q_ids)
    first_ids = {w: encode(tok, w) for w in coded}  # the text opens without a space
    for attempt in range(100):
        words, used = [], 0
        while True:
            w = rng.choices(coded, weights)[0]
            ids = first_ids[w] if not words else costs.word[w]
            if used + len(ids) > budget:
                break
            words.append(w)
            used += len(ids)
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        ranked = sorted(counts.values(), reverse=True) + [0, 0, 0, 0]
        if ranked[2] > max(ranked[3], 1):
            break
    else:
        raise ValueError(f"length {length} is too short for ruler/fwe")
    top = sorted(counts, key=lambda w: -counts[w])[:3]
    pieces = [tid for i, w in enumerate(words) for tid in (first_ids[w] if i == 0 else costs.word[w])]
    for w in spares:  # fill the last few tokens with made-up words used nowhere else
        pieces += costs.word[w][: budget - len(pieces)]
    if len(pieces) != budget:
        raise AssertionError("fwe: could not fill the last tokens")
    p.add(pieces, "context")
    p.add(q_ids, "question")
    return _finish(
        tok,
        p,
        "fwe",
        length,
        seed,
        sample,
        top,
        "recall",
        counts={w: counts[w] for w in top},
        alpha=alpha,
        words=len(words),
    )


# --------------------------------------------------------------------------------------------


def make(tok, name: str, length: int, seed: int = 0, sample: int = 0) -> Task:
    if name in NIAH:
        return niah(tok, name, length, seed, sample)
    if name == "vt":
        return vt(tok, length, seed, sample)
    if name == "cwe":
        return cwe(tok, length, seed, sample)
    if name == "fwe":
        return fwe(tok, length, seed, sample)
    raise ValueError(f"unknown RULER task {name!r}; known: {TASKS}")


def generate(tok, length: int, seed: int = 0, tasks=TASKS, samples: int = 1) -> list[Task]:
    """``samples`` instances of each RULER task for one context length."""
    return [make(tok, name.removeprefix("ruler/"), length, seed, s) for name in tasks for s in range(samples)]
