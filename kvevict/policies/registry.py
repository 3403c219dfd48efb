"""The residency-policy registry, and `build_policy`: the one way to build a policy.

`register_policy`, `available_policies` and `make_policy` are a `kvevict.registry.Registry`
of `Policy` subclasses (re-exported by `kvevict.policies.base` and `kvevict.policies`).

**Offline policies.** A policy class with ``offline = True`` (Belady) needs the future: the
requests the run will see. It provides the classmethod hook
``from_requests(requests, *, block_size, extra_key, time)`` that builds it from them, ``time``
being the clock value of each request's ``begin`` (``"index"``, ``"arrival"`` or one value per
request; see `kvevict.policies.belady.request_times`). `build_policy` calls that hook, so the
simulator, the replay and the engine build every policy the same way; reports use
`is_offline` to label the oracle and never choose it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy
from kvevict.registry import Registry
from kvevict.types import Request

__all__ = ["POLICIES", "PolicySpec", "available_policies", "build_policy", "is_offline",
           "make_policy", "online_first", "register_policy"]

#: The registry of residency policies.
POLICIES: Registry[Policy] = Registry("policy", Policy)

#: What `build_policy` accepts: a registered name, a `Policy` instance, or a zero-argument
#: factory returning a fresh one.
PolicySpec = str | Policy | Callable[[], Policy]


def register_policy(name: str) -> Callable[[type], type]:
    """Class decorator: make a policy constructible as ``make_policy(name, **params)``.

    An offline class (``offline = True``) must also have a ``from_requests`` classmethod.
    """
    register = POLICIES.register(name)

    def decorate(cls: type) -> type:
        if getattr(cls, "offline", False) and not callable(getattr(cls, "from_requests", None)):
            raise ConfigError(f"offline policy {cls.__name__} needs a classmethod "
                              "from_requests(requests, *, block_size, extra_key, time)")
        return register(cls)

    return decorate


def available_policies() -> list[str]:
    """Names accepted by `make_policy`, sorted."""
    return POLICIES.names()


def make_policy(name: str | Policy, **params: Any) -> Policy:
    """Build a registered policy by name, e.g. ``make_policy("lfu", half_life=60.0)``.

    A `Policy` instance is returned as is (then ``params`` must be empty). An offline policy
    built here gets no future; `build_policy` gives it one.
    """
    if isinstance(name, Policy):
        if params:
            raise ConfigError("parameters were given together with a policy instance")
        return name
    return POLICIES.make(name, **params)


def is_offline(policy: str | type | Policy) -> bool:
    """Whether ``policy`` (a registered name, a policy class or an instance) is offline, i.e.
    needs the future. A name that is not registered (a report's label) is not."""
    if isinstance(policy, str):
        if policy not in POLICIES:
            return False
        policy = POLICIES.get(policy)
    return bool(getattr(policy, "offline", False))


def online_first(names: Iterable[str]) -> list[str]:
    """``names`` with the offline policies moved last (each group keeps its order)."""
    names = list(names)
    return [n for n in names if not is_offline(n)] + [n for n in names if is_offline(n)]


def build_policy(spec: PolicySpec, params: Mapping[str, Any] | None = None, *,
                 requests: Sequence[Request] | None = None, block_size: int | None = None,
                 time_axis: str | Sequence[float] = "index", extra_key: Any = None) -> Policy:
    """The policy a run uses, from a name (with ``params``), an instance or a factory.

    ``params`` is a mapping, not keywords, because a policy's own parameters may share a name
    with this function's (the market policy takes a ``block_size`` too).

    Args:
        spec: a registered name, a `Policy` instance (returned as is) or a zero-argument
            factory returning a fresh `Policy`.
        params: parameters of a policy given by name. An offline policy given parameters
            is built from them as any other (its future among them), not from ``requests``.
        requests: the requests the run will begin, in that order. An offline policy given
            by name alone is built from them (its ``from_requests`` hook).
        block_size: tokens per block, to hash token-mode requests for an offline policy.
        time_axis: the clock value at which each of ``requests`` begins: ``"index"``,
            ``"arrival"`` (made strictly increasing) or one value per request.
        extra_key: the manager's ``extra_key``, for token-mode requests.

    Raises:
        ConfigError: an unknown name or parameter, parameters with an instance or factory,
            or an offline policy by name alone without ``requests``.
    """
    params = dict(params or {})
    if not isinstance(spec, str):
        if params:
            raise ConfigError(f"parameters ({', '.join(params)}) were given together with a "
                              "policy instance or factory; policy parameters need a policy "
                              "given by name")
        if isinstance(spec, Policy):
            return spec
        if not callable(spec):
            raise ConfigError(f"policy must be a registered name, a Policy or a factory, got "
                              f"{type(spec).__name__}")
        built = spec()
        if not isinstance(built, Policy):
            raise ConfigError(f"a policy factory returned {type(built).__name__}, not a Policy")
        return built
    cls = POLICIES.get(spec)
    if not is_offline(cls):
        return POLICIES.make(spec, **params)
    if params:
        try:
            return POLICIES.make(spec, **params)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (policy {spec!r} is offline: given by name alone, it is "
                              "built from the run's requests)") from None
    if requests is None:
        raise ConfigError(
            f"policy {spec!r} is offline: it needs the future; pass requests= (the requests "
            f"the run will begin, in order) or its own parameters "
            f"({', '.join(POLICIES.parameters(spec)) or 'none'})")
    return cls.from_requests(requests, block_size=block_size,  # type: ignore[attr-defined]
                             extra_key=extra_key, time=time_axis)
