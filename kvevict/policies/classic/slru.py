"""SLRU and 2Q: two-segment LRU, and a FIFO filter in front of an LRU with a ghost queue.

**SLRU** (segmented LRU). Source: Ramakrishna Karedla, J. Spencer Love and Bradley G. Wherry,
"Caching strategies to improve disk system performance", IEEE Computer 27(3), 1994. The cache
is split into a *probationary* and a *protected* segment, each kept in LRU order. A block
enters the probationary segment's MRU end; a hit on a probationary block moves it to the
protected segment's MRU end, and when the protected segment then holds more than its share,
its LRU block is demoted to the probationary segment's MRU end; a hit on a protected block
makes it the protected MRU. Victims come from the probationary segment's LRU end (from the
protected one's when the probationary segment is empty). Karedla et al. leave the split as a
parameter; the default ``protected_ratio = 0.8`` (80% protected, 20% probationary) is the one of
W-TinyLFU's main cache (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
Admission Policy", ACM Transactions on Storage 13(4), 2017) and of Caffeine, the library that
ships it.

**2Q** (the "full version"). Source: Theodore Johnson and Dennis Shasha, "2Q: A Low Overhead
High Performance Buffer Management Replacement Algorithm", VLDB'94. ``A1in`` is a
FIFO of blocks seen once, ``Am`` an LRU of blocks seen again after leaving ``A1in``, and
``A1out`` a FIFO of the hashes of blocks evicted from ``A1in`` (a ghost, no data). A new block
enters ``A1in``, unless its hash is in ``A1out``: then it enters ``Am``. A hit in ``A1in``
does nothing (a *correlated reference*: the paper's rule), a hit in ``Am`` makes the block its
MRU. To make room: when ``|A1in| > Kin`` the FIFO's oldest block is evicted and its hash
enters ``A1out`` (at most ``Kout`` hashes, oldest dropped first); otherwise ``Am``'s LRU block
is evicted (no ghost). Defaults: ``Kin = 25%`` and ``Kout = 50%`` of the cache, the paper's
recommendation (also libCacheSim's ``TwoQ`` defaults ``Ain-size-ratio=0.25,
Aout-size-ratio=0.5``).

**Adaptation to a KV prefix cache** (both). Segment and queue membership covers every resident
block and follows its history (insert, hits) as in the papers; the sizes that steer them
(``|protected|``, ``|A1in|``) count every resident block. The victim is the first *candidate*
(cached leaf no sequence uses) in the order the paper evicts from, or in the other segment or
queue when that one has none.

- Recency is the manager's access order (``last_access_tick``: a block's last hit or its
  release, a chain tail first), as in `kvevict.policies.lru.LRU`. A demoted SLRU block becomes
  the probationary segment's most recent block at the moment of its demotion (it ranks after
  every access made before it, before every access made after).
- SLRU demotes the protected segment's LRU *block*, candidate or not (a demotion moves no data).
- 2Q's ``A1in`` order is insertion order; ``A1out`` is keyed by ``block_hash`` (a recomputed
  block has the same chained hash).
- An access is an insertion or a prefix hit; a release ends the request's access.
- The cache size is that of `kvevict.policies.classic.base` (the most blocks seen resident, or
  ``capacity``).

Index: each segment's or queue's candidates in a `KeyedHeap`, and for SLRU a lazy heap of the
protected blocks by access tick (an entry found stale is pushed again with its current tick,
once per access): amortized O(log n) per event and per victim.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvevict.policies.base import register_policy
from kvevict.policies.classic.base import ListEntry, TwoListPolicy, check_ratio
from kvevict.types import BlockInfo

__all__ = ["SLRU", "TwoQ"]

_PROBATION, _PROTECTED = 0, 1
_NEVER = (-1, 0)


class _SLRUEntry(ListEntry):
    __slots__ = ("demoted",)

    def __init__(self, block: BlockInfo) -> None:  # no super call: once per insert
        self.block = block
        self.list = _PROBATION
        self.demoted: tuple[int, int] = _NEVER  # recency key given by the last demotion


@register_policy("slru")
class SLRU(TwoListPolicy[_SLRUEntry]):
    """Segmented LRU (Karedla et al. 1994) over the candidates of a prefix cache; see the
    module docstring.

    Args:
        protected_ratio: the protected segment's share of the cache, in (0, 1).
        capacity: the cache size in blocks; None learns it (the most blocks seen resident).
    """

    def __init__(self, protected_ratio: float = 0.8, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.protected_ratio = check_ratio("protected_ratio", protected_ratio)
        self._members: list[tuple[int, int]] = []  # protected blocks by tick (lazy)
        self._last_tick = -1  # the newest access tick seen
        self._demotions = 0

    @property
    def protected_size(self) -> int:
        """Resident blocks in the protected segment."""
        return self._sizes[_PROTECTED]

    @property
    def probation_size(self) -> int:
        """Resident blocks in the probationary segment."""
        return self._sizes[_PROBATION]

    def segment_of(self, block_id: int) -> str | None:
        """``"probation"`` or ``"protected"`` for a resident block, else None."""
        entry = self._entries.get(block_id)
        if entry is None:
            return None
        return "protected" if entry.list == _PROTECTED else "probation"

    def _key(self, entry: _SLRUEntry) -> tuple[int, int]:
        """Recency: the later of the block's last access and its last demotion."""
        access = (entry.block.last_access_tick, 0)
        return access if access > entry.demoted else entry.demoted

    def _new_entry(self, block: BlockInfo) -> _SLRUEntry:
        return _SLRUEntry(block)  # the probationary segment

    def _first(self) -> int:
        return _PROBATION

    def on_hit(self, block: BlockInfo, now: float) -> None:
        entry = self._entry(block)
        tick = block.last_access_tick
        if tick > self._last_tick:
            self._last_tick = tick
        entry.demoted = _NEVER
        if entry.list == _PROBATION:
            self._move(entry, _PROTECTED)
            heapq.heappush(self._members, (tick, block.block_id))
            limit = self.protected_ratio * (self.capacity or self._peak)
            sizes = self._sizes
            while sizes[_PROTECTED] > limit and self._demote():
                pass

    def _demote(self) -> bool:
        """Move the protected segment's least recent block to the probationary MRU end."""
        members, entries = self._members, self._entries
        while members:
            tick, block_id = members[0]
            entry = entries.get(block_id)
            if entry is None or entry.list != _PROTECTED:
                heapq.heappop(members)
                continue
            current = entry.block.last_access_tick
            if current != tick:  # accessed since it was pushed
                heapq.heapreplace(members, (current, block_id))
                continue
            heapq.heappop(members)
            self._demotions += 1
            entry.demoted = (self._last_tick, self._demotions)
            self._move(entry, _PROBATION)
            return True
        return False

    def __repr__(self) -> str:
        return f"SLRU(protected_ratio={self.protected_ratio}, capacity={self.capacity})"


_A1IN, _AM = 0, 1


class _TwoQEntry(ListEntry):
    __slots__ = ("seq",)

    def __init__(self, block: BlockInfo, queue: int, seq: int) -> None:
        self.block = block  # ListEntry's fields, set here: once per insert
        self.list = queue
        self.seq = seq


@register_policy("2q")
class TwoQ(TwoListPolicy[_TwoQEntry]):
    """2Q, the full version (Johnson and Shasha, VLDB'94), over the candidates of a prefix
    cache; see the module docstring.

    Args:
        in_ratio: ``Kin``, the ``A1in`` FIFO's share of the cache, in (0, 1).
        out_ratio: ``Kout``, the ``A1out`` ghost's size as a share of the cache, in (0, 10].
        capacity: the cache size in blocks; None learns it (the most blocks seen resident).
    """

    def __init__(self, in_ratio: float = 0.25, out_ratio: float = 0.5,
                 capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.in_ratio = check_ratio("in_ratio", in_ratio)
        self.out_ratio = check_ratio("out_ratio", out_ratio, high=10.0, closed_high=True)
        self._seq = 0
        self._a1out: OrderedDict[Any, None] = OrderedDict()  # ghost hashes, oldest first

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(|A1in|, |Am|, |A1out|)``."""
        return self._sizes[_A1IN], self._sizes[_AM], len(self._a1out)

    def queue_of(self, block_id: int) -> str | None:
        """``"A1in"`` or ``"Am"`` for a resident block, else None."""
        entry = self._entries.get(block_id)
        if entry is None:
            return None
        return "A1in" if entry.list == _A1IN else "Am"

    def in_ghost(self, block_hash: Any) -> bool:
        """Whether ``block_hash`` is in ``A1out``."""
        return block_hash in self._a1out

    def _new_entry(self, block: BlockInfo) -> _TwoQEntry:
        """Into Am if the block's hash is in A1out (seen again after leaving A1in), else
        A1in."""
        self._seq += 1
        a1out = self._a1out
        if block.block_hash in a1out:
            del a1out[block.block_hash]
            return _TwoQEntry(block, _AM, self._seq)
        return _TwoQEntry(block, _A1IN, self._seq)

    def _key(self, entry: _TwoQEntry) -> int:
        """A1in is a FIFO (insertion number), Am an LRU (access tick)."""
        if entry.list == _A1IN:
            return entry.seq
        return entry.block.last_access_tick

    def _left(self, entry: _TwoQEntry) -> None:
        """A block evicted from A1in leaves its hash in A1out (at most Kout, oldest out)."""
        if entry.list == _A1IN:
            a1out = self._a1out
            a1out[entry.block.block_hash] = None
            limit = self.out_ratio * (self.capacity or self._peak)
            while len(a1out) > limit:
                a1out.popitem(last=False)

    def _first(self) -> int:
        # A1in above Kin: its oldest candidate, else Am's least recent
        return _A1IN if self._sizes[_A1IN] > self.in_ratio * (self.capacity or self._peak) \
            else _AM

    def __repr__(self) -> str:
        return (f"TwoQ(in_ratio={self.in_ratio}, out_ratio={self.out_ratio}, "
                f"capacity={self.capacity})")
