"""Belady's offline oracle: evict the candidate whose next use lies furthest in the future.

Given the future (a trace), the victim is the candidate (cached, unused leaf) whose next
access comes last; blocks never used again go first, ties by least recent access. Candidates
are leaves, so prefix closure holds. It is the upper bound every chart shows: no online
policy can know more. Source: L. A. Belady, "A study of replacement algorithms for a
virtual-storage computer", IBM Systems Journal 5(2), 1966.

**Why a static heap is exact.** A block's future is the sorted list of clock times at which
the requests that use it begin. Its next use at time ``now`` is the first of those times
``> now``. That key only changes when the clock passes one of the block's access times, i.e.
when a request containing the block begins. While the block is a candidate it is a resident
leaf, and prefix closure makes every ancestor resident too, so such a request's prefix lookup
reaches it: the block is *hit*, acquired, and stops being a candidate before the key could
change. So the key computed when a block becomes a candidate stays right until it leaves the
candidate set, and a heap keyed on ``-next_use`` (tie: least recently accessed) answers
``victim`` in O(log n) amortized, through `ScoredPolicy`.

This needs the clock at each ``begin`` to be the access time the future lists for that
request, and distinct requests to begin at distinct times. `kvevict.replay` arranges both (it
sets the clock to the request index, or to strictly increasing arrival times, and builds the
future from the same requests). With a scheduler that delays requests, keys are computed from
planned access times and the oracle is an approximation.

Among evictable blocks, a descendant is used only by requests that also use its ancestors, so
its next use is never earlier than theirs: the furthest-next-use leaf is a furthest-next-use
block overall, and restricting the choice to leaves loses nothing.

Without a future (``Belady()``, as ``make_policy("belady")`` builds it) every block is
"never used again" and the order degenerates to the tie-break: least recently used first.
``build_policy("belady", requests=..., time_axis=...)`` (what the simulator, the replay and the
engine call) gives it the future of those requests.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from kvevict.errors import ConfigError
from kvevict.hashing import block_hashes
from kvevict.policies.base import ScoredPolicy, register_policy
from kvevict.types import BlockInfo, Request

__all__ = ["Belady", "request_times"]

_TIME_MODES = ("index", "arrival")


def request_times(requests: Sequence[Request], time: str = "index") -> list[float]:
    """The access time of each request on a strictly increasing axis.

    ``"index"``: request ``i`` is at time ``i``. ``"arrival"``: its ``arrival``, nudged up to
    the next representable float when it does not exceed the previous request's time (ties
    and out-of-order arrivals), so every request begins at a distinct time, as the oracle
    requires.
    """
    if time == "index":
        return [float(i) for i in range(len(requests))]
    if time == "arrival":
        out: list[float] = []
        last = -math.inf
        for req in requests:
            t = float(req.arrival)
            if t <= last:
                t = math.nextafter(last, math.inf)
            out.append(t)
            last = t
        return out
    raise ConfigError(f"time must be one of {', '.join(_TIME_MODES)}, got {time!r}")


@register_policy("belady")
class Belady(ScoredPolicy):
    """Evict the candidate whose next use is furthest away (never used again: first).

    Args:
        future: block hash -> access times (clock values at which the requests using the
            block begin). Each list is copied and sorted. None or empty: no block is ever
            used again, so the order is least recently used. Build it from a trace with
            `Belady.from_requests`.

    O(log n) per event (static heap; see the module docstring for why that is exact).

    It is **offline** (``offline = True``): `kvevict.policies.registry.build_policy` builds it
    by name from the run's requests through `from_requests`, and reports label it the oracle.
    """

    #: Needs the future: built from the run's requests (`from_requests`).
    offline: ClassVar[bool] = True

    def __init__(self, future: Mapping[Any, Iterable[float]] | None = None) -> None:
        super().__init__()
        if future is None:
            future = {}
        if not isinstance(future, Mapping):
            raise ConfigError(
                "future must map block hashes to access times (a dict of lists), got "
                f"{type(future).__name__}"
            )
        table: dict[Any, list[float]] = {}
        for key, times in future.items():
            if isinstance(times, (str, bytes)) or not isinstance(times, Iterable):
                raise ConfigError(
                    f"future[{key!r}] must be a sequence of access times, got "
                    f"{type(times).__name__}"
                )
            values = []
            for t in times:
                if isinstance(t, bool) or not isinstance(t, (int, float, np.integer,
                                                             np.floating)) or t != t:
                    raise ConfigError(f"future[{key!r}] holds {t!r}; access times are numbers")
                values.append(float(t))
            values.sort()
            table[key] = values
        self._future = table

    @classmethod
    def from_requests(cls, requests: Iterable[Request], *, block_size: int | None = None,
                      extra_key: Any = None,
                      time: str | Sequence[float] = "index") -> Belady:
        """The oracle for a known sequence of requests.

        Args:
            requests: the requests, in the order they will begin.
            block_size: tokens per block; needed when any request gives ``tokens`` (hashed
                with `kvevict.hashing.block_hashes`, as the manager does). Requests given as
                ``block_hashes`` use their ids as they are.
            extra_key: the manager's ``extra_key``, for token-mode requests.
            time: the clock value at which each request begins: ``"index"`` (request ``i``
                at ``i``), ``"arrival"`` (its arrival, made strictly increasing; see
                `request_times`) or an explicit sequence, one time per request.
        """
        reqs = list(requests)
        for req in reqs:
            if not isinstance(req, Request):
                raise ConfigError(f"from_requests takes Requests, got {type(req).__name__}")
        if isinstance(time, str):
            times = request_times(reqs, time)
        else:
            times = list(time)
            if len(times) != len(reqs):
                raise ConfigError(f"time gives {len(times)} values for {len(reqs)} requests")
        future: dict[Any, list[float]] = {}
        for req, t in zip(reqs, times, strict=True):
            if req.block_hashes is not None:
                hashes: Iterable[Any] = req.block_hashes
            else:
                if block_size is None:
                    raise ConfigError(
                        f"request {req.request_id!r} gives tokens; pass block_size= to hash "
                        "them into blocks"
                    )
                hashes = block_hashes(req.tokens, block_size, extra_key)
            for h in hashes:
                future.setdefault(h, []).append(t)
        return cls(future)

    @property
    def num_blocks_known(self) -> int:
        """Distinct block hashes in the future."""
        return len(self._future)

    def next_use(self, block_hash: Any, now: float) -> float:
        """First access time of ``block_hash`` after ``now``; ``inf`` if never again."""
        times = self._future.get(block_hash)
        if not times:
            return math.inf
        i = bisect_right(times, now)
        return times[i] if i < len(times) else math.inf

    def score(self, block: BlockInfo, now: float) -> float:
        return -self.next_use(block.block_hash, now)

    def __repr__(self) -> str:
        return f"Belady(blocks_known={len(self._future)})"
