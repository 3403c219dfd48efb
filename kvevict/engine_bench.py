"""``kvevict engine-bench``: eviction policies on the real engine, repeated, next to the simulator.

`run_bench` replays generated workloads (one per workload seed) through the built-in engine
(`run_engine`), every policy ``repeats`` times, plus an **unbounded** pool in every repeat
(nothing is ever evicted: the reference for the answers and the infinite-cache hit ratio), and
simulates the same runs with a `CostModel` calibrated on this engine, so the simulator's
fidelity is a measured number with its spread:

1. **Cost model.** Loaded from a ``kvevict calibrate`` file, or calibrated on the fly over the
   lengths these workloads use (`kvevict.engine.calibrate`), with the clock the runs use.
2. **Time compression.** The workload's arrivals are workload seconds (an hour of chat). The
   engine plays them ``time_scale`` times faster (see `kvevict.engine.executor`): by default
   the factor that makes the offered load ``target_load`` (0.5) of the engine's compute, as
   the cost model estimates it for an infinite cache without batching, on the first seed's
   workload (one factor for every seed and repeat). Idle time is skipped, so a run lasts
   about as long as its compute.
3. **Pool size.** By default the size at which the simulator's LRU hits half the prompt
   tokens an infinite cache would on the first seed's workload (bisection over sizes), but
   never below what the largest request of any seed needs; the report says what it chose.
4. **Runs.** Repeat by repeat, seed by seed, every policy once on a fresh pool (the unbounded
   pool included), in an order rotated by one place per repeat, so that every policy's runs
   are spread over the whole benchmark and a slow drift of the machine's speed falls on all
   of them alike. The engine is deterministic in what it computes, not in how long it takes:
   each step's measured duration advances the clock, so arrivals land in different steps from
   one run to the next and latencies (and, through the batching, slightly the hits) vary
   between identical runs. The simulator is deterministic: one prediction per policy and seed.
   Cost-aware policies get the calibrated cost model (`default_policy_params`), in the
   simulator too.
5. **Replicates.** `replicates`: with one workload seed a repeat is the unit (the interval is
   the run-to-run spread of this workload); with several, a seed is, its repeats averaged
   (the repeats of one workload are not independent samples of the workload population).
6. **Report.** Per policy, every metric as mean ± 95% CI over the replicates
   (`kvevict.stats`); `fidelity`: measured token hit ratio and TTFT p50/p95 against the
   simulator's prediction, with the relative error (``predicted / measured - 1``) and its
   interval, and whether it is within 10%; the decision against LRU by the paired rule of
   ``kvevict simulate`` (`kvevict.report.choose_policy`: a policy is named only when its
   advantage lies beyond the interval of the paired per-replicate difference), on the
   *measured* load (each compared run's own work per second of arrivals, priced by the
   calibrated cost model at the engine's measured speed, `kvevict.run.SimResult.measured_load`:
   ρ ≥ 1 means the engine could not keep up, and the decision is then not made on latency;
   the busy time over the arrival span is about 1 whenever the engine is never idle, at any
   load, so it is not the load); whether every
   run's answers equal its seed's first unbounded run's (`compare_answers`).

**Tiers** (``host_bytes``, ``disk_dir``: ``kvevict engine-bench --host-gib X --disk-dir D``).
Every policy run gets a fresh `kvevict.engine.tiers.engine_tiers` stack below its pool: a
host tier (a second CPU tensor of ``host_bytes``) and a disk tier (checksummed block files in
a fresh subdirectory of ``disk_dir``, removed after the run), so an evicted block is demoted
and a hit below the pool reloads it. The links are measured on this machine first
(`kvevict.engine.tiers.measure_link`: host copies, cold disk reads) and the demotion rule
compares those reloads with the calibrated cost model's recompute; the result's ``"tiers"``
holds the fitted profiles, the crossover depth they give, and per run the blocks each tier
served, the reloads, the bytes moved and the measured reload seconds. The unbounded
reference runs without tiers, so the answer check proves the reloads lossless. The simulator
predicts the runs without tiers (its tiers are `kvevict.sim`'s business), so the fidelity
columns of a tiered benchmark compare the tiered engine against an untiered prediction.

All latencies are engine seconds: seconds of the run's timer, ``"wall"`` (`time.perf_counter`,
what a user waits) or ``"cpu"`` (`time.thread_time`, the CPU time of the engine's thread: what
the run would take with the core to itself, other processes' time left out; one torch thread
on a CPU device).

This module sits above both the simulator (`kvevict.sim`) and the engine (`kvevict.engine`),
which never import each other: it is the one place that runs both and compares them.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvevict.cost import CostModel
from kvevict.engine.answers import compare_answers
from kvevict.engine.calibrate import Calibration, calibrate, engine_description
from kvevict.engine.driver import (
    EngineResult,
    default_policy_params,
    in_engine_seconds,
    run_engine,
    unbounded_capacity,
)
from kvevict.engine.model import LlamaModel
from kvevict.engine.tiers import LinkFit, engine_tiers, measure_link
from kvevict.errors import ConfigError
from kvevict.policies.registry import is_offline
from kvevict.report import Choice, choose_policy, explain_choice
from kvevict.run import infinite_cache_hits
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.stats import Interval, aggregate, interval
from kvevict.types import Request

__all__ = ["FIDELITY_METRICS", "FIDELITY_TOLERANCE", "TIMERS", "auto_capacity",
           "auto_time_scale", "blocks_needed", "calibrate_for_workload", "fidelity",
           "format_report", "interval_dict", "replicates", "run_bench", "strip_answers"]

MIB = 2**20
REFERENCE = "unbounded"
BASELINE = "lru"
#: The clocks a run can be timed by: ``"wall"`` (what a user waits), ``"cpu"`` (the engine
#: thread's CPU time: other processes on a shared machine left out).
TIMERS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
TIMER_TEXT = {"wall": "time.perf_counter: wall-clock seconds, what a user waits",
              "cpu": "time.thread_time: the engine thread's CPU seconds, other processes left "
                     "out"}
#: The metrics `fidelity` compares by default.
FIDELITY_METRICS = ("token_hit_ratio", "ttft_p50", "ttft_p95")
#: The fidelity target: the prediction within 10% of the measurement (issue 12).
FIDELITY_TOLERANCE = 0.10


def blocks_needed(request: Request, block_size: int) -> int:
    """Blocks a request holds at its longest: its prompt plus its output."""
    return -(-(request.prompt_len + request.output_len) // block_size)


def auto_time_scale(requests: Sequence[Request], cost: CostModel, block_size: int,
                    target_load: float) -> tuple[float, float]:
    """``(time_scale, estimated busy engine seconds)``: the compression at which the
    workload offers ``target_load`` of the engine's compute (one request at a time, with an
    infinite cache: every prompt token not hit is prefilled, every output token after the
    first is one decode step at half the answer's length of context)."""
    if not 0 < target_load <= 10:
        raise ConfigError(f"target load must be in (0, 10], got {target_load}")
    ordered = sorted(requests, key=lambda r: r.arrival)
    hits = infinite_cache_hits(ordered, block_size)
    busy = 0.0
    for r, h in zip(ordered, hits, strict=True):
        p = r.prompt_len
        busy += cost.prefill_seconds(max(p - h, 1), min(h, p - 1))
        out = max(r.output_len - 1, 0)
        busy += out * cost.decode_seconds(p + out // 2, 1)
    span = ordered[-1].arrival - ordered[0].arrival
    if span <= 0 or busy <= 0:
        return 1.0, busy
    return span * target_load / busy, busy


def auto_capacity(requests: Sequence[Request], cost: CostModel, config: SchedulerConfig,
                  block_size: int, low: int, high: int, fraction: float = 0.5,
                  ) -> tuple[int, float, float]:
    """``(capacity, simulated LRU token hit ratio there, infinite-cache ratio)``: the pool
    size in ``[low, high]`` whose simulated LRU hit ratio is closest to ``fraction`` of the
    infinite cache's (bisection; LRU's hit ratio grows with the size)."""
    memo: dict[int, tuple[float, float]] = {}

    def hit(cap: int) -> float:
        if cap not in memo:
            s = simulate(requests, "lru", capacity_blocks=cap, block_size=block_size,
                         cost=cost, config=config).summary()
            memo[cap] = (s["token_hit_ratio"], s["infinite_cache_hit_ratio"])
        return memo[cap][0]

    hit(low)
    target = fraction * memo[low][1]
    if hit(low) >= target:
        return low, memo[low][0], memo[low][1]
    lo, hi = low, high  # hit(lo) < target <= hit(hi) (or hi is the largest size)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if hit(mid) < target:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda c: (abs(hit(c) - target), c))
    return best, memo[best][0], memo[best][1]


# -- replicates, intervals and the fidelity comparison ---------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mean_of(values: list[Any]) -> Any:
    """The mean of numbers, dicts averaged key by key, an equal other value kept; else None."""
    if all(_is_number(v) for v in values):
        return math.fsum(values) / len(values)
    if all(isinstance(v, Mapping) for v in values):
        out = {}
        for key in dict.fromkeys(k for d in values for k in d):
            mean = _mean_of([d[key] for d in values if key in d])
            if mean is not None:
                out[key] = mean
        return out
    first = values[0]
    return first if all(v == first for v in values[1:]) else None


def replicates(runs: Sequence[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """``(unit, cells)``: measured runs as the independent replicates `kvevict.stats` and
    `kvevict.report.choose_policy` take (cells: metrics plus ``"policy"``,
    ``"capacity_blocks"`` and ``"seed"``, the replicate label they pair on).

    Each run is a dict of metrics with ``"policy"``, ``"capacity_blocks"``, ``"seed"`` (the
    workload seed) and ``"repeat"``.

    - Runs of one workload seed: the unit is ``"repeat"``, one cell per run with ``"seed"``
      set to its repeat number. Repeat ``r`` of every policy ran in the same round, so pairing
      by repeat also cancels a slow drift of the machine's speed. The interval is the
      run-to-run spread on this one workload.
    - Runs of two or more seeds: the unit is ``"seed"``, one cell per (policy, capacity, seed)
      holding the mean of each numeric metric over that seed's repeats (nested dicts key by
      key; other values kept when equal). The repeats of one workload share its requests,
      so they are not independent samples of the workload population; their means are (the
      interval is over independent replications: Law and Kelton, *Simulation Modeling and
      Analysis*, 3rd ed., §9.4.1).

    Every cell also holds ``"workload_seed"`` and ``"repeats"`` (the runs it stands for).

    Raises:
        ConfigError: no runs, a run without one of those keys, or two runs with the same
            policy, capacity, seed and repeat.
    """
    if not runs:
        raise ConfigError("no runs to make replicates of")
    groups: dict[tuple[Any, Any, Any], list[Mapping[str, Any]]] = {}
    for i, run in enumerate(runs):
        missing = [k for k in ("policy", "capacity_blocks", "seed", "repeat") if k not in run]
        if missing:
            raise ConfigError(f"run {i} lacks {', '.join(map(repr, missing))}: each run is a "
                              "summary plus 'policy', 'capacity_blocks', 'seed' and 'repeat'")
        group = groups.setdefault((run["policy"], run["capacity_blocks"], run["seed"]), [])
        if any(r["repeat"] == run["repeat"] for r in group):
            raise ConfigError(f"two runs of policy {run['policy']!r} at "
                              f"{run['capacity_blocks']} blocks, seed {run['seed']!r}, repeat "
                              f"{run['repeat']!r}")
        group.append(run)
    seeds = {run["seed"] for run in runs}
    cells: list[dict[str, Any]] = []
    if len(seeds) < 2:
        for run in runs:
            cell = {k: v for k, v in run.items() if k != "repeat"}
            cell.update(seed=run["repeat"], workload_seed=run["seed"], repeats=1)
            cells.append(cell)
        return "repeat", cells
    for (policy, capacity, seed), group in groups.items():
        keys = [k for k in dict.fromkeys(k for r in group for k in r)
                if k not in ("policy", "capacity_blocks", "seed", "repeat")]
        cell: dict[str, Any] = {"policy": policy, "capacity_blocks": capacity, "seed": seed}
        for key in keys:
            mean = _mean_of([r[key] for r in group if key in r])
            if mean is not None:
                cell[key] = mean
        cell.update(workload_seed=seed, repeats=len(group))
        cells.append(cell)
    return "seed", cells


def _verdict(error: Interval | None, tolerance: float) -> str:
    """``"within"`` the tolerance, ``"outside"`` it, or ``"unresolved"`` (the interval
    straddles a bound); with one replicate the mean decides; ``"n/a"`` without an error."""
    if error is None:
        return "n/a"
    if not error.known:
        return "within" if abs(error.mean) <= tolerance else "outside"
    if error.low >= -tolerance and error.high <= tolerance:
        return "within"
    if error.low > tolerance or error.high < -tolerance:
        return "outside"
    return "unresolved"


def fidelity(runs: Sequence[Mapping[str, Any]], predictions: Sequence[Mapping[str, Any]], *,
             metrics: Sequence[str] = FIDELITY_METRICS,
             tolerance: float = FIDELITY_TOLERANCE,
             confidence: float = 0.95) -> list[dict[str, Any]]:
    """The simulator's prediction against the engine's measurement, with their spreads.

    ``runs`` are measured runs as `replicates` takes them; ``predictions`` one simulator
    summary per (policy, seed) (``"policy"``, ``"seed"`` and the metrics; the simulator is
    deterministic, so a prediction stands for every repeat of its seed). One row per
    (policy, capacity) of ``runs``, in their order, with ``"unit"`` and ``"n"`` (the
    replicates) and, per metric, ``"measured"``, ``"predicted"`` and ``"error"`` as
    `Interval`, and ``"verdict"``:

    - ``measured``: the interval over the replicates (`replicates`: repeats of one seed, or
      seeds with their repeats averaged);
    - ``predicted``: the interval over the seeds' predictions (unknown with one seed: one
      deterministic number);
    - ``error``: the interval of the per-replicate relative error ``predicted(seed) /
      measured - 1`` (a replicate measuring 0 is left out; ``None`` when all are);
    - ``verdict``: ``"within"`` when the error's interval lies inside ``±tolerance``,
      ``"outside"`` when it lies entirely beyond, ``"unresolved"`` when it straddles a bound;
      with one replicate (no interval) the mean error decides.

    Raises:
        ConfigError: a run whose (policy, seed) has no prediction, a metric missing from a run
            or a prediction, or a tolerance that is not a positive number.
    """
    if isinstance(tolerance, bool) or not _is_number(tolerance) or not tolerance > 0:
        raise ConfigError(f"the fidelity tolerance must be a positive number (0.10 for 10%), "
                          f"got {tolerance!r}")
    unit, cells = replicates(runs)
    predicted: dict[tuple[Any, Any], Mapping[str, Any]] = {}
    for p in predictions:
        predicted[(p["policy"], p["seed"])] = p
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["policy"], cell["capacity_blocks"]), []).append(cell)
    rows = []
    for (policy, capacity), group in groups.items():
        seeds = list(dict.fromkeys(c["workload_seed"] for c in group))
        for s in seeds:
            if (policy, s) not in predicted:
                raise ConfigError(f"no prediction for policy {policy!r}, seed {s!r}")
        row: dict[str, Any] = {"policy": policy, "capacity_blocks": capacity, "unit": unit,
                               "n": len(group), "tolerance": tolerance, "metrics": {}}
        for metric in metrics:
            for c in group:
                if metric not in c:
                    raise ConfigError(f"the run of {policy!r} (seed {c['workload_seed']!r}) "
                                      f"has no {metric!r}")
            for s in seeds:
                if metric not in predicted[(policy, s)]:
                    raise ConfigError(f"the prediction for {policy!r}, seed {s!r}, has no "
                                      f"{metric!r}")
            measured = interval([c[metric] for c in group], confidence)
            pred = interval([predicted[(policy, s)][metric] for s in seeds], confidence)
            errors = [predicted[(policy, c["workload_seed"])][metric] / c[metric] - 1
                      for c in group if c[metric] != 0]
            error = interval(errors, confidence) if errors else None
            row["metrics"][metric] = {"measured": measured, "predicted": pred, "error": error,
                                      "verdict": _verdict(error, tolerance)}
        rows.append(row)
    return rows


def interval_dict(value: Any) -> Any:
    """``value`` JSON-ready: every `Interval` in it (nested in dicts and lists) as
    `Interval.as_dict`."""
    if isinstance(value, Interval):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: interval_dict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [interval_dict(v) for v in value]
    return value


def _as_interval(d: Mapping[str, Any]) -> Interval:
    """An `Interval.as_dict` back as an `Interval`."""
    half = d["half"]
    return Interval(d["mean"], math.nan if half is None else half, d["n"], d["confidence"])


# -- the benchmark ---------------------------------------------------------------------------


def _error_pct(predicted: float, measured: float) -> float | None:
    if measured == 0:
        return None
    return round((predicted / measured - 1) * 100, 1)


def _run_entry(label: str, seed: Any, repeat: int, measured: EngineResult,
               predicted: dict[str, Any], cold: int,
               reference: EngineResult | None) -> dict[str, Any]:
    m = measured.summary(cold)
    entry: dict[str, Any] = {
        "policy": label, "seed": seed, "repeat": repeat,
        "capacity_blocks": measured.sim.capacity_blocks,
        "measured": m, "predicted": predicted,
        "error_pct": {k: _error_pct(predicted[k], m[k]) for k in FIDELITY_METRICS},
        "kv": measured.kv,
        "requests": measured.request_rows(),
    }
    entry["answers"] = (None if reference is None
                        else compare_answers(reference, measured).as_dict())
    return entry


def _workloads(requests: Sequence[Request] | Mapping[Any, Sequence[Request]],
               ) -> dict[Any, list[Request]]:
    if isinstance(requests, Mapping):
        if not requests:
            raise ConfigError("give at least one workload seed")
        items = list(requests.items())
    else:
        items = [(0, requests)]
    out = {}
    for seed, reqs in items:
        if isinstance(reqs, (str, bytes)) or not isinstance(reqs, Sequence):
            raise ConfigError(f"the workload of seed {seed!r} must be a list of Request, got "
                              f"{type(reqs).__name__}")
        if not reqs:
            raise ConfigError(f"the workload of seed {seed!r} holds no requests")
        out[seed] = sorted(reqs, key=lambda r: r.arrival)
    return out


def _timer(timer: Any, model: LlamaModel) -> tuple[str, Callable[[], float]]:
    """``(name, clock)`` of a `TIMERS` name or a callable (``"custom"``)."""
    if callable(timer):
        return "custom", timer
    if not isinstance(timer, str) or timer not in TIMERS:
        raise ConfigError(f"unknown timer {timer!r}; valid: {', '.join(TIMERS)}, or a callable "
                          "returning seconds")
    if timer == "cpu":
        import torch

        threads = torch.get_num_threads()
        if model.device.type != "cpu" or threads != 1:
            raise ConfigError(
                f"the 'cpu' timer measures the engine thread's CPU time, which counts all "
                f"the work only with one torch thread on a CPU device; got {threads} "
                f"thread(s) on {model.device.type}")
    return timer, TIMERS[timer]


def run_bench(requests: Sequence[Request] | Mapping[Any, Sequence[Request]], model: LlamaModel,
              policies: Sequence[str], *, repeats: int = 3, block_size: int = 16,
              capacity_blocks: int | None = None, time_scale: float | None = None,
              target_load: float = 0.5, config: SchedulerConfig | None = None,
              cost: CostModel | Calibration | None = None, cold_requests: int = 5,
              timer: str | Callable[[], float] = "wall", confidence: float = 0.95,
              check: bool = False, progress: Callable[[str], None] | None = None,
              host_bytes: float = 0, disk_dir: str | Path | None = None,
              disk_bytes: float = 2**30, demote: str = "cost",
              links: Mapping[str, LinkFit] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the JSON-ready result.

    Args:
        requests: token-id requests inside the model's vocabulary (workload seconds): one
            workload (labelled seed 0), or a mapping workload seed -> its requests.
        model: the engine's model.
        policies: policy names (each runs on a fresh pool of ``capacity_blocks``); LRU, the
            baseline of the decision, is added first when missing.
        repeats: engine runs per policy and seed.
        block_size: tokens per block.
        capacity_blocks: pool size (None: `auto_capacity`).
        time_scale: workload seconds per engine second (None: `auto_time_scale`).
        target_load: the offered load the automatic time scale aims at.
        config: scheduler knobs (default: 512 tokens per step, 64 sequences).
        cost: a `CostModel` of this engine in engine seconds, or the `Calibration` it came
            from (None: `calibrate_for_workload` now, with ``timer``).
        cold_requests: how many first requests count as the cold start.
        timer: the clock of the runs and of an on-the-fly calibration: a `TIMERS` name, or
            a callable returning seconds (recorded as ``"custom"``; a test's clock).
        confidence: of the intervals (0.95).
        check: ``manager.check()`` after every engine step (slow).
        progress: called with a line before each phase.
        host_bytes: a host tier of this size under every policy run's pool (0: none).
        disk_dir: a disk tier in a fresh subdirectory of this directory per run (None:
            none).
        disk_bytes: the disk tier's size.
        demote: the tiers' demotion rule (``"cost"``: what reloads faster than it
            recomputes; ``"always"``).
        links: measured links by tier name (``"host"``, ``"disk"``; default: measured now
            with `measure_link`).

    The result holds ``"runs"`` (every run: measured summary, the prediction for its seed,
    the error of that run, its requests and its answers' check), ``"predictions"`` (one per
    policy and seed), ``"summary"`` (per policy, every measured and predicted metric as an
    interval over the replicates), ``"fidelity"`` (`fidelity`'s rows), ``"load"`` (measured),
    ``"decision"`` (`choose_policy` on the replicates) and ``"lossless"``; with tiers,
    ``"tiers"`` (the links, their crossover depths, and per policy the tiers' counters).
    """
    say = progress or (lambda _line: None)
    workloads = _workloads(requests)
    if not policies:
        raise ConfigError("give at least one policy")
    if len(set(policies)) != len(policies):
        raise ConfigError(f"a policy is given twice in {', '.join(policies)}")
    if REFERENCE in policies:
        raise ConfigError(f"{REFERENCE!r} is the reference run's label, not a policy")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an int >= 1, got {repeats!r}")
    if isinstance(cold_requests, bool) or not isinstance(cold_requests, int) or \
            cold_requests < 0:
        raise ConfigError(f"cold requests must be an int >= 0, got {cold_requests!r}")
    timer, clock = _timer(timer, model)
    policies = list(policies) if BASELINE in policies else [BASELINE, *policies]
    seeds = list(workloads)
    first = workloads[seeds[0]]
    cfg = config or SchedulerConfig(max_num_batched_tokens=512)
    need = {s: max(blocks_needed(r, block_size) for r in w) for s, w in workloads.items()}
    min_blocks = max(need.values())
    unbounded = {s: unbounded_capacity(w, block_size, cfg.max_num_seqs)
                 for s, w in workloads.items()}
    calibration: dict[str, Any]
    if cost is None:
        say("calibrating the cost model on this engine")
        cost = calibrate_for_workload(model, [r for w in workloads.values() for r in w],
                                      block_size, cfg, timer=clock)
    if isinstance(cost, Calibration):
        calibration = {"source": "on the fly", "timer": timer, **cost.as_dict()}
        cost = cost.cost
    elif isinstance(cost, CostModel):
        calibration = {"source": "given"}
    else:
        raise ConfigError(f"cost must be a CostModel or a Calibration, got "
                          f"{type(cost).__name__}")
    busy_estimate = None
    auto_scale = time_scale is None
    if time_scale is None:
        time_scale, busy_estimate = auto_time_scale(first, cost, block_size, target_load)
    elif isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
            math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(f"time scale must be a positive number, got {time_scale!r}")
    scaled = cost.scaled(time_scale)  # the simulator's cost model on the workload's clock
    auto_cap = capacity_blocks is None
    sim_lru_hit = None
    if capacity_blocks is None:
        say("sizing the pool with the simulator (LRU at half the infinite cache's hits)")
        capacity_blocks, sim_lru_hit, _ = auto_capacity(
            first, scaled, cfg, block_size, min_blocks, max(unbounded[seeds[0]], min_blocks))
    elif isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or \
            capacity_blocks < 1:
        raise ConfigError(f"cache blocks must be a positive int, got {capacity_blocks!r}")
    if capacity_blocks < min_blocks:
        seed = max(need, key=lambda s: need[s])
        largest = max(workloads[seed], key=lambda r: blocks_needed(r, block_size))
        raise ConfigError(
            f"the pool ({capacity_blocks:,} blocks of {block_size} tokens) cannot hold request "
            f"{largest.request_id!r} (seed {seed}), which needs {min_blocks:,} blocks; use at "
            f"least --cache-blocks {min_blocks}")
    bytes_per_block = model.config.layout().bytes_per_block(block_size)
    tiered = bool(host_bytes) or disk_dir is not None
    tier_info: dict[str, Any] | None = None
    if tiered:
        links, tier_info = _tier_setup(model, block_size, host_bytes, disk_dir, disk_bytes,
                                       demote, links, cost, clock, say)

    def stack_for(label: str, run: int) -> Any:
        if not tiered or label == REFERENCE:
            return None
        directory = None if disk_dir is None else Path(disk_dir) / f"run-{run}"
        if directory is not None and directory.exists():
            shutil.rmtree(directory)
        return engine_tiers(model.config.layout(), block_size, host_bytes=host_bytes,
                            disk_dir=directory, disk_bytes=disk_bytes, cost=cost,
                            host_profile=links["host"].profile if "host" in links
                            else "host-pcie5",
                            disk_profile=links["disk"].profile if "disk" in links
                            else "nvme",
                            demote=demote, model=_model_identity(model), timer=clock)

    def capacity_of(label: str, seed: Any) -> int:
        return unbounded[seed] if label == REFERENCE else capacity_blocks

    say("predicting every run with the simulator")
    predictions: dict[tuple[str, Any], dict[str, Any]] = {}
    for seed in seeds:
        for label in (REFERENCE, *policies):
            policy = BASELINE if label == REFERENCE else label
            params = default_policy_params(policy, scaled, block_size)
            sim = simulate(workloads[seed], policy, capacity_blocks=capacity_of(label, seed),
                           block_size=block_size, cost=scaled, config=cfg,
                           policy_params=params)
            predictions[(label, seed)] = in_engine_seconds(sim, time_scale).summary()

    labels = [REFERENCE, *policies]
    runs: list[dict[str, Any]] = []
    references: dict[Any, EngineResult] = {}
    answers: dict[str, dict[str, dict[str, list[int]]]] = {str(s): {} for s in seeds}
    total, done = repeats * len(seeds) * len(labels), 0
    for repeat in range(repeats):
        order = labels[repeat % len(labels):] + labels[:repeat % len(labels)]
        for seed in seeds:
            for label in order:
                done += 1
                cap = capacity_of(label, seed)
                say(f"[{done}/{total}] repeat {repeat + 1}/{repeats}, seed {seed}: {label} "
                    f"({cap:,} blocks)")
                policy = BASELINE if label == REFERENCE else label
                stack = stack_for(label, done)
                t0 = time.perf_counter()
                try:
                    result = run_engine(workloads[seed], model, policy, capacity_blocks=cap,
                                        block_size=block_size, time_scale=time_scale,
                                        config=cfg, cost=scaled, check=check, timer=clock,
                                        tiers=stack)
                finally:
                    if stack is not None and disk_dir is not None:
                        shutil.rmtree(Path(disk_dir) / f"run-{done}", ignore_errors=True)
                wall = time.perf_counter() - t0
                reference = references.get(seed)
                if reference is None and label == REFERENCE:
                    references[seed] = result
                runs.append(_run_entry(label, seed, repeat, result, predictions[(label, seed)],
                                       cold_requests, reference))
                runs[-1]["wall_s"] = round(wall, 3)
                if repeat == 0:
                    answers[str(seed)][label] = {str(k): list(v)
                                                 for k, v in result.answers.items()}
    runs.sort(key=lambda r: (labels.index(r["policy"]), seeds.index(r["seed"]), r["repeat"]))

    def flat(r: Mapping[str, Any], summary: Mapping[str, Any]) -> dict[str, Any]:
        return {**summary, "policy": r["policy"], "seed": r["seed"],
                "capacity_blocks": None if r["policy"] == REFERENCE else capacity_blocks}

    measured = [{**flat(r, r["measured"]), "repeat": r["repeat"]} for r in runs]
    predicted = [flat({"policy": label, "seed": seed}, predictions[(label, seed)])
                 for label in labels for seed in seeds]
    unit, cells = replicates(measured)
    summary = _summary(cells, predicted, confidence)
    rows = fidelity(measured, predicted, confidence=confidence)

    spans = {s: (w[-1].arrival - w[0].arrival) / time_scale for s, w in workloads.items()}
    # the load each compared run put on the engine (`SimResult.measured_load`: its own work,
    # priced by the calibrated cost model and rescaled to the engine's measured speed, per
    # second of arrivals); the worst run decides, as in `kvevict simulate`
    compared = [r["measured"] for r in runs
                if r["policy"] != REFERENCE and not is_offline(r["policy"])]
    loads = [m["measured_load"] for m in compared]
    rho = max(loads) if loads else 0.0
    load = {"rho": round(rho, 4), "stable": rho < 1,
            "rho_by_run": [round(x, 4) for x in loads],
            "busy_by_run": [round(m["busy_load"], 4) for m in compared],
            "source": "measured: each compared run's own work per second of arrivals (its "
                      "steps priced by the calibrated cost model, each decode step's shared "
                      "part split at the batch run at the box's limit, rescaled to the "
                      "engine's measured seconds); the largest run counts"}
    choice = choose_policy([c for c in cells if c["policy"] != REFERENCE], load=load,
                           capacity_blocks=capacity_blocks, confidence=confidence,
                           replicate=unit)

    inf_hit = predictions[(REFERENCE, seeds[0])]["infinite_cache_hit_ratio"]
    if auto_cap:
        note = (f"the simulator's LRU hits {sim_lru_hit:.3f} of prompt tokens here, "
                f"{sim_lru_hit / inf_hit:.0%} of the infinite cache's {inf_hit:.3f}"
                if inf_hit else "no prompt token can hit in this workload")
        if capacity_blocks == min_blocks and sim_lru_hit is not None and inf_hit and \
                sim_lru_hit > 0.5 * inf_hit:
            note += (f"; this is the smallest pool that holds the largest request "
                     f"({min_blocks:,} blocks), so LRU cannot be pushed lower: add people "
                     "(--scale) for a larger working set")
        if len(seeds) > 1:
            note += f" (seed {seeds[0]}; the same size for every seed)"
    else:
        note = "given"
    per_seed = [_workload_entry(s, w, predictions[(REFERENCE, s)]) for s, w in workloads.items()]
    return {
        "workload": {**per_seed[0], "seeds": seeds},
        "workloads": per_seed,
        "model": engine_description(model, block_size),
        "time_scale": {"factor": round(time_scale, 6), "auto": auto_scale,
                       "target_load": target_load if auto_scale else None,
                       "estimated_busy_s": round(busy_estimate, 3)
                       if busy_estimate is not None else None,
                       "engine_span_s": round(spans[seeds[0]], 3)},
        "cache": {"capacity_blocks": capacity_blocks, "auto": auto_cap,
                  "bytes": capacity_blocks * bytes_per_block, "bytes_per_block": bytes_per_block,
                  "block_size": block_size, "unbounded_blocks": unbounded[seeds[0]],
                  "unbounded_blocks_by_seed": {str(s): unbounded[s] for s in seeds},
                  "min_blocks": min_blocks, "simulated_lru_hit_ratio": sim_lru_hit,
                  "note": note},
        "cost_model": cost.to_dict(),
        "calibration": calibration,
        "scheduler": {"max_num_batched_tokens": cfg.max_num_batched_tokens,
                      "max_num_seqs": cfg.max_num_seqs, "preemption": cfg.preemption},
        "cold_requests": min(cold_requests, min(len(w) for w in workloads.values())),
        "timer": timer,
        "repeats": repeats,
        "seeds": seeds,
        "policies": policies,
        "replicates": {"unit": unit, "n": len(seeds) if unit == "seed" else repeats,
                       "confidence": confidence},
        "runs": runs,
        "predictions": predicted,
        "summary": interval_dict(summary),
        "fidelity": interval_dict(rows),
        "load": load,
        "decision": _decision_dict(choice, unit),
        "lossless": all(r["answers"] is None or r["answers"]["lossless"] for r in runs),
        "answers_by_seed": answers,
        **({} if tier_info is None else {"tiers": _tier_summary(tier_info, runs)}),
    }


def _model_identity(model: LlamaModel) -> str:
    """The engine model's identity in a disk tier's manifest: its sizes and weight seed."""
    c = model.config
    return (f"kvevict-llama(vocab={c.vocab_size}, hidden={c.hidden_size}, "
            f"layers={c.num_layers}, heads={c.num_heads}/{c.num_kv_heads}x{c.head_dim}, "
            f"intermediate={c.intermediate_size}, {str(c.dtype).removeprefix('torch.')}, "
            f"seed={model.seed})")


def _tier_setup(model: LlamaModel, block_size: int, host_bytes: float,
                disk_dir: str | Path | None, disk_bytes: float, demote: str,
                links: Mapping[str, LinkFit] | None, cost: CostModel,
                clock: Callable[[], float], say: Callable[[str], None],
                ) -> tuple[dict[str, LinkFit], dict[str, Any]]:
    """Check the tier options, measure the links (unless given); the result's ``"tiers"``
    header: sizes, links, and the crossover depth each link gives under ``cost``."""
    layout = model.config.layout()
    per_block = layout.bytes_per_block(block_size)
    for name, size, used in (("host", host_bytes, bool(host_bytes)),
                             ("disk", disk_bytes, disk_dir is not None)):
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not (
                math.isfinite(size) and size >= 0):
            raise ConfigError(f"the {name} tier's size must be a number of bytes >= 0, got "
                              f"{size!r}")
        if used and size < per_block:
            raise ConfigError(f"a {name} tier of {size:,.0f} bytes holds no {per_block:,}-byte "
                              f"block of this model; give at least {per_block / 2**30:.3g} GiB")
    if demote not in ("cost", "always"):
        raise ConfigError(f"demote must be 'cost' or 'always', got {demote!r}")
    found = dict(links or {})
    if host_bytes and "host" not in found:
        say("measuring the host tier's link (CPU tensor copies)")
        found["host"] = measure_link("host", layout, block_size, dtype=model.config.dtype,
                                     name="host", timer=clock)
    if disk_dir is not None:
        try:
            Path(disk_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier directory {disk_dir}: "
                              f"{exc.strerror or exc}") from None
        if "disk" not in found:
            say(f"measuring the disk tier's link (cold reads under {disk_dir})")
            found["disk"] = measure_link("disk", layout, block_size, dtype=model.config.dtype,
                                         directory=disk_dir, name="disk", timer=clock)
    info: dict[str, Any] = {
        "host_bytes": host_bytes, "host_blocks": int(host_bytes // per_block),
        "disk_dir": None if disk_dir is None else str(disk_dir), "disk_bytes": disk_bytes,
        "disk_blocks": int(disk_bytes // per_block) if disk_dir is not None else 0,
        "bytes_per_block": per_block, "demote": demote,
        "links": {name: fit.as_dict() for name, fit in found.items()},
    }
    crossover = {}
    for name in ("host", "disk"):
        if name not in found:
            continue
        fit = found[name]
        reload = fit.predicted_read_seconds(1)
        if name == "disk" and "host" in found and host_bytes:  # staged through host
            reload += found["host"].predicted_read_seconds(1)
        depth = next((d for d in range(1 << 16)
                      if cost.recompute_seconds(d, block_size) > reload), None)
        crossover[name] = {"reload_s_per_block": reload, "crossover_depth": depth,
                           "recompute_s_at_depth_0": cost.recompute_seconds(0, block_size)}
    info["crossover"] = crossover
    return found, info


def _tier_summary(info: dict[str, Any], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The tiers' header plus, per policy, the tiers' counters averaged over its runs."""
    by_policy: dict[str, list[Mapping[str, Any]]] = {}
    for r in runs:
        t = r["measured"].get("tiers")
        if t is not None:
            by_policy.setdefault(r["policy"], []).append(t)
    out = dict(info)
    out["by_policy"] = {}
    for policy, found in by_policy.items():
        keep = ("hits_by_tier", "reloads", "bytes_read", "bytes_written", "demotions",
                "drops", "checksum_failures", "reload_s_measured",
                "reload_s_predicted_per_block", "takes", "restored_takes")
        out["by_policy"][policy] = {k: _mean_of([t.get(k, {} if k in (
            "hits_by_tier", "bytes_read", "bytes_written", "demotions", "drops") else 0)
            for t in found]) for k in keep}
        out["by_policy"][policy]["runs"] = len(found)
    return out


def _workload_entry(seed: Any, ordered: list[Request],
                    reference: Mapping[str, Any]) -> dict[str, Any]:
    return {"seed": seed, "requests": len(ordered),
            "sessions": len({r.session_id for r in ordered}),
            "span_s": round(ordered[-1].arrival - ordered[0].arrival, 3),
            "prompt_tokens": sum(r.prompt_len for r in ordered),
            "output_tokens": sum(r.output_len for r in ordered),
            "infinite_cache_hit_ratio": reference["infinite_cache_hit_ratio"]}


def _summary(cells: list[dict[str, Any]], predicted: list[dict[str, Any]],
             confidence: float) -> list[dict[str, Any]]:
    """Per policy: every measured metric over the replicates and every predicted one over
    the seeds, as intervals (`kvevict.stats.aggregate`)."""
    strip = ("workload_seed", "repeats")
    measured = aggregate([{k: v for k, v in c.items() if k not in strip} for c in cells],
                         confidence)
    pred = {r["policy"]: r for r in aggregate(predicted, confidence)}
    return [{"policy": row["policy"], "capacity_blocks": row["capacity_blocks"],
             "replicates": row["seeds"], "measured": row,
             "predicted": pred[row["policy"]]} for row in measured]


def _decision_dict(choice: Choice, unit: str) -> dict[str, Any]:
    return {"policy": choice.policy, "reason": choice.reason,
            "significant": choice.significant, "metric": choice.metric,
            "latency_decision": choice.latency_decision, "unit": unit,
            "replicates": choice.seeds, "capacity_blocks": choice.capacity_blocks,
            "versus": choice.versus,
            "difference": None if choice.difference is None else choice.difference.as_dict(),
            "comparisons": [{"policy": p, "difference": d.as_dict()}
                            for p, d in choice.comparisons],
            "explanation": explain_choice(choice, BASELINE, unit)}


def calibrate_for_workload(model: LlamaModel, requests: Sequence[Request], block_size: int,
                           config: SchedulerConfig, repeats: int = 3,
                           timer: Callable[[], float] = time.perf_counter) -> Calibration:
    """`calibrate` over the chunk sizes, batch sizes and contexts ``requests`` will use
    under ``config``, timed by ``timer``."""
    cfg = config
    longest = max(r.prompt_len + r.output_len for r in requests)
    chunk = cfg.max_num_batched_tokens
    ctx = max(64, min(longest, 8192))
    prefill = sorted({n for n in (16, 64, 256, chunk) if n <= chunk} | {min(chunk, 16)})
    cached = sorted({0, ctx // 2, ctx})
    batches = sorted({b for b in (1, 4, 16) if b <= cfg.max_num_seqs} | {1})
    contexts = sorted({64, ctx // 4, ctx})
    if len(batches) * len(contexts) < 3:
        contexts = sorted(set(contexts) | {ctx // 2, ctx // 8 + 1})
    if len(prefill) * len(cached) < 3:
        cached = sorted(set(cached) | {ctx // 4})
    return calibrate(model, block_size=block_size, prefill_lengths=prefill,
                     cached_lengths=cached, decode_batches=batches, decode_contexts=contexts,
                     repeats=repeats, timer=timer)


# -- the terminal report -----------------------------------------------------------------------


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0f}%"


def _fmt_error(d: Mapping[str, Any] | None) -> str:
    """A relative error's interval in percent: ``"-8% ± 3%"``."""
    if d is None:
        return "n/a"
    if d["half"] is None:
        return f"{d['mean'] * 100:+.0f}%"
    half = d["half"] * 100
    return f"{d['mean'] * 100:+.0f}% ± {half:.0f}%" if half >= 0.5 else \
        f"{d['mean'] * 100:+.0f}% ± <1%"


def _fmt_iv(d: Mapping[str, Any], spec: str) -> str:
    iv = _as_interval(d)
    if not iv.known:  # one replicate: the mean alone (the header says how many there are)
        return format(iv.mean, spec)
    return format(iv, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w)
                     for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
    return out


def _replicate_text(result: Mapping[str, Any]) -> str:
    rep = result["replicates"]
    n, k = result["repeats"], len(result["seeds"])
    runs = f"{n} repeat{'s' if n != 1 else ''} x {k} seed{'s' if k != 1 else ''}"
    if rep["unit"] == "seed":
        return (f"{runs}; mean ± {rep['confidence']:.0%} CI over the {k} seeds (each seed's "
                f"repeats averaged)")
    if n == 1:
        return f"{runs}; one run per policy, no interval (use --repeats 3 for one)"
    return f"{runs}; mean ± {rep['confidence']:.0%} CI over the {n} repeats"


def format_report(result: dict[str, Any], workload: str) -> str:
    """The terminal report of `run_bench`'s result."""
    w, m, ts, cache = (result["workload"], result["model"], result["time_scale"],
                       result["cache"])
    kv = result["runs"][-1]["kv"]
    seeds = result["seeds"]
    lines = [
        f"engine-bench: {workload}: {w['requests']} requests, {w['sessions']} sessions, "
        f"{w['prompt_tokens']:,} prompt + {w['output_tokens']:,} output tokens"
        + (f" (seed {seeds[0]}; {len(seeds)} seeds)" if len(seeds) > 1 else ""),
        f"engine: Llama-style, {m['num_layers']} layers, hidden {m['hidden_size']}, "
        f"{m['num_heads']}/{m['num_kv_heads']} heads x {m['head_dim']}, vocab "
        f"{m['vocab_size']} ({m['parameters'] / 1e6:.2f}M parameters), {m['dtype']} on "
        f"{m['device']}, {m['torch_threads']} torch thread(s)"
        + (f"; model load {m['load_s']:.3f} s, first forward (cold) "
           f"{m['first_forward_s']:.3f} s" if "load_s" in m else ""),
        f"KV tensor: {kv['device']} {kv['dtype']} {kv['shape']}, "
        f"{kv['bytes'] / MIB:.1f} MiB ({kv['bytes_per_block']:,} bytes per "
        f"{kv['block_size']}-token block); weights on {kv['weights_device']}",
        f"time: {w['span_s']:,.0f} s of workload arrivals replayed x{ts['factor']:.2f} "
        f"faster = {ts['engine_span_s']:,.1f} s"
        + (f" (auto: offered load {ts['target_load']} of the engine's estimated unbatched "
           f"compute, {ts['estimated_busy_s']:.1f} s)" if ts["auto"] else ""),
        f"timer: {result['timer']} ({TIMER_TEXT.get(result['timer'], 'a given clock')})",
    ]
    cal = result["calibration"]
    if "fit" in cal:
        fit = cal["fit"]
        lines.append(f"cost model: calibrated {cal['source']} in {cal['seconds']:.1f} s (fit "
                     f"error mean {fit['prefill_mean_abs_rel_err']:.0%} prefill, "
                     f"{fit['decode_mean_abs_rel_err']:.0%} decode)")
    else:
        lines.append(f"cost model: {cal.get('path', cal['source'])}")
    lines.append(f"cache: {cache['capacity_blocks']:,} blocks = "
                 f"{cache['bytes'] / MIB:.1f} MiB ({'auto: ' if cache['auto'] else ''}"
                 f"{cache['note']}); unbounded reference {cache['unbounded_blocks']:,} blocks")
    load = result["load"]
    lines.append(f"measured load: ρ = {load['rho']:.2f} (each compared run's own work per "
                 f"second of arrivals at the engine's measured speed, largest of "
                 f"{len(load['rho_by_run'])} runs)"
                 + ("" if load["stable"] else ": the engine could not keep up, the queue "
                    "grew and the latencies are not steady state"))
    lines.append(f"runs: {_replicate_text(result)}; repeats interleaved, every policy once "
                 "per round")
    lines.append("")
    answers = _answers_by_policy(result["runs"])
    header = ["policy", "hit", "TTFT p50", "TTFT p95", "sim hit", "sim p50", "sim p95",
              "err hit", "err p50", "err p95", "answers vs unbounded"]
    rows = []
    for row in result["fidelity"]:
        cells = []
        for metric, spec in zip(FIDELITY_METRICS, (".3f", ".4f", ".4f")):
            cells.append(_fmt_iv(row["metrics"][metric]["measured"], spec))
        for metric, spec in zip(FIDELITY_METRICS, (".3f", ".4f", ".4f")):
            cells.append(_fmt_iv(row["metrics"][metric]["predicted"], spec))
        cells += [_fmt_error(row["metrics"][k]["error"]) for k in FIDELITY_METRICS]
        rows.append([row["policy"], *cells, answers[row["policy"]]])
    lines += ["measured on the engine vs predicted by the simulator (TTFT in seconds; err = "
              "predicted / measured - 1, per replicate)", *_table(header, rows), ""]
    cold = result["cold_requests"]
    header = ["policy", "cold p50", "cold p95", "warm p50", "warm p95", "decode tok/s",
              "recomputed", "preempt", "peak blocks", "peak RSS MiB", "busy s", "priced s",
              "wall s"]
    rows = []
    for row in result["summary"]:
        me = row["measured"]
        c, wa, eng = me.get("cold", {}), me.get("warm", {}), me["engine"]
        rss = me["memory"]["os"].get("peak_rss_bytes")
        wall = [r["wall_s"] for r in result["runs"] if r["policy"] == row["policy"]]
        priced = eng.get("predicted_busy_s")
        rows.append([row["policy"], _mean_text(c.get("ttft_p50"), ".4f"),
                     _mean_text(c.get("ttft_p95"), ".4f"), _mean_text(wa.get("ttft_p50"), ".4f"),
                     _mean_text(wa.get("ttft_p95"), ".4f"),
                     _mean_text(me["decode_tokens_per_s_p50"], ".0f"),
                     _mean_text(me["recomputed_prefill_tokens"], ",.0f"),
                     _mean_text(me["preemptions"], ".1f"), _mean_text(me["peak_blocks"], ",.0f"),
                     "n/a" if not isinstance(rss, Mapping) else f"{rss['mean'] / MIB:.0f}",
                     _mean_text(eng["busy_s"], ".1f"),
                     "n/a" if not isinstance(priced, Mapping) else f"{priced['mean']:.1f}",
                     f"{sum(wall) / len(wall):.1f}"])
    lines += [f"means over the runs: cold start (first {cold} requests) vs warm steady state; "
              "decode tok/s is the median request's streaming rate; peak RSS from the OS; "
              "busy s = measured engine time, priced s = the cost model's price of the same "
              "steps", *_table(header, rows)]
    if "tiers" in result:
        lines += ["", *_tier_lines(result["tiers"])]
    lines += ["", *_conclusion(result)]
    return "\n".join(lines)


def _link_text(link: Mapping[str, Any]) -> str:
    p = link["profile"]
    cold = {True: "cold reads", False: "page-cache reads", None: "reads"}[link["cold"]]
    return (f"{cold} {p['latency_s'] * 1e6:.1f} us + {p['read_bytes_per_s'] / 1e9:.3g} GB/s, "
            f"writes {p['write_bytes_per_s'] / 1e9:.3g} GB/s")


def _tier_lines(tiers: Mapping[str, Any]) -> list[str]:
    """The tiers' part of the terminal report."""
    parts = []
    links, cross = tiers["links"], tiers["crossover"]
    if tiers["host_blocks"]:
        parts.append(f"host {tiers['host_bytes'] / MIB:,.1f} MiB ({tiers['host_blocks']:,} "
                     f"blocks; measured {_link_text(links['host'])})")
    if tiers["disk_dir"] is not None:
        parts.append(f"disk {tiers['disk_bytes'] / MIB:,.1f} MiB under {tiers['disk_dir']} "
                     f"({tiers['disk_blocks']:,} blocks; measured {_link_text(links['disk'])})")
    depth = "; ".join(
        f"{name}: reload {c['reload_s_per_block'] * 1e6:,.0f} us/block vs recompute "
        f"{c['recompute_s_at_depth_0'] * 1e6:,.0f} us at depth 0, worth it from depth "
        f"{c['crossover_depth']}" for name, c in cross.items())
    lines = [f"tiers: {'; '.join(parts)}", f"demotion rule {tiers['demote']!r}; the "
             f"calibrated cost model and the measured links give: {depth}"]
    names = ["device"] + (["host"] if tiers["host_blocks"] else []) + (
        ["disk"] if tiers["disk_dir"] is not None else [])
    header = ["policy", *[f"{n} hits" for n in names], "reloads",
              *[f"{n} MiB read/written" for n in names[1:]], "drops", "takes (undone)",
              "reload s", "priced s"]
    rows = []
    for policy, t in tiers["by_policy"].items():
        hits = t["hits_by_tier"] or {}
        drops = t["drops"] or {}
        rows.append([policy, *[f"{hits.get(n, 0):,.1f}" for n in names],
                     f"{t['reloads']:,.1f}",
                     *[f"{(t['bytes_read'] or {}).get(n, 0) / MIB:,.2f}/"
                       f"{(t['bytes_written'] or {}).get(n, 0) / MIB:,.2f}" for n in names[1:]],
                     ", ".join(f"{k} {v:,.1f}" for k, v in sorted(drops.items())) or "0",
                     f"{t['takes']:,.1f} ({t['restored_takes']:,.1f})",
                     f"{t['reload_s_measured']:.4f}", f"{t['reload_s_predicted_per_block']:.4f}"])
    lines += ["blocks served by each tier and bytes moved, means over each policy's runs "
              "(the unbounded reference runs without tiers); takes = admissions that held "
              "blocks below the pool (undone: admission deferred the request; nothing is "
              "read until the load); reload s = measured seconds of the loads, priced s = "
              "the links' price of the reloaded blocks one at a time",
              *_table(header, rows)]
    return lines


def _mean_text(d: Any, spec: str) -> str:
    return "n/a" if not isinstance(d, Mapping) else format(d["mean"], spec)


def _answers_by_policy(runs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Per policy, what its runs' answer checks say in one phrase."""
    checks: dict[str, list[Mapping[str, Any] | None]] = {}
    for r in runs:
        checks.setdefault(r["policy"], []).append(r["answers"])
    out = {}
    for policy, found in checks.items():
        done = [c for c in found if c is not None]
        n = len(done)
        ref = "reference" + ("; " if done else "") if len(done) < len(found) else ""
        bugs = sum(c["bugs"] for c in done)
        missing = sum(len(c["missing"]) for c in done)
        ties = sum(c["near_ties"] for c in done)
        runs = f"{n} run{'s' if n != 1 else ''}"
        if not done:
            out[policy] = ref
        elif bugs or missing:
            out[policy] = ref + f"BUG: {bugs} tokens differ" + (
                f", {missing} requests missing" if missing else "")
        elif ties:
            out[policy] = ref + f"{runs} equal up to {ties} float near-tie(s)"
        else:
            out[policy] = ref + f"{runs} identical ({done[0]['positions']:,} tokens each)"
    return out


def _conclusion(result: dict[str, Any]) -> list[str]:
    d = result["decision"]
    lines = [f"chosen: {d['policy']} ({d['reason']})", d["explanation"]]
    tol = FIDELITY_TOLERANCE
    verdicts: dict[str, list[str]] = {}
    for row in result["fidelity"]:
        for metric, v in row["metrics"].items():
            verdicts.setdefault(metric, []).append(f"{row['policy']} {v['verdict']}")
    names = {"token_hit_ratio": "hit ratio", "ttft_p50": "p50 TTFT", "ttft_p95": "p95 TTFT"}
    lines.append(f"simulator fidelity (target: within ±{tol:.0%}, judged on the error's "
                 "interval): " + "; ".join(f"{names.get(k, k)}: {', '.join(v)}"
                                           for k, v in verdicts.items()))
    if result["lossless"]:
        lines.append(f"lossless: every run's answers equal its seed's first unbounded run's "
                     f"({len(result['runs'])} runs; residency eviction changed no answer)")
    else:
        bad = sorted({f"{r['policy']} (seed {r['seed']}, repeat {r['repeat'] + 1})"
                      for r in result["runs"]
                      if r["answers"] is not None and not r["answers"]["lossless"]})
        lines.append(f"BUG: answers differ from the unbounded pool's under {', '.join(bad)}: "
                     "residency eviction must be lossless")
    return lines


def strip_answers(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without the bulky answers (written to their own file)."""
    return {k: v for k, v in result.items() if k != "answers_by_seed"}
