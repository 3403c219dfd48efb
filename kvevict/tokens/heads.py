"""Head-granular token eviction: every (layer, kv head) keeps its own tokens, and its own count.

A `TokenPolicy` keeps one selection per layer, shared by the layer's kv heads, so the layer's
cache stays rectangular. Heads attend to different things, and two methods of issue 16 exploit
that by letting each head choose:

- **EMA-scored head-granular eviction** (seed 004: the unified KV sizing / six-tier memory
  paper, which pairs its Bayesian reuse predictor with "EMA-scored head-granular eviction").
  Each kv head scores a stored token by an exponential moving average of the attention its
  queries give it (`ema_attention`), and keeps its own top tokens. The decay defaults to
  ``1 - 1/64``: an average over the last 64 queries, the observation window of kvpress's
  ``SnapKVPress``. (`kvevict.tokens.heuristics.H2O` is the undecayed, layer-shared sum.)
- **LKV-H** (Zhou et al., "LKV: End-to-End Learning of Head-wise Budgets and Token Selection for
  LLM KV Cache Eviction", arXiv:2605.06676, 2026): how many tokens each (layer, head) keeps is
  learned end to end under one global retention target. `HeadBudgets` holds a logit per
  (layer, head); the shares are a softmax over all of them, so the budget moves between heads
  but the total stays ``retention`` of the cache. `train_lkv_h` trains them through the frozen
  judge with `HeadGate`, a straight-through relaxation of each head's top-``n`` cut: the
  forward pass is the deployed eviction (a head's tokens past its count get ``-inf``), the
  gradient is that of the soft cut ``log σ((n - rank - ½) / τ)`` (`straight_through_attention`,
  so a token past the count still tells its head whether more budget would have helped). Each
  head ranks its tokens by ``scoring``: the shipped budgets use a per-head `KVScorer`
  distilled from each head's own future attention (``lkv_h_scorer.safetensors``,
  `train_token_policies.py`), since key norms do not rank the judge's tokens well.

Both run through ``make_token_policy("ema_heads" | "lkv_h", ...)`` in every cache
(`kvevict.tokens.head_policies`: each head keeps its own slots of a rectangular store, evicting
at every forward). `kvevict.adapters.hf.heads.HeadCache` runs them as context compression
instead, each head's kept tokens their own tensor ``[B, n_h, D]``, the layout a head-paged
cache stores, so the bytes counted are the bytes held. `allocate` turns shares into integer
counts that sum exactly to the target; `select_heads` picks each head's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import register_token_policy
from kvevict.tokens.heuristics import H2O
from kvevict.tokens.learned import KVScorer, ScorerShape
from kvevict.tokens.lkv import context_rows, straight_through_attention, train_through

__all__ = [
    "DEFAULT_DECAY",
    "HEAD_SCORINGS",
    "EMAAttention",
    "HeadBudgets",
    "HeadGate",
    "allocate",
    "check_decay",
    "check_retention",
    "ema_attention",
    "head_scores",
    "load_budgets",
    "save_budgets",
    "select_heads",
    "train_lkv_h",
]

#: The EMA's default decay: a mean age of 64 queries (kvpress ``SnapKVPress``'s window).
DEFAULT_DECAY = 1.0 - 1.0 / 64
#: How `head_scores` can score a head's tokens (or pass a per-head `KVScorer`).
HEAD_SCORINGS = ("ema", "knorm")


def check_decay(decay: Any) -> float:
    """``decay`` as a float in (0, 1); `ConfigError` otherwise."""
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
        raise ConfigError(f"decay must be in (0, 1), got {decay!r}")
    return float(decay)


def check_retention(retention: Any) -> float:
    """``retention`` as a float in (0, 1]; `ConfigError` otherwise."""
    if isinstance(retention, bool) or not isinstance(retention, (int, float)) or not (
            0.0 < float(retention) <= 1.0):
        raise ConfigError(f"retention must be a fraction in (0, 1], got {retention!r}")
    return float(retention)


def ema_attention(weights: Tensor, decay: float = DEFAULT_DECAY,
                  previous: Tensor | None = None) -> Tensor:
    """Per head, the EMA of the attention each stored token received: ``[B, H, T]``.

    ``weights`` ``[B, H, Q, T]`` are the softmax probabilities of ``Q`` queries in order; the
    EMA after them is ``s ← decay · s + (1 - decay) · p_q``, starting from ``previous``
    (``[B, H, T']``, ``T' <= T``; newer tokens start at 0) or from zeros."""
    check_decay(decay)
    q, length = weights.shape[2], weights.shape[3]
    ages = torch.arange(q - 1, -1, -1, device=weights.device, dtype=torch.float64)
    w = ((1.0 - decay) * decay ** ages).to(torch.float32)
    scores = torch.einsum("bhqt,q->bht", weights.float(), w)
    if previous is not None:
        scores = scores + decay ** q * F.pad(previous.float(), (0, length - previous.shape[-1]))
    return scores


@register_token_policy("ema")
class EMAAttention(H2O):
    """The EMA score at layer granularity, for every cache: ``make_token_policy("ema", ...)``.

    H2O's accumulation with a decay: each forward folds its queries' attention into the kept
    tokens' EMA (`ema_attention`, the kv heads averaged), so what the recent queries attend to
    counts most; new tokens start at 0. For one selection per head use
    ``make_token_policy("ema_heads", ...)`` (`kvevict.tokens.head_policies.EMAHeads`).

    Args:
        budget: tokens kept per sequence per layer.
        decay: the EMA's decay in (0, 1), default `DEFAULT_DECAY`.
        n_recent: recent tokens always kept (default 0: the EMA alone decides).
    """

    def __init__(self, budget: int, decay: float = DEFAULT_DECAY, n_recent: int = 0) -> None:
        super().__init__(budget, n_recent)
        self.decay = check_decay(decay)

    def _accumulate(self, layer_idx: int, attention: Tensor) -> Tensor:
        """The kept tokens' EMA grown to ``T`` slots and folded with this call's attention."""
        batch, _, _, length = attention.shape
        acc = self.accumulated(layer_idx)
        if acc is not None and (acc.shape[0] != batch or acc.shape[1] > length):
            raise ConfigError(f"EMA layer {layer_idx} holds state for {acc.shape[0]} x "
                              f"{acc.shape[1]} stored tokens, got {batch} x {length}: call "
                              "reset() for a new batch or after a crop, reorder() after a beam "
                              "reorder")
        previous = None if acc is None else acc[:, None].to(attention.device)
        return ema_attention(attention.float(), self.decay, previous).mean(dim=1)

    def _params(self) -> dict[str, Any]:
        return {"decay": self.decay, "n_recent": self.n_recent}


def head_scores(scoring: str | KVScorer, layer_idx: int, keys: Tensor, values: Tensor,
                ema: Tensor | None = None) -> Tensor:
    """``[B, Hkv, T]``: how much each head wants to keep each token (higher = keep).

    ``"knorm"`` is minus the key norm (kvpress ``KnormPress``, per head); ``"ema"`` is the
    head's `ema_attention` (pass it as ``ema``); a per-head `KVScorer` (LKV-T or KVP) scores
    keys and values."""
    if isinstance(scoring, KVScorer):
        return scoring(layer_idx, keys, values)
    if scoring == "knorm":
        return -keys.float().norm(dim=-1)
    if scoring == "ema":
        if ema is None:
            raise ConfigError("scoring 'ema' needs the heads' attention EMA (run the prefill "
                              "under head_attention)")
        return ema
    raise ConfigError(f"unknown head scoring {scoring!r}; expected one of {list(HEAD_SCORINGS)} "
                      "or a KVScorer")


def allocate(shares: Tensor, retention: float, context: int) -> Tensor:
    """Integer kept counts ``[L, H]`` from positive ``shares`` ``[L, H]``.

    The counts sum exactly to ``round(retention · context · L · H)`` (at least one per head),
    each in ``[1, context]``: water-filling finds the scale at which the capped shares meet the
    total, and the remainder goes to the largest fractional parts (ties to the lower index)."""
    retention = check_retention(retention)
    if context < 1:
        raise ConfigError(f"context must be >= 1 token, got {context}")
    s = shares.detach().double()
    if s.dim() != 2 or not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ConfigError(f"shares must be a [layers, heads] tensor of positive finite numbers, "
                          f"got {tuple(shares.shape)}")
    cells = s.numel()
    total = min(cells * context, max(cells, round(retention * context * cells)))
    lo, hi = 0.0, float(context) / float(s.min()) + 1.0
    for _ in range(100):  # the scale λ with Σ clip(λ s, 1, C) = total
        mid = 0.5 * (lo + hi)
        if float((s * mid).clamp(1.0, float(context)).sum()) < total:
            lo = mid
        else:
            hi = mid
    ideal = (s * hi).clamp(1.0, float(context))
    counts = ideal.floor().long().clamp(1, context)
    left = total - int(counts.sum())
    if left > 0:
        frac = (ideal - counts.double()).flatten()
        frac[counts.flatten() >= context] = -1.0
        order = torch.sort(-frac, stable=True).indices[:left]
        counts.view(-1)[order] += 1
    elif left < 0:
        frac = (ideal - counts.double()).flatten()
        frac[counts.flatten() <= 1] = 2.0
        order = torch.sort(frac, stable=True).indices[:-left]
        counts.view(-1)[order] -= 1
    return counts


def select_heads(scores: Tensor, counts: Sequence[int]) -> list[Tensor]:
    """Per kv head ``h``, the ``counts[h]`` slots with the highest ``scores[:, h]``
    (``[B, H, T]``), ascending: a list of long ``[B, counts[h]]``. Equal scores keep the later
    slot (the more recent token); NaN ranks below every number."""
    batch, heads, length = scores.shape
    if len(counts) != heads:
        raise ConfigError(f"{len(counts)} counts for {heads} heads; give one per kv head")
    kept = []
    newest_first = torch.arange(length - 1, -1, -1, device=scores.device)
    for h in range(heads):
        n = int(counts[h])
        if not 1 <= n <= length:
            raise ConfigError(f"head {h} would keep {n} of {length} tokens; expected 1..{length}")
        s = scores[:, h].float().nan_to_num(nan=-torch.inf)[:, newest_first]
        order = torch.sort(s, dim=1, descending=True, stable=True).indices
        kept.append(newest_first[order[:, :n]].sort(dim=1).values)
    return kept


# -- LKV-H: learned head budgets --------------------------------------------------------------


class HeadBudgets(torch.nn.Module):
    """LKV-H's learned budgets: a logit per (layer, kv head).

    `shares` is ``L · H · softmax(logits)`` (mean 1), so ``retention · shares`` is each head's
    kept fraction before capping and the total is fixed. Zero logits are uniform budgets."""

    def __init__(self, shape: ScorerShape) -> None:
        super().__init__()
        self.shape = shape
        self.logits = torch.nn.Parameter(torch.zeros(shape.layers, shape.kv_heads))

    def shares(self) -> Tensor:
        flat = torch.softmax(self.logits.flatten(), dim=0) * self.logits.numel()
        return flat.view_as(self.logits)

    def counts(self, retention: float, context: int) -> Tensor:
        """Integer kept tokens ``[L, H]`` for a context of ``context`` tokens (`allocate`)."""
        return allocate(self.shares(), retention, context)


def save_budgets(budgets: HeadBudgets, path: str | Path, *,
                 extra: dict[str, Any] | None = None) -> None:
    """Write ``budgets`` to ``path`` (safetensors) with the model shape they were trained for."""
    from safetensors.torch import save_file

    meta = {"shape": json.dumps(attrs.asdict(budgets.shape)), "method": "lkv_h",
            "extra": json.dumps(extra or {})}
    save_file({"logits": budgets.logits.detach().contiguous()}, str(path), metadata=meta)


def load_budgets(path: str | Path, shape: ScorerShape) -> HeadBudgets:
    """The budgets saved at ``path``; `ConfigError` when they were trained for another model
    shape (both named) or the file holds something else."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no LKV-H budgets at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    try:
        saved = ScorerShape(**json.loads(meta["shape"]))
        method = meta["method"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a kvevict LKV-H file (metadata {meta})") from exc
    if method != "lkv_h" or "logits" not in tensors:
        raise ConfigError(f"{path} holds {method!r} parameters, not 'lkv_h' budgets")
    if saved != shape:
        raise ConfigError(f"{path} was trained for a model of shape {saved}, but this model "
                          f"has shape {shape}")
    budgets = HeadBudgets(saved)
    with torch.no_grad():
        budgets.logits.copy_(tensors["logits"])
    return budgets


class HeadGate:
    """An attention function (transformers' ``AttentionInterface`` signature, eager math) that
    cuts each kv head's context to its LKV-H count, straight-through, for training.

    Set ``context`` (``C``) and ``retention`` (``ρ``) before each forward. Head ``(l, h)`` keeps
    ``n = min(1, ρ · share) · C`` context tokens ranked by ``scoring`` (detached: only the
    budgets learn). The queries after the context see the kept ones only; the prefill is not
    compressed. Ranks break ties as `select_heads` does, so the forward pass is exactly the
    deployed eviction."""

    def __init__(self, budgets: HeadBudgets, scoring: str | KVScorer = "knorm",
                 temperature: float = 2.0) -> None:
        if isinstance(scoring, str) and scoring not in ("knorm",):
            raise ConfigError("HeadGate scores without attention: use 'knorm' or a KVScorer")
        self.budgets, self.scoring, self.temperature = budgets, scoring, temperature
        self.context = 0
        self.retention = 1.0

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, scaling: float | None = None,
                 dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor]:
        c, layer = self.context, module.layer_idx
        with torch.no_grad():
            scores = head_scores(self.scoring, layer, key[:, :, :c], value[:, :, :c])
            newest_first = torch.arange(c - 1, -1, -1, device=key.device)  # ties: the newer
            order = newest_first[torch.sort(scores[..., newest_first].nan_to_num(nan=-torch.inf),
                                            dim=-1, descending=True, stable=True).indices]
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(c, device=key.device).expand_as(order)).float()
        kept = (self.retention * self.budgets.shares()[layer]).clamp(max=1.0) * c  # [H]
        hard_n = kept.detach().round().clamp(min=1.0)
        soft = F.logsigmoid((kept[None, :, None] - rank - 0.5) / self.temperature)
        hard = (rank >= hard_n[None, :, None]).float() * -1e9  # [B, Hkv, C]
        groups = query.shape[1] // key.shape[1]
        hard, soft = hard.repeat_interleave(groups, dim=1), soft.repeat_interleave(groups, dim=1)
        return straight_through_attention(
            query, key, value, context_rows(c, query, key, hard),
            context_rows(c, query, key, soft), attention_mask, scaling)


def train_lkv_h(forward: Callable[[Tensor, HeadGate], Tensor],
                batches: Sequence[tuple[Tensor, Tensor, int]], shape: ScorerShape, *,
                retentions: Sequence[float] = (0.1, 0.15, 0.25, 0.5), epochs: int = 1,
                lr: float = 0.05, scoring: str | KVScorer = "knorm", seed: int = 0,
                log: Callable[[str], None] | None = None) -> HeadBudgets:
    """Learn LKV-H budgets end to end through the frozen judge.

    ``forward(ids, gate)`` runs the judge on ``ids`` with ``gate`` as its attention and returns
    logits; ``batches`` are ``(ids, targets, context)`` with targets -100 except at answer
    tokens. Each step draws a retention from ``retentions`` (seeded), so one set of budgets
    serves every target."""
    for r in retentions:
        check_retention(r)
    torch.manual_seed(seed)
    budgets = HeadBudgets(shape)
    train_through(forward, HeadGate(budgets, scoring), budgets, batches, retentions,
                  epochs=epochs, lr=lr, seed=seed, log=log, tag="lkv_h")
    return budgets.eval()
