"""The run loop beside the scheduler, shared by the simulator and the engine.

"One scheduler, two executors" (`kvevict.scheduler`): the simulator (`kvevict.sim`) and the
built-in engine (`kvevict.engine`) run the same `Scheduler` and differ only in the executor.
What they share sits here, below both, so neither imports the other:

- `drive`: hand each request to the scheduler once the clock reaches its arrival, and step
  until every request is finished;
- `collect`: assemble the finished run into a `SimResult`: per-request records
  (`RequestRecord`: the time to the first token in its parts, what the first admission's
  lookup found), run-level counters and what an infinite cache would have hit
  (`infinite_cache_hits`);
- `CostModelExecutor`: the executor that charges each step what a `CostModel` says it costs
  (the simulator runs on it; the engine prices its measured steps with it).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import attrs
import numpy as np

from kvevict.cost import CostModel
from kvevict.hashing import block_hashes
from kvevict.manager import KVCacheManager
from kvevict.scheduler import Executor, RequestState, Scheduler, StepOutput, StepPlan
from kvevict.types import ManualClock, Request

__all__ = ["CostModelExecutor", "RequestRecord", "SimResult", "chunk_seconds", "collect",
           "drive", "infinite_cache_hits", "recompute_seconds"]


def chunk_seconds(cost: CostModel, start: int, end: int, computed: int) -> float:
    """What ``cost`` charges a prefill chunk of slots ``[start, end)`` with ``computed`` real
    tokens (`PrefillChunk`): ``prefill_seconds(computed, start)``, or one token's after
    ``end - 1`` for a fully cached prompt (``computed == 0``: the last token's logits)."""
    if computed == 0:
        return cost.prefill_seconds(1, max(end - 1, 0))
    return cost.prefill_seconds(computed, start)


def recompute_seconds(cost: CostModel, chunks: SequenceABC[tuple[int, int, int]],
                      prompt_tokens: int, compulsory_from: int) -> float:
    """The seconds ``cost`` charges for the recomputed tokens of a request's prefill chunks
    (``(start, end, computed)`` in order, as `RequestState.prefill_chunks` lists them).

    A prompt position's computation is *compulsory* the first time the request computes it
    at or after ``compulsory_from`` (where neither an infinite cache nor the first admission
    found it cached; the last prompt token always, for its logits); every other computation
    is a *recompute*. The recomputed positions of a chunk are its first ones (a chunk starts
    where the cache's hit ended and runs upward), and a chunk's recompute seconds are its
    charge (`chunk_seconds`) less the charge of its compulsory tail alone: the linear and
    attention terms of its recomputed tokens, plus the per-call overhead when the chunk is
    all recompute. Exact for `CostModel.prefill_seconds`, which is additive over adjacent
    token ranges apart from that overhead.
    """
    done = min(compulsory_from, prompt_tokens - 1)  # compulsory positions start here
    seconds = 0.0
    for start, end, computed in chunks:
        if computed == 0:  # the last token's logits: compulsory once
            if done >= prompt_tokens:
                seconds += chunk_seconds(cost, start, end, 0)
            done = max(done, prompt_tokens)
            continue
        k = min(max(done - start, 0), computed)  # positions [start, start + k) recomputed
        if k:
            seconds += (cost.prefill_seconds(computed, start)
                        - cost.prefill_seconds(computed - k, start + k))
        done = max(done, start + computed)
    return seconds


class CostModelExecutor(Executor):
    """Virtual time: a step costs the sum of its prefill chunks' `CostModel.prefill_seconds`
    plus one decode step over the batch (`CostModel.decode_batch_seconds`); the clock
    advances by that much."""

    def __init__(self, cost: CostModel, clock: ManualClock) -> None:
        self.cost = cost
        self.clock = clock

    def step_seconds(self, plan: StepPlan) -> float:
        cost = self.cost
        seconds = 0.0
        for chunk in plan.prefills:
            seconds += chunk_seconds(cost, chunk.start, chunk.end, chunk.computed)
        if plan.decodes:
            seconds += cost.decode_batch_seconds(
                [s.seq.num_tokens for s in plan.decodes])  # type: ignore[union-attr]
        return seconds

    def execute(self, plan: StepPlan, manager: KVCacheManager) -> StepOutput:
        seconds = self.step_seconds(plan)
        self.clock.advance(seconds)
        return StepOutput({}, seconds)

    def idle_until(self, t: float) -> None:
        if t > self.clock.now:
            self.clock.set(t)


@attrs.frozen
class RequestRecord:
    """What happened to one request (times in seconds of the run's clock).

    The time to the first token splits exactly (up to floating-point rounding):
    ``ttft = wait_memory + wait_compute + prefill_s + reload_s``, with ``queue_wait =
    wait_memory + wait_compute``. See `kvevict.scheduler` ("Where the time to the first
    token goes") for which interval is which; the first token is sampled by the step that
    ends the prompt's prefill, so no decode step is part of the TTFT.

    Attributes:
        request_id, session_id, workload_class, arrival: from the `Request`.
        prompt_tokens, output_tokens: the prompt's length; tokens generated.
        cached_tokens: prompt tokens the first admission found cached.
        computed_prefill_tokens: every token prefilled, recomputation included.
        queue_wait: seconds before the first token in which none of its prefill ran
            (``wait_memory + wait_compute``).
        ttft: arrival to the end of the step that sampled the first token.
        finish: clock time of the last token.
        preemptions, deferrals: times preempted; times admission control deferred it.
        wait_memory: seconds waiting for memory (preempted, deferred, or queued behind a
            head that could not allocate while the step had budget and a seat).
        wait_compute: seconds waiting for compute (the token budget, the seats, a step in
            progress).
        prefill_s: seconds of the steps that ran its prefill chunks before the first token.
        recompute_prefill_s: of ``prefill_s``, what the cost model charges for its
            recomputed prefill tokens (`recompute_seconds`): positions an infinite cache, or
            its own first admission, had cached, and positions computed again after a
            preemption. Priced, not measured (the engine's steps are timed whole).
        reload_s: seconds reloading KV from a lower tier; 0 until the cache has tiers.
        prompt_blocks, cached_blocks: prompt blocks looked up at the first admission, and of
            those found cached (the block hit ratio's denominator and numerator).
        resume_lookups, resume_hit_blocks: blocks looked up, and found cached, when it
            resumed after preemptions (summed over its resumes).
    """

    request_id: Any
    session_id: Any
    workload_class: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    computed_prefill_tokens: int
    queue_wait: float
    ttft: float
    finish: float
    preemptions: int
    deferrals: int
    wait_memory: float
    wait_compute: float
    prefill_s: float
    recompute_prefill_s: float
    reload_s: float
    prompt_blocks: int
    cached_blocks: int
    resume_lookups: int
    resume_hit_blocks: int

    @classmethod
    def from_state(cls, s: RequestState, *, recompute_prefill_s: float) -> RequestRecord:
        """The record of a finished `RequestState`; ``recompute_prefill_s`` is priced by the
        caller (`collect`: `recompute_seconds`)."""
        return cls(
            request_id=s.request_id, session_id=s.request.session_id,
            workload_class=s.request.workload_class, arrival=s.arrival,
            prompt_tokens=s.request.prompt_len, output_tokens=s.num_output,
            cached_tokens=s.cached_tokens or 0,
            computed_prefill_tokens=s.computed_prefill_tokens,
            queue_wait=s.queue_wait or 0.0, ttft=s.ttft or 0.0,
            finish=s.finish_time or 0.0, preemptions=s.preemptions, deferrals=s.deferrals,
            wait_memory=s.wait_memory, wait_compute=s.wait_compute, prefill_s=s.prefill_time,
            recompute_prefill_s=recompute_prefill_s, reload_s=0.0,
            prompt_blocks=s.prompt_blocks, cached_blocks=s.cached_blocks,
            resume_lookups=s.resume_lookups, resume_hit_blocks=s.resume_hit_blocks,
        )

    def time_divided(self, factor: float) -> RequestRecord:
        """This record with every time (arrival, the TTFT and its parts, finish) divided by
        ``factor`` (the engine: workload to engine seconds)."""
        f = factor
        return attrs.evolve(
            self, arrival=self.arrival / f, queue_wait=self.queue_wait / f,
            ttft=self.ttft / f, finish=self.finish / f, wait_memory=self.wait_memory / f,
            wait_compute=self.wait_compute / f, prefill_s=self.prefill_s / f,
            recompute_prefill_s=self.recompute_prefill_s / f, reload_s=self.reload_s / f)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


#: the TTFT and its parts: summary key prefix -> record field
_TIMES = (("ttft", "ttft"), ("queue_wait", "queue_wait"), ("wait_memory", "wait_memory"),
          ("wait_compute", "wait_compute"), ("prefill_s", "prefill_s"),
          ("recompute_prefill_s", "recompute_prefill_s"), ("reload_s", "reload_s"))


def _times(recs: SequenceABC[RequestRecord]) -> dict[str, float]:
    """p50/p95/p99 and mean of the TTFT and each of its parts (``ttft_p95``,
    ``wait_memory_mean``...); the means add up as the records do, the percentiles do not."""
    out: dict[str, float] = {}
    for key, field in _TIMES:
        values = np.array([getattr(r, field) for r in recs])
        for q in (50, 95, 99):
            out[f"{key}_p{q}"] = round(_pct(values, q), 6)
        out[f"{key}_mean"] = round(float(values.mean()), 6) if len(values) else 0.0
    return out


def _ratio(num: int, den: int) -> float:
    return round(num / den, 6) if den else 0.0


@attrs.frozen
class SimResult:
    """Per-request records and run-level counters of one simulation."""

    policy: str
    capacity_blocks: int
    block_size: int
    records: tuple[RequestRecord, ...]
    manager_stats: dict[str, Any]
    preemptions: int
    steps: int
    makespan: float
    infinite_hit_tokens: int
    #: prefill tokens an infinite cache would still compute (misses, and one token of a
    #: fully cached prompt for its logits): what no policy can avoid
    infinite_compute_tokens: int
    #: seconds the executor was busy, and the span from the first to the last arrival
    busy_seconds: float = 0.0
    arrival_span: float = 0.0

    def summary(self) -> dict[str, Any]:
        """The headline numbers (JSON-ready, rounded for stable output).

        Hit ratios count each request's first admission only: ``token_hit_ratio`` is cached
        over prompt tokens, ``block_hit_ratio`` cached over looked-up prompt blocks (the
        manager's lookups of the first admissions); lookups of preempted requests resuming
        are counted apart (``resume_lookups``, ``resume_hit_blocks``,
        ``resume_block_hit_ratio``). Times: p50/p95/p99 and mean of the TTFT and its parts
        (`RequestRecord`), overall and per workload class (``classes``). docs/columns.md
        defines every key.
        """
        recs = self.records
        prompt = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        computed = sum(r.computed_prefill_tokens for r in recs)
        compulsory = self.infinite_compute_tokens
        out_tokens = sum(r.output_tokens for r in recs)
        stats = self.manager_stats
        times = _times(recs)
        resume_lookups = sum(r.resume_lookups for r in recs)
        resume_hits = sum(r.resume_hit_blocks for r in recs)
        out: dict[str, Any] = {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": len(recs),
            "token_hit_ratio": _ratio(cached, prompt),
            "block_hit_ratio": _block_hit_ratio(recs),
            "infinite_cache_hit_ratio": _ratio(self.infinite_hit_tokens, prompt),
            "prefill_tokens_computed": computed,
            "recomputed_prefill_tokens": max(computed - compulsory, 0),
            "ttft_p50": times["ttft_p50"],
            "ttft_p95": times["ttft_p95"],
            "ttft_p99": times["ttft_p99"],
            "queue_wait_p95": times["queue_wait_p95"],
            "throughput_tokens_per_s": round(out_tokens / self.makespan, 3)
            if self.makespan > 0 else 0.0,
            "requests_per_s": round(len(recs) / self.makespan, 6) if self.makespan > 0
            else 0.0,
            # the measured load: busy seconds per second of arrivals; at >= 1 the box could
            # not keep up with this policy's misses, and the queue grew through the run
            "measured_load": round(self.busy_seconds / self.arrival_span, 6)
            if self.arrival_span > 0 else 0.0,
            "evictions": stats["evictions"],
            "evictions_by_class": dict(sorted(stats["evictions_by_class"].items())),
            "preemptions": self.preemptions,
            "deferrals": sum(r.deferrals for r in recs),
            "peak_blocks": stats["peak_blocks_used"],
            "resume_lookups": resume_lookups,
            "resume_hit_blocks": resume_hits,
            "resume_block_hit_ratio": _ratio(resume_hits, resume_lookups),
        }
        out.update(times)
        by_class: dict[str, list[RequestRecord]] = {}
        for r in recs:
            by_class.setdefault(r.workload_class, []).append(r)
        out["classes"] = {cls: _class_summary(by_class[cls]) for cls in sorted(by_class)}
        return out


def _block_hit_ratio(recs: SequenceABC[RequestRecord]) -> float:
    return _ratio(sum(r.cached_blocks for r in recs), sum(r.prompt_blocks for r in recs))


def _class_summary(recs: SequenceABC[RequestRecord]) -> dict[str, Any]:
    """One workload class's requests, hit ratios (first admissions), preemptions and times."""
    return {
        "requests": len(recs),
        "token_hit_ratio": _ratio(sum(r.cached_tokens for r in recs),
                                  sum(r.prompt_tokens for r in recs)),
        "block_hit_ratio": _block_hit_ratio(recs),
        "preemptions": sum(r.preemptions for r in recs),
        "deferrals": sum(r.deferrals for r in recs),
        **_times(recs),
    }


def _request_hashes(request: Request, block_size: int, with_output: bool) -> list[Any]:
    if request.block_hashes is not None:
        return list(request.block_hashes)
    tokens = request.tokens
    if with_output and request.output_tokens is not None:
        # decode feeds back every sampled token but the last, so only those get cached
        tokens = np.concatenate([tokens, request.output_tokens[:request.output_len - 1]])
    return block_hashes(tokens, block_size)


def infinite_cache_hits(requests: SequenceABC[Request], block_size: int) -> list[int]:
    """Prompt tokens an infinite cache would hit, per request in arrival order (a request's
    own answer is cached for the next turn, as decode caches it)."""
    seen: set[Any] = set()
    hits: list[int] = []
    for r in sorted(requests, key=lambda r: r.arrival):
        hashes = _request_hashes(r, block_size, with_output=False)
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        hits.append(min(n * block_size, r.prompt_len))
        seen.update(_request_hashes(r, block_size, with_output=True))
    return hits


def drive(scheduler: Scheduler, ordered: SequenceABC[Request], clock: ManualClock,
          on_step: Callable[[Scheduler], None] | None = None) -> None:
    """Hand each request (sorted by arrival) to ``scheduler`` once ``clock`` reaches its
    arrival and step until every request is finished; when nothing runs, the executor idles
    until the next arrival. ``on_step`` is called after every step that ran."""
    executor = scheduler.executor
    i, n = 0, len(ordered)
    while i < n or scheduler.has_work():
        while i < n and ordered[i].arrival <= clock.now:
            scheduler.add(ordered[i])
            i += 1
        if not scheduler.has_work():
            executor.idle_until(ordered[i].arrival)
            continue
        scheduler.step(ordered[i].arrival if i < n else None)
        if on_step is not None:
            on_step(scheduler)


def collect(scheduler: Scheduler, ordered: SequenceABC[Request], clock: ManualClock,
            name: str, cost: CostModel | None = None) -> SimResult:
    """The `SimResult` of a finished `drive`: per-request records, the manager's stats and
    what an infinite cache would have hit.

    ``cost`` prices the recomputed prefill tokens (`recompute_seconds`) in clock seconds: by
    default the executor's own cost model when it is a `CostModelExecutor`, else the default
    `CostModel`."""
    manager = scheduler.manager
    block_size = manager.block_size
    inf_hits = infinite_cache_hits(ordered, block_size)
    if cost is None:
        executor = scheduler.executor
        cost = executor.cost if isinstance(executor, CostModelExecutor) else CostModel()
    inf_by_id = {r.request_id: h for r, h in zip(ordered, inf_hits, strict=True)}
    records = tuple(
        RequestRecord.from_state(s, recompute_prefill_s=recompute_seconds(
            cost, s.prefill_chunks, s.request.prompt_len,
            max(inf_by_id[s.request_id], s.cached_tokens or 0)))
        for s in sorted(scheduler.finished, key=lambda s: s.arrival))
    return SimResult(
        policy=name, capacity_blocks=manager.pool.num_blocks, block_size=block_size,
        records=records, manager_stats=manager.stats.as_dict(),
        preemptions=scheduler.preemptions, steps=scheduler.steps,
        makespan=clock.now - ordered[0].arrival,
        infinite_hit_tokens=sum(inf_hits),
        busy_seconds=scheduler.busy_seconds,
        arrival_span=ordered[-1].arrival - ordered[0].arrival,
        infinite_compute_tokens=sum(max(r.prompt_len - h, 1)  # >= 1: the last token's
                                    for r, h in zip(ordered, inf_hits, strict=True)),  # logits
    )
