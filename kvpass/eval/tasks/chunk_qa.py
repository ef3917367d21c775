"""Chunked multi-document QA, for chunk-fusion policies (CacheBlend-style KV reuse of documents).

What it measures: whether a policy that computes each document's KV cache separately (and reuses
it, possibly recomputing a few tokens) still lets the model answer a question that needs one fact
from one document. Each document holds exactly one fact, so the answer depends on one chunk only,
and the other chunks are distractors of the same shape.

Layout (exactly ``length`` tokens):

    S  system part: [BOS] + instruction + a filler passage from the essays (no fact) that absorbs
       the tokens left over, so that the chunks can all be exactly ``chunk_tokens`` long
    C1 ... Ck  documents of exactly ``chunk_tokens`` (512) tokens: "\\n\\nDocument:\\n" + essay
       sentences with one planted fact "The secret code of the {key} is {4 digits}." at a random
       sentence boundary, cut to fit; keys are a color and a thing ("red door", "teal vault")
    Q  "\\n\\nQuestion: What is the secret code of the {key}? Answer: The secret code of the
       {key} is"   -> " 4817"

k = (length - |S without filler| - |Q|) // chunk_tokens, at most len(fact_keys(tok)) (about 190).
``meta["spans"]`` has "system", "chunks" (list of (start, end)), "question"; ``meta["target_chunk"]`` is the index of
the chunk holding the answer, ``meta["fact_spans"]`` where each fact is. A chunk's ids depend only on
(seed, length, chunk index), never on the question, so the tasks of one length (one per target
chunk) share S and all chunks and differ only in Q: a policy may cache chunks across them.
"""

from __future__ import annotations

from kvpass.eval.tasks._core import (
    Prompt,
    Task,
    bos_ids,
    check_length,
    encode,
    encode_many,
    fill,
    find_all,
    plant,
    random_number,
    rng_for,
    start_sentence,
    units_for,
)

CHUNK_TOKENS = 512
MAX_NEW_TOKENS = 16
COLORS = (
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "black",
    "white",
    "pink",
    "brown",
    "gray",
    "golden",
    "silver",
    "violet",
    "crimson",
    "turquoise",
    "beige",
    "maroon",
    "navy",
    "olive",
    "teal",
    "lavender",
    "scarlet",
    "indigo",
    "amber",
    "coral",
    "ivory",
    "magenta",
    "bronze",
    "emerald",
    "ruby",
    "copper",
)
THINGS = ("door", "gate", "safe", "vault", "locker", "chest")
INSTRUCTION = (
    "You are given several documents. Each document mentions the secret code of one thing, "
    "such as a door or a safe. Read them and answer the question at the end.\n\nBackground:\n"
)
DOC_HEADER = "\n\nDocument:\n"


def _question(key: str) -> str:
    return f"\n\nQuestion: What is the secret code of the {key}? Answer: The secret code of the {key} is"


def fact_keys(tok) -> list[str]:
    """ "{color} {thing}" keys whose question has the most common token length for this tokenizer, so
    that Q (and hence S and every chunk position) has the same length whichever chunk is asked about."""
    keys = [f"{c} {t}" for t in THINGS for c in COLORS]
    lens = dict(zip(keys, map(len, encode_many(tok, [_question(k) for k in keys]))))
    mode = max(sorted(set(lens.values())), key=lambda n: sum(v == n for v in lens.values()))
    return [k for k in keys if lens[k] == mode]


def layout(tok, length: int, seed: int, chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """System part, chunks and facts for one (length, seed); shared by all questions."""
    rng = rng_for("chunk_qa", length, seed)
    units = units_for(tok, "essay")
    bos = bos_ids(tok)
    instr = encode(tok, INSTRUCTION)
    doc_header = encode(tok, DOC_HEADER)
    keys = fact_keys(tok)
    q_len = len(encode(tok, _question(keys[0])))
    k = (length - len(bos) - len(instr) - q_len) // chunk_tokens
    if k < 1:
        raise ValueError(f"length {length} is too short for chunk_qa with {chunk_tokens}-token chunks")
    if k > len(keys):
        raise ValueError(f"chunk_qa supports at most {len(keys)} chunks with this tokenizer; use a shorter length")
    chosen = rng.sample(keys, k)
    codes: list[str] = []
    while len(codes) < k:
        c = random_number(rng, 4)
        if c not in codes:
            codes.append(c)
    chunks, facts, fact_ids = [], [], []
    for i in range(k):
        start = start_sentence(units, rng)  # each document opens an essay or paragraph
        fact = f"The secret code of the {chosen[i]} is {codes[i]}."
        ids, (span,), (fid,), _ = plant(tok, units, start, chunk_tokens - len(doc_header), [fact], [rng.random()])
        chunks.append(doc_header + ids)
        facts.append((len(doc_header) + span[0], len(doc_header) + span[1]))
        fact_ids.append(fid)
    return dict(
        k=k,
        chosen=chosen,
        codes=codes,
        chunks=chunks,
        facts=facts,
        fact_ids=fact_ids,
        instr=instr,
        filler_start=start_sentence(units, rng_for("chunk_qa/filler", length, seed)),
    )


def make(tok, length: int, seed: int, target: int, chunk_tokens: int = CHUNK_TOKENS, lay: dict | None = None) -> Task:
    lay = lay or layout(tok, length, seed, chunk_tokens)
    k = lay["k"]
    if not 0 <= target < k:
        raise ValueError(f"target chunk {target} out of range: this length has {k} chunks")
    key, code = lay["chosen"][target], lay["codes"][target]
    q_ids = encode(tok, _question(key))
    p = Prompt(tok)
    p.add(lay["instr"])
    filler = length - len(p) - k * chunk_tokens - len(q_ids)
    p.add([t for piece in fill(units_for(tok, "essay"), lay["filler_start"], filler) for t in piece])
    p.spans["system"] = (0, len(p))
    chunk_spans, fact_spans = [], []
    for ids, (a, b) in zip(lay["chunks"], lay["facts"]):
        s, _ = p.add(ids)
        chunk_spans.append((s, s + len(ids)))
        fact_spans.append((s + a, s + b))
    p.spans["chunks"] = chunk_spans
    p.add(q_ids, "question")
    for fid, (a, _) in zip(lay["fact_ids"], fact_spans):
        assert find_all(p.ids, fid) == [a], "each fact must occur exactly once"
    task = Task(
        family="chunk_qa",
        name="chunk_qa/secret_code",
        input_ids=p.ids,
        answers=[code],
        metric="contains",
        max_new_tokens=MAX_NEW_TOKENS,
        meta=dict(
            length=length,
            seed=seed,
            target_chunk=target,
            key=key,
            num_chunks=k,
            chunk_tokens=chunk_tokens,
            spans=p.spans,
            fact_spans=fact_spans,
            keys=lay["chosen"],
            codes=lay["codes"],
            depth=target / max(k - 1, 1),
            bos=bool(bos_ids(tok)),
        ),
    )
    return check_length(task)


def generate(tok, length: int, seed: int = 0, chunk_tokens: int = CHUNK_TOKENS, targets="ends") -> list[Task]:
    """One task per target chunk: "ends" = first, middle and last chunk; "all"; or a list of indices."""
    lay = layout(tok, length, seed, chunk_tokens)
    k = lay["k"]
    if targets == "ends":
        targets = sorted({0, k // 2, k - 1})
    elif targets == "all":
        targets = range(k)
    return [make(tok, length, seed, int(t), chunk_tokens, lay) for t in targets]
