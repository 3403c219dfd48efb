"""A trace replayed through vLLM's real ``CPUOffloadingManager``: no engine, no GPU.

Each request, in list order, goes through the manager as vLLM's ``OffloadingConnector``
scheduler drives it for a request whose KV the GPU tier no longer holds:

1. ``on_new_request``; each offload key's end-token position recorded in the context;
2. ``lookup`` of its keys, head first, until the first miss: the hit chunks (vLLM's
   ``_maximal_prefix_lookup``);
3. ``prepare_load`` / ``complete_load`` of the hits (the transfer back to the GPU);
4. ``prepare_store`` / ``complete_store`` of the keys after the hits (``CHUNK_LEVEL``
   offload: only newly computed chunks; a store that cannot evict enough is skipped, as
   vLLM skips it);
5. ``on_request_finished``.

Only **full** chunks have keys (vLLM hashes full blocks only): `offload_requests` cuts each
request to its ``num_tokens // chunk_tokens`` full chunks and drops requests with none; a
token-mode request (JSONL, ShareGPT) is hashed into chained chunk hashes first
(`kvevict.hashing.block_hashes`, as `kvevict.replay` hashes it). The
hit ratio is chunk hits over chunk lookups. On the bundled Mooncake trace (512-token
chunks) vLLM's built-in ``lru`` gives 0.0880 / 0.2925 / 0.6009 at 1,000 / 5,000 / 20,000
chunks, and ``arc`` 0.0820 / 0.3045 / 0.6132.

The clock is the request index (kvevict's ``time="index"``, the default) or the arrival
seconds (``time="arrival"``), so a kvevict policy's time-aware parameters are in the same
unit as in `kvevict.replay`. The results are kvevict's `ReplayResult` (``capacity_blocks`` =
chunks, ``block_size`` = tokens per chunk); `replay_offload_table` gives a `ReplayTable` of
policies by sizes, for `kvevict.replay.format_table` (``kvevict replay --engine
vllm-offload``).
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvevict.adapters.vllm import check_table_args, replay_cells
from kvevict.adapters.vllm.offload import KVEvictCachePolicy, offload_policy
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.hashing import block_hashes
from kvevict.replay import ReplayResult, ReplayTable, Tally
from kvevict.types import ManualClock, Request

from vllm.v1.kv_offload.base import (  # isort: skip
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # isort: skip

__all__ = ["VLLM_POLICIES", "drive_request", "make_manager", "offload_keys",
           "offload_requests", "replay_offload", "replay_offload_table"]

#: vLLM's own offload policies, named with this prefix to tell them from kvevict's.
VLLM_POLICIES = ("vllm:lru", "vllm:arc")

_MODULE = "kvevict.adapters.vllm.offload"


def offload_requests(requests: Iterable[Request], chunk_tokens: int = 512) -> list[Request]:
    """``requests`` cut to their full chunks (hash mode), those with none dropped.

    A hash-mode request keeps its first ``num_tokens // chunk_tokens`` ids and that many
    chunks of tokens, so that `kvevict.replay.replay` and `replay_offload` see one stream. A
    token-mode request becomes the chained hashes of its full chunks of ``chunk_tokens``
    tokens (`kvevict.hashing.block_hashes`, the hashes `kvevict.replay` gives its blocks).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    out = []
    for req in requests:
        if not isinstance(req, Request):
            raise ConfigError(f"offload_requests takes Requests, got {type(req).__name__}")
        if req.block_hashes is None:
            hashes = tuple(block_hashes(req.tokens, chunk_tokens))
        else:
            hashes = req.block_hashes[:req.prompt_len // chunk_tokens]
        if not hashes:
            continue
        out.append(Request(req.request_id, session_id=req.session_id,
                           workload_class=req.workload_class, arrival=req.arrival,
                           output_len=req.output_len, turn=req.turn, retention=req.retention,
                           block_hashes=hashes, num_tokens=len(hashes) * chunk_tokens))
    return out


def _key_bytes(block_hash: Any) -> bytes:
    if isinstance(block_hash, bytes):
        return block_hash
    if isinstance(block_hash, int) and not isinstance(block_hash, bool) and block_hash >= 0:
        return block_hash.to_bytes(max(8, (block_hash.bit_length() + 7) // 8), "big")
    if isinstance(block_hash, str):
        return block_hash.encode()
    raise ConfigError(f"a block hash must be bytes, a str or an int >= 0 to become an offload "
                      f"key, got {block_hash!r}")


def offload_keys(request: Request, group: int = 0) -> list[OffloadKey]:
    """The offload keys of ``request``'s listed blocks in KV cache group ``group``."""
    if request.block_hashes is None:
        raise ConfigError(f"request {request.request_id!r} has no block_hashes")
    return [make_offload_key(_key_bytes(h), group) for h in request.block_hashes]


def make_manager(policy: str, capacity_chunks: int, *, chunk_tokens: int = 512,
                 params: Mapping[str, Any] | None = None, clock: ManualClock | None = None
                 ) -> tuple[CPUOffloadingManager, KVEvictCachePolicy | None]:
    """A ``CPUOffloadingManager`` of ``capacity_chunks`` running ``policy`` (one of
    `VLLM_POLICIES`, or a kvevict policy name through `KVEvictCachePolicy`), and the
    adapter it runs (None for vLLM's own)."""
    if isinstance(capacity_chunks, bool) or not isinstance(capacity_chunks, int) \
            or capacity_chunks < 1:
        raise ConfigError(f"capacity_chunks must be a positive int, got {capacity_chunks!r}")
    if not isinstance(policy, str) or not policy:
        raise ConfigError(f"policy must be a name, got {policy!r}")
    if policy.startswith("vllm:"):
        if policy not in VLLM_POLICIES:
            raise ConfigError(f"unknown vLLM policy {policy!r}; known: "
                              f"{', '.join(VLLM_POLICIES)}")
        if params:
            raise ConfigError(f"{policy} takes no parameters, got {sorted(params)}")
        return CPUOffloadingManager(capacity_chunks, cache_policy=policy[len("vllm:"):]), None
    with offload_policy(policy, params, chunk_tokens=chunk_tokens,
                        clock=clock if clock is not None else ManualClock()) as slot:
        manager = CPUOffloadingManager(capacity_chunks,
                                       cache_policy=KVEvictCachePolicy.__name__,
                                       cache_policy_module_path=_MODULE)
    return manager, slot.policies[0]


def drive_request(manager: CPUOffloadingManager, keys: Sequence[OffloadKey],
                  req_context: ReqContext, chunk_tokens: int = 512) -> tuple[int, int | None]:
    """One request through ``manager`` (see the module's steps): (hit chunks, chunks
    evicted to store the rest, or None when the store was skipped)."""
    manager.on_new_request(req_context)
    for i, key in enumerate(keys):
        req_context.set_offload_key_position(key, (i + 1) * chunk_tokens)
    hits = 0
    for key in keys:
        if manager.lookup(key, req_context) is not LookupResult.HIT:
            break
        hits += 1
    if hits:
        manager.prepare_load(keys[:hits], req_context)
        manager.complete_load(keys[:hits], req_context)
    evicted: int | None = 0
    if hits < len(keys):
        out = manager.prepare_store(keys[hits:], req_context)
        if out is None:
            evicted = None
        else:
            evicted = len(out.evicted_keys)
            if out.keys_to_store:
                manager.complete_store(out.keys_to_store, req_context)
    manager.on_request_finished(req_context)
    return hits, evicted


def replay_offload(requests: Iterable[Request], policy: str, capacity_chunks: int, *,
                   chunk_tokens: int = 512, params: Mapping[str, Any] | None = None,
                   label: str | None = None, check_every: int = 0,
                   time: str = "index") -> ReplayResult:
    """Replay ``requests`` (cut by `offload_requests`) through a real ``CPUOffloadingManager``.

    Args:
        requests: hash-mode requests, e.g. ``read_mooncake(bundled_trace_path("mooncake"))``.
        policy: ``"vllm:lru"`` / ``"vllm:arc"`` (vLLM's own) or a kvevict policy name.
        capacity_chunks: chunks in the offload tier.
        chunk_tokens: tokens per chunk (512 for the Mooncake traces).
        params: the kvevict policy's parameters.
        label: the result's policy label (default: ``policy``).
        check_every: check the adapter's bookkeeping every this many requests (0: never).
        time: the policies' clock: ``"index"`` (the request's index among the cut requests,
            as `kvevict.replay` counts them on the same list) or ``"arrival"`` (its arrival
            seconds, as the trace gives them).

    Returns:
        A `ReplayResult`; ``rejected`` counts requests whose store was skipped; the prefill
        compute saved (by the default `kvevict.cost.CostModel`) counts each cut request's
        full chunks, its hit chunks cached; the counts by batches of consecutive cut
        requests are kept as `kvevict.replay` keeps them (for `kvevict.replay.compare`).
    """
    if time not in ("index", "arrival"):
        raise ConfigError(f"time must be 'index' or 'arrival', got {time!r}")
    reqs = offload_requests(requests, chunk_tokens)
    clock = ManualClock()
    manager, adapter = make_manager(policy, capacity_chunks, chunk_tokens=chunk_tokens,
                                    params=params, clock=clock)
    # the keys laid out before the clock starts: the timer sees the manager and its policy
    # (and the connector's per-request calls), not the trace's conversion to vLLM keys
    stream = [(float(req.arrival) if time == "arrival" else float(i), str(req.request_id),
               offload_keys(req)) for i, req in enumerate(reqs)]
    start = _time.perf_counter()
    skipped = evictions = 0
    tally = Tally(CostModel())
    for i, (t, req_id, keys) in enumerate(stream):
        clock.set(t)
        found, evicted = drive_request(manager, keys, ReqContext(req_id), chunk_tokens)
        tally.add(len(keys), found, len(keys) * chunk_tokens, found * chunk_tokens)
        if evicted is None:
            skipped += 1
        else:
            evictions += evicted
        if check_every and adapter is not None and (i + 1) % check_every == 0:
            adapter.check()
    seconds = _time.perf_counter() - start
    accesses, hits, token_queries, token_hits = tally.totals()
    return ReplayResult(policy=label if label is not None else policy,
                        capacity_blocks=capacity_chunks, block_size=chunk_tokens,
                        requests=len(reqs), accesses=accesses, hits=hits,
                        token_queries=token_queries, token_hits=token_hits,
                        evictions=evictions, rejected=skipped, seconds=seconds,
                        **tally.result_fields())


def replay_offload_table(requests: Iterable[Request], policies: Sequence[str],
                         capacities: Iterable[int], chunk_tokens: int = 512, *,
                         time: str = "index",
                         progress: Callable[[str, int], None] | None = None) -> ReplayTable:
    """`replay_offload` of every policy at every capacity, over one cut of ``requests``.

    Args:
        requests: any requests (`offload_requests` cuts them once; a `TraceFile` is read once).
        policies: `VLLM_POLICIES` names or online kvevict policy names, each once.
        capacities: offload tier sizes in chunks.
        chunk_tokens: tokens per chunk.
        time: as for `replay_offload`.
        progress: called ``progress(policy, capacity)`` after each cell.

    Returns:
        A `ReplayTable` (``capacities`` in chunks), for `kvevict.replay.format_table`.
    """
    policies, sizes = check_table_args(policies, capacities, "chunks")
    for policy in policies:  # a bad name fails before any replay runs
        make_manager(policy, 1, chunk_tokens=chunk_tokens)
    cut = offload_requests(requests, chunk_tokens)
    return replay_cells(policies, sizes, lambda policy, size: replay_offload(
        cut, policy, size, chunk_tokens=chunk_tokens, time=time), progress)
