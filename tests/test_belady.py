"""Belady's offline oracle: exact victims, prefix closure, futures from requests, optimality."""

from __future__ import annotations

import functools
import itertools
import math
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st
from oracle_harness import BS, Harness, req

from kvevict import BlockPool, ConfigError, KVCacheManager, ManualClock, Request, make_policy
from kvevict.policies.belady import Belady, request_times
from kvevict.policies.oracles import HorizonOracle
from kvevict.prefix import block_hashes
from kvevict.replay import replay
from kvevict.testing import machine_for

# -- exact victims on hand-built futures ----------------------------------------------------


def test_evicts_the_furthest_next_use_first():
    future = {10: [0, 6], 20: [1, 5], 30: [2, 7], 40: [3]}
    h = Harness(3, Belady(future))
    for t, ids in enumerate([[10], [20], [30]]):
        h.run(t, ids)
    h.run(3, [40])  # candidates: 10 (next 6), 20 (next 5), 30 (next 7)
    assert h.evicted == [30]
    h.run(4, [50])  # 10 (6), 20 (5), 40 (never again) -> 40
    assert h.evicted == [30, 40]
    h.run(5, [20])  # a hit: nothing evicted
    assert h.evicted == [30, 40]
    h.run(6, [10])  # a hit
    h.run(7, [60])  # 10, 20 and 50 are all never used again: least recently used (50) first
    assert h.evicted == [30, 40, 50]


def test_never_used_blocks_go_first_and_tie_by_least_recent_use():
    future = {1: [0, 100], 2: [1], 3: [2], 4: [3]}
    h = Harness(4, Belady(future))
    for t, ids in enumerate([[1], [2], [3], [4]]):
        h.run(t, ids)
    h.run(4, [5])  # 2, 3, 4 never again: the oldest (2) first; 1 (used at 100) stays
    h.run(5, [6])
    h.run(6, [7])
    assert h.evicted == [2, 3, 4]
    h.run(7, [8])  # now 1 (next 100) is the only candidate with a future: 5 goes first
    assert h.evicted == [2, 3, 4, 5]


def test_next_use_is_strictly_after_now():
    policy = Belady({7: [3, 1, 5]})  # unsorted input is sorted
    assert policy.next_use(7, 0) == 1
    assert policy.next_use(7, 1) == 3  # an access at ``now`` is the current one, not next
    assert policy.next_use(7, 4.5) == 5
    assert policy.next_use(7, 5) == math.inf
    assert policy.next_use(8, 0) == math.inf
    assert policy.num_blocks_known == 1


def test_tail_first_within_a_released_chain():
    """Never-used chains lose their tail first (ties go to the least recent release)."""
    h = Harness(3, Belady())
    h.run(0, [1, 2, 3])
    h.run(1, [4, 5])
    assert h.evicted == [3, 2]


# -- prefix closure -------------------------------------------------------------------------


class _Recording(Belady):
    def __init__(self, future):
        super().__init__(future)
        self.offered = []

    def on_candidate(self, block, now):
        assert block.num_children == 0, "an inner block was offered"
        self.offered.append(block.block_hash)
        super().on_candidate(block, now)


def test_inner_blocks_are_never_offered_even_with_the_furthest_next_use():
    # An inconsistent future: the root block 1 is never used again, its descendants soon.
    # Block 1 has the furthest next use, but it is not a leaf, so it is never offered.
    future = {1: [], 2: [10], 3: [11], 4: [12], 5: [12]}
    policy = _Recording(future)
    h = Harness(3, policy)
    h.run(0, [1, 2, 3])
    assert policy.offered == [3]
    h.run(1, [4])  # 3 is the only candidate; then 2 becomes a leaf
    assert h.evicted == [3] and policy.offered == [3, 2, 4]
    h.run(2, [5])  # candidates 2 (next 10) and 4 (next 12): 4 goes, 1 stays
    assert h.evicted == [3, 4]
    assert 1 not in policy.offered
    h.manager.evict(2)  # emptying the cache takes 5 (next 12), then 2 (next 10)
    assert h.evicted[2:] == [5, 2]
    assert policy.offered[-1] == 1


# -- the future from requests ---------------------------------------------------------------


def test_from_requests_hash_mode_uses_ids_and_indices():
    reqs = [req(0, [1, 2], 5.0), req(1, [1, 3], 5.0), req(2, [1, 2, 4], 9.0)]
    policy = Belady.from_requests(reqs)
    assert policy._future == {1: [0.0, 1.0, 2.0], 2: [0.0, 2.0], 3: [1.0], 4: [2.0]}
    arrival = Belady.from_requests(reqs, time="arrival")
    tie = math.nextafter(5.0, math.inf)  # equal arrivals are made strictly increasing
    assert arrival._future == {1: [5.0, tie, 9.0], 2: [5.0, 9.0], 3: [tie], 4: [9.0]}
    explicit = Belady.from_requests(reqs, time=[10, 20, 30])
    assert explicit._future[2] == [10.0, 30.0]


def test_from_requests_token_mode_hashes_like_the_manager():
    system = list(range(8))
    reqs = [Request("a", tokens=system + [9, 9]), Request("b", tokens=system + [1, 1, 1, 1])]
    policy = Belady.from_requests(reqs, block_size=4, extra_key="m")
    ha = block_hashes(reqs[0].tokens, 4, "m")
    hb = block_hashes(reqs[1].tokens, 4, "m")
    assert ha == hb[:2] and len(hb) == 3
    assert policy._future == {ha[0]: [0.0, 1.0], ha[1]: [0.0, 1.0], hb[2]: [1.0]}
    # the manager's blocks carry the same hashes
    manager = KVCacheManager(BlockPool(8, 4), policy, extra_key="m")
    manager.begin(reqs[1])
    assert {b.block_hash for b in manager.tree} == set(hb)


def test_from_requests_errors():
    with pytest.raises(ConfigError, match="block_size"):
        Belady.from_requests([Request("a", tokens=[1, 2, 3, 4])])
    with pytest.raises(ConfigError, match="2 values for 1 requests"):
        Belady.from_requests([req(0, [1])], time=[0, 1])
    with pytest.raises(ConfigError, match="time must be one of"):
        Belady.from_requests([req(0, [1])], time="wallclock")
    with pytest.raises(ConfigError, match="Requests"):
        Belady.from_requests([[1, 2]])


def test_constructor_validates_the_future():
    with pytest.raises(ConfigError, match="must map"):
        Belady([1, 2, 3])
    with pytest.raises(ConfigError, match="sequence of access times"):
        Belady({1: 5})
    with pytest.raises(ConfigError, match="numbers"):
        Belady({1: [0, "soon"]})
    with pytest.raises(ConfigError, match="numbers"):
        Belady({1: [float("nan")]})


def test_request_times_are_strictly_increasing():
    reqs = [req(0, [1], 3.0), req(1, [2], 3.0), req(2, [3], 1.0), req(3, [4], 7.0)]
    times = request_times(reqs, "arrival")
    assert times[0] == 3.0 and times[3] == 7.0
    assert all(a < b for a, b in itertools.pairwise(times))
    assert request_times(reqs) == [0.0, 1.0, 2.0, 3.0]


def test_registered_and_constructible_without_arguments():
    policy = make_policy("belady")
    assert isinstance(policy, Belady) and policy.num_blocks_known == 0
    assert make_policy("belady", future={1: [2]}).next_use(1, 0) == 2


def test_empty_future_degenerates_to_lru():
    reqs = _random_trace(seed=3, n=300, max_id_growth=3)
    for capacity in (4, 9, 20):
        lru = replay(reqs, "lru", capacity, BS)
        empty = replay(reqs, Belady(), capacity, BS)
        assert (empty.hits, empty.evictions) == (lru.hits, lru.evictions)


# -- the shared stateful machine --------------------------------------------------------------


class _ScrambledFuture(Belady):
    """Arbitrary (but fixed per block and time) next uses, to exercise the heap order."""

    def next_use(self, block_hash, now):
        return math.inf if block_hash % 5 == 0 else now + 1 + block_hash % 7


def test_stateful_machine_empty_future():
    machine_for(lambda: Belady()).TestCase().runTest()


def test_stateful_machine_scrambled_future():
    machine_for(_ScrambledFuture).TestCase().runTest()


def test_stateful_machine_tensor_mode_small_pool():
    machine_for(_ScrambledFuture, tensor=True, num_blocks=6).TestCase().runTest()


# -- optimality -------------------------------------------------------------------------------


def _build_trace(steps, capacity):
    """Prefix-chained hash-mode requests: each extends a random earlier chain (or the root)."""
    chains: list[tuple[int, ...]] = []
    next_id = 1
    reqs = []
    for i, (pick, grow) in enumerate(steps):
        k = pick % (len(chains) + 1)
        base = chains[k - 1] if k else ()
        if not base and not grow:
            grow = 1
        chain = base + tuple(range(next_id, next_id + grow))
        next_id += grow
        chain = chain[:capacity]
        chains.append(chain)
        reqs.append(Request(i, block_hashes=chain, num_tokens=len(chain) * BS))
    return reqs


def _random_trace(seed, n, max_id_growth):
    import random

    rnd = random.Random(seed)
    steps = [(rnd.randrange(10**6), rnd.randrange(max_id_growth + 1)) for _ in range(n)]
    return _build_trace(steps, capacity=10**6)


def _optimum(chains, capacity):
    """Most prefix hits any leaf-only demand-eviction schedule gets (exhaustive search)."""
    parent = {c[j]: (c[j - 1] if j else None) for c in chains for j in range(len(c))}

    @cache
    def best(i, resident):
        if i == len(chains):
            return 0
        ids = chains[i]
        n = 0
        while n < len(ids) and ids[n] in resident:
            n += 1
        excess = len(ids) - n - (capacity - len(resident))
        evictable = sorted(resident - set(ids[:n]))
        options = []
        for gone in itertools.combinations(evictable, max(excess, 0)):
            keep = resident - set(gone)
            if all(parent[b] is None or parent[b] in keep for b in keep):  # closure
                options.append(keep)
        return n + max(best(i + 1, frozenset(keep | set(ids[n:]))) for keep in options)

    return best(0, frozenset())


@given(
    steps=st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 2)), min_size=1,
                   max_size=9),
    capacity=st.integers(2, 4),
)
def test_belady_matches_the_exhaustive_optimum(steps, capacity):
    reqs = _build_trace(steps, capacity)
    oracle = replay(reqs, "belady", capacity, BS, check_every=1)
    best = _optimum(tuple(r.block_hashes for r in reqs), capacity)
    assert oracle.hits == best
    for name in ("lru", "lfu", "pinned"):
        assert replay(reqs, name, capacity, BS).hits <= best


@given(seed=st.integers(0, 10**6), capacity=st.integers(3, 30))
def test_belady_at_or_above_online_policies_on_random_traces(seed, capacity):
    reqs = _random_trace(seed, n=150, max_id_growth=3)
    reqs = [r for r in reqs if len(r.block_hashes) <= capacity]
    oracle = replay(reqs, "belady", capacity, BS)
    assert oracle.rejected == 0
    for name in ("lru", "lfu", "pinned"):
        assert replay(reqs, name, capacity, BS).hits <= oracle.hits


# -- the future from a file (trace scale) -----------------------------------------------------

#: Belady's block hit ratios on the bundled trace (tests/test_replay.py GOLDEN), from the
#: in-memory future and from the next-use file alike.
GOLDEN_BELADY = {1000: 0.2691, 2000: 0.3742, 5000: 0.5256, 10000: 0.6174, 20000: 0.6396}


@pytest.fixture(scope="module")
def mooncake():
    from kvevict.workloads import bundled_trace_path, read_mooncake

    return read_mooncake(bundled_trace_path())


def test_file_belady_gives_the_golden_numbers_and_the_same_victims(mooncake):
    from kvevict.policies.belady import NextUseFile

    with NextUseFile.build(mooncake, block_size=512) as future:
        for size, golden in GOLDEN_BELADY.items():
            runs = {}
            for kind, policy in (("file", future.policy(size)),
                                 ("dict", Belady.from_requests(mooncake))):
                manager = KVCacheManager(BlockPool(size, 512), policy, clock=ManualClock())
                evicted = []
                manager.add_eviction_listener(lambda b, now, out=evicted: out.append(
                    b.block_hash))
                for i, request in enumerate(mooncake):
                    manager.clock.set(float(i))
                    manager.finish(manager.begin(request).seq_id)
                runs[kind] = (manager.stats.block_hits, evicted)
            assert runs["file"] == runs["dict"], size
            assert round(runs["file"][0] / 121_877, 4) == golden
        assert future.num_slots == 43_924 and future.num_accesses == 121_877


def test_replay_builds_the_file_oracle_for_belady_by_name_only(mooncake, monkeypatch):
    from kvevict.policies import belady as module

    built = []
    original = module.FileBelady.__init__

    def spy(self, future, capacity_blocks):
        built.append(capacity_blocks)
        original(self, future, capacity_blocks)

    monkeypatch.setattr(module.FileBelady, "__init__", spy)
    reqs = mooncake[:300]
    by_name = replay(reqs, "belady", 500)
    assert built == [500]
    assert replay(reqs, "belady", 500, future={}).hits < by_name.hits  # params: no file
    assert replay(reqs, lambda: Belady.from_requests(reqs), 500).hits == by_name.hits
    assert built == [500]


def test_requests_that_share_an_id_keep_the_clock_order():
    """A request's begin consumes its accesses by id; with a repeated id the begins cannot be
    told apart, so the future stays compared with the clock (the replay's order)."""
    unique = Belady.from_requests([req(0, [1], 0.0), req(1, [1], 1.0)])
    assert unique.next_use(1, 5.0) == 0.0  # request 0 has not begun: it is still coming
    shared = Belady.from_requests([req(0, [1], 0.0), req(0, [1], 1.0)])
    assert [shared.next_use(1, t) for t in (-1.0, 0.0, 1.0)] == [0.0, 1.0, math.inf]


@pytest.mark.parametrize("build", [
    Belady.from_requests,
    functools.partial(HorizonOracle.from_requests, horizon=10.0),
    functools.partial(HorizonOracle.from_requests, horizon=math.inf),  # the reuse oracle
], ids=["belady", "horizon", "reuse"])
def test_a_preempted_requests_blocks_are_kept_for_its_resume(build):
    """Request a (blocks 1, 2) is preempted; block 9 waits for request y, planned at 5. A
    preempted request resumes, so its blocks are used again at its planned time (0): the
    oracle evicts 9, and a resumes on both of its blocks. Before `on_preempt`, a's accesses
    were consumed at its begin, its blocks looked dead, and the oracle evicted its tail.
    The horizon and reuse oracles share the future (with 9 live too, LRU order among the
    live evicts 9, released first)."""
    a, x, y = req("a", [1, 2], 0.0), req("x", [9], 1.0), req("y", [9], 5.0)
    oracle = build([a, x, y], time=[0.0, 1.0, 5.0])
    policy = getattr(oracle, "belady", oracle)  # the future the oracle looks up
    clock = ManualClock()
    m = KVCacheManager(BlockPool(3, BS), oracle, clock=clock)
    m.begin(a)
    clock.set(1.0)
    m.begin(x)
    m.finish("x")
    assert policy.next_use(1, 1.0) == math.inf  # a began: its accesses left the future
    clock.set(2.0)
    m.preempt("a")
    assert [policy.next_use(h, 2.0) for h in (1, 2, 9)] == [0.0, 0.0, 5.0]
    assert m.evict(1) == 1
    clock.set(3.0)
    assert m.resume("a").num_cached_tokens == 2 * BS
    assert policy.next_use(1, 3.0) == math.inf  # resumed: consumed again
    m.finish("a")
    clock.set(5.0)
    assert m.begin(y).num_cached_tokens == 0  # 9 was the victim
    m.check()


def test_a_preempted_request_that_finishes_does_not_come_back():
    """An aborted preempted request: what `on_preempt` put back leaves the future."""
    a = req("a", [1, 2], 0.0)
    policy = Belady.from_requests([a, req("b", [2], 4.0)], time=[0.0, 4.0])
    m = KVCacheManager(BlockPool(3, BS), policy, clock=ManualClock())
    m.begin(a)
    m.preempt("a")
    assert [policy.next_use(h, 0.0) for h in (1, 2)] == [0.0, 0.0]
    m.finish("a")
    assert [policy.next_use(h, 0.0) for h in (1, 2)] == [math.inf, 4.0]
    m.check()
