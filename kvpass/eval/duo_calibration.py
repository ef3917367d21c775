"""``kvpass.duo_pattern``: a head pattern for ``duoattention`` measured on the user's own model.

DuoAttention (Xiao et al., 2024) tells retrieval heads from streaming heads by optimising a gate per KV head on
synthetic passkey retrieval. This calibration keeps the task and measures instead of optimising: each sample is a
stretch of random tokens with a passkey (a random run of ``needle`` tokens) at a random depth, and the same passkey
again at the end; while the model reads the copy, a head that retrieves attends to the first occurrence, far outside
any sink or recent window, and a streaming head does not. A KV head's score is the attention its query heads give
the first occurrence from the copy's positions (summed over the passkey, averaged over the copy's positions, the
group's query heads and the samples): in [0, 1], high for retrieval heads. ``duoattention`` makes the
``streaming`` share with the lowest scores streaming heads.

The pattern is written as the DuoAttention repository's ``full_attention_heads.tsv`` (one line per layer, one
score per KV head) and cached per model (its config and a digest of its weights) and settings under
``$KVPASS_CACHE/duo`` (else ``~/.cache/kvpass/duo``); a second call returns the cached file. The model runs with
eager attention for the calibration (its own attention implementation is restored after), one sample at a time;
each layer's attention weights are reduced as they are computed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpass.errors import ConfigError


def duo_pattern(
    model,
    *,
    samples: int = 8,
    length: int = 1024,
    needle: int = 16,
    seed: int = 0,
    out: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Measure ``model``'s per-layer, per-KV-head retrieval scores and write them for ``duoattention``'s
    ``pattern``; returns the file's path (cached: a second call with the same model and settings reads nothing).

    ``samples`` prompts of ``length`` tokens (random tokens, a ``needle``-token passkey at a random depth, the
    passkey again at the end); ``out``: where to write (default: the cache); ``progress``: a line per sample."""
    from kvpass.chunks.chunkstore import model_fingerprint
    from kvpass.eval.model_cache import cache_dir

    for name, value, lo in (("samples", samples, 1), ("length", length, 64), ("needle", needle, 2)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ConfigError(f"kvpass.duo_pattern: parameter '{name}' must be an int >= {lo}, got {value!r}")
    if 4 * needle > length:
        raise ConfigError(
            f"kvpass.duo_pattern: parameter 'needle' ({needle}) must be at most a quarter of 'length' "
            f"({length}): the passkey and its copy sit in random text"
        )
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    path = (
        Path(out)
        if out is not None
        else (cache_dir() / "duo" / f"{model_fingerprint(model)[:16]}-s{samples}-l{length}-n{needle}-r{seed}.tsv")
    )
    if out is None and path.is_file():
        return path
    scores = torch.zeros(layers, kv_heads, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    special = {getattr(cfg, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")}
    low = max([t for t in special if isinstance(t, int)] + [2]) + 1 if cfg.vocab_size > 1000 else 3
    span = {}

    def hook(module, args, output):  # reduce this layer's weights now and hand none on
        weights = output[1]
        first, copy = span["first"], span["copy"]
        got = weights[0, :, copy : copy + needle, first : first + needle].sum(-1).mean(-1)  # [H]
        scores[module.layer_idx] += got.double().cpu().view(kv_heads, heads // kv_heads).mean(-1)
        return (output[0], None) + tuple(output[2:])

    attn = [m for m in model.modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")]
    if len(attn) != layers:
        raise ConfigError(
            f"kvpass.duo_pattern: found {len(attn)} attention modules with a layer index in "
            f"{type(model).__name__}, for {layers} layers: this calibration reads each layer's "
            f"attention weights from modules named *Attention with a layer_idx"
        )
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    handles = [m.register_forward_hook(hook) for m in attn]
    try:
        for i in range(samples):
            body = torch.randint(low, cfg.vocab_size, (length - 2 * needle,), generator=g)
            key = torch.randint(low, cfg.vocab_size, (needle,), generator=g)
            depth = int(torch.randint(length // 8, length // 2, (1,), generator=g))
            ids = torch.cat([body[:depth], key, body[depth:], key])[None].to(device)
            span.update(first=depth, copy=length - needle)
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, output_attentions=True)
            if progress:
                print(f"kvpass.duo_pattern: sample {i + 1}/{samples}", flush=True)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(before)
    scores = (scores / samples).clamp(0, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join("\t".join(f"{x:.6f}" for x in row) + "\n" for row in scores.tolist()))
    tmp.replace(path)
    return path
