"""``cacheblend``: chunk fusion that recomputes the tokens whose keys deviate most (CacheBlend).

Position recovery as ``pie``; the selection pass (the first two layers on all tokens, see
``kvpass.policies.chunk_fusion.a3``) gives every document token its fresh layer-1 key, and the recompute set is
the top ``ratio * n`` document tokens by the L2 deviation between the fresh key and the stored,
re-rotated one, summed over KV heads. CacheBlend picks by KV deviation; the key alone is what this
baseline is specified with.
"""

from __future__ import annotations

from kvpass.policies.chunk_fusion.base import TopRatio


class CacheBlend(TopRatio):
    name = "cacheblend"
    summary = "chunk fusion: recompute the top r document tokens by layer-1 key deviation"

    def score(self, site, q, k, kv_pos, q_pos, req):
        cached = req.cached_keys
        n = min(cached.shape[2], k.shape[2])
        dev = (k[:, :, :n].float() - cached[:, :, :n].to(k.device).float()).norm(dim=-1)  # [B, H_kv, n]
        out = dev.new_zeros(k.shape[:3])
        out[..., :n] = dev
        return out
