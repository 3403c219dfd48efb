"""Compare policies on a generated workload in a dozen lines (the Python side of
``kvevict simulate``).

Run: python examples/simulate_workload.py
"""

from kvevict.report import choose_policy, format_table
from kvevict.sim import simulate
from kvevict.workloads import generate


def main(duration: float = 600.0, capacity_blocks: int = 400) -> list[dict]:
    requests = generate("chat-server", seed=0, duration=duration)
    summaries = [{**simulate(requests, policy, capacity_blocks=capacity_blocks).summary(),
                  "seed": 0} for policy in ("lru", "market", "belady")]
    print(f"{len(requests)} requests, {capacity_blocks} blocks of 16 tokens")
    print(format_table(summaries))
    print("run:", choose_policy(summaries).policy)  # one seed: LRU, until more seeds show better
    return summaries


if __name__ == "__main__":
    main()
