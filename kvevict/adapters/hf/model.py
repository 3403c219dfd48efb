"""What the Hugging Face adapter needs to know about a transformers model.

`inspect_model` reads a decoder-only model's config once: which layers are full attention (those
are paged into a `BlockPool`), which are special (sliding window, linear attention, ...: they keep
transformers' own cache layer classes), the KV head geometry and the dtype. Anything the adapter
cannot serve raises `ConfigError` naming what is supported.

`attention_modules` and `project_queries` (with `kvevict.tokens.base.window_attention`)
recompute, for the token policies that need it (H2O, SnapKV, TOVA), the softmax attention of
the most recent queries over a layer's stored keys, the way kvpress does: from the attention
module's own ``q_proj`` and rotary embedding, in float32, whatever attention kernel the model
runs.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

from kvevict.adapters.hf.blocks import MANAGED_POOLS
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool

__all__ = [
    "PAGED_LAYER_TYPE",
    "SUPPORTED_DTYPES",
    "ModelSpec",
    "attention_modules",
    "check_pool",
    "inspect_model",
    "project_queries",
]

#: Model dtypes the adapter pages (the pool stores K/V in the model's dtype).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

#: The transformers layer type whose K/V go into the pool; every other known type keeps its
#: transformers class (see ``transformers.cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``).
PAGED_LAYER_TYPE = "full_attention"

_SUPPORTED_MODELS = ("decoder-only models with multi-head, grouped-query or multi-query "
                     "attention whose keys and values share one head_dim (Llama, Mistral, "
                     "Qwen2, Qwen3, Gemma, Phi-3 and the like)")


@attrs.frozen
class ModelSpec:
    """The cache geometry of one decoder-only model, read from its config.

    ``layer_types[i]`` is transformers' name for layer ``i`` (``"full_attention"``,
    ``"sliding_attention"``, ...) and ``layer_kwargs[i]`` what its cache class needs.
    """

    model_name: str
    layer_types: tuple[str, ...]
    layer_kwargs: tuple[dict, ...]
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def paged_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers, in model order (pool layer ``i`` holds the
        K/V of model layer ``paged_layers[i]``)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == PAGED_LAYER_TYPE)

    @property
    def has_special_layers(self) -> bool:
        """Whether some layer is not full attention (it keeps its transformers class)."""
        return len(self.paged_layers) != len(self.layer_types)

    def layout(self) -> KVLayout:
        """The `KVLayout` of the paged layers only (sliding and other layers are not pooled)."""
        layers, heads, kv_heads = (len(self.paged_layers), self.num_attention_heads,
                                   self.num_kv_heads)
        name = self.model_name
        if kv_heads == heads:
            return KVLayout.mha(layers, heads, self.head_dim, self.dtype, name=name)
        if kv_heads == 1:
            return KVLayout.mqa(layers, heads, self.head_dim, self.dtype, name=name)
        return KVLayout.gqa(layers, heads, kv_heads, self.head_dim, self.dtype, name=name)


def _positive(config: Any, name: str, default: Any = None) -> int:
    value = getattr(config, name, None)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model config field {name} must be a positive int, got {value!r}; "
                          f"supported: {_SUPPORTED_MODELS}")
    return value


def inspect_model(model: Any) -> ModelSpec:
    """Read the cache geometry of ``model`` (a transformers ``PreTrainedModel``).

    Raises:
        ConfigError: not a transformers model, an encoder-decoder, multi-head latent attention
            (MLA: keys and values of different sizes), a layer type transformers' cache does
            not know, no full-attention layer at all, or a dtype outside `SUPPORTED_DTYPES`.
    """
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(f"model must be a transformers PreTrainedModel such as "
                          f"LlamaForCausalLM, got {type(model).__name__}; supported: "
                          f"{_SUPPORTED_MODELS}")
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(f"{name} is an encoder-decoder model; the HF adapter supports "
                          f"{_SUPPORTED_MODELS}")
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "kv_lora_rank", None) is not None:
        raise ConfigError(f"{name} uses multi-head latent attention (MLA), whose cached keys "
                          f"and values differ in size; supported: {_SUPPORTED_MODELS}")
    heads = _positive(config, "num_attention_heads")
    kv_heads = _positive(config, "num_key_value_heads", heads)
    hidden = _positive(config, "hidden_size")
    head_dim = _positive(config, "head_dim", hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{name}: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    except (AttributeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{name}: cannot read the layer types from its config ({exc}); "
                          f"supported: {_SUPPORTED_MODELS}") from None
    unknown = sorted({t for t in layer_types if t not in DYNAMIC_LAYER_TYPE_MAPPING})
    if unknown:
        kept = ", ".join(t for t in DYNAMIC_LAYER_TYPE_MAPPING if t != PAGED_LAYER_TYPE)
        raise ConfigError(f"{name} has layer type(s) {', '.join(unknown)}, which the HF "
                          f"adapter does not support; supported layer types: "
                          f"{PAGED_LAYER_TYPE} (paged) and {kept} (kept as transformers' own "
                          "cache layers)")
    if PAGED_LAYER_TYPE not in layer_types:
        raise ConfigError(f"{name} has no {PAGED_LAYER_TYPE} layer (its layers are "
                          f"{', '.join(sorted(set(layer_types)))}), so there is nothing to page; "
                          "for a Mistral-style config set sliding_window=None, or use "
                          "transformers' DynamicCache")
    dtype = model.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(f"{name} runs in {dtype}; the HF adapter supports "
                          f"{', '.join(map(str, SUPPORTED_DTYPES))}")
    return ModelSpec(name, tuple(layer_types), tuple(layer_kwargs), heads, kv_heads, head_dim,
                     dtype, model.device)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The attention modules of ``model`` by layer index: modules with an int ``layer_idx``,
    a ``q_proj`` linear layer and a ``head_dim`` (Llama, Mistral, Qwen2/3 style)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if (isinstance(idx, int) and isinstance(getattr(module, "q_proj", None), nn.Linear)
                and isinstance(getattr(module, "head_dim", None), int)):
            found.setdefault(idx, module)
    return found


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotate-half rotary embedding of Llama, for modules that do not define their own."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def project_queries(module: nn.Module, hidden_states: Tensor,
                    position_embeddings: tuple[Tensor, Tensor], count: int) -> Tensor:
    """Post-RoPE queries ``[B, Hq, count, D]`` of the last ``count`` tokens, as the attention
    ``module`` computes them (``q_proj``, optional ``q_norm``, the module's rotary function).

    Args:
        hidden_states: ``[B, q, hidden]`` input of the attention module (after its norm).
        position_embeddings: ``(cos, sin)``, each ``[B or 1, q, D]``.
        count: how many of the most recent tokens to project (``1 <= count <= q``).
    """
    h = hidden_states[:, -count:]
    q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim)
    norm = getattr(module, "q_norm", None)
    if norm is not None:
        q = norm(q)
    q = q.transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos[..., -count:, :], sin[..., -count:, :]
    rope = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", _apply_rope)
    return rope(q, q, cos, sin)[0]



def check_pool(pool: Any, spec: ModelSpec) -> None:
    """Raise `ConfigError` unless ``pool`` can hold the paged layers of ``spec``'s model."""
    if not isinstance(pool, BlockPool):
        raise ConfigError(f"pool must be a kvevict BlockPool, got {type(pool).__name__}")
    if pool in MANAGED_POOLS:
        raise ConfigError("this pool belongs to a SessionStore (its manager hands out the "
                          "blocks); use SessionStore.cache_for() instead")
    if pool.kv is None or pool.layout is None:
        raise ConfigError("pool has no KV tensor (metadata-only); build it with a layout and "
                          "storage=True")
    layout = pool.layout
    got = (layout.num_layers, layout.kv_planes, layout.num_kv_heads, layout.head_dim)
    want = (len(spec.paged_layers), 2, spec.num_kv_heads, spec.head_dim)
    if got != want:
        raise ConfigError(f"pool layout does not match {spec.model_name}: (full-attention "
                          f"layers, planes, kv heads, head_dim) is {got} in the pool, {want} in "
                          "the model; build it from ModelSpec.layout()")
    if pool.dtype != spec.dtype:
        raise ConfigError(f"pool dtype is {pool.dtype} but {spec.model_name} runs in "
                          f"{spec.dtype}; the pool must store the model's dtype")
    if pool.device != spec.device:
        raise ConfigError(f"pool is on {pool.device} but the model is on {spec.device}")
