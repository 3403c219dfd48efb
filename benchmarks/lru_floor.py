"""The floor: kvevict's hash-mode LRU semantics in the leanest pure Python, with no API around it.

`bench_manager.py` replays its stream through this as a third implementation, to measure how
much of kvevict-LRU's cost over the vLLM baseline is the work kvevict's semantics require and
how much is the manager's structure (argument checks, `Sequence` objects, the policy protocol,
chunked prefill, pins, listeners, admission, statistics by name).

Kept, per block, exactly as `KVCacheManager` with the built-in `LRU` does it:

- the hit: a prefix lookup that checks the ids are prefix-chained, a reference in the pool's
  ref counts and in the block record, the access stamp (clock time and event tick), the hit
  count, the hitting session and the sharer record (`kvevict.types.note_sharer`);
- a `BlockInfo` record created for every cached block, and a candidate set of the cached,
  unused leaves beside the built-in `LRU` policy's own queue and late heap, driven as the
  manager's inlined LRU loop drives them (tail of the oldest released chain first);
- eviction of leaves only: a parent left without cached children becomes a candidate, at the
  queue's front when it is older than the queue's head;
- release stamps every cached block; evictions are counted by workload class.

Left out: everything `KVCacheManager` does per request rather than per block, and the general
paths this stream never takes (token ids and hashing, chunked prefill, preemption, pins,
admission, other policies). On the benchmark stream it finds the same hits and evicts the same
blocks as kvevict-LRU (checked by ``test_same_hits``).
"""

from __future__ import annotations

from typing import Any

from kvevict.policies.lru import LRU
from kvevict.types import BlockInfo, ManualClock, note_sharer

__all__ = ["LRUFloor"]


class _Seq:
    __slots__ = ("num_tokens", "table")

    def __init__(self, table: list[int], num_tokens: int) -> None:
        self.table = table
        self.num_tokens = num_tokens


class LRUFloor:
    """Hash-mode prefix caching with kvevict's LRU semantics, driven like the vLLM baseline."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.used = [False] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.records: list[BlockInfo | None] = [None] * num_blocks  # cached blocks
        self.cached: dict[Any, BlockInfo] = {}  # block hash -> record
        self.candidates: dict[int, BlockInfo] = {}  # cached, ref 0, leaf
        self.lru = LRU()  # the candidates' order
        self.tick = 0
        self.num_evictable = 0
        self.seqs: dict[Any, _Seq] = {}
        self.clock = ManualClock()  # set ``clock.now``, as for the manager
        self.evictions = 0
        self.evictions_by_class: dict[str, int] = {}
        self.block_queries = self.block_hits = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_queries

    @property
    def hit_ratio(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries

    def begin(self, request: Any) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        cached = self.cached
        hit: list[BlockInfo] = []
        hit_free = 0
        parent: Any = 0
        for h in hashes:
            block = cached.get(h)
            if block is None:
                break
            if block._parent != parent or block._depth != len(hit):
                raise ValueError(f"block id {h!r} is not prefix-chained")
            if not block._ref_count:
                hit_free += 1
            hit.append(block)
            parent = h
        num_hit = len(hit)
        rest = hashes[num_hit + 1:]
        if rest and not cached.keys().isdisjoint(rest):
            raise ValueError("block ids are not prefix-chained")
        prompt = request.num_tokens
        slots = max(prompt, len(hashes) * bs)
        need = -(-slots // bs) - num_hit
        free = self.free
        if need > len(free) + self.num_evictable - hit_free:
            raise MemoryError(f"request {request.request_id!r} needs {need} blocks")
        now = self.clock.now
        session = request.session_id
        ref = self.ref
        candidates = self.candidates
        tick = self.tick
        for block in hit:  # acquire: hits stop being evictable
            if not block._ref_count:
                self.num_evictable -= 1
                if block._id in candidates:
                    del candidates[block._id]
                    self.lru.on_uncandidate(block, now)
            block._ref_count += 1
            ref[block._id] += 1
        if need > len(free):
            self._evict(need - len(free))
        for block in hit:  # touch
            tick += 1
            block._last_access = now
            block._last_access_tick = tick
            block._hit_count += 1
            block._last_hit_session = session
            if block._sharer != session:
                note_sharer(block, session, now)
            block._shared = now
        table = [block._id for block in hit]
        used = self.used
        for _ in range(need):
            block_id = free.pop()
            used[block_id] = True
            ref[block_id] = 1
            table.append(block_id)
        records = self.records
        cls, retention, kinds = request.workload_class, request.retention, request.block_kinds
        for depth in range(num_hit, len(hashes)):  # cache the prompt's listed blocks
            h = hashes[depth]
            tick += 1
            kind = kinds[depth] if kinds is not None and depth < len(kinds) else "prompt"
            block_id = table[depth]
            block = BlockInfo(block_id, h, parent, depth, None, 0, cls, session, now, tick,
                              retention, "prefill", kind)
            block._ref_count = 1
            if depth:
                cached[parent]._num_children += 1
            cached[h] = block
            records[block_id] = block
            parent = h
        self.tick = tick
        self.seqs[request.request_id] = _Seq(table, slots)
        self.block_queries += len(hashes)
        self.block_hits += num_hit
        self.prefix_cache_queries += prompt
        self.prefix_cache_hits += min(num_hit * bs, prompt)

    def _evict(self, count: int) -> None:
        """The manager's `_evict_lru`: the queue's head, or the policy's choice while its heap
        of late candidates is not empty."""
        now = self.clock.now
        candidates, cached, records = self.candidates, self.cached, self.records
        used, free = self.used, self.free
        by_class = self.evictions_by_class
        lru = self.lru
        late, pop_oldest, on_candidate = lru._late, lru._queue.popitem, lru.on_candidate
        for _ in range(count):
            if late:  # the heap may hold the oldest: let the policy choose
                victim_id = lru.victim(now)
                block = candidates.pop(victim_id)
                lru.on_evict(block, now)
            else:
                victim_id = pop_oldest(False)[0]
                block = candidates.pop(victim_id)
            del cached[block._hash]
            records[victim_id] = None
            used[victim_id] = False
            free.append(victim_id)
            cls = block._workload_class
            by_class[cls] = by_class.get(cls, 0) + 1
            if block._depth:  # the parent may have become a leaf, hence a candidate
                parent = cached[block._parent]
                parent._num_children -= 1
                if not parent._num_children and not parent._ref_count:
                    candidates[parent._id] = parent
                    on_candidate(parent, now)
        self.evictions += count
        self.num_evictable -= count

    def append(self, request_id: Any, num_tokens: int) -> None:
        seq = self.seqs[request_id]
        target = seq.num_tokens + num_tokens
        need = -(-target // self.block_size) - len(seq.table)
        if need > 0:
            free = self.free
            if need > len(free) + self.num_evictable:
                raise MemoryError(f"request {request_id!r} needs {need} more blocks")
            if need > len(free):
                self._evict(need - len(free))
            used, ref, table = self.used, self.ref, seq.table
            for _ in range(need):
                block_id = free.pop()
                used[block_id] = True
                ref[block_id] = 1
                table.append(block_id)
        seq.num_tokens = target

    def finish(self, request_id: Any) -> None:
        seq = self.seqs.pop(request_id)
        now = self.clock.now
        records, ref, used, free = self.records, self.ref, self.used, self.free
        candidates = self.candidates
        tick = self.tick
        for block_id in reversed(seq.table):  # tail first
            ref[block_id] -= 1
            block = records[block_id]
            if block is None:  # a partial or decode block: free it
                used[block_id] = False
                free.append(block_id)
                continue
            count = block._ref_count - 1
            block._ref_count = count
            tick += 1
            block._last_access = now
            block._last_access_tick = tick
            if not count:
                self.num_evictable += 1
                if not block._num_children:
                    candidates[block_id] = block
                    self.tick = tick
                    self.lru.on_candidate(block, now)
        self.tick = tick
