"""The page family's operators (quest, raas), registered on import; their kernels sit in ``kvpass.kernels``.

``kvpass::page_bounds(q, kmin, kmax) -> ub [B, H, P] fp32``
    Quest's page upper bounds, per query head (``page_bounds_reference``), by which Quest's decode steps rank
    pages on both caches; its kernel is parallel over blocks of pages
    (``kvpass.kernels.page_bounds``). A ``triton_op``: Triton on CUDA, ``kvpass::page_bounds_ref``
    elsewhere.

``kvpass::raas_stamp(q, k_new, count, kmin, kmax, live, ts, born, meta, seen, decode_pages, alpha)``
    RaaS's per-layer decode update of its page tables, on both caches, in place (fold the token into its
    page's bounds, stamp the decode pages, plan the next slot; ``kvpass.kernels.raas_stamp``). A
    ``triton_op``: two Triton launches on CUDA, ``kvpass::raas_stamp_ref`` elsewhere.

``kvpass::top_pages(ub, top) -> idx [..., top] int32``
    The ``top`` best pages of each row of scores ``ub [..., P]`` (``-inf`` = not eligible), in
    ascending index order, -1 padded; ties go to the lower index (``top_pages_reference``). Quest's
    page choice on a SlotCache; its kernel selects without sorting (``kvpass.kernels.top_pages``).
    A ``triton_op``: Triton on CUDA (rows up to ``MAX_PAGES``), ``kvpass::top_pages_ref`` elsewhere.

``kvpass::page_select(q, k, handle, key) -> block_map [B, H_kv, steps] int32``
    The pages (blocks of 16) a page-selecting policy's decode step reads, -1 = none (Quest's top
    pages by upper bound and the current page); ``k`` is the cache with the new token last, which the
    policy folds into its page bounds first (stateful like ``compact``, idempotent for equal inputs).
    Feeds ``decode_attention``'s ``block_map``.

``kvpass::step_position(k_pool, handle, key) -> q_pos [B, 1]`` and
``kvpass::pool_write(k_pool!, v_pool!, k_new, v_new, q, q_pos, handle, key) -> kv_pos``
    The decode step of a pool site (``SitePlan.pool``, raas): the new token's true position (read
    from the layer's record), then the policy writes the token's K/V into a slot of the stored pool
    in place (the graph stores the mutated pool; nothing is concatenated or gathered) and returns
    every slot's position after the write. The write depends only on its inputs and the policy's
    plan for the step, so a replayed call writes the same slot.

``key`` in these operators names one compiled graph's attention site (``Site.key``, ``kvpass.cache.runtime``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpass.cache import runtime
from kvpass.kernels import page_bounds as _bounds
from kvpass.kernels import raas_stamp as _stamp
from kvpass.kernels import top_pages as _top
from kvpass.op_registry import register
from kvpass.policies.contract import PagePolicy


@torch.library.custom_op("kvpass::page_bounds_ref", mutates_args=())
def page_bounds_ref(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    return _bounds.page_bounds_reference(q, kmin, kmax)


@page_bounds_ref.register_fake
def _(q, kmin, kmax):
    return q.new_empty((q.shape[0], q.shape[1], kmin.shape[2]), dtype=torch.float32)


@torch.library.triton_op("kvpass::page_bounds", mutates_args=())
def page_bounds(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest's upper bound ``[B, H, P]`` (fp32) of every page for every query head; see
    ``kvpass.kernels.page_bounds``. Triton on CUDA, the reference operator elsewhere."""
    if q.device.type == "cuda" and _bounds.triton is not None:
        return _bounds.page_bounds_triton(q, kmin, kmax, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.page_bounds_ref(q, kmin, kmax)


_TABLES = ("kmin", "kmax", "live", "ts", "born", "meta", "seen")


@torch.library.custom_op("kvpass::raas_stamp_ref", mutates_args=_TABLES)
def raas_stamp_ref(
    q: Tensor,
    k_new: Tensor,
    count: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    live: Tensor,
    ts: Tensor,
    born: Tensor,
    meta: Tensor,
    seen: Tensor,
    decode_pages: int,
    alpha: float,
) -> None:
    _stamp.raas_stamp_reference(q, k_new, count, kmin, kmax, live, ts, born, meta, seen, decode_pages, alpha)


@torch.library.triton_op("kvpass::raas_stamp", mutates_args=_TABLES)
def raas_stamp(
    q: Tensor,
    k_new: Tensor,
    count: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    live: Tensor,
    ts: Tensor,
    born: Tensor,
    meta: Tensor,
    seen: Tensor,
    decode_pages: int,
    alpha: float,
) -> None:
    """RaaS's decode update of one layer's page tables, in place; see ``kvpass.kernels.raas_stamp``.
    Triton on CUDA (contiguous tables, as a SlotCache allocates them), the reference operator elsewhere."""
    tables = (kmin, kmax, live, ts, born, meta, seen)
    if q.device.type == "cuda" and _stamp.triton is not None and all(t.is_contiguous() for t in tables):
        return _stamp.raas_stamp_triton(q, k_new, count, *tables, decode_pages, alpha, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.raas_stamp_ref(q, k_new, count, *tables, decode_pages, alpha)


@torch.library.custom_op("kvpass::top_pages_ref", mutates_args=())
def top_pages_ref(ub: Tensor, top: int) -> Tensor:
    return _top.top_pages_reference(ub, top)


@top_pages_ref.register_fake
def _(ub, top):
    return ub.new_empty((*ub.shape[:-1], top), dtype=torch.int32)


@torch.library.triton_op("kvpass::top_pages", mutates_args=())
def top_pages(ub: Tensor, top: int) -> Tensor:
    """The ``top`` best pages of each row of ``ub`` in index order, -1 padded; see
    ``kvpass.kernels.top_pages``. Triton on CUDA, the reference operator elsewhere."""
    if ub.device.type == "cuda" and _top.triton is not None and ub.shape[-1] <= _top.MAX_PAGES:
        return _top.top_pages_triton(ub, top, launch=torch.library.wrap_triton)
    return torch.ops.kvpass.top_pages_ref(ub, top)


def _pager(policy) -> PagePolicy:
    """The policy (or member of a composition) that selects pages for decode reads: the one that brings the
    contract's ``PagePolicy`` protocol."""
    for m in policy.members or (policy,):
        if isinstance(m, PagePolicy):
            return m
    raise RuntimeError(f"kvpass: policy '{policy.name}' selects no pages (kvpass::page_select)")


@torch.library.custom_op("kvpass::page_select", mutates_args=())
def page_select(q: Tensor, k: Tensor, handle: int, key: int) -> Tensor:
    rt = runtime.get(handle)
    return _pager(rt.policy).page_map(rt.sites[key], q, k, rt.state.layer(runtime.layer_of(key)))


@page_select.register_fake
def _(q, k, handle, key: int):
    steps = _pager(runtime.get(handle).policy).map_steps
    return k.new_empty((k.shape[0], k.shape[1], steps), dtype=torch.int32)


@torch.library.custom_op("kvpass::step_position", mutates_args=())
def step_position(k_pool: Tensor, handle: int, key: int) -> Tensor:
    return runtime.get(handle).step_position(key, k_pool)


@step_position.register_fake
def _(k_pool, handle, key: int):
    return k_pool.new_empty((k_pool.shape[0], 1), dtype=torch.long)


@torch.library.custom_op("kvpass::pool_write", mutates_args=("k_pool", "v_pool"))
def pool_write(
    k_pool: Tensor, v_pool: Tensor, k_new: Tensor, v_new: Tensor, q: Tensor, q_pos: Tensor, handle: int, key: int
) -> Tensor:
    return runtime.get(handle).pool_write(key, q, k_pool, v_pool, k_new, v_new, q_pos)


@pool_write.register_fake
def _(k_pool, v_pool, k_new, v_new, q, q_pos, handle, key: int):
    return k_pool.new_empty(k_pool.shape[:3], dtype=torch.long)


register(
    page_bounds=page_bounds,
    page_bounds_ref=page_bounds_ref,
    raas_stamp=raas_stamp,
    raas_stamp_ref=raas_stamp_ref,
    top_pages=top_pages,
    top_pages_ref=top_pages_ref,
    page_select=page_select,
    step_position=step_position,
    pool_write=pool_write,
)
