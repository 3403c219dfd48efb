"""Per-eviction cost of the market, bayes, dbms and classic policies versus LRU, at 10k and 1M
candidates.

Each policy drives a `KVCacheManager` over a metadata-only `BlockPool` (no layout, no tensor)
that holds ``N`` eviction candidates: ``N`` finished one-block requests (hash mode, so every
block is a cached, unused leaf), with a mix of sessions, workload classes and block kinds,
arriving over `SPAN_S` clock seconds whatever ``N`` (so every ``N`` sees the same idle times,
turn counts and classes; only the density differs), and every `SHARED_EVERY`-th block hit once
more by another session (shared: the market prices it as a union over its sharers, bayes puts
it in its ``shared`` pairs). Then ``manager.evict(1)`` is timed in a loop, the clock advancing
1 ms every `BURST` evictions (a run of evictions at one instant, as when one request needs
several blocks, then a new instant, where the market reprices its queue heads).

Each of ``rounds`` rounds first refills the pool with ``evictions`` fresh candidates (untimed),
then times ``evictions`` evictions, so the candidate count stays within ``[N, N + evictions]``;
the cost is the best round's CPU seconds (``time.process_time``) divided by ``evictions``.
Victim selection must not be linear in ``N``: the growth from 10k to 1M candidates (100x) must
stay far below 100 (Python's own dict and heap operations get slower with size, as their
memory stops fitting the CPU caches, so even LRU's O(log n) heap grows a few times).

As a script (the table: us per eviction, ratio to LRU at each N, growth from the smallest to
the largest N, and the fill time)::

    python benchmarks/bench_policies.py [--sizes 10000,1000000] [--policies lru,market,s3fifo]

As pytest-benchmark tests (group ``eviction-cost``; one round = ``evictions`` evictions)::

    pytest benchmarks/bench_policies.py --benchmark-only --benchmark-group-by=group,param:n

``KVEVICT_BENCH_EVICT_SIZES`` sets the candidate counts of the pytest benchmarks (default
``10000,1000000``; filling 1M candidates takes 15 to 60 s per policy).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import pytest

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict import BlockPool, KVCacheManager, ManualClock, Request

GROUP = "eviction-cost"
#: The classic baselines (`kvevict.policies.classic`), timed like the others.
CLASSIC = ("s3fifo", "arc", "slru", "2q", "gdsf")
#: Policies timed by default; ``lru`` is the baseline of the ratios.
POLICIES = ("lru", "market", "bayes", "dbms", *CLASSIC, "learned")
BASELINE = "lru"
CLASSES = ("chat", "agent", "rag", "single_shot", "batch")
KINDS = ("prompt", "context", "output")
#: Clock seconds over which the N fill requests arrive (below bayes' 300 s horizon and the
#: market's 300 s abandonment of programmatic classes: every candidate is still "live").
SPAN_S = 240.0
#: Requests (turns) per session: N // TURNS_PER_SESSION sessions, a turn every SPAN_S / 8 s.
TURNS_PER_SESSION = 8
#: Every this many blocks, one is hit once more by another session (two sharers).
SHARED_EVERY = 10
#: Evictions per clock instant; the clock advances EVICT_STEP_S between instants.
BURST = 8
EVICT_STEP_S = 1e-3
EVICTIONS = 2_000  # per round
ROUNDS = 5
BENCH_SIZES = tuple(int(s) for s in os.environ.get(
    "KVEVICT_BENCH_EVICT_SIZES", "10000,1000000").split(",") if s.strip())
#: The script's timer: CPU seconds of this process (other work on a shared machine inflates
#: it much less than wall time; the loop is single-threaded and does no I/O).
cpu_time = time.process_time

# -- the candidates ----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def make_requests(n: int, extra: int) -> tuple[tuple[Request, Request | None], ...]:
    """``n + extra`` (fill request, shared hit or None) pairs for ``n`` candidates.

    Fill request ``i`` caches block ``i + 1`` alone: session ``i % S`` (``S = n //
    TURNS_PER_SESSION``), so a session's turns are ``SPAN_S / TURNS_PER_SESSION`` s apart; its
    class follows the session, its kind the block. Every `SHARED_EVERY`-th block is then hit by
    the next session (its own class): two sharers. Built once per ``(n, extra)`` and shared by
    every policy (a million `Request` objects take several seconds to build).
    """
    sessions = max(1, n // TURNS_PER_SESSION)
    out = []
    for i in range(n + extra):
        s = i % sessions
        req = Request(("c", i), block_hashes=(i + 1,), num_tokens=16, session_id=s,
                      workload_class=CLASSES[s % len(CLASSES)],
                      block_kinds=(KINDS[i % len(KINDS)],))
        hit = None
        if i % SHARED_EVERY == 0 and sessions > 1:
            other = (s + 1) % sessions
            hit = Request(("h", i), block_hashes=(i + 1,), num_tokens=16, session_id=other,
                          workload_class=CLASSES[other % len(CLASSES)])
        out.append((req, hit))
    return tuple(out)


class EvictionBench:
    """A manager full of ``n`` one-block candidates of one policy, and its clock.

    `fill` begins and finishes the next requests (one per ``SPAN_S / n`` clock seconds);
    `evict` evicts, the clock advancing `EVICT_STEP_S` every `BURST` evictions.
    """

    def __init__(self, policy: str, n: int, evictions: int = EVICTIONS,
                 rounds: int = ROUNDS) -> None:
        self.n = n
        self.requests = make_requests(n, evictions * rounds)
        num_blocks = len(self.requests) + 64  # never short of a free block while filling
        self.clock = ManualClock()
        self.manager = KVCacheManager(BlockPool(num_blocks, 16, storage=False), policy,
                                      clock=self.clock)
        self.dt = SPAN_S / n
        self.next = 0  # index of the next fill request

    def fill(self, count: int) -> float:
        """Add ``count`` candidates (begin + finish, plus the shared hit); CPU seconds."""
        manager, clock = self.manager, self.clock
        begin, finish = manager.begin, manager.finish
        now, dt = clock.now, self.dt
        start = cpu_time()
        for req, hit in self.requests[self.next:self.next + count]:
            now += dt
            clock.now = now
            begin(req)
            finish(req.request_id)
            if hit is not None:
                begin(hit)
                finish(hit.request_id)
        seconds = cpu_time() - start
        self.next += count
        return seconds

    def evict(self, count: int) -> None:
        """Evict ``count`` candidates, one ``manager.evict(1)`` call each."""
        clock, evict = self.clock, self.manager.evict
        now = clock.now
        for j in range(count):
            if j % BURST == 0:
                now += EVICT_STEP_S
                clock.now = now
            evict(1)


def time_policy(policy: str, n: int, evictions: int = EVICTIONS, rounds: int = ROUNDS
                ) -> tuple[float, float]:
    """(seconds per eviction, best of ``rounds``; fill CPU seconds for the first ``n``)."""
    bench = EvictionBench(policy, n, evictions, rounds)
    gc.collect()
    fill_s = bench.fill(n)
    assert bench.manager.num_candidates == n
    best = float("inf")
    for _ in range(rounds):
        bench.fill(evictions)
        gc.collect()
        start = cpu_time()
        bench.evict(evictions)
        best = min(best, cpu_time() - start)
        assert bench.manager.num_candidates == n  # every call evicted one block
    return best / evictions, fill_s


def time_policies(policies: Sequence[str], sizes: Sequence[int], evictions: int = EVICTIONS,
                  rounds: int = ROUNDS, verbose: bool = False
                  ) -> dict[tuple[str, int], tuple[float, float]]:
    """``(policy, n) -> (seconds per eviction, fill seconds)``; one manager alive at a time."""
    out = {}
    for n in sizes:
        for policy in policies:
            gc.collect()  # the previous manager is gone before the next one is filled
            out[policy, n] = time_policy(policy, n, evictions, rounds)
            if verbose:
                per, fill = out[policy, n]
                print(f"  {policy:<8} N={n:>9,}: {per * 1e6:8.2f} us/eviction "
                      f"(fill {fill:.1f} s)", flush=True)
    return out


# -- pytest ------------------------------------------------------------------------------------


def test_eviction_cost_is_sublinear() -> None:
    """25x the candidates costs each eviction far less than 25x (O(log n), not O(n))."""
    small, large = 2_000, 50_000
    policies = ("lru", "market", "bayes", "dbms", *CLASSIC, "learned")
    result = time_policies(policies, (small, large), evictions=1_000, rounds=3)
    for policy in policies:
        a, b = result[policy, small][0], result[policy, large][0]
        growth = b / a
        print(f"\n{policy}: {a * 1e6:.2f} us -> {b * 1e6:.2f} us per eviction for "
              f"{large // small}x the candidates ({growth:.2f}x)")
        assert growth < 5, f"{policy}: victim selection looks linear in the candidates"


def test_fill_gives_nontrivial_prices() -> None:
    """The fill spreads candidates over several market queues and bayes pairs."""
    market = EvictionBench("market", 2_000, 100, 1)
    market.fill(2_000)
    market.manager.check()
    assert market.manager.policy.num_queues >= 10  # classes x turn buckets, and shared ones
    prices = {round(q.price, 30) for q in market.manager.policy.cheapest(200, market.clock.now)}
    assert len(prices) > 20
    bayes = EvictionBench("bayes", 2_000, 100, 1)
    bayes.fill(2_000)
    bayes.manager.check()
    pairs = {bayes.manager.policy.pair_of(block_id)
             for block_id in bayes.manager.tree.candidates}
    assert len(pairs) >= 4


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("n", BENCH_SIZES)  # n outermost: the requests are built once per N
def test_eviction_cost(benchmark, policy: str, n: int) -> None:
    bench = EvictionBench(policy, n, EVICTIONS, ROUNDS)
    fill_s = bench.fill(n)

    def setup():  # fresh candidates every round, untimed
        bench.fill(EVICTIONS)
        gc.collect()
        return (EVICTIONS,), {}

    benchmark.extra_info.update(candidates=n, evictions_per_round=EVICTIONS,
                                fill_seconds=round(fill_s, 2))
    benchmark.pedantic(bench.evict, setup=setup, rounds=ROUNDS, iterations=1)
    assert bench.manager.num_candidates == n


# -- script ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,1000000",
                        help="comma-separated candidate counts N (default 10000,1000000)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated policies (default {','.join(POLICIES)}; "
                             f"{BASELINE} is always timed, as the baseline)")
    parser.add_argument("--evictions", type=int, default=EVICTIONS, help="per round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="best of this many rounds")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if BASELINE not in policies:
        policies.insert(0, BASELINE)

    start = time.perf_counter()
    print(f"per-eviction cost: N one-block candidates ({len(CLASSES)} classes, N/"
          f"{TURNS_PER_SESSION} sessions, 1 in {SHARED_EVERY} shared), best of {args.rounds} "
          f"rounds of {args.evictions} manager.evict(1) calls (process CPU time)")
    results: dict[tuple[str, int], tuple[float, float]] = {}
    for n in sizes:
        t = time.perf_counter()
        make_requests(n, args.evictions * args.rounds)
        print(f"built the requests for N={n:,} in {time.perf_counter() - t:.1f} s", flush=True)
        results.update(time_policies(policies, [n], args.evictions, args.rounds, verbose=True))
    make_requests.cache_clear()

    small, large = sizes[0], sizes[-1]
    print(f"\n{'policy':<9}" + "".join(f"{f'us N={n:,}':>16}{'vs lru':>8}" for n in sizes)
          + (f"{'growth':>9}" if len(sizes) > 1 else "")
          + "".join(f"{f'fill s N={n:,}':>20}" for n in sizes))
    for policy in policies:
        row = f"{policy:<9}"
        for n in sizes:
            per = results[policy, n][0]
            row += f"{per * 1e6:>16.2f}{per / results[BASELINE, n][0]:>7.2f}x"
        if len(sizes) > 1:
            row += f"{results[policy, large][0] / results[policy, small][0]:>8.2f}x"
        row += "".join(f"{results[policy, n][1]:>20.2f}" for n in sizes)
        print(row)
    if len(sizes) > 1:
        factor = large / small
        print(f"growth = us per eviction at N={large:,} / at N={small:,}: {factor:.0f} if "
              "linear in N; a few x for an O(log n) index (larger dicts and heaps miss the "
              "CPU caches)")
        worst = max(results[p, large][0] / results[p, small][0] for p in policies)
        verdict = "OK (sublinear)" if worst < factor / 10 else "LOOKS LINEAR"
        print(f"worst growth {worst:.2f}x for {factor:.0f}x the candidates: {verdict}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
