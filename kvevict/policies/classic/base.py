"""What the classic policies share: the cache size they learn, and a lazy candidate heap.

**The cache size.** S3-FIFO, ARC, SLRU and 2Q size their queues as fractions of the cache
(S3-FIFO's small queue is 10% of it, 2Q's ``Kin`` 25%, ...), but a kvevict policy is never told
the pool's size. A `ClassicPolicy` therefore counts the blocks it holds resident (every
``on_insert`` adds one, every ``on_evict`` takes one away) and uses the most it has held at
once as the cache size ``C``, unless a ``capacity`` is given. The manager evicts only to make
room, so at the first eviction the resident count is the pool's size (less the private
partial blocks of running token-mode sequences) and the high-water mark stays there: from the
first decision on, the queue targets are those of a cache of that size, fixed as in the papers.
Before the first eviction no target is consulted. A pool that is never filled is never asked
for a victim by the manager (only ``manager.evict``, ahead of time, asks: then ``C`` is the
largest number of blocks cached so far, the cache the policy has actually seen).

**The candidate heap.** `KeyedHeap` holds the candidates of one queue by a key (an insertion
number for a FIFO, the manager's access tick for an LRU list): ``add`` and ``discard`` are
O(log n) and O(1), ``peek`` and ``pop`` amortized O(log n) (stale entries are dropped when they
surface, and the heap is rebuilt when they outnumber the live ones).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy

__all__ = ["ClassicPolicy", "KeyedHeap", "check_capacity", "check_ratio"]


def check_ratio(name: str, value: Any, *, low: float = 0.0, high: float = 1.0,
                closed_high: bool = False) -> float:
    """``value`` as a float in ``(low, high)`` (``(low, high]`` with ``closed_high``), or a
    `ConfigError` naming the parameter and the range."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and low < value
          and (value <= high if closed_high else value < high))
    if not ok:
        bracket = "]" if closed_high else ")"
        raise ConfigError(f"{name} must be a number in ({low:g}, {high:g}{bracket}, got "
                          f"{value!r}")
    return float(value)


def check_capacity(capacity: Any) -> int | None:
    """A policy's ``capacity`` parameter: None (learn it) or an int >= 1 (blocks)."""
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 1):
        raise ConfigError(f"capacity must be None (learned: the most blocks seen resident) "
                          f"or an int >= 1 (blocks), got {capacity!r}")
    return capacity


class KeyedHeap:
    """Candidates by key, smallest first: a binary heap with lazy deletion.

    A block id has at most one live key; ``add`` of an id already present replaces its key.
    """

    __slots__ = ("_heap", "_keys")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int]] = []
        self._keys: dict[int, Any] = {}

    def add(self, block_id: int, key: Any) -> None:
        """Index ``block_id`` under ``key``."""
        self._keys[block_id] = key
        heap = self._heap
        heapq.heappush(heap, (key, block_id))
        if len(heap) > 2 * len(self._keys) + 1024:  # mostly stale: rebuild, amortized O(1)
            self._heap = [(k, b) for b, k in self._keys.items()]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> bool:
        """Drop ``block_id``; whether it was indexed."""
        return self._keys.pop(block_id, None) is not None

    def peek(self) -> int | None:
        """The block id with the smallest key, or None when empty."""
        heap, keys = self._heap, self._keys
        while heap:
            key, block_id = heap[0]
            if keys.get(block_id) == key:
                return block_id
            heapq.heappop(heap)  # discarded or re-keyed since it was pushed
        return None

    def pop(self) -> int | None:
        """Remove and return the block id with the smallest key (None when empty)."""
        block_id = self.peek()
        if block_id is not None:
            heapq.heappop(self._heap)
            del self._keys[block_id]
        return block_id

    def key(self, block_id: int) -> Any:
        """The live key of ``block_id`` (None if it is not indexed)."""
        return self._keys.get(block_id)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class ClassicPolicy(Policy):
    """A policy whose queue targets are fractions of a cache size it learns (see the module
    docstring): ``capacity`` when given, else the most blocks it has held resident at once.

    Subclasses keep ``self._resident`` (blocks held now) and ``self._peak`` (the most held at
    once) current, inline on their hot paths: one more at each insertion, one less at each
    eviction.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = check_capacity(capacity)
        self._resident = 0
        self._peak = 0

    @property
    def cache_size(self) -> int:
        """``C``, in blocks: ``capacity``, else the most blocks seen resident (at least 1)."""
        capacity = self.capacity
        if capacity is not None:
            return capacity
        return self._peak or 1

    @property
    def resident(self) -> int:
        """Blocks the policy holds now (inserted and not yet evicted)."""
        return self._resident
