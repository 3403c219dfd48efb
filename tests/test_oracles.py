"""The reuse and horizon oracles: exact victims, identities with LRU and with each other,
the file-backed and in-memory futures, goldens on the bundled trace, and the decomposition
table of `kvevict.replay`."""

from __future__ import annotations

import math

import pytest
from oracle_harness import BS, Harness, req

from kvevict import BlockPool, ConfigError, KVCacheManager, ManualClock, Request, make_policy
from kvevict.policies.belady import Belady, NextUseFile, request_times
from kvevict.policies.oracles import (
    DEFAULT_HORIZON,
    FileHorizonOracle,
    FileReuseOracle,
    HorizonOracle,
    ReuseOracle,
)
from kvevict.policies.registry import build_policy, is_offline
from kvevict.replay import (
    INFINITE,
    default_policies,
    format_table,
    replay,
    replay_table,
    row_labels,
)
from kvevict.sim import simulate
from kvevict.testing import machine_for
from kvevict.workloads import bundled_trace_path, read_mooncake

SIZES = (1000, 2000, 5000, 10000, 20000)

#: The issue's measurement of the reuse oracle on the bundled trace (``--time arrival``,
#: 512-token blocks, block hit ratio), reproduced exactly.
ISSUE_REUSE = (0.1229, 0.1995, 0.4022, 0.5904, 0.6396)

#: Block hit ratios on the bundled trace, arrival axis (``kvevict replay --time arrival
#: --horizons 30,120,300``); docs/replay.md, "Oracle decomposition".
GOLDEN_ARRIVAL = {
    "lru": (0.0841, 0.1464, 0.2793, 0.4239, 0.5718),
    "horizon-oracle H=30": (0.2035, 0.2628, 0.3539, 0.4667, 0.5828),
    "horizon-oracle H=120": (0.1635, 0.2641, 0.4757, 0.5337, 0.6054),
    "horizon-oracle H=300": (0.1272, 0.2071, 0.4353, 0.6035, 0.6307),
    "reuse-oracle": ISSUE_REUSE,
    "belady": (0.2691, 0.3742, 0.5256, 0.6174, 0.6396),
    INFINITE: (0.6396,) * 5,
}


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return read_mooncake(bundled_trace_path("mooncake"))


# -- exact victims on hand-built futures ----------------------------------------------------


def test_reuse_oracle_evicts_dead_blocks_first_in_lru_order():
    future = {1: [0, 9], 2: [1], 3: [2], 4: [3, 8], 5: [4]}
    h = Harness(4, ReuseOracle(future))
    for t, ids in enumerate([[1], [2], [3], [4]]):
        h.run(t, ids)
    h.run(4, [5])  # dead: 2, 3 (live: 1, 4): the least recently used dead one, 2
    assert h.evicted == [2]
    h.run(5, [6])  # dead: 3, 5: 3 (older)
    h.run(6, [7])  # dead: 5, 6: 5
    assert h.evicted == [2, 3, 5]
    h.run(7, [10])  # dead: 6, 7 -> 6; the live 1 (oldest of all) stays
    assert h.evicted == [2, 3, 5, 6]
    h.run(8, [4])  # a hit
    assert h.evicted == [2, 3, 5, 6]


def test_reuse_oracle_runs_lru_among_live_blocks_where_belady_does_not():
    future = {1: [0, 5], 3: [1, 6], 4: [2]}
    runs = {}
    for name, policy in (("reuse", ReuseOracle(future)), ("belady", Belady(future))):
        h = Harness(2, policy)
        h.run(0, [1])
        h.run(1, [3])
        h.run(2, [4])  # both candidates are live: 1 (next 5) is older, 3 (next 6) later
        runs[name] = h.evicted
    assert runs == {"reuse": [1], "belady": [3]}


def test_reuse_oracle_keeps_a_live_chain_and_drops_a_dead_tail_first():
    """A single-shot request's private tail (never used again) goes before a live chat's,
    even though the chat's blocks were used longer ago; LRU drops the chat's tail."""
    chat, single = [1, 2, 3], [1, 7, 8]  # both share the system block 1
    future = {1: [0, 1, 3], 2: [0, 3], 3: [0, 3], 7: [1], 8: [1], 9: [2]}
    runs = {}
    for name, policy in (("reuse", ReuseOracle(future)), ("lru", make_policy("lru"))):
        h = Harness(5, policy)
        h.run(0, chat)
        h.run(1, single)
        h.run(2, [9])  # one block needed: 5 resident, 4 candidates (3 and 8 are leaves)
        runs[name] = (h.evicted, h.run(3, chat))
    assert runs["reuse"] == ([8], 3)  # the dead tail; the chat hits its whole prefix
    assert runs["lru"] == ([3, 8], 2)  # the chat's tail, released longest ago (and the
    # chat's miss then costs the single-shot tail too)


def test_horizon_oracle_depends_on_the_clock():
    """H = 10. Block 1 (used at 0, next at 12) is older than block 2 (used at 1, next at 20).
    At time 2 block 2's next use (20) is beyond 2 + 10: it goes first although more recent.
    At time 10 both next uses are within 10 + 10: LRU among them takes the older, 1."""
    future = {1: [0, 12], 2: [1, 20], 3: [2, 10]}
    early = Harness(2, HorizonOracle(future, horizon=10))
    early.run(0, [1])
    early.run(1, [2])
    early.run(2, [3])
    late = Harness(2, HorizonOracle(future, horizon=10))
    late.run(0, [1])
    late.run(1, [2])
    late.run(10, [3])
    assert (early.evicted, late.evicted) == ([2], [1])


def test_horizon_oracle_far_and_dead_blocks_share_one_lru_class():
    """Beyond H and never again are the same class: the older of them goes first."""
    future = {1: [0, 100], 2: [1], 3: [2, 4], 4: [3]}
    h = Harness(3, HorizonOracle(future, horizon=5))
    for t, ids in enumerate([[1], [2], [3]]):
        h.run(t, ids)
    h.run(3, [4])  # far: 1 (next 100 > 8), 2 (never); near: 3 (next 4): 1 is the oldest
    assert h.evicted == [1]
    h.run(4, [3])  # a hit on the near block
    h.run(5, [5])  # far: 2 (never), 4 (never): 2
    assert h.evicted == [1, 2]


def test_a_far_block_is_promoted_when_the_clock_reaches_its_next_use_minus_h():
    future = {1: [0, 30], 2: [1, 50], 3: [2]}
    policy = HorizonOracle(future, horizon=10)
    h = Harness(4, policy)
    h.run(0, [1])
    h.run(1, [2])
    h.run(2, [3])
    assert (policy.num_far, policy.num_near) == (3, 0)  # 30 > 12, 50 > 12, 3 never
    block = {b.block_id: b.block_hash for b in h.manager.tree}
    assert block[policy.victim(19.5)] == 1  # far, oldest
    assert block[policy.victim(20.0)] == 2  # 30 <= 20 + 10: 1 is near; far: 2, the dead 3
    assert (policy.num_far, policy.num_near) == (2, 1)
    assert block[policy.victim(40.0)] == 3  # 2 is near too; only the dead 3 is far
    assert (policy.num_far, policy.num_near) == (1, 2)
    h.clock.set(41.0)
    assert h.manager.evict(3) == 3
    assert h.evicted == [3, 1, 2]  # the far one, then LRU among the near ones
    assert len(policy) == 0 and policy.victim(50.0) is None


def test_horizon_zero_is_lru_and_infinite_is_the_reuse_oracle_on_hand_built_futures():
    future = {1: [0, 3], 2: [1, 9], 3: [2], 4: [4, 5], 5: [6]}
    schedule = [(0, [1]), (1, [2]), (2, [3]), (3, [1]), (4, [4]), (5, [4]), (6, [5]),
                (7, [6]), (9, [2])]

    def evictions(policy):
        h = Harness(3, policy)
        for t, ids in schedule:
            h.run(t, ids)
        return h.evicted

    assert evictions(HorizonOracle(future, horizon=0)) == evictions(make_policy("lru"))
    assert evictions(HorizonOracle(future, horizon=math.inf)) == evictions(ReuseOracle(future))
    assert evictions(ReuseOracle(future)) != evictions(make_policy("lru"))


# -- building them --------------------------------------------------------------------------


def test_registered_offline_with_defaults():
    horizon = make_policy("horizon-oracle")
    assert isinstance(horizon, HorizonOracle) and horizon.horizon == DEFAULT_HORIZON == 300.0
    assert make_policy("horizon-oracle", horizon=60).horizon == 60.0
    reuse = make_policy("reuse-oracle")
    assert isinstance(reuse, ReuseOracle) and reuse.horizon == math.inf
    assert is_offline("reuse-oracle") and is_offline("horizon-oracle")
    assert repr(reuse) == "ReuseOracle(blocks_known=0)"
    assert repr(HorizonOracle({1: [0]}, 30)) == "HorizonOracle(blocks_known=1, horizon=30)"


def test_from_requests_and_build_policy_with_a_horizon():
    reqs = [req(0, [1, 2], 0.0), req(1, [1, 3], 4.0), req(2, [1, 2], 9.0)]
    oracle = HorizonOracle.from_requests(reqs, time="arrival", horizon=5)
    assert oracle.horizon == 5 and oracle.belady.next_use(2, 0.0) == 0.0
    oracle.on_begin(reqs[0], [], [], 0.0)  # request 0's accesses leave the future
    assert oracle.belady.next_use(2, 0.0) == 9.0
    built = build_policy("horizon-oracle", {"horizon": 5}, requests=reqs, time_axis="arrival")
    assert isinstance(built, HorizonOracle) and built.horizon == 5
    assert built.num_blocks_known == 3  # the future came from the requests
    default = build_policy("horizon-oracle", requests=reqs, time_axis="index")
    default.on_begin(reqs[0], [], [], 0.0)
    assert default.horizon == DEFAULT_HORIZON and default.belady.next_use(2, 0.0) == 2.0
    reuse = build_policy("reuse-oracle", requests=reqs)
    assert isinstance(reuse, ReuseOracle) and reuse.num_blocks_known == 3
    assert reuse.belady.next_use(2, 100.0) == 0.0  # request 0 has not begun: still coming
    reuse.on_begin(reqs[0], [], [], 0.0)
    assert reuse.belady.next_use(2, 100.0) == 2.0
    # parameters the hook does not take: built from them, as before (no future)
    assert build_policy("horizon-oracle", {"future": {}, "horizon": 1},
                        requests=reqs).num_blocks_known == 0


def test_horizon_errors_are_specific():
    for bad in (-1, float("nan"), "300", True, None):
        with pytest.raises(ConfigError, match="horizon must be"):
            HorizonOracle(horizon=bad)
    with pytest.raises(ConfigError, match="horizon must be"):
        build_policy("horizon-oracle", {"horizon": -5}, requests=[req(0, [1])])
    with pytest.raises(ConfigError, match="future must map"):
        ReuseOracle([1, 2])
    with pytest.raises(ConfigError, match="Requests"):
        ReuseOracle.from_requests([[1]])
    with NextUseFile.build([req(0, [1])], block_size=BS) as future:
        with pytest.raises(ConfigError, match="arrivals=True"):
            FileHorizonOracle(future, 4, time="arrival", horizon=30)
        with pytest.raises(ConfigError, match="time must be"):
            FileHorizonOracle(future, 4, time="wall")
        with pytest.raises(ConfigError, match="capacity_blocks"):
            FileReuseOracle(future, 0)
        # H = 0 and H = inf need no arrivals
        assert FileHorizonOracle(future, 4, time="arrival", horizon=0).limit(5.0) == -1.0
        assert FileReuseOracle(future, 4, time="arrival").limit(5.0) == math.inf


def test_the_arrival_cursor_nudges_ties_as_the_replay_does(monkeypatch):
    from kvevict.policies import oracles as module

    monkeypatch.setattr(module, "_ARRIVAL_CHUNK", 2)  # several reads of the arrivals
    arrivals = [0.0, 1.0, 1.0, 1.0, 2.5, 7.0]
    reqs = [req(i, [i + 1], t) for i, t in enumerate(arrivals)]
    times = request_times(reqs, "arrival")
    with NextUseFile.build(reqs, block_size=BS, arrivals=True) as future:
        oracle = FileHorizonOracle(future, 4, time="arrival", horizon=1.0)
        assert times[2] > 1.0 and times[3] > times[2]  # the ties, nudged up
        assert oracle.limit(0.0) == 1.0  # requests 0 and 1 at <= 1.0 s; the ties are above
        assert oracle.limit(times[1]) == 3.0  # 2.0 s: the ties are below
        assert oracle.limit(1.5) == 4.0  # 2.5 <= 2.5
        assert oracle.limit(1e9) == 5.0
        oracle.close()
        index = FileHorizonOracle(future, 4, time="index", horizon=2)
        assert index.limit(1.0) == 3.0


# -- the bundled trace: file-backed = in memory, identities, goldens -------------------------


def _evictions(trace, policy, size, times):
    manager = KVCacheManager(BlockPool(size, 512), policy, clock=ManualClock())
    evicted = []
    manager.add_eviction_listener(lambda b, now: evicted.append(b.block_hash))
    for request, t in zip(trace, times, strict=True):
        manager.clock.set(t)
        manager.finish(manager.begin(request).seq_id)
    return manager.stats.block_hits, evicted


@pytest.mark.parametrize(("kind", "horizon", "time"), [
    ("reuse", None, "index"), ("horizon", 30.0, "arrival"), ("horizon", 300.0, "index")])
def test_file_oracles_evict_exactly_as_the_in_memory_ones(trace, kind, horizon, time):
    head = trace[:2000]
    times = request_times(head, time)
    with NextUseFile.build(head, block_size=512, arrivals=True) as future:
        for size in (800, 3000):
            if kind == "reuse":
                memory = ReuseOracle.from_requests(head, time=time)
                file = ReuseOracle.from_next_uses(future, size, time=time)
            else:
                memory = HorizonOracle.from_requests(head, time=time, horizon=horizon)
                file = HorizonOracle.from_next_uses(future, size, time=time, horizon=horizon)
            hits, evicted = _evictions(head, file, size, times)
            assert (hits, evicted) == _evictions(head, memory, size, times), size
            assert len(evicted) > 1000  # the comparison covers many choices
            file.close()


@pytest.fixture(scope="module")
def decomposition(trace):
    """The docs' table plus the two identities' rows: arrival axis, every size."""
    return replay_table(trace, ["lru", "horizon-oracle", "reuse-oracle", "belady", INFINITE],
                        SIZES, time="arrival", horizons=[0, 30, 120, 300, math.inf])


def test_the_issues_reuse_oracle_numbers_are_reproduced(decomposition):
    assert [round(r, 4) for r in decomposition.ratios()["reuse-oracle"]] == list(ISSUE_REUSE)


def test_golden_decomposition_on_the_bundled_trace(decomposition):
    ratios = decomposition.ratios()
    for name, golden in GOLDEN_ARRIVAL.items():
        assert [round(r, 4) for r in ratios[name]] == list(golden), name


def test_h_zero_is_lru_and_h_infinite_is_the_reuse_oracle_on_the_bundled_trace(
        decomposition):
    for size in SIZES:
        for a, b in (("horizon-oracle H=0", "lru"), ("horizon-oracle H=inf", "reuse-oracle")):
            x, y = decomposition.get(a, size), decomposition.get(b, size)
            assert (x.hits, x.evictions, x.token_hits) == (y.hits, y.evictions, y.token_hits)


def test_decomposition_is_ordered_as_the_bounds_say(decomposition):
    """LRU <= reuse oracle <= Belady <= infinite at every size, and every horizon oracle
    between LRU and Belady (none of these is a theorem for prefix-tree replays; measured)."""
    r = decomposition.ratios()
    for i, _ in enumerate(SIZES):
        assert r["lru"][i] <= r["reuse-oracle"][i] <= r["belady"][i] <= r[INFINITE][i]
        for h in (30, 120, 300):
            assert r["lru"][i] <= r[f"horizon-oracle H={h}"][i] <= r["belady"][i]
    inf = decomposition.get(INFINITE, 1000)
    assert inf.evictions == 0 and inf.rejected == 0 and inf.hits == 121_877 - 43_924
    assert format_table(decomposition).splitlines()[-1].startswith("| infinite | 0.6396 |")


def test_simulator_untimed_gives_the_replay_numbers(trace):
    """build_policy from the requests (the simulator's path) = the replay's file oracles."""
    head = trace[:600]
    for name, params in (("reuse-oracle", {}), ("horizon-oracle", {"horizon": 40})):
        sim = simulate(head, name, capacity_blocks=700, block_size=512, timing=False,
                       policy_params=params)
        rep = replay(head, name, 700, **params)
        assert sim.manager_stats["block_hits"] == rep.hits, name
        assert sim.manager_stats["evictions"] == rep.evictions, name


def test_timed_simulator_runs_the_horizon_oracle_on_arrival_seconds(trace):
    head = trace[:300]
    result = simulate(head, "horizon-oracle", capacity_blocks=900, block_size=512,
                      policy_params={"horizon": 30})
    lru = simulate(head, "lru", capacity_blocks=900, block_size=512)
    assert result.summary()["token_hit_ratio"] > lru.summary()["token_hit_ratio"]


# -- the replay table's defaults --------------------------------------------------------------


def test_default_table_is_the_decomposition():
    names = default_policies()
    assert names[-4:] == ["horizon-oracle", "reuse-oracle", "belady", INFINITE]
    assert not any(is_offline(n) for n in names[:-4])


def test_horizons_replace_the_default_row_or_follow_the_list():
    reqs = [req(i, ids, float(i)) for i, ids in
            enumerate([[1, 2], [3], [1, 2], [4], [3], [1, 5]])]
    table = replay_table(reqs, ["lru", "horizon-oracle", INFINITE], [3], BS,
                         horizons=[1, 2.5])
    assert table.policies == ["lru", "horizon-oracle H=1", "horizon-oracle H=2.5", INFINITE]
    table = replay_table(reqs, ["lru", INFINITE], [3], BS, horizons=[2])
    assert table.policies == ["lru", "horizon-oracle H=2", INFINITE]
    # row_labels names the rows without replaying, as replay_table places them
    for names, horizons in ((["lru", "horizon-oracle", INFINITE], [1, 2.5]),
                            (["lru", INFINITE], [2]), (["lru", "horizon-oracle"], None)):
        assert row_labels(names, horizons) == replay_table(reqs, names, [3], BS,
                                                           horizons=horizons).policies
    assert row_labels() == default_policies()
    twice = r"horizons lists horizon-oracle H=1 twice .*; give each horizon once"
    with pytest.raises(ConfigError, match=twice):
        row_labels(["lru"], [1, 1.0])
    assert replay(reqs, INFINITE, 3, BS).hits == 2 + 1 + 1  # every repeated block hits
    with pytest.raises(ConfigError, match=twice):
        replay_table(reqs, ["lru"], [3], BS, horizons=[1, 1.0])
    with pytest.raises(ConfigError, match="at least one"):
        replay_table(reqs, ["lru"], [3], BS, horizons=[])
    with pytest.raises(ConfigError, match="horizon must be"):
        replay_table(reqs, ["lru"], [3], BS, horizons=[-1])
    with pytest.raises(ConfigError, match="takes no parameters"):
        replay(reqs, INFINITE, 3, BS, horizon=3)


def test_stream_of_a_one_shot_iterator_equals_a_list(trace):
    head = trace[:500]
    listed = replay_table(head, ["reuse-oracle", "horizon-oracle", INFINITE], [600],
                          time="arrival")
    streamed = replay_table(iter(head), ["reuse-oracle", "horizon-oracle", INFINITE], [600],
                            time="arrival")
    assert [r.hits for r in streamed.results] == [r.hits for r in listed.results]


# -- the shared stateful machine --------------------------------------------------------------


class _ScrambledHorizon(HorizonOracle):
    """Arbitrary (but fixed per block and candidacy) next uses, so that blocks start near
    or far and are promoted as the machine's clock advances."""

    def __init__(self):
        super().__init__(horizon=3.0)

    def next_use_key(self, block, now):
        return math.inf if block.block_hash % 5 == 0 else now + 1 + block.block_hash % 7


def test_stateful_machine_by_name():
    machine_for("reuse-oracle").TestCase().runTest()
    machine_for("horizon-oracle").TestCase().runTest()


def test_stateful_machine_scrambled_future_with_promotions():
    machine_for(_ScrambledHorizon).TestCase().runTest()
    machine_for(_ScrambledHorizon, tensor=True, num_blocks=6).TestCase().runTest()


# -- the plot -------------------------------------------------------------------------------


def test_replay_figure_draws_each_row_in_its_fixed_style():
    from kvevict import report

    rows = [{"policy": p, "capacity_blocks": c, "block_hit_ratio": v}
            for p, vals in (("lru", (0.1, 0.3)), ("horizon-oracle H=30", (0.2, 0.35)),
                            ("horizon-oracle H=300", (0.15, 0.4)), ("belady", (0.3, 0.5)),
                            (INFINITE, (0.6, 0.6)))
            for c, v in zip((1000, 4000), vals, strict=True)]
    fig = report.replay_figure(rows, "t")
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["lru", "horizon-oracle H=30", "horizon-oracle H=300", "belady",
                           "infinite cache (0.600)"]
    lru, h30, h300, belady = (lines[k] for k in list(lines)[:4])
    assert (lru.get_color(), lru.get_marker(), lru.get_linestyle()) == ("#1f77b4", "o", "-")
    assert (belady.get_color(), belady.get_marker(), belady.get_linestyle()) == (
        "#000000", "*", "--")
    assert report.POLICY_STYLES["horizon-oracle"] == ("#00a087", "h")
    # a family: the first in the policy's own style, the next a third of the way to white
    # (0x00 + 255/3 = 0x55, 0xa0 + 95/3 = 0xc0, 0x87 + 120/3 = 0xaf), with another marker
    assert (h30.get_color(), h30.get_marker(), h30.get_linestyle()) == ("#00a087", "h", "--")
    assert (h300.get_color(), h300.get_marker()) == ("#55c0af", "X")
    assert list(h30.get_ydata()) == [0.2, 0.35]
    assert lines["infinite cache (0.600)"].get_linestyle() == ":"
    with pytest.raises(ConfigError, match="at least one row"):
        report.replay_figure([], "t")
