"""A Llama-style decoder with paged attention over a `BlockPool`, and a dense reference.

The model is deliberately small and explicit: plain tensors, no autograd, no ``nn.Module``.
It drives the KV pool with real K/V data, checks token for token that paged attention over
cached blocks gives the logits of a full recompute, and runs the weights of a Hugging Face
Llama, Qwen2 or Mistral checkpoint (see `kvevict.engine.hf`).

Architecture (as Hugging Face ``LlamaForCausalLM``; the optional parts in brackets)::

    x = embed[token_ids]                                   # [T, hidden]
    for each layer:
        h = rms_norm(x) * attn_norm
        q = h @ wq.T [+ bq] -> [T, num_heads, head_dim]    # RoPE applied to q and k
        k = h @ wk.T [+ bk] -> [T, num_kv_heads, head_dim] # (rotate-half convention)
        v = h @ wv.T [+ bv] -> [T, num_kv_heads, head_dim]
        x = x + attention(q, k, v) @ wo.T [+ bo]           # causal [within a sliding window],
        h = rms_norm(x) * mlp_norm                         # GQA: kv heads shared by groups
        x = x + (silu(h @ w_gate.T [+ b_gate]) * (h @ w_up.T [+ b_up])) @ w_down.T [+ b_down]
    logits = (rms_norm(x) * final_norm) @ lm_head.T        # lm_head is embed when tied

Shapes of the weights (all in ``config.dtype``, on the model's device), by the names
`LlamaModel.from_weights` takes and `LlamaModel.weights` returns (``layers.{i}.`` prefixed for
the per-layer ones)::

    embed       [vocab_size, hidden_size]
    wq          [num_heads * head_dim, hidden_size]        bq [num_heads * head_dim]
    wk, wv      [num_kv_heads * head_dim, hidden_size]     bk, bv [num_kv_heads * head_dim]
    wo          [hidden_size, num_heads * head_dim]        bo [hidden_size]
    w_gate/up   [intermediate_size, hidden_size]           b_gate, b_up [intermediate_size]
    w_down      [hidden_size, intermediate_size]           b_down [hidden_size]
    attn_norm, mlp_norm, final_norm   [hidden_size]
    lm_head     [vocab_size, hidden_size]                  (absent when tie_embeddings)

Biases exist only where the config asks for them (``qkv_bias``: Qwen2; ``o_bias`` and
``mlp_bias``: Llama's ``attention_bias`` / ``mlp_bias``). Internally q/k/v and gate/up are
stored fused (one matrix multiply each); ``layers[i]["wq"]`` and friends are views into them.

Random weights: matrices and biases are drawn from ``normal(0, 0.02)`` with a
``torch.Generator`` seeded by ``seed`` (on the CPU, in float32, then cast), norms are ones, so
a seed gives the same weights on every device and dtype. Logits are returned in float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["ROPE_SCALING_KINDS", "SUPPORTED_DTYPES", "LlamaModel", "ModelConfig", "RopeScaling"]

#: Dtypes the model runs in.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

#: RoPE scaling kinds `RopeScaling` implements (Hugging Face ``rope_type`` names).
ROPE_SCALING_KINDS: tuple[str, ...] = ("linear", "llama3")

#: ``scaled_dot_product_attention(enable_gqa=)`` exists from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def _positive_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _optional_positive_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive_int(inst, attribute, value)


def _positive_float(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _optional_positive_float(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive_float(inst, attribute, value)


def _is_bool(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be a bool, got {value!r}")


def _supported_dtype(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"{attribute.name} must be one of {', '.join(map(str, SUPPORTED_DTYPES))}, "
            f"got {value!r}"
        )


def _layer_tuple(value: Any) -> Any:
    """attrs converter: any iterable of layer indices (not a string) becomes a tuple."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    try:
        return tuple(value)
    except TypeError:
        return value


@attrs.frozen
class RopeScaling:
    """RoPE frequency scaling for long contexts, as Hugging Face's ``rope_parameters``.

    ``kind="linear"`` divides every frequency by ``factor`` (position interpolation).
    ``kind="llama3"`` (Llama 3.1+) divides the low frequencies (wavelength above
    ``original_max_position_embeddings / low_freq_factor``) by ``factor``, keeps the high ones
    (wavelength below ``original_max_position_embeddings / high_freq_factor``) and blends in
    between. Other kinds (yarn, dynamic, longrope, ...) are not implemented: `ConfigError`.
    """

    kind: str
    factor: float = attrs.field(validator=_positive_float)
    low_freq_factor: float = attrs.field(default=1.0, validator=_positive_float)
    high_freq_factor: float = attrs.field(default=4.0, validator=_positive_float)
    original_max_position_embeddings: int = attrs.field(default=8192, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ConfigError(f"RoPE scaling kind {self.kind!r} is not supported; supported: "
                              f"{', '.join(ROPE_SCALING_KINDS)} (or no scaling)")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Scale the float32 inverse frequencies ``[head_dim / 2]`` (as transformers does)."""
        if self.kind == "linear":
            return inv_freq / self.factor
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)


@attrs.frozen
class ModelConfig:
    """Sizes and options of a Llama-style decoder. Invalid values raise `ConfigError`.

    ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA; equal means MHA) and
    ``head_dim`` must be even (RoPE rotates pairs). ``hidden_size`` need not equal
    ``num_heads * head_dim``: ``wo`` maps the concatenated heads back to ``hidden_size``.

    Options beyond the plain Llama (all off by default):

    * ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: biases on the q/k/v, output and MLP
      projections (Qwen2 has q/k/v biases; Llama's ``attention_bias`` means q/k/v and o).
    * ``tie_embeddings``: the LM head is the embedding matrix.
    * ``sliding_window``: a query at position ``p`` attends only to keys at positions
      ``p - sliding_window + 1 .. p`` (Mistral; Qwen2 with ``use_sliding_window``), in the
      layers listed in ``sliding_layers`` (None: every layer).
    * ``rope_scaling``: a `RopeScaling` (``linear`` or ``llama3``).
    * ``attention_scale``: the softmax scale (None: ``head_dim ** -0.5``).
    """

    vocab_size: int = attrs.field(validator=_positive_int)
    hidden_size: int = attrs.field(validator=_positive_int)
    num_layers: int = attrs.field(validator=_positive_int)
    num_heads: int = attrs.field(validator=_positive_int)
    num_kv_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    intermediate_size: int = attrs.field(validator=_positive_int)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    rms_eps: float = attrs.field(default=1e-5, validator=_positive_float)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_supported_dtype)
    qkv_bias: bool = attrs.field(default=False, validator=_is_bool)
    o_bias: bool = attrs.field(default=False, validator=_is_bool)
    mlp_bias: bool = attrs.field(default=False, validator=_is_bool)
    tie_embeddings: bool = attrs.field(default=False, validator=_is_bool)
    sliding_window: int | None = attrs.field(default=None, validator=_optional_positive_int)
    sliding_layers: tuple[int, ...] | None = attrs.field(default=None, converter=_layer_tuple)
    rope_scaling: RopeScaling | None = None
    attention_scale: float | None = attrs.field(default=None,
                                                validator=_optional_positive_float)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling or None, got "
                              f"{type(self.rope_scaling).__name__}")
        layers = self.sliding_layers
        if layers is not None:
            if self.sliding_window is None:
                raise ConfigError("sliding_layers is set but sliding_window is None")
            if not isinstance(layers, tuple) or not all(
                type(i) is int and 0 <= i < self.num_layers for i in layers
            ) or len(set(layers)) != len(layers):
                raise ConfigError(
                    f"sliding_layers must be distinct layer indices in [0, {self.num_layers}), "
                    f"got {layers!r}"
                )

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

    def layout(self) -> KVLayout:
        """The KV layout of this model: MHA when the head counts are equal, else GQA."""
        if self.num_heads == self.num_kv_heads:
            return KVLayout.mha(self.num_layers, self.num_heads, self.head_dim, self.dtype)
        return KVLayout.gqa(
            self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every weight this config needs (the `LlamaModel.from_weights`
        names, in the order the random initialisation draws them)."""
        c = self
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {"embed": (c.vocab_size, c.hidden_size)}
        for i in range(c.num_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm"] = (c.hidden_size,)
            shapes[p + "wq"] = (q_out, c.hidden_size)
            shapes[p + "wk"] = (kv_out, c.hidden_size)
            shapes[p + "wv"] = (kv_out, c.hidden_size)
            shapes[p + "wo"] = (c.hidden_size, q_out)
            shapes[p + "mlp_norm"] = (c.hidden_size,)
            shapes[p + "w_gate"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "w_up"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "w_down"] = (c.hidden_size, c.intermediate_size)
            if c.qkv_bias:
                shapes[p + "bq"] = (q_out,)
                shapes[p + "bk"] = (kv_out,)
                shapes[p + "bv"] = (kv_out,)
            if c.o_bias:
                shapes[p + "bo"] = (c.hidden_size,)
            if c.mlp_bias:
                shapes[p + "b_gate"] = (c.intermediate_size,)
                shapes[p + "b_up"] = (c.intermediate_size,)
                shapes[p + "b_down"] = (c.hidden_size,)
        shapes["final_norm"] = (c.hidden_size,)
        if not c.tie_embeddings:
            shapes["lm_head"] = (c.vocab_size, c.hidden_size)
        return shapes

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies ``[head_dim / 2]`` in float32 on the CPU (scaled if
        ``rope_scaling`` says so), computed as transformers computes them."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** exponent)
        if self.rope_scaling is not None:
            inv_freq = self.rope_scaling.apply(inv_freq)
        return inv_freq


_NORMS = ("attn_norm", "mlp_norm", "final_norm")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """A Llama-style decoder (see the module docstring), seeded random weights by default.

    Args:
        config: the sizes, options and dtype.
        seed: seed of the weight generator; same seed, same weights.
        device: torch device of the weights and activations.

    Other constructors: `from_weights` (named tensors) and `from_hf` (a transformers
    ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM``).

    Two forwards:

    * `forward_dense` recomputes everything from the token ids, without any cache.
    * `forward_paged` writes the K/V of new tokens into a `BlockPool` and attends over the
      K/V gathered back from the pool's blocks, for a batch of sequences at once.
    """

    def __init__(self, config: ModelConfig, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        gen = torch.Generator(device="cpu").manual_seed(seed)
        weights: dict[str, torch.Tensor] = {}
        for name, shape in config.weight_shapes().items():
            if name.rsplit(".", 1)[-1] in _NORMS:
                weights[name] = torch.ones(shape)
            else:
                weights[name] = torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02
        self.seed: int | None = seed
        self._load(config, weights, device)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                     device: str | torch.device = "cpu") -> LlamaModel:
        """A model with the given weights, by the names of `ModelConfig.weight_shapes`.

        Every needed name must be present with exactly its shape and a floating-point dtype
        (tensors are cast to ``config.dtype`` and moved to ``device``); a missing, extra or
        misshapen tensor raises `ConfigError` naming it.
        """
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not isinstance(weights, Mapping):
            raise ConfigError(f"weights must be a mapping name -> tensor, got "
                              f"{type(weights).__name__}")
        shapes = config.weight_shapes()
        missing = [n for n in shapes if n not in weights]
        extra = [n for n in weights if n not in shapes]
        if missing or extra:
            raise ConfigError(
                "weights do not match the config: "
                + (f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}" if missing
                   else "")
                + ("; " if missing and extra else "")
                + (f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}" if extra else "")
            )
        for name, shape in shapes.items():
            t = weights[name]
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"weight {name!r} must be a torch.Tensor, got "
                                  f"{type(t).__name__}")
            if not t.is_floating_point():
                raise ConfigError(f"weight {name!r} has dtype {t.dtype}; expected a "
                                  "floating-point tensor")
            if tuple(t.shape) != shape:
                raise ConfigError(f"weight {name!r} has shape {tuple(t.shape)}, expected "
                                  f"{shape}")
        model = cls.__new__(cls)
        model.seed = None
        cls._load(model, config, weights, device)  # the class initialising its own instance
        return model

    @classmethod
    def from_hf(cls, model: Any, *, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None) -> LlamaModel:
        """The weights of a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
        ``MistralForCausalLM`` instance; see `kvevict.engine.hf.from_hf`."""
        from kvevict.engine.hf import from_hf

        return from_hf(model, dtype=dtype, device=device)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> LlamaModel:
        """Load a local Hugging Face checkpoint directory through transformers; see
        `kvevict.engine.hf.load_pretrained`."""
        from kvevict.engine.hf import load_pretrained

        return load_pretrained(path, dtype=dtype, device=device)

    def _load(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
              device: str | torch.device) -> None:
        """Set the weights (validated by the caller), fusing q/k/v and gate/up."""
        self.config = c = config
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {device!r} is not a torch device: {exc}") from None

        def get(name: str) -> torch.Tensor:
            return weights[name].detach().to(device=self.device, dtype=c.dtype)

        def fused(names: list[str]) -> torch.Tensor:
            return torch.cat([weights[n].detach().to(c.dtype) for n in names]).to(self.device)

        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv_split = [q_out, q_out + kv_out]
        self.embed = get("embed")
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            wqkv = fused([p + "wq", p + "wk", p + "wv"])
            w_gate_up = fused([p + "w_gate", p + "w_up"])
            layer: dict[str, torch.Tensor | None] = {
                "attn_norm": get(p + "attn_norm"),
                "wqkv": wqkv,
                "bqkv": fused([p + "bq", p + "bk", p + "bv"]) if c.qkv_bias else None,
                "wo": get(p + "wo"),
                "bo": get(p + "bo") if c.o_bias else None,
                "mlp_norm": get(p + "mlp_norm"),
                "w_gate_up": w_gate_up,
                "b_gate_up": fused([p + "b_gate", p + "b_up"]) if c.mlp_bias else None,
                "w_down": get(p + "w_down"),
                "b_down": get(p + "b_down") if c.mlp_bias else None,
            }
            layer["wq"], layer["wk"], layer["wv"] = wqkv.tensor_split(qkv_split)
            layer["w_gate"], layer["w_up"] = w_gate_up.chunk(2)
            bqkv, b_gate_up = layer["bqkv"], layer["b_gate_up"]
            if bqkv is not None:
                layer["bq"], layer["bk"], layer["bv"] = bqkv.tensor_split(qkv_split)
            if b_gate_up is not None:
                layer["b_gate"], layer["b_up"] = b_gate_up.chunk(2)
            self.layers.append(layer)
        self.final_norm = get("final_norm")
        self.lm_head = self.embed if c.tie_embeddings else get("lm_head")
        self.inv_freq = c.inv_freq().to(self.device)
        self._windows = [c.layer_window(i) for i in range(c.num_layers)]
        self._cos = self._sin = torch.empty(0, c.head_dim, device=self.device, dtype=c.dtype)

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight by its `ModelConfig.weight_shapes` name (views, not copies), so that
        ``LlamaModel.from_weights(model.config, model.weights())`` rebuilds the model."""
        out: dict[str, torch.Tensor] = {}
        for name in self.config.weight_shapes():
            if name.startswith("layers."):
                _, i, key = name.split(".")
                tensor = self.layers[int(i)][key]
                assert tensor is not None  # weight_shapes lists only the configured biases
                out[name] = tensor
            else:
                out[name] = getattr(self, name)
        return out

    # ------------------------------------------------------------------ building blocks

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return weight * xf.to(x.dtype)

    def _rope_tables(self, positions: torch.Tensor,
                     max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` (model dtype) at ``positions``, from a table grown
        in powers of two; the values equal transformers' (float32, cast to the dtype)."""
        if max_position >= self._cos.shape[0]:
            size = max(256, 1 << max_position.bit_length())
            pos = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(self.config.dtype)
            self._sin = emb.sin().to(self.config.dtype)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """``scaled_dot_product_attention`` over ``[batch, heads, len, head_dim]`` or
        ``[heads, len, head_dim]`` tensors, with fewer KV heads than query heads (GQA).

        3-D inputs get a batch dimension: on the CPU, torch runs its fused (flash) kernel on
        4-D inputs only and falls back to a several times slower reference path otherwise."""
        if q.dim() == 3:
            return self._sdpa(q[None], k[None], v[None], mask, causal)[0]
        g = self.config.group_size
        scale = self.config.attention_scale
        if g > 1 and not _SDPA_HAS_GQA:
            k = k.repeat_interleave(g, dim=-3)
            v = v.repeat_interleave(g, dim=-3)
        kwargs = {"enable_gqa": True} if g > 1 and _SDPA_HAS_GQA else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, **kwargs)

    def _run_layers(self, ids: torch.Tensor, positions: torch.Tensor, max_position: int,
                    attend: Any) -> torch.Tensor:
        """Embed ``ids [T]`` at ``positions [T]`` and run every layer; ``attend(layer_index,
        q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])`` returns attention ``[T, Hq * D]``.
        Returns the final hidden states ``[T, hidden]`` (before the final norm)."""
        c = self.config
        t = ids.shape[0]
        qk_heads = c.num_heads + c.num_kv_heads
        cos, sin = self._rope_tables(positions, max_position)
        x = self.embed[ids]
        for li, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer["attn_norm"])
            qkv = F.linear(h, layer["wqkv"], layer["bqkv"])
            qk = qkv[:, :qk_heads * c.head_dim].view(t, qk_heads, c.head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, qk_heads * c.head_dim:].view(t, c.num_kv_heads, c.head_dim)
            x = x + F.linear(attend(li, q, k, v), layer["wo"], layer["bo"])
            h = self._rms_norm(x, layer["mlp_norm"])
            gate, up = F.linear(h, layer["w_gate_up"], layer["b_gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["w_down"], layer["b_down"])
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()

    # ------------------------------------------------------------------ validation

    def _check_tokens(self, token_ids: Any, what: str = "token_ids") -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor):
            raise ConfigError(f"{what} must be a 1-D torch.Tensor of ints, got "
                              f"{type(token_ids).__name__}")
        if token_ids.dim() != 1:
            raise ConfigError(f"{what} must be 1-D [n], got shape {tuple(token_ids.shape)}")
        if token_ids.dtype == torch.bool or token_ids.is_floating_point() or \
                token_ids.is_complex():
            raise ConfigError(f"{what} must have an integer dtype, got {token_ids.dtype}")
        if token_ids.numel() == 0:
            raise ConfigError(f"{what} is empty; at least one token is needed")
        if token_ids.numel() == 1:
            lo = hi = int(token_ids[0])
        else:
            lo, hi = (int(v) for v in torch.aminmax(token_ids))
        if lo < 0 or hi >= self.config.vocab_size:
            raise ConfigError(
                f"{what} must be in [0, {self.config.vocab_size}), got values in [{lo}, {hi}]"
            )
        return token_ids.to(device=self.device, dtype=torch.long)

    def check_pool(self, pool: BlockPool) -> None:
        """Raise `ConfigError` unless ``pool`` can hold this model's K/V."""
        if not isinstance(pool, BlockPool):
            raise ConfigError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if pool.kv is None or pool.layout is None:
            raise ConfigError("pool has no KV tensor (metadata-only); create it with a layout "
                              "and storage=True")
        c, lay = self.config, pool.layout
        got = (lay.num_layers, lay.kv_planes, lay.num_kv_heads, lay.head_dim)
        want = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        if got != want:
            raise ConfigError(
                "pool layout does not match the model: (num_layers, kv_planes, num_kv_heads, "
                f"head_dim) is {got} in the pool, {want} in the model"
            )
        if pool.dtype != c.dtype:
            raise ConfigError(f"pool dtype is {pool.dtype}, model dtype is {c.dtype}")
        if pool.device != self.device:
            raise ConfigError(f"pool is on {pool.device}, model is on {self.device}")
        if not pool.kv.is_contiguous():
            raise ConfigError("pool.kv must be contiguous (as BlockPool allocates it)")

    def _check_entries(self, pool: BlockPool, seqs: Any
                       ) -> list[tuple[torch.Tensor, int, list[int]]]:
        """Validate ``forward_paged``'s ``seqs``; return ``(ids, start, table[:needed])``."""
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence) or not seqs:
            raise ConfigError("seqs must be a non-empty list of (token_ids, start, block_table)")
        bs, num_blocks = pool.block_size, pool.num_blocks
        prepared: list[tuple[torch.Tensor, int, list[int]]] = []
        for i, entry in enumerate(seqs):
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise ConfigError(f"seqs[{i}] must be (token_ids, start, block_table), got "
                                  f"{entry!r}")
            token_ids, start, table = entry
            ids = self._check_tokens(token_ids, f"seqs[{i}] token_ids")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ConfigError(f"seqs[{i}] start must be an int >= 0, got {start!r}")
            end = start + ids.shape[0]
            need = -(-end // bs)
            table = list(table)
            if len(table) < need:
                raise ConfigError(
                    f"seqs[{i}] block_table has {len(table)} blocks; positions [0, {end}) with "
                    f"block_size {bs} need {need}"
                )
            table = table[:need]
            for b in table:
                if type(b) is not int or not 0 <= b < num_blocks:
                    raise ConfigError(f"seqs[{i}] block id {b!r} is not an int in [0, "
                                      f"{num_blocks})")
            free = pool.first_free(table)
            if free is not None:
                raise ConfigError(f"seqs[{i}] block {free} is free (not allocated)")
            if len(set(table)) != len(table):
                raise ConfigError(f"seqs[{i}] block_table repeats a block: {table}")
            prepared.append((ids, start, table))
        return prepared

    # ------------------------------------------------------------------ forwards

    @torch.no_grad()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Full recompute without any cache: ``token_ids [T]`` -> float32 logits ``[T, vocab]``."""
        ids = self._check_tokens(token_ids)
        n = ids.shape[0]
        positions = torch.arange(n, device=self.device)
        masks: dict[int | None, torch.Tensor] = {}

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            window = self._windows[li]
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            if window is None or window >= n:
                out = self._sdpa(q, k, v, causal=True)
            else:
                if window not in masks:
                    masks[window] = _causal_mask(positions, positions, window)
                out = self._sdpa(q, k, v, masks[window])
            return out.transpose(0, 1).reshape(n, -1)

        return self._logits(self._run_layers(ids, positions, n - 1, attend))

    @torch.no_grad()
    def forward_paged(
        self,
        pool: BlockPool,
        seqs: Sequence[tuple[torch.Tensor, int, Sequence[int]]],
        *,
        return_all: bool = False,
        positions: Sequence[int] | None = None,
        queries: Sequence[int] | None = None,
        head_masks: Sequence[torch.Tensor | None] | None = None,
        kv_store: Any = None,
    ) -> Any:
        """Run new tokens of several sequences, with K/V stored in and read from ``pool``.

        Each entry of ``seqs`` is ``(token_ids [n], start, block_table)``: the sequence's new
        tokens at positions ``start .. start+n-1``, and the pool blocks holding its context
        (``block_table[i]`` holds positions ``i*block_size .. (i+1)*block_size - 1``). Positions
        ``0 .. start-1`` must already be in the pool (a cached prefix or earlier steps). For
        every layer the new tokens' K/V are written to block ``pos // block_size``, slot
        ``pos % block_size``; then the new queries attend causally (within the sliding window,
        if the config has one) over K/V gathered from the blocks. This covers prefill
        (``start = 0``), chunked prefill and prefill after a cached prefix (``start > 0,
        n > 1``) and decode (``n = 1``), mixed freely in one call.

        All new tokens of all sequences go through the projections and the MLP as one batch.
        Attention runs once for all decode entries (``n = 1``: block tables gathered with one
        ``index_select``, padded to the longest context, masked; one call per bucket of similar
        lengths, see ``_decode_buckets``) and once per longer entry.
        Writes go only to the slots of the new positions, so blocks before ``start //
        block_size`` are never modified; a caller that shares a partly filled block must
        copy it first (copy-on-write is the cache manager's business). Every entry's K/V are
        written before any entry attends, layer by layer, so an entry may read blocks another
        entry of the same call fills; two entries may write the same slot only with the same
        token at the same position (a block the manager deduplicated), one write wins.

        Everything is validated before anything is written; invalid input raises `ConfigError`
        and leaves the pool unchanged.

        **Token eviction** (`kvevict.engine.executor`, ``token_policy``) decouples a sequence's
        slots from its positions: after some tokens were dropped and the kept ones compacted
        into the first slots, ``start`` is the *slot* of the first new token (its K/V go to
        slot ``start``, it attends causally over slots ``0 .. start``) while ``positions[i]``
        is its *position*, the one RoPE rotates it by (default: ``start``). Kept tokens keep
        the rotation of their original position. A position other than the slot needs full
        attention in every layer (a sliding window counts positions): `ConfigError`.

        **Per-head masks** (``head_masks``, head-granular token eviction): an entry's mask,
        bool ``[num_layers, num_kv_heads, start]``, says which of its ``start`` stored slots
        each (layer, kv head) attends to; its new tokens are always seen (causally). Such an
        entry runs its own attention call, under that mask, even as a decode; entries without
        a mask take the batched paths above.

        Args:
            pool: the tensor-backed `BlockPool` (`check_pool`).
            seqs: ``(token_ids, start, block_table)`` per sequence (see above).
            return_all: return the logits of every new token, not only the last.
            positions: per entry, the position of its first new token (None: ``start``).
            queries: per entry, how many of its last new tokens' queries (post-RoPE) to
                return as well, ``0 .. n`` (None: none, and the plain return value).
            head_masks: per entry, None or its per-head mask (see above); None: no masks.
            kv_store: None, or ``kv_store(layer, keys, values) -> (keys, values)`` on the new
                tokens' K/V ``[1, Hkv, n, D]`` of every layer: what the pool keeps of them (a
                token policy's ``store_kv``: MoE-nD's quantization). The forward attends to
                its own new tokens as computed and to earlier ones as the pool keeps them: the
                computed K/V are written, attended to, then replaced by ``kv_store``'s.

        Returns:
            float32 logits of each sequence's last new token, ``[len(seqs), vocab]``; with
            ``return_all=True`` a list of ``[n_i, vocab]`` tensors, one per sequence. With
            ``queries``, the pair ``(logits, captured)``: ``captured[i]`` is None for a count
            of 0, else one ``[num_heads, count, head_dim]`` tensor per layer (model dtype).
        """
        self.check_pool(pool)
        prepared = self._check_entries(pool, seqs)
        logical = self._check_positions(prepared, positions)
        capture = self._check_queries(prepared, queries)
        masked = self._check_head_masks(prepared, head_masks)
        bs, dev = pool.block_size, self.device
        # decode entries sorted by context length, then cut into buckets (see _decode_buckets)
        decode = sorted((i for i, e in enumerate(prepared)
                         if e[0].shape[0] == 1 and masked[i] is None),
                        key=lambda i: prepared[i][1])
        longer = [i for i, e in enumerate(prepared) if e[0].shape[0] > 1 or masked[i] is not None]
        order = decode + longer

        # RoPE positions and flat pool slots (block * block_size + offset) of every new token
        positions_parts: list[torch.Tensor] = []
        slots_parts: list[torch.Tensor] = []
        if decode:
            starts = [prepared[i][1] for i in decode]
            positions_parts.append(torch.tensor([logical[i] for i in decode], device=dev))
            slots_parts.append(torch.tensor(
                [prepared[i][2][s // bs] * bs + s % bs for i, s in zip(decode, starts)],
                device=dev))
        for i in longer:
            ids, start, table = prepared[i]
            slot = torch.arange(start, start + ids.shape[0], device=dev)
            positions_parts.append(slot + (logical[i] - start))
            slots_parts.append(torch.tensor(table, device=dev)[slot // bs] * bs + slot % bs)
        rope_positions = torch.cat(positions_parts)
        slots = torch.cat(slots_parts)
        ids = torch.cat([prepared[i][0] for i in order])
        max_position = max(logical[i] + prepared[i][0].shape[0] - 1 for i in order)
        # rows of each captured entry's last queries in the step's token order
        captured: list[list[torch.Tensor] | None] = [None] * len(prepared)
        rows: list[tuple[int, int, int]] = []  # (entry, first row, end row)
        offset = 0
        for i in order:
            n = prepared[i][0].shape[0]
            if capture[i]:
                rows.append((i, offset + n - capture[i], offset + n))
                captured[i] = []
            offset += n

        buckets = _decode_buckets([prepared[i][1] + 1 for i in decode])
        decode_plans = {w: [_decode_plan(prepared, decode[lo:hi], bs, w, dev)
                            for lo, hi in buckets]
                        for w in set(self._windows)} if decode else {}
        longer_plans = {w: [_chunk_plan(prepared[i], bs, w, dev) for i in longer]
                        for w in set(self._windows)} if longer else {}
        longer_masks = [masked[i] for i in longer]
        kv = pool.kv
        assert kv is not None  # checked by check_pool
        c = self.config

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_pool = kv[li, 0].view(-1, c.num_kv_heads, c.head_dim)
            v_pool = kv[li, 1].view(-1, c.num_kv_heads, c.head_dim)
            k_pool.index_copy_(0, slots, k)
            v_pool.index_copy_(0, slots, v)
            for i, lo, hi in rows:
                captured[i].append(q[lo:hi].transpose(0, 1))  # type: ignore[union-attr]
            window = self._windows[li]
            outs: list[torch.Tensor] = []
            if decode:
                for (lo, hi), plan in zip(buckets, decode_plans[window], strict=True):
                    outs.append(self._decode_attention(kv, li, q[lo:hi], plan))
            offset = len(decode)
            for plan, heads in zip(longer_plans.get(window, []), longer_masks):
                n = plan.num_new
                outs.append(self._chunk_attention(kv, li, q[offset:offset + n],
                                                  k[offset:offset + n], v[offset:offset + n],
                                                  plan, None if heads is None else heads[li]))
                offset += n
            if kv_store is not None:  # what the pool keeps, once this forward has attended
                k, v = (t[0].transpose(0, 1)
                        for t in kv_store(li, k.transpose(0, 1)[None], v.transpose(0, 1)[None]))
                k_pool.index_copy_(0, slots, k)
                v_pool.index_copy_(0, slots, v)
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        x = self._run_layers(ids, rope_positions, max_position, attend)
        lengths = [prepared[i][0].shape[0] for i in order]
        out: torch.Tensor | list[torch.Tensor]
        if return_all:
            per_seq = self._logits(x).split(lengths)
            result: list[torch.Tensor] = [torch.empty(0)] * len(prepared)
            for i, logits in zip(order, per_seq):
                result[i] = logits
            out = result
        else:
            last = torch.tensor(lengths, device=dev).cumsum(0) - 1
            inverse = [0] * len(order)
            for rank, i in enumerate(order):
                inverse[i] = rank
            last = last[torch.tensor(inverse, device=dev)]
            out = self._logits(x.index_select(0, last))
        return out if queries is None else (out, captured)

    def _check_positions(self, prepared: list[tuple[torch.Tensor, int, list[int]]],
                         positions: Any) -> list[int]:
        """Validate ``forward_paged``'s ``positions``; return one per entry."""
        starts = [start for _, start, _ in prepared]
        if positions is None:
            return starts
        if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence) or \
                len(positions) != len(prepared):
            raise ConfigError(f"positions must be a list of {len(prepared)} ints (one per "
                              f"entry of seqs), got {positions!r}")
        for i, (p, start) in enumerate(zip(positions, starts)):
            if isinstance(p, bool) or not isinstance(p, int) or p < start:
                raise ConfigError(f"positions[{i}] must be an int >= the entry's start "
                                  f"({start}): a slot holds a token at this position or "
                                  f"later, got {p!r}")
            if p != start and any(w is not None for w in self._windows):
                raise ConfigError("a position other than the slot (token eviction) needs full "
                                  "attention in every layer; this model has a sliding window")
        return list(positions)

    @staticmethod
    def _check_queries(prepared: list[tuple[torch.Tensor, int, list[int]]],
                       queries: Any) -> list[int]:
        """Validate ``forward_paged``'s ``queries``; return one count per entry."""
        if queries is None:
            return [0] * len(prepared)
        if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence) or \
                len(queries) != len(prepared):
            raise ConfigError(f"queries must be a list of {len(prepared)} counts (one per "
                              f"entry of seqs), got {queries!r}")
        for i, (count, (ids, _, _)) in enumerate(zip(queries, prepared)):
            n = ids.shape[0]
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n:
                raise ConfigError(f"queries[{i}] must be an int in [0, {n}] (the entry's new "
                                  f"tokens), got {count!r}")
        return list(queries)

    def _check_head_masks(self, prepared: list[tuple[torch.Tensor, int, list[int]]],
                          head_masks: Any) -> list[torch.Tensor | None]:
        """Validate ``forward_paged``'s ``head_masks``; return one (or None) per entry."""
        if head_masks is None:
            return [None] * len(prepared)
        if isinstance(head_masks, (str, bytes)) or not isinstance(head_masks, Sequence) or \
                len(head_masks) != len(prepared):
            raise ConfigError(f"head_masks must be a list of {len(prepared)} masks or None "
                              f"(one per entry of seqs), got {head_masks!r}")
        c = self.config
        out: list[torch.Tensor | None] = []
        for i, (mask, (_, start, _)) in enumerate(zip(head_masks, prepared)):
            want = (c.num_layers, c.num_kv_heads, start)
            if mask is not None and (not isinstance(mask, torch.Tensor)
                                     or mask.dtype != torch.bool or tuple(mask.shape) != want):
                got = (f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor)
                       else type(mask).__name__)
                raise ConfigError(f"head_masks[{i}] must be None or a bool tensor of shape "
                                  f"{list(want)} [layers, kv heads, stored slots], got {got}")
            if mask is not None and any(w is not None for w in self._windows):
                raise ConfigError("head_masks need full attention in every layer; this model "
                                  "has a sliding window")
            out.append(None if mask is None or start == 0 else mask.to(self.device))
        return out

    def _decode_attention(self, kv: torch.Tensor, li: int, q: torch.Tensor,
                          plan: _DecodePlan) -> torch.Tensor:
        """One query per sequence (``q [B, Hq, D]``) over its context, all in one call."""
        c = self.config
        b = q.shape[0]
        shape = (b, -1, c.num_kv_heads, c.head_dim)
        k = kv[li, 0].index_select(0, plan.blocks).view(shape)[:, plan.lo:plan.hi]
        v = kv[li, 1].index_select(0, plan.blocks).view(shape)[:, plan.lo:plan.hi]
        out = self._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), plan.mask)
        return out.reshape(b, -1)

    def _chunk_attention(self, kv: torch.Tensor, li: int, q: torch.Tensor, k_new: torch.Tensor,
                         v_new: torch.Tensor, plan: _ChunkPlan,
                         heads: torch.Tensor | None = None) -> torch.Tensor:
        """Several new tokens of one sequence (``q [n, Hq, D]``) over its context; ``heads``
        (bool ``[Hkv, start]``, or None) masks stored slots per kv head."""
        c = self.config
        mask = plan.mask
        if heads is not None:  # start > 0 and full attention: the context is slots 0 .. end
            seen = torch.cat([heads, heads.new_ones((heads.shape[0], plan.num_new))], dim=1)
            mask = plan.mask[None] & seen.repeat_interleave(c.group_size, dim=0)[:, None]
        if plan.blocks is None:  # start == 0: the context is exactly the new tokens
            k, v = k_new, v_new
        else:
            shape = (-1, c.num_kv_heads, c.head_dim)
            k = kv[li, 0].index_select(0, plan.blocks).view(shape)[plan.lo:plan.hi]
            v = kv[li, 1].index_select(0, plan.blocks).view(shape)[plan.lo:plan.hi]
        out = self._sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask,
                         causal=mask is None)
        return out.transpose(0, 1).reshape(q.shape[0], -1)


# ---------------------------------------------------------------------- attention plans


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[..., n, ctx]`` bool mask, True where the query at ``q_pos`` may see ``k_pos``."""
    diff = q_pos[..., :, None] - k_pos[..., None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


@attrs.frozen
class _DecodePlan:
    """Where the decode entries' contexts lie, computed once per call and window size.

    ``blocks`` is the block tables, padded to the longest and flattened; after gathering,
    key positions ``lo .. hi`` of the padded ``[B, ctx]`` rows are attended, under ``mask``
    (None when one sequence's exact context is sliced)."""

    blocks: torch.Tensor
    lo: int
    hi: int
    mask: torch.Tensor | None


@attrs.frozen
class _ChunkPlan:
    """One multi-token entry: its context blocks (None: use the new K/V directly, start 0),
    the gathered slots ``lo .. hi`` to attend, and the mask (None: plain causal)."""

    num_new: int
    blocks: torch.Tensor | None
    lo: int
    hi: int
    mask: torch.Tensor | None


def _first_key(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` attends to."""
    return 0 if window is None else max(0, position - window + 1)


#: Decode contexts shorter than this many tokens are never split into separate buckets.
DECODE_BUCKET_MIN_TOKENS = 256


def _decode_buckets(lengths: list[int]) -> list[tuple[int, int]]:
    """Cut ascending decode context lengths into contiguous ``[lo, hi)`` buckets whose
    longest context is at most twice their shortest (or at most `DECODE_BUCKET_MIN_TOKENS`).

    One attention call per bucket: padding every sequence to the batch's longest context
    would cost ``B x longest``; with buckets the padded work is at most twice the real work,
    for a few more calls."""
    buckets: list[tuple[int, int]] = []
    lo = 0
    for i, n in enumerate(lengths):
        first = lengths[lo]
        if i > lo and n > max(2 * first, DECODE_BUCKET_MIN_TOKENS):
            buckets.append((lo, i))
            lo = i
    if lengths:
        buckets.append((lo, len(lengths)))
    return buckets


def _decode_plan(prepared: list[tuple[torch.Tensor, int, list[int]]], decode: list[int],
                 bs: int, window: int | None, device: torch.device) -> _DecodePlan:
    starts = [prepared[i][1] for i in decode]
    first_blocks = [_first_key(s, window) // bs for s in starts]
    tables = [prepared[i][2][fb:] for i, fb in zip(decode, first_blocks)]
    if len(decode) == 1:  # no padding: slice the exact context, no mask
        lo = _first_key(starts[0], window) - first_blocks[0] * bs
        hi = starts[0] + 1 - first_blocks[0] * bs
        return _DecodePlan(torch.tensor(tables[0], device=device), lo, hi, None)
    width = max(len(t) for t in tables)
    padded = [t + [t[0]] * (width - len(t)) for t in tables]
    blocks = torch.tensor(padded, device=device).flatten()
    q_pos = torch.tensor(starts, device=device)[:, None]  # [B, 1]
    k_pos = (torch.tensor(first_blocks, device=device)[:, None] * bs
             + torch.arange(width * bs, device=device)[None, :])  # [B, ctx]
    mask = _causal_mask(q_pos, k_pos, window)  # [B, 1, ctx]; padding lies past the query
    return _DecodePlan(blocks, 0, width * bs, mask[:, None])  # [B, 1 (heads), 1, ctx]


def _chunk_plan(entry: tuple[torch.Tensor, int, list[int]], bs: int, window: int | None,
                device: torch.device) -> _ChunkPlan:
    ids, start, table = entry
    n = ids.shape[0]
    end = start + n
    q_pos = torch.arange(start, end, device=device)
    if start == 0:
        k_pos = q_pos
        mask = None if window is None or window >= n else _causal_mask(q_pos, k_pos, window)
        return _ChunkPlan(n, None, 0, n, mask)
    first_key = _first_key(start, window)
    fb = first_key // bs
    lo, hi = first_key - fb * bs, end - fb * bs
    k_pos = torch.arange(first_key, end, device=device)
    return _ChunkPlan(n, torch.tensor(table[fb:], device=device), lo, hi,
                      _causal_mask(q_pos, k_pos, window))
