"""Memory tiers in the simulator (issue 15): a host tier below the GPU's KV, p95 TTFT and
recomputed prefill tokens against GPU only, tiered `market` and `bayes` against tiered LRU,
prefetch on and off; mean ± 95% CI over seeds, paired by seed.

For each workload (chat-server, agent):

- **the box**: issue 8's realistic one, as `benchmarks/workload_aware.py` has it (Llama-3-8B
  on one L4 24 GB, 32 seats, 2,048 batched tokens), the request rate scaled so the offered
  load ρ is ``--target-load`` (0.7) on the first seed;
- **the GPU's KV**, by ``--sizing`` (averaged over the seeds, in blocks of 16 tokens):

  - ``working-set`` (the default): ``--fraction`` (0.25) of the workload's working set as
    `benchmarks/workload_aware.py` measures it, ``fraction x (reuse + running)``: ``reuse`` is
    what LRU needs to cache (`workload_aware.working_set`), ``running`` what the fluid
    model's mean running batch holds (`workload_aware.running_blocks`);
  - ``batch-plus-reuse``: ``seats + fraction x reuse``, where ``seats`` is what the 32
    running seats hold at once when all are taken (`seat_blocks`: 32 x the mean request's
    prompt and half its answer, `workload_aware.running_blocks` with the batch at its cap).
    The running batch's peak fits, and only the reuse working set is scaled down. It can
    exceed what the L4 holds (an oversubscribed what-if, marked);
- **the tiers** (`kvevict.sim.TierConfig`): a host tier of ``--host-x`` (0, 1, 2, 4, 8)
  times the GPU's blocks, metadata only, reloaded over the box's GPU host link (the L4's
  PCIe Gen4 x16, 32 GB/s; `kvevict.sim.host_link_profile`), each reload queued on that one
  link (`kvevict.run.TierTransfers`); the cell's policy in the pool and in the host tier,
  priced by `kvevict.tiers.TierStack.policy_cost_model` (market, bayes); LRU in both is the
  baseline (LMCache's and SGLang HiCache's default); 0 is GPU only;
- **prefetch**: every policy once more at the ``--prefetch-x`` (4) host size with prefetch
  on (CachedAttention: a waiting request's host-tier prefix starts loading at arrival).

Cells run through `kvevict.study.run_cells` (``--jobs`` worker processes); intervals are
`kvevict.stats.interval` (Student t over the seeds) and `kvevict.stats.paired` (per-seed
differences). Run from the repository root::

    python benchmarks/tiers_sim.py --out out/tiers        # 5 seeds; tables on stdout, the PNG
    python benchmarks/tiers_sim.py --sizing batch-plus-reuse --out out/tiers-b

It prints the tables of docs/tiers_sim.md and, with ``--out``, writes ``results.json`` and
the PNG (p95 TTFT against the host tier's size, per policy): ``tiers_sim.png``
(``working-set``) or ``tiers_sim_batch_plus_reuse.png``.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload_aware import running_blocks, working_set

from kvevict import workloads
from kvevict.box import Box, gpu_profile, kv_cache_bytes
from kvevict.errors import ConfigError
from kvevict.layout import preset
from kvevict.load import offered_load, scale_for_load
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import TierConfig, host_link_profile
from kvevict.stats import interval, paired
from kvevict.study import Cell, Source, Study, run_cells, study_requests

WORKLOADS = ("chat-server", "agent")
SIZINGS = ("working-set", "batch-plus-reuse")
SEATS = 32
POLICIES = ("lru", "market", "bayes")
BLOCK_SIZE = 16
#: what each cell keeps of its summary
KEYS = ("ttft_p95", "ttft_p50", "recomputed_prefill_tokens", "token_hit_ratio",
        "measured_load", "preemptions", "wait_memory_p95", "wait_compute_p95", "prefill_s_p95",
        "recompute_prefill_s_p95", "reload_s_p95", "reload_s_mean", "ttft_mean",
        "wait_memory_mean", "wait_compute_mean", "prefill_s_mean", "recompute_prefill_s_mean")
#: what each cell keeps of each workload class's summary
CLASS_KEYS = ("ttft_p50", "ttft_p95", "wait_memory_p95", "wait_compute_p95")


def seat_blocks(requests: list, seats: int = SEATS) -> float:
    """Blocks ``seats`` running requests hold at once: ``seats`` x the mean request's prompt
    and half its answer, in blocks of `BLOCK_SIZE` (`workload_aware.running_blocks` with the
    running batch at ``seats`` instead of the fluid model's mean)."""
    mean_tokens = float(np.mean([r.prompt_len + r.output_len / 2 for r in requests]))
    return seats * mean_tokens / BLOCK_SIZE


def gpu_blocks(sizing: str, fraction: float, reuse: float, running: float,
               seats: float) -> float:
    """The GPU's KV in blocks under ``sizing``, from one seed's reuse working set, mean
    running batch and full seats (blocks): ``fraction x (reuse + running)`` or
    ``seats + fraction x reuse``."""
    if sizing == "working-set":
        return fraction * (reuse + running)
    if sizing == "batch-plus-reuse":
        return seats + fraction * reuse
    raise ConfigError(f"sizing must be one of {', '.join(SIZINGS)}, got {sizing!r}")


def png_name(sizing: str) -> str:
    """The figure's file name of a sizing."""
    return "tiers_sim.png" if sizing == "working-set" else \
        f"tiers_sim_{sizing.replace('-', '_')}.png"


def sizing_label(w: dict) -> str:
    """How one workload's GPU KV was sized, in words (for titles)."""
    if w.get("sizing", "working-set") == "working-set":
        return f"GPU KV {w['fraction']:g}x the working set"
    return f"GPU KV = 32 seats + {w['fraction']:g}x the reuse set"


def star(iv) -> str:
    """`*` when the interval excludes 0."""
    return " *" if iv.known and (iv.high < 0 or iv.low > 0) else ""


def run(args: argparse.Namespace) -> dict:
    layout = preset("llama-3-8b")
    box = Box(gpu_profile("l4-24gb"))
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)
    cost = box.cost_model(layout)
    kv = kv_cache_bytes(box, layout, max_num_batched_tokens=2048, max_num_seqs=32)
    seeds = list(range(args.seeds))
    link = host_link_profile(cost)
    out: dict = {"box_blocks": kv.blocks(BLOCK_SIZE), "sizing": args.sizing,
                 "seeds": seeds, "host_x": args.host_x,
                 "prefetch_x": args.prefetch_x, "policies": args.policies,
                 "host_link_bytes_per_s": link.read_bytes_per_s,
                 "bytes_per_block": layout.bytes_per_block(BLOCK_SIZE), "workloads": {}}
    for name in args.workloads:
        first = workloads.generate(name, seed=seeds[0])
        scale = scale_for_load(first, cost, BLOCK_SIZE, args.target_load, max_batch=32)
        study = Study(Source(workload=name, rate_scale=scale), layout, BLOCK_SIZE, cost, config)
        rho = offered_load(study_requests(study, seeds[0]), cost, BLOCK_SIZE, max_batch=32).rho
        parts = []  # per seed: reuse working set, mean running batch, full seats (blocks)
        for s in seeds:
            requests = study_requests(study, s)
            parts.append((working_set(requests, BLOCK_SIZE), running_blocks(requests, cost),
                          seat_blocks(requests)))
        reuse, running, seats = (float(np.mean(col)) for col in zip(*parts, strict=True))
        wset = reuse + running
        largest = max(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE)
                      for s in seeds for r in study_requests(study, s))
        gpu = max(largest, round(float(np.mean(
            [gpu_blocks(args.sizing, args.fraction, *p) for p in parts]))))
        variants = [(x, False) for x in args.host_x] + [(args.prefetch_x, True)]
        cells = []
        for x, prefetch in variants:
            tiers = TierConfig(round(x * gpu), prefetch=prefetch) if x else None
            cells += [Cell(p, gpu, s, tiers=tiers) for s in seeds for p in args.policies]
        start = time.perf_counter()
        results = run_cells(study, cells, jobs=args.jobs)
        seconds = time.perf_counter() - start
        rows: dict = {}
        for cell, res in zip(cells, results, strict=True):
            x = 0 if cell.tiers is None else cell.tiers.host_blocks / gpu
            key = f"{cell.policy}@{x:g}" + ("+prefetch" if cell.tiers is not None
                                            and cell.tiers.prefetch else "")
            kept = {k: res[k] for k in KEYS}
            kept["classes"] = {c: {k: v[k] for k in CLASS_KEYS}
                               for c, v in res.get("classes", {}).items()}
            if "tiers" in res:
                t = res["tiers"]
                kept["host_hit_blocks"] = t["hit_blocks"].get("host", 0)
                kept["device_hit_blocks"] = t["hit_blocks"]["device"]
                kept["link_utilization"] = t["links"]["host"]["utilization"]
                kept["link_queued_s"] = t["links"]["host"]["queued_s"]
                kept["write_utilization"] = t["write_utilization"]["host"]
                kept["drops"] = t["drops"]
                kept["prefetch"] = t["prefetch"]
            rows.setdefault(key, {})[cell.seed] = kept
        out["workloads"][name] = {"scale": scale, "rho": rho, "working_set_blocks": wset,
                                  "reuse_blocks": reuse, "running_blocks": running,
                                  "seat_blocks": seats, "sizing": args.sizing,
                                  "gpu_blocks": gpu, "fraction": args.fraction,
                                  "seconds": seconds, "cells": rows}
        print(tables(name, out["workloads"][name], out), flush=True)
    return out


def _col(cells: dict, key: str) -> dict:
    return {s: float(c[key]) for s, c in cells.items()}


def tables(name: str, w: dict, out: dict) -> str:
    """The tables of one workload (``w``) of a run's results (``out``)."""
    args = argparse.Namespace(host_x=out["host_x"], policies=out["policies"],
                              prefetch_x=out["prefetch_x"])
    cells, gpu = w["cells"], w["gpu_blocks"]
    if w.get("sizing", "working-set") == "working-set":
        size = f"GPU KV {gpu:,} blocks ({w['fraction']:g}x)"
    else:
        size = (f"GPU KV {gpu:,} blocks (32 seats {w['seat_blocks']:,.0f} + "
                f"{w['fraction']:g}x reuse {w['reuse_blocks']:,.0f})")
    over = (f", over the box's {out['box_blocks']:,} (an oversubscribed what-if)"
            if gpu > out["box_blocks"] else "")
    lines = [f"### {name}: ρ {w['rho']:.2f} (rate x{w['scale']:.3g}), working set "
             f"{w['working_set_blocks']:,.0f} blocks, {size}{over}; "
             f"{len(args.host_x) + 1} variants x "
             f"{len(args.policies)} policies x {len(next(iter(cells.values())))} seeds in "
             f"{w['seconds']:.0f} s", ""]
    lines += ["| host tier | policy | p95 TTFT (s) | recomputed prefill tokens | token hit | "
              "host-tier hit blocks | measured load |", "|---|---|---:|---:|---:|---:|---:|"]
    for x in args.host_x:
        for p in args.policies:
            c = cells[f"{p}@{x:g}"]
            host = (f"{interval(list(_col(c, 'host_hit_blocks').values())):,.0f}"
                    if x else "")
            lines.append(
                f"| {x:g}x = {round(x * gpu):,} | {p} | "
                f"{interval(list(_col(c, 'ttft_p95').values())):.2f} | "
                f"{interval(list(_col(c, 'recomputed_prefill_tokens').values())):,.0f} | "
                f"{interval(list(_col(c, 'token_hit_ratio').values())):.3f} | {host} | "
                f"{interval(list(_col(c, 'measured_load').values())):.3f} |")
    lines += ["", f"(a) a host tier of {args.prefetch_x:g}x against GPU only, per policy "
              "(paired by seed; the ratio is of the means):", "",
              "| policy | p95 TTFT GPU only | p95 TTFT tiered | tiered − GPU only | ratio | "
              "recomputed tokens tiered − GPU only |", "|---|---:|---:|---:|---:|---:|"]
    x4 = f"{args.prefetch_x:g}"
    for p in args.policies:
        g, t = cells[f"{p}@0"], cells[f"{p}@{x4}"]
        d = paired(_col(t, "ttft_p95"), _col(g, "ttft_p95"))
        dr = paired(_col(t, "recomputed_prefill_tokens"), _col(g, "recomputed_prefill_tokens"))
        gm = np.mean(list(_col(g, "ttft_p95").values()))
        tm = np.mean(list(_col(t, "ttft_p95").values()))
        lines.append(f"| {p} | {gm:.2f} | {tm:.2f} | {d:.2f}{star(d)} | {tm / gm:.3f} | "
                     f"{dr:,.0f}{star(dr)} |")
    lines += ["", "(b) tiered policies against tiered LRU at each host size (paired by seed):",
              "", "| host tier | policy | recomputed tokens − LRU | p95 TTFT − LRU (s) |",
              "|---|---|---:|---:|"]
    for x in args.host_x:
        base = cells[f"lru@{x:g}"]
        for p in args.policies:
            if p == "lru":
                continue
            c = cells[f"{p}@{x:g}"]
            dr = paired(_col(c, "recomputed_prefill_tokens"),
                        _col(base, "recomputed_prefill_tokens"))
            dp = paired(_col(c, "ttft_p95"), _col(base, "ttft_p95"))
            lines.append(f"| {x:g}x | {p} | {dr:,.0f}{star(dr)} | {dp:.3f}{star(dp)} |")
    lines += ["", f"Prefetch at {x4}x: on − off (paired by seed):", "",
              "| policy | p95 TTFT on − off (s) | mean reload on | mean reload off | "
              "p95 reload on | p95 reload off | blocks prefetched | used | peak staged |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in args.policies:
        on, off = cells[f"{p}@{x4}+prefetch"], cells[f"{p}@{x4}"]
        d = paired(_col(on, "ttft_p95"), _col(off, "ttft_p95"))
        pre = [c["prefetch"] for c in on.values()]
        lines.append(
            f"| {p} | {d:.4f}{star(d)} | "
            f"{np.mean(list(_col(on, 'reload_s_mean').values())) * 1e3:.3f} ms | "
            f"{np.mean(list(_col(off, 'reload_s_mean').values())) * 1e3:.3f} ms | "
            f"{np.mean(list(_col(on, 'reload_s_p95').values())) * 1e3:.3f} ms | "
            f"{np.mean(list(_col(off, 'reload_s_p95').values())) * 1e3:.3f} ms | "
            f"{np.mean([q['blocks'] for q in pre]):,.0f} | "
            f"{np.mean([q['used'] for q in pre]):,.0f} | "
            f"{np.mean([q['peak_staged_blocks'] for q in pre]):,.0f} |")
    lines += ["", "Where the TTFT goes (means over seeds; p95 of each part, and the mean TTFT "
              "split exactly into its parts):", "",
              "| host tier | policy | measured load | p95 TTFT | p95 wait memory | "
              "p95 wait compute | p95 prefill | p95 recompute | p95 reload | mean TTFT = "
              "memory + compute + prefill + reload | host link busy | writes busy |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for x in (0, args.prefetch_x):
        for p in args.policies:
            c = cells[f"{p}@{x:g}"]

            def m(key, c=c):
                return float(np.mean(list(_col(c, key).values())))
            busy = (f"{m('link_utilization'):.2e}", f"{m('write_utilization'):.2e}") if x \
                else ("", "")
            lines.append(
                f"| {x:g}x | {p} | {m('measured_load'):.3f} | {m('ttft_p95'):.2f} | "
                f"{m('wait_memory_p95'):.2f} | {m('wait_compute_p95'):.2f} | "
                f"{m('prefill_s_p95'):.3f} | {m('recompute_prefill_s_p95'):.3f} | "
                f"{m('reload_s_p95') * 1e3:.3f} ms | {m('ttft_mean'):.2f} = "
                f"{m('wait_memory_mean'):.2f} + {m('wait_compute_mean'):.2f} + "
                f"{m('prefill_s_mean'):.3f} + {m('reload_s_mean') * 1e3:.3f} ms | "
                f"{busy[0]} | {busy[1]} |")
    classes = sorted({c for cell in cells.values() for seed in cell.values()
                      for c in seed.get("classes", {})})
    if len(classes) > 1:
        lines += ["", "Per workload class (means over seeds; a request queues first come, first "
                  "served with every other class):", "",
                  "| host tier | policy | class | p50 TTFT | p95 TTFT | p95 wait memory | "
                  "p95 wait compute |", "|---|---|---|---:|---:|---:|---:|"]
        for x in (0, args.prefetch_x):
            for p in args.policies:
                for k in classes:
                    per = [seed["classes"][k] for seed in cells[f"{p}@{x:g}"].values()
                           if k in seed.get("classes", {})]
                    lines.append(f"| {x:g}x | {p} | {k} | "
                                 + " | ".join(f"{np.mean([c[q] for c in per]):.2f}"
                                              for q in CLASS_KEYS) + " |")
    return "\n".join(lines) + "\n"


def plot(out: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["workloads"])
    colors = {"lru": "#444444", "market": "#d7301f", "bayes": "#2b8cbe"}
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 7.4), squeeze=False)
    for ax, name in zip(axes[1], names, strict=True):  # paired by seed against GPU-only LRU
        w = out["workloads"][name]
        xs = out["host_x"]
        base = _col(w["cells"]["lru@0"], "ttft_p95")
        for i, p in enumerate(out["policies"]):
            ivs = [paired({s: 100 * (v / base[s] - 1) for s, v in
                           _col(w["cells"][f"{p}@{x:g}"], "ttft_p95").items()},
                          dict.fromkeys(base, 0.0)) for x in xs]
            ax.errorbar([x + (i - 1) * 0.06 for x in xs], [iv.mean for iv in ivs],
                        yerr=[iv.half if iv.known else 0 for iv in ivs], marker="o",
                        capsize=3, color=colors.get(p), label=f"{p} (tiered)")
        ax.axhline(-50, color="#999999", ls="--", lw=1, label="−50%: issue 15's target")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(xs, [("GPU only" if x == 0 else f"{x:g}x") for x in xs])
        ax.set_xlabel(f"host tier / GPU KV ({w['gpu_blocks']:,} blocks)")
        ax.set_ylabel("p95 TTFT vs GPU-only LRU (%),\npaired by seed, 95% CI")
        ax.set_ylim(min(-60, ax.get_ylim()[0]), max(10, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center right")
    for ax, name in zip(axes[0], names, strict=True):
        w = out["workloads"][name]
        xs = out["host_x"]
        for i, p in enumerate(out["policies"]):
            ivs = [interval(list(_col(w["cells"][f"{p}@{x:g}"], "ttft_p95").values()))
                   for x in xs]
            offset = (i - 1) * 0.06
            ax.errorbar([x + offset for x in xs], [iv.mean for iv in ivs],
                        yerr=[iv.half if iv.known else 0 for iv in ivs], marker="o",
                        capsize=3, color=colors.get(p), label=f"{p} (tiered)")
            pre = interval(list(_col(w["cells"][f"{p}@{out['prefetch_x']:g}+prefetch"],
                                     "ttft_p95").values()))
            ax.errorbar([out["prefetch_x"] + offset + 0.2], [pre.mean],
                        yerr=[pre.half if pre.known else 0], marker="^", capsize=3,
                        color=colors.get(p), alpha=0.6,
                        label="▲ prefetch on (each policy's colour)" if i == 0 else None)
        base = np.mean(list(_col(w["cells"]["lru@0"], "ttft_p95").values()))
        ax.axhline(base / 2, color="#999999", ls="--", lw=1, label="half of GPU-only LRU")
        ax.set_xticks(xs, [("GPU only" if x == 0 else f"{x:g}x") for x in xs])
        ax.set_xlabel(f"host tier / GPU KV ({w['gpu_blocks']:,} blocks)")
        ax.set_ylabel("p95 TTFT (s), mean ± 95% CI")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: {sizing_label(w)}, offered ρ {w['rho']:.2f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"A host KV tier on one L4 (Llama-3-8B, PCIe Gen4 host link), "
                 f"sessions closed loop, {len(out['seeds'])} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    parser.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    parser.add_argument("--host-x", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.0, 1.0, 2.0, 4.0, 8.0],
                        help="host tier sizes, multiples of the GPU's blocks (0: GPU only)")
    parser.add_argument("--prefetch-x", type=float, default=4.0,
                        help="the host size of the prefetch cells and of comparison (a)")
    parser.add_argument("--sizing", choices=SIZINGS, default="working-set",
                        help="the GPU's KV: --fraction x (reuse + mean running batch), or the "
                             "32 seats' blocks + --fraction x reuse (module docstring)")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--target-load", type=float, default=0.7)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write results.json and the PNG")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="print the tables and draw the PNG (into --out) of a results.json "
                             "written before, without running")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        out = json.loads(args.from_json.read_text())
        for w in out["workloads"].values():  # JSON keys are strings: seeds back to ints
            w["cells"] = {k: {int(s): c for s, c in v.items()} for k, v in w["cells"].items()}
        for name, w in out["workloads"].items():
            print(tables(name, w, out))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            plot(out, args.out / png_name(out.get("sizing", "working-set")))
        return 0
    if 0.0 not in args.host_x or args.prefetch_x not in args.host_x or "lru" not in \
            args.policies:
        parser.error("--host-x must hold 0 and --prefetch-x, and --policies lru")
    out = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(out, indent=1, default=str))
        plot(out, args.out / png_name(args.sizing))
        print(f"wrote results.json and {png_name(args.sizing)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
