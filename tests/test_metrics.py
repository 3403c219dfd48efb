"""Per-request numbers of a run: the TTFT in its parts, recomputed prefill priced, one
denominator for the hit ratios, per-class summaries (`kvevict.run`, `kvevict.scheduler`)."""

import math

import attrs
import pytest

from kvevict import BlockPool, KVCacheManager, ManualClock, Request
from kvevict.cost import CostModel
from kvevict.policies import Market, MarketAdmission
from kvevict.run import (
    CostModelExecutor,
    RequestRecord,
    chunk_seconds,
    drive,
    recompute_seconds,
)
from kvevict.scheduler import Scheduler, SchedulerConfig
from kvevict.sim import simulate
from kvevict.workloads import generate

# 1 ms per prefill token, no attention term; a decode step costs 10 ms
COST = CostModel(linear_s_per_token=0.001, attn_s_per_pair=0.0, decode_step_s=0.01,
                 decode_s_per_context_token=0.0)


def req(rid, tokens, arrival=0.0, output_len=1, cls="chat", **kw):
    return Request(rid, tokens=list(tokens), arrival=arrival, output_len=output_len,
                   session_id=rid, workload_class=cls, **kw)


def by_id(result):
    return {r.request_id: r for r in result.records}


def parts(r):
    return (round(r.wait_memory, 9), round(r.wait_compute, 9), round(r.prefill_s, 9))


# -- the TTFT in its parts, on hand-built runs --------------------------------------------


def test_waiting_for_the_token_budget_is_compute_and_batch_mates_count_as_prefill():
    # budget 8: A's 8-token prompt fills step 1 (0..8 ms) and B is not reached. Step 2
    # (8..25 ms): A's decode (10 ms) and 7 of B's tokens; step 3 (25..36 ms): A's decode
    # and B's last token, which samples B's first token.
    result = simulate([req("a", range(8), output_len=3), req("b", range(100, 108))],
                      "lru", capacity_blocks=64, block_size=4, cost=COST,
                      config=SchedulerConfig(max_num_batched_tokens=8))
    a, b = by_id(result)["a"], by_id(result)["b"]
    assert parts(a) == (0.0, 0.0, 0.008) and a.ttft == pytest.approx(0.008)
    assert parts(b) == (0.0, 0.008, 0.028)
    assert b.ttft == pytest.approx(0.036)
    assert b.queue_wait == b.wait_compute
    assert b.ttft == pytest.approx(b.queue_wait + b.prefill_s, abs=1e-15)


def test_arriving_during_a_step_waits_for_compute_until_it_ends():
    result = simulate([req("a", range(8)), req("b", range(100, 104), arrival=0.003)],
                      "lru", capacity_blocks=64, block_size=4, cost=COST)
    b = by_id(result)["b"]
    assert parts(b) == (0.0, 0.005, 0.004)  # waits 3..8 ms, then its 4 tokens
    assert b.ttft == pytest.approx(0.009)


def test_a_queue_behind_a_head_that_cannot_allocate_waits_for_memory():
    # 4 blocks of 4 tokens. A (12 tokens, 5 output tokens) holds 3 blocks, then 4 as it
    # decodes (13..16 tokens) until it finishes at 52 ms. B (2 blocks) and C (1 block)
    # arrive during A's prefill (0..12 ms): compute until 12 ms; from then the head B cannot
    # allocate while the step has budget and seats, so B and C behind it wait for memory
    # until 52 ms; both prefill in the step 52..64 ms (8 + 4 tokens).
    reqs = [req("a", range(12), output_len=5),
            req("b", range(100, 108), arrival=0.001, cls="batch"),
            req("c", range(200, 204), arrival=0.002)]
    result = simulate(reqs, "lru", capacity_blocks=4, block_size=4, cost=COST)
    got = by_id(result)
    assert parts(got["a"]) == (0.0, 0.0, 0.012)
    assert parts(got["b"]) == (0.04, 0.011, 0.012)
    assert parts(got["c"]) == (0.04, 0.01, 0.012)
    assert got["b"].ttft == pytest.approx(0.063) and got["c"].ttft == pytest.approx(0.062)
    assert result.preemptions == 0 and got["b"].recompute_prefill_s == 0.0
    s = result.summary()
    assert set(s["classes"]) == {"batch", "chat"}
    batch, chat = s["classes"]["batch"], s["classes"]["chat"]
    assert batch["requests"] == 1 and chat["requests"] == 2
    assert batch["wait_memory_p95"] == 0.04 and batch["wait_compute_p50"] == 0.011
    assert chat["wait_memory_p50"] == 0.02  # A 0, C 0.04
    assert chat["wait_memory_p99"] == round(0.04 * 0.99, 6)  # numpy's linear percentile
    assert chat["prefill_s_mean"] == 0.012 and chat["ttft_p50"] == pytest.approx(0.037)
    assert s["wait_memory_mean"] == round(0.08 / 3, 6)


def test_preempted_mid_prefill_waits_for_memory_and_recomputes_its_partial_block():
    # 4 blocks of 4 tokens, budget 10. Step 1 (0..10 ms): A's 4-token prompt (first token)
    # and 6 of B's 12 tokens (block 0 full and cached, block 1 partial); C arrives at 5 ms.
    # Step 2 (10..20 ms): A's decode takes the last free block; B's next chunk cannot
    # allocate, so B is preempted (block 0 stays cached, block 1 is freed) and the pass
    # admits nothing (memory pressure): C waits for memory. Step 3 (20..30 ms): B's resume
    # still cannot allocate, C waits behind it. A finishes; step 4 (30..40 ms) prefills B's
    # tokens 4..12 (4 and 5 a second time) and 2 of C's; step 5 (40..42 ms) C's last two.
    reqs = [req("a", range(4), output_len=3), req("b", range(100, 112)),
            req("c", range(200, 204), arrival=0.005)]
    result = simulate(reqs, "lru", capacity_blocks=4, block_size=4, cost=COST,
                      config=SchedulerConfig(max_num_batched_tokens=10))
    got = by_id(result)
    b, c = got["b"], got["c"]
    assert b.preemptions == 1 and result.preemptions == 1
    assert parts(b) == (0.02, 0.0, 0.02)
    assert b.ttft == pytest.approx(0.040)
    assert parts(c) == (0.02, 0.005, 0.012)
    assert c.ttft == pytest.approx(0.037)
    assert b.computed_prefill_tokens == 14
    assert b.recompute_prefill_s == pytest.approx(0.002)  # 2 tokens at 1 ms
    assert c.recompute_prefill_s == 0.0
    assert result.summary()["recomputed_prefill_tokens"] == 2
    # one denominator: B's resume found its block 0 cached; that hit is counted apart
    assert (b.prompt_blocks, b.cached_blocks) == (3, 0)
    assert (b.resume_lookups, b.resume_hit_blocks) == (3, 1)
    s = result.summary()
    assert s["block_hit_ratio"] == 0.0 == s["token_hit_ratio"]
    assert (s["resume_lookups"], s["resume_hit_blocks"]) == (3, 1)
    assert s["resume_block_hit_ratio"] == round(1 / 3, 6)
    # the manager's own counters include the resume (what the old column showed)
    assert result.manager_stats["block_hits"] == 1
    assert result.manager_stats["block_hit_ratio"] == pytest.approx(1 / 8)


def test_time_preempted_before_the_first_token_is_waiting_for_memory():
    # reference: watch the queue after every step; a request still waiting there preempted
    # (and before its first token) waited for memory during that whole step
    reqs = sorted(generate("chat-server", seed=0, duration=300), key=lambda r: r.arrival)
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(480, 16), "lru", clock=clock)
    sched = Scheduler(manager, CostModelExecutor(CostModel(), clock))
    seen: dict = {}
    last = [clock.now]

    def watch(s):
        for state in s.waiting:
            if state.status == "preempted" and state.first_token_time is None:
                seen[state.request_id] = seen.get(state.request_id, 0.0) + clock.now - last[0]
        last[0] = clock.now

    drive(sched, reqs, clock, watch)
    assert len(seen) >= 5
    for state in sched.finished:
        if state.request_id in seen:
            assert state.wait_memory >= seen[state.request_id] - 1e-9, state
            assert state.wait_memory > 0.0


def test_a_seat_limit_is_waiting_for_compute():
    # max_num_seqs 1: B waits for A's prefill and 4 decodes (0..48 ms) for a seat
    result = simulate([req("a", range(8), output_len=5), req("b", range(100, 104))],
                      "lru", capacity_blocks=64, block_size=4, cost=COST,
                      config=SchedulerConfig(max_num_seqs=1))
    assert parts(by_id(result)["b"]) == (0.0, 0.048, 0.004)


def test_an_admission_deferral_is_waiting_for_memory():
    # an agent step fills 4 of 6 blocks; the batch request arriving at 16 s would evict a
    # fresh agent block: deferred at 16, 17, 18, 19 and 20 s, admitted at 21 s
    cost = CostModel()
    market = Market(cost, block_size=16)
    admission = MarketAdmission(market, max_wait=5.0, retry_interval=1.0)
    reqs = [req("a", range(64), cls="agent"), req("b", range(1000, 1048), arrival=16.0,
                                                   cls="batch")]
    result = simulate(reqs, market, capacity_blocks=6, block_size=16, cost=cost,
                      admission=admission)
    b = by_id(result)["b"]
    assert b.deferrals == 5
    assert (b.wait_memory, b.wait_compute) == (5.0, 0.0)
    assert b.prefill_s == pytest.approx(cost.prefill_seconds(48), rel=1e-12)


# -- recomputed prefill, priced -----------------------------------------------------------


def test_recompute_seconds_prices_what_an_infinite_cache_would_not_compute():
    cost = CostModel(linear_s_per_token=1e-3, attn_s_per_pair=1e-5, prefill_overhead_s=0.5)
    # first admission hit 4 of 20 tokens, an infinite cache 12: tokens 4..12 are recomputed
    assert recompute_seconds(cost, [(4, 20, 16)], 20, 12) == pytest.approx(
        cost.prefill_seconds(16, 4) - cost.prefill_seconds(8, 12))
    # the linear and attention terms of positions 4..11, no overhead (the chunk has
    # compulsory tokens too)
    assert recompute_seconds(cost, [(4, 20, 16)], 20, 12) == pytest.approx(
        8e-3 + 1e-5 * sum(p + 1 for p in range(4, 12)))
    # a chunk that is all recompute carries its overhead
    assert recompute_seconds(cost, [(0, 8, 8), (4, 8, 4)], 8, 0) == pytest.approx(
        cost.prefill_seconds(4, 4))
    # nothing to recompute when the cache had all an infinite one would
    assert recompute_seconds(cost, [(12, 20, 8)], 20, 12) == 0.0
    # a fully cached prompt computes its last token once (compulsory), again after a resume
    logits = [(16, 16, 0)]
    assert recompute_seconds(cost, logits, 16, 16) == 0.0
    assert recompute_seconds(cost, logits * 2, 16, 16) == pytest.approx(
        cost.prefill_seconds(1, 15))
    assert chunk_seconds(cost, 16, 16, 0) == cost.prefill_seconds(1, 15)
    # a miss an infinite cache would also compute is compulsory except the cached part
    assert recompute_seconds(cost, [(0, 16, 16)], 16, 16) == pytest.approx(
        cost.prefill_seconds(16, 0) - cost.prefill_seconds(1, 15))


def test_a_session_evicted_between_turns_recomputes_its_history():
    # 8 blocks of 4 tokens: the batch request between the turns evicts 5 of turn 1's 6
    # blocks; turn 2 (29 tokens) hits 4 tokens where an infinite cache hits 24, so 20 of
    # its 25 computed tokens are recomputed: 20 ms at 1 ms per token
    prompt1, answer1 = list(range(16)), list(range(500, 509))
    t1 = Request("t1", tokens=prompt1, session_id="s", output_len=9, output_tokens=answer1,
                 arrival=0.0, turn=1)
    other = Request("o", tokens=list(range(1000, 1028)), session_id="other",
                    workload_class="batch", output_len=1, arrival=5.0, turn=1)
    t2 = Request("t2", tokens=prompt1 + answer1 + [900, 901, 902, 903], session_id="s",
                 output_len=1, arrival=10.0, turn=2)
    result = simulate([t1, other, t2], "lru", capacity_blocks=8, block_size=4, cost=COST)
    r2 = by_id(result)["t2"]
    assert (r2.cached_tokens, r2.computed_prefill_tokens) == (4, 25)
    assert r2.recompute_prefill_s == pytest.approx(0.020)
    assert r2.prefill_s == pytest.approx(0.025)
    assert by_id(result)["t1"].recompute_prefill_s == 0.0
    big = simulate([t1, other, t2], "lru", capacity_blocks=1000, block_size=4, cost=COST)
    assert all(r.recompute_prefill_s == 0.0 for r in big.records)


# -- every request of random workloads ----------------------------------------------------

#: (workload, seed, seconds, cache blocks or None for the largest request's, scheduler)
RANDOM_RUNS = [
    ("chat-server", 0, 300, 480, SchedulerConfig()),
    ("chat-server", 1, 300, 480, SchedulerConfig(preemption="fewest-processed",
                                                 max_num_batched_tokens=512)),
    ("agent", 2, 600, None, SchedulerConfig(max_num_seqs=4)),
    ("rag", 3, 300, None, SchedulerConfig(enable_chunked_prefill=False)),
    ("mixed", 4, 300, None, SchedulerConfig(max_num_batched_tokens=1024)),
]


@pytest.fixture(scope="module", params=range(len(RANDOM_RUNS)), ids=lambda i: RANDOM_RUNS[i][0])
def random_run(request):
    name, seed, duration, capacity, config = RANDOM_RUNS[request.param]
    reqs = generate(name, seed=seed, duration=duration)
    if capacity is None:  # as tight as the largest request allows
        capacity = max(-(-(r.prompt_len + r.output_len) // 16) for r in reqs)
    return simulate(reqs, "lru", capacity_blocks=capacity, block_size=16, config=config)


def test_the_parts_add_up_for_every_request(random_run):
    for r in random_run.records:
        assert r.queue_wait == r.wait_memory + r.wait_compute  # exactly: the record's sum
        total = r.wait_memory + r.wait_compute + r.prefill_s + r.reload_s
        assert math.isclose(total, r.ttft, rel_tol=1e-12, abs_tol=1e-12), r
        assert min(r.wait_memory, r.wait_compute, r.prefill_s) >= 0.0, r
        assert r.reload_s == 0.0
        # the priced recompute is part of the steps that ran the prefill
        assert 0.0 <= r.recompute_prefill_s <= r.prefill_s * (1 + 1e-12), r
        assert r.prefill_s > 0.0  # every prompt computes at least its last token
    s = random_run.summary()
    parts_mean = s["wait_memory_mean"] + s["wait_compute_mean"] + s["prefill_s_mean"]
    assert s["ttft_mean"] == pytest.approx(parts_mean, abs=2e-6)  # each rounded to 1e-6


def test_block_lookups_reconcile_with_the_manager(random_run):
    recs, stats = random_run.records, random_run.manager_stats
    assert (sum(r.prompt_blocks + r.resume_lookups for r in recs)
            == stats["block_queries"])
    assert sum(r.cached_blocks + r.resume_hit_blocks for r in recs) == stats["block_hits"]
    assert all(r.prompt_blocks == r.prompt_tokens // 16 for r in recs)  # full blocks
    assert all(r.cached_tokens == 16 * r.cached_blocks for r in recs)
    assert sum(r.preemptions for r in recs) == random_run.preemptions
    assert all(r.resume_lookups > 0 for r in recs if r.preemptions)


def test_class_summaries_partition_the_run(random_run):
    s = random_run.summary()
    classes = s["classes"]
    assert sorted(classes) == sorted({r.workload_class for r in random_run.records})
    assert sum(c["requests"] for c in classes.values()) == s["requests"]
    assert sum(c["preemptions"] for c in classes.values()) == s["preemptions"]
    for cls, c in classes.items():
        recs = [r for r in random_run.records if r.workload_class == cls]
        assert c["token_hit_ratio"] == round(
            sum(r.cached_tokens for r in recs) / sum(r.prompt_tokens for r in recs), 6)
        assert c["block_hit_ratio"] == round(
            sum(r.cached_blocks for r in recs) / sum(r.prompt_blocks for r in recs), 6)
        assert c["ttft_p95"] >= c["ttft_p50"]


def test_an_unbounded_cache_never_waits_for_memory():
    reqs = generate("chat-server", seed=1, duration=300)
    result = simulate(reqs, "lru", capacity_blocks=200_000, block_size=16)
    assert result.preemptions == 0
    assert all(r.wait_memory == 0.0 for r in result.records)
    assert sum(r.wait_compute for r in result.records) > 0  # the batch jobs queue
    s = result.summary()
    assert s["wait_memory_p99"] == 0.0 and s["queue_wait_p95"] == s["wait_compute_p95"]
    assert all(r.recompute_prefill_s == 0.0 for r in result.records)


# -- one denominator under pressure -------------------------------------------------------


@pytest.fixture(scope="module")
def pressured():
    """chat-server at the pressure of ``--scale 4 --cache-blocks 480`` (cut to 300 s):
    dozens of preemptions, whose resumes find most of their blocks still cached."""
    reqs = generate("chat-server", seed=0, duration=300)
    return simulate(reqs, "lru", capacity_blocks=480, block_size=16)


def test_token_and_block_hit_differ_only_by_partial_blocks(pressured):
    s = pressured.summary()
    recs = pressured.records
    assert s["preemptions"] > 20 and s["resume_lookups"] > 0
    # token hit = cached blocks * 16 / prompt tokens; block hit = cached / full blocks:
    # the same hits, one divided by the prompts' tokens, one by their full blocks' tokens
    full_tokens = sum(16 * r.prompt_blocks for r in recs)
    prompt = sum(r.prompt_tokens for r in recs)
    assert s["token_hit_ratio"] == pytest.approx(s["block_hit_ratio"] * full_tokens / prompt,
                                                 abs=2e-6)
    assert abs(s["block_hit_ratio"] - s["token_hit_ratio"]) < 0.01
    # the old column divided the manager's counters, resumes included: 0.65 against 0.50
    old = pressured.manager_stats["block_hit_ratio"]
    assert old > s["block_hit_ratio"] + 0.1
    assert s["resume_block_hit_ratio"] > old  # resumes find their own blocks cached


def test_resume_hits_do_not_raise_the_block_hit_ratio(pressured):
    # the same records with every resume's lookups doubled (more preemptions finding their
    # blocks) leave the block hit ratio as it is; only the resume counters move
    s = pressured.summary()
    doubled = attrs.evolve(pressured, records=tuple(
        attrs.evolve(r, resume_lookups=2 * r.resume_lookups,
                     resume_hit_blocks=2 * r.resume_hit_blocks) for r in pressured.records))
    d = doubled.summary()
    assert d["block_hit_ratio"] == s["block_hit_ratio"]
    assert d["token_hit_ratio"] == s["token_hit_ratio"]
    assert d["resume_hit_blocks"] == 2 * s["resume_hit_blocks"]


# -- records in other time units ----------------------------------------------------------


def test_time_divided_divides_every_time_and_nothing_else():
    r = by_id(simulate([req("a", range(8), output_len=3), req("b", range(100, 108))],
                       "lru", capacity_blocks=64, block_size=4, cost=COST,
                       config=SchedulerConfig(max_num_batched_tokens=8)))["b"]
    d = r.time_divided(4.0)
    for field in attrs.fields(RequestRecord):
        before, after = getattr(r, field.name), getattr(d, field.name)
        if isinstance(before, float):
            assert after == before / 4.0, field.name
        else:
            assert after == before, field.name


def test_the_scheduler_alone_splits_the_wait():
    # the scheduler's states carry the parts without the simulator (the engine's path)
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(64, 4), "lru", clock=clock)
    sched = Scheduler(manager, CostModelExecutor(COST, clock),
                      SchedulerConfig(max_num_batched_tokens=8))
    a = sched.add(req("a", range(8), output_len=3))
    b = sched.add(req("b", range(100, 108)))
    assert a.queue_wait is None  # no first token yet
    while sched.has_work():
        sched.step()
    assert (b.wait_memory, b.prefill_time) == (0.0, pytest.approx(0.028))
    assert b.queue_wait == b.wait_compute == pytest.approx(0.008)
    assert b.first_scheduled == pytest.approx(0.008) and b.phase is None
