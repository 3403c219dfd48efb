"""The ``kvevict`` command: which policy should this box run, and what does it buy?

``kvevict simulate`` (no arguments) replays the built-in ``chat-server`` workload through
every policy at a default cache size, prints a table, and with ``--out DIR`` writes
``results.json``, ``hit_ratio.png``, ``ttft_cdf.png`` and ``DECISION.md``.
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
    sim.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    sim.add_argument("--duration", type=float, default=None,
                     help="generated trace length in seconds (generator default)")
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
                     help="tokens per block (default 16; 512 for Mooncake traces)")
    sim.add_argument("--sweep", type=_floats, default=list(DEFAULT_SWEEP),
                     help="capacity multipliers for the hit-ratio sweep "
                          "(default: 0.5,2,4; sizes that cannot hold the largest request "
                          "are skipped)")
    sim.add_argument("--no-sweep", action="store_true", help="skip the capacity sweep")
    sim.add_argument("--max-batched-tokens", type=int, default=2048,
                     help="scheduler token budget per step (default %(default)s)")
    sim.add_argument("--max-seqs", type=int, default=64,
                     help="most running requests (default %(default)s)")
    sim.add_argument("--preemption", default="last-arrived",
                     choices=("last-arrived", "fewest-processed"),
                     help="which running request to preempt (default %(default)s)")
    sim.add_argument("--out", type=Path, help="write results.json, plots and DECISION.md here")
    sim.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def _layout(args: argparse.Namespace) -> KVLayout:
    if args.model_config is not None:
        try:
            config = json.loads(args.model_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {args.model_config}: {exc}") from None
        return from_hf_config(config)
    return preset(args.model)


def _requests(args: argparse.Namespace) -> tuple[list[Any], str]:
    from kvevict import workloads

    if args.trace is not None:
        readers = {"jsonl": workloads.read_jsonl, "mooncake": workloads.read_mooncake,
                   "alibaba": workloads.read_alibaba, "sharegpt": workloads.read_sharegpt}
        if not args.trace.exists():
            raise ConfigError(f"trace file {args.trace} does not exist")
        return readers[args.format](args.trace), f"{args.trace.name} ({args.format})"
    name = args.workload or "chat-server"
    kwargs = {} if args.duration is None else {"duration": args.duration}
    return workloads.generate(name, seed=args.seed, **kwargs), name


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
    from kvevict.policies import available_policies
    from kvevict.scheduler import SchedulerConfig
    from kvevict.sim import simulate

    policies = _csv(args.policies)
    valid = available_policies()
    unknown = [p for p in policies if p not in valid]
    if unknown or not policies:
        raise ConfigError(f"unknown policy {', '.join(unknown) or '(none given)'}; valid "
                          f"names: {', '.join(valid)}")
    if all(p == "belady" for p in policies):
        raise ConfigError("--policies needs at least one online policy to choose from "
                          "(belady is the offline bound)")
    if args.block_size is not None and args.block_size <= 0:
        raise ConfigError(f"--block-size must be a positive int, got {args.block_size}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    if args.trace is not None and args.trace.exists() and not args.trace.is_file():
        raise ConfigError(f"--trace {args.trace} is not a file")
    layout = _layout(args)
    requests, workload = _requests(args)
    if not requests:
        raise ConfigError(f"{workload} holds no requests")
    block_size = args.block_size or (512 if args.format == "mooncake" and args.trace else 16)
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
    chosen = report.choose_policy(summaries)
    print(f"\nchosen: {chosen['policy']} (lowest p95 TTFT {chosen['ttft_p95']:.3f} s)")
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
    try:
        if args.command == "simulate":
            return simulate_command(args)
    except (ConfigError, TraceFormatError, KVEvictError, OSError) as exc:
        print(f"kvevict: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
