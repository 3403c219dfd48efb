"""``kvevict simulate``: compare eviction policies on a workload or a trace, print the
table, and with ``--out DIR`` write ``results.json``, the plots and ``DECISION.md``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvevict.cli.common import (
    FORMATS,
    GIB,
    Progress,
    float_list,
    generator_args,
    parse_policies,
    policy_module_arg,
    policy_module_files,
    recorded_command,
    scheduler_args,
)
from kvevict.errors import ConfigError
from kvevict.layout import PRESETS, KVLayout, from_hf_config, preset

__all__ = ["DEFAULT_POLICIES", "add_parser", "simulate_command"]

DEFAULT_POLICIES = ("lru", "lfu", "pinned", "market", "bayes", "dbms", "belady")
DEFAULT_SWEEP = (0.5, 2.0, 4.0)


def add_parser(sub: Any) -> None:
    """The ``simulate`` subcommand's options."""
    sim = sub.add_parser("simulate", help="compare eviction policies on a workload or trace")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help="built-in workload generator (default: chat-server)")
    src.add_argument("--trace", type=Path, help="a trace file instead of a generator")
    sim.add_argument("--format", choices=FORMATS, default="jsonl", help="trace file format")
    generator_args(sim)
    sim.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                     help="comma-separated policy names (default: %(default)s)")
    policy_module_arg(sim)
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
    sim.add_argument("--sweep", type=float_list, default=list(DEFAULT_SWEEP),
                     help="capacity multipliers for the hit-ratio sweep "
                          "(default: 0.5,2,4; sizes that cannot hold the largest request "
                          "are skipped)")
    sim.add_argument("--no-sweep", action="store_true", help="skip the capacity sweep")
    scheduler_args(sim, max_batched_tokens=2048)
    sim.add_argument("--out", type=Path, help="write results.json, plots and DECISION.md here")
    sim.add_argument("--quiet", action="store_true", help="no progress output")
    sim.set_defaults(run=simulate_command)


def blocks_needed(request: Any, block_size: int) -> int:
    """Blocks a request holds at its longest: its prompt (each listed hash a block) plus
    its output."""
    prompt = request.prompt_len
    if request.block_hashes is not None:
        prompt = max(prompt, len(request.block_hashes) * block_size)
    return -(-(prompt + request.output_len) // block_size)



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



def simulate_command(args: argparse.Namespace) -> int:
    from kvevict import report
    from kvevict.policies.registry import is_offline
    from kvevict.scheduler import SchedulerConfig
    from kvevict.sim import simulate

    policies = parse_policies(args.policies, args.policy_module)
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
    largest = max(requests, key=lambda r: blocks_needed(r, block_size))
    min_blocks = blocks_needed(largest, block_size)
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
    progress = Progress(len(policies) * (1 + len(sweep_caps)), args.quiet)
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
        if args.policy_module:
            payload["policy_modules"] = policy_module_files(args)
        (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        command = recorded_command(args)
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
