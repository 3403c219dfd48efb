"""Chained block hashing and the prefix tree of cached blocks.

A block's hash is ``H(parent_hash, token ids, extra_key)`` with BLAKE2b (128-bit digest), so the
same prefix hashes to the same value in every process and on every machine (no Python
``hash()``, no ``PYTHONHASHSEED``). Two sequences share a cached block exactly when they share
every token up to and including it, as in vLLM's and SGLang's prefix caching.

The tree holds one `BlockInfo` per cached block, keyed by hash. A block is a **leaf** when no
cached child is resident, and a **candidate** for eviction when it is a leaf with ref count 0.
Evicting only candidates keeps the *prefix closure* invariant: a cached block is resident only
if its parent is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from types import MappingProxyType
from typing import Any

from kvevict.errors import ConfigError
from kvevict.types import BlockInfo, as_token_array

__all__ = ["ROOT_HASH", "PrefixTree", "block_hashes", "hash_block"]

#: The parent hash of a sequence's first block.
ROOT_HASH = 0


def _encode_extra(key: Any) -> bytes:
    """Canonical bytes for an extra key (model id, LoRA id, multimodal hash...)."""
    if key is None:
        return b"N"
    if isinstance(key, bool):
        return b"B1" if key else b"B0"
    if isinstance(key, int):
        return b"I" + str(key).encode()
    if isinstance(key, str):
        data = key.encode("utf-8")
        return b"S" + str(len(data)).encode() + b":" + data
    if isinstance(key, bytes):
        return b"Y" + str(len(key)).encode() + b":" + key
    if isinstance(key, tuple):
        return b"T(" + b",".join(_encode_extra(k) for k in key) + b")"
    raise ConfigError(
        f"extra_key must be None, int, str, bytes or a tuple of those (so it hashes the same "
        f"in every process), got {type(key).__name__}"
    )


def _parent_bytes(parent_hash: Any) -> bytes:
    if isinstance(parent_hash, bool) or not isinstance(parent_hash, int) or not (
        0 <= parent_hash < 2**128
    ):
        raise ConfigError(
            f"parent_hash must be an int in [0, 2**128) (a block hash or ROOT_HASH), got "
            f"{parent_hash!r}"
        )
    return parent_hash.to_bytes(16, "little")


def hash_block(parent_hash: int, tokens: Any, extra_key: Any = None) -> int:
    """Hash one block: ``BLAKE2b-128(parent_hash || int64-LE token ids || extra_key)``.

    Returns a non-negative ``int`` below ``2**128``; never equal to `ROOT_HASH` in practice.
    """
    arr = as_token_array(tokens)
    h = hashlib.blake2b(digest_size=16)
    h.update(_parent_bytes(parent_hash))
    h.update(arr.astype("<i8", copy=False).tobytes())
    h.update(_encode_extra(extra_key))
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Any, block_size: int, extra_key: Any = None,
                 parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every *full* block of ``tokens`` (a trailing partial block has none)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    arr = as_token_array(tokens).astype("<i8", copy=False)
    extra = _encode_extra(extra_key)
    _parent_bytes(parent_hash)
    out: list[int] = []
    parent = parent_hash
    for start in range(0, len(arr) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent.to_bytes(16, "little", signed=False))
        h.update(arr[start:start + block_size].tobytes())
        h.update(extra)
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


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
