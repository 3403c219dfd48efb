"""The market's candidate index: recency queues keyed by price class, and a cache of their
head prices for the current clock time.

Candidates live in one recency queue (ordered by ``last_access_tick``) per key
``(class, turn bucket, cost bucket)``; shared blocks go to queues keyed by ``(class, sharer
bucket, cost bucket)``. Within a private queue every block has the same `ReuseModel` and
(quantized) cost, and ``q`` decreases with idle time, so the head is exactly the cheapest; the
victim is the cheapest head. Within a shared queue the order by most recent use is an
approximation (the union depends on all sharers' times); its heads are priced by a callback.

Head prices are cached for one clock time and learner version: a run of victims at one
instant costs O(log Q) each, a new instant O(Q) once, with Q the number of non-empty
queues, never O(n).

Entries are tuples ``(tick, seq, block_id, block, queue)``; an entry is live while
``live[block_id]`` is that very tuple (lazy deletion: removed entries stay in a queue until
they reach its head, and a queue is rebuilt when more than half of it is dead). A queue is a
deque in tick order, as LRU's: a released block (the newest tick) goes to its back, the parent
of an evicted block (older than the head) to its front, both O(1) (a heap's pop is O(log n)
tuple comparisons); the rare other one goes to a small heap beside it, and the head is the
older of the two heads.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvevict.policies.market.price import ReuseModel
from kvevict.types import BlockInfo

__all__ = ["PriceIndex", "RecencyQueue"]

#: ``shared_log_p(block, now)``: log reuse probability of a shared block (the sharer union).
SharedPricer = Callable[[BlockInfo, float], float]
#: ``model_of(key)``: the `ReuseModel` of a new queue's key, None for a shared queue.
ModelOf = Callable[[tuple], "ReuseModel | None"]


class RecencyQueue:
    """One queue of candidates with one price model, in access-tick order: a deque
    (ascending ticks) and a heap of the entries that fit at neither end of it.

    ``model`` is None for a shared queue (priced per block by the sharer union).
    """

    __slots__ = ("items", "key", "late", "log_c", "model", "n", "newest", "shared")

    def __init__(self, key: tuple, model: ReuseModel | None, log_c: float) -> None:
        self.key = key
        self.model = model
        self.log_c = log_c
        self.shared = model is None
        self.items: deque[tuple] = deque()  # ascending ticks (dead entries included)
        self.late: list[tuple] = []  # heap of the entries added between the deque's ends
        self.newest = -1  # tick of the deque's last entry
        self.n = 0  # live entries


class PriceIndex:
    """Candidates by price class, and the cheapest of them at a clock time."""

    def __init__(self, shared_log_p: SharedPricer, model_of: ModelOf) -> None:
        self.shared_log_p = shared_log_p
        self.model_of = model_of
        #: price evaluations so far (one per queue head priced)
        self.evaluations = 0
        #: every queue made so far by key (an emptied one is kept for its key's next block)
        self.queues: dict[tuple, RecencyQueue] = {}
        #: queues holding at least one candidate
        self.nonempty = 0
        self.live: dict[int, tuple] = {}
        self._seq = 0
        # head-price cache for one clock time and learner version
        self._hc: list[tuple] = []
        self._hc_now: float | None = None
        self._hc_version = -1
        self._dirty: set[RecencyQueue] = set()

    def __len__(self) -> int:
        return len(self.live)

    def entry(self, block_id: int) -> tuple | None:
        """The live entry of ``block_id``, or None."""
        return self.live.get(block_id)

    # -- membership ------------------------------------------------------------------------

    def add(self, block: BlockInfo, key: tuple, log_c: float) -> None:
        """Index candidate ``block`` under ``key`` (a new queue's model from ``model_of``)."""
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = RecencyQueue(key, self.model_of(key), log_c)
        self._seq += 1
        block_id = block.block_id
        tick = block.last_access_tick
        entry = (tick, self._seq, block_id, block, q)
        live = self.live
        if block_id in live:  # defensive: a repeated on_candidate replaces the old entry
            self.remove(block_id)
        live[block_id] = entry
        q.n += 1
        if q.n == 1:
            self.nonempty += 1
        items = q.items
        if not items or tick > q.newest:  # the newest: to the back
            items.append(entry)
            q.newest = tick
            first = items[0]
            if first is not entry and live.get(first[2]) is first:
                return  # a live entry ahead of it: not the head (the usual case)
        elif tick < items[0][0] and not q.late:  # older than all: the front, the head
            items.appendleft(entry)
            self._dirty.add(q)
            return
        elif tick < items[0][0]:
            items.appendleft(entry)
        else:
            heapq.heappush(q.late, entry)
        if self._head(q) is entry:  # the new head (the queue's price changes)
            self._dirty.add(q)
        if len(items) + len(q.late) > 2 * q.n + 64:
            self._compact(q)

    def _compact(self, q: RecencyQueue) -> None:
        """Rebuild ``q`` from its live entries, all in the deque."""
        live = self.live
        entries = [e for e in q.items if live.get(e[2]) is e]
        entries.extend(e for e in q.late if live.get(e[2]) is e)
        entries.sort(key=lambda e: e[0])  # distinct ticks
        q.items = deque(entries)
        q.late = []
        q.newest = entries[-1][0] if entries else -1

    def remove(self, block_id: int) -> None:
        """Forget ``block_id`` (no-op if it is not indexed)."""
        live = self.live
        entry = live.get(block_id)
        if entry is None:
            return
        q = entry[4]
        items = q.items
        if items and items[0] is entry and not q.late:  # the head (a victim, usually)
            items.popleft()
            self._dirty.add(q)
        elif self._head(q) is entry:
            if items and items[0] is entry:
                items.popleft()
            else:
                heapq.heappop(q.late)
            self._dirty.add(q)
        del live[block_id]
        q.n -= 1
        if q.n == 0:
            items.clear()
            q.late.clear()
            self.nonempty -= 1
        elif len(items) + len(q.late) > 2 * q.n + 64:
            self._compact(q)

    # -- prices ----------------------------------------------------------------------------

    def entry_log_price(self, entry: tuple, now: float) -> float:
        """log price of an indexed entry at ``now``."""
        self.evaluations += 1
        q = entry[4]
        block = entry[3]
        if q.shared:
            return q.log_c + self.shared_log_p(block, now)
        m = q.model
        z = (now - block.last_access) * m.r - m.L
        if z > 35.0:
            sp = z
        elif z < -35.0:
            sp = math.exp(z)
        else:
            sp = math.log1p(math.exp(z))
        return q.log_c + m.log_hf - sp

    # -- victim ----------------------------------------------------------------------------

    def _head(self, q: RecencyQueue) -> tuple | None:
        """The live entry of ``q`` with the oldest tick (dropping dead ones ahead of it)."""
        items, late, live = q.items, q.late, self.live
        first = None
        while items:
            first = items[0]
            if live.get(first[2]) is first:
                break
            items.popleft()
            first = None
        while late:
            top = late[0]
            if live.get(top[2]) is top:
                if first is None or top[0] < first[0]:
                    return top
                break
            heapq.heappop(late)
        return first

    def cheapest_id(self, now: float, version: int) -> int | None:
        """The block id of the cheapest candidate at ``now`` (prices of learner ``version``)."""
        live = self.live
        if not live:
            return None
        hc = self._hc
        if (now != self._hc_now or version != self._hc_version
                or len(hc) > 4 * self.nonempty + 64):
            hc.clear()
            self._dirty.clear()
            self._price_heads(self.queues.values(), now)
            self._hc_now, self._hc_version = now, version
        elif self._dirty:  # the common case after an eviction: reprice the changed heads
            self._price_heads(self._dirty, now, replace_dead_top=len(self._dirty) == 1)
            self._dirty.clear()
        while hc:
            entry = hc[0][3]
            if live.get(entry[2]) is entry:
                return entry[2]
            heapq.heappop(hc)
        self._hc_now = None  # cannot happen while candidates exist; rebuild next time
        return None

    def pop_cheapest(self, now: float, version: int) -> int | None:
        """`cheapest_id`, then forgotten as by `remove` (its head price, now dead, stays at
        the top of the head-price heap until the next call replaces it)."""
        block_id = self.cheapest_id(now, version)
        if block_id is not None:
            self.remove(block_id)
        return block_id

    def _price_heads(self, queues: Iterable[RecencyQueue], now: float,
                     replace_dead_top: bool = False) -> None:
        """Push ``(log price, tick, seq, entry)`` of the head of each of ``queues`` into the
        head-price heap (the private ones priced inline: `entry_log_price` without a call).

        With ``replace_dead_top`` (one queue to reprice), an entry that sorts after a dead top
        replaces it with one ``heapreplace``: `cheapest_id` would pop that top first, so the
        heap ends up with the same contents."""
        live = self.live
        hc = self._hc
        put = heapq.heappush
        exp, log1p = math.exp, math.log1p
        n = 0
        head = self._head
        for q in queues:
            items = q.items
            entry = items[0] if items else None
            if entry is None or q.late or live.get(entry[2]) is not entry:
                if not q.n:
                    continue
                entry = head(q)
                if entry is None:
                    continue
            n += 1
            if q.shared:
                log_price = q.log_c + self.shared_log_p(entry[3], now)
            else:
                m = q.model
                z = (now - entry[3].last_access) * m.r - m.L
                sp = z if z > 35.0 else exp(z) if z < -35.0 else log1p(exp(z))
                log_price = q.log_c + m.log_hf - sp
            item = (log_price, entry[0], entry[1], entry)
            top = hc[0] if replace_dead_top and hc else None
            if top is not None and top < item and live.get(top[3][2]) is not top[3]:
                heapq.heapreplace(hc, item)
            else:
                put(hc, item)
        self.evaluations += n

    def _sorted_entries(self, q: RecencyQueue) -> Iterator[tuple]:
        """The live entries of ``q`` in queue order, lazily (the deque merged with a walk of
        the heap)."""
        live = self.live

        def in_deque() -> Iterator[tuple]:
            for entry in list(q.items):
                if live.get(entry[2]) is entry:
                    yield entry

        def in_heap() -> Iterator[tuple]:
            heap = q.late
            if not heap:
                return
            frontier = [(heap[0], 0)]
            size = len(heap)
            while frontier:
                entry, i = heapq.heappop(frontier)
                if live.get(entry[2]) is entry:
                    yield entry
                for child in (2 * i + 1, 2 * i + 2):
                    if child < size:
                        heapq.heappush(frontier, (heap[child], child))

        return heapq.merge(in_deque(), in_heap(), key=lambda e: e[0])

    def cheapest(self, k: int, now: float) -> list[tuple[float, tuple]]:
        """``(log price, entry)`` of the ``k`` candidates `cheapest_id` would give next, in
        order: a k-way merge over the queues, O(Q + k log Q) price evaluations."""
        merge: list[tuple[Any, ...]] = []
        price = self.entry_log_price
        for q in self.queues.values():
            walk = self._sorted_entries(q)
            entry = next(walk, None)
            if entry is not None:
                merge.append((price(entry, now), entry[0], entry[1], entry, walk))
        heapq.heapify(merge)
        out: list[tuple[float, tuple]] = []
        while merge and len(out) < k:
            log_price, _, _, entry, walk = heapq.heappop(merge)
            out.append((log_price, entry))
            nxt = next(walk, None)
            if nxt is not None:
                heapq.heappush(merge, (price(nxt, now), nxt[0], nxt[1], nxt, walk))
        return out
