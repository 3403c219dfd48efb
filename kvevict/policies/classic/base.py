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
surface, and the heap is rebuilt when they outnumber the live ones). The entry added last
waits beside the heap and is taken first when it is the smallest: the parent an eviction
exposes is often the next victim, and then costs no heap work.

**Two lists.** ARC, SLRU and 2Q keep every resident block in one of two lists (ARC's ``T1``
and ``T2``, SLRU's probationary and protected segments, 2Q's ``A1in`` and ``Am``) and evict
the first candidate of the list their rule names, or of the other list when that one has no
candidate. `TwoListPolicy` is that bookkeeping, once: the entries, a `KeyedHeap` of each list's
candidates, each list's resident count; a subclass says which list a new block enters
(``_new_entry``), a candidate's key in its list (``_key``), which list to evict from
(``_first``) and what a block that leaves the cache leaves behind (``_left``: a ghost).
"""

from __future__ import annotations

import abc
import heapq
import math
from typing import Any, Generic, TypeVar

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy
from kvevict.types import BlockInfo

__all__ = ["ClassicPolicy", "KeyedHeap", "ListEntry", "TwoListPolicy", "check_capacity",
           "check_ratio"]


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
    The entry added last waits beside the heap until the next ``add`` (a chain's tail goes
    block by block, each eviction exposing the next victim), and is taken first when its key
    is the smallest: those evictions cost no heap push or pop.
    """

    __slots__ = ("_heap", "_held", "_keys")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int]] = []
        self._held: tuple[Any, int] | None = None  # (key, block id) added last
        self._keys: dict[int, Any] = {}

    def add(self, block_id: int, key: Any) -> None:
        """Index ``block_id`` under ``key``."""
        keys = self._keys
        keys[block_id] = key
        held = self._held
        self._held = (key, block_id)
        if held is None or keys.get(held[1]) != held[0]:
            return  # nothing held, or a stale entry: dropped
        heap = self._heap
        heapq.heappush(heap, held)
        if len(heap) > 2 * len(keys) + 1024:  # mostly stale: rebuild, amortized O(1)
            self._heap = [(k, b) for b, k in keys.items() if b != block_id]
            heapq.heapify(self._heap)

    def discard(self, block_id: int) -> bool:
        """Drop ``block_id``; whether it was indexed."""
        return self._keys.pop(block_id, None) is not None

    def _first(self) -> tuple[Any, int] | None:
        """The entry with the smallest live key, the held one or the heap's top."""
        heap, keys = self._heap, self._keys
        held = self._held
        if held is not None:
            if keys.get(held[1]) != held[0]:
                self._held = held = None  # discarded or re-keyed since it was added
            elif not heap or held < heap[0]:
                return held  # below the heap's first entry, stale or not: below them all
        while heap:
            key, block_id = heap[0]
            if keys.get(block_id) == key:
                break
            heapq.heappop(heap)  # discarded or re-keyed since it was pushed
        if held is not None and (not heap or held < heap[0]):
            return held
        return heap[0] if heap else None

    def peek(self) -> int | None:
        """The block id with the smallest key, or None when empty."""
        first = self._first()
        return None if first is None else first[1]

    def pop(self) -> int | None:
        """Remove and return the block id with the smallest key (None when empty)."""
        first = self._first()
        if first is None:
            return None
        if first is self._held:
            self._held = None
        else:
            heapq.heappop(self._heap)
        block_id = first[1]
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


class ListEntry:
    """A resident block of a `TwoListPolicy` and its list (0 or 1)."""

    __slots__ = ("block", "list")

    def __init__(self, block: BlockInfo, which: int) -> None:
        self.block = block
        self.list = which


E = TypeVar("E", bound=ListEntry)


class TwoListPolicy(ClassicPolicy, Generic[E]):
    """A classic policy over two lists of resident blocks (see the module docstring).

    The victim is the first candidate of list ``_first()``, or of the other list when that one
    has none. A subclass moves an entry between the lists with `_move` (ARC and SLRU on a
    hit, SLRU on a demotion).
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self._entries: dict[int, E] = {}
        #: each list's candidates, by the subclass's `_key`
        self._lists = (KeyedHeap(), KeyedHeap())
        #: each list's resident blocks, candidates or not
        self._sizes = [0, 0]

    # -- what a subclass says --------------------------------------------------------------

    @abc.abstractmethod
    def _new_entry(self, block: BlockInfo) -> E:
        """The entry of ``block``, inserted now, in the list it enters (the cache size
        counts it already; the lists' sizes do not yet)."""

    @abc.abstractmethod
    def _key(self, entry: E) -> Any:
        """A candidate's key in its list: the smallest goes first."""

    @abc.abstractmethod
    def _first(self) -> int:
        """The list to evict from (the other one when it has no candidate)."""

    def _left(self, entry: E) -> None:
        """``entry``'s block was evicted (it has been dropped): remember what the policy
        remembers of it. Nothing by default."""

    # -- events ----------------------------------------------------------------------------

    def _admit(self, block: BlockInfo, now: float = 0.0) -> E:
        """Insert ``block`` into the list `_new_entry` names; also ``on_insert``."""
        old = self._entries.get(block.block_id)
        if old is not None:  # the id was reused without an on_evict: forget the old block
            self._drop(old)
        resident = self._resident = self._resident + 1
        if resident > self._peak:
            self._peak = resident
        entry = self._entries[block.block_id] = self._new_entry(block)
        self._sizes[entry.list] += 1
        return entry

    on_insert = _admit  # type: ignore[assignment]

    def _entry(self, block: BlockInfo) -> E:
        """``block``'s entry, admitted first if the policy does not hold it."""
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        return entry

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)  # _entry, inlined: once per candidate
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        self._lists[entry.list].add(block.block_id, self._key(entry))

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            self._lists[entry.list].discard(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            self._drop(entry)
            self._left(entry)

    def _drop(self, entry: E) -> None:
        """Forget a resident block (nothing remembered)."""
        block_id = entry.block.block_id
        del self._entries[block_id]
        self._lists[entry.list].discard(block_id)
        self._sizes[entry.list] -= 1
        self._resident -= 1

    def _move(self, entry: E, which: int) -> None:
        """Move ``entry`` to list ``which``; a candidate is indexed there by its `_key`."""
        old = entry.list
        sizes = self._sizes
        sizes[old] -= 1
        sizes[which] += 1
        entry.list = which
        block_id = entry.block.block_id
        if self._lists[old].discard(block_id):
            self._lists[which].add(block_id, self._key(entry))

    # -- the victim ------------------------------------------------------------------------

    def victim(self, now: float) -> int | None:
        first = self._first()
        lists = self._lists
        chosen = lists[first].peek()
        return chosen if chosen is not None else lists[1 - first].peek()

    def pop_victim(self, now: float) -> int | None:
        first = self._first()
        lists = self._lists
        chosen = lists[first].pop()
        if chosen is None:
            chosen = lists[1 - first].pop()
            if chosen is None:
                return None
        entry = self._entries.pop(chosen)  # _drop, inlined: the heap popped it already
        self._sizes[entry.list] -= 1
        self._resident -= 1
        self._left(entry)
        return chosen

    def __len__(self) -> int:
        return len(self._lists[0]) + len(self._lists[1])
