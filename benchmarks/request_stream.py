"""A seeded multi-turn chat request stream for the manager benchmarks.

Requests are trace-style: each prompt is a tuple of prefix-chained block ids (as in the Mooncake
and Alibaba traces, one id per cacheable block of ``block_size`` tokens) plus a token count whose
last block may be partial. The stream mixes:

- **sessions** of a multi-turn chat: turn ``k + 1``'s prompt is turn ``k``'s full prompt blocks
  followed by fresh blocks (the previous answer and the next user message);
- **shared system prompts**: most sessions start with one of a few system prompts, chosen
  Zipf-like, so their blocks are shared by many sessions;
- **abandoned sessions**: the number of open sessions is capped, the oldest are dropped, so part
  of the cache is never reused.

Up to ``concurrency`` requests are in flight; when one more arrives the oldest is decoded
(a few ``append`` calls) and finished. A session never has two turns in flight.

The stream is a flat list of operations, built once (outside any timing) and replayed by every
implementation, so all of them see exactly the same work:

- ``(BEGIN, request, 0, t)``
- ``(APPEND, request_id, num_tokens, t)``
- ``(FINISH, request_id, 0, t)``
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from kvevict import Request

__all__ = ["APPEND", "BEGIN", "FINISH", "RequestStream", "StreamConfig", "make_stream"]

BEGIN, APPEND, FINISH = 0, 1, 2


@dataclass(frozen=True)
class StreamConfig:
    """Shape of the generated stream. The defaults put an 8k-block pool under pressure."""

    num_requests: int = 100_000
    num_blocks: int = 8_192  #: pool size the stream is sized for
    block_size: int = 16
    seed: int = 0
    num_system_prompts: int = 12
    system_prompt_blocks: tuple[int, int] = (4, 32)  #: [low, high) blocks
    p_system_prompt: float = 0.8  #: a new session starts with a shared system prompt
    p_new_session: float = 0.3  #: a request opens a new session (else: next turn of one)
    max_open_sessions: int = 1_500  #: the oldest open session is abandoned beyond this
    first_turn_blocks: tuple[int, int] = (1, 12)
    next_turn_blocks: tuple[int, int] = (1, 6)
    max_prompt_blocks: int = 64  #: a session ends once its prompt reaches this
    max_appends: int = 3  #: decode appends per request, 1..max_appends
    append_tokens: tuple[int, int] = (1, 33)  #: tokens per decode append, [low, high)
    concurrency: int = 8  #: requests in flight
    mean_interarrival_s: float = 0.05


@dataclass
class RequestStream:
    """The operations to replay and what they add up to."""

    config: StreamConfig
    ops: list[tuple[int, object, int, float]]
    num_requests: int
    num_prompt_blocks: int  #: sum of listed (cacheable) prompt blocks over all requests
    num_block_slots: int  #: sum over requests of blocks held at finish (prompt + decode)


def make_stream(config: StreamConfig | None = None, **overrides: object) -> RequestStream:
    """Build the operation list for ``config`` (fields can be overridden by keyword)."""
    if config is None:
        config = StreamConfig()
    if overrides:
        config = replace(config, **overrides)
    rng = np.random.default_rng(config.seed)
    n = config.num_requests
    bs = config.block_size
    next_id = 1  # block ids are ints, unique across the stream

    def fresh(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    system_prompts = [fresh(int(k)) for k in rng.integers(*config.system_prompt_blocks,
                                                          size=config.num_system_prompts)]
    zipf = 1.0 / np.arange(1, config.num_system_prompts + 1)
    # every random draw up front (vectorized), consumed one per request below
    draws = zip(
        np.cumsum(rng.exponential(config.mean_interarrival_s, n)).tolist(),  # arrival
        (rng.random(n) < config.p_new_session).tolist(),  # open a new session
        rng.random(n).tolist(),  # which idle session continues
        (rng.random(n) < config.p_system_prompt).tolist(),  # new session: system prompt?
        rng.choice(config.num_system_prompts, n, p=zipf / zipf.sum()).tolist(),  # which one
        rng.integers(*config.first_turn_blocks, size=n).tolist(),
        rng.integers(*config.next_turn_blocks, size=n).tolist(),
        rng.integers(0, bs, size=n).tolist(),  # tokens in the last (partial) block
        strict=True,
    )
    num_appends = rng.integers(1, config.max_appends + 1, size=n).tolist()
    append_tokens = rng.integers(*config.append_tokens, size=(n, config.max_appends)).tolist()

    open_sessions: dict[int, list[int]] = {}  # session id -> its prompt's block ids (ordered)
    idle: list[int] = []  # open sessions with no turn in flight
    in_flight: deque[tuple[int, str, int, int]] = deque()  # (index, request id, session, tokens)
    ops: list[tuple[int, object, int, float]] = []
    num_prompt_blocks = num_block_slots = 0
    t = 0.0

    def retire_oldest() -> None:
        nonlocal num_block_slots
        i, rid, sid, tokens = in_flight.popleft()
        for count in append_tokens[i][:num_appends[i]]:
            ops.append((APPEND, rid, count, t))
            tokens += count
        ops.append((FINISH, rid, 0, t))
        num_block_slots += -(-tokens // bs)
        if sid in open_sessions:
            idle.append(sid)

    next_session = 0
    for i, (t, new_session, pick, with_system, system, first, more, partial) in enumerate(draws):
        if len(in_flight) >= config.concurrency:
            retire_oldest()
        if idle and not new_session:
            sid = idle.pop(int(pick * len(idle)))
            blocks = open_sessions[sid]
            blocks.extend(fresh(more))
        else:
            sid = next_session
            next_session += 1
            blocks = list(system_prompts[system]) if with_system else []
            blocks.extend(fresh(first))
            open_sessions[sid] = blocks
            if len(open_sessions) > config.max_open_sessions:
                oldest = next(iter(open_sessions))
                del open_sessions[oldest]
                if oldest in idle:
                    idle.remove(oldest)
        tokens = len(blocks) * bs + partial  # the last block may be partial
        request = Request(f"r{i}", block_hashes=tuple(blocks), num_tokens=tokens,
                          session_id=sid, arrival=t)
        ops.append((BEGIN, request, 0, t))
        num_prompt_blocks += len(blocks)
        in_flight.append((i, request.request_id, sid, tokens))
        if len(blocks) >= config.max_prompt_blocks:
            del open_sessions[sid]  # last turn of this session
    while in_flight:
        retire_oldest()
    return RequestStream(config, ops, config.num_requests, num_prompt_blocks, num_block_slots)
