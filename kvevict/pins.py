"""Explicit pins with expiry, and the candidates the manager withholds from its policy.

`KVCacheManager.pin` marks cached blocks to keep until a clock time (or until `unpin`). A
pinned block that becomes a candidate is *withheld*: the policy never hears of it, and it is
evicted only when the policy offers no candidate at all (earliest pin expiry first, then the
least recently used). When a pin expires or is removed, a withheld block is handed back to the
policy as a new candidate.

The same place holds the candidates a policy *refused*: a block whose ``on_candidate`` raised.
The policy may not index it, so the manager keeps it itself and evicts it before asking the
policy for a victim (it has no rank to wait for).

Pins keeps its two ordered indexes in `sortedcontainers.SortedList`: the finite pins by expiry
(which pins lapse at ``now``) and the withheld candidates by (expiry, last access) (which one
to evict when nothing else is left). It never touches the pool, the tree or the policy; the
manager asks and acts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from sortedcontainers import SortedList

from kvevict.types import BlockInfo

__all__ = ["Pins"]


class Pins:
    """Pinned block ids with their expiry, and the withheld and refused candidates."""

    def __init__(self) -> None:
        self._until: dict[int, float] = {}  # block id -> pinned until (inf: until unpinned)
        self._expiring = SortedList()  # (until, block id) of the finite pins
        self._withheld: dict[int, BlockInfo] = {}  # pinned candidates kept from the policy
        self._withheld_order = SortedList()  # (until, last access tick, block id)
        self._refused: dict[int, BlockInfo] = {}  # candidates whose on_candidate raised
        #: pinned block id -> until: a read-only live view
        self.pinned: Mapping[int, float] = MappingProxyType(self._until)
        #: candidates kept from the policy (pinned or refused), by block id: read-only view
        self.withheld: Mapping[int, BlockInfo] = MappingProxyType(self._withheld)
        #: candidates whose ``on_candidate`` raised, by block id: a read-only live view
        self.refused: Mapping[int, BlockInfo] = MappingProxyType(self._refused)
        #: the earliest finite expiry (inf when none)
        self.next_expiry = math.inf

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._until

    def __iter__(self) -> Iterator[int]:
        return iter(self._until)

    # -- pinning -----------------------------------------------------------------------------

    def pin(self, block: BlockInfo, expiry: float) -> bool:
        """Pin ``block`` until ``expiry`` (a longer existing pin stays). Return True when the
        block is a new pin: if it is a candidate, the caller withdraws it from the policy and
        then calls `withhold`."""
        block_id = block.block_id
        old = self._until.get(block_id)
        if old is not None and old >= expiry:
            return False
        self._until[block_id] = expiry
        if old is not None and old != math.inf:
            self._expiring.remove((old, block_id))
        if expiry != math.inf:
            self._expiring.add((expiry, block_id))
            self.next_expiry = self._expiring[0][0]
        if old is not None and block_id in self._withheld:
            self._withheld_order.remove((old, block.last_access_tick, block_id))
            self._withheld_order.add((expiry, block.last_access_tick, block_id))
        if old is None and block_id in self._refused:  # already kept from the policy
            del self._refused[block_id]
            self._hold(block)
            return False
        return old is None

    def unpin(self, block_id: int) -> BlockInfo | None:
        """Remove a pin; return the block if it was withheld (the caller offers it to the
        policy)."""
        until = self._until.pop(block_id)
        if until != math.inf:
            self._expiring.remove((until, block_id))
            self.next_expiry = self._expiring[0][0] if self._expiring else math.inf
        block = self._withheld.pop(block_id, None)
        if block is not None:
            self._withheld_order.remove((until, block.last_access_tick, block_id))
        return block

    def expire(self, now: float) -> list[BlockInfo]:
        """Drop the pins due at ``now``; return the withheld blocks they released, by expiry
        (the caller offers them to the policy)."""
        expiring = self._expiring
        released = []
        while expiring and expiring[0][0] <= now:
            _, block_id = expiring[0]
            block = self.unpin(block_id)
            if block is not None:
                released.append(block)
        return released

    def is_pinned(self, block_id: int, now: float) -> bool:
        """Whether a block is pinned past ``now``."""
        until = self._until.get(block_id)
        return until is not None and until > now

    # -- withheld candidates -----------------------------------------------------------------

    def withhold(self, block: BlockInfo) -> bool:
        """A block became a candidate: keep it from the policy if it is pinned (True)."""
        if block.block_id not in self._until:
            return False
        self._hold(block)
        return True

    def _hold(self, block: BlockInfo) -> None:
        block_id = block.block_id
        self._withheld[block_id] = block
        self._withheld_order.add((self._until[block_id], block.last_access_tick, block_id))

    def refuse(self, block: BlockInfo) -> None:
        """Keep a candidate the policy failed to take (its ``on_candidate`` raised)."""
        self._refused[block.block_id] = block

    def take_back(self, block_id: int) -> bool:
        """A candidate left the candidate set (hit or evicted): True if it was kept here (then
        the policy never had it)."""
        block = self._withheld.pop(block_id, None)
        if block is not None:
            self._withheld_order.remove(
                (self._until[block_id], block.last_access_tick, block_id))
            return True
        return self._refused.pop(block_id, None) is not None

    def evicted(self, block_id: int) -> None:
        """A block left the cache: forget its pin."""
        self.take_back(block_id)
        if block_id in self._until:
            self.unpin(block_id)

    def fallback(self) -> BlockInfo | None:
        """The kept candidate to evict when the policy offers none: a refused one first, else
        the pinned one whose pin ends first (then the least recently used)."""
        if self._refused:
            return next(iter(self._refused.values()))
        if self._withheld_order:
            return self._withheld[self._withheld_order[0][2]]
        return None

    def __repr__(self) -> str:
        return (f"Pins(pinned={len(self._until)}, withheld={len(self._withheld)}, "
                f"refused={len(self._refused)})")
