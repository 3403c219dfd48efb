"""Mutation checks: the suite fails against each hand-made mutant in `mutants.py`.

Each case runs a slice of the suite in a fresh process with ``KVEVICT_MUTANT`` set (the
mutant replaces one production method; see ``conftest.py``) and asserts that the slice fails,
and with the error the mutant should cause. The same slice passes on the real code: it is part
of this suite. There is one eviction loop, so the stateful machine (`kvevict.testing`) sees the
code the simulator runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mutants import MUTANTS

TESTS = Path(__file__).resolve().parent
MACHINE = "tests/test_stateful.py::test_machine_metadata_mode[lru]"

CASES = {
    # LRU's order, as the manager's one eviction loop asks for it: exact eviction orders
    "lru-newest-first": (["tests/test_policies.py", "-k", "lru_evicts_the_oldest"],
                         "assert [5, 4, 3, 2, 1, 0] == [2, 1, 0, 5, 4, 3]"),
    "lru-late-to-the-back": (["tests/test_policies.py", "-k", "lru_evicts_the_oldest"],
                             "AssertionError"),
    # the leaf check and pin withholding: the stateful machine
    "no-leaf-check": ([MACHINE], "candidate set != {cached, ref 0, leaf}"),
    "no-pin-withholding": ([MACHINE], "was offered to the policy"),
}


def test_every_mutant_has_a_case():
    assert set(CASES) == set(MUTANTS)


@pytest.mark.parametrize("mutant", sorted(CASES))
def test_the_suite_kills_the_mutant(mutant):
    targets, expected = CASES[mutant]
    env = {**os.environ, "KVEVICT_MUTANT": mutant}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          "-n", "0", *targets], cwd=TESTS.parent, env=env, capture_output=True,
                         text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"the mutant {mutant!r} survived:\n{out[-3000:]}"
    assert "1 failed" in out and expected in out, out[-3000:]
