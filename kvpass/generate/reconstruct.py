"""Repeat passes over a prefill's entries, for a policy that scores a prompt by how the model repeats it (kvzip).

A policy whose ``Needs.reconstructs`` is set (``kvpass.policies.contract.ReconstructPolicy``) chooses what a prefill
keeps from scores that only the whole model can give: after the prompt, the model reads a prompt asking it to repeat
the context, then the context (``policy.passes``), and each layer's attention over the prompt's entries scores them
(``kvpass::repeat_scores``, ``Runtime.repeat_scores``).

Within ``repeat_passes`` the caller prefills its ``kvpass.SlotCache`` as usual, and that prefill is the only one:
each layer's ``slot_prefill`` hands its entries to the passes' ``DynamicCache`` (``Deferred.cache``, which keeps
the whole prompt) and leaves the choice for later (``Deferred.keeps``); a sliding-window layer writes its ring at
once. When the prefill's forward returns (``kvpass.compile``'s forward calls ``finish``; otherwise the block's end
does), the passes run, each on a shallow copy of that cache (a ``DynamicCache`` update rebinds its tensors and never
writes into them), so every pass finds the prompt's entries alone, as the paper's passes do once their own entries
are dropped; the scores go to ``GenerationState.scores``, and each held layer keeps its best entries from them
(``slots.keep_held``, the rest of ``slot_prefill``). The prefill's logits do not depend on the choice: the first token
comes from them. The scoring cache goes before the block's first decode step.

``kvpass.compile``'s ``generate`` (``decode_loop.decode``), ``kvpass.RequestQueue`` and ``kvpass compare``'s runner
call it around their prefill; a SlotCache prefill of such a policy outside it is refused by name.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvpass.cache import slots
from kvpass.cache.argument import cache_kwarg
from kvpass.errors import ConfigError

_TAGS = itertools.count(2)


@dataclass
class Deferred:
    """The repeat passes of one prompt, waiting for the prefill whose entries they score: ``cache`` receives each
    layer's keys and values (``slot_prefill``), ``keeps`` per layer what its choice needs once the scores exist."""

    cache: DynamicCache
    length: int  # the prompt's tokens, which the passes score
    passes: list
    forward: object
    where: str
    kw: dict
    keeps: dict = field(default_factory=dict)  # layer -> what slots.keep_held needs
    tag: int = field(default_factory=lambda: next(_TAGS))  # the held layers' counts carry -tag until they keep


@contextlib.contextmanager
def repeat_passes(model, be, ids: torch.Tensor, mask: torch.Tensor | None = None, one_logit: bool = True, forward=None):
    """``kvpass.repeat_passes``: the prefill of prompt ``ids [B, n]`` (``mask [B, n]``: 1 for a real token, or None)
    that the block runs on a ``kvpass.SlotCache`` keeps what ``be``'s policy scores by repeat passes over it; nothing
    changes when ``be``'s policy does not reconstruct, or ``be`` is None. The passes run as the prefill's forward
    returns on ``kvpass.compile``'s forward; on a plain ``torch.compile``d forward, as the block ends: end it right
    after the prefill, then decode (a cache written again before the passes is refused by name). ``forward``: the
    compiled forward for the passes (default: ``model`` itself, whose ``forward`` kvpass.compile replaced);
    ``one_logit``: it takes ``logits_to_keep`` (no logits are read here)."""
    if be is None or not be.policy.needs.reconstructs:
        yield
        return
    if mask is not None and bool(mask.all()):
        mask = None  # no padding: no mask, so no pass builds an [n, n + r] mask of the whole prompt
    passes = be.policy.passes(ids, mask)
    if not passes:  # nothing to choose from (a prompt within the budget)
        yield
        return
    state = be.runtime.state
    kw = {"use_cache": True, **({"logits_to_keep": 1} if one_logit else {})}
    state.deferred = Deferred(
        DynamicCache(config=model.config),
        ids.shape[1],
        passes,
        model if forward is None else forward,
        cache_kwarg(model),
        kw,
    )
    state.passes = True
    try:
        yield
        finish(be)
    finally:
        state.repeat, state.passes, state.deferred = None, False, None
        state.scores.clear()


def finish(be) -> None:
    """Run the repeat passes a prefill waits for and keep its held layers' entries by their scores; nothing when no
    SlotCache prefill ran inside ``repeat_passes`` since (another cache keeps every entry) or the passes ran."""
    state = be.runtime.state
    job = state.deferred
    if job is None or not job.keeps:
        return
    state.deferred = None  # the passes' own forward calls prefill nothing
    got = sorted({job.cache.layers[layer].keys.shape[-2] for layer in job.keeps})
    if got != [job.length]:
        raise ConfigError(
            f"policy '{be.policy.name}': its repeat passes score the whole {job.length}-token prompt, and the "
            f"prefill inside kvpass.repeat_passes gave {got} entries; prefill the whole prompt in one call"
        )
    target = _held_cache(be, job)
    with torch.no_grad():
        for start, end, pass_ids, pass_mask in job.passes:
            state.repeat = (start, end)
            masked = _masked(pass_mask, pass_ids.shape[1])
            job.forward(input_ids=pass_ids, **masked, **{job.where: _shallow(job.cache)}, **job.kw)
            state.repeat = None
        for layer, held in job.keeps.items():
            k, v, scores = job.cache.layers[layer].keys, job.cache.layers[layer].values, state.scores.get(layer)
            slots.keep_held(be.runtime, target.layers[layer], held, k, v, scores)
    be.runtime.slot_cache_prefilled(target)


def _held_cache(be, job: Deferred):
    """The SlotCache whose prefill ``job`` holds: the one whose held layers' counts carry the job's tag (a graph
    may run ``slot_prefill`` on copies of the cache's tensors, so the operator's arguments do not name it)."""
    for cache in list(be.runtime.slot_caches):  # every kvpass.SlotCache built for this backend
        layers = cache.layers
        if all(i < len(layers) and bool((layers[i].count[:, slots.SEEN] == -job.tag).all()) for i in job.keeps):
            return cache
    raise ConfigError(
        f"policy '{be.policy.name}': the kvpass.SlotCache prefilled inside kvpass.repeat_passes was written again "
        f"before the repeat passes ran (on a forward of your own they run as the block ends); end the block right "
        f"after the prefill, then decode"
    )


def _shallow(cache):
    """A copy of ``cache`` whose layers are copies: an update rebinds the copy's tensors, the original keeps its."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def _masked(mask: torch.Tensor | None, length: int) -> dict:
    """The keywords of a call of ``length`` tokens under ``mask`` (its whole sequence): the mask, and each row's
    position ids counted over its real tokens as transformers' ``generate`` counts them; none without a mask (the
    model counts every token, and the call's graph is the one a caller's unmasked prefill compiles)."""
    if mask is None:
        return {}
    return {"attention_mask": mask, "position_ids": (mask.long().cumsum(-1) - 1).clamp_min(0)[:, -length:]}
