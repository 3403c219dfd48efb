"""KVP: per-head token rankers trained by reinforcement learning on generation traces.

Source: Moschella, Manduchi and Sener, "Learning to Evict from Key-Value Cache" (KV Policy,
arXiv:2602.10238, 2026). Eviction at every budget is one ranking of the tokens (their
Proposition 1: nested optimal sets), so KVP trains one lightweight agent per kv head that ranks
the stored tokens from their key and value vectors only, on pre-computed generation traces. The
reward scores a ranking at *all* budgets at once: the future utility (the attention later
queries give a token) kept by the top ``b`` tokens, averaged over budgets.

Here: a per-head `KVScorer` (``per_head=True``) defines a Plackett–Luce distribution over
rankings; a ranking is sampled with the Gumbel-top-k trick and scored by `ranking_reward` over
a budget grid; REINFORCE with the greedy ranking's reward as the baseline (self-critical,
Rennie et al., CVPR 2017) trains it. At deployment the layer's heads share one selection, so the
policy adds the heads' log-softmax scores (the sum of per-head Plackett–Luce log-probabilities
of putting a token first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import register_token_policy
from kvevict.tokens.learned import KVScorer, LearnedTokenPolicy, ScorerShape

__all__ = ["KVPolicy", "ranking_reward", "train_kvp"]

#: The budgets (fractions of the context) the reward averages over.
REWARD_BUDGETS: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


@register_token_policy("kvp")
class KVPolicy(LearnedTokenPolicy):
    """KVP: keep the tokens the per-head RL rankers rank highest (see the module docstring).

    Args:
        budget: tokens kept per sequence per layer.
        scorer: a trained per-head `KVScorer`, or the path of its file
            (``JUDGE_DIR / "kvp.safetensors"`` for the judge).
        shape: the model's `ScorerShape`, when ``scorer`` is a path.
        n_recent: the newest tokens always kept (default
            `kvevict.tokens.learned.N_RECENT`).
    """

    method: ClassVar[str] = "kvp"

    def reduce_heads(self, scores: Tensor) -> Tensor:
        return torch.log_softmax(scores, dim=-1).sum(dim=1)


def ranking_reward(order: Tensor, utility: Tensor,
                   budgets: Sequence[float] = REWARD_BUDGETS) -> Tensor:
    """The share of future utility the top ``b`` tokens of ``order`` keep, averaged over the
    ``budgets`` (fractions of the ``T`` tokens). ``order``: long ``[..., T]`` (best first);
    ``utility``: ``[..., T]`` non-negative. Returns ``[...]`` in [0, 1]."""
    length = utility.shape[-1]
    kept = utility.gather(-1, order).cumsum(-1)
    total = utility.sum(-1, keepdim=True).clamp_min(1e-12)
    cuts = torch.tensor([max(1, round(b * length)) - 1 for b in budgets], device=order.device)
    return (kept.index_select(-1, cuts) / total).mean(-1)


def _plackett_luce_logp(scores: Tensor, order: Tensor) -> Tensor:
    """Log-probability of the full ranking ``order`` under Plackett–Luce with ``scores``."""
    s = scores.gather(-1, order)
    tail = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)  # logsumexp of s[i:]
    return (s - tail).sum(-1)


def train_kvp(traces: Sequence[dict[str, Any]], shape: ScorerShape, *, epochs: int = 3,
              lr: float = 3e-3, hidden: int = 32, seed: int = 0,
              budgets: Sequence[float] = REWARD_BUDGETS,
              log: Callable[[str], None] | None = None) -> KVScorer:
    """Train per-head KVP rankers on ``traces`` (`kvevict.judge.judge_traces`: per layer the
    context ``keys``, ``values`` and the future ``utility`` per kv head)."""
    for b in budgets:
        if not 0.0 < b <= 1.0:
            raise ConfigError(f"reward budgets must be in (0, 1], got {b!r}")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    scorer = KVScorer(shape, hidden, per_head=True)
    opt = torch.optim.Adam(scorer.parameters(), lr=lr)
    step = 0
    for _ in range(epochs):
        for trace in traces:
            loss = torch.zeros(())
            gain = 0.0
            for layer in range(shape.layers):
                scores = scorer(layer, trace["keys"][layer], trace["values"][layer])
                utility = trace["utility"][layer]
                u = torch.rand(scores.shape, generator=gen).clamp(1e-9, 1 - 1e-9)
                sampled = (scores.detach() - torch.log(-torch.log(u))).argsort(-1, True)
                greedy = scores.detach().argsort(-1, descending=True)
                advantage = (ranking_reward(sampled, utility, budgets)
                             - ranking_reward(greedy, utility, budgets))
                logp = _plackett_luce_logp(scores, sampled)
                loss = loss - (advantage * logp).mean()
                gain += float(ranking_reward(greedy, utility, budgets).mean())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if log is not None and step % 10 == 0:
                log(f"kvp step {step} greedy reward {gain / shape.layers:.4f}")
            step += 1
    return scorer.eval()
