"""MoE-nD's routed tuples against the best uniform tuple of the same byte budget, on the judge.

    python benchmarks/routed_vs_uniform.py --fraction 0.1 --seeds 0 1 2 --items 24

For each task: calibrate each layer's answer-loss increase per ``(keep ratio, key bits, value
bits)`` tuple on calibration items (`kvevict.adapters.hf.routed.calibrate`, item seeds disjoint
from the evaluation's), route under a budget of ``--fraction`` of the full cache's bytes
(`kvevict.tokens.solver.route`), and compare the exact match of the routed cache against the
best uniform tuple that fits the same budget (`uniform` with the same loss table), both run by
`routed_answers` over ``--items`` items per evaluation seed. Prints a markdown table (mean and
95% Student-t interval over the seeds, the paired difference) and writes
``routed_vs_uniform.json`` under ``--out``.

With ``--joint-rounds N`` (N > 0), the routing is checked on the joint calibration loss
before it is evaluated (`kvevict.adapters.hf.routed.refine_route`): N rounds of re-measuring
each layer's losses around the current routing and routing again, and the uniform tuple
measured too; the routing of lowest joint loss on the calibration items is the one compared.
When it differs from `route`'s, the latter is evaluated as well (``additive`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvevict.adapters.hf.routed import calibrate, refine_route, routed_answers
from kvevict.judge import JUDGE_DIR, load_judge
from kvevict.layout import KVLayout
from kvevict.stats import interval
from kvevict.tokens import ScorerShape
from kvevict.tokens.solver import Tuple, cost_table, route, total_bytes, uniform
from kvevict.tokens.tasks import TASKS, make_items

CALIBRATION_SEED = 40_000  # disjoint from the judge's (10k, 20k), LKV's (30k) and the docs' (0..)
RATIOS = (1.0, 0.5, 0.25, 0.1, 0.05)
BITS = (None, 8, 4, 2)


def tuples(ratios=RATIOS, bits=BITS) -> list[Tuple]:
    return [Tuple(r, k, v) for r in ratios for k in bits for v in bits]


def exact(answers, items) -> float:
    return sum(a == it.answer for a, it in zip(answers, items, strict=True)) / len(items)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--judge", type=Path, default=JUDGE_DIR)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--calibration-items", type=int, default=16)
    ap.add_argument("--policy", default="knorm",
                    help="the attention-free token policy (lkv_t and kvp load the judge's "
                         "shipped scorer)")
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    ap.add_argument("--bits", type=lambda x: None if x == "none" else int(x), nargs="+",
                    default=list(BITS), help="bit widths, 'none' for unquantized")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--joint-rounds", type=int, default=0,
                    help="rounds of refine_route on the joint calibration loss (0: route's "
                         "routing as it is)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_judge(args.judge)
    layout = KVLayout.from_hf_config(model.config)
    params = ({"scorer": args.judge / f"{args.policy}.safetensors",
               "shape": ScorerShape.of(model)} if args.policy in ("lkv_t", "kvp") else {})
    candidates = tuples(args.ratios, args.bits)
    if Tuple(1.0, None, None) not in candidates:
        candidates.append(Tuple(1.0, None, None))  # the full cache: the calibration's base
    rows = []
    for task in args.tasks:
        calib = make_items(task, args.calibration_items, length=1024, seed=CALIBRATION_SEED)
        losses = calibrate(model, calib, candidates, token_policy=args.policy,
                           token_params=params)
        tokens = len(calib[0].context)
        costs = cost_table(layout, tokens, candidates)
        full = total_bytes([Tuple(1.0, None, None)] * layout.num_layers, costs)
        budget = args.fraction * full
        additive = route(losses, costs, budget)
        flat = uniform(None, costs, budget, losses)
        routed, joint = additive, {}
        if args.joint_rounds:
            routed, nll, (nll_additive, nll_uniform) = refine_route(
                model, calib, costs, budget, [additive, flat], token_policy=args.policy,
                token_params=params, rounds=args.joint_rounds)
            joint = {"joint_nll": {"routed": nll, "additive": nll_additive,
                                   "uniform": nll_uniform},
                     "additive_tuples": [list(t) for t in additive]}
        runs = [("routed", routed), ("uniform", flat)]
        if routed != additive:
            runs.append(("additive", additive))
        accs: dict[str, list[float]] = {name: [] for name, _ in runs}
        for seed in args.seeds:
            items = make_items(task, args.items, length=1024, seed=seed)
            for name, routing in runs:
                answers, _ = routed_answers(model, items, routing, token_policy=args.policy,
                                            token_params=params)
                accs[name].append(exact(answers, items))
        diff = [r - u for r, u in zip(accs["routed"], accs["uniform"], strict=True)]
        row = {"task": task, "budget_bytes": budget, "full_bytes": full,
               "routed_tuples": [list(t) for t in routed], "uniform_tuple": list(flat[0]),
               "routed_bytes": total_bytes(routed, costs),
               "uniform_bytes": total_bytes(flat, costs), **accs, "difference": diff, **joint}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| task | routed tuples (per layer) | uniform tuple | routed | uniform | routed - "
          "uniform |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        ri, ui, di = interval(r["routed"]), interval(r["uniform"]), interval(r["difference"])
        tup = ", ".join(f"({t[0]}, {t[1]}, {t[2]})" for t in r["routed_tuples"])
        u = r["uniform_tuple"]
        print(f"| {r['task']} | {tup} | ({u[0]}, {u[1]}, {u[2]}) | {100 * ri.mean:.1f} ± "
              f"{100 * (ri.high - ri.mean):.1f} | {100 * ui.mean:.1f} ± "
              f"{100 * (ui.high - ui.mean):.1f} | {100 * di.mean:+.1f} ± "
              f"{100 * (di.high - di.mean):.1f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routed_vs_uniform.json").write_text(json.dumps(
        {"command": "python benchmarks/routed_vs_uniform.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
