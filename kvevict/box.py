"""The box a simulation runs on: named accelerator profiles, tensor parallelism, and the KV
capacity vLLM would allocate on it.

A `GpuProfile` holds one accelerator's datasheet figures (memory, HBM bandwidth, dense BF16
FLOPs, host link, GPU-to-GPU interconnect) with their source; `GPU_PROFILES` has the common
ones, looked up by `gpu_profile`. ``GpuProfile.from_calibration`` is "this machine": a profile
whose cost model is the one ``kvevict calibrate`` measured. A `Box` is ``gpus`` of one profile
running one model with tensor parallelism, at vLLM's ``gpu_memory_utilization``.

**KV capacity** (`kv_cache_bytes`), as vLLM's ``Worker.determine_available_memory``
(``vllm/worker/worker.py``, ``vllm/v1/worker/gpu_worker.py``) computes it on each GPU::

    kv = gpus * memory * utilization - weights - gpus * (activation + reserve)

``weights`` is ``params * weight_bytes_per_param`` for the whole model (tensor parallelism
shards it across the GPUs). ``activation`` is the peak that vLLM's ``profile_run`` measures
on a dummy forward of ``max_num_batched_tokens`` tokens spread over ``max_num_seqs``
sequences, followed by sampling one token for each sequence with top-k and top-p set (so
that the sort path is exercised); kvevict estimates it (`activation_bytes_per_gpu`) as the
larger of two live sets:

- the forward: in the MLP of one layer the residual and the normed hidden states
  (``2 * hidden_size``), the gate-and-up projection (``2 * intermediate / gpus``) and its
  activation (``intermediate / gpus``) are live at once, per token, in 2-byte activations;
- the sampler: ``max_num_seqs`` rows of full-vocabulary logits (tensor parallelism gathers
  them whole onto the rank that samples, and the block count is the smallest over the
  ranks), ``SAMPLER_BYTES_PER_LOGIT`` = 30 bytes per logit (the bf16 logits,
  their float32 copy, the sorted values and int64 indices, the softmax, its cumulative sum
  and the scattered result of vLLM's top-k/top-p path), plus the final hidden states.

``reserve`` is memory outside PyTorch's allocator: the CUDA context, cuBLAS and NCCL
workspaces and CUDA graphs; `DEFAULT_RESERVE_BYTES` is 1 GiB per GPU (an estimate: vLLM's
profiler logged 1.79 GiB of non-torch memory for Llama-3-8B on one H100 and 3.58 GiB on each
of two, vllm-project/vllm PR #10511; newer vLLM versions also subtract CUDA graphs, "less
than 1GB" in a vLLM maintainer's estimate, vllm-project/vllm issue #5193).
The KV bytes per token on each GPU (`kv_bytes_per_token_per_gpu`) follow vLLM's sharding:
KV heads split across the GPUs, or, when there are fewer KV heads than GPUs, one head per
GPU, replicated; an MLA latent is replicated on every GPU. The block count is the KV bytes
of one GPU over its share of a block. ``docs/box.md`` compares the formula with a published
vLLM startup log (Llama-3-8B, one H100, 0.9: 53.29 GiB logged, 54.75 GiB here, +2.7%).

**Cost model** (`Box.cost_model`): `kvevict.cost.CostModel.for_model` with the profile's
figures, tensor parallelism modelled as Megatron-LM does it (Shoeybi et al. 2019,
arXiv 1909.08053, section 3): each GPU holds ``1/gpus`` of every weight matrix and of the
KV heads, so FLOPs and HBM bandwidth add up over the GPUs (``gpus * peak``), the weights read
per decode step split, and a context token costs its per-GPU KV share over one GPU's
bandwidth; every layer adds two all-reduces (after attention and after the MLP) of
``hidden_size * 2`` bytes per token, each moving ``2 (gpus - 1) / gpus`` times that over the
interconnect in a ring (Patarasuk and Yuan 2009, NCCL's ring algorithm)::

    all_reduce_s_per_token = 2 * num_layers * 2 (gpus - 1) / gpus * hidden_size * 2
                             / interconnect_bytes_per_s

charged to every prefill token (``linear_s_per_token``) and to every sequence of a decode
batch (``decode_s_per_seq``). The all-reduces' per-call latency (a few microseconds each,
``2 * num_layers`` per step) is not modelled, so a tensor-parallel decode step is
optimistic. A reload moves each GPU's share over its own host link, in parallel.

Invalid input raises `kvevict.errors.ConfigError` naming what was wrong.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import attrs

from kvevict.cost import (
    H100_BF16_FLOPS,
    H100_HBM_BYTES_PER_S,
    MODEL_PARAMS,
    PCIE5_X16_BYTES_PER_S,
    CostModel,
)
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout, preset

__all__ = [
    "DEFAULT_RESERVE_BYTES",
    "GPU_PROFILES",
    "MODEL_DIMS",
    "SAMPLER_BYTES_PER_LOGIT",
    "Box",
    "GpuProfile",
    "KVCapacity",
    "ModelDims",
    "activation_bytes_per_gpu",
    "check_capacity",
    "gpu_profile",
    "kv_bytes_per_token_per_gpu",
    "kv_cache_bytes",
]

GIB = 1 << 30
MIB = 1 << 20

#: Memory per GPU outside PyTorch's allocator (CUDA context, cuBLAS / NCCL workspaces, CUDA
#: graphs) that the capacity formula sets aside; see the module docstring for the estimate.
DEFAULT_RESERVE_BYTES = 1 * GIB

#: Bytes live per logit at the peak of vLLM's top-k/top-p sampler during ``profile_run``:
#: bf16 logits 2 + float32 copy 4 + sorted values 4 + int64 sort indices 8 + softmax 4 +
#: cumulative sum 4 + scattered result 4.
SAMPLER_BYTES_PER_LOGIT = 30

#: Bytes per activation element (bf16 / fp16 activations), for the forward live set and the
#: all-reduce messages.
ACTIVATION_BYTES = 2

PCIE4_X16_BYTES_PER_S = 32e9  # PCIe Gen4 x16, per direction (64 GB/s both ways)


# --------------------------------------------------------------------------- validation


def _positive_number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
    return value


def _check_profile_rate(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive_number(f"GpuProfile.{attribute.name}", value)


def _check_memory(instance: Any, attribute: Any, value: Any) -> None:
    _positive_int(f"GpuProfile.{attribute.name} (bytes)", value)


def _check_text(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"GpuProfile.{attribute.name} must be a non-empty string, got "
                          f"{value!r}")


def _check_calibrated(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, CostModel):
        raise ConfigError(f"GpuProfile.calibrated must be a CostModel or None, got "
                          f"{type(value).__name__}")


# --------------------------------------------------------------------------- profiles


@attrs.frozen
class GpuProfile:
    """One accelerator's figures, each from its datasheet (``source`` says which).

    Attributes:
        name: the lookup key, e.g. ``"h100-sxm-80gb"``.
        label: how a person names it, e.g. ``"H100 SXM 80 GB"``.
        memory_bytes: device memory the driver reports (``nvidia-smi``'s total), the
            quantity vLLM multiplies by ``gpu_memory_utilization``.
        hbm_bytes_per_s: device memory bandwidth.
        bf16_dense_flops: dense (not sparse) BF16 tensor-core FLOP/s.
        host_link_bytes_per_s: host-to-device link, one direction.
        interconnect_bytes_per_s: GPU-to-GPU link for tensor parallelism (NVLink, or the PCIe
            peer path), one direction.
        source: where the figures come from.
        calibrated: for "this machine" (`from_calibration`): the measured cost model, which
            `Box.cost_model` returns as it is; the four rates are then None.
    """

    name: str = attrs.field(validator=_check_text)
    label: str = attrs.field(validator=_check_text)
    memory_bytes: int = attrs.field(validator=_check_memory)
    hbm_bytes_per_s: float | None = attrs.field(validator=_check_profile_rate)
    bf16_dense_flops: float | None = attrs.field(validator=_check_profile_rate)
    host_link_bytes_per_s: float | None = attrs.field(validator=_check_profile_rate)
    interconnect_bytes_per_s: float | None = attrs.field(validator=_check_profile_rate)
    source: str = attrs.field(validator=_check_text)
    calibrated: CostModel | None = attrs.field(default=None, validator=_check_calibrated)

    def __attrs_post_init__(self) -> None:
        rates = {"hbm_bytes_per_s": self.hbm_bytes_per_s,
                 "bf16_dense_flops": self.bf16_dense_flops,
                 "host_link_bytes_per_s": self.host_link_bytes_per_s,
                 "interconnect_bytes_per_s": self.interconnect_bytes_per_s}
        missing = [k for k, v in rates.items() if v is None]
        if self.calibrated is None and missing:
            raise ConfigError(f"GpuProfile {self.name!r} needs {', '.join(missing)} (or a "
                              "calibrated cost model)")

    @classmethod
    def from_calibration(cls, path: str | Path, *, memory_bytes: int | None = None,
                         name: str = "this-machine") -> GpuProfile:
        """"This machine": a profile whose cost model is the one ``kvevict calibrate`` wrote
        to ``path`` (read with `CostModel.load`), so that a `Box` of it yields exactly that
        `CostModel`.

        The device memory is ``memory_bytes`` if given, else the file's
        ``engine.device_memory_bytes`` if it records one, else measured here for the device
        the calibration ran on (``torch.cuda.mem_get_info`` for CUDA, physical memory for
        the CPU): the calibration describes this machine.

        Raises:
            ConfigError: the file is missing or malformed, or its device's memory cannot be
                told.
        """
        path = Path(path)
        cost = CostModel.load(path)  # raises ConfigError naming the file
        data = json.loads(path.read_text())
        engine = data.get("engine") if isinstance(data, dict) else None
        engine = engine if isinstance(engine, dict) else {}
        device = str(engine.get("device", "cpu"))
        if memory_bytes is None:
            memory_bytes = engine.get("device_memory_bytes")
        if memory_bytes is None:
            memory_bytes = _device_memory(device, path)
        memory_bytes = _positive_int("memory_bytes", memory_bytes)
        when = f", {engine['date']}" if "date" in engine else ""
        return cls(name=name, label=f"this machine ({device}, calibrated{when})",
                   memory_bytes=memory_bytes, hbm_bytes_per_s=None, bf16_dense_flops=None,
                   host_link_bytes_per_s=None, interconnect_bytes_per_s=None,
                   source=f"kvevict calibrate: {path}", calibrated=cost)


def _device_memory(device: str, path: Path) -> int:
    """Total memory of ``device`` on this machine (the device a calibration ran on)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{path} was calibrated on {device}, but this machine has no "
                              "CUDA device; pass memory_bytes=")
        index = int(device.split(":")[1]) if ":" in device else 0
        return int(torch.cuda.mem_get_info(index)[1])
    if device == "cpu":
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    raise ConfigError(f"{path} was calibrated on device {device!r}, whose memory kvevict "
                      "cannot measure; pass memory_bytes=")


def _mib(n: int) -> int:
    return n * MIB


_NV = "NVIDIA"
#: The named accelerator profiles (``docs/box.md`` has the table with every source). Memory
#: is ``nvidia-smi``'s total where a published reading was found (cited), else the datasheet
#: capacity; BF16 is the dense tensor-core figure (datasheets print twice it "with
#: sparsity"); links are per direction.
GPU_PROFILES: dict[str, GpuProfile] = {p.name: p for p in (
    GpuProfile(
        "h100-sxm-80gb", "H100 SXM 80 GB", _mib(81559), H100_HBM_BYTES_PER_S,
        H100_BF16_FLOPS, PCIE5_X16_BYTES_PER_S, 450e9,
        f"{_NV} H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): 80 GB "
        "HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity (989 dense, as kvevict.cost), "
        "PCIe Gen5 128 GB/s, NVLink 900 GB/s (both directions); memory: nvidia-smi reads "
        "81,559 MiB (github.com/LMCache/LMCache/issues/259)"),
    GpuProfile(
        "h200-141gb", "H200 SXM 141 GB", 141 * GIB, 4.8e12,
        H100_BF16_FLOPS, PCIE5_X16_BYTES_PER_S, 450e9,
        f"{_NV} H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): 141 GB "
        "HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, PCIe Gen5 128 GB/s, NVLink "
        "900 GB/s; memory: the datasheet's 141 GB read as GiB, as the H100's 80 GB is "
        "(no published nvidia-smi reading found)"),
    GpuProfile(
        "a100-80gb", "A100 SXM 80 GB", _mib(81920), 2.039e12, 312e12,
        PCIE4_X16_BYTES_PER_S, 300e9,
        f"{_NV} A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100): 80 GB "
        "HBM2e, 2,039 GB/s, BF16 624 TFLOPS with sparsity, PCIe Gen4 64 GB/s, NVLink "
        "600 GB/s (both directions); memory: nvidia-smi reads 81,920 MiB on the "
        "A800-SXM4-80GB, the same board memory (github.com/dexmal/dexbotic/issues/41)"),
    GpuProfile(
        "a100-40gb", "A100 SXM 40 GB", _mib(40960), 1.555e12, 312e12,
        PCIE4_X16_BYTES_PER_S, 300e9,
        f"{_NV} A100 Tensor Core GPU datasheet: 40 GB HBM2, 1,555 GB/s, BF16 624 TFLOPS "
        "with sparsity, PCIe Gen4 64 GB/s, NVLink 600 GB/s; memory: nvidia-smi reads "
        "40,960 MiB (github.com/bottlerocket-os/bottlerocket-core-kit/pull/834)"),
    GpuProfile(
        "l40s-48gb", "L40S 48 GB", _mib(46068), 864e9, 362.05e12,
        PCIE4_X16_BYTES_PER_S, PCIE4_X16_BYTES_PER_S,
        f"{_NV} L40S datasheet (nvidia.com/en-us/data-center/l40s): 48 GB GDDR6 with ECC, "
        "864 GB/s, BF16 733 TFLOPS with sparsity (362.05 dense), PCIe Gen4 x16 64 GB/s, no "
        "NVLink (peers over PCIe); memory: nvidia-smi reads 46,068 MiB with ECC on "
        "(github.com/akash-network/provider-configs/pull/99)"),
    GpuProfile(
        "l4-24gb", "L4 24 GB", _mib(24 * 1024 * 15 // 16), 300e9, 121e12,
        PCIE4_X16_BYTES_PER_S, PCIE4_X16_BYTES_PER_S,
        f"{_NV} L4 datasheet (nvidia.com/en-us/data-center/l4): 24 GB GDDR6, 300 GB/s, "
        "BF16 242 TFLOPS with sparsity, PCIe Gen4 x16 64 GB/s, no NVLink; memory: 24 GiB "
        "less the 1/16 that ECC (on by default) keeps, the rule that gives the L40S's "
        "46,080 MiB against its 46,068 MiB reading (no published L4 reading found)"),
    GpuProfile(
        "rtx-4090-24gb", "GeForce RTX 4090 24 GB", _mib(24564), 1008e9, 165.2e12,
        PCIE4_X16_BYTES_PER_S, PCIE4_X16_BYTES_PER_S,
        f"{_NV} Ada Lovelace GPU architecture whitepaper v2.1, appendix A: 24 GB GDDR6X, "
        "1,008 GB/s, BF16 tensor 165.2 TFLOPS with FP32 accumulate (330.4 with sparsity), "
        "PCIe Gen4 x16; no NVLink and no peer-to-peer on GeForce, so the PCIe figure is "
        "optimistic for tensor parallelism; memory: nvidia-smi reads 24,564 MiB "
        "(github.com/RLinf/RLinf/issues/255)"),
)}


def gpu_profile(name: str) -> GpuProfile:
    """The `GPU_PROFILES` entry called ``name`` (case-insensitive; ``_`` and spaces read as
    ``-``).

    Raises:
        ConfigError: unknown name; the message lists the valid ones.
    """
    key = name.strip().lower().replace("_", "-").replace(" ", "-") if isinstance(
        name, str) else name
    try:
        return GPU_PROFILES[key]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown GPU {name!r}; valid names: {', '.join(GPU_PROFILES)}, "
                          "or a calibration file (kvevict calibrate)") from None


# --------------------------------------------------------------------------- model dims


def _check_dim(instance: Any, attribute: Any, value: Any) -> None:
    _positive_int(f"ModelDims.{attribute.name}", value)


def _check_total(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive_number("ModelDims.total_params", value)


@attrs.frozen
class ModelDims:
    """The sizes beyond the KV layout that memory and tensor parallelism need, from a
    model's ``config.json``.

    Attributes:
        hidden_size: the residual stream width (the all-reduce message per token).
        intermediate_size: the widest MLP a token passes through (for a mixture of
            experts, its dense layers).
        vocab_size: logits per sampled row.
        gated_mlp: a gated MLP (SwiGLU: gate and up projections, ``2 * intermediate``
            wide); False for a plain one (``intermediate`` wide).
        total_params: parameters stored, when they differ from those active per token
            (`kvevict.cost.MODEL_PARAMS`), as in a mixture of experts.
    """

    hidden_size: int = attrs.field(validator=_check_dim)
    intermediate_size: int = attrs.field(validator=_check_dim)
    vocab_size: int = attrs.field(validator=_check_dim)
    gated_mlp: bool = True
    total_params: float | None = attrs.field(default=None, validator=_check_total)


#: `ModelDims` of the `kvevict.layout.PRESETS`, from their published ``config.json``.
MODEL_DIMS: dict[str, ModelDims] = {
    "llama-3-8b": ModelDims(4096, 14336, 128256),
    "llama-3-70b": ModelDims(8192, 28672, 128256),
    "llama-2-7b": ModelDims(4096, 11008, 32000),
    "mistral-7b": ModelDims(4096, 14336, 32000),
    "qwen2-7b": ModelDims(3584, 18944, 152064),
    "qwen2.5-0.5b": ModelDims(896, 4864, 151936),
    "falcon-7b": ModelDims(4544, 18176, 65024, gated_mlp=False),
    "deepseek-v3": ModelDims(7168, 18432, 129280, total_params=671e9),
    "deepseek-v2-lite": ModelDims(2048, 10944, 102400, total_params=15.7e9),
}


def _layout(layout: KVLayout | str) -> KVLayout:
    out = preset(layout) if isinstance(layout, str) else layout
    if not isinstance(out, KVLayout):
        raise ConfigError(f"layout must be a KVLayout or a preset name, got {layout!r}")
    return out


def _dims(layout: KVLayout, dims: ModelDims | None) -> ModelDims:
    if dims is not None:
        if not isinstance(dims, ModelDims):
            raise ConfigError(f"dims must be a ModelDims, got {type(dims).__name__}")
        return dims
    found = MODEL_DIMS.get(layout.name or "")
    if found is None:
        raise ConfigError(f"no model sizes known for {layout.name!r}; pass dims=ModelDims("
                          f"hidden_size, intermediate_size, vocab_size) (known: "
                          f"{', '.join(MODEL_DIMS)})")
    return found


def _stored_params(layout: KVLayout, params: float | None, dims: ModelDims | None) -> float:
    if params is not None:
        return _positive_number("params", params)
    d = dims if dims is not None else MODEL_DIMS.get(layout.name or "")
    if d is not None and d.total_params is not None:
        return d.total_params
    found = MODEL_PARAMS.get(layout.name or "")
    if found is None:
        raise ConfigError(f"no parameter count known for {layout.name!r}; pass params= "
                          f"(known: {', '.join(MODEL_PARAMS)})")
    return found


# --------------------------------------------------------------------------- the box


def _check_gpu(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, GpuProfile):
        raise ConfigError(f"Box.gpu must be a GpuProfile (see gpu_profile), got "
                          f"{type(value).__name__}")


def _check_gpus(instance: Any, attribute: Any, value: Any) -> None:
    _positive_int("gpus (the tensor-parallel degree)", value)


def _check_utilization(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0 < value <= 1):
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1] (vLLM's default: 0.9), "
                          f"got {value!r}")


def _check_optional_bytes(instance: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive_int(f"Box.{attribute.name}", value)


@attrs.frozen
class Box:
    """``gpus`` accelerators of one profile serving one model with tensor parallelism.

    Attributes:
        gpu: the accelerator (`gpu_profile`, or `GpuProfile.from_calibration`).
        gpus: the tensor-parallel degree.
        gpu_memory_utilization: the fraction of each GPU's memory the engine may use
            (vLLM's ``--gpu-memory-utilization``, 0.9 by default).
        host_memory_bytes: host memory for a KV tier below the GPU (`tier_blocks`; the
            simulator's ``--host-gib`` / ``--host-x``, `kvevict.sim.TierConfig`), or None.
        disk_bytes: disk for a KV tier below the host tier (``--disk-gib``), or None.

    Raises:
        ConfigError: a bad field, or a calibrated profile with ``gpus > 1`` (a calibration
            measures one device).
    """

    gpu: GpuProfile = attrs.field(validator=_check_gpu)
    gpus: int = attrs.field(default=1, validator=_check_gpus)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_check_utilization)
    host_memory_bytes: int | None = attrs.field(default=None, validator=_check_optional_bytes)
    disk_bytes: int | None = attrs.field(default=None, validator=_check_optional_bytes)

    def __attrs_post_init__(self) -> None:
        if self.gpu.calibrated is not None and self.gpus != 1:
            raise ConfigError(f"{self.gpu.label} is a calibration of one device; it cannot "
                              f"model tensor parallelism over {self.gpus} GPUs (use gpus=1)")

    def describe(self) -> str:
        """``"1 x H100 SXM 80 GB at 0.9 utilization"``, then the KV tiers below the GPU when
        the box has them (``", 16.00 GiB host KV tier, 64.00 GiB disk KV tier"``)."""
        out = f"{self.gpus} x {self.gpu.label} at {self.gpu_memory_utilization:g} utilization"
        if self.host_memory_bytes is not None:
            out += f", {self.host_memory_bytes / GIB:.2f} GiB host KV tier"
        if self.disk_bytes is not None:
            out += f", {self.disk_bytes / GIB:.2f} GiB disk KV tier"
        return out

    def tier_blocks(self, layout: KVLayout | str, block_size: int) -> tuple[int, int]:
        """Blocks of ``block_size`` tokens of ``layout`` the host and disk KV tiers hold
        (``host_memory_bytes`` and ``disk_bytes`` over the bytes of a whole block, rounded
        down; 0 for a tier the box has not)."""
        per_block = _layout(layout).bytes_per_block(_positive_int("block_size", block_size))
        return tuple(0 if n is None else n // per_block  # type: ignore[return-value]
                     for n in (self.host_memory_bytes, self.disk_bytes))

    @property
    def usable_bytes(self) -> float:
        """``gpus * memory_bytes * gpu_memory_utilization``: what the engine may use."""
        return self.gpus * self.gpu.memory_bytes * self.gpu_memory_utilization

    def cost_model(self, layout: KVLayout | str | None = None, params: float | None = None,
                   *, dims: ModelDims | None = None, mfu: float = 0.5,
                   weight_bytes_per_param: float = 2.0) -> CostModel:
        """The `CostModel` of ``layout`` (a preset name or a `KVLayout`) on this box.

        A calibrated profile returns its measured cost model unchanged (``layout`` and the
        rest are ignored: the calibration timed its own model). Otherwise
        `CostModel.for_model` with the profile's FLOPs, HBM bandwidth and host link, and,
        for ``gpus > 1``, the tensor-parallel model of the module docstring (it needs
        ``dims`` for the hidden size: `MODEL_DIMS` for presets). ``params`` are the
        parameters active per token (`kvevict.cost.MODEL_PARAMS` for presets).
        """
        if self.gpu.calibrated is not None:
            return self.gpu.calibrated
        if layout is None:
            raise ConfigError(f"{self.gpu.label} has no measured cost model: give the "
                              "model's layout (a preset name or a KVLayout)")
        lay = _layout(layout)
        n = self.gpus
        per_gpu_kv = kv_bytes_per_token_per_gpu(lay, n)
        gpu = self.gpu
        assert gpu.bf16_dense_flops is not None and gpu.hbm_bytes_per_s is not None
        assert gpu.host_link_bytes_per_s is not None and gpu.interconnect_bytes_per_s is not None
        base = CostModel.for_model(lay, params, peak_flops=n * gpu.bf16_dense_flops, mfu=mfu,
                                   hbm_bytes_per_s=n * gpu.hbm_bytes_per_s,
                                   link_bytes_per_s=gpu.host_link_bytes_per_s,
                                   weight_bytes_per_param=weight_bytes_per_param)
        if n == 1:
            return base
        hidden = _dims(lay, dims).hidden_size
        all_reduce = (2 * lay.num_layers * 2 * (n - 1) / n * hidden * ACTIVATION_BYTES
                      / gpu.interconnect_bytes_per_s)
        return attrs.evolve(
            base,
            linear_s_per_token=base.linear_s_per_token + all_reduce,
            decode_s_per_seq=base.decode_s_per_seq + all_reduce,
            decode_s_per_context_token=per_gpu_kv / gpu.hbm_bytes_per_s,
            reload_bytes_per_s=gpu.host_link_bytes_per_s * lay.bytes_per_token / per_gpu_kv,
        )


def kv_bytes_per_token_per_gpu(layout: KVLayout | str, gpus: int = 1) -> int:
    """KV bytes one GPU holds per token under ``gpus``-way tensor parallelism, as vLLM
    shards the cache: the KV heads split evenly (``num_kv_heads % gpus == 0``), or, with
    fewer KV heads than GPUs, one head per GPU, each head replicated
    ``gpus / num_kv_heads`` times (``gpus % num_kv_heads == 0``); an MLA latent (and an MQA
    head) is replicated on every GPU.

    Raises:
        ConfigError: the heads do not divide evenly.
    """
    lay = _layout(layout)
    n = _positive_int("gpus", gpus)
    heads = lay.num_kv_heads
    if lay.attention == "mla" or n == 1:
        per_gpu = heads
    elif heads >= n:
        if heads % n:
            raise ConfigError(f"{lay.name or 'the model'} has {heads} KV heads, which do not "
                              f"split over {n} GPUs; use a tensor-parallel degree that "
                              f"divides {heads}")
        per_gpu = heads // n
    else:
        if n % heads:
            raise ConfigError(f"{lay.name or 'the model'} has {heads} KV heads, fewer than "
                              f"{n} GPUs and not a divisor of it; use a degree that is a "
                              f"multiple of {heads}")
        per_gpu = 1
    if n > 1 and lay.num_attention_heads is not None and lay.num_attention_heads % n:
        raise ConfigError(f"{lay.name or 'the model'} has {lay.num_attention_heads} attention "
                          f"heads, which do not split over {n} GPUs")
    return lay.num_layers * lay.kv_planes * per_gpu * lay.head_dim * lay.dtype_bytes


def activation_bytes_per_gpu(layout: KVLayout | str, *, max_num_batched_tokens: int,
                             max_num_seqs: int = 256, gpus: int = 1,
                             dims: ModelDims | None = None) -> float:
    """The activation peak of vLLM's profiling run on one GPU, estimated as the larger of
    the forward's MLP live set and the sampler's (see the module docstring)::

        forward = T * 2 * (2 * hidden + (3 if gated else 2) * intermediate / gpus)
        sampler = S * vocab * SAMPLER_BYTES_PER_LOGIT + T * hidden * 2

    with ``T = max_num_batched_tokens`` and ``S = min(max_num_seqs, T)`` sampled rows.
    """
    lay = _layout(layout)
    d = _dims(lay, dims)
    t = _positive_int("max_num_batched_tokens", max_num_batched_tokens)
    s = min(_positive_int("max_num_seqs", max_num_seqs), t)
    n = _positive_int("gpus", gpus)
    mlp = (3 if d.gated_mlp else 2) * d.intermediate_size / n
    forward = t * ACTIVATION_BYTES * (2 * d.hidden_size + mlp)
    sampler = s * d.vocab_size * SAMPLER_BYTES_PER_LOGIT + t * d.hidden_size * ACTIVATION_BYTES
    return float(max(forward, sampler))


@attrs.frozen
class KVCapacity:
    """Where a box's memory goes, summed over its GPUs (`kv_cache_bytes` computes it).

    Attributes:
        box: the box.
        layout: the model's KV layout.
        total_bytes: ``gpus * memory * utilization``, what the engine may use.
        weights_bytes: the model's weights (all shards).
        activation_bytes: the activation peak, summed over the GPUs.
        reserve_bytes: non-torch memory and CUDA graphs, summed over the GPUs.
        kv_bytes: what is left for the KV cache: total - weights - activation - reserve.
        kv_bytes_per_token_per_gpu: one GPU's share of a token's KV
            (`kv_bytes_per_token_per_gpu`).
    """

    box: Box
    layout: KVLayout
    total_bytes: float
    weights_bytes: float
    activation_bytes: float
    reserve_bytes: float
    kv_bytes: float
    kv_bytes_per_token_per_gpu: int

    def blocks(self, block_size: int) -> int:
        """Blocks of ``block_size`` tokens the KV memory holds: one GPU's KV bytes over its
        share of a block, rounded down (vLLM's ``num_gpu_blocks``)."""
        bs = _positive_int("block_size", block_size)
        per_gpu = self.kv_bytes / self.box.gpus
        return max(0, math.floor(per_gpu / (self.kv_bytes_per_token_per_gpu * bs)))

    def block_bytes(self, blocks: int, block_size: int) -> int:
        """The KV bytes of ``blocks`` blocks of the model (the whole block, all GPUs'
        shards: what the simulator's pool counts)."""
        return blocks * self.layout.bytes_per_block(block_size)

    def text(self, block_size: int) -> str:
        """One line for a person: the formula with its numbers and the block count."""
        n = self.blocks(block_size)
        return (f"{self.box.describe()}: {self.total_bytes / GIB:,.2f} GiB usable - "
                f"{self.weights_bytes / GIB:,.2f} GiB weights - "
                f"{self.activation_bytes / GIB:,.2f} GiB activation peak - "
                f"{self.reserve_bytes / GIB:,.2f} GiB reserve = "
                f"{self.kv_bytes / GIB:,.2f} GiB for KV: {n:,} blocks of {block_size} tokens "
                f"of {self.layout.name or 'the model'} ({n * block_size:,} tokens)")

    def to_dict(self, block_size: int) -> dict[str, Any]:
        """The breakdown as a JSON-ready dict (bytes, and the block count)."""
        return {"box": self.box.describe(), "gpu": self.box.gpu.name, "gpus": self.box.gpus,
                "gpu_memory_utilization": self.box.gpu_memory_utilization,
                "total_bytes": round(self.total_bytes),
                "weights_bytes": round(self.weights_bytes),
                "activation_bytes": round(self.activation_bytes),
                "reserve_bytes": round(self.reserve_bytes), "kv_bytes": round(self.kv_bytes),
                "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
                "block_size": block_size, "blocks": self.blocks(block_size)}


def kv_cache_bytes(box: Box, layout: KVLayout | str, params: float | None = None, *,
                   max_num_batched_tokens: int, max_num_seqs: int = 256,
                   dims: ModelDims | None = None, weight_bytes_per_param: float = 2.0,
                   reserve_bytes_per_gpu: float = DEFAULT_RESERVE_BYTES,
                   activation_bytes: float | None = None) -> KVCapacity:
    """The KV cache vLLM would allocate on ``box`` for ``layout`` (the formula of the
    module docstring), as a `KVCapacity` breakdown.

    ``params`` are the parameters stored (for a mixture of experts, every expert); by
    default ``dims.total_params``, else `kvevict.cost.MODEL_PARAMS`. ``activation_bytes``
    (per GPU) replaces the estimate (`activation_bytes_per_gpu`), e.g. with the figure a
    vLLM log prints; ``reserve_bytes_per_gpu`` the non-torch reserve.

    Raises:
        ConfigError: bad arguments, or the model does not fit (the message has the numbers).
    """
    if not isinstance(box, Box):
        raise ConfigError(f"box must be a Box, got {type(box).__name__}")
    lay = _layout(layout)
    n = box.gpus
    per_gpu_kv = kv_bytes_per_token_per_gpu(lay, n)
    weights = _stored_params(lay, params, dims) * _positive_number(
        "weight_bytes_per_param", weight_bytes_per_param)
    if activation_bytes is None:
        act = activation_bytes_per_gpu(lay, max_num_batched_tokens=max_num_batched_tokens,
                                       max_num_seqs=max_num_seqs, gpus=n, dims=dims)
    else:
        act = _positive_number("activation_bytes", activation_bytes)
    if isinstance(reserve_bytes_per_gpu, bool) or not isinstance(
            reserve_bytes_per_gpu, (int, float)) or not (
            math.isfinite(reserve_bytes_per_gpu) and reserve_bytes_per_gpu >= 0):
        raise ConfigError(f"reserve_bytes_per_gpu must be a finite number >= 0, got "
                          f"{reserve_bytes_per_gpu!r}")
    total = box.usable_bytes
    kv = total - weights - n * act - n * reserve_bytes_per_gpu
    cap = KVCapacity(box=box, layout=lay, total_bytes=total, weights_bytes=weights,
                     activation_bytes=n * act, reserve_bytes=n * float(reserve_bytes_per_gpu),
                     kv_bytes=kv, kv_bytes_per_token_per_gpu=per_gpu_kv)
    if kv <= 0:
        raise ConfigError(
            f"{lay.name or 'the model'} does not fit on {box.describe()}: "
            f"{total / GIB:,.2f} GiB usable - {weights / GIB:,.2f} GiB weights - "
            f"{cap.activation_bytes / GIB:,.2f} GiB activation peak - "
            f"{cap.reserve_bytes / GIB:,.2f} GiB reserve leaves {kv / GIB:,.2f} GiB for KV; "
            "use more GPUs, a larger GPU or a higher utilization")
    return cap


def check_capacity(requested_blocks: int, capacity: KVCapacity, block_size: int, *,
                   allow_oversubscribe: bool, label: str | None = None,
                   flag: str = "--allow-oversubscribe") -> bool:
    """Check that ``requested_blocks`` fit in what ``capacity`` leaves for KV.

    Returns True when the request is larger than the box (allowed with
    ``allow_oversubscribe``: a what-if the caller should record), False when it fits.
    ``label`` names what the user asked for (default ``"--cache-blocks N (X GiB)"``);
    ``flag`` is the option that allows it.

    Raises:
        ConfigError: more blocks than the box holds and not ``allow_oversubscribe``; the
            message names both numbers, in blocks and GiB, and ``flag``.
    """
    requested = _positive_int("requested_blocks", requested_blocks)
    if not isinstance(capacity, KVCapacity):
        raise ConfigError(f"capacity must be a KVCapacity (kv_cache_bytes), got "
                          f"{type(capacity).__name__}")
    if not isinstance(allow_oversubscribe, bool):
        raise ConfigError(f"allow_oversubscribe must be True or False, got "
                          f"{allow_oversubscribe!r}")
    available = capacity.blocks(block_size)
    if requested <= available:
        return False
    if allow_oversubscribe:
        return True
    req_gib = capacity.block_bytes(requested, block_size) / GIB
    avail_gib = capacity.block_bytes(available, block_size) / GIB
    asked = (f"--cache-blocks {requested:,} ({req_gib:,.1f} GiB)" if label is None
             else f"{label} ({requested:,} blocks, {req_gib:,.1f} GiB)")
    raise ConfigError(
        f"{asked} is more than the box holds: {capacity.box.describe()} leaves "
        f"{available:,} blocks ({avail_gib:,.1f} GiB) for KV; pass {flag} to simulate it "
        "anyway (a what-if the box could not run)")
