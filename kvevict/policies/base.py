"""The residency `Policy` protocol, the `ScoredPolicy` base and the policy registry.

The manager owns all cache state; a policy observes events and ranks candidates. Block events
carry the block's read-only `BlockInfo` (its ``parent`` record too) and the clock time
``now``; request events carry the `Request`:

| event | when | default |
|---|---|---|
| ``bind(block_size)`` | once, when a manager takes the policy | stores ``manager_block_size`` |
| ``on_begin(request, hits, new, now)`` | a request began: its hits, the blocks it cached | no-op |
| ``on_insert(block, now)`` | a full block became cached (in use, no candidate yet) | no-op |
| ``on_hit(block, now)`` | a prefix lookup reused it (decode appends are not hits) | no-op |
| ``on_hits(request, hits, now)`` | a begin or resume reused these blocks (after on_hit) | no-op |
| ``on_candidate(block, now)`` | it entered the candidate set (cached, ref 0, leaf) | required |
| ``on_uncandidate(block, now)`` | it left the candidate set without being evicted | required |
| ``on_evict(block, now)`` | the manager evicts it (no separate ``on_uncandidate``) | required |
| ``victim(now)`` | name one current candidate to evict (a peek), or None if none | required |
| ``pop_victim(now)`` | optional: ``victim`` and ``on_evict`` in one call | not called |
| ``on_finish(request, blocks, now)`` | a request finished: the cached blocks it held | no-op |
| ``on_preempt(request, blocks, now)`` | preempted: the blocks it held, still held | no-op |
| ``on_resume(request, hits, new, now)`` | a preempted request resumed: as ``on_begin`` | no-op |

``on_evict`` is sent for every evicted block, including a pinned one the policy was never
offered (evicted only when no other candidate existed). A victim that is not a candidate
makes the manager raise `PolicyError`. An event that raises must leave the policy as it was;
the manager then raises `PolicyError` naming the policy, the event and the block, and stays
consistent (see `kvevict.manager`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from sortedcontainers import SortedList

from kvevict.errors import ConfigError
from kvevict.types import BlockInfo, Request

__all__ = [
    "Policy",
    "ScoredPolicy",
    "available_policies",
    "hook",
    "make_policy",
    "pop_victim_of",
    "register_policy",
]


class Policy(abc.ABC):
    """Base of residency policies. Subclasses implement the candidate index and `victim`.

    The no-op hooks (``on_begin``, ``on_insert``, ``on_hit``, ``on_hits``, ``on_finish``,
    ``on_preempt``, ``on_resume``) are
    there so a policy only overrides what it uses; the manager never calls one left as it is.
    """

    #: Registry name, set by `register_policy`.
    name: ClassVar[str] = ""
    #: Whether the policy needs the future (an oracle such as Belady): then it is built from
    #: the requests (``from_requests``) by `build_policy`, and reports list it last.
    offline: ClassVar[bool] = False

    #: Tokens per block of the manager this policy serves (set by `bind`; None before).
    manager_block_size: int | None = None

    def bind(self, block_size: int) -> None:
        """A manager with blocks of ``block_size`` tokens took this policy."""
        if self.manager_block_size is not None and self.manager_block_size != block_size:
            raise ConfigError(f"{self!r} already serves blocks of {self.manager_block_size} "
                              f"tokens; use a fresh policy for blocks of {block_size}")
        self.manager_block_size = block_size

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        """``request`` began: ``hits`` are its cached prefix (``len(hits) * block_size``
        tokens), ``new`` the blocks it cached (its first prefill chunk's)."""

    def on_insert(self, block: BlockInfo, now: float) -> None:
        """A full block became cached (it is in use, not yet a candidate)."""

    def on_hit(self, block: BlockInfo, now: float) -> None:
        """A prefix lookup reused ``block``."""

    def on_hits(self, request: Request, hits: Sequence[BlockInfo], now: float) -> None:
        """A prefix lookup of ``request`` (its `begin`, or a `resume` after a preemption)
        reused ``hits``, its cached prefix in chain order (not empty): every one of them is
        stamped already, and each had its ``on_hit``. Sent before the request's new blocks
        are cached, so a policy that batches its hit work here sees the same state as per
        block in ``on_hit``."""

    def on_finish(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        """``request`` finished; ``blocks`` are the cached blocks it held, in order (empty if
        it was preempted). Its ``output_len`` is the answer's length: as the request
        declared it or, when it declared none (0), the tokens appended to its sequence (the
        vLLM plugin: the tokens the request generated)."""

    def on_preempt(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        """``request`` was preempted and waits to resume (a scheduler resumes preempted
        requests first): ``blocks`` are the cached blocks it held, in chain order. Sent
        before they are released, so a policy can price them as coming back when they
        become candidates right after this call; if it raises, the request stays running."""

    def on_resume(self, request: Request, hits: Sequence[BlockInfo],
                  new: Sequence[BlockInfo], now: float) -> None:
        """A preempted ``request`` resumed: ``hits`` are its cached prefix as found now,
        ``new`` the blocks it cached (as for `on_begin`, which a resume does not send)."""

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

    #: Optional, for speed: a method ``pop_victim(now) -> block id or None`` that names the
    #: next victim *and* forgets it, as `victim` followed by `on_evict` would; the manager then
    #: evicts that block without sending ``on_evict``. None here: the manager calls `victim`
    #: and `on_evict`. A policy whose index can pop its minimum defines it to save a call per
    #: eviction (`LRU`, `ScoredPolicy`). A subclass that redefines `victim` or `on_evict`
    #: below the class that defines ``pop_victim`` is asked through those instead.
    pop_victim: ClassVar[Callable[..., int | None] | None] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ScoredPolicy(Policy):
    """A policy defined by one function: ``score(block, now)``; the lowest score goes first.

    Ties go to the least recently accessed block (``last_access_tick``), so a chain released
    at one instant loses its tail before its head.

    When the score does not depend on ``now`` (the default, ``time_dependent = False``) it is
    computed once when the block becomes a candidate and kept in an ordered index
    (`sortedcontainers.SortedList`): each event costs O(log n). The candidate offered last is
    held beside the index until the next one is offered, and is the victim when it is below
    the index's first: an eviction exposes its victim's parent, which is often the next
    victim (a chain's tail goes block by block: 92% of LFU's victims on the bundled trace),
    and then costs no index insertion or removal. A subclass whose score changes
    with time while the block waits sets ``time_dependent = True``; ``victim`` then rescans
    every candidate (O(n)), which is fine for experiments and what a dedicated index (see the
    market policy) avoids.

    A complete policy::

        class MostRecentFirst(ScoredPolicy):
            def score(self, block, now):
                return -block.last_access
    """

    time_dependent: ClassVar[bool] = False

    def __init__(self) -> None:
        self._order = SortedList()  # (score, last access tick, block id), lowest first
        self._held: tuple[Any, int, int] | None = None  # the last offered, beside the index
        self._keys: dict[int, tuple[Any, int, int]] = {}  # every indexed or held key
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
        held = self._held
        if held is not None:
            self._order.add(held)
        self._held = key
        self._keys[block_id] = key

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._forget(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._forget(block.block_id)

    def _forget(self, block_id: int) -> None:
        if self.time_dependent:
            self._blocks.pop(block_id, None)
            return
        key = self._keys.pop(block_id, None)
        if key is self._held:
            self._held = None
        elif key is not None:
            self._order.remove(key)

    def pop_victim(self, now: float) -> int | None:
        if self.time_dependent:
            chosen = self.victim(now)
            if chosen is not None:
                del self._blocks[chosen]
            return chosen
        order, key = self._order, self._held
        if key is not None and (not order or key < order[0]):
            self._held = None
        elif order:
            key = order.pop(0)
        else:
            return None
        del self._keys[key[2]]
        return key[2]

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
        order, held = self._order, self._held
        if held is not None and (not order or held < order[0]):
            return held[2]
        return order[0][2] if order else None

    def __len__(self) -> int:
        return len(self._blocks) if self.time_dependent else len(self._keys)


# -- registry ------------------------------------------------------------------------------
# The registry is `kvevict.policies.registry` (one generic `kvevict.registry.Registry` serves
# block and token policies); its names are re-exported here, where the policy modules import
# them from. Imported last because that module needs `Policy` above.


def pop_victim_of(policy: Policy) -> Callable[[float], Any] | None:
    """The policy's ``pop_victim`` if it has one that agrees with its ``victim`` and
    ``on_evict``: a subclass that redefines either (say, an LRU that picks another victim)
    is asked through them instead, so its override is never bypassed. The manager, the
    memory tiers and the vLLM adapter all evict through this."""
    mro = type(policy).__mro__

    def owner(name: str) -> int:
        return next(i for i, cls in enumerate(mro) if name in cls.__dict__)

    pop = owner("pop_victim")
    if mro[pop].__dict__["pop_victim"] is None or min(owner("victim"), owner("on_evict")) < pop:
        return None
    return policy.pop_victim  # type: ignore[return-value]


def hook(obj: object, base: type, name: str) -> Callable[..., Any] | None:
    """``obj``'s bound method ``name`` if its class overrides ``base``'s no-op, else None
    (a caller skips hooks left as no-ops: a hot path)."""
    return None if getattr(type(obj), name) is getattr(base, name) else getattr(obj, name)


from kvevict.policies.registry import (  # noqa: E402
    available_policies,
    make_policy,
    register_policy,
)
