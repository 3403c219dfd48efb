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


def test_stress_runs_the_machines_rules_and_counts_them():
    from kvevict.testing import stress

    out = stress("lru", 3_000, seed=1, steps_per_run=150)
    assert out["ops"] == 3_000 and out["runs"] == 20
    assert sum(out["by_rule"].values()) == 3_000
    assert set(out["by_rule"]) == {"advance", "append", "begin", "evict", "finish", "lookup",
                                   "pin", "preempt", "prefill", "resume", "unpin"}
    assert stress("lru", 3_000, seed=1, steps_per_run=150)["by_rule"] == out["by_rule"]


def test_stress_names_the_seed_run_and_step_of_a_violation():
    from kvevict import LRU
    from kvevict.testing import stress

    class PlainSubclass(LRU):
        pass

    class OffersNothing(LRU):
        def victim(self, now):
            chosen = super().victim(now)
            return None if chosen is None else chosen + 1000

    assert stress(PlainSubclass, 500)["ops"] == 500  # a correct subclass passes
    with pytest.raises(AssertionError, match=r"stress\(.*seed=3\): run \d+ step \d+: "
                                             r"PolicyError: .*not a candidate"):
        stress(OffersNothing, 5_000, seed=3)
