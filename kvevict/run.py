"""The run loop beside the scheduler, shared by the simulator and the engine.

"One scheduler, two executors" (`kvevict.scheduler`): the simulator (`kvevict.sim`) and the
built-in engine (`kvevict.engine`) run the same `Scheduler` and differ only in the executor.
What they share sits here, below both, so neither imports the other:

- `drive`: hand each request to the scheduler once the clock reaches its arrival, and step
  until every request is finished;
- `collect`: assemble the finished run into a `SimResult`: per-request records
  (`RequestRecord`), run-level counters and what an infinite cache would have hit
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

__all__ = ["CostModelExecutor", "RequestRecord", "SimResult", "collect", "drive",
           "infinite_cache_hits"]


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
            n = chunk.computed
            if n == 0:  # a fully cached prompt: recompute the last token's logits
                seconds += cost.prefill_seconds(1, max(chunk.end - 1, 0))
            else:
                seconds += cost.prefill_seconds(n, chunk.start)
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
    """What happened to one request (times in seconds of the run's clock)."""

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

    @classmethod
    def from_state(cls, s: RequestState) -> RequestRecord:
        return cls(
            request_id=s.request_id, session_id=s.request.session_id,
            workload_class=s.request.workload_class, arrival=s.arrival,
            prompt_tokens=s.request.prompt_len, output_tokens=s.num_output,
            cached_tokens=s.cached_tokens or 0,
            computed_prefill_tokens=s.computed_prefill_tokens,
            queue_wait=s.queue_wait or 0.0, ttft=s.ttft or 0.0,
            finish=s.finish_time or 0.0, preemptions=s.preemptions, deferrals=s.deferrals,
        )


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


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

    def summary(self) -> dict[str, Any]:
        """The headline numbers (JSON-ready, rounded for stable output)."""
        recs = self.records
        prompt = sum(r.prompt_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        computed = sum(r.computed_prefill_tokens for r in recs)
        compulsory = self.infinite_compute_tokens
        ttft = np.array([r.ttft for r in recs])
        wait = np.array([r.queue_wait for r in recs])
        out_tokens = sum(r.output_tokens for r in recs)
        stats = self.manager_stats
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": len(recs),
            "token_hit_ratio": round(cached / prompt, 6) if prompt else 0.0,
            "block_hit_ratio": round(stats["block_hit_ratio"], 6),
            "infinite_cache_hit_ratio": round(self.infinite_hit_tokens / prompt, 6)
            if prompt else 0.0,
            "prefill_tokens_computed": computed,
            "recomputed_prefill_tokens": max(computed - compulsory, 0),
            "ttft_p50": round(_pct(ttft, 50), 6),
            "ttft_p95": round(_pct(ttft, 95), 6),
            "ttft_p99": round(_pct(ttft, 99), 6),
            "queue_wait_p95": round(_pct(wait, 95), 6),
            "throughput_tokens_per_s": round(out_tokens / self.makespan, 3)
            if self.makespan > 0 else 0.0,
            "requests_per_s": round(len(recs) / self.makespan, 6) if self.makespan > 0
            else 0.0,
            "evictions": stats["evictions"],
            "evictions_by_class": dict(sorted(stats["evictions_by_class"].items())),
            "preemptions": self.preemptions,
            "deferrals": sum(r.deferrals for r in recs),
            "peak_blocks": stats["peak_blocks_used"],
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
            name: str) -> SimResult:
    """The `SimResult` of a finished `drive`: per-request records, the manager's stats and
    what an infinite cache would have hit."""
    manager = scheduler.manager
    block_size = manager.block_size
    inf_hits = infinite_cache_hits(ordered, block_size)
    records = tuple(RequestRecord.from_state(s)
                    for s in sorted(scheduler.finished, key=lambda s: s.arrival))
    return SimResult(
        policy=name, capacity_blocks=manager.pool.num_blocks, block_size=block_size,
        records=records, manager_stats=manager.stats.as_dict(),
        preemptions=scheduler.preemptions, steps=scheduler.steps,
        makespan=clock.now - ordered[0].arrival,
        infinite_hit_tokens=sum(inf_hits),
        infinite_compute_tokens=sum(max(r.prompt_len - h, 1)  # >= 1: the last token's
                                    for r, h in zip(ordered, inf_hits, strict=True)),  # logits
    )
