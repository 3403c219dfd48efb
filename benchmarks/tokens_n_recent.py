"""The recent window the deployed token policies always keep (``n_recent``), on validation items.

    python benchmarks/tokens_n_recent.py --seed 5 --items 32 --threads 1

Evicting at every forward, a policy that scores only what it was trained on (the learned
scorers: the context's tokens) or what it has seen attended (the EMA of ``ema_heads``) would drop
the question fed after the context at once. So each keeps its ``n_recent`` newest tokens; the
default (`kvevict.tokens.learned.N_RECENT`) is chosen here, on validation items of the judge
(seed 5: disjoint from the training items, seeds 30,000+, and from the docs' evaluation seeds
0-2), through the production path (`kvevict.judge.judge_accuracy`: `PagedCache` in
``generate()``). Prints the mean exact match over the three tasks per policy, ``n_recent`` and
fraction, as a markdown table.
"""

from __future__ import annotations

import argparse

import torch
from tokens_accuracy import policy_params  # the shipped parameters, as the docs' grid loads them

from kvevict.judge import judge_accuracy, load_judge
from kvevict.tokens.tasks import TASKS, make_items

WINDOWS = {"lkv_t": (0, 4, 8, 16, 32), "kvp": (0, 4, 8, 16, 32), "ema_heads": (0, 8, 32)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.1])
    ap.add_argument("--policies", nargs="+", choices=list(WINDOWS), default=list(WINDOWS))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    judge = load_judge()
    sets = {task: make_items(task, args.items, length=1024, seed=args.seed) for task in TASKS}
    print(f"mean exact match over {', '.join(TASKS)} (%), validation seed {args.seed}, "
          f"{args.items} items per task; cells: "
          + " / ".join(f"{f:.0%}" for f in args.fractions))
    for name in args.policies:
        cells = []
        for n in WINDOWS[name]:
            means = []
            for fraction in args.fractions:
                scores = {task: judge_accuracy(judge, items, name, fraction=fraction,
                                               n_recent=n, **policy_params(name, judge))
                          for task, items in sets.items()}
                print(f"# {name} n_recent={n} {fraction}: {scores}", flush=True)
                means.append(100 * sum(scores.values()) / len(scores))
            cells.append(" / ".join(f"{m:.1f}" for m in means))
        print("\n| `n_recent` | " + " | ".join(str(n) for n in WINDOWS[name]) + " |")
        print("|---|" + "---:|" * len(WINDOWS[name]))
        print(f"| `{name}` | " + " | ".join(cells) + " |\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
