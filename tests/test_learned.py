"""The `learned` policy: inferred conversations, the reuse table, exact victims, golden numbers.

The hand-built cases drive a real `KVCacheManager` (the production path) with requests given
as block hashes, one at a time on a manual clock, and read the victims it names. The cost
model there charges every depth the same (``attn_s_per_pair=0``), so a victim is decided by
the learned odds and the idle time alone.
"""

from __future__ import annotations

import pytest

from kvevict import workloads
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.policies.learned import (
    GAP_EDGES,
    HORIZON_WEIGHT,
    INITIAL_HORIZON_S,
    NUM_GAP_BINS,
    ConversationTracker,
    GapTable,
    LearnedReuse,
    ReuseTable,
    gap_bin,
)
from kvevict.pool import BlockPool
from kvevict.replay import replay
from kvevict.sim import simulate
from kvevict.types import BlockInfo, ManualClock, Request

FLAT = CostModel(attn_s_per_pair=0.0)


def run(m: KVCacheManager, clock: ManualClock, t: float, rid: object, blocks: tuple,
        cls: str = "chat", out: int = 8, session: object = None) -> tuple[int, int]:
    """One request at time ``t``: begin, finish; returns (hit blocks, blocks)."""
    clock.set(t)
    req = Request(request_id=rid, block_hashes=blocks, num_tokens=len(blocks) * 4,
                  output_len=out, workload_class=cls, session_id=session)
    seq = m.begin(req)
    hit = seq.num_hit_slots // 4
    m.finish(rid)
    return hit, len(blocks)


def manager(capacity: int, policy: LearnedReuse) -> tuple[KVCacheManager, ManualClock]:
    clock = ManualClock()
    return KVCacheManager(BlockPool(capacity, 4), policy, clock=clock), clock


def victims(m: KVCacheManager, n: int) -> list:
    """The block hashes of the next ``n`` victims, evicted one at a time."""
    out = []
    for _ in range(n):
        chosen = m.policy.victim(m.clock())
        out.append(m.block(chosen).block_hash)
        m.evict(1)
    return out


# -- the conversation tracker ------------------------------------------------------------------


def block(block_id: int, h: object, depth: int = 0) -> BlockInfo:
    return BlockInfo(block_id, h, None, depth, None, 1, "chat", None, 0.0, 0, None)


def test_tracker_infers_the_next_turn_from_a_private_chain() -> None:
    t = ConversationTracker()
    # three block ids, the last partial (10 tokens in blocks of 4), as in a Mooncake trace
    a = Request(request_id=1, block_hashes=(1, 2, 3), num_tokens=10)
    b1, b2, b3 = block(1, 1, 0), block(2, 2, 1), block(3, 3, 2)
    conv = t.begin(a, [], [b1, b2, b3], block_size=4)
    assert conv[1] == 1
    t.finish(conv, [b1, b2, b3])
    for b in (b1, b2, b3):
        b.hit_count = 1  # the next request's hit
    # the hit ends in the chain this conversation created: its next turn
    assert t.begin(a, [b1, b2, b3]) == (conv[0], 2)
    assert t.begin(a, [b1, b2]) == (conv[0], 2)  # a partial last block not repeated
    assert t.begin(a, [b1])[1] == 1  # stops inside that prompt: a shared prefix
    # a block reused by someone else already is shared: a new conversation starts there
    b1.hit_count = 2
    other = t.begin(a, [b1])
    assert other[0] != conv[0] and other[1] == 1
    t.forget(3)
    assert t.begin(a, [b1, b2, b3])[1] == 1  # evicted: forgotten


def test_tracker_uses_session_ids_when_given() -> None:
    t = ConversationTracker()
    r = Request(request_id=1, block_hashes=(1,), num_tokens=4, session_id="s")
    assert [t.begin(r, [])[1] for _ in range(3)] == [1, 2, 3]


def test_inferred_turns_equal_the_session_turns_on_a_generated_trace() -> None:
    """chat-server with its session ids, and the same requests with them stripped, in the
    timed simulator (decode caches each answer, so every turn ends on a private block): the
    tracker gives every request the same turn. The pool holds everything: inference sees the
    tree, so an evicted chain end would restart the count. Blocks of 4 tokens, so that every
    turn caches a block of its own: with 16-token blocks, some turns (a short message, a
    short answer) cache none, and the tree cannot tell their next turn from a new
    conversation sharing the system prompt."""
    reqs = workloads.generate("chat-server", seed=1)
    turns = {}
    for strip in (False, True):
        policy = LearnedReuse()
        seen = []
        orig = policy.conversations.begin

        def begin(request, hits, new, block_size=None, orig=orig, seen=seen):
            out = orig(request, hits, new, block_size)
            seen.append((request.request_id, out[1]))
            return out

        policy.conversations.begin = begin  # type: ignore[method-assign]
        source = [r if not strip else Request(
            request_id=r.request_id, tokens=r.tokens, workload_class=r.workload_class,
            arrival=r.arrival, output_len=r.output_len, session_id=None) for r in reqs]
        simulate(source, policy, capacity_blocks=10**6, block_size=4)  # see the docstring
        turns[strip] = dict(seen)
    assert turns[False] == turns[True]
    assert turns[False] == {r.request_id: r.turn for r in reqs}
    assert max(turns[True].values()) >= 5


# -- the reuse table ---------------------------------------------------------------------------


def test_table_starts_every_cell_at_the_pooled_rate_and_learns() -> None:
    table = ReuseTable(prior_weight=8.0, memory=float("inf"))
    assert table.p("a") == table.p("b") == 0.5
    for i in range(4):
        table.open(("a", i), "a", 0.0)
        table.open(("b", i), "b", 0.0)
    for i in range(4):
        table.reuse(("a", i), 1.0, horizon=10.0)  # within the horizon: successes
    table.reuse(("b", 0), 20.0, horizon=10.0)  # too late: a failure
    table.expire(9.0, horizon=10.0)  # nothing is 10 s old at t=9 yet
    assert table.observations == 5
    table.expire(11.0, horizon=10.0)  # b's three open trials fail
    assert table.observations == 8
    pooled = 5 / 10  # 1 + 4 successes, 1 + 4 failures
    assert table.p("a") == pytest.approx((8 * pooled + 4) / 12)
    assert table.p("b") == pytest.approx((8 * pooled) / 12)


def test_the_horizon_is_the_moving_mean_of_evicted_idle_times_in_eviction_order() -> None:
    """H starts at the initial horizon, becomes the first victim's idle time, then moves by
    HORIZON_WEIGHT toward each later victim's idle time, in the order the victims left: read
    between single evictions, and after a burst (no rebuild inside it reads H), it equals
    a fold done by hand."""
    policy = LearnedReuse(FLAT)
    m, clock = manager(16, policy)
    assert policy.horizon == INITIAL_HORIZON_S
    for k in range(8):  # eight one-block requests released at t = 0, 10, ..., 70: one cell
        run(m, clock, 10.0 * k, ("r", k), (("b", k),), out=0)
    released = [m.tree.get(("b", k)).last_access for k in range(8)]
    assert released == [10.0 * k for k in range(8)]

    def fold(idles: list[float]) -> float:
        h = idles[0]
        for idle in idles[1:]:
            h += HORIZON_WEIGHT * (idle - h)
        return h

    clock.set(100.0)
    m.evict(1)  # the oldest, idle 100 s
    assert policy.horizon == 100.0
    m.evict(1)  # idle 90 s
    assert policy.horizon == fold([100.0, 90.0])
    clock.set(250.0)
    m.evict(3)  # idle 230, 220 and 210 s, oldest first
    assert [m.tree.get(("b", k)) is None for k in range(8)] == [True] * 5 + [False] * 3
    assert policy.horizon == fold([100.0, 90.0, 230.0, 220.0, 210.0])
    assert policy.horizon != fold([100.0, 90.0, 210.0, 220.0, 230.0])  # the order matters


def test_a_later_prefill_chunk_resolves_its_trial_when_it_is_cached() -> None:
    """A request that caches part of its prompt after its begin (a chunked prefill): the
    content it computes again resolves the trial it reuses at the time it was cached, not at
    its finish, and the trial is not replaced unresolved by the request's own."""
    policy = LearnedReuse(FLAT)
    m, clock = manager(16, policy)
    old = tuple(("old", i) for i in range(4))
    a = tuple(("a", i) for i in range(4))
    run(m, clock, 0.0, "old", old, cls="batch")  # block uses 1-4: the 4th opens a trial
    run(m, clock, 40.0, "a", a)  # uses 5-8: a trial for a's last block, at t = 40
    assert set(policy.table.trials) == {old[3], a[3]}
    cell = policy.cell(m.tree.get(a[3]))
    clock.set(50.0)
    m.evict(8)  # everything; the idle times set H (about 49 s); the trials stay open
    assert 45.0 < policy.horizon < 50.0
    clock.set(52.0)
    m.begin(Request(request_id="b", block_hashes=a, num_tokens=16, output_len=8,
                    workload_class="chat"), max_new_tokens=8)  # a's first two blocks now
    assert policy.table.observations == 0  # no hit, and a's trial is on its last block
    clock.set(55.0)
    m.prefill("b")  # a's last two blocks computed again at t = 55: 15 s after a's trial
    clock.set(95.0)  # past the horizon: the trial succeeds only by its time of caching
    m.finish("b")
    assert policy.table.observations == 2  # a's trial succeeded, then old's expired
    assert policy.table.counts(cell) == (1.0, 0.0)


def test_no_estimate_at_time_t_uses_an_event_after_t() -> None:
    """Replaying the bundled trace up to time t, or all of it, leaves the same table at t."""
    reqs = workloads.read_mooncake(workloads.bundled_trace_path())
    cut = 400.0
    head = [r for r in reqs if r.arrival <= cut]

    def table_at_cut(source: list[Request]) -> dict:
        policy = LearnedReuse()
        snapshot: dict = {}
        orig = policy.on_begin

        def on_begin(request, hits, new, now, orig=orig):
            if request.arrival <= cut:  # the state the request at t saw, after its begin
                snapshot.clear()
                table = policy.table
                snapshot.update(cells={c: table.counts(c) for c in {*table.succ, *table.fail}},
                                horizon=policy.horizon, obs=table.observations)
            orig(request, hits, new, now)

        policy.on_begin = on_begin  # type: ignore[method-assign]
        replay(source, policy, 2000, 512, time="arrival")
        return snapshot

    full, partial = table_at_cut(reqs), table_at_cut(head)
    assert full == partial
    assert full["obs"] > 1000


# -- exact victims -----------------------------------------------------------------------------


def test_cold_start_with_one_cell_is_lru() -> None:
    """Single-block requests of one class and output length share one cell: whatever the
    table learns, the order is recency."""
    m, clock = manager(4, LearnedReuse(FLAT))
    for i, t in enumerate((0, 1, 2, 3)):
        run(m, clock, t, i, (100 + i,))
    run(m, clock, 4, 9, (101,))  # a hit: 101 is the newest now
    assert victims(m, 4) == [100, 102, 103, 101]


def test_an_exposed_parent_competes_with_every_candidate_and_leaves_when_hit() -> None:
    """The parent an eviction exposes is held beside the heap (a chain's tail usually goes
    next): it is the next victim only when it is the cheapest, it rejoins the heap when
    another eviction exposes a block, and a hit that makes it no candidate drops it."""
    m, clock = manager(16, LearnedReuse(FLAT))  # cold start: every cell equal, so LRU
    run(m, clock, 0, "a", ("a0", "a1"))
    run(m, clock, 1, "b", ("b0", "b1"))
    run(m, clock, 2, "d", ("a0",))  # a0 used at 2, still inner (a1 hangs below it)
    for i in range(6):  # newer candidates (and enough of them that no repricing intervenes)
        run(m, clock, 10 + i, ("x", i), (f"x{i}",))
    # a1 goes; a0 (last used at 2) is exposed but newer than b1, which goes first and
    # exposes b0 (used at 1): a0 rejoins the heap and goes before the newer ones
    assert victims(m, 5) == ["a1", "b1", "b0", "a0", "x0"]
    m, clock = manager(16, LearnedReuse(FLAT))
    run(m, clock, 0, "e", ("e0", "e1", "e2"))
    run(m, clock, 1, "f", ("f0", "f1"))
    assert victims(m, 1) == ["e2"]  # exposes e1
    run(m, clock, 2, "g", ("e0", "e1", "g2"))  # a hit on e1: no longer a candidate
    assert victims(m, 5) == ["f1", "f0", "g2", "e1", "e0"]


def teach(m: KVCacheManager, clock: ManualClock, cls_dead: str = "chat") -> float:
    """Six conversations of 8 turns (a 5-block first prompt, then one new block per turn,
    1 s apart) that come back until their last turn, and six single requests of class
    ``cls_dead`` with the same 5-block shape that never do; then time passes so every open
    trial fails. Returns the clock time reached."""
    t = 0.0
    for c in range(6):
        chain: tuple = tuple(("c", c, i) for i in range(5))
        for turn in range(8):
            if turn:
                chain = chain + (("c", c, 4 + turn),)
            run(m, clock, t, ("c", c, turn), chain)
            t += 1.0
        run(m, clock, t, ("dead", c), tuple(("d", c, i) for i in range(5)), cls=cls_dead)
        t += 1.0
    return t + 120.0  # past the horizon (60 s before any eviction): open trials fail


def test_an_inferred_5th_turn_outlives_a_fresh_conversation_of_the_same_idle_time() -> None:
    policy = LearnedReuse(FLAT)
    m, clock = manager(400, policy)
    t = teach(m, clock)
    run(m, clock, t, "expire", (("x",),))  # a request at t: every old trial is resolved
    m.evict(m.pool.num_used)  # empty the cache (learning kept)
    # a conversation at its 5th turn (a 1-block first prompt, then one block per turn) and a
    # fresh one, both chains of 5 blocks, both released at t + 1 (the same idle time); no
    # session ids: the turns are inferred
    chain: tuple = ()
    for turn in range(4):
        chain = chain + (("live", turn),)
        run(m, clock, t + 0.2 * turn, ("live", turn), chain)
    chain = chain + (("live", 4),)
    run(m, clock, t + 1.0, ("live", 4), chain)
    run(m, clock, t + 1.0, "fresh", tuple(("fresh", i) for i in range(5)))
    live, fresh = m.tree.get(("live", 4)), m.tree.get(("fresh", 4))
    assert (policy.cell(live)[2], policy.cell(fresh)[2]) == (3, 1)  # turns 3+ and 1
    assert policy.table.p(policy.cell(fresh)) < policy.table.p(policy.cell(live))
    assert victims(m, 1) == [("fresh", 4)]
    # without what it learned (a fresh policy on the same two chains) it is LRU: live first
    m2, clock2 = manager(400, LearnedReuse(FLAT))
    run(m2, clock2, 0.0, "l", tuple(("live", i) for i in range(5)))
    run(m2, clock2, 0.0, "f", tuple(("fresh", i) for i in range(5)))
    assert victims(m2, 1) == [("live", 4)]


def test_a_dead_single_shot_tail_goes_before_a_live_chats() -> None:
    policy = LearnedReuse(FLAT)
    m, clock = manager(400, policy)
    t = teach(m, clock, cls_dead="single_shot")
    run(m, clock, t, "expire", (("x",),))
    m.evict(m.pool.num_used)
    # a chat's first turn and a single-shot request, same depth, released together
    run(m, clock, t + 1.0, "chat", (("chat", 0),))
    run(m, clock, t + 1.0, "shot", (("shot", 0),), cls="single_shot")
    assert policy.table.p(policy.cell(m.tree.get(("shot", 0))))  \
        < policy.table.p(policy.cell(m.tree.get(("chat", 0))))
    assert victims(m, 1) == [("shot", 0)]


# -- the ghost: a content's uses survive its eviction ----------------------------------------


def test_the_ghost_counts_a_contents_uses_across_its_evictions() -> None:
    policy = LearnedReuse(FLAT, ghost=True)
    m, clock = manager(400, policy)
    run(m, clock, 0.0, "a", (("a", 0),))
    run(m, clock, 1.0, "a2", (("a", 0),))  # a hit: two uses
    clock.set(60.0)
    m.evict(m.pool.num_used)
    assert policy.ghost_size == 1
    run(m, clock, 61.0, "a3", (("a", 0),))  # a miss: cached again, its third use
    run(m, clock, 61.0, "f", (("f", 0),))  # new content
    a, f = m.tree.get(("a", 0)), m.tree.get(("f", 0))
    assert (a.hit_count, policy.uses_before(a), policy.cell(a)[0]) == (0, 2, 2)
    assert (policy.uses_before(f), policy.cell(f)[0]) == (0, 0)
    assert policy.ghost_size == 0  # recalled: the block holds its count now
    clock.set(120.0)
    m.evict(m.pool.num_used)  # 3 uses of a, 1 of f
    run(m, clock, 121.0, "a4", (("a", 0),))
    run(m, clock, 121.0, "f2", (("f", 0),))
    assert policy.uses_before(m.tree.get(("a", 0))) == 3
    assert policy.uses_before(m.tree.get(("f", 0))) == 1
    # without the ghost an evicted content starts again from none
    plain = LearnedReuse(FLAT)
    m, clock = manager(400, plain)
    run(m, clock, 0.0, "a", (("a", 0),))
    clock.set(60.0)
    m.evict(m.pool.num_used)
    run(m, clock, 61.0, "a2", (("a", 0),))
    assert (plain.ghost_size, plain.uses_before(m.tree.get(("a", 0)))) == (0, 0)


@pytest.mark.parametrize(("ghost", "first"), [(True, ("fresh", 0)), (False, ("seen", 0))])
def test_content_seen_before_outlives_new_content_when_it_returns_more(ghost, first) -> None:
    """The table has learned that blocks used once before return within H and new ones do
    not. A block of content evicted earlier and cached again, and a new one released a
    second later: with the ghost they fall in those two cells, and the new one goes first;
    without it both are new content, and LRU's order decides."""
    policy = LearnedReuse(FLAT, ghost=ghost)
    m, clock = manager(400, policy)
    run(m, clock, 0.0, "x", (("seen", 0),))
    clock.set(60.0)
    m.evict(m.pool.num_used)  # H = 60 s, the idle time of that eviction
    table = policy.table
    out = (8).bit_length()  # run()'s answers are 8 tokens
    seen_cell, new_cell = (1, out, 1, "chat", 0), (0, out, 1, "chat", 0)
    for j in range(20):
        table.open(("s", j), seen_cell, 60.0)
        table.reuse(("s", j), 65.0, policy.horizon)  # back within H
        table.open(("n", j), new_cell, 60.0)
    table.expire(130.0, policy.horizon)  # never back: failed
    run(m, clock, 130.0, "again", (("seen", 0),))
    run(m, clock, 131.0, "new", (("fresh", 0),))
    seen, fresh = m.tree.get(("seen", 0)), m.tree.get(("fresh", 0))
    assert policy.cell(seen) == (seen_cell if ghost else new_cell)
    assert policy.cell(fresh) == new_cell
    clock.set(132.0)
    assert victims(m, 1) == [first]


def test_the_ghost_holds_at_most_the_blocks_the_cache_held() -> None:
    reqs = workloads.read_mooncake(workloads.bundled_trace_path())
    policy = LearnedReuse(ghost=True)
    result = replay(reqs[:1500], policy, 1000, 512, time="arrival")
    assert result.evictions > 10_000
    assert 900 <= policy.ghost_size <= 1000


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ConfigError, match="prior_weight"):
        LearnedReuse(prior_weight=0)
    with pytest.raises(ConfigError, match="memory"):
        LearnedReuse(memory=1)
    with pytest.raises(ConfigError, match="max_conversations"):
        LearnedReuse(max_conversations=0)
    with pytest.raises(ConfigError, match="gaps must be one of"):
        LearnedReuse(gaps="lognormal")
    with pytest.raises(ConfigError, match="ghost must be True or False, got 'yes'"):
        LearnedReuse(ghost="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cost_model"):
        LearnedReuse(cost_model="h100")  # type: ignore[arg-type]


# -- golden numbers ----------------------------------------------------------------------------

GOLDEN = {1000: 0.0963, 2000: 0.1532, 5000: 0.3174, 10000: 0.4743, 20000: 0.6136}


@pytest.mark.parametrize("size", sorted(GOLDEN))
def test_golden_block_hit_ratios_on_the_bundled_trace(size: int) -> None:
    reqs = workloads.read_mooncake(workloads.bundled_trace_path())
    result = replay(reqs, "learned", size, 512, time="arrival")
    assert round(result.block_hit_ratio, 4) == GOLDEN[size]


# -- the empirical gap model (gaps="empirical", an option) -------------------------------------


def test_gap_bins_are_log_spaced_from_a_tenth_of_a_second_to_a_day() -> None:
    assert len(GAP_EDGES) == NUM_GAP_BINS == 26
    assert GAP_EDGES[1] == pytest.approx(0.1) and GAP_EDGES[-1] == pytest.approx(86_400.0)
    assert GAP_EDGES[2] / GAP_EDGES[1] == pytest.approx(864_000 ** (1 / 24))
    assert [gap_bin(x) for x in (0.0, 0.05, 0.1, 1.0, 10.0, 20.0, 86_400.0, 1e9)] \
        == [0, 0, 1, 5, 9, 10, 25, 25]


def test_gap_table_is_the_kaplan_meier_estimate_with_open_trials_censored() -> None:
    """Gaps 1, 1, 10 and one trial still open at age 20: KM gives S = 1/2 past 1 s and 1/4
    past 10 s (at 10 s, two are at risk: the event and the open trial). A negligible prior
    weight: the pooled prior counts resolved trials only, not open ones."""
    table = GapTable(prior_weight=1e-12, memory=float("inf"))
    for i in range(4):
        table.open(("a", i), "a", 0.0)
    table.reuse(("a", 0), 1.0)
    table.reuse(("a", 1), 1.0)
    table.reuse(("a", 2), 10.0)
    assert table.observations == 3
    events, censored = table.counts("a")
    assert events[5] == events[9] * 2 == 2.0 and sum(censored) == 0.0
    assert table.open_counts("a", 20.0)[10] == 1.0  # age 20 s: bin 10
    s = table.survival("a", now=20.0)
    assert s[5] == 1.0 and s[6] == s[9] == pytest.approx(0.5) and s[10] == pytest.approx(0.25)
    assert s[-1] == pytest.approx(0.25)  # no event seen past 10 s
    # without the open trial (only what has resolved), the last one at risk returned
    assert table.survival("a")[10] == 0.0
    # a trial open past the window (a day) is censored there and closed
    table.expire(90_000.0)
    assert table.observations == 4 and table.counts("a")[1][25] == 1.0
    assert not table.trials


def test_open_counts_are_the_open_trials_by_age_under_random_operations() -> None:
    """`open_counts` keeps runs of trials per release; against the trials themselves (no
    decay: each counts 1), after random opens (some of a hash still open, in the same cell
    or another), reuses (some before the trial opened: not its reuse) and expiries."""
    import random

    rng = random.Random(7)
    table = GapTable(prior_weight=8.0, memory=float("inf"))
    cells = ["a", "b", "c"]
    now = 0.0
    for _ in range(3000):
        now += rng.expovariate(1.0)
        op = rng.random()
        if op < 0.5:
            table.open_all([(rng.randrange(60), rng.choice(cells))
                            for _ in range(rng.randrange(1, 6))], now)
        elif op < 0.9:
            table.reuse_all([rng.randrange(60) for _ in range(rng.randrange(1, 4))],
                            now - rng.choice([0.0, 0.0, 5.0]))
        else:
            table.expire(now, rng.choice([20.0, 200.0]))
        if rng.random() < 0.2:
            for cell in cells:
                want = [0.0] * NUM_GAP_BINS
                for t0, c in table.trials.values():
                    if c == cell:
                        want[gap_bin(max(now - t0, 0.0))] += 1.0
                assert table.open_counts(cell, now) == want


def test_return_odds_match_the_survival_curve_they_come_from() -> None:
    """`return_odds` (and its log, what the policy prices with) against the formula written
    out from `survival` and `hazards`: ``1 - S(t + H) / S(t)`` at each bin's geometric middle,
    ``S`` interpolated over log time in a bin; on random tables, open trials included, at
    horizons inside bin 0, inside the range and past a day."""
    import math
    import random

    def reference(table, cell, horizon, now):
        hz, start = table.hazards(cell, now), table.survival(cell, now)

        def surv(x):
            k = gap_bin(x)
            if k == NUM_GAP_BINS - 1:
                return start[k]
            frac = x / 0.1 if k == 0 else math.log(x / GAP_EDGES[k]) / math.log(GAP_EDGES[2]
                                                                              / GAP_EDGES[1])
            return start[k] * (1.0 - hz[k]) ** frac

        ratio = GAP_EDGES[2] / GAP_EDGES[1]
        idle = [0.05] + [GAP_EDGES[k] * math.sqrt(ratio) for k in range(1, NUM_GAP_BINS - 1)]
        idle.append(86_400.0)
        return [1.0 - surv(t + horizon) / surv(t) if surv(t) > 0 else 0.0 for t in idle]

    rng = random.Random(3)
    for trial in range(40):
        table = GapTable(prior_weight=rng.choice([1e-9, 8.0]), memory=1000.0)
        cells = ["a", "b"]
        now = 0.0
        for j in range(rng.randrange(1, 60)):
            now += rng.expovariate(0.2)
            table.open((trial, j), rng.choice(cells), now)
            if rng.random() < 0.7:
                table.reuse((trial, j), now + rng.lognormvariate(2.0, 3.5))
        now += 100.0
        for cell in cells + ["never seen"]:
            for horizon in (0.03, 7.0, 60.0, 3_000.0, 200_000.0):
                want = reference(table, cell, horizon, now)
                got = table.return_odds(cell, horizon, now)
                assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
                logs = table.log_return_odds(cell, horizon, now)
                assert [math.exp(x) for x in logs] == got
                assert all((x == -math.inf) == (q == 0.0) for x, q in zip(logs, want))


def test_a_sparse_cell_backs_off_to_the_pooled_gaps() -> None:
    table = GapTable(prior_weight=8.0, memory=float("inf"))
    for i in range(8):
        table.open(("a", i), "a", 0.0)
        table.reuse(("a", i), 1.0)  # every gap of a is 1 s
    assert table.hazards("a")[5] == 1.0
    assert table.hazards("new")[5] == 1.0  # an unseen cell: the pooled estimate
    table.open(("b", 0), "b", 0.0)
    table.reuse(("b", 0), 10.0)  # one gap of 10 s in b, against 8 pseudo-trials at 1 s
    pooled_at_1s = 8 / 9
    assert table.hazards("b")[5] == pytest.approx(8 * pooled_at_1s / (1 + 8))


@pytest.mark.parametrize("table", [ReuseTable(8.0, 1000.0), GapTable(8.0, 1000.0)],
                         ids=["reuse", "gaps"])
def test_a_trial_book_holds_its_open_trials_not_its_history(table) -> None:
    """Releases whose trials all end in a reuse leave nothing behind: neither their place in
    the expiry order (kept a day with empirical gaps) nor, in `GapTable`, a run in a cell
    that is never read. 20,000 more such releases in one cell may not add 200 KB; keeping
    either would add about 2.5 MB."""
    import gc
    import tracemalloc

    def peak(start, stop):
        gc.collect()
        tracemalloc.start()
        try:
            for i in range(start, stop):
                table.open_all([(i % 50, "never read")], float(i))
                table.reuse_all([i % 50], i + 0.5, horizon=86_400.0)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(0, 2_000)  # the table's own structures reach their size
    short, long = peak(2_000, 4_000), peak(4_000, 24_000)
    assert long - short < 200_000, (short, long)
    assert not table.trials  # every trial ended in its reuse


def test_empirical_cold_start_is_lru() -> None:
    m, clock = manager(4, LearnedReuse(FLAT, gaps="empirical"))
    for i, t in enumerate((0, 1, 2, 3)):
        run(m, clock, t, i, (100 + i,))
    run(m, clock, 4, 9, (101,))
    assert victims(m, 4) == [100, 102, 103, 101]


def test_a_heavy_tailed_cell_keeps_a_block_idle_90_s_over_a_short_gap_cells_idle_20_s() -> None:
    """Cell "heavy": gaps of 1 s to 300 s. Cell "short": half its blocks return within 10 s,
    the rest never (still open). At 90 s idle a heavy block still has even odds of a return
    within H = 60 s; a short-gap block idle 20 s is almost surely dead."""
    policy = LearnedReuse(FLAT, gaps="empirical")
    m, clock = manager(400, policy)
    run(m, clock, 400.0, "h", (("heavy", 0),), cls="heavy")
    run(m, clock, 470.0, "s", (("short", 0),), cls="short")
    heavy, short = m.tree.get(("heavy", 0)), m.tree.get(("short", 0))
    ch, cs = policy.cell(heavy), policy.cell(short)
    assert ch != cs
    table = policy.table
    assert isinstance(table, GapTable)
    for j, gap in enumerate((1, 2, 5, 10, 30, 60, 100, 150, 200, 300) * 2):
        table.open(("h", j), ch, 0.0)
        table.reuse(("h", j), float(gap))
    for j in range(20):
        table.open(("s", j), cs, 0.0)
        if j < 10:
            table.reuse(("s", j), 1.0 + 0.8 * j)  # 1 to 8.2 s; the other ten stay open
    now = 490.0
    assert policy.horizon == 60.0
    assert policy.return_odds(heavy, now) > 0.4 > 0.1 > policy.return_odds(short, now)
    clock.set(now)
    assert victims(m, 1) == [("short", 0)]  # the more recent one, LRU's last choice


def test_empirical_estimates_at_t_use_no_event_after_t() -> None:
    reqs = workloads.read_mooncake(workloads.bundled_trace_path())
    cut = 300.0
    head = [r for r in reqs if r.arrival <= cut]

    def table_at_cut(source: list[Request]) -> dict:
        policy = LearnedReuse(gaps="empirical")
        snapshot: dict = {}
        orig = policy.on_begin

        def on_begin(request, hits, new, now, orig=orig):
            if request.arrival <= cut:
                table = policy.table
                snapshot.clear()
                snapshot.update(
                    odds={c: table.return_odds(c, policy.horizon, now) for c in table.cells()},
                    horizon=policy.horizon, obs=table.observations)
            orig(request, hits, new, now)

        policy.on_begin = on_begin  # type: ignore[method-assign]
        replay(source, policy, 2000, 512, time="arrival")
        return snapshot

    full, partial = table_at_cut(reqs), table_at_cut(head)
    assert full == partial
    assert full["obs"] > 500


EMPIRICAL = {1000: 0.0857, 2000: 0.1544, 5000: 0.2967, 10000: 0.4530, 20000: 0.6098}
#: with the ghost (``ghost=True``)
EMPIRICAL_GHOST = {1000: 0.0900, 2000: 0.1617, 5000: 0.2959, 10000: 0.4593, 20000: 0.6120}


@pytest.mark.parametrize("size", [2000, 20000])
@pytest.mark.parametrize("ghost", [False, True])
def test_empirical_golden_block_hit_ratios(size: int, ghost: bool) -> None:
    reqs = workloads.read_mooncake(workloads.bundled_trace_path())
    result = replay(reqs, LearnedReuse(gaps="empirical", ghost=ghost), size, 512,
                    time="arrival")
    assert round(result.block_hit_ratio, 4) == (EMPIRICAL_GHOST if ghost else EMPIRICAL)[size]


def test_the_stateful_machine_runs_learned_with_the_ghost() -> None:
    from kvevict.testing import machine_for

    machine_for(lambda: LearnedReuse(gaps="empirical", ghost=True)).TestCase().runTest()
    machine_for(lambda: LearnedReuse(ghost=True), num_blocks=5, block_size=2).TestCase().runTest()
