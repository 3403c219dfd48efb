"""What a run of the engine occupies: the process's memory as the OS reports it, and where
the KV tensor lives (read off the tensor, not assumed)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

from kvevict.engine.model import LlamaModel
from kvevict.errors import ConfigError
from kvevict.pool import BlockPool

__all__ = ["kv_placement", "process_memory", "reset_peak_rss"]


def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / VmSwap of this process in bytes, from /proc (Linux); {} elsewhere."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSwap"):
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024  # reported in kB
    return out


def reset_peak_rss() -> bool:
    """Reset the OS's peak-RSS counter of this process (Linux ``/proc/self/clear_refs``);
    False when the OS does not allow it (the peak is then the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def process_memory() -> dict[str, Any]:
    """The process's resident memory as the OS reports it (not what torch says):
    ``rss_bytes`` now, ``peak_rss_bytes``, ``swap_bytes`` and where they came from."""
    status = _proc_status()
    if "VmRSS" in status:
        return {"source": "/proc/self/status", "rss_bytes": status["VmRSS"],
                "peak_rss_bytes": status.get("VmHWM"), "swap_bytes": status.get("VmSwap")}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"source": "getrusage", "rss_bytes": None, "peak_rss_bytes": peak,
            "swap_bytes": None}


def kv_placement(pool: BlockPool, model: LlamaModel | None = None) -> dict[str, Any]:
    """Where the KV tensor actually lives: device, dtype, shape, bytes (read off the tensor)."""
    kv = pool.kv
    if kv is None:
        raise ConfigError("pool has no KV tensor (metadata-only)")
    out: dict[str, Any] = {"device": str(kv.device), "dtype": str(kv.dtype).replace("torch.", ""),
                           "shape": list(kv.shape), "bytes": kv.numel() * kv.element_size(),
                           "bytes_per_block": pool.bytes_per_block,
                           "blocks": pool.num_blocks, "block_size": pool.block_size}
    if model is not None:
        weights = model.weights()
        out["weights_device"] = str(next(iter(weights.values())).device)
        out["weights_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
    return out
