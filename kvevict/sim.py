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

**Memory tiers** (``tiers=``, a `TierConfig`): below the pool, a host tier (and a disk tier
below it), metadata-only (`kvevict.tiers`): an evicted block is demoted when reloading it
is faster than recomputing it, a hit below the pool is reloaded. The reload takes time on
the links (`kvevict.run.TierTransfers`: one link per tier, shared, first come first served):
an admitted request waits for its KV (``reload_s``, a part of its TTFT), and with
``prefetch`` its lower-tier prefix starts loading while it waits in the queue. A policy given
by name that takes a ``cost_model`` (``market``, ``bayes``, ``gdsf``, ``dbms``) prices a
block with what losing it costs, a reload from the tier it would go to
(`kvevict.tiers.TierStack.policy_cost_model`), in the pool and in each tier; each tier runs
the pool's policy unless `TierConfig.policy` names another (LRU for an offline policy).
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
from kvevict.policies.registry import POLICIES, build_policy, is_offline, spec_name
from kvevict.pool import BlockPool
from kvevict.run import (
    CostModelExecutor,
    RunCollector,
    SessionGate,
    SimResult,
    TierTransfers,
    check_closed_loop,
    drive,
)
from kvevict.scheduler import Scheduler, SchedulerConfig, StepPlan
from kvevict.tiers import DEMOTE_RULES, TIER_PROFILES, Tier, TierProfile, TierStack, tier_profile
from kvevict.types import ManualClock, Request

__all__ = ["SimResult", "TierConfig", "host_link_profile", "simulate"]


def _blocks(instance: Any, attribute: Any, value: Any) -> None:
    low = 1 if attribute.name == "host_blocks" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"TierConfig.{attribute.name} must be an int >= {low} (blocks of the "
                          f"pool's size), got {value!r}")


def _profile(instance: Any, attribute: Any, value: Any) -> None:
    if value is None and attribute.name == "host_profile":
        return
    if isinstance(value, TierProfile):
        return
    if not isinstance(value, str) or value not in TIER_PROFILES:
        raise ConfigError(f"TierConfig.{attribute.name} must be a TierProfile or one of "
                          f"{', '.join(TIER_PROFILES)}, got {value!r}")


def _tier_policy(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"TierConfig.policy must be a registered policy name or None (the "
                          f"pool's), got {value!r}")


def _flag(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"TierConfig.{attribute.name} must be True or False, got {value!r}")


def _demote(instance: Any, attribute: Any, value: Any) -> None:
    if value not in DEMOTE_RULES:
        raise ConfigError(f"TierConfig.demote must be one of {', '.join(DEMOTE_RULES)}, got "
                          f"{value!r}")


def host_link_profile(cost: CostModel) -> TierProfile:
    """The host tier's link on the box ``cost`` describes: its reload bandwidth
    (`CostModel.reload_bytes_per_s`: the box's GPU host link, each GPU's share over its own
    under tensor parallelism, `kvevict.box.Box.cost_model`) both ways, and the latency of a
    copy call of ``TIER_PROFILES["host-pcie5"]`` (10 us)."""
    base = TIER_PROFILES["host-pcie5"]
    return TierProfile("host", cost.reload_bytes_per_s, cost.reload_bytes_per_s,
                       base.latency_s, real=True,
                       source=f"the box's GPU host link ({cost.reload_bytes_per_s / 1e9:g} GB/s "
                              f"per direction); {base.latency_s * 1e6:g} us per copy as "
                              "host-pcie5")


@attrs.frozen
class TierConfig:
    """Memory tiers below the simulator's pool, metadata-only (`kvevict.tiers`).

    Attributes:
        host_blocks: blocks of the host tier (tier 1), >= 1.
        disk_blocks: blocks of a disk tier below it (tier 2); 0 (the default) for none.
        host_profile: the host tier's link (a `kvevict.tiers.TierProfile` or a name in
            `kvevict.tiers.TIER_PROFILES`); None (the default): the box's GPU host link
            (`host_link_profile` of the run's cost model).
        disk_profile: the disk tier's link to the host tier (default ``"nvme"``, PCIe 5.0
            NVMe staged through host memory; ``"nvme-gds"`` reads straight into HBM).
        policy: the tiers' residency policy by name; None (the default): the pool's when it
            is given by name and online, else ``"lru"``.
        prefetch: start loading a request's lower-tier prefix while it waits in the queue
            (`kvevict.run.TierTransfers`).
        demote: ``"cost"`` (demote what is faster to reload than to recompute, the default)
            or ``"always"`` (`kvevict.tiers.DEMOTE_RULES`).
    """

    host_blocks: int = attrs.field(validator=_blocks)
    disk_blocks: int = attrs.field(default=0, validator=_blocks)
    host_profile: TierProfile | str | None = attrs.field(default=None, validator=_profile)
    disk_profile: TierProfile | str = attrs.field(default="nvme", validator=_profile)
    policy: str | None = attrs.field(default=None, validator=_tier_policy)
    prefetch: bool = attrs.field(default=False, validator=_flag)
    demote: str = attrs.field(default="cost", validator=_demote)

    def stack(self, cost: CostModel, pool_policy: str | Policy) -> TierStack:
        """A fresh `kvevict.tiers.TierStack` of these tiers, pricing with ``cost``; its
        tiers run `policy`, or ``pool_policy`` when that is an online policy's name."""
        policy = self.policy
        if policy is None:
            online = isinstance(pool_policy, str) and not is_offline(pool_policy)
            policy = pool_policy if online else "lru"
        elif is_offline(policy):
            raise ConfigError(f"TierConfig.policy {policy!r} is offline (it needs the future); "
                              "a tier runs an online policy")
        host = host_link_profile(cost) if self.host_profile is None else tier_profile(
            self.host_profile)
        tiers = [Tier(self.host_blocks, host, policy=policy, name="host")]
        if self.disk_blocks:
            tiers.append(Tier(self.disk_blocks, tier_profile(self.disk_profile),
                              policy=policy, name="disk"))
        return TierStack(tiers, cost_model=cost, demote=self.demote)


class _ZeroCostExecutor(CostModelExecutor):
    def step_parts(self, plan: StepPlan) -> tuple[float, float]:
        return 0.0, 0.0


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
             records: bool | None = None, tiers: TierConfig | None = None,
             closed_loop: bool = True) -> SimResult:
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
    already), not when it streams. ``tiers``: memory tiers below the pool (see **Memory
    tiers** in the module docstring; timed runs only). ``closed_loop``: a session's request
    is not sent before the answer it follows exists (`kvevict.run.SessionGate`, timed runs
    only); False sends every request at its trace arrival (open loop).
    """
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ConfigError(f"requests must be an iterable of Request objects, got "
                          f"{type(requests).__name__}")
    if records is not None and not isinstance(records, bool):
        raise ConfigError(f"records must be True, False or None, got {records!r}")
    check_closed_loop(closed_loop)
    if tiers is not None:
        if not isinstance(tiers, TierConfig):
            raise ConfigError(f"tiers must be a TierConfig or None, got {type(tiers).__name__}")
        if not timing:
            raise ConfigError("tiers= needs a timed run (timing=True): a reload's time is "
                              "what the tiers cost")
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
    clock = ManualClock()
    pool = BlockPool(capacity_blocks, block_size, layout, storage=False)
    if tiers is not None and isinstance(policy, str) and not offline:
        # by name: the manager builds it with the stack's reload-aware cost model
        stack = tiers.stack(cost or CostModel(), policy)
        manager = KVCacheManager(pool, policy, clock=clock, admission=admission, tiers=stack,
                                 **(policy_params or {}))
    else:
        params = dict(policy_params or {})
        named = spec_name(policy)  # "market(horizon=60)" takes what "market" takes
        if (cost is not None and isinstance(policy, str) and not offline and named in POLICIES
                and "cost_model" in POLICIES.parameters(named) and "cost_model" not in params):
            params["cost_model"] = cost  # price with the box's costs, as the executor charges
        policy_obj = build_policy(policy, params, requests=ordered if offline else None,
                                  block_size=block_size,
                                  time_axis="arrival" if timing else "index")
        stack = None if tiers is None else tiers.stack(cost or CostModel(), policy)
        manager = KVCacheManager(pool, policy_obj, clock=clock, admission=admission,
                                 tiers=stack)
    if timing:
        executor: CostModelExecutor = CostModelExecutor(cost or CostModel(), clock)
        cfg = config or SchedulerConfig()
    else:
        executor = _ZeroCostExecutor(cost or CostModel(), clock)
        cfg = SchedulerConfig(max_num_batched_tokens=2**62, max_num_seqs=1)
    collector = RunCollector(block_size, executor.cost, records=records)
    transfers = None if tiers is None else TierTransfers(manager, prefetch=tiers.prefetch)
    scheduler = Scheduler(manager, executor, cfg, on_finish=collector.finish,
                          keep_finished=False, transfers=transfers)
    gate = SessionGate() if closed_loop and timing else None
    drive(scheduler, ordered, clock, on_add=collector.admit, sessions=gate)
    return collector.result(scheduler, clock, name, gate)
