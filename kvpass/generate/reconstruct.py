"""Repeat passes before a prefill, for a policy that scores a prompt by how the model repeats it (kvzip).

A policy whose ``Needs.reconstructs`` is set (``kvpass.policies.contract.ReconstructPolicy``) chooses what a prefill
keeps from scores that only the whole model can give: after the prompt, the model reads a prompt asking it to repeat
the context, then the context (``policy.passes``), and each layer's attention over the prompt's entries scores them
(``kvpass::repeat_scores``, ``Runtime.repeat_scores``). ``repeat_passes`` runs that on a ``DynamicCache`` of its
own, which keeps the whole prompt: the prompt is prefilled into it, and each pass runs on a shallow copy of it (a
``DynamicCache`` update rebinds its tensors and never writes into them), so every pass finds the prompt's entries
alone, as the paper's passes do once their own entries are dropped. The scores stay in the backend's generation
state (``GenerationState.scores``) for the prefill that follows on the caller's cache, whose ``select`` keeps the
best entries; that prefill gives the first token. The scoring cache goes before the block runs.

``kvpass.compile``'s ``generate`` (``decode_loop.decode``), ``kvpass.RequestQueue`` and ``kvpass compare``'s runner
call it around their prefill; a SlotCache prefill of such a policy outside it is refused by name.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import DynamicCache

from kvpass.cache.argument import cache_kwarg


@contextlib.contextmanager
def repeat_passes(model, be, ids: torch.Tensor, mask: torch.Tensor | None = None, one_logit: bool = True, forward=None):
    """``kvpass.repeat_passes``: within the block, ``be``'s generation state holds the repeat passes' scores of
    prompt ``ids [B, n]`` (``mask [B, n]``: 1 for a real token, or None) for the prefill the block runs; nothing
    when ``be``'s policy does not reconstruct, or ``be`` is None. ``forward``: the compiled forward (default:
    ``model`` itself, whose ``forward`` kvpass.compile replaced); ``one_logit``: it takes ``logits_to_keep`` (no
    logits are read here)."""
    if be is None or not be.policy.needs.reconstructs:
        yield
        return
    if mask is not None and bool(mask.all()):
        mask = None  # no padding: no mask, so the scoring prefill builds no [n, n] mask (31 GiB at 130k tokens)
    passes = be.policy.passes(ids, mask)
    if not passes:  # nothing to choose from (a prompt within the budget)
        yield
        return
    forward = model if forward is None else forward
    state = be.runtime.state
    kw = {"use_cache": True, **({"logits_to_keep": 1} if one_logit else {})}
    cache = DynamicCache(config=model.config)
    where = cache_kwarg(model)
    state.passes = True
    try:
        with torch.no_grad():
            forward(input_ids=ids, **_masked(mask, ids.shape[1]), **{where: cache}, **kw)
            for start, end, pass_ids, pass_mask in passes:
                state.repeat = (start, end)
                forward(input_ids=pass_ids, **_masked(pass_mask, pass_ids.shape[1]), **{where: _shallow(cache)}, **kw)
                state.repeat = None
        del cache
        yield
    finally:
        state.repeat, state.passes = None, False
        state.scores.clear()


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
