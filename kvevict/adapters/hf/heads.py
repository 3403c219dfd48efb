"""`HeadCache`: head-granular token eviction (EMA-scored, LKV-H budgets) in a transformers
``Cache``.

`kvevict.tokens.heads` has the methods; this runs them in ``generate()``. (The same methods
run through ``make_token_policy("ema_heads" | "lkv_h", ...)`` in `PagedCache` and the engine,
evicting at every step: `kvevict.tokens.head_policies`.) The protocol here is
context compression, as `RoutedCache` and the judge use: the context is prefilled, then each
(layer, kv head) keeps its own ``n_lh`` context tokens (`allocate` over LKV-H budgets, or equal
counts), chosen by its own scores (`head_scores`: the head's attention EMA, its key norms, or a
per-head learned scorer). Every later token is kept in full after them (the residual).

Each kv head's kept keys and values are their own tensors ``[B, n_h, D]``, so `nbytes` is what
a head-paged cache holds. transformers builds one mask per forward, so the model runs under
`head_attention(model, cache)`: eager attention per kv head over that head's kept tokens (all
visible: batches are unpadded) and the residual (the mask's last columns). During the prefill
the same function records each head's attention EMA. Batches must be unpadded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvevict.adapters.hf.routed import (
    ResidualLayer,
    attention_function,
    full_attention_layers,
    greedy_answers,
)
from kvevict.errors import ConfigError
from kvevict.tokens.base import eager_attention
from kvevict.tokens.heads import (
    DEFAULT_DECAY,
    HeadBudgets,
    allocate,
    check_retention,
    ema_attention,
    head_scores,
    load_budgets,
    select_heads,
)
from kvevict.tokens.learned import KVScorer, ScorerShape
from kvevict.tokens.tasks import TaskItem, batches

__all__ = ["HEAD_ATTENTION", "HeadCache", "HeadLayer", "head_answers", "head_attention"]

#: The attention implementation name `head_attention` registers.
HEAD_ATTENTION = "kvevict_heads"


class HeadLayer(ResidualLayer):
    """One layer of a `HeadCache`: per kv head, its kept context tokens; then the residual."""

    def __init__(self, layer_idx: int, decay: float) -> None:
        super().__init__(layer_idx)
        self.decay = decay
        #: Per kv head ``(keys [B, n, D], values [B, n, Dv], positions [B, n])`` once compressed.
        self.kept: list[tuple[Tensor, Tensor, Tensor]] | None = None
        #: The heads' attention EMA ``[B, Hkv, T]`` over the prefill (before compression).
        self.ema: Tensor | None = None

    @property
    def compressed(self) -> bool:
        return self.kept is not None

    @property
    def residual(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def kept_counts(self) -> list[int]:
        return [] if self.kept is None else [int(k.shape[1]) for k, _, _ in self.kept]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.append(key_states, value_states)
        return self.keys, self.values

    def record(self, weights: Tensor) -> None:
        """Fold a prefill forward's attention ``[B, Hq, Q, T]`` into the heads' EMA."""
        batch, hq, q, length = weights.shape
        hkv = self.keys.shape[1]
        per_kv = weights.float().view(batch, hkv, hq // hkv, q, length).mean(dim=2)
        self.ema = ema_attention(per_kv, self.decay, self.ema)

    def compress(self, counts: Sequence[int], scoring: str | KVScorer) -> None:
        """Keep ``counts[h]`` context tokens in head ``h`` (once, after the prefill)."""
        keys, values = self.keys, self.values
        length = keys.shape[-2]
        scores = head_scores(scoring, self.layer_idx, keys, values, self.ema)
        slots = select_heads(scores, [min(int(n), length) for n in counts])
        self.kept = []
        for h, s in enumerate(slots):
            k = keys[:, h].gather(1, s[:, :, None].expand(-1, -1, keys.shape[-1]))
            v = values[:, h].gather(1, s[:, :, None].expand(-1, -1, values.shape[-1]))
            self.kept.append((k.contiguous(), v.contiguous(), s))
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]
        self.ema = None

    def attend(self, query: Tensor, mask: Tensor | None,
               scaling: float | None) -> tuple[Tensor, Tensor | None]:
        """Attention of ``query`` ``[B, Hq, Q, D]`` over each head's kept tokens and the
        residual; the mask's last ``residual`` columns are the residual's."""
        assert self.kept is not None
        batch, hq, q, _ = query.shape
        hkv = len(self.kept)
        groups = hq // hkv
        r = self.residual
        tail = None if mask is None else mask[..., -r:]
        out = []
        for h, (k, v, _) in enumerate(self.kept):
            kh = torch.cat([k, self.keys[:, h]], dim=1)[:, None]  # [B, 1, n + R, D]
            vh = torch.cat([v, self.values[:, h]], dim=1)[:, None]
            bias = None
            if tail is not None:
                bias = torch.nn.functional.pad(tail, (k.shape[1], 0))
                if bias.shape[1] != 1:
                    bias = bias[:, h * groups:(h + 1) * groups]
            o, _ = eager_attention(query[:, h * groups:(h + 1) * groups], kh, vh, bias,
                                   scaling)
            out.append(o)  # [B, Q, G, Dv]
        return torch.cat(out, dim=2), None

    def nbytes(self) -> int:
        """Bytes held: every head's kept keys and values plus the residual."""
        held = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v, _ in (self.kept or []))
        if self.keys is not None:
            held += self.keys.numel() * self.keys.element_size()
            held += self.values.numel() * self.values.element_size()
        return held

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.residual + (max(self.kept_counts()) if self.kept else 0)
        return stored + query_length, self.seen - stored


class HeadCache(Cache):
    """A cache in which each (layer, kv head) keeps its own context tokens and count.

    Args:
        model: a decoder-only transformers model whose layers are all full attention.
        retention: the fraction of the context's KV kept over all layers and heads, (0, 1].
        scoring: ``"ema"`` (the heads' attention EMA over the prefill, seed 004's
            head-granular eviction), ``"knorm"``, or a per-head `KVScorer`.
        budgets: LKV-H `HeadBudgets` (or the path of their file) for the per-head counts;
            None gives every head the same count.
        decay: the EMA's decay (default `DEFAULT_DECAY`).
    """

    def __init__(self, model: Any, retention: float, *, scoring: str | KVScorer = "ema",
                 budgets: HeadBudgets | str | Path | None = None,
                 decay: float = DEFAULT_DECAY) -> None:
        layers = full_attention_layers(model, "HeadCache")
        self.retention = check_retention(retention)
        shape = ScorerShape.of(model)
        if isinstance(budgets, (str, Path)):
            budgets = load_budgets(budgets, shape)
        if budgets is not None and budgets.shape != shape:
            raise ConfigError(f"budgets were learned for a model of shape {budgets.shape}, but "
                              f"this model has shape {shape}")
        if isinstance(scoring, str):
            head_scores(scoring, 0, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                        torch.zeros(1, 1, 1))  # unknown names raise here
        self.scoring, self.budgets, self.shape = scoring, budgets, shape
        super().__init__(layers=[HeadLayer(i, decay) for i in range(layers)])

    @property
    def compressed(self) -> bool:
        return all(layer.compressed for layer in self.layers)

    def counts(self, context: int) -> Tensor:
        """Kept tokens ``[L, Hkv]`` for a ``context``-token prefill."""
        shares = (self.budgets.shares() if self.budgets is not None
                  else torch.ones(self.shape.layers, self.shape.kv_heads))
        return allocate(shares, self.retention, context)

    def compress(self) -> None:
        """Compress every layer now (call once, after the context's prefill)."""
        if self.compressed:
            raise ConfigError("this HeadCache was already compressed")
        if not all(layer.is_initialized for layer in self.layers):
            raise ConfigError("compress() needs a prefill first")
        if self.scoring == "ema" and any(layer.ema is None for layer in self.layers):
            raise ConfigError("scoring 'ema' needs the prefill to run under "
                              "head_attention(model, cache)")
        counts = self.counts(self.layers[0].residual)
        with torch.no_grad():
            for layer, row in zip(self.layers, counts.tolist(), strict=True):
                layer.compress(row, self.scoring)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The widest layer's sizes: a one-token forward's mask covers every layer."""
        stored = max(layer.get_mask_sizes(0)[0] for layer in self.layers)
        return stored + query_length, self.layers[0].seen - stored

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def head_attention(model: Any, cache: HeadCache, restore: str = "eager") -> Any:
    """Run ``model`` with ``cache``'s attention (a context manager): eager attention that
    records each head's EMA during the prefill and attends per head after compression."""

    def attend(module: Any, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor | None]:
        layer = cache.layers[module.layer_idx]
        if layer.compressed:
            return layer.attend(query, attention_mask, scaling)
        bias = None if attention_mask is None else attention_mask[..., -key.shape[-2]:]
        out, weights = eager_attention(query, key, value, bias, scaling)
        layer.record(weights.detach())
        return out, weights

    return attention_function(model, HEAD_ATTENTION, attend, restore)


@torch.no_grad()
def head_answers(model: Any, items: Sequence[TaskItem], retention: float, *,
                 scoring: str | KVScorer = "ema", budgets: HeadBudgets | str | Path | None = None,
                 decay: float = DEFAULT_DECAY, batch: int = 16
                 ) -> tuple[list[tuple[int, ...]], int]:
    """Greedy answers with head-granular eviction: prefill the context, compress, then
    ``generate()`` from the question on. Returns the answers and the bytes one sequence's cache
    held right after the compression (the most over the batches)."""
    answers: list[tuple[int, ...]] = []
    held = 0
    for chunk in batches(items, batch):
        cache = HeadCache(model, retention, scoring=scoring, budgets=budgets, decay=decay)
        with head_attention(model, cache):
            model(input_ids=torch.tensor([it.context for it in chunk]), cache=cache,
                  use_cache=True)
            cache.compress()
            held = max(held, cache.nbytes() // len(chunk))
            prompt = torch.tensor([it.prompt for it in chunk])
            n = len(chunk[0].answer)
            answers += greedy_answers(model, prompt, cache, n)
    return answers, held
