"""The plain block-level replay: hit ratios of residency policies on a trace, no timing.

Semantics (one `KVCacheManager` over a metadata-only `BlockPool` of ``capacity_blocks``):

- requests run **one at a time**, in the order given: ``begin`` then ``finish``, nothing
  else (no decode appends, no concurrency, no queueing, no timing);
- a prompt's hit is its longest cached prefix: counting **stops at the first missing
  block**, as in vLLM's and SGLang's prefix caching;
- the prompt's missing blocks are allocated, evicting candidates through the policy; only
  **leaves** are evicted and the running request's own blocks are protected;
- on ``finish`` the blocks are released tail first and become candidates;
- the clock is set to the request's time before each request: its index (``time="index"``,
  the default) or its arrival, made strictly increasing (``time="arrival"``: ties are
  nudged up to the next float, as `kvevict.policies.belady.request_times` does; an arrival
  before the previous request's is a `ConfigError` naming the request);
- an offline policy (``"belady"``) gets its future from the same requests on the same time
  axis, so it is the exact furthest-next-use oracle of this replay; so do the reuse and
  horizon oracles (`kvevict.policies.oracles`: they know whether a block is used again, or
  whether within H, and run LRU otherwise);
- `INFINITE` (``"infinite"``) is the infinite cache: a pool that holds every block the trace
  caches, so nothing is evicted and no request is rejected (its row is the same at every
  size);
- a request larger than the whole pool cannot run: its blocks count as misses, the cache is
  left as it was, and it is counted in ``rejected``; it is no one's next use;
- besides the hits, each cell adds up the prefill compute its hits saved, by a
  `kvevict.cost.CostModel` (``cost_model=``, default `CostModel()`: the cost the value-aware
  policies price with): per request, ``prefill(n, 0) - prefill(n - c, c)`` for a prompt of
  ``n`` tokens with ``c`` cached (`kvevict.cost.PrefillLedger`). Prefill is quadratic in the
  context, so this weighs a deep block's hit above a shallow one's, as the cost-aware
  policies do: ``prefill_saved_ratio`` is what they optimize, the block hit ratio what LRU
  does.

**Scale.** The requests are consumed lazily, one at a time: any iterable works (a list, a
generator, a `kvevict.workloads.TraceFile` or ``iter_mooncake(path)``), and an online
replay holds the cache (the pool, the prefix tree, the policy's index: in proportion to
``capacity_blocks``) and running counters, not the trace. Per-request records are kept only
with ``records=True``. ``"belady"`` by name reads the trace twice: a first pass writes, per
block access, the index of the next request using the block to a file
(`kvevict.policies.belady.NextUseFile`: memory in proportion to the distinct blocks, see
there), then the replay reads it through a memory-mapped window (`FileBelady`); a one-shot
iterator is spilled to a temporary file during the first pass so it can be read again.
The reuse and horizon oracles by name read the same file (any offline class that defines
``from_next_uses`` does; on the arrival axis the file also holds the arrivals), and so does
the infinite cache, whose pool is sized from it (every distinct block, plus the largest
request): it holds every block, so its memory follows the distinct blocks, not the cache.
Another offline policy (a user's ``from_requests``) gets the requests as a list.
`replay_table` feeds every (policy, size) cell from one pass over the trace.

**The oracle decomposition.** By default `replay_table` (and ``kvevict replay``) replays
every registered online policy, then the horizon oracle, the reuse oracle, Belady and the
infinite cache (`default_policies`); ``horizons=`` sweeps the horizon oracle's H. Reading
up the rows: the reuse oracle's gain over LRU is what knowing *whether* a block comes back
is worth (classification), Belady's over it what knowing *when* adds (timing), and the
infinite cache bounds them all.

**Is a difference real? Batch means.** A replay is exact, but the trace is one sample of
traffic: a policy 2% above LRU on it may be below on the next hour's. Each cell therefore
also keeps its counts in batches of consecutive requests (`ReplayResult.batches`), between
`MIN_BATCHES` and twice as many of equal size whatever the trace's length (when the list is
full, neighbours merge and the batch size doubles; a last partial batch joins the last
one). `compare` pairs two policies batch by batch, as the simulator pairs seeds: the
interval of the per-batch difference of a metric is the t-interval of the method of batch
means (Law and Kelton, *Simulation Modeling and Analysis*, 3rd ed., §9.5.3), the same
batches for both policies, so the traffic's own ups and downs cancel in the difference. It
assumes batches long against the cache's turnover, so that one batch's state says little
about the next one's hits. Where they are not (a large pool keeps blocks for longer than a
batch lasts), consecutive differences are correlated; when their lag-1 autocorrelation
``r`` is positive the interval is widened by ``sqrt((1 + r) / (1 - r))`` (`lag1_factor`,
the variance factor of the mean of an AR(1) sequence), so a short batch does not make an
interval narrower than it should be. A difference whose interval holds 0 is reported as no
significant difference (``kvevict replay --versus lru``).

Run ``kvevict replay`` (or ``python -m kvevict.replay``) for the Markdown table, e.g.
``kvevict replay --time arrival --horizons 30,120,300``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import kvevict.policies  # noqa: F401  (registers the built-in policies)
from kvevict.cost import CostModel, PrefillLedger, check_cost_model
from kvevict.errors import ConfigError, OutOfBlocks
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy, available_policies
from kvevict.policies.belady import NextUseFile
from kvevict.policies.oracles import check_horizon
from kvevict.policies.registry import (
    POLICIES,
    PolicySpec,
    build_policy,
    check_distinct,
    check_spec,
    hook_parameters,
    is_offline,
    online_first,
)
from kvevict.pool import BlockPool
from kvevict.stats import Interval, interval
from kvevict.tiers import TierStack
from kvevict.types import ManualClock, Request

__all__ = ["BATCH_FIELDS", "INFINITE", "MAX_LAG1", "METRICS", "MIN_BATCHES", "ORACLES",
           "Batches", "Comparison", "ReplayRecord", "ReplayResult", "ReplayTable", "Tally",
           "compare", "default_policies", "format_comparison", "format_table",
           "format_tier_table", "horizon_label", "lag1", "lag1_factor", "load_results", "main",
           "open_trace", "replay", "replay_table", "row_labels"]

#: ``progress(phase, requests done)`` is called every this many requests (and at the end).
PROGRESS_EVERY = 1000

#: The name of the infinite-cache row: no policy, a pool that holds every block the trace
#: ever caches (nothing is evicted). Accepted wherever the replay takes a policy name.
INFINITE = "infinite"

#: The built-in oracles, weakest first: the order of the oracle rows in a default table.
ORACLES = ("horizon-oracle", "reuse-oracle", "belady")

#: What a replay table can show (`format_table`, ``--metric``): `ReplayResult` attributes.
METRICS = ("block_hit_ratio", "token_hit_ratio", "prefill_saved_ratio", "evictions", "hits")

#: What each of `ReplayResult.batches` counts, in order.
BATCH_FIELDS = ("accesses", "hits", "token_queries", "token_hits", "prefill_s",
                "prefill_saved_s")
#: A replay keeps between this many batches and twice as many (see the module docstring).
MIN_BATCHES = 10
#: The most lag-1 autocorrelation `compare` corrects for (its factor is then 4.36).
MAX_LAG1 = 0.9
#: The ratio metrics `compare` pairs: (numerator, denominator) in `BATCH_FIELDS`.
_RATIO_PARTS = {"block_hit_ratio": (1, 0), "token_hit_ratio": (3, 2),
                "prefill_saved_ratio": (5, 4)}


def horizon_label(horizon: float) -> str:
    """The label of the horizon oracle's row at ``horizon`` in a `replay_table` given
    ``horizons``: ``"horizon-oracle H=60"``."""
    return f"horizon-oracle H={check_horizon(horizon):g}"


def default_policies() -> list[str]:
    """What a `replay_table` replays by default: every registered online policy (sorted),
    then the offline ones: others first, then the built-in oracles weakest first
    (`ORACLES`: ``horizon-oracle``, ``reuse-oracle``, ``belady``), then `INFINITE`."""
    names = online_first(available_policies())
    offline = [n for n in names if is_offline(n)]
    builtin = [n for n in ORACLES if n in offline]
    return ([n for n in names if not is_offline(n)]
            + [n for n in offline if n not in builtin] + builtin + [INFINITE])


@dataclass(frozen=True)
class ReplayRecord:
    """One request of a replay (``records=True``)."""

    index: int  #: position in the trace (0-based)
    request_id: Any
    blocks: int  #: cacheable prompt blocks looked up
    block_hits: int  #: of those, found cached
    tokens: int  #: prompt tokens looked up
    token_hits: int  #: of those, found cached
    rejected: bool = False  #: larger than the pool: not run, all misses


@dataclass(frozen=True)
class ReplayResult:
    """What one replay of one policy at one pool size measured."""

    policy: str  #: policy label (registry name, or the label given)
    capacity_blocks: int
    block_size: int
    requests: int  #: requests replayed (rejected ones included)
    accesses: int  #: cacheable prompt blocks looked up
    hits: int  #: of those, found cached
    token_queries: int  #: prompt tokens looked up
    token_hits: int  #: of those, found cached
    evictions: int
    rejected: int = 0  #: requests larger than the pool (counted as all misses)
    #: wall time of this replay's own work: building its policy (for Belady: its backward
    #: pass) and its begin/finish calls; reading the trace (and Belady's first pass) is shared
    #: by the cells of a `replay_table` and not counted
    seconds: float = 0.0
    records: tuple[ReplayRecord, ...] | None = None  #: per request, with ``records=True``
    #: with ``tiers=``: ``hits`` (blocks served by each tier, ``"device"`` the pool's;
    #: ``hits`` above is their sum) and the `kvevict.tiers.TierStats` counters (bytes read
    #: and written per tier, demotions, drops by reason)
    tiers: dict[str, Any] | None = None
    #: prefill seconds of every request's prompt with nothing cached, by the replay's cost
    #: model (`kvevict.cost.PrefillLedger`; rejected requests included)
    prefill_s: float = 0.0
    #: of those, the seconds the cached prefixes saved
    prefill_saved_s: float = 0.0
    #: the same counts by batches of consecutive requests, each as `BATCH_FIELDS` (batch
    #: means, see the module docstring; the vLLM engines keep them too)
    batches: tuple[tuple[float, ...], ...] = ()

    @property
    def tier_hit_ratios(self) -> dict[str, float]:
        """Blocks served by each tier over ``accesses`` (empty without tiers)."""
        if not self.tiers or not self.accesses:
            return {}
        return {name: n / self.accesses for name, n in self.tiers["hits"].items()}

    @property
    def block_hit_ratio(self) -> float:
        """``hits / accesses`` (0 when there were none)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """``token_hits / token_queries`` (0 when there were none)."""
        return self.token_hits / self.token_queries if self.token_queries else 0.0

    @property
    def prefill_saved_ratio(self) -> float:
        """``prefill_saved_s / prefill_s``: the share of the prefill compute the cache saved
        (0 when there was none)."""
        return self.prefill_saved_s / self.prefill_s if self.prefill_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field (``records`` as a list of dicts, or None) and the three ratios."""
        out = asdict(self)
        for name in _RATIOS:
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> ReplayResult:
        """The result `as_dict` gave ``row`` (a row of a ``results.json``): the inverse, exact.

        Raises:
            ConfigError: a field missing or unknown, or a ratio that is not the one the
                counts give (the row was edited or cut).
        """
        if not isinstance(row, Mapping):
            raise ConfigError(f"a replay result is a mapping of its fields, got "
                              f"{type(row).__name__}")
        names = _RESULT_FIELDS
        label = f"the row of {row.get('policy', '?')!r} at {row.get('capacity_blocks', '?')}"
        unknown = sorted(set(row) - set(names) - set(_RATIOS))
        if unknown:
            raise ConfigError(f"{label} has unknown fields {', '.join(unknown)} (a replay "
                              f"result has {', '.join(names)} and the three ratios)")
        missing = [f for f in _REQUIRED_FIELDS if f not in row]
        if missing:
            raise ConfigError(f"{label} lacks {', '.join(missing)}")
        kwargs = {f: row[f] for f in names if f in row}
        try:
            records = kwargs.get("records")
            if records is not None:
                kwargs["records"] = tuple(ReplayRecord(**r) for r in records)
            kwargs["batches"] = tuple(tuple(b) for b in kwargs.get("batches", ()))
            result = cls(**kwargs)
            ratios = {name: getattr(result, name) for name in _RATIOS}
        except (TypeError, ValueError) as exc:  # a record's fields, a count that is no number
            raise ConfigError(f"{label} is not a replay result: {exc}") from None
        for name, value in ratios.items():
            if name in row and row[name] != value:
                raise ConfigError(f"{label} says {name} = {row[name]!r}, but its counts give "
                                  f"{value!r}")
        return result


#: The ratios `ReplayResult.as_dict` adds to the fields.
_RATIOS = tuple(_RATIO_PARTS)
_RESULT_FIELDS = tuple(f.name for f in fields(ReplayResult))
#: The fields a row must give (the rest have defaults).
_REQUIRED_FIELDS = ("policy", "capacity_blocks", "block_size", "requests", "accesses", "hits",
                    "token_queries", "token_hits", "evictions")


def _label(policy: PolicySpec) -> str:
    if isinstance(policy, str):
        return policy
    if isinstance(policy, Policy):
        return policy.name or type(policy).__name__
    return getattr(policy, "name", "") or getattr(policy, "__name__", "custom")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_source(requests: Any) -> None:
    if isinstance(requests, (str, bytes, os.PathLike)):
        raise ConfigError("requests must be an iterable of Request objects, not a string or "
                          "path (read a trace first, e.g. with kvevict.workloads.TraceFile or "
                          "kvevict.workloads.iter_mooncake)")
    if not isinstance(requests, Iterable):
        raise ConfigError(f"requests must be an iterable of Request objects, got "
                          f"{type(requests).__name__}")


def _check_time(time: str) -> str:
    if time not in ("index", "arrival"):
        raise ConfigError(f"time must be one of index, arrival, got {time!r}")
    return time


class _Axis:
    """The clock value of each request, computed as they stream past: its index, or its
    arrival made strictly increasing (an arrival before the previous one is an error)."""

    def __init__(self, time: str) -> None:
        self.arrival = _check_time(time) == "arrival"
        self.last_arrival = -math.inf
        self.last = -math.inf

    def __call__(self, index: int, request: Request) -> float:
        if not self.arrival:
            return float(index)
        t = float(request.arrival)
        if t < self.last_arrival:
            raise ConfigError(
                f"request {request.request_id!r} (number {index} of the trace, from 0) "
                f"arrives at {t:g} s, before the previous request's {self.last_arrival:g} s; "
                "time='arrival' needs the requests in arrival order (sort them, or replay on "
                "time='index')")
        self.last_arrival = t
        if t <= self.last:
            t = math.nextafter(self.last, math.inf)
        self.last = t
        return t


def _streams(policy: PolicySpec, params: Mapping[str, Any]) -> bool:
    """Whether the replay reads this policy's future from a `NextUseFile`: an offline class
    by name that defines ``from_next_uses`` itself (Belady, the reuse and horizon oracles;
    not a subclass that only inherits it) and takes every parameter given through it."""
    if not isinstance(policy, str) or policy == INFINITE:
        return False
    cls = POLICIES.get(policy)
    hook = vars(cls).get("from_next_uses")
    if not is_offline(cls) or hook is None:
        return False
    return set(params) <= hook_parameters(cls.from_next_uses)  # type: ignore[attr-defined]


def _needs_list(policy: PolicySpec, params: Mapping[str, Any]) -> bool:
    """An offline policy by name that does not stream, with no parameters or only ones its
    ``from_requests`` takes: that hook takes the requests as a list."""
    if not isinstance(policy, str) or policy == INFINITE or not is_offline(policy) \
            or _streams(policy, params):
        return False
    return set(params) <= hook_parameters(POLICIES.get(policy).from_requests)  # type: ignore


class Batches:
    """A cell's counts in batches of consecutive requests: between `MIN_BATCHES` and twice as
    many, of equal size (see the module docstring). Every replay of a `ReplayResult` keeps
    one (this module's, and the vLLM engines' in `kvevict.adapters.vllm`), so `compare`
    pairs any two rows replayed on the same requests."""

    __slots__ = ("size", "done", "open", "count")

    def __init__(self) -> None:
        self.size = 1  # requests per batch
        self.done: list[list[float]] = []
        self.open = [0.0] * len(BATCH_FIELDS)
        self.count = 0  # requests in the open batch

    def add(self, counts: Sequence[float]) -> None:
        """One request's counts (as `BATCH_FIELDS`)."""
        batch = self.open
        for i, x in enumerate(counts):
            batch[i] += x
        self.count += 1
        if self.count == self.size:
            done = self.done
            done.append(batch)
            self.open = [0.0] * len(BATCH_FIELDS)
            self.count = 0
            if len(done) == 2 * MIN_BATCHES:  # neighbours merge: half as many, twice as long
                self.done = [[a + b for a, b in zip(done[i], done[i + 1])]
                             for i in range(0, len(done), 2)]
                self.size *= 2

    def result(self) -> tuple[tuple[float, ...], ...]:
        """The batches, a last partial one joined to the last full one."""
        out = [list(b) for b in self.done]
        if self.count:
            if out:
                out[-1] = [a + b for a, b in zip(out[-1], self.open)]
            else:
                out.append(list(self.open))
        return tuple(tuple(b) for b in out)


class Tally:
    """A replay's requests, one `add` each: the prefill seconds they cost and saved by a cost
    model (`kvevict.cost.PrefillLedger`) and their `Batches`. Every replay of a `ReplayResult`
    keeps one (this module's, and the vLLM engines' in `kvevict.adapters.vllm`)."""

    __slots__ = ("prefill", "batches")

    def __init__(self, cost_model: CostModel) -> None:
        self.prefill = PrefillLedger(cost_model)
        self.batches = Batches()

    def add(self, blocks: int, block_hits: int, tokens: int, token_hits: int) -> None:
        """One request: ``blocks`` looked up, the first ``block_hits`` served from the cache;
        its prompt of ``tokens``, the first ``token_hits`` served (0 and 0 for a request
        that could not run)."""
        full, saved = self.prefill.add(tokens, token_hits)
        self.batches.add((blocks, block_hits, tokens, token_hits, full, saved))

    def totals(self) -> tuple[int, int, int, int]:
        """(blocks, block hits, tokens, token hits) over every request added."""
        batches = self.batches.result()
        return tuple(round(math.fsum(b[i] for b in batches))  # type: ignore[return-value]
                     for i in range(4))

    def result_fields(self) -> dict[str, Any]:
        """The `ReplayResult` fields it holds: ``prefill_s``, ``prefill_saved_s`` and
        ``batches``."""
        return {"prefill_s": self.prefill.full_s, "prefill_saved_s": self.prefill.saved_s,
                "batches": self.batches.result()}


class _Cell:
    """One policy at one pool size, fed one request at a time (``closes``: the policy reads
    a next-use file and has a ``close``)."""

    def __init__(self, label: str, policy: Policy, capacity_blocks: int, block_size: int,
                 extra_key: Any, check_every: int, records: bool, seconds: float,
                 cost_model: CostModel, closes: bool = False,
                 tiers: TierStack | None = None) -> None:
        self.label = label
        self.closes = closes
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.policy = policy
        self.clock = ManualClock(0.0)
        self.manager = KVCacheManager(BlockPool(capacity_blocks, block_size), policy,
                                      clock=self.clock, extra_key=extra_key, tiers=tiers)
        self.check_every = check_every
        self.records: list[ReplayRecord] | None = [] if records else None
        self.requests = self.rejected = self.rejected_blocks = self.rejected_tokens = 0
        self.seconds = seconds
        self.tally = Tally(cost_model)

    def step(self, index: int, request: Request, t: float) -> None:
        start = _time.perf_counter()
        manager = self.manager
        self.clock.set(t)
        self.requests += 1
        stats = manager.stats
        hits_before, tokens_before = stats.block_hits, stats.prefix_cache_hits
        queries_before = stats.prefix_cache_queries
        try:
            seq = manager.begin(request)
        except OutOfBlocks:
            self.rejected += 1
            tokens = request.prompt_len
            if request.block_hashes is not None:
                blocks = len(request.block_hashes)
            else:
                blocks = tokens // self.block_size
            self.rejected_blocks += blocks
            self.rejected_tokens += tokens
            if self.records is not None:
                self.records.append(ReplayRecord(index, request.request_id, blocks, 0,
                                                 tokens, 0, True))
            self.seconds += _time.perf_counter() - start
            self.tally.add(blocks, 0, tokens, 0)
            return
        manager.finish(seq.seq_id)
        token_hits = stats.prefix_cache_hits - tokens_before
        block_hits = stats.block_hits - hits_before
        if self.records is not None:
            self.records.append(ReplayRecord(
                index, request.request_id, len(seq.hashes), block_hits,
                request.prompt_len, token_hits))
        if self.check_every and self.requests % self.check_every == 0:
            manager.check()
        self.seconds += _time.perf_counter() - start
        self.tally.add(len(seq.hashes), block_hits, stats.prefix_cache_queries - queries_before,
                       token_hits)

    def result(self) -> ReplayResult:
        if self.check_every:
            self.manager.check()
        if self.closes:
            self.policy.close()  # type: ignore[attr-defined]
        stats = self.manager.stats
        stack = self.manager.tiers
        tiers = None if stack is None else {"hits": stack.hits_by_tier(stats.block_hits),
                                            **stack.stats.as_dict()}
        return ReplayResult(
            policy=self.label,
            capacity_blocks=self.capacity_blocks,
            block_size=self.block_size,
            requests=self.requests,
            accesses=stats.block_queries + self.rejected_blocks,
            hits=stats.block_hits,
            token_queries=stats.prefix_cache_queries + self.rejected_tokens,
            token_hits=stats.prefix_cache_hits,
            evictions=stats.evictions,
            rejected=self.rejected,
            seconds=self.seconds,
            records=None if self.records is None else tuple(self.records),
            tiers=tiers,
            **self.tally.result_fields(),
        )


Progress = Callable[[str, int], None]


def _run(requests: Iterable[Request], cells: Sequence[tuple[str, PolicySpec, dict[str, Any]]],
         sizes: Sequence[int], block_size: int, time: str, extra_key: Any, check_every: int,
         records: bool, progress: Progress | None,
         workdir: str | os.PathLike[str] | None, cost_model: CostModel,
         tiers: Callable[[], TierStack] | None = None) -> list[ReplayResult]:
    """Replay every (label, policy, params) of ``cells`` at every size, from one pass over
    ``requests`` (two when Belady streams its future; see the module docstring)."""
    source: Iterable[Request] = requests
    infinite = [label for label, spec, _ in cells if spec == INFINITE]
    cells = [c for c in cells if c[1] != INFINITE]
    if any(_needs_list(spec, params) for _, spec, params in cells):
        source = list(requests)
        for req in source:
            if not isinstance(req, Request):
                raise ConfigError(f"replay takes Requests, got {type(req).__name__}")
    future: NextUseFile | None = None
    try:
        if infinite or any(_streams(spec, params) for _, spec, params in cells):
            one_shot = iter(source) is source
            tick = None if progress is None else (lambda n: progress("future", n))
            future = NextUseFile.build(source, block_size=block_size, extra_key=extra_key,
                                       directory=workdir, spill=one_shot, on_request=tick,
                                       arrivals=time == "arrival")
            if one_shot:
                source = future.spilled()
        running = [_make_cell(label, spec, params, size, block_size, time, extra_key,
                              check_every, records, source, future, cost_model, tiers)
                   for label, spec, params in cells for size in sizes]
        unbounded = []
        if infinite:
            assert future is not None
            # room for every distinct block and the largest request's uncached tail: an LRU
            # that is never asked for a victim
            room = future.num_slots + future.max_need + 1
            unbounded = [_Cell(INFINITE, build_policy("lru"), room, block_size, extra_key,
                               check_every, records, 0.0, cost_model)]
            running += unbounded
        axis = _Axis(time)
        count = 0
        for index, req in enumerate(source):
            if not isinstance(req, Request):
                raise ConfigError(f"replay takes Requests, got {type(req).__name__}")
            t = axis(index, req)
            for cell in running:
                cell.step(index, req, t)
            count = index + 1
            if progress is not None and count % PROGRESS_EVERY == 0:
                progress("replay", count)
        if progress is not None:
            progress("replay", count)
        results = [cell.result() for cell in running if cell not in unbounded]
        for cell in unbounded:
            whole = cell.result()
            if whole.evictions:  # pragma: no cover (the room above rules it out)
                raise ConfigError(f"the infinite cache of {cell.capacity_blocks:,} blocks "
                                  f"evicted {whole.evictions:,}; please report this")
            results += [replace(whole, policy=label, capacity_blocks=size)
                        for label in infinite for size in sizes]
        return results
    finally:
        if future is not None:
            future.close()


def _make_cell(label: str, spec: PolicySpec, params: dict[str, Any], size: int,
               block_size: int, time: str, extra_key: Any, check_every: int, records: bool,
               source: Iterable[Request], future: NextUseFile | None, cost_model: CostModel,
               tiers: Callable[[], TierStack] | None = None) -> _Cell:
    start = _time.perf_counter()
    stack = None if tiers is None else _stack_of(tiers)
    if stack is not None:  # a value-aware policy prices a block with its reload
        params = stack.policy_params(spec, params, block_size=block_size)
    if _streams(spec, params):
        assert future is not None
        cls = POLICIES.get(spec)
        policy: Policy = cls.from_next_uses(future, size, time=time,  # type: ignore
                                            **params)
        return _Cell(label, policy, size, block_size, extra_key, check_every, records,
                     _time.perf_counter() - start, cost_model, closes=True, tiers=stack)
    if _needs_list(spec, params):
        reqs = source if isinstance(source, list) else list(source)  # a list (see _run)
        axis = _Axis(time)
        times = [axis(i, r) for i, r in enumerate(reqs)]
        fits = [(r, t) for r, t in zip(reqs, times, strict=True)
                if -(-r.prompt_len // block_size) <= size]
        policy = build_policy(spec, params, requests=[r for r, _ in fits],
                              block_size=block_size, time_axis=[t for _, t in fits],
                              extra_key=extra_key)
    else:
        policy = build_policy(spec, params)
    return _Cell(label, policy, size, block_size, extra_key, check_every, records,
                 _time.perf_counter() - start, cost_model, tiers=stack)


def _stack_of(tiers: Callable[[], TierStack]) -> TierStack:
    stack = tiers() if callable(tiers) else None
    if not isinstance(stack, TierStack):
        raise ConfigError("tiers must be a zero-argument factory returning a fresh "
                          f"kvevict.tiers.TierStack (one per replay), got {tiers!r}")
    return stack


def _check_spec(policy: PolicySpec, params: Mapping[str, Any]) -> None:
    """An unknown name, or parameters for the infinite cache, fail before the trace is
    read."""
    if policy == INFINITE:
        if params:
            raise ConfigError(f"the infinite cache takes no parameters, got "
                              f"{', '.join(params)}")
    elif isinstance(policy, str):
        POLICIES.get(policy)


def _cell(label: str, spec: PolicySpec, params: Mapping[str, Any]
          ) -> tuple[str, PolicySpec, dict[str, Any]]:
    """A replay's (label, policy, params), the parameters a name carries
    (``learned(ghost=true)``, `parse_spec`) moved into ``params``, checked before the trace
    is read."""
    if isinstance(spec, str) and spec != INFINITE and "(" in spec:
        spec, params = check_spec(spec, params)
    _check_spec(spec, params)
    return label, spec, dict(params)


def replay(requests: Iterable[Request], policy: PolicySpec, capacity_blocks: int,
           block_size: int = 512, *, time: str = "index", extra_key: Any = None,
           check_every: int = 0, label: str | None = None, records: bool = False,
           progress: Progress | None = None, workdir: str | os.PathLike[str] | None = None,
           tiers: Callable[[], TierStack] | None = None, cost_model: CostModel | None = None,
           **policy_params: Any) -> ReplayResult:
    """Replay ``requests`` through one policy at one pool size (semantics: module docstring).

    Args:
        requests: the trace, in order (token-mode or ``block_hashes`` requests): any
            iterable, consumed lazily (see **Scale** in the module docstring).
        policy: a registered name (an offline one, ``"belady"``, ``"reuse-oracle"``,
            ``"horizon-oracle"``, gets its future from ``requests``), `INFINITE`
            (``"infinite"``: a cache that never evicts), a fresh `Policy` instance, or a
            zero-argument factory returning one (see
            `kvevict.policies.registry.build_policy`).
        capacity_blocks: blocks in the pool.
        block_size: tokens per block (512 for the Mooncake traces).
        time: the clock axis: ``"index"`` (request ``i`` at time ``i``) or ``"arrival"``
            (arrival seconds, strictly increasing; the requests must be in arrival order).
            Time-aware parameters (half-lives, windows) are in these units.
        extra_key: mixed into token-mode block hashes (see `KVCacheManager`).
        check_every: run `KVCacheManager.check` every this many requests (0: never; slow).
        label: the name to report (default: the policy's registry name).
        records: keep a `ReplayRecord` per request (memory in proportion to the trace).
        progress: called as ``progress(phase, requests done)`` every `PROGRESS_EVERY`
            requests and at the end of each pass; ``phase`` is ``"future"`` for Belady's
            first pass, ``"replay"`` for the replay.
        workdir: where Belady's next-use files go (default: the system's temporary
            directory); they are removed when the replay ends.
        tiers: a zero-argument factory returning a fresh `kvevict.tiers.TierStack`
            (metadata-only): blocks evicted from the pool are demoted there and a hit there
            is a reload, counted by tier in `ReplayResult.tiers`.
        cost_model: the prefill cost of `ReplayResult.prefill_s` and ``prefill_saved_s``
            (default `CostModel()`); it does not reach the policy (give a value-aware
            policy its own ``cost_model`` in ``policy_params``).
        policy_params: parameters of a policy given by name.
    """
    _positive_int("capacity_blocks", capacity_blocks)
    _positive_int("block_size", block_size)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ConfigError(f"check_every must be a non-negative int, got {check_every!r}")
    _check_source(requests)
    _check_time(time)
    cell = _cell(label if label is not None else _label(policy), policy, policy_params)
    costs = check_cost_model(cost_model)
    (result,) = _run(requests, [cell], [capacity_blocks],
                     block_size, time, extra_key, check_every, records, progress, workdir,
                     costs, tiers)
    return result


@dataclass
class ReplayTable:
    """Results of every policy at every pool size, in the order they were given."""

    policies: list[str]
    capacities: list[int]
    results: list[ReplayResult] = field(default_factory=list)

    def get(self, policy: str, capacity_blocks: int) -> ReplayResult:
        """The result of one policy at one size."""
        for r in self.results:
            if r.policy == policy and r.capacity_blocks == capacity_blocks:
                return r
        raise KeyError((policy, capacity_blocks))

    def ratios(self, metric: str = "block_hit_ratio") -> dict[str, list[float]]:
        """policy -> the metric at each capacity, in ``capacities`` order."""
        return {p: [getattr(self.get(p, c), metric) for c in self.capacities]
                for p in self.policies}

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (policy, size), as `ReplayResult.as_dict`."""
        return [r.as_dict() for r in self.results]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> ReplayTable:
        """The table whose `rows` are ``rows`` (`ReplayResult.from_dict` each): policies and
        sizes in the order they first appear.

        Raises:
            ConfigError: no rows, a (policy, size) given twice or missing (every policy
                needs every size), or a bad row.
        """
        results = [ReplayResult.from_dict(r) for r in rows]
        if not results:
            raise ConfigError("a replay table needs at least one row")
        policies = list(dict.fromkeys(r.policy for r in results))
        capacities = list(dict.fromkeys(r.capacity_blocks for r in results))
        cells: set[tuple[str, int]] = set()
        for r in results:
            cell = (r.policy, r.capacity_blocks)
            if cell in cells:
                raise ConfigError(f"two rows of {r.policy!r} at {r.capacity_blocks:,} blocks")
            cells.add(cell)
        for p in policies:
            lacking = [c for c in capacities if (p, c) not in cells]
            if lacking:
                raise ConfigError(f"{p!r} has no row at {', '.join(f'{c:,}' for c in lacking)}"
                                  f" blocks (the table's sizes: "
                                  f"{', '.join(f'{c:,}' for c in capacities)})")
        return cls(policies, capacities, results)

    def select(self, policies: Sequence[str] | None = None,
               capacities: Sequence[int] | None = None) -> ReplayTable:
        """The rows of ``policies`` at ``capacities`` (None: all), in the order given.

        Raises:
            ConfigError: a policy or size the table does not have, named with those it has,
                or one named twice.
        """
        policies = list(self.policies if policies is None else policies)
        capacities = list(self.capacities if capacities is None else capacities)
        check_distinct(policies, "select's policies", "policy")
        check_distinct(capacities, "select's sizes", "size")
        unknown = [p for p in policies if p not in self.policies]
        if unknown:
            raise ConfigError(f"no row {unknown[0]!r} in this table (rows: "
                              f"{', '.join(self.policies)})")
        absent = [c for c in capacities if c not in self.capacities]
        if absent:
            raise ConfigError(f"no size {absent[0]:,} in this table (sizes: "
                              f"{', '.join(f'{c:,}' for c in self.capacities)})")
        return ReplayTable(policies, capacities,
                           [self.get(p, c) for p in policies for c in capacities])


def replay_table(requests: Iterable[Request],
                 policies: Sequence[str] | Mapping[str, PolicySpec] | None = None,
                 capacities: Iterable[int] = (1000, 2000, 5000, 10000, 20000),
                 block_size: int = 512, *, time: str = "index",
                 extra_key: Any = None, records: bool = False,
                 progress: Progress | None = None,
                 workdir: str | os.PathLike[str] | None = None,
                 horizons: Iterable[float] | None = None,
                 tiers: Callable[[], TierStack] | None = None,
                 cost_model: CostModel | None = None) -> ReplayTable:
    """Replay every policy at every capacity, all from one pass over ``requests`` (two with
    an oracle or the infinite cache), each cell as `replay` would.

    Args:
        requests: the trace (any iterable, consumed lazily).
        policies: registered names (and `INFINITE`), or a mapping label -> name or
            zero-argument factory (a fresh policy is needed per replay, so instances are not
            accepted). Default (`default_policies`): every registered online policy, then
            the oracles weakest first (``horizon-oracle``, ``reuse-oracle``, ``belady``),
            then the infinite cache: the oracle decomposition.
        capacities: pool sizes in blocks.
        block_size: as for `replay`.
        time: as for `replay`.
        extra_key: as for `replay`.
        records: as for `replay` (per cell).
        progress: as for `replay`.
        workdir: as for `replay`.
        horizons: H values of the horizon oracle (clock units: seconds on the arrival axis,
            requests on the index axis). Each gives a row labelled `horizon_label` (e.g.
            ``"horizon-oracle H=60"``), in the order given, in place of the
            ``"horizon-oracle"`` row at its default H (`DEFAULT_HORIZON`), or, when the list
            does not name it, after the last policy that is not `INFINITE`. None: only the
            row of the default H, if the list names it.
        tiers: as for `replay` (a fresh stack per cell; the infinite cache has none).
        cost_model: as for `replay`.
    """
    _check_source(requests)
    if policies is None:  # the online policies, then the oracles and the infinite cache
        policies = default_policies()
    if isinstance(policies, str):
        raise ConfigError("policies must be a list of names or a mapping, not one string")
    if isinstance(policies, Mapping):
        specs = dict(policies)
    else:
        policies = list(policies)
        check_distinct(policies, "policies")
        specs = {p: p for p in policies}
    for lbl, spec in specs.items():
        if isinstance(spec, Policy):
            raise ConfigError(f"policy {lbl!r}: give a name or a factory, not an instance "
                              "(each replay needs a fresh policy)")
    # an unknown name or parameter fails before any replay runs
    cells = [_cell(lbl, spec, {}) for lbl, spec in specs.items()]
    if horizons is not None:
        cells = _with_horizons(cells, horizons)
    sizes = [_positive_int("capacity", c) for c in capacities]
    _positive_int("block_size", block_size)
    _check_time(time)
    costs = check_cost_model(cost_model)
    results = _run(requests, cells, sizes, block_size, time, extra_key, 0, records, progress,
                   workdir, costs, tiers)
    return ReplayTable([lbl for lbl, _, _ in cells], sizes, results)


def row_labels(policies: Sequence[str] | None = None,
               horizons: Iterable[float] | None = None) -> list[str]:
    """The rows a `replay_table` of these ``policies`` (names; None: `default_policies`) and
    ``horizons`` has, in order, without replaying: the horizon oracle's row replaced by one
    row per horizon as `replay_table` places them (a caller checks a row name before the
    replay runs). A bad horizon is the `ConfigError` `replay_table` would raise."""
    names = default_policies() if policies is None else list(policies)
    cells: list[tuple[str, PolicySpec, dict[str, Any]]] = [(p, p, {}) for p in names]
    if horizons is not None:
        cells = _with_horizons(cells, horizons)
    return [lbl for lbl, _, _ in cells]


def _with_horizons(cells: list[tuple[str, PolicySpec, dict[str, Any]]],
                   horizons: Iterable[float]) -> list[tuple[str, PolicySpec, dict[str, Any]]]:
    """``cells`` with the horizon oracle's row replaced by one row per horizon (or those
    rows added after the last row that is not the infinite cache)."""
    if isinstance(horizons, (str, bytes)) or not isinstance(horizons, Iterable):
        raise ConfigError(f"horizons must be a list of numbers (clock units), got "
                          f"{horizons!r}")
    values = [check_horizon(h) for h in horizons]
    if not values:
        raise ConfigError("horizons needs at least one value (or None for the default H)")
    labels = [horizon_label(h) for h in values]
    check_distinct(labels, "horizons", "horizon")
    rows = [(lbl, "horizon-oracle", {"horizon": h})
            for lbl, h in zip(labels, values, strict=True)]
    taken = {lbl for lbl, _, _ in cells} & set(labels)
    if taken:
        raise ConfigError(f"policies already has a row labelled {sorted(taken)[0]!r}")
    at = next((i for i, (_, spec, params) in enumerate(cells)
               if spec == "horizon-oracle" and not params), None)  # not a row given its H
    if at is not None:
        return cells[:at] + rows + cells[at + 1:]
    tail = len(cells)
    while tail and cells[tail - 1][1] == INFINITE:
        tail -= 1
    return cells[:tail] + rows + cells[tail:]


def _head(table: ReplayTable) -> list[str]:
    """The header and rule of a Markdown table with a column per pool size of ``table``."""
    return ["| policy | " + " | ".join(f"{c:,} blocks" for c in table.capacities) + " |",
            "|---|" + "---:|" * len(table.capacities)]


def format_table(table: ReplayTable, metric: str = "block_hit_ratio", digits: int = 4) -> str:
    """A Markdown table: one row per policy, one column per pool size."""
    if metric not in METRICS:
        raise ConfigError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    lines = _head(table)
    for p in table.policies:
        cells = []
        for c in table.capacities:
            value = getattr(table.get(p, c), metric)
            cells.append(f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Comparison:
    """One policy against a baseline at one pool size, on one ratio metric (`compare`)."""

    policy: str
    baseline: str
    capacity_blocks: int
    metric: str
    value: float  #: the policy's metric
    base: float  #: the baseline's
    #: the difference ``value - base``, with its confidence interval by batch means
    #: (widened by `lag1_factor` where consecutive batches are correlated)
    difference: Interval
    #: the lag-1 autocorrelation of the per-batch differences
    lag1: float = 0.0

    @property
    def ratio(self) -> float:
        """``value / base`` (``nan`` when the baseline's is 0)."""
        return self.value / self.base if self.base else math.nan

    @property
    def significant(self) -> bool:
        """Whether the interval of the difference excludes 0."""
        d = self.difference
        return d.known and (d.low > 0 or d.high < 0)


def compare(table: ReplayTable, baseline: str = "lru", metric: str = "block_hit_ratio",
            confidence: float = 0.95) -> list[Comparison]:
    """Every other row of ``table`` against ``baseline`` at each size, on a ratio ``metric``
    (``block_hit_ratio``, ``token_hit_ratio``, ``prefill_saved_ratio``): the difference and
    its interval by batch means, paired batch by batch (see the module docstring).

    The difference of batch ``b`` is ``(numerator_policy - numerator_baseline) / mean
    denominator`` (hits over the mean accesses of a batch, ...), so the intervals' means are
    exactly ``value - base``.

    Raises:
        ConfigError: an unknown metric or baseline, a table without batches (results
            built by hand), or results whose batches do not line up.
    """
    if metric not in _RATIO_PARTS:
        raise ConfigError(f"compare needs a ratio metric ({', '.join(_RATIO_PARTS)}), got "
                          f"{metric!r}")
    if baseline not in table.policies:
        raise ConfigError(f"baseline {baseline!r} is not a row of the table (rows: "
                          f"{', '.join(table.policies)})")
    num, den = _RATIO_PARTS[metric]
    out = []
    for size in table.capacities:
        base = table.get(baseline, size)
        if len(base.batches) < 2:
            raise ConfigError(f"{baseline} at {size:,} blocks has {len(base.batches)} "
                              "batches; compare needs a replay of at least 2 requests")
        mean_den = math.fsum(b[den] for b in base.batches) / len(base.batches)
        for policy in table.policies:
            if policy == baseline:
                continue
            r = table.get(policy, size)
            if len(r.batches) != len(base.batches) or any(
                    a[0] != b[0] for a, b in zip(r.batches, base.batches)):
                raise ConfigError(f"{policy} and {baseline} at {size:,} blocks were not "
                                  "replayed on the same requests (their batches differ)")
            diffs = [(a[num] - b[num]) / mean_den if mean_den else 0.0
                     for a, b in zip(r.batches, base.batches)]
            iv = interval(diffs, confidence)
            rho = lag1(diffs)
            if rho > 0:
                iv = Interval(iv.mean, iv.half * lag1_factor(rho), iv.n, iv.confidence)
            out.append(Comparison(policy, baseline, size, metric, getattr(r, metric),
                                  getattr(base, metric), iv, rho))
    return out


def lag1(values: Sequence[float]) -> float:
    """The lag-1 autocorrelation of ``values`` (0 for fewer than 3, or no spread)."""
    n = len(values)
    if n < 3:
        return 0.0
    m = math.fsum(values) / n
    dev = [v - m for v in values]
    var = math.fsum(d * d for d in dev)
    if var == 0:
        return 0.0
    return math.fsum(dev[i] * dev[i + 1] for i in range(n - 1)) / var


def lag1_factor(rho: float) -> float:
    """How much wider a mean's interval is when its values have lag-1 autocorrelation
    ``rho > 0`` than when they are independent: ``sqrt((1 + rho) / (1 - rho))``, the
    variance factor of the mean of an AR(1) sequence, with ``rho`` capped at `MAX_LAG1`."""
    rho = min(rho, MAX_LAG1)
    return math.sqrt((1.0 + rho) / (1.0 - rho))


def format_comparison(table: ReplayTable, baseline: str = "lru",
                      metric: str = "block_hit_ratio", confidence: float = 0.95,
                      comparisons: Sequence[Comparison] | None = None) -> str:
    """A Markdown table of `compare`: per row and size, the ratio to ``baseline`` and the
    difference with its interval; **bold** where the interval excludes 0, ``n.s.`` (no
    significant difference) where it does not. ``comparisons``: what `compare` returned for
    these arguments, if the caller has it (it is not computed again)."""
    rows = (compare(table, baseline, metric, confidence) if comparisons is None
            else comparisons)
    lines = _head(table)
    for policy in table.policies:
        if policy == baseline:
            continue
        cells = []
        for c in rows:
            if c.policy != policy:
                continue
            d = c.difference
            text = f"{c.ratio:.3f}x ({d.mean:+.4f} ± {d.half:.4f}"
            cells.append(f"**{text})**" if c.significant else f"{text}, n.s.)")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_tier_table(table: ReplayTable, digits: int = 4) -> str:
    """A Markdown table of a tiered replay: per (policy, size), the hit ratio of each tier
    and in all, and the GiB read from and written to each lower tier."""
    first = next((r for r in table.results if r.tiers), None)
    if first is None:
        raise ConfigError("the table has no tiered results (replay with tiers=)")
    names = list(first.tiers["hits"])  # type: ignore[index]
    lower = names[1:]
    header = ("| policy | pool blocks | " + " | ".join(f"hit {n}" for n in names)
              + " | hit total | " + " | ".join(f"GiB read {n} | GiB written {n}" for n in lower)
              + " |")
    rule = "|---|---:|" + "---:|" * (len(names) + 1 + 2 * len(lower))
    lines = [header, rule]
    for r in table.results:
        if not r.tiers:
            continue
        ratios = r.tier_hit_ratios
        cells = [f"{ratios.get(n, 0.0):.{digits}f}" for n in names]
        cells.append(f"{r.block_hit_ratio:.{digits}f}")
        for n in lower:
            cells.append(f"{r.tiers['bytes_read'].get(n, 0) / 2 ** 30:,.1f}")
            cells.append(f"{r.tiers['bytes_written'].get(n, 0) / 2 ** 30:,.1f}")
        lines.append(f"| {r.policy} | {r.capacity_blocks:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------


def load_results(path: str | os.PathLike[str]) -> tuple[ReplayTable, dict[str, Any]]:
    """Read back what ``kvevict replay --out DIR`` wrote: ``path`` is ``DIR`` or its
    ``results.json``. Returns the table (`ReplayTable.from_rows`, the batches included, so
    `compare` runs on it against any row) and the rest of the file (trace, engine, sizes,
    command, ...).

    Raises:
        ConfigError: no such file, not JSON, no ``results`` list, or a bad row; each names
            the file.
    """
    file = os.fspath(path)
    if os.path.isdir(file):
        file = os.path.join(file, "results.json")
    try:
        with open(file, encoding="utf-8") as f:
            payload = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no replay results at {file} (kvevict replay --out DIR writes "
                          "DIR/results.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read replay results from {file}: {exc}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("results"), list):
        raise ConfigError(f"{file} is not a replay's results.json: it has no 'results' list")
    try:
        table = ReplayTable.from_rows(payload["results"])
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{file}: {exc}") from None
    meta = {k: v for k, v in payload.items() if k != "results"}
    return table, meta


def open_trace(trace: str | os.PathLike[str], format: str = "mooncake", *,
               block_size: int | None = None, time: str = "index",
               flag: str = "--block-size") -> tuple[Any, int]:
    """The trace a replay command reads, as a re-readable `kvevict.workloads.TraceFile`,
    and the block size to replay it with.

    ``trace`` is a bundled trace name (``"mooncake"``, format ``mooncake`` only) or a file.
    Mooncake: the trace's own block size; a ``block_size`` other than it is a `ConfigError`
    naming both and ``flag``. Alibaba: ``block_size`` or 16. JSONL and ShareGPT (token mode,
    or block ids of a size only the caller knows): ``block_size`` or 16. With
    ``time="arrival"`` the reader checks that arrivals never decrease, naming the line.
    """
    from kvevict.workloads import READERS, TraceFile
    from kvevict.workloads.formats import ALIBABA_BLOCK_SIZE
    from kvevict.workloads.mooncake import BUNDLED_TRACES, bundled_trace_path, check_block_size

    if format not in READERS:
        raise ConfigError(f"--format must be one of {', '.join(READERS)}, got {format!r}")
    _check_time(time)
    name = os.fspath(trace)
    if format == "mooncake" and name in BUNDLED_TRACES:
        path = str(bundled_trace_path(name))
    elif os.path.isfile(name):
        path = name
    elif format == "mooncake":
        raise ConfigError(f"--trace must be a bundled trace ({', '.join(BUNDLED_TRACES)}) or "
                          f"a Mooncake .jsonl file; {name!r} is neither")
    else:
        raise ConfigError(f"--trace must be a {format} trace file; {name!r} is not a file")
    if block_size is not None:
        _positive_int(flag, block_size)
    arrival = time == "arrival"
    if format == "mooncake":
        size = check_block_size(path, block_size, flag=flag)
        return TraceFile(path, "mooncake", block_size=size), size
    if format == "alibaba":
        size = block_size or ALIBABA_BLOCK_SIZE
        return TraceFile(path, "alibaba", block_size=size, arrival_order=arrival), size
    size = block_size or 16
    if format == "sharegpt":
        return TraceFile(path, "sharegpt", block_size=size), size
    return TraceFile(path, "jsonl", arrival_order=arrival), size


def _command_policies(text: str | None, modules: Sequence[str]) -> list[str] | None:
    """``--policies`` (None: `default_policies`), once the ``kvevict.policies`` entry points
    and the ``--policy-module`` modules are loaded; a name given twice is an error."""
    from kvevict.policies.registry import load_entry_point_policies, load_policy_modules

    load_entry_point_policies()
    load_policy_modules(modules, flag="--policy-module", cwd=True)
    if text is None:
        return None
    policies = [p.strip() for p in text.split(",") if p.strip()]
    check_distinct(policies, "--policies")
    return policies


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvevict.replay``: print the Markdown table of a replay (``kvevict replay``
    has these options and more: ``--format``, ``--out``, ``--records``, a progress bar)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvevict.replay",
        description="Block-level replay of a trace through residency policies "
                    "(one request at a time, no timing); prints a Markdown table.",
    )
    parser.add_argument("--trace", default="mooncake",
                        help="bundled trace name (mooncake) or a Mooncake .jsonl file")
    parser.add_argument("--sizes", default="1000,2000,5000,10000,20000",
                        help="comma-separated pool sizes in blocks")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policy names, 'infinite' for the infinite cache "
                             "(default: every registered online policy, then the oracles and "
                             "the infinite cache)")
    parser.add_argument("--horizons", default=None, metavar="H,...",
                        help="the horizon oracle at each H (clock units: seconds with --time "
                             "arrival), one row each")
    parser.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                        help="import MODULE (e.g. mypkg.mypolicies; found on sys.path or in "
                             "the current directory) before --policies is checked, so the "
                             "policies it registers can be named; repeatable")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block: the trace's (512 unless the file says "
                             "otherwise, the default) and no other")
    parser.add_argument("--time", choices=("index", "arrival"), default="index",
                        help="clock axis: request index or arrival seconds")
    parser.add_argument("--metric", default="block_hit_ratio",
                        choices=METRICS)
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        horizons = None if args.horizons is None else [
            float(h) for h in args.horizons.split(",") if h.strip()]
        policies = _command_policies(args.policies, args.policy_module)
        trace, block_size = open_trace(args.trace, "mooncake", block_size=args.block_size,
                                       time=args.time)
        table = replay_table(trace, policies, sizes, block_size, time=args.time,
                             horizons=horizons)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(table, args.metric))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
