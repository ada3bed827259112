"""The import graph of the product's packages against docs/architecture.md's layer table: no
circles, no arrow from a lower layer up or across a row, and no module the table does not place.

Every import counts, at module level, inside a function or under TYPE_CHECKING: a circle a type
checker needs is a circle a reader has to hold in their head all the same.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("chameleond",)
BENCH = "chameleond.bench"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MARK = "<!-- layers: read by tests/test_layers.py -->"


def layers() -> list[tuple[str, ...]]:
    """docs/architecture.md's layer table, top to bottom: each row's entries (module names or
    package prefixes)."""
    lines = ARCHITECTURE.read_text().split(MARK, 1)[1].strip().splitlines()
    rows = []
    for line in lines[2:]:  # after the header and its rule
        if not line.startswith("|"):
            break
        rows.append(tuple(re.findall(r"`([\w.]+)`", line.split("|")[2])))
    return rows


def place(module: str, rows: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """The row and entry that hold `module`: the longest entry naming it or a package above it
    (the root `chameleond` names only its own `__init__`)."""
    found = [
        (len(entry), i, entry)
        for i, row in enumerate(rows)
        for entry in row
        if module == entry or (entry != "chameleond" and module.startswith(entry + "."))
    ]
    if not found:
        return None
    _, i, entry = max(found)
    return i, entry


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


def test_every_module_sits_on_the_table() -> None:
    rows = layers()
    assert len(rows) >= 10 and all(rows)
    assert [m for m in sorted(modules()) if place(m, rows) is None] == []


def test_no_arrow_up_or_across_a_row() -> None:
    rows = layers()
    wrong = []
    for m, targets in graph().items():
        here = place(m, rows)
        assert here is not None
        for t in targets:
            there = place(t, rows)
            assert there is not None
            if there[1] != here[1] and there[0] <= here[0]:
                wrong.append(f"{m} ({here[1]}) imports {t} ({there[1]})")
    assert sorted(wrong) == []


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


def test_the_table_places_what_it_names() -> None:
    """The table as the checks above read it: rows in order, longest entry first."""
    rows = layers()
    names = [entry for row in rows for entry in row]
    assert names[0] == BENCH and "chameleond.core" in names
    daemon, worker = place("chameleond.daemon.ingest", rows), place("chameleond.worker", rows)
    assert daemon is not None and worker is not None and daemon[0] == worker[0]
    core = place("chameleond.core.decide", rows)
    assert core is not None and core[1] == "chameleond.core" and core[0] > daemon[0]
    assert place("chameleond.nowhere", rows) is None  # the root names only itself
