"""LKV-T: token importance learned end to end from keys and values, no attention matrix.

Source: Zhou et al., "LKV: End-to-End Learning of Head-wise Budgets and Token Selection for LLM
KV Cache Eviction" (arXiv:2605.06676, 2026). LKV formulates eviction as a differentiable
problem trained on the task loss; LKV-T is its token selector, a scorer of each stored token's
K/V that never materialises attention (so it runs beside fused attention kernels), near-lossless
at 15% retention on LongBench. (LKV-H, its learned per-head budgets, is
`kvevict.tokens.heads`: it needs a cache whose heads keep different counts, `HeadCache`.)

Here: a `KVScorer` (an MLP per layer over ``[k ; v]`` per kv head, heads averaged so the layer's
selection is shared) is trained with the judge frozen, through a **straight-through top-k
gate** inside attention (`GatedAttention`): for the queries a compressed cache would serve (the
question and the answer), the context keys outside the scorer's top ``ρ·C`` get a logit of -inf
in the forward pass, exactly the eviction at deployment, while the gradient flows through the
soft gate ``log σ((s - t) / τ)`` around the top-k threshold ``t``. The loss is the judge's
answer cross-entropy; ``ρ`` is drawn per step from the retention grid, so one scorer serves
every budget. Queries inside the context see every key (the prefill is not compressed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import eager_attention, register_token_policy
from kvevict.tokens.learned import KVScorer, LearnedTokenPolicy, ScorerShape

__all__ = ["GatedAttention", "LKVToken", "train_lkv_t", "train_through"]


@register_token_policy("lkv_t")
class LKVToken(LearnedTokenPolicy):
    """LKV-T: keep the tokens a learned K/V scorer ranks highest (see the module docstring).

    Args:
        budget: tokens kept per sequence per layer.
        scorer: a trained `KVScorer`, or the path of its file (``JUDGE_DIR / "lkv_t.safetensors"``
            for the judge).
        shape: the model's `ScorerShape`, when ``scorer`` is a path.
    """

    method: ClassVar[str] = "lkv_t"


class GatedAttention:
    """An attention function (transformers' ``AttentionInterface`` signature, eager math) that
    gates the context keys by a scorer's straight-through top-k, for training.

    Set ``context`` (context tokens ``C``) and ``retention`` (``ρ``) before each forward.
    """

    def __init__(self, scorer: KVScorer, temperature: float = 1.0) -> None:
        self.scorer = scorer
        self.temperature = temperature
        self.context = 0
        self.retention = 1.0

    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, scaling: float | None = None,
                 dropout: float = 0.0, **_: Any) -> tuple[Tensor, Tensor]:
        c = self.context
        scores = self.scorer(module.layer_idx, key.detach(), value.detach()).mean(dim=1)
        ctx = scores[:, :c]  # [B, C]
        kept = max(1, round(self.retention * c))
        threshold = ctx.topk(kept, dim=1).values[:, -1:].detach()
        hard = (ctx >= threshold).float()
        soft = F.logsigmoid((ctx - threshold) / self.temperature)
        bias_ctx = (1.0 - hard) * -1e9 + (soft - soft.detach())  # forward: hard; grad: soft
        tq, tk = query.shape[2], key.shape[-2]
        rows = torch.arange(tk - tq, tk, device=query.device) >= c  # queries after the context
        full = F.pad(bias_ctx, (0, tk - c))  # [B, Tk]
        bias = torch.where(rows[None, None, :, None], full[:, None, None, :], 0.0)
        if attention_mask is not None:
            bias = bias + attention_mask[:, :, :, :tk]
        return eager_attention(query, key, value, bias, scaling)


def train_lkv_t(forward: Callable[[Tensor, GatedAttention], Tensor],
                batches: Sequence[tuple[Tensor, Tensor, int]], shape: ScorerShape, *,
                retentions: Sequence[float] = (0.1, 0.15, 0.25, 0.5), epochs: int = 1,
                lr: float = 3e-3, hidden: int = 32, seed: int = 0,
                log: Callable[[str], None] | None = None) -> KVScorer:
    """Train an LKV-T scorer end to end through the frozen judge.

    ``forward(ids, gate)`` runs the judge on ``ids`` with ``gate`` as its attention and returns
    logits; ``batches`` are ``(ids, targets, context)`` with targets -100 except at answer
    tokens. Each step draws a retention from ``retentions`` (seeded)."""
    for r in retentions:
        if not 0.0 < r <= 1.0:
            raise ConfigError(f"retention fractions must be in (0, 1], got {r!r}")
    torch.manual_seed(seed)
    scorer = KVScorer(shape, hidden)
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
