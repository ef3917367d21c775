"""What kvpass raises and warns: ``ConfigError`` for a bad name or parameter, ``KVPassWarning`` (said once per
backend through ``warn_once``) when a graph is compiled unchanged or a setting cannot take effect;
``device_assert`` for a check that must not sync the GPU."""

from __future__ import annotations

import warnings

import torch

DEVICE_MESSAGE_LIMIT = 254  # torch refuses a device assert's message of 255 characters or more on a GPU


def device_assert(cond, msg: str) -> None:
    """``torch._assert_async(cond, msg)``: fails on the device, without a host sync. On a GPU torch refuses a
    message of 255 characters or more when the assert is *called* (even when it holds, so every call of an
    eager operator failed there while the CPU tests passed); checked here on every device."""
    if len(msg) > DEVICE_MESSAGE_LIMIT:
        raise ValueError(
            f"kvpass bug: a device assert's message is {len(msg)} characters (torch's limit on a GPU: "
            f"{DEVICE_MESSAGE_LIMIT}): {msg[:80]}..."
        )
    torch._assert_async(cond, msg)


class ConfigError(ValueError):
    """A policy name or parameter is invalid. The message names the parameter and its range; it starts with
    ``kvpass`` (added where the raising code names only the policy or the class), so a user can tell the library's
    refusal from one of torch or transformers."""

    def __init__(self, msg: str = "", *args) -> None:
        msg = str(msg)
        super().__init__(msg if msg.startswith("kvpass") else f"kvpass: {msg}", *args)


class SlotCacheUnrewritten(ConfigError):
    """A graph kvpass compiles unchanged holds a ``kvpass.SlotCache``: only kvpass's rewritten attention reads its
    slots, so the graph cannot run on it. ``kvpass.compile``'s generate catches this and runs the model's own cache
    instead; a SlotCache passed by hand gets it as the error. ``reason``: why the graph is left unchanged."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"kvpass: this graph cannot run on a kvpass.SlotCache: kvpass leaves it unchanged ({reason}), and a "
            f"SlotCache's slots are read right only by the attention kvpass writes (unchanged, the model reads them "
            f"as a StaticCache, which some families misread: GPT-Neo slices its local mask by the stored length). "
            f"Pass the model's own cache (past_key_values=DynamicCache(config=model.config)); kvpass.compile's "
            f"generate does so by itself"
        )


class KVPassWarning(UserWarning):
    """kvpass left a graph unchanged; the message says which node and which assumption failed."""


_WARNED: set[tuple] = set()


def warn_once(msg: str, owner=None) -> None:
    """Warn with ``msg`` once per ``owner`` (a backend, i.e. a compiled function: a second model with
    the same problem is told too), or once per process without one."""
    key = (owner.runtime.handle if hasattr(owner, "runtime") else owner, msg)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, KVPassWarning, stacklevel=3)
