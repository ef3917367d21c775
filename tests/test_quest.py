"""Quest page selection (kvpass/policies/quest.py, ``kvpass::page_select``).

* a budget at least the length equals ``full`` (bare forward, batch 2, and shape-dynamic graphs);
* a small budget reads only the selected pages (``blocks_read``), and layers below ``dense_layers``
  stay exact;
* the pages a step reads are the top-k by Quest's bound, computed here by hand page by page, plus
  the current page;
* the incrementally kept min / max keys equal the min / max over each page's valid keys, and bound
  every key (hypothesis, with padding and appends of several tokens); replays change nothing;
* opcheck of ``kvpass::page_select``; configuration errors;
* ``kvpass::top_pages`` (the SlotCache decode's choice of pages): its selection kernel equals its
  reference under the interpreter, and the reference a selection by hand (hypothesis: ties, -inf,
  NaN, fewer eligible pages than ``top``; its opcheck is in test_ops.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpass
from kvpass.cache.state import LayerState
from kvpass.policies import ConfigError, make_policy
from kvpass.policies.pages.quest import PAGE, extend_bounds
from test_raas import decode  # greedy bare-forward decode through a kvpass backend

SITE = SimpleNamespace(layer=0, phase="decode", sliding_window=None, cache="dynamic")


@pytest.mark.parametrize("dynamic", [None, True])
def test_budget_above_length_equals_full(dynamic):
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    full, _, _ = decode("full", ids, 30)
    got, be, cache = decode("quest", ids, 30, dynamic=dynamic, budget=48, dense_layers=0, stats=True)
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    assert be.runtime.blocks_read() == 1.0  # 43 tokens: 3 pages + the current one
    assert any("block=16" in p for r in be.reports if r.phase == "decode" for p in r.plans.values())
    assert cache.layers[0].keys.shape[-2] == 13 + 30  # nothing evicted


def test_small_budget_reads_the_selection_only():
    """80 decode steps at budget 48: each step reads 4 of up to 7 pages; dense layers read all."""
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(4))
    full, _, _ = decode("full", ids, 80)
    got, be, cache = decode("quest", ids, 80, budget=48, dense_layers=0, stats=True)
    lengths = range(21, 101)
    want = sum(min(4, -(-n // PAGE)) for n in lengths) / sum(-(-n // PAGE) for n in lengths)
    assert be.runtime.blocks_read() == pytest.approx(want)
    assert not torch.allclose(got, full, atol=1e-3)  # the selection changes the result
    assert cache.layers[1].keys.shape[-2] == 100
    _, be1, _ = decode("quest", ids, 80, budget=48, dense_layers=1, stats=True)
    assert set(be1.runtime.visits) == {1}  # layer 0 keeps exact attention


def prefill_state(pol, k, valid=None):
    b, hkv, n, _ = k.shape
    pos = torch.arange(n).expand(b, hkv, n)
    if valid is not None:
        pos = torch.where(valid, pos, -1)
    _, extra = pol.select(SITE, None, k, k, pos, torch.arange(n).expand(b, n), None)
    return LayerState(pos=pos, seen=n, extra=extra)


def hand_bounds(k, valid, pages):
    """[B, H_kv, pages, D] min / max over each page's valid keys (0 where a page has none), by loops."""
    b, hkv, _, d = k.shape
    kmin, kmax = torch.zeros(b, hkv, pages, d, dtype=k.dtype), torch.zeros(b, hkv, pages, d, dtype=k.dtype)
    live = torch.zeros(b, hkv, pages, dtype=torch.bool)
    for bi in range(b):
        for g in range(hkv):
            for p in range(pages):
                rows = k[bi, g, p * PAGE : (p + 1) * PAGE][valid[bi, g, p * PAGE : (p + 1) * PAGE]]
                if len(rows):
                    kmin[bi, g, p], kmax[bi, g, p], live[bi, g, p] = rows.min(0).values, rows.max(0).values, True
    return kmin, kmax, live


def test_selected_pages_are_the_top_k_by_bound():
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, d, n = 2, 6, 2, 8, 150
    pol = make_policy("quest", budget=64)  # top 4 pages + the current one
    k = torch.randn(b, hkv, n, d, generator=gen)
    k[0, 1, 40:56] *= 4  # make a few pages stand out
    q = torch.randn(b, h, 1, d, generator=gen)
    state = prefill_state(pol, k[:, :, :-1])
    got = pol.page_map(SITE, q, k, state)
    assert got.shape == (b, hkv, 5) and got.dtype == torch.int32
    cur = (n - 1) // PAGE
    kmin, kmax, _ = hand_bounds(k, torch.ones(b, hkv, n, dtype=torch.bool), cur)
    for bi in range(b):
        for g in range(hkv):
            ub = []
            for p in range(cur):
                per_head = [
                    sum(
                        max(float(q[bi, hh, 0, e] * kmax[bi, g, p, e]), float(q[bi, hh, 0, e] * kmin[bi, g, p, e]))
                        for e in range(d)
                    )
                    for hh in range(g * 3, g * 3 + 3)
                ]
                ub.append(max(per_head))
            top = sorted(range(cur), key=lambda p: -ub[p])[:4]
            assert got[bi, g].tolist() == sorted(top + [cur])
    assert pol.page_map(SITE, q, k, state).tolist() == got.tolist()  # a replay selects the same


def test_pages_without_valid_keys_are_never_selected():
    """A row that is mostly left padding: pages holding only padding are not candidates (-1 instead)."""
    b, hkv, n, d = 1, 1, 97, 4
    k = torch.randn(b, hkv, n, d, generator=torch.Generator().manual_seed(3))
    valid = torch.arange(n - 1) >= 70  # 70 padding entries: pages 0-3 empty
    pol = make_policy("quest", budget=64)  # top 4 of pages 0-5
    state = prefill_state(pol, k[:, :, :-1], valid.expand(b, hkv, n - 1))
    got = pol.page_map(SITE, torch.randn(b, 2, 1, d), k, state)[0, 0].tolist()
    assert got == [4, 5, 6, -1, -1]


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 50),
    pad=st.integers(0, 30),
    chunks=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    b=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_bounds_are_min_max_of_each_page(seed, n, pad, chunks, b, dtype):
    """Prompt (with left padding), then appends of 1-20 tokens: the kept bounds equal the page-wise
    min / max of the valid keys, bound every key, and covering the same entries again is a no-op."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 4
    total = n + sum(chunks)
    k = (torch.randn(b, hkv, total, d, generator=gen) * 3).to(dtype)
    valid = torch.ones(b, hkv, total, dtype=torch.bool)
    valid[-1, :, : min(pad, n - 1)] = False  # the last row is left-padded
    st_ = extend_bounds({}, k[:, :, :n], valid[:, :, :n])
    length = n
    for c in chunks:
        length += c
        st_ = extend_bounds(st_, k[:, :, :length], valid[:, :, :length] if c > 1 else None)
        before = {key: val.clone() for key, val in st_.items() if isinstance(val, torch.Tensor)}
        extend_bounds(st_, k[:, :, :length])  # replay
        assert all(torch.equal(before[key], st_[key]) for key in before)
        pages = -(-length // PAGE)
        kmin, kmax, live = hand_bounds(k[:, :, :length], valid[:, :, :length], pages)
        assert torch.equal(st_["live"][:, :, :pages], live) and st_["n"] == length
        assert torch.equal(st_["kmin"][:, :, :pages], kmin) and torch.equal(st_["kmax"][:, :, :pages], kmax)
        keys = torch.nn.functional.pad(k[:, :, :length], (0, 0, 0, pages * PAGE - length)).view(b, hkv, pages, PAGE, d)
        ok = torch.nn.functional.pad(valid[:, :, :length], (0, pages * PAGE - length)).view(b, hkv, pages, PAGE, 1)
        assert bool(((keys >= st_["kmin"][:, :, :pages, None]) | ~ok).all())
        assert bool(((keys <= st_["kmax"][:, :, :pages, None]) | ~ok).all())


def test_opcheck_page_select():
    be = kvpass.backend("quest", compiler="eager", budget=48, dense_layers=0)
    rt = be.runtime
    rt.sites[0] = SITE
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 90, 8, generator=gen)
    rt.state.layers[0] = prefill_state(be.policy, k[:, :, :-1])
    q = torch.randn(1, 4, 1, 8, generator=gen)
    out = torch.ops.kvpass.page_select(q, k, rt.handle, 0)
    assert out.shape == (1, 2, 4) and (out[..., -1] == 5).all()
    torch.library.opcheck(torch.ops.kvpass.page_select.default, (q, k, rt.handle, 0))


def test_configuration_errors():
    with pytest.raises(ConfigError, match="'budget' must be a multiple of 16"):
        make_policy("quest", budget=40)
    with pytest.raises(ConfigError, match="'budget'"):
        make_policy("quest", budget=8)
    with pytest.raises(ConfigError, match="'dense_layers'"):
        make_policy("quest", dense_layers=-1)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 3),
    pages=st.sampled_from([1, 3, 16, 17, 40, 130, 600]),
    top=st.sampled_from([0, 1, 3, 16, 40, 200]),
    values=st.sampled_from(["normal", "ties", "wide"]),
    holes=st.floats(0.0, 1.0),
    nan=st.booleans(),
    block=st.sampled_from([16, 128, 2048]),
)
def test_top_pages_kernel_equals_reference(seed, rows, pages, top, values, holes, nan, block):
    """``kvpass::top_pages``' selection kernel (Triton interpreter) equals ``top_pages_reference``: the
    ``top`` best pages ascending, -1 padded, ties to the lower index (few distinct values force ties at
    the cut, across the kernel's blocks of pages), ``-inf`` and NaN never chosen, fewer eligible pages than
    ``top``, negative scores, zeros of both signs; the reference itself agrees with a selection by hand."""
    from kvpass.kernels.top_pages import top_pages_reference, top_pages_triton

    gen = torch.Generator().manual_seed(seed)
    if values == "ties":
        ub = (
            torch.randint(-2, 3, (rows, pages), generator=gen).float() * torch.tensor([1.0, -0.0]).repeat(pages)[:pages]
        )
    elif values == "wide":
        ub = torch.randn(rows, pages, generator=gen) * 10.0 ** torch.randint(-30, 30, (rows, pages), generator=gen)
    else:
        ub = torch.randn(rows, pages, generator=gen)
    ub[torch.rand(rows, pages, generator=gen) < holes] = float("-inf")
    if nan:
        ub[:, ::5] = float("nan")
    ref = top_pages_reference(ub, top)
    for r in range(rows):  # by hand: best first, ties by index, eligible only
        ok = [p for p in range(pages) if ub[r, p] > float("-inf")]
        best = sorted(sorted(ok, key=lambda p: -float(ub[r, p]))[:top])  # sorted() is stable
        assert ref[r].tolist() == best + [-1] * (top - len(best))
    got = top_pages_triton(ub, top, block=block)  # rows over several blocks too (pages > block)
    assert got.dtype == torch.int32 and torch.equal(got, ref)


def test_page_select_finds_its_pager_by_the_contracts_protocol():
    """``kvpass::page_select`` asks the policy, or the member of a composition, that brings ``PagePolicy``
    (kvpass.policies.contract); a policy without it is refused by name."""
    from kvpass.policies import make_policy
    from kvpass.policies.contract import PagePolicy
    from kvpass.policies.pages.ops import _pager

    quest = make_policy("quest", budget=64)
    assert isinstance(quest, PagePolicy) and not isinstance(make_policy("snapkv"), PagePolicy)
    assert _pager(quest) is quest  # a single policy is its own pager (its members are empty)
    composed = make_policy("quest+art", budget=64)
    assert isinstance(_pager(composed), type(quest))
    with pytest.raises(RuntimeError, match="policy 'snapkv' selects no pages"):
        _pager(make_policy("snapkv"))
