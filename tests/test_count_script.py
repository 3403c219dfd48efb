"""The counting of ``benchmarks/count.py``: valgrind's totals read by name, and the cycle
estimate, tested on hand-written logs (valgrind itself is not needed)."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

LOG = """\
==4242== Callgrind, a call-graph generating cache profiler
side note: the child printed this
==4242== Events    : Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim
==4242== Collected : 1000 400 300 7 11 13 2 3 5 90 17 8 19
==4242==
"""


@pytest.fixture(scope="module")
def count():
    return load_benchmark("count")


def test_totals_are_read_by_their_names(count):
    assert count.parse_counts(LOG) == {
        "Ir": 1000, "I1mr": 7, "D1mr": 11, "D1mw": 13, "ILmr": 2, "DLmr": 3, "DLmw": 5,
        "Bcm": 17, "Bim": 19}


def test_the_cycle_estimate_is_cachegrinds(count):
    # Ir + 10 (Bcm + Bim) + 10 (I1mr + D1mr + D1mw) + 100 (ILmr + DLmr + DLmw)
    assert count.estimated_cycles(count.parse_counts(LOG)) == \
        1000 + 10 * (17 + 19) + 10 * (7 + 11 + 13) + 100 * (2 + 3 + 5)


def test_a_log_without_branch_counts_names_what_is_missing(count):
    log = LOG.replace(" Bc Bcm Bi Bim", "").replace(" 90 17 8 19", "")
    with pytest.raises(RuntimeError, match=r"lack \['Bcm', 'Bim'\]"):
        count.parse_counts(log)


def test_a_log_without_totals_shows_its_end(count):
    with pytest.raises(RuntimeError, match=r"(?s)no event totals.*the child printed this"):
        count.parse_counts(LOG.split("==4242== Events")[0])
