"""Token-level policies: exact kept sets, loop references, padding, properties, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevict.errors import ConfigError, PolicyError
from kvevict.tokens import (
    H2O,
    TOKEN_POLICIES,
    KeyNorm,
    KVScorer,
    ScorerShape,
    SnapKV,
    StreamingLLM,
    TokenPolicy,
    available_token_policies,
    make_token_policy,
    register_token_policy,
)

# -- builders --------------------------------------------------------------------------------


def inputs(batch=1, heads=1, length=10, dim=4, *, seed=0, queries=None, valid=None,
           positions=None):
    """Random keys/values, ascending positions, all-valid mask and optional attention.

    The attention is a softmax over random logits with invalid key slots masked out.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=gen)
    values = torch.randn(batch, heads, length, dim, generator=gen)
    if positions is None:
        positions = torch.arange(length).expand(batch, length).clone()
    if valid is None:
        valid = torch.ones(batch, length, dtype=torch.bool)
    attention = None
    if queries is not None:
        logits = torch.randn(batch, heads, queries, length, generator=gen) * 2
        logits = logits.masked_fill(~valid[:, None, None, :], -torch.inf)
        attention = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return keys, values, positions, valid, attention


def attention_from(rows, heads=1):
    """A [1, heads, Q, T] attention tensor from a list of Q probability rows."""
    probs = torch.tensor(rows, dtype=torch.float32)
    return probs.expand(1, heads, *probs.shape).clone()


def left_padded(batch, length, seed):
    """Left padding: row b has a random number of leading invalid slots (position 1, as HF)."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.ones(batch, length, dtype=torch.bool)
    positions = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        pad = int(torch.randint(0, length // 2 + 1, (1,), generator=gen))
        valid[b, :pad] = False
        positions[b, :pad] = 1
        # gaps between positions, as after earlier pruning
        steps = torch.randint(1, 4, (length - pad,), generator=gen)
        positions[b, pad:] = torch.cumsum(steps, 0) - 1
    return positions, valid


# -- reference implementations (loops over rows and heads, written from the papers) ----------


def ref_finish(chosen, positions, valid, budget):
    """Complete one row: all valid slots if they fit the budget (then the newest invalid
    slots), else the chosen set. Returns the sorted kept slots."""
    length = len(valid)
    kept_count = min(budget, length)
    valid_slots = [t for t in range(length) if valid[t]]
    if len(valid_slots) <= kept_count:
        invalid = sorted((t for t in range(length) if not valid[t]),
                         key=lambda t: (positions[t], t), reverse=True)
        return sorted(valid_slots + invalid[: kept_count - len(valid_slots)])
    assert len(chosen) == kept_count
    return sorted(chosen)


def ref_newest(positions, valid, count):
    slots = sorted((t for t in range(len(valid)) if valid[t]),
                   key=lambda t: (positions[t], t), reverse=True)
    return slots[:count]


def ref_top(values, candidates, count, positions):
    """The ``count`` best candidates; equal values keep the more recent (position, slot)."""
    return sorted(candidates, key=lambda t: (values[t], positions[t], t), reverse=True)[:count]


def ref_streaming(positions, valid, budget, n_sink):
    """StreamingLLM: the first n_sink tokens plus the most recent budget - n_sink."""
    out = []
    for b in range(len(valid)):
        pos, ok = positions[b].tolist(), valid[b].tolist()
        by_pos = sorted((t for t in range(len(ok)) if ok[t]), key=lambda t: (pos[t], t))
        chosen = by_pos[:n_sink] + by_pos[n_sink:][-(budget - n_sink):]
        out.append(ref_finish(chosen, pos, ok, budget))
    return out


def ref_knorm(keys, valid, positions, budget):
    """Key norm: keep the lowest mean-over-heads L2 norm of the keys."""
    batch, heads, length, dim = keys.shape
    out = []
    for b in range(batch):
        norms = []
        for t in range(length):
            per_head = [math.sqrt(sum(float(keys[b, h, t, d]) ** 2 for d in range(dim)))
                        for h in range(heads)]
            norms.append(sum(per_head) / heads)
        ok = valid[b].tolist()
        cand = [t for t in range(length) if ok[t]]
        chosen = sorted(cand, key=lambda t: norms[t])[: min(budget, length)]
        out.append(ref_finish(chosen, positions[b].tolist(), ok, budget))
    return out


def ref_h2o_received(attention):
    """Attention each slot received: summed over queries, averaged over heads ([B][T])."""
    batch, heads, queries, length = attention.shape
    return [[sum(float(attention[b, h, q, t]) for q in range(queries) for h in range(heads))
             / heads for t in range(length)] for b in range(batch)]


def ref_h2o_step(acc, attention, positions, valid, budget, n_recent):
    """One H2O step for all rows: grow the state, add the attention, keep recent + heavy."""
    received = ref_h2o_received(attention)
    out, new_acc = [], []
    for b in range(len(valid)):
        old = acc[b] if acc is not None else []
        total = [received[b][t] + (old[t] if t < len(old) else 0.0)
                 for t in range(len(received[b]))]
        pos, ok = positions[b].tolist(), valid[b].tolist()
        recent = ref_newest(pos, ok, n_recent)
        rest = [t for t in range(len(ok)) if ok[t] and t not in recent]
        kept_count = min(budget, len(ok))
        chosen = recent + ref_top(total, rest, kept_count - len(recent), pos)
        kept = ref_finish(chosen, pos, ok, budget)
        out.append(kept)
        new_acc.append([total[t] for t in kept])
    return out, new_acc


def ref_snapkv(attention, positions, valid, budget, window_size, kernel_size, pooling="avg"):
    """SnapKV as kvpress writes it: per head, mean of the window queries' attention over the
    non-window tokens, 1-D pooling with zero padding, mean over heads, top-k plus the window.
    Assumes the window is the last w slots (true for left padding)."""
    batch, heads, queries, length = attention.shape
    w = min(window_size, queries)
    half = kernel_size // 2
    out = []
    for b in range(batch):
        prefix = length - w
        scores = [0.0] * prefix
        for h in range(heads):
            votes = [sum(float(attention[b, h, q, t]) for q in range(queries - w, queries)) / w
                     for t in range(prefix)]
            for t in range(prefix):
                around = [votes[j] if 0 <= j < prefix else 0.0
                          for j in range(t - half, t + half + 1)]
                pooled = sum(around) / kernel_size if pooling == "avg" else max(around)
                scores[t] += pooled / heads
        pos, ok = positions[b].tolist(), valid[b].tolist()
        window = list(range(prefix, length))
        assert window == sorted(ref_newest(pos, ok, w))
        cand = [t for t in range(prefix) if ok[t]]
        chosen = window + ref_top(scores, cand, min(budget, length) - w, pos)
        out.append(ref_finish(chosen, pos, ok, budget))
    return out


# -- exact kept sets on hand-built tensors --------------------------------------------------


def test_streaming_two_sinks_window_three():
    keys, values, positions, valid, _ = inputs(length=10)
    policy = make_token_policy("streamingllm", budget=5, n_sink=2)
    assert policy.select(0, keys, values, positions, valid).tolist() == [[0, 1, 7, 8, 9]]


def test_streaming_sinks_skip_left_padding():
    # slots 0-2 are padding (HF gives them position 1); the sinks are the first real tokens
    positions = torch.tensor([[1, 1, 1, 0, 1, 2, 3, 4, 5, 6]])
    valid = torch.tensor([[False] * 3 + [True] * 7])
    keys, values, _, _, _ = inputs(length=10)
    policy = StreamingLLM(budget=4, n_sink=2)
    assert policy.select(0, keys, values, positions, valid).tolist() == [[3, 4, 8, 9]]


def test_streaming_uses_positions_not_slots():
    # after an earlier pruning the stored positions have gaps; slot order is not position order
    positions = torch.tensor([[0, 1, 50, 40, 30, 60]])
    keys, values, _, valid, _ = inputs(length=6)
    policy = StreamingLLM(budget=3, n_sink=1)
    # sink: position 0 (slot 0); most recent: positions 60 (slot 5) and 50 (slot 2)
    assert policy.select(0, keys, values, positions, valid).tolist() == [[0, 2, 5]]


def test_keynorm_keeps_lowest_norms():
    keys = torch.zeros(1, 1, 5, 2)
    keys[0, 0, :, 0] = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    _, _, positions, valid, _ = inputs(length=5)
    assert KeyNorm(budget=2).select(0, keys, keys, positions, valid).tolist() == [[1, 3]]
    assert KeyNorm(budget=3).select(0, keys, keys, positions, valid).tolist() == [[1, 3, 4]]


def test_keynorm_averages_heads():
    keys = torch.zeros(1, 2, 3, 1)
    keys[0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0])  # head 0 alone would keep slot 0
    keys[0, 1, :, 0] = torch.tensor([9.0, 2.0, 1.0])  # means: 5, 2, 2 -> tie, recent first
    _, _, positions, valid, _ = inputs(length=3)
    assert KeyNorm(budget=1).select(0, keys, keys, positions, valid).tolist() == [[2]]
    assert KeyNorm(budget=2).select(0, keys, keys, positions, valid).tolist() == [[1, 2]]


def test_ties_keep_the_more_recent_token():
    keys = torch.ones(1, 1, 6, 2)
    _, _, positions, valid, _ = inputs(length=6)
    assert KeyNorm(budget=2).select(0, keys, keys, positions, valid).tolist() == [[4, 5]]


def test_nan_scores_rank_below_valid_tokens():
    keys = torch.ones(1, 1, 4, 2)
    keys[0, 0, 3] = torch.nan
    _, _, positions, valid, _ = inputs(length=4)
    assert KeyNorm(budget=3).select(0, keys, keys, positions, valid).tolist() == [[0, 1, 2]]


def test_h2o_accumulates_over_two_calls_and_follows_pruning():
    policy = H2O(budget=3, n_recent=1)
    keys, values, positions, valid, _ = inputs(length=4)
    first = attention_from([[0.1, 0.5, 0.15, 0.25]])
    kept = policy.select(0, keys, values, positions, valid, first)
    # recent: slot 3; heavy hitters among slots 0-2: slot 1 (0.5), slot 2 (0.15)
    assert kept.tolist() == [[1, 2, 3]]
    assert torch.allclose(policy.accumulated(0), torch.tensor([[0.5, 0.15, 0.25]]))

    # the cache keeps slots 1, 2, 3 (positions 1, 2, 3) and appends position 4
    positions2 = torch.tensor([[1, 2, 3, 4]])
    second = attention_from([[0.0, 0.6, 0.1, 0.3]])
    # accumulated: [0.5, 0.75, 0.35, 0.3]; recent: slot 3; heavy: slots 1 and 0
    kept2 = policy.select(0, keys, values, positions2, valid, second)
    assert kept2.tolist() == [[0, 1, 3]]
    assert torch.allclose(policy.accumulated(0), torch.tensor([[0.5, 0.75, 0.3]]))

    # without the first call's attention the choice differs (slot 2 beats slot 0)
    fresh = H2O(budget=3, n_recent=1)
    assert fresh.select(0, keys, values, positions2, valid, second).tolist() == [[1, 2, 3]]


def test_h2o_layers_are_independent_and_score_is_pure():
    policy = H2O(budget=3, n_recent=1)
    keys, values, positions, valid, _ = inputs(length=4)
    attn = attention_from([[0.1, 0.5, 0.15, 0.25]])
    before = policy.score(0, keys, values, positions, attn)
    again = policy.score(0, keys, values, positions, attn)
    assert torch.equal(before, again)
    assert policy.accumulated(0) is None
    policy.select(1, keys, values, positions, valid, attn)
    assert policy.accumulated(0) is None
    assert policy.accumulated(1).shape == (1, 3)
    policy.reset()
    assert policy.accumulated(1) is None


def test_h2o_no_pruning_still_accumulates():
    policy = H2O(budget=8, n_recent=2)
    keys, values, positions, valid, _ = inputs(length=3)
    attn = attention_from([[0.2, 0.3, 0.5]])
    assert policy.select(0, keys, values, positions, valid, attn).tolist() == [[0, 1, 2]]
    assert policy.select(0, keys, values, positions, valid, attn).tolist() == [[0, 1, 2]]
    assert torch.allclose(policy.accumulated(0), torch.tensor([[0.4, 0.6, 1.0]]))


def test_h2o_reorder_follows_beams():
    policy = H2O(budget=2, n_recent=0)
    keys, values, positions, valid, _ = inputs(batch=2, length=2)
    attn = torch.tensor([[[[0.9, 0.1]]], [[[0.2, 0.8]]]])
    policy.select(0, keys, values, positions, valid, attn)
    policy.reorder(torch.tensor([1, 1]))
    assert torch.allclose(policy.accumulated(0), torch.tensor([[0.2, 0.8], [0.2, 0.8]]))


def test_recent_windows_follow_positions_not_slots():
    keys, values, _, valid, _ = inputs(length=4)
    positions = torch.tensor([[0, 5, 2, 3]])  # slot 1 holds the newest token
    attn = attention_from([[0.1, 0.0, 0.5, 0.4]])
    h2o = H2O(budget=2, n_recent=1)
    assert h2o.select(0, keys, values, positions, valid, attn).tolist() == [[1, 2]]
    snap = SnapKV(budget=2, window_size=1, kernel_size=1)
    assert snap.select(0, keys, values, positions, valid, attn).tolist() == [[1, 2]]


def snapkv_case():
    """T=8, window = slots 6 and 7; the window queries' votes for slots 0-5 are
    [0, .3, 0, .2, .25, .05]: slot 1 wins alone, slot 4 wins after averaging over 3."""
    row = [0.0, 0.3, 0.0, 0.2, 0.25, 0.05, 0.1, 0.1]
    keys, values, positions, valid, _ = inputs(length=8)
    return keys, values, positions, valid, attention_from([row, row])


def test_snapkv_pooling_changes_the_choice():
    keys, values, positions, valid, attn = snapkv_case()
    plain = SnapKV(budget=3, window_size=2, kernel_size=1)
    pooled = SnapKV(budget=3, window_size=2, kernel_size=3)
    assert plain.select(0, keys, values, positions, valid, attn).tolist() == [[1, 6, 7]]
    # pooled votes: slot 1 -> .1, slot 3 -> .15, slot 4 -> (.2+.25+.05)/3 = .167
    assert pooled.select(0, keys, values, positions, valid, attn).tolist() == [[4, 6, 7]]
    # max pooling: slots 0, 1, 2 all reach .3; the tie keeps the most recent (slot 2)
    maxed = SnapKV(budget=3, window_size=2, kernel_size=3, pooling="max")
    assert maxed.select(0, keys, values, positions, valid, attn).tolist() == [[2, 6, 7]]


def test_snapkv_always_keeps_the_window():
    keys, values, positions, valid, attn = snapkv_case()
    attn = attention_from([[0.5, 0.5, 0, 0, 0, 0, 0, 0]] * 2)  # the window gets no attention
    policy = SnapKV(budget=4, window_size=2, kernel_size=1)
    assert policy.select(0, keys, values, positions, valid, attn).tolist() == [[0, 1, 6, 7]]


def test_snapkv_window_limited_to_available_queries():
    keys, values, positions, valid, _ = inputs(length=8)
    row = [0.05, 0.3, 0.05, 0.1, 0.1, 0.1, 0.2, 0.1]
    policy = SnapKV(budget=3, window_size=2, kernel_size=1)
    # one query: the window is the newest token only; slots 1 and 6 win the vote
    assert policy.select(0, keys, values, positions, valid, attention_from([row])).tolist() \
        == [[1, 6, 7]]


# -- equal to loop references on random tensors ----------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("padded", [False, True])
def test_streaming_matches_reference(seed, padded):
    batch, length = 3, 17
    keys, values, positions, valid, _ = inputs(batch, 2, length, seed=seed)
    if padded:
        positions, valid = left_padded(batch, length, seed)
    for budget, n_sink in [(6, 2), (9, 4), (3, 0), (20, 4)]:
        got = StreamingLLM(budget, n_sink=n_sink).select(0, keys, values, positions, valid)
        assert got.tolist() == ref_streaming(positions, valid, budget, n_sink)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("padded", [False, True])
def test_keynorm_matches_reference(seed, padded):
    batch, length = 3, 15
    keys, values, positions, valid, _ = inputs(batch, 3, length, 5, seed=seed)
    if padded:
        positions, valid = left_padded(batch, length, seed)
    for budget in (1, 4, 9, 15, 30):
        got = KeyNorm(budget).select(0, keys, values, positions, valid)
        assert got.tolist() == ref_knorm(keys, valid, positions, budget)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("padded", [False, True])
def test_h2o_matches_reference_over_several_steps(seed, padded):
    batch, heads, length, budget, n_recent = 2, 2, 14, 8, 3
    keys, values, positions, valid, attn = inputs(batch, heads, length, seed=seed,
                                                  queries=length)
    if padded:
        positions, valid = left_padded(batch, length, seed)
        _, _, _, _, attn = inputs(batch, heads, length, seed=seed, queries=length, valid=valid)
    policy = H2O(budget, n_recent=n_recent)
    acc = None
    gen = torch.Generator().manual_seed(100 + seed)
    for step in range(4):
        got = policy.select(0, keys, values, positions, valid, attn)
        want, acc = ref_h2o_step(acc, attn, positions, valid, budget, n_recent)
        assert got.tolist() == want, step
        assert torch.allclose(policy.accumulated(0), torch.tensor(acc), atol=1e-5)
        # prune the cache to the kept slots and append two decoded tokens
        positions = torch.cat([positions.gather(1, got), positions.max(1, keepdim=True).values
                               + torch.tensor([[1, 2]])], dim=1)
        valid = torch.cat([valid.gather(1, got), torch.ones(batch, 2, dtype=torch.bool)], 1)
        length = positions.shape[1]
        keys = torch.randn(batch, heads, length, 4, generator=gen)
        values = torch.randn(batch, heads, length, 4, generator=gen)
        logits = torch.randn(batch, heads, 2, length, generator=gen)
        attn = torch.softmax(logits.masked_fill(~valid[:, None, None, :], -torch.inf), -1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(("kernel", "pooling"), [(1, "avg"), (5, "avg"), (3, "max")])
def test_snapkv_matches_reference(seed, padded, kernel, pooling):
    batch, heads, length = 2, 2, 20
    positions = valid = None
    if padded:
        positions, valid = left_padded(batch, length, seed)
    keys, values, positions, valid, attn = inputs(batch, heads, length, seed=seed, queries=6,
                                                  positions=positions, valid=valid)
    for budget, window in [(8, 4), (12, 6), (30, 4)]:
        policy = SnapKV(budget, window_size=window, kernel_size=kernel, pooling=pooling)
        got = policy.select(0, keys, values, positions, valid, attn)
        assert got.tolist() == ref_snapkv(attn, positions, valid, budget, window, kernel,
                                          pooling)


# -- padding ---------------------------------------------------------------------------------


def test_invalid_slots_are_dropped_first():
    keys = torch.ones(1, 1, 6, 2)
    keys[0, 0, :3] = 0.0  # the padding has the lowest key norms, i.e. the best scores
    valid = torch.tensor([[False, False, False, True, True, True]])
    _, _, positions, _, _ = inputs(length=6)
    assert KeyNorm(budget=3).select(0, keys, keys, positions, valid).tolist() == [[3, 4, 5]]


@pytest.mark.parametrize("name", ["streamingllm", "knorm", "h2o", "snapkv"])
def test_short_row_keeps_all_its_valid_tokens(name):
    batch, length = 2, 10
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :7] = False  # row 1: three valid tokens, budget 6
    keys, values, positions, valid, attn = inputs(batch, 2, length, queries=3, valid=valid)
    policy = make_token_policy(name, budget=6, **({"window_size": 2} if name == "snapkv"
                                                  else {"n_sink": 1} if name == "streamingllm"
                                                  else {}))
    kept = policy.select(0, keys, values, positions, valid, attn)
    assert kept.shape == (2, 6)
    assert {7, 8, 9} <= set(kept[1].tolist())
    assert valid.gather(1, kept).sum(1).tolist() == [6, 3]


# -- properties ------------------------------------------------------------------------------


@st.composite
def cases(draw):
    name = draw(st.sampled_from(["streamingllm", "knorm", "h2o", "snapkv"]))
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    length = draw(st.integers(0, 12))
    budget = draw(st.integers(2 if name == "snapkv" else 1, 15))
    params = {}
    if name == "streamingllm":
        params["n_sink"] = draw(st.integers(0, budget - 1))
    elif name == "h2o":
        params["n_recent"] = draw(st.integers(0, budget))
    elif name == "snapkv":
        params["window_size"] = draw(st.integers(1, budget - 1))
        params["kernel_size"] = draw(st.sampled_from([1, 3, 5]))
        params["pooling"] = draw(st.sampled_from(["avg", "max"]))
    valid = draw(st.lists(st.lists(st.booleans(), min_size=length, max_size=length),
                          min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**16))
    queries = draw(st.integers(1, 4))
    return name, budget, params, batch, heads, length, valid, seed, queries


@settings(max_examples=150, deadline=None)
@given(cases())
def test_selection_properties(case):
    name, budget, params, batch, heads, length, valid_rows, seed, queries = case
    valid = torch.tensor(valid_rows, dtype=torch.bool).reshape(batch, length)
    keys, values, positions, valid, attn = inputs(batch, heads, length, 3, seed=seed,
                                                  queries=queries, valid=valid)
    policy = make_token_policy(name, budget=budget, **params)
    kept = policy.select(0, keys, values, positions, valid, attn)
    count = min(budget, length)
    assert kept.shape == (batch, count)
    assert kept.dtype == torch.long
    for b in range(batch):
        row = kept[b].tolist()
        assert row == sorted(set(row))
        assert all(0 <= t < length for t in row)
        valid_slots = {t for t in range(length) if valid_rows[b][t]}
        if len(valid_slots) <= budget:
            assert valid_slots <= set(row)
        else:
            assert set(row) <= valid_slots


# -- registry and bad input ------------------------------------------------------------------


def test_registry():
    assert available_token_policies() == ["ema", "ema_heads", "h2o", "knorm", "kvp", "lkv_h",
                                          "lkv_t", "moe_nd", "snapkv", "streamingllm", "tova"]
    policy = make_token_policy("snapkv", budget=64, window_size=8, kernel_size=7,
                               pooling="max")
    assert isinstance(policy, SnapKV) and policy.needs_attention
    assert repr(policy) == "SnapKV(budget=64, window_size=8, kernel_size=7, pooling='max')"
    assert make_token_policy(policy) is policy
    assert not StreamingLLM(8).needs_attention and H2O(8).n_recent == 4
    with pytest.raises(ConfigError, match="valid names: ema, ema_heads, h2o, knorm, kvp, "
                                          "lkv_h, lkv_t, moe_nd, snapkv, streamingllm, tova"):
        make_token_policy("lru", budget=4)
    with pytest.raises(ConfigError, match=r"no parameter.*window.*accepts: budget, n_sink"):
        make_token_policy("streamingllm", budget=8, window=3)
    with pytest.raises(ConfigError, match="needs a budget"):
        make_token_policy("knorm")
    with pytest.raises(ConfigError, match="together with a policy instance"):
        make_token_policy(policy, budget=3)


def test_custom_policy_from_the_docstring():
    @register_token_policy("test-vnorm")
    class ValueNorm(TokenPolicy):
        def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
            self._check(layer_idx, keys, values, positions, valid, attention)
            return self._mask(values.float().norm(dim=-1).mean(dim=1), valid)

    try:
        values = torch.zeros(1, 1, 4, 1)
        values[0, 0, :, 0] = torch.tensor([3.0, 1.0, 4.0, 2.0])
        keys, _, positions, valid, _ = inputs(length=4, dim=1)
        policy = make_token_policy("test-vnorm", budget=2)
        assert policy.select(0, keys, values, positions, valid).tolist() == [[0, 2]]
    finally:
        from kvevict import tokens

        tokens.TOKEN_POLICIES.unregister("test-vnorm")


def test_broken_score_raises_policy_error():
    class Broken(TokenPolicy):
        def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
            return torch.zeros(3)

    keys, values, positions, valid, _ = inputs(length=4)
    with pytest.raises(PolicyError, match=r"Broken.score returned \(3,\).*\(1, 4\)"):
        Broken(2).select(0, keys, values, positions, valid)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: KeyNorm(0), "budget must be >= 1"),
    (lambda: KeyNorm(2.5), "budget must be an int"),
    (lambda: KeyNorm(True), "budget must be an int"),
    (lambda: StreamingLLM(4), r"n_sink \(4\) must be smaller than budget \(4\)"),
    (lambda: StreamingLLM(4, n_sink=-1), "n_sink must be >= 0"),
    (lambda: H2O(4, n_recent=5), r"n_recent \(5\) must be at most budget \(4\)"),
    (lambda: SnapKV(16), r"window_size \(32\) must be smaller than budget \(16\)"),
    (lambda: SnapKV(16, window_size=4, kernel_size=4), "kernel_size must be odd"),
    (lambda: SnapKV(16, window_size=4, pooling="mean"), "pooling must be one of avg, max"),
])
def test_bad_parameters(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_bad_tensors():
    keys, values, positions, valid, attn = inputs(2, 2, 6, queries=2)
    policy = H2O(4)
    ok = (0, keys, values, positions, valid, attn)

    def call(**changes):
        names = ["layer_idx", "keys", "values", "positions", "valid", "attention"]
        args = dict(zip(names, ok))
        args.update(changes)
        return policy.select(**args)

    cases = [
        ({"layer_idx": -1}, "layer_idx must be an int >= 0"),
        ({"keys": keys[0]}, r"keys must be a float tensor of shape \[B, Hkv, T, D\]"),
        ({"keys": keys.long()}, "keys must be a float tensor"),
        ({"values": values[:, :, :5]}, r"values must have shape \[B, Hkv, T, Dv\] = "
                                       r"\[2, 2, 6, Dv\].*\[2, 2, 5, 4\]"),
        ({"positions": positions.float()}, "positions must be an integer tensor"),
        ({"positions": positions[:, :5]}, r"positions .* \[2, 6\], got .*\[2, 5\]"),
        ({"valid": valid.long()}, "valid must be a bool tensor"),
        ({"valid": valid[:1]}, r"valid must be a bool tensor of shape \[B, T\] = \[2, 6\]"),
        ({"attention": None}, "policy 'h2o' needs attention"),
        ({"attention": attn[..., :5]}, r"attention must be .*\[2, 2, Q>=1, 6\]"),
        ({"attention": attn[:, :1]}, "attention must be a float tensor"),
        ({"attention": attn[:, :, :0]}, "attention must be"),
    ]
    for changes, message in cases:
        with pytest.raises(ConfigError, match=message):
            call(**changes)
    assert policy.accumulated(0) is None  # failed calls leave no state
    with pytest.raises(ConfigError, match="policy 'snapkv' needs attention"):
        SnapKV(4, window_size=2).score(0, keys, values, positions)
    with pytest.raises(ValueError, match="values must have shape"):  # ConfigError is one
        KeyNorm(2).score(0, keys, values[..., :3, :], positions)


def test_h2o_state_mismatch_errors():
    policy = H2O(4, n_recent=1)
    keys, values, positions, valid, attn = inputs(2, 1, 6, queries=1)
    policy.select(0, keys, values, positions, valid, attn)  # state now holds 4 slots
    k3, v3, p3, m3, a3 = inputs(2, 1, 3, queries=1)
    with pytest.raises(ConfigError, match="holds state for 4 stored tokens but got T=3"):
        policy.select(0, k3, v3, p3, m3, a3)
    k1, v1, p1, m1, a1 = inputs(1, 1, 6, queries=1)
    with pytest.raises(ConfigError, match="state for batch size 2, got 1"):
        policy.select(0, k1, v1, p1, m1, a1)
    policy.reset()
    assert policy.select(0, k3, v3, p3, m3, a3).shape == (2, 3)


def test_empty_cache():
    keys, values, positions, valid, attn = inputs(2, 1, 0, queries=1)
    scorer = {"scorer": KVScorer(ScorerShape(layers=1, kv_heads=1, key_dim=4, value_dim=4))}
    for name in available_token_policies():
        if TOKEN_POLICIES.get(name).granularity == "head":
            continue  # per-head positions: tests/test_tokens_heads_paged.py
        policy = make_token_policy(name, budget=4, **({"window_size": 2}
                                                       if name == "snapkv" else {"n_sink": 1}
                                                       if name == "streamingllm" else scorer
                                                       if name in ("kvp", "lkv_t") else {}))
        assert policy.select(0, keys, values, positions, valid, attn).shape == (2, 0)
