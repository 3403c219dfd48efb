"""Continuous batching over the `KVCacheManager`: one scheduler, two executors.

Every step the scheduler builds a `StepPlan` under a token budget (vLLM's
``max_num_batched_tokens``): first the running requests (one decode token each, or the next
chunk of a prefill), then waiting requests in arrival order (preempted ones first), as long as
the budget, ``max_num_seqs`` and memory allow. The plan goes to an `Executor`: the simulator's
executor advances a virtual clock with a `CostModel`; the engine's executor runs a real model.
So a simulated and a measured run differ only by the executor.

Memory comes from the manager. A request that cannot allocate makes the scheduler **preempt**
a running one (its blocks are released, cached ones stay cached; it returns to the front of
the queue and recomputes what was evicted). Which one is pluggable:

- ``"last-arrived"``: vLLM's choice, the running request that arrived last.
- ``"fewest-processed"``: the DBMS-inspired choice of arXiv 2411.07447 (Sun et al.), the one
  with the fewest processed tokens, i.e. the cheapest to recompute.

Admission: the manager consults its `Admission` before a request evicts; a deferred request
stays in the queue (others behind it may start) and is retried every step.

**Where the time to the first token goes.** Every instant from a request's arrival to the end
of the step that samples its first token is charged to exactly one of three parts
(`RequestState.wait_memory`, `.wait_compute`, `.prefill_time`), decided at each scheduling
pass for the interval until the next pass:

- *prefill*: a step that runs one of its prefill chunks (the whole step: its batch-mates'
  chunks and decodes run in the same forward pass);
- *waiting for memory*: it is preempted and waits to resume; or admission control deferred
  it (until the scheduler next tries it); or the pass stopped admitting waiting requests
  because of memory (the head of the queue could not allocate its blocks, or the pass
  preempted) while the step still had token budget and a free seat. The whole queue behind a
  memory-blocked head waits for memory: admission is first come, first served;
- *waiting for compute*: everything else before its first token: it arrived while a step ran
  (until that step ends), the pass ran out of token budget (``max_num_batched_tokens``) or
  seats (``max_num_seqs``) before reaching it, or, admitted and mid-prefill, its next chunk
  did not fit the step's budget.

With memory tiers there is a fourth part, *reload* (`RequestState.reload_time`): a scheduler
given ``transfers`` (the simulator's `kvevict.run.TierTransfers`) asks it, when a request is
admitted, when the KV it reloaded from a lower tier, and any block of its cached prefix that
another request's reload is still bringing in, has arrived over the link. Until then the
request holds the blocks it hit or reloads but runs nothing, and takes no seat of
``max_num_seqs``, as in vLLM: an asynchronous KV load leaves the request waiting
(``WAITING_FOR_REMOTE_KVS``) with no new work allocated while the batch goes on, and a
request takes a seat only once it runs. Once the load is in, it takes a seat in the first
pass that has one, ahead of the queue (vLLM puts it back at the queue's front), and its
uncached rest is allocated then, as a running request's next prefill chunk: a block no step
has computed is never in the cache for another request (or for the request itself, preempted
meanwhile) to hit. The time between the end of the load and that pass is waiting for
compute.

So ``ttft = wait_memory + wait_compute + prefill_time + reload_time`` (up to floating-point
rounding of the clock differences), and ``queue_wait = wait_memory + wait_compute``.
"""

from __future__ import annotations

import abc
import math
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from kvevict.errors import AdmissionDeferred, ConfigError, OutOfBlocks
from kvevict.manager import KVCacheManager, Sequence
from kvevict.types import Request

__all__ = [
    "PHASES",
    "PREEMPTION_MODES",
    "Executor",
    "PrefillChunk",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "StepOutput",
    "StepPlan",
]

PREEMPTION_MODES = ("last-arrived", "fewest-processed")


def _positive_int(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class SchedulerConfig:
    """Knobs of the continuous-batching scheduler (vLLM's names where they exist).

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill chunks + decode tokens).
        max_num_seqs: most requests running at once.
        enable_chunked_prefill: split long prompts across steps; if False a prompt waits
            until its whole uncached part fits the budget.
        preemption: which running request to preempt: one of `PREEMPTION_MODES`.
    """

    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive_int)
    max_num_seqs: int = attrs.field(default=64, validator=_positive_int)
    enable_chunked_prefill: bool = True
    preemption: str = "last-arrived"

    def __attrs_post_init__(self) -> None:
        if self.preemption not in PREEMPTION_MODES:
            raise ConfigError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got "
                              f"{self.preemption!r}")


#: the parts of the time to the first token a `RequestState` is in between two passes
#: (``"queue"`` follows the queue's reason of the pass; see the module docstring)
PHASES = ("queue", "memory", "compute", "prefill", "reload")


class RequestState:
    """The scheduler's record of one request, and its measurements (times in clock seconds).

    ``ttft`` is from arrival to the end of the step that produced its first token. It splits
    into ``wait_memory`` + ``wait_compute`` (together ``queue_wait``: every interval before
    the first token in which none of its prefill ran, preempted and stalled ones included),
    ``prefill_time`` (the steps that ran its prefill chunks) and ``reload_time`` (admitted,
    waiting for its reloaded KV to cross the link); see the module docstring for which
    interval goes where. ``first_scheduled`` is the first admission's time. While it waits
    for a reload, ``ready_at`` is when the load ends.

    Per admission it keeps what the cache lookup found: ``prompt_blocks`` and
    ``cached_blocks`` (blocks looked up and found at the first admission), and
    ``resume_lookups`` and ``resume_hit_blocks`` (the same, summed over resumes after
    preemption). ``prefill_chunks`` lists ``(start, end, computed)`` of every prefill chunk
    that ran before the first token (as in `PrefillChunk`), for pricing recomputed tokens.
    """

    __slots__ = ("arrival", "cached_blocks", "cached_tokens", "computed_prefill_tokens",
                 "decode_time", "deferrals", "finish_time", "first_scheduled",
                 "first_token_time", "num_output", "pending_token", "phase", "phase_memory",
                 "phase_since", "prefill_chunks", "prefill_time", "preemptions",
                 "prompt_blocks", "ready_at", "reload_time", "request",
                 "resume_hit_blocks", "resume_lookups", "seq", "status", "wait_compute",
                 "wait_memory")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.arrival = request.arrival
        self.status = "waiting"  # waiting | running | preempted | finished
        self.seq: Sequence | None = None
        self.pending_token: int | None = None  # sampled, not yet fed back
        self.num_output = 0
        self.cached_tokens: int | None = None  # prompt tokens hit at the first begin
        self.computed_prefill_tokens = 0  # every token prefilled, recompute included
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.decode_time = 0.0
        self.preemptions = 0
        self.deferrals = 0
        self.wait_memory = 0.0
        self.wait_compute = 0.0
        self.prefill_time = 0.0
        self.reload_time = 0.0
        self.ready_at: float | None = None  # admitted, its reload ends then
        #: the part of the TTFT it is in now (one of `PHASES`; None once the first token
        #: is out), since ``phase_since``; ``phase_memory`` is the scheduler's queue
        #: memory-wait counter at that time (see `enter`)
        self.phase: str | None = "compute"
        self.phase_since = request.arrival
        self.phase_memory = 0.0
        self.prefill_chunks: list[tuple[int, int, int]] = []
        self.prompt_blocks = 0
        self.cached_blocks = 0
        self.resume_lookups = 0
        self.resume_hit_blocks = 0

    @property
    def request_id(self) -> Any:
        return self.request.request_id

    @property
    def target_output(self) -> int:
        """Tokens to generate (at least one: the first token ends the prefill)."""
        return max(1, self.request.output_len)

    @property
    def queue_wait(self) -> float | None:
        """``wait_memory + wait_compute`` once the first token is out (None before)."""
        if self.first_token_time is None:
            return None
        return self.wait_memory + self.wait_compute

    def enter(self, phase: str | None, now: float, queue_memory: float) -> None:
        """Charge the time since the last change to the phase it was in, then be in
        ``phase`` (one of `PHASES`, or None: the first token is out) from ``now``.

        ``queue_memory`` is the scheduler's counter of seconds in which the queue waited for
        memory: a ``"queue"`` interval is waiting for memory for as much as that counter
        grew during it, and waiting for compute for the rest. A no-op once the first token
        is out."""
        if self.phase is None:
            return
        since = self.phase_since
        dt = now - since
        if dt > 0:
            current = self.phase
            if current == "queue":
                memory = min(max(queue_memory - self.phase_memory, 0.0), dt)
                self.wait_memory += memory
                self.wait_compute += dt - memory
            elif current == "memory":
                self.wait_memory += dt
            elif current == "compute":
                self.wait_compute += dt
            elif current == "reload":
                self.reload_time += dt
            else:
                self.prefill_time += dt
            since = now
        self.phase = phase
        self.phase_since = since
        self.phase_memory = queue_memory

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    def next_output_token(self) -> int:
        """Output token ``num_output``: from ``request.output_tokens`` when the request fixes
        its answer, else a deterministic stand-in id (the same in every process)."""
        out = self.request.output_tokens
        if out is not None and self.num_output < len(out):
            return int(out[self.num_output])
        return zlib.crc32(f"{self.request_id!r}:{self.num_output}".encode()) % 32000

    def __repr__(self) -> str:
        return (f"RequestState({self.request_id!r}, {self.status}, output={self.num_output}/"
                f"{self.target_output})")


@attrs.frozen
class PrefillChunk:
    """Tokens ``[start, end)`` of a sequence are computed this step (``start`` are cached or
    computed already). ``samples`` says whether the chunk ends the prompt and yields the
    first token (a fully cached prompt gives ``start == end``: only the last token's logits
    are recomputed)."""

    state: RequestState
    start: int
    end: int
    samples: bool
    #: real tokens computed (``end - start`` less the padding of a hash-only prompt)
    computed: int = -1

    def __attrs_post_init__(self) -> None:
        if self.computed < 0:
            object.__setattr__(self, "computed", self.end - self.start)


@attrs.define
class StepPlan:
    """What one step runs: prefill chunks and one decode token per listed request."""

    prefills: list[PrefillChunk] = attrs.Factory(list)
    decodes: list[RequestState] = attrs.Factory(list)

    @property
    def num_tokens(self) -> int:
        return sum(max(1, c.end - c.start) if c.samples else c.end - c.start
                   for c in self.prefills) + len(self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


@attrs.frozen
class StepOutput:
    """The executor's answer: sampled token ids by request id (for chunks that sample and
    for every decode); ``seconds`` the step took (measured or modelled)."""

    tokens: dict[Any, int]
    seconds: float = 0.0


class Executor(abc.ABC):
    """Runs a `StepPlan`: advances virtual time (simulator) or runs a model (engine)."""

    @abc.abstractmethod
    def execute(self, plan: StepPlan, manager: KVCacheManager) -> StepOutput:
        """Run the plan; the sequences' block tables are allocated already."""

    @abc.abstractmethod
    def idle_until(self, t: float) -> None:
        """Nothing can run before clock time ``t`` (the next arrival or retry)."""

    @property
    def work_meter(self) -> Any:
        """The `kvevict.run.CostModelExecutor` that priced every step this executor ran, part
        by part (``prefill_work``, ``decode_work``, ``decode_tokens``: a run's measured load,
        `kvevict.run.SimResult.measured_load`), or None when nothing priced them."""
        return None


class Scheduler:
    """Continuous batching: `add` requests, then `step` until `has_work` is False.

    Args:
        manager: the cache manager (its clock is the scheduler's clock).
        executor: runs each step.
        config: `SchedulerConfig`.
        on_finish: called with each finished `RequestState` (the sink of a run that keeps
            what it needs itself, as `kvevict.run.RunCollector`).
        keep_finished: keep every finished `RequestState` in ``finished`` (the default; its
            request and prompt stay referenced). With False a finished request leaves the
            scheduler once ``on_finish`` has seen it, so a long run holds only the requests
            in flight.
        transfers: the link model of a cache with memory tiers (`kvevict.run.TierTransfers`
            or any object with its two methods): ``arrived(state)`` as each request is
            queued (to start a prefetch), ``admitted(state, seq, pool_hits, now)`` after each
            admission (begin or resume), returning the clock time its reloaded KV has
            arrived; until then the request waits (``reload_time``). None (the default):
            reloads take no time.
    """

    def __init__(self, manager: KVCacheManager, executor: Executor,
                 config: SchedulerConfig | None = None,
                 on_finish: Callable[[RequestState], None] | None = None, *,
                 keep_finished: bool = True, transfers: Any = None) -> None:
        if not isinstance(manager, KVCacheManager):
            raise ConfigError(f"manager must be a KVCacheManager, got {type(manager).__name__}")
        if not isinstance(executor, Executor):
            raise ConfigError(f"executor must be an Executor, got {type(executor).__name__}")
        self.manager = manager
        self.executor = executor
        self.config = config if config is not None else SchedulerConfig()
        self.on_finish = on_finish
        if not isinstance(keep_finished, bool):
            raise ConfigError(f"keep_finished must be True or False, got {keep_finished!r}")
        self.keep_finished = keep_finished
        self.transfers = transfers
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        #: requests of ``running`` admitted to wait for a reload that have not run yet
        #: (``ready_at`` set): they take no seat
        self.loading = 0
        self.finished: list[RequestState] = []
        self.steps = 0
        #: seconds the executor spent on steps (the run's busy time)
        self.busy_seconds = 0.0
        #: steps planned at the box's limit that decoded (a request was left waiting because
        #: every seat was taken or memory was short, or the step preempted), and the
        #: sequences those steps decoded: their ratio is the batch the box sustains when it is
        #: full (`kvevict.run.SimResult.limit_batch`, the measured load's decode batch)
        self.limit_steps = 0
        self.limit_decodes = 0
        self.preemptions = 0
        self._retry_at: float | None = None
        # why the untouched part of the waiting queue waits since the last pass ("memory" or
        # "compute"), since when, and the seconds it has waited for memory in all
        self._queue_reason = "compute"
        self._queue_since: float | None = None
        self._queue_memory = 0.0

    @property
    def clock(self) -> Callable[[], float]:
        return self.manager.clock

    def add(self, request: Request) -> RequestState:
        """Queue a request that has arrived."""
        if not isinstance(request, Request):
            raise ConfigError(f"add() takes a Request, got {type(request).__name__}")
        state = RequestState(request)
        now = self.clock()
        # it arrived while a step ran: waiting for compute until now, then it is in the queue
        state.enter("queue", max(now, state.arrival), self._queue_memory_at(now))
        self.waiting.append(state)
        if self.transfers is not None:
            self.transfers.arrived(state)
        return state

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------

    def _queue_memory_at(self, now: float) -> float:
        """The queue's memory-wait counter brought up to ``now``."""
        since = self._queue_since
        if since is not None and self._queue_reason == "memory" and now > since:
            self._queue_memory += now - since
        if since is None or now > since:
            self._queue_since = now
        return self._queue_memory

    def _preempt_for(self, needing: RequestState, scheduled: set[Any]) -> RequestState:
        """Preempt one running request not yet in this step's plan (possibly ``needing``)."""
        candidates = [s for s in self.running
                      if s is needing or s.request_id not in scheduled]
        if candidates == [needing] and len(self.running) == 1:
            raise ConfigError(
                f"request {needing.request_id!r} needs more blocks than the whole pool "
                f"({self.manager.pool.num_blocks} blocks of {self.manager.block_size} "
                "tokens); enlarge the cache"
            )
        if self.config.preemption == "last-arrived":
            victim = max(candidates, key=lambda s: (s.arrival, str(s.request_id)))
        else:  # fewest processed tokens: cheapest to recompute (arXiv 2411.07447)
            victim = min(candidates, key=lambda s: (s.seq.num_tokens, -s.arrival))  # type: ignore[union-attr]
        self.manager.preempt(victim.request_id)
        self._unload(victim)  # a load under way is wasted
        now = self.clock()
        victim.enter("memory", now, self._queue_memory_at(now))  # it waits to resume
        victim.status = "preempted"
        victim.preemptions += 1
        self.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        return victim

    def _grow_running(self, state: RequestState, grow: Callable[[], Any],
                      scheduled: set[Any]) -> bool:
        """Run ``grow`` (an allocation); preempt others on `OutOfBlocks`. False if ``state``
        itself was preempted."""
        while True:
            try:
                grow()
                return True
            except OutOfBlocks:
                if self._preempt_for(state, scheduled) is state:
                    return False

    @staticmethod
    def _feed(state: RequestState) -> Any:
        """What a decode step appends: the last sampled token (a count for hash-only
        requests)."""
        return 1 if state.request.tokens is None else [state.pending_token]

    def _schedule_decode(self, state: RequestState, plan: StepPlan, scheduled: set[Any]) -> bool:
        feed = self._feed(state)
        if not self._grow_running(
                state, lambda: self.manager.append(state.request_id, feed), scheduled):
            return False
        state.pending_token = None
        plan.decodes.append(state)
        return True

    def schedule(self) -> StepPlan:
        """Build the next step's plan, allocating its memory."""
        cfg = self.config
        manager = self.manager
        stats = manager.stats
        budget = cfg.max_num_batched_tokens
        plan = StepPlan()
        now = self.clock()
        memory = self._queue_memory_at(now)
        preempted_before = self.preemptions
        scheduled: set[Any] = set()
        for state in list(self.running):
            if state.status != "running":
                continue  # preempted in this pass (waiting for memory from now)
            if state.ready_at is not None:  # admitted, waiting for its reload
                spent = self._loaded(state, plan, budget, now, memory, scheduled)
                if spent is not None:
                    budget -= spent
                continue
            if budget <= 0:
                state.enter("compute", now, memory)  # no-op after its first token
                continue
            seq = state.seq
            assert seq is not None
            if seq.num_pending:
                n = min(seq.num_pending, budget)
                if not cfg.enable_chunked_prefill and n < seq.num_pending:
                    state.enter("compute", now, memory)
                    continue
                start = seq.num_tokens
                if not self._grow_running(
                        state, lambda s=seq, k=n: manager.prefill(s.seq_id, k), scheduled):
                    continue
                samples = seq.num_pending == 0 and state.pending_token is None
                real = seq.real_tokens(start, start + n)
                self._plan_prefill(state, plan, start, start + n, samples, real, real, now,
                                   memory)
                budget -= n
            else:
                if not self._schedule_decode(state, plan, scheduled):
                    continue
                budget -= 1
            scheduled.add(state.request_id)
        if self.preemptions != preempted_before and plan:
            self._queue_reason = "memory"
            self._at_limit(plan)
            return plan  # under memory pressure: start nothing new this step (as vLLM)
        deferred: list[RequestState] = []
        preempted_before = self.preemptions
        reason = "compute"  # why the requests this pass does not reach wait
        while self.waiting and budget > 0 and self.seated() < cfg.max_num_seqs:
            if self.preemptions != preempted_before:
                reason = "memory"
                break  # admitting made room by preempting: stop, or the two would cycle
            state = self.waiting[0]
            limit = budget if cfg.enable_chunked_prefill else None
            resuming = state.status == "preempted"
            # a request that will wait for a reload allocates its uncached rest once loaded
            loads = self.transfers is not None and self.transfers.will_wait(state, now)
            if loads:
                limit = 0
            queries, hits = stats.block_queries, stats.block_hits
            try:
                if resuming:
                    seq = manager.resume(state.request_id, max_new_tokens=limit)
                else:
                    seq = manager.begin(state.request, max_new_tokens=limit)
            except AdmissionDeferred as exc:
                state.deferrals += 1
                state.enter("memory", now, memory)  # until it is tried again
                deferred.append(self.waiting.popleft())
                retry = now + max(exc.retry_after, 0.0)
                if retry <= now:  # a wait too small to move the clock: move it one ulp
                    retry = math.nextafter(now, math.inf)
                self._retry_at = retry if self._retry_at is None else min(self._retry_at, retry)
                continue
            except OutOfBlocks:
                if not self.running and not plan:
                    raise ConfigError(
                        f"request {state.request_id!r} needs more blocks than the whole pool "
                        f"({manager.pool.num_blocks} blocks of {manager.block_size} tokens); "
                        "enlarge the cache"
                    ) from None
                state.enter("memory" if resuming else "queue", now, memory)
                reason = "memory"
                break
            self.waiting.popleft()
            if resuming:
                state.resume_lookups += stats.block_queries - queries
                state.resume_hit_blocks += stats.block_hits - hits
            else:
                state.prompt_blocks = stats.block_queries - queries
                state.cached_blocks = stats.block_hits - hits
            if state.cached_tokens is None:
                state.cached_tokens = seq.num_cached_tokens
            if state.first_scheduled is None:
                state.first_scheduled = now
            state.seq = seq
            state.status = "running"
            self.running.append(state)
            if self.transfers is not None:
                pool_hits = stats.block_hits - hits - sum(seq.reloaded)
                ready = self.transfers.admitted(state, seq, pool_hits, now)
                if loads:  # its rest is allocated and run once the load is in (`_loaded`)
                    state.ready_at = ready
                    self.loading += 1
                    spent = self._loaded(state, plan, budget, now, memory, scheduled)
                    if spent is not None:
                        budget -= spent
                    continue
                if ready > now:
                    raise AssertionError(
                        f"request {state.request_id!r} waits for a reload that "
                        "TierTransfers.will_wait did not foresee")
            start = seq.num_hit_slots
            n = seq.num_tokens - start
            samples = seq.num_pending == 0 and state.pending_token is None
            if n == 0 and not samples:  # a resumed sequence, fully cached: decode now
                if self._schedule_decode(state, plan, scheduled):
                    scheduled.add(state.request_id)
                    budget -= 1
                continue
            real = seq.real_tokens(start, seq.num_tokens)
            computed = max(real, 1) if samples else real
            self._plan_prefill(state, plan, start, seq.num_tokens, samples, real, computed, now,
                               memory)
            scheduled.add(state.request_id)  # in this step's plan: not to be preempted now
            budget -= computed
        self._queue_reason = reason
        if self.waiting and (reason == "memory" or self.seated() >= cfg.max_num_seqs):
            self._at_limit(plan)
        for state in reversed(deferred):
            self.waiting.appendleft(state)
        return plan

    def _unload(self, state: RequestState) -> None:
        """``state`` no longer waits to run after a reload (it runs, or was preempted)."""
        if state.ready_at is not None:
            state.ready_at = None
            self.loading -= 1

    def seated(self) -> int:
        """Running requests that hold a seat of ``max_num_seqs``: all but those waiting to
        run after a reload."""
        return len(self.running) - self.loading

    def _at_limit(self, plan: StepPlan) -> None:
        """Count ``plan`` as a step at the box's limit (`limit_steps`) when it decodes."""
        if plan.decodes:
            self.limit_steps += 1
            self.limit_decodes += len(plan.decodes)

    def _loaded(self, state: RequestState, plan: StepPlan, budget: int, now: float,
                memory: float, scheduled: set[Any]) -> int | None:
        """A request admitted to wait for a reload: still loading, it waits (``reload``);
        loaded, it takes a seat and allocates and runs its first chunk of what is uncached (or,
        a resumed sequence fully cached, its decode) when a seat is free and the step's budget
        holds it, and waits for compute from the end of the load otherwise. Returns the budget
        spent, or None when nothing ran."""
        ready = state.ready_at
        assert ready is not None and state.seq is not None
        if ready > now:
            state.enter("reload", now, memory)
            return None
        state.enter("compute", ready, memory)  # loaded at ``ready``; since then, compute
        if budget <= 0 or self.seated() >= self.config.max_num_seqs:
            return None
        seq = state.seq
        pending = seq.num_pending
        n = min(pending, budget) if self.config.enable_chunked_prefill else pending
        samples = n == pending and state.pending_token is None
        if n == 0 and not samples:  # a resumed sequence, fully cached: decode
            if not self._schedule_decode(state, plan, scheduled):
                return None
            self._unload(state)
            scheduled.add(state.request_id)
            return 1
        start = seq.num_tokens
        real = seq.real_tokens(start, start + n) if n else 0
        computed = max(real, 1) if samples else real
        if computed > budget:  # a whole prompt that does not fit (no chunked prefill)
            state.enter("compute", now, memory)
            return None
        if n and not self._grow_running(
                state, lambda: self.manager.prefill(seq.seq_id, n), scheduled):
            return None  # preempted itself to make room
        self._unload(state)
        self._plan_prefill(state, plan, start, start + n, samples, real, computed, now, memory)
        scheduled.add(state.request_id)
        return computed

    @staticmethod
    def _plan_prefill(state: RequestState, plan: StepPlan, start: int, end: int,
                      samples: bool, real: int, computed: int, now: float,
                      memory: float) -> None:
        """Put positions ``[start, end)`` of ``state`` in ``plan`` as a prefill chunk
        (``real`` of them real tokens; ``samples``: it ends the prompt and samples), counting
        ``computed`` prefill tokens; before the first token, the chunk is part of its prefill
        (``prefill_chunks``, the ``prefill`` phase)."""
        plan.prefills.append(PrefillChunk(state, start, end, samples, real))
        state.computed_prefill_tokens += computed
        if state.first_token_time is None:
            state.prefill_chunks.append((start, end, real))
            state.enter("prefill", now, memory)

    def step(self, next_arrival: float | None = None) -> StepPlan:
        """Schedule, execute and account one step. If nothing can run, idle until the
        earliest of a deferred request's retry time and ``next_arrival`` (the driver's next
        request) and return the empty plan."""
        plan = self.schedule()
        retry, self._retry_at = self._retry_at, None
        if not plan:
            wake = min(t for t in (retry, next_arrival, math.inf) if t is not None)
            for state in self.running:  # a reload under way ends
                if state.ready_at is not None and state.ready_at < wake:
                    wake = state.ready_at
            if wake == math.inf:
                if self.has_work():
                    raise ConfigError("scheduler is stuck: requests wait but nothing can run")
                return plan
            self.executor.idle_until(wake)
            return plan
        out = self.executor.execute(plan, self.manager)
        self.steps += 1
        self.busy_seconds += out.seconds
        self.complete(plan, out)
        return plan

    def complete(self, plan: StepPlan, out: StepOutput) -> None:
        """Record sampled tokens, first-token times and finished requests."""
        now = self.clock()
        producers = [c.state for c in plan.prefills if c.samples] + plan.decodes
        for state in producers:
            token = out.tokens.get(state.request_id)
            if token is None:
                token = state.next_output_token()
            if state.first_token_time is None:
                state.first_token_time = now
                state.enter(None, now, self._queue_memory)  # its last prefill step ends
            state.num_output += 1
            if state.num_output >= state.target_output:
                self.manager.finish(state.request_id)
                state.status = "finished"
                state.finish_time = now
                self.running.remove(state)
                if self.keep_finished:
                    self.finished.append(state)
                if self.on_finish is not None:
                    self.on_finish(state)
                state.seq = None  # its blocks are released; keep the record, not the tokens
            else:
                state.pending_token = token
