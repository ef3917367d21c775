"""The package's layering: no module imports from a layer above its own, and no import cycle.

Layers, lowest first (``docs/ARCHITECTURE.md``): errors and the core kernels; the cache and runtime state; the
core operators; policies (the contract, the registry, each policy with its family's operators and kernels);
the compiler pass; the generation runtime and chunk fusion's driver; evaluation; the CLI and the public API
(nothing in the compiler pass imports the generation runtime that runs what it compiled). Imports inside functions
count too: a lazy import that hides an upward edge is still one.
"""

from __future__ import annotations

import ast
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[1] / "kvpass"

LAYERS = [  # (prefix, layer); the longest matching prefix decides
    ("kvpass.errors", 0), ("kvpass.operators", 0), ("kvpass.kernels", 0),
    ("kvpass.cache", 1),
    ("kvpass.ops", 2),
    ("kvpass.policies", 3),
    ("kvpass.compiler", 4),
    ("kvpass.chunks", 5), ("kvpass.generate", 5),
    ("kvpass.eval", 6),
    ("kvpass.cli", 7), ("kvpass", 7),
]


def layer(module: str) -> int:
    for prefix, n in sorted(LAYERS, key=lambda p: -len(p[0])):
        if module == prefix or module.startswith(prefix + "."):
            return n
    raise AssertionError(f"{module} is in no layer")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: pathlib.Path, known) -> set[str]:
    """The kvpass modules ``name`` imports (``from a import b`` counts ``a.b`` when that is a module), with the
    packages above each (importing ``kvpass.a.b`` runs ``kvpass/a/__init__.py`` first; the root package, the
    public API, excepted)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("kvpass"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            found.update(subs or [node.module])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvpass"))
    found |= {".".join(m.split(".")[:i]) for m in found for i in range(2, m.count(".") + 1)}
    return {m for m in found if m != name and not name.startswith(m + ".")}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, mods) for name, path in mods.items()}


def test_no_import_reaches_a_higher_layer():
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
           for m, targets in sorted(graph().items()) for t in sorted(targets) if layer(t) > layer(m)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    g = graph()
    # the registry (kvpass.policies) and the public API import their members; an edge from a package to its
    # own submodules is how a package is assembled, not a cycle
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_every_subpackage_says_what_it_is():
    for p in PKG.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(p.read_text()))
        assert doc and len(doc) > 40 and "TODO" not in doc, f"{p.relative_to(PKG.parent)} needs a module docstring"


def operators() -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(op -> module defining it, module -> ops it calls)``: an op is defined by ``custom_op`` / ``triton_op``
    on ``"kvpass::name"`` and called as ``torch.ops.kvpass.name`` (or through an alias ``X = torch.ops.kvpass``)."""
    defined, called = {}, {}
    for name, path in modules().items():
        src = path.read_text()
        for op in re.findall(r'(?:custom_op|triton_op)\(\s*"kvpass::(\w+)"', src):
            assert op not in defined, f"kvpass::{op} is defined in {defined[op]} and in {name}"
            defined[op] = name
        aliases = re.findall(r"^\s*(\w+)\s*=\s*torch\.ops\.kvpass\s*$", src, re.M)
        uses = set(re.findall(r"torch\.ops\.kvpass\.(\w+)", src))
        for alias in aliases:
            uses |= set(re.findall(rf"\b{alias}\.(\w+)", src))
        called[name] = uses
    return defined, called


def test_no_operator_call_reaches_a_higher_layer():
    """Calling ``torch.ops.kvpass.x`` depends on the module that defines ``x`` as much as an import does, but
    no import shows it: a lower layer calling (or a graph pass emitting) an operator a higher layer defines
    is an upward edge all the same."""
    defined, called = operators()
    assert len(defined) > 30, sorted(defined)   # the scan sees the operators (36 when written)
    unknown = {f"{m}: {op}" for m, ops in called.items() for op in ops
               if op not in defined and op not in ("default",)}
    assert not unknown, f"calls of operators no module defines: {sorted(unknown)}"
    bad = [f"{m} (layer {layer(m)}) calls kvpass::{op}, defined in {defined[op]} (layer {layer(defined[op])})"
           for m, ops in sorted(called.items()) for op in sorted(ops) if layer(defined[op]) > layer(m)]
    assert not bad, "\n".join(bad)


POLICY_HOLDERS = {"policy", "pol", "member", "evictor", "active"}   # how the compiler, cache and driver name one


def policy_reads(path: pathlib.Path) -> set[tuple[str, int]]:
    """``(attribute, line)`` of every attribute read or written on a policy object in ``path``: ``policy.x``,
    ``self.policy.x``, ``getattr(policy, "x")`` (the names in ``POLICY_HOLDERS``)."""
    def holds_policy(node) -> bool:
        return (isinstance(node, ast.Name) and node.id in POLICY_HOLDERS
                or isinstance(node, ast.Attribute) and node.attr in POLICY_HOLDERS)

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and holds_policy(node.value):
            found.add((node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and holds_policy(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            found.add((node.args[1].value, node.lineno))
    return found


def declared_policy_names() -> set[str]:
    """What the contract declares of a policy: the ``Policy`` base's public names and every family protocol's."""
    from kvpass.policies import contract

    names = {n for n in dir(contract.Policy) if not n.startswith("_")}
    for proto in (contract.GatedPolicy, contract.PagePolicy, contract.FusionPolicy):
        names |= set(proto.__annotations__) | {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return names


def test_the_compiler_reads_policies_only_through_the_contract():
    """The compiler, the cache and chunk fusion's driver read of a policy only what the contract declares (the
    base class and the family protocols), never an attribute they hope a policy has."""
    declared = declared_policy_names()
    assert {"select", "budget", "page_map", "recompute"} <= declared
    bad, seen = [], 0
    for package in ("compiler", "cache", "chunks"):
        for path in sorted((PKG / package).rglob("*.py")):
            reads = policy_reads(path)
            seen += len(reads)
            bad += [f"{path.relative_to(PKG.parent)}:{line}: policy.{name}" for name, line in sorted(reads)
                    if name not in declared]
    assert seen > 40, seen   # the scan sees the reads (72 when written)
    assert not bad, "read of a policy attribute no contract protocol declares:\n" + "\n".join(bad)


def test_the_policy_read_scan_sees_an_undeclared_read(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(self, policy):\n    return policy.budget + self.policy.hoped_for + getattr(policy, 'also')\n")
    assert {n for n, _ in policy_reads(src)} - declared_policy_names() == {"hoped_for", "also"}
