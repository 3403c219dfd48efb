"""Train the learned token policies (LKV-T, KVP, LKV-H) on the shipped judge; save them beside it.

    python benchmarks/train_token_policies.py --seed 0

All train on fresh items of the three tasks (seeds disjoint from every evaluation set) with the
judge frozen, and write ``lkv_t.safetensors``, ``kvp.safetensors``, ``lkv_h.safetensors`` and
``lkv_h_scorer.safetensors`` into the judge's folder, plus ``TOKEN_POLICIES.json`` (command,
threads, wall time and items per method, SHA-256 of each file).

- LKV-T (`kvevict.tokens.lkv`): warm-started by distillation on the full-cache traces' future
  attention (every question of a context asked after it, `packed_items`), then end to end
  through the judge's answer loss, with a straight-through top-k gate on the context keys at
  a retention drawn per step.
- KVP (`kvevict.tokens.kvp`): REINFORCE on the same full-cache generation traces
  (`kvevict.judge.judge_traces`), rewarded by the future attention a ranking keeps at every
  budget.
- LKV-H (`kvevict.tokens.heads`): a per-(layer, head) scorer distilled from each head's own
  future attention on the same traces (``lkv_h_scorer.safetensors``), then per-(layer, head)
  budgets under the retention target, end to end through the judge's answer loss with a
  straight-through per-head cut over that (frozen) ranking.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from kvevict.judge import JUDGE_DIR, gated_logits, judge_traces, load_judge
from kvevict.tokens.heads import save_budgets, train_lkv_h
from kvevict.tokens.kvp import train_kvp
from kvevict.tokens.learned import KVScorer, ScorerShape, distill_scorer, save_scorer
from kvevict.tokens.lkv import train_lkv_t
from kvevict.tokens.tasks import TASKS, make_items, packed_items

METHODS = ("lkv_t", "kvp", "lkv_h")
TRAIN_SEED = 30_000  # item seeds: disjoint from the judge's (10k, 20k) and the docs' (0..9)


def lkv_batches(items, batch: int):
    """``(ids, targets, context)`` per batch: prompt + answer teacher-forced, loss on answers."""
    out = []
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        ids = torch.tensor([(*it.prompt, *it.answer[:-1]) for it in chunk])
        targets = torch.full_like(ids, -100)
        start = len(chunk[0].prompt) - 1
        targets[:, start:] = torch.tensor([it.answer for it in chunk])
        out.append((ids, targets, len(chunk[0].context)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--judge", type=Path, default=JUDGE_DIR)
    ap.add_argument("--items", type=int, default=160, help="training contexts per task")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                    help="train only these; the others' files and manifest entries are kept")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_judge(args.judge)
    for p in model.parameters():
        p.requires_grad_(False)
    shape = ScorerShape.of(model)
    items = []
    for t in TASKS:  # interleaved so every batch of one task shares its lengths
        items += make_items(t, args.items, length=1024, seed=TRAIN_SEED + args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    batches = lkv_batches(items, args.batch)
    order = torch.randperm(len(batches), generator=generator).tolist()
    batches = [batches[i] for i in order]
    manifest = args.judge / "TOKEN_POLICIES.json"
    report = json.loads(manifest.read_text()) if manifest.is_file() else {}
    command = "python benchmarks/train_token_policies.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    forward = lambda ids, gate: gated_logits(model, ids, gate)  # noqa: E731

    # every question of a context after it: the attention all three learn from (one task per
    # batch: its items share their lengths)
    traces = [tr for t in TASKS
              for tr in judge_traces(model, packed_items(t, args.items, length=1024,
                                                         seed=TRAIN_SEED + args.seed),
                                     batch=args.batch, context=1024)]
    traces = [traces[i] for i in torch.randperm(len(traces), generator=generator).tolist()]
    for name in args.methods:
        start = time.perf_counter()
        if name == "lkv_t":
            lkv = train_lkv_t(forward, batches, shape, traces=traces, seed=args.seed, log=log)
            save_scorer(lkv, args.judge / "lkv_t.safetensors", method="lkv_t")
        elif name == "kvp":
            kvp = train_kvp(traces, shape, epochs=args.epochs + 1, seed=args.seed, log=log)
            save_scorer(kvp, args.judge / "kvp.safetensors", method="kvp")
        else:  # each head ranks its tokens by its own distilled scorer, then the budgets
            torch.manual_seed(args.seed)
            ranking = distill_scorer(KVScorer(shape, 128, per_head=True), traces,
                                     seed=args.seed, log=log)
            save_scorer(ranking, args.judge / "lkv_h_scorer.safetensors", method="lkv_h")
            budgets = train_lkv_h(forward, batches, shape, epochs=args.epochs, seed=args.seed,
                                  scoring=ranking, log=log)
            save_budgets(budgets, args.judge / "lkv_h.safetensors")
        report[f"{name}_seconds"] = round(time.perf_counter() - start)
        report[f"{name}_command"] = command
        report[f"{name}_items_per_task"] = args.items
        report[f"{name}_threads"] = args.threads
    report["seed"] = args.seed
    for name in ("lkv_t", "kvp", "lkv_h", "lkv_h_scorer"):
        path = args.judge / f"{name}.safetensors"
        if path.is_file():  # a method never trained beside this judge has no file to digest
            report[f"{name}_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (args.judge / "TOKEN_POLICIES.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
