"""`PagedLayer`: one full-attention layer of a `PagedCache`, and the forward it is part of.

A layer keeps a contiguous working view of its stored keys and values, ``[B, Hkv, capacity,
D]`` buffers of which the first ``stored`` slots are live, grown by doubling, so a decode step
writes one slot instead of re-concatenating the whole cache. With a token policy it also keeps
each slot's original position and validity (False for padding) and, after storing a forward's
tokens, lets the policy choose the slots to keep (see `PagedLayer.update`). With a
head-granular policy (``granularity == "head"``) each kv head keeps its own slots: positions
and validity are per head, ``[B, Hkv, slots]``, and a head's slots past its count are invalid
(`PagedCache.head_mask` masks them out of that head's attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvevict.tokens.base import check_head_selection, check_selection, stored_kv

if TYPE_CHECKING:
    from kvevict.adapters.hf.cache import PagedCache

__all__ = ["Forward", "PagedLayer"]


class Forward:
    """What the cache knows about the forward in flight (set by the decoder's pre-hook)."""

    __slots__ = ("dirty_from", "evicted", "head_counts", "positions", "q", "queries",
                 "special", "start", "stored", "token_ids", "valid", "width")

    def __init__(self, start: int, stored: int, q: int) -> None:
        self.start = start  #: logical length before the forward
        self.stored = stored  #: stored slots per row before the forward
        self.q = q  #: new tokens
        self.dirty_from = stored  #: first slot this forward rewrote (min over layers)
        self.evicted = False
        self.token_ids: Tensor | None = None  #: [B, q]
        self.valid: Tensor | None = None  #: bool [B, q], token policy only
        self.positions: Tensor | None = None  #: long [B, q], token policy only
        self.queries: dict[int, Tensor] = {}  #: layer -> [B, Hq, W, D], attention policies
        self.special: list[int] = []  #: tokens each special (non-paged) layer had seen
        #: head-granular policy: layer -> each kv head's kept count after this forward
        self.head_counts: dict[int, list[int]] | None = None
        self.width = 0  #: head-granular policy: slots every layer stores after this forward


class PagedLayer(CacheLayerMixin):
    """One full-attention layer of a `PagedCache`.

    ``keys`` / ``values`` are views ``[B, Hkv, S, D]`` of the stored slots; ``stored`` is
    ``S`` and ``seen`` the logical length ``L`` (``S < L`` once tokens were evicted). With a
    token policy, ``positions`` (long) and ``valid`` (bool) ``[B, S]`` describe each slot.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.stored = 0
        self.seen = 0
        self._k: Tensor | None = None  # [B, H, capacity, D]
        self._v: Tensor | None = None
        self._pos: Tensor | None = None  # [B, capacity], or [B, H, capacity] per head
        self._valid: Tensor | None = None

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]
        return self._cache.is_croppable

    @property
    def positions(self) -> Tensor | None:
        return None if self._pos is None else self._pos[..., :self.stored]

    @property
    def valid(self) -> Tensor | None:
        return None if self._valid is None else self._valid[..., :self.stored]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty((batch, heads, 0, dim))
        self._v = value_states.new_empty((batch, heads, 0, dim))
        if self._cache.token_policy is not None:
            rows = (batch, heads, 0) if self._cache.head_granular else (batch, 0)
            self._pos = torch.zeros(rows, dtype=torch.long, device=self.device)
            self._valid = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        if self._k is not None:
            self.keys, self.values = self._k[:, :, :self.stored], self._v[:, :, :self.stored]

    def rewind(self, stored: int, seen: int) -> None:
        """Back to ``stored`` slots and logical length ``seen`` (an earlier state of this
        layer: the cache undoing a forward that did not finish)."""
        self.stored, self.seen = stored, seen
        self._refresh()

    def _reserve(self, needed: int) -> None:
        """Grow the buffers (by doubling) to hold ``needed`` slots."""
        capacity = self._k.shape[2]
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity, 16)
        count = self.stored
        self._k, self._v = (_regrow(t, count, capacity) for t in (self._k, self._v))
        if self._pos is not None:
            self._pos, self._valid = (_regrow(t, count, capacity) for t in (self._pos, self._valid))

    def load(self, keys: Tensor, values: Tensor) -> None:
        """Start from ``keys`` / ``values`` ``[B, Hkv, n, D]`` (a prefix read from the pool)."""
        self.lazy_initialization(keys, values)
        self._reserve(keys.shape[2])
        count = keys.shape[2]
        self._k[:, :, :count] = keys
        self._v[:, :, :count] = values
        self.stored = self.seen = count
        self._refresh()

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        """Store this forward's keys and values ``[B, Hkv, q, D]`` (as the token policy's
        ``store_kv`` gives them back when it ``transforms_kv``); return every stored slot's
        (the view attention reads). With a token policy, evict down to the budget after.

        With ``transforms_kv`` the forward's attention reads its own new tokens as computed
        and the earlier ones as stored: a token is read through ``store_kv`` by every later
        forward, not by its own (as a quantized KV cache reads back only what it stored)."""
        cache = self._cache
        fwd = cache.check_update(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        computed = None
        if cache.token_policy is not None and cache.token_policy.transforms_kv:
            computed = key_states, value_states
            key_states, value_states = stored_kv(cache.token_policy, self.layer_idx,
                                                 key_states, value_states)
        q, start = fwd.q, self.stored
        end = start + q
        self._reserve(end)
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.stored, self.seen = end, self.seen + q
        keys, values = self._k[:, :, :end], self._v[:, :, :end]
        if cache.token_policy is not None and cache.head_granular:
            self._pos[:, :, start:end] = fwd.positions[:, None]
            self._valid[:, :, start:end] = fwd.valid[:, None]
            self._evict_heads(fwd, keys, values)
        elif cache.token_policy is not None:
            self._pos[:, start:end] = fwd.positions
            self._valid[:, start:end] = fwd.valid
            self._evict(fwd, keys, values)
        self._refresh()
        if computed is not None:  # this forward's own tokens as computed (see above)
            keys = torch.cat((keys[:, :, :start], computed[0]), dim=2)
            values = torch.cat((values[:, :, :start], computed[1]), dim=2)
        return keys, values

    def _evict(self, fwd: Forward, keys: Tensor, values: Tensor) -> None:
        """Let the token policy pick the kept slots; gather them into fresh buffers (the
        returned views still hold every slot for this forward's attention)."""
        cache = self._cache
        policy = cache.token_policy
        length = self.stored
        if length <= cache.budget and not policy.needs_attention:
            return
        positions, valid = self._pos[:, :length], self._valid[:, :length]
        attention = None
        if policy.needs_attention:
            attention = cache.attention_scores(self, fwd, keys, valid)
        kept = policy.select(self.layer_idx, keys, values, positions, valid, attention=attention)
        batch = keys.shape[0]
        count = min(cache.budget, length)
        check_selection(policy, kept, batch, count, length)
        if count == length:
            return  # every slot kept (select returns them ascending)
        index = kept.to(keys.device)
        gather = index[:, None, :, None].expand(batch, keys.shape[1], count, keys.shape[3])
        self._keep(fwd, keys.gather(2, gather), values.gather(2, gather),
                   positions.gather(1, index), valid.gather(1, index),
                   (index != torch.arange(count, device=index.device)).any(dim=0))

    def _evict_heads(self, fwd: Forward, keys: Tensor, values: Tensor) -> None:
        """`_evict` for a head-granular policy: each kv head keeps its own ``counts[h]``
        slots, gathered into the first slots of that head; the layer stores ``fwd.width``
        slots (the widest layer's), and a head's slots past its count become invalid."""
        cache = self._cache
        policy = cache.token_policy
        length = self.stored
        counts = cache.head_plan(fwd)[self.layer_idx]
        everything = min(counts) == length
        if everything and not policy.needs_attention:
            return
        positions, valid = self._pos[..., :length], self._valid[..., :length]
        attention = None
        if policy.needs_attention:
            attention = cache.attention_scores(self, fwd, keys, valid)
        kept = policy.select(self.layer_idx, keys, values, positions, valid, attention=attention)
        batch, heads, _, dim = keys.shape
        width = fwd.width
        index, live = check_head_selection(policy, kept, batch, counts, length, width)
        if everything:
            return  # every slot of every head kept
        index = index.to(keys.device)
        gather = index[..., None].expand(batch, heads, width, dim)
        self._keep(fwd, keys.gather(2, gather), values.gather(2, gather),
                   positions.gather(2, index), valid.gather(2, index) & live.to(keys.device),
                   (index != torch.arange(width, device=index.device)).flatten(0, 1).any(dim=0))

    def _keep(self, fwd: Forward, keys: Tensor, values: Tensor, positions: Tensor,
              valid: Tensor, moved: Tensor) -> None:
        """Make the gathered kept slots (``keys`` / ``values`` ``[B, Hkv, n, D]``, their
        ``positions`` and ``valid``) the layer's store, with room for the next forward;
        ``moved`` (bool ``[n]``) marks the slots whose content changed, for the pool sync."""
        count = keys.shape[2]
        capacity = max(self._k.shape[2], count + fwd.q)
        self._k, self._v = _regrow(keys, count, capacity), _regrow(values, count, capacity)
        self._pos = _regrow(positions, count, capacity)
        self._valid = _regrow(valid, count, capacity)
        self.stored = count
        first = int(moved.nonzero()[0]) if bool(moved.any()) else count
        fwd.dirty_from = min(fwd.dirty_from, first)
        fwd.evicted = True

    def take_rows(self, rows: list[int]) -> None:
        """Row ``i`` becomes the old row ``rows[i]``; a same-size reorder copies only the rows
        that change."""
        if self._k is None:
            return
        index = torch.tensor(rows, dtype=torch.long, device=self._k.device)
        if len(rows) != self._k.shape[0]:
            self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
            if self._pos is not None:
                self._pos = self._pos.index_select(0, index)
                self._valid = self._valid.index_select(0, index)
        else:
            changed = index != torch.arange(len(rows), device=index.device)
            if bool(changed.any()):
                dst, src, s = changed.nonzero().flatten(), index[changed], self.stored
                self._k[dst, :, :s] = self._k[src, :, :s]
                self._v[dst, :, :s] = self._v[src, :, :s]
                if self._pos is not None:
                    self._pos[dst, ..., :s] = self._pos[src, ..., :s]
                    self._valid[dst, ..., :s] = self._valid[src, ..., :s]
        self._refresh()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` slots (no token policy: slots are positions)."""
        self.stored = self.seen = length
        self._refresh()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(S + q, L - S)``: the stored slots stand for positions ``L - S .. L - 1``."""
        return self.stored + query_length, self.seen - self.stored

    def get_seq_length(self) -> int:
        """The logical length: every token seen, evicted ones included."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget everything stored (the cache releases the blocks)."""
        self.stored = self.seen = 0
        self._k = self._v = self._pos = self._valid = None
        self.keys = self.values = None
        self.is_initialized = False


def _regrow(t: Tensor, count: int, capacity: int) -> Tensor:
    """A buffer of ``capacity`` slots (dim 2 of ``[B, H, slots, D]``, the last dim of
    ``[B, slots]`` and ``[B, H, slots]``) starting with the first ``count`` slots of ``t``."""
    if t.dim() == 4:
        new = t.new_empty((t.shape[0], t.shape[1], capacity, t.shape[3]))
        new[:, :, :count] = t[:, :, :count]
    else:
        new = t.new_zeros((*t.shape[:-1], capacity))
        new[..., :count] = t[..., :count]
    return new
