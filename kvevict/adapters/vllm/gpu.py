"""The GPU tier: a kvevict residency policy deciding vLLM's prefix-cache eviction.

vLLM 0.32 has no hook for the GPU prefix cache's eviction order: ``BlockPool`` builds an LRU
``FreeKVCacheBlockQueue`` itself (PR #40270, a pluggable ``GPUCachePolicy``, is unmerged;
`upstream_gpu_policy` looks for it). So this module replaces three vLLM classes by
subclasses, only when a policy is asked for (`install`, the ``vllm.general_plugins`` entry
point `kvevict.adapters.vllm.register_gpu_plugin` with ``KVEVICT_VLLM_POLICY`` set, or a
`gpu_policy` block):

- `KVEvictKVCacheManager` (``KVCacheManager``): sets the request a call is about (its
  session, class and retention hint reach the block records and the request events), and
  builds its ``BlockPool`` as a `KVEvictBlockPool`;
- `KVEvictBlockPool` (``BlockPool``): turns vLLM's per-request calls into kvevict events;
- `KVEvictFreeQueue` (``FreeKVCacheBlockQueue``): ``popleft_n`` (vLLM's allocation) takes the
  free *uncached* blocks first, from the queue's front, as vLLM does, and then the policy's
  victims among the free cached blocks.

| vLLM call (per request, per KV cache group) | kvevict events (`GPUTier`) |
|---|---|
| ``touch(blocks)`` (a prefix hit) | ``on_uncandidate`` if offered, ``on_hit``, then ``on_hits`` |
| ``cache_full_blocks`` (full blocks hashed) | ``on_insert`` per block |
| ``free_blocks`` (tail first) | release stamps; ``on_candidate`` for each free leaf |
| ``popleft_n(n)`` (``get_new_blocks``) | uncached first; then ``pop_victim`` (or ``victim``) |
| ``evict_blocks`` (a connector drops hashes) | ``on_evict`` |
| ``reset_prefix_cache`` | a fresh policy |
| first ``allocate_slots`` / ``free`` of a request | ``on_begin`` / ``on_finish`` |
| ``free`` while running (a preemption) / the next allocation | ``on_preempt`` / ``on_resume`` |
| ``pop_blocks_for_free`` (a deferred free), then their ``free_blocks`` | as ``free`` |

**Candidates are leaves**, as in kvevict's manager: a free cached block is offered to the
policy only if no resident cached block chains from its hash, or another resident block
holds the same hash (vLLM does not deduplicate: a block recomputed while a copy is cached
becomes a twin, and either twin may go without breaking a chain). vLLM's lookup stops at
the first miss, so evicting an inner block would strand its children; with leaves only, a
policy that prices blocks by depth cannot do that. Whenever a free cached block exists but
no leaf does (every free one has a child in use), the queue's front goes, in vLLM's order.
Stamps follow kvevict's manager: one access counter for hits (head first) and releases
(tail first), so kvevict's ``lru`` orders leaves exactly as vLLM's free queue does.

A policy that raises, or names a block that is not a current candidate, is *quarantined*
(as in the offload tier): the error is logged (logger ``kvevict.adapters.vllm``) and kept
as `GPUTier.policy_error`, and from then on blocks are evicted from the queue's front, which
is vLLM's own LRU order. No exception reaches vLLM.

**Metrics.** vLLM has no channel from the scheduler's prefix cache to its stat loggers that
a plugin can extend (``SchedulerStats`` has fixed fields; ``vllm.stat_logger_plugins`` run
in the front-end process, not in the engine core that holds the cache), so the tier writes
`GPUTier.metrics` as JSON to the file ``KVEVICT_VLLM_METRICS`` names (``{pid}`` in it
becomes the engine core's process id), every ``KVEVICT_VLLM_METRICS_EVERY`` seconds (10) and
at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import math
import os
import time as _time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from kvevict.adapters.vllm import check_vllm_version, policy_failure, vllm_version
from kvevict.adapters.vllm.offload import RequestInfo
from kvevict.errors import ConfigError, PolicyError
from kvevict.policies.base import Policy, hook, pop_victim_of
from kvevict.policies.registry import build_policy, is_offline, load_entry_point_policies
from kvevict.types import BlockInfo, MonotonicClock, Request

vllm_version()  # ImportError with the install line when vLLM is absent
check_vllm_version()

import vllm.v1.core.kv_cache_coordinator as _coordinator_module  # noqa: E402
import vllm.v1.core.sched.scheduler as _scheduler_module  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

__all__ = [
    "ENV_METRICS",
    "ENV_METRICS_EVERY",
    "ENV_PARAMS",
    "ENV_POLICY",
    "GPUConfig",
    "GPUSlot",
    "GPUTier",
    "KVEvictBlockPool",
    "KVEvictFreeQueue",
    "KVEvictKVCacheManager",
    "gpu_policy",
    "install",
    "installed",
    "uninstall",
    "upstream_gpu_policy",
]

logger = logging.getLogger("kvevict.adapters.vllm")

#: The registered online kvevict policy that decides the GPU prefix cache (unset: stock vLLM).
ENV_POLICY = "KVEVICT_VLLM_POLICY"
#: Its parameters, a JSON object (``{"half_life": 60}``).
ENV_PARAMS = "KVEVICT_VLLM_POLICY_PARAMS"
#: A file the engine core writes `GPUTier.metrics` to as JSON (``{pid}``: its process id).
ENV_METRICS = "KVEVICT_VLLM_METRICS"
#: Seconds between two writes of that file (default `METRICS_EVERY`).
ENV_METRICS_EVERY = "KVEVICT_VLLM_METRICS_EVERY"
#: Default seconds between metrics writes.
METRICS_EVERY = 10.0
#: Victims whose price (a policy's ``price(block, now)``) the metrics keep.
PRICES_KEPT = 16


def upstream_gpu_policy() -> type | None:
    """vLLM's own GPU-tier policy class (``GPUCachePolicy``, PR #40270) if the installed vLLM
    has one, else None.

    The PR adds the class next to ``BlockPool``, which then uses it, so it is looked for in
    ``vllm.v1.core.block_pool`` and ``vllm.v1.core.kv_cache_utils``. vLLM 0.32 has neither.
    """
    import vllm.v1.core.block_pool as block_pool_module
    import vllm.v1.core.kv_cache_utils as utils_module

    for module in (block_pool_module, utils_module):
        found = getattr(module, "GPUCachePolicy", None)
        if isinstance(found, type):
            return found
    return None


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


@attrs.frozen
class GPUConfig:
    """What the GPU tier runs.

    Args:
        policy: a registered online policy name, a fresh `Policy` or a zero-argument factory.
        params: the policy's parameters (by name only).
        clock: the time source of every event (default: `MonotonicClock`, seconds).
        metrics_path: where the tier writes its `GPUTier.metrics` (None: nowhere);
            ``{pid}`` becomes the process id.
        metrics_every: seconds between two writes.
    """

    policy: Any
    params: Mapping[str, Any] = attrs.field(factory=dict)
    clock: Callable[[], float] = attrs.field(factory=MonotonicClock)
    metrics_path: str | None = None
    metrics_every: float = METRICS_EVERY

    def __attrs_post_init__(self) -> None:
        if isinstance(self.policy, str):
            if not self.policy:
                raise ConfigError(f"{ENV_POLICY} must name a registered kvevict policy, such "
                                  "as lru, lfu or market; got an empty string")
            if is_offline(self.policy):
                raise ConfigError(f"{ENV_POLICY}={self.policy} is an offline policy (it "
                                  "needs the future); the GPU tier takes an online policy")
        elif not (isinstance(self.policy, Policy) or callable(self.policy)):
            raise ConfigError("the GPU tier's policy must be a registered policy name, a "
                              f"Policy or a factory, got {type(self.policy).__name__}")
        if not isinstance(self.params, Mapping):
            raise ConfigError(f"{ENV_PARAMS} must be a JSON object of parameter names to "
                              f"values, got {type(self.params).__name__}")
        if not callable(self.clock):
            raise ConfigError(f"clock must be callable, got {type(self.clock).__name__}")
        if self.metrics_path is not None and (not isinstance(self.metrics_path, str)
                                              or not self.metrics_path):
            raise ConfigError(f"{ENV_METRICS} must be a file path, got {self.metrics_path!r}")
        _positive_float(ENV_METRICS_EVERY, self.metrics_every)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> GPUConfig | None:
        """The config the environment asks for, or None when `ENV_POLICY` is unset or empty.

        Raises:
            ConfigError: `ENV_PARAMS` is not a JSON object, `ENV_METRICS_EVERY` not a
                positive number, or the policy is unknown, offline or given a parameter it
                does not take (the policy is built once here to check).
        """
        env = os.environ if environ is None else environ
        name = env.get(ENV_POLICY, "").strip()
        if not name:
            return None
        text = env.get(ENV_PARAMS, "").strip()
        params: Any = {}
        if text:
            try:
                params = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{ENV_PARAMS} must be a JSON object such as "
                                  f"'{{\"half_life\": 60}}'; got {text!r} ({exc.msg} at "
                                  f"character {exc.pos})") from None
            if not isinstance(params, dict):
                raise ConfigError(f"{ENV_PARAMS} must be a JSON object of parameter names to "
                                  f"values, got {type(params).__name__}: {text!r}")
        every_text = env.get(ENV_METRICS_EVERY, "").strip()
        every = METRICS_EVERY
        if every_text:
            try:
                every = float(every_text)
            except ValueError:
                raise ConfigError(f"{ENV_METRICS_EVERY} must be a number of seconds, got "
                                  f"{every_text!r}") from None
        load_entry_point_policies()
        config = cls(name, params, MonotonicClock(), env.get(ENV_METRICS) or None, every)
        build_policy(config.policy, config.params)  # an unknown name or parameter fails here
        return config


@attrs.define
class GPUSlot:
    """A `gpu_policy` block: its config and the tiers built inside it (one per pool)."""

    config: GPUConfig
    tiers: list[GPUTier] = attrs.field(factory=list)


_SLOT: contextvars.ContextVar[GPUSlot | None] = contextvars.ContextVar(
    "kvevict_vllm_gpu_slot", default=None)
_INSTALLED: list[GPUConfig] = []  # the plugin's config, once installed (at most one)


def _free(block: KVCacheBlock) -> bool:
    return block.ref_cnt == 0 and not block.is_null


class GPUTier:
    """The kvevict side of one `KVEvictBlockPool`: block records, the candidate set (free
    cached leaves), the policy and its quarantine, and the metrics.

    Args:
        blocks: the pool's blocks (vLLM's ``BlockPool.blocks``; index = block id).
        queue: the pool's `KVEvictFreeQueue`.
        config: what to run.
        block_size: tokens per block (vLLM's hash block size): the policy's ``bind``.
        block_bytes: KV bytes of one block per KV cache group (the records' ``nbytes``).

    Attributes:
        policy: the kvevict policy (None once quarantined).
        policy_error: the `PolicyError` that quarantined it, or None.
        records: per block id, its `BlockInfo` while it is cached, else None.
        offered: per block id, 1 while it is one of the policy's candidates.
        evictions: cached blocks evicted; of those, ``policy_evictions`` chosen by the policy
            and ``fallback_evictions`` taken from the queue's front (no leaf, or
            quarantined); ``reused_uncached``: allocations served by uncached free blocks.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock], queue: KVEvictFreeQueue,
                 config: GPUConfig, block_size: int, block_bytes: Sequence[int] = (0,)
                 ) -> None:
        self.config = config
        self.block_size = block_size
        self.clock = config.clock
        self.blocks = blocks
        self.queue = queue
        self.block_bytes = tuple(block_bytes)
        n = len(blocks)
        self.records: list[BlockInfo | None] = [None] * n
        self.offered = bytearray(n)
        self.num_candidates = 0
        self.holders: dict[Any, list[int]] = {}  # block hash -> resident blocks holding it
        self.children: dict[Any, int] = {}  # block hash -> resident blocks chaining from it
        self.group_of = bytearray(n)  # block id -> KV cache group of its record
        self.tick = 0
        self.evictions = self.policy_evictions = self.fallback_evictions = 0
        self.reused_uncached = self.hits = self.inserts = self.vllm_evictions = 0
        self.evictions_by_class: dict[str, int] = {}
        self.prices: deque[float] = deque(maxlen=PRICES_KEPT)
        self.policy_error: PolicyError | None = None
        self.policy: Policy | None = None
        # the request a KVEvictKVCacheManager call is about, and what it told the policy
        self.request: Any = None
        self.info: RequestInfo = _DEFAULT_INFO
        self.begun: dict[str, list[BlockInfo]] = {}  # request id -> its cached records
        self.preempted: set[str] = set()  # request ids preempted, waiting to resume
        # finished requests whose free vLLM deferred (pop_blocks_for_free): the ids of the
        # blocks it popped, in allocation order -> (request, held records), oldest first
        self.finishing: dict[tuple[int, ...], deque[tuple[Request, list[BlockInfo]]]] = {}
        self.call_hits: list[BlockInfo] = []
        self.call_new: list[BlockInfo] = []
        self.infos: dict[str, tuple[RequestInfo, Request | None]] = {}
        self.metrics_next = _time.monotonic() + config.metrics_every
        self.metrics_state: tuple[Any, ...] = ()
        self.start_policy()

    # -- the policy --------------------------------------------------------------------------

    def start_policy(self) -> None:
        """Build the policy from the config (a fresh one for a name or a factory)."""
        policy = build_policy(self.config.policy, self.config.params)
        policy.bind(self.block_size)
        self.policy = policy
        self.policy_error = None
        self.p_candidate = policy.on_candidate
        self.p_uncandidate = policy.on_uncandidate
        self.p_evict = policy.on_evict
        self.p_victim = policy.victim
        self.p_pop = pop_victim_of(policy)
        self.p_insert = hook(policy, Policy, "on_insert")
        self.p_hit = hook(policy, Policy, "on_hit")
        self.p_hits = hook(policy, Policy, "on_hits")
        self.p_begin = hook(policy, Policy, "on_begin")
        self.p_finish = hook(policy, Policy, "on_finish")
        self.p_preempt = hook(policy, Policy, "on_preempt")
        self.p_resume = hook(policy, Policy, "on_resume")
        price = getattr(policy, "price", None)
        self.p_price = price if callable(price) and self.config.metrics_path else None

    def quarantine(self, event: str, block_id: int | None, exc: BaseException | None,
                   message: str | None = None) -> None:
        """Stop calling the policy after it raised (or named a non-candidate) in ``event``."""
        self.policy_error = policy_failure(
            self.policy, event, "block", block_id, exc, message,
            "the GPU prefix cache now evicts in vLLM's LRU order")
        self.policy = None
        self.p_insert = self.p_hit = self.p_hits = self.p_begin = self.p_finish = None
        self.p_preempt = self.p_resume = None
        self.p_price = None

    # -- candidates --------------------------------------------------------------------------

    def is_leaf(self, key: Any) -> bool:
        """No resident cached block chains from ``key``, or a twin also holds it."""
        return not self.children.get(key) or len(self.holders[key]) > 1

    def withdraw_sole(self, key: Any, now: float) -> None:
        """``key`` has children now and one holder: that holder, if offered, is an inner
        block again and is withdrawn."""
        holders = self.holders.get(key)
        if holders is None or len(holders) != 1 or self.policy is None:
            return
        block_id = holders[0]
        if self.offered[block_id]:
            self.offered[block_id] = 0
            self.num_candidates -= 1
            try:
                self.p_uncandidate(self.records[block_id], now)
            except Exception as exc:
                self.quarantine("on_uncandidate", block_id, exc)

    def offer_free(self, key: Any, now: float) -> None:
        """``key``'s holders are leaves now (its last child went, or it got a twin): each
        free one not yet offered is, with its own stamp."""
        holders = self.holders.get(key)
        if holders is None or self.policy is None:
            return
        blocks, offered, records = self.blocks, self.offered, self.records
        for block_id in holders:
            if not offered[block_id] and _free(blocks[block_id]):
                offered[block_id] = 1
                self.num_candidates += 1
                try:
                    self.p_candidate(records[block_id], now)
                except Exception as exc:
                    self.quarantine("on_candidate", block_id, exc)
                    return

    def forget(self, block_id: int, now: float) -> BlockInfo:
        """Drop ``block_id``'s record (it is evicted); the policy has been told already. Its
        parent's and twins' leaf status is updated (offered or withdrawn)."""
        records = self.records
        record = records[block_id]
        records[block_id] = None
        if self.offered[block_id]:
            self.offered[block_id] = 0
            self.num_candidates -= 1
        key = record.block_hash
        holders = self.holders[key]
        holders.remove(block_id)
        if not holders:
            del self.holders[key]
        elif len(holders) == 1 and self.children.get(key):
            self.withdraw_sole(key, now)  # the last holder of a hash with children
        parent = record.parent_hash
        if parent is not None:
            left = self.children[parent] - 1
            if left:
                self.children[parent] = left
            else:
                del self.children[parent]
                self.offer_free(parent, now)  # its holders are leaves now
        cls = record.workload_class
        self.evictions_by_class[cls] = self.evictions_by_class.get(cls, 0) + 1
        return record

    # -- request context ---------------------------------------------------------------------

    def begin_call(self, request: Any) -> None:
        """A `KVEvictKVCacheManager` call about ``request`` starts."""
        self.request = request
        entry = self.infos.get(request.request_id)
        if entry is None:
            entry = self.infos[request.request_id] = (_request_info(request), None)
        self.info = entry[0]
        self.call_hits = []
        self.call_new = []

    def end_call(self, allocated: bool) -> None:
        """It ended (``allocated``: vLLM gave it its slots). A request's first call that got
        its slots sends ``on_begin``; the request's cached blocks are kept for
        ``on_finish``."""
        request = self.request
        self.request = None
        self.info = _DEFAULT_INFO
        if request is None or not allocated:
            return
        req_id = request.request_id
        held = self.begun.get(req_id)
        if held is None:
            self.begun[req_id] = self.call_hits + self.call_new
            resumed = req_id in self.preempted
            if resumed:
                self.preempted.discard(req_id)
            started, event = ((self.p_resume, "on_resume") if resumed
                              else (self.p_begin, "on_begin"))
            if started is not None:
                try:
                    started(self.kvevict_request(request), self.call_hits, self.call_new,
                            self.clock())
                except Exception as exc:
                    self.quarantine(event, None, exc)
        elif self.call_new:
            held.extend(self.call_new)

    def preempt(self, request: Any) -> bool:
        """``request`` is about to be freed: if it is still RUNNING, vLLM's scheduler
        preempts it (``_preempt_request`` frees a request whose status is still RUNNING; a
        finished one's is FINISHED_* by then). ``on_preempt`` with the cached blocks it
        holds, before they are released; its next first ``allocate_slots`` sends
        ``on_resume``. False (and nothing sent) if it is not running or never got its
        slots: its free is then a finish."""
        if request.status != RequestStatus.RUNNING:
            return False
        req_id = request.request_id
        held = self.begun.pop(req_id, None)
        if held is None:
            return False
        self.preempted.add(req_id)
        if self.p_preempt is not None:
            self.send_released(self.p_preempt, "on_preempt", self.kvevict_request(request),
                               held)
        return True

    def finish(self, request: Any, deferred: Sequence[KVCacheBlock] = ()) -> None:
        """``request`` was freed: ``on_finish`` with the cached blocks it held (none if it
        was preempted and not resumed), after they are released. ``deferred``: the blocks
        vLLM popped to free later (``pop_blocks_for_free``, when a step in flight may still
        write them); ``on_finish`` then waits for their ``free_blocks`` (`freed`)."""
        req_id = request.request_id
        held = self.begun.pop(req_id, None)
        if req_id in self.preempted:
            self.preempted.discard(req_id)
            held = []
        if held is not None and self.p_finish is not None:
            built = self.kvevict_request(request)
            produced = request.num_output_tokens  # the answer's length, known now
            if produced and produced != built.output_len:
                built = attrs.evolve(built, output_len=int(produced))
            if deferred:
                key = tuple(b.block_id for b in deferred)
                self.finishing.setdefault(key, deque()).append((built, held))
            else:
                self.send_released(self.p_finish, "on_finish", built, held)
        self.infos.pop(req_id, None)

    def freed(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``free_blocks(blocks)`` (tail first), after `released`: if they are the blocks
        of a finished request whose free vLLM deferred, its ``on_finish`` now."""
        key = tuple(b.block_id for b in reversed(blocks))
        waiting = self.finishing.get(key)
        if waiting is None:
            return
        built, held = waiting.popleft()
        if not waiting:
            del self.finishing[key]
        self.send_released(self.p_finish, "on_finish", built, held)

    def send_released(self, event_hook: Callable[..., None] | None, event: str,
                      request: Request, held: list[BlockInfo]) -> None:
        """``event_hook`` (the policy's ``on_finish`` or ``on_preempt``; None: not
        overridden) with the records of ``held`` still cached; quarantine if it raises."""
        if event_hook is None:
            return
        live = [r for r in held if self.records[r.block_id] is r]
        try:
            event_hook(request, live, self.clock())
        except Exception as exc:
            self.quarantine(event, None, exc)

    def kvevict_request(self, request: Any) -> Request:
        """The kvevict `Request` a request event carries (built once per vLLM request). Its
        ``output_len`` is the request's ``max_tokens`` (what is known at its begin);
        `finish` sends ``on_finish`` with the tokens it generated instead, when it
        generated any."""
        info, built = self.infos.get(request.request_id, (None, None))
        if built is not None:
            return built
        if info is None:
            info = _request_info(request)
        bs = self.queue.hash_block_size
        prompt = int(request.num_prompt_tokens)
        hashes = tuple(request.block_hashes[:prompt // bs]) if bs else ()
        params = request.sampling_params
        built = Request(request.request_id, session_id=info.session_id,
                        workload_class=info.workload_class,
                        arrival=float(request.arrival_time), retention=info.retention,
                        output_len=int(params.max_tokens or 0) if params is not None else 0,
                        block_hashes=hashes, num_tokens=prompt)
        self.infos[request.request_id] = (info, built)
        return built

    # -- vLLM's events -----------------------------------------------------------------------

    def hit(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``BlockPool.touch(blocks)``, before vLLM's own: a prefix hit on ``blocks``."""
        now = self.clock()
        records, offered = self.records, self.offered
        info = self.info
        session, retention = info.session_id, info.retention
        on_hit = self.p_hit
        tick = self.tick
        found = []
        for block in blocks:
            record = records[block.block_id]
            if record is None:
                continue
            block_id = block.block_id
            if offered[block_id]:
                offered[block_id] = 0
                self.num_candidates -= 1
                if self.policy is not None:
                    try:
                        self.p_uncandidate(record, now)
                    except Exception as exc:
                        self.quarantine("on_uncandidate", block_id, exc)
                        on_hit = None
            tick += 1
            record.last_access = now
            record.last_access_tick = tick
            record.hit_count += 1
            record.last_hit_session = session
            if retention is not None:
                record.retention = retention
            record.note_sharer(session, now)
            found.append(record)
            if on_hit is not None:
                try:
                    on_hit(record, now)
                except Exception as exc:
                    self.quarantine("on_hit", block_id, exc)
                    on_hit = None
        self.tick = tick
        self.hits += len(found)
        if found:
            self.call_hits.extend(found)
            if self.p_hits is not None and self.request is not None:
                try:
                    self.p_hits(self.kvevict_request(self.request), found, now)
                except Exception as exc:
                    self.quarantine("on_hits", None, exc)

    def cached(self, request: Any, blocks: Sequence[KVCacheBlock], first: int, end: int,
               block_size: int, group: int) -> None:
        """``cache_full_blocks``, after vLLM's own: ``blocks[first:end]`` (of ``block_size``
        tokens, KV cache group ``group``) got their hashes."""
        now = self.clock()
        records, holders, children = self.records, self.holders, self.children
        info = self.info if self.request is request else _request_info(request)
        nbytes = self.block_bytes[group] if group < len(self.block_bytes) else 0
        prompt = int(request.num_prompt_tokens)
        on_insert = self.p_insert
        new = self.call_new
        for i in range(first, end):
            block = blocks[i]
            key = block.block_hash
            if key is None or block.is_null:
                continue
            block_id = block.block_id
            old = records[block_id]
            if old is not None:
                if old.block_hash == key:
                    continue
                self.drop(block_id, now)  # re-hashed (a partial block promoted)
            parent_block = blocks[i - 1] if i > 0 else None
            parent = None if parent_block is None or parent_block.is_null \
                else parent_block.block_hash
            # a block whose tokens reach past the prompt holds decoded ones
            decode = (block.block_hash_num_tokens or (i + 1) * block_size) > prompt
            self.tick += 1
            record = BlockInfo(block_id, key, parent, i, None, nbytes, info.workload_class,
                               info.session_id, now, self.tick, info.retention,
                               "decode" if decode else "prefill",
                               "output" if decode else "prompt")
            records[block_id] = record
            self.group_of[block_id] = group
            twins = holders.get(key)
            if twins is None:
                holders[key] = [block_id]
            else:
                twins.append(block_id)
                if len(twins) == 2 and children.get(key):
                    self.offer_free(key, now)  # a twin: the other holder is a leaf now
            if parent is not None:
                count = children.get(parent, 0)
                children[parent] = count + 1
                if not count:
                    self.withdraw_sole(parent, now)  # an inner block now, unless twinned
            self.inserts += 1
            new.append(record)
            if on_insert is not None:
                try:
                    on_insert(record, now)
                except Exception as exc:
                    self.quarantine("on_insert", block_id, exc)
                    on_insert = None

    def released(self, blocks: Sequence[KVCacheBlock]) -> None:
        """``free_blocks(blocks)`` (tail first), after vLLM's own: release stamps, and each
        free cached leaf becomes a candidate."""
        now = self.clock()
        records, offered = self.records, self.offered
        policy = self.policy
        holders, children = self.holders, self.children
        on_candidate = self.p_candidate
        tick = self.tick
        for block in blocks:
            record = records[block.block_id]
            if record is None:
                continue
            tick += 1
            record.last_access = now
            record.last_access_tick = tick
            if block.ref_cnt or policy is None:
                continue
            key = record.block_hash
            if children.get(key) and len(holders[key]) == 1:
                continue  # an inner block: offered when its last child goes
            block_id = block.block_id
            offered[block_id] = 1
            self.num_candidates += 1
            try:
                on_candidate(record, now)
            except Exception as exc:
                self.tick = tick
                self.quarantine("on_candidate", block_id, exc)
                policy = None
        self.tick = tick
        if self.config.metrics_path is not None:
            if self.queue.num_free_blocks == len(self.records) - 1:  # all but the null block
                self.write_metrics(idle=True)  # the pool went idle: the figures are final
            else:
                self.maybe_write_metrics()

    def take(self, n: int) -> list[KVCacheBlock]:
        """``popleft_n(n)``: ``n`` free blocks for ``get_new_blocks``, out of the queue.

        Free uncached blocks first, from the queue's front (where vLLM keeps them); then the
        policy's victims; then, with no candidate left (or the policy quarantined), the
        queue's front (vLLM's LRU order). Every cached one taken is evicted: the policy gets
        ``on_evict`` (``pop_victim`` forgets it itself), and vLLM drops its hash next.
        """
        queue = self.queue
        head = queue.fake_free_list_head
        remove = queue.unlink
        out: list[KVCacheBlock] = []
        now = None
        records, blocks = self.records, self.blocks
        while len(out) < n:
            first = head.next_free_block
            if first.block_hash is None or records[first.block_id] is None:
                remove(first)
                out.append(first)
                if first.block_hash is None:
                    self.reused_uncached += 1
                else:
                    self.evictions += 1
                    self.fallback_evictions += 1
                continue
            if now is None:
                now = self.clock()
            block_id = None
            if self.policy is not None and self.num_candidates:
                block_id = self.pick(now)
            if block_id is None:  # no leaf, or quarantined: vLLM's order
                block_id = first.block_id
                if self.policy is not None:  # on_evict even if never offered (an inner one)
                    try:
                        self.p_evict(records[block_id], now)
                    except Exception as exc:
                        self.quarantine("on_evict", block_id, exc)
                self.fallback_evictions += 1
            else:
                self.policy_evictions += 1
            block = blocks[block_id]
            remove(block)
            self.forget(block_id, now)
            self.evictions += 1
            out.append(block)
        return out

    def pick(self, now: float) -> int | None:
        """The policy's next victim, told ``on_evict`` already; None if it failed (then
        quarantined)."""
        pop = self.p_pop
        try:
            block_id = pop(now) if pop is not None else self.p_victim(now)
        except Exception as exc:
            self.quarantine("pop_victim" if pop is not None else "victim", None, exc)
            return None
        records = self.records
        if not isinstance(block_id, int) or not 0 <= block_id < len(records) \
                or not self.offered[block_id]:
            self.quarantine("victim", block_id if isinstance(block_id, int) else None, None,
                            f"victim {block_id!r} is not a candidate ({self.num_candidates} "
                            "candidates)")
            return None
        record = records[block_id]
        price = self.p_price
        if price is not None:
            try:
                self.prices.append(float(price(record, now)))
            except Exception as exc:  # a price is a metric: never a reason to quarantine
                logger.warning("policy %r: price of block %d failed: %s", self.policy,
                               block_id, exc)
                self.p_price = None
        if pop is None:
            try:
                self.p_evict(record, now)
            except Exception as exc:
                self.quarantine("on_evict", block_id, exc)
        return block_id

    def drop(self, block_id: int, now: float) -> None:
        """A block's record goes outside an allocation (its hash is dropped or replaced):
        the policy forgets it, and its queue position stays vLLM's."""
        record = self.records[block_id]
        if record is None:
            return
        if self.policy is not None:
            try:
                self.p_evict(record, now)
            except Exception as exc:
                self.quarantine("on_evict", block_id, exc)
        self.forget(block_id, now)
        self.vllm_evictions += 1

    def reset(self) -> None:
        """``reset_prefix_cache`` succeeded: every record goes. A policy given by name or
        factory is built afresh; an instance is told ``on_evict`` for each record."""
        now = self.clock()
        instance = isinstance(self.config.policy, Policy)
        for block_id, record in enumerate(self.records):
            if record is not None and instance and self.policy is not None:
                try:
                    self.p_evict(record, now)
                except Exception as exc:
                    self.quarantine("on_evict", block_id, exc)
        n = len(self.records)
        self.records = [None] * n
        self.offered = bytearray(n)
        self.num_candidates = 0
        self.holders.clear()
        self.children.clear()
        # the tick goes on: a policy instance outlives the reset, and ticks order its
        # accesses strictly (a restart would give new records the ticks of old entries)
        self.begun.clear()
        self.preempted.clear()
        if not instance:
            self.start_policy()

    # -- metrics and checks ------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """kvevict's figures for this pool (what the metrics file holds)."""
        return {
            "policy": str(self.config.policy) if isinstance(self.config.policy, str)
            else repr(self.config.policy),
            "params": dict(self.config.params),
            "vllm_version": vllm_version(),
            "pid": os.getpid(),
            "blocks": len(self.records),
            "cached_blocks": sum(r is not None for r in self.records),
            "candidates": self.num_candidates,
            "hits": self.hits,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "policy_evictions": self.policy_evictions,
            "fallback_evictions": self.fallback_evictions,
            "evictions_by_class": dict(sorted(self.evictions_by_class.items())),
            "hash_drops": self.vllm_evictions,
            "reused_uncached": self.reused_uncached,
            "policy_error": None if self.policy_error is None else str(self.policy_error),
            "last_victim_prices": list(self.prices),
        }

    def maybe_write_metrics(self) -> None:
        """Write the metrics file when `GPUConfig.metrics_every` seconds have passed."""
        if self.config.metrics_path is not None and _time.monotonic() >= self.metrics_next:
            self.write_metrics()

    def write_metrics(self, idle: bool = False) -> None:
        """Write `metrics` to the config's file now (atomically: a reader never sees half);
        with ``idle``, only if anything changed since the last write."""
        path = self.config.metrics_path
        if path is None:
            return
        state = (self.hits, self.inserts, self.evictions, self.vllm_evictions,
                 self.policy_error is None)
        if idle and state == self.metrics_state:
            return
        self.metrics_state = state
        self.metrics_next = _time.monotonic() + self.config.metrics_every
        target = path.replace("{pid}", str(os.getpid()))
        tmp = f"{target}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.metrics(), fh, indent=1, sort_keys=True)
            os.replace(tmp, target)
        except OSError as exc:  # a metrics file must never stop the server
            logger.warning("kvevict metrics not written to %s: %s", target, exc)

    def check(self) -> None:
        """Raise AssertionError unless the records, the candidate set and vLLM's pool agree."""
        holders: dict[Any, list[int]] = {}
        children: dict[Any, int] = {}
        for block_id, record in enumerate(self.records):
            block = self.blocks[block_id]
            if record is None:
                assert not self.offered[block_id], block_id
                continue
            assert block.block_hash == record.block_hash, (block_id, "hash")
            holders.setdefault(record.block_hash, []).append(block_id)
            if record.parent_hash is not None:
                children[record.parent_hash] = children.get(record.parent_hash, 0) + 1
        assert {k: sorted(v) for k, v in holders.items()} == \
            {k: sorted(v) for k, v in self.holders.items()}
        assert children == self.children, "children counts"
        if self.policy is not None:
            for block_id, record in enumerate(self.records):
                want = record is not None and _free(self.blocks[block_id]) \
                    and self.is_leaf(record.block_hash)
                if not want and self.offered[block_id]:
                    raise AssertionError(f"block {block_id} offered but not a free leaf")
        assert self.num_candidates == sum(self.offered), "candidate count"


_DEFAULT_INFO = RequestInfo()


def _request_info(request: Any) -> RequestInfo:
    """Session, class and retention of a vLLM request: ``sampling_params.extra_args
    ["kvevict"]`` (``session_id``, ``workload_class``, ``priority``, ``until``), its
    ``session_id`` otherwise; a malformed entry is logged and ignored."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    hints = extra.get("kvevict") if isinstance(extra, Mapping) else None
    session = request.session_id
    if hints is None:
        return _DEFAULT_INFO if session is None else RequestInfo(session)
    try:
        info = RequestInfo.parse(hints)
    except ConfigError as exc:
        logger.warning("request %s: extra_args['kvevict'] ignored: %s", request.request_id, exc)
        return _DEFAULT_INFO if session is None else RequestInfo(session)
    if info.session_id is None and session is not None:
        info = RequestInfo(session, info.workload_class, info.retention)
    return info


class KVEvictFreeQueue(FreeKVCacheBlockQueue):
    """vLLM's free-block queue whose ``popleft_n`` / ``popleft`` ask the `GPUTier`.

    Every other method is vLLM's: the linked list keeps every free block in vLLM's order
    (uncached at the front, cached appended tail first on release), which is the order of
    uncached reuse and the quarantine's fallback; the policy's victims are unlinked from the
    middle (O(1)).
    """

    def __init__(self, blocks: list[KVCacheBlock], hash_block_size: int) -> None:
        super().__init__(blocks)
        self.hash_block_size = hash_block_size
        self.tier: GPUTier | None = None

    def unlink(self, block: KVCacheBlock) -> None:
        """vLLM's ``remove``: ``block`` leaves the queue."""
        FreeKVCacheBlockQueue.remove(self, block)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        tier = self.tier
        if tier is None:
            return super().popleft_n(n)
        return tier.take(n)

    def popleft(self) -> KVCacheBlock:
        if self.tier is None or self.num_free_blocks == 0:
            return super().popleft()
        return self.tier.take(1)[0]


class KVEvictBlockPool(BlockPool):
    """vLLM's ``BlockPool`` feeding a `GPUTier` (built by `KVEvictKVCacheManager`).

    Args: vLLM's, then ``config`` (what to run) and ``block_bytes`` (KV bytes per block, per
    KV cache group).
    """

    def __init__(self, *args: Any, config: GPUConfig, block_bytes: Sequence[int] = (0,),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        queue = KVEvictFreeQueue(self.free_block_queue.get_all_free_blocks(),
                                 self.hash_block_size)
        self.free_block_queue = queue
        self.tier = GPUTier(self.blocks, queue, config, self.hash_block_size, block_bytes)
        queue.tier = self.tier

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.tier.hit(blocks)
        super().touch(blocks)

    def cache_full_blocks(self, request: Any, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: list[bool] | None = None) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks,
                                  block_size, kv_cache_group_id, block_mask)
        if num_cached_blocks < num_full_blocks:
            self.tier.cached(request, blocks, num_cached_blocks, num_full_blocks,
                             block_size, kv_cache_group_id)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        super().free_blocks(blocks)
        tier = self.tier
        tier.released([b for b in blocks if b.pool is None or b.pool is self])
        if tier.finishing:
            tier.freed(blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        tier = self.tier
        now = tier.clock()
        moved = []
        for block_id in block_ids:
            if 0 <= block_id < len(self.blocks) and tier.records[block_id] is not None:
                tier.drop(block_id, now)
                if _free(self.blocks[block_id]):
                    moved.append(self.blocks[block_id])
        super().evict_blocks(block_ids)
        # hashless now: reused first, as vLLM reuses every uncached free block
        for block in moved:
            self.free_block_queue.unlink(block)
        self.free_block_queue.prepend_n(moved)

    def cache_partial_block(self, request: Any, block: KVCacheBlock, num_tokens: int,
                            kv_cache_group_id: int, block_size: int,
                            replace_existing_hashes: bool = False) -> Any:
        out = super().cache_partial_block(request, block, num_tokens, kv_cache_group_id,
                                          block_size, replace_existing_hashes)
        self.resync(block)
        return out

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        super().move_block_hashes(src_block, dst_block)
        self.resync(src_block)

    def resync(self, block: KVCacheBlock) -> None:
        """A block whose primary hash vLLM changed outside ``cache_full_blocks`` (partial
        entries, hybrid models) loses its record: vLLM's order decides it from then on."""
        record = self.tier.records[block.block_id]
        if record is not None and block.block_hash != record.block_hash:
            self.tier.drop(block.block_id, self.tier.clock())

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.tier.reset()
        return done


def _block_bytes(kv_cache_config: Any) -> list[int]:
    """KV bytes of one block of each KV cache group (every layer of the group)."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        try:
            out.append(int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names))
        except Exception:  # a spec without a page size (none in 0.32's attention specs)
            out.append(0)
    return out


def _current_config() -> tuple[GPUConfig | None, GPUSlot | None]:
    slot = _SLOT.get()
    if slot is not None:
        return slot.config, slot
    return (_INSTALLED[0] if _INSTALLED else None), None


_TIERS: weakref.WeakSet[GPUTier] = weakref.WeakSet()


class KVEvictKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager`` whose pool is a `KVEvictBlockPool` running the current
    config (a `gpu_policy` block's, else the installed plugin's), and whose calls tell the
    pool which request they are about.

    Raises:
        ConfigError: built with no config (neither installed nor inside `gpu_policy`).
    """

    def __init__(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        config, slot = _current_config()
        if config is None:
            raise ConfigError(f"KVEvictKVCacheManager needs a policy: set {ENV_POLICY} for "
                              "the vLLM plugin, or build it inside "
                              "kvevict.adapters.vllm.gpu.gpu_policy(NAME)")
        block_bytes = _block_bytes(kv_cache_config)

        def pool(*pool_args: Any, **pool_kwargs: Any) -> KVEvictBlockPool:
            return KVEvictBlockPool(*pool_args, config=config, block_bytes=block_bytes,
                                    **pool_kwargs)

        stock = _coordinator_module.BlockPool
        _coordinator_module.BlockPool = pool  # only while this manager builds its pool
        try:
            super().__init__(kv_cache_config, *args, **kwargs)
        finally:
            _coordinator_module.BlockPool = stock
        if not isinstance(self.block_pool, KVEvictBlockPool):
            raise ConfigError("vLLM built its BlockPool outside kv_cache_coordinator; this "
                              "vLLM's layout is not the one kvevict supports")
        self.tier = self.block_pool.tier
        if slot is not None:
            slot.tiers.append(self.tier)
        if config.metrics_path is not None:
            _TIERS.add(self.tier)

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        tier = self.tier
        tier.begin_call(request)
        out = None
        try:
            out = super().allocate_slots(request, *args, **kwargs)
        finally:
            tier.end_call(out is not None)
        return out

    def free(self, request: Any) -> None:
        tier = self.tier
        preempting = tier.preempt(request)
        tier.begin_call(request)
        try:
            super().free(request)
        finally:
            tier.request = None
            if not preempting:
                tier.finish(request)

    def pop_blocks_for_free(self, request: Any) -> list[KVCacheBlock]:
        """vLLM's deferred free (``Scheduler._free_request_blocks`` while a step in flight
        may still write the blocks): the blocks leave the request now and reach
        ``free_blocks`` later. A preemption sends ``on_preempt`` now, as `free` does; a
        finish sends ``on_finish`` once they are released (`GPUTier.freed`)."""
        tier = self.tier
        preempting = tier.preempt(request)
        blocks = super().pop_blocks_for_free(request)
        if not preempting:
            tier.finish(request, blocks)
        return blocks


def _write_all_metrics() -> None:
    for tier in list(_TIERS):
        tier.write_metrics()


_PATCHED: list[Any] = []  # the scheduler's own KVCacheManager, while installed


def install(config: GPUConfig) -> None:
    """Make every ``KVCacheManager`` vLLM's scheduler builds from now on run ``config``
    (the plugin's work; `uninstall` undoes it).

    Raises:
        ConfigError: the installed vLLM is not supported, or has its own ``GPUCachePolicy``
            (PR #40270), which kvevict does not drive yet.
    """
    if not isinstance(config, GPUConfig):
        raise ConfigError(f"install takes a GPUConfig, got {type(config).__name__}")
    check_vllm_version()
    upstream = upstream_gpu_policy()
    if upstream is not None:
        raise ConfigError(
            f"vLLM {vllm_version()} has its own GPU-tier policy hook ({upstream.__module__}."
            f"{upstream.__name__}, PR #40270); this kvevict replaces vLLM 0.32's internals "
            f"instead and would bypass it. Unset {ENV_POLICY}, or use a vLLM 0.32.x")
    _INSTALLED[:] = [config]
    if not _PATCHED:
        _PATCHED.append(_scheduler_module.KVCacheManager)
        _scheduler_module.KVCacheManager = KVEvictKVCacheManager
    if config.metrics_path is not None:
        atexit.register(_write_all_metrics)
    # through vLLM's logging (a child of its "vllm" logger), so that it shows in its log
    logging.getLogger("vllm.kvevict").info(
        "kvevict: the GPU prefix cache evicts with kvevict policy %r %s%s", config.policy,
        dict(config.params), f"; metrics to {config.metrics_path}" if config.metrics_path
        else "")


def uninstall() -> None:
    """Undo `install`: vLLM's scheduler builds its own ``KVCacheManager`` again."""
    if _PATCHED:
        _scheduler_module.KVCacheManager = _PATCHED.pop()
    _INSTALLED.clear()


def installed() -> GPUConfig | None:
    """The config `install` set, or None."""
    return _INSTALLED[0] if _INSTALLED else None


@contextlib.contextmanager
def gpu_policy(policy: Any, params: Mapping[str, Any] | None = None, *,
               clock: Callable[[], float] | None = None,
               metrics_path: str | None = None) -> Iterator[GPUSlot]:
    """A `KVEvictKVCacheManager` built inside this block runs ``policy``; the block yields
    a `GPUSlot` whose ``tiers`` lists the tiers built in it (for tests and the replay)::

        with gpu_policy("lfu") as slot:
            manager = KVEvictKVCacheManager(kv_cache_config, max_model_len=2048, ...)
        tier = slot.tiers[0]
    """
    config = GPUConfig(policy, dict(params or {}),
                       clock if clock is not None else MonotonicClock(), metrics_path)
    if isinstance(policy, str):
        build_policy(config.policy, config.params)  # an unknown name or parameter fails here
    slot = GPUSlot(config)
    token = _SLOT.set(slot)
    try:
        yield slot
    finally:
        _SLOT.reset(token)
