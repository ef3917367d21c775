"""The torch settings kvpass changes for the whole process, and why.

Set by ``apply()``, which every ``kvpass.backend(...)`` (``Backend.__init__``) calls:

* ``torch._dynamo.config.fail_on_recompile_limit_hit = True`` (left alone when the caller set
  ``suppress_errors``): past Dynamo's recompile limit a frame runs uncompiled, so a decode step after a kvpass
  prefill would run outside the policy on the cache it evicted. transformers models share one wrapper code
  object, so the limit (8) is reached by the fifth model compiled in a process. This makes it an error.
* ``torch._dynamo.config.specialize_float = True``: Dynamo leaves float attributes unspecialized (RMSNorm's
  eps, an embedding's norm_type); AOT's tensorify pass then specializes them and restarts the frame's analysis,
  so every graph is traced and compiled twice (a 32-layer 8B shape: minutes). Specialized floats recompile
  only when a float argument changes between calls, which a decoder's forward does not take.

Both stay process-wide: Dynamo reads them while it traces, inside the compiled function's call and before any
backend runs, so scoping them to kvpass's graphs would take a ``config.patch`` around every call of the compiled
forward, and a raw ``kvpass.backend`` given to ``torch.compile`` has no call of its own to wrap.

Added to by ``mark_cacheable(fn, key)``, per kvpass function, when Inductor is about to compile a graph that
calls it (``Backend._compile``, through ``kvpass.compiler.backend.mark_cacheable``):

* ``torch._inductor.config.unsafe_marked_cacheable_functions[name] = key``: AOTAutograd's cache refuses a graph
  that calls a Python function it does not know (a second process then traces a 32-layer decode graph again:
  30 s); this names kvpass's own tensor functions (``write_slots``, a policy's ``SlotHooks``), keyed by the
  pass key and the function's source. Only kvpass functions are named.

Scoped settings, not process-wide (each is undone when its call returns): ``config.patch(recompile_limit=...)``
around a ``generate`` call (``kvpass.generate.fastpath``) and around ``kvpass.explain``
(``kvpass.compiler.explain``); ``torch.compiler.set_stance("fail_on_recompile")`` around a decode step that
passes the first step's mask again (``kvpass.generate.decode_loop``); the Inductor ``config_patches`` of a
``torch.compile`` mode, given to ``compile_fx`` for one graph (``Backend._mode_patches``).
"""

from __future__ import annotations

import hashlib
import inspect

import torch


def apply() -> None:
    """Set the Dynamo settings above; calling it again changes nothing."""
    if not torch._dynamo.config.suppress_errors:
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.specialize_float = True


def mark_cacheable(fn, key: str) -> None:
    """Name the kvpass function ``fn`` in Inductor's ``unsafe_marked_cacheable_functions``, keyed by ``key`` (the
    pass key) and ``fn``'s source; a function already named keeps its entry. A torch without the setting:
    nothing (AOTAutograd then does not cache the graph)."""
    from torch._inductor import config as inductor_config

    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if marked is None:
        return
    name = f"{fn.__module__}.{fn.__name__}"
    if name not in marked:
        source = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
        marked[name] = f"{key[:16]}-{source}"
