"""`CostModel`: what recomputing, decoding and reloading KV costs, in seconds.

Shared by the value-aware policies (a block's price is its reuse odds times what losing it
costs) and the simulator (virtual time). The prefill time of ``n`` new tokens after ``c``
cached ones is a linear term (the matmuls, ``2 * params`` FLOPs per token) plus an attention
term that grows with the context (``4 * layers * attn_dim`` FLOPs per query-key pair)::

    prefill(n, c) = overhead + n * linear + attn * n * (c + (n + 1) / 2)
    linear = 2 * params / (peak_flops * mfu)
    attn   = 4 * num_layers * attn_dim / (peak_flops * mfu)

so recomputing block ``d`` (tokens ``d*B .. (d+1)*B``) costs ``prefill(B, d*B)``, which
grows with its depth. Decode is memory-bound: one step reads the weights and the context's
KV, ``decode(c) = step_overhead + (weight_bytes + c * kv_bytes_per_token) / hbm_bandwidth``.
Reloading a block from a lower tier costs ``nbytes / link_bandwidth``.

Defaults: Llama-3-8B (8.03e9 parameters, bf16) on one NVIDIA H100 SXM, from the NVIDIA H100
datasheet: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, PCIe Gen5 x16 64 GB/s host link; model
FLOPs utilisation 0.5 for prefill, as reported for well-tuned serving engines (e.g. Sarathi-
Serve, OSDI'24). The result, ~2e-5 s per prefill token, matches published vLLM prefill
throughputs of tens of thousands of tokens per second for 8B models on one H100. Every field
can be overridden, and ``kvevict calibrate`` fits them to a real engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout, preset

__all__ = ["MODEL_PARAMS", "CostModel", "PrefillLedger", "check_block_size",
           "check_cost_model"]

#: Parameters per token of forward pass (activated parameters for MoE), from model cards.
MODEL_PARAMS: dict[str, float] = {
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "llama-2-7b": 6.74e9,
    "mistral-7b": 7.24e9,
    "qwen2-7b": 7.62e9,
    "qwen2.5-0.5b": 0.49e9,
    "falcon-7b": 7.22e9,
    "deepseek-v3": 37e9,  # 671B total, 37B activated per token
    "deepseek-v2-lite": 2.4e9,  # 15.7B total, 2.4B activated
}

H100_BF16_FLOPS = 989e12
H100_HBM_BYTES_PER_S = 3.35e12
PCIE5_X16_BYTES_PER_S = 64e9


def _non_negative(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        math.isfinite(value) and value >= 0
    ):
        raise ConfigError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _bool(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    _non_negative(instance, attribute, value)
    if value == 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class CostModel:
    """Seconds for prefill, decode and reload (see the module docstring for the formulas).

    Attributes:
        linear_s_per_token: prefill seconds per new token, context-independent part.
        attn_s_per_pair: prefill seconds per (query, key) pair of attention.
        prefill_overhead_s: fixed seconds per prefill call.
        decode_step_s: seconds per decode step with an empty context (weights read).
        decode_s_per_context_token: extra decode seconds per token of context (KV read).
        reload_bytes_per_s: lower-tier to device bandwidth for reloads.
        kv_bytes_per_token: KV bytes per token (from the layout), used for reload sizes.
        decode_s_per_seq: extra decode seconds per sequence in the batch (per-sequence work
            that does not scale with the context: a small engine's launch and gather
            overhead). 0 by default (a large GPU engine's batch is one kernel per layer);
            ``kvevict calibrate`` fits it.
        decode_pads_batch: a decode batch costs as if every sequence had the longest
            context of the batch (an engine that pads the batch to one dense attention
            call; kvevict's built-in one does so for short contexts) rather than the sum of
            the contexts (a paged attention kernel). False by default; ``kvevict calibrate``
            measures which.
    """

    linear_s_per_token: float = attrs.field(default=2.0 * 8.03e9 / (H100_BF16_FLOPS * 0.5),
                                            validator=_non_negative)
    attn_s_per_pair: float = attrs.field(default=4 * 32 * 4096 / (H100_BF16_FLOPS * 0.5),
                                         validator=_non_negative)
    prefill_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    decode_step_s: float = attrs.field(default=2 * 8.03e9 / H100_HBM_BYTES_PER_S,
                                       validator=_non_negative)
    decode_s_per_context_token: float = attrs.field(default=131072 / H100_HBM_BYTES_PER_S,
                                                    validator=_non_negative)
    reload_bytes_per_s: float = attrs.field(default=PCIE5_X16_BYTES_PER_S, validator=_positive)
    kv_bytes_per_token: int = attrs.field(default=131072, validator=_non_negative)
    decode_s_per_seq: float = attrs.field(default=0.0, validator=_non_negative)
    decode_pads_batch: bool = attrs.field(default=False, validator=_bool)

    @classmethod
    def for_model(cls, model: str | KVLayout, params: float | None = None, *,
                  peak_flops: float = H100_BF16_FLOPS, mfu: float = 0.5,
                  hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S,
                  link_bytes_per_s: float = PCIE5_X16_BYTES_PER_S,
                  weight_bytes_per_param: float = 2.0) -> CostModel:
        """Derive a cost model from a layout (or preset name) and hardware figures.

        ``params`` defaults to `MODEL_PARAMS` for presets; it is required otherwise.
        """
        layout = preset(model) if isinstance(model, str) else model
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"model must be a preset name or a KVLayout, got {model!r}")
        if params is None:
            params = MODEL_PARAMS.get(layout.name or "")
            if params is None:
                raise ConfigError(
                    f"no parameter count known for {layout.name!r}; pass params= (known: "
                    f"{', '.join(MODEL_PARAMS)})"
                )
        for name, value in (("params", params), ("peak_flops", peak_flops),
                            ("hbm_bytes_per_s", hbm_bytes_per_s),
                            ("link_bytes_per_s", link_bytes_per_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
            raise ConfigError(f"mfu must be in (0, 1], got {mfu!r}")
        flops = peak_flops * mfu
        if layout.attention == "mla":
            attn_dim = (layout.num_attention_heads or 1) * 192  # qk_nope 128 + rope 64
        else:
            attn_dim = (layout.num_attention_heads or layout.num_kv_heads) * layout.head_dim
        return cls(
            linear_s_per_token=2.0 * params / flops,
            attn_s_per_pair=4.0 * layout.num_layers * attn_dim / flops,
            decode_step_s=weight_bytes_per_param * params / hbm_bytes_per_s,
            decode_s_per_context_token=layout.bytes_per_token / hbm_bytes_per_s,
            reload_bytes_per_s=link_bytes_per_s,
            kv_bytes_per_token=layout.bytes_per_token,
        )

    def prefill_seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` already in the cache."""
        if new_tokens < 0 or cached_tokens < 0:
            raise ConfigError(f"token counts must be >= 0, got new={new_tokens}, "
                              f"cached={cached_tokens}")
        if new_tokens == 0:
            return 0.0
        n, c = new_tokens, cached_tokens
        return (self.prefill_overhead_s + n * self.linear_s_per_token
                + self.attn_s_per_pair * n * (c + (n + 1) / 2))

    def decode_seconds(self, context_tokens: int, batch: int = 1) -> float:
        """Seconds for one decode step of ``batch`` sequences of ``context_tokens`` each
        (`decode_batch_seconds` for sequences of different lengths)."""
        return (self.decode_step_s + batch * self.decode_s_per_seq
                + batch * context_tokens * self.decode_s_per_context_token)

    def decode_batch_seconds(self, contexts: Sequence[int]) -> float:
        """Seconds for one decode step over sequences with these context lengths (0 for
        none): the fixed step, per sequence, and per context token, where a padding engine
        (`decode_pads_batch`) pays every sequence the longest context."""
        if not contexts:
            return 0.0
        b = len(contexts)
        context = b * max(contexts) if self.decode_pads_batch else sum(contexts)
        return (self.decode_step_s + b * self.decode_s_per_seq
                + context * self.decode_s_per_context_token)

    def recompute_seconds(self, depth: int, block_size: int) -> float:
        """Seconds to recompute block ``depth`` (its ``block_size`` tokens after the prefix)."""
        return self.prefill_seconds(block_size, depth * block_size)

    def reload_seconds(self, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` back from the lower tier."""
        return nbytes / self.reload_bytes_per_s

    def scaled(self, factor: float) -> CostModel:
        """This model on an engine ``factor`` times slower: every duration multiplied by
        ``factor`` (the reload bandwidth divided by it). The engine benchmark uses it to
        express measured engine seconds on a time-compressed workload's clock."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 0):
            raise ConfigError(f"factor must be a positive finite number, got {factor!r}")
        return attrs.evolve(
            self, linear_s_per_token=self.linear_s_per_token * factor,
            attn_s_per_pair=self.attn_s_per_pair * factor,
            prefill_overhead_s=self.prefill_overhead_s * factor,
            decode_step_s=self.decode_step_s * factor,
            decode_s_per_context_token=self.decode_s_per_context_token * factor,
            decode_s_per_seq=self.decode_s_per_seq * factor,
            reload_bytes_per_s=self.reload_bytes_per_s / factor)

    def to_dict(self) -> dict[str, float]:
        """The fields as a JSON-ready dict (`from_dict` reads it back)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """A cost model from a dict of fields (missing ones keep their defaults), or from
        the JSON `kvevict calibrate` writes (its ``"cost_model"`` entry). Unknown fields
        raise `ConfigError`."""
        if isinstance(data, dict) and isinstance(data.get("cost_model"), dict):
            data = data["cost_model"]
        if not isinstance(data, dict):
            raise ConfigError(f"a cost model is a JSON object of fields, got "
                              f"{type(data).__name__}")
        names = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"unknown cost model field(s) {', '.join(map(repr, unknown))}; "
                              f"valid fields: {', '.join(names)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write the fields to ``path`` as JSON."""
        Path(path).write_text(json.dumps({"cost_model": self.to_dict()}, indent=2,
                                         sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a cost model saved by `save` or by ``kvevict calibrate``; a missing or
        malformed file raises `ConfigError` naming it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"cost model file {path} does not exist") from None
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read cost model file {path}: {exc}") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


class PrefillLedger:
    """The prefill compute of a stream of prompts, and what their cached prefixes saved of
    it, by a `CostModel`: what a cost-aware policy (`market`, `learned`, `gdsf`) optimizes,
    where a hit ratio counts a shallow block as much as a deep one.

    A prompt of ``n`` tokens of which the first ``c`` were served from the cache costs
    ``prefill(n - c, c)``; with nothing cached it costs ``prefill(n, 0)`` (``full_s``), and
    the difference is saved (``saved_s``). The prefill is quadratic in the context, so a
    hit on a long prompt's prefix saves more than its share of the tokens. A prompt served
    whole costs nothing (its fixed overhead is saved too). Reload time from a lower tier is
    not counted here (`kvevict.tiers` counts the bytes moved).
    """

    __slots__ = ("cost_model", "full_s", "saved_s")

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model
        self.full_s = 0.0  #: prefill seconds of every prompt with nothing cached
        self.saved_s = 0.0  #: of those, what the cached prefixes saved

    def add(self, prompt_tokens: int, cached_tokens: int) -> tuple[float, float]:
        """One prompt of ``prompt_tokens``, the first ``cached_tokens`` served from the
        cache (0 for a request that could not run): its (full, saved) prefill seconds."""
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ConfigError(f"cached tokens must be in [0, prompt tokens], got "
                              f"{cached_tokens} of {prompt_tokens}")
        prefill = self.cost_model.prefill_seconds
        full = prefill(prompt_tokens, 0)
        saved = (full - prefill(prompt_tokens - cached_tokens, cached_tokens)
                 if cached_tokens else 0.0)
        self.full_s += full
        self.saved_s += saved
        return full, saved


def check_cost_model(cost_model: CostModel | None) -> CostModel:
    """``cost_model``, or the default `CostModel` for None; `ConfigError` for anything else
    (a policy parameter check)."""
    if cost_model is None:
        return CostModel()
    if not isinstance(cost_model, CostModel):
        raise ConfigError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
    return cost_model


def check_block_size(block_size: int | None) -> int | None:
    """A policy's optional ``block_size`` parameter: an int >= 1, or None."""
    if block_size is not None and (isinstance(block_size, bool)
                                   or not isinstance(block_size, int) or block_size < 1):
        raise ConfigError(f"block_size must be an int >= 1 or None, got {block_size!r}")
    return block_size
