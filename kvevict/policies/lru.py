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
from collections import OrderedDict

from kvevict.policies.base import ScoredPolicy, register_policy
from kvevict.types import BlockInfo

__all__ = ["LRU"]


@register_policy("lru")
class LRU(ScoredPolicy):
    """Evict the candidate released or hit longest ago. O(1) per event in the common case.

    The manager stamps every access with an increasing counter (``last_access_tick``) while
    the clock never goes back, so ordering by ``(last_access, last_access_tick)`` is ordering
    by the tick alone. A block released by a finishing request becomes a candidate with the
    newest tick: it goes to the end of an ordered queue (vLLM's free-block queue). A block
    that becomes a candidate with an *older* tick (a parent left a leaf by an eviction, a
    rolled-back hit, an unpinned block) goes to the queue's front when it is older than the
    queue's head (the usual case: the parent of the evicted block, released with it), else to
    a small heap; the victim is the older of the queue's head and the heap's top.
    """

    def __init__(self) -> None:
        super().__init__()
        self._queue: OrderedDict[int, int] = OrderedDict()  # block id -> tick, ascending
        self._late: list[tuple[int, int]] = []  # heap of (tick, block id), lazily cleaned
        self._late_ticks: dict[int, int] = {}  # live heap entries: block id -> tick
        self._newest = -1  # tick of the queue's last entry

    def score(self, block: BlockInfo, now: float) -> float:
        return block.last_access

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        tick = block.last_access_tick
        queue = self._queue
        if tick > self._newest:
            queue[block.block_id] = tick
            self._newest = tick
        elif not queue:
            queue[block.block_id] = tick
            self._newest = tick  # the queue's last entry now
        elif tick < queue[next(iter(queue))]:
            # older than every queued block: its front (the parent of an evicted block,
            # released with it, goes first this way, with no heap work)
            queue[block.block_id] = tick
            queue.move_to_end(block.block_id, last=False)
        else:
            live = self._late_ticks
            live[block.block_id] = tick
            late = self._late
            heapq.heappush(late, (tick, block.block_id))
            if len(late) > 2 * len(live) + 1024:
                # mostly entries of blocks hit or pinned since: a cache that seldom evicts
                # never cleans them in `victim`, so keep the live ones (amortized O(1))
                late = self._late = [(t, b) for b, t in live.items()]
                heapq.heapify(late)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        if self._queue.pop(block.block_id, None) is None:
            self._late_ticks.pop(block.block_id, None)

    on_uncandidate = on_evict

    def pop_victim(self, now: float) -> int | None:
        queue = self._queue
        if not self._late:  # no late candidate: the queue's head is the oldest
            return queue.popitem(last=False)[0] if queue else None
        chosen = self.victim(now)
        if chosen is not None and queue.pop(chosen, None) is None:
            del self._late_ticks[chosen]
        return chosen

    def victim(self, now: float) -> int | None:
        late, live = self._late, self._late_ticks
        while late:
            tick, block_id = late[0]
            if live.get(block_id) == tick:
                break
            heapq.heappop(late)  # evicted, dropped or re-offered since it was pushed
        queue = self._queue
        if queue:
            first = next(iter(queue))
            if late and late[0][0] < queue[first]:
                return late[0][1]
            return first
        return late[0][1] if late else None

    def __len__(self) -> int:
        return len(self._queue) + len(self._late_ticks)
