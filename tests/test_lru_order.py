"""LRU's queue-plus-heap index names exactly the candidate a brute-force minimum would.

The manager stamps accesses with a strictly increasing tick while the clock never goes back,
so LRU order is tick order. Candidates mostly arrive with the newest tick (a released chain)
but some arrive late, with an older one (a parent left a leaf by an eviction, a rolled-back
hit, an unpinned block): the index must still pick the smallest tick among live candidates.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvevict.policies.lru import LRU
from kvevict.types import BlockInfo


def record(block_id: int, tick: int) -> BlockInfo:
    return BlockInfo(block_id, ("h", block_id), None, 0, None, 1, "chat", "s", float(tick),
                     tick, None)


ops = st.lists(st.tuples(st.sampled_from(["new", "late", "drop", "reoffer", "evict"]),
                         st.integers(0, 10**6)), max_size=120)


@given(ops)
def test_victim_is_the_oldest_live_candidate(operations):
    lru = LRU()
    live: dict[int, int] = {}  # block id -> tick (the reference)
    used_ticks: set[int] = set()
    dropped: dict[int, int] = {}  # dropped, not evicted: may come back with the same tick
    newest = 0
    next_id = 0
    for op, r in operations:
        if op in ("new", "late"):
            if op == "new":
                newest += 1 + r % 3
                tick = newest
            else:  # an older tick nobody holds (unique, like the manager's counter)
                tick = r % (newest + 1)
                if tick in used_ticks:
                    continue
            used_ticks.add(tick)
            live[next_id] = tick
            lru.on_candidate(record(next_id, tick), 0.0)
            next_id += 1
        elif op == "drop" and live:
            block_id = sorted(live)[r % len(live)]
            dropped[block_id] = live.pop(block_id)
            lru.on_uncandidate(record(block_id, dropped[block_id]), 0.0)
        elif op == "reoffer" and dropped:
            block_id = sorted(dropped)[r % len(dropped)]
            tick = dropped.pop(block_id)  # even r: a rolled-back hit, back with its old tick
            if r % 2:  # odd r: touched since, and back late with a new (still old) tick
                fresh = r % (newest + 1)
                if fresh not in used_ticks:
                    used_ticks.add(fresh)
                    tick = fresh
            live[block_id] = tick
            lru.on_candidate(record(block_id, tick), 0.0)
        elif op == "evict":
            expected = min(live, key=live.__getitem__) if live else None
            assert lru.victim(0.0) == expected
            if expected is not None:
                lru.on_evict(record(expected, live.pop(expected)), 0.0)
        assert len(lru) == len(live)
    while live:  # drain: the whole remaining order
        expected = min(live, key=live.__getitem__)
        assert lru.victim(0.0) == expected
        lru.on_evict(record(expected, live.pop(expected)), 0.0)
    assert lru.victim(0.0) is None


def test_a_block_back_late_with_a_newer_tick_is_not_found_at_its_old_one():
    lru = LRU()
    for block_id, tick in ((0, 10), (1, 20)):  # in order: the queue
        lru.on_candidate(record(block_id, tick), 0.0)
    lru.on_candidate(record(2, 5), 0.0)  # late: the heap
    lru.on_uncandidate(record(2, 5), 0.0)  # hit ...
    lru.on_candidate(record(2, 15), 0.0)  # ... and back, still late, with a newer tick
    lru.on_candidate(record(3, 12), 0.0)  # another late one, between
    order = []
    while (victim := lru.victim(0.0)) is not None:
        order.append(victim)
        lru.on_evict(record(victim, 0), 0.0)
    assert order == [0, 3, 2, 1]  # ticks 10, 12, 15, 20
