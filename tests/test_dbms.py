"""The database-style policy (``dbms``): exact LRU-2 orders, correlated references, the
five-minute rule's break-even interval and expiry, parameter checks, bounded victim cost, and
the shared stateful machine."""

from __future__ import annotations

import math

import pytest

import kvevict.policies.dbms as dbms_module
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.policies.base import available_policies, make_policy
from kvevict.policies.dbms import DBMS
from kvevict.pool import BlockPool
from kvevict.testing import machine_for
from kvevict.types import BlockInfo, Request

A = list(range(100, 112))
B = list(range(200, 212))
C = list(range(300, 312))

#: recompute_seconds(d, 4) = 4 s at any depth; a 4-token block is 1 GiB when nbytes == 0
UNIT_COST = CostModel(linear_s_per_token=1.0, attn_s_per_pair=0.0, kv_bytes_per_token=2**28)


def use(m, clock, t, tokens, rid, release_at=None):
    """Begin a request at ``t`` and finish it at ``release_at`` (default: ``t``)."""
    clock.set(t)
    m.begin(Request(rid, tokens=tokens))
    if release_at is not None:
        clock.set(release_at)
    m.finish(rid)


def test_registered_and_constructible_without_arguments():
    assert "dbms" in available_policies()
    policy = make_policy("dbms")
    assert isinstance(policy, DBMS)
    assert (policy.k, policy.correlated_period, policy.count_releases) == (2, 0.0, False)
    assert policy.rent_per_gib_s == 1 / 80 and policy.compute_value == 1.0


def test_docstrings_document_the_dbms_inspired_preemption_link():
    doc = dbms_module.__doc__
    assert "2411.07447" in doc and "preempt" in doc and "fewest processed tokens" in doc
    assert "O'Neil" in doc and "Gray and Putzolu" in doc


@pytest.mark.parametrize("policy, order", [
    ("dbms", ["c", "a", "b"]),  # c: one access (infinite distance); then oldest 2nd access
    ("lru", ["b", "a", "c"]),
])
def test_lru_2_order_on_a_hand_built_case(make_manager, clock, evict_one_by_one, policy, order):
    """a: accessed at t=1 and t=5; b: at t=3 and t=4; c: once, at t=6 (the most recent).
    LRU-2 ranks by the second most recent access: c (none) < a (t=1) < b (t=3); a block
    accessed twice recently beats a block accessed once more recently."""
    params = {"rent_per_gib_s": 0.0} if policy == "dbms" else {}
    m = make_manager(8, policy, **params)
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 3, B[:4], "b1")
    use(m, clock, 4, B[:4], "b2")
    use(m, clock, 5, A[:4], "a2")
    use(m, clock, 6, C[:4], "c1")
    ids = {"a": m.lookup(A[:4]).block_ids[0], "b": m.lookup(B[:4]).block_ids[0],
           "c": m.lookup(C[:4]).block_ids[0]}
    if policy == "dbms":
        assert m.policy.history(ids["a"]) == (5.0, 1.0)
        assert m.policy.history(ids["b"]) == (4.0, 3.0)
        assert m.policy.history(ids["c"]) == (6.0, -math.inf)
    names = {v: k for k, v in ids.items()}
    assert [names[i] for i in evict_one_by_one(m, 3)] == order


def test_blocks_with_fewer_than_k_accesses_go_first_least_recently_used_first(
        make_manager, clock, evict_one_by_one):
    m = make_manager(8, "dbms", rent_per_gib_s=0.0)
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 2, A[:4], "a2")  # a: two accesses
    use(m, clock, 3, B[:4], "b1")  # b, c: one each; b older
    use(m, clock, 4, C[:4], "c1")
    a, b, c = (m.lookup(x[:4]).block_ids[0] for x in (A, B, C))
    assert evict_one_by_one(m, 3) == [b, c, a]


def test_correlated_period_merges_close_accesses(make_manager, clock, evict_one_by_one):
    """With correlated_period=2: b's accesses at t=3 and t=4 are one reference, so b has one
    access and goes before c (LRU among single references), then a (accesses t=1, t=5)."""
    m = make_manager(8, "dbms", rent_per_gib_s=0.0, correlated_period=2.0)
    use(m, clock, 1, A[:4], "a1")
    use(m, clock, 3, B[:4], "b1")
    use(m, clock, 4, B[:4], "b2")
    use(m, clock, 5, A[:4], "a2")
    use(m, clock, 6, C[:4], "c1")
    a, b, c = (m.lookup(x[:4]).block_ids[0] for x in (A, B, C))
    assert m.policy.history(b) == (3.0, -math.inf)
    assert evict_one_by_one(m, 3) == [b, c, a]


def test_correlated_period_shifts_older_history_like_o_neil():
    """Accesses at 0, then 10 and 10.5 (correlated), then 20: the burst's length (0.5 s) is
    added to the older entry when the next uncorrelated access arrives."""
    policy = DBMS(k=3, correlated_period=1.0)
    block = BlockInfo(0, 1, None, 0, None, 0, "chat", "s", 0.0, 1, None)
    policy.on_insert(block, 0.0)
    for t in (10.0, 10.5, 20.0):
        policy.on_hit(block, t)
    assert policy.history(0) == (20.0, 10.5, 0.5)


def test_count_releases_records_the_release_as_an_access(make_manager, clock):
    m = make_manager(8, "dbms", count_releases=True)
    use(m, clock, 1, A[:4], "a1", release_at=3)
    assert m.policy.history(m.lookup(A[:4]).block_ids[0]) == (3.0, 1.0)
    m2 = make_manager(8, "dbms")
    use(m2, clock, 4, A[:4], "a1", release_at=6)
    assert m2.policy.history(m2.lookup(A[:4]).block_ids[0]) == (4.0, -math.inf)


def test_break_even_interval_formula():
    policy = DBMS(cost_model=UNIT_COST, rent_per_gib_s=0.5, compute_value=2.0)
    block = BlockInfo(0, 1, None, 3, [1, 2, 3, 4], 0, "chat", "s", 0.0, 1, None)
    # T_b = recompute 4 s * 2 / (0.5 per GiB-s * 1 GiB) = 16 s
    assert policy.break_even(block) == 16.0
    sized = BlockInfo(1, 2, None, 3, [1, 2, 3, 4], 2**29, "chat", "s", 0.0, 1, None)
    assert policy.break_even(sized) == 32.0  # half a GiB: half the rent
    assert DBMS(rent_per_gib_s=0.0).break_even(block) == math.inf
    # defaults: Llama-3-8B bf16 on an H100, a 16-token block (2 MiB) at the start of a
    # sequence: about 21 seconds
    default = BlockInfo(2, 3, None, 0, None, 2 * 2**20, "chat", "s", 0.0, 1, None)
    assert 20.0 < DBMS().break_even(default) < 22.0
    assert DBMS().break_even(default) < DBMS().break_even(
        BlockInfo(3, 4, None, 2000, None, 2 * 2**20, "chat", "s", 0.0, 1, None))


@pytest.mark.parametrize("rent, victim", [(0.5, "x"), (0.0, "y")])
def test_dbms_evicts_a_block_past_its_break_even_interval_before_a_fresher_one(
        make_manager, clock, rent, victim):
    """T_b = 4 s / (0.5 * 1 GiB) = 8 s. x: accessed at t=0 and t=1 (LRU-2 alone keeps it);
    y: accessed once at t=5. At t=12, x has idled 11 s > 8 s and goes first; y (idle 7 s)
    stays. With rent 0 (pure LRU-K) y goes first."""
    m = make_manager(8, "dbms", rent_per_gib_s=rent, cost_model=UNIT_COST)
    use(m, clock, 0, A[:4], "x1")
    use(m, clock, 1, A[:4], "x2")
    use(m, clock, 5, B[:4], "y1")
    x, y = m.lookup(A[:4]).block_ids[0], m.lookup(B[:4]).block_ids[0]
    clock.set(12)
    assert m.policy.is_expired(x, 12.0) == (rent > 0)
    assert not m.policy.is_expired(y, 12.0)
    evicted = []
    m.add_eviction_listener(lambda block, now: evicted.append(block.block_id))
    m.evict(1)
    assert evicted == [{"x": x, "y": y}[victim]]
    m.check()


def test_expiry_boundary_and_lru_k_order_among_expired(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "dbms", rent_per_gib_s=0.5, cost_model=UNIT_COST)  # T_b = 8 s
    use(m, clock, 0, A[:4], "p1")
    use(m, clock, 1, A[:4], "p2")  # p: two accesses, idle since 1
    use(m, clock, 2, B[:4], "q1")  # q: one access, idle since 2
    p, q = m.lookup(A[:4]).block_ids[0], m.lookup(B[:4]).block_ids[0]
    assert not m.policy.is_expired(p, 9.0)  # idle exactly T_b: not yet
    assert m.policy.is_expired(p, 9.5) and not m.policy.is_expired(q, 9.5)
    clock.set(100)  # both expired: LRU-2 decides among them (q has one access)
    assert evict_one_by_one(m, 2) == [q, p]


def test_a_hit_renews_an_expired_block(make_manager, clock, evict_one_by_one):
    m = make_manager(8, "dbms", rent_per_gib_s=0.5, cost_model=UNIT_COST)  # T_b = 8 s
    use(m, clock, 0, A[:4], "a1")
    use(m, clock, 1, B[:4], "b1")
    a, b = m.lookup(A[:4]).block_ids[0], m.lookup(B[:4]).block_ids[0]
    assert m.policy.is_expired(a, 20.0)
    use(m, clock, 20, A[:4], "a2")  # hit: a is fresh again, with two accesses
    assert not m.policy.is_expired(a, 20.0) and m.policy.is_expired(b, 20.0)
    assert evict_one_by_one(m, 2) == [b, a]


@pytest.mark.parametrize("params, message", [
    ({"k": 0}, "k must be an int >= 1"),
    ({"k": 2.0}, "k must be an int >= 1"),
    ({"k": True}, "k must be an int >= 1"),
    ({"correlated_period": -1}, "correlated_period must be a finite number >= 0"),
    ({"correlated_period": math.inf}, "correlated_period must be a finite number >= 0"),
    ({"correlated_period": math.nan}, "correlated_period must be a finite number >= 0"),
    ({"count_releases": 1}, "count_releases must be True or False"),
    ({"rent_per_gib_s": -0.1}, "rent_per_gib_s must be a finite number >= 0"),
    ({"rent_per_gib_s": "cheap"}, "rent_per_gib_s must be a finite number >= 0"),
    ({"compute_value": 0}, "compute_value must be > 0"),
    ({"compute_value": math.inf}, "compute_value must be a finite number >= 0"),
    ({"cost_model": 3}, "cost_model must be a CostModel"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"horizon": 3}, "has no parameter"),
])
def test_bad_parameters_raise_config_error(params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy("dbms", **params)


@pytest.mark.parametrize("n", [10_000])
def test_victim_cost_is_amortized_constant(n):
    """10k candidates, half of them expiring: every victim call pops each stale heap entry
    at most once, so the pops never exceed the evictions plus the expiries."""
    policy = DBMS(cost_model=UNIT_COST, rent_per_gib_s=0.5)  # T_b = 8 s
    blocks = []
    for i in range(n):
        t = i * 0.002  # accesses over 20 s
        block = BlockInfo(i, i, None, 0, None, 0, "chat", "s", t, i, None)
        policy.on_insert(block, t)
        if i % 3 == 0:
            policy.on_hit(block, t)  # two accesses
        policy.on_candidate(block, t)
        blocks.append(block)
    now = 20.0  # blocks idle since before t=12 have expired
    victims = 3000
    order = []
    for _ in range(victims):
        chosen = policy.victim(now)
        order.append(chosen)
        policy.on_evict(blocks[chosen], now)
    assert policy.victim_stats["stale_pops"] <= victims
    assert len(policy) == n - victims
    expired = [i for i in range(n) if i * 0.002 + 8.0 < now]
    # expired first, in LRU-2 order: single-access ones (LRU), then the twice-used ones
    single = [i for i in expired if i % 3]
    double = [i for i in expired if i % 3 == 0]
    assert order == (single + double)[:victims]


def test_every_victim_is_the_brute_force_minimum(clock):
    """The lazy expiry index picks exactly the candidate a full scan would pick."""
    import numpy as np

    class Noted(DBMS):
        """Notes each victim's history as it pops it (the victim is forgotten by the time
        the eviction listener runs)."""

        def pop_victim(self, now):
            chosen = self.victim(now)
            self.popped_history = self.history(chosen) if chosen is not None else ()
            return super().pop_victim(now)

    policy = Noted(cost_model=UNIT_COST, rent_per_gib_s=0.5)  # T_b = 8 s
    m = KVCacheManager(BlockPool(14, 4), policy, clock=clock)
    checked = []

    def check(block, now):
        keys = {}
        for c in m.tree.candidates:
            b = m.block(c)
            expired = now - b.last_access > policy.break_even(b)
            hist = policy.popped_history if c == block.block_id else policy.history(c)
            keys[c] = (not expired, hist[-1], b.last_access_tick, c)
        assert block.block_id == min(keys, key=keys.get)
        checked.append((block.block_id, keys[block.block_id][0]))

    m.add_eviction_listener(check)
    gen = np.random.default_rng(4)
    t = 0.0
    for i in range(150):
        s = int(gen.integers(0, 6))
        prompt = [2000 + 10 * s + j for j in range(8)] + [int(x) for x in gen.integers(0, 4, 4)]
        t += float(gen.choice([0.0, 0.5, 3.0, 9.0]))
        use(m, clock, t, prompt, f"r{i}")
    assert len(checked) > 50
    assert {fresh for _, fresh in checked} == {True, False}  # both groups were exercised
    m.check()


@pytest.mark.parametrize("params", [
    {},
    {"rent_per_gib_s": 1e6},  # everything expires at once
    {"count_releases": True, "correlated_period": 1.0, "k": 3},
])
def test_stateful_machine(params):
    machine_for("dbms", **params).TestCase().runTest()


def test_stateful_machine_tensor_mode_and_small_pool():
    machine_for("dbms", tensor=True, num_blocks=10, rent_per_gib_s=1e3).TestCase().runTest()
    machine_for("dbms", num_blocks=5, block_size=2).TestCase().runTest()


def test_policy_instance_through_manager(clock):
    m = KVCacheManager(BlockPool(4, 4), DBMS(), clock=clock)
    use(m, clock, 0, A, "a")
    assert len(m.policy) == 1
    m.check()
