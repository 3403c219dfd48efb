"""LKV-T: token importance learned end to end from keys and values, no attention matrix.

Source: Zhou et al., "LKV: End-to-End Learning of Head-wise Budgets and Token Selection for LLM
KV Cache Eviction" (arXiv:2605.06676, 2026). LKV formulates eviction as a differentiable
problem trained on the task loss; LKV-T is its token selector, a scorer of each stored token's
K/V that never materialises attention (so it runs beside fused attention kernels), near-lossless
at 15% retention on LongBench. (LKV-H, its learned per-head budgets, is
`kvevict.tokens.heads`: it needs a cache whose heads keep different counts, `HeadCache`.)

Here: a `KVScorer` (an MLP per layer over ``[k ; v]`` per kv head, heads averaged so the layer's
selection is shared) is trained with the judge frozen, in two stages (`train_lkv_t`):

1. **Warm start by distillation** (`kvevict.tokens.learned.distill_scorer`): the scorer's
   softmax over the context is fitted (listwise cross-entropy) to the attention the question's
   and answer's queries give each context token under the full cache (`kvevict.judge.judge_traces`).
   Measured on the judge: keeping the top 15% by that future attention (an oracle) gives the
   full cache's accuracy on all three tasks, so it is the signal to imitate from K/V alone.
2. **End to end through a straight-through top-k gate** inside attention (`GatedAttention`):
   for the queries a compressed cache would serve (the question and the answer), the context
   keys outside the scorer's top ``ρ·C`` are masked in the forward pass, exactly the eviction
   at deployment; the backward pass is that of the *soft* gate ``log σ((s - t) / τ)`` around
   the top-k threshold ``t`` (`straight_through_attention`). The soft pass is what gives an
   evicted token a gradient: under the hard mask its attention weight, and so its gradient, is
   exactly zero, and a scorer trained that way never learns to bring back a token it dropped.
   The loss is the judge's answer cross-entropy; ``ρ`` is drawn per step from the retention
   grid, so one scorer serves every budget. Queries inside the context see every key (the
   prefill is not compressed).

As every method that evicts while decoding (H2O's recent window, SnapKV's observation window,
StreamingLLM's window), LKV-T always keeps the ``n_recent`` newest tokens: the scorer was
trained on context tokens, and the question and the answer being generated come after them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import eager_attention, register_token_policy
from kvevict.tokens.learned import (
    N_RECENT,
    KVScorer,
    LearnedTokenPolicy,
    ScorerShape,
    distill_scorer,
)

__all__ = ["GatedAttention", "LKVToken", "context_rows", "straight_through_attention",
           "train_lkv_t", "train_through"]


@register_token_policy("lkv_t")
class LKVToken(LearnedTokenPolicy):
    """LKV-T: keep the tokens a learned K/V scorer ranks highest (see the module docstring).

    Args:
        budget: tokens kept per sequence per layer.
        scorer: a trained `KVScorer`, or the path of its file (``JUDGE_DIR / "lkv_t.safetensors"``
            for the judge).
        shape: the model's `ScorerShape`, when ``scorer`` is a path.
        n_recent: the newest tokens always kept (default
            `kvevict.tokens.learned.N_RECENT`).
    """

    method: ClassVar[str] = "lkv_t"


def straight_through_attention(query: Tensor, key: Tensor, value: Tensor, hard: Tensor,
                               soft: Tensor, attention_mask: Tensor | None,
                               scaling: float | None) -> tuple[Tensor, Tensor]:
    """Eager attention whose forward value uses the ``hard`` bias (the deployed eviction: 0 or
    -1e9 per key) and whose gradient is that of the ``soft`` bias (a relaxation, e.g.
    ``log σ((s - t) / τ)``): ``out_hard + out_soft - out_soft.detach()``.

    Biases broadcast to ``[B, Hq, Tq, Tk]``; ``attention_mask`` (transformers' float mask) is
    added to both. A key masked by ``hard`` has zero weight there, and so zero gradient; in the
    soft pass it keeps a small weight, so the gradient says whether bringing it back would have
    lowered the loss. Returns the output ``[B, Tq, Hq, Dv]`` and the hard weights."""
    tk = key.shape[-2]
    mask = 0.0 if attention_mask is None else attention_mask[:, :, :, :tk]
    out, weights = eager_attention(query, key, value, hard.detach() + mask, scaling)
    relaxed, _ = eager_attention(query, key, value, soft + mask, scaling)
    return out + relaxed - relaxed.detach(), weights


def context_rows(context: int, query: Tensor, key: Tensor, per_key: Tensor) -> Tensor:
    """``per_key`` ``[B, H, C]`` (a bias on the ``context`` first keys) as a bias
    ``[B, H, Tq, Tk]`` that applies only to the queries after the context: the prefill sees
    every key, the question and the answer see what the cache would hold."""
    tq, tk = query.shape[2], key.shape[-2]
    rows = torch.arange(tk - tq, tk, device=query.device) >= context
    full = F.pad(per_key, (0, tk - context))[:, :, None, :]  # [B, H, 1, Tk]
    return torch.where(rows[None, None, :, None], full, 0.0)


class GatedAttention:
    """An attention function (transformers' ``AttentionInterface`` signature, eager math) that
    gates the context keys by a scorer's straight-through top-k, for training.

    Set ``context`` (context tokens ``C``) and ``retention`` (``ρ``) before each forward. The
    ``n_recent`` newest context tokens are always kept, as `LKVToken` keeps them.
    """

    def __init__(self, scorer: KVScorer, temperature: float = 1.0,
                 n_recent: int = N_RECENT) -> None:
        self.scorer = scorer
        self.temperature = temperature
        self.n_recent = n_recent
        self.context = 0
        self.retention = 1.0

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, scaling: float | None = None,
                 dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor]:
        c = self.context
        scores = self.scorer(module.layer_idx, key[:, :, :c].detach(),
                             value[:, :, :c].detach()).mean(dim=1)  # [B, C]
        kept = max(1, round(self.retention * c))
        recent = torch.arange(c, device=key.device) >= c - min(self.n_recent, kept)
        ranked = scores.masked_fill(recent, 1e4)  # no gradient through the kept window
        threshold = ranked.topk(kept, dim=1).values[:, -1:].detach()
        hard = (ranked < threshold).float() * -1e9
        soft = F.logsigmoid((ranked - threshold) / self.temperature)
        return straight_through_attention(  # [B, 1, C]: a kv head's query heads share it
            query, key, value, context_rows(c, query, key, hard[:, None]),
            context_rows(c, query, key, soft[:, None]), attention_mask, scaling)


def train_lkv_t(forward: Callable[[Tensor, GatedAttention], Tensor],
                batches: Sequence[tuple[Tensor, Tensor, int]], shape: ScorerShape, *,
                traces: Sequence[dict[str, Any]] = (), distill_epochs: int = 30,
                retentions: Sequence[float] = (0.1, 0.15, 0.25, 0.5), epochs: int = 1,
                lr: float = 3e-4, hidden: int = 128, seed: int = 0,
                log: Callable[[str], None] | None = None) -> KVScorer:
    """Train an LKV-T scorer: warm-started on ``traces`` (`distill_scorer`, skipped when there
    are none), then end to end through the frozen judge.

    ``forward(ids, gate)`` runs the judge on ``ids`` with ``gate`` as its attention and returns
    logits; ``batches`` are ``(ids, targets, context)`` with targets -100 except at answer
    tokens. Each step draws a retention from ``retentions`` (seeded)."""
    for r in retentions:
        if not 0.0 < r <= 1.0:
            raise ConfigError(f"retention fractions must be in (0, 1], got {r!r}")
    torch.manual_seed(seed)
    scorer = KVScorer(shape, hidden)
    if traces:
        distill_scorer(scorer, traces, epochs=distill_epochs, seed=seed, log=log)
    scorer.train()
    train_through(forward, GatedAttention(scorer), scorer, batches, retentions, epochs=epochs,
                  lr=lr, seed=seed, log=log, tag="lkv_t")
    return scorer.eval()


def train_through(forward: Callable[[Tensor, Any], Tensor], gate: Any, module: torch.nn.Module,
                  batches: Sequence[tuple[Tensor, Tensor, int]], retentions: Sequence[float],
                  *, epochs: int, lr: float, seed: int,
                  log: Callable[[str], None] | None, tag: str) -> None:
    """The loop LKV-T and LKV-H share: per batch, set ``gate``'s context and a retention drawn
    from ``retentions`` (seeded), run ``forward(ids, gate)`` through the frozen judge, and take an
    Adam step on ``module``'s parameters against the answers' cross-entropy."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    step = 0
    for _ in range(epochs):
        for ids, targets, context in batches:
            gate.context = context
            gate.retention = float(retentions[int(torch.randint(len(retentions), (1,),
                                                                generator=gen))])
            logits = forward(ids, gate)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   targets.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if log is not None and step % 20 == 0:
                log(f"{tag} step {step} retention {gate.retention} loss {loss.item():.4f}")
            step += 1
