"""``raas``: page-timestamp eviction during long decodes (seed paper: RaaS), on a fixed page pool.

Storage. The cache tensors the model stores are the page pool itself: after the prefill each
global layer's K/V become ``[B, H_kv, pages * 16, D]`` with ``pages = prefill pages + budget/16 +
1``, page ``p`` in slots ``16p .. 16p+15``. Prefill pages hold the prompt in order; the rest are
decode pages. Per (sequence, KV head) the policy keeps a page table in ``LayerState.extra``:
which pages are resident (``live``), each page's timestamp and allocation step, its element-wise
min / max keys, the current decode page and its fill. Empty slots carry position -1, so
``attention_pos`` never sees them; a decode step attends to every resident entry exactly. The pool
is allocated once, at the prefill: memory is flat from there on, and every eviction returns a page
that the next allocation reuses.

Each decode step (in ``select``, after the step's attention):

1. score: ``kvpass::page_scores`` computes Quest's upper bound of every resident page for every
   query head, its softmax share over the resident pages, and stamps ``ts = tokens seen`` on the
   pages whose share exceeds ``alpha`` for some query head of the KV group;
2. place the new token: into the current decode page while it has room (its min / max keys grow);
   otherwise a new page is taken from the free list. When all ``budget/16 + 1`` decode pages are
   full, the full decode page with the oldest timestamp (ties: the earliest allocated) is evicted
   first and its page reused. Prefill pages and the current partial page are never evicted.

Default ``alpha = 0.02``, chosen by a sweep on the long-decode task (README, ``bench/sweep_raas.py``,
``bench/results/raas_sweep_smollm2_cpu/``: SmolLM2-135M, 512-token prompt, 256 new tokens, budget
64): perplexity of ``full``'s continuation 1.0842 / 1.0834 / 1.0812 / 1.0837 / 1.0835 for alpha
0.005 / 0.01 / 0.02 / 0.05 / 0.1, greedy agreement 0.992 then 0.996. A small alpha stamps almost
every page every step, so timestamps stop ranking pages and eviction becomes oldest-allocated-first;
0.02 was the best value measured (a trend of one token in 256 on one prompt, not significant). Alpha is compared with a softmax share over the
resident pages, so its natural scale is ``1 / resident pages`` (1/37 in the sweep).

Cost. Steps 1 and 2 are one pure function of tensors (``_step``) with no branch on device values
and no host sync; on CUDA it runs compiled by Inductor (a handful of fused kernels per layer, where
eager PyTorch launched about 60: measured 58 ms per step against quest's 26 ms on SmolLM2's shape,
H200, before the change), on other devices eagerly. ``test_compiled_step_equals_eager`` checks the
two agree step by step.

Positions stay true: every slot's token index is in ``LayerState.pos`` and RoPE continues from the
tokens seen. Batch > 1 works with per-(sequence, KV head) page tables. Graphs that append several
tokens to a filled cache are not supported (a clear error at compile time).
"""

from __future__ import annotations

import torch

from kvpass.policies.base import ConfigError, Param, Policy, SitePlan

PAGE = 16
_STAMP = -2  # page_scores writes this where a page passes alpha; replaced by the token count on the device


class RaaS(Policy):
    name = "raas"
    summary = "decode-time page eviction by attention timestamps, constant memory (page pool of budget/16 + 1)"
    evicts = True
    params = (
        Param("budget", int, 1024, PAGE, 1 << 24, "decode tokens kept per layer and KV head (a multiple of 16), "
              "besides the prompt and the current page"),
        Param("alpha", float, 0.02, 0.0, 1.0, "softmax share above which a page's timestamp is refreshed"),
    )

    def check_config(self) -> None:
        if self.budget % PAGE:
            raise ConfigError(f"policy 'raas': parameter 'budget' must be a multiple of {PAGE} in "
                              f"[{PAGE}, {1 << 24}], got {self.budget}")

    @property
    def decode_pages(self) -> int:
        """Decode pages in the pool: budget/16 full pages plus the current partial page."""
        return self.budget // PAGE + 1

    def plan(self, site) -> SitePlan | str:
        if site.sliding_window:
            return SitePlan(attention=True, evict=False)
        if site.cache != "dynamic":
            return (f"layer {site.layer}: raas keeps its page pool in a DynamicCache; "
                    f"this graph uses a {site.cache} cache")
        if site.phase not in ("prefill", "decode"):
            raise NotImplementedError(
                f"policy 'raas' supports prefill graphs and one-token decode graphs; layer {site.layer} is in a "
                f"'{site.phase}' graph (several tokens appended to a filled cache, or a dynamic query length)")
        return SitePlan(attention=True, evict=True)

    def stored_length(self, site, total):
        if site.phase == "prefill":
            return ((total + PAGE - 1) // PAGE + self.decode_pages) * PAGE
        return total - 1  # decode: the new token goes into a slot of the pool

    def select(self, site, q, k, v, kv_pos, q_pos, layer_state):
        now = q_pos[0, -1] + 1  # tokens seen, a 0-d device tensor: int() would sync the GPU per layer and step
        if kv_pos.shape[-1] == q_pos.shape[1]:
            return self._prefill(k, kv_pos, now)
        extra = layer_state.extra if layer_state is not None else {}
        if "live" not in extra or extra["slots"] != k.shape[2] - 1:
            raise RuntimeError("policy 'raas': a decode step found no page table for its cache (the cache "
                               "was not filled by a raas prefill with this backend)")
        st, base = [extra[key] for key in STATE], [extra["base"][key] for key in STATE]
        step = _compiled_step() if k.is_cuda else _step
        keep, new, old = step(q[:, :, -1], k[:, :, -1:].float(), now, self.alpha, extra["n_pre"], k.shape[2] - 1,
                              extra["seen"], st, base)
        return keep, dict(extra, **dict(zip(STATE, new)), seen=now, base=dict(zip(STATE, old)))

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill(self, k, kv_pos, now):
        b, hkv, n, d = k.shape
        n_pre = -(-n // PAGE)
        pages = n_pre + self.decode_pages
        slots = pages * PAGE
        dev = k.device
        idx = torch.arange(slots, device=dev)
        keep = torch.where(idx < n, idx, -1).expand(b, hkv, slots).contiguous()
        pad = n_pre * PAGE - n
        valid = torch.nn.functional.pad(kv_pos >= 0, (0, pad), value=False).view(b, hkv, n_pre, PAGE, 1)
        kp = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(b, hkv, n_pre, PAGE, d)
        kmin = torch.where(valid, kp, float("inf")).amin(3)
        kmax = torch.where(valid, kp, float("-inf")).amax(3)
        live = torch.zeros(b, hkv, pages, dtype=torch.bool, device=dev)
        live[:, :, :n_pre] = valid.any(3)[..., 0]
        zeros = torch.zeros(b, hkv, self.decode_pages, d, device=dev)
        kmin = torch.cat([torch.where(live[:, :, :n_pre, None], kmin, 0.0), zeros], 2)
        kmax = torch.cat([torch.where(live[:, :, :n_pre, None], kmax, 0.0), zeros], 2)
        ts = torch.zeros(b, hkv, pages, dtype=torch.long, device=dev)
        ts[:, :, :n_pre] = now
        born = torch.arange(pages, device=dev).expand(b, hkv, pages).clone()
        born[:, :, n_pre:] = -1
        extra = dict(slots=slots, n_pre=n_pre, fill=torch.tensor(PAGE, device=dev),
                     cur=torch.full((b, hkv), -1, device=dev), live=live, ts=ts, born=born, kmin=kmin,
                     kmax=kmax, seen=now, evicted=torch.full((b, hkv), -1, device=dev))
        extra["base"] = dict(extra)
        return keep, extra


# -- decode: one step is a pure function of tensors, compiled by Inductor on CUDA ----------------

STATE = ("fill", "cur", "live", "ts", "born", "kmin", "kmax", "evicted")


def _step(q, knew, now, alpha: float, n_pre: int, slots: int, seen, st: list, base: list):
    """One decode step of the page table, without a branch on device values.

    ``q [B, H, D]`` is the step's (scaled) query, ``knew [B, H_kv, 1, D]`` its key (fp32), ``now`` the
    tokens seen (0-d), ``st`` / ``base`` the STATE tensors after and before the previous call. A replay
    of the same call (``seen == now``: the operator run again on the same inputs) starts again from
    ``base``. Then: timestamps by ``kvpass::page_scores``, and the token placed. "Room in the current
    page" and "take a page, evicting the oldest full decode page when none is free" are both computed
    and selected, so no step waits for the GPU. Returns (keep, new STATE, the STATE it started from).
    """
    replay = seen == now
    old = [torch.where(replay, before, after) for after, before in zip(st, base)]
    fill, cur, live, ts, born, kmin, kmax, _ = old
    b, hkv, pages = live.shape
    d = knew.shape[-1]
    dev = knew.device
    _, ts = torch.ops.kvpass.page_scores(q, kmin, kmax, live, ts, alpha, _STAMP)
    ts = torch.where(ts == _STAMP, now, ts)  # the operator marks the pages to stamp; `now` stays on the device
    new_page = fill >= PAGE  # the current decode page is full (or none was taken yet)
    dec = torch.arange(pages, device=dev) >= n_pre  # decode pages; prompt pages are never evicted
    dec_live = live | ~dec
    evict = new_page & dec_live.all(-1)  # [B, H_kv]: no free decode page left
    key = torch.where(live & dec, ts * (1 << 32) + born, torch.iinfo(torch.long).max)
    victim = key.argmin(-1, keepdim=True)  # the oldest timestamp, then the earliest allocated
    live = live.scatter(2, victim, live.gather(2, victim) & ~evict[..., None])
    evicted = torch.where(evict, victim[..., 0], -1)
    # the page the new token goes to: the lowest free decode page, or the current one
    free = (~live & dec).long().argmax(-1)
    c = torch.where(new_page, free, cur)[..., None]
    live = live.scatter(2, c, True)
    ts = ts.scatter(2, c, torch.where(new_page, now, ts.gather(2, c)))
    born = born.scatter(2, c, torch.where(new_page, now, born.gather(2, c)))
    cd = c[..., None].expand(b, hkv, 1, d)
    kmin = kmin.scatter(2, cd, torch.where(new_page, knew, torch.minimum(kmin.gather(2, cd), knew)))
    kmax = kmax.scatter(2, cd, torch.where(new_page, knew, torch.maximum(kmax.gather(2, cd), knew)))
    keep = torch.arange(slots, device=dev).expand(b, hkv, slots).clone()
    page_slots = c * PAGE + torch.arange(PAGE, device=dev)
    keep.scatter_(2, page_slots, torch.where(new_page, -1, page_slots))  # a new page's old entries leave
    fill = torch.where(new_page, 1, fill + 1)
    keep.scatter_(2, c * PAGE + fill - 1, slots)  # the new token's slot (``slots`` is its index in k)
    return keep, [fill, c[..., 0], live, ts, born, kmin, kmax, evicted], old


_COMPILED = None


def _compiled_step():
    """``_step`` compiled once per process (shapes dynamic); falls back to eager, with one warning, if
    Inductor cannot build it."""
    global _COMPILED
    if _COMPILED is None:
        compiled = torch.compile(_step, dynamic=True, fullgraph=True)

        def run(*args):
            global _COMPILED
            try:
                return compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compile failure: the eager step is exact
                from kvpass.backend import warn_once

                warn_once(f"kvpass: raas's compiled decode step failed ({type(exc).__name__}: {exc}); "
                          "running it eagerly (slower, same result)")
                _COMPILED = _step
                return _step(*args)
        _COMPILED = run
    return _COMPILED
