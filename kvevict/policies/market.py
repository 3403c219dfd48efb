"""The class-decay market: evict the candidate whose expected reload cost per byte is lowest.

A block's **price** is what keeping it is worth per byte of memory::

    price(b, now) = P(reuse within H | class, turn, idle time, sharers) x cost(depth) / bytes

and the victim is the cheapest candidate (``seeds/003``: "The KV Cache Is a Market, Not a
Cache"; DESIGN.md, "Cost and value").

**Reuse model.** Per workload class ``c`` and *turn bucket* ``b`` (how many turns the session has
had: 1, 2-3, 4-7, 8-15, 16+), a session comes back at all with probability ``p = p_return[c][b]``
and, if it does, after an exponential gap of mean ``mu_c`` ("KVCache Cache in the Wild",
ATC'25, models reuse per request category and turn with exponential reuse times). Given that
it has not come back after an idle time ``t``, the odds it comes back within the horizon ``H``
are (Bayes on the mixture "returns with prob p, exponential gap; else never")::

    q(t) = p (F(t+H) - F(t)) / (1 - p F(t)),   F(t) = 1 - exp(-t / mu)
         = (1 - exp(-H / mu)) * sigmoid(logit(p) - t / mu)

so ``q`` starts near ``p (1 - e^(-H/mu))`` and fades once ``t`` passes a few ``mu``: the session
is *abandoned* (nobody logs out cleanly; a chat user not back after half an hour is gone).
``q`` is strictly decreasing in ``t``. A block used by ``k > 1`` distinct sessions is worth the
union of their odds, ``1 - prod_i (1 - q_i(t_i))``, each sharer with its own class, turn and
idle time ``t_i`` (at least the ``max_sharers`` most recent sharers exactly; older ones, no
longer tracked, count at the oldest tracked sharer's odds, an upper bound). ``cost(depth)`` is
`CostModel.recompute_seconds` of the block (deeper blocks attend to more context); ``bytes`` is
the block's size (``kv_bytes_per_token x block_size`` of the cost model for a metadata-only
pool). Retention hints are not priced: wrap the market in ``pinned`` or use `manager.pin`.

**Defaults** per class are in `DEFAULT_CLASS_PARAMS` (sources in the comment above it and in
docs/policies/market.md); every one of them is corrected online.

**Turns.** The policy sees blocks, not requests: a session begins a turn when it hits a cached
block, or inserts its block 0 (nothing was cached), at a time it had not begun at before. A
later chunk of a chunked prefill inserts deeper blocks only and is not a turn; a resume after a
preemption that hits its prefix is (indistinguishable from a begin). Requests without a
session id are all first turns and teach nothing.

**Learned online.** Each turn of a session is a trial: it succeeds when the session begins
another turn (its gap, from its last release to the new begin, is a reuse-gap sample) and fails
once it has been idle ``abandon_after_s``. Per class and turn bucket, ``p`` is a Beta posterior
mean (``prior_weight`` pseudo-trials at the default); per class, ``mu`` is estimated in log
space (``E[log gap] = log mu - gamma`` for exponential gaps, Euler's gamma), robust to the
heavy tail of human think times, with ``prior_weight`` pseudo-samples at the default. Counts
decay by ``1 - 1/memory`` per observation so the estimates follow a drifting workload. Traces
without class labels (everything "chat") still learn, and the turn buckets separate the
sessions that keep coming back from the ones that never do. Evictions are not counted as
non-returns (that would let the policy confirm its own choices): a session that comes back to
an evicted prefix is still seen, through the blocks it recomputes. New estimates take effect at
the next distinct clock time at which a victim or quote is asked for.

**Victim selection without a scan.** Candidates live in one recency queue (a heap ordered by
``last_access_tick``) per key ``(class, turn bucket, cost bucket)``; shared blocks go to queues
keyed by ``(class, sharer bucket, cost bucket)``. Within a private queue every block has the same
class parameters and (quantized) cost, and ``q`` decreases with idle time, so the head is exactly
the cheapest; the victim is the cheapest head (cf. ATC'25's per-category queues). Costs are
quantized to ``1 / cost_resolution`` of an octave (the price uses the quantized cost, so the
order is exact for the price as defined). Within a shared queue the order by most recent use
is an approximation (the union depends on all sharers' times). Head prices are cached for the
current clock time: a run of evictions at one instant costs O(log n + log Q) each, a new
instant O(Q) once, with Q the number of non-empty queues (a few dozen at most), never O(n).

`MarketAdmission` defers low-value requests (batch, single-shot) whose evictions would destroy
state priced above what the request is worth, for at most ``max_wait`` seconds.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvevict.admission import Admission, AdmissionDecision
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.types import BlockInfo, Request

if TYPE_CHECKING:
    from kvevict.manager import KVCacheManager

__all__ = [
    "DEFAULT_CLASS_PARAMS",
    "NUM_TURN_BUCKETS",
    "ClassEstimate",
    "ClassParams",
    "Market",
    "MarketAdmission",
    "Quote",
    "turn_bucket",
]

#: Turn buckets: 1 turn, 2-3, 4-7, 8-15, 16 or more.
NUM_TURN_BUCKETS = 5
_EULER = 0.5772156649015329
_P_MIN, _P_MAX = 1e-4, 1.0 - 1e-4
_MIN_GAP_S = 1e-3


def turn_bucket(turns: int) -> int:
    """Bucket of a session that has had ``turns`` turns: 0 for 1, 1 for 2-3, 2 for 4-7,
    3 for 8-15, 4 for 16 or more."""
    return min(NUM_TURN_BUCKETS - 1, max(int(turns), 1).bit_length() - 1)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == value


def _p_tuple(value: Any) -> tuple[float, ...]:
    if _is_number(value):
        value = (value,) * NUM_TURN_BUCKETS
    try:
        values = tuple(value)
    except TypeError:
        raise ConfigError(
            f"p_return must be a probability or a sequence of {NUM_TURN_BUCKETS} (one per turn "
            f"bucket: 1, 2-3, 4-7, 8-15, 16+ turns), got {value!r}"
        ) from None
    if len(values) != NUM_TURN_BUCKETS or not all(
        _is_number(v) and 0.0 <= v <= 1.0 for v in values
    ):
        raise ConfigError(
            f"p_return must be a probability or {NUM_TURN_BUCKETS} probabilities in [0, 1] "
            f"(turn buckets 1, 2-3, 4-7, 8-15, 16+), got {value!r}"
        )
    return tuple(float(v) for v in values)


def _positive_finite(instance: Any, attribute: Any, value: Any) -> None:
    if not _is_number(value) or not (0 < value < math.inf):
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _non_negative_finite(instance: Any, attribute: Any, value: Any) -> None:
    if not _is_number(value) or not (0 <= value < math.inf):
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


def _softplus(z: float) -> float:
    if z > 35.0:
        return z
    if z < -35.0:
        return math.exp(z)
    return math.log1p(math.exp(z))


class _Par:
    """Current model of one (class, turn bucket): logit p, 1/mu, log(1 - exp(-H/mu))."""

    __slots__ = ("L", "log_hf", "mu", "p", "r")

    def __init__(self) -> None:
        self.p = self.mu = self.L = self.r = self.log_hf = 0.0


class _Queue:
    """One recency queue: a heap of entries ``(tick, seq, block_id, block, queue)``."""

    __slots__ = ("heap", "key", "log_c", "n", "par", "shared")

    def __init__(self, key: tuple, par: _Par | None, log_c: float) -> None:
        self.key = key
        self.par = par
        self.log_c = log_c
        self.shared = par is None
        self.heap: list[tuple] = []
        self.n = 0


class _Session:
    __slots__ = ("cls", "last_begin", "last_seen", "pending", "turns")

    def __init__(self, cls: str, now: float) -> None:
        self.cls = cls
        self.turns = 1
        self.last_begin = now
        self.last_seen = now
        self.pending = False


class _Stats:
    __slots__ = ("fail", "log_gap_sum", "n_gap", "succ")

    def __init__(self) -> None:
        self.succ = [0.0] * NUM_TURN_BUCKETS
        self.fail = [0.0] * NUM_TURN_BUCKETS
        self.log_gap_sum = 0.0
        self.n_gap = 0.0

    def decay(self, g: float) -> None:
        self.succ = [x * g for x in self.succ]
        self.fail = [x * g for x in self.fail]
        self.log_gap_sum *= g
        self.n_gap *= g


@register_policy("market")
class Market(Policy):
    """Evict the candidate with the lowest price (reuse odds x reload cost / bytes).

    Args:
        cost_model: recompute costs (default: `CostModel()`, Llama-3-8B on an H100).
        block_size: tokens per block, for the cost of a block's depth. None: taken from the
            first block that carries token ids, else 16 (hash-only traces carry none).
        horizon: seconds ahead over which reuse is counted (``H``).
        class_params: per-class overrides: a `ClassParams`, or a mapping of some of its fields
            (merged over the built-in defaults, or over ``default_class``'s for a new class).
        default_class: the class whose defaults an unknown class starts from.
        learn: learn ``p_return`` and ``mean_reuse_s`` online from observed returns.
        prior_weight: pseudo-observations the defaults are worth when learning.
        memory: observations after which old ones weigh ``1/e`` (exponential forgetting).
        cost_resolution: cost buckets per octave (the price uses the bucket's cost).
        max_sessions: sessions whose turn counts are remembered (least recently active forgotten).
        max_sharers: most recent sharers tracked exactly per shared block.
    """

    def __init__(self, cost_model: CostModel | None = None, *, block_size: int | None = None,
                 horizon: float = 60.0,
                 class_params: Mapping[str, ClassParams | Mapping[str, Any]] | None = None,
                 default_class: str = "chat", learn: bool = True, prior_weight: float = 8.0,
                 memory: float = 1000.0, cost_resolution: int = 8,
                 max_sessions: int = 100_000, max_sharers: int = 64) -> None:
        if cost_model is None:
            cost_model = CostModel()
        if not isinstance(cost_model, CostModel):
            raise ConfigError(f"cost_model must be a CostModel or None, got "
                              f"{type(cost_model).__name__}")
        if block_size is not None and (isinstance(block_size, bool)
                                       or not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block_size must be a positive int or None, got {block_size!r}")
        if not _is_number(horizon) or not (0 < horizon < math.inf):
            raise ConfigError(f"horizon must be a positive finite number of seconds, "
                              f"got {horizon!r}")
        if not isinstance(learn, bool):
            raise ConfigError(f"learn must be True or False, got {learn!r}")
        if not _is_number(prior_weight) or not (0 < prior_weight < math.inf):
            raise ConfigError(f"prior_weight must be a positive finite number, "
                              f"got {prior_weight!r}")
        if not _is_number(memory) or not (1 < memory <= math.inf):
            raise ConfigError(f"memory must be a number > 1 (observations; inf: never forget), "
                              f"got {memory!r}")
        for name, value, low in (("cost_resolution", cost_resolution, 1),
                                 ("max_sessions", max_sessions, 1),
                                 ("max_sharers", max_sharers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(default_class, str) or not default_class:
            raise ConfigError(f"default_class must be a non-empty class name, "
                              f"got {default_class!r}")
        params = dict(DEFAULT_CLASS_PARAMS)
        if class_params is not None:
            if not isinstance(class_params, Mapping):
                raise ConfigError("class_params must map class names to ClassParams or to "
                                  f"dicts of ClassParams fields, got "
                                  f"{type(class_params).__name__}")
            fields = [f.name for f in attrs.fields(ClassParams)]
            for cls, override in class_params.items():
                if not isinstance(cls, str) or not cls:
                    raise ConfigError(f"class_params keys must be class names, got {cls!r}")
                if isinstance(override, ClassParams):
                    params[cls] = override
                    continue
                if not isinstance(override, Mapping):
                    raise ConfigError(f"class_params[{cls!r}] must be a ClassParams or a dict "
                                      f"of its fields ({', '.join(fields)}), got {override!r}")
                unknown = [k for k in override if k not in fields]
                if unknown:
                    raise ConfigError(f"class_params[{cls!r}] has unknown field(s) "
                                      f"{', '.join(map(str, unknown))}; valid: "
                                      f"{', '.join(fields)}")
                base = params.get(cls, params.get(default_class))
                if base is None:
                    missing = [f for f in ("p_return", "mean_reuse_s", "abandon_after_s")
                               if f not in override]
                    if missing:
                        raise ConfigError(f"class_params[{cls!r}] is a new class; give "
                                          f"{', '.join(missing)}")
                    params[cls] = ClassParams(**override)
                else:
                    params[cls] = attrs.evolve(base, **override)
        if default_class not in params:
            raise ConfigError(f"default_class {default_class!r} has no parameters; known: "
                              f"{', '.join(sorted(params))} (or add it in class_params)")
        self.cost_model = cost_model
        self.block_size = block_size
        self.horizon = float(horizon)
        self.class_params: dict[str, ClassParams] = params
        self.default_class = default_class
        self.learn = learn
        self.prior_weight = float(prior_weight)
        self.memory = float(memory)
        self.cost_resolution = cost_resolution
        self.max_sessions = max_sessions
        self.max_sharers = max_sharers
        #: Price evaluations so far (one per queue head priced); for tests and profiling.
        self.price_evaluations = 0
        self._gamma = 1.0 - 1.0 / self.memory
        self._bs: int | None = block_size
        self._cost_cache: dict[tuple[int, int], tuple[float, float, int]] = {}
        self._queues: dict[tuple, _Queue] = {}
        self._live: dict[int, tuple] = {}
        self._seq = 0
        self._par: dict[tuple[str, int], _Par] = {}
        self._stats: dict[str, _Stats] = {}
        self._fifo: dict[str, deque] = {}
        self._stats_dirty = False
        self._version = 0
        self._synced_now: float | None = None
        self._sessions: OrderedDict[Any, _Session] = OrderedDict()
        # block id -> [block, its most recent sharers]; at most one entry per pool block
        self._sharer_log: dict[int, list] = {}
        # head-price cache for one clock time and parameter version
        self._hc: list[tuple] = []
        self._hc_now: float | None = None
        self._hc_version = -1
        self._dirty: set[_Queue] = set()

    # -- parameters ------------------------------------------------------------------------

    def _cp(self, cls: str) -> ClassParams:
        cp = self.class_params.get(cls)
        return cp if cp is not None else self.class_params[self.default_class]

    def _estimate(self, cls: str, tb: int) -> tuple[float, float]:
        cp = self._cp(cls)
        p, mu = cp.p_return[tb], cp.mean_reuse_s
        st = self._stats.get(cls) if self.learn else None
        if st is not None:
            w = self.prior_weight
            p = (w * p + st.succ[tb]) / (w + st.succ[tb] + st.fail[tb])
            log_mu = (w * (math.log(mu) - _EULER) + st.log_gap_sum) / (w + st.n_gap) + _EULER
            mu = math.exp(log_mu)
        return min(max(p, _P_MIN), _P_MAX), mu

    def _compute_par(self, par: _Par, cls: str, tb: int) -> None:
        p, mu = self._estimate(cls, tb)
        par.p, par.mu = p, mu
        par.L = math.log(p / (1.0 - p))
        par.r = 1.0 / mu
        hf = -math.expm1(-self.horizon / mu)
        par.log_hf = math.log(hf) if hf > 0 else -math.inf

    def _param(self, cls: str, tb: int) -> _Par:
        par = self._par.get((cls, tb))
        if par is None:
            par = self._par[(cls, tb)] = _Par()
            self._compute_par(par, cls, tb)
        return par

    def _sync(self, now: float) -> None:
        """At a new clock time: expire unreturned trials, apply what was learned."""
        if now == self._synced_now:
            return
        self._synced_now = now
        if self.learn:
            self._expire(now)
        if self._stats_dirty:
            self._stats_dirty = False
            for (cls, tb), par in self._par.items():
                self._compute_par(par, cls, tb)
            self._version += 1

    def estimate(self, workload_class: str, now: float | None = None) -> ClassEstimate:
        """The current reuse model of ``workload_class`` (prior + what was learned).

        With ``now``, sessions idle past their class's ``abandon_after_s`` at ``now`` are
        first counted as abandoned.
        """
        if not isinstance(workload_class, str) or not workload_class:
            raise ConfigError(f"workload_class must be a non-empty string, "
                              f"got {workload_class!r}")
        if now is not None:
            if not _is_number(now):
                raise ConfigError(f"now must be a clock time (number), got {now!r}")
            self._sync(float(now))
        ps, mu = [], 0.0
        for tb in range(NUM_TURN_BUCKETS):
            p, mu = self._estimate(workload_class, tb)
            ps.append(p)
        st = self._stats.get(workload_class)
        return ClassEstimate(workload_class, tuple(ps), mu,
                             sum(st.succ) if st else 0.0, sum(st.fail) if st else 0.0,
                             st.n_gap if st else 0.0)

    # -- learning --------------------------------------------------------------------------

    def _observe(self, cls: str, tb: int, gap: float | None) -> None:
        st = self._stats.get(cls)
        if st is None:
            st = self._stats[cls] = _Stats()
        if self._gamma < 1.0:
            st.decay(self._gamma)
        if gap is None:
            st.fail[tb] += 1.0
        else:
            st.succ[tb] += 1.0
            st.log_gap_sum += math.log(max(gap, _MIN_GAP_S))
            st.n_gap += 1.0
        self._stats_dirty = True

    def _open_trial(self, rec: _Session, now: float) -> None:
        rec.pending = True
        fifo = self._fifo.get(rec.cls)
        if fifo is None:
            fifo = self._fifo[rec.cls] = deque()
        fifo.append((now, rec, rec.turns))

    def _expire(self, now: float) -> None:
        for cls, fifo in list(self._fifo.items()):
            wait = self._cp(cls).abandon_after_s
            while fifo and fifo[0][0] + wait <= now:
                _, rec, turns = fifo.popleft()
                if rec.turns != turns or not rec.pending:
                    continue  # the session came back meanwhile
                if rec.last_seen + self._cp(rec.cls).abandon_after_s > now:
                    target = self._fifo.setdefault(rec.cls, deque())
                    target.append((rec.last_seen, rec, turns))  # still within its window
                    continue
                rec.pending = False
                self._observe(rec.cls, turn_bucket(turns), None)

    def _touch(self, session: Any, cls: str, now: float, own: bool, begins: bool) -> None:
        """Session ``session`` is active at ``now``; ``begins``: the event marks a begin, a new
        turn unless the session already began at ``now``. ``own``: ``cls`` is its own class."""
        if session is None:
            return
        if begins and now != self._synced_now:
            self._sync(now)  # expire old trials even if nothing is ever evicted
        sessions = self._sessions
        rec = sessions.get(session)
        if rec is None:
            if not begins:
                return
            rec = sessions[session] = _Session(cls, now)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
            if self.learn:
                self._open_trial(rec, now)
            return
        if own:
            rec.cls = cls
        if not begins or rec.last_begin == now:
            return
        if self.learn and rec.pending:
            rec.pending = False
            self._observe(rec.cls, turn_bucket(rec.turns), now - rec.last_seen)
        rec.turns += 1
        rec.last_begin = rec.last_seen = now
        sessions.move_to_end(session)
        if self.learn:
            self._open_trial(rec, now)

    # -- events ----------------------------------------------------------------------------

    def on_insert(self, block: BlockInfo, now: float) -> None:
        # A begin either hits (on_hit) or, when nothing is cached, inserts block 0 first; a
        # later chunk of a chunked prefill inserts deeper blocks only, and is not a new turn.
        if block.created_by != "prefill":
            return
        session = block.session
        rec = self._sessions.get(session)
        depth = block.depth
        if rec is not None and (depth or rec.last_begin == now):
            rec.cls = block.workload_class
            return
        self._touch(session, block.workload_class, now, True, depth == 0)

    def on_hit(self, block: BlockInfo, now: float) -> None:
        session = block.last_hit_session
        rec = self._sessions.get(session)
        if rec is None or rec.last_begin != now:
            self._touch(session, block.workload_class, now, False, True)
        if block.num_sharers > 1:
            tracked = self._sharer_log.get(block.block_id)
            if tracked is None or tracked[0] is not block:
                self._sharers_of(block)
            else:
                log = tracked[1]
                log[session] = now
                if len(log) > 2 * self.max_sharers:  # keep the most recent, amortized O(1)
                    tracked[1] = self._most_recent(log)

    def _most_recent(self, sharers: dict[Any, float]) -> dict[Any, float]:
        if len(sharers) <= self.max_sharers:
            return dict(sharers)
        return dict(sorted(sharers.items(), key=lambda kv: kv[1])[-self.max_sharers:])

    def _sharers_of(self, block: BlockInfo) -> dict[Any, float]:
        """The most recent sharers of ``block`` (``max_sharers`` to twice that), tracked from
        now on."""
        tracked = self._sharer_log.get(block.block_id)
        if tracked is not None and tracked[0] is block:
            return tracked[1]
        log = self._most_recent(block.sharers)
        self._sharer_log[block.block_id] = [block, log]
        return log

    def _cost(self, block: BlockInfo) -> tuple[float, float, int]:
        """(quantized log cost per byte, recompute seconds, bytes) of a block."""
        if self._bs is None:
            tokens = block.tokens
            self._bs = len(tokens) if tokens is not None and len(tokens) else 16
        key = (block.depth, block.nbytes)
        hit = self._cost_cache.get(key)
        if hit is None:
            cm = self.cost_model
            cost = cm.recompute_seconds(block.depth, self._bs)
            nbytes = block.nbytes or cm.kv_bytes_per_token * self._bs or 1
            res = self.cost_resolution
            bucket = round(math.log2(max(cost, 1e-300) / nbytes) * res)
            hit = self._cost_cache[key] = (bucket * math.log(2.0) / res, cost, nbytes)
        return hit

    def _classify(self, block: BlockInfo) -> tuple[_Par | None, float]:
        """(class parameters, or None for a shared block; quantized log cost per byte)."""
        log_c = self._cost(block)[0]
        if block.num_sharers > 1:
            return None, log_c
        rec = self._sessions.get(block.session)
        tb = turn_bucket(rec.turns) if rec is not None else 0
        return self._param(block.workload_class, tb), log_c

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        k = block.num_sharers
        rec = self._sessions.get(block.last_hit_session if k > 1 else block.session)
        if rec is not None and block.last_access == now:
            rec.last_seen = now  # a release: the session's idle time starts here
        cost = self._cost_cache.get((block.depth, block.nbytes))
        log_c = (cost or self._cost(block))[0]
        cls = block.workload_class
        if k > 1:
            tb = -((k - 1).bit_length())  # sharer bucket: 2, 3-4, 5-8, ...
        elif rec is None:
            tb = 0
        else:
            turns = rec.turns
            tb = 0 if turns < 2 else min(NUM_TURN_BUCKETS - 1, turns.bit_length() - 1)
        key = (cls, tb, log_c)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = _Queue(key, self._param(cls, tb) if tb >= 0 else None,
                                           log_c)
        self._seq += 1
        block_id = block.block_id
        entry = (block.last_access_tick, self._seq, block_id, block, q)
        live = self._live
        old = live.get(block_id)
        if old is not None:  # defensive: a repeated on_candidate replaces the old entry
            self._remove(block_id)
        live[block_id] = entry
        heap = q.heap
        heapq.heappush(heap, entry)
        q.n += 1
        while live.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        if heap[0] is entry:
            self._dirty.add(q)
        if len(heap) > 2 * q.n + 64:
            q.heap = [e for e in heap if live.get(e[2]) is e]
            heapq.heapify(q.heap)

    def _remove(self, block_id: int) -> None:
        live = self._live
        entry = live.get(block_id)
        if entry is None:
            return
        q = entry[4]
        heap = q.heap
        while live.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)
        if heap[0] is entry:
            heapq.heappop(heap)
            self._dirty.add(q)
        del live[block_id]
        q.n -= 1
        if q.n == 0:
            heap.clear()
            if self._queues.get(q.key) is q:
                del self._queues[q.key]

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._remove(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._remove(block.block_id)
        self._sharer_log.pop(block.block_id, None)

    # -- prices ----------------------------------------------------------------------------

    def _log_q(self, par: _Par, idle: float) -> float:
        return par.log_hf - _softplus(idle * par.r - par.L)

    def _union_log_p(self, block: BlockInfo, now: float) -> float:
        """log P(at least one sharer comes back within the horizon)."""
        log = self._sharers_of(block)
        cls = block.workload_class
        sessions = self._sessions
        log_qs = []
        oldest, oldest_t = 0, math.inf
        for session, t in log.items():
            rec = sessions.get(session)
            par = (self._param(rec.cls, turn_bucket(rec.turns)) if rec is not None
                   else self._param(cls, 0))
            if t < oldest_t:
                oldest, oldest_t = len(log_qs), t
            log_qs.append(self._log_q(par, now - t))
        if not log_qs:
            return -math.inf
        extra = max(0, block.num_sharers - len(log_qs))  # untracked: at the oldest's odds
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

    def _entry_log_price(self, entry: tuple, now: float) -> float:
        self.price_evaluations += 1
        q = entry[4]
        block = entry[3]
        if q.shared:
            return q.log_c + self._union_log_p(block, now)
        par = q.par
        return q.log_c + par.log_hf - _softplus((now - block.last_access) * par.r - par.L)

    def _log_price(self, block: BlockInfo, now: float) -> tuple[float, float]:
        """(log price, log reuse probability) of any cached block, as if a candidate now."""
        entry = self._live.get(block.block_id)
        if entry is not None and entry[3] is block:
            log_price = self._entry_log_price(entry, now)
            return log_price, log_price - entry[4].log_c
        par, log_c = self._classify(block)
        if par is None:
            log_p = self._union_log_p(block, now)
        else:
            log_p = self._log_q(par, now - block.last_access)
        return log_c + log_p, log_p

    def price(self, block: BlockInfo, now: float) -> float:
        """Price of ``block`` at ``now``: reuse probability x quantized cost / bytes
        (seconds of recompute per byte)."""
        self._sync(now)
        return math.exp(self._log_price(block, now)[0])

    def reuse_probability(self, block: BlockInfo, now: float) -> float:
        """P(``block`` is reused within the horizon | what is known at ``now``)."""
        self._sync(now)
        return math.exp(self._log_price(block, now)[1])

    # -- victim ----------------------------------------------------------------------------

    def _head(self, q: _Queue) -> tuple | None:
        heap, live = q.heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                return entry
            heapq.heappop(heap)
        return None

    def victim(self, now: float) -> int | None:
        if now != self._synced_now:
            self._sync(now)
        live = self._live
        if not live:
            return None
        hc = self._hc
        price = self._entry_log_price
        if (now != self._hc_now or self._version != self._hc_version
                or len(hc) > 4 * len(self._queues) + 64):
            hc.clear()
            self._dirty.clear()
            for q in self._queues.values():
                entry = self._head(q)
                if entry is not None:
                    hc.append((price(entry, now), entry[0], entry[1], entry))
            heapq.heapify(hc)
            self._hc_now, self._hc_version = now, self._version
        elif self._dirty:
            for q in self._dirty:
                entry = self._head(q)
                if entry is not None:
                    heapq.heappush(hc, (price(entry, now), entry[0], entry[1], entry))
            self._dirty.clear()
        while hc:
            entry = hc[0][3]
            if live.get(entry[2]) is entry:
                return entry[2]
            heapq.heappop(hc)
        self._hc_now = None  # cannot happen while candidates exist; rebuild next time
        return None

    def _sorted_entries(self, q: _Queue) -> Iterator[tuple]:
        """The live entries of ``q`` in queue order, lazily (a walk of the heap)."""
        heap, live = q.heap, self._live
        if not heap:
            return
        frontier = [(heap[0], 0)]
        size = len(heap)
        while frontier:
            entry, i = heapq.heappop(frontier)
            if live.get(entry[2]) is entry:
                yield entry
            for child in (2 * i + 1, 2 * i + 2):
                if child < size:
                    heapq.heappush(frontier, (heap[child], child))

    def cheapest(self, k: int, now: float) -> list[Quote]:
        """Quotes of the ``k`` candidates `victim` would take next at ``now``, cheapest first.

        A k-way merge over the queues: O(Q + k log Q) price evaluations, not a scan.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"k must be a non-negative int, got {k!r}")
        self._sync(now)
        merge: list[tuple] = []
        price = self._entry_log_price
        for q in self._queues.values():
            walk = self._sorted_entries(q)
            entry = next(walk, None)
            if entry is not None:
                merge.append((price(entry, now), entry[0], entry[1], entry, walk))
        heapq.heapify(merge)
        out: list[Quote] = []
        while merge and len(out) < k:
            log_price, _, _, entry, walk = heapq.heappop(merge)
            block, q = entry[3], entry[4]
            _, cost, nbytes = self._cost(block)
            out.append(Quote(entry[2], math.exp(log_price), math.exp(log_price - q.log_c),
                             cost, nbytes, block.workload_class))
            nxt = next(walk, None)
            if nxt is not None:
                heapq.heappush(merge, (price(nxt, now), nxt[0], nxt[1], nxt, walk))
        return out

    def cheapest_prices(self, k: int, now: float) -> list[float]:
        """Prices of the ``k`` cheapest candidates at ``now``, ascending."""
        return [quote.price for quote in self.cheapest(k, now)]

    @property
    def num_queues(self) -> int:
        """Non-empty recency queues (the most price evaluations one victim call costs)."""
        return len(self._queues)

    def __len__(self) -> int:
        return len(self._live)

    def __repr__(self) -> str:
        return (f"Market(horizon={self.horizon}, learn={self.learn}, "
                f"classes={sorted(self.class_params)})")


class MarketAdmission(Admission):
    """Defer a low-value request while the blocks it would evict are worth more than it is.

    For a request of class ``c`` that must evict ``n`` blocks, the market quotes the ``n``
    cheapest candidates ``i`` (reuse probability ``P_i``, recompute seconds ``cost_i``):

    - ask = ``sum_i P_i * cost_i``: the recompute the evictions are expected to cause;
    - bid = ``weight_c * sum_i cost_i``: the memory's worth to the request, i.e. the request
      may evict state whose cost-weighted mean reuse probability is at most ``weight_c``.

    If ask > bid and ``c`` is deferrable, the request waits (`AdmissionDeferred` from the
    manager, ``retry_after`` = ``retry_interval`` or the time left), at most ``max_wait``
    seconds after its first deferral, then is admitted whatever the prices. Interactive
    classes (chat, agent, rag) are never deferred by default, so a batch job cannot starve an
    interactive user, and the wait bound means the batch job is not starved either.

    Args:
        market: the `Market` the manager evicts with (it supplies the quotes).
        max_wait: seconds a request may be deferred in total.
        weights: per-class weights (default: each class's `ClassParams.weight`).
        deferrable: classes that may be deferred (default: those with
            `ClassParams.deferrable`: batch, single_shot).
        retry_interval: suggested seconds between retries.
    """

    def __init__(self, market: Market, *, max_wait: float = 30.0,
                 weights: Mapping[str, float] | None = None,
                 deferrable: Iterable[str] | None = None, retry_interval: float = 1.0) -> None:
        if not isinstance(market, Market):
            raise ConfigError(f"market must be a Market policy, got {type(market).__name__}")
        if not _is_number(max_wait) or not (0 <= max_wait < math.inf):
            raise ConfigError(f"max_wait must be a finite number of seconds >= 0, "
                              f"got {max_wait!r}")
        if not _is_number(retry_interval) or not (0 < retry_interval < math.inf):
            raise ConfigError(f"retry_interval must be a positive finite number of seconds, "
                              f"got {retry_interval!r}")
        if weights is not None:
            if not isinstance(weights, Mapping):
                raise ConfigError(f"weights must map class names to numbers >= 0, "
                                  f"got {type(weights).__name__}")
            for cls, w in weights.items():
                if not isinstance(cls, str) or not _is_number(w) or not (0 <= w < math.inf):
                    raise ConfigError(f"weights must map class names to finite numbers >= 0, "
                                      f"got {cls!r}: {w!r}")
        if deferrable is not None:
            if isinstance(deferrable, str):
                raise ConfigError("deferrable must be a collection of class names, not one "
                                  f"string ({deferrable!r}); e.g. ('batch',)")
            try:
                deferrable = frozenset(deferrable)
            except TypeError:
                raise ConfigError(f"deferrable must be a collection of class names, "
                                  f"got {deferrable!r}") from None
            if not all(isinstance(c, str) and c for c in deferrable):
                raise ConfigError(f"deferrable must hold class names, got {sorted(deferrable)}")
        self.market = market
        self.max_wait = float(max_wait)
        self.retry_interval = float(retry_interval)
        self.weights = dict(weights) if weights is not None else None
        self.deferrable = deferrable
        self.deferrals = 0  #: deferral decisions so far
        self._first: dict[Any, float] = {}

    def weight(self, workload_class: str) -> float:
        """What a request of ``workload_class`` bids per unit of cost."""
        if self.weights is not None and workload_class in self.weights:
            return float(self.weights[workload_class])
        return self.market._cp(workload_class).weight

    def is_deferrable(self, workload_class: str) -> bool:
        """Whether requests of ``workload_class`` may be made to wait."""
        if self.deferrable is not None:
            return workload_class in self.deferrable
        return self.market._cp(workload_class).deferrable

    def admit(self, request: Request, num_evictions: int, manager: KVCacheManager,
              now: float) -> AdmissionDecision:
        cls = request.workload_class
        if not self.is_deferrable(cls) or num_evictions <= 0:
            return AdmissionDecision(True)
        rid = request.request_id
        first = self._first.get(rid)
        if first is not None and now >= first + self.max_wait:
            return AdmissionDecision(True, reason=f"waited {now - first:.3g} s >= max_wait")
        quotes = self.market.cheapest(num_evictions, now)
        cost = sum(q.cost_s for q in quotes)
        ask = sum(q.reuse_probability * q.cost_s for q in quotes)
        weight = self.weight(cls)
        if ask <= weight * cost:
            return AdmissionDecision(True)
        if first is None:
            first = self._first[rid] = now
            if len(self._first) > 4096:  # forget requests their callers gave up on
                horizon = now - 2 * self.max_wait
                self._first = {k: t for k, t in self._first.items() if t >= horizon}
        self.deferrals += 1
        left = (first + self.max_wait) - now  # > 0: the deadline, not a difference of waits
        mean_p = ask / cost if cost > 0 else 1.0
        return AdmissionDecision(
            False,
            reason=(f"the {len(quotes)} cheapest blocks it would evict have a cost-weighted "
                    f"reuse probability of {mean_p:.3g}, above the {weight:.3g} a {cls} "
                    f"request is worth; it waits at most {left:.3g} s more"),
            retry_after=min(self.retry_interval, left),
        )

    def on_admitted(self, request: Request, now: float) -> None:
        self._first.pop(request.request_id, None)

    def __repr__(self) -> str:
        return f"MarketAdmission(max_wait={self.max_wait}, market={self.market!r})"
