"""Honest statistics over seeds: means with Student-t confidence intervals, paired differences.

A sweep runs every cell (policy × cache size × seed) once; a *cell* is one simulation's
`kvevict.run.SimResult.summary` plus ``"seed"``. This module turns cells into numbers that say
how sure they are:

- `interval`: the mean of ``n`` independent values and the half-width of its two-sided
  confidence interval, ``t(1 - (1 - confidence) / 2, n - 1) · s / √n`` with ``s`` the sample
  standard deviation (``n - 1`` in the denominator). With one value the spread is unknown: the
  half-width is ``nan`` and the interval prints as ``"0.722 (1 seed)"``.
- `paired`: the interval of the per-seed difference ``a[seed] - b[seed]``. Seeds are common
  random numbers: policy A and policy B replay the *same* requests under seed ``s``, so most of
  the seed-to-seed variation cancels in the difference and its interval is far narrower than
  the two separate intervals suggest (Law and Kelton, *Simulation Modeling and Analysis*, 3rd
  ed., §10.2 and §11.2: the paired-t interval with common random numbers).
- `aggregate`: one row per (policy, capacity_blocks) with every numeric metric of the cells,
  nested dicts such as ``"classes"`` included, as an `Interval`, and ``"seeds"``: ``n``.

The Student-t quantile is computed here (no scipy): bisection on the t distribution's CDF,
``F(t) = 1 - I_x(ν/2, 1/2) / 2`` for ``t ≥ 0`` with ``x = ν / (ν + t²)`` (Abramowitz and
Stegun 26.7.1 with 26.5.27), where the regularized incomplete beta function ``I_x(a, b)`` is
evaluated by its continued fraction (A&S 26.5.8) with the modified Lentz method (Press et al.,
*Numerical Recipes*, 3rd ed., §6.4). It matches the published tables to 1e-4 (``t(0.975, 1)
= 12.7062``, ``t(0.975, 4) = 2.7764``, ``t(0.975, 29) = 2.0452``; ``tests/test_stats.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvevict.errors import ConfigError

__all__ = ["Interval", "aggregate", "interval", "paired", "t_quantile"]

#: The keys that identify a cell's group and its replicate; they are not metrics.
GROUP_KEYS = ("policy", "capacity_blocks")
SEED_KEY = "seed"


# -- the Student-t quantile ---------------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (A&S 26.5.8), by the modified
    Lentz method; converges fast for ``x < (a + 1) / (a + b + 2)``."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge "
                          f"(a={a}, b={b}, x={x})")  # pragma: no cover - not reached for t


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    """``P(T <= t)`` for Student's t with ``df`` degrees of freedom (normal for ``inf``)."""
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=1024)
def _t_quantile(p: float, df: float) -> float:
    """`t_quantile` without the checks, cached: a sweep asks for the same few quantiles (one
    per seed count) for every metric of every row."""
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t distribution with ``df`` degrees of freedom: the ``t``
    with ``P(T <= t) = p``. ``df`` may be any positive number, or ``math.inf`` for the standard
    normal. Exact to about 1e-12 (bisection on the CDF to machine precision).

    Raises:
        ConfigError: ``p`` not strictly between 0 and 1, or ``df`` not positive.
    """
    if not 0.0 < p < 1.0:
        raise ConfigError(f"a quantile's probability must be strictly between 0 and 1, got {p}")
    if not df > 0:
        raise ConfigError(f"degrees of freedom must be positive, got {df}")
    return _t_quantile(float(p), float(df))


# -- intervals ----------------------------------------------------------------------------------

def _plain_spec(spec: str) -> str:
    return spec or ".3f"


def _format_half(half: float, spec: str) -> str:
    """The half-width in ``spec``; a positive one that rounds to zero prints as ``<`` the last
    digit (``"<0.001"``), so a tiny spread never reads as none."""
    text = format(half, spec)
    if half > 0 and float(text.replace(",", "")) == 0.0:
        decimals = _decimals(spec)
        return "<" + format(10.0 ** -decimals, f".{decimals}f")
    return text


def _decimals(spec: str) -> int:
    """The digits after the point that a fixed-point ``spec`` (``".3f"``, ``",.0f"``) prints."""
    if "." in spec:
        digits = "".join(ch for ch in spec.split(".", 1)[1] if ch.isdigit())
        if digits:
            return int(digits)
    return 6


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@attrs.frozen
class Interval:
    """A mean over ``n`` seeds and the half-width of its two-sided confidence interval.

    ``half`` is ``nan`` when ``n == 1``: one seed says nothing about the spread, so the
    interval is unknown (`known` is false; `low` and `high` are ``nan``). Formatting shows the
    mean and the half-width in the same format spec (``f"{iv:.3f}"`` gives ``"0.722 ± 0.004"``;
    a positive half-width too small for the spec gives ``"0.722 ± <0.001"``; one seed gives
    ``"0.722 (1 seed)"``). ``str`` uses ``.3f``.
    """

    mean: float
    #: ``nan`` (unknown) with one seed; two unknown half-widths compare equal
    half: float = attrs.field(eq=attrs.cmp_using(eq=_same_float), hash=False)
    n: int
    confidence: float = 0.95

    @property
    def known(self) -> bool:
        """Whether the spread is known (at least two seeds)."""
        return not math.isnan(self.half)

    @property
    def low(self) -> float:
        """``mean - half`` (``nan`` when unknown)."""
        return self.mean - self.half

    @property
    def high(self) -> float:
        """``mean + half`` (``nan`` when unknown)."""
        return self.mean + self.half

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"mean", "half", "n", "confidence"}``, ``half`` ``None`` when unknown
        (JSON has no nan)."""
        return {"mean": self.mean, "half": self.half if self.known else None, "n": self.n,
                "confidence": self.confidence}

    def __format__(self, spec: str) -> str:
        spec = _plain_spec(spec)
        mean = format(self.mean, spec)
        if not self.known:
            return f"{mean} ({self.n} seed{'s' if self.n != 1 else ''})"
        return f"{mean} ± {_format_half(self.half, spec)}"

    def __str__(self) -> str:
        return format(self, ".3f")


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be strictly between 0 and 1 (0.95 for a 95% "
                          f"interval), got {confidence}")


def _as_floats(values: Iterable[Any], what: str) -> list[float]:
    if isinstance(values, (str, bytes, Mapping)):
        raise ConfigError(f"{what} must be a sequence of numbers, got {type(values).__name__}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{what} must be numbers, got {v!r} ({type(v).__name__})")
        if not math.isfinite(v):
            raise ConfigError(f"{what} must be finite numbers, got {v!r}")
        out.append(float(v))
    return out


def interval(values: Iterable[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` (independent replicates, one per seed) and its Student-t
    confidence interval: half-width ``t(1 - (1 - confidence) / 2, n - 1) · s / √n``, with ``s``
    the sample standard deviation. One value gives an unknown (``nan``) half-width.

    Raises:
        ConfigError: no values, a value that is not a finite number, or ``confidence`` not
            strictly between 0 and 1.
    """
    _check_confidence(confidence)
    xs = _as_floats(values, "interval values")
    n = len(xs)
    if n == 0:
        raise ConfigError("an interval needs at least one value, got none")
    mean = math.fsum(xs) / n
    if n == 1:
        return Interval(mean, math.nan, 1, confidence)
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * math.sqrt(var / n)
    return Interval(mean, half, n, confidence)


def paired(a: Mapping[Any, float] | Sequence[float], b: Mapping[Any, float] | Sequence[float],
           confidence: float = 0.95) -> Interval:
    """The interval of the per-seed difference ``a - b``.

    ``a`` and ``b`` are either mappings seed -> value (paired by seed; both must hold the same
    seeds) or sequences of equal length (paired by position). Pairing is what makes a common-
    random-numbers comparison sharp: the seed's own variation cancels in each difference.

    Raises:
        ConfigError: the seeds (or lengths) differ, or a value is not a finite number.
    """
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise ConfigError("paired takes two mappings seed -> value or two sequences, "
                          f"got {type(a).__name__} and {type(b).__name__}")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            only_a = sorted(set(a) - set(b), key=repr)
            only_b = sorted(set(b) - set(a), key=repr)
            raise ConfigError(f"paired needs the same seeds on both sides; only in the first: "
                              f"{only_a}, only in the second: {only_b}")
        seeds = sorted(a, key=repr)
        xs = _as_floats([a[s] for s in seeds], "paired values")
        ys = _as_floats([b[s] for s in seeds], "paired values")
    else:
        xs = _as_floats(a, "paired values")
        ys = _as_floats(b, "paired values")
        if len(xs) != len(ys):
            raise ConfigError(f"paired needs sequences of equal length, got {len(xs)} and "
                              f"{len(ys)}")
    return interval([x - y for x, y in zip(xs, ys, strict=True)], confidence)


# -- cells to rows ------------------------------------------------------------------------------

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _aggregate_values(values: list[Any], confidence: float) -> Any:
    """One key's values across a group's cells: numbers -> `Interval`, dicts -> a dict
    aggregated key by key, equal other values -> that value; anything else -> ``None``
    (dropped)."""
    if all(_is_number(v) for v in values):
        return interval(values, confidence)
    if all(isinstance(v, Mapping) for v in values):
        return _aggregate_dicts(values, confidence)
    first = values[0]
    return first if all(v == first for v in values[1:]) else None


def _aggregate_dicts(dicts: list[Mapping[str, Any]], confidence: float,
                     skip: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    for key in keys:
        if key in skip:
            continue
        values = [d[key] for d in dicts if d.get(key) is not None]
        if not values:
            continue
        agg = _aggregate_values(values, confidence)
        if agg is not None:
            out[key] = agg
    return out


def aggregate(cells: Sequence[Mapping[str, Any]],
              confidence: float = 0.95) -> list[dict[str, Any]]:
    """One row per (policy, capacity_blocks), in the order the groups first appear in ``cells``.

    In a row, ``"policy"`` and ``"capacity_blocks"`` are the group's, ``"seeds"`` is the number
    of cells (seeds) in it, and every other key is aggregated across those cells: a numeric
    value (int or float, not bool) becomes an `Interval`; a dict (``"classes"``,
    ``"evictions_by_class"``) becomes a dict aggregated the same way, key by key; any other
    value is kept when every cell has the same one and dropped otherwise. A key that only some
    cells hold (a class absent under one seed), or that some hold as ``None`` (undefined there:
    ``resume_block_hit_ratio`` of a run in which no request resumed), is aggregated over the
    cells that hold a value: its `Interval`'s ``n`` says how many. ``"seed"`` itself is not a
    metric and is not kept.

    Raises:
        ConfigError: a cell without ``policy``, ``capacity_blocks`` or ``seed``, or two cells
            with the same policy, capacity and seed.
    """
    _check_confidence(confidence)
    groups: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    seen: set[tuple[Any, Any, Any]] = set()
    for i, cell in enumerate(cells):
        if not isinstance(cell, Mapping):
            raise ConfigError(f"cell {i} must be a dict (a SimResult.summary() plus 'seed'), "
                              f"got {type(cell).__name__}")
        missing = [k for k in (*GROUP_KEYS, SEED_KEY) if k not in cell]
        if missing:
            raise ConfigError(f"cell {i} lacks {', '.join(map(repr, missing))}: each cell is a "
                              "SimResult.summary() plus 'seed'")
        key = (cell["policy"], cell["capacity_blocks"])
        if (*key, cell[SEED_KEY]) in seen:
            raise ConfigError(f"two cells for policy {key[0]!r} at {key[1]} blocks with seed "
                              f"{cell[SEED_KEY]!r}; each (policy, size, seed) runs once")
        seen.add((*key, cell[SEED_KEY]))
        groups.setdefault(key, []).append(cell)
    rows = []
    for (policy, capacity), group in groups.items():
        row: dict[str, Any] = {"policy": policy, "capacity_blocks": capacity,
                               "seeds": len(group)}
        row.update(_aggregate_dicts(list(group), confidence, skip=(*GROUP_KEYS, SEED_KEY)))
        rows.append(row)
    return rows
