"""S3-FIFO: a small FIFO queue that filters one-hit blocks, a main FIFO with 2-bit CLOCK
reinsertion, and a ghost FIFO of recently filtered block hashes.

Source: Juncheng Yang, Yazhuo Zhang, Ziyue Qiu, Yao Yue and Rashmi Vinayak, "FIFO queues are
all you need for cache eviction", SOSP'23, and its reference implementation, libCacheSim
``libCacheSim/cache/eviction/S3FIFOv0.c`` ("the original S3FIFO implementation used in" the
paper) and ``S3FIFO.c``.

**The algorithm** (``C`` is the cache size). Every block carries a frequency counter capped at
3 (two bits), zeroed on insertion; a hit adds one.

- *Insert*: a block whose hash is in the ghost queue G goes to the head of the main queue M
  (and leaves G); any other goes to the head of the small queue S.
- *Evict*: from S when ``|S| >= small_ratio * C``, else from M.
- *Evict from S*: look at S's tail. A block hit at least ``move_to_main`` times while in S
  moves to M's head, its counter cleared; the next block is looked at. The first block hit
  fewer times is evicted and its hash enters G (at most ``ghost_ratio * C`` hashes, oldest
  dropped first).
- *Evict from M*: look at M's tail. A block with a counter above 0 is reinserted at M's head
  with the counter decremented; the first block at 0 is evicted.

Defaults: ``small_ratio = 0.1`` (S is 10% of the cache, which the authors found to
"generalize well"; libCacheSim's ``small-size-ratio=0.10``), ``ghost_ratio = 0.9`` (G holds as
many entries as M; libCacheSim's ``ghost-size-ratio=0.90``), counters capped at 3.
``move_to_main = 1``: a block hit once while in S is promoted. The authors' S3-FIFO page says
the tail of S "is either moved to M if it is accessed more than once or G if not" (the
insertion being the first access) "and its access bits are cleared during the move", and the
blog's illustration uses "small-to-main migration threshold 1"; libCacheSim's code defaults
to 2 (``move-to-main-threshold=2``), which ``move_to_main=2`` reproduces.

**Adaptation to a KV prefix cache.** The paper's cache may evict any object; kvevict may evict
only candidates (cached leaves no running sequence uses). Queue membership covers every
resident block and follows its history exactly as in the paper: inserted into S or M (by the
ghost), hits counted, promoted from S to M and reinserted in M when an eviction scan passes
it. A scan passes a non-candidate like any block, promoting or reinserting it when its counter
says so; a non-candidate the paper would evict stays where it is (at the tail, first in line)
and is evicted as soon as it becomes a candidate, unless a hit raises its counter first (then
the next scan reinserts it). So the victim is the first *candidate* in the order the paper
evicts. Details:

- *S*: the first cold candidate (the oldest S candidate hit fewer than ``move_to_main``
  times) is S's victim; every S block hit enough times that entered S before it is promoted
  to M first, in order, as the paper's scan would. With no cold candidate in S, the scan
  promotes every such block and the eviction falls to M. With ``|S|`` below the target and no
  candidate in M, the eviction falls to S.
- *M*: blocks the scan set aside (non-candidates at 0) keep their place before M's tail; one
  that becomes a candidate with its counter still at 0 is the next M victim.
- *Ghosts* are keyed by ``block_hash``: a block evicted and later recomputed has the same hash
  (the chained content hash), so the ghost recognises it as the paper recognises an object id.
  A block evicted from S enters G.
- *The cache size* ``C``: see `kvevict.policies.classic.base` (the most blocks seen resident,
  or ``capacity``).
- *Accesses*: an insertion (the miss that computed the block) and each prefix hit. Releasing
  a block at the end of its request is part of the same access and counts nothing.

`victim` runs the paper's scan up to the victim (the promotions and reinsertions it makes on
the way are the paper's own, lazy by design) and remembers its answer until the next event, so
asking twice names the same block. Index: S's cold candidates and hit blocks are two heaps by
insertion number, M a FIFO (`collections.OrderedDict`) plus two heaps of the blocks set aside;
every promotion, reinsertion and set-aside is paid for by an earlier insertion or hit, so each
event and each victim costs amortized O(log n).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Any

from kvevict.errors import ConfigError
from kvevict.policies.base import register_policy
from kvevict.policies.classic.base import ClassicPolicy, check_ratio
from kvevict.types import BlockInfo

__all__ = ["S3FIFO"]

_SMALL, _MAIN = 0, 1
#: The paper's two-bit counter: frequencies are capped at 3.
MAX_FREQ = 3


class _Entry:
    """One resident block: its queue, position (insertion number) and counter."""

    __slots__ = ("block", "cand", "freq", "parked", "queue", "seq")

    def __init__(self, block: BlockInfo, queue: int, seq: int) -> None:
        self.block = block
        self.queue = queue
        self.seq = seq
        self.freq = 0
        self.cand = False
        self.parked = False  # in M, set aside by a scan (a non-candidate at 0)


@register_policy("s3fifo")
class S3FIFO(ClassicPolicy):
    """S3-FIFO (SOSP'23) over the candidates of a prefix cache; see the module docstring.

    Args:
        small_ratio: the small queue's share of the cache, in (0, 1).
        ghost_ratio: the ghost queue's size as a share of the cache, >= 0.
        move_to_main: hits in the small queue that promote a block to the main one (1 to 3).
        capacity: the cache size in blocks the ratios apply to; None learns it (the most
            blocks seen resident at once).
    """

    def __init__(self, small_ratio: float = 0.1, ghost_ratio: float = 0.9,
                 move_to_main: int = 1, capacity: int | None = None) -> None:
        super().__init__(capacity)
        self.small_ratio = check_ratio("small_ratio", small_ratio)
        if (isinstance(ghost_ratio, bool) or not isinstance(ghost_ratio, (int, float))
                or not math.isfinite(ghost_ratio) or ghost_ratio < 0):
            raise ConfigError(f"ghost_ratio must be a finite number >= 0 (ghost entries per "
                              f"block of the cache), got {ghost_ratio!r}")
        self.ghost_ratio = float(ghost_ratio)
        if (isinstance(move_to_main, bool) or not isinstance(move_to_main, int)
                or not 1 <= move_to_main <= MAX_FREQ):
            raise ConfigError(f"move_to_main must be an int from 1 to {MAX_FREQ} (hits in the "
                              f"small queue that promote a block), got {move_to_main!r}")
        self.move_to_main = move_to_main
        self._entries: dict[int, _Entry] = {}
        self._seq = 0
        self._small = 0  # |S|, every resident block in S
        self._main = 0  # |M|
        self._cold: list[tuple[int, int]] = []  # S candidates hit < move_to_main times (lazy)
        self._hot: list[tuple[int, int]] = []  # S blocks hit >= move_to_main times (lazy)
        self._queue: OrderedDict[int, None] = OrderedDict()  # M not set aside, tail first
        self._ready: list[tuple[int, int]] = []  # set-aside M candidates at 0 (lazy)
        self._again: list[tuple[int, int]] = []  # set-aside M blocks hit since (lazy)
        self._ghost: OrderedDict[Any, None] = OrderedDict()  # block hashes, oldest first
        self._chosen: int | None = None
        self._num_candidates = 0
        self._small_limit = self._ghost_limit = 0.0
        self._resize()

    def _resize(self) -> None:
        """The targets for the current cache size: S's share and G's bound."""
        size = self.capacity or self._peak or 1
        self._small_limit = self.small_ratio * size
        self._ghost_limit = self.ghost_ratio * size

    # -- queries ---------------------------------------------------------------------------

    @property
    def small_size(self) -> int:
        """Resident blocks in the small queue S."""
        return self._small

    @property
    def main_size(self) -> int:
        """Resident blocks in the main queue M."""
        return self._main

    @property
    def ghost_size(self) -> int:
        """Hashes in the ghost queue G."""
        return len(self._ghost)

    def queue_of(self, block_id: int) -> str | None:
        """``"S"`` or ``"M"`` for a resident block, None for one the policy does not hold."""
        entry = self._entries.get(block_id)
        return None if entry is None else "SM"[entry.queue]

    def frequency(self, block_id: int) -> int | None:
        """The block's counter (0 to 3), None for one the policy does not hold."""
        entry = self._entries.get(block_id)
        return None if entry is None else entry.freq

    def in_ghost(self, block_hash: Any) -> bool:
        """Whether ``block_hash`` is in the ghost queue."""
        return block_hash in self._ghost

    # -- events ----------------------------------------------------------------------------

    def _admit(self, block: BlockInfo, now: float = 0.0) -> _Entry:
        """Insert ``block`` (into M if its hash is a ghost, else S); also ``on_insert``."""
        block_id = block.block_id
        entries = self._entries
        old = entries.get(block_id)
        if old is not None:  # the id was reused without an on_evict: forget the old block
            self._drop(old)
        self._chosen = None
        seq = self._seq = self._seq + 1
        ghost = self._ghost
        block_hash = block.block_hash
        if block_hash in ghost:
            del ghost[block_hash]
            entry = entries[block_id] = _Entry(block, _MAIN, seq)
            self._queue[block_id] = None
            self._main += 1
        else:
            entry = entries[block_id] = _Entry(block, _SMALL, seq)
            self._small += 1
        resident = self._resident = self._resident + 1
        if resident > self._peak:
            self._peak = resident
            if self.capacity is None:
                self._resize()
        return entry

    on_insert = _admit  # type: ignore[assignment]

    def on_hit(self, block: BlockInfo, now: float) -> None:
        self._chosen = None
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        freq = entry.freq
        if freq >= MAX_FREQ:
            return
        entry.freq = freq + 1
        if entry.queue == _SMALL:
            if freq + 1 == self.move_to_main:
                heapq.heappush(self._hot, (entry.seq, block.block_id))
        elif entry.parked and freq == 0:
            heapq.heappush(self._again, (entry.seq, block.block_id))

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        self._chosen = None
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._admit(block)
        if not entry.cand:
            entry.cand = True
            self._num_candidates += 1
        if entry.queue == _SMALL:
            if entry.freq < self.move_to_main:
                heapq.heappush(self._cold, (entry.seq, block.block_id))
        elif entry.parked and entry.freq == 0:
            heapq.heappush(self._ready, (entry.seq, block.block_id))

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._chosen = None
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block and entry.cand:
            entry.cand = False
            self._num_candidates -= 1

    def on_evict(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            self._evicted(entry)
        else:
            self._chosen = None

    def _drop(self, entry: _Entry) -> None:
        """Forget a resident block (no ghost)."""
        self._chosen = None
        block_id = entry.block.block_id
        del self._entries[block_id]
        if entry.cand:
            self._num_candidates -= 1
        if entry.queue == _SMALL:
            self._small -= 1
        else:
            self._main -= 1
            if not entry.parked:
                del self._queue[block_id]
        self._resident -= 1

    def _evicted(self, entry: _Entry) -> None:
        """``entry``'s block left the cache: forget it; from S, its hash enters the ghost."""
        self._drop(entry)
        if entry.queue == _SMALL:
            ghost = self._ghost
            ghost[entry.block.block_hash] = None
            while len(ghost) > self._ghost_limit:
                ghost.popitem(last=False)

    # -- the eviction scans ----------------------------------------------------------------

    def _to_main(self, entry: _Entry) -> None:
        """Promote an S block to M's head, its counter cleared."""
        self._seq += 1
        entry.seq = self._seq
        entry.queue = _MAIN
        entry.freq = 0
        self._small -= 1
        self._main += 1
        self._queue[entry.block.block_id] = None

    def _scan_small(self) -> int | None:
        """S's victim: its first cold candidate, after promoting the hit blocks ahead of it
        (all of them when there is none); None when S has no cold candidate."""
        entries, threshold = self._entries, self.move_to_main
        cold = self._cold
        victim = None
        while cold:
            seq, block_id = cold[0]
            entry = entries.get(block_id)
            if (entry is not None and entry.queue == _SMALL and entry.seq == seq
                    and entry.cand and entry.freq < threshold):
                victim = entry
                break
            heapq.heappop(cold)
        limit = victim.seq if victim is not None else math.inf
        hot = self._hot
        while hot and hot[0][0] < limit:
            seq, block_id = heapq.heappop(hot)
            entry = entries.get(block_id)
            if entry is not None and entry.queue == _SMALL and entry.seq == seq:
                self._to_main(entry)
        return None if victim is None else victim.block.block_id

    def _top_aside(self, heap: list[tuple[int, int]], ready: bool) -> _Entry | None:
        """The oldest live set-aside M block of ``heap``: a candidate at 0 (``ready``), or
        one hit since it was set aside."""
        entries = self._entries
        while heap:
            seq, block_id = heap[0]
            entry = entries.get(block_id)
            if (entry is not None and entry.parked and entry.seq == seq
                    and (entry.cand and entry.freq == 0 if ready else entry.freq > 0)):
                return entry
            heapq.heappop(heap)
        return None

    def _scan_main(self) -> int | None:
        """M's victim: its first candidate at 0, reinserting blocks with a count on the way;
        None when M holds no candidate."""
        queue, entries = self._queue, self._entries
        while True:
            ready = self._top_aside(self._ready, True)
            again = self._top_aside(self._again, False)
            if ready is not None or again is not None:  # set aside: before M's tail
                if again is None or (ready is not None and ready.seq < again.seq):
                    return ready.block.block_id
                heapq.heappop(self._again)
                again.parked = False
                again.freq -= 1
                self._seq += 1
                again.seq = self._seq
                queue[again.block.block_id] = None
                continue
            if not queue:
                return None
            block_id = next(iter(queue))
            entry = entries[block_id]
            if entry.freq:  # 2-bit CLOCK: reinsert at the head, one count less
                entry.freq -= 1
                self._seq += 1
                entry.seq = self._seq
                queue.move_to_end(block_id)
            elif entry.cand:
                return block_id
            else:  # the paper would evict it; it is in use or has children: set it aside
                del queue[block_id]
                entry.parked = True

    def _choose(self) -> int | None:
        if self._small >= self._small_limit:
            chosen = self._scan_small()
            return chosen if chosen is not None else self._scan_main()
        chosen = self._scan_main()
        if chosen is None:
            chosen = self._scan_small()
            if chosen is None:  # S's hit candidates were promoted: M has them now
                chosen = self._scan_main()
        return chosen

    def victim(self, now: float) -> int | None:
        chosen = self._chosen
        if chosen is None:
            chosen = self._chosen = self._choose()
        return chosen

    def pop_victim(self, now: float) -> int | None:
        chosen = self._chosen
        if chosen is not None:
            self._chosen = None
        elif self._small >= self._small_limit:  # _choose, its usual case inlined
            chosen = self._scan_small()
            if chosen is None:
                chosen = self._scan_main()
                if chosen is None:
                    return None
        else:
            chosen = self._choose()
            if chosen is None:
                return None
        entry = self._entries.pop(chosen)  # _evicted, inlined: once per eviction
        if entry.cand:
            self._num_candidates -= 1
        self._resident -= 1
        if entry.queue == _SMALL:
            self._small -= 1
            ghost = self._ghost
            ghost[entry.block.block_hash] = None
            while len(ghost) > self._ghost_limit:
                ghost.popitem(last=False)
        else:
            self._main -= 1
            if not entry.parked:
                del self._queue[chosen]
        return chosen

    def __len__(self) -> int:
        return self._num_candidates

    def __repr__(self) -> str:
        return (f"S3FIFO(small_ratio={self.small_ratio}, ghost_ratio={self.ghost_ratio}, "
                f"move_to_main={self.move_to_main}, capacity={self.capacity})")
