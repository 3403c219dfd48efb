"""What a K/V scorer should learn: two oracles of token eviction on the judge.

    python benchmarks/tokens_oracles.py --items 16 --seed 0

Both see what no deployed policy sees, and both run through the judge's protocol
(`kvevict.judge.judge_accuracy`: the context compressed before the question, `PagedCache` in
``generate()``), keeping the newest tokens after the context (the question and the answer):

- ``future attention``: per layer, the context tokens the question's and the answer's queries
  attend to most under the full cache (`kvevict.judge.judge_traces`, heads averaged). This is
  LKV-T's distillation target (`kvevict.tokens.learned.distill_scorer`) and KVP's reward.
- ``records``: every token that is not filler (the task's records, ``BOS``, the task mark),
  then the most recent ones: what a reader of the task would keep.

Prints exact match per task and fraction. Measured on the shipped judge (16 items, seed 0):
future attention 100 / 100 / 93.8% at both 15% and 10%, the full cache's accuracy; records
100 / 25.0 / 87.5% at 15% and 93.8 / 6.2 / 81.2% at 10%. The needle's lookup needs particular
filler tokens, which only the judge's attention tells.
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from kvevict.judge import budget_for, judge_accuracy, judge_traces, load_judge
from kvevict.tokens.base import TokenPolicy
from kvevict.tokens.tasks import FILLER, TASKS, make_items


class FutureAttention(TokenPolicy):
    """Keep, per layer, the context tokens with the most future attention (``utility[layer]``
    ``[B, Hkv, C]`` from `judge_traces`); every token after the context is kept first."""

    def __init__(self, budget: int, utility: list[Tensor]) -> None:
        super().__init__(budget)
        self.utility = utility

    def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
        u = self.utility[layer_idx].mean(dim=1)  # [B, C]
        context = u.shape[1]
        after = positions >= context
        s = u.gather(1, positions.clamp(max=context - 1)).masked_fill(after, torch.inf)
        return self._mask(s, valid)


class Records(TokenPolicy):
    """Keep every non-filler token of the prompt ``ids`` ``[B, P]`` (and every token after
    it), then the most recent."""

    def __init__(self, budget: int, ids: Tensor) -> None:
        super().__init__(budget)
        self.ids = ids

    def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
        length = self.ids.shape[1]
        token = self.ids.gather(1, positions.clamp(max=length - 1))
        keep = (token < FILLER[0]) | (positions >= length)
        return self._mask(keep.float() * 1e6 + positions.float(), valid)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.15, 0.1])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_judge()
    print("| oracle | fraction | " + " | ".join(TASKS) + " |\n|---|---:|" + "---:|" * len(TASKS))
    for fraction in args.fractions:
        got: dict[str, list[float]] = {"future attention": [], "records": []}
        for task in TASKS:
            items = make_items(task, args.items, length=1024, seed=args.seed)
            keep = budget_for(fraction, len(items[0].context))
            utility = judge_traces(model, items, batch=args.items)[0]["utility"]
            ids = torch.tensor([it.prompt for it in items])
            for name, policy in (("future attention", FutureAttention(keep, utility)),
                                 ("records", Records(keep, ids))):
                got[name].append(judge_accuracy(model, items, policy, fraction=fraction,
                                                batch=args.items))
        for name, accs in got.items():
            print(f"| {name} | {round(100 * fraction)}% | "
                  + " | ".join(f"{100 * a:.1f}" for a in accs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
