"""Database-style replacement: LRU-K ranking plus the five-minute rule, per block.

**LRU-K** (O'Neil, O'Neil and Weikum, "The LRU-K page replacement algorithm for database
disk buffering", SIGMOD'93), K = 2 by default. A block's backward K-distance is measured from
``t_K``, the time of its K-th most recent access: the candidate with the oldest ``t_K`` goes
first. A block with fewer than K accesses has an infinite backward distance (``t_K = -inf``),
so it goes before every block with K accesses, least recently used first among such blocks
(O'Neil's rule). One-shot blocks therefore cannot flush blocks that were used twice: scan
resistance. Accesses are the block's insert and its prefix hits; with
``count_releases=True`` also the release that made it a candidate (off by default: insert and
release belong to one request, i.e. one correlated reference). Accesses less than
``correlated_period`` seconds after the previous one form a *correlated reference period* and
count as one; as in O'Neil's algorithm, the length of that period is added to the older
history entries when the next uncorrelated access arrives. Histories are kept while a block is
cached and forgotten when it is evicted (no retained-information period).

**Five-minute rule** (Gray and Putzolu, SIGMOD'87; revisited by Gray and Graefe, 1997, and
Appuswamy et al., 2019), applied per block. Keeping a block costs memory rent; dropping it
costs a recompute if it comes back. The two are equal for a re-reference interval of

    T_b = recompute_seconds(depth, block_size) * compute_value
          / (rent_per_gib_s * bytes / 2**30)

seconds, the block's *break-even interval*. ``compute_value`` is the price of one second of
(re)compute and ``rent_per_gib_s`` the price of holding one GiB of KV memory for one second,
in the same currency (only their ratio matters). The defaults price both in GPU-seconds of one
80 GiB accelerator: a second of recompute costs 1, a GiB held for a second costs 1/80 (its
share of the device). For Llama-3-8B in bf16 with 16-token blocks (2 MiB) that gives
``T_b`` of about 20 s near the start of a sequence, more for deeper (costlier) blocks. A
candidate idle (``now - last_access``, last hit or release) for longer than its ``T_b`` is
*expired* and goes before every unexpired candidate; among expired candidates the LRU-K order
holds.

Index: the LRU-K key of a candidate is time-invariant while it is a candidate (a hit first
takes it out of the candidate set), so candidates sit in a heap by that key; a second heap
ordered by expiry time (``last_access + T_b``) moves them lazily into a heap of expired ones
when `victim` is called at a later time. O(log n) per event and per expiry, O(1) amortized
stale-entry pops per victim. The manager evicts through `pop_victim`: the victim and its
``on_evict`` in one call, its heap entry popped at once.

Relation to arXiv 2411.07447 (Kim, Li, Hong and Ailamaki, "Faster LLM Inference using
DBMS-Inspired Preemption and Cache Replacement Policies"): that paper brings the same database
toolbox (cost models, the five-minute rule for KV retention) to LLM serving, together with a
DBMS-inspired *preemption* policy: when memory runs out, preempt the running request that is
cheapest to recompute (the one with the fewest processed tokens). That choice is about running
requests, not cached blocks, so it belongs to the scheduler's pluggable preemption choice
(implemented there, not here); this policy covers the residency half.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from kvevict.cost import CostModel, check_block_size, check_cost_model
from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.types import BlockInfo

__all__ = ["DBMS"]

#: Tokens per block assumed for the recompute cost of a block without token ids (vLLM's default).
DEFAULT_BLOCK_SIZE = 16
_GIB = float(1 << 30)
_NEG_INF = -math.inf


class _State:
    """Per-block access history and index entries."""

    __slots__ = ("block", "ckey", "expired", "hist", "last", "last_tick", "xkey")

    def __init__(self, block: BlockInfo, k: int) -> None:
        self.block = block
        self.hist: list[float] = [_NEG_INF] * k  # most recent uncorrelated access first
        self.last = _NEG_INF  # time of the most recent access (correlated or not)
        self.last_tick = -1  # manager tick of the most recent counted access
        self.ckey: tuple | None = None  # LRU-K key while a candidate
        self.xkey: tuple | None = None  # expiry-heap entry while an unexpired candidate
        self.expired = False


def _number(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    if positive and value == 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")
    return float(value)


@register_policy("dbms")
class DBMS(Policy):
    """LRU-K (K = 2) with per-block five-minute-rule expiry; see the module docstring.

    Args:
        k: accesses remembered per block (the K of LRU-K), an int >= 1.
        correlated_period: seconds after an access during which further accesses count as
            the same reference (0: every access counts).
        count_releases: also count the release that makes a block a candidate as an access.
        rent_per_gib_s: price of holding one GiB of KV for one second; 0 disables the
            five-minute rule (pure LRU-K).
        compute_value: price of one second of recompute, same currency, > 0.
        cost_model: the `CostModel` giving ``recompute_seconds`` (default: ``CostModel()``).
        block_size: tokens per block for the recompute cost and, when the pool keeps no KV
            bytes, for the block size in bytes; None uses the block's own token count when it
            has token ids, else 16.

    Bytes are ``BlockInfo.nbytes``, or ``cost_model.kv_bytes_per_token * block_size`` when the
    pool is metadata-only (``nbytes == 0``).
    """

    def __init__(self, k: int = 2, correlated_period: float = 0.0,
                 count_releases: bool = False, rent_per_gib_s: float = 1.0 / 80.0,
                 compute_value: float = 1.0, cost_model: CostModel | None = None,
                 block_size: int | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be an int >= 1 (the K of LRU-K), got {k!r}")
        self.k = k
        self.correlated_period = _number("correlated_period", correlated_period)
        if not isinstance(count_releases, bool):
            raise ConfigError(f"count_releases must be True or False, got {count_releases!r}")
        self.count_releases = count_releases
        self.rent_per_gib_s = _number("rent_per_gib_s", rent_per_gib_s)
        self.compute_value = _number("compute_value", compute_value, positive=True)
        self.cost_model = check_cost_model(cost_model)
        self.block_size = check_block_size(block_size)
        self._states: dict[int, _State] = {}
        self._live: list[tuple] = []  # LRU-K keys of unexpired candidates
        self._expired: list[tuple] = []  # LRU-K keys of expired candidates
        self._expiry: list[tuple] = []  # (expires, tick, id) of unexpired candidates
        self._num_live = 0
        self._num_expired = 0
        self._num_pending = 0
        self._tb_cache: dict[tuple[int, int, int], float] = {}
        self.victim_stats = {"victim_calls": 0, "stale_pops": 0}

    # -- the five-minute rule --------------------------------------------------------------

    def break_even(self, block: BlockInfo) -> float:
        """``T_b`` of ``block`` in seconds (``inf`` when memory is free or has no size)."""
        bs = self.block_size
        if bs is None:
            tokens = block.tokens
            bs = len(tokens) if tokens is not None and len(tokens) else DEFAULT_BLOCK_SIZE
        nbytes = block.nbytes or self.cost_model.kv_bytes_per_token * bs
        key = (block.depth, bs, nbytes)
        tb = self._tb_cache.get(key)
        if tb is None:
            rent = self.rent_per_gib_s * nbytes / _GIB
            if rent == 0:
                tb = math.inf
            else:
                cost = self.cost_model.recompute_seconds(block.depth, bs) * self.compute_value
                tb = cost / rent
            if len(self._tb_cache) < 1 << 16:
                self._tb_cache[key] = tb
        return tb

    # -- access history --------------------------------------------------------------------

    def _state(self, block: BlockInfo) -> _State:
        state = self._states.get(block.block_id)
        if state is not None and state.block is not block:
            # the id was reused: the old block left without an on_evict (the manager evicts
            # pinned candidates without telling the policy)
            self._leave(state)
            state = None
        if state is None:
            state = _State(block, self.k)
            self._states[block.block_id] = state
        return state

    def _access(self, state: _State, t: float, tick: int) -> None:
        hist = state.hist
        if hist[0] != _NEG_INF and t - state.last < self.correlated_period:
            state.last = t  # correlated with the previous access: the same reference
        else:
            shift = state.last - hist[0] if hist[0] != _NEG_INF else 0.0
            for i in range(len(hist) - 1, 0, -1):
                hist[i] = hist[i - 1] + shift if hist[i - 1] != _NEG_INF else _NEG_INF
            hist[0] = t
            state.last = t
        state.last_tick = tick

    def history(self, block_id: int) -> tuple[float, ...]:
        """The remembered access times of a cached block, most recent first (``-inf``: none),
        or ``()`` for a block the policy does not track."""
        state = self._states.get(block_id)
        return () if state is None else tuple(state.hist)

    # -- events ----------------------------------------------------------------------------

    def on_insert(self, block: BlockInfo, now: float) -> None:
        self._access(self._state(block), now, block.last_access_tick)

    def on_hit(self, block: BlockInfo, now: float) -> None:
        state = self._state(block)
        if state.ckey is not None:  # hits come after the manager took the block
            self._uncandidate(state)
        self._access(state, now, block.last_access_tick)

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        state = self._state(block)
        if state.ckey is not None:
            self._uncandidate(state)  # offered twice: re-index
        tick = block.last_access_tick
        if self.count_releases and tick > state.last_tick:
            self._access(state, block.last_access, tick)
        block_id = block.block_id
        state.ckey = (state.hist[-1], tick, block_id)
        expires = block.last_access + self.break_even(block)
        if expires < now:
            state.expired = True
            heapq.heappush(self._expired, state.ckey)
            self._num_expired += 1
            if len(self._expired) > 2 * self._num_expired + 64:
                self._expired = self._compact(self._expired, True)
            return
        state.expired = False
        heapq.heappush(self._live, state.ckey)
        self._num_live += 1
        if len(self._live) > 2 * self._num_live + 64:
            self._live = self._compact(self._live, False)
        if expires != math.inf:
            state.xkey = (expires, tick, block_id)
            heapq.heappush(self._expiry, state.xkey)
            self._num_pending += 1
            if len(self._expiry) > 2 * self._num_pending + 64:
                states = self._states
                heap = [x for x in self._expiry
                        if (s := states.get(x[2])) is not None and s.xkey is x]
                heapq.heapify(heap)
                self._expiry = heap

    def _uncandidate(self, state: _State) -> None:
        if state.ckey is None:
            return
        if state.expired:
            self._num_expired -= 1
        else:
            self._num_live -= 1
            if state.xkey is not None:
                self._num_pending -= 1
        state.ckey = None
        state.xkey = None
        state.expired = False

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        state = self._states.get(block.block_id)
        if state is not None and state.block is block:
            self._uncandidate(state)

    def _leave(self, state: _State) -> None:
        self._uncandidate(state)
        del self._states[state.block.block_id]

    def on_evict(self, block: BlockInfo, now: float) -> None:
        state = self._states.get(block.block_id)
        if state is not None and state.block is block:
            self._leave(state)

    # -- victim ----------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        heap, states = self._expiry, self._states
        while heap and heap[0][0] < now:
            x = heapq.heappop(heap)
            state = states.get(x[2])
            if state is None or state.xkey is not x:
                continue  # stale
            state.xkey = None
            state.expired = True
            self._num_pending -= 1
            self._num_live -= 1
            self._num_expired += 1
            heapq.heappush(self._expired, state.ckey)  # type: ignore[arg-type]

    def _compact(self, heap: list[tuple], expired: bool) -> list[tuple]:
        states = self._states
        out = [c for c in heap
               if (s := states.get(c[2])) is not None and s.ckey is c and s.expired is expired]
        heapq.heapify(out)
        return out

    def _head(self, heap: list[tuple], expired: bool) -> tuple | None:
        states = self._states
        while heap:
            c = heap[0]
            s = states.get(c[2])
            if s is not None and s.ckey is c and s.expired is expired:
                return c
            heapq.heappop(heap)
            self.victim_stats["stale_pops"] += 1
        return None

    def _top(self, now: float) -> tuple[list[tuple], tuple | None]:
        """The heap the victim is at the top of (expired candidates first) and its entry."""
        self._expire(now)
        self.victim_stats["victim_calls"] += 1
        heap = self._expired
        head = self._head(heap, True)
        if head is None:
            heap = self._live
            head = self._head(heap, False)
        return heap, head

    def victim(self, now: float) -> int | None:
        head = self._top(now)[1]
        return None if head is None else head[2]

    def pop_victim(self, now: float) -> int | None:
        """`victim` and its `on_evict` in one step (the manager's eviction loop)."""
        heap, head = self._top(now)
        if head is None:
            return None
        heapq.heappop(heap)
        self._leave(self._states[head[2]])
        return head[2]

    def is_expired(self, block_id: int, now: float) -> bool:
        """Whether a candidate has been idle longer than its break-even interval at ``now``."""
        self._expire(now)
        state = self._states.get(block_id)
        return state is not None and state.ckey is not None and state.expired

    def __len__(self) -> int:
        return self._num_live + self._num_expired

    def __repr__(self) -> str:
        return (f"DBMS(k={self.k}, correlated_period={self.correlated_period}, "
                f"rent_per_gib_s={self.rent_per_gib_s}, compute_value={self.compute_value})")
