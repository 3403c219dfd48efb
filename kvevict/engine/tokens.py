"""Token eviction in the engine: a `kvevict.tokens.TokenPolicy` keeps ``budget`` tokens of
every sequence in every layer of the pool.

`EngineExecutor` (``token_policy=``) hands this module each forward's works; after the forward
(a prefill chunk or a decode step) `TokenEviction.after_forward` shows each sequence's stored
tokens to the policy, layer by layer, as the Hugging Face adapter's ``PagedLayer`` does:

- ``select`` runs once per layer per forward when the layer stores more than ``budget`` tokens,
  and on every forward for a policy that ``needs_attention`` (H2O accumulates what each forward
  saw). The keys and values it scores are the layer's stored slots read back from the
  sequence's blocks (keys after RoPE), ``positions`` their original positions.
- For a ``needs_attention`` policy the attention is that of every new query of the forward
  over the stored keys (causal, the query heads averaged within each GQA group): the
  definition of the adapter's ``window_attention``, recomputed here from the queries
  `LlamaModel.forward_paged` returns (``queries=``).
- Over budget, each layer keeps ``select``'s slots: their K/V are written into the sequence's
  first ``budget`` slots (layers may keep different tokens, never a different count), and
  `KVCacheManager.compact` gives the blocks past them back to the pool. New tokens then go to
  the slots after the kept ones, rotated by their own position: kept tokens keep the rotation
  of theirs (no re-rotation), and the logical length keeps counting.

**Head-granular policies** (``granularity == "head"``: ``ema_heads``, ``lkv_h``) keep each kv
head's own slots: per layer and head the policy's ``head_counts`` of the stored slots; each
head's kept K/V go to the sequence's first slots of that head (keys are stored after RoPE, so
any token can sit in any slot of any head), every layer keeps ``W`` slots, the most any
(layer, head) keeps, and `KVCacheManager.compact` gives the blocks past ``W`` back. Positions
and validity are kept per (layer, head); a head's slots past its count are invalid, and
`head_masks` hands them to `LlamaModel.forward_paged` (``head_masks=``), which masks them out
of that head's attention. A sequence whose slots are all valid (equal counts) has no mask and
runs the engine's batched decode path.

**Caching.** A compacted block no longer holds the tokens its hash names, so a request that
may be compacted (`TokenEviction.uncacheable`: its prompt plus the decodes it will compute
exceed the budget) must be begun uncacheable (the manager's ``uncacheable`` predicate): it
neither hits cached blocks nor caches its own, and recomputes its whole prompt. That also
keeps its answers independent of what the cache held. A request that stays within the budget
is cached and hit as usual; its tokens are shown to the policy but never dropped.

**State.** A stateful policy (one that overrides `TokenPolicy.reset`, as H2O does) is copied
for each sequence (`copy.deepcopy`, then ``reset()``); a stateless one is shared. A preempted
sequence is recomputed from its first token when it resumes (uncacheable, nothing hits), with
a fresh policy state. A peek (the last-token logits of a fully cached prompt) only happens to
a cacheable sequence and is not shown to the policy.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch
from torch import Tensor

from kvevict.engine.model import LlamaModel
from kvevict.errors import ConfigError, KVEvictError
from kvevict.manager import KVCacheManager, Sequence
from kvevict.pool import BlockPool
from kvevict.tokens import TOKEN_POLICIES, ScorerShape, TokenPolicy, make_token_policy
from kvevict.tokens.base import (
    check_head_selection,
    check_selection,
    head_counts_of,
    stored_kv,
    window_attention,
)
from kvevict.types import Request

__all__ = ["TokenEviction"]



@attrs.define
class _SeqState:
    """One sequence's token-eviction state: its policy, each layer's kept positions."""

    owner: Any  #: the scheduler's `RequestState` (its status says when to forget this)
    policy: TokenPolicy
    #: per layer, long ``[stored]``: the original positions (``[Hkv, stored]`` per head for a
    #: head-granular policy)
    positions: list[Tensor]
    stored: int  #: slots per layer
    #: head-granular policy: per layer, bool ``[Hkv, stored]``, False past a head's count
    valid: list[Tensor] | None = None


@attrs.define
class _Item:
    """One sequence's share of a forward, as `TokenEviction.after_forward` needs it."""

    state: _SeqState
    seq_id: Any
    slot: int  #: first slot the forward wrote
    position: int  #: its position
    count: int  #: new tokens
    table: list[int]


class TokenEviction:
    """The token policy of an `EngineExecutor` (see the module docstring).

    Args:
        model: the engine's `LlamaModel` (full attention in every layer).
        policy: a registered token policy name or a `TokenPolicy` instance.
        budget: tokens kept per sequence per layer; required with a name, and equal to the
            instance's budget (or None) with an instance.
        params: more parameters of a named policy. A policy that takes ``shape=`` (the learned
            ``lkv_t``, ``kvp``, ``lkv_h``, and ``moe_nd``) gets it from the model unless given.

    Raises:
        ConfigError: an unknown name, a missing or mismatched budget, parameters with an
            instance, or a model with a sliding window.

    Attributes:
        compactions: forwards after which a sequence's stored tokens were cut to the budget.
        dropped_tokens: tokens those cuts dropped (per sequence, counted once for all layers).
        freed_blocks: blocks they gave back to the pool.
    """

    def __init__(self, model: LlamaModel, policy: str | TokenPolicy,
                 budget: int | None = None, params: dict[str, Any] | None = None) -> None:
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
        c = model.config
        if c.sliding_window is not None:
            raise ConfigError("token eviction in the engine needs full attention in every "
                              f"layer; this model has a sliding window of {c.sliding_window} "
                              "(it counts positions, which kept tokens no longer fill)")
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"token_params must be a dict or None, got "
                              f"{type(params).__name__}")
        if isinstance(policy, TokenPolicy):
            if params:
                raise ConfigError("token_params were given with a TokenPolicy instance; pass "
                                  "a registered name to build one")
            if budget is not None and budget != policy.budget:
                raise ConfigError(f"token_budget={budget!r} differs from the token policy's "
                                  f"budget ({policy.budget}); give one")
            built = policy
        elif isinstance(policy, str):
            params = dict(params or {})
            TOKEN_POLICIES.get(policy)  # an unknown name first
            if "shape" in TOKEN_POLICIES.parameters(policy) and "shape" not in params:
                params["shape"] = ScorerShape(c.num_layers, c.num_kv_heads, c.head_dim,
                                              c.head_dim)
            built = make_token_policy(policy, budget=budget, **params)
        else:
            raise ConfigError(f"token_policy must be None, a registered name "
                              f"({', '.join(TOKEN_POLICIES.names())}) or a TokenPolicy, got "
                              f"{type(policy).__name__}")
        built.reset()
        self.model = model
        self.policy = built
        self.budget = built.budget
        #: whether each sequence gets its own copy of the policy (it overrides ``reset``)
        self.stateful = type(built).reset is not TokenPolicy.reset
        #: whether each kv head keeps its own slots (``granularity == "head"``)
        self.head_granular = built.granularity == "head"
        #: ``forward_paged``'s ``kv_store``: the policy's checked ``store_kv`` when it
        #: ``transforms_kv`` (MoE-nD's quantization; the same for every sequence), else None
        self.kv_store = self._store_kv if built.transforms_kv else None
        self.scaling = c.attention_scale if c.attention_scale is not None \
            else c.head_dim ** -0.5
        self.compactions = 0
        self.dropped_tokens = 0
        self.freed_blocks = 0
        self._states: dict[Any, _SeqState] = {}
        self._final: dict[Any, tuple[tuple[int, ...], ...]] = {}

    # -- what the executor asks ------------------------------------------------------------

    def uncacheable(self, request: Request) -> bool:
        """Whether ``request`` may store more than ``budget`` tokens (its prompt, plus the
        ``output_len - 1`` decodes whose K/V are computed), hence be compacted: the
        ``uncacheable`` predicate of the `KVCacheManager`."""
        return request.prompt_len + max(request.output_len - 1, 0) > self.budget

    def queries(self, count: int) -> int:
        """How many of a forward's ``count`` new queries the policy needs: all of them for a
        policy that scores attention (as the adapter's default), else none."""
        return count if self.policy.needs_attention else 0

    def kept_positions(self, seq_id: Any) -> tuple[Any, ...] | None:
        """Per layer, the original positions of the tokens a sequence stores (after its last
        forward; kept after it finished), or None for one never run. With a head-granular
        policy, per layer a tuple per kv head of its valid slots' positions, in slot order."""
        state = self._states.get(seq_id)
        if state is not None:
            return _positions(state)
        return self._final.get(seq_id)

    def all_kept_positions(self) -> dict[Any, tuple[tuple[int, ...], ...]]:
        """`kept_positions` of every sequence run so far."""
        out = dict(self._final)
        for seq_id in self._states:
            out[seq_id] = self.kept_positions(seq_id)  # type: ignore[assignment]
        return out

    def prune(self) -> None:
        """Forget the state of sequences that stopped running (a finished one's positions
        are kept for `kept_positions`; a preempted one starts afresh when it resumes)."""
        for seq_id in [k for k, s in self._states.items() if s.owner.status != "running"]:
            state = self._states.pop(seq_id)
            if state.owner.status == "finished":
                self._final[seq_id] = _positions(state)

    def check_sequence(self, seq: Sequence) -> None:
        """`ConfigError` when ``seq`` may be compacted but was begun cacheable (the manager
        was built without this predicate): its blocks are or may be shared."""
        if seq.cacheable and self.uncacheable(seq.request):
            raise ConfigError(
                f"request {seq.seq_id!r} may store more than the token budget ({self.budget}) "
                "but its sequence is cacheable: build the KVCacheManager with "
                "uncacheable=executor.uncacheable (run_engine does)")

    def item(self, owner: Any, seq: Sequence, slot: int, position: int, count: int,
             table: list[int], fresh: bool) -> _Item:
        """This forward's share of ``seq``: ``count`` tokens at ``slot`` / ``position``.
        ``fresh``: the first prefill chunk since the sequence was begun or resumed."""
        state = self._states.get(seq.seq_id)
        layers = self.model.config.num_layers
        if fresh or state is None or (seq.cacheable and state.stored != slot):
            if not seq.cacheable and slot != 0:
                raise KVEvictError(f"internal error: uncacheable request {seq.seq_id!r} "
                                   f"starts at slot {slot}, not 0")
            # a cacheable sequence is never compacted: its slots are its positions
            prior = torch.arange(slot, device=self.model.device)
            policy = self.policy
            if self.stateful:
                policy = copy.deepcopy(policy)
                policy.reset()
            state = _SeqState(owner, policy, [prior] * layers, slot)
            if self.head_granular:
                heads = self.model.config.num_kv_heads
                state.positions = [prior.expand(heads, slot)] * layers
                state.valid = [torch.ones((heads, slot), dtype=torch.bool,
                                          device=self.model.device)] * layers
            self._states[seq.seq_id] = state
        elif state.stored != slot:
            raise KVEvictError(f"internal error: request {seq.seq_id!r} stores "
                               f"{state.stored} slots but its next token goes to slot {slot}")
        return _Item(state, seq.seq_id, slot, position, count, table)

    def _store_kv(self, layer_idx: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        return stored_kv(self.policy, layer_idx, keys, values)

    def head_masks(self, items: list[_Item]) -> list[Tensor | None] | None:
        """Per item, bool ``[layers, Hkv, slot]``: which of its stored slots each (layer, kv
        head) attends to, or None where every slot is valid: ``forward_paged``'s
        ``head_masks=``. None for a policy that is not head-granular."""
        if not self.head_granular:
            return None
        masks: list[Tensor | None] = []
        for item in items:
            valid = item.state.valid
            masks.append(None if valid is None or all(bool(v.all()) for v in valid)
                         else torch.stack(valid))
        return masks

    # -- after the forward -----------------------------------------------------------------

    def after_forward(self, manager: KVCacheManager, pool: BlockPool, items: list[_Item],
                      captured: list[list[Tensor] | None]) -> None:
        """Show each item's stored tokens to its policy; compact the ones over budget."""
        for item, queries in zip(items, captured, strict=True):
            self._apply(manager, pool, item, queries)

    def _apply(self, manager: KVCacheManager, pool: BlockPool, item: _Item,
               queries: list[Tensor] | None) -> None:
        if self.head_granular:
            self._apply_heads(manager, pool, item, queries)
            return
        state, policy = item.state, item.state.policy
        device = self.model.device
        new = torch.arange(item.position, item.position + item.count, device=device)
        state.positions = [torch.cat((p, new)) for p in state.positions]
        length = state.stored = item.slot + item.count
        if length <= self.budget and not policy.needs_attention:
            return
        if policy.needs_attention and queries is None:
            raise KVEvictError(f"internal error: no queries captured for {item.seq_id!r}")
        c = self.model.config
        count = min(self.budget, length)
        kv, blocks, slots = self._stored(pool, item, length, count)
        valid = torch.ones((1, length), dtype=torch.bool, device=device)
        for li in range(c.num_layers):
            k, v = self._layer_kv(kv, li, blocks, length)
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            positions = state.positions[li]
            attention = None
            if policy.needs_attention:
                attention = window_attention(queries[li][None], keys, valid,  # type: ignore
                                             self.scaling)
            kept = policy.select(li, keys, values, positions[None], valid, attention=attention)
            check_selection(policy, kept, 1, count, length)
            if count == length:
                continue  # every slot kept
            index = kept[0].to(device)
            self._write_kv(kv, li, slots, k[index], v[index])
            state.positions[li] = positions[index]
        self._compact(manager, item, length, count)

    def _apply_heads(self, manager: KVCacheManager, pool: BlockPool, item: _Item,
                     queries: list[Tensor] | None) -> None:
        """`_apply` for a head-granular policy: per (layer, kv head) its ``head_counts`` slots,
        written into that head's first slots; every layer keeps the widest count's slots."""
        state, policy = item.state, item.state.policy
        assert state.valid is not None  # item() built the state for a head-granular policy
        c = self.model.config
        device, heads = self.model.device, c.num_kv_heads
        new = torch.arange(item.position, item.position + item.count, device=device)
        state.positions = [torch.cat((p, new.expand(heads, -1)), dim=1)
                           for p in state.positions]
        fresh = torch.ones((heads, item.count), dtype=torch.bool, device=device)
        state.valid = [torch.cat((v, fresh), dim=1) for v in state.valid]
        length = state.stored = item.slot + item.count
        counts = [head_counts_of(policy, li, length, heads) for li in range(c.num_layers)]
        if min(min(n) for n in counts) == length and not policy.needs_attention:
            return
        if policy.needs_attention and queries is None:
            raise KVEvictError(f"internal error: no queries captured for {item.seq_id!r}")
        width = max(max(n) for n in counts)
        kv, blocks, slots = self._stored(pool, item, length, width)
        for li in range(c.num_layers):
            k, v = self._layer_kv(kv, li, blocks, length)
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            positions, valid = state.positions[li], state.valid[li]
            attention = None
            if policy.needs_attention:
                attention = window_attention(queries[li][None], keys, valid[None],  # type: ignore
                                             self.scaling)
            kept = policy.select(li, keys, values, positions[None], valid[None],
                                 attention=attention)
            index, live = check_head_selection(policy, kept, 1, counts[li], length, width)
            if min(counts[li]) == length:
                continue  # every slot of every head kept
            index = index[0].to(device)  # [Hkv, width]
            gather = index[..., None].expand(heads, width, c.head_dim)
            self._write_kv(kv, li, slots, keys[0].gather(1, gather).transpose(0, 1),
                           values[0].gather(1, gather).transpose(0, 1))
            state.positions[li] = positions.gather(1, index)
            state.valid[li] = valid.gather(1, index) & live.to(device)
        self._compact(manager, item, length, width)

    # -- reading and writing a sequence's slots (both granularities) ------------------------

    def _stored(self, pool: BlockPool, item: _Item, length: int,
                count: int) -> tuple[Tensor, Tensor, Tensor]:
        """The pool's K/V tensor, the blocks holding ``item``'s first ``length`` slots, and
        the flat pool slots of its first ``count`` slots (where the kept tokens go)."""
        kv = pool.kv
        assert kv is not None  # the executor checked the pool
        bs = pool.block_size
        blocks = torch.tensor(item.table[:-(-length // bs)], device=self.model.device)
        slots = torch.arange(count, device=self.model.device)
        return kv, blocks, blocks[slots // bs] * bs + slots % bs

    def _layer_kv(self, kv: Tensor, li: int, blocks: Tensor,
                  length: int) -> tuple[Tensor, Tensor]:
        """Layer ``li``'s stored K and V of a sequence, ``[length, Hkv, D]`` each (copies)."""
        c = self.model.config
        shape = (-1, c.num_kv_heads, c.head_dim)
        k = kv[li, 0].index_select(0, blocks).view(shape)[:length]
        v = kv[li, 1].index_select(0, blocks).view(shape)[:length]
        return k, v

    def _write_kv(self, kv: Tensor, li: int, slots: Tensor, keys: Tensor,
                  values: Tensor) -> None:
        """Write ``keys`` / ``values`` ``[n, Hkv, D]`` into layer ``li``'s pool ``slots``."""
        c = self.model.config
        kv[li, 0].view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, keys)
        kv[li, 1].view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, slots, values)

    def _compact(self, manager: KVCacheManager, item: _Item, length: int, kept: int) -> None:
        """Give back the blocks past a sequence's first ``kept`` slots (of ``length``)."""
        if kept < length:
            self.freed_blocks += len(manager.compact(item.seq_id, kept))
            self.compactions += 1
            self.dropped_tokens += length - kept
            item.state.stored = kept

    def __repr__(self) -> str:
        return f"TokenEviction({self.policy!r})"


def _positions(state: _SeqState) -> tuple[Any, ...]:
    """`TokenEviction.kept_positions` of one sequence's state."""
    if state.valid is None:
        return tuple(tuple(p.tolist()) for p in state.positions)
    return tuple(tuple(tuple(p[h][v[h]].tolist()) for h in range(p.shape[0]))
                 for p, v in zip(state.positions, state.valid, strict=True))
