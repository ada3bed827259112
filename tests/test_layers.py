"""The import graph of the product's packages: no circles, and no arrow from a lower layer up.

Every import counts, at module level, inside a function or under TYPE_CHECKING: a circle a type
checker needs is a circle a reader has to hold in their head all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chameleond",)

# What each layer must not import (by module prefix): data flows down, from the edges to the core.
DAEMON, STATE, CLI, SIM, HANDLERS, WORKER = (
    "chameleond.daemon",
    "chameleond.jobstate",
    "chameleond.cli",
    "chameleond.sim",
    "chameleond.handlers",
    "chameleond.worker",
)
# The benchmarks sit above everything they drive (the cli, the local cluster, the daemon, the
# worker): no module outside them imports them. `chameleonctl bench` reaches them through its
# command table, a module name loaded on demand, not an import.
BENCH = "chameleond.bench"
FORBIDDEN = {
    "chameleond.core": (DAEMON, STATE, CLI, SIM, "chameleond.local", HANDLERS, WORKER),
    "chameleond.events": (DAEMON, STATE, CLI, HANDLERS),
    "chameleond.protocol": (DAEMON, STATE, CLI, HANDLERS),
    "chameleond.streams": (DAEMON, STATE, CLI, SIM, HANDLERS, WORKER, "chameleond.local"),
    "chameleond.jobstate": (DAEMON, CLI, SIM, HANDLERS, WORKER),
    HANDLERS: (DAEMON, CLI, SIM, WORKER),
    "chameleond.sim": (DAEMON, CLI, HANDLERS),
    DAEMON: (CLI, WORKER, "chameleond.local"),
    WORKER: (DAEMON, STATE, CLI, HANDLERS),
}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project's modules `module` imports, anywhere in its text."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                yield name


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: set(imported(m, p, known)) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_cycles() -> None:
    assert cycles(graph()) == set()


def test_no_arrow_from_a_lower_layer_up() -> None:
    wrong = sorted(
        f"{m} imports {t}"
        for m, targets in graph().items()
        for layer, banned in FORBIDDEN.items()
        if within(m, layer)
        for t in targets
        if any(within(t, b) for b in banned)
    )
    assert wrong == []


def test_nothing_in_the_product_imports_the_benchmarks() -> None:
    wrong = sorted(
        f"{m} imports {t}"
        for m, targets in graph().items()
        if not within(m, BENCH)
        for t in targets
        if within(t, BENCH)
    )
    assert wrong == []
    # The one way in: `chameleonctl bench` names the package (ctl.py dispatches by module name).
    ctl = ast.parse((ROOT / "chameleond" / "cli" / "ctl.py").read_text())
    named = {n.value for n in ast.walk(ctl) if isinstance(n, ast.Constant)}
    assert BENCH in named


def test_the_walk_sees_the_imports() -> None:
    """The checks above are only as good as the graph: it holds the arrows we know are there."""
    g = graph()
    assert "chameleond.daemon.dispatch" in g["chameleond.daemon.ingest"]
    assert {"chameleond.jobstate.job", "chameleond.events"} <= g["chameleond.handlers.fault"]
    assert "chameleond.events" in g["chameleond.protocol"]
    assert {"chameleond.bench.cluster", "chameleond.local.cluster"} <= g[
        "chameleond.bench.recovery"
    ]
    assert "chameleond.cli.up" in g["chameleond.bench.training"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == {frozenset({"a", "b"})}
