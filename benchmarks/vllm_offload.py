"""The bundled Mooncake trace through vLLM's real ``CPUOffloadingManager`` (no engine, no GPU).

Prints, as Markdown, the chunk hit ratio of vLLM's own offload policies (``vllm:lru``,
``vllm:arc``) and of kvevict's policies through `KVEvictCachePolicy`, beside what kvevict's
own replay (`kvevict.replay.replay`, prefix tree, leaves only) gives on the same stream; then
the bookkeeping speed of kvevict's ``lru`` through the adapter as a ratio to vLLM's built-in
``lru``, measured in the same process on the same stream (best of ``--repeat`` interleaved
runs each; the keys are built before the clock starts).

Run it in the vLLM venv (docs/vllm.md)::

    python benchmarks/vllm_offload.py --sizes 1000,5000,20000
"""

from __future__ import annotations

import argparse
import sys

from kvevict.adapters.vllm.replay import offload_requests, replay_offload
from kvevict.replay import replay
from kvevict.workloads import bundled_trace_path, read_mooncake

THROUGH_VLLM = ("vllm:lru", "lru", "vllm:arc", "market", "bayes")
KVEVICT_OWN = ("lru", "market", "bayes")


def hit_table(requests, sizes) -> str:
    cut = offload_requests(requests, 512)
    head = "| policy | replayed by | " + " | ".join(f"{s:,} chunks" for s in sizes) + " |"
    lines = [head, "|---|---|" + "---:|" * len(sizes)]
    for policy in THROUGH_VLLM:
        cells = [replay_offload(requests, policy, s).block_hit_ratio for s in sizes]
        where = "vLLM built-in" if policy.startswith("vllm:") else "kvevict via adapter"
        lines.append(f"| {policy} | {where}, vLLM manager | "
                     + " | ".join(f"{c:.4f}" for c in cells) + " |")
    for policy in KVEVICT_OWN:
        cells = [replay(cut, policy, s, block_size=512).block_hit_ratio for s in sizes]
        lines.append(f"| {policy} | kvevict.replay (tree) | "
                     + " | ".join(f"{c:.4f}" for c in cells) + " |")
    return "\n".join(lines)


def speed_table(requests, sizes, repeat: int) -> str:
    cut = offload_requests(requests, 512)
    lines = ["| chunks | vLLM lru req/s | kvevict lru via adapter req/s | ratio | "
             "market / kvevict lru | bayes / kvevict lru |", "|---:|---:|---:|---:|---:|---:|"]
    policies = ("vllm:lru", "lru", "market", "bayes")
    for size in sizes:
        best = dict.fromkeys(policies, float("inf"))
        for _ in range(repeat):  # interleaved, so that a busy spell hits every policy
            for policy in policies:
                best[policy] = min(best[policy], replay_offload(cut, policy, size).seconds)
        rate = {policy: len(cut) / best[policy] for policy in policies}
        lines.append(f"| {size:,} | {rate['vllm:lru']:,.0f} | {rate['lru']:,.0f} | "
                     f"{rate['lru'] / rate['vllm:lru']:.2f}x | "
                     f"{rate['market'] / rate['lru']:.2f}x | {rate['bayes'] / rate['lru']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,5000,20000")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-hits", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    requests = read_mooncake(bundled_trace_path("mooncake"))
    if not args.no_hits:
        print("Chunk hit ratio, bundled Mooncake trace, 512-token chunks:\n")
        print(hit_table(requests, sizes))
    if not args.no_speed:
        print("\nBookkeeping speed, requests/s through CPUOffloadingManager "
              f"(best of {args.repeat}):\n")
        print(speed_table(requests, sizes, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
