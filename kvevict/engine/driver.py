"""Run requests through the shared scheduler, the manager and the real model, and measure.

`run_engine` is the engine's counterpart of `kvevict.sim.simulate`: the same `Scheduler`
and run loop (`kvevict.run`: `drive`, `collect`), with `EngineExecutor` running the model
instead of a cost model pricing the steps. It builds the policy with
`kvevict.policies.registry.build_policy` (an offline policy gets the requests' future on the
arrival axis) and returns an `EngineResult` with the measurements: per request queue wait,
prefill phase, TTFT, decode rate, cached and computed tokens, answers; per run peak pool
blocks, torch and OS memory (`kvevict.engine.memory`), where the KV tensor lives.

With ``tiers`` (a `kvevict.tiers.TierStack` holding real bytes: a host tensor, a disk
directory; `kvevict.engine.tiers.engine_tiers` builds one) a block the policy evicts is
demoted below the pool instead of lost, and a request whose prefix continues there reloads it
(copied back into pool blocks before its prefill, so the model never recomputes it). The
reload is real work on the engine's clock: it happens while the scheduler admits the request,
between two steps, so its measured seconds are charged to the next step like the rest of the
cache management. `EngineResult.tiers` reports what moved (`kvevict.engine.tiers.tier_report`).

With ``token_policy`` (a `kvevict.tokens` name or `TokenPolicy`, ``token_budget``,
``token_params``) every sequence keeps at most ``token_budget`` tokens per layer
(`kvevict.engine.tokens`); the manager is built with the executor's ``uncacheable``
predicate, so a request that may be cut neither hits nor caches blocks.
`EngineResult.token_positions` holds what each request kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any

import attrs
import numpy as np
import torch

from kvevict.cost import CostModel
from kvevict.engine.executor import EngineExecutor, check_time_scale
from kvevict.engine.memory import kv_placement, process_memory, reset_peak_rss
from kvevict.engine.model import LlamaModel
from kvevict.engine.tiers import tier_report
from kvevict.errors import ConfigError
from kvevict.hashing import block_hashes
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy
from kvevict.policies.registry import (
    POLICIES,
    build_policy,
    is_offline,
    spec_name,
    with_spec_params,
)
from kvevict.pool import BlockPool
from kvevict.run import (
    RequestRecord,
    SessionGate,
    SimResult,
    check_closed_loop,
    collect,
    drive,
)
from kvevict.scheduler import Scheduler, SchedulerConfig
from kvevict.tiers import TierPricedCost, TierStack
from kvevict.tokens import TokenPolicy
from kvevict.types import ManualClock, Request

__all__ = ["EngineResult", "default_policy_params", "in_engine_seconds", "run_engine",
           "tier_priced_cost", "unbounded_capacity"]


def unbounded_capacity(requests: SequenceABC[Request], block_size: int,
                       max_num_seqs: int) -> int:
    """Blocks that never run out for ``requests``: one per distinct full block the run can
    cache (prompts and fed-back outputs) plus a partial block per running sequence."""
    distinct: set[Any] = set()
    for r in requests:
        if r.tokens is None:
            raise ConfigError(f"request {r.request_id!r} has no token ids; the engine needs them")
        tokens = r.tokens
        if r.output_tokens is not None and r.output_len > 1:
            tokens = np.concatenate([tokens, r.output_tokens[:r.output_len - 1]])
        distinct.update(block_hashes(tokens, block_size))
    longest = max(-(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    return len(distinct) + max_num_seqs + longest


def _check_requests(requests: SequenceABC[Request], vocab_size: int) -> list[Request]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, SequenceABC):
        raise ConfigError("requests must be a list of Request")
    if not requests:
        raise ConfigError("run_engine() needs at least one request")
    for r in requests:
        if not isinstance(r, Request):
            raise ConfigError(f"requests must hold Request objects, got {type(r).__name__}")
        if r.tokens is None:
            raise ConfigError(f"request {r.request_id!r} is given as block hashes only; the "
                              "engine needs token ids")
        for name, ids in (("prompt", r.tokens), ("output", r.output_tokens)):
            if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ConfigError(
                    f"request {r.request_id!r}: {name} token ids lie in [{ids.min()}, "
                    f"{ids.max()}], outside the model's vocabulary [0, {vocab_size}); "
                    f"generate the workload with vocab_size={vocab_size}")
    return sorted(requests, key=lambda r: r.arrival)


def default_policy_params(policy: str, cost: CostModel | None,
                          block_size: int) -> dict[str, Any]:
    """What `run_engine` gives a named policy unless told otherwise: the cost model (to
    cost-aware policies: market, bayes, dbms) and the block size, where it takes them. Pass
    the same to `kvevict.sim.simulate` for a matching simulation. An offline policy gets
    none: it is built from the requests."""
    if is_offline(policy):
        return {}
    accepted = POLICIES.parameters(spec_name(policy))
    params: dict[str, Any] = {}
    if cost is not None and "cost_model" in accepted:
        params["cost_model"] = cost
    if "block_size" in accepted:
        params["block_size"] = block_size
    return params


def tier_priced_cost(tiers: TierStack, cost: CostModel | None, time_scale: float,
                     bytes_per_block: int) -> TierPricedCost:
    """The cost model a value-aware pool policy prices blocks with over ``tiers``
    (`kvevict.tiers.TierPricedCost`: losing a block from the pool costs the reload of its
    ``bytes_per_block`` from the tier below, or its recompute when that is cheaper), on the
    workload's clock: ``cost`` is in workload seconds (None: the stack's own model, in
    engine seconds), the reload in engine seconds times ``time_scale``."""
    engine = tiers.cost_model if cost is None else cost.scaled(1 / time_scale)
    loss = tiers.tiers[0].profile.transfer_seconds(bytes_per_block)
    fields = {f.name: getattr(engine, f.name) for f in attrs.fields(CostModel)}
    priced = TierPricedCost(**fields, loss_reload_s=loss, kept_reload_s=0.0)
    return attrs.evolve(priced.scaled(time_scale), loss_reload_s=loss * time_scale)


def _policy(policy: str | Policy, ordered: list[Request], block_size: int,
            cost: CostModel | None, params: dict[str, Any] | None,
            tiers: TierStack | None = None, time_scale: float = 1.0,
            bytes_per_block: int = 0) -> Policy:
    """`build_policy`: a named policy gets `default_policy_params` overridden by ``params``;
    an offline one the future of ``ordered`` on the arrival axis. Over ``tiers`` a policy
    that takes a cost model gets `tier_priced_cost` (unless ``params`` set one)."""
    if isinstance(policy, str):
        # parameters in the name (`parse_spec`) are the caller's: they override the defaults
        policy, params = with_spec_params(policy, params)
        defaults = default_policy_params(policy, cost, block_size)
        if tiers is not None and not is_offline(policy) and \
                "cost_model" in POLICIES.parameters(policy):
            defaults["cost_model"] = tier_priced_cost(tiers, cost, time_scale, bytes_per_block)
        params = {**defaults, **(params or {})}
    return build_policy(policy, params, requests=ordered, block_size=block_size,
                        time_axis="arrival")


@attrs.frozen
class EngineResult:
    """One engine run: what the simulator reports, measured, plus the engine's own numbers.

    Times in ``records``, ``makespan`` and the summary are **engine seconds** (the clock's
    workload seconds divided by ``time_scale``).
    """

    sim: SimResult  #: the run in the simulator's terms (`SimResult.summary` works)
    time_scale: float
    answers: dict[Any, tuple[int, ...]]
    margins: dict[Any, tuple[float, ...]]
    top_logits: dict[Any, tuple[float, ...]]
    engine_prefill_tokens: dict[Any, int]
    engine: dict[str, Any]  #: steps, busy/model/host seconds, work counters
    memory: dict[str, Any]  #: peak pool blocks, torch peak, OS RSS
    kv: dict[str, Any]  #: `kv_placement`
    #: what the tiers below the pool did (`kvevict.engine.tiers.tier_report`); None without
    tiers: dict[str, Any] | None = None
    #: token eviction: request id -> per layer, the original positions of the tokens it
    #: stored after its last forward; None without a token policy
    token_positions: dict[Any, tuple[tuple[int, ...], ...]] | None = None

    @property
    def policy(self) -> str:
        return self.sim.policy

    def summary(self, cold_requests: int = 0) -> dict[str, Any]:
        """`SimResult.summary` of the run plus engine numbers; with ``cold_requests`` the
        first ones (by arrival) are also summarised apart from the rest (``cold`` /
        ``warm``)."""
        out = self.sim.summary()
        recs = self.sim.records
        out["decode_tokens_per_s_p50"] = _p50([_decode_rate(r) for r in recs])
        out["engine"] = dict(self.engine)
        out["memory"] = dict(self.memory)
        if self.tiers is not None:
            out["tiers"] = dict(self.tiers)
        if cold_requests:
            out["cold"] = _phase(recs[:cold_requests])
            out["warm"] = _phase(recs[cold_requests:])
        return out

    def request_rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per request (engine seconds)."""
        rows = []
        for r in self.sim.records:
            rows.append({
                "request_id": r.request_id, "session_id": r.session_id,
                "workload_class": r.workload_class, "arrival_s": round(r.arrival, 6),
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "computed_prefill_tokens": r.computed_prefill_tokens,
                "engine_prefill_tokens": self.engine_prefill_tokens.get(r.request_id, 0),
                "queue_wait_s": round(r.queue_wait, 6),
                "prefill_s": round(r.ttft - r.queue_wait, 6), "ttft_s": round(r.ttft, 6),
                "decode_s": round(r.finish - r.arrival - r.ttft, 6),
                "output_tokens": r.output_tokens,
                "decode_tokens_per_s": round(_decode_rate(r), 3),
                "preemptions": r.preemptions,
            })
        return rows


def _p50(values: list[float]) -> float:
    return round(float(np.median(values)), 6) if values else 0.0


def _decode_rate(r: RequestRecord) -> float:
    """Tokens per second after the first one, as the user sees them stream."""
    seconds = r.finish - r.arrival - r.ttft
    return (r.output_tokens - 1) / seconds if r.output_tokens > 1 and seconds > 0 else 0.0


def _phase(recs: SequenceABC[RequestRecord]) -> dict[str, Any]:
    ttft = np.array([r.ttft for r in recs])
    return {
        "requests": len(recs),
        "ttft_p50": round(float(np.percentile(ttft, 50)), 6) if len(ttft) else 0.0,
        "ttft_p95": round(float(np.percentile(ttft, 95)), 6) if len(ttft) else 0.0,
        "queue_wait_p50": _p50([r.queue_wait for r in recs]),
        "prefill_s_p50": _p50([r.ttft - r.queue_wait for r in recs]),
        "decode_tokens_per_s_p50": _p50([_decode_rate(r) for r in recs]),
    }


def in_engine_seconds(result: SimResult, time_scale: float) -> SimResult:
    """``result``, every time in workload seconds (a simulated run), with every time divided
    by ``time_scale`` (workload to engine seconds)."""
    if time_scale == 1.0:
        return result
    f = time_scale
    records = tuple(r.time_divided(f) for r in result.records)
    return attrs.evolve(result, records=records, makespan=result.makespan / f,
                        arrival_span=result.arrival_span / f,
                        busy_seconds=result.busy_seconds / f,
                        load_seconds=None if result.load_seconds is None
                        else result.load_seconds / f)


def _engine_times(result: SimResult, executor: EngineExecutor) -> SimResult:
    """The engine run's `SimResult` (collected on the workload clock) in engine seconds: its
    records and arrival span divided by the time scale, its busy seconds the steps' measured
    time, and its ``load_seconds`` the work its pricer priced (the cost model the engine was
    given, in engine seconds; None without one) rescaled to the engine's measured speed
    (times measured over priced seconds of the same steps). So `SimResult.measured_load` is
    the engine's own work per second of arrivals, each decode step's shared part split at the
    batch the box ran when it was full, as for a simulated run, in measured seconds."""
    priced = result.load_seconds  # the pricer's engine seconds
    load = (None if priced is None or executor.predicted_seconds <= 0
            else priced * executor.busy_seconds / executor.predicted_seconds)
    scaled = in_engine_seconds(result, executor.time_scale)
    return attrs.evolve(scaled, busy_seconds=executor.busy_seconds, load_seconds=load)


def run_engine(requests: SequenceABC[Request], model: LlamaModel, policy: str | Policy = "lru",
               *, capacity_blocks: int, block_size: int = 16, time_scale: float = 1.0,
               config: SchedulerConfig | None = None, cost: CostModel | None = None,
               policy_params: dict[str, Any] | None = None, teacher_forcing: bool = True,
               check: bool = False, on_step: Callable[[Scheduler], None] | None = None,
               timer: Callable[[], float] = time.perf_counter,
               tiers: TierStack | None = None,
               token_policy: str | TokenPolicy | None = None,
               token_budget: int | None = None,
               token_params: dict[str, Any] | None = None,
               closed_loop: bool = True) -> EngineResult:
    """Replay ``requests`` through the scheduler, the manager and the real model.

    Args:
        requests: with token ids inside the model's vocabulary (any order; sorted by
            arrival). Arrivals are workload seconds.
        model: the `LlamaModel` (its device holds the pool).
        policy: a registered name (``"belady"`` gets the trace's future) or an instance.
        capacity_blocks: pool size in blocks (`unbounded_capacity` for a pool that never
            evicts).
        block_size: tokens per block.
        time_scale: workload seconds per engine second (see the module docstring).
        config: the scheduler's knobs (default `SchedulerConfig()`).
        cost: a `CostModel` in workload seconds, given to cost-aware policies (market,
            bayes, dbms) as ``cost_model`` unless ``policy_params`` set one; it also prices
            the records' ``recompute_prefill_s`` (the default `CostModel` when None).
        policy_params: extra parameters of a named policy.
        teacher_forcing: feed back the requests' fixed output tokens (see the module
            docstring).
        check: call ``manager.check()`` after every step and verify the fed tokens (slow).
        on_step: called with the scheduler after every step.
        timer: the step timer (see `EngineExecutor`).
        closed_loop: a session's request waits for the answer it follows
            (`kvevict.run.SessionGate`), as in the simulator; False sends every request at
            its arrival.
        tiers: memory tiers below the pool (see the module docstring), a fresh stack per
            run (a stack serves one pool); its cost model, which decides what is worth
            demoting, is in engine seconds. A named policy that takes a cost model prices
            blocks with `tier_priced_cost`.
        token_policy: token eviction, as `EngineExecutor` takes it (see the module
            docstring); the engine dict then counts ``token_compactions``, ``token_dropped``
            and ``token_freed_blocks``.
        token_budget: the token policy's budget, as `EngineExecutor` takes it.
        token_params: the token policy's parameters, as `EngineExecutor` takes them.
    """
    if not isinstance(model, LlamaModel):
        raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
    check_time_scale(time_scale)
    check_closed_loop(closed_loop)
    ordered = _check_requests(requests, model.config.vocab_size)
    if tiers is not None and not isinstance(tiers, TierStack):
        raise ConfigError(f"tiers must be a kvevict.tiers.TierStack, got {type(tiers).__name__}")
    pool = BlockPool(capacity_blocks, block_size, model.config.layout(), device=model.device)
    policy_obj = _policy(policy, ordered, block_size, cost, policy_params, tiers,
                         float(time_scale), pool.bytes_per_block)
    name = policy if isinstance(policy, str) else type(policy).__name__.lower()
    clock = ManualClock()
    executor = EngineExecutor(model, pool, clock, time_scale=time_scale,
                              teacher_forcing=teacher_forcing, check_tokens=check,
                              timer=timer,
                              cost=None if cost is None else cost.scaled(1 / time_scale),
                              token_policy=token_policy, token_budget=token_budget,
                              token_params=token_params)
    manager = KVCacheManager(pool, policy_obj, clock=clock, tiers=tiers,
                             uncacheable=executor.uncacheable)
    scheduler = Scheduler(manager, executor, config or SchedulerConfig())
    cuda = pool.device is not None and pool.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(pool.device)
    rss_reset = reset_peak_rss()
    executor.reset_timer()
    def after_step(s: Scheduler) -> None:
        if check:
            manager.check()
        if on_step is not None:
            on_step(s)

    gate = SessionGate() if closed_loop else None
    sent: list[Request] = []
    drive(scheduler, ordered, clock, after_step if check or on_step is not None else None,
          on_add=lambda state: sent.append(state.request), sessions=gate)
    sim = collect(scheduler, sent, clock, name, cost=cost, sessions=gate)  # cost prices recomputes
    memory: dict[str, Any] = {"peak_pool_blocks": manager.stats.peak_blocks_used,
                              "pool_blocks": capacity_blocks,
                              "peak_pool_bytes": manager.stats.peak_blocks_used
                              * pool.bytes_per_block}
    if cuda:
        memory["torch_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(pool.device)
        memory["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(pool.device)
    else:
        memory["torch_peak_allocated_bytes"] = None  # the CPU allocator keeps no statistics
    os_mem = process_memory()
    os_mem["peak_is_per_run"] = rss_reset
    memory["os"] = os_mem
    engine = {
        "steps": executor.steps, "busy_s": round(executor.busy_seconds, 6),
        "model_s": round(executor.model_seconds, 6), "host_s": round(executor.host_seconds, 6),
        "first_step_s": round(executor.first_step_seconds or 0.0, 6),
        "predicted_busy_s": round(executor.predicted_seconds, 6) if cost is not None else None,
        "by_step_kind": {k: {"steps": int(v[0]), "busy_s": round(v[1], 6),
                             "predicted_s": round(v[2], 6) if cost is not None else None}
                         for k, v in executor.by_kind.items()},
        "prefill_tokens": executor.prefill_tokens, "decode_tokens": executor.decode_tokens,
        "skipped_tokens": executor.skipped_tokens, "peeks": executor.peeks,
        "stale_items": executor.stale_items,
        "output_tokens_per_busy_s": round(
            sum(r.output_tokens for r in sim.records) / executor.busy_seconds, 3)
        if executor.busy_seconds > 0 else 0.0,
    }
    tokens = executor.tokens
    if tokens is not None:
        engine.update(token_policy=repr(tokens.policy), token_budget=tokens.budget,
                      token_compactions=tokens.compactions, token_dropped=tokens.dropped_tokens,
                      token_freed_blocks=tokens.freed_blocks)
    return EngineResult(
        sim=_engine_times(sim, executor), time_scale=executor.time_scale,
        answers={k: tuple(v) for k, v in executor.answers.items()},
        margins={k: tuple(v) for k, v in executor.margins.items()},
        top_logits={k: tuple(v) for k, v in executor.top_logits.items()},
        engine_prefill_tokens=dict(executor.engine_prefill_tokens), engine=engine,
        memory=memory, kv=kv_placement(pool, model),
        tiers=None if tiers is None else tier_report(tiers, manager.stats.block_hits),
        token_positions=None if tokens is None else tokens.all_kept_positions(),
    )
