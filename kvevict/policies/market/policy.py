"""The `Market` policy: evict the candidate whose expected reload cost per byte is lowest.

It composes the three parts of the market, each in its own module:

- `kvevict.policies.market.price`: the reuse and price model (`ClassParams`, the odds of one
  session, the union over sharers, the quantized cost per byte);
- `kvevict.policies.market.learner`: sessions, turns and the online estimates
  (`ReuseLearner`);
- `kvevict.policies.market.index`: the candidate index ordered by price (`PriceIndex`).

This module turns the manager's block events into the learner's session events and the
index's candidates, and prices shared blocks (the union over their tracked sharers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.policies.base import Policy, register_policy
from kvevict.policies.market.index import PriceIndex
from kvevict.policies.market.learner import ReuseLearner
from kvevict.policies.market.price import (
    DEFAULT_CLASS_PARAMS,
    ClassEstimate,
    ClassParams,
    CostBuckets,
    Quote,
    ReuseModel,
    check_learning,
    checked_cost_model,
    is_number,
    union_log_p,
)
from kvevict.types import BlockInfo, Request

__all__ = ["Market"]

_NOBODY = object()  # a session id no request has


@register_policy("market")
class Market(Policy):
    """Evict the candidate with the lowest price (reuse odds x reload cost / bytes).

    Args:
        cost_model: recompute costs (default: `CostModel()`, Llama-3-8B on an H100).
        block_size: tokens per block, for the cost of a block's depth. None: taken from the
            first block that carries token ids, else 16 (hash-only traces carry none).
        horizon: seconds ahead over which reuse is counted (``H``).
        class_params: per-class overrides: a `ClassParams`, or a mapping of some of its fields
            (merged over the built-in defaults, or over ``default_class``'s for a new class).
        default_class: the class whose defaults an unknown class starts from.
        learn: learn ``p_return`` and ``mean_reuse_s`` online from observed returns.
        prior_weight: pseudo-observations the defaults are worth when learning.
        memory: observations after which old ones weigh ``1/e`` (exponential forgetting).
        cost_resolution: cost buckets per octave (the price uses the bucket's cost).
        max_sessions: sessions whose turn counts are remembered (least recently active forgotten).
        max_sharers: most recent sharers tracked exactly per shared block.
    """

    def __init__(self, cost_model: CostModel | None = None, *, block_size: int | None = None,
                 horizon: float = 60.0,
                 class_params: Mapping[str, ClassParams | Mapping[str, Any]] | None = None,
                 default_class: str = "chat", learn: bool = True, prior_weight: float = 8.0,
                 memory: float = 1000.0, cost_resolution: int = 8,
                 max_sessions: int = 100_000, max_sharers: int = 64) -> None:
        cost_model = checked_cost_model(cost_model, block_size)
        if not is_number(horizon) or not (0 < horizon < math.inf):
            raise ConfigError(f"horizon must be a positive finite number of seconds, "
                              f"got {horizon!r}")
        if not isinstance(learn, bool):
            raise ConfigError(f"learn must be True or False, got {learn!r}")
        check_learning(prior_weight, memory)
        for name, value, low in (("cost_resolution", cost_resolution, 1),
                                 ("max_sessions", max_sessions, 1),
                                 ("max_sharers", max_sharers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(default_class, str) or not default_class:
            raise ConfigError(f"default_class must be a non-empty class name, "
                              f"got {default_class!r}")
        params = dict(DEFAULT_CLASS_PARAMS)
        if class_params is not None:
            if not isinstance(class_params, Mapping):
                raise ConfigError("class_params must map class names to ClassParams or to "
                                  f"dicts of ClassParams fields, got "
                                  f"{type(class_params).__name__}")
            fields = [f.name for f in attrs.fields(ClassParams)]
            for cls, override in class_params.items():
                if not isinstance(cls, str) or not cls:
                    raise ConfigError(f"class_params keys must be class names, got {cls!r}")
                if isinstance(override, ClassParams):
                    params[cls] = override
                    continue
                if not isinstance(override, Mapping):
                    raise ConfigError(f"class_params[{cls!r}] must be a ClassParams or a dict "
                                      f"of its fields ({', '.join(fields)}), got {override!r}")
                unknown = [k for k in override if k not in fields]
                if unknown:
                    raise ConfigError(f"class_params[{cls!r}] has unknown field(s) "
                                      f"{', '.join(map(str, unknown))}; valid: "
                                      f"{', '.join(fields)}")
                base = params.get(cls, params.get(default_class))
                if base is None:
                    missing = [f for f in ("p_return", "mean_reuse_s", "abandon_after_s")
                               if f not in override]
                    if missing:
                        raise ConfigError(f"class_params[{cls!r}] is a new class; give "
                                          f"{', '.join(missing)}")
                    params[cls] = ClassParams(**override)
                else:
                    params[cls] = attrs.evolve(base, **override)
        if default_class not in params:
            raise ConfigError(f"default_class {default_class!r} has no parameters; known: "
                              f"{', '.join(sorted(params))} (or add it in class_params)")
        self.cost_model = cost_model
        self.block_size = block_size
        self.horizon = float(horizon)
        self.class_params: dict[str, ClassParams] = params
        self.default_class = default_class
        self.learn = learn
        self.prior_weight = float(prior_weight)
        self.memory = float(memory)
        self.cost_resolution = cost_resolution
        self.max_sessions = max_sessions
        self.max_sharers = max_sharers
        #: the online learner (sessions, turns, estimates)
        self.learner = ReuseLearner(params, default_class, self.horizon, learn,
                                    self.prior_weight, self.memory, max_sessions)
        #: the candidate index ordered by price
        self.index = PriceIndex(self._shared_log_p, self._model_of)
        self._costs = CostBuckets(cost_model, block_size, cost_resolution)
        self._log_c_at: dict[int, float] = {}  # depth -> log cost per byte, at _log_c_nbytes
        self._log_c_nbytes: int | None = None
        self._index_add, self._index_remove = self.index.add, self.index.remove
        self._cheapest_entry = self.index.cheapest_entry
        self._sessions = self.learner.sessions
        # block id -> [block, its most recent sharers]; at most one entry per pool block
        self._sharer_log: dict[int, list] = {}
        # moves on whenever a sharer log may change (a request's hits)
        self._log_epoch = 0
        # the last union: (now, learner version and epoch, log epoch, class, log, log P)
        self._last_union: tuple = (None, -1, -1, -1, None, None, 0.0)
        self._forget_sharers = self._sharer_log.pop

    # -- parameters ------------------------------------------------------------------------

    @property
    def price_evaluations(self) -> int:
        """Price evaluations so far (one per queue head priced); for tests and profiling."""
        return self.index.evaluations

    def params(self, workload_class: str) -> ClassParams:
        """The prior `ClassParams` of ``workload_class`` (``default_class``'s if unknown)."""
        return self.learner.params(workload_class)

    def estimate(self, workload_class: str, now: float | None = None) -> ClassEstimate:
        """The current reuse model of ``workload_class`` (prior + what was learned).

        With ``now``, sessions idle past their class's ``abandon_after_s`` at ``now`` are
        first counted as abandoned.
        """
        if not isinstance(workload_class, str) or not workload_class:
            raise ConfigError(f"workload_class must be a non-empty string, "
                              f"got {workload_class!r}")
        if now is not None:
            if not is_number(now):
                raise ConfigError(f"now must be a clock time (number), got {now!r}")
            self.learner.sync(float(now))
        return self.learner.class_estimate(workload_class)

    # -- events ----------------------------------------------------------------------------

    def on_insert(self, block: BlockInfo, now: float) -> None:
        # A begin either hits (on_hits) or, when nothing is cached, inserts block 0 first; a
        # later chunk of a chunked prefill inserts deeper blocks only, and is not a new turn.
        if block.created_by != "prefill":
            return
        rec = self._sessions.get(block.session)
        if rec is not None and (block.depth or rec.last_begin == now):
            if rec.cls != block.workload_class:
                self.learner.reclass(rec, block.workload_class)
            return
        self.learner.touch(block.session, block.workload_class, now, True, block.depth == 0)

    def on_hits(self, request: Request, hits: Sequence[BlockInfo], now: float) -> None:
        # A request's hits (begin or resume) begin the session's turn, under the class of
        # the first hit block (the learner's touch; none if the session began at ``now``),
        # and make it a recent sharer of each shared hit block. Sent before the request's
        # new blocks are cached (on_insert), as the per-block hits were.
        self._log_epoch += 1
        session = request.session_id
        rec = self._sessions.get(session)
        if rec is None or rec.last_begin != now:
            self.learner.touch(session, hits[0].workload_class, now, False, True)
        sharer_log = self._sharer_log
        limit = 2 * self.max_sharers
        for block in hits:
            if block.num_sharers > 1:
                tracked = sharer_log.get(block.block_id)
                if tracked is None or tracked[0] is not block:
                    self._sharers_of(block)
                else:
                    log = tracked[1]
                    log[session] = now
                    if len(log) > limit:  # keep the most recent, amortized O(1)
                        tracked[1] = self._most_recent(log)

    def _most_recent(self, sharers: dict[Any, float]) -> dict[Any, float]:
        if len(sharers) <= self.max_sharers:
            return dict(sharers)
        return dict(sorted(sharers.items(), key=lambda kv: kv[1])[-self.max_sharers:])

    def _sharers_of(self, block: BlockInfo) -> dict[Any, float]:
        """The most recent sharers of ``block`` (``max_sharers`` to twice that), tracked from
        now on."""
        tracked = self._sharer_log.get(block.block_id)
        if tracked is not None and tracked[0] is block:
            return tracked[1]
        log = self._most_recent(block.sharers)
        self._sharer_log[block.block_id] = [block, log]
        return log

    def _classify(self, block: BlockInfo) -> tuple[ReuseModel | None, float]:
        """(reuse model, or None for a shared block; quantized log cost per byte)."""
        log_c = self._costs.of(block)[0]
        if block.num_sharers > 1:
            return None, log_c
        rec = self._sessions.get(block.session)
        tb = rec.bucket if rec is not None else 0
        return self.learner.model(block.workload_class, tb), log_c

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        k = block.num_sharers
        if k > 1:
            rec = self._sessions.get(block.last_hit_session)
            tb = -((k - 1).bit_length())  # sharer bucket: 2, 3-4, 5-8, ...
        else:
            rec = self._sessions.get(block.session)
            tb = 0 if rec is None else rec.bucket
        if rec is not None and block.last_access == now:
            rec.last_seen = now  # a release: the session's idle time starts here
        log_c = self._log_c_at.get(block.depth) if block.nbytes == self._log_c_nbytes else None
        if log_c is None:
            log_c = self._log_c_of(block)
        self._index_add(block, (block.workload_class, tb, log_c), log_c)

    def _log_c_of(self, block: BlockInfo) -> float:
        """The quantized log cost per byte of ``block``, remembered by depth for blocks of
        the first size seen (all of one pool's)."""
        log_c = self._costs.of(block)[0]
        if self._log_c_nbytes is None:
            self._log_c_nbytes = block.nbytes
        if block.nbytes == self._log_c_nbytes:
            self._log_c_at[block.depth] = log_c
        return log_c

    def _model_of(self, key: tuple) -> ReuseModel | None:
        """The reuse model of a new queue ``(class, bucket, log cost)``: None when shared."""
        cls, tb, _ = key
        return self.learner.model(cls, tb) if tb >= 0 else None

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._index_remove(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        block_id = block.block_id
        self._index_remove(block_id)
        self._sharer_log.pop(block_id, None)

    # -- prices ----------------------------------------------------------------------------

    def _shared_log_p(self, block: BlockInfo, now: float) -> float:
        """log P(at least one sharer comes back within the horizon).

        `union_log_p` of the sharers' ``log q``. When every sharer is tracked, in one pass
        with the same operations in the same order (so the same float): the sharers' models
        come from the learner's per-class tables, looked up again only when the class or
        turn bucket changes from one sharer to the next. The blocks of a shared chain have
        the same sharers at the same times: a union whose inputs are those of the last one
        (the clock, the learner's version and session records, the sharer log in order, the
        class) is that one's.
        """
        log = self._sharers_of(block)
        n = len(log)
        if not n or block.num_sharers > n:  # none, or some untracked: the general union
            return self._union_of(block, log, now)
        learner = self.learner
        cls0 = block.workload_class
        last = self._last_union
        if (now == last[0] and learner.version == last[1] and learner.epoch == last[2]
                and self._log_epoch == last[3] and cls0 == last[4] and log == last[5]
                and list(log) == list(last[5])):
            return last[6]  # the same sharers at the same times (the next block of a chain)
        log_p = self._union_pass(log, cls0, now)
        if log_p is None:
            log_p = self._union_of(block, log, now)
        self._last_union = (now, learner.version, learner.epoch, self._log_epoch, cls0, log,
                            log_p)
        return log_p

    def _union_pass(self, log: dict[Any, float], cls0: str, now: float) -> float | None:
        """`_shared_log_p` over tracked sharers in one pass; None when every odds underflowed
        (then the general union sums them)."""
        sessions_get = self._sessions.get
        tables = self.learner.tables
        model = self.learner.model
        exp, log1p = math.exp, math.log1p
        total = 0.0
        certain = False  # some q >= 1: the union is 1
        m_cls: Any = _NOBODY
        m_tb = -1
        r = big_l = log_hf = 0.0
        for session, t in log.items():
            rec = sessions_get(session)
            if rec is None:
                cls, tb = cls0, 0
            else:
                cls, tb = rec.cls, rec.bucket
            if tb != m_tb or cls != m_cls:
                table = tables.get(cls)
                m = table[tb] if table is not None else None
                if m is None:
                    m = model(cls, tb)
                m_cls, m_tb = cls, tb
                r, big_l, log_hf = m.r, m.L, m.log_hf
            z = (now - t) * r - big_l  # m.log_q(now - t), inlined
            q = exp(log_hf - (z if z > 35.0 else exp(z) if z < -35.0 else log1p(exp(z))))
            if q >= 1.0:
                certain = True  # the union is 1 (what follows is not used)
            else:
                total += log1p(-q)
        if certain:
            return 0.0
        p = -math.expm1(total)
        return math.log(p) if p > 0.0 else None

    def _union_of(self, block: BlockInfo, log: dict[Any, float], now: float) -> float:
        """`union_log_p` over the tracked sharers ``log`` of ``block``, the untracked ones
        at the odds of the oldest tracked."""
        sessions = self._sessions
        model = self.learner.model
        log_qs = []
        oldest, oldest_t = 0, math.inf
        for session, t in log.items():
            rec = sessions.get(session)
            m = model(block.workload_class, 0) if rec is None else model(rec.cls, rec.bucket)
            if t < oldest_t:
                oldest, oldest_t = len(log_qs), t
            log_qs.append(m.log_q(now - t))
        extra = max(0, block.num_sharers - len(log_qs))
        return union_log_p(log_qs, oldest, extra)

    def _log_price(self, block: BlockInfo, now: float) -> tuple[float, float]:
        """(log price, log reuse probability) of any cached block, as if a candidate now."""
        entry = self.index.entry(block.block_id)
        if entry is not None and entry[3] is block:
            log_price = self.index.entry_log_price(entry, now)
            return log_price, log_price - entry[4].log_c
        model, log_c = self._classify(block)
        if model is None:
            log_p = self._shared_log_p(block, now)
        else:
            log_p = model.log_q(now - block.last_access)
        return log_c + log_p, log_p

    def price(self, block: BlockInfo, now: float) -> float:
        """Price of ``block`` at ``now``: reuse probability x quantized cost / bytes
        (seconds of recompute per byte)."""
        self.learner.sync(now)
        return math.exp(self._log_price(block, now)[0])

    def reuse_probability(self, block: BlockInfo, now: float) -> float:
        """P(``block`` is reused within the horizon | what is known at ``now``)."""
        self.learner.sync(now)
        return math.exp(self._log_price(block, now)[1])

    # -- victim ----------------------------------------------------------------------------

    def victim(self, now: float) -> int | None:
        learner = self.learner
        if now != learner.synced_now:
            learner.sync(now)
        return self.index.cheapest_id(now, learner.version)

    def pop_victim(self, now: float) -> int | None:
        learner = self.learner
        if now != learner.synced_now:
            learner.sync(now)
        entry = self._cheapest_entry(now, learner.version, True)
        if entry is None:
            return None
        block_id = entry[2]
        self._forget_sharers(block_id, None)
        return block_id

    def cheapest(self, k: int, now: float) -> list[Quote]:
        """Quotes of the ``k`` candidates `victim` would take next at ``now``, cheapest first.

        A k-way merge over the queues: O(Q + k log Q) price evaluations, not a scan.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"k must be a non-negative int, got {k!r}")
        self.learner.sync(now)
        out: list[Quote] = []
        for log_price, entry in self.index.cheapest(k, now):
            block, q = entry[3], entry[4]
            _, cost, nbytes = self._costs.of(block)
            out.append(Quote(entry[2], math.exp(log_price), math.exp(log_price - q.log_c),
                             cost, nbytes, block.workload_class))
        return out

    def cheapest_prices(self, k: int, now: float) -> list[float]:
        """Prices of the ``k`` cheapest candidates at ``now``, ascending."""
        return [quote.price for quote in self.cheapest(k, now)]

    @property
    def num_queues(self) -> int:
        """Non-empty recency queues (the most price evaluations one victim call costs)."""
        return self.index.nonempty

    def __len__(self) -> int:
        return len(self.index)

    def __repr__(self) -> str:
        return (f"Market(horizon={self.horizon}, learn={self.learn}, "
                f"classes={sorted(self.class_params)})")
