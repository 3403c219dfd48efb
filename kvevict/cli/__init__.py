"""The ``kvevict`` command: which policy should this box run, and what does it buy?

``kvevict simulate`` (no arguments) replays the built-in ``chat-server`` workload through
every policy at a default cache size, prints a table, and with ``--out DIR`` writes
``results.json``, ``hit_ratio.png``, ``ttft_cdf.png`` and ``DECISION.md``
(`kvevict.cli.simulate`).

``kvevict calibrate`` times the built-in engine (`kvevict.engine`) and fits the simulator's
`CostModel` to it; ``kvevict engine-bench`` runs policies on the real engine, side by side
with the simulator's prediction (`kvevict.engine_bench`; both in `kvevict.cli.engine`).

Each subcommand lives in its own module with an ``add_parser`` that sets the function it
runs; what they share is `kvevict.cli.common`. User errors (bad names, malformed traces, a
cache too small for one request) print one line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from kvevict.cli import engine, export, replay, simulate
from kvevict.cli.common import check_flags
from kvevict.cli.simulate import DEFAULT_POLICIES
from kvevict.errors import ConfigError, KVEvictError, TraceFormatError

__all__ = ["DEFAULT_POLICIES", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvevict",
        description="Decide which KV-cache state an LLM server keeps resident, with numbers.")
    sub = parser.add_subparsers(dest="command", required=True)
    simulate.add_parser(sub)
    replay.add_parser(sub)
    export.add_parser(sub)
    engine.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_flags(args)
        return args.run(args)
    except (ConfigError, TraceFormatError, KVEvictError, OSError) as exc:
        print(f"kvevict: error: {exc}", file=sys.stderr)
        return 2
