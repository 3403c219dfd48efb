"""The training-free token policies: StreamingLLM, KeyNorm, H2O and SnapKV.

Each keeps ``budget`` tokens per sequence per layer by its own score; the protocol, the shared
selection and the registry are in `kvevict.tokens.base`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import (
    LayerState,
    TokenPolicy,
    check_int,
    newest,
    oldest,
    register_token_policy,
)

__all__ = ["H2O", "KeyNorm", "SnapKV", "StreamingLLM"]


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
        self.n_sink = check_int("n_sink", n_sink, minimum=0)
        if self.n_sink >= self.budget:
            raise ConfigError(f"n_sink ({n_sink}) must be smaller than budget ({budget}) to "
                              "leave room for the recent window")

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        sinks = oldest(positions, self._all_valid(positions, valid), self.n_sink)
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
class H2O(LayerState, TokenPolicy):
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
        self.n_recent = check_int("n_recent", n_recent, minimum=0)
        if self.n_recent > self.budget:
            raise ConfigError(f"n_recent ({n_recent}) must be at most budget ({budget})")
        self._state: dict[int, Tensor] = {}  # per layer, the accumulated attention [B, T]

    def _accumulate(self, layer_idx: int, attention: Tensor) -> Tensor:
        """State of ``layer_idx`` grown to ``T`` slots, plus this call's attention (pure)."""
        batch, _, _, length = attention.shape
        received = attention.float().sum(dim=2).mean(dim=1)  # [B, T]
        acc = self._state.get(layer_idx)
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
        recent = newest(positions, self._all_valid(positions, valid), self.n_recent)
        return self._mask(scores.masked_fill(recent, torch.inf), valid)

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
        self.window_size = check_int("window_size", window_size, minimum=1)
        if self.window_size >= self.budget:
            raise ConfigError(f"window_size ({window_size}) must be smaller than budget "
                              f"({budget}); pass a smaller window_size")
        self.kernel_size = check_int("kernel_size", kernel_size, minimum=1)
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
        window = newest(positions, valid, min(self.window_size, attention.shape[2]))
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
