"""The Llama-style engine model: paged attention over a BlockPool equals dense recompute."""

from __future__ import annotations

import pytest
import torch

from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.model import RopeScaling
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


def test_mixed_batch_of_prefills_and_decodes_in_one_call(model):
    """Entries of any kind, in any order: each gets its own logits, equal to dense."""
    pool = make_pool(model.config, num_blocks=48)
    seqs = [tokens(n, seed=20 + n) for n in (9, 6, 14, 11)]
    tables = [grow(pool, [], len(s)) for s in seqs]
    # sequences 1 and 3 already have all but their last token in the pool
    for i in (1, 3):
        model.forward_paged(pool, [(seqs[i][:-1], 0, tables[i])])
    batch = [
        (seqs[0], 0, tables[0]),                         # full prefill
        (seqs[1][-1:], len(seqs[1]) - 1, tables[1]),     # decode
        (seqs[2][:5], 0, tables[2]),                     # first prefill chunk
        (seqs[3][-1:], len(seqs[3]) - 1, tables[3]),     # decode
    ]
    last = model.forward_paged(pool, batch)
    every = model.forward_paged(pool, batch, return_all=True)
    dense = [model.forward_dense(seqs[0]), model.forward_dense(seqs[1]),
             model.forward_dense(seqs[2][:5]), model.forward_dense(seqs[3])]
    assert [tuple(e.shape) for e in every] == [(9, 97), (1, 97), (5, 97), (1, 97)]
    for i in range(4):
        torch.testing.assert_close(last[i], dense[i][-1], **TOL)
        torch.testing.assert_close(every[i], dense[i][-every[i].shape[0]:], **TOL)
    # then the rest of the chunked sequence, after its cached first chunk
    logits = model.forward_paged(pool, [(seqs[2][5:], 5, tables[2])])
    torch.testing.assert_close(logits[0], model.forward_dense(seqs[2])[-1], **TOL)


@pytest.mark.parametrize("sliding_layers", [None, (1,)])
def test_sliding_window_paged_matches_dense(sliding_layers):
    cfg = tiny_config(sliding_window=6, sliding_layers=sliding_layers)
    model = LlamaModel(cfg, seed=3)
    assert [cfg.layer_window(i) for i in range(2)] == \
        ([6, 6] if sliding_layers is None else [None, 6])
    pool = make_pool(cfg, num_blocks=48)
    seqs = [tokens(n, seed=30 + n) for n in (5, 17, 26)]
    tables = []
    for s in seqs:  # prefill in chunks of 7: later chunks start past the window
        table: list[int] = []
        for pos in range(0, len(s) - 3, 7):
            chunk = s[pos:min(pos + 7, len(s) - 3)]
            grow(pool, table, pos + len(chunk))
            logits = model.forward_paged(pool, [(chunk, pos, table)])
            torch.testing.assert_close(logits[0], model.forward_dense(s[:pos + len(chunk)])[-1],
                                       **TOL)
        tables.append(table)
    for back in (3, 2, 1):  # batched decode of different lengths, windows in other blocks,
        batch = []          # then (back == 1) one sequence per call
        for s, table in zip(seqs, tables):
            pos = len(s) - back
            batch.append((s[pos:pos + 1], pos, grow(pool, table, pos + 1)))
        if back > 1:
            logits = model.forward_paged(pool, batch)
        else:
            logits = torch.cat([model.forward_paged(pool, [entry]) for entry in batch])
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], model.forward_dense(s[:len(s) - back + 1])[-1],
                                       **TOL)
    # the window really limits attention: a token outside it does not change the last logits
    ids = tokens(12, seed=40)
    other = ids.clone()
    other[0] = (other[0] + 1) % 97
    if sliding_layers is None:  # 2 layers x window 6 reach back 10 positions, not 11
        torch.testing.assert_close(model.forward_dense(ids)[-1], model.forward_dense(other)[-1])
    else:
        assert not torch.allclose(model.forward_dense(ids)[-1], model.forward_dense(other)[-1])


def test_biases_tied_embeddings_and_rope_scaling_paged_match_dense():
    cfg = tiny_config(qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=True,
                      rope_scaling=RopeScaling("llama3", 8.0, original_max_position_embeddings=8),
                      attention_scale=0.2)
    model = LlamaModel(cfg, seed=4)
    assert model.lm_head is model.embed
    assert "lm_head" not in model.weights() and "layers.1.b_down" in model.weights()
    pool = make_pool(cfg)
    ids = tokens(15, seed=41)
    table = grow(pool, [], 15)
    model.forward_paged(pool, [(ids[:9], 0, table)])
    logits = model.forward_paged(pool, [(ids[9:], 9, table)], return_all=True)[0]
    torch.testing.assert_close(logits, model.forward_dense(ids)[9:], **TOL)
    # every option changes the output
    plain = LlamaModel(tiny_config(), seed=4).forward_dense(ids)
    assert not torch.allclose(model.forward_dense(ids), plain, atol=1e-3)


def test_from_weights_round_trip_and_seeded_weights_unchanged():
    model = LlamaModel(tiny_config(), seed=7)
    copy = LlamaModel.from_weights(model.config, model.weights())
    ids = tokens(10, seed=42)
    assert torch.equal(copy.forward_dense(ids), model.forward_dense(ids))
    assert copy.seed is None and model.seed == 7
    # the fused q/k/v and gate/up matrices are exposed as views with the documented shapes
    layer = model.layers[0]
    assert layer["wq"].shape == (32, 32) and layer["wk"].shape == (16, 32)
    assert layer["w_gate"].shape == (64, 32) and layer["w_down"].shape == (32, 64)
    # random draws keep their order: the same seed gives the same weights as before biases
    gen = torch.Generator().manual_seed(7)
    first = torch.randn(97, 32, generator=gen) * 0.02
    assert torch.equal(model.embed, first)
    assert torch.equal(layer["wq"], torch.randn(32, 32, generator=gen) * 0.02)


def test_new_config_options_validate():
    with pytest.raises(ConfigError, match="sliding_layers is set but sliding_window is None"):
        tiny_config(sliding_layers=(0,))
    with pytest.raises(ConfigError, match="sliding_layers must be distinct"):
        tiny_config(sliding_window=4, sliding_layers=(0, 2))
    with pytest.raises(ConfigError, match="sliding_window"):
        tiny_config(sliding_window=0)
    with pytest.raises(ConfigError, match="qkv_bias must be a bool"):
        tiny_config(qkv_bias=1)
    with pytest.raises(ConfigError, match="'yarn' is not supported; supported: linear, llama3"):
        RopeScaling("yarn", 2.0)
    with pytest.raises(ConfigError, match="rope_scaling must be a RopeScaling"):
        tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="attention_scale"):
        tiny_config(attention_scale=-1.0)
    assert tiny_config(sliding_window=4, sliding_layers=[1]).sliding_layers == (1,)


def test_entries_sharing_blocks_in_one_call(model):
    """Two entries may write the same slots with the same tokens (a block the manager
    deduplicated), and an entry may read blocks another entry fills in the same call (each
    layer writes every entry's K/V before any entry attends)."""
    pool = make_pool(model.config)
    ids = tokens(11, seed=43)
    table = grow(pool, [], 11)
    twin = table[:2] + [pool.allocate()]  # shares the first two blocks
    logits = model.forward_paged(pool, [(ids[:8], 0, table), (ids[:8], 0, twin)])
    torch.testing.assert_close(logits[0], model.forward_dense(ids[:8])[-1], **TOL)
    torch.testing.assert_close(logits[1], logits[0], **TOL)
    pool.kv[:, :, table[:2]] = 0  # the reader can only be right with the fresh writes
    reader = model.forward_paged(pool, [(ids[:8], 0, table), (ids[8:], 8, twin)])
    torch.testing.assert_close(reader[1], model.forward_dense(ids)[-1], **TOL)


def test_decode_buckets_bound_padding_to_twice_the_real_work(monkeypatch):
    from kvevict.engine import model as model_mod

    buckets = model_mod._decode_buckets
    assert buckets([]) == []
    assert buckets([10, 100, 200, 256]) == [(0, 4)]  # all under the minimum: one call
    assert buckets([10, 300, 500, 600, 601, 2000]) == [(0, 1), (1, 4), (4, 5), (5, 6)]
    monkeypatch.setattr(model_mod, "DECODE_BUCKET_MIN_TOKENS", 1)
    assert buckets([2, 3, 4, 5, 9, 10, 11]) == [(0, 3), (3, 6), (6, 7)]
    for lengths in ([1, 2, 3, 4, 5, 6, 7, 8, 100], [3, 3, 3], [5, 11, 23, 47]):
        cut = buckets(lengths)
        assert cut[0][0] == 0 and cut[-1][1] == len(lengths)
        assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
        assert all(lengths[hi - 1] <= 2 * lengths[lo] for lo, hi in cut)


@pytest.mark.parametrize("window", [None, 6])
def test_bucketed_batched_decode_matches_dense(monkeypatch, window):
    """Decode entries given out of length order, split into several buckets, each row's logits
    equal the dense recompute (and come back in the caller's order)."""
    from kvevict.engine import model as model_mod

    monkeypatch.setattr(model_mod, "DECODE_BUCKET_MIN_TOKENS", 1)
    model = LlamaModel(tiny_config(sliding_window=window), seed=5)
    pool = make_pool(model.config, num_blocks=64)
    seqs = [tokens(n, seed=50 + n) for n in (13, 3, 30, 8, 2, 17)]
    batch = []
    for s in seqs:
        table = grow(pool, [], len(s) - 1)
        model.forward_paged(pool, [(s[:-1], 0, table)])
        batch.append((s[-1:], len(s) - 1, grow(pool, table, len(s))))
    assert len(model_mod._decode_buckets(sorted(len(s) for s in seqs))) > 2
    logits = model.forward_paged(pool, batch)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(logits[i], model.forward_dense(s)[-1], **TOL)
