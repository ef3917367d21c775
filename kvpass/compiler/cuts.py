"""Cuts between decode steps on a ``kvpass.SlotCache``: a policy that shrinks its layers every so many decode
steps (``SlotHooks.cut``: expected_attention's ``decode_interval``) does so outside the compiled decode graph.

Inside the graph a cut would run at every step (a CUDA graph replays all of its work) to act at one step in
hundreds. So the graph's call is wrapped (``cutting``): before a decode step, where a row of the cache may be
due, the policy's ``cut`` runs on the layers' slots and state, in place (their addresses stay, as the graph's
replay needs), and decides per row on the device which rows are due. Whether any may be is the host's question,
answered without waiting for the device: after each step the largest fill of the first cut layer is copied to
pinned memory without blocking, and the copy made two steps earlier is read: a step adds one entry to a row and
a cut only removes, so that copy plus one bounds the fill now. The host thus stays one step ahead, as kvpass's
decoding loop keeps it; the layers hold 2 slots past the cut's size for a cache whose first steps have no copy
yet.

``points`` finds, before the rewrite, where each site's slots and state enter the graph.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from kvpass.cache.slots import FILLED
from kvpass.compiler.detect import SLOT_APPEND_ARGS
from kvpass.compiler.fxargs import leading


@dataclass(frozen=True)
class CutPoint:
    """One layer's cut: the policy's ``cut`` and the graph inputs of its ``(keys, values, pos, count)`` and state."""

    cut: Callable
    due: int
    slots: tuple[int, int, int, int]
    state: tuple[int, ...]


def points(gm: fx.GraphModule, sites, plans) -> list[CutPoint] | str:
    """The cut of every SlotCache site whose plan has one, or why they cannot run (a tensor that is not a graph
    input); an empty list where no site cuts."""
    inputs = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    found = []
    for site in sites:
        hooks = plans[site.layer].slot_hooks
        if site.cache != "slot" or hooks is None or hooks.cut is None:
            continue
        keys, values, pos, count, _, _, state = leading(site.slot, SLOT_APPEND_ARGS)
        nodes = [keys, values, pos, count, *state]
        if any(n not in inputs for n in nodes):
            return f"layer {site.layer}: its slots are not inputs of the decode graph, so no cut can run between steps"
        at = [inputs[n] for n in nodes]
        found.append(CutPoint(hooks.cut, hooks.due, tuple(at[:4]), tuple(at[4:])))
    return found


class Schedule:
    """Whether a cut may be due before a step, from the fills copied after earlier steps (the module docstring).
    The copy of two steps back, plus one, bounds the fill from above (a step adds one entry to a row, a cut only
    removes), so a step it finds below the cut's size needs none; a row the cut just passed by (it became due a
    step after another) is caught at the next step, where the copy from before that cut still says "may be"."""

    def __init__(self, due: int) -> None:
        self.due = due
        self.count: torch.Tensor | None = None
        self.notes: deque = deque(maxlen=2)  # (host copy, event) after each of the last two steps

    def may_be_due(self, count: torch.Tensor) -> bool:
        if count is not self.count:  # another cache: nothing known of it yet (its first steps cannot be due)
            self.count = count
            self.notes.clear()
        if len(self.notes) < 2:
            return False
        host, event = self.notes[0]
        if event is not None:
            event.synchronize()  # the step before last: done, or nearly, by the time the next is queued
        return int(host) + 1 >= self.due

    def note(self, count: torch.Tensor) -> None:
        """After a step: its largest fill, copied without blocking."""
        fill = count[:, FILLED].amax()
        if fill.is_cuda:
            host = torch.empty((), dtype=fill.dtype, pin_memory=True)
            host.copy_(fill, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = fill, None
        self.notes.append((host, event))


def cutting(fn, cuts: list[CutPoint]):
    """``fn`` (a compiled decode graph) with the layers' cuts run before each step where one may be due."""
    schedule = Schedule(min(c.due for c in cuts))
    first = cuts[0].slots[3]

    def call(*args):
        count = args[first]
        if schedule.may_be_due(count):
            with torch.no_grad():
                for c in cuts:
                    c.cut(*(args[i] for i in c.slots), [args[i] for i in c.state])
        out = fn(*args)
        schedule.note(count)
        return out

    call.__dict__.update(getattr(fn, "__dict__", {}))
    return call
