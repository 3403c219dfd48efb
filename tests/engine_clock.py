"""A reproducible timer for the built-in engine's executor in tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable


def fake_timer(step: float = 1e-4) -> Callable[[], float]:
    """Every reading ``step`` seconds later than the one before: the same steps whatever the
    code under test costs, so measured times are exact."""
    counter = itertools.count()
    return lambda: next(counter) * step
