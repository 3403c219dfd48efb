"""Closed-loop sessions (`kvevict.run.SessionGate`): a session's request is not sent before
the answer it follows exists, then its think time or tool pause."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevict import workloads
from kvevict.box import Box, gpu_profile
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import preset
from kvevict.load import iter_rate_scaled, rate_scaled, scale_for_load
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.types import Request


def turn(rid, arrival, parent=None, pause=None, *, session="s", last=False, tokens=None):
    extra = {"parent": parent, "last": last}
    if pause is not None:
        extra["pause"] = pause
    return Request(rid, tokens=list(range(32)) if tokens is None else tokens,
                   session_id=session, arrival=arrival, output_len=len(ANSWER),
                   output_tokens=ANSWER, extra=extra)


ANSWER = list(range(100, 140))  # every turn's 40-token answer


def by_id(result):
    return {r.request_id: r for r in result.records}


def fitting(reqs, blocks):
    """``blocks``, or the blocks of the largest request if more (16-token blocks)."""
    return max(blocks, max(-(-(r.prompt_len + r.output_len) // 16) for r in reqs))


def assert_sent_on_time(reqs, result):
    """Every request of ``reqs`` finished, and was sent at exactly ``max(trace arrival,
    parent's last token + pause)`` (no pause: 0); ``held_requests`` counts the late ones."""
    rec = by_id(result)
    assert len(rec) == len(reqs)
    late = 0
    for r in reqs:
        parent = r.extra["parent"]
        want = r.arrival
        if parent is not None:
            want = max(r.arrival, rec[parent].finish + (r.extra.get("pause") or 0.0))
        assert rec[r.request_id].arrival == pytest.approx(want, abs=1e-12)
        late += want > r.arrival
    assert result.held_requests == late


def test_a_turn_that_arrives_before_its_answer_is_sent_after_it_plus_its_pause():
    second = list(range(32)) + ANSWER + [7] * 8  # the first turn, its answer, a message
    reqs = [turn("t1", 0.0), turn("t2", 0.1, "t1", 2.0, tokens=second),
            turn("x", 0.2, session="o")]
    closed = simulate(reqs, "lru", capacity_blocks=64, cost=CostModel())
    rec = by_id(closed)
    assert rec["t1"].finish > 0.1  # the answer is not there at t2's trace arrival
    assert rec["t2"].arrival == pytest.approx(rec["t1"].finish + 2.0, abs=1e-12)
    assert rec["x"].arrival == 0.2  # another session's request is not held
    assert closed.summary()["held_requests"] == 1
    # t2 then finds t1's prompt and answer cached (decode caches all but the last sampled
    # token: 71 tokens, 4 whole blocks); sent at its trace arrival it finds what was decoded
    assert rec["t2"].cached_tokens == 64
    opened = by_id(simulate(reqs, "lru", capacity_blocks=64, cost=CostModel(),
                            closed_loop=False))
    # open loop: the prompt and the one block of the answer decoded by 0.1 s
    assert opened["t2"].arrival == 0.1 and opened["t2"].cached_tokens == 48
    assert simulate(reqs, "lru", capacity_blocks=64, cost=CostModel(),
                    closed_loop=False).summary()["held_requests"] == 0


def test_a_box_that_keeps_up_runs_the_trace_unchanged():
    reqs = [turn("t1", 0.0), turn("t2", 100.0, "t1", 2.0), turn("t3", 200.0, "t2", 2.0)]
    result = simulate(reqs, "lru", capacity_blocks=64, cost=CostModel())
    assert [r.arrival for r in result.records] == [0.0, 100.0, 200.0]
    assert result.summary()["held_requests"] == 0


def test_a_chain_of_held_turns_waits_turn_by_turn():
    reqs = [turn("t1", 0.0), turn("t2", 0.01, "t1", 0.5), turn("t3", 0.02, "t2", 0.25),
            turn("t4", 0.03, "t3", last=True)]  # no pause given: sent as the answer ends
    rec = by_id(simulate(reqs, "lru", capacity_blocks=64, cost=CostModel()))
    assert rec["t2"].arrival == pytest.approx(rec["t1"].finish + 0.5, abs=1e-12)
    assert rec["t3"].arrival == pytest.approx(rec["t2"].finish + 0.25, abs=1e-12)
    assert rec["t4"].arrival == pytest.approx(rec["t3"].finish, abs=1e-12)


def test_requests_without_session_links_are_never_held():
    """A trace without ``extra["parent"]`` (Mooncake's, a user's own requests), or whose
    parent is not the session's previous request here, runs open loop."""
    plain = [Request(i, tokens=list(range(32)), session_id="s", arrival=0.01 * i,
                     output_len=40) for i in range(4)]
    a = simulate(plain, "lru", capacity_blocks=64, cost=CostModel())
    assert [r.arrival for r in a.records] == [0.0, 0.01, 0.02, 0.03]
    orphan = [turn("t5", 0.0, "t4", 3.0), turn("t6", 0.01, "elsewhere", 3.0, session="z")]
    b = simulate(orphan, "lru", capacity_blocks=64, cost=CostModel())
    assert [r.arrival for r in b.records] == [0.0, 0.01] and b.held_requests == 0


def test_closed_loop_must_be_a_bool():
    with pytest.raises(ConfigError, match="closed_loop must be True or False"):
        simulate([turn("t1", 0.0)], "lru", capacity_blocks=64, closed_loop=1)


def test_generators_record_the_pause_that_follows_the_estimated_answer():
    for name, dspt in (("chat", 0.02), ("agent", 0.02)):
        reqs = workloads.generate(name, seed=3)
        ids = {r.request_id: r for r in reqs}
        later = [r for r in reqs if r.extra["parent"] is not None]
        assert later
        for r in later:
            parent = ids[r.extra["parent"]]
            assert r.extra["pause"] > 0
            assert r.arrival == pytest.approx(
                parent.arrival + parent.output_len * dspt + r.extra["pause"], abs=2e-6)
        assert all("pause" not in r.extra for r in reqs if r.extra["parent"] is None)


def test_a_rate_scale_scales_the_pauses_too():
    reqs = [turn("t1", 10.0), turn("t2", 14.0, "t1", 3.0)]
    for scaled in (rate_scaled(reqs, 4.0), list(iter_rate_scaled(reqs, 4.0))):
        assert [r.arrival for r in scaled] == [10.0, 11.0]
        assert "pause" not in scaled[0].extra and scaled[1].extra["pause"] == 0.75
    assert reqs[1].extra["pause"] == 3.0  # the input is not changed


def agent_study():
    layout = preset("llama-3-8b")
    cost = Box(gpu_profile("l4-24gb")).cost_model(layout)
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)
    reqs = workloads.generate("agent", seed=0)
    return rate_scaled(reqs, scale_for_load(reqs, cost, 16, 0.7, max_batch=32)), cost, config


def test_no_agent_step_is_sent_before_the_answer_it_carries():
    """The agent workload at ρ 0.7 (its arrivals compressed 6.5x, answer estimates too): open
    loop, every step arrives before the previous step's answer and recomputes what it could
    not find (golden numbers, seed 0, LRU, 4,494 blocks); closed loop, each waits."""
    reqs, cost, config = agent_study()
    trace = {r.request_id: r for r in reqs}
    closed = simulate(reqs, "lru", capacity_blocks=4494, cost=cost, config=config)
    opened = simulate(reqs, "lru", capacity_blocks=4494, cost=cost, config=config,
                      closed_loop=False)
    rec = by_id(closed)
    for r in closed.records:
        assert r.arrival >= trace[r.request_id].arrival
        parent = trace[r.request_id].extra["parent"]
        if parent is not None:
            pause = trace[r.request_id].extra["pause"]
            assert r.arrival >= rec[parent].finish + pause - 1e-9
    early = sum(1 for r in opened.records if trace[r.request_id].extra["parent"] is not None
                and r.arrival < by_id(opened)[trace[r.request_id].extra["parent"]].finish)
    assert early == 239
    assert closed.summary()["held_requests"] == 239
    assert (opened.summary()["recomputed_prefill_tokens"],
            closed.summary()["recomputed_prefill_tokens"]) == (34464, 176)


@st.composite
def sessions(draw):
    """Up to 5 sessions of 1-4 requests each: trace arrivals, pauses, prompt and answer
    lengths drawn; each later request's prompt extends the previous one's prompt and answer
    (as a chat history does), and some carry no pause."""
    requests = []
    for s in range(draw(st.integers(1, 5))):
        t = draw(st.floats(0, 2))
        history: list[int] = []
        parent = None
        n = draw(st.integers(1, 4))
        for k in range(n):
            user = [1000 * s + 100 * k + i for i in range(draw(st.integers(1, 40)))]
            answer = [50_000 + 1000 * s + 100 * k + i for i in range(draw(st.integers(1, 30)))]
            pause = draw(st.one_of(st.none(), st.floats(0, 1)))
            extra = {"parent": parent, "last": k == n - 1}
            if parent is not None and pause is not None:
                extra["pause"] = pause
            rid = f"s{s}-{k}"
            requests.append(Request(rid, tokens=history + user, session_id=f"s{s}",
                                    arrival=t, output_len=len(answer), output_tokens=answer,
                                    extra=extra))
            history = history + user + answer
            parent = rid
            t += draw(st.floats(0, 0.5))
    return requests


@given(sessions(), st.integers(8, 64))
@settings(max_examples=60, deadline=None)
def test_every_request_is_sent_at_its_arrival_or_at_its_answer_plus_its_pause(reqs, blocks):
    """On random sessions and pool sizes, the run (the simulator's production path) sends each
    request at exactly ``max(trace arrival, parent's last token + pause)``, finishes every
    request, and counts as held exactly those sent late."""
    capacity = fitting(reqs, blocks)
    result = simulate(reqs, "lru", capacity_blocks=capacity, cost=CostModel())
    assert_sent_on_time(reqs, result)
    opened = simulate(reqs, "lru", capacity_blocks=capacity, cost=CostModel(),
                      closed_loop=False)
    assert sorted(r.arrival for r in opened.records) == sorted(r.arrival for r in reqs)


def test_the_timed_belady_keeps_what_a_held_turn_will_use():
    """A turn planned at 0.01 s is held until 10 s after its parent's answer. Meanwhile a
    dead request (d) and a new one (x) need the pool. The oracle, built by name as the
    simulator builds it, keeps the held turn's history (its future is consumed by the
    requests that begin, not by the clock) and the turn finds 64 tokens cached; keyed by the
    clock alone, as before, the overdue turn looks served, and the oracle falls back to LRU."""
    from kvevict.policies.belady import Belady, future_of, request_times

    second = list(range(32)) + ANSWER + [7] * 8
    dead = Request("d", tokens=list(range(500, 532)), session_id="d", arrival=2.0,
                   output_len=1, extra={"parent": None, "last": True})
    new = Request("x", tokens=list(range(900, 948)), session_id="x", arrival=5.0,
                  output_len=1, extra={"parent": None, "last": True})
    held = Request("t2", tokens=second, session_id="s", arrival=0.01, output_len=1,
                   extra={"parent": "t1", "pause": 10.0, "last": True})
    reqs = [turn("t1", 0.0), held, dead, new]

    def cached(policy):
        rec = by_id(simulate(reqs, policy, capacity_blocks=7, cost=CostModel()))
        assert rec["t2"].arrival == pytest.approx(rec["t1"].finish + 10.0)
        return rec["t2"].cached_tokens

    by_clock = Belady(future_of(reqs, block_size=16, time=request_times(reqs, "arrival")))
    assert (cached("lru"), cached(by_clock), cached("belady")) == (32, 32, 64)


# -- links without pauses (a real trace's, such as Alibaba's parent_chat_id) ---------------

def link(rid, arrival, parent=None, *, tokens=None, output=ANSWER):
    """A request linked as a real trace links it: ``extra["parent"]``, no pause, no
    ``extra["last"]`` (the trace does not say whether the conversation goes on)."""
    return Request(rid, tokens=list(range(32)) if tokens is None else tokens,
                   session_id="s", arrival=arrival, output_len=len(output),
                   output_tokens=output, extra={"parent": parent})


def test_a_linked_request_is_sent_no_earlier_than_its_parents_answer():
    """Two answers to one parent (a regenerated answer) both wait for it, a follow-up of a
    held request waits for that one, and a request whose parent is not in the trace, or that
    arrives after its parent's answer, is sent at its arrival. No think time is added."""
    second = list(range(32)) + ANSWER + [7] * 8
    reqs = [link("a", 0.0), link("b", 0.05, "a", tokens=second), link("c", 0.06, "a"),
            link("d", 0.07, "b", tokens=second + ANSWER + [9] * 8),
            link("e", 0.08, "elsewhere"), link("f", 500.0, "a")]
    result = simulate(reqs, "lru", capacity_blocks=64, cost=CostModel())
    rec = by_id(result)
    assert rec["a"].finish > 0.07
    assert rec["b"].arrival == rec["a"].finish and rec["c"].arrival == rec["a"].finish
    assert rec["d"].arrival == rec["b"].finish
    assert rec["e"].arrival == 0.08 and rec["f"].arrival == 500.0
    assert result.held_requests == 3
    assert rec["b"].cached_tokens == 64  # a's prompt and its answer, as in the turn above
    opened = by_id(simulate(reqs, "lru", capacity_blocks=64, cost=CostModel(),
                            closed_loop=False))
    assert opened["b"].arrival == 0.05 and opened["b"].cached_tokens == 32


def test_an_alibaba_trace_runs_closed_loop(tmp_path):
    """The Alibaba reader links each chat to its ``parent_chat_id``: compressed 1,000x, the
    sample's follow-ups arrive before the answers they follow and wait for them."""
    import json

    from kvevict.workloads import read_alibaba

    lines = [  # chat 1, its follow-up 3 and 3's follow-up 5; chat 4 follows one outside
        (1, -1, 0.5, 40, 10, [0, 1, 2]), (2, -1, 1.0, 16, 3, [7]),
        (3, 1, 30.25, 70, 5, [0, 1, 2, 3, 4]), (4, 99, 31.0, 17, 2, [8, 9]),
        (5, 3, 90.0, 90, 8, [0, 1, 2, 3, 4, 5])]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(
        {"chat_id": c, "parent_chat_id": p, "timestamp": t, "input_length": n,
         "output_length": o, "type": "text", "turn": 1, "hash_ids": h}) + "\n"
        for c, p, t, n, o, h in lines))
    reqs = rate_scaled(read_alibaba(path), 1000.0)
    closed = simulate(reqs, "lru", capacity_blocks=64, cost=CostModel())
    rec = by_id(closed)
    for r in reqs:
        parent = r.extra["parent"]
        want = max(r.arrival, rec[parent].finish) if parent in rec else r.arrival
        assert rec[r.request_id].arrival == pytest.approx(want, abs=1e-12)
    assert rec[3].arrival == rec[1].finish > reqs[2].arrival  # chat 3 waits for chat 1
    assert closed.held_requests == sum(rec[r.request_id].arrival > r.arrival for r in reqs)
    assert closed.held_requests >= 1


def test_the_gate_remembers_the_requests_in_flight_not_the_conversations(monkeypatch):
    """6,000 single-turn conversations with a follow-up each, on a box that keeps up: the
    pause-free table holds what is in flight (swept when it doubles), never the trace. The
    run is the simulator's own; the gate only records its size after each step."""
    from kvevict import run, sim

    sizes = []

    class Observed(run.SessionGate):
        def stepped(self, now):
            super().stepped(now)
            sizes.append(len(self.linked))

    monkeypatch.setattr(sim, "SessionGate", Observed)
    reqs = []
    for i in range(3000):
        reqs.append(link(f"q{i}", 1.0 * i, tokens=[i % 50] * 20, output=[1, 2]))
        reqs.append(link(f"r{i}", 1.0 * i + 0.5, f"q{i}", tokens=[i % 50] * 20, output=[3]))
    result = simulate(reqs, "lru", capacity_blocks=64, cost=CostModel())
    assert len(result.records) == 6000 and result.held_requests == 0
    assert len(sizes) >= 6000 and max(sizes) <= 2 * run.SessionGate.SWEEP_MIN


@st.composite
def linked_requests(draw):
    """Up to 12 requests, each linked to none or to an earlier one (branches included),
    with drawn arrivals and prompt and answer lengths; no pauses, no end markers."""
    requests = []
    t = 0.0
    for i in range(draw(st.integers(1, 12))):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        user = [1000 * i + k for k in range(draw(st.integers(1, 40)))]
        answer = [50_000 + 1000 * i + k for k in range(draw(st.integers(1, 30)))]
        history = [] if parent is None else requests[parent].tokens.tolist()
        requests.append(Request(i, tokens=history + user, session_id=0, arrival=t,
                                output_len=len(answer), output_tokens=answer,
                                extra={"parent": parent}))
        t += draw(st.floats(0, 0.3))
    return requests


@given(linked_requests(), st.integers(8, 64), st.sampled_from([0, 1024]))
@settings(max_examples=60, deadline=None)
def test_every_linked_request_is_sent_at_its_arrival_or_at_its_parents_answer(reqs, blocks,
                                                                           sweep):
    """On random link trees, with the table swept after every step or at its default sizes,
    every request is sent at exactly ``max(trace arrival, parent's last token)``."""
    from kvevict.run import SessionGate

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SessionGate, "SWEEP_MIN", sweep)
        mp.setattr(SessionGate, "SWEEP_GROWTH", 0 if sweep == 0 else 2)
        result = simulate(reqs, "lru", capacity_blocks=fitting(reqs, blocks), cost=CostModel())
    assert_sent_on_time(reqs, result)


def test_a_follow_up_that_arrives_during_its_parents_last_step_waits_for_it(monkeypatch):
    """The sweep forgets a finished request only once every arrival up to its finish has been
    handed in: a follow-up that arrives a microsecond before its parent's last token, inside
    the step that produces it and handed in after that step, is still sent at the answer,
    with the table swept after every step."""
    from kvevict.run import SessionGate

    monkeypatch.setattr(SessionGate, "SWEEP_MIN", 0)  # sweep after every step
    monkeypatch.setattr(SessionGate, "SWEEP_GROWTH", 0)
    alone = simulate([link("a", 0.0)], "lru", capacity_blocks=64, cost=CostModel())
    finish = alone.records[0].finish
    reqs = [link("a", 0.0), link("b", finish - 1e-6, "a")]
    rec = by_id(simulate(reqs, "lru", capacity_blocks=64, cost=CostModel()))
    assert rec["a"].finish == finish and rec["b"].arrival == finish
