"""Accuracy vs KV bytes for every token policy on the judge, and decode cost per step.

    python benchmarks/tokens_accuracy.py --seeds 0 1 2 --items 24 --out docs/img

For each task of `kvevict.tokens.tasks`, each retention fraction of the context (50%, 25%, 15%,
10%) and each policy, the judge's exact-match accuracy over ``--items`` held-out questions per
evaluation seed (seeds 0.. are disjoint from the judge's and the learned policies' training
items), through transformers' ``generate()`` with a kvevict ``PagedCache``
(`kvevict.judge.judge_answers`). The mean and a 95% Student-t interval over the seeds are
reported, and KV bytes next to the fraction. Writes ``tokens_accuracy.json`` and
``tokens_accuracy.png`` under ``--out`` and prints the markdown table.

``--decode`` instead times one decode step of each policy against transformers'
``DynamicCache`` on the judge (same process, interleaved repetitions, median ratio).

``--merge`` combines runs over disjoint ``--policies``; with ``--moe``, it also takes
``benchmarks/routed_vs_uniform.py`` results (one byte budget each) as the rows of ``moe_nd``:
MoE-nD's routed tuples in `RoutedCache`, at their budget's fraction of the full cache's bytes
and the bytes the routing holds. They are neither a learned eviction nor a heuristic one (they
quantize), so the mean table lists them apart from that comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvevict.judge import JUDGE_DIR, budget_for, judge_accuracy, kv_bytes, load_judge
from kvevict.stats import interval
from kvevict.tokens import KVScorer, ScorerShape
from kvevict.tokens.learned import load_scorer
from kvevict.tokens.tasks import TASKS, make_items

FRACTIONS = (0.5, 0.25, 0.15, 0.1)
HEURISTICS = ("streamingllm", "knorm", "h2o", "snapkv", "tova", "ema")
LEARNED = ("lkv_t", "kvp")
#: Head-granular methods (`kvevict.adapters.hf.heads.HeadCache`): each kv head keeps its own
#: tokens; ``ema_heads`` with equal counts per head, ``lkv_h`` with the learned budgets.
HEADS = ("ema_heads", "lkv_h")
#: Every learned method (plotted solid, compared with the best heuristic).
LEARNED_ALL = (*LEARNED, "lkv_h")
#: rows from `benchmarks/routed_vs_uniform.py` (``--merge ... --moe``): eviction and
#: quantization routed per layer, outside the learned-vs-heuristic comparison
QUANTIZED = ("moe_nd",)
#: ``moe_nd``'s routing in the decode cost: 15% of the context per layer on average (layers
#: at 10, 10, 20 and 20%, keys and values at 4 and 8 bits), as in tests/test_tokens_moe_nd_paged.py.
MOE_DECODE_ROUTING = ((0.1, 4, 4), (0.1, 8, 4), (0.2, 8, 8), (0.2, 4, 8))


def head_accuracy(model, items, method: str, fraction: float) -> tuple[float, int]:
    """Exact match and bytes held of a head-granular method (one batch per answer length)."""
    from kvevict.adapters.hf.heads import head_answers

    if method == "ema_heads":
        params = {"scoring": "ema"}
    else:
        path = JUDGE_DIR / "lkv_h.safetensors"
        ranking = load_scorer(JUDGE_DIR / "lkv_h_scorer.safetensors", ScorerShape.of(model),
                              method="lkv_h")  # the ranking LKV-H's budgets were trained over
        params = {"scoring": ranking, "budgets": path if path.is_file() else None}
    answers, held = head_answers(model, items, fraction, **params)
    right = sum(a == it.answer for a, it in zip(answers, items, strict=True))
    return right / len(items), held


def policy_params(name: str, model) -> dict:
    if name in LEARNED:
        path = JUDGE_DIR / f"{name}.safetensors"
        if not path.is_file():  # decode cost only: a seeded random scorer of the right shape
            torch.manual_seed(1)
            return {"scorer": KVScorer(ScorerShape.of(model), per_head=name == "kvp")}
        return {"scorer": path, "shape": ScorerShape.of(model)}
    if name == "lkv_h":  # its per-head ranker and learned budgets, through make_token_policy
        return {"scorer": JUDGE_DIR / "lkv_h_scorer.safetensors",
                "budgets": JUDGE_DIR / "lkv_h.safetensors", "shape": ScorerShape.of(model)}
    if name == "moe_nd":
        return {"routing": MOE_DECODE_ROUTING}
    return {}


def accuracy_grid(model, seeds, items_per_seed, policies, fractions, log=print) -> list[dict]:
    rows = []
    for task in TASKS:
        sets = {s: make_items(task, items_per_seed, length=1024, seed=s) for s in seeds}
        context = len(sets[seeds[0]][0].context)
        full = [judge_accuracy(model, sets[s], None) for s in seeds]
        rows.append({"task": task, "policy": "full", "fraction": 1.0,
                     "bytes": kv_bytes(model, context), "per_seed": full})
        log(f"{task} full {full}")
        for name in [p for p in policies if p not in HEADS]:
            for fraction in fractions:
                acc = [judge_accuracy(model, sets[s], name, fraction=fraction,
                                      **policy_params(name, model)) for s in seeds]
                rows.append({"task": task, "policy": name, "fraction": fraction,
                             "bytes": kv_bytes(model, budget_for(fraction, context)),
                             "per_seed": acc})
                log(f"{task} {name} {fraction} {acc}")
        for name in [p for p in policies if p in HEADS]:
            for fraction in fractions:
                got = [head_accuracy(model, sets[s], name, fraction) for s in seeds]
                rows.append({"task": task, "policy": name, "fraction": fraction,
                             "bytes": max(b for _, b in got), "per_seed": [a for a, _ in got]})
                log(f"{task} {name} {fraction} {[a for a, _ in got]}")
    for r in rows:
        iv = interval(r["per_seed"])
        r["mean"], r["low"], r["high"] = iv.mean, iv.low, iv.high
    return rows


def moe_rows(result: dict) -> list[dict]:
    """The ``moe_nd`` rows of one `benchmarks/routed_vs_uniform.py` result: per task, the
    routed tuples' exact match per evaluation seed, at the budget's fraction of the full
    cache's bytes, with the bytes the routing holds."""
    rows = []
    for r in result["rows"]:
        iv = interval(r["routed"])
        rows.append({"task": r["task"], "policy": "moe_nd",
                     "fraction": round(r["budget_bytes"] / r["full_bytes"], 6),
                     "bytes": r["routed_bytes"], "per_seed": r["routed"],
                     "mean": iv.mean, "low": iv.low, "high": iv.high})
    return rows


def table(rows, fractions) -> str:
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    lines = []
    for task in TASKS:
        full = next(r for r in rows if r["task"] == task and r["policy"] == "full")
        lines.append(f"\n**{task}** (full cache: {100 * full['mean']:.1f}%, "
                     f"{full['bytes'] / 1024:.0f} KiB)\n")
        kib = {f: next(r["bytes"] for r in rows if r["fraction"] == f) / 1024
               for f in fractions}
        head = " | ".join(f"{round(100 * f)}% ({kib[f]:.0f} KiB)" for f in fractions)
        lines += [f"| policy | {head} |", "|---" * (len(fractions) + 1) + "|"]
        for p in policies:
            cells = []
            for f in fractions:
                r = next(r for r in rows if r["task"] == task and r["policy"] == p
                         and r["fraction"] == f)
                half = (r["high"] - r["low"]) / 2
                cells.append(f"{100 * r['mean']:.1f} ± {100 * half:.1f}")
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [mean_table(rows, policies)])


def task_mean(rows, policy: str, fraction: float) -> list[float]:
    """Per evaluation seed, the mean exact match over the three tasks (the full cache for
    ``policy == "full"``)."""
    per_task = [next(r["per_seed"] for r in rows if r["task"] == t and r["policy"] == policy
                     and (policy == "full" or r["fraction"] == fraction)) for t in TASKS]
    return [statistics.fmean(seed) for seed in zip(*per_task, strict=True)]


def mean_table(rows, policies, fraction: float = 0.15) -> str:
    """The mean over the three tasks at ``fraction`` per policy, with a 95% interval over the
    seeds, and the best learned policy minus the best heuristic, paired by seed."""
    lines = [f"\n**Mean over the three tasks at {round(100 * fraction)}%** (95% interval over "
             "the seeds)\n", "| policy | accuracy |", "|---|---|"]
    means = {p: task_mean(rows, p, fraction) for p in ["full", *policies]}
    for p, m in means.items():
        iv = interval(m)
        lines.append(f"| {p} | {100 * iv.mean:.1f} ± {100 * (iv.high - iv.mean):.1f} |")
    learned = [p for p in policies if p in LEARNED_ALL]
    heuristic = [p for p in policies if p not in learned and p not in QUANTIZED]
    if learned and heuristic:
        best_l = max(learned, key=lambda p: statistics.fmean(means[p]))
        best_h = max(heuristic, key=lambda p: statistics.fmean(means[p]))
        diff = interval([a - b for a, b in zip(means[best_l], means[best_h], strict=True)])
        lines.append(f"\nBest learned ({best_l}) minus best heuristic ({best_h}), paired by "
                     f"seed: {100 * diff.mean:+.1f} ± {100 * (diff.high - diff.mean):.1f} "
                     "points.")
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    fig, axes = plt.subplots(1, len(TASKS), figsize=(4.2 * len(TASKS), 4.2), sharey=True)
    for ax, task in zip(axes, TASKS, strict=True):
        full = next(r for r in rows if r["task"] == task and r["policy"] == "full")
        ax.axhline(100 * full["mean"], color="black", lw=1, ls="--", label="full cache")
        for p in policies:
            rs = sorted((r for r in rows if r["task"] == task and r["policy"] == p),
                        key=lambda r: r["bytes"])
            x = [r["bytes"] / 1024 for r in rs]
            y = [100 * r["mean"] for r in rs]
            err = [[100 * (r["mean"] - r["low"]) for r in rs],
                   [100 * (r["high"] - r["mean"]) for r in rs]]
            style = "-o" if p in LEARNED_ALL else ":^" if p in QUANTIZED else "--s"
            color = {"color": "black"} if p in QUANTIZED else {}  # past the 10-colour cycle
            ax.errorbar(x, y, yerr=err, fmt=style, ms=4, capsize=2, label=p, alpha=0.85,
                        **color)
        ax.set_xscale("log")
        ax.set_ylim(-5, 105)  # exact match; an interval past 0 or 100 is cut at the frame
        ax.set_title(task)
        ax.set_xlabel("KV kept (KiB, all layers)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("exact match (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=(len(labels) + 1) // 2, fontsize=8,
               frameon=False)
    fig.suptitle("Judge accuracy vs KV bytes (mean and 95% CI over evaluation seeds; "
                 "solid: learned; dotted: quantized)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)


@torch.no_grad()
def decode_cost(model, policies, fraction: float = 0.15, reps: int = 30) -> dict[str, float]:
    """Median time of one decode step under each policy / under a DynamicCache."""
    from transformers import DynamicCache

    from kvevict.adapters.hf import PagedCache
    from kvevict.adapters.hf.heads import HeadCache, head_attention
    from kvevict.tokens import make_token_policy

    item = make_items("needle", 1, length=1024, seed=0)[0]
    ctx = torch.tensor([item.prompt])
    step_ids = torch.tensor([[item.answer[0]]])

    def timed(make_cache) -> float:
        cache = make_cache()
        if isinstance(cache, HeadCache):  # head-granular: compress after the prefill
            with head_attention(model, cache):
                model(input_ids=ctx, cache=cache, use_cache=True)
                cache.compress()
                model(input_ids=step_ids, cache=cache, use_cache=True)  # warm
                t = time.perf_counter()
                model(input_ids=step_ids, cache=cache, use_cache=True)
                return time.perf_counter() - t
        model(input_ids=ctx, cache=cache, use_cache=True)
        model(input_ids=step_ids, cache=cache, use_cache=True)  # warm
        t = time.perf_counter()
        model(input_ids=step_ids, cache=cache, use_cache=True)
        return time.perf_counter() - t

    makers = {"dynamic": lambda: DynamicCache(config=model.config),
              "paged (no policy)": lambda: PagedCache(model)}
    budget = budget_for(fraction, len(item.prompt))
    for name in policies:
        if name in HEADS:  # context compression once, and the make_token_policy route below
            scoring = "ema" if name == "ema_heads" else "knorm"
            makers[f"HeadCache, {name}"] = lambda s=scoring: HeadCache(model, fraction, scoring=s)
        makers[name] = (lambda n=name: PagedCache(model, token_policy=make_token_policy(
            n, budget=budget, **policy_params(n, model))))
    samples: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(reps):
        for k, make in makers.items():
            samples[k].append(timed(make))
    base = statistics.median(samples["dynamic"])
    return {k: statistics.median(v) / base for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--policies", nargs="+", default=[*HEURISTICS, *LEARNED, *HEADS])
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--random-judge", action="store_true",
                    help="with --decode: a seeded random model of the judge's shape (the cost "
                         "of a step does not depend on the weights)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                    help="combine the tokens_accuracy.json of runs over disjoint --policies "
                         "(e.g. one per core) into --out's JSON, table and PNG, and exit")
    ap.add_argument("--moe", type=Path, nargs="+", metavar="JSON", default=[],
                    help="with --merge: routed_vs_uniform.py results (one budget each) as "
                         "the moe_nd rows")
    args = ap.parse_args(argv)
    if args.merge:
        rows, seen = [], set()
        for path in args.merge:
            for r in json.loads(path.read_text()):
                key = (r["task"], r["policy"], r["fraction"])
                if key not in seen:  # the full cache is in every run
                    seen.add(key)
                    rows.append(r)
        for path in args.moe:
            rows += moe_rows(json.loads(path.read_text()))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokens_accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
        plot(rows, args.out / "tokens_accuracy.png")
        print(table(rows, sorted({r["fraction"] for r in rows if r["policy"] != "full"},
                                 reverse=True)))
        return 0
    torch.set_num_threads(args.threads)
    if args.random_judge:
        from train_judge import judge_config
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(judge_config()).eval()
        model.set_attn_implementation("eager")  # as load_judge loads it
    else:
        model = load_judge()
    if args.decode:
        ratios = decode_cost(model, args.policies)
        print("| cache | decode step / DynamicCache step |\n|---|---|")
        for k, v in ratios.items():
            print(f"| {k} | {v:.2f}x |")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokens_decode.json").write_text(json.dumps(ratios, indent=1) + "\n")
        return 0
    rows = accuracy_grid(model, args.seeds, args.items, args.policies, args.fractions)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokens_accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, args.out / "tokens_accuracy.png")
    print(table(rows, args.fractions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
