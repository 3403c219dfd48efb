"""The Llama-style engine model: paged attention over a BlockPool equals dense recompute."""

from __future__ import annotations

import pytest
import torch

from kvevict.engine import LlamaModel, ModelConfig
from kvevict.errors import ConfigError
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool

BLOCK = 4
TOL = {"atol": 1e-5, "rtol": 1e-5}


def tiny_config(**overrides) -> ModelConfig:
    params = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=64)
    params.update(overrides)
    return ModelConfig(**params)


def make_pool(config: ModelConfig, num_blocks: int = 32) -> BlockPool:
    return BlockPool(num_blocks, BLOCK, config.layout(), device="cpu")


def grow(pool: BlockPool, table: list[int], end: int) -> list[int]:
    """Allocate blocks onto ``table`` until it covers positions ``[0, end)``."""
    while len(table) * BLOCK < end:
        table.append(pool.allocate())
    return table


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=gen)


@pytest.fixture
def model() -> LlamaModel:
    return LlamaModel(tiny_config(), seed=0)


def test_config_layout_and_validation():
    cfg = tiny_config()
    assert cfg.layout() == KVLayout.gqa(2, 4, 2, 8, torch.float32)
    assert tiny_config(num_kv_heads=4).layout().attention == "mha"
    assert tiny_config(dtype=torch.bfloat16).layout().dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        tiny_config(num_kv_heads=3)
    with pytest.raises(ConfigError, match="even"):
        tiny_config(head_dim=7)
    with pytest.raises(ConfigError, match="hidden_size"):
        tiny_config(hidden_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        tiny_config(dtype=torch.int8)
    with pytest.raises(ConfigError, match="rms_eps"):
        tiny_config(rms_eps=-1.0)


def test_prefill_equals_dense(model):
    pool = make_pool(model.config)
    ids = tokens(11)
    table = grow(pool, [], 11)
    logits = model.forward_paged(pool, [(ids, 0, table)])
    dense = model.forward_dense(ids)
    assert logits.shape == (1, 97) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], dense[-1], **TOL)


def test_prefill_return_all_matches_every_position(model):
    pool = make_pool(model.config)
    ids = tokens(9)
    table = grow(pool, [], 9)
    (all_logits,) = model.forward_paged(pool, [(ids, 0, table)], return_all=True)
    torch.testing.assert_close(all_logits, model.forward_dense(ids), **TOL)


def test_chunked_prefill_then_greedy_decode(model):
    pool = make_pool(model.config)
    seq = tokens(13, seed=2)
    table: list[int] = []
    pos = 0
    for size in (3, 5, 13 - 8):
        chunk = seq[pos:pos + size]
        grow(pool, table, pos + size)
        logits = model.forward_paged(pool, [(chunk, pos, table)])
        pos += size
        torch.testing.assert_close(logits[0], model.forward_dense(seq[:pos])[-1], **TOL)
    for _ in range(4):
        nxt = int(logits[0].argmax())
        dense_prev = model.forward_dense(seq)[-1]
        assert nxt == int(dense_prev.argmax())
        seq = torch.cat([seq, torch.tensor([nxt])])
        grow(pool, table, pos + 1)
        logits = model.forward_paged(pool, [(seq[pos:pos + 1], pos, table)])
        pos += 1
        dense = model.forward_dense(seq)[-1]
        torch.testing.assert_close(logits[0], dense, **TOL)
        assert int(logits[0].argmax()) == int(dense.argmax())


def test_shared_prefix_reuses_blocks_without_touching_them(model):
    pool = make_pool(model.config)
    a = tokens(10, seed=3)
    table_a = grow(pool, [], 10)
    model.forward_paged(pool, [(a, 0, table_a)])
    shared = table_a[:2]
    before = [pool.block_bytes(b) for b in table_a]

    b = torch.cat([a[:8], tokens(6, seed=4)])
    table_b = list(shared)
    for blk in shared:
        pool.incref(blk)
    grow(pool, table_b, len(b))
    logits = model.forward_paged(pool, [(b[8:], 8, table_b)])
    torch.testing.assert_close(logits[0], model.forward_dense(b)[-1], **TOL)
    assert [pool.block_bytes(blk) for blk in table_a] == before
    assert not set(table_b[2:]) & set(table_a)


def test_batched_decode_of_different_lengths(model):
    pool = make_pool(model.config)
    seqs = [tokens(n, seed=10 + n) for n in (3, 8, 13)]
    tables = []
    for s in seqs:
        table = grow(pool, [], len(s) - 1)
        model.forward_paged(pool, [(s[:-1], 0, table)])
        tables.append(grow(pool, table, len(s)))
    batch = [(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)]
    logits = model.forward_paged(pool, batch)
    assert logits.shape == (3, 97)
    for i, s in enumerate(seqs):
        dense = model.forward_dense(s)[-1]
        torch.testing.assert_close(logits[i], dense, **TOL)
        assert int(logits[i].argmax()) == int(dense.argmax())


def test_mha_and_bfloat16_paged_match_dense():
    for cfg, tol in ((tiny_config(num_kv_heads=4), TOL),
                     (tiny_config(dtype=torch.bfloat16), {"atol": 2e-2, "rtol": 2e-2})):
        model = LlamaModel(cfg, seed=5)
        pool = make_pool(cfg)
        ids = tokens(10, seed=6)
        table = grow(pool, [], 10)
        model.forward_paged(pool, [(ids[:6], 0, table)])
        logits = model.forward_paged(pool, [(ids[6:], 6, table)])
        torch.testing.assert_close(logits[0], model.forward_dense(ids)[-1], **tol)


def test_seeded_determinism():
    ids = tokens(7)
    a = LlamaModel(tiny_config(), seed=1).forward_dense(ids)
    b = LlamaModel(tiny_config(), seed=1).forward_dense(ids)
    c = LlamaModel(tiny_config(), seed=2).forward_dense(ids)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_bad_pools_raise(model):
    ids = tokens(4)
    bf16 = BlockPool(8, BLOCK, model.config.layout(), device="cpu", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="dtype"):
        model.forward_paged(bf16, [(ids, 0, [bf16.allocate()])])
    other = BlockPool(8, BLOCK, KVLayout.gqa(2, 4, 1, 8, torch.float32), device="cpu")
    with pytest.raises(ConfigError, match="layout does not match"):
        model.forward_paged(other, [(ids, 0, [other.allocate()])])
    deeper = BlockPool(8, BLOCK, KVLayout.gqa(3, 4, 2, 8, torch.float32), device="cpu")
    with pytest.raises(ConfigError, match="layout does not match"):
        model.forward_paged(deeper, [(ids, 0, [deeper.allocate()])])
    with pytest.raises(ConfigError, match="metadata-only"):
        model.forward_paged(BlockPool(8, BLOCK), [(ids, 0, [0])])


def test_bad_inputs_raise_and_leave_pool_unchanged(model):
    pool = make_pool(model.config, num_blocks=8)
    table = grow(pool, [], 8)
    snapshot = pool.kv.clone()
    with pytest.raises(ConfigError, match="1-D"):
        model.forward_paged(pool, [(tokens(8).view(2, 4), 0, table)])
    with pytest.raises(ConfigError, match="1-D"):
        model.forward_dense(tokens(8).view(2, 4))
    with pytest.raises(ConfigError, match="integer dtype"):
        model.forward_dense(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"in \[0, 97\)"):
        model.forward_dense(torch.tensor([1, 97]))
    with pytest.raises(ConfigError, match="empty"):
        model.forward_dense(torch.zeros(0, dtype=torch.long))
    # The second entry is bad: nothing is written for the first one either.
    with pytest.raises(ConfigError, match="need 3"):
        model.forward_paged(pool, [(tokens(4), 0, table), (tokens(9), 0, table)])
    with pytest.raises(ConfigError, match="free"):
        model.forward_paged(pool, [(tokens(4), 0, [7])])
    with pytest.raises(ConfigError, match="repeats"):
        model.forward_paged(pool, [(tokens(8), 0, [table[0], table[0]])])
    with pytest.raises(ConfigError, match="start"):
        model.forward_paged(pool, [(tokens(2), -1, table)])
    assert torch.equal(pool.kv, snapshot)
