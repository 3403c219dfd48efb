"""Load the weights of a Hugging Face transformers model into the engine's `LlamaModel`.

Supported: ``LlamaForCausalLM`` (``model_type`` ``"llama"``), ``Qwen2ForCausalLM``
(``"qwen2"``) and ``MistralForCausalLM`` (``"mistral"``), which share the Llama decoder and
differ in options `ModelConfig` has: q/k/v biases (Qwen2), o and MLP biases (Llama's
``attention_bias`` / ``mlp_bias``), tied embeddings, a sliding window (Mistral; Qwen2's
``layer_types``), ``rope_theta``, ``rms_norm_eps``, an explicit ``head_dim`` and RoPE scaling of
type ``linear`` or ``llama3``. Anything else (another architecture, yarn / dynamic / longrope
RoPE, partial rotary, an activation other than SiLU) raises `ConfigError` naming what is
supported, rather than loading a model that would compute something different.

transformers is imported only here, and only by `load_pretrained`: `from_hf` and
`config_from_hf` work on objects the caller already built, so ``import kvevict.engine`` never
imports transformers.

Example::

    from transformers import AutoModelForCausalLM
    from kvevict.engine.hf import from_hf

    hf_model = AutoModelForCausalLM.from_pretrained("/models/Qwen2.5-0.5B")
    model = from_hf(hf_model, dtype=torch.float32)   # or load_pretrained("/models/...")
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvevict.engine.model import (
    ROPE_SCALING_KINDS,
    SUPPORTED_DTYPES,
    LlamaModel,
    ModelConfig,
    RopeScaling,
)
from kvevict.errors import ConfigError

__all__ = ["SUPPORTED_ARCHITECTURES", "config_from_hf", "from_hf", "load_pretrained"]

#: ``model_type`` -> the transformers class this module loads.
SUPPORTED_ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}

#: Our per-layer weight name -> the transformers name under ``model.layers.{i}.``.
_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "b_gate": "mlp.gate_proj.bias",
    "b_up": "mlp.up_proj.bias",
    "b_down": "mlp.down_proj.bias",
}
_TOP_NAMES: Mapping[str, str] = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def _supported_list() -> str:
    return ", ".join(f"{cls} ({mt!r})" for mt, cls in SUPPORTED_ARCHITECTURES.items())


def _hf_name(name: str) -> str:
    """The transformers state-dict name of one of our weight names."""
    if name.startswith("layers."):
        _, i, key = name.split(".")
        return f"model.layers.{i}.{_LAYER_NAMES[key]}"
    return _TOP_NAMES[name]


def _check_dtype(dtype: Any, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"{what} must be a torch.dtype, got {dtype!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"{what} is {dtype}; the engine runs in {', '.join(map(str, SUPPORTED_DTYPES))}. "
            "Pass dtype= (e.g. dtype=torch.float32) to convert the weights"
        )
    return dtype


def _rope(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be a dict, got {type(params).__name__}")
    if "rope_theta" not in params and any(isinstance(v, Mapping) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported; expected one "
                          "dict with rope_type and rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not supported; RoPE must rotate "
                          "the whole head_dim (factor 1.0)")
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALING_KINDS:
        raise ConfigError(f"RoPE type {kind!r} is not supported; supported: default, "
                          f"{', '.join(ROPE_SCALING_KINDS)}")
    try:
        if kind == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        return theta, RopeScaling(
            "llama3", float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ConfigError(f"{kind} RoPE scaling needs {exc.args[0]!r} in rope_parameters"
                          ) from None


def _sliding(hf_config: Any, num_layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, sliding_layers)``: Mistral slides in every layer when
    ``sliding_window`` is set; Qwen2 lists per-layer ``layer_types``."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return window, None
    layer_types = list(layer_types)
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not supported; supported: "
                          "full_attention, sliding_attention")
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types lists {len(layer_types)} layers, the config has "
                          f"{num_layers}")
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if not sliding:
        return None, None
    if window is None:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is None")
    return window, (None if len(sliding) == num_layers else sliding)


def config_from_hf(hf_config: Any, dtype: torch.dtype | None = None) -> ModelConfig:
    """The `ModelConfig` of a transformers ``LlamaConfig`` / ``Qwen2Config`` /
    ``MistralConfig`` (any object with their fields).

    ``dtype``: the engine's dtype (default: the config's ``dtype`` / ``torch_dtype`` when it
    is a supported one, else float32). Raises `ConfigError` for an unsupported architecture,
    activation or RoPE variant.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {model_type!r}; supported: "
                          f"{_supported_list()}")
    act = getattr(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act {act!r} is not supported; the engine's MLP is SwiGLU "
                          "(silu)")
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if dtype not in SUPPORTED_DTYPES:
            dtype = torch.float32
    dtype = _check_dtype(dtype, "dtype")

    def field(name: str) -> Any:
        value = getattr(hf_config, name, None)
        if value is None:
            raise ConfigError(f"the {model_type} config has no {name}")
        return value

    num_layers = field("num_hidden_layers")
    num_heads = field("num_attention_heads")
    hidden = field("hidden_size")
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    theta, scaling = _rope(hf_config)
    window, sliding_layers = _sliding(hf_config, num_layers)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelConfig(
        vocab_size=field("vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=field("intermediate_size"),
        rope_theta=theta,
        rms_eps=float(field("rms_norm_eps")),
        dtype=dtype,
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        sliding_window=window,
        sliding_layers=sliding_layers,
        rope_scaling=scaling,
    )


def from_hf(model: Any, *, dtype: torch.dtype | None = None,
            device: str | torch.device | None = None) -> LlamaModel:
    """A `LlamaModel` with the weights of a transformers causal LM instance.

    Args:
        model: a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM``.
        dtype: the engine's dtype (default: the model's, which must then be float32,
            bfloat16 or float16; pass ``dtype=torch.float32`` to convert e.g. float64).
        device: where the engine runs (default: the model's device).

    The weights are copied (converted, fused); the transformers model is not changed and can
    be dropped afterwards. Raises `ConfigError` for anything unsupported, and when the
    model's parameters do not match its config (a missing or unexpected tensor or bias).
    """
    hf_config = getattr(model, "config", None)
    if hf_config is None or not callable(getattr(model, "state_dict", None)):
        raise ConfigError(f"expected a transformers causal LM ({_supported_list()}), got "
                          f"{type(model).__name__}")
    model_type = getattr(hf_config, "model_type", None)
    expected = SUPPORTED_ARCHITECTURES.get(model_type)
    if expected is None or type(model).__name__ != expected:
        raise ConfigError(f"unsupported architecture {type(model).__name__} (model_type "
                          f"{model_type!r}); supported: {_supported_list()}")
    params = list(model.parameters())
    if not params:
        raise ConfigError(f"{type(model).__name__} has no parameters")
    first = params[0]
    if first.device.type == "meta":
        raise ConfigError("the model's weights are on the meta device (not loaded)")
    model_dtype = first.dtype
    if dtype is None:
        dtype = _check_dtype(model_dtype, f"the model's dtype ({type(model).__name__})")
    config = config_from_hf(hf_config, _check_dtype(dtype, "dtype"))
    state = model.state_dict()
    weights: dict[str, torch.Tensor] = {}
    for name in config.weight_shapes():
        hf_name = _hf_name(name)
        if hf_name not in state:
            raise ConfigError(f"{type(model).__name__} has no {hf_name!r} (needed as {name!r} "
                              "by its config)")
        weights[name] = state[hf_name]
    consumed = {_hf_name(n) for n in weights}
    if config.tie_embeddings:
        consumed.add(_TOP_NAMES["lm_head"])  # the tied copy in the state dict
    unexpected = sorted(n for n in state if n not in consumed and not n.endswith("inv_freq"))
    if unexpected:
        raise ConfigError(f"{type(model).__name__} has tensors its config does not explain, "
                          f"which the engine would ignore: {unexpected[:6]}")
    return LlamaModel.from_weights(config, weights,
                                   device=first.device if device is None else device)


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> LlamaModel:
    """Load a local Hugging Face checkpoint directory (``config.json`` + safetensors) with
    transformers, and return the engine model (see `from_hf`).

    The architecture is checked from ``config.json`` before any weight is read. Needs
    ``pip install "kvevict[hf]"`` (transformers); nothing is downloaded.
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{str(path)!r} is not a local checkpoint directory (no config.json)")
    if dtype is not None:
        _check_dtype(dtype, "dtype")
    try:
        import transformers
    except ImportError:
        raise ConfigError("loading a checkpoint needs transformers: pip install "
                          "'kvevict[hf]'") from None
    hf_config = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    config_from_hf(hf_config, dtype or torch.float32)  # refuse before reading the weights
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        p, local_files_only=True, dtype="auto" if dtype is None else dtype)
    return from_hf(hf_model, dtype=dtype, device=device)
