"""Workload-aware policies against LRU and the classic baselines on the generated workloads
(issue 13): recomputed prefill tokens and p95 TTFT, mean ± 95% CI over seeds, paired by seed.

For each workload (chat-server, agent, rag, mixed):

- **the box**: the main job's (`kvevict simulate` defaults: Llama-3-8B on one L4 24 GB,
  vLLM's KV formula, 32 seats, 2,048 batched tokens), with the request rate scaled so the
  offered load ρ is ``--target-load`` (0.7) on the first seed, as ``kvevict simulate
  --target-load`` does (`kvevict.load.scale_for_load`: arrivals compressed in time);
- **the working set**: what LRU needs to cache, plus what the running batch holds. The first
  is the smallest pool (found by bisection, in blocks of 16 tokens) at which the exact
  replay's LRU (`kvevict.replay`: prompts only, one request at a time) comes within 0.01 of
  the infinite cache's token hit ratio (docs/mainjob.md's "what LRU needs"); the second is the
  fluid model's mean running batch (`OfferedLoad.mean_running_batch`) times the mean blocks
  of a running request (its prompt and half its answer). Averaged over the seeds. The
  footprint (every block ever touched) would make 1x a cache that never evicts, and the replay
  alone leaves no room for the running batch;
- **the cells**: every policy at ``--fractions`` (0.25, 0.5, 1) of that working set on every
  seed (`kvevict.study.run_cells`, ``--jobs`` worker processes). A size above what the box
  holds is an oversubscribed what-if, as ``--allow-oversubscribe`` is in the CLI (marked in
  the table).

The table gives, per workload and size, each policy's recomputed prefill tokens and p95 TTFT
as mean ± CI, and their paired per-seed difference from LRU (a difference whose interval
excludes 0 is marked ``*``). Run from the repository root::

    python benchmarks/workload_aware.py                      # 5 seeds, the table on stdout
    python benchmarks/workload_aware.py --seeds 2 --workloads rag --out /tmp/wa

With ``--out`` and every policy, it also prints the summary table of docs/simulate.md and
writes its chart, ``workload_aware.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict import workloads
from kvevict.box import Box, gpu_profile, kv_cache_bytes
from kvevict.hashing import block_hashes
from kvevict.layout import preset
from kvevict.load import offered_load, scale_for_load
from kvevict.replay import replay
from kvevict.scheduler import SchedulerConfig
from kvevict.stats import interval, paired
from kvevict.study import Cell, Source, Study, run_cells, study_requests

WORKLOADS = ("chat-server", "agent", "rag", "mixed")
POLICIES = ("lru", "lfu", "s3fifo", "arc", "slru", "2q", "gdsf", "market", "bayes", "dbms",
            "learned")
BLOCK_SIZE = 16


def working_set(requests: list, block_size: int, margin: float = 0.01) -> int:
    """The smallest pool (blocks) at which the exact replay's LRU is within ``margin`` of the
    infinite cache's token hit ratio."""
    need = max(-(-r.prompt_len // block_size) for r in requests)
    footprint = len({h for r in requests for h in block_hashes(r.tokens, block_size)}) + 1
    top = replay(requests, "lru", footprint, block_size).token_hit_ratio
    lo, hi = need, footprint
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(requests, "lru", mid, block_size).token_hit_ratio >= top - margin:
            hi = mid
        else:
            lo = mid + 1
    return lo


def running_blocks(requests: list, cost) -> float:
    """Blocks the fluid model's mean running batch holds (prompt and half the answer each)."""
    load = offered_load(requests, cost, BLOCK_SIZE, max_batch=32)
    mean_tokens = float(np.mean([r.prompt_len + r.output_len / 2 for r in requests]))
    return load.mean_running_batch * mean_tokens / BLOCK_SIZE


def run(args: argparse.Namespace) -> dict:
    layout = preset("llama-3-8b")
    box = Box(gpu_profile("l4-24gb"))
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)
    cost = box.cost_model(layout)
    kv = kv_cache_bytes(box, layout, max_num_batched_tokens=2048, max_num_seqs=32)
    box_blocks = kv.blocks(BLOCK_SIZE)
    seeds = list(range(args.seeds))
    out: dict = {"box_blocks": box_blocks, "seeds": seeds, "workloads": {}}
    for name in args.workloads:
        first = workloads.generate(name, seed=seeds[0])
        scale = scale_for_load(first, cost, BLOCK_SIZE, args.target_load, max_batch=32)
        source = Source(workload=name, rate_scale=scale)
        study = Study(source, layout, BLOCK_SIZE, cost, config)
        rho = offered_load(study_requests(study, seeds[0]), cost, BLOCK_SIZE, max_batch=32).rho
        wset = float(np.mean([working_set(study_requests(study, s), BLOCK_SIZE)
                              + running_blocks(study_requests(study, s), cost)
                              for s in seeds]))
        largest = max(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE)
                      for s in seeds for r in study_requests(study, s))
        sizes = sorted({max(largest, round(f * wset)) for f in args.fractions})
        cells = [Cell(p, c, s) for c in sizes for s in seeds for p in args.policies]
        start = time.perf_counter()
        results = run_cells(study, cells, jobs=args.jobs)
        seconds = time.perf_counter() - start
        rows = {}
        for cell, res in zip(cells, results, strict=True):
            rows.setdefault((cell.policy, cell.capacity_blocks), {})[cell.seed] = res
        out["workloads"][name] = {
            "scale": scale, "rho": rho, "working_set_blocks": wset, "sizes": sizes,
            "fractions": list(args.fractions), "seconds": seconds,
            "cells": {f"{p}@{c}": {s: {k: r[k] for k in (
                "recomputed_prefill_tokens", "ttft_p95", "token_hit_ratio", "measured_load",
                "wait_memory_p95", "wait_compute_p95", "prefill_s_p95",
                "recompute_prefill_s_p95", "preemptions")} for s, r in by_seed.items()}
                for (p, c), by_seed in rows.items()},
        }
        print(table(name, out["workloads"][name], args.policies, box_blocks), flush=True)
    return out


def table(name: str, w: dict, policies: list[str], box_blocks: int) -> str:
    lines = [f"### {name}: ρ {w['rho']:.2f} (rate x{w['scale']:.3g}), working set "
             f"{w['working_set_blocks']:,.0f} blocks; box {box_blocks:,} blocks; "
             f"{w['seconds']:.0f} s", ""]
    lines.append("| size | policy | recomputed prefill tokens | vs LRU | p95 TTFT (s) | "
                 "vs LRU | token hit |")
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for frac, size in zip(w["fractions"], w["sizes"], strict=False):
        over = " (over the box)" if size > box_blocks else ""
        base = w["cells"][f"lru@{size}"]
        for p in policies:
            cells = w["cells"][f"{p}@{size}"]
            rec = {s: float(c["recomputed_prefill_tokens"]) for s, c in cells.items()}
            p95 = {s: float(c["ttft_p95"]) for s, c in cells.items()}
            hit = interval([c["token_hit_ratio"] for c in cells.values()])
            if p == "lru":
                d_rec = d_p95 = ""
            else:
                dr = paired(rec, {s: float(c["recomputed_prefill_tokens"])
                                  for s, c in base.items()})
                dp = paired(p95, {s: float(c["ttft_p95"]) for s, c in base.items()})
                d_rec = f"{dr:,.0f}" + (" *" if dr.known and (dr.high < 0 or dr.low > 0)
                                        else "")
                d_p95 = f"{dp:.3f}" + (" *" if dp.known and (dp.high < 0 or dp.low > 0)
                                       else "")
            lines.append(f"| {frac:g}x = {size:,}{over} | {p} | "
                         f"{interval(list(rec.values())):,.0f} | {d_rec} | "
                         f"{interval(list(p95.values())):.3f} | {d_p95} | {hit:.3f} |")
    return "\n".join(lines) + "\n"


CLASSIC = ("s3fifo", "arc", "slru", "2q", "gdsf")
AWARE = ("market", "bayes", "dbms", "learned")


def summary(out: dict, png: Path | None = None) -> str:
    """The cross-workload table of docs/simulate.md (learned, the best classic baseline and
    the best workload-aware policy against LRU, per workload and size) and, with ``png``,
    its bar chart. Needs every policy of CLASSIC and AWARE in the run."""
    rows = []
    for wl, w in out["workloads"].items():
        cells = w["cells"]
        for frac, size in zip(w["fractions"], w["sizes"], strict=False):
            tokens = {p: {s: float(c["recomputed_prefill_tokens"])
                          for s, c in cells[f"{p}@{size}"].items()}
                      for p in ("lru", *CLASSIC, *AWARE)}
            base = tokens["lru"]
            diffs = {p: paired(tokens[p], base) for p in (*CLASSIC, *AWARE)}
            best_c = min(CLASSIC, key=lambda p: diffs[p].mean)
            best_a = min(AWARE, key=lambda p: diffs[p].mean)
            rows.append((wl, frac, size, float(np.mean(list(base.values()))), diffs, best_c,
                         best_a))

    def fmt(iv) -> str:
        return f"{iv:,.0f}" + (" *" if iv.known and (iv.high < 0 or iv.low > 0) else "")

    lines = ["| workload | size | LRU recomputed tokens | learned − LRU | best classic − LRU | "
             "best of market, bayes, dbms, learned − LRU |", "|---|---|---:|---:|---:|---:|"]
    for wl, frac, size, lru_mean, diffs, bc, ba in rows:
        lines.append(f"| {wl} | {frac:g}x = {size:,} | {lru_mean:,.0f} | {fmt(diffs['learned'])} "
                     f"| {bc}: {fmt(diffs[bc])} | {ba}: {fmt(diffs[ba])} |")
    if png is not None:
        _plot(rows, png)
    return "\n".join(lines) + "\n"


def _plot(rows: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.25 * len(names), 3.6))
    for ax, wl in zip(np.atleast_1d(axes), names, strict=True):
        mine = [r for r in rows if r[0] == wl]
        x = np.arange(len(mine))
        for i, (label, color) in enumerate((("learned", "#2a7f62"), ("best classic", "#8c6bb1"),
                                            ("market", "#d7301f"))):
            vals = []
            for _, _, _, lru_mean, diffs, bc, _ in mine:
                iv = diffs[{"learned": "learned", "best classic": bc, "market": "market"}[label]]
                vals.append((iv.mean / lru_mean * 100 if lru_mean else 0.0,
                             iv.half / lru_mean * 100 if lru_mean and iv.known else 0.0))
            ax.bar(x + (i - 1) * 0.27, [v for v, _ in vals], 0.27, yerr=[h for _, h in vals],
                   capsize=3, color=color, label=label)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(x, [f"{r[1]:g}x" for r in mine])
        ax.set_title(wl)
        ax.set_xlabel("cache / working set")
        ax.grid(axis="y", alpha=0.3)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("recomputed prefill tokens\nvs LRU (%), 95% CI")
    first.legend(fontsize=8, loc="lower left")
    fig.suptitle("Generated workloads at offered ρ 0.7, sessions closed loop, on one L4 "
                 "(Llama-3-8B), 5 seeds, paired by "
                 "seed: below 0 recomputes less than LRU", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.25, 0.5, 1.0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--target-load", type=float, default=0.7)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args(argv)
    out = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=1, default=str))
        if set(CLASSIC + AWARE) <= set(args.policies):
            print(summary(out, args.out / "workload_aware.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
