"""`KVCacheManager`: the only place that mutates cache state.

It composes a `BlockPool` (physical blocks and ref counts), a `PrefixTree` (cached blocks by
chained hash) and a `Policy` (which candidate to evict), and keeps them consistent:

- ``begin(request)``: look up the longest cached prefix, take a reference on every hit block,
  allocate the rest (evicting through the policy when the pool is full), cache the prompt's
  full blocks.
- ``append(seq_id, tokens)``: grow a running sequence; each block that fills up is hashed and
  cached (decode appends are not hits).
- ``finish(seq_id)`` / ``preempt(seq_id)``: release the blocks tail first; cached ones become
  candidates, the partial tail is freed. ``resume(seq_id)`` brings a preempted one back.
- ``pin(prefix, until)`` / ``unpin(prefix)``: explicit retention, honoured for every policy:
  a pinned candidate is evicted only when no other candidate exists.
- ``lookup(tokens)``: the cached prefix length, no side effects.
- ``stats`` and ``check()`` (every invariant; it holds after any exception).

Time comes from the injected ``clock`` (a callable returning seconds).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kvevict.admission import Admission, AlwaysAdmit
from kvevict.errors import (
    AdmissionDeferred,
    ConfigError,
    KVEvictError,
    OutOfBlocks,
    PolicyError,
)
from kvevict.policies.base import Policy, make_policy
from kvevict.policies.lru import LRU
from kvevict.pool import BlockPool
from kvevict.prefix import ROOT_HASH, PrefixTree, block_hashes
from kvevict.types import (
    BlockInfo,
    ManualClock,
    Request,
    as_token_array,
    note_sharer,
)

__all__ = ["CacheStats", "InvariantError", "KVCacheManager", "LookupResult", "Sequence"]


class InvariantError(KVEvictError, AssertionError):
    """`KVCacheManager.check()` found the cache state inconsistent (a bug, never user error)."""


@attrs.define
class CacheStats:
    """Counters since the manager was built. Token counts use vLLM's metric names."""

    prefix_cache_queries: int = 0  #: prompt tokens looked up (vLLM name)
    prefix_cache_hits: int = 0  #: of those, tokens found cached (vLLM name)
    block_queries: int = 0  #: cacheable prompt blocks looked up
    block_hits: int = 0  #: of those, blocks found cached
    requests: int = 0  #: sequences begun (resumes included)
    finished: int = 0
    preemptions: int = 0
    allocated_blocks: int = 0  #: blocks taken from the pool
    inserted_blocks: int = 0  #: blocks that became cached
    evictions: int = 0
    evictions_by_class: dict[str, int] = attrs.field(factory=dict)
    peak_blocks_used: int = 0

    @property
    def hit_ratio(self) -> float:
        """Token hit ratio ``prefix_cache_hits / prefix_cache_queries`` (0 when none)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries \
            else 0.0

    @property
    def block_hit_ratio(self) -> float:
        """``block_hits / block_queries`` (0 when none)."""
        return self.block_hits / self.block_queries if self.block_queries else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["hit_ratio"] = self.hit_ratio
        out["block_hit_ratio"] = self.block_hit_ratio
        return out


@attrs.frozen
class LookupResult:
    """What a prefix lookup found: the cached prefix, in tokens and blocks."""

    num_cached_tokens: int
    num_cached_blocks: int
    block_ids: tuple[int, ...]


class Sequence:
    """A running (or preempted) sequence: its request, known tokens and block table.

    ``block_table[i]`` is the pool block holding tokens ``[i * block_size, (i+1) *
    block_size)``. ``num_tokens`` token slots are allocated (computed or being computed);
    ``num_pending`` more are known but not yet allocated (the rest of a chunked prefill, or
    a preempted sequence's tokens to recompute). Read it; only the manager changes it.
    """

    __slots__ = ("seq_id", "request", "block_table", "num_tokens", "num_cached_tokens",
                 "num_hit_slots", "status", "_hashes", "_known", "_prompt_hashes",
                 "_prompt_slots", "_num_generated")

    def __init__(self, request: Request, prompt_hashes: list[Any], prompt_slots: int) -> None:
        self.seq_id = request.request_id
        self.request = request
        self.block_table: list[int] = []
        self.num_tokens = 0
        #: tokens found cached at the last begin / resume (real tokens, at most the known)
        self.num_cached_tokens = 0
        #: token slots the hit covered (a hash-only prompt's partial last block counts whole)
        self.num_hit_slots = 0
        self.status = "running"
        self._hashes: list[Any] = []  # hash of each cached full block, in order
        # token mode: every known token id (prompt, then generated); None for hash mode
        self._known: list[int] | None = (
            None if request.tokens is None else request.tokens.tolist()
        )
        self._prompt_hashes = prompt_hashes
        self._prompt_slots = prompt_slots
        self._num_generated = 0

    @property
    def session_id(self) -> Any:
        return self.request.session_id

    @property
    def num_known(self) -> int:
        """Token slots known so far: the prompt's plus every appended token."""
        return self._prompt_slots + self._num_generated

    @property
    def num_pending(self) -> int:
        """Known token slots not yet allocated (to prefill or recompute)."""
        return self.num_known - self.num_tokens

    def real_tokens(self, start: int, end: int) -> int:
        """Tokens of slots ``[start, end)`` that are real: a hash-only prompt whose last
        block is partial is padded to whole blocks, and padding is no work."""
        pad_lo, pad_hi = self.request.prompt_len, self._prompt_slots
        overlap = max(0, min(end, pad_hi) - max(start, pad_lo))
        return end - start - overlap

    @property
    def tokens(self) -> list[int] | None:
        """All known token ids (prompt + appended), or None for a hash-only request."""
        return None if self._known is None else list(self._known)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id!r}, status={self.status}, tokens={self.num_tokens}, "
                f"pending={self.num_pending}, blocks={len(self.block_table)}, "
                f"cached={self.num_cached_tokens})")


class KVCacheManager:
    """Paged KV-cache residency with prefix caching and a pluggable eviction policy.

    Args:
        pool: the `BlockPool` (tensor-backed or metadata-only).
        policy: a `Policy` instance or a registered name (``"lru"``, ``"lfu"``, ...).
        clock: callable returning the current time in seconds (default: a `ManualClock` at 0).
        extra_key: mixed into every block hash (model / adapter id): caches with different
            keys never share blocks.
        admission: consulted before a request evicts anything (default: `AlwaysAdmit`).
    """

    def __init__(self, pool: BlockPool, policy: Policy | str = "lru", *,
                 clock: Callable[[], float] | None = None, extra_key: Any = None,
                 admission: Admission | None = None, **policy_params: Any) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"pool must be a BlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.block_size = pool.block_size
        self.policy = make_policy(policy, **policy_params)
        if clock is not None and not callable(clock):
            raise ConfigError("clock must be a callable returning seconds")
        self.clock: Callable[[], float] = clock if clock is not None else ManualClock()
        self.extra_key = extra_key
        block_hashes([], 1, extra_key)  # validates extra_key
        if admission is not None and not isinstance(admission, Admission):
            raise ConfigError(f"admission must be an Admission, got {type(admission).__name__}")
        self.admission: Admission = admission if admission is not None else AlwaysAdmit()
        self.tree = PrefixTree()
        self.stats = CacheStats()
        self._seqs: dict[Any, Sequence] = {}
        self._records: dict[int, BlockInfo] = {}  # block id -> record, cached blocks only
        self._num_evictable = 0  # cached blocks with ref count 0
        self._pins: dict[int, float] = {}  # block id -> pinned until (inf: until unpinned)
        self._pin_heap: list[tuple[float, int]] = []
        self._withheld: dict[int, BlockInfo] = {}  # pinned candidates kept from the policy
        self._tick = 0
        self._last_now = -math.inf
        self._eviction_listeners: list[Callable[[BlockInfo, float], None]] = []
        # skip calls to hooks the policy leaves as no-ops (a hot path)
        policy_type = type(self.policy)
        self._on_hit = None if policy_type.on_hit is Policy.on_hit else self.policy.on_hit
        self._on_insert = (None if policy_type.on_insert is Policy.on_insert
                           else self.policy.on_insert)
        # the built-in LRU gets an inlined eviction loop (not a subclass: it may override)
        self._builtin_lru = policy_type is LRU

    # -- time ------------------------------------------------------------------------------

    def _now(self) -> float:
        now = float(self.clock())
        if now < self._last_now:
            raise ConfigError(f"the clock went backwards: {now} after {self._last_now}")
        self._last_now = now
        return now

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing."""
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix tree."""
        return len(self.tree)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no running sequence uses (all evictable, leaves first)."""
        return self._num_evictable

    @property
    def num_candidates(self) -> int:
        """Current candidates (cached, ref 0, leaf), pinned ones included."""
        return len(self.tree.candidates)

    def sequence(self, seq_id: Any) -> Sequence:
        """The live sequence with this id."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ConfigError(f"no live sequence with id {seq_id!r}") from None

    @property
    def sequences(self) -> dict[Any, Sequence]:
        """Live sequences (running and preempted) by id (a copy)."""
        return dict(self._seqs)

    def block(self, block_id: int) -> BlockInfo | None:
        """The record of a cached block, or None if the block is not cached."""
        return self._records.get(block_id)

    def _prefix_hashes(self, prefix: Any) -> list[Any]:
        if isinstance(prefix, Request):
            if prefix.block_hashes is not None:
                return list(prefix.block_hashes)
            prefix = prefix.tokens
        return block_hashes(prefix, self.block_size, self.extra_key)

    def lookup(self, prefix: Any) -> LookupResult:
        """Longest cached prefix of ``prefix`` (token ids or a `Request`); no side effects."""
        hit = self.tree.longest_prefix(self._prefix_hashes(prefix))
        return LookupResult(len(hit) * self.block_size, len(hit),
                            tuple(b._id for b in hit))

    # -- begin / resume --------------------------------------------------------------------

    def begin(self, request: Request, max_new_tokens: int | None = None) -> Sequence:
        """Start a request: reuse its cached prefix, allocate the rest, cache its full blocks.

        With ``max_new_tokens`` only that many uncached prompt tokens are allocated now (a
        chunked prefill); `prefill` allocates the rest later. The lookup always covers the
        whole prompt.

        Raises `OutOfBlocks` (state unchanged) when even evicting every candidate would not
        free enough blocks, and `AdmissionDeferred` (state unchanged) when admission control
        tells the request to wait rather than evict.
        """
        if not isinstance(request, Request):
            raise ConfigError(f"begin() takes a Request, got {type(request).__name__}")
        if request.request_id in self._seqs:
            raise ConfigError(f"a sequence with id {request.request_id!r} is already live")
        prompt_len = request.prompt_len
        if prompt_len == 0:
            raise ConfigError(f"request {request.request_id!r} has an empty prompt")
        if max_new_tokens is not None:
            self._check_count("max_new_tokens", max_new_tokens)
        if request.block_hashes is not None:
            hashes = request.block_hashes  # a tuple of distinct ids (checked by Request)
            max_blocks = -(-prompt_len // self.block_size)
            if len(hashes) > max_blocks:
                raise ConfigError(
                    f"request {request.request_id!r}: {len(hashes)} block hashes for "
                    f"{prompt_len} tokens; expected at most {max_blocks} blocks of "
                    f"{self.block_size}"
                )
            # each listed id is one cacheable block: the prompt occupies whole blocks, and
            # appended tokens start a new block rather than grow a shared cached one
            slots = max(prompt_len, len(hashes) * self.block_size)
        else:
            hashes = block_hashes(request.tokens, self.block_size, self.extra_key)
            slots = prompt_len
        seq = Sequence(request, hashes, slots)
        self._start(seq, max_new_tokens, prompt_len)
        self._seqs[seq.seq_id] = seq
        return seq

    def resume(self, seq_id: Any, max_new_tokens: int | None = None) -> Sequence:
        """Bring a preempted sequence back: look up its known tokens again, allocate (up to
        ``max_new_tokens`` uncached ones of) the rest; `prefill` allocates what remains."""
        seq = self.sequence(seq_id)
        if seq.status != "preempted":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}, not preempted")
        self._check_count("max_new_tokens", max_new_tokens)
        self._start(seq, max_new_tokens, seq.num_known)
        seq.status = "running"
        return seq

    @staticmethod
    def _check_count(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")

    def _known_hashes(self, seq: Sequence) -> list[Any]:
        """Hashes of every full known block of ``seq`` (its lookup key on begin/resume)."""
        if seq._known is None:
            return seq._prompt_hashes  # appended blocks of hash-only requests are never cached
        hashes = list(seq._prompt_hashes)
        bs = self.block_size
        n_full = len(seq._known) // bs
        hashes.extend(seq._hashes[len(hashes):n_full])  # known from an earlier residency
        while len(hashes) < n_full:
            d = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(block_hashes(seq._known[d * bs:(d + 1) * bs], bs, self.extra_key,
                                       parent)[0])
        return hashes

    def _start(self, seq: Sequence, max_new_tokens: int | None, query_tokens: int) -> None:
        """Hit the cached prefix of ``seq``'s known tokens, then allocate up to
        ``max_new_tokens`` more; ``query_tokens`` count as prefix-cache queries."""
        bs = self.block_size
        # (a hash-only request's appended blocks are never cached: its prompt's are the key)
        hashes = seq._prompt_hashes if seq._known is None else self._known_hashes(seq)
        cached = self.tree._blocks
        hit: list[BlockInfo] = []
        hit_free = 0  # hit blocks no running sequence holds (they stop being evictable)
        if seq._known is None:  # hash ids from a trace: check they are chained
            parent = ROOT_HASH
            depth = 0
            for h in hashes:
                block = cached.get(h)
                if block is None:
                    break
                if block._parent != parent or block._depth != depth:
                    raise ConfigError(
                        f"request {seq.seq_id!r}: block id {h!r} is cached under parent "
                        f"{block._parent!r} but follows {parent!r} here; block_hashes must "
                        "be prefix-chained"
                    )
                if not block._ref_count:
                    hit_free += 1
                hit.append(block)
                parent = h
                depth += 1
            if not cached.keys().isdisjoint(hashes[len(hit) + 1:]):
                h = next(h for h in hashes[len(hit) + 1:] if h in cached)
                raise ConfigError(
                    f"request {seq.seq_id!r}: block id {h!r} is cached but an earlier "
                    "id of this request is not; block_hashes must be prefix-chained"
                )
        else:
            for h in hashes:
                block = cached.get(h)
                if block is None:
                    break
                if not block._ref_count:
                    hit_free += 1
                hit.append(block)
        known = seq._prompt_slots + seq._num_generated  # seq.num_known
        hit_tokens = min(len(hit) * bs, known)
        target = known if max_new_tokens is None else min(known, hit_tokens + max_new_tokens)
        need = -(-target // bs) - len(hit)
        available = len(self.pool._free) + self._num_evictable - hit_free
        if need > available:
            raise OutOfBlocks(
                f"request {seq.seq_id!r} needs {need} new blocks but only {available} can be "
                f"freed ({self.pool.num_free} free, {self._num_evictable - hit_free} evictable "
                f"cached); the rest is in use by running sequences",
                needed=need, available=available,
            )
        now = self._now()
        pool = self.pool
        old_hashes = seq._hashes
        self._acquire_all(hit, now)  # hold the hit blocks so eviction cannot take them
        seq.block_table = [b._id for b in hit]
        seq._hashes = list(hashes[:len(hit)])
        seq.num_tokens = hit_tokens
        try:
            evictions = need - len(pool._free)
            admission = self.admission
            always = type(admission) is AlwaysAdmit  # admits, and on_admitted is a no-op
            if evictions > 0 and not always:
                decision = admission.admit(seq.request, evictions, self, now)
                if not decision.admit:
                    raise AdmissionDeferred(
                        f"request {seq.seq_id!r} deferred: {decision.reason}",
                        request_id=seq.seq_id, reason=decision.reason,
                        retry_after=decision.retry_after,
                    )
            if evictions > 0:
                self._evict(evictions, now)
            session = seq.request.session_id
            retention = seq.request.retention
            on_hit = self._on_hit
            tick = self._tick
            for block in hit:
                tick += 1
                block._last_access = now
                block._last_access_tick = tick
                block._hit_count += 1
                block._last_hit_session = session
                if block._sharer != session:  # note_sharer, inlined for the common case
                    note_sharer(block, session, now)
                block._shared = now
                if retention is not None:
                    block._retention = retention
                if on_hit is not None:
                    self._tick = tick
                    on_hit(block, now)
            self._tick = tick
            self._allocate_to(seq, target, now, "prefill")
            if not always:
                admission.on_admitted(seq.request, now)
        except BaseException:
            # undo: release what the sequence holds (cached blocks become candidates)
            self._release_all(seq, now, touch=False)
            seq._hashes = old_hashes
            seq.num_tokens = 0
            raise
        seq.num_hit_slots = hit_tokens
        seq.num_cached_tokens = seq.real_tokens(0, hit_tokens)
        stats = self.stats
        stats.requests += 1
        stats.prefix_cache_queries += query_tokens
        stats.prefix_cache_hits += min(seq.num_cached_tokens, query_tokens)
        stats.block_queries += len(hashes)
        stats.block_hits += len(hit)

    # -- growth: prefill chunks and decode appends -----------------------------------------

    def prefill(self, seq_id: Any, num_tokens: int | None = None) -> list[int]:
        """Allocate the next ``num_tokens`` (default: all) pending tokens of a running
        sequence (a prefill chunk, or recompute after `resume`); return new block ids.

        Raises `OutOfBlocks` (state unchanged) when the blocks cannot be freed.
        """
        seq = self.sequence(seq_id)
        if seq.status != "running":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}; resume it first")
        pending = seq.num_pending
        if num_tokens is None:
            num_tokens = pending
        self._check_count("num_tokens", num_tokens)
        if num_tokens > pending:
            raise ConfigError(f"sequence {seq_id!r} has {pending} pending tokens; cannot "
                              f"prefill {num_tokens}")
        return self._grow(seq, seq.num_tokens + num_tokens, None, "prefill")

    def append(self, seq_id: Any, tokens: Any) -> list[int]:
        """Append decoded tokens to a running sequence; return ids of newly allocated blocks.

        ``tokens`` are token ids (1-D ints). For a request given as ``block_hashes`` (no
        token ids) pass a count instead; its appended blocks are not cached. Decode appends
        are not hits. Raises `OutOfBlocks` (state unchanged) when the blocks cannot be freed.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self.sequence(seq_id)  # raises: no such sequence
        if seq.status != "running":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}; resume it before appending")
        if seq._known is None:
            if (type(tokens) is not int  # not a plain int count (the common case)
                    and (isinstance(tokens, bool) or not isinstance(tokens, int))) or tokens < 0:
                raise ConfigError(
                    f"sequence {seq_id!r} was given as block hashes; append a token count "
                    f"(a non-negative int), got {type(tokens).__name__}"
                )
            new_tokens: list[int] | None = None
            n = tokens
        elif type(tokens) is list and all(type(t) is int and t >= 0 for t in tokens):
            new_tokens, n = tokens, len(tokens)  # the decode loop's fast path
        else:
            new_tokens = as_token_array(tokens).tolist()
            n = len(new_tokens)
        if seq.num_tokens != seq._prompt_slots + seq._num_generated:
            raise ConfigError(f"sequence {seq_id!r} still has {seq.num_pending} prompt tokens "
                              "to prefill; call prefill() before appending")
        target = seq.num_tokens + n
        bs = self.block_size
        if (-(-target // bs) <= len(seq.block_table)
                and (new_tokens is None or target // bs <= len(seq._hashes))):
            # the decode loop's common case: no new block, none becomes full and cacheable
            seq._num_generated += n
            if new_tokens is not None:
                seq._known.extend(new_tokens)  # type: ignore[union-attr]
            seq.num_tokens = target
            return []
        return self._grow(seq, target, new_tokens, "decode")

    def _grow(self, seq: Sequence, target: int, new_tokens: list[int] | None,
              created_by: str) -> list[int]:
        bs = self.block_size
        need = -(-target // bs) - len(seq.block_table)
        free = self.pool._free
        available = len(free) + self._num_evictable
        if need > available:
            raise OutOfBlocks(
                f"sequence {seq.seq_id!r} needs {need} more blocks but only {available} can "
                "be freed", needed=need, available=available,
            )
        now = self._now()
        if need > 0:  # (even with enough free blocks: _evict expires due pins)
            self._evict(need - len(free), now)
        known = seq._prompt_slots + seq._num_generated  # seq.num_known
        if target > known:  # decode appends make new tokens known
            seq._num_generated += target - known
            if new_tokens is not None:
                seq._known.extend(new_tokens)  # type: ignore[union-attr]
        before = len(seq.block_table)
        self._allocate_to(seq, target, now, created_by)
        return seq.block_table[before:]

    def _allocate_to(self, seq: Sequence, target: int, now: float, created_by: str) -> None:
        """Allocate blocks until ``target`` token slots are covered (the caller evicted
        enough), then cache every block that became full."""
        pool = self.pool
        bs = self.block_size
        need = -(-target // bs) - len(seq.block_table)
        if need > 0:
            free, used, ref = pool._free, pool._used, pool._ref
            table = seq.block_table
            for _ in range(need):
                block_id = free.pop()  # the caller made room; the pool's own checks are
                used[block_id] = True  # for its public API
                ref[block_id] = 1
                table.append(block_id)
            self.stats.allocated_blocks += need
        seq.num_tokens = target
        if seq._known is None:  # hash mode: listed blocks are cacheable when computed
            listed = seq._prompt_hashes
            done = len(listed) if target >= seq._prompt_slots else target // bs
            first = len(seq._hashes)
            if first < min(done, len(listed)):
                self._cache_listed(seq, first, min(done, len(listed)), now, created_by)
        else:
            prompt_hashes = seq._prompt_hashes
            for depth in range(len(seq._hashes), target // bs):
                if depth < len(prompt_hashes):
                    h = prompt_hashes[depth]
                else:
                    parent = seq._hashes[-1] if seq._hashes else ROOT_HASH
                    h = block_hashes(seq._known[depth * bs:(depth + 1) * bs], bs,  # type: ignore
                                     self.extra_key, parent)[0]
                self._cache_block(seq, depth, h, now, created_by)
        used = pool.num_blocks - len(pool._free)  # pool.num_used
        if used > self.stats.peak_blocks_used:
            self.stats.peak_blocks_used = used

    def _cache_listed(self, seq: Sequence, first: int, end: int, now: float,
                      created_by: str) -> None:
        """`_cache_block` for blocks ``first..end-1`` of a hash-mode request, in one loop
        (the simulator's and the trace replay's hot path)."""
        cached = self.tree._blocks
        records = self._records
        table, hashes, listed = seq.block_table, seq._hashes, seq._prompt_hashes
        request = seq.request
        kinds = request.block_kinds
        nbytes = self.pool.bytes_per_block
        cls, session, retention = request.workload_class, request.session_id, request.retention
        on_insert = self._on_insert
        parent = hashes[-1] if first else ROOT_HASH  # seq holds the parent: cached
        for depth in range(first, end):
            block_hash = listed[depth]
            if block_hash in cached:  # computed twice concurrently: keep the cached copy
                self._cache_block(seq, depth, block_hash, now, created_by)
                parent = block_hash
                continue
            self._tick += 1
            kind = kinds[depth] if kinds is not None and depth < len(kinds) else "prompt"
            block_id = table[depth]
            block = BlockInfo(block_id, block_hash, parent, depth, None, nbytes, cls, session,
                              now, self._tick, retention, created_by, kind)
            block._ref_count = 1
            if depth:  # the parent is held by seq: it was no candidate and stays none
                cached[parent]._num_children += 1
            cached[block_hash] = block
            records[block_id] = block
            hashes.append(block_hash)
            self.stats.inserted_blocks += 1
            if on_insert is not None:
                on_insert(block, now)
            parent = block_hash

    def _cache_block(self, seq: Sequence, depth: int, block_hash: Any, now: float,
                     created_by: str) -> None:
        """Register the full block ``depth`` of ``seq`` (or share an identical cached one)."""
        block_id = seq.block_table[depth]
        cached = self.tree._blocks
        existing = cached.get(block_hash)
        if existing is not None:  # computed twice concurrently: keep the cached copy
            self._acquire_all((existing,), now)
            note_sharer(existing, seq.request.session_id, now)
            seq.block_table[depth] = existing._id
            self.pool.decref(block_id)
            self.pool.free(block_id)
            seq._hashes.append(block_hash)
            return
        self._tick += 1
        parent = seq._hashes[-1] if depth else ROOT_HASH  # seq holds the parent: cached
        bs = self.block_size
        end = (depth + 1) * bs
        request = seq.request
        tokens = None
        if seq._known is not None:
            tokens = np.asarray(seq._known[depth * bs:end], dtype=np.int64)
        if end > request.prompt_len and seq._known is not None:
            kind = "output"  # holds generated tokens
        else:
            kinds = request.block_kinds
            kind = kinds[depth] if kinds is not None and depth < len(kinds) else "prompt"
        block = BlockInfo(block_id, block_hash, parent, depth, tokens, self.pool.bytes_per_block,
                          request.workload_class, request.session_id, now, self._tick,
                          request.retention, created_by, kind)
        block._ref_count = 1
        if depth:  # the parent is held by seq: it was no candidate and stays none
            cached[parent]._num_children += 1
        cached[block_hash] = block
        self._records[block_id] = block
        seq._hashes.append(block_hash)
        self.stats.inserted_blocks += 1
        if self._on_insert is not None:
            self._on_insert(block, now)

    # -- release ---------------------------------------------------------------------------

    def finish(self, seq_id: Any) -> None:
        """End a sequence: release its blocks tail first; cached ones become candidates."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self.sequence(seq_id)  # raises: no such sequence
        if seq.status == "running":
            self._release_all(seq, self._now())
        del self._seqs[seq_id]
        seq.status = "finished"
        self.stats.finished += 1

    def preempt(self, seq_id: Any) -> Sequence:
        """Release a running sequence's blocks (tail first) but keep it for `resume`."""
        seq = self.sequence(seq_id)
        if seq.status != "running":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}, not running")
        self._release_all(seq, self._now())
        seq.status = "preempted"
        self.stats.preemptions += 1
        return seq

    def _release_all(self, seq: Sequence, now: float, touch: bool = True) -> None:
        """Drop ``seq``'s references, tail first: cached blocks left unused become
        candidates (leaves) or evictable; uncached ones go back to the free list."""
        records = self._records
        pool = self.pool
        ref, used, free = pool._ref, pool._used, pool._free
        tick = self._tick
        get = records.get
        for block_id in reversed(seq.block_table):
            ref[block_id] -= 1
            block = get(block_id)
            if block is None:  # a partial (or never cached) block: free it
                used[block_id] = False
                free.append(block_id)
                continue
            count = block._ref_count - 1
            block._ref_count = count
            if touch:
                tick += 1
                block._last_access = now
                block._last_access_tick = tick
            if not count:
                self._num_evictable += 1
                if not block._num_children:
                    self._tick = tick
                    self._add_candidate(block, now)
        self._tick = tick
        seq.block_table = []

    def _acquire_all(self, blocks: Any, now: float) -> None:
        """Take a reference on each cached block (they stop being candidates)."""
        ref = self.pool._ref
        candidates = self.tree.candidates
        for block in blocks:
            if not block._ref_count:
                self._num_evictable -= 1
                if block._id in candidates:
                    self._drop_candidate(block, now)
            block._ref_count += 1
            ref[block._id] += 1

    # -- candidates and eviction -----------------------------------------------------------

    def _add_candidate(self, block: BlockInfo, now: float) -> None:
        self.tree.candidates[block._id] = block
        if block._id in self._pins:
            self._withheld[block._id] = block
        else:
            self.policy.on_candidate(block, now)

    def _drop_candidate(self, block: BlockInfo, now: float) -> None:
        del self.tree.candidates[block._id]
        if self._withheld.pop(block._id, None) is None:
            self.policy.on_uncandidate(block, now)

    def _expire_pins(self, now: float) -> None:
        heap = self._pin_heap
        while heap and heap[0][0] <= now:
            until, block_id = heapq.heappop(heap)
            if self._pins.get(block_id) == until:
                self._unpin_block(block_id, now)

    def _evict(self, count: int, now: float) -> None:
        """Evict ``count`` candidates (the caller checked that enough exist)."""
        if self._pin_heap:
            self._expire_pins(now)  # ``now`` is fixed: expiring once is enough
        withheld = self._withheld
        if not withheld and not self._eviction_listeners:
            if self._builtin_lru:
                self._evict_lru(count, now)
            else:
                self._evict_fast(count, now)
            return
        candidates = self.tree.candidates
        victim = self.policy.victim
        evict_block = self._evict_block
        for _ in range(count):
            victim_id = victim(now)
            block = candidates.get(victim_id) if victim_id is not None else None
            if block is None or victim_id in withheld:
                offered = len(candidates) - len(withheld)
                if victim_id is None and not offered:
                    victim_id = min(withheld, key=lambda i: (
                        self._pins[i], withheld[i]._last_access_tick))
                    block = candidates[victim_id]
                elif victim_id is None:
                    raise PolicyError(
                        f"{self.policy!r}.victim() returned None but it holds {offered} "
                        "candidates"
                    )
                else:
                    what = ("a pinned candidate the policy was never offered"
                            if victim_id in withheld else "not a candidate")
                    raise PolicyError(
                        f"{self.policy!r}.victim() returned block {victim_id!r}, which is "
                        f"{what} (candidates are cached, unused leaves)"
                    )
            evict_block(block, now)

    def _evict_fast(self, count: int, now: float) -> None:
        """`_evict` with `_evict_block` inlined, for the common case: no pinned candidate, no
        listener (the hot path of a cache under pressure)."""
        candidates = self.tree.candidates
        policy = self.policy
        victim, on_evict = policy.victim, policy.on_evict
        cached = self.tree._blocks
        records = self._records
        pool = self.pool
        used, free = pool._used, pool._free
        stats = self.stats
        by_class = stats.evictions_by_class
        pins = self._pins
        on_candidate = policy.on_candidate
        for _ in range(count):
            victim_id = victim(now)
            block = candidates.get(victim_id) if victim_id is not None else None
            if block is None:
                if victim_id is None:
                    raise PolicyError(
                        f"{policy!r}.victim() returned None but it holds {len(candidates)} "
                        "candidates"
                    )
                raise PolicyError(
                    f"{policy!r}.victim() returned block {victim_id!r}, which is not a "
                    "candidate (candidates are cached, unused leaves)"
                )
            del candidates[victim_id]
            on_evict(block, now)
            del cached[block._hash]
            del records[victim_id]
            self._num_evictable -= 1
            used[victim_id] = False
            free.append(victim_id)
            stats.evictions += 1
            cls = block._workload_class
            by_class[cls] = by_class.get(cls, 0) + 1
            if block._depth:  # the parent may have become a leaf, hence a candidate
                parent = cached[block._parent]
                parent._num_children -= 1
                if not parent._num_children and not parent._ref_count:
                    if parent._id in pins:
                        self._add_candidate(parent, now)
                    else:  # _add_candidate, inlined
                        candidates[parent._id] = parent
                        on_candidate(parent, now)

    def _evict_lru(self, count: int, now: float) -> None:
        """`_evict_fast` for the built-in `LRU` (vLLM's order, the common configuration), with
        its ``victim`` / ``on_evict`` / ``on_candidate`` inlined on its queue: the same victims
        in the same order, and the same index state, as through the protocol calls."""
        candidates = self.tree.candidates
        policy = self.policy
        queue = policy._queue
        late = policy._late  # blocks offered late (older than the queue's tail): rare
        pop_oldest = queue.popitem
        cached = self.tree._blocks
        records = self._records
        pool = self.pool
        used, free = pool._used, pool._free
        by_class = self.stats.evictions_by_class
        pins = self._pins
        on_candidate = policy.on_candidate
        evicted = 0
        try:
            for _ in range(count):
                if late:  # the heap may hold the oldest: let the policy choose
                    victim_id = policy.victim(now)
                    block = candidates.pop(victim_id)
                    policy.on_evict(block, now)
                else:  # the queue's head is the oldest candidate
                    victim_id = pop_oldest(False)[0]
                    block = candidates.pop(victim_id)
                del cached[block._hash]
                del records[victim_id]
                used[victim_id] = False
                free.append(victim_id)
                evicted += 1
                cls = block._workload_class
                by_class[cls] = by_class.get(cls, 0) + 1
                if block._depth:  # the parent may have become a leaf, hence a candidate
                    parent = cached[block._parent]
                    parent._num_children -= 1
                    if not parent._num_children and not parent._ref_count:
                        parent_id = parent._id
                        if parent_id in pins:
                            self._add_candidate(parent, now)
                            continue
                        candidates[parent_id] = parent
                        on_candidate(parent, now)
        finally:
            self._num_evictable -= evicted
            self.stats.evictions += evicted

    def add_eviction_listener(self, callback: Callable[[BlockInfo, float], None]) -> None:
        """Call ``callback(block, now)`` just before each eviction (the block still cached).

        For metrics and tests; a listener must not change the cache.
        """
        if not callable(callback):
            raise ConfigError("an eviction listener must be callable(block, now)")
        self._eviction_listeners.append(callback)

    def _evict_block(self, block: BlockInfo, now: float) -> None:
        if self._eviction_listeners:
            for listener in self._eviction_listeners:
                listener(block, now)
        block_id = block._id
        del self.tree.candidates[block_id]
        if self._withheld and self._withheld.pop(block_id, None) is not None:
            del self._pins[block_id]
        self.policy.on_evict(block, now)  # also for pinned blocks it was never offered
        cached = self.tree._blocks
        del cached[block._hash]
        del self._records[block_id]
        self._num_evictable -= 1
        pool = self.pool
        pool._used[block_id] = False
        pool._free.append(block_id)
        stats = self.stats
        stats.evictions += 1
        by_class = stats.evictions_by_class
        cls = block._workload_class
        by_class[cls] = by_class.get(cls, 0) + 1
        if block._depth:  # the parent may have become a leaf, hence a candidate
            parent = cached[block._parent]
            parent._num_children -= 1
            if parent._num_children == 0 and parent._ref_count == 0:
                self._add_candidate(parent, now)

    def evict(self, count: int = 1) -> int:
        """Evict up to ``count`` candidates now (e.g. to make room ahead of time); return
        how many were evicted."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"count must be a non-negative int, got {count!r}")
        count = min(count, self._num_evictable)
        self._evict(count, self._now())
        return count

    # -- pins ------------------------------------------------------------------------------

    def pin(self, prefix: Any, until: float | None = None) -> int:
        """Pin the cached blocks of ``prefix`` (token ids or a `Request`) until a clock time
        (None: until `unpin`). Returns how many blocks were pinned.

        Pinned candidates are never offered to the policy; they are evicted only when no other
        candidate exists (earliest pin expiry first).
        """
        if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))
                                  or until != until):
            raise ConfigError(f"until must be a clock time (number) or None, got {until!r}")
        now = self._now()
        expiry = math.inf if until is None else float(until)
        blocks = self.tree.longest_prefix(self._prefix_hashes(prefix))
        if expiry <= now:
            return 0
        for block in blocks:
            old = self._pins.get(block._id)
            if old is not None and old >= expiry:
                continue
            self._pins[block._id] = expiry
            if expiry != math.inf:
                heapq.heappush(self._pin_heap, (expiry, block._id))
            if old is None and block._id in self.tree.candidates:
                self.policy.on_uncandidate(block, now)
                self._withheld[block._id] = block
        return len(blocks)

    def unpin(self, prefix: Any) -> int:
        """Remove pins from the cached blocks of ``prefix``; return how many were pinned."""
        now = self._now()
        count = 0
        for block in self.tree.longest_prefix(self._prefix_hashes(prefix)):
            if block._id in self._pins:
                self._unpin_block(block._id, now)
                count += 1
        return count

    def _unpin_block(self, block_id: int, now: float) -> None:
        del self._pins[block_id]
        block = self._withheld.pop(block_id, None)
        if block is not None:
            self.policy.on_candidate(block, now)

    def is_pinned(self, block_id: int) -> bool:
        """Whether a cached block is explicitly pinned (expired pins count as unpinned)."""
        until = self._pins.get(block_id)
        return until is not None and until > self.clock()

    # -- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """Verify every invariant; raise `InvariantError` naming the first one broken."""
        pool, tree = self.pool, self.tree

        def fail(msg: str) -> None:
            raise InvariantError(msg)

        if pool.num_free + pool.num_used != pool.num_blocks:
            fail("free + used != total")
        if len(set(pool._free)) != len(pool._free):
            fail("a block is on the free list twice")
        for b in pool._free:
            if pool._used[b] or pool._ref[b]:
                fail(f"free block {b} is marked used or referenced")
        refs = [0] * pool.num_blocks
        for seq in self._seqs.values():
            if seq.status == "running":
                expected = -(-seq.num_tokens // self.block_size)
                if len(seq.block_table) != expected:
                    fail(f"sequence {seq.seq_id!r} holds {len(seq.block_table)} blocks for "
                         f"{seq.num_tokens} tokens")
                if len(set(seq.block_table)) != len(seq.block_table):
                    fail(f"sequence {seq.seq_id!r} lists a block twice")
                for depth, b in enumerate(seq.block_table):
                    refs[b] += 1
                    if depth < len(seq._hashes):
                        rec = self._records.get(b)
                        if rec is None or rec._hash != seq._hashes[depth]:
                            fail(f"sequence {seq.seq_id!r} block {depth} is not its cached "
                                 "block")
            elif seq.block_table:
                fail(f"{seq.status} sequence {seq.seq_id!r} still holds blocks")
        for b in range(pool.num_blocks):
            if pool._ref[b] != refs[b]:
                fail(f"block {b}: ref count {pool._ref[b]} but {refs[b]} running users")
            if pool._ref[b] < 0:
                fail(f"block {b}: negative ref count")
            if pool._used[b] and refs[b] == 0 and b not in self._records:
                fail(f"block {b} is used but neither cached nor held (leaked)")
        if len(self._records) != len(tree):
            fail("records and tree disagree on the cached blocks")
        children: dict[Any, int] = {}
        evictable = 0
        for block in tree:
            if self._records.get(block._id) is not block:
                fail(f"cached block {block._id} has no record")
            if not pool._used[block._id]:
                fail(f"cached block {block._id} is on the free list")
            if block._ref_count != pool._ref[block._id]:
                fail(f"block {block._id}: record ref {block._ref_count} != pool ref")
            if block._depth > 0:
                if block._parent not in tree:
                    fail(f"prefix closure: block {block._id}'s parent is not cached")
                children[block._parent] = children.get(block._parent, 0) + 1
            if block._ref_count == 0:
                evictable += 1
        if evictable != self._num_evictable:
            fail(f"evictable count {self._num_evictable} != {evictable}")
        expected_candidates = set()
        for block in tree:
            if block._num_children != children.get(block._hash, 0):
                fail(f"block {block._id}: child count {block._num_children} is wrong")
            if block._ref_count == 0 and block._num_children == 0:
                expected_candidates.add(block._id)
        if set(tree.candidates) != expected_candidates:
            fail("candidate set != {cached, ref 0, leaf}")
        for block_id in self._withheld:
            if block_id not in self._pins or block_id not in tree.candidates:
                fail(f"withheld block {block_id} is not a pinned candidate")
        for block_id in self._pins:
            if block_id not in self._records:
                fail(f"pinned block {block_id} is not cached")
            if block_id in tree.candidates and block_id not in self._withheld:
                fail(f"pinned candidate {block_id} was offered to the policy")
        size = getattr(self.policy, "__len__", None)
        if size is not None:
            offered = len(tree.candidates) - len(self._withheld)
            if len(self.policy) != offered:  # type: ignore[arg-type]
                fail(f"policy tracks {len(self.policy)} candidates, expected "  # type: ignore
                     f"{offered}")

    def __repr__(self) -> str:
        return (f"KVCacheManager(blocks={self.pool.num_blocks}, block_size={self.block_size}, "
                f"policy={self.policy!r}, cached={len(self.tree)}, free={self.pool.num_free})")
