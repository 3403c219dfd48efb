"""KVCacheManager: begin / append / finish, prefix hits, dedup, back-pressure, preemption, pins,
trace-style hash requests and bad input. Every error case ends with ``manager.check()``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevict.errors import ConfigError, OutOfBlocks, PolicyError
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy
from kvevict.pool import BlockPool
from kvevict.prefix import ROOT_HASH, block_hashes
from kvevict.types import ManualClock, Request

A = list(range(100, 112))  # 3 full blocks of 4
B = list(range(200, 212))
C = list(range(300, 312))


def snapshot(manager):
    """Everything a failed call must leave unchanged."""
    return (
        manager.stats.as_dict(),
        manager.num_free_blocks,
        manager.num_cached_blocks,
        manager.num_evictable_blocks,
        sorted(manager.tree.candidates),
        {sid: (s.status, list(s.block_table), s.num_tokens, s.tokens)
         for sid, s in manager.sequences.items()},
        {b.block_id: (b.ref_count, b.hit_count, b.last_access_tick) for b in manager.tree},
    )


# -- begin / append / finish -------------------------------------------------------------------


def test_begin_allocates_and_caches_full_prompt_blocks(make_manager):
    m = make_manager(8)
    seq = m.begin(Request("a", tokens=list(range(10))))
    assert seq.block_table == [0, 1, 2]
    assert seq.num_tokens == 10 and seq.num_cached_tokens == 0
    assert m.num_cached_blocks == 2  # the partial third block is not cached
    assert m.block(2) is None
    first, second = m.block(0), m.block(1)
    assert first.block_hash == block_hashes(list(range(10)), 4)[0]
    assert (first.depth, second.depth) == (0, 1)
    assert second.parent_hash == first.block_hash and first.parent_hash == ROOT_HASH
    assert first.tokens.tolist() == [0, 1, 2, 3] and first.created_by == "prefill"
    assert (first.ref_count, first.hit_count) == (1, 0)
    assert m.num_free_blocks == 5 and m.num_candidates == 0
    m.check()


def test_second_request_hits_the_shared_prefix(make_manager, clock):
    m = make_manager(8)
    m.begin(Request("a", tokens=list(range(10)), session_id="s1"))
    clock.set(5)
    seq = m.begin(Request("b", tokens=[*list(range(8)), 50, 51, 52, 53, 54], session_id="s2"))
    assert seq.block_table == [0, 1, 3, 4]
    assert seq.num_cached_tokens == 8
    assert m.block(0).ref_count == 2 and m.block(1).ref_count == 2
    assert m.block(0).hit_count == 1 and m.block(0).sharers == {"s1": 0.0, "s2": 5.0}
    assert m.block(0).last_hit_session == "s2"
    s = m.stats
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (23, 8)
    assert (s.block_queries, s.block_hits) == (5, 2)
    assert s.hit_ratio == pytest.approx(8 / 23)
    assert s.block_hit_ratio == pytest.approx(2 / 5)
    assert (s.requests, s.allocated_blocks, s.inserted_blocks) == (2, 5, 3)
    assert s.peak_blocks_used == 5
    m.check()


def test_whole_prompt_hit_still_reports_cached_tokens_exactly(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=A))
    m.finish("a")
    seq = m.begin(Request("b", tokens=A))
    assert seq.block_table == [0, 1, 2] and seq.num_cached_tokens == 12
    assert m.stats.prefix_cache_hits == 12 and m.stats.allocated_blocks == 3
    m.check()


def test_lookup_has_no_side_effects(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    clock.set(1)
    m.begin(Request("a", tokens=A[:8]))
    m.finish("a")
    clock.set(2)
    m.begin(Request("b", tokens=B[:8]))
    m.finish("b")
    clock.set(3)
    before = snapshot(m)
    result = m.lookup([*A[:8], 1, 2, 3])
    assert (result.num_cached_tokens, result.num_cached_blocks, result.block_ids) == (8, 2, (0, 1))
    assert m.lookup(Request("q", tokens=[*A[:4], 7, 7, 7, 7])).block_ids == (0,)
    assert m.lookup([9, 9, 9, 9]).num_cached_blocks == 0
    assert snapshot(m) == before
    assert m.block(0).hit_count == 0
    # a lookup does not refresh A: A (released at t=1) still goes before B (t=2)
    assert evict_one_by_one(m, 4) == [1, 0, 3, 2]


def test_decode_appends_fill_blocks_that_later_requests_hit(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=[1, 2, 3, 4, 5, 6]))
    assert m.num_cached_blocks == 1
    assert m.append("a", [7, 8]) == []  # block 1 was already allocated
    assert m.num_cached_blocks == 2
    decoded = m.block(1)
    assert decoded.created_by == "decode" and decoded.tokens.tolist() == [5, 6, 7, 8]
    assert decoded.block_hash == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    assert m.append("a", [9]) == [2]
    assert m.sequence("a").tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert m.sequence("a").num_tokens == 9
    # decode appends are not hits
    assert m.block(0).hit_count == 0 and decoded.hit_count == 0
    assert (m.stats.prefix_cache_queries, m.stats.prefix_cache_hits) == (6, 0)
    m.finish("a")
    assert m.num_free_blocks == 6  # the partial block 2 went back
    seq = m.begin(Request("b", tokens=[1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert seq.num_cached_tokens == 8 and seq.block_table[:2] == [0, 1]
    assert decoded.hit_count == 1
    assert m.stats.prefix_cache_hits == 8
    m.check()


def test_append_returns_every_new_block(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=[1]))
    assert m.append("a", list(range(2, 12))) == [1, 2]  # 11 tokens: blocks 0, 1, 2
    assert m.num_cached_blocks == 2
    assert m.append("a", []) == []
    assert m.sequence("a").num_tokens == 11
    m.check()


def test_finish_releases_tail_first(make_manager, evict_one_by_one):
    m = make_manager(8)
    m.begin(Request("a", tokens=[*A, 1, 2]))  # 3 cached blocks and a partial one
    m.finish("a")
    assert m.num_free_blocks == 5  # 8 - 3 cached (the partial block 3 was freed)
    assert m.num_evictable_blocks == 3
    assert sorted(m.tree.candidates) == [2]  # only the tail is a candidate
    # released tail first: the access counter orders tail < middle < head
    ticks = [m.block(b).last_access_tick for b in (2, 1, 0)]
    assert ticks == sorted(ticks) and len(set(ticks)) == 3
    assert m.stats.finished == 1 and "a" not in m.sequences
    assert evict_one_by_one(m, 1) == [2]
    assert sorted(m.tree.candidates) == [1]  # its parent became the candidate
    assert evict_one_by_one(m, 2) == [1, 0]
    assert m.num_cached_blocks == 0 and m.stats.evictions == 3
    assert m.stats.evictions_by_class == {"chat": 3}
    assert m.evict(5) == 0


def test_on_finish_carries_the_answers_length(make_manager):
    """A request that declared no output (a transformers turn: generate() decides) finishes
    with the tokens appended as its ``output_len``; a declared one is kept."""
    from kvevict.policies.lru import LRU

    class Lengths(LRU):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_finish(self, request, blocks, now):
            self.seen.append((request.request_id, request.output_len, request.turn))

    policy = Lengths()
    m = KVCacheManager(BlockPool(12, 4), policy)
    m.begin(Request("a", tokens=A, turn=2))
    m.append("a", [1, 2, 3])
    m.append("a", [4, 5])
    m.begin(Request("b", tokens=B, output_len=7))
    m.append("b", [1, 2])
    m.begin(Request("c", tokens=C[:4]))
    m.finish("a")
    m.finish("b")
    m.finish("c")
    assert policy.seen == [("a", 5, 2), ("b", 7, 0), ("c", 0, 0)]
    assert m.sequences == {} and m.stats.finished == 3
    m.check()


def test_evict_count_is_capped_and_validated(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=A))
    m.begin(Request("b", tokens=B[:8]))
    m.finish("b")
    assert m.evict(10) == 2  # a's blocks are in use
    assert m.num_cached_blocks == 3
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="count must be a non-negative int"):
            m.evict(bad)
        m.check()


# -- dedup -------------------------------------------------------------------------------------


def test_identical_decoded_block_is_deduplicated(make_manager):
    m = make_manager(8)
    a = m.begin(Request("a", tokens=[1, 2], session_id="sa"))
    b = m.begin(Request("b", tokens=[1, 2], session_id="sb"))  # no full block: nothing to hit
    assert (a.block_table, b.block_table) == ([0], [1])
    m.append("a", [3, 4])
    assert m.block(0) is not None and m.stats.inserted_blocks == 1
    m.append("b", [3, 4])  # same chained hash as a's block 0
    assert b.block_table == [0]  # points to a's cached block
    assert m.block(1) is None and not m.pool.is_used(1)  # the duplicate was freed
    assert m.block(0).ref_count == 2 and m.pool.ref_count(0) == 2
    assert m.block(0).hit_count == 0  # not a prefix hit
    assert set(m.block(0).sharers) == {"sa", "sb"}
    assert m.stats.inserted_blocks == 1 and m.num_cached_blocks == 1
    assert m.num_free_blocks == 7
    m.check()
    m.append("b", [5])
    assert b.block_table == [0, 1]
    m.finish("a")
    m.finish("b")
    assert sorted(m.tree.candidates) == [0] and m.num_free_blocks == 7
    m.check()


def test_dedup_against_a_released_candidate(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=[1, 2]))
    b = m.begin(Request("b", tokens=[1, 2]))
    m.append("a", [3, 4])
    m.finish("a")
    assert sorted(m.tree.candidates) == [0] and len(m.policy) == 1
    m.append("b", [3, 4])
    assert b.block_table == [0]
    assert m.tree.candidates == {} and len(m.policy) == 0  # no longer evictable
    assert m.num_evictable_blocks == 0 and m.num_free_blocks == 7
    m.check()


# -- back-pressure -----------------------------------------------------------------------------


def test_out_of_blocks_on_begin_leaves_state_unchanged(make_manager):
    m = make_manager(4)
    m.begin(Request("a", tokens=A[:8]))
    m.begin(Request("b", tokens=B[:8]))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match=r"request 'c' needs 1 new blocks but only 0 can be "
                                          r"freed \(0 free, 0 evictable cached\)") as info:
        m.begin(Request("c", tokens=[1]))
    assert (info.value.needed, info.value.available) == (1, 0)
    assert snapshot(m) == before and "c" not in m.sequences
    m.check()
    m.finish("a")
    seq = m.begin(Request("c", tokens=[1]))
    assert seq.block_table == [1]  # a's tail was evicted and reused
    assert m.lookup(A[:8]).block_ids == (0,)
    m.check()


def test_out_of_blocks_counts_hit_blocks_as_not_evictable(make_manager):
    m = make_manager(4)
    m.begin(Request("a", tokens=A[:8]))
    m.begin(Request("x", tokens=[1, 2]))
    m.begin(Request("y", tokens=[3, 4]))
    m.finish("a")  # blocks 0, 1 cached and evictable; 2, 3 in use
    before = snapshot(m)
    # hits both of a's blocks and needs 3 more: 0 free + 2 evictable - 2 held by the hit
    with pytest.raises(OutOfBlocks, match="needs 3 new blocks but only 0 can be freed") as info:
        m.begin(Request("c", tokens=A[:8] + [5] * 9))
    assert (info.value.needed, info.value.available) == (3, 0)
    assert snapshot(m) == before
    assert m.block(0).ref_count == 0 and m.block(0).hit_count == 0
    m.check()


def test_out_of_blocks_on_append_leaves_state_unchanged(make_manager):
    m = make_manager(4)
    m.begin(Request("a", tokens=A[:8]))
    m.begin(Request("b", tokens=B[:8]))
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="sequence 'a' needs 1 more blocks but only 0 can be "
                                          "freed") as info:
        m.append("a", [1])
    assert (info.value.needed, info.value.available) == (1, 0)
    assert snapshot(m) == before
    assert m.sequence("a").tokens == A[:8]
    m.check()
    m.finish("b")
    assert m.append("a", [1]) == [3]  # b's tail (block 3) evicted and reused
    assert m.sequence("a").block_table == [0, 1, 3]
    assert m.lookup(B[:8]).block_ids == (2,)
    m.check()


# -- preempt / resume --------------------------------------------------------------------------


def test_preempt_releases_and_resume_hits_the_cached_prefix(make_manager, clock):
    m = make_manager(8)
    m.begin(Request("a", tokens=A[:10]))
    m.append("a", [1, 2, 3])  # 13 tokens: 3 cached blocks and a partial one
    assert m.sequence("a").block_table == [0, 1, 2, 3]
    clock.set(1)
    seq = m.preempt("a")
    assert seq.status == "preempted" and seq.block_table == []
    assert m.num_free_blocks == 5 and m.num_evictable_blocks == 3
    assert m.stats.preemptions == 1 and "a" in m.sequences
    m.check()
    clock.set(2)
    seq = m.resume("a")
    assert seq.status == "running"
    assert seq.num_cached_tokens == 12 and seq.num_tokens == 13
    assert seq.block_table == [0, 1, 2, 3]
    assert m.stats.requests == 2 and m.stats.block_hits == 3
    assert m.stats.prefix_cache_hits == 12 and m.stats.prefix_cache_queries == 10 + 13
    # the partial tail survived the preemption: completing it caches the right tokens
    m.append("a", [4, 5, 6])
    assert m.block(2).tokens.tolist() == [108, 109, 1, 2]
    assert m.block(3).tokens.tolist() == [3, 4, 5, 6]
    assert m.block(3).created_by == "decode"
    assert m.lookup([*A[:10], 1, 2, 3, 4, 5, 6]).num_cached_blocks == 4
    m.check()


def test_resume_after_partial_eviction_recaches_from_tokens(make_manager, evict_one_by_one):
    m = make_manager(8)
    m.begin(Request("a", tokens=A[:10]))
    m.append("a", [1, 2])
    m.preempt("a")
    assert evict_one_by_one(m, 1) == [2]  # the tail (prompt 8..9 + decoded 1, 2)
    seq = m.resume("a")
    assert seq.num_cached_tokens == 8 and seq.block_table == [0, 1, 2]
    assert m.block(2).tokens.tolist() == [108, 109, 1, 2]
    assert m.block(2).created_by == "prefill"
    assert m.lookup([*A[:10], 1, 2]).num_cached_blocks == 3
    m.check()


def test_preempt_resume_errors(make_manager):
    m = make_manager(4)
    m.begin(Request("a", tokens=A[:8]))
    with pytest.raises(ConfigError, match="sequence 'a' is running, not preempted"):
        m.resume("a")
    m.check()
    m.preempt("a")
    before = snapshot(m)
    with pytest.raises(ConfigError, match="sequence 'a' is preempted, not running"):
        m.preempt("a")
    with pytest.raises(ConfigError, match="sequence 'a' is preempted; resume it before "
                                          "appending"):
        m.append("a", [1])
    assert snapshot(m) == before
    m.check()
    # while preempted its blocks are evictable; a resume that cannot fit fails cleanly
    m.begin(Request("b", tokens=[*B[:8], 1, 2, 3, 4, 5]))  # evicts both of a's blocks
    assert m.num_cached_blocks == 3 and m.lookup(A[:8]).num_cached_blocks == 0
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="request 'a' needs 2 new blocks but only 0"):
        m.resume("a")
    assert snapshot(m) == before and m.sequence("a").status == "preempted"
    m.check()
    m.finish("a")  # a preempted sequence can be dropped
    assert "a" not in m.sequences and m.stats.finished == 1
    m.check()


# -- explicit pins -----------------------------------------------------------------------------


def _released(m, clock, t, tokens, rid):
    clock.set(t)
    m.begin(Request(rid, tokens=tokens))
    m.finish(rid)


def _two_released_chains(m, clock):
    """A (blocks 0, 1) released at t=1, B (blocks 2, 3) released at t=2."""
    _released(m, clock, 1, A[:8], "a")
    _released(m, clock, 2, B[:8], "b")


def _three_released_blocks(m, clock):
    """One-block prompts A (block 0), B (block 1), C (block 2) released at t=1, 2, 3."""
    _released(m, clock, 1, A[:4], "a")
    _released(m, clock, 2, B[:4], "b")
    _released(m, clock, 3, C[:4], "c")


def test_pinned_block_outlives_newer_unpinned_ones(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    assert m.pin(A[:4]) == 1
    assert m.is_pinned(0) and not m.is_pinned(1)
    assert len(m.policy) == 2  # the pinned candidate is withheld from the policy
    m.check()
    assert evict_one_by_one(m, 2) == [1, 2]  # B and C go first although A is older
    assert evict_one_by_one(m, 1) == [0]  # then only the pinned candidate is left
    assert m.stats.evictions == 3


def test_pinned_candidates_go_earliest_expiry_first(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    assert m.pin(A[:4], until=100) == 1
    assert m.pin(B[:4], until=50) == 1
    assert m.pin(C[:4]) == 1  # until unpinned
    assert evict_one_by_one(m, 3) == [1, 0, 2]


def test_pin_with_until_expires(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    assert m.pin(A[:4], until=10) == 1
    clock.set(9)
    assert evict_one_by_one(m, 1) == [1]  # before t=10 A is shielded: B goes
    clock.set(11)
    # the pin lapsed: A is offered to LRU again and, released at t=1, goes before C (t=3)
    assert evict_one_by_one(m, 1) == [0]
    assert not m.is_pinned(0)
    assert evict_one_by_one(m, 1) == [2]


def test_longer_pin_wins_over_a_shorter_one(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    m.pin(A[:4], until=20)
    m.pin(A[:4], until=10)  # does not shorten the pin
    clock.set(15)
    assert evict_one_by_one(m, 2) == [1, 2]
    m.pin(B[:4], until=30)  # B is gone: nothing to pin
    clock.set(21)
    assert evict_one_by_one(m, 1) == [0]


def test_pin_in_the_past_pins_nothing(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    clock.set(5)
    assert m.pin(A[:4], until=5) == 0
    assert not m.is_pinned(0)
    assert evict_one_by_one(m, 1) == [0]


def test_unpin_hands_blocks_back_to_the_policy(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    assert m.pin(A[:4]) == 1
    assert m.unpin(A[:4]) == 1
    assert m.unpin(A[:4]) == 0
    assert not m.is_pinned(0) and len(m.policy) == 3
    m.check()
    assert evict_one_by_one(m, 3) == [0, 1, 2]


def test_pinned_candidate_hit_and_released_stays_withheld(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    m.pin(A[:4])
    clock.set(4)
    seq = m.begin(Request("a2", tokens=[*A[:4], 1]))  # hits the pinned candidate
    assert seq.block_table[0] == 0 and len(m.policy) == 2
    m.check()
    m.finish("a2")
    assert len(m.policy) == 2
    m.check()
    assert evict_one_by_one(m, 3) == [1, 2, 0]


def test_pinned_chain_inner_block_stays_pinned(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    _two_released_chains(m, clock)
    assert m.pin(A[:8]) == 2  # block 1 is a candidate, block 0 (its parent) is not
    assert evict_one_by_one(m, 2) == [3, 2]  # B goes first although A is older
    # only pinned candidates are left: A's tail, then A's head (pinned when it was inner)
    assert evict_one_by_one(m, 2) == [1, 0]


def test_pinned_block_in_use_stays_pinned_after_release(make_manager, clock, evict_one_by_one):
    m = make_manager(8)
    clock.set(1)
    m.begin(Request("a", tokens=A[:4]))
    assert m.pin(A[:4]) == 1  # in use: not a candidate yet
    clock.set(2)
    m.finish("a")  # now a pinned candidate: must be withheld
    _released(m, clock, 3, B[:4], "b")
    assert len(m.policy) == 1
    m.check()
    assert evict_one_by_one(m, 2) == [1, 0]  # LRU alone would take A (t=2) first


def test_is_pinned_reads_the_clock(make_manager, clock):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    m.pin(A[:4], until=10)
    assert m.is_pinned(0)
    clock.set(11)
    assert not m.is_pinned(0)


@pytest.mark.parametrize("bad", ["10", True, float("nan")])
def test_pin_rejects_a_bad_until(make_manager, clock, bad):
    m = make_manager(8)
    _three_released_blocks(m, clock)
    with pytest.raises(ConfigError, match="until must be a clock time"):
        m.pin(A[:4], until=bad)
    assert not m.is_pinned(0)
    m.check()


# -- trace-style requests (block hashes) -------------------------------------------------------


def test_hash_requests_hit_and_append_counts(make_manager):
    m = make_manager(8)
    seq = m.begin(Request("r1", block_hashes=["h0", "h1", "h2"], num_tokens=12))
    assert seq.block_table == [0, 1, 2] and seq.tokens is None
    assert m.block(1).parent_hash == "h0" and m.block(1).tokens is None
    assert m.append("r1", 5) == [3, 4]  # 17 tokens: 5 blocks; appended blocks are not cached
    assert m.num_cached_blocks == 3 and seq.num_tokens == 17
    m.finish("r1")
    seq = m.begin(Request("r2", block_hashes=["h0", "h1", "x2"], num_tokens=11))
    assert seq.num_cached_tokens == 8 and seq.block_table[:2] == [0, 1]
    assert m.stats.block_hits == 2 and m.stats.prefix_cache_hits == 8
    assert m.lookup(Request("q", block_hashes=["h0", "zz"], num_tokens=8)).block_ids == (0,)
    m.check()


def test_hash_request_chain_errors(make_manager):
    m = make_manager(8)
    m.begin(Request("r1", block_hashes=["h0", "h1"], num_tokens=8))
    m.finish("r1")
    before = snapshot(m)
    with pytest.raises(ConfigError, match="block id 'h1' is cached under parent 'h0' but "
                                          "follows 0 here; block_hashes must be prefix-chained"):
        m.begin(Request("bad1", block_hashes=["h1"], num_tokens=4))
    with pytest.raises(ConfigError, match="block id 'h1' is cached but an earlier id of this "
                                          "request is not"):
        m.begin(Request("bad2", block_hashes=["zz", "h1"], num_tokens=8))
    with pytest.raises(ConfigError, match="block_hashes repeat an id"):
        m.begin(Request("bad3", block_hashes=["q", "q"], num_tokens=8))
    with pytest.raises(ConfigError, match="3 block hashes for 8 tokens; expected at most 2 "
                                          "blocks of 4"):
        m.begin(Request("bad4", block_hashes=["a", "b", "c"], num_tokens=8))
    assert snapshot(m) == before
    assert m.block(0).hit_count == 0
    m.check()


def test_hash_request_append_needs_a_count(make_manager):
    m = make_manager(8)
    m.begin(Request("r1", block_hashes=["h0"], num_tokens=4))
    before = snapshot(m)
    for bad in ([1, 2], -1, True):
        with pytest.raises(ConfigError, match="was given as block hashes; append a token count"):
            m.append("r1", bad)
    assert snapshot(m) == before
    m.check()


def test_resume_of_a_hash_request(make_manager):
    m = make_manager(8)
    m.begin(Request("r1", block_hashes=["h0", "h1"], num_tokens=8))
    m.append("r1", 3)
    m.preempt("r1")
    seq = m.resume("r1")
    assert seq.num_cached_tokens == 8 and seq.num_tokens == 11
    assert seq.block_table[:2] == [0, 1] and len(seq.block_table) == 3
    m.check()


# -- bad input ---------------------------------------------------------------------------------


def test_empty_prompt_is_rejected(make_manager):
    m = make_manager(4)
    m.begin(Request("a", tokens=A[:4]))
    before = snapshot(m)
    with pytest.raises(ConfigError, match="request 'e' has an empty prompt"):
        m.begin(Request("e", tokens=[]))
    with pytest.raises(ConfigError, match="request 'f' has an empty prompt"):
        m.begin(Request("f", block_hashes=[], num_tokens=0))
    assert snapshot(m) == before
    m.check()


def test_duplicate_request_id_is_rejected(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=A[:4]))
    before = snapshot(m)
    with pytest.raises(ConfigError, match="a sequence with id 'a' is already live"):
        m.begin(Request("a", tokens=B[:4]))
    assert snapshot(m) == before
    m.check()


def test_begin_takes_a_request(make_manager):
    m = make_manager(8)
    with pytest.raises(ConfigError, match="begin\\(\\) takes a Request, got list"):
        m.begin([1, 2, 3])
    m.check()


@pytest.mark.parametrize("tokens, match", [
    ([[1, 2], [3, 4]], "must be a 1-D sequence of integer token ids"),
    ([1.5, 2.0], "must hold integer token ids, got dtype float64"),
    ([1, -1], "must be non-negative token ids"),
])
def test_bad_tokens_are_rejected_in_requests_and_appends(make_manager, tokens, match):
    m = make_manager(8)
    with pytest.raises(ConfigError, match=match):
        Request("x", tokens=tokens)
    m.begin(Request("a", tokens=[1, 2]))
    before = snapshot(m)
    with pytest.raises(ConfigError, match=match):
        m.append("a", tokens)
    with pytest.raises(ConfigError, match=match):
        m.append("a", np.array(tokens))
    assert snapshot(m) == before
    m.check()


def test_unknown_sequence_id(make_manager):
    m = make_manager(8)
    m.begin(Request("a", tokens=A[:4]))
    before = snapshot(m)
    for call in (lambda: m.append("nope", [1]), lambda: m.finish("nope"),
                 lambda: m.preempt("nope"), lambda: m.resume("nope"),
                 lambda: m.sequence("nope")):
        with pytest.raises(ConfigError, match="no live sequence with id 'nope'"):
            call()
    assert snapshot(m) == before
    m.check()
    m.finish("a")
    with pytest.raises(ConfigError, match="no live sequence with id 'a'"):
        m.finish("a")
    m.check()


def test_a_clock_that_goes_backwards_is_rejected():
    clock = ManualClock(5)
    m = KVCacheManager(BlockPool(8, 4), "lru", clock=clock)
    m.begin(Request("a", tokens=A[:8]))
    clock.now = 3.0  # a broken clock; ManualClock.set() itself refuses this
    before = snapshot(m)
    with pytest.raises(ConfigError, match=r"the clock went backwards: 3\.0 after 5\.0"):
        m.begin(Request("b", tokens=A[:8]))
    with pytest.raises(ConfigError, match="the clock went backwards"):
        m.finish("a")
    with pytest.raises(ConfigError, match="the clock went backwards"):
        m.append("a", [1])
    with pytest.raises(ConfigError, match="the clock went backwards"):
        m.preempt("a")
    assert snapshot(m) == before
    assert m.sequence("a").status == "running" and "b" not in m.sequences
    m.check()
    clock.now = 6.0
    m.finish("a")
    assert m.block(1).last_access == 6.0
    m.check()


def test_manager_constructor_validation():
    pool = BlockPool(4, 4)
    with pytest.raises(ConfigError, match="pool must be a BlockPool, got int"):
        KVCacheManager(4)
    with pytest.raises(ConfigError, match="clock must be a callable"):
        KVCacheManager(pool, clock=3.0)
    with pytest.raises(ConfigError, match="extra_key must be None, int, str, bytes"):
        KVCacheManager(pool, extra_key=1.5)
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        KVCacheManager(pool, "nope")


def test_extra_key_separates_managers_hashes(clock):
    m1 = KVCacheManager(BlockPool(4, 4), clock=clock, extra_key="model-a")
    m2 = KVCacheManager(BlockPool(4, 4), clock=clock, extra_key="model-b")
    m1.begin(Request("a", tokens=A[:4]))
    m2.begin(Request("a", tokens=A[:4]))
    assert m1.block(0).block_hash == block_hashes(A[:4], 4, "model-a")[0]
    assert m1.block(0).block_hash != m2.block(0).block_hash


class _BadVictim(Policy):
    """Tracks candidates correctly but always names the same block as the victim."""

    def __init__(self, victim_id):
        self.victim_id = victim_id
        self.candidates = set()

    def on_candidate(self, block, now):
        self.candidates.add(block.block_id)

    def on_uncandidate(self, block, now):
        self.candidates.discard(block.block_id)

    def on_evict(self, block, now):
        self.candidates.discard(block.block_id)

    def victim(self, now):
        return self.victim_id

    def __len__(self):
        return len(self.candidates)


def test_a_policy_raising_on_preempt_leaves_the_sequence_running(clock):
    """``on_preempt`` comes before the release: if it raises, nothing is released, the
    sequence still runs, and the manager raises `PolicyError` naming the event."""
    from kvevict.policies.lru import LRU

    class Refuses(LRU):
        def on_preempt(self, request, blocks, now):
            raise RuntimeError("no")

    m = KVCacheManager(BlockPool(4, 4), Refuses(), clock=clock)
    m.begin(Request("a", tokens=A[:10]))
    before = snapshot(m)
    with pytest.raises(PolicyError, match=r"on_preempt\(\) raised: RuntimeError: no"):
        m.preempt("a")
    assert snapshot(m) == before and m.sequence("a").status == "running"
    m.check()


@pytest.mark.parametrize("victim_id", [2, 0, 99])
def test_policy_naming_a_non_candidate_raises_and_leaves_cache_consistent(clock, victim_id):
    """2: held by a running sequence; 0: the block the new request hits; 99: no such block."""
    m = KVCacheManager(BlockPool(3, 4), _BadVictim(victim_id), clock=clock)
    m.begin(Request("a", tokens=A[:8]))  # blocks 0, 1
    m.begin(Request("x", tokens=[1, 2]))  # block 2, running
    clock.set(1)
    m.finish("a")
    clock.set(2)
    before = snapshot(m)
    # hits block 0 and needs 1 block: forces an eviction
    with pytest.raises(PolicyError, match=f"returned block {victim_id}, which is not a "
                                          "candidate"):
        m.begin(Request("b", tokens=[*A[:4], 7, 7, 7, 7]))
    m.check()
    assert snapshot(m) == before
    assert m.block(0).ref_count == 0 and m.pool.ref_count(0) == 0  # the hit was let go
    assert m.block(0).hit_count == 0 and "b" not in m.sequences
    assert m.policy.candidates == {1}
    with pytest.raises(PolicyError, match="which is not a candidate"):
        m.append("x", [3, 4, 5])
    m.check()
    assert snapshot(m) == before


class _NoVictim(_BadVictim):
    def victim(self, now):
        return None


def test_policy_returning_none_while_holding_candidates(clock):
    m = KVCacheManager(BlockPool(4, 4), _NoVictim(None), clock=clock)
    m.begin(Request("a", tokens=A[:8]))
    m.finish("a")
    before = snapshot(m)
    with pytest.raises(PolicyError, match=r"victim\(\) returned None but it holds 1 candidates"):
        m.evict(1)
    m.check()
    assert snapshot(m) == before


class _Forgetful(_BadVictim):
    """Never forgets a candidate, so it names a pinned one the manager withheld."""

    def on_uncandidate(self, block, now):
        pass

    def victim(self, now):
        return min(self.candidates)

    __len__ = None  # its count is wrong on purpose; check() must not rely on it


def test_policy_naming_a_withheld_pinned_block(make_manager, clock):
    m = KVCacheManager(BlockPool(4, 4), _Forgetful(None), clock=clock)
    m.begin(Request("a", tokens=A[:4]))
    m.finish("a")
    m.begin(Request("b", tokens=B[:4]))
    m.finish("b")
    m.pin(A[:4])
    before = snapshot(m)
    with pytest.raises(PolicyError, match="returned block 0, which is a pinned candidate the "
                                          "policy was never offered"):
        m.evict(1)
    m.check()
    assert snapshot(m) == before and m.is_pinned(0)


class _RaisesOnHit(_BadVictim):
    def on_hit(self, block, now):
        raise RuntimeError("policy bug in on_hit")


def test_policy_raising_in_on_hit_leaves_cache_consistent(clock):
    m = KVCacheManager(BlockPool(4, 4), _RaisesOnHit(None), clock=clock)
    m.begin(Request("a", tokens=A[:4]))
    m.finish("a")
    with pytest.raises((RuntimeError, PolicyError)):
        m.begin(Request("b", tokens=[*A[:4], 1]))
    assert "b" not in m.sequences
    m.check()
    assert m.pool.ref_count(0) == 0


def test_trace_block_id_zero_is_a_block_not_the_root(clock):
    """Mooncake's first block id is 0 == ROOT_HASH: it must still be its child's parent."""
    from kvevict.policies.base import ScoredPolicy

    class LowestHashFirst(ScoredPolicy):
        def score(self, block, now):
            return block.block_hash

    m = KVCacheManager(BlockPool(2, 4), LowestHashFirst(), clock=clock)
    m.begin(Request(1, block_hashes=[0, 1], num_tokens=8))
    m.finish(1)
    m.begin(Request(2, block_hashes=[5], num_tokens=4))
    m.finish(2)
    assert sorted(b.block_hash for b in m.tree) == [0, 5]  # the leaf 1 went, not its parent 0
    m.check()
    assert m.begin(Request(3, block_hashes=[0, 1], num_tokens=8)).num_cached_tokens == 4
    m.check()


def test_a_popular_block_remembers_only_the_most_recent_sharers(clock):
    from kvevict.types import MAX_SHARERS

    m = KVCacheManager(BlockPool(8, 4), "lru", clock=clock)
    for i in range(MAX_SHARERS + 10):
        clock.advance(1.0)
        m.begin(Request(i, tokens=[1, 2, 3, 4, 9], session_id=f"s{i}"))
        m.finish(i)
    block = m.block(m.lookup([1, 2, 3, 4]).block_ids[0])
    assert block.num_sharers == MAX_SHARERS
    assert set(block.sharers) == {f"s{i}" for i in range(10, MAX_SHARERS + 10)}
    m.check()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9) | st.integers(0, 400), min_size=1, max_size=600))
def test_sharers_equal_a_last_use_ordered_record(sessions):
    """`BlockInfo.note_sharer` keeps the most recent sharer apart from the earlier ones (a
    repeat hit by the same session is one store); what `sharers` and `num_sharers` show equals a
    plain record of every session in order of last use, cut to the MAX_SHARERS most recent."""
    from collections import OrderedDict

    from kvevict.types import MAX_SHARERS, BlockInfo

    block = BlockInfo(0, 1, 0, 0, None, 0, "chat", sessions[0], 0.0, 0, None)
    model = OrderedDict([(sessions[0], 0.0)])
    for t, session in enumerate(sessions[1:], start=1):
        block.note_sharer(session, float(t))
        model.pop(session, None)
        model[session] = float(t)
        expected = dict(list(model.items())[-MAX_SHARERS:])
        assert block.sharers == expected
        assert list(block.sharers) == list(expected)  # oldest first
        assert block.num_sharers == len(expected)


def test_sharers_are_cut_back_to_the_most_recent_in_order():
    from kvevict.types import MAX_SHARERS, SHARERS_SLACK, BlockInfo

    block = BlockInfo(0, 1, 0, 0, None, 0, "chat", "s0", 0.0, 0, None)
    for i in range(1, 3 * SHARERS_SLACK):
        block.note_sharer(f"s{i}", float(i))
        assert block.num_remembered_sharers <= SHARERS_SLACK  # bounded memory
    last = 3 * SHARERS_SLACK - 1
    assert list(block.sharers) == [f"s{i}" for i in range(last - MAX_SHARERS + 1, last + 1)]
    block.note_sharer(f"s{last - 5}", float(last + 1))  # an old sharer comes back: newest
    assert list(block.sharers)[-1] == f"s{last - 5}"
    assert block.sharers[f"s{last - 5}"] == float(last + 1)
    assert block.num_sharers == MAX_SHARERS


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), -float("inf"), -0.5, "1.0",
                                     True, None])
def test_a_request_with_an_impossible_arrival_is_rejected_when_built(arrival):
    """``nan`` made `simulate` hang, ``inf`` gave a NaN p95, a negative arrival counted its
    wait from 0: each is a clear error at construction now."""
    with pytest.raises(ConfigError, match=r"request 'r': arrival must be a finite clock time "
                                          r">= 0 \(seconds\), got "):
        Request("r", tokens=[1, 2], arrival=arrival)


@pytest.mark.parametrize("arrival", [0, 0.0, 3, 2.5, np.float64(1.5), np.int64(4)])
def test_finite_non_negative_arrivals_are_accepted(arrival):
    assert Request("r", tokens=[1], arrival=arrival).arrival == arrival


def test_policy_events_of_a_request_in_order(clock):
    """What a policy hears of one request, in order: per hit block ``on_hit``, then one
    ``on_hits`` with the hits in chain order (begin and resume alike, not sent without
    hits), then ``on_insert`` per block it caches, then ``on_begin`` (a begin) or
    ``on_resume`` (a resume). A preemption sends ``on_preempt`` with the blocks it held,
    while it still holds them (none is a candidate yet)."""
    from kvevict.policies.lru import LRU

    class Recorder(LRU):
        def __init__(self):
            super().__init__()
            self.events = []

        def on_begin(self, request, hits, new, now):
            self.events.append(("begin", request.request_id, [b.block_id for b in hits],
                                [b.block_id for b in new], now))

        def on_insert(self, block, now):
            self.events.append(("insert", block.block_id))

        def on_hit(self, block, now):
            self.events.append(("hit", block.block_id, block.hit_count))

        def on_hits(self, request, hits, now):
            self.events.append(("hits", request.request_id, [b.block_id for b in hits],
                                [b.hit_count for b in hits], now))
            hits.clear()  # the policy's own copy: the manager's hits are untouched

        def on_preempt(self, request, blocks, now):
            self.events.append(("preempt", request.request_id, [b.block_id for b in blocks],
                                [b.ref_count for b in blocks], len(self), now))

        def on_resume(self, request, hits, new, now):
            self.events.append(("resume", request.request_id, [b.block_id for b in hits],
                                [b.block_id for b in new], now))

    policy = Recorder()
    m = KVCacheManager(BlockPool(8, 4), policy, clock=clock)
    m.begin(Request("a", tokens=A))
    m.finish("a")
    assert policy.events == [("insert", 0), ("insert", 1), ("insert", 2),
                             ("begin", "a", [], [0, 1, 2], 0.0)]
    policy.events.clear()
    clock.set(2.0)
    seq = m.begin(Request("b", tokens=[*A[:8], *C[:5]]))
    assert policy.events == [("hit", 0, 1), ("hit", 1, 1), ("hits", "b", [0, 1], [1, 1], 2.0),
                             ("insert", 3), ("begin", "b", [0, 1], [3], 2.0)]
    assert [b.block_id for b in seq.cached_blocks] == [0, 1, 3]
    policy.events.clear()
    clock.set(2.5)
    m.preempt("b")
    assert policy.events == [("preempt", "b", [0, 1, 3], [1, 1, 1], 1, 2.5)]  # a's 2 left
    assert len(policy) == 2  # then released: the leaves 2 (a's tail) and 3 (b's) are candidates
    policy.events.clear()
    clock.set(3.0)
    m.resume("b", max_new_tokens=0)
    assert policy.events == [("hit", 0, 2), ("hit", 1, 2), ("hit", 3, 1),
                             ("hits", "b", [0, 1, 3], [2, 2, 1], 3.0),
                             ("resume", "b", [0, 1, 3], [], 3.0)]
    m.check()
