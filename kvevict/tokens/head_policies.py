"""Head-granular token policies through `make_token_policy`: ``ema_heads`` and ``lkv_h``.

`kvevict.tokens.heads` holds the methods (the heads' attention EMA, LKV-H's learned budgets,
`allocate`, `select_heads`); this module makes them `TokenPolicy` objects with
``granularity = "head"`` (the protocol is in `kvevict.tokens.base`), so they run wherever a
token policy runs: `kvevict.adapters.hf.PagedCache` in ``generate()`` and the engine's
``token_policy=``, evicting at every forward, not once after a prefill as
`kvevict.adapters.hf.heads.HeadCache` does.

Each kv head ranks its own ``T`` stored slots (``positions`` / ``valid`` ``[B, Hkv, T]``):

- `HeadTokenPolicy.select`: per head, the ``n_recent`` newest valid tokens score ``+inf``,
  invalid slots ``-inf`` (NaN scores rank just above them), then `select_heads` keeps each
  head's top ``head_counts(...)[h]`` (ties to the later slot) and returns ``[B, Hkv, W]``,
  ``W = max(counts)``, each head's row padded with its last kept slot.
- ``ema_heads`` (`EMAHeads`): every head keeps ``min(budget, T)`` slots by its own EMA of the
  attention its queries gave them.
- ``lkv_h`` (`LKVHeads`): head ``(l, h)`` keeps ``counts[l, h]`` slots, `allocate` over the
  learned shares with retention ``min(1, budget / T)``: the counts sum to
  ``budget · layers · kv_heads`` (``T · layers · kv_heads`` under the budget), each in
  ``[1, T]``; each head ranks its slots by its own learned `KVScorer`.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvevict.errors import ConfigError, PolicyError
from kvevict.tokens.base import (
    LayerState,
    TokenPolicy,
    check_int,
    head_counts_of,
    newest,
    register_token_policy,
)
from kvevict.tokens.heads import (
    DEFAULT_DECAY,
    HeadBudgets,
    allocate,
    check_decay,
    ema_attention,
    load_budgets,
    select_heads,
)
from kvevict.tokens.learned import N_RECENT, KVScorer, ScorerShape, load_scorer

__all__ = ["EMAHeads", "HeadTokenPolicy", "LKVHeads"]


class HeadTokenPolicy(TokenPolicy):
    """Base of head-granular token policies: each kv head keeps its own top-scored slots.

    A subclass implements `score` (float ``[B, Hkv, T]``, higher = keep) and may override
    `head_counts` (default: ``min(budget, T)`` for every head).

    Args:
        budget: tokens kept per sequence per layer and kv head (on average, for policies whose
            heads keep different counts).
        n_recent: the newest valid tokens each head always keeps (at most ``budget``).
    """

    granularity: ClassVar[str] = "head"

    def __init__(self, budget: int, n_recent: int = 0) -> None:
        super().__init__(budget)
        self.n_recent = min(check_int("n_recent", n_recent, minimum=0), self.budget)
        self._allocation: tuple[Tensor, int, list[list[int]]] | None = None

    def allocated(self, shares: Tensor, length: int) -> list[list[int]]:
        """`allocate` over ``shares`` (``[L, H]``) at retention ``min(1, budget / length)`` for
        ``length`` (>= 1) stored slots: counts summing to ``budget · L · H`` (all of them under
        the budget), each at most ``length``; computed once per (shares, length): every layer
        asks with the policy's own shares."""
        cached = self._allocation
        if cached is None or cached[0] is not shares or cached[1] != length:
            counts = allocate(shares, min(1.0, self.budget / length), length)
            cached = self._allocation = (shares, length, counts.tolist())
        return cached[2]

    @abc.abstractmethod
    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        """Float ``[B, Hkv, T]``: how much each head wants to keep each of its slots."""

    def select(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
               valid: Tensor, attention: Tensor | None = None) -> Tensor:
        """Per kv head its kept slots: long ``[B, Hkv, max(counts)]`` (see the module
        docstring)."""
        batch, heads, length, _ = self._check(layer_idx, keys, values, positions, valid,
                                              attention)
        counts = head_counts_of(self, layer_idx, length, heads)
        scores = self.score(layer_idx, keys, values, positions, attention, valid=valid)
        if not isinstance(scores, Tensor) or tuple(scores.shape) != (batch, heads, length):
            got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise PolicyError(f"{type(self).__name__}.score returned {got}, expected a tensor "
                              f"of shape {(batch, heads, length)}")
        if length == 0:
            return torch.zeros((batch, heads, 0), dtype=torch.long, device=keys.device)
        ranked = scores.float().nan_to_num(nan=torch.finfo(torch.float32).min)
        if self.n_recent:
            recent = newest(positions.flatten(0, 1), valid.flatten(0, 1), self.n_recent)
            ranked = ranked.masked_fill(recent.view(batch, heads, length), torch.inf)
        ranked = ranked.masked_fill(~valid, -torch.inf)
        widest = max(counts)
        return torch.stack([torch.cat([k, k[:, -1:].expand(batch, widest - k.shape[1])], dim=1)
                            for k in select_heads(ranked, counts)], dim=1)

    def _params(self) -> dict[str, Any]:
        return {"n_recent": self.n_recent}


@register_token_policy("ema_heads")
class EMAHeads(LayerState, HeadTokenPolicy):
    """EMA-scored head-granular eviction: each kv head keeps its own ``min(budget, T)`` slots
    by the EMA of the attention its queries gave them.

    Score of head ``h``'s slot: ``s ← β · s + (1 − β) · p_q`` over every query ``q`` this
    layer has seen (`ema_attention`, the query heads averaged within the GQA group), new slots
    starting at 0. **State**, as `kvevict.tokens.heuristics.H2O`'s: ``select`` folds this
    forward's attention into the EMA and keeps the EMA of the selected slots only, per head,
    so call it once per forward of a layer (with that forward's attention) and keep exactly
    those slots; `score` previews it and changes nothing.

    Source: seed 004 (the unified KV sizing / six-tier memory paper), which pairs its reuse
    predictor with "EMA-scored head-granular eviction"; the decay `DEFAULT_DECAY` is an
    average over 64 queries, kvpress ``SnapKVPress``'s window. ``make_token_policy("ema")`` is
    the same score shared by a layer's heads.

    Args:
        budget: tokens each kv head keeps per sequence and layer.
        decay: the EMA's decay ``β`` in (0, 1), default `DEFAULT_DECAY`.
        n_recent: the newest tokens each head always keeps (default `N_RECENT`, 8). Evicting
            at every forward, a token fed after a long context starts with a near-zero EMA
            and would be dropped at once: the question. On the judge at 15% (validation seed
            5, 32 items per task, ``benchmarks/tokens_n_recent.py``) ``n_recent`` 0, 8 and 32
            score 30.2, 34.4 and 33.3% (mean of the tasks).
    """

    needs_attention: ClassVar[bool] = True

    def __init__(self, budget: int, decay: float = DEFAULT_DECAY,
                 n_recent: int = N_RECENT) -> None:
        super().__init__(budget, n_recent)
        self.decay = check_decay(decay)
        self._state: dict[int, Tensor] = {}  # per layer, each head's EMA [B, Hkv, T]

    def _accumulate(self, layer_idx: int, attention: Tensor) -> Tensor:
        """The kept slots' EMA grown to ``T`` slots and folded with ``attention`` (pure)."""
        batch, heads, _, length = attention.shape
        ema = self._state.get(layer_idx)
        if ema is not None and (ema.shape[:2] != (batch, heads) or ema.shape[2] > length):
            raise ConfigError(f"ema_heads layer {layer_idx} holds state for "
                              f"{list(ema.shape)} slots, got [{batch}, {heads}, {length}]: "
                              "call reset() for a new batch or after a crop, reorder() after "
                              "a beam reorder")
        previous = None if ema is None else ema.to(attention.device)
        return ema_attention(attention.float(), self.decay, previous)

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        assert attention is not None  # _check raised otherwise
        return self._accumulate(layer_idx, attention)

    def _params(self) -> dict[str, Any]:
        return {"decay": self.decay, "n_recent": self.n_recent}


@register_token_policy("lkv_h")
class LKVHeads(HeadTokenPolicy):
    """LKV-H: learned per-(layer, head) budgets, each head ranking its slots by its own
    learned scorer.

    `head_counts` is `allocate` over the budgets' shares (``L · H · softmax(logits)``) at
    retention ``min(1, budget / T)`` for ``T`` stored slots, computed once per ``T`` for all
    layers: the counts sum to ``budget · L · H`` (at most ``T`` each). Each head's slots are
    ranked by its own `KVScorer` (``per_head``), the ``n_recent`` newest always kept (the
    question and the answer being generated, which the scorer never saw in training).

    Source: Zhou et al., "LKV: End-to-End Learning of Head-wise Budgets and Token Selection for
    LLM KV Cache Eviction" (arXiv:2605.06676, 2026). The shipped parameters
    (``kvevict.judge.JUDGE_DIR``: ``lkv_h.safetensors``, the budgets; ``lkv_h_scorer.safetensors``,
    the per-head ranker they were trained over) come from ``benchmarks/train_token_policies.py``.

    Args:
        budget: tokens kept per sequence per layer and kv head, on average over the heads.
        scorer: a per-head `KVScorer`, or the path of its file (method ``lkv_h``).
        budgets: the learned `HeadBudgets`, or the path of their file.
        shape: the model shape (`ScorerShape.of(model)`), needed to load either from a file;
            the engine fills it in.
        n_recent: the newest tokens each head always keeps (default `N_RECENT`).
    """

    def __init__(self, budget: int, scorer: KVScorer | str | Path | None = None,
                 budgets: HeadBudgets | str | Path | None = None,
                 shape: ScorerShape | None = None, n_recent: int = N_RECENT) -> None:
        super().__init__(budget, n_recent)
        if scorer is None or budgets is None:
            raise ConfigError("lkv_h needs scorer= and budgets= (objects, or the paths "
                              "kvevict.judge.JUDGE_DIR / 'lkv_h_scorer.safetensors' and "
                              "'lkv_h.safetensors' with shape=ScorerShape.of(model))")
        if not isinstance(scorer, KVScorer) or not isinstance(budgets, HeadBudgets):
            if shape is None:
                raise ConfigError("shape= (ScorerShape.of(model)) is needed to load lkv_h's "
                                  "parameters from files")
        if not isinstance(scorer, KVScorer):
            scorer = load_scorer(scorer, shape, method="lkv_h")
        if not isinstance(budgets, HeadBudgets):
            budgets = load_budgets(budgets, shape)
        if not scorer.per_head:
            raise ConfigError("lkv_h ranks each head by its own scorer: give a KVScorer "
                              "built with per_head=True")
        if scorer.shape != budgets.shape or (shape is not None and shape != scorer.shape):
            raise ConfigError(f"lkv_h's scorer has shape {scorer.shape} and its budgets "
                              f"{budgets.shape}" + ("" if shape is None else
                                                    f"; the model has shape {shape}"))
        self.scorer, self.budgets, self.shape = scorer, budgets, scorer.shape
        with torch.no_grad():
            self._shares = budgets.shares().detach().clone()

    def head_counts(self, layer_idx: int, length: int, kv_heads: int) -> list[int]:
        """Head ``h`` of ``layer_idx`` keeps ``allocate(shares, min(1, budget / T), T)[l, h]``
        of ``T = length`` slots."""
        if not 0 <= layer_idx < self.shape.layers or kv_heads != self.shape.kv_heads:
            raise ConfigError(f"lkv_h's budgets are for {self.shape.layers} layers of "
                              f"{self.shape.kv_heads} kv heads; got layer {layer_idx} of "
                              f"{kv_heads}")
        if length == 0:
            return [0] * kv_heads
        return list(self.allocated(self._shares, length)[layer_idx])

    @torch.no_grad()
    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        return self.scorer(layer_idx, keys, values)

    def _params(self) -> dict[str, Any]:
        return {"shape": self.shape, "n_recent": self.n_recent}
