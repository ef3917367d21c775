"""Requests admitted one at a time into the rows of a running batch.

A batch-1 ``SlotCache`` prefills each request; ``SlotCache.admit`` copies its row into a free row of the batch
cache, ``reset_row`` empties a finished one, and the batch decodes as one step with each row's own position.
The rows never mix: a row refilled while the others decode leaves their tokens what they are alone, here for the
policies whose decode steps run their own tensor code on the layer's state (``HOOKED``: a row's state must stay
its own) at the no-op setting, where nothing is evicted and the state alone tells the rows apart. Every policy's
rows, these included, are admitted through the same ``admit`` / ``reset_row`` by ``kvpass.RequestQueue``, whose test
(``tests/test_requests.py``: five requests through two rows, refilled while the other decodes) runs one policy of
each mechanism at its demanding setting.
"""

from __future__ import annotations

import pytest
import torch

import kvpass
from conformance import CONFORMANCE, one_per_mechanism
from families import build
from kvpass.policies import POLICIES, make_policy

SLOT = one_per_mechanism([n for n, e in CONFORMANCE.items() if not e.driver])  # conformance.py
# h2o, quest, raas, tova (their state at the no-op setting) and adakv (its heads' ranges, which each decode step
# writes); expected_attention's decode cuts, whose state each row keeps too: tests/test_expected_attention.py
HOOKED = [n for n in SLOT if make_policy(n, **CONFORMANCE[n].noop).slot_state(64, 16) or POLICIES[n].needs.heads]
MAX, NEW = 64, 12


def ids_of(n: int) -> torch.Tensor:
    return torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(n))


@torch.no_grad()
def prefill(model, staging, ids) -> torch.Tensor:
    """The request's first token (greedy), its prompt in ``staging``'s row 0."""
    staging.reset()
    return model(input_ids=ids, use_cache=True, **{model.generate.cache_kwarg: staging}).logits[:, -1].argmax(-1)


@torch.no_grad()
def step(model, cache, tokens) -> torch.Tensor:
    """One decode step of every row (each at its own position): the next tokens ``[B]``."""
    out = model(
        input_ids=tokens[:, None],
        position_ids=cache.row_positions(),
        use_cache=True,
        **{model.generate.cache_kwarg: cache},
    )
    return out.logits[:, -1].argmax(-1)


def alone(model, staging, ids, n: int) -> list[int]:
    tok = prefill(model, staging, ids)
    out = [int(tok)]
    for _ in range(n - 1):
        tok = step(model, staging, tok)
        out.append(int(tok))
    return out


# the demanding settings: tests/test_requests.py (CI time)
@pytest.mark.parametrize("policy,setting", [(p, "noop") for p in HOOKED])
def test_a_row_refilled_while_the_others_decode_keeps_every_row_as_alone(policy, setting):
    """Rows 0 and 1 take requests A and B; after 4 steps row 1 is emptied and takes C while row 0 goes on.
    Each row's tokens equal its request decoded alone (which equals ``generate``'s greedy tokens)."""
    torch._dynamo.reset()
    model = build("llama")
    params = getattr(CONFORMANCE[policy], setting)
    be = kvpass.compile(model, policy, compiler="eager", **params)
    staging = kvpass.SlotCache(model, be, max_length=MAX, max_new_tokens=16)
    batch = kvpass.SlotCache(model, be, max_length=MAX, batch_size=2, max_new_tokens=16)
    a, b, c = ids_of(20), ids_of(33), ids_of(27)
    want_a, want_c = alone(model, staging, a, NEW), alone(model, staging, c, NEW - 4)
    assert want_a == model.generate(a, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, 20:].tolist()

    tokens = torch.empty(2, dtype=torch.long)
    tokens[0] = prefill(model, staging, a)
    batch.admit(0, staging)
    tokens[1] = prefill(model, staging, b)
    batch.admit(1, staging)
    got_a, got_c = [int(tokens[0])], []
    for _ in range(3):
        tokens = step(model, batch, tokens)
        got_a.append(int(tokens[0]))
    batch.reset_row(1)  # B is done: C takes its row while A keeps decoding
    tokens[1] = prefill(model, staging, c)
    batch.admit(1, staging)
    got_c.append(int(tokens[1]))
    for _ in range(NEW - 4 - 1):
        tokens = step(model, batch, tokens)
        got_a.append(int(tokens[0]))
        got_c.append(int(tokens[1]))
    assert got_a == want_a[: len(got_a)] and got_c == want_c, (got_a, want_a, got_c, want_c)
    assert all(not r.problems for r in be.reports), be.plans()


def test_admit_refuses_another_configuration():
    torch._dynamo.reset()
    model = build("llama")
    be = kvpass.compile(model, "snapkv", compiler="eager", budget=16, window=4)
    batch = kvpass.SlotCache(model, be, max_length=MAX, batch_size=2, max_new_tokens=16)
    with pytest.raises(kvpass.ConfigError, match="has not been prefilled"):
        batch.admit(0, kvpass.SlotCache(model, be, max_length=MAX, max_new_tokens=16))
    with pytest.raises(kvpass.ConfigError, match="the two caches differ"):
        batch.admit(0, kvpass.SlotCache(model, be, max_length=2 * MAX, max_new_tokens=16))
    with pytest.raises(kvpass.ConfigError, match="'row' must be in 0..1"):
        batch.admit(2, kvpass.SlotCache(model, be, max_length=MAX, max_new_tokens=16))
