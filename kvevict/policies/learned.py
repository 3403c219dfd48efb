"""`learned`: evict the candidate whose learned odds of reuse, times its recompute cost per
byte, is lowest; conversations and turns inferred from the prefix tree when requests carry
no session id.

Three parts, each learned online from what the cache observes and nothing else:

- **Conversations** (`ConversationTracker`). A request with a session id continues that
  session. A request without one (Mooncake's and Alibaba's traces, most servers' traffic)
  continues an earlier request's conversation when its cache hit runs past the shared blocks
  into that request's private chain: the hit ends on a block that request created (its
  prompt's new blocks or its decoded answer), that nobody else has reused, and at or past the
  end of that request's prompt (a partial last block of a block-id trace excepted). Anything
  else (no hit, a hit that ends in a widely shared prefix or inside someone's prompt) starts a
  new conversation. It sees only what the cache holds: a conversation whose private blocks
  were evicted, or whose turn cached no block of its own, starts again at turn 1.
- **The reuse table** (`ReuseTable`). The blocks a request held open *trials* when the
  request finishes (one block use in ``TRIAL_EVERY`` = 4, in order: a sample, as LRB trains
  on), each filed under the block's feature cell (below). The trial succeeds when the
  same content is used again within ``H`` seconds (a hit, or a miss that caches the same
  block hash again: a reuse the cache did not serve still counts, so eviction does not censor
  the label), and fails once ``H`` seconds pass without one. Per cell, the estimate is the
  decayed success rate with a Beta prior of ``prior_weight`` pseudo-trials at the pooled rate
  of all cells, so a new cell starts at the average and, before anything is learned, every
  cell is equal (the policy is then exactly LRU). Counts decay by ``1 - 1/memory`` per
  observation, so the table follows drift. A trial is resolved only by an event at or after
  its end, so no estimate at time ``t`` uses anything after ``t``.
- **The horizon** ``H``: the cache's characteristic time (Che, Tung and Wang, "Hierarchical
  Web caching systems: modeling, design and experimental results", IEEE JSAC 2002): how long
  an idle block survives here, estimated as the moving mean of the idle time of evicted blocks
  (weight 1/100 per eviction). A reuse later than ``H`` would not have been served anyway, so
  it is what "reuse" means for this cache. Before the first eviction it is 60 s (the market's
  horizon; it only matters once something is evicted).

**Features** of a block (its cell), read when the request that used it last finishes: its
prefix-hit count (0, 1, 2+: most blocks used once are never used again, the observation
behind S3-FIFO, Yang et al., SOSP'23), the log2 bucket of that request's output length
(learned conversation continuation: LPC, NeurIPS'25, predicts a continuation from the
response), the inferred turn (1, 2, 3+), the workload class, and the log2 bucket of the
block's depth.

**Price.** ``p(cell) * exp(-idle / H) * cost / bytes``: the learned odds, discounted by the
idle time in units of the horizon, times the block's recompute seconds per byte
(`kvevict.policies.market.price.CostBuckets`, as the market prices it). The lowest price goes
first; ties go to the least recently used. No gap distribution is assumed for the odds (they
are counted, not fitted); the discount only orders blocks of one cell by recency.

**Gap distributions** (``gaps="empirical"``, an option; measured below the default, see
docs/policies/learned.md). Per cell, `GapTable` keeps a decayed log-spaced histogram of the
time to a block's next use, censored (Kaplan-Meier, open trials counted at their age), and
the price is ``P(t < G <= t + H | G > t) * cost / bytes`` at the block's idle time ``t``: a
step function of the idle time's bin, kept exact in the heap by a timer per candidate at the
end of its bin.

**The ghost** (``ghost=True``, an option; see docs/policies/learned.md). A block's use count
is its record's: a content evicted and cached again starts from none, so the feature is
censored by eviction exactly where it matters, in a small cache. With the ghost the policy
remembers the use counts of the contents it evicted, as S3-FIFO's ghost queue (Yang et al.,
SOSP'23) and ARC's ghost lists (Megiddo and Modha, FAST'03) remember evicted keys, and at most
as many as the cache has held; a content cached again goes on counting from there.

**Index.** In log form the price is ``log p + log(cost / bytes) + (last_access - t0) / H`` up
to a term shared by every candidate, so it does not change with ``now``: a candidate is priced
once, when it becomes one (or, for the blocks a request releases, when its ``on_finish``
gives their features), into a heap. A parent exposed by an eviction is priced at once and
held beside the heap, the victim when it is below the heap's top; it joins the heap when an
eviction exposes another first. A chain's tail goes block by block (on the bundled trace nine
victims in ten are the parent the eviction before exposed), so most evictions cost no heap
operation. If the estimates change before the next victim is chosen (the last eviction of a
request exposes a parent, and the next request's hits resolve trials), it is priced again
then, so every key is what pricing it at that victim choice would give. The log odds of a
cell are computed once per version of the table (it changes only when a trial resolves).
The heap is rebuilt with the current estimates and ``H`` after two evictions per candidate
since the last rebuild (amortized O(log n) per eviction): prices are at most that stale.

**Events.** A request's reuses are resolved in one call each: its hits in ``on_hits``, the
blocks its begin cached in ``on_begin`` (no ``on_insert`` per block), and blocks it cached
later (a chunked prefill's later chunks) when it finishes, each at the time it was cached.
"""

from __future__ import annotations

import abc
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.policies.market.price import CostBuckets, check_learning, checked_cost_model
from kvevict.types import BlockInfo, Request

__all__ = ["ConversationTracker", "GapTable", "Ghost", "LearnedReuse", "ReuseTable", "gap_bin"]

#: Horizon (seconds) before the first eviction: the market's default horizon.
INITIAL_HORIZON_S = 60.0
#: Weight of one eviction in the moving mean of evicted idle times (about 100 evictions).
HORIZON_WEIGHT = 0.01
#: One block use in this many opens a trial (the learning signal, sampled: LRB, NSDI'20,
#: trains on a sample of requests too).
TRIAL_EVERY = 4
#: Every candidate is repriced after this many evictions per candidate (amortized: half a
#: repricing per eviction).
REPRICE_EVERY = 2
#: How the odds of reuse fall with idle time: "empirical" (a censored gap histogram per
#: cell, `GapTable`) or "exponential" (odds within H times exp(-idle / H), `ReuseTable`).
GAP_MODELS = ("empirical", "exponential")


class ConversationTracker:
    """Conversations and turns: from session ids where requests carry them, else inferred from
    where each request's cache hit ends (see the module docstring).

    Every cached block a request created (its prompt's new blocks, its decoded answer) is
    filed under that request's conversation and turn. `begin` names the conversation and
    turn of a request whose hit is ``hits``: when the hit ends on a block one earlier request
    created and nobody else has reused (its only hit is this one), the request continues that
    request's conversation; `finish` files the blocks the request held; `forget` drops an
    evicted block.
    """

    def __init__(self, max_conversations: int = 100_000) -> None:
        if isinstance(max_conversations, bool) or not isinstance(max_conversations, int) \
                or max_conversations < 1:
            raise ConfigError(f"max_conversations must be an int >= 1, got "
                              f"{max_conversations!r}")
        self.max_conversations = max_conversations
        #: cached block id -> (conversation key, turn) of the request that created it, and
        #: the depth a hit must reach to have covered that request's prompt
        self.owner: dict[int, tuple[Any, int, int]] = {}
        #: session id -> turns so far (least recently begun first)
        self.sessions: OrderedDict[Any, int] = OrderedDict()
        self._next = 0

    def begin(self, request: Request, hits: Sequence[BlockInfo],
              new: Sequence[BlockInfo] = (), block_size: int | None = None) -> tuple[Any, int]:
        """(conversation key, turn) of ``request``, turn 1 for a new conversation; files
        ``new`` (the blocks it cached) under it. ``block_size`` (tokens per block) tells a
        partial last block of a request given as block ids."""
        session = request.session_id
        if session is not None:
            turn = self.sessions.pop(session, 0) + 1
            self.sessions[session] = turn
            if len(self.sessions) > self.max_conversations:
                self.sessions.popitem(last=False)
            conv: tuple[Any, int] = (("session", session), turn)
        else:
            found = None
            if hits:
                end = hits[-1]
                if end.hit_count <= 1:  # private: this request's hit is its only one
                    found = self.owner.get(end.block_id)
                    if found is not None and end.depth < found[2]:
                        found = None  # it stops inside that prompt: a shared prefix
            if found is not None:
                conv = (found[0], found[1] + 1)
            else:
                self._next += 1
                conv = (("inferred", self._next), 1)
        # a next turn covers this prompt's cached blocks, but for a partial last block
        # (block ids whose prompt ends inside the last block), which it does not repeat
        n = len(hits) + len(new)
        hashes = request.block_hashes
        partial = hashes is not None and request.prompt_len < len(hashes) * (block_size or 1)
        entry = (conv[0], conv[1], max(n - 1 - int(partial), 0))
        owner = self.owner
        for block in new:
            owner[block.block_id] = entry
        return conv

    def finish(self, conv: tuple[Any, int], blocks: Sequence[BlockInfo]) -> None:
        """The request of ``conv`` (key, turn) finished holding ``blocks``: file the ones it
        created and no one has filed (its decoded answer), reached by any hit through them."""
        owner = self.owner
        for block in blocks:
            if block.block_id not in owner and block.hit_count == 0:
                owner[block.block_id] = (conv[0], conv[1], block.depth)

    def forget(self, block_id: int) -> None:
        """``block_id`` left the cache."""
        self.owner.pop(block_id, None)


class TrialBook(abc.ABC):
    """The open trials of a reuse table, and how they end: shared by `ReuseTable` and
    `GapTable`, which differ only in what they learn from an ending (``_reused``,
    ``_expired``).

    A trial opens when a sampled use of a block ends (``open``: its content's hash, its
    cell, the time); it ends when the same content is used again (``reuse_all``: after
    ``gap`` seconds) or when it has been open longer than a limit (``expire``). A use at a
    time before the trial opened is not its reuse (the trial stays open), so no estimate at
    time ``t`` uses an event after ``t``.
    """

    def __init__(self) -> None:
        #: block hash -> (release time, cell) of its open trial
        self.trials: dict[Any, tuple[float, Any]] = {}
        #: (release time, the hashes released then), oldest first: one entry per release
        self._order: deque[tuple[float, list[Any]]] = deque()
        #: observations so far (a version: estimates change only when it moves)
        self.observations = 0

    def open(self, block_hash: Any, cell: Any, now: float) -> None:
        """A use of ``block_hash`` ended at ``now``; its block was in ``cell``."""
        self.open_all([(block_hash, cell)], now)

    def open_all(self, trials: Sequence[tuple[Any, Any]], now: float) -> None:
        """`open` for each ``(block hash, cell)`` of one release at ``now``."""
        table = self.trials
        hashes = []
        for block_hash, cell in trials:
            table[block_hash] = (now, cell)
            hashes.append(block_hash)
        order = self._order
        order.append((now, hashes))
        if len(order) > 2 * len(table) + 1024:
            # mostly releases whose trials all ended in a reuse: they would wait for the
            # limit (a day of releases with empirical gaps) with nothing left to expire
            kept: deque[tuple[float, list[Any]]] = deque()
            for t0, released in order:
                still_open = [h for h in released if table.get(h, (None,))[0] == t0]
                if still_open:
                    kept.append((t0, still_open))
            self._order = kept

    def reuse(self, block_hash: Any, now: float, horizon: float = math.inf) -> None:
        """``block_hash`` is used again at ``now`` (a hit, or a miss that caches it again)."""
        self.reuse_all((block_hash,), now, horizon)

    def reuse_all(self, block_hashes: Iterable[Any], now: float,
                  horizon: float = math.inf) -> None:
        """`reuse` of each of ``block_hashes`` (one request's blocks) at ``now``; ``horizon``
        for a table that counts a reuse within it as a success."""
        trials = self.trials
        pop = trials.pop
        reused = self._reused
        # most uses end no trial (one in TRIAL_EVERY opens one): skip them in C; the filter
        # is lazy, so a hash named twice sees the first one's effect, as in a plain loop
        for block_hash in filter(trials.__contains__, block_hashes):
            trial = pop(block_hash)
            if trial[0] > now:  # opened after that use: not its reuse
                trials[block_hash] = trial
                continue
            reused(block_hash, trial[1], now - trial[0], horizon)

    def expire(self, now: float, limit: float) -> None:
        """End every trial open longer than ``limit`` seconds at ``now``."""
        order, trials = self._order, self.trials
        oldest = now - limit
        expired = self._expired
        while order and order[0][0] < oldest:
            t0, hashes = order.popleft()
            for h in hashes:
                trial = trials.get(h)
                if trial is not None and trial[0] == t0:
                    del trials[h]
                    expired(h, trial[1], now - t0)

    @abc.abstractmethod
    def _reused(self, block_hash: Any, cell: Any, gap: float, horizon: float) -> None:
        """The trial of ``block_hash`` in ``cell`` ended in a reuse after ``gap`` seconds."""

    @abc.abstractmethod
    def _expired(self, block_hash: Any, cell: Any, age: float) -> None:
        """The trial of ``block_hash`` in ``cell`` ended unreused, open ``age`` seconds."""


class ReuseTable(TrialBook):
    """Per feature cell, the decayed odds that a block is used again within the horizon
    (see the module docstring: trials, the Beta prior at the pooled rate, the decay). A
    trial succeeds when it is reused within ``horizon`` (`reuse_all`) and fails when it has
    been open longer (`expire` with the horizon as the limit)."""

    def __init__(self, prior_weight: float, memory: float) -> None:
        super().__init__()
        self.prior_weight = prior_weight
        self.gamma = 1.0 - 1.0 / memory
        self.succ: dict[Any, float] = {}
        self.fail: dict[Any, float] = {}
        self.total_succ = 1.0  # the pooled prior: one success and one failure
        self.total_fail = 1.0

    def expire(self, now: float, horizon: float) -> None:
        """Fail every open trial older than ``horizon`` at ``now``."""
        super().expire(now, horizon)

    def _reused(self, block_hash: Any, cell: Any, gap: float, horizon: float) -> None:
        self._observe(cell, gap <= horizon)

    def _expired(self, block_hash: Any, cell: Any, age: float) -> None:
        self._observe(cell, False)

    def _observe(self, cell: Any, success: bool) -> None:
        # each cell's counts decay by gamma per observation of that cell (a memory of about
        # `memory` of its own trials, as the market's per-class counts); the pooled totals
        # decay per observation of any cell
        g = self.gamma
        s = self.succ.get(cell, 0.0) * g
        f = self.fail.get(cell, 0.0) * g
        if success:
            self.succ[cell] = s + 1.0
            self.fail[cell] = f
            self.total_succ = self.total_succ * g + 1.0
            self.total_fail *= g
        else:
            self.succ[cell] = s
            self.fail[cell] = f + 1.0
            self.total_fail = self.total_fail * g + 1.0
            self.total_succ *= g
        self.observations += 1

    def counts(self, cell: Any) -> tuple[float, float]:
        """The decayed (successes, failures) of ``cell``."""
        return self.succ.get(cell, 0.0), self.fail.get(cell, 0.0)

    def p(self, cell: Any) -> float:
        """P(reuse within the horizon) of a block in ``cell``."""
        ts, tf = self.total_succ, self.total_fail
        w = self.prior_weight
        s = self.succ.get(cell, 0.0)
        return (w * ts / (ts + tf) + s) / (w + s + self.fail.get(cell, 0.0))


#: Edges (seconds) of the gap histogram: bin 0 is [0, 0.1 s), bins 1 to 24 are log-spaced
#: from 0.1 s to one day (a factor of 864,000^(1/24), about 1.77, per bin), bin 25 is a day
#: or more. The range spans a token's time to a user's next-day return; 24 log bins give
#: about four per decade.
GAP_BINS = 24
GAP_LO = 0.1
GAP_HI = 86_400.0
GAP_LOG_RATIO = math.log(GAP_HI / GAP_LO) / GAP_BINS
GAP_EDGES: tuple[float, ...] = (0.0,) + tuple(
    GAP_LO * math.exp(k * GAP_LOG_RATIO) for k in range(GAP_BINS + 1))
#: Number of bins, the last one open-ended.
NUM_GAP_BINS = GAP_BINS + 2
#: A trial still open this long (seconds) after its release is censored there and closed:
#: the histogram's range, one day.
GAP_WINDOW = GAP_HI
#: A cell's survival table is recomputed once this fraction of its weight is new (and at
#: every rebuild of the heap): its estimate then moves by at most about that much between.
REFRESH_FRACTION = 0.125
_INV_LOG_RATIO = 1.0 / GAP_LOG_RATIO
_LAST_BIN = NUM_GAP_BINS - 1
_ZEROS = (0.0,) * NUM_GAP_BINS
_BINS_DOWN = range(NUM_GAP_BINS - 1, -1, -1)


def gap_bin(seconds: float) -> int:
    """The histogram bin of a gap (or an idle time) of ``seconds`` (see `GAP_EDGES`)."""
    if seconds < GAP_LO:
        return 0
    k = 1 + int(math.log(seconds / GAP_LO) * _INV_LOG_RATIO)
    return k if k < _LAST_BIN else _LAST_BIN


def _bin_fraction(seconds: float) -> tuple[int, float]:
    """The bin of ``seconds`` and how far into it they are: in log time (linear in bin 0;
    0 in the last bin, where ``S`` is flat)."""
    k = gap_bin(seconds)
    if k == _LAST_BIN:
        return k, 0.0
    if k == 0:
        return k, seconds / GAP_LO
    return k, math.log(seconds / GAP_EDGES[k]) * _INV_LOG_RATIO


def _survival(hazards: Sequence[float]) -> list[float]:
    """``S`` at the start of each bin from the bins' hazards: the product of ``1 - hazard``
    over the bins before it (1 at 0)."""
    s, out = 1.0, []
    for h in hazards:
        out.append(s)
        s *= 1.0 - h
    return out


#: Per bin of idle time, the idle time its odds are taken at (the bin's geometric middle;
#: 0.05 s in bin 0, a day in the last), with `_bin_fraction` of it.
_IDLE_POINTS: tuple[tuple[float, int, float], ...] = tuple(
    (t, *_bin_fraction(t)) for t in
    [0.5 * GAP_LO] + [GAP_EDGES[k] * math.exp(0.5 * GAP_LOG_RATIO)
                      for k in range(1, NUM_GAP_BINS - 1)] + [GAP_HI])


class GapTable(TrialBook):
    """Per feature cell, the decayed empirical distribution of the time to a block's next use,
    censored (see the module docstring, "Gap distributions").

    Each trial (a sampled block use, as in `ReuseTable`) ends either in an *event*, the same
    content used again after ``gap`` seconds, filed in the log-spaced bin of ``gap``, or is
    *censored* at its age when it has been open longer than the window (`WINDOW_HORIZONS`
    horizons), filed in the bin of that age. Per bin, the hazard is the Kaplan-Meier (life
    table) estimate: events in the bin over the trials still at risk at its start (Kaplan
    and Meier, "Nonparametric estimation from incomplete observations", JASA 1958; the
    censored at a bin are counted at risk in it, their convention for ties). The survival
    ``S(t) = P(no use within t)`` is the product of ``1 - hazard``; it counts the blocks that
    never return (their ``S`` stays at ``1 - P(return)``), so no return probability is kept
    apart from the gaps. A cell is shrunk to the pooled histogram of all cells with
    ``prior_weight`` pseudo-trials, so a sparse cell backs off to the average. Counts decay
    by ``1 - 1/memory`` per observation of the cell (the pooled ones per observation of any
    cell), stored scaled (one multiplication per observation, not one per bin).
    """

    def __init__(self, prior_weight: float, memory: float) -> None:
        super().__init__()
        self.prior_weight = prior_weight
        self.gamma = 1.0 - 1.0 / memory
        self._inv_gamma = 1.0 / self.gamma
        #: cell -> [events per bin, censored per bin, scale]: counts are stored times scale
        self._cells: dict[Any, list[Any]] = {}
        self._pooled: list[Any] = [[0.0] * NUM_GAP_BINS, [0.0] * NUM_GAP_BINS, 1.0]
        #: cell -> observations of it (its own version)
        self.cell_observations: dict[Any, int] = {}
        #: cell -> the runs of trials opened in it, oldest first: one per release, as
        #: [release time, the cell's observations then, how many are still open] (a run
        #: none of whose trials is open is dropped when the cell is next read, or when the
        #: runs outnumber twice the open trials: a cell never read keeps none for long)
        self._open: dict[Any, deque[list[Any]]] = {}
        self._runs = 0  # runs in ``_open``, at most (reads drop some without counting)
        #: block hash -> the run its open trial counts in
        self._run_of: dict[Any, list[Any]] = {}
        #: (horizon, `_idle_spans` at it), for the last horizon asked
        self._spans: tuple[float, list[tuple[int, float, int, float]]] = (math.nan, [])

    def open_all(self, trials: Sequence[tuple[Any, Any]], now: float) -> None:
        """Open a trial for each ``(block hash, cell)`` of one release at ``now``, counted
        in its cell's run for this release (`open_counts`)."""
        super().open_all(trials, now)
        by_cell, seen, run_of = self._open, self.cell_observations, self._run_of
        runs: dict[Any, list[Any]] = {}
        for block_hash, cell in trials:
            old = run_of.get(block_hash)
            if old is not None:  # a trial opened again replaces the one still open
                old[2] -= 1
            run = runs.get(cell)
            if run is None:
                run = runs[cell] = [now, seen.get(cell, 0), 0]
                q = by_cell.get(cell)
                if q is None:
                    q = by_cell[cell] = deque()
                q.append(run)
                self._runs += 1
            run[2] += 1
            run_of[block_hash] = run
        if self._runs > 2 * len(run_of) + 1024:  # mostly closed runs: drop them, amortized
            for cell, q in by_cell.items():
                by_cell[cell] = deque(run for run in q if run[2] > 0)
            self._runs = sum(len(q) for q in by_cell.values())

    def _close(self, block_hash: Any) -> None:
        """The trial of ``block_hash`` ended: it no longer counts in its run."""
        run = self._run_of.pop(block_hash, None)
        if run is not None:
            run[2] -= 1

    def open_counts(self, cell: Any, now: float) -> list[float]:
        """Per bin, ``cell``'s trials still open at ``now``, each in the bin of its age and
        weighted by the decay of the cell's observations since it opened: censored at
        ``now``, as the Kaplan-Meier estimate at ``now`` counts them."""
        counts = [0.0] * NUM_GAP_BINS
        q = self._open.get(cell)
        if not q:
            return counts
        g = self.gamma
        n = self.cell_observations.get(cell, 0)
        closed = 0
        log, lo, inv_ratio, last = math.log, GAP_LO, _INV_LOG_RATIO, _LAST_BIN
        for t0, seen, left in q:  # a run's trials share their age and decay
            if left > 0:
                # its bin: `gap_bin`, inline; calling it here and `_bin_fraction` in
                # `_idle_spans` cost 9% more instructions per replayed request (count.py
                # policy, empirical gaps with the ghost: 14.63 G against 13.40 G)
                age = now - t0
                k = 0 if age < lo else 1 + int(log(age / lo) * inv_ratio)
                counts[k if k < last else last] += left * g ** (n - seen)
            else:
                closed += 1
        if closed:
            self._open[cell] = deque(run for run in q if run[2] > 0)
        return counts

    def expire(self, now: float, limit: float = GAP_WINDOW) -> None:
        """Censor every trial open longer than ``limit`` (the window) at ``now``, at its
        age."""
        super().expire(now, limit)

    def _reused(self, block_hash: Any, cell: Any, gap: float, horizon: float) -> None:
        self._close(block_hash)
        self._observe(cell, gap, True)  # an event at the gap, whatever the horizon

    def _expired(self, block_hash: Any, cell: Any, age: float) -> None:
        self._close(block_hash)
        self._observe(cell, age, False)

    def _observe(self, cell: Any, age: float, event: bool) -> None:
        k = gap_bin(age)
        which = 0 if event else 1
        entry = self._cells.get(cell)
        if entry is None:
            entry = self._cells[cell] = [[0.0] * NUM_GAP_BINS, [0.0] * NUM_GAP_BINS, 1.0]
        for e in (entry, self._pooled):
            # decay every count by gamma (the scale grows by 1/gamma), then add one
            e[2] *= self._inv_gamma
            e[which][k] += e[2]
            if e[2] > 1e100:
                s = 1.0 / e[2]
                e[0] = [x * s for x in e[0]]
                e[1] = [x * s for x in e[1]]
                e[2] = 1.0
        self.cell_observations[cell] = self.cell_observations.get(cell, 0) + 1
        self.observations += 1

    def counts(self, cell: Any) -> tuple[list[float], list[float]]:
        """The decayed (events, censored) per bin of ``cell`` (zeros if never observed)."""
        entry = self._cells.get(cell)
        if entry is None:
            return [0.0] * NUM_GAP_BINS, [0.0] * NUM_GAP_BINS
        s = 1.0 / entry[2]
        return [x * s for x in entry[0]], [x * s for x in entry[1]]

    def cells(self) -> list[Any]:
        """The cells observed so far."""
        return list(self._cells)

    def weight(self, cell: Any) -> float:
        """The decayed number of trials of ``cell``."""
        entry = self._cells.get(cell)
        return 0.0 if entry is None else (sum(entry[0]) + sum(entry[1])) / entry[2]

    def hazards(self, cell: Any, now: float | None = None) -> list[float]:
        """Per bin, the Kaplan-Meier hazard of ``cell``'s counts shrunk to the pooled ones:
        events in the bin over the trials at risk at its start (0 where none is). With
        ``now``, the cell's open trials count as censored at their age (`open_counts`)."""
        pe, pc, pooled_scale = self._pooled
        ps = 1.0 / pooled_scale
        total = (sum(pe) + sum(pc)) * ps
        w = self.prior_weight * ps / total if total > 0 else 0.0
        entry = self._cells.get(cell)
        if entry is None:
            events, censored, s = _ZEROS, _ZEROS, 1.0
        else:
            events, censored, s = entry[0], entry[1], 1.0 / entry[2]
        open_now = _ZEROS if now is None else self.open_counts(cell, now)
        out = [0.0] * NUM_GAP_BINS
        at_risk = 0.0
        for k in _BINS_DOWN:  # the trials at risk at a bin's start: those ending in it or after
            d = events[k] * s + w * pe[k]
            at_risk += d + (censored[k] * s + open_now[k] + w * pc[k])
            out[k] = d / at_risk if at_risk > 0 else 0.0
        return out

    def survival(self, cell: Any, now: float | None = None) -> list[float]:
        """``S`` at the start of each bin (``GAP_EDGES``; 1 at 0): the estimated probability
        that a block of ``cell`` is not used again within that time."""
        return _survival(self.hazards(cell, now))

    def return_odds(self, cell: Any, horizon: float, now: float | None = None) -> list[float]:
        """Per bin of idle time, ``P(t < G <= t + H | G > t)`` for a block of ``cell`` idle
        ``t`` (the bin's geometric middle; 0.05 s in bin 0, a day in the last): the odds
        that it is used again within ``horizon`` given it has not been for ``t``.

        ``S(x)`` between edges is interpolated with the bin's hazard spread evenly over log
        time (linear time in bin 0), and is flat past a day. With ``S`` counting the blocks
        that never return, this is the posterior the brief of issue 13 writes as
        ``p (F(t + H) - F(t)) / (p S_r(t) + 1 - p)`` with ``p`` the return probability and
        ``S_r = 1 - F`` the survival of the returning blocks' gaps: the same number.
        """
        exp = math.exp
        return [exp(x) for x in self.log_return_odds(cell, horizon, now)]

    def log_return_odds(self, cell: Any, horizon: float, now: float | None = None
                        ) -> list[float]:
        """The log of `return_odds` (``-inf`` where the odds are 0): what the policy prices
        with, in one pass over the idle points."""
        log, inf = math.log, -math.inf
        hz = self.hazards(cell, now)
        start = _survival(hz)
        out = []
        for k, f, k_end, f_end in self._idle_spans(horizon):
            # S at fraction f of bin k: its hazard spread evenly over the bin (f is 0 in the
            # last bin, where S is flat)
            keep = 1.0 - hz[k]
            at = start[k] * (keep ** f if keep > 0 else (1.0 if f <= 0 else 0.0))
            if at > 0:
                keep = 1.0 - hz[k_end]
                q = 1.0 - start[k_end] * (keep ** f_end if keep > 0 else
                                          (1.0 if f_end <= 0 else 0.0)) / at
                out.append(log(q) if q > 0 else inf)
            else:  # no block of the cell is idle this long: no odds
                out.append(inf)
        return out

    def _idle_spans(self, horizon: float) -> list[tuple[int, float, int, float]]:
        """Per idle point (`_IDLE_POINTS`), its bin and fraction and those of ``horizon``
        later: kept for the last ``horizon`` asked (every cell repriced at one rebuild asks
        the same)."""
        if self._spans[0] != horizon:
            spans = []
            log, lo, inv_ratio, last, edges = (math.log, GAP_LO, _INV_LOG_RATIO, _LAST_BIN,
                                               GAP_EDGES)
            for t, k, f in _IDLE_POINTS:  # `_bin_fraction(t + horizon)`, inline (see
                # `open_counts`; `test_return_odds_match_the_survival_curve_they_come_from`
                # checks the result against the bins written out)
                end = t + horizon
                if end < lo:
                    spans.append((k, f, 0, end / lo))
                    continue
                k_end = 1 + int(log(end / lo) * inv_ratio)
                if k_end >= last:
                    spans.append((k, f, last, 0.0))
                else:
                    spans.append((k, f, k_end, log(end / edges[k_end]) * inv_ratio))
            self._spans = (horizon, spans)
        return self._spans[1]


class Ghost:
    """The use counts of evicted contents, so a content cached again goes on counting: as
    S3-FIFO's ghost queue (Yang et al., SOSP'23) and ARC's ghost lists (Megiddo and Modha,
    FAST'03) remember evicted keys. It holds at most as many contents as the most blocks its
    policy has tracked at once (about the cache's size), dropping the longest evicted first.
    """

    def __init__(self) -> None:
        #: evicted content (block hash) -> the requests that used it until then, oldest
        #: eviction first
        self.uses: OrderedDict[Any, int] = OrderedDict()
        #: cached block id -> the uses of its content before it was cached this time
        self.earlier: dict[int, int] = {}
        self.bound = 0  # the most blocks tracked at once

    def __len__(self) -> int:
        return len(self.uses)

    def recall(self, blocks: Iterable[BlockInfo]) -> None:
        """``blocks`` were just cached: those remembered go on counting their content's uses."""
        uses, earlier = self.uses, self.earlier
        for block in blocks:
            n = uses.pop(block.block_hash, None)
            if n is not None:
                earlier[block.block_id] = n

    def remember(self, block: BlockInfo, tracked: int) -> None:
        """``block`` is evicted while its policy tracks ``tracked`` blocks: note its content's
        uses (its record's hits, the uses before it was cached, and the one that cached it)."""
        if tracked > self.bound:
            self.bound = tracked
        uses = self.uses
        block_hash = block.block_hash
        uses.pop(block_hash, None)  # (cached again without a begin that recalled it)
        uses[block_hash] = block.hit_count + self.earlier.pop(block.block_id, 0) + 1
        if len(uses) > self.bound:
            uses.popitem(last=False)


@register_policy("learned")
class LearnedReuse(Policy):
    """Evict the candidate with the lowest learned price (see the module docstring).

    Args:
        cost_model: recompute costs (default: `CostModel()`, Llama-3-8B on an H100).
        block_size: tokens per block for the cost of a block's depth (None: taken from the
            first block with token ids, else the manager's block size).
        prior_weight: pseudo-trials of the pooled rate in each cell's estimate.
        memory: observations after which old ones weigh ``1/e``.
        max_conversations: session ids the conversation tracker remembers (inferred
            conversations live on their cached blocks and need no bound).
        gaps: ``"exponential"`` (default) or ``"empirical"`` (see the module docstring).
        ghost: remember the use counts of evicted contents, so a content cached again goes
            on counting its uses (default False; see the module docstring).
    """

    def __init__(self, cost_model: CostModel | None = None, *, block_size: int | None = None,
                 prior_weight: float = 8.0, memory: float = 1000.0,
                 max_conversations: int = 100_000, gaps: str = "exponential",
                 ghost: bool = False) -> None:
        cost_model = checked_cost_model(cost_model, block_size)
        check_learning(prior_weight, memory)
        if gaps not in GAP_MODELS:
            raise ConfigError(f"gaps must be one of {', '.join(map(repr, GAP_MODELS))}, "
                              f"got {gaps!r}")
        if not isinstance(ghost, bool):
            raise ConfigError(f"ghost must be True or False, got {ghost!r}")
        # 29 instance attributes once bound, no more: CPython shares an instance dict's keys
        # up to 30, and with a 30th every attribute load here cost more (+3% instructions
        # per replayed request, `benchmarks/count.py policy`); `gaps` and `ghost` are
        # properties for that reason
        self._empirical = gaps == "empirical"
        self.cost_model = cost_model
        self.block_size = block_size
        self.prior_weight = float(prior_weight)
        self.memory = float(memory)
        self.conversations = ConversationTracker(max_conversations)
        self.table: GapTable | ReuseTable = (
            GapTable(self.prior_weight, self.memory) if self._empirical
            else ReuseTable(self.prior_weight, self.memory))
        self.costs: CostBuckets | None = None
        self._horizon = INITIAL_HORIZON_S  # H as of the last fold of `_idles`
        self._evicted = 0  # evictions folded into it so far
        self._idles: list[float] = []  # idle times of the evictions not folded in yet
        #: block id -> its feature cell, filed when the request that used it last finished
        self._state: dict[int, tuple[Any, ...]] = {}
        #: the use counts of evicted contents (``ghost=True``), else None
        self._ghost: Ghost | None = Ghost() if ghost else None
        #: request id -> ((conversation key, turn), blocks known at its begin), begin to finish
        self._running: dict[Any, tuple[tuple[Any, int], int]] = {}
        #: (key, tick, block id, block): a candidate's entry carries its record
        self._heap: list[tuple[float, int, int, BlockInfo]] = []
        #: the heap entry of the candidate an eviction exposed last, held beside the heap
        #: (usually the next victim: a chain's tail goes block by block)
        self._held: tuple[float, int, int, BlockInfo] | None = None
        #: priced candidates' live heap entries, and the candidates not priced yet: together
        #: every candidate
        self._keys: dict[int, tuple[float, int, int, BlockInfo]] = {}
        self._pending: dict[int, BlockInfo] = {}
        self._t0 = 0.0  # the time origin of the heap's keys
        self._key_horizon = INITIAL_HORIZON_S  # H the heap's keys use
        self._since_rebuild = 0  # evictions since the heap was last rebuilt
        self._sampled = 0  # block uses since the last one that opened a trial
        self._log_p: dict[tuple[Any, ...], float] = {}  # cell -> log p, for one table version
        self._log_p_version = -1
        self._exposed: list[BlockInfo] = []  # priced since the last victim choice
        self._exposed_at = 0  # the table's version they were priced with
        #: empirical gaps: cell -> (log odds per idle bin, the cell's observations and
        #: weight when computed)
        self._odds: dict[Any, tuple[list[float], int, float]] = {}
        #: empirical gaps: (time the idle bin of a key ends, block id, that key)
        self._timers: list[tuple[float, int, tuple[float, int, int, BlockInfo]]] = []

    @property
    def horizon(self) -> float:
        """The horizon H (seconds): the moving mean of evicted idle times (weight
        `HORIZON_WEIGHT`; the first eviction's idle time until then `INITIAL_HORIZON_S`). An
        eviction only notes its idle time; they are folded in, in order, when H is read."""
        idles = self._idles
        if idles:
            h = self._horizon
            w = HORIZON_WEIGHT
            first = self._evicted == 0
            for idle in idles:
                if idle < 0.0:
                    idle = 0.0
                if first:
                    h = idle
                    first = False
                else:
                    h += w * (idle - h)
                if h < 1e-6:
                    h = 1e-6
            self._evicted += len(idles)
            idles.clear()
            self._horizon = h
        return self._horizon

    def bind(self, block_size: int) -> None:
        super().bind(block_size)
        if self.costs is None:
            self.costs = CostBuckets(self.cost_model, self.block_size or block_size, 8)

    # -- features and price ----------------------------------------------------------------

    def cell(self, block: BlockInfo) -> tuple[Any, ...]:
        """The feature cell of ``block`` (hit count, output bucket, turn, class, depth):
        as filed when the request that used it last finished, else from its record alone
        (no output, turn 1)."""
        cell = self._state.get(block.block_id)
        return cell if cell is not None else self._cells((block,), 0, 1)[0]

    def _cells(self, blocks: Sequence[BlockInfo], out_bucket: int, turn: int
               ) -> list[tuple[Any, ...]]:
        """The cells of ``blocks`` used by one request of output bucket ``out_bucket`` at
        ``turn``. The use count is the content's: its record's hits plus the uses before it
        was last evicted (`uses_before`)."""
        turn = turn if turn < 3 else 3
        ghost = self._ghost
        if ghost is None or not ghost.earlier:
            # without earlier uses the count is the record's: no lookup per block (one
            # comprehension for both cost the default 1% more instructions per request)
            return [(b.hit_count if b.hit_count < 2 else 2, out_bucket, turn, b.workload_class,
                     b.depth.bit_length() if b.depth < 64 else 7) for b in blocks]
        before = ghost.earlier.get
        return [(u if (u := b.hit_count + before(b.block_id, 0)) < 2 else 2, out_bucket, turn,
                 b.workload_class, b.depth.bit_length() if b.depth < 64 else 7) for b in blocks]

    @property
    def gaps(self) -> str:
        """The gap model: ``"empirical"`` or ``"exponential"``."""
        return "empirical" if self._empirical else "exponential"

    @property
    def ghost(self) -> bool:
        """Whether evicted contents' use counts are remembered (`Ghost`)."""
        return self._ghost is not None

    def uses_before(self, block: BlockInfo) -> int:
        """Uses of ``block``'s content before it was cached this time (the requests that
        used it until it was evicted): 0 unless the ghost remembered it."""
        ghost = self._ghost
        return 0 if ghost is None else ghost.earlier.get(block.block_id, 0)

    @property
    def ghost_size(self) -> int:
        """Evicted contents whose use counts the ghost remembers (0 without it)."""
        return 0 if self._ghost is None else len(self._ghost)

    def price(self, block: BlockInfo, now: float) -> float:
        """The block's price at ``now``: with empirical gaps, ``P(used again within H | idle
        so far) * cost / bytes`` (the odds of its cell at the bin of its idle time); with
        exponential ones, ``p(cell) * exp(-idle / H) * cost / bytes``."""
        costs = self.costs
        if costs is None:
            raise ConfigError("the policy is not bound to a manager yet")
        log_cpb = costs.of(block)[0]
        idle = max(now - block.last_access, 0.0)
        if self._empirical:
            return math.exp(self._log_odds(self.cell(block), now)[gap_bin(idle)] + log_cpb)
        table = self.table
        assert isinstance(table, ReuseTable)
        return table.p(self.cell(block)) * math.exp(log_cpb - idle / self.horizon)

    def return_odds(self, block: BlockInfo, now: float) -> float:
        """With empirical gaps, the odds that ``block`` is used again within ``H`` given its
        idle time at ``now`` (its price without the cost)."""
        if not self._empirical:
            raise ConfigError("return_odds needs gaps='empirical'")
        idle = max(now - block.last_access, 0.0)
        return math.exp(self._log_odds(self.cell(block), now)[gap_bin(idle)])

    def _log_odds(self, cell: tuple[Any, ...], now: float) -> list[float]:
        """Log of the cell's odds per idle bin (empirical gaps), recomputed once
        `REFRESH_FRACTION` of the cell's weight is new since, and at every rebuild."""
        table = self.table
        assert isinstance(table, GapTable)
        seen = table.cell_observations.get(cell, 0)
        cached = self._odds.get(cell)
        if cached is not None and seen - cached[1] < max(1.0, REFRESH_FRACTION * cached[2]):
            return cached[0]
        odds = table.log_return_odds(cell, self.horizon, now)
        self._odds[cell] = (odds, seen, table.weight(cell))
        return odds

    def _key(self, block: BlockInfo, cell: tuple[Any, ...], now: float
             ) -> tuple[float, int, int, BlockInfo]:
        """The heap entry of ``block`` in ``cell`` at ``now``: (log price up to a shared term,
        tick, block id, the block; ticks order accesses strictly, so two entries equal up to
        the id hold the same record, and no comparison orders two records).
        Exponential gaps: the log odds of a cell are kept until the table observes anything.
        Empirical gaps: the log odds at the bin of the idle time, and a timer at the end of
        that bin."""
        if self._empirical:
            last = block.last_access
            idle = now - last
            k = gap_bin(idle if idle > 0 else 0.0)
            while k < NUM_GAP_BINS - 1 and last + GAP_EDGES[k + 1] <= now:
                k += 1  # an idle time at a bin's edge, rounded below it
            key = (self._log_odds(cell, now)[k] + self.costs.of(block)[0],  # type: ignore[union-attr]
                   block.last_access_tick, block.block_id, block)
            if k < NUM_GAP_BINS - 1:
                heapq.heappush(self._timers, (last + GAP_EDGES[k + 1], block.block_id, key))
            return key
        table = self.table
        log_p = self._log_p
        if self._log_p_version != table.observations:
            log_p.clear()
            self._log_p_version = table.observations
        lp = log_p.get(cell)
        if lp is None:
            lp = log_p[cell] = math.log(table.p(cell))  # type: ignore[union-attr]
        return (lp + self.costs.of(block)[0]  # type: ignore[union-attr]
                + (block.last_access - self._t0) / self._key_horizon,
                block.last_access_tick, block.block_id, block)

    def _price_pending(self, now: float) -> None:
        """Price the candidates that are waiting for it."""
        pending, keys, heap, key, cell = (self._pending, self._keys, self._heap, self._key,
                                          self.cell)
        for block in pending.values():
            k = keys[block.block_id] = key(block, cell(block), now)
            heapq.heappush(heap, k)
        pending.clear()

    def _reprice(self, blocks: Sequence[BlockInfo], now: float) -> None:
        """Price again those of ``blocks`` that are still priced candidates: the estimates
        changed since (a candidate exposed by the last eviction of a request is priced with
        the estimates of the next request's first eviction, as one priced then would be)."""
        keys, heap, key, state = self._keys, self._heap, self._key, self._state
        for block in blocks:
            block_id = block.block_id
            if block_id in keys:
                k = keys[block_id] = key(block, state[block_id], now)
                heapq.heappush(heap, k)

    def _rekey_due(self, now: float) -> None:
        """Empirical gaps: price again every candidate whose idle time left its bin."""
        timers, keys, heap = self._timers, self._keys, self._heap
        key, state, cell = self._key, self._state, self.cell
        pop, push = heapq.heappop, heapq.heappush
        while timers and timers[0][0] <= now:
            _, block_id, old = pop(timers)
            if keys.get(block_id) is old:
                block = old[3]
                c = state.get(block_id)
                k = keys[block_id] = key(block, c if c is not None else cell(block), now)
                push(heap, k)

    def _compact(self) -> None:
        """Drop the stale entries of the heap and of the timers. Evictions rebuild the heap,
        but a cache that seldom evicts would keep a stale entry for every hit on a released
        block; `on_finish` compacts once they outnumber the live ones twice over (amortized
        O(1) per entry), so the policy's memory follows its candidates, not its traffic."""
        keys = self._keys
        heap = [entry for entry in self._heap if keys.get(entry[2]) is entry]
        heapq.heapify(heap)
        self._heap = heap
        if self._timers:
            timers = [timer for timer in self._timers if keys.get(timer[1]) is timer[2]]
            heapq.heapify(timers)
            self._timers = timers

    def _rebuild(self, now: float) -> None:
        """Reprice every candidate with the current estimates and horizon."""
        self._t0 = now
        self._key_horizon = self.horizon
        keys, pending = self._keys, self._pending
        blocks = [entry[3] for entry in keys.values()]
        blocks += pending.values()
        pending.clear()
        self._exposed.clear()
        self._odds.clear()
        self._timers = []
        self._held = None
        keys.clear()
        heap = []
        key, cell, state = self._key, self.cell, self._state
        for block in blocks:
            block_id = block.block_id
            c = state.get(block_id)
            k = keys[block_id] = key(block, c if c is not None else cell(block), now)
            heap.append(k)
        heapq.heapify(heap)
        self._heap = heap
        self._since_rebuild = 0

    # -- events ----------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Resolve the trials that are too old at ``now``: censored past the window
        (empirical gaps), failed past the horizon (exponential)."""
        if self._empirical:
            self.table.expire(now)
        else:
            self.table.expire(now, self.horizon)

    def _resolve(self, block_hashes: Iterable[Any], now: float) -> None:
        """``block_hashes`` are used again at ``now``."""
        self.table.reuse_all(block_hashes, now, self.horizon)

    def on_hits(self, request: Request, hits: Sequence[BlockInfo], now: float) -> None:
        self._expire(now)
        self._resolve([block.block_hash for block in hits], now)

    def on_begin(self, request: Request, hits: Sequence[BlockInfo],
                 new: Sequence[BlockInfo], now: float) -> None:
        # the misses that cached content used before: reuses the cache did not serve
        self._resolve([block.block_hash for block in new], now)
        ghost = self._ghost
        if ghost is not None and ghost.uses:
            ghost.recall(new)
        self._running[request.request_id] = (self.conversations.begin(
            request, hits, new, self.manager_block_size), len(hits) + len(new))

    def on_finish(self, request: Request, blocks: Sequence[BlockInfo], now: float) -> None:
        run = self._running.pop(request.request_id, None)
        if not blocks:
            return
        table = self.table
        turn = 1
        if run is not None:
            conv, known = run
            turn = conv[1]
            self.conversations.finish(conv, blocks)
            # blocks cached after the begin (later prefill chunks): reuses when they were
            # cached, before the trials they resolve can expire
            for block in blocks[known:]:
                self._resolve((block.block_hash,), block.created)
            ghost = self._ghost
            if ghost is not None and ghost.uses:
                ghost.recall(blocks[known:])
        out = request.output_len
        cells = self._cells(blocks, min(out.bit_length(), 10) if out > 0 else 0, turn)
        self._expire(now)
        filed = dict(zip([block.block_id for block in blocks], cells))
        self._state.update(filed)
        # one block use in TRIAL_EVERY is a trial (LRB samples too), counted across requests
        every, n = TRIAL_EVERY, len(blocks)
        first = every - 1 - self._sampled
        if first < n:
            table.open_all([(blocks[i].block_hash, cells[i]) for i in range(first, n, every)],
                           now)
        self._sampled = (self._sampled + n) % every
        # the request's released candidates are priced now that their features are known
        pending = self._pending
        if pending:
            keys, heap, key = self._keys, self._heap, self._key
            for block_id in [i for i in pending if i in filed]:
                block = pending.pop(block_id)
                k = keys[block_id] = key(block, filed[block_id], now)
                heapq.heappush(heap, k)
            bound = 2 * len(keys) + 1024
            if len(heap) > bound or len(self._timers) > bound:
                self._compact()

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        block_id = block.block_id
        cell = self._state.get(block_id)
        if cell is None or block.last_access >= now:
            # released now (its request's on_finish gives its features), or never released
            self._pending[block_id] = block
        else:  # exposed by an eviction: its features are those of its last release
            key = self._keys[block_id] = self._key(block, cell, now)
            held = self._held
            if held is not None and self._keys.get(held[2]) is held:
                heapq.heappush(self._heap, held)  # the one exposed before it
            self._held = key
            self._exposed.append(block)
            self._exposed_at = self.table.observations

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        block_id = block.block_id
        if self._pending.pop(block_id, None) is None:
            del self._keys[block_id]

    def on_evict(self, block: BlockInfo, now: float) -> None:
        block_id = block.block_id
        if self._pending.pop(block_id, None) is None:
            self._keys.pop(block_id, None)
        self._evicted_block(block, now)

    def _evicted_block(self, block: BlockInfo, now: float) -> None:
        """Forget an evicted block's features and conversation, and note its idle time for
        the horizon (folded in when `horizon` is next read)."""
        block_id = block.block_id
        ghost = self._ghost
        if ghost is not None:
            ghost.remember(block, len(self._state))
        self._state.pop(block_id, None)
        self.conversations.forget(block_id)
        self._idles.append(now - block.last_access)
        self._since_rebuild += 1

    def _top(self, now: float) -> tuple[float, int, int, BlockInfo] | None:
        if self._since_rebuild >= REPRICE_EVERY * (len(self._keys) + len(self._pending)):
            self._rebuild(now)
        else:
            if self._pending:
                self._price_pending(now)
            exposed = self._exposed
            if exposed:
                if self._exposed_at != self.table.observations:
                    self._reprice(exposed, now)
                exposed.clear()
            if self._timers:
                self._rekey_due(now)
        heap, keys = self._heap, self._keys
        held = self._held
        if held is not None:
            if keys.get(held[2]) is not held:  # stale (repriced, evicted, no longer offered)
                self._held = held = None
            elif not heap or held < heap[0]:
                return held  # below the heap's first entry, stale or not: below them all
        while heap and keys.get(heap[0][2]) is not heap[0]:
            heapq.heappop(heap)  # a stale entry, as above
        if held is not None and (not heap or held < heap[0]):
            return held
        return heap[0] if heap else None

    def victim(self, now: float) -> int | None:
        top = self._top(now)
        return None if top is None else top[2]

    def pop_victim(self, now: float) -> int | None:
        top = self._top(now)
        if top is None:
            return None
        if top is self._held:
            self._held = None
        else:
            heapq.heappop(self._heap)
        block_id = top[2]
        del self._keys[block_id]
        self._evicted_block(top[3], now)
        return block_id

    def __repr__(self) -> str:
        ghost = ", ghost=True" if self.ghost else ""
        return (f"LearnedReuse(gaps={self.gaps!r}{ghost}, prior_weight={self.prior_weight}, "
                f"memory={self.memory}, horizon={self.horizon:.3g})")
