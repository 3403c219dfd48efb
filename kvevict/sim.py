"""The simulator: replay a trace through scheduler + manager + policy on a virtual clock.

The scheduler is the same one the built-in engine uses; only the executor differs, and the
run loop (`kvevict.run`: `drive`, `collect`) is shared. Here `CostModelExecutor` charges each
step what a `CostModel` says it costs and advances a `ManualClock`, so a run of thousands of
requests takes seconds. Per request it records arrival, queue wait, cached tokens, computed
prefill tokens, TTFT and finish; `SimResult` summarises hit ratios, recomputed prefill
tokens, TTFT percentiles, queue wait, throughput, evictions by class, preemptions and peak
blocks.

With ``timing=False`` the run degenerates to the plain block-level replay of
`kvevict.replay`: requests one at a time in arrival order, no decode, the clock at the
request index. The two agree exactly (a test checks it on the bundled Mooncake trace).

**Streaming.** ``requests`` may be any iterable in arrival order: a list (sorted here), or
a stream such as a `kvevict.workloads.TraceFile`, consumed lazily by `kvevict.run.drive`.
Finished requests leave the scheduler; the run keeps per request only what the summary
needs (`kvevict.run.RunColumns`, 60 bytes) unless ``records=True``, so a streamed run holds
the cache and the requests in flight, not the trace (see `kvevict.run`, **Memory**). An
offline policy (``"belady"``) needs the future: it is built from the same requests (a
re-iterable one, such as a `TraceFile`, is read once more for it; a one-shot iterator is
listed first) and holds what it needs, every access time of every block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from typing import Any

import attrs

from kvevict.admission import Admission
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy
from kvevict.policies.registry import build_policy, is_offline
from kvevict.pool import BlockPool
from kvevict.run import CostModelExecutor, RunCollector, SimResult, drive
from kvevict.scheduler import Scheduler, SchedulerConfig, StepPlan
from kvevict.types import ManualClock, Request

__all__ = ["SimResult", "simulate"]


class _ZeroCostExecutor(CostModelExecutor):
    def step_seconds(self, plan: StepPlan) -> float:
        return 0.0


class _Untimed:
    """The requests of an untimed run (``timing=False``), re-iterable when the source is: the
    ``i``-th at time ``i``, without decode."""

    def __init__(self, requests: Iterable[Request]) -> None:
        self.requests = requests

    def __iter__(self) -> Iterator[Request]:
        for i, r in enumerate(self.requests):
            yield attrs.evolve(r, arrival=float(i), output_len=0, output_tokens=None)


def simulate(requests: Iterable[Request], policy: str | Policy = "lru", *,
             capacity_blocks: int | None = None, cache_bytes: float | None = None,
             layout: KVLayout | None = None, block_size: int = 16,
             cost: CostModel | None = None, config: SchedulerConfig | None = None,
             admission: Admission | None = None, timing: bool = True,
             policy_params: dict[str, Any] | None = None,
             records: bool | None = None) -> SimResult:
    """Replay ``requests`` and measure.

    ``requests``: a list in any order (sorted by arrival here), or any other iterable in
    arrival order, streamed (see **Streaming** in the module docstring; an arrival earlier
    than the one before it is a `ConfigError` naming both). Give the capacity as
    ``capacity_blocks`` or as ``cache_bytes`` with a ``layout``. ``policy`` is a name (with
    ``policy_params``) or an instance, built by `kvevict.policies.registry.build_policy`: an
    offline policy (``"belady"``) gets the trace's future on the arrival axis. With
    ``timing=False`` the run is the plain block-level replay (see the module docstring).
    ``records``: keep a `kvevict.run.RequestRecord` per request in `SimResult.records`
    (memory in proportion to the trace); by default when ``requests`` is a list (held whole
    already), not when it streams.
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ConfigError(f"requests must be an iterable of Request objects, got "
                          f"{type(requests).__name__}")
    if records is not None and not isinstance(records, bool):
        raise ConfigError(f"records must be True, False or None, got {records!r}")
    if capacity_blocks is None:
        if cache_bytes is None or layout is None:
            raise ConfigError("give capacity_blocks=, or cache_bytes= with layout=")
        capacity_blocks = layout.blocks_for_bytes(cache_bytes, block_size)
        if capacity_blocks < 1:
            raise ConfigError(f"{cache_bytes} bytes hold no block of {block_size} tokens of "
                              f"{layout.name or 'this model'}")
    offline = isinstance(policy, str) and is_offline(policy)
    ordered: Iterable[Request]
    if isinstance(requests, SequenceABC):
        if not requests:
            raise ConfigError("simulate() needs at least one request")
        ordered = sorted(requests, key=lambda r: r.arrival)
        if records is None:
            records = True
    else:
        ordered = requests
        if offline and iter(requests) is requests:  # one pass for the future, one to run
            ordered = list(requests)
        if records is None:
            records = False
    if not timing:
        ordered = _Untimed(ordered)
        if isinstance(requests, SequenceABC):
            ordered = list(ordered)
    name = policy if isinstance(policy, str) else type(policy).__name__.lower()
    policy_obj = build_policy(policy, policy_params, requests=ordered if offline else None,
                              block_size=block_size,
                              time_axis="arrival" if timing else "index")
    clock = ManualClock()
    pool = BlockPool(capacity_blocks, block_size, layout, storage=False)
    manager = KVCacheManager(pool, policy_obj, clock=clock, admission=admission)
    if timing:
        executor: CostModelExecutor = CostModelExecutor(cost or CostModel(), clock)
        cfg = config or SchedulerConfig()
    else:
        executor = _ZeroCostExecutor(cost or CostModel(), clock)
        cfg = SchedulerConfig(max_num_batched_tokens=2**62, max_num_seqs=1)
    collector = RunCollector(block_size, executor.cost, records=records)
    scheduler = Scheduler(manager, executor, cfg, on_finish=collector.finish,
                          keep_finished=False)
    drive(scheduler, ordered, clock, on_add=collector.admit)
    return collector.result(scheduler, clock, name)
