"""Residency policies driven through the manager: exact eviction orders on hand-built cases,
the registry, and `ScoredPolicy` with a time-dependent score."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest

from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.policies import (
    LFU,
    LRU,
    RefcountPinned,
    ScoredPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from kvevict.pool import BlockPool
from kvevict.types import Request, RetentionHint

A = list(range(100, 112))  # 3 full blocks of 4
B = list(range(200, 212))
C = list(range(300, 312))
D = list(range(400, 412))


def use(m, clock, t, tokens, rid, **request):
    """Begin and finish one request at time ``t``."""
    clock.set(t)
    m.begin(Request(rid, tokens=tokens, **request))
    m.finish(rid)


def record_evictions(m):
    """Collect ``(block_id, depth)`` of every eviction, in order."""
    evicted = []
    m.add_eviction_listener(lambda block, now: evicted.append((block.block_id, block.depth)))
    return evicted


# -- LRU ---------------------------------------------------------------------------------------


def test_lru_evicts_the_oldest_chain_tail_first(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    use(m, clock, 1, A, "a")  # blocks 0, 1, 2
    use(m, clock, 2, B, "b")  # blocks 3, 4, 5
    assert evict_one_by_one(m, 6) == [2, 1, 0, 5, 4, 3]


def test_lru_under_allocation_pressure(make_manager, clock):
    m = make_manager(6)
    use(m, clock, 1, A, "a")
    use(m, clock, 2, B, "b")
    evicted = record_evictions(m)
    clock.set(3)
    seq = m.begin(Request("c", tokens=C[:8]))
    assert evicted == [(2, 2), (1, 1)]  # A's tail, then the block before it
    assert seq.block_table == [1, 2]
    assert m.lookup(A).num_cached_blocks == 1 and m.lookup(B).num_cached_blocks == 3
    m.append("c", [1])
    assert evicted[2:] == [(0, 0)]  # then A's head, before any of B
    assert m.stats.evictions == 3 and m.stats.evictions_by_class == {"chat": 3}
    m.check()


def test_lru_hit_refreshes_a_chain(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    use(m, clock, 1, A[:8], "a")  # blocks 0, 1
    use(m, clock, 2, B[:8], "b")  # blocks 2, 3
    use(m, clock, 3, A[:8], "a-again")  # full hit on A
    assert m.block(0).hit_count == 1 and m.block(1).last_access == 3
    assert evict_one_by_one(m, 4) == [3, 2, 1, 0]  # the unhit newer chain goes first


def test_lru_partial_hit_refreshes_only_the_hit_blocks(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    use(m, clock, 1, A[:8], "a")  # blocks 0, 1
    use(m, clock, 2, B[:8], "b")  # blocks 2, 3
    use(m, clock, 3, A[:4] + C[:4], "ac")  # hits block 0, caches block 4 under it
    assert m.block(0).num_children == 2
    # A's unhit tail (t=1), B (t=2), the new branch (t=3, released before its parent), A's head
    assert evict_one_by_one(m, 5) == [1, 3, 2, 4, 0]


def test_lru_order_is_the_same_for_a_policy_instance(clock, evict_one_by_one):
    m = KVCacheManager(BlockPool(8, 4), LRU(), clock=clock)
    use(m, clock, 2, B[:8], "b")
    use(m, clock, 1 + 2, A[:8], "a")
    assert evict_one_by_one(m, 4) == [1, 0, 3, 2]


# -- LFU ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, order", [("lfu", [1, 0]), ("lru", [0, 1])])
def test_lfu_keeps_a_block_hit_twice_over_a_newer_one_hit_once(
        make_manager, clock, evict_one_by_one, policy, order):
    m = make_manager(8, policy)
    use(m, clock, 0, A[:4], "a0")
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 2, A[:4], "a2")  # block 0: 2 hits
    use(m, clock, 3, B[:4], "b0")
    use(m, clock, 4, B[:4], "b1")  # block 1: 1 hit, more recent
    assert (m.block(0).hit_count, m.block(1).hit_count) == (2, 1)
    assert evict_one_by_one(m, 2) == order


def test_lfu_breaks_ties_by_recency(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "lfu")
    use(m, clock, 1, A[:4], "a0")
    use(m, clock, 2, A[:4], "a1")  # block 0: 1 hit, released t=2
    use(m, clock, 3, B[:4], "b0")
    use(m, clock, 4, B[:4], "b1")  # block 1: 1 hit, released t=4
    use(m, clock, 5, C[:4], "c0")  # block 2: no hit, newest
    use(m, clock, 6, D[:4], "d0")
    use(m, clock, 6, D[:4], "d1")
    use(m, clock, 6, D[:4], "d2")  # block 3: 2 hits
    assert evict_one_by_one(m, 4) == [2, 0, 1, 3]


@pytest.mark.parametrize("t_b, order", [(7.8, [1, 0]), (7.9, [0, 1])])
def test_lfu_half_life_ages_old_hits(make_manager, clock, evict_one_by_one, t_b, order):
    """f = (1 + hits) * 2**(-idle / H). A: 2 hits, last used t=2; B: 1 hit, last used t_b.
    A goes first iff 3 * 2**(-(t_b - 2) / H) < 2, i.e. t_b > 2 + H * log2(1.5) = 7.8496."""
    half_life = 10.0
    threshold = 2 + half_life * math.log2(1.5)
    assert 7.8 < threshold < 7.9
    assert (3 * 2 ** (-(t_b - 2) / half_life) < 2) == (order == [0, 1])
    m = make_manager(8, "lfu", half_life=half_life)
    use(m, clock, 0, A[:4], "a0")
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 2, A[:4], "a2")  # block 0: hits 2, last access t=2
    use(m, clock, t_b - 0.5, B[:4], "b0")
    use(m, clock, t_b, B[:4], "b1")  # block 1: hits 1, last access t_b
    clock.set(50)  # both age alike while waiting: the order does not depend on when we evict
    assert evict_one_by_one(m, 2) == order


def test_lfu_without_half_life_never_ages(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "lfu")
    use(m, clock, 0, A[:4], "a0")
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 2, A[:4], "a2")
    use(m, clock, 1000, B[:4], "b0")
    use(m, clock, 1001, B[:4], "b1")
    assert evict_one_by_one(m, 2) == [1, 0]


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "10"])
def test_lfu_rejects_a_bad_half_life(bad):
    with pytest.raises(ConfigError, match="half_life must be a positive finite number or None"):
        make_policy("lfu", half_life=bad)


# -- refcount-pinned ---------------------------------------------------------------------------


def _shared_prefix_and_private_chat(m, clock):
    """Block 0: a prefix used by sessions s1, s2, s3 at t=0, 1, 2 (each with a private partial
    tail that is freed). Block 1: a private chat of session p at t=3."""
    for t, session in enumerate(("s1", "s2", "s3")):
        use(m, clock, t, [*A[:4], t, t], f"r{t}", session_id=session)
    use(m, clock, 3, B[:4], "p0", session_id="p")
    assert m.block(0).num_sharers == 3 and m.block(1).num_sharers == 1


def test_pinned_keeps_a_widely_shared_prefix(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "pinned", min_sharers=3, window=600)
    _shared_prefix_and_private_chat(m, clock)
    assert m.policy.num_protected == 1
    assert m.policy.protected_until(m.block(0)) == 600.0
    assert m.policy.protected_until(m.block(1)) == -math.inf
    clock.set(10)
    assert evict_one_by_one(m, 1) == [1]  # the newer private chat goes
    assert evict_one_by_one(m, 1) == [0]  # only protected candidates left: it goes too


@pytest.mark.parametrize("t, order", [(599.9, [1, 0]), (600.0, [0, 1]), (601.0, [0, 1])])
def test_pinned_protection_lapses_after_the_window(make_manager, clock, evict_one_by_one,
                                                   t, order):
    m = make_manager(8, "pinned", min_sharers=3, window=600)
    _shared_prefix_and_private_chat(m, clock)
    clock.set(t)
    # once the window has passed, the inner LRU decides: the prefix (released t=2) is older
    assert evict_one_by_one(m, 2) == order


def test_pinned_needs_min_sharers_distinct_sessions(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "pinned", min_sharers=3, window=600)
    use(m, clock, 0, [*A[:4], 0], "r0", session_id="s1")
    use(m, clock, 1, [*A[:4], 1], "r1", session_id="s2")
    use(m, clock, 2, [*A[:4], 2], "r2", session_id="s2")  # same session again
    use(m, clock, 3, B[:4], "p0", session_id="p")
    assert m.block(0).hit_count == 2 and m.block(0).num_sharers == 2
    assert m.policy.num_protected == 0
    clock.set(10)
    assert evict_one_by_one(m, 2) == [0, 1]  # plain LRU


def test_pinned_with_only_protected_left_evicts_the_earliest_ending(
        make_manager, clock, evict_one_by_one):
    m = make_manager(8, "pinned", min_sharers=3, window=600)
    for t, session in ((0, "s1"), (1, "s2"), (2, "s3")):
        use(m, clock, t, [*A[:4], 9], f"a{t}", session_id=session)
    for t, session in ((3, "s4"), (4, "s5"), (5, "s6")):
        use(m, clock, t, [*B[:4], 9], f"b{t}", session_id=session)
    use(m, clock, 6, [*A[:4], 9], "a6", session_id="s1")  # s1 again: sharers s1@6, s3@2, s2@1
    assert m.policy.protected_until(m.block(0)) == 601.0
    assert m.policy.protected_until(m.block(1)) == 603.0
    assert m.policy.num_protected == 2
    clock.set(10)
    # LRU alone would take block 1 (last used t=5) before block 0 (t=6)
    assert evict_one_by_one(m, 2) == [0, 1]


@pytest.mark.parametrize("t, order", [(99.0, [1, 0]), (100.0, [0, 1])])
def test_pinned_honours_a_retention_hint(make_manager, clock, evict_one_by_one, t, order):
    m = make_manager(8, "pinned")
    use(m, clock, 1, A[:4], "hinted", retention=RetentionHint(priority=1.0, until=100.0))
    use(m, clock, 2, B[:4], "plain")
    assert m.policy.protected_until(m.block(0)) == 100.0
    clock.set(t)
    assert evict_one_by_one(m, 2) == order


def test_pinned_hint_from_a_later_hit_applies(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "pinned")
    use(m, clock, 1, A[:4], "a")
    use(m, clock, 2, B[:4], "b")
    use(m, clock, 3, A[:4], "a-again", retention=RetentionHint(until=50.0))
    assert m.block(0).retention.until == 50.0 and m.block(1).retention is None
    clock.set(10)
    assert evict_one_by_one(m, 2) == [1, 0]


def test_pinned_wraps_a_named_inner_policy():
    policy = make_policy("pinned", inner="lfu", inner_params={"half_life": 5.0},
                         min_sharers=2, window=30)
    assert isinstance(policy, RefcountPinned)
    assert isinstance(policy.inner, LFU) and policy.inner.half_life == 5.0
    assert (policy.min_sharers, policy.window) == (2, 30.0)
    inner = LRU()
    assert make_policy("pinned", inner=inner).inner is inner


def test_pinned_passes_the_request_events_to_its_inner_policy():
    """A preemption and a resume reach the wrapped policy, as begin and finish do: the
    Belady inside keeps a preempted request's blocks for its resume (tests/test_belady.py)."""
    from kvevict import BlockPool, KVCacheManager, ManualClock, Request
    from kvevict.policies.belady import Belady

    a = Request("a", block_hashes=[1, 2], num_tokens=8, arrival=0.0)
    x = Request("x", block_hashes=[9], num_tokens=4, arrival=1.0)
    inner = Belady.from_requests([a, x, Request("y", block_hashes=[9], num_tokens=4,
                                                arrival=5.0)], time=[0.0, 1.0, 5.0])
    m = KVCacheManager(BlockPool(3, 4), make_policy("pinned", inner=inner), clock=ManualClock())
    m.begin(a)
    m.begin(x)
    m.finish("x")
    m.preempt("a")
    assert [inner.next_use(h, 2.0) for h in (1, 2)] == [0.0, 0.0]
    assert m.evict(1) == 1
    assert m.resume("a").num_cached_tokens == 8
    assert inner.next_use(1, 2.0) == math.inf
    m.check()


@pytest.mark.parametrize("params, match", [
    ({"min_sharers": 0}, "min_sharers must be an int >= 1, got 0"),
    ({"min_sharers": 2.0}, "min_sharers must be an int >= 1, got 2.0"),
    ({"min_sharers": True}, "min_sharers must be an int >= 1, got True"),
    ({"window": 0}, "window must be a positive number of seconds, got 0"),
    ({"window": -5.0}, "window must be a positive number of seconds, got -5.0"),
    ({"inner": "nope"}, "unknown policy 'nope'"),
])
def test_pinned_rejects_bad_parameters(params, match):
    with pytest.raises(ConfigError, match=match):
        make_policy("pinned", **params)


# -- registry ----------------------------------------------------------------------------------


def test_unknown_policy_name_lists_the_valid_names():
    with pytest.raises(ConfigError, match="unknown policy 'nope'; valid names: ") as info:
        make_policy("nope")
    message = str(info.value)
    for name in ("lru", "lfu", "pinned"):
        assert name in message.split("valid names: ")[1].split(", ")
    with pytest.raises(ConfigError, match="unknown policy 3"):
        make_policy(3)


@pytest.mark.parametrize("name, params, match", [
    ("lfu", {"halflife": 3}, r"policy 'lfu' has no parameter\(s\) halflife; it accepts: "
                             "half_life"),
    ("lru", {"window": 3}, r"policy 'lru' has no parameter\(s\) window; it accepts: no "
                           "parameters"),
])
def test_unknown_parameter_names_the_accepted_ones(name, params, match):
    with pytest.raises(ConfigError, match=match):
        make_policy(name, **params)


def test_unknown_parameter_of_pinned_names_its_own_parameters():
    with pytest.raises(ConfigError, match="min_sharers"):
        make_policy("pinned", min_sharer=3)


def test_available_policies_includes_the_builtins():
    names = available_policies()
    assert {"lru", "lfu", "pinned"} <= set(names)
    assert names == sorted(names)
    assert type(make_policy("lru")) is LRU
    assert type(make_policy("lfu")) is LFU
    assert type(make_policy("pinned")) is RefcountPinned
    assert (LRU.name, LFU.name, RefcountPinned.name) == ("lru", "lfu", "pinned")


def test_registering_a_taken_name_with_another_class_is_rejected():
    class Impostor(LRU):
        pass

    with pytest.raises(ConfigError, match=r"a policy named 'lru' is already registered \(LRU\)"):
        register_policy("lru")(Impostor)
    assert type(make_policy("lru")) is LRU
    assert Impostor.name == "lru"  # inherited, not overwritten by the failed registration
    assert register_policy("lru")(LRU) is LRU  # the same class again is fine


@pytest.mark.parametrize("bad", ["", "LRU", " lru", 3, None])
def test_register_rejects_bad_names(bad):
    with pytest.raises(ConfigError, match="policy names are non-empty lower-case strings"):
        register_policy(bad)


def test_make_policy_returns_an_instance_as_is():
    policy = LFU(half_life=3.0)
    assert make_policy(policy) is policy
    with pytest.raises(ConfigError, match="parameters were given together with a policy "
                                          "instance"):
        make_policy(policy, half_life=4.0)


# -- ScoredPolicy with a time-dependent score -------------------------------------------------


class IdleTimesClassWeight(ScoredPolicy):
    """Lowest first: ``-(now - last_access) * weight[class]``; the order changes with time."""

    time_dependent = True
    WEIGHT: ClassVar[dict[str, float]] = {"chat": 1.0, "rag": 3.0}

    def score(self, block, now):
        return -(now - block.last_access) * self.WEIGHT[block.workload_class]


class FrozenIdleTimesClassWeight(IdleTimesClassWeight):
    time_dependent = False


def _chat_then_rag(clock, policy):
    """Block 0: chat, released t=0. Block 1: rag, released t=5. Scores cross at t=7.5."""
    m = KVCacheManager(BlockPool(4, 4), policy, clock=clock)
    use(m, clock, 0, A[:4], "chat", workload_class="chat")
    use(m, clock, 5, B[:4], "rag", workload_class="rag")
    return m


@pytest.mark.parametrize("t, victim", [(7.0, 0), (7.5, 0), (8.0, 1)])
def test_time_dependent_score_is_evaluated_at_eviction_time(clock, evict_one_by_one, t, victim):
    """t=7: chat -7 vs rag -6; t=7.5: both -7.5, the older access goes; t=8: -8 vs -9."""
    policy = IdleTimesClassWeight()
    m = _chat_then_rag(clock, policy)
    clock.set(t)
    assert policy.victim(t) == victim
    assert len(policy) == 2
    assert evict_one_by_one(m, 1) == [victim]
    assert len(policy) == 1


def test_time_independent_score_is_frozen_when_the_block_becomes_a_candidate(
        clock, evict_one_by_one):
    """Without time_dependent both scores were 0 when computed; the tie goes to the older."""
    m = _chat_then_rag(clock, FrozenIdleTimesClassWeight())
    clock.set(8.0)
    assert evict_one_by_one(m, 1) == [0]


def test_a_twenty_line_policy_works_through_the_manager(clock, evict_one_by_one):
    class MostRecentFirst(ScoredPolicy):
        def score(self, block, now):
            return -block.last_access

    m = KVCacheManager(BlockPool(8, 4), MostRecentFirst(), clock=clock)
    use(m, clock, 1, A[:8], "a")
    use(m, clock, 2, B[:8], "b")
    # MRU among leaves: B's tail, then A's tail (t=1) loses to B's head (t=2)
    assert evict_one_by_one(m, 4) == [3, 2, 1, 0]


class OldestFirst(ScoredPolicy):
    def score(self, block, now):
        return block.last_access


def test_the_last_offered_candidate_competes_with_the_index_and_leaves_when_hit(
        clock, evict_one_by_one):
    """The candidate offered last waits beside the index: it is the victim only when it is
    the lowest, it joins the index when another is offered, and a hit that takes it out of
    the candidates drops it."""
    m = KVCacheManager(BlockPool(16, 4), OldestFirst(), clock=clock)
    use(m, clock, 0, A[:8], "a")  # blocks 0, 1
    use(m, clock, 1, B[:8], "b")  # blocks 2, 3
    use(m, clock, 2, A[:4], "d")  # block 0 used at 2 (still inner)
    for i in range(6):  # blocks 4..9, newer
        use(m, clock, 10 + i, [500 + 10 * i + j for j in range(4)], f"x{i}")
    # 1 goes and exposes 0 (used at 2); 3 (used at 1) goes first and exposes 2 (used at 1),
    # and 0 joins the index: it goes before the newer blocks
    assert evict_one_by_one(m, 5) == [1, 3, 2, 0, 4]

    m = KVCacheManager(BlockPool(16, 4), OldestFirst(), clock=clock)
    clock.set(20)
    use(m, clock, 20, C, "e")  # blocks 0, 1, 2
    use(m, clock, 21, D[:8], "f")  # blocks 3, 4
    assert evict_one_by_one(m, 1) == [2]  # exposes 1
    clock.set(22)
    seq = m.begin(Request("g", tokens=C[:8] + [9] * 4))  # a hit on 1: no longer a candidate
    g2 = seq.cached_blocks[-1].block_id
    m.finish("g")
    assert evict_one_by_one(m, 5) == [4, 3, g2, 1, 0]


def test_a_subclass_that_redefines_victim_or_on_evict_is_never_bypassed(make_manager, clock):
    """LRU pops its queue in one call (``pop_victim``); an LRU subclass that picks another
    victim, or watches evictions, is asked through its own ``victim`` / ``on_evict``."""
    from kvevict import LRU
    from kvevict.policies.base import pop_victim_of

    class Newest(LRU):
        def victim(self, now):
            return next(reversed(self._queue)) if self._queue else super().victim(now)

    class Watching(LRU):
        seen: list

        def on_evict(self, block, now):
            self.seen = [*getattr(self, "seen", []), block.block_id]
            super().on_evict(block, now)

    assert pop_victim_of(LRU()) is not None and pop_victim_of(Newest()) is None
    assert pop_victim_of(Watching()) is None
    watching = Watching()
    m = make_manager(4, watching)
    for i in range(3):
        clock.advance(1)
        m.begin(Request(f"r{i}", tokens=[i] * 4))
        m.finish(f"r{i}")
    m.evict(2)
    assert watching.seen == [0, 1]
    m = make_manager(4, Newest())
    for i in range(3):
        clock.advance(1)
        m.begin(Request(f"n{i}", tokens=[i] * 4))
        m.finish(f"n{i}")
    m.evict(1)
    assert [b.block_id for b in m.tree] == [0, 1]  # the newest (block 2) went first
