"""What the ``kvevict`` subcommands share: policy lists and ``--policy-module``, the
recorded command that reruns a run, flag checks that name the flag, shared option groups and
the progress output."""

from __future__ import annotations

import argparse
import os
import shlex
import site
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from kvevict.errors import ConfigError

__all__ = ["FORMATS", "GIB", "Progress", "check_flags", "csv_list", "float_list",
           "generator_args", "import_policy_modules", "int_list", "parse_policies",
           "policy_module_arg", "policy_module_files", "recorded_command", "sayer",
           "scheduler_args"]

FORMATS = ("jsonl", "mooncake", "alibaba", "sharegpt")
GIB = 2**30


def csv_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_policies(text: str, modules: list[str] | None = None) -> list[str]:
    """The ``--policies`` list, once the ``kvevict.policies`` entry points and the
    ``--policy-module`` modules are loaded; unknown names (or none) name the valid ones, a
    parameter the policy does not take names the ones it does, and a name given twice is an
    error naming it."""
    from kvevict.policies import available_policies
    from kvevict.policies.registry import (
        check_distinct,
        check_spec,
        load_entry_point_policies,
        split_specs,
    )

    load_entry_point_policies()
    import_policy_modules(modules or [])
    policies = split_specs(text)  # commas inside a name's parameters do not split it
    valid = available_policies()
    unknown = [p for p in policies if "(" not in p and p not in valid]
    if unknown or not policies:
        raise ConfigError(f"unknown policy {', '.join(unknown) or '(none given)'}; valid "
                          f"names: {', '.join(valid)}")
    for p in policies:
        if "(" in p:
            check_spec(p)
    check_distinct(policies, "--policies")
    return policies


def import_policy_modules(modules: list[str]) -> list[Any]:
    """Import the ``--policy-module`` modules (found on ``sys.path`` or in the current
    directory, as ``python -m`` finds them), so that the policies they register can be named;
    a module that cannot be imported is a `ConfigError` naming the flag and the module."""
    from kvevict.policies.registry import load_policy_modules

    return load_policy_modules(modules, flag="--policy-module", cwd=True)


def module_root(module: Any) -> Path | None:
    """The ``sys.path`` entry ``module`` was imported from (None when unknown)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    depth = module.__name__.count(".") + (1 if path.name == "__init__.py" else 0)
    return path.parents[depth]


def installed_roots() -> set[Path]:
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
    installed = installed_roots()
    roots: list[str] = []
    for name in getattr(args, "policy_module", None) or []:
        root = module_root(sys.modules.get(name))
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
    "seeds": (1, "workload seeds"),
    "jobs": (1, "worker processes"),
    "gpus": (1, "GPUs in the tensor-parallel group"),
}
#: Float flags that must be positive and finite: destination -> what the value is.
_POSITIVE_FLAGS = {"duration": "seconds of generated trace", "scale": "a rate multiplier",
                   "rate_scale": "a request-rate multiplier",
                   "target_load": "the offered load to aim at"}
#: Integer-list flags: destination -> least value of each entry.
_INT_LIST_FLAGS = {"prefill_lengths": 1, "cached_lengths": 0, "decode_batches": 1,
                   "decode_contexts": 0}


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flags(args: argparse.Namespace) -> None:
    """`ConfigError` naming the flag for a value the command cannot use (the checks that
    would otherwise fail deeper down under an internal field name)."""
    for dest, (least, what) in _INT_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and value < least:
            kind = {0: "a non-negative int", 1: "a positive int"}.get(least, f"an int >= {least}")
            raise ConfigError(f"{flag_name(dest)} ({what}) must be {kind}, got {value}")
    for dest, what in _POSITIVE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"{flag_name(dest)} ({what}) must be a positive finite number, got "
                              f"{value}")
    for dest, least in _INT_LIST_FLAGS.items():
        values = getattr(args, dest, None)
        for v in values or []:
            if v < least:
                raise ConfigError(f"{flag_name(dest)} must hold ints >= {least}, got {v}")
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
            points = len(set(a)) * len(set(b))
            raise ConfigError(f"{flag_name(new)} x {flag_name(cached)} give {points} {what} "
                              "point(s); give at least 3")


def policy_module_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                        help="import MODULE (e.g. mypkg.mypolicies; found on sys.path or in "
                             "the current directory) before --policies is checked, so the "
                             "policies it registers with kvevict.policies.register_policy "
                             "can be named; repeatable")


def float_list(text: str) -> list[float]:
    try:
        return [float(p) for p in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None


def generator_args(parser: argparse.ArgumentParser) -> None:
    """The options that shape a generated workload (simulate and engine-bench)."""
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--duration", type=float, default=None,
                        help="generated trace length in seconds (generator default)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the workload's request rate, e.g. its number of people "
                             "(default 1)")



def scheduler_args(parser: argparse.ArgumentParser, max_batched_tokens: int,
                   max_seqs: int = 64) -> None:
    """The scheduler's options, shared by simulate and engine-bench."""
    parser.add_argument("--max-batched-tokens", type=int, default=max_batched_tokens,
                        help="scheduler token budget per step (default %(default)s)")
    parser.add_argument("--max-seqs", type=int, default=max_seqs,
                        help="most running requests (default %(default)s)")
    parser.add_argument("--preemption", default="last-arrived",
                        choices=("last-arrived", "fewest-processed"),
                        help="which running request to preempt (default %(default)s)")


def int_list(text: str) -> list[int]:
    try:
        return [int(p) for p in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None



def sayer(args: argparse.Namespace) -> Any:
    start = time.monotonic()

    def say(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    return say



class Progress:
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

