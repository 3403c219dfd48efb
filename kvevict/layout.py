"""Exact KV-cache sizes per token and per block, for MHA, GQA, MQA and MLA, in any dtype.

A `KVLayout` describes what one token of context costs in the KV cache of a decoder-only
transformer. Every layer stores, for every token, ``kv_planes`` planes of ``num_kv_heads``
vectors of ``head_dim`` elements each::

    elements_per_token = num_layers * kv_planes * num_kv_heads * head_dim
    bytes_per_token    = elements_per_token * dtype_bytes
    bytes_per_block    = bytes_per_token * block_size

``kv_planes`` is 2 (one K plane, one V plane) for multi-head (MHA), grouped-query (GQA) and
multi-query (MQA) attention; they differ only in ``num_kv_heads``: MHA has as many KV heads as
query heads, GQA has fewer (each shared by a group of query heads), MQA has one.

Multi-head latent attention (MLA, DeepSeek-V2/V3; arXiv 2405.04434, section 2.1) caches no
per-head K or V at all. Per layer and token it stores one vector: the compressed joint KV
latent ``c_kv`` (``kv_lora_rank`` elements), concatenated with the decoupled RoPE key ``k_pe``
(``qk_rope_head_dim`` elements) that all heads share. Per-head keys and values are
re-derived from ``c_kv`` by up-projections that can be absorbed into the query and output
projections, so they never need to be cached; ``k_pe`` is kept apart because RoPE is
position-dependent and would block that absorption. MLA is therefore modelled as
``kv_planes = 1``, ``num_kv_heads = 1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``.
The config's ``num_key_value_heads`` (128 for DeepSeek-V3) is irrelevant to the cache.

Examples (bf16, 2 bytes per element):

* Llama-3-8B (GQA, 32 layers, 8 KV heads, head_dim 128):
  32 * 2 * 8 * 128 * 2 = 131072 bytes/token = 128 KiB/token.
* DeepSeek-V3 (MLA, 61 layers, kv_lora_rank 512 + qk_rope_head_dim 64 = 576):
  61 * 576 * 2 = 70272 bytes/token.

>>> preset("llama-3-8b").bytes_per_token
131072
>>> preset("deepseek-v3").bytes_per_token
70272

Invalid input raises `kvevict.errors.ConfigError` (a `ValueError`) naming what was wrong and
what was expected. This module never imports ``transformers``: `from_hf_config` reads plain
attributes (or dict keys) of whatever config object it is given.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from kvevict.errors import ConfigError

__all__ = [
    "ATTENTION_KINDS",
    "DTYPE_ALIASES",
    "PRESETS",
    "KVLayout",
    "from_hf_config",
    "preset",
]

#: The attention kinds a `KVLayout` can describe.
ATTENTION_KINDS: tuple[str, ...] = ("mha", "gqa", "mqa", "mla")

#: Accepted dtype spellings (lower case; a leading ``"torch."`` is also accepted).
DTYPE_ALIASES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}

_GIB = 1 << 30


# --------------------------------------------------------------------------- helpers


def _is_count(value: object) -> bool:
    """True for a positive integer that is not a bool (numpy integers count too)."""
    return (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) > 0
    )


def _describe(value: object) -> str:
    if isinstance(value, (bool, int, str)) or value is None:
        return repr(value)
    return f"{value!r} ({type(value).__name__})"


def _check_count(what: str, value: object) -> int:
    """Return ``value`` as an int, or raise ConfigError saying it must be a positive int."""
    if not _is_count(value):
        raise ConfigError(f"{what} must be a positive int, got {_describe(value)}")
    return int(value)  # type: ignore[call-overload]


def _to_int_if_integral(value: object) -> object:
    """attrs converter: normalise numpy/other Integral values to int; leave the rest alone."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _to_dtype(value: object) -> torch.dtype:
    """attrs converter: a torch.dtype, or one of the `DTYPE_ALIASES` spellings."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        key = key.removeprefix("torch.")
        if key in DTYPE_ALIASES:
            return DTYPE_ALIASES[key]
        raise ConfigError(
            f"unknown dtype {value!r}; expected a torch.dtype or one of: "
            + ", ".join(DTYPE_ALIASES)
        )
    raise ConfigError(
        f"dtype must be a torch.dtype or a string, got {_describe(value)}; "
        "valid strings: " + ", ".join(DTYPE_ALIASES)
    )


def _to_attention(value: object) -> object:
    """attrs converter: lower-case attention names ("GQA" -> "gqa")."""
    return value.strip().lower() if isinstance(value, str) else value


def _validate_attention(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value not in ATTENTION_KINDS:
        raise ConfigError(
            f"attention must be one of {', '.join(map(repr, ATTENTION_KINDS))}, "
            f"got {_describe(value)}"
        )


def _validate_count(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    _check_count(attribute.name, value)


def _validate_optional_count(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _check_count(f"{attribute.name} (when given)", value)


def _validate_name(_inst: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"name must be a str or None, got {_describe(value)}")


# --------------------------------------------------------------------------- KVLayout


@attrs.frozen
class KVLayout:
    """The KV-cache geometry of one model: what a token and a block of tokens cost in bytes.

    Attributes:
        attention: ``"mha"``, ``"gqa"``, ``"mqa"`` or ``"mla"`` (case-insensitive on input).
        num_layers: decoder layers that hold a KV cache.
        num_kv_heads: KV heads per layer; 1 for MQA and for MLA.
        head_dim: elements per head per plane; for MLA ``kv_lora_rank + qk_rope_head_dim``.
        dtype: element type of the cache; a ``torch.dtype`` or a string such as ``"bf16"``
            (see `DTYPE_ALIASES`), stored as a ``torch.dtype``.
        num_attention_heads: query heads (informational: gives the GQA group size).
        kv_lora_rank: MLA only; size of the compressed KV latent ``c_kv``.
        qk_rope_head_dim: MLA only; size of the shared decoupled RoPE key ``k_pe``.
        name: free-form label, e.g. the model id.

    Raises:
        ConfigError: on any invalid field or inconsistent combination of fields.
    """

    attention: str = attrs.field(converter=_to_attention, validator=_validate_attention)
    num_layers: int = attrs.field(converter=_to_int_if_integral, validator=_validate_count)
    num_kv_heads: int = attrs.field(converter=_to_int_if_integral, validator=_validate_count)
    head_dim: int = attrs.field(converter=_to_int_if_integral, validator=_validate_count)
    dtype: torch.dtype = attrs.field(converter=_to_dtype)
    num_attention_heads: int | None = attrs.field(
        default=None, converter=_to_int_if_integral, validator=_validate_optional_count
    )
    kv_lora_rank: int | None = attrs.field(
        default=None, converter=_to_int_if_integral, validator=_validate_optional_count
    )
    qk_rope_head_dim: int | None = attrs.field(
        default=None, converter=_to_int_if_integral, validator=_validate_optional_count
    )
    name: str | None = attrs.field(default=None, validator=_validate_name)

    def __attrs_post_init__(self) -> None:
        kind = self.attention
        heads = self.num_attention_heads
        if kind == "mla":
            if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
                raise ConfigError(
                    "attention='mla' requires kv_lora_rank and qk_rope_head_dim, got "
                    f"kv_lora_rank={self.kv_lora_rank!r}, "
                    f"qk_rope_head_dim={self.qk_rope_head_dim!r}"
                )
            expected = self.kv_lora_rank + self.qk_rope_head_dim
            if self.head_dim != expected:
                raise ConfigError(
                    f"attention='mla' requires head_dim == kv_lora_rank + qk_rope_head_dim "
                    f"= {self.kv_lora_rank} + {self.qk_rope_head_dim} = {expected}, "
                    f"got head_dim={self.head_dim}"
                )
            if self.num_kv_heads != 1:
                raise ConfigError(
                    "attention='mla' caches one latent vector per token, so num_kv_heads "
                    f"must be 1, got {self.num_kv_heads}"
                )
            return
        for field_name in ("kv_lora_rank", "qk_rope_head_dim"):
            if getattr(self, field_name) is not None:
                raise ConfigError(
                    f"{field_name} applies only to attention='mla', got "
                    f"{field_name}={getattr(self, field_name)!r} with attention={kind!r}"
                )
        if kind == "mqa":
            if self.num_kv_heads != 1:
                raise ConfigError(
                    f"attention='mqa' requires num_kv_heads == 1, got {self.num_kv_heads} "
                    "(use attention='gqa' for several KV heads)"
                )
        elif kind == "mha":
            if heads is not None and heads != self.num_kv_heads:
                raise ConfigError(
                    "attention='mha' requires num_attention_heads == num_kv_heads (or None), "
                    f"got num_attention_heads={heads}, num_kv_heads={self.num_kv_heads} "
                    "(use attention='gqa' or 'mqa')"
                )
        elif heads is not None and heads % self.num_kv_heads != 0:  # gqa
            raise ConfigError(
                "attention='gqa' requires num_attention_heads to be a multiple of "
                f"num_kv_heads, got num_attention_heads={heads}, "
                f"num_kv_heads={self.num_kv_heads}"
            )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def mha(
        cls,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = "float16",
        *,
        name: str | None = None,
    ) -> KVLayout:
        """Multi-head attention: one K and one V head per query head."""
        return cls(
            "mha", num_layers, num_heads, head_dim, dtype,
            num_attention_heads=num_heads, name=name,
        )

    @classmethod
    def gqa(
        cls,
        num_layers: int,
        num_attention_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = "float16",
        *,
        name: str | None = None,
    ) -> KVLayout:
        """Grouped-query attention: ``num_attention_heads / num_kv_heads`` queries per KV head."""
        return cls(
            "gqa", num_layers, num_kv_heads, head_dim, dtype,
            num_attention_heads=num_attention_heads, name=name,
        )

    @classmethod
    def mqa(
        cls,
        num_layers: int,
        num_attention_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = "float16",
        *,
        name: str | None = None,
    ) -> KVLayout:
        """Multi-query attention: a single K and V head shared by all query heads."""
        return cls(
            "mqa", num_layers, 1, head_dim, dtype,
            num_attention_heads=num_attention_heads, name=name,
        )

    @classmethod
    def mla(
        cls,
        num_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype | str = "float16",
        num_attention_heads: int | None = None,
        *,
        name: str | None = None,
    ) -> KVLayout:
        """Multi-head latent attention (DeepSeek-V2/V3): caches ``[c_kv | k_pe]`` per token."""
        rank = _check_count("kv_lora_rank", kv_lora_rank)
        rope = _check_count("qk_rope_head_dim", qk_rope_head_dim)
        return cls(
            "mla", num_layers, 1, rank + rope, dtype,
            num_attention_heads=num_attention_heads,
            kv_lora_rank=rank, qk_rope_head_dim=rope, name=name,
        )

    @classmethod
    def from_hf_config(cls, config: Any, dtype: torch.dtype | str | None = None) -> KVLayout:
        """Same as the module function `from_hf_config`."""
        return from_hf_config(config, dtype)

    # ------------------------------------------------------------------ sizes

    @property
    def kv_planes(self) -> int:
        """Planes cached per layer: 2 (K and V), or 1 for MLA (the ``[c_kv | k_pe]`` latent)."""
        return 1 if self.attention == "mla" else 2

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element (``dtype.itemsize``)."""
        return self.dtype.itemsize

    @property
    def elements_per_token(self) -> int:
        """``num_layers * kv_planes * num_kv_heads * head_dim``, summed over all layers."""
        return self.num_layers * self.kv_planes * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """Exact KV-cache bytes for one token across all layers."""
        return self.elements_per_token * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        """Exact KV-cache bytes for a block of ``block_size`` tokens across all layers."""
        return self.bytes_per_token * _check_count("block_size", block_size)

    def blocks_for_bytes(self, nbytes: float, block_size: int) -> int:
        """Whole blocks of ``block_size`` tokens that fit in ``nbytes``: ``floor(nbytes / bpb)``.

        ``nbytes`` may be an int or a finite float (e.g. ``0.9 * total``), and must be >= 0.
        """
        per_block = self.bytes_per_block(block_size)
        ok = isinstance(nbytes, numbers.Real) and not isinstance(nbytes, bool)
        if not ok or not math.isfinite(nbytes) or nbytes < 0:
            raise ConfigError(
                f"nbytes must be a non-negative finite number of bytes, got {_describe(nbytes)}"
            )
        if isinstance(nbytes, numbers.Integral):
            return int(nbytes) // per_block
        return math.floor(nbytes / per_block)

    def tokens_per_gib(self, block_size: int | None = None) -> int:
        """Tokens whose KV cache fits in 1 GiB (2**30 bytes).

        With ``block_size`` the count is rounded down to whole blocks, as a paged pool stores it.
        """
        if block_size is None:
            return _GIB // self.bytes_per_token
        return self.blocks_for_bytes(_GIB, block_size) * block_size

    def tensor_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the paged KV pool tensor holding ``num_blocks`` blocks of ``block_size`` tokens.

        ``(num_layers, kv_planes, num_blocks, block_size, num_kv_heads, head_dim)``, indexed as
        ``pool[layer, plane, block, slot, kv_head, :]``. ``plane`` is 0 for K and 1 for V; for MLA
        there is a single plane whose last axis holds ``c_kv`` (the first ``kv_lora_rank``
        elements) followed by ``k_pe`` (the last ``qk_rope_head_dim`` elements). A contiguous
        tensor of this shape and `dtype` occupies exactly
        ``num_blocks * bytes_per_block(block_size)`` bytes.
        """
        return (
            self.num_layers,
            self.kv_planes,
            _check_count("num_blocks", num_blocks),
            _check_count("block_size", block_size),
            self.num_kv_heads,
            self.head_dim,
        )


# --------------------------------------------------------------------------- HF configs


def _getter(config: Any) -> Callable[[str], Any]:
    """A lookup that returns None for a field that is missing (or set to None)."""
    if isinstance(config, Mapping):
        return config.get
    return lambda key: getattr(config, key, None)


def from_hf_config(config: Any, dtype: torch.dtype | str | None = None) -> KVLayout:
    """Build a `KVLayout` from a Hugging Face style model config, without importing transformers.

    ``config`` is any object with attributes (a ``transformers.PretrainedConfig``, a
    ``types.SimpleNamespace``) or a mapping such as a parsed ``config.json``.

    * DeepSeek-V2/V3 style (``kv_lora_rank`` set, plus ``qk_rope_head_dim``): ``"mla"`` with
      ``head_dim = kv_lora_rank + qk_rope_head_dim``; ``num_key_value_heads`` is ignored.
    * Llama / Qwen2 / Mistral style: ``num_hidden_layers``, ``num_attention_heads``,
      ``num_key_value_heads`` (missing: equals ``num_attention_heads``) and ``head_dim``
      (missing or None: ``hidden_size // num_attention_heads``). Falcon's legacy
      ``multi_query=True`` (without ``new_decoder_architecture``) means one KV head; with
      ``new_decoder_architecture`` its ``num_kv_heads`` is used. KV heads equal to query heads
      is ``"mha"``, a single KV head (with several query heads) is ``"mqa"``, else ``"gqa"``.

    ``dtype``: the argument if given, else the config's ``dtype`` or ``torch_dtype`` (string or
    torch.dtype), else float16. ``name``: ``name_or_path``, ``_name_or_path`` or ``model_type``.

    Raises:
        ConfigError: a required field is missing or invalid; the message names the field and
            the config's ``model_type``.
    """
    get = _getter(config)
    model_type = get("model_type") or "unknown"

    def count(field_name: str) -> int:
        value = get(field_name)
        if value is None:
            raise ConfigError(
                f"config (model_type={model_type!r}) is missing required field {field_name!r}"
            )
        return _check_count(f"config field {field_name!r} (model_type={model_type!r})", value)

    def optional_count(field_name: str) -> int | None:
        return None if get(field_name) is None else count(field_name)

    if dtype is None:  # ``dtype`` first: transformers 5 warns on reading ``torch_dtype``
        dtype = get("dtype")
        if dtype is None:
            dtype = get("torch_dtype")
        if dtype is None:
            dtype = torch.float16
    name = next(
        (n for n in (get("name_or_path"), get("_name_or_path"), get("model_type"))
         if isinstance(n, str) and n),
        None,
    )

    num_layers = count("num_hidden_layers")
    heads = optional_count("num_attention_heads")

    if get("kv_lora_rank") is not None:
        return KVLayout.mla(
            num_layers,
            count("kv_lora_rank"),
            count("qk_rope_head_dim"),
            dtype,
            num_attention_heads=heads,
            name=name,
        )

    if heads is None:
        heads = count("num_attention_heads")  # raises: missing

    kv_heads = optional_count("num_key_value_heads")
    if kv_heads is None:
        if get("new_decoder_architecture") and get("num_kv_heads") is not None:
            kv_heads = count("num_kv_heads")
        elif get("multi_query") and not get("new_decoder_architecture"):
            kv_heads = 1
        else:
            kv_heads = heads

    head_dim = optional_count("head_dim")
    if head_dim is None:
        if get("hidden_size") is None:
            raise ConfigError(
                f"config (model_type={model_type!r}) has neither 'head_dim' nor 'hidden_size'; "
                "one is needed to know the per-head size"
            )
        head_dim = _check_count(
            f"hidden_size // num_attention_heads (model_type={model_type!r})",
            count("hidden_size") // heads,
        )

    if kv_heads == heads:
        return KVLayout.mha(num_layers, heads, head_dim, dtype, name=name)
    if kv_heads == 1:
        return KVLayout.mqa(num_layers, heads, head_dim, dtype, name=name)
    return KVLayout.gqa(num_layers, heads, kv_heads, head_dim, dtype, name=name)


# --------------------------------------------------------------------------- presets

#: Layouts of well-known models, from their published ``config.json`` values, in bf16.
PRESETS: dict[str, KVLayout] = {
    "llama-3-8b": KVLayout.gqa(32, 32, 8, 128, "bfloat16", name="llama-3-8b"),
    "llama-3-70b": KVLayout.gqa(80, 64, 8, 128, "bfloat16", name="llama-3-70b"),
    "llama-2-7b": KVLayout.mha(32, 32, 128, "bfloat16", name="llama-2-7b"),
    "mistral-7b": KVLayout.gqa(32, 32, 8, 128, "bfloat16", name="mistral-7b"),
    "qwen2-7b": KVLayout.gqa(28, 28, 4, 128, "bfloat16", name="qwen2-7b"),
    "qwen2.5-0.5b": KVLayout.gqa(24, 14, 2, 64, "bfloat16", name="qwen2.5-0.5b"),
    "falcon-7b": KVLayout.mqa(32, 71, 64, "bfloat16", name="falcon-7b"),
    "deepseek-v3": KVLayout.mla(61, 512, 64, "bfloat16", 128, name="deepseek-v3"),
    "deepseek-v2-lite": KVLayout.mla(27, 512, 64, "bfloat16", 16, name="deepseek-v2-lite"),
}


def preset(name: str) -> KVLayout:
    """The `PRESETS` entry called ``name`` (case-insensitive).

    Raises:
        ConfigError: ``name`` is not a preset; the message lists the valid names.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    try:
        return PRESETS[key]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown preset {name!r}; valid names: {', '.join(PRESETS)}"
        ) from None
