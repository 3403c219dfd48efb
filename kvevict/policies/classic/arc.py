"""ARC: adaptive replacement between a recency list and a frequency list, steered by ghosts.

Source: Nimrod Megiddo and Dharmendra S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", USENIX FAST'03 (the algorithm ``ARC(c)``).

**The algorithm.** ``T1`` holds blocks seen once recently, ``T2`` blocks seen at least twice;
``B1`` and ``B2`` remember the hashes of blocks evicted from them (ghosts, no data). ``p`` is
the target size of ``T1``, from 0 to ``c`` (the cache size), starting at 0.

- A hit on a block of ``T1`` or ``T2`` moves it to ``T2``'s MRU end (Case I).
- A block inserted whose hash is in ``B1`` (Case II) raises ``p`` by
  ``max(|B2| / |B1|, 1)`` (at most ``c``); in ``B2`` (Case III) lowers it by
  ``max(|B1| / |B2|, 1)`` (at least 0). Either way the block goes to ``T2``.
- Any other block goes to ``T1`` (Case IV); first the ghosts are trimmed so that after it
  ``|T1| + |B1| <= c`` (dropping ``B1``'s LRU hashes) and ``|T1| + |T2| + |B1| + |B2| <= 2c``
  (dropping ``B2``'s).
- ``REPLACE``: evict ``T1``'s LRU block into ``B1`` when ``|T1| > p``, else ``T2``'s LRU block
  into ``B2``.

**Adaptation to a KV prefix cache.**

- Membership of ``T1`` / ``T2`` covers every resident block and follows its history (insert,
  hits) as in the paper; ``|T1|`` and ``|T2|`` count them all. The victim is the least recent
  *candidate* (cached leaf no sequence uses) of the list ``REPLACE`` names, or of the other
  list when that one has no candidate.
- Recency is the manager's access order (``last_access_tick``: a block's last hit or its
  release, a chain tail first), the order `kvevict.policies.lru.LRU` evicts in: within each
  list ARC evicts as LRU does.
- The manager makes room for a request's missing blocks before it inserts them, so ``REPLACE``
  runs before the block it makes room for is known: ``p`` adapts when that block is inserted,
  and the paper's tie rule (evict from ``T1`` also when ``|T1| = p`` and the new block's hash
  is in ``B2``) is not applied.
- Ghosts are keyed by ``block_hash`` (a recomputed block has the same chained hash). Every
  block that leaves the cache enters its list's ghost.
- ``c`` is the cache size of `kvevict.policies.classic.base` (the most blocks seen resident,
  or ``capacity``).

Index: the candidates of each list sit in a `KeyedHeap` by access tick; O(log n) per event and
per victim.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvevict.policies.base import register_policy
from kvevict.policies.classic.base import ClassicPolicy, KeyedHeap
from kvevict.types import BlockInfo

__all__ = ["ARC"]

_T1, _T2 = 1, 2


class _Entry:
    __slots__ = ("block", "list")

    def __init__(self, block: BlockInfo, which: int) -> None:
        self.block = block
        self.list = which


@register_policy("arc")
class ARC(ClassicPolicy):
    """ARC (FAST'03) over the candidates of a prefix cache; see the module docstring.

    Args:
        capacity: the cache size ``c`` in blocks; None learns it (the most blocks seen
            resident at once).
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        #: the adaptive target size of T1, in blocks (0 to c)
        self.p = 0.0
        self._entries: dict[int, _Entry] = {}
        self._t1 = KeyedHeap()  # T1's candidates by access tick
        self._t2 = KeyedHeap()
        self._n1 = 0  # |T1|, every resident block of T1
        self._n2 = 0
        self._b1: OrderedDict[Any, None] = OrderedDict()  # ghost hashes, LRU first
        self._b2: OrderedDict[Any, None] = OrderedDict()

    # -- queries ---------------------------------------------------------------------------

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(|T1|, |T2|, |B1|, |B2|)``."""
        return self._n1, self._n2, len(self._b1), len(self._b2)

    def list_of(self, block_id: int) -> str | None:
        """``"T1"`` or ``"T2"`` for a resident block, None for one the policy does not hold."""
        entry = self._entries.get(block_id)
        return None if entry is None else f"T{entry.list}"

    def ghost_of(self, block_hash: Any) -> str | None:
        """``"B1"`` or ``"B2"`` if ``block_hash`` is a ghost, else None."""
        if block_hash in self._b1:
            return "B1"
        return "B2" if block_hash in self._b2 else None

    # -- events ----------------------------------------------------------------------------

    def _admit(self, block: BlockInfo, now: float = 0.0) -> _Entry:
        """Insert ``block`` (Cases II to IV); also ``on_insert``."""
        old = self._entries.get(block.block_id)
        if old is not None:  # the id was reused without an on_evict: forget the old block
            self._drop(old)
        resident = self._resident = self._resident + 1
        if resident > self._peak:
            self._peak = resident
        c = self.capacity or self._peak
        h = block.block_hash
        b1, b2 = self._b1, self._b2
        if h in b1:  # Case II: T1 was too small
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[h]
            which = _T2
        elif h in b2:  # Case III: T2 was too small
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[h]
            which = _T2
        else:  # Case IV: keep |L1| <= c and |L1| + |L2| <= 2c once the block is in T1
            n1 = self._n1
            if n1 + len(b1) >= c:
                while b1 and n1 + len(b1) >= c:
                    b1.popitem(last=False)
            else:
                while b2 and n1 + self._n2 + len(b1) + len(b2) >= 2 * c:
                    b2.popitem(last=False)
            which = _T1
        if which == _T1:
            self._n1 += 1
        else:
            self._n2 += 1
        entry = self._entries[block.block_id] = _Entry(block, which)
        return entry

    on_insert = _admit  # type: ignore[assignment]

    def on_hit(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        if entry.list == _T1:  # Case I: seen twice
            entry.list = _T2
            self._n1 -= 1
            self._n2 += 1

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        index = self._t1 if entry.list == _T1 else self._t2
        index.add(block.block_id, block.last_access_tick)

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            (self._t1 if entry.list == _T1 else self._t2).discard(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            self._evicted(entry)

    def _drop(self, entry: _Entry) -> None:
        block_id = entry.block.block_id
        del self._entries[block_id]
        if entry.list == _T1:
            self._t1.discard(block_id)
            self._n1 -= 1
        else:
            self._t2.discard(block_id)
            self._n2 -= 1
        self._resident -= 1

    def _evicted(self, entry: _Entry) -> None:
        self._drop(entry)
        ghost = self._b1 if entry.list == _T1 else self._b2
        ghost[entry.block.block_hash] = None

    # -- REPLACE ---------------------------------------------------------------------------

    def victim(self, now: float) -> int | None:
        if self._n1 > self.p:  # REPLACE: T1 is above its target
            chosen = self._t1.peek()
            return chosen if chosen is not None else self._t2.peek()
        chosen = self._t2.peek()
        return chosen if chosen is not None else self._t1.peek()

    def pop_victim(self, now: float) -> int | None:
        first, second = (self._t1, self._t2) if self._n1 > self.p else (self._t2, self._t1)
        chosen = first.pop()
        if chosen is None:
            chosen = second.pop()
            if chosen is None:
                return None
        entry = self._entries.pop(chosen)  # _evicted, inlined: once per eviction
        self._resident -= 1
        if entry.list == _T1:
            self._n1 -= 1
            self._b1[entry.block.block_hash] = None
        else:
            self._n2 -= 1
            self._b2[entry.block.block_hash] = None
        return chosen

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __repr__(self) -> str:
        return f"ARC(capacity={self.capacity})"
