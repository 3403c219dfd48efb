"""`PagedCache`: a ``transformers.Cache`` whose full-attention layers live in a `BlockPool`.

Per full-attention layer the cache keeps a contiguous working view ``[B, Hkv, S, D]`` of the
stored keys and values (`PagedLayer`: what attention reads, grown in place without
re-concatenating), and after each forward writes the new slots through to the pool's blocks
(`blocks.py`). Sliding window, linear-attention and other special layers keep transformers' own
layer classes.

Two forward hooks on the model's decoder (`hooks.py`) tell the cache where a forward starts and
ends: the start gives the token ids, the 2-D attention mask and the positions of the new tokens;
the end is when the new slots are written to the pool, so a forward that raises leaves no
half-written block behind.

Token-level eviction (optional ``token_policy``, a `kvevict.tokens.TokenPolicy`): when a
layer stores more than ``budget`` tokens after a forward, the policy picks the ``budget`` slots
each row keeps (the same for all kv heads of that layer). Kept tokens keep their original
positions (no re-rotation). ``get_seq_length`` stays the logical length ``L`` (tokens seen)
while ``get_mask_sizes`` reports the stored ``S`` plus the offset ``L - S``, so transformers'
masks and positions stay right. Padding is tracked per slot from the 2-D mask: padded slots
are evicted first, and the mask handed to the model is remapped to the kept slots.

A head-granular policy (``granularity == "head"``: ``ema_heads``, ``lkv_h``) lets each kv head
keep its own tokens and its own count: a layer stores, per head, its kept slots first, every
layer as many slots as the widest (layer, head) keeps (the pool's blocks hold all layers), and
a head's slots past its count are invalid. transformers builds one mask for all heads, so the
attention modules' pre-hook replaces it, in a layer where some head has an invalid slot, by
`head_mask`: an additive ``[B, Hq, q, S + q]`` mask per query head (eager and SDPA attention
honour it). Where every stored slot is valid (equal counts, no padding) transformers' own mask
is used unchanged.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache

from kvevict.adapters.hf.blocks import PrivateBlocks, SessionBlocks, gather_slots
from kvevict.adapters.hf.hooks import install_hooks
from kvevict.adapters.hf.layer import Forward, PagedLayer
from kvevict.adapters.hf.model import (
    PAGED_LAYER_TYPE,
    ModelSpec,
    attention_modules,
    check_pool,
    inspect_model,
    project_queries,
)
from kvevict.errors import ConfigError, PolicyError
from kvevict.pool import BlockPool
from kvevict.tokens import TokenPolicy, make_token_policy
from kvevict.tokens.base import head_counts_of, window_attention

__all__ = ["PagedCache"]


class PagedCache(Cache):
    """A ``transformers.Cache`` that pages full-attention K/V into a kvevict `BlockPool`.

    Pass it to ``generate(..., cache=cache)`` (or the deprecated ``past_key_values=``). One
    cache holds one batch of sequences; build a new one (or call `reset`) for a new batch.

    Args:
        model: the decoder-only transformers model the cache serves (hooks are installed on
            it once; they do nothing for other caches).
        pool: a tensor-backed `BlockPool` shaped for the model's full-attention layers
            (``ModelSpec.layout()``), not used by a `KVCacheManager`. Default: a private pool.
        num_blocks: size of the private pool (default: sized on demand, doubling when full).
        block_size: tokens per block of the private pool (default 16).
        token_policy: a `kvevict.tokens.TokenPolicy`, or a registered name such as
            ``"streamingllm"`` built with ``budget``. One policy instance per cache: a
            stateful policy (H2O) follows this cache's slots.
        budget: tokens kept per sequence per layer; defaults to the policy's budget and must
            equal it when both are given.
        attention_queries: for policies that need attention, how many of a forward's most
            recent queries are scored (default: all of them).

    Raises:
        ConfigError: an unsupported model, layer type or dtype, a pool of the wrong shape,
            dtype or device, or a policy that needs attention on a model whose attention
            modules cannot be found.
    """

    def __init__(self, model: nn.Module, *, pool: BlockPool | None = None,
                 num_blocks: int | None = None, block_size: int = 16,
                 token_policy: TokenPolicy | str | None = None, budget: int | None = None,
                 attention_queries: int | None = None) -> None:
        spec = inspect_model(model)
        self.spec: ModelSpec = spec
        self._decoder = weakref.ref(model.base_model)
        self.token_policy, self.budget = _token_policy(token_policy, budget)
        self.attention_queries = _optional_count("attention_queries", attention_queries)
        self._wants_queries = bool(self.token_policy is not None
                                   and self.token_policy.needs_attention)
        self._head_granular = bool(self.token_policy is not None
                                   and self.token_policy.granularity == "head")
        if self._head_granular and spec.has_special_layers:
            raise ConfigError(f"head-granular token policy {self.token_policy!r} needs full "
                              f"attention in every layer; {spec.model_name} has sliding-window "
                              "or other special layers")
        if self._wants_queries or self._head_granular:
            self._attention_modules = _checked_attention_modules(model, spec, self.token_policy)
        install_hooks(model.base_model, PagedCache,
                      attention=self._wants_queries or self._head_granular)
        layers: list[Any] = []
        for idx, (kind, kwargs) in enumerate(zip(spec.layer_types, spec.layer_kwargs)):
            if kind == PAGED_LAYER_TYPE:
                layers.append(PagedLayer(self, idx))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kwargs))
        super().__init__(layers=layers)
        self._paged: list[PagedLayer] = [lay for lay in layers if isinstance(lay, PagedLayer)]
        self._special = [lay for lay in layers if not isinstance(lay, PagedLayer)]
        if pool is not None:
            check_pool(pool, spec)
        if num_blocks is not None and (pool is not None or isinstance(num_blocks, bool)
                                       or not isinstance(num_blocks, int) or num_blocks <= 0):
            raise ConfigError(f"num_blocks must be a positive int sizing the private pool (and "
                              f"pool= absent), got num_blocks={num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        self._blocks: PrivateBlocks | SessionBlocks = PrivateBlocks(
            spec.layout(), pool, num_blocks, block_size, spec.device)
        self._batch: int | None = None
        self._length = 0  # logical tokens of every row
        self._forward: Forward | None = None
        self._broken: str | None = None
        self._closed = False
        self._store: Any = None
        self._on_close: Callable[[PagedCache], None] | None = None
        self.prompt_tokens = 0  #: SessionStore turns: tokens of the prompt
        self.reused_tokens = 0  #: SessionStore turns: prompt tokens read from the pool

    def start_turn(self, store: Any, seq_id: Any, prompt: list[int], resident: int,
                   reuse: int, on_close: Callable[[PagedCache], None]) -> None:
        """Make this new cache one row over a manager sequence of ``store`` that holds
        ``resident`` prompt tokens in the pool, of which the first ``reuse`` are loaded.

        Called by `SessionStore.cache_for` (use that); ``on_close(cache)`` runs once, when the
        cache is closed. Raises `ConfigError` on a cache that already ran a forward or a turn.
        """
        if self._store is not None or self._batch is not None or self._closed:
            raise ConfigError("start_turn needs a new PagedCache (SessionStore.cache_for "
                              "builds one per turn)")
        self._blocks = SessionBlocks(store.manager, seq_id, prompt, resident)
        self._store, self._on_close = store, on_close
        self._batch = 1
        self.prompt_tokens, self.reused_tokens = len(prompt), reuse
        if reuse:
            table = store.manager.sequence(seq_id).block_table
            for layer, (keys, values) in zip(self._paged, gather_slots(store.pool, table, reuse)):
                layer.load(keys, values)
            self._length = reuse

    # -- what the pool holds ---------------------------------------------------------------

    @property
    def pool(self) -> BlockPool | None:
        """The pool the paged layers write to (None until a private pool is first needed)."""
        return self._blocks.pool

    @property
    def store(self) -> Any:
        """The `SessionStore` whose turn this cache is, or None for a standalone cache."""
        return self._store

    @property
    def wants_queries(self) -> bool:
        """Whether the token policy scores attention, so the attention hooks must capture
        each forward's queries (`capture_queries`)."""
        return self._wants_queries

    @property
    def head_granular(self) -> bool:
        """Whether the token policy keeps its own slots per kv head (``granularity ==
        "head"``), so the paged layers store per-head positions and validity and the attention
        modules' pre-hook asks for `head_mask`."""
        return self._head_granular

    @property
    def block_tables(self) -> list[list[int]]:
        """Each row's pool blocks, in slot order (a copy)."""
        return [list(t) for t in self._blocks.tables]

    @property
    def stored_length(self) -> int:
        """Slots each row stores per paged layer (``S``; less than the logical length once
        tokens were evicted)."""
        return self._paged[0].stored

    @property
    def is_croppable(self) -> bool:
        """True only when `crop` can restore an earlier state exactly: no token policy (evicted
        tokens cannot come back) and not a SessionStore turn (its blocks are committed), and
        every special layer croppable."""
        if self.token_policy is not None or isinstance(self._blocks, SessionBlocks):
            return False
        return all(layer.is_croppable for layer in self.layers
                   if not isinstance(layer, PagedLayer))

    # -- forward bookkeeping (called from the hooks and the paged layers) ------------------

    def begin_forward(self, decoder: nn.Module, arguments: dict) -> Tensor | None:
        """Open a forward; return a remapped 2-D attention mask when eviction needs one.

        Called by the decoder's forward pre-hook (`hooks.py`) with the forward's arguments by
        name."""
        if self._decoder() is not decoder:
            raise ConfigError("this PagedCache was built for another model; build one per model")
        if self._closed:
            raise ConfigError("this cache was closed; get a new one (SessionStore.cache_for or "
                              "PagedCache(...))")
        if self._broken:
            raise ConfigError(self._broken)
        if self._forward is not None:  # the previous forward raised before its end
            self._rollback(self._forward)
        ids = arguments.get("input_ids")
        ref = ids if ids is not None else arguments.get("inputs_embeds")
        if not isinstance(ref, Tensor) or ref.dim() < 2:
            raise ConfigError("PagedCache needs input_ids [batch, q] or inputs_embeds")
        batch, q = int(ref.shape[0]), int(ref.shape[1])
        if self._batch is not None and batch != self._batch:
            if self._length:
                raise ConfigError(f"this cache holds {self._batch} sequence(s) but the forward "
                                  f"has batch size {batch}; build one cache per batch")
            for layer in self._paged:  # empty, but shaped for the old batch
                layer.reset()
        if isinstance(self._blocks, SessionBlocks) and batch != 1:
            raise ConfigError(f"a SessionStore cache holds one sequence; got batch size {batch}")
        fwd = Forward(self._length, self.stored_length, q)
        fwd.token_ids = ids
        fwd.special = [_tokens_seen(layer) for layer in self._special]
        if isinstance(self._blocks, SessionBlocks):
            self._blocks.check_tokens(fwd.start, ids)
        mask = None
        if self.token_policy is not None:
            mask = self._track_padding(fwd, batch, arguments)
        self._batch = batch
        self._forward = fwd
        return mask

    def _track_padding(self, fwd: Forward, batch: int, arguments: dict) -> Tensor | None:
        """Record the new tokens' validity and positions; remap the mask to the kept slots."""
        length, stored, q = fwd.start, fwd.stored, fwd.q
        device = self.spec.device
        mask = arguments.get("attention_mask")
        if mask is None:
            fwd.valid = torch.ones((batch, q), dtype=torch.bool, device=device)
        elif isinstance(mask, Tensor) and mask.dim() == 2 and tuple(mask.shape) == (
                batch, length + q):
            fwd.valid = mask[:, length:].to(device=device, dtype=torch.bool)
        else:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ConfigError(f"with token eviction the attention_mask must be the 2-D padding "
                              f"mask of the whole sequence, [batch, cached + new] = "
                              f"[{batch}, {length + q}], or None; got {got}")
        positions = arguments.get("position_ids")
        if positions is None:
            positions = torch.arange(length, length + q, device=device).expand(batch, q)
        elif not (isinstance(positions, Tensor) and positions.dim() == 2
                  and positions.shape[-1] == q):
            raise ConfigError("with token eviction position_ids must be [batch, q] or None")
        fwd.positions = positions.to(device).expand(batch, q)
        if stored == length:
            return None
        if self._head_granular:  # per-head validity: each layer's head_mask
            kept_valid = torch.ones((batch, stored), dtype=torch.bool, device=device)
        else:
            kept_valid = self._consistent_padding()
        if mask is None and bool(kept_valid.all()):
            return None
        remapped = (mask.clone() if mask is not None
                    else torch.ones((batch, length + q), dtype=torch.long, device=device))
        remapped[:, length - stored:length] = kept_valid.to(remapped.dtype)
        if mask is not None and torch.equal(remapped, mask):
            return None
        if self.spec.has_special_layers:
            raise ConfigError("padding that is not left padding, together with token eviction, "
                              "is supported only on models whose layers are all full attention")
        return remapped

    def _consistent_padding(self) -> Tensor:
        """The stored slots' validity ``[B, S]``, the same in every layer (`PolicyError`
        otherwise)."""
        kept_valid = self._paged[0].valid
        for layer in self._paged[1:]:
            if not torch.equal(layer.valid, kept_valid):
                raise PolicyError(f"{self.token_policy!r} kept different padding slots in "
                                  "different layers; keep every valid token and the newest "
                                  "invalid ones when a row has fewer valid tokens than budget")
        return kept_valid

    def check_update(self, layer: PagedLayer, keys: Tensor, values: Tensor) -> Forward:
        """The forward in flight, once ``layer``'s new ``keys`` / ``values`` are checked
        against it (called by `PagedLayer.update`); raises `ConfigError` otherwise."""
        fwd = self._forward
        if fwd is None:
            raise ConfigError("PagedCache.update was called outside a forward of the model it "
                              "was built for; pass the cache to that model's forward/generate")
        spec = self.spec
        if keys.dtype != spec.dtype or values.dtype != spec.dtype:
            raise ConfigError(f"layer {layer.layer_idx} produced {keys.dtype} keys / "
                              f"{values.dtype} values but the cache stores {spec.dtype}; "
                              "build the cache after casting the model")
        want = (self._batch, spec.num_kv_heads, fwd.q, spec.head_dim)
        if tuple(keys.shape) != want or tuple(values.shape) != want:
            raise ConfigError(f"layer {layer.layer_idx} keys/values have shapes "
                              f"{tuple(keys.shape)} / {tuple(values.shape)}, expected {want} "
                              "[batch, kv_heads, new tokens, head_dim]")
        if layer.seen != fwd.start:
            raise ConfigError(f"layer {layer.layer_idx} was updated twice in one forward")
        if keys.requires_grad and torch.is_grad_enabled():
            raise ConfigError("PagedCache is for inference; run under torch.no_grad()")
        return fwd

    def end_forward(self) -> None:
        """Close the forward: write its new slots through to the pool (called by the
        decoder's forward hook)."""
        fwd = self._forward
        if fwd is None:
            return
        paged = self._paged
        done = [layer.seen == fwd.start + fwd.q for layer in paged]
        if not any(done):  # the model ran without touching the cache
            self._forward = None
            return
        if not all(done):
            self._rollback(fwd)
            raise ConfigError("a forward updated only some of the full-attention layers; "
                              "PagedCache needs every layer to see every token")
        stored = paged[0].stored
        views = [(layer.keys, layer.values) for layer in paged]
        try:
            self._blocks.sync(views, fwd.dirty_from, stored, self._batch, fwd.token_ids)
        except BaseException:
            self._rollback(fwd)
            raise
        self._length = fwd.start + fwd.q
        self._forward = None

    def _rollback(self, fwd: Forward) -> None:
        """Undo a forward that did not finish: views back to their length before it."""
        self._forward = None
        if fwd.evicted:
            self._broken = ("a forward with token eviction failed midway; the evicted tokens "
                            "cannot be restored: call reset()")
        elif fwd.special != [_tokens_seen(layer) for layer in self._special]:
            self._broken = ("a forward failed midway after updating sliding-window or other "
                            "special layers, which cannot be rolled back: call reset()")
        if self._broken:
            raise ConfigError(self._broken)
        for layer in self._paged:
            layer.rewind(fwd.stored, fwd.start)
        if isinstance(self._blocks, PrivateBlocks):  # blocks allocated for the failed forward
            if fwd.stored:
                self._blocks.truncate(fwd.stored)
            else:
                self._blocks.release()

    def capture_queries(self, module: nn.Module, hidden: Tensor,
                        rope: tuple[Tensor, Tensor]) -> None:
        """Keep the queries an attention module computes from ``hidden`` in this forward
        (called by the attention modules' pre-hooks when `wants_queries`)."""
        fwd = self._forward
        if fwd is None or self._attention_modules.get(module.layer_idx) is not module:
            return
        count = fwd.q if self.attention_queries is None else min(fwd.q, self.attention_queries)
        with torch.no_grad():
            fwd.queries[module.layer_idx] = project_queries(module, hidden, rope, count)

    def head_plan(self, fwd: Forward) -> dict[int, list[int]]:
        """Each paged layer's per-kv-head kept counts after ``fwd`` (the policy's
        `head_counts` of the ``S + q`` slots it will store), computed once per forward, and
        ``fwd.width``, the most any head keeps: the slots every layer stores (called by
        `PagedLayer.update` for a head-granular policy)."""
        if fwd.head_counts is None:
            length = fwd.stored + fwd.q
            fwd.head_counts = {
                layer.layer_idx: head_counts_of(self.token_policy, layer.layer_idx, length,
                                                self.spec.num_kv_heads)
                for layer in self._paged}
            fwd.width = max(max(c) for c in fwd.head_counts.values())
        return fwd.head_counts

    def head_mask(self, module: nn.Module) -> Tensor | None:
        """The additive attention mask ``[B, Hq, q, S + q]`` (model dtype) of ``module``'s
        layer in the forward in flight, when a head-granular policy left some head of it an
        invalid slot (past its count, or padding); None otherwise (transformers' own mask is
        right). Query ``i`` of head ``h`` sees head ``h``'s valid stored slots and the valid
        new tokens up to itself. Called by the attention modules' pre-hook (`hooks.py`)."""
        fwd = self._forward
        if fwd is None or not self._head_granular:
            return None
        layer = self.layers[module.layer_idx]
        valid = layer.valid if isinstance(layer, PagedLayer) else None
        if valid is None or bool(valid.all()):
            return None
        batch, heads, stored = valid.shape
        q, device = fwd.q, valid.device
        causal = torch.ones((q, q), dtype=torch.bool, device=device).tril()
        new = (causal[None] & fwd.valid[:, None, :].to(device))[:, None]  # [B, 1, q, q]
        visible = torch.cat([valid[:, :, None, :].expand(batch, heads, q, stored),
                             new.expand(batch, heads, q, q)], dim=-1)
        visible = visible.repeat_interleave(self.spec.num_attention_heads // heads, dim=1)
        dtype = self.spec.dtype
        zeros = torch.zeros(visible.shape, dtype=dtype, device=device)
        return zeros.masked_fill(~visible, torch.finfo(dtype).min)

    def attention_scores(self, layer: PagedLayer, fwd: Forward, keys: Tensor,
                         valid: Tensor) -> Tensor:
        """Attention of ``layer``'s captured queries over ``keys`` (``valid`` slots only,
        ``[B, S]``, or ``[B, Hkv, S]`` per head), for a token policy that scores by attention
        (called by `PagedLayer.update`)."""
        queries = fwd.queries.pop(layer.layer_idx, None)
        if queries is None:
            raise ConfigError(f"no queries were captured for layer {layer.layer_idx}; the "
                              f"token policy {self.token_policy!r} needs attention modules with "
                              "q_proj, head_dim and layer_idx called with cache=")
        module = self._attention_modules[layer.layer_idx]
        scaling = getattr(module, "scaling", module.head_dim ** -0.5)
        return window_attention(queries, keys, valid, scaling)

    # -- the transformers Cache API --------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues beam ``beam_idx[i]``. Blocks are shared by ref
        count (copied only when a shared block is written next)."""
        rows = [int(i) for i in beam_idx.tolist()]
        if rows != list(range(len(rows))):
            self._take_rows(rows, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (rows share their blocks)."""
        rows = [r for r in range(self._batch or 0) for _ in range(repeats)]
        self._take_rows(rows, torch.tensor(rows, dtype=torch.long))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (a long tensor, or a bool mask over the rows)."""
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self._take_rows([int(i) for i in indices.tolist()], indices)

    def _take_rows(self, rows: list[int], index: Tensor) -> None:
        if self._forward is not None:
            raise ConfigError("cannot reorder the batch during a forward")
        if self._batch is None or not self._length:
            return
        if any(not 0 <= r < self._batch for r in rows):
            raise ConfigError(f"row indices must lie in [0, {self._batch}), got {rows}")
        self._blocks.take_rows(rows)
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                layer.take_rows(rows)
            elif len(rows) == self._batch:
                layer.reorder_cache(index)
            else:
                layer.batch_select_indices(index)
        if self.token_policy is not None:
            self.token_policy.reorder(torch.tensor(rows, dtype=torch.long))
        self._batch = len(rows)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (``crop(0)`` trims special layers only).

        Raises `ConfigError` for a positive argument (transformers 5 semantics) or a cache that
        is not croppable (see `is_croppable`)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) \
                or tokens_to_remove > 0:
            raise ConfigError(f"crop takes 0 or a negative number of tokens to remove, got "
                              f"{tokens_to_remove!r}")
        if tokens_to_remove < 0 and self.token_policy is not None:
            raise ConfigError("a cache with token eviction cannot be cropped: evicted tokens "
                              "cannot come back (is_croppable is False)")
        if tokens_to_remove < 0 and isinstance(self._blocks, SessionBlocks):
            self._blocks.truncate(0)  # raises: a turn's blocks are already shared
        for layer in self._special:  # first: a sliding layer may refuse
            layer.crop(tokens_to_remove)
        if tokens_to_remove < 0:
            length = max(0, self._length + tokens_to_remove)
            self._blocks.truncate(length)
            for layer in self._paged:
                layer.truncate(length)
            self._length = length

    def reset(self) -> None:
        """Forget every sequence: release the blocks, empty the layers, reset the policy."""
        if isinstance(self._blocks, SessionBlocks):
            raise ConfigError("a SessionStore cache cannot be reset; call "
                              "SessionStore.cache_for() for the next turn")
        self._blocks.release()
        for layer in self.layers:
            layer.reset()
        if self.token_policy is not None:
            self.token_policy.reset()
        self._batch, self._length, self._forward, self._broken = None, 0, None, None

    def close(self) -> None:
        """Release the blocks. A SessionStore turn is committed: its full blocks stay cached
        for later turns (evictable by the store's policy). Further use raises."""
        if self._closed:
            return
        self._blocks.release()
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        policy = "" if self.token_policy is None else f", token_policy={self.token_policy!r}"
        return (f"PagedCache(model={self.spec.model_name}, batch={self._batch}, "
                f"length={self._length}, stored={self.stored_length}{policy})")


# -- argument checks ---------------------------------------------------------------------------


def _tokens_seen(layer: Any) -> int:
    """Tokens a transformers layer has seen (0 for layers that do not count them)."""
    seen = getattr(layer, "get_seq_length", None)
    return seen() if seen is not None and getattr(layer, "is_initialized", False) else 0


def _optional_count(name: str, value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value <= 0):
        raise ConfigError(f"{name} must be a positive int or None, got {value!r}")
    return value


def _token_policy(policy: Any, budget: Any) -> tuple[TokenPolicy | None, int | None]:
    """The cache's token policy (built from a registered name if need be) and its budget."""
    if policy is None:
        if budget is not None:
            raise ConfigError("budget= needs a token_policy= (e.g. 'streamingllm')")
        return None, None
    if isinstance(policy, str):
        policy = make_token_policy(policy, budget=budget)
    elif not isinstance(policy, TokenPolicy):
        raise ConfigError(f"token_policy must be a kvevict.tokens.TokenPolicy or a registered "
                          f"name, got {type(policy).__name__}")
    budget = _optional_count("budget", budget)
    if budget is not None and budget != policy.budget:
        raise ConfigError(f"budget={budget} differs from the token policy's budget "
                          f"({policy.budget}); give one")
    policy.reset()
    return policy, policy.budget


def _checked_attention_modules(model: nn.Module, spec: ModelSpec,
                               policy: Any) -> dict[int, nn.Module]:
    modules = attention_modules(model.base_model)
    missing = [i for i in spec.paged_layers if i not in modules]
    if missing:
        raise ConfigError(f"token policy {policy!r} needs attention scores, which PagedCache "
                          f"recomputes from attention modules with q_proj, head_dim and "
                          f"layer_idx (Llama, Mistral, Qwen2/3 style); {spec.model_name} has "
                          f"none for layer(s) {missing}")
    return modules
