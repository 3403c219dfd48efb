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
from collections.abc import Iterable, Iterator
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
    """Cached blocks keyed by chained hash, with leaf and candidate bookkeeping.

    The tree never decides what to evict; the manager asks it what is resident, what the
    longest cached prefix of a hash chain is, and whether a block is a candidate.
    """

    def __init__(self) -> None:
        self._blocks: dict[Any, BlockInfo] = {}
        #: Candidates (cached, ref 0, leaf), by block id.
        self.candidates: dict[int, BlockInfo] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: Any) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[BlockInfo]:
        return iter(self._blocks.values())

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

    def insert(self, block: BlockInfo) -> BlockInfo | None:
        """Register ``block``; return its parent if the parent just stopped being a leaf.

        A block at depth > 0 needs its parent (by ``block.parent_hash``) cached; a block at
        depth 0 has none (whatever its parent hash says: trace ids may equal `ROOT_HASH`).
        """
        if block._hash in self._blocks:
            shown = f"{block._hash:#x}" if isinstance(block._hash, int) else repr(block._hash)
            raise ConfigError(f"block hash {shown} is already cached")
        parent = None
        if block._depth > 0:
            parent = self._blocks.get(block._parent)
            if parent is None:
                raise ConfigError(
                    f"cannot cache block at depth {block._depth}: its parent is not cached "
                    "(prefix closure)"
                )
        self._blocks[block._hash] = block
        if parent is not None:
            parent._num_children += 1
            if parent._num_children == 1:
                return parent
        return None

    def remove(self, block: BlockInfo) -> BlockInfo | None:
        """Unregister a leaf; return its parent if the parent just became a leaf."""
        if block._num_children:
            raise ConfigError(
                f"block {block._id} has {block._num_children} cached children; only leaves "
                "can be removed"
            )
        del self._blocks[block._hash]
        self.candidates.pop(block._id, None)
        if block._depth > 0:
            parent = self._blocks[block._parent]
            parent._num_children -= 1
            if parent._num_children == 0:
                return parent
        return None

    @staticmethod
    def is_candidate(block: BlockInfo) -> bool:
        """Cached, not used by any running sequence, and a leaf."""
        return block._ref_count == 0 and block._num_children == 0

