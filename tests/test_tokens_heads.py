"""Head-granular token eviction (`kvevict.tokens.heads`, `kvevict.adapters.hf.heads`): exact
allocations and selections on hand-built cases, the EMA against its recurrence, and the cache
against the training gate's masked full attention on a seeded random model of the judge's
shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import judge_shaped, plain_answers

from kvevict.adapters.hf.heads import HeadCache, head_answers, head_attention
from kvevict.errors import ConfigError
from kvevict.judge import gated_logits
from kvevict.tokens.heads import (
    HeadBudgets,
    HeadGate,
    allocate,
    ema_attention,
    load_budgets,
    save_budgets,
    select_heads,
    train_lkv_h,
)
from kvevict.tokens.learned import ScorerShape
from kvevict.tokens.tasks import VOCAB_SIZE, make_items, training_batch


@pytest.fixture(scope="module")
def model():
    return judge_shaped(VOCAB_SIZE)


# -- allocation and selection ----------------------------------------------------------------


def test_allocate_splits_the_total_by_share_with_ties_to_the_lower_index():
    # total 0.5 * 10 * 2 = 10; λ = 2.5 gives 2.5 and 7.5; the one left goes to head 0
    assert allocate(torch.tensor([[1.0, 3.0]]), 0.5, 10).tolist() == [[3, 7]]


def test_allocate_caps_a_head_at_the_context_and_gives_the_rest_away():
    # total 12 of 2 x 8: head 1 wants 100x head 0 but holds at most 8
    assert allocate(torch.tensor([[1.0, 100.0]]), 0.75, 8).tolist() == [[4, 8]]


def test_allocate_keeps_one_token_per_head_and_hits_the_total_exactly():
    shares = torch.tensor([[0.001, 1.0, 5.0], [2.0, 0.5, 9.0]])
    for retention in (0.1, 0.15, 0.25, 0.5, 1.0):
        counts = allocate(shares, retention, 101)
        assert int(counts.sum()) == round(retention * 101 * 6)
        assert int(counts.min()) >= 1 and int(counts.max()) <= 101


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, True, "0.5"])
def test_a_retention_outside_zero_one_is_refused(bad):
    with pytest.raises(ConfigError, match="retention must be a fraction in"):
        allocate(torch.ones(1, 2), bad, 10)


def test_select_heads_keeps_each_heads_top_with_ties_to_the_newer_slot():
    scores = torch.tensor([[[5.0, 1.0, 5.0, 0.0, 2.0],
                            [0.0, 9.0, float("nan"), 9.0, 1.0]]])
    kept = select_heads(scores, [2, 3])
    assert kept[0].tolist() == [[0, 2]]
    assert kept[1].tolist() == [[1, 3, 4]]  # NaN ranks last
    assert select_heads(scores, [1, 1])[0].tolist() == [[2]]  # equal 5s: the later slot


def test_select_heads_refuses_a_count_outside_the_stored_tokens():
    with pytest.raises(ConfigError, match="head 1 would keep 6 of 5"):
        select_heads(torch.zeros(1, 2, 5), [1, 6])


def test_ema_attention_is_the_recurrence_from_a_previous_state():
    torch.manual_seed(1)
    weights = torch.rand(2, 3, 4, 6)
    previous = torch.rand(2, 3, 5)
    decay = 0.8
    state = torch.nn.functional.pad(previous, (0, 1))
    for q in range(4):
        state = decay * state + (1 - decay) * weights[:, :, q]
    assert torch.allclose(ema_attention(weights, decay, previous), state, atol=1e-6)


# -- the cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("scoring", ["ema", "knorm"])
def test_full_retention_is_token_identical_to_dynamic_cache(model, scoring):
    items = make_items("needle", 3, length=96, seed=4)
    answers, held = head_answers(model, items, 1.0, scoring=scoring)
    assert answers == plain_answers(model, items)
    # 2 layers x 2 kv heads x (K, V) x 16 dims x 4 bytes x 96 context tokens
    assert held == 2 * 2 * 2 * 16 * 4 * 96


def test_each_head_keeps_its_own_tokens_and_the_bytes_count_them(model):
    items = make_items("recall", 2, length=62, seed=5)  # 62 context tokens
    cache = HeadCache(model, 0.25, scoring="knorm")
    with torch.no_grad(), head_attention(model, cache):
        model(input_ids=torch.tensor([it.context for it in items]), cache=cache, use_cache=True)
        cache.compress()
    # 62 context tokens: 15.5 per head, the two left over to the lowest indices
    assert cache.counts(62).tolist() == [[16, 16], [15, 15]]
    assert [la.kept_counts() for la in cache.layers] == [[16, 16], [15, 15]]
    assert cache.nbytes() == 62 * 2 * 2 * 16 * 4  # every kept (token, head): K and V, fp32
    heads_differ = any(not torch.equal(la.kept[0][2], la.kept[1][2]) for la in cache.layers)
    assert heads_differ


def test_the_cache_computes_what_the_training_gate_masks(model):
    """Deployed (kept tensors per head) and trained (full attention, evicted keys at -inf per
    head) are the same attention: LKV-H learns on the function it is deployed with."""
    items = make_items("vartrack", 2, length=64, seed=6)  # 64 context tokens, 16 per head
    context = len(items[0].context)
    cache = HeadCache(model, 0.25, scoring="knorm")
    rest = torch.tensor([(*it.question, *it.answer[:-1]) for it in items])
    with torch.no_grad(), head_attention(model, cache):
        model(input_ids=torch.tensor([it.context for it in items]), cache=cache, use_cache=True)
        cache.compress()
        deployed = model(input_ids=rest, cache=cache, use_cache=True).logits
    gate = HeadGate(HeadBudgets(ScorerShape.of(model)), "knorm")
    gate.context, gate.retention = context, 0.25
    full = torch.tensor([(*it.context, *it.question, *it.answer[:-1]) for it in items])
    with torch.no_grad():
        trained = gated_logits(model, full, gate)[:, context:]
    assert torch.allclose(deployed, trained, atol=1e-5)


def test_lkv_h_learns_budgets_that_move_between_heads_and_reload(model, tmp_path):
    rng = __import__("numpy").random.default_rng(0)
    batches = []
    for _ in range(4):
        ids, targets = training_batch(["recall", "needle"], 64, rng, queries=2)
        batches.append((torch.from_numpy(ids), torch.from_numpy(targets), 64))
    for p in model.parameters():
        p.requires_grad_(False)
    budgets = train_lkv_h(lambda ids, gate: gated_logits(model, ids, gate), batches,
                          ScorerShape.of(model), epochs=2, lr=0.5)
    shares = budgets.shares().detach()
    assert not torch.allclose(shares, torch.ones_like(shares))  # the budget moved
    assert abs(float(shares.sum()) - 4.0) < 1e-5  # the total did not
    path = tmp_path / "lkv_h.safetensors"
    save_budgets(budgets, path)
    again = load_budgets(path, ScorerShape.of(model))
    assert torch.equal(again.counts(0.15, 1000), budgets.counts(0.15, 1000))
    other = ScorerShape(4, 2, 32, 32)
    with pytest.raises(ConfigError, match=r"layers=2.*layers=4"):
        load_budgets(path, other)
    cache = HeadCache(model, 0.15, scoring="knorm", budgets=path)
    assert torch.equal(cache.counts(1000), budgets.counts(0.15, 1000))


def test_bad_scoring_and_uncompressed_ema_are_refused(model):
    with pytest.raises(ConfigError, match="unknown head scoring 'attn'"):
        HeadCache(model, 0.5, scoring="attn")
    cache = HeadCache(model, 0.5, scoring="ema")
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 40, 300]]), cache=cache, use_cache=True)
    with pytest.raises(ConfigError, match="needs the prefill to run under head_attention"):
        cache.compress()


def test_the_ema_token_policy_decays_what_the_kept_tokens_received():
    """``make_token_policy("ema")``: the layer-shared EMA, state carried across forwards."""
    from kvevict.tokens import make_token_policy

    policy = make_token_policy("ema", budget=2, decay=0.5)
    keys = torch.zeros(1, 1, 3, 2)
    valid = torch.ones(1, 3, dtype=torch.bool)
    first = torch.tensor([[[[0.5, 0.2, 0.3]]]])
    kept = policy.select(0, keys, keys, torch.arange(3)[None], valid, first)
    assert kept.tolist() == [[0, 2]]  # EMA .25 .10 .15
    assert torch.allclose(policy.accumulated(0), torch.tensor([[0.25, 0.15]]))
    # the kept two, then one new token; two queries: s = .25 s + .25 p1 + .5 p2
    second = torch.tensor([[[[0.0, 0.6, 0.4], [0.1, 0.6, 0.3]]]])
    kept = policy.select(0, keys, keys, torch.tensor([[0, 2, 3]]), valid, second)
    want = torch.tensor([0.25 * 0.25 + 0.05, 0.25 * 0.15 + 0.15 + 0.3, 0.1 + 0.15])
    assert kept.tolist() == [[1, 2]]
    assert torch.allclose(policy.accumulated(0), want[None, 1:])
    with pytest.raises(ConfigError, match="decay must be in"):
        make_token_policy("ema", budget=2, decay=1.0)
