"""The simulator: agreement with the block-level replay, determinism, exact summaries,
Belady as a bound, MarketAdmission deferrals, preemption modes and bad input.

Every workload here is small (a few hundred requests at most); the one large input is the
bundled Mooncake trace (3,993 requests), read once per module.
"""

from __future__ import annotations

import json

import pytest

import kvevict.scheduler as scheduler_mod
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import preset
from kvevict.policies import Market, MarketAdmission, available_policies
from kvevict.prefix import block_hashes
from kvevict.replay import replay
from kvevict.run import CostModelExecutor
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.types import Request
from kvevict.workloads import bundled_trace_path, generate, read_mooncake, trace_digest

# 1 ms per prefill token, no attention term; a decode step costs 10 ms whatever the context
COST = CostModel(linear_s_per_token=0.001, attn_s_per_pair=0.0, decode_step_s=0.01,
                 decode_s_per_context_token=0.0)
ONLINE = [p for p in available_policies() if p != "belady"]


class Livelock(RuntimeError):
    """The scheduler stepped far more often than the workload needs."""


@pytest.fixture
def step_guard(monkeypatch):
    """Make `Scheduler.step` raise `Livelock` after ``limit`` calls instead of hanging."""

    def install(limit: int) -> list[int]:
        count = [0]
        original = scheduler_mod.Scheduler.step

        def step(self, *args, **kwargs):
            count[0] += 1
            if count[0] > limit:
                raise Livelock(f"{limit} scheduler steps; the clock is stuck at "
                               f"{self.manager.clock()!r}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(scheduler_mod.Scheduler, "step", step)
        return count

    return install


def blocks_needed(req: Request, block_size: int = 16) -> int:
    return -(-(req.prompt_len + req.output_len) // block_size)


# -- timing=False is the plain block-level replay (bundled Mooncake trace) ----------------


@pytest.fixture(scope="module")
def mooncake():
    return read_mooncake(bundled_trace_path("mooncake"))


_PAIRS: dict[tuple[str, int], tuple] = {}


def sim_and_replay(requests, policy: str, capacity: int):
    """One untimed simulation and one replay of the Mooncake trace (memoised per module)."""
    key = (policy, capacity)
    if key not in _PAIRS:
        _PAIRS[key] = (simulate(requests, policy, capacity_blocks=capacity, block_size=512,
                                timing=False),
                       replay(requests, policy, capacity, block_size=512))
    return _PAIRS[key]


@pytest.mark.parametrize("policy, capacity",
                         [("lru", 1000), ("lru", 5000), ("belady", 1000), ("lfu", 1000)])
def test_untimed_simulation_equals_block_replay_on_mooncake(mooncake, policy, capacity):
    sim, rep = sim_and_replay(mooncake, policy, capacity)
    stats = sim.manager_stats
    assert rep.rejected == 0  # every request fits: both runs see the same requests
    assert stats["block_queries"] == rep.accesses
    assert stats["block_hits"] == rep.hits
    assert stats["evictions"] == rep.evictions
    assert stats["prefix_cache_queries"] == rep.token_queries
    assert stats["prefix_cache_hits"] == rep.token_hits
    assert stats["block_hit_ratio"] == rep.block_hit_ratio  # same integers, same float
    summary = sim.summary()
    assert summary["block_hit_ratio"] == round(rep.block_hit_ratio, 6)
    assert summary["evictions"] == rep.evictions
    assert summary["requests"] == len(mooncake) == rep.requests
    assert summary["preemptions"] == 0 and summary["deferrals"] == 0
    # one request at a time, nothing decoded, zero-cost steps
    assert all(r.output_tokens == 1 and r.ttft == 0.0 and r.queue_wait == 0.0
               for r in sim.records)


def test_untimed_lru_hit_ratio_grows_with_capacity(mooncake):
    small, _ = sim_and_replay(mooncake, "lru", 1000)
    large, _ = sim_and_replay(mooncake, "lru", 5000)
    assert small.manager_stats["block_hits"] < large.manager_stats["block_hits"]
    belady, _ = sim_and_replay(mooncake, "belady", 1000)
    lfu, _ = sim_and_replay(mooncake, "lfu", 1000)
    assert belady.manager_stats["block_hits"] >= small.manager_stats["block_hits"]
    assert belady.manager_stats["block_hits"] >= lfu.manager_stats["block_hits"]


def test_untimed_token_hit_ratio_equals_block_replay_on_mooncake(mooncake):
    sim, rep = sim_and_replay(mooncake, "lru", 1000)
    assert all(r.cached_tokens <= r.prompt_tokens for r in sim.records)
    assert sim.summary()["token_hit_ratio"] == round(rep.token_hit_ratio, 6)


def test_mooncake_with_an_infinite_cache_recomputes_nothing(mooncake):
    head = mooncake[:300]
    summary = simulate(head, "lru", capacity_blocks=10**6, block_size=512).summary()
    assert summary["evictions"] == 0 and summary["preemptions"] == 0
    assert summary["token_hit_ratio"] <= summary["infinite_cache_hit_ratio"]
    assert summary["recomputed_prefill_tokens"] == 0


# -- determinism --------------------------------------------------------------------------


def test_same_seed_same_results_and_json():
    first_trace = generate("chat-server", seed=3, duration=600)
    second_trace = generate("chat-server", seed=3, duration=600)
    assert trace_digest(first_trace) == trace_digest(second_trace)
    a = simulate(first_trace, "market", capacity_blocks=2048)
    b = simulate(second_trace, "market", capacity_blocks=2048)
    assert a.summary() == b.summary()
    assert a.records == b.records
    assert a.manager_stats == b.manager_stats
    assert (a.steps, a.makespan, a.preemptions) == (b.steps, b.makespan, b.preemptions)
    assert (json.dumps(a.summary(), sort_keys=True).encode()
            == json.dumps(b.summary(), sort_keys=True).encode())
    assert a.summary()["evictions"] > 0  # the cache was under pressure: policy decisions ran
    other = generate("chat-server", seed=4, duration=600)
    assert trace_digest(other) != trace_digest(first_trace)


# -- exact summaries on a hand-built trace ------------------------------------------------

# block_size 4. Turn 1: a 16-token prompt (4 blocks), 9 output tokens 500..508. The decode
# feeds back 500..507 (the last sampled token is never fed), so 24 tokens = 6 full blocks
# are cached. Turn 2's prompt is turn 1's prompt + answer + 4 new tokens = 29 tokens: it
# hits those 6 blocks (24 tokens) and prefills 5.
PROMPT1 = list(range(16))
ANSWER1 = list(range(500, 509))
PROMPT2 = PROMPT1 + ANSWER1 + [900, 901, 902, 903]


def chat_turns():
    t1 = Request("t1", tokens=PROMPT1, session_id="s", output_len=9, output_tokens=ANSWER1,
                 arrival=0.0, turn=1)
    t2 = Request("t2", tokens=PROMPT2, session_id="s", output_len=1, arrival=10.0, turn=2)
    return t1, t2


def test_two_chat_turns_exact_ttft_and_hits():
    t1, t2 = chat_turns()
    result = simulate([t2, t1], "lru", capacity_blocks=1000, block_size=4, cost=COST)
    r1, r2 = result.records  # sorted by arrival whatever the input order
    assert (r1.request_id, r2.request_id) == ("t1", "t2")
    # turn 1: 16 prefill tokens at 1 ms = 16 ms to the first token, then 8 decode steps
    assert r1.ttft == pytest.approx(0.016)
    assert r1.finish == pytest.approx(0.016 + 8 * 0.010)
    assert (r1.cached_tokens, r1.computed_prefill_tokens, r1.output_tokens) == (0, 16, 9)
    # turn 2: 24 of 29 prompt tokens cached; 5 prefilled at 1 ms
    assert r2.ttft == pytest.approx(0.005)
    assert r2.finish == pytest.approx(10.005)
    assert (r2.cached_tokens, r2.computed_prefill_tokens, r2.output_tokens) == (24, 5, 1)
    assert r1.queue_wait == r2.queue_wait == 0.0
    s = result.summary()
    assert s["requests"] == 2
    assert s["token_hit_ratio"] == round(24 / 45, 6)
    assert s["infinite_cache_hit_ratio"] == round(24 / 45, 6)
    # blocks looked up: 4 (turn 1, none cached) + 7 (turn 2: 6 cached + block 6)
    assert s["block_hit_ratio"] == round(6 / 11, 6)
    assert s["prefill_tokens_computed"] == 21
    assert s["recomputed_prefill_tokens"] == 0
    assert s["ttft_p50"] == pytest.approx((0.016 + 0.005) / 2)
    assert s["evictions"] == 0 and s["evictions_by_class"] == {}
    assert s["preemptions"] == 0 and s["deferrals"] == 0
    # 9 + 1 output tokens over a makespan from t=0 to turn 2's finish at 10.005 s
    assert s["throughput_tokens_per_s"] == round(10 / 10.005, 3)
    assert s["requests_per_s"] == round(2 / 10.005, 6)
    assert s["peak_blocks"] == 8  # turn 2: 6 hit + 2 new blocks (29 tokens)


def test_tiny_cache_evicts_the_session_between_turns():
    # 8 blocks of 4 tokens. After turn 1 its 6 blocks are cached. A batch request of 28
    # tokens (7 blocks) arrives in between: 2 free + 5 evicted chat blocks (LRU evicts
    # leaves, so block 0 of the session survives). Turn 2 then hits only block 0 (4 tokens)
    # and must evict all 7 batch blocks for its 7 new ones.
    t1, t2 = chat_turns()
    other = Request("o", tokens=list(range(1000, 1028)), session_id="other",
                    workload_class="batch", output_len=1, arrival=5.0, turn=1)
    result = simulate([t1, other, t2], "lru", capacity_blocks=8, block_size=4, cost=COST)
    r1, ro, r2 = result.records
    assert ro.request_id == "o" and ro.cached_tokens == 0 and ro.ttft == pytest.approx(0.028)
    assert (r2.cached_tokens, r2.computed_prefill_tokens) == (4, 25)
    assert r2.ttft == pytest.approx(0.025)
    s = result.summary()
    prompt = 16 + 28 + 29
    assert s["infinite_cache_hit_ratio"] == round(24 / prompt, 6)
    assert s["token_hit_ratio"] == round(4 / prompt, 6)
    assert s["prefill_tokens_computed"] == 16 + 28 + 25
    # an infinite cache would compute 73 - 24 = 49 tokens; this one computed 20 more
    assert s["recomputed_prefill_tokens"] == 20
    # each eviction is charged to the class of the request that created the block
    assert s["evictions_by_class"] == {"batch": 7, "chat": 5}
    assert s["evictions"] == 12
    assert s["peak_blocks"] == 8
    # the same trace with a huge cache recomputes nothing
    big = simulate([t1, other, t2], "lru", capacity_blocks=1000, block_size=4, cost=COST)
    assert big.summary()["recomputed_prefill_tokens"] == 0
    assert big.summary()["token_hit_ratio"] == s["infinite_cache_hit_ratio"]


def test_infinite_cache_matches_what_decode_caches():
    # turn 1: 16 prompt tokens + 8 output tokens = 24 = 6 blocks, but only 7 output tokens
    # are fed back, so 5 full blocks are cached; turn 2 can hit 20 tokens, not 24
    answer = list(range(500, 508))
    t1 = Request("t1", tokens=PROMPT1, session_id="s", output_len=8, output_tokens=answer,
                 arrival=0.0, turn=1)
    t2 = Request("t2", tokens=PROMPT1 + answer + [900, 901, 902, 903], session_id="s",
                 output_len=1, arrival=10.0, turn=2)
    result = simulate([t1, t2], "lru", capacity_blocks=1000, block_size=4, cost=COST)
    assert result.records[1].cached_tokens == 20
    s = result.summary()
    assert s["infinite_cache_hit_ratio"] == s["token_hit_ratio"] == round(20 / 44, 6)
    assert s["recomputed_prefill_tokens"] == 0


def test_infinite_cache_hit_ratio_on_a_generated_chat_trace():
    """An independent count of what an unbounded cache hits, with decode semantics (every
    output token but the last is fed back): equal to what a huge cache actually hits."""
    reqs = generate("chat", seed=11, duration=600)
    seen: set = set()
    expected = 0
    for r in reqs:
        hashes = block_hashes(r.tokens, 16)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        expected += min(n * 16, r.prompt_len)
        fed = list(r.tokens) + list(r.output_tokens[:max(r.output_len - 1, 0)])
        seen.update(block_hashes(fed, 16))
    result = simulate(reqs, "lru", capacity_blocks=10**6)
    assert result.summary()["evictions"] == 0
    assert sum(rec.cached_tokens for rec in result.records) == expected
    prompt = sum(r.prompt_len for r in reqs)
    assert result.summary()["token_hit_ratio"] == round(expected / prompt, 6)


# -- Belady bounds the online policies ----------------------------------------------------


@pytest.fixture(scope="module")
def chat_trace():
    reqs = generate("chat", seed=5, duration=900)
    assert max(blocks_needed(r) for r in reqs) < 160
    return reqs


@pytest.mark.parametrize("capacity", [160, 240, 400])
def test_belady_bounds_every_online_policy_untimed(chat_trace, capacity):
    results = {p: simulate(chat_trace, p, capacity_blocks=capacity, timing=False)
               for p in [*ONLINE, "belady"]}
    oracle = results.pop("belady")
    for policy, res in results.items():
        assert res.manager_stats["block_queries"] == oracle.manager_stats["block_queries"]
        assert res.manager_stats["block_hits"] <= oracle.manager_stats["block_hits"], policy
        assert res.summary()["token_hit_ratio"] <= oracle.summary()["token_hit_ratio"], policy


@pytest.mark.parametrize("capacity", [160, 400])
def test_belady_bounds_online_policies_timed_on_chat(chat_trace, capacity):
    """Timed mode gives Belady only the arrival-time future, and preemption resumes add
    lookups, so it is no theorem there; on this chat trace (no preemptions) it still bounds
    the token hit ratio and the recomputed prefill of every online policy."""
    results = {p: simulate(chat_trace, p, capacity_blocks=capacity) for p in [*ONLINE, "belady"]}
    oracle = results.pop("belady").summary()
    for policy, res in results.items():
        s = res.summary()
        assert s["preemptions"] == 0
        assert s["token_hit_ratio"] <= oracle["token_hit_ratio"], policy
        assert s["recomputed_prefill_tokens"] >= oracle["recomputed_prefill_tokens"], policy


# -- MarketAdmission in the simulator ------------------------------------------------------


def agent_then_batch(batch_arrival: float):
    """An agent step fills 4 of 6 blocks (16 tokens each); a batch request needing 3 blocks
    arrives later and must evict one fresh agent block."""
    agent = Request("a", tokens=list(range(64)), session_id="task", workload_class="agent",
                    output_len=1, arrival=0.0, turn=1)
    batch = Request("b", tokens=list(range(1000, 1048)), session_id="job",
                    workload_class="batch", output_len=1, arrival=batch_arrival, turn=1)
    return [agent, batch]


def test_market_admission_defers_a_batch_request_exactly_max_wait(step_guard):
    step_guard(1000)
    cost = CostModel()
    market = Market(cost, block_size=16)
    admission = MarketAdmission(market, max_wait=5.0, retry_interval=1.0)
    result = simulate(agent_then_batch(16.0), market, capacity_blocks=6, block_size=16,
                      cost=cost, admission=admission)
    a, b = result.records
    assert a.deferrals == 0
    # deferred at 16, 17, 18, 19, 20 (the agent block stays fresh); admitted at 21
    assert b.deferrals == 5
    assert b.queue_wait == 5.0
    assert result.summary()["deferrals"] == 5
    # without admission control the batch request evicts at once
    plain = simulate(agent_then_batch(16.0), "market", capacity_blocks=6, block_size=16,
                     cost=cost)
    assert plain.records[1].deferrals == 0 and plain.records[1].queue_wait == 0.0


def test_market_admission_deferral_always_ends(step_guard):
    step_guard(1000)
    cost = CostModel()
    market = Market(cost, block_size=16)
    admission = MarketAdmission(market, max_wait=5.0, retry_interval=1.0)
    result = simulate(agent_then_batch(3.2), market, capacity_blocks=6, block_size=16,
                      cost=cost, admission=admission)
    assert result.records[1].queue_wait == pytest.approx(5.0)


def test_market_admission_on_an_agent_and_batch_mix(step_guard, monkeypatch):
    agent = generate("agent", seed=2, duration=200, tasks_per_minute=4.0)
    batch = generate("batch", seed=2, duration=200, jobs=1, requests_per_job=10,
                     spread_seconds=120.0, first_start=0.1, last_start=0.1,
                     template_tokens=256, input_tokens_mean=400.0, output_tokens_mean=100.0)
    reqs = sorted(agent + batch, key=lambda r: r.arrival)
    assert len({r.request_id for r in reqs}) == len(reqs)
    capacity = int(1.5 * max(blocks_needed(r) for r in reqs))

    step_seconds: list[float] = []
    execute = CostModelExecutor.execute

    def timed_execute(self, plan, manager):
        out = execute(self, plan, manager)
        step_seconds.append(out.seconds)
        return out

    monkeypatch.setattr(CostModelExecutor, "execute", timed_execute)

    class Recording(MarketAdmission):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.first_deferral: dict = {}
            self.admitted_after: dict = {}

        def admit(self, request, num_evictions, manager, now):
            decision = super().admit(request, num_evictions, manager, now)
            rid = request.request_id
            if not decision.admit:
                self.first_deferral.setdefault(rid, now)
            elif rid in self.first_deferral and rid not in self.admitted_after:
                self.admitted_after[rid] = now - self.first_deferral[rid]
            return decision

    max_wait = 5.0
    cost = CostModel()
    market = Market(cost, block_size=16)
    admission = Recording(market, max_wait=max_wait)
    step_guard(100_000)  # the run takes ~12,000 steps
    result = simulate(reqs, market, capacity_blocks=capacity, cost=cost, admission=admission)

    # no starvation: every request ran to its last output token
    by_id = {r.request_id: r for r in reqs}
    assert len(result.records) == len(reqs)
    assert all(rec.output_tokens == max(1, by_id[rec.request_id].output_len)
               for rec in result.records)
    deferred = {rec.workload_class for rec in result.records if rec.deferrals}
    assert deferred == {"batch"}  # batch requests wait; agents never do
    assert result.summary()["deferrals"] > 0
    # every deferral window ends within max_wait plus one scheduler step (the retry happens
    # at the first step boundary at or after the deadline)
    assert admission.first_deferral and set(admission.admitted_after) == set(
        admission.first_deferral)
    longest_step = max(step_seconds)
    assert longest_step < 0.5
    assert max(admission.admitted_after.values()) <= max_wait + longest_step
    # and so each batch request's queue wait is max_wait plus at most one second: before a
    # deferral or after admission it only waits for running requests to free blocks and
    # for step boundaries, which in this run takes well under a second (longest step < 0.5 s)
    waits = [rec.queue_wait for rec in result.records if rec.workload_class == "batch"]
    assert max(waits) <= max_wait + 1.0
    assert max(waits) >= max_wait * 0.9  # some request really did wait out its max_wait
    # the same run without admission control never defers
    plain = simulate(reqs, "market", capacity_blocks=capacity, cost=cost)
    assert plain.summary()["deferrals"] == 0


# -- preemption modes --------------------------------------------------------------------


def test_both_preemption_modes_finish_a_pressured_workload():
    reqs = generate("batch", seed=4, duration=60, jobs=1, requests_per_job=24,
                    template_tokens=256, input_tokens_mean=300.0, output_tokens_mean=200.0)
    capacity = 2 * max(blocks_needed(r) for r in reqs)
    by_id = {r.request_id: r for r in reqs}
    runs = {}
    for mode in ("last-arrived", "fewest-processed"):
        res = simulate(reqs, "lru", capacity_blocks=capacity,
                       config=SchedulerConfig(preemption=mode))
        assert len(res.records) == len(reqs)
        assert all(rec.output_tokens == max(1, by_id[rec.request_id].output_len)
                   for rec in res.records)
        assert res.preemptions > 0
        assert res.summary()["preemptions"] == res.preemptions == sum(
            rec.preemptions for rec in res.records)
        runs[mode] = res
    # the mode reaches the scheduler: the runs preempt differently (at the time of
    # writing 16 preemptions for last-arrived, 21 for fewest-processed)
    assert ([rec.preemptions for rec in runs["last-arrived"].records]
            != [rec.preemptions for rec in runs["fewest-processed"].records])


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("timing", [True, False])
def test_capacity_smaller_than_a_request_names_it(timing):
    reqs = [Request("small", tokens=list(range(8)), output_len=1, arrival=0.0),
            Request("huge-one", tokens=list(range(100, 200)), output_len=1, arrival=1.0)]
    with pytest.raises(ConfigError, match="'huge-one' needs more blocks than the whole pool"):
        simulate(reqs, "lru", capacity_blocks=4, block_size=4, timing=timing)


def test_request_outgrowing_the_pool_while_decoding_names_it():
    reqs = [Request("grows", tokens=list(range(8)), output_len=40, arrival=0.0)]
    with pytest.raises(ConfigError, match="'grows' needs more blocks than the whole pool"):
        simulate(reqs, "lru", capacity_blocks=4, block_size=4)
    # untimed runs decode nothing, so the prompt alone must fit
    ok = simulate(reqs, "lru", capacity_blocks=4, block_size=4, timing=False)
    assert ok.summary()["requests"] == 1


def test_capacity_arguments():
    reqs = [Request("r", tokens=list(range(32)), output_len=2)]
    with pytest.raises(ConfigError, match="cache_bytes= with layout="):
        simulate(reqs, cache_bytes=2**30)
    with pytest.raises(ConfigError, match="capacity_blocks=, or cache_bytes= with layout="):
        simulate(reqs)
    layout = preset("llama-3-8b")
    with pytest.raises(ConfigError, match="hold no block"):
        simulate(reqs, cache_bytes=1000, layout=layout)
    res = simulate(reqs, cache_bytes=2**26, layout=layout)
    assert res.capacity_blocks == layout.blocks_for_bytes(2**26, 16) == 32


@pytest.mark.parametrize("empty", [[], ()])
def test_empty_request_list(empty):
    with pytest.raises(ConfigError, match="at least one request"):
        simulate(empty, "lru", capacity_blocks=8)


def test_a_value_policy_by_name_is_priced_with_the_simulated_box_costs():
    """An untiered run builds ``market`` (and any policy taking ``cost_model``) with the cost
    model the executor charges, not the default one; explicit parameters win."""
    from kvevict.policies.lru import LRU
    from kvevict.policies.registry import POLICIES, register_policy

    seen = []

    @register_policy("probe_cost")
    class Probe(LRU):
        def __init__(self, cost_model: CostModel | None = None) -> None:
            super().__init__()
            seen.append(cost_model)

    try:
        box = CostModel(linear_s_per_token=1e-3)
        requests = [Request(f"r{i}", tokens=list(range(40)), arrival=i * 0.5, output_len=2)
                    for i in range(3)]
        simulate(requests, "probe_cost", capacity_blocks=64, block_size=8, cost=box)
        own = CostModel(linear_s_per_token=2e-3)
        simulate(requests, "probe_cost", capacity_blocks=64, block_size=8, cost=box,
                 policy_params={"cost_model": own})
        simulate(requests, "probe_cost", capacity_blocks=64, block_size=8)
    finally:
        POLICIES.unregister("probe_cost")
    assert seen[0] is box and seen[1] is own and seen[2] is None


# -- the measured load: this policy's work, the decode at the batch the box sustains --------------

LOAD_COST = CostModel(decode_step_s=0.02, decode_s_per_seq=1e-4, decode_s_per_context_token=1e-7,
                      linear_s_per_token=1e-4, attn_s_per_pair=1e-8)


def test_measured_load_of_an_infinite_pool_on_serial_traffic_is_the_offered_load():
    from kvevict.load import offered_load

    # each request done before the next arrives, every shared prefix cached, no seat ever
    # short: the run's work is exactly what rho prices, while the box is busy far longer
    # per request than its share of a full batch
    reqs = [Request(f"r{i}", tokens=list(range(i % 3 * 100, i % 3 * 100 + 40)) + [1000 + i] * 8,
                    output_len=5, arrival=0.2 * i) for i in range(12)]
    summary = simulate(reqs, "lru", capacity_blocks=1000, block_size=16, cost=LOAD_COST,
                       config=SchedulerConfig(max_num_seqs=8)).summary()
    rho = offered_load(reqs, LOAD_COST, 16, max_batch=8).rho
    assert summary["limit_batch"] == 8.0
    assert summary["measured_load"] == pytest.approx(rho, abs=1e-6)
    assert summary["busy_load"] > 3 * summary["measured_load"]
    # no request resumed: the resume hit ratio is undefined, not 0
    assert summary["resume_lookups"] == 0 and summary["resume_block_hit_ratio"] is None


def test_measured_load_prices_the_decode_at_the_batch_memory_allows():
    # 2 blocks hold 2 of these sequences at a time, under 4 seats: every decode step with a
    # request left waiting for memory ran 2 sequences, so the decode's shared part is priced
    # at 2 per step, not at the 4 seats
    # (six arrive at once; a seventh, alone after them, gives the arrivals a span of 1 s)
    reqs = [Request(f"m{i}", tokens=[100 * i + k for k in range(8)], output_len=4,
                    arrival=0.0 if i < 6 else 1.0) for i in range(7)]
    summary = simulate(reqs, "lru", capacity_blocks=2, block_size=16, cost=LOAD_COST,
                       config=SchedulerConfig(max_num_seqs=4)).summary()
    assert summary["limit_batch"] == 2.0
    assert summary["preemptions"] == 0
    prefill = LOAD_COST.prefill_seconds(8)
    decode = 3 * LOAD_COST.decode_s_per_seq + (9 + 10 + 11) * LOAD_COST.decode_s_per_context_token
    work = 7 * (prefill + decode) + 7 * 3 * LOAD_COST.decode_step_s / 2
    assert summary["measured_load"] == pytest.approx(work * 6 / 7 / 1.0, abs=1e-6)
