"""How much an eviction order could save in a timed run: Belady on the times requests
really began, against LRU (issue 13's agent cells).

The timed simulator's `Belady` ranks blocks by the *planned* times of the requests that use
them (their trace arrivals). Behind a queue, or in a closed-loop session whose next turn
waits for its answer, a request begins later than planned, so those keys are an
approximation. Here the oracle is given the times at which each request began in the
previous run instead (first LRU's; the first chunk's start, ``arrival + queue_wait``), and
run again, ``--rounds`` times: each round is a real run of the simulator, so the eviction
order of the last one is one that exists, and its recomputed prefill tokens are what that
order achieves. The table pairs it with LRU by seed (`kvevict.stats.paired`).

The box, rate and sizes are `benchmarks/workload_aware.py`'s (one L4, Llama-3-8B, 32 seats,
offered ρ 0.7 on seed 0, sessions closed loop). Run from the repository root::

    python benchmarks/realized_oracle.py --workload agent --fractions 0.25,0.5 --seeds 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import attrs
import numpy as np

from kvevict import workloads
from kvevict.box import Box, gpu_profile
from kvevict.layout import preset
from kvevict.load import scale_for_load
from kvevict.policies.belady import Belady
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.stats import paired
from kvevict.study import Source, Study, study_requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload_aware import BLOCK_SIZE, running_blocks, working_set


def began(result) -> dict:
    """Request id -> when its first prefill chunk started (arrival + queue wait)."""
    return {r.request_id: r.arrival + r.queue_wait for r in result.records}


def realized_belady(requests: list, times: dict) -> Belady:
    """Belady whose planned time for each request is ``times[request_id]``: the requests
    re-timed to it, on the oracle's own arrival axis (`Belady.from_requests`, which makes
    the times strictly increasing)."""
    retimed = sorted((attrs.evolve(r, arrival=times[r.request_id]) for r in requests),
                     key=lambda r: r.arrival)
    return Belady.from_requests(retimed, block_size=BLOCK_SIZE, time="arrival")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="agent")
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.25, 0.5])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-load", type=float, default=0.7)
    args = parser.parse_args(argv)
    layout = preset("llama-3-8b")
    box = Box(gpu_profile("l4-24gb"))
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)
    cost = box.cost_model(layout)
    seeds = list(range(args.seeds))
    first = workloads.generate(args.workload, seed=seeds[0])
    scale = scale_for_load(first, cost, BLOCK_SIZE, args.target_load, max_batch=32)
    study = Study(Source(workload=args.workload, rate_scale=scale), layout, BLOCK_SIZE,
                  cost, config)
    traces = {s: list(study_requests(study, s)) for s in seeds}
    wset = float(np.mean([working_set(traces[s], BLOCK_SIZE) + running_blocks(traces[s], cost)
                          for s in seeds]))

    def run(requests, policy, capacity):
        return simulate(requests, policy, capacity_blocks=capacity, layout=layout,
                        block_size=BLOCK_SIZE, cost=cost, config=config, records=True)

    print(f"{args.workload}: working set {wset:,.0f} blocks, rate x{scale:.3g}")
    print("| size | seed | LRU | Belady, planned times | "
          + " | ".join(f"realized, round {k + 1}" for k in range(args.rounds)) + " |")
    print("|---|---:|---:|---:|" + "---:|" * args.rounds)
    for fraction in args.fractions:
        capacity = round(fraction * wset)
        lru, last, planned = {}, {}, {}
        for s in seeds:
            base = run(traces[s], "lru", capacity)
            lru[s] = base.summary()["recomputed_prefill_tokens"]
            planned[s] = run(traces[s], "belady", capacity).summary()[
                "recomputed_prefill_tokens"]
            times, rounds = began(base), []
            for _ in range(args.rounds):
                result = run(traces[s], realized_belady(traces[s], times), capacity)
                rounds.append(result.summary()["recomputed_prefill_tokens"])
                times = began(result)
            last[s] = rounds[-1]
            print(f"| {fraction:g}x = {capacity:,} | {s} | {lru[s]:,} | {planned[s]:,} | "
                  + " | ".join(f"{v:,}" for v in rounds) + " |", flush=True)
        print(f"{fraction:g}x: Belady (planned) - LRU {paired(planned, lru)}; "
              f"Belady (realized, round {args.rounds}) - LRU {paired(last, lru)}; "
              f"LRU mean {np.mean(list(lru.values())):,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
