"""Peer cross-check: kvpress's SnapKV, StreamingLLM and KeyNorm presses against kvevict's policies.

kvpress (NVIDIA, the reference library for token eviction) caps transformers below 5.3, so it
runs in a side venv, never as a dependency of kvevict (``docs/tokens_kvpress.md`` has the venv
commands)::

    /work/venv-kvpress/bin/python benchmarks/kvpress_crosscheck.py

On the judge model (``kvevict/data/judge`` when its ``model.safetensors`` is there, else a
seeded random `LlamaForCausalLM` of ``train_judge.judge_config()``) and the prompts of
`kvevict.tokens.tasks.make_items`, every press runs through kvpress's own prefill hook at each
compression ratio. A wrapper around the press's ``score`` / ``compress`` records which token
positions it keeps per layer and kv head (checked against the keys kvpress actually keeps), and
runs kvevict's ``select`` on the very same keys and attention with the same budget (what
kvpress keeps). Two inputs per item:

- ``prompt``: the whole prompt (context and question) is prefilled and compressed;
- ``context``: kvpress's pipeline: the context is compressed, then the question is fed and
  the answer decoded greedily on the compressed cache.

Generated answers are compared in both modes, decoded greedily exactly as kvpress's pipeline
does (original positions passed explicitly). kvevict's selection is applied through the same
kvpress hook (a ``BasePress`` whose ``compress`` gathers kvevict's choice), so the answers differ
only by the kept sets: kvevict's own `PagedCache` needs transformers >= 5.3 and cannot run here.

The comparison functions (`kvpress_budget`, `exact_floor`, `jaccard`, `compare_layer`,
`per_head_select`, `difference_regions`, `equal_up_to_ties`, `swap_gap`, `head_agreement`,
`window_attention`, `summarize`) are pure and are tested without kvpress
(``tests/test_tokens_crosscheck.py``). Output:
``benchmarks/results/kvpress_crosscheck.json`` and Markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (ROOT, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from kvevict.tokens import TokenPolicy, make_token_policy  # noqa: E402
from kvevict.tokens.base import window_attention as base_window_attention  # noqa: E402
from kvevict.tokens.tasks import EOS, QUESTION_LENGTH, TASKS, make_items  # noqa: E402

OUT = HERE / "results" / "kvpress_crosscheck.json"
JUDGE = ROOT / "kvevict" / "data" / "judge"

#: The compression ratios of the brief (kvpress's ``compression_ratio``: the fraction pruned).
RATIOS: tuple[float, ...] = (0.5, 0.75, 0.85, 0.9)
#: kvpress's SnapKVPress defaults (kvpress 0.5.5 ``snapkv_press.py``) and StreamingLLMPress's.
KVPRESS_SNAPKV_WINDOW = 64
KVPRESS_SNAPKV_KERNEL = 5
KVPRESS_N_SINK = 4
#: kvevict's SnapKV default window (`kvevict.tokens.heuristics.SnapKV`).
KVEVICT_SNAPKV_WINDOW = 32
#: Queries of the prefill whose attention kvevict's SnapKV gets (the largest window compared).
ATTENTION_QUERIES = KVPRESS_SNAPKV_WINDOW
#: Tokens after the context in every task prompt (``QUERY`` and the queried token).
QUESTION_TOKENS = QUESTION_LENGTH


# -- pure comparison functions (tested without kvpress) ---------------------------------------


def kvpress_budget(length: int, ratio: float) -> int:
    """Tokens a kvpress ``ScorerPress`` keeps of ``length`` at ``compression_ratio=ratio``.

    kvpress 0.5.5 ``utils.compute_n_kept``: ``max(1, int(length * (1 - ratio)))`` for
    ``ratio < 1``: a floor, taken after a float multiplication, so ``1 - 0.9`` =
    0.09999999999999998 keeps 99 of 1000 tokens, not 100.
    """
    if ratio >= 1.0:
        return 0
    return max(1, int(length * (1 - ratio)))


def exact_floor(length: int, ratio: float) -> int:
    """``floor(length * (1 - ratio))`` in exact arithmetic, ``ratio`` read as the decimal it
    prints as (0.9 is 9/10): the budget a retention fraction means without float error."""
    return math.floor(length * (1 - Fraction(repr(ratio))))


def jaccard(a: Tensor | Sequence[int], b: Tensor | Sequence[int]) -> float:
    """``|a & b| / |a | b|`` of two sets of token positions (1.0 when both are empty)."""
    sa = set(a.tolist() if isinstance(a, Tensor) else a)
    sb = set(b.tolist() if isinstance(b, Tensor) else b)
    union = sa | sb
    return 1.0 if not union else len(sa & sb) / len(union)


def per_head_select(policy: TokenPolicy, layer_idx: int, keys: Tensor, values: Tensor,
                    positions: Tensor, valid: Tensor, attention: Tensor | None = None) -> Tensor:
    """kvevict's ``policy.select`` run on each kv head alone: long ``[B, Hkv, n]``.

    With one head the head average of a kvevict score is that head's score, so this is
    kvevict's scoring with kvpress's per-head layout (each kv head keeps its own tokens).
    """
    heads = keys.shape[1]
    kept = [policy.select(layer_idx, keys[:, h:h + 1], values[:, h:h + 1], positions, valid,
                          None if attention is None else attention[:, h:h + 1])
            for h in range(heads)]
    return torch.stack(kept, dim=1)


def compare_layer(reference: Tensor, candidate: Tensor) -> dict[str, Any]:
    """Compare one layer's kept sets, kv head by kv head.

    Args:
        reference: long ``[Hkv, n]``, the positions kvpress keeps in each kv head (any order).
        candidate: long ``[n]`` (a selection shared by all heads, kvevict's layout) or
            ``[Hkv, n]`` (one set per head).

    Returns:
        ``{"layer_exact": bool (every head's set equal), "head_exact": [bool per head],
        "jaccard": [float per head]}``.
    """
    if candidate.dim() == 1:
        candidate = candidate.unsqueeze(0).expand(reference.shape[0], -1)
    if candidate.shape[0] != reference.shape[0]:
        raise ValueError(f"candidate has {candidate.shape[0]} heads, expected "
                         f"{reference.shape[0]} like the reference (or a 1-D shared set)")
    exact = [set(r.tolist()) == set(c.tolist()) for r, c in zip(reference, candidate,
                                                                 strict=True)]
    jac = [jaccard(r, c) for r, c in zip(reference, candidate, strict=True)]
    return {"layer_exact": all(exact), "head_exact": exact, "jaccard": jac}


def difference_regions(reference: Tensor, candidate: Tensor, length: int, *, n_sink: int,
                       window: int) -> dict[str, dict[str, int]]:
    """Where two kept sets differ, summed over the heads of one layer.

    Each position kept by only one side is counted in the region it lies in: ``"sink"``
    (position ``< n_sink``), ``"window"`` (``>= length - window``) or ``"middle"``.

    Args:
        reference, candidate: as in `compare_layer`.
        length: the number of stored tokens.

    Returns:
        ``{"reference_only": {region: count}, "candidate_only": {region: count}}``.
    """
    if candidate.dim() == 1:
        candidate = candidate.unsqueeze(0).expand(reference.shape[0], -1)

    def region(p: int) -> str:
        if p < n_sink:
            return "sink"
        if p >= length - window:
            return "window"
        return "middle"

    out = {side: {"sink": 0, "middle": 0, "window": 0}
           for side in ("reference_only", "candidate_only")}
    for r, c in zip(reference, candidate, strict=True):
        sr, sc = set(r.tolist()), set(c.tolist())
        for p in sr - sc:
            out["reference_only"][region(p)] += 1
        for p in sc - sr:
            out["candidate_only"][region(p)] += 1
    return out


def equal_up_to_ties(reference: Tensor, candidate: Tensor, scores: Tensor) -> list[bool]:
    """Per head: whether two kept sets are equal once tokens of exactly equal score (in
    ``scores``, the reference's ``[Hkv, T]`` scores) may be exchanged, i.e. whether the
    positions only one side keeps have the same multiset of scores on both sides. True for
    equal sets. A difference that is only top-k tie-breaking gives True.
    """
    if candidate.dim() == 1:
        candidate = candidate.unsqueeze(0).expand(reference.shape[0], -1)
    out = []
    for r, c, s in zip(reference, candidate, scores, strict=True):
        sr, sc = set(r.tolist()), set(c.tolist())
        only_r = sorted(s[p].item() for p in sr - sc)
        only_c = sorted(s[p].item() for p in sc - sr)
        out.append(only_r == only_c)
    return out


def swap_gap(reference: Tensor, candidate: Tensor, scores: Tensor) -> float:
    """How far from a tie the exchanged tokens are: per head, the positions only one side
    keeps are sorted by their ``scores`` (the reference's ``[Hkv, T]``) and paired; the result
    is the largest ``|score difference|`` of a pair over the heads (0.0 for equal sets, and for
    sets equal up to exact ties). A tiny gap means a near-tie decided by float rounding."""
    if candidate.dim() == 1:
        candidate = candidate.unsqueeze(0).expand(reference.shape[0], -1)
    gap = 0.0
    for r, c, s in zip(reference, candidate, scores, strict=True):
        sr, sc = set(r.tolist()), set(c.tolist())
        only_r = sorted(s[p].item() for p in sr - sc)
        only_c = sorted(s[p].item() for p in sc - sr)
        gap = max([gap, *(abs(a - b) for a, b in zip(only_r, only_c, strict=True))])
    return gap


def head_agreement(kept: Tensor) -> float:
    """Mean Jaccard between the kept sets of every pair of kv heads of one layer (``[Hkv, n]``);
    1.0 for a single head. How far a per-head selection is from any shared one."""
    heads = kept.shape[0]
    pairs = [jaccard(kept[i], kept[j]) for i in range(heads) for j in range(i + 1, heads)]
    return 1.0 if not pairs else sum(pairs) / len(pairs)


def window_attention(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """Softmax attention of the last ``W`` queries over all ``T`` keys, as kvevict's adapter and
    engine feed their attention policies: `kvevict.tokens.base.window_attention` (torch only,
    so it imports beside transformers 5.2) with every slot valid. Shapes as there; float32
    ``[B, Hkv, W, T]``, causal, query heads averaged within each GQA group."""
    valid = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool, device=keys.device)
    return base_window_attention(queries, keys, valid, scaling)


def summarize(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate layer records into one row per ``(mode, method, ratio, variant)``.

    Each record holds ``mode``, ``method``, ``ratio``, ``variant``, ``budget`` and a
    `compare_layer` result (``layer_exact``, ``head_exact``, ``jaccard``). A row has
    ``layers`` (records), ``layer_exact`` (fraction of layers whose every head matched),
    ``head_exact`` (fraction of (layer, head) pairs that matched), ``jaccard`` (mean over
    (layer, head)), ``jaccard_min``, the budgets seen and ``layers_with_mismatch`` (the layer
    indices of the records that were not exact); rows keep the records' first-seen
    order. A record may also hold ``tied`` (`equal_up_to_ties`, one bool per head): then the
    row has ``head_exact_up_to_ties``, the fraction of (layer, head) pairs equal up to ties;
    and ``gap`` (`swap_gap`): then the row has ``max_swap_gap``, the largest over its records.
    """
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for rec in records:
        key = (rec["mode"], rec["method"], rec["ratio"], rec["variant"])
        groups.setdefault(key, []).append(rec)
    rows = []
    for (mode, method, ratio, variant), recs in groups.items():
        heads = [e for r in recs for e in r["head_exact"]]
        jac = [j for r in recs for j in r["jaccard"]]
        rows.append({
            "mode": mode, "method": method, "ratio": ratio, "variant": variant,
            "layers": len(recs),
            "layer_exact": sum(bool(r["layer_exact"]) for r in recs) / len(recs),
            "head_exact": sum(map(bool, heads)) / len(heads),
            "jaccard": sum(jac) / len(jac),
            "jaccard_min": min(jac),
            "budgets": sorted({int(r["budget"]) for r in recs}),
            "layers_with_mismatch": sorted({int(r["layer"]) for r in recs
                                            if not r["layer_exact"]}),
        })
        if all("tied" in r for r in recs):
            tied = [t for r in recs for t in r["tied"]]
            rows[-1]["head_exact_up_to_ties"] = sum(map(bool, tied)) / len(tied)
        if all("gap" in r for r in recs):
            rows[-1]["max_swap_gap"] = max(float(r["gap"]) for r in recs)
    return rows


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table of ``rows``: ``columns`` are ``(header, key, format spec)``."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key, "")
            cells.append(format(value, spec) if spec and value != "" else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the kvevict side ---------------------------------------------------------------------------


#: kvevict variants per method: ``(label, builder(budget) -> TokenPolicy, per_head)``. The first
#: is kvevict's defaults; the others change only what differs from kvpress.
VARIANTS: dict[str, list[tuple[str, Callable[[int], TokenPolicy], bool]]] = {
    "streamingllm": [
        ("kvevict n_sink=4 (default)",
         lambda n: make_token_policy("streamingllm", budget=n, n_sink=KVPRESS_N_SINK), False),
    ],
    "knorm": [
        ("kvevict shared (default)", lambda n: make_token_policy("knorm", budget=n), False),
        ("kvevict per head", lambda n: make_token_policy("knorm", budget=n), True),
    ],
    "snapkv": [
        ("kvevict w=32 shared (default)",
         lambda n: make_token_policy("snapkv", budget=n, window_size=KVEVICT_SNAPKV_WINDOW),
         False),
        ("kvevict w=64 shared",
         lambda n: make_token_policy("snapkv", budget=n, window_size=KVPRESS_SNAPKV_WINDOW,
                                     kernel_size=KVPRESS_SNAPKV_KERNEL), False),
        ("kvevict w=64 per head",
         lambda n: make_token_policy("snapkv", budget=n, window_size=KVPRESS_SNAPKV_WINDOW,
                                     kernel_size=KVPRESS_SNAPKV_KERNEL), True),
    ],
}


def kvevict_kept(method: str, variant: int, module: Any, hidden_states: Tensor, keys: Tensor,
                 values: Tensor, kwargs: Mapping[str, Any], budget: int) -> Tensor:
    """kvevict's kept positions for one layer of one prefill: long ``[Hkv, n]``, ascending per
    head (a shared selection repeated over the heads)."""
    _, policy_of, per_head = VARIANTS[method][variant]
    policy = policy_of(budget)
    batch, heads, length, _ = keys.shape
    positions = torch.arange(length).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool)
    attention = None
    if policy.needs_attention:
        queries = project_queries(module, hidden_states, kwargs["position_embeddings"],
                                  ATTENTION_QUERIES)
        attention = window_attention(queries, keys, module.scaling)
    if per_head:
        kept = per_head_select(policy, module.layer_idx, keys, values, positions, valid,
                               attention)
        return kept[0]
    kept = policy.select(module.layer_idx, keys, values, positions, valid, attention)
    return kept[0].unsqueeze(0).expand(heads, -1)


def project_queries(module: Any, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                    count: int) -> Tensor:
    """Post-RoPE queries ``[B, Hq, count, D]`` of the last ``count`` tokens, as a Llama attention
    module computes them (what ``kvevict.adapters.hf.model.project_queries`` does)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    h = hidden_states[:, -count:]
    q = module.q_proj(h).view(*h.shape[:-1], -1, module.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos[..., -count:, :], sin[..., -count:, :]
    return apply_rotary_pos_emb(q, q, cos, sin)[0]


# -- the kvpress side ---------------------------------------------------------------------------


def make_press(method: str, ratio: float) -> Any:
    from kvpress import KnormPress, SnapKVPress, StreamingLLMPress

    if method == "streamingllm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=KVPRESS_N_SINK)
    if method == "knorm":
        return KnormPress(compression_ratio=ratio)
    if method == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=KVPRESS_SNAPKV_WINDOW,
                           kernel_size=KVPRESS_SNAPKV_KERNEL)
    raise ValueError(f"unknown method {method!r}")


class Recorder:
    """Wraps a kvpress press: records, per layer, the positions it keeps in each kv head and
    kvevict's choices on the same keys / attention / budget.

    ``press.score`` is wrapped to keep the scores; after kvpress's own ``compress`` has run,
    the kept indices are ``scores.topk(n_kept)`` (kvpress's ``ScorerPress.compress``) and are
    checked against the keys kvpress returned (an exact tensor equality), so a recorded set is
    what kvpress really kept.
    """

    def __init__(self, method: str, press: Any) -> None:
        self.method = method
        self.press = press
        self.layers: dict[int, dict[str, Any]] = {}
        self.attention_diff = 0.0
        self._scores: Tensor | None = None
        original_score, original_compress = press.score, press.compress

        def score(module, hidden_states, keys, values, attentions, kwargs):
            self._scores = original_score(module, hidden_states, keys, values, attentions, kwargs)
            return self._scores

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            out_keys, out_values = original_compress(module, hidden_states, keys, values,
                                                     attentions, kwargs)
            self.record(module, hidden_states, keys, values, kwargs, out_keys)
            return out_keys, out_values

        press.score = score
        press.compress = compress

    def record(self, module: Any, hidden_states: Tensor, keys: Tensor, values: Tensor,
               kwargs: Mapping[str, Any], out_keys: Tensor) -> None:
        from kvpress.utils import compute_n_kept

        length = keys.shape[2]
        budget = compute_n_kept(length, self.press.compression_ratio)
        assert budget == kvpress_budget(length, self.press.compression_ratio)
        assert self._scores is not None
        idx = self._scores.topk(budget, dim=-1).indices  # [B, Hkv, n], as kvpress does
        gathered = keys.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1]))
        if not torch.equal(gathered, out_keys):
            raise AssertionError(f"layer {module.layer_idx}: the recorded indices do not "
                                 "reproduce the keys kvpress kept")
        kvpress_kept = idx[0].sort(dim=-1).values
        entry = {"length": length, "budget": budget, "kvpress": kvpress_kept, "kvevict": {},
                 "scores": self._scores[0].float()}
        for v in range(len(VARIANTS[self.method])):
            entry["kvevict"][v] = kvevict_kept(self.method, v, module, hidden_states, keys,
                                               values, kwargs, budget)
        if self.method == "snapkv":  # kvevict's attention vs the one kvpress computed itself
            w = KVPRESS_SNAPKV_WINDOW
            theirs = self.press.compute_window_attention(module, hidden_states, keys, w,
                                                         kwargs["position_embeddings"])
            groups = theirs.shape[1] // keys.shape[1]
            theirs = theirs.view(theirs.shape[0], keys.shape[1], groups, *theirs.shape[2:])
            queries = project_queries(module, hidden_states, kwargs["position_embeddings"], w)
            ours = window_attention(queries, keys, module.scaling)[..., :-w]
            diff = (theirs.float().mean(dim=2) - ours).abs().max().item()
            self.attention_diff = max(self.attention_diff, diff)
        self.layers[module.layer_idx] = entry


def gather_press(method: str, variant: int) -> Any:
    """A kvpress ``BasePress`` whose prefill compression keeps kvevict's choice (so kvevict's
    answers go through the same cache machinery as kvpress's)."""
    from kvpress.presses.base_press import BasePress
    from kvpress.utils import compute_n_kept

    press = BasePress()
    press.compression_ratio = 0.0

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        budget = compute_n_kept(keys.shape[2], press.compression_ratio)
        kept = kvevict_kept(method, variant, module, hidden_states, keys, values, kwargs, budget)
        idx = kept.unsqueeze(0).expand(keys.shape[0], -1, -1).unsqueeze(-1)
        return (keys.gather(2, idx.expand(-1, -1, -1, keys.shape[-1])).contiguous(),
                values.gather(2, idx.expand(-1, -1, -1, values.shape[-1])).contiguous())

    press.compress = compress
    return press


# -- the model and the runs ---------------------------------------------------------------------


def load_judge(folder: Path, seed: int) -> tuple[Any, str]:
    """The judge model: the weights in ``folder`` when present, else a seeded random model."""
    from train_judge import judge_config
    from transformers import LlamaForCausalLM

    weights = folder / "model.safetensors"
    if weights.exists():
        model = LlamaForCausalLM.from_pretrained(str(folder))
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        source = f"trained judge ({folder}, model.safetensors sha256 {digest[:16]}...)"
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(judge_config())
        source = f"random LlamaForCausalLM(judge_config()), torch.manual_seed({seed})"
    return model.eval(), source


@torch.no_grad()
def run_one(model: Any, press: Any, prompt: list[int], mode: str, steps: int) -> list[int]:
    """Prefill under ``press`` (None: full cache) and decode greedily, as kvpress's pipeline
    does: a fresh ``DynamicCache``, the compressed cache's tokens keep their original positions
    (passed as ``position_ids``), stop at ``EOS`` or after ``steps`` tokens.

    ``mode="context"``: the last `QUESTION_TOKENS` tokens (the question) are fed after the
    compression; ``"prompt"``: the whole prompt is prefilled and compressed.
    """
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    cut = len(prompt) - QUESTION_TOKENS if mode == "context" else len(prompt)
    context = torch.tensor([prompt[:cut]])
    with press(model) if press is not None else contextlib.nullcontext():
        out = model(input_ids=context, past_key_values=cache, logits_to_keep=1)
    position = cut
    if mode == "context":
        question = torch.tensor([prompt[cut:]])
        pos = torch.arange(position, position + question.shape[1]).unsqueeze(0)
        out = model(input_ids=question, past_key_values=cache, position_ids=pos,
                    logits_to_keep=1)
        position += question.shape[1]
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < steps and generated[-1] != EOS:
        pos = torch.tensor([[position]])
        out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache,
                    position_ids=pos)
        position += 1
        generated.append(int(out.logits[0, -1].argmax()))
    return generated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=4, help="items per task and seed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["prompt", "context"],
                    choices=["prompt", "context"])
    ap.add_argument("--judge", type=Path, default=JUDGE,
                    help="folder of the judge's weights (a seeded random model when it has no "
                         "model.safetensors)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    import kvpress
    import transformers

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, source = load_judge(args.judge, args.model_seed)
    for length in (1000, 1024, 1027, 1030, 4096):  # kvpress's rounding, once
        from kvpress.utils import compute_n_kept
        for ratio in RATIOS:
            assert compute_n_kept(length, ratio) == kvpress_budget(length, ratio)

    lengths = sorted({args.length, args.length + QUESTION_TOKENS, 1000})
    budgets = [{"length": n, "ratio": r, "kvpress": kvpress_budget(n, r),
                "exact_floor": exact_floor(n, r)} for n in lengths for r in RATIOS]
    records: list[dict[str, Any]] = []
    regions: dict[tuple, dict[str, dict[str, int]]] = {}
    head_agree: dict[tuple, list[float]] = {}
    answers: list[dict[str, Any]] = []
    attention_diff = 0.0
    items = [(seed, it) for seed in args.seeds for task in TASKS
             for it in make_items(task, args.items, length=args.length, seed=seed)]
    for mode in args.modes:
        for n, (seed, item) in enumerate(items):
            prompt, steps = list(item.prompt), len(item.answer)
            full = run_one(model, None, prompt, mode, steps)
            row = {"mode": mode, "task": item.task, "seed": seed, "item": n,
                   "answer": list(item.answer), "full": full, "runs": {}}
            for method in VARIANTS:
                for ratio in RATIOS:
                    press = make_press(method, ratio)
                    rec = Recorder(method, press)
                    got = run_one(model, press, prompt, mode, steps)
                    row["runs"][f"{method}@{ratio}/kvpress"] = got
                    attention_diff = max(attention_diff, rec.attention_diff)
                    for layer, entry in sorted(rec.layers.items()):
                        head_agree.setdefault((mode, method, ratio), []).append(
                            head_agreement(entry["kvpress"]))
                        for v, kept in entry["kvevict"].items():
                            label = VARIANTS[method][v][0]
                            cmp = compare_layer(entry["kvpress"], kept)
                            cmp["tied"] = equal_up_to_ties(entry["kvpress"], kept,
                                                           entry["scores"])
                            cmp["gap"] = swap_gap(entry["kvpress"], kept, entry["scores"])
                            records.append({"mode": mode, "method": method, "ratio": ratio,
                                            "variant": label, "budget": entry["budget"],
                                            "layer": layer, "task": item.task, **cmp})
                            reg = difference_regions(entry["kvpress"], kept, entry["length"],
                                                     n_sink=KVPRESS_N_SINK,
                                                     window=KVPRESS_SNAPKV_WINDOW)
                            acc = regions.setdefault((mode, method, ratio, label), {
                                s: {"sink": 0, "middle": 0, "window": 0} for s in reg})
                            for side, counts in reg.items():
                                for k, c in counts.items():
                                    acc[side][k] += c
                    for v, (label, _, _) in enumerate(VARIANTS[method]):
                        gp = gather_press(method, v)
                        gp.compression_ratio = ratio
                        row["runs"][f"{method}@{ratio}/{label}"] = run_one(model, gp, prompt,
                                                                           mode, steps)
            answers.append(row)
        print(f"mode {mode} done, {time.perf_counter() - start:.0f}s", file=sys.stderr,
              flush=True)

    rows = summarize(records)
    for row in rows:
        key = (row["mode"], row["method"], row["ratio"])
        agree = head_agree[key]
        row["kvpress_head_agreement"] = sum(agree) / len(agree)
        row["differences"] = regions[(*key, row["variant"])]
    gen_rows = generation_rows(answers)
    result = {
        "model": source, "torch": torch.__version__, "transformers": transformers.__version__,
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress"),
        "items": len(items), "seeds": args.seeds, "items_per_task_and_seed": args.items,
        "length": args.length, "ratios": list(RATIOS), "modes": args.modes,
        "max_attention_abs_diff": attention_diff,
        "seconds": round(time.perf_counter() - start, 1),
        "budgets": budgets, "selection": rows, "generation": gen_rows, "answers": answers,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    return 0


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def generation_rows(answers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per ``(mode, run)``: exact match with the task's answer, and agreement with kvpress's
    answer and with the full cache's (fractions of items)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for row in answers:
        full_key = (row["mode"], "full cache")
        f = out.setdefault(full_key, {"mode": row["mode"], "run": "full cache", "n": 0,
                                      "exact_match": 0, "same_as_kvpress": math.nan,
                                      "same_as_full": 0})
        f["n"] += 1
        f["exact_match"] += row["full"] == row["answer"]
        f["same_as_full"] += 1
        for run, got in row["runs"].items():
            press_key = run.split("/")[0] + "/kvpress"
            o = out.setdefault((row["mode"], run), {"mode": row["mode"], "run": run, "n": 0,
                                                    "exact_match": 0, "same_as_kvpress": 0,
                                                    "same_as_full": 0})
            o["n"] += 1
            o["exact_match"] += got == row["answer"]
            o["same_as_kvpress"] += got == row["runs"][press_key]
            o["same_as_full"] += got == row["full"]
    rows = []
    for o in out.values():
        n = o["n"]
        rows.append({**o, "exact_match": o["exact_match"] / n,
                     "same_as_full": o["same_as_full"] / n,
                     "same_as_kvpress": (o["same_as_kvpress"] / n
                                         if not (isinstance(o["same_as_kvpress"], float)
                                                 and math.isnan(o["same_as_kvpress"]))
                                         else math.nan)})
    return rows


def generation_pivot(gen_rows: Sequence[Mapping[str, Any]], mode: str) -> list[dict[str, Any]]:
    """One row per ``(method, ratio)`` of ``mode``: exact match of the full cache, of kvpress,
    of kvevict's defaults and of kvevict with kvpress's parameters and per-head layout (the
    last variant of `VARIANTS`), and how often each kvevict answer equals kvpress's."""
    by_run = {g["run"]: g for g in gen_rows if g["mode"] == mode}
    full = by_run["full cache"]["exact_match"]
    out = []
    for method, variants in VARIANTS.items():
        for ratio in RATIOS:
            head = f"{method}@{ratio}"
            if f"{head}/kvpress" not in by_run:
                continue
            default = by_run[f"{head}/{variants[0][0]}"]
            matched = by_run[f"{head}/{variants[-1][0]}"]
            out.append({"method": method, "ratio": ratio, "full": full,
                        "kvpress": by_run[f"{head}/kvpress"]["exact_match"],
                        "default": default["exact_match"],
                        "default_same": default["same_as_kvpress"],
                        "matched": matched["exact_match"],
                        "matched_same": matched["same_as_kvpress"],
                        "matched_label": variants[-1][0]})
    return out


def report(result: Mapping[str, Any]) -> str:
    """The Markdown report: the set comparison and the generation comparison per mode."""
    parts = [f"model: {result['model']}; {result['items']} items x {len(result['modes'])} modes;"
             f" torch {result['torch']}, transformers {result['transformers']}, kvpress "
             f"{result['kvpress']}; max |attention kvpress - kvevict| = "
             f"{result['max_attention_abs_diff']:.2e}; {result['seconds']} s"]
    sel_cols = [("method", "method", ""), ("ratio", "ratio", ""), ("budget", "budget", ""),
                ("kvevict variant", "variant", ""), ("layer exact", "layer_exact", ".3f"),
                ("head exact", "head_exact", ".3f"),
                ("head exact up to ties", "head_exact_up_to_ties", ".3f"),
                ("mean Jaccard", "jaccard", ".4f"),
                ("min Jaccard", "jaccard_min", ".3f"), ("layers differing", "where", ""),
                ("kvpress head-head J", "kvpress_head_agreement", ".3f"),
                ("max swap gap", "max_swap_gap", ".1e"),
                ("kvpress-only sink/mid/win", "kp_only", ""),
                ("kvevict-only sink/mid/win", "kv_only", "")]
    gen_cols = [("run", "run", ""), ("items", "n", ""), ("exact match", "exact_match", ".3f"),
                ("same as kvpress", "same_as_kvpress", ".3f"),
                ("same as full cache", "same_as_full", ".3f")]
    parts.append("\n### kvpress budgets (`int(T * (1 - ratio))`) vs exact floor\n\n" + markdown(
        result["budgets"], [("T", "length", ""), ("ratio", "ratio", ""),
                            ("kvpress keeps", "kvpress", ""), ("exact floor", "exact_floor", "")]))
    pivot_cols = [("method", "method", ""), ("ratio", "ratio", ""), ("full cache", "full", ".3f"),
                  ("kvpress", "kvpress", ".3f"), ("kvevict default", "default", ".3f"),
                  ("default's answer = kvpress's", "default_same", ".3f"),
                  ("kvevict as kvpress", "matched", ".3f"),
                  ("its answer = kvpress's", "matched_same", ".3f"),
                  ("kvevict as kvpress is", "matched_label", "")]
    for mode in result["modes"]:
        rows = []
        for r in result["selection"]:
            if r["mode"] != mode:
                continue
            d = r["differences"]
            kp, kv = d["reference_only"], d["candidate_only"]
            rows.append({**r, "budget": "/".join(map(str, r["budgets"])),
                         "where": ",".join(map(str, r["layers_with_mismatch"])) or "-",
                         "kp_only": f"{kp['sink']}/{kp['middle']}/{kp['window']}",
                         "kv_only": f"{kv['sink']}/{kv['middle']}/{kv['window']}"})
        parts.append(f"\n### Kept sets, mode `{mode}`\n\n" + markdown(rows, sel_cols))
        gens = [g for g in result["generation"] if g["mode"] == mode]
        parts.append(f"\n### Generated answers, mode `{mode}`\n\n" + markdown(gens, gen_cols))
        parts.append(f"\n### Exact match, mode `{mode}`\n\n" + markdown(
            generation_pivot(result["generation"], mode), pivot_cols))
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
