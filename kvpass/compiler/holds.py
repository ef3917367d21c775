"""Which DynamicCache a compiled graph's call runs on, so that the runtime's state follows it.

On a DynamicCache the policy's records (true positions, tokens seen, bookkeeping) live in the backend's runtime,
not in the cache. To tell caches apart, a graph's call is matched to its cache by a tensor object: the first
kvpass layer's stored keys, which the graph returns (Dynamo stores that very output into the cache) and the next
call on the same cache passes back in. ``holds`` finds that input and output in a graph before the rewrite;
``following`` wraps the compiled graph so the runtime switches to that cache's records before the call
(``Runtime.follow``) and notes what the cache holds after it (``Runtime.held_by``). A prefill graph has no such
input (its cache starts empty): its call starts a new record.
"""

from __future__ import annotations

from torch import fx


def holds(gm: fx.GraphModule, sites) -> tuple[int | None, int] | None:
    """``(input, output)``: the positions, among the graph's inputs and its flat outputs, of the keys the first
    DynamicCache site's layer stores (input None in a prefill graph, whose cache starts empty); None when no site
    of the graph stores its keys as the attention reads them (a sliding layer that trims them, another cache)."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    for site in sites:
        if site.cache != "dynamic" or site.k not in outputs:
            continue
        if site.k_past is not None and site.k_past.op == "placeholder":
            return inputs.index(site.k_past), outputs.index(site.k)
        return (None, outputs.index(site.k)) if site.phase == "prefill" else None
    return None


def following(fn, runtime, io: tuple[int | None, int]):
    """``fn`` (a compiled graph) run on the state of the cache its call holds (``holds``'s positions)."""
    given, returned = io

    def call(*args):
        runtime.follow(None if given is None else args[given])
        out = fn(*args)
        runtime.held_by(out[returned])
        return out

    call.__dict__.update(getattr(fn, "__dict__", {}))
    return call
