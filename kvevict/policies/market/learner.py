"""The market's online learner: sessions, their turns, and the per-class reuse estimates.

Each turn of a session is a trial: it succeeds when the session begins another turn (its gap,
from its last release to the new begin, is a reuse-gap sample) and fails once it has been idle
``abandon_after_s``. Per class and turn bucket, ``p`` is a Beta posterior mean
(``prior_weight`` pseudo-trials at the default); per class, ``mu`` is estimated in log space
(``E[log gap] = log mu - gamma`` for exponential gaps, Euler's gamma), with ``prior_weight``
pseudo-samples at the default. Counts decay by ``1 - 1/memory`` per observation. New estimates
take effect at the next `ReuseLearner.sync` at a new clock time: every `ReuseModel` handed out
is then updated in place and `ReuseLearner.version` moves on.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

from kvevict.policies.market.price import (
    NUM_TURN_BUCKETS,
    ClassEstimate,
    ClassParams,
    ReuseModel,
    turn_bucket,
)

__all__ = ["ClassStats", "ReuseLearner", "SessionRecord"]

_EULER = 0.5772156649015329
_P_MIN, _P_MAX = 1e-4, 1.0 - 1e-4
_MIN_GAP_S = 1e-3


class SessionRecord:
    """What the learner knows of one session: its class, turns so far (and their
    `turn_bucket`), the clock time of its last begin and of its last activity, and whether a
    trial is open."""

    __slots__ = ("bucket", "cls", "last_begin", "last_seen", "pending", "turns")

    def __init__(self, cls: str, now: float) -> None:
        self.cls = cls
        self.turns = 1
        self.bucket = 0  # turn_bucket(turns), kept with it: the hot paths read it
        self.last_begin = now
        self.last_seen = now
        self.pending = False


class ClassStats:
    """Decayed observation counts of one class: returns and abandonments per turn bucket,
    and the sum of log reuse gaps."""

    __slots__ = ("fail", "log_gap_sum", "n_gap", "succ")

    def __init__(self) -> None:
        self.succ = [0.0] * NUM_TURN_BUCKETS
        self.fail = [0.0] * NUM_TURN_BUCKETS
        self.log_gap_sum = 0.0
        self.n_gap = 0.0

    def decay(self, g: float) -> None:
        self.succ = [x * g for x in self.succ]
        self.fail = [x * g for x in self.fail]
        self.log_gap_sum *= g
        self.n_gap *= g


class ReuseLearner:
    """Sessions and turns, learned return probabilities and reuse gaps, and the current
    `ReuseModel` per (class, turn bucket).

    The arguments are `Market`'s (validated there).
    """

    def __init__(self, class_params: Mapping[str, ClassParams], default_class: str,
                 horizon: float, learn: bool, prior_weight: float, memory: float,
                 max_sessions: int) -> None:
        self.class_params = class_params
        self.default_class = default_class
        self.horizon = horizon
        self.learn = learn
        self.prior_weight = prior_weight
        self.max_sessions = max_sessions
        self.gamma = 1.0 - 1.0 / memory
        #: session id -> record, least recently begun first
        self.sessions: OrderedDict[Any, SessionRecord] = OrderedDict()
        #: estimates changed since the last version (takes effect at the next new clock time)
        self.version = 0
        #: moves on whenever a session record may change (`touch`, `reclass`)
        self.epoch = 0
        self.synced_now: float | None = None
        self._models: dict[tuple[str, int], ReuseModel] = {}
        self._class_models: dict[str, list[tuple[int, ReuseModel]]] = {}  # the same, by class
        #: class -> its models by turn bucket (None where not made yet): the hot paths' table
        self.tables: dict[str, list[ReuseModel | None]] = {}
        self._dirty_classes: set[str] = set()  # observed since the last sync
        self._stats: dict[str, ClassStats] = {}
        self._fifo: dict[str, deque] = {}  # open trials per class, by start time
        self._stats_dirty = False

    # -- parameters ------------------------------------------------------------------------

    def params(self, cls: str) -> ClassParams:
        """The prior parameters of ``cls`` (``default_class``'s for an unknown class)."""
        cp = self.class_params.get(cls)
        return cp if cp is not None else self.class_params[self.default_class]

    def estimate(self, cls: str, tb: int) -> tuple[float, float]:
        """Current (p_return, mean_reuse_s) of ``cls`` in turn bucket ``tb``."""
        return self._p_return(cls, tb), self._mean_reuse(cls)

    def _p_return(self, cls: str, tb: int) -> float:
        p = self.params(cls).p_return[tb]
        st = self._stats.get(cls) if self.learn else None
        if st is not None:
            w = self.prior_weight
            p = (w * p + st.succ[tb]) / (w + st.succ[tb] + st.fail[tb])
        return min(max(p, _P_MIN), _P_MAX)

    def _mean_reuse(self, cls: str) -> float:
        mu = self.params(cls).mean_reuse_s
        st = self._stats.get(cls) if self.learn else None
        if st is not None:
            w = self.prior_weight
            log_mu = (w * (math.log(mu) - _EULER) + st.log_gap_sum) / (w + st.n_gap) + _EULER
            mu = math.exp(log_mu)
        return mu

    def model(self, cls: str, tb: int) -> ReuseModel:
        """The `ReuseModel` of (``cls``, ``tb``), kept current by `sync`."""
        model = self._models.get((cls, tb))
        if model is None:
            model = self._models[(cls, tb)] = ReuseModel()
            model.set(*self.estimate(cls, tb), self.horizon)
            self._class_models.setdefault(cls, []).append((tb, model))
            table = self.tables.get(cls)
            if table is None:
                table = self.tables[cls] = [None] * NUM_TURN_BUCKETS
            table[tb] = model
        return model

    def class_estimate(self, cls: str) -> ClassEstimate:
        """The current reuse model of ``cls`` with its observation counts."""
        ps, mu = [], 0.0
        for tb in range(NUM_TURN_BUCKETS):
            p, mu = self.estimate(cls, tb)
            ps.append(p)
        st = self._stats.get(cls)
        return ClassEstimate(cls, tuple(ps), mu, sum(st.succ) if st else 0.0,
                             sum(st.fail) if st else 0.0, st.n_gap if st else 0.0)

    def sync(self, now: float) -> None:
        """At a new clock time: expire unreturned trials, apply what was learned."""
        if now == self.synced_now:
            return
        self.synced_now = now
        if self.learn:
            self._expire(now)
        if self._stats_dirty:
            # Only the observed classes' estimates moved. One table per class: its gap
            # model (mu, 1/mu, log(1 - exp(-H/mu))) once, then each bucket's p.
            self._stats_dirty = False
            for cls in self._dirty_classes:
                models = self._class_models.get(cls)
                if not models:
                    continue
                mu = self._mean_reuse(cls)
                r, log_hf = ReuseModel.gap_terms(mu, self.horizon)
                for tb, model in models:
                    model.update(self._p_return(cls, tb), mu, r, log_hf)
            self._dirty_classes.clear()
            self.version += 1

    # -- learning --------------------------------------------------------------------------

    def _observe(self, cls: str, tb: int, gap: float | None) -> None:
        st = self._stats.get(cls)
        if st is None:
            st = self._stats[cls] = ClassStats()
        if self.gamma < 1.0:
            st.decay(self.gamma)
        if gap is None:
            st.fail[tb] += 1.0
        else:
            st.succ[tb] += 1.0
            st.log_gap_sum += math.log(max(gap, _MIN_GAP_S))
            st.n_gap += 1.0
        self._stats_dirty = True
        self._dirty_classes.add(cls)

    def _open_trial(self, rec: SessionRecord, now: float) -> None:
        rec.pending = True
        fifo = self._fifo.get(rec.cls)
        if fifo is None:
            fifo = self._fifo[rec.cls] = deque()
        fifo.append((now, rec, rec.turns))

    def _expire(self, now: float) -> None:
        for cls, fifo in list(self._fifo.items()):
            wait = self.params(cls).abandon_after_s
            while fifo and fifo[0][0] + wait <= now:
                _, rec, turns = fifo.popleft()
                if rec.turns != turns or not rec.pending:
                    continue  # the session came back meanwhile
                if rec.last_seen + self.params(rec.cls).abandon_after_s > now:
                    target = self._fifo.setdefault(rec.cls, deque())
                    target.append((rec.last_seen, rec, turns))  # still within its window
                    continue
                rec.pending = False
                self._observe(rec.cls, turn_bucket(turns), None)

    def reclass(self, rec: SessionRecord, cls: str) -> None:
        """The session of ``rec`` is of class ``cls`` from now on."""
        rec.cls = cls
        self.epoch += 1

    def touch(self, session: Any, cls: str, now: float, own: bool, begins: bool) -> None:
        """Session ``session`` is active at ``now``; ``begins``: the event marks a begin, a new
        turn unless the session already began at ``now``. ``own``: ``cls`` is its own class."""
        if session is None:
            return
        self.epoch += 1
        if begins and now != self.synced_now:
            self.sync(now)  # expire old trials even if nothing is ever evicted
        sessions = self.sessions
        rec = sessions.get(session)
        if rec is None:
            if not begins:
                return
            rec = sessions[session] = SessionRecord(cls, now)
            if len(sessions) > self.max_sessions:
                sessions.popitem(last=False)
            if self.learn:
                self._open_trial(rec, now)
            return
        if own:
            rec.cls = cls
        if not begins or rec.last_begin == now:
            return
        if self.learn and rec.pending:
            rec.pending = False
            self._observe(rec.cls, turn_bucket(rec.turns), now - rec.last_seen)
        rec.turns += 1
        rec.bucket = turn_bucket(rec.turns)
        rec.last_begin = rec.last_seen = now
        sessions.move_to_end(session)
        if self.learn:
            self._open_trial(rec, now)
