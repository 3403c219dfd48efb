"""Admission control: may a request evict cached state to start now, or should it wait?

The manager (and the scheduler) consult an `Admission` before a request evicts anything: when
the pool is full of state worth more than what the new request would produce, the request
waits instead (``../seeds``: "spare queue capacity so a batch job can't starve an interactive
user"). Implementations bound the wait so nothing starves. The default, `AlwaysAdmit`, never
defers: the behaviour of vLLM and SGLang. The simulator names its admissions
(``kvevict simulate --admission``, `kvevict.study.Study.admission`):
`kvevict.policies.market.admission.ADMISSIONS`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import attrs

from kvevict.types import Request

if TYPE_CHECKING:
    from kvevict.manager import KVCacheManager

__all__ = ["Admission", "AdmissionDecision", "AlwaysAdmit"]


@attrs.frozen
class AdmissionDecision:
    """``admit`` or not; when not, ``retry_after`` seconds and a ``reason`` for the logs."""

    admit: bool
    reason: str = ""
    retry_after: float = 0.0


ADMIT = AdmissionDecision(True)


class Admission(abc.ABC):
    """Decides whether ``request`` may evict ``num_evictions`` candidates right now.

    Called only when the request cannot start from free blocks alone, after its cache hits
    are held (so they are not among the candidates). It must not change the cache.
    """

    @abc.abstractmethod
    def admit(self, request: Request, num_evictions: int, manager: KVCacheManager,
              now: float) -> AdmissionDecision:
        """Admit, or defer with a reason and a suggested wait."""

    def on_admitted(self, request: Request, now: float) -> None:
        """The request started (its deferral, if any, is over)."""


class AlwaysAdmit(Admission):
    """Never defer: evict whatever the policy picks (vLLM's and SGLang's behaviour)."""

    def admit(self, request: Request, num_evictions: int, manager: KVCacheManager,
              now: float) -> AdmissionDecision:
        return ADMIT
