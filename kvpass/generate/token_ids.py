"""Token ids as kvpass's entry points take them: one check, so that no entry point truncates, wraps or misreads
what a caller passes.

    from kvpass.generate.token_ids import token_ids
    ids = token_ids(prompt, "kvpass.RequestQueue.add", vocab_size=vocab_size(model))

A prompt is a 1-D sequence of integer ids (a list, a tuple or a tensor of an integer dtype) or one row ``[1, L]``.
Floats are refused even where every value is whole, as transformers refuses a float tensor of ids: converting
``[5.7, 6.2]`` to integers would give other tokens without a word. Booleans are refused too. With ``vocab_size``,
an id outside ``0 .. vocab_size - 1`` is refused before it reaches the embedding (on a GPU, an index out of range
is a device assert that ends the process).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.errors import ConfigError


def token_ids(ids, where: str, parameter: str = "ids", vocab_size: int | None = None) -> Tensor:
    """``ids`` as a 1-D int64 tensor (on the device of a tensor given, else on the CPU).

    Args:
        ids: a non-empty 1-D sequence of token ids, or one row ``[1, L]``: a list or tuple of ints, or a tensor
            of an integer dtype.
        where: what took them (``"kvpass.RequestQueue.add"``), for the error.
        parameter: the name of the caller's parameter, for the error.
        vocab_size: when given, every id must be below it (and none negative).

    Raises ``ConfigError`` naming ``where``, ``parameter`` and what to pass instead.
    """
    try:
        t = ids if isinstance(ids, Tensor) else torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"{where}: parameter '{parameter}' must be a sequence of integer token ids (a list of "
            f"ints or an integer tensor), got {type(ids).__name__} ({e})"
        ) from None
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:  # before the dtype: an empty list is a float tensor
        raise ConfigError(
            f"{where}: parameter '{parameter}' must be a non-empty 1-D sequence of token ids (or one "
            f"row [1, L]), got shape {tuple(t.shape)}"
        )
    return check_values(t, where, parameter, vocab_size)


def check_values(t: Tensor, where: str, parameter: str, vocab_size: int | None = None) -> Tensor:
    """``t`` (ids, at least 1-D) as int64, refused by ``ConfigError`` where it is not of an integer dtype or (with
    ``vocab_size``) holds an id outside ``0 .. vocab_size - 1``; the message gives the first such id's index."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ConfigError(
            f"{where}: parameter '{parameter}' must hold integer token ids, got dtype {t.dtype} "
            f"(kvpass does not round or truncate ids: pass the tokenizer's integers, e.g. "
            f"torch.tensor(ids, dtype=torch.long))"
        )
    t = t.long()
    if vocab_size is not None:
        bad = ((t < 0) | (t >= vocab_size)).nonzero()
        if bad.numel():
            at = tuple(int(i) for i in bad[0])
            raise ConfigError(
                f"{where}: parameter '{parameter}' holds token id {int(t[at])} at position "
                f"{at[0] if len(at) == 1 else at}, outside the model's vocabulary of {vocab_size} ids "
                f"(0 .. {vocab_size - 1}); tokenize with the model's own tokenizer"
            )
    return t


def vocab_size(model) -> int | None:
    """How many token ids ``model``'s input embedding takes (its ``num_embeddings``), else its config's
    ``vocab_size``; None where neither says."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embedding = None
    n = getattr(embedding, "num_embeddings", None)
    if isinstance(n, int):
        return n
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "vocab_size", None)
    return n if isinstance(n, int) else None
