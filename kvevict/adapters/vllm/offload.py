"""`KVEvictCachePolicy`: a kvevict residency policy deciding vLLM's CPU offload tier.

vLLM's ``CPUOffloadingManager`` keeps offloaded KV in fixed-size *chunks* (one per offload
key: a block hash and a KV cache group) and asks a ``CachePolicy`` which chunks to drop. This
class is that ``CachePolicy``: it owns the chunks (``get`` / ``insert`` / ``remove`` /
``clear``), keeps one kvevict `BlockInfo` record per chunk, and turns vLLM's calls into the
kvevict `Policy` events (``kvevict.policies.base``):

| vLLM call | kvevict events |
|---|---|
| ``insert(key, chunk)`` (a store began) | ``on_insert`` |
| ``mark_evictable`` (a store or the last load finished) | none yet: the chunk is *pending* |
| ``mark_non_evictable`` (a load began) | ``on_uncandidate`` (none if pending) |
| ``on_request_finished`` (reused keys) | ``on_uncandidate`` if offered, ``on_hit``, head first |
| ``on_request_finished`` (every key) | release stamps, tail first; ``on_candidate`` if idle |
| ``touch(keys)`` | as a reuse of ``keys`` |
| ``evict(n, protected)`` | pending ones ``on_candidate``; ``victim`` / ``on_evict`` until ``n`` |
| ``remove(key)`` (a store failed) | ``on_evict`` |
| ``clear()`` | a fresh policy |

Per-request batching: a chunk that becomes idle (its store or load done) is offered to the
policy once, with its final stamp, when its request finishes, and not also when it became
idle; a victim is never chosen before every idle chunk is offered (`flush`, at the top of
``evict``). The policy sees the events kvevict's own manager sends for the same request:
``on_insert`` + one ``on_candidate`` per stored chunk, ``on_uncandidate`` + ``on_hit`` +
``on_candidate`` per hit. A protected victim is set aside (``on_uncandidate``) and offered
back after.

Whenever a victim is chosen, the candidates are exactly the idle chunks (``ref_cnt == 0``):
the offload tier is a flat cache, with no prefix tree, so every idle chunk may go, not only
leaves. Stamps follow `KVCacheManager`'s:
one access counter (``last_access_tick``) for creation, hits and releases, so kvevict's
``lru`` orders chunks exactly as vLLM's built-in ``LRUCachePolicy`` ranks them.

``evict`` is atomic, as vLLM requires: when fewer than ``n`` idle unprotected chunks exist it
returns None before any event. A policy that raises, or names a chunk that is not a current
candidate, is *quarantined*: the adapter logs the error (logger ``kvevict.adapters.vllm``),
keeps it as `policy_error`, stops calling the policy, and evicts from then on in the order
chunks last became idle. vLLM's manager never sees the exception, so its counters and
chunks stay consistent (an exception escaping ``mark_evictable`` would leave the rest of a
``complete_store`` undone).

Which policy runs: the ``kvevict_policy`` (a registered name, default none: required) and
``kvevict_policy_params`` (a mapping) keys of ``kv_connector_extra_config``, read from the
``OffloadingSpec`` that builds the manager (vLLM passes a policy only ``cache_capacity``), or
an `offload_policy` block around a direct ``CPUOffloadingManager(...)``. The request context
(``kv_transfer_params["kvevict"]``: ``session_id``, ``workload_class``, ``priority``,
``until``) becomes the records' session, class and retention hint.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from kvevict.adapters.vllm import check_vllm_version, policy_failure, vllm_version
from kvevict.errors import ConfigError, PolicyError
from kvevict.policies.base import Policy
from kvevict.policies.registry import build_policy, is_offline
from kvevict.types import WORKLOAD_CLASSES, BlockInfo, MonotonicClock, RetentionHint

vllm_version()  # ImportError with the install line when vLLM is absent
check_vllm_version()

from vllm.v1.kv_offload.base import OffloadKey, ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.base import (  # noqa: E402
    CachePolicy,
    ChunkStatus,
    order_request_keys,
)

__all__ = ["KVEvictCachePolicy", "OffloadConfig", "OffloadSlot", "RequestInfo", "offload_policy"]

logger = logging.getLogger("kvevict.adapters.vllm")

#: ``kv_connector_extra_config`` keys the adapter reads.
EXTRA_KEYS = ("kvevict_policy", "kvevict_policy_params", "kvevict_chunk_tokens",
              "kvevict_chunk_bytes")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


@attrs.frozen
class OffloadConfig:
    """What `KVEvictCachePolicy` runs: the kvevict policy and the chunks' geometry.

    Args:
        policy: a registered online policy name (``"lru"``, ``"market"``, ...), a fresh
            `Policy` instance or a zero-argument factory.
        params: the policy's parameters (by name only).
        chunk_tokens: tokens per offload chunk (``block_size * blocks_per_chunk`` in vLLM):
            the records' depth and the policy's ``bind``.
        chunk_bytes: KV bytes of one chunk (the records' ``nbytes``; 0 when unknown).
        clock: the time source of every event (default: `MonotonicClock`, seconds).
    """

    policy: Any
    params: Mapping[str, Any] = attrs.field(factory=dict)
    chunk_tokens: int = attrs.field(default=16)
    chunk_bytes: int = attrs.field(default=0)
    clock: Callable[[], float] = attrs.field(factory=MonotonicClock)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.policy, str):
            if is_offline(self.policy):
                raise ConfigError(f"kvevict_policy {self.policy!r} is offline (it needs the "
                                  "future); the offload tier takes an online policy")
        elif not (isinstance(self.policy, Policy) or callable(self.policy)):
            raise ConfigError("kvevict_policy must be a registered policy name, a Policy or a "
                              f"factory, got {type(self.policy).__name__}")
        if not isinstance(self.params, Mapping):
            raise ConfigError("kvevict_policy_params must be a mapping of parameter names to "
                              f"values, got {type(self.params).__name__}")
        _positive_int("kvevict_chunk_tokens", self.chunk_tokens)
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes < 0:
            raise ConfigError(f"kvevict_chunk_bytes must be an int >= 0, got "
                              f"{self.chunk_bytes!r}")
        if not callable(self.clock):
            raise ConfigError(f"clock must be callable, got {type(self.clock).__name__}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], *, chunk_tokens: int | None = None,
                          chunk_bytes: int | None = None) -> OffloadConfig:
        """Parse ``kv_connector_extra_config``; ``chunk_tokens`` / ``chunk_bytes`` are the
        spec's, used when the extra config does not set ``kvevict_chunk_*``."""
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a mapping, got "
                              f"{type(extra).__name__}")
        name = extra.get("kvevict_policy")
        if not isinstance(name, str) or not name:
            raise ConfigError(
                "eviction_policy KVEvictCachePolicy needs kv_connector_extra_config "
                "\"kvevict_policy\": a registered kvevict policy name such as \"lru\" or "
                f"\"market\"; got {name!r}"
            )
        params = extra.get("kvevict_policy_params") or {}
        tokens = extra.get("kvevict_chunk_tokens", chunk_tokens)
        if tokens is None:
            raise ConfigError("set kv_connector_extra_config \"kvevict_chunk_tokens\" (tokens "
                              "per offload chunk): the offloading spec did not give it")
        nbytes = extra.get("kvevict_chunk_bytes", chunk_bytes or 0)
        return cls(name, params, tokens, nbytes)


@attrs.define
class OffloadSlot:
    """An `offload_policy` block: its config and the policies built inside it."""

    config: OffloadConfig
    policies: list[KVEvictCachePolicy] = attrs.field(factory=list)


_PENDING: contextvars.ContextVar[OffloadSlot | None] = contextvars.ContextVar(
    "kvevict_vllm_offload_slot", default=None)


@contextlib.contextmanager
def offload_policy(policy: Any, params: Mapping[str, Any] | None = None, *,
                   chunk_tokens: int = 16, chunk_bytes: int = 0,
                   clock: Callable[[], float] | None = None) -> Iterator[OffloadSlot]:
    """Configure the `KVEvictCachePolicy` that a manager built inside this block creates.

    For a ``CPUOffloadingManager`` constructed directly (tests, `replay_offload`), where no
    ``OffloadingSpec`` carries a ``kv_connector_extra_config``. The block yields an
    `OffloadSlot` whose ``policies`` lists the policies built in it (vLLM keeps its policy
    private)::

        with offload_policy("market", {"horizon": 30.0}, chunk_tokens=512) as slot:
            manager = CPUOffloadingManager(1000, cache_policy="KVEvictCachePolicy",
                                           cache_policy_module_path=__name__)
        adapter = slot.policies[0]
    """
    config = OffloadConfig(policy, dict(params or {}), chunk_tokens, chunk_bytes,
                           clock if clock is not None else MonotonicClock())
    slot = OffloadSlot(config)
    token = _PENDING.set(slot)
    try:
        yield slot
    finally:
        _PENDING.reset(token)


def _config_from_spec() -> OffloadConfig | None:
    """The config of the ``OffloadingSpec`` whose ``get_manager`` is building this policy
    (found on the call stack: vLLM passes a policy only ``cache_capacity``), or None."""
    from vllm.v1.kv_offload.base import OffloadingSpec

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, OffloadingSpec):
                blocks = getattr(owner, "blocks_per_chunk", None)
                per_block = getattr(owner, "tokens_per_block", None) or (None,)
                tokens = per_block[0] * blocks if per_block[0] and blocks else None
                nbytes = getattr(owner, "kv_bytes_per_chunk", None)
                return OffloadConfig.from_extra_config(
                    owner.extra_config, chunk_tokens=tokens,
                    chunk_bytes=nbytes if isinstance(nbytes, int) else None)
            frame = frame.f_back
    finally:
        del frame
    return None


@attrs.frozen
class RequestInfo:
    """What a request tells the policy: from ``kv_transfer_params["kvevict"]``."""

    session_id: Any = None
    workload_class: str = "chat"
    retention: RetentionHint | None = None

    @classmethod
    def of(cls, req_context: ReqContext) -> RequestInfo:
        """Parsed once per request (kept in the context's per-request state). A malformed
        entry is logged, naming the field, and the defaults are used: a bad request
        parameter must not stop the server."""
        info = req_context.get_state(RequestInfo)
        if info is not None:
            return info
        info = _DEFAULT_INFO
        params = req_context.kv_transfer_params or {}
        hints = params.get("kvevict") if isinstance(params, Mapping) else None
        if hints is not None:
            try:
                info = cls.parse(hints)
            except ConfigError as exc:
                logger.warning("request %s: kv_transfer_params['kvevict'] ignored: %s",
                               req_context.req_id, exc)
        req_context.set_state(info)
        return info

    @classmethod
    def parse(cls, hints: Any) -> RequestInfo:
        """``{"session_id": ..., "workload_class": "agent", "priority": 1.0, "until": t}``."""
        if not isinstance(hints, Mapping):
            raise ConfigError(f"expected a mapping, got {type(hints).__name__}")
        unknown = set(hints) - {"session_id", "workload_class", "priority", "until"}
        if unknown:
            raise ConfigError(f"unknown keys {sorted(unknown)}; expected session_id, "
                              "workload_class, priority, until")
        cls_name = hints.get("workload_class", "chat")
        if not isinstance(cls_name, str) or not cls_name:
            raise ConfigError(f"workload_class must be a non-empty string such as "
                              f"{', '.join(WORKLOAD_CLASSES)}; got {cls_name!r}")
        retention = None
        if "priority" in hints or "until" in hints:
            retention = RetentionHint(hints.get("priority", 0.0), hints.get("until"))
        return cls(hints.get("session_id"), cls_name, retention)


_DEFAULT_INFO = RequestInfo()
_NO_PLACE = (0, _DEFAULT_INFO)


class KVEvictCachePolicy(CachePolicy):
    """vLLM ``CachePolicy`` running a kvevict `Policy` over the offload tier's chunks.

    Args:
        cache_capacity: chunks in the tier (vLLM passes it).
        config: what to run; None: the current `offload_policy` block, else the building
            spec's ``kv_connector_extra_config`` (``kvevict_policy``, ...).

    Attributes:
        policy: the kvevict policy (None once quarantined).
        policy_error: the `PolicyError` that quarantined it, or None.
        evictions: chunks evicted; fallback_evictions: of those, chosen without the policy.
        idle: the idle chunks' keys, in the order they last became idle.
        pending: of those, the ones not yet offered to the policy (`flush` offers them).
    """

    def __init__(self, cache_capacity: int, config: OffloadConfig | None = None) -> None:
        super().__init__(cache_capacity)
        slot = _PENDING.get() if config is None else None
        if slot is not None:
            config = slot.config
            slot.policies.append(self)
        elif config is None:
            config = _config_from_spec()
        if config is None:
            raise ConfigError(
                "KVEvictCachePolicy found no configuration: set kv_connector_extra_config "
                "{\"eviction_policy\": \"KVEvictCachePolicy\", \"cache_policy_module_path\": "
                "\"kvevict.adapters.vllm.offload\", \"kvevict_policy\": NAME} on the "
                "OffloadingConnector, or build the manager inside "
                "kvevict.adapters.vllm.offload.offload_policy(NAME)"
            )
        if not isinstance(config, OffloadConfig):
            raise ConfigError(f"config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        self.clock = config.clock
        self.chunk_tokens = config.chunk_tokens
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        # vLLM's manager calls get() on every lookup, load and store: the dict's own method
        # (the class's `get` says the same, for readers and for vLLM's abstract base)
        self.get = self.chunks.get  # type: ignore[method-assign]
        self.records: dict[OffloadKey, BlockInfo] = {}
        # idle chunks in the order they last became idle (the quarantine's eviction order)
        self.idle: dict[OffloadKey, None] = {}
        # idle chunks not yet offered to the policy (see `flush`)
        self.pending: dict[OffloadKey, None] = {}
        self.key_of: dict[int, OffloadKey] = {}  # record block id (chunk id) -> key
        # where a store miss said a key sits: key -> (depth, request info)
        self._placed: dict[OffloadKey, tuple[int, RequestInfo]] = {}
        self._tick = 0
        self.policy_error: PolicyError | None = None
        self.evictions = 0
        self.fallback_evictions = 0
        self.policy: Policy | None = None
        self._start_policy()

    def _start_policy(self) -> None:
        config = self.config
        policy = build_policy(config.policy, config.params)
        policy.bind(config.chunk_tokens)
        self.policy = policy
        self.policy_error = None

    # -- errors ------------------------------------------------------------------------------

    def _quarantine(self, event: str, key: OffloadKey | None, exc: BaseException | None,
                    message: str | None = None) -> None:
        record = self.records.get(key) if key is not None else None
        block_id = record.block_id if record is not None else None
        self.policy_error = policy_failure(self.policy, event, "chunk", block_id, exc, message,
                                           "the offload tier now evicts without it")
        self.policy = None

    def _call(self, event: str, record: BlockInfo, key: OffloadKey) -> None:
        """Send a block event; quarantine the policy if it raises."""
        try:
            getattr(self.policy, event)(record, self.clock())
        except Exception as exc:
            self._quarantine(event, key, exc)

    # -- chunk storage -----------------------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        now = self.clock()
        depth, info = self._placed.get(key, _NO_PLACE)
        self._tick += 1
        # no parent: the offload tier is flat (a chunk's prefix may be elsewhere or gone)
        record = BlockInfo(chunk.chunk_id, key, None, depth, None, self.config.chunk_bytes,
                           info.workload_class, info.session_id, now, self._tick,
                           info.retention, "prefill", "prompt")
        self.chunks[key] = chunk
        self.records[key] = record
        self.key_of[chunk.chunk_id] = key
        policy = self.policy
        if policy is not None:
            try:
                policy.on_insert(record, now)
            except Exception as exc:
                self._quarantine("on_insert", key, exc)
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        record = self.records.pop(key)
        self.key_of.pop(record.block_id, None)
        self._placed.pop(key, None)
        self.idle.pop(key, None)
        self.pending.pop(key, None)
        if self.policy is not None:
            self._call("on_evict", record, key)

    def clear(self) -> None:
        """Drop every chunk. A policy given by name or factory is built afresh (it forgets
        what it learned, as vLLM's ARC does); a policy instance is told ``on_evict`` for
        every chunk instead."""
        records, idle = self.records, self.idle
        instance = isinstance(self.config.policy, Policy)
        if instance and self.policy is not None:
            for key in list(records):
                self._call("on_evict", records[key], key)
                if self.policy is None:
                    break
        self.chunks.clear()
        records.clear()
        idle.clear()
        self.pending.clear()
        self.key_of.clear()
        self._placed.clear()
        # the tick goes on: a policy instance outlives the reset, and ticks order its
        # accesses strictly (a restart would give new records the ticks of old entries)
        if not instance:  # a quarantined instance stays quarantined
            self._start_policy()

    def mark_evictable(self, key: OffloadKey) -> None:
        """Idle now; offered to the policy when its request finishes, or before the next
        victim is chosen, whichever comes first (`pending`)."""
        self.idle[key] = None
        self.pending[key] = None

    def mark_non_evictable(self, key: OffloadKey) -> None:
        del self.idle[key]
        if key in self.pending:  # never offered: nothing to withdraw
            del self.pending[key]
            return
        policy = self.policy
        if policy is not None:
            try:
                policy.on_uncandidate(self.records[key], self.clock())
            except Exception as exc:
                self._quarantine("on_uncandidate", key, exc)

    def flush(self) -> None:
        """Offer the policy every `pending` idle chunk (``on_candidate``, in the order they
        became idle), so that its candidates are exactly the idle chunks."""
        pending = self.pending
        policy = self.policy
        if pending and policy is not None:
            on_candidate, records, now = policy.on_candidate, self.records, self.clock()
            for key in pending:
                try:
                    on_candidate(records[key], now)
                except Exception as exc:
                    self._quarantine("on_candidate", key, exc)
                    break
        pending.clear()

    # -- request events ----------------------------------------------------------------------

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Remember where each missed key sits in its request (depth, parent), for its
        record at ``insert``; a miss itself is no policy event."""
        info = RequestInfo.of(req_context)
        position = req_context.get_offload_key_position
        tokens = self.chunk_tokens
        placed = self._placed
        for key in keys:
            end = position(key)
            depth = max(0, -(-end // tokens) - 1) if end is not None else 0
            placed[key] = (depth, info)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """An access outside a request's finish (``OffloadingManager.touch``): a reuse."""
        keys = [key for key in keys if key in self.records]
        self._access(keys, set(keys), RequestInfo.of(req_context))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        # one KV cache group: vLLM's manager has put it head to tail already (what
        # order_request_keys would redo, position by position)
        ordered = key_groups[0] if len(key_groups) == 1 else order_request_keys(key_groups,
                                                                                 req_context)
        placed, records = self._placed, self.records
        resident = []
        for key in ordered:
            if placed:
                placed.pop(key, None)
            if key in records:
                resident.append(key)
        self._access(resident, reused_keys, RequestInfo.of(req_context))

    def _access(self, keys: Sequence[OffloadKey], reused: set[OffloadKey],
                info: RequestInfo) -> None:
        """``keys`` (head to tail, resident) were used by one request, ``reused`` of them
        found cached: hits head first, then releases tail first (`KVCacheManager`'s
        stamps); each idle chunk is offered with its final stamp, once (an offered one is
        withdrawn first, a `pending` one just offered)."""
        now = self.clock()
        records, idle, pending = self.records, self.idle, self.pending
        policy = self.policy
        tick = self._tick
        withdrawn: set[OffloadKey] = set()
        if reused:
            session, retention = info.session_id, info.retention
            for key in keys:
                if key not in reused:
                    continue
                record = records[key]
                if policy is not None and key in idle and key not in pending:
                    try:
                        policy.on_uncandidate(record, now)
                    except Exception as exc:
                        self._quarantine("on_uncandidate", key, exc)
                        policy = None
                    withdrawn.add(key)
                tick += 1
                record.last_access = now
                record.last_access_tick = tick
                record.hit_count += 1
                record.last_hit_session = session
                if retention is not None:
                    record.retention = retention
                record.note_sharer(session, now)
                if policy is not None:
                    try:
                        policy.on_hit(record, now)
                    except Exception as exc:
                        self._quarantine("on_hit", key, exc)
                        policy = None
        for key in reversed(keys):
            record = records[key]
            tick += 1
            record.last_access = now
            record.last_access_tick = tick
            if key in idle:
                del idle[key]  # it became idle again: the end of the fallback order
                idle[key] = None
                if key in pending:
                    del pending[key]
                    offered = False
                else:
                    offered = key not in withdrawn
                if policy is not None:
                    event = "on_uncandidate"
                    try:
                        if offered:
                            policy.on_uncandidate(record, now)
                        event = "on_candidate"
                        policy.on_candidate(record, now)
                    except Exception as exc:
                        self._quarantine(event, key, exc)
                        policy = None
        self._tick = tick

    # -- eviction ----------------------------------------------------------------------------

    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` idle chunks not in ``protected``, or None (nothing changed)."""
        if n <= 0:
            return []
        idle = self.idle
        available = len(idle) - sum(1 for key in protected if key in idle)
        if n > available:
            return None
        chosen: list[OffloadKey] = []
        taken: set[OffloadKey] = set()
        self.flush()
        if self.policy is not None:
            self._evict_by_policy(n, protected, chosen, taken)
        if len(chosen) < n:  # quarantined (now or before): the order chunks became idle
            for key in idle:
                if key not in protected and key not in taken:
                    chosen.append(key)
                    taken.add(key)
                    self.fallback_evictions += 1
                    if len(chosen) == n:
                        break
        out = []
        chunks, records, key_of, placed = self.chunks, self.records, self.key_of, self._placed
        for key in chosen:
            chunk = chunks.pop(key)
            del key_of[records.pop(key).block_id]
            del idle[key]
            if placed:
                placed.pop(key, None)
            out.append((key, chunk))
        self.evictions += n
        return out

    def _evict_by_policy(self, n: int, protected: set[OffloadKey], chosen: list[OffloadKey],
                         taken: set[OffloadKey]) -> None:
        """Ask the policy for victims until ``n`` are chosen (into ``chosen``); protected
        victims are set aside and offered back. Stops early only on a quarantine."""
        policy = self.policy
        records, idle, key_of = self.records, self.idle, self.key_of
        victim, on_evict, on_uncandidate = policy.victim, policy.on_evict, policy.on_uncandidate
        now = self.clock()
        aside: list[OffloadKey] = []
        while len(chosen) < n:
            try:
                block_id = victim(now)
            except Exception as exc:
                self._quarantine("victim", None, exc)
                break
            key = key_of.get(block_id) if block_id is not None else None
            if key is None or key not in idle or key in taken:
                self._quarantine("victim", key, None, f"victim {block_id!r} is not an idle "
                                 f"chunk ({len(idle)} idle, {len(chosen)} chosen)")
                break
            record = records[key]
            side = key in protected
            try:
                (on_uncandidate if side else on_evict)(record, now)
            except Exception as exc:
                self._quarantine("on_uncandidate" if side else "on_evict", key, exc)
                break
            if side:
                aside.append(key)
            else:
                chosen.append(key)
                taken.add(key)
        if self.policy is not None:
            for key in aside:
                self._call("on_candidate", records[key], key)
                if self.policy is None:
                    break

    # -- introspection -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.chunks)

    def check(self) -> None:
        """Raise AssertionError unless the adapter's own bookkeeping is consistent."""
        assert self.chunks.keys() == self.records.keys()
        assert set(self.idle) <= set(self.chunks)
        assert set(self.pending) <= set(self.idle)
        for key, chunk in self.chunks.items():
            assert (chunk.ref_cnt == 0) == (key in self.idle), key
            assert self.key_of[self.records[key].block_id] == key
        assert len(self.key_of) == len(self.chunks)

    def __repr__(self) -> str:
        return (f"KVEvictCachePolicy({self.config.policy!r}, chunks={len(self.chunks)}/"
                f"{self.cache_capacity}, idle={len(self.idle)})")

