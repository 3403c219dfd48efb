"""MoE-nD's greedy routing: the exact choice on hand-built tables, tie-breaks, the refinement,
brute-force and uniform comparisons on random tables, the byte table, bad input."""

from __future__ import annotations

import random

import pytest

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.tokens.quant import kv_bytes
from kvevict.tokens.solver import (
    Tuple,
    check_tuple,
    cost_table,
    kept_tokens,
    optimal_route,
    route,
    total_bytes,
    total_loss,
    uniform,
)

#: The first judge's shape (4 query heads of 32); the shipped judge has 2 of 64.
JUDGE = KVLayout.gqa(4, 4, 2, 32, "float32")

FULL = Tuple(1.0, None, None)
QUANT = Tuple(1.0, 4, 4)
EVICT = Tuple(0.25, None, None)
BOTH = Tuple(0.25, 4, 4)
COSTS = {FULL: 100, QUANT: 25, EVICT: 25, BOTH: 7}


def three_layers():
    """Layer 0 needs every token but takes quantization, layer 1 the reverse, layer 2 takes
    anything."""
    losses = [
        {FULL: 0.0, QUANT: 0.02, EVICT: 0.9, BOTH: 1.0},
        {FULL: 0.0, QUANT: 0.8, EVICT: 0.03, BOTH: 0.85},
        {FULL: 0.0, QUANT: 0.01, EVICT: 0.02, BOTH: 0.04},
    ]
    return losses, [dict(COSTS) for _ in range(3)]


def test_hand_built_three_layer_choice():
    losses, costs = three_layers()
    # descent from 300 bytes: layer 2 -> QUANT (0.01 / 75 per byte), layer 0 -> QUANT
    # (0.02 / 75), layer 1 -> EVICT (0.03 / 75), now 75 bytes; then layer 2 QUANT -> BOTH
    # (0.03 / 18, below layer 1's 0.82 / 18 and layer 0's 0.98 / 18): 57 bytes, done
    for refine in (True, False):
        choice = route(losses, costs, 60, refine=refine)
        assert choice == [QUANT, EVICT, BOTH]
    assert total_bytes(choice, costs) == 57
    assert total_loss(choice, losses) == pytest.approx(0.09)
    assert optimal_route(losses, costs, 60) == [QUANT, EVICT, BOTH]
    # one tuple for every layer: only BOTH fits 60 bytes (21), at 1.89
    assert uniform(None, costs, 60, losses) == [BOTH] * 3
    assert total_loss(uniform(None, costs, 60, losses), losses) == pytest.approx(1.89)
    # without losses, the uniform baseline is the least compression that fits
    assert uniform(None, costs, 75) == [QUANT] * 3  # QUANT and EVICT both 75: tuple order
    assert uniform([EVICT, BOTH], costs, 75, losses) == [EVICT] * 3
    # a budget for everything keeps everything; one for the cheapest routing gives it
    assert route(losses, costs, 300) == [FULL] * 3
    assert route(losses, costs, 21) == [BOTH] * 3


def test_ties_go_to_the_lower_layer_then_tuple_order():
    same = {FULL: 0.0, QUANT: 0.5, EVICT: 0.5, BOTH: 2.0}
    losses = [dict(same), dict(same)]
    costs = [dict(COSTS), dict(COSTS)]
    # one of the two layers must drop to 25 bytes: equal ratios, so layer 0 moves, to QUANT
    # (QUANT and EVICT cost and lose the same; QUANT keeps more tokens)
    assert route(losses, costs, 125, refine=False) == [QUANT, FULL]
    assert route(losses, costs, 125) == [QUANT, FULL]


def test_refinement_spends_the_budget_left():
    full, mid, low = Tuple(1.0, None, None), Tuple(0.5, None, None), Tuple(0.1, 2, 2)
    row = {full: 0.0, mid: 0.45, low: 0.5}
    costs = [{full: 100, mid: 60, low: 10}] * 2
    losses = [dict(row), dict(row)]
    # the descent takes layer 0 to `low` (0.5 / 90 per byte beats 0.45 / 40) and stops at
    # 110 bytes; 60 bytes are left, and `mid` (50 more) lowers the loss by 0.05
    assert route(losses, costs, 170, refine=False) == [low, full]
    assert route(losses, costs, 170) == [mid, full]
    best = optimal_route(losses, costs, 170)
    assert total_loss(best, losses) == pytest.approx(0.45) and total_bytes(best, costs) == 160


def test_refinement_falls_back_to_uniform_when_it_predicts_less():
    a, b, c = Tuple(1.0, None, None), Tuple(0.5, 8, 8), Tuple(0.1, 2, 2)
    losses = [{a: 0.0, b: 0.2, c: 0.9}, {a: 0.0, b: 0.4, c: 1.5}]
    costs = [{a: 70, b: 50, c: 10}, {a: 60, b: 40, c: 20}]
    # the descent moves layer 0 twice (0.2 / 20, then 0.7 / 40 < layer 1's 0.4 / 20) and stops
    # at 70 bytes with 0.9; no upgrade fits the 20 bytes left; b everywhere (90 bytes) has 0.6
    assert route(losses, costs, 90, refine=False) == [c, a]
    assert route(losses, costs, 90) == [b, b] == uniform(None, costs, 90, losses)
    assert total_loss(optimal_route(losses, costs, 90), losses) == pytest.approx(0.6)


def random_table(rng: random.Random, monotone: bool):
    """3-4 layers, 3-6 tuples, costs 1-100 bytes; losses random, or falling with the cost."""
    tuples = [Tuple(r, k, v) for r in (1.0, 0.5, 0.25, 0.15, 0.1)
              for k in (None, 8, 4, 2) for v in (None, 8, 4, 2)]
    layers, count = rng.choice([3, 4]), rng.randint(3, 6)
    chosen = rng.sample(tuples, count)
    costs = [{t: rng.randint(1, 100) for t in chosen} for _ in range(layers)]
    if monotone:
        losses = [{t: round(rng.uniform(0.5, 2) * (100 - c) ** 2 / 1e4, 6)
                   for t, c in row.items()} for row in costs]
    else:
        losses = [{t: round(rng.random(), 6) for t in chosen} for _ in range(layers)]
    low = sum(min(r.values()) for r in costs)
    high = sum(max(r.values()) for r in costs)
    return losses, costs, rng.randint(low, high)


def agreement(tables: int, *, seed: int = 2026, monotone: bool = False) -> dict[str, int]:
    """Counts over ``tables`` random tables: how often `route` (refined and not) equals the
    brute-force optimum's predicted loss, and is above the uniform baseline's. Asserts the
    facts that always hold."""
    rng = random.Random(seed)
    counts = {"tables": tables, "uniform_fits": 0, "optimal": 0, "optimal_plain": 0,
              "above_uniform": 0, "above_uniform_plain": 0}
    for _ in range(tables):
        losses, costs, budget = random_table(rng, monotone)
        best = total_loss(optimal_route(losses, costs, budget), losses)
        try:
            flat = total_loss(uniform(None, costs, budget, losses), losses)
            counts["uniform_fits"] += 1
        except ConfigError:
            flat = None
        for refine, suffix in ((True, ""), (False, "_plain")):
            choice = route(losses, costs, budget, refine=refine)
            assert total_bytes(choice, costs) <= budget
            got = total_loss(choice, losses)
            assert got >= best - 1e-9
            counts["optimal" + suffix] += abs(got - best) <= 1e-9
            counts["above_uniform" + suffix] += flat is not None and got > flat + 1e-9
        assert counts["above_uniform"] == 0  # the refined routing never loses to uniform
    return counts


def test_greedy_against_brute_force():
    # golden counts for this seed (the module docstring has the 2000-table figures)
    assert agreement(200) == {"tables": 200, "uniform_fits": 146, "optimal": 190,
                              "optimal_plain": 125, "above_uniform": 0,
                              "above_uniform_plain": 11}
    assert agreement(200, monotone=True) == {"tables": 200, "uniform_fits": 146,
                                             "optimal": 148, "optimal_plain": 82,
                                             "above_uniform": 0, "above_uniform_plain": 25}


def test_cost_table_from_the_layout():
    tuples = [FULL, QUANT, Tuple(0.15, 2, 4), Tuple(0.1, 8, None)]
    costs = cost_table(JUDGE, 1000, tuples)
    assert len(costs) == 4 and all(row == costs[0] for row in costs)
    assert costs[0][FULL] == 512000
    assert costs[0][QUANT] == 72256
    assert costs[0][Tuple(0.15, 2, 4)] == kv_bytes(JUDGE, 150, 2, 4)
    assert costs[0][Tuple(0.1, 8, None)] == kv_bytes(JUDGE, 100, 8, None)
    assert kept_tokens(0.15, 1000) == 150
    assert kept_tokens(0.001, 10) == 1
    assert kept_tokens(0.5, 0) == 0
    assert kept_tokens(1 / 3, 10) == 4
    # 10% of the full cache, every layer at the same tuple or routed: both fit
    budget = 0.10 * 4 * 512000
    losses = [{t: i * 0.1 + j for j, t in enumerate(tuples)} for i in range(4)]
    choice = route(losses, costs, budget)
    assert total_bytes(choice, costs) <= budget


def test_bad_input():
    losses, costs = three_layers()
    with pytest.raises(ConfigError, match=r"keep_ratio .* must be a number in \(0, 1\], got 0"):
        check_tuple((0, 4, 4))
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got 1.5"):
        kept_tokens(1.5, 10)
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got nan"):
        route([{(float("nan"), 4, 4): 0.0}], [{(float("nan"), 4, 4): 1}], 10)
    with pytest.raises(ConfigError, match="key_bits must be one of 2, 4, 8 or None"):
        check_tuple((0.5, 3, 4))
    with pytest.raises(ConfigError, match="value_bits must be one of 2, 4, 8 or None"):
        check_tuple((0.5, 4, 16))
    with pytest.raises(ConfigError, match=r"budget_bytes 20 is below the cheapest routing "
                                          r"\(21 bytes"):
        route(losses, costs, 20)
    with pytest.raises(ConfigError, match=r"budget_bytes 20 is below the cheapest routing"):
        optimal_route(losses, costs, 20)
    with pytest.raises(ConfigError, match=r"below every uniform routing \(the cheapest is 21"):
        uniform(None, costs, 20, losses)
    with pytest.raises(ConfigError, match="losses has 2 layers and costs 3"):
        route(losses[:2], costs, 100)
    with pytest.raises(ConfigError, match="layer 1: losses and costs must list the same tuples"):
        route(losses, [costs[0], {FULL: 100}, costs[2]], 300)
    with pytest.raises(ConfigError, match="must be a finite number"):
        route([{FULL: float("nan")}], [{FULL: 1}], 10)
    with pytest.raises(ConfigError, match="must be an int number of bytes >= 0"):
        route([{FULL: 0.0}], [{FULL: -1}], 10)
    with pytest.raises(ConfigError, match="budget_bytes must be a finite number >= 0"):
        route(losses, costs, float("inf"))
    with pytest.raises(ConfigError, match="not in every layer's costs"):
        uniform([Tuple(0.5, 2, 2)], costs, 100)
    with pytest.raises(ConfigError, match="more than max_routings=10"):
        optimal_route(losses, costs, 100, max_routings=10)
