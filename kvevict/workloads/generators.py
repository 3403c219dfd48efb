"""Seeded workload generators: chat, agent, RAG, single-shot and batch requests, and mixes.

Every generator returns a ``list[Request]`` sorted by arrival (seconds from 0), with **real
token ids** (``int64``, drawn from ``[0, vocab_size)``) so the manager hashes them like any
prompt. Each new piece of text (a user message, a model answer, a tool result, a document
chunk) is a run of fresh random ids from the seeded `numpy.random.Generator`; text that is
repeated (a shared system prompt, a conversation's history, a retrieved chunk) repeats the
same ids, so prefix sharing in the trace is exactly the sharing a real server would see.

Structure of the requests:

- **chat**: turn ``k``'s prompt is the system prompt, every earlier user message and model
  answer, then the new user message. Turn ``k``'s answer is ``output_tokens`` (``output_len``
  ids), and turn ``k + 1``'s prompt starts with turn ``k``'s prompt followed by exactly those
  ids, so the blocks a simulated decode caches are the blocks the next turn hits. A session
  ends without notice (abandonment) after a random number of turns: nobody logs out.
- **agent**: a task is a loop of LLM calls. Step ``k + 1``'s prompt is step ``k``'s prompt,
  step ``k``'s output (the tool call) and the tool's result, after a tool pause of seconds.
  Every agent shares one tool prompt (tool definitions) at the start.
- **rag**: single-shot questions over a shared corpus. The prompt is a system prompt, the
  ``top_k`` retrieved chunks sorted by (document, chunk) id, then the question. A chunk is a
  fixed run of ids, but its KV is only reusable when everything before it is equal too: two
  queries share blocks up to their first differing chunk. Real RAG prefix sharing therefore
  needs the documents early in the prompt and in a canonical order, as here.
- **single_shot**: independent requests from a few apps, each app's prompt template shared
  by all its requests, with bursty (Gamma) inter-arrival times.
- **batch**: jobs of many long prompts sharing a job template, arriving at once, with long
  outputs.
- **chat-server** (mix): a handful of people chatting on one box with a shared system prompt;
  each person has conversation after conversation with idle gaps between, and every
  conversation is simply abandoned; plus an occasional batch job.
- **mixed** (mix): chat + agent + rag + single_shot over the same window.
- **chat-steady**: chat at a busy server's rate (36 conversations a minute: offered load
  0.66 on one L4 with Llama-3-8B), a 450 s window after a 1800 s warm-up; the main job's
  workload (``docs/mainjob.md``).

Every request sets ``session_id``, ``turn`` (1 for a session's first request),
``workload_class`` and ``block_kinds`` (per prompt block of ``block_size`` tokens: ``"prompt"``
for system/user/template text, ``"context"`` for tool results and retrieved chunks,
``"output"`` for earlier answers fed back; a block spanning two kinds takes the kind of the
majority of its tokens, ties going to ``prompt``, then ``context``). ``extra`` holds
``kind_spans`` (``[start, end, kind]`` token ranges, to recompute kinds for another block
size), ``parent`` (the request id of the session's previous request, or None) and ``last``
(True on the final request of a session that ended by itself, i.e. not cut by the end of the
window), plus generator-specific keys (``person``, ``job``).

Arrivals do not wait for answers: the next request of a session arrives at the previous
arrival plus an estimated answer time (``output_len * decode_seconds_per_token``) plus the
think time or tool pause. A replay that needs strict ordering can follow ``extra["parent"]``.
Requests arriving at or after ``duration`` are dropped (the trace is a window). A chat
workload with ``warmup > 0`` also starts conversations in ``[-warmup, 0)`` and drops their
requests before 0: the window then opens on a server in steady state (conversations under way,
their earlier turns not in the trace), so its arrival rate and working set do not ramp up.

Same seed, same trace: `generate` with equal arguments returns identical requests (compare
with `kvevict.workloads.formats.trace_digest`). The parameter table with the public source of
every default is in ``docs/workloads.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import numpy as np

from kvevict.errors import ConfigError
from kvevict.types import BLOCK_KINDS, Request, RetentionHint

__all__ = [
    "AgentParams",
    "BatchParams",
    "ChatParams",
    "ChatServerParams",
    "MixedParams",
    "RagParams",
    "SingleShotParams",
    "SteadyChatParams",
    "WorkloadParams",
    "available_workloads",
    "block_kinds_from_spans",
    "generate",
    "workload_params",
]

_KIND_CODE = {k: i for i, k in enumerate(BLOCK_KINDS)}  # prompt 0, context 1, output 2
_KIND_NAMES = np.array(BLOCK_KINDS, dtype=object)


# -- validators ----------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float, np.integer,
                                                                np.floating))
            and math.isfinite(float(value)))


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if not _is_number(value) or value <= 0:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be a positive "
                          f"number, got {value!r}")


def _non_negative(instance: Any, attribute: Any, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be a "
                          f"non-negative number, got {value!r}")


def _probability(instance: Any, attribute: Any, value: Any) -> None:
    if not _is_number(value) or not 0 <= value < 1:
        raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be a probability "
                          f"in [0, 1), got {value!r}")


def _int_at_least(low: int) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be an int "
                              f">= {low}, got {value!r}")

    return check


def _optional_positive(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _instance_of(cls: type) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, cls):
            raise ConfigError(f"{type(instance).__name__}.{attribute.name} must be a "
                              f"{cls.__name__}, got {type(value).__name__}")

    return check


def _pos(default: float, **kw: Any) -> Any:
    return attrs.field(default=default, validator=_positive, **kw)


def _nonneg(default: float) -> Any:
    return attrs.field(default=default, validator=_non_negative)


def _int(default: int, low: int = 1) -> Any:
    return attrs.field(default=default, validator=_int_at_least(low))


def _prob(default: float) -> Any:
    return attrs.field(default=default, validator=_probability)


# -- shared machinery ----------------------------------------------------------------------


class _Trace:
    """Builds requests for one generator run: fresh ids, kinds, arrival window."""

    def __init__(self, rng: np.random.Generator, vocab_size: int, block_size: int,
                 duration: float) -> None:
        self.rng = rng
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.duration = duration
        self.requests: list[tuple[float, int, Request]] = []

    def fresh(self, n: int) -> np.ndarray:
        """``n`` new random token ids."""
        return self.rng.integers(0, self.vocab_size, size=int(n), dtype=np.int64)

    def lognormal_int(self, mean: float, sigma: float, low: int = 1,
                      high: int | None = None) -> int:
        """A lognormal integer with the given mean (not median), clipped to [low, high]."""
        mu = math.log(mean) - sigma * sigma / 2
        value = round(float(self.rng.lognormal(mu, sigma)))
        value = max(low, value)
        return value if high is None else min(high, value)

    def add(self, request_id: str, segments: list[tuple[np.ndarray, str]], *, session: str,
            workload_class: str, arrival: float, turn: int, output: np.ndarray,
            parent: str | None, last: bool = False, retention: RetentionHint | None = None,
            pause: float | None = None, **extra: Any) -> bool:
        """Append one request unless it arrives outside the window ``[0, duration)``.

        Return False for one at or after ``duration`` (its session ends there), True
        otherwise: a request of a warm-up session that arrives before 0 is not kept, but its
        session goes on into the window.
        """
        arrival = round(float(arrival), 6)
        if arrival >= self.duration:
            return False
        if arrival < 0:
            return True
        parts = [s for s, _ in segments if len(s)]
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        spans: list[list[Any]] = []
        pos = 0
        for seg, kind in segments:
            n = len(seg)
            if n == 0:
                continue
            if spans and spans[-1][2] == kind and spans[-1][1] == pos:
                spans[-1][1] = pos + n
            else:
                spans.append([pos, pos + n, kind])
            pos += n
        meta: dict[str, Any] = {"kind_spans": spans, "parent": parent, "last": last}
        if pause is not None:
            meta["pause"] = round(float(pause), 6)
        meta.update(extra)
        req = Request(
            request_id, tokens=tokens, session_id=session, workload_class=workload_class,
            arrival=arrival, output_len=len(output), output_tokens=output, turn=turn,
            block_kinds=block_kinds_from_spans(spans, len(tokens), self.block_size),
            retention=retention, extra=meta,
        )
        self.requests.append((arrival, len(self.requests), req))
        return True

    def result(self) -> list[Request]:
        return [r for _, _, r in sorted(self.requests, key=lambda t: (t[0], t[1]))]


def block_kinds_from_spans(spans: list[list[Any]], num_tokens: int,
                           block_size: int) -> tuple[str, ...]:
    """Kind of each block (the last one possibly partial) from ``[start, end, kind]`` spans.

    A block takes the kind of the majority of its tokens; ties go to ``"prompt"``, then
    ``"context"``. Tokens outside every span count as ``"prompt"``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    if num_tokens == 0:
        return ()
    nb = -(-num_tokens // block_size)
    codes = np.zeros(num_tokens, dtype=np.int64)  # prompt unless a span says otherwise
    for start, end, kind in spans:
        if _KIND_CODE[kind]:
            codes[start:end] = _KIND_CODE[kind]
    k = len(BLOCK_KINDS)
    counts = np.bincount(np.arange(num_tokens) // block_size * k + codes, minlength=nb * k)
    best = counts.reshape(nb, k).argmax(axis=1)  # ties: the first kind in BLOCK_KINDS order
    return tuple(_KIND_NAMES[best].tolist())


def _poisson_times(rng: np.random.Generator, rate_per_s: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process on [0, duration)."""
    times: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t >= duration:
            return times
        times.append(t)


def _zipf_weights(n: int, exponent: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** exponent
    return w / w.sum()


def _child_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, index]))


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


# -- parameters ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WorkloadParams:
    """Fields every workload has. Subclasses add their own; all are validated."""

    name: ClassVar[str] = ""
    #: Trace window in seconds; requests arriving at or after it are dropped.
    duration: float = _pos(1800.0)
    #: Token ids are drawn from ``[0, vocab_size)`` (32000: the Llama-2 / Mistral vocabulary).
    vocab_size: int = _int(32000, 2)
    #: Block size ``block_kinds`` are computed for (16: vLLM's default block size).
    block_size: int = _int(16)
    #: Estimated seconds per generated token, added before a session's next request.
    decode_seconds_per_token: float = _nonneg(0.02)

    def scaled(self, factor: float) -> WorkloadParams:
        """These parameters with the request rate multiplied by ``factor``."""
        return self

    def generate(self, seed: int = 0) -> list[Request]:
        """The trace for ``seed`` (same seed, same trace)."""
        return self._generate(np.random.default_rng(_check_seed(seed)))

    def generate_from(self, rng: np.random.Generator) -> list[Request]:
        """The trace drawn from ``rng`` (a numpy ``Generator``, advanced by the draw): what
        `generate` does with ``default_rng(seed)``, for a caller that owns the stream, such
        as one part of a mix."""
        if not isinstance(rng, np.random.Generator):
            raise ConfigError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
        return self._generate(rng)

    def _generate(self, rng: np.random.Generator) -> list[Request]:  # pragma: no cover
        raise NotImplementedError

    def _trace(self, rng: np.random.Generator) -> _Trace:
        return _Trace(rng, self.vocab_size, self.block_size, self.duration)


@attrs.frozen(kw_only=True)
class ChatParams(WorkloadParams):
    """Multi-turn chat sessions sharing one system prompt (see docs/workloads.md)."""

    name: ClassVar[str] = "chat"
    #: Poisson rate of new conversations.
    sessions_per_minute: float = _pos(4.0)
    #: Shared system prompt length (0: none).
    system_prompt_tokens: int = _int(256, 0)
    #: User message length: lognormal with this mean and shape.
    user_tokens_mean: float = _pos(70.0)
    user_tokens_sigma: float = _nonneg(1.0)
    #: Answer length: lognormal with this mean and shape, at most ``max_output_tokens``.
    output_tokens_mean: float = _pos(215.0)
    output_tokens_sigma: float = _nonneg(0.8)
    max_output_tokens: int = _int(2048)
    #: Probability a conversation goes on after its first turn.
    first_continue_prob: float = _prob(0.4)
    #: Probability it goes on after each later turn (1 - this is the per-turn abandonment).
    later_continue_prob: float = _prob(0.7)
    max_turns: int = _int(30)
    #: Think time between an answer and the next message: lognormal with this median.
    think_time_median: float = _pos(60.0)
    think_time_sigma: float = _nonneg(1.5)
    #: Conversations also start in ``[-warmup, 0)``; their requests before 0 are dropped, so
    #: the window opens on a server already in steady state (0: the server starts empty).
    warmup: float = _nonneg(0.0)

    def scaled(self, factor: float) -> ChatParams:
        return attrs.evolve(self, sessions_per_minute=self.sessions_per_minute * factor)

    @property
    def mean_turns(self) -> float:
        """Expected turns per conversation, ignoring ``max_turns`` and the window."""
        return 1 + self.first_continue_prob / (1 - self.later_continue_prob)

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        system = tr.fresh(self.system_prompt_tokens)
        for i, start in enumerate(_poisson_times(rng, self.sessions_per_minute / 60,
                                                 self.warmup + self.duration)):
            _chat_session(tr, self, system, f"chat-{i}", start - self.warmup)
        return tr.result()


@attrs.frozen(kw_only=True)
class SteadyChatParams(ChatParams):
    """`ChatParams` at a busy server's rate, observed in steady state (the main job)."""

    name: ClassVar[str] = "chat-steady"
    duration: float = _pos(450.0)
    sessions_per_minute: float = _pos(36.0)
    warmup: float = _nonneg(1800.0)


def _chat_session(tr: _Trace, p: ChatParams, system: np.ndarray, session: str, start: float,
                  **extra: Any) -> float:
    """Add one conversation from ``start``; return when its last answer is done."""
    history: list[tuple[np.ndarray, str]] = [(system, "prompt")]
    t = start
    parent = None
    pause = None
    turn = 1
    while True:
        user = tr.fresh(tr.lognormal_int(p.user_tokens_mean, p.user_tokens_sigma))
        output = tr.fresh(tr.lognormal_int(p.output_tokens_mean, p.output_tokens_sigma,
                                           high=p.max_output_tokens))
        go_on = turn < p.max_turns and tr.rng.random() < (
            p.first_continue_prob if turn == 1 else p.later_continue_prob)
        rid = f"{session}-t{turn}"
        if not tr.add(rid, [*history, (user, "prompt")], session=session,
                      workload_class="chat", arrival=t, turn=turn, output=output,
                      parent=parent, last=not go_on, pause=pause, **extra):
            return math.inf
        done = t + len(output) * p.decode_seconds_per_token
        if not go_on:
            return done
        history += [(user, "prompt"), (output, "output")]
        pause = float(tr.rng.lognormal(math.log(p.think_time_median), p.think_time_sigma))
        t = done + pause
        parent = rid
        turn += 1


@attrs.frozen(kw_only=True)
class AgentParams(WorkloadParams):
    """Agent tasks: loops of LLM calls with tool pauses and a shared tool prompt."""

    name: ClassVar[str] = "agent"
    #: Poisson rate of new tasks.
    tasks_per_minute: float = _pos(1.0)
    #: Shared tool prompt (tool definitions) at the start of every task.
    tool_prompt_tokens: int = _int(1024, 0)
    #: Task description: lognormal mean and shape.
    task_tokens_mean: float = _pos(300.0)
    task_tokens_sigma: float = _nonneg(0.8)
    #: LLM calls per task: geometric with this mean, at most ``max_steps``.
    mean_steps: float = attrs.field(default=10.0)
    max_steps: int = _int(40)
    #: Each call's output (a tool call, or the final answer): lognormal mean and shape.
    action_tokens_mean: float = _pos(150.0)
    action_tokens_sigma: float = _nonneg(0.7)
    #: Each tool result fed back: lognormal mean and shape.
    tool_result_tokens_mean: float = _pos(400.0)
    tool_result_tokens_sigma: float = _nonneg(1.0)
    #: Tool execution time: lognormal with this median (seconds) and shape.
    tool_pause_median: float = _pos(2.0)
    tool_pause_sigma: float = _nonneg(1.0)
    #: If set, every step but the last carries ``RetentionHint(1.0, until=arrival + ttl)``.
    retention_ttl: float | None = attrs.field(default=None, validator=_optional_positive)

    @mean_steps.validator
    def _check_mean_steps(self, attribute: Any, value: Any) -> None:
        if not _is_number(value) or value < 1:
            raise ConfigError(f"AgentParams.mean_steps must be a number >= 1, got {value!r}")

    def scaled(self, factor: float) -> AgentParams:
        return attrs.evolve(self, tasks_per_minute=self.tasks_per_minute * factor)

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        tools = tr.fresh(self.tool_prompt_tokens)
        for i, start in enumerate(_poisson_times(rng, self.tasks_per_minute / 60,
                                                 self.duration)):
            session = f"agent-{i}"
            steps = min(self.max_steps, int(rng.geometric(1.0 / self.mean_steps)))
            task = tr.fresh(tr.lognormal_int(self.task_tokens_mean, self.task_tokens_sigma))
            history: list[tuple[np.ndarray, str]] = [(tools, "prompt"), (task, "prompt")]
            t, parent, pause = start, None, None
            for step in range(1, steps + 1):
                output = tr.fresh(tr.lognormal_int(self.action_tokens_mean,
                                                   self.action_tokens_sigma))
                last = step == steps
                rid = f"{session}-s{step}"
                hint = None
                if self.retention_ttl is not None and not last:
                    hint = RetentionHint(1.0, until=round(t, 6) + self.retention_ttl)
                ok = tr.add(rid, list(history), session=session, workload_class="agent",
                            arrival=t, turn=step, output=output, parent=parent, last=last,
                            retention=hint, pause=pause)
                if not ok or last:
                    break
                result = tr.fresh(tr.lognormal_int(self.tool_result_tokens_mean,
                                                   self.tool_result_tokens_sigma))
                history += [(output, "output"), (result, "context")]
                pause = float(rng.lognormal(math.log(self.tool_pause_median),
                                            self.tool_pause_sigma))
                t += len(output) * self.decode_seconds_per_token + pause
                parent = rid
        return tr.result()


@attrs.frozen(kw_only=True)
class RagParams(WorkloadParams):
    """Single-shot questions over a shared chunked corpus with Zipf document popularity."""

    name: ClassVar[str] = "rag"
    #: Poisson rate of questions.
    queries_per_minute: float = _pos(10.0)
    num_docs: int = _int(200)
    chunks_per_doc: int = _int(4)
    #: Tokens per chunk (a fixed run of ids per chunk).
    chunk_tokens: int = _int(256)
    #: Chunks retrieved per question.
    top_k: int = _int(5)
    #: Document popularity: probability of rank ``r`` (1 = most popular) ~ ``r ** -exponent``.
    zipf_exponent: float = _nonneg(1.0)
    system_prompt_tokens: int = _int(128, 0)
    question_tokens_mean: float = _pos(40.0)
    question_tokens_sigma: float = _nonneg(0.8)
    output_tokens_mean: float = _pos(200.0)
    output_tokens_sigma: float = _nonneg(0.8)

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.num_docs * self.chunks_per_doc:
            raise ConfigError(f"RagParams.top_k={self.top_k} exceeds the corpus of "
                              f"{self.num_docs * self.chunks_per_doc} chunks")

    def scaled(self, factor: float) -> RagParams:
        return attrs.evolve(self, queries_per_minute=self.queries_per_minute * factor)

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        system = tr.fresh(self.system_prompt_tokens)
        n_chunks = self.num_docs * self.chunks_per_doc
        corpus = tr.fresh(n_chunks * self.chunk_tokens).reshape(n_chunks, self.chunk_tokens)
        # chunk c belongs to document c // chunks_per_doc; document d has Zipf rank d + 1
        p = np.repeat(_zipf_weights(self.num_docs, self.zipf_exponent) / self.chunks_per_doc,
                      self.chunks_per_doc)
        p = np.maximum(p, 1e-300)  # a steep exponent must not leave fewer than top_k choices
        p /= p.sum()
        for i, t in enumerate(_poisson_times(rng, self.queries_per_minute / 60,
                                             self.duration)):
            chunks = np.sort(rng.choice(n_chunks, size=self.top_k, replace=False, p=p))
            question = tr.fresh(tr.lognormal_int(self.question_tokens_mean,
                                                 self.question_tokens_sigma))
            output = tr.fresh(tr.lognormal_int(self.output_tokens_mean,
                                               self.output_tokens_sigma))
            segments = [(system, "prompt"), *((corpus[c], "context") for c in chunks),
                        (question, "prompt")]
            tr.add(f"rag-{i}", segments, session=f"rag-{i}", workload_class="rag", arrival=t,
                   turn=1, output=output, parent=None, last=True,
                   chunks=[int(c) for c in chunks])
        return tr.result()


@attrs.frozen(kw_only=True)
class SingleShotParams(WorkloadParams):
    """Independent requests from a few apps with shared templates and bursty arrivals."""

    name: ClassVar[str] = "single_shot"
    #: Mean request rate.
    requests_per_second: float = _pos(0.3)
    #: Gamma shape of inter-arrival times (1: Poisson; below 1: burstier, CV = shape**-0.5).
    burst_shape: float = _pos(0.5)
    num_templates: int = _int(4)
    #: App popularity ~ ``rank ** -exponent``.
    template_zipf_exponent: float = _nonneg(1.0)
    template_tokens_mean: float = _pos(600.0)
    template_tokens_sigma: float = _nonneg(0.5)
    input_tokens_mean: float = _pos(100.0)
    input_tokens_sigma: float = _nonneg(1.0)
    output_tokens_mean: float = _pos(150.0)
    output_tokens_sigma: float = _nonneg(0.8)

    def scaled(self, factor: float) -> SingleShotParams:
        return attrs.evolve(self, requests_per_second=self.requests_per_second * factor)

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        templates = [tr.fresh(tr.lognormal_int(self.template_tokens_mean,
                                               self.template_tokens_sigma))
                     for _ in range(self.num_templates)]
        weights = _zipf_weights(self.num_templates, self.template_zipf_exponent)
        scale = 1.0 / (self.requests_per_second * self.burst_shape)
        t, i = 0.0, 0
        while True:
            t += float(rng.gamma(self.burst_shape, scale))
            if t >= self.duration:
                break
            app = int(rng.choice(self.num_templates, p=weights))
            user = tr.fresh(tr.lognormal_int(self.input_tokens_mean, self.input_tokens_sigma))
            output = tr.fresh(tr.lognormal_int(self.output_tokens_mean,
                                               self.output_tokens_sigma))
            tr.add(f"single-{i}", [(templates[app], "prompt"), (user, "prompt")],
                   session=f"single-{i}", workload_class="single_shot", arrival=t, turn=1,
                   output=output, parent=None, last=True, app=app)
            i += 1
        return tr.result()


@attrs.frozen(kw_only=True)
class BatchParams(WorkloadParams):
    """Batch jobs: many long prompts sharing a job template, arriving at once."""

    name: ClassVar[str] = "batch"
    jobs: int = _int(2)
    requests_per_job: int = _int(100)
    #: All of a job's requests arrive within this many seconds of its start.
    spread_seconds: float = _nonneg(2.0)
    #: Jobs start uniformly in ``[first_start, last_start] * duration``.
    first_start: float = attrs.field(default=0.0, validator=_probability)
    last_start: float = attrs.field(default=0.8, validator=_probability)
    template_tokens: int = _int(1024, 0)
    input_tokens_mean: float = _pos(1000.0)
    input_tokens_sigma: float = _nonneg(0.5)
    output_tokens_mean: float = _pos(400.0)
    output_tokens_sigma: float = _nonneg(0.5)

    def __attrs_post_init__(self) -> None:
        if self.last_start < self.first_start:
            raise ConfigError(f"BatchParams.last_start={self.last_start} is before "
                              f"first_start={self.first_start}")

    def scaled(self, factor: float) -> BatchParams:
        return attrs.evolve(self, requests_per_job=max(1, round(self.requests_per_job
                                                                * factor)))

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        _batch_jobs(tr, self, prefix="batch")
        return tr.result()


def _batch_jobs(tr: _Trace, p: BatchParams, prefix: str) -> None:
    rng = tr.rng
    starts = np.sort(rng.uniform(p.first_start, p.last_start, size=p.jobs)) * p.duration
    for j, start in enumerate(starts):
        template = tr.fresh(p.template_tokens)
        offsets = np.sort(rng.uniform(0.0, p.spread_seconds, size=p.requests_per_job))
        for i, off in enumerate(offsets):
            item = tr.fresh(tr.lognormal_int(p.input_tokens_mean, p.input_tokens_sigma))
            output = tr.fresh(tr.lognormal_int(p.output_tokens_mean, p.output_tokens_sigma))
            tr.add(f"{prefix}-{j}-{i}", [(template, "prompt"), (item, "prompt")],
                   session=f"{prefix}-{j}-{i}", workload_class="batch",
                   arrival=float(start + off), turn=1, output=output, parent=None, last=True,
                   job=j)


@attrs.frozen(kw_only=True)
class ChatServerParams(WorkloadParams):
    """A handful of people chatting on one box, plus an occasional batch job (seeds/000)."""

    name: ClassVar[str] = "chat-server"
    duration: float = _pos(3600.0)
    #: People using the box; each has one conversation at a time.
    people: int = _int(6)
    #: People start their first conversation uniformly within this many seconds.
    start_spread: float = _nonneg(600.0)
    #: Idle time between a person's conversations: lognormal median (seconds) and shape.
    session_gap_median: float = _pos(120.0)
    session_gap_sigma: float = _nonneg(1.0)
    #: How each conversation goes (its rate, window and warmup fields are not used).
    chat: ChatParams = attrs.field(
        factory=lambda: ChatParams(first_continue_prob=0.5, later_continue_prob=0.8,
                                   think_time_median=40.0, think_time_sigma=1.2),
        validator=_instance_of(ChatParams))
    #: The batch jobs (``jobs=0``: none).
    batch: BatchParams = attrs.field(
        factory=lambda: BatchParams(jobs=2, requests_per_job=40, first_start=0.2,
                                    last_start=0.8),
        validator=_instance_of(BatchParams))

    def scaled(self, factor: float) -> ChatServerParams:
        return attrs.evolve(self, people=max(1, round(self.people * factor)),
                            batch=self.batch.scaled(factor))

    def _generate(self, rng: np.random.Generator) -> list[Request]:
        tr = self._trace(rng)
        chat = attrs.evolve(self.chat, duration=self.duration, vocab_size=self.vocab_size,
                            block_size=self.block_size,
                            decode_seconds_per_token=self.decode_seconds_per_token)
        system = tr.fresh(chat.system_prompt_tokens)
        for person in range(self.people):
            t = float(rng.uniform(0.0, self.start_spread))
            conv = 0
            while t < self.duration:
                end = _chat_session(tr, chat, system, f"p{person}-c{conv}", t, person=person)
                t = end + float(rng.lognormal(math.log(self.session_gap_median),
                                              self.session_gap_sigma))
                conv += 1
        if self.batch.jobs:
            batch = attrs.evolve(self.batch, duration=self.duration,
                                 vocab_size=self.vocab_size, block_size=self.block_size)
            _batch_jobs(tr, batch, prefix="batch")
        return tr.result()


@attrs.frozen(kw_only=True)
class MixedParams(WorkloadParams):
    """Chat, agent, RAG and single-shot traffic on one server, each from its own stream."""

    name: ClassVar[str] = "mixed"
    chat: ChatParams = attrs.field(factory=ChatParams, validator=_instance_of(ChatParams))
    agent: AgentParams = attrs.field(factory=AgentParams, validator=_instance_of(AgentParams))
    rag: RagParams = attrs.field(factory=RagParams, validator=_instance_of(RagParams))
    single_shot: SingleShotParams = attrs.field(factory=SingleShotParams,
                                                validator=_instance_of(SingleShotParams))

    _PARTS: ClassVar[tuple[str, ...]] = ("chat", "agent", "rag", "single_shot")

    def scaled(self, factor: float) -> MixedParams:
        return attrs.evolve(self, **{k: getattr(self, k).scaled(factor) for k in self._PARTS})

    def generate(self, seed: int = 0) -> list[Request]:
        seed = _check_seed(seed)
        merged: list[tuple[float, int, int, Request]] = []
        for k, part in enumerate(self._PARTS):
            params = attrs.evolve(getattr(self, part), duration=self.duration,
                                  vocab_size=self.vocab_size, block_size=self.block_size,
                                  decode_seconds_per_token=self.decode_seconds_per_token)
            for i, req in enumerate(params.generate_from(_child_rng(seed, k))):
                merged.append((req.arrival, k, i, req))
        merged.sort(key=lambda t: t[:3])
        return [t[3] for t in merged]


# -- registry ------------------------------------------------------------------------------

_WORKLOADS: dict[str, type[WorkloadParams]] = {
    cls.name: cls
    for cls in (ChatParams, SteadyChatParams, AgentParams, RagParams, SingleShotParams,
                BatchParams, ChatServerParams, MixedParams)
}


def available_workloads() -> list[str]:
    """Names accepted by `generate`, sorted."""
    return sorted(_WORKLOADS)


def _apply_overrides(params: WorkloadParams, overrides: dict[str, Any]) -> WorkloadParams:
    fields = attrs.fields_dict(type(params))
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown parameter {unknown[0]!r} for workload {params.name!r}; valid "
            f"parameters: {', '.join(sorted(fields))}"
        )
    changes = {}
    for key, value in overrides.items():
        current = getattr(params, key)
        if isinstance(current, WorkloadParams) and isinstance(value, dict):
            value = _apply_overrides(current, value)
        changes[key] = value
    return attrs.evolve(params, **changes)


def workload_params(name: str, *, duration: float | None = None, scale: float = 1.0,
                    **overrides: Any) -> WorkloadParams:
    """The validated parameters `generate` would use.

    ``overrides`` replace fields of the workload's parameter class (a nested part of a mix
    takes a dict of its own fields, e.g. ``chat={"think_time_median": 30}``); then ``scale``
    multiplies the request rate (`WorkloadParams.scaled`); then ``duration`` (seconds)
    replaces the window. Raises `ConfigError` for an unknown name, an unknown field or a bad
    value.
    """
    if not isinstance(name, str) or name not in _WORKLOADS:
        raise ConfigError(
            f"unknown workload {name!r}; valid workloads: {', '.join(available_workloads())}"
        )
    if not _is_number(scale) or scale <= 0:
        raise ConfigError(f"scale must be a positive number, got {scale!r}")
    params = _apply_overrides(_WORKLOADS[name](), overrides)
    if scale != 1.0:
        params = params.scaled(float(scale))
    if duration is not None:
        params = attrs.evolve(params, duration=duration)
    return params


def generate(name: str, seed: int = 0, duration: float | None = None, scale: float = 1.0,
             **overrides: Any) -> list[Request]:
    """Generate a named workload: ``generate("chat-server", seed=1)``.

    Args:
        name: one of `available_workloads` (``agent``, ``batch``, ``chat``,
            ``chat-server``, ``mixed``, ``rag``, ``single_shot``).
        seed: non-negative int; the same arguments always give the same trace.
        duration: trace window in seconds (default: the workload's own).
        scale: multiplies the request rate (sessions, tasks, queries or people).
        overrides: fields of the workload's parameter class (see `workload_params`).

    Returns:
        The requests, sorted by arrival.
    """
    return workload_params(name, duration=duration, scale=scale, **overrides).generate(seed)
