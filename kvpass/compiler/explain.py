"""``kvpass.explain``: what the pass finds in a model and what a policy would do there."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

COLUMNS = (
    "layer",
    "attention",
    "kind",
    "heads",
    "kv_heads",
    "head_dim",
    "scale",
    "softcap",
    "cache",
    "rope",
    "positions",
    "residual",
    "plan",
)


# What str(Explanation) and `kvpass explain` print: the per-layer columns, layers grouped.
GROUPED_COLUMNS = ("layers",) + COLUMNS[1:]

LEGEND = [
    "legend:",
    "  layers     layer indices in graph order; a range (0-29) groups consecutive layers with identical rows",
    "  attention  sdpa (F.scaled_dot_product_attention), eager (softmax(q @ k^T) @ v) or flash (left as is)",
    "  kind       global: attends to every earlier token; sliding(W): to the last W tokens only",
    "  heads, kv_heads, head_dim: query heads, key/value heads (fewer: grouped-query), size of a head",
    "  scale, softcap: factor on q @ k^T before the softmax; c of the logit cap c*tanh(s/c) (0.0: none)",
    "  cache      the KV cache the model updates: dynamic (DynamicCache), static (StaticCache), slot",
    "             (kvpass.SlotCache) or none",
    "  rope       RoPE source: the graph node of the cos that rotates the new keys (same name: same rotary",
    "             embedding)",
    "  positions  the graph node of the integer position ids behind that RoPE (kvpass keeps them right",
    "             when a policy evicts or gathers tokens)",
    "  residual   found: the residual add after the attention was located (gated policies cut the graph",
    "             there)",
    "  plan       what the policy does at this layer (unchanged: the model's own attention and cache)",
    "  -: not found. Node names are those of the traced FX graph; Explanation.rows has every layer's values.",
]


def _cell(row: dict, column: str) -> str:
    value = row.get(column)
    if column == "kind" and row.get("sliding_window"):
        return f"sliding({row['sliding_window']})"
    if column == "residual":
        return "found" if value is not None else "-"
    if column in ("rope", "positions") and value is None:
        return "-"
    return str(value if value is not None else "")


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _grouped(rows: list[dict]) -> list[list[str]]:
    """Rows of GROUPED_COLUMNS: runs of consecutive layers with identical cells share one row."""
    out: list[list[str]] = []
    run: tuple | None = None  # (first layer, last layer, cells)
    for r in rows:
        cells = [_cell(r, c) for c in COLUMNS[1:]]
        layer = r.get("layer")
        if (
            run is not None
            and cells == run[2]
            and isinstance(layer, int)
            and isinstance(run[1], int)
            and layer == run[1] + 1
        ):
            run = (run[0], layer, cells)
            continue
        if run is not None:
            out.append([_span(run[0], run[1])] + run[2])
        run = (layer, layer, cells)
    if run is not None:
        out.append([_span(run[0], run[1])] + run[2])
    return out


@dataclass
class Explanation:
    """Structured result: one row per attention site of each compiled graph, plus problems."""

    policy: str
    graphs: list  # list[GraphReport]
    # a per-head policy (kvpass.cache.ragged): layer -> entries each KV head kept after the explained prefill (row 0)
    head_budgets: dict = field(default_factory=dict)

    @property
    def rows(self) -> list[dict]:
        """Rows of the first graph that has attention sites (the forward that was explained)."""
        for g in self.graphs:
            if g.sites:
                return [dict(r, plan=g.plans.get(r["layer"], "unchanged")) for r in g.sites]
        return []

    @property
    def tensor_parallel(self) -> str:
        """The rank's share of the heads when the model is split by tensor parallelism, else ''."""
        return next((g.tp for g in self.graphs if g.tp), "")

    @property
    def reductions(self) -> list[str]:
        """The collectives kvpass inserted for decisions that span a layer's heads (tensor parallelism)."""
        return [r for g in self.graphs for r in g.reductions]

    @property
    def problems(self) -> list[str]:
        return [p for g in self.graphs for p in g.problems]

    def table(self, grouped: bool = False, legend: bool = False) -> str:
        """The table as text. By default one row per layer with the raw values (FX node names for
        ``rope``, ``positions`` and ``residual``). ``grouped``: consecutive layers whose rows are
        identical apart from the layer index share one row ("0-29"), ``residual`` reads "found"
        (its node name differs in every layer) and a sliding ``kind`` shows its window.
        ``legend``: a few lines under the table saying what each column means. ``str()`` and
        ``kvpass.explain(verbose=True)`` give the grouped table with its legend."""
        if grouped:
            columns, rows = GROUPED_COLUMNS, _grouped(self.rows)
        else:
            columns, rows = COLUMNS, [[str(r.get(c, "")) for c in COLUMNS] for r in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*columns), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in rows]
        if grouped:  # no trailing blanks after the last (plan) column
            lines = [line.rstrip() for line in lines]
        lines.append(f"policy: {self.policy}; sites: {len(self.rows)}")
        if self.tensor_parallel:
            lines.append(f"{self.tensor_parallel} (heads and kv_heads above are this rank's)")
            lines.append(
                "reductions: " + ("; ".join(self.reductions) or "none (every decision of this policy is per KV head)")
            )
        if self.head_budgets:
            lines.append(
                "kept per KV head after this prefill (row 0): "
                + "; ".join(f"layer {i}: {' '.join(map(str, n))}" for i, n in sorted(self.head_budgets.items()))
            )
        lines += [f"problem: {p}" for p in self.problems]
        if legend:
            lines += LEGEND
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table(grouped=True, legend=True)

    def __repr__(self) -> str:
        return f"Explanation(policy={self.policy!r}, sites={len(self.rows)}, problems={len(self.problems)})"


def explain(model, example_inputs, policy="full", *, verbose: bool = True, **params) -> Explanation:
    """Trace ``model`` on ``example_inputs`` and report every attention site and the policy's plan.

    ``example_inputs`` is a dict of keyword arguments (``{"input_ids": ids}``), a tuple of positional
    arguments, or a single tensor. The model runs once, under ``torch.no_grad``; it is not modified.
    Prints the table (consecutive identical layers grouped, with a legend of the columns) when
    ``verbose``; returns an ``Explanation`` either way.
    """
    from kvpass.compiler.backend import Backend

    be = Backend(policy, compiler="eager", **params)
    fn = model.forward if hasattr(model, "forward") else model
    compiled = torch.compile(fn, backend=be)
    # Every explain adds a cache entry to the model's (shared) code objects; don't let many explains of one
    # model hit Dynamo's recompile limit and silently fall back to eager.
    limit = max(torch._dynamo.config.recompile_limit, 64)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit):
        if isinstance(example_inputs, dict):
            compiled(**example_inputs)
        elif isinstance(example_inputs, (tuple, list)):
            compiled(*example_inputs)
        else:
            compiled(example_inputs)
    from kvpass.cache.ragged import LENGTH

    heads = {i: st.extra["heads"][0, :, LENGTH].tolist() for i, st in be.state.layers.items() if "heads" in st.extra}
    result = Explanation(policy=repr(be.policy), graphs=be.reports, head_budgets=heads)
    if verbose:
        print(result)
    return result
