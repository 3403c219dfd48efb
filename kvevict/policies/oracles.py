"""Partial oracles: what Belady's gap over LRU is made of, *classification* or *timing*.

Belady (`kvevict.policies.belady`) knows when every block is next used. The two oracles here
know less, and otherwise run LRU, so that a gap can be split:

- **reuse oracle** (``"reuse-oracle"``): knows only *whether* a block is used again in the
  rest of the trace. Dead blocks (never used again) go first, in LRU order, then live ones,
  in LRU order. What it gains over LRU is the value of telling reused blocks from dead ones;
  what Belady gains over it is the value of knowing *when*.
- **horizon oracle** (``"horizon-oracle"``, parameter ``horizon`` = H): knows whether the
  block's next use falls within H of now on the run's clock. Blocks whose next use is
  beyond ``now + H``, or never, go first, in LRU order, then the rest, in LRU order. It is
  the question an online predictor can hope to answer ("back within H?"). H = 0 is LRU
  exactly (no candidate's next use is at or before now), H = ∞ the reuse oracle exactly;
  the tests check both identities eviction by eviction.

**Why fixing a block's next use when it becomes a candidate is exact.** As for Belady (see
`kvevict.policies.belady`): a candidate is a resident leaf whose ancestors are resident too,
so the next request using it hits it and takes it out of the candidate set; its next use
cannot change while it waits. So the reuse oracle's class (dead or live) is fixed for the
whole candidacy, and the horizon oracle's changes at most once, from "beyond H" to "within
H", when the clock reaches ``next use - H``: a heap of the waiting blocks keyed by their next
use moves them over as the clock passes. Within each class the order is LRU's: the classes
are two `LRU` indexes, so every event costs O(log n) amortized (O(1) in the common case) and
the victim is the head of the first non-empty class. The victim is always a candidate, so
prefix closure holds.

**Time units.** H is in the units of the run's clock: seconds on the arrival axis (the
timed simulator, ``kvevict replay --time arrival``), requests on the index axis (the
replay's default). Next uses are compared as ``next_use <= now + H`` (a float comparison on
the clock's own values).

**Default horizon.** `DEFAULT_HORIZON` is 300 seconds: the lifetime of a cached prompt prefix
in production prompt caches. Anthropic's prompt cache keeps a prefix 5 minutes after its
last use by default (https://docs.claude.com/en/docs/build-with-claude/prompt-caching), and
Azure OpenAI's in-memory retention "typically clears caches within 5 to 10 minutes of
inactivity" (https://learn.microsoft.com/azure/foundry/openai/how-to/prompt-caching). It is
a reference point, not a tuned value: `kvevict replay --horizons` sweeps others.

**Where they are built.** Like Belady they are offline (``offline = True``):
`kvevict.policies.registry.build_policy` builds them from the run's requests
(`HorizonOracle.from_requests`, keeping every access time of every block in memory), so they
work in the timed simulator (as approximations there, like Belady: the scheduler may delay a
request past its planned time) and in the engine. `kvevict.replay` streams them instead,
like Belady (`HorizonOracle.from_next_uses`): the next use of each block access comes from
the trace's `kvevict.policies.belady.NextUseFile`, and on the arrival axis the requests'
arrivals from the same file, read forward as the clock advances. The file-backed and the
in-memory oracles give the same victims (the tests compare them eviction by eviction on the
bundled trace).
"""

from __future__ import annotations

import abc
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.policies.belady import Belady, NextUseFile, NextUseReader, ReaderBacked
from kvevict.policies.lru import LRU
from kvevict.types import BlockInfo, Request

__all__ = ["DEFAULT_HORIZON", "FileHorizonOracle", "FileReuseOracle", "HorizonOracle",
           "ReuseOracle", "TwoClassOracle", "check_horizon"]

#: The horizon oracle's default H: 300 seconds, the default lifetime of a cached prefix in
#: production prompt caches (see the module docstring for the sources).
DEFAULT_HORIZON = 300.0

#: Arrivals read at a time by the arrival-axis cursor of `FileHorizonOracle`.
_ARRIVAL_CHUNK = 4096


def check_horizon(horizon: Any) -> float:
    """``horizon`` as a float: a number ``>= 0`` (``inf`` allowed), else a `ConfigError`."""
    if isinstance(horizon, bool) or not isinstance(horizon, (int, float, np.integer,
                                                             np.floating)):
        raise ConfigError(f"horizon must be a number of clock units (seconds on the arrival "
                          f"axis, requests on the index axis) >= 0, got {horizon!r}")
    value = float(horizon)
    if value != value or value < 0:
        raise ConfigError(f"horizon must be >= 0 (0: LRU; inf: the reuse oracle), got "
                          f"{horizon!r}")
    return value


class TwoClassOracle(Policy):
    """Candidates in two LRU-ordered classes: *far* (next use beyond a limit, or never),
    evicted first, then *near*.

    A subclass gives ``next_use_key(block, now)``: the block's next use on some increasing
    axis (``inf``: never), asked once when the block becomes a candidate; and
    ``limit(now)``: a candidate whose key is finite and ``<= limit(now)`` is near. The limit
    must never decrease as the clock advances: a far block is moved to the near class
    (once) when the limit reaches its key, a near block never goes back. Each class is an
    `LRU` index, so within a class the order is exactly LRU's.
    """

    #: Needs the future (built from the requests, or from a next-use file).
    offline: ClassVar[bool] = True

    def __init__(self) -> None:
        self._far = LRU()  # next use beyond the limit, or never: evicted first
        self._near = LRU()
        self._side: dict[int, bool] = {}  # candidate id -> near?
        self._waiting: dict[int, tuple[float, int, BlockInfo]] = {}  # far, finite key
        self._heap: list[tuple[float, int, int]] = []  # (key, tick, id), lazily cleaned

    @abc.abstractmethod
    def next_use_key(self, block: BlockInfo, now: float) -> float:
        """The candidate's next use on the axis of `limit` (``inf``: never used again)."""

    @abc.abstractmethod
    def limit(self, now: float) -> float:
        """The largest next-use key that counts as near at clock time ``now``."""

    @property
    def num_far(self) -> int:
        """Candidates in the far class (as last promoted)."""
        return len(self._far)

    @property
    def num_near(self) -> int:
        """Candidates in the near class (as last promoted)."""
        return len(self._near)

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        key = self.next_use_key(block, now)
        block_id = block.block_id
        if key != math.inf and key <= self.limit(now):
            self._near.on_candidate(block, now)
            self._side[block_id] = True
            return
        self._far.on_candidate(block, now)
        self._side[block_id] = False
        if key != math.inf:
            tick = block.last_access_tick
            self._waiting[block_id] = (key, tick, block)
            heapq.heappush(self._heap, (key, tick, block_id))

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._drop(block.block_id, block, now)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        self._drop(block.block_id, block, now)

    def _drop(self, block_id: int, block: BlockInfo, now: float) -> None:
        near = self._side.pop(block_id, None)
        if near is None:
            return
        if near:
            self._near.on_evict(block, now)
        else:
            self._far.on_evict(block, now)
            self._waiting.pop(block_id, None)

    def _promote(self, now: float) -> None:
        """Move every far candidate whose next use is now within the limit to near."""
        heap = self._heap
        if not heap:
            return
        lim = self.limit(now)
        waiting = self._waiting
        while heap and heap[0][0] <= lim:
            key, tick, block_id = heapq.heappop(heap)
            entry = waiting.get(block_id)
            if entry is None or entry[0] != key or entry[1] != tick:
                continue  # evicted, dropped, or a candidate again since it was pushed
            del waiting[block_id]
            block = entry[2]
            self._far.on_evict(block, now)
            self._near.on_candidate(block, now)
            self._side[block_id] = True

    def victim(self, now: float) -> int | None:
        self._promote(now)
        chosen = self._far.victim(now)
        return chosen if chosen is not None else self._near.victim(now)

    def pop_victim(self, now: float) -> int | None:
        self._promote(now)
        if len(self._far):
            chosen = self._far.pop_victim(now)
            self._waiting.pop(chosen, None)
        else:
            chosen = self._near.pop_victim(now)
        if chosen is not None:
            del self._side[chosen]
        return chosen

    def __len__(self) -> int:
        return len(self._side)


@register_policy("horizon-oracle")
class HorizonOracle(TwoClassOracle):
    """Evict first, in LRU order, the candidates whose next use is beyond ``now + horizon``
    (or never); then the rest, in LRU order.

    Args:
        future: block hash -> access times, as for `Belady` (None or empty: no block is used
            again, so the order is LRU's). Build it from a trace with `from_requests`.
        horizon: H, in clock units (seconds on the arrival axis, requests on the index
            axis), ``>= 0``; ``inf`` is the reuse oracle. Default `DEFAULT_HORIZON` (300).

    Offline: `kvevict.policies.registry.build_policy` builds it from the run's requests
    (with ``horizon`` when given as a parameter); `kvevict.replay` streams its future from
    a next-use file (`from_next_uses`). O(log n) amortized per event.
    """

    def __init__(self, future: Mapping[Any, Iterable[float]] | None = None,
                 horizon: float = DEFAULT_HORIZON) -> None:
        super().__init__()
        self.horizon = check_horizon(horizon)
        #: Belady on the same future: its ``next_use`` is this oracle's lookup
        self.belady = Belady(future)

    @classmethod
    def from_requests(cls, requests: Iterable[Request], *, block_size: int | None = None,
                      extra_key: Any = None, time: str | Sequence[float] = "index",
                      horizon: float = DEFAULT_HORIZON) -> HorizonOracle:
        """The oracle for a known sequence of requests (arguments as for
        `Belady.from_requests`, plus ``horizon``)."""
        oracle = cls(horizon=horizon)  # checked before the future is built
        oracle.belady = Belady.from_requests(requests, block_size=block_size,
                                             extra_key=extra_key, time=time)
        return oracle

    @classmethod
    def from_next_uses(cls, future: NextUseFile, capacity_blocks: int, *,
                       time: str = "index",
                       horizon: float = DEFAULT_HORIZON) -> FileHorizonOracle:
        """The same oracle with its future read from a `NextUseFile` (the replay's path):
        a `FileHorizonOracle` on the clock axis ``time``."""
        return FileHorizonOracle(future, capacity_blocks, time=time, horizon=horizon)

    @property
    def num_blocks_known(self) -> int:
        """Distinct block hashes in the future."""
        return self.belady.num_blocks_known

    def next_use_key(self, block: BlockInfo, now: float) -> float:
        return self.belady.next_use(block.block_hash, now)

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        self.belady.on_begin(request, hits, new, now)  # its future, consumed by requests

    def on_preempt(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        self.belady.on_preempt(request, blocks, now)  # what it held comes back

    def on_resume(self, request: Request, hits: Sequence[BlockInfo],
                  new: Sequence[BlockInfo], now: float) -> None:
        self.belady.on_resume(request, hits, new, now)

    def on_finish(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        self.belady.on_finish(request, blocks, now)

    def limit(self, now: float) -> float:
        return now + self.horizon

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(blocks_known={self.num_blocks_known}, "
                f"horizon={self.horizon:g})")


@register_policy("reuse-oracle")
class ReuseOracle(HorizonOracle):
    """Evict first, in LRU order, the candidates never used again; then the rest, in LRU
    order: the horizon oracle with an infinite horizon.

    Args:
        future: block hash -> access times, as for `Belady` (None or empty: LRU's order).
    """

    def __init__(self, future: Mapping[Any, Iterable[float]] | None = None) -> None:
        super().__init__(future, horizon=math.inf)

    @classmethod
    def from_requests(cls, requests: Iterable[Request], *, block_size: int | None = None,
                      extra_key: Any = None,
                      time: str | Sequence[float] = "index") -> ReuseOracle:
        """The oracle for a known sequence of requests (arguments as for
        `Belady.from_requests`)."""
        oracle = cls()
        oracle.belady = Belady.from_requests(requests, block_size=block_size,
                                             extra_key=extra_key, time=time)
        return oracle

    @classmethod
    def from_next_uses(cls, future: NextUseFile, capacity_blocks: int, *,
                       time: str = "index") -> FileReuseOracle:
        """The same oracle with its future read from a `NextUseFile`: a
        `FileReuseOracle`."""
        return FileReuseOracle(future, capacity_blocks, time=time)

    def __repr__(self) -> str:
        return f"ReuseOracle(blocks_known={self.num_blocks_known})"


class FileHorizonOracle(ReaderBacked, TwoClassOracle):
    """`HorizonOracle` with its future read from a `NextUseFile`: the same victims, for a
    trace of any length.

    It follows the replay through ``on_begin`` with a
    `kvevict.policies.belady.NextUseReader`: a candidate's key is the index of the next
    request using it. The limit at clock time ``now`` is the index of the last request whose
    clock time is ``<= now + horizon``: ``now + horizon`` itself on the index axis (request
    ``j`` begins at ``j``); on the arrival axis a cursor reads the file's arrivals forward
    (made strictly increasing as the replay's clock makes them), so the file must be built
    with ``arrivals=True``. Since clock times increase with the index, ``key <= limit`` is
    ``time of the next use <= now + horizon``, `HorizonOracle`'s test.

    Built by `kvevict.replay` for ``"horizon-oracle"``; `HorizonOracle.from_next_uses`
    builds one by hand.
    """

    name: ClassVar[str] = "horizon-oracle"

    def __init__(self, future: NextUseFile, capacity_blocks: int, *, time: str = "index",
                 horizon: float = DEFAULT_HORIZON) -> None:
        super().__init__()
        if time not in ("index", "arrival"):
            raise ConfigError(f"time must be one of index, arrival, got {time!r}")
        self.horizon = check_horizon(horizon)
        self.time = time
        self.reader = NextUseReader(future, capacity_blocks)
        self.future = future
        self.capacity_blocks = capacity_blocks
        self._arrivals = None
        if time == "arrival" and 0 < self.horizon < math.inf:
            self._arrivals = future.arrival_window()  # ConfigError without arrivals=True
        self._count = 0  # requests whose clock time is <= the last limit asked for
        self._last = -math.inf  # clock time of request _count - 1
        self._buffer: list[float] = []  # raw arrivals of requests _start ...
        self._start = 0

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        self.reader.begin(request, hits, new)

    def next_use_key(self, block: BlockInfo, now: float) -> float:
        use = self.reader.next_use(block.block_id, type(self).__name__)
        return math.inf if use < 0 else float(use)

    def limit(self, now: float) -> float:
        if self._arrivals is None:  # index axis, or H = 0 or inf: no arrival needed
            if self.time == "arrival":
                return math.inf if self.horizon == math.inf else -1.0
            return now + self.horizon
        edge = now + self.horizon
        n = self.future.num_requests
        count, last = self._count, self._last
        while count < n:
            k = count - self._start
            if k >= len(self._buffer):
                self._start = count
                self._buffer = self._arrivals.get(count, min(_ARRIVAL_CHUNK,
                                                             n - count)).tolist()
                k = 0
            t = self._buffer[k]
            if t <= last:
                t = math.nextafter(last, math.inf)
            if t > edge:
                break
            last = t
            count += 1
        self._count, self._last = count, last
        return float(count - 1)

    def close(self) -> None:
        """Unmap the windows."""
        super().close()
        if self._arrivals is not None:
            self._arrivals.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.future!r}, capacity_blocks="
                f"{self.capacity_blocks}, time={self.time!r}, horizon={self.horizon:g})")


class FileReuseOracle(FileHorizonOracle):
    """`ReuseOracle` with its future read from a `NextUseFile`: `FileHorizonOracle` with an
    infinite horizon (no arrivals needed)."""

    name: ClassVar[str] = "reuse-oracle"

    def __init__(self, future: NextUseFile, capacity_blocks: int, *,
                 time: str = "index") -> None:
        super().__init__(future, capacity_blocks, time=time, horizon=math.inf)

    def __repr__(self) -> str:
        return (f"FileReuseOracle({self.future!r}, capacity_blocks={self.capacity_blocks}, "
                f"time={self.time!r})")
