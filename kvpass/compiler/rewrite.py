"""Rewrite: replace detected sites with kvpass operators, as the rewrite kind of each site's plan says.

``REWRITES`` maps ``SitePlan.rewrite_kind`` (decided by ``kvpass.compiler.plan``) to the function that rewrites it:

* ``attention`` (and ``append``, whose cache the model updates itself): ``attention(q, k, v, mask, scale,
  causal, softcap)`` takes the place of the SDPA call or of the eager ``softmax(q k^T) v`` chain;
* ``evict``: the ``torch.cat`` cache update becomes ``cache_update`` (K/V plus true positions), attention
  becomes ``attention_pos`` (mask from positions, so it always matches the kept entries; a prefill graph,
  whose cache held nothing, keeps ``attention`` with the model's own mask), and ``compact`` produces the
  tensors the cache stores, so evicted entries are freed;
* ``pool`` (raas's decode steps on a DynamicCache): ``pool_write`` writes the new token into a slot of the
  stored pool in place, ``decode_attention`` reads the pool, and the pool itself is stored;
* ``overwrite`` (chunk fusion's recompute, ``kvpass.chunks.router``): the ``torch.cat`` pair becomes
  ``cache_overwrite`` (the new tokens written over their slots of a merged cache, same length), attention
  becomes ``attention_slots`` (slot j is position j), and the overwritten tensors are what the cache stores;
* ``slot`` (a ``kvpass.SlotCache``): the cache's ``slot_append`` becomes the slot writes of the policy's rule
  and hooks, and decode steps read the slots by position with ``decode_attention``;
* ``unchanged``: nothing.

Any rewrite reads a decode step's cache with ``decode_attention`` (ART) instead of exact attention when the plan
carries a ``DecodeRead``. Once a site evicts or appends to a shrunk cache, position ids the model derived from
the cache length pass through ``true_positions`` (``kvpass.compiler.positions``).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from kvpass import ops as _ops  # noqa: F401  (registers torch.ops.kvpass.*)
from kvpass.cache.ragged import by_head
from kvpass.cache.slots import pending_positions, write_heads, write_slots
from kvpass.compiler.detect import SLOT_APPEND_ARGS, Detection, Site, seq_slice, val
from kvpass.compiler.fxargs import leading
from kvpass.compiler.maskcheck import site_mask
from kvpass.compiler.positions import fix_positions, table_lookups
from kvpass.compiler.tp import gather_heads
from kvpass.kernels.decode_attention import ORDER_MAP
from kvpass.ops import CAUSAL_NONE
from kvpass.policies.contract import DecodeRead, SitePlan, SlotHooks, decode_read_problem

OPS = torch.ops.kvpass


@dataclasses.dataclass(frozen=True)
class Rewritten:
    """What ``rewrite`` did to one graph."""

    rewritten: int  # sites rewritten (any rewrite kind but ``unchanged``)
    evicting: list[int]  # layers whose cache the policy shrinks (``evict`` and ``pool`` rewrites)
    appending: list[int]  # layers left to the model's cache update, positions fixed (``append``)
    slots: list[int]  # kvpass.SlotCache layers (``slot``)
    positions_fixed: list[str]  # position nodes routed through ``true_positions``
    reductions: list[str]  # collectives inserted for decisions across heads (tensor parallelism)


def _empty(k_past) -> bool:
    """A site with no stored entries in this graph (a prefill: no past, or a past of static length 0)."""
    past = val(k_past)
    return k_past is None or (isinstance(past, torch.Tensor) and 0 in past.shape)  # (a symbolic size is never 0)


def _first(graph: fx.Graph, nodes) -> fx.Node:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return min(nodes, key=order.__getitem__)


def _items(graph: fx.Graph, node: fx.Node, n: int) -> list[fx.Node]:
    with graph.inserting_after(node):
        items = [graph.call_function(operator.getitem, (node, i)) for i in range(n)]
    return items


def _replace_output(site, new: fx.Node) -> None:
    """The site's attention output becomes ``new`` (same shape and dtype), which takes over Dynamo's
    ``example_value``: AOTAutograd's cache refuses a graph with a method called on a tensor whose node has
    none (HF's ``attn_output.transpose(1, 2)``)."""
    if "example_value" in site.out.meta:
        new.meta.setdefault("example_value", site.out.meta["example_value"])
    site.out.replace_all_uses_with(new)


def _erase(graph: fx.Graph, nodes) -> None:
    """Erase the nodes that have become dead, users before their inputs."""
    pending = list(nodes)
    progress = True
    while pending and progress:
        progress = False
        for n in list(pending):
            if getattr(n, "_erased", False):
                pending.remove(n)
            elif not n.users:
                graph.erase_node(n)
                pending.remove(n)
                progress = True


def _query_and_scale(graph: fx.Graph, site: Site):
    """A symbolic scale (dynamic float) is folded into q, so the op's scale is a constant 1.0."""
    if not isinstance(site.scale, fx.Node):
        return site.q, site.scale
    with graph.inserting_before(site.out):
        return graph.call_function(operator.mul, (site.q, site.scale)), 1.0


def _decode_read(
    graph: fx.Graph,
    site: Site,
    read: DecodeRead,
    handle: int,
    q,
    k,
    v,
    mask,
    kv_pos,
    q_pos,
    scale,
    window,
    kv_len=None,
    bmap=None,
) -> fx.Node:
    """``decode_attention`` (ART) for one decode step; with statistics, ``count_visits`` after it.
    A read with ``pages`` (Quest) reads only the blocks ``page_select`` chooses (its ``block_map``), a
    SlotCache read the blocks of ``bmap`` when given."""
    if bmap is None and read.pages:
        bmap = graph.call_function(OPS.page_select.default, (q, k, handle, site.key))
    att = graph.call_function(
        OPS.decode_attention.default,
        (
            q,
            k,
            v,
            mask,
            kv_pos,
            q_pos,
            None,
            kv_len,
            bmap,
            scale,
            site.softcap,
            window,
            read.tau,
            read.phi,
            read.patience,
            read.block,
            read.order,
            read.probe,
            read.horizon,
        ),
    )
    out, visited = (graph.call_function(operator.getitem, (att, i)) for i in range(2))
    if read.stats:
        out = graph.call_function(OPS.count_visits.default, (out, visited, k, read.block, handle, site.key))
    return out


def _attention_only(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> None:
    read = plan.read
    q, scale = _query_and_scale(graph, site)
    with graph.inserting_before(site.out):
        if read is not None:
            new = _decode_read(graph, site, read, handle, q, site.k, site.v, site.mask, None, None, scale, 0)
        else:
            mask, causal = site_mask(site)
            new = graph.call_function(OPS.attention.default, (q, site.k, site.v, mask, scale, causal, site.softcap))
            if plan.repeat_scores:  # idle unless a repeat pass runs (kvzip)
                new = graph.call_function(
                    OPS.repeat_scores.default, (new, q, site.k, mask, scale, site.softcap, handle, site.key)
                )
    _replace_output(site, new)
    _erase(graph, [site.out] + site.erase)


def _prefill_attention(graph: fx.Graph, site: Site, plan: SitePlan, q, k, v, mask, scale, causal) -> tuple:
    """A prefill's exact attention over the prompt: ``(out, lse)``, where a plan that asks for the rows'
    log-sum-exp (``SitePlan.lse``) gets it from ``attention_lse`` when the attention is plainly causal (no
    mask left, no softcap), else ``(attention, None)`` and the policy computes what it needs itself."""
    if plan.lse and mask is None and causal != CAUSAL_NONE and not site.softcap:
        both = graph.call_function(OPS.attention_lse.default, (q, k, v, scale))
        return tuple(graph.call_function(operator.getitem, (both, i)) for i in range(2))
    return graph.call_function(OPS.attention.default, (q, k, v, mask, scale, causal, site.softcap)), None


def _layer_votes(graph: fx.Graph, site: Site, plan: SitePlan, q_scaled, reductions: list) -> fx.Node | None:
    """A prefill whose selection reads the whole layer's window votes (``SitePlan.layer_votes``): they are
    computed in the graph (``layer_scores``, ``[B, H_kv, N]``) and, on a tensor-parallel rank, gathered from
    every rank (``kvpass.compiler.tp``), so each rank's ``select`` sees what one device's would. Under dynamic
    shapes (one graph for every call) too: its ``select`` acts only on a prefill."""
    if not plan.layer_votes or site.phase not in ("prefill", "dynamic"):
        return None
    local = graph.call_function(
        OPS.layer_scores.default,
        (q_scaled, site.k_new, site_mask(site)[0], 1.0, float(site.softcap), int(plan.layer_votes)),
    )
    return gather_heads(graph, local, site.tp, f"layer {site.layer}: selection votes", reductions)


def _query_rope(graph: fx.Graph, site: Site, plan: SitePlan) -> tuple:
    """A call whose selection reads the queries before RoPE (``SitePlan.rope``: a prefill's, or a decode step's
    where the policy keeps decode-time statistics): ``(q_pre, cos, sin)``, the query before the rotation scaled
    like ``q`` (``q_pre . k`` is a logit at no rotation) and the rotation's tables (``Site.q_rope``: the planning
    policy refused an unrecognised one); all None where the query is not rotated (the policy reads ``q``)."""
    if not plan.rope or site.q_rope.cos is None:
        return None, None, None
    rope = site.q_rope
    pre = rope.pre if site.scale == 1.0 else graph.call_function(operator.mul, (rope.pre, site.scale))
    return pre, rope.cos, rope.sin


def _out_proj(graph: fx.Graph, site: Site, plan: SitePlan) -> fx.Node | None:
    """A prefill whose selection reads the layer's output projection (``SitePlan.out_proj``): its weight as the
    graph reads it (``Site.o_proj``: a tensor-parallel rank's local shard), ``[hidden, H * Dv]`` (an ``addmm`` /
    ``matmul`` operand transposed, a view); None in decode graphs. The nodes that read it from its parameter
    (casts, ``to_local``) sit where the model runs the projection, after the attention: those after the attention
    output are moved before it (to the current insertion point); they read graph inputs or attributes only."""
    if not plan.out_proj or site.phase not in ("prefill", "dynamic") or site.o_proj.weight is None:
        return None
    proj = site.o_proj
    order = {n: i for i, n in enumerate(graph.nodes)}
    chain, node = [proj.weight], proj.weight
    while node.op not in ("placeholder", "get_attr"):  # detect.out_projection checked the chain's steps
        node = node.args[0]
        chain.append(node)
    for n in reversed(chain[:-1] if node.op == "placeholder" else chain):
        if order[n] > order[site.out]:
            site.out.prepend(n)
    return graph.call_function(torch.t, (proj.weight,)) if proj.transposed else proj.weight


def _evicting(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> list[str]:
    read, tokens = plan.read, (site.tokens if plan.tokens else None)
    mask, causal = site_mask(site)
    update = OPS.heads_update.default if plan.heads else OPS.cache_update.default
    with graph.inserting_before(_first(graph, [site.k, site.v])):
        upd = graph.call_function(update, (site.k_past, site.v_past, site.k_new, site.v_new, mask, handle, site.key))
    k_all, v_all, kv_pos, q_pos, *ranges = _items(graph, upd, 6 if plan.heads else 4)
    q, scale = _query_and_scale(graph, site)
    window = site.sliding_window or 0
    lse = None
    with graph.inserting_before(site.out):
        if plan.heads and site.phase != "prefill":
            att = _heads_read(graph, site, plan, handle, q, k_all, v_all, kv_pos, q_pos, scale, *ranges)
        elif read is not None:
            att = _decode_read(graph, site, read, handle, q, k_all, v_all, None, kv_pos, q_pos, scale, window)
        elif site.phase == "prefill":
            # The cache held nothing: K/V are exactly the prompt and the model's own mask (causal and
            # padding) matches them. It keeps SDPA's fused kernels, where attention_pos would build an
            # [N, N] position mask per head: gigabytes at 32k-128k tokens.
            att, lse = _prefill_attention(graph, site, plan, q, k_all, v_all, mask, scale, causal)
        else:
            att = graph.call_function(
                OPS.attention_pos.default, (q, k_all, v_all, q_pos, kv_pos, scale, site.softcap, window)
            )
        # compact gets q with the scale folded in (q . k is the logit), whatever graph it runs in, so a
        # scoring policy never depends on which graph's site it is told about
        q_scaled = q if scale == 1.0 else graph.call_function(operator.mul, (q, scale))
        reductions: list[str] = []
        votes = _layer_votes(graph, site, plan, q_scaled, reductions)
        cmp = graph.call_function(
            OPS.compact.default,
            (
                q_scaled,
                k_all,
                v_all,
                kv_pos,
                q_pos,
                handle,
                site.key,
                tokens,
                votes,
                lse,
                *_query_rope(graph, site, plan),
                _out_proj(graph, site, plan),
            ),
        )
    k_st, v_st = _items(graph, cmp, 2)
    _replace_output(site, att)
    _erase(graph, [site.out] + site.erase)
    for old, new in ((site.k, k_st), (site.v, v_st)):
        old.replace_all_uses_with(new)  # what remains are the stored tensors (graph outputs)
        _erase(graph, [old])
    _after(graph, k_st if _first(graph, [k_st, v_st]) is v_st else v_st)
    return reductions


def _heads_read(
    graph: fx.Graph, site: Site, plan: SitePlan, handle: int, q, k_all, v_all, kv_pos, q_pos, scale, start, length
) -> fx.Node:
    """Attention over a per-head layer (``kvpass.cache.ragged``; ``k_all`` ``[B, H_kv, L, D]`` is the row's pool): a
    decode step reads each head's range of the pool with ``decode_attention`` (``kv_start``); several queries
    (an append, a graph of any length) attend by position over each head's entries (``ragged.by_head``)."""
    pool = [graph.call_function(torch.flatten, (t, 1, 2)) for t in (k_all, v_all, kv_pos)]  # [B, H_kv L, ...]
    k_pool, v_pool = (graph.call_function(torch.unsqueeze, (t, 1)) for t in pool[:2])
    pos = graph.call_function(torch.unsqueeze, (pool[2], 1))
    if site.phase == "decode" and decode_read_problem(site) is None:
        att = graph.call_function(
            OPS.decode_attention.default,
            (
                q,
                k_pool,
                v_pool,
                None,
                pos,
                q_pos,
                None,
                length,
                None,
                scale,
                site.softcap,
                0,
                0.0,
                0.0,
                5,
                DecodeRead().block,
                DecodeRead().order,
                0,
                0,
                start,
            ),
        )
        return graph.call_function(operator.getitem, (att, 0))
    view = graph.call_function(by_head, (k_pool, v_pool, pos, start, length))
    k_h, v_h, pos_h = (graph.call_function(operator.getitem, (view, i)) for i in range(3))
    return graph.call_function(OPS.attention_pos.default, (q, k_h, v_h, q_pos, pos_h, scale, site.softcap, 0))


def _after(graph: fx.Graph, anchor: fx.Node) -> None:
    """Move the nodes that now read a value defined after them (a sliding layer's stored slice
    ``cat[:, :, -(W-1):]`` sits right after the concatenation) to just after ``anchor``, users with them."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late = [n for n in graph.nodes if order[n] < order[anchor] and any(order[a] > order[n] for a in n.all_input_nodes)]
    todo, moved = list(late), []
    while todo:
        n = todo.pop(0)
        if n in moved:
            continue
        moved.append(n)
        todo += [u for u in n.users if order[u] < order[anchor]]
    at = anchor
    for n in sorted(moved, key=order.__getitem__):
        at.append(n)
        at = n


def _pool_write(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> None:
    """A pool policy's decode step (raas): the new token is written into a slot of the stored pool in
    place (``pool_write``) and the pool is read by ``decode_attention`` (exact unless the plan reads
    with ART). The graph stores the mutated pool tensors themselves: no concatenation, no compaction."""
    q, scale = _query_and_scale(graph, site)
    with graph.inserting_before(site.out):
        q_pos = graph.call_function(OPS.step_position.default, (site.k_past, handle, site.key))
        q_scaled = q if scale == 1.0 else graph.call_function(operator.mul, (q, scale))
        kv_pos = graph.call_function(
            OPS.pool_write.default,
            (site.k_past, site.v_past, site.k_new, site.v_new, q_scaled, q_pos, handle, site.key),
        )
        att = _decode_read(
            graph,
            site,
            plan.read or DecodeRead(),
            handle,
            q,
            site.k_past,
            site.v_past,
            None,
            kv_pos,
            q_pos,
            scale,
            site.sliding_window or 0,
        )
    _replace_output(site, att)
    _erase(graph, [site.out] + site.erase)
    for old, new in ((site.k, site.k_past), (site.v, site.v_past)):
        old.replace_all_uses_with(new)  # the graph stores the pool it wrote into
        _erase(graph, [old])


def _overwrite(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> None:
    """Chunk fusion: new K/V written over their slots of the stored (merged) cache, exact position mask;
    with ``votes``, ``fusion_votes`` after the attention hands the question's attention to the policy."""
    with graph.inserting_before(_first(graph, [site.k, site.v])):
        upd = graph.call_function(
            OPS.cache_overwrite.default, (site.k_past, site.v_past, site.k_new, site.v_new, handle, site.key)
        )
    k_all, v_all, kv_pos, q_pos = _items(graph, upd, 4)
    q, scale = _query_and_scale(graph, site)
    with graph.inserting_before(site.out):
        # slot j holds position j: attention_slots is attention_pos with that known, so on CUDA a
        # FlashAttention-style kernel masks by position and skips key blocks past each query tile
        att = graph.call_function(OPS.attention_slots.default, (q, k_all, v_all, q_pos, scale, site.softcap))
        if plan.votes:
            att = graph.call_function(
                OPS.fusion_votes.default, (att, q, k_all, q_pos, scale, site.softcap, handle, site.key)
            )
    _replace_output(site, att)
    _erase(graph, [site.out] + site.erase)
    for old, new in ((site.k, k_all), (site.v, v_all)):
        old.replace_all_uses_with(new)  # the stored tensors (graph outputs)
        _erase(graph, [old])


def _slot(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> list[str]:
    """A ``kvpass.SlotCache`` site (``kvpass.cache.slots``): the cache's own ``slot_append`` is replaced.

    * prefill: exact attention over the prompt with the model's mask; ``slot_prefill`` lets the policy
      keep entries and writes them into the slots;
    * decode: ``write_slots`` puts the token into the victim slot the policy's rule picks on the device,
      then ``decode_attention`` reads every slot by position (ART when the plan reads with it);
    * append (several tokens on a filled cache): attention by position over the slots and the new
      tokens, then ``write_slots`` (a token sees what its own call evicts, as on a DynamicCache);
    * a per-head layout (``SitePlan.heads``) in decode or append: ``write_heads`` puts each head's tokens
      after its range, then each head's range is read (``_heads_read``).

    A sliding-window layer is a ring of its window's slots (``slot_prefill`` keeps the prompt's last
    entries), read by position within the window."""
    rule, protect = plan.slot
    window = site.sliding_window or 0  # a sliding layer: a ring of its window, read within the window
    keys, values, pos, count, _, _, state = leading(site.slot, SLOT_APPEND_ARGS)
    hooks = plan.slot_hooks or SlotHooks()
    reductions: list[str] = []
    q, scale = _query_and_scale(graph, site)
    with graph.inserting_before(site.out):
        if site.phase == "prefill":
            mask, causal = site_mask(site)
            att, lse = _prefill_attention(graph, site, plan, q, site.k_new, site.v_new, mask, scale, causal)
            q_scaled = q if scale == 1.0 else graph.call_function(operator.mul, (q, scale))
            votes = _layer_votes(graph, site, plan, q_scaled, reductions)
            graph.call_function(
                OPS.slot_prefill.default,
                (
                    keys,
                    values,
                    pos,
                    count,
                    state,
                    q_scaled,
                    site.k_new,
                    site.v_new,
                    mask,
                    handle,
                    site.key,
                    site.tokens if plan.tokens else None,
                    votes,
                    lse,
                    *_query_rope(graph, site, plan),
                    _out_proj(graph, site, plan),
                ),
            )
            if hooks.refresh is not None:
                graph.call_function(hooks.refresh, (keys, pos, count, state, *hooks.args))
        elif plan.heads:  # the per-head layout (kvpass.cache.ragged): each head's tokens after its range, then read
            ranges = state[0]  # a per-head policy's first state tensor (ragged.SLOT_STATE, Needs.heads)
            w = graph.call_function(
                write_heads, (keys, values, pos, count, ranges, site.k_new, site.v_new, plan.heads_ring)
            )
            q_pos, start, length = (graph.call_function(operator.getitem, (w, i)) for i in range(3))
            att = _heads_read(graph, site, plan, handle, q, keys, values, pos, q_pos, scale, start, length)
        elif site.phase == "decode":
            slot = None if hooks.place is None else graph.call_function(hooks.place, (pos, count, state, *hooks.args))
            w = graph.call_function(
                write_slots, (keys, values, pos, count, site.k_new, site.v_new, rule, protect, slot)
            )
            q_pos, kv_len = (graph.call_function(operator.getitem, (w, i)) for i in range(2))
            read, bmap = plan.read or DecodeRead(), None
            if hooks.update is not None or hooks.observe is not None:
                q_scaled = q if scale == 1.0 else graph.call_function(operator.mul, (q, scale))
            if hooks.update is not None:
                graph.call_function(hooks.update, (q_scaled, keys, pos, count, state, site.k_new, *hooks.args))
            if hooks.select is not None:
                bmap = graph.call_function(hooks.select, (q, pos, count, state, *hooks.args))
                read = dataclasses.replace(read, block=hooks.block, order=ORDER_MAP)
            if hooks.observe is not None:
                pre, cos, sin = _query_rope(graph, site, plan)
                graph.call_function(hooks.observe, (q_scaled if pre is None else pre, cos, sin, state, *hooks.args))
            att = _decode_read(
                graph, site, read, handle, q, keys, values, None, pos, q_pos, scale, window, kv_len, bmap
            )
        else:
            pend = graph.call_function(pending_positions, (pos, count, site.k_new, rule, protect))
            q_pos, kv_pos = (graph.call_function(operator.getitem, (pend, i)) for i in range(2))
            k_all = graph.call_function(torch.cat, ([keys, site.k_new], -2))
            v_all = graph.call_function(torch.cat, ([values, site.v_new], -2))
            att = graph.call_function(
                OPS.attention_pos.default, (q, k_all, v_all, q_pos, kv_pos, scale, site.softcap, window)
            )
            graph.call_function(write_slots, (keys, values, pos, count, site.k_new, site.v_new, rule, protect))
            if hooks.refresh is not None:
                graph.call_function(hooks.refresh, (keys, pos, count, state, *hooks.args))
    _replace_output(site, att)
    # the model's reads of the slots' leading entries go too: AOT would trace a dead view of the slots and
    # guard on whether it is contiguous (capacity == read length), a second decode graph for pyramidkv
    _erase(graph, [site.out] + site.erase + [r for r in (site.k, site.v) if seq_slice(r) is not None])
    graph.erase_node(site.slot)
    return reductions


def rewrite(gm: fx.GraphModule, found: Detection, plans: dict[int, SitePlan], handle: int) -> Rewritten:
    """Apply ``plans`` (site.layer -> SitePlan) to ``gm`` in place; returns what was done."""
    graph = gm.graph
    done: dict[str, list[int]] = {kind: [] for kind in REWRITES}
    reductions: list[str] = []  # collectives inserted for decisions across heads (tensor parallelism)
    for site in found.sites:
        plan = plans[site.layer]
        reductions += REWRITES[plan.rewrite_kind](graph, site, plan, handle) or []  # the gathers it inserted
        done[plan.rewrite_kind].append(site.layer)
    evicting, appending = done["evict"] + done["pool"], done["append"]
    # One eviction anywhere (now or in the prefill an appending graph follows) shortens the length the
    # model derives positions from: fix them all.
    fixed = (
        fix_positions(graph, found.sites, handle, prefill=all(_empty(s.k_past) for s in found.sites))
        if evicting or appending
        else []
    )
    # positions passed in: RoPE's, or an integer input indexing a float table (CTRL's sinusoids)
    passed = next(
        (p for p in [s.positions for s in found.sites] + table_lookups(graph, embedding=False) if p is not None), None
    )
    after_prefill = any(s.phase != "prefill" for s in found.sites)
    if (appending or evicting) and after_prefill and not fixed and passed is not None:
        # positions passed in: checked against the tokens seen, and noted (how far the sequence reached)
        with graph.inserting_after(passed):
            noted = graph.call_function(OPS.note_positions.default, (passed, handle))
        passed.replace_all_uses_with(noted, delete_user_cb=lambda u: u is not noted)
    graph.lint()
    gm.recompile()
    return Rewritten(
        rewritten=sum(len(v) for k, v in done.items() if k != "unchanged"),
        evicting=evicting,
        appending=appending,
        slots=done["slot"],
        positions_fixed=fixed,
        reductions=reductions,
    )


def _unchanged(graph: fx.Graph, site: Site, plan: SitePlan, handle: int) -> None:
    """A site the policy leaves to the model."""


REWRITES = {
    "attention": _attention_only,
    "append": _attention_only,
    "evict": _evicting,
    "pool": _pool_write,
    "overwrite": _overwrite,
    "slot": _slot,
    "unchanged": _unchanged,
}
