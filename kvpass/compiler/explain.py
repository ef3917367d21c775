"""``kvpass.explain``: what the pass finds in a model and what a policy would do there."""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLUMNS = ("layer", "attention", "kind", "heads", "kv_heads", "head_dim", "scale", "softcap", "cache",
           "rope", "positions", "residual", "plan")


@dataclass
class Explanation:
    """Structured result: one row per attention site of each compiled graph, plus problems."""

    policy: str
    graphs: list  # list[GraphReport]

    @property
    def rows(self) -> list[dict]:
        """Rows of the first graph that has attention sites (the forward that was explained)."""
        for g in self.graphs:
            if g.sites:
                return [dict(r, plan=g.plans.get(r["layer"], "unchanged")) for r in g.sites]
        return []

    @property
    def problems(self) -> list[str]:
        return [p for g in self.graphs for p in g.problems]

    def table(self) -> str:
        rows = [[str(r.get(c, "")) for c in COLUMNS] for r in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(COLUMNS)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*COLUMNS), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in rows]
        lines.append(f"policy: {self.policy}; sites: {len(self.rows)}")
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"Explanation(policy={self.policy!r}, sites={len(self.rows)}, problems={len(self.problems)})"


def explain(model, example_inputs, policy="full", *, verbose: bool = True, **params) -> Explanation:
    """Trace ``model`` on ``example_inputs`` and report every attention site and the policy's plan.

    ``example_inputs`` is a dict of keyword arguments (``{"input_ids": ids}``), a tuple of positional
    arguments, or a single tensor. The model runs once, under ``torch.no_grad``; it is not modified.
    Prints the table when ``verbose``; returns an ``Explanation`` either way.
    """
    from kvpass.compiler.backend import Backend

    be = Backend(policy, compiler="eager", **params)
    fn = model.forward if hasattr(model, "forward") else model
    compiled = torch.compile(fn, backend=be)
    # Every explain adds a cache entry to the model's (shared) code objects; don't let a session of
    # explains hit Dynamo's recompile limit and silently fall back to eager.
    limit = max(torch._dynamo.config.recompile_limit, 64)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit):
        if isinstance(example_inputs, dict):
            compiled(**example_inputs)
        elif isinstance(example_inputs, (tuple, list)):
            compiled(*example_inputs)
        else:
            compiled(example_inputs)
    result = Explanation(policy=repr(be.policy), graphs=be.reports)
    if verbose:
        print(result.table())
    return result
