"""The comparison logic of ``benchmarks/kvpress_crosscheck.py``, tested without kvpress.

The script itself runs in a side venv with kvpress (``docs/tokens_kvpress.md``); its pure
functions are checked here on hand-built tensors with exact values, and kvpress's three scoring
rules (kvpress 0.5.5 ``streaming_llm_press.py``, ``knorm_press.py``, ``snapkv_press.py``,
``scorer_press.py``) are restated in a few lines so that "kvevict run per head equals kvpress"
is checked in CI too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from bench_scripts import load_benchmark

from kvevict.tokens import make_token_policy


@pytest.fixture(scope="module")
def cc():
    return load_benchmark("kvpress_crosscheck")


def _all(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(length)[None], torch.ones(1, length, dtype=torch.bool)


# -- budgets -----------------------------------------------------------------------------------


def test_kvpress_budget_floors_after_a_float_multiplication(cc):
    assert [cc.kvpress_budget(1027, r) for r in cc.RATIOS] == [513, 256, 154, 102]
    assert [cc.kvpress_budget(1024, r) for r in cc.RATIOS] == [512, 256, 153, 102]
    # 1 - 0.9 = 0.09999999999999998: kvpress keeps 99 of 1000, the exact floor is 100
    assert cc.kvpress_budget(1000, 0.9) == 99
    assert cc.exact_floor(1000, 0.9) == 100
    assert cc.kvpress_budget(1000, 0.5) == cc.exact_floor(1000, 0.5) == 500
    assert cc.kvpress_budget(3, 0.9) == 1  # clamped to one token
    assert cc.kvpress_budget(10, 1.0) == 0


# -- set comparisons ---------------------------------------------------------------------------


def test_jaccard_exact_values(cc):
    assert cc.jaccard([1, 2, 3], [2, 3, 4]) == 0.5
    assert cc.jaccard(torch.tensor([5, 1]), torch.tensor([1, 5])) == 1.0
    assert cc.jaccard([], []) == 1.0
    assert cc.jaccard([0], [1]) == 0.0


def test_compare_layer_shared_and_per_head(cc):
    reference = torch.tensor([[0, 1, 2], [0, 3, 4]])
    shared = cc.compare_layer(reference, torch.tensor([2, 1, 0]))
    assert shared == {"layer_exact": False, "head_exact": [True, False], "jaccard": [1.0, 0.2]}
    per_head = cc.compare_layer(reference, torch.tensor([[2, 0, 1], [4, 3, 0]]))
    assert per_head == {"layer_exact": True, "head_exact": [True, True],
                        "jaccard": [1.0, 1.0]}
    with pytest.raises(ValueError, match="candidate has 3 heads, expected 2"):
        cc.compare_layer(reference, torch.zeros(3, 3, dtype=torch.long))


def test_difference_regions_counts_each_side(cc):
    got = cc.difference_regions(torch.tensor([[0, 5, 9], [0, 1, 9]]),
                                torch.tensor([0, 4, 8]), 10, n_sink=1, window=2)
    # head 0: kvpress-only {5 middle, 9 window}, kvevict-only {4 middle, 8 window};
    # head 1: kvpress-only {1 middle, 9 window}, kvevict-only {4 middle, 8 window}
    assert got == {"reference_only": {"sink": 0, "middle": 2, "window": 2},
                   "candidate_only": {"sink": 0, "middle": 2, "window": 2}}
    sinks = cc.difference_regions(torch.tensor([[0, 1]]), torch.tensor([1, 2]), 10,
                                  n_sink=1, window=2)
    assert sinks == {"reference_only": {"sink": 1, "middle": 0, "window": 0},
                     "candidate_only": {"sink": 0, "middle": 1, "window": 0}}


def test_equal_up_to_ties(cc):
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.9], [0.1, 0.5, 0.5, 0.9]])
    reference = torch.tensor([[1, 3], [1, 3]])
    # head 0 swaps two tokens of score 0.5 (a tie); head 1 swaps 0.5 for 0.1 (not a tie)
    assert cc.equal_up_to_ties(reference, torch.tensor([[2, 3], [0, 3]]), scores) == [True,
                                                                                     False]
    assert cc.equal_up_to_ties(reference, torch.tensor([3, 1]), scores) == [True, True]


def test_swap_gap(cc):
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.9], [0.1, 0.5, 0.25, 0.9]])
    reference = torch.tensor([[1, 3], [1, 3]])
    assert cc.swap_gap(reference, reference, scores) == 0.0
    assert cc.swap_gap(reference, torch.tensor([[2, 3], [2, 3]]), scores) == 0.25
    assert cc.swap_gap(reference, torch.tensor([0, 3]), scores) == pytest.approx(0.4)


def test_head_agreement(cc):
    assert cc.head_agreement(torch.tensor([[0, 1], [1, 2], [0, 1]])) == pytest.approx(5 / 9)
    assert cc.head_agreement(torch.tensor([[0, 1]])) == 1.0


def test_summarize_exact_fractions(cc):
    base = {"mode": "prompt", "method": "knorm", "ratio": 0.5, "variant": "v", "budget": 2,
            "layer": 0}
    records = [
        {**base, "layer": 3, "layer_exact": True, "head_exact": [True, True], "jaccard": [1.0, 1.0],
         "tied": [True, True], "gap": 0.0},
        {**base, "layer_exact": False, "head_exact": [True, False], "jaccard": [1.0, 0.5],
         "tied": [True, True], "gap": 0.25},
        {**base, "variant": "w", "layer_exact": False, "head_exact": [False, False],
         "jaccard": [0.0, 0.5]},
    ]
    rows = cc.summarize(records)
    assert [r["variant"] for r in rows] == ["v", "w"]
    assert rows[0]["layers"] == 2 and rows[0]["layer_exact"] == 0.5
    assert rows[0]["head_exact"] == 0.75 and rows[0]["jaccard"] == 0.875
    assert rows[0]["jaccard_min"] == 0.5 and rows[0]["budgets"] == [2]
    assert rows[0]["layers_with_mismatch"] == [0]
    assert rows[0]["head_exact_up_to_ties"] == 1.0 and rows[0]["max_swap_gap"] == 0.25
    assert rows[1]["head_exact"] == 0.0 and "head_exact_up_to_ties" not in rows[1]
    assert "max_swap_gap" not in rows[1]


# -- per head vs shared, against kvpress's scoring rules restated ------------------------------


def test_knorm_per_head_vs_shared_on_hand_built_keys(cc):
    # one-dimensional keys: the norm is |k|. Head 0 norms [3, 1, 2, 4], head 1 [1, 4, 3, 2].
    keys = torch.tensor([[[[3.0], [1.0], [2.0], [4.0]], [[1.0], [-4.0], [3.0], [2.0]]]])
    positions, valid = _all(4)
    policy = make_token_policy("knorm", budget=2)
    per_head = cc.per_head_select(policy, 0, keys, keys, positions, valid)
    assert per_head.tolist() == [[[1, 2], [0, 3]]]
    # kvpress KnormPress: each head keeps its own top-2 of -||k||
    kvpress = (-keys.norm(dim=-1)).topk(2, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(per_head, kvpress)
    # kvevict's shared selection: mean norms [2, 2.5, 2.5, 3]; slots 1 and 2 tie at 2.5 and
    # the more recent one (2) is kept
    shared = policy.select(0, keys, keys, positions, valid)
    assert shared.tolist() == [[0, 2]]
    assert cc.compare_layer(kvpress[0], shared[0]) == {
        "layer_exact": False, "head_exact": [False, False], "jaccard": [1 / 3, 1 / 3]}


def test_streamingllm_matches_kvpress_rule(cc):
    length, ratio = 10, 0.5
    budget = cc.kvpress_budget(length, ratio)
    # kvpress StreamingLLMPress: ones, zeros on [n_sink, n_sink + n_pruned), top-k
    scores = torch.ones(length)
    n_pruned = length - int(length * (1 - ratio))
    scores[4:4 + n_pruned] = 0
    kvpress = sorted(scores.topk(budget).indices.tolist())
    keys = torch.randn(1, 2, length, 4)
    positions, valid = _all(length)
    kept = make_token_policy("streamingllm", budget=budget, n_sink=4).select(
        0, keys, keys, positions, valid)
    assert kvpress == [0, 1, 2, 3, 9] == kept[0].tolist()


def _kvpress_snapkv_scores(attention: torch.Tensor, window: int, kernel: int) -> torch.Tensor:
    """kvpress 0.5.5 SnapKVPress.score for ``attention [B, Hkv, W, T]`` (one query head per kv
    head): mean over the window queries of the non-window columns, average pooling, the
    window padded with the maximum + 1."""
    scores = attention[..., -window:, :-window].mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


def test_snapkv_per_head_with_kvpress_parameters_equals_kvpress(cc):
    torch.manual_seed(0)
    length, window, heads = 200, 16, 2
    logits = torch.randn(1, heads, window, length) * 3
    causal = torch.arange(length)[None] <= (length - window + torch.arange(window))[:, None]
    attention = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    keys = torch.randn(1, heads, length, 4)
    positions, valid = _all(length)
    budget = cc.kvpress_budget(length, 0.75)
    kvpress = _kvpress_snapkv_scores(attention, window, 5).topk(budget, dim=-1).indices
    kvpress = kvpress.sort(dim=-1).values[0]
    same = make_token_policy("snapkv", budget=budget, window_size=window, kernel_size=5)
    per_head = cc.per_head_select(same, 0, keys, keys, positions, valid, attention)[0]
    assert torch.equal(per_head, kvpress)
    # kvevict's default window (half of it here) keeps only the last 8 positions for sure
    half = make_token_policy("snapkv", budget=budget, window_size=window // 2)
    kept = cc.per_head_select(half, 0, keys, keys, positions, valid, attention)[0]
    regions = cc.difference_regions(kvpress, kept, length, n_sink=0, window=window)
    assert regions["candidate_only"]["window"] == 0
    assert regions["reference_only"]["window"] > 0  # kvpress keeps all 16 window tokens
    assert not cc.compare_layer(kvpress, kept)["layer_exact"]


def test_window_attention_is_the_one_the_adapter_and_engine_use(cc):
    pytest.importorskip("transformers")
    from kvevict.tokens.base import window_attention

    torch.manual_seed(1)
    queries = torch.randn(2, 4, 5, 8)  # 4 query heads, 2 kv heads
    keys = torch.randn(2, 2, 12, 8)
    ours = cc.window_attention(queries, keys, 8 ** -0.5)
    theirs = window_attention(queries, keys, torch.ones(2, 12, dtype=torch.bool), 8 ** -0.5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # a hand-built case: one query over two zero keys, then a second that also sees slot 2
    flat = cc.window_attention(torch.ones(1, 1, 2, 1), torch.zeros(1, 1, 3, 1), 1.0)
    torch.testing.assert_close(flat, torch.tensor([[[[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]]]))


def test_generation_rows_and_pivot(cc):
    default, matched = cc.VARIANTS["knorm"][0][0], cc.VARIANTS["knorm"][-1][0]
    answers = [
        {"mode": "context", "answer": [300, 2], "full": [300, 2],
         "runs": {"knorm@0.5/kvpress": [300, 2], f"knorm@0.5/{default}": [301, 2],
                  f"knorm@0.5/{matched}": [300, 2]}},
        {"mode": "context", "answer": [310, 2], "full": [311, 2],
         "runs": {"knorm@0.5/kvpress": [312, 2], f"knorm@0.5/{default}": [312, 2],
                  f"knorm@0.5/{matched}": [312, 2]}},
    ]
    rows = {r["run"]: r for r in cc.generation_rows(answers)}
    assert rows["full cache"]["exact_match"] == 0.5 and rows["full cache"]["n"] == 2
    assert rows["knorm@0.5/kvpress"]["same_as_full"] == 0.5
    assert rows[f"knorm@0.5/{default}"]["same_as_kvpress"] == 0.5
    assert rows[f"knorm@0.5/{default}"]["exact_match"] == 0.0
    pivot = cc.generation_pivot(list(rows.values()), "context")
    assert pivot == [{"method": "knorm", "ratio": 0.5, "full": 0.5, "kvpress": 0.5,
                      "default": 0.0, "default_same": 0.5, "matched": 0.5,
                      "matched_same": 1.0, "matched_label": matched}]


def test_the_named_defaults_are_kvevicts(cc):
    import inspect

    from kvevict.tokens import SnapKV, StreamingLLM

    assert inspect.signature(SnapKV).parameters["window_size"].default == \
        cc.KVEVICT_SNAPKV_WINDOW == 32
    assert inspect.signature(SnapKV).parameters["kernel_size"].default == \
        cc.KVPRESS_SNAPKV_KERNEL == 5
    assert inspect.signature(StreamingLLM).parameters["n_sink"].default == cc.KVPRESS_N_SINK == 4
    assert [label for label, _, _ in cc.VARIANTS["snapkv"]] == [
        "kvevict w=32 shared (default)", "kvevict w=64 shared", "kvevict w=64 per head"]
