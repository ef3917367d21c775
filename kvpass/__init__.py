"""kvpass: long-context KV-cache policies for HuggingFace decoders, compiled in via torch.compile.

    import torch, kvpass
    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy="full"))
"""

# The supported range (pyproject.toml; CI runs the suite on the newest and a subset on these floors).
TORCH_FLOOR, TRANSFORMERS_FLOOR = "2.11", "5.14.1"


def _check_versions() -> None:
    import torch
    import transformers
    from packaging.version import Version

    for name, have, floor in (("torch", torch.__version__, TORCH_FLOOR),
                              ("transformers", transformers.__version__, TRANSFORMERS_FLOOR)):
        if Version(have.split("+")[0]) < Version(floor):
            raise ImportError(f"kvpass needs {name} >= {floor}, found {have}; install a newer one: "
                              f"pip install '{name}>={floor}'")


_check_versions()

from kvpass.compiler.backend import Backend, GraphReport, KVPass, backend  # noqa: E402
from kvpass.errors import KVPassWarning  # noqa: E402
from kvpass.cache.slots import SlotCache  # noqa: E402
from kvpass.compiler.fastpath import compile  # noqa: E402
from kvpass.fusion.chunkstore import ChunkKV, ChunkStore, ChunkStoreWarning  # noqa: E402
from kvpass.compiler.explain import Explanation, explain  # noqa: E402
from kvpass.fusion.router import ChunkFusion, FusedPrompt  # noqa: E402
from kvpass.policies import ConfigError, Policy, available as available_policies  # noqa: E402
from kvpass.cache.state import GenerationState  # noqa: E402

__version__ = "0.1.0"
__all__ = ["backend", "explain", "Backend", "KVPass", "GraphReport", "Explanation", "KVPassWarning",
           "ConfigError", "Policy", "GenerationState", "available_policies", "ChunkStore", "ChunkKV",
           "ChunkStoreWarning", "ChunkFusion", "FusedPrompt", "SlotCache", "compile"]
