"""The package's layering: no module imports from a layer above its own, and no import cycle.

Layers, lowest first (``docs/ARCHITECTURE.md``): errors, the operator registry, the core kernels and the
process-wide torch settings; the cache and runtime state; the core operators; policies (the contract, the
registry, each policy with its family's operators and kernels); the compiler pass; the generation runtime and
chunk fusion's driver; evaluation; the CLI and the public API (nothing in the compiler pass imports the generation
runtime that runs what it compiled). Imports inside functions count too: a lazy import that hides an upward edge
is still one.

Two rules on state: a policy, runtime or generation state is read by the attributes its class declares (no
``getattr`` with a default), and every module-level container a function fills is listed here with what it is.
"""

from __future__ import annotations

import ast
import pathlib
import re

PKG = pathlib.Path(__file__).resolve().parents[1] / "kvpass"

LAYERS = [  # (prefix, layer); the longest matching prefix decides
    ("kvpass.errors", 0),
    ("kvpass.op_registry", 0),
    ("kvpass.kernels", 0),
    ("kvpass.settings", 0),
    ("kvpass.cache", 1),
    ("kvpass.ops", 2),
    ("kvpass.policies", 3),
    ("kvpass.compiler", 4),
    ("kvpass.chunks", 5),
    ("kvpass.generate", 5),
    ("kvpass.eval", 6),
    ("kvpass.cli", 7),
    ("kvpass", 7),
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
    bad = [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in sorted(graph().items())
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
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
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t) :] + [t]))
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
    assert len(defined) > 30, sorted(defined)  # the scan sees the operators (36 when written)
    unknown = {f"{m}: {op}" for m, ops in called.items() for op in ops if op not in defined and op not in ("default",)}
    assert not unknown, f"calls of operators no module defines: {sorted(unknown)}"
    bad = [
        f"{m} (layer {layer(m)}) calls kvpass::{op}, defined in {defined[op]} (layer {layer(defined[op])})"
        for m, ops in sorted(called.items())
        for op in sorted(ops)
        if layer(defined[op]) > layer(m)
    ]
    assert not bad, "\n".join(bad)


POLICY_HOLDERS = {"policy", "pol", "member", "evictor", "active"}  # how the compiler, cache and driver name one


def policy_reads(path: pathlib.Path) -> set[tuple[str, int]]:
    """``(attribute, line)`` of every attribute read or written on a policy object in ``path``: ``policy.x``,
    ``self.policy.x``, ``getattr(policy, "x")`` (the names in ``POLICY_HOLDERS``)."""

    def holds_policy(node) -> bool:
        return (
            isinstance(node, ast.Name)
            and node.id in POLICY_HOLDERS
            or isinstance(node, ast.Attribute)
            and node.attr in POLICY_HOLDERS
        )

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and holds_policy(node.value):
            found.add((node.attr, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and holds_policy(node.args[0])
            and isinstance(node.args[1], ast.Constant)
        ):
            found.add((node.args[1].value, node.lineno))
    return found


def declared_policy_names() -> set[str]:
    """What the contract declares of a policy: the ``Policy`` base's public names and every family protocol's."""
    from kvpass.policies import contract

    names = {n for n in dir(contract.Policy) if not n.startswith("_")}
    for proto in (contract.GatedPolicy, contract.PagePolicy, contract.FusionPolicy, contract.ReconstructPolicy):
        methods = {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
        names |= set(proto.__annotations__) | methods
    return names


def test_the_compiler_reads_policies_only_through_the_contract():
    """The compiler, the cache, chunk fusion's driver and the generation runtime read of a policy only what the
    contract declares (the base class and the family protocols), never an attribute they hope a policy has."""
    declared = declared_policy_names()
    assert {"select", "budget", "page_map", "recompute"} <= declared
    bad, seen = [], 0
    for package in ("compiler", "cache", "chunks", "generate"):
        for path in sorted((PKG / package).rglob("*.py")):
            reads = policy_reads(path)
            seen += len(reads)
            bad += [
                f"{path.relative_to(PKG.parent)}:{line}: policy.{name}"
                for name, line in sorted(reads)
                if name not in declared
            ]
    assert seen > 40, seen  # the scan sees the reads (72 when written)
    assert not bad, "read of a policy attribute no contract protocol declares:\n" + "\n".join(bad)


def test_the_policy_read_scan_sees_an_undeclared_read(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(self, policy):\n    return policy.budget + self.policy.hoped_for + getattr(policy, 'also')\n")
    assert {n for n, _ in policy_reads(src)} - declared_policy_names() == {"hoped_for", "also"}


STATE_HOLDERS = POLICY_HOLDERS | {"rt", "runtime", "state", "st", "layer_state", "lay"}
# how the code names a policy, a Runtime, a GenerationState, a LayerState and a SlotCache layer. Not ``cache`` and
# not ``layer``: those hold the model's transformers cache and its layers (any Cache, or None), read with defaults


def defaulted_reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, call)`` of every ``getattr(x, "name", default)`` in ``path`` whose ``x`` is a policy, a runtime or
    a generation state: a name in ``STATE_HOLDERS`` (``x`` or ``y.x``) or a handle's runtime (``runtime.get(h)``)."""

    def holds_state(node) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return isinstance(node.func.value, ast.Name) and node.func.value.id in ("runtime", "_runtime")
        return (
            isinstance(node, ast.Name)
            and node.id in STATE_HOLDERS
            or isinstance(node, ast.Attribute)
            and node.attr in STATE_HOLDERS
        )

    return sorted(
        (node.lineno, ast.unparse(node))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
        and holds_state(node.args[0])
        and isinstance(node.args[1], ast.Constant)
    )


def test_policy_runtime_and_state_attributes_are_declared():
    """An attribute of a policy, a runtime or a generation state that another module sets or reads is declared
    on its class (a default in ``__init__`` or a class attribute) and read plainly: ``getattr(rt, "gate", None)``
    hides who sets it, and a misspelt name reads as the default."""
    bad = [
        f"{path.relative_to(PKG.parent)}:{line}: {call}"
        for path in sorted(PKG.rglob("*.py"))
        for line, call in defaulted_reads(path)
    ]
    assert not bad, "getattr with a default on a kvpass object; declare the attribute on its class:\n" + "\n".join(bad)


def test_the_defaulted_read_scan_sees_one(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f(self, rt, handle, model):\n"
        "    return (getattr(rt, 'gate', None), getattr(self.policy, 'x', 0), getattr(_runtime.get(handle), "
        "'y', 1),\n            getattr(model.config, 'z', None), getattr(rt, 'gate'))\n"
    )
    assert {call for _, call in defaulted_reads(src)} == {
        "getattr(rt, 'gate', None)",
        "getattr(self.policy, 'x', 0)",
        "getattr(_runtime.get(handle), 'y', 1)",
    }


MUTABLE_GLOBALS = {  # module-level containers a function changes, "module.NAME": what each one is
    "kvpass.cache.runtime._RUNTIMES": (
        "the backend handle table operators read (handle -> Runtime): to be replaced by state passed as arguments"
    ),
    "kvpass.op_registry.OPS": "the registry of kvpass operators by name, filled as each operator module is imported",
    "kvpass.errors._WARNED": "warn_once's record of the warnings given, per owner and message",
    "kvpass.policies.prefill.punctuation._CACHE": "a cache: punctuation token ids per tokenizer (weak keys)",
    "kvpass.eval.tasks._core._UNIT_CACHE": "a cache: a corpus's tokenized units per tokenizer",
    "kvpass.eval.model_cache._hash_roots": "the model-cache roots in use (using_root's stack), where hashes are kept",
}

CONTAINERS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}
MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "extend", "insert", "remove", "discard", "clear"}


def module_containers(tree: ast.Module) -> dict[str, int]:
    """``name -> line`` of each module-level assignment of a mutable container (a literal or a constructor call)."""

    def container(value) -> bool:
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            return True
        f = value.func if isinstance(value, ast.Call) else None
        return isinstance(f, ast.Name) and f.id in CONTAINERS or isinstance(f, ast.Attribute) and f.attr in CONTAINERS

    found, todo = {}, list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):  # module level still, inside a block
            todo += [s for field in ("body", "orelse", "finalbody") for s in getattr(stmt, field, [])]
            todo += [s for h in getattr(stmt, "handlers", []) for s in h.body]
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and container(stmt.value):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            found.update({t.id: stmt.lineno for t in targets if isinstance(t, ast.Name)})
    return found


def shown(path: pathlib.Path) -> pathlib.Path:
    return path.relative_to(PKG.parent) if path.is_relative_to(PKG.parent) else path


def mutated_globals(mods: dict[str, pathlib.Path]) -> dict[str, str]:
    """``"module.NAME" -> "file:line"`` of each module-level container that a function mutates: an item assigned
    or deleted (``X[k] = v``), or a mutating method (``X.append``, ``.add``, ``.update``, ``.setdefault``,
    ``.pop``, ...), on ``X`` in its own module or on ``alias.X`` where ``alias`` names its module."""
    trees = {name: ast.parse(path.read_text()) for name, path in mods.items()}
    containers = {name: module_containers(tree) for name, tree in trees.items()}
    found = {}
    for name, tree in trees.items():
        aliases = {}  # local name -> the module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname})

        def owner(expr) -> str | None:
            while isinstance(expr, ast.Subscript):  # X[k][j] = v changes X's contents too
                expr = expr.value
            if isinstance(expr, ast.Name) and expr.id in containers[name]:
                return f"{name}.{expr.id}"
            if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                module = aliases.get(expr.value.id)
                if expr.attr in containers.get(module, ()):
                    return f"{module}.{expr.attr}"
            return None

        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                changed = []
                if isinstance(node, (ast.Assign, ast.Delete)):
                    changed = [t.value for t in node.targets if isinstance(t, ast.Subscript)]
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Subscript):
                    changed = [node.target.value]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    changed = [node.func.value]
                for expr in changed:
                    if (key := owner(expr)) is not None:
                        found.setdefault(key, f"{shown(mods[name])}:{node.lineno}")
    return found


def test_every_module_level_registry_is_listed():
    """A module-level container that functions fill is state shared by the whole process (two backends, two
    models, two threads): an operator that reads one depends on more than its arguments. Each one is listed in
    ``MUTABLE_GLOBALS`` with what it is; a new one fails here until it is listed and said why."""
    found = mutated_globals(modules())
    new = [f"{where}: {name}" for name, where in sorted(found.items()) if name not in MUTABLE_GLOBALS]
    gone = sorted(set(MUTABLE_GLOBALS) - set(found))
    assert not new, "module-level containers a function mutates, not in MUTABLE_GLOBALS:\n" + "\n".join(new)
    assert not gone, f"listed in MUTABLE_GLOBALS but no longer mutated by a function (drop them): {gone}"


def test_the_registry_scan_sees_one(tmp_path):
    (tmp_path / "a.py").write_text(
        "SEEN = {}\nFIXED = {'x': 1}\nLATER = []\nLATER.append(1)\ndef f(k):\n    SEEN[k] = FIXED[k]\n"
    )
    (tmp_path / "b.py").write_text("from pkg import a as _a\ndef g(k):\n    _a.LATER.append(k)\n    _a.FIXED.get(k)\n")
    found = mutated_globals({"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"})
    assert sorted(found) == ["pkg.a.LATER", "pkg.a.SEEN"]
