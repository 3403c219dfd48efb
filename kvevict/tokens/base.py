"""Token-level eviction: which tokens of one long sequence stay in an attention layer's cache.

This is the lossy kind of eviction (see the design notes): a `TokenPolicy` scores the tokens an
attention layer currently stores and keeps ``budget`` of them per sequence. It only ranks; the
caller (the Hugging Face adapter, the engine) gathers the kept keys and values. Only torch is
imported here, never transformers.

Shapes, for one layer of a batch of ``B`` sequences with ``Hkv`` key/value heads:

- ``keys`` / ``values``: ``[B, Hkv, T, D]`` as stored (keys after RoPE). ``values`` may have
  its own last dimension.
- ``positions``: integer ``[B, T]``, each stored token's original position in its sequence.
  Kept tokens keep their positions, so "sink" and "recent" are decided by position, not slot.
- ``valid``: bool ``[B, T]``; False marks padding or an empty slot. Invalid slots are always
  dropped first.
- ``attention``: None, or float ``[B, Hkv, Q, T]``: the softmax probabilities of the last ``Q``
  queries over the ``T`` stored keys, query heads averaged within each GQA group. Needed by the
  policies with ``needs_attention = True`` (H2O, SnapKV).

The selection is shared by all kv heads of a layer (per-head scores are averaged), so the
layer's cache stays rectangular: ``select`` returns ``[B, min(budget, T)]`` slot indices,
ascending per row. A row with fewer valid tokens than that keeps all of them, padded with its
invalid slots (the caller gathers ``valid`` with the same indices).

**Head-granular policies** (``granularity = "head"``, `kvevict.tokens.head_policies`) let each
kv head keep its own tokens and its own count. Keys are stored after RoPE, so any token can sit
in any slot of any head: ``positions`` and ``valid`` are then ``[B, Hkv, T]`` (each head's own
slots), ``head_counts(layer_idx, T, Hkv)`` says how many slots each head of a layer keeps, and
``select`` returns long ``[B, Hkv, W]`` with ``W`` the largest of those counts: head ``h``'s
first ``counts[h]`` entries are its kept slots, ascending and unique; its entries past that are
any slot indices (the caller gathers them and marks them invalid). The caller stores the layer
``W'`` slots wide (``W'``, the widest layer's ``W``, is the same for every layer of a store whose
blocks hold all layers) and masks each head's slots past its count out of attention
(`check_head_selection` validates what ``select`` returned and says which slots are live).

Ties are broken deterministically: equal scores keep the more recent token (larger position,
then later slot). NaN scores rank below every other valid token.

The heuristic policies are in `kvevict.tokens.heuristics`: ``streamingllm``
(`StreamingLLM`), ``h2o`` (`H2O`), ``snapkv`` (`SnapKV`) and ``knorm`` (`KeyNorm`); build them
with ``make_token_policy(name, budget=..., **params)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvevict.errors import ConfigError, PolicyError
from kvevict.registry import Registry

__all__ = [
    "TOKEN_POLICIES",
    "LayerState",
    "TokenPolicy",
    "available_token_policies",
    "check_head_selection",
    "check_int",
    "check_selection",
    "eager_attention",
    "head_counts_of",
    "make_token_policy",
    "newest",
    "oldest",
    "register_token_policy",
    "stored_kv",
    "window_attention",
]


# -- helpers ---------------------------------------------------------------------------------


def check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _order(valid: Tensor, keys: list[tuple[Tensor, bool]], *, newest_slot_first: bool) -> Tensor:
    """Per row, the slot indices sorted valid-first, then by ``keys`` (most significant first).

    Each key is ``(tensor [B, T], descending)``. The final tie-break is the slot index itself
    (later slots first when ``newest_slot_first``). Built by stable sorts from the least
    significant key to the most significant one.
    """
    batch, length = valid.shape
    order = torch.arange(length, device=valid.device).expand(batch, length)
    if newest_slot_first:
        order = order.flip(1)
    for values, descending in reversed([(valid.to(torch.uint8), True), *keys]):
        perm = torch.sort(values.gather(1, order), dim=1, descending=descending, stable=True)
        order = order.gather(1, perm.indices)
    return order


def _rank(order: Tensor) -> Tensor:
    """The inverse of `_order`: ``rank[b, slot]`` = where ``slot`` sits in row ``b``'s order."""
    batch, length = order.shape
    ranks = torch.arange(length, device=order.device).expand(batch, length)
    return torch.empty_like(order).scatter_(1, order, ranks)


def newest(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """Bool ``[B, T]``: each row's ``count`` valid tokens with the largest positions."""
    order = _order(valid, [(positions, True)], newest_slot_first=True)
    return (_rank(order) < count) & valid


def oldest(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """Bool ``[B, T]``: each row's ``count`` valid tokens with the smallest positions."""
    order = _order(valid, [(positions, False)], newest_slot_first=False)
    return (_rank(order) < count) & valid


# -- the protocol ----------------------------------------------------------------------------


class TokenPolicy(abc.ABC):
    """Base of token-level policies: score the stored tokens of a layer, keep ``budget``.

    A subclass implements `score`; `select` (valid-first, top ``budget`` by score, ties to the
    more recent token, returned ascending) is shared. A stateful policy (H2O) overrides `reset`,
    `reorder` and extends `select` so that its state follows the kept tokens.

    A complete policy that keeps the tokens with the largest value norms::

        @register_token_policy("vnorm")
        class ValueNorm(TokenPolicy):
            def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
                self._check(layer_idx, keys, values, positions, valid, attention)
                return self._mask(values.float().norm(dim=-1).mean(dim=1), valid)

    Args:
        budget: tokens kept per sequence per layer (>= 1).
    """

    #: Registry name, set by `register_token_policy`.
    name: ClassVar[str] = ""
    #: True when `score` / `select` need the ``attention`` argument.
    needs_attention: ClassVar[bool] = False
    #: ``"layer"``: one selection per layer, shared by its kv heads (``select`` returns
    #: ``[B, count]``); ``"head"``: each kv head keeps its own slots (``select`` returns
    #: ``[B, Hkv, W]``, positions and validity are ``[B, Hkv, T]``; see `head_counts`).
    granularity: ClassVar[str] = "layer"
    #: True when `store_kv` changes the K/V the cache stores (MoE-nD's quantization).
    transforms_kv: ClassVar[bool] = False

    def __init__(self, budget: int) -> None:
        self.budget = check_int("budget", budget, minimum=1)

    def reset(self) -> None:
        """Forget accumulated state (a new sequence, or the cache was cropped). No-op here."""

    def reorder(self, batch_indices: Tensor) -> None:
        """Follow a reordering of the batch rows (beam search): row ``i`` becomes the old row
        ``batch_indices[i]``. No-op for stateless policies."""

    def store_kv(self, layer_idx: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """What the cache stores for the K/V ``[..., D]`` (``[B, Hkv, q, D]``) a forward just
        computed in ``layer_idx``: unchanged here. With ``transforms_kv`` the caller stores what
        this returns, once per token, and every later forward reads it (the forward that
        computed them attends to them as computed, as transformers' ``QuantizedCache`` does): it
        must treat each token and head on its own (no group spans tokens), depend on nothing
        but the layer, and keep shapes and dtypes."""
        return keys, values

    def head_counts(self, layer_idx: int, length: int, kv_heads: int) -> list[int]:
        """How many of ``length`` stored slots each of the ``kv_heads`` heads of ``layer_idx``
        keeps (each in ``[1, length]``, 0 when empty): every head ``min(budget, length)`` here. A
        head-granular policy may give heads, and layers, different counts (LKV-H)."""
        return [min(self.budget, length)] * kv_heads

    @abc.abstractmethod
    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        """Float ``[B, T]``: how much each stored token is worth keeping (higher = keep).

        ``valid`` (optional, bool ``[B, T]``, default all True) lets a policy that reasons about
        "the first" or "the most recent" tokens ignore padding; invalid slots score ``-inf``.
        """

    def select(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor, attention: Tensor | None = None) -> Tensor:
        """The slots to keep: long ``[B, min(budget, T)]``, ascending and unique per row.

        Invalid slots go first; then the lowest scores; equal scores drop the older token.
        """
        batch, _, length, _ = self._check(layer_idx, keys, values, positions, valid, attention)
        scores = self.score(layer_idx, keys, values, positions, attention, valid=valid)
        if not isinstance(scores, Tensor) or _shape(scores) != (batch, length):
            got = _shape(scores) if isinstance(scores, Tensor) else type(scores).__name__
            raise PolicyError(f"{type(self).__name__}.score returned {got}, "
                              f"expected a tensor of shape {(batch, length)}")
        scores = scores.float().nan_to_num(nan=-torch.inf)
        order = _order(valid, [(scores, True), (positions, True)], newest_slot_first=True)
        kept = min(self.budget, length)
        return order[:, :kept].sort(dim=1).values

    # -- validation, shared by subclasses --------------------------------------------------

    def _check(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor | None, attention: Tensor | None) -> tuple[int, int, int, int]:
        """Validate the arguments of `score` / `select`; return ``(B, Hkv, T, D)``."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ConfigError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        if not isinstance(keys, Tensor) or keys.dim() != 4 or not keys.is_floating_point():
            raise ConfigError("keys must be a float tensor of shape [B, Hkv, T, D], got "
                              f"{_describe(keys)}")
        batch, heads, length, dim = keys.shape
        if (not isinstance(values, Tensor) or values.dim() != 4
                or _shape(values)[:3] != (batch, heads, length)):
            raise ConfigError(f"values must have shape [B, Hkv, T, Dv] = [{batch}, {heads}, "
                              f"{length}, Dv] like keys, got {_describe(values)}")
        rows, names = ((batch, length), "[B, T]") if self.granularity == "layer" else (
            (batch, heads, length), "[B, Hkv, T]")
        if (not isinstance(positions, Tensor) or _shape(positions) != rows
                or positions.is_floating_point() or positions.dtype == torch.bool
                or positions.is_complex()):
            raise ConfigError(f"positions must be an integer tensor of shape {names} = "
                              f"{list(rows)}, got {_describe(positions)}")
        if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                                  or _shape(valid) != rows):
            raise ConfigError(f"valid must be a bool tensor of shape {names} = {list(rows)}, "
                              f"got {_describe(valid)}")
        if attention is None:
            if self.needs_attention:
                raise ConfigError(f"policy {self.name or type(self).__name__!r} needs "
                                  "attention: pass the softmax probabilities [B, Hkv, Q, T] of "
                                  "the last Q queries (eager attention)")
        elif (not isinstance(attention, Tensor) or attention.dim() != 4
              or not attention.is_floating_point()
              or _shape(attention)[:2] != (batch, heads) or attention.shape[3] != length
              or attention.shape[2] < 1):
            raise ConfigError(f"attention must be a float tensor of shape [B, Hkv, Q, T] = "
                              f"[{batch}, {heads}, Q>=1, {length}], got {_describe(attention)}")
        return batch, heads, length, dim

    @staticmethod
    def _mask(scores: Tensor, valid: Tensor | None) -> Tensor:
        """``scores`` with invalid slots set to ``-inf``."""
        return scores if valid is None else scores.masked_fill(~valid, -torch.inf)

    @staticmethod
    def _all_valid(positions: Tensor, valid: Tensor | None) -> Tensor:
        return torch.ones_like(positions, dtype=torch.bool) if valid is None else valid

    def _params(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}(budget={self.budget}{extra})"


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"{value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__}"


def stored_kv(policy: TokenPolicy, layer_idx: int, keys: Tensor,
              values: Tensor) -> tuple[Tensor, Tensor]:
    """``policy.store_kv(layer_idx, keys, values)``, checked: the same shapes and dtypes
    back, else `PolicyError`."""
    got = policy.store_kv(layer_idx, keys, values)
    if (not isinstance(got, tuple) or len(got) != 2
            or any(not isinstance(t, Tensor) or t.shape != ref.shape or t.dtype != ref.dtype
                   for t, ref in zip(got, (keys, values), strict=False))):
        raise PolicyError(f"{policy!r}.store_kv must return (keys, values) shaped and typed as "
                          f"given, {tuple(keys.shape)} {keys.dtype} and {tuple(values.shape)} "
                          f"{values.dtype}")
    return got


class LayerState(abc.ABC):
    """The state of a token policy that keeps one tensor per layer, batch rows first, aligned
    with the stored slots (`kvevict.tokens.heuristics.H2O`'s accumulated attention,
    `kvevict.tokens.head_policies.EMAHeads`' per-head EMA). Put it before the `TokenPolicy`
    base: it supplies `reset` (forget every layer), `reorder` (follow a beam reorder of the
    rows), `accumulated` (a copy of a layer's state) and `select`: the base policy's
    selection, then the layer's state folded with this call's attention (the subclass's
    ``_accumulate``, pure) and kept for the selected slots only. The subclass's ``__init__``
    sets ``self._state = {}``."""

    _state: dict[int, Tensor]

    @abc.abstractmethod
    def _accumulate(self, layer_idx: int, attention: Tensor) -> Tensor:
        """The layer's state grown to the ``T`` stored slots and folded with ``attention``
        (pure: the state is kept by `select`)."""

    def select(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor, attention: Tensor | None = None) -> Tensor:
        """Select as the base policy does, then keep the state of the selected slots only."""
        kept = super().select(layer_idx, keys, values, positions, valid,  # type: ignore[misc]
                              attention)
        assert attention is not None  # a stateful policy needs attention (_check raised)
        state = self._accumulate(layer_idx, attention)
        self._state[layer_idx] = state.gather(-1, kept.to(state.device))
        return kept

    def reset(self) -> None:
        """Forget every layer's state (a new sequence, or the cache was cropped)."""
        self._state.clear()

    def reorder(self, batch_indices: Tensor) -> None:
        """Row ``i`` of every layer's state becomes the old row ``batch_indices[i]``."""
        for layer_idx, state in self._state.items():
            idx = batch_indices.to(device=state.device, dtype=torch.long)
            self._state[layer_idx] = state.index_select(0, idx)

    def accumulated(self, layer_idx: int) -> Tensor | None:
        """The state of a layer's kept slots (``[B, T]``, or ``[B, Hkv, T]`` per head), or
        None (a copy)."""
        state = self._state.get(layer_idx)
        return None if state is None else state.clone()


# -- what a head-granular select returns -------------------------------------------------


def head_counts_of(policy: TokenPolicy, layer_idx: int, length: int, kv_heads: int) -> list[int]:
    """``policy.head_counts(layer_idx, length, kv_heads)``, checked: one int in
    ``[1, length]`` per kv head (0 for an empty layer), else `PolicyError`."""
    counts = policy.head_counts(layer_idx, length, kv_heads)
    least = min(1, length)
    if (not isinstance(counts, (list, tuple)) or len(counts) != kv_heads
            or any(isinstance(n, bool) or not isinstance(n, int) or not least <= n <= length
                   for n in counts)):
        raise PolicyError(f"{policy!r}.head_counts({layer_idx}, {length}, {kv_heads}) returned "
                          f"{counts!r}; expected {kv_heads} ints in [{least}, {length}]")
    return list(counts)


def check_selection(policy: TokenPolicy, kept: Any, batch: int, count: int,
                    length: int) -> Tensor:
    """Check what a layer-granular ``select`` returned for a layer of ``length`` stored slots
    keeping ``count``: long ``[B, count]``, and, when it drops slots (``count < length``),
    ascending and unique per row; otherwise `PolicyError`. Returns ``kept``."""
    if (not isinstance(kept, Tensor) or tuple(kept.shape) != (batch, count)
            or kept.dtype != torch.long):
        got = tuple(kept.shape) if isinstance(kept, Tensor) else type(kept).__name__
        raise PolicyError(f"{policy!r}.select returned {got}; expected a long tensor of "
                          f"shape {(batch, count)}")
    if 1 < count < length and not bool((kept[:, 1:] > kept[:, :-1]).all()):
        raise PolicyError(f"{policy!r}.select must return slot indices ascending and "
                          "unique per row")
    return kept


def check_head_selection(policy: TokenPolicy, kept: Any, batch: int, counts: Sequence[int],
                         length: int, width: int) -> tuple[Tensor, Tensor]:
    """Check what a head-granular ``select`` returned for one layer of ``length`` slots, and
    widen it to the store's ``width`` (at least ``max(counts)``).

    ``kept`` must be long ``[B, Hkv, max(counts)]`` with slot indices in ``[0, length)``, head
    ``h``'s first ``counts[h]`` ascending and unique; otherwise `PolicyError`. Returns the
    slots to gather, long ``[B, Hkv, width]`` (each head's row padded with its last entry), and
    which of them are live, bool ``[Hkv, width]`` (``j < counts[h]``): the others are masked
    out of attention."""
    heads, widest = len(counts), max(counts)
    if (not isinstance(kept, Tensor) or kept.dtype != torch.long
            or _shape(kept) != (batch, heads, widest)):
        got = _shape(kept) if isinstance(kept, Tensor) else type(kept).__name__
        raise PolicyError(f"{policy!r}.select returned {got}; expected a long tensor of shape "
                          f"{(batch, heads, widest)} (per kv head, its {list(counts)} kept slots)")
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= length):
        raise PolicyError(f"{policy!r}.select returned slot indices outside [0, {length})")
    live = (torch.arange(width, device=kept.device)[None, :]
            < torch.tensor(list(counts), device=kept.device)[:, None])
    if widest > 1 and not bool(((kept[..., 1:] > kept[..., :-1])
                                | ~live[None, :, 1:widest]).all()):
        raise PolicyError(f"{policy!r}.select must return each head's kept slots ascending and "
                          "unique")
    if width > widest:
        kept = torch.cat([kept, kept[..., -1:].expand(batch, heads, width - widest)], dim=-1)
    return kept, live


# -- the attention a policy is given --------------------------------------------------------


def window_attention(queries: Tensor, keys: Tensor, valid: Tensor, scaling: float) -> Tensor:
    """Softmax attention of the last queries over a layer's stored keys, per kv head.

    Args:
        queries: ``[B, Hq, W, D]``, the last ``W`` queries of this forward.
        keys: ``[B, Hkv, T, D]`` stored keys, this forward's new ones last (at least ``W``).
        valid: bool ``[B, T]``, or ``[B, Hkv, T]`` for a head-granular store (each head's own
            slots); invalid (padding, or past a head's count) slots get no attention.
        scaling: the softmax temperature of the model (``head_dim ** -0.5`` usually).

    Returns:
        float32 ``[B, Hkv, W, T]``: query ``i`` (slot ``T - W + i``) sees every valid slot up
        to its own (causal), query heads averaged within each GQA group. A query that sees no
        valid slot (a padding query) gets a row of zeros.
    """
    batch, q_heads, window, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    q = queries.float().reshape(batch, kv_heads, group * window, dim)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scaling
    logits = logits.view(batch, kv_heads, group, window, length)
    last_visible = length - window + torch.arange(window, device=keys.device)  # own slot
    causal = torch.arange(length, device=keys.device)[None, :] <= last_visible[:, None]
    per_head = valid[:, :, None, None, :] if valid.dim() == 3 else valid[:, None, None, None, :]
    visible = causal[None, None, None] & per_head
    probs = torch.softmax(logits.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num(0.0)
    return probs.mean(dim=2)


def eager_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None = None,
                    scaling: float | None = None) -> tuple[Tensor, Tensor]:
    """Softmax attention as transformers' eager kernel computes it, with grouped kv heads.

    ``query`` ``[B, Hq, Tq, D]``, ``key`` / ``value`` ``[B, Hkv, Tk, D]``, ``bias`` added to the
    logits (a float mask, broadcastable to ``[B, Hq, Tq, Tk]``), ``scaling`` default
    ``D ** -0.5``. Returns the output ``[B, Tq, Hq, Dv]`` and the weights, as an attention
    function registered with transformers returns them."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    logits = torch.matmul(query, k.transpose(2, 3)) * scale
    if bias is not None:
        logits = logits + bias
    weights = torch.softmax(logits.float(), dim=-1).to(query.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous(), weights


# -- registry ----------------------------------------------------------------------------------

#: The registry of token policies (the same generic `kvevict.registry.Registry` as the
#: residency policies').
TOKEN_POLICIES: Registry[TokenPolicy] = Registry("token policy", TokenPolicy)


def register_token_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a token policy constructible as ``make_token_policy(name, ...)``."""
    return TOKEN_POLICIES.register(name)


def available_token_policies() -> list[str]:
    """Names accepted by `make_token_policy`, sorted."""
    return TOKEN_POLICIES.names()


def make_token_policy(name: str | TokenPolicy, budget: int | None = None,
                      **params: Any) -> TokenPolicy:
    """Build a registered token policy, e.g. ``make_token_policy("snapkv", budget=256)``.

    A `TokenPolicy` instance is returned as is (then ``budget`` and ``params`` must be absent).
    """
    if isinstance(name, TokenPolicy):
        if budget is not None or params:
            raise ConfigError("budget or parameters were given together with a policy instance")
        return name
    TOKEN_POLICIES.get(name)  # an unknown name is reported before a missing budget
    if budget is None:
        raise ConfigError(f"token policy {name!r} needs a budget (tokens kept per sequence "
                          "per layer), e.g. budget=256")
    return TOKEN_POLICIES.make(name, budget, **params)


