"""kvpass: long-context KV-cache policies for HuggingFace decoders, compiled in via torch.compile.

    import torch, kvpass
    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy="full"))

The public names are imported on first use (``kvpass.backend`` imports the compiler, and with it torch
and transformers), so the ``kvpass`` command answers ``--help`` without them.
"""

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
            raise ImportError(f"kvpass needs {name} >= {floor}, found {have}; install a newer one: "
                              f"pip install '{name}>={floor}'")


_check_versions()

_PUBLIC = {  # name -> the module that defines it
    "Backend": "kvpass.compiler.backend", "GraphReport": "kvpass.compiler.backend",
    "KVPass": "kvpass.compiler.backend", "backend": "kvpass.compiler.backend",
    "KVPassWarning": "kvpass.errors", "SlotCache": "kvpass.cache.slots", "compile": "kvpass.compiler.fastpath",
    "RequestQueue": "kvpass.compiler.requests",
    "ChunkKV": "kvpass.chunks.chunkstore", "ChunkStore": "kvpass.chunks.chunkstore",
    "ChunkStoreWarning": "kvpass.chunks.chunkstore", "Explanation": "kvpass.compiler.explain",
    "explain": "kvpass.compiler.explain", "ChunkFusion": "kvpass.chunks.router", "FusedPrompt": "kvpass.chunks.router",
    "ConfigError": "kvpass.policies", "Policy": "kvpass.policies", "GenerationState": "kvpass.cache.state",
}


def __getattr__(name: str):
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
__all__ = ["backend", "explain", "Backend", "KVPass", "GraphReport", "Explanation", "KVPassWarning",
           "ConfigError", "Policy", "GenerationState", "available_policies", "ChunkStore", "ChunkKV",
           "ChunkStoreWarning", "ChunkFusion", "FusedPrompt", "SlotCache", "compile", "RequestQueue"]
