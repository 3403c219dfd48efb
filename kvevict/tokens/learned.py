"""What the learned token policies share: a per-layer scorer of stored keys and values, and its
parameter file.

A `KVScorer` maps each stored token's key and value, per kv head, through a small two-layer
MLP (``[k_h ; v_h] -> hidden -> 1``, one MLP per layer, shared by that layer's heads) to a
score; `LearnedTokenPolicy` averages the heads' scores (or reduces them as the subclass says)
and keeps the top ``budget`` as every `TokenPolicy` does. No attention matrix is needed, so a
learned policy runs with FlashAttention-style kernels that never materialise it.

The parameters are saved with `save_scorer` as a safetensors file whose metadata records the
model shape they were trained for (layers, kv heads, key and value head dims) and the method;
`load_scorer` refuses a file for another shape, naming both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from torch import Tensor

from kvevict.errors import ConfigError
from kvevict.tokens.base import TokenPolicy, check_int, newest

__all__ = ["KVScorer", "LearnedTokenPolicy", "ScorerShape", "distill_scorer", "load_scorer",
           "save_scorer"]

#: Newest tokens a learned policy always keeps (the question and the answer being generated,
#: which the scorer never saw in training). Chosen among 4, 8, 16 and 32 on validation items of
#: the judge (seed 5, disjoint from the training items and from the evaluation seeds 0-2;
#: ``benchmarks/tokens_n_recent.py``).
N_RECENT = 8


@attrs.frozen
class ScorerShape:
    """The model shape a scorer was trained for."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def of(cls, model: Any) -> ScorerShape:
        """The shape of a transformers decoder config (``model.config``) or of a config."""
        cfg = getattr(model, "config", model)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head, head)


class KVScorer(torch.nn.Module):
    """Per layer (and per kv head when ``per_head``), an MLP from one head's ``[key ; value]``
    to a score.

    ``forward(layer, keys, values)`` takes ``[B, Hkv, T, D]`` / ``[B, Hkv, T, Dv]`` and returns
    the per-head scores ``[B, Hkv, T]`` (float32). Inputs are RMS-normalised per token and head
    first, so the scorer sees directions, not the norms RoPE and the layer scale set. The raw
    norms are appended as two more features (KeyNorm's signal stays available).
    """

    def __init__(self, shape: ScorerShape, hidden: int = 32, *, per_head: bool = False) -> None:
        super().__init__()
        self.shape = shape
        self.hidden = hidden
        self.per_head = per_head
        width = shape.key_dim + shape.value_dim + 2
        count = shape.layers * (shape.kv_heads if per_head else 1)
        self.mlps = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 1))
            for _ in range(count))

    def forward(self, layer: int, keys: Tensor, values: Tensor) -> Tensor:
        if not 0 <= layer < self.shape.layers:
            raise ConfigError(f"the scorer was trained for {self.shape.layers} layers; got "
                              f"layer {layer}")
        if keys.shape[1] != self.shape.kv_heads or keys.shape[-1] != self.shape.key_dim or (
                values.shape[-1] != self.shape.value_dim):
            raise ConfigError(f"the scorer was trained for {self.shape}; got keys of shape "
                              f"{list(keys.shape)} and values of shape {list(values.shape)}")
        k, v = keys.float(), values.float()
        kn, vn = k.pow(2).mean(dim=-1, keepdim=True), v.pow(2).mean(dim=-1, keepdim=True)
        x = torch.cat([k * torch.rsqrt(kn + 1e-6), v * torch.rsqrt(vn + 1e-6),
                       0.5 * torch.log(kn + 1e-6), 0.5 * torch.log(vn + 1e-6)], dim=-1)
        if not self.per_head:
            return self.mlps[layer](x).squeeze(-1)
        heads = self.shape.kv_heads
        return torch.stack([self.mlps[layer * heads + h](x[:, h]).squeeze(-1)
                            for h in range(heads)], dim=1)


def save_scorer(scorer: KVScorer, path: str | Path, *, method: str,
                extra: dict[str, Any] | None = None) -> None:
    """Write ``scorer`` to ``path`` (safetensors) with its shape, hidden width and method."""
    from safetensors.torch import save_file

    meta = {"shape": json.dumps(attrs.asdict(scorer.shape)), "hidden": str(scorer.hidden),
            "per_head": json.dumps(scorer.per_head), "method": method,
            "extra": json.dumps(extra or {})}
    save_file({k: v.contiguous() for k, v in scorer.state_dict().items()}, str(path),
              metadata=meta)


def load_scorer(path: str | Path, shape: ScorerShape, *, method: str) -> KVScorer:
    """The scorer saved at ``path``; `ConfigError` when it was trained for another model
    shape (both named) or by another method."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no scorer parameters at {path}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    try:
        saved = ScorerShape(**json.loads(meta["shape"]))
        hidden, saved_method = int(meta["hidden"]), meta["method"]
        per_head = bool(json.loads(meta["per_head"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a kvevict scorer file (metadata {meta})") from exc
    if saved_method != method:
        raise ConfigError(f"{path} holds {saved_method!r} parameters, not {method!r}")
    if saved != shape:
        raise ConfigError(f"{path} was trained for a model of shape {saved}, but this model "
                          f"has shape {shape}")
    scorer = KVScorer(saved, hidden, per_head=per_head)
    scorer.load_state_dict(tensors)
    return scorer.eval()


class LearnedTokenPolicy(TokenPolicy):
    """A token policy whose score is a learned `KVScorer` of keys and values.

    Subclasses set ``method`` (the scorer file's method tag) and may override `reduce_heads`.

    Args:
        budget: tokens kept per sequence per layer.
        scorer: a `KVScorer`, or the path of a file written by `save_scorer`.
        shape: the model shape (`ScorerShape.of(model)`), needed when ``scorer`` is a path.
        n_recent: the newest tokens always kept, ``0 <= n_recent <= budget`` (default
            `N_RECENT`).
    """

    method: ClassVar[str] = ""

    def __init__(self, budget: int, scorer: KVScorer | str | Path | None = None,
                 shape: ScorerShape | None = None, n_recent: int = N_RECENT) -> None:
        super().__init__(budget)
        self.n_recent = min(check_int("n_recent", n_recent, minimum=0), self.budget)
        if scorer is None:
            raise ConfigError(f"{type(self).__name__} needs scorer= (a KVScorer or the path of "
                              "its parameter file, e.g. kvevict.judge.JUDGE_DIR / "
                              f"'{self.method}.safetensors')")
        if not isinstance(scorer, KVScorer):
            if shape is None:
                raise ConfigError("shape= (ScorerShape.of(model)) is needed to load a scorer "
                                  "from a file")
            scorer = load_scorer(scorer, shape, method=self.method)
        self.scorer = scorer

    def reduce_heads(self, scores: Tensor) -> Tensor:
        """``[B, Hkv, T]`` per-head scores to ``[B, T]``: the mean."""
        return scores.mean(dim=1)

    @torch.no_grad()
    def score(self, layer_idx: int, keys: Tensor, values: Tensor, positions: Tensor,
              attention: Tensor | None = None, *, valid: Tensor | None = None) -> Tensor:
        self._check(layer_idx, keys, values, positions, valid, attention)
        scores = self.reduce_heads(self.scorer(layer_idx, keys, values))
        if self.n_recent:
            recent = newest(positions, self._all_valid(positions, valid), self.n_recent)
            scores = scores.masked_fill(recent, torch.inf)
        return self._mask(scores, valid)

    def _params(self) -> dict[str, Any]:
        return {"shape": self.scorer.shape, "n_recent": self.n_recent}


def distill_scorer(scorer: KVScorer, traces: Sequence[dict[str, Any]], *, epochs: int = 30,
                   lr: float = 3e-3, seed: int = 0,
                   log: Callable[[str], None] | None = None) -> KVScorer:
    """Fit ``scorer`` to the future attention of generation traces (in place; returned).

    Per trace (`kvevict.judge.judge_traces`) and layer, the listwise cross-entropy
    ``-sum_i p_i log softmax(s)_i`` between the context tokens' future attention ``p``
    (``utility``, normalised; averaged over the kv heads unless the scorer is per head) and the
    scorer's scores ``s`` (averaged over the heads likewise), with Adam and a cosine learning
    rate over ``epochs`` passes in a seeded order. A ranking by ``p`` is what a scorer of K/V
    should reproduce: on the judge, keeping the top 15% by it keeps the full cache's accuracy."""
    check_int("epochs", epochs, minimum=1)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(scorer.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * len(traces))
    scorer.train()
    for epoch in range(epochs):
        total = 0.0
        for i in torch.randperm(len(traces), generator=gen).tolist():
            trace = traces[i]
            loss = torch.zeros(())
            for layer in range(scorer.shape.layers):
                scores = scorer(layer, trace["keys"][layer], trace["values"][layer])
                target = trace["utility"][layer]
                if not scorer.per_head:
                    scores, target = scores.mean(dim=1), target.mean(dim=1)
                target = target / target.sum(dim=-1, keepdim=True).clamp_min(1e-12)
                loss = loss - (target * torch.log_softmax(scores, dim=-1)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            total += loss.item()
        if log is not None:
            log(f"distill epoch {epoch} loss {total / len(traces):.4f}")
    return scorer.eval()
