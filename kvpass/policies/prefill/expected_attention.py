"""``expected_attention``: keep the entries that future queries are expected to attend to (Devoto et al., 2025).

"Expected Attention: KV cache compression by estimating attention from future queries' distribution" models
the queries still to come as a Gaussian: per layer and query head, the mean ``mu`` and covariance ``Sigma`` of
the prompt's queries before RoPE, leaving out the first ``n_sink`` tokens (attention sinks, outliers). RoPE
turns a query at future position ``t`` by ``R(t)``; averaged over the next ``n_future_positions`` positions
after the prompt, ``R_bar = mean_t R(t)``, the rotated statistics are ``mu' = R_bar mu`` and
``Sigma' = R_bar Sigma R_bar^T``. Each key after the sinks, as the cache stores it (after RoPE), gets the
expected logit of a future query, ``s mu'.k + s^2 k^T Sigma' k / 2`` (the log of the Gaussian's
``E[exp(s q.k)]``; the second term only with ``use_covariance``), with ``s`` the attention's softmax scale; a
softmax over those keys per query head, averaged over the query heads of each KV group, times
``(score + epsilon) * ||v||`` with ``use_vnorm``, gives each entry's priority. The sinks are always kept, then
the highest priorities: ``budget`` entries per layer and KV head, in their original order (ties to the earlier
entry, left padding last). A prompt no longer than ``budget`` is kept whole, which equals ``full``. Decode steps
append (``kvpass.policies.prefill.base``), unless ``decode_interval`` is set: then a layer that reaches ``budget +
decode_interval`` entries is cut back to ``budget`` by the same scores, its statistics from the last
``decode_queries`` decode queries (a ring per layer, ``observe``) and the rotation after the latest token
(``cut_keep``, one decision for both caches: inside ``select`` on a DynamicCache, whose stored length is then
``min(n, budget + (n - budget) mod decode_interval)``; between decode steps on a SlotCache, ``slot_cut`` run by
``kvpass.compiler.cuts``, the ring kept in the decode graph by ``SlotHooks.observe``).

Parameters: ``budget`` (2048, 2..2^24; entries kept per layer and KV head, sinks and window included; above
``n_sink + window``), ``n_sink`` (4, 0..65536), ``n_future_positions`` (512, 1..2^20), ``use_covariance`` (True),
``use_vnorm`` (True), ``epsilon`` (0.0, >= 0), ``window`` (0, 0..65536: last prompt tokens also always kept;
0 keeps none by position, as kvpress), ``decode_interval`` (0, or 16..2^20: decode tokens between cuts; 0: none),
``decode_queries`` (256, 2..65536: the ring's length).

**RoPE, read off the graph.** The pass finds transformers' rotate-half RoPE on each site's query,
``q = pre * cos + rotate_half(pre) * sin`` on its first ``r`` dims (partial rotary passes the others through),
and hands ``select`` the query before it (``q_pre``, scaled like ``q``) and the ``cos`` / ``sin`` tables, above
their casts to the activations' dtype (fp32 in transformers; ``kvpass.compiler.detect.query_rope``). Per row and
table column, ``z_i = cos_i + i sin_i`` of consecutive real tokens differ by the column's frequency ``f``; every
RoPE frequency is below pi, so the wrapped step ``angle(z_{i+1} conj(z_i))`` is ``f`` itself, and the steps
telescope: their mean over the row's real tokens is ``f`` to float precision whatever the positions' size.
``|z|`` is the attention factor (YaRN's, LongRoPE's), and the last real token's ``z`` is where the next positions
start: ``R(t)`` of the ``s``-th next position is ``diag(a cos(phi + s f)) + diag(a sin(phi + s f)) P`` (``P``:
rotate_half's matrix), identity on pass-through dims, and its mean over ``s = 1..n_future_positions`` is a
Dirichlet kernel (closed form, float64). So every rotate-half variant transformers builds (default, linear,
dynamic at the prompt's length, YaRN, llama3, LongRoPE) is handled without a model-name branch, in whatever
positions the model gave the prompt (only offsets matter: a left-padded row scores what it scores alone). A
query with no rotation (absolute-position models: GPT-2, OPT; NoPE layers such as Cohere2's global ones) has
``R_bar = I``; a query transformed in a way the pass does not recognise (GPT-J's interleaved rotation) is
refused, and the graph is compiled unchanged with a warning.

**Left padding.** Statistics over the real queries after each row's first ``n_sink`` real tokens, softmax over its
real keys after them; padding is never kept over a real token.

**Against kvpress 0.5.5's ``ExpectedAttentionPress``.** The same statistics, rotation, logits, softmax, group
mean and value norms, sinks always kept and the top entries per KV head, with these differences: the logit's
scale is the model's attention scale, where kvpress divides by ``sqrt(head_dim)`` (the same wherever the model's
scale is ``head_dim**-0.5``: Llama, Mistral, Qwen, Phi-3; not Gemma's ``query_pre_attn_scalar`` or Granite's
``attention_multiplier``); the queries are the model's own before RoPE (the projection's bias, as Qwen2's, and
q/k norms included: kvpress rebuilds them from ``q_proj``'s weight without its bias and refuses Qwen3 and Gemma-3);
partial rotary rotates only its dims; the future rotation starts after each row's last real token, with the
frequencies the prompt was rotated with (kvpress asks the rotary module at the future positions, which under
dynamic scaling may move them); kvpass counts kept entries (``budget``) where kvpress drops a
``compression_ratio`` of each prompt; padding is handled. Computation: statistics, logits and scores in fp32,
the rotation in float64.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from kvpass.cache.slots import FILLED, state_tensors
from kvpass.policies.contract import ConfigError, Refusal, SitePlan, SlotHooks, param
from kvpass.policies.prefill import scoring
from kvpass.policies.prefill.base import PrefillEviction

CHUNK = 4096  # tokens per step of the statistics and the logits (bounds their fp32 temporaries)


def _row_sums(weights: Tensor, values: Tensor) -> Tensor:
    """``[B, r]``: per row, ``weights [B, n]`` times ``values [B or 1, n, r]`` summed over ``n`` (a table shared
    by the batch is not copied per row)."""
    if values.shape[0] == 1:
        return weights @ values[0]
    return torch.einsum("bn,bnr->br", weights, values)


def rope_frequencies(cos: Tensor, sin: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """From RoPE tables ``[B or 1, (1,) L, r]`` and the real tokens ``real [B, L]``: per row and column, the
    frequency (radians per position; the mean wrapped angle step between consecutive real tokens) and the last real
    token's ``cos + i sin`` (its angle, and its magnitude: the attention factor), float64 ``[B, r]`` each."""
    b, n = real.shape
    c, s = (t.reshape(-1, n, t.shape[-1]).double() for t in (cos, sin))
    steps = torch.atan2(s[:, 1:] * c[:, :-1] - c[:, 1:] * s[:, :-1], c[:, 1:] * c[:, :-1] + s[:, 1:] * s[:, :-1])
    pairs = (real[:, 1:] & real[:, :-1]).double()
    freq = _row_sums(pairs, steps) / pairs.sum(-1, keepdim=True).clamp_min(1.0)
    last = torch.where(real, torch.arange(n, device=real.device), 0).amax(-1)  # left padding: L - 1
    pick = torch.zeros_like(real, dtype=torch.float64).scatter_(1, last[:, None], 1.0)
    return freq, torch.complex(_row_sums(pick, c), _row_sums(pick, s))


def mean_rotation(cos: Tensor, sin: Tensor, real: Tensor, future: int, dim: int) -> Tensor:
    """``R_bar [B, dim, dim]`` float64: RoPE's rotation averaged over the ``future`` positions after each row's last
    real token, identity past the tables' ``r`` columns (partial rotary)."""
    return rotation(*rope_frequencies(cos, sin, real), future, dim)


def rotation(freq: Tensor, last: Tensor, future: int, dim: int) -> Tensor:
    """``R_bar [B, dim, dim]`` float64: RoPE's rotation at frequencies ``freq [B, r]`` averaged over the ``future``
    positions after a token rotated by ``last [B, r]`` (complex: ``cos + i sin``), identity past ``r``."""
    half = freq / 2
    # mean over s = 1..F of exp(i s f) = exp(i (F + 1) f / 2) sin(F f / 2) / (F sin(f / 2)), 1 at f = 0
    kernel = torch.where(half == 0, 1.0, torch.sin(future * half) / (future * torch.sin(half)))
    turn = (future + 1) * half
    mean = last * torch.complex(kernel * torch.cos(turn), kernel * torch.sin(turn))  # [B, r]
    r, b = freq.shape[-1], freq.shape[0]
    rot = torch.zeros(r, r, dtype=torch.float64, device=freq.device)  # rotate_half(x) = rot @ x
    h = torch.arange(r // 2, device=freq.device)
    rot[h, h + r // 2], rot[h + r // 2, h] = -1.0, 1.0
    out = torch.eye(dim, dtype=torch.float64, device=freq.device).repeat(b, 1, 1)
    out[:, :r, :r] = torch.diag_embed(mean.real) + mean.imag[:, :, None] * rot
    return out


def query_moments(x: Tensor, rows: Tensor, covariance: bool) -> tuple[Tensor, Tensor | None]:
    """Mean ``[B, H, D]`` and population covariance ``[B, H, D, D]`` (None without ``covariance``), fp32, of the
    queries ``x [B, H, L, D]`` at the tokens ``rows [B, L]``."""
    w = rows.float()
    count = w.sum(-1).clamp_min(1.0)[:, None, None]
    spans = range(0, x.shape[2], CHUNK)
    mu = sum((x[:, :, i : i + CHUNK].float() * w[:, None, i : i + CHUNK, None]).sum(2) for i in spans) / count
    if not covariance:
        return mu, None
    cov = 0
    for i in spans:
        xc = (x[:, :, i : i + CHUNK].float() - mu[:, :, None]) * w[:, None, i : i + CHUNK, None]
        cov = cov + xc.transpose(-1, -2) @ xc
    return mu, cov / count[..., None]


def expected_logits(mu: Tensor, cov: Tensor | None, k: Tensor) -> Tensor:
    """``[B, H, N]`` fp32: ``mu . k + k^T cov k / 2`` of each query head's statistics (scaled like ``q``) with the
    keys ``k [B, H_kv, N, D]`` of its KV head."""
    b, h, d = mu.shape
    hkv = k.shape[1]
    mu = mu.view(b, hkv, h // hkv, d)
    cov = None if cov is None else cov.view(b, hkv, h // hkv, d, d)
    parts = []
    for i in range(0, k.shape[2], CHUNK):
        kc = k[:, :, i : i + CHUNK].float()
        logit = torch.einsum("bkgd,bknd->bkgn", mu, kc)
        if cov is not None:
            logit = logit + 0.5 * (torch.einsum("bknd,bkgde->bkgne", kc, cov) * kc[:, :, None]).sum(-1)
        parts.append(logit)
    return torch.cat(parts, -1).view(b, h, -1)


# decode-time statistics (``decode_interval``), one layer's state on either cache, per row and KV head: the ring of
# the last ``decode_queries`` queries before RoPE; RoPE's latest cos and sin and the sum of its angle steps; counts
SEEN, SINCE_CUT = 0, 1  # the columns of ``counts``: decode queries seen, queries since the last cut
SLACK = 2  # SlotCache slots past the cut's size: kvpass.compiler.cuts learns a step's fill two steps late


def decode_state(groups: int, queries: int, head_dim: int) -> dict:
    """The decode-time state of a layer (``Policy.slot_state``'s form): the query ring ``[G, W, D]`` in the
    activations' dtype, RoPE's ``[3, D]`` (cos, sin, summed angle steps) in float64 and the ``counts``."""
    return {
        "queries": ((groups, queries, head_dim), None, 0.0),
        "rope": ((3, head_dim), torch.float64, 0.0),
        "counts": ((2,), torch.int64, 0),
    }


def observe(q_pre: Tensor, cos: Tensor | None, sin: Tensor | None, state: list) -> None:
    """Fold a call's ``L`` queries ``q_pre [B, H, L, D]`` (before RoPE, scaled like ``q``) and their RoPE tables
    (``[B or 1, (1,) L, r]``, or None: no rotation) into a layer's decode state, in place. The ring keeps the last
    ``W`` queries (the slot of the ``i``-th since the last cut is ``i mod W``); each new token adds the wrapped angle
    step from the token before it (none before the first)."""
    queries, rope, counts = state
    b, hkv, g, w, d = queries.shape
    n = q_pre.shape[2]
    new = q_pre[:, :, -w:].reshape(b, hkv, g, -1, d)
    m = new.shape[3]
    slot = (counts[:, :, SINCE_CUT, None] + (n - m) + torch.arange(m, device=q_pre.device)) % w  # [B, H_kv, m]
    queries.scatter_(3, slot[:, :, None, :, None].expand(b, hkv, g, m, d), new.to(queries.dtype))
    if cos is not None:
        r = cos.shape[-1]
        c, s = (t.reshape(-1, n, r).double().expand(b, n, r) for t in (cos, sin))
        c = torch.cat([rope[:, 0, 0, None, :r], c], 1)  # the latest token before the call first
        s = torch.cat([rope[:, 0, 1, None, :r], s], 1)
        steps = torch.atan2(s[:, 1:] * c[:, :-1] - c[:, 1:] * s[:, :-1], c[:, 1:] * c[:, :-1] + s[:, 1:] * s[:, :-1])
        steps[:, 0] *= (counts[:, 0, SEEN] > 0)[:, None]
        rope[:, :, 2, :r] += steps.sum(1)[:, None]
        rope[:, :, 0, :r] = c[:, None, -1]
        rope[:, :, 1, :r] = s[:, None, -1]
    counts += n


def reset(keys: Tensor, pos: Tensor, count: Tensor, state: list) -> None:
    """After a SlotCache prefill (``SlotHooks.refresh``): no decode query seen yet."""
    state[1].zero_()
    state[2].zero_()


class ExpectedAttention(PrefillEviction):
    name = "expected_attention"
    summary = "the attention future queries are expected to give (prompt query statistics, averaged RoPE)"
    window: int = param(0, 0, 1 << 16, "last prompt tokens always kept (0: none, as kvpress's ExpectedAttentionPress)")
    n_sink: int = param(4, 0, 1 << 16, "first prompt tokens always kept and left out of the statistics and scores")
    n_future_positions: int = param(512, 1, 1 << 20, "future positions RoPE's rotation is averaged over")
    use_covariance: bool = param(True, doc="add the queries' covariance term to the expected logits")
    use_vnorm: bool = param(True, doc="weigh each entry's expected attention by its value's L2 norm")
    epsilon: float = param(0.0, 0.0, None, "added to the expected attention before the value norm weighs it")
    decode_interval: int = param(
        0,
        0,
        1 << 20,
        "0: decode steps only append; else 16 or more decode tokens between cuts back to the budget (kvpress: 512)",
    )
    decode_queries: int = param(256, 2, 1 << 16, "latest decode queries a cut's statistics are taken from")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decode_interval:  # it evicts after its prefill: a DynamicCache's decode graphs run the selection
            self.needs = dataclasses.replace(type(self).needs, decode_appends=False)

    def check_config(self) -> None:
        if self.budget <= self.window + self.n_sink:
            raise ConfigError(
                f"policy '{self.name}': parameter 'budget' must be > n_sink + window "
                f"({self.n_sink} + {self.window}), got {self.budget}; the budget counts the sinks and "
                f"the window, so pass a larger budget or fewer sinks"
            )
        if 0 < self.decode_interval < 16:
            raise ConfigError(
                f"policy '{self.name}': parameter 'decode_interval' must be 0 (no decode cuts) or in [16, "
                f"{1 << 20}], got {self.decode_interval}; a cut scores every stored entry, so cut less often"
            )

    def plan(self, site) -> SitePlan | Refusal:
        plan = super().plan(site)
        if not isinstance(plan, SitePlan) or not plan.evict:
            return plan
        if self.decode_interval and site.phase not in ("prefill", "decode"):
            return Refusal(
                f"layer {site.layer}: expected_attention with decode_interval cuts after one-token decode "
                f"steps; this '{site.phase}' graph adds several tokens to a filled cache"
            )
        if site.phase not in ("prefill", "dynamic") and not self.decode_interval:
            return plan  # decode steps append
        if site.q_rope.problem:
            return Refusal(f"layer {site.layer}: its scores need the queries before RoPE, and {site.q_rope.problem}")
        return dataclasses.replace(plan, rope=True)

    def stored_length(self, site, total):
        if site.phase == "prefill" or not self.decode_interval:
            return super().stored_length(site, total)
        # back to the budget each time the layer reaches budget + decode_interval entries
        return torch.sym_min(total, self.budget + (total - self.budget) % self.decode_interval)

    def ranking(self, site, q, k, v, kv_pos, q_pos, keep, q_pre=None, cos=None, sin=None):
        self._check_rotated(site, cos)
        valid, forced = scoring.window_layout(kv_pos, self.window)
        real = valid[:, 0]  # [B, N]: a prefill's keys are its queries' tokens
        sinks, rest = self._sinks(real)
        mu, cov = query_moments(q if q_pre is None else q_pre, rest, self.use_covariance)
        rot = None if cos is None else mean_rotation(cos, sin, real, self.n_future_positions, mu.shape[-1])
        return self._expected(mu, cov, rot, k, v, rest), forced | sinks[:, None], valid

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state, **inputs):
        n, new = kv_pos.shape[-1], q_pos.shape[1]
        if not self.decode_interval or n == new:
            return super().select(site, q, k, v, kv_pos, q_pos, layer_state, **inputs)
        cos, sin, q_pre = inputs.get("cos"), inputs.get("sin"), inputs.get("q_pre")
        self._check_rotated(site, cos)
        book = layer_state.extra if layer_state is not None else {}
        if "queries" not in book:  # the first decode step after the prefill: the state a SlotCache layer holds
            spec = decode_state(q.shape[1] // k.shape[1], self.decode_queries, q.shape[-1])
            book = dict(zip(spec, state_tensors(spec, *k.shape[:2], q.dtype, q.device)))
        state = [book["queries"], book["rope"], book["counts"]]
        observe(q if q_pre is None else q_pre, cos, sin, state)
        keep = int(self.stored_length(site, n))
        if keep >= n:
            return None, book
        idx = self.cut_keep(k, v, kv_pos, state, keep, 0 if cos is None else cos.shape[-1])
        book["counts"][..., SINCE_CUT] = 0
        return idx, book

    def cut_keep(self, k: Tensor, v: Tensor, pos: Tensor, state: list, keep: int, rotary: int) -> Tensor:
        """A decode-time cut, on either cache: the ``keep`` entries ``[B, H_kv, keep]`` (ascending) of the stored
        ``k`` / ``v`` / ``pos`` that stay, by the expected attention of queries distributed as the last
        ``decode_queries`` decode queries, rotated over the ``n_future_positions`` after the latest token
        (``rotary``: RoPE's columns, 0 without RoPE). The sinks (the first ``n_sink`` stored entries) and the
        ``window`` latest stay whatever their score."""
        queries, rope, counts = state
        b, hkv, g, w, d = queries.shape
        rows = torch.arange(w, device=k.device) < counts[:, 0, SINCE_CUT, None].clamp_max(w)
        mu, cov = query_moments(queries.reshape(b, hkv * g, w, d), rows, self.use_covariance)
        rot = None
        if rotary:
            freq = rope[:, 0, 2, :rotary] / (counts[:, 0, SEEN, None] - 1).clamp_min(1)
            rot = rotation(
                freq, torch.complex(rope[:, 0, 0, :rotary], rope[:, 0, 1, :rotary]), self.n_future_positions, d
            )
        valid, forced = scoring.window_layout(pos, self.window)
        sinks, rest = self._sinks(valid[:, 0])
        return scoring.keep_top(self._expected(mu, cov, rot, k, v, rest), forced | sinks[:, None], valid, keep)

    def slot_capacity(
        self, max_length: int, max_new_tokens: int, layer: int = 0, layers: int = 1, ranks: int = 1
    ) -> int:
        if not self.decode_interval:
            return super().slot_capacity(max_length, max_new_tokens, layer, layers, ranks)
        return min(max_length, self.budget + min(max_new_tokens, self.decode_interval + SLACK))

    def slot_state(self, capacity: int, head_dim: int, groups: int = 1) -> dict:
        return decode_state(groups, self.decode_queries, head_dim) if self.decode_interval else {}

    def slot_hooks(self, site) -> SlotHooks | None:
        if not self.decode_interval or site.sliding_window:
            return None
        return SlotHooks(
            refresh=reset,
            observe=observe,
            cut=functools.partial(self.slot_cut, rotary=site.q_rope.rotary),
            due=self.budget + self.decode_interval,
        )

    def slot_cut(self, keys: Tensor, values: Tensor, pos: Tensor, count: Tensor, state: list, rotary: int) -> None:
        """``SlotHooks.cut``: the rows whose layer holds ``budget + decode_interval`` entries keep the ``budget`` that
        ``cut_keep`` picks, in the first slots and in order; the others are left as they are."""
        due = count[:, FILLED] >= self.budget + self.decode_interval
        idx = self.cut_keep(keys, values, pos, state, self.budget, rotary)
        for t in (keys, values):
            kept = t.gather(2, idx[..., None].expand(*idx.shape, t.shape[-1]))
            t[:, :, : self.budget] = torch.where(due[:, None, None, None], kept, t[:, :, : self.budget])
        cut = torch.full_like(pos, -1)
        cut[:, :, : self.budget] = pos.gather(2, idx)
        pos.copy_(torch.where(due[:, None, None], cut, pos))
        count[:, FILLED] = torch.where(due, self.budget, count[:, FILLED])
        state[2][..., SINCE_CUT] = torch.where(due[:, None], 0, state[2][..., SINCE_CUT])

    def _check_rotated(self, site, cos) -> None:
        rotated = site.q_rope is not None and site.q_rope.cos is not None
        if rotated != (cos is not None):  # never score a rotated query as if it were not, or the reverse
            raise RuntimeError(
                f"policy '{self.name}': layer {site.layer}'s query is {'' if rotated else 'not '}"
                f"rotated by RoPE, but select was {'not ' if rotated else ''}given RoPE tables"
            )

    def _sinks(self, real: Tensor) -> tuple[Tensor, Tensor]:
        """``(sinks, rest)`` ``[B, N]``: the first ``n_sink`` real entries, and the other real ones."""
        sinks = real & (real.long().cumsum(-1) <= self.n_sink)
        return sinks, real & ~sinks

    def _expected(self, mu: Tensor, cov: Tensor | None, rot: Tensor | None, k: Tensor, v: Tensor, rest: Tensor):
        """``[B, H_kv, N]``: each ``rest`` entry's expected attention from queries of mean ``mu`` and covariance
        ``cov`` turned by ``rot`` (None: no rotation), averaged over each KV group, weighed by the value norms."""
        if rot is not None:
            mu = torch.einsum("bij,bhj->bhi", rot, mu.double()).float()
            if cov is not None:
                cov = torch.einsum("bij,bhjk,blk->bhil", rot, cov.double(), rot).float()
        logit = expected_logits(mu, cov, k).masked_fill(~rest[:, None], -math.inf)
        attn = torch.softmax(logit, -1).nan_to_num(0.0)  # a row with no key after its sinks: nothing
        score = attn.view(k.shape[0], k.shape[1], -1, k.shape[2]).mean(2)
        if self.use_vnorm:
            score = (score + self.epsilon) * torch.linalg.vector_norm(v.float(), dim=-1)
        return score
