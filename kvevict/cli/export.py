"""``kvevict export``: write a generated workload as a trace file, so that a run can be
repeated on the file (``kvevict simulate --trace trace.jsonl`` gives the same results as
``kvevict simulate --workload W --seed S``), shared, or read by another tool.

``--format jsonl`` (the default) is kvevict's own format: every `Request` field, an exact
round trip (`kvevict.workloads.write_jsonl`). ``--format mooncake`` writes the Mooncake
format (`kvevict.workloads.write_mooncake`): block ids of ``--block-size`` tokens (the
workload's block size, 16, by default; written on every line), arrival times and lengths,
without token ids, sessions or classes, so a simulation of it is not the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvevict.cli.common import generator_args
from kvevict.errors import ConfigError

__all__ = ["add_parser", "export_command"]


def add_parser(sub: Any) -> None:
    """The ``export`` subcommand's options."""
    exp = sub.add_parser("export", help="write a generated workload as a trace file")
    exp.add_argument("--workload", default="chat-server",
                     help="built-in workload generator (default %(default)s)")
    generator_args(exp)
    exp.add_argument("--format", choices=("jsonl", "mooncake"), default="jsonl",
                     help="jsonl: every request field, an exact round trip (default); "
                          "mooncake: block ids, times and lengths only")
    exp.add_argument("--block-size", type=int, default=None,
                     help="--format mooncake: tokens per block id (default: the workload's "
                          "block size, 16)")
    exp.add_argument("--out", type=Path, required=True, help="the trace file to write")
    exp.add_argument("--quiet", action="store_true", help="no summary line")
    exp.set_defaults(run=export_command)


def export_command(args: argparse.Namespace) -> int:
    from kvevict import workloads

    if args.block_size is not None and args.format != "mooncake":
        raise ConfigError("--block-size applies to --format mooncake only (a jsonl trace "
                          "keeps the token ids, and the reader picks the block size)")
    if args.out.exists() and args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory; give the trace file's path")
    if not args.out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: the directory {args.out.parent} does not exist")
    kwargs = {} if args.duration is None else {"duration": args.duration}
    params = workloads.workload_params(args.workload, scale=args.scale, **kwargs)
    requests = params.generate(args.seed)
    if not requests:
        raise ConfigError(f"workload {args.workload} (seed {args.seed}) generated no requests; "
                          "raise --duration or --scale")
    if args.format == "mooncake":
        block_size = params.block_size if args.block_size is None else args.block_size
        count = workloads.write_mooncake(requests, args.out, block_size=block_size)
        what = f"Mooncake, blocks of {block_size} tokens"
    else:
        count = workloads.write_jsonl(requests, args.out)
        what = "kvevict JSONL"
    if not args.quiet:
        print(f"wrote {count:,} requests of {args.workload} (seed {args.seed}, scale "
              f"{args.scale:g}, {params.duration:g} s) to {args.out} ({what})")
    return 0
