"""The architecture diagram in ``docs/concepts.md`` is true to the code.

The page holds one diagram (the fenced block with the boxes), a fenced ``# runtime imports``
list and a fenced ``# typing-only imports`` list, all at node level. A node is a top-level
module (``kvevict/manager.py`` is ``manager``), a subpackage with everything in it
(``policies``, ``engine``, ``workloads``, ``adapters.hf``), or ``kvevict`` itself (the facade,
``kvevict/__init__.py``). This module measures the imports of every file under ``kvevict/``
with `ast` (imports inside functions included; those under ``if TYPE_CHECKING:`` kept apart,
since they never run) and checks that:

- the runtime list is exactly the measured runtime graph, and the typing-only list exactly the
  edges that exist only under ``TYPE_CHECKING``;
- the diagram draws every node once, each strictly above every node it imports (so no arrow,
  drawn or implied, points up, and the picture is a topological order of the graph);
- the table under the diagram has a row for every node, and each subpackage's row names its
  member modules;
- there is no import cycle between nodes, except the ones in `ALLOWED_CYCLES` (none today);
- the usage example in ``kvevict/__init__.py``'s docstring runs.

Planted edges (an extra import in the code, an extra line in the doc, a cycle) show that each
comparison fails when the two disagree.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvevict"
CONCEPTS = ROOT / "docs" / "concepts.md"

#: Import cycles between nodes that are allowed, each with its reason. There are none: every
#: back edge (``admission``, ``invariants`` and ``policies`` naming ``KVCacheManager`` in type
#: hints) is under ``TYPE_CHECKING`` and never runs.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}

Graph = dict[str, set[str]]


# --- measuring the code ---------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = PACKAGE.parent / Path(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def is_package(name: str) -> bool:
    return (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").exists()


def node_of(module: str) -> str | None:
    """The diagram node of a ``kvevict`` module (None for ``kvevict.adapters``, the namespace
    that holds one subpackage per adapter and only a docstring itself)."""
    parts = module.split(".")[1:]
    if not parts:
        return "kvevict"
    if parts[0] == "adapters":
        return f"adapters.{parts[1]}" if len(parts) > 1 else None
    return parts[0]


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
                    (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
                for stmt in node.body:
                    found.update(id(n) for n in ast.walk(stmt))
    return found


def imports_in(source: str, current: str) -> list[tuple[str, int, bool]]:
    """Every ``kvevict`` module ``source`` (the module ``current``) imports, anywhere in it:
    ``(module, line, typing_only)``. ``from a import b`` names ``a.b`` when that is a module
    and ``a`` otherwise; relative imports are resolved against ``current``."""
    tree = ast.parse(source)
    typing_only = _typing_only(tree)
    package = current.split(".")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                depth = len(package) - node.level + is_package(current)
                base = ".".join([*package[:depth], *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names if is_module(f"{base}.{a.name}")]
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        found.extend((t, node.lineno, id(node) in typing_only) for t in targets
                     if t == "kvevict" or t.startswith("kvevict."))
    return found


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def measure(sources: Mapping[str, str]) -> tuple[Graph, Graph, dict]:
    """The node graph of ``sources`` (module name -> source): runtime edges, edges found only
    under ``TYPE_CHECKING``, and where each edge is (``(a, b) -> ["module:line", ...]``)."""
    runtime: Graph = {}
    typing: Graph = {}
    where: dict[tuple[str, str], list[str]] = {}
    for module, source in sources.items():
        a = node_of(module)
        for target, line, typing_only in imports_in(source, module):
            b = node_of(target)
            assert a is not None, f"{module}:{line} imports {target}; give it a node"
            if b is None or a == b:
                continue
            (typing if typing_only else runtime).setdefault(a, set()).add(b)
            where.setdefault((a, b), []).append(f"{module}:{line}")
        if a is not None:
            runtime.setdefault(a, set())
    for a, bs in typing.items():
        bs -= runtime.get(a, set())
    return runtime, {a: bs for a, bs in typing.items() if bs}, where


# --- reading the doc ------------------------------------------------------------------------

def fenced_blocks(text: str) -> list[list[str]]:
    return [block.splitlines() for block in
            re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)]


def edge_list(text: str, title: str) -> Graph:
    """The fenced list whose first line is ``# <title>...``: ``a -> b, c`` per line (``a ->``
    with nothing after it: a node that imports no other node)."""
    blocks = [b for b in fenced_blocks(text) if b and b[0].startswith(f"# {title}")]
    assert len(blocks) == 1, f"concepts.md needs one fenced block starting '# {title}'"
    graph: Graph = {}
    for line in blocks[0][1:]:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        source, sep, targets = line.partition("->")
        assert sep, f"not 'a -> b, c': {line!r}"
        source = source.strip()
        assert source not in graph, f"{source} is listed twice"
        graph[source] = {t.strip() for t in targets.split(",") if t.strip()}
    return graph


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def diagram_rows(text: str, nodes: set[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Where the diagram draws each node: its row (content lines counted top to bottom over
    all boxes) and its box (1 = the top layer). Only the text inside a box's side walls
    counts, so the box titles may use any words."""
    blocks = [b for b in fenced_blocks(text) if any("┌" in line for line in b)]
    assert len(blocks) == 1, "concepts.md must hold exactly one box diagram"
    row_of: dict[str, int] = {}
    box_of: dict[str, int] = {}
    box = 0
    for row, line in enumerate(blocks[0]):
        inner = line.strip()
        if inner.startswith("┌"):
            box += 1
        if not inner.startswith("│"):
            continue
        for token in _TOKEN.findall(inner):
            if token in nodes:
                assert token not in row_of, f"the diagram draws {token} twice"
                row_of[token] = row
                box_of[token] = box
    return row_of, box_of


def table_rows(text: str) -> dict[str, set[str]]:
    """The table's rows: node (the backticked first cell) -> the member modules listed in
    parentheses after it (``| `engine` (model, executor, ...) | ... |``; empty if none)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`([A-Za-z_][\w.]*)`\s*(?:\(([^)]*)\))?\s*\|", line)
        if m:
            rows[m.group(1)] = {n.strip() for n in (m.group(2) or "").split(",") if n.strip()}
    return rows


# --- comparing ------------------------------------------------------------------------------

def graph_differences(doc: Graph, code: Graph, what: str,
                      where: Mapping[tuple[str, str], list[str]] | None = None) -> list[str]:
    """Each edge one side has and the other lacks, as a sentence (with the importing lines
    when ``where`` is given)."""
    out = []
    for a in sorted(set(doc) | set(code)):
        for b in sorted(code.get(a, set()) - doc.get(a, set())):
            at = f" ({', '.join(where[(a, b)])})" if where else ""
            out.append(f"the code has {what} {a} -> {b}{at}, concepts.md does not show it")
        for b in sorted(doc.get(a, set()) - code.get(a, set())):
            out.append(f"concepts.md shows {what} {a} -> {b}, the code has no such import")
    return out


def upward_edges(graph: Graph, row_of: Mapping[str, int]) -> list[str]:
    return [f"{a} -> {b}: {b} is not drawn below {a}" for a in sorted(graph)
            for b in sorted(graph[a]) if row_of[b] <= row_of[a]]


def cycles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def unexpected_cycles(graph: Graph) -> list[str]:
    return [" <-> ".join(sorted(c)) for c in cycles(graph) if c not in ALLOWED_CYCLES]


@pytest.fixture(scope="module")
def code():
    return measure(package_sources())


@pytest.fixture(scope="module")
def doc():
    return CONCEPTS.read_text()


# --- the checks -----------------------------------------------------------------------------

def test_every_module_has_a_node_and_the_namespace_imports_nothing():
    sources = package_sources()
    assert {node_of(m) for m in sources} >= {"manager", "policies", "engine", "adapters.hf",
                                             "workloads", "kvevict"}
    assert imports_in(sources["kvevict.adapters"], "kvevict.adapters") == []


def test_the_runtime_import_list_is_the_measured_graph(code, doc):
    runtime, _, where = code
    differences = graph_differences(edge_list(doc, "runtime imports"), runtime, "the import",
                                    where)
    assert not differences, "\n".join(differences)


def test_the_typing_only_list_is_the_measured_one(code, doc):
    _, typing, _ = code
    differences = graph_differences(edge_list(doc, "typing-only imports"), typing,
                                    "the typing-only import")
    assert not differences, "\n".join(differences)


def test_the_diagram_draws_every_node_once_above_what_it_imports(code, doc):
    runtime, _, _ = code
    row_of, box_of = diagram_rows(doc, set(runtime))
    assert set(row_of) == set(runtime), f"not drawn: {sorted(set(runtime) - set(row_of))}"
    assert not upward_edges(runtime, row_of), "\n".join(upward_edges(runtime, row_of))
    assert box_of["cli"] == box_of["engine_bench"] == box_of["sim"] == box_of["engine"] == 1
    assert box_of["run"] == box_of["scheduler"] < box_of["manager"] < box_of["pool"]
    assert box_of["pool"] < box_of["errors"]


def test_the_table_names_every_node_and_every_member(code, doc):
    runtime, _, _ = code
    rows = table_rows(doc)
    assert set(runtime) <= set(rows), f"no table row: {sorted(set(runtime) - set(rows))}"
    members: dict[str, set[str]] = {}
    for module in package_sources():
        node = node_of(module)
        if node is None or node == "kvevict" or module == f"kvevict.{node}":
            continue
        prefix = f"kvevict.{node}."
        if module.startswith(prefix):
            members.setdefault(node, set()).add(module[len(prefix):].split(".")[0])
    for node, names in members.items():
        assert rows[node] == names, f"the {node} row lists {sorted(rows[node])}, the code has " \
            f"{sorted(names)}"


def test_no_import_cycle_between_nodes(code):
    runtime, _, _ = code
    assert not unexpected_cycles(runtime)


def test_the_typing_only_edges_would_be_cycles_if_they_ran(code):
    """Why they must stay under ``TYPE_CHECKING``: each one points up the diagram."""
    runtime, typing, _ = code
    both = {a: runtime.get(a, set()) | typing.get(a, set()) for a in set(runtime) | set(typing)}
    assert unexpected_cycles(both), "a typing-only edge no longer closes a cycle: update the doc"


def test_the_package_docstring_example_runs():
    import kvevict

    doc = kvevict.__doc__
    start = doc.index("Usage (")
    block = doc[doc.index("::\n", start) + 3:]
    lines = []
    for line in block.splitlines():
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    code = textwrap.dedent("\n".join(lines))
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "kvevict.__doc__", "exec"), {})
    cached, summary = out.getvalue().splitlines()
    assert cached == "32"  # what the example's comment says
    assert summary.startswith("{'policy': 'market'")


# --- the checks fail when code and doc disagree ---------------------------------------------

#: (module, planted source, edge it adds, whether that edge closes a cycle). ``engine -> sim``
#: closes none (nothing under ``sim`` imports the engine), but it is drawn sideways, which the
#: diagram forbids, and it is the boundary ``tests/test_layers.py`` guards.
PLANTS = [
    ("kvevict.types", "\ndef _late():\n    from kvevict.manager import KVCacheManager\n",
     "types", "manager", True),
    ("kvevict.pool", "\nimport kvevict.sim\n", "pool", "sim", True),
    ("kvevict.prefix", "\nfrom kvevict import simulate\n", "prefix", "kvevict", True),
    ("kvevict.engine.driver", "\nfrom kvevict import sim\n", "engine", "sim", False),
    ("kvevict.policies.lru", "\nfrom .. import scheduler\n", "policies", "scheduler", True),
]


@pytest.mark.parametrize("module, planted, a, b, cycle", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_import_fails_every_check(doc, module, planted, a, b, cycle):
    sources = package_sources()
    sources[module] += planted
    runtime, _, _ = measure(sources)
    assert b in runtime[a]
    differences = graph_differences(edge_list(doc, "runtime imports"), runtime, "the import")
    assert differences == [f"the code has the import {a} -> {b}, concepts.md does not show it"]
    row_of, _ = diagram_rows(doc, set(runtime))
    assert upward_edges(runtime, row_of) == [f"{a} -> {b}: {b} is not drawn below {a}"]
    assert bool(unexpected_cycles(runtime)) == cycle


def test_a_planted_typing_only_import_is_not_a_runtime_edge(doc):
    sources = package_sources()
    sources["kvevict.pins"] = sources["kvevict.pins"].replace(
        "from __future__ import annotations\n",
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvevict.manager import KVCacheManager\n", 1)
    runtime, typing, _ = measure(sources)
    assert "manager" not in runtime["pins"] and typing["pins"] == {"manager"}
    assert not graph_differences(edge_list(doc, "runtime imports"), runtime, "the import")
    assert graph_differences(edge_list(doc, "typing-only imports"), typing, "x") == [
        "the code has x pins -> manager, concepts.md does not show it"]


def test_an_edge_the_code_lacks_fails_the_comparison(code, doc):
    runtime, _, _ = code
    assert "pool" not in runtime["types"]
    planted = doc.replace("\ntypes -> errors\n", "\ntypes -> errors, pool\n", 1)
    assert planted != doc
    assert graph_differences(edge_list(planted, "runtime imports"), runtime, "the import") == [
        "concepts.md shows the import types -> pool, the code has no such import"]


def test_a_node_missing_from_the_diagram_is_found(code, doc):
    runtime, _, _ = code
    lines = doc.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("│") and
              re.search(r"\bpins\b", line))
    lines[at] = re.sub(r"\bpins\b", "pinz", lines[at])
    row_of, _ = diagram_rows("\n".join(lines), set(runtime))
    assert "pins" not in row_of and set(row_of) == set(runtime) - {"pins"}


def test_the_cycle_check_sees_a_planted_cycle():
    graph = {"manager": {"pool"}, "pool": {"errors"}, "errors": {"manager"}, "types": set()}
    assert unexpected_cycles(graph) == ["errors <-> manager <-> pool"]
    assert unexpected_cycles({"a": {"b"}, "b": set()}) == []
