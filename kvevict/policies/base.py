"""The residency `Policy` protocol, the `ScoredPolicy` base and the policy registry.

The manager owns all cache state; a policy observes events and ranks candidates. Every event
carries the block's read-only `BlockInfo` and the current clock time ``now``:

- ``on_insert``: a full block became cached.
- ``on_hit``: a prefix lookup reused it (decode appends are not hits).
- ``on_candidate`` / ``on_uncandidate``: it entered / left the candidate set (cached, ref
  count 0, leaf of the prefix tree).
- ``on_evict``: the manager evicted it (it also leaves the candidate set; no separate
  ``on_uncandidate`` is sent). Sent for every evicted block, including an explicitly pinned
  one the policy was never offered (evicted only when no other candidate existed).

``victim(now)`` names one current candidate by block id, without removing it (a peek); the
manager evicts it and then sends ``on_evict``. It returns None only when the policy holds no
candidate. A victim that is not a candidate makes the manager raise `PolicyError`.
"""

from __future__ import annotations

import abc
import heapq
from typing import Any, ClassVar

from kvevict.types import BlockInfo

__all__ = [
    "Policy",
    "ScoredPolicy",
    "available_policies",
    "make_policy",
    "register_policy",
]


class Policy(abc.ABC):
    """Base of residency policies. Subclasses implement the candidate index and `victim`.

    The no-op ``on_insert`` / ``on_hit`` are there so a policy only overrides what it uses.
    """

    #: Registry name, set by `register_policy`.
    name: ClassVar[str] = ""

    def on_insert(self, block: BlockInfo, now: float) -> None:
        """A full block became cached (it is in use, not yet a candidate)."""

    def on_hit(self, block: BlockInfo, now: float) -> None:
        """A prefix lookup reused ``block``."""

    @abc.abstractmethod
    def on_candidate(self, block: BlockInfo, now: float) -> None:
        """``block`` entered the candidate set."""

    @abc.abstractmethod
    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        """``block`` left the candidate set without being evicted."""

    @abc.abstractmethod
    def on_evict(self, block: BlockInfo, now: float) -> None:
        """``block`` was evicted; forget it."""

    @abc.abstractmethod
    def victim(self, now: float) -> int | None:
        """The block id to evict next (a current candidate), or None when there is none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ScoredPolicy(Policy):
    """A policy defined by one function: ``score(block, now)``; the lowest score goes first.

    Ties go to the least recently accessed block (``last_access_tick``), so a chain released
    at one instant loses its tail before its head.

    When the score does not depend on ``now`` (the default, ``time_dependent = False``) it is
    computed once when the block becomes a candidate and kept in a heap: ``victim`` costs
    O(log n) amortized. A subclass whose score changes with time while the block waits sets
    ``time_dependent = True``; ``victim`` then rescans every candidate (O(n)), which is fine
    for experiments and what a dedicated index (see the market policy) avoids.

    A complete policy::

        class MostRecentFirst(ScoredPolicy):
            def score(self, block, now):
                return -block.last_access
    """

    time_dependent: ClassVar[bool] = False

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, int]] = []
        self._keys: dict[int, tuple[Any, int, int]] = {}
        self._blocks: dict[int, BlockInfo] = {}

    @abc.abstractmethod
    def score(self, block: BlockInfo, now: float) -> Any:
        """Eviction priority of a candidate: lower is evicted first. Floats or tuples."""

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        block_id = block.block_id
        if self.time_dependent:
            self._blocks[block_id] = block
            return
        key = (self.score(block, now), block.last_access_tick, block_id)
        self._keys[block_id] = key
        heapq.heappush(self._heap, key)
        if len(self._heap) > 2 * len(self._keys) + 64:  # drop stale entries
            self._heap = list(self._keys.values())
            heapq.heapify(self._heap)

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._forget(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._forget(block.block_id)

    def _forget(self, block_id: int) -> None:
        if self.time_dependent:
            self._blocks.pop(block_id, None)
        else:
            self._keys.pop(block_id, None)

    def victim(self, now: float) -> int | None:
        if self.time_dependent:
            if not self._blocks:
                return None
            score = self.score
            best = min(
                self._blocks.values(),
                key=lambda b: (score(b, now), b.last_access_tick, b.block_id),
            )
            return best.block_id
        heap, keys = self._heap, self._keys
        while heap:
            key = heap[0]
            if keys.get(key[2]) is key:
                return key[2]
            heapq.heappop(heap)
        return None

    def __len__(self) -> int:
        return len(self._blocks) if self.time_dependent else len(self._keys)


# -- registry ------------------------------------------------------------------------------
# The registry is `kvevict.policies.registry` (one generic `kvevict.registry.Registry` serves
# block and token policies); its names are re-exported here, where the policy modules import
# them from. Imported last because that module needs `Policy` above.

from kvevict.policies.registry import (  # noqa: E402
    available_policies,
    make_policy,
    register_policy,
)
