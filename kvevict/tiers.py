"""Memory tiers below the pool: evicting a block demotes it, a hit below the pool reloads it.

A `TierStack` is the lower half of a cache hierarchy whose top (tier 0) is the manager's
`BlockPool` on its torch device. Tier ``k >= 1`` is a `Tier`: a capacity in blocks, a link to
the tier above it (read and write bandwidth, a latency; a `TierProfile`), its own residency
policy (any registered one, by name or instance) and a store for the KV bytes:

- ``"host"``: one CPU tensor shaped like the pool's (pinned when CUDA is present);
- a `DiskStore`: one file per block under a directory, each with a BLAKE2b checksum, and a
  manifest naming the model and layout it was written for;
- ``"metadata"``: no bytes at all, for trace-scale simulation (the default).

Every block lives in exactly one tier (exclusive tiers, as SGLang HiCache's ``write_back``
policy and vLLM's CPU offloading keep one copy per medium; kvevict moves the record, so a
block keeps its access history on the way down and back up).

**Demotion** (`demote`, called by the manager's eviction loop once per burst, with the
blocks it evicted from the pool in order): a block leaving tier ``k`` goes to tier ``k + 1``
when reloading it from there is faster than recomputing it, and is dropped otherwise, or
when there is no tier ``k + 1``::

    reload_seconds(k + 1) = sum over the hops up to the device of (latency + nbytes / read_bw)
    recompute_seconds     = CostModel.recompute_seconds(depth, block_size)

This is the rule of InferCept (Abhyankar et al., ICML'24: per intercepted request,
swap when the transfer costs less than the recomputation, which grows with the context) and
of CachedAttention (Gao et al., USENIX ATC'24: saving to host and disk happens
asynchronously and off the critical path, so only the reload is charged). Recomputation grows
with depth and a reload does not, so shallow blocks are dropped and deep ones kept. A block
whose descendants live in lower tiers is demoted regardless of its own cost (dropping it
would make them unreachable) unless it cannot be placed; then it is dropped together with
them. ``demote="always"`` turns the cost rule off (every block goes down while there is
room). A full tier first makes room by demoting its own policy's victim one tier further.

**Promotion** (`match`, `hold` then `load`, called by the manager's ``begin`` /
``resume``): the part of a request's chain right after its hit in the pool that lives in
lower tiers is matched (no side effects), held once the request is known to fit (so that the
evictions made for it cannot drop it; nothing is read yet), then loaded: each block's bytes
are read (a disk block's file, its checksum checked), copied into a pool block, and the
block becomes cached there: a reload, counted by tier. A disk block whose checksum fails at
load is a miss with a logged warning, dropped with its descendants (the rest of the chain),
and the reload ends before it. A request that does not fit, or that admission defers, reads
nothing, however often it is retried.

**Prefix closure across tiers.** A block's parent lives in the same tier or one above it
(the pool above all), so a chain reads down the tiers from the device and a block is
reachable only if its whole prefix is. A tier evicts only its own leaves (blocks with no
child in that tier), so this holds after every move; `kvevict.invariants` checks it.

Policies across tiers: `TierStack.policy_cost_model` is the `CostModel` a value-aware policy
(``market``, ``bayes``, ``gdsf``, ``dbms``) gets for tier ``k``; its ``recompute_seconds``
answers what losing the block from that tier costs on its next use (a reload from the tier
it would go to, or a recompute), less what the reload from where it is costs already.
`TIER_PROFILES` holds seed 004's six tiers with their published figures (``docs/tiers.md``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import operator
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch

from kvevict.cost import CostModel
from kvevict.errors import ConfigError, PolicyError
from kvevict.hashing import ROOT_HASH
from kvevict.layout import KVLayout
from kvevict.policies.base import Policy, make_policy, pop_victim_of
from kvevict.types import BlockInfo

if TYPE_CHECKING:
    from kvevict.pool import BlockPool

__all__ = [
    "DEMOTE_RULES",
    "TIER_PROFILES",
    "DiskStore",
    "HostStore",
    "MetadataStore",
    "Tier",
    "TierPricedCost",
    "TierProfile",
    "TierStack",
    "TierStats",
    "tier_profile",
]

logger = logging.getLogger("kvevict.tiers")

#: How `TierStack` decides whether an evicted block goes down: ``"cost"`` (reload faster
#: than recompute, the default) or ``"always"`` (whenever there is room).
DEMOTE_RULES = ("cost", "always")

_GB = 1e9
_HASH_OF = operator.attrgetter("block_hash")


def _rate(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _latency(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ConfigError(f"{attribute.name} must be a finite number of seconds >= 0, got "
                          f"{value!r}")


def _text(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{attribute.name} must be a non-empty string, got {value!r}")


@attrs.frozen
class TierProfile:
    """The link from one memory tier to the tier above it, from published figures.

    Attributes:
        name: the profile's key in `TIER_PROFILES`.
        read_bytes_per_s: bandwidth of a reload from this tier to the tier above.
        write_bytes_per_s: bandwidth of a demotion into this tier.
        latency_s: fixed seconds per transfer (the medium's access latency).
        direct: the link goes straight to the device (GPUDirect Storage, GPUDirect RDMA): a
            reload skips the tiers between; otherwise it crosses each tier above in turn.
        real: whether kvevict moves real bytes through such a tier (device, host, disk) or
            only prices it (the others are simulated).
        source: where the figures come from.
    """

    name: str = attrs.field(validator=_text)
    read_bytes_per_s: float = attrs.field(validator=_rate)
    write_bytes_per_s: float = attrs.field(validator=_rate)
    latency_s: float = attrs.field(validator=_latency)
    direct: bool = False
    real: bool = False
    source: str = ""

    def transfer_seconds(self, nbytes: int, blocks: int = 1, write: bool = False) -> float:
        """Seconds to move ``blocks`` blocks of ``nbytes`` each over this link in one batch
        (one latency, the bytes at the link's bandwidth)."""
        if blocks <= 0:
            return 0.0
        rate = self.write_bytes_per_s if write else self.read_bytes_per_s
        return self.latency_s + blocks * nbytes / rate


#: Seed 004's six tiers (``docs/tiers.md`` has the table with every source). ``hbm`` is the
#: pool itself (tier 0); the others are links to the tier above.
TIER_PROFILES: dict[str, TierProfile] = {p.name: p for p in (
    TierProfile("hbm", 3.35e12, 3.35e12, 0.0, real=True,
                source="NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3"),
    TierProfile("host-pcie5", 64 * _GB, 64 * _GB, 10e-6, real=True,
                source="PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b, ~64 GB/s per direction "
                       "(PCI-SIG); ~10 us per cudaMemcpyAsync call"),
    TierProfile("host-c2c", 450 * _GB, 450 * _GB, 2e-6, real=True,
                source="NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s bidirectional, 450 GB/s "
                       "per direction"),
    TierProfile("cxl", 36 * _GB, 36 * _GB, 0.25e-6,
                source="Micron CZ120 CXL memory module: up to 36 GB/s; Sun et al., MICRO'23: "
                       "CXL load latency ~250 ns"),
    TierProfile("nvme", 14 * _GB, 7 * _GB, 80e-6, real=True,
                source="PCIe 5.0 NVMe SSD (Kioxia CM7-R datasheet: 14 GB/s sequential read, "
                       "6.75 GB/s write); ~80 us read latency; staged through host memory"),
    TierProfile("nvme-gds", 14 * _GB, 7 * _GB, 30e-6, direct=True,
                source="the same SSD read by NVIDIA GPUDirect Storage (cuFile) straight into "
                       "HBM: no host bounce buffer"),
    TierProfile("rdma", 50 * _GB, 50 * _GB, 3e-6, direct=True,
                source="400 Gb/s NIC (NVIDIA ConnectX-7 datasheet) = 50 GB/s; GPUDirect "
                       "RDMA into HBM as Mooncake's Transfer Engine does"),
    TierProfile("pfs", 40 * 2 ** 30, 10 * 2 ** 30, 1e-3,
                source="DeepSeek 3FS README: KVCache reads peak at 40 GiB/s per client node; "
                       "~1 ms per file open and read (estimate)"),
)}


def tier_profile(name: str | TierProfile) -> TierProfile:
    """A `TierProfile` by name (`TIER_PROFILES`), or the profile given."""
    if isinstance(name, TierProfile):
        return name
    profile = TIER_PROFILES.get(name) if isinstance(name, str) else None
    if profile is None:
        raise ConfigError(f"unknown tier profile {name!r}; known: {', '.join(TIER_PROFILES)}")
    return profile


@attrs.define
class TierStats:
    """Counters of a `TierStack` since it was built, by tier name (``"device"`` for the pool).

    A reloaded block also counts in the manager's ``block_hits`` and ``prefix_cache_hits``
    (its prefill is skipped); ``hit_blocks`` says which lower tier served it.
    """

    hit_blocks: dict[str, int] = attrs.field(factory=dict)  #: blocks reloaded from each tier
    bytes_read: dict[str, int] = attrs.field(factory=dict)  #: bytes reloaded from each tier
    bytes_written: dict[str, int] = attrs.field(factory=dict)  #: bytes demoted into each tier
    demotions: dict[str, int] = attrs.field(factory=dict)  #: blocks demoted into each tier
    reloads: int = 0  #: blocks promoted into the pool, all tiers
    drops: dict[str, int] = attrs.field(factory=dict)  #: dropped blocks by reason (below)
    checksum_failures: int = 0  #: disk blocks whose checksum did not match (never served)

    #: Why a block was dropped: ``cost`` (cheaper to recompute), ``last_tier`` (nowhere
    #: lower), ``back_pressure`` (the tier below could not take it: full of held blocks, a
    #: full disk, an unwritable directory), ``cascade`` (its parent was dropped),
    #: ``corrupt`` (a checksum failure), ``superseded`` (recomputed in the pool meanwhile).
    DROP_REASONS = ("cost", "last_tier", "back_pressure", "cascade", "corrupt", "superseded")

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class TierPricedCost(CostModel):
    """The `CostModel` a policy of tier ``k`` prices blocks with: its ``recompute_seconds``
    is the cost of *losing* the block from tier ``k`` on its next use, not of recomputing it.

    ``min(recompute, loss_reload_s) - kept_reload_s`` (at least 0): evicting the block sends
    it to the tier below, from which a reload costs ``loss_reload_s`` (`math.inf` when there
    is none), or drops it, then a recompute; keeping it costs ``kept_reload_s`` already (0 in
    the pool). Every other method is the base model's.
    """

    loss_reload_s: float = math.inf
    kept_reload_s: float = 0.0

    def recompute_seconds(self, depth: int, block_size: int) -> float:
        recompute = self.prefill_seconds(block_size, depth * block_size)
        return max(min(recompute, self.loss_reload_s) - self.kept_reload_s, 0.0)


# -- stores ---------------------------------------------------------------------------------


class MetadataStore:
    """No bytes: a tier that only keeps records (trace-scale simulation)."""

    kind = "metadata"
    holds_data = False

    def bind(self, capacity: int, layout: KVLayout | None, dtype: torch.dtype | None,
             block_size: int, model: str) -> None:
        """Nothing to allocate."""

    def write(self, slot: int, block: BlockInfo, data: torch.Tensor | None) -> bool:
        return True

    def read(self, slot: int, block: BlockInfo) -> torch.Tensor | None:
        return None

    def free(self, slot: int, block: BlockInfo) -> None:
        """Nothing to release."""

    def recover(self) -> list[tuple[dict[str, Any], int]]:
        return []

    def __repr__(self) -> str:
        return "MetadataStore()"


class HostStore:
    """One CPU tensor holding ``capacity`` blocks in the pool's layout, pinned (page-locked)
    when CUDA is present so that copies to and from the device are DMA transfers."""

    kind = "host"
    holds_data = True

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = pin_memory
        self.kv: torch.Tensor | None = None

    def bind(self, capacity: int, layout: KVLayout | None, dtype: torch.dtype | None,
             block_size: int, model: str) -> None:
        if layout is None or dtype is None:
            raise ConfigError("a host store needs a pool with a KV tensor (a layout and "
                              "storage=True); use store='metadata' for a metadata-only pool")
        pin = torch.cuda.is_available() if self.pin_memory is None else bool(self.pin_memory)
        self.kv = torch.zeros(layout.tensor_shape(capacity, block_size), dtype=dtype,
                              device="cpu", pin_memory=pin)

    def write(self, slot: int, block: BlockInfo, data: torch.Tensor | None) -> bool:
        self.kv[:, :, slot].copy_(data)  # type: ignore[index]
        return True

    def read(self, slot: int, block: BlockInfo) -> torch.Tensor | None:
        return self.kv[:, :, slot]  # type: ignore[index]

    def free(self, slot: int, block: BlockInfo) -> None:
        """The slot is reused by the next write."""

    def recover(self) -> list[tuple[dict[str, Any], int]]:
        return []

    def __repr__(self) -> str:
        pinned = self.kv is not None and self.kv.is_pinned()
        return f"HostStore(pinned={pinned})"


_MAGIC = b"KVEVBLK1"
_DIGEST = 16
MANIFEST = "manifest.json"
_FORMAT = "kvevict-disk-tier"


def _hash_json(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"a disk tier stores blocks whose hash is an int or a str, got "
                        f"{type(value).__name__}")
    return value


class DiskStore:
    """One file per block under ``directory``, each with a checksum, and a manifest.

    A block file is ``MAGIC | u32 header length | JSON header | KV bytes | BLAKE2b-128 of all
    that``; the header holds the block's hash, parent hash, depth, tokens and shape, so a new
    process reopening the directory recovers its blocks (`recover`). It is written to a
    temporary file and renamed into place, so a crash leaves the old file or the new one. A
    file that is truncated or has a flipped byte fails its checksum on read: the block is a
    miss (logged, counted), never served. A failed write (a full disk, an unwritable
    directory) is back-pressure: the block is dropped, not the process.

    ``manifest.json`` records the model and the layout (dtype, block size, shape); opening a
    directory written for another model or layout raises `ConfigError` naming both.
    """

    kind = "disk"
    holds_data = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.shape: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.identity: dict[str, Any] | None = None

    @staticmethod
    def identity_of(layout: KVLayout, dtype: torch.dtype, block_size: int,
                    model: str) -> dict[str, Any]:
        """What a directory must match: the model and the layout of its blocks."""
        return {"model": model, "attention": layout.attention, "num_layers": layout.num_layers,
                "kv_planes": layout.kv_planes, "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim, "dtype": str(dtype).removeprefix("torch."),
                "block_size": block_size}

    def bind(self, capacity: int, layout: KVLayout | None, dtype: torch.dtype | None,
             block_size: int, model: str) -> None:
        if layout is None or dtype is None:
            raise ConfigError("a disk store needs a pool with a KV tensor (a layout and "
                              "storage=True); use store='metadata' for a metadata-only pool")
        identity = self.identity_of(layout, dtype, block_size, model)
        path = self.directory / MANIFEST
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the disk tier directory {self.directory}: "
                              f"{exc}") from None
        if path.exists():
            try:
                found = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read the disk tier manifest {path}: {exc}") from None
            if not isinstance(found, dict) or found.get("format") != _FORMAT:
                raise ConfigError(f"{path} is not a kvevict disk tier manifest")
            written = found.get("identity")
            if written != identity:
                raise ConfigError(
                    f"the disk tier directory {self.directory} was written for "
                    f"{_describe_identity(written)}; this cache is "
                    f"{_describe_identity(identity)}. Use another directory (or delete "
                    "this one)")
        else:
            try:
                _atomic_write(path, json.dumps({"format": _FORMAT, "version": 1,
                                                "identity": identity}, indent=2).encode())
            except OSError as exc:
                logger.warning("cannot write the disk tier manifest %s: %s; blocks written "
                               "here will not be recovered by another process", path, exc)
        self.identity = identity
        self.dtype = dtype
        self.shape = tuple(layout.tensor_shape(1, block_size)[:2]) + tuple(
            layout.tensor_shape(1, block_size)[3:])

    def path_of(self, block_hash: Any) -> Path:
        """The file of the block with this hash."""
        key = hashlib.blake2b(json.dumps(_hash_json(block_hash)).encode(),
                              digest_size=16).hexdigest()
        return self.directory / f"{key}.kvblock"

    def write(self, slot: int, block: BlockInfo, data: torch.Tensor | None) -> bool:
        try:
            header = json.dumps({
                "hash": _hash_json(block.block_hash), "parent": _hash_json(block.parent_hash),
                "depth": block.depth,
                "tokens": None if block.tokens is None else [int(t) for t in block.tokens],
                "class": block.workload_class, "kind": block.kind,
                "created_by": block.created_by,
            }).encode()
        except TypeError as exc:
            logger.warning("disk tier: block %s not written: %s", block.block_id, exc)
            return False
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()  # type: ignore
        body = _MAGIC + struct.pack("<I", len(header)) + header + payload
        digest = hashlib.blake2b(body, digest_size=_DIGEST).digest()
        path = self.path_of(block.block_hash)
        try:
            _atomic_write(path, body + digest)
        except OSError as exc:
            logger.warning("disk tier: block %s not written to %s (%s): dropped",
                           block.block_id, path, exc.strerror or exc)
            return False
        return True

    def _parse(self, raw: bytes, path: Path) -> tuple[dict[str, Any], bytes] | None:
        if len(raw) < len(_MAGIC) + 4 + _DIGEST or not raw.startswith(_MAGIC):
            return None
        body, digest = raw[:-_DIGEST], raw[-_DIGEST:]
        if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
            return None
        (n,) = struct.unpack_from("<I", body, len(_MAGIC))
        start = len(_MAGIC) + 4
        try:
            header = json.loads(body[start:start + n])
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return header, body[start + n:]

    def read(self, slot: int, block: BlockInfo) -> torch.Tensor | None:
        path = self.path_of(block.block_hash)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            logger.warning("disk tier: cannot read block %s from %s: %s", block.block_id,
                           path, exc)
            return None
        parsed = self._parse(raw, path)
        expected = math.prod(self.shape) * self.dtype.itemsize  # type: ignore[arg-type,union-attr]
        if parsed is None or parsed[0].get("hash") != block.block_hash or \
                len(parsed[1]) != expected:
            logger.warning("disk tier: block file %s failed its checksum (torn or corrupted):"
                           " treated as a miss", path)
            return None
        data = torch.frombuffer(bytearray(parsed[1]), dtype=torch.uint8)
        return data.view(self.dtype).reshape(self.shape)  # type: ignore[arg-type]

    def free(self, slot: int, block: BlockInfo) -> None:
        self.discard(block.block_hash)

    def discard(self, block_hash: Any) -> None:
        """Remove the file of the block with this hash, if any."""
        try:
            self.path_of(block_hash).unlink(missing_ok=True)
        except (OSError, TypeError):
            pass

    def recover(self) -> list[tuple[dict[str, Any], int]]:
        """Headers of the intact block files in the directory, with their sizes; a file that
        fails its checksum is logged and removed."""
        out = []
        expected = math.prod(self.shape) * self.dtype.itemsize  # type: ignore[arg-type,union-attr]
        for path in sorted(self.directory.glob("*.kvblock")):
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            parsed = self._parse(raw, path)
            if parsed is None or len(parsed[1]) != expected or \
                    path != self.path_of(parsed[0].get("hash")):
                logger.warning("disk tier: block file %s failed its checksum (torn or "
                               "corrupted): removed", path)
                path.unlink(missing_ok=True)
                continue
            out.append((parsed[0], len(raw)))
        return out

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r})"


def _describe_identity(identity: Any) -> str:
    if not isinstance(identity, dict):
        return repr(identity)
    return (f"model {identity.get('model')!r} with layout {identity.get('attention')} "
            f"{identity.get('num_layers')} layers x {identity.get('kv_planes')} planes x "
            f"{identity.get('num_kv_heads')} heads x {identity.get('head_dim')}, "
            f"{identity.get('dtype')}, block_size {identity.get('block_size')}")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def _make_store(store: Any) -> Any:
    if store is None or store == "metadata":
        return MetadataStore()
    if store == "host":
        return HostStore()
    if isinstance(store, (str, os.PathLike)) and store not in ("host", "metadata"):
        return DiskStore(store)
    if isinstance(store, (MetadataStore, HostStore, DiskStore)):
        return store
    raise ConfigError(f"store must be 'metadata', 'host', a directory (disk) or a store, got "
                      f"{store!r}")


# -- the lower-tier index ----------------------------------------------------------------------


class BlockIndex:
    """Every lower-tier block of one `TierStack`, by hash and by parent hash.

    The stack owns it and reads it (a lookup, a block's children below the pool); its tiers
    keep it, each entering a block in the same step as it takes the block into a slot and
    taking it out as it frees the slot, so a move costs no separate indexing pass.

    ``blocks`` maps a hash to its record. ``children`` maps a parent hash to the records of
    its children below the pool: the child's record itself while it has one (the common
    case: a chain), a dict of them by hash (in the order they were placed) once a second
    child joins; a tier taking a child out deletes the entry once no child is left. Read
    children with `children_of`.
    """

    __slots__ = ("blocks", "children")

    def __init__(self) -> None:
        self.blocks: dict[Any, BlockInfo] = {}
        self.children: dict[Any, Any] = {}

    def add(self, block: BlockInfo) -> None:
        """Enter ``block`` (just placed in a tier): one dict operation per index when it is
        its parent's only child below."""
        h = block.block_hash
        self.blocks[h] = block
        if block.depth > 0:
            kids = self.children.setdefault(block.parent_hash, block)
            if kids is not block:  # a second child
                if kids.__class__ is dict:
                    kids[h] = block
                else:
                    self.children[block.parent_hash] = {kids.block_hash: kids, h: block}

    def remove(self, block: BlockInfo) -> None:
        """Take ``block`` out (`add` undone): its hash, its entry among its parent's children
        (the entry goes once no child is left)."""
        h = block.block_hash
        del self.blocks[h]
        if block.depth > 0:
            up = block.parent_hash
            kids = self.children.pop(up, None)
            if kids is not block and kids is not None:  # siblings: put the rest back
                if kids.__class__ is dict:
                    kids.pop(h, None)
                if kids:
                    self.children[up] = kids

    def children_of(self, block_hash: Any) -> list[BlockInfo]:
        """The lower-tier children of the block with this hash, in the order they were
        placed."""
        kids = self.children.get(block_hash)
        if kids is None:
            return []
        return list(kids.values()) if kids.__class__ is dict else [kids]


# -- one tier -------------------------------------------------------------------------------


class Tier:
    """One memory tier below the pool.

    Args:
        capacity_blocks: blocks the tier holds (> 0).
        profile: its link to the tier above: a `TierProfile` or a name in `TIER_PROFILES`
            (default ``"host-pcie5"``).
        policy: its residency policy, a registered name or a fresh `Policy` instance
            (default ``"lru"``, LMCache's and HiCache's default).
        store: ``"metadata"`` (no bytes; the default), ``"host"`` (a CPU tensor), a
            directory path (a `DiskStore`) or a store instance.
        name: the tier's name in stats and records' ``tier`` (default: the profile's name,
            ``"disk"`` for a disk store).
        policy_params: parameters of a policy given by name.

    Read its ``records`` (slot -> `BlockInfo`), ``candidates`` and ``held`` (live read-only
    views); only the `TierStack` changes them. Every change also keeps the stack's
    `BlockIndex` (`join`): a block enters it as it takes a slot and leaves it as it frees one.
    """

    def __init__(self, capacity_blocks: int, profile: TierProfile | str = "host-pcie5", *,
                 policy: Policy | str = "lru", store: Any = None, name: str | None = None,
                 **policy_params: Any) -> None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or \
                capacity_blocks <= 0:
            raise ConfigError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
        self.capacity_blocks = capacity_blocks
        self.profile = tier_profile(profile)
        self.store = _make_store(store)
        if name is None:
            name = "disk" if isinstance(self.store, DiskStore) else self.profile.name
        if not isinstance(name, str) or not name or name == "device":
            raise ConfigError(f"a tier's name must be a non-empty string other than 'device', "
                              f"got {name!r}")
        self.name = name
        self.policy_spec = policy
        self.policy_params = dict(policy_params)
        self.policy: Policy | None = None
        self._pop: Any = None  # the policy's pop_victim, when it agrees with victim
        self._on_candidate: Any = None
        self._on_insert: Any = None
        self._frees = False
        self.index = 0  #: its position in the stack (1 = right below the pool), set by it
        self._records: dict[int, BlockInfo] = {}
        self.records: Mapping[int, BlockInfo] = _view(self._records)
        self._candidates: dict[int, BlockInfo] = {}
        self.candidates: Mapping[int, BlockInfo] = _view(self._candidates)
        self._held: dict[int, BlockInfo] = {}
        self.held: Mapping[int, BlockInfo] = _view(self._held)
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self._lookup = BlockIndex()  # its stack's (`join`); its own until then

    def join(self, index: BlockIndex) -> None:
        """Keep ``index`` (its stack's) as it takes blocks in and lets them go."""
        self._lookup = index

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots holding a block (held ones included)."""
        return self.capacity_blocks - len(self._free)

    def free_slots(self) -> list[int]:
        """The free slots (a copy)."""
        return list(self._free)

    @property
    def next_slot(self) -> int:
        """The slot `add` fills next (the tier must have a free one)."""
        return self._free[-1]

    def is_held(self, block: BlockInfo) -> bool:
        """Whether ``block`` (in this tier) is held for a reload."""
        return block.block_id in self._held

    # -- changes (the stack's; each keeps the candidate set and tells the policy) ---------

    def add(self, block: BlockInfo, now: float) -> int:
        """Put ``block`` (its ``num_children`` already this tier's count) in a free slot; it
        is a candidate when it has no child here. Returns the slot (its new ``block_id``)."""
        slot = self._free.pop()
        block.block_id = slot
        block.tier = self.name
        block.ref_count = 0
        self._records[slot] = block
        if self._on_insert is not None:
            self._on_insert(block, now)
        if not block.num_children:
            self._candidates[slot] = block
            self._on_candidate(block, now)
        self._lookup.add(block)
        return slot

    def remove(self, block: BlockInfo, now: float) -> None:
        """Take ``block`` out of this tier and the stack's index: free its slot and its
        store's copy, tell the policy (``on_evict``), and make its parent a candidate when it
        was its last child here."""
        if not self._release((block,), 0, 1, now, True):
            raise ConfigError(f"block {block.block_id} is not in tier {self.name!r}")

    def remove_run(self, blocks: Sequence[BlockInfo], start: int, stop: int,
                   now: float) -> int:
        """`remove` ``blocks[start:stop]`` in order, up to the first one whose record names
        another tier; return where it stopped (``stop`` when it took out every one). A
        reload's chain lies in one tier, then in the next, ... (prefix closure): one call
        per tier takes its part out."""
        return self._release(blocks, start, stop, now, True)

    def peek_victim(self, now: float) -> BlockInfo | None:
        """The candidate the policy would evict (nothing changes), or None."""
        if not self._candidates:
            return None
        victim_id = self.policy.victim(now)  # type: ignore[union-attr]
        block = self._candidates.get(victim_id)
        if block is None:
            raise PolicyError(f"{self.policy!r}.victim() in tier {self.name!r} returned "
                              f"{victim_id!r}, which is not one of its candidates",
                              policy=self.policy, event="victim", block_id=victim_id)
        return block

    def pop_victim(self, now: float) -> BlockInfo | None:
        """Take out the candidate the policy names (as `remove` would), or None when there
        is none."""
        block = self._take_victim(now)
        if block is not None:
            self._release((block,), 0, 1, now, False)
        return block

    def _take_victim(self, now: float) -> BlockInfo | None:
        """The candidate the policy names, out of the candidates (its ``on_evict`` sent), or
        None when there is none; a name that is not a candidate is a `PolicyError`."""
        candidates = self._candidates
        if not candidates:
            return None
        pop = self._pop
        victim_id = pop(now) if pop is not None else \
            self.policy.victim(now)  # type: ignore[union-attr]
        block = candidates.pop(victim_id, None)
        if block is None:
            raise PolicyError(f"{self.policy!r}.victim() in tier {self.name!r} returned "
                              f"{victim_id!r}, which is not one of its candidates",
                              policy=self.policy, event="victim", block_id=victim_id)
        if pop is None:
            self.policy.on_evict(block, now)  # type: ignore[union-attr]
        return block

    def take_in(self, blocks: Sequence[BlockInfo], start: int, now: float,
                worth: Mapping[int, bool] | None) -> tuple[int, int, int, int]:
        """Place ``blocks[start:]`` here, in order, in one loop: each into a free slot as
        `add` would, or, the tier being full, into the slot of the policy's victim, which
        leaves for good (as `pop_victim` then `add`: a tier with no tier below it, whose
        victims are gone, and no bytes to write).

        Each block is out of every tier, its ``parent`` up to date. A block with children
        below the pool counts those (all in this tier: nothing is below it); one with none
        is left out (``tier = "dropped"``) when ``worth`` (by depth; None: keep every
        block) maps its depth to False. When the tier is full and its policy has no
        candidate (every block held), the loop stops before that block.

        Returns where it stopped (``len(blocks)`` when it placed or left out every block),
        and how many blocks it placed, victims it let go and blocks it left out."""
        lookup = self._lookup
        children, index, unindex = lookup.children, lookup.add, lookup.remove
        records, candidates, held, free = self._records, self._candidates, self._held, \
            self._free
        pop, policy, on_candidate, on_insert = self._pop, self.policy, self._on_candidate, \
            self._on_insert
        frees, name = self._frees, self.name
        added = dropped = 0
        end = len(blocks)
        for i in range(start, end):
            block = blocks[i]
            h = block.block_hash
            kids = children.get(h)
            if kids is None:
                if worth is not None and not worth[block.depth]:
                    block.tier = "dropped"  # cheaper to recompute, nothing below needs it
                    dropped += 1
                    continue
                block.num_children = 0
            else:
                block.num_children = len(kids) if kids.__class__ is dict else 1
            if free:  # a free slot (`add`, inline)
                slot = free.pop()
                victim = None
                added += 1
            elif not candidates:  # full, and nothing to let go
                end = i
                break
            else:  # the policy's victim leaves (`_take_victim`, `_release`, inline)
                slot = pop(now) if pop is not None else policy.victim(now)  # type: ignore
                victim = candidates.pop(slot, None)
                if victim is None:
                    raise PolicyError(f"{policy!r}.victim() in tier {name!r} returned "
                                      f"{slot!r}, which is not one of its candidates",
                                      policy=policy, event="victim", block_id=slot)
                if pop is None:
                    policy.on_evict(victim, now)  # type: ignore[union-attr]
                if frees:
                    self.store.free(slot, victim)
                del records[slot]  # (the slot goes to the end of the table, as add puts it)
                parent = victim.parent
                if parent is block:
                    block.num_children -= 1
                elif parent is not None and parent.tier == name:  # (then in ``records``:
                    n = parent.num_children - 1  # a record leaving a tier says "dropped")
                    parent.num_children = n
                    if not n and (not held or parent.block_id not in held):
                        candidates[parent.block_id] = parent
                        on_candidate(parent, now)
                victim.tier = "dropped"
            # ``block`` takes the slot (as `add`)
            block.block_id = slot
            block.tier = name
            block.ref_count = 0
            records[slot] = block
            if on_insert is not None:
                on_insert(block, now)
            if not block.num_children:
                candidates[slot] = block
                on_candidate(block, now)
            # the stack's index: the victim out, the block in
            if victim is not None:
                unindex(victim)
            index(block)
        placed = end - start - dropped
        return end, placed, placed - added, dropped

    def _release(self, blocks: Sequence[BlockInfo], start: int, stop: int, now: float,
                 evict: bool) -> int:
        """Let ``blocks[start:stop]`` go, in order: free each one's slot and its store's copy,
        make its parent a candidate when it was its last child here, and take it out of the
        stack's index. ``evict``: each is first checked to be here (the loop stops at one
        whose record names another tier; one that says this tier but is not here is a
        `ConfigError`), taken out of the candidates and the held, and the policy is told
        (``on_evict``); else it is the policy's victim, out of them already. Returns where it
        stopped."""
        name, records, candidates, held, free = self.name, self._records, self._candidates, \
            self._held, self._free
        policy, frees = self.policy, self._frees
        unindex = self._lookup.remove
        for i in range(start, stop):
            block = blocks[i]
            slot = block.block_id
            if evict:
                if block.tier != name:
                    return i
                if records.get(slot) is not block:
                    raise ConfigError(f"block {slot} is not in tier {name!r}")
                candidates.pop(slot, None)
                held.pop(slot, None)
                policy.on_evict(block, now)  # type: ignore[union-attr]
            del records[slot]
            if frees:
                self.store.free(slot, block)
            free.append(slot)
            parent = block.parent
            if parent is not None and parent.tier == name and \
                    records.get(parent.block_id) is parent:
                n = parent.num_children - 1
                parent.num_children = n
                if not n and parent.block_id not in held:
                    candidates[parent.block_id] = parent
                    policy.on_candidate(parent, now)  # type: ignore[union-attr]
            block.tier = "dropped"
            unindex(block)  # out of the stack's index
        return stop

    def bind_policy(self, policy: Policy, block_size: int) -> None:
        """Take ``policy`` (the stack builds it, priced for this tier)."""
        policy.bind(block_size)
        self.policy = policy
        self._pop = pop_victim_of(policy)
        self._on_candidate = policy.on_candidate
        self._on_insert = None if type(policy).on_insert is Policy.on_insert else \
            policy.on_insert
        self._frees = self.store.holds_data

    def hold(self, block: BlockInfo, now: float) -> None:
        """Keep ``block`` from being evicted (a reload is under way)."""
        self.hold_run((block,), 0, now)

    def hold_run(self, blocks: Sequence[BlockInfo], start: int, now: float) -> int:
        """`hold` ``blocks[start:]`` in order, up to the first one whose record names
        another tier; return where it stopped (``len(blocks)`` when it held every one)."""
        name, candidates, held = self.name, self._candidates, self._held
        uncandidate = self.policy.on_uncandidate  # type: ignore[union-attr]
        for i in range(start, len(blocks)):
            block = blocks[i]
            if block.tier != name:
                return i
            slot = block.block_id
            if candidates.pop(slot, None) is not None:
                uncandidate(block, now)
            held[slot] = block
        return len(blocks)

    def unhold(self, block: BlockInfo, now: float) -> None:
        """Undo `hold`."""
        slot = block.block_id
        if self._held.pop(slot, None) is None:
            return
        if not block.num_children:
            self._candidates[slot] = block
            self.policy.on_candidate(block, now)  # type: ignore[union-attr]

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return (f"Tier({self.name!r}, blocks={len(self._records)}/{self.capacity_blocks}, "
                f"policy={self.policy!r}, store={self.store!r})")


class _ByDepth(dict):
    """A rule's answer by depth, each computed once, on its first lookup."""

    __slots__ = ("rule",)

    def __init__(self, rule: Any) -> None:
        super().__init__()
        self.rule = rule

    def __missing__(self, depth: int) -> Any:
        value = self[depth] = self.rule(depth)
        return value


def _view(d: dict) -> Mapping:
    from types import MappingProxyType

    return MappingProxyType(d)


# -- the stack ------------------------------------------------------------------------------


class TierStack:
    """The tiers below a pool, in order (``tiers[0]`` is tier 1, right below the pool).

    Args:
        tiers: the lower tiers, fastest first (at least one).
        cost_model: prices recomputation for the demotion rule and the tier policies
            (default `CostModel()`).
        demote: ``"cost"`` (demote only what is faster to reload than recompute; default) or
            ``"always"``.
        model: the model's identity for a disk tier's manifest (default: the layout's name).

    A `KVCacheManager` given ``tiers=`` binds the stack to its pool (`bind`) and calls
    `demote`, `match` / `hold` / `restore` / `load`, `superseded` and `orphaned`; nothing
    else changes it. ``stats`` (`TierStats`) counts what moved.
    """

    def __init__(self, tiers: Sequence[Tier], *, cost_model: CostModel | None = None,
                 demote: str = "cost", model: str | None = None) -> None:
        tiers = tuple(tiers)
        if not tiers or not all(isinstance(t, Tier) for t in tiers):
            raise ConfigError("tiers must be a non-empty sequence of Tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct, got {names}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ConfigError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        if demote not in DEMOTE_RULES:
            raise ConfigError(f"demote must be one of {', '.join(DEMOTE_RULES)}, got {demote!r}")
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"model must be a non-empty string, got {model!r}")
        if any(t.index for t in tiers):
            raise ConfigError("a Tier belongs to one stack; build fresh tiers")
        for i, tier in enumerate(tiers, start=1):
            tier.index = i
        self.tiers = tiers
        self.cost_model = cost_model if cost_model is not None else CostModel()
        self.demote_rule = demote
        self.model = model
        n = len(tiers)
        self._demoted = [0] * (n + 1)  # blocks demoted into tier k
        self._served = [0] * (n + 1)  # blocks reloaded from tier k
        self._drops: dict[str, int] = {}
        self._corrupt = 0
        self._cost_rule = demote == "cost"
        self.pool: BlockPool | None = None
        self.block_size: int | None = None
        self.bytes_per_block = 0
        self._by_name = {t.name: t for t in tiers}
        self._held_by_name = {t.name: t.held for t in tiers}
        #: each tier's index (1 = right below the pool) by its name
        self.index_of: Mapping[str, int] = _view({t.name: t.index for t in tiers})
        #: every lower-tier block by hash and by parent hash, kept by the tiers as they move
        #: blocks (`BlockIndex`)
        self._lookup = lookup = BlockIndex()
        for tier in tiers:
            tier.join(lookup)
        self._where = lookup.blocks  # hash -> record, every lower-tier block
        #: lower-tier blocks by hash: a read-only live view
        self.blocks: Mapping[Any, BlockInfo] = _view(self._where)
        self._below = lookup.children  # parent hash -> lower children (`BlockIndex`)
        self._recompute: dict[int, float] = {}  # depth -> recompute seconds
        self._worth = _ByDepth(self._worth_at)  # depth -> worth demoting into tier 1
        self._reload_s: list[float] = []  # per-block reload seconds from tier k (index k)
        self._holds_data = False

    @property
    def stats(self) -> TierStats:
        """What moved since the stack was built (a snapshot, `TierStats`)."""
        nbytes = self.bytes_per_block
        names = [t.name for t in self.tiers]
        demoted, served = self._demoted, self._served
        return TierStats(
            hit_blocks={n: served[k] for k, n in enumerate(names, 1) if served[k]},
            bytes_read={n: served[k] * nbytes for k, n in enumerate(names, 1) if served[k]},
            bytes_written={n: demoted[k] * nbytes for k, n in enumerate(names, 1)
                           if demoted[k]},
            demotions={n: demoted[k] for k, n in enumerate(names, 1) if demoted[k]},
            reloads=sum(served), drops=dict(self._drops), checksum_failures=self._corrupt)

    # -- binding -----------------------------------------------------------------------

    def bind(self, pool: BlockPool, policy_cost_model: CostModel | None = None) -> None:
        """Attach the stack to ``pool`` (once): size the stores, build the tier policies,
        recover a disk tier's blocks."""
        if self.pool is not None:
            raise ConfigError("this TierStack already serves a pool; build a fresh one")
        self.pool = pool
        self.block_size = pool.block_size
        layout = pool.layout
        nbytes = pool.bytes_per_block
        if not nbytes:
            nbytes = self.cost_model.kv_bytes_per_token * pool.block_size
        self.bytes_per_block = nbytes
        self._holds_data = pool.kv is not None
        model = self.model or (layout.name if layout is not None and layout.name else "model")
        for tier in self.tiers:
            if tier.store.holds_data and not self._holds_data:
                raise ConfigError(f"tier {tier.name!r} stores KV bytes ({tier.store!r}) but the "
                                  "pool is metadata-only; use store='metadata'")
            if not tier.store.holds_data and self._holds_data:
                raise ConfigError(f"tier {tier.name!r} is metadata-only but the pool holds KV "
                                  "bytes: a reload would have nothing to copy; use "
                                  "store='host' or a disk directory")
        self._reload_s = [0.0] + [self._path_seconds(k, 1) for k in range(1, len(self.tiers) + 1)]
        for tier in self.tiers:
            tier.store.bind(tier.capacity_blocks, layout, pool.dtype, pool.block_size, model)
            tier.bind_policy(make_policy(tier.policy_spec, **self.policy_params(
                tier.policy_spec, tier.policy_params, tier.index)), pool.block_size)
        for tier in self.tiers:
            self._recover(tier)

    def policy_params(self, policy: Any, params: Mapping[str, Any] | None = None,
                      tier: int = 0, *, block_size: int | None = None) -> dict[str, Any]:
        """``params`` for building ``policy`` (a name) to serve tier ``tier`` (0: the pool):
        a policy that takes a ``cost_model`` gets `policy_cost_model` of that tier, built on
        the ``cost_model`` given in ``params`` (else the stack's). ``block_size`` prices a
        block before the stack is bound to a pool (a metadata-only one)."""
        out = dict(params or {})
        if not isinstance(policy, str):
            return out
        from kvevict.policies.registry import POLICIES, spec_name

        name = spec_name(policy)  # "market(horizon=60)" takes what "market" takes
        if name in POLICIES and "cost_model" in POLICIES.parameters(name):
            out["cost_model"] = self.policy_cost_model(tier, out.get("cost_model"),
                                                       block_size=block_size)
        return out

    def policy_cost_model(self, tier: int = 0, base: CostModel | None = None, *,
                          block_size: int | None = None) -> TierPricedCost:
        """The cost model a policy of tier ``tier`` (0: the pool) prices blocks with
        (`TierPricedCost`): losing a block costs a reload from tier ``tier + 1`` (or a
        recompute when there is none, or it is cheaper), less the reload it costs already."""
        n = len(self.tiers)
        if isinstance(tier, bool) or not isinstance(tier, int) or not 0 <= tier <= n:
            raise ConfigError(f"tier must be an int in [0, {n}], got {tier!r}")
        base = self.cost_model if base is None else base
        if not isinstance(base, CostModel):
            raise ConfigError(f"cost_model must be a CostModel, got {type(base).__name__}")
        fields = {f.name: getattr(base, f.name) for f in attrs.fields(CostModel)}
        nbytes = self.bytes_per_block or base.kv_bytes_per_token * (
            self.block_size or block_size or 16)
        loss = self._path_seconds(tier + 1, 1, nbytes) if tier < n else math.inf
        kept = self._path_seconds(tier, 1, nbytes) if tier else 0.0
        return TierPricedCost(**fields, loss_reload_s=loss, kept_reload_s=kept)

    # -- costs -------------------------------------------------------------------------

    def _path_seconds(self, k: int, blocks: int, nbytes: int | None = None) -> float:
        """Seconds to reload ``blocks`` blocks from tier ``k`` to the device: its link, then
        each link above it unless its link is direct."""
        nbytes = self.bytes_per_block if nbytes is None else nbytes
        total = 0.0
        while k >= 1:
            profile = self.tiers[k - 1].profile
            total += profile.transfer_seconds(nbytes, blocks)
            if profile.direct:
                break
            k -= 1
        return total

    def reload_seconds(self, tier: int, blocks: int = 1) -> float:
        """Seconds to reload ``blocks`` blocks of the pool from tier ``tier`` (>= 1) to the
        device in one batch (one latency per link crossed)."""
        if isinstance(tier, bool) or not isinstance(tier, int) or not 1 <= tier <= len(
                self.tiers):
            raise ConfigError(f"tier must be an int in [1, {len(self.tiers)}], got {tier!r}")
        return self._path_seconds(tier, blocks)

    def reloads_seconds(self, reloaded: Sequence[int]) -> float:
        """Seconds to reload what a sequence's ``reloaded`` counts (blocks from tier 1, 2,
        ...), each tier's blocks in one batch."""
        return sum(self._path_seconds(k, n) for k, n in enumerate(reloaded, start=1) if n)

    def recompute_seconds(self, depth: int) -> float:
        """Seconds to recompute the pool's block at ``depth`` (the cost model's prefill)."""
        value = self._recompute.get(depth)
        if value is None:
            value = self._recompute[depth] = self.cost_model.recompute_seconds(
                depth, self.block_size or 16)
        return value

    def worth_demoting(self, block: BlockInfo, tier: int) -> bool:
        """Whether reloading ``block`` from tier ``tier`` beats recomputing it (the cost
        rule), or the rule is ``"always"``."""
        if self.demote_rule == "always":
            return True
        return self._reload_s[tier] < self.recompute_seconds(block.depth)

    def crossover_depth(self, tier: int, limit: int = 1 << 20) -> int | None:
        """The shallowest depth from which a block is worth demoting into tier ``tier``
        (None when none up to ``limit`` is)."""
        reload = self._reload_s[tier]
        lo, hi = 0, limit
        if self.recompute_seconds(hi) <= reload:
            return None
        while lo < hi:  # recompute grows with depth
            mid = (lo + hi) // 2
            if self.recompute_seconds(mid) > reload:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- queries -----------------------------------------------------------------------

    def tier(self, name_or_index: str | int) -> Tier:
        """A tier by name or by index (1 = right below the pool)."""
        if isinstance(name_or_index, int) and not isinstance(name_or_index, bool):
            if 1 <= name_or_index <= len(self.tiers):
                return self.tiers[name_or_index - 1]
        elif name_or_index in self._by_name:
            return self._by_name[name_or_index]
        raise ConfigError(f"no tier {name_or_index!r}; tiers: "
                          f"{', '.join(t.name for t in self.tiers)} (1..{len(self.tiers)})")

    def tier_index(self, block: BlockInfo) -> int:
        """The index of the tier holding ``block`` (0 for the pool)."""
        tier = self._by_name.get(block.tier)
        return 0 if tier is None else tier.index

    def get(self, block_hash: Any) -> BlockInfo | None:
        """The lower-tier block with this hash, or None."""
        return self._where.get(block_hash)

    def __contains__(self, block_hash: Any) -> bool:
        return block_hash in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self) -> Iterator[BlockInfo]:
        return iter(self._where.values())

    def children_below(self, block_hash: Any) -> list[BlockInfo]:
        """The lower-tier blocks whose parent has this hash."""
        return self._lookup.children_of(block_hash)

    def match(self, hashes: Sequence[Any], start: int) -> list[BlockInfo]:
        """The lower-tier blocks continuing ``hashes`` from ``start`` (where the pool's hit
        ended), stopping at the first hash no tier holds or one already held; no side
        effects."""
        where, held = self._where, self._held_by_name
        out: list[BlockInfo] = []
        for i in range(start, len(hashes)):
            block = where.get(hashes[i])
            if block is None or block.block_id in held[block.tier]:
                break
            out.append(block)
        return out

    def served_by_staged(self, moves: Mapping[tuple[int, int], int]) -> None:
        """Count reloads where the bytes came from: ``moves[(found, staged)]`` blocks the
        pool reloaded from tier ``found`` (1-based) were served by a copy a prefetch had
        already read from tier ``staged`` (the block moved down a tier after its prefetch;
        `kvevict.run.TierTransfers`). They count as reads of tier ``staged``."""
        served = self._served
        for (found, staged), n in moves.items():
            served[found] -= n
            served[staged] += n

    def hits_by_tier(self, device_hits: int) -> dict[str, int]:
        """Blocks served by each tier: ``device_hits`` (the manager's ``block_hits`` less
        the reloads) and every tier's reloads."""
        out = {"device": device_hits - sum(self._served)}
        for tier in self.tiers:
            out[tier.name] = self._served[tier.index]
        return out

    # -- moves (the manager's hooks) ------------------------------------------------------

    def demote(self, blocks: Sequence[BlockInfo], now: float) -> None:
        """``blocks`` were just evicted from the pool, in this order (one eviction burst; their
        records are out of the tree, their pool blocks still hold their KV): place each in
        tier 1, or drop it, exactly as one `_place` after another would.

        A metadata-only stack whose tier 1 is its last (a trace replay's host tier) hands
        the burst to that tier in one call (`Tier.take_in`): one loop places every block, a
        full tier giving the policy's victim's slot to it, and keeps the stack's index as
        it goes; nothing is read or written."""
        if self._holds_data or len(self.tiers) > 1:
            kv = self.pool.kv if self._holds_data else None  # type: ignore[union-attr]
            place = self._place
            for block in blocks:
                place(block, 1, now, None if kv is None else kv[:, :, block.block_id])
            return
        tier = self.tiers[0]
        worth = self._worth if self._cost_rule else None
        placed = lost = dropped = 0
        i, n = 0, len(blocks)
        while True:
            i, p, gone, left = tier.take_in(blocks, i, now, worth)
            placed, lost, dropped = placed + p, lost + gone, dropped + left
            if i == n:
                break
            self._drop(blocks[i], "back_pressure", now)  # every block there is held
            i += 1
        self._demoted[1] += placed
        drops = self._drops
        if lost:
            drops["last_tier"] = drops.get("last_tier", 0) + lost
        if dropped:
            drops["cost"] = drops.get("cost", 0) + dropped

    def _worth_at(self, depth: int) -> bool:
        """Whether a block at ``depth`` is worth demoting into tier 1 by the cost rule
        (``_worth`` caches it by depth)."""
        return self._reload_s[1] < self.recompute_seconds(depth)

    def _place(self, block: BlockInfo, k: int, now: float, data: torch.Tensor | None,
               force: bool = False) -> bool:
        """Put ``block`` (out of every tier, its KV in ``data``) in tier ``k`` or drop it;
        return whether it was placed."""
        tiers = self.tiers
        n = len(tiers)
        if k > n:
            self._drop(block, "last_tier", now)
            return False
        below = self._below
        h = block.block_hash
        if not force and self._cost_rule and h not in below and \
                self._reload_s[k] >= self.recompute_seconds(block.depth):
            self._drop(block, "cost", now)
            return False
        tier = tiers[k - 1]
        if not tier.num_free:
            if k == n and not self._holds_data:  # the replay's common case, inline
                victim = tier.pop_victim(now)
                if victim is None:
                    self._drop(block, "back_pressure", now)
                    return False
                drops = self._drops  # (a leaf of the last tier: no descendants)
                drops["last_tier"] = drops.get("last_tier", 0) + 1
            elif not self._make_room(tier, now):
                self._drop(block, "back_pressure", now)
                return False
        if self._holds_data and not tier.store.write(tier.next_slot, block, data):
            self._drop(block, "back_pressure", now)
            return False
        kids = below.get(h)  # (making room may have moved some)
        if kids is None:
            block.num_children = 0
        elif n == 1:
            block.num_children = len(kids) if kids.__class__ is dict else 1
        else:
            name = tier.name
            block.num_children = sum(1 for c in self._lookup.children_of(h) if c.tier == name)
        tier.add(block, now)
        self._demoted[k] += 1
        return True

    def _make_room(self, tier: Tier, now: float) -> bool:
        """Free one slot of ``tier`` by moving its policy's victim one tier down (or
        dropping it); False when the tier has no candidate (all held or inner)."""
        data = None
        if self._holds_data:
            victim = tier.peek_victim(now)
            if victim is None:
                return False
            data = self._read(victim, tier)
        victim = tier.pop_victim(now)
        if victim is None:
            return False
        if self._holds_data and data is None:  # a corrupted file: drop it, the slot is free
            self._corrupt += 1
            self._drop(victim, "corrupt", now)
        elif tier.index == len(self.tiers):  # nothing lower: a leaf here has no descendants
            drops = self._drops
            drops["last_tier"] = drops.get("last_tier", 0) + 1
        else:
            self._place(victim, tier.index + 1, now, data)
        return True

    def _read(self, block: BlockInfo, tier: Tier) -> torch.Tensor | None:
        """``block``'s KV from ``tier`` as a tensor of its own (None: metadata-only, or a
        disk file that failed its checksum)."""
        if not self._holds_data:
            return None
        data = tier.store.read(block.block_id, block)
        if data is not None and tier.store.kind == "host":
            data = data.clone()  # the slot may be reused before the copy is written
        return data

    def _drop(self, block: BlockInfo, reason: str, now: float) -> None:
        """``block`` (in no tier) is gone: count it, and drop its lower-tier descendants,
        which no lookup could reach any more."""
        drops = self._drops
        drops[reason] = drops.get(reason, 0) + 1
        block.tier = "dropped"
        for child in self._lookup.children_of(block.block_hash):
            self._by_name[child.tier].remove(child, now)
            self._drop(child, "cascade", now)

    def take(self, hashes: Sequence[Any], start: int, now: float) -> list[BlockInfo]:
        """Hold the lower-tier continuation of ``hashes`` from ``start`` for a reload (`match`
        then `hold`) and return it. Undo with `restore`, finish with `load`."""
        blocks = self.match(hashes, start)
        if blocks:
            self.hold(blocks, now)
        return blocks

    def hold(self, blocks: Sequence[BlockInfo], now: float) -> None:
        """Hold ``blocks`` (a `match`) for a reload: no tier evicts a held block, so the
        evictions made for the request cannot drop them. Nothing is read here: a disk
        block's file is read and its checksum checked by `load`, once the request is known
        to fit (a request that waits for memory and is retried reads nothing). The manager
        holds only after it checked that the request fits."""
        by_name, i, n = self._by_name, 0, len(blocks)
        while i < n:  # one call per tier: the chain's part there
            i = by_name[blocks[i].tier].hold_run(blocks, i, now)

    def restore(self, blocks: Sequence[BlockInfo], now: float) -> None:
        """Undo `hold`: the blocks stay where they are and may be evicted again."""
        for block in blocks:
            tier = self._by_name.get(block.tier)
            if tier is not None:
                tier.unhold(block, now)

    def load(self, blocks: Sequence[BlockInfo], block_ids: Sequence[int], now: float) -> int:
        """Finish a reload of held ``blocks`` (a chain): copy each one's KV into the pool
        block of the same position in ``block_ids`` and take it out of its tier; counted by
        tier. Return how many were loaded: all of them, unless a disk block's file fails its
        checksum here. That block is a miss (logged, counted in ``checksum_failures``, never
        served) and is dropped with its lower-tier descendants (the rest of the chain among
        them), so the reload ends before it; the pool blocks of the positions from there on
        are left untouched for the caller to free. The loaded records are then the pool's
        (``tier == "device"``, ``block_id`` the pool block, no children counted); the caller
        registers them in the tree."""
        n = len(blocks)
        if len(block_ids) != n:
            raise ValueError(f"load: {n} blocks but {len(block_ids)} pool blocks")
        by_name = self._by_name
        loaded = n
        if self._holds_data:  # every block's KV first (a disk file's checksum checked)
            kv = self.pool.kv  # type: ignore[union-attr]
            for i, block in enumerate(blocks):
                data = by_name[block.tier].store.read(block.block_id, block)
                if data is None:  # a torn or corrupted file: a miss, never served
                    loaded = i
                    break
                kv[:, :, block_ids[i]].copy_(data)
        served = self._served
        i = 0
        while i < loaded:  # one call per tier: the chain's part there
            tier = by_name[blocks[i].tier]
            end = tier.remove_run(blocks, i, loaded, now)
            served[tier.index] += end - i
            i = end
        for i in range(loaded):
            block = blocks[i]
            block.block_id = block_ids[i]
            block.tier = "device"
            block.num_children = 0
            block.ref_count = 0
        if loaded < n:
            block = blocks[loaded]
            self._corrupt += 1
            by_name[block.tier].remove(block, now)
            self._drop(block, "corrupt", now)
        return loaded

    def superseded(self, blocks: Sequence[BlockInfo], now: float,
                   hashes: Sequence[Any] | None = None) -> None:
        """New pool records were cached for ``blocks``: a lower-tier copy of the same hash
        (another sequence computed it meanwhile) is dropped, and its lower-tier children
        become the new record's. ``hashes``: the blocks' hashes, when the caller holds them
        in a sequence already (a slice of the chain), so none is read from a record."""
        where = self._where
        if where.keys().isdisjoint(map(_HASH_OF, blocks) if hashes is None else hashes):
            return  # the common case, at C speed
        for block in blocks:
            old = where.get(block.block_hash)
            if old is None:
                continue
            kids = self._lookup.children_of(block.block_hash)
            self._by_name[old.tier].remove(old, now)
            drops = self._drops
            drops["superseded"] = drops.get("superseded", 0) + 1
            for child in kids:
                child.parent = block

    def orphaned(self, blocks: Sequence[BlockInfo], now: float) -> None:
        """Pool records left the cache without a demotion (a rolled-back operation): their
        lower-tier descendants can no longer be reached and are dropped."""
        below, children_of = self._below, self._lookup.children_of
        for block in blocks:
            if block.block_hash not in below:
                continue
            for child in children_of(block.block_hash):
                self._by_name[child.tier].remove(child, now)
                self._drop(child, "cascade", now)

    def spill(self, now: float, to: int | None = None) -> int:
        """Move every block of the tiers above tier ``to`` (default: the last) down into it,
        ignoring the cost rule, deepest first (a parent never sits below its child); return
        how many moved. After ``manager.evict(manager.num_evictable_blocks)`` this writes a
        whole cache to a disk tier before a process exits."""
        target = self.tier(len(self.tiers) if to is None else to)
        moved = 0
        for k in range(1, target.index):
            tier = self.tiers[k - 1]
            for block in sorted(tier.records.values(), key=lambda b: -b.depth):
                if tier.is_held(block):
                    continue
                data = self._read(block, tier)
                tier.remove(block, now)
                if self._holds_data and data is None:
                    self._corrupt += 1
                    self._drop(block, "corrupt", now)
                    continue
                moved += self._place(block, target.index, now, data, force=True)
        return moved

    # -- recovery ----------------------------------------------------------------------

    def _recover(self, tier: Tier) -> None:
        """Rebuild the records of the blocks a disk store already holds (a new process on
        the same directory): those whose whole prefix is on disk too, shallowest first up
        to the tier's capacity; the files of the others are removed."""
        headers = {header["hash"]: header for header, _ in tier.store.recover()}
        if not headers:
            return
        built: dict[Any, BlockInfo] = {}

        def build(h: Any, depth_left: int) -> BlockInfo | None:
            if h in built:
                return built[h]
            header = headers.get(h)
            depth = None if header is None else header.get("depth")
            if header is None or not isinstance(depth, int) or depth < 0 or depth_left < 0:
                return None
            parent = None
            if depth:
                parent = build(header.get("parent"), depth_left - 1)
                if parent is None or parent.depth != depth - 1:
                    return None
            elif header.get("parent") != ROOT_HASH:
                return None
            tokens = header.get("tokens")
            block = BlockInfo(-1, h, header.get("parent"), depth,
                              None if tokens is None else np.asarray(tokens, dtype=np.int64),
                              self.bytes_per_block, header.get("class") or "chat", None, 0.0, 0,
                              None, header.get("created_by") or "prefill",
                              header.get("kind") or "prompt", parent)
            built[h] = block
            return block

        for h in headers:
            build(h, len(headers))
        blocks = sorted(built.values(), key=lambda b: b.depth)
        keep = blocks[:tier.capacity_blocks]
        kept = {b.block_hash for b in keep}
        for h in headers:
            if h not in kept:
                tier.store.discard(h)
        for block in keep:
            if block.depth > 0:
                block.parent.num_children += 1  # type: ignore[union-attr]
        for block in reversed(keep):  # children first: a parent's count is final
            tier.add(block, 0.0)

    def __repr__(self) -> str:
        return f"TierStack({', '.join(repr(t) for t in self.tiers)})"
