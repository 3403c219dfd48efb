"""`kvevict.report`: the decision rule against LRU (paired by seed), the tables with
intervals, the decision record, the fixed plot styles and the plots.

Decisions are checked on hand-built cells whose paired differences are worked out in the
comments (t(0.975, 2) = 4.302653, t(0.975, 1) = 12.706205)."""

from __future__ import annotations

import datetime as dt
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvevict import report, stats
from kvevict.errors import ConfigError
from kvevict.stats import Interval, interval, paired

ROOT = Path(__file__).resolve().parent.parent


def cell(policy, seed, p95, recomputed=1000, cap=100, **extra):
    return {"policy": policy, "capacity_blocks": cap, "seed": seed, "ttft_p95": p95,
            "recomputed_prefill_tokens": recomputed, **extra}


def runs(policy, p95s, recomputed=None, cap=100):
    recomputed = recomputed or [1000] * len(p95s)
    return [cell(policy, s, p, r, cap) for s, (p, r) in enumerate(zip(p95s, recomputed))]


LRU = [1.0, 2.0, 3.0]  # a large seed effect, common to every policy (common random numbers)


# -- the decision ---------------------------------------------------------------------------

def test_equal_policies_make_no_significant_difference_and_keep_lru():
    cells = runs("lru", LRU) + runs("market", LRU)
    choice = report.choose_policy(cells)
    assert choice.policy == "lru" and not choice.significant
    assert choice.metric == "ttft_p95" and choice.latency_decision
    assert choice.difference == Interval(0.0, 0.0, 3) and choice.versus == "market"
    assert choice.reason == (
        "no significant difference: keep LRU (the simplest); no policy's p95 TTFT advantage "
        "over lru is beyond the 95% interval of the paired per-seed difference over 3 seeds "
        "(best: market - lru = 0.000 ± 0.000 s)")


def test_a_significant_win_is_picked_and_a_better_mean_without_significance_is_not():
    cells = (runs("lru", LRU)
             + runs("lfu", [0.4, 2.3, 2.7])        # -0.6, +0.3, -0.3: mean -0.2, half 1.14
             + runs("market", [0.9, 1.85, 2.9])    # -0.1, -0.15, -0.1: -0.117 ± 0.072
             + runs("bayes", [0.95, 1.95, 2.95]))  # -0.05 every seed: -0.05 ± 0
    choice = report.choose_policy(cells)
    assert choice.policy == "market" and choice.significant
    assert choice.difference == paired([0.9, 1.85, 2.9], LRU)
    assert choice.difference.mean == pytest.approx(-0.35 / 3)
    assert choice.difference.half == pytest.approx(4.302653 * math.sqrt(1 / 1200) / math.sqrt(3),
                                                   rel=1e-6)
    assert [p for p, _ in choice.comparisons] == ["lfu", "market", "bayes"]
    assert choice.reason == (
        "market lowers p95 TTFT against lru: paired per-seed difference -0.117 ± 0.072 s over "
        "3 seeds, whose 95% interval excludes 0; the best mean of the 2 policies significantly "
        "better than lru")
    assert report.explain_choice(choice) == (
        "p95 TTFT, paired per-seed difference against lru (3 seeds, 100 blocks):\n"
        "- lfu - lru: -0.200 ± 1.138 s: no significant difference\n"
        "- market - lru: -0.117 ± 0.072 s: better (chosen)\n"
        "- bayes - lru: -0.050 ± <0.001 s: better")  # float noise in 0.95 - 1.0, etc.


def test_the_independent_intervals_overlap_but_the_paired_one_does_not():
    """Common random numbers: the seed effect (1, 2, 3 s) swamps the separate intervals, and
    cancels in the paired one."""
    market = [0.9, 1.85, 2.9]
    assert interval(market).high > interval(LRU).low  # unpaired: indistinguishable
    assert report.choose_policy(runs("lru", LRU) + runs("market", market)).significant


def test_an_exact_tie_in_the_mean_goes_to_the_narrower_interval_then_the_name():
    # binary-exact values: every difference below is exact, so the means tie exactly at -0.5
    zeta = runs("zeta", [0.5, 1.5, 2.5])          # -0.5 every seed: half 0
    beta = runs("beta", [0.375, 1.5, 2.625])      # -0.625, -0.5, -0.375: -0.5 ± 0.311
    assert report.choose_policy(runs("lru", LRU) + beta + zeta).policy == "zeta"
    alpha = runs("alpha", [0.5, 1.5, 2.5])
    assert report.choose_policy(runs("lru", LRU) + beta + zeta + alpha).policy == "alpha"


def test_only_worse_policies_keep_lru_and_say_none_is_better():
    choice = report.choose_policy(runs("lru", LRU) + runs("market", [1.1, 2.1, 3.1]))
    assert choice.policy == "lru" and not choice.significant
    assert choice.reason.startswith("no policy is significantly better than LRU: keep LRU "
                                    "(the simplest);")
    assert report.explain_choice(choice).endswith("- market - lru: 0.100 ± 0.000 s: worse")


def test_an_unstable_load_makes_no_latency_decision():
    cells = (runs("lru", LRU, [1000, 2000, 3000])
             + runs("market", [0.5, 1.5, 2.5], [1100, 2100, 3100])  # faster, recomputes more
             + runs("bayes", [1.2, 2.2, 3.2], [900, 1900, 2900]))   # slower, recomputes less
    stable = report.choose_policy(cells, load={"rho": 0.7, "stable": True, "rate_scale": 1.0})
    assert stable.policy == "market" and stable.metric == "ttft_p95"
    load = {"rho": 1.3, "stable": False, "rate_scale": 2.0}
    choice = report.choose_policy(cells, load=load)
    assert choice.policy == "bayes" and choice.significant
    assert choice.metric == "recomputed_prefill_tokens" and not choice.latency_decision
    assert choice.difference == Interval(-100.0, 0.0, 3)
    assert choice.reason == (
        "the offered load is unstable (ρ = 1.30, rate scale 2): the queue grows without bound "
        "and latencies are not steady state, so no latency-based decision is made; decided on "
        "recomputed prefill tokens instead; bayes lowers recomputed prefill tokens against "
        "lru: paired per-seed difference -100 ± 0 over 3 seeds, whose 95% interval excludes 0")


def test_what_counts_as_unstable():
    assert report.is_unstable({"rho": 1.0, "stable": True})  # rho >= 1 wins
    assert report.is_unstable({"stable": False})
    assert report.is_unstable({"rho": math.inf})
    assert not report.is_unstable({"rho": 0.99, "stable": True, "rate_scale": 1.0})
    assert not report.is_unstable(None)


def test_one_seed_keeps_lru_whatever_the_point_estimate():
    cells = runs("lru", [2.0]) + runs("market", [0.5])
    choice = report.choose_policy(cells)
    assert choice.policy == "lru" and not choice.significant and choice.seeds == 1
    assert not choice.difference.known
    assert choice.reason == (
        "1 seed: the interval is unknown, so no significance can be claimed and no policy can "
        "be shown better than LRU: keep LRU (the simplest); run more seeds (e.g. --seeds 5). "
        "Best point estimate of p95 TTFT: market - lru = -1.500 s")
    assert report.explain_choice(choice).endswith("- market - lru: -1.500 (1 seed) s: "
                                                  "unknown (1 seed)")


def test_an_offline_policy_is_never_chosen():
    cells = runs("lru", LRU) + runs("belady", [0.1, 0.2, 0.3]) + runs("market", LRU)
    choice = report.choose_policy(cells)
    assert choice.policy == "lru" and [p for p, _ in choice.comparisons] == ["market"]
    with pytest.raises(ConfigError, match="no online policy to choose from"):
        report.choose_policy(runs("belady", LRU))


def test_lru_alone_is_kept_without_a_comparison():
    choice = report.choose_policy(runs("lru", LRU) + runs("belady", LRU))
    assert choice.policy == "lru" and choice.difference is None and choice.comparisons == ()
    assert choice.reason == "lru is the only online policy measured: nothing to compare it " \
                            "with; keep LRU"


def test_the_decision_needs_lru_one_size_and_the_metric():
    with pytest.raises(ConfigError, match=r"no lru cells at 100 blocks; measured: market"):
        report.choose_policy(runs("market", LRU))
    two = runs("lru", LRU) + runs("lru", [5.0, 6.0, 7.0], cap=50) + runs("market", LRU, cap=50)
    with pytest.raises(ConfigError, match=r"several cache sizes \(100, 50 blocks\)"):
        report.choose_policy(two)
    assert report.choose_policy(two, capacity_blocks=50).capacity_blocks == 50
    with pytest.raises(ConfigError, match="no cell at 70 blocks"):
        report.choose_policy(two, capacity_blocks=70)
    with pytest.raises(ConfigError, match="seed 0, has no 'ttft_p95'"):
        report.choose_policy([{"policy": "lru", "capacity_blocks": 1, "seed": 0}])
    with pytest.raises(ConfigError, match="same seeds"):
        report.choose_policy(runs("lru", LRU) + runs("market", LRU[:2]))


# -- tables ---------------------------------------------------------------------------------

COLUMNS = [c for c in report.TABLE_COLUMNS
           if c[1] in ("token_hit_ratio", "recomputed_prefill_tokens", "ttft_p95")]


def _table_cells():
    # n = 2: half = 12.706205 * |a - b| / 2
    return [cell("lru", 0, 1.0, 1000, token_hit_ratio=0.50),
            cell("lru", 1, 1.4, 3000, token_hit_ratio=0.70),
            cell("market", 0, 0.9, 900, token_hit_ratio=0.60),
            cell("market", 1, 0.9, 1100, token_hit_ratio=0.62),
            cell("belady", 0, 0.5, 0, token_hit_ratio=0.9),
            cell("belady", 1, 0.7, 0, token_hit_ratio=0.9)]


def test_format_table_exact_terminal_text():
    assert report.format_table(_table_cells(), columns=COLUMNS) == (
        "policy                token hit  recomputed tok     TTFT p95 s\n"
        "----------------  -------------  --------------  -------------\n"
        "lru               0.600 ± 1.271  2,000 ± 12,706  1.200 ± 2.541\n"
        "market            0.610 ± 0.127   1,000 ± 1,271  0.900 ± 0.000\n"
        "belady (approx.)  0.900 ± 0.000           0 ± 0  0.600 ± 1.271\n"
        "(approx.): an offline policy in the timed simulator sees requests as the scheduler "
        "delays them; an approximation, not a bound")


def test_format_table_exact_markdown_with_an_unstable_load():
    text = report.format_table(_table_cells()[:4], markdown=True, columns=COLUMNS,
                               load={"rho": 1.25, "stable": False, "rate_scale": 1.0})
    assert text == (
        "| policy | token hit | recomputed tok | TTFT p95 s† |\n"
        "|---|---:|---:|---:|\n"
        "| lru | 0.600 ± 1.271 | 2,000 ± 12,706 | 1.200 ± 2.541 |\n"
        "| market | 0.610 ± 0.127 | 1,000 ± 1,271 | 0.900 ± 0.000 |\n"
        "\n"
        "† offered load ρ = 1.25 ≥ 1: the queue grows without bound; these latencies are not "
        "steady state")


def test_format_table_one_seed_several_sizes_and_missing_columns():
    cells = [cell("lru", 0, 1.0, 1000, cap=1250), cell("lru", 0, 0.5, 500, cap=20000)]
    assert report.format_table(cells, columns=COLUMNS[1:] + [("resume hit",
                                                             "resume_block_hit_ratio",
                                                             ".3f", True)]) == (
        "policy  blocks  recomputed tok  TTFT p95 s  resume hit\n"
        "------  ------  --------------  ----------  ----------\n"
        "lru      1,250           1,000       1.000           -\n"
        "lru     20,000             500       0.500           -\n"
        "1 seed: single runs, no confidence interval (run more seeds for one)")
    mixed = cells[:1] + [cell("lru", s, 0.5, 500, cap=20000) for s in (0, 1)]
    assert report.format_table(mixed, columns=COLUMNS[2:]).splitlines()[2:] == [
        "lru      1,250      1  1.000 (1 seed)",
        "lru     20,000      2   0.500 ± 0.000"]


def test_format_table_default_columns_show_optional_ones_only_when_present():
    header = report.format_table(runs("lru", LRU)).splitlines()[0].split()
    assert "resume" not in header and "hit" in header  # "token hit", "block hit"
    with_resume = [dict(c, resume_block_hit_ratio=0.1) for c in runs("lru", LRU)]
    assert "resume hit" in report.format_table(with_resume).splitlines()[0]


def test_a_ratio_undefined_on_some_seeds_is_averaged_over_the_others_and_says_so():
    # a run in which no request resumed has no resume hit ratio (None), not a ratio of 0
    cells = [dict(c, resume_block_hit_ratio=v)
             for c, v in zip(runs("lru", LRU), (None, 0.8, None), strict=True)]
    row = stats.aggregate(cells)[0]
    assert row["resume_block_hit_ratio"].n == 1 and row["resume_block_hit_ratio"].mean == 0.8
    assert "0.800 (1 of 3 seeds)" in report.format_table(cells).splitlines()[2]
    none = [dict(c, resume_block_hit_ratio=None) for c in runs("lru", LRU)]
    assert "resume_block_hit_ratio" not in stats.aggregate(none)[0]
    assert "resume" not in report.format_table(none).splitlines()[0]


def _class_cells():
    out = []
    for seed, (chat, batch) in enumerate([(0.5, 0.3), (0.7, 0.5)]):
        for policy, f in (("lru", 1.0), ("market", 0.5)):
            out.append(cell(policy, seed, 1.0, classes={
                "chat": {"requests": 8 + 2 * seed, "ttft_p95": chat * f},
                "batch": {"requests": 2, "ttft_p95": batch * f}}))
    return out


def test_format_class_table_exact_text():
    assert report.format_class_table(_class_cells()) == (
        "p95 TTFT by class\n"
        "policy   chat (9 req)  batch (2 req)\n"
        "------  -------------  -------------\n"
        "lru     0.600 ± 1.271  0.400 ± 1.271\n"
        "market  0.300 ± 0.635  0.200 ± 0.635")
    with pytest.raises(ConfigError, match="no row has per-class results"):
        report.format_class_table(runs("lru", LRU))


# -- the decision record --------------------------------------------------------------------

def _record(cells, **kw):
    args = {"workload": "mixed", "model": "llama-3-8b", "layout_desc": "GQA",
            "capacity_desc": "100 blocks", "command": "kvevict simulate --seeds 2",
            "box": "1x H100 SXM 80 GB", "date": dt.date(2025, 1, 2)}
    return report.decision_record(cells, **{**args, **kw})


def test_decision_record_shows_the_load_the_classes_and_the_exact_headroom():
    cells = _class_cells()
    text = _record(cells, load={"rho": 0.7, "stable": True, "rate_scale": 1.5},
                   headroom={"belady_exact": 0.81, "lru": Interval(0.75, 0.01, 2),
                             "infinite": 0.9})
    lines = text.splitlines()
    assert lines[:10] == [
        "# KV-cache eviction decision: mixed", "",
        "- **Date:** 2025-01-02",
        "- **Workload:** `mixed`; seeds 0, 1 (2 seeds)",
        "- **Box:** 1x H100 SXM 80 GB",
        "- **Model and sizes:** llama-3-8b: GQA",
        "- **Cache:** 100 blocks",
        "- **Offered load:** ρ = 0.70, rate scale 1.5: stable (ρ < 1)",
        "- **Rerun:** `kvevict simulate --seeds 2`", ""]
    assert "## Decision: run `lru`" in lines  # equal p95 overall: no significant difference
    assert "| policy | chat (9 req) | batch (2 req) |" in lines
    assert ("- The exact offline oracle (Belady in the untimed replay of the same requests, "
            "`kvevict.replay`) reaches a token hit ratio of 0.810; `lru` reaches 0.750 ± 0.010 "
            "in the same replay: 0.060 (a difference of means) is left on the table for any "
            "online policy at this size.") in lines
    assert "- An infinite cache would hit 0.900 of prompt tokens: the rest is compulsory." \
        in lines
    # chat waits longer than batch at p95: the starvation is spelled out
    assert any(line.startswith("At `lru` the slowest class is `chat` (p95 TTFT 0.600 ± 1.271 "
                               "s), the fastest `batch` (0.400 ± 1.271 s). **Interactive "
                               "traffic (`chat`) waits at least as long as the batch class")
               for line in lines)
    assert "Warning" not in text


def test_decision_record_of_an_unstable_load_warns_and_decides_on_recompute():
    cells = (runs("lru", LRU, [1000, 2000, 3000])
             + runs("market", [0.5, 1.5, 2.5], [1100, 2100, 3100])
             + runs("belady", [0.1, 0.2, 0.3], [0, 0, 0]))
    text = _record(cells, load={"rho": 1.4, "stable": False, "rate_scale": 1.0})
    assert "- **Offered load:** ρ = 1.40, rate scale 1: **unstable**" in text
    assert "> **Warning: the offered load is unstable (ρ = 1.40, rate scale 1).**" in text
    assert "No latency-based decision is made." in text
    assert "## Decision: run `lru`" in text  # market is faster, but recomputes more
    assert "decided on recomputed prefill tokens instead" in text
    assert "TTFT p95 s† |" in text
    assert "## Measured (mean ± 95% CI over 3 seeds, 100 blocks)" in text
    one = _record([c for c in cells if c["seed"] == 0])
    assert "## Measured (1 seed: no interval, 100 blocks)" in one
    assert "1 seed: single runs, no confidence interval (run more seeds for one)" in one
    assert "**Why:** 1 seed: the interval is unknown" in one
    assert "| belady (approx.) |" in text
    assert ("- No exact-oracle replay was given. The timed belady (approx.) sees the requests "
            "as the scheduler delays them: an approximation, not a bound; do not read the gap "
            "to it as the headroom.") in text
    assert text.splitlines()[-4:-2] == [
        "- users report slow first tokens that these numbers do not predict;",
        "- you need to tell smaller differences apart: more seeds narrow the intervals (the "
        "half-width shrinks as 1/√n)."]


# -- styles ---------------------------------------------------------------------------------

def test_builtin_policies_have_fixed_distinct_styles():
    assert report.policy_style("lru") == {"color": "#1f77b4", "marker": "o", "linestyle": "-"}
    assert report.policy_style("belady") == {"color": "#000000", "marker": "*",
                                             "linestyle": ":"}
    assert report.policy_style("learned") == {"color": "#e7298a", "marker": "X",
                                              "linestyle": "-"}
    styles = [report.POLICY_STYLES[p] for p in report.POLICY_STYLES]
    assert len({c for c, _ in styles}) == len({m for _, m in styles}) == len(styles)
    # every policy and oracle kvevict registers has one, so no two lines of a replay plot
    # share a colour
    assert set(report.POLICY_STYLES) == {
        "2q", "arc", "bayes", "belady", "dbms", "gdsf", "horizon-oracle", "learned", "lfu",
        "lru", "market", "pinned", "reuse-oracle", "s3fifo", "slru"}


def test_other_names_hash_deterministically_into_a_separate_palette():
    style = report.policy_style("my-policy")
    assert style == {"color": "#393b79", "marker": "H", "linestyle": "-"}  # golden
    builtin = {c for c, _ in report.POLICY_STYLES.values()}
    for name in ("my-policy", "lru2", "x" * 40):
        assert report.policy_style(name)["color"] not in builtin
    code = "from kvevict.report import policy_style; print(policy_style('my-policy'))"
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # not this process's
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
    assert out == str(style) + "\n"  # not Python's salted hash()


def test_size_labels():
    sizes = (480, 1250, 2500, 5000, 20000, 1_500_000, 1024, 3072, 6144, 1000, 1536)
    assert [report.size_label(n) for n in sizes] == [
        "480", "1.25k", "2.5k", "5k", "20k", "1.5M", "1k", "3k", "6k", "1k", "1.54k"]


# -- plots ----------------------------------------------------------------------------------

def _sweep(seeds=(0, 1, 2)):
    out = []
    for seed in seeds:
        for cap, base in ((1250, 0.3), (2500, 0.4), (5000, 0.5)):
            for policy, adv in (("lru", 0.0), ("lfu", 0.0), ("belady", 0.1)):
                out.append(cell(policy, seed, 1.0, cap=cap, infinite_cache_hit_ratio=0.8,
                                token_hit_ratio=base + adv + 0.01 * seed))
    return out


def test_hit_ratio_figure_styles_offsets_bands_and_ticks():
    pytest.importorskip("matplotlib")
    fig = report.hit_ratio_figure(_sweep(), "t", exact={1250: 0.45, 2500: 0.55, 5000: 0.65})
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"lru", "lfu", "belady (approx.)", "belady (exact replay)",
                          "infinite cache"}
    assert lines["lru"].get_color() == "#1f77b4" and lines["lru"].get_marker() == "o"
    assert lines["lfu"].get_color() == "#ff7f0e" and lines["lfu"].get_marker() == "s"
    assert lines["belady (approx.)"].get_linestyle() == ":"
    assert lines["belady (exact replay)"].get_linestyle() == "--"
    # lru and lfu coincide: shifted by -1 and 0 offsets of 0.025 in log2 (3 policies)
    assert list(lines["lru"].get_xdata()) == pytest.approx(
        [c * 2 ** -0.025 for c in (1250, 2500, 5000)])
    assert list(lines["lfu"].get_xdata()) == pytest.approx([1250, 2500, 5000])
    assert list(lines["lfu"].get_ydata()) == pytest.approx([0.31, 0.41, 0.51])
    assert len(ax.collections) == 3  # one CI band per policy line
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    half = interval([0.3, 0.31, 0.32]).half
    assert band.min() == pytest.approx(0.31 - half) and band.max() == pytest.approx(0.51 + half)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1.25k", "2.5k", "5k"]
    assert ax.get_xscale() == "log"
    assert "shifted ≤ ±2% per policy" in ax.get_legend().get_title().get_text()


def test_hit_ratio_figure_cuts_a_band_to_the_ratios_range():
    """Two seeds far apart: the t-interval reaches below 0 and above 1, the band stops at
    both, and the legend says so; a band inside [0, 1] is drawn as it is, without the note."""
    pytest.importorskip("matplotlib")
    cells = [cell("lru", seed, 1.0, cap=cap, token_hit_ratio=ratio)
             for cap, ratios in ((1000, (0.02, 0.3)), (2000, (0.7, 0.98)))
             for seed, ratio in enumerate(ratios)]
    iv = interval([0.02, 0.3])
    assert iv.low < 0 and interval([0.7, 0.98]).high > 1  # t on one degree of freedom
    ax = report.hit_ratio_figure(cells, "t").axes[0]
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == 0.0 and band.max() == 1.0
    assert "within [0, 1], a ratio's range" in ax.get_legend().get_title().get_text()
    ax = report.hit_ratio_figure(_sweep(), "t").axes[0]
    assert "within [0, 1]" not in ax.get_legend().get_title().get_text()


def test_hit_ratio_figure_with_one_seed_draws_no_band():
    pytest.importorskip("matplotlib")
    ax = report.hit_ratio_figure(_sweep(seeds=(0,)), "t").axes[0]
    assert len(ax.collections) == 0
    assert "1 seed: no interval" in ax.get_legend().get_title().get_text()


def test_ttft_cdf_figure_bands_and_staggered_markers():
    pytest.importorskip("matplotlib")
    runs_ = {0: [0.1, 0.2, 0.4], 1: [0.1, 0.3, 0.5], 2: [0.2, 0.3, 0.6]}
    ax = report.ttft_cdf_figure({"lru": runs_, "lfu": runs_}, "t").axes[0]
    lru, lfu = ax.get_lines()
    assert list(lru.get_ydata()) == list(lfu.get_ydata())  # they coincide...
    assert lru.get_markevery() != lfu.get_markevery()      # ...and their markers alternate
    assert lru.get_ydata()[-1] == 1.0 and lru.get_ydata()[0] == 0.0
    assert len(ax.collections) == 2  # a band each


def test_class_p95_figure_bars_and_error_bars():
    pytest.importorskip("matplotlib")
    ax = report.class_p95_figure(_class_cells(), "t").axes[0]
    heights = [round(p.get_height(), 9) for p in ax.patches]
    assert heights == [0.6, 0.4, 0.3, 0.2]  # lru: chat, batch; market: chat, batch
    assert [p.get_facecolor()[:3] for p in ax.patches][::2] == [
        pytest.approx((0x1f / 255, 0x77 / 255, 0xb4 / 255)),
        pytest.approx((0xd6 / 255, 0x27 / 255, 0x28 / 255))]
    segments = [c for c in ax.collections if len(c.get_segments()) == 2]
    tops = sorted(max(s[0][1], s[1][1]) for c in segments for s in c.get_segments())
    # mean + half, half = 12.706205 * |a - b| / 2 over the two seeds
    assert tops == pytest.approx(sorted([0.6 + 12.706205 * 0.1, 0.4 + 12.706205 * 0.1,
                                         0.3 + 12.706205 * 0.05, 0.2 + 12.706205 * 0.05]))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["chat\n(9 req)", "batch\n(2 req)"]
    lows = sorted(min(s[0][1], s[1][1]) for c in segments for s in c.get_segments())
    assert lows == [0.0, 0.0, 0.0, 0.0]  # every half-width exceeds its mean: cut at 0


def _comparisons():
    from kvevict.replay import Comparison

    def c(policy, size, mean, half, baseline="lru", metric="block_hit_ratio"):
        return Comparison(policy, baseline, size, metric, 0.1 + mean, 0.1,
                          Interval(mean, half, 15))

    return [c("learned", 1000, 0.012, 0.008), c("learned", 4000, 0.007, 0.012),
            c("arc", 1000, -0.002, 0.004), c("arc", 4000, 0.01, 0.005),
            c("belady", 1000, 0.2, 0.01), c("belady", 4000, 0.25, 0.02)]


def test_comparison_figure_bars_fill_only_what_is_beyond_the_interval():
    pytest.importorskip("matplotlib")
    ax = report.comparison_figure(_comparisons(), "t").axes[0]
    lines = ax.get_lines()
    # per policy: its line (hollow markers) then, if any, the filled markers beyond 0
    bars = {b.get_label(): b.lines[0] for b in ax.containers}  # errorbar: (line, caps, bars)
    mains = [bars[p] for p in ("learned", "arc", "belady")]
    assert [(p, ln.get_color(), ln.get_marker(), ln.get_linestyle(),
             ln.get_markerfacecolor()) for p, ln in zip(bars, mains)] == [
        ("learned", "#e7298a", "X", "-", "white"), ("arc", "#bcbd22", ">", "-", "white"),
        ("belady", "#000000", "*", "--", "white")]
    in_bars = {id(x) for b in ax.containers for x in (b.lines[0], *b.lines[1])}
    filled = [ln for ln in lines if id(ln) not in in_bars and ln.get_linestyle() == "None"]
    # learned at 1k (+.012 ± .008), arc at 4k, belady at both; not learned at 4k, arc at 1k
    assert [(ln.get_color(), [round(y, 4) for y in ln.get_ydata()]) for ln in filled] == [
        ("#e7298a", [0.012]), ("#bcbd22", [0.01]), ("#000000", [0.2, 0.25])]
    # the bars: mean ± half, policies shifted apart on the size axis (2^(±0.06) around 1k)
    learned = mains[0]
    assert list(learned.get_xdata()) == pytest.approx([1000 * 2 ** -0.06, 4000 * 2 ** -0.06])
    segments = [seg for coll in ax.collections for seg in coll.get_segments()]
    spans = sorted((round(min(s[0][1], s[1][1]), 4), round(max(s[0][1], s[1][1]), 4))
                   for s in segments)
    assert (0.004, 0.02) in spans and (-0.005, 0.019) in spans and (-0.006, 0.002) in spans
    assert ax.get_ylabel() == "block hit ratio − lru's"
    assert [ln.get_ydata()[0] for ln in lines if ln.get_color() == "black"] == [0.0]


def test_comparison_figure_draws_a_sweep_as_one_family_as_the_replay_figure_does():
    pytest.importorskip("matplotlib")
    from kvevict.replay import Comparison

    names = ["learned", "horizon-oracle H=30", "horizon-oracle H=300"]
    comparisons = [Comparison(p, "lru", size, "block_hit_ratio", 0.2, 0.1,
                              Interval(0.1, 0.01, 15)) for p in names for size in (1000, 4000)]
    ax = report.comparison_figure(comparisons, "t").axes[0]
    bars = {b.get_label(): b.lines[0] for b in ax.containers}
    got = {p: (ln.get_color(), ln.get_marker(), ln.get_linestyle()) for p, ln in bars.items()}
    # the horizon oracle's sweep: its own style first, then a third of the way to white with
    # the first of MARKERS no line here has (learned has "X", the oracle "h")
    assert got == {"learned": ("#e7298a", "X", "-"),
                   "horizon-oracle H=30": ("#00a087", "h", "--"),
                   "horizon-oracle H=300": ("#55c0af", "<", "--")}
    rows = [{"policy": p, "capacity_blocks": 1000, "block_hit_ratio": 0.1} for p in names]
    lines = {ln.get_label(): ln for ln in report.replay_figure(rows, "t").axes[0].get_lines()}
    assert {p: (ln.get_color(), ln.get_marker()) for p, ln in lines.items()} == {
        p: style[:2] for p, style in got.items()}
    # the filled markers beyond the interval take the family's style too
    in_bars = {id(x) for b in ax.containers for x in (b.lines[0], *b.lines[1])}
    filled = [ln for ln in ax.get_lines() if id(ln) not in in_bars
              and ln.get_color() != "black"]  # (the line at 0)
    assert sorted((ln.get_color(), ln.get_marker()) for ln in filled) == sorted(
        style[:2] for style in got.values())


def test_comparison_figure_errors():
    from kvevict.replay import Comparison

    with pytest.raises(ConfigError, match="at least one comparison"):
        report.comparison_figure([], "t")
    other = Comparison("arc", "learned", 1000, "block_hit_ratio", 0.1, 0.1,
                       Interval(0.0, 0.01, 15))
    with pytest.raises(ConfigError, match="one baseline and one metric; got "
                                          "lru/block_hit_ratio and learned/block_hit_ratio"):
        report.comparison_figure([*_comparisons(), other], "t")


def test_plots_write_reproducible_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("a", "b"):
        report.plot_hit_ratio(_sweep(), tmp_path / f"hit_{name}.png", "t")
        report.plot_class_p95(_class_cells(), tmp_path / f"class_{name}.png", "t")
        report.plot_ttft_cdf({"lru": [0.1, 0.2]}, tmp_path / f"cdf_{name}.png", "t")
        report.plot_comparison(_comparisons(), tmp_path / f"versus_{name}.png", "t")
    for kind in ("hit", "class", "cdf", "versus"):
        a = (tmp_path / f"{kind}_a.png").read_bytes()
        assert a.startswith(b"\x89PNG") and a == (tmp_path / f"{kind}_b.png").read_bytes()


def test_report_imports_and_tabulates_without_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from kvevict import report\n"
            "cells = [{'policy': 'lru', 'capacity_blocks': 1, 'seed': 0, 'ttft_p95': 1.0}]\n"
            "print(report.choose_policy(cells).policy)\n"
            "try:\n    report.plot_hit_ratio(cells, 'x.png', 't')\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out == 'lru\nplots need matplotlib: pip install "kvevict[plot]"\n'
