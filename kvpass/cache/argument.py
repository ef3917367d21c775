"""The keyword a model's ``forward`` and ``generate`` take the cache by: ``cache`` from transformers 5.24 on
(``past_key_values`` still works there, with a deprecation warning), ``past_key_values`` before."""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _of_class(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwarg(model) -> str:
    """``"cache"`` where ``type(model).forward`` takes a ``cache`` argument, else ``"past_key_values"``."""
    return _of_class(type(model))


def with_cache(model, cache) -> dict:
    """``{cache_kwarg(model): cache}``: keyword arguments that pass ``cache`` to ``model`` or its ``generate``."""
    return {cache_kwarg(model): cache}
