"""MoE-nD through `make_token_policy` (``moe_nd``): per-layer counts and bit widths in
`PagedCache` (``generate()``) and the engine.

- Each layer keeps its routed share of the budget (exact counts on a hand-checked case).
- `store_kv` is quantize-then-dequantize per token, within each bit width's bound, and it is
  what the cache stores; a forward attends to its own tokens as computed and to earlier ones
  as stored (HF and the engine); `packed_bytes` counts codes and scales.
- Unquantized at a budget at or above the sequence length: `DynamicCache`'s greedy tokens, in
  ``generate()`` and the engine.
- HF and the engine keep the same positions per layer and generate the same tokens with
  quantized, uneven layers (a random tiny model and the shipped judge).
- Bad routings, budgets and inner policies are `ConfigError`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import build
from test_tokens_heads_paged import (
    NEW,
    ONE_CHUNK,
    PROMPT,
    engine_positions,
    peaked,
    per_head_positions,
    prompt_ids,
)

from kvevict.adapters.hf import PagedCache
from kvevict.engine import run_engine
from kvevict.engine.hf import from_hf
from kvevict.errors import ConfigError
from kvevict.tokens import MoEND, ScorerShape, make_token_policy
from kvevict.tokens.quant import dequant_error_bound, kv_bytes, quantize
from kvevict.types import Request

UNEVEN = [(1.0, 8, 4), (0.5, 4, 2)]  # layer 0 keeps twice layer 1's tokens


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return peaked(build("llama"))


def test_each_layer_keeps_its_routed_share_of_the_budget():
    moe = make_token_policy("moe_nd", budget=9, routing=UNEVEN)
    # 9 x 2 layers = 18 slots in proportion 1 : 0.5 -> 12 and 6, every head alike
    assert moe.layer_counts(37) == [12, 6]
    assert moe.head_counts(0, 37, 2) == [12, 12] and moe.head_counts(1, 37, 2) == [6, 6]
    assert moe.layer_counts(7) == [7, 7]  # under the budget: everything
    # ratios of the context: budget = mean ratio x C keeps ratio x C per layer
    routed = make_token_policy("moe_nd", budget=75, routing=[(0.1, 4, 4), (0.2, 4, 4)])
    assert routed.layer_counts(500) == [50, 100]


def test_store_kv_is_per_token_fake_quantization_within_the_bound():
    moe = MoEND(4, routing=UNEVEN)
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    for layer, (_, kb, vb) in enumerate(UNEVEN):
        k, v = moe.store_kv(layer, keys, values)
        for got, x, bits in ((k, keys, kb), (v, values, vb)):
            q = quantize(x, bits, axis="token")
            assert torch.equal(got, q.dequantize(x.dtype))
            assert bool(((got - x).abs() <= dequant_error_bound(q, x.dtype)).all())
            assert not torch.equal(got, x)
        # per token: a token's stored K/V do not depend on the others
        k1, _ = moe.store_kv(layer, keys[:, :, 2:3], values[:, :, 2:3])
        assert torch.equal(k1, k[:, :, 2:3])
    plain = MoEND(4, routing=[(0.5, None, None)] * 2)
    assert plain.store_kv(0, keys, values) == (keys, values)


def test_the_cache_stores_what_store_kv_returns(tiny):
    ids = prompt_ids()
    moe = make_token_policy("moe_nd", budget=PROMPT, routing=UNEVEN)
    cache = PagedCache(tiny, token_policy=moe)
    full = PagedCache(tiny)
    with torch.no_grad():
        tiny(input_ids=ids[None, :5], cache=full, use_cache=True)
        tiny(input_ids=ids[None, :5], cache=cache, use_cache=True)
    # one forward attends to its own tokens as computed, so every layer's inputs are the
    # model's own, and every layer stores what store_kv makes of the unquantized K/V
    for got, plain in zip(cache.layers, full.layers, strict=True):
        want_k, want_v = moe.store_kv(got.layer_idx, plain.keys, plain.values)
        assert torch.allclose(got.keys, want_k, atol=1e-6)
        assert torch.allclose(got.values, want_v, atol=1e-6)
        assert not torch.equal(got.keys, plain.keys)


def test_packed_bytes_counts_codes_and_scales_per_layer():
    moe = make_token_policy("moe_nd", budget=75, routing=[(0.1, 4, 2), (0.2, None, 8)])
    # layer 0: 50 tokens, 4-bit keys and 2-bit values; layer 1: 100 tokens, float32 keys
    want = (kv_bytes((2, 32, torch.float32), 50, 4, 2, key_axis="token", value_axis="token")
            + kv_bytes((2, 32, torch.float32), 100, None, 8, key_axis="token",
                       value_axis="token"))
    assert moe.packed_bytes(500, 2, 32, torch.float32) == want
    # by hand: 4-bit keys of 50 tokens x 2 heads x 32 channels = 1600 bytes of codes, 2-bit
    # values 800, float32 keys of 100 tokens 25600, 8-bit values 6400; 4 bytes of scale and
    # zero per token and head and quantized plane: (100 + 100 + 200) x 4
    assert want == 1600 + 800 + 25600 + 6400 + 400 * 4


@pytest.mark.parametrize("where", ["hf", "engine"])
def test_unquantized_at_full_budget_is_dynamic_cache(tiny, where):
    ids = prompt_ids()
    routing = [(1.0, None, None), (0.5, None, None)]
    with torch.no_grad():
        want = tiny.generate(ids[None], do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)[0, PROMPT:].tolist()
    if where == "hf":
        cache = PagedCache(tiny, token_policy=make_token_policy(
            "moe_nd", budget=PROMPT + NEW, routing=routing))
        with torch.no_grad():
            got = tiny.generate(ids[None], cache=cache, do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW)[0, PROMPT:].tolist()
    else:
        got = list(run_engine([Request("a", tokens=ids.numpy(), output_len=NEW)],
                              from_hf(tiny), capacity_blocks=64, block_size=4, check=True,
                              config=ONE_CHUNK, token_policy="moe_nd",
                              token_budget=PROMPT + NEW,
                              token_params={"routing": routing}).answers["a"])
    assert got == want


def test_engine_keeps_the_layers_positions_and_tokens_of_paged_cache(tiny):
    ids = prompt_ids()
    cache = PagedCache(tiny, token_policy=make_token_policy("moe_nd", budget=9,
                                                            routing=UNEVEN))
    with torch.no_grad():
        out = tiny.generate(ids[None], cache=cache, do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW)
        full = tiny.generate(ids[None], do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)
    want = per_head_positions(cache)
    result = run_engine([Request("a", tokens=ids.numpy(), output_len=NEW)], from_hf(tiny),
                        capacity_blocks=64, block_size=4, check=True, config=ONE_CHUNK,
                        token_policy="moe_nd", token_budget=9,
                        token_params={"routing": UNEVEN})
    assert engine_positions(result) == want
    assert list(result.answers["a"]) == out[0, PROMPT:].tolist()
    assert [[len(h) for h in layer] for layer in want] == [[12, 12], [6, 6]]
    assert want[0][0] == want[0][1]  # every head of a layer keeps the same tokens
    assert not torch.equal(out, full)  # and it changed the answer


def top_logit(model, chunks: list[torch.Tensor], policy) -> float:
    """The top-1 logit after the last of ``chunks`` fed in turn through a `PagedCache`."""
    cache = PagedCache(model, token_policy=policy)
    with torch.no_grad():
        for chunk in chunks:
            logits = model(input_ids=chunk[None], cache=cache, use_cache=True).logits
    return float(logits[0, -1].max())


def test_a_prefix_hit_reads_the_stored_kv_and_a_forward_its_own_as_computed(tiny):
    """Within the budget a request is cached. Its prefill attends to its own tokens as
    computed (its first logit is PagedCache's over the prompt in one forward); a later request
    with the same prompt hits every block, and its last token (a peek) reads the prompt as
    stored, quantized (PagedCache's over the prompt less its last token, then that token)."""
    ids = prompt_ids(16)
    requests = [Request("first", tokens=ids.numpy(), output_len=3),
                Request("again", tokens=ids.numpy(), output_len=3, arrival=1e3)]
    result = run_engine(requests, from_hf(tiny), capacity_blocks=64, block_size=4, check=True,
                        config=ONE_CHUNK, token_policy="moe_nd", token_budget=64,
                        token_params={"routing": UNEVEN})
    assert [r.cached_tokens for r in result.sim.records] == [0, 16]

    def policy():
        return make_token_policy("moe_nd", budget=64, routing=UNEVEN)

    whole = top_logit(tiny, [ids], policy())
    split = top_logit(tiny, [ids[:-1], ids[-1:]], policy())
    assert abs(whole - split) > 1e-4  # reading the stored prompt changes the logits
    assert result.top_logits["first"][0] == pytest.approx(whole, abs=1e-5)
    assert result.top_logits["again"][0] == pytest.approx(split, abs=1e-5)


def test_the_judge_keeps_the_same_layers_in_hf_and_the_engine():
    """A routing on the shipped judge at 15% of a 1,024-token context on average (layers at
    10, 10, 20 and 20%, 4 and 8 bits): the same positions and tokens in both."""
    from kvevict.judge import load_judge
    from kvevict.tokens.tasks import make_items

    torch.set_num_threads(1)
    judge = load_judge()
    routing = [(0.1, 4, 4), (0.1, 8, 4), (0.2, 8, 8), (0.2, 4, 8)]
    item = make_items("recall", 1, length=1024, seed=0)[0]
    ids = torch.tensor(item.prompt)
    budget, new = 154, len(item.answer)
    cache = PagedCache(judge, token_policy=make_token_policy("moe_nd", budget=budget,
                                                             routing=routing))
    with torch.no_grad():
        out = judge.generate(ids[None], attention_mask=torch.ones_like(ids)[None], cache=cache,
                             do_sample=False, max_new_tokens=new)
    want = per_head_positions(cache)
    from kvevict.scheduler import SchedulerConfig

    result = run_engine([Request("a", tokens=ids.numpy(), output_len=new)], from_hf(judge),
                        capacity_blocks=80, block_size=16, check=True,
                        config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=1),
                        token_policy="moe_nd", token_budget=budget,
                        token_params={"routing": routing})
    assert engine_positions(result) == want
    assert list(result.answers["a"]) == out[0, len(ids):].tolist()
    assert [len(layer[0]) for layer in want] == [103, 103, 205, 205]  # 616 = 154 x 4


def test_bad_routings_budgets_and_inner_policies_are_config_errors():
    with pytest.raises(ConfigError, match="routing="):
        make_token_policy("moe_nd", budget=4)
    with pytest.raises(ConfigError, match="key_bits must be one of 2, 4, 8"):
        make_token_policy("moe_nd", budget=4, routing=[(0.5, 3, 4)])
    with pytest.raises(ConfigError, match="value_bits must be one of 2, 4, 8"):
        make_token_policy("moe_nd", budget=4, routing=[(0.5, 4, 16)])
    for ratio in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"keep_ratio .* must be a number in \(0, 1\]"):
            make_token_policy("moe_nd", budget=4, routing=[(ratio, 4, 4)])
    with pytest.raises(ConfigError, match="budget"):
        make_token_policy("moe_nd", budget=0, routing=[(0.5, 4, 4)])
    with pytest.raises(ConfigError, match="2 tuples but the model has 4 layers"):
        make_token_policy("moe_nd", budget=4, routing=UNEVEN, shape=ScorerShape(4, 2, 32, 32))
    with pytest.raises(ConfigError, match="needs no attention matrix"):
        make_token_policy("moe_nd", budget=4, routing=UNEVEN, inner="h2o")
    with pytest.raises(ConfigError, match="needs no attention matrix"):
        make_token_policy("moe_nd", budget=4, routing=UNEVEN,
                          inner=make_token_policy("ema_heads", budget=4))
    with pytest.raises(ConfigError, match="routing has 2 layers"):
        make_token_policy("moe_nd", budget=4, routing=UNEVEN).head_counts(2, 10, 2)
