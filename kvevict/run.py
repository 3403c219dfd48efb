"""The run loop beside the scheduler, shared by the simulator and the engine.

"One scheduler, two executors" (`kvevict.scheduler`): the simulator (`kvevict.sim`) and the
built-in engine (`kvevict.engine`) run the same `Scheduler` and differ only in the executor.
What they share sits here, below both, so neither imports the other:

- `drive`: hand each request to the scheduler once the clock reaches its arrival, and step
  until every request is finished. The requests are consumed lazily, in the order given,
  peeking one ahead (`in_arrival_order`: an arrival earlier than the one before it is a
  `ConfigError` naming both requests);
- `RunCollector`: the sink of a run. It sees each request as it is handed to the scheduler
  (what an infinite cache would hit, `InfiniteCache`) and each as it finishes (the
  scheduler's ``on_finish`` hook), and keeps only what the summary needs: per request the
  arrival and the time to the first token in its parts, in `RunColumns` (compact arrays),
  per workload class running sums of the counters; or, when asked for, a full
  `RequestRecord` per request. `RunCollector.result` makes the `SimResult`;
- `collect`: the same `SimResult` from a scheduler that kept its finished requests
  (``Scheduler.finished``) and the list of requests it ran (the engine's run);
- `CostModelExecutor`: the executor that charges each step what a `CostModel` says it costs
  (the simulator runs on it; the engine prices its measured steps with it).

**Memory.** A streamed run holds the cache (the pool, the prefix tree, the policy: in
proportion to the capacity), the requests in flight (waiting or running), and per finished
request 60 bytes of `RunColumns` (seven float64 times and a 4-byte class code), plus what
the infinite cache has seen: one bit per distinct block id for the dense non-negative int
ids of the Mooncake and Alibaba traces (`InfiniteCache`). A cache that never evicts must
remember every block it was ever given; that set is inherent to the infinite-cache
baseline, not to the run. With ``records=True`` (`RunCollector`, `kvevict.sim.simulate`) a
`RequestRecord` per request is kept as well.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any, ClassVar

import attrs
import numpy as np

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.hashing import block_hashes, request_hashes
from kvevict.manager import KVCacheManager
from kvevict.scheduler import Executor, RequestState, Scheduler, StepOutput, StepPlan
from kvevict.types import BlockInfo, ManualClock, Request

__all__ = ["CostModelExecutor", "InfiniteCache", "Link", "RequestRecord", "RunCollector",
           "RunColumns", "SessionGate", "SimResult", "TierTransfers", "check_closed_loop",
           "chunk_seconds", "collect", "drive", "in_arrival_order", "infinite_cache_hits",
           "recompute_seconds", "tier_summary"]


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
        #: the work of the steps run, priced per sequence as `kvevict.load.offered_load`
        #: prices it: prefill seconds, decode seconds without each step's shared part
        #: (``decode_step_s``), and decode tokens (`RunCollector.result`'s measured load)
        self.prefill_work = 0.0
        self.decode_work = 0.0
        self.decode_tokens = 0

    def step_parts(self, plan: StepPlan) -> tuple[float, float]:
        """What ``plan`` costs: its prefill chunks' seconds and its decode step's."""
        cost = self.cost
        prefill = 0.0
        for chunk in plan.prefills:
            prefill += chunk_seconds(cost, chunk.start, chunk.end, chunk.computed)
        decode = cost.decode_batch_seconds(
            [s.seq.num_tokens for s in plan.decodes]) if plan.decodes else 0.0  # type: ignore[union-attr]
        return prefill, decode

    def step_seconds(self, plan: StepPlan) -> float:
        prefill, decode = self.step_parts(plan)
        return prefill + decode

    @property
    def work_meter(self) -> CostModelExecutor:
        """Itself: it prices every step it runs."""
        return self

    def execute(self, plan: StepPlan, manager: KVCacheManager) -> StepOutput:
        prefill, decode = self.step_parts(plan)
        self.prefill_work += prefill
        if plan.decodes:
            self.decode_work += max(decode - self.cost.decode_step_s, 0.0)
            self.decode_tokens += len(plan.decodes)
        seconds = prefill + decode
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
        reload_s: seconds admitted but waiting for KV reloaded from a lower tier to cross
            its link (`TierTransfers`; queued behind other transfers on a shared link); 0
            without tiers.
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
            recompute_prefill_s=recompute_prefill_s, reload_s=s.reload_time,
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

#: the times `RunColumns` keeps per request (`RequestRecord` fields; ``queue_wait`` is
#: ``wait_memory + wait_compute``, added up again when the summary needs it)
TIME_COLUMNS = ("ttft", "wait_memory", "wait_compute", "prefill_s", "recompute_prefill_s",
                "reload_s")
#: the counters `RunColumns` sums per workload class (`RequestRecord` fields)
COUNTERS = ("prompt_tokens", "cached_tokens", "computed_prefill_tokens", "output_tokens",
            "preemptions", "deferrals", "prompt_blocks", "cached_blocks", "resume_lookups",
            "resume_hit_blocks")


def _times(columns: dict[str, np.ndarray]) -> dict[str, float]:
    """p50/p95/p99 and mean of the TTFT and each of its parts (``ttft_p95``,
    ``wait_memory_mean``...) over ``columns`` (`TIME_COLUMNS` -> values, in arrival order);
    the means add up as the records do, the percentiles do not."""
    out: dict[str, float] = {}
    for key, field in _TIMES:
        if field == "queue_wait":
            values = columns["wait_memory"] + columns["wait_compute"]
        else:
            values = columns[field]
        for q in (50, 95, 99):
            out[f"{key}_p{q}"] = round(_pct(values, q), 6)
        out[f"{key}_mean"] = round(float(values.mean()), 6) if len(values) else 0.0
    return out


def _ratio(num: int, den: int) -> float:
    return round(num / den, 6) if den else 0.0


class RunColumns:
    """What a run's summary needs of its finished requests, without a record per request.

    Per request, in the order they finished: the arrival and the `TIME_COLUMNS` (float64
    arrays, ``array('d')``) and the workload class (a code into ``classes``, ``array('I')``):
    60 bytes a request, so the summary's percentiles and means are exact. Per workload
    class: the request count and the sum of each of `COUNTERS` (Python ints). The summary
    (`summarize`) puts the requests in arrival order first (a stable sort: ties in the order
    they finished), the order of `SimResult.records`, so every number equals the one the
    records give.
    """

    def __init__(self) -> None:
        self.arrival = array("d")
        self.times = {name: array("d") for name in TIME_COLUMNS}
        self.class_code = array("I")
        #: workload class -> its code, in order of first appearance
        self.classes: dict[str, int] = {}
        #: per class code: requests, then one sum per `COUNTERS` entry
        self.sums: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.arrival)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunColumns):
            return NotImplemented
        return (self.arrival == other.arrival and self.times == other.times
                and self.class_code == other.class_code and self.classes == other.classes
                and self.sums == other.sums)

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        """Bytes of the per-request arrays (their used length; `array` over-allocates by up
        to about 1/8 as it grows)."""
        arrays = [self.arrival, self.class_code, *self.times.values()]
        return sum(len(a) * a.itemsize for a in arrays)

    def add(self, record: RequestRecord) -> None:
        """Add one finished request (its fields as `RequestRecord` has them)."""
        code = self.classes.get(record.workload_class)
        if code is None:
            code = self.classes[record.workload_class] = len(self.classes)
            self.sums.append([0] * (1 + len(COUNTERS)))
        self.arrival.append(record.arrival)
        for name, column in self.times.items():
            column.append(getattr(record, name))
        self.class_code.append(code)
        sums = self.sums[code]
        sums[0] += 1
        for i, name in enumerate(COUNTERS, start=1):
            sums[i] += getattr(record, name)

    @classmethod
    def from_records(cls, records: Iterable[RequestRecord]) -> RunColumns:
        """The columns of ``records``."""
        out = cls()
        for r in records:
            out.add(r)
        return out

    def _order(self) -> np.ndarray:
        """The permutation that puts the requests in arrival order (stable)."""
        return np.argsort(np.frombuffer(self.arrival, dtype=np.float64), kind="stable")

    def in_arrival_order(self, name: str) -> np.ndarray:
        """The `TIME_COLUMNS` column ``name`` (or ``"arrival"``), in arrival order."""
        column = self.arrival if name == "arrival" else self.times[name]
        return np.frombuffer(column, dtype=np.float64)[self._order()]

    def summarize(self) -> tuple[dict[str, int], dict[str, float], dict[str, dict[str, Any]]]:
        """``(totals, times, classes)``: ``totals`` the request count (``"requests"``) and
        each of `COUNTERS` summed over every request; ``times`` as `SimResult.summary` gives
        them (``ttft_p95``...); ``classes`` the summary of each workload class (sorted by
        name): requests, hit ratios (first admissions), preemptions, deferrals and times."""
        order = self._order()
        columns = {name: np.frombuffer(col, dtype=np.float64)[order]
                   for name, col in self.times.items()}
        codes = np.frombuffer(self.class_code, dtype=np.uint32)[order]
        totals = {"requests": 0, **dict.fromkeys(COUNTERS, 0)}
        keys = ("requests", *COUNTERS)
        for sums in self.sums:
            for key, value in zip(keys, sums, strict=True):
                totals[key] += value
        classes: dict[str, dict[str, Any]] = {}
        for name in sorted(self.classes):
            code = self.classes[name]
            c = dict(zip(keys, self.sums[code], strict=True))
            mask = codes == code
            classes[name] = {
                "requests": c["requests"],
                "token_hit_ratio": _ratio(c["cached_tokens"], c["prompt_tokens"]),
                "block_hit_ratio": _ratio(c["cached_blocks"], c["prompt_blocks"]),
                "preemptions": c["preemptions"],
                "deferrals": c["deferrals"],
                **_times({k: v[mask] for k, v in columns.items()}),
            }
        return totals, _times(columns), classes


@attrs.frozen
class SimResult:
    """Run-level counters of one simulation, and its finished requests: a `RequestRecord`
    each (``records``, when the run kept them) or their `RunColumns` (``columns``)."""

    policy: str
    capacity_blocks: int
    block_size: int
    #: per request in arrival order, when the run kept records (else None)
    records: tuple[RequestRecord, ...] | None
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
    #: the work of the steps run with each decode step's shared part priced at
    #: ``limit_batch`` sequences (`RunCollector.result`; an engine run's is rescaled to its
    #: measured speed); None when nothing priced the steps (an engine run without a cost
    #: model)
    load_seconds: float | None = None
    #: the mean decode batch of the steps run at the box's limit (`Scheduler.limit_steps`),
    #: or ``max_num_seqs`` when the run never reached it
    limit_batch: float | None = None
    #: the summary's columns of a run that kept no records (None when it kept them)
    columns: RunColumns | None = attrs.field(default=None, eq=False)
    #: a cache with memory tiers: what moved between them and how busy each link was
    #: (`tier_summary`); None without tiers
    tiers: dict[str, Any] | None = None
    #: requests a `SessionGate` sent later than their trace arrival, because the answer they
    #: follow was not there yet (0 in an open-loop run)
    held_requests: int = 0

    def __attrs_post_init__(self) -> None:
        if self.records is None and self.columns is None:
            raise ConfigError("a SimResult needs its records or its columns (RunColumns)")

    def request_columns(self) -> RunColumns:
        """The summary's view of the finished requests: ``columns``, or those of
        ``records`` when the run kept them (the records are then the source of truth, so a
        result whose records were rescaled, as the engine's are, sums up rescaled)."""
        if self.records is not None:
            return RunColumns.from_records(self.records)
        assert self.columns is not None
        return self.columns

    def ttfts(self) -> np.ndarray:
        """Every request's time to the first token, in arrival order (float64)."""
        if self.records is not None:
            return np.array([r.ttft for r in self.records], dtype=np.float64)
        assert self.columns is not None
        return self.columns.in_arrival_order("ttft")

    def measured_load(self, requests: int) -> float:
        """The load this run put on the box: its work per second of arrivals, as
        `kvevict.load.offered_load` prices ρ (``(requests - 1) / arrival_span`` requests a
        second times the mean work), but with this policy's own prefill (its misses,
        recomputation after preemption, a chunk's overhead each) and each decode step's shared
        part priced at the batch the box ran when it was full (`limit_batch`), not at
        ``max_num_seqs`` when memory held the batch below it. At >= 1 the box could not keep
        up: the queue grew through the run. An infinite pool that never reaches its limit
        gives ρ (tested). Without ``load_seconds`` (an engine run without a cost model), the
        busy seconds per second of arrivals."""
        if self.load_seconds is None or requests < 1 or self.arrival_span <= 0:
            return self.busy_load
        return round(self.load_seconds * (requests - 1) / requests / self.arrival_span, 6)

    @property
    def busy_load(self) -> float:
        """Busy seconds per second of arrivals (0 without an arrival span): about 1 whenever
        something always runs, at any load (a decode step costs about the same at any batch),
        so not a load."""
        return round(self.busy_seconds / self.arrival_span, 6) if self.arrival_span > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The headline numbers (JSON-ready, rounded for stable output).

        Hit ratios count each request's first admission only: ``token_hit_ratio`` is cached
        over prompt tokens, ``block_hit_ratio`` cached over looked-up prompt blocks (the
        manager's lookups of the first admissions); lookups of preempted requests resuming
        are counted apart (``resume_lookups``, ``resume_hit_blocks``,
        ``resume_block_hit_ratio``). Times: p50/p95/p99 and mean of the TTFT and its parts
        (`RequestRecord`), overall and per workload class (``classes``). A run with memory
        tiers adds ``tiers`` (`tier_summary`). docs/columns.md defines every key.
        """
        totals, times, classes = self.request_columns().summarize()
        prompt = totals["prompt_tokens"]
        computed = totals["computed_prefill_tokens"]
        compulsory = self.infinite_compute_tokens
        out_tokens = totals["output_tokens"]
        n = totals["requests"]
        stats = self.manager_stats
        resume_lookups = totals["resume_lookups"]
        resume_hits = totals["resume_hit_blocks"]
        out: dict[str, Any] = {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": n,
            "token_hit_ratio": _ratio(totals["cached_tokens"], prompt),
            "block_hit_ratio": _ratio(totals["cached_blocks"], totals["prompt_blocks"]),
            "infinite_cache_hit_ratio": _ratio(self.infinite_hit_tokens, prompt),
            "prefill_tokens_computed": computed,
            "recomputed_prefill_tokens": max(computed - compulsory, 0),
            "ttft_p50": times["ttft_p50"],
            "ttft_p95": times["ttft_p95"],
            "ttft_p99": times["ttft_p99"],
            "queue_wait_p95": times["queue_wait_p95"],
            "throughput_tokens_per_s": round(out_tokens / self.makespan, 3)
            if self.makespan > 0 else 0.0,
            "requests_per_s": round(n / self.makespan, 6) if self.makespan > 0
            else 0.0,
            "measured_load": self.measured_load(n),
            "busy_load": self.busy_load,
            "limit_batch": None if self.limit_batch is None else round(self.limit_batch, 3),
            "evictions": stats["evictions"],
            "evictions_by_class": dict(sorted(stats["evictions_by_class"].items())),
            "preemptions": self.preemptions,
            "deferrals": totals["deferrals"],
            "held_requests": self.held_requests,
            "peak_blocks": stats["peak_blocks_used"],
            "resume_lookups": resume_lookups,
            "resume_hit_blocks": resume_hits,
            # undefined (None) when no request resumed: a ratio of nothing is not 0
            "resume_block_hit_ratio": _ratio(resume_hits, resume_lookups) if resume_lookups
            else None,
        }
        out.update(times)
        out["classes"] = classes
        if self.tiers is not None:
            out["tiers"] = self.tiers
        return out


# -- memory tiers: the links a reload crosses ------------------------------------------------


class Link:
    """One direction of the link from a memory tier to the tier above it (its
    `kvevict.tiers.TierProfile`), shared by every request: a transfer issued at ``start``
    begins when the link is free (``busy_until``) and lasts ``profile.transfer_seconds``
    (one latency, the bytes at the link's read bandwidth). Transfers are served one at a
    time in the order they are issued, so none gets bandwidth another is using."""

    def __init__(self, name: str, profile: Any) -> None:
        self.name = name
        self.profile = profile
        self.busy_until = -math.inf
        self.busy_seconds = 0.0  #: seconds the link moved data
        self.queued_seconds = 0.0  #: seconds transfers waited for the link, summed
        self.transfers = 0
        self.blocks = 0

    def transfer(self, start: float, blocks: int, nbytes: int) -> float:
        """Queue ``blocks`` blocks of ``nbytes`` each, ready to move at ``start``; return
        when they have crossed."""
        begin = max(start, self.busy_until)
        seconds = self.profile.transfer_seconds(nbytes, blocks)
        self.busy_until = begin + seconds
        self.busy_seconds += seconds
        self.queued_seconds += begin - start
        self.transfers += 1
        self.blocks += blocks
        return self.busy_until

    def as_dict(self, span: float) -> dict[str, Any]:
        return {"busy_s": round(self.busy_seconds, 6),
                "utilization": round(self.busy_seconds / span, 6) if span > 0 else 0.0,
                "queued_s": round(self.queued_seconds, 6), "transfers": self.transfers,
                "blocks": self.blocks}


class TierTransfers:
    """The reloads of a cache with memory tiers (a manager with a `kvevict.tiers.TierStack`)
    on the links between the tiers, in virtual time: the ``transfers`` of a `Scheduler`.

    Each tier ``k`` has one `Link` (its profile's read direction, to tier ``k - 1``). A block
    reloaded from tier ``k`` crosses tier ``k``'s link, then every link above it (a direct
    link, GPUDirect, goes straight to the device), the blocks of one tier in one transfer
    per link. When a request is admitted, the manager has already moved the records
    (`kvevict.tiers.TierStack.load`); `admitted` queues the bytes on the links and returns
    when the last of them arrives, and the scheduler holds the request until then
    (``reload_time``).

    **Prefetch** (``prefetch=True``; CachedAttention, Gao et al., USENIX ATC'24:
    a request's KV starts loading while it waits in the queue): when a request arrives, the
    lower-tier continuation of its cached prefix (as a lookup then finds it) is queued on
    the links at once, into a staging buffer. At admission a reloaded block that was
    prefetched is ready when its prefetch ended; the others are queued then. The staging
    buffer is not charged to the pool (``peak_staged_blocks`` says how large it grew), so
    what prefetch buys here is an upper bound; a prefetched block that a tier drops before
    the admission is recomputed (the staged copy is not used), and one prefetched for two
    waiting requests crosses the link once.

    **A block on its way is not there yet.** A reloaded block is in the pool from its
    admission on, so another request can hit it while it still crosses the link: that
    request waits for it too (`admitted` keeps each reloaded block's arrival time until it
    has passed). `will_wait` says, before an admission, whether the request will wait, so
    that the scheduler allocates its uncached rest only once the load is in (`Scheduler`:
    no block is in the cache before a step computes it).

    Demotions (writes down the tiers) are not queued: CachedAttention saves asynchronously,
    off the critical path, and a PCIe link moves both directions at once. Their load on each
    tier's write bandwidth is reported (`tier_summary`: ``write_utilization``); above 1 the
    writes could not have kept up.
    """

    def __init__(self, manager: KVCacheManager, *, prefetch: bool = False) -> None:
        stack = manager.tiers
        if stack is None:
            raise ConfigError("TierTransfers needs a manager with tiers (KVCacheManager(..., "
                              "tiers=TierStack(...)))")
        if not isinstance(prefetch, bool):
            raise ConfigError(f"prefetch must be True or False, got {prefetch!r}")
        self.manager = manager
        self.stack = stack
        self.prefetch = prefetch
        self.links = [Link(t.name, t.profile) for t in stack.tiers]
        self.nbytes = stack.bytes_per_block
        self.reloaded_blocks = 0  #: blocks reloaded at admissions (begin and resume)
        self.prefetched_blocks = 0  #: blocks put on the links by prefetches
        self.prefetch_used = 0  #: reloaded blocks a prefetch had staged
        self.peak_staged_blocks = 0
        #: hash -> [ready time, waiting requests, the tier its prefetch read it from]
        self._staged: dict[Any, list[Any]] = {}
        self._prefetched: dict[RequestState, list[Any]] = {}  # request -> its staged hashes
        #: hash -> when the reloaded block arrives, kept until swept (when the table has
        #: doubled) once that time has passed
        self.landing: dict[Any, float] = {}
        self._sweep_at = 1024
        #: a waiting request's prompt hashes, from its first lookup to its admission
        #: (a head blocked for memory is looked up on every pass)
        self._hashes: dict[RequestState, Any] = {}

    def load(self, counts: SequenceABC[int], start: float) -> list[float]:
        """Queue ``counts[k - 1]`` blocks from each tier ``k`` at ``start``; the time each
        tier's blocks arrive at the device (``start`` for a tier with none)."""
        links, tiers, nbytes = self.links, self.stack.tiers, self.nbytes
        ends = []
        for k, n in enumerate(counts, start=1):
            t = start
            j = k
            while n and j >= 1:
                t = links[j - 1].transfer(t, n, nbytes)
                if tiers[j - 1].profile.direct:
                    break
                j -= 1
            ends.append(t)
        return ends

    def _lookup(self, state: RequestState) -> tuple[Any, list[BlockInfo], list[BlockInfo]]:
        """What an admission of ``state`` now would find, without side effects: its chain's
        hashes, the pool's cached prefix of them, and the lower tiers' continuation."""
        manager = self.manager
        request = state.request
        if state.status == "preempted":  # resumes look up every known token's chain
            hashes = manager.sequence(state.request_id).hashes
        elif manager.uncacheable is not None and manager.uncacheable(request):
            return (), [], []
        else:
            hashes = self._hashes.get(state)
            if hashes is None:
                hashes = self._hashes[state] = request_hashes(
                    request, manager.block_size, manager.extra_key)
        hit = manager.tree.longest_prefix(hashes)
        return hashes, hit, self.stack.match(hashes, len(hit))

    def will_wait(self, state: RequestState, now: float) -> bool:
        """Whether ``state``, admitted at ``now``, would wait for KV on a link: blocks it
        reloads (not already staged and arrived) or cached blocks still arriving."""
        _, hit, lower = self._lookup(state)
        staged = self._staged
        for block in lower:
            entry = staged.get(block.block_hash)
            if entry is None or entry[0] > now:
                return True
        landing = self.landing
        return bool(landing) and any(landing.get(b.block_hash, now) > now for b in hit)

    def arrived(self, state: RequestState) -> None:
        """``state`` was queued: with prefetch on, start loading its lower-tier prefix."""
        if not self.prefetch:
            return
        _, _, lower = self._lookup(state)
        if not lower:
            return
        staged = self._staged
        counts = [0] * len(self.links)
        new: list[tuple[Any, int]] = []
        for block in lower:
            entry = staged.get(block.block_hash)
            if entry is None:
                k = self.stack.tier_index(block)
                counts[k - 1] += 1
                new.append((block.block_hash, k))
        ends = self.load(counts, state.arrival)
        for h, k in new:
            staged[h] = [ends[k - 1], 0, k]
        mine = [b.block_hash for b in lower]
        for h in mine:
            staged[h][1] += 1
        self._prefetched[state] = mine
        self.prefetched_blocks += len(new)
        if len(staged) > self.peak_staged_blocks:
            self.peak_staged_blocks = len(staged)

    def admitted(self, state: RequestState, seq: Any, pool_hits: int, now: float) -> float:
        """``state`` was admitted at ``now`` (``seq``, the manager's `Sequence`, found
        ``pool_hits`` blocks in the pool and reloaded ``seq.reloaded`` from the tiers, in
        chain order right after them): queue what no prefetch staged; return when the last
        reloaded block has arrived."""
        self._hashes.pop(state, None)
        staged = self._staged
        landing = self.landing
        ready = now
        if landing:  # cached blocks another request's reload is still bringing in
            for h in seq.hashes[:pool_hits]:
                t = landing.get(h)
                if t is not None and t > ready:
                    ready = t
        counts = seq.reloaded
        total = sum(counts)
        if total:
            hashes = seq.hashes[pool_hits:pool_hits + total]
            need = [0] * len(self.links)
            queued: list[tuple[Any, int]] = []
            moved: dict[tuple[int, int], int] = {}
            i = 0
            for k, n in enumerate(counts, start=1):
                for h in hashes[i:i + n]:
                    entry = staged.pop(h, None) if staged else None
                    if entry is None:
                        need[k - 1] += 1
                        queued.append((h, k))
                    else:  # staged by a prefetch: it is ready when that ends
                        self.prefetch_used += 1
                        landing[h] = entry[0]
                        ready = max(ready, entry[0])
                        if entry[2] != k:  # read from a tier it has left since
                            moved[k, entry[2]] = moved.get((k, entry[2]), 0) + 1
                i += n
            if moved:
                self.stack.served_by_staged(moved)
            if queued:
                ends = self.load(need, now)
                for h, k in queued:
                    landing[h] = ends[k - 1]
                ready = max(ready, *ends)
            self.reloaded_blocks += total
            if len(landing) >= self._sweep_at:
                self.landing = {h: t for h, t in landing.items() if t > now}
                self._sweep_at = max(1024, 2 * len(self.landing))
        mine = self._prefetched.pop(state, None)
        if mine:
            for h in mine:
                entry = staged.get(h)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del staged[h]
        return ready


def tier_summary(manager: KVCacheManager, transfers: TierTransfers | None,
                 span: float) -> dict[str, Any]:
    """What a run with memory tiers moved (``span``: its makespan, for the links'
    utilization): each tier's name, size, policy and link; the blocks served by each tier
    (``hit_blocks``: the device's own hits and every tier's reloads, all admissions);
    ``kvevict.tiers.TierStats`` (demotions, drops by reason, bytes read and written); the
    load of each tier's write bandwidth (``write_utilization``: the bytes demoted into it
    over its write bandwidth, over the span); and with ``transfers`` each read link's busy
    time, utilization and queueing (``links``) and the prefetch counters."""
    stack = manager.tiers
    assert stack is not None
    stats = stack.stats
    write = {}
    for tier in stack.tiers:
        busy = stats.bytes_written.get(tier.name, 0) / tier.profile.write_bytes_per_s
        write[tier.name] = round(busy / span, 6) if span > 0 else 0.0
    out: dict[str, Any] = {
        "tiers": [{"name": t.name, "capacity_blocks": t.capacity_blocks,
                   "policy": t.policy.name if t.policy is not None else None,
                   "profile": t.profile.name,
                   "read_bytes_per_s": t.profile.read_bytes_per_s,
                   "latency_s": t.profile.latency_s} for t in stack.tiers],
        "bytes_per_block": stack.bytes_per_block,
        "demote": stack.demote_rule,
        "hit_blocks": stack.hits_by_tier(manager.stats.block_hits),
        "reloads": stats.reloads,
        "demotions": dict(sorted(stats.demotions.items())),
        "drops": dict(sorted(stats.drops.items())),
        "bytes_read": dict(sorted(stats.bytes_read.items())),
        "bytes_written": dict(sorted(stats.bytes_written.items())),
        "write_utilization": write,
    }
    if transfers is not None:
        out["links"] = {link.name: link.as_dict(span) for link in transfers.links}
        out["prefetch"] = {"enabled": transfers.prefetch,
                           "blocks": transfers.prefetched_blocks,
                           "used": transfers.prefetch_used,
                           "peak_staged_blocks": transfers.peak_staged_blocks}
    return out


# -- the infinite cache --------------------------------------------------------------------


class _HashSet:
    """A set of block ids, compact for dense non-negative ints.

    Ints below a bound live in a bitset, in pages of ``2**16`` bits (8 KiB ``bytearray``),
    allocated on first use; every other id (larger ints, the 128-bit hashes of token-mode
    requests, other hashables) in a Python set. The bound starts at ``2**20`` and doubles
    whenever it falls below 8 times the number of members (as `kvevict.workloads.IdTable`
    grows), and the set members it then covers move into pages. So the dense ids of the
    Mooncake and Alibaba traces cost one bit each, ids however sparse at most 2 bytes each
    in pages, and anything else what a Python set costs (about 60 to 100 bytes a member).
    Integral ids are compared by value (numpy ints as Python ints), as a set compares them.
    """

    PAGE_BITS = 16

    def __init__(self) -> None:
        self.bound = 1 << 20
        self.pages: list[bytearray | None] = [None] * (self.bound >> self.PAGE_BITS)
        self.other: set[Any] = set()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes of the pages and their list, plus an estimate of the set's (100 a member)."""
        pages = sum(1 for p in self.pages if p is not None)
        return pages * (1 << (self.PAGE_BITS - 3)) + 8 * len(self.pages) + 100 * len(self.other)

    def _key(self, h: Any) -> Any:
        if type(h) is not int and isinstance(h, (int, np.integer)):
            return int(h)
        return h

    def __contains__(self, h: Any) -> bool:
        h = self._key(h)
        if type(h) is int and 0 <= h < self.bound:
            page = self.pages[h >> self.PAGE_BITS]
            if page is None:
                return False
            slot = h & ((1 << self.PAGE_BITS) - 1)
            return bool(page[slot >> 3] >> (slot & 7) & 1)
        return h in self.other

    def add(self, h: Any) -> None:
        h = self._key(h)
        if type(h) is int and 0 <= h < self.bound:
            bits = self.PAGE_BITS
            page = self.pages[h >> bits]
            if page is None:
                page = self.pages[h >> bits] = bytearray(1 << (bits - 3))
            slot = h & ((1 << bits) - 1)
            bit = 1 << (slot & 7)
            if page[slot >> 3] & bit:
                return
            page[slot >> 3] |= bit
        else:
            if h in self.other:
                return
            self.other.add(h)
        self.size += 1
        if 8 * self.size > self.bound:
            self._grow()

    def prefix(self, ids: SequenceABC[Any], limit: int) -> int:
        """How many of the first ``limit`` of ``ids`` are members, counting from the first
        and stopping at the first that is not."""
        bits = self.PAGE_BITS
        mask = (1 << bits) - 1
        pages, bound = self.pages, self.bound
        n = 0
        while n < limit:
            h = ids[n]
            if type(h) is int and 0 <= h < bound:
                page = pages[h >> bits]
                if page is None:
                    break
                slot = h & mask
                if not page[slot >> 3] >> (slot & 7) & 1:
                    break
            elif h not in self:
                break
            n += 1
        return n

    def update(self, ids: Iterable[Any]) -> None:
        """Add every one of ``ids``."""
        bits = self.PAGE_BITS
        mask = (1 << bits) - 1
        for h in ids:
            if type(h) is int and 0 <= h < self.bound:
                pages = self.pages
                page = pages[h >> bits]
                if page is None:
                    page = pages[h >> bits] = bytearray(1 << (bits - 3))
                slot = h & mask
                bit = 1 << (slot & 7)
                if page[slot >> 3] & bit:
                    continue
                page[slot >> 3] |= bit
                self.size += 1
                if 8 * self.size > self.bound:
                    self._grow()
            else:
                self.add(h)

    def _grow(self) -> None:
        while 8 * self.size > self.bound:
            self.bound *= 2
        self.pages.extend([None] * ((self.bound >> self.PAGE_BITS) - len(self.pages)))
        moving = [h for h in self.other if type(h) is int and 0 <= h < self.bound]
        for h in moving:
            self.other.discard(h)
            self.size -= 1
            self.add(h)


def _request_hashes(request: Request, block_size: int, with_output: bool) -> list[Any]:
    if request.block_hashes is not None:
        return list(request.block_hashes)
    tokens = request.tokens
    if with_output and request.output_tokens is not None:
        # decode feeds back every sampled token but the last, so only those get cached
        tokens = np.concatenate([tokens, request.output_tokens[:request.output_len - 1]])
    return block_hashes(tokens, block_size)


class InfiniteCache:
    """A cache that never evicts, fed requests one at a time in arrival order: what each
    would hit (its longest prefix of blocks seen before, as the manager's lookup counts it).

    ``cache_output=True`` (the timed run's): a request's own answer is cached for the next
    turn, as decode caches it (every sampled token but the last). ``cache_output=False``
    (the untimed replay's, `kvevict.replay`): only prompts are cached.

    It remembers every block id it was given (`_HashSet`: one bit per dense int id). That is
    inherent to an infinite cache: it is the set of everything ever cached.
    """

    def __init__(self, block_size: int, *, cache_output: bool = True) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.cache_output = cache_output
        self.seen = _HashSet()

    def lookup(self, request: Request) -> tuple[int, int]:
        """``(hit blocks, prompt blocks looked up)`` of ``request``, which is then cached."""
        bs = self.block_size
        cached = _request_hashes(request, bs, with_output=self.cache_output)
        if request.block_hashes is not None:
            prompt = len(cached)
        else:  # the first full blocks of prompt + output are the prompt's own
            prompt = request.prompt_len // bs
        n = self.seen.prefix(cached, prompt)
        self.seen.update(cached)
        return n, prompt

    def hit_tokens(self, request: Request) -> int:
        """Prompt tokens ``request`` hits (its hit blocks' tokens, at most the prompt);
        then it is cached."""
        n, _ = self.lookup(request)
        return min(n * self.block_size, request.prompt_len)


def infinite_cache_hits(requests: Iterable[Request], block_size: int) -> list[int]:
    """Prompt tokens an infinite cache would hit, per request in arrival order (a request's
    own answer is cached for the next turn, as decode caches it): `InfiniteCache` over the
    requests sorted by arrival."""
    cache = InfiniteCache(block_size)
    return [cache.hit_tokens(r) for r in sorted(requests, key=lambda r: r.arrival)]


# -- the run loop --------------------------------------------------------------------------


def in_arrival_order(requests: Iterable[Request]) -> Iterator[Request]:
    """``requests`` as given, one at a time, checked: each a `Request`, arriving no earlier
    than the one before it (else `ConfigError` naming both requests and their times)."""
    prev: Request | None = None
    for r in requests:
        if not isinstance(r, Request):
            raise ConfigError(f"requests must be Request objects, got {type(r).__name__}")
        if prev is not None and r.arrival < prev.arrival:
            raise ConfigError(
                f"request {r.request_id!r} arrives at {r.arrival!r} s, before request "
                f"{prev.request_id!r} (the one given before it) at {prev.arrival!r} s: the "
                "requests are streamed in the order given and must come in arrival order "
                "(sort a list by arrival; sort a trace file by arrival once, see "
                "docs/simulate.md, \"Trace scale\")")
        prev = r
        yield r


class SessionGate:
    """Closed-loop sessions for `drive`: a request is not sent before the answer it follows.

    A generated trace schedules a session's next request at its parent's arrival plus an
    *estimate* of the answer time plus the user's think time or the tool's pause
    (`kvevict.workloads.generators`). When the box is slower than the estimate, for instance
    behind a queue, that request would arrive before the answer it carries exists: a
    physically impossible run, which recomputes the answer's tokens and feeds the queue with
    requests no client could have sent. A multi-turn client waits for the answer (vLLM's
    ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` sends a conversation's next turn
    after its response), and so does this gate. A request's parent is ``extra["parent"]``
    (None for a first turn); a sent-late request is the same `Request` with the later
    ``arrival``, so its TTFT counts from when it was sent. Two kinds of trace carry links:

    - **Sessions with pauses** (the generators': every request says whether it is its
      session's last, ``extra["last"]``). A request whose parent is the previous request of
      its session (``session_id``) is sent at ``max(arrival, parent's finish + pause)``,
      where ``pause`` is ``extra["pause"]`` (the think time or tool pause after the answer;
      0 if absent). Memory: the latest request of each session that another may follow,
      until the next one arrives.
    - **Links without pauses** (a real trace's, such as Alibaba's ``parent_chat_id``: no
      ``extra["last"]``). The trace records when each request was sent, not how long its
      client thought, so no pause is assumed: a request is sent at ``max(arrival, parent's
      finish)``, never before the answer it follows. A parent may have several followers (a
      regenerated answer). Memory: the requests in flight, not the conversations: a finished
      request is forgotten once the arrivals up to its finish have all been handed in (no
      later arrival can precede its answer), swept when the table has doubled.

    A request that arrives after its parent's finish (plus its pause) is sent at its own
    arrival, so a trace the box keeps up with runs unchanged. Requests without a link, or
    whose parent is not in the gate's memory (it arrived before the trace's window, or ran
    long enough ago), pass unchanged.
    """

    #: the pause-free table is swept when it reaches ``max(SWEEP_MIN, SWEEP_GROWTH x`` the
    #: requests the last sweep kept``)``: amortized O(1) per request, and at most about
    #: twice the requests in flight
    SWEEP_MIN: ClassVar[int] = 1024
    SWEEP_GROWTH: ClassVar[float] = 2.0

    def __init__(self) -> None:
        #: session id -> (request id, its state once added, else None): a session's latest
        #: request while another may follow it (not marked ``extra["last"]``)
        self.latest: dict[Any, tuple[Any, RequestState | None]] = {}
        #: request id -> its state once added, else None: requests of pause-free links that
        #: have not finished, or finished too recently to forget
        self.linked: dict[Any, RequestState | None] = {}
        self.sweep_at: float = self.SWEEP_MIN  # sweep `linked` when it reaches this size
        self.handed = -math.inf  # every arrival up to this time has been handed in
        self.waiting: dict[Any, list[Request]] = {}  # parent id -> requests held behind it
        self.watched: list[RequestState] = []  # added parents that requests wait for
        self.due: list[tuple[float, int, Request]] = []  # heap: (send time, order, request)
        self.order = 0
        self.held = 0  # requests sent later than their arrival

    def arrive(self, request: Request) -> bool:
        """``request`` has reached its arrival: True when the gate holds it (it is sent later
        by `pop_due`), False when it is sent now."""
        extra = request.extra
        if "parent" not in extra:  # a trace without links
            return False
        parent = extra["parent"]
        if "last" not in extra:  # a link without pauses
            self.linked[request.request_id] = None
            if parent is None or parent not in self.linked:
                return False
            return self._wait(request, parent, self.linked[parent])
        sid = request.session_id
        if sid is None:
            return False
        prev = self.latest.pop(sid, None)
        if not extra["last"]:
            self.latest[sid] = (request.request_id, None)
        if parent is None or prev is None or prev[0] != parent:
            return False
        return self._wait(request, parent, prev[1])

    def _wait(self, request: Request, parent: Any, state: RequestState | None) -> bool:
        """Hold ``request`` behind ``parent`` (``state``: None while it is not added yet)
        until it finishes; once it has, `_send`."""
        if state is None or state.finish_time is None:  # not added yet, or in flight
            behind = self.waiting.setdefault(parent, [])
            behind.append(request)
            if state is not None and len(behind) == 1:
                self.watched.append(state)
            return True
        return self._send(request, state.finish_time)

    def _send(self, request: Request, finished: float) -> bool:
        """Hold ``request`` until ``finished`` plus its pause, unless that is not after its
        own arrival (then False: it is sent as it is)."""
        at = finished + float(request.extra.get("pause") or 0.0)
        if at <= request.arrival:
            return False
        self._due(at, attrs.evolve(request, arrival=at))
        self.held += 1
        return True

    def _due(self, at: float, request: Request) -> None:
        heapq.heappush(self.due, (at, self.order, request))
        self.order += 1

    def add(self, state: RequestState) -> None:
        """``state``'s request has been handed to the scheduler."""
        rid = state.request_id
        sid = state.request.session_id
        if rid in self.linked:
            self.linked[rid] = state
        elif sid is not None and self.latest.get(sid, (None,))[0] == rid:
            self.latest[sid] = (rid, state)
        if rid in self.waiting:
            self.watched.append(state)

    def stepped(self, now: float) -> None:
        """After a step that ended at ``now``: send what waited for the requests that finished
        in it, and forget the pause-free requests that finished before the previous step
        ended (every arrival up to then has been handed in, so none can precede them)."""
        if self.watched:
            still = []
            for state in self.watched:
                if state.finish_time is None:
                    still.append(state)
                    continue
                for request in self.waiting.pop(state.request_id):
                    if not self._send(request, state.finish_time):
                        self._due(request.arrival, request)
            self.watched = still
        if len(self.linked) >= self.sweep_at:
            before = self.handed
            self.linked = {rid: s for rid, s in self.linked.items()
                           if s is None or s.finish_time is None or s.finish_time > before}
            self.sweep_at = max(self.SWEEP_MIN, self.SWEEP_GROWTH * len(self.linked))
        self.handed = now

    def next_time(self) -> float | None:
        """When the earliest held request is sent (None: none is due)."""
        return self.due[0][0] if self.due else None

    def pop_due(self, now: float) -> Request | None:
        """The earliest held request sent at or before ``now``, or None."""
        if self.due and self.due[0][0] <= now:
            return heapq.heappop(self.due)[2]
        return None


def check_closed_loop(value: Any) -> None:
    """``closed_loop`` (a `SessionGate` or none: `kvevict.sim.simulate`, `Study`, the
    engine's `run_engine`) must be a bool."""
    if not isinstance(value, bool):
        raise ConfigError(f"closed_loop must be True or False, got {value!r}")


def drive(scheduler: Scheduler, requests: Iterable[Request], clock: ManualClock,
          on_step: Callable[[Scheduler], None] | None = None, *,
          on_add: Callable[[RequestState], None] | None = None,
          sessions: SessionGate | None = None) -> None:
    """Hand each request to ``scheduler`` once ``clock`` reaches its arrival and step until
    every request is finished; when nothing runs, the executor idles until the next arrival.

    ``requests`` is any iterable in arrival order (a list, a generator, a trace file's
    reader), consumed lazily, one ahead of the clock (`in_arrival_order`: an arrival
    earlier than the one before it is a `ConfigError`). ``on_step`` is called after every
    step that ran, ``on_add`` with each request's `RequestState` as it is queued.
    ``sessions``: a `SessionGate` holds each session's request until the answer it follows
    exists (closed-loop clients); None sends every request at its arrival (open loop).
    """
    executor = scheduler.executor
    stream = in_arrival_order(requests)
    nxt = next(stream, None)
    gate = sessions
    while True:
        while True:  # everything that has arrived by now, in time order
            due = gate.next_time() if gate is not None else None
            if nxt is not None and nxt.arrival <= clock.now and (due is None
                                                                or nxt.arrival <= due):
                request, nxt = nxt, next(stream, None)
                if gate is not None and gate.arrive(request):
                    continue
            elif due is not None and due <= clock.now:
                assert gate is not None
                request = gate.pop_due(clock.now)
            else:
                break
            state = scheduler.add(request)
            if gate is not None:
                gate.add(state)
            if on_add is not None:
                on_add(state)
        due = gate.next_time() if gate is not None else None
        upcoming = min((t for t in (nxt.arrival if nxt is not None else None, due)
                        if t is not None), default=None)
        if not scheduler.has_work():
            if upcoming is None:
                break
            executor.idle_until(upcoming)
            continue
        scheduler.step(upcoming)
        if gate is not None:
            gate.stepped(clock.now)
        if on_step is not None:
            on_step(scheduler)


class RunCollector:
    """The sink of a run: what the `SimResult` needs, gathered as requests arrive and
    finish, so that the scheduler need not keep them (``Scheduler(keep_finished=False)``).

    Hook `admit` to `drive`'s ``on_add`` and `finish` to the scheduler's ``on_finish``;
    `result` gives the `SimResult`. At arrival it asks the `InfiniteCache` what the request
    would hit (kept until it finishes, for pricing its recomputed tokens); at finish it makes
    the request's `RequestRecord` and keeps it (``records=True``) or adds it to `RunColumns`
    and drops it.

    Args:
        block_size: tokens per block (the manager's).
        cost: prices the recomputed prefill tokens (`recompute_seconds`).
        records: keep a `RequestRecord` per request (memory in proportion to the trace).
    """

    def __init__(self, block_size: int, cost: CostModel, *, records: bool = False) -> None:
        if not isinstance(cost, CostModel):
            raise ConfigError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.block_size = block_size
        self.cost = cost
        self.infinite = InfiniteCache(block_size)
        self.records: list[RequestRecord] | None = [] if records else None
        self.columns: RunColumns | None = None if records else RunColumns()
        self.arrived = 0
        self.first_arrival = 0.0
        self.last_arrival = 0.0
        self.infinite_hit_tokens = 0
        self.infinite_compute_tokens = 0
        self._in_flight: dict[RequestState, int] = {}  # state -> its infinite-cache hit

    def arrive(self, request: Request) -> int:
        """Count ``request`` (arriving in arrival order) and return the prompt tokens an
        infinite cache would hit."""
        hit = self.infinite.hit_tokens(request)
        if not self.arrived:
            self.first_arrival = request.arrival
        self.last_arrival = request.arrival
        self.arrived += 1
        self.infinite_hit_tokens += hit
        self.infinite_compute_tokens += max(request.prompt_len - hit, 1)  # >= 1: the logits
        return hit

    def admit(self, state: RequestState) -> None:
        """`drive`'s ``on_add``: ``state``'s request has been queued."""
        self._in_flight[state] = self.arrive(state.request)

    def finish(self, state: RequestState) -> None:
        """The scheduler's ``on_finish``: ``state`` is done."""
        self.record(state, self._in_flight.pop(state))

    def record(self, state: RequestState, infinite_hit: int) -> None:
        """Keep what the summary needs of a finished request (``infinite_hit``: its
        `arrive` answer)."""
        record = RequestRecord.from_state(state, recompute_prefill_s=recompute_seconds(
            self.cost, state.prefill_chunks, state.request.prompt_len,
            max(infinite_hit, state.cached_tokens or 0)))
        if self.records is not None:
            self.records.append(record)
        else:
            assert self.columns is not None
            self.columns.add(record)

    def result(self, scheduler: Scheduler, clock: ManualClock, name: str,
               sessions: SessionGate | None = None) -> SimResult:
        """The `SimResult` of the finished run (``sessions``: the run's `SessionGate`)."""
        if not self.arrived:
            raise ConfigError("the run had no requests; a simulation needs at least one")
        manager = scheduler.manager
        records = None if self.records is None else tuple(
            sorted(self.records, key=lambda r: r.arrival))
        makespan = clock.now - self.first_arrival
        tiers = None
        if manager.tiers is not None:
            transfers = scheduler.transfers
            tiers = tier_summary(manager, transfers if isinstance(transfers, TierTransfers)
                                 else None, makespan)
        return SimResult(
            policy=name, capacity_blocks=manager.pool.num_blocks,
            block_size=manager.block_size, records=records, columns=self.columns,
            manager_stats=manager.stats.as_dict(), preemptions=scheduler.preemptions,
            steps=scheduler.steps, makespan=makespan,
            infinite_hit_tokens=self.infinite_hit_tokens,
            infinite_compute_tokens=self.infinite_compute_tokens,
            busy_seconds=scheduler.busy_seconds,
            arrival_span=self.last_arrival - self.first_arrival, tiers=tiers,
            held_requests=0 if sessions is None else sessions.held, **_load(scheduler))


def _load(scheduler: Scheduler) -> dict[str, float]:
    """`SimResult.load_seconds` and `SimResult.limit_batch` of a run whose steps were priced
    (the executor's `Executor.work_meter`: the simulator's `CostModelExecutor`, or the
    engine's pricer when it has a cost model), in the meter's seconds; nothing otherwise."""
    meter = scheduler.executor.work_meter
    if meter is None:
        return {}
    batch = (scheduler.limit_decodes / scheduler.limit_steps if scheduler.limit_steps
             else float(scheduler.config.max_num_seqs))
    return {"load_seconds": meter.prefill_work + meter.decode_work
            + meter.decode_tokens * meter.cost.decode_step_s / batch,
            "limit_batch": batch}


def collect(scheduler: Scheduler, ordered: SequenceABC[Request], clock: ManualClock,
            name: str, cost: CostModel | None = None,
            sessions: SessionGate | None = None) -> SimResult:
    """The `SimResult` of a finished `drive` whose scheduler kept its finished requests
    (``Scheduler.finished``; the engine's run), with a `RequestRecord` per request:
    `RunCollector` over ``ordered`` (the requests in the order they were handed to the
    scheduler, with the arrivals a `SessionGate` gave them) and the finished ones.

    ``cost`` prices the recomputed prefill tokens (`recompute_seconds`) in clock seconds: by
    default the executor's own cost model when it is a `CostModelExecutor`, else the default
    `CostModel`."""
    if cost is None:
        executor = scheduler.executor
        cost = executor.cost if isinstance(executor, CostModelExecutor) else CostModel()
    collector = RunCollector(scheduler.manager.block_size, cost, records=True)
    hits = {r.request_id: collector.arrive(r) for r in ordered}
    for state in scheduler.finished:
        collector.record(state, hits[state.request_id])
    return collector.result(scheduler, clock, name, sessions)
