"""`kvevict.stats`: Student-t quantiles against published tables, intervals on hand-computed
data, paired differences by seed, and the aggregation of cells into rows."""

from __future__ import annotations

import math

import pytest

from kvevict.errors import ConfigError
from kvevict.stats import Interval, aggregate, interval, paired, t_quantile

# -- the t quantile ---------------------------------------------------------------------------

#: Two-sided critical values from the standard tables (e.g. NIST/SEMATECH e-Handbook of
#: Statistical Methods, 1.3.6.7.2, "Critical values of the Student's t distribution").
TABLE = [
    (0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 3, 3.1824), (0.975, 4, 2.7764),
    (0.975, 5, 2.5706), (0.975, 10, 2.2281), (0.975, 29, 2.0452), (0.975, 30, 2.0423),
    (0.975, 100, 1.9840), (0.95, 5, 2.0150), (0.95, 20, 1.7247), (0.99, 7, 2.9980),
    (0.995, 1, 63.6567), (0.995, 10, 3.1693), (0.9, 1, 3.0777), (0.9, 60, 1.2958),
]


@pytest.mark.parametrize(("p", "df", "expected"), TABLE)
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_closed_forms_for_one_and_two_degrees_of_freedom():
    for p in (0.55, 0.8, 0.975, 0.999):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-10)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)),
                                                 rel=1e-10)


def test_t_quantile_is_symmetric_and_tends_to_the_normal():
    assert t_quantile(0.5, 7) == 0.0
    assert t_quantile(0.025, 4) == pytest.approx(-2.7764, abs=1e-4)
    assert t_quantile(0.975, math.inf) == pytest.approx(1.959964, abs=1e-6)
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959966, abs=1e-5)
    assert t_quantile(0.975, 4) > t_quantile(0.975, 5) > t_quantile(0.975, math.inf)


def _t_pdf(x, df):
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


@pytest.mark.parametrize("df", [1.5, 2.5, 7.25])
def test_t_quantile_of_fractional_df_against_numerical_integration_of_the_density(df):
    t = t_quantile(0.975, df)
    n = 20_000  # Simpson's rule on [0, t]: P(0 < T < t) must be 0.475
    h = t / n
    total = _t_pdf(0, df) + _t_pdf(t, df)
    total += sum((4 if k % 2 else 2) * _t_pdf(k * h, df) for k in range(1, n))
    assert total * h / 3 == pytest.approx(0.475, abs=1e-9)


@pytest.mark.parametrize(("p", "df", "match"), [(0.0, 4, "strictly between 0 and 1"),
                                                (1.0, 4, "strictly between 0 and 1"),
                                                (0.975, 0, "degrees of freedom"),
                                                (0.975, -1, "degrees of freedom")])
def test_t_quantile_rejects_bad_arguments(p, df, match):
    with pytest.raises(ConfigError, match=match):
        t_quantile(p, df)


# -- intervals --------------------------------------------------------------------------------

def test_interval_of_hand_computed_data():
    iv = interval([1, 2, 3, 4, 5])  # mean 3, s = sqrt(2.5), s / sqrt(5) = sqrt(0.5)
    assert iv.mean == 3.0 and iv.n == 5 and iv.known
    assert iv.half == pytest.approx(2.776445 * math.sqrt(0.5), rel=1e-6)  # 1.963243
    assert (iv.low, iv.high) == pytest.approx((3 - 1.963243, 3 + 1.963243), abs=1e-6)
    assert str(iv) == "3.000 ± 1.963"
    iv90 = interval([1, 2, 3, 4, 5], confidence=0.90)
    assert iv90.half == pytest.approx(2.131847 * math.sqrt(0.5), rel=1e-6)
    assert iv90.confidence == 0.90


def test_interval_of_two_values_and_of_equal_values():
    iv = interval([0.70, 0.74])  # s = 0.02 * sqrt(2), s / sqrt(2) = 0.02
    assert iv.mean == pytest.approx(0.72)
    assert iv.half == pytest.approx(12.706205 * 0.02, rel=1e-6)
    same = interval([0.5, 0.5, 0.5])
    assert same.half == 0.0 and same.low == same.high == 0.5
    assert str(same) == "0.500 ± 0.000"


def test_one_seed_has_no_interval():
    iv = interval([0.722])
    assert iv.mean == 0.722 and iv.n == 1 and not iv.known
    assert math.isnan(iv.half) and math.isnan(iv.low) and math.isnan(iv.high)
    assert str(iv) == "0.722 (1 seed)"
    assert format(iv, ",.0f") == "1 (1 seed)"


def test_interval_formatting():
    assert format(Interval(0.7221, 0.0043, 5), ".3f") == "0.722 ± 0.004"
    assert f"{Interval(0.7221, 0.0043, 5)}" == "0.722 ± 0.004"  # empty spec: .3f
    assert format(Interval(0.7221, 0.0002, 5), ".3f") == "0.722 ± <0.001"
    assert format(Interval(12345.0, 1234.4, 3), ",.0f") == "12,345 ± 1,234"
    assert format(Interval(12345.0, 0.2, 3), ",.0f") == "12,345 ± <1"
    assert format(Interval(1.5, math.nan, 3), ".2f") == "1.50 (3 seeds)"


def test_interval_as_dict_is_json_ready():
    assert Interval(0.5, 0.25, 4).as_dict() == {"mean": 0.5, "half": 0.25, "n": 4,
                                                "confidence": 0.95}
    assert interval([0.5]).as_dict() == {"mean": 0.5, "half": None, "n": 1, "confidence": 0.95}


@pytest.mark.parametrize(("values", "match"), [([], "at least one value"),
                                               ([1.0, math.nan], "finite"),
                                               ([1.0, math.inf], "finite"),
                                               ([True, 1.0], "must be numbers"),
                                               (["0.5"], "must be numbers"),
                                               ("12", "sequence of numbers")])
def test_interval_rejects_bad_values(values, match):
    with pytest.raises(ConfigError, match=match):
        interval(values)


@pytest.mark.parametrize("confidence", [0.0, 1.0, 95])
def test_interval_rejects_a_bad_confidence(confidence):
    with pytest.raises(ConfigError, match="confidence must be strictly between 0 and 1"):
        interval([1.0, 2.0], confidence)


# -- paired -----------------------------------------------------------------------------------

def test_paired_by_seed_is_the_interval_of_the_differences():
    a = {2: 30.0, 0: 10.0, 1: 20.0}  # seed order does not matter
    b = {0: 9.0, 1: 19.5, 2: 29.0}
    d = paired(a, b)  # differences 1.0, 0.5, 1.0
    assert d.mean == pytest.approx(5 / 6)
    # s = sqrt(1/12); s / sqrt(3) = 1/6
    assert d.half == pytest.approx(4.302653 / 6, rel=1e-6)
    assert d == interval([1.0, 0.5, 1.0])
    # the seed effect (10, 20, 30) cancels: the unpaired interval of a alone is ~35x wider
    assert interval(a.values()).half > 30 * d.half


def test_paired_sequences_pair_by_position():
    assert paired([3.0, 5.0], [1.0, 4.0]) == interval([2.0, 1.0])


def test_paired_rejects_mismatched_seeds_and_lengths():
    with pytest.raises(ConfigError, match=r"same seeds.*only in the first: \[2\], only in the "
                                          r"second: \[3\]"):
        paired({0: 1.0, 2: 1.0}, {0: 1.0, 3: 1.0})
    with pytest.raises(ConfigError, match="equal length, got 2 and 3"):
        paired([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="two mappings seed -> value or two sequences"):
        paired({0: 1.0}, [1.0])


# -- aggregate --------------------------------------------------------------------------------

def _cell(policy, seed, hit, p95, **extra):
    return {"policy": policy, "capacity_blocks": 100, "seed": seed, "token_hit_ratio": hit,
            "ttft_p95": p95, "evictions": 10 * (seed + 1), "workload": "chat",
            "stable": True, **extra}


def test_aggregate_makes_one_row_per_policy_and_size_with_intervals():
    cells = [
        _cell("lru", 0, 0.5, 1.0, classes={"chat": {"requests": 8, "ttft_p95": 0.5},
                                           "batch": {"requests": 2, "ttft_p95": 3.0}}),
        _cell("market", 0, 0.6, 0.8, classes={"chat": {"requests": 8, "ttft_p95": 0.4}}),
        _cell("lru", 1, 0.7, 1.4, classes={"chat": {"requests": 6, "ttft_p95": 0.7},
                                           "batch": {"requests": 4, "ttft_p95": 5.0}}),
        _cell("market", 1, 0.8, 1.2, classes={"chat": {"requests": 6, "ttft_p95": 0.6}},
              note="x"),
        {**_cell("lru", 0, 0.4, 2.0), "capacity_blocks": 50},
    ]
    rows = aggregate(cells)
    assert [(r["policy"], r["capacity_blocks"], r["seeds"]) for r in rows] == [
        ("lru", 100, 2), ("market", 100, 2), ("lru", 50, 1)]
    lru = rows[0]
    assert lru["token_hit_ratio"] == interval([0.5, 0.7])
    assert lru["ttft_p95"] == interval([1.0, 1.4])
    assert lru["evictions"] == interval([10, 20])
    assert lru["classes"]["chat"]["ttft_p95"] == interval([0.5, 0.7])
    assert lru["classes"]["batch"]["requests"] == interval([2, 4])
    assert "seed" not in lru
    assert lru["workload"] == "chat" and lru["stable"] is True  # equal non-numbers kept
    assert rows[1]["note"] == "x"  # held by one cell only: aggregated over that one
    market = rows[1]
    assert set(market["classes"]) == {"chat"}
    assert rows[2]["token_hit_ratio"].n == 1 and not rows[2]["token_hit_ratio"].known


def test_aggregate_keeps_a_key_some_seeds_lack_over_the_seeds_that_have_it():
    cells = [_cell("lru", 0, 0.5, 1.0, classes={"chat": {"ttft_p95": 0.5}}),
             _cell("lru", 1, 0.6, 1.0, classes={"chat": {"ttft_p95": 0.7},
                                                "rag": {"ttft_p95": 0.1}}),
             _cell("lru", 2, 0.7, 1.0, classes={"chat": {"ttft_p95": 0.9}})]
    row = aggregate(cells)[0]
    assert row["classes"]["chat"]["ttft_p95"].n == 3
    assert row["classes"]["rag"]["ttft_p95"] == interval([0.1])


def test_aggregate_drops_differing_non_numbers():
    cells = [_cell("lru", 0, 0.5, 1.0), {**_cell("lru", 1, 0.5, 1.0), "workload": "rag"}]
    assert "workload" not in aggregate(cells)[0]


def test_aggregate_rejects_bad_cells():
    with pytest.raises(ConfigError, match="cell 1 lacks 'seed'"):
        aggregate([_cell("lru", 0, 0.5, 1.0), {"policy": "lru", "capacity_blocks": 100}])
    with pytest.raises(ConfigError, match="two cells for policy 'lru' at 100 blocks with seed 0"):
        aggregate([_cell("lru", 0, 0.5, 1.0), _cell("lru", 0, 0.6, 1.0)])
    with pytest.raises(ConfigError, match="cell 0 must be a dict"):
        aggregate([("lru", 0)])
