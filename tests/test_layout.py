"""Tests for kvevict.layout: exact KV-cache byte counts, HF config parsing, presets, errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
import torch

from kvevict.errors import ConfigError
from kvevict.layout import (
    ATTENTION_KINDS,
    DTYPE_ALIASES,
    PRESETS,
    KVLayout,
    from_hf_config,
    preset,
)

# ----------------------------------------------------------------- HF-style configs (values
# from the published config.json files)


def llama3_8b_cfg(**overrides):
    fields = {
        "model_type": "llama", "_name_or_path": "llama-3-8b", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "head_dim": 128, "torch_dtype": "bfloat16",
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def deepseek_v3_cfg(**overrides):
    fields = {
        "model_type": "deepseek_v3", "_name_or_path": "deepseek-v3", "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "torch_dtype": "bfloat16",
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


# Namespaces equivalent to each preset: no head_dim where the real config has none.
PRESET_CONFIGS = {
    "llama-3-8b": llama3_8b_cfg(),
    "llama-3-70b": SimpleNamespace(
        model_type="llama", _name_or_path="llama-3-70b", num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, hidden_size=8192, torch_dtype="bfloat16",
    ),
    "llama-2-7b": SimpleNamespace(
        model_type="llama", _name_or_path="llama-2-7b", num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, hidden_size=4096,
        torch_dtype="bfloat16",
    ),
    "mistral-7b": SimpleNamespace(
        model_type="mistral", _name_or_path="mistral-7b", num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, head_dim=None,
        torch_dtype="bfloat16",
    ),
    "qwen2-7b": SimpleNamespace(
        model_type="qwen2", _name_or_path="qwen2-7b", num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, hidden_size=3584, torch_dtype="bfloat16",
    ),
    "qwen2.5-0.5b": SimpleNamespace(
        model_type="qwen2", _name_or_path="qwen2.5-0.5b", num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, hidden_size=896, torch_dtype="bfloat16",
    ),
    "falcon-7b": SimpleNamespace(
        model_type="falcon", _name_or_path="falcon-7b", num_hidden_layers=32,
        num_attention_heads=71, num_key_value_heads=1, hidden_size=4544,
        torch_dtype="bfloat16",
    ),
    "deepseek-v3": deepseek_v3_cfg(),
    "deepseek-v2-lite": SimpleNamespace(
        model_type="deepseek_v2", _name_or_path="deepseek-v2-lite", num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, hidden_size=2048, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        torch_dtype="bfloat16",
    ),
}


# ----------------------------------------------------------------- exact sizes


def test_llama3_8b_bytes_per_token_and_block():
    layout = KVLayout.gqa(32, 32, 8, 128, "bf16")
    assert layout.kv_planes == 2
    assert layout.dtype_bytes == 2
    assert layout.elements_per_token == 32 * 2 * 8 * 128
    assert layout.bytes_per_token == 131072  # 128 KiB
    assert layout.bytes_per_block(16) == 2097152  # 2 MiB
    assert layout.bytes_per_block(1) == 131072


def test_llama2_7b_mha_bytes_per_token():
    layout = KVLayout.mha(32, 32, 128, "bfloat16")
    assert layout.attention == "mha"
    assert layout.bytes_per_token == 524288


def test_falcon_mqa_bytes_per_token():
    layout = KVLayout.mqa(32, 71, 64, "bf16")
    assert layout.attention == "mqa"
    assert layout.num_kv_heads == 1
    assert layout.bytes_per_token == 32 * 2 * 1 * 64 * 2 == 8192


def test_deepseek_v3_mla_bytes_per_token():
    layout = KVLayout.mla(61, 512, 64, "bf16", num_attention_heads=128)
    assert layout.kv_planes == 1
    assert layout.num_kv_heads == 1
    assert layout.head_dim == 576
    assert layout.bytes_per_token == 61 * 576 * 2 == 70272
    assert layout.bytes_per_block(64) == 70272 * 64


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dtype_scaling(name):
    bf16 = PRESETS[name]
    fp8 = attrs.evolve(bf16, dtype="fp8")
    fp32 = attrs.evolve(bf16, dtype="fp32")
    assert fp8.bytes_per_token * 2 == bf16.bytes_per_token
    assert fp32.bytes_per_token == 2 * bf16.bytes_per_token
    assert fp8.dtype == torch.float8_e4m3fn
    assert fp32.dtype == torch.float32


@pytest.mark.parametrize(
    ("spelling", "expected", "itemsize"),
    [
        ("float32", torch.float32, 4),
        ("fp32", torch.float32, 4),
        ("float16", torch.float16, 2),
        ("fp16", torch.float16, 2),
        ("half", torch.float16, 2),
        ("bfloat16", torch.bfloat16, 2),
        ("bf16", torch.bfloat16, 2),
        ("float8_e4m3fn", torch.float8_e4m3fn, 1),
        ("fp8", torch.float8_e4m3fn, 1),
        ("fp8_e4m3", torch.float8_e4m3fn, 1),
        ("float8_e5m2", torch.float8_e5m2, 1),
        ("fp8_e5m2", torch.float8_e5m2, 1),
        ("int8", torch.int8, 1),
        ("uint8", torch.uint8, 1),
        ("BF16", torch.bfloat16, 2),
        ("torch.float16", torch.float16, 2),
        (torch.float64, torch.float64, 8),
    ],
)
def test_dtype_spellings(spelling, expected, itemsize):
    layout = KVLayout.mha(2, 4, 8, spelling)
    assert layout.dtype == expected
    assert layout.dtype_bytes == itemsize
    assert layout.bytes_per_token == 2 * 2 * 4 * 8 * itemsize


def test_dtype_aliases_all_resolve_to_dtypes():
    assert all(isinstance(d, torch.dtype) for d in DTYPE_ALIASES.values())
    assert ATTENTION_KINDS == ("mha", "gqa", "mqa", "mla")


def test_default_dtype_is_float16():
    assert KVLayout.mha(1, 1, 1).dtype == torch.float16
    assert KVLayout.mla(1, 4, 2).dtype == torch.float16


# ----------------------------------------------------------------- shapes and capacity


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_tensor_shape_matches_bytes(name):
    layout = PRESETS[name]
    shape = layout.tensor_shape(3, 16)
    assert shape == (
        layout.num_layers, layout.kv_planes, 3, 16, layout.num_kv_heads, layout.head_dim,
    )
    assert math.prod(shape) * layout.dtype_bytes == 3 * layout.bytes_per_block(16)


def test_tensor_shape_values_and_real_tensor():
    assert preset("llama-3-8b").tensor_shape(10, 16) == (32, 2, 10, 16, 8, 128)
    assert preset("deepseek-v3").tensor_shape(2, 64) == (61, 1, 2, 64, 1, 576)
    small = KVLayout.gqa(2, 4, 2, 8, "bf16")
    pool = torch.empty(small.tensor_shape(5, 4), dtype=small.dtype)
    assert pool.numel() * pool.element_size() == 5 * small.bytes_per_block(4)


def test_blocks_for_bytes():
    layout = preset("llama-3-8b")  # 2 MiB per 16-token block
    assert layout.blocks_for_bytes(2097152 * 10, 16) == 10
    assert layout.blocks_for_bytes(2097152 * 10 - 1, 16) == 9
    assert layout.blocks_for_bytes(2097152 * 10 + 2097151, 16) == 10
    assert layout.blocks_for_bytes(0, 16) == 0
    assert layout.blocks_for_bytes(80 * 2**30, 16) == 40960
    assert layout.blocks_for_bytes(0.5 * 2**30, 16) == 256
    assert layout.blocks_for_bytes(np.int64(2097152 * 3), 16) == 3


def test_tokens_per_gib():
    assert preset("llama-3-8b").tokens_per_gib() == 8192
    assert preset("deepseek-v3").tokens_per_gib() == 2**30 // 70272 == 15279
    # rounded down to whole 16-token blocks
    assert preset("deepseek-v3").tokens_per_gib(16) == 15264


def test_layout_is_frozen_and_hashable():
    layout = preset("llama-3-8b")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.num_layers = 1
    assert hash(layout) == hash(KVLayout.gqa(32, 32, 8, 128, "bf16", name="llama-3-8b"))


def test_numpy_integers_are_normalised_to_int():
    layout = KVLayout.gqa(np.int64(32), 32, np.int32(8), 128, "bf16")
    assert type(layout.num_layers) is int
    assert type(layout.num_kv_heads) is int
    assert layout.bytes_per_token == 131072


def test_attention_name_is_case_insensitive():
    assert KVLayout("GQA", 2, 2, 8, "bf16", num_attention_heads=4).attention == "gqa"


# ----------------------------------------------------------------- from_hf_config


def test_from_hf_config_llama3_gqa():
    layout = from_hf_config(llama3_8b_cfg())
    assert layout.attention == "gqa"
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert layout.num_attention_heads == 32
    assert layout.dtype == torch.bfloat16
    assert layout.bytes_per_token == 131072
    assert layout.name == "llama-3-8b"


def test_from_hf_config_qwen2_derives_head_dim():
    cfg = PRESET_CONFIGS["qwen2-7b"]
    assert not hasattr(cfg, "head_dim")
    layout = from_hf_config(cfg)
    assert layout.attention == "gqa"
    assert layout.head_dim == 3584 // 28 == 128
    assert layout.bytes_per_token == 28 * 2 * 4 * 128 * 2 == 57344


def test_from_hf_config_mistral_head_dim_none_is_derived():
    layout = from_hf_config(PRESET_CONFIGS["mistral-7b"])
    assert layout.head_dim == 128
    assert layout.bytes_per_token == 131072


def test_from_hf_config_explicit_head_dim_wins_over_hidden_size():
    # Gemma-style: head_dim is not hidden_size // heads
    layout = from_hf_config(llama3_8b_cfg(hidden_size=3072, head_dim=256))
    assert layout.head_dim == 256


def test_from_hf_config_without_kv_heads_is_mha():
    cfg = SimpleNamespace(
        model_type="gpt_neox", num_hidden_layers=32, num_attention_heads=32, hidden_size=4096
    )
    layout = from_hf_config(cfg)
    assert layout.attention == "mha"
    assert layout.num_kv_heads == 32
    assert layout.head_dim == 128
    assert layout.dtype == torch.float16  # no dtype anywhere -> float16
    assert layout.bytes_per_token == 32 * 2 * 32 * 128 * 2 == 524288
    assert layout.name == "gpt_neox"


def test_from_hf_config_single_kv_head_is_mqa():
    layout = from_hf_config(PRESET_CONFIGS["falcon-7b"])
    assert layout.attention == "mqa"
    assert layout.bytes_per_token == 8192


def test_from_hf_config_falcon_legacy_multi_query_flag():
    cfg = SimpleNamespace(
        model_type="falcon", num_hidden_layers=32, num_attention_heads=71, num_kv_heads=71,
        hidden_size=4544, multi_query=True, new_decoder_architecture=False,
        torch_dtype="bfloat16",
    )
    layout = from_hf_config(cfg)
    assert layout.attention == "mqa"
    assert layout.bytes_per_token == 8192

    # falcon-40b style: new decoder architecture, grouped KV heads in num_kv_heads
    cfg40 = SimpleNamespace(
        model_type="falcon", num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
        hidden_size=8192, multi_query=True, new_decoder_architecture=True,
    )
    layout40 = from_hf_config(cfg40)
    assert (layout40.attention, layout40.num_kv_heads, layout40.head_dim) == ("gqa", 8, 64)


def test_from_hf_config_single_head_is_mha():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 1, "hidden_size": 64}
    assert from_hf_config(cfg).attention == "mha"


def test_from_hf_config_deepseek_v3_mla():
    layout = from_hf_config(deepseek_v3_cfg())
    assert layout.attention == "mla"
    assert layout.num_kv_heads == 1  # the config's num_key_value_heads=128 is ignored
    assert layout.head_dim == 576
    assert (layout.kv_lora_rank, layout.qk_rope_head_dim) == (512, 64)
    assert layout.num_attention_heads == 128
    assert layout.bytes_per_token == 70272


def test_from_hf_config_dict():
    cfg = {
        "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16",
    }
    layout = from_hf_config(cfg)
    assert layout.attention == "gqa"
    assert layout.bytes_per_token == 131072
    assert layout.name == "llama"
    mla = from_hf_config(vars(deepseek_v3_cfg()))
    assert mla.bytes_per_token == 70272


@pytest.mark.parametrize(
    ("cfg_dtype", "arg", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, None, torch.bfloat16),
        ({"torch_dtype": "float32"}, None, torch.float32),
        ({"torch_dtype": torch.float32}, None, torch.float32),
        ({"dtype": "bfloat16"}, None, torch.bfloat16),
        ({"torch_dtype": None, "dtype": "float32"}, None, torch.float32),
        ({}, None, torch.float16),
        ({"torch_dtype": "bfloat16"}, "fp8", torch.float8_e4m3fn),
        ({"torch_dtype": "bfloat16"}, torch.float32, torch.float32),
    ],
)
def test_from_hf_config_dtype_resolution(cfg_dtype, arg, expected):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, **cfg_dtype}
    assert from_hf_config(cfg, dtype=arg).dtype == expected


def test_from_hf_config_name_precedence():
    base = {"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 8}
    assert from_hf_config({**base, "model_type": "llama"}).name == "llama"
    named = {**base, "model_type": "llama", "_name_or_path": "meta-llama/Meta-Llama-3-8B"}
    assert from_hf_config(named).name == "meta-llama/Meta-Llama-3-8B"
    blank = {**base, "model_type": "llama", "_name_or_path": ""}
    assert from_hf_config(blank).name == "llama"
    assert from_hf_config(base).name is None


def test_classmethod_from_hf_config_is_the_module_function():
    assert KVLayout.from_hf_config(llama3_8b_cfg()) == from_hf_config(llama3_8b_cfg())
    assert KVLayout.from_hf_config(llama3_8b_cfg(), "fp32").dtype == torch.float32


def test_no_transformers_import():
    code = (
        "import sys, kvevict.layout as m; "
        "m.from_hf_config({'num_hidden_layers': 1, 'num_attention_heads': 1, 'hidden_size': 8}); "
        "sys.exit(1 if 'transformers' in sys.modules else 0)"
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root)


# ----------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESET_CONFIGS))
def test_preset_equals_from_hf_config(name):
    assert preset(name) == from_hf_config(PRESET_CONFIGS[name])


def test_every_preset_has_an_equivalent_config():
    assert set(PRESETS) == set(PRESET_CONFIGS)


@pytest.mark.parametrize(
    ("name", "attention", "bytes_per_token"),
    [
        ("llama-3-8b", "gqa", 131072),
        ("llama-3-70b", "gqa", 80 * 2 * 8 * 128 * 2),
        ("llama-2-7b", "mha", 524288),
        ("mistral-7b", "gqa", 131072),
        ("qwen2-7b", "gqa", 57344),
        ("qwen2.5-0.5b", "gqa", 24 * 2 * 2 * 64 * 2),
        ("falcon-7b", "mqa", 8192),
        ("deepseek-v3", "mla", 70272),
        ("deepseek-v2-lite", "mla", 27 * 576 * 2),
    ],
)
def test_preset_bytes_per_token(name, attention, bytes_per_token):
    layout = preset(name)
    assert layout.attention == attention
    assert layout.dtype == torch.bfloat16
    assert layout.bytes_per_token == bytes_per_token
    assert layout.name == name


def test_docs_preset_table_matches_presets():
    doc = Path(__file__).resolve().parent.parent / "docs" / "layout.md"
    rows = {}
    for line in doc.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
    assert set(rows) == set(PRESETS)
    for name, cells in rows.items():
        layout = PRESETS[name]
        expected = [
            layout.attention, str(layout.num_layers), str(layout.num_attention_heads),
            str(layout.num_kv_heads), str(layout.head_dim), f"{layout.bytes_per_token:,}",
            f"{layout.bytes_per_token / 1024:g}", f"{layout.bytes_per_block(16):,}",
            f"{layout.tokens_per_gib():,}",
        ]
        assert cells == expected, name


def test_preset_lookup_is_case_insensitive():
    assert preset("Llama-3-8B") is PRESETS["llama-3-8b"]


# ----------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, r"num_layers must be a positive int, got 0"),
        ({"num_layers": -3}, r"num_layers must be a positive int, got -3"),
        ({"num_layers": True}, r"num_layers must be a positive int, got True"),
        ({"num_layers": 2.0}, r"num_layers must be a positive int, got 2\.0 \(float\)"),
        ({"num_layers": "32"}, r"num_layers must be a positive int, got '32'"),
        ({"num_kv_heads": 0}, r"num_kv_heads must be a positive int, got 0"),
        ({"head_dim": False}, r"head_dim must be a positive int, got False"),
        ({"head_dim": None}, r"head_dim must be a positive int, got None"),
        ({"num_attention_heads": 0}, r"num_attention_heads \(when given\) must be a positive"),
        ({"attention": "sliding"}, r"attention must be one of 'mha', 'gqa', 'mqa', 'mla', got"),
        ({"attention": 2}, r"attention must be one of .*got 2"),
        ({"dtype": "float12"}, r"unknown dtype 'float12'; expected a torch\.dtype or one of"),
        ({"dtype": 2}, r"dtype must be a torch\.dtype or a string, got 2"),
        ({"name": 7}, r"name must be a str or None, got 7"),
        ({"kv_lora_rank": 512}, r"kv_lora_rank applies only to attention='mla'"),
        ({"num_attention_heads": 6}, r"multiple of num_kv_heads, got num_attention_heads=6"),
    ],
)
def test_invalid_fields(kwargs, match):
    fields = {
        "attention": "gqa", "num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype": "bf16",
        "num_attention_heads": 8,
    }
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        KVLayout(**fields)


def test_config_error_is_value_error():
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        KVLayout.mha(0, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"kv_lora_rank": None, "qk_rope_head_dim": 64},
            r"attention='mla' requires kv_lora_rank and qk_rope_head_dim, got kv_lora_rank=None",
        ),
        (
            {"kv_lora_rank": 512, "qk_rope_head_dim": None},
            r"requires kv_lora_rank and qk_rope_head_dim, got .*qk_rope_head_dim=None",
        ),
        (
            {"head_dim": 512},
            r"head_dim == kv_lora_rank \+ qk_rope_head_dim = 512 \+ 64 = 576, got head_dim=512",
        ),
        ({"num_kv_heads": 2}, r"num_kv_heads must be 1, got 2"),
    ],
)
def test_invalid_mla(kwargs, match):
    fields = {
        "attention": "mla", "num_layers": 61, "num_kv_heads": 1, "head_dim": 576,
        "dtype": "bf16", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    }
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        KVLayout(**fields)


@pytest.mark.parametrize(
    ("rank", "rope", "match"),
    [
        (0, 64, r"kv_lora_rank must be a positive int, got 0"),
        (512, True, r"qk_rope_head_dim must be a positive int, got True"),
        (None, 64, r"kv_lora_rank must be a positive int, got None"),
    ],
)
def test_invalid_mla_constructor(rank, rope, match):
    with pytest.raises(ConfigError, match=match):
        KVLayout.mla(61, rank, rope)


def test_mqa_with_two_kv_heads_rejected():
    with pytest.raises(ConfigError, match=r"attention='mqa' requires num_kv_heads == 1, got 2"):
        KVLayout("mqa", 32, 2, 64, "bf16", num_attention_heads=8)


def test_mha_with_fewer_kv_heads_rejected():
    with pytest.raises(
        ConfigError, match=r"attention='mha' requires num_attention_heads == num_kv_heads"
    ):
        KVLayout("mha", 32, 8, 128, "bf16", num_attention_heads=32)


def test_gqa_heads_not_a_multiple_rejected():
    with pytest.raises(ConfigError, match=r"num_attention_heads=10, num_kv_heads=4"):
        KVLayout.gqa(2, 10, 4, 64)


@pytest.mark.parametrize("bad", [0, -1, True, 16.0, "16", None])
def test_invalid_block_size(bad):
    layout = preset("llama-3-8b")
    with pytest.raises(ConfigError, match=r"block_size must be a positive int, got"):
        layout.bytes_per_block(bad)
    with pytest.raises(ConfigError, match=r"block_size must be a positive int, got"):
        layout.blocks_for_bytes(2**30, bad)
    with pytest.raises(ConfigError, match=r"block_size must be a positive int, got"):
        layout.tensor_shape(4, bad)
    if bad is not None:  # tokens_per_gib(None) means "not rounded to blocks"
        with pytest.raises(ConfigError, match=r"block_size must be a positive int, got"):
            layout.tokens_per_gib(bad)


@pytest.mark.parametrize("bad", [0, -2, False, 3.0])
def test_invalid_num_blocks(bad):
    with pytest.raises(ConfigError, match=r"num_blocks must be a positive int, got"):
        preset("llama-3-8b").tensor_shape(bad, 16)


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), True, "1024", None])
def test_invalid_nbytes(bad):
    with pytest.raises(ConfigError, match=r"nbytes must be a non-negative finite number"):
        preset("llama-3-8b").blocks_for_bytes(bad, 16)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (
            {"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096},
            r"config \(model_type='llama'\) is missing required field 'num_hidden_layers'",
        ),
        (
            {"num_attention_heads": 32, "hidden_size": 4096},
            r"model_type='unknown'\) is missing required field 'num_hidden_layers'",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096},
            r"model_type='llama'\) is missing required field 'num_attention_heads'",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32},
            r"model_type='llama'\) has neither 'head_dim' nor 'hidden_size'",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 0, "num_attention_heads": 32,
             "hidden_size": 4096},
            r"config field 'num_hidden_layers' \(model_type='llama'\) must be a positive int, "
            "got 0",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 32,
             "num_key_value_heads": 5, "hidden_size": 4096},
            r"multiple of num_kv_heads, got num_attention_heads=32, num_kv_heads=5",
        ),
        (
            {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512},
            r"model_type='deepseek_v3'\) is missing required field 'qk_rope_head_dim'",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
             "hidden_size": 64, "torch_dtype": "float12"},
            r"unknown dtype 'float12'",
        ),
    ],
)
def test_from_hf_config_invalid(cfg, match):
    with pytest.raises(ConfigError, match=match):
        from_hf_config(cfg)


def test_from_hf_config_missing_layers_on_namespace():
    cfg = llama3_8b_cfg()
    del cfg.num_hidden_layers
    with pytest.raises(ConfigError, match=r"missing required field 'num_hidden_layers'"):
        from_hf_config(cfg)


@pytest.mark.parametrize("bad", ["llama-4", "", 3])
def test_unknown_preset(bad):
    with pytest.raises(ConfigError, match=r"unknown preset .*valid names: llama-3-8b, "):
        preset(bad)
