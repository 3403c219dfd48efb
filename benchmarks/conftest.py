"""pytest setup for the benchmarks: collect ``bench_*.py`` and import from the checkout.

The project's pytest settings collect ``test_*.py`` under ``tests/`` only, so without this
``pytest benchmarks/`` would find nothing here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # sibling helper modules; kvevict without `pip install -e .`
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def pytest_configure(config: pytest.Config) -> None:
    """Benchmarks time one process at a time: they run serially, whatever the project's
    ``addopts`` ask for the tests (``-n auto``, pytest-xdist; pytest-benchmark turns itself off
    under xdist)."""
    config.option.numprocesses = 0
    config.option.dist = "no"
    config.option.tx = []


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):  # named on the command line:
        return pytest.Module.from_parent(parent, path=file_path)  # pytest collects it itself
    return None
