"""Head-granular policies through ``make_token_policy`` (`PagedCache`) against `HeadCache`.

    python benchmarks/tokens_heads_paged.py --seeds 0 1 2 --items 16 --fraction 0.15

``ema_heads`` and ``lkv_h`` on the judge, each task, the docs' evaluation sets (seeds 0..,
1,024-token contexts): exact match through `kvevict.judge.judge_accuracy` (``PagedCache`` in
``generate()``, evicting at every step, the registered policies), next to the same methods'
`HeadCache` rows (context compression once, the residual kept) read from
``docs/img/tokens_accuracy.json``. Also the KV bytes per sequence right after the context:
what the rectangular store holds (every layer as wide as the widest (layer, head) count) and
what a head-paged store would hold (each head its own count).
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
GRID = Path(__file__).resolve().parent.parent / "docs" / "img" / "tokens_accuracy.json"


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_judge()
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
