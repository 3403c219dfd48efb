"""`SessionStore`: multi-turn prefix reuse across ``generate()`` calls.

A store owns one `BlockPool` and the `KVCacheManager` over it. Each turn asks for a cache::

    store = SessionStore(model, num_blocks=4096, policy="lru")
    with store.cache_for("alice", input_ids, workload_class="chat") as cache:
        out = model.generate(input_ids, cache=cache, max_new_tokens=64)

``cache_for`` looks up the longest resident prefix of ``input_ids`` (from any session, so a
shared system prompt hits too), pins it and returns a `PagedCache` already holding it:
``generate()`` prefills only the rest. Every block the turn computes is hashed into the
prefix tree as soon as its forward finishes; closing the cache (``with`` exit, `finish` or the
session's next `cache_for`) releases the turn, and its blocks become candidates that the
store's policy (any kvevict `Policy`: ``"lru"``, ``"market"``, ...) evicts when the pool is
full. A returning session whose tail was evicted recomputes it: the lookup simply stops
earlier. The output is the same either way; only the work differs.

**Tiers** (``host_blocks=``, ``disk_dir=``): a block the policy evicts from the pool is
demoted to a host tier (a CPU tensor) or a disk tier (one checksummed file per block under
``disk_dir``; `kvevict.tiers`) instead of being lost, and a turn whose prefix continues
there reloads it (copied back into pool blocks in ``cache_for``; ``generate()`` prefills only
what no tier holds). `close` (or leaving a ``with SessionStore(...)`` block) writes every
cached block down to the disk tier, so a **new process** with the same model and directory
resumes the conversations from disk::

    with SessionStore(model, num_blocks=4096, disk_dir="kv/") as store:
        ...                                    # turns 1-3
    store = SessionStore(model, num_blocks=4096, disk_dir="kv/")   # another process
    with store.cache_for("alice", turn_4_ids) as cache:  # turns 1-3 reloaded from disk
        ...

The directory's manifest names the model (`model_identity`: its class, config and a
fingerprint of its weights) and the layout (dtype, block size, heads); opening it for
another model or layout raises `ConfigError` naming both. A block file that fails its
checksum (torn, truncated, a flipped byte) is a miss, logged and recomputed, never served.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvevict.adapters.hf.blocks import MANAGED_POOLS
from kvevict.adapters.hf.cache import PagedCache
from kvevict.adapters.hf.model import inspect_model
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.manager import CacheStats, KVCacheManager
from kvevict.policies.base import Policy
from kvevict.pool import BlockPool
from kvevict.tiers import DiskStore, HostStore, Tier, TierProfile, TierStack, TierStats
from kvevict.types import MonotonicClock, Request, RetentionHint, as_token_array

__all__ = ["SessionStore", "model_identity"]

#: Elements of each weight tensor (from each end) that `model_identity` fingerprints.
FINGERPRINT_ELEMENTS = 4096
#: Config keys that do not change the KV a model computes (left out of its identity).
_VOLATILE_CONFIG = ("transformers_version", "_name_or_path", "architectures",
                    "_attn_implementation_autoset", "use_cache", "output_attentions",
                    "output_hidden_states", "return_dict")


def model_identity(model: nn.Module) -> str:
    """A model's identity for a disk tier's manifest: ``"<class>:<32 hex digits>"``, the
    BLAKE2b-128 of its config (less the keys that do not change its KV, such as the
    transformers version) and of every weight tensor's name, shape, dtype and its first and
    last `FINGERPRINT_ELEMENTS` elements. Two models share cached KV on disk only when this
    matches: the same architecture with other weights (a fine-tune, another seed) gets
    another identity. A fingerprint, not a full hash: hashing every weight of a large model
    would take seconds; pass ``model_id=`` to `SessionStore` to name a model yourself."""
    h = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG}
        h.update(json.dumps(data, sort_keys=True, default=str).encode())
    n = FINGERPRINT_ELEMENTS
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
            flat = tensor.detach().reshape(-1)
            part = flat if flat.numel() <= 2 * n else torch.cat([flat[:n], flat[-n:]])
            h.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"{type(model).__name__}:{h.hexdigest()}"


def _prompt_ids(input_ids: Any) -> list[int]:
    """``input_ids`` (``[1, n]`` or ``[n]`` tensor, or a list of ints) as a list of ints."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ConfigError(f"cache_for takes one sequence, input_ids [1, n]; got shape "
                              f"{tuple(input_ids.shape)} (one cache per session turn)")
        input_ids = input_ids[0]
    ids = as_token_array(input_ids, what="input_ids").tolist()
    if not ids:
        raise ConfigError("input_ids is empty; a turn needs at least one token")
    return ids


class SessionStore:
    """Prefix-cached K/V of many sessions in one pool, evicted by a kvevict `Policy`.

    Args:
        model: the decoder-only transformers model (every layer full attention: sliding
            window and other special layers are not pooled, so they could not be restored).
        num_blocks: blocks in the store's pool.
        block_size: tokens per block (default 16); only whole blocks are shared.
        policy: the residency policy, an instance or a registered name (default ``"lru"``).
        clock: callable returning seconds (default: `MonotonicClock`).
        extra_key: mixed into every block hash (e.g. an adapter id).
        host_blocks: blocks of a host tier below the pool (a CPU tensor, pinned when CUDA
            is present; 0: none).
        disk_dir: directory of a disk tier below that (None: none); blocks already there
            (written by an earlier store of the same model and layout) are recovered.
        disk_blocks: the disk tier's capacity in blocks (default: 16 times the pool's).
        cost_model: prices recomputation for the demotion rule and a value-aware policy's
            reload costs (default `CostModel()`: an 8B model on an H100; give this model's).
        demote: ``"cost"`` (demote only what reloads faster than it recomputes; default)
            or ``"always"``.
        host_profile: the host tier's link (a `kvevict.tiers.TIER_PROFILES` name or a
            `TierProfile`; default ``"host-pcie5"``).
        disk_profile: the disk tier's link (likewise; default ``"nvme"``).
        model_id: the model's name in the disk tier's manifest (default `model_identity`).
        **policy_params: passed to the policy when ``policy`` is a name.

    Attributes:
        manager: the `KVCacheManager` (stats, `check()`, eviction listeners).
        pool: the `BlockPool` (``[full layers, 2, blocks, block_size, kv_heads, head_dim]``).
        prompt_tokens: prompt tokens of every turn so far.
        reused_tokens: of those, tokens read from the pool instead of prefilled (reloaded
            ones included).
        tiers: the `TierStack` below the pool, or None.
    """

    def __init__(self, model: nn.Module, *, num_blocks: int, block_size: int = 16,
                 policy: Policy | str = "lru", clock: Callable[[], float] | None = None,
                 extra_key: Any = None, host_blocks: int = 0,
                 disk_dir: str | os.PathLike[str] | None = None, disk_blocks: int | None = None,
                 cost_model: CostModel | None = None, demote: str = "cost",
                 host_profile: TierProfile | str = "host-pcie5",
                 disk_profile: TierProfile | str = "nvme", model_id: str | None = None,
                 **policy_params: Any) -> None:
        spec = inspect_model(model)
        if spec.has_special_layers:
            kinds = sorted(set(spec.layer_types) - {"full_attention"})
            raise ConfigError(f"SessionStore needs every layer to be full attention; "
                              f"{spec.model_name} also has {', '.join(kinds)} layers, whose "
                              "state the pool does not hold (use a standalone PagedCache)")
        self.model = model
        self.spec = spec
        self.pool = BlockPool(num_blocks, block_size, spec.layout(), device=spec.device,
                              dtype=spec.dtype)
        MANAGED_POOLS.add(self.pool)
        self.tiers = _tier_stack(model, num_blocks, host_blocks, disk_dir, disk_blocks,
                                 cost_model, demote, host_profile, disk_profile, model_id)
        self.manager = KVCacheManager(self.pool, policy,
                                      clock=clock if clock is not None else MonotonicClock(),
                                      extra_key=extra_key, tiers=self.tiers, **policy_params)
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self._turns: dict[Any, int] = {}
        self._open: dict[Any, PagedCache] = {}

    @property
    def stats(self) -> CacheStats:
        """The manager's counters (prefix-cache queries and hits in tokens, evictions, ...)."""
        return self.manager.stats

    @property
    def tier_stats(self) -> TierStats | None:
        """What the tiers moved (`kvevict.tiers.TierStats`: ``hit_blocks`` by tier,
        ``reloads``, bytes, drops, checksum failures), or None without tiers."""
        return None if self.tiers is None else self.tiers.stats

    def hits_by_tier(self) -> dict[str, int]:
        """Prefix-cache block hits served by each tier: ``device`` (the pool) and each lower
        tier's reloads (``{"device": hits}`` without tiers)."""
        hits = self.manager.stats.block_hits
        return {"device": hits} if self.tiers is None else self.tiers.hits_by_tier(hits)

    def persist(self) -> int:
        """Write every cached block down to the disk tier, ignoring the cost rule (a new
        process can only resume what is on disk): open turns are committed, every evictable
        pool block is evicted into the tiers, and the tiers above the disk spill into it.
        Returns the blocks the disk tier holds. A block that cannot be written (a full disk,
        an unwritable directory) is dropped and counted (``tier_stats.drops``)."""
        if self.tiers is None or self.tiers.tiers[-1].store.kind != "disk":
            raise ConfigError("persist() needs a disk tier: SessionStore(..., disk_dir=...)")
        for cache in list(self._open.values()):
            cache.close()
        stack, manager = self.tiers, self.manager
        rule = stack.demote_rule
        stack.demote_rule = "always"
        try:
            manager.evict(manager.num_evictable_blocks)
            stack.spill(manager.clock())
        finally:
            stack.demote_rule = rule
        return len(stack.tiers[-1])

    def close(self) -> None:
        """Commit the open turns and, with a disk tier, `persist` the cache; the store
        stays usable (the blocks are reloaded from the tiers on their next hit)."""
        if self.tiers is not None and self.tiers.tiers[-1].store.kind == "disk":
            self.persist()
        else:
            for cache in list(self._open.values()):
                cache.close()

    def __enter__(self) -> SessionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resident_tokens(self, input_ids: Any) -> int:
        """How many leading tokens of ``input_ids`` are resident (whole blocks); no side
        effects."""
        return self.manager.lookup(_prompt_ids(input_ids)).num_cached_tokens

    def cache_for(self, session_id: Any, input_ids: Any, *, workload_class: str = "chat",
                  retention: RetentionHint | None = None) -> PagedCache:
        """A cache for the next turn of ``session_id`` holding the longest resident prefix.

        ``input_ids`` (``[1, n]``) is the whole conversation so far, as passed to
        ``generate()``. The cache holds ``min(resident, n - 1)`` tokens (at least one token is
        prefilled, for the logits); ``cache.reused_tokens`` says how many. An open cache of the
        same session is closed (committed) first.

        Raises:
            ConfigError: bad ``input_ids`` or ``workload_class``.
            OutOfBlocks: cannot happen here (no block is allocated until a forward); a turn
                that outgrows the pool raises it from ``generate()``.
        """
        ids = _prompt_ids(input_ids)
        previous = self._open.pop(session_id, None)
        if previous is not None:
            previous.close()
        turn = self._turns.get(session_id, 0)
        request = Request((session_id, turn), tokens=ids, session_id=session_id,
                          workload_class=workload_class, turn=turn, retention=retention)
        seq = self.manager.begin(request, max_new_tokens=0)
        reuse = min(seq.num_tokens, len(ids) - 1)
        cache = PagedCache(self.model)
        cache.start_turn(self, seq.seq_id, ids, seq.num_tokens, reuse,
                         on_close=functools.partial(self._closed, session_id))
        self._turns[session_id] = turn + 1
        self._open[session_id] = cache
        self.prompt_tokens += len(ids)
        self.reused_tokens += reuse
        return cache

    @property
    def sessions(self) -> list[Any]:
        """The sessions the store counts turns for (every ``cache_for`` id not yet ended with
        `end`), oldest first."""
        return list(self._turns)

    def end(self, session_id: Any) -> int:
        """End a conversation: commit its open turn, if any, and forget its turn count (the
        store's only per-session state, which otherwise grows with every session a long-lived
        server sees). Its blocks stay cached for the policy to evict: another session may
        share them. A later ``cache_for`` with the same id starts a new conversation at turn 0.
        Returns the turns the session had.

        Raises:
            ConfigError: ``session_id`` has no turn in this store (never started, or ended).
        """
        if session_id not in self._turns:
            raise ConfigError(f"end({session_id!r}): no such session in this store (it never "
                              f"had a turn or was already ended); {len(self._turns)} open")
        cache = self._open.pop(session_id, None)
        if cache is not None:
            cache.close()
        return self._turns.pop(session_id)

    def finish(self, cache: PagedCache) -> None:
        """Commit a turn (same as ``cache.close()``)."""
        if not isinstance(cache, PagedCache) or cache.store is not self:
            raise ConfigError("finish() takes a cache returned by this store's cache_for()")
        cache.close()

    def _closed(self, session_id: Any, cache: PagedCache) -> None:
        if self._open.get(session_id) is cache:
            del self._open[session_id]

    def __repr__(self) -> str:
        tiers = "" if self.tiers is None else f", tiers={self.tiers!r}"
        return (f"SessionStore(model={self.spec.model_name}, blocks={self.pool.num_blocks}, "
                f"block_size={self.pool.block_size}, policy={self.manager.policy!r}, "
                f"open={len(self._open)}{tiers})")


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _tier_stack(model: nn.Module, num_blocks: int, host_blocks: Any,
                disk_dir: str | os.PathLike[str] | None, disk_blocks: Any,
                cost_model: CostModel | None, demote: str, host_profile: Any,
                disk_profile: Any, model_id: str | None) -> TierStack | None:
    """The store's tiers below the pool (None when it has none)."""
    host_blocks = _count("host_blocks", host_blocks, 0)
    if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
        raise ConfigError(f"disk_dir must be a directory path, got {disk_dir!r}")
    if disk_blocks is not None:
        _count("disk_blocks", disk_blocks, 1)
        if disk_dir is None:
            raise ConfigError("disk_blocks= sizes a disk tier: give disk_dir= too")
    tiers = []
    if host_blocks:
        tiers.append(Tier(host_blocks, host_profile, store=HostStore(), name="host"))
    if disk_dir is not None:
        size = 16 * num_blocks if disk_blocks is None else disk_blocks
        tiers.append(Tier(size, disk_profile, store=DiskStore(disk_dir), name="disk"))
    if not tiers:
        return None
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError(f"model_id must be a non-empty string, got {model_id!r}")
    identity = model_id if model_id is not None else (
        model_identity(model) if disk_dir is not None else None)
    return TierStack(tiers, cost_model=cost_model, demote=demote, model=identity)
