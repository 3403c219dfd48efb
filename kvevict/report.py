"""Reports of a policy comparison: the terminal table, PNG plots and the decision record.

The decision record follows the advice of the seed text (``shared/seeds/000``): write the
decision down with the workload, the date and the reason (the measured numbers), say what
headroom is left, and say what should trigger a retest.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvevict.policies.registry import POLICIES, is_offline

__all__ = ["choose_policy", "decision_record", "explain_choice", "format_table",
           "plot_hit_ratio", "plot_ttft_cdf"]

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("token hit", "token_hit_ratio", "{:.3f}"),
    ("block hit", "block_hit_ratio", "{:.3f}"),
    ("recomputed tok", "recomputed_prefill_tokens", "{:,}"),
    ("TTFT p50 s", "ttft_p50", "{:.3f}"),
    ("TTFT p95 s", "ttft_p95", "{:.3f}"),
    ("TTFT p99 s", "ttft_p99", "{:.3f}"),
    ("wait p95 s", "queue_wait_p95", "{:.3f}"),
    ("evictions", "evictions", "{:,}"),
    ("preempt", "preemptions", "{:,}"),
)


def format_table(summaries: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    """One row per policy summary (`SimResult.summary`)."""
    header = [c[0] for c in TABLE_COLUMNS]
    rows = [[fmt.format(s[key]) for _, key, fmt in TABLE_COLUMNS] for s in summaries]
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) if i else h.ljust(w)
                     for i, (h, w) in enumerate(zip(header, widths, strict=True)))]
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    return "\n".join(out)


def choose_policy(summaries: Sequence[dict[str, Any]], tie: float = 0.01) -> dict[str, Any]:
    """The online policy to run: the lowest p95 TTFT (the number a chat server's users feel);
    p95s within ``tie`` (relative, or 5 ms) of the best count as equal, and among those the
    fewest recomputed prefill tokens wins, then LRU (the engines' default), then the name.
    An offline policy (Belady: `kvevict.policies.registry.is_offline`) is never chosen."""
    online = _online(summaries)
    if not online:
        raise ValueError("no online policy to choose from")
    best = min(s["ttft_p95"] for s in online)
    close = [s for s in online if s["ttft_p95"] <= best + max(best * tie, 0.005)]
    return min(close, key=lambda s: (s["recomputed_prefill_tokens"], s["policy"] != "lru",
                                     s["policy"]))


def explain_choice(summaries: Sequence[dict[str, Any]],
                   tie: float = 0.01) -> tuple[dict[str, Any], str]:
    """`choose_policy` and the reason in one line: the lowest p95 TTFT, or a tie with the
    lowest broken by fewer recomputed prefill tokens (the numbers are in the text)."""
    chosen = choose_policy(summaries, tie)
    fastest = min(_online(summaries),
                  key=lambda s: (s["ttft_p95"], s["policy"] != "lru", s["policy"]))
    if chosen["ttft_p95"] <= fastest["ttft_p95"]:
        return chosen, f"lowest p95 TTFT {chosen['ttft_p95']:.3f} s"
    return chosen, (f"p95 TTFT {chosen['ttft_p95']:.3f} s, a tie with the lowest "
                    f"({fastest['policy']} {fastest['ttft_p95']:.3f} s), and fewer recomputed "
                    f"prefill tokens ({chosen['recomputed_prefill_tokens']:,} vs "
                    f"{fastest['recomputed_prefill_tokens']:,})")


def _online(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summaries of online policies (labels that are not offline policies' names)."""
    return [s for s in summaries if not is_offline(s["policy"])]


def decision_record(summaries: Sequence[dict[str, Any]], *, workload: str, model: str,
                    layout_desc: str, capacity_desc: str, seed: int, command: str,
                    sweep: Sequence[dict[str, Any]] = (),
                    date: _dt.date | None = None) -> str:
    """The decision in Markdown: what was measured, what is chosen and why, the headroom left,
    and what should trigger a retest."""
    date = date or _dt.date.today()
    chosen = choose_policy(summaries)
    lru = next((s for s in summaries if s["policy"] == "lru"), None)
    oracle = next((s for s in summaries if is_offline(s["policy"])), None)
    lines = [
        f"# KV-cache eviction decision: {workload}",
        "",
        f"- **Date:** {date.isoformat()}",
        f"- **Workload:** `{workload}` (seed {seed}), {chosen['requests']} requests",
        f"- **Model and sizes:** {model}: {layout_desc}",
        f"- **Cache:** {capacity_desc}",
        f"- **Command:** `{command}`",
        "",
        f"## Decision: run `{chosen['policy']}`",
        "",
    ]
    why = [f"Its p95 time to first token is {chosen['ttft_p95']:.3f} s (p50 "
           f"{chosen['ttft_p50']:.3f} s), the lowest measured (p95s within 1% count as "
           f"equal), and among those it recomputes the fewest prefill tokens, "
           f"{chosen['recomputed_prefill_tokens']:,}, at a token hit ratio of "
           f"{chosen['token_hit_ratio']:.3f}."]
    if lru is not None and chosen["policy"] != "lru":
        d95 = lru["ttft_p95"] - chosen["ttft_p95"]
        dre = lru["recomputed_prefill_tokens"] - chosen["recomputed_prefill_tokens"]
        why.append(f"Against LRU (the serving engines' default) it changes p95 TTFT by "
                   f"{-d95:+.3f} s ({lru['ttft_p95']:.3f} s to {chosen['ttft_p95']:.3f} s) "
                   f"and recomputes {dre:,} fewer prefill tokens.")
    elif lru is not None:
        others = [s for s in _online(summaries) if s["policy"] != "lru"]
        if others:
            runner = min(others, key=lambda s: (s["ttft_p95"],
                                                s["recomputed_prefill_tokens"]))
            why.append(f"No workload-aware policy beat LRU here (the best other, "
                       f"`{runner['policy']}`, has p95 TTFT {runner['ttft_p95']:.3f} s and "
                       f"recomputes {runner['recomputed_prefill_tokens']:,} tokens): keep "
                       "the default until the workload changes.")
    lines += why + ["", "## Measured", "", format_table(summaries, markdown=True), ""]
    lines += ["## Headroom", ""]
    if oracle is not None:
        gap = oracle["token_hit_ratio"] - chosen["token_hit_ratio"]
        lines.append(f"- The offline oracle ({POLICIES.get(oracle['policy']).__name__}) "
                     f"reaches a token hit ratio of {oracle['token_hit_ratio']:.3f}; "
                     f"{gap:.3f} is left on the table for any online policy at this size.")
    lines.append(f"- An infinite cache would hit {chosen['infinite_cache_hit_ratio']:.3f} of "
                 "prompt tokens: the rest is compulsory.")
    lines.append(f"- Peak blocks in use: {chosen['peak_blocks']:,} of the pool; "
                 f"{chosen['preemptions']} preemptions and p95 queue wait "
                 f"{chosen['queue_wait_p95']:.3f} s. Keep spare memory for prompt variance "
                 "and spare queue capacity so a batch job cannot starve an interactive user.")
    if sweep:
        lines += ["", "Hit ratio by cache size (token hit ratio):", ""]
        caps = sorted({s["capacity_blocks"] for s in sweep})
        pols = list(dict.fromkeys(s["policy"] for s in sweep))
        lines.append("| policy | " + " | ".join(f"{c:,} blocks" for c in caps) + " |")
        lines.append("|---|" + "|".join("---:" for _ in caps) + "|")
        for p in pols:
            vals = {s["capacity_blocks"]: s["token_hit_ratio"] for s in sweep
                    if s["policy"] == p}
            lines.append(f"| {p} | " + " | ".join(f"{vals.get(c, float('nan')):.3f}"
                                                    for c in caps) + " |")
    lines += [
        "", "## Retest when", "",
        "- a new model family (another KV size per token, another prefill speed);",
        "- longer contexts than this workload's (a larger share of the cache per session);",
        "- another team or application on the box (a new workload mix);",
        "- a driver, CUDA or engine update (the cost model behind these latencies);",
        "- users report slow first tokens that these numbers do not predict.",
        "",
        "Simulated with kvevict's scheduler and a cost model (`kvevict.cost.CostModel`, "
        "defaults from published H100 figures); fit its fields to your own engine before "
        "trusting absolute latencies.",
        "",
    ]
    return "\n".join(lines)


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('plots need matplotlib: pip install "kvevict[plot]"') from exc
    return plt


def _finish(plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str,
            ylabel: str) -> None:
    """Label, save (no timestamp metadata, so files are reproducible) and close a plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_hit_ratio(sweep: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Token hit ratio against cache size, one line per policy; the offline oracle (Belady)
    dashed as the ceiling."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pols = list(dict.fromkeys(s["policy"] for s in sweep))
    for p in pols:
        pts = sorted((s["capacity_blocks"], s["token_hit_ratio"]) for s in sweep
                     if s["policy"] == p)
        style = {"linestyle": "--", "color": "black"} if is_offline(p) else {"marker": "o"}
        ax.plot([x for x, _ in pts], [y for _, y in pts], label=p, **style)
    inf = max((s["infinite_cache_hit_ratio"] for s in sweep), default=None)
    if inf is not None:
        ax.axhline(inf, color="grey", linewidth=0.8, linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    _finish(plt, fig, ax, path, title, "cache size (blocks)", "token hit ratio")


def plot_ttft_cdf(ttfts: dict[str, Sequence[float]], path: Path, title: str) -> None:
    """Empirical CDF of time to first token, one line per policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, values in ttfts.items():
        xs = sorted(values)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        style = {"linestyle": "--", "color": "black"} if is_offline(p) else {}
        ax.step(xs, ys, where="post", label=p, **style)
    ax.set_xscale("symlog", linthresh=0.01)
    _finish(plt, fig, ax, path, title, "time to first token (s)", "fraction of requests")
