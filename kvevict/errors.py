"""The errors kvevict raises, each naming what was wrong and what was expected.

A failing call leaves the cache consistent: `KVCacheManager.check()` holds after any of these.
"""

from __future__ import annotations

__all__ = [
    "AdmissionDeferred",
    "ConfigError",
    "KVEvictError",
    "OutOfBlocks",
    "PolicyError",
    "TraceFormatError",
]


class KVEvictError(Exception):
    """Base class of every error kvevict raises on purpose."""


class ConfigError(KVEvictError, ValueError):
    """An argument or configuration value is invalid (wrong type, range, shape or name)."""


class OutOfBlocks(KVEvictError):
    """Not enough blocks even after evicting every candidate: back-pressure, not a crash.

    Everything resident is in use by running sequences (ref count > 0). The caller should wait
    for a sequence to finish, preempt one, or shrink the request.
    """

    def __init__(self, message: str, *, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class PolicyError(KVEvictError):
    """A policy broke the contract: `victim()` named a block that is not a candidate, or an
    event raised. ``policy``, ``event`` and ``block_id`` say which (None when unknown); the
    policy's own exception, if any, is the ``__cause__``."""

    def __init__(self, message: str, *, policy: object = None, event: str | None = None,
                 block_id: object = None) -> None:
        super().__init__(message)
        self.policy = policy
        self.event = event
        self.block_id = block_id


class TraceFormatError(KVEvictError, ValueError):
    """A trace file is malformed; the message names the file, the line and the field."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}"
            if line is not None:
                where += f":{line}"
            where += ": "
        if field is not None:
            message = f"field {field!r}: {message}"
        super().__init__(where + message)
        self.path = path
        self.line = line
        self.field = field


class AdmissionDeferred(KVEvictError):
    """Admission control told a request to wait instead of evicting (state unchanged).

    ``retry_after`` is the suggested wait in seconds; ``reason`` says why.
    """

    def __init__(self, message: str, *, request_id: object = None, reason: str = "",
                 retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reason = reason
        self.retry_after = retry_after
