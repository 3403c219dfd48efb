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
import os
import shlex
import site
import sys
import sysconfig
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


def _policies(text: str, modules: list[str] | None = None) -> list[str]:
    """The ``--policies`` list, once the ``kvevict.policies`` entry points and the
    ``--policy-module`` modules are loaded; unknown names (or none) name the valid ones, and
    a name given twice is an error naming it."""
    from kvevict.policies import available_policies
    from kvevict.policies.registry import check_distinct, load_entry_point_policies

    load_entry_point_policies()
    import_policy_modules(modules or [])
    policies = _csv(text)
    valid = available_policies()
    unknown = [p for p in policies if p not in valid]
    if unknown or not policies:
        raise ConfigError(f"unknown policy {', '.join(unknown) or '(none given)'}; valid "
                          f"names: {', '.join(valid)}")
    check_distinct(policies, "--policies")
    return policies


def import_policy_modules(modules: list[str]) -> list[Any]:
    """Import the ``--policy-module`` modules (found on ``sys.path`` or in the current
    directory, as ``python -m`` finds them), so that the policies they register can be named;
    a module that cannot be imported is a `ConfigError` naming the flag and the module."""
    from kvevict.policies.registry import load_policy_modules

    return load_policy_modules(modules, flag="--policy-module", cwd=True)


def _module_root(module: Any) -> Path | None:
    """The ``sys.path`` entry ``module`` was imported from (None when unknown)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    depth = module.__name__.count(".") + (1 if path.name == "__init__.py" else 0)
    return path.parents[depth]


def _installed_roots() -> set[Path]:
    """Where a fresh interpreter finds modules without a PYTHONPATH: site-packages, the
    standard library, and the directory this kvevict is imported from."""
    roots = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()]}
    roots |= {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "purelib",
                                                                   "platlib")}
    roots.add(Path(__file__).resolve().parents[1])
    return roots


def policy_module_files(args: argparse.Namespace) -> dict[str, str]:
    """``--policy-module`` name -> the file it was imported from (for results.json)."""
    out = {}
    for name in getattr(args, "policy_module", None) or []:
        module = sys.modules.get(name)
        out[name] = str(getattr(module, "__file__", None) or "")
    return out


def recorded_command(args: argparse.Namespace) -> str:
    """The command line that reruns this run: ``kvevict`` and its arguments, with a
    ``PYTHONPATH=`` prefix when a ``--policy-module`` was imported from outside the installed
    packages (a directory on ``sys.path`` that a fresh shell would not have)."""
    command = "kvevict " + " ".join(shlex.quote(a) for a in args.argv)
    installed = _installed_roots()
    roots: list[str] = []
    for name in getattr(args, "policy_module", None) or []:
        root = _module_root(sys.modules.get(name))
        if root is not None and root not in installed and str(root) not in roots:
            roots.append(str(root))
    if roots:
        command = f"PYTHONPATH={shlex.quote(os.pathsep.join(roots))} {command}"
    return command


#: Integer flags checked before a command runs, so that a bad value is reported under the
#: flag's name (``--max-batched-tokens``), not the field it fills (``max_num_batched_tokens``):
#: argparse destination -> (least value, what the value is).
_INT_FLAGS: dict[str, tuple[int, str]] = {
    "max_batched_tokens": (1, "the scheduler's token budget per step"),
    "max_seqs": (1, "the most running requests"),
    "seed": (0, "the generator seed"),
    "vocab": (2, "the vocabulary size"),
    "hidden": (1, "the hidden size"),
    "layers": (1, "the number of decoder layers"),
    "heads": (1, "the number of query heads"),
    "kv_heads": (1, "the number of key/value heads"),
    "head_dim": (1, "the head dimension"),
    "intermediate": (1, "the MLP intermediate size"),
    "repeats": (1, "timed calls per point"),
    "block_size": (1, "tokens per block"),
    "cache_blocks": (1, "the KV cache size in blocks"),
}
#: Float flags that must be positive and finite: destination -> what the value is.
_POSITIVE_FLAGS = {"duration": "seconds of generated trace", "scale": "a rate multiplier"}
#: Integer-list flags: destination -> least value of each entry.
_INT_LIST_FLAGS = {"prefill_lengths": 1, "cached_lengths": 0, "decode_batches": 1,
                   "decode_contexts": 0}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flags(args: argparse.Namespace) -> None:
    """`ConfigError` naming the flag for a value the command cannot use (the checks that
    would otherwise fail deeper down under an internal field name)."""
    for dest, (least, what) in _INT_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value < least:
            kind = {0: "a non-negative int", 1: "a positive int"}.get(least, f"an int >= {least}")
            raise ConfigError(f"{_flag(dest)} ({what}) must be {kind}, got {value}")
    for dest, what in _POSITIVE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{_flag(dest)} ({what}) must be a positive finite number, got "
                              f"{value}")
    for dest, least in _INT_LIST_FLAGS.items():
        values = getattr(args, dest, None)
        for v in values or []:
            if v < least:
                raise ConfigError(f"{_flag(dest)} must hold ints >= {least}, got {v}")
    heads, kv_heads = getattr(args, "heads", None), getattr(args, "kv_heads", None)
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ConfigError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads}) "
                          "(grouped-query attention; equal means MHA)")
    head_dim = getattr(args, "head_dim", None)
    if head_dim is not None and head_dim % 2:
        raise ConfigError(f"--head-dim must be even (RoPE rotates pairs), got {head_dim}")
    for new, cached, what in (("prefill_lengths", "cached_lengths", "prefill"),
                              ("decode_batches", "decode_contexts", "decode")):
        a, b = getattr(args, new, None), getattr(args, cached, None)
        if a and b and len(set(a)) * len(set(b)) < 3:
            raise ConfigError(f"{_flag(new)} x {_flag(cached)} give {len(set(a)) * len(set(b))} "
                              f"{what} point(s); give at least 3")


def _policy_module_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                        help="import MODULE (e.g. mypkg.mypolicies; found on sys.path or in "
                             "the current directory) before --policies is checked, so the "
                             "policies it registers with kvevict.policies.register_policy "
                             "can be named; repeatable")


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
    _policy_module_arg(sim)
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
    _policy_module_arg(eb)
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

    policies = _policies(args.policies, args.policy_module)
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
    result["command"] = recorded_command(args)
    if args.policy_module:
        result["policy_modules"] = policy_module_files(args)
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

    policies = _policies(args.policies, args.policy_module)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"simulate": simulate_command, "calibrate": calibrate_command,
                "engine-bench": engine_bench_command}
    try:
        if args.command in commands:
            check_flags(args)
            return commands[args.command](args)
    except (ConfigError, TraceFormatError, KVEvictError, OSError) as exc:
        print(f"kvevict: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
