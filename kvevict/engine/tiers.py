"""Real memory tiers under the engine's pool: a host tier (a second CPU tensor) and a disk tier
(a directory of checksummed block files), measured on this machine.

`kvevict.tiers` holds the mechanism (`TierStack`: demote on eviction, reload on a hit below
the pool, the reload-versus-recompute rule); this module fits it to the built-in engine:

- `TimedTierStack`: a `TierStack` that times its reloads (``load``: the disk reads and
  checksums, the copies into the pool) with the engine's clock, so a run reports the seconds
  its reloads really took, next to what the profiles predicted.
- `engine_tiers`: the stack the engine and ``kvevict engine-bench --host-gib X --disk-dir D``
  run with: a host tier of ``host_bytes`` and a disk tier of ``disk_bytes`` under a
  directory, with links measured here (`measure_link`) unless given.
- `measure_link`: a `TierProfile` fitted to this machine: the seconds to move ``n`` blocks
  through a store exactly as `TierStack` does (`HostStore` / `DiskStore` read, then a copy
  into a pool block; write for the other direction), least squares of
  ``t(n) = latency + n * bytes_per_block / bandwidth`` over ``n`` in ``block_counts``.
  A disk link is measured **cold** by default: every file is flushed (``fsync``) and dropped
  from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``) before it is read, so the read
  reaches the device; ``cold=False`` measures reads the page cache serves (the common case on
  a machine with free RAM, which the OS gives to the page cache).
- `measure_recompute`: the seconds to recompute one block at each depth (a prefill of
  ``block_size`` tokens after ``depth * block_size`` cached ones), as the cost model prices
  `CostModel.recompute_seconds`.
- `crossover_table`: per depth, measured reload (per tier) and recompute next to what the
  cost model and the profiles predict, and the crossover depth (the shallowest depth from
  which reloading beats recomputing), measured and predicted. The rule is InferCept's
  (Abhyankar et al., ICML'24, section 4: swap when the transfer costs less than the
  recomputation) and CachedAttention's (Gao et al., USENIX ATC'24, section 3: only the reload
  sits on the critical path; the save is asynchronous).

Every timing is the median of ``repeats`` timed calls after one untimed warm-up, like
`kvevict.engine.calibrate`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kvevict.cost import CostModel
from kvevict.engine.model import LlamaModel
from kvevict.errors import ConfigError
from kvevict.hashing import ROOT_HASH, hash_block
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool
from kvevict.tiers import DiskStore, HostStore, Tier, TierProfile, TierStack
from kvevict.types import BlockInfo

__all__ = ["DEFAULT_BLOCK_COUNTS", "DEFAULT_DEPTHS", "LinkFit", "TimedTierStack",
           "crossover_table", "engine_tiers", "measure_link", "measure_recompute",
           "tier_report"]

#: Blocks per batch of the link measurement.
DEFAULT_BLOCK_COUNTS = (1, 2, 4, 8, 16, 32)
#: Block depths of the recompute measurement.
DEFAULT_DEPTHS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
GIB = 2**30


class TimedTierStack(TierStack):
    """A `TierStack` that times its reloads with ``timer`` (default `time.perf_counter`).

    ``reload_seconds_measured`` adds up the seconds of every `load` (reading a disk block's
    file and checking its checksum, copying into the pool); ``reload_batches`` counts the
    calls of `load` that moved a block. ``takes`` counts the holds of a lower-tier chain for a
    reload (a request whose prefix continues below the pool and that fits) and
    ``restored_takes`` those undone by `restore` (admission deferred the request, or a policy
    raised); a request that does not fit holds and reads nothing, so a request retried until
    it fits is one take and one load. Everything else is `TierStack`'s.
    """

    def __init__(self, tiers: Sequence[Tier], *, timer: Callable[[], float] = time.perf_counter,
                 **kwargs: Any) -> None:
        super().__init__(tiers, **kwargs)
        if not callable(timer):
            raise ConfigError("timer must be a callable returning seconds")
        self.timer = timer
        self.reload_seconds_measured = 0.0
        self.reload_batches = 0
        self.takes = 0
        self.restored_takes = 0

    def hold(self, blocks: Sequence[BlockInfo], now: float) -> None:
        if blocks:
            self.takes += 1
        super().hold(blocks, now)

    def restore(self, blocks: Sequence[BlockInfo], now: float) -> None:
        if blocks:
            self.restored_takes += 1
        super().restore(blocks, now)

    def load(self, blocks: Sequence[BlockInfo], block_ids: Sequence[int], now: float) -> int:
        t0 = self.timer()
        try:
            return super().load(blocks, block_ids, now)
        finally:
            self.reload_seconds_measured += self.timer() - t0
            self.reload_batches += 1 if blocks else 0


def _check_bytes(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            np.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a number of bytes >= 0, got {value!r}")


def engine_tiers(layout: KVLayout, block_size: int, *, host_bytes: float = 0,
                 disk_dir: str | os.PathLike[str] | None = None, disk_bytes: float = GIB,
                 cost: CostModel | None = None, host_profile: TierProfile | str = "host-pcie5",
                 disk_profile: TierProfile | str = "nvme", demote: str = "cost",
                 model: str | None = None, policy: str = "lru",
                 timer: Callable[[], float] = time.perf_counter) -> TimedTierStack:
    """The tiers of one engine run: a host tier holding ``host_bytes`` (a CPU tensor) and,
    with ``disk_dir``, a disk tier holding ``disk_bytes`` in that directory.

    Args:
        layout, block_size: the pool's (a tier's capacity is its bytes over the pool's
            bytes per block, rounded down).
        host_bytes: size of the host tier (0: none).
        disk_dir: directory of the disk tier (None: none).
        disk_bytes: size of the disk tier.
        cost: the cost model of the demotion rule, in the seconds of ``timer`` (the
            engine's, not the workload's); default `CostModel()`.
        host_profile, disk_profile: the links (`measure_link` fits them to this machine).
        demote: ``"cost"`` or ``"always"`` (`TierStack`).
        model: the model's identity in the disk tier's manifest.
        policy: each tier's residency policy.
        timer: times the reloads (`TimedTierStack`).

    Raises:
        ConfigError: no tier at all, or a size that holds no block.
    """
    _check_bytes("host_bytes", host_bytes)
    _check_bytes("disk_bytes", disk_bytes)
    per_block = layout.bytes_per_block(block_size)
    tiers = []
    if host_bytes:
        blocks = int(host_bytes // per_block)
        if blocks < 1:
            raise ConfigError(f"a host tier of {host_bytes:,.0f} bytes holds no "
                              f"{per_block:,}-byte block; give at least {per_block:,}")
        tiers.append(Tier(blocks, host_profile, store=HostStore(), policy=policy,
                          name="host"))
    if disk_dir is not None:
        blocks = int(disk_bytes // per_block)
        if blocks < 1:
            raise ConfigError(f"a disk tier of {disk_bytes:,.0f} bytes holds no "
                              f"{per_block:,}-byte block; give at least {per_block:,}")
        tiers.append(Tier(blocks, disk_profile, store=DiskStore(disk_dir), policy=policy,
                          name="disk"))
    if not tiers:
        raise ConfigError("engine_tiers needs host_bytes > 0 or a disk_dir")
    return TimedTierStack(tiers, cost_model=cost, demote=demote, model=model, timer=timer)


def tier_report(stack: TierStack, device_hits: int) -> dict[str, Any]:
    """What a run's tiers did, JSON-ready: blocks served by each tier (``hits_by_tier``,
    the pool's own hits as ``device``), reloads, bytes moved each way per tier, demotions,
    drops by reason, checksum failures, each tier's size and link, and, for a
    `TimedTierStack`, the measured reload seconds next to what the links predict for the
    same blocks (each tier's blocks of a reload priced as one batch per reload call is not
    known here: the prediction prices every block apart, an upper bound)."""
    stats = stack.stats
    out: dict[str, Any] = {
        "hits_by_tier": stack.hits_by_tier(device_hits),
        "reloads": stats.reloads,
        "bytes_read": dict(stats.bytes_read),
        "bytes_written": dict(stats.bytes_written),
        "demotions": dict(stats.demotions),
        "drops": dict(stats.drops),
        "checksum_failures": stats.checksum_failures,
        "bytes_per_block": stack.bytes_per_block,
        "demote_rule": stack.demote_rule,
        "tiers": [{"name": t.name, "store": t.store.kind, "capacity_blocks": t.capacity_blocks,
                   "used_blocks": t.num_used, "profile": attrs.asdict(t.profile),
                   "reload_s_per_block": stack.reload_seconds(t.index),
                   "crossover_depth": stack.crossover_depth(t.index)}
                  for t in stack.tiers],
    }
    if isinstance(stack, TimedTierStack):
        out["reload_s_measured"] = stack.reload_seconds_measured
        out["reload_calls"] = stack.reload_batches
        out["takes"] = stack.takes
        out["restored_takes"] = stack.restored_takes
        out["reload_s_predicted_per_block"] = sum(
            stats.hit_blocks.get(t.name, 0) * stack.reload_seconds(t.index)
            for t in stack.tiers)
    return out


# -- measuring ------------------------------------------------------------------------------


@attrs.frozen
class LinkFit:
    """A link measured on this machine: the fitted `TierProfile` and the points it came from.

    ``points`` are ``(blocks, read seconds, write seconds)`` (medians); ``read_fit`` and
    ``write_fit`` the ``(latency, seconds per block)`` of the least-squares lines; ``cold``
    whether disk reads bypassed the page cache.
    """

    profile: TierProfile
    bytes_per_block: int
    points: tuple[tuple[int, float, float], ...]
    read_fit: tuple[float, float]
    write_fit: tuple[float, float]
    cold: bool | None

    def predicted_read_seconds(self, blocks: int) -> float:
        """The profile's price of reading ``blocks`` blocks in one batch."""
        return self.profile.transfer_seconds(self.bytes_per_block, blocks)

    def as_dict(self) -> dict[str, Any]:
        return {"profile": attrs.asdict(self.profile), "bytes_per_block": self.bytes_per_block,
                "points": [list(p) for p in self.points], "read_fit": list(self.read_fit),
                "write_fit": list(self.write_fit), "cold": self.cold}


def _line(xs: Sequence[int], ys: Sequence[float]) -> tuple[float, float]:
    """``y = a + b x`` with ``a, b >= 0`` minimising the *relative* error (each point divided
    by its measured value, as `kvevict.engine.calibrate` fits), so a one-block reload counts
    as much as a 32-block one; the best of the free fit, the fit through the origin and the
    flat one that keeps both coefficients >= 0."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    candidates = []
    coef, *_ = np.linalg.lstsq(np.stack([w, w * x], axis=1), np.ones_like(y), rcond=None)
    if coef[0] >= 0 and coef[1] > 0:
        candidates.append((float(coef[0]), float(coef[1])))
    candidates.append((0.0, float((w * x) @ np.ones_like(y) / ((w * x) @ (w * x)))))
    candidates.append((float(w @ np.ones_like(y) / (w @ w)), 1e-12))

    def miss(c: tuple[float, float]) -> float:
        return float(np.sum(((c[0] + c[1] * x) * w - 1.0) ** 2))

    return min(candidates, key=miss)


def _blocks_for(n: int, block_size: int) -> list[BlockInfo]:
    """``n`` chained block records (hashes, parents, tokens) for the store calls."""
    out, parent = [], ROOT_HASH
    for depth in range(n):
        tokens = np.arange(depth * block_size, (depth + 1) * block_size, dtype=np.int64)
        h = hash_block(parent, tokens, "kvevict-link-measurement")
        block = BlockInfo(depth, h, parent, depth, tokens, 0, "chat", None, 0.0, 0, None,
                          "prefill", "prompt", None)
        out.append(block)
        parent = h
    return out


def _drop_from_page_cache(path: Path) -> bool:
    """Flush ``path`` to the device and drop it from the page cache; False where the OS has
    no ``posix_fadvise``."""
    advise = getattr(os, "posix_fadvise", None)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if advise is None:
            return False
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def measure_link(kind: str, layout: KVLayout, block_size: int, *,
                 dtype: torch.dtype | None = None, directory: str | os.PathLike[str] | None = None,
                 block_counts: Sequence[int] = DEFAULT_BLOCK_COUNTS, repeats: int = 5,
                 cold: bool = True, name: str | None = None,
                 timer: Callable[[], float] = time.perf_counter) -> LinkFit:
    """Fit a `TierProfile` for a ``"host"`` or ``"disk"`` tier to this machine (see the
    module docstring).

    The pool and the host tensor are CPU tensors of ``layout`` (``dtype``: the layout's); a
    disk link writes its files under ``directory`` (default: a temporary directory, removed
    afterwards). Reads are timed as `TierStack` reloads them: a host block is read and
    copied into a pool block; a disk block's file is read, its checksum checked, then
    copied. Writes as it demotes them: a pool block copied into the store.
    """
    if kind not in ("host", "disk"):
        raise ConfigError(f"kind must be 'host' or 'disk', got {kind!r}")
    counts = sorted(set(block_counts))
    if len(counts) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                              for n in counts):
        raise ConfigError(f"block_counts must hold at least two distinct ints >= 1, got "
                          f"{list(block_counts)!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an int >= 1, got {repeats!r}")
    dtype = dtype or layout.dtype
    most = counts[-1]
    pool = BlockPool(2 * most, block_size, layout, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))  # type: ignore
    blocks = _blocks_for(most, block_size)
    nbytes = pool.bytes_per_block
    tmp = None
    if kind == "host":
        store: Any = HostStore(pin_memory=False)
    else:
        if directory is None:
            tmp = tempfile.TemporaryDirectory(prefix="kvevict-link-")
            directory = tmp.name
        store = DiskStore(Path(directory) / "link-measurement")
    store.bind(most, layout, dtype, block_size, "link-measurement")
    dropped: bool | None = None
    points = []
    try:
        for n in counts:
            reads, writes = [], []
            for r in range(repeats + 1):
                t0 = timer()
                for i in range(n):
                    store.write(i, blocks[i], pool.kv[:, :, i])  # type: ignore[index]
                t1 = timer()
                if kind == "disk" and cold:
                    dropped = all(_drop_from_page_cache(store.path_of(b.block_hash))
                                  for b in blocks[:n])
                t2 = timer()
                for i in range(n):
                    data = store.read(i, blocks[i])
                    if data is None:
                        raise ConfigError(f"the {kind} link measurement read back a block "
                                          "that failed its checksum; the directory is not "
                                          "usable")
                    pool.kv[:, :, most + i].copy_(data)  # type: ignore[index]
                t3 = timer()
                if r:  # the first round warms up
                    writes.append(t1 - t0)
                    reads.append(t3 - t2)
            if not torch.equal(pool.kv[:, :, most:most + n], pool.kv[:, :, :n]):  # type: ignore
                raise ConfigError(f"the {kind} link did not give back the bytes written")
            points.append((n, statistics.median(reads), statistics.median(writes)))
    finally:
        if kind == "disk":
            for b in blocks:
                store.discard(b.block_hash)
        if tmp is not None:
            tmp.cleanup()
    read = _line([p[0] for p in points], [p[1] for p in points])
    write = _line([p[0] for p in points], [p[2] for p in points])
    label = name or f"{kind}-measured"
    where = "page cache bypassed (fsync + POSIX_FADV_DONTNEED)" if dropped else (
        "reads served by the page cache" if kind == "disk" else "CPU tensor to CPU tensor")
    profile = TierProfile(label, nbytes / read[1], nbytes / write[1], read[0], real=True,
                          source=f"measured on this machine by kvevict.engine.tiers."
                                 f"measure_link ({kind}, {where}; {nbytes:,}-byte blocks, "
                                 f"{', '.join(map(str, counts))} blocks per batch, median "
                                 f"of {repeats})")
    return LinkFit(profile, nbytes, tuple(points), read, write,
                   None if kind == "host" else bool(dropped))


def measure_recompute(model: LlamaModel, block_size: int,
                      depths: Sequence[int] = DEFAULT_DEPTHS, *, repeats: int = 5,
                      timer: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Seconds to recompute one block at each depth on ``model``: ``forward_paged`` of
    ``block_size`` new tokens after ``depth * block_size`` cached ones (median of
    ``repeats`` after a warm-up; the cached K/V are whatever the pool holds, which does not
    change the timing)."""
    if not isinstance(model, LlamaModel):
        raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
    depths = sorted(set(depths))
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                         for d in depths):
        raise ConfigError(f"depths must be ints >= 0, got {list(depths)!r}")
    pool = BlockPool(depths[-1] + 1, block_size, model.config.layout(), device=model.device)
    table = [pool.allocate() for _ in range(pool.num_blocks)]
    vocab = model.config.vocab_size
    cuda = model.device.type == "cuda"
    out = {}
    for d in depths:
        ids = torch.arange(d * block_size, (d + 1) * block_size, device=model.device) % vocab
        times = []
        for r in range(repeats + 1):
            t0 = timer()
            model.forward_paged(pool, [(ids, d * block_size, table[:d + 1])])
            if cuda:
                torch.cuda.synchronize(model.device)
            if r:
                times.append(timer() - t0)
        out[d] = statistics.median(times)
    return out


def crossover_table(recompute: dict[int, float], links: dict[str, LinkFit],
                    cost: CostModel, block_size: int) -> dict[str, Any]:
    """Per depth: measured recompute and per-block reload from each link (one block per
    batch, as the demotion rule prices it) next to the cost model's and the profiles'
    predictions, with the crossover depths.

    Returns ``{"rows": [...], "crossover": {tier: {"measured", "predicted"}}}``; a
    crossover is the shallowest measured depth from which reloading is faster than
    recomputing at every deeper measured depth (None: at none of them), ``predicted`` the
    same depth by the cost model and the profile (a `TierStack.crossover_depth`-style
    search over all depths, not only the measured ones).
    """
    rows = []
    for d, measured in sorted(recompute.items()):
        row: dict[str, Any] = {"depth": d, "recompute_s": measured,
                               "recompute_predicted_s": cost.recompute_seconds(d, block_size)}
        for name, fit in links.items():
            one = next((p for p in fit.points if p[0] == 1), None)
            row[f"{name}_reload_s"] = None if one is None else one[1]
            row[f"{name}_reload_predicted_s"] = fit.predicted_read_seconds(1)
        rows.append(row)
    crossover = {}
    for name, fit in links.items():
        measured_at = None
        for row in reversed(rows):
            reload = row[f"{name}_reload_s"]
            if reload is None or reload >= row["recompute_s"]:
                break
            measured_at = row["depth"]
        reload = fit.predicted_read_seconds(1)
        predicted = None
        lo, hi = 0, 1 << 20
        if cost.recompute_seconds(hi, block_size) > reload:
            while lo < hi:
                mid = (lo + hi) // 2
                if cost.recompute_seconds(mid, block_size) > reload:
                    hi = mid
                else:
                    lo = mid + 1
            predicted = lo
        crossover[name] = {"measured": measured_at, "predicted": predicted}
    return {"rows": rows, "crossover": crossover}
