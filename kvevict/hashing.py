"""Chained block hashing: the content key of every cached block.

A block's hash is ``H(parent_hash, token ids, extra_key)`` with BLAKE2b (128-bit digest), so the
same prefix hashes to the same value in every process and on every machine (no Python
``hash()``, no ``PYTHONHASHSEED``). Two sequences share a cached block exactly when they share
every token up to and including it, as in vLLM's and SGLang's prefix caching.

This module sits at the bottom of the layers (it needs only `kvevict.types`): the prefix tree,
the manager, the run loop, trace readers and offline policies all hash with it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvevict.errors import ConfigError
from kvevict.types import as_token_array

__all__ = ["ROOT_HASH", "block_hashes", "hash_block"]

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
