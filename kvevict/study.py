"""A study: the cells of a policy comparison (policy x cache size x seed), run serially, in
worker processes, or as Ray tasks, with the same results every way.

A `Study` says where the requests come from (`Source`: a generated workload, one trace per
seed, or a trace file), the model's layout, the block size, the cost model and the
scheduler's settings. A `Cell` is one simulation of it: a policy at a cache size on one
seed's requests. `run_cell` runs one and returns its `SimResult.summary` plus the seed (and
the per-request records when the cell asks for them); `run_cells` runs a list of them.
A study's ``tiers`` (`kvevict.sim.TierConfig`, or a cell's own) put memory tiers below the
pool of its timed cells; each such cell's summary then has ``tiers`` (what moved, the links'
load):

- ``jobs=1``: one after another, in this process;
- ``jobs=N``: in ``N`` worker processes (`concurrent.futures.ProcessPoolExecutor`);
- ``ray=True``: as Ray tasks, on the cluster at ``ray_address`` or on a local one.

Each cell is deterministic (a seeded generator, a virtual clock), so the three give the same
list, in the order the cells were given; a test compares them cell for cell. A worker builds
a seed's requests once and keeps them for the next cell of the same seed, and imports the
study's ``policy_modules`` so that policies registered outside kvevict can be named there too.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import attrs

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.policies.market.admission import admission_for, check_admission
from kvevict.run import check_closed_loop
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import TierConfig
from kvevict.types import Request

__all__ = ["Cell", "Source", "Study", "TraceRequests", "run_cell", "run_cells"]

#: Trace readers by ``--format`` name.
READERS = ("jsonl", "mooncake", "alibaba", "sharegpt")


@attrs.frozen
class TraceRequests:
    """A trace file's requests as a re-iterable stream: each ``iter()`` reads the file afresh
    (`kvevict.workloads.TraceFile`) one request at a time, in file order, rate-scaled on the
    way (`kvevict.load.iter_rate_scaled`) when ``rate_scale`` is not 1.

    The file must be sorted by arrival: the Mooncake reader rejects an earlier timestamp
    (naming the line), and every run over the stream (`kvevict.run.in_arrival_order`)
    rejects an arrival earlier than the one before it, naming both requests."""

    path: str
    format: str = "jsonl"
    #: the Mooncake or Alibaba trace's block size (None: the reader's default)
    block_size: int | None = None
    rate_scale: float = 1.0

    def trace(self) -> Any:
        """The `kvevict.workloads.TraceFile` it reads."""
        from kvevict.workloads import TraceFile

        options: dict[str, Any] = {}
        if self.format in ("mooncake", "alibaba") and self.block_size is not None:
            options["block_size"] = self.block_size
        return TraceFile(self.path, self.format, **options)

    def __iter__(self) -> Iterator[Request]:
        requests: Iterable[Request] = self.trace()
        if self.rate_scale != 1.0:
            from kvevict.load import iter_rate_scaled

            requests = iter_rate_scaled(requests, self.rate_scale)
        return iter(requests)


@attrs.frozen
class Source:
    """Where a study's requests come from: ``workload`` (a generator name, with ``scale``
    and ``duration``; each seed its own trace) or ``trace`` (a file in ``format``, the same
    requests for every seed; ``block_size`` is the Mooncake trace's block size).
    ``rate_scale`` multiplies the request rate (`kvevict.load.rate_scaled`)."""

    workload: str | None = None
    trace: str | None = None
    format: str = "jsonl"
    scale: float = 1.0
    duration: float | None = None
    block_size: int | None = None
    rate_scale: float = 1.0

    def __attrs_post_init__(self) -> None:
        if (self.workload is None) == (self.trace is None):
            raise ConfigError("a Source takes exactly one of workload= and trace=")
        if self.format not in READERS:
            raise ConfigError(f"unknown trace format {self.format!r}; valid formats: "
                              f"{', '.join(READERS)}")

    def requests(self, seed: int) -> list[Request] | TraceRequests:
        """The requests of ``seed`` in arrival order: a generated workload's as a list,
        sorted; a trace file's (the same for every seed) as a `TraceRequests` stream, read
        afresh by every pass over it and never held whole."""
        if self.trace is not None:
            return TraceRequests(self.trace, self.format, self.block_size, self.rate_scale)
        from kvevict import workloads

        kwargs = {} if self.duration is None else {"duration": self.duration}
        requests = workloads.generate(self.workload, seed=seed, scale=self.scale,  # type: ignore[arg-type]
                                      **kwargs)
        requests = sorted(requests, key=lambda r: r.arrival)
        if self.rate_scale != 1.0:
            from kvevict.load import rate_scaled

            requests = rate_scaled(requests, self.rate_scale)
        return requests


@attrs.frozen
class Study:
    """What every cell of a comparison shares."""

    source: Source
    layout: KVLayout
    block_size: int
    cost: CostModel
    config: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    #: modules that register policies (``--policy-module``), imported by every worker
    policy_modules: tuple[str, ...] = ()
    #: admission control by name (`kvevict.policies.market.admission.admission_for`):
    #: ``"always"``, or ``"market"``, which defers in the cells of a policy that quotes prices
    #: (``market``); each cell's summary then records the admission it ran with
    #: (``"admission"``)
    admission: str = attrs.field(default="always",
                                 validator=lambda _study, _attribute, v: check_admission(v))
    #: memory tiers below the pool of every timed cell (`kvevict.sim.TierConfig`; a cell's
    #: own ``tiers`` replaces them); None: GPU only
    tiers: TierConfig | None = attrs.field(default=None,
                                           validator=lambda _s, _a, v: _check_tiers(v))
    #: a session's request waits for the answer it follows (`kvevict.run.SessionGate`);
    #: False: every request at its trace arrival (``--open-loop``)
    closed_loop: bool = attrs.field(default=True,
                                    validator=lambda _s, _a, v: check_closed_loop(v))


def _check_tiers(value: Any) -> None:
    if value is not None and not isinstance(value, TierConfig):
        raise ConfigError(f"tiers must be a kvevict.sim.TierConfig or None, got "
                          f"{type(value).__name__}")


#: what a cell runs: the timed simulation, or the exact untimed replay (`kvevict.replay`)
MODES = ("timed", "replay")


@attrs.frozen(order=True)
class Cell:
    """One simulation: ``policy`` at ``capacity_blocks`` on the requests of ``seed``;
    ``records`` asks for the per-request records in the result, ``ttfts`` for every
    request's TTFT alone. ``mode="replay"`` runs the
    plain block-level replay instead (`kvevict.replay.replay`: one request at a time, no
    timing), where Belady is the exact furthest-next-use oracle; ``capacity_blocks=None``
    there is a pool that never evicts (the infinite cache of that replay)."""

    policy: str
    capacity_blocks: int | None
    seed: int
    records: bool = False
    mode: str = attrs.field(default="timed")
    #: return every request's TTFT (``"ttfts"``: `SimResult.ttfts`, 8 bytes a request), for
    #: a TTFT CDF without the records
    ttfts: bool = False
    #: memory tiers of this cell (`kvevict.sim.TierConfig`), in place of the study's; None:
    #: the study's
    tiers: TierConfig | None = attrs.field(default=None, order=False,
                                           validator=lambda _s, _a, v: _check_tiers(v))

    @mode.validator
    def _check_mode(self, attribute: Any, value: Any) -> None:
        if value not in MODES:
            raise ConfigError(f"a cell's mode is one of {', '.join(MODES)}, got {value!r}")
        if self.tiers is not None and value != "timed":
            raise ConfigError("only a timed cell has memory tiers (the replay has no clock)")
        if self.capacity_blocks is None and value != "replay":
            raise ConfigError("only a replay cell may have an unbounded pool "
                              "(capacity_blocks=None)")


#: this process's requests by (source, seed): a worker builds each seed's trace once (a
#: trace file's is a `TraceRequests` stream: nothing is held)
_REQUESTS: dict[tuple[Source, int], list[Request] | TraceRequests] = {}


def study_requests(study: Study, seed: int) -> list[Request] | TraceRequests:
    """``study``'s requests of ``seed``, built once per process."""
    key = (study.source, seed)
    if key not in _REQUESTS:
        _REQUESTS.clear()  # one seed at a time: a worker keeps one trace, not all of them
        _REQUESTS[key] = study.source.requests(seed)
    return _REQUESTS[key]


def run_cell(study: Study, cell: Cell) -> dict[str, Any]:
    """Simulate ``cell``: its `SimResult.summary` with ``"seed"`` added, with ``"records"``
    (one dict per request, in arrival order) when the cell asks for them, and ``"ttfts"``
    (a float64 array, in arrival order) when it asks for those. A
    replay cell gives its policy, mode, seed, capacity, hit ratios, requests and evictions."""
    from kvevict.policies.registry import load_policy_modules
    from kvevict.sim import simulate

    if study.policy_modules:
        load_policy_modules(list(study.policy_modules), flag="--policy-module", cwd=True)
    requests = study_requests(study, cell.seed)
    if cell.mode == "replay":
        return _replay_cell(study, cell, requests)
    policy, admission = admission_for(study.admission, cell.policy)
    result = simulate(requests, policy, admission=admission,
                      capacity_blocks=cell.capacity_blocks, layout=study.layout,
                      block_size=study.block_size, cost=study.cost, config=study.config,
                      records=cell.records,
                      tiers=cell.tiers if cell.tiers is not None else study.tiers,
                      closed_loop=study.closed_loop)
    out = result.summary()
    out["seed"] = cell.seed
    if study.admission != "always":  # which cells deferred: the market's, not LRU's
        out["policy"], out["admission"] = cell.policy, "always" if admission is None else "market"
    if cell.records:
        out["records"] = [attrs.asdict(r) for r in result.records]  # type: ignore[union-attr]
    if cell.ttfts:
        out["ttfts"] = result.ttfts()
    return out


def _replay_cell(study: Study, cell: Cell, requests: Iterable[Request]) -> dict[str, Any]:
    from kvevict.replay import replay

    if cell.capacity_blocks is None:
        return _infinite_replay_cell(study, cell, requests)
    result = replay(requests, cell.policy, cell.capacity_blocks, study.block_size)
    return {"policy": cell.policy, "mode": "replay", "seed": cell.seed,
            "capacity_blocks": cell.capacity_blocks,
            "token_hit_ratio": round(result.token_hit_ratio, 6),
            "block_hit_ratio": round(result.block_hit_ratio, 6),
            "requests": result.requests, "evictions": result.evictions}


def _infinite_replay_cell(study: Study, cell: Cell, requests: Iterable[Request]
                          ) -> dict[str, Any]:
    """The replay cell of a pool that never evicts (``capacity_blocks=None``), counted
    without a pool: in the plain replay (`kvevict.replay`: one request at a time, prompts
    cached, nothing evicted) a request hits its longest prefix of blocks seen before, and
    an infinite cache that caches prompts only (`kvevict.run.InfiniteCache`,
    ``cache_output=False``) counts exactly that: the same blocks looked up and hit, the same
    tokens (a test checks it against the replay of a pool holding every block). It holds
    one bit per distinct dense block id instead of a pool and a record per block."""
    from kvevict.run import InfiniteCache

    cache = InfiniteCache(study.block_size, cache_output=False)
    bs = study.block_size
    n = blocks = block_hits = tokens = token_hits = 0
    for r in requests:
        hit, looked_up = cache.lookup(r)
        n += 1
        blocks += looked_up
        block_hits += hit
        tokens += r.prompt_len
        token_hits += min(hit * bs, r.prompt_len)
    return {"policy": cell.policy, "mode": "replay", "seed": cell.seed,
            "capacity_blocks": None,
            "token_hit_ratio": round(token_hits / tokens if tokens else 0.0, 6),
            "block_hit_ratio": round(block_hits / blocks if blocks else 0.0, 6),
            "requests": n, "evictions": 0}


def run_cells(study: Study, cells: Sequence[Cell], *, jobs: int = 1, ray: bool = False,
              ray_address: str | None = None,
              progress: Callable[[Cell], None] | None = None) -> list[dict[str, Any]]:
    """`run_cell` for every cell, in the order given: serially (``jobs=1``), in ``jobs``
    worker processes, or as Ray tasks (``ray=True``; ``ray_address`` names a running
    cluster, None starts a local one with ``jobs`` CPUs). ``progress`` is called with each
    cell as it finishes."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be a positive int, got {jobs!r}")
    cells = list(cells)
    if ray:
        return _run_ray(study, cells, jobs, ray_address, progress)
    if jobs == 1 or len(cells) <= 1:
        out = []
        for cell in cells:
            out.append(run_cell(study, cell))
            if progress is not None:
                progress(cell)
        return out
    # cells of one seed go to the same worker where possible: order them by seed so each
    # worker's consecutive cells reuse its trace (results are put back in the given order)
    order = sorted(range(len(cells)), key=lambda i: (cells[i].seed, i))
    results: list[dict[str, Any] | None] = [None] * len(cells)
    with ProcessPoolExecutor(max_workers=min(jobs, len(cells)),
                             mp_context=_mp_context()) as pool:
        futures = {pool.submit(run_cell, study, cells[i]): i for i in order}
        for future in as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if progress is not None:
                progress(cells[i])
    return results  # type: ignore[return-value]


def _mp_context() -> Any:
    """Fork where the platform has it (workers inherit the registry and imports at no
    cost); spawn elsewhere (the worker imports the study's policy modules itself)."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return multiprocessing.get_context(method)


def _run_ray(study: Study, cells: list[Cell], jobs: int, address: str | None,
             progress: Callable[[Cell], None] | None) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'kvevict[ray]'") from None
    started = False
    if not ray.is_initialized():
        if address is None:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
        started = True
    try:
        task = ray.remote(run_cell)
        study_ref = ray.put(study)
        refs = [task.remote(study_ref, cell) for cell in cells]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[dict[str, Any] | None] = [None] * len(cells)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                results[i] = ray.get(ref)
                if progress is not None:
                    progress(cells[i])
        return results  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()
