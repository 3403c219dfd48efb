"""``kvevict engine-bench``: eviction policies on the real engine, next to the simulator.

`run_bench` replays one generated workload through the built-in engine (`run_engine`) once per
policy, plus once with an **unbounded** pool (nothing is ever evicted: the reference for the
answers and the infinite-cache hit ratio), and simulates the same runs with a `CostModel`
calibrated on this engine, so the simulator's fidelity is a measured number:

1. **Cost model.** Loaded from a ``kvevict calibrate`` file, or calibrated on the fly over the
   lengths this workload uses (`kvevict.engine.calibrate`).
2. **Time compression.** The workload's arrivals are workload seconds (an hour of chat). The
   engine plays them ``time_scale`` times faster (see `kvevict.engine.executor`): by default
   the factor that makes the offered load ``target_load`` (0.5) of the engine's compute, as
   the cost model estimates it for an infinite cache without batching. Idle time is skipped,
   so a run lasts about as long as its compute.
3. **Pool size.** By default the size at which the simulator's LRU hits half the prompt
   tokens an infinite cache would (bisection over sizes), but never below what the largest
   request needs; the report says what it chose and why.
4. **Runs.** The unbounded reference first, then each policy on a fresh pool. Cost-aware
   policies get the calibrated cost model (`default_policy_params`), in the simulator too.
5. **Report.** Per policy, measured TTFT p50/p95 and token hit ratio against the simulator's
   prediction (error % = predicted / measured - 1), cold (first requests) and warm TTFT,
   decode rate, recompute, peak pool blocks and the process's peak RSS, and whether its
   answers equal the unbounded run's (`compare_answers`).

All latencies are engine seconds (wall-clock seconds of this process).

This module sits above both the simulator (`kvevict.sim`) and the engine (`kvevict.engine`),
which never import each other: it is the one place that runs both and compares them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
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
from kvevict.errors import ConfigError
from kvevict.run import SimResult, infinite_cache_hits
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.types import Request

__all__ = ["auto_capacity", "auto_time_scale", "blocks_needed", "calibrate_for_workload",
           "format_report", "run_bench", "strip_answers"]

MIB = 2**20
REFERENCE = "unbounded"


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


def _error_pct(predicted: float, measured: float) -> float | None:
    if measured == 0:
        return None
    return round((predicted / measured - 1) * 100, 1)


def _run_entry(label: str, measured: EngineResult, predicted: SimResult, cold: int,
               reference: EngineResult | None) -> dict[str, Any]:
    m = measured.summary(cold)
    p = predicted.summary()
    entry: dict[str, Any] = {
        "policy": label, "capacity_blocks": measured.sim.capacity_blocks,
        "measured": m, "predicted": p,
        "error_pct": {k: _error_pct(p[k], m[k])
                      for k in ("ttft_p50", "ttft_p95", "token_hit_ratio")},
        "kv": measured.kv,
        "requests": measured.request_rows(),
    }
    if reference is not None:
        entry["answers"] = compare_answers(reference, measured).as_dict()
    else:
        entry["answers"] = None
    return entry


def run_bench(requests: Sequence[Request], model: LlamaModel, policies: Sequence[str], *,
              block_size: int = 16, capacity_blocks: int | None = None,
              time_scale: float | None = None, target_load: float = 0.5,
              config: SchedulerConfig | None = None,
              cost: CostModel | Calibration | None = None, cold_requests: int = 5,
              check: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the JSON-ready result.

    Args:
        requests: token-id requests inside the model's vocabulary (workload seconds).
        model: the engine's model.
        policies: policy names (each runs on a fresh pool of ``capacity_blocks``).
        block_size: tokens per block.
        capacity_blocks: pool size (None: `auto_capacity`).
        time_scale: workload seconds per engine second (None: `auto_time_scale`).
        target_load: the offered load the automatic time scale aims at.
        config: scheduler knobs (default: 512 tokens per step, 64 sequences).
        cost: a `CostModel` of this engine in engine seconds, or the `Calibration` it came
            from (None: `calibrate_for_workload` now).
        cold_requests: how many first requests count as the cold start.
        check: ``manager.check()`` after every engine step (slow).
        progress: called with a line before each phase.
    """
    say = progress or (lambda _line: None)
    if not requests:
        raise ConfigError("the workload holds no requests")
    if not policies:
        raise ConfigError("give at least one policy")
    if isinstance(cold_requests, bool) or not isinstance(cold_requests, int) or \
            cold_requests < 0:
        raise ConfigError(f"cold requests must be an int >= 0, got {cold_requests!r}")
    ordered = sorted(requests, key=lambda r: r.arrival)
    cfg = config or SchedulerConfig(max_num_batched_tokens=512)
    min_blocks = max(blocks_needed(r, block_size) for r in ordered)
    unbounded = unbounded_capacity(ordered, block_size, cfg.max_num_seqs)
    calibration: dict[str, Any]
    if cost is None:
        say("calibrating the cost model on this engine")
        cost = calibrate_for_workload(model, ordered, block_size, cfg)
    if isinstance(cost, Calibration):
        calibration = {"source": "on the fly", **cost.as_dict()}
        cost = cost.cost
    elif isinstance(cost, CostModel):
        calibration = {"source": "given"}
    else:
        raise ConfigError(f"cost must be a CostModel or a Calibration, got "
                          f"{type(cost).__name__}")
    busy_estimate = None
    auto_scale = time_scale is None
    if time_scale is None:
        time_scale, busy_estimate = auto_time_scale(ordered, cost, block_size, target_load)
    elif isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
            math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(f"time scale must be a positive number, got {time_scale!r}")
    scaled = cost.scaled(time_scale)  # the simulator's cost model on the workload's clock
    auto_cap = capacity_blocks is None
    sim_lru_hit = None
    if capacity_blocks is None:
        say("sizing the pool with the simulator (LRU at half the infinite cache's hits)")
        capacity_blocks, sim_lru_hit, _ = auto_capacity(ordered, scaled, cfg, block_size,
                                                        min_blocks, unbounded)
    elif isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or \
            capacity_blocks < 1:
        raise ConfigError(f"cache blocks must be a positive int, got {capacity_blocks!r}")
    if capacity_blocks < min_blocks:
        largest = max(ordered, key=lambda r: blocks_needed(r, block_size))
        raise ConfigError(
            f"the pool ({capacity_blocks:,} blocks of {block_size} tokens) cannot hold request "
            f"{largest.request_id!r}, which needs {min_blocks:,} blocks; use at least "
            f"--cache-blocks {min_blocks}")
    bytes_per_block = model.config.layout().bytes_per_block(block_size)

    def run(policy: str, capacity: int) -> EngineResult:
        return run_engine(ordered, model, policy, capacity_blocks=capacity,
                          block_size=block_size, time_scale=time_scale, config=cfg,
                          cost=scaled, check=check)

    def predict(policy: str, capacity: int) -> SimResult:
        params = default_policy_params(policy, scaled, block_size)
        return in_engine_seconds(
            simulate(ordered, policy, capacity_blocks=capacity, block_size=block_size,
                     cost=scaled, config=cfg, policy_params=params), time_scale)

    runs = []
    answers: dict[str, dict[Any, list[int]]] = {}
    total = len(policies) + 1
    say(f"[1/{total}] {REFERENCE} pool ({unbounded:,} blocks): the reference")
    t0 = time.perf_counter()
    reference = run("lru", unbounded)
    runs.append(_run_entry(REFERENCE, reference, predict("lru", unbounded), cold_requests,
                           None))
    runs[-1]["wall_s"] = round(time.perf_counter() - t0, 3)
    answers[REFERENCE] = {str(k): list(v) for k, v in reference.answers.items()}
    for i, policy in enumerate(policies, 2):
        say(f"[{i}/{total}] {policy} ({capacity_blocks:,} blocks)")
        t0 = time.perf_counter()
        result = run(policy, capacity_blocks)
        runs.append(_run_entry(policy, result, predict(policy, capacity_blocks),
                               cold_requests, reference))
        runs[-1]["wall_s"] = round(time.perf_counter() - t0, 3)
        answers[policy] = {str(k): list(v) for k, v in result.answers.items()}
    inf_hit = reference.sim.summary()["infinite_cache_hit_ratio"]
    if auto_cap:
        note = (f"the simulator's LRU hits {sim_lru_hit:.3f} of prompt tokens here, "
                f"{sim_lru_hit / inf_hit:.0%} of the infinite cache's {inf_hit:.3f}"
                if inf_hit else "no prompt token can hit in this workload")
        if capacity_blocks == min_blocks and sim_lru_hit is not None and inf_hit and \
                sim_lru_hit > 0.5 * inf_hit:
            note += (f"; this is the smallest pool that holds the largest request "
                     f"({min_blocks:,} blocks), so LRU cannot be pushed lower: add people "
                     "(--scale) for a larger working set")
    else:
        note = "given"
    sessions = len({r.session_id for r in ordered})
    span = ordered[-1].arrival - ordered[0].arrival
    return {
        "workload": {
            "requests": len(ordered), "sessions": sessions, "span_s": round(span, 3),
            "prompt_tokens": sum(r.prompt_len for r in ordered),
            "output_tokens": sum(r.output_len for r in ordered),
            "infinite_cache_hit_ratio": inf_hit,
        },
        "model": engine_description(model, block_size),
        "time_scale": {"factor": round(time_scale, 6), "auto": auto_scale,
                       "target_load": target_load if auto_scale else None,
                       "estimated_busy_s": round(busy_estimate, 3)
                       if busy_estimate is not None else None,
                       "engine_span_s": round(span / time_scale, 3)},
        "cache": {"capacity_blocks": capacity_blocks, "auto": auto_cap,
                  "bytes": capacity_blocks * bytes_per_block, "bytes_per_block": bytes_per_block,
                  "block_size": block_size, "unbounded_blocks": unbounded,
                  "min_blocks": min_blocks, "simulated_lru_hit_ratio": sim_lru_hit,
                  "note": note},
        "cost_model": cost.to_dict(),
        "calibration": calibration,
        "scheduler": {"max_num_batched_tokens": cfg.max_num_batched_tokens,
                      "max_num_seqs": cfg.max_num_seqs, "preemption": cfg.preemption},
        "cold_requests": min(cold_requests, len(ordered)),
        "runs": runs,
        "lossless": all(r["answers"] is None or r["answers"]["lossless"] for r in runs),
        "answers_by_policy": answers,
    }


def calibrate_for_workload(model: LlamaModel, requests: Sequence[Request], block_size: int,
                           config: SchedulerConfig, repeats: int = 3) -> Calibration:
    """`calibrate` over the chunk sizes, batch sizes and contexts ``requests`` will use
    under ``config``."""
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
                     repeats=repeats)


# -- the terminal report -----------------------------------------------------------------------


def _fmt_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w)
                     for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
    return out


def format_report(result: dict[str, Any], workload: str) -> str:
    """The terminal report of `run_bench`'s result."""
    w, m, ts, cache = (result["workload"], result["model"], result["time_scale"],
                       result["cache"])
    kv = result["runs"][-1]["kv"]
    lines = [
        f"engine-bench: {workload}: {w['requests']} requests, {w['sessions']} sessions, "
        f"{w['prompt_tokens']:,} prompt + {w['output_tokens']:,} output tokens",
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
    lines.append("")
    header = ["policy", "hit", "TTFT p50", "TTFT p95", "sim hit", "sim p50", "sim p95",
              "err hit", "err p50", "err p95", "answers vs unbounded"]
    rows = []
    for r in result["runs"]:
        me, pr, err = r["measured"], r["predicted"], r["error_pct"]
        verdict = "(reference)" if r["answers"] is None else _verdict(r["answers"])
        rows.append([r["policy"], f"{me['token_hit_ratio']:.3f}", f"{me['ttft_p50']:.4f}",
                     f"{me['ttft_p95']:.4f}", f"{pr['token_hit_ratio']:.3f}",
                     f"{pr['ttft_p50']:.4f}", f"{pr['ttft_p95']:.4f}",
                     _fmt_pct(err["token_hit_ratio"]), _fmt_pct(err["ttft_p50"]),
                     _fmt_pct(err["ttft_p95"]), verdict])
    lines += ["measured on the engine vs predicted by the simulator (TTFT in seconds; "
              "err = predicted / measured - 1)", *_table(header, rows), ""]
    cold = result["cold_requests"]
    header = ["policy", "cold p50", "cold p95", "warm p50", "warm p95", "decode tok/s",
              "recomputed", "preempt", "peak blocks", "peak RSS MiB", "busy s", "priced s",
              "wall s"]
    rows = []
    for r in result["runs"]:
        me = r["measured"]
        c, wa = me.get("cold", {}), me.get("warm", {})
        rss = me["memory"]["os"]["peak_rss_bytes"]
        rows.append([r["policy"], f"{c.get('ttft_p50', 0):.4f}", f"{c.get('ttft_p95', 0):.4f}",
                     f"{wa.get('ttft_p50', 0):.4f}", f"{wa.get('ttft_p95', 0):.4f}",
                     f"{me['decode_tokens_per_s_p50']:.0f}",
                     f"{me['recomputed_prefill_tokens']:,}", f"{me['preemptions']}",
                     f"{me['peak_blocks']:,}", "n/a" if rss is None else f"{rss / MIB:.0f}",
                     f"{me['engine']['busy_s']:.1f}", _priced(me['engine']),
                     f"{r['wall_s']:.1f}"])
    lines += [f"cold start (first {cold} requests) vs warm steady state; decode tok/s is the "
              "median request's streaming rate; peak RSS from the OS; busy s = measured "
              "engine time, priced s = the cost model's price of the same steps",
              *_table(header, rows)]
    lines += ["", *_conclusion(result)]
    return "\n".join(lines)


def _priced(engine: dict[str, Any]) -> str:
    priced = engine.get("predicted_busy_s")
    return "n/a" if priced is None else f"{priced:.1f}"


def _verdict(check: dict[str, Any]) -> str:
    if check["identical"]:
        return f"identical ({check['positions']:,} tokens)"
    if check["lossless"]:
        return f"equal up to {check['near_ties']} float near-tie(s)"
    return f"BUG: {check['bugs']} tokens differ" + (
        f", {len(check['missing'])} requests missing" if check["missing"] else "")


def _conclusion(result: dict[str, Any]) -> list[str]:
    runs = {r["policy"]: r for r in result["runs"]}
    lines = []
    lru = runs.get("lru")
    for name, r in runs.items():
        if name in (REFERENCE, "lru") or lru is None:
            continue
        a, b = r["measured"]["ttft_p95"], lru["measured"]["ttft_p95"]
        pa, pb = r["predicted"]["ttft_p95"], lru["predicted"]["ttft_p95"]
        change = f"{(a / b - 1) * 100:+.0f}%" if b else "n/a"
        pchange = f"{(pa / pb - 1) * 100:+.0f}%" if pb else "n/a"
        lines.append(f"{name} vs lru: p95 TTFT {a:.4f} s vs {b:.4f} s ({change}); the "
                     f"simulator predicted {pa:.4f} s vs {pb:.4f} s ({pchange})")
    errs = [abs(e) for r in result["runs"] for e in r["error_pct"].values() if e is not None]
    if errs:
        lines.append(f"simulator fidelity: mean |error| {sum(errs) / len(errs):.0f}% over "
                     f"TTFT p50/p95 and hit ratio, worst {max(errs):.0f}%")
    if result["lossless"]:
        lines.append("lossless: every policy's answers equal the unbounded pool's "
                     "(residency eviction changed no answer)")
    else:
        bad = [r["policy"] for r in result["runs"]
               if r["answers"] is not None and not r["answers"]["lossless"]]
        lines.append(f"BUG: answers differ from the unbounded pool's under {', '.join(bad)}: "
                     "residency eviction must be lossless")
    return lines


def strip_answers(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without the bulky per-policy answers (written to their own file)."""
    return {k: v for k, v in result.items() if k != "answers_by_policy"}

