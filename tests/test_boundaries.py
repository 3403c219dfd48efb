"""Layer boundaries: no module reads or writes another object's underscore attributes.

`find_violations` walks a module's AST and reports every ``x._name`` (``_name`` not a dunder)
whose ``x`` is not ``self``, ``cls``, ``super()`` or the name of a class defined in the same
module. ``getattr``/``setattr``/``hasattr``/``delattr`` with such a name as a string literal
count too (the same access, spelled differently). `test_kvevict_respects_its_boundaries` runs
it over every ``kvevict/**/*.py`` the tests import, minus `ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvevict

PACKAGE = Path(kvevict.__file__).resolve().parent
ROOT = PACKAGE.parent

#: ``(module path relative to the repository root, attribute, reason)``. Only for private
#: APIs of other projects that have no public equivalent; kvevict's own objects get a public
#: method instead. Every entry must still match an access (see `test_allow_list_is_live`).
ALLOWED: tuple[tuple[str, str, str], ...] = ()

_OWN = frozenset({"self", "cls"})
_ATTR_FUNCTIONS = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_own(node: ast.expr, classes: frozenset[str]) -> bool:
    """``self``, ``cls``, a class of this module, or ``super()``."""
    if isinstance(node, ast.Name):
        return node.id in _OWN or node.id in classes
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def find_violations(source: str, path: str) -> list[str]:
    """Every access to another object's underscore attribute in ``source``, as
    ``"path:line: expression"`` (sorted by line and column)."""
    tree = ast.parse(source, filename=path)
    classes = frozenset(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if _is_private(node.attr) and not _is_own(node.value, classes):
                found.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_FUNCTIONS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _is_private(node.args[1].value) and not _is_own(node.args[0], classes)):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{path}:{line}: {expr}" for line, _, expr in sorted(found)]


def _attribute(violation: str) -> str:
    """The private name a `find_violations` line is about."""
    expr = violation.split(": ", 1)[1]
    if expr.endswith(")"):  # getattr(x, '_name', ...)
        return expr.split("'")[1] if "'" in expr else expr.split('"')[1]
    return expr.rsplit(".", 1)[1]


def package_violations() -> tuple[list[str], set[tuple[str, str]]]:
    """Violations in every module of the installed ``kvevict`` package that `ALLOWED` does not
    cover, and the allow-list keys that matched something."""
    allowed = {(path, attr) for path, attr, _ in ALLOWED}
    left, used = [], set()
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(ROOT).as_posix()
        for violation in find_violations(file.read_text(encoding="utf-8"), rel):
            key = (rel, _attribute(violation))
            if key in allowed:
                used.add(key)
            else:
                left.append(violation)
    return left, used


def test_kvevict_respects_its_boundaries():
    left, _ = package_violations()
    assert not left, ("modules read or write another object's underscore attributes; give "
                      "that object a public method or property instead:\n  "
                      + "\n  ".join(left))


def test_allow_list_is_justified_and_live():
    for entry in ALLOWED:
        path, attr, reason = entry
        assert (ROOT / path).is_file(), entry
        assert _is_private(attr) and len(reason.split()) >= 4, entry
    _, used = package_violations()
    stale = {(p, a) for p, a, _ in ALLOWED} - used
    assert not stale, f"allow-list entries that match nothing any more: {sorted(stale)}"


PLANTED = '''\
import torch


class Own:
    _shared = 0

    def __init__(self, other):
        self._x = 1
        Own._shared += 1
        print(self.__class__, other.__dict__, super()._hidden)

    @classmethod
    def make(cls):
        return cls._shared


def peek(other):
    return other._secret


def poke(other):
    other.inner._value = 2
    torch._C._nn  # third party
    getattr(other, "_sneaky")
    getattr(other, "__doc__")
'''


def test_checker_reports_a_planted_violation_with_its_line(tmp_path):
    file = tmp_path / "planted.py"
    file.write_text(PLANTED)
    got = find_violations(file.read_text(), "pkg/planted.py")
    assert got == [
        "pkg/planted.py:18: other._secret",
        "pkg/planted.py:22: other.inner._value",
        "pkg/planted.py:23: torch._C",
        "pkg/planted.py:23: torch._C._nn",
        "pkg/planted.py:24: getattr(other, '_sneaky')",
    ]
    assert [_attribute(v) for v in got] == ["_secret", "_value", "_C", "_nn", "_sneaky"]


def test_checker_passes_self_cls_own_class_super_and_dunders():
    source = PLANTED.split("\n\ndef peek")[0] + "\n"
    assert find_violations(source, "ok.py") == []
    # a class of another module is not "own": the same access from outside is reported
    assert find_violations("from m import Own\nOwn._shared\n", "x.py") == [
        "x.py:2: Own._shared"]
