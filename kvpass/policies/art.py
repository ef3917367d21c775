"""``art``: Attention Run-time Termination for decode steps (seed paper: ART).

Decode attention reads the cache block by block (block 0, then the most recent block and
backwards) with a streaming softmax, and stops once the normalised output has stopped moving:
``patience`` consecutive blocks whose relative change ``d_scale`` is below ``tau`` and whose
direction change ``1 - cos`` is below ``phi``, for every query head of a KV group. The kernel,
its reference and the choices behind them are in ``kvpass.kernels.decode_attention``.

Prefill is untouched (the model's own attention). Nothing is evicted: composed with an eviction
policy (``snapkv+art``, ``streamingllm+art``) the evictor decides what the cache keeps and ART
decides how much of it a decode step reads. ``tau = 0`` or ``phi = 0`` reads everything: exact
attention, the no-op setting that must equal ``full``.

``horizon = 16`` by default: the stop rule may fire within the first 16 blocks (the sinks and the
1,920 most recent entries at block 128); a read that has not stopped by then reads the rest split-KV,
in parallel. With ``horizon = 0`` (the paper's rule, stop anywhere) one program per sequence and KV
head reads the whole cache serially: at batch 1 that is 8 programs on a 132-SM GPU, and ``art`` decoded
2.8x slower than ``full`` at 32k (H100, 2026-11-25); measured end to end on SmolLM2 (docs/policies/art.md),
``horizon=16`` decoded at 1.09x ``full``'s speed against 1.02x without it, at the same accuracy.

Decode sites that the kernel cannot serve (a per-head mask, a top-left causal mask on one query,
different q and v head sizes) keep exact attention through ``kvpass::attention``.
"""

from __future__ import annotations

from kvpass.policies.contract import ConfigError, DecodeRead, Needs, Policy, SitePlan, param


class ART(Policy):
    name = "art"
    summary = "early-terminating decode attention (stop when the output stops moving)"
    # the prefill is exact attention and an append: an uncompiled one writes the same
    needs = Needs(slot_rule="append", plain_prefill=True)
    tau: float = param(1e-5, 0.0, 1.0, "relative output change below which a block is stable")
    phi: float = param(1e-3, 0.0, 1.0, "direction change (1 - cos) below which a block is stable")
    patience: int = param(5, 1, 1 << 20, "consecutive stable blocks before the rest is skipped")
    block: int = param(128, 16, 1024, "KV entries per block (a power of two)")
    order: str = param("recency", doc="block order: 'recency' (0, n-1, ..., 1) or 'natural'")
    probe: int = param(0, 0, 1 << 16, "probe elements of head_dim (0: all)")
    horizon: int = param(
        16,
        0,
        1 << 20,
        "blocks within which the read may stop (0: anywhere); a read "
        "that has not stopped by then reads the rest in parallel (split-KV)",
    )
    stats: bool = param(False, doc="count blocks read (Backend.runtime.blocks_read())")

    def check_config(self) -> None:
        if self.block & (self.block - 1):
            raise ConfigError(f"policy 'art': parameter 'block' must be a power of two in [16, 1024], got {self.block}")
        if self.order not in ("recency", "natural"):
            raise ConfigError(f"policy 'art': parameter 'order' must be 'recency' or 'natural', got {self.order!r}")

    def plan(self, site) -> SitePlan:
        from kvpass.kernels.decode_attention import ORDERS
        from kvpass.policies.contract import decode_read_problem

        if site.phase != "decode":
            # exact attention through the kvpass op, as `full`: a proven-causal mask becomes the causal mode
            # (left to Inductor, SDPA read a materialised mask: 49 GiB and 7x full's TTFT at 128k)
            return SitePlan(attention=True)
        if decode_read_problem(site) is not None:
            return SitePlan(attention=True)  # exact attention; `kvpass explain` shows the plan
        return SitePlan(
            attention=True,
            read=DecodeRead(
                tau=self.tau,
                phi=self.phi,
                patience=self.patience,
                block=self.block,
                order=ORDERS[self.order],
                probe=self.probe,
                horizon=self.horizon,
                stats=self.stats,
            ),
        )
