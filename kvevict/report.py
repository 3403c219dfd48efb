"""Reports of a policy comparison over seeds: tables with confidence intervals, the decision,
PNG plots and the decision record.

The input is a list of *cells*: one simulation's `kvevict.run.SimResult.summary` plus
``"seed"`` (one cell per policy × cache size × seed), and the run's offered load
``{"rho": float, "stable": bool, "rate_scale": float}``. `kvevict.stats.aggregate` turns the
cells into rows of `kvevict.stats.Interval` (mean ± 95% CI over the seeds); the tables print
them, and `choose_policy` compares every online policy with LRU by the paired per-seed
difference (see its docstring, and ``docs/statistics.md``, for the exact rule).

The decision record follows the advice of the seed text (``shared/seeds/000``): write the
decision down with the workload, the date and the reason (the measured numbers), say what
headroom is left, and say what should trigger a retest.

Plots need matplotlib (``pip install "kvevict[plot]"``); it is imported only when a plot is
drawn, so this module imports without it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvevict.errors import ConfigError
from kvevict.policies.registry import is_offline
from kvevict.stats import Interval, aggregate, paired

__all__ = ["Choice", "choose_policy", "class_p95_figure", "comparison_figure",
           "decision_record", "explain_choice", "format_class_table", "format_table",
           "hit_ratio_figure", "is_unstable", "plot_class_p95", "plot_comparison",
           "plot_hit_ratio", "plot_replay", "plot_ttft_cdf", "policy_label", "policy_style",
           "replay_figure", "size_label", "ttft_cdf_figure"]

#: The terminal and Markdown table: ``(header, key, format spec, shown when no row has it)``.
#: Columns whose key no row holds and that are not always shown (the TTFT decomposition and
#: the resume counter, which newer summaries add) are left out.
TABLE_COLUMNS: tuple[tuple[str, str, str, bool], ...] = (
    ("token hit", "token_hit_ratio", ".3f", True),
    ("block hit", "block_hit_ratio", ".3f", True),
    ("resume hit", "resume_block_hit_ratio", ".3f", False),
    ("recomputed tok", "recomputed_prefill_tokens", ",.0f", True),
    ("TTFT p50 s", "ttft_p50", ".3f", True),
    ("TTFT p95 s", "ttft_p95", ".3f", True),
    ("TTFT p99 s", "ttft_p99", ".3f", True),
    ("wait p95 s", "queue_wait_p95", ".3f", True),
    ("evictions", "evictions", ",.0f", True),
    ("preempt", "preemptions", ",.0f", True),
)

#: The TTFT decomposition (`decision_record`'s second table): waiting for memory, waiting for
#: compute, prefill of recomputed tokens, each at p50/p95/p99.
DECOMPOSITION_COLUMNS: tuple[tuple[str, str, str, bool], ...] = tuple(
    (f"{what} p{q} s", f"{key}_p{q}", ".3f", False)
    for what, key in (("mem wait", "wait_memory"), ("compute wait", "wait_compute"),
                      ("recompute", "recompute_prefill_s"))
    for q in (50, 95, 99)
)

#: How the decision's metrics read in text: ``key: (name, format spec, unit)``.
METRIC_TEXT: dict[str, tuple[str, str, str]] = {
    "ttft_p50": ("p50 TTFT", ".3f", " s"),
    "ttft_p95": ("p95 TTFT", ".3f", " s"),
    "ttft_p99": ("p99 TTFT", ".3f", " s"),
    "recomputed_prefill_tokens": ("recomputed prefill tokens", ",.0f", ""),
    "token_hit_ratio": ("token hit ratio", ".3f", ""),
    "block_hit_ratio": ("block hit ratio", ".3f", ""),
    "prefill_saved_ratio": ("share of prefill compute saved", ".3f", ""),
}

#: The mark on latency columns of a run whose offered load is unstable (ρ ≥ 1).
UNSTABLE_MARK = "†"
#: The mark on an offline policy measured in the timed simulator (an approximation).
APPROX_SUFFIX = " (approx.)"


def _higher_is_better(metric: str) -> bool:
    return "hit_ratio" in metric or metric.startswith("throughput") or metric.endswith("_per_s")


def _is_latency(key: str) -> bool:
    return key.startswith(("ttft", "queue_wait", "wait_", "recompute_prefill_s"))


def _metric_text(metric: str) -> tuple[str, str, str]:
    return METRIC_TEXT.get(metric, (metric, ".4g", ""))


# -- load -----------------------------------------------------------------------------------------

def is_unstable(load: Mapping[str, Any] | None) -> bool:
    """Whether the offered load is unstable: ``load["rho"] >= 1`` or ``load["stable"]`` is
    false. Then the queue grows without bound and latencies are not steady state. ``None`` (no
    load given) counts as stable."""
    if load is None:
        return False
    rho = load.get("rho")
    if isinstance(rho, (int, float)) and not isinstance(rho, bool) and rho >= 1:
        return True
    return load.get("stable") is False


def _load_text(load: Mapping[str, Any]) -> str:
    parts = []
    rho = load.get("rho")
    if isinstance(rho, (int, float)):
        parts.append(f"ρ = {rho:.2f}")
    scale = load.get("rate_scale")
    if isinstance(scale, (int, float)):
        parts.append(f"rate scale {scale:g}")
    measured = load.get("measured_load")
    if isinstance(measured, (int, float)):
        parts.append(f"measured load {measured:.2f} (its own work per second of arrivals, the "
                     "worst online policy and seed)")
    if parts:
        return ", ".join(parts)
    return "marked unstable" if load.get("stable") is False else "ρ not given"


def _unstable_note(load: Mapping[str, Any] | None) -> str:
    rho = None if load is None else load.get("rho")
    measured = None if load is None else load.get("measured_load")
    if isinstance(rho, (int, float)) and rho >= 1:
        what = f"offered load ρ = {rho:.2f} ≥ 1"
    elif isinstance(measured, (int, float)) and measured >= 1:
        what = f"measured load {measured:.2f} ≥ 1 (this cache's misses overload the box)"
    else:
        what = "the offered load is marked unstable"
    return (f"{UNSTABLE_MARK} {what}: the queue grows without bound; these latencies are not "
            "steady state")


# -- policies: labels and plot styles --------------------------------------------------------------

def policy_label(policy: str) -> str:
    """The name a table or plot shows: an offline policy measured in the timed simulator gets
    ``" (approx.)"``: it sees the requests as the scheduler delays them, so it approximates the
    oracle and is not a bound (the exact oracle is the untimed replay, `kvevict.replay`)."""
    return f"{policy}{APPROX_SUFFIX}" if is_offline(policy) else policy


#: Fixed colours and markers of the built-in policies (matplotlib's ``tab10`` colours), so a
#: policy looks the same in every plot of every run.
POLICY_STYLES: dict[str, tuple[str, str]] = {
    "lru": ("#1f77b4", "o"),
    "lfu": ("#ff7f0e", "s"),
    "pinned": ("#2ca02c", "^"),
    "market": ("#d62728", "D"),
    "bayes": ("#9467bd", "v"),
    "dbms": ("#8c564b", "P"),
    "belady": ("#000000", "*"),
    "reuse-oracle": ("#3c5488", "p"),
    "horizon-oracle": ("#00a087", "h"),
    "learned": ("#e7298a", "X"),
    "s3fifo": ("#17becf", "<"),
    "arc": ("#bcbd22", ">"),
    "gdsf": ("#7f7f7f", "d"),
    "slru": ("#a6761d", "8"),
    "2q": ("#66a61e", "H"),
}
#: Colours for other names, disjoint from the fixed ones, and markers; a name picks one of
#: each by its SHA-256 digest (the same in every process, unlike Python's ``hash``).
PALETTE: tuple[str, ...] = ("#e377c2", "#d95f02", "#7570b3", "#393b79", "#637939")
MARKERS: tuple[str, ...] = ("X", "h", "<", ">", "p", "d", "8", "H")


def policy_style(policy: str) -> dict[str, str]:
    """The plot style of ``policy``: ``{"color", "marker", "linestyle"}``. Built-in names have
    fixed entries (`POLICY_STYLES`); any other name hashes (SHA-256 of its UTF-8 bytes) to a
    colour of `PALETTE` and a marker of `MARKERS`. An offline policy measured in the timed
    simulator (an approximation) is dotted with hollow markers; the exact replay's oracle,
    which `plot_hit_ratio` draws from its ``exact`` argument, is dashed with filled ones."""
    if policy in POLICY_STYLES:
        color, marker = POLICY_STYLES[policy]
    else:
        digest = hashlib.sha256(policy.encode("utf-8")).digest()
        color = PALETTE[digest[0] % len(PALETTE)]
        marker = MARKERS[digest[1] % len(MARKERS)]
    return {"color": color, "marker": marker,
            "linestyle": ":" if is_offline(policy) else "-"}


# -- tables ---------------------------------------------------------------------------------------

def _rows(rows_or_cells: Sequence[Mapping[str, Any]],
          confidence: float = 0.95) -> list[dict[str, Any]]:
    """Aggregated rows: ``rows_or_cells`` as is when it holds `aggregate`'s rows (they carry
    ``"seeds"``), else aggregated."""
    items = list(rows_or_cells)
    if items and all("seeds" in r for r in items):
        return [dict(r) for r in items]
    return aggregate(items, confidence)


def _cell(value: Any, spec: str, single: bool = False, seeds: int | None = None) -> str:
    """A table cell: an `Interval` as mean ± half, or only its mean when the whole table is
    one seed (``single``: a note says so once instead of ``(1 seed)`` in every cell). An
    interval over fewer than the row's ``seeds`` (a value undefined on the other seeds) says
    over how many: ``0.834 (1 of 5 seeds)``."""
    if isinstance(value, Interval):
        if seeds is not None and value.n < seeds:
            shown = format(value, spec) if value.known else format(value.mean, spec)
            return f"{shown} ({value.n} of {seeds} seeds)"
        return format(value.mean, spec) if single and value.n == 1 else format(value, spec)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return "-"


def _render(header: list[str], rows: list[list[str]], markdown: bool) -> str:
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


#: The note under a table of single runs.
ONE_SEED_NOTE = "1 seed: single runs, no confidence interval (run more seeds for one)"


def _single(rows: list[dict[str, Any]]) -> bool:
    return all(r["seeds"] == 1 for r in rows)


def _footer(rows: list[dict[str, Any]], unstable: bool, load: Mapping[str, Any] | None,
            latency_shown: bool) -> list[str]:
    notes = [ONE_SEED_NOTE] if _single(rows) else []
    if unstable and latency_shown:
        notes.append(_unstable_note(load))
    if any(is_offline(r["policy"]) for r in rows):
        notes.append(f"{APPROX_SUFFIX.strip()}: an offline policy in the timed simulator sees "
                     "requests as the scheduler delays them; an approximation, not a bound")
    return notes


def format_table(rows: Sequence[Mapping[str, Any]], markdown: bool = False, *,
                 load: Mapping[str, Any] | None = None,
                 columns: Sequence[tuple[str, str, str, bool]] = TABLE_COLUMNS,
                 notes: bool = True) -> str:
    """One line per (policy, cache size): every column as mean ± 95% CI over the seeds.

    ``rows`` are `kvevict.stats.aggregate`'s rows, or cells (summaries with ``"seed"``), which
    are aggregated first. A ``blocks`` column appears when the rows hold several cache sizes,
    a ``seeds`` column when they hold different numbers of seeds. When every row is one
    seed, the cells show the means alone and a note says there is no interval. When the load
    is unstable (`is_unstable`, or a row whose ``"stable"`` is false), the latency headers
    carry ``†`` and a note under the table says why. Offline policies are labelled
    ``(approx.)`` (`policy_label`), with a note (``notes=False`` leaves the notes out, for a
    second table under the first). ``columns``: ``(header, key, format spec, always
    shown)``; a column that is not always shown appears when some row holds its key.
    """
    rows_ = _rows(rows)
    if not rows_:
        raise ConfigError("format_table needs at least one row")
    unstable = is_unstable(load) or any(r.get("stable") is False for r in rows_)
    shown = [c for c in columns if c[3] or any(c[1] in r for r in rows_)]
    header = ["policy"]
    several_sizes = len({r["capacity_blocks"] for r in rows_}) > 1
    several_n = len({r["seeds"] for r in rows_}) > 1
    single = _single(rows_)
    if several_sizes:
        header.append("blocks")
    if several_n:
        header.append("seeds")
    header += [h + (UNSTABLE_MARK if unstable and _is_latency(key) else "")
               for h, key, _, _ in shown]
    lines = []
    for r in rows_:
        line = [policy_label(r["policy"])]
        if several_sizes:
            line.append(f"{r['capacity_blocks']:,}")
        if several_n:
            line.append(str(r["seeds"]))
        line += [_cell(r.get(key), spec, single, r["seeds"]) for _, key, spec, _ in shown]
        lines.append(line)
    text = _render(header, lines, markdown)
    return text + _notes(_footer(rows_, unstable, load, any(_is_latency(c[1]) for c in shown))
                         if notes else [], markdown)


def _notes(notes: list[str], markdown: bool) -> str:
    if not notes:
        return ""
    return "\n\n" + "\n\n".join(notes) if markdown else "\n" + "\n".join(notes)


def _classes(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(c for r in rows for c in (r.get("classes") or {})))


def format_class_table(rows: Sequence[Mapping[str, Any]], metric: str = "ttft_p95",
                       markdown: bool = False, *, spec: str | None = None,
                       load: Mapping[str, Any] | None = None, notes: bool = True) -> str:
    """Per workload class: one line per (policy, cache size), one column per class, each
    ``metric`` of that class (``"ttft_p95"`` by default; any key of the summaries'
    ``"classes"`` entries) as mean ± 95% CI. A class's header carries its request count per
    seed (the mean over seeds, from the first row that has it). An unstable load marks a
    latency metric's headers with ``†`` and notes why (``notes=False``: no notes).

    This is where an interactive user starved by a batch job shows: the chat column's p95
    next to the batch column's.
    """
    rows_ = _rows(rows)
    classes = _classes(rows_)
    if not classes:
        raise ConfigError("no row has per-class results (a 'classes' entry); the summaries "
                          "predate per-class metrics")
    spec = spec or _metric_text(metric)[1]
    single = _single(rows_)
    unstable = (is_unstable(load) or any(r.get("stable") is False for r in rows_)) \
        and _is_latency(metric)
    header = ["policy"]
    several_sizes = len({r["capacity_blocks"] for r in rows_}) > 1
    if several_sizes:
        header.append("blocks")
    for c in classes:
        n = next((r["classes"][c].get("requests") for r in rows_
                  if c in (r.get("classes") or {}) and "requests" in r["classes"][c]), None)
        count = f" ({n.mean:,.0f} req)" if isinstance(n, Interval) else ""
        header.append(f"{c}{count}{UNSTABLE_MARK if unstable else ''}")
    lines = []
    for r in rows_:
        line = [policy_label(r["policy"])]
        if several_sizes:
            line.append(f"{r['capacity_blocks']:,}")
        for c in classes:
            line.append(_cell((r.get("classes") or {}).get(c, {}).get(metric), spec, single))
        lines.append(line)
    text = f"{_metric_text(metric)[0]} by class\n" if not markdown else ""
    text += _render(header, lines, markdown)
    return text + _notes(_footer(rows_, unstable, load, True) if notes else [], markdown)


# -- the decision ---------------------------------------------------------------------------------

@attrs.frozen
class Choice:
    """What `choose_policy` decided and why.

    ``difference`` is the paired per-seed interval of ``metric`` (policy minus LRU) for the
    chosen policy; when LRU is kept, for the policy with the best mean difference (``versus``
    names it), or ``None`` when LRU is the only online policy. ``comparisons`` holds every
    other online policy's paired interval against LRU, in the order of the cells.
    """

    policy: str
    reason: str
    significant: bool
    metric: str
    difference: Interval | None
    versus: str | None
    comparisons: tuple[tuple[str, Interval], ...]
    latency_decision: bool
    seeds: int
    capacity_blocks: int


def _capacity(cells: Sequence[Mapping[str, Any]], capacity_blocks: int | None) -> int:
    caps = list(dict.fromkeys(c["capacity_blocks"] for c in cells))
    if capacity_blocks is None:
        if len(caps) != 1:
            raise ConfigError(f"the cells hold several cache sizes ({', '.join(map(str, caps))} "
                              "blocks); pass capacity_blocks= for the size to decide at")
        return caps[0]
    if capacity_blocks not in caps:
        raise ConfigError(f"no cell at {capacity_blocks} blocks; the cells hold "
                          f"{', '.join(map(str, caps))}")
    return capacity_blocks


def _by_seed(cells: Sequence[Mapping[str, Any]], policy: str, capacity: int,
             metric: str) -> dict[Any, float]:
    out = {}
    for c in cells:
        if c["policy"] == policy and c["capacity_blocks"] == capacity:
            if metric not in c:
                raise ConfigError(f"the cell of {policy!r} at {capacity} blocks, seed "
                                  f"{c['seed']!r}, has no {metric!r}")
            out[c["seed"]] = c[metric]
    return out


def _better(d: Interval, higher: bool) -> bool:
    return d.known and (d.low > 0 if higher else d.high < 0)


def _worse(d: Interval, higher: bool) -> bool:
    return d.known and (d.high < 0 if higher else d.low > 0)


def choose_policy(cells: Sequence[Mapping[str, Any]], *, load: Mapping[str, Any] | None = None,
                  capacity_blocks: int | None = None, metric: str = "ttft_p95",
                  unstable_metric: str = "recomputed_prefill_tokens", baseline: str = "lru",
                  confidence: float = 0.95, replicate: str = "seed") -> Choice:
    """The online policy to run, chosen against LRU (the serving engines' default) by the
    paired per-seed difference. The rule, exactly (``docs/statistics.md`` states the same):

    1. Only online policies are candidates: an offline one (`is_offline`: Belady) is never
       chosen. LRU (``baseline``) must be among the cells.
    2. The metric is p95 TTFT (``metric``), lower is better. When the load is unstable
       (`is_unstable`: ρ ≥ 1), no latency-based decision is made: the metric is recomputed
       prefill tokens (``unstable_metric``), lower is better. (A metric whose name holds
       ``hit_ratio`` is higher-is-better.)
    3. For every other candidate P, the paired interval of ``metric(P) - metric(LRU)`` over
       the seeds at the decision's cache size (`kvevict.stats.paired`; both must have the same
       seeds). P is *significantly better* when that interval is known (two seeds or more)
       and lies entirely on P's side of 0: its upper end is below 0 (above 0 for
       higher-is-better). An interval that touches 0 is not significant.
    4. If some policies are significantly better, the one with the best mean difference wins;
       an exact tie goes to the smaller half-width, then to the alphabetically first name.
    5. Otherwise LRU is kept: "no significant difference: keep LRU (the simplest)" when no
       policy differs significantly, "no policy is significantly better than LRU: keep LRU
       (the simplest)" when some are significantly worse. With one seed no interval is known,
       so no policy can be shown better: LRU is kept and the reason says to run more seeds.

    ``capacity_blocks`` is the cache size to decide at (needed when the cells hold several).
    ``replicate`` names what a cell's ``"seed"`` stands for in the reason's words (``"seed"``;
    ``kvevict engine-bench`` pairs repeated runs of one workload: ``"repeat"``).

    Raises:
        ConfigError: no online policy, no LRU cells, several sizes and no ``capacity_blocks``,
            a cell without the metric, or policies measured on different seeds.
    """
    if not cells:
        raise ConfigError("no online policy to choose from: no cells")
    aggregate(cells, confidence)  # checks the cells' keys and duplicate seeds
    capacity = _capacity(cells, capacity_blocks)
    at_size = [c for c in cells if c["capacity_blocks"] == capacity]
    online = list(dict.fromkeys(c["policy"] for c in at_size if not is_offline(c["policy"])))
    if not online:
        raise ConfigError("no online policy to choose from (offline policies such as Belady "
                          "are bounds, never chosen)")
    if baseline not in online:
        raise ConfigError(f"the decision compares every policy with {baseline} (the serving "
                          f"engines' default), but there are no {baseline} cells at {capacity} "
                          f"blocks; measured: {', '.join(online)}")
    unstable = is_unstable(load)
    used = unstable_metric if unstable else metric
    higher = _higher_is_better(used)
    name, spec, unit = _metric_text(used)
    base = _by_seed(at_size, baseline, capacity, used)
    seeds = len(base)
    comparisons = tuple((p, paired(_by_seed(at_size, p, capacity, used), base, confidence))
                        for p in online if p != baseline)
    prefix = ""
    if unstable:
        prefix = (f"the offered load is unstable ({_load_text(load or {})}): the queue grows "
                  f"without bound and latencies are not steady state, so no latency-based "
                  f"decision is made; decided on {name} instead; ")

    def choice(policy: str, reason: str, significant: bool, d: Interval | None,
               versus: str | None) -> Choice:
        return Choice(policy, prefix + reason, significant, used, d, versus, comparisons,
                      not unstable, seeds, capacity)

    if not comparisons:
        return choice(baseline, f"{baseline} is the only online policy measured: nothing to "
                      f"compare it with; keep {baseline.upper()}", False, None, None)
    sign = -1.0 if higher else 1.0  # smaller key = better mean difference
    best = min(comparisons, key=lambda pc: (sign * pc[1].mean, pc[0]))
    conf = f"{confidence:.0%}"
    per, many = f"per-{replicate}", f"{seeds} {replicate}s"
    if seeds < 2:
        return choice(baseline, (
            f"1 {replicate}: the interval is unknown, so no significance can be claimed and no "
            f"policy can be shown better than {baseline.upper()}: keep {baseline.upper()} (the "
            f"simplest); run more {replicate}s (e.g. --{replicate}s 5). Best point estimate "
            f"of {name}: "
            f"{best[0]} - {baseline} = {best[1].mean:{spec}}{unit}"), False, best[1], best[0])
    better = [(p, d) for p, d in comparisons if _better(d, higher)]
    if better:
        p, d = min(better, key=lambda pc: (sign * pc[1].mean, pc[1].half, pc[0]))
        others = (f"; the best mean of the {len(better)} policies significantly better than "
                  f"{baseline}") if len(better) > 1 else ""
        direction = ("raises" if higher else "lowers")
        return choice(p, (
            f"{p} {direction} {name} against {baseline}: paired {per} difference "
            f"{d:{spec}}{unit} over {many}, whose {conf} interval excludes 0"
            f"{others}"), True, d, p)
    worse = [p for p, d in comparisons if _worse(d, higher)]
    head = (f"no policy is significantly better than {baseline.upper()}"
            if worse else "no significant difference")
    return choice(baseline, (
        f"{head}: keep {baseline.upper()} (the simplest); no policy's {name} advantage over "
        f"{baseline} is beyond the {conf} interval of the paired {per} difference over "
        f"{many} (best: {best[0]} - {baseline} = {best[1]:{spec}}{unit})"), False,
        best[1], best[0])


def explain_choice(choice: Choice, baseline: str = "lru", replicate: str = "seed") -> str:
    """Every compared policy's paired difference against LRU, one line each, with its verdict
    (better, worse, no significant difference, or unknown with one seed): the evidence behind
    ``choice.reason``. ``replicate`` as in `choose_policy`."""
    name, spec, unit = _metric_text(choice.metric)
    higher = _higher_is_better(choice.metric)
    lines = [f"{name}, paired per-{replicate} difference against {baseline} "
             f"({choice.seeds} {replicate}{'s' if choice.seeds != 1 else ''}, "
             f"{choice.capacity_blocks:,} blocks):"]
    for p, d in choice.comparisons:
        if not d.known:
            verdict = f"unknown (1 {replicate})"
        elif _better(d, higher):
            verdict = "better"
        elif _worse(d, higher):
            verdict = "worse"
        else:
            verdict = "no significant difference"
        mark = " (chosen)" if p == choice.policy else ""
        lines.append(f"- {p} - {baseline}: {d:{spec}}{unit}: {verdict}{mark}")
    if not choice.comparisons:
        lines.append(f"- {baseline} only")
    return "\n".join(lines)


# -- the decision record --------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (Interval, int, float)) else str(value)


def _mean(value: Any) -> float:
    return value.mean if isinstance(value, Interval) else float(value)


def _class_note(row: Mapping[str, Any], metric: str = "ttft_p95") -> str | None:
    """The slowest and fastest class of ``row`` at ``metric``, and a plain warning when an
    interactive class (any but ``batch``) waits at least as long as ``batch``."""
    classes = row.get("classes") or {}
    vals = {c: d[metric] for c, d in classes.items()
            if isinstance(d, Mapping) and isinstance(d.get(metric), Interval)}
    if len(vals) < 2:
        return None
    slow = max(vals, key=lambda c: vals[c].mean)
    fast = min(vals, key=lambda c: vals[c].mean)
    text = (f"At `{row['policy']}` the slowest class is `{slow}` (p95 TTFT {vals[slow]} s), "
            f"the fastest `{fast}` ({vals[fast]} s).")
    batch = vals.get("batch")
    if batch is not None:
        starved = [c for c, v in vals.items() if c != "batch" and v.mean >= batch.mean]
        if starved:
            text += (f" **Interactive traffic ({', '.join(f'`{c}`' for c in starved)}) waits "
                     "at least as long as the batch class at p95: a batch job is starving "
                     "interactive users. Give them priority or their own capacity.**")
    return text


def _headroom_lines(headroom: Mapping[str, Any] | None, chosen: str,
                    rows: list[dict[str, Any]], metric_name: str) -> list[str]:
    lines = []
    chosen_row = next(r for r in rows if r["policy"] == chosen)
    timed = [r for r in rows if is_offline(r["policy"])]
    if headroom is not None and "belady_exact" in headroom:
        exact = headroom["belady_exact"]
        ref = chosen if chosen in headroom else ("lru" if "lru" in headroom else None)
        text = (f"- The exact offline oracle (Belady in the untimed replay of the same "
                f"requests, `kvevict.replay`) reaches a {metric_name} of {_fmt(exact, '.3f')}")
        if ref is not None:
            gap = _mean(exact) - _mean(headroom[ref])
            text += (f"; `{ref}` reaches {_fmt(headroom[ref], '.3f')} in the same replay: "
                     f"{gap:.3f} (a difference of means) is left on the table for any online "
                     "policy at this size.")
        else:
            text += "."
        lines.append(text)
        if timed:
            lines.append(f"- The timed {', '.join(policy_label(r['policy']) for r in timed)} "
                         "in the tables is an approximation (it sees the requests as the "
                         "scheduler delays them), not this bound.")
    elif timed:
        t = timed[0]
        hit = t.get("token_hit_ratio")
        reaches = f" reaches a token hit ratio of {_fmt(hit, '.3f')}, but it" if hit is not None \
            else ""
        lines.append(f"- No exact-oracle replay was given. The timed "
                     f"{policy_label(t['policy'])}{reaches} sees the requests as the scheduler "
                     "delays them: an approximation, not a bound; do not read the gap to it as "
                     "the headroom.")
    if headroom is not None and "infinite" in headroom:
        inf = headroom["infinite"]
    else:
        inf = chosen_row.get("infinite_cache_hit_ratio")
    if inf is not None:
        lines.append(f"- An infinite cache would hit {_fmt(inf, '.3f')} of prompt tokens: the "
                     "rest is compulsory.")
    if all(k in chosen_row for k in ("peak_blocks", "preemptions", "queue_wait_p95")):
        lines.append(f"- Peak blocks in use at `{chosen}`: {chosen_row['peak_blocks']:,.0f} "
                     f"of the pool; {chosen_row['preemptions']:,.0f} preemptions and p95 queue "
                     f"wait {chosen_row['queue_wait_p95']} s. Keep spare memory for prompt "
                     "variance and spare queue capacity so a batch job cannot starve an "
                     "interactive user.")
    return lines


def _size_table(rows: list[dict[str, Any]], metric: str) -> list[str]:
    caps = sorted({r["capacity_blocks"] for r in rows})
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["policy"], r["capacity_blocks"]): r for r in rows}
    single = _single(rows)
    lines = ["| policy | " + " | ".join(f"{c:,} blocks" for c in caps) + " |",
             "|---|" + "|".join("---:" for _ in caps) + "|"]
    for p in pols:
        lines.append(f"| {policy_label(p)} | " + " | ".join(
            _cell(by[(p, c)].get(metric), ".3f", single) if (p, c) in by else "-"
            for c in caps) + " |")
    return lines


def decision_record(cells: Sequence[Mapping[str, Any]], *, workload: str, model: str,
                    layout_desc: str, capacity_desc: str, command: str,
                    box: str | None = None, load: Mapping[str, Any] | None = None,
                    headroom: Mapping[str, Any] | None = None,
                    headroom_metric: str = "token hit ratio",
                    capacity_blocks: int | None = None, confidence: float = 0.95,
                    date: _dt.date | None = None) -> str:
    """The decision in Markdown (``DECISION.md``).

    It shows the command that reruns the study; the workload, box, model, cache and seeds;
    the offered load (ρ and the rate scale) with a plain warning when ρ ≥ 1; the table with
    95% CIs (and the TTFT decomposition when the cells carry it); the per-class p95 TTFT (and
    hit ratio) table, with the slowest class named and a warning when an interactive class
    waits as long as the batch class; the decision and its statistical reason
    (`choose_policy`, `explain_choice`); the headroom; the hit ratio by cache size when the
    cells hold several sizes; and what should trigger a retest.

    ``cells``: summaries plus ``"seed"`` at one or more sizes (``capacity_blocks`` is the
    size decided at, needed when several). ``headroom``: the exact untimed replay's results at
    that size (`kvevict.replay`), ``{"belady_exact": hit ratio, "infinite": hit ratio,
    "lru": hit ratio, ...}``, each a float or an `Interval` (``headroom_metric`` says which
    ratio). Without it, a timed Belady among the cells is reported as the approximation it is.
    """
    date = date or _dt.date.today()
    choice = choose_policy(cells, load=load, capacity_blocks=capacity_blocks,
                           confidence=confidence)
    all_rows = aggregate(cells, confidence)
    rows = [r for r in all_rows if r["capacity_blocks"] == choice.capacity_blocks]
    chosen = next(r for r in rows if r["policy"] == choice.policy)
    seeds = sorted({c["seed"] for c in cells if c["capacity_blocks"] == choice.capacity_blocks},
                   key=repr)
    unstable = is_unstable(load)
    requests = chosen.get("requests")
    per_seed = f", {requests.mean:,.0f} requests per seed" if isinstance(requests, Interval) \
        else ""
    lines = [
        f"# KV-cache eviction decision: {workload}",
        "",
        f"- **Date:** {date.isoformat()}",
        f"- **Workload:** `{workload}`{per_seed}; seeds {', '.join(map(str, seeds))} "
        f"({len(seeds)} seed{'s' if len(seeds) != 1 else ''})",
    ]
    if box:
        lines.append(f"- **Box:** {box}")
    lines += [f"- **Model and sizes:** {model}: {layout_desc}",
              f"- **Cache:** {capacity_desc}"]
    if load is not None:
        lines.append(f"- **Offered load:** {_load_text(load)}: "
                     + ("**unstable**" if unstable else "stable (ρ < 1)"))
    lines += [f"- **Rerun:** `{command}`", ""]
    if unstable:
        lines += [f"> **Warning: the offered load is unstable ({_load_text(load or {})}).** "
                  "The box cannot keep up with the arrivals: the queue grows without bound, "
                  "so the latencies below are not steady state (they grow with the length of "
                  "the trace). No latency-based decision is made. Slow the arrivals "
                  "(`--rate-scale`, `--target-load 0.7`) or use a larger box.", ""]
    verdict = ("significant" if choice.significant else "not significant")
    lines += [f"## Decision: run `{choice.policy}`", "",
              f"**Why:** {choice.reason}.", "",
              f"Statistical rule: a policy replaces LRU only when the {confidence:.0%} "
              "interval of its paired per-seed difference from LRU excludes 0 in its favour; "
              f"here: {verdict}. See `kvevict.report.choose_policy`.", "",
              explain_choice(choice), ""]
    if choice.metric != "token_hit_ratio" and len(seeds) > 1 and all(
            "token_hit_ratio" in c for c in cells):
        # what the choice moves besides the decision's metric: the hit ratio, same rule
        hits = choose_policy(cells, load={"stable": True}, metric="token_hit_ratio",
                             capacity_blocks=choice.capacity_blocks, confidence=confidence)
        lines += ["What the choice moves in the cache, by the same paired rule:", "",
                  explain_choice(hits), ""]
    conf = f"{confidence:.0%}"
    over = (f"mean ± {conf} CI over {len(seeds)} seeds" if len(seeds) > 1
            else "1 seed: no interval")
    lines += [f"## Measured ({over}, {choice.capacity_blocks:,} blocks)", "",
              format_table(rows, markdown=True, load=load), ""]
    if any(c[1] in r for r in rows for c in DECOMPOSITION_COLUMNS):
        lines += ["TTFT decomposed (waiting for memory, waiting for compute, prefill of "
                  "recomputed tokens):", "",
                  format_table(rows, markdown=True, load=load, columns=DECOMPOSITION_COLUMNS,
                               notes=False),
                  ""]
    if _classes(rows):
        lines += ["## Per class", "", "p95 time to first token (s) by workload class:", "",
                  format_class_table(rows, "ttft_p95", markdown=True, load=load, notes=False),
                  ""]
        if any("token_hit_ratio" in (d or {}) for r in rows
               for d in (r.get("classes") or {}).values()):
            lines += ["Token hit ratio by workload class:", "",
                      format_class_table(rows, "token_hit_ratio", markdown=True, notes=False),
                      ""]
        note = _class_note(chosen)
        if note:
            lines += [note, ""]
    lines += ["## Headroom", ""]
    lines += _headroom_lines(headroom, choice.policy, rows, headroom_metric)
    if len({r["capacity_blocks"] for r in all_rows}) > 1:
        lines += ["", f"Token hit ratio by cache size (mean ± {conf} CI):", ""]
        lines += _size_table(all_rows, "token_hit_ratio")
    retest = [
        "a new model family (another KV size per token, another prefill speed)",
        "longer contexts than this workload's (a larger share of the cache per session)",
        "another team or application on the box (a new workload mix)",
        "the offered load moves (more users, another box): latencies change sharply as ρ "
        "approaches 1",
        "a driver, CUDA or engine update (the cost model behind these latencies)",
        "users report slow first tokens that these numbers do not predict",
    ]
    if not choice.significant:
        retest.append("you need to tell smaller differences apart: more seeds narrow the "
                      "intervals (the half-width shrinks as 1/√n)")
    lines += ["", "## Retest when", ""]
    lines += [f"- {item}{';' if i < len(retest) - 1 else '.'}" for i, item in enumerate(retest)]
    lines += [
        "",
        "Simulated with kvevict's scheduler and a cost model (`kvevict.cost.CostModel`, "
        "defaults from published H100 figures); fit its fields to your own engine before "
        "trusting absolute latencies.",
        "",
    ]
    return "\n".join(lines)



# -- plots ----------------------------------------------------------------------------------------
#
# Each plot has a ``*_figure`` function that returns the matplotlib `Figure` (for a notebook, or
# to inspect) and a ``plot_*`` function that saves it as a PNG. Figures are built without
# pyplot, so no global figure state is left behind.

def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('plots need matplotlib: pip install "kvevict[plot]"') from exc
    return Figure(figsize=(width, height))


def _decorate(fig: Any, ax: Any, title: str, xlabel: str, ylabel: str,
              legend_title: str | None = None) -> None:
    """Label a plot; the legend sits outside the axes, on the right, so it hides no line."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    legend = ax.legend(fontsize=8, title=legend_title, title_fontsize=7,
                       loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if legend_title:
        legend.get_title().set_multialignment("left")
    fig.tight_layout()


def _save(fig: Any, path: Path) -> None:
    """Save as PNG with no timestamp metadata, so files are reproducible."""
    fig.savefig(path, dpi=110, metadata={"Software": None})


def size_label(n: float) -> str:
    """A cache size as a tick label, at most three significant digits: ``"480"``,
    ``"1.25k"``, ``"20k"``, ``"1.5M"``. ``k`` is 1,000, except for a multiple of 1,024 (a pool
    sized in powers of two), where it is 1,024: ``1024 -> "1k"``, ``6144 -> "6k"``; the exact
    sizes are in the tables."""
    if n >= 1024 and n % 1024 == 0 and n < 1024 ** 2:
        return f"{n / 1024:.3g}k"
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.3g}"


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """A log2 size axis with plain labels: ticks at the measured sizes when there are at most
    twelve, else at powers of two."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    sizes = sorted(set(sizes))
    if len(sizes) > 12:
        lo = math.floor(math.log2(sizes[0]))
        hi = math.ceil(math.log2(sizes[-1]))
        ticks = [2.0 ** k for k in range(lo, hi + 1)]
    else:
        ticks = [float(s) for s in sizes]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: size_label(v)))
    ax.xaxis.set_minor_locator(NullLocator())


#: Horizontal offset between neighbouring policies on the size axis, in log2 units (2^0.025
#: is 1.7%): lines that coincide stay side by side instead of hiding each other.
SIZE_OFFSET_LOG2 = 0.025


def _size_shift(i: int, m: int, step: float) -> float:
    """The factor line ``i`` of ``m`` is shifted by on a log2 size axis: ``2^((i - (m - 1) /
    2) · step)``, so that the lines are centred on the true size."""
    return 2.0 ** ((i - (m - 1) / 2) * step)


def _size_spread(m: int, step: float) -> float:
    """The largest relative shift of ``m`` lines (`_size_shift`'s outermost, less 1)."""
    return 2.0 ** ((m - 1) / 2 * step) - 1.0


def _ratio_band(intervals: Sequence[Interval]) -> tuple[list[float], list[float], bool]:
    """The band of a ratio's intervals cut to its range [0, 1], and whether any was cut: a
    t-interval over a few seeds can reach past it (0.43 ± 0.80 over two), and a ratio
    outside it is not possible (the cut interval still holds the true mean whenever the
    whole one does)."""
    return ([min(max(iv.low, 0.0), 1.0) for iv in intervals],
            [min(max(iv.high, 0.0), 1.0) for iv in intervals],
            any(iv.low < 0.0 or iv.high > 1.0 for iv in intervals))


def hit_ratio_figure(cells: Sequence[Mapping[str, Any]], title: str, *,
                     metric: str = "token_hit_ratio",
                     exact: Mapping[int, float | Interval] | None = None,
                     confidence: float = 0.95) -> Any:
    """``metric`` (token hit ratio) against cache size, one line per policy with its 95% CI
    as a band, cut to the ratio's range [0, 1] (`_ratio_band`; no band with one seed); the
    infinite cache as a grey dotted line.

    ``cells`` are cells or `kvevict.stats.aggregate` rows. ``exact``: the exact untimed
    replay's Belady by cache size (`kvevict.replay`), drawn black dashed with filled stars as
    the ceiling; a timed Belady among the cells is dotted with hollow stars and labelled
    ``(approx.)``. Each policy keeps its colour and marker (`policy_style`); policy ``i`` of
    ``m`` is shifted by ``(i - (m - 1) / 2) · SIZE_OFFSET_LOG2`` on the log2 size axis so
    coinciding lines stay visible (the legend says by how much). The size axis is log2 with
    ticks at the measured sizes labelled ``"1.25k"``, ``"2.5k"``, ... (`size_label`).
    """
    rows = _rows(cells, confidence)
    fig = _figure(9.0, 4.8)
    ax = fig.subplots()
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    m = len(pols)
    sizes = sorted({r["capacity_blocks"] for r in rows} | set(exact or {}))
    one_seed = all(r["seeds"] == 1 for r in rows)
    cut = False  # a band cut to the ratio's range [0, 1]
    for i, p in enumerate(pols):
        pts = sorted((r["capacity_blocks"], r[metric]) for r in rows
                     if r["policy"] == p and isinstance(r.get(metric), Interval))
        if not pts:
            continue
        shift = _size_shift(i, m, SIZE_OFFSET_LOG2)
        xs = [c * shift for c, _ in pts]
        style = policy_style(p)
        ax.plot(xs, [iv.mean for _, iv in pts], label=policy_label(p), color=style["color"],
                marker=style["marker"], linestyle=style["linestyle"], markersize=6,
                linewidth=1.4, zorder=3 + i,
                markerfacecolor="none" if is_offline(p) else style["color"])
        if all(iv.known for _, iv in pts):
            lows, highs, cut_here = _ratio_band([iv for _, iv in pts])
            cut = cut or cut_here
            ax.fill_between(xs, lows, highs, color=style["color"],
                            alpha=min(0.15, max(0.04, 0.3 / m)), linewidth=0, zorder=2)
    if exact:
        ex = sorted(exact.items())
        ax.plot([c for c, _ in ex], [_mean(v) for _, v in ex], color="black", linestyle="--",
                marker="*", markersize=7, linewidth=1.2, label="belady (exact replay)",
                zorder=3 + m)
        if all(isinstance(v, Interval) and v.known for _, v in ex):
            lows, highs, cut_here = _ratio_band([v for _, v in ex])
            cut = cut or cut_here
            ax.fill_between([c for c, _ in ex], lows, highs, color="black", alpha=0.1,
                            linewidth=0)
    inf = [r["infinite_cache_hit_ratio"].mean for r in rows
           if isinstance(r.get("infinite_cache_hit_ratio"), Interval)]
    if inf:
        ax.axhline(max(inf), color="grey", linewidth=0.9, linestyle=":", label="infinite cache")
    _size_axis(ax, sizes)
    spread = _size_spread(m, SIZE_OFFSET_LOG2)
    notes = []
    if m > 1:
        notes.append(f"x shifted ≤ ±{spread:.0%} per policy\nso coinciding lines stay visible")
    notes.append("1 seed: no interval" if one_seed else
                 f"bands: {confidence:.0%} CI over seeds, each\npolicy alone (the decision "
                 "pairs seeds)" + ("\nwithin [0, 1], a ratio's range" if cut else ""))
    _decorate(fig, ax, title, "cache size (blocks, log scale)", _metric_text(metric)[0],
              "\n".join(notes))
    return fig


def plot_hit_ratio(cells: Sequence[Mapping[str, Any]], path: Path, title: str, *,
                   metric: str = "token_hit_ratio",
                   exact: Mapping[int, float | Interval] | None = None,
                   confidence: float = 0.95) -> None:
    """`hit_ratio_figure` saved as a PNG at ``path``."""
    _save(hit_ratio_figure(cells, title, metric=metric, exact=exact, confidence=confidence),
          path)


#: The label of the exact replay's infinite-cache row (`kvevict.replay.INFINITE`).
INFINITE_LABEL = "infinite"


def _shade(color: str, amount: float) -> str:
    """``color`` (``"#rrggbb"``) mixed with white by ``amount`` (0: itself, 1: white)."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _family_styles(labels: Sequence[str]) -> dict[str, tuple[str, str]]:
    """``(colour, marker)`` per label. A label ``"name detail"`` (``"horizon-oracle H=60"``)
    is drawn in ``name``'s colour (`policy_style`), its ``k``-th detail (in the order of
    ``labels``) lighter by ``k / (details + 1)`` and, past the first (which keeps ``name``'s
    own marker), with the ``k``-th marker no name in ``labels`` has (`MARKERS` first, then
    the fixed styles' markers), so a sweep reads as one family and no detail takes another
    line's marker."""
    families: dict[str, list[str]] = {}
    for label in labels:
        families.setdefault(label.split(" ", 1)[0], []).append(label)
    styles = {base: policy_style(base) for base in families}
    used = {style["marker"] for style in styles.values()}
    free = [mk for mk in dict.fromkeys(MARKERS + tuple(m for _, m in POLICY_STYLES.values()))
            if mk not in used]
    out = {}
    for base, members in families.items():
        style = styles[base]
        others = free or [mk for mk in MARKERS if mk != style["marker"]]
        for k, label in enumerate(members):
            color = _shade(style["color"], k / (len(members) + 1)) if len(members) > 1 \
                else style["color"]
            out[label] = (color, style["marker"] if k == 0 else others[(k - 1) % len(others)])
    return out


def replay_figure(rows: Sequence[Mapping[str, Any]], title: str, *,
                  metric: str = "block_hit_ratio") -> Any:
    """The exact replay's ``metric`` (block hit ratio) against pool size, one line per row
    label of a `kvevict.replay.ReplayTable` (``rows``: its `rows()`, or the ``results`` of
    ``kvevict replay --out``'s ``results.json``): the oracle decomposition in one picture.

    Online policies are solid lines with filled markers in their fixed style
    (`policy_style`); the replay's oracles, exact here, are dashed. A sweep
    (``"horizon-oracle H=60"``, ``H=600``, ...) reads as one family: its name's colour,
    lighter per detail, and a marker per detail (`_family_styles`).
    The infinite cache (`INFINITE_LABEL`) is a grey dotted line at its ratio. Line ``i`` of
    ``m`` is shifted by ``(i - (m - 1) / 2) · SIZE_OFFSET_LOG2`` on the log2 size axis so
    that coinciding lines (the horizon oracle at H = 0 is LRU) stay visible.
    """
    labels = list(dict.fromkeys(str(r["policy"]) for r in rows))
    if not labels:
        raise ConfigError("a replay plot needs at least one row")
    fig = _figure(9.5, 5.0)
    ax = fig.subplots()
    lines = [p for p in labels if p != INFINITE_LABEL]
    styles = _family_styles(lines)
    m = len(lines)
    sizes = sorted({int(r["capacity_blocks"]) for r in rows})
    for i, p in enumerate(lines):
        base = p.split(" ", 1)[0]
        color, marker = styles[p]
        pts = sorted((int(r["capacity_blocks"]), float(r[metric])) for r in rows
                     if r["policy"] == p)
        shift = _size_shift(i, m, SIZE_OFFSET_LOG2)
        ax.plot([c * shift for c, _ in pts], [v for _, v in pts], label=p, color=color,
                marker=marker, markersize=6, linewidth=1.4, zorder=3 + i,
                linestyle="--" if is_offline(base) else "-")
    inf = [float(r[metric]) for r in rows if r["policy"] == INFINITE_LABEL]
    if inf:
        ax.axhline(max(inf), color="grey", linewidth=1.0, linestyle=":",
                   label=f"infinite cache ({max(inf):.3f})")
    _size_axis(ax, sizes)
    spread = _size_spread(m, SIZE_OFFSET_LOG2)
    note = ("exact replay: dashed = oracles\n"
            + (f"x shifted ≤ ±{spread:.0%} per line\nso coinciding lines stay visible"
               if m > 1 else ""))
    _decorate(fig, ax, title, "pool size (blocks, log scale)", _metric_text(metric)[0],
              note.rstrip())
    return fig


def plot_replay(rows: Sequence[Mapping[str, Any]], path: Path, title: str, *,
                metric: str = "block_hit_ratio") -> None:
    """`replay_figure` saved as a PNG at ``path``."""
    _save(replay_figure(rows, title, metric=metric), path)


#: Horizontal offset between neighbouring policies of a comparison plot, in log2 units (2^0.06
#: is 4%): wider than `SIZE_OFFSET_LOG2`, so that the interval bars stand apart.
BAR_OFFSET_LOG2 = 0.06


def comparison_figure(comparisons: Sequence[Any], title: str) -> Any:
    """Each policy's difference from the baseline against pool size, with its interval as a
    bar: `kvevict.replay.compare`'s output (its ``Comparison`` objects, one baseline and one
    metric). A marker is filled where the interval excludes 0 and hollow where it does not
    (no significant difference); a black line marks 0. Each policy keeps its colour and
    marker (`policy_style`; an oracle's line is dashed; a sweep such as the horizon oracle's
    ``H=60``, ``H=600`` is one family, as in `replay_figure`), and policy ``i`` of ``m`` is shifted
    by ``(i - (m - 1) / 2) · BAR_OFFSET_LOG2`` on the log2 size axis so that bars at one size
    stand side by side."""
    comparisons = list(comparisons)
    if not comparisons:
        raise ConfigError("a comparison plot needs at least one comparison")
    first = comparisons[0]
    mixed = [c for c in comparisons if (c.baseline, c.metric) != (first.baseline, first.metric)]
    if mixed:
        raise ConfigError(f"a comparison plot takes one baseline and one metric; got "
                          f"{first.baseline}/{first.metric} and "
                          f"{mixed[0].baseline}/{mixed[0].metric}")
    fig = _figure(9.5, 5.0)
    ax = fig.subplots()
    policies = list(dict.fromkeys(c.policy for c in comparisons))
    styles = _family_styles(policies)
    m = len(policies)
    for i, p in enumerate(policies):
        pts = sorted((c.capacity_blocks, c) for c in comparisons if c.policy == p)
        base = p.split(" ", 1)[0]
        color, marker = styles[p]
        if base == INFINITE_LABEL:
            color = "#7f7f7f"
        shift = _size_shift(i, m, BAR_OFFSET_LOG2)
        xs = [size * shift for size, _ in pts]
        ys = [c.difference.mean for _, c in pts]
        ax.errorbar(xs, ys, yerr=[c.difference.half for _, c in pts], color=color,
                    marker=marker, markersize=7, markerfacecolor="white",
                    linestyle="--" if is_offline(base) else "-", linewidth=1.1, capsize=3,
                    label=p, zorder=3 + i)
        beyond = [(x, y) for x, y, (_, c) in zip(xs, ys, pts) if c.significant]
        if beyond:
            ax.plot([x for x, _ in beyond], [y for _, y in beyond], color=color,
                    marker=marker, markersize=7, linestyle="none", zorder=3 + m + i)
    ax.axhline(0.0, color="black", linewidth=0.9, zorder=2)
    _size_axis(ax, sorted({c.capacity_blocks for c in comparisons}))
    spread = _size_spread(m, BAR_OFFSET_LOG2)
    confidence = first.difference.confidence
    note = (f"bars: {confidence:.0%} interval by\nbatch means, paired with {first.baseline}\n"
            "filled: beyond it; hollow: n.s."
            + (f"\nx shifted ≤ ±{spread:.0%} per policy" if m > 1 else ""))
    _decorate(fig, ax, title, "pool size (blocks, log scale)",
              f"{_metric_text(first.metric)[0]} − {first.baseline}'s", note)
    return fig


def plot_comparison(comparisons: Sequence[Any], path: Path, title: str) -> None:
    """`comparison_figure` saved as a PNG at ``path``."""
    _save(comparison_figure(comparisons, title), path)


def _cdf_series(values: Sequence[float] | Mapping[Any, Sequence[float]]) -> list[list[float]]:
    if isinstance(values, Mapping):
        return [sorted(float(v) for v in vs) for _, vs in sorted(values.items(), key=repr)]
    return [sorted(float(v) for v in values)]


#: Points of the TTFT CDF's common grid (log-spaced between the smallest positive and the
#: largest TTFT, plus 0), and the spacing of a line's markers along it.
CDF_GRID_POINTS = 600
CDF_MARK_EVERY = 60


def ttft_cdf_figure(ttfts: Mapping[str, Sequence[float] | Mapping[Any, Sequence[float]]],
                    title: str, confidence: float = 0.95) -> Any:
    """Empirical CDF of time to first token, one line per policy.

    ``ttfts[policy]`` is the TTFTs of one run, or a mapping seed -> TTFTs. The CDFs are
    evaluated on a common grid (`CDF_GRID_POINTS`); with several seeds the line is the mean of
    the per-seed CDFs and the band the pointwise 95% CI of that mean (Student t over the
    seeds). Markers sit every `CDF_MARK_EVERY` grid points, policy ``i`` of ``m`` starting
    ``i · CDF_MARK_EVERY / m`` points later, so coinciding lines show alternating markers;
    colours and markers are fixed by name (`policy_style`).
    """
    import numpy as np

    from kvevict.stats import t_quantile

    series = {p: [s for s in _cdf_series(v) if s] for p, v in ttfts.items()}
    series = {p: s for p, s in series.items() if s}
    everything = [x for s in series.values() for run in s for x in run]
    if not everything:
        raise ConfigError("a TTFT CDF needs at least one TTFT")
    fig = _figure(9.0, 4.8)
    ax = fig.subplots()
    positive = [x for x in everything if x > 0]
    lo = min(positive) if positive else 1e-3
    hi = max(max(everything), lo * 1.0001)
    grid = np.concatenate([[0.0], np.geomspace(lo, hi, CDF_GRID_POINTS)])
    m = len(series)
    multi = any(len(s) > 1 for s in series.values())
    for i, (p, runs) in enumerate(series.items()):
        cdfs = np.array([np.searchsorted(np.asarray(r), grid, side="right") / len(r)
                         for r in runs])
        mean = cdfs.mean(axis=0)
        style = policy_style(p)
        ax.plot(grid, mean, label=policy_label(p), color=style["color"],
                linestyle=style["linestyle"], marker=style["marker"], markersize=5,
                markevery=(1 + i * CDF_MARK_EVERY // m, CDF_MARK_EVERY), linewidth=1.3,
                zorder=3 + i, markerfacecolor="none" if is_offline(p) else style["color"])
        if len(runs) > 1:
            n = len(runs)
            half = (t_quantile(1 - (1 - confidence) / 2, n - 1) * cdfs.std(axis=0, ddof=1)
                    / math.sqrt(n))
            ax.fill_between(grid, np.clip(mean - half, 0, 1), np.clip(mean + half, 0, 1),
                            color=style["color"], alpha=min(0.15, max(0.04, 0.3 / m)),
                            linewidth=0, zorder=2)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_ylim(0, 1.02)
    note = ("markers staggered so\ncoinciding lines stay visible\n"
            + (f"bands: {confidence:.0%} CI over seeds" if multi else "1 seed: no interval"))
    _decorate(fig, ax, title, "time to first token (s)", "fraction of requests", note)
    return fig


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float] | Mapping[Any, Sequence[float]]],
                  path: Path, title: str, confidence: float = 0.95) -> None:
    """`ttft_cdf_figure` saved as a PNG at ``path``."""
    _save(ttft_cdf_figure(ttfts, title, confidence), path)


def class_p95_figure(cells: Sequence[Mapping[str, Any]], title: str, *,
                     metric: str = "ttft_p95", capacity_blocks: int | None = None,
                     confidence: float = 0.95) -> Any:
    """Per-class ``metric`` (p95 TTFT) as grouped bars: one group per workload class (its
    request count per seed under the name), one bar per policy in its fixed colour (an
    offline policy white, hatched, edged in its colour) with the 95% CI as an error bar
    (none with one seed; the lower bar is cut at 0, since a time is never negative). A log y
    axis when the classes differ by more than 30x, so a fast class stays readable next to a
    slow one. ``cells``: cells or rows at one cache size (``capacity_blocks`` picks it when
    there are several)."""
    rows = _rows(cells, confidence)
    caps = list(dict.fromkeys(r["capacity_blocks"] for r in rows))
    if capacity_blocks is None and len(caps) > 1:
        raise ConfigError(f"the rows hold several cache sizes ({', '.join(map(str, caps))}); "
                          "pass capacity_blocks=")
    cap = capacity_blocks if capacity_blocks is not None else caps[0]
    rows = [r for r in rows if r["capacity_blocks"] == cap]
    classes = _classes(rows)
    if not classes:
        raise ConfigError("no row has per-class results (a 'classes' entry)")
    fig = _figure(max(7.5, 2.5 + 0.35 * len(classes) * len(rows)), 4.8)
    ax = fig.subplots()
    width = 0.8 / len(rows)
    values = []
    for i, r in enumerate(rows):
        ivs = [(r.get("classes") or {}).get(c, {}).get(metric) for c in classes]
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(classes))]
        means = [iv.mean if isinstance(iv, Interval) else float("nan") for iv in ivs]
        halves = [iv.half if isinstance(iv, Interval) and iv.known else 0.0 for iv in ivs]
        # a latency is never negative: the lower bar stops at 0 (the table has the interval)
        errs = [[min(h, max(mu, 0.0)) if not math.isnan(mu) else 0.0
                 for h, mu in zip(halves, means, strict=True)], halves]
        values += [v for v in means if v > 0]
        style = policy_style(r["policy"])
        offline = is_offline(r["policy"])
        ax.bar(xs, means, width=width * 0.92, yerr=errs, capsize=3,
               color="white" if offline else style["color"],
               edgecolor=style["color"] if offline else "black",
               linewidth=0.8 if offline else 0.5, hatch="//" if offline else None,
               label=policy_label(r["policy"]), error_kw={"elinewidth": 1.0, "ecolor": "black"})
    ax.set_xticks(range(len(classes)))
    labels = []
    for c in classes:
        n = next((r["classes"][c].get("requests") for r in rows
                  if c in (r.get("classes") or {})), None)
        labels.append(f"{c}\n({n.mean:,.0f} req)" if isinstance(n, Interval) else c)
    ax.set_xticklabels(labels)
    if values and max(values) / min(values) > 30:
        ax.set_yscale("log")
    one_seed = all(r["seeds"] == 1 for r in rows)
    name, _, unit = _metric_text(metric)
    _decorate(fig, ax, title, "workload class", f"{name}{unit and ' (s)'}",
              "1 seed: no interval" if one_seed else f"error bars: {confidence:.0%} CI")
    return fig


def plot_class_p95(cells: Sequence[Mapping[str, Any]], path: Path, title: str, *,
                   metric: str = "ttft_p95", capacity_blocks: int | None = None,
                   confidence: float = 0.95) -> None:
    """`class_p95_figure` saved as a PNG at ``path``."""
    _save(class_p95_figure(cells, title, metric=metric, capacity_blocks=capacity_blocks,
                           confidence=confidence), path)
