"""The residency-policy registry, and `build_policy`: the one way to build a policy.

`register_policy`, `available_policies` and `make_policy` are a `kvevict.registry.Registry`
of `Policy` subclasses (re-exported by `kvevict.policies.base` and `kvevict.policies`).

**Offline policies.** A policy class with ``offline = True`` (Belady) needs the future: the
requests the run will see. It provides the classmethod hook
``from_requests(requests, *, block_size, extra_key, time)`` that builds it from them, ``time``
being the clock value of each request's ``begin`` (``"index"``, ``"arrival"`` or one value per
request; see `kvevict.policies.belady.request_times`), and any parameter of the policy's
own as a further keyword (``horizon`` for the horizon oracle). `build_policy` calls that hook,
so the simulator, the replay and the engine build every policy the same way; reports use
`is_offline` to label the oracle and never choose it.

**Parameters in a name.** Wherever a policy is named by text (``kvevict replay --policies``,
``kvevict simulate --policies``, ``KVEVICT_VLLM_POLICY``, `build_policy`, `make_policy`), the
text may carry parameters: ``learned(gaps=empirical, ghost=true)`` is ``learned`` built with
``gaps="empirical"`` and ``ghost=True`` (`parse_spec`). Each value is read as JSON when it is
JSON (numbers, ``true``/``false``/``null``, quoted strings), else as the bare string; the
whole text is the row's label in a report. So a variant is compared with one command, and
without a module that registers it.

**Policies from elsewhere.** `load_policy_modules` imports modules that register policies
(the commands' ``--policy-module``), and `load_entry_point_policies` loads, once, the entry
points of the group ``kvevict.policies`` that installed packages declare: each names a
module (importing it registers its policies) or a `Policy` class (registered under the entry
point's name unless it is registered already)::

    [project.entry-points."kvevict.policies"]
    s3fifo = "mypkg.policies:S3FIFO"        # a Policy class, registered as "s3fifo"
    mypkg = "mypkg.policies"                # a module that calls register_policy itself
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from kvevict.errors import ConfigError
from kvevict.policies.base import Policy
from kvevict.registry import Registry
from kvevict.types import Request

__all__ = ["ENTRY_POINT_GROUP", "POLICIES", "PolicySpec", "available_policies", "build_policy",
           "check_distinct", "check_spec", "hook_parameters", "is_offline",
           "load_entry_point_policies", "load_policy_modules", "make_policy", "online_first",
           "parse_spec", "register_policy", "spec_name", "split_specs", "with_spec_params"]

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


#: The entry-point group through which installed packages register policies.
ENTRY_POINT_GROUP = "kvevict.policies"

_entry_points_loaded = False


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def check_distinct(names: Sequence[Any], what: str = "--policies", noun: str = "policy"
                   ) -> None:
    """`ConfigError` naming each name ``names`` lists more than once (``what`` names the
    list, e.g. the ``--policies`` flag; ``noun`` what it lists)."""
    names = list(names)
    repeated = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if repeated:
        times = {2: "twice"}
        counts = ", ".join(f"{n!s} {times.get(names.count(n), f'{names.count(n)} times')}"
                           for n in repeated)
        raise ConfigError(f"{what} lists {counts} ({','.join(map(str, names))}); give each "
                          f"{noun} once")


def load_policy_modules(modules: Iterable[str], *, flag: str = "--policy-module",
                        cwd: bool = False) -> list[ModuleType]:
    """Import each of ``modules`` (dotted names) so that the policies they register with
    `register_policy` can be named; return the modules. With ``cwd=True`` the current
    directory is searched too (after ``sys.path``), as ``python -m`` does.

    Raises:
        ConfigError: a module that cannot be imported (or fails while importing), naming
            ``flag`` (the option that gave it) and the module, in one line.
    """
    if isinstance(modules, str):
        modules = [modules]
    here = os.getcwd()
    added = cwd and here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)
    try:
        return _import_all(modules, flag)
    finally:
        if added:
            sys.path.remove(here)


def _import_all(modules: Iterable[str], flag: str) -> list[ModuleType]:
    loaded = []
    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{flag} needs a module name (dotted, e.g. mypkg.mypolicies), "
                              f"got {name!r}")
        try:
            loaded.append(importlib.import_module(name.strip()))
        except Exception as exc:  # the module's own errors too: report them as one line
            raise ConfigError(f"{flag} {name}: cannot import module {name!r} "
                              f"({_one_line(exc)})") from None
    return loaded


def load_entry_point_policies(*, reload: bool = False) -> list[str]:
    """Load the entry points of the group ``kvevict.policies`` (`ENTRY_POINT_GROUP`), once
    per process (again with ``reload=True``); return their names.

    An entry point that loads to a module has registered its policies by being imported; one
    that loads to a `Policy` subclass is registered under the entry point's name, unless that
    class is registered already.

    Raises:
        ConfigError: an entry point that fails to load or is neither a module nor a
            `Policy` subclass, naming it.
    """
    global _entry_points_loaded
    if _entry_points_loaded and not reload:
        return []
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name} = {ep.value} (group {ENTRY_POINT_GROUP})"
        try:
            obj = ep.load()
        except Exception as exc:
            raise ConfigError(f"{where} cannot be loaded ({_one_line(exc)})") from None
        if isinstance(obj, type) and issubclass(obj, Policy):
            known = obj.name in POLICIES and POLICIES.get(obj.name) is obj
            if not known:
                try:
                    register_policy(ep.name)(obj)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
        elif not isinstance(obj, ModuleType):
            raise ConfigError(f"{where} is {obj!r}, neither a module nor a Policy subclass")
        names.append(ep.name)
    _entry_points_loaded = True
    return names


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
    if isinstance(name, str) and "(" in name:
        name, params = with_spec_params(name, params)
    return POLICIES.make(name, **params)


_LITERALS = {"True": True, "False": False, "None": None}


def parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of a policy named by text: ``"lru"`` is ``("lru", {})``, and
    ``"learned(gaps=empirical, ghost=true)"`` is ``("learned", {"gaps": "empirical",
    "ghost": True})``. A value is JSON where it parses as JSON (``60``, ``0.5``, ``true``,
    ``null``, ``"a b"``; Python's ``True``, ``False`` and ``None`` too), else the bare
    string. Only the syntax is checked here: the name and the parameters are checked by
    `check_spec`, and when the policy is built.

    Raises:
        ConfigError: text that is not ``NAME`` or ``NAME(KEY=VALUE, ...)``, naming it.
    """
    if not isinstance(text, str):
        raise ConfigError(f"a policy name must be a string, got {type(text).__name__}")
    text = text.strip()
    if "(" not in text and ")" not in text:
        return text, {}
    form = "NAME(KEY=VALUE, ...), e.g. learned(gaps=empirical, ghost=true)"
    name, _, rest = text.partition("(")
    name = name.strip()
    if not name or not rest.endswith(")") or "(" in rest or ")" in rest[:-1]:
        raise ConfigError(f"policy {text!r} is not a name with parameters: expected {form}")
    params: dict[str, Any] = {}
    body = rest[:-1].strip()
    for item in body.split(",") if body else []:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key.isidentifier() or not value:
            raise ConfigError(f"policy {text!r}: {item.strip()!r} is not KEY=VALUE; "
                              f"expected {form}")
        if key in params:
            raise ConfigError(f"policy {text!r} gives {key} twice")
        if value in _LITERALS:
            params[key] = _LITERALS[value]
            continue
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return name, params


def with_spec_params(spec: str, params: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of ``spec`` (`parse_spec`) with ``params`` added.

    Raises:
        ConfigError: bad syntax, or a parameter given both in ``spec`` and in ``params``.
    """
    name, given = parse_spec(spec)
    if params:
        both = [k for k in params if k in given]
        if both:
            raise ConfigError(f"policy {spec!r}: {', '.join(both)} given both in the name and "
                              "as a parameter; give each once")
        given.update(params)
    return name, given


def check_spec(spec: str, params: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """``(name, params)`` of a policy named by text (`with_spec_params`), once the name is
    known to be registered and the parameters to be its own: what a command checks before
    it reads a trace.

    Raises:
        ConfigError: bad syntax, an unknown name (listing the valid ones), or a parameter
            the policy does not take (listing the ones it takes).
    """
    name, given = with_spec_params(spec, params)
    POLICIES.check_parameters(name, given)
    return name, given


def spec_name(policy: Any) -> Any:
    """The registered name of a policy named with parameters (``"lfu"`` for
    ``"lfu(half_life=7)"``), for a lookup by name (what the policy takes, whether it is
    offline); anything else, malformed text included, as it is (building it reports the
    error)."""
    if isinstance(policy, str) and "(" in policy:
        try:
            return parse_spec(policy)[0]
        except ConfigError:
            return policy
    return policy


def split_specs(text: str) -> list[str]:
    """A comma-separated list of policies (``--policies``) split at the commas outside
    parentheses, so ``"lru,learned(gaps=empirical, ghost=true)"`` is two; blanks dropped.

    Raises:
        ConfigError: unbalanced parentheses, naming the list.
    """
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"unbalanced parentheses in the policy list {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def is_offline(policy: str | type | Policy) -> bool:
    """Whether ``policy`` (a registered name, with parameters or not, a policy class or an
    instance) is offline, i.e. needs the future. A name that is not registered (a report's
    label) is not."""
    if isinstance(policy, str):
        policy = spec_name(policy)
        if policy not in POLICIES:
            return False
        policy = POLICIES.get(policy)
    return bool(getattr(policy, "offline", False))


def online_first(names: Iterable[str]) -> list[str]:
    """``names`` with the offline policies moved last (each group keeps its order)."""
    names = list(names)
    return [n for n in names if not is_offline(n)] + [n for n in names if is_offline(n)]


def hook_parameters(hook: Callable[..., Any]) -> set[str]:
    """The keyword-only parameters of an offline class's hook (``from_requests``, or the
    replay's ``from_next_uses``) that are the policy's own: all but ``block_size``,
    ``extra_key`` and ``time``, which every such hook takes."""
    import inspect

    sig = inspect.signature(hook).parameters
    return {n for n, p in sig.items() if p.kind is p.KEYWORD_ONLY} - {"block_size",
                                                                     "extra_key", "time"}


def build_policy(spec: PolicySpec, params: Mapping[str, Any] | None = None, *,
                 requests: Sequence[Request] | None = None, block_size: int | None = None,
                 time_axis: str | Sequence[float] = "index", extra_key: Any = None) -> Policy:
    """The policy a run uses, from a name (with ``params``), an instance or a factory.

    ``params`` is a mapping, not keywords, because a policy's own parameters may share a name
    with this function's (the market policy takes a ``block_size`` too).

    Args:
        spec: a registered name (parameters may be in it: `parse_spec`; not also in
            ``params``), a `Policy` instance (returned as is) or a zero-argument
            factory returning a fresh `Policy`.
        params: parameters of a policy given by name. An offline policy given parameters
            that its ``from_requests`` takes as keywords of its own (the horizon oracle's
            ``horizon``) is built from ``requests`` with them; given others (its future
            among them) it is built from them as any other, not from ``requests``.
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
    if "(" in spec:
        spec, params = with_spec_params(spec, params)
    cls = POLICIES.get(spec)
    if not is_offline(cls):
        return POLICIES.make(spec, **params)
    if params and requests is not None \
            and set(params) <= hook_parameters(cls.from_requests):  # type: ignore
        return cls.from_requests(requests, block_size=block_size,  # type: ignore[attr-defined]
                                 extra_key=extra_key, time=time_axis, **params)
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
