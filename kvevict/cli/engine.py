"""``kvevict calibrate`` (time the built-in engine, fit the cost model) and ``kvevict
engine-bench`` (run policies on the real engine next to the simulator's prediction)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvevict.cli.common import (
    generator_args,
    int_list,
    parse_policies,
    policy_module_arg,
    policy_module_files,
    recorded_command,
    sayer,
    scheduler_args,
)
from kvevict.errors import ConfigError

__all__ = ["add_parsers", "calibrate_command", "engine_bench_command"]

DTYPES = ("float32", "bfloat16", "float16")


def add_parsers(sub: Any) -> None:
    """The ``calibrate`` and ``engine-bench`` subcommands' options."""
    cal = sub.add_parser("calibrate", help="time the built-in engine and fit the cost model")
    engine_model_args(cal)
    cal.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    cal.add_argument("--prefill-lengths", type=int_list, default=None,
                     help="new-token counts of the timed prefills (default 16,64,256,512)")
    cal.add_argument("--cached-lengths", type=int_list, default=None,
                     help="cached-prefix lengths of the timed prefills (default 0,512,2048)")
    cal.add_argument("--decode-batches", type=int_list, default=None,
                     help="batch sizes of the timed decode steps (default 1,4,16)")
    cal.add_argument("--decode-contexts", type=int_list, default=None,
                     help="context lengths of the timed decode steps (default 64,512,2048)")
    cal.add_argument("--repeats", type=int, default=3,
                     help="timed calls per point; the median counts (default 3)")
    timer_arg(cal)
    cal.add_argument("--out", type=Path, default=Path("calibration.json"),
                     help="JSON file to write (default %(default)s)")
    cal.add_argument("--quiet", action="store_true", help="no progress output")

    eb = sub.add_parser("engine-bench",
                        help="run policies on the real engine next to the simulator's prediction")
    eb.add_argument("--workload", default="chat-server",
                    help="built-in workload generator (default %(default)s)")
    generator_args(eb)
    eb.add_argument("--requests", type=int, default=120,
                    help="run the first N requests by arrival (default %(default)s)")
    eb.add_argument("--repeats", dest="run_repeats", type=int, default=3,
                    help="engine runs per policy (and seed); every metric is reported as "
                         "mean ± 95%% CI over them (default %(default)s)")
    eb.add_argument("--seeds", type=int, default=1,
                    help="workload seeds, from --seed on; with 2 or more the interval is "
                         "over the seeds, each seed's repeats averaged (default %(default)s)")
    eb.add_argument("--policies", default="lru,market",
                    help="comma-separated policy names (default: %(default)s)")
    policy_module_arg(eb)
    eb.add_argument("--cache-blocks", type=int, default=None,
                    help="pool size in blocks (default: where the simulator's LRU hits half "
                         "of what an infinite cache would, or the nearest feasible size)")
    eb.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    eb.add_argument("--time-scale", type=float, default=None,
                    help="workload seconds per engine second (default: automatic, see --load)")
    eb.add_argument("--load", type=float, default=0.5,
                    help="offered load the automatic time scale aims at, as a fraction of "
                         "the engine's estimated compute (default %(default)s)")
    scheduler_args(eb, max_batched_tokens=512)
    eb.add_argument("--cost-model", type=Path, default=None,
                    help="a kvevict calibrate JSON (default: calibrate now)")
    eb.add_argument("--cold-requests", type=int, default=5,
                    help="first requests reported as the cold start (default %(default)s)")
    eb.add_argument("--check", action="store_true",
                    help="check the cache's invariants after every engine step (slow)")
    timer_arg(eb)
    g = eb.add_argument_group("memory tiers below the pool (kvevict.engine.tiers)")
    g.add_argument("--host-gib", type=float, default=0.0,
                   help="a host tier of this many GiB (a second CPU tensor) under every "
                        "policy run's pool: evicted blocks are demoted there and reloaded "
                        "on a hit (default: none)")
    g.add_argument("--disk-dir", type=Path, default=None,
                   help="a disk tier in this directory (one checksummed file per block, a "
                        "fresh subdirectory per run, removed after it; default: none)")
    g.add_argument("--disk-gib", type=float, default=1.0,
                   help="the disk tier's size in GiB (default %(default)s)")
    g.add_argument("--demote", choices=("cost", "always"), default="cost",
                   help="cost: demote a block only when reloading it beats recomputing it "
                        "(measured links, calibrated cost model); always: whenever there is "
                        "room (default %(default)s)")
    engine_model_args(eb)
    eb.add_argument("--out", type=Path,
                    help="write results.json, answers.json (and calibration.json) here")
    eb.add_argument("--quiet", action="store_true", help="no progress output")
    cal.set_defaults(run=calibrate_command)
    eb.set_defaults(run=engine_bench_command)


def engine_model_args(parser: argparse.ArgumentParser) -> None:
    """The built-in engine's model: a seeded random Llama-style decoder of these sizes."""
    g = parser.add_argument_group("engine model (seeded random Llama-style weights)")
    g.add_argument("--vocab", type=int, default=1024,
                   help="vocabulary size; generated token ids are drawn below it (default "
                        "%(default)s)")
    g.add_argument("--hidden", type=int, default=128, help="hidden size (default %(default)s)")
    g.add_argument("--layers", type=int, default=2, help="decoder layers (default %(default)s)")
    g.add_argument("--heads", type=int, default=4, help="query heads (default %(default)s)")
    g.add_argument("--kv-heads", type=int, default=2,
                   help="key/value heads (GQA; default %(default)s)")
    g.add_argument("--head-dim", type=int, default=32, help="head dimension (default %(default)s)")
    g.add_argument("--intermediate", type=int, default=256,
                   help="MLP intermediate size (default %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and KV dtype (default %(default)s)")
    g.add_argument("--device", default="auto",
                   help="torch device: auto (CUDA when available), cpu, cuda, cuda:N")
    g.add_argument("--model-seed", type=int, default=0, help="weight seed (default 0)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: a small model gains little from more, "
                        "and on a shared box spinning threads slow each other)")


def timer_arg(parser: argparse.ArgumentParser) -> None:
    """``--timer``: the clock engine steps (and calibration calls) are timed by."""
    parser.add_argument("--timer", choices=("wall", "cpu"), default="wall",
                        help="wall: wall-clock seconds (what a user waits); cpu: the engine "
                             "thread's CPU seconds, other processes on a shared machine left "
                             "out (needs --threads 1 on a CPU device; default %(default)s)")


def check_timer(args: argparse.Namespace) -> None:
    """``--timer cpu`` counts one thread's CPU time: one torch thread, on the CPU."""
    if args.timer == "cpu" and (args.threads != 1 or args.device not in ("auto", "cpu")):
        raise ConfigError(f"--timer cpu measures the engine thread's CPU time, which counts "
                          f"all the work only with --threads 1 on --device cpu; got --threads "
                          f"{args.threads} --device {args.device}")


def engine_model(args: argparse.Namespace) -> tuple[Any, dict[str, float]]:
    """Build the engine's model from the flags; time the load and a first (cold) forward."""
    import torch

    from kvevict.engine import LlamaModel, ModelConfig
    from kvevict.pool import BlockPool

    if args.threads < 1:
        raise ConfigError(f"--threads must be a positive int, got {args.threads}")
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        cpu_only = getattr(args, "timer", "wall") == "cpu"
        device = "cuda" if torch.cuda.is_available() and not cpu_only else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r} is not a torch device (auto, cpu, cuda, "
                          "cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: only cpu and cuda are supported")
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         num_layers=args.layers, num_heads=args.heads,
                         num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                         intermediate_size=args.intermediate,
                         dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    model = LlamaModel(config, seed=args.model_seed, device=dev)
    load_s = time.perf_counter() - t0
    # the first forward of a process pays for kernel selection and allocations: time it
    pool = BlockPool(4, 16, config.layout(), device=dev)
    table = [pool.allocate() for _ in range(4)]
    ids = torch.arange(32, device=dev) % config.vocab_size
    t0 = time.perf_counter()
    model.forward_paged(pool, [(ids, 0, table)])
    model.forward_paged(pool, [(ids[:1], 32, table)])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    first_s = time.perf_counter() - t0
    return model, {"load_s": round(load_s, 4), "first_forward_s": round(first_s, 4)}



def calibrate_command(args: argparse.Namespace) -> int:
    from kvevict.engine.calibrate import (
        DEFAULT_CACHED_LENGTHS,
        DEFAULT_DECODE_BATCHES,
        DEFAULT_DECODE_CONTEXTS,
        DEFAULT_PREFILL_LENGTHS,
        calibrate,
    )
    from kvevict.engine_bench import TIMERS

    if args.out.exists() and args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory; give a file name")
    check_timer(args)
    model, startup = engine_model(args)
    say = sayer(args)
    cal = calibrate(
        model, block_size=args.block_size,
        prefill_lengths=args.prefill_lengths or list(DEFAULT_PREFILL_LENGTHS),
        cached_lengths=args.cached_lengths or list(DEFAULT_CACHED_LENGTHS),
        decode_batches=args.decode_batches or list(DEFAULT_DECODE_BATCHES),
        decode_contexts=args.decode_contexts or list(DEFAULT_DECODE_CONTEXTS),
        repeats=args.repeats, progress=say, timer=TIMERS[args.timer])
    cal.engine.update(startup)
    cal.engine["timer"] = args.timer
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(args.out)
    e = cal.engine
    print(f"calibrated {e['num_layers']}-layer hidden-{e['hidden_size']} engine ({e['dtype']} "
          f"on {e['device']}, {e['torch_threads']} thread(s)) in {cal.seconds:.1f} s")
    for name, value in cal.cost.to_dict().items():
        print(f"  {name:28s} {value:.6g}")
    fit = cal.fit_summary()
    print(f"fit error: prefill mean {fit['prefill_mean_abs_rel_err']:.0%} (worst "
          f"{fit['prefill_max_abs_rel_err']:.0%}), decode mean "
          f"{fit['decode_mean_abs_rel_err']:.0%} (worst {fit['decode_max_abs_rel_err']:.0%})")
    print(f"wrote {args.out}")
    return 0


def engine_bench_command(args: argparse.Namespace) -> int:
    from kvevict import workloads
    from kvevict.cost import CostModel
    from kvevict.engine_bench import format_report, run_bench, strip_answers
    from kvevict.scheduler import SchedulerConfig

    policies = parse_policies(args.policies, args.policy_module)
    if args.requests < 1:
        raise ConfigError(f"--requests must be a positive int, got {args.requests}")
    if args.run_repeats < 1:
        raise ConfigError(f"--repeats (engine runs per policy) must be a positive int, got "
                          f"{args.run_repeats}")
    if args.cold_requests < 0:
        raise ConfigError(f"--cold-requests must be >= 0, got {args.cold_requests}")
    if not 0 < args.load <= 10:
        raise ConfigError(f"--load: the target load must be in (0, 10], got {args.load}")
    if args.time_scale is not None and not (0 < args.time_scale < float("inf")):
        raise ConfigError(f"--time-scale must be a positive finite number (the time scale), "
                          f"got {args.time_scale}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    for flag, value in (("--host-gib", args.host_gib), ("--disk-gib", args.disk_gib)):
        if not 0 <= value < float("inf"):
            raise ConfigError(f"{flag} must be a finite number of GiB >= 0, got {value}")
    if args.disk_dir is not None and args.disk_dir.exists() and not args.disk_dir.is_dir():
        raise ConfigError(f"--disk-dir {args.disk_dir} exists and is not a directory")
    check_timer(args)
    cost = None
    if args.cost_model is not None:
        cost = CostModel.load(args.cost_model)
        timed_by = _calibration_timer(args.cost_model)
        if timed_by is not None and timed_by != args.timer:
            print(f"note: {args.cost_model} was calibrated with --timer {timed_by}, the runs "
                  f"use --timer {args.timer}: the prediction prices one clock, the runs "
                  "measure another", file=sys.stderr)
    config = SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                             max_num_seqs=args.max_seqs, preemption=args.preemption)
    kwargs: dict[str, Any] = {"vocab_size": args.vocab, "block_size": args.block_size}
    if args.duration is not None:
        kwargs["duration"] = args.duration
    seeds = list(range(args.seed, args.seed + args.seeds))
    by_seed = {}
    for seed in seeds:
        requests = workloads.generate(args.workload, seed=seed, scale=args.scale, **kwargs)
        if len(requests) < args.requests:
            raise ConfigError(f"workload {args.workload} (seed {seed}, scale {args.scale}) "
                              f"has only {len(requests)} requests; lower --requests or raise "
                              "--duration / --scale")
        by_seed[seed] = requests[:args.requests]
    say = sayer(args)
    say(f"building the engine model ({args.layers} layers, hidden {args.hidden})")
    model, startup = engine_model(args)
    result = run_bench(by_seed, model, policies, repeats=args.run_repeats,
                       block_size=args.block_size, capacity_blocks=args.cache_blocks,
                       time_scale=args.time_scale, target_load=args.load, config=config,
                       cost=cost, cold_requests=args.cold_requests, timer=args.timer,
                       check=args.check, progress=say, host_bytes=args.host_gib * 2**30,
                       disk_dir=args.disk_dir, disk_bytes=args.disk_gib * 2**30,
                       demote=args.demote)
    result["model"].update(startup)
    if args.cost_model is not None:
        result["calibration"]["path"] = str(args.cost_model)
    result["command"] = recorded_command(args)
    if args.policy_module:
        result["policy_modules"] = policy_module_files(args)
    result["workload"].update({"name": args.workload, "scale": args.scale})
    seeds_text = (f"seed {args.seed}" if args.seeds == 1
                  else f"seeds {seeds[0]}-{seeds[-1]}")
    print(format_report(result, f"{args.workload} ({seeds_text}, scale {args.scale:g})"))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps(strip_answers(result), indent=2, sort_keys=True, default=str) + "\n")
        (out / "answers.json").write_text(
            json.dumps(result["answers_by_seed"], sort_keys=True) + "\n")
        written = ["results.json", "answers.json"]
        cal = result["calibration"]
        if "cost_model" in cal:  # calibrated now: save it for --cost-model next time
            (out / "calibration.json").write_text(json.dumps(
                {k: v for k, v in cal.items() if k not in ("source", "path")}, indent=2,
                sort_keys=True) + "\n")
            written.append("calibration.json")
        print(f"wrote {', '.join(written)} to {out}")
    return 0 if result["lossless"] else 1


def _calibration_timer(path: Path) -> str | None:
    """The ``--timer`` a calibration file was measured with, when it says (``None`` for a
    file from before the option, or a bare cost model)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    engine = data.get("engine")
    timer = data.get("timer") or (engine.get("timer") if isinstance(engine, dict) else None)
    return timer if isinstance(timer, str) else None
