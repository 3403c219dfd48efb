"""`RoutedCache` (MoE-nD's per-layer eviction + quantization) and its calibration, on a seeded
random judge-like model (smaller, grouped-query)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import judge_shaped, plain_answers

from kvevict.adapters.hf.routed import (
    RoutedCache,
    calibrate,
    refine_route,
    routed_answers,
    routed_attention,
)
from kvevict.errors import ConfigError
from kvevict.tokens import make_token_policy
from kvevict.tokens.quant import kv_bytes, quantize
from kvevict.tokens.solver import Tuple, route, total_bytes, uniform
from kvevict.tokens.tasks import VOCAB_SIZE, make_items

WHOLE = Tuple(1.0, None, None)


@pytest.fixture(scope="module")
def model():
    return judge_shaped(VOCAB_SIZE)


def test_whole_unquantized_layers_are_token_identical_to_dynamic_cache(model):
    items = make_items("needle", 3, length=128, seed=1)
    answers, held = routed_answers(model, items, [WHOLE, WHOLE])
    assert answers == plain_answers(model, items)
    # 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes x 128 tokens
    assert held == 2 * 2 * 2 * 16 * 4 * 128


def test_each_layer_keeps_its_share_quantized_as_quantize_gives(model):
    items = make_items("recall", 2, length=100, seed=2)
    routing = [Tuple(0.5, 4, 8), Tuple(0.25, 2, None)]
    cache = RoutedCache(model, routing)
    with torch.no_grad(), routed_attention(model):
        model(input_ids=torch.tensor([it.context for it in items]), cache=cache, use_cache=True)
        full = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        cache.compress()
    for layer, (k, v), (ratio, kb, vb) in zip(cache.layers, full, routing, strict=True):
        kept = make_token_policy("knorm", budget=round(ratio * 100)).select(
            layer.layer_idx, k, v, torch.arange(100).expand(2, 100),
            torch.ones(2, 100, dtype=torch.bool))
        assert torch.equal(layer.kept_positions, kept)
        idx = kept[:, None, :, None].expand(-1, 2, -1, 16)
        kk, vv = k.gather(2, idx), v.gather(2, idx)
        want_k = quantize(kk, kb, axis="channel").dequantize(torch.float32)
        want_v = vv if vb is None else quantize(vv, vb, axis="token").dequantize(torch.float32)
        got_k, got_v = layer.update(k[:, :, :1], v[:, :, :1])
        assert torch.equal(got_k[:, :, :-1], want_k) and torch.equal(got_v[:, :, :-1], want_v)
    # the bytes the layers hold: one layer's K and V at its bits, plus the one residual token
    want = (kv_bytes((2, 16, torch.float32), 50, 4, 8, batch=2)
            + kv_bytes((2, 16, torch.float32), 25, 2, None, batch=2)
            + 2 * kv_bytes((2, 16, torch.float32), 1, batch=2))
    assert cache.nbytes() == want


def test_a_multi_token_forward_after_compression_equals_feeding_one_at_a_time(model):
    """The mask cut from the end is right for every layer's own keys."""
    items = make_items("recall", 2, length=100, seed=3)
    routing = [Tuple(0.5, 8, 8), Tuple(0.2, 4, 4)]
    rest = torch.tensor([(*it.question, *it.answer) for it in items])
    outs = []
    with torch.no_grad(), routed_attention(model):
        for step in (rest.shape[1], 1):
            cache = RoutedCache(model, routing)
            model(input_ids=torch.tensor([it.context for it in items]), cache=cache,
                  use_cache=True)
            cache.compress()
            outs.append(torch.cat([model(input_ids=rest[:, i:i + step], cache=cache,
                                         use_cache=True).logits
                                   for i in range(0, rest.shape[1], step)], dim=1))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    with pytest.raises(ConfigError, match="already compressed"):
        cache.compress()


def test_bad_routings_are_refused(model):
    with pytest.raises(ConfigError, match="routing has 1 tuples but the model has 2 layers"):
        RoutedCache(model, [WHOLE])
    with pytest.raises(ConfigError, match="key_bits"):
        RoutedCache(model, [Tuple(0.5, 3, 8), WHOLE])
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        RoutedCache(model, [Tuple(1.5, 8, 8), WHOLE])
    with pytest.raises(ConfigError, match="needs one"):
        RoutedCache(model, [WHOLE, WHOLE], token_policy="snapkv")


def test_calibration_shares_one_prefill_and_equals_a_prefill_per_routing(model):
    """`calibrate` prefills once and compresses a reroute of it per tuple: the losses are
    exactly those of a fresh prefill and compression per routing."""
    items = make_items("needle", 3, length=90, seed=2)
    tuples = [WHOLE, Tuple(0.5, 4, 8), Tuple(0.25, 2, None)]
    losses = calibrate(model, items, tuples)

    base = _fresh_nll(model, items, [WHOLE, WHOLE])
    for layer in range(2):
        for t in tuples[1:]:
            routing = [t if i == layer else WHOLE for i in range(2)]
            assert losses[layer][t] == _fresh_nll(model, items, routing) - base
    assert len({v for row in losses for v in row.values()}) > 2  # the tuples do differ


def test_calibration_routing_and_the_uniform_baseline(model):
    items = make_items("recall", 4, length=100, seed=4)
    tuples = [WHOLE, Tuple(0.5, 8, 8), Tuple(0.25, 4, 4), Tuple(0.1, 2, 2)]
    losses = calibrate(model, items, tuples)
    assert [row[WHOLE] for row in losses] == [0.0, 0.0]
    assert all(set(row) == set(tuples) for row in losses)
    costs = _tiny_costs(tuples, 100)
    budget = 0.2 * costs[0][WHOLE] * 2
    routed = route(losses, costs, budget)
    flat = uniform(tuples, costs, budget, losses)
    assert sum(c[t] for c, t in zip(costs, routed, strict=True)) <= budget
    assert len(set(flat)) == 1  # one tuple for every layer
    assert sum(r[t] for r, t in zip(losses, routed, strict=True)) <= sum(
        r[t] for r, t in zip(losses, flat, strict=True)) + 1e-12


def _tiny_costs(tuples, tokens):
    return [{t: kv_bytes((2, 16, torch.float32), max(1, round(t.keep_ratio * tokens)),
                         t.key_bits, t.value_bits) for t in tuples}] * 2


def _fresh_nll(model, items, routing):
    """The answers' mean NLL after a prefill and compression of its own under ``routing``."""
    cache = RoutedCache(model, routing)
    with routed_attention(model), torch.no_grad():
        model(input_ids=torch.tensor([it.context for it in items]), cache=cache)
        cache.compress()
        rest = torch.tensor([(*it.question, *it.answer[:-1]) for it in items])
        logp = torch.log_softmax(model(input_ids=rest, cache=cache).logits[:, 1:].float(),
                                 dim=-1)
    answer = torch.tensor([it.answer for it in items])
    return float(-logp.gather(2, answer[:, :, None]).mean())


def test_refine_route_measures_the_starts_jointly_and_only_lowers_the_loss(model):
    """Each start's joint NLL is exactly that of its own prefill and compression; with no
    rounds the lowest start is chosen; the search returns a routing within budget whose NLL
    (again exact) is below every start's on this seeded model."""
    items = make_items("recall", 4, length=100, seed=4)
    tuples = [WHOLE, Tuple(0.5, 8, 8), Tuple(0.25, 4, 4), Tuple(0.1, 2, 2)]
    costs = _tiny_costs(tuples, 100)
    budget = costs[0][WHOLE] + costs[0][Tuple(0.25, 4, 4)]
    starts = [[Tuple(0.1, 2, 2)] * 2, [Tuple(0.25, 4, 4)] * 2]
    same, nll0, measured = refine_route(model, items, costs, budget, starts, rounds=0)
    assert measured == [_fresh_nll(model, items, r) for r in starts]
    lowest = min(range(2), key=measured.__getitem__)
    assert same == starts[lowest] and nll0 == measured[lowest]
    chosen, nll, again = refine_route(model, items, costs, budget, starts, rounds=2)
    assert again == measured
    assert chosen not in starts and total_bytes(chosen, costs) <= budget
    assert nll == _fresh_nll(model, items, chosen) < min(measured)


def test_refine_route_refuses_bad_starts(model):
    items = make_items("recall", 2, length=100, seed=4)
    tuples = [WHOLE, Tuple(0.25, 4, 4)]
    costs = _tiny_costs(tuples, 100)
    budget = 2 * costs[0][Tuple(0.25, 4, 4)]
    with pytest.raises(ConfigError, match="at least one start"):
        refine_route(model, items, costs, budget, [])
    with pytest.raises(ConfigError, match=r"starts\[0\] has 1 tuples; the model has 2 layers"):
        refine_route(model, items, costs, budget, [[WHOLE]])
    with pytest.raises(ConfigError, match=r"starts\[1\] takes \d+ bytes, over the budget"):
        refine_route(model, items, costs, budget, [[Tuple(0.25, 4, 4)] * 2, [WHOLE] * 2])
    with pytest.raises(ConfigError, match="rounds must be an int >= 0, got -1"):
        refine_route(model, items, costs, budget, [[Tuple(0.25, 4, 4)] * 2], rounds=-1)
