"""Least frequently used, with optional exponential aging and an LRU tie-break.

Frequency = accesses = 1 + prefix hits. With ``half_life`` set, a block's frequency decays
by half every ``half_life`` seconds since its last access:
``f(now) = (1 + hits) * 2 ** (-(now - last_access) / half_life)``. All candidates decay at
the same rate, so their order never changes while they wait; the heap key is
``log2(1 + hits) + last_access / half_life``, the log of ``f`` up to a shared term.
Source: the LFU-with-aging family (e.g. LFU-DA, Arlitt et al., 2000); vLLM and SGLang ship LRU.
"""

from __future__ import annotations

import math

from kvevict.errors import ConfigError
from kvevict.policies.base import ScoredPolicy, register_policy
from kvevict.types import BlockInfo

__all__ = ["LFU"]


@register_policy("lfu")
class LFU(ScoredPolicy):
    """Evict the candidate with the fewest (aged) accesses; ties: least recently used.

    Args:
        half_life: seconds for an unused block's frequency to halve; None disables aging.
    """

    def __init__(self, half_life: float | None = None) -> None:
        super().__init__()
        if half_life is not None and (
            isinstance(half_life, bool) or not isinstance(half_life, (int, float))
            or not half_life > 0 or math.isinf(half_life)
        ):
            raise ConfigError(f"half_life must be a positive finite number or None, "
                              f"got {half_life!r}")
        self.half_life = half_life

    def score(self, block: BlockInfo, now: float) -> float:
        if self.half_life is None:
            return float(block.hit_count)
        return math.log2(1 + block.hit_count) + block.last_access / self.half_life

    def __repr__(self) -> str:
        return f"LFU(half_life={self.half_life})"
