"""Seeded workload generators: determinism, request structure, timing statistics, validation."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.types import ManualClock, Request
from kvevict.workloads.formats import trace_digest
from kvevict.workloads.generators import (
    AgentParams,
    BatchParams,
    ChatParams,
    ChatServerParams,
    RagParams,
    SteadyChatParams,
    available_workloads,
    block_kinds_from_spans,
    generate,
    workload_params,
)

NAMES = ["agent", "batch", "chat", "chat-server", "chat-steady", "mixed", "rag",
         "single_shot"]


def by_session(requests: list[Request]) -> dict:
    sessions: dict = defaultdict(list)
    for r in requests:
        sessions[r.session_id].append(r)
    for reqs in sessions.values():
        reqs.sort(key=lambda r: r.turn)
    return sessions


def test_available_workloads():
    assert available_workloads() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_trace(name):
    a = generate(name, seed=7, duration=600)
    b = generate(name, seed=7, duration=600)
    assert len(a) > 0
    assert trace_digest(a) == trace_digest(b)
    assert trace_digest(a) != trace_digest(generate(name, seed=8, duration=600))


@pytest.mark.parametrize("name", NAMES)
def test_default_sizes_and_sorted_arrivals(name):
    reqs = generate(name)
    assert 100 <= len(reqs) <= 2000
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals)
    duration = workload_params(name).duration
    assert 0 <= arrivals[0] and arrivals[-1] < duration
    assert len({r.request_id for r in reqs}) == len(reqs)
    for r in reqs[:50]:
        assert r.tokens is not None and r.tokens.dtype == np.int64 and r.prompt_len > 0
        assert r.tokens.max() < 32000
        assert r.output_tokens is not None and len(r.output_tokens) == r.output_len
        assert r.turn >= 1 and r.session_id is not None
        assert len(r.block_kinds) == -(-r.prompt_len // 16)


def test_chat_turns_repeat_previous_prompt_and_answer():
    reqs = generate("chat", seed=3)
    sessions = by_session(reqs)
    multi = [s for s in sessions.values() if len(s) >= 3]
    assert len(multi) >= 5
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for prev, nxt in zip(turns, turns[1:]):
            head = np.concatenate([prev.tokens, prev.output_tokens])
            assert np.array_equal(nxt.tokens[:len(head)], head)
            assert nxt.prompt_len > len(head)  # plus a new user message
            assert nxt.extra["parent"] == prev.request_id
            assert nxt.arrival > prev.arrival
            assert not prev.extra["last"]
            # the earlier answer is tagged as output where it fills a block
            kinds = nxt.block_kinds
            start = prev.prompt_len // 16 + 1
            end = len(head) // 16
            if end > start:
                assert set(kinds[start:end]) == {"output"}


def test_chat_sessions_share_the_system_prompt():
    p = workload_params("chat")
    reqs = generate("chat", seed=4)
    first = [r for r in reqs if r.turn == 1]
    system = first[0].tokens[:p.system_prompt_tokens]
    assert all(np.array_equal(r.tokens[:p.system_prompt_tokens], system) for r in first)
    # and nothing beyond it: users' messages are fresh text
    assert len({r.tokens[p.system_prompt_tokens:p.system_prompt_tokens + 8].tobytes()
                for r in first}) == len(first)


def test_think_time_median_matches_parameter():
    # a large sample with a fixed seed: the median inter-turn think time is the parameter
    params = ChatParams(duration=1e7, sessions_per_minute=0.0015, first_continue_prob=0.9,
                        later_continue_prob=0.9, think_time_median=90.0, think_time_sigma=1.5,
                        system_prompt_tokens=8, user_tokens_mean=8, output_tokens_mean=8)
    reqs = params.generate(seed=11)
    gaps = []
    for turns in by_session(reqs).values():
        for prev, nxt in zip(turns, turns[1:]):
            gaps.append(nxt.arrival - prev.arrival
                        - prev.output_len * params.decode_seconds_per_token)
    assert len(gaps) > 1500
    gaps = np.array(gaps)
    assert abs(math.log(np.median(gaps) / 90.0)) < 0.15
    assert abs(np.std(np.log(gaps)) - 1.5) < 0.15


def test_chat_abandonment_turn_count():
    params = ChatParams(duration=1e6, sessions_per_minute=0.07, system_prompt_tokens=4,
                        user_tokens_mean=4, output_tokens_mean=4)
    sessions = by_session(params.generate(seed=2))
    lengths = np.array([len(s) for s in sessions.values()])
    assert len(lengths) > 1000
    assert abs(lengths.mean() - params.mean_turns) < 0.25
    assert abs((lengths == 1).mean() - (1 - params.first_continue_prob)) < 0.05
    assert all(s[-1].extra["last"] for s in sessions.values())


def test_agent_prefix_grows_step_by_step():
    p = workload_params("agent")
    reqs = generate("agent", seed=5)
    sessions = by_session(reqs)
    assert all(r.workload_class == "agent" for r in reqs)
    tools = reqs[0].tokens[:p.tool_prompt_tokens]
    long_tasks = 0
    for steps in sessions.values():
        assert np.array_equal(steps[0].tokens[:p.tool_prompt_tokens], tools)
        long_tasks += len(steps) >= 3
        for prev, nxt in zip(steps, steps[1:]):
            head = np.concatenate([prev.tokens, prev.output_tokens])
            assert np.array_equal(nxt.tokens[:len(head)], head)
            assert nxt.prompt_len > len(head)  # plus the tool result
            assert nxt.turn == prev.turn + 1
            pause = nxt.arrival - prev.arrival - prev.output_len * p.decode_seconds_per_token
            assert 0 < pause < 600  # seconds, not minutes
        if len(steps) >= 2:
            assert "context" in steps[1].block_kinds  # the tool result
    assert long_tasks >= 5


def test_agent_retention_hint():
    reqs = generate("agent", seed=1, duration=900, retention_ttl=30.0)
    for steps in by_session(reqs).values():
        for r in steps[:-1]:
            assert r.retention is not None and r.retention.until == pytest.approx(
                r.arrival + 30.0)
        if steps[-1].extra["last"]:
            assert steps[-1].retention is None


def test_rag_single_shot_with_shared_chunks():
    p = workload_params("rag")
    reqs = generate("rag", seed=6)
    assert all(r.turn == 1 and r.extra["last"] for r in reqs)
    assert len({r.session_id for r in reqs}) == len(reqs)
    n = p.system_prompt_tokens + p.top_k * p.chunk_tokens
    for r in reqs:
        assert r.extra["chunks"] == sorted(r.extra["chunks"])
        assert r.block_kinds[p.system_prompt_tokens // 16 + 1] == "context"
        assert r.prompt_len > n
    # two queries whose first retrieved chunk is the same share system prompt + that chunk
    by_first = defaultdict(list)
    for r in reqs:
        by_first[r.extra["chunks"][0]].append(r)
    a, b = max(by_first.values(), key=len)[:2]
    k = p.system_prompt_tokens + p.chunk_tokens
    assert np.array_equal(a.tokens[:k], b.tokens[:k])
    # Zipf popularity: the most popular document is retrieved far more than the median one
    docs = np.bincount([c // p.chunks_per_doc for r in reqs for c in r.extra["chunks"]],
                       minlength=p.num_docs)
    assert docs[0] > 5 * max(1, np.median(docs))


def test_single_shot_templates_and_bursts():
    reqs = generate("single_shot", seed=2)
    assert all(r.workload_class == "single_shot" for r in reqs)
    apps = defaultdict(list)
    for r in reqs:
        apps[r.extra["app"]].append(r)
    assert len(apps) >= 2
    for group in apps.values():
        heads = {g.tokens[:64].tobytes() for g in group}
        assert len(heads) == 1  # the app template is shared
    gaps = np.diff([r.arrival for r in reqs])
    assert np.std(gaps) / np.mean(gaps) > 1.15  # burstier than Poisson (CV 1)


def test_batch_jobs_arrive_at_once_and_share_a_template():
    p = BatchParams(jobs=2, requests_per_job=30)
    reqs = p.generate(seed=0)
    assert len(reqs) == 60
    for j in range(2):
        job = [r for r in reqs if r.extra["job"] == j]
        assert max(r.arrival for r in job) - min(r.arrival for r in job) <= p.spread_seconds
        assert len({r.tokens[:p.template_tokens].tobytes() for r in job}) == 1
        assert all(r.workload_class == "batch" for r in job)


def test_chat_server_is_seed_000():
    p = workload_params("chat-server")
    reqs = generate("chat-server", seed=0)
    classes = {r.workload_class for r in reqs}
    assert classes == {"chat", "batch"}
    chat = [r for r in reqs if r.workload_class == "chat"]
    sessions = by_session(chat)
    people = {r.extra["person"] for r in chat}
    assert len(people) == p.people
    assert len(sessions) > p.people  # sessions come and go: several per person
    # nobody logs out: conversations just stop, well before the end of the window
    abandoned = [s for s in sessions.values() if s[-1].extra["last"]
                 and s[-1].arrival < p.duration - 600]
    assert len(abandoned) >= p.people
    assert any(len(s) >= 3 for s in sessions.values())
    # one shared system prompt on the box
    n = p.chat.system_prompt_tokens
    assert len({s[0].tokens[:n].tobytes() for s in sessions.values()}) == 1
    # a person has one conversation at a time
    for person in people:
        convs = sorted((s for s in sessions.values() if s[0].extra["person"] == person),
                       key=lambda s: s[0].arrival)
        for a, b in zip(convs, convs[1:]):
            assert b[0].arrival > a[-1].arrival
    assert len([r for r in reqs if r.workload_class == "batch"]) == 2 * 40


def test_mixed_has_every_class():
    reqs = generate("mixed", seed=1, duration=900)
    assert {r.workload_class for r in reqs} == {"chat", "agent", "rag", "single_shot"}
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)


def test_scale_and_overrides():
    def sessions(**kw):
        return len({r.session_id for r in generate("chat", seed=0, duration=3600, **kw)})

    assert 1.7 < sessions(scale=2.0) / sessions() < 2.3
    assert workload_params("chat-server", scale=2.0).people == 12
    p = workload_params("chat-server", people=3, chat={"think_time_median": 30.0})
    assert p.people == 3 and p.chat.think_time_median == 30.0
    assert p.chat.later_continue_prob == 0.8  # the mix's own default is kept
    assert workload_params("mixed", duration=120).duration == 120
    short = generate("chat", seed=0, duration=300)
    assert short and max(r.arrival for r in short) < 300


@pytest.mark.parametrize("call", [
    lambda: generate("chat", sessions_per_minute=-1),
    lambda: generate("chat", first_continue_prob=1.5),
    lambda: generate("chat", think_time_median=0),
    lambda: generate("chat", max_turns=0),
    lambda: generate("chat", user_tokens_mean=float("nan")),
    lambda: generate("chat", no_such_field=1),
    lambda: generate("chat", scale=0),
    lambda: generate("chat", duration=-5),
    lambda: generate("chat", seed=-1),
    lambda: generate("chat", seed=1.5),
    lambda: generate("agent", mean_steps=0.5),
    lambda: generate("agent", retention_ttl=-1.0),
    lambda: generate("chat-server", chat={"bogus": 1}),
    lambda: generate("chat-server", chat=3),
    lambda: ChatParams(vocab_size=1),
    lambda: ChatServerParams(people=0),
    lambda: RagParams(num_docs=1, chunks_per_doc=2, top_k=3),
    lambda: BatchParams(first_start=0.5, last_start=0.2),
    lambda: AgentParams(max_steps=True),
])
def test_bad_parameters_raise_config_error(call):
    with pytest.raises(ConfigError):
        call()


def test_unknown_parameter_lists_valid_ones():
    with pytest.raises(ConfigError, match="think_time_median"):
        generate("chat", think_time=3)


def test_unknown_workload_lists_names():
    with pytest.raises(ConfigError) as info:
        generate("chatt")
    for name in NAMES:
        assert name in str(info.value)
    with pytest.raises(ConfigError):
        generate(None)


def test_block_kinds_majority():
    spans = [[0, 5, "prompt"], [5, 16, "output"], [16, 24, "context"], [24, 32, "prompt"],
             [32, 34, "context"]]
    # block 0: 5 prompt / 11 output; block 1: 8 context / 8 prompt (tie -> prompt);
    # block 2 (partial): context
    assert block_kinds_from_spans(spans, 34, 16) == ("output", "prompt", "context")
    assert block_kinds_from_spans([], 0, 16) == ()
    with pytest.raises(ConfigError):
        block_kinds_from_spans(spans, 34, 0)


def test_replay_next_turns_hit_decoded_blocks():
    # replayed one at a time with room for everything, a chat turn finds its whole history
    # (previous prompt + previous answer, in full blocks) cached by the previous decode
    reqs = generate("chat-server", seed=2, duration=900)
    by_id = {r.request_id: r for r in reqs}
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(50_000, 16), "lru", clock=clock)
    later_turns = 0
    for r in reqs:
        clock.set(max(clock.now, r.arrival))
        before = manager.stats.prefix_cache_hits
        manager.begin(r)
        manager.append(r.request_id, r.output_tokens)
        manager.finish(r.request_id)
        gained = manager.stats.prefix_cache_hits - before
        if r.workload_class == "chat" and r.turn > 1:
            prev = by_id[r.extra["parent"]]
            assert gained >= (prev.prompt_len + prev.output_len) // 16 * 16
            later_turns += 1
    manager.check()
    assert later_turns >= 5


# -- chat-steady: a window of a server in steady state ------------------------------------


def test_warmup_window_is_the_tail_of_a_longer_trace():
    # conversations that start in [-warmup, 0) are drawn exactly as a trace of
    # warmup + duration seconds draws them: the window is that trace's last `duration`
    # seconds, shifted to start at 0, with the same ids, turns, parents and answers
    warm = generate("chat", seed=5, duration=300, warmup=900, sessions_per_minute=8)
    long = generate("chat", seed=5, duration=1200, sessions_per_minute=8)
    tail = [r for r in long if r.arrival >= 900]
    assert len(warm) == len(tail) > 50
    for a, b in zip(warm, tail, strict=True):
        assert a.request_id == b.request_id and a.turn == b.turn
        assert a.arrival == pytest.approx(b.arrival - 900, abs=2e-6)
        assert np.array_equal(a.tokens, b.tokens)
        assert np.array_equal(a.output_tokens, b.output_tokens)
        assert a.extra["parent"] == b.extra["parent"]
        assert a.block_kinds == b.block_kinds


def test_warmup_zero_is_the_plain_chat_trace():
    assert trace_digest(generate("chat", seed=3, warmup=0.0)) == trace_digest(
        generate("chat", seed=3))


def test_warmup_opens_on_conversations_under_way():
    cold = generate("chat", seed=0, duration=120, sessions_per_minute=20)
    warm = generate("chat", seed=0, duration=120, sessions_per_minute=20, warmup=1800)
    assert all(r.turn == 1 for r in cold if r.arrival < 30)  # an empty server: first turns
    early = [r for r in warm if r.arrival < 30]
    assert sum(r.turn > 1 for r in early) >= len(early) // 4 > 0
    # a later turn whose previous turn was before the window has a parent not in the trace
    ids = {r.request_id for r in warm}
    assert any(r.extra["parent"] is not None and r.extra["parent"] not in ids for r in warm)


def test_chat_steady_defaults():
    p = workload_params("chat-steady")
    assert isinstance(p, SteadyChatParams) and isinstance(p, ChatParams)
    assert (p.duration, p.sessions_per_minute, p.warmup) == (450.0, 36.0, 1800.0)
    # the conversation itself is chat's: lengths, turns and think times unchanged
    chat = workload_params("chat")
    for field in ("user_tokens_mean", "output_tokens_mean", "first_continue_prob",
                  "later_continue_prob", "think_time_median", "think_time_sigma",
                  "system_prompt_tokens"):
        assert getattr(p, field) == getattr(chat, field)
    assert workload_params("chat-steady", scale=2).sessions_per_minute == 72.0
    reqs = generate("chat-steady", seed=0)
    assert 0 <= reqs[0].arrival and reqs[-1].arrival < 450
    # steady state: the two halves of the window see about the same arrival rate
    first = sum(r.arrival < 225 for r in reqs)
    assert abs(first - (len(reqs) - first)) < 0.15 * len(reqs)


def test_chat_steady_is_stationary_where_cold_chat_ramps_up():
    # arrivals in the first and second half of a 450 s window, over seeds 0..2
    def halves(name, **kw):
        first = second = 0
        for seed in range(3):
            for r in generate(name, seed=seed, **kw):
                first += r.arrival < 225
                second += r.arrival >= 225
        return first, second

    cold_first, cold_second = halves("chat", duration=450, sessions_per_minute=36)
    warm_first, warm_second = halves("chat-steady")
    assert cold_second > 1.15 * cold_first  # from an empty start, conversations pile up
    assert abs(warm_second - warm_first) < 0.05 * (warm_first + warm_second)
    assert warm_first + warm_second > 1.25 * (cold_first + cold_second)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "10", True])
def test_bad_warmup(bad):
    with pytest.raises(ConfigError, match="warmup"):
        generate("chat", warmup=bad)
