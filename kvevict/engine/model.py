"""A Llama-style decoder with paged attention over a `BlockPool`, and a dense reference.

The model is deliberately small and explicit: plain tensors, no autograd, no ``nn.Module``.
It exists to drive the KV pool with real K/V data and to check, token for token, that paged
attention over cached blocks gives the same logits as a full recompute.

Architecture (as Hugging Face ``LlamaForCausalLM``)::

    x = embed[token_ids]                                   # [T, hidden]
    for each layer:
        h = rms_norm(x) * attn_norm
        q = h @ wq.T -> [T, num_heads, head_dim]           # RoPE applied to q and k
        k = h @ wk.T -> [T, num_kv_heads, head_dim]        # (rotate-half convention)
        v = h @ wv.T -> [T, num_kv_heads, head_dim]
        x = x + attention(q, k, v) @ wo.T                  # causal, GQA: kv heads repeated
        h = rms_norm(x) * mlp_norm
        x = x + (silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    logits = (rms_norm(x) * final_norm) @ lm_head.T        # untied lm_head, [T, vocab]

Shapes and dtypes of the weights (all in ``config.dtype``, on the model's device)::

    embed       [vocab_size, hidden_size]
    wq          [num_heads * head_dim, hidden_size]
    wk, wv      [num_kv_heads * head_dim, hidden_size]
    wo          [hidden_size, num_heads * head_dim]
    w_gate/up   [intermediate_size, hidden_size]
    w_down      [hidden_size, intermediate_size]
    norms       [hidden_size] (ones)
    lm_head     [vocab_size, hidden_size]

Matrices are drawn from ``normal(0, 0.02)`` with a ``torch.Generator`` seeded by ``seed`` (on
the CPU, in float32, then cast), so a seed gives the same weights on every device and dtype.
Logits are returned in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool

__all__ = ["SUPPORTED_DTYPES", "LlamaModel", "ModelConfig"]

#: Dtypes the model runs in.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def _positive_int(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _positive_float(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _supported_dtype(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"{attribute.name} must be one of {', '.join(map(str, SUPPORTED_DTYPES))}, "
            f"got {value!r}"
        )


@attrs.frozen
class ModelConfig:
    """Sizes of a Llama-style decoder. Invalid values raise `ConfigError`.

    ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA; equal means MHA) and
    ``head_dim`` must be even (RoPE rotates pairs). ``hidden_size`` need not equal
    ``num_heads * head_dim``: ``wo`` maps the concatenated heads back to ``hidden_size``.
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

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def layout(self) -> KVLayout:
        """The KV layout of this model: MHA when the head counts are equal, else GQA."""
        if self.num_heads == self.num_kv_heads:
            return KVLayout.mha(self.num_layers, self.num_heads, self.head_dim, self.dtype)
        return KVLayout.gqa(
            self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """A seeded, randomly initialised Llama-style decoder (see the module docstring).

    Args:
        config: the sizes and dtype.
        seed: seed of the weight generator; same seed, same weights.
        device: torch device of the weights and activations.

    Two forwards:

    * `forward_dense` recomputes everything from the token ids, without any cache.
    * `forward_paged` writes the K/V of new tokens into a `BlockPool` and attends over the
      K/V gathered back from the pool's blocks.
    """

    def __init__(self, config: ModelConfig, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"config must be a ModelConfig, got {type(config).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.config = config
        self.seed = seed
        self.device = torch.device(device)
        c = config
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.02
            return w.to(device=self.device, dtype=c.dtype)

        def ones() -> torch.Tensor:
            return torch.ones(c.hidden_size, device=self.device, dtype=c.dtype)

        self.embed = normal(c.vocab_size, c.hidden_size)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            self.layers.append({
                "attn_norm": ones(),
                "wq": normal(c.num_heads * c.head_dim, c.hidden_size),
                "wk": normal(c.num_kv_heads * c.head_dim, c.hidden_size),
                "wv": normal(c.num_kv_heads * c.head_dim, c.hidden_size),
                "wo": normal(c.hidden_size, c.num_heads * c.head_dim),
                "mlp_norm": ones(),
                "w_gate": normal(c.intermediate_size, c.hidden_size),
                "w_up": normal(c.intermediate_size, c.hidden_size),
                "w_down": normal(c.hidden_size, c.intermediate_size),
            })
        self.final_norm = ones()
        self.lm_head = normal(c.vocab_size, c.hidden_size)
        self.inv_freq = 1.0 / (
            c.rope_theta
            ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device)
                / c.head_dim)
        )

    # ------------------------------------------------------------------ building blocks

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` by its absolute ``positions [T]`` (HF Llama)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()[:, None, :].to(x.dtype)
        sin = emb.sin()[:, None, :].to(x.dtype)
        return x * cos + _rotate_half(x) * sin

    def _qkv(self, layer: dict[str, torch.Tensor], x: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        h = self._rms_norm(x, layer["attn_norm"])
        t = x.shape[0]
        q = (h @ layer["wq"].T).view(t, c.num_heads, c.head_dim)
        k = (h @ layer["wk"].T).view(t, c.num_kv_heads, c.head_dim)
        v = (h @ layer["wv"].T).view(t, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                start: int) -> torch.Tensor:
        """Causal attention of ``q [n, Hq, D]`` (positions ``start..start+n-1``) over
        ``k, v [ctx, Hkv, D]`` (positions ``0..ctx-1``); returns ``[n, Hq * D]``."""
        n, ctx = q.shape[0], k.shape[0]
        g = self.config.group_size
        if g > 1:
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        q_pos = torch.arange(start, start + n, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, ctx], True = attend
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )  # [Hq, n, D]
        return out.transpose(0, 1).reshape(n, -1)

    def _mlp(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x, layer["mlp_norm"])
        return (F.silu(h @ layer["w_gate"].T) * (h @ layer["w_up"].T)) @ layer["w_down"].T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(x, self.final_norm) @ self.lm_head.T).float()

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
        lo, hi = int(token_ids.min()), int(token_ids.max())
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

    # ------------------------------------------------------------------ forwards

    @torch.no_grad()
    def forward_dense(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Full recompute without any cache: ``token_ids [T]`` -> float32 logits ``[T, vocab]``."""
        ids = self._check_tokens(token_ids)
        positions = torch.arange(ids.shape[0], device=self.device)
        x = self.embed[ids]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            x = x + self._attend(q, k, v, 0) @ layer["wo"].T
            x = x + self._mlp(layer, x)
        return self._logits(x)

    @torch.no_grad()
    def forward_paged(
        self,
        pool: BlockPool,
        seqs: Sequence[tuple[torch.Tensor, int, Sequence[int]]],
        *,
        return_all: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Run new tokens of several sequences, with K/V stored in and read from ``pool``.

        Each entry of ``seqs`` is ``(token_ids [n], start, block_table)``: the sequence's new
        tokens at positions ``start .. start+n-1``, and the pool blocks holding its context
        (``block_table[i]`` holds positions ``i*block_size .. (i+1)*block_size - 1``). Positions
        ``0 .. start-1`` must already be in the pool (a cached prefix or earlier steps). For
        every layer the new tokens' K/V are written to block ``pos // block_size``, slot
        ``pos % block_size``; then the new queries attend causally over K/V gathered from the
        blocks for positions ``0 .. start+n-1``. This covers prefill (``start = 0``), chunked
        prefill and prefill after a cached prefix (``start > 0, n > 1``) and decode (``n = 1``).

        Sequences are run one after the other (a plain loop, all layers per sequence); this is
        the correctness reference, batching them into one kernel call is a later optimisation.
        Writes go only to the slots of the new positions, so blocks before ``start //
        block_size`` are never modified; a caller that shares a partly filled block must
        copy it first (copy-on-write is the cache manager's business).

        Everything is validated before anything is written; invalid input raises `ConfigError`
        and leaves the pool unchanged.

        Returns:
            float32 logits of each sequence's last new token, ``[len(seqs), vocab]``; with
            ``return_all=True`` a list of ``[n_i, vocab]`` tensors, one per sequence.
        """
        self.check_pool(pool)
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence) or not seqs:
            raise ConfigError("seqs must be a non-empty list of (token_ids, start, block_table)")
        bs = pool.block_size
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
                if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < pool.num_blocks:
                    raise ConfigError(f"seqs[{i}] block id {b!r} is not in [0, "
                                      f"{pool.num_blocks})")
                if not pool.is_used(b):
                    raise ConfigError(f"seqs[{i}] block {b} is free (not allocated)")
            if len(set(table)) != len(table):
                raise ConfigError(f"seqs[{i}] block_table repeats a block: {table}")
            prepared.append((ids, start, table))

        outs = [self._run_paged(pool, ids, start, table) for ids, start, table in prepared]
        if return_all:
            return outs
        return torch.stack([o[-1] for o in outs])

    def _run_paged(self, pool: BlockPool, ids: torch.Tensor, start: int,
                   table: list[int]) -> torch.Tensor:
        c, bs = self.config, pool.block_size
        kv = pool.kv
        assert kv is not None  # checked by check_pool
        n = ids.shape[0]
        end = start + n
        positions = torch.arange(start, end, device=self.device)
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)
        # (block, first slot, offset in the new tokens, count) for each block the writes touch
        segments: list[tuple[int, int, int, int]] = []
        pos = start
        while pos < end:
            slot = pos % bs
            count = min(bs - slot, end - pos)
            segments.append((table[pos // bs], slot, pos - start, count))
            pos += count
        x = self.embed[ids]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            for block_id, slot, off, count in segments:
                pool.write(block_id, li, k[off:off + count], v[off:off + count], start=slot)
            k_ctx = kv[li, 0, blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:end]
            v_ctx = kv[li, 1, blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:end]
            x = x + self._attend(q, k_ctx, v_ctx, start) @ layer["wo"].T
            x = x + self._mlp(layer, x)
        return self._logits(x)
