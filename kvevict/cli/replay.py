"""``kvevict replay``: the exact block-level replay of a trace (`kvevict.replay`: one request
at a time, no timing) through policies at several pool sizes; prints a Markdown table, and
with ``--out DIR`` writes ``results.json`` and ``hit_ratio.png`` (every row against pool
size, `kvevict.report.plot_replay`). ``--versus NAME`` also prints every row against the row
``NAME`` with its interval by batch means (`kvevict.replay.compare`), and with ``--out`` draws
it as ``versus.png`` (`kvevict.report.plot_comparison`).

By default the table is the **oracle decomposition**: every registered online policy, then
the horizon oracle (``--horizons`` sweeps its H), the reuse oracle, Belady and the infinite
cache (`kvevict.replay.default_policies`). ``--policies`` picks rows by name, ``infinite``
included.

The trace streams (`kvevict.workloads.TraceFile`): memory follows the cache, not the
trace, and ``belady`` reads its future from a next-use file written by a first pass (see
`kvevict.policies.belady.NextUseFile`). A progress bar per pass goes to stderr.

``--engine vllm-offload`` replays the same trace through vLLM's real ``CPUOffloadingManager``
instead (`kvevict.adapters.vllm.replay.replay_offload_table`: no model, no GPU), with vLLM's
own policies (``vllm:lru``, ``vllm:arc``) or any online kvevict policy through the adapter;
``--sizes`` are then offload chunks of ``--block-size`` tokens. ``--engine vllm`` replays it
through vLLM's real GPU-tier ``KVCacheManager`` (`kvevict.adapters.vllm.gpu_replay.
replay_gpu_table`: vLLM hashes the prompts' tokens itself), stock (``vllm:lru``) or with any
online kvevict policy through the GPU-tier plugin; ``--sizes`` are then GPU blocks. Both need
vLLM installed (docs/vllm.md); without it the command stops with one line naming the install
command. They keep the same batches as kvevict's replay, so ``--versus vllm:lru`` says whether
a kvevict policy inside vLLM differs from stock vLLM beyond the interval.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvevict.cli.common import (
    FORMATS,
    Progress,
    float_list,
    import_policy_modules,
    int_list,
    parse_policies,
    policy_module_arg,
    policy_module_files,
    recorded_command,
)
from kvevict.errors import ConfigError
from kvevict.policies.oracles import DEFAULT_HORIZON
from kvevict.policies.registry import split_specs
from kvevict.replay import (
    INFINITE,
    METRICS,
    MIN_BATCHES,
    ReplayTable,
    compare,
    default_policies,
    format_comparison,
    format_table,
    format_tier_table,
    load_results,
    open_trace,
    replay_table,
    row_labels,
)

__all__ = ["DEFAULT_SIZES", "ENGINES", "add_parser", "replay_command"]

DEFAULT_SIZES = (1000, 2000, 5000, 10000, 20000)
#: ``--engine``: kvevict's own block manager, vLLM's real offload-tier manager, or vLLM's
#: real GPU-tier ``KVCacheManager``.
ENGINES = ("kvevict", "vllm-offload", "vllm")
#: What ``--sizes`` count, and what the header names, per vLLM engine.
_VLLM_ENGINES = {"vllm-offload": ("offload chunks", "vLLM's CPUOffloadingManager"),
                 "vllm": ("GPU blocks", "vLLM's KVCacheManager (GPU tier)")}
#: Updates of each pass's progress bar (on a terminal; a log gets one line per update, so
#: `LOG_STEPS` of them).
BAR_STEPS = 40
LOG_STEPS = 10
#: Options that say how to replay a trace: refused with ``--from`` (which replays nothing)
#: when they differ from their defaults.
_REPLAY_ONLY = ("trace", "format", "engine", "horizons", "block_size", "time", "records",
                "workdir", "host_blocks", "host_policy", "host_profile")


def add_parser(sub: Any) -> None:
    """The ``replay`` subcommand's options."""
    rep = sub.add_parser("replay", help="exact block-level hit ratios of policies on a trace "
                                        "(no timing; Belady is the exact oracle)")
    rep.add_argument("--trace", default="mooncake",
                     help="a trace file, or the name of a bundled trace (mooncake, the "
                          "default; --format mooncake)")
    rep.add_argument("--format", choices=FORMATS, default="mooncake",
                     help="trace file format (default %(default)s)")
    rep.add_argument("--sizes", type=int_list, default=None,
                     help="comma-separated pool sizes in blocks (default: "
                          f"{','.join(map(str, DEFAULT_SIZES))}; with --from, those of the "
                          "saved results to show, all by default)")
    rep.add_argument("--engine", choices=ENGINES, default="kvevict",
                     help="whose bookkeeping replays the trace: kvevict's block manager (the "
                          "default), vLLM's real CPUOffloadingManager (vllm-offload; sizes in "
                          "offload chunks) or vLLM's real GPU-tier KVCacheManager (vllm; "
                          "sizes in GPU blocks); the vLLM engines need vLLM")
    rep.add_argument("--policies", default=None,
                     help="comma-separated policy names, and 'infinite' for the infinite "
                          "cache (default: every registered online policy, then "
                          "horizon-oracle, reuse-oracle, belady and infinite; with --engine "
                          "vllm-offload: vllm:lru, vllm:arc and every registered online one; "
                          "with --engine vllm: vllm:lru and every registered online one)")
    rep.add_argument("--horizons", type=float_list, default=None, metavar="H,...",
                     help="the horizon oracle at each H (seconds with --time arrival, "
                          "requests with --time index): one row 'horizon-oracle H=...' each, "
                          f"in place of its row at the default H ({DEFAULT_HORIZON:g})")
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
    rep.add_argument("--versus", default=None, metavar="NAME",
                     help="also print every row against the row NAME (e.g. lru): the ratio of "
                          "--metric (a ratio metric; else the block hit ratio) and the "
                          "difference with its 95%% interval by batch means, 'n.s.' where it "
                          "holds 0")
    rep.add_argument("--records", action="store_true",
                     help="keep per-request records and write them to results.json "
                          "(memory in proportion to the trace)")
    rep.add_argument("--workdir", type=Path, default=None,
                     help="directory for belady's next-use files (default: the system's "
                          "temporary directory; removed at the end)")
    rep.add_argument("--out", type=Path,
                     help="write results.json and hit_ratio.png (every row against pool "
                          "size) here")
    rep.add_argument("--host-blocks", type=int, default=None, metavar="N",
                     help="a host memory tier of N blocks below the pool (kvevict.tiers, "
                          "metadata-only): evicted blocks are demoted there, a hit there is "
                          "a reload; prints the hit ratio by tier and the bytes moved")
    rep.add_argument("--host-policy", default="lru",
                     help="the host tier's own policy (default %(default)s)")
    rep.add_argument("--host-profile", default="host-pcie5",
                     help="the host tier's link (kvevict.tiers.TIER_PROFILES; default "
                          "%(default)s)")
    rep.add_argument("--from", dest="saved", type=Path, default=None, metavar="DIR",
                     help="replay nothing: read the results.json that --out DIR wrote (DIR "
                          "or the file) and print its table, or --versus against another "
                          "row; --policies and --sizes pick rows and sizes, --out writes the "
                          "plots only")
    rep.add_argument("--quiet", action="store_true", help="no progress output")
    rep.set_defaults(run=replay_command,
                     replay_defaults={d: rep.get_default(d) for d in _REPLAY_ONLY})


def _host_tier(args: argparse.Namespace) -> Any:
    """The ``tiers`` factory of ``--host-blocks`` (None without it)."""
    blocks = getattr(args, "host_blocks", None)
    if blocks is None:
        return None
    if blocks <= 0:
        raise ConfigError(f"--host-blocks must be a positive number of blocks, got {blocks}")
    from kvevict.tiers import Tier, TierStack, tier_profile

    profile = tier_profile(args.host_profile)
    from kvevict.policies.registry import check_spec

    check_spec(args.host_policy)  # an unknown name or parameter fails before the trace is read

    def factory() -> TierStack:
        return TierStack([Tier(blocks, profile, policy=args.host_policy, name="host")])

    return factory


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
    """``--policies`` (registered names and ``infinite``), or `default_policies` once the
    ``--policy-module`` modules and the entry points are loaded."""
    from kvevict.policies.registry import check_distinct, load_entry_point_policies

    if args.policies is not None:
        names = split_specs(args.policies)
        check_distinct(names, "--policies")
        named = [n for n in names if n != INFINITE]
        if named:
            parse_policies(",".join(named), args.policy_module)
        elif not names:
            parse_policies("", args.policy_module)  # names the valid ones
        else:
            load_entry_point_policies()
            import_policy_modules(args.policy_module)
        return names
    load_entry_point_policies()
    import_policy_modules(args.policy_module)
    return default_policies()


def _vllm_replay(engine: str = "vllm-offload"):
    """The table function and vLLM's own policy names of ``engine`` (``vllm-offload``:
    `replay_offload_table`; ``vllm``: `replay_gpu_table`), or a `ConfigError` naming the
    install command when vLLM is absent (or not a supported version)."""
    from kvevict.adapters.vllm import vllm_version

    try:
        vllm_version()
    except ImportError as exc:
        raise ConfigError(f"--engine {engine}: {exc}") from None
    if engine == "vllm":
        from kvevict.adapters.vllm.gpu_replay import VLLM_GPU_POLICIES, replay_gpu_table

        return replay_gpu_table, VLLM_GPU_POLICIES
    from kvevict.adapters.vllm.replay import VLLM_POLICIES, replay_offload_table

    return replay_offload_table, VLLM_POLICIES


def _offload_policies(args: argparse.Namespace, vllm_policies: tuple[str, ...],
                      engine: str = "vllm-offload") -> list[str]:
    """``--policies`` for a vLLM ``engine``: vLLM's own names or online kvevict ones
    (default: vLLM's, then every registered online kvevict policy)."""
    from kvevict.policies import available_policies
    from kvevict.policies.registry import check_spec, is_offline, load_entry_point_policies

    load_entry_point_policies()
    import_policy_modules(args.policy_module)
    online = [p for p in available_policies() if not is_offline(p)]
    if args.policies is None:
        return list(vllm_policies) + online
    names = split_specs(args.policies)
    offline = [p for p in names if is_offline(p)]
    if offline:
        raise ConfigError(f"--engine {engine} takes online policies; {offline[0]} is "
                          "offline (it needs the future)")
    for p in names:
        if "(" in p:
            check_spec(p)  # an unknown name or parameter, named
    unknown = [p for p in names
               if "(" not in p and p not in online and p not in vllm_policies]
    if unknown or not names:
        raise ConfigError(f"unknown policy {', '.join(unknown) or '(none given)'}; valid "
                          f"names with --engine {engine}: "
                          f"{', '.join(list(vllm_policies) + online)}")
    from kvevict.policies.registry import check_distinct

    check_distinct(names, "--policies")
    return names


def _plot_metric(metric: str) -> str:
    """The plot's y axis: ``--metric`` when it is a ratio, else the block hit ratio."""
    return metric if metric.endswith("_ratio") else "block_hit_ratio"


def _check_sizes(sizes: list[int]) -> None:
    if not sizes:
        raise ConfigError("--sizes needs at least one pool size in blocks")
    bad = [s for s in sizes if s <= 0]
    if bad:
        raise ConfigError(f"--sizes must hold positive ints (pool sizes in blocks), got "
                          f"{bad[0]}")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--sizes gives a size twice: {','.join(map(str, sizes))}")


def _check_versus(versus: str | None, rows: list[str], what: str) -> None:
    """``--versus`` names one of ``rows`` (those of ``what``: this replay, saved results)."""
    if versus is not None and versus not in rows:
        raise ConfigError(f"--versus {versus!r} is not a row of {what} (rows: "
                          f"{', '.join(rows)})")


def replay_command(args: argparse.Namespace) -> int:
    if args.sizes is not None:
        _check_sizes(list(args.sizes))
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    if getattr(args, "saved", None) is not None:
        return _saved_command(args)
    sizes = list(args.sizes) if args.sizes is not None else list(DEFAULT_SIZES)
    if args.workdir is not None and not args.workdir.is_dir():
        raise ConfigError(f"--workdir {args.workdir} is not a directory")
    engine = getattr(args, "engine", "kvevict")
    horizons = getattr(args, "horizons", None)
    tiers = _host_tier(args)
    if tiers is not None and engine != "kvevict":
        raise ConfigError("--host-blocks is for --engine kvevict (vLLM's offload manager is "
                          "itself the host tier)")
    versus = getattr(args, "versus", None)
    if horizons is not None and not horizons:
        raise ConfigError("--horizons needs at least one H (a number of seconds with --time "
                          "arrival, of requests with --time index)")
    if engine in _VLLM_ENGINES:
        if horizons is not None:
            raise ConfigError(f"--horizons is for --engine kvevict: the horizon oracle is "
                              f"offline, and --engine {engine} runs online policies only")
        if args.records:
            raise ConfigError(f"--records is for --engine kvevict; the {engine} replay "
                              "keeps no per-request records")
        if args.workdir is not None:
            raise ConfigError(f"--workdir holds belady's next-use files, for --engine "
                              f"kvevict; --engine {engine} runs online policies only")
        run_table, vllm_policies = _vllm_replay(engine)
        policies = _offload_policies(args, vllm_policies, engine)
        rows = list(policies)
    else:
        policies = _policies(args)
        rows = row_labels(policies, horizons)
    _check_versus(versus, rows, "this replay")  # before the replay, not after it
    trace, block_size = open_trace(args.trace, args.format, block_size=args.block_size,
                                   time=args.time)
    if engine in _VLLM_ENGINES:
        unit = _VLLM_ENGINES[engine][0]

        def cell_done(policy: str, size: int) -> None:
            if not args.quiet:
                print(f"{engine}: {policy} at {size:,} {unit} done", file=sys.stderr)

        table = run_table(trace, policies, sizes, block_size, time=args.time,
                          progress=cell_done)
    else:
        total = 0 if args.quiet else trace.count()
        table = replay_table(trace, policies, sizes, block_size, time=args.time,
                             records=args.records,
                             progress=None if args.quiet else _Bars(total, args.quiet),
                             workdir=args.workdir, horizons=horizons, tiers=tiers)
        policies = list(table.policies)
        unit = "blocks"
    requests = table.results[0].requests if table.results else 0
    meta: dict[str, Any] = {
        "trace": str(args.trace), "format": args.format, "block_size": block_size,
        "time": args.time, "requests": requests, "sizes": sizes, "policies": policies,
        "command": recorded_command(args), "engine": engine,
    }
    if horizons is not None:  # an infinite H as "inf" (JSON has no infinity)
        meta["horizons"] = [h if math.isfinite(h) else "inf" for h in horizons]
    if tiers is not None:
        meta["host"] = {"blocks": args.host_blocks, "policy": args.host_policy,
                        "profile": args.host_profile}
    if engine in _VLLM_ENGINES:
        from kvevict.adapters.vllm import vllm_version

        meta["vllm_version"] = vllm_version()
    if args.policy_module:
        meta["policy_modules"] = policy_module_files(args)
    _report(args, table, meta, save=args.out is not None)
    return 0


def _saved_command(args: argparse.Namespace) -> int:
    """``--from``: the table and comparisons of saved results; nothing is replayed."""
    defaults = args.replay_defaults
    given = [d for d in _REPLAY_ONLY if getattr(args, d) != defaults[d]]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(f"{flag} says how to replay a trace; --from {args.saved} replays "
                          "nothing (it reads the results a replay saved)")
    table, meta = load_results(args.saved)
    policies = None
    if args.policies is not None:
        # the saved rows' names, not the registry's: a row may be `infinite`, an oracle sweep
        # or a policy another process registered (--policy-module)
        from kvevict.policies.registry import check_distinct

        policies = split_specs(args.policies)
        if not policies:
            raise ConfigError(f"--policies names no row (rows: {', '.join(table.policies)})")
        check_distinct(policies, "--policies")
    table = table.select(policies, args.sizes)
    _check_versus(args.versus, table.policies, "these results")
    meta.setdefault("trace", str(args.saved))
    _report(args, table, meta, save=False)
    return 0


def _report(args: argparse.Namespace, table: ReplayTable, meta: dict[str, Any],
            save: bool) -> None:
    """Print the table (and ``--versus``, the tier table), and with ``--out`` draw the plots
    (and, when ``save``, write results.json: ``meta`` and the table's rows)."""
    engine = meta.get("engine", "kvevict")
    unit = _VLLM_ENGINES[engine][0] if engine in _VLLM_ENGINES else "blocks"
    block_size = meta.get("block_size", table.results[0].block_size)
    time = meta.get("time", "index")
    versus = args.versus
    print(f"trace {meta['trace']} ({meta.get('format', 'mooncake')}): "
          f"{table.results[0].requests:,} requests; {unit} of {block_size} tokens; time axis "
          f"{time}" + (f"; {_VLLM_ENGINES[engine][1]}" if engine in _VLLM_ENGINES else ""))
    print(format_table(table, args.metric))
    comparisons = None
    if versus is not None:
        metric = _plot_metric(args.metric)
        comparisons = compare(table, versus, metric)
        batches = len(table.results[0].batches)
        print(f"\nagainst {versus}: the ratio of the {metric.replace('_', ' ')}, and the "
              f"difference with its 95% interval by batch means ({batches} batches of "
              f"consecutive requests, at least {MIN_BATCHES}); bold where it excludes 0, "
              "n.s. (no significant difference) where it does not")
        print(format_comparison(table, versus, metric, comparisons=comparisons))
    if any(r.tiers for r in table.results):
        host = meta.get("host")
        about = (f" of {host['blocks']:,} blocks ({host['policy']}, {host['profile']})"
                 if host else "")
        print(f"\nwith a host tier{about}: blocks served by each tier over blocks looked up; "
              "GiB moved at the cost model's KV bytes per block")
        print(format_tier_table(table))
    if args.out is None:
        return
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if save:
        payload = dict(meta, results=table.rows())
        (out / "results.json").write_text(json.dumps(payload, indent=2, sort_keys=True)
                                          + "\n")
        written.append("results.json")
    from kvevict.report import plot_comparison, plot_replay

    axis = "arrival seconds" if time == "arrival" else "request index"
    replayed = ("exact replay" if engine == "kvevict"
                else _VLLM_ENGINES[engine][1].removesuffix(" (GPU tier)"))
    title = (f"{Path(str(meta['trace'])).name}: {replayed}, {block_size}-token "
             f"{unit}, {axis} clock")
    try:  # as kvevict simulate: without matplotlib, the results and a note saying so
        plot_replay(table.rows(), out / "hit_ratio.png", title,
                    metric=_plot_metric(args.metric))
        written.append("hit_ratio.png")
        if comparisons:
            plot_comparison(comparisons, out / "versus.png", title)
            written.append("versus.png")
    except ImportError as exc:
        print(f"note: {exc}", file=sys.stderr)
    print(f"wrote {', '.join(written) or 'nothing'} to {out}")
