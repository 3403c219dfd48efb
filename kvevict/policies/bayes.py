"""Bayesian reuse predictor: a Beta posterior per (block type, transition type) pair.

Source: arXiv 2604.26968 ("a Bayesian reuse predictor with Beta conjugate priors over 16
(block-type, transition-type) pairs"). The paper's exact taxonomy is not public; this is our
reading of it:

- **block type** (4), classified when a residency period begins: ``shared`` (the block has
  been used by two or more distinct sessions, ``num_sharers >= 2``), else its ``kind``:
  ``prompt`` (user or system text), ``output`` (model output: decode-appended, or a previous
  answer fed back) or ``context`` (a tool result or retrieved document).
- **transition** (4), how the period began: ``prefill`` / ``decode`` (the block was created by
  that phase, ``BlockInfo.created_by``), ``hit_own`` (a prefix hit by the session that created
  it) or ``hit_other`` (a hit by another session).

A *residency period* starts when the block is cached or hit and ends with

- a **success**: the next prefix hit (which also starts the next period), or
- a **failure**: eviction (unless ``count_evictions=False``, which treats an eviction as
  censored: no outcome), or idling past ``horizon`` seconds unused. Idle time is
  ``now - last_access`` (last hit or release) and is timed while the block is a candidate (a
  cached, unused leaf: the only state in which it competes for its slot). A failure is counted
  once, when first noticed: at the next event or ``victim`` call after the instant it happened,
  or when the block leaves the candidate set, whichever comes first. Blocks that are not
  candidates (in use, or with a cached child) are not timed: a hit on one is a success
  however long ago it was last used.

Each period's outcome updates its pair's ``Beta(alpha, beta)``: ``alpha += 1`` on success,
``beta += 1`` on failure. A candidate's score is

    score = E[p | pair] * recompute_seconds(depth, block_size) / bytes

(``E[p] = alpha / (alpha + beta)``; lowest evicted first; ``bytes`` is ``nbytes``, or the
cost model's bytes per block for a metadata-only pool; the cost per byte is rounded down to
``1 / cost_resolution`` of an octave so that near-equal costs are ordered by recency). With
``thompson=True`` the mean is replaced by one draw ``p ~ Beta(alpha, beta)`` per pair per
`victim` call (16 draws per call, whether or not they decide it), from the injected generator.
A candidate whose period has already failed (idle past the horizon) has predicted reuse 0 and
goes before every live candidate, least recently used first.

Index. The posterior changes as the policy learns, so a static heap key would go stale. Each of
the 16 pairs keeps its own heap of candidates keyed by the time-invariant
``(recompute_seconds / bytes, last_access_tick, block_id)``; `victim` multiplies the 16 heap
heads by their pair's current mean (or draw) and takes the least: O(16) per victim plus
amortized stale-entry pops, O(log n) per event. A heap ordered by idle-expiry time moves
candidates into a heap of failed ones as the clock passes their horizon (amortized O(log n)
per candidate).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvevict.cost import CostModel, check_block_size, check_cost_model
from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.types import BlockInfo

__all__ = ["BLOCK_TYPES", "PAIRS", "TRANSITIONS", "BayesReuse"]

#: Block types, in pair-index order.
BLOCK_TYPES = ("shared", "prompt", "output", "context")
#: Transition types (how a residency period began), in pair-index order.
TRANSITIONS = ("prefill", "decode", "hit_own", "hit_other")

_SHARED, _PROMPT = 0, 1
_KIND_TYPE = {"prompt": 1, "output": 2, "context": 3}
_CREATED = {"prefill": 0, "decode": 1}
_HIT_OWN, _HIT_OTHER = 2, 3
#: The 16 (block_type, transition) pairs, in pair-index order.
PAIRS = tuple((bt, tr) for bt in BLOCK_TYPES for tr in TRANSITIONS)
_NPAIRS = len(PAIRS)
_heappush = heapq.heappush
#: Tokens per block assumed for the recompute cost of a block without token ids (vLLM's default).
DEFAULT_BLOCK_SIZE = 16


def _block_type(block: BlockInfo) -> int:
    if block.num_sharers >= 2:
        return _SHARED
    return _KIND_TYPE.get(block.kind, _PROMPT)


class _State:
    """Per-block bookkeeping (every cached block the policy has heard of)."""

    __slots__ = ("block", "failed", "kind_type", "pair", "pkey", "session", "xkey")

    def __init__(self, block: BlockInfo, pair: int, kind_type: int) -> None:
        self.block = block
        # what never changes while the block is cached: its type unless shared, its session
        self.kind_type = kind_type
        self.session = block.session
        self.pair = pair  # pair of the current residency period
        self.failed = False  # the current period already ended in a failure (idle)
        self.pkey: tuple | None = None  # entry in the pair heap while a live candidate
        self.xkey: tuple | None = None  # entry in the expiry heap / failed heap


def _check_number(name: str, value: Any, *, positive: bool = False,
                  allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if math.isinf(value) and not allow_inf:
        raise ConfigError(f"{name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return float(value)


@register_policy("bayes")
class BayesReuse(Policy):
    """Evict the candidate with the least ``P(reuse | pair) * recompute cost / bytes``.

    Args:
        horizon: seconds a candidate may stay idle before its residency period counts as a
            failure (and it is evicted first); None or ``math.inf`` disables idle failures.
        prior: ``(alpha, beta)`` of every pair's Beta prior, or a mapping
            ``{(block_type, transition): (alpha, beta)}`` overriding the default
            ``(1.0, 1.0)`` for some pairs. Both numbers must be > 0.
        thompson: draw each pair's reuse probability from its posterior at every `victim`
            call (Thompson sampling) instead of using the posterior mean. Needs ``rng``.
        rng: the ``numpy.random.Generator`` for Thompson sampling.
        cost_model: the `CostModel` giving ``recompute_seconds`` (default: ``CostModel()``).
        block_size: tokens per block for the recompute cost; None uses the block's own token
            count when it has token ids, else 16.
        count_evictions: count an eviction as a failure of the block's period (the source's
            definition). False treats it as censored (no outcome): only idling past the
            horizon is a failure, so the policy's own evictions cannot confirm its beliefs.
        cost_resolution: cost-per-byte buckets per octave: the cost is rounded down to a
            power of ``2 ** (1 / cost_resolution)``, so blocks whose costs differ by less than
            a bucket are ordered by recency (least recently used first); None: exact cost.

    Instrumentation: ``victim_stats`` counts ``victim_calls``, ``head_comparisons`` (pair
    heads scored) and ``stale_pops`` (lazily deleted heap entries discarded).
    """

    def __init__(self, horizon: float | None = 300.0,
                 prior: tuple[float, float] | Mapping[tuple[str, str], tuple[float, float]]
                 = (1.0, 1.0),
                 thompson: bool = False, rng: np.random.Generator | None = None,
                 cost_model: CostModel | None = None, block_size: int | None = None,
                 count_evictions: bool = True, cost_resolution: int | None = 8) -> None:
        if horizon is None:
            horizon = math.inf
        self.horizon = _check_number("horizon", horizon, positive=True, allow_inf=True)
        self.prior_alpha = [1.0] * _NPAIRS
        self.prior_beta = [1.0] * _NPAIRS
        if isinstance(prior, Mapping):
            for pair_name, ab in prior.items():
                index = self._pair_index(pair_name)
                self.prior_alpha[index], self.prior_beta[index] = self._check_prior(ab)
        else:
            a, b = self._check_prior(prior)
            self.prior_alpha = [a] * _NPAIRS
            self.prior_beta = [b] * _NPAIRS
        if not isinstance(thompson, bool):
            raise ConfigError(f"thompson must be True or False, got {thompson!r}")
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise ConfigError("rng must be a numpy.random.Generator (e.g. "
                              f"numpy.random.default_rng(0)), got {type(rng).__name__}")
        if thompson and rng is None:
            raise ConfigError("thompson=True needs rng=numpy.random.default_rng(seed): "
                              "randomness is injected, never global")
        self.thompson = thompson
        self.rng = rng
        self.cost_model = check_cost_model(cost_model)
        self.block_size = check_block_size(block_size)
        if not isinstance(count_evictions, bool):
            raise ConfigError(f"count_evictions must be True or False, got {count_evictions!r}")
        self.count_evictions = count_evictions
        if cost_resolution is not None and (isinstance(cost_resolution, bool) or not isinstance(
                cost_resolution, int) or cost_resolution < 1):
            raise ConfigError(f"cost_resolution must be an int >= 1 (buckets per octave) or "
                              f"None, got {cost_resolution!r}")
        self.cost_resolution = cost_resolution
        self.successes = [0] * _NPAIRS
        self.failures = [0] * _NPAIRS
        self._means = [self.prior_alpha[p] / (self.prior_alpha[p] + self.prior_beta[p])
                       for p in range(_NPAIRS)]
        self._stale_means: set[int] = set()  # pairs whose counts changed since _means
        self._expired_at: float | None = None  # clock time of the last `_expire`
        self._states: dict[int, _State] = {}
        self._heaps: list[list[tuple]] = [[] for _ in range(_NPAIRS)]
        self._occupied: set[int] = set()  # pairs whose heap holds entries (live or stale)
        self._live = [0] * _NPAIRS  # live (non-failed) candidates per pair
        self._expiry: list[tuple] = []  # (last_access + horizon, tick, id) of live candidates
        self._failed: list[tuple] = []  # heap of the same tuples: failed candidates
        self._num_failed = 0
        self._num_pending = 0  # live candidates with an entry in the expiry heap
        self._cost_cache: dict[tuple[int, int, int], float] = {}
        self.victim_stats = {"victim_calls": 0, "head_comparisons": 0, "stale_pops": 0}

    # -- configuration helpers -------------------------------------------------------------

    @staticmethod
    def _check_prior(ab: Any) -> tuple[float, float]:
        if isinstance(ab, (str, bytes)) or not hasattr(ab, "__len__") or len(ab) != 2:
            raise ConfigError(f"a prior is a pair (alpha, beta) of numbers > 0, got {ab!r}")
        a = _check_number("prior alpha", ab[0], positive=True)
        b = _check_number("prior beta", ab[1], positive=True)
        return a, b

    @staticmethod
    def _pair_index(pair: Any) -> int:
        if (not isinstance(pair, tuple) or len(pair) != 2 or pair[0] not in BLOCK_TYPES
                or pair[1] not in TRANSITIONS):
            raise ConfigError(
                f"a pair is (block_type, transition) with block_type in "
                f"{', '.join(BLOCK_TYPES)} and transition in {', '.join(TRANSITIONS)}; "
                f"got {pair!r}"
            )
        return BLOCK_TYPES.index(pair[0]) * len(TRANSITIONS) + TRANSITIONS.index(pair[1])

    # -- the posterior ---------------------------------------------------------------------

    def _update(self, pair: int, success: bool) -> None:
        if success:
            self.successes[pair] += 1
        else:
            self.failures[pair] += 1
        self._stale_means.add(pair)

    def _current_means(self) -> list[float]:
        """The posterior means, brought up to date for the pairs counted since the last read
        (a request's hits and failures are batched into one division per pair)."""
        stale = self._stale_means
        if stale:
            means, pa, pb = self._means, self.prior_alpha, self.prior_beta
            succ, fail = self.successes, self.failures
            for pair in stale:
                a = pa[pair] + succ[pair]
                b = pb[pair] + fail[pair]
                means[pair] = a / (a + b)
            stale.clear()
        return self._means

    def posterior(self, now: float | None = None) -> dict[tuple[str, str], tuple[float, float]]:
        """``{(block_type, transition): (alpha, beta)}`` for all 16 pairs.

        With ``now``, idle failures up to that time are counted first.
        """
        if now is not None:
            self._expire(now)
        return {
            (bt, tr): (self.prior_alpha[p] + self.successes[p],
                       self.prior_beta[p] + self.failures[p])
            for p, (bt, tr) in enumerate(PAIRS)
        }

    def counts(self, now: float | None = None) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(block_type, transition): (successes, failures)}`` observed so far."""
        if now is not None:
            self._expire(now)
        return {
            (bt, tr): (self.successes[p], self.failures[p])
            for p, (bt, tr) in enumerate(PAIRS)
        }

    def posterior_mean(self, block_type: str, transition: str) -> float:
        """``alpha / (alpha + beta)`` of one pair."""
        return self._current_means()[self._pair_index((block_type, transition))]

    def pair_of(self, block_id: int) -> tuple[str, str] | None:
        """The (block_type, transition) of a tracked block's current period, else None."""
        state = self._states.get(block_id)
        if state is None:
            return None
        return PAIRS[state.pair]

    # -- value ---------------------------------------------------------------------------

    def cost_per_byte(self, block: BlockInfo) -> float:
        """``recompute_seconds(depth, block_size) / bytes``, rounded down to a power of
        ``2 ** (1 / cost_resolution)`` unless ``cost_resolution`` is None.

        Bytes are ``BlockInfo.nbytes``, or ``cost_model.kv_bytes_per_token * block_size``
        when the pool keeps no KV bytes (``nbytes == 0``), or 1 if that is 0 too.
        """
        bs = self.block_size
        if bs is None:
            tokens = block.tokens
            bs = len(tokens) if tokens is not None and len(tokens) else DEFAULT_BLOCK_SIZE
        key = (block.depth, bs, block.nbytes)
        value = self._cost_cache.get(key)
        if value is None:
            cm = self.cost_model
            nbytes = block.nbytes or cm.kv_bytes_per_token * bs or 1
            value = cm.recompute_seconds(block.depth, bs) / nbytes
            res = self.cost_resolution
            if res is not None and value > 0:
                value = 2.0 ** (math.floor(math.log2(value) * res + 1e-9) / res)
            if len(self._cost_cache) < 1 << 16:
                self._cost_cache[key] = value
        return value

    def score(self, block: BlockInfo, now: float) -> float:
        """The current score of a tracked block (posterior mean; 0 once its period failed)."""
        self._expire(now)
        means = self._current_means()
        state = self._states.get(block.block_id)
        if state is None:
            return means[self._start_pair(block, None)] * self.cost_per_byte(block)
        if state.failed:
            return 0.0
        return means[state.pair] * self.cost_per_byte(block)

    # -- events ----------------------------------------------------------------------------

    def _start_pair(self, block: BlockInfo, transition: int | None) -> int:
        if transition is None:
            transition = _CREATED.get(block.created_by, 0)
        return _block_type(block) * 4 + transition

    def _track(self, block: BlockInfo, transition: int | None) -> _State:
        state = self._states.get(block.block_id)
        if state is not None and state.block is not block:
            # the id was reused: the old block left without an on_evict (e.g. it was a pinned
            # candidate, which the manager evicts without telling the policy)
            self._close(state, evicted=self.count_evictions)
            state = None
        if state is None:
            state = _State(block, self._start_pair(block, transition),
                           _KIND_TYPE.get(block.kind, _PROMPT))
            self._states[block.block_id] = state
        return state

    # Every event first counts the idle failures up to ``now`` (`_expire`), once per clock
    # time: after it ran at ``now`` no live candidate can expire before ``now`` changes.

    def on_insert(self, block: BlockInfo, now: float) -> None:
        if now != self._expired_at:
            self._expire(now)
        block_id = block.block_id
        state = self._states.get(block_id)
        if state is not None and state.block is block:
            state.pair = ((_SHARED if block.num_sharers >= 2 else state.kind_type) * 4
                          + _CREATED.get(block.created_by, 0))  # _start_pair(block, None)
            state.failed = False
            return
        # _track: a new period (closing the old block of a reused id first)
        if state is not None:
            self._close(state, evicted=self.count_evictions)
        kind_type = _KIND_TYPE.get(block.kind, _PROMPT)
        self._states[block_id] = _State(
            block, (_SHARED if block.num_sharers >= 2 else kind_type) * 4
            + _CREATED.get(block.created_by, 0), kind_type)

    def on_hit(self, block: BlockInfo, now: float) -> None:
        if now != self._expired_at:
            self._expire(now)
        state = self._states.get(block.block_id)
        if state is not None and state.block is block:
            if state.pkey is not None or state.xkey is not None:  # hits come after acquire
                self._uncandidate(state, now)
            if not state.failed:  # _update(pair, True)
                self.successes[state.pair] += 1
                self._stale_means.add(state.pair)
        else:
            state = self._track(block, None)
        bt = _SHARED if block.num_sharers >= 2 else state.kind_type
        state.pair = bt * 4 + (_HIT_OWN if block.last_hit_session == state.session
                               else _HIT_OTHER)
        state.failed = False

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        if now != self._expired_at:
            self._expire(now)
        block_id = block.block_id
        state = self._states.get(block_id)
        if state is None or state.block is not block:
            state = self._track(block, None)
        elif state.pkey is not None or state.xkey is not None:
            self._uncandidate(state, now)  # offered twice: re-index
        tick = block.last_access_tick
        expires = block.last_access + self.horizon
        if state.failed or expires < now:
            if not state.failed:
                state.failed = True
                self._update(state.pair, False)
            state.xkey = (expires, tick, block_id)
            heapq.heappush(self._failed, state.xkey)
            self._num_failed += 1
            return
        bs = self.block_size
        if bs is None:
            tokens = block.tokens
            bs = len(tokens) if tokens is not None and len(tokens) else DEFAULT_BLOCK_SIZE
        cost = self._cost_cache.get((block.depth, bs, block.nbytes))
        pair = state.pair
        state.pkey = key = (self.cost_per_byte(block) if cost is None else cost, tick, block_id)
        heap = self._heaps[pair]
        _heappush(heap, key)
        if len(heap) == 1:
            self._occupied.add(pair)
        live = self._live
        live[pair] += 1
        if len(heap) > 2 * live[pair] + 64:
            self._compact_pair(pair)
        if expires != math.inf:
            state.xkey = key = (expires, tick, block_id)
            expiry = self._expiry
            _heappush(expiry, key)
            self._num_pending += 1
            if len(expiry) > 2 * self._num_pending + 64:
                self._compact_expiry()

    def _uncandidate(self, state: _State, now: float) -> None:
        if state.pkey is not None:
            self._live[state.pair] -= 1
            state.pkey = None
            if state.xkey is not None:
                self._num_pending -= 1
        elif state.xkey is not None:
            self._num_failed -= 1
            if len(self._failed) > 2 * self._num_failed + 64:
                self._compact_failed()
        state.xkey = None

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        if now != self._expired_at:
            self._expire(now)
        state = self._states.get(block.block_id)
        if state is not None and state.block is block:
            self._uncandidate(state, now)

    def _close(self, state: _State, evicted: bool) -> None:
        self._uncandidate(state, 0.0)
        if evicted and not state.failed:
            self._update(state.pair, False)
        del self._states[state.block.block_id]

    def on_evict(self, block: BlockInfo, now: float) -> None:
        if now != self._expired_at:
            self._expire(now)
        state = self._states.get(block.block_id)
        if state is not None and state.block is block:
            if state.pkey is not None or state.xkey is not None:
                self._uncandidate(state, now)
            if self.count_evictions and not state.failed:  # _close, inlined
                self.failures[state.pair] += 1
                self._stale_means.add(state.pair)
            del self._states[block.block_id]

    # -- idle failures ---------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Move live candidates idle for longer than the horizon to the failed heap."""
        if now == self._expired_at:
            return
        self._expired_at = now
        heap = self._expiry
        states = self._states
        while heap and heap[0][0] < now:
            key = heapq.heappop(heap)
            state = states.get(key[2])
            if state is None or state.xkey is not key or state.pkey is None:
                continue  # stale entry
            self._live[state.pair] -= 1
            self._num_pending -= 1
            state.pkey = None
            state.failed = True
            self._update(state.pair, False)
            heapq.heappush(self._failed, key)
            self._num_failed += 1

    # -- victim ----------------------------------------------------------------------------

    def victim(self, now: float) -> int | None:
        best = self._best(now)
        return None if best is None else best[0][2]

    def pop_victim(self, now: float) -> int | None:
        """`victim` and `on_evict` in one call: the chosen heap head is popped at once (no
        stale entry left behind) and its period closed as `on_evict` closes it."""
        best = self._best(now)
        if best is None:
            return None
        key, pair = best
        block_id = key[2]
        state = self._states.pop(block_id)
        if pair < 0:  # a failed candidate (its failure already counted)
            heapq.heappop(self._failed)
            self._num_failed -= 1
        else:
            heapq.heappop(self._heaps[pair])
            self._live[pair] -= 1
            if state.xkey is not None:
                self._num_pending -= 1  # its expiry entry is stale now
            if self.count_evictions:
                # the failure, and its pair's mean brought up to date at once (the next
                # victim then finds nothing stale), as `_current_means` computes it
                fail = self.failures[pair] = self.failures[pair] + 1
                if pair not in self._stale_means:
                    a = self.prior_alpha[pair] + self.successes[pair]
                    b = self.prior_beta[pair] + fail
                    self._means[pair] = a / (a + b)
        state.pkey = state.xkey = None
        return block_id

    def _best(self, now: float) -> tuple[tuple, int] | None:
        """The victim's live heap entry and its pair (-1: the failed heap), or None. Stale
        entries ahead of it are popped; the entry itself stays in its heap, at the top."""
        if now != self._expired_at:
            self._expire(now)
        if self.thompson:  # one draw per pair per call, used or not: reproducible streams
            alpha = np.add(self.prior_alpha, self.successes)
            beta = np.add(self.prior_beta, self.failures)
            means = self.rng.beta(alpha, beta).tolist()  # type: ignore[union-attr]
        else:
            means = self._current_means() if self._stale_means else self._means
        states = self._states
        stats = self.victim_stats
        stats["victim_calls"] += 1
        stale = 0
        failed = self._failed
        while failed:
            key = failed[0]
            state = states.get(key[2])
            if state is not None and state.xkey is key and state.pkey is None:
                if stale:
                    stats["stale_pops"] += stale
                return key, -1
            heapq.heappop(failed)
            stale += 1
        # the least (score, tick, id) over the pairs' heads; unique, so any visiting order
        best: tuple | None = None
        best_pair = -1
        best_score = 0.0
        compared = 0
        heaps = self._heaps
        emptied = None
        for pair in self._occupied:
            heap = heaps[pair]
            while heap:
                key = heap[0]
                state = states.get(key[2])
                if state is not None and state.pkey is key:
                    break
                heapq.heappop(heap)
                stale += 1
            if not heap:
                emptied = [pair] if emptied is None else [*emptied, pair]
                continue
            compared += 1
            key = heap[0]
            score = means[pair] * key[0]
            if (best is None or score < best_score
                    or (score == best_score and (key[1], key[2]) < (best[1], best[2]))):
                best, best_score, best_pair = key, score, pair
        if emptied is not None:
            self._occupied.difference_update(emptied)
        stats["head_comparisons"] += compared
        if stale:
            stats["stale_pops"] += stale
        return None if best is None else (best, best_pair)

    # -- compaction ----------------------------------------------------------------------

    def _compact_pair(self, pair: int) -> None:
        states = self._states
        heap = [k for k in self._heaps[pair]
                if (s := states.get(k[2])) is not None and s.pkey is k]
        heapq.heapify(heap)
        self._heaps[pair] = heap
        if heap:
            self._occupied.add(pair)
        else:
            self._occupied.discard(pair)

    def _compact_expiry(self) -> None:
        states = self._states
        heap = [k for k in self._expiry
                if (s := states.get(k[2])) is not None and s.xkey is k and s.pkey is not None]
        heapq.heapify(heap)
        self._expiry = heap

    def _compact_failed(self) -> None:
        states = self._states
        heap = [k for k in self._failed
                if (s := states.get(k[2])) is not None and s.xkey is k and s.pkey is None]
        heapq.heapify(heap)
        self._failed = heap

    def __len__(self) -> int:
        return sum(self._live) + self._num_failed

    def __repr__(self) -> str:
        return (f"BayesReuse(horizon={self.horizon}, thompson={self.thompson}, "
                f"block_size={self.block_size}, count_evictions={self.count_evictions})")
