"""The plain block-level replay: hit ratios of residency policies on a trace, no timing.

Semantics (one `KVCacheManager` over a metadata-only `BlockPool` of ``capacity_blocks``):

- requests run **one at a time**, in list order: ``begin`` then ``finish``, nothing else
  (no decode appends, no concurrency, no queueing, no cost model);
- a prompt's hit is its longest cached prefix: counting **stops at the first missing
  block**, as in vLLM's and SGLang's prefix caching;
- the prompt's missing blocks are allocated, evicting candidates through the policy; only
  **leaves** are evicted and the running request's own blocks are protected;
- on ``finish`` the blocks are released tail first and become candidates;
- the clock is set to the request's time before each request: its index (``time="index"``,
  the default) or its arrival, made strictly increasing (``time="arrival"``); see
  `kvevict.policies.belady.request_times`;
- an offline policy (``"belady"``) gets its future from the same requests on the same time
  axis (`kvevict.policies.registry.build_policy`), so it is the exact furthest-next-use oracle
  of this replay;
- a request larger than the whole pool cannot run: its blocks count as misses, the cache is
  left as it was, and it is counted in ``rejected``.

Run ``python -m kvevict.replay --trace mooncake --sizes 1000,2000,5000,10000,20000`` for the
Markdown table of every registered policy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import kvevict.policies  # noqa: F401  (registers the built-in policies)
from kvevict.errors import ConfigError, OutOfBlocks
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy, available_policies
from kvevict.policies.belady import request_times
from kvevict.policies.registry import (
    POLICIES,
    PolicySpec,
    build_policy,
    check_distinct,
    is_offline,
    online_first,
)
from kvevict.pool import BlockPool
from kvevict.types import ManualClock, Request

__all__ = ["ReplayResult", "ReplayTable", "format_table", "main", "replay", "replay_table"]


@dataclass(frozen=True)
class ReplayResult:
    """What one replay of one policy at one pool size measured."""

    policy: str  #: policy label (registry name, or the label given)
    capacity_blocks: int
    block_size: int
    requests: int  #: requests replayed (rejected ones included)
    accesses: int  #: cacheable prompt blocks looked up
    hits: int  #: of those, found cached
    token_queries: int  #: prompt tokens looked up
    token_hits: int  #: of those, found cached
    evictions: int
    rejected: int = 0  #: requests larger than the pool (counted as all misses)
    seconds: float = 0.0  #: wall time of the replay

    @property
    def block_hit_ratio(self) -> float:
        """``hits / accesses`` (0 when there were none)."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def token_hit_ratio(self) -> float:
        """``token_hits / token_queries`` (0 when there were none)."""
        return self.token_hits / self.token_queries if self.token_queries else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["block_hit_ratio"] = self.block_hit_ratio
        out["token_hit_ratio"] = self.token_hit_ratio
        return out


def _check_requests(requests: Iterable[Request]) -> list[Request]:
    if isinstance(requests, (str, bytes)):
        raise ConfigError("requests must be a sequence of Request objects, not a string "
                          "(read a trace first, e.g. with kvevict.workloads.read_mooncake)")
    reqs = list(requests)
    for req in reqs:
        if not isinstance(req, Request):
            raise ConfigError(f"replay takes Requests, got {type(req).__name__}")
    return reqs


def _build_policy(policy: PolicySpec, reqs: list[Request], times: list[float],
                  capacity_blocks: int, block_size: int, extra_key: Any,
                  params: Mapping[str, Any]) -> Policy:
    """`build_policy`; an offline policy's future holds only the requests that fit the pool
    (one larger than the pool never runs, so it is no one's next use)."""
    future: list[Request] | None = None
    future_times: list[float] = []
    if isinstance(policy, str) and is_offline(policy):
        fits = [(r, t) for r, t in zip(reqs, times, strict=True)
                if -(-r.prompt_len // block_size) <= capacity_blocks]
        future = [r for r, _ in fits]
        future_times = [t for _, t in fits]
    return build_policy(policy, params, requests=future, block_size=block_size,
                        time_axis=future_times, extra_key=extra_key)


def _label(policy: PolicySpec) -> str:
    if isinstance(policy, str):
        return policy
    if isinstance(policy, Policy):
        return policy.name or type(policy).__name__
    return getattr(policy, "name", "") or getattr(policy, "__name__", "custom")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _replay(reqs: list[Request], times: list[float], policy: PolicySpec, capacity_blocks: int,
            block_size: int, extra_key: Any, check_every: int, label: str | None,
            params: Mapping[str, Any]) -> ReplayResult:
    start = _time.perf_counter()
    built = _build_policy(policy, reqs, times, capacity_blocks, block_size, extra_key,
                          params)
    clock = ManualClock(times[0] if times else 0.0)
    manager = KVCacheManager(BlockPool(capacity_blocks, block_size), built, clock=clock,
                             extra_key=extra_key)
    rejected = rejected_blocks = rejected_tokens = 0
    for i, (req, t) in enumerate(zip(reqs, times, strict=True)):
        clock.set(t)
        try:
            seq = manager.begin(req)
        except OutOfBlocks:
            rejected += 1
            rejected_tokens += req.prompt_len
            if req.block_hashes is not None:
                rejected_blocks += len(req.block_hashes)
            else:
                rejected_blocks += req.prompt_len // block_size
            continue
        manager.finish(seq.seq_id)
        if check_every and (i + 1) % check_every == 0:
            manager.check()
    if check_every:
        manager.check()
    stats = manager.stats
    return ReplayResult(
        policy=label if label is not None else _label(policy),
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        requests=len(reqs),
        accesses=stats.block_queries + rejected_blocks,
        hits=stats.block_hits,
        token_queries=stats.prefix_cache_queries + rejected_tokens,
        token_hits=stats.prefix_cache_hits,
        evictions=stats.evictions,
        rejected=rejected,
        seconds=_time.perf_counter() - start,
    )


def replay(requests: Iterable[Request], policy: PolicySpec, capacity_blocks: int,
           block_size: int = 512, *, time: str = "index", extra_key: Any = None,
           check_every: int = 0, label: str | None = None,
           **policy_params: Any) -> ReplayResult:
    """Replay ``requests`` through one policy at one pool size (semantics: module docstring).

    Args:
        requests: the trace, in order (token-mode or ``block_hashes`` requests).
        policy: a registered name (an offline one, ``"belady"``, gets its future from
            ``requests``), a fresh `Policy` instance, or a zero-argument factory returning one
            (see `kvevict.policies.registry.build_policy`).
        capacity_blocks: blocks in the pool.
        block_size: tokens per block (512 for the Mooncake traces).
        time: the clock axis: ``"index"`` (request ``i`` at time ``i``) or ``"arrival"``
            (arrival seconds, strictly increasing). Time-aware parameters (half-lives,
            windows) are in these units.
        extra_key: mixed into token-mode block hashes (see `KVCacheManager`).
        check_every: run `KVCacheManager.check` every this many requests (0: never; slow).
        label: the name to report (default: the policy's registry name).
        policy_params: parameters of a policy given by name.
    """
    _positive_int("capacity_blocks", capacity_blocks)
    _positive_int("block_size", block_size)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ConfigError(f"check_every must be a non-negative int, got {check_every!r}")
    reqs = _check_requests(requests)
    times = request_times(reqs, time)
    return _replay(reqs, times, policy, capacity_blocks, block_size, extra_key, check_every,
                   label, policy_params)


@dataclass
class ReplayTable:
    """Results of every policy at every pool size, in the order they were given."""

    policies: list[str]
    capacities: list[int]
    results: list[ReplayResult] = field(default_factory=list)

    def get(self, policy: str, capacity_blocks: int) -> ReplayResult:
        """The result of one policy at one size."""
        for r in self.results:
            if r.policy == policy and r.capacity_blocks == capacity_blocks:
                return r
        raise KeyError((policy, capacity_blocks))

    def ratios(self, metric: str = "block_hit_ratio") -> dict[str, list[float]]:
        """policy -> the metric at each capacity, in ``capacities`` order."""
        return {p: [getattr(self.get(p, c), metric) for c in self.capacities]
                for p in self.policies}

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (policy, size), as `ReplayResult.as_dict`."""
        return [r.as_dict() for r in self.results]


def replay_table(requests: Iterable[Request],
                 policies: Sequence[str] | Mapping[str, PolicySpec] | None = None,
                 capacities: Iterable[int] = (1000, 2000, 5000, 10000, 20000),
                 block_size: int = 512, *, time: str = "index",
                 extra_key: Any = None) -> ReplayTable:
    """Replay every policy at every capacity.

    Args:
        requests: the trace.
        policies: registered names, or a mapping label -> name or zero-argument factory (a
            fresh policy is needed per replay, so instances are not accepted). Default: every
            registered policy, the offline ones (``"belady"``) last.
        capacities: pool sizes in blocks.
        block_size: as for `replay`.
        time: as for `replay`.
        extra_key: as for `replay`.
    """
    reqs = _check_requests(requests)
    if policies is None:  # the online policies, then the oracle
        policies = online_first(available_policies())
    if isinstance(policies, str):
        raise ConfigError("policies must be a list of names or a mapping, not one string")
    if isinstance(policies, Mapping):
        specs = dict(policies)
    else:
        policies = list(policies)
        check_distinct(policies, "policies")
        specs = {p: p for p in policies}
    for lbl, spec in specs.items():
        if isinstance(spec, Policy):
            raise ConfigError(f"policy {lbl!r}: give a name or a factory, not an instance "
                              "(each replay needs a fresh policy)")
        if isinstance(spec, str):
            POLICIES.get(spec)  # an unknown name fails before any replay runs
    sizes = [_positive_int("capacity", c) for c in capacities]
    _positive_int("block_size", block_size)
    times = request_times(reqs, time)
    table = ReplayTable(list(specs), sizes)
    for lbl, spec in specs.items():
        for size in sizes:
            table.results.append(_replay(reqs, times, spec, size, block_size, extra_key, 0,
                                         lbl, {}))
    return table


def format_table(table: ReplayTable, metric: str = "block_hit_ratio", digits: int = 4) -> str:
    """A Markdown table: one row per policy, one column per pool size."""
    if metric not in ("block_hit_ratio", "token_hit_ratio", "evictions", "hits"):
        raise ConfigError(f"metric must be block_hit_ratio, token_hit_ratio, evictions or "
                          f"hits, got {metric!r}")
    header = "| policy | " + " | ".join(f"{c:,} blocks" for c in table.capacities) + " |"
    rule = "|---|" + "---:|" * len(table.capacities)
    lines = [header, rule]
    for p in table.policies:
        cells = []
        for c in table.capacities:
            value = getattr(table.get(p, c), metric)
            cells.append(f"{value:.{digits}f}" if isinstance(value, float) else f"{value:,}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------


def _load_trace(trace: str, block_size: int | None = None) -> tuple[list[Request], int]:
    """The requests of ``--trace`` and its block size; a ``--block-size`` other than the
    trace's is a `ConfigError` naming both."""
    from kvevict.workloads.mooncake import (
        BUNDLED_TRACES,
        bundled_trace_path,
        check_block_size,
        read_mooncake,
    )

    if trace in BUNDLED_TRACES:
        path = str(bundled_trace_path(trace))
    elif os.path.isfile(trace):
        path = trace
    else:
        raise ConfigError(f"--trace must be a bundled trace ({', '.join(BUNDLED_TRACES)}) or "
                          f"a Mooncake .jsonl file; {trace!r} is neither")
    size = check_block_size(path, block_size, flag="--block-size")
    return read_mooncake(path, block_size=size), size


def _command_policies(text: str | None, modules: Sequence[str]) -> list[str] | None:
    """``--policies`` (None: every registered one), once the ``kvevict.policies`` entry points
    and the ``--policy-module`` modules are loaded; a name given twice is an error."""
    from kvevict.policies.registry import load_entry_point_policies, load_policy_modules

    load_entry_point_policies()
    load_policy_modules(modules, flag="--policy-module", cwd=True)
    if text is None:
        return None
    policies = [p.strip() for p in text.split(",") if p.strip()]
    check_distinct(policies, "--policies")
    return policies


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvevict.replay``: print the Markdown table of a replay."""
    parser = argparse.ArgumentParser(
        prog="python -m kvevict.replay",
        description="Block-level replay of a trace through residency policies "
                    "(one request at a time, no timing); prints a Markdown table.",
    )
    parser.add_argument("--trace", default="mooncake",
                        help="bundled trace name (mooncake) or a Mooncake .jsonl file")
    parser.add_argument("--sizes", default="1000,2000,5000,10000,20000",
                        help="comma-separated pool sizes in blocks")
    parser.add_argument("--policies", default=None,
                        help="comma-separated policy names (default: every registered one)")
    parser.add_argument("--policy-module", action="append", default=[], metavar="MODULE",
                        help="import MODULE (e.g. mypkg.mypolicies; found on sys.path or in "
                             "the current directory) before --policies is checked, so the "
                             "policies it registers can be named; repeatable")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block: the trace's (512 unless the file says "
                             "otherwise, the default) and no other")
    parser.add_argument("--time", choices=("index", "arrival"), default="index",
                        help="clock axis: request index or arrival seconds")
    parser.add_argument("--metric", default="block_hit_ratio",
                        choices=("block_hit_ratio", "token_hit_ratio", "evictions", "hits"))
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        policies = _command_policies(args.policies, args.policy_module)
        reqs, block_size = _load_trace(args.trace, args.block_size)
        table = replay_table(reqs, policies, sizes, block_size, time=args.time)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(table, args.metric))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

