"""TOVA: keep the tokens the current query attends to most.

Source: Oren et al., "Transformers are Multi-State RNNs" (EMNLP 2024, arXiv:2401.06104): Token
Omission Via Attention drops, whenever the cache is over budget, the tokens with the lowest
attention from the *last* query, averaged over the heads; no window, no sinks, no accumulated
history. kvpress's ``TOVAPress`` scores a prefill the same way, with the last token's attention
averaged over heads. A strong training-free baseline: it is what attention says now.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from kvevict.tokens.base import TokenPolicy, register_token_policy

__all__ = ["TOVA"]


@register_token_policy("tova")
class TOVA(TokenPolicy):
    """Score: the last query's attention to each stored token, averaged over the kv heads
    (each the mean of its GQA group's query heads, as the caller provides it).

    Args:
        budget: tokens kept per sequence per layer.
    """

    needs_attention: ClassVar[bool] = True

    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        assert attention is not None  # _check raised otherwise
        return self._mask(attention[:, :, -1, :].float().mean(dim=1), valid)
