"""Refcount-pinned: protect widely shared prefixes and hinted blocks, delegate the rest.

A candidate is *protected* until
``max(retention.until, t_k + window)``, where ``t_k`` is the k-th most recent use of the block
by a distinct session (so a system prompt used by >= ``min_sharers`` sessions within
``window`` seconds stays), and ``retention.until`` is the request's explicit hint. Protected
candidates are withheld from the inner policy; when protection lapses they are handed back.
Only when the inner policy has no candidate left is a protected one evicted (the one whose
protection ends first). This is SGLang's and vLLM's "keep the system prompt" intuition made
explicit; cf. prompt-cache pinning in Anthropic's and OpenAI's APIs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, make_policy, register_policy
from kvevict.policies.classic.base import KeyedHeap
from kvevict.types import BlockInfo, Request

__all__ = ["RefcountPinned"]


@register_policy("pinned")
class RefcountPinned(Policy):
    """Wraps any policy; shields shared or hinted blocks while any other candidate exists.

    Args:
        inner: the policy deciding among unprotected candidates (a name or an instance).
        min_sharers: distinct sessions within ``window`` that make a block protected (k).
        window: seconds a session's use counts towards sharing.
        inner_params: parameters for ``inner`` when it is given by name.
    """

    def __init__(self, inner: str | Policy = "lru", min_sharers: int = 3,
                 window: float = 600.0, inner_params: dict[str, Any] | None = None) -> None:
        if isinstance(min_sharers, bool) or not isinstance(min_sharers, int) or min_sharers < 1:
            raise ConfigError(f"min_sharers must be an int >= 1, got {min_sharers!r}")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ConfigError(f"window must be a positive number of seconds, got {window!r}")
        if inner_params is not None and not isinstance(inner_params, dict):
            raise ConfigError(f"inner_params must be a dict, got {type(inner_params).__name__}")
        self.inner = make_policy(inner, **(inner_params or {}))
        self.min_sharers = min_sharers
        self.window = float(window)
        #: protected candidates by (protection end, access tick), and their records
        self._protected = KeyedHeap()
        self._blocks: dict[int, BlockInfo] = {}

    def protected_until(self, block: BlockInfo) -> float:
        """Clock time until which ``block`` is protected (-inf if it is not)."""
        until = -math.inf
        hint = block.retention
        if hint is not None and hint.until is not None:
            until = float(hint.until)
        if block.num_sharers >= self.min_sharers:
            times = sorted(block.sharers.values(), reverse=True)
            until = max(until, times[self.min_sharers - 1] + self.window)
        return until

    def bind(self, block_size: int) -> None:
        super().bind(block_size)
        self.inner.bind(block_size)

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        self.inner.on_begin(request, hits, new, now)

    def on_finish(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        self.inner.on_finish(request, blocks, now)

    def on_preempt(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        self.inner.on_preempt(request, blocks, now)

    def on_resume(self, request: Request, hits: Sequence[BlockInfo],
                  new: Sequence[BlockInfo], now: float) -> None:
        self.inner.on_resume(request, hits, new, now)

    def on_insert(self, block: BlockInfo, now: float) -> None:
        self.inner.on_insert(block, now)

    def on_hit(self, block: BlockInfo, now: float) -> None:
        self.inner.on_hit(block, now)

    def on_hits(self, request: Request, hits: Sequence[BlockInfo], now: float) -> None:
        self.inner.on_hits(request, hits, now)

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        until = self.protected_until(block)
        if until > now:
            self._protected.add(block.block_id, (until, block.last_access_tick))
            self._blocks[block.block_id] = block
        else:
            self.inner.on_candidate(block, now)

    def _leave(self, block: BlockInfo, now: float, evicted: bool) -> None:
        if self._protected.discard(block.block_id):
            del self._blocks[block.block_id]
        elif evicted:
            self.inner.on_evict(block, now)
        else:
            self.inner.on_uncandidate(block, now)

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._leave(block, now, evicted=False)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._leave(block, now, evicted=True)

    def victim(self, now: float) -> int | None:
        # hand back candidates whose protection lapsed (the index drops stale entries, and
        # compacts itself when they pile up in a cache that seldom evicts)
        protected = self._protected
        while (first := protected.peek()) is not None and protected.key(first)[0] <= now:
            protected.pop()
            self.inner.on_candidate(self._blocks.pop(first), now)
        chosen = self.inner.victim(now)
        if chosen is not None:
            return chosen
        return protected.peek()

    @property
    def num_protected(self) -> int:
        """Candidates currently shielded from the inner policy."""
        return len(self._protected)

    def __repr__(self) -> str:
        return (f"RefcountPinned(inner={self.inner!r}, min_sharers={self.min_sharers}, "
                f"window={self.window})")
