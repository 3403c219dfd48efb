"""The shared stateful machine (`kvevict.testing.CacheMachine`) over a tiered manager.

The machine's model tracks the pool; here a begin / resume also hits the lower tiers'
continuation of its prefix (a reload), so the predicted hit, the out-of-blocks decision and
the pool's KV bytes (tensor mode: every cached block, reloaded ones included, must hold
exactly what was written for its tokens) are checked against a stack of two tiers. Every
step also runs ``check()``, which verifies the tiers (`kvevict.invariants`), and the
invariants below: the pool and the tiers never share a block, and every lower-tier block's
prefix is reachable.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from kvevict import KVCacheManager
from kvevict.policies.base import make_policy
from kvevict.testing import CacheMachine
from kvevict.tiers import Tier, TierStack


def tiered_machine(policy: str, *, tensor: bool, demote: str, lower_policy: str = "lru",
                   num_blocks: int = 5, capacities: tuple[int, ...] = (6, 8)):
    store = "host" if tensor else "metadata"

    class TieredMachine(CacheMachine):
        moved: ClassVar[dict[str, int]] = {"reloads": 0, "demotions": 0, "superseded": 0}

        def __init__(self) -> None:
            super().__init__()
            self.stack = TierStack([Tier(c, profile, store=store, policy=lower_policy)
                                    for c, profile in zip(capacities, ("host-pcie5", "cxl"))],
                                   demote=demote)
            # the same (untouched) pool, now under a tiered manager
            self.manager = KVCacheManager(self.pool, make_policy(policy), clock=self.clock,
                                          tiers=self.stack)
            self.manager.add_eviction_listener(self._on_evict)
            self.in_start = False

        def _start(self, model, call, chunk):
            self.in_start = True  # a begin / resume also hits the lower tiers
            try:
                return super()._start(model, call, chunk)
            finally:
                self.in_start = False

        def _model_hits(self, tokens):
            n = super()._model_hits(tokens)
            if self.in_start:
                hashes = self._hashes(tokens)
                while n < len(hashes) and hashes[n] in self.stack:
                    n += 1
            return n

        def teardown(self):
            stats = self.stack.stats
            self.moved["reloads"] += stats.reloads
            self.moved["demotions"] += sum(stats.demotions.values())
            self.moved["superseded"] += stats.drops.get("superseded", 0)
            super().teardown()

        @invariant()
        def pool_and_tiers_are_disjoint_and_closed(self):
            below = {b.block_hash: b for b in self.stack}
            assert not below.keys() & self.cached.keys()
            for block in below.values():
                assert block.depth == 0 or block.parent_hash in below or \
                    block.parent_hash in self.cached

    TieredMachine.num_blocks = num_blocks
    TieredMachine.tensor = tensor
    # derandomized, a fixed size: the counts asserted after a run are stable
    TieredMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=50,
                                               deadline=None, derandomize=True)
    return TieredMachine


@pytest.mark.parametrize("demote", ["always", "cost"])
@pytest.mark.parametrize("policy", ["lru", "market"])
def test_tiered_machine_metadata(policy, demote):
    machine = tiered_machine(policy, tensor=False, demote=demote)
    machine.TestCase().runTest()
    assert machine.moved["reloads"] > 0 and machine.moved["demotions"] > 0


@pytest.mark.parametrize("lower_policy", ["lru", "lfu"])
def test_tiered_machine_tensor_reloads_exact_bytes(lower_policy):
    machine = tiered_machine("lru", tensor=True, demote="always", lower_policy=lower_policy)
    machine.TestCase().runTest()
    assert machine.moved["reloads"] > 0  # reloaded blocks were checked byte for byte


def test_tiered_machine_tiny_tiers_under_pressure():
    """One-block tiers: demotions push blocks through both tiers and out constantly."""
    machine = tiered_machine("lru", tensor=False, demote="always", num_blocks=5,
                             capacities=(1, 1))
    machine.TestCase().runTest()
    assert machine.moved["reloads"] > 0


@pytest.mark.parametrize("capacity", [1, 6])
@pytest.mark.parametrize("lower_policy", ["lru", "lfu"])
def test_tiered_machine_one_metadata_tier(lower_policy, capacity):
    """One metadata tier: every eviction burst goes down in one batched loop (swapping the
    tier's victim out when it is full)."""
    machine = tiered_machine("lru", tensor=False, demote="always", lower_policy=lower_policy,
                             capacities=(capacity,))
    machine.TestCase().runTest()
    assert machine.moved["reloads"] > 0 and machine.moved["demotions"] > 0
