"""Long decoding, for policies that evict during generation rather than (only) at prefill.

What it measures: how far generation under a policy drifts from generation with the full cache,
over 512 to 4096 new tokens. There is no fixed answer: the harness first generates greedily with
the full cache (the reference), then scores a policy by

    - greedy-token agreement: the fraction of steps where the policy's greedy token equals the
      reference token (teacher-forced on the reference, or up to the first divergence, as the
      harness defines it), and
    - the perplexity of the reference continuation under the policy.

Hence ``metric="agreement"``, ``answers=[]``, and ``score()`` refuses these tasks. Set the
generation to ignore EOS (``meta["ignore_eos"]``): instruct models may stop early.

Prompt for "long_decode/continue" (exactly ``length`` tokens, BOS included if the tokenizer adds it):

    Below is an excerpt from an essay by Paul Graham.\\n\\n
    <essay text, starting mid-sentence so that it ends at a sentence end>
    \\n\\nContinue the essay in the same style, for several more paragraphs:\\n\\n

Reasoning problems (only if ``reasoning-gym`` is installed; ``reasoning=None`` means "if
importable"): few-shot arithmetic that SmolLM2-135M-Instruct solves part of the time, as
"long_decode/basic_arithmetic" (two one-digit terms, + - *) and "long_decode/chain_sum" (two
one-digit terms, + -). The prompt is ``length`` tokens of solved examples
"Question: 4 - 1 = ?\\nAnswer: 3\\n\\n" (the first one cut to fit) then "Question: 7 * 2 = ?\\nAnswer:";
metric "contains" on the output cut at the first newline (``meta["stop"]``). These test decoding
with a long context but need only a few new tokens.
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
    rng_for,
    start_sentence,
    units_for,
)

MAX_NEW_TOKENS = 512
HEADER = "Below is an excerpt from an essay by Paul Graham.\n\n"
INSTRUCTION = "\n\nContinue the essay in the same style, for several more paragraphs:\n\n"

# reasoning-gym dataset -> config; chosen so that SmolLM2-135M-Instruct gets some right with few shots
# (measured on 10 problems after 8 shots: basic_arithmetic 8/10, chain_sum 4/10).
REASONING = {
    "basic_arithmetic": dict(
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+", "-", "*"),
        allow_parentheses=False,
        allow_negation=False,
    ),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}
REASONING_MAX_NEW_TOKENS = 8


def continuation(tok, length: int, seed: int, max_new_tokens: int = MAX_NEW_TOKENS) -> Task:
    """Essay excerpt + instruction to continue; scored by agreement with the full-cache generation."""
    units = units_for(tok, "essay")
    start = start_sentence(units, rng_for("long_decode", length, seed), paragraph=False)
    p = Prompt(tok)
    p.add(HEADER, "header")
    tail = encode(tok, INSTRUCTION)
    budget = length - len(p) - len(tail)
    if budget < 1:
        raise ValueError(f"length {length} is too short for long_decode/continue")
    text = fill(units, start, budget, fragment="start")
    p.add([t for piece in text for t in piece], "context")
    p.add(tail, "instruction")
    task = Task(
        family="long_decode",
        name="long_decode/continue",
        input_ids=p.ids,
        answers=[],
        metric="agreement",
        max_new_tokens=int(max_new_tokens),
        meta=dict(
            length=length,
            seed=seed,
            spans=p.spans,
            ignore_eos=True,
            bos=bool(bos_ids(tok)),
            reference="greedy generation with the full cache",
        ),
    )
    return check_length(task)


def reasoning_gym_available() -> bool:
    try:
        import reasoning_gym  # noqa: F401
    except Exception:
        return False
    return True


def _problems(name: str, seed: int, n: int) -> list[tuple[str, str]]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset(name, size=n, seed=seed, **REASONING[name])
    return [(ds[i]["metadata"]["expression"], str(ds[i]["answer"])) for i in range(n)]


def arithmetic(tok, name: str, length: int, seed: int, sample: int) -> Task:
    """Few-shot arithmetic from reasoning-gym, ``length`` tokens of solved examples then one question."""
    rng = rng_for("long_decode", name, length, seed, sample)
    ((expr, answer),) = _problems(name, rng.randrange(2**31), 1)
    p = Prompt(tok)
    q_ids = encode(tok, f"Question: {expr} = ?\nAnswer:")
    budget = length - len(p) - len(q_ids)
    if budget < 1:
        raise ValueError(f"length {length} is too short for long_decode/{name}")
    shots: list[list[int]] = []
    used, shot_seed = 0, rng.randrange(2**31)
    while used < budget:  # newest example last, cut the oldest to fit
        batch = [(e, a) for e, a in _problems(name, shot_seed, 256) if e != expr]
        shot_seed += 1
        for ids in encode_many(tok, [f"Question: {e} = ?\nAnswer: {a}\n\n" for e, a in batch]):
            shots.insert(0, ids)
            used += len(ids)
            if used >= budget:
                break
    shots[0] = shots[0][used - budget :]
    p.add([t for s in shots for t in s], "context")
    p.add(q_ids, "question")
    task = Task(
        family="long_decode",
        name=f"long_decode/{name}",
        input_ids=p.ids,
        answers=[answer],
        metric="contains",
        max_new_tokens=REASONING_MAX_NEW_TOKENS,
        meta=dict(
            length=length,
            seed=seed,
            sample=sample,
            spans=p.spans,
            stop=["\n"],
            expression=expr,
            shots=len(shots),
            source="reasoning-gym",
            bos=bool(bos_ids(tok)),
        ),
    )
    return check_length(task)


def generate(
    tok,
    length: int,
    seed: int = 0,
    max_new_tokens=MAX_NEW_TOKENS,
    reasoning: bool | None = None,
    reasoning_samples: int = 4,
) -> list[Task]:
    """The continuation task (one per value if ``max_new_tokens`` is a list), then, if reasoning-gym is
    there (or ``reasoning=True``, which fails without it), ``reasoning_samples`` problems per dataset."""
    budgets = [max_new_tokens] if isinstance(max_new_tokens, int) else list(max_new_tokens)
    tasks = [continuation(tok, length, seed, n) for n in budgets]
    if reasoning is None:
        reasoning = reasoning_gym_available()
    if reasoning:
        for name in REASONING:
            tasks += [arithmetic(tok, name, length, seed, s) for s in range(reasoning_samples)]
    return tasks
