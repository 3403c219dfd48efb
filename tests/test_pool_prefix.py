"""BlockPool (allocation, ref counts, KV storage), chained block hashing and the PrefixTree."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvevict.errors import ConfigError, OutOfBlocks
from kvevict.layout import KVLayout
from kvevict.pool import BlockPool
from kvevict.prefix import ROOT_HASH, PrefixTree, block_hashes, hash_block
from kvevict.types import BlockInfo

REPO = Path(__file__).resolve().parents[1]

GQA = KVLayout.gqa(num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=8,
                   dtype="float32")
MLA = KVLayout.mla(num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2, dtype="float32")


# -- BlockPool: allocation and ref counts ------------------------------------------------------


def test_allocate_hands_out_block_zero_first_then_in_order():
    pool = BlockPool(4, 16)
    assert [pool.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert (pool.num_free, pool.num_used) == (0, 4)
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 1]


def test_freed_block_is_the_next_one_allocated():
    pool = BlockPool(4, 16)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.decref(b) == 0
    pool.free(b)
    assert not pool.is_used(b)
    assert (pool.num_free, pool.num_used) == (2, 2)
    assert pool.allocate() == b
    assert pool.allocate() == 3
    assert (a, c) == (0, 2)


def test_incref_decref_return_new_counts():
    pool = BlockPool(2, 4)
    b = pool.allocate()
    assert pool.incref(b) == 2
    assert pool.incref(b) == 3
    assert pool.decref(b) == 2
    assert pool.ref_count(b) == 2
    assert pool.decref(b) == 1
    assert pool.decref(b) == 0
    assert pool.is_used(b)  # decref never frees
    assert pool.num_free == 1


def test_decref_at_zero_is_an_error():
    pool = BlockPool(2, 4)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(ConfigError, match="block 0 has ref count 0; cannot release it again"):
        pool.decref(b)
    assert pool.ref_count(b) == 0


def test_free_with_references_is_an_error():
    pool = BlockPool(2, 4)
    b = pool.allocate()
    with pytest.raises(ConfigError, match="cannot free block 0: ref count is 1, expected 0"):
        pool.free(b)
    assert pool.is_used(b) and pool.num_free == 1


def test_free_of_a_free_block_is_an_error():
    pool = BlockPool(2, 4)
    b = pool.allocate()
    pool.decref(b)
    pool.free(b)
    with pytest.raises(ConfigError, match="block 0 is free; it was never allocated or was freed"):
        pool.free(b)
    with pytest.raises(ConfigError, match="block 1 is free"):
        pool.incref(1)
    with pytest.raises(ConfigError, match="block 1 is free"):
        pool.decref(1)
    assert pool.num_free == 2  # not on the free list twice
    assert [pool.allocate(), pool.allocate()] == [0, 1]


@pytest.mark.parametrize("bad", [-1, 3, True, 1.0, "0", None])
def test_bad_block_ids_are_rejected(bad):
    pool = BlockPool(3, 4)
    pool.allocate()
    for call in (pool.incref, pool.decref, pool.free, pool.ref_count, pool.is_used):
        with pytest.raises(ConfigError, match=r"block id must be an int in \[0, 3\), got"):
            call(bad)
    assert pool.ref_count(0) == 1


def test_out_of_blocks_when_empty():
    pool = BlockPool(2, 4)
    pool.allocate()
    pool.allocate()
    with pytest.raises(OutOfBlocks, match="all 2 blocks are in use") as info:
        pool.allocate()
    assert (info.value.needed, info.value.available) == (1, 0)
    assert (pool.num_free, pool.num_used) == (0, 2)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0, "block_size": 4}, "num_blocks must be a positive int, got 0"),
    ({"num_blocks": -3, "block_size": 4}, "num_blocks must be a positive int, got -3"),
    ({"num_blocks": 2.0, "block_size": 4}, "num_blocks must be a positive int, got 2.0"),
    ({"num_blocks": True, "block_size": 4}, "num_blocks must be a positive int, got True"),
    ({"num_blocks": 4, "block_size": 0}, "block_size must be a positive int, got 0"),
    ({"num_blocks": 4, "block_size": -16}, "block_size must be a positive int, got -16"),
])
def test_non_positive_sizes_are_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BlockPool(**kwargs)


def test_layout_must_be_a_kvlayout():
    with pytest.raises(ConfigError, match="layout must be a KVLayout, got dict"):
        BlockPool(4, 4, {"num_layers": 2})


def test_tensor_options_without_a_layout_are_rejected():
    with pytest.raises(ConfigError, match="a pool with a tensor needs a layout="):
        BlockPool(4, 4, device="cpu")


# -- BlockPool: metadata-only mode -------------------------------------------------------------


def test_metadata_only_without_layout_has_no_tensor_and_zero_bytes():
    pool = BlockPool(4, 16)
    assert pool.kv is None
    assert pool.bytes_per_block == 0
    b = pool.allocate()
    with pytest.raises(ConfigError, match="metadata-only"):
        pool.read(b, 0)
    with pytest.raises(ConfigError, match="holds no KV tensor"):
        pool.write(b, 0, torch.zeros(1, 2, 8))


def test_metadata_only_with_layout_sizes_blocks_exactly():
    pool = BlockPool(3, 4, GQA, storage=False)
    assert pool.kv is None
    # 2 layers * 2 planes * 2 heads * 8 dims * 4 tokens * 4 bytes
    assert pool.bytes_per_block == 1024 == GQA.bytes_per_block(4)
    assert BlockPool(3, 4, MLA, storage=False).bytes_per_block == 2 * 1 * 1 * 8 * 4 * 4
    half = BlockPool(3, 4, GQA, storage=False, dtype=torch.float16)
    assert half.bytes_per_block == 512


# -- BlockPool: tensor mode --------------------------------------------------------------------


def test_gqa_tensor_shape_and_bytes():
    pool = BlockPool(3, 4, GQA, device="cpu")
    assert tuple(pool.kv.shape) == (2, 2, 3, 4, 2, 8)
    assert pool.kv.dtype == torch.float32
    assert pool.kv.device == torch.device("cpu")
    assert pool.kv.numel() * pool.kv.element_size() == 3 * pool.bytes_per_block == 3 * 1024


def test_gqa_write_read_round_trip():
    pool = BlockPool(3, 4, GQA, device="cpu")
    b0, b1 = pool.allocate(), pool.allocate()
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(2, 2, 8, generator=gen)
    value = torch.randn(2, 2, 8, generator=gen)
    pool.write(b1, 1, key, value, start=1)
    k, v = pool.read(b1, 1)
    assert k.shape == (4, 2, 8) and v.shape == (4, 2, 8)
    assert torch.equal(k[1:3], key) and torch.equal(v[1:3], value)
    assert torch.count_nonzero(k[0]) == 0 and torch.count_nonzero(k[3]) == 0
    assert torch.count_nonzero(v[0]) == 0 and torch.count_nonzero(v[3]) == 0
    # other layer and other block untouched
    k0, v0 = pool.read(b1, 0)
    assert torch.count_nonzero(k0) == 0 and torch.count_nonzero(v0) == 0
    assert torch.count_nonzero(pool.kv[:, :, b0]) == 0
    # exactly 2 tokens * 2 planes * 2 heads * 8 dims were written
    assert torch.count_nonzero(pool.kv) == torch.count_nonzero(key) + torch.count_nonzero(value)
    # read returns views of the pool
    k[0].fill_(7.0)
    assert torch.all(pool.kv[1, 0, b1, 0] == 7.0)
    raw = pool.block_bytes(b1)
    assert len(raw) == pool.bytes_per_block
    assert raw == pool.kv[:, :, b1].contiguous().view(torch.uint8).numpy().tobytes()


def test_mla_write_read_round_trip():
    pool = BlockPool(2, 4, MLA, device="cpu")
    assert tuple(pool.kv.shape) == (2, 1, 2, 4, 1, 8)
    b = pool.allocate()
    latent = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 1, 8) + 1
    pool.write(b, 0, latent)
    k, v = pool.read(b, 0)
    assert v is None
    assert torch.equal(k, latent)
    assert torch.count_nonzero(pool.read(b, 1)[0]) == 0


def _pool_with_block():
    pool = BlockPool(2, 4, GQA, device="cpu")
    return pool, pool.allocate()


@pytest.mark.parametrize("key_shape, value_shape, match", [
    ((2, 2, 8), (3, 2, 8), r"key and value shapes differ: \(2, 2, 8\) vs \(3, 2, 8\)"),
    ((2, 4, 8), (2, 4, 8), r"key shape is \(2, 4, 8\), expected \[n, 2, 8\]"),
    ((2, 2, 8), (2, 2, 4), r"value shape is \(2, 2, 4\), expected \[n, 2, 8\]"),
    ((16,), (16,), r"key shape is \(16,\), expected \[n, 2, 8\]"),
])
def test_write_rejects_mismatched_shapes(key_shape, value_shape, match):
    pool, b = _pool_with_block()
    with pytest.raises(ConfigError, match=match):
        pool.write(b, 0, torch.ones(key_shape), torch.ones(value_shape))
    assert torch.count_nonzero(pool.kv) == 0  # nothing half-written


def test_write_rejects_wrong_dtype():
    pool, b = _pool_with_block()
    with pytest.raises(ConfigError,
                       match=r"value dtype is torch\.float16, expected the pool's torch\.float32"):
        pool.write(b, 0, torch.ones(1, 2, 8), torch.ones(1, 2, 8, dtype=torch.float16))
    with pytest.raises(ConfigError, match=r"key must be a torch\.Tensor, got ndarray"):
        pool.write(b, 0, np.ones((1, 2, 8), dtype=np.float32), torch.ones(1, 2, 8))
    assert torch.count_nonzero(pool.kv) == 0


def test_write_needs_value_for_two_planes():
    pool, b = _pool_with_block()
    with pytest.raises(ConfigError, match="this pool stores K and V; pass both key and value"):
        pool.write(b, 0, torch.ones(1, 2, 8))
    assert torch.count_nonzero(pool.kv) == 0


def test_write_rejects_value_for_mla():
    pool = BlockPool(2, 4, MLA, device="cpu")
    b = pool.allocate()
    with pytest.raises(ConfigError, match=r"an MLA pool has one plane .*pass value=None"):
        pool.write(b, 0, torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    assert torch.count_nonzero(pool.kv) == 0


@pytest.mark.parametrize("start, n, match", [
    (3, 2, r"tokens \[3, 5\) do not fit a block of 4 slots"),
    (0, 5, r"tokens \[0, 5\) do not fit a block of 4 slots"),
    (-1, 1, r"tokens \[-1, 0\) do not fit a block of 4 slots"),
])
def test_write_beyond_the_block_is_rejected(start, n, match):
    pool, b = _pool_with_block()
    with pytest.raises(ConfigError, match=match):
        pool.write(b, 0, torch.ones(n, 2, 8), torch.ones(n, 2, 8), start=start)
    assert torch.count_nonzero(pool.kv) == 0


def test_write_and_read_check_block_and_layer():
    pool, b = _pool_with_block()
    with pytest.raises(ConfigError, match=r"layer must be an int in \[0, 2\), got 2"):
        pool.write(b, 2, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    with pytest.raises(ConfigError, match=r"layer must be an int in \[0, 2\), got -1"):
        pool.read(b, -1)
    with pytest.raises(ConfigError, match="block 1 is free"):
        pool.write(1, 0, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    with pytest.raises(ConfigError, match="block 1 is free"):
        pool.read(1, 0)


# -- hashing -----------------------------------------------------------------------------------

#: Golden values: a change of hash function (or of its byte encoding) must fail these.
GOLDEN_1234 = 63313377624295042360169306713299003085
GOLDEN_CHAIN_M = [30688003034040476818596669314782940711,
                  254083380269296018889538172253950247283]
GOLDEN_TUPLE_KEY = 241721495641296011684807625357685585340


def test_hash_block_golden_values():
    assert hash_block(0, [1, 2, 3, 4]) == GOLDEN_1234
    assert hash_block(ROOT_HASH, np.array([1, 2, 3, 4], dtype=np.int32)) == GOLDEN_1234
    assert hash_block(0, torch.tensor([1, 2, 3, 4])) == GOLDEN_1234
    assert block_hashes(list(range(1, 9)), 4, "m") == GOLDEN_CHAIN_M
    assert hash_block(0, [1, 2, 3, 4], ("m", 1, b"x", None, True)) == GOLDEN_TUPLE_KEY


def test_hash_block_matches_the_documented_formula():
    """BLAKE2b-128(parent as 16 LE bytes || int64-LE token ids || encoded extra key)."""

    def reference(parent, tokens, extra):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent.to_bytes(16, "little"))
        h.update(np.asarray(tokens, dtype="<i8").tobytes())
        h.update(extra)
        return int.from_bytes(h.digest(), "little")

    assert hash_block(0, [1, 2, 3, 4]) == reference(0, [1, 2, 3, 4], b"N")
    assert hash_block(5, [9], "m") == reference(5, [9], b"S1:m")
    assert hash_block(5, [9], 7) == reference(5, [9], b"I7")
    first = reference(0, [1, 2, 3, 4], b"S1:m")
    assert GOLDEN_CHAIN_M == [first, reference(first, [5, 6, 7, 8], b"S1:m")]
    assert 0 <= GOLDEN_1234 < 2**128


def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    # Import kvevict.prefix without the package __init__ (which loads torch): keeps this fast.
    code = ("import sys, types; pkg = types.ModuleType('kvevict'); "
            f"pkg.__path__ = [{str(REPO / 'kvevict')!r}]; sys.modules['kvevict'] = pkg; "
            "from kvevict.prefix import hash_block, block_hashes; "
            "print(hash_block(0, [1, 2, 3, 4], ('m', 1, b'x', None, True))); "
            "print(block_hashes(list(range(1, 9)), 4, 'm')); "
            "print(hash('m'))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    lines = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True, timeout=60).stdout.splitlines()
    assert int(lines[0]) == GOLDEN_TUPLE_KEY
    assert lines[1] == repr(GOLDEN_CHAIN_M)
    assert int(lines[2]) != hash("m") or os.environ.get("PYTHONHASHSEED") == "12345"


def test_block_hashes_chain_is_hash_block_applied_in_turn():
    tokens = list(range(100, 111))  # 2 full blocks of 4 and a partial one of 3
    hashes = block_hashes(tokens, 4, "model-a")
    h0 = hash_block(ROOT_HASH, tokens[0:4], "model-a")
    h1 = hash_block(h0, tokens[4:8], "model-a")
    assert hashes == [h0, h1]
    assert block_hashes(tokens, 4, "model-a", parent_hash=h0) == [
        hash_block(h0, tokens[0:4], "model-a"),
        hash_block(hash_block(h0, tokens[0:4], "model-a"), tokens[4:8], "model-a")]


def test_same_tokens_under_another_parent_hash_differently():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens 5..8, different parent
    assert hash_block(a[0], [5, 6, 7, 8]) == a[1]
    assert hash_block(b[0], [5, 6, 7, 8]) == b[1]


def test_extra_key_separates_caches():
    tokens = [1, 2, 3, 4]
    keys = [None, "m", "n", 0, 1, b"m", ("m",), ("m", 1), True]
    hashes = [hash_block(0, tokens, k) for k in keys]
    assert len(set(hashes)) == len(keys)
    assert hash_block(0, tokens, None) == GOLDEN_1234
    # str and bytes with the same characters are different keys
    assert hash_block(0, tokens, "m") != hash_block(0, tokens, b"m")


def test_bad_extra_key_is_rejected():
    with pytest.raises(ConfigError, match="extra_key must be None, int, str, bytes or a tuple"):
        hash_block(0, [1], 1.5)
    with pytest.raises(ConfigError, match="got list"):
        block_hashes([1, 2], 1, ["m"])


def test_trailing_partial_block_has_no_hash():
    assert block_hashes([1, 2, 3], 4) == []
    assert len(block_hashes(list(range(7)), 4)) == 1
    assert len(block_hashes(list(range(8)), 4)) == 2
    assert block_hashes(list(range(7)), 4) == block_hashes(list(range(4)), 4)
    assert block_hashes([], 4) == []


@pytest.mark.parametrize("tokens, match", [
    ([[1, 2], [3, 4]], r"1-D sequence of integer token ids, got an array of shape \(2, 2\)"),
    ([1.0, 2.0], "must hold integer token ids, got dtype float64"),
    (np.array([1, 2], dtype=np.float32), "must hold integer token ids, got dtype float32"),
    ([True, False], "must hold integer token ids, got dtype bool"),
    ([1, -2, 3], "must be non-negative token ids, got -2"),
    (5, r"1-D sequence of integer token ids, got an array of shape \(\)"),
])
def test_bad_tokens_are_rejected(tokens, match):
    with pytest.raises(ConfigError, match=match):
        hash_block(0, tokens)
    with pytest.raises(ConfigError, match=match):
        block_hashes(tokens, 1)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, None])
def test_block_hashes_rejects_bad_block_size(bad):
    with pytest.raises(ConfigError, match="block_size must be a positive int"):
        block_hashes([1, 2, 3, 4], bad)


@pytest.mark.parametrize("parent", [-1, 2**128])
def test_hash_block_rejects_a_parent_hash_out_of_range(parent):
    with pytest.raises(ConfigError, match="parent"):
        hash_block(parent, [1, 2, 3, 4])


# -- PrefixTree --------------------------------------------------------------------------------


def _info(block_id, block_hash, parent, depth, parent_record=None):
    block = BlockInfo(block_id, block_hash, parent, depth, None, 0, "chat", "s", 0.0, block_id,
                      None, parent=parent_record)
    block.ref_count = 1  # cached while its sequence holds it
    return block


def _chain_tree():
    """root -> a -> b, and a -> c (block ids 0, 1, 2), all held (ref 1)."""
    tree = PrefixTree()
    a = _info(0, 11, ROOT_HASH, 0)
    b, c = _info(1, 22, 11, 1, a), _info(2, 33, 11, 1, a)
    for block in (a, b, c):
        tree.insert(block)
    return tree, a, b, c


def _release(tree, blocks):
    """What the manager does when a sequence drops its last reference to ``blocks``."""
    for block in blocks:
        block.ref_count -= 1
    return tree.unreferenced([b for b in blocks if not b.ref_count])


def test_insert_counts_children():
    tree, a, b, c = _chain_tree()
    assert len(tree) == 3
    assert (a.num_children, b.num_children, c.num_children) == (2, 0, 0)
    assert 11 in tree and 44 not in tree
    assert tree.get(22) is b and tree.get(44) is None
    assert [blk.block_id for blk in tree] == [0, 1, 2]
    assert tree.num_evictable == 0 and dict(tree.candidates) == {}
    assert not PrefixTree.is_candidate(b)  # held
    b.ref_count = 0
    assert PrefixTree.is_candidate(b) and not PrefixTree.is_candidate(a)


def test_release_reports_the_leaves_that_became_candidates_in_order():
    tree, a, b, c = _chain_tree()
    assert _release(tree, [c, b, a]) == [c, b]  # a has cached children: no candidate
    assert tree.num_evictable == 3 and list(tree.candidates) == [2, 1]
    assert tree.candidate(1) is b and tree.candidate(0) is None
    # a hit takes b and a again: only b left the candidate set
    for block in (a, b):
        block.ref_count += 1
    assert tree.referenced([a, b]) == [b]
    assert tree.num_evictable == 1 and list(tree.candidates) == [2]


def test_candidates_is_a_read_only_view():
    tree, *_ = _chain_tree()
    with pytest.raises(TypeError):
        tree.candidates[5] = None  # type: ignore[index]


def test_longest_prefix_stops_at_the_first_miss():
    tree, a, b, c = _chain_tree()
    assert tree.longest_prefix([11, 22]) == [a, b]
    assert tree.longest_prefix([11, 33, 99]) == [a, c]
    # 22 is cached, but it comes after a miss: not counted
    assert tree.longest_prefix([11, 99, 22]) == [a]
    assert tree.longest_prefix([99, 11, 22]) == []
    assert tree.longest_prefix(iter([11])) == [a]
    assert tree.longest_prefix([]) == []


def test_match_counts_unreferenced_hits_and_checks_the_chain():
    tree, a, b, c = _chain_tree()
    _release(tree, [b])
    assert tree.match([11, 22, 99]) == ([a, b], 1)
    with pytest.raises(ConfigError, match="block id 33 is cached under parent 11 but follows "
                                          "22 here"):
        tree.match([11, 22, 33], "r1")
    with pytest.raises(ConfigError, match="request 'r2': block id 22 is cached but an earlier "
                                          "id of this request is not"):
        tree.match([11, 99, 22], "r2")


def test_insert_requires_a_cached_parent():
    tree, _a, _b, _c = _chain_tree()
    orphan = _info(3, 55, 77, 2)
    with pytest.raises(ConfigError, match="cannot cache block at depth 2: its parent is not "
                                          r"cached \(prefix closure\)"):
        tree.insert(orphan)
    assert 55 not in tree and len(tree) == 3


def test_insert_requires_a_held_block():
    tree, a, _b, _c = _chain_tree()
    loose = _info(4, 66, 11, 1, a)
    loose.ref_count = 0
    with pytest.raises(ConfigError, match="must be held by a running sequence"):
        tree.insert(loose)
    assert 66 not in tree and a.num_children == 2


def test_insert_rejects_a_hash_already_cached():
    tree, a, b, _c = _chain_tree()
    with pytest.raises(ConfigError, match="block hash 0x16 is already cached"):
        tree.insert(_info(5, 22, 11, 1, a))
    assert tree.get(22) is b and a.num_children == 2


def test_insert_rejects_a_duplicate_string_hash_with_config_error():
    tree = PrefixTree()
    tree.insert(_info(0, "h0", ROOT_HASH, 0))
    with pytest.raises(ConfigError, match="already cached"):
        tree.insert(_info(1, "h0", ROOT_HASH, 0))


def test_evict_only_candidates_and_report_the_parent_that_became_one():
    tree, a, b, c = _chain_tree()
    _release(tree, [c, b, a])
    with pytest.raises(ConfigError, match="block 0 is not a candidate"):
        tree.evict(a)
    assert 11 in tree
    assert tree.evict(b) is None  # a still has c
    assert a.num_children == 1 and 22 not in tree and 1 not in tree.candidates
    assert tree.evict(c) is a  # a just became a leaf, with ref 0: a candidate
    assert a.num_children == 0 and list(tree.candidates) == [0]
    assert tree.evict(a) is None
    assert len(tree) == 0 and tree.num_evictable == 0


def test_discard_undoes_an_insert():
    tree, a, b, c = _chain_tree()
    d = _info(3, 44, 22, 2, b)
    tree.insert(d)
    assert b.num_children == 1
    tree.discard(d)
    assert 44 not in tree and b.num_children == 0
    with pytest.raises(ConfigError, match="block 0 is not a cached leaf"):
        tree.discard(a)


def test_insert_chain_registers_a_chain_in_one_call_or_nothing():
    tree, a, b, c = _chain_tree()
    d = _info(3, 44, 22, 2, b)
    e = _info(4, 55, 44, 3, d)
    tree.insert_chain([d, e])
    assert (b.num_children, d.num_children, e.num_children) == (1, 1, 0)
    assert tree.get(55) is e and len(tree) == 5
    f = _info(5, 66, 33, 2, c)
    stray = _info(6, 77, 11, 1, a)  # a's child, not f's: no chain
    with pytest.raises(ConfigError, match="block 6 does not continue the chain"):
        tree.insert_chain([f, stray])
    assert 66 not in tree and 77 not in tree and c.num_children == 0 and len(tree) == 5
