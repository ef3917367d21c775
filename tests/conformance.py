"""The conformance list: every registered policy with a cheap and a demanding setting.

``tests/test_conformance.py`` runs every entry through one loop of checks (a no-op equal to ``full``, the
budget respected in stored bytes, state reset between prompts, a SlotCache equal to a DynamicCache, a
left-padded batch equal to its rows alone). A new policy adds one entry here; a policy without one fails
``test_every_policy_has_an_entry``. Prompts are ``PROMPT`` tokens, decoded ``NEW`` steps, on the tiny
two-layer Llama of ``tests/families.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

PROMPT, NEW = 40, 6
DUO_PATTERN = os.path.join(os.path.dirname(__file__), "data", "duo_pattern_llama.tsv")
PUNCT = [5, 7]  # sentence-end token ids of the conformance prompts (sablock's segments)
GATE = dict(layer=0)  # the two-layer model's only selection layer
UNEVEN = (  # a left-padded batch on a DynamicCache is refused (tests/test_conformance.py checks the refusal)
    "its layers store different lengths and transformers sizes a decode step's padding mask from layer 0's "
    "(a known limit on a DynamicCache: docs/policies/pyramidkv.md)"
)


@dataclass(frozen=True)
class Entry:
    """How one policy is checked. ``noop``: parameters under which it equals ``full`` on these prompts;
    ``demanding``: parameters under which it acts on them (evicts, stops early, gates); ``kept(P, T)``: the
    most entries a layer stores after a ``P``-token prompt and ``T`` decode steps under ``demanding``;
    ``unpadded``: why a left-padded batch is not checked (empty: it is); ``driver``: ``"fusion"`` for a policy that only
    ``kvpass.ChunkFusion`` runs (its own tests cover it; here the plain path must refuse it), ``"reconstruct"`` for one
    whose repeat passes run around a SlotCache's prefill (``kvpass.repeat_passes``: kvpass.compile's generate,
    RequestQueue, `kvpass compare`; ``tests/test_kvzip.py`` runs these checks there);
    ``parallel``: the
    parameters that replace ``demanding``'s under tensor parallelism, where a decision averaged over a layer's
    heads is refused (``tests/test_tensor_parallel.py``)."""

    noop: dict = field(default_factory=dict)
    demanding: dict = field(default_factory=dict)
    kept: Callable[[int, int], int] = lambda p, t: p + t
    unpadded: str = ""
    driver: str = ""
    parallel: dict = field(default_factory=dict)


def _prefill(budget: int, window: int = 4, **more) -> dict:
    return dict(budget=budget, window=window, **more)


CONFORMANCE: dict[str, Entry] = {
    "full": Entry(),
    "streamingllm": Entry(dict(budget=1000), dict(budget=16, sinks=2), kept=lambda p, t: 16),
    "art": Entry(
        dict(tau=0.0, phi=0.0, block=16),
        dict(tau=0.9, phi=0.9, patience=1, block=16),
        unpadded="its stop rule reads blocks of 16 slots and left padding moves their boundaries, so a "
        "padded row may stop at another block than alone (exact with tau=0)",
    ),
    "snapkv": Entry(_prefill(1000), _prefill(16), kept=lambda p, t: 16 + t),
    "pyramidkv": Entry(_prefill(1000), _prefill(16), kept=lambda p, t: 2 * 16 + t, unpadded=UNEVEN),
    "chunkkv": Entry(_prefill(1000, chunk=4), _prefill(16, chunk=4), kept=lambda p, t: 16 + t),
    "sablock": Entry(
        _prefill(1000, punctuation_ids=PUNCT), _prefill(16, punctuation_ids=PUNCT), kept=lambda p, t: 16 + t
    ),
    # no window by default (kvpress's presses have none): the demanding setting runs that path
    "knorm": Entry(_prefill(1000, window=0), _prefill(16, window=0), kept=lambda p, t: 16 + t),
    "keydiff": Entry(_prefill(1000, window=0), _prefill(16, window=0), kept=lambda p, t: 16 + t),
    # its defaults (4 sinks, no window), as kvpress's ExpectedAttentionPress
    "expected_attention": Entry(dict(budget=1000), dict(budget=16), kept=lambda p, t: 16 + t),
    # snapkv as the scorer, with the frame's window of 4 (its own, 32, would exceed the demanding budget)
    "criticalkv": Entry(_prefill(1000), _prefill(16), kept=lambda p, t: 16 + t),
    # per-head budgets over snapkv (window 4): the layer's H_kv x 16 entries shared out among its heads
    # (under tensor parallelism each rank allocates its own heads' share: alpha=1, each head the scorer's choice,
    # decides as one device)
    "adakv": Entry(_prefill(1000), _prefill(16), kept=lambda p, t: 16 + t, parallel=_prefill(16, alpha=1.0)),
    # the tiny llama's pattern (tests/data): one streaming head in each layer at 0.5; a head's window 2 + 8
    "duoattention": Entry(
        dict(pattern=DUO_PATTERN, streaming=0.0),
        dict(pattern=DUO_PATTERN, sinks=2, recent=8),
        kept=lambda p, t: -(-(p + t + 2 + 8 + t) // 2),
    ),
    "h2o": Entry(dict(budget=1000), dict(budget=16, heavy=0.5), kept=lambda p, t: 16),
    "tova": Entry(dict(budget=1000), dict(budget=16), kept=lambda p, t: 16, parallel=dict(budget=16, per_head=True)),
    "quest": Entry(dict(budget=1024), dict(budget=16, dense_layers=0)),  # reads pages, frees nothing
    # keeps every prompt page and budget/16 + 1 decode pages (a pool of 16-entry pages)
    "raas": Entry(dict(budget=1024), dict(budget=16, alpha=0.5), kept=lambda p, t: (-(-p // 16) + 2) * 16),
    "asl": Entry(_prefill(1000), _prefill(16, **GATE), kept=lambda p, t: 16 + t),
    "asl_fullkv": Entry(_prefill(1000), _prefill(16, **GATE), unpadded=UNEVEN),  # layers to the gate keep all
    "asl_2pass": Entry(_prefill(1000), _prefill(16, **GATE), kept=lambda p, t: 16 + t),
    "fastkv": Entry(_prefill(1000, **GATE), _prefill(16, **GATE), kept=lambda p, t: 16 + t),  # its default layer
    # (L // 2) is the two-layer model's last: no gate, so the no-op would not run the gated path
    "gemfilter": Entry(dict(budget=1000), dict(budget=16, **GATE), kept=lambda p, t: 16 + t),
    "kvzip": Entry(driver="reconstruct"),
    **{name: Entry(driver="fusion") for name in ("a3", "a3+evict", "cacheblend", "legolink", "pie", "full_reuse")},
}


# What a policy class may add over its parent and still run its parent's mechanism: how it ranks entries at prefill
# (a pure function of one row's tensors, which the loop above checks per policy, left-padded rows included) and
# its parameters. Everything else (planning, selection frame, slot rule and hooks, budgets per layer, gates) is
# mechanism.
SCORING = {"priority", "check_config", "params", "name", "summary"}


def mechanism(name: str) -> tuple:
    """The policy's mechanism: for each public attribute of its class other than ``SCORING`` and its parameters,
    the class that defines it, and its ``needs``."""
    import dataclasses

    from kvpass.policies import POLICIES

    cls = POLICIES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    attrs = sorted({a for k in cls.__mro__ for a in vars(k) if not a.startswith("_")} - fields - SCORING)
    return tuple((a, next(k for k in cls.__mro__ if a in vars(k))) for a in attrs) + (cls.needs,)


def one_per_mechanism(names: list[str]) -> list[str]:
    """The first of ``names`` (in order) of each mechanism: the tests that exercise what policies do beyond ranking
    (admission into a running batch, request queues, graphs per prompt length) run these; a scorer added on an
    existing frame (``knorm`` beside ``snapkv``) is covered there by the policy whose frame it shares."""
    seen: dict[tuple, str] = {}
    for n in names:
        seen.setdefault(mechanism(n), n)
    return list(seen.values())
