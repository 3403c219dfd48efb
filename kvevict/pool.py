"""Physical KV blocks: one torch tensor (or none, for simulation), a free list, ref counts.

Storage layout, for a `KVLayout` with ``L`` layers::

    kv: torch.Tensor[L, P, num_blocks, block_size, H, D]   (dtype and device of the pool)

where ``P`` is the number of planes (2 for K and V; 1 for MLA, whose plane holds the
compressed latent ``c_kv`` concatenated with the decoupled RoPE key ``k_pe``), ``H`` the KV
heads (1 for MQA and MLA) and ``D`` the head dim. Block ``b`` of layer ``l`` is
``kv[l, :, b]``: ``[P, block_size, H, D]``.

The pool knows nothing of hashes or policies: it hands out free blocks, counts references and
takes blocks back. ``ref_count`` is the number of running sequences using a block; a block with
ref count 0 may still hold cached data (the manager decides when it is freed).
"""

from __future__ import annotations

from typing import Any

import torch

from kvevict.errors import ConfigError, OutOfBlocks
from kvevict.layout import KVLayout

__all__ = ["BlockPool"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


class BlockPool:
    """A fixed number of KV blocks of ``block_size`` tokens each.

    Args:
        num_blocks: blocks in the pool (> 0).
        block_size: tokens per block (> 0).
        layout: the model's KV layout; gives the bytes per block and the tensor shape. Without
            one the pool is metadata-only and blocks have 0 bytes.
        device: torch device of the tensor (default: CUDA when available, else CPU).
        dtype: tensor dtype (default: the layout's dtype).
        storage: allocate the tensor (True) or run metadata-only (False), as the simulator does.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout | None = None, *,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 storage: bool = True) -> None:
        self.num_blocks = _positive_int("num_blocks", num_blocks)
        self.block_size = _positive_int("block_size", block_size)
        if layout is not None and not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.kv: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        if layout is not None:
            self.dtype = layout.dtype if dtype is None else dtype
            if not isinstance(self.dtype, torch.dtype):
                raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
            self.bytes_per_block = (
                layout.elements_per_token * block_size * self.dtype.itemsize
            )
        else:
            self.bytes_per_block = 0
        if storage and layout is not None:
            if device is None:
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self.device = torch.device(device)
            self.kv = torch.zeros(
                layout.tensor_shape(num_blocks, block_size), dtype=self.dtype, device=self.device
            )
        elif storage and layout is None and (device is not None or dtype is not None):
            raise ConfigError("a pool with a tensor needs a layout= (KVLayout)")
        self._ref = [0] * num_blocks
        self._used = [False] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    # -- allocation ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks on the free list (holding nothing)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks handed out (running or cached); ``num_free + num_used == num_blocks``."""
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """Take a free block, with ref count 1. Raises `OutOfBlocks` when none is free."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use", needed=1, available=0)
        block_id = self._free.pop()
        self._used[block_id] = True
        self._ref[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        """Return a block with ref count 0 to the free list."""
        self._check_used(block_id)
        if self._ref[block_id] != 0:
            raise ConfigError(
                f"cannot free block {block_id}: ref count is {self._ref[block_id]}, expected 0"
            )
        self._used[block_id] = False
        self._free.append(block_id)

    def incref(self, block_id: int) -> int:
        """Add a reference; return the new ref count."""
        self._check_used(block_id)
        self._ref[block_id] += 1
        return self._ref[block_id]

    def decref(self, block_id: int) -> int:
        """Drop a reference; return the new ref count (the block is not freed here)."""
        self._check_used(block_id)
        if self._ref[block_id] == 0:
            raise ConfigError(f"block {block_id} has ref count 0; cannot release it again")
        self._ref[block_id] -= 1
        return self._ref[block_id]

    def ref_count(self, block_id: int) -> int:
        """Current ref count of a block."""
        self._check_id(block_id)
        return self._ref[block_id]

    def is_used(self, block_id: int) -> bool:
        """Whether the block is handed out (running or cached)."""
        self._check_id(block_id)
        return self._used[block_id]

    # -- batch operations (the manager's hot path; like vLLM's ``popleft_n`` / ``append_n``) --

    def take(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with ref count 1, in the order `allocate` would hand
        them out. Raises `OutOfBlocks` (nothing taken) when fewer than ``n`` are free."""
        free = self._free
        if n > len(free):
            raise OutOfBlocks(f"{n} blocks requested but only {len(free)} of "
                              f"{self.num_blocks} are free", needed=n, available=len(free))
        if n <= 0:
            if n < 0:
                raise ConfigError(f"cannot take {n} blocks; expected a count >= 0")
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        used, ref = self._used, self._ref
        for block_id in ids:
            used[block_id] = True
            ref[block_id] = 1
        return ids

    def release(self, block_ids: list[int]) -> None:
        """Return blocks with ref count 0 to the free list, in order (the last one is handed
        out first). Raises `ConfigError` (nothing released) if one is free or referenced."""
        used, ref = self._used, self._ref
        for block_id in block_ids:
            if ref[block_id] or not used[block_id]:
                break
            used[block_id] = False
        else:
            self._free.extend(block_ids)
            return
        for undo in block_ids:  # put back what this call changed, then say what was wrong
            if undo == block_id:
                break
            used[undo] = True
        self._check_used(block_id)
        raise ConfigError(f"cannot release block {block_id}: ref count is {ref[block_id]}, "
                          "expected 0")

    def incref_all(self, block_ids: Any) -> None:
        """Add one reference to each block. Raises `ConfigError` (nothing changed) if one is
        not handed out."""
        used, ref = self._used, self._ref
        for block_id in block_ids:
            if not used[block_id]:
                break
            ref[block_id] += 1
        else:
            return
        for undo in block_ids:
            if undo == block_id:
                break
            ref[undo] -= 1
        self._check_used(block_id)

    def decref_all(self, block_ids: Any) -> None:
        """Drop one reference from each block (none is freed here). Raises `ConfigError`
        (nothing changed) if a block is not referenced."""
        ref = self._ref
        for block_id in block_ids:
            if ref[block_id] <= 0:
                break
            ref[block_id] -= 1
        else:
            return
        for undo in block_ids:
            if undo == block_id:
                break
            ref[undo] += 1
        self._check_used(block_id)
        raise ConfigError(f"block {block_id} has ref count 0; cannot release it again")

    # -- inspection --------------------------------------------------------------------------

    def first_free(self, block_ids: Any) -> int | None:
        """The first of ``block_ids`` (valid ids) that is free, or None when all are handed
        out: one call to check a whole block table."""
        used = self._used
        for block_id in block_ids:
            if not used[block_id]:
                return block_id
        return None

    def free_ids(self) -> list[int]:
        """The free list (a copy; its last block is handed out next)."""
        return list(self._free)

    def ref_counts(self) -> list[int]:
        """Ref count of every block, by id (a copy)."""
        return list(self._ref)

    def used_flags(self) -> list[bool]:
        """Whether each block is handed out, by id (a copy)."""
        return list(self._used)

    def _check_id(self, block_id: Any) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not (
            0 <= block_id < self.num_blocks
        ):
            raise ConfigError(
                f"block id must be an int in [0, {self.num_blocks}), got {block_id!r}"
            )

    def _check_used(self, block_id: int) -> None:
        self._check_id(block_id)
        if not self._used[block_id]:
            raise ConfigError(f"block {block_id} is free; it was never allocated or was freed")

    # -- KV data ---------------------------------------------------------------------------

    def _require_storage(self) -> torch.Tensor:
        if self.kv is None:
            raise ConfigError("this pool is metadata-only (storage=False or no layout); it "
                              "holds no KV tensor")
        return self.kv

    def _check_layer(self, layer: Any) -> None:
        n = self.layout.num_layers  # type: ignore[union-attr]
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
            raise ConfigError(f"layer must be an int in [0, {n}), got {layer!r}")

    def write(self, block_id: int, layer: int, key: torch.Tensor,
              value: torch.Tensor | None = None, start: int = 0) -> None:
        """Write KV for tokens ``start .. start + n`` of a block, for one layer.

        Args:
            key: ``[n, H, D]`` keys (for MLA: the ``[n, 1, D]`` latent+rope plane), pool dtype.
            value: ``[n, H, D]`` values, required unless the layout is MLA (then None).
            start: first token slot in the block.
        """
        kv = self._require_storage()
        self._check_used(block_id)
        self._check_layer(layer)
        layout: KVLayout = self.layout  # type: ignore[assignment]  # storage implies one
        planes = [key] if layout.kv_planes == 1 else [key, value]
        if layout.kv_planes == 1 and value is not None:
            raise ConfigError("an MLA pool has one plane (latent + rope); pass value=None")
        if layout.kv_planes == 2 and value is None:
            raise ConfigError("this pool stores K and V; pass both key and value")
        shape = None
        for name, t in zip(("key", "value"), planes, strict=False):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise ConfigError(f"{name} dtype is {t.dtype}, expected the pool's {self.dtype}")
            expected_tail = (layout.num_kv_heads, layout.head_dim)
            if t.dim() != 3 or tuple(t.shape[1:]) != expected_tail:
                raise ConfigError(
                    f"{name} shape is {tuple(t.shape)}, expected [n, {expected_tail[0]}, "
                    f"{expected_tail[1]}]"
                )
            if shape is not None and t.shape != shape:
                raise ConfigError(f"key and value shapes differ: {tuple(shape)} vs "
                                  f"{tuple(t.shape)}")
            shape = t.shape
        n = int(shape[0])  # type: ignore[index]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or (
            start + n > self.block_size
        ):
            raise ConfigError(
                f"tokens [{start}, {start + n}) do not fit a block of {self.block_size} slots"
            )
        for plane, t in enumerate(planes):
            kv[layer, plane, block_id, start:start + n].copy_(t)

    def read(self, block_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """KV of one block and layer as views: ``(key [block_size, H, D], value or None)``."""
        kv = self._require_storage()
        self._check_used(block_id)
        self._check_layer(layer)
        if kv.shape[1] == 1:
            return kv[layer, 0, block_id], None
        return kv[layer, 0, block_id], kv[layer, 1, block_id]

    def block_bytes(self, block_id: int) -> bytes:
        """Raw bytes of a block across all layers (for integrity checks)."""
        kv = self._require_storage()
        self._check_id(block_id)
        data = kv[:, :, block_id].contiguous().cpu()
        return data.view(torch.uint8).numpy().tobytes()
