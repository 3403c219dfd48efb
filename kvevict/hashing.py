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

import numpy as np

from kvevict.errors import ConfigError
from kvevict.types import Request, as_token_array

__all__ = ["ROOT_HASH", "block_hashes", "chain_hashes", "encode_extra", "hash_block",
           "request_hashes"]

#: The parent hash of a sequence's first block.
ROOT_HASH = 0

_INT64_LE = np.dtype("<i8")


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
    _parent_bytes(parent_hash)
    return chain_hashes(as_token_array(tokens), block_size, encode_extra(extra_key),
                        parent_hash)


def request_hashes(request: Request, block_size: int | None = None,
                   extra_key: Any = None) -> Any:
    """The block hashes ``request`` uses, as the manager computes them: its
    ``block_hashes``, or its tokens hashed in blocks of ``block_size``."""
    if request.block_hashes is not None:
        return request.block_hashes
    if block_size is None:
        raise ConfigError(f"request {request.request_id!r} gives tokens; pass block_size= to "
                          "hash them into blocks")
    return block_hashes(request.tokens, block_size, extra_key)


def encode_extra(extra_key: Any) -> bytes:
    """The bytes every block hash under ``extra_key`` ends with (`ConfigError` if the key
    would not hash the same in every process): computed once by a caller that hashes many
    blocks under one key (`chain_hashes`)."""
    return _encode_extra(extra_key)


def chain_hashes(tokens: np.ndarray, block_size: int, extra: bytes,
                 parent_hash: int = ROOT_HASH) -> list[int]:
    """`block_hashes` for input already checked: ``tokens`` a 1-D integer array of token ids
    (as `kvevict.types.Request` holds them), ``extra`` from `encode_extra`, ``parent_hash`` a
    hash or `ROOT_HASH`. The hot path of every token-mode request.

    The same values as `hash_block` block by block, in one pass: the array is laid out as
    little-endian int64 once and each block's bytes are a slice of one `memoryview` of it
    (no copy per block), fed to BLAKE2b after the parent's 16 bytes.
    """
    n = len(tokens) // block_size
    if not n:
        return []
    if tokens.dtype != _INT64_LE or not tokens.flags.c_contiguous:
        tokens = np.ascontiguousarray(tokens, dtype=_INT64_LE)
    data = memoryview(tokens).cast("B")
    step = block_size * 8
    blake2b = hashlib.blake2b
    from_bytes = int.from_bytes
    out: list[int] = []
    append = out.append
    parent = parent_hash
    for start in range(0, n * step, step):
        h = blake2b(parent.to_bytes(16, "little"), digest_size=16)
        h.update(data[start:start + step])
        h.update(extra)
        parent = from_bytes(h.digest(), "little")
        append(parent)
    return out
