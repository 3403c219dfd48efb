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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kvevict.adapters.hf.blocks import MANAGED_POOLS
from kvevict.adapters.hf.cache import PagedCache
from kvevict.adapters.hf.model import inspect_model
from kvevict.errors import ConfigError
from kvevict.manager import CacheStats, KVCacheManager
from kvevict.policies.base import Policy
from kvevict.pool import BlockPool
from kvevict.types import MonotonicClock, Request, RetentionHint, as_token_array

__all__ = ["SessionStore"]


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
        **policy_params: passed to the policy when ``policy`` is a name.

    Attributes:
        manager: the `KVCacheManager` (stats, `check()`, eviction listeners).
        pool: the `BlockPool` (``[full layers, 2, blocks, block_size, kv_heads, head_dim]``).
        prompt_tokens: prompt tokens of every turn so far.
        reused_tokens: of those, tokens read from the pool instead of prefilled.
    """

    def __init__(self, model: nn.Module, *, num_blocks: int, block_size: int = 16,
                 policy: Policy | str = "lru", clock: Callable[[], float] | None = None,
                 extra_key: Any = None, **policy_params: Any) -> None:
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
        self.manager = KVCacheManager(self.pool, policy,
                                      clock=clock if clock is not None else MonotonicClock(),
                                      extra_key=extra_key, **policy_params)
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self._turns: dict[Any, int] = {}
        self._open: dict[Any, PagedCache] = {}

    @property
    def stats(self) -> CacheStats:
        """The manager's counters (prefix-cache queries and hits in tokens, evictions, ...)."""
        return self.manager.stats

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
        cache.start_turn(self, seq.seq_id, ids, seq.num_tokens, reuse, on_close=self._closed)
        self._turns[session_id] = turn + 1
        self._open[session_id] = cache
        self.prompt_tokens += len(ids)
        self.reused_tokens += reuse
        return cache

    def finish(self, cache: PagedCache) -> None:
        """Commit a turn (same as ``cache.close()``)."""
        if not isinstance(cache, PagedCache) or cache.store is not self:
            raise ConfigError("finish() takes a cache returned by this store's cache_for()")
        cache.close()

    def _closed(self, cache: PagedCache) -> None:
        for session, open_cache in list(self._open.items()):
            if open_cache is cache:
                del self._open[session]

    def __repr__(self) -> str:
        return (f"SessionStore(model={self.spec.model_name}, blocks={self.pool.num_blocks}, "
                f"block_size={self.pool.block_size}, policy={self.manager.policy!r}, "
                f"open={len(self._open)})")
