"""The shared stateful machine (kvevict.testing) against every registered policy."""

import pytest

from kvevict import available_policies
from kvevict.testing import machine_for

POLICIES = available_policies()


@pytest.mark.parametrize("policy", POLICIES)
def test_machine_metadata_mode(policy):
    machine_for(policy).TestCase().runTest()


@pytest.mark.parametrize("policy", POLICIES)
def test_machine_tensor_mode(policy):
    machine_for(policy, tensor=True, num_blocks=10).TestCase().runTest()


def test_machine_small_pool_pressure():
    """A pool of 5 blocks: OutOfBlocks and pinned-only eviction happen constantly."""
    machine_for("lru", num_blocks=5, block_size=2).TestCase().runTest()


def test_machine_surfaces_a_policy_naming_a_non_candidate():
    """A policy whose victim is not a candidate fails the run with PolicyError."""
    from kvevict import LRU, PolicyError

    class MostRecentNonCandidate(LRU):
        def victim(self, now):
            chosen = super().victim(now)
            return None if chosen is None else chosen + 1000

    with pytest.raises(PolicyError):
        machine_for(MostRecentNonCandidate, num_blocks=5).TestCase().runTest()
