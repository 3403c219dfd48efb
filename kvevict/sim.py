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
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

import attrs

from kvevict.admission import Admission
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy
from kvevict.policies.registry import build_policy
from kvevict.pool import BlockPool
from kvevict.run import CostModelExecutor, SimResult, collect, drive
from kvevict.scheduler import Scheduler, SchedulerConfig, StepPlan
from kvevict.types import ManualClock, Request

__all__ = ["SimResult", "simulate"]


class _ZeroCostExecutor(CostModelExecutor):
    def step_seconds(self, plan: StepPlan) -> float:
        return 0.0


def simulate(requests: SequenceABC[Request], policy: str | Policy = "lru", *,
             capacity_blocks: int | None = None, cache_bytes: float | None = None,
             layout: KVLayout | None = None, block_size: int = 16,
             cost: CostModel | None = None, config: SchedulerConfig | None = None,
             admission: Admission | None = None, timing: bool = True,
             policy_params: dict[str, Any] | None = None) -> SimResult:
    """Replay ``requests`` (any order; sorted by arrival) and measure.

    Give the capacity as ``capacity_blocks`` or as ``cache_bytes`` with a ``layout``.
    ``policy`` is a name (with ``policy_params``) or an instance, built by
    `kvevict.policies.registry.build_policy`: an offline policy (``"belady"``) gets the
    trace's future on the arrival axis. With ``timing=False`` the run is the plain
    block-level replay (see the module docstring).
    """
    if not requests:
        raise ConfigError("simulate() needs at least one request")
    if capacity_blocks is None:
        if cache_bytes is None or layout is None:
            raise ConfigError("give capacity_blocks=, or cache_bytes= with layout=")
        capacity_blocks = layout.blocks_for_bytes(cache_bytes, block_size)
        if capacity_blocks < 1:
            raise ConfigError(f"{cache_bytes} bytes hold no block of {block_size} tokens of "
                              f"{layout.name or 'this model'}")
    ordered = sorted(requests, key=lambda r: r.arrival)
    if not timing:
        ordered = [attrs.evolve(r, arrival=float(i), output_len=0, output_tokens=None)
                   for i, r in enumerate(ordered)]
    name = policy if isinstance(policy, str) else type(policy).__name__.lower()
    policy_obj = build_policy(policy, policy_params, requests=ordered, block_size=block_size,
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
    scheduler = Scheduler(manager, executor, cfg)
    drive(scheduler, ordered, clock)
    return collect(scheduler, ordered, clock, name)


