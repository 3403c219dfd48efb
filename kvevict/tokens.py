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

Ties are broken deterministically: equal scores keep the more recent token (larger position,
then later slot). NaN scores rank below every other valid token.

Policies: ``streamingllm`` (`StreamingLLM`), ``h2o`` (`H2O`), ``snapkv`` (`SnapKV`) and
``knorm`` (`KeyNorm`); build them with ``make_token_policy(name, budget=..., **params)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvevict.errors import ConfigError, PolicyError
from kvevict.registry import Registry

__all__ = [
    "H2O",
    "TOKEN_POLICIES",
    "KeyNorm",
    "SnapKV",
    "StreamingLLM",
    "TokenPolicy",
    "available_token_policies",
    "make_token_policy",
    "register_token_policy",
]


# -- helpers ---------------------------------------------------------------------------------


def _check_int(name: str, value: Any, *, minimum: int) -> int:
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


def _newest(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """Bool ``[B, T]``: each row's ``count`` valid tokens with the largest positions."""
    order = _order(valid, [(positions, True)], newest_slot_first=True)
    return (_rank(order) < count) & valid


def _oldest(positions: Tensor, valid: Tensor, count: int) -> Tensor:
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

    def __init__(self, budget: int) -> None:
        self.budget = _check_int("budget", budget, minimum=1)

    def reset(self) -> None:
        """Forget accumulated state (a new sequence, or the cache was cropped). No-op here."""

    def reorder(self, batch_indices: Tensor) -> None:
        """Follow a reordering of the batch rows (beam search): row ``i`` becomes the old row
        ``batch_indices[i]``. No-op for stateless policies."""

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
        if (not isinstance(positions, Tensor) or _shape(positions) != (batch, length)
                or positions.is_floating_point() or positions.dtype == torch.bool
                or positions.is_complex()):
            raise ConfigError(f"positions must be an integer tensor of shape [B, T] = "
                              f"[{batch}, {length}], got {_describe(positions)}")
        if valid is not None and (not isinstance(valid, Tensor) or valid.dtype != torch.bool
                                  or _shape(valid) != (batch, length)):
            raise ConfigError(f"valid must be a bool tensor of shape [B, T] = [{batch}, "
                              f"{length}], got {_describe(valid)}")
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


# -- the policies --------------------------------------------------------------------------


@register_token_policy("streamingllm")
class StreamingLLM(TokenPolicy):
    """Attention sinks plus a recent window (StreamingLLM).

    Keeps the ``n_sink`` valid tokens with the smallest positions (the "attention sinks") and
    fills the rest of the budget with the most recent tokens: a window of
    ``budget - n_sink``. Scores: sinks ``+inf``, every other token its position.

    Source: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
    arXiv:2309.17453), which keeps 4 sink tokens; kvpress ``StreamingLLMPress`` (``n_sink=4``,
    scores 1 for the sinks and the kept window, 0 for the pruned middle). Kept tokens keep their
    original positions here (kvpress's ``KeyRerotationPress`` would re-rotate them).

    Args:
        budget: tokens kept per sequence per layer.
        n_sink: sink tokens kept at the start, ``0 <= n_sink < budget``. Default 4.
    """

    def __init__(self, budget: int, n_sink: int = 4) -> None:
        super().__init__(budget)
        self.n_sink = _check_int("n_sink", n_sink, minimum=0)
        if self.n_sink >= self.budget:
            raise ConfigError(f"n_sink ({n_sink}) must be smaller than budget ({budget}) to "
                              "leave room for the recent window")

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        sinks = _oldest(positions, self._all_valid(positions, valid), self.n_sink)
        scores = positions.float().masked_fill(sinks, torch.inf)
        return self._mask(scores, valid)

    def _params(self) -> dict[str, Any]:
        return {"n_sink": self.n_sink}


@register_token_policy("knorm")
class KeyNorm(TokenPolicy):
    """Keep the tokens whose keys have the lowest L2 norm.

    Score: ``-||k||_2``, averaged over the kv heads (computed in float32).

    Source: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
    Compression" (EMNLP 2024, arXiv:2406.11430): a low key norm goes with high attention;
    kvpress ``KnormPress`` scores ``-keys.norm(dim=-1)``. kvpress keeps per head; here the
    per-head scores are averaged so a layer keeps the same tokens in every head.

    Args:
        budget: tokens kept per sequence per layer.
    """

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        return self._mask(-keys.float().norm(dim=-1).mean(dim=1), valid)


@register_token_policy("h2o")
class H2O(TokenPolicy):
    """Heavy hitters (accumulated attention) plus a recent window (H2O).

    Each token's score is the attention it has received, summed over every query seen so far
    (all calls of this layer), averaged over the kv heads. The ``n_recent`` most recent valid
    tokens are always kept (score ``+inf``); the rest of the budget goes to the heaviest
    hitters.

    **State.** The accumulated attention is kept per layer, aligned with the stored slots.
    Call `select` exactly once per forward pass of a layer, with that pass's attention, even
    when nothing needs pruning (it then returns every slot): `select` adds the attention to the
    state and then *keeps only the selected slots* of the state, so the caller must keep exactly
    those slots of its cache. Slots appended since the previous call (``T`` grew) start at
    zero. `score` is pure: it previews the accumulated score with ``attention`` added and
    changes nothing. `reset` forgets everything (new sequence, crop); `reorder` follows a
    reordering of the batch rows (beam search). A stored length that shrank without a
    `select`, or a changed batch size, raises `ConfigError`.

    Source: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models" (NeurIPS 2023, arXiv:2306.14048); the reference ``H2OKVCache_LayerWise``
    (FMInference/H2O, ``h2o_hf/utils_real_drop/modify_llama.py``) sums attention over queries,
    zero-initialises new tokens, keeps ``recent_size`` recent tokens plus the top ``hh_size``
    of the rest, and uses equal heavy and recent ratios. kvpress ``ObservedAttentionPress`` is
    the prefill-only variant (it divides by the number of queries that saw each token).

    Args:
        budget: tokens kept per sequence per layer.
        n_recent: recent tokens always kept, ``0 <= n_recent <= budget``. Default
            ``budget // 2`` (equal heavy and recent shares, as in the paper).
    """

    needs_attention: ClassVar[bool] = True

    def __init__(self, budget: int, n_recent: int | None = None) -> None:
        super().__init__(budget)
        if n_recent is None:
            n_recent = self.budget // 2
        self.n_recent = _check_int("n_recent", n_recent, minimum=0)
        if self.n_recent > self.budget:
            raise ConfigError(f"n_recent ({n_recent}) must be at most budget ({budget})")
        self._acc: dict[int, Tensor] = {}

    def reset(self) -> None:
        self._acc.clear()

    def reorder(self, batch_indices: Tensor) -> None:
        for layer_idx, acc in self._acc.items():
            idx = batch_indices.to(device=acc.device, dtype=torch.long)
            self._acc[layer_idx] = acc.index_select(0, idx)

    def accumulated(self, layer_idx: int) -> Tensor | None:
        """The accumulated attention ``[B, T]`` of a layer's kept slots, or None (a copy)."""
        acc = self._acc.get(layer_idx)
        return None if acc is None else acc.clone()

    def _accumulate(self, layer_idx: int, attention: Tensor) -> Tensor:
        """State of ``layer_idx`` grown to ``T`` slots, plus this call's attention (pure)."""
        batch, _, _, length = attention.shape
        received = attention.float().sum(dim=2).mean(dim=1)  # [B, T]
        acc = self._acc.get(layer_idx)
        if acc is None:
            return received
        if acc.shape[0] != batch:
            raise ConfigError(f"H2O layer {layer_idx} holds state for batch size {acc.shape[0]}"
                              f", got {batch}; call reset() for a new batch or reorder() "
                              "after a beam reorder")
        if acc.shape[1] > length:
            raise ConfigError(f"H2O layer {layer_idx} holds state for {acc.shape[1]} stored "
                              f"tokens but got T={length}: the cache shrank without select(); "
                              "call reset() after a crop")
        return received + F.pad(acc.to(received.device), (0, length - acc.shape[1]))

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        assert attention is not None  # _check raised otherwise
        scores = self._accumulate(layer_idx, attention)
        recent = _newest(positions, self._all_valid(positions, valid), self.n_recent)
        return self._mask(scores.masked_fill(recent, torch.inf), valid)

    def select(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor, attention: Tensor | None = None) -> Tensor:
        """Select as the base class does, then keep the state of the selected slots only."""
        kept = super().select(layer_idx, keys, values, positions, valid, attention)
        assert attention is not None
        acc = self._accumulate(layer_idx, attention)
        self._acc[layer_idx] = acc.gather(1, kept.to(acc.device))
        return kept

    def _params(self) -> dict[str, Any]:
        return {"n_recent": self.n_recent}


@register_token_policy("snapkv")
class SnapKV(TokenPolicy):
    """Observation-window voting with 1-D pooling (SnapKV).

    The last ``w = min(window_size, Q)`` queries vote: each stored token gets the mean attention
    those queries give it, averaged over the kv heads. The window's own tokens (the ``w`` most
    recent valid tokens) are always kept (score ``+inf``), so the votes they receive are set to
    zero before pooling (kvpress slices them off). The other votes are smoothed by a 1-D
    pooling along the stored tokens (kernel ``kernel_size``, stride 1, zero padding
    ``kernel_size // 2``), so the neighbours of a strongly attended token are kept with it.
    The rest of the budget goes to the top scores.

    Pooling runs per kv head before the head average (as kvpress pools before its GQA-group
    average), over slots in storage order with window and invalid slots counted as zero.
    SnapKV is stateless: it is meant for the end of a prefill, where ``Q >= window_size``.

    Source: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS
    2024, arXiv:2404.14469); FasterDecoding/SnapKV ``snapkv_utils.py`` (``SnapKVCluster``:
    window 32 in its model patches, kernel 5, ``avgpool`` or ``maxpool``, requires
    capacity > window) and kvpress ``SnapKVPress`` (window 64, kernel 5, average pooling,
    mean over the window queries, scores averaged per GQA group).

    Args:
        budget: tokens kept per sequence per layer.
        window_size: observation window, ``1 <= window_size < budget``. Default 32.
        kernel_size: pooling kernel, odd and >= 1 (1: no pooling). Default 5.
        pooling: ``"avg"`` (default) or ``"max"``.
    """

    needs_attention: ClassVar[bool] = True
    POOLINGS: ClassVar[tuple[str, ...]] = ("avg", "max")

    def __init__(self, budget: int, window_size: int = 32, kernel_size: int = 5,
                 pooling: str = "avg") -> None:
        super().__init__(budget)
        self.window_size = _check_int("window_size", window_size, minimum=1)
        if self.window_size >= self.budget:
            raise ConfigError(f"window_size ({window_size}) must be smaller than budget "
                              f"({budget}); pass a smaller window_size")
        self.kernel_size = _check_int("kernel_size", kernel_size, minimum=1)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be odd (the pooled length must stay T), "
                              f"got {kernel_size}")
        if pooling not in self.POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(self.POOLINGS)}, "
                              f"got {pooling!r}")
        self.pooling = pooling

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        _, _, length, _ = self._check(layer_idx, keys, values, positions, valid, attention)
        assert attention is not None  # _check raised otherwise
        valid = self._all_valid(positions, valid)
        window = _newest(positions, valid, min(self.window_size, attention.shape[2]))
        votes = attention[:, :, -self.window_size:, :].float().mean(dim=2)  # [B, Hkv, T]
        votes = votes.masked_fill((window | ~valid).unsqueeze(1), 0.0)
        if self.kernel_size > 1 and length > 0:
            pad = self.kernel_size // 2
            flat = votes.flatten(0, 1).unsqueeze(1)  # [B*Hkv, 1, T]
            if self.pooling == "avg":
                flat = F.avg_pool1d(flat, self.kernel_size, stride=1, padding=pad)
            else:  # max_pool1d pads with -inf; votes are >= 0, so zero padding is the same
                flat = F.max_pool1d(F.pad(flat, (pad, pad)), self.kernel_size, stride=1)
            votes = flat.view_as(votes)
        scores = votes.mean(dim=1).masked_fill(window, torch.inf)
        return self._mask(scores, valid)

    def _params(self) -> dict[str, Any]:
        return {"window_size": self.window_size, "kernel_size": self.kernel_size,
                "pooling": self.pooling}
