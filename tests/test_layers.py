"""Imports run one way: kernels/ and a few plain modules are the ground floor, benchmarks are
a leaf nothing imports (their registry, which names them, is on the ground floor), report
draws what benchmarks and runs wrote without importing them, and no module imports itself
back through others. Read from the source (every import, also those inside functions), not
by importing it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Imports only each other (and third-party packages).
GROUND = ("qerl.errors", "qerl.atomic", "qerl.record", "qerl.settings", "qerl.methods",
          "qerl.archs", "qerl.formats", "qerl.rl.phases", "qerl.bench.registry")
# What qerl.report may import: the ground floor and itself, nothing that builds a model.
REPORT_MAY_IMPORT = (*GROUND, "qerl.report")


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(("qerl", "kernels", *parts[1:]) if parts[0] == "kernels" else parts)
    return name.removesuffix(".__init__")


def _imports(path: Path, known: set[str]) -> set[str]:
    """The qerl modules ``path`` imports (``from qerl.a import b`` is qerl.a.b if that is
    a module, else qerl.a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qerl"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("qerl"))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    paths = [*REPO.glob("qerl/**/*.py"), *REPO.glob("kernels/*.py")]
    paths = [p for p in paths if "kernels" not in p.relative_to(REPO).parts[1:-1]]
    known = {_module(p) for p in paths}
    return {_module(p): _imports(p, known) - {_module(p)} for p in paths}


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in prefixes)


def test_the_kernels_stand_on_the_ground_floor(graph):
    for module, imports in graph.items():
        if _within(module, ["qerl.kernels"]):
            above = sorted(i for i in imports
                           if not _within(i, ["qerl.kernels", "qerl.errors", "qerl.formats"]))
            assert not above, f"{module} imports {above}"


def test_the_ground_floor_imports_nothing_above_it(graph):
    for module, imports in graph.items():
        if _within(module, GROUND):
            above = sorted(i for i in imports if not _within(i, GROUND))
            assert not above, f"{module} imports {above}"


def test_benchmarks_are_a_leaf_and_report_imports_no_producer(graph):
    for module, imports in graph.items():
        if not _within(module, ["qerl.bench", "qerl.cli"]):
            bench = sorted(i for i in imports
                           if _within(i, ["qerl.bench"]) and not _within(i, GROUND))
            assert not bench, f"{module} imports {bench}"
        if not _within(module, ["qerl.report", "qerl.bench", "qerl.cli"]):
            report = sorted(i for i in imports if _within(i, ["qerl.report"]))
            assert not report, f"{module} imports {report}"
        if _within(module, ["qerl.report"]):
            other = sorted(i for i in imports if not _within(i, REPORT_MAY_IMPORT))
            assert not other, f"{module} imports {other}"
        assert "qerl.cli" not in imports, f"{module} imports the command line"


def test_no_module_imports_itself_back(graph):
    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for nxt in graph.get(module, ()):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [c for c in map(cycle_from, graph) if c]
    assert not cycles, f"import cycles: {cycles[:3]}"
