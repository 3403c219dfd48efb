"""Memory tiers (kvevict.tiers): demotion, reload, the cost rule, closure across tiers,
bit-identical reloads per tier / dtype / layout, and the disk tier's faults."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from kvevict import BlockPool, ConfigError, CostModel, KVCacheManager, Request
from kvevict.layout import KVLayout
from kvevict.tiers import (
    TIER_PROFILES,
    DiskStore,
    Tier,
    TierPricedCost,
    TierProfile,
    TierStack,
    tier_profile,
)

BS = 4


def req(rid, start, blocks, session=None):
    return Request(rid, tokens=list(range(start, start + blocks * BS)), session_id=session)


def run(manager, rid, start, blocks):
    seq = manager.begin(req(rid, start, blocks))
    manager.finish(rid)
    manager.check()
    return seq


# -- metadata-only: what moves where, exactly ---------------------------------------------


def test_eviction_demotes_and_a_hit_below_reloads():
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(6, BS), "lru", tiers=stack)
    run(m, "a", 0, 4)
    run(m, "b", 100, 6)  # evicts all four of a's blocks: demoted
    assert stack.stats.demotions == {"host-pcie5": 4}
    assert len(stack) == 4 and m.num_cached_blocks == 6
    seq = run(m, "c", 0, 4)  # a's prefix again: reloaded from the host tier
    assert seq.reloaded == (4,)
    assert seq.num_cached_tokens == 16
    assert m.stats.block_hits == 4 and m.stats.prefix_cache_hits == 16
    assert stack.stats.hit_blocks == {"host-pcie5": 4}
    assert stack.stats.reloads == 4
    assert stack.stats.bytes_read == {"host-pcie5": 4 * stack.bytes_per_block}
    # c needed 4 blocks: 4 of b's 6 went down (4 + 4 = 8 demotions, the tier holds 8)
    assert stack.stats.demotions == {"host-pcie5": 8}
    assert len(stack) == 4 and stack.hits_by_tier(m.stats.block_hits) == {
        "device": 0, "host-pcie5": 4}


def test_a_hit_continues_from_the_pool_into_the_tier():
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(6, BS), "lru", tiers=stack)
    run(m, "a", 0, 5)
    run(m, "b", 100, 3)  # evicts a's 2 deepest blocks (LRU: tail first)
    assert stack.stats.demotions == {"host-pcie5": 2}
    assert sorted(b.depth for b in stack) == [3, 4]
    seq = run(m, "c", 0, 5)
    assert seq.reloaded == (2,) and seq.num_cached_tokens == 20
    assert m.stats.block_hits == 5


def test_without_a_lower_tier_left_the_block_is_dropped():
    stack = TierStack([Tier(2, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(4, BS), "lru", tiers=stack)
    run(m, "a", 0, 4)
    run(m, "b", 100, 4)
    # four demotions into a 2-block tier: two of them pushed the tier's LRU leaf out
    assert stack.stats.demotions == {"host-pcie5": 4}
    assert stack.stats.drops == {"last_tier": 2}
    assert sorted(b.depth for b in stack) == [0, 1]  # the head survives: leaves go first


def test_demotion_cascades_through_two_tiers():
    stack = TierStack([Tier(2, "host-pcie5"), Tier(4, "nvme")], demote="always")
    m = KVCacheManager(BlockPool(4, BS), "lru", tiers=stack)
    run(m, "a", 0, 4)
    run(m, "b", 100, 4)
    assert stack.stats.demotions == {"host-pcie5": 4, "nvme": 2}
    assert {b.depth: b.tier for b in stack} == {0: "host-pcie5", 1: "host-pcie5",
                                                 2: "nvme", 3: "nvme"}
    seq = run(m, "c", 0, 4)  # the whole chain: two blocks from each tier
    assert seq.reloaded == (2, 2)
    assert stack.stats.hit_blocks == {"host-pcie5": 2, "nvme": 2}


# -- the cost rule ------------------------------------------------------------------------


def _cost_stack(capacity=32):
    # recompute(d) = 4 * 1e-3 + 1e-5 * 4 * (4 d + 2.5) = 0.0041 + 0.00016 d seconds;
    # reload = 5 ms + 4000 B / 4e6 B/s = 6 ms: worth it from depth 12 (0.0041 + 0.00192)
    cost = CostModel(linear_s_per_token=1e-3, attn_s_per_pair=1e-5, kv_bytes_per_token=1000)
    link = TierProfile("slow", 4e6, 4e6, 5e-3)
    return TierStack([Tier(capacity, link)], cost_model=cost)


def test_crossover_depth_of_the_cost_rule():
    stack = _cost_stack()
    KVCacheManager(BlockPool(8, BS), "lru", tiers=stack)
    assert stack.reload_seconds(1) == pytest.approx(6e-3)
    assert stack.recompute_seconds(11) == pytest.approx(0.0041 + 0.00176)
    assert stack.crossover_depth(1) == 12


def test_shallow_chains_are_dropped_deep_ones_demoted_whole():
    stack = _cost_stack()
    m = KVCacheManager(BlockPool(16, BS), "lru", tiers=stack)
    run(m, "shallow", 0, 8)  # depths 0..7: cheaper to recompute than to reload
    run(m, "other", 1000, 16)
    assert stack.stats.drops == {"cost": 8} and not stack.stats.demotions
    run(m, "deep", 5000, 16)  # evicts other's 16: 12..15 pay, and their prefix goes along
    assert stack.stats.demotions == {"slow": 16}
    assert stack.stats.drops == {"cost": 8}
    seq = run(m, "again", 1000, 16)
    assert seq.reloaded == (16,)


def test_policy_cost_model_prices_the_reload_from_the_tier_below():
    stack = _cost_stack()
    m = KVCacheManager(BlockPool(16, BS), "market", tiers=stack)
    cm = m.policy.cost_model
    assert isinstance(cm, TierPricedCost)
    assert cm.loss_reload_s == pytest.approx(6e-3) and cm.kept_reload_s == 0.0
    assert cm.recompute_seconds(3, BS) == pytest.approx(0.0041 + 0.00048)  # cheaper: recompute
    assert cm.recompute_seconds(40, BS) == pytest.approx(6e-3)  # capped at the reload
    last = stack.policy_cost_model(1)  # the last tier: losing means recomputing
    assert last.loss_reload_s == math.inf and last.kept_reload_s == pytest.approx(6e-3)
    assert last.recompute_seconds(40, BS) == pytest.approx(0.0041 + 0.0064 - 6e-3)
    assert last.recompute_seconds(3, BS) == 0.0
    assert last.prefill_seconds(8, 0) == stack.cost_model.prefill_seconds(8, 0)


def test_bayes_built_by_name_gets_the_tier_priced_cost():
    stack = _cost_stack()
    m = KVCacheManager(BlockPool(16, BS), "bayes", tiers=stack)
    assert isinstance(m.policy.cost_model, TierPricedCost)


# -- profiles -------------------------------------------------------------------------------


def test_seed_004_profiles_are_all_there_with_sources():
    assert {"hbm", "host-pcie5", "host-c2c", "cxl", "nvme", "nvme-gds", "rdma",
            "pfs"} <= set(TIER_PROFILES)
    assert all(p.source for p in TIER_PROFILES.values())
    assert TIER_PROFILES["host-pcie5"].read_bytes_per_s == 64e9
    assert TIER_PROFILES["host-c2c"].read_bytes_per_s == 450e9
    assert tier_profile("rdma").direct and not tier_profile("nvme").direct
    with pytest.raises(ConfigError, match="unknown tier profile 'tape'"):
        tier_profile("tape")


def test_a_reload_crosses_every_link_unless_it_is_direct():
    cost = CostModel(kv_bytes_per_token=1000)
    host, nvme, gds = (tier_profile(n) for n in ("host-pcie5", "nvme", "nvme-gds"))
    staged = TierStack([Tier(4, host), Tier(4, nvme)], cost_model=cost)
    KVCacheManager(BlockPool(4, BS), tiers=staged)
    nbytes = 4000
    assert staged.reload_seconds(2) == pytest.approx(
        host.latency_s + nbytes / host.read_bytes_per_s
        + nvme.latency_s + nbytes / nvme.read_bytes_per_s)
    direct = TierStack([Tier(4, host), Tier(4, gds)], cost_model=cost)
    KVCacheManager(BlockPool(4, BS), tiers=direct)
    assert direct.reload_seconds(2) == pytest.approx(gds.latency_s + nbytes / gds.read_bytes_per_s)
    assert direct.reloads_seconds((3, 2)) == pytest.approx(
        host.latency_s + 3 * nbytes / host.read_bytes_per_s
        + gds.latency_s + 2 * nbytes / gds.read_bytes_per_s)


# -- bad input ------------------------------------------------------------------------------


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ConfigError, match="capacity_blocks must be a positive int"):
        Tier(0)
    with pytest.raises(ConfigError, match="non-empty sequence of Tier"):
        TierStack([])
    with pytest.raises(ConfigError, match="demote must be one of cost, always"):
        TierStack([Tier(2)], demote="never")
    with pytest.raises(ConfigError, match="tier names must be distinct"):
        TierStack([Tier(2), Tier(2)])
    with pytest.raises(ConfigError, match="tiers must be a TierStack"):
        KVCacheManager(BlockPool(4, BS), tiers=[Tier(2)])
    stack = TierStack([Tier(2)])
    KVCacheManager(BlockPool(4, BS), tiers=stack)
    with pytest.raises(ConfigError, match="already serves a pool"):
        KVCacheManager(BlockPool(4, BS), tiers=stack)
    layout = KVLayout.gqa(num_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=2)
    with pytest.raises(ConfigError, match="metadata-only but the pool holds KV bytes"):
        KVCacheManager(BlockPool(4, BS, layout, device="cpu"), tiers=TierStack([Tier(2)]))
    with pytest.raises(ConfigError, match=r"stores KV bytes .* but the pool is metadata-only"):
        KVCacheManager(BlockPool(4, BS), tiers=TierStack([Tier(2, store="host")]))


# -- real bytes: bit-identical reloads ------------------------------------------------------

LAYOUTS = {
    "gqa": lambda dt: KVLayout.gqa(num_layers=2, num_attention_heads=4, num_kv_heads=2,
                                   head_dim=8, dtype=dt, name="tiny-gqa"),
    "mla": lambda dt: KVLayout.mla(num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2, dtype=dt,
                                   name="tiny-mla"),
}


class Writer:
    """Fills every computed block with seeded random KV and checks every hit block holds
    exactly what was written for its hash."""

    def __init__(self, manager, seed=0):
        self.m = manager
        self.kv = manager.pool.kv
        self.gen = torch.Generator().manual_seed(seed)
        self.written: dict = {}
        self.checked = 0

    def run(self, rid, start, blocks):
        seq = self.m.begin(req(rid, start, blocks))
        hit = seq.num_cached_tokens // BS
        for depth, b in enumerate(seq.block_table):
            h = seq.hashes[depth]
            if depth < hit:
                assert torch.equal(self.kv[:, :, b], self.written[h]), (rid, depth)
                self.checked += 1
            else:
                x = torch.randn(self.kv[:, :, b].shape, generator=self.gen).to(self.kv.dtype)
                self.kv[:, :, b].copy_(x)
                self.written[h] = x
        self.m.finish(rid)
        self.m.check()
        return seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("where", ["host", "disk"])
def test_reloaded_kv_is_bit_identical(tmp_path, where, layout, dtype):
    lay = LAYOUTS[layout](dtype)
    store = "host" if where == "host" else tmp_path / "disk"
    stack = TierStack([Tier(16, "host-pcie5" if where == "host" else "nvme", store=store)],
                      demote="always")
    m = KVCacheManager(BlockPool(4, BS, lay, device="cpu"), "lru", tiers=stack)
    w = Writer(m)
    w.run("a", 0, 4)
    w.run("b", 100, 4)
    seq = w.run("a2", 0, 4)  # all four back from the tier, byte for byte
    assert seq.reloaded == (4,) and w.checked == 4


def test_two_real_tiers_host_then_disk_bit_identical(tmp_path):
    lay = LAYOUTS["gqa"](torch.bfloat16)
    stack = TierStack([Tier(3, "host-pcie5", store="host"), Tier(8, "nvme", store=tmp_path)],
                      demote="always")
    m = KVCacheManager(BlockPool(4, BS, lay, device="cpu"), "lru", tiers=stack)
    w = Writer(m)
    for r in range(3):
        w.run(f"a{r}", 100 * r, 4)
    seq = w.run("again", 0, 4)
    assert sum(seq.reloaded) == 4 and seq.reloaded[1] > 0  # some came from disk
    assert w.checked == 4


# -- the disk tier's faults -----------------------------------------------------------------


def _disk_manager(directory, model="tiny", capacity=16, layout="gqa", dtype=torch.bfloat16):
    lay = LAYOUTS[layout](dtype)
    stack = TierStack([Tier(capacity, "nvme", store=directory)], demote="always", model=model)
    return KVCacheManager(BlockPool(4, BS, lay, device="cpu"), "lru", tiers=stack)


@pytest.mark.parametrize("fault", ["truncate", "flip"])
def test_a_corrupted_disk_file_is_a_miss_never_served(tmp_path, caplog, fault):
    m = _disk_manager(tmp_path)
    w = Writer(m)
    w.run("a", 0, 4)
    w.run("b", 100, 4)
    stack = m.tiers
    victim = next(b for b in stack if b.depth == 1 and b.tokens[0] == 4)  # a's second block
    path = stack.tiers[0].store.path_of(victim.block_hash)
    raw = bytearray(path.read_bytes())
    if fault == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    else:
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvevict.tiers"):
        seq = w.run("a2", 0, 4)  # depth 0 from disk, depth 1 corrupted: 2.. unreachable
    assert seq.reloaded == (1,) and w.checked == 1
    assert stack.stats.checksum_failures == 1
    assert stack.stats.drops.get("corrupt") == 1 and stack.stats.drops.get("cascade") == 2
    assert "failed its checksum" in caplog.text
    assert not path.exists()
    m.check()


def test_a_checksum_failure_found_at_load_shrinks_the_hit(tmp_path, caplog):
    """A disk block is read only when it is loaded, after the evictions made for the
    request: a corrupted one found then ends the reload there (a miss, never served), the
    chunk is re-sized to the shorter hit and the pool blocks it no longer needs stay free."""
    lay = LAYOUTS["gqa"](torch.bfloat16)
    reads = []

    class Counting(DiskStore):
        def read(self, slot, block):
            reads.append(block.depth)
            return super().read(slot, block)

    stack = TierStack([Tier(16, "nvme", store=Counting(tmp_path))], demote="always")
    m = KVCacheManager(BlockPool(8, BS, lay, device="cpu"), "lru", tiers=stack)
    w = Writer(m)
    w.run("a", 0, 4)
    w.run("b", 100, 8)  # a's 4 blocks go to disk
    third = next(b for b in stack if b.depth == 2 and b.tokens[0] == 8)
    path = stack.tiers[0].store.path_of(third.block_hash)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    assert reads == []
    with caplog.at_level(logging.WARNING, logger="kvevict.tiers"):
        # 6 blocks; 4 below the pool, then a chunk of one block: 5 pool blocks evicted for it
        seq = m.begin(req("a2", 0, 6), max_new_tokens=BS)
    assert "failed its checksum" in caplog.text
    assert reads == [0, 1, 2]  # depth 2 failed: depth 3 (its child) was never read
    assert seq.reloaded == (2,) and seq.num_cached_tokens == 2 * BS
    # the chunk follows the 2-block hit: 2 + 1 blocks, 12 tokens, 12 pending
    assert len(seq.block_table) == 3 and seq.num_tokens == 3 * BS and seq.num_pending == 3 * BS
    # 5 of b's blocks were evicted for the 5-block need: 8 - 3 (b's left) - 3 (a2's) free
    assert m.stats.evictions - 4 == 5 and m.num_free_blocks == 2
    assert stack.stats.checksum_failures == 1
    assert stack.stats.drops == {"corrupt": 1, "cascade": 1}
    assert stack.stats.reloads == 2 and m.stats.block_hits == 2
    for depth in range(2):  # the two loaded blocks hold what was written for them
        assert torch.equal(m.pool.kv[:, :, seq.block_table[depth]], w.written[seq.hashes[depth]])
    assert not path.exists()
    m.check()
    m.prefill("a2")
    m.finish("a2")
    m.check()


def test_a_full_disk_is_back_pressure_not_a_crash(tmp_path, monkeypatch):
    import errno

    import kvevict.tiers as tiers_module

    m = _disk_manager(tmp_path)
    w = Writer(m)
    w.run("a", 0, 4)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tiers_module, "_atomic_write", full)
    w.run("b", 100, 4)  # a's four blocks cannot be written: dropped, counted
    assert m.tiers.stats.drops == {"back_pressure": 4}
    assert len(m.tiers) == 0
    seq = w.run("a2", 0, 4)
    assert seq.reloaded == () and seq.num_cached_tokens == 0
    m.check()


def test_an_unwritable_directory_is_back_pressure(tmp_path):
    m = _disk_manager(tmp_path)
    w = Writer(m)
    w.run("a", 0, 4)
    # a directory that disappeared under the cache (and a file where it was): every
    # write fails
    for p in tmp_path.iterdir():
        p.unlink()
    tmp_path.rmdir()
    tmp_path.write_bytes(b"not a directory")
    w.run("b", 100, 4)
    assert m.tiers.stats.drops == {"back_pressure": 4}
    m.check()
    tmp_path.unlink()


def test_a_directory_for_another_model_or_layout_is_refused(tmp_path):
    _disk_manager(tmp_path, model="llama-a")
    with pytest.raises(ConfigError, match=r"written for model 'llama-a'.*this cache is model "
                                          r"'llama-b'"):
        _disk_manager(tmp_path, model="llama-b")
    with pytest.raises(ConfigError, match=r"bfloat16.*this cache is .*float16"):
        _disk_manager(tmp_path, model="llama-a", dtype=torch.float16)
    with pytest.raises(ConfigError, match=r"layout gqa.*this cache is .*layout mla"):
        _disk_manager(tmp_path, model="llama-a", layout="mla")
    _disk_manager(tmp_path, model="llama-a")  # the same identity opens


def test_a_new_process_resumes_from_the_disk_directory(tmp_path):
    m = _disk_manager(tmp_path)
    w = Writer(m)
    w.run("t1", 0, 3)
    m.evict(m.num_evictable_blocks)  # everything down to disk, as before an exit
    assert len(m.tiers) == 3
    again = _disk_manager(tmp_path)  # a fresh manager, stack and pool on the same directory
    assert sorted(b.depth for b in again.tiers) == [0, 1, 2]
    again.check()
    w2 = Writer(again)
    w2.written = w.written
    seq = w2.run("t2", 0, 3)
    assert seq.reloaded == (3,) and w2.checked == 3
    assert again.tiers.stats.hit_blocks == {"disk": 3}


def test_spill_moves_the_host_tier_to_disk(tmp_path):
    lay = LAYOUTS["gqa"](torch.float32)
    stack = TierStack([Tier(8, "host-pcie5", store="host"), Tier(8, "nvme", store=tmp_path)],
                      demote="always", model="tiny")
    m = KVCacheManager(BlockPool(4, BS, lay, device="cpu"), "lru", tiers=stack)
    w = Writer(m)
    w.run("a", 0, 4)
    m.evict(m.num_evictable_blocks)
    assert {b.tier for b in stack} == {"host-pcie5"}
    assert stack.spill(0.0) == 4
    assert {b.tier for b in stack} == {"disk"}
    m.check()
    assert len(list(tmp_path.glob("*.kvblock"))) == 4
    seq = w.run("a2", 0, 4)
    assert seq.reloaded == (0, 4) and w.checked == 4


def test_disk_store_rejects_a_metadata_pool():
    with pytest.raises(ConfigError, match="stores KV bytes"):
        KVCacheManager(BlockPool(4, BS), tiers=TierStack([Tier(2, store=DiskStore("/tmp/x"))]))


# -- the manager's other paths: recomputed meanwhile, rollbacks, out of blocks, resume -----


def test_a_block_computed_again_supersedes_its_copy_below():
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(6, BS), "lru", tiers=stack)
    run(m, "x", 0, 3)
    m.evict(3)
    assert len(stack) == 3
    seq = m.begin(Request("y", tokens=[0, 1, 2, 3, 4]))  # block 0 reloaded, 1 and 2 below
    assert seq.reloaded == (1,)
    m.append("y", [5, 6, 7])  # block 1 computed again: the copy below is superseded
    m.check()
    assert stack.stats.drops == {"superseded": 1} and len(stack) == 1
    (below,) = list(stack)
    assert below.depth == 2 and below.parent is m.block(seq.block_table[1])  # re-parented
    m.finish("y")
    seq = run(m, "z", 0, 3)  # blocks 0, 1 in the pool, 2 reloaded under the new parent
    assert seq.reloaded == (1,) and seq.num_cached_tokens == 12


def test_a_rolled_back_reload_drops_what_only_it_could_reach():
    from kvevict import LRU, PolicyError

    class HitRaises(LRU):
        armed = False

        def on_hit(self, block, now):
            if self.armed:
                raise RuntimeError("boom")

    policy = HitRaises()
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(6, BS), policy, tiers=stack)
    run(m, "x", 0, 3)
    m.evict(3)
    policy.armed = True
    with pytest.raises(PolicyError, match="on_hit"):
        m.begin(req("y", 0, 2))  # reloads blocks 0 and 1, then rolls back
    m.check()
    # the two reloaded records were uncached; block 2 (below, child of 1) is unreachable
    assert len(stack) == 0 and stack.stats.drops == {"cascade": 1}
    assert m.num_cached_blocks == 0


def test_out_of_blocks_leaves_the_tiers_as_they_were():
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(4, BS), "lru", tiers=stack)
    run(m, "x", 0, 2)
    m.evict(2)
    m.begin(req("hog", 500, 3))  # three of four blocks in use
    from kvevict import OutOfBlocks

    with pytest.raises(OutOfBlocks):
        m.begin(req("y", 0, 2))
    m.check()  # nothing left held
    assert len(stack) == 2 and len(stack.tiers[0].candidates) == 1
    m.finish("hog")
    seq = run(m, "y", 0, 2)
    assert seq.reloaded == (2,)


def test_resume_reloads_what_was_demoted_while_preempted():
    stack = TierStack([Tier(8, "host-pcie5")], demote="always")
    m = KVCacheManager(BlockPool(4, BS), "lru", tiers=stack)
    m.begin(req("a", 0, 3))
    m.preempt("a")
    run(m, "b", 100, 4)  # pushes a's three blocks down
    assert len(stack) >= 3
    seq = m.resume("a")
    assert seq.reloaded == (3,) and seq.num_cached_tokens == 12
    m.finish("a")
    m.check()


# -- the replay with a host tier ------------------------------------------------------------


def _trace():
    # three sessions of 3 blocks each, then each again: a 4-block pool keeps one session
    reqs = [Request(f"r{i}", block_hashes=tuple(range(10 * i, 10 * i + 3)), num_tokens=3 * BS)
            for i in range(3)]
    return reqs + [Request(f"s{i}", block_hashes=tuple(range(10 * i, 10 * i + 3)),
                           num_tokens=3 * BS) for i in range(3)]


def test_replay_with_a_host_tier_counts_hits_by_tier():
    from kvevict.replay import format_tier_table, replay, replay_table

    plain = replay(_trace(), "lru", 4, BS)
    assert plain.hits == 0  # LRU at 4 blocks: each session is gone when it comes back
    tiered = replay(_trace(), "lru", 4, BS, check_every=1,
                    tiers=lambda: TierStack([Tier(8, name="host")], demote="always"))
    assert tiered.hits == 9 and tiered.tiers["hits"] == {"device": 0, "host": 9}
    assert tiered.tier_hit_ratios == {"device": 0.0, "host": 0.5}
    assert tiered.tiers["demotions"] == {"host": 14}
    table = replay_table(_trace(), ["lru"], [4], BS,
                         tiers=lambda: TierStack([Tier(8, name="host")], demote="always"))
    text = format_tier_table(table)
    assert "| lru | 4 | 0.0000 | 0.5000 | 0.5000 |" in text
    with pytest.raises(ConfigError, match="zero-argument factory"):
        replay(_trace(), "lru", 4, BS, tiers=TierStack([Tier(8)]))


def test_cli_replay_host_blocks(capsys, tmp_path):
    from kvevict.cli import main

    assert main(["replay", "--policies", "lru", "--sizes", "200", "--host-blocks", "800",
                 "--quiet", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "with a host tier of 800 blocks (lru, host-pcie5)" in out
    assert "| policy | pool blocks | hit device | hit host | hit total |" in out
    # read back (--from): the same tables, the tier named from results.json
    assert main(["replay", "--from", str(tmp_path)]) == 0
    assert out.startswith(capsys.readouterr().out)


# -- the batched demotion equals one placement after another --------------------------------


class OneByOne(TierStack):
    """The reference: each evicted block placed on its own through the general path."""

    def demote(self, blocks, now):
        for block in blocks:
            self._place(block, 1, now, None)


def _replay_state(stack_type, tier_policy, demote, profile, n=1500):
    from kvevict import OutOfBlocks
    from kvevict.replay import open_trace

    trace, block_size = open_trace("mooncake")
    stack = stack_type([Tier(400, profile, policy=tier_policy, name="host")], demote=demote)
    m = KVCacheManager(BlockPool(300, block_size), "lru", tiers=stack)
    for t, request in enumerate(trace):
        if t == n:
            break
        m.clock.set(float(t))
        try:
            m.begin(request)
        except OutOfBlocks:
            continue
        m.finish(request.request_id)
    m.check()
    tier = stack.tiers[0]
    table = [(slot, b.block_hash, b.num_children, b.last_access_tick)
             for slot, b in tier.records.items()]
    return stack.stats.as_dict(), m.stats.as_dict(), table, sorted(tier.candidates)


@pytest.mark.parametrize("tier_policy,demote,latency", [
    ("lru", "always", None), ("lru", "cost", 0.04), ("lfu", "cost", 0.04),
    ("lfu", "always", None)])
def test_a_burst_demoted_at_once_equals_one_block_at_a_time(tier_policy, demote, latency):
    profile = "host-pcie5" if latency is None else TierProfile("slow", 1e12, 1e12, latency)
    fast = _replay_state(TierStack, tier_policy, demote, profile)
    slow = _replay_state(OneByOne, tier_policy, demote, profile)
    assert fast == slow
    stats = fast[0]
    assert stats["reloads"] > 0 and stats["drops"]["last_tier"] > 0
    if demote == "cost":  # blocks shallower than the crossover (84) were dropped
        assert stats["drops"]["cost"] > 0
