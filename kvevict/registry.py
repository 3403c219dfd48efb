"""One generic name registry, used for residency policies and for token policies.

A `Registry` maps lower-case names to classes derived from one base class. It registers them
(a class decorator that also sets the class's ``name``), lists them, looks them up and builds
them from keyword parameters, with errors that name what was wrong and what is accepted::

    unknown policy 'x'; valid names: lfu, lru, ...
    policy 'lfu' has no parameter(s) halflife; it accepts: half_life

The residency registry is `kvevict.policies.registry` (``register_policy`` and friends); the
token-policy one is in `kvevict.tokens` (``register_token_policy`` and friends). This module
knows neither kind.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from kvevict.errors import ConfigError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of the subclasses of ``base`` that can be built by name.

    Args:
        kind: what the entries are called in messages, e.g. ``"policy"`` or
            ``"token policy"``.
        base: the class every registered class derives from.
    """

    def __init__(self, kind: str, base: type[T]) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register the class under ``name`` and set its ``name``.

        Registering the same class twice is fine; another class under a taken name is not.
        """
        if not isinstance(name, str) or not name or name != name.strip().lower():
            raise ConfigError(f"{self.kind} names are non-empty lower-case strings, got "
                              f"{name!r}")

        def decorate(cls: type) -> type:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise ConfigError(f"{cls!r} is not a {self.base.__name__} subclass")
            taken = self._classes.get(name)
            if taken is not None and taken is not cls:
                raise ConfigError(f"a {self.kind} named {name!r} is already registered "
                                  f"({taken.__name__})")
            self._classes[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return decorate

    def unregister(self, name: str) -> None:
        """Forget ``name`` (for tests that register a class of their own)."""
        self.get(name)
        del self._classes[name]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._classes

    def get(self, name: Any) -> type[T]:
        """The class registered as ``name``; `ConfigError` listing the valid names if none."""
        if not isinstance(name, str) or name not in self._classes:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid names: "
                              f"{', '.join(self.names())}")
        return self._classes[name]

    def parameters(self, name: str) -> list[str]:
        """The keyword parameters the class registered as ``name`` takes, in order."""
        return [p.name for p in inspect.signature(self.get(name)).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]

    def check_parameters(self, name: str, params: Mapping[str, Any]) -> None:
        """`ConfigError` when ``params`` holds a name the class does not take (a class with
        ``**kwargs`` takes any)."""
        sig = inspect.signature(self.get(name))
        if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
            return
        accepted = self.parameters(name)
        unknown = [k for k in params if k not in accepted]
        if unknown:
            raise ConfigError(f"{self.kind} {name!r} has no parameter(s) {', '.join(unknown)}; "
                              f"it accepts: {', '.join(accepted) or 'no parameters'}")

    def make(self, name: str, *args: Any, **params: Any) -> T:
        """Build the class registered as ``name`` from ``args`` and ``params`` (checked)."""
        self.check_parameters(name, params)
        return self.get(name)(*args, **params)
