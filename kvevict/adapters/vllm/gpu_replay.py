"""A trace replayed through vLLM's real GPU-tier ``KVCacheManager``: no model, no GPU.

One request at a time, in list order, as vLLM's scheduler drives a request that runs alone:

1. a vLLM ``Request`` is built from the prompt's token ids; vLLM's own block hasher
   (``get_request_block_hasher``, sha256 as ``vllm serve`` defaults to) chains its full
   blocks;
2. ``get_computed_blocks``: its longest cached prefix, as vLLM caps it (a prompt is never hit
   whole: its last token is recomputed for the logits);
3. ``allocate_slots`` for the rest: hits touched, new blocks taken from the free queue
   (evicting), the prompt's full blocks cached;
4. ``free``: released tail first.

No decode steps run (as in `kvevict.replay`): a trace's outputs are never hit, only the
prompts. A request's output length is its ``max_tokens`` (1 when the trace gives none), which
the plugin passes to the policy as the request's ``output_len``, as kvevict's replay does. A
request that cannot fit in the whole pool is not run and counts as all misses
(``rejected``).

The KV cache is vLLM's ``KVCacheConfig`` built by hand: one ``FullAttentionSpec`` group of
``block_size`` tokens and ``capacity_blocks + 1`` blocks (vLLM keeps one as its null block, so
``capacity_blocks`` hold KV, as in a kvevict pool of that size). A token-mode request
(JSONL, ShareGPT) keeps its tokens. A hash-mode request (Mooncake, Alibaba) becomes tokens
deterministically: block id ``h`` is the ``block_size`` tokens ``h * block_size + j``, so
equal ids make equal blocks and vLLM's hashing chains them as the trace chains its ids; the
prompt is cut to ``num_tokens``.

Policies: ``vllm:lru`` is stock vLLM (no plugin), any online kvevict policy runs through the
GPU-tier plugin (`kvevict.adapters.vllm.gpu`). The clock is the request index
(``time="index"``) or its arrival seconds. The counters are vLLM's: ``token_queries`` /
``token_hits`` are its ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens, and
tokens served from the cache), ``accesses`` / ``hits`` the full blocks looked up / hit.
"""

from __future__ import annotations

import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvevict.adapters.vllm import check_table_args, replay_cells

# kvevict's GPU-tier module before vLLM's: it checks vLLM is there (and supported) first
from kvevict.adapters.vllm.gpu import GPUTier, KVEvictKVCacheManager, gpu_policy
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.policies.registry import is_offline
from kvevict.replay import ReplayRecord, ReplayResult, ReplayTable, Tally
from kvevict.types import ManualClock, Request

import torch  # isort: skip  (vLLM's specs take a torch dtype)
from vllm.sampling_params import SamplingParams  # isort: skip
from vllm.utils.hashing import get_hash_fn_by_name  # isort: skip
from vllm.v1.core.kv_cache_manager import KVCacheManager  # isort: skip
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # isort: skip
from vllm.v1.kv_cache_interface import (  # isort: skip
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request as VllmRequest  # isort: skip

__all__ = ["VLLM_GPU_POLICIES", "GPUStream", "block_hasher", "drive_request", "kv_cache_config",
           "make_gpu_manager", "prompt_tokens", "replay_gpu", "replay_gpu_table"]

#: vLLM's own GPU-tier policy (stock vLLM, no plugin), named apart from kvevict's ``lru``.
VLLM_GPU_POLICIES = ("vllm:lru",)

#: ``vllm serve``'s default ``--prefix-caching-hash-algo``.
HASH_ALGO = "sha256"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def kv_cache_config(capacity_blocks: int, block_size: int = 16) -> KVCacheConfig:
    """One full-attention group of ``capacity_blocks`` usable blocks (+ vLLM's null block)
    of ``block_size`` tokens; one layer, one KV head of 64 float32 values."""
    _positive_int("capacity_blocks", capacity_blocks)
    _positive_int("block_size", block_size)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=capacity_blocks + 1, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])


def make_gpu_manager(policy: str, capacity_blocks: int, *, block_size: int = 16,
                     params: Mapping[str, Any] | None = None,
                     clock: Callable[[], float] | None = None,
                     max_model_len: int | None = None,
                     ) -> tuple[KVCacheManager, GPUTier | None]:
    """vLLM's ``KVCacheManager`` over `kv_cache_config`, stock (``"vllm:lru"``) or through
    the plugin with a kvevict policy, and the plugin's `GPUTier` (None for stock)."""
    config = kv_cache_config(capacity_blocks, block_size)
    if not isinstance(policy, str) or not policy:
        raise ConfigError(f"policy must be a name, got {policy!r}")
    length = max_model_len if max_model_len is not None else (capacity_blocks + 1) * block_size
    kwargs = dict(max_model_len=length, scheduler_block_size=block_size,
                  hash_block_size=block_size, enable_caching=True, log_stats=False)
    if policy.startswith("vllm:"):
        if policy not in VLLM_GPU_POLICIES:
            raise ConfigError(f"unknown vLLM GPU-tier policy {policy!r}; known: "
                              f"{', '.join(VLLM_GPU_POLICIES)}")
        if params:
            raise ConfigError(f"{policy} takes no parameters, got {sorted(params)}")
        return KVCacheManager(config, **kwargs), None
    if is_offline(policy):
        raise ConfigError(f"{policy} is offline (it needs the future); the GPU tier runs "
                          "online policies")
    with gpu_policy(policy, params, clock=clock if clock is not None else ManualClock()) \
            as slot:
        manager = KVEvictKVCacheManager(config, **kwargs)
    return manager, slot.tiers[0]


def prompt_tokens(request: Request, block_size: int, index: int = 0) -> list[int]:
    """The token ids vLLM gets for ``request``: its own (token mode), or ``block_size``
    tokens ``h * block_size + j`` per listed block id ``h``, cut to its ``num_tokens``
    (hash mode; an id must be an int >= 0). A prompt longer than its listed blocks ends in
    tokens ``-(index + 1)``, its own (``index``: its position in the trace)."""
    if request.block_hashes is None:
        return [int(t) for t in request.tokens]
    for h in request.block_hashes:
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or h < 0:
            raise ConfigError(f"request {request.request_id!r}: the GPU-tier replay maps "
                              f"block ids that are ints >= 0 to tokens, got {h!r}")
    ids = np.asarray(request.block_hashes, dtype=np.int64)
    out = (ids[:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel().tolist()
    n = request.prompt_len
    if len(out) < n:
        out.extend([-(index + 1)] * (n - len(out)))
    return out[:n]


class GPUStream:
    """Requests and the token ids vLLM gets for each (`prompt_tokens`), built once for the
    cells of a `replay_gpu_table`."""

    def __init__(self, requests: Iterable[Request], block_size: int) -> None:
        _positive_int("block_size", block_size)
        self.block_size = block_size
        self.requests = list(requests)
        for req in self.requests:
            if not isinstance(req, Request):
                raise ConfigError(f"the GPU-tier replay takes kvevict Requests, got "
                                  f"{type(req).__name__}")
        self.tokens = [prompt_tokens(req, block_size, i) for i, req in enumerate(self.requests)]


def drive_request(manager: KVCacheManager, request: VllmRequest) -> int | None:
    """One request through ``manager`` (see the module's steps): the tokens served from the
    cache, or None when it could not be allocated (then nothing changed)."""
    blocks, computed, _ = manager.get_computed_blocks(request)
    out = manager.allocate_slots(request, request.num_tokens - computed, computed, blocks)
    if out is None:
        return None
    manager.free(request)
    return computed


def block_hasher(block_size: int) -> Callable[[VllmRequest], list[Any]]:
    """vLLM's request block hasher for blocks of ``block_size`` tokens (`HASH_ALGO`; sets
    vLLM's ``NONE_HASH`` as the engine does at start)."""
    hash_fn = get_hash_fn_by_name(HASH_ALGO)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def replay_gpu(requests: Iterable[Request], policy: str, capacity_blocks: int, *,
               block_size: int = 16, params: Mapping[str, Any] | None = None,
               label: str | None = None, time: str = "index",
               check_every: int = 0, records: bool = False) -> ReplayResult:
    """Replay ``requests`` through vLLM's real ``KVCacheManager`` (module docstring).

    Args:
        requests: token-mode or hash-mode kvevict requests, in order (or a `GPUStream`).
        policy: ``"vllm:lru"`` (stock vLLM) or an online kvevict policy name (the plugin).
        capacity_blocks: usable blocks in the GPU pool.
        block_size: tokens per block (a Mooncake trace's own: 512).
        params: the kvevict policy's parameters.
        label: the result's policy label (default: ``policy``).
        time: the policies' clock: ``"index"`` or ``"arrival"`` (seconds).
        check_every: check the plugin's records against vLLM's pool every this many
            requests (0: never).
        records: keep a `ReplayRecord` per request (its ``token_hits`` is vLLM's
            ``RequestOutput.num_cached_tokens`` for the same request in an engine).

    Returns:
        A `ReplayResult`: vLLM's token counters, full blocks looked up and hit, cached blocks
        evicted (hashed blocks minus those still cached at the end), requests rejected, and
        the prefill compute the hits saved by the default `kvevict.cost.CostModel`, and
        the same counts by batches of consecutive requests (as `kvevict.replay` counts
        them, so `kvevict.replay.compare` pairs two policies).
    """
    if time not in ("index", "arrival"):
        raise ConfigError(f"time must be 'index' or 'arrival', got {time!r}")
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
        raise ConfigError(f"check_every must be a non-negative int, got {check_every!r}")
    stream = requests if isinstance(requests, GPUStream) else GPUStream(requests, block_size)
    if stream.block_size != block_size:
        raise ConfigError(f"the stream's prompts were cut for blocks of {stream.block_size} "
                          f"tokens, not {block_size}")
    reqs = stream.requests
    clock = ManualClock()
    manager, tier = make_gpu_manager(policy, capacity_blocks, block_size=block_size,
                                     params=params, clock=clock,
                                     max_model_len=max([r.prompt_len for r in reqs] +
                                                       [block_size]) + block_size)
    hasher = block_hasher(block_size)
    pool = manager.block_pool
    start = _time.perf_counter()
    rejected = cached = 0
    tally = Tally(CostModel())
    kept: list[ReplayRecord] | None = [] if records else None
    for i, (req, tokens) in enumerate(zip(reqs, stream.tokens)):
        t = float(req.arrival) if time == "arrival" else float(i)
        req_id, session = str(req.request_id), req.session_id
        clock.set(t)
        # nothing is decoded here: the trace's output length is the request's max_tokens,
        # which the plugin gives the policy as the request's output_len
        params_v = SamplingParams(max_tokens=max(int(req.output_len), 1))
        vreq = VllmRequest(req_id, tokens, params_v, None, arrival_time=t,
                           block_hasher=hasher,
                           session_id=None if session is None else str(session))
        full = len(vreq.block_hashes)
        found = drive_request(manager, vreq)
        got = found or 0  # tokens hit (none for a rejected request)
        got_blocks = got // block_size
        if found is None:
            rejected += 1
        else:
            cached += full - got_blocks
        tally.add(full, got_blocks, vreq.num_tokens, got)
        if kept is not None:
            kept.append(ReplayRecord(i, req_id, full, got_blocks, vreq.num_tokens, got,
                                     found is None))
        if check_every and tier is not None and (i + 1) % check_every == 0:
            tier.check()
    seconds = _time.perf_counter() - start
    resident = sum(1 for block in pool.blocks if block.block_hash is not None)
    evictions = cached - resident
    if tier is not None and tier.evictions != evictions:
        raise AssertionError(f"plugin counted {tier.evictions} evictions, vLLM's pool "
                             f"{evictions}")
    accesses, hits, queries, token_hits = tally.totals()
    return ReplayResult(policy=label if label is not None else policy,
                        capacity_blocks=capacity_blocks, block_size=block_size,
                        requests=len(reqs), accesses=accesses, hits=hits,
                        token_queries=queries, token_hits=token_hits, evictions=evictions,
                        rejected=rejected, seconds=seconds,
                        records=None if kept is None else tuple(kept),
                        **tally.result_fields())


def replay_gpu_table(requests: Iterable[Request], policies: Sequence[str],
                     capacities: Iterable[int], block_size: int = 16, *, time: str = "index",
                     progress: Callable[[str, int], None] | None = None) -> ReplayTable:
    """`replay_gpu` of every policy at every size over one read of ``requests``.

    Args:
        requests: any kvevict requests (a `TraceFile` is read once).
        policies: ``"vllm:lru"`` or online kvevict policy names, each once.
        capacities: usable GPU pool sizes in blocks.
        block_size: tokens per block.
        time: as for `replay_gpu`.
        progress: called ``progress(policy, capacity)`` after each cell.

    Returns:
        A `ReplayTable`, for `kvevict.replay.format_table`.
    """
    policies, sizes = check_table_args(policies, capacities, "blocks")
    for policy in policies:  # a bad name fails before any replay runs
        make_gpu_manager(policy, 1, block_size=block_size)
    stream = GPUStream(requests, block_size)
    return replay_cells(policies, sizes, lambda policy, size: replay_gpu(
        stream, policy, size, block_size=block_size, time=time), progress)
