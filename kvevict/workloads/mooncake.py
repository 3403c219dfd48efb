"""Read and write the Mooncake trace format (FAST'25, kvcache-ai/Mooncake).

One JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

- ``timestamp``: arrival time in milliseconds (int or float, >= 0, non-decreasing);
- ``input_length``: prompt tokens (int >= 1);
- ``output_length``: generated tokens (int >= 0);
- ``hash_ids``: prefix-chained ids (ints >= 0, distinct within a line) of the prompt's
  512-token blocks, the last one possibly partial. Two requests whose lists share a leading
  run share that prefix; an id always follows the same parent id, in every line;
- ``block_size`` (optional, kvevict's extension): tokens per hash id, when not 512. The first
  record decides the trace's block size (its ``block_size``, else 512); a later line that
  carries a different one is malformed. `write_mooncake` writes it on every line when its
  ``block_size`` is not 512, so what it writes reads back.

**Block size.** A trace's hash ids are blocks of a fixed size, fixed when the trace was
recorded: replaying it with other blocks would count one hash id as a block of the wrong
number of tokens and print nonsense. So a reader given a ``block_size`` other than the
trace's (`trace_block_size`) raises `ConfigError` naming both; leave it out (None) to use
the trace's.

Each line becomes a hash-mode `Request`: ``request_id`` = the record's 0-based index (blank
lines are skipped and not counted), ``block_hashes`` = ``hash_ids``, ``arrival`` =
``timestamp / 1000`` (seconds), ``output_len`` = ``output_length``, ``workload_class`` =
``"chat"`` and ``session_id`` = None (the format has no sessions).

**Prompt length.** Every listed id is one cacheable block, so the prompt must reach into its
last listed block: ``num_tokens = max(input_length, block_size * (len(hash_ids) - 1) + 1)``.
When that raises ``input_length`` (a trace whose lengths and ids disagree), the original
value is kept in ``request.extra["input_length"]`` and `write_mooncake` writes it back. Tokens
beyond ``block_size * len(hash_ids)`` (a trace listing fewer ids than its length needs) are a
tail that is allocated but never cached. The bundled trace needs neither: its lengths and ids
agree on every line (121,877 listed blocks).

Malformed input raises `TraceFormatError` naming the file, the line and the field: invalid
JSON, a missing field, a wrong type, a negative number, a timestamp smaller than the previous
line's (the format lists requests in arrival order, and a replay relies on it), an id
repeated within a line, or an id that follows a different parent than on an earlier line (the
ids would not be prefix-chained). Unknown extra fields are ignored.
"""

from __future__ import annotations

import json
import math
import os
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from kvevict.errors import ConfigError, TraceFormatError
from kvevict.hashing import block_hashes as _token_block_hashes
from kvevict.types import Request

__all__ = [
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_SIZE",
    "IdTable",
    "bundled_trace_path",
    "check_block_size",
    "iter_mooncake",
    "read_mooncake",
    "trace_block_size",
    "write_mooncake",
]

#: Tokens per block of the Mooncake traces' ``hash_ids``.
MOONCAKE_BLOCK_SIZE = 512

#: Traces shipped inside the package (``kvevict/data/``), by name.
BUNDLED_TRACES = {"mooncake": "mooncake_synthetic_trace.jsonl"}

_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def bundled_trace_path(name: str = "mooncake") -> Path:
    """Path of a trace shipped with kvevict, e.g. ``bundled_trace_path("mooncake")``.

    ``"mooncake"`` is the synthetic trace published with Mooncake (3,993 requests, Apache-2.0;
    attribution in ``kvevict/data/README.md``).
    """
    if name not in BUNDLED_TRACES:
        raise ConfigError(
            f"unknown bundled trace {name!r}; valid names: {', '.join(sorted(BUNDLED_TRACES))}"
        )
    path = Path(__file__).resolve().parents[1] / "data" / BUNDLED_TRACES[name]
    if not path.is_file():
        raise FileNotFoundError(
            f"bundled trace {name!r} is missing at {path}; the kvevict installation lacks its "
            "package data (kvevict/data/*.jsonl)"
        )
    return path


class IdTable:
    """A map from non-negative int ids to non-negative ints that stays compact at trace scale.

    The readers use it for what they must remember about every id they have seen (a Mooncake
    block id's parent, an Alibaba chat's session), so that reading a trace of millions of
    requests holds neither the records nor a Python object per id.

    **Memory.** Ids below a bound live in pages of ``2**16`` int64 slots (`array.array`),
    allocated on first use; larger ids live in a dict. The bound starts at ``2**20`` and
    doubles whenever it falls below 8 times the number of entries, and the dict entries it
    then covers move into pages. So dense ids (0, 1, 2, ..., as in the Mooncake and Alibaba
    traces) cost 8 bytes each; ids however sparse cost at most 64 bytes each in pages (the
    pages cover ids below ``8 * len`` to ``16 * len`` only), and about 100 bytes each in the
    dict (random 64-bit ids, say). `nbytes` reports the total.
    """

    PAGE_BITS: ClassVar[int] = 16

    def __init__(self) -> None:
        self._bound = 1 << 20
        self._pages: list[array | None] = [None] * (self._bound >> self.PAGE_BITS)
        self._high: dict[int, int] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes held by the pages, plus an estimate of the dict's (100 per entry)."""
        pages = sum(1 for p in self._pages if p is not None)
        return pages * (8 << self.PAGE_BITS) + 8 * len(self._pages) + 100 * len(self._high)

    def get(self, key: int) -> int | None:
        """The value of ``key`` (a non-negative int), or None when it has none."""
        if key < self._bound:
            page = self._pages[key >> self.PAGE_BITS]
            if page is None:
                return None
            value = page[key & ((1 << self.PAGE_BITS) - 1)]
            return value - 1 if value else None
        return self._high.get(key)

    def __contains__(self, key: int) -> bool:
        return self.get(key) is not None

    def __setitem__(self, key: int, value: int) -> None:
        """Set ``key`` (a non-negative int) to ``value`` (an int in ``[0, 2**63 - 1)``)."""
        if key < self._bound:
            bits = self.PAGE_BITS
            page = self._pages[key >> bits]
            if page is None:
                page = self._pages[key >> bits] = array("q", bytes(8 << bits))
            slot = key & ((1 << bits) - 1)
            if not page[slot]:
                self._size += 1
            page[slot] = value + 1
        else:
            if key not in self._high:
                self._size += 1
            self._high[key] = value
        if 8 * self._size > self._bound:
            self._grow()

    def _grow(self) -> None:
        while 8 * self._size > self._bound:
            self._bound *= 2
        self._pages.extend([None] * ((self._bound >> self.PAGE_BITS) - len(self._pages)))
        moving = [k for k in self._high if k < self._bound]
        for key in moving:
            value = self._high.pop(key)
            self._size -= 1
            self[key] = value

    def link(self, ids: Sequence[int]) -> int:
        """Record that each of ``ids`` follows the one before it (the first: no parent), and
        return the position of the first id already recorded with another parent (-1 when
        none). The stored value is ``parent + 1`` (0: no parent); used for the prefix chains
        of Mooncake and Alibaba ``hash_ids``. Ids before the returned position are recorded,
        the rest are not."""
        bits = self.PAGE_BITS
        mask = (1 << bits) - 1
        pages, high = self._pages, self._high
        parent = 0  # parent + 1 of the next id
        for i, h in enumerate(ids):
            if h < self._bound:
                page = pages[h >> bits]
                if page is None:
                    page = pages[h >> bits] = array("q", bytes(8 << bits))
                stored = page[h & mask]
                if not stored:
                    page[h & mask] = parent + 1
                    self._size += 1
                    if 8 * self._size > self._bound:
                        self._grow()
                        pages = self._pages
                elif stored != parent + 1:
                    return i
            else:
                stored = high.get(h)
                if stored is None:
                    self[h] = parent
                    pages = self._pages
                elif stored != parent:
                    return i
            parent = h + 1
        return -1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def lengths_and_block_ids(obj: dict[str, Any], bad: Any, path: str, line: int
                          ) -> tuple[int, int, list[int]]:
    """Check the fields block-id traces share (Mooncake, Alibaba): ``input_length`` >= 1,
    ``output_length`` >= 0 and ``hash_ids``, a list of distinct non-negative ints.
    ``bad(field, what)`` builds the `TraceFormatError` for a field."""
    input_length = obj["input_length"]
    if not _is_int(input_length) or input_length < 1:
        raise bad("input_length", "a positive integer (prompt tokens)")
    output_length = obj["output_length"]
    if not _is_int(output_length) or output_length < 0:
        raise bad("output_length", "a non-negative integer (generated tokens)")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise bad("hash_ids", "a list of non-negative integer block ids")
    # the fast test first (JSON ints are exactly int; bool is not), the exact one on failure
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0):
        for h in ids:
            if not _is_int(h) or h < 0:
                raise TraceFormatError(
                    f"expected non-negative integer block ids, got {h!r} in the list",
                    path=path, line=line, field="hash_ids",
                )
    if len(set(ids)) != len(ids):
        raise TraceFormatError("an id repeats within the list; expected prefix-chained "
                               "distinct block ids", path=path, line=line, field="hash_ids")
    return input_length, output_length, ids


def _load_line(text: str, path: str, line: int) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"not valid JSON ({exc.msg} at column {exc.colno}); expected "
                               "one JSON object per line", path=path, line=line) from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}",
                               path=path, line=line)
    return obj


def _declared_block_size(obj: dict[str, Any], path: str, line: int) -> int | None:
    """A record's ``block_size`` field (None when it has none)."""
    if "block_size" not in obj:
        return None
    value = obj["block_size"]
    if not _is_int(value) or value < 1:
        raise TraceFormatError(f"expected a positive integer (tokens per hash id), got "
                               f"{value!r}", path=path, line=line, field="block_size")
    return int(value)


def _first_record(name: str) -> tuple[dict[str, Any], int] | None:
    """The first non-blank line of a trace, parsed, and its line number (None if none)."""
    with open(name, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = _decode(raw, name, line_no)
            if text.strip():
                return _load_line(text, name, line_no), line_no
    return None


def _decode(raw: bytes, name: str, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"not UTF-8 text ({exc.reason} at byte {exc.start})",
                               path=name, line=line_no) from None


def _block_size_source(declared: int | None) -> str:
    return ('its first record\'s "block_size" field' if declared is not None else
            'the Mooncake format\'s default: the file declares no "block_size"')


def trace_block_size(path: str | os.PathLike[str]) -> int:
    """Tokens per hash id of a Mooncake trace: its first record's ``block_size`` field, or
    `MOONCAKE_BLOCK_SIZE` (512) when it has none (or the file holds no record)."""
    return check_block_size(path, None)


def _mismatch(name: str, block_size: int, trace_size: int, declared: int | None,
              flag: str) -> ConfigError:
    given = f"{flag} {block_size}" if flag.startswith("-") else f"{flag}={block_size}"
    fix = f"{flag} {trace_size}" if flag.startswith("-") else f"{flag}={trace_size}"
    return ConfigError(
        f"{given} does not match the trace {name}: its hash ids are {trace_size}-token "
        f"blocks ({_block_size_source(declared)}), not {block_size}-token ones; leave "
        f"{flag} out or pass {fix}")


def check_block_size(path: str | os.PathLike[str], block_size: int | None, *,
                     flag: str = "block_size") -> int:
    """The block size to read the Mooncake trace at ``path`` with: the trace's
    (`trace_block_size`) when ``block_size`` is None; ``block_size`` when it equals the
    trace's; else `ConfigError` naming both sizes, and ``flag`` (the option that gave
    ``block_size``, e.g. ``"--block-size"``)."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(
            block_size, int) or block_size <= 0):
        raise ConfigError(f"{flag} must be a positive int, got {block_size!r}")
    name = os.fspath(path)
    first = _first_record(name)
    declared = None if first is None else _declared_block_size(first[0], name, first[1])
    trace_size = MOONCAKE_BLOCK_SIZE if declared is None else declared
    if block_size is not None and block_size != trace_size:
        raise _mismatch(name, block_size, trace_size, declared, flag)
    return trace_size


def _parse_record(obj: dict[str, Any], path: str, line: int, index: int, block_size: int,
                  workload_class: str) -> tuple[Request, int | float]:
    for name in _FIELDS:
        if name not in obj:
            raise TraceFormatError(
                f"missing; each line needs {', '.join(_FIELDS)}", path=path, line=line,
                field=name,
            )

    def bad(field: str, what: str) -> TraceFormatError:
        return TraceFormatError(f"expected {what}, got {obj[field]!r}", path=path, line=line,
                                field=field)

    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or ts < 0:
        raise bad("timestamp", "a non-negative number of milliseconds")
    input_length, output_length, ids = lengths_and_block_ids(obj, bad, path, line)
    num_tokens = input_length
    extra: dict[str, Any] = {}
    if ids:
        least = block_size * (len(ids) - 1) + 1
        if num_tokens < least:
            num_tokens = least
            extra["input_length"] = input_length
    request = Request(index, block_hashes=ids, num_tokens=num_tokens, arrival=ts / 1000,
                      output_len=output_length, workload_class=workload_class, extra=extra)
    return request, ts


def iter_mooncake(path: str | os.PathLike[str], *, block_size: int | None = None,
                  workload_class: str = "chat", check_chains: bool = True) -> Iterator[Request]:
    """Yield the requests of a Mooncake trace one at a time (see the module docstring).

    It holds one record at a time, plus what the prefix-chain check must remember: the parent
    of every id seen, in an `IdTable` (8 bytes per id for the dense ids of the published
    traces; 0.9 GB for a 10M-request trace of 11 new blocks per request).
    ``check_chains=False`` skips that check (an id following another parent than before is
    then not reported) and holds nothing per id. Arguments are checked when it is called; the
    file is opened at the first ``next``.

    Args:
        path: the ``.jsonl`` file.
        block_size: tokens per listed block: None (the default) for the trace's own
            (`trace_block_size`: 512 unless the file says otherwise); another value than
            the trace's raises `ConfigError` naming both (when the first record is read).
        workload_class: the class every request is tagged with.
        check_chains: check that every id always follows the same parent (the default).
    """
    if block_size is not None and (isinstance(block_size, bool)
                                   or not isinstance(block_size, int) or block_size <= 0):
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(workload_class, str) or not workload_class:
        raise ConfigError(f"workload_class must be a non-empty string, got {workload_class!r}")
    return _iter_mooncake(os.fspath(path), block_size, workload_class, bool(check_chains))


def _iter_mooncake(name: str, block_size: int | None, workload_class: str,
                   check_chains: bool) -> Iterator[Request]:
    parents = IdTable() if check_chains else None  # id -> its parent id + 1 (0: first)
    last_ts = -math.inf
    index = 0
    trace_size = MOONCAKE_BLOCK_SIZE
    decided_on = 0  # the line whose record decided the trace's block size
    why = ""
    with open(name, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = _decode(raw, name, line_no)
            if not text.strip():
                continue
            obj = _load_line(text, name, line_no)
            declared = _declared_block_size(obj, name, line_no)
            if not decided_on:
                decided_on = line_no
                why = (f"its block_size {declared}" if declared is not None else
                       f"no block_size field, so {MOONCAKE_BLOCK_SIZE}")
                trace_size = MOONCAKE_BLOCK_SIZE if declared is None else declared
                if block_size is not None and block_size != trace_size:
                    raise _mismatch(name, block_size, trace_size, declared, "block_size")
            elif declared is not None and declared != trace_size:
                raise TraceFormatError(
                    f"expected {trace_size}, the trace's block size (set by the first record, "
                    f"line {decided_on}: {why}), got {declared}", path=name, line=line_no,
                    field="block_size")
            req, ts = _parse_record(obj, name, line_no, index, trace_size, workload_class)
            if ts < last_ts:
                raise TraceFormatError(
                    f"{ts:g} ms is earlier than the previous line's {last_ts:g} ms; expected "
                    "requests in arrival order (non-decreasing timestamps)",
                    path=name, line=line_no, field="timestamp",
                )
            last_ts = ts
            if parents is not None:
                ids = req.block_hashes
                broken = parents.link(ids)  # type: ignore[arg-type]
                if broken >= 0:
                    raise _chain_error(name, line_no, ids, broken,  # type: ignore[arg-type]
                                       parents)
            index += 1
            yield req


def _chain_error(name: str, line_no: int, ids: Sequence[int], at: int,
                 parents: IdTable) -> TraceFormatError:
    """The error for ``ids[at]``, whose parent differs from the one recorded; the line that
    first listed it is found by reading the file again (an error path only)."""
    h = ids[at]
    parent = None if at == 0 else ids[at - 1]
    stored = parents.get(h)
    seen = None if not stored else stored - 1
    first = line_no
    with open(name, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number >= line_no:
                break
            text = raw.decode("utf-8")
            if text.strip() and h in _load_line(text, name, number).get("hash_ids", ()):
                first = number
                break
    where = "first in the list" if parent is None else f"after id {parent}"
    before = "first" if seen is None else f"after id {seen}"
    return TraceFormatError(
        f"id {h} comes {where} here but {before} on line {first}; "
        "expected prefix-chained ids (each id always follows the same parent)",
        path=name, line=line_no, field="hash_ids",
    )


def read_mooncake(path: str | os.PathLike[str], *, block_size: int | None = None,
                  workload_class: str = "chat", check_chains: bool = True) -> list[Request]:
    """All requests of a Mooncake trace, in file order (see `iter_mooncake`)."""
    return list(iter_mooncake(path, block_size=block_size, workload_class=workload_class,
                              check_chains=check_chains))


def _timestamp_ms(arrival: float) -> int | float:
    ms = float(arrival) * 1000
    nearest = round(ms)
    return int(nearest) if abs(ms - nearest) < 1e-6 else ms


def write_mooncake(requests: Iterable[Request], path: str | os.PathLike[str], *,
                   block_size: int = MOONCAKE_BLOCK_SIZE) -> int:
    """Write requests as a Mooncake trace; return how many lines were written.

    Hash-mode requests keep their ``block_hashes`` (they must be non-negative ints). A
    token-mode request lists its full ``block_size``-token blocks, hashed as the manager does
    and renumbered densely from one past the largest id any hash-mode request uses, so shared
    prefixes stay shared. ``timestamp`` is ``arrival * 1000`` (an int when whole);
    ``input_length`` is the prompt length (or ``extra["input_length"]`` when the reader had to
    raise it). A ``block_size`` other than 512 is written on every line (``"block_size"``), so
    the readers read the file back at that size. Requests must be in arrival order.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    reqs = list(requests)
    next_id = 0
    for req in reqs:
        if not isinstance(req, Request):
            raise ConfigError(f"write_mooncake takes Requests, got {type(req).__name__}")
        if req.block_hashes is not None:
            for h in req.block_hashes:
                if not _is_int(h) or h < 0:
                    raise ConfigError(
                        f"request {req.request_id!r}: the Mooncake format needs non-negative "
                        f"int block ids, got {h!r}"
                    )
                next_id = max(next_id, h + 1)
    dense: dict[int, int] = {}
    last = -math.inf
    count = 0
    with open(os.fspath(path), "w", encoding="utf-8") as fh:
        for req in reqs:
            if req.arrival < last:
                raise ConfigError(
                    f"request {req.request_id!r}: arrival {req.arrival} precedes the previous "
                    f"request's {last}; write requests in arrival order"
                )
            last = req.arrival
            if req.block_hashes is not None:
                ids = [int(h) for h in req.block_hashes]
            else:
                ids = []
                for h in _token_block_hashes(req.tokens, block_size):
                    if h not in dense:
                        dense[h] = next_id
                        next_id += 1
                    ids.append(dense[h])
            input_length = req.extra.get("input_length", req.prompt_len)
            record = {"timestamp": _timestamp_ms(req.arrival), "input_length": int(input_length),
                      "output_length": int(req.output_len), "hash_ids": ids}
            if block_size != MOONCAKE_BLOCK_SIZE:
                record["block_size"] = block_size
            fh.write(json.dumps(record, separators=(", ", ": ")) + "\n")
            count += 1
    return count
