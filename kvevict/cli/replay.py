"""``kvevict replay``: the exact block-level replay of a trace (`kvevict.replay`: one request
at a time, no timing) through policies at several pool sizes; prints a Markdown table, and
with ``--out DIR`` writes ``results.json``.

The trace streams (`kvevict.workloads.TraceFile`): memory follows the cache, not the
trace, and ``belady`` reads its future from a next-use file written by a first pass (see
`kvevict.policies.belady.NextUseFile`). A progress bar per pass goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvevict.cli.common import (
    FORMATS,
    Progress,
    import_policy_modules,
    int_list,
    parse_policies,
    policy_module_arg,
    policy_module_files,
    recorded_command,
)
from kvevict.errors import ConfigError

__all__ = ["DEFAULT_SIZES", "add_parser", "replay_command"]

DEFAULT_SIZES = (1000, 2000, 5000, 10000, 20000)
METRICS = ("block_hit_ratio", "token_hit_ratio", "evictions", "hits")
#: Updates of each pass's progress bar (on a terminal; a log gets one line per update, so
#: `LOG_STEPS` of them).
BAR_STEPS = 40
LOG_STEPS = 10


def add_parser(sub: Any) -> None:
    """The ``replay`` subcommand's options."""
    rep = sub.add_parser("replay", help="exact block-level hit ratios of policies on a trace "
                                        "(no timing; Belady is the exact oracle)")
    rep.add_argument("--trace", default="mooncake",
                     help="a trace file, or the name of a bundled trace (mooncake, the "
                          "default; --format mooncake)")
    rep.add_argument("--format", choices=FORMATS, default="mooncake",
                     help="trace file format (default %(default)s)")
    rep.add_argument("--sizes", type=int_list, default=list(DEFAULT_SIZES),
                     help="comma-separated pool sizes in blocks (default: "
                          f"{','.join(map(str, DEFAULT_SIZES))})")
    rep.add_argument("--policies", default=None,
                     help="comma-separated policy names (default: every registered one, "
                          "the offline ones last)")
    policy_module_arg(rep)
    rep.add_argument("--block-size", type=int, default=None,
                     help="tokens per block: a Mooncake trace's own (512 unless the file says "
                          "otherwise) and no other; Alibaba 16; jsonl and sharegpt: 16 "
                          "unless given")
    rep.add_argument("--time", choices=("index", "arrival"), default="index",
                     help="clock axis: request index or arrival seconds (the trace must be "
                          "in arrival order; default %(default)s)")
    rep.add_argument("--metric", choices=METRICS, default="block_hit_ratio",
                     help="what the printed table shows (default %(default)s)")
    rep.add_argument("--records", action="store_true",
                     help="keep per-request records and write them to results.json "
                          "(memory in proportion to the trace)")
    rep.add_argument("--workdir", type=Path, default=None,
                     help="directory for belady's next-use files (default: the system's "
                          "temporary directory; removed at the end)")
    rep.add_argument("--out", type=Path, help="write results.json here")
    rep.add_argument("--quiet", action="store_true", help="no progress output")
    rep.set_defaults(run=replay_command)


class _Bars:
    """One `Progress` bar per pass (``future``: Belady's first pass; ``replay``), fed by the
    replay's ``progress(phase, requests done)`` callback."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total = total
        self.quiet = quiet
        steps = BAR_STEPS if sys.stderr.isatty() else LOG_STEPS
        self.steps = max(1, min(steps, total))
        self.bars: dict[str, Progress] = {}

    def __call__(self, phase: str, done: int) -> None:
        bar = self.bars.get(phase)
        if bar is None:
            bar = self.bars[phase] = Progress(self.steps, self.quiet)
        target = self.steps if done >= self.total else done * self.steps // self.total
        what = "first pass (next uses)" if phase == "future" else "replay"
        while bar.done < target:
            bar.update(f"{what}: {done:,} requests")


def _policies(args: argparse.Namespace) -> list[str]:
    """``--policies``, or every registered policy (the offline ones last) once the
    ``--policy-module`` modules and the entry points are loaded."""
    from kvevict.policies import available_policies
    from kvevict.policies.registry import load_entry_point_policies, online_first

    if args.policies is not None:
        return parse_policies(args.policies, args.policy_module)
    load_entry_point_policies()
    import_policy_modules(args.policy_module)
    return online_first(available_policies())


def replay_command(args: argparse.Namespace) -> int:
    from kvevict.replay import format_table, open_trace, replay_table

    sizes = list(args.sizes)
    if not sizes:
        raise ConfigError("--sizes needs at least one pool size in blocks")
    bad = [s for s in sizes if s <= 0]
    if bad:
        raise ConfigError(f"--sizes must hold positive ints (pool sizes in blocks), got "
                          f"{bad[0]}")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--sizes gives a size twice: {','.join(map(str, sizes))}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    if args.workdir is not None and not args.workdir.is_dir():
        raise ConfigError(f"--workdir {args.workdir} is not a directory")
    policies = _policies(args)
    trace, block_size = open_trace(args.trace, args.format, block_size=args.block_size,
                                   time=args.time)
    total = 0 if args.quiet else trace.count()
    table = replay_table(trace, policies, sizes, block_size, time=args.time,
                         records=args.records,
                         progress=None if args.quiet else _Bars(total, args.quiet),
                         workdir=args.workdir)
    requests = table.results[0].requests if table.results else 0
    print(f"trace {args.trace} ({args.format}): {requests:,} requests; blocks of "
          f"{block_size} tokens; time axis {args.time}")
    print(format_table(table, args.metric))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {
            "trace": str(args.trace), "format": args.format, "block_size": block_size,
            "time": args.time, "requests": requests, "sizes": sizes, "policies": policies,
            "results": table.rows(), "command": recorded_command(args),
        }
        if args.policy_module:
            payload["policy_modules"] = policy_module_files(args)
        (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        print(f"wrote results.json to {out}")
    return 0
