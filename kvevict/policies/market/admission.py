"""`MarketAdmission`: defer a low-value request while the blocks it would evict are worth
more than it is (the market's prices, seen by admission); and admission control by name
(`ADMISSIONS`, `admission_for`), as ``kvevict simulate --admission`` and `kvevict.study.Study`
take it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvevict.admission import Admission, AdmissionDecision
from kvevict.errors import ConfigError
from kvevict.policies.market.policy import Market
from kvevict.policies.market.price import is_number
from kvevict.types import Request

#: Admission control by name: ``"always"`` never defers (`kvevict.admission.AlwaysAdmit`, the
#: behaviour of vLLM and SGLang); ``"market"`` is `MarketAdmission` with its defaults, quoting
#: the prices of the run's own `Market` (`admission_for`).
ADMISSIONS = ("always", "market")
#: `MarketAdmission`'s default bound on a request's total wait, in seconds: a policy choice
#: (no source measures it), short next to the minutes a batch job takes and long next to the
#: seconds an agent's tool call keeps its state hot (`ClassParams.mean_reuse_s` 6.2 s)
DEFAULT_MAX_WAIT = 30.0

if TYPE_CHECKING:
    from kvevict.manager import KVCacheManager

__all__ = ["ADMISSIONS", "DEFAULT_MAX_WAIT", "MarketAdmission", "admission_for", "check_admission",
           "quotes_prices"]


class MarketAdmission(Admission):
    """Defer a low-value request while the blocks it would evict are worth more than it is.

    For a request of class ``c`` that must evict ``n`` blocks, the market quotes the ``n``
    cheapest candidates ``i`` (reuse probability ``P_i``, recompute seconds ``cost_i``):

    - ask = ``sum_i P_i * cost_i``: the recompute the evictions are expected to cause;
    - bid = ``weight_c * sum_i cost_i``: the memory's worth to the request, i.e. the request
      may evict state whose cost-weighted mean reuse probability is at most ``weight_c``.

    If ask > bid and ``c`` is deferrable, the request waits (`AdmissionDeferred` from the
    manager, ``retry_after`` = ``retry_interval`` or the time left), at most ``max_wait``
    seconds after its first deferral, then is admitted whatever the prices. Interactive
    classes (chat, agent, rag) are never deferred by default, so a batch job cannot starve an
    interactive user, and the wait bound means the batch job is not starved either.

    Args:
        market: the `Market` the manager evicts with (it supplies the quotes).
        max_wait: seconds a request may be deferred in total.
        weights: per-class weights (default: each class's `ClassParams.weight`).
        deferrable: classes that may be deferred (default: those with
            `ClassParams.deferrable`: batch, single_shot).
        retry_interval: suggested seconds between retries.
    """

    def __init__(self, market: Market, *, max_wait: float = DEFAULT_MAX_WAIT,
                 weights: Mapping[str, float] | None = None,
                 deferrable: Iterable[str] | None = None, retry_interval: float = 1.0) -> None:
        if not isinstance(market, Market):
            raise ConfigError(f"market must be a Market policy, got {type(market).__name__}")
        if not is_number(max_wait) or not (0 <= max_wait < math.inf):
            raise ConfigError(f"max_wait must be a finite number of seconds >= 0, "
                              f"got {max_wait!r}")
        if not is_number(retry_interval) or not (0 < retry_interval < math.inf):
            raise ConfigError(f"retry_interval must be a positive finite number of seconds, "
                              f"got {retry_interval!r}")
        if weights is not None:
            if not isinstance(weights, Mapping):
                raise ConfigError(f"weights must map class names to numbers >= 0, "
                                  f"got {type(weights).__name__}")
            for cls, w in weights.items():
                if not isinstance(cls, str) or not is_number(w) or not (0 <= w < math.inf):
                    raise ConfigError(f"weights must map class names to finite numbers >= 0, "
                                      f"got {cls!r}: {w!r}")
        if deferrable is not None:
            if isinstance(deferrable, str):
                raise ConfigError("deferrable must be a collection of class names, not one "
                                  f"string ({deferrable!r}); e.g. ('batch',)")
            try:
                deferrable = frozenset(deferrable)
            except TypeError:
                raise ConfigError(f"deferrable must be a collection of class names, "
                                  f"got {deferrable!r}") from None
            if not all(isinstance(c, str) and c for c in deferrable):
                raise ConfigError(f"deferrable must hold class names, got {sorted(deferrable)}")
        self.market = market
        self.max_wait = float(max_wait)
        self.retry_interval = float(retry_interval)
        self.weights = dict(weights) if weights is not None else None
        self.deferrable = deferrable
        self.deferrals = 0  #: deferral decisions so far
        self._first: dict[Any, float] = {}

    def weight(self, workload_class: str) -> float:
        """What a request of ``workload_class`` bids per unit of cost."""
        if self.weights is not None and workload_class in self.weights:
            return float(self.weights[workload_class])
        return self.market.params(workload_class).weight

    def is_deferrable(self, workload_class: str) -> bool:
        """Whether requests of ``workload_class`` may be made to wait."""
        if self.deferrable is not None:
            return workload_class in self.deferrable
        return self.market.params(workload_class).deferrable

    def admit(self, request: Request, num_evictions: int, manager: KVCacheManager,
              now: float) -> AdmissionDecision:
        cls = request.workload_class
        if not self.is_deferrable(cls) or num_evictions <= 0:
            return AdmissionDecision(True)
        rid = request.request_id
        first = self._first.get(rid)
        if first is not None and now >= first + self.max_wait:
            return AdmissionDecision(True, reason=f"waited {now - first:.3g} s >= max_wait")
        quotes = self.market.cheapest(num_evictions, now)
        cost = sum(q.cost_s for q in quotes)
        ask = sum(q.reuse_probability * q.cost_s for q in quotes)
        weight = self.weight(cls)
        if ask <= weight * cost:
            return AdmissionDecision(True)
        if first is None:
            first = self._first[rid] = now
            if len(self._first) > 4096:  # forget requests their callers gave up on
                horizon = now - 2 * self.max_wait
                self._first = {k: t for k, t in self._first.items() if t >= horizon}
        self.deferrals += 1
        left = (first + self.max_wait) - now  # > 0: the deadline, not a difference of waits
        mean_p = ask / cost if cost > 0 else 1.0
        return AdmissionDecision(
            False,
            reason=(f"the {len(quotes)} cheapest blocks it would evict have a cost-weighted "
                    f"reuse probability of {mean_p:.3g}, above the {weight:.3g} a {cls} "
                    f"request is worth; it waits at most {left:.3g} s more"),
            retry_after=min(self.retry_interval, left),
        )

    def on_admitted(self, request: Request, now: float) -> None:
        self._first.pop(request.request_id, None)

    def __repr__(self) -> str:
        return f"MarketAdmission(max_wait={self.max_wait}, market={self.market!r})"


def check_admission(name: Any) -> str:
    """``name`` if it is one of `ADMISSIONS`, else a `ConfigError` naming the valid ones."""
    if name not in ADMISSIONS:
        raise ConfigError(f"unknown admission {name!r}; valid admissions: {', '.join(ADMISSIONS)}")
    return name


def quotes_prices(policy: str) -> bool:
    """Whether the policy registered as ``policy`` is a `Market` (or a subclass), the only
    policies that quote the prices `MarketAdmission` compares (an unknown name is a
    `ConfigError` listing the valid ones)."""
    from kvevict.policies.registry import POLICIES, spec_name

    return issubclass(POLICIES.get(spec_name(policy)), Market)


def admission_for(admission: str, policy: str) -> tuple[str | Market, Admission | None]:
    """What a run of the policy named ``policy`` evicts with and asks before it evicts, under
    the admission named ``admission`` (one of `ADMISSIONS`): ``(policy, admission)``, to pass
    to `kvevict.sim.simulate` as its policy and ``admission=``.

    - ``"always"``: ``(policy, None)``: the name, built by the run as usual, and the manager's
      default `kvevict.admission.AlwaysAdmit`.
    - ``"market"``, for a policy that `quotes_prices`: a fresh instance, built by name as the
      run would build it (so it evicts exactly as it does without admission control), and a
      `MarketAdmission` with its defaults quoting that same instance's prices.
    - ``"market"``, for any other policy: ``(policy, None)``. It quotes no prices, so nothing
      can be compared with what a request is worth: it admits always, and the caller says so
      (`kvevict.study.run_cell` records the admission each cell ran with).
    """
    check_admission(admission)
    if admission == "always" or not quotes_prices(policy):
        return policy, None
    from kvevict.policies.registry import build_policy

    market = build_policy(policy)
    assert isinstance(market, Market)  # quotes_prices: its registered class is a Market
    return market, MarketAdmission(market)
