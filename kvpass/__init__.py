"""kvpass: long-context KV-cache policies for HuggingFace decoders, compiled in via torch.compile.

    import torch, kvpass
    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy="full"))

The public names are imported on first use (``kvpass.backend`` imports the compiler, and with it torch
and transformers), so the ``kvpass`` command answers ``--help`` without them.
"""

import copy
import functools
import importlib

# The supported range (pyproject.toml; CI runs the suite on the newest and a subset on these floors).
TORCH_FLOOR, TRANSFORMERS_FLOOR = "2.11", "5.14.1"


def _check_versions() -> None:
    """The installed torch and transformers against the floors, read from their metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for name, floor in (("torch", TORCH_FLOOR), ("transformers", TRANSFORMERS_FLOOR)):
        try:
            have = version(name)
        except PackageNotFoundError:
            raise ImportError(f"kvpass needs {name} >= {floor}; install it: pip install '{name}>={floor}'") from None
        if Version(have.split("+")[0]) < Version(floor):
            raise ImportError(
                f"kvpass needs {name} >= {floor}, found {have}; install a newer one: pip install '{name}>={floor}'"
            )


_check_versions()

_PUBLIC = {  # name -> the module that defines it
    "Backend": "kvpass.compiler.backend",
    "GraphReport": "kvpass.compiler.backend",
    "KVPass": "kvpass.compiler.backend",
    "backend": "kvpass.compiler.backend",
    "KVPassWarning": "kvpass.errors",
    "SlotCache": "kvpass.cache.slots",
    "RequestQueue": "kvpass.generate.requests",
    "RequestFailed": "kvpass.generate.requests",
    "StoredChunk": "kvpass.chunks.chunkstore",
    "ChunkStore": "kvpass.chunks.chunkstore",
    "ChunkStoreWarning": "kvpass.chunks.chunkstore",
    "Explanation": "kvpass.compiler.explain",
    "explain": "kvpass.compiler.explain",
    "ChunkFusion": "kvpass.chunks.router",
    "FusedPrompt": "kvpass.chunks.router",
    "ConfigError": "kvpass.policies",
    "Policy": "kvpass.policies",
    "GenerationState": "kvpass.cache.state",
    "duo_pattern": "kvpass.eval.duo_calibration",
    "repeat_passes": "kvpass.generate.reconstruct",
}

_DEPRECATED = {  # name -> the public name that replaces it; each access warns, for one release
    "ChunkKV": "StoredChunk",  # kvpass.ChunkKV reads as the ChunkKV eviction policy; it is a stored chunk's K/V
}


def compile(model, policy="full", **options):
    """Compile ``model`` with the KV-cache ``policy`` and give its ``generate`` the fast path; returns the
    ``kvpass.Backend``. The options (``mode``, ``compiler``, ``prefill_compiler``, ``fullgraph``, ``direct_steps``,
    the policy's parameters) and what ``generate`` then does: ``kvpass.generate.fastpath.compile``.

    An encoder-decoder (``config.is_encoder_decoder``) is refused: kvpass compiles decoder-only models.
    ``copy.deepcopy`` of the compiled model gives the model uncompiled (its class's ``forward`` and ``generate``)
    with its own copy of the weights; ``kvpass.compile`` the copy for a policy of its own.
    """
    from kvpass.errors import ConfigError
    from kvpass.generate.fastpath import compile as compile_fast_path

    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ConfigError(
            f"kvpass.compile: parameter 'model' is an encoder-decoder ({type(model).__name__}, "
            f"config.is_encoder_decoder=True): kvpass compiles decoder-only models, whose one "
            f"self-attention cache its policies manage (a decoder's cross-attention reads the "
            f"encoder's output, another cache); run this model uncompiled, or torch.compile it "
            f"without kvpass"
        )
    be = compile_fast_path(model, policy, **options)
    model.__deepcopy__ = functools.partial(_uncompiled_copy, model)
    return be


_COMPILED = ("forward", "generate", "__deepcopy__")  # what kvpass.compile sets on the model object


def _uncompiled_copy(model, memo: dict):
    """``copy.deepcopy`` of a model ``kvpass.compile`` compiled: everything copied but what the compile set on the
    model object. The compiled forward is bound to the original model and the fast path's caches and lock are
    the original's: kept, the copy would run the original's weights."""
    twin = type(model).__new__(type(model))
    memo[id(model)] = twin
    state = {k: v for k, v in model.__getstate__().items() if k not in _COMPILED}
    twin.__setstate__(copy.deepcopy(state, memo))
    return twin


def __getattr__(name: str):
    if name in _DEPRECATED:  # not cached in globals(), so that every access warns
        import warnings

        new = _DEPRECATED[name]
        warnings.warn(
            f"kvpass.{name} is deprecated and is removed in the next release: use kvpass.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__(new)
    if name == "available_policies":
        value = importlib.import_module("kvpass.policies").available
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    else:
        raise AttributeError(f"module 'kvpass' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"
__all__ = [
    "backend",
    "explain",
    "Backend",
    "KVPass",
    "GraphReport",
    "Explanation",
    "KVPassWarning",
    "ConfigError",
    "Policy",
    "GenerationState",
    "available_policies",
    "ChunkStore",
    "StoredChunk",
    "ChunkStoreWarning",
    "ChunkFusion",
    "FusedPrompt",
    "SlotCache",
    "compile",
    "RequestQueue",
    "RequestFailed",
    "repeat_passes",
    "duo_pattern",
]
