"""Tests for kvevict.box: GPU profiles, the vLLM-style KV capacity, tensor parallelism in the
cost model, "this machine" from a calibration, and the oversubscription check.

Every capacity below is computed by hand from the formula of ``kvevict/box.py``; the vLLM
comparison uses the startup log a vLLM maintainer posted in vllm-project/vllm PR #10511.
"""

from __future__ import annotations

import json
import math
import os

import attrs
import pytest

from kvevict.box import (
    DEFAULT_RESERVE_BYTES,
    GPU_PROFILES,
    MODEL_DIMS,
    SAMPLER_BYTES_PER_LOGIT,
    Box,
    GpuProfile,
    KVCapacity,
    ModelDims,
    activation_bytes_per_gpu,
    check_capacity,
    gpu_profile,
    kv_bytes_per_token_per_gpu,
    kv_cache_bytes,
)
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import PRESETS, KVLayout, preset

GIB = 1 << 30
MIB = 1 << 20


def h100(gpus: int = 1, util: float = 0.9) -> Box:
    return Box(gpu_profile("h100-sxm-80gb"), gpus=gpus, gpu_memory_utilization=util)


# ----------------------------------------------------------------------------- profiles


def test_profiles_cover_the_issue_list_with_sources():
    assert set(GPU_PROFILES) == {"h100-sxm-80gb", "h200-141gb", "a100-80gb", "a100-40gb",
                                 "l40s-48gb", "l4-24gb", "rtx-4090-24gb"}
    for p in GPU_PROFILES.values():
        assert p.calibrated is None
        assert "datasheet" in p.source or "whitepaper" in p.source
    # dense BF16, not the "with sparsity" figure the datasheets print first
    assert GPU_PROFILES["h100-sxm-80gb"].bf16_dense_flops == 989e12
    assert GPU_PROFILES["a100-80gb"].bf16_dense_flops == 312e12
    assert GPU_PROFILES["l4-24gb"].bf16_dense_flops == 121e12
    assert GPU_PROFILES["l40s-48gb"].bf16_dense_flops == 362.05e12
    assert GPU_PROFILES["rtx-4090-24gb"].bf16_dense_flops == 165.2e12
    # memory as nvidia-smi reports it
    assert GPU_PROFILES["h100-sxm-80gb"].memory_bytes == 81559 * MIB
    assert GPU_PROFILES["l40s-48gb"].memory_bytes == 46068 * MIB
    assert GPU_PROFILES["l4-24gb"].memory_bytes == 23040 * MIB
    assert GPU_PROFILES["h200-141gb"].hbm_bytes_per_s == 4.8e12


def test_gpu_profile_lookup_is_tolerant_and_names_the_valid_ones():
    assert gpu_profile("H100-SXM-80GB") is GPU_PROFILES["h100-sxm-80gb"]
    assert gpu_profile(" rtx_4090_24gb ") is GPU_PROFILES["rtx-4090-24gb"]
    with pytest.raises(ConfigError) as err:
        gpu_profile("h100")
    assert "unknown GPU 'h100'" in str(err.value)
    for name in GPU_PROFILES:
        assert name in str(err.value)
    with pytest.raises(ConfigError):
        gpu_profile(None)  # type: ignore[arg-type]


def test_a_profile_needs_every_rate_unless_calibrated():
    with pytest.raises(ConfigError, match="needs hbm_bytes_per_s"):
        GpuProfile("x", "X", 1 << 30, None, 1e12, 1e9, 1e9, "made up")
    with pytest.raises(ConfigError, match="memory_bytes"):
        GpuProfile("x", "X", 0, 1e12, 1e12, 1e9, 1e9, "made up")
    with pytest.raises(ConfigError, match="interconnect_bytes_per_s"):
        GpuProfile("x", "X", 1 << 30, 1e12, 1e12, 1e9, -1.0, "made up")


# ----------------------------------------------------------------------------- the box


def test_box_validates_utilization_and_degree():
    p = gpu_profile("a100-40gb")
    assert Box(p).gpu_memory_utilization == 0.9
    assert Box(p, gpu_memory_utilization=1.0).usable_bytes == 40960 * MIB
    for bad in (0, 0.0, -0.1, 1.01, math.nan, True, "0.9"):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            Box(p, gpu_memory_utilization=bad)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="gpus"):
            Box(p, gpus=bad)
    with pytest.raises(ConfigError, match="GpuProfile"):
        Box("a100-40gb")  # type: ignore[arg-type]
    box = Box(p, host_memory_bytes=512 * GIB, disk_bytes=4096 * GIB)
    assert (box.host_memory_bytes, box.disk_bytes) == (512 * GIB, 4096 * GIB)
    with pytest.raises(ConfigError, match="host_memory_bytes"):
        Box(p, host_memory_bytes=0)
    assert h100(2).describe() == "2 x H100 SXM 80 GB at 0.9 utilization"


# ----------------------------------------------------------------------------- capacity


def test_llama3_8b_on_one_h100_by_hand():
    cap = kv_cache_bytes(h100(), "llama-3-8b", max_num_batched_tokens=8192)
    total = 81559 * MIB * 0.9  # nvidia-smi's 81,559 MiB x 0.9
    weights = 8.03e9 * 2  # MODEL_PARAMS x bf16
    forward = 8192 * 2 * (2 * 4096 + 3 * 14336)  # 838,860,800
    sampler = 256 * 128256 * 30 + 8192 * 4096 * 2  # 1,052,114,944: the larger
    assert forward == 838_860_800 and sampler == 1_052_114_944
    kv = total - weights - sampler - GIB
    assert cap.total_bytes == total
    assert cap.weights_bytes == weights
    assert cap.activation_bytes == sampler
    assert cap.reserve_bytes == GIB
    assert cap.kv_bytes == kv
    assert cap.kv_bytes_per_token_per_gpu == 131072
    assert cap.blocks(16) == math.floor(kv / (131072 * 16)) == 28029
    assert cap.blocks(512) == 875
    assert cap.text(16) == (
        "1 x H100 SXM 80 GB at 0.9 utilization: 71.68 GiB usable - 14.96 GiB weights - "
        "0.98 GiB activation peak - 1.00 GiB reserve = 54.75 GiB for KV: 28,029 blocks of "
        "16 tokens of llama-3-8b (448,464 tokens)")
    d = cap.to_dict(16)
    assert (d["blocks"], d["gpus"], d["kv_bytes"]) == (28029, 1, round(kv))


def test_matches_the_published_vllm_log_within_three_percent():
    """vllm-project/vllm PR #10511 (comment of 2024-12-14), ``vllm serve
    meta-llama/Meta-Llama-3-8B`` on one H100 80GB at gpu_memory_utilization 0.90 (V0 engine,
    max_num_batched_tokens 8192, max_num_seqs 256): total_gpu_memory 79.22 GiB, model weights
    14.96 GiB, non_torch_memory 1.79 GiB, PyTorch activation peak 1.26 GiB,
    available_kv_cache_memory 53.29 GiB; with -tp 2 the weights take 7.48 GiB per GPU."""
    logged_kv_gib = 53.29
    cap = kv_cache_bytes(h100(), "llama-3-8b", max_num_batched_tokens=8192, max_num_seqs=256)
    ours = cap.kv_bytes / GIB
    assert ours == pytest.approx(54.746, abs=1e-3)
    assert abs(ours / logged_kv_gib - 1) < 0.03  # +2.7%: see docs/box.md for the budget
    assert cap.weights_bytes / GIB == pytest.approx(14.96, abs=0.005)
    tp2 = kv_cache_bytes(h100(2), "llama-3-8b", max_num_batched_tokens=8192)
    assert tp2.weights_bytes / 2 / GIB == pytest.approx(7.48, abs=0.005)
    # with the log's own measured terms and total, the formula gives the log's figure
    logged = Box(attrs.evolve(gpu_profile("h100-sxm-80gb"), memory_bytes=round(79.22 * GIB)))
    exact = kv_cache_bytes(logged, "llama-3-8b", params=14.96 * GIB / 2,
                           max_num_batched_tokens=8192, activation_bytes=1.26 * GIB,
                           reserve_bytes_per_gpu=1.79 * GIB)
    assert exact.kv_bytes / GIB == pytest.approx(logged_kv_gib, abs=0.006)


def test_tensor_parallel_halves_kv_bytes_per_gpu():
    llama = preset("llama-3-8b")  # 8 KV heads
    assert kv_bytes_per_token_per_gpu(llama, 1) == 131072
    assert kv_bytes_per_token_per_gpu(llama, 2) == 65536
    assert kv_bytes_per_token_per_gpu(llama, 8) == 16384
    # fewer KV heads than GPUs: one head per GPU, replicated (vLLM does the same)
    assert kv_bytes_per_token_per_gpu("llama-3-70b", 16) == 80 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token_per_gpu("llama-3-70b", 8) == 80 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token_per_gpu("qwen2.5-0.5b", 2) == 24 * 2 * 1 * 64 * 2
    # an MLA latent is on every GPU
    assert kv_bytes_per_token_per_gpu("deepseek-v3", 8) == 70272
    with pytest.raises(ConfigError, match="8 KV heads, which do not split over 3 GPUs"):
        kv_bytes_per_token_per_gpu(llama, 3)
    with pytest.raises(ConfigError, match="71 attention heads, which do not split over 2"):
        kv_bytes_per_token_per_gpu("falcon-7b", 2)  # MQA: one KV head, 71 query heads
    with pytest.raises(ConfigError, match="fewer than 8 GPUs and not a divisor"):
        kv_bytes_per_token_per_gpu(KVLayout.gqa(2, 24, 3, 64, "bf16"), 8)
    one = kv_cache_bytes(h100(), llama, max_num_batched_tokens=2048)
    two = kv_cache_bytes(h100(2), llama, max_num_batched_tokens=2048)
    assert two.kv_bytes_per_token_per_gpu * 2 == one.kv_bytes_per_token_per_gpu
    assert two.blocks(16) == math.floor(two.kv_bytes / 2 / (65536 * 16))
    # two GPUs: twice the memory, the weights once, activation and reserve on each
    assert two.kv_bytes == pytest.approx(2 * 81559 * MIB * 0.9 - 16.06e9
                                         - 2 * two.activation_bytes / 2 - 2 * GIB)


def test_activation_estimate_by_hand_and_overrides():
    # forward-bound: many tokens, few sequences
    assert activation_bytes_per_gpu("llama-3-8b", max_num_batched_tokens=16384,
                                    max_num_seqs=16) == 16384 * 2 * (8192 + 3 * 14336)
    # tensor parallelism splits the MLP, not the residual
    assert activation_bytes_per_gpu("llama-3-8b", max_num_batched_tokens=16384,
                                    max_num_seqs=16, gpus=2) == 16384 * 2 * (8192 + 21504)
    # sampled rows are at most the tokens
    assert activation_bytes_per_gpu("llama-3-8b", max_num_batched_tokens=8,
                                    max_num_seqs=256) == max(
        8 * 2 * (8192 + 43008), 8 * 128256 * SAMPLER_BYTES_PER_LOGIT + 8 * 4096 * 2)
    assert MODEL_DIMS["falcon-7b"].gated_mlp is False
    assert activation_bytes_per_gpu("falcon-7b", max_num_batched_tokens=16384,
                                    max_num_seqs=1) == 16384 * 2 * (2 * 4544 + 2 * 18176)
    custom = KVLayout.gqa(4, 8, 2, 64, "bf16")  # no name: no known sizes
    with pytest.raises(ConfigError, match="pass dims=ModelDims"):
        kv_cache_bytes(h100(), custom, params=1e8, max_num_batched_tokens=512)
    dims = ModelDims(512, 1024, 1000)
    cap = kv_cache_bytes(h100(), custom, params=1e8, max_num_batched_tokens=512, dims=dims,
                         reserve_bytes_per_gpu=0)
    forward, sampler = 512 * 2 * (1024 + 3 * 1024), 256 * 1000 * 30 + 512 * 512 * 2
    assert (forward, sampler) == (4_194_304, 8_204_288)
    assert cap.activation_bytes == sampler
    assert cap.kv_bytes == 81559 * MIB * 0.9 - 2e8 - cap.activation_bytes
    fixed = kv_cache_bytes(h100(), custom, params=1e8, max_num_batched_tokens=512,
                           activation_bytes=GIB)
    assert fixed.activation_bytes == GIB and fixed.reserve_bytes == DEFAULT_RESERVE_BYTES
    with pytest.raises(ConfigError, match="no parameter count known"):
        kv_cache_bytes(h100(), custom, max_num_batched_tokens=512, dims=dims)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        kv_cache_bytes(h100(), "llama-3-8b", max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="reserve_bytes_per_gpu"):
        kv_cache_bytes(h100(), "llama-3-8b", max_num_batched_tokens=512,
                       reserve_bytes_per_gpu=-1)


def test_mixture_of_experts_weighs_every_expert():
    box = Box(gpu_profile("h200-141gb"), gpus=8)
    with pytest.raises(ConfigError, match=r"1,249\.83 GiB weights"):  # 671e9 in bf16
        kv_cache_bytes(box, "deepseek-v3", max_num_batched_tokens=2048)
    cap = kv_cache_bytes(box, "deepseek-v3", max_num_batched_tokens=2048,
                         weight_bytes_per_param=1.0)  # served in FP8, as DeepSeek ships it
    assert cap.weights_bytes == 671e9  # not the 37e9 active per token
    assert cap.kv_bytes_per_token_per_gpu == 70272


def test_a_model_that_does_not_fit_is_an_error_with_the_numbers():
    with pytest.raises(ConfigError) as err:
        kv_cache_bytes(Box(gpu_profile("l4-24gb")), "llama-3-70b", max_num_batched_tokens=2048)
    msg = str(err.value)
    assert msg.startswith("llama-3-70b does not fit on 1 x L4 24 GB at 0.9 utilization: "
                          "20.25 GiB usable - 131.50 GiB weights")
    assert "leaves -113.20 GiB for KV" in msg


# ----------------------------------------------------------------------------- oversubscribe


def test_check_capacity_names_both_numbers_and_the_flag():
    cap = kv_cache_bytes(h100(), "llama-3-8b", max_num_batched_tokens=8192)
    assert check_capacity(875, cap, 512, allow_oversubscribe=False) is False
    assert check_capacity(5000, cap, 512, allow_oversubscribe=True) is True
    with pytest.raises(ConfigError) as err:
        check_capacity(5000, cap, 512, allow_oversubscribe=False)
    assert str(err.value) == (
        "--cache-blocks 5,000 (312.5 GiB) is more than the box holds: 1 x H100 SXM 80 GB at "
        "0.9 utilization leaves 875 blocks (54.7 GiB) for KV; pass --allow-oversubscribe to "
        "simulate it anyway (a what-if the box could not run)")
    with pytest.raises(ConfigError) as err:
        check_capacity(876, cap, 512, allow_oversubscribe=False, label="--cache-gib 54.75",
                       flag="--oversubscribe")
    assert str(err.value).startswith("--cache-gib 54.75 (876 blocks, 54.8 GiB) is more than")
    assert "pass --oversubscribe" in str(err.value)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="requested_blocks"):
            check_capacity(bad, cap, 512, allow_oversubscribe=False)
    with pytest.raises(ConfigError, match="allow_oversubscribe"):
        check_capacity(1, cap, 512, allow_oversubscribe="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="KVCapacity"):
        check_capacity(1, 875, 512, allow_oversubscribe=False)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- cost model


def test_one_h100_reproduces_the_default_cost_model_exactly():
    assert h100().cost_model("llama-3-8b") == CostModel()
    assert h100().cost_model(preset("mistral-7b")) == CostModel.for_model("mistral-7b")
    a100 = Box(gpu_profile("a100-80gb")).cost_model("llama-3-8b")
    assert a100 == CostModel.for_model("llama-3-8b", peak_flops=312e12,
                                       hbm_bytes_per_s=2.039e12, link_bytes_per_s=32e9)
    with pytest.raises(ConfigError, match="give the model's layout"):
        h100().cost_model()


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_tensor_parallel_cost_model_by_hand(gpus):
    cm = h100(gpus).cost_model("llama-3-8b")
    ring = 2 * (gpus - 1) / gpus
    all_reduce = 2 * 32 * ring * 4096 * 2 / 450e9
    assert cm.linear_s_per_token == pytest.approx(
        2 * 8.03e9 / (gpus * 989e12 * 0.5) + all_reduce, rel=1e-12)
    assert cm.attn_s_per_pair == pytest.approx(4 * 32 * 4096 / (gpus * 989e12 * 0.5),
                                               rel=1e-12)
    assert cm.decode_step_s == pytest.approx(2 * 8.03e9 / (gpus * 3.35e12), rel=1e-12)
    assert cm.decode_s_per_seq == pytest.approx(all_reduce, rel=1e-12)
    assert cm.decode_s_per_context_token == pytest.approx(131072 / gpus / 3.35e12, rel=1e-12)
    assert cm.reload_bytes_per_s == pytest.approx(gpus * 64e9, rel=1e-12)
    assert cm.kv_bytes_per_token == 131072  # a block's logical size, for reload sizes
    if gpus == 2:  # the ring factor is 1: 2 all-reduces x 32 layers x 8 KiB per token
        assert all_reduce == 524288 / 450e9


def test_replicated_heads_do_not_speed_up_the_kv_read():
    lay = KVLayout.gqa(24, 16, 2, 64, "bf16", name="small")  # 2 KV heads on 4 GPUs
    cm = Box(gpu_profile("l40s-48gb"), gpus=4).cost_model(
        lay, 1e9, dims=ModelDims(1024, 4096, 32000))
    per_gpu = 24 * 2 * 1 * 64 * 2  # one head per GPU
    assert cm.decode_s_per_context_token == pytest.approx(per_gpu / 864e9, rel=1e-12)
    assert cm.reload_bytes_per_s == pytest.approx(32e9 * 2, rel=1e-12)  # 2 distinct shards
    assert cm.decode_s_per_seq == pytest.approx(2 * 24 * 1.5 * 1024 * 2 / 32e9, rel=1e-12)
    with pytest.raises(ConfigError, match="no model sizes known for 'small'"):
        Box(gpu_profile("l40s-48gb"), gpus=4).cost_model(lay, 1e9)


# ----------------------------------------------------------------------------- this machine


def write_calibration(path, cost: CostModel, **engine):
    path.write_text(json.dumps({"cost_model": cost.to_dict(), "engine": engine,
                                "fit": {}, "samples": [], "seconds": 1.0}))
    return path


def test_this_machine_yields_exactly_the_calibrated_cost_model(tmp_path):
    measured = CostModel(linear_s_per_token=3e-5, attn_s_per_pair=1e-9,
                         prefill_overhead_s=2e-3, decode_step_s=4e-3, decode_s_per_seq=1e-4,
                         decode_s_per_context_token=2e-8, kv_bytes_per_token=4096,
                         decode_pads_batch=True)
    path = write_calibration(tmp_path / "cal.json", measured, device="cpu",
                             date="2025-01-02", device_memory_bytes=8 * GIB)
    prof = GpuProfile.from_calibration(path)
    assert prof.calibrated == CostModel.load(path) == measured
    assert prof.memory_bytes == 8 * GIB
    assert prof.label == "this machine (cpu, calibrated, 2025-01-02)"
    box = Box(prof)
    assert box.cost_model() == measured
    assert box.cost_model("llama-3-8b", 8.03e9) == measured  # the calibration's own model
    assert GpuProfile.from_calibration(path, memory_bytes=GIB).memory_bytes == GIB
    with pytest.raises(ConfigError, match="calibration of one device"):
        Box(prof, gpus=2)
    cap = kv_cache_bytes(box, "qwen2.5-0.5b", max_num_batched_tokens=512, max_num_seqs=8)
    assert cap.total_bytes == 8 * GIB * 0.9


def test_this_machine_measures_its_memory_when_the_file_does_not_say(tmp_path):
    path = write_calibration(tmp_path / "cal.json", CostModel(), device="cpu")
    assert GpuProfile.from_calibration(path).memory_bytes == (
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    odd = write_calibration(tmp_path / "odd.json", CostModel(), device="mps")
    with pytest.raises(ConfigError, match="pass memory_bytes="):
        GpuProfile.from_calibration(odd)
    assert GpuProfile.from_calibration(odd, memory_bytes=GIB).memory_bytes == GIB
    with pytest.raises(ConfigError, match="does not exist"):
        GpuProfile.from_calibration(tmp_path / "missing.json")


def test_every_preset_has_dims_and_fits_an_h200():
    assert set(MODEL_DIMS) == set(PRESETS)
    for name in PRESETS:
        gpus = 8 if name == "deepseek-v3" else 1
        if name == "llama-3-70b":
            gpus = 2
        cap = kv_cache_bytes(Box(gpu_profile("h200-141gb"), gpus=gpus), name,
                             max_num_batched_tokens=2048,
                             weight_bytes_per_param=1.0 if name == "deepseek-v3" else 2.0)
        assert isinstance(cap, KVCapacity) and cap.blocks(16) > 0
