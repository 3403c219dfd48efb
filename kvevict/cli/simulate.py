"""``kvevict simulate``: compare eviction policies on a workload or a trace, on a named box,
over several seeds, print the table with 95% intervals, and with ``--out DIR`` write
``results.json``, the plots and ``DECISION.md``.

The steps, in order:

1. **the box** (`kvevict.box`): a GPU profile (``--gpu``, ``--gpus``,
   ``--gpu-memory-utilization``) gives the cost model and the KV capacity vLLM would leave;
   a ``--cache-gib`` / ``--cache-blocks`` beyond it is an error unless
   ``--allow-oversubscribe``. ``--host-gib`` / ``--host-x`` (and ``--disk-gib`` /
   ``--disk-x`` below it) put memory tiers under the GPU's KV (`kvevict.sim.TierConfig`,
   docs/tiers_sim.md): every timed cell then reloads over the box's host link;
2. **the load** (`kvevict.load`): the offered load ρ of the requests on that box, after
   ``--rate-scale`` or the scale ``--target-load`` finds; ρ ≥ 1 is reported as unstable, and
   then no decision is made on latencies;
3. **the cells** (`kvevict.study`): every policy at the box's capacity and at the sweep's
   sizes, on each seed, run in ``--jobs`` processes or as Ray tasks (``--ray``), plus the
   exact untimed replay of LRU, Belady and an infinite cache at the decided size (the
   headroom);
4. **the answer** (`kvevict.report`): the table and the per-class p95 TTFT with their
   intervals, and the decision against LRU by the paired per-seed interval.
"""

from __future__ import annotations

import argparse
import json
import os
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

#: what the main job compares: every built-in online policy (the baseline first, then the
#: workload-aware and learned ones, then the classic baselines) and the offline bound
DEFAULT_POLICIES = ("lru", "lfu", "pinned", "market", "bayes", "dbms", "learned", "s3fifo",
                    "arc", "slru", "2q", "gdsf", "belady")
DEFAULT_SWEEP = (2.0, 4.0)
DEFAULT_WORKLOAD = "chat-steady"
DEFAULT_GPU = "l4-24gb"
DEFAULT_MAX_SEQS = 32
DEFAULT_SEEDS = 5


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_parser(sub: Any) -> None:
    """The ``simulate`` subcommand's options."""
    from kvevict.box import GPU_PROFILES
    from kvevict.policies.market.admission import ADMISSIONS, DEFAULT_MAX_WAIT

    sim = sub.add_parser("simulate", help="compare eviction policies on a workload or trace")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help=f"built-in workload generator (default: {DEFAULT_WORKLOAD})")
    src.add_argument("--trace", type=Path, help="a trace file instead of a generator")
    sim.add_argument("--format", choices=FORMATS, default="jsonl", help="trace file format")
    generator_args(sim)
    sim.add_argument("--seeds", type=int, default=None,
                     help=f"generator seeds, from --seed on (default {DEFAULT_SEEDS}; a trace "
                          "file is one sample: 1)")
    sim.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                     help="comma-separated policy names (default: %(default)s)")
    policy_module_arg(sim)
    sim.add_argument("--admission", choices=ADMISSIONS, default="always",
                     help="admission control: always (a request evicts whatever the policy "
                          "picks, as vLLM and SGLang do) or market (in the market policy's "
                          "cells, a batch or single-shot request waits, at most "
                          f"{DEFAULT_MAX_WAIT:g} s, while the blocks it would evict are priced "
                          "above what it is worth; chat, agent and rag never wait) "
                          "(default %(default)s)")
    model = sim.add_mutually_exclusive_group()
    model.add_argument("--model", default="llama-3-8b",
                       help=f"model preset: {', '.join(PRESETS)} (default %(default)s)")
    model.add_argument("--model-config", type=Path,
                       help="a Hugging Face config.json to size the KV cache from")
    box = sim.add_argument_group("the box (docs/box.md)")
    box.add_argument("--gpu", default=DEFAULT_GPU,
                     help=f"accelerator profile: {', '.join(GPU_PROFILES)}, or the JSON "
                          "`kvevict calibrate` wrote (this machine) (default %(default)s)")
    box.add_argument("--gpus", type=int, default=1,
                     help="GPUs in the tensor-parallel group (default 1)")
    box.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="share of GPU memory the engine may use, as vLLM's flag "
                          "(default %(default)s)")
    cap = sim.add_mutually_exclusive_group()
    cap.add_argument("--cache-gib", type=float, default=None,
                     help="KV cache size in GiB (default: what the box leaves for KV)")
    cap.add_argument("--cache-blocks", type=int, default=None,
                     help="KV cache size in blocks (default: what the box leaves for KV)")
    tiers = sim.add_argument_group("memory tiers below the GPU's KV (docs/tiers_sim.md)")
    host = tiers.add_mutually_exclusive_group()
    host.add_argument("--host-gib", type=float, default=None,
                      help="a host-memory KV tier of X GiB, reloaded over the box's GPU host "
                           "link (default: none)")
    host.add_argument("--host-x", type=float, default=None,
                      help="a host-memory KV tier of X times the GPU KV capacity")
    disk = tiers.add_mutually_exclusive_group()
    disk.add_argument("--disk-gib", type=float, default=None,
                      help="a disk KV tier of Y GiB below the host tier (PCIe 5.0 NVMe, "
                           "kvevict.tiers' nvme profile; needs --host-gib or --host-x)")
    disk.add_argument("--disk-x", type=float, default=None,
                      help="a disk KV tier of Y times the GPU KV capacity")
    tiers.add_argument("--prefetch", action="store_true",
                       help="start loading a waiting request's lower-tier prefix while it is "
                            "queued (CachedAttention)")
    tiers.add_argument("--tier-policy", default=None,
                       help="the tiers' residency policy (default: each cell's own policy; "
                            "LRU for an offline one)")
    sim.add_argument("--open-loop", action="store_true",
                     help="send every request at its trace arrival, even before the answer "
                          "it follows exists (default: a session's next request waits for "
                          "its answer, then its think time or tool pause)")
    sim.add_argument("--allow-oversubscribe", action="store_true",
                     help="allow a cache larger than the box holds (a what-if study; "
                          "recorded in results.json)")
    load = sim.add_mutually_exclusive_group()
    load.add_argument("--rate-scale", type=float, default=None,
                      help="multiply the request rate by X (divide inter-arrival times)")
    load.add_argument("--target-load", type=float, default=None,
                      help="scale the request rate so the offered load ρ is this (e.g. 0.7)")
    sim.add_argument("--block-size", type=int, default=None,
                     help="tokens per block (default 16; a Mooncake trace's own, 512 unless "
                          "the file says otherwise, and no other)")
    sim.add_argument("--sweep", type=float_list, default=list(DEFAULT_SWEEP),
                     help="capacity multipliers for the hit-ratio sweep "
                          "(default: 2,4; sizes that cannot hold the largest request "
                          "are skipped)")
    sim.add_argument("--no-sweep", action="store_true", help="skip the capacity sweep")
    scheduler_args(sim, max_batched_tokens=2048, max_seqs=DEFAULT_MAX_SEQS)
    run = sim.add_argument_group("running the cells")
    run.add_argument("--jobs", type=int, default=None,
                     help=f"worker processes (default: every core, here {_cpus()})")
    run.add_argument("--ray", action="store_true",
                     help="run the cells as Ray tasks (pip install 'kvevict[ray]')")
    run.add_argument("--ray-address", default=None,
                     help="a running Ray cluster (default with --ray: a local one)")
    sim.add_argument("--records", action="store_true",
                     help="put every request's record of the decided size in results.json")
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


def _widest(requests: Any, block_size: int) -> tuple[int, Any, int]:
    """``(requests, the first of the largest, its blocks_needed)`` in one pass over
    ``requests`` (a list or a trace file's stream); ``(0, None, 0)`` when there are none."""
    count, largest, need = 0, None, 0
    for r in requests:
        count += 1
        blocks = blocks_needed(r, block_size)
        if blocks > need:
            largest, need = r, blocks
    return count, largest, need


def _layout(args: argparse.Namespace) -> KVLayout:
    if args.model_config is not None:
        try:
            config = json.loads(args.model_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {args.model_config}: {exc}") from None
        return from_hf_config(config)
    return preset(args.model)


def _source(args: argparse.Namespace) -> tuple[Any, str, int | None]:
    """The `kvevict.study.Source`, the workload's label, and the block size the trace fixes
    (a Mooncake trace's hash ids are blocks of its own size; None: nothing fixes one)."""
    from kvevict import workloads
    from kvevict.study import Source

    if args.trace is not None:
        if not args.trace.exists():
            raise ConfigError(f"trace file {args.trace} does not exist")
        if not args.trace.is_file():
            raise ConfigError(f"--trace {args.trace} is not a file")
        if args.scale != 1 or args.duration is not None:
            raise ConfigError("--scale and --duration shape a generated workload; they do not "
                              "apply to --trace")
        label = f"{args.trace.name} ({args.format})"
        block_size = None
        if args.format == "mooncake":
            block_size = workloads.check_block_size(args.trace, args.block_size,
                                                    flag="--block-size")
        return (Source(trace=str(args.trace), format=args.format, block_size=block_size),
                label, block_size)
    name = args.workload or DEFAULT_WORKLOAD
    if name not in workloads.available_workloads():
        raise ConfigError(f"unknown workload {name!r} for --workload; valid workloads: "
                          f"{', '.join(workloads.available_workloads())}")
    label = name if args.scale == 1 else f"{name} (scale {args.scale:g})"
    return Source(workload=name, scale=args.scale, duration=args.duration), label, None


def _check(args: argparse.Namespace) -> None:
    """The checks that span flags or read the file system (single values are checked by
    `kvevict.cli.common.check_flags` before the command runs)."""
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} exists and is not a directory")
    if args.seeds is not None and args.seeds > 1 and args.trace is not None:
        raise ConfigError(f"--seeds {args.seeds}: a trace file is one sample (seeds shape a "
                          "generated workload); drop --seeds or use --workload")
    if not args.no_sweep:
        bad = [m for m in args.sweep if not 0 < m < float("inf")]
        if bad or not args.sweep:
            raise ConfigError(f"--sweep takes positive finite capacity multipliers, got "
                              f"{', '.join(map(str, bad)) or '(none)'}")
    if args.ray_address is not None and not args.ray:
        raise ConfigError("--ray-address names the cluster for --ray; add --ray")
    for flag in ("host_gib", "host_x", "disk_gib", "disk_x"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < float("inf"):
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} takes a positive finite size, got {value}")
    has_host = args.host_gib is not None or args.host_x is not None
    if (args.disk_gib is not None or args.disk_x is not None) and not has_host:
        raise ConfigError("a disk tier sits below the host tier: give --host-gib or --host-x "
                          "with --disk-gib / --disk-x")
    if (args.prefetch or args.tier_policy is not None) and not has_host:
        flag = "--prefetch" if args.prefetch else "--tier-policy"
        raise ConfigError(f"{flag} applies to memory tiers: give --host-gib or --host-x")


def tier_blocks(args: argparse.Namespace, capacity: int, bytes_per_block: int,
                block_size: int, model: str) -> tuple[int, int]:
    """The host and disk tiers' blocks the flags ask for: ``--host-gib`` / ``--disk-gib``
    in GiB of blocks of ``bytes_per_block``, ``--host-x`` / ``--disk-x`` as a multiple of the
    GPU's ``capacity`` (rounded); ``(0, 0)`` without tiers. `ConfigError` for a size that
    holds no block."""
    out = []
    for tier in ("host", "disk"):
        gib, times = getattr(args, f"{tier}_gib"), getattr(args, f"{tier}_x")
        if gib is not None:
            blocks = int(gib * GIB // bytes_per_block)
            if blocks < 1:
                raise ConfigError(f"--{tier}-gib {gib:g} holds no block of {block_size} tokens "
                                  f"of {model} ({bytes_per_block:,} bytes per block)")
        elif times is not None:
            blocks = round(times * capacity)
            if blocks < 1:
                raise ConfigError(f"--{tier}-x {times:g} of {capacity:,} GPU blocks is no block; "
                                  "give a larger multiple")
        else:
            blocks = 0
        out.append(blocks)
    return out[0], out[1]


def _admission(name: str, policies: list[str]) -> str:
    """What ``--admission name`` does to these policies' cells, in words; `ConfigError` when
    ``market`` is asked for and no policy quotes the prices it compares
    (`kvevict.policies.market.admission.admission_for`)."""
    from kvevict.policies.market.admission import DEFAULT_MAX_WAIT, quotes_prices

    if name == "always":
        return "always (every request evicts what the policy picks; vLLM's and SGLang's behaviour)"
    priced = [p for p in policies if quotes_prices(p)]
    if not priced:
        raise ConfigError(f"--admission {name} defers with the market policy's prices, and no "
                          f"policy in --policies quotes them ({', '.join(policies)}); add "
                          "market to --policies, or use --admission always")
    others = [p for p in policies if p not in priced]
    text = (f"{name} in the cells of {', '.join(priced)} (a deferrable class's request waits, "
            f"at most {DEFAULT_MAX_WAIT:g} s, while the blocks it would evict are priced above "
            "what it is worth)")
    if others:
        verbs = ("quotes", "admits") if len(others) == 1 else ("quote", "admit")
        text += f"; {', '.join(others)} {verbs[0]} no prices and {verbs[1]} always"
    return text


def _box(args: argparse.Namespace) -> Any:
    from kvevict.box import Box, GpuProfile, gpu_profile

    name = args.gpu
    path = Path(name)
    if name.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--gpu {name}: no such calibration file")
        gpu = GpuProfile.from_calibration(path)
    else:
        gpu = gpu_profile(name)
    return Box(gpu, gpus=args.gpus, gpu_memory_utilization=args.gpu_memory_utilization)


def simulate_command(args: argparse.Namespace) -> int:
    from kvevict import report
    from kvevict.box import check_capacity, kv_cache_bytes
    from kvevict.cost import CostModel
    from kvevict.load import instability_message, offered_load, scale_for_load
    from kvevict.policies.registry import is_offline
    from kvevict.scheduler import SchedulerConfig
    from kvevict.study import Cell, Study, run_cells, study_requests

    policies = parse_policies(args.policies, args.policy_module)
    if all(is_offline(p) for p in policies):
        bound = "is the offline bound" if len(set(policies)) == 1 else "are offline bounds"
        raise ConfigError("--policies needs at least one online policy to choose from "
                          f"({', '.join(policies)} {bound})")
    _check(args)
    say = (lambda line: None) if args.quiet else (
        lambda line: print(line, file=sys.stderr, flush=True))
    if "lru" not in policies:  # the baseline every decision is measured against
        policies = ["lru", *policies]
        say("note: lru added to --policies: the decision compares every policy with it")
    admission = _admission(args.admission, policies)
    layout = _layout(args)
    source, workload, trace_block_size = _source(args)
    block_size = trace_block_size or args.block_size or 16
    box = _box(args)
    config = SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                             max_num_seqs=args.max_seqs, preemption=args.preemption)
    try:
        cost = box.cost_model(layout)
        cost_note = None
    except ConfigError as exc:  # a --model-config of unknown parameter count
        cost = CostModel()
        cost_note = f"{exc}; timing with the default cost model (Llama-3-8B on one H100)"
        print(f"note: {cost_note}", file=sys.stderr)
    try:
        kv = kv_cache_bytes(box, layout, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_num_seqs=config.max_num_seqs)
    except ConfigError as exc:
        if args.cache_blocks is None and args.cache_gib is None:
            raise
        kv = None  # the model's size is unknown: the given cache stands on its own
        print(f"note: {exc}; the box's KV capacity is unknown", file=sys.stderr)
    box_blocks = kv.blocks(block_size) if kv is not None else None
    if args.cache_blocks is not None:
        capacity, label = args.cache_blocks, None
    elif args.cache_gib is not None:
        gib = args.cache_gib
        if not gib > 0 or gib == float("inf"):
            raise ConfigError(f"--cache-gib must be a positive finite number, got {gib}")
        capacity, label = layout.blocks_for_bytes(gib * GIB, block_size), f"--cache-gib {gib:g}"
        if capacity < 1:
            raise ConfigError(f"{gib} GiB holds no block of {block_size} tokens of "
                              f"{layout.name or 'this model'} "
                              f"({layout.bytes_per_block(block_size):,} bytes per block)")
    else:
        capacity, label = box_blocks, None
    oversubscribed = False
    if kv is not None and (args.cache_blocks is not None or args.cache_gib is not None):
        oversubscribed = check_capacity(capacity, kv, block_size,
                                        allow_oversubscribe=args.allow_oversubscribe,
                                        label=label)
    n_seeds = args.seeds or (1 if args.trace is not None else DEFAULT_SEEDS)
    seeds = list(range(args.seed, args.seed + n_seeds))

    # the load: one rate scale for every seed, found on the first seed's requests (a trace
    # file's are a stream, read afresh by each pass: nothing here holds the whole trace)
    first = source.requests(seeds[0])
    if isinstance(first, list) and not first:
        raise ConfigError(f"{workload} holds no requests")
    rate_scale = 1.0
    if args.target_load is not None:
        rate_scale = scale_for_load(first, cost, block_size, args.target_load,
                                    max_batch=config.max_num_seqs)
    elif args.rate_scale is not None:
        rate_scale = args.rate_scale
    if rate_scale != 1.0:
        import attrs

        source = attrs.evolve(source, rate_scale=rate_scale)
    tiers, tiers_desc = _tiers(args, capacity, layout, block_size, cost)
    if tiers is not None:
        import attrs

        bpb = layout.bytes_per_block(block_size)
        box = attrs.evolve(box, host_memory_bytes=tiers.host_blocks * bpb,
                           disk_bytes=tiers.disk_blocks * bpb or None)
    study = Study(source, layout, block_size, cost, config, tuple(args.policy_module),
                  admission=args.admission, tiers=tiers, closed_loop=not args.open_loop)
    load = offered_load(study_requests(study, seeds[0]), cost, block_size,
                        max_batch=config.max_num_seqs)
    load_info = {**load.to_dict(), "rho": load.rho, "stable": load.stable,
                 "rate_scale": rate_scale}
    if args.target_load is not None:
        load_info["target_load"] = args.target_load

    min_blocks = 0
    for s in seeds:
        count, largest, need = _widest(study_requests(study, s), block_size)
        if not count:
            raise ConfigError(f"{workload} (seed {s}) holds no requests")
        if need > min_blocks:
            min_blocks, widest = need, largest
    if capacity < min_blocks:
        raise ConfigError(
            f"the cache ({capacity:,} blocks of {block_size} tokens) cannot hold request "
            f"{widest.request_id!r}, which needs {min_blocks:,} blocks; use at least "
            f"--cache-blocks {min_blocks}"
        )
    sweep_caps = [] if args.no_sweep else sorted(
        {max(1, round(capacity * m)) for m in args.sweep} - {capacity})
    too_small = [c for c in sweep_caps if c < min_blocks]
    if too_small:
        say(f"note: sweep sizes {', '.join(map(str, too_small))} blocks skipped: they cannot "
            f"hold the largest request ({min_blocks} blocks)")
    sweep_caps = [c for c in sweep_caps if c >= min_blocks]

    tokens_cap = capacity * block_size
    capacity_desc = (f"{capacity:,} blocks of {block_size} tokens = {tokens_cap:,} tokens = "
                     f"{capacity * layout.bytes_per_block(block_size) / GIB:.2f} GiB")
    if oversubscribed:
        capacity_desc += f" (oversubscribed: the box holds {box_blocks:,} blocks)"
    print(f"workload {workload}: {load.requests:,} requests (seed {seeds[0]}), "
          f"{n_seeds} seed{'s' if n_seeds != 1 else ''}; model {layout.name}")
    print(f"box: {kv.text(block_size) if kv is not None else box.describe()}")
    print(f"cache: {capacity_desc}")
    print(f"load: {load.text()}" + (f" at rate scale {rate_scale:.3g}" if rate_scale != 1 else ""))
    unstable_message = instability_message(load)
    if unstable_message:
        print(f"warning: {unstable_message}; no decision is made on latencies")
    print(f"admission: {admission}")
    print("sessions: " + ("open loop (every request at its trace arrival)" if args.open_loop
                          else "closed loop (a session's next request waits for the answer "
                               "it follows, then its pause)"))
    if tiers_desc:
        print(f"tiers: {tiers_desc}")

    # at the decided size: every request's TTFT for the CDF (every seed, with its band), and
    # the full records only with --records (a dict per request: memory in proportion to it)
    cells = [Cell(p, c, s, records=args.records and c == capacity, ttfts=c == capacity)
             for c in [capacity, *sweep_caps] for s in seeds for p in policies]
    cells += [Cell(p, c, s, mode="replay") for s in seeds
              for p, c in [(p, c) for c in [capacity, *sweep_caps] for p in ("lru", "belady")]
              + [("lru", None)]]
    jobs = args.jobs or _cpus()
    progress = Progress(len(cells), args.quiet)
    results = run_cells(study, cells, jobs=jobs, ray=args.ray, ray_address=args.ray_address,
                        progress=lambda c: progress.update(
                            f"{c.policy} @ {c.capacity_blocks or 'inf'} s{c.seed}"
                            + (" replay" if c.mode == "replay" else "")))
    timed = [r for r, c in zip(results, cells, strict=True) if c.mode == "timed"]
    replays = [r for r, c in zip(results, cells, strict=True) if c.mode == "replay"]
    records = {(r["policy"], r["seed"]): r.pop("records") for r in timed if "records" in r}
    ttfts = {(r["policy"], r["seed"]): r.pop("ttfts") for r in timed if "ttfts" in r}
    main_cells = [r for r in timed if r["capacity_blocks"] == capacity]
    headroom = _headroom(replays, capacity)

    # the offered load is a lower bound (it prices only an infinite cache's misses); the
    # measured one prices each policy's own misses: either >= 1 makes the run unstable. The
    # worst seed counts: one seed whose queue grows has no steady-state latencies to pair
    measured = max(c["measured_load"] for c in main_cells if not is_offline(c["policy"]))
    load_info["measured_load"] = round(measured, 6)
    if load.stable and measured >= 1:
        load_info["stable"] = False
        print(f"warning: measured load {measured:.2f} >= 1 at {capacity:,} blocks (the offered "
              f"{load.rho:.2f} prices only an infinite cache's misses): this cache's misses "
              "overload the box, the queue grows without bound and the latencies are not "
              "steady state; no decision is made on latencies")
    print(report.format_table(main_cells, load=load_info))
    print()
    print(report.format_class_table(main_cells, load=load_info))
    choice = report.choose_policy(main_cells, load=load_info)
    print(f"\nchosen: {choice.policy} ({choice.reason})")
    if len(seeds) > 1:
        print(report.explain_choice(choice))
        if choice.metric != "token_hit_ratio":
            print(report.explain_choice(report.choose_policy(
                main_cells, load={"stable": True}, metric="token_hit_ratio")))
    if args.out is not None:
        out: Path = args.out
        out.mkdir(parents=True, exist_ok=True)
        payload: dict[str, Any] = {
            "workload": workload, "seeds": seeds, "model": layout.name,
            "bytes_per_token": layout.bytes_per_token, "block_size": block_size,
            "box": {"description": box.describe(), "gpu": box.gpu.name, "gpus": box.gpus,
                    "gpu_memory_utilization": box.gpu_memory_utilization,
                    "kv_capacity": kv.to_dict(block_size) if kv is not None else None},
            "capacity_blocks": capacity, "oversubscribed": oversubscribed,
            "tiers": None if tiers is None else {
                "host_blocks": tiers.host_blocks, "disk_blocks": tiers.disk_blocks,
                "host_memory_bytes": box.host_memory_bytes, "disk_bytes": box.disk_bytes,
                "prefetch": tiers.prefetch, "policy": tiers.policy, "demote": tiers.demote,
                "description": tiers_desc},
            "load": load_info, "cost_model": cost.to_dict(), "admission": args.admission,
            "closed_loop": not args.open_loop,
            "scheduler": {"max_num_batched_tokens": config.max_num_batched_tokens,
                          "max_num_seqs": config.max_num_seqs,
                          "preemption": config.preemption},
            "cells": sorted(timed, key=lambda s: (s["capacity_blocks"], s["policy"],
                                                  s["seed"])),
            "replay": replays, "headroom": {k: v.as_dict() for k, v in headroom.items()},
            "chosen": choice.policy, "decision": {
                "policy": choice.policy, "reason": choice.reason,
                "significant": choice.significant, "metric": choice.metric,
                "latency_decision": choice.latency_decision},
            "command": recorded_command(args),
        }
        if cost_note:
            payload["cost_note"] = cost_note
        if args.records:
            payload["records"] = [{"policy": p, "seed": s, "records": recs}
                                  for (p, s), recs in sorted(records.items())]
        if args.policy_module:
            payload["policy_modules"] = policy_module_files(args)
        (out / "results.json").write_text(
            json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        layout_desc = (f"{layout.attention.upper()}, {layout.num_layers} layers, "
                       f"{layout.bytes_per_token:,} KV bytes per token ({layout.dtype})")
        (out / "DECISION.md").write_text(report.decision_record(
            timed, workload=workload, model=layout.name or "custom",
            layout_desc=layout_desc, capacity_desc=capacity_desc,
            command=payload["command"], box=box.describe(), load=load_info,
            headroom=headroom, capacity_blocks=capacity))
        written = ["results.json", "DECISION.md"]
        try:
            if sweep_caps:
                report.plot_hit_ratio(timed, out / "hit_ratio.png",
                                      f"{workload}: hit ratio vs cache size")
                written.append("hit_ratio.png")
            report.plot_ttft_cdf(
                {p: {s: values for (q, s), values in ttfts.items() if q == p}
                 for p in dict.fromkeys(p for p, _ in ttfts)},
                out / "ttft_cdf.png", f"{workload}: TTFT at {capacity:,} blocks")
            written.append("ttft_cdf.png")
            lru_replays, exact = _headroom_plot(replays)
            report.plot_hit_ratio(lru_replays, out / "headroom.png",
                                  f"{workload}: exact untimed replay (kvevict.replay)",
                                  exact=exact)
            written.append("headroom.png")
            report.plot_class_p95(main_cells, out / "class_p95.png",
                                  f"{workload}: p95 TTFT by class at {capacity:,} blocks")
            written.append("class_p95.png")
        except ImportError as exc:
            print(f"note: {exc}", file=sys.stderr)
        print(f"wrote {', '.join(written)} to {out}")
    return 0


def _tiers(args: argparse.Namespace, capacity: int, layout: KVLayout, block_size: int,
           cost: Any) -> tuple[Any, str | None]:
    """The `kvevict.sim.TierConfig` the tier flags ask for and a line describing it, or
    ``(None, None)`` without tiers."""
    from kvevict.policies.registry import POLICIES, check_spec, is_offline, spec_name
    from kvevict.sim import TierConfig, host_link_profile
    from kvevict.tiers import TIER_PROFILES

    bpb = layout.bytes_per_block(block_size)
    host, disk = tier_blocks(args, capacity, bpb, block_size, layout.name or "this model")
    if not host:
        return None, None
    if args.tier_policy is not None:
        if spec_name(args.tier_policy) not in POLICIES:
            raise ConfigError(f"unknown policy {args.tier_policy!r} for --tier-policy; valid "
                              f"policies: {', '.join(POLICIES.names())}")
        check_spec(args.tier_policy)  # a parameter it does not take
        if is_offline(args.tier_policy):
            raise ConfigError(f"--tier-policy {args.tier_policy} is offline (it needs the "
                              "future); a tier runs an online policy")
    tiers = TierConfig(host, disk, policy=args.tier_policy, prefetch=args.prefetch)
    link = host_link_profile(cost)
    desc = (f"host {host:,} blocks ({host * bpb / GIB:.2f} GiB, {host / capacity:.3g}x the "
            f"GPU's) over the box's host link ({link.read_bytes_per_s / 1e9:g} GB/s, "
            f"{link.latency_s * 1e6:g} us per copy)")
    if disk:
        nvme = TIER_PROFILES["nvme"]
        desc += (f"; disk {disk:,} blocks ({disk * bpb / GIB:.2f} GiB) over NVMe "
                 f"({nvme.read_bytes_per_s / 1e9:g} GB/s read)")
    policy = args.tier_policy or "each cell's own (lru for an offline one)"
    desc += (f"; tier policy: {policy}; prefetch {'on' if args.prefetch else 'off'}; "
             "metadata only, reloads queued on the links")
    return tiers, desc


def _replay_interval(replays: list[dict[str, Any]], policy: str, capacity: int | None) -> Any:
    """``policy``'s token hit ratio in the exact untimed replay at ``capacity`` (None: the
    infinite cache), mean ± 95% CI over the seeds."""
    from kvevict.stats import interval

    return interval([r["token_hit_ratio"] for r in replays
                     if r["policy"] == policy and r["capacity_blocks"] == capacity])


def _headroom_plot(replays: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """The headroom plot's inputs, all from the exact untimed replay: LRU's cells by size (each
    with its seed's infinite cache as ``infinite_cache_hit_ratio``), and Belady's token hit
    ratio by size as intervals over the seeds (the plot's exact ceiling)."""
    infinite = {r["seed"]: r["token_hit_ratio"] for r in replays
                if r["capacity_blocks"] is None}
    lru = [{**r, "infinite_cache_hit_ratio": infinite[r["seed"]]} for r in replays
           if r["policy"] == "lru" and r["capacity_blocks"] is not None]
    sizes = sorted({r["capacity_blocks"] for r in replays if r["policy"] == "belady"})
    return lru, {c: _replay_interval(replays, "belady", c) for c in sizes}


def _headroom(replays: list[dict[str, Any]], capacity: int) -> dict[str, Any]:
    """The exact untimed replay's token hit ratios at the decided size: LRU, the exact Belady
    oracle, and the infinite cache."""
    return {"lru": _replay_interval(replays, "lru", capacity),
            "belady_exact": _replay_interval(replays, "belady", capacity),
            "infinite": _replay_interval(replays, "lru", None)}
