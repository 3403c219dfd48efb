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
from kvevict.policies.classic.base import ListEntry, TwoListPolicy
from kvevict.types import BlockInfo

__all__ = ["ARC"]

_T1, _T2 = 0, 1


@register_policy("arc")
class ARC(TwoListPolicy[ListEntry]):
    """ARC (FAST'03) over the candidates of a prefix cache; see the module docstring.

    Args:
        capacity: the cache size ``c`` in blocks; None learns it (the most blocks seen
            resident at once).
    """

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__(capacity)
        #: the adaptive target size of T1, in blocks (0 to c)
        self.p = 0.0
        self._b1: OrderedDict[Any, None] = OrderedDict()  # ghost hashes, LRU first
        self._b2: OrderedDict[Any, None] = OrderedDict()

    # -- queries ---------------------------------------------------------------------------

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(|T1|, |T2|, |B1|, |B2|)``."""
        return self._sizes[_T1], self._sizes[_T2], len(self._b1), len(self._b2)

    def list_of(self, block_id: int) -> str | None:
        """``"T1"`` or ``"T2"`` for a resident block, None for one the policy does not hold."""
        entry = self._entries.get(block_id)
        return None if entry is None else ("T1", "T2")[entry.list]

    def ghost_of(self, block_hash: Any) -> str | None:
        """``"B1"`` or ``"B2"`` if ``block_hash`` is a ghost, else None."""
        if block_hash in self._b1:
            return "B1"
        return "B2" if block_hash in self._b2 else None

    # -- events ----------------------------------------------------------------------------

    def _new_entry(self, block: BlockInfo) -> ListEntry:
        """Cases II to IV: the list a new block enters, adapting ``p`` on a ghost."""
        c = self.capacity or self._peak
        h = block.block_hash
        b1, b2 = self._b1, self._b2
        if h in b1:  # Case II: T1 was too small
            self.p = min(float(c), self.p + max(len(b2) / len(b1), 1.0))
            del b1[h]
            return ListEntry(block, _T2)
        if h in b2:  # Case III: T2 was too small
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[h]
            return ListEntry(block, _T2)
        # Case IV: keep |L1| <= c and |L1| + |L2| <= 2c once the block is in T1
        n1, n2 = self._sizes
        if n1 + len(b1) >= c:
            while b1 and n1 + len(b1) >= c:
                b1.popitem(last=False)
        else:
            while b2 and n1 + n2 + len(b1) + len(b2) >= 2 * c:
                b2.popitem(last=False)
        return ListEntry(block, _T1)

    def on_hit(self, block: BlockInfo, now: float) -> None:
        entry = self._entry(block)
        if entry.list == _T1:  # Case I: seen twice
            self._move(entry, _T2)

    def _key(self, entry: ListEntry) -> int:
        return entry.block.last_access_tick  # LRU within each list

    def _left(self, entry: ListEntry) -> None:
        (self._b1 if entry.list == _T1 else self._b2)[entry.block.block_hash] = None

    # -- REPLACE ---------------------------------------------------------------------------

    def _first(self) -> int:
        return _T1 if self._sizes[_T1] > self.p else _T2  # REPLACE: T1 above its target

    def __repr__(self) -> str:
        return f"ARC(capacity={self.capacity})"
