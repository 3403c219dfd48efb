"""Import direction: the engine never imports the simulator, and the simulator never imports
the engine (`shared/DESIGN.md`, "Boundaries (round 2)"). The shared run loop is `kvevict.run`,
below both; `kvevict.engine_bench`, above both, is the one place that runs the two."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvevict"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, current: str = "kvevict") -> set[str]:
    """Every ``kvevict`` module a source imports, anywhere in it (functions included):
    ``import a.b``, ``from a.b import c`` (``a.b.c`` too when that is a module) and relative
    imports, resolved against the module ``current``."""
    found: set[str] = set()
    package = current.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                depth = len(package) - node.level + current_is_package(current)
                base = ".".join([*package[:depth], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "kvevict" or m.startswith("kvevict.")}


def current_is_package(name: str) -> bool:
    return (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").exists()


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), module_name(path))


def reaches(module: str, target: str) -> bool:
    """Whether ``module`` imports ``target`` or a module inside it."""
    return module == target or module.startswith(target + ".")


ENGINE = sorted((PACKAGE / "engine").glob("*.py"))


def test_the_engine_modules_are_found():
    names = {module_name(p) for p in ENGINE}
    assert {"kvevict.engine", "kvevict.engine.executor", "kvevict.engine.driver"} <= names


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: p.name)
def test_no_engine_module_imports_the_simulator(path):
    bad = sorted(m for m in imports_of(path) if reaches(m, "kvevict.sim"))
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {', '.join(bad)}"


def test_the_simulator_imports_nothing_from_the_engine():
    bad = sorted(m for m in imports_of(PACKAGE / "sim.py") if reaches(m, "kvevict.engine"))
    assert not bad, f"kvevict/sim.py imports {', '.join(bad)}"


def _module_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def _closure(start: str, graph: dict[str, set[str]]) -> set[str]:
    """Modules ``start`` reaches through imports, not following package ``__init__`` files
    (importing ``kvevict.x.y`` runs ``kvevict/__init__.py``, which re-exports everything)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m in seen or m not in graph:
                continue
            seen.add(m)
            if not current_is_package(m):
                todo.append(m)
    return seen


def test_the_shared_run_loop_reaches_neither_side():
    graph = _module_graph()
    for start in ("kvevict.run", "kvevict.scheduler"):
        reached = _closure(start, graph)
        bad = sorted(m for m in reached if reaches(m, "kvevict.sim") or
                     reaches(m, "kvevict.engine") or m == "kvevict.engine_bench")
        assert not bad, f"{start} reaches {', '.join(bad)}"


def test_no_engine_module_reaches_the_simulator_through_another():
    graph = _module_graph()
    for path in ENGINE:
        name = module_name(path)
        bad = sorted(m for m in _closure(name, graph) if reaches(m, "kvevict.sim"))
        assert not bad, f"{name} reaches {', '.join(bad)}"


@pytest.mark.parametrize("source", [
    "import kvevict.sim",
    "from kvevict.sim import simulate",
    "from kvevict import sim",
    "def f():\n    from kvevict.sim import drive\n",
    "from .. import sim",
])
def test_the_check_sees_a_planted_import(source):
    found = imported_modules(source, "kvevict.engine.driver")
    assert any(reaches(m, "kvevict.sim") for m in found), found


def test_the_check_ignores_lookalikes():
    found = imported_modules("import kvevict.simulation_notes\nfrom kvevict.run import drive\n"
                             "import simpy\n", "kvevict.engine.driver")
    assert not any(reaches(m, "kvevict.sim") for m in found), found
