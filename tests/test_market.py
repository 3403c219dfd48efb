"""The class-decay market (`kvevict.policies.market`): exact victims against LRU on hand-built
cases, admission with a bounded wait, online learning, sub-linear victim selection, the shared
stateful machine and parameter validation."""

from __future__ import annotations

import math
import random

import pytest

from kvevict.cost import CostModel
from kvevict.errors import AdmissionDeferred, ConfigError, OutOfBlocks
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy, available_policies, make_policy
from kvevict.policies.market import (
    DEFAULT_CLASS_PARAMS,
    ClassParams,
    Market,
    MarketAdmission,
    turn_bucket,
)
from kvevict.policies.pinned import RefcountPinned
from kvevict.pool import BlockPool
from kvevict.testing import machine_for
from kvevict.types import ManualClock, Request

BS = 4  # block size of every hand-built case


def tokens(base: int, n: int) -> list[int]:
    """``n`` distinct token ids starting at ``base``."""
    return list(range(base, base + n))


def new_manager(policy, num_blocks: int, **kwargs) -> tuple[KVCacheManager, ManualClock]:
    clock = ManualClock()
    return KVCacheManager(BlockPool(num_blocks, BS), policy, clock=clock, **kwargs), clock


def use(m: KVCacheManager, clock: ManualClock, t: float, toks: list[int], rid: str,
        **request) -> None:
    """Begin and finish one request at time ``t``."""
    clock.set(t)
    m.begin(Request(rid, tokens=toks, **request))
    m.finish(rid)


def record_evictions(m: KVCacheManager) -> list[int]:
    evicted: list[int] = []
    m.add_eviction_listener(lambda block, now: evicted.append(block.block_id))
    return evicted


def test_registered_and_constructible_without_arguments():
    assert "market" in available_policies()
    policy = make_policy("market")
    assert isinstance(policy, Market) and len(policy) == 0
    assert policy.victim(0.0) is None
    assert make_policy("market", horizon=30.0, learn=False).horizon == 30.0


def test_turn_buckets():
    assert [turn_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 1000)] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


# -- exact victims -----------------------------------------------------------------------------

AGENT, RAG, NEW = tokens(100, 9), tokens(200, 9), tokens(300, 9)


def agent_pause_then_rag(policy) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
    """An agent step finishes at t=0 and pauses for a tool; a RAG answer finishes at t=1;
    at t=5 a new chat turn needs 2 blocks that only evictions can free."""
    m, clock = new_manager(policy, 5)  # 2 + 2 cached, 1 free after the first two
    use(m, clock, 0, AGENT, "agent-step-1", session_id="agent", workload_class="agent")
    use(m, clock, 1, RAG, "rag-query", session_id="rag", workload_class="rag")
    agent_blocks = m.lookup(AGENT).block_ids
    rag_blocks = m.lookup(RAG).block_ids
    assert len(agent_blocks) == len(rag_blocks) == 2
    evicted = record_evictions(m)
    clock.set(5)
    m.begin(Request("chat-turn", tokens=NEW, session_id="user", workload_class="chat"))
    m.check()
    return evicted, agent_blocks, rag_blocks


def test_market_keeps_an_agent_through_a_tool_pause_and_evicts_the_rag_answer():
    evicted, _agent_blocks, rag_blocks = agent_pause_then_rag(Market())
    assert evicted == [rag_blocks[1], rag_blocks[0]]  # the RAG chain, tail first


def test_lru_evicts_the_agent_in_the_same_situation():
    evicted, agent_blocks, _rag_blocks = agent_pause_then_rag("lru")
    assert evicted == [agent_blocks[1], agent_blocks[0]]


def test_agent_and_rag_prices_at_the_pause():
    market = Market()
    m, clock = new_manager(market, 5)
    use(m, clock, 0, AGENT, "a", session_id="agent", workload_class="agent")
    use(m, clock, 1, RAG, "r", session_id="rag", workload_class="rag")
    agent_tail = m.block(m.lookup(AGENT).block_ids[1])
    rag_tail = m.block(m.lookup(RAG).block_ids[1])
    # agent: p = 0.75, mu = 6.2 s, idle 5 s; H = 60 s
    p, mu = 0.75, 6.2
    expected = -math.expm1(-60 / mu) / (1 + math.exp(5 / mu - math.log(p / (1 - p))))
    assert market.reuse_probability(agent_tail, 5.0) == pytest.approx(expected, rel=1e-12)
    assert market.reuse_probability(rag_tail, 5.0) < 0.01 < 0.5 < expected


SYSTEM = tokens(1000, 4)  # one block


def shared_system_prompt_vs_private_chat(policy) -> tuple[list[int], int, int]:
    """Three sessions use a one-block system prompt (t=0, 1, 2); a private chat caches one
    block at t=3; at t=4 a new request needs a block that only an eviction can free."""
    m, clock = new_manager(policy, 3)
    for i in range(3):
        use(m, clock, i, [*SYSTEM, 7], f"s{i}", session_id=f"session-{i}")
    system_block = m.lookup(SYSTEM).block_ids[0]
    assert m.block(system_block).num_sharers == 3
    use(m, clock, 3, [*tokens(2000, 4), 7], "private", session_id="private")
    private_block = m.lookup(tokens(2000, 4)).block_ids[0]
    evicted = record_evictions(m)
    clock.set(4)
    m.begin(Request("next", tokens=[*tokens(3000, 4), 7], session_id="newcomer"))
    m.check()
    return evicted, system_block, private_block


def test_market_keeps_a_system_prompt_shared_by_three_sessions_over_a_newer_private_chat():
    evicted, _system_block, private_block = shared_system_prompt_vs_private_chat(Market())
    assert evicted == [private_block]


def test_lru_evicts_the_shared_system_prompt():
    evicted, system_block, _private_block = shared_system_prompt_vs_private_chat("lru")
    assert evicted == [system_block]


def test_shared_price_is_the_union_of_the_sharers_odds():
    market = Market()
    m, clock = new_manager(market, 3)
    for i in range(3):
        use(m, clock, i, [*SYSTEM, 7], f"s{i}", session_id=f"session-{i}")
    block = m.block(m.lookup(SYSTEM).block_ids[0])
    p, mu = 0.5, 373.0  # chat, first turn
    q = [-math.expm1(-60 / mu) / (1 + math.exp((4 - t) / mu - math.log(p / (1 - p))))
         for t in (0, 1, 2)]
    union = 1 - (1 - q[0]) * (1 - q[1]) * (1 - q[2])
    assert market.reuse_probability(block, 4.0) == pytest.approx(union, rel=1e-12)


# -- admission ---------------------------------------------------------------------------------


def agent_state_fills_the_pool(max_wait: float = 5.0):
    market = Market()
    admission = MarketAdmission(market, max_wait=max_wait)
    m, clock = new_manager(market, 2, admission=admission)
    use(m, clock, 0, AGENT[:5], "agent-step", session_id="agent", workload_class="agent")
    assert m.num_free_blocks == 1 and m.num_cached_blocks == 1
    return m, clock, market, admission


def test_admission_defers_a_batch_request_that_would_evict_a_live_agent_then_admits_it():
    m, clock, market, admission = agent_state_fills_the_pool(max_wait=5.0)
    agent_block = m.lookup(AGENT[:5]).block_ids[0]
    batch = Request("batch-1", tokens=tokens(500, 5), session_id="job", workload_class="batch")
    before = (m.stats.as_dict(), [b.block_hash for b in m.tree], m.num_free_blocks)
    clock.set(1)
    with pytest.raises(AdmissionDeferred) as info:
        m.begin(batch)
    assert info.value.request_id == "batch-1"
    assert 0 < info.value.retry_after <= 5.0
    assert "batch" in info.value.reason
    m.check()
    assert (m.stats.as_dict(), [b.block_hash for b in m.tree], m.num_free_blocks) == before
    assert m.sequences == {} and m.block(agent_block) is not None
    clock.set(4)  # 3 s after the first deferral: still within max_wait
    with pytest.raises(AdmissionDeferred):
        m.begin(batch)
    m.check()
    # the agent's state is still priced above what a batch request is worth at t=6 ...
    assert market.cheapest(1, 6.0)[0].reuse_probability > admission.weight("batch")
    clock.set(6)  # ... but the request has waited max_wait: admitted, the agent evicted
    seq = m.begin(batch)
    assert seq.block_table and m.lookup(AGENT[:5]).num_cached_blocks == 0
    assert m.stats.evictions == 1 and admission.deferrals == 2
    m.check()


def test_admission_admits_an_interactive_chat_request_in_the_same_situation():
    m, clock, _market, admission = agent_state_fills_the_pool()
    chat = Request("chat-1", tokens=tokens(500, 5), session_id="user", workload_class="chat")
    assert admission.admit(chat, 1, m, 1.0).admit
    clock.set(1)
    m.begin(chat)
    assert m.stats.evictions == 1 and admission.deferrals == 0
    m.check()


def test_admission_admits_a_batch_request_that_only_evicts_a_finished_rag_answer():
    market = Market()
    m, clock = new_manager(market, 2, admission=MarketAdmission(market))
    use(m, clock, 0, RAG[:5], "rag-query", session_id="rag", workload_class="rag")
    clock.set(1)
    m.begin(Request("batch-1", tokens=tokens(500, 5), session_id="job",
                    workload_class="batch"))
    assert m.stats.evictions == 1
    m.check()


def test_cheapest_matches_the_eviction_order():
    market = Market()
    m, clock = new_manager(market, 12)
    use(m, clock, 0, AGENT, "a", session_id="agent", workload_class="agent")
    use(m, clock, 1, RAG, "r", session_id="rag", workload_class="rag")
    use(m, clock, 2, NEW, "c", session_id="chat")
    quotes = market.cheapest(6, 3.0)
    assert [q.price for q in quotes] == sorted(q.price for q in quotes)
    assert market.cheapest_prices(6, 3.0) == [q.price for q in quotes]
    assert len(quotes) == 3  # the three chain tails are the only candidates (leaves)
    assert [q.workload_class for q in quotes] == ["rag", "chat", "agent"]
    evicted = record_evictions(m)
    clock.set(3)
    m.evict(6)
    # evicting a tail makes its parent a candidate; quotes only list current candidates
    assert evicted[0] == quotes[0].block_id
    assert market.cheapest(0, 3.0) == []


# -- learning ----------------------------------------------------------------------------------


def learning_stream(m: KVCacheManager, clock: ManualClock, returning: int = 40,
                    never: int = 120) -> float:
    """Unlabelled traffic (every request "chat"): ``returning`` sessions come back every 2 s
    for 4 turns in all; ``never`` sessions have one turn and vanish. Returns the last time."""
    events = []
    for i in range(returning):
        for turn in range(4):
            events.append((i * 0.5 + 2.0 * turn, f"r{i}", turn))
    for i in range(never):
        events.append((i * 0.2, f"n{i}", 0))
    events.sort()
    base = {}
    for t, session, turn in events:
        start = base.setdefault(session, 10_000 + 100 * len(base))
        use(m, clock, t, tokens(start, BS * (turn + 1)), f"{session}-{turn}",
            session_id=session)
    return events[-1][0]


def test_learning_moves_the_class_model_in_the_right_direction():
    market = Market()
    m, clock = new_manager(market, 512)
    last = learning_stream(m, clock)
    assert m.stats.evictions == 0
    before = market.estimate("chat")  # returns are seen at once, abandonment after 1800 s
    default = DEFAULT_CLASS_PARAMS["chat"]
    assert before.mean_reuse_s < 10.0 < default.mean_reuse_s  # ~2 s gaps, not minutes
    assert before.gap_samples == pytest.approx(120, rel=0.15)
    after = market.estimate("chat", now=last + default.abandon_after_s + 1)
    assert after.abandons == pytest.approx(160, rel=0.15)  # 120 one-shot + 40 last turns
    # a first turn is followed by another only 1 time in 4 here, below the 0.5 prior ...
    assert after.p_return[0] < 0.35 < default.p_return[0]
    # ... but a session that came back keeps coming back (turns 2-3), above the 0.7 prior
    assert after.p_return[1] > 0.9 > default.p_return[1]
    assert after.mean_reuse_s < 10.0  # abandonments only age the gap samples (forgetting)
    fresh = Market(learn=False).estimate("chat", now=1e6)
    assert fresh.p_return == default.p_return and fresh.mean_reuse_s == default.mean_reuse_s


def two_chat_sessions(m: KVCacheManager, clock: ManualClock, t0: float) -> tuple[int, int]:
    """Session A has two turns (t0, t0+1) and goes quiet; session B has its first turn at
    t0+30. Returns the candidate leaves of A and B."""
    a, b = tokens(50_000, 8), tokens(60_000, 4)
    use(m, clock, t0, a[:4], "A-1", session_id="A")
    use(m, clock, t0 + 1, a, "A-2", session_id="A")
    use(m, clock, t0 + 30, b, "B-1", session_id="B")
    return m.lookup(a).block_ids[1], m.lookup(b).block_ids[0]


def test_an_exact_victim_changes_after_learning():
    # without history: A (2 turns, p = 0.7, idle 30 s of a 373 s mean) outprices B (first
    # turn, p = 0.5): B is the victim
    untrained = Market()
    m, clock = new_manager(untrained, 64)
    a_leaf, b_leaf = two_chat_sessions(m, clock, 0.0)
    assert untrained.victim(31.0) == b_leaf
    # after learning that sessions come back within seconds or never, A (idle 30 s, many
    # mean gaps) is as good as gone, while B may still come back: A is the victim
    trained = Market()
    m, clock = new_manager(trained, 512)
    last = learning_stream(m, clock)
    t0 = last + 2000.0
    clock.set(t0)
    m.evict(m.num_evictable_blocks)
    a_leaf, b_leaf = two_chat_sessions(m, clock, t0)
    assert trained.victim(t0 + 31.0) == a_leaf
    assert trained.estimate("chat").mean_reuse_s < 10.0


def test_learning_off_keeps_the_defaults():
    market = Market(learn=False)
    m, clock = new_manager(market, 512)
    learning_stream(m, clock)
    est = market.estimate("chat", now=1e5)
    assert est.returns == est.abandons == est.gap_samples == 0
    assert est.mean_reuse_s == DEFAULT_CLASS_PARAMS["chat"].mean_reuse_s


def test_chunked_prefill_is_not_a_new_turn():
    market = Market()
    m, clock = new_manager(market, 16)
    if "max_new_tokens" not in KVCacheManager.begin.__code__.co_varnames:
        pytest.skip("this manager has no chunked prefill")
    clock.set(0)
    m.begin(Request("r", tokens=tokens(100, 16), session_id="s"), max_new_tokens=4)
    clock.set(1)
    m.prefill("r")
    m.finish("r")
    assert market._sessions["s"].turns == 1


# -- sub-linear victim selection ---------------------------------------------------------------

CLASSES = ("chat", "agent", "rag", "single_shot", "batch")


def test_victim_selection_prices_queue_heads_not_candidates():
    n = 10_000
    market = Market()
    m, clock = new_manager(market, n + 64)
    for i in range(n):
        use(m, clock, i * 0.01, tokens(BS * i, BS), f"r{i}", session_id=i,
            workload_class=CLASSES[i % len(CLASSES)])
    assert len(market) == m.num_candidates == n
    queues = market.num_queues
    assert queues == len(CLASSES)  # one (class, turn, cost) queue each here
    t = clock.now
    for _ in range(50):  # a new instant per call: every head is priced once
        t += 1.0
        clock.set(t)
        before = market.price_evaluations
        assert m.evict(1) == 1
        assert market.price_evaluations - before <= market.num_queues + 2
    before = market.price_evaluations
    assert m.evict(500) == 500  # one instant: only the changed heads are priced again
    assert market.price_evaluations - before <= market.num_queues + 2 * 500
    before = market.price_evaluations
    market.cheapest(100, t)
    assert market.price_evaluations - before <= market.num_queues + 100
    m.check()


def test_victim_is_the_cheapest_candidate():
    """Against a brute-force scan: mixed classes, turns, depths and idle times, no sharing
    (the queues are exact there)."""
    rng = random.Random(7)
    market = Market(block_size=BS)
    m, clock = new_manager(market, 600)
    t = 0.0
    sessions: dict[int, int] = {}
    for i in range(300):
        t += rng.choice([0.0, 0.5, 3.0, 20.0, 200.0])
        s = rng.randrange(60)
        turn = sessions.get(s, 0)
        sessions[s] = turn + 1
        use(m, clock, t, tokens(100_000 + 1000 * s, BS * min(turn + 1, 8)), f"r{i}",
            session_id=s, workload_class=CLASSES[s % len(CLASSES)])
    for _ in range(60):
        t += rng.choice([0.0, 1.0, 30.0])
        clock.set(t)
        candidates = list(m.tree.candidates.values())
        best = min(candidates, key=lambda b: (market.price(b, t), b.last_access_tick))
        assert market.victim(t) == best.block_id
        m.evict(1)
    m.check()


# -- the shared stateful machine ---------------------------------------------------------------


def test_machine_market():
    machine_for(lambda: Market()).TestCase().runTest()


def test_machine_market_extreme_parameters():
    machine_for(lambda: Market(horizon=1.0, max_sharers=1, memory=2.0, cost_resolution=1,
                               max_sessions=2),
                num_blocks=6, block_size=2).TestCase().runTest()


def test_machine_market_tensor_mode_and_wrapped_in_pinned():
    machine_for(lambda: RefcountPinned(inner=Market()), tensor=True,
                num_blocks=10).TestCase().runTest()


# -- parameters --------------------------------------------------------------------------------


@pytest.mark.parametrize("params, message", [
    ({"horizon": 0}, "horizon"),
    ({"horizon": math.inf}, "horizon"),
    ({"horizon": "60"}, "horizon"),
    ({"cost_model": "h100"}, "cost_model"),
    ({"block_size": 0}, "block_size"),
    ({"learn": 1}, "learn"),
    ({"prior_weight": -1}, "prior_weight"),
    ({"memory": 1}, "memory"),
    ({"cost_resolution": 0}, "cost_resolution"),
    ({"max_sessions": 1.5}, "max_sessions"),
    ({"max_sharers": 0}, "max_sharers"),
    ({"default_class": "nope"}, "default_class"),
    ({"class_params": {"chat": {"p_return": 1.5}}}, "p_return"),
    ({"class_params": {"chat": {"p_return": (0.5, 0.6)}}}, "p_return"),
    ({"class_params": {"chat": {"mean_reuse_s": 0}}}, "mean_reuse_s"),
    ({"class_params": {"chat": {"halflife": 3}}}, "unknown field"),
    ({"class_params": {"chat": 0.5}}, "class_params"),
    ({"class_params": ["chat"]}, "class_params"),
    ({"class_params": {"code": {"p_return": 0.5}}, "default_class": "nope"}, "new class"),
])
def test_bad_parameters_raise_config_error(params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy("market", **params)


def test_class_params_overrides_and_unknown_classes():
    market = Market(class_params={
        "agent": {"mean_reuse_s": 2.0},
        "code": ClassParams(0.9, 30.0, 600.0, weight=1.0),
    }, cost_model=CostModel(), learn=False)
    assert market.class_params["agent"].mean_reuse_s == 2.0
    assert market.class_params["agent"].p_return == DEFAULT_CLASS_PARAMS["agent"].p_return
    assert market.estimate("code").p_return == (0.9,) * 5
    assert market.estimate("unheard-of").mean_reuse_s == DEFAULT_CLASS_PARAMS["chat"].mean_reuse_s
    with pytest.raises(ConfigError, match="abandon_after_s"):
        ClassParams(0.5, 10.0, -1.0)
    with pytest.raises(ConfigError, match="workload_class"):
        market.estimate("")


@pytest.mark.parametrize("kwargs, message", [
    ({"max_wait": -1}, "max_wait"),
    ({"max_wait": math.nan}, "max_wait"),
    ({"retry_interval": 0}, "retry_interval"),
    ({"weights": {"batch": -0.1}}, "weights"),
    ({"weights": [0.1]}, "weights"),
    ({"deferrable": "batch"}, "deferrable"),
    ({"deferrable": [1]}, "deferrable"),
])
def test_bad_admission_parameters_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        MarketAdmission(Market(), **kwargs)


def test_admission_needs_a_market():
    with pytest.raises(ConfigError, match="Market"):
        MarketAdmission(make_policy("lru"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="k must"):
        Market().cheapest(-1, 0.0)


# -- package layout and the learner's view of turns --------------------------------------------


def test_package_reexports_and_public_class_parameters():
    import kvevict.policies as policies
    from kvevict.policies.market import admission, index, learner, policy, price

    assert policies.Market is policy.Market is Market
    assert policies.MarketAdmission is admission.MarketAdmission is MarketAdmission
    assert DEFAULT_CLASS_PARAMS is price.DEFAULT_CLASS_PARAMS
    market = Market(class_params={"batch": {"weight": 0.05}})
    assert isinstance(market.learner, learner.ReuseLearner)
    assert isinstance(market.index, index.PriceIndex)
    assert market.params("batch").weight == 0.05
    assert market.params("no-such-class") == DEFAULT_CLASS_PARAMS["chat"]  # default_class
    adm = MarketAdmission(market)
    assert adm.weight("batch") == 0.05 and adm.is_deferrable("batch")
    assert not adm.is_deferrable("chat")


def test_turns_count_once_per_instant_and_restart_for_a_forgotten_session():
    market = Market()
    m, clock = new_manager(market, 64)
    prompt = tokens(100, 2 * BS)
    for i, t in enumerate((0, 10, 20, 20)):  # the two requests at t=20 are one turn
        use(m, clock, t, prompt + tokens(1000 * (i + 1), BS), f"a{i}", session_id="a")
    assert market.learner.sessions["a"].turns == 3
    # with room for one session record, a session that was forgotten starts over, also when
    # it comes back at the instant another session was begun
    market = Market(max_sessions=1)
    m, clock = new_manager(market, 64)
    use(m, clock, 0, prompt, "a0", session_id="a")
    use(m, clock, 1, tokens(500, 2 * BS), "b0", session_id="b")
    use(m, clock, 2, prompt + tokens(900, BS), "a1", session_id="a")
    use(m, clock, 2, tokens(500, 2 * BS), "b1", session_id="b")
    use(m, clock, 2, prompt + tokens(800, BS), "a2", session_id="a")
    assert list(market.learner.sessions) == ["a"]
    assert market.learner.sessions["a"].turns == 1
    m.check()


# -- the fast paths against their references ---------------------------------------------------


def test_one_pass_sharer_union_is_the_general_union_bit_for_bit():
    """`_shared_log_p`'s one pass (tracked sharers only) gives the very float of the general
    union (`_union_of`), over sharers of several classes and turn counts and idle times."""
    rng = random.Random(3)
    market = Market()
    m, clock = new_manager(market, 400)
    t = 0.0
    for i in range(120):
        t += rng.choice([0.0, 0.5, 2.0, 30.0])
        s = rng.randrange(25)
        use(m, clock, t, [*SYSTEM, *tokens(50_000 + 100 * i, BS)], f"r{i}", session_id=s,
            workload_class=CLASSES[s % len(CLASSES)])
    block = m.block(m.lookup(SYSTEM).block_ids[0])
    assert block.num_sharers > 10
    compared = 0
    for dt in (0.0, 1.0, 7.5, 60.0, 400.0, 5000.0):
        now = t + dt
        market.learner.sync(now)
        log = market._sharers_of(block)
        assert len(log) == block.num_sharers  # all tracked: the one-pass case
        assert market._shared_log_p(block, now) == market._union_of(block, log, now)
        compared += 1
    assert compared == 6


class PerBlockHits(Market):
    """The market as it heard hits before `Policy.on_hits`: one ``on_hit`` per hit block,
    each asking the learner about the session (the reference for the batched hits)."""

    on_hits = Policy.on_hits  # left as the no-op: the manager sends on_hit per block only

    def on_hit(self, block, now):
        session = block.last_hit_session
        rec = self.learner.sessions.get(session)
        if rec is None or rec.last_begin != now:
            self.learner.touch(session, block.workload_class, now, False, True)
        if block.num_sharers > 1:
            tracked = self._sharer_log.get(block.block_id)
            if tracked is None or tracked[0] is not block:
                self._sharers_of(block)
            else:
                tracked[1][session] = now
                if len(tracked[1]) > 2 * self.max_sharers:
                    tracked[1] = self._most_recent(tracked[1])


def _market_state(market: Market) -> tuple:
    learner = market.learner
    sessions = [(k, r.cls, r.turns, r.bucket, r.last_begin, r.last_seen, r.pending)
                for k, r in learner.sessions.items()]
    estimates = [learner.class_estimate(c) for c in sorted(learner.tables)]
    logs = {b: (t[0].block_id, list(t[1].items())) for b, t in market._sharer_log.items()}
    return sessions, estimates, logs, market.price_evaluations, learner.version


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_hits_compute_what_per_block_hits_computed(seed):
    """`Market.on_hits` (one call per begin or resume) against the per-block reference, on
    random begins (chunked too), prefills, appends, preemptions, resumes and finishes of
    sessions of every class sharing system prompts: the same sessions, turns, estimates,
    sharer logs, price evaluations and victims after every operation."""
    rng = random.Random(seed)
    systems = [tokens(10_000 * (k + 1), 2 * BS) for k in range(3)]
    runs = []
    for policy in (Market(max_sharers=3, max_sessions=12), PerBlockHits(max_sharers=3,
                                                                         max_sessions=12)):
        m, clock = new_manager(policy, 40)
        runs.append((m, clock, policy, record_evictions(m)))
    live: list[str] = []
    t = 0.0
    for step in range(500):
        t += rng.choice([0.0, 0.0, 0.5, 3.0, 40.0])
        op = rng.random()
        s = rng.randrange(16)
        rid = f"r{step}"
        request = Request(rid, tokens=[*rng.choice(systems),
                                       *tokens(100 * s, rng.randrange(1, 3 * BS))],
                          session_id=s, workload_class=CLASSES[(s + step // 97) % 5])
        target = rng.choice(live) if live else None
        outcomes = []
        for m, clock, _, _ in runs:
            clock.set(t)
            try:
                if op < 0.4 or target is None:
                    chunk = rng.choice([None, None, BS]) if not outcomes else outcomes[0][1]
                    m.begin(request, max_new_tokens=chunk)
                    outcomes.append(("begin", chunk))
                else:
                    seq = m.sequence(target)
                    if seq.status == "preempted":
                        m.resume(target)
                        outcomes.append(("resume", None))
                    elif seq.num_pending:
                        m.prefill(target)
                        outcomes.append(("prefill", None))
                    elif op < 0.6:
                        m.append(target, tokens(7_000 + step, BS + 1))
                        outcomes.append(("append", None))
                    elif op < 0.75:
                        m.preempt(target)
                        outcomes.append(("preempt", None))
                    else:
                        m.finish(target)
                        outcomes.append(("finish", None))
            except OutOfBlocks:
                outcomes.append(("full", None))
        assert outcomes[0] == outcomes[1]
        if outcomes[0][0] == "begin":
            live.append(rid)
        elif outcomes[0][0] == "finish":
            live.remove(target)
        (m1, _, p1, ev1), (m2, _, p2, ev2) = runs
        assert ev1 == ev2 and _market_state(p1) == _market_state(p2)
    assert len(runs[0][3]) > 100  # the pool turned over
    for m, _, _, _ in runs:
        m.check()


def test_the_index_victim_is_the_cheapest_head_by_a_scan_of_every_price():
    """`PriceIndex.cheapest_entry` (a heap of queue-head prices, a private head's price
    reused for a head last accessed when the one before it was, the victim's price replaced
    in place) names the candidate a scan would: the lowest ``(entry_log_price, tick)`` over
    every queue's oldest live entry. Through pops, adds at both ends and between, removals,
    runs at one instant, new instants and learner versions that change the models."""
    from kvevict.policies.market.index import PriceIndex
    from kvevict.policies.market.price import ReuseModel
    from kvevict.types import BlockInfo

    rng = random.Random(5)
    models = {}
    for tb in range(3):
        models[tb] = ReuseModel()
        models[tb].set(0.2 + 0.3 * tb, 5.0 + 20.0 * tb, 60.0)

    def shared_log_p(block, now):  # decreasing with idle time, as a private queue's price
        return -0.05 * (now - block.last_access) - 0.5

    index = PriceIndex(shared_log_p, lambda key: models[key[1]] if key[1] >= 0 else None)
    indexed: dict[int, tuple[int, tuple]] = {}  # block id -> (tick, key)
    blocks: dict[int, BlockInfo] = {}
    next_tick, first_tick, now, version, popped = 10_000, 10_000, 0.0, 0, 0

    def add(block_id, tick):
        block = BlockInfo(block_id, ("h", block_id), None, 0, None, 1, "chat", "s",
                          tick // 3 * 0.25, tick, None)  # groups of 3 share their access
        block.last_access = tick // 3 * 0.25
        key = ("chat", rng.choice([0, 1, 2, -1]), float(rng.randrange(2)))
        index.add(block, key, key[2])
        blocks[block_id], indexed[block_id] = block, (tick, key)

    def expected(now):
        heads = {}
        for block_id, (tick, key) in indexed.items():
            if key not in heads or tick < heads[key][0]:
                heads[key] = (tick, block_id)
        return min(((index.entry_log_price(index.entry(b), now), tick, b)
                    for tick, b in heads.values()), default=(None, None, None))[2]

    for step in range(4000):
        op = rng.random()
        free = [b for b in range(300) if b not in indexed]
        if op < 0.35 and free:
            if rng.random() < 0.6:
                next_tick += 1
                tick = next_tick  # the newest: to the back
            else:
                first_tick -= rng.randint(1, 2)
                tick = first_tick  # older than all: the front, as a victim's parent
            add(rng.choice(free), tick)
        elif op < 0.45 and indexed:
            block_id = rng.choice(list(indexed))
            index.remove(block_id)
            del indexed[block_id]
        elif op < 0.5:
            now += rng.choice([0.25, 1.0, 10.0])
        elif op < 0.53:
            tb = rng.randrange(3)  # a learner sync: a model changes, the version moves on
            models[tb].set(rng.uniform(0.05, 0.95), rng.uniform(1.0, 100.0), 60.0)
            version += 1
        elif indexed:
            want = expected(now)
            got = index.cheapest_entry(now, version, pop=True)[2]
            assert got == want, (step, got, want)
            del indexed[got]
            popped += 1
            parent = rng.choice(free) if free and rng.random() < 0.7 else None
            if parent is not None:  # the victim's parent, older than every other entry
                first_tick -= 1
                add(parent, first_tick)
    assert popped > 1000 and index.evaluations > popped


def test_learner_tables_hold_the_models_it_hands_out():
    market = Market()
    learner = market.learner
    for cls, tb in (("chat", 0), ("agent", 3), ("chat", 4), ("new-class", 1)):
        model = learner.model(cls, tb)
        assert learner.tables[cls][tb] is model
        assert learner.model(cls, tb) is model
    assert learner.tables["chat"][1] is None  # not made yet


def test_queue_heads_against_a_reference_under_random_adds_and_removes():
    """The deque + heap queues give the oldest live entry as each queue's head, whatever
    the order of ticks (back, front or between) and removals (heads or not)."""
    from kvevict.policies.market.index import PriceIndex
    from kvevict.policies.market.price import ReuseModel
    from kvevict.types import BlockInfo

    model = ReuseModel()
    model.set(0.5, 10.0, 60.0)
    index = PriceIndex(lambda block, now: 0.0, lambda key: model)
    rng = random.Random(11)
    blocks: dict[int, BlockInfo] = {}
    indexed: dict[int, tuple] = {}  # block id -> (tick, key)
    tick = 1000
    for step in range(6000):
        op = rng.random()
        if op < 0.55 or not indexed:
            block_id = rng.randrange(400)
            if block_id in indexed:
                continue
            r = rng.random()
            if r < 0.7:
                tick += 1
                t = tick  # the newest: to the back
            elif r < 0.85:
                t = min((v[0] for v in indexed.values()), default=tick) - rng.randint(1, 5)
            else:
                t = rng.randint(0, tick)
            if any(v[0] == t for v in indexed.values()):
                continue  # ticks are distinct among candidates
            block = BlockInfo(block_id, ("h", block_id), None, 0, None, 1, "chat", "s",
                              float(t), t, None)
            blocks[block_id] = block
            key = ("chat", 0, float(rng.randrange(3)))
            index.add(block, key, key[2])
            indexed[block_id] = (t, key)
        else:
            block_id = rng.choice(list(indexed))
            index.remove(block_id)
            del indexed[block_id]
        if step % 50 == 0 or step > 5900:
            assert len(index) == len(indexed)
            assert index.nonempty == len({v[1] for v in indexed.values()})
            for key, q in index.queues.items():
                if not q.n:
                    continue
                expect = min((v[0], b) for b, v in indexed.items() if v[1] == key)
                head = index._head(q)
                assert (head[0], head[2]) == expect
            victim = index.cheapest_id(float(tick + step), 0)
            if indexed:
                assert victim in indexed
