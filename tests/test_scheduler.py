"""The shared scheduler with the cost-model executor: exact steps, TTFT, preemption choice."""

import pytest

from kvevict import (
    BlockPool,
    ConfigError,
    KVCacheManager,
    ManualClock,
    Request,
)
from kvevict.cost import CostModel
from kvevict.run import CostModelExecutor
from kvevict.scheduler import Scheduler, SchedulerConfig

# 1 ms per prefill token, no attention term; a decode step costs 10 ms
COST = CostModel(linear_s_per_token=0.001, attn_s_per_pair=0.0, decode_step_s=0.01,
                 decode_s_per_context_token=0.0)


def make(num_blocks=64, block_size=4, **config):
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(num_blocks, block_size), "lru", clock=clock)
    sched = Scheduler(manager, CostModelExecutor(COST, clock), SchedulerConfig(**config))
    return clock, manager, sched


def run(sched, limit=1000):
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("did not finish")


def test_chunked_prefill_takes_ceil_prompt_over_budget_steps_then_decodes():
    clock, manager, sched = make(max_num_batched_tokens=32)
    state = sched.add(Request("r", tokens=list(range(100)), output_len=3))
    plans = []
    while sched.has_work():
        plans.append(sched.step())
    chunks = [(c.start, c.end, c.samples) for p in plans for c in p.prefills]
    assert chunks == [(0, 32, False), (32, 64, False), (64, 96, False), (96, 100, True)]
    assert [len(p.decodes) for p in plans] == [0, 0, 0, 0, 1, 1]
    # TTFT = 100 prefill tokens at 1 ms; then two decode steps of 10 ms each
    assert state.ttft == pytest.approx(0.100)
    assert state.finish_time == pytest.approx(0.120)
    assert state.num_output == 3 and state.computed_prefill_tokens == 100
    assert manager.stats.finished == 1
    manager.check()


def test_second_turn_prefills_only_its_new_tokens_and_is_faster():
    clock, manager, sched = make()
    first = sched.add(Request("t1", tokens=list(range(40)), session_id="s", output_len=4,
                              output_tokens=[500, 501, 502, 503]))
    run(sched)
    second_prompt = list(range(40)) + [500, 501, 502, 503] + [7] * 8
    clock.advance(5.0)
    second = sched.add(Request("t2", tokens=second_prompt, session_id="s", arrival=clock.now,
                               output_len=1))
    run(sched)
    # the decode fed 500..502 (the last sampled token is never fed), so 40 + 3 tokens exist:
    # 10 full prompt blocks hit; block 10 (tokens 40..43) was never full
    assert second.cached_tokens == 40
    assert second.computed_prefill_tokens == len(second_prompt) - 40
    assert second.ttft == pytest.approx(0.012)
    assert first.ttft == pytest.approx(0.040)


def test_fully_cached_prompt_recomputes_only_the_last_token():
    clock, manager, sched = make()
    sched.add(Request("a", tokens=list(range(16)), output_len=1))
    run(sched)
    b = sched.add(Request("b", tokens=list(range(16)), output_len=1, arrival=clock.now))
    run(sched)
    assert b.cached_tokens == 16 and b.computed_prefill_tokens == 1
    assert b.ttft == pytest.approx(0.001)


@pytest.mark.parametrize("mode, victim", [("last-arrived", "late"),
                                          ("fewest-processed", "small")])
def test_preemption_victim_choice(mode, victim):
    # 6 blocks of 4 tokens. "small" (arrives first, 4 tokens) and "late" (arrives second,
    # 12 tokens) run; "grower" (arrives last of all? no: first) needs room to decode.
    clock, manager, sched = make(num_blocks=6, block_size=4, preemption=mode,
                                 max_num_batched_tokens=64)
    grower = sched.add(Request("grower", tokens=list(range(100, 104)), output_len=12,
                               arrival=0.0))
    small = sched.add(Request("small", tokens=list(range(200, 204)), output_len=12,
                              arrival=0.1))
    late = sched.add(Request("late", tokens=list(range(300, 312)), output_len=12,
                             arrival=0.2))
    run(sched)
    preempted = {s.request_id for s in (grower, small, late) if s.preemptions}
    assert victim in preempted
    first = min((s for s in (grower, small, late) if s.preemptions),
                key=lambda s: s.first_token_time)
    assert first.request_id in preempted
    assert all(s.status == "finished" and s.num_output == 12 for s in (grower, small, late))
    manager.check()


def test_fewest_processed_preempts_the_cheapest_to_recompute_first():
    clock, manager, sched = make(num_blocks=6, block_size=4, preemption="fewest-processed",
                                 max_num_batched_tokens=64)
    states = [sched.add(Request(n, tokens=list(range(k, k + size)), output_len=12,
                                arrival=a))
              for n, k, size, a in (("grower", 100, 4, 0.0), ("small", 200, 4, 0.1),
                                    ("late", 300, 12, 0.2))]
    order = []
    orig = sched._preempt_for

    def spy(needing, scheduled):
        victim = orig(needing, scheduled)
        order.append(victim.request_id)
        return victim

    sched._preempt_for = spy
    run(sched)
    assert order[0] in ("grower", "small")  # 4 + decoded tokens < late's 12
    assert all(s.status == "finished" for s in states)


def test_request_larger_than_the_pool_is_a_clear_error():
    clock, manager, sched = make(num_blocks=4, block_size=4)
    sched.add(Request("huge", tokens=list(range(40)), output_len=1))
    with pytest.raises(ConfigError, match="needs more blocks than the whole pool"):
        run(sched)
    manager.check()


def test_request_outgrowing_the_pool_while_decoding_is_a_clear_error():
    clock, manager, sched = make(num_blocks=2, block_size=4)
    sched.add(Request("long", tokens=list(range(6)), output_len=10))
    with pytest.raises(ConfigError, match="needs more blocks than the whole pool"):
        run(sched)


def test_bad_scheduler_config():
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be a positive int"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="preemption must be one of last-arrived"):
        SchedulerConfig(preemption="random")
