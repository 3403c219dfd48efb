"""Value types shared by every layer: requests, retention hints, block records and clocks."""

from __future__ import annotations

import math
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
        arrival = self.arrival
        if isinstance(arrival, bool) or not isinstance(arrival, (int, float, np.integer,
                                                                 np.floating)) or not (
                0.0 <= arrival < math.inf):
            raise ConfigError(
                f"request {self.request_id!r}: arrival must be a finite clock time >= 0 "
                f"(seconds), got {arrival!r}"
            )
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
    """The metadata record of one cached block, as policies see it.

    The manager owns these records and keeps them current; every other layer, policies
    included, only reads them (a policy keeps its own state in its own index, never in a
    record). ``depth`` is the block's index in its sequence (block ``d`` holds tokens
    ``[d * block_size, (d + 1) * block_size)``).

    Attributes (all read-only outside the manager):
        block_id: physical block id in the pool.
        block_hash: chained content hash (the tree key).
        parent_hash: the parent block's hash (`ROOT_HASH` for depth 0).
        parent: the parent block's record, None at depth 0.
        depth: block index in its sequence (0 = first).
        tokens: token ids of the block (None for a request given as block hashes).
        nbytes: KV bytes this block occupies.
        tier: memory tier holding the block.
        workload_class: workload class of the request that created the block.
        session: session that created the block.
        created: clock time the block was cached.
        last_access: clock time of the last hit or release.
        last_access_tick: the manager's event counter at the last hit or release; a strict
            total order of accesses.
        hit_count: prefix-cache hits on this block (decode appends are not hits).
        last_hit_session: session of the most recent hit, or None if never hit.
        last_sharer: the session that used the block last (it created or hit it), and
        last_shared: when; `sharers` lists every remembered one.
        num_sharers: distinct sessions that used the block (at most MAX_SHARERS are
            remembered).
        ref_count: running sequences using it.
        num_children: resident cached children; 0 means the block is a leaf.
        retention: retention hint of the request that last used it, if any.
        created_by: ``"prefill"`` or ``"decode"``: how the block's tokens were produced.
        kind: ``"prompt"``, ``"context"`` or ``"output"`` (see `Request.block_kinds`).
    """

    # hot fields first, so that the few the manager reads and writes per block (eviction,
    # hit, release) share one or two cache lines of the record (a memory-bound hot path)
    __slots__ = (
        "ref_count",
        "num_children",
        "block_id",
        "block_hash",
        "parent_hash",
        "parent",
        "depth",
        "tier",
        "last_access_tick",
        "last_access",
        "workload_class",
        "last_sharer",
        "last_shared",
        "num_sharers",
        "_sharers",
        "hit_count",
        "last_hit_session",
        "__weakref__",
        "nbytes",
        "created",
        "created_by",
        "kind",
        "retention",
        "session",
        "tokens",
    )

    def __init__(self, block_id: int, block_hash: Any, parent_hash: Any, depth: int,
                 tokens: np.ndarray | None, nbytes: int, workload_class: str, session: Any,
                 now: float, tick: int, retention: RetentionHint | None,
                 created_by: str = "prefill", kind: str = "prompt",
                 parent: BlockInfo | None = None) -> None:
        self.block_id = block_id
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.parent = parent
        self.depth = depth
        self.tokens = tokens
        self.nbytes = nbytes
        self.tier = "device"
        self.workload_class = workload_class
        self.session = session
        self.created = now
        self.last_access = now
        self.last_access_tick = tick
        self.hit_count = 0
        # The sessions that used the block, in order of last use, are ``_sharers`` (the
        # earlier ones, None until a second session uses the block) followed by
        # ``last_sharer`` (the most recent, last used at ``last_shared``): a hit by the same
        # session as the last one is then a single store. ``_sharers`` holds up to
        # SHARERS_SLACK sessions before it is cut back to the MAX_SHARERS most recent; only the
        # most recent MAX_SHARERS show.
        self.last_sharer = session
        self.last_shared = now
        self._sharers: dict[Any, float] | None = None
        self.num_sharers = 1  # kept with _sharers: policies read it on every hit and release
        self.ref_count = 0
        self.retention = retention
        self.num_children = 0
        self.created_by = created_by
        self.last_hit_session = None
        self.kind = kind

    def note_sharer(self, session: Any, now: float) -> None:
        """Record that ``session`` used the block at ``now``."""
        if self.last_sharer != session:
            earlier = self._sharers
            if earlier is None:
                self._sharers = {self.last_sharer: self.last_shared}
                self.num_sharers = 2
            else:  # ``session`` becomes the most recent: one more sharer unless it was one
                if earlier.pop(session, None) is None and self.num_sharers < MAX_SHARERS:
                    self.num_sharers += 1
                earlier[self.last_sharer] = self.last_shared
                if len(earlier) >= SHARERS_SLACK:  # keep the most recent only, amortized O(1)
                    self._sharers = dict(list(earlier.items())[-MAX_SHARERS:])
            self.last_sharer = session
        self.last_shared = now

    @property
    def sharers(self) -> dict[Any, float]:
        """Distinct sessions that used the block -> last use time (a copy, oldest first; the
        MAX_SHARERS most recent)."""
        earlier = self._sharers
        if earlier is None:
            return {self.last_sharer: self.last_shared}
        items = list(earlier.items())[1 - MAX_SHARERS:]  # with the latest: MAX_SHARERS
        items.append((self.last_sharer, self.last_shared))
        return dict(items)

    @property
    def num_remembered_sharers(self) -> int:
        """Sessions the record holds right now (bounded by SHARERS_SLACK: memory)."""
        earlier = self._sharers
        return 1 if earlier is None else len(earlier) + 1

    def __repr__(self) -> str:
        return (
            f"BlockInfo(id={self.block_id}, depth={self.depth}, "
            f"class={self.workload_class!r}, session={self.session!r}, ref={self.ref_count}, "
            f"hits={self.hit_count}, last_access={self.last_access})"
        )


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
