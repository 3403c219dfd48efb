"""Replay at trace scale: the compact id table, the next-use file, streaming, flat memory."""

from __future__ import annotations

import gc
import itertools
import random
import tracemalloc

import numpy as np
import pytest

from kvevict import ConfigError, Request
from kvevict.policies import belady as belady_module
from kvevict.policies.belady import NEVER, Belady, FileBelady, NextUseFile
from kvevict.replay import replay, replay_table
from kvevict.workloads import IdTable, TraceFile, bundled_trace_path, read_mooncake

BS = 4


def _reqs(chains, sizes=None):
    sizes = sizes or [len(c) * BS for c in chains]
    return [Request(i, block_hashes=c, num_tokens=n, arrival=float(i))
            for i, (c, n) in enumerate(zip(chains, sizes, strict=True))]


# -- IdTable -------------------------------------------------------------------------------


def test_id_table_matches_a_dict_for_dense_sparse_and_huge_ids():
    rng = random.Random(7)
    table, ref = IdTable(), {}
    keys = ([rng.randrange(5000) for _ in range(3000)]
            + [rng.randrange(2**40) for _ in range(3000)]
            + [2**63 + rng.randrange(10**6) for _ in range(200)])
    rng.shuffle(keys)
    for k in keys:
        v = rng.randrange(2**40)
        table[k] = v
        ref[k] = v
        assert len(table) == len(ref)
    assert all(table.get(k) == v for k, v in ref.items())
    assert table.get(5001) is None and 5001 not in table and keys[0] in table
    with pytest.raises(TypeError):
        table["a"] = 1


def test_id_table_moves_ids_into_pages_as_it_grows_and_stays_8_bytes_per_dense_id():
    table = IdTable()
    table[3 << 20] = 5  # above the first bound (2**20): in the dict
    assert table.nbytes == 8 * 16 + 100  # the page list, one dict entry
    for k in range(1 << 19):  # 8 * entries passes the bound twice: the id moves to a page
        table[k] = k
    assert table.get(3 << 20) == 5 and table.get(12345) == 12345
    assert len(table) == (1 << 19) + 1
    # the bound doubled to 2**23 (8 per entry): 128 page slots; 8 pages of dense ids and the
    # one page of the moved id; 8 bytes per id of the dense pages
    assert table.nbytes == 9 * (8 << IdTable.PAGE_BITS) + 8 * 128
    assert table.nbytes < 8.1 * len(table) + (8 << IdTable.PAGE_BITS) + 8 * 128


def test_id_table_link_records_chains_and_names_the_first_break():
    table = IdTable()
    assert table.link([1, 2, 3]) == -1
    assert table.link([1, 2, 4]) == -1
    assert table.get(1) == 0 and table.get(2) == 2 and table.get(4) == 3  # parent + 1
    assert table.link([5, 2]) == 1  # 2 follows 1, not 5
    assert table.get(5) == 0  # recorded up to the break
    assert table.link([3]) == 0  # 3 follows 2, not the root
    big = 2**50
    assert table.link([big, big + 1]) == -1 and table.link([7, big + 1]) == 1


# -- NextUseFile: exact next uses ----------------------------------------------------------


def _next(future, capacity=None):
    return np.fromfile(future.next_uses(capacity), dtype=future.next_dtype).tolist()


def test_next_uses_of_a_hand_built_trace():
    reqs = _reqs([[1, 2], [3], [1, 2, 4], [3]])
    with NextUseFile.build(reqs, block_size=BS) as future:
        assert (future.num_requests, future.num_accesses, future.max_need) == (4, 7, 3)
        assert future.num_slots == 5  # ids 0..4 are their own slots
        assert _next(future) == [2, 2, 3, NEVER, NEVER, NEVER, NEVER]
        # a 2-block pool never runs request 2: it is no one's next use
        assert _next(future, 2) == [NEVER, NEVER, 3, NEVER, NEVER, NEVER, NEVER]
        assert future.next_uses(3) == future.next_uses(None) == future.next_uses(99)
        assert future.bytes_on_disk == 7 * 8 + 5 * 8 + 4 * 8 + 2 * 7 * 4


@pytest.mark.parametrize("keys", ["dense", "sparse", "str", "mixed"])
def test_next_uses_do_not_depend_on_how_ids_are_spelled(keys, monkeypatch):
    rng = random.Random(3)
    chains = [[rng.randrange(60) for _ in range(rng.randrange(1, 6))] for _ in range(400)]
    chains = [list(dict.fromkeys(c)) for c in chains]
    spell = {"dense": lambda h: h, "sparse": lambda h: h * 10**15 + 7,
             "str": lambda h: f"b{h}", "mixed": lambda h: h if h % 2 else f"b{h}"}[keys]
    with NextUseFile.build(_reqs(chains), block_size=BS) as plain:
        expected = _next(plain)
    monkeypatch.setattr(belady_module, "_CHUNK_REQUESTS", 7)  # many backward chunks
    monkeypatch.setattr(belady_module, "_CHUNK_IDS", 5)  # many forward flushes
    with NextUseFile.build(_reqs([[spell(h) for h in c] for c in chains]),
                           block_size=BS) as spelled:
        assert _next(spelled) == expected
        assert spelled.num_slots >= len({h for c in chains for h in c})
    brute = []
    for i, c in enumerate(chains):
        for h in c:
            later = [j for j in range(i + 1, len(chains)) if h in chains[j]]
            brute.append(later[0] if later else NEVER)
    assert expected == brute


def test_token_mode_requests_hash_as_the_manager_does():
    system = list(range(8))
    reqs = [Request(i, tokens=system + [i] * 6) for i in range(3)]
    with NextUseFile.build(reqs, block_size=BS) as future:
        assert future.num_accesses == 3 * 3  # 14 tokens: 3 full blocks each
        assert _next(future) == [1, 1, NEVER, 2, 2, NEVER, NEVER, NEVER, NEVER]


def test_the_files_are_removed_on_close_and_errors_are_specific(tmp_path):
    future = NextUseFile.build(_reqs([[1]]), block_size=BS, directory=tmp_path)
    (root,) = tmp_path.iterdir()
    future.close()
    assert not root.exists() and future.bytes_on_disk == 0
    with pytest.raises(ConfigError, match="closed"):
        future.next_uses()
    with pytest.raises(ConfigError, match="block_size"):
        NextUseFile.build([], block_size=0)
    with pytest.raises(ConfigError, match="Requests"):
        NextUseFile.build([1], block_size=BS, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []  # a failed build leaves nothing behind
    with pytest.raises(ConfigError, match="spill"):
        NextUseFile.build([], block_size=BS).spilled()


def test_file_belady_refuses_requests_it_was_not_built_from():
    from kvevict import BlockPool, KVCacheManager, PolicyError

    with NextUseFile.build(_reqs([[1, 2], [3]]), block_size=BS) as future:
        manager = KVCacheManager(BlockPool(4, BS), future.policy(4))
        manager.finish(manager.begin(_reqs([[1, 2]])[0]).seq_id)
        with pytest.raises(PolicyError, match="has 2 cached blocks but request 1 of the "
                                              "future has 1"):
            manager.begin(Request("x", block_hashes=[5, 6], num_tokens=8))
        with pytest.raises(ConfigError, match="capacity_blocks"):
            FileBelady(future, 0)


# -- the file oracle is Belady -------------------------------------------------------------


def _random_trace(seed, n, alphabet):
    rng = random.Random(seed)
    chains: list[list] = [[]]
    reqs = []
    for i in range(n):
        base = rng.choice(chains)
        chain = base[:rng.randrange(len(base) + 1)] + [next(alphabet)
                                                       for _ in range(rng.randrange(0, 4))]
        if not chain:
            chain = [next(alphabet)]
        chains.append(chain)
        reqs.append(Request(i, block_hashes=chain, num_tokens=len(chain) * BS - rng.randrange(BS),
                            arrival=i * 0.5 + (rng.random() < 0.2) * 0.0))
    return reqs


@pytest.mark.parametrize(("seed", "capacity", "time"), [(0, 6, "index"), (1, 12, "arrival"),
                                                        (2, 4, "index"), (3, 25, "arrival")])
def test_file_belady_gives_the_victims_of_the_dict_belady(seed, capacity, time):
    reqs = _random_trace(seed, 300, itertools.count())
    assert any(len(r.block_hashes) > capacity for r in reqs) or capacity > 6
    by_file = replay(reqs, "belady", capacity, BS, time=time, records=True, check_every=50)
    fits = [r for r in reqs if len(r.block_hashes) <= capacity]
    times = [float(i) if time == "index" else r.arrival for i, r in enumerate(reqs)]
    fit_times = [t for r, t in zip(reqs, times, strict=True) if len(r.block_hashes) <= capacity]
    if time == "arrival":  # equal arrivals: nudged as the replay does
        from kvevict.policies.belady import request_times

        fit_times = [t for r, t in zip(reqs, request_times(reqs, "arrival"), strict=True)
                     if len(r.block_hashes) <= capacity]
    by_dict = replay(reqs, lambda: Belady.from_requests(fits, time=fit_times), capacity, BS,
                     time=time, records=True, label="belady")
    assert by_file == by_dict.__class__(**{**by_dict.__dict__, "seconds": by_file.seconds})


def test_one_shot_iterators_are_spilled_for_the_second_pass():
    trace = read_mooncake(bundled_trace_path())[:800]
    listed = replay(trace, "belady", 600)
    assert replay(iter(trace), "belady", 600).hits == listed.hits
    assert replay((r for r in trace), "belady", 600).evictions == listed.evictions
    table = replay_table(TraceFile(bundled_trace_path(), "mooncake"), ["lru", "belady"],
                         [600, 2000])
    whole = read_mooncake(bundled_trace_path())
    for policy, size in itertools.product(("lru", "belady"), (600, 2000)):
        alone = replay(whole, policy, size)
        assert table.get(policy, size) == type(alone)(**{**alone.__dict__,
                                                         "seconds": table.get(policy,
                                                                              size).seconds})


# -- memory does not follow the trace ------------------------------------------------------


def _repeated(n, base):
    """``n`` requests: the base trace repeated with shifted ids, built on the fly."""
    stride = 1 + max(h for r in base for h in r.block_hashes)
    for i in range(n):
        r = base[i % len(base)]
        shift = (i // len(base)) * stride
        yield Request(i, block_hashes=[h + shift for h in r.block_hashes],
                      num_tokens=r.num_tokens)


def _peak(fn):
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_online_replay_memory_does_not_grow_with_the_trace():
    base = read_mooncake(bundled_trace_path())[:500]
    short = _peak(lambda: replay(_repeated(2000, base), "lru", 1500))
    long = _peak(lambda: replay(_repeated(8000, base), "lru", 1500))
    held = _peak(lambda: list(_repeated(6000, base)))  # what 6k more requests would hold
    assert long < 1.25 * short, (short, long)
    assert held > short  # holding the extra requests would break the bound above
    records = _peak(lambda: replay(_repeated(8000, base), "lru", 1500, records=True))
    assert records > long + 8000 * 60  # records are kept only when asked for


def test_belady_replay_memory_follows_the_distinct_blocks_not_the_requests(monkeypatch):
    # chunks smaller than both traces, so that only what is kept per block can grow
    monkeypatch.setattr(belady_module, "_CHUNK_REQUESTS", 256)
    monkeypatch.setattr(belady_module, "_CHUNK_IDS", 4096)
    base = read_mooncake(bundled_trace_path())[:500]  # 500 requests, 15k accesses
    slots = 1 + max(h for r in base for h in r.block_hashes)  # per repetition of the base
    short = _peak(lambda: replay(_repeated(2000, base), "belady", 1500))
    long = _peak(lambda: replay(_repeated(8000, base), "belady", 1500))
    # at most the backward pass's last-use array: 4 bytes per distinct block (12 more
    # repetitions of the base), whichever pass peaks
    assert long - short < 4 * 12 * slots + 2**18, (short, long, slots)

    def backward(n):
        with NextUseFile.build(_repeated(n, base), block_size=512) as future:
            return _peak(future.next_uses)

    grown = backward(8000) - backward(2000)
    assert 0.9 * 4 * 12 * slots < grown < 4 * 12 * slots + 2**16, (grown, slots)
