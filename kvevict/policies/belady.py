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
future from the same requests).

**Consumed by requests, not by the clock.** Built from requests (`Belady.from_requests`, which
is how `kvevict.policies.registry.build_policy` builds it for the simulator and the engine),
the oracle takes each request's accesses out of the future when that request begins
(`Belady.plan`, `Belady.on_begin`), and a block's next use is the first planned access of a
request that has not begun, whatever the clock says. The argument above holds unchanged: the
key changes only when a request using the block begins, and that request hits it. When every
request begins at its planned time, this is the clock's order exactly (the replay). With a
scheduler that delays requests (a queue, or a closed-loop session's turn waiting for its
answer, `kvevict.run.SessionGate`), the next uses are still ordered by planned times, so the
oracle is an approximation; but a delayed request still counts as coming, instead of as
already served (which made the timed oracle fall back to LRU wherever requests waited).
A preempted request is coming too: `Belady.on_preempt` puts the blocks it held back in the
future at its planned time before they become candidates, and its resume (`on_resume`), which
hits every one of them still cached, takes them out again, so the keys stay exact.

Among evictable blocks, a descendant is used only by requests that also use its ancestors, so
its next use is never earlier than theirs: the furthest-next-use leaf is a furthest-next-use
block overall, and restricting the choice to leaves loses nothing.

Without a future (``Belady()``, as ``make_policy("belady")`` builds it) every block is
"never used again" and the order degenerates to the tie-break: least recently used first.
``build_policy("belady", requests=..., time_axis=...)`` (what the simulator and the engine
call) gives it the future of those requests.

**At trace scale.** `Belady` keeps every access time of every block in memory. The replay
(`kvevict.replay`, ``"belady"`` by name) uses `FileBelady` instead: a first pass over the
trace (`NextUseFile.build`) writes each block access's id to a file, a backward pass over that
file writes, per access, the index of the next request using the same block (`NEVER` for
none), and the replay reads those through a memory-mapped window as requests begin. Memory is
one slot per distinct block during the backward pass (4 bytes for dense int ids; see
`NextUseFile`) and one number per cached block during the replay. Its victims are `Belady`'s
(the tests compare them eviction by eviction on the bundled trace).
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import tempfile
import weakref
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from kvevict.errors import ConfigError
from kvevict.hashing import request_hashes
from kvevict.policies.base import ScoredPolicy, register_policy
from kvevict.types import BlockInfo, Request

__all__ = ["NEVER", "Belady", "FileBelady", "NextUseFile", "NextUseReader", "ReaderBacked",
           "future_of", "request_hashes", "request_times"]

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


def future_of(requests: Iterable[Request], *, block_size: int | None = None,
              extra_key: Any = None,
              time: str | Sequence[float] = "index") -> dict[Any, list[float]]:
    """The future of a known sequence of requests: block hash -> the sorted clock times of
    the requests that use it (what `Belady` takes; `Belady.from_requests` documents the
    arguments). Shared by the offline policies built from requests."""
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
        for h in request_hashes(req, block_size, extra_key):
            future.setdefault(h, []).append(t)
    return future


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
        #: request id -> its planned access time, until it begins (`from_requests`); None:
        #: a future given as times alone, compared with the clock
        self._planned: dict[Any, float] | None = None
        #: request id -> its planned time, from its begin to its finish (`plan`)
        self._begun: dict[Any, float] = {}
        #: preempted request id -> the block hashes put back in its future (`on_preempt`)
        self._waiting: dict[Any, list[Any]] = {}
        self._hashing: tuple[int | None, Any] = (None, None)

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
        policy = cls(future_of(reqs, block_size=block_size, extra_key=extra_key, time=time))
        policy.plan(reqs, time, block_size=block_size, extra_key=extra_key)
        return policy

    def plan(self, requests: Sequence[Request], time: str | Sequence[float] = "index", *,
             block_size: int | None = None, extra_key: Any = None) -> None:
        """Consume the future by requests, not by the clock: each of ``requests`` (whose
        future this policy holds, on the same ``time`` axis as `from_requests`) takes its
        accesses out of the future when it begins (`on_begin`), and a block's next use is then
        the earliest planned access of a request that has not begun, even one planned before
        ``now``. A request that the scheduler, or a closed-loop session, delays past its
        planned time still counts as coming, instead of as already served. When every request
        begins at its planned time this is the clock's order exactly. Requests that share an
        id cannot be told apart at their begin, so with any repeated id the future stays
        compared with the clock."""
        times = request_times(requests, time) if isinstance(time, str) else list(time)
        planned = {r.request_id: float(t) for r, t in zip(requests, times, strict=True)}
        if len(planned) == len(requests):
            self._planned = planned
            self._hashing = (block_size, extra_key)

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        if self._planned is None:
            return
        t = self._planned.pop(request.request_id, None)
        if t is None:
            return
        self._begun[request.request_id] = t
        self._consume(request_hashes(request, *self._hashing), t)

    def _consume(self, hashes: Iterable[Any], t: float) -> None:
        """Take one access at ``t`` of each of ``hashes`` out of the future."""
        future = self._future
        for h in hashes:
            times = future.get(h)
            if times:
                i = bisect_left(times, t)
                if i < len(times) and times[i] == t:
                    del times[i]

    def on_preempt(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        """A preempted request comes back: the blocks it held are used again at its resume,
        put back in the future at its planned time (before they become candidates, so
        their keys see it; a resume hits every one still cached, so the keys stay exact)."""
        t = self._begun.get(request.request_id)
        if t is None:
            return
        hashes = [block.block_hash for block in blocks]
        future = self._future
        for h in hashes:
            insort(future.setdefault(h, []), t)
        self._waiting.setdefault(request.request_id, []).extend(hashes)

    def on_resume(self, request: Request, hits: Sequence[BlockInfo],
                  new: Sequence[BlockInfo], now: float) -> None:
        hashes = self._waiting.pop(request.request_id, None)
        if hashes is not None:
            self._consume(hashes, self._begun[request.request_id])

    def on_finish(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        """A request that finishes while preempted (aborted) will not come back: what
        `on_preempt` put back is taken out again, for every key computed from now on. Its
        blocks that are candidates already keep the key they got (an imminent use) until
        they leave the candidate set; the simulator and the engine resume every preempted
        request, so only an abort meets this."""
        t = self._begun.pop(request.request_id, None)
        hashes = self._waiting.pop(request.request_id, None)
        if hashes is not None:
            self._consume(hashes, t)  # type: ignore[arg-type]

    @classmethod
    def from_next_uses(cls, future: NextUseFile, capacity_blocks: int, *,
                       time: str = "index") -> FileBelady:
        """The same oracle with its future read from a `NextUseFile` (what `kvevict.replay`
        builds for ``"belady"`` by name): a `FileBelady`. ``time`` is the replay's clock axis;
        Belady's order does not depend on it (next uses are compared by request index)."""
        return FileBelady(future, capacity_blocks)

    @property
    def num_blocks_known(self) -> int:
        """Distinct block hashes in the future."""
        return len(self._future)

    def next_use(self, block_hash: Any, now: float) -> float:
        """First access time of ``block_hash`` after ``now``; ``inf`` if never again. Built
        from requests (`plan`): the first planned access of a request that has not begun,
        whatever ``now`` is."""
        times = self._future.get(block_hash)
        if not times:
            return math.inf
        if self._planned is not None:
            return times[0]
        i = bisect_right(times, now)
        return times[i] if i < len(times) else math.inf

    def score(self, block: BlockInfo, now: float) -> float:
        return -self.next_use(block.block_hash, now)

    def __repr__(self) -> str:
        return f"Belady(blocks_known={len(self._future)})"


# -- the future on disk, for traces of any length --------------------------------------------

#: Next use of an access that is the block's last.
NEVER = -1

#: Requests per chunk of the backward pass.
_CHUNK_REQUESTS = 4096
#: Block ids buffered by the forward pass before they are written.
_CHUNK_IDS = 1 << 16
#: Largest int id stored as itself (above: renumbered like any other key).
_MAX_RAW_ID = (1 << 62) - 1
#: Entries of a memory-mapped window read by `FileBelady`.
_WINDOW = 1 << 20


def _read(path: str, dtype: np.dtype, start: int, count: int) -> np.ndarray:
    """``count`` items from item ``start`` of a raw array file (a plain read, so the pages
    do not stay mapped)."""
    with open(path, "rb") as fh:
        fh.seek(start * dtype.itemsize)
        return np.fromfile(fh, dtype=dtype, count=count)


class _Window:
    """Sequential reads of a raw array file through a memory-mapped window of at least
    `_WINDOW` items, moved forward as reads pass its end: the resident pages of the mapping
    stay a window's worth, however long the file."""

    def __init__(self, path: str, dtype: np.dtype, length: int) -> None:
        self.path, self.dtype, self.length = path, dtype, length
        self.start = self.end = 0
        self.view: np.ndarray | None = None

    def get(self, start: int, count: int) -> np.ndarray:
        if start < self.start or start + count > self.end:
            self.view = None  # unmap the old window first
            self.start = start
            self.end = min(self.length, start + max(count, _WINDOW))
            if self.end > self.start:
                self.view = np.memmap(self.path, dtype=self.dtype, mode="r",
                                      offset=start * self.dtype.itemsize,
                                      shape=(self.end - self.start,))
        if count == 0:
            return np.zeros(0, dtype=self.dtype)
        assert self.view is not None
        return self.view[start - self.start:start - self.start + count]

    def close(self) -> None:
        self.view = None


class NextUseFile:
    """The future of a trace, on disk: for every block access, when the block is next used.

    Built by `build` in two passes over the trace that hold memory in proportion to the
    number of distinct blocks, not of accesses or requests:

    1. **forward** (streams the requests once): each request's block ids (its
       ``block_hashes``, or the chained hashes of its tokens, as the manager computes them)
       are appended to ``ids.i64`` (int64, one per access, in access order), its first
       access's position to ``offsets.i64`` and the blocks it needs
       (``ceil(prompt_len / block_size)``) to ``need.i64``. Int ids in ``[0, 2**62)`` are
       stored as they are; any other key (a str, a 128-bit token hash) gets a dense number
       from a dict, stored negative.
    2. **backward** (`next_uses`, per pool size that rejects a different set of requests):
       the ids are read back from the end in chunks of 4,096 requests; within a chunk a
       stable sort by id pairs each access with the next one of the same block, and an array
       ``last`` (one slot per distinct id: the index of the earliest later request using it)
       answers for the rest. The result, the index of the next request using the block
       (`NEVER`, -1, for none), goes to ``next-<size>.i32`` (int64 past 2**31 requests).

    **Memory bound.** ``last`` is 4 bytes (8 past 2**31 requests) per slot. With int ids that
    are dense (the largest below ``4 * accesses + 2**20``, as in the Mooncake and Alibaba
    traces, whose ids count up from 0), the slots are the ids themselves: ``4 * (max id + 1)``
    bytes, no map at all. Sparse int ids (64-bit hashes) are renumbered by a dict in an extra
    pass, and keys that are not ints always go through one: about 100 bytes per distinct
    block. A request whose ``need`` exceeds the pool never runs, so the backward pass for
    that pool size skips it: it is no one's next use, as in `replay`.

    **Disk.** 8 bytes per access for the ids, 4 (or 8) per access per next-use file, 16 per
    request. The files live in a temporary directory (under ``directory`` when given),
    removed by `close` (or when the object is collected).

    A request that needs its requests again after a one-shot iterator is consumed can ask
    for ``spill=True``: the forward pass then also pickles each request to ``requests.pkl``
    and `spilled` reads them back. An oracle that needs the clock time of a future request
    (the horizon oracle of `kvevict.policies.oracles`, on the arrival axis) asks for
    ``arrivals=True``: each request's ``arrival`` then goes to ``arrival.f64`` (float64, 8
    bytes per request), read through `arrival_window`.
    """

    def __init__(self, root: str, *, num_requests: int, num_accesses: int, num_slots: int,
                 base: int, max_need: int, block_size: int, spill: bool,
                 arrivals: bool = False) -> None:
        self.root = root
        self.num_requests = num_requests
        self.num_accesses = num_accesses
        #: slots of the ``last`` array: distinct blocks (dense ids: largest id + 1) + other keys
        self.num_slots = num_slots
        self.max_need = max_need
        self.block_size = block_size
        self.has_spill = spill
        self.has_arrivals = arrivals
        self.base = base  # slot of stored id -1 is base; of id -1 - k, base + k
        self.next_dtype = np.dtype(np.int32 if num_requests < 2**31 - 1 else np.int64)
        self.closed = False
        self._next_files: dict[int | None, str] = {}
        self._finalizer = weakref.finalize(self, shutil.rmtree, root, True)

    # -- the forward pass ----------------------------------------------------------------

    @classmethod
    def build(cls, requests: Iterable[Request], *, block_size: int, extra_key: Any = None,
              directory: str | os.PathLike[str] | None = None, spill: bool = False,
              on_request: Callable[[int], None] | None = None,
              arrivals: bool = False) -> NextUseFile:
        """Read ``requests`` once (in the order they will begin) and write their block ids.

        Args:
            requests: any iterable of `Request` (consumed once).
            block_size: tokens per block; token-mode requests are hashed with it (and
                ``extra_key``), and each request's ``need`` is counted in it.
            extra_key: the manager's ``extra_key``, for token-mode requests.
            directory: where to create the temporary directory (default: the system's).
            spill: also keep a copy of the requests (`spilled`), for a one-shot iterator.
            on_request: called with the number of requests read so far, every 1,000 and at
                the end (a progress display).
            arrivals: also write each request's arrival (`arrival_window` reads them).
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(requests, (str, bytes)):
            raise ConfigError("requests must be an iterable of Request objects, not a string")
        root = tempfile.mkdtemp(prefix="kvevict-future-",
                                dir=None if directory is None else os.fspath(directory))
        try:
            return cls._forward(root, requests, block_size, extra_key, spill, on_request,
                                arrivals)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise

    @classmethod
    def _forward(cls, root: str, requests: Iterable[Request], block_size: int,
                 extra_key: Any, spill: bool,
                 on_request: Callable[[int], None] | None,
                 arrivals: bool = False) -> NextUseFile:
        others: dict[Any, int] = {}
        buf: list[Any] = []
        offsets: list[int] = []
        needs: list[int] = []
        times: list[float] = []
        state = {"max": -1}
        accesses = 0
        max_need = 0
        count = 0
        spill_fh = open(os.path.join(root, "requests.pkl"), "wb") if spill else None
        time_fh = open(os.path.join(root, "arrival.f64"), "wb") if arrivals else None
        with open(os.path.join(root, "ids.i64"), "wb") as ids_fh, \
                open(os.path.join(root, "offsets.i64"), "wb") as off_fh, \
                open(os.path.join(root, "need.i64"), "wb") as need_fh:
            try:
                for req in requests:
                    if not isinstance(req, Request):
                        raise ConfigError(f"replay takes Requests, got {type(req).__name__}")
                    hashes = request_hashes(req, block_size, extra_key)
                    need = -(-req.prompt_len // block_size)
                    max_need = max(max_need, need)
                    offsets.append(accesses)
                    needs.append(need)
                    if time_fh is not None:
                        times.append(float(req.arrival))
                    buf.extend(hashes)
                    accesses += len(hashes)
                    count += 1
                    if spill_fh is not None:
                        pickle.dump(req, spill_fh, protocol=pickle.HIGHEST_PROTOCOL)
                    if len(buf) >= _CHUNK_IDS:
                        cls._flush_ids(buf, ids_fh, others, state)
                    if len(offsets) >= _CHUNK_REQUESTS:
                        np.asarray(offsets, dtype=np.int64).tofile(off_fh)
                        np.asarray(needs, dtype=np.int64).tofile(need_fh)
                        offsets, needs = [], []
                        if time_fh is not None:
                            np.asarray(times, dtype=np.float64).tofile(time_fh)
                            times = []
                    if on_request is not None and count % 1000 == 0:
                        on_request(count)
                if time_fh is not None:
                    np.asarray(times, dtype=np.float64).tofile(time_fh)
            finally:
                if spill_fh is not None:
                    spill_fh.close()
                if time_fh is not None:
                    time_fh.close()
            cls._flush_ids(buf, ids_fh, others, state)
            offsets.append(accesses)
            np.asarray(offsets, dtype=np.int64).tofile(off_fh)
            np.asarray(needs, dtype=np.int64).tofile(need_fh)
        if on_request is not None:
            on_request(count)
        top = state["max"]
        if top + 1 <= 4 * accesses + (1 << 20):  # dense int ids: slots are the ids
            base = top + 1
        else:
            base = cls._renumber(os.path.join(root, "ids.i64"), accesses)
        return cls(root, num_requests=count, num_accesses=accesses,
                   num_slots=base + len(others), base=base, max_need=max_need,
                   block_size=block_size, spill=spill, arrivals=arrivals)

    @staticmethod
    def _flush_ids(buf: list[Any], fh: Any, others: dict[Any, int],
                   state: dict[str, int]) -> None:
        """Write the buffered ids (int ids as they are, other keys as ``-1 - k``) and empty
        ``buf``."""
        if not buf:
            return
        if set(map(type, buf)) == {int} and min(buf) >= 0 and max(buf) <= _MAX_RAW_ID:
            arr = np.asarray(buf, dtype=np.int64)
        else:
            out = []
            for h in buf:
                if isinstance(h, (int, np.integer)):  # bool and numpy ints as the dicts see them
                    h = int(h)
                elif isinstance(h, float) and h.is_integer():
                    h = int(h)
                if type(h) is int and 0 <= h <= _MAX_RAW_ID:
                    out.append(h)
                    continue
                k = others.get(h)
                if k is None:
                    k = others[h] = len(others)
                out.append(-1 - k)
            arr = np.asarray(out, dtype=np.int64)
        if len(arr):
            state["max"] = max(state["max"], int(arr.max()))
        arr.tofile(fh)
        buf.clear()

    @staticmethod
    def _renumber(path: str, accesses: int) -> int:
        """Renumber the non-negative ids of ``path`` densely in order of first access (the
        sparse case: a dict of the distinct ids); return how many there are."""
        dense: dict[int, int] = {}
        with open(path, "r+b") as fh:
            for start in range(0, accesses, _CHUNK_IDS):
                fh.seek(start * 8)
                raw = np.fromfile(fh, dtype=np.int64, count=min(_CHUNK_IDS, accesses - start))
                ints = raw >= 0
                uniq, first, inverse = np.unique(raw[ints], return_index=True,
                                                 return_inverse=True)
                mapped = np.empty(len(uniq), dtype=np.int64)
                for j in np.argsort(first, kind="stable").tolist():  # first-access order
                    key = int(uniq[j])
                    value = dense.get(key)
                    if value is None:
                        value = dense[key] = len(dense)
                    mapped[j] = value
                raw[ints] = mapped[inverse]
                fh.seek(start * 8)
                raw.tofile(fh)
        return len(dense)

    # -- the backward pass ---------------------------------------------------------------

    def _path(self, name: str) -> str:
        if self.closed:
            raise ConfigError("this NextUseFile is closed")
        return os.path.join(self.root, name)

    def _class_of(self, capacity_blocks: int | None) -> int | None:
        """The pool sizes that reject the same requests share a file: None for every size
        that holds the largest request."""
        if capacity_blocks is None or capacity_blocks >= self.max_need:
            return None
        return capacity_blocks

    def next_uses(self, capacity_blocks: int | None = None) -> str:
        """The path of the next-use file for a pool of ``capacity_blocks`` (None: every
        request runs), written on first use: item ``p`` is the index of the next request
        after access ``p``'s that uses the same block and fits the pool, `NEVER` if none
        (items of requests that do not fit are `NEVER` too)."""
        key = self._class_of(capacity_blocks)
        if key in self._next_files:
            return self._next_files[key]
        name = self._path(f"next-{'all' if key is None else key}.i{self.next_dtype.itemsize * 8}")
        self._backward(name, key)
        self._next_files[key] = name
        return name

    def _backward(self, name: str, capacity: int | None) -> None:
        i64 = np.dtype(np.int64)
        dt = self.next_dtype
        last = np.full(self.num_slots, NEVER, dtype=dt)
        base = self.base
        with open(name, "wb") as out:
            out.truncate(self.num_accesses * dt.itemsize)
            end = self.num_requests
            while end > 0:
                start = max(0, end - _CHUNK_REQUESTS)
                offs = _read(self._path("offsets.i64"), i64, start, end - start + 1)
                a, b = int(offs[0]), int(offs[-1])
                result = np.full(b - a, NEVER, dtype=dt)
                if b > a:
                    raw = _read(self._path("ids.i64"), i64, a, b - a)
                    slots = np.where(raw >= 0, raw, base - 1 - raw)
                    counts = np.diff(offs)
                    req = np.repeat(np.arange(start, end, dtype=np.int64), counts)
                    if capacity is not None:
                        fits = _read(self._path("need.i64"), i64, start, end - start) <= capacity
                        keep = np.flatnonzero(np.repeat(fits, counts))
                        slots, req = slots[keep], req[keep]
                    else:
                        keep = None
                    order = np.argsort(slots, kind="stable")  # by block, then access order
                    xs, rs = slots[order], req[order].astype(dt)
                    nxt = last[xs]  # the next use after this chunk (gathered before updates)
                    if len(xs) > 1:
                        same = xs[1:] == xs[:-1]
                        nxt[:-1][same] = rs[1:][same]  # the next access within the chunk
                        head = np.ones(len(xs), dtype=bool)
                        head[1:] = ~same
                    else:
                        head = np.ones(len(xs), dtype=bool)
                    last[xs[head]] = rs[head]  # the earliest use in this chunk
                    unsorted = np.empty_like(nxt)
                    unsorted[order] = nxt
                    if keep is None:
                        result = unsorted
                    else:
                        result[keep] = unsorted
                out.seek(a * dt.itemsize)
                result.tofile(out)
                end = start

    # -- readers -------------------------------------------------------------------------

    def policy(self, capacity_blocks: int) -> FileBelady:
        """A fresh `FileBelady` for a replay of these requests on a pool of
        ``capacity_blocks``."""
        return FileBelady(self, capacity_blocks)

    def windows(self, capacity_blocks: int) -> tuple[_Window, _Window, _Window]:
        """Memory-mapped readers of the offsets, the needs and the next uses (for
        `FileBelady`)."""
        i64 = np.dtype(np.int64)
        return (_Window(self._path("offsets.i64"), i64, self.num_requests + 1),
                _Window(self._path("need.i64"), i64, self.num_requests),
                _Window(self.next_uses(capacity_blocks), self.next_dtype, self.num_accesses))

    def arrival_window(self) -> _Window:
        """A sequential reader of the requests' arrivals (``build(..., arrivals=True)``):
        ``arrival_window().get(start, count)`` is a float64 array of the arrivals of requests
        ``start`` to ``start + count - 1``, as the trace gives them (not made increasing)."""
        if not self.has_arrivals:
            raise ConfigError("this NextUseFile was built without arrivals=True")
        return _Window(self._path("arrival.f64"), np.dtype(np.float64), self.num_requests)

    def spilled(self) -> Iterator[Request]:
        """The requests, read back from the spill file (``build(..., spill=True)``)."""
        if not self.has_spill:
            raise ConfigError("this NextUseFile was built without spill=True")
        path = self._path("requests.pkl")

        def gen() -> Iterator[Request]:
            with open(path, "rb") as fh:
                for _ in range(self.num_requests):
                    yield pickle.load(fh)

        return gen()

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the files written so far."""
        if self.closed:
            return 0
        return sum(os.path.getsize(os.path.join(self.root, f)) for f in os.listdir(self.root))

    def close(self) -> None:
        """Remove the files."""
        self.closed = True
        self._finalizer()

    def __enter__(self) -> NextUseFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NextUseFile(requests={self.num_requests:,}, accesses={self.num_accesses:,}, "
                f"slots={self.num_slots:,})")


class NextUseReader:
    """Follows a replay through a `NextUseFile`: for each cached block, the index of the next
    request that uses it (`NEVER`: none), the part every file-backed oracle shares
    (`FileBelady`, and the reuse and horizon oracles of `kvevict.policies.oracles`).

    Its policy calls `begin` from ``on_begin``: the ``k``-th request that begins is the
    ``k``-th request of the file that fits the pool (``need <= capacity_blocks``; the others
    never begin), and each of its blocks (its hits, then the blocks it cached, in chain
    order) takes the next use stored for that access. One number per cached block, and
    memory-mapped windows of the files.

    Args:
        future: the file, built from the requests the replay will begin, in order.
        capacity_blocks: the pool's size (which requests never begin, and which next-use
            file applies).
    """

    def __init__(self, future: NextUseFile, capacity_blocks: int) -> None:
        if not isinstance(future, NextUseFile):
            raise ConfigError(f"future must be a NextUseFile, got {type(future).__name__}")
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks <= 0:
            raise ConfigError(f"capacity_blocks must be a positive int, got "
                              f"{capacity_blocks!r}")
        self.future = future
        self.capacity_blocks = capacity_blocks
        self._offsets, self._need, self._next = future.windows(capacity_blocks)
        self._cursor = 0  # the next request of the file that may begin
        self._next_of: dict[int, int] = {}  # cached block id -> next use (request index)

    @property
    def requests_begun(self) -> int:
        """Requests of the file passed so far (begun, or skipped as too large)."""
        return self._cursor

    def begin(self, request: Request, hits: Sequence[BlockInfo],
              new: Sequence[BlockInfo]) -> None:
        """``request`` began with these hits and new blocks: record their next uses. A
        request that does not match the file (another count of blocks) is a `ConfigError`."""
        i = self._cursor
        n = self.future.num_requests
        while i < n and int(self._need.get(i, 1)[0]) > self.capacity_blocks:
            i += 1
        if i >= n:
            raise ConfigError(f"request {request.request_id!r} begins after the "
                              f"{n:,} requests this oracle's future holds")
        start, end = (int(v) for v in self._offsets.get(i, 2))
        count = len(hits) + len(new)
        if count != end - start:
            raise ConfigError(f"request {request.request_id!r} has {count} cached blocks but "
                              f"request {i} of the future has {end - start}; the oracle "
                              "must replay the requests it was built from, in order")
        uses = self._next.get(start, count).tolist()
        table = self._next_of
        j = 0
        for block in hits:
            table[block.block_id] = uses[j]
            j += 1
        for block in new:
            table[block.block_id] = uses[j]
            j += 1
        self._cursor = i + 1

    def next_use(self, block_id: int, who: str = "this oracle") -> int:
        """The index of the next request using cached block ``block_id`` (`NEVER`: none); a
        block no request has begun with is a `ConfigError` (``who`` names the policy)."""
        use = self._next_of.get(block_id)
        if use is None:
            raise ConfigError(f"block {block_id} became a candidate before any request "
                              f"that began used it; {who} follows kvevict.replay only")
        return use

    def forget(self, block_id: int) -> None:
        """``block_id`` was evicted."""
        self._next_of.pop(block_id, None)

    def close(self) -> None:
        """Unmap the windows."""
        for window in (self._offsets, self._need, self._next):
            window.close()


class ReaderBacked:
    """Mixin of the file-backed oracles (`FileBelady`, the oracles' file forms): each keeps a
    `NextUseReader` as ``reader`` and forgets a block's next use when it is evicted. Put it
    first among the bases, so that its ``on_evict`` and ``pop_victim`` wrap the policy's."""

    reader: NextUseReader

    def on_evict(self, block: BlockInfo, now: float) -> None:
        super().on_evict(block, now)  # type: ignore[misc]
        self.reader.forget(block.block_id)

    def pop_victim(self, now: float) -> int | None:
        chosen = super().pop_victim(now)  # type: ignore[misc]
        if chosen is not None:
            self.reader.forget(chosen)
        return chosen

    def close(self) -> None:
        """Unmap the windows."""
        self.reader.close()


class FileBelady(ReaderBacked, ScoredPolicy):
    """`Belady` with its future read from a `NextUseFile`: the same victims, for a trace of
    any length.

    It follows the replay through ``on_begin`` with a `NextUseReader`. A block's score while
    it is a candidate is ``-(index of the next request using it)`` (``-inf``: never again),
    which orders candidates exactly as `Belady`'s ``-(time of the next use)`` does on any
    strictly increasing time axis, with the same tie-break (least recently accessed first);
    see the module docstring for why a key fixed when a block becomes a candidate stays
    right.

    It keeps one number per cached block, and memory-mapped windows of the files. Built by
    `kvevict.replay` for ``"belady"``; `NextUseFile.policy` builds one by hand. A request
    that does not match the file (another count of blocks) is a `ConfigError`.
    """

    name: ClassVar[str] = "belady"
    offline: ClassVar[bool] = True

    def __init__(self, future: NextUseFile, capacity_blocks: int) -> None:
        super().__init__()
        self.reader = NextUseReader(future, capacity_blocks)
        self.future = future
        self.capacity_blocks = capacity_blocks

    @property
    def requests_begun(self) -> int:
        """Requests of the file passed so far (begun, or skipped as too large)."""
        return self.reader.requests_begun

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        self.reader.begin(request, hits, new)

    def score(self, block: BlockInfo, now: float) -> float:
        use = self.reader.next_use(block.block_id, "FileBelady")
        return -math.inf if use < 0 else -float(use)


    def __repr__(self) -> str:
        return f"FileBelady({self.future!r}, capacity_blocks={self.capacity_blocks})"
