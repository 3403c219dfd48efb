"""Head-granular policies through ``make_token_policy`` (`PagedCache`) against `HeadCache`.

    python benchmarks/tokens_heads_paged.py --seeds 0 1 2 --items 16 --fraction 0.15

``ema_heads`` and ``lkv_h`` on the judge, each task, the docs' evaluation sets (seeds 0..,
1,024-token contexts): exact match through `kvevict.judge.judge_accuracy` (``PagedCache`` in
``generate()``, evicting at every step, the registered policies), next to the same methods'
`HeadCache` rows (context compression once, the residual kept) read from
``docs/img/tokens_accuracy.json``. Also the KV bytes per sequence right after the context:
what the rectangular store holds (every layer as wide as the widest (layer, head) count) and
what a head-paged store would hold (each head its own count).

``--moe`` instead runs ``moe_nd`` (MoE-nD's per-layer ratios and bit widths as a token policy,
``knorm`` ranking) with the routed and the uniform tuples of ``docs/img/routed_vs_uniform.json``
(10% of the full cache's bytes, per task) through ``PagedCache``, next to that file's
`RoutedCache` accuracies, with the bytes a packed store would hold after the context.
``--routed FILE`` takes another `benchmarks/routed_vs_uniform.py` result (a file with several
``runs`` takes its first), and ``--inner lkv_t`` (or ``kvp``) ranks the tokens with the
shipped learned scorer, as ``routed_vs_uniform.py --policy`` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvevict.judge import JUDGE_DIR, budget_for, judge_accuracy, load_judge
from kvevict.stats import interval
from kvevict.tokens import ScorerShape, make_token_policy
from kvevict.tokens.base import head_counts_of
from kvevict.tokens.tasks import TASKS, make_items

POLICIES = ("ema_heads", "lkv_h")
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
GRID = DOCS_IMG / "tokens_accuracy.json"
ROUTED = DOCS_IMG / "routed_vs_uniform.json"


def params(name: str, model) -> dict:
    if name == "lkv_h":
        return {"scorer": JUDGE_DIR / "lkv_h_scorer.safetensors",
                "budgets": JUDGE_DIR / "lkv_h.safetensors", "shape": ScorerShape.of(model)}
    return {}


def held_bytes(model, name: str, budget: int, context: int) -> tuple[int, int]:
    """Bytes of one sequence's K/V right after the context: the rectangular store (width =
    the widest head count, in every layer and head) and a head-paged store (each head's own
    count)."""
    cfg = model.config
    shape = ScorerShape.of(model)
    policy = make_token_policy(name, budget=budget, **params(name, model))
    counts = [head_counts_of(policy, layer, context, shape.kv_heads)
              for layer in range(shape.layers)]
    per_slot = 2 * shape.key_dim * model.dtype.itemsize  # one head's K and V of one token
    width = max(max(row) for row in counts)
    return (width * cfg.num_hidden_layers * shape.kv_heads * per_slot,
            sum(map(sum, counts)) * per_slot)


def moe_table(model, seeds: list[int], items: int, routed: Path = ROUTED,
              inner: str = "knorm") -> str:
    """``moe_nd`` through `PagedCache` with ``routed``'s routings (a
    `benchmarks/routed_vs_uniform.py` result; the first of its ``runs`` when it has several),
    ranked by ``inner``, against `RoutedCache`."""
    shape = ScorerShape.of(model)
    result = json.loads(routed.read_text())
    rows = result["runs"][0]["rows"] if "runs" in result else result["rows"]
    ranking = ({"inner": inner} if inner == "knorm" else
               {"inner": inner, "shape": shape,
                "inner_params": {"scorer": JUDGE_DIR / f"{inner}.safetensors"}})
    lines = ["| task | routing | `moe_nd` (PagedCache) | RoutedCache | packed KiB |",
             "|---|---|---|---|---|"]
    for row in rows:
        sets = [make_items(row["task"], items, length=1024, seed=s) for s in seeds]
        context = len(sets[0][0].context)
        for kind in ("routed", "uniform"):
            tuples = row[f"{kind}_tuples"] if kind == "routed" else [row["uniform_tuple"]] * (
                shape.layers)
            routing = [tuple(t) for t in tuples]
            budget = max(1, round(sum(t[0] for t in routing) / len(routing) * context))
            acc = [judge_accuracy(model, items_, "moe_nd", budget=budget, routing=routing,
                                  **ranking) for items_ in sets]
            iv, ref = interval([100 * a for a in acc]), interval([100 * a for a in row[kind]])
            moe = make_token_policy("moe_nd", budget=budget, routing=routing)
            packed = moe.packed_bytes(context, shape.kv_heads, shape.key_dim, model.dtype)
            lines.append(f"| {row['task']} | {kind} | {iv.mean:.1f} ± {iv.high - iv.mean:.1f} | "
                         f"{ref.mean:.1f} ± {ref.high - ref.mean:.1f} | {packed / 1024:.0f} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="moe_nd against RoutedCache instead")
    ap.add_argument("--routed", type=Path, default=ROUTED,
                    help="with --moe: the routed_vs_uniform.py result whose routings to run")
    ap.add_argument("--inner", choices=("knorm", "lkv_t", "kvp"), default="knorm",
                    help="with --moe: the ranking of moe_nd's kept tokens")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_judge()
    if args.moe:
        print(moe_table(model, args.seeds, args.items, args.routed, args.inner))
        return 0
    grid = json.loads(GRID.read_text()) if GRID.is_file() else []
    head_cache = {(r["task"], r["policy"]): r["per_seed"] for r in grid
                  if r["fraction"] == args.fraction}
    lines = ["| policy | task | PagedCache | HeadCache (docs grid) |", "|---|---|---|---|"]
    means: dict[str, list[list[float]]] = {name: [] for name in POLICIES}
    for name in POLICIES:
        for task in TASKS:
            acc = [judge_accuracy(model, make_items(task, args.items, length=1024, seed=s),
                                  name, fraction=args.fraction, **params(name, model))
                   for s in args.seeds]
            means[name].append(acc)
            iv = interval([100 * a for a in acc])
            ref = head_cache.get((task, name))
            old = "n/a" if ref is None else f"{100 * sum(ref) / len(ref):.1f}"
            lines.append(f"| {name} | {task} | {iv.mean:.1f} ± {iv.high - iv.mean:.1f} | "
                         f"{old} |")
            print(lines[-1], flush=True)
    for name, per_task in means.items():
        per_seed = [100 * sum(t[i] for t in per_task) / len(per_task)
                    for i in range(len(args.seeds))]
        iv = interval(per_seed)
        lines.append(f"| {name} | mean | {iv.mean:.1f} ± {iv.high - iv.mean:.1f} | |")
    context = len(make_items(TASKS[0], 1, length=1024, seed=0)[0].context)
    budget = budget_for(args.fraction, context)
    lines += ["", "| policy | rectangular store (KiB) | head-paged (KiB) |", "|---|---|---|"]
    for name in POLICIES:
        rect, paged = held_bytes(model, name, budget, context)
        lines.append(f"| {name} | {rect / 1024:.0f} | {paged / 1024:.0f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
