"""MoE-nD's routing: each layer gets its own (keep ratio, K bits, V bits) under one byte budget.

Sun et al., "MoE-nD: Per-Layer Mixture-of-Experts Routing for Multi-Axis KV Cache Compression"
(arXiv:2604.17695, 2026) route every layer to its own ``(eviction ratio, K bits, V bits)``
tuple under a global memory budget, chosen by "an offline-calibrated greedy solver" that
minimizes the predicted quality loss. Only the paper's abstract was available here; the solver
below is the method as kvevict's issue 16 states it:

- a calibration table, measured by the caller: ``losses[layer][tuple]``, the loss increase of
  compressing that layer alone with that tuple (the rest uncompressed), and
  ``costs[layer][tuple]``, the bytes that layer's K/V then take (`cost_table` builds it from
  `kvevict.tokens.quant.kv_bytes`). The predicted loss of a routing is the sum over layers,
  i.e. layers are assumed to add up independently;
- `route`: start every layer at its most expensive (least lossy) tuple; while the total is
  over the budget, make the single move, over all layers and all cheaper tuples of a layer,
  with the smallest loss increase per byte saved. Two refinements of this module's follow
  (``refine=True``, the default; both only lower the predicted loss and stay within budget):
  spend what is left of the budget on the upgrades with the largest loss decrease per extra
  byte that still fit, then return the best uniform routing instead if it predicts less;
- `uniform`: the baseline, one tuple for every layer (MoE-nD's "2d_uniform");
- `optimal_route`: the exact optimum by enumeration, for small tables.

Greedy is not optimal (the problem is a multiple-choice knapsack). Measured on 2000 random
tables of 3 or 4 layers with 3 to 6 tuples each, costs of 1 to 100 bytes and a budget drawn
between the cheapest and the most expensive routing (``agreement(2000)`` in
``tests/test_tokens_solver.py``; a uniform routing fits in 1524 of them):

| losses                      | refined = optimum | plain = optimum | plain above uniform |
|-----------------------------|-------------------|-----------------|---------------------|
| independent uniform [0, 1)  | 1906 (95.3%)      | 1149 (57.5%)    | 187 of 1524 (12.3%) |
| falling with the cost       | 1568 (78.4%)      | 913 (45.7%)     | 155 of 1524 (10.2%) |

The refined routing is never above the uniform one (by construction); the plain descent can
stop well under the budget when its last move overshoots it (``test_refinement_*``).
The test asserts what always holds (within budget, never below the optimum, refined never
above uniform) and these counts on 200 tables as golden numbers.

Ties are broken deterministically: equal ratios prefer the larger byte change, then the lower
layer, then the tuple that comes first in `tuple_order` (more kept tokens, then more key bits,
then more value bits; None, unquantized, ranks above 8 bits).

Bad input raises `kvevict.errors.ConfigError`: a keep ratio outside (0, 1], a bit width other
than 2, 4, 8 or None, tables of different lengths or with different tuples for losses and
costs, NaN losses, negative costs, and a budget below the cheapest routing (both numbers
named).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.tokens.quant import BITS, kv_bytes

__all__ = [
    "Tuple",
    "check_tuple",
    "cost_table",
    "kept_tokens",
    "optimal_route",
    "route",
    "total_bytes",
    "total_loss",
    "tuple_order",
    "uniform",
]


class Tuple(NamedTuple):
    """One layer's compression: the fraction of tokens kept and the K and V bit widths.

    ``key_bits`` / ``value_bits``: 2, 4 or 8, or None for unquantized. A plain
    ``(keep_ratio, key_bits, value_bits)`` tuple compares and hashes equal to it.
    """

    keep_ratio: float
    key_bits: int | None
    value_bits: int | None


def _check_ratio(value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 < value <= 1:
        raise ConfigError(f"keep_ratio (the retention fraction) must be a number in (0, 1], "
                          f"got {value!r}")
    return float(value)


def _check_bits(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in BITS:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, BITS))} or None "
                          f"(unquantized), got {value!r}")
    return int(value)


def check_tuple(value: Any) -> Tuple:
    """``value`` as a validated `Tuple`.

    Raises:
        ConfigError: not a 3-tuple, a keep ratio outside (0, 1], or a bit width other than 2,
            4, 8 or None.
    """
    if not isinstance(value, tuple) or len(value) != 3:
        raise ConfigError(f"a tuple must be (keep_ratio, key_bits, value_bits), got {value!r}")
    return Tuple(_check_ratio(value[0]), _check_bits("key_bits", value[1]),
                 _check_bits("value_bits", value[2]))


def tuple_order(t: Tuple) -> tuple[float, float, float]:
    """Sort key, least compressed first: more kept tokens, more key bits, more value bits."""
    def rank(bits: int | None) -> float:
        return math.inf if bits is None else bits
    return (-t.keep_ratio, -rank(t.key_bits), -rank(t.value_bits))


def kept_tokens(keep_ratio: float, tokens: int) -> int:
    """Tokens a layer keeps of ``tokens`` at ``keep_ratio``: ``ceil(keep_ratio * tokens)``,
    at least 1 (0 for an empty sequence).

    The product is rounded to 9 decimals first, so ``0.15 * 1000`` keeps 150, not 151.
    """
    ratio = _check_ratio(keep_ratio)
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ConfigError(f"tokens must be an int >= 0, got {tokens!r}")
    if tokens == 0:
        return 0
    return max(1, math.ceil(round(ratio * int(tokens), 9)))


def cost_table(layout: KVLayout, tokens: int, tuples: Iterable[Any], *,
               group_size: int | None = None, key_group_size: int | None = None,
               value_group_size: int | None = None, key_axis: str = "channel",
               value_axis: str = "token") -> list[dict[Tuple, int]]:
    """``costs[layer][tuple]``: the bytes each of ``layout``'s layers takes under each tuple.

    A layer keeping ``kept_tokens(ratio, tokens)`` tokens at those bit widths, counted by
    `kvevict.tokens.quant.kv_bytes` (the same for every layer of a uniform model), with its
    group and axis arguments.
    """
    checked = [check_tuple(t) for t in tuples]
    if not checked:
        raise ConfigError("tuples must not be empty")
    row = {t: kv_bytes(layout, kept_tokens(t.keep_ratio, tokens), t.key_bits, t.value_bits,
                       group_size=group_size, key_group_size=key_group_size,
                       value_group_size=value_group_size, key_axis=key_axis,
                       value_axis=value_axis)
           for t in checked}
    return [dict(row) for _ in range(layout.num_layers)]


# -- validation of the tables ---------------------------------------------------------------


def _check_budget(budget: Any) -> float:
    ok = isinstance(budget, numbers.Real) and not isinstance(budget, bool)
    if not ok or not math.isfinite(budget) or budget < 0:
        raise ConfigError(f"budget_bytes must be a finite number >= 0, got {budget!r}")
    return budget


def _check_costs(costs: Any) -> list[dict[Tuple, int]]:
    if isinstance(costs, Mapping) or not isinstance(costs, Sequence) or not costs:
        raise ConfigError("costs must be a non-empty list with one {tuple: bytes} mapping per "
                          f"layer, got {type(costs).__name__}")
    table = []
    for layer, row in enumerate(costs):
        if not isinstance(row, Mapping) or not row:
            raise ConfigError(f"costs[{layer}] must be a non-empty {{tuple: bytes}} mapping, "
                              f"got {type(row).__name__}")
        checked = {}
        for t, nbytes in row.items():
            if (isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral)
                    or nbytes < 0):
                raise ConfigError(f"costs[{layer}][{t!r}] must be an int number of bytes >= 0, "
                                  f"got {nbytes!r}")
            checked[check_tuple(t)] = int(nbytes)
        table.append(checked)
    return table


def _check_losses(losses: Any, costs: list[dict[Tuple, int]]) -> list[dict[Tuple, float]]:
    if isinstance(losses, Mapping) or not isinstance(losses, Sequence):
        raise ConfigError("losses must be a list with one {tuple: loss} mapping per layer, got "
                          f"{type(losses).__name__}")
    if len(losses) != len(costs):
        raise ConfigError(f"losses has {len(losses)} layers and costs {len(costs)}; expected "
                          "one row per layer in both")
    table = []
    for layer, row in enumerate(losses):
        if not isinstance(row, Mapping):
            raise ConfigError(f"losses[{layer}] must be a {{tuple: loss}} mapping, got "
                              f"{type(row).__name__}")
        checked = {}
        for t, loss in row.items():
            ok = isinstance(loss, numbers.Real) and not isinstance(loss, bool)
            if not ok or math.isnan(loss) or math.isinf(loss):
                raise ConfigError(f"losses[{layer}][{t!r}] must be a finite number, "
                                  f"got {loss!r}")
            checked[check_tuple(t)] = float(loss)
        if set(checked) != set(costs[layer]):
            only_l = sorted(set(checked) - set(costs[layer]), key=tuple_order)
            only_c = sorted(set(costs[layer]) - set(checked), key=tuple_order)
            raise ConfigError(f"layer {layer}: losses and costs must list the same tuples; only "
                              f"in losses: {only_l}, only in costs: {only_c}")
        table.append(checked)
    return table


def total_bytes(choice: Sequence[Any], costs: Sequence[Mapping[Any, int]]) -> int:
    """Sum over layers of ``costs[layer][choice[layer]]``."""
    table = _check_costs(costs)
    if len(choice) != len(table):
        raise ConfigError(f"choice has {len(choice)} layers, costs {len(table)}")
    return sum(_lookup(table, layer, t, "costs") for layer, t in enumerate(choice))


def total_loss(choice: Sequence[Any], losses: Sequence[Mapping[Any, float]]) -> float:
    """Sum over layers of ``losses[layer][choice[layer]]``: a routing's predicted loss."""
    if len(choice) != len(losses):
        raise ConfigError(f"choice has {len(choice)} layers, losses {len(losses)}")
    return math.fsum(_lookup(losses, layer, t, "losses") for layer, t in enumerate(choice))


def _lookup(table: Sequence[Mapping[Any, Any]], layer: int, t: Any, name: str) -> Any:
    key = check_tuple(t)
    if key not in table[layer]:
        raise ConfigError(f"{name}[{layer}] has no entry for {key}")
    return table[layer][key]


def _too_small(cheapest: int, budget: float) -> ConfigError:
    return ConfigError(f"budget_bytes {budget} is below the cheapest routing ({cheapest} bytes: "
                       "every layer at its cheapest tuple); raise the budget or add cheaper "
                       "tuples")


# -- the solvers ----------------------------------------------------------------------------


def route(losses: Sequence[Mapping[Any, float]], costs: Sequence[Mapping[Any, int]],
          budget_bytes: float, *, refine: bool = True) -> list[Tuple]:
    """MoE-nD's greedy routing: one tuple per layer, total bytes within ``budget_bytes``.

    Args:
        losses: ``losses[layer][tuple]``, the calibrated loss increase of that layer alone.
        costs: ``costs[layer][tuple]``, that layer's K/V bytes (`cost_table`); the same tuples
            as ``losses`` per layer.
        budget_bytes: the most bytes all layers together may take.
        refine: after the descent, spend the budget left on loss-lowering upgrades, and return
            the best uniform routing instead when its predicted loss is lower (default).
            False gives the issue's greedy descent alone.

    Returns:
        ``[Tuple per layer]`` (module docstring: descend by the smallest loss per byte saved,
        then refill by the largest loss saved per byte).

    Raises:
        ConfigError: bad tables (module docstring), or a budget below the cheapest routing.
    """
    cost = _check_costs(costs)
    loss = _check_losses(losses, cost)
    budget = _check_budget(budget_bytes)
    orders = [sorted(row, key=tuple_order) for row in cost]
    cheapest = sum(min(row.values()) for row in cost)
    if cheapest > budget:
        raise _too_small(cheapest, budget)
    # start: the most expensive tuple of each layer (ties: the least loss, then tuple_order)
    current = [min(order, key=lambda t, c=c, lo=lo: (-c[t], lo[t]))
               for order, c, lo in zip(orders, cost, loss, strict=True)]
    total = sum(c[t] for c, t in zip(cost, current, strict=True))
    while total > budget:
        best: tuple[Any, ...] | None = None
        for layer, order in enumerate(orders):
            here = current[layer]
            for rank, t in enumerate(order):
                saved = cost[layer][here] - cost[layer][t]
                if saved <= 0:
                    continue
                key = ((loss[layer][t] - loss[layer][here]) / saved, -saved, layer, rank)
                if best is None or key < best[0]:
                    best = (key, layer, t, saved)
        assert best is not None  # some layer is above its cheapest while the total exceeds it
        _, layer, t, saved = best
        current[layer] = t
        total -= saved
    # refill: upgrades that lower the loss and still fit, the best loss saved per byte first
    while refine:
        best = None
        for layer, order in enumerate(orders):
            here = current[layer]
            for rank, t in enumerate(order):
                extra = cost[layer][t] - cost[layer][here]
                gain = loss[layer][here] - loss[layer][t]
                if gain <= 0 or total + extra > budget:
                    continue
                key = (-gain / extra if extra > 0 else -math.inf, -gain, layer, rank)
                if best is None or key < best[0]:
                    best = (key, layer, t, extra)
        if best is None:
            break
        _, layer, t, extra = best
        current[layer] = t
        total += extra
    if refine:
        shared = set.intersection(*(set(row) for row in cost))
        fitting = [t for t in sorted(shared, key=tuple_order)
                   if sum(row[t] for row in cost) <= budget]
        if fitting:
            flat = min(fitting, key=lambda t: math.fsum(row[t] for row in loss))
            if math.fsum(row[flat] for row in loss) < total_loss(current, loss):
                return [flat] * len(cost)
    return current


def uniform(tuples: Iterable[Any] | None, costs: Sequence[Mapping[Any, int]],
            budget_bytes: float,
            losses: Sequence[Mapping[Any, float]] | None = None) -> list[Tuple]:
    """The baseline: the best single tuple, used by every layer, whose total fits the budget.

    Args:
        tuples: the candidates (None: every tuple that all layers' ``costs`` list).
        costs: ``costs[layer][tuple]`` as for `route`.
        budget_bytes: the most bytes all layers together may take.
        losses: with a loss table, "best" is the least predicted loss (ties: more bytes, then
            `tuple_order`); without one, the most bytes that fit (the least compression).

    Returns:
        ``[t] * num_layers``.

    Raises:
        ConfigError: bad tables, a tuple some layer lacks, or no candidate that fits (the
            cheapest candidate's total and the budget named).
    """
    cost = _check_costs(costs)
    loss = None if losses is None else _check_losses(losses, cost)
    budget = _check_budget(budget_bytes)
    shared = set.intersection(*(set(row) for row in cost))
    if tuples is None:
        candidates = sorted(shared, key=tuple_order)
    else:
        candidates = [check_tuple(t) for t in tuples]
        missing = [t for t in candidates if t not in shared]
        if missing:
            raise ConfigError(f"tuples {missing} are not in every layer's costs")
    if not candidates:
        raise ConfigError("no tuple is listed for every layer, so there is no uniform routing")
    totals = {t: sum(row[t] for row in cost) for t in candidates}
    fitting = [t for t in candidates if totals[t] <= budget]
    if not fitting:
        raise ConfigError(f"budget_bytes {budget} is below every uniform routing (the cheapest "
                          f"is {min(totals.values())} bytes)")
    if loss is None:
        chosen = min(fitting, key=lambda t: (-totals[t], tuple_order(t)))
    else:
        chosen = min(fitting, key=lambda t: (math.fsum(row[t] for row in loss), -totals[t],
                                             tuple_order(t)))
    return [chosen] * len(cost)


def optimal_route(losses: Sequence[Mapping[Any, float]], costs: Sequence[Mapping[Any, int]],
                  budget_bytes: float, *, max_routings: int = 1_000_000) -> list[Tuple]:
    """The exact optimum by enumeration: the least predicted loss within the budget.

    Ties: fewer bytes, then the first routing in `tuple_order` per layer. For small tables
    (tests, a few layers); refuses more than ``max_routings`` routings.

    Raises:
        ConfigError: bad tables, a budget below the cheapest routing, or too many routings.
    """
    cost = _check_costs(costs)
    loss = _check_losses(losses, cost)
    budget = _check_budget(budget_bytes)
    count = math.prod(len(row) for row in cost)
    if count > max_routings:
        raise ConfigError(f"{count} routings to enumerate, more than max_routings="
                          f"{max_routings}; use route() for tables this large")
    cheapest = sum(min(row.values()) for row in cost)
    if cheapest > budget:
        raise _too_small(cheapest, budget)
    orders = [sorted(row, key=tuple_order) for row in cost]
    best: tuple[float, int] | None = None
    chosen: tuple[Tuple, ...] = ()
    for combo in itertools.product(*orders):
        nbytes = sum(c[t] for c, t in zip(cost, combo, strict=True))
        if nbytes > budget:
            continue
        key = (math.fsum(lo[t] for lo, t in zip(loss, combo, strict=True)), nbytes)
        if best is None or key < best:
            best, chosen = key, combo
    return list(chosen)
