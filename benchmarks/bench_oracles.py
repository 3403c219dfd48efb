"""Per-eviction cost of the reuse and horizon oracles versus LRU, at 10k and 1M candidates.

Each policy drives a `KVCacheManager` over a metadata-only `BlockPool` that holds ``N``
eviction candidates: ``N`` finished one-block requests (block ``i + 1`` alone, at clock time
``i · SPAN_S / N``). The oracles get a future in which a quarter of the blocks are never used
again and the others are used once more, ``U(0, 4 H)`` seconds after they were cached (seeded),
so the horizon oracle (``H = HORIZON_S``) holds both classes and moves far blocks to the near
class as the clock advances. Then ``manager.evict(1)`` is timed in a loop, the clock advancing
`EVICT_STEP_S` every `BURST` evictions. Each of ``rounds`` rounds first adds ``evictions``
fresh candidates (untimed); the cost is the best round's CPU seconds per eviction.

Victim choice must not be linear in ``N``: from 10k to 1M candidates (100x) the cost per
eviction must grow far less than 100x (an O(log n) heap and Python dicts grow a few times as
their memory stops fitting the CPU caches).

As a script::

    python benchmarks/bench_oracles.py [--sizes 10000,1000000]

As a pytest check (2k and 50k candidates, growth below 5x)::

    pytest benchmarks/bench_oracles.py
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict import BlockPool, KVCacheManager, ManualClock, Request
from kvevict.policies.lru import LRU
from kvevict.policies.oracles import HorizonOracle, ReuseOracle

POLICIES = ("lru", "reuse-oracle", "horizon-oracle")
BASELINE = "lru"
#: Clock seconds over which the N fill requests arrive, and the horizon oracle's H.
SPAN_S = 240.0
HORIZON_S = 60.0
#: Fraction of blocks never used again.
DEAD = 0.25
BURST = 8
EVICT_STEP_S = 1e-3
EVICTIONS = 2_000
ROUNDS = 5
cpu_time = time.process_time


def _future(total: int, dt: float, seed: int = 0) -> dict[int, list[float]]:
    """Block ``i + 1``: cached at ``i · dt``; never again (a `DEAD` fraction) or once more,
    ``U(0, 4 H)`` s later."""
    rng = np.random.default_rng(seed)
    dead = rng.random(total) < DEAD
    later = rng.uniform(0.0, 4 * HORIZON_S, total)
    return {i + 1: [i * dt] if dead[i] else [i * dt, i * dt + float(later[i])]
            for i in range(total)}


def make_policy(name: str, total: int, dt: float):
    if name == "lru":
        return LRU()
    if name == "reuse-oracle":
        return ReuseOracle(_future(total, dt))
    if name == "horizon-oracle":
        return HorizonOracle(_future(total, dt), horizon=HORIZON_S)
    raise SystemExit(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")


def time_policy(name: str, n: int, evictions: int = EVICTIONS,
                rounds: int = ROUNDS) -> float:
    """Seconds per eviction (best of ``rounds``) with ``n`` candidates."""
    total = n + evictions * rounds
    dt = SPAN_S / n
    policy = make_policy(name, total, dt)
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(total + 64, 16, storage=False), policy, clock=clock)
    state = {"next": 0}

    def fill(count: int) -> None:
        for i in range(state["next"], state["next"] + count):
            clock.set(max(clock.now, i * dt))
            req = Request(i, block_hashes=(i + 1,), num_tokens=16)
            manager.begin(req)
            manager.finish(i)
        state["next"] += count

    fill(n)
    best = float("inf")
    for _ in range(rounds):
        fill(evictions)
        gc.collect()
        now = clock.now
        start = cpu_time()
        for j in range(evictions):
            if j % BURST == 0:
                now += EVICT_STEP_S
                clock.now = now
            manager.evict(1)
        best = min(best, cpu_time() - start)
        assert manager.num_candidates == n
    return best / evictions


def time_policies(policies: Sequence[str], sizes: Sequence[int], evictions: int = EVICTIONS,
                  rounds: int = ROUNDS, verbose: bool = False) -> dict[tuple[str, int], float]:
    out = {}
    for n in sizes:
        for name in policies:
            gc.collect()
            out[name, n] = time_policy(name, n, evictions, rounds)
            if verbose:
                print(f"  {name:<15} N={n:>9,}: {out[name, n] * 1e6:8.2f} us/eviction",
                      flush=True)
    return out


def test_oracle_eviction_cost_is_sublinear() -> None:
    """25x the candidates costs each eviction far less than 25x (O(log n), not O(n))."""
    small, large = 2_000, 50_000
    result = time_policies(POLICIES, (small, large), evictions=1_000, rounds=3)
    for name in POLICIES:
        growth = result[name, large] / result[name, small]
        print(f"\n{name}: {result[name, small] * 1e6:.2f} us -> "
              f"{result[name, large] * 1e6:.2f} us per eviction for {large // small}x the "
              f"candidates ({growth:.2f}x)")
        assert growth < 5, f"{name}: victim selection looks linear in the candidates"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,1000000",
                        help="comma-separated candidate counts N (default 10000,1000000)")
    parser.add_argument("--evictions", type=int, default=EVICTIONS, help="per round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="best of this many rounds")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    start = time.perf_counter()
    results = time_policies(POLICIES, sizes, args.evictions, args.rounds, verbose=True)
    small, large = sizes[0], sizes[-1]
    print(f"\n{'policy':<15}" + "".join(f"{f'us N={n:,}':>16}{'vs lru':>8}" for n in sizes)
          + (f"{'growth':>9}" if len(sizes) > 1 else ""))
    for name in POLICIES:
        row = f"{name:<15}"
        for n in sizes:
            per = results[name, n]
            row += f"{per * 1e6:>16.2f}{per / results[BASELINE, n]:>7.2f}x"
        if len(sizes) > 1:
            row += f"{results[name, large] / results[name, small]:>8.2f}x"
        print(row)
    if len(sizes) > 1:
        factor = large / small
        worst = max(results[p, large] / results[p, small] for p in POLICIES)
        verdict = "OK (sublinear)" if worst < factor / 10 else "LOOKS LINEAR"
        print(f"worst growth {worst:.2f}x for {factor:.0f}x the candidates: {verdict}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
