"""The model's own rotary embedding, per layer: tables, inverse rotation and re-rotation of keys.

Chunk fusion stores keys *before* RoPE and rotates them to the positions they take in a request.
That needs, for every attention layer, the rotation the model itself applies. Nothing here is
written per model family:

* **Candidates.** Every submodule with an ``inv_freq`` buffer is a rotary module (HF's
  ``*RotaryEmbedding``: it computes ``cos, sin`` for given position ids, with its scaling type,
  ``attention_scaling`` and dynamic frequency updates). A module whose ``forward`` takes a
  ``layer_type`` gives one candidate per entry of ``config.layer_types``. "No rotation" (NoPE
  layers) is a candidate too.
* **Calibration.** One token is run alone at position 0 and at position ``p``. Alone, its keys in
  every layer are context-free, so layer ``i``'s key at ``p`` must equal its key at 0 un-rotated
  with the candidate's tables at 0 and rotated with its tables at ``p``. Each layer takes the
  candidate that reproduces it; a layer that no candidate reproduces (an interleaved-pair RoPE, a
  rotation kvpass does not know) raises ``ConfigError`` instead of ever producing wrong keys.
* **Rotation** is ``x * cos + rotate_half(x) * sin`` on the first ``R`` dims (``R`` = the tables'
  width; partial rotary leaves the rest), through ``kvpass::rope_rotate`` (Triton on CUDA); the
  inverse uses ``kvpass.kernels.rope_rotate.rope_inverse_tables``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpass import ops as _ops  # noqa: F401  (registers torch.ops.kvpass.*)
from kvpass.cache.argument import with_cache
from kvpass.kernels.rope_rotate import rope_inverse_tables
from kvpass.policies.contract import ConfigError

CALIBRATION_POSITION = 37


@dataclass(frozen=True)
class Rotary:
    """One way a layer rotates its keys: a rotary module (and layer type), or none."""

    module: torch.nn.Module | None
    layer_type: str | None = None

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """fp32 ``cos, sin [L, R]`` for ``positions [L]``; None for a layer without RoPE."""
        if self.module is None:
            return None
        ref = self.module.inv_freq
        x = torch.zeros(1, dtype=torch.float32, device=ref.device)
        pos = positions.to(ref.device).long().reshape(1, -1)
        kw = {"layer_type": self.layer_type} if self.layer_type is not None else {}
        with torch.no_grad():
            cos, sin = self.module(x, pos, **kw)
        return cos[0].float(), sin[0].float()

    def describe(self) -> str:
        if self.module is None:
            return "none"
        name = type(self.module).__name__
        return f"{name}[{self.layer_type}]" if self.layer_type else name


def rotate(x: Tensor, tables: tuple[Tensor, Tensor] | None) -> Tensor:
    """``x [..., L, D]`` rotated by ``tables`` (None: unchanged), through ``kvpass::rope_rotate``."""
    if tables is None:
        return x
    cos, sin = (t.to(x.device) for t in tables)
    shape = x.shape
    out = torch.ops.kvpass.rope_rotate(x.reshape(-1, shape[-2], shape[-1]), cos, sin)
    return out.reshape(shape)


def unrotate(x: Tensor, tables: tuple[Tensor, Tensor] | None) -> Tensor:
    """The inverse of ``rotate(x, tables)``: keys as they were before RoPE."""
    if tables is None:
        return x
    return rotate(x, rope_inverse_tables(*tables))


def _candidates(model) -> list[Rotary]:
    found, seen = [], set()
    layer_types = list(dict.fromkeys(getattr(model.config, "layer_types", None) or []))
    for mod in model.modules():
        if id(mod) in seen or not isinstance(getattr(mod, "inv_freq", None), Tensor):
            continue
        seen.add(id(mod))
        try:
            takes_type = "layer_type" in inspect.signature(mod.forward).parameters
        except (TypeError, ValueError):
            takes_type = False
        if takes_type and layer_types:
            found += [Rotary(mod, t) for t in layer_types]
        else:
            found.append(Rotary(mod))
    return found + [Rotary(None)]


def layer_keys(model, ids: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per layer ``(k, v) [B, H_kv, L, D]`` of a plain forward of ``ids`` at ``positions`` on an empty
    cache (what the model stores, keys after RoPE)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


class RotaryMap:
    """The rotation of every layer of ``model`` (see the module docstring). Build once per model."""

    def __init__(self, model, position: int = CALIBRATION_POSITION) -> None:
        dev = next(model.parameters()).device
        token = torch.tensor([[min(5, model.config.vocab_size - 1)]], device=dev)
        at0 = layer_keys(model, token, torch.zeros_like(token))
        atp = layer_keys(model, token, torch.full_like(token, position))
        cands = _candidates(model)
        p0, pp = torch.tensor([0]), torch.tensor([position])
        tables = [(c, c.tables(p0), c.tables(pp)) for c in cands]
        tol = 1e-4 if at0[0][0].dtype == torch.float32 else 3e-2
        self.layers: list[Rotary] = []
        for i, ((k0, _), (kp, _)) in enumerate(zip(at0, atp)):
            k0f, kpf = k0.float(), kp.float()
            scale = kpf.abs().max().clamp_min(1e-6)
            best, err = None, float("inf")
            for cand, t0, tp in tables:
                if t0 is not None and t0[0].shape[-1] > k0.shape[-1]:
                    continue
                e = float((rotate(unrotate(k0f, t0), tp) - kpf).abs().max() / scale)
                if e < err:
                    best, err = cand, e
            if best is None or err > tol:
                raise ConfigError(
                    f"parameter 'model': kvpass cannot reproduce the key rotation of layer {i} with any rotary "
                    f"module of this model (best relative error {err:.2e}); chunk fusion needs HF's rotate_half "
                    f"RoPE (or none) to re-rotate stored keys"
                )
            self.layers.append(best)

    def tables(self, layer: int, positions: Tensor):
        return self.layers[layer].tables(positions)

    def groups(self) -> dict[Rotary, list[int]]:
        """Layers sharing one rotation (so a table is computed once per group)."""
        out: dict[Rotary, list[int]] = {}
        for i, r in enumerate(self.layers):
            out.setdefault(r, []).append(i)
        return out

    def __repr__(self) -> str:
        kinds = sorted({r.describe() for r in self.layers})
        return f"RotaryMap(layers={len(self.layers)}, rotations={kinds})"
