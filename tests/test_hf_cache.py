"""PagedCache against transformers' DynamicCache on tiny random Llama, Qwen2 and Mistral models.

Without token eviction a paged cache must be invisible: the same tokens and the same logits as
DynamicCache, for one prompt, a left-padded batch, beam search and chunked prefill; and the
pool must hold exactly the K/V the layers attend over, with beams sharing blocks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import SIZES, VOCAB, build  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    MistralConfig,
    MistralForCausalLM,
)

from kvevict.adapters.hf import PagedCache, inspect_model  # noqa: E402
from kvevict.errors import ConfigError, OutOfBlocks  # noqa: E402
from kvevict.pool import BlockPool  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}


def prompts(batch: int = 1, length: int = 11, pad: int = 0, seed: int = 1):
    """Token ids ``[batch, length]`` and their mask; the last row is left-padded by ``pad``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if pad:
        ids[-1, :pad], mask[-1, :pad] = 0, 0
    return ids, mask


def generate(model, cache, ids, mask, **options):
    if "max_length" not in options:
        options.setdefault("max_new_tokens", 8)
    return model.generate(ids, attention_mask=mask, cache=cache, do_sample=False,
                          return_dict_in_generate=True, output_logits=True, **options)


def assert_same_generation(ref, got) -> None:
    assert torch.equal(ref.sequences, got.sequences)
    assert len(ref.logits) == len(got.logits)
    for a, b in zip(ref.logits, got.logits):
        torch.testing.assert_close(a, b, **TOL)


def pool_keys(cache: PagedCache, pool_layer: int, row: int) -> torch.Tensor:
    """Keys ``[Hkv, S, D]`` of one row and pool layer, gathered from the pool's blocks."""
    kv = cache.pool.kv
    blocks = torch.tensor(cache.block_tables[row])
    return kv[pool_layer, 0, blocks].flatten(0, 1)[:cache.stored_length].transpose(0, 1)


def forward(model, ids, cache, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]


# -- equality with DynamicCache ----------------------------------------------------------------

MODES = {
    "single": (dict(batch=1), {}),
    "left-padded batch": (dict(batch=3, pad=4), {}),
    "beam search": (dict(batch=2, pad=3), dict(num_beams=3)),
    "chunked prefill": (dict(batch=2, pad=2), dict(prefill_chunk_size=4)),
}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_generate_matches_dynamic_cache(kind, mode):
    model = build(kind)
    shape, options = MODES[mode]
    ids, mask = prompts(**shape)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, **options)
    cache = PagedCache(model, block_size=4)
    got = generate(model, cache, ids, mask, **options)
    assert_same_generation(ref, got)
    if "num_beams" in options:
        torch.testing.assert_close(ref.sequences_scores, got.sequences_scores, **TOL)
    # the pool holds exactly what the full-attention layers attend over
    for pool_layer, layer in enumerate(cache._paged):
        for row in range(cache._batch):
            assert torch.equal(pool_keys(cache, pool_layer, row), layer.keys[row])


def test_deprecated_past_key_values_argument_works():
    model = build()
    ids, mask = prompts()
    ref = generate(model, DynamicCache(config=model.config), ids, mask)
    with pytest.warns(FutureWarning):
        got = model.generate(ids, attention_mask=mask, past_key_values=PagedCache(model),
                             max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    assert_same_generation(ref, got)


def test_special_layers_keep_their_transformers_class():
    model = build("qwen2")
    cache = PagedCache(model)
    assert [type(layer).__name__ for layer in cache.layers] == ["PagedLayer",
                                                               "DynamicSlidingWindowLayer"]
    assert cache.pool is None  # created at the first write
    forward(model, prompts()[0], cache)
    assert cache.pool.layout.num_layers == 1  # one pool layer per full-attention layer


# -- beams share blocks ------------------------------------------------------------------------


def test_beam_search_shares_prompt_blocks_instead_of_copying():
    model = build()
    ids, mask = prompts(batch=1, length=12)
    cache = PagedCache(model, block_size=4)
    out = generate(model, cache, ids, mask, num_beams=3)
    tables = cache.block_tables
    assert len(tables) == 3 and all(len(t) == 5 for t in tables)  # 12 + 7 fed = 19 slots
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # the prompt's blocks, shared
    pool = cache.pool
    assert pool.num_used == len({b for t in tables for b in t}) < 15
    for block in {b for t in tables for b in t}:
        assert pool.ref_count(block) == sum(t.count(block) for t in tables)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, num_beams=3)
    assert torch.equal(ref.sequences, out.sequences)


def test_reorder_copies_a_shared_block_only_when_it_is_written():
    model = build()
    ids, _ = prompts(batch=2, length=6)
    paged, dense = PagedCache(model, block_size=4), DynamicCache(config=model.config)
    torch.testing.assert_close(forward(model, ids, paged), forward(model, ids, dense), **TOL)
    beam_idx = torch.tensor([1, 1])
    paged.reorder_cache(beam_idx)
    dense.reorder_cache(beam_idx)
    first, second = paged.block_tables
    assert first == second and all(paged.pool.ref_count(b) == 2 for b in first)
    assert paged.pool.num_used == 2  # row 0's old blocks went back to the free list
    step = torch.tensor([[5], [7]])
    torch.testing.assert_close(forward(model, step, paged), forward(model, step, dense), **TOL)
    first, second = paged.block_tables
    assert first[0] == second[0] and paged.pool.ref_count(first[0]) == 2  # full, untouched
    assert first[1] != second[1]  # the written tail block was copied for one row
    assert paged.pool.num_used == 3
    for row in range(2):
        assert torch.equal(pool_keys(paged, 0, row), paged._paged[0].keys[row])


def test_repeat_interleave_and_select_indices_follow_dynamic_cache():
    model = build()
    ids, _ = prompts(batch=2, length=5)
    paged, dense = PagedCache(model, block_size=4), DynamicCache(config=model.config)
    forward(model, ids, paged), forward(model, ids, dense)
    for cache in (paged, dense):
        cache.batch_repeat_interleave(2)
    step = torch.tensor([[3], [4], [5], [6]])
    torch.testing.assert_close(forward(model, step, paged), forward(model, step, dense), **TOL)
    keep = torch.tensor([0, 3])
    for cache in (paged, dense):
        cache.batch_select_indices(keep)
    step = torch.tensor([[9], [10]])
    torch.testing.assert_close(forward(model, step, paged), forward(model, step, dense), **TOL)
    tables = paged.block_tables
    assert len(tables) == 2 and paged.pool.num_used == len({b for t in tables for b in t})
    assert paged.get_seq_length() == dense.get_seq_length() == 7


# -- crop, reset, pools ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_crop_rolls_back_exactly(kind):
    model = build(kind)
    ids, _ = prompts(length=9)
    cache = PagedCache(model, block_size=4)
    assert cache.is_croppable
    forward(model, ids, cache)
    extra = torch.tensor([[11, 12, 13]])
    before = forward(model, extra, cache)
    assert cache.get_seq_length() == 12 and cache.block_tables == [[0, 1, 2]]
    cache.crop(0)
    assert cache.get_seq_length() == 12
    cache.crop(-3)
    assert cache.get_seq_length() == 9 and cache.block_tables == [[0, 1, 2]]
    cache.crop(-2)
    assert cache.get_seq_length() == 7 and cache.block_tables == [[0, 1]]
    assert cache.pool.num_used == 2
    forward(model, ids[:, 7:], cache)
    torch.testing.assert_close(forward(model, extra, cache), before, **TOL)
    with pytest.raises(ConfigError, match="negative"):
        cache.crop(3)


def test_assisted_decoding_crops_rejected_candidates():
    """Prompt-lookup decoding verifies guessed tokens and crops the rejected ones."""
    model = build()
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]])
    options = dict(max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **options)
    cache = PagedCache(model, block_size=4)
    assert torch.equal(model.generate(ids, cache=cache, **options), ref)
    assert cache.get_seq_length() == ref.shape[1] - 1
    assert cache.pool.num_used == len(cache.block_tables[0]) == 6  # cropped blocks released


def test_reset_releases_every_block_of_a_shared_pool():
    model = build()
    spec = inspect_model(model)
    pool = BlockPool(32, 4, spec.layout(), device="cpu")
    ids, mask = prompts(batch=2, pad=1)
    first, second = PagedCache(model, pool=pool), PagedCache(model, pool=pool)
    out_first = generate(model, first, ids, mask)
    out_second = generate(model, second, ids, mask)
    assert torch.equal(out_first.sequences, out_second.sequences)
    assert pool.num_used == 2 * 2 * 5  # two caches, two rows, 11 + 7 = 18 slots each
    first.reset()
    assert pool.num_used == 10 and first.get_seq_length() == 0
    second.close()
    assert pool.num_free == pool.num_blocks
    again = generate(model, first, ids, mask)
    assert torch.equal(again.sequences, out_first.sequences)
    with pytest.raises(ConfigError, match="closed"):
        generate(model, second, ids, mask)


def test_private_pool_grows_when_full():
    model = build()
    ids, mask = prompts(length=4)
    cache = PagedCache(model, block_size=1)
    out = generate(model, cache, ids, mask, max_length=30)
    assert cache.pool.num_blocks == 32 and cache.pool.num_used == 29
    assert torch.equal(pool_keys(cache, 1, 0), cache._paged[1].keys[0])
    ref = generate(model, DynamicCache(config=model.config), ids, mask, max_length=30)
    assert torch.equal(out.sequences, ref.sequences)


def test_fixed_pool_too_small_raises_out_of_blocks_and_stays_usable():
    model = build()
    ids, mask = prompts(length=12)
    cache = PagedCache(model, num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocks, match="pool of 2 blocks"):
        generate(model, cache, ids, mask)
    assert cache.get_seq_length() == 0  # the failed forward was rolled back
    ids, mask = ids[:, :6], mask[:, :6]
    ref = generate(model, DynamicCache(config=model.config), ids, mask, max_new_tokens=2)
    got = generate(model, cache, ids, mask, max_new_tokens=2)
    assert_same_generation(ref, got)


def test_a_forward_that_raises_midway_is_rolled_back():
    model = build()
    ids, _ = prompts(length=6)
    cache, dense = PagedCache(model), DynamicCache(config=model.config)
    forward(model, ids, cache), forward(model, ids, dense)

    def explode(*_):
        raise RuntimeError("boom")

    handle = model.model.layers[1].register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom"):
        forward(model, torch.tensor([[7]]), cache)
    handle.remove()
    assert cache._paged[0].seen == 7  # layer 0 stored the token before layer 1 raised
    step = torch.tensor([[9]])
    torch.testing.assert_close(forward(model, step, cache), forward(model, step, dense), **TOL)
    assert cache.get_seq_length() == 7


def test_a_failed_forward_that_touched_a_sliding_layer_asks_for_reset():
    model = build("qwen2")
    cache = PagedCache(model)
    forward(model, prompts(length=5)[0], cache)

    def explode(*_):
        raise RuntimeError("boom")

    handle = model.model.norm.register_forward_pre_hook(explode)  # after every layer ran
    with pytest.raises(RuntimeError, match="boom"):
        forward(model, torch.tensor([[7]]), cache)
    handle.remove()
    with pytest.raises(ConfigError, match="cannot be rolled back: call reset"):
        forward(model, torch.tensor([[7]]), cache)
    cache.reset()
    ids, mask = prompts(length=5)
    ref = generate(model, DynamicCache(config=model.config), ids, mask)
    assert_same_generation(ref, generate(model, cache, ids, mask))


# -- bad input ----------------------------------------------------------------------------------


def test_all_sliding_window_model_is_rejected_with_the_fix():
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**SIZES))  # sliding_window=4096 on every layer
    with pytest.raises(ConfigError, match=r"no full_attention layer.*sliding_window=None"):
        PagedCache(model)


def test_unknown_layer_type_names_the_supported_ones():
    model = build("qwen2")
    model.config.layer_types = ["full_attention", "warp_attention"]
    with pytest.raises(ConfigError, match=r"warp_attention.*full_attention \(paged\).*"
                                          r"sliding_attention"):
        PagedCache(model)


def test_unsupported_models_are_rejected():
    with pytest.raises(ConfigError, match="PreTrainedModel"):
        PagedCache(torch.nn.Linear(2, 2))
    model = build()
    model.config.kv_lora_rank = 16
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        PagedCache(model)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ConfigError, match="encoder-decoder"):
        PagedCache(t5)


def test_wrong_dtypes_name_the_supported_ones():
    model = build().to(torch.float64)
    with pytest.raises(ConfigError, match=r"float32, torch\.float16, torch\.bfloat16"):
        PagedCache(model)
    model = build()
    spec = inspect_model(model)
    half_pool = BlockPool(8, 4, spec.layout(), device="cpu", dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"pool dtype is torch\.float16.*float32"):
        PagedCache(model, pool=half_pool)
    cache = PagedCache(model)
    model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"bfloat16 keys.*stores torch\.float32"):
        forward(model, prompts()[0], cache)


def test_bad_pools_and_arguments():
    model = build()
    spec = inspect_model(model)
    wrong = BlockPool(8, 4, inspect_model(build(num_key_value_heads=4)).layout(), device="cpu")
    with pytest.raises(ConfigError, match="pool layout does not match"):
        PagedCache(model, pool=wrong)
    with pytest.raises(ConfigError, match="metadata-only"):
        PagedCache(model, pool=BlockPool(8, 4, spec.layout(), storage=False))
    with pytest.raises(ConfigError, match="num_blocks"):
        PagedCache(model, pool=BlockPool(8, 4, spec.layout(), device="cpu"), num_blocks=8)
    with pytest.raises(ConfigError, match="block_size"):
        PagedCache(model, block_size=0)


def test_misuse_at_run_time():
    model = build()
    cache = PagedCache(model)
    ids, _ = prompts(batch=2)
    forward(model, ids, cache)
    with pytest.raises(ConfigError, match="holds 2 sequence"):
        forward(model, prompts(batch=3)[0], cache)
    other = build()
    with pytest.raises(ConfigError, match="built for"):  # a model without the hooks
        forward(other, ids, cache)
    PagedCache(other)  # now hooked
    with pytest.raises(ConfigError, match="built for another model"):
        forward(other, ids, cache)
    with pytest.raises(ConfigError, match="outside a forward"):
        cache.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8), 0)
