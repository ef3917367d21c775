"""Deterministic evaluation tasks for KV-cache policies, with exact token lengths, and their scorers.

    from kvpass.eval import tasks
    for t in tasks.build("niah", tokenizer, lengths=[1024, 4096], seed=0):
        out = generate(model, t.input_ids, max_new_tokens=t.max_new_tokens)   # greedy
        s = tasks.score(t, tokenizer.decode(out))                             # in [0, 1]

Families (one module each, see their docstrings):

- ``niah``        needle in a haystack on Paul Graham essays: depth grid x {passkey, magic_number}
- ``ruler``       RULER-style synthetic tasks: niah_single_{1,2,3}, niah_multikey, niah_multivalue,
                  niah_multiquery, vt, cwe, fwe
- ``long_decode`` essay continuation scored by agreement with the full cache (the harness scores it),
                  plus few-shot arithmetic from reasoning-gym when it is installed
- ``chunk_qa``    system prompt, k documents of exactly 512 tokens each with one planted fact, question

Every ``Task.input_ids`` is exactly ``meta["length"]`` tokens, BOS included when the tokenizer adds
one by default (Gemma: yes; SmolLM2: no); see ``kvpass.eval.tasks._core``. Prompts are completion
style: the last words of the prompt start the answer sentence ("... The pass key is"), so greedy
decoding without a chat template is intended. Each generator is deterministic in
(tokenizer, length, seed, options).
"""

from __future__ import annotations

from kvpass.eval.tasks import chunk_qa, long_decode, niah, ruler
from kvpass.eval.tasks._core import Task, haystack_text
from kvpass.eval.tasks.scoring import SCORERS, score

FAMILIES = {
    "niah": niah.generate,
    "ruler": ruler.generate,
    "long_decode": long_decode.generate,
    "chunk_qa": chunk_qa.generate,
}


def build(family: str, tokenizer, lengths: list[int], seed: int = 0, **options) -> list[Task]:
    """All tasks of ``family`` for each length (in the order given), deterministic in the arguments.

    Options go to the family's generator:
      niah:        depths=(0, .25, .5, .75, 1.0), kinds=("passkey", "magic_number")
      ruler:       tasks=ruler.TASKS (names without the "ruler/" prefix), samples=1
      long_decode: max_new_tokens=512, reasoning=None (None: include reasoning-gym problems if it is
                   installed), reasoning_samples=4
      chunk_qa:    chunk_tokens=512, targets="ends" ("ends": first, middle, last chunk; "all"; or a
                   list of chunk indices)
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {sorted(FAMILIES)}")
    if isinstance(lengths, int):
        lengths = [lengths]
    out: list[Task] = []
    for n in lengths:
        out.extend(FAMILIES[family](tokenizer, int(n), seed, **options))
    return out


__all__ = ["Task", "SCORERS", "FAMILIES", "build", "score", "haystack_text"]
