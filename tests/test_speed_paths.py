"""The hot paths made faster for issue 14 give exactly what the plain paths give.

- `kvevict.hashing.chain_hashes` (one pass over a memoryview) equals `hash_block` chained block
  by block, on golden values computed with the per-block implementation it replaced;
- token mode keeps the prompt as a read-only snapshot: a cached block's ``tokens`` are a
  read-only view equal to its slice of the prompt, whatever the caller does to its array
  afterwards, and blocks filled by decode appends hold and hash the generated ids;
- `BayesReuse.pop_victim` (victim and on_evict in one call) evicts the same blocks in the same
  order and learns the same counts as ``victim`` followed by ``on_evict``, with and without
  Thompson sampling; `DBMS.pop_victim` evicts the same blocks in the same order, with the
  five-minute rule expiring candidates and without it.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvevict.hashing import ROOT_HASH, block_hashes, chain_hashes, encode_extra, hash_block
from kvevict.manager import KVCacheManager
from kvevict.policies.bayes import BayesReuse
from kvevict.policies.dbms import DBMS
from kvevict.pool import BlockPool
from kvevict.types import ManualClock, Request

# -- hashing ---------------------------------------------------------------------------------


def test_golden_hashes_of_the_per_block_implementation():
    # computed with the per-block loop (one tobytes per block) this module's pass replaced
    assert hash_block(0, [1, 2, 3, 4]) == 0x2fa1b6862a31877b372e7b153a26a6cd
    assert block_hashes(list(range(10)), 4, "model-a") == [
        0x19fa291a5c03b9d2c4e4e6e49983756, 0x914d07e938145e767e486b28037833ee]
    parent = hash_block(0, [7])
    assert block_hashes(np.arange(6, dtype=np.int32), 3, (1, "x"), parent) == [
        0xafa4ec64ceca276702da06bc09af593d, 0x2553f5e07773a340727f96e869d8fe70]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, ">i8"])
@pytest.mark.parametrize("extra_key", [None, 7, "m", (1, "a", b"x")])
def test_chain_hashes_equals_hash_block_chained(dtype, extra_key):
    tokens = np.random.default_rng(5).integers(0, 30000, 203).astype(dtype)
    for block_size in (1, 4, 16, 203, 204):
        parent, expected = ROOT_HASH, []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block(parent, tokens[start:start + block_size], extra_key)
            expected.append(parent)
        got = chain_hashes(tokens, block_size, encode_extra(extra_key))
        assert got == expected
        assert block_hashes(tokens.tolist(), block_size, extra_key) == expected
    strided = np.arange(40, dtype=np.int64)[::2]  # not contiguous: laid out once
    assert chain_hashes(strided, 4, encode_extra(None)) == block_hashes(strided.tolist(), 4)


# -- token mode ------------------------------------------------------------------------------


def test_cached_tokens_are_a_read_only_snapshot():
    m = KVCacheManager(BlockPool(8, 4), "lru", clock=ManualClock())
    prompt = np.arange(100, 110, dtype=np.int64)  # two full blocks and a partial one
    seq = m.begin(Request("a", tokens=prompt))
    prompt[:] = 0  # the caller reuses its buffer: nothing cached changes
    blocks = seq.cached_blocks
    assert [b.tokens.tolist() for b in blocks] == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert all(not b.tokens.flags.writeable for b in blocks)
    assert seq.hashes == block_hashes(np.arange(100, 108), 4)
    assert seq.tokens == list(range(100, 110))
    with pytest.raises(ValueError):
        blocks[0].tokens[0] = 1
    m.finish("a")
    assert m.lookup(list(range(100, 108))).num_cached_blocks == 2
    assert m.lookup([0] * 8).num_cached_blocks == 0
    m.check()


def test_decode_blocks_hold_and_hash_the_generated_ids():
    m = KVCacheManager(BlockPool(8, 4), "lru", clock=ManualClock())
    seq = m.begin(Request("a", tokens=[1, 2, 3, 4, 5, 6]))
    m.append("a", [7, 8])  # block 1 fills: prompt ids 5, 6 and generated 7, 8
    m.append("a", [9, 10, 11, 12, 13])  # block 2 fills with generated ids only
    assert seq.tokens == list(range(1, 14))
    assert seq.token_array(2, 11).tolist() == list(range(3, 12))
    assert [b.tokens.tolist() for b in seq.cached_blocks] == [
        [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert [b.kind for b in seq.cached_blocks] == ["prompt", "output", "output"]
    assert seq.hashes == block_hashes(list(range(1, 14)), 4)
    m.finish("a")
    assert m.lookup(list(range(1, 13))).num_cached_blocks == 3
    m.check()


# -- bayes: pop_victim against victim + on_evict ---------------------------------------------


class _Asked(BayesReuse):
    """Bayes asked through ``victim`` and ``on_evict`` (the manager sees them redefined below
    ``pop_victim``)."""

    on_evict = BayesReuse.on_evict


def _drive(policy):
    """A pool under pressure: the evictions in order (block id, time) and the block hits."""
    clock = ManualClock()
    m = KVCacheManager(BlockPool(24, 4), policy, clock=clock)
    evicted = []
    m.add_eviction_listener(lambda block, now: evicted.append((block.block_id, now)))
    gen = np.random.default_rng(7)
    for i in range(400):
        s = int(gen.integers(0, 8))
        prompt = [3000 + 10 * s + j for j in range(8)] + [int(x) for x in gen.integers(0, 5, 6)]
        clock.set(float(i))
        m.begin(Request(f"r{i}", tokens=prompt, session_id=f"s{s}"))
        m.append(f"r{i}", [int(x) for x in gen.integers(0, 60, 5)])
        m.finish(f"r{i}")
        if i % 50 == 49:
            m.check()
    return evicted, m.stats.block_hits


def _run(policy):
    evicted, hits = _drive(policy)
    return evicted, policy.counts(400.0), hits


@pytest.mark.parametrize("thompson", [False, True])
def test_bayes_pop_victim_equals_victim_then_on_evict(thompson):
    def make(cls):
        rng = np.random.default_rng(3) if thompson else None
        return cls(horizon=6.0, thompson=thompson, rng=rng)

    popped, asked = make(BayesReuse), make(_Asked)
    got, expected = _run(popped), _run(asked)
    assert len(got[0]) > 500  # evictions under pressure, idle failures among them
    assert sum(f for _, f in got[1].values()) > 100
    assert got == expected
    assert popped.victim_stats["victim_calls"] == asked.victim_stats["victim_calls"]


# -- dbms: pop_victim against victim + on_evict ----------------------------------------------


class _AskedDBMS(DBMS):
    """DBMS asked through ``victim`` and ``on_evict``."""

    on_evict = DBMS.on_evict


@pytest.mark.parametrize("rent", [0.0, 1 / 80, 1e6])  # no expiry, some, all at once
def test_dbms_pop_victim_equals_victim_then_on_evict(rent):
    popped, asked = DBMS(rent_per_gib_s=rent), _AskedDBMS(rent_per_gib_s=rent)
    got, expected = _drive(popped), _drive(asked)
    assert len(got[0]) > 500
    assert got == expected
    # the same choices; the victim's heap entry is popped at once, not later as stale
    assert popped.victim_stats["victim_calls"] == asked.victim_stats["victim_calls"]
    assert popped.victim_stats["stale_pops"] < asked.victim_stats["stale_pops"]
