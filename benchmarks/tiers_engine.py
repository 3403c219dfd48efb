"""Reload versus recompute on the built-in engine, measured on this machine, next to the model.

For the engine's tiny Llama (``kvevict engine-bench``'s default sizes) this script measures:

- **recompute** of one block at each depth: ``forward_paged`` of ``block_size`` tokens after
  ``depth * block_size`` cached ones (`kvevict.engine.tiers.measure_recompute`), next to
  what the calibrated `CostModel` (`kvevict.engine.calibrate`, fitted in this run) predicts;
- **reload** of one block from each tier, exactly as `kvevict.tiers.TierStack` moves it
  (`kvevict.engine.tiers.measure_link`): a host tier (a second CPU tensor), a disk tier read
  cold (``fsync`` + ``POSIX_FADV_DONTNEED`` before each read, so the device serves it) and the
  same disk read warm (the page cache serves it); next to the `TierProfile` fitted to the
  measurement (latency + bytes / bandwidth over 1-32 blocks per batch);
- the **crossover depth**: from which depth on reloading a block beats recomputing it,
  measured (the table's rows) and predicted (the calibrated cost model against the fitted
  profile: the rule `TierStack` demotes by, after InferCept, ICML'24, section 4, and
  CachedAttention, ATC'24, section 3);
- an **end-to-end check**: a chat replay on a pool too small for it, over the measured host
  and disk tiers, whose answers must equal an unbounded pool's token for token, with the
  blocks each tier served.

Every timing is a median of ``--repeats`` calls after a warm-up (wall clock,
``time.perf_counter``); the ratios between rows matter more than the absolute numbers on a
shared machine. Usage::

    python benchmarks/tiers_engine.py [--model engine-bench|tiny] [--repeats 7]
                                      [--depths 0,1,2,4,8,16,32,64,128,256]
                                      [--disk-dir DIR] [--json out.json] [--no-replay]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # kvevict from this checkout without an install
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from kvevict.engine import LlamaModel, ModelConfig  # noqa: E402
from kvevict.engine.answers import compare_answers  # noqa: E402
from kvevict.engine.calibrate import calibrate  # noqa: E402
from kvevict.engine.driver import run_engine, unbounded_capacity  # noqa: E402
from kvevict.engine.tiers import (  # noqa: E402
    crossover_table,
    engine_tiers,
    measure_link,
    measure_recompute,
)
from kvevict.scheduler import SchedulerConfig  # noqa: E402
from kvevict.workloads import generate  # noqa: E402

BLOCK = 16
MODELS = {
    "engine-bench": ModelConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4,
                                num_kv_heads=2, head_dim=32, intermediate_size=256),
    "tiny": ModelConfig(vocab_size=128, hidden_size=16, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8, intermediate_size=32),
}


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e6:,.0f}"


def replay(model: LlamaModel, links: dict, cost, disk_dir: Path) -> dict:
    """A chat replay on a pool of the largest request's size over the measured tiers, against
    an unbounded pool: the answers must be identical."""
    requests = generate("chat", seed=1, vocab_size=model.config.vocab_size, duration=600,
                        sessions_per_minute=12, output_tokens_mean=24, user_tokens_mean=40,
                        system_prompt_tokens=64, think_time_median=1.0,
                        first_continue_prob=0.8, later_continue_prob=0.8)[:40]
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    small = max(-(-(r.prompt_len + r.output_len) // BLOCK) for r in requests)
    layout = model.config.layout()
    per_block = layout.bytes_per_block(BLOCK)
    ref = run_engine(requests, model, capacity_blocks=unbounded_capacity(requests, BLOCK, 8),
                     block_size=BLOCK, config=config)
    bare = run_engine(requests, model, capacity_blocks=small, block_size=BLOCK, config=config)
    stack = engine_tiers(layout, BLOCK, host_bytes=small // 2 * per_block,
                         disk_dir=disk_dir / "replay", disk_bytes=4 * small * per_block,
                         cost=cost, host_profile=links["host"].profile,
                         disk_profile=links["disk (cold)"].profile)
    tiered = run_engine(requests, model, capacity_blocks=small, block_size=BLOCK,
                        config=config, tiers=stack)
    check = compare_answers(ref, tiered)
    out = {"requests": len(requests), "pool_blocks": small, "host_blocks": small // 2,
           "disk_blocks": 4 * small, "answers": check.verdict(), "identical": check.identical,
           "tiers": tiered.tiers}
    for name, run in (("unbounded", ref), ("pool only", bare), ("pool + tiers", tiered)):
        s = run.sim.summary()
        out[name] = {"token_hit_ratio": s["token_hit_ratio"],
                     "prefill_tokens_computed": sum(run.engine_prefill_tokens.values()),
                     "busy_s": run.engine["busy_s"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", default="0,1,2,4,8,16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--disk-dir", type=Path, default=None,
                        help="where the disk tier's files go (default: a temp directory)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--no-replay", action="store_true", help="skip the end-to-end check")
    parser.add_argument("--model", choices=sorted(MODELS), default="engine-bench",
                        help="engine-bench: kvevict engine-bench's default model; tiny: the "
                             "1-layer hidden-16 model of its tests (cheaper to recompute)")
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    torch.set_num_threads(1)
    config = MODELS[args.model]
    model = LlamaModel(config, seed=0)
    layout = config.layout()
    tmp = tempfile.TemporaryDirectory(prefix="kvevict-tiers-bench-")
    disk_dir = args.disk_dir or Path(tmp.name)
    t0 = time.perf_counter()
    longest = (max(depths) + 1) * BLOCK
    cal = calibrate(model, block_size=BLOCK, prefill_lengths=[16, 64, 256],
                    cached_lengths=sorted({0, longest // 2, longest}),
                    decode_batches=[1, 4], decode_contexts=[64, longest], repeats=3)
    cost = cal.cost
    links = {
        "host": measure_link("host", layout, BLOCK, repeats=args.repeats, name="host"),
        "disk (cold)": measure_link("disk", layout, BLOCK, directory=disk_dir,
                                    repeats=args.repeats, name="disk-cold"),
        "disk (warm)": measure_link("disk", layout, BLOCK, directory=disk_dir, cold=False,
                                    repeats=args.repeats, name="disk-warm"),
    }
    recompute = measure_recompute(model, BLOCK, depths, repeats=args.repeats)
    table = crossover_table(recompute, links, cost, BLOCK)
    print(f"engine: Llama {config.num_layers} layers, hidden {config.hidden_size}, "
          f"{config.num_heads}/{config.num_kv_heads} heads x {config.head_dim}, float32 on "
          f"cpu, 1 thread; {layout.bytes_per_block(BLOCK):,}-byte blocks of {BLOCK} tokens")
    fit = cal.fit_summary()
    print(f"cost model: calibrated in this run (prefill fit error mean "
          f"{fit['prefill_mean_abs_rel_err']:.0%}); links fitted to the measurement:")
    for name, link in links.items():
        p = link.profile
        print(f"  {name:12s} latency {p.latency_s * 1e6:8.1f} us, read "
              f"{p.read_bytes_per_s / 1e9:7.3f} GB/s, write {p.write_bytes_per_s / 1e9:7.3f} "
              f"GB/s" + ("" if link.cold is None else
                         f" (page cache {'bypassed' if link.cold else 'serving'})"))
    print()
    print("per block, microseconds (measured | predicted by the cost model / the fitted link)")
    names = list(links)
    header = ["depth", "recompute", "predicted", *[f"{n}" for n in names],
              *[f"{n} pred" for n in names]]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    for row in table["rows"]:
        cells = [str(row["depth"]), _us(row["recompute_s"]), _us(row["recompute_predicted_s"]),
                 *[_us(row[f"{n}_reload_s"]) for n in names],
                 *[_us(row[f"{n}_reload_predicted_s"]) for n in names]]
        print("| " + " | ".join(cells) + " |")
    print()
    for name, c in table["crossover"].items():
        print(f"crossover {name:12s}: measured from depth {c['measured']}, predicted from "
              f"depth {c['predicted']}")
    result = {"cost_model": cost.to_dict(), "links": {k: v.as_dict() for k, v in links.items()},
              "recompute": {str(k): v for k, v in recompute.items()}, **table}
    if not args.no_replay:
        e2e = replay(model, links, cost, disk_dir)
        result["replay"] = e2e
        t = e2e["tiers"]
        print()
        print(f"replay: {e2e['requests']} chat requests, pool {e2e['pool_blocks']} blocks, "
              f"host {e2e['host_blocks']}, disk {e2e['disk_blocks']}: answers vs unbounded "
              f"{e2e['answers']}")
        for name in ("unbounded", "pool only", "pool + tiers"):
            r = e2e[name]
            print(f"  {name:13s} token hit ratio {r['token_hit_ratio']:.3f}, prefill tokens "
                  f"computed {r['prefill_tokens_computed']:,}, busy {r['busy_s']:.2f} s")
        print(f"  blocks served by tier {t['hits_by_tier']}, reloads {t['reloads']}, bytes read "
              f"{t['bytes_read']}, written {t['bytes_written']}, drops {t['drops']}; reloads "
              f"took {t['reload_s_measured'] * 1e3:.1f} ms measured, "
              f"{t['reload_s_predicted_per_block'] * 1e3:.1f} ms priced by the links")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.cleanup()
    return 0 if args.no_replay or result["replay"]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
