"""kvpass: long-context KV-cache policies for HuggingFace decoders, compiled in via torch.compile.

    import torch, kvpass
    model.forward = torch.compile(model.forward, backend=kvpass.backend(policy="full"))
"""

from kvpass.backend import Backend, GraphReport, KVPass, KVPassWarning, backend
from kvpass.cache import SlotCache
from kvpass.chunkstore import ChunkKV, ChunkStore, ChunkStoreWarning
from kvpass.explain import Explanation, explain
from kvpass.fusion import ChunkFusion, FusedPrompt
from kvpass.policies import ConfigError, Policy, available as available_policies
from kvpass.state import GenerationState

__version__ = "0.1.0"
__all__ = ["backend", "explain", "Backend", "KVPass", "GraphReport", "Explanation", "KVPassWarning",
           "ConfigError", "Policy", "GenerationState", "available_policies", "ChunkStore", "ChunkKV",
           "ChunkStoreWarning", "ChunkFusion", "FusedPrompt", "SlotCache"]
