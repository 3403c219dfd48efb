"""Shared fixtures: a manual clock and a small metadata-only cache manager factory."""

from __future__ import annotations

import os

import pytest

from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.types import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    """A clock at t=0 that only moves when a test moves it."""
    return ManualClock()


@pytest.fixture
def make_manager(clock):
    """Build a metadata-only `KVCacheManager` on the shared clock (block_size 4 by default)."""

    def build(num_blocks: int = 8, policy="lru", *, block_size: int = 4, **params):
        return KVCacheManager(BlockPool(num_blocks, block_size), policy, clock=clock, **params)

    return build


@pytest.fixture
def evict_one_by_one():
    """Evict ``n`` blocks one ``evict(1)`` at a time; return the evicted block ids in order."""

    def run(manager: KVCacheManager, n: int) -> list[int]:
        order = []
        for _ in range(n):
            before = {b.block_id for b in manager.tree}
            assert manager.evict(1) == 1
            gone = before - {b.block_id for b in manager.tree}
            assert len(gone) == 1, gone
            order.append(gone.pop())
            manager.check()
        return order

    return run


def pytest_configure(config):
    """``KVEVICT_MUTANT=<name>`` runs the tests against a hand-made mutant of the production
    code (`mutants.py`); `test_mutations.py` checks that they then fail."""
    name = os.environ.get("KVEVICT_MUTANT")
    if name:
        from hypothesis import Phase, settings
        from mutants import MUTANTS

        MUTANTS[name]()
        # a failure is all that is asked for: no shrinking
        settings.register_profile("mutant", parent=settings.get_profile("ci"),
                                  phases=(Phase.explicit, Phase.reuse, Phase.generate))
        settings.load_profile("mutant")
