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

    __slots__ = ("items", "key", "late", "log_c", "model", "n", "newest", "price",
                 "priced_access", "priced_stamp", "shared")

    def __init__(self, key: tuple, model: ReuseModel | None, log_c: float) -> None:
        self.key = key
        self.model = model
        self.log_c = log_c
        self.shared = model is None
        self.items: deque[tuple] = deque()  # ascending ticks (dead entries included)
        self.late: list[tuple] = []  # heap of the entries added between the deque's ends
        self.newest = -1  # tick of the deque's last entry
        self.n = 0  # live entries
        # private queue: the last head price computed (``price``), for a head last accessed
        # at ``priced_access``, valid while the index's stamp is ``priced_stamp``
        self.price = 0.0
        self.priced_access = math.nan
        self.priced_stamp = -1


class PriceIndex:
    """Candidates by price class, and the cheapest of them at a clock time."""

    def __init__(self, shared_log_p: SharedPricer, model_of: ModelOf) -> None:
        self.shared_log_p = shared_log_p
        self.model_of = model_of
        #: price evaluations so far (one per queue head priced)
        self.evaluations = 0
        #: every queue made so far by key (an emptied one is kept for its key's next block)
        self.queues: dict[tuple, RecencyQueue] = {}
        #: the queues holding at least one candidate (what a new clock time reprices)
        self.active: dict[RecencyQueue, None] = {}
        self.live: dict[int, tuple] = {}
        self._seq = 0
        # head-price cache for one clock time and learner version
        self._hc: list[tuple] = []
        self._hc_now: float | None = None
        self._hc_version = -1
        self._stamp = 0  # moves on with every rebuild of the head-price heap
        self._dead_top = False  # the heap's top is the price of the entry popped last
        self._dirty: set[RecencyQueue] = set()

    def __len__(self) -> int:
        return len(self.live)

    @property
    def nonempty(self) -> int:
        """Queues holding at least one candidate."""
        return len(self.active)

    def entry(self, block_id: int) -> tuple | None:
        """The live entry of ``block_id``, or None."""
        return self.live.get(block_id)

    # -- membership ------------------------------------------------------------------------

    def add(self, block: BlockInfo, key: tuple, log_c: float) -> None:
        """Index candidate ``block`` under ``key`` (a new queue's model from ``model_of``)."""
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = RecencyQueue(key, self.model_of(key), log_c)
        block_id = block.block_id
        live = self.live
        self._seq = seq = self._seq + 1
        tick = block.last_access_tick
        entry = (tick, seq, block_id, block, q)
        if live.setdefault(block_id, entry) is not entry:  # defensive: a repeated
            self.remove(block_id)  # on_candidate replaces the old entry
            live[block_id] = entry
        n = q.n = q.n + 1
        items = q.items
        if n == 1:  # an empty queue (an emptied one keeps no dead entries): the head
            self.active[q] = None
            items.append(entry)
            q.newest = tick
            self._dirty.add(q)
            return
        if items and tick < items[0][0]:  # older than the deque: the front
            items.appendleft(entry)
            if not q.late:  # older than every entry: the new head (the usual case: the
                self._dirty.add(q)  # parent of a victim)
                return
        elif not items or tick > q.newest:  # the newest: to the back
            items.append(entry)
            q.newest = tick
            first = items[0]
            if first is not entry and live.get(first[2]) is first:
                return  # a live entry ahead of it: not the head
        else:
            heapq.heappush(q.late, entry)
        if self._head(q) is entry:  # the new head (the queue's price changes)
            self._dirty.add(q)
        if len(items) + len(q.late) > 2 * n + 64:
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
        entry = self.live.get(block_id)
        if entry is not None:
            self._unlink(entry)

    def _unlink(self, entry: tuple) -> None:
        """Forget the live ``entry``: it leaves its queue's head at once (the queue is
        repriced at the next victim), or stays in place, dead, until it reaches the head."""
        q = entry[4]
        items = q.items
        if items and items[0] is entry and not q.late:  # the head (a victim, usually)
            items.popleft()
            self._dirty.add(q)
            head = True
        else:
            head = self._head(q) is entry
            if head:
                if items and items[0] is entry:
                    items.popleft()
                else:
                    heapq.heappop(q.late)
                self._dirty.add(q)
        del self.live[entry[2]]
        q.n -= 1
        if q.n == 0:
            if items:
                items.clear()
            if q.late:
                q.late.clear()
            del self.active[q]
        elif not head and len(items) + len(q.late) > 2 * q.n + 64:  # dead entries left
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
        entry = self.cheapest_entry(now, version)
        return None if entry is None else entry[2]

    def cheapest_entry(self, now: float, version: int, pop: bool = False) -> tuple | None:
        """The live entry of the cheapest candidate at ``now`` (prices of learner
        ``version``), or None; with ``pop`` it is forgotten, as by `remove`.

        The top of the head-price heap of ``(log price, tick, seq, entry)``, once the heap is
        up to date: at a new clock time or learner version every non-empty queue's head is
        priced again; otherwise only the queues whose head changed (after an eviction, the
        victim's). Private heads are priced inline (`entry_log_price` without a call); a
        private queue's price depends on its head only through the head's last access
        time, so a head last accessed when the one priced before it was (the next block of
        a chain released at one instant: usually the parent of the victim) takes that
        price as it is, until the next rebuild.

        A popped entry's price, now dead, stays at the top of the heap. With one queue to
        reprice, its head's price, when it sorts after that dead top, replaces it (the dead
        top would be popped first anyway: the same contents), in place when it stays below
        the top's children (the usual case: the victim's parent, or the next block of its
        queue), else by one ``heapreplace``."""
        live = self.live
        if not live:
            return None
        hc = self._hc
        dirty = self._dirty
        replace_dead_top = False
        rebuild = (now != self._hc_now or version != self._hc_version
                   or len(hc) > 4 * len(self.active) + 64)
        queues: Iterable[RecencyQueue]
        if rebuild:
            hc.clear()
            dirty.clear()
            self._stamp += 1
            self._hc_now, self._hc_version = now, version
            queues = self.active
        else:
            queues = dirty
            replace_dead_top = self._dead_top and len(dirty) == 1
        self._dead_top = False
        top = None  # the live entry whose price went to the top in place, if any
        if queues:
            stamp = self._stamp
            n = 0
            for q in queues:
                items = q.items
                entry = items[0] if items else None
                if entry is None or q.late or live.get(entry[2]) is not entry:
                    if not q.n:
                        continue
                    entry = self._head(q)
                    if entry is None:
                        continue
                n += 1
                if q.shared:
                    log_price = q.log_c + self.shared_log_p(entry[3], now)
                else:
                    accessed = entry[3].last_access
                    if accessed == q.priced_access and q.priced_stamp == stamp:
                        log_price = q.price
                    else:
                        m = q.model
                        z = (now - accessed) * m.r - m.L
                        sp = (z if z > 35.0 else math.exp(z) if z < -35.0 else
                              math.log1p(math.exp(z)))
                        log_price = q.price = q.log_c + m.log_hf - sp
                        q.priced_access, q.priced_stamp = accessed, stamp
                item = (log_price, entry[0], entry[1], entry)
                if rebuild:
                    hc.append(item)  # made a heap below
                elif replace_dead_top and hc[0] < item:
                    size = len(hc)
                    if (size < 2 or item < hc[1]) and (size < 3 or item < hc[2]):
                        hc[0] = item
                        top = entry
                    else:
                        heapq.heapreplace(hc, item)
                else:
                    heapq.heappush(hc, item)
            if rebuild:
                heapq.heapify(hc)
            self.evaluations += n
            dirty.clear()
        if top is None:
            while hc:
                top = hc[0][3]
                if live.get(top[2]) is top:
                    break
                heapq.heappop(hc)
            else:
                self._hc_now = None  # cannot happen while candidates exist: rebuild next
                return None
        if pop:
            self._unlink(top)
            self._dead_top = True  # its price is the top, until the next call
        return top

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
