"""The judge: a tiny Llama trained here, and token-eviction accuracy measured on it.

A token policy is only as good as the answers a model still gets right once most of its KV is
gone. `load_judge` loads the model `benchmarks/train_judge.py` trained on the synthetic tasks of
`kvevict.tokens.tasks` and shipped in ``kvevict/data/judge/`` (weights checked against the
SHA-256 in its ``MANIFEST.json``); `judge_answers` runs it under a token policy in transformers'
``generate()`` with a kvevict `PagedCache`, and `judge_accuracy` scores exact matches.

The protocol is context compression, as in kvpress's benchmarks: the context is prefilled and
compressed to the budget *before* the question is seen, then the question is fed and the answer
generated greedily, with the policy keeping the budget at every step. (Compressing after a
prefill that already holds the question would let the first answer token read the full cache.)
The budget is a fraction of the context's tokens (`budget_for`); `kv_bytes` counts what a
budget holds, so eviction and quantization compare on one axis.

transformers is imported only when a function needs it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvevict.errors import ConfigError
from kvevict.tokens import TokenPolicy, make_token_policy
from kvevict.tokens.tasks import TaskItem, batches

__all__ = ["JUDGE_DIR", "budget_for", "judge_accuracy", "judge_answers", "kv_bytes",
           "load_judge"]

#: Where the shipped judge lives (``config.json``, ``model.safetensors``, ``MANIFEST.json``).
JUDGE_DIR = Path(__file__).resolve().parent / "data" / "judge"


def load_judge(path: str | Path = JUDGE_DIR, *, verify: bool = True) -> Any:
    """The judge as a transformers ``LlamaForCausalLM`` in eval mode (float32, CPU).

    With ``verify`` the weights' SHA-256 must equal the manifest's; a mismatch raises
    `ConfigError` naming both digests (a corrupted or retrained file)."""
    from transformers import LlamaForCausalLM

    path = Path(path)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"no judge weights at {weights}; train them with "
                          "`python benchmarks/train_judge.py`")
    if verify:
        manifest = json.loads((path / "MANIFEST.json").read_text())
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        if digest != manifest["sha256"]:
            raise ConfigError(f"judge weights at {weights} have SHA-256 {digest}, but its "
                              f"manifest says {manifest['sha256']}")
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.eval()


def budget_for(fraction: float, context_tokens: int) -> int:
    """Tokens kept per sequence per layer at ``fraction`` of a ``context_tokens``-token cache
    (rounded, at least 1). ``fraction`` must be in (0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
            0.0 < fraction <= 1.0):
        raise ConfigError(f"retention fraction must be a number in (0, 1], got {fraction!r}")
    return max(1, round(fraction * context_tokens))


def kv_bytes(model: Any, tokens: int) -> int:
    """Bytes the K and V of ``tokens`` tokens take in every layer of ``model`` (its dtype)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim
    return tokens * per_token * model.dtype.itemsize


@torch.no_grad()
def judge_answers(model: Any, items: Sequence[TaskItem], policy: str | TokenPolicy | None,
                  *, fraction: float = 1.0, budget: int | None = None, batch: int = 16,
                  **params: Any) -> list[tuple[int, ...]]:
    """Each item's greedy answer (as many tokens as its expected answer) under ``policy``
    keeping ``budget`` tokens, by default ``budget_for(fraction, len(context))`` (policy None:
    the full cache, no policy).

    Items of one batch must share their context and answer lengths (the generated tasks do).
    ``params`` go to `make_token_policy`; a fresh policy is built per batch (a policy
    instance is used as given, so pass a name for batches)."""
    from kvevict.adapters.hf import PagedCache
    from kvevict.adapters.hf.routed import greedy_answers

    out: list[tuple[int, ...]] = []
    for chunk in batches(items, batch):
        ctx_len, ans_len = len(chunk[0].context), len(chunk[0].answer)
        if policy is None:
            cache = PagedCache(model)
        else:
            keep = budget_for(fraction, ctx_len) if budget is None else budget
            tp = (policy if isinstance(policy, TokenPolicy)
                  else make_token_policy(policy, keep, **params))
            cache = PagedCache(model, token_policy=tp)
        context = torch.tensor([it.context for it in chunk])
        prompt = torch.tensor([it.prompt for it in chunk])
        model(input_ids=context, cache=cache, use_cache=True)
        out += greedy_answers(model, prompt, cache, ans_len)
    return out


def judge_accuracy(model: Any, items: Sequence[TaskItem], policy: str | TokenPolicy | None,
                   *, fraction: float = 1.0, **params: Any) -> float:
    """Exact-match accuracy of `judge_answers` (every answer token right)."""
    answers = judge_answers(model, items, policy, fraction=fraction, **params)
    return sum(a == it.answer for a, it in zip(answers, items, strict=True)) / len(items)



@torch.no_grad()
def judge_traces(model: Any, items: Sequence[TaskItem], *, batch: int = 8,
                 context: int | None = None) -> list[dict[str, Any]]:
    """Full-cache generation traces of the judge: what the learned policies are trained on.

    Per batch of items (teacher-forced on prompt + answer): ``keys[l]`` / ``values[l]``, the
    stored K (after RoPE) and V of the context tokens ``[B, Hkv, C, D]`` in layer ``l``, and
    ``utility[l]`` ``[B, Hkv, C]``: the attention the question's and answer's queries (the ones
    a compressed cache serves) give each context token, averaged over those queries and over
    the query heads of each kv group. Needs eager attention (the judge loads with it).

    ``context`` is the number of context tokens (default: each item's `TaskItem.context`);
    `kvevict.tokens.tasks.packed_items` needs it, as its prompts hold several questions."""
    from transformers import DynamicCache

    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    traces = []
    for chunk in batches(items, batch):
        ctx = len(chunk[0].context) if context is None else context
        ids = torch.tensor([(*it.prompt, *it.answer[:-1]) for it in chunk])
        cache = DynamicCache(config=cfg)
        out = model(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
        keys, values, utility = [], [], []
        for layer, att in enumerate(out.attentions):
            b, h, t, _ = att.shape
            future = att[:, :, ctx:, :ctx].float().mean(dim=2)  # [B, H, C]
            utility.append(future.view(b, h // group, group, ctx).mean(dim=2))
            keys.append(cache.layers[layer].keys[:, :, :ctx].clone())
            values.append(cache.layers[layer].values[:, :, :ctx].clone())
        traces.append({"keys": keys, "values": values, "utility": utility,
                       "evidence": [it.evidence for it in chunk]})
    return traces


def gated_logits(model: Any, ids: torch.Tensor, gate: Any) -> torch.Tensor:
    """The judge's logits on ``ids`` with ``gate`` (e.g. `kvevict.tokens.lkv.GatedAttention`)
    as every layer's attention function: how LKV-T trains through the frozen judge. The
    judge's own eager attention is set back afterwards."""
    from kvevict.adapters.hf.routed import attention_function

    with attention_function(model, "kvevict_gated", gate):
        return model(input_ids=ids).logits
