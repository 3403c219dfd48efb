"""A minimal vLLM-v1-style prefix-caching block manager: the baseline for the manager benchmark.

The design of vLLM's ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``,
``FreeKVCacheBlockQueue``) and ``vllm/v1/core/block_pool.py`` (``BlockPool``), cut to what a
metadata-only, single-group manager needs:

- every block is a slotted object carrying its ref count, its cached hash (or None) and the two
  links of an intrusive doubly linked list;
- the **free queue** holds every block with ref count 0, cached or not, in eviction order:
  ``popleft``, ``append`` and ``remove`` (of a block in the middle) are O(1) and allocate no
  Python objects (fake head and tail sentinels, no branches on empty ends); ``appendleft`` too;
- ``cached_block_hash_to_block`` maps a block hash to its block;
- **begin**: look up the prompt's hashes until the first miss, ``touch`` the hits (ref + 1,
  out of the free queue if they were free), allocate the rest from the queue front (a popped
  block that still has a hash is evicted from the map), cache the prompt's listed blocks;
- **finish**: release the blocks in reverse order (tail first); those whose ref count drops to 0
  go to the queue tail if cached, so the tail of the least recently used chain is evicted first,
  and to the queue front if uncached (they hold nothing, so they are reused before any cached
  block is evicted; vLLM's ``BlockPool.free_blocks`` splits them this way since PR #42656,
  ``prepend_n`` / ``append_n``).

Semantics match kvevict's hash mode (each listed id is one cacheable block; prompt blocks are
cached at begin; decode blocks are not cached). Unlike kvevict, vLLM may evict an inner block of
a chain whose children are still cached (they become unreachable); so hit counts agree closely
but not exactly.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

__all__ = ["FreeKVCacheBlockQueue", "KVCacheBlock", "VllmLRUBlockManager"]


class KVCacheBlock:
    """One physical block: ref count, cached hash, and its links in the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Any = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks; front = next to reuse. All operations O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head = KVCacheBlock(-1)  # fake sentinels: no None checks on the hot path
        self.tail = KVCacheBlock(-1)
        chain = [self.head, *blocks, self.tail]
        for prev, nxt in pairwise(chain):
            prev.next_free = nxt
            nxt.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks")
        nxt = block.next_free
        self.head.next_free = nxt
        nxt.prev_free = self.head
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def appendleft(self, block: KVCacheBlock) -> None:
        head = self.head
        first = head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = head
        head.next_free = block
        self.num_free_blocks += 1

    def append(self, block: KVCacheBlock) -> None:
        tail = self.tail
        last = tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = tail
        tail.prev_free = block
        self.num_free_blocks += 1

    def __len__(self) -> int:
        return self.num_free_blocks


class VllmLRUBlockManager:
    """Prefix caching with vLLM's LRU free queue, driven like `kvevict.KVCacheManager`.

    Takes the same `kvevict.Request` objects (``block_hashes`` + ``num_tokens``) and offers
    ``begin`` / ``append`` / ``finish`` with the same meaning and the same hit counters.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[Any, KVCacheBlock] = {}
        self.req_to_blocks: dict[Any, list[KVCacheBlock]] = {}
        self.req_num_tokens: dict[Any, int] = {}
        self.block_queries = 0
        self.block_hits = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.evictions = 0

    @property
    def hit_ratio(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_queries

    def _get_new_block(self) -> KVCacheBlock:
        block = self.free_block_queue.popleft()
        block_hash = block.block_hash
        if block_hash is not None:  # evict its cached content
            if self.cached_block_hash_to_block.get(block_hash) is block:
                del self.cached_block_hash_to_block[block_hash]
            block.block_hash = None
            self.evictions += 1
        block.ref_cnt = 1
        return block

    def begin(self, request: Any) -> list[KVCacheBlock]:
        hashes = request.block_hashes
        num_tokens = request.num_tokens
        cached = self.cached_block_hash_to_block
        computed: list[KVCacheBlock] = []
        for block_hash in hashes:  # longest cached prefix: stop at the first miss
            block = cached.get(block_hash)
            if block is None:
                break
            computed.append(block)
        num_hit = len(computed)
        need = -(-num_tokens // self.block_size) - num_hit
        queue = self.free_block_queue
        hit_free = 0
        for block in computed:
            if block.ref_cnt == 0:
                hit_free += 1
        if need > queue.num_free_blocks - hit_free:
            raise ValueError(f"request {request.request_id!r} needs {need} blocks, "
                             f"{queue.num_free_blocks - hit_free} can be freed")
        for block in computed:  # touch: hits leave the free queue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1
        get_new_block = self._get_new_block
        blocks = computed
        for _ in range(need):
            blocks.append(get_new_block())
        for i in range(num_hit, len(hashes)):  # cache the prompt's full blocks
            block = blocks[i]
            block.block_hash = block_hash = hashes[i]
            cached[block_hash] = block  # replaces an unreachable orphan with the same hash
        self.req_to_blocks[request.request_id] = blocks
        self.req_num_tokens[request.request_id] = num_tokens
        self.block_queries += len(hashes)
        self.block_hits += num_hit
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += min(num_hit * self.block_size, num_tokens)
        return blocks

    def append(self, request_id: Any, num_tokens: int) -> None:
        blocks = self.req_to_blocks[request_id]
        total = self.req_num_tokens[request_id] + num_tokens
        self.req_num_tokens[request_id] = total
        need = -(-total // self.block_size) - len(blocks)
        if need > self.free_block_queue.num_free_blocks:
            raise ValueError(f"request {request_id!r} needs {need} more blocks")
        for _ in range(need):
            blocks.append(self._get_new_block())

    def finish(self, request_id: Any) -> None:
        del self.req_num_tokens[request_id]
        queue = self.free_block_queue
        append, appendleft = queue.append, queue.appendleft
        for block in reversed(self.req_to_blocks.pop(request_id)):  # tail first
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    appendleft(block)  # holds nothing: reuse it first
                else:
                    append(block)

    def check(self) -> None:
        """Ref counts match the running requests; the queue holds exactly the ref-0 blocks."""
        refs = [0] * len(self.blocks)
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                refs[block.block_id] += 1
        queued = []
        block = self.free_block_queue.head.next_free
        while block is not self.free_block_queue.tail:
            queued.append(block.block_id)
            block = block.next_free
        if len(queued) != self.free_block_queue.num_free_blocks:
            raise AssertionError("free queue length != num_free_blocks")
        if sorted(queued) != [b.block_id for b in self.blocks if b.ref_cnt == 0]:
            raise AssertionError("free queue != blocks with ref count 0")
        for block in self.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref {block.ref_cnt} != "
                                     f"{refs[block.block_id]}")
        for block_hash, block in self.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cached block {block.block_id} lost its hash")
