"""What the timed simulator prints is physically possible: invariants of every record and
every run, on random workloads, boxes, policies, admissions, tiers and loop modes (the
simulator's own production path: `kvevict.sim.simulate`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevict.cost import CostModel
from kvevict.policies.market.admission import admission_for
from kvevict.policies.registry import available_policies
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import TierConfig, simulate
from kvevict.types import Request

BLOCK = 16
# every registered policy with admission always, and the market with its MarketAdmission
# (which defers batch and single-shot requests): one case in four
RUNS = [(p, "always") for p in available_policies()]
RUNS += [("market", "market")] * (len(RUNS) // 3)
CLASSES = ("chat", "agent", "batch", "rag", "single_shot")


@st.composite
def workloads(draw):
    """Up to 14 requests: each starts from one of three shared prefixes (or none), or
    follows an earlier request (its prompt and answer, then a message), with drawn arrival
    gaps, lengths, classes and pauses."""
    prefixes = [[], list(range(2 * BLOCK)), list(range(500, 500 + 3 * BLOCK + 5))]
    reqs: list[Request] = []
    t = 0.0
    for i in range(draw(st.integers(1, 14))):
        follows = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        user = [10_000 + 100 * i + k for k in range(draw(st.integers(1, 60)))]
        answer = [60_000 + 100 * i + k for k in range(draw(st.integers(1, 24)))]
        if follows is None:
            history = draw(st.sampled_from(prefixes))
            extra = {"parent": None}
        else:
            p = reqs[follows]
            history = p.tokens.tolist() + list(p.output_tokens)
            extra = {"parent": p.request_id}
            if draw(st.booleans()):
                extra["pause"] = draw(st.floats(0, 0.5))
        reqs.append(Request(f"r{i}", tokens=history + user, session_id=f"s{i}",
                            workload_class=draw(st.sampled_from(CLASSES)), arrival=t,
                            output_len=len(answer), output_tokens=answer, extra=extra))
        t += draw(st.floats(0, 0.3))
    return reqs


@given(workloads(), st.sampled_from(RUNS), st.integers(0, 40),
       st.integers(16, 256), st.integers(1, 6), st.booleans(),
       st.sampled_from(["last-arrived", "fewest-processed"]),
       st.one_of(st.none(), st.integers(1, 64)), st.booleans(), st.booleans(),
       st.integers(0, 32))
@settings(max_examples=300, deadline=None)
def test_every_number_of_a_timed_run_is_physically_possible(
        reqs, run, spare, budget, seats, chunked, preemption, host, closed, prefetch,
        disk):
    need = max(-(-(r.prompt_len + r.output_len) // BLOCK) for r in reqs)
    capacity = need + spare
    config = SchedulerConfig(max_num_batched_tokens=budget if chunked else 4096,
                             max_num_seqs=seats, enable_chunked_prefill=chunked,
                             preemption=preemption)
    tiers = None if host is None else TierConfig(host_blocks=host, disk_blocks=disk,
                                                 prefetch=prefetch)
    cost = CostModel()
    policy, admission = admission_for(run[1], run[0])
    result = simulate(reqs, policy, capacity_blocks=capacity, cost=cost, config=config,
                      tiers=tiers, closed_loop=closed, records=True, admission=admission)
    trace = {r.request_id: r for r in reqs}
    rec = {r.request_id: r for r in result.records}
    assert sorted(rec) == sorted(trace)
    eps = 1e-9
    for rid, r in rec.items():
        q = trace[rid]
        assert r.arrival >= q.arrival - eps
        parent = q.extra["parent"]
        if closed and parent is not None:
            assert r.arrival >= rec[parent].finish + (q.extra.get("pause") or 0.0) - eps
        for part in (r.wait_memory, r.wait_compute, r.prefill_s, r.reload_s,
                     r.recompute_prefill_s, r.queue_wait):
            assert part >= -eps
        assert r.ttft == pytest.approx(r.wait_memory + r.wait_compute + r.prefill_s
                                       + r.reload_s, abs=1e-9)
        assert r.queue_wait == pytest.approx(r.wait_memory + r.wait_compute, abs=1e-9)
        assert r.ttft > 0  # at least the step that samples the first token
        assert r.arrival + r.ttft <= r.finish + eps
        assert r.output_tokens == q.output_len
        assert r.prompt_tokens == q.prompt_len
        assert 0 <= r.cached_tokens <= r.prompt_tokens
        assert 0 <= r.cached_blocks <= r.prompt_blocks <= r.prompt_tokens // BLOCK
        assert r.cached_tokens == r.cached_blocks * BLOCK
        assert r.recompute_prefill_s <= r.prefill_s + eps
        if r.preemptions == 0:  # (a resumed request may find what others computed since)
            assert r.computed_prefill_tokens == max(r.prompt_tokens - r.cached_tokens, 1)
        assert r.computed_prefill_tokens >= 1
        assert r.resume_hit_blocks <= r.resume_lookups
    s = result.summary()
    assert result.manager_stats["peak_blocks_used"] <= capacity
    first = min(r.arrival for r in result.records)
    last_finish = max(r.finish for r in result.records)
    assert result.makespan == pytest.approx(last_finish - first, abs=1e-9)
    assert result.busy_seconds <= result.makespan + eps
    assert s["token_hit_ratio"] <= s["infinite_cache_hit_ratio"] + eps
    # every token served was computed by some step: at least what an infinite cache computes
    assert s["recomputed_prefill_tokens"] == (
        sum(r.computed_prefill_tokens for r in result.records)
        - result.infinite_compute_tokens)
    assert 0 <= s["held_requests"] <= sum(q.extra["parent"] is not None for q in reqs)
    if not closed:
        assert s["held_requests"] == 0
    if tiers is not None:  # no link moves bytes faster than its bandwidth, or for longer
        t = result.tiers  # than the run
        per = t["bytes_per_block"]
        assert t["hit_blocks"].get("host", 0) + t["hit_blocks"].get("disk", 0) == t["reloads"]
        for tier in t["tiers"]:
            name = tier["name"]
            link = t["links"][name]
            read = t["bytes_read"].get(name, 0)
            assert read == t["hit_blocks"].get(name, 0) * per
            # every block read from a tier crossed its link (so did prefetches never used);
            # a block staged from the host and demoted to the disk before its admission is a
            # host read (it counted as a disk read until 2026-12-03)
            assert t["hit_blocks"].get(name, 0) <= link["blocks"]
            assert link["busy_s"] >= link["blocks"] * per / tier["read_bytes_per_s"] - eps
            assert link["busy_s"] <= result.makespan + eps
            assert 0 <= link["utilization"] <= 1
            assert t["bytes_written"].get(name, 0) == t["demotions"].get(name, 0) * per
            assert 0 <= t["write_utilization"].get(name, 0) <= 1
        assert t["demotions"].get("host", 0) <= result.manager_stats["evictions"]
