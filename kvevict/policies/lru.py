"""Least recently used: vLLM's prefix-cache eviction order, as a `ScoredPolicy`.

Score = the clock time of the block's last hit or release; ties broken by the manager's
access counter. When a request finishes, its blocks are released tail first, so the tail of
the oldest released chain goes first, exactly like vLLM's free-block queue (blocks appended
in reverse order on free, evicted from the front; a hit removes a block from the queue).
Source: vLLM ``vllm/v1/core/kv_cache_utils.py`` (``FreeKVCacheBlockQueue``).

Only leaves of the prefix tree are candidates here (vLLM may evict an inner block whose
children are still cached, which leaves unreachable children behind); the order among leaves
is the same.
"""

from __future__ import annotations

import heapq

from kvevict.policies.base import ScoredPolicy, register_policy
from kvevict.types import BlockInfo

__all__ = ["LRU"]


@register_policy("lru")
class LRU(ScoredPolicy):
    """Evict the candidate released or hit longest ago. O(log n) per event."""

    def score(self, block: BlockInfo, now: float) -> float:
        return block.last_access

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        # ScoredPolicy.on_candidate with score() inlined: LRU is the hot baseline
        key = (block._last_access, block._last_access_tick, block._id)
        self._keys[block._id] = key
        heapq.heappush(self._heap, key)
        if len(self._heap) > 2 * len(self._keys) + 64:
            self._heap = list(self._keys.values())
            heapq.heapify(self._heap)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._keys.pop(block._id, None)

    on_uncandidate = on_evict
