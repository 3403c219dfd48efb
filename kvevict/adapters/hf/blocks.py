"""Where a `PagedCache`'s K/V live in the `BlockPool`: per-row block tables and their writes.

A cache keeps, per paged layer, a contiguous working view ``[B, Hkv, S, D]`` that attention
reads, and writes each forward's new slots through to the pool once the forward is done: one
``index_copy_`` per layer and plane into ``pool.kv``. Row ``b``'s slot ``s`` lives in block
``tables[b][s // block_size]`` at offset ``s % block_size``; all rows hold the same number of
slots ``S`` (the cache is rectangular).

Two owners of block tables:

- `PrivateBlocks`, for a standalone cache: it allocates from a pool no manager uses, shares
  blocks between rows by ref count (beam search forks rows without copying), copies a shared
  block before writing into it (copy on write) and, when it owns the pool, grows it on demand.
- `SessionBlocks`, for a `SessionStore` turn: one row, backed by a `KVCacheManager` sequence, so
  the blocks are hashed into the prefix tree and become evictable by the store's policy when
  the turn finishes. Blocks are registered only after the forward that computed them succeeded.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kvevict.errors import ConfigError, OutOfBlocks
from kvevict.layout import KVLayout
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool

__all__ = ["MANAGED_POOLS", "PrivateBlocks", "SessionBlocks", "gather_slots", "scatter_slots"]

#: Pools owned by a SessionStore's manager: a standalone cache must not allocate from them.
MANAGED_POOLS: weakref.WeakSet[BlockPool] = weakref.WeakSet()

#: ``(keys, values)`` views ``[B, Hkv, >= S, D]`` of each paged layer, in pool layer order.
LayerViews = Sequence[tuple[Tensor, Tensor]]


def scatter_slots(pool: BlockPool, tables: list[list[int]], views: LayerViews, start: int,
                  end: int, writable: Tensor | None = None) -> None:
    """Copy slots ``[start, end)`` of every row from the layer views into the pool.

    ``writable`` (bool ``[B * (end - start)]``, row-major) skips the slots it marks False.
    One ``index_copy_`` per layer and plane into the pool seen as ``[L, 2, blocks * block_size,
    Hkv, D]``; a decode step (one slot per row) takes the fast path without reshaping.
    """
    count = end - start
    if count <= 0:
        return
    kv = pool.kv
    assert kv is not None  # pools given to a cache always have storage
    num_layers, planes, num_blocks, bs, heads, dim = kv.shape
    if len(tables) * count <= 512:  # plain Python beats building index tensors here
        flat = torch.tensor([table[s // bs] * bs + s % bs for table in tables
                             for s in range(start, end)], dtype=torch.long, device=kv.device)
    else:
        slots = torch.arange(start, end, device=kv.device)
        table = torch.tensor(tables, dtype=torch.long, device=kv.device)  # [B, blocks]
        flat = (table[:, slots // bs] * bs + slots % bs).reshape(-1)  # [B * count]
    if writable is not None:
        flat = flat[writable]
    slots_of = kv.view(num_layers, planes, num_blocks * bs, heads, dim)
    for layer, planes_of_layer in enumerate(views):
        for plane, view in enumerate(planes_of_layer):
            if count == 1:
                src = view[:, :, start]  # [B, H, D]
            else:
                src = view[:, :, start:end].transpose(1, 2).reshape(-1, heads, dim)
            if writable is not None:
                src = src[writable]
            slots_of[layer, plane].index_copy_(0, flat, src)


def gather_slots(pool: BlockPool, table: list[int], count: int) -> list[tuple[Tensor, Tensor]]:
    """Slots ``[0, count)`` of one row as ``(keys, values)`` ``[1, Hkv, count, D]`` per pool
    layer (copies)."""
    kv = pool.kv
    assert kv is not None
    bs = pool.block_size
    blocks = torch.tensor(table[:-(-count // bs)], dtype=torch.long, device=kv.device)
    out = []
    for layer in range(kv.shape[0]):
        planes = kv[layer][:, blocks].flatten(1, 2)[:, :count]  # [2, count, H, D]
        out.append((planes[0].transpose(0, 1)[None], planes[1].transpose(0, 1)[None]))
    return out


class PrivateBlocks:
    """Block tables of a standalone `PagedCache`, one per batch row (see the module docstring).

    Args:
        layout: the paged layers' layout (used when the pool is created here).
        pool: a tensor-backed pool no `KVCacheManager` uses; None: a private pool, created at
            the first write and doubled whenever it is full.
        num_blocks: the private pool's fixed size (None: sized on demand).
        block_size: tokens per block of the private pool.
        device: device of the private pool.
    """

    def __init__(self, layout: KVLayout, pool: BlockPool | None, num_blocks: int | None,
                 block_size: int, device: torch.device) -> None:
        self.layout = layout
        self.pool = pool
        self.growable = pool is None and num_blocks is None
        self._num_blocks = num_blocks
        self._block_size = block_size if pool is None else pool.block_size
        self._device = device
        self.tables: list[list[int]] = []

    @property
    def block_size(self) -> int:
        return self._block_size

    def _new_pool(self, num_blocks: int) -> BlockPool:
        return BlockPool(num_blocks, self._block_size, self.layout, device=self._device)

    def _allocate(self) -> int:
        pool = self.pool
        assert pool is not None
        try:
            return pool.allocate()
        except OutOfBlocks:
            if not self.growable:
                raise OutOfBlocks(
                    f"the cache's pool of {pool.num_blocks} blocks of {pool.block_size} tokens "
                    "is full (every block is in use); pass a larger num_blocks= or pool=, or "
                    "leave num_blocks unset to let a private pool grow",
                    needed=1, available=0) from None
        self._grow()
        return self.pool.allocate()  # type: ignore[union-attr]

    def _grow(self) -> None:
        """Replace the private pool by one twice as large, keeping every block's data and ref
        count (block ids are remapped in the tables)."""
        old = self.pool
        assert old is not None and old.kv is not None
        new = self._new_pool(2 * old.num_blocks)
        remap = {}
        for block in range(old.num_blocks):
            refs = old.ref_count(block)
            if refs:
                target = new.allocate()
                for _ in range(refs - 1):
                    new.incref(target)
                new.kv[:, :, target].copy_(old.kv[:, :, block])  # type: ignore[index]
                remap[block] = target
        for table in self.tables:  # in place: callers may hold a table
            table[:] = [remap[b] for b in table]
        self.pool = new

    def sync(self, views: LayerViews, start: int, stored: int, batch: int,
             token_ids: Tensor | None = None) -> None:
        """Make every row hold ``stored`` slots and write slots ``[start, stored)`` through:
        allocate missing blocks, copy the shared ones about to be written, release the rest."""
        bs = self._block_size
        need = -(-stored // bs)
        if self.pool is None:
            size = self._num_blocks or max(16, 2 * batch * need)
            self.pool = self._new_pool(size)
        if not self.tables:
            self.tables = [[] for _ in range(batch)]
        self.truncate(stored)
        for table in self.tables:
            while len(table) < need:
                block = self._allocate()  # may grow the pool (remapping ids in place)
                table.append(block)
            for j in range(start // bs, need):
                if self.pool.ref_count(table[j]) > 1:  # copy on write
                    self._copy_block(table, j)
        scatter_slots(self.pool, self.tables, views, start, stored)

    def _copy_block(self, table: list[int], j: int) -> None:
        """Give ``table`` its own copy of its ``j``-th block (shared with another row)."""
        copy = self._allocate()
        pool = self.pool
        shared = table[j]  # read after allocating: growing the pool remaps block ids
        pool.kv[:, :, copy].copy_(pool.kv[:, :, shared])  # type: ignore[union-attr,index]
        pool.decref(shared)  # type: ignore[union-attr]  # still held by another row
        table[j] = copy

    def truncate(self, stored: int) -> None:
        """Release every row's blocks beyond the first ``ceil(stored / block_size)``."""
        need = -(-stored // self._block_size)
        for table in self.tables:
            while len(table) > need:
                self._release(table.pop())

    def _release(self, block: int) -> None:
        if self.pool.decref(block) == 0:  # type: ignore[union-attr]
            self.pool.free(block)  # type: ignore[union-attr]

    def take_rows(self, rows: list[int]) -> None:
        """Row ``i`` becomes a reference to the old row ``rows[i]``: blocks are shared (one
        more ref each), never copied."""
        if not self.tables:
            return
        new = [list(self.tables[r]) for r in rows]
        for table in new:
            for block in table:
                self.pool.incref(block)  # type: ignore[union-attr]
        self.release()
        self.tables = new

    def release(self) -> None:
        """Drop every row's references; blocks nobody holds go back to the free list."""
        for table in self.tables:
            for block in reversed(table):
                self._release(block)
        self.tables = []


class SessionBlocks:
    """The blocks of one `SessionStore` turn: a `KVCacheManager` sequence (one row).

    The manager sequence starts holding only the reused prefix (``begin(...,
    max_new_tokens=0)``); `sync` grows it by the slots a finished forward computed (prompt
    tokens through ``prefill``, generated ones through ``append``) and writes them, so a block
    enters the prefix tree only once its K/V are in the pool.
    """

    def __init__(self, manager: KVCacheManager, seq_id: Any, prompt: list[int],
                 resident: int) -> None:
        self.manager = manager
        self.pool = manager.pool
        self.seq_id = seq_id
        self.prompt = prompt
        self.resident = resident  #: slots already in the pool (the reused prefix)
        self.closed = False

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def tables(self) -> list[list[int]]:
        if self.closed:
            return []
        return [list(self.manager.sequence(self.seq_id).block_table)]

    def check_tokens(self, start: int, token_ids: Tensor | None) -> None:
        """Raise `ConfigError` unless ``token_ids`` ``[1, q]`` (fed at positions ``start ..``)
        are given and agree with the turn's prompt where they overlap it."""
        if token_ids is None:
            raise ConfigError("a SessionStore cache needs the token ids of every forward; call "
                              "generate() / the model with input_ids, not inputs_embeds")
        end = min(start + token_ids.shape[1], len(self.prompt))
        if start < end and token_ids[0, :end - start].tolist() != self.prompt[start:end]:
            raise ConfigError(f"the input_ids at positions [{start}, {end}) differ from the "
                              "prompt given to SessionStore.cache_for(); pass the same "
                              "input_ids to generate()")

    def sync(self, views: LayerViews, start: int, stored: int, batch: int,
             token_ids: Tensor | None = None) -> None:
        """Grow the manager sequence to ``stored`` slots and write the new ones.

        ``token_ids`` are this forward's ids, fed at positions ``[start, stored)``. Blocks that
        another live sequence already holds (computed twice at once) are not rewritten.
        """
        manager, seq_id = self.manager, self.seq_id
        seq = manager.sequence(seq_id)
        prompt_len = len(self.prompt)
        if stored > seq.num_tokens:
            in_prompt = min(stored, prompt_len) - seq.num_tokens
            if in_prompt > 0:
                manager.prefill(seq_id, in_prompt)
            if stored > prompt_len:
                first = max(seq.num_tokens, prompt_len)
                assert token_ids is not None  # check_tokens ran at the forward's start
                manager.append(seq_id, token_ids[0, first - start:stored - start].tolist())
        low = max(start, self.resident)
        if low < stored:
            table, bs, pool = seq.block_table, self.pool.block_size, self.pool
            shared = {b for b in table[low // bs:-(-stored // bs)] if pool.ref_count(b) > 1}
            writable = None
            if shared:
                writable = torch.tensor([table[s // bs] not in shared
                                         for s in range(low, stored)], device=pool.kv.device)
            scatter_slots(pool, [table], views, low, stored, writable)
        self.resident = max(self.resident, stored)

    def truncate(self, stored: int) -> None:
        raise ConfigError("a SessionStore cache cannot be cropped (its blocks are already in "
                          "the prefix tree); its is_croppable is False")

    def take_rows(self, rows: list[int]) -> None:
        if rows != [0]:
            raise ConfigError("a SessionStore cache holds one sequence; beam search and batch "
                              "expansion need a standalone PagedCache")

    def release(self) -> None:
        """Finish the manager sequence: its full blocks become candidates for eviction."""
        if not self.closed:
            self.manager.finish(self.seq_id)
            self.closed = True
