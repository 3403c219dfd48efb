"""`KVCacheManager`: the only place that mutates cache state.

It composes a `BlockPool` (physical blocks and ref counts), a `PrefixTree` (cached blocks by
chained hash, child counts, the candidate set), `Pins` (explicit retention) and a `Policy`
(which candidate to evict), and keeps them consistent:

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
- ``compact(seq_id, num_slots)``: token eviction (the engine's ``token_policy``) kept only
  ``num_slots`` of an uncacheable sequence's token slots: the blocks past them go back to the
  pool. A request the ``uncacheable`` predicate names neither hits nor caches blocks, because
  its blocks will stop holding the tokens their hashes name.
- ``stats`` and ``check()`` (every invariant, see `kvevict.invariants`; it holds after any
  exception).

Every request is normalized at the boundary into a chain of block hashes plus a count of
token slots: a token request is hashed (`kvevict.hashing.block_hashes`) and its chain grows as
decode appends fill blocks; a trace request brings its chain. Past that point there is one
hit loop, one caching path and one eviction loop, and the policy is reached only through the
`Policy` protocol.

A policy event that raises becomes a `PolicyError` naming the policy, the event and the block
(the policy's exception is its ``__cause__``), and the cache stays consistent (`check` holds):

- ``begin`` and ``resume`` are rolled back: the blocks they cached are uncached again (the
  policy hears ``on_evict``), the hits released; evictions they made stay made.
- ``victim`` / ``on_evict`` raising while making room: that block stays cached and the
  operation fails before it changed anything else.
- ``append`` / ``prefill`` complete once they allocated (the tokens are known and their KV is
  being computed); a block whose ``on_insert`` raised is cached all the same.
- ``finish``, ``preempt``, ``evict`` and ``unpin`` complete; a block whose ``on_candidate``
  raised is kept by the manager (`kvevict.pins`) and evicted before the policy is asked.
- ``pin``: a block whose ``on_uncandidate`` raised is not pinned.

Time comes from the injected ``clock`` (a callable returning seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import attrs
import numpy as np

from kvevict.admission import Admission, AlwaysAdmit
from kvevict.errors import AdmissionDeferred, ConfigError, OutOfBlocks, PolicyError
from kvevict.hashing import ROOT_HASH, block_hashes, chain_hashes, encode_extra
from kvevict.invariants import InvariantError, check_manager
from kvevict.pins import Pins
from kvevict.policies.base import Policy, hook, make_policy, pop_victim_of
from kvevict.pool import BlockPool
from kvevict.prefix import PrefixTree
from kvevict.tiers import TierStack
from kvevict.types import BlockInfo, ManualClock, Request, as_token_array

__all__ = ["CacheStats", "InvariantError", "KVCacheManager", "LookupResult", "Sequence"]


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
    """A running (or preempted) sequence: its request, hash chain and block table.

    ``block_table[i]`` is the pool block holding tokens ``[i * block_size, (i+1) *
    block_size)``; its first ``len(cached_blocks)`` entries are cached blocks (their records
    are ``cached_blocks``), the rest are private to this sequence. ``hashes`` is the
    sequence's chain: the hash of every full known block (a token request's chain grows as
    appends fill blocks; a trace request's is its listed ids). ``num_tokens`` token slots are
    allocated (computed or being computed); ``num_pending`` more are known but not yet
    allocated (the rest of a chunked prefill, or a preempted sequence's tokens to recompute).
    A token request's known tokens are ``prompt_tokens`` (a read-only int64 array, copied
    once at `KVCacheManager.begin`) followed by ``generated_tokens`` (appended ids, a list):
    the prompt is never turned into a Python list, and a cached block's ``tokens`` are a
    read-only view of one array copied per caching call (see `KVCacheManager`).

    Token eviction: a sequence begun by a request the manager's ``uncacheable`` predicate
    names has ``cacheable`` False: it neither hits nor caches blocks. `KVCacheManager.compact`
    can then drop tokens from it: ``num_dropped`` tokens of its ``num_tokens`` hold no slot any
    more, and the block table covers ``num_slots = num_tokens - num_dropped`` slots.
    Read it; only the manager changes it.
    """

    __slots__ = ("seq_id", "request", "block_table", "cached_blocks", "hashes",
                 "prompt_tokens", "generated_tokens", "num_tokens", "num_cached_tokens",
                 "num_hit_slots", "prompt_slots", "num_generated", "status", "reloaded",
                 "cacheable", "num_dropped")

    def __init__(self, request: Request, hashes: Any, prompt_slots: int) -> None:
        self.seq_id = request.request_id
        self.request = request
        self.block_table: list[int] = []
        #: records of the cached blocks at the head of the block table
        self.cached_blocks: list[BlockInfo] = []
        #: the chain: hash of each full known block (token mode) or each listed block
        self.hashes = hashes
        #: token mode: the prompt's token ids (read-only int64); None for hash mode
        self.prompt_tokens: np.ndarray | None = None
        #: token mode: the ids appended since (decode); None for hash mode
        self.generated_tokens: list[int] | None = None
        if request.tokens is not None:
            prompt = np.array(request.tokens, dtype=np.int64)  # a snapshot: hashed, cached
            prompt.flags.writeable = False
            self.prompt_tokens = prompt
            self.generated_tokens = []
        self.num_tokens = 0
        #: tokens found cached at the last begin / resume (real tokens, at most the known)
        self.num_cached_tokens = 0
        #: token slots the hit covered (a hash-only prompt's partial last block counts whole)
        self.num_hit_slots = 0
        #: token slots of the prompt (a hash-only prompt is padded to whole listed blocks)
        self.prompt_slots = prompt_slots
        self.num_generated = 0
        self.status = "running"
        #: blocks the last begin / resume reloaded from each lower tier (tier 1 first);
        #: () when none was (see `kvevict.tiers`)
        self.reloaded: tuple[int, ...] = ()
        #: False for a request the manager's ``uncacheable`` predicate names: no hits, no
        #: cached blocks (token eviction rewrites its blocks, see `KVCacheManager.compact`)
        self.cacheable = True
        #: tokens token eviction dropped since the last begin / resume (they hold no slot)
        self.num_dropped = 0

    @property
    def session_id(self) -> Any:
        return self.request.session_id

    @property
    def num_known(self) -> int:
        """Token slots known so far: the prompt's plus every appended token."""
        return self.prompt_slots + self.num_generated

    @property
    def num_slots(self) -> int:
        """Token slots the block table covers: ``num_tokens`` less the dropped ones."""
        return self.num_tokens - self.num_dropped

    @property
    def num_pending(self) -> int:
        """Known token slots not yet allocated (to prefill or recompute)."""
        return self.num_known - self.num_tokens

    def real_tokens(self, start: int, end: int) -> int:
        """Tokens of slots ``[start, end)`` that are real: a hash-only prompt whose last
        block is partial is padded to whole blocks, and padding is no work."""
        pad_lo, pad_hi = self.request.prompt_len, self.prompt_slots
        overlap = max(0, min(end, pad_hi) - max(start, pad_lo))
        return end - start - overlap

    @property
    def tokens(self) -> list[int] | None:
        """All known token ids (prompt + appended), or None for a hash-only request."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens.tolist() + self.generated_tokens  # type: ignore[operator]

    #: The same list (a copy), under the name earlier versions stored it as.
    token_ids = tokens

    def token_array(self, start: int, end: int) -> np.ndarray:
        """Known token ids ``[start, end)`` of a token request as a new read-only int64
        array (one copy, whether they lie in the prompt, the appended ids or both)."""
        prompt = self.prompt_tokens
        n = len(prompt)  # type: ignore[arg-type]
        if end <= n:
            out = prompt[start:end].copy()  # type: ignore[index]
        else:
            gen = self.generated_tokens[max(0, start - n):end - n]  # type: ignore[index]
            head = prompt[start:n] if start < n else prompt[:0]  # type: ignore[index]
            out = np.concatenate((head, np.asarray(gen, dtype=np.int64)))
        out.flags.writeable = False
        return out

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
        tiers: memory tiers below the pool (`kvevict.tiers.TierStack`): an evicted block is
            demoted there (or dropped), a hit there is reloaded. A policy given by name that
            takes a ``cost_model`` prices blocks with the stack's reload costs.
        uncacheable: called with each request at `begin`; a request it returns True for
            neither hits cached blocks nor caches its own (``Sequence.cacheable`` is False),
            so that token eviction may rewrite its blocks (`compact`). None: every request is
            cacheable.
    """

    def __init__(self, pool: BlockPool, policy: Policy | str = "lru", *,
                 clock: Callable[[], float] | None = None, extra_key: Any = None,
                 admission: Admission | None = None, tiers: TierStack | None = None,
                 uncacheable: Callable[[Request], bool] | None = None,
                 **policy_params: Any) -> None:
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if tiers is not None:
            if not isinstance(tiers, TierStack):
                raise ConfigError(f"tiers must be a TierStack, got {type(tiers).__name__}")
            tiers.bind(pool)
            policy_params = tiers.policy_params(policy, policy_params)
        #: the tiers below the pool, or None
        self.tiers = tiers
        self._demote = None if tiers is None else tiers.demote
        self.pool = pool
        self.block_size = pool.block_size
        self.policy = make_policy(policy, **policy_params)
        if clock is not None and not callable(clock):
            raise ConfigError("clock must be a callable returning seconds")
        self.clock: Callable[[], float] = clock if clock is not None else ManualClock()
        self.extra_key = extra_key
        self._extra = encode_extra(extra_key)  # validates extra_key; every hash ends with it
        if admission is not None and not isinstance(admission, Admission):
            raise ConfigError(f"admission must be an Admission, got {type(admission).__name__}")
        self.admission: Admission = admission if admission is not None else AlwaysAdmit()
        if uncacheable is not None and not callable(uncacheable):
            raise ConfigError("uncacheable must be None or a callable(request) -> bool")
        #: the predicate naming the requests that neither hit nor cache (None: none)
        self.uncacheable = uncacheable
        self.tree = PrefixTree()
        self.pins = Pins()
        self.stats = CacheStats()
        self._seqs: dict[Any, Sequence] = {}
        self._records: dict[int, BlockInfo] = {}  # block id -> record, cached blocks only
        #: cached blocks' records by block id: a read-only live view
        self.records = MappingProxyType(self._records)
        self._tick = 0
        self._last_now = -math.inf
        # what the running operation cached, for its rollback: blocks it created (in order)
        self._created: list[BlockInfo] = []
        self._eviction_listeners: list[Callable[[BlockInfo, float], None]] = []
        self.policy.bind(self.block_size)
        self._on_hit = hook(self.policy, Policy, "on_hit")
        self._on_hits = hook(self.policy, Policy, "on_hits")
        self._on_insert = hook(self.policy, Policy, "on_insert")
        self._on_begin = hook(self.policy, Policy, "on_begin")
        self._on_finish = hook(self.policy, Policy, "on_finish")
        self._on_preempt = hook(self.policy, Policy, "on_preempt")
        self._on_resume = hook(self.policy, Policy, "on_resume")
        self._on_admitted = hook(self.admission, Admission, "on_admitted")
        # what the eviction loop calls, bound once (it runs for every block a request needs)
        self._victim, self._on_evict = self.policy.victim, self.policy.on_evict
        self._pop_victim = pop_victim_of(self.policy)
        self._candidates, self._evict_from_tree = self.tree.candidates, self.tree.evict
        self._withheld, self._refused = self.pins.withheld, self.pins.refused

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
        return self.tree.num_evictable

    @property
    def num_candidates(self) -> int:
        """Current candidates (cached, ref 0, leaf), pinned ones included."""
        return self.tree.num_candidates

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
                            tuple(b.block_id for b in hit))

    def check(self) -> None:
        """Verify every invariant; raise `InvariantError` naming the first one broken."""
        check_manager(self)

    # -- policy events ---------------------------------------------------------------------

    def _policy_error(self, event: str, block: BlockInfo | None,
                      exc: Exception) -> PolicyError:
        block_id = None if block is None else block.block_id
        where = "" if block is None else f" on block {block_id}"
        error = PolicyError(f"{self.policy!r}.{event}() raised{where}: "
                            f"{type(exc).__name__}: {exc}",
                            policy=self.policy, event=event, block_id=block_id)
        error.__cause__ = exc
        return error

    def _offer(self, blocks: list[BlockInfo], now: float) -> PolicyError | None:
        """Blocks became candidates: hand them to the policy, pinned ones excepted. A block
        whose ``on_candidate`` raises is kept by the manager; the first error is returned
        for the caller to raise once its operation is complete."""
        pinned = self.pins.pinned
        on_candidate = self.policy.on_candidate
        error = None
        for block in blocks:
            if pinned and self.pins.withhold(block):
                continue
            try:
                on_candidate(block, now)
            except Exception as exc:
                self.pins.refuse(block)
                if error is None:
                    error = self._policy_error("on_candidate", block, exc)
        return error

    # -- begin / resume --------------------------------------------------------------------

    def begin(self, request: Request, max_new_tokens: int | None = None) -> Sequence:
        """Start a request: reuse its cached prefix, allocate the rest, cache its full blocks.

        With ``max_new_tokens`` only that many uncached prompt tokens are allocated now (a
        chunked prefill); `prefill` allocates the rest later. The lookup always covers the
        whole prompt.

        Raises `OutOfBlocks` (state unchanged) when even evicting every candidate would not
        free enough blocks, `AdmissionDeferred` (state unchanged) when admission control
        tells the request to wait rather than evict, and `PolicyError` (rolled back) when a
        policy event raises.
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
            seq = Sequence(request, hashes, slots)
        else:  # hash the sequence's snapshot of the prompt, in one pass
            seq = Sequence(request, None, prompt_len)
            seq.hashes = chain_hashes(seq.prompt_tokens, self.block_size,  # type: ignore
                                      self._extra)
        if self.uncacheable is not None:
            seq.cacheable = not self.uncacheable(request)
        self._start(seq, max_new_tokens, prompt_len, begin=True)
        self._seqs[seq.seq_id] = seq
        return seq

    def resume(self, seq_id: Any, max_new_tokens: int | None = None) -> Sequence:
        """Bring a preempted sequence back: look up its known tokens again, allocate (up to
        ``max_new_tokens`` uncached ones of) the rest; `prefill` allocates what remains."""
        seq = self.sequence(seq_id)
        if seq.status != "preempted":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}, not preempted")
        self._check_count("max_new_tokens", max_new_tokens)
        self._start(seq, max_new_tokens, seq.num_known, begin=False)
        seq.status = "running"
        return seq

    @staticmethod
    def _check_count(name: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")

    def _start(self, seq: Sequence, max_new_tokens: int | None, query_tokens: int,
               begin: bool) -> None:
        """Hit the cached prefix of ``seq``'s chain, then allocate up to ``max_new_tokens``
        more; ``query_tokens`` count as prefix-cache queries."""
        bs = self.block_size
        hashes = seq.hashes
        seq.num_dropped = 0
        hit, unreferenced = self.tree.match(hashes, seq.seq_id) if seq.cacheable else ([], 0)
        num_hit = len(hit)  # ``hit`` becomes the sequence's list of cached blocks and grows
        lower = () if self.tiers is None or not seq.cacheable else \
            self._match_lower(seq, hashes, num_hit)
        num_lower = len(lower)  # the chain's continuation in lower tiers, to reload
        known = seq.num_known
        hit_tokens = min((num_hit + num_lower) * bs, known)
        target = known if max_new_tokens is None else min(known, hit_tokens + max_new_tokens)
        need = -(-target // bs) - num_hit
        pool = self.pool
        evictable = self.tree.num_evictable - unreferenced
        available = pool.num_free + evictable
        if need > available:  # (nothing below the pool was held yet)
            raise OutOfBlocks(
                f"request {seq.seq_id!r} needs {need} new blocks but only {available} can be "
                f"freed ({pool.num_free} free, {evictable} evictable cached); the rest is in "
                "use by running sequences",
                needed=need, available=available,
            )
        now = self._now()
        try:
            if num_lower:  # it fits: hold them, so that the evictions made for it keep them
                self.tiers.hold(lower, now)  # type: ignore[union-attr]
            seq.block_table = self._acquire(hit, now)  # hold the hits: eviction cannot take them
        except BaseException:
            self._restore_lower(lower)
            raise
        seq.cached_blocks = hit
        seq.num_tokens = hit_tokens
        self._created = []
        allocated = self.stats.allocated_blocks
        try:
            evictions = need - pool.num_free
            if evictions > 0:
                decision = self.admission.admit(seq.request, evictions, self, now)
                if not decision.admit:
                    raise AdmissionDeferred(
                        f"request {seq.seq_id!r} deferred: {decision.reason}",
                        request_id=seq.seq_id, reason=decision.reason,
                        retry_after=decision.retry_after,
                    )
                self._evict(evictions, now)
            if num_lower:
                loaded = self._reload(seq, lower, now)  # ``hit`` (the cached blocks) grows
                lower = ()
                if loaded < num_lower:  # a block failed its checksum: the hit ends before it
                    hit_tokens = min((num_hit + loaded) * bs, known)
                    seq.num_tokens = hit_tokens
                    if max_new_tokens is not None:
                        target = min(known, hit_tokens + max_new_tokens)
                num_hit += loaded
            self._note_hits(hit, seq.request, now)
            self._allocate_to(seq, target, now, "prefill")
            if self._on_admitted is not None:
                self._on_admitted(seq.request, now)
            started, event = ((self._on_begin, "on_begin") if begin
                              else (self._on_resume, "on_resume"))
            if started is not None:
                try:
                    cached = seq.cached_blocks
                    started(seq.request, cached[:num_hit], cached[num_hit:], now)
                except Exception as exc:
                    raise self._policy_error(event, None, exc) from exc
        except BaseException:
            # undo: uncache what this call cached, release what the sequence holds (the hits
            # become candidates again); evictions done stay done
            self._restore_lower(lower)
            self._uncache_created(seq, now)
            self.stats.allocated_blocks = allocated
            self._release(seq, now, touch=False)
            seq.num_tokens = 0
            raise
        seq.num_hit_slots = hit_tokens
        seq.num_cached_tokens = seq.real_tokens(0, hit_tokens)
        stats = self.stats
        stats.requests += 1
        stats.prefix_cache_queries += query_tokens
        stats.prefix_cache_hits += min(seq.num_cached_tokens, query_tokens)
        stats.block_queries += len(hashes)
        stats.block_hits += num_hit

    def _match_lower(self, seq: Sequence, hashes: Any, num_hit: int) -> list[BlockInfo]:
        """The lower tiers' continuation of ``seq``'s hit (no side effects: it is held only
        once the request is known to fit, and read only when it is loaded)."""
        seq.reloaded = ()
        return self.tiers.match(hashes, num_hit)  # type: ignore[union-attr]

    def _restore_lower(self, lower: Any) -> None:
        if lower:
            self.tiers.restore(lower, self._last_now)  # type: ignore[union-attr]

    def _reload(self, seq: Sequence, lower: list[BlockInfo], now: float) -> int:
        """Copy the held lower-tier blocks into pool blocks (the caller evicted enough) and
        cache them there, as ``seq``'s next cached blocks: a reload, not a recompute. Return
        how many were loaded: fewer when a disk block fails its checksum at load (a miss;
        it and the rest of the chain are dropped, their pool blocks go back)."""
        tiers = self.tiers
        index_of = tiers.index_of  # type: ignore[union-attr]
        where = [index_of[block.tier] for block in lower]
        pool = self.pool
        ids = pool.take(len(lower))
        loaded = tiers.load(lower, ids, now)  # type: ignore[union-attr]
        if loaded < len(ids):
            unused = ids[loaded:]
            pool.decref_all(unused)
            pool.release(unused[::-1])  # the free list as it was
            del ids[loaded:]
            lower = lower[:loaded]
        self.stats.allocated_blocks += loaded
        counts = [0] * len(tiers.tiers)  # type: ignore[union-attr]
        for k in where[:loaded]:
            counts[k - 1] += 1
        seq.block_table.extend(ids)
        records = self._records
        for block in lower:
            block.ref_count = 1
            records[block.block_id] = block
        seq.reloaded = tuple(counts)
        if lower:
            self._register(lower, seq, now)
        return loaded

    def _note_hits(self, hit: list[BlockInfo], request: Request, now: float) -> None:
        """Stamp each hit block's record, then tell the policy: ``on_hit`` per block, then
        ``on_hits`` once with them all (begin and resume alike)."""
        session, retention = request.session_id, request.retention
        on_hit = self._on_hit
        tick = self._tick
        for block in hit:  # the hot path of every lookup
            tick += 1
            block.last_access = now
            block.last_access_tick = tick
            block.hit_count += 1
            block.last_hit_session = session
            if retention is not None:
                block.retention = retention
            if block.last_sharer != session:
                block.note_sharer(session, now)
            else:
                block.last_shared = now
            if on_hit is not None:
                self._tick = tick
                try:
                    on_hit(block, now)
                except Exception as exc:
                    raise self._policy_error("on_hit", block, exc) from exc
        self._tick = tick
        if hit and self._on_hits is not None:
            try:
                self._on_hits(request, hit[:], now)
            except Exception as exc:
                raise self._policy_error("on_hits", None, exc) from exc

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
        if seq.generated_tokens is None:
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
        if seq.num_tokens != seq.prompt_slots + seq.num_generated:
            raise ConfigError(f"sequence {seq_id!r} still has {seq.num_pending} prompt tokens "
                              "to prefill; call prefill() before appending")
        target = seq.num_tokens + n
        bs = self.block_size
        if (-(-(target - seq.num_dropped) // bs) <= len(seq.block_table)
                and (new_tokens is None or not seq.cacheable
                     or target // bs <= len(seq.cached_blocks))):
            # the decode loop's common case: no new block, none becomes full and cacheable
            seq.num_generated += n
            if new_tokens is not None:
                seq.generated_tokens.extend(new_tokens)  # type: ignore[union-attr]
            seq.num_tokens = target
            return []
        return self._grow(seq, target, new_tokens, "decode")

    def _grow(self, seq: Sequence, target: int, new_tokens: list[int] | None,
              created_by: str) -> list[int]:
        bs = self.block_size
        need = -(-(target - seq.num_dropped) // bs) - len(seq.block_table)
        pool = self.pool
        available = pool.num_free + self.tree.num_evictable
        if need > available:
            raise OutOfBlocks(
                f"sequence {seq.seq_id!r} needs {need} more blocks but only {available} can "
                "be freed", needed=need, available=available,
            )
        now = self._now()
        if need > 0:  # (even with enough free blocks: _evict expires due pins)
            self._evict(need - pool.num_free, now)
        known = seq.num_known
        if target > known:  # decode appends make new tokens known
            seq.num_generated += target - known
            if new_tokens is not None:
                seq.generated_tokens.extend(new_tokens)  # type: ignore[union-attr]
                self._extend_chain(seq)
        before = len(seq.block_table)
        self._created = []
        self._allocate_to(seq, target, now, created_by)
        return seq.block_table[before:]

    def _uncache_created(self, seq: Sequence, now: float) -> None:
        """Unregister the blocks the failed operation created (tail first; their KV was
        never computed): they become private blocks of ``seq`` again. The policy hears
        ``on_evict`` for each, as for any block that leaves the cache."""
        created, self._created = self._created, []
        if not created:
            return
        cached = seq.cached_blocks
        del cached[len(cached) - len(created):]  # they are the tail of the cached blocks
        if self.tiers is not None:  # their descendants below cannot be reached any more
            self.tiers.orphaned(created, now)
        for block in reversed(created):
            self.tree.discard(block)
            del self._records[block.block_id]
            block.ref_count = 0
            self.stats.inserted_blocks -= 1
            try:
                self._on_evict(block, now)
            except Exception:  # already raising the error that caused this rollback
                pass

    def _extend_chain(self, seq: Sequence) -> None:
        """Token mode: hash every block of ``seq``'s known tokens that became full."""
        hashes, bs = seq.hashes, self.block_size
        first, full = len(hashes), seq.num_known // bs
        if full > first:
            hashes.extend(chain_hashes(seq.token_array(first * bs, full * bs), bs, self._extra,
                                       hashes[-1] if hashes else ROOT_HASH))

    def _allocate_to(self, seq: Sequence, target: int, now: float, created_by: str) -> None:
        """Allocate blocks until ``target`` token slots are covered (the caller evicted
        enough), then cache every block of the chain that became full."""
        pool = self.pool
        bs = self.block_size
        need = -(-(target - seq.num_dropped) // bs) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(pool.take(need))
            self.stats.allocated_blocks += need
        seq.num_tokens = target
        end = min(len(seq.hashes), target // bs) if seq.cacheable else 0
        if len(seq.cached_blocks) < end:
            self._cache(seq, end, now, created_by)
        used = pool.num_used
        if used > self.stats.peak_blocks_used:
            self.stats.peak_blocks_used = used

    def _cache(self, seq: Sequence, end: int, now: float, created_by: str) -> None:
        """Register blocks ``len(seq.cached_blocks) .. end - 1`` of ``seq``'s block table
        under its chain (or share an identical cached block): the one caching path."""
        tree = self.tree
        lookup = tree.blocks.get
        records = self._records
        cached, table, hashes = seq.cached_blocks, seq.block_table, seq.hashes
        request = seq.request
        kinds = request.block_kinds
        bs = self.block_size
        first = len(cached)
        # token mode: the new blocks' ids in one array (one copy), each block a view of it
        known = None if seq.prompt_tokens is None else seq.token_array(first * bs, end * bs)
        prompt_len = request.prompt_len
        nbytes = self.pool.bytes_per_block
        cls, session, retention = request.workload_class, request.session_id, request.retention
        tick = self._tick
        run: list[BlockInfo] = []  # new blocks not yet registered: a chain
        parent = cached[-1] if cached else None  # seq holds the parent: it stays no candidate
        for depth in range(first, end):
            block_hash = hashes[depth]
            existing = lookup(block_hash)
            if existing is not None:  # computed twice concurrently: keep the cached copy
                if run:
                    self._register(run, seq, now)
                    run = []
                self._share(seq, depth, existing, now)
                parent = existing
                continue
            tokens = None
            kind = kinds[depth] if kinds is not None and depth < len(kinds) else "prompt"
            if known is not None:
                at = (depth - first) * bs
                tokens = known[at:at + bs]
                if (depth + 1) * bs > prompt_len:
                    kind = "output"  # holds generated tokens
            tick += 1
            block_id = table[depth]
            block = BlockInfo(block_id, block_hash,
                              ROOT_HASH if parent is None else parent.block_hash, depth,
                              tokens, nbytes, cls, session, now, tick, retention,
                              created_by, kind, parent)
            block.ref_count = 1
            records[block_id] = block
            run.append(block)
            parent = block
        self._tick = tick
        if run:
            self._register(run, seq, now)

    def _register(self, run: list[BlockInfo], seq: Sequence, now: float) -> None:
        """Put a chain of new records in the tree, then tell the policy (``on_insert``)."""
        self.tree.insert_chain(run)
        if self.tiers is not None:  # a lower tier's copy of a block computed again
            first = len(seq.cached_blocks)  # the run continues them: its hashes follow
            self.tiers.superseded(run, now, seq.hashes[first:first + len(run)])
        seq.cached_blocks.extend(run)
        self._created.extend(run)
        self.stats.inserted_blocks += len(run)
        on_insert = self._on_insert
        if on_insert is None:
            return
        error = None
        for block in run:
            try:
                on_insert(block, now)
            except Exception as exc:  # cached all the same (the policy indexes candidates,
                if error is None:  # which it will hear of)
                    error = self._policy_error("on_insert", block, exc)
        if error is not None:
            raise error

    def _share(self, seq: Sequence, depth: int, existing: BlockInfo, now: float) -> None:
        """Swap ``seq``'s private block ``depth`` for the identical cached ``existing``."""
        private = seq.block_table[depth]
        self._acquire([existing], now)
        existing.note_sharer(seq.request.session_id, now)
        seq.block_table[depth] = existing.block_id
        seq.cached_blocks.append(existing)
        self.pool.decref_all((private,))
        self.pool.release([private])

    # -- token eviction --------------------------------------------------------------------

    def compact(self, seq_id: Any, num_slots: int) -> list[int]:
        """Token eviction kept ``num_slots`` of a running uncacheable sequence's slots, moved
        into its first slots by the caller: release the blocks past them, tail first, and
        count the dropped tokens (``Sequence.num_dropped``). ``num_tokens``, the logical
        length, is unchanged, and later appends fill the slots after the kept ones.

        Returns the released block ids. Raises `ConfigError` (nothing changed) for a
        sequence that is not running, a cacheable one (its blocks are or may become
        prefix-cache hits, so their contents must stay what their hashes name: build the
        manager with an ``uncacheable`` predicate naming it), or ``num_slots`` outside
        ``[0, num_slots now]``.
        """
        seq = self.sequence(seq_id)
        if seq.status != "running":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}; only a running sequence "
                              "can be compacted")
        if seq.cacheable:
            raise ConfigError(f"sequence {seq_id!r} is cacheable: its blocks may be shared as "
                              "prefix-cache hits and must keep the tokens their hashes name; "
                              "build the manager with uncacheable= naming the requests token "
                              "eviction compacts")
        slots = seq.num_slots
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or \
                not 0 <= num_slots <= slots:
            raise ConfigError(f"num_slots must be an int in [0, {slots}] (the slots sequence "
                              f"{seq_id!r} holds), got {num_slots!r}")
        keep = -(-num_slots // self.block_size)
        freed = seq.block_table[keep:]
        if freed:
            del seq.block_table[keep:]
            self.pool.decref_all(freed)
            self.pool.release(freed[::-1])
        seq.num_dropped += slots - num_slots
        return freed

    # -- release ---------------------------------------------------------------------------

    def finish(self, seq_id: Any) -> None:
        """End a sequence: release its blocks tail first; cached ones become candidates."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self.sequence(seq_id)  # raises: no such sequence
        blocks = seq.cached_blocks
        running = seq.status == "running"
        now = self._now() if running or self._on_finish is not None else self._last_now
        error = self._release(seq, now) if running else None
        del self._seqs[seq_id]
        seq.status = "finished"
        self.stats.finished += 1
        if self._on_finish is not None:
            request = seq.request
            if not request.output_len and seq.num_generated:
                # a request that declared no output (transformers' generate() decides its
                # length): on_finish carries the tokens appended, the answer's length
                request = attrs.evolve(request, output_len=seq.num_generated,
                                       output_tokens=None)
            try:
                self._on_finish(request, blocks, now)
            except Exception as exc:
                raise self._policy_error("on_finish", None, exc) from exc
        if error is not None:
            raise error

    def preempt(self, seq_id: Any) -> Sequence:
        """Release a running sequence's blocks (tail first) but keep it for `resume`. The
        policy's ``on_preempt`` sees them first; if it raises, the sequence stays running."""
        seq = self.sequence(seq_id)
        if seq.status != "running":
            raise ConfigError(f"sequence {seq_id!r} is {seq.status}, not running")
        now = self._now()
        if self._on_preempt is not None:
            try:
                self._on_preempt(seq.request, seq.cached_blocks, now)
            except Exception as exc:
                raise self._policy_error("on_preempt", None, exc) from exc
        error = self._release(seq, now)
        seq.status = "preempted"
        self.stats.preemptions += 1
        if error is not None:
            raise error
        return seq

    def _release(self, seq: Sequence, now: float, touch: bool = True) -> PolicyError | None:
        """Drop ``seq``'s references, tail first: cached blocks left unused become evictable
        (candidates if leaves); private ones go back to the free list."""
        table, blocks = seq.block_table, seq.cached_blocks
        pool = self.pool
        pool.decref_all(table)
        n = len(blocks)
        if len(table) > n:
            pool.release(table[:n - 1:-1] if n else table[::-1])
        unused = []
        tick = self._tick
        for block in reversed(blocks):
            if touch:  # stamp each release: LRU's order, tail first (not on a rollback)
                tick += 1
                block.last_access = now
                block.last_access_tick = tick
            count = block.ref_count - 1
            block.ref_count = count
            if not count:
                unused.append(block)
        self._tick = tick
        seq.block_table = []
        seq.cached_blocks = []
        if unused:
            new = self.tree.unreferenced(unused)
            if new:
                return self._offer(new, now)
        return None

    def _acquire(self, blocks: list[BlockInfo], now: float) -> list[int]:
        """Take a reference on each cached block (they stop being candidates); return their
        ids. If the policy raises on a block leaving its index, nothing is taken."""
        ids = [block.block_id for block in blocks]
        first = []
        for block in blocks:
            if not block.ref_count:
                first.append(block)
            block.ref_count += 1
        self.pool.incref_all(ids)
        if first:
            left = self.tree.referenced(first)
            if left:
                self._withdraw(left, blocks, ids, now)
        return ids

    def _withdraw(self, left: list[BlockInfo], blocks: list[BlockInfo], ids: list[int],
                  now: float) -> None:
        """``left`` stopped being candidates (``blocks`` were acquired): tell the policy."""
        pins = self.pins
        kept = pins.withheld or pins.refused
        on_uncandidate = self.policy.on_uncandidate
        for i, block in enumerate(left):
            if kept and pins.take_back(block.block_id):
                continue  # the policy never had it
            try:
                on_uncandidate(block, now)
            except Exception as exc:
                error = self._policy_error("on_uncandidate", block, exc)
                # roll back: drop the references; the blocks before ``i`` go back to the
                # policy, block ``i`` and those after it never left it
                unused = []
                for b in blocks:
                    b.ref_count -= 1
                    if not b.ref_count:
                        unused.append(b)
                self.pool.decref_all(ids)
                self.tree.unreferenced(unused)
                self._offer(left[:i], now)
                raise error from exc

    # -- eviction --------------------------------------------------------------------------

    def _evict(self, count: int, now: float) -> None:
        """Evict ``count`` candidates (the caller checked that enough exist): the one
        eviction loop. The policy names each victim; candidates the manager keeps from it
        (pinned or refused) are evicted only as described in `kvevict.pins`."""
        pins = self.pins
        if pins.next_expiry <= now:  # ``now`` is fixed: expiring once is enough
            error = self._offer(pins.expire(now), now)
            if error is not None:
                raise error
        candidates, evict_from_tree = self._candidates, self._evict_from_tree
        victim, on_evict = self._victim, self._on_evict
        pop_victim = self._pop_victim
        popped = False
        withheld, refused = self._withheld, self._refused
        listeners = self._eviction_listeners
        records = self._records
        demote = self._demote
        by_class = self.stats.evictions_by_class
        freed: list[int] = []
        evicted: list[BlockInfo] = []  # for the tiers
        error = None
        try:
            for _ in range(count):
                if refused:  # a candidate the policy could not take: no rank to wait for
                    block = pins.fallback()
                    kept = True
                else:
                    popped = pop_victim is not None  # then the policy forgot it already
                    try:
                        victim_id = pop_victim(now) if popped else victim(now)
                    except Exception as exc:
                        raise self._policy_error("pop_victim" if popped else "victim", None,
                                                 exc) from exc
                    block = candidates.get(victim_id)
                    kept = False
                    if block is None or (withheld and victim_id in withheld):
                        block = self._no_victim(victim_id)
                        kept = True
                if listeners:
                    for listener in listeners:
                        listener(block, now)
                if kept or not popped:
                    try:
                        on_evict(block, now)  # also for a kept block the policy never had
                    except Exception as exc:
                        raise self._policy_error("on_evict", block, exc) from exc
                if kept:
                    pins.evicted(block.block_id)
                block_id = block.block_id
                parent = evict_from_tree(block)
                del records[block_id]
                freed.append(block_id)
                if demote is not None:
                    evicted.append(block)
                cls = block.workload_class
                by_class[cls] = by_class.get(cls, 0) + 1
                if parent is not None:  # the parent became a leaf, hence a candidate
                    offered = self._offer((parent,), now)
                    if error is None:
                        error = offered
        finally:
            if freed:
                if evicted:  # to the tier below, or dropped (`kvevict.tiers`), in one burst
                    demote(evicted, now)  # type: ignore[misc]
                self.pool.release(freed)
                self.stats.evictions += len(freed)
        if error is not None:
            raise error

    def _no_victim(self, victim_id: Any) -> BlockInfo:
        """``victim()`` named no offered candidate: the kept candidate to evict when the
        policy holds none, else a `PolicyError`."""
        pins = self.pins
        refused = pins.refused.get(victim_id)
        if refused is not None:  # the policy indexed it after all
            return refused
        offered = self.tree.num_candidates - len(pins.withheld) - len(pins.refused)
        if victim_id is None and not offered:
            block = pins.fallback()
            if block is not None:
                return block
        if victim_id is None:
            raise PolicyError(
                f"{self.policy!r}.victim() returned None but it holds {offered} candidates",
                policy=self.policy, event="victim",
            )
        what = ("a pinned candidate the policy was never offered"
                if victim_id in pins.withheld else "not a candidate")
        raise PolicyError(
            f"{self.policy!r}.victim() returned block {victim_id!r}, which is {what} "
            "(candidates are cached, unused leaves)",
            policy=self.policy, event="victim", block_id=victim_id,
        )

    def add_eviction_listener(self, callback: Callable[[BlockInfo, float], None]) -> None:
        """Call ``callback(block, now)`` just before each eviction (the block still cached),
        from the one eviction loop. For metrics and tests; a listener must not change the
        cache."""
        if not callable(callback):
            raise ConfigError("an eviction listener must be callable(block, now)")
        self._eviction_listeners.append(callback)

    def evict(self, count: int = 1) -> int:
        """Evict up to ``count`` candidates now (e.g. to make room ahead of time); return
        how many were evicted."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError(f"count must be a non-negative int, got {count!r}")
        count = min(count, self.tree.num_evictable)
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
        pins, candidates = self.pins, self.tree.candidates
        for block in blocks:
            if pins.pin(block, expiry) and block.block_id in candidates:
                try:  # withdraw it from the policy first: if that raises, no pin
                    self.policy.on_uncandidate(block, now)
                except Exception as exc:
                    pins.unpin(block.block_id)
                    raise self._policy_error("on_uncandidate", block, exc) from exc
                pins.withhold(block)
        return len(blocks)

    def unpin(self, prefix: Any) -> int:
        """Remove pins from the cached blocks of ``prefix``; return how many were pinned."""
        now = self._now()
        count = 0
        released = []
        for block in self.tree.longest_prefix(self._prefix_hashes(prefix)):
            if block.block_id in self.pins:
                withheld = self.pins.unpin(block.block_id)
                if withheld is not None:
                    released.append(withheld)
                count += 1
        error = self._offer(released, now)
        if error is not None:
            raise error
        return count

    def is_pinned(self, block_id: int) -> bool:
        """Whether a cached block is explicitly pinned (expired pins count as unpinned)."""
        return self.pins.is_pinned(block_id, self.clock())

    def __repr__(self) -> str:
        return (f"KVCacheManager(blocks={self.pool.num_blocks}, block_size={self.block_size}, "
                f"policy={self.policy!r}, cached={len(self.tree)}, free={self.pool.num_free})")
