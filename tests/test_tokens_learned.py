"""The judge's tasks, TOVA, the learned scorers (LKV-T, KVP) and their parameter files."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kvevict.errors import ConfigError
from kvevict.judge import budget_for
from kvevict.tokens import KVScorer, ScorerShape, make_token_policy
from kvevict.tokens.kvp import _plackett_luce_logp, ranking_reward
from kvevict.tokens.learned import load_scorer, save_scorer
from kvevict.tokens.lkv import GatedAttention
from kvevict.tokens.tasks import (
    EOS,
    QUERY,
    TASKS,
    make_items,
    training_batch,
)

SHAPE = ScorerShape(layers=2, kv_heads=2, key_dim=4, value_dim=4)


# -- tasks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_items_are_reproducible_and_hold_their_evidence(task):
    a = make_items(task, 3, length=256, seed=5)
    assert a == make_items(task, 3, length=256, seed=5)
    assert a != make_items(task, 3, length=256, seed=6)
    for it in a:
        assert len(it.context) == 256 and it.question[0] == QUERY and len(it.question) == 2
        assert it.prompt == it.context + it.question and it.answer[-1] == EOS
        held = [it.prompt[p] for p in it.evidence]
        if task == "recall":  # the pair "key value": the queried key, then the answer
            assert held == [it.question[1], it.answer[0]]
        elif task == "needle":  # NEEDLE, the three values
            assert held == [it.question[1], *it.answer[:3]]
        else:  # three assignments VAR src dst from the queried value along the chain
            chain = [it.question[1], *it.answer[:3]]
            assert held == [t for i in range(3) for t in (16, chain[i], chain[i + 1])]


def test_training_batch_targets_are_the_answers():
    ids, targets = training_batch(["recall", "needle"], 200, np.random.default_rng(0),
                                  queries=2)
    for row in range(2):
        marked = np.nonzero(targets[row] != -100)[0]
        assert (targets[row, marked] == ids[row, marked + 1]).all()
        queried = np.nonzero(ids[row] == QUERY)[0] + 1
        assert set(queried) <= set(marked)  # the answer's first token follows the queried one
    # two recall questions of 2 answer tokens; the needle task has one question of 4
    assert (targets[0] != -100).sum() == 2 * 2 and (targets[1] != -100).sum() == 4


def test_packed_items_ask_every_question_of_a_context_after_it():
    from kvevict.tokens.tasks import QUERY, packed_items

    for task, questions, answer_len in (("recall", 24, 2), ("needle", 1, 4), ("vartrack", 3, 4)):
        items = packed_items(task, 2, length=300, seed=4)
        assert len(items) == 2 and items[0].prompt[:300] != items[1].prompt[:300]
        for it in items:
            tail = it.prompt[300:]
            assert len(tail) == questions * (2 + answer_len) - answer_len
            asked = [tail[i + 1] for i in range(0, len(tail), 2 + answer_len)]
            assert tail[::2 + answer_len] == (QUERY,) * questions
            assert len(set(asked)) == questions  # each question once
            context = it.prompt[:300]
            assert all(q in context for q in asked)
            if task == "recall":  # each answer is the value after its key in the context
                answers = [*(tail[i + 2] for i in range(0, len(tail) - 2, 4)), it.answer[0]]
                assert answers == [context[context.index(q) + 1] for q in asked]
            assert all(context[p] < 416 for p in it.evidence)  # records, never filler
            assert len(it.evidence) == {"recall": 48, "needle": 52, "vartrack": 27}[task]
    assert packed_items("recall", 1, length=300, seed=4) == packed_items(
        "recall", 1, length=300, seed=4)[:1]
    with pytest.raises(ConfigError, match="unknown task"):
        packed_items("nope", 1)


def test_distilling_a_scorer_learns_the_ranking_of_the_future_attention():
    """Synthetic traces: the future attention goes to the tokens whose value points along one
    direction. Before distillation the scorer's top 4 miss them; after, they are its top 4
    in every layer and row, on traces it was not fitted on."""
    from kvevict.tokens.learned import distill_scorer

    gen = torch.Generator().manual_seed(0)

    def trace():
        keys, values = torch.randn(4, 2, 16, 4, generator=gen), torch.randn(4, 2, 16, 4,
                                                                             generator=gen)
        hot = torch.rand(4, 16, generator=gen).argsort(-1)[:, :4]  # 4 tokens per row
        mark = torch.zeros(4, 16, dtype=torch.bool).scatter_(1, hot, True)
        values[..., 0] += 4.0 * mark[:, None]
        utility = torch.where(mark[:, None], 1.0, 0.01).expand(4, 2, 16).clone()
        return {"keys": [keys] * 2, "values": [values] * 2, "utility": [utility] * 2,
                "mark": mark}

    train, held_out = [trace() for _ in range(24)], [trace() for _ in range(4)]
    torch.manual_seed(0)
    scorer = KVScorer(SHAPE, hidden=16)

    def hits():
        with torch.no_grad():
            return [bool(t["mark"].gather(1, scorer(layer, t["keys"][layer], t["values"][layer])
                                          .mean(1).topk(4).indices).all())
                    for t in held_out for layer in range(2)]

    assert not all(hits())
    assert distill_scorer(scorer, train, epochs=40, lr=1e-2) is scorer
    assert all(hits()) and not scorer.training


def test_the_curriculum_scale_shrinks_the_records_and_their_minimum_length():
    from kvevict.tokens.tasks import min_length

    ids, targets = training_batch(["recall", "needle", "vartrack"], 40,
                                  np.random.default_rng(1), queries=16, scale=2 / 12)
    # 4 recall pairs (4 questions of 2 answer tokens), 2 needle distractors (1 question of 4),
    # 1 chain (1 question of 3 variables and EOS)
    assert [(targets[r] != -100).sum() for r in range(3)] == [8, 4, 4]
    needle = ids[1, :40].tolist()
    assert sum(needle.count(m) for m in range(8, 16)) == 3  # NEEDLE and 2 distractor marks
    assert [min_length(t, 2 / 12) for t in ("recall", "needle", "vartrack")] == [10, 14, 11]
    assert [min_length(t) for t in ("recall", "needle", "vartrack")] == [50, 54, 29]
    with pytest.raises(ConfigError, match=r"scale must be in \(0, 1\]"):
        training_batch(["recall"], 64, np.random.default_rng(0), scale=0.0)


def test_bad_task_arguments():
    with pytest.raises(ConfigError, match="unknown task 'qa'"):
        make_items("qa", 2)
    with pytest.raises(ConfigError, match="count must be an int >= 1"):
        make_items("recall", 0)
    with pytest.raises(ConfigError, match="too short"):
        make_items("recall", 1, length=40)  # 24 pairs need 48 tokens


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan"), True, "0.5"])
def test_a_retention_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ConfigError, match=r"retention fraction must be a number in \(0, 1\]"):
        budget_for(fraction, 1000)


def test_budget_for_rounds_and_keeps_one():
    assert budget_for(0.15, 1024) == 154 and budget_for(1.0, 1024) == 1024
    assert budget_for(1e-6, 1024) == 1
    with pytest.raises(ConfigError, match="budget must be >= 1"):
        make_token_policy("tova", budget=0)


# -- TOVA ------------------------------------------------------------------------------------


def test_tova_keeps_what_the_last_query_attends_to():
    keys = torch.zeros(1, 2, 5, 4)
    positions = torch.arange(5).unsqueeze(0)
    valid = torch.ones(1, 5, dtype=torch.bool)
    att = torch.zeros(1, 2, 2, 5)
    att[0, 0, -1] = torch.tensor([0.1, 0.5, 0.0, 0.3, 0.1])
    att[0, 1, -1] = torch.tensor([0.3, 0.1, 0.2, 0.3, 0.1])
    att[0, :, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])  # an earlier query: ignored
    tova = make_token_policy("tova", budget=2)
    # head means: .2 .3 .1 .3 .1 -> top two .3 (slots 1 and 3)
    assert tova.select(0, keys, keys, positions, valid, att).tolist() == [[1, 3]]
    with pytest.raises(ConfigError, match="needs attention"):
        tova.select(0, keys, keys, positions, valid)


# -- scorers and their files ------------------------------------------------------------------


@pytest.mark.parametrize("per_head", [False, True])
def test_a_saved_scorer_loads_with_the_same_scores(tmp_path, per_head):
    torch.manual_seed(0)
    scorer = KVScorer(SHAPE, hidden=8, per_head=per_head)
    keys, values = torch.randn(3, 2, 7, 4), torch.randn(3, 2, 7, 4)
    method = "kvp" if per_head else "lkv_t"
    save_scorer(scorer, tmp_path / "s.safetensors", method=method)
    again = load_scorer(tmp_path / "s.safetensors", SHAPE, method=method)
    assert again.per_head == per_head
    assert torch.equal(scorer(1, keys, values), again(1, keys, values))
    policy = make_token_policy(method, budget=3, scorer=tmp_path / "s.safetensors",
                               shape=SHAPE, n_recent=0)
    positions = torch.arange(7).expand(3, 7)
    kept = policy.select(0, keys, values, positions, torch.ones(3, 7, dtype=torch.bool))
    per = scorer(0, keys, values).detach()
    reduced = per.mean(1) if not per_head else torch.log_softmax(per, -1).sum(1)
    assert kept.tolist() == reduced.topk(3, dim=1).indices.sort(dim=1).values.tolist()
    # with n_recent=1 the newest token (slot 6) is kept whatever its score, plus the top two
    # of the others
    recent = make_token_policy(method, budget=3, scorer=again, n_recent=1)
    kept = recent.select(0, keys, values, positions, torch.ones(3, 7, dtype=torch.bool))
    top = reduced[:, :6].topk(2, dim=1).indices
    assert kept.tolist() == [sorted([*row, 6]) for row in top.tolist()]


def test_the_learned_policies_keep_the_newest_tokens_by_default():
    """The question and the answer come after the context the scorer was trained on: the
    newest N_RECENT tokens are kept even when the scorer ranks them last."""
    from kvevict.tokens.learned import N_RECENT

    scorer = KVScorer(SHAPE, hidden=8)
    keys = torch.randn(1, 2, 20, 4)
    policy = make_token_policy("lkv_t", budget=12, scorer=scorer)
    assert policy.n_recent == N_RECENT == 8
    kept = policy.select(0, keys, keys, torch.arange(20)[None], torch.ones(1, 20, dtype=torch.bool))
    assert set(range(12, 20)) <= set(kept[0].tolist())
    with pytest.raises(ConfigError, match="n_recent must be >= 0"):
        make_token_policy("lkv_t", budget=12, scorer=scorer, n_recent=-1)
    assert make_token_policy("lkv_t", budget=4, scorer=scorer).n_recent == 4  # at most budget


def test_a_scorer_file_for_another_shape_or_method_is_refused(tmp_path):
    save_scorer(KVScorer(SHAPE, hidden=8), tmp_path / "s.safetensors", method="lkv_t")
    other = ScorerShape(layers=4, kv_heads=2, key_dim=32, value_dim=32)
    with pytest.raises(ConfigError) as err:
        load_scorer(tmp_path / "s.safetensors", other, method="lkv_t")
    assert "layers=2, kv_heads=2, key_dim=4" in str(err.value)
    assert "layers=4, kv_heads=2, key_dim=32" in str(err.value)
    with pytest.raises(ConfigError, match="holds 'lkv_t' parameters, not 'kvp'"):
        load_scorer(tmp_path / "s.safetensors", SHAPE, method="kvp")
    with pytest.raises(ConfigError, match="needs scorer="):
        make_token_policy("lkv_t", budget=4)
    with pytest.raises(ConfigError, match="trained for"):
        KVScorer(SHAPE)(0, torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4))


# -- KVP's reward and ranking distribution ----------------------------------------------------


def test_ranking_reward_averages_the_kept_utility_over_budgets():
    utility = torch.tensor([0.0, 3.0, 1.0, 0.0])
    order = torch.tensor([1, 0, 2, 3])
    # budgets 1/4 -> 1 token: 3/4; 2/4 -> 2 tokens: 3/4; 3/4 -> 3 tokens: 4/4
    got = ranking_reward(order, utility, budgets=(0.25, 0.5, 0.75))
    assert math.isclose(float(got), (0.75 + 0.75 + 1.0) / 3, rel_tol=1e-6)
    best = ranking_reward(torch.tensor([1, 2, 0, 3]), utility, budgets=(0.25, 0.5, 0.75))
    assert float(best) > float(got)


def test_plackett_luce_probabilities_sum_to_one():
    scores = torch.tensor([0.3, -1.0, 2.0])
    total = sum(math.exp(float(_plackett_luce_logp(scores, torch.tensor(p))))
                for p in itertools.permutations(range(3)))
    assert math.isclose(total, 1.0, rel_tol=1e-6)
    first = math.exp(float(_plackett_luce_logp(scores, torch.tensor([2, 0, 1]))))
    e = [math.exp(x) for x in (0.3, -1.0, 2.0)]
    assert math.isclose(first, e[2] / sum(e) * e[0] / (e[0] + e[1]), rel_tol=1e-6)


# -- LKV-T's training gate --------------------------------------------------------------------


class _Layer:
    layer_idx = 0


def _eager(query, key, value, mask, drop=None):
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = query @ k.transpose(2, 3) * query.shape[-1] ** -0.5 + mask
    if drop is not None:
        logits = logits.masked_fill(drop, -torch.inf)
    return (torch.softmax(logits, -1) @ v).transpose(1, 2)


def test_the_gate_evicts_exactly_the_context_keys_outside_the_top_k():
    torch.manual_seed(1)
    scorer = KVScorer(ScorerShape(1, 2, 4, 4), hidden=8)
    gate = GatedAttention(scorer, n_recent=0)
    q, k, v = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    causal = torch.full((8, 8), -torch.inf).triu(1)[None, None]
    gate.context, gate.retention = 6, 1.0
    out, _ = gate(_Layer(), q, k, v, causal)
    assert torch.allclose(out, _eager(q, k, v, causal), atol=1e-6)
    gate.retention = 0.5  # keep 3 of the 6 context keys, for queries 6 and 7 only
    out, _ = gate(_Layer(), q, k, v, causal)
    s = scorer(0, k, v).mean(1)[0, :6]
    evicted = torch.ones(8, dtype=torch.bool)
    evicted[s.topk(3).indices] = False
    evicted[6:] = False
    drop = torch.zeros(8, 8, dtype=torch.bool)
    drop[6:] = evicted
    assert torch.allclose(out, _eager(q, k, v, causal, drop[None, None]), atol=1e-6)
    out.sum().backward()  # the soft gate carries a gradient to the scorer
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in scorer.parameters())


class _TokenScores(torch.nn.Module):
    """A "scorer" whose scores are parameters, one per context token (the gate's gradient per
    token is then the parameter's gradient)."""

    def __init__(self, scores):
        super().__init__()
        self.scores = torch.nn.Parameter(torch.tensor(scores))

    def forward(self, layer, keys, values):
        return self.scores.expand(keys.shape[0], keys.shape[1], -1)


def test_an_evicted_token_gets_a_gradient_and_the_window_is_kept():
    """Under the hard mask an evicted key has weight 0 and so no gradient; the straight-through
    pass gives it the soft gate's gradient, so training can bring it back. The newest
    ``n_recent`` context keys are kept whatever their scores, as LKVToken keeps them."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    causal = torch.full((8, 8), -torch.inf).triu(1)[None, None]
    scores = _TokenScores([3.0, -1.0, 2.0, -2.0, 1.0, -5.0])
    gate = GatedAttention(scores, n_recent=1)
    gate.context, gate.retention = 6, 0.5  # keep 3: slot 5 (the window), then slots 0 and 2
    out, _ = gate(_Layer(), q, k, v, causal)
    drop = torch.zeros(8, 8, dtype=torch.bool)
    drop[6:, [1, 3, 4]] = True
    assert torch.allclose(out, _eager(q, k, v, causal, drop[None, None]), atol=1e-6)
    out.pow(2).sum().backward()
    grad = scores.scores.grad
    assert all(abs(float(grad[i])) > 1e-6 for i in (1, 3, 4))  # evicted, yet they learn
    assert float(grad[5]) == 0.0  # the window's slot is kept regardless of its score
