"""Trace readers and writers: kvevict's own JSONL, the Alibaba (Qwen-Bailian) format, ShareGPT.

Every reader raises `TraceFormatError` naming the file, the line and the field for malformed
input. (The Mooncake format lives in `kvevict.workloads.mooncake`.)

**kvevict JSONL** (`write_jsonl` / `read_jsonl`): one request per line, every `Request` field::

    {"request_id": "chat-0-t1", "session_id": "chat-0", "workload_class": "chat",
     "arrival": 12.5, "turn": 1, "output_len": 3, "tokens": [5, 9, 2], "block_hashes": null,
     "num_tokens": null, "output_tokens": [7, 7, 1], "block_kinds": ["prompt"],
     "retention": null, "extra": {}}

(one line in the file). A round trip is exact for requests whose ids are str or int, whose
block hashes are ints or strs, and whose ``extra`` is JSON-native (str keys; lists, not
tuples). Only ``request_id`` and a prompt (``tokens``, or ``block_hashes`` with
``num_tokens``) are required when reading; other fields take the `Request` defaults.

**Alibaba** (`read_alibaba`): the "KVCache Cache in the Wild" traces (ATC'25, Wang et al.;
``alibaba-edu/qwen-bailian-usagetraces-anon``), one JSON object per line::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091]}

**ShareGPT** (`read_sharegpt`): a JSON list of conversations::

    [{"id": "a1", "conversations": [{"from": "human", "value": "Hi"},
                                    {"from": "gpt", "value": "Hello!"}]}]
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from kvevict.errors import ConfigError, TraceFormatError
from kvevict.types import BLOCK_KINDS, Request, RetentionHint
from kvevict.workloads.generators import block_kinds_from_spans
from kvevict.workloads.mooncake import (
    IdTable,
    check_block_size,
    iter_mooncake,
    lengths_and_block_ids,
)

__all__ = [
    "ALIBABA_BLOCK_SIZE",
    "ALIBABA_CLASSES",
    "READERS",
    "TraceFile",
    "iter_alibaba",
    "iter_jsonl",
    "iter_sharegpt",
    "read_alibaba",
    "read_jsonl",
    "read_sharegpt",
    "request_from_dict",
    "request_to_dict",
    "synthetic_token_ids",
    "trace_digest",
    "write_jsonl",
]

#: Tokens per block of the Alibaba traces' ``hash_ids``.
ALIBABA_BLOCK_SIZE = 16

#: Workload class of each Alibaba request ``type``; other types keep the raw string.
ALIBABA_CLASSES = {"text": "chat", "search": "rag", "file": "rag", "image": "single_shot"}

_JSONL_FIELDS = ("request_id", "session_id", "workload_class", "arrival", "turn", "output_len",
                 "tokens", "block_hashes", "num_tokens", "output_tokens", "block_kinds",
                 "retention", "extra")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _plain(value: Any) -> Any:
    """Numpy scalars to Python ones (JSON cannot encode them)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


# -- kvevict JSONL -------------------------------------------------------------------------


def request_to_dict(request: Request) -> dict[str, Any]:
    """The JSON-ready record of a request (the kvevict JSONL line, as a dict).

    Raises `ConfigError` when a field cannot be written as JSON (an id that is neither str
    nor int, a block hash that is neither int nor str, a non-JSON ``extra``).
    """
    return _record(request, lists=True)


def _record(request: Request, lists: bool) -> dict[str, Any]:
    """The record, with token arrays as lists (``lists``) or as their lengths."""
    if not isinstance(request, Request):
        raise ConfigError(f"expected a Request, got {type(request).__name__}")
    rid = _plain(request.request_id)
    if not (isinstance(rid, str) or _is_int(rid)):
        raise ConfigError(f"request {rid!r}: request_id must be a str or int to be written "
                          f"as JSON, got {type(rid).__name__}")
    sid = _plain(request.session_id)
    if not (sid is None or isinstance(sid, str) or _is_int(sid)):
        raise ConfigError(f"request {rid!r}: session_id must be None, a str or an int to be "
                          f"written as JSON, got {type(sid).__name__}")
    hashes = None
    if request.block_hashes is not None:
        hashes = [_plain(h) for h in request.block_hashes]
        for h in hashes:
            if not (isinstance(h, str) or _is_int(h)):
                raise ConfigError(f"request {rid!r}: block hashes must be ints or strs to be "
                                  f"written as JSON, got {h!r}")
    retention = None
    if request.retention is not None:
        retention = {"priority": _plain(request.retention.priority),
                     "until": _plain(request.retention.until)}
    try:
        json.dumps(request.extra)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"request {rid!r}: extra must be JSON-serializable; {exc}") from None
    return {
        "request_id": rid,
        "session_id": sid,
        "workload_class": request.workload_class,
        "arrival": float(request.arrival),
        "turn": int(request.turn),
        "output_len": int(request.output_len),
        "tokens": _array(request.tokens, lists),
        "block_hashes": hashes,
        "num_tokens": None if request.num_tokens is None else int(request.num_tokens),
        "output_tokens": _array(request.output_tokens, lists),
        "block_kinds": None if request.block_kinds is None else list(request.block_kinds),
        "retention": retention,
        "extra": request.extra,
    }


def _array(arr: np.ndarray | None, lists: bool) -> list[int] | int | None:
    if arr is None:
        return None
    return arr.tolist() if lists else len(arr)


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def trace_digest(requests: Iterable[Request]) -> str:
    """SHA-256 of a canonical serialization of ``requests`` (in order): equal traces have
    equal digests, whatever process made them. Used to check that the same seed gives the
    same trace.

    Each request contributes its `request_to_dict` record (sorted keys, compact JSON) with
    the token arrays replaced by their little-endian int64 bytes.
    """
    h = hashlib.sha256()
    for req in requests:
        h.update(_dumps(_record(req, lists=False)).encode("utf-8"))
        for arr in (req.tokens, req.output_tokens):
            if arr is not None:
                h.update(arr.astype("<i8", copy=False).tobytes())
        h.update(b"\n")
    return h.hexdigest()


def write_jsonl(requests: Iterable[Request], path: str | os.PathLike[str]) -> int:
    """Write requests as kvevict JSONL (one per line, every field); return the count."""
    lines = [_dumps(request_to_dict(r)) for r in requests]  # validate before writing
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line + "\n")
    return len(lines)


def _token_list(obj: dict, name: str, path: str, line: int) -> list[int] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list):
        raise TraceFormatError(f"expected a list of non-negative integer token ids, got "
                               f"{type(value).__name__}", path=path, line=line, field=name)
    for v in value:
        if not _is_int(v) or v < 0:
            raise TraceFormatError(f"expected non-negative integer token ids, got {v!r} in "
                                   "the list", path=path, line=line, field=name)
    return value


def request_from_dict(obj: Any, *, path: str | None = None, line: int | None = None) -> Request:
    """Build a `Request` from a kvevict JSONL record; `TraceFormatError` if malformed."""
    if not isinstance(obj, dict):
        raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}",
                               path=path, line=line)
    unknown = sorted(set(obj) - set(_JSONL_FIELDS))
    if unknown:
        raise TraceFormatError(f"unknown field; a line holds {', '.join(_JSONL_FIELDS)}",
                               path=path, line=line, field=unknown[0])
    if "request_id" not in obj:
        raise TraceFormatError("missing; every line needs a request_id", path=path, line=line,
                               field="request_id")

    def bad(field: str, what: str) -> TraceFormatError:
        return TraceFormatError(f"expected {what}, got {obj[field]!r}", path=path, line=line,
                                field=field)

    rid = obj["request_id"]
    if not (isinstance(rid, str) or _is_int(rid)):
        raise bad("request_id", "a string or an integer")
    sid = obj.get("session_id")
    if not (sid is None or isinstance(sid, str) or _is_int(sid)):
        raise bad("session_id", "null, a string or an integer")
    wclass = obj.get("workload_class", "chat")
    if not isinstance(wclass, str) or not wclass:
        raise bad("workload_class", "a non-empty string such as chat, agent, rag")
    arrival = obj.get("arrival", 0.0)
    if not _is_number(arrival) or arrival < 0:
        raise bad("arrival", "a non-negative number of seconds")
    turn = obj.get("turn", 0)
    if not _is_int(turn) or turn < 0:
        raise bad("turn", "a non-negative integer")
    output_len = obj.get("output_len", 0)
    if not _is_int(output_len) or output_len < 0:
        raise bad("output_len", "a non-negative integer (generated tokens)")
    tokens = _token_list(obj, "tokens", path, line)
    output_tokens = _token_list(obj, "output_tokens", path, line)
    if output_tokens is not None and len(output_tokens) != output_len:
        raise TraceFormatError(f"{len(output_tokens)} ids but output_len={output_len}; "
                               "expected one id per generated token", path=path, line=line,
                               field="output_tokens")
    hashes = obj.get("block_hashes")
    if hashes is not None:
        if not isinstance(hashes, list):
            raise bad("block_hashes", "null or a list of integer or string block ids")
        for h in hashes:
            if not (isinstance(h, str) or _is_int(h)):
                raise TraceFormatError(f"expected integer or string block ids, got {h!r} in "
                                       "the list", path=path, line=line, field="block_hashes")
    num_tokens = obj.get("num_tokens")
    if num_tokens is not None and (not _is_int(num_tokens) or num_tokens < 0):
        raise bad("num_tokens", "null or a non-negative integer (prompt tokens)")
    if tokens is None and hashes is None:
        raise TraceFormatError("missing; each line needs tokens, or block_hashes with "
                               "num_tokens", path=path, line=line, field="tokens")
    if tokens is not None and hashes is not None:
        raise TraceFormatError("given together with tokens; give one of them",
                               path=path, line=line, field="block_hashes")
    if hashes is not None and num_tokens is None:
        raise TraceFormatError("missing; block_hashes needs the prompt length",
                               path=path, line=line, field="num_tokens")
    if tokens is not None and num_tokens is not None and num_tokens != len(tokens):
        raise TraceFormatError(f"{num_tokens} but {len(tokens)} tokens are listed",
                               path=path, line=line, field="num_tokens")
    kinds = obj.get("block_kinds")
    if kinds is not None:
        if not isinstance(kinds, list) or any(k not in BLOCK_KINDS for k in kinds):
            raise bad("block_kinds", f"null or a list of {', '.join(BLOCK_KINDS)}")
    retention = obj.get("retention")
    if retention is not None:
        if (not isinstance(retention, dict) or set(retention) - {"priority", "until"}
                or not _is_number(retention.get("priority", 0.0))
                or not (retention.get("until") is None or _is_number(retention["until"]))):
            raise bad("retention", 'null or {"priority": number, "until": number or null}')
        retention = RetentionHint(retention.get("priority", 0.0), retention.get("until"))
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise bad("extra", "a JSON object")
    try:
        return Request(rid, tokens=tokens, session_id=sid, workload_class=wclass,
                       arrival=arrival, output_len=output_len, turn=turn, retention=retention,
                       block_hashes=hashes, num_tokens=num_tokens, block_kinds=kinds,
                       output_tokens=output_tokens, extra=extra)
    except ConfigError as exc:  # pragma: no cover - every case is checked above
        raise TraceFormatError(str(exc), path=path, line=line) from None


def _json_lines(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                       "expected one JSON object per line",
                                       path=path, line=line_no) from None


def _first_line(path: str, before: int, matches: Callable[[Any], bool]) -> int | None:
    """The first line (below ``before``) whose JSON object ``matches``, read again from the
    file: how the streaming readers name the earlier line of a duplicate without keeping a
    line number per request (an error path only)."""
    for line_no, obj in _json_lines(path):
        if line_no >= before:
            return None
        if isinstance(obj, dict) and matches(obj):
            return line_no
    return None


class _Order:
    """The arrival-order check of a streaming reader: each arrival at least the previous
    one's, else `TraceFormatError` naming the line and ``field``."""

    def __init__(self, path: str, field: str, unit: str) -> None:
        self.path, self.field, self.unit = path, field, unit
        self.last = -math.inf
        self.last_line = 0

    def check(self, value: float, line: int) -> None:
        if value < self.last:
            raise TraceFormatError(
                f"{value:g} {self.unit} is earlier than line {self.last_line}'s {self.last:g} "
                f"{self.unit}; expected requests in arrival order (non-decreasing "
                f"{self.field}), as a replay on the arrival time axis needs",
                path=self.path, line=line, field=self.field)
        self.last, self.last_line = value, line


def iter_jsonl(path: str | os.PathLike[str], *, arrival_order: bool = False
               ) -> Iterator[Request]:
    """Yield the requests of a kvevict JSONL file one at a time, in file order.

    Blank lines are skipped. A repeated ``request_id`` is an error (field ``request_id``).
    With ``arrival_order`` an ``arrival`` smaller than the previous line's is an error too
    (field ``arrival``): the file must list requests in arrival order, as
    `kvevict.workloads.write_jsonl` of a generated workload does.

    It holds one record at a time, plus what the duplicate check remembers: 8 bytes per
    non-negative int id (an `IdTable`), else one Python hash per id in a set (about 70
    bytes); a hash seen twice is confirmed by reading the file again.
    """
    return _iter_jsonl(os.fspath(path), bool(arrival_order))


def _iter_jsonl(name: str, arrival_order: bool) -> Iterator[Request]:
    ints = IdTable()  # non-negative int request id -> 0
    others: set[int] = set()  # hash((type name, id)) of the other ids
    order = _Order(name, "arrival", "s") if arrival_order else None
    for line_no, obj in _json_lines(name):
        req = request_from_dict(obj, path=name, line=line_no)
        rid = req.request_id
        if _is_int(rid) and rid >= 0:
            repeated = rid in ints
            if not repeated:
                ints[rid] = 0
        else:
            key = hash((type(rid).__name__, rid))
            repeated = key in others
            others.add(key)
        if repeated:
            first = _first_line(name, line_no, lambda o, rid=rid: (
                type(o.get("request_id")) is type(rid) and o.get("request_id") == rid))
            if first is not None:  # else two ids shared a hash: not a repeat
                raise TraceFormatError(f"{rid!r} was already used on line {first}; expected "
                                       "unique request ids", path=name, line=line_no,
                                       field="request_id")
        if order is not None:
            order.check(req.arrival, line_no)
        yield req


def read_jsonl(path: str | os.PathLike[str], *, arrival_order: bool = False) -> list[Request]:
    """All requests of a kvevict JSONL file, in file order (see `iter_jsonl`)."""
    return list(iter_jsonl(path, arrival_order=arrival_order))


# -- Alibaba (Qwen-Bailian) ----------------------------------------------------------------

_ALIBABA_FIELDS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length",
                   "type", "turn", "hash_ids")


def _parse_alibaba(obj: Any, path: str, line: int, block_size: int,
                   classes: dict[str, str], roots: IdTable, pending: IdTable) -> Request:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}",
                               path=path, line=line)
    for name in _ALIBABA_FIELDS:
        if name not in obj:
            raise TraceFormatError(f"missing; each line needs {', '.join(_ALIBABA_FIELDS)}",
                                   path=path, line=line, field=name)

    def bad(field: str, what: str) -> TraceFormatError:
        return TraceFormatError(f"expected {what}, got {obj[field]!r}", path=path, line=line,
                                field=field)

    chat_id = obj["chat_id"]
    if not _is_int(chat_id) or chat_id < 0:
        raise bad("chat_id", "a non-negative integer")
    parent = obj["parent_chat_id"]
    if not _is_int(parent) or parent < -1:
        raise bad("parent_chat_id", "an integer chat id, or -1 for the first turn")
    if parent == chat_id:
        raise bad("parent_chat_id", "the id of an earlier request, not the request's own id")
    ts = obj["timestamp"]
    if not _is_number(ts) or ts < 0:
        raise bad("timestamp", "a non-negative number of seconds")
    input_length, output_length, ids = lengths_and_block_ids(obj, bad, path, line)
    rtype = obj["type"]
    if not isinstance(rtype, str) or not rtype:
        raise bad("type", "a non-empty string such as text, search, image, file")
    turn = obj["turn"]
    if not _is_int(turn) or turn < 0:
        raise bad("turn", "a non-negative integer")
    extra: dict[str, Any] = {"type": rtype, "parent_chat_id": parent,
                             "parent": None if parent == -1 else parent}
    num_tokens = input_length
    if ids and num_tokens < block_size * (len(ids) - 1) + 1:
        num_tokens = block_size * (len(ids) - 1) + 1
        extra["input_length"] = input_length
    session = _alibaba_session(chat_id, parent, path, line, roots, pending)
    return Request(chat_id, block_hashes=ids, num_tokens=num_tokens, arrival=float(ts),
                   output_len=output_length, turn=turn, workload_class=classes.get(rtype, rtype),
                   session_id=session, extra=extra)


def _alibaba_session(chat_id: int, parent: int, path: str, line: int, roots: IdTable,
                     pending: IdTable) -> int:
    """The root chat of ``chat_id`` (recorded in ``roots``): itself for a first turn, its
    parent's root for a parent on an earlier line, the parent's id for a parent not seen
    (outside the trace window; ``pending`` keeps the first line that named it, so that the
    parent turning up later is an error naming that line)."""
    if chat_id in roots:
        first = _first_line(path, line, lambda o: o.get("chat_id") == chat_id)
        raise TraceFormatError(f"{chat_id} was already used on line {first}; expected unique "
                               "chat ids", path=path, line=line, field="chat_id")
    named_on = pending.get(chat_id)
    if named_on is not None:
        raise TraceFormatError(
            f"parent_chat_id {chat_id} names chat {chat_id}, which comes later, on line "
            f"{line}; expected each parent on an earlier line than its children (the trace in "
            "time order), or -1, or an id outside the trace", path=path, line=named_on,
            field="parent_chat_id")
    if parent == -1:
        root = chat_id
    else:
        known = roots.get(parent)
        if known is None:  # not (yet) in the file: the conversation began before it
            root = parent
            if parent not in pending:
                pending[parent] = line
        else:
            root = known
    roots[chat_id] = root
    return root


def iter_alibaba(path: str | os.PathLike[str], *, block_size: int = ALIBABA_BLOCK_SIZE,
                 classes: dict[str, str] | None = None, arrival_order: bool = False
                 ) -> Iterator[Request]:
    """Yield the requests of an Alibaba "KVCache in the wild" trace one at a time, in file
    order.

    Each line becomes a hash-mode `Request`: ``request_id`` = ``chat_id``, ``block_hashes`` =
    ``hash_ids`` (``block_size``-token blocks, 16 in the published traces), ``arrival`` =
    ``timestamp`` (seconds), ``output_len`` = ``output_length``, ``turn`` = ``turn`` and
    ``extra`` = ``{"type": ..., "parent_chat_id": ..., "parent": ...}``, ``parent`` being
    the parent chat id or None for a first turn: the link by which a timed run sends a turn
    no earlier than the answer it follows (`kvevict.run.SessionGate`; the trace records no
    think time, so none is assumed).

    **Sessions.** ``session_id`` is the root chat id, found by following ``parent_chat_id``
    links (``-1`` marks a root) to earlier lines. A parent that is not in the file (the
    conversation began before the trace window) anchors the chain: the session is that
    missing parent's id, so its later turns still group together. A parent must come before
    its children (the published traces are in time order): a chat named as a parent on an
    earlier line is an error naming that line, which also rules out cycles.

    **Classes.** ``workload_class`` comes from ``type`` through ``classes`` (default
    `ALIBABA_CLASSES`: ``text`` → ``chat``; ``search`` → ``rag``, search results are
    retrieved context; ``file`` → ``rag``, an uploaded document is long context placed
    before the question; ``image`` → ``single_shot``). Any other type keeps its raw string.

    **Prompt length.** As for Mooncake, every listed id is one cacheable block, so
    ``num_tokens = max(input_length, block_size * (len(hash_ids) - 1) + 1)``; a raised
    length keeps the original in ``extra["input_length"]``.

    **Order.** With ``arrival_order`` a ``timestamp`` smaller than the previous line's is an
    error (field ``timestamp``).

    **Memory.** One record at a time, plus each chat's session in an `IdTable` (8 bytes per
    chat for dense chat ids).

    Malformed input raises `TraceFormatError` naming the file, line and field: invalid
    JSON, a missing field, a wrong type, a negative length or timestamp, ``hash_ids`` that
    are not distinct non-negative ints, a repeated ``chat_id``, or a ``parent_chat_id`` that
    names a later line. Unknown extra fields are ignored.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    mapping = dict(ALIBABA_CLASSES if classes is None else classes)
    for k, v in mapping.items():
        if not isinstance(k, str) or not isinstance(v, str) or not v:
            raise ConfigError(f"classes must map type strings to non-empty class names, got "
                              f"{k!r}: {v!r}")
    return _iter_alibaba(os.fspath(path), block_size, mapping, bool(arrival_order))


def _iter_alibaba(name: str, block_size: int, mapping: dict[str, str],
                  arrival_order: bool) -> Iterator[Request]:
    roots = IdTable()  # chat id -> its session's root chat id
    pending = IdTable()  # parent id not seen yet -> the first line that named it
    order = _Order(name, "timestamp", "s") if arrival_order else None
    for line_no, obj in _json_lines(name):
        req = _parse_alibaba(obj, name, line_no, block_size, mapping, roots, pending)
        if order is not None:
            order.check(req.arrival, line_no)
        yield req


def read_alibaba(path: str | os.PathLike[str], *, block_size: int = ALIBABA_BLOCK_SIZE,
                 classes: dict[str, str] | None = None, arrival_order: bool = False
                 ) -> list[Request]:
    """All requests of an Alibaba "KVCache in the wild" trace, in file order (see
    `iter_alibaba`)."""
    return list(iter_alibaba(path, block_size=block_size, classes=classes,
                             arrival_order=arrival_order))


# -- ShareGPT ------------------------------------------------------------------------------

_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
_SYSTEM_ROLES = frozenset({"system"})

_MASK64 = (1 << 64) - 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def synthetic_token_ids(text: str, chars_per_token: float = 4.0,
                        vocab_size: int = 32000) -> np.ndarray:
    """Deterministic stand-in token ids for ``text`` without a tokenizer.

    The text is cut into runs of ``chars_per_token`` characters from its start (run ``i``
    covers characters ``[floor(i * c), floor((i + 1) * c))``) and each run is hashed into
    ``[0, vocab_size)``: ``ceil(len(text) / c)`` ids. Equal texts get equal ids, and two
    texts sharing a leading run share the ids over it. The same in every process.
    """
    if not text:
        return np.zeros(0, dtype=np.int64)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n = len(codes)
    count = math.ceil(n / chars_per_token)
    starts = np.floor(np.arange(count) * chars_per_token).astype(np.int64)
    starts = np.unique(np.minimum(starts, n - 1))
    owner = np.searchsorted(starts, np.arange(n), side="right") - 1
    offset = (np.arange(n) - starts[owner]).astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = _mix64(codes + (offset + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
        sums = np.add.reduceat(mixed, starts)
        sums = _mix64(sums + (np.diff(np.append(starts, n)).astype(np.uint64)
                              << np.uint64(40)))
    return (sums % np.uint64(vocab_size)).astype(np.int64)


def iter_sharegpt(path: str | os.PathLike[str],
                  tokenizer: Callable[[str], Any] | None = None, chars_per_token: float = 4.0,
                  *, vocab_size: int = 32000, block_size: int = 16,
                  conversation_interval: float = 1.0, turn_interval: float = 60.0,
                  limit: int | None = None) -> Iterator[Request]:
    """Yield the requests of a ShareGPT-shaped conversation file one at a time, in arrival
    order: one per assistant message.

    The file is a JSON list of ``{"id": str, "conversations": [{"from": role, "value":
    str}, ...]}``; roles ``human``/``user``, ``gpt``/``assistant`` (also ``chatgpt``,
    ``bard``, ``bing``, ``model``) and ``system``. For assistant message ``k`` of a
    conversation the prompt is every earlier message, the output its own text
    (``output_tokens``). Each message is tokenized on its own and the pieces concatenated,
    so turn ``k + 1``'s prompt starts with turn ``k``'s prompt and output exactly.

    Token ids come from ``tokenizer`` (a callable ``str -> list[int]``; pass one that adds
    no special tokens, e.g. ``lambda s: tok.encode(s, add_special_tokens=False)``) or,
    without one, from `synthetic_token_ids` (about ``len(text) / chars_per_token`` ids
    hashed from the text into ``[0, vocab_size)``: shared text gives shared ids).

    The format has no times: conversation ``i`` starts at ``i * conversation_interval`` and
    its turns follow ``turn_interval`` seconds apart (a simple deterministic clock; re-time
    the requests for anything else). Requests come sorted by arrival (ties: conversation
    order, then turn). ``session_id`` is the conversation's ``id`` (``conv<index>`` when
    missing; ``<id>#<index>`` when repeated), ``request_id`` is ``<session>/<turn>``,
    ``turn`` counts assistant messages from 1, ``workload_class`` is ``chat`` and
    ``block_kinds`` (for ``block_size``) tag earlier answers ``output`` and the rest
    ``prompt``. An assistant message with nothing before it (a greeting) makes no request,
    but later prompts include it. ``limit`` reads only the first conversations.

    **Memory.** The list is parsed one conversation at a time (`json.JSONDecoder.raw_decode`
    over a buffer of the file). Requests wait in a heap until no later conversation can
    arrive before them: those that arrive after the start of the conversation being read,
    about ``turn_interval / conversation_interval`` conversations' worth. The conversation
    ids seen are kept, to rename repeats.

    Malformed input raises `TraceFormatError` naming the file and field; the "line" is the
    conversation's index in the list (0-based), and for invalid JSON the file's line.
    """
    if tokenizer is not None and not callable(tokenizer):
        raise ConfigError(f"tokenizer must be a callable str -> list[int], got "
                          f"{type(tokenizer).__name__}")
    if not _is_number(chars_per_token) or chars_per_token <= 0:
        raise ConfigError(f"chars_per_token must be a positive number, got {chars_per_token!r}")
    if not _is_int(vocab_size) or vocab_size < 2:
        raise ConfigError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if not _is_int(block_size) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    for label, value in (("conversation_interval", conversation_interval),
                         ("turn_interval", turn_interval)):
        if not _is_number(value) or value < 0:
            raise ConfigError(f"{label} must be a non-negative number, got {value!r}")
    if limit is not None and (not _is_int(limit) or limit < 0):
        raise ConfigError(f"limit must be None or a non-negative int, got {limit!r}")
    return _iter_sharegpt(os.fspath(path), tokenizer, float(chars_per_token), vocab_size,
                          block_size, conversation_interval, turn_interval, limit)


def _json_array(path: str, chunk: int = 1 << 20) -> Iterator[Any]:
    """The elements of the JSON list in ``path``, one at a time, reading ``chunk``
    characters at a time. Invalid JSON is a `TraceFormatError` naming the file's line; a
    file that is not a list is read whole, to say what it is."""
    decoder = json.JSONDecoder()
    space = " \t\n\r"
    with open(path, encoding="utf-8") as fh:
        buf = ""
        pos = 0
        eof = False
        lines_before = 0  # newlines in the text dropped from the front of ``buf``
        col_before = 0  # characters of the current line dropped with it

        def more() -> bool:
            nonlocal buf, pos, eof, lines_before, col_before
            if eof:
                return False
            text = fh.read(chunk)
            if not text:
                eof = True
                return False
            nl = buf.rfind("\n", 0, pos)
            lines_before += buf.count("\n", 0, pos)
            col_before = pos - nl - 1 if nl >= 0 else col_before + pos
            buf = buf[pos:] + text
            pos = 0
            return True

        def error(msg: str, at: int) -> TraceFormatError:
            line = lines_before + buf.count("\n", 0, at) + 1
            nl = buf.rfind("\n", 0, at)
            col = at - nl if nl >= 0 else col_before + at + 1
            return TraceFormatError(f"not valid JSON ({msg} at column {col}); expected a "
                                    "JSON list of conversations", path=path, line=line)

        def skip() -> bool:
            """Skip white space; False at the end of the file."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in space:
                    pos += 1
                if pos < len(buf):
                    return True
                if not more():
                    return False

        if not skip() or buf[pos] != "[":
            fh.seek(0)
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"not valid JSON ({exc.msg} at column {exc.colno}); "
                                       "expected a JSON list of conversations", path=path,
                                       line=exc.lineno) from None
            raise TraceFormatError(f"expected a JSON list of conversations, got "
                                   f"{type(data).__name__}", path=path)
        pos += 1
        first = True
        while True:
            if not skip():
                raise error("Expecting value", pos)
            if buf[pos] == "]" and first:
                pos += 1
                break
            if not first:
                if buf[pos] == "]":
                    pos += 1
                    break
                if buf[pos] != ",":
                    raise error("Expecting ',' delimiter", pos)
                pos += 1
                if not skip():
                    raise error("Expecting value", pos)
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if more():
                        continue
                    raise error(exc.msg, exc.pos) from None
                if end == len(buf) and more():  # a number may go on in the next chunk
                    continue
                break
            pos = end
            first = False
            yield value
        if skip():
            raise error("Extra data", pos)


def _iter_sharegpt(name: str, tokenizer: Callable[[str], Any] | None, chars_per_token: float,
                   vocab_size: int, block_size: int, conversation_interval: float,
                   turn_interval: float, limit: int | None) -> Iterator[Request]:
    def encode(text: str, where: int, field: str) -> np.ndarray:
        if tokenizer is None:
            return synthetic_token_ids(text, chars_per_token, vocab_size)
        ids = tokenizer(text)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or any(not _is_int(i) or i < 0 for i in ids):
            raise ConfigError(f"the tokenizer must return a list of non-negative ints; for "
                              f"{field} of conversation {where} in {name} it returned "
                              f"{ids!r:.80}")
        return np.asarray(ids, dtype=np.int64)

    waiting: list[tuple[float, int, Request]] = []  # heap by (arrival, order made)
    made = 0
    seen: set[str] = set()
    for index, conv in enumerate(_json_array(name)):
        if limit is not None and index >= limit:
            break
        start = round(index * conversation_interval, 6)
        while waiting and waiting[0][0] <= start:  # nothing read later arrives before these
            yield heapq.heappop(waiting)[2]
        if not isinstance(conv, dict):
            raise TraceFormatError(f"expected a conversation object, got "
                                   f"{type(conv).__name__}", path=name, line=index)
        raw_id = conv.get("id")
        if raw_id is not None and not (isinstance(raw_id, str) or _is_int(raw_id)):
            raise TraceFormatError(f"expected a string, got {raw_id!r}", path=name, line=index,
                                   field="id")
        session = f"conv{index}" if raw_id is None else str(raw_id)
        if session in seen:
            session = f"{session}#{index}"
        seen.add(session)
        if "conversations" not in conv:
            raise TraceFormatError("missing; each conversation needs a list of messages",
                                   path=name, line=index, field="conversations")
        messages = conv["conversations"]
        if not isinstance(messages, list):
            raise TraceFormatError(f"expected a list of messages, got "
                                   f"{type(messages).__name__}", path=name, line=index,
                                   field="conversations")
        pieces: list[np.ndarray] = []
        spans: list[list[Any]] = []
        pos = 0
        turn = 0
        for m, msg in enumerate(messages):
            field = f"conversations[{m}]"
            if not isinstance(msg, dict):
                raise TraceFormatError(f"expected a message object, got {type(msg).__name__}",
                                       path=name, line=index, field=field)
            for key in ("from", "value"):
                if key not in msg:
                    raise TraceFormatError("missing", path=name, line=index,
                                           field=f"{field}.{key}")
            role, text = msg["from"], msg["value"]
            if not isinstance(role, str) or role.lower() not in (
                    _USER_ROLES | _ASSISTANT_ROLES | _SYSTEM_ROLES):
                raise TraceFormatError(f"expected human, gpt or system, got {role!r}",
                                       path=name, line=index, field=f"{field}.from")
            if not isinstance(text, str):
                raise TraceFormatError(f"expected a string, got {type(text).__name__}",
                                       path=name, line=index, field=f"{field}.value")
            ids = encode(text, index, f"{field}.value")
            role = role.lower()
            if role in _ASSISTANT_ROLES:
                if pos > 0:
                    turn += 1
                    prompt = np.concatenate(pieces)
                    arrival = round(index * conversation_interval + (turn - 1) * turn_interval,
                                    6)
                    req = Request(f"{session}/{turn}", tokens=prompt, session_id=session,
                                  workload_class="chat", arrival=arrival,
                                  output_len=len(ids), output_tokens=ids, turn=turn,
                                  block_kinds=block_kinds_from_spans(spans, pos, block_size),
                                  extra={"conversation": index})
                    heapq.heappush(waiting, (arrival, made, req))
                    made += 1
                kind = "output"
            else:
                kind = "prompt"
            if len(ids):
                pieces.append(ids)
                spans.append([pos, pos + len(ids), kind])
                pos += len(ids)
    while waiting:
        yield heapq.heappop(waiting)[2]


def read_sharegpt(path: str | os.PathLike[str], tokenizer: Callable[[str], Any] | None = None,
                  chars_per_token: float = 4.0, *, vocab_size: int = 32000,
                  block_size: int = 16, conversation_interval: float = 1.0,
                  turn_interval: float = 60.0, limit: int | None = None) -> list[Request]:
    """All requests of a ShareGPT-shaped conversation file, in arrival order (see
    `iter_sharegpt`)."""
    return list(iter_sharegpt(path, tokenizer, chars_per_token, vocab_size=vocab_size,
                              block_size=block_size,
                              conversation_interval=conversation_interval,
                              turn_interval=turn_interval, limit=limit))


# -- any format, re-readable ---------------------------------------------------------------

#: The streaming reader of each trace format, by the name the command line uses.
READERS: dict[str, Callable[..., Iterator[Request]]] = {
    "jsonl": iter_jsonl,
    "mooncake": iter_mooncake,
    "alibaba": iter_alibaba,
    "sharegpt": iter_sharegpt,
}


class TraceFile:
    """A trace file that can be read as often as needed, one request at a time.

    Each ``iter()`` opens the file afresh and streams it through the format's reader
    (`READERS`), so a replay can go over it twice (Belady's first pass, then the replay)
    without holding it in memory. Reader options are checked here, by building (not
    running) one reader.

    Args:
        path: the file.
        format: ``"jsonl"``, ``"mooncake"``, ``"alibaba"`` or ``"sharegpt"``.
        arrival_order: make the reader check that arrivals never decrease (`iter_jsonl`,
            `iter_alibaba`; the Mooncake format always requires it and the ShareGPT reader
            sorts), so a replay on the arrival axis gets an error naming the line.
        options: the reader's keyword arguments (``block_size=`` for Mooncake and Alibaba,
            ``tokenizer=`` for ShareGPT, ...).
    """

    def __init__(self, path: str | os.PathLike[str], format: str = "jsonl", *,
                 arrival_order: bool = False, **options: Any) -> None:
        if format not in READERS:
            raise ConfigError(f"format must be one of {', '.join(READERS)}, got {format!r}")
        self.path = os.fspath(path)
        self.format = format
        if arrival_order and format in ("jsonl", "alibaba"):
            options["arrival_order"] = True
        self.options = options
        READERS[format](self.path, **options)  # checks the options; reads nothing

    @property
    def block_size(self) -> int | None:
        """Tokens per listed block id when the format fixes it (Mooncake: the trace's own,
        checked against a ``block_size`` option; Alibaba: the option, 16 by default); None
        for token-mode formats."""
        if self.format == "mooncake":
            return check_block_size(self.path, self.options.get("block_size"))
        if self.format == "alibaba":
            return int(self.options.get("block_size", ALIBABA_BLOCK_SIZE))
        return None

    def __iter__(self) -> Iterator[Request]:
        return READERS[self.format](self.path, **self.options)

    def count(self) -> int:
        """How many requests the file holds: its non-blank lines for the line formats (no
        parsing), a full streamed read for ShareGPT."""
        if self.format == "sharegpt":
            return sum(1 for _ in self)
        with open(self.path, "rb") as fh:
            return sum(1 for line in fh if line.strip())

    def __repr__(self) -> str:
        return f"TraceFile({self.path!r}, {self.format!r})"
