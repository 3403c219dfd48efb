"""The engine-vs-simulator fidelity table: ``engine-bench`` (measured) against the simulator
(predicted, cost model calibrated on this machine), with the spread of both, and where the
error comes from, measured.

For each timer (``wall``: wall-clock seconds; ``cpu``: the engine thread's CPU seconds, which
leave other processes on a shared machine out), one `kvevict.engine_bench.run_bench` of a
generated workload: the cost model calibrated on the fly with that timer, every policy and
the unbounded reference run ``--repeats`` times (interleaved), and the simulator's prediction
for the same requests, pool, scheduler and time compression. Printed (Markdown):

1. **Fidelity**: per policy, token hit ratio and TTFT p50/p95, measured (mean ± 95% CI over
   the repeats, or over the seeds with ``--seeds``) and predicted, and the relative error
   ``predicted / measured - 1`` with its interval; the verdict against the 10% target
   (`kvevict.engine_bench.fidelity`: ``within`` when the error's interval lies inside ±10%,
   ``outside`` when it lies entirely beyond, ``unresolved`` when it straddles a bound).
2. **Where the error comes from** (means over each policy's runs):

   - *the price of the steps*: the calibrated cost model's price of exactly the steps the
     engine ran (``priced``) against their measured time (``busy``), split into decode-only
     steps and steps with a prefill chunk. This isolates the cost model's error from the
     scheduling (which requests shared which step);
   - *host time*: scheduling and cache management between model calls, per step; the cost
     model prices model calls only (calibration times ``forward_paged``);
   - *the engine against itself*: the coefficient of variation (stdev / mean) over the
     repeats of the busy time and of TTFT p50/p95, the same requests every time. No fixed
     cost model can predict a run closer than the runs agree with each other;
   - *contention*: wall seconds per busy second of the runs (with the ``cpu`` timer, how much
     longer the run took than the CPU time its thread got);
   - *timer resolution*: the smallest nonzero step between two readings of the clock;
   - *the tail*: the p95 of the wait for memory, measured and predicted;
   - *step by step*: one more run of ``--profile`` (LRU), with the time inside
     `forward_paged` (the call calibration times) measured apart, per kind of step
     (decode-only by batch size, and steps with a prefill chunk): the cost model's price, the
     model call, the executor's work around it (inputs, sampling, marking blocks valid) and
     the host time, per step.

3. **Corrected prediction**: the simulator again, with the cost model's decode coefficients
   scaled by the unbounded runs' measured / priced ratio of decode-only steps and its
   prefill coefficients by that of steps with a prefill chunk (approximate: those steps also
   carry decodes). Cost-aware policies keep the calibrated cost model as their parameter, as
   in the engine. The reference runs are one pool size and no eviction; the policies' rows
   are then predictions of other runs. What this removes is the cost model's price error;
   what is left is the scheduling and queueing the simulator reproduces only on average.
   With it, the **sensitivity** of the simulated TTFT p50/p95 to the price of a step: every
   step priced 10% higher. A p95 that is a wait for memory moves by far more than 10%, so a
   small error in the price of a step becomes a large one in the tail.

Usage (from the repository root; a few minutes on 2 shared cores)::

    python benchmarks/fidelity.py
    python benchmarks/fidelity.py --requests 40 --repeats 2 --timers cpu   # a quick look
    python benchmarks/fidelity.py --out results/fidelity                  # + fidelity.json

The engine is the default ``kvevict engine-bench`` model (2 layers, hidden 128, fp32, one
torch thread, CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs
import torch

from kvevict import workloads
from kvevict.cost import CostModel
from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.driver import default_policy_params, in_engine_seconds, run_engine
from kvevict.engine_bench import (
    FIDELITY_METRICS,
    FIDELITY_TOLERANCE,
    TIMERS,
    fidelity,
    interval_dict,
    run_bench,
)
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate

MODEL = dict(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=32, intermediate_size=256)
DECODE_FIELDS = ("decode_step_s", "decode_s_per_seq", "decode_s_per_context_token")
PREFILL_FIELDS = ("prefill_overhead_s", "linear_s_per_token", "attn_s_per_pair")
NAMES = {"token_hit_ratio": "hit", "ttft_p50": "TTFT p50", "ttft_p95": "TTFT p95"}
SPECS = {"token_hit_ratio": ".3f", "ttft_p50": ".4f", "ttft_p95": ".4f"}


def step_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Measured / priced seconds of the given runs' decode-only steps and steps with a
    prefill chunk (sums over the runs), and of all their steps."""
    sums = {k: [0.0, 0.0] for k in ("decode", "prefill", "all")}
    for r in runs:
        engine = r["measured"]["engine"]
        for kind, v in engine["by_step_kind"].items():
            sums[kind][0] += v["busy_s"]
            sums[kind][1] += v["predicted_s"] or 0.0
        sums["all"][0] += engine["busy_s"]
        sums["all"][1] += engine["predicted_busy_s"] or 0.0
    return {k: (b / p if p > 0 else math.nan) for k, (b, p) in sums.items()}


def corrected_cost(cost: CostModel, ratios: dict[str, float]) -> CostModel:
    """``cost`` with its decode coefficients times ``ratios["decode"]`` and its prefill
    coefficients times ``ratios["prefill"]``."""
    changes = {f: getattr(cost, f) * ratios["decode"] for f in DECODE_FIELDS}
    changes.update({f: getattr(cost, f) * ratios["prefill"] for f in PREFILL_FIELDS})
    return attrs.evolve(cost, **changes)


def corrected_predictions(result: dict[str, Any], by_seed: dict[int, list[Any]],
                          block_size: int, price: float = 1.0,
                          ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The simulator's predictions with the cost model corrected on the unbounded runs (and
    every step's price times ``price``), as `fidelity` takes them, and the ratios used."""
    ratios = step_ratios([r for r in result["runs"] if r["policy"] == "unbounded"])
    cost = CostModel.from_dict(result["cost_model"])
    factor = result["time_scale"]["factor"]
    priced = corrected_cost(cost, ratios).scaled(factor * price)
    as_param = cost.scaled(factor)  # what the engine's cost-aware policies were given
    sched = result["scheduler"]
    config = SchedulerConfig(max_num_batched_tokens=sched["max_num_batched_tokens"],
                             max_num_seqs=sched["max_num_seqs"], preemption=sched["preemption"])
    out = []
    for seed, requests in by_seed.items():
        for label in ("unbounded", *result["policies"]):
            policy = "lru" if label == "unbounded" else label
            capacity = (result["cache"]["unbounded_blocks_by_seed"][str(seed)]
                        if label == "unbounded" else result["cache"]["capacity_blocks"])
            sim = simulate(requests, policy, capacity_blocks=capacity, block_size=block_size,
                           cost=priced, config=config,
                           policy_params=default_policy_params(policy, as_param, block_size))
            out.append({**in_engine_seconds(sim, factor).summary(), "policy": label,
                        "seed": seed})
    return out, ratios


class TimedModel(LlamaModel):
    """The engine's model, with the time spent inside `forward_paged` (what calibration
    times) added up by ``clock``."""

    def __init__(self, *args: Any, clock: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.forward_s = 0.0

    def forward_paged(self, *args: Any, **kwargs: Any) -> Any:
        t0 = self.clock()
        try:
            return super().forward_paged(*args, **kwargs)
        finally:
            self.forward_s += self.clock() - t0


#: Decode-only steps grouped by batch size: ``(label, smallest, largest)``.
BATCH_BUCKETS = (("1", 1, 1), ("2-3", 2, 3), ("4-7", 4, 7), ("8-15", 8, 15), ("16+", 16, 10**9))


def step_profile(result: dict[str, Any], requests: list[Any], timer: str,
                 policy: str = "lru") -> list[dict[str, Any]]:
    """One more engine run of ``policy`` (the first seed, the bench's pool, time compression
    and cost model), step by step: per kind of step (decode-only by batch size, and steps
    with a prefill chunk), the cost model's price per step against the time inside
    `forward_paged` (the call calibration times), the rest of the executor's model phase
    (building the call's inputs, sampling, marking blocks valid) and the host time
    (scheduling and cache management between steps), all in milliseconds per step."""
    clock = TIMERS[timer]
    model = TimedModel(ModelConfig(**MODEL), seed=0, device="cpu", clock=clock)
    factor = result["time_scale"]["factor"]
    scaled = CostModel.from_dict(result["cost_model"]).scaled(factor)
    sched = result["scheduler"]
    config = SchedulerConfig(max_num_batched_tokens=sched["max_num_batched_tokens"],
                             max_num_seqs=sched["max_num_seqs"], preemption=sched["preemption"])
    groups: dict[str, list[float]] = {}
    last = {"busy": 0.0, "model": 0.0, "forward": 0.0, "priced": 0.0, "decode": 0,
            "prefill": 0}

    def record(s: Any) -> None:
        ex = s.executor
        now = {"busy": ex.busy_seconds, "model": ex.model_seconds, "forward": model.forward_s,
               "priced": ex.predicted_seconds, "decode": ex.decode_tokens,
               "prefill": ex.by_kind["prefill"][0]}
        d = {k: now[k] - last[k] for k in now}
        last.update(now)
        if d["busy"] <= 0:
            return
        if d["prefill"]:
            label = "with prefill"
        else:
            label = next(b for b, lo, hi in BATCH_BUCKETS if lo <= d["decode"] <= hi)
        g = groups.setdefault(label, [0, 0.0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[1] += d["busy"]
        g[2] += d["model"]
        g[3] += d["forward"]
        g[4] += d["priced"]

    run_engine(requests, model, policy, capacity_blocks=result["cache"]["capacity_blocks"],
               block_size=16, time_scale=factor, config=config, cost=scaled, timer=clock,
               on_step=record)
    rows = []
    order = [b for b, _, _ in BATCH_BUCKETS] + ["with prefill"]
    for label in order:
        if label not in groups:
            continue
        n, busy, model_s, forward, priced = groups[label]
        rows.append({"steps": label if label == "with prefill" else f"decode x{label}",
                     "count": n, "priced_ms": priced / n * 1e3,
                     "forward_ms": forward / n * 1e3,
                     "executor_ms": (model_s - forward) / n * 1e3,
                     "host_ms": (busy - model_s) / n * 1e3, "measured_ms": busy / n * 1e3,
                     "share": busy})
    total = sum(r["share"] for r in rows)
    for r in rows:
        r["share"] = r["share"] / total if total else math.nan
    return rows


def _cv(values: list[float]) -> float:
    if len(values) < 2 or statistics.fmean(values) == 0:
        return math.nan
    return statistics.stdev(values) / statistics.fmean(values)


def diagnosis(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per policy (means over its runs): where the prediction's error comes from."""
    rows = []
    summary = {row["policy"]: row for row in result["summary"]}
    for policy in ("unbounded", *result["policies"]):
        runs = [r for r in result["runs"] if r["policy"] == policy]
        eng = [r["measured"]["engine"] for r in runs]
        ratios = step_ratios(runs)
        steps = sum(e["steps"] for e in eng)
        host = sum(e["host_s"] for e in eng)
        busy = sum(e["busy_s"] for e in eng)
        rows.append({
            "policy": policy, "runs": len(runs),
            "busy_s": busy / len(runs), "priced_s": sum(e["predicted_busy_s"] for e in eng)
            / len(runs),
            "busy_over_priced": ratios["all"], "decode_over_priced": ratios["decode"],
            "prefill_over_priced": ratios["prefill"],
            "host_us_per_step": host / steps * 1e6 if steps else math.nan,
            "host_share": host / busy if busy else math.nan,
            "busy_cv": _cv([e["busy_s"] for e in eng]),
            "ttft_p50_cv": _cv([r["measured"]["ttft_p50"] for r in runs]),
            "ttft_p95_cv": _cv([r["measured"]["ttft_p95"] for r in runs]),
            "wall_over_busy": sum(r["wall_s"] for r in runs) / busy if busy else math.nan,
            "wait_memory_p95": summary[policy]["measured"]["wait_memory_p95"]["mean"],
            "wait_memory_p95_predicted": summary[policy]["predicted"]["wait_memory_p95"]["mean"],
        })
    return rows


def timer_resolution(clock: Any, calls: int = 200_000) -> float:
    """The smallest nonzero difference between consecutive readings of ``clock``."""
    best = math.inf
    last = clock()
    for _ in range(calls):
        now = clock()
        if now != last:
            best = min(best, now - last)
            last = now
    return best


def _iv(d: dict[str, Any], spec: str) -> str:
    if d["half"] is None:
        return format(d["mean"], spec)
    half = format(d["half"], spec)
    if d["half"] > 0 and float(half) == 0:
        half = "<" + format(10 ** -int(spec[1:-1]), spec)
    return f"{format(d['mean'], spec)} ± {half}"


def _err(d: dict[str, Any] | None) -> str:
    if d is None:
        return "n/a"
    mean = f"{d['mean'] * 100:+.1f}%"
    return mean if d["half"] is None else f"{mean} ± {d['half'] * 100:.1f}%"


def fidelity_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: one line per policy, measured, predicted, error and verdict per metric."""
    head = ["policy"]
    for m in FIDELITY_METRICS:
        head += [f"{NAMES[m]} measured", f"{NAMES[m]} predicted", "error", "verdict"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:", "---:", "---:", "---"] * len(FIDELITY_METRICS))
             + "|"]
    for row in rows:
        cells = [row["policy"]]
        for m in FIDELITY_METRICS:
            v = row["metrics"][m]
            cells += [_iv(v["measured"], SPECS[m]), _iv(v["predicted"], SPECS[m]),
                      _err(v["error"]), v["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def diagnosis_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: the diagnosis rows."""
    head = ["policy", "runs", "busy s", "priced s", "busy / priced", "decode steps",
            "prefill steps", "host us/step", "host share", "busy CV", "p50 CV", "p95 CV",
            "wall / busy", "mem wait p95 s", "predicted"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["policy"], str(r["runs"]), f"{r['busy_s']:.1f}", f"{r['priced_s']:.1f}",
            f"{r['busy_over_priced']:.2f}", f"{r['decode_over_priced']:.2f}",
            f"{r['prefill_over_priced']:.2f}", f"{r['host_us_per_step']:.0f}",
            f"{r['host_share']:.1%}", f"{r['busy_cv']:.1%}", f"{r['ttft_p50_cv']:.1%}",
            f"{r['ttft_p95_cv']:.1%}", f"{r['wall_over_busy']:.2f}",
            f"{r['wait_memory_p95']:.3f}", f"{r['wait_memory_p95_predicted']:.3f}"]) + " |")
    return lines


def profile_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: `step_profile`'s rows."""
    head = ["steps", "count", "share of busy", "priced ms", "forward_paged ms",
            "executor ms", "host ms", "measured ms", "forward / priced", "measured / priced"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["steps"], f"{r['count']:,}", f"{r['share']:.0%}", f"{r['priced_ms']:.3f}",
            f"{r['forward_ms']:.3f}", f"{r['executor_ms']:.3f}", f"{r['host_ms']:.3f}",
            f"{r['measured_ms']:.3f}", f"{r['forward_ms'] / r['priced_ms']:.2f}",
            f"{r['measured_ms'] / r['priced_ms']:.2f}"]) + " |")
    return lines


def sensitivity(base: list[dict[str, Any]], higher: list[dict[str, Any]],
                price: float) -> list[dict[str, Any]]:
    """Per policy (first seed): how much the simulated TTFT p50/p95 move when every step is
    priced ``price`` times higher (relative changes)."""
    rows = []
    for a, b in zip(base, higher, strict=True):
        if a["seed"] != base[0]["seed"]:
            continue
        rows.append({"policy": a["policy"], "price": price,
                     **{k: b[k] / a[k] - 1 if a[k] else math.nan
                        for k in ("ttft_p50", "ttft_p95", "wait_memory_p95")}})
    return rows


def bench(args: argparse.Namespace, timer: str, by_seed: dict[int, list[Any]],
          say: Any) -> dict[str, Any]:
    """One timer's benchmark, fidelity, diagnosis and corrected prediction."""
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig(**MODEL), seed=0, device="cpu")
    t0 = time.perf_counter()
    result = run_bench(by_seed, model, args.policies.split(","), repeats=args.repeats,
                       target_load=args.load, cold_requests=5, timer=timer,
                       config=SchedulerConfig(max_num_batched_tokens=512), progress=say)
    seconds = time.perf_counter() - t0
    predicted, ratios = corrected_predictions(result, by_seed, 16)
    measured = [{**r["measured"], "policy": r["policy"], "seed": r["seed"],
                 "repeat": r["repeat"],
                 "capacity_blocks": None if r["policy"] == "unbounded" else
                 r["capacity_blocks"]} for r in result["runs"]]
    corrected = interval_dict(fidelity(measured, predicted))
    higher, _ = corrected_predictions(result, by_seed, 16, price=1.1)
    moves = sensitivity(predicted, higher, 1.1)
    say(f"profiling one more {args.profile} run step by step")
    profile = step_profile(result, by_seed[0], timer, args.profile)
    return {"timer": timer, "seconds": round(seconds, 1),
            "resolution_s": timer_resolution(TIMERS[timer]),
            "calibration_fit": result["calibration"].get("fit"),
            "time_scale": result["time_scale"], "cache": result["cache"],
            "load": result["load"], "replicates": result["replicates"],
            "decision": {k: result["decision"][k] for k in ("policy", "reason")},
            "lossless": result["lossless"], "fidelity": result["fidelity"],
            "diagnosis": diagnosis(result), "correction": ratios,
            "corrected_fidelity": corrected, "sensitivity": moves, "profile": profile,
            "profile_policy": args.profile, "cost_model": result["cost_model"]}


def report(out: dict[str, Any]) -> list[str]:
    """Markdown for one timer's results."""
    fit = out["calibration_fit"] or {}
    load, cache = out["load"], out["cache"]
    c = out["correction"]
    lines = [f"### Timer: {out['timer']}", "",
             f"{out['replicates']['n']} {out['replicates']['unit']}s, "
             f"{out['seconds']:.0f} s; pool {cache['capacity_blocks']:,} blocks "
             f"(unbounded {cache['unbounded_blocks']:,}); time x{out['time_scale']['factor']:.2f}; "
             f"measured load ρ = {load['rho']:.2f}; calibration fit error mean "
             f"{fit.get('prefill_mean_abs_rel_err', math.nan):.0%} prefill, "
             f"{fit.get('decode_mean_abs_rel_err', math.nan):.0%} decode; timer resolution "
             f"{out['resolution_s'] * 1e9:.0f} ns; answers lossless: {out['lossless']}", "",
             *fidelity_table(out["fidelity"]), "", "Where the error comes from:", "",
             *diagnosis_table(out["diagnosis"]), "",
             f"Step by step (one more {out['profile_policy']} run, seed 0; ms per step):", "",
             *profile_table(out["profile"]), "",
             f"Corrected on the unbounded runs (decode x{c['decode']:.2f}, prefill "
             f"x{c['prefill']:.2f}):", "", *fidelity_table(out["corrected_fidelity"]), "",
             "Sensitivity of the (corrected) simulator: every step priced 10% higher moves "
             + "; ".join(f"{m['policy']}: p50 {m['ttft_p50']:+.0%}, p95 {m['ttft_p95']:+.0%}"
                         for m in out["sensitivity"]), "",
             f"Decision: {out['decision']['policy']} ({out['decision']['reason']})", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="chat-server")
    parser.add_argument("--scale", type=float, default=4.0)
    parser.add_argument("--requests", type=int, default=60,
                        help="the first N requests by arrival of each seed (default 60)")
    parser.add_argument("--seeds", type=int, default=1, help="workload seeds from 0 (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy (default 3)")
    parser.add_argument("--policies", default="lru", help="comma-separated (default lru)")
    parser.add_argument("--load", type=float, default=0.5,
                        help="offered load of the automatic time compression (default 0.5)")
    parser.add_argument("--timers", default="wall,cpu", help="wall, cpu or both (default both)")
    parser.add_argument("--profile", default="lru",
                        help="the policy of the step-by-step run (default lru)")
    parser.add_argument("--out", type=Path, help="write fidelity.json here")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    timers = [t.strip() for t in args.timers.split(",") if t.strip()]
    bad = [t for t in timers if t not in TIMERS]
    if bad or not timers:
        parser.error(f"--timers: unknown {', '.join(bad) or '(none)'}; valid: "
                     f"{', '.join(TIMERS)}")
    torch.set_num_threads(1)
    start = time.perf_counter()

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    by_seed = {}
    for seed in range(args.seeds):
        requests = workloads.generate(args.workload, seed=seed, scale=args.scale,
                                      vocab_size=MODEL["vocab_size"], block_size=16)
        by_seed[seed] = requests[:args.requests]
    results = []
    for timer in timers:
        say(f"timer {timer}")
        results.append(bench(args, timer, by_seed, say))
    command = "python benchmarks/fidelity.py " + " ".join(sys.argv[1:] if argv is None
                                                          else argv)
    lines = [f"`{command.strip()}`: {args.workload} x{args.scale:g}, first {args.requests} "
             f"requests, {args.seeds} seed(s), {args.repeats} repeats, policies "
             f"{args.policies}, target ±{FIDELITY_TOLERANCE:.0%}; "
             f"{time.perf_counter() - start:.0f} s in all", ""]
    for out in results:
        lines += report(out)
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fidelity.json").write_text(json.dumps(
            {"command": command.strip(), "results": results}, indent=2, sort_keys=True,
            default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
