"""What kvpass raises and warns: ``ConfigError`` for a bad name or parameter, ``KVPassWarning`` (said once per
backend through ``warn_once``) when a graph is compiled unchanged or a setting cannot take effect."""

from __future__ import annotations

import warnings


class ConfigError(ValueError):
    """A policy name or parameter is invalid. The message names the parameter and its range."""


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
