"""Every invariant of a `KVCacheManager`, checked from the outside through public views.

`check_manager` (what `KVCacheManager.check` runs) rebuilds what the pool, the prefix tree,
the pins and the policy must hold from the live sequences and the block records, and raises
`InvariantError` naming the first difference:

- the pool: ``free + used == total``, no block free twice, free blocks unused and
  unreferenced, every block's ref count equal to its running users, no leaked block;
- the sequences: one block per ``block_size`` token slots, no block listed twice, the cached
  head of each block table is the chain's cached blocks;
- the tree: one record per cached block, held blocks' record ref counts equal the pool's,
  prefix closure (every parent cached, and the record's parent is that block), child
  counts, the evictable count, and the candidate set = {cached, ref 0, leaf};
- pins: withheld blocks are pinned candidates, refused ones are candidates, and no pinned
  candidate was offered to the policy; a policy with ``__len__`` tracks exactly the offered
  candidates.

It runs in O(blocks) and is meant for tests and debugging, not for a hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from kvevict.errors import KVEvictError

if TYPE_CHECKING:
    from kvevict.manager import KVCacheManager

__all__ = ["InvariantError", "check_manager"]


class InvariantError(KVEvictError, AssertionError):
    """`KVCacheManager.check()` found the cache state inconsistent (a bug, never user error)."""


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def _check_pool(manager: KVCacheManager, refs: list[int]) -> None:
    pool = manager.pool
    free, ref, used = pool.free_ids(), pool.ref_counts(), pool.used_flags()
    if pool.num_free + pool.num_used != pool.num_blocks:
        _fail("free + used != total")
    if len(set(free)) != len(free):
        _fail("a block is on the free list twice")
    for b in free:
        if used[b] or ref[b]:
            _fail(f"free block {b} is marked used or referenced")
    if len(free) + sum(used) != pool.num_blocks:
        _fail("the free list and the used flags disagree")
    records = manager.records
    for b in range(pool.num_blocks):
        if ref[b] != refs[b]:
            _fail(f"block {b}: ref count {ref[b]} but {refs[b]} running users")
        if ref[b] < 0:
            _fail(f"block {b}: negative ref count")
        if used[b] and refs[b] == 0 and b not in records:
            _fail(f"block {b} is used but neither cached nor held (leaked)")
        if b in records and not used[b]:
            _fail(f"cached block {b} is on the free list")


def _check_sequences(manager: KVCacheManager) -> list[int]:
    """Each live sequence's table; return the running users of every block."""
    bs = manager.block_size
    refs = [0] * manager.pool.num_blocks
    records = manager.records
    for seq in manager.sequences.values():
        table, cached = seq.block_table, seq.cached_blocks
        if seq.status != "running":
            if table or cached:
                _fail(f"{seq.status} sequence {seq.seq_id!r} still holds blocks")
            continue
        expected = -(-seq.num_slots // bs)  # token eviction may have dropped some tokens
        if len(table) != expected:
            _fail(f"sequence {seq.seq_id!r} holds {len(table)} blocks for {seq.num_slots} "
                  "token slots")
        if seq.num_dropped and seq.cacheable:
            _fail(f"sequence {seq.seq_id!r} dropped tokens but is cacheable")
        if len(set(table)) != len(table):
            _fail(f"sequence {seq.seq_id!r} lists a block twice")
        if len(cached) > min(len(table), len(seq.hashes)):
            _fail(f"sequence {seq.seq_id!r} has more cached blocks than its table or chain")
        for depth, b in enumerate(table):
            refs[b] += 1
            if depth < len(cached):
                rec = records.get(b)
                if rec is None or rec is not cached[depth] or \
                        rec.block_hash != seq.hashes[depth]:
                    _fail(f"sequence {seq.seq_id!r} block {depth} is not its cached block")
            elif b in records:
                _fail(f"sequence {seq.seq_id!r} block {depth} is cached but not counted as "
                      "such")
    return refs


def _check_tree(manager: KVCacheManager, refs: list[int]) -> set[int]:
    """Records, prefix closure, child counts; return the expected candidates."""
    tree, records = manager.tree, manager.records
    if len(records) != len(tree):
        _fail("records and tree disagree on the cached blocks")
    children: dict[Any, int] = {}
    evictable = 0
    for block in tree:
        if records.get(block.block_id) is not block:
            _fail(f"cached block {block.block_id} has no record")
        if block.ref_count != refs[block.block_id]:
            _fail(f"block {block.block_id}: record ref {block.ref_count} != pool ref")
        if block.depth > 0:
            parent = tree.get(block.parent_hash)
            if parent is None:
                _fail(f"prefix closure: block {block.block_id}'s parent is not cached")
            if block.parent is not parent or parent.depth != block.depth - 1:
                _fail(f"block {block.block_id}: its parent record is not the cached parent")
            children[block.parent_hash] = children.get(block.parent_hash, 0) + 1
        elif block.parent is not None:
            _fail(f"block {block.block_id} at depth 0 has a parent record")
        if block.ref_count == 0:
            evictable += 1
    if evictable != tree.num_evictable:
        _fail(f"evictable count {tree.num_evictable} != {evictable}")
    expected = set()
    for block in tree:
        if block.num_children != children.get(block.block_hash, 0):
            _fail(f"block {block.block_id}: child count {block.num_children} is wrong")
        if block.ref_count == 0 and block.num_children == 0:
            expected.add(block.block_id)
    if set(tree.candidates) != expected:
        _fail("candidate set != {cached, ref 0, leaf}")
    return expected


def _check_pins(manager: KVCacheManager) -> None:
    pins, candidates, records = manager.pins, manager.tree.candidates, manager.records
    for block_id in pins.withheld:
        if block_id not in pins or block_id not in candidates:
            _fail(f"withheld block {block_id} is not a pinned candidate")
    for block_id in pins.refused:
        if block_id not in candidates:
            _fail(f"refused block {block_id} is not a candidate")
        if block_id in pins.withheld:
            _fail(f"block {block_id} is both withheld and refused")
    for block_id in pins:
        if block_id not in records:
            _fail(f"pinned block {block_id} is not cached")
        if block_id in candidates and block_id not in pins.withheld:
            _fail(f"pinned candidate {block_id} was offered to the policy")
    size = getattr(manager.policy, "__len__", None)
    if size is not None:
        offered = len(candidates) - len(pins.withheld) - len(pins.refused)
        if size() != offered:
            _fail(f"policy tracks {size()} candidates, expected {offered}")


def _check_tiers(manager: KVCacheManager) -> None:
    stack, tree = manager.tiers, manager.tree
    if stack is None:
        return
    index = {t.name: t.index for t in stack.tiers}
    total = 0
    for tier in stack.tiers:
        records, free = tier.records, tier.free_slots()
        name = tier.name
        if len(set(free)) != len(free) or any(s in records for s in free):
            _fail(f"tier {name!r}: a slot is free twice or both free and used")
        if len(records) + len(free) != tier.capacity_blocks:
            _fail(f"tier {name!r}: {len(records)} blocks + {len(free)} free slots != "
                  f"{tier.capacity_blocks}")
        if tier.held:
            _fail(f"tier {name!r}: blocks {sorted(tier.held)} are still held for a reload")
        children: dict[int, int] = {}
        for slot, block in records.items():
            if block.block_id != slot or block.tier != name:
                _fail(f"tier {name!r} slot {slot}: its record says block {block.block_id} "
                      f"in tier {block.tier!r}")
            if stack.get(block.block_hash) is not block:
                _fail(f"tier {name!r} slot {slot}: not the stack's block for its hash")
            if tree.get(block.block_hash) is not None:
                _fail(f"tier {name!r} slot {slot}: its hash is also cached in the pool")
            if block.ref_count:
                _fail(f"tier {name!r} slot {slot}: ref count {block.ref_count} below the pool")
            parent = block.parent
            if block.depth == 0:
                if parent is not None:
                    _fail(f"tier {name!r} slot {slot}: depth 0 with a parent record")
                continue
            if parent is None or parent.block_hash != block.parent_hash or \
                    parent.depth != block.depth - 1:
                _fail(f"tier {name!r} slot {slot}: its parent record is not its parent")
            if tree.get(block.parent_hash) is parent:
                continue
            if stack.get(block.parent_hash) is not parent:
                _fail(f"prefix closure: tier {name!r} slot {slot}'s parent is in no tier")
            if index[parent.tier] > tier.index:
                _fail(f"prefix closure: tier {name!r} slot {slot}'s parent is in the lower "
                      f"tier {parent.tier!r}")
            if parent.tier == name:
                children[parent.block_id] = children.get(parent.block_id, 0) + 1
            if block not in stack.children_below(block.parent_hash):
                _fail(f"tier {name!r} slot {slot}: missing from its parent's children")
        expected = set()
        for slot, block in records.items():
            if block.num_children != children.get(slot, 0):
                _fail(f"tier {name!r} slot {slot}: child count {block.num_children} != "
                      f"{children.get(slot, 0)}")
            if not block.num_children:
                expected.add(slot)
        if set(tier.candidates) != expected:
            _fail(f"tier {name!r}: candidate set != its leaves")
        size = getattr(tier.policy, "__len__", None)
        if size is not None and size() != len(expected):
            _fail(f"tier {name!r}: policy tracks {size()} candidates, expected "
                  f"{len(expected)}")
        total += len(records)
    if len(stack) != total:
        _fail(f"the tier stack indexes {len(stack)} blocks but its tiers hold {total}")
    for block in tree:
        if block.tier != "device":
            _fail(f"pool block {block.block_id} says it is in tier {block.tier!r}")


def check_manager(manager: KVCacheManager) -> None:
    """Verify every invariant of ``manager``; raise `InvariantError` naming the first one
    broken."""
    refs = _check_sequences(manager)
    _check_pool(manager, refs)
    _check_tree(manager, refs)
    _check_pins(manager)
    _check_tiers(manager)
