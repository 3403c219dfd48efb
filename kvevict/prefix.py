"""The prefix tree of cached blocks, keyed by chained hash (`kvevict.hashing`).

The tree holds one `BlockInfo` per cached block, keyed by hash. A block is a **leaf** when no
cached child is resident, and a **candidate** for eviction when it is a leaf with ref count 0.
Evicting only candidates keeps the *prefix closure* invariant: a cached block is resident only
if its parent is. The hash functions are re-exported here for code that imported them from
this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from types import MappingProxyType
from typing import Any

from kvevict.errors import ConfigError
from kvevict.hashing import ROOT_HASH, block_hashes, hash_block
from kvevict.types import BlockInfo

__all__ = ["ROOT_HASH", "PrefixTree", "block_hashes", "hash_block"]


class PrefixTree:
    """Cached blocks keyed by chained hash; owns child counts and the candidate set.

    The tree never decides what to evict. Its caller (the manager, which owns the records'
    ref counts) tells it when a cached block gains its first running user (`referenced`) or
    loses its last (`unreferenced`); the tree keeps each block's ``num_children``, the count
    of evictable blocks and the candidate set (cached, ref count 0, leaf), and reports every
    leaf transition back: which blocks entered or left the candidate set.
    """

    def __init__(self) -> None:
        self._blocks: dict[Any, BlockInfo] = {}
        #: Cached blocks by hash: a read-only live view (``blocks.get`` is the hot lookup).
        self.blocks: Mapping[Any, BlockInfo] = MappingProxyType(self._blocks)
        self._candidates: dict[int, BlockInfo] = {}
        #: Candidates (cached, ref 0, leaf) by block id: a read-only live view.
        self.candidates: Mapping[int, BlockInfo] = MappingProxyType(self._candidates)
        self._num_evictable = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: Any) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[BlockInfo]:
        return iter(self._blocks.values())

    def candidate(self, block_id: Any) -> BlockInfo | None:
        """The candidate with this block id, or None if it is not one."""
        return self._candidates.get(block_id)

    @property
    def num_candidates(self) -> int:
        return len(self._candidates)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with ref count 0 (candidates and the inner blocks above them)."""
        return self._num_evictable

    def get(self, block_hash: Any) -> BlockInfo | None:
        """The cached block with this hash, or None."""
        return self._blocks.get(block_hash)

    def longest_prefix(self, hashes: Iterable[Any]) -> list[BlockInfo]:
        """Cached blocks matching ``hashes`` from the start, stopping at the first miss."""
        blocks = self._blocks
        out: list[BlockInfo] = []
        for h in hashes:
            block = blocks.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def match(self, hashes: SequenceABC[Any], what: Any = "") -> tuple[list[BlockInfo], int]:
        """The cached prefix of a hash chain, and how many of its blocks have ref count 0.

        Checks that the chain agrees with the tree: each hit block is cached under the
        previous hash at its depth, and no later hash is cached past the first miss (which
        prefix closure rules out). Raises `ConfigError` naming ``what`` otherwise: ids from a
        trace must be prefix-chained.
        """
        blocks = self._blocks
        hit: list[BlockInfo] = []
        unreferenced = 0
        parent = None
        for h in hashes:
            block = blocks.get(h)
            if block is None:
                break
            if block.parent is not parent:
                expected = ROOT_HASH if parent is None else parent.block_hash
                raise ConfigError(
                    f"request {what!r}: block id {h!r} is cached under parent "
                    f"{block.parent_hash!r} but follows {expected!r} here; block_hashes must "
                    "be prefix-chained"
                )
            if not block.ref_count:
                unreferenced += 1
            hit.append(block)
            parent = block
        n = len(hit)
        if n + 1 < len(hashes) and not blocks.keys().isdisjoint(hashes[n + 1:]):
            h = next(h for h in hashes[n + 1:] if h in blocks)
            raise ConfigError(
                f"request {what!r}: block id {h!r} is cached but an earlier id of this "
                "request is not; block_hashes must be prefix-chained"
            )
        return hit, unreferenced

    def insert(self, block: BlockInfo) -> None:
        """Register ``block``, held by a running sequence (ref count >= 1).

        A block at depth > 0 needs its parent cached (``block.parent``, under
        ``block.parent_hash``); the parent, held by the same sequence, gains a child.
        """
        if block.block_hash in self._blocks:
            h = block.block_hash
            shown = f"{h:#x}" if isinstance(h, int) else repr(h)
            raise ConfigError(f"block hash {shown} is already cached")
        if block.ref_count < 1:
            raise ConfigError(f"block {block.block_id} must be held by a running sequence "
                              "when it is cached (ref count >= 1)")
        parent = block.parent
        if block.depth > 0:
            if parent is None or self._blocks.get(block.parent_hash) is not parent:
                raise ConfigError(
                    f"cannot cache block at depth {block.depth}: its parent is not cached "
                    "(prefix closure)"
                )
            if parent.block_id in self._candidates:
                raise ConfigError(f"cannot cache block {block.block_id} under candidate "
                                  f"{parent.block_id}: the parent must be held")
            parent.num_children += 1
        self._blocks[block.block_hash] = block

    def insert_chain(self, blocks: SequenceABC[BlockInfo]) -> None:
        """Register held blocks that form a chain in one call (a request's new blocks):
        ``blocks[0]`` as `insert` would, each later one as the child of the one before it.
        Raises `ConfigError` (nothing registered) if they do not form such a chain."""
        self.insert(blocks[0])
        cached = self._blocks
        prev = blocks[0]
        for i in range(1, len(blocks)):
            block = blocks[i]
            h = block.block_hash
            if h in cached or block.parent is not prev or block.ref_count < 1:
                for undo in reversed(blocks[:i]):
                    self.discard(undo)
                raise ConfigError(f"block {block.block_id} does not continue the chain: it "
                                  "must be a held, uncached child of the block before it")
            prev.num_children += 1
            cached[h] = block
            prev = block

    def discard(self, block: BlockInfo) -> None:
        """Undo `insert` of a held leaf (nothing below it, so no candidate changes)."""
        if block.num_children or self._blocks.get(block.block_hash) is not block:
            raise ConfigError(f"block {block.block_id} is not a cached leaf")
        del self._blocks[block.block_hash]
        if block.parent is not None:
            block.parent.num_children -= 1

    def referenced(self, blocks: list[BlockInfo]) -> list[BlockInfo]:
        """Blocks whose ref count just went from 0 to 1; return those that left the
        candidate set (in order)."""
        self._num_evictable -= len(blocks)
        pop = self._candidates.pop
        return [b for b in blocks if pop(b.block_id, None) is not None]

    def unreferenced(self, blocks: list[BlockInfo]) -> list[BlockInfo]:
        """Blocks whose ref count just went to 0; return those that became candidates (the
        leaves among them, in order)."""
        self._num_evictable += len(blocks)
        candidates = self._candidates
        out = []
        for block in blocks:
            if not block.num_children:
                candidates[block.block_id] = block
                out.append(block)
        return out

    def evict(self, block: BlockInfo) -> BlockInfo | None:
        """Remove a candidate; return its parent if the parent just became a candidate."""
        if self._candidates.pop(block.block_id, None) is None:
            raise ConfigError(f"block {block.block_id} is not a candidate (cached, ref 0, "
                              "leaf); only candidates can be evicted")
        del self._blocks[block.block_hash]
        self._num_evictable -= 1
        parent = block.parent
        if parent is not None:
            n = parent.num_children - 1
            parent.num_children = n
            if not n and not parent.ref_count:
                self._candidates[parent.block_id] = parent
                return parent
        return None

    @staticmethod
    def is_candidate(block: BlockInfo) -> bool:
        """Cached, not used by any running sequence, and a leaf."""
        return block.ref_count == 0 and block.num_children == 0
