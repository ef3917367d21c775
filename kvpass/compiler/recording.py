"""Calls of compiled graphs noted while a decode step is watched: the backend wraps every graph it compiles
(``recorded``); the generation runtime's direct steps (``kvpass.generate.direct_steps``) set ``recording.calls``
to a list around one step and read back which graphs it ran, with their inputs and outputs."""

from __future__ import annotations

import threading


class _Recording(threading.local):
    calls: list | None = None  # the compiled graphs called while a step is watched on this thread, else None


recording = _Recording()


def recorded(fn, phase: str):
    """``fn`` (a compiled graph as the backend hands it to Dynamo), noting each call while a step is watched."""

    def call(*args):
        out = fn(*args)
        if recording.calls is not None:
            recording.calls.append((call, args, out))
        return out

    call.phase = phase
    call.__dict__.update({k: v for k, v in getattr(fn, "__dict__", {}).items() if k not in call.__dict__})
    return call
