"""The market's reuse and price model: class parameters, turn buckets, the odds ``q(t)`` of one
session, the union over a block's sharers, and the quantized cost per byte.

A block's price is ``P(reuse within H | class, turn, idle time, sharers) x cost(depth) / bytes``.
For one session of class ``c`` in turn bucket ``b``, with return probability ``p`` and mean
gap ``mu``, the odds of a reuse within ``H`` after an idle time ``t`` are::

    q(t) = (1 - exp(-H / mu)) * sigmoid(logit(p) - t / mu)

kept in log space: ``log q(t) = log_hf - softplus(t * r - L)`` with ``L = logit p``,
``r = 1 / mu`` and ``log_hf = log(1 - exp(-H / mu))`` (`ReuseModel`). Everything here is pure:
no state about blocks, sessions or candidates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.types import BlockInfo

__all__ = [
    "DEFAULT_CLASS_PARAMS",
    "NUM_TURN_BUCKETS",
    "ClassEstimate",
    "ClassParams",
    "CostBuckets",
    "Quote",
    "ReuseModel",
    "check_learning",
    "checked_cost_model",
    "is_number",
    "softplus",
    "turn_bucket",
    "union_log_p",
]

#: Turn buckets: 1 turn, 2-3, 4-7, 8-15, 16 or more.
NUM_TURN_BUCKETS = 5


def turn_bucket(turns: int) -> int:
    """Bucket of a session that has had ``turns`` turns: 0 for 1, 1 for 2-3, 2 for 4-7,
    3 for 8-15, 4 for 16 or more."""
    return min(NUM_TURN_BUCKETS - 1, max(int(turns), 1).bit_length() - 1)


def is_number(value: Any) -> bool:
    """A real number (int or float, not bool, not NaN)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == value


def checked_cost_model(cost_model: Any, block_size: Any) -> CostModel:
    """``cost_model`` (a `CostModel`, or None for the default) once it and ``block_size`` (a
    positive int or None) are checked: the two arguments every priced policy takes."""
    if cost_model is None:
        cost_model = CostModel()
    if not isinstance(cost_model, CostModel):
        raise ConfigError(f"cost_model must be a CostModel or None, got "
                          f"{type(cost_model).__name__}")
    if block_size is not None and (isinstance(block_size, bool)
                                   or not isinstance(block_size, int) or block_size < 1):
        raise ConfigError(f"block_size must be a positive int or None, got {block_size!r}")
    return cost_model


def check_learning(prior_weight: Any, memory: Any) -> None:
    """The two arguments of a learned estimate: ``prior_weight`` (pseudo-observations, a
    positive finite number) and ``memory`` (observations after which old ones weigh 1/e:
    a number > 1, or inf)."""
    if not is_number(prior_weight) or not (0 < prior_weight < math.inf):
        raise ConfigError(f"prior_weight must be a positive finite number, "
                          f"got {prior_weight!r}")
    if not is_number(memory) or not (1 < memory <= math.inf):
        raise ConfigError(f"memory must be a number > 1 (observations; inf: never forget), "
                          f"got {memory!r}")


def _p_tuple(value: Any) -> tuple[float, ...]:
    if is_number(value):
        value = (value,) * NUM_TURN_BUCKETS
    try:
        values = tuple(value)
    except TypeError:
        raise ConfigError(
            f"p_return must be a probability or a sequence of {NUM_TURN_BUCKETS} (one per turn "
            f"bucket: 1, 2-3, 4-7, 8-15, 16+ turns), got {value!r}"
        ) from None
    if len(values) != NUM_TURN_BUCKETS or not all(
        is_number(v) and 0.0 <= v <= 1.0 for v in values
    ):
        raise ConfigError(
            f"p_return must be a probability or {NUM_TURN_BUCKETS} probabilities in [0, 1] "
            f"(turn buckets 1, 2-3, 4-7, 8-15, 16+), got {value!r}"
        )
    return tuple(float(v) for v in values)


def _positive_finite(instance: Any, attribute: Any, value: Any) -> None:
    if not is_number(value) or not (0 < value < math.inf):
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _non_negative_finite(instance: Any, attribute: Any, value: Any) -> None:
    if not is_number(value) or not (0 <= value < math.inf):
        raise ConfigError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _is_bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


@attrs.frozen
class ClassParams:
    """Prior reuse model and admission terms of one workload class.

    Attributes:
        p_return: probability that a session comes back for another turn (within
            ``abandon_after_s``), per turn bucket (1, 2-3, 4-7, 8-15, 16+ turns so far); a
            single number means the same for every bucket.
        mean_reuse_s: mean gap (seconds) between a turn's release and the next turn's begin,
            for sessions that come back (exponential).
        abandon_after_s: a session idle this long without coming back counts as gone (a failed
            trial when learning).
        weight: what a request of this class is worth to `MarketAdmission`: it may evict
            blocks whose cost-weighted mean reuse probability is at most ``weight``.
        deferrable: whether `MarketAdmission` may make requests of this class wait.
    """

    p_return: tuple[float, ...] = attrs.field(converter=_p_tuple)
    mean_reuse_s: float = attrs.field(validator=_positive_finite)
    abandon_after_s: float = attrs.field(validator=_positive_finite)
    weight: float = attrs.field(default=1.0, validator=_non_negative_finite)
    deferrable: bool = attrs.field(default=False, validator=_is_bool)


# Sources (details in docs/policies/market.md):
# - mean_reuse_s, chat/rag 373 s: ATC'25 "KVCache Cache in the Wild" (Wang et al.), to-C trace A:
#   80% of reuses within 10 minutes; for exponential gaps 600 s / ln 5 = 373 s.
# - mean_reuse_s, agent/single_shot/batch 6.2 s: same paper, to-B API trace B: 80% of reuses
#   within 10 s; 10 s / ln 5 = 6.2 s (programmatic callers, tool round trips take seconds).
# - chat p_return 0.5 at turn 1: LMSYS-Chat-1M (Zheng et al., ICLR'24) averages 2.0 turns per
#   conversation; a geometric number of turns with mean 2 continues with probability 0.5.
#   Rising with the turn: ATC'25 (reuse per turn category) and DESIGN.md; the later values are
#   assumptions the learner corrects.
# - agent p_return 0.75 .. 0.95: InferCept (Abhyankar et al., ICML'24) observes 3 to 28
#   interceptions (tool calls) per request on average; a geometric loop of 4 to 29 segments
#   continues with probability 0.75 to 0.97.
# - rag 0.02 at turn 1: seed 003 ("a one-off RAG query produces a KV block that will almost never
#   be touched again once the response streams out"); an assumption, learned online.
# - single_shot/batch 0.01: single-turn by definition; ATC'25 trace B has < 0.1% multi-turn
#   requests. Their reuse comes from shared prompts, which the sharer union prices.
# - abandon_after_s: 1800 s for human-paced classes (< 1% of exponential gaps of mean 373 s are
#   longer), 300 s for programmatic ones.
# - weight / deferrable: DESIGN.md and seed 000 ("a batch job can't starve an interactive user");
#   interactive classes are never deferred.
#: Built-in classes; unknown classes start from ``default_class`` (chat) and learn their own.
DEFAULT_CLASS_PARAMS: dict[str, ClassParams] = {
    "chat": ClassParams((0.5, 0.7, 0.8, 0.85, 0.9), 373.0, 1800.0, 1.0, False),
    "agent": ClassParams((0.75, 0.85, 0.9, 0.95, 0.95), 6.2, 300.0, 1.0, False),
    "rag": ClassParams((0.02, 0.5, 0.7, 0.8, 0.85), 373.0, 1800.0, 0.5, False),
    "single_shot": ClassParams((0.01, 0.3, 0.5, 0.6, 0.7), 6.2, 300.0, 0.2, True),
    "batch": ClassParams((0.01, 0.3, 0.5, 0.6, 0.7), 6.2, 300.0, 0.1, True),
}


@attrs.frozen
class Quote:
    """The price of one candidate at one instant (see `Market.cheapest`)."""

    block_id: int
    price: float  #: reuse probability x cost per byte (seconds / byte, cost quantized)
    reuse_probability: float  #: P(reuse within the horizon), union over sharers
    cost_s: float  #: recompute seconds of the block (unquantized)
    nbytes: int  #: bytes the block occupies (as used in the price)
    workload_class: str


@attrs.frozen
class ClassEstimate:
    """Current (prior + learned) reuse model of a class, per turn bucket."""

    workload_class: str
    p_return: tuple[float, ...]
    mean_reuse_s: float
    returns: float  #: observed (decayed) returns
    abandons: float  #: observed (decayed) abandonments
    gap_samples: float  #: observed (decayed) reuse-gap samples


def softplus(z: float) -> float:
    """``log(1 + exp(z))``, without overflow."""
    if z > 35.0:
        return z
    if z < -35.0:
        return math.exp(z)
    return math.log1p(math.exp(z))


class ReuseModel:
    """The odds of one (class, turn bucket) in the form the price needs: ``p``, ``mu``,
    ``L = logit p``, ``r = 1 / mu`` and ``log_hf = log(1 - exp(-H / mu))``.

    One object per (class, bucket), updated in place when the estimates change, so a queue
    that holds it always prices with the current model.
    """

    __slots__ = ("L", "log_hf", "mu", "p", "r")

    def __init__(self) -> None:
        self.p = self.mu = self.L = self.r = self.log_hf = 0.0

    def set(self, p: float, mu: float, horizon: float) -> None:
        """Take the return probability ``p`` (in (0, 1)) and mean gap ``mu`` (seconds)."""
        self.update(p, mu, *self.gap_terms(mu, horizon))

    @staticmethod
    def gap_terms(mu: float, horizon: float) -> tuple[float, float]:
        """``(1 / mu, log(1 - exp(-horizon / mu)))``: what the price needs of the gap model,
        the same for every turn bucket of a class."""
        hf = -math.expm1(-horizon / mu)
        return 1.0 / mu, math.log(hf) if hf > 0 else -math.inf

    def update(self, p: float, mu: float, r: float, log_hf: float) -> None:
        """Take ``p`` and the gap terms of `gap_terms`."""
        self.p, self.mu = p, mu
        self.L = math.log(p / (1.0 - p))
        self.r = r
        self.log_hf = log_hf

    def log_q(self, idle: float) -> float:
        """log P(a reuse within the horizon | no return after ``idle`` seconds)."""
        return self.log_hf - softplus(idle * self.r - self.L)


def union_log_p(log_qs: Iterable[float], oldest: int, extra: int) -> float:
    """log P(at least one sharer comes back), from each tracked sharer's ``log q``.

    ``extra`` untracked sharers count at the odds of the tracked one at index ``oldest``
    (an upper bound). ``-inf`` when there are none.
    """
    log_qs = list(log_qs)
    if not log_qs:
        return -math.inf
    total = 0.0
    for i, lq in enumerate(log_qs):
        q = math.exp(lq)
        if q >= 1.0:
            return 0.0
        total += (1 + extra if i == oldest else 1) * math.log1p(-q)
    p = -math.expm1(total)
    if p > 0.0:
        return math.log(p)
    top = max(log_qs)  # every q underflowed: the union is the sum
    return top + math.log(sum(math.exp(lq - top) for lq in log_qs) + extra *
                          math.exp(log_qs[oldest] - top))


class CostBuckets:
    """Recompute cost of a block, its bytes, and the quantized log cost per byte the price
    uses (``1 / resolution`` of an octave), cached per ``(depth, nbytes)``.

    ``block_size`` None: taken from the first block that carries token ids, else 16.
    """

    def __init__(self, cost_model: CostModel, block_size: int | None, resolution: int) -> None:
        self.cost_model = cost_model
        self.block_size = block_size
        self.resolution = resolution
        #: (depth, nbytes) -> (quantized log cost per byte, recompute seconds, bytes)
        self.table: dict[tuple[int, int], tuple[float, float, int]] = {}

    def of(self, block: BlockInfo) -> tuple[float, float, int]:
        """(quantized log cost per byte, recompute seconds, bytes) of ``block``."""
        hit = self.table.get((block.depth, block.nbytes))
        return hit if hit is not None else self._compute(block)

    def _compute(self, block: BlockInfo) -> tuple[float, float, int]:
        bs = self.block_size
        if bs is None:
            tokens = block.tokens
            bs = self.block_size = len(tokens) if tokens is not None and len(tokens) else 16
        cm = self.cost_model
        cost = cm.recompute_seconds(block.depth, bs)
        nbytes = block.nbytes or cm.kv_bytes_per_token * bs or 1
        res = self.resolution
        bucket = round(math.log2(max(cost, 1e-300) / nbytes) * res)
        hit = self.table[(block.depth, block.nbytes)] = (bucket * math.log(2.0) / res, cost,
                                                         nbytes)
        return hit
