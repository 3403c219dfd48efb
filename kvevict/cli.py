"""The ``kvevict`` command: which policy should this box run, and what does it buy?

``kvevict simulate`` (no arguments) replays the built-in ``chat-server`` workload through
every policy at a default cache size, prints a table, and with ``--out DIR`` writes
``results.json``, ``hit_ratio.png``, ``ttft_cdf.png`` and ``DECISION.md``.

``kvevict calibrate`` times the built-in engine (`kvevict.engine`) and fits the simulator's
`CostModel` to it; ``kvevict engine-bench`` runs policies on the real engine, side by side
with the simulator's prediction (`kvevict.engine_bench`).

User errors (bad names, malformed traces, a cache too small for one request) print one line
and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvevict.errors import ConfigError, KVEvictError, TraceFormatError
from kvevict.layout import PRESETS, KVLayout, from_hf_config, preset

__all__ = ["DEFAULT_POLICIES", "main"]

DEFAULT_POLICIES = ("lru", "lfu", "pinned", "market", "bayes", "dbms", "belady")
DEFAULT_SWEEP = (0.5, 2.0, 4.0)
FORMATS = ("jsonl", "mooncake", "alibaba", "sharegpt")
GIB = 2**30


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _policies(text: str) -> list[str]:
    """The ``--policies`` list; unknown names (or none) name the valid ones."""
    from kvevict.policies import available_policies

    policies = _csv(text)
    valid = available_policies()
    unknown = [p for p in policies if p not in valid]
    if unknown or not policies:
        raise ConfigError(f"unknown policy {', '.join(unknown) or '(none given)'}; valid "
                          f"names: {', '.join(valid)}")
    return policies


def _floats(text: str) -> list[float]:
    try:
        return [float(p) for p in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None


def _blocks_needed(request: Any, block_size: int) -> int:
    """Blocks a request holds at its longest: its prompt (each listed hash a block) plus
    its output."""
    prompt = request.prompt_len
    if request.block_hashes is not None:
        prompt = max(prompt, len(request.block_hashes) * block_size)
    return -(-(prompt + request.output_len) // block_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict",
        description="Decide which KV-cache state an LLM server keeps resident, with numbers.")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="compare eviction policies on a workload or trace")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help="built-in workload generator (default: chat-server)")
    src.add_argument("--trace", type=Path, help="a trace file instead of a generator")
    sim.add_argument("--format", choices=FORMATS, default="jsonl", help="trace file format")
    _generator_args(sim)
    sim.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                     help="comma-separated policy names (default: %(default)s)")
    model = sim.add_mutually_exclusive_group()
    model.add_argument("--model", default="llama-3-8b",
                       help=f"model preset: {', '.join(PRESETS)} (default %(default)s)")
    model.add_argument("--model-config", type=Path,
                       help="a Hugging Face config.json to size the KV cache from")
    cap = sim.add_mutually_exclusive_group()
    cap.add_argument("--cache-gib", type=float, default=None,
                     help="KV cache size in GiB (default: 1)")
    cap.add_argument("--cache-blocks", type=int, default=None, help="KV cache size in blocks")
    sim.add_argument("--block-size", type=int, default=None,
                     help="tokens per block (default 16; a Mooncake trace's own, 512 unless "
                          "the file says otherwise, and no other)")
    sim.add_argument("--sweep", type=_floats, default=list(DEFAULT_SWEEP),
                     help="capacity multipliers for the hit-ratio sweep "
                          "(default: 0.5,2,4; sizes that cannot hold the largest request "
                          "are skipped)")
    sim.add_argument("--no-sweep", action="store_true", help="skip the capacity sweep")
    _scheduler_args(sim, max_batched_tokens=2048)
    sim.add_argument("--out", type=Path, help="write results.json, plots and DECISION.md here")
    sim.add_argument("--quiet", action="store_true", help="no progress output")

    cal = sub.add_parser("calibrate", help="time the built-in engine and fit the cost model")
    _engine_model_args(cal)
    cal.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    cal.add_argument("--prefill-lengths", type=_ints, default=None,
                     help="new-token counts of the timed prefills (default 16,64,256,512)")
    cal.add_argument("--cached-lengths", type=_ints, default=None,
                     help="cached-prefix lengths of the timed prefills (default 0,512,2048)")
    cal.add_argument("--decode-batches", type=_ints, default=None,
                     help="batch sizes of the timed decode steps (default 1,4,16)")
    cal.add_argument("--decode-contexts", type=_ints, default=None,
                     help="context lengths of the timed decode steps (default 64,512,2048)")
    cal.add_argument("--repeats", type=int, default=3,
                     help="timed calls per point; the median counts (default 3)")
    cal.add_argument("--out", type=Path, default=Path("calibration.json"),
                     help="JSON file to write (default %(default)s)")
    cal.add_argument("--quiet", action="store_true", help="no progress output")

    eb = sub.add_parser("engine-bench",
                        help="run policies on the real engine next to the simulator's prediction")
    eb.add_argument("--workload", default="chat-server",
                    help="built-in workload generator (default %(default)s)")
    _generator_args(eb)
    eb.add_argument("--requests", type=int, default=120,
                    help="run the first N requests by arrival (default %(default)s)")
    eb.add_argument("--policies", default="lru,market",
                    help="comma-separated policy names (default: %(default)s)")
    eb.add_argument("--cache-blocks", type=int, default=None,
                    help="pool size in blocks (default: where the simulator's LRU hits half "
                         "of what an infinite cache would, or the nearest feasible size)")
    eb.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    eb.add_argument("--time-scale", type=float, default=None,
                    help="workload seconds per engine second (default: automatic, see --load)")
    eb.add_argument("--load", type=float, default=0.5,
                    help="offered load the automatic time scale aims at, as a fraction of "
                         "the engine's estimated compute (default %(default)s)")
    _scheduler_args(eb, max_batched_tokens=512)
    eb.add_argument("--cost-model", type=Path, default=None,
                    help="a kvevict calibrate JSON (default: calibrate now)")
    eb.add_argument("--cold-requests", type=int, default=5,
                    help="first requests reported as the cold start (default %(default)s)")
    eb.add_argument("--check", action="store_true",
                    help="check the cache's invariants after every engine step (slow)")
    _engine_model_args(eb)
    eb.add_argument("--out", type=Path,
                    help="write results.json, answers.json (and calibration.json) here")
    eb.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _generator_args(parser: argparse.ArgumentParser) -> None:
    """The options that shape a generated workload (simulate and engine-bench)."""
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--duration", type=float, default=None,
                        help="generated trace length in seconds (generator default)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the workload's request rate, e.g. its number of people "
                             "(default 1)")


DTYPES = ("float32", "bfloat16", "float16")


def _scheduler_args(parser: argparse.ArgumentParser, max_batched_tokens: int) -> None:
    """The scheduler's options, shared by simulate and engine-bench."""
    parser.add_argument("--max-batched-tokens", type=int, default=max_batched_tokens,
                        help="scheduler token budget per step (default %(default)s)")
    parser.add_argument("--max-seqs", type=int, default=64,
                        help="most running requests (default %(default)s)")
    parser.add_argument("--preemption", default="last-arrived",
                        choices=("last-arrived", "fewest-processed"),
                        help="which running request to preempt (default %(default)s)")


def _ints(text: str) -> list[int]:
    try:
        return [int(p) for p in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _engine_model_args(parser: argparse.ArgumentParser) -> None:
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


def _engine_model(args: argparse.Namespace) -> tuple[Any, dict[str, float]]:
    """Build the engine's model from the flags; time the load and a first (cold) forward."""
    import torch

    from kvevict.engine import LlamaModel, ModelConfig
    from kvevict.pool import BlockPool

    if args.threads < 1:
        raise ConfigError(f"--threads must be a positive int, got {args.threads}")
    torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
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


def _say(args: argparse.Namespace) -> Any:
    start = time.monotonic()

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    return say


def calibrate_command(args: argparse.Namespace) -> int:
    from kvevict.engine.calibrate import (
        DEFAULT_CACHED_LENGTHS,
        DEFAULT_DECODE_BATCHES,
        DEFAULT_DECODE_CONTEXTS,
        DEFAULT_PREFILL_LENGTHS,
        calibrate,
    )

    if args.out.exists() and args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory; give a file name")
    model, startup = _engine_model(args)
    say = _say(args)
    cal = calibrate(
        model, block_size=args.block_size,
        prefill_lengths=args.prefill_lengths or list(DEFAULT_PREFILL_LENGTHS),
        cached_lengths=args.cached_lengths or list(DEFAULT_CACHED_LENGTHS),
        decode_batches=args.decode_batches or list(DEFAULT_DECODE_BATCHES),
        decode_contexts=args.decode_contexts or list(DEFAULT_DECODE_CONTEXTS),
        repeats=args.repeats, progress=say)
    cal.engine.update(startup)
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

    policies = _policies(args.policies)
    if len(set(policies)) != len(policies):
        raise ConfigError(f"--policies lists a policy twice: {args.policies}")
    if args.requests < 1:
        raise ConfigError(f"--requests must be a positive int, got {args.requests}")
    if args.block_size < 1:
        raise ConfigError(f"--block-size must be a positive int, got {args.block_size}")
    if args.cold_requests < 0:
        raise ConfigError(f"--cold-requests must be >= 0, got {args.cold_requests}")
    if not 0 < args.load <= 10:
        raise ConfigError(f"--load: the target load must be in (0, 10], got {args.load}")
    if args.time_scale is not None and not (0 < args.time_scale < float("inf")):
        raise ConfigError(f"--time-scale must be a positive finite number (the time scale), "
                          f"got {args.time_scale}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    cost = None
    if args.cost_model is not None:
        cost = CostModel.load(args.cost_model)
    config = SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                             max_num_seqs=args.max_seqs, preemption=args.preemption)
    kwargs: dict[str, Any] = {"vocab_size": args.vocab, "block_size": args.block_size}
    if args.duration is not None:
        kwargs["duration"] = args.duration
    requests = workloads.generate(args.workload, seed=args.seed, scale=args.scale, **kwargs)
    if len(requests) < args.requests:
        raise ConfigError(f"workload {args.workload} (seed {args.seed}, scale {args.scale}) "
                          f"has only {len(requests)} requests; lower --requests or raise "
                          "--duration / --scale")
    requests = requests[:args.requests]
    say = _say(args)
    say(f"building the engine model ({args.layers} layers, hidden {args.hidden})")
    model, startup = _engine_model(args)
    result = run_bench(requests, model, policies, block_size=args.block_size,
                       capacity_blocks=args.cache_blocks, time_scale=args.time_scale,
                       target_load=args.load, config=config, cost=cost,
                       cold_requests=args.cold_requests, check=args.check, progress=say)
    result["model"].update(startup)
    if args.cost_model is not None:
        result["calibration"]["path"] = str(args.cost_model)
    result["command"] = "kvevict " + " ".join(shlex.quote(a) for a in args.argv)
    result["workload"].update({"name": args.workload, "seed": args.seed, "scale": args.scale})
    print(format_report(result, f"{args.workload} (seed {args.seed}, scale {args.scale:g})"))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps(strip_answers(result), indent=2, sort_keys=True, default=str) + "\n")
        (out / "answers.json").write_text(
            json.dumps(result["answers_by_policy"], sort_keys=True) + "\n")
        written = ["results.json", "answers.json"]
        cal = result["calibration"]
        if "cost_model" in cal:  # calibrated now: save it for --cost-model next time
            (out / "calibration.json").write_text(json.dumps(
                {k: v for k, v in cal.items() if k not in ("source", "path")}, indent=2,
                sort_keys=True) + "\n")
            written.append("calibration.json")
        print(f"wrote {', '.join(written)} to {out}")
    return 0 if result["lossless"] else 1


def _layout(args: argparse.Namespace) -> KVLayout:
    if args.model_config is not None:
        try:
            config = json.loads(args.model_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {args.model_config}: {exc}") from None
        return from_hf_config(config)
    return preset(args.model)


def _requests(args: argparse.Namespace) -> tuple[list[Any], str, int | None]:
    """The requests, the workload's label, and the block size the trace fixes (a Mooncake
    trace's hash ids are blocks of its own size; None: the trace or generator fixes none)."""
    from kvevict import workloads

    if args.trace is not None:
        readers = {"jsonl": workloads.read_jsonl, "mooncake": workloads.read_mooncake,
                   "alibaba": workloads.read_alibaba, "sharegpt": workloads.read_sharegpt}
        if not args.trace.exists():
            raise ConfigError(f"trace file {args.trace} does not exist")
        if args.scale != 1 or args.duration is not None:
            raise ConfigError("--scale and --duration shape a generated workload; they do not "
                              "apply to --trace")
        label = f"{args.trace.name} ({args.format})"
        if args.format == "mooncake":
            block_size = workloads.check_block_size(args.trace, args.block_size,
                                                    flag="--block-size")
            return workloads.read_mooncake(args.trace, block_size=block_size), label, block_size
        return readers[args.format](args.trace), label, None
    name = args.workload or "chat-server"
    kwargs = {} if args.duration is None else {"duration": args.duration}
    requests = workloads.generate(name, seed=args.seed, scale=args.scale, **kwargs)
    return requests, name if args.scale == 1 else f"{name} (scale {args.scale:g})", None


class _Progress:
    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.start = time.monotonic()

    def update(self, label: str) -> None:
        self.done += 1
        if self.quiet:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.start
        end = "\n" if self.done == self.total or not sys.stderr.isatty() else "\r"
        print(f"[{bar}] {self.done}/{self.total} {label:<28} {elapsed:6.1f}s",
              end=end, file=sys.stderr, flush=True)


def simulate_command(args: argparse.Namespace) -> int:
    from kvevict import report
    from kvevict.policies.registry import is_offline
    from kvevict.scheduler import SchedulerConfig
    from kvevict.sim import simulate

    policies = _policies(args.policies)
    if all(is_offline(p) for p in policies):
        bound = "is the offline bound" if len(set(policies)) == 1 else "are offline bounds"
        raise ConfigError("--policies needs at least one online policy to choose from "
                          f"({', '.join(policies)} {bound})")
    if args.block_size is not None and args.block_size <= 0:
        raise ConfigError(f"--block-size must be a positive int, got {args.block_size}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    if args.trace is not None and args.trace.exists() and not args.trace.is_file():
        raise ConfigError(f"--trace {args.trace} is not a file")
    layout = _layout(args)
    requests, workload, trace_block_size = _requests(args)
    if not requests:
        raise ConfigError(f"{workload} holds no requests")
    block_size = trace_block_size or args.block_size or 16
    if args.cache_blocks is not None:
        capacity = args.cache_blocks
        if capacity <= 0:
            raise ConfigError(f"--cache-blocks must be positive, got {capacity}")
    else:
        gib = 1.0 if args.cache_gib is None else args.cache_gib
        if not gib > 0 or gib == float("inf"):
            raise ConfigError(f"--cache-gib must be a positive finite number, got {gib}")
        capacity = layout.blocks_for_bytes(gib * GIB, block_size)
        if capacity < 1:
            raise ConfigError(f"{gib} GiB holds no block of {block_size} tokens of "
                              f"{layout.name or 'this model'} "
                              f"({layout.bytes_per_block(block_size):,} bytes per block)")
    largest = max(requests, key=lambda r: _blocks_needed(r, block_size))
    min_blocks = _blocks_needed(largest, block_size)
    if capacity < min_blocks:
        raise ConfigError(
            f"the cache ({capacity:,} blocks of {block_size} tokens) cannot hold request "
            f"{largest.request_id!r}, which needs {min_blocks:,} blocks; use at least "
            f"--cache-blocks {min_blocks}"
        )
    config = SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                             max_num_seqs=args.max_seqs, preemption=args.preemption)
    sweep_caps = [] if args.no_sweep else sorted(
        {max(1, round(capacity * m)) for m in args.sweep} - {capacity})
    too_small = [c for c in sweep_caps if c < min_blocks]
    if too_small and not args.quiet:
        print(f"note: sweep sizes {', '.join(map(str, too_small))} blocks skipped: they cannot "
              f"hold the largest request ({min_blocks} blocks)", file=sys.stderr)
    sweep_caps = [c for c in sweep_caps if c >= min_blocks]
    progress = _Progress(len(policies) * (1 + len(sweep_caps)), args.quiet)
    from kvevict.cost import CostModel

    try:
        cost = CostModel.for_model(layout)
    except ConfigError:
        cost = CostModel()  # unknown parameter count: the Llama-3-8B default
    main_results = {}
    for p in policies:
        main_results[p] = simulate(requests, p, capacity_blocks=capacity, layout=layout,
                                   block_size=block_size, cost=cost, config=config)
        progress.update(f"{p} @ {capacity:,} blocks")
    sweep = [r.summary() for r in main_results.values()]
    for cap in sweep_caps:
        for p in policies:
            sweep.append(simulate(requests, p, capacity_blocks=cap, layout=layout,
                                  block_size=block_size, cost=cost, config=config).summary())
            progress.update(f"{p} @ {cap:,} blocks")
    summaries = [r.summary() for r in main_results.values()]
    tokens_cap = capacity * block_size
    capacity_desc = (f"{capacity:,} blocks of {block_size} tokens = {tokens_cap:,} tokens = "
                     f"{capacity * layout.bytes_per_block(block_size) / GIB:.2f} GiB")
    print(f"workload {workload}: {len(requests)} requests; model {layout.name}; cache "
          f"{capacity_desc}")
    print(report.format_table(summaries))
    chosen, why = report.explain_choice(summaries)
    print(f"\nchosen: {chosen['policy']} ({why})")
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "workload": workload, "seed": args.seed, "model": layout.name,
            "bytes_per_token": layout.bytes_per_token, "block_size": block_size,
            "capacity_blocks": capacity, "scheduler": {
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_num_seqs": config.max_num_seqs, "preemption": config.preemption},
            "results": summaries, "sweep": sorted(
                sweep, key=lambda s: (s["policy"], s["capacity_blocks"])),
            "chosen": chosen["policy"],
        }
        (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        command = "kvevict " + " ".join(shlex.quote(a) for a in args.argv)
        layout_desc = (f"{layout.attention.upper()}, {layout.num_layers} layers, "
                       f"{layout.bytes_per_token:,} KV bytes per token ({layout.dtype})")
        (out / "DECISION.md").write_text(report.decision_record(
            summaries, workload=workload, model=layout.name or "custom",
            layout_desc=layout_desc, capacity_desc=capacity_desc, seed=args.seed,
            command=command, sweep=sweep))
        written = ["results.json", "DECISION.md"]
        try:
            if sweep_caps:
                report.plot_hit_ratio(sweep, out / "hit_ratio.png",
                                      f"{workload}: hit ratio vs cache size")
                written.append("hit_ratio.png")
            report.plot_ttft_cdf(
                {p: [rec.ttft for rec in r.records] for p, r in main_results.items()},
                out / "ttft_cdf.png", f"{workload}: TTFT at {capacity:,} blocks")
            written.append("ttft_cdf.png")
        except ImportError as exc:
            print(f"note: {exc}", file=sys.stderr)
        print(f"wrote {', '.join(written)} to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"simulate": simulate_command, "calibrate": calibrate_command,
                "engine-bench": engine_bench_command}
    try:
        if args.command in commands:
            return commands[args.command](args)
    except (ConfigError, TraceFormatError, KVEvictError, OSError) as exc:
        print(f"kvevict: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
