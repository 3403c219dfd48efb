"""Value types shared by every layer: requests, retention hints, block records and clocks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvevict.errors import ConfigError

__all__ = [
    "BLOCK_KINDS",
    "MAX_SHARERS",
    "WORKLOAD_CLASSES",
    "BlockInfo",
    "ManualClock",
    "MonotonicClock",
    "Request",
    "RetentionHint",
    "as_token_array",
    "note_sharer",
]

#: The built-in workload classes. Any other non-empty string is accepted too (extensible).
WORKLOAD_CLASSES = ("chat", "agent", "rag", "single_shot", "batch")

#: Sessions a block remembers as sharers (the most recent ones): bounds a popular system
#: prompt's record, which thousands of sessions may hit.
MAX_SHARERS = 64

#: A block's sharer record may hold up to this many sessions before it is cut back to the
#: MAX_SHARERS most recent (amortized O(1) per use; only the most recent MAX_SHARERS show).
SHARERS_SLACK = 2 * MAX_SHARERS

#: What a block's tokens are: see `Request.block_kinds`.
BLOCK_KINDS = ("prompt", "context", "output")


def as_token_array(tokens: Any, *, what: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a 1-D ``int64`` array, or raise `ConfigError` saying what was wrong.

    Accepts a list/tuple of ints, a 1-D integer numpy array or a 1-D integer torch tensor.
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a 1-D sequence of integer token ids; {exc}") from None
    if arr.ndim != 1:
        raise ConfigError(
            f"{what} must be a 1-D sequence of integer token ids, got an array of shape "
            f"{arr.shape}"
        )
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise ConfigError(f"{what} must be non-negative token ids, got {int(arr.min())}")
    return arr.astype(np.int64, copy=False)


def _check_finite_number(name: str):
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"{name} must be a number, got {value!r}")

    return check


@attrs.frozen
class RetentionHint:
    """A caller's hint that a request's blocks are worth keeping.

    ``priority`` is a free-form weight (higher means keep longer; policies decide how to use
    it); ``until`` is an absolute clock time before which the caller expects reuse (``None``:
    no deadline). `RefcountPinned` protects blocks whose hint's ``until`` lies in the future.
    """

    priority: float = attrs.field(default=0.0, validator=_check_finite_number("priority"))
    until: float | None = attrs.field(default=None)

    @until.validator
    def _check_until(self, attribute: Any, value: Any) -> None:
        if value is not None:
            _check_finite_number("until")(self, attribute, value)


def _tokens_converter(value: Any) -> np.ndarray | None:
    return None if value is None else as_token_array(value)


@attrs.frozen(eq=False)
class Request:
    """One unit of work: a chat turn, an agent step, a RAG query.

    Give the prompt either as ``tokens`` (token ids, hashed into blocks by the manager) or as
    ``block_hashes`` (already chained block ids, as in the Mooncake and Alibaba traces, where
    each listed id is one cacheable block) together with ``num_tokens``.

    ``block_kinds`` optionally tags prompt block ``d`` with what it holds: ``"prompt"`` (user
    or system text), ``"context"`` (a tool result or retrieved document) or ``"output"`` (a
    previous model answer fed back). Untagged prompt blocks are ``"prompt"``; blocks filled by
    decoding are ``"output"``.

    ``output_tokens`` optionally fixes the ids a simulated decode produces (``output_len`` of
    them), so that the next turn of a conversation, whose prompt repeats this answer, hits
    the blocks its decode cached.
    """

    request_id: Any
    tokens: np.ndarray | None = attrs.field(default=None, converter=_tokens_converter)
    session_id: Any = None
    workload_class: str = "chat"
    arrival: float = 0.0
    output_len: int = 0
    turn: int = 0
    retention: RetentionHint | None = None
    block_hashes: tuple | None = attrs.field(default=None)
    num_tokens: int | None = attrs.field(default=None)
    block_kinds: tuple | None = attrs.field(default=None)
    output_tokens: np.ndarray | None = attrs.field(default=None, converter=_tokens_converter)
    extra: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.tokens is None and self.block_hashes is None:
            raise ConfigError(
                f"request {self.request_id!r}: give the prompt as tokens= or block_hashes="
            )
        if self.tokens is not None and self.block_hashes is not None:
            raise ConfigError(
                f"request {self.request_id!r}: give tokens= or block_hashes=, not both"
            )
        if self.block_hashes is not None:
            hashes = self.block_hashes
            if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Sequence):
                raise ConfigError(
                    f"request {self.request_id!r}: block_hashes must be a sequence of "
                    f"hashable block ids, got {type(hashes).__name__}"
                )
            hashes = tuple(hashes)
            if len(set(hashes)) != len(hashes):
                raise ConfigError(f"request {self.request_id!r}: block_hashes repeat an id; "
                                  "expected a prefix-chained list of distinct block ids")
            object.__setattr__(self, "block_hashes", hashes)
            if self.num_tokens is None:
                raise ConfigError(
                    f"request {self.request_id!r}: block_hashes= needs num_tokens= "
                    "(the prompt length in tokens)"
                )
        if self.num_tokens is not None:
            if isinstance(self.num_tokens, bool) or not isinstance(
                self.num_tokens, (int, np.integer)
            ) or self.num_tokens < 0:
                raise ConfigError(
                    f"request {self.request_id!r}: num_tokens must be a non-negative int, "
                    f"got {self.num_tokens!r}"
                )
            if self.tokens is not None and int(self.num_tokens) != len(self.tokens):
                raise ConfigError(
                    f"request {self.request_id!r}: num_tokens={self.num_tokens} but "
                    f"{len(self.tokens)} tokens given"
                )
        if self.block_kinds is not None:
            kinds = tuple(self.block_kinds)
            bad = [k for k in kinds if k not in BLOCK_KINDS]
            if bad:
                raise ConfigError(
                    f"request {self.request_id!r}: block_kinds must be drawn from "
                    f"{', '.join(BLOCK_KINDS)}; got {bad[0]!r}"
                )
            object.__setattr__(self, "block_kinds", kinds)
        if not isinstance(self.workload_class, str) or not self.workload_class:
            raise ConfigError(
                f"request {self.request_id!r}: workload_class must be a non-empty string "
                f"such as {', '.join(WORKLOAD_CLASSES)}; got {self.workload_class!r}"
            )
        if isinstance(self.output_len, bool) or not isinstance(
            self.output_len, (int, np.integer)
        ) or self.output_len < 0:
            raise ConfigError(
                f"request {self.request_id!r}: output_len must be a non-negative int, "
                f"got {self.output_len!r}"
            )
        if self.output_tokens is not None and len(self.output_tokens) != self.output_len:
            raise ConfigError(
                f"request {self.request_id!r}: {len(self.output_tokens)} output_tokens but "
                f"output_len={self.output_len}"
            )
        if self.retention is not None and not isinstance(self.retention, RetentionHint):
            raise ConfigError(
                f"request {self.request_id!r}: retention must be a RetentionHint, "
                f"got {type(self.retention).__name__}"
            )

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        if self.tokens is not None:
            return len(self.tokens)
        return int(self.num_tokens)  # type: ignore[arg-type]


class BlockInfo:
    """The metadata record of one cached block, as policies see it. Read-only to policies.

    The manager owns these records and updates them; a policy reads the properties below and
    must not keep state in them. ``depth`` is the block's index in its sequence (block ``d``
    holds tokens ``[d * block_size, (d + 1) * block_size)``).
    """

    # hot fields first, so that the few the manager reads and writes per block (eviction,
    # hit, release) share one or two cache lines of the record (a memory-bound hot path)
    __slots__ = (
        "_ref_count",
        "_num_children",
        "_id",
        "_hash",
        "_parent",
        "_depth",
        "_last_access_tick",
        "_last_access",
        "_workload_class",
        "_sharer",
        "_shared",
        "_sharers",
        "_hit_count",
        "_last_hit_session",
        "__weakref__",
        "_bytes",
        "_created",
        "_created_by",
        "_kind",
        "_retention",
        "_session",
        "_tier",
        "_tokens",
    )

    def __init__(self, block_id: int, block_hash: Any, parent: Any, depth: int,
                 tokens: np.ndarray | None, nbytes: int, workload_class: str, session: Any,
                 now: float, tick: int, retention: RetentionHint | None,
                 created_by: str = "prefill", kind: str = "prompt") -> None:
        self._id = block_id
        self._hash = block_hash
        self._parent = parent
        self._depth = depth
        self._tokens = tokens
        self._bytes = nbytes
        self._tier = "device"
        self._workload_class = workload_class
        self._session = session
        self._created = now
        self._last_access = now
        self._last_access_tick = tick
        self._hit_count = 0
        self._sharer = session  # the most recent sharer and its last use...
        self._shared = now
        self._sharers: dict[Any, float] | None = None  # ...and the earlier ones (or None)
        self._ref_count = 0
        self._retention = retention
        self._num_children = 0
        self._created_by = created_by
        self._last_hit_session = None
        self._kind = kind

    block_id = property(lambda self: self._id, doc="Physical block id in the pool.")
    block_hash = property(lambda self: self._hash, doc="Chained content hash (the tree key).")
    parent_hash = property(lambda self: self._parent, doc="Parent block's hash, None at root.")
    depth = property(lambda self: self._depth, doc="Block index in its sequence (0 = first).")
    tokens = property(lambda self: self._tokens, doc="Token ids of the block (None if hashed).")
    nbytes = property(lambda self: self._bytes, doc="KV bytes this block occupies.")
    tier = property(lambda self: self._tier, doc="Memory tier holding the block.")
    workload_class = property(lambda self: self._workload_class,
                              doc="Workload class of the request that created the block.")
    session = property(lambda self: self._session, doc="Session that created the block.")
    created = property(lambda self: self._created, doc="Clock time the block was cached.")
    last_access = property(lambda self: self._last_access,
                           doc="Clock time of the last hit or release.")
    last_access_tick = property(lambda self: self._last_access_tick,
                                doc="Manager event counter at the last hit or release; "
                                    "a strict total order of accesses.")
    hit_count = property(lambda self: self._hit_count,
                         doc="Prefix-cache hits on this block (decode appends are not hits).")
    # The sessions that used the block, in order of last use, are ``_sharers`` (the earlier
    # ones, None until a second session uses the block) followed by ``_sharer`` (the most recent,
    # last used at ``_shared``): a hit by the same session as the last one is then a single
    # store (`note_sharer`). ``_sharers`` holds up to SHARERS_SLACK sessions before it is cut
    # back to the MAX_SHARERS most recent; only the most recent MAX_SHARERS show.

    @property
    def sharers(self) -> dict[Any, float]:
        """Distinct sessions that used the block -> last use time (a copy, oldest first; the
        MAX_SHARERS most recent)."""
        earlier = self._sharers
        if earlier is None:
            return {self._sharer: self._shared}
        items = list(earlier.items())[1 - MAX_SHARERS:]  # with the latest: MAX_SHARERS
        items.append((self._sharer, self._shared))
        return dict(items)

    @property
    def num_sharers(self) -> int:
        """Number of distinct sessions that used the block (at most MAX_SHARERS are
        remembered)."""
        earlier = self._sharers
        return 1 if earlier is None else min(len(earlier) + 1, MAX_SHARERS)

    ref_count = property(lambda self: self._ref_count, doc="Running sequences using it.")
    retention = property(lambda self: self._retention,
                         doc="Retention hint of the request that last used it, if any.")
    num_children = property(lambda self: self._num_children,
                            doc="Resident cached children; 0 means the block is a leaf.")
    created_by = property(lambda self: self._created_by,
                          doc="'prefill' or 'decode': how the block's tokens were produced.")
    kind = property(lambda self: self._kind,
                    doc="'prompt', 'context' or 'output' (see Request.block_kinds).")
    last_hit_session = property(lambda self: self._last_hit_session,
                                doc="Session of the most recent hit, or None if never hit.")

    def __repr__(self) -> str:
        return (
            f"BlockInfo(id={self._id}, depth={self._depth}, class={self._workload_class!r}, "
            f"session={self._session!r}, ref={self._ref_count}, hits={self._hit_count}, "
            f"last_access={self._last_access})"
        )


def note_sharer(block: BlockInfo, session: Any, now: float) -> None:
    """Record that ``session`` used ``block`` at ``now`` (the manager's hit path)."""
    if block._sharer != session:
        earlier = block._sharers
        if earlier is None:
            block._sharers = {block._sharer: block._shared}
        else:
            earlier.pop(session, None)  # it becomes the most recent
            earlier[block._sharer] = block._shared
            if len(earlier) >= SHARERS_SLACK:  # keep the most recent only, amortized O(1)
                block._sharers = dict(list(earlier.items())[-MAX_SHARERS:])
        block._sharer = session
    block._shared = now


class ManualClock:
    """A clock that only moves when told to; the default in tests and the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ConfigError(f"a clock cannot go backwards: advance({seconds})")
        self.now += seconds
        return self.now

    def set(self, t: float) -> float:
        """Jump to absolute time ``t`` (>= the current time)."""
        if t < self.now:
            raise ConfigError(f"a clock cannot go backwards: set({t}) with now={self.now}")
        self.now = float(t)
        return self.now


class MonotonicClock:
    """Wall time from `time.monotonic`, in seconds."""

    def __call__(self) -> float:
        return time.monotonic()
