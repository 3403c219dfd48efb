"""Real tiers under the built-in engine (kvevict.engine.tiers): a host tier (a second CPU
tensor) and a disk tier (checksummed files in a temp dir) below the engine's pool.

- a reloaded block's KV is bit-identical to what the model wrote, per tier, dtype and layout;
- a replay over tiers answers token for token what an unbounded pool answers, with its
  reloads counted by tier (golden numbers on a fixed clock);
- a corrupted or truncated block file is a miss with a logged warning (the block is
  recomputed, never served) and an unwritable directory is back-pressure (the block is
  dropped, counted), each leaving ``check()`` true and the answers identical;
- the crossover table's arithmetic on hand-built links and cost models;
- ``kvevict engine-bench --host-gib --disk-dir`` writes the tiers' report.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from engine_clock import fake_timer

from kvevict.admission import Admission, AdmissionDecision
from kvevict.cli import main
from kvevict.cost import CostModel
from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.answers import compare_answers
from kvevict.engine.driver import run_engine, tier_priced_cost, unbounded_capacity
from kvevict.engine.tiers import (
    LinkFit,
    TimedTierStack,
    crossover_table,
    engine_tiers,
    measure_link,
    measure_recompute,
)
from kvevict.errors import AdmissionDeferred, ConfigError, OutOfBlocks
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.scheduler import SchedulerConfig
from kvevict.tiers import DiskStore, Tier, TierProfile
from kvevict.types import ManualClock, Request
from kvevict.workloads import generate

BLOCK = 16
VOCAB = 64
CONFIG = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6)
LAYOUTS = {"gqa": 2, "mha": 4, "mqa": 1}  # kv heads of a 4-head model
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 logits of one prefix, computed in other shapes



def tiny(dtype=torch.float32, kv_heads=2) -> LlamaModel:
    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=kv_heads, head_dim=8, intermediate_size=64, dtype=dtype)
    return LlamaModel(config, seed=0)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny()


def chat(n: int = 18) -> list[Request]:
    return generate("chat", seed=1, vocab_size=VOCAB, duration=300, sessions_per_minute=12,
                    output_tokens_mean=20, user_tokens_mean=20, system_prompt_tokens=32,
                    think_time_median=0.5, decode_seconds_per_token=0.001,
                    first_continue_prob=0.8, later_continue_prob=0.8)[:n]


def prompt(start: int, blocks: int) -> list[int]:
    return [(start + i) % VOCAB for i in range(blocks * BLOCK)]


def prefill(manager: KVCacheManager, model: LlamaModel, rid: str, tokens: list[int]):
    """Begin ``rid``, run the model over what is not cached, finish; returns the sequence
    and the logits of its last position."""
    seq = manager.begin(Request(rid, tokens=tokens))
    start = seq.num_cached_tokens
    ids = torch.tensor(tokens[start:] if start < len(tokens) else tokens[-1:])
    pos = start if start < len(tokens) else len(tokens) - 1
    table = list(seq.block_table)
    kv = manager.pool.kv
    saved = kv[:, :, table[pos // BLOCK], pos % BLOCK].clone()
    logits = model.forward_paged(manager.pool, [(ids, pos, table)])[0]
    if start >= len(tokens):  # a fully reloaded prompt: leave its last block as it was
        kv[:, :, table[pos // BLOCK], pos % BLOCK] = saved
    else:
        manager.prefill(rid)
    manager.finish(rid)
    manager.check()
    return seq, logits


def tiered_manager(model, tmp_path, tier: str, pool_blocks: int = 8, host_blocks: int = 16,
                   disk_blocks: int = 64):
    layout = model.config.layout()
    per_block = layout.bytes_per_block(BLOCK)
    stack = engine_tiers(layout, BLOCK, host_bytes=host_blocks * per_block if tier != "disk"
                         else 0, disk_dir=tmp_path / "disk" if tier != "host" else None,
                         disk_bytes=disk_blocks * per_block, demote="always")
    pool = BlockPool(pool_blocks, BLOCK, layout, device="cpu")
    return KVCacheManager(pool, "lru", clock=ManualClock(), tiers=stack), stack


# -- bit-identical reloads ------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype,layout", [(torch.float32, "gqa"), (torch.bfloat16, "gqa"),
                                          (torch.float16, "gqa"), (torch.float32, "mha"),
                                          (torch.bfloat16, "mqa")])
def test_a_reloaded_block_is_bit_identical(tmp_path, tier, dtype, layout):
    model = tiny(dtype, LAYOUTS[layout])
    manager, stack = tiered_manager(model, tmp_path, tier)
    tokens = prompt(0, 4)
    prefill(manager, model, "a", tokens)
    written = manager.pool.kv[:, :, list(manager.lookup(tokens).block_ids)].clone()
    assert written.dtype == dtype and written.abs().sum() > 0
    prefill(manager, model, "b", prompt(7, 8))  # 8 blocks: every one of a's goes down
    assert sorted(b.depth for b in stack) == [0, 1, 2, 3]
    assert {b.tier for b in stack} == {tier}
    again = manager.begin(Request("c", tokens=tokens), max_new_tokens=0)
    assert again.reloaded == (4,) and again.num_cached_tokens == 64
    reloaded = manager.pool.kv[:, :, list(again.block_table)]
    assert torch.equal(reloaded.view(torch.uint8), written.view(torch.uint8))
    assert stack.stats.hit_blocks == {tier: 4}
    assert stack.stats.bytes_read == {tier: 4 * stack.bytes_per_block}
    manager.finish("c")
    manager.check()


def test_a_reloaded_prefix_gives_the_logits_of_a_fresh_prefill(model, tmp_path):
    manager, stack = tiered_manager(model, tmp_path, "both", host_blocks=2)
    tokens = prompt(3, 4) + [5, 6, 7]  # 4 whole blocks and 3 tokens more
    _, first = prefill(manager, model, "a", tokens)
    prefill(manager, model, "b", prompt(40, 8))
    assert {b.depth: b.tier for b in stack} == {0: "host", 1: "host", 2: "disk", 3: "disk"}
    seq, again = prefill(manager, model, "c", tokens)
    assert seq.reloaded == (2, 2) and seq.num_cached_tokens == 64
    dense = model.forward_dense(torch.tensor(tokens))[-1]
    torch.testing.assert_close(again, first, **TOL)  # 3 positions vs 67: other kernels
    torch.testing.assert_close(again, dense, **TOL)


# -- the engine's answers over tiers --------------------------------------------------------


def test_answers_over_tiers_equal_the_unbounded_pool(model, tmp_path):
    requests = chat()
    small = max(-(-(r.prompt_len + r.output_len) // BLOCK) for r in requests)
    ref = run_engine(requests, model, capacity_blocks=unbounded_capacity(requests, BLOCK, 6),
                     block_size=BLOCK, config=CONFIG, timer=fake_timer())
    bare = run_engine(requests, model, capacity_blocks=small, block_size=BLOCK,
                      config=CONFIG, timer=fake_timer())
    layout = model.config.layout()
    per_block = layout.bytes_per_block(BLOCK)
    stack = engine_tiers(layout, BLOCK, host_bytes=8 * per_block, disk_dir=tmp_path / "d",
                         disk_bytes=64 * per_block, demote="always", timer=fake_timer(1e-6))
    tiered = run_engine(requests, model, capacity_blocks=small, block_size=BLOCK,
                        config=CONFIG, timer=fake_timer(), tiers=stack, check=True)
    assert compare_answers(ref, tiered).identical
    assert compare_answers(ref, bare).identical
    t = tiered.tiers
    # golden numbers of this fixed-clock replay: 12 reloads, 11 from the host, 1 from disk
    assert t["hits_by_tier"] == {"device": 102, "host": 11, "disk": 1}
    assert t["reloads"] == 12 and t["checksum_failures"] == 0 and t["drops"] == {}
    assert t["bytes_read"] == {"host": 11 * per_block, "disk": per_block}
    assert t["demotions"] == {"host": 38, "disk": 25}
    assert t["bytes_written"] == {"host": 38 * per_block, "disk": 25 * per_block}
    assert tiered.summary()["tiers"] == t
    s_tiered, s_bare, s_ref = (r.sim.summary() for r in (tiered, bare, ref))
    # the tiers give back what the small pool lost: the unbounded pool's hits, exactly
    assert s_tiered["token_hit_ratio"] == s_ref["token_hit_ratio"] == 0.78961
    assert s_bare["token_hit_ratio"] == 0.706494
    assert sum(tiered.engine_prefill_tokens.values()) == 486
    assert sum(bare.engine_prefill_tokens.values()) == 678


def test_a_cost_aware_policy_prices_the_reload_from_the_tier_below(model):
    layout = model.config.layout()
    cost = CostModel(linear_s_per_token=1e-3, attn_s_per_pair=1e-6, kv_bytes_per_token=1)
    link = TierProfile("slow", 1e6, 1e6, 2e-3)
    stack = engine_tiers(layout, BLOCK, host_bytes=10**6, host_profile=link)
    nbytes = layout.bytes_per_block(BLOCK)  # 4,096 bytes: a 6.096 ms reload
    priced = tier_priced_cost(stack, cost, 10.0, nbytes)
    assert priced.loss_reload_s == pytest.approx(10 * (2e-3 + nbytes / 1e6))
    assert priced.linear_s_per_token == pytest.approx(1e-3)  # already workload seconds
    # depth 0: a 16.1 ms recompute beats the 61 ms reload; depth 300 (93 ms) does not
    assert priced.recompute_seconds(0, BLOCK) == pytest.approx(
        cost.prefill_seconds(BLOCK, 0))
    assert cost.recompute_seconds(300, BLOCK) > priced.loss_reload_s
    assert priced.recompute_seconds(300, BLOCK) == pytest.approx(priced.loss_reload_s)


# -- faults -----------------------------------------------------------------------------------


def corrupt(path, how: str) -> None:
    raw = path.read_bytes()
    if how == "flip":
        raw = raw[:100] + bytes([raw[100] ^ 0x01]) + raw[101:]
    else:
        raw = raw[:len(raw) // 2]
    path.write_bytes(raw)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_corrupted_block_file_is_a_logged_miss(model, tmp_path, caplog, how):
    manager, stack = tiered_manager(model, tmp_path, "disk")
    tokens = prompt(0, 4) + [9, 9]
    _, first = prefill(manager, model, "a", tokens)
    prefill(manager, model, "b", prompt(30, 8))
    disk = stack.tier("disk")
    third = next(b for b in stack if b.depth == 2)
    corrupt(disk.store.path_of(third.block_hash), how)
    with caplog.at_level(logging.WARNING, logger="kvevict.tiers"):
        seq, again = prefill(manager, model, "c", tokens)
    assert "failed its checksum" in caplog.text
    assert seq.reloaded == (2,) and seq.num_cached_tokens == 32  # depths 0-1 only
    assert stack.stats.checksum_failures == 1
    assert stack.stats.drops == {"corrupt": 1, "cascade": 1}  # depth 3 lost its parent
    torch.testing.assert_close(again, first, **TOL)  # depths 2-3 recomputed
    manager.check()


def test_corrupted_files_mid_run_leave_the_answers_identical(model, tmp_path, caplog):
    requests = chat()
    small = max(-(-(r.prompt_len + r.output_len) // BLOCK) for r in requests)
    ref = run_engine(requests, model, capacity_blocks=unbounded_capacity(requests, BLOCK, 6),
                     block_size=BLOCK, config=CONFIG, timer=fake_timer())
    layout = model.config.layout()
    per_block = layout.bytes_per_block(BLOCK)
    directory = tmp_path / "d"
    stack = engine_tiers(layout, BLOCK, disk_dir=directory, disk_bytes=64 * per_block,
                         demote="always")
    flipped: set[str] = set()

    def flip_new_files(_scheduler) -> None:  # every block file is corrupted once written
        for path in directory.glob("*.kvblock"):
            if path.name not in flipped:
                corrupt(path, "flip")
                flipped.add(path.name)

    with caplog.at_level(logging.WARNING, logger="kvevict.tiers"):
        run = run_engine(requests, model, capacity_blocks=small, block_size=BLOCK,
                         config=CONFIG, timer=fake_timer(), tiers=stack, check=True,
                         on_step=flip_new_files)
    assert compare_answers(ref, run).identical
    t = run.tiers
    assert t["checksum_failures"] > 0 and t["hits_by_tier"]["disk"] == 0
    assert t["drops"]["corrupt"] == t["checksum_failures"]
    assert caplog.text.count("failed its checksum") == t["checksum_failures"]


def test_an_unwritable_directory_is_back_pressure(model, tmp_path):
    manager, stack = tiered_manager(model, tmp_path, "disk")
    directory = tmp_path / "disk"
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # every write fails, even as root
    tokens = prompt(0, 4)
    _, first = prefill(manager, model, "a", tokens)
    prefill(manager, model, "b", prompt(30, 8))
    assert stack.stats.drops == {"back_pressure": 4} and len(stack) == 0
    seq, again = prefill(manager, model, "c", tokens)
    assert seq.reloaded == () and seq.num_cached_tokens == 0  # recomputed
    torch.testing.assert_close(again, first, **TOL)
    manager.check()


def test_bad_tier_sizes_are_refused(model, tmp_path):
    layout = model.config.layout()
    with pytest.raises(ConfigError, match="holds no 4,096-byte block"):
        engine_tiers(layout, BLOCK, host_bytes=100)
    with pytest.raises(ConfigError, match="needs host_bytes > 0 or a disk_dir"):
        engine_tiers(layout, BLOCK)
    with pytest.raises(ConfigError, match="host_bytes must be a number of bytes"):
        engine_tiers(layout, BLOCK, host_bytes=-1)
    with pytest.raises(ConfigError, match=r"tiers must be a kvevict\.tiers\.TierStack"):
        run_engine(chat(2), model, capacity_blocks=64, tiers="host")


# -- measurement ------------------------------------------------------------------------------


def test_crossover_table_on_hand_built_links():
    cost = CostModel(prefill_overhead_s=0.0, linear_s_per_token=1e-4, attn_s_per_pair=1e-6,
                     kv_bytes_per_token=0)
    # recompute(d) = 16 * 1e-4 + 1e-6 * 16 * (16 d + 8.5) = 1.736e-3 + 2.56e-4 d
    fast = LinkFit(TierProfile("fast", 1e9, 1e9, 1e-5), 4096, ((1, 1.2e-5, 0.0),
                                                               (2, 2.0e-5, 0.0)),
                   (1e-5, 4.1e-6), (0.0, 0.0), None)
    slow = LinkFit(TierProfile("slow", 4096 / 1e-3, 1e9, 1.5e-3), 4096,
                   ((1, 3.0e-3, 0.0), (2, 4.0e-3, 0.0)), (1.5e-3, 1e-3), (0.0, 0.0), True)
    measured = {0: 2.0e-3, 2: 2.5e-3, 4: 3.5e-3, 8: 4.0e-3}
    table = crossover_table(measured, {"fast": fast, "slow": slow}, cost, BLOCK)
    rows = table["rows"]
    assert [r["depth"] for r in rows] == [0, 2, 4, 8]
    assert rows[1]["recompute_predicted_s"] == pytest.approx(1.736e-3 + 2 * 2.56e-4)
    assert rows[0]["slow_reload_s"] == 3.0e-3
    assert rows[0]["slow_reload_predicted_s"] == pytest.approx(2.5e-3)
    # measured: the fast link wins from depth 0; the slow one (3 ms) from depth 4 (3.5 ms)
    # predicted: 1.736e-3 + 2.56e-4 d > 2.5e-3 from d = 3; the fast link from depth 0
    assert table["crossover"] == {"fast": {"measured": 0, "predicted": 0},
                                  "slow": {"measured": 4, "predicted": 3}}


def test_measure_link_and_recompute_shapes(model, tmp_path):
    layout = model.config.layout()
    host = measure_link("host", layout, BLOCK, block_counts=(1, 2), repeats=1)
    disk = measure_link("disk", layout, BLOCK, directory=tmp_path, block_counts=(1, 3),
                        repeats=1)
    assert [p[0] for p in host.points] == [1, 2] and [p[0] for p in disk.points] == [1, 3]
    assert host.cold is None and disk.cold in (True, False)
    assert host.profile.real and host.bytes_per_block == layout.bytes_per_block(BLOCK)
    assert list(tmp_path.glob("**/*.kvblock")) == []  # its files are removed
    times = measure_recompute(model, BLOCK, depths=(0, 3), repeats=1)
    assert sorted(times) == [0, 3] and all(t > 0 for t in times.values())
    with pytest.raises(ConfigError, match="at least two distinct"):
        measure_link("host", layout, BLOCK, block_counts=(4,))
    with pytest.raises(ConfigError, match="'host' or 'disk'"):
        measure_link("tape", layout, BLOCK)


def test_timed_stack_times_the_load(model, tmp_path):
    layout = model.config.layout()
    stack = engine_tiers(layout, BLOCK, host_bytes=8 * layout.bytes_per_block(BLOCK),
                         demote="always", timer=fake_timer(1.0))
    assert isinstance(stack, TimedTierStack)
    pool = BlockPool(4, BLOCK, layout, device="cpu")
    manager = KVCacheManager(pool, "lru", clock=ManualClock(), tiers=stack)
    prefill(manager, model, "a", prompt(0, 2))
    prefill(manager, model, "b", prompt(20, 4))
    manager.begin(Request("c", tokens=prompt(0, 2)), max_new_tokens=0)
    assert stack.reload_batches == 1
    # c's load (a's two blocks), one tick of the 1-second fake clock; its take (a hold) reads
    # nothing and is not timed; a and b found nothing below the pool: no take
    assert stack.reload_seconds_measured == 1.0
    assert (stack.takes, stack.restored_takes) == (1, 0)


# -- the CLI ------------------------------------------------------------------------------------


def test_engine_bench_with_tiers_writes_their_report(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["engine-bench", "--requests", "8", "--scale", "2", "--max-seqs", "8",
            "--max-batched-tokens", "128", "--cold-requests", "2", "--quiet",
            "--vocab", "128", "--hidden", "16", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "8", "--intermediate", "32", "--device", "cpu",
            "--repeats", "1", "--policies", "lru", "--host-gib", "0.0001",
            "--disk-dir", str(tmp_path / "disk"), "--disk-gib", "0.001", "--demote", "always",
            "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "tiers: host 0.1 MiB (104 blocks" in text
    assert "disk 1.0 MiB under" in text
    result = json.loads((out / "results.json").read_text())
    tiers = result["tiers"]
    assert tiers["host_blocks"] == 104 and tiers["disk_blocks"] == 1048
    assert tiers["bytes_per_block"] == 1024 and tiers["demote"] == "always"
    assert set(tiers["links"]) == {"host", "disk"}
    assert set(tiers["by_policy"]) == {"lru"} and tiers["by_policy"]["lru"]["runs"] == 1
    assert result["lossless"]
    assert list((tmp_path / "disk").glob("run-*")) == []  # each run's files are removed
    lru = next(r for r in result["runs"] if r["policy"] == "lru")
    unbounded = next(r for r in result["runs"] if r["policy"] == "unbounded")
    assert "tiers" in lru["measured"] and "tiers" not in unbounded["measured"]


def test_engine_bench_tier_options_are_checked(capsys, tmp_path):
    base = ["engine-bench", "--requests", "4", "--quiet", "--device", "cpu"]
    rc = main([*base, "--host-gib", "-1"])
    assert rc == 2 and "--host-gib must be a finite number of GiB >= 0" in \
        capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    rc = main([*base, "--disk-dir", str(tmp_path / "f")])
    assert rc == 2 and "exists and is not a directory" in capsys.readouterr().err


def test_a_request_that_does_not_fit_takes_nothing(model):
    layout = model.config.layout()
    stack = engine_tiers(layout, BLOCK, host_bytes=8 * layout.bytes_per_block(BLOCK),
                         demote="always")
    manager = KVCacheManager(BlockPool(4, BLOCK, layout, device="cpu"), "lru",
                             clock=ManualClock(), tiers=stack)
    prefill(manager, model, "a", prompt(0, 2))
    prefill(manager, model, "b", prompt(20, 4))
    with pytest.raises(OutOfBlocks):  # a's 2 blocks below the pool, then 4 more: 6 > 4
        manager.begin(Request("c", tokens=prompt(0, 2) + prompt(50, 4)))
    # the capacity check comes before the take: nothing was held, nothing read
    assert (stack.takes, stack.restored_takes, stack.reload_batches) == (0, 0, 0)
    assert sorted(b.depth for b in stack) == [0, 1] and stack.stats.reloads == 0
    manager.check()


class CountingDisk(DiskStore):
    """A disk store that counts its block reads (each one a file read and a checksum)."""

    reads = 0

    def read(self, slot, block):
        self.reads += 1
        return super().read(slot, block)


class Defer(Admission):
    """Defers request ``rid`` the first ``times`` times it would evict, then admits."""

    def __init__(self, rid: str, times: int) -> None:
        self.rid, self.left = rid, times

    def admit(self, request, num_evictions, manager, now):
        if request.request_id == self.rid and self.left:
            self.left -= 1
            return AdmissionDecision(False, "test", 1.0)
        return AdmissionDecision(True)


def disk_manager(model, tmp_path, admission=None):
    layout = model.config.layout()
    store = CountingDisk(tmp_path / "disk")
    stack = TimedTierStack([Tier(16, "nvme", store=store)], demote="always",
                           timer=fake_timer(1.0))
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(4, BLOCK, layout, device="cpu"), "lru", clock=clock,
                             tiers=stack, admission=admission)
    return manager, stack, store, clock


def test_a_request_retried_until_it_fits_reads_its_disk_chain_once(model, tmp_path):
    manager, stack, store, clock = disk_manager(model, tmp_path)
    _, first = prefill(manager, model, "a", prompt(0, 2))
    prefill(manager, model, "b", prompt(20, 4))  # a's 2 blocks go to disk
    assert sorted(b.depth for b in stack) == [0, 1] and store.reads == 0
    manager.begin(Request("hog", tokens=prompt(40, 3)))  # 3 of the 4 pool blocks in use
    for t in range(1, 6):  # c needs a's 2 blocks reloaded, 1 pool block is free
        clock.set(float(t))
        with pytest.raises(OutOfBlocks):
            manager.begin(Request("c", tokens=prompt(0, 2)))
        manager.check()
    assert (stack.takes, stack.restored_takes, store.reads) == (0, 0, 0)
    manager.finish("hog")
    clock.set(6.0)
    seq, again = prefill(manager, model, "c", prompt(0, 2))
    assert seq.reloaded == (2,) and seq.num_cached_tokens == 2 * BLOCK
    # five retries and the start: one take, one load, each disk block read once
    assert (stack.takes, stack.restored_takes, stack.reload_batches) == (1, 0, 1)
    assert store.reads == 2 and stack.stats.reloads == 2
    torch.testing.assert_close(again, first, **TOL)


def test_a_deferred_request_holds_but_reads_nothing_until_it_loads(model, tmp_path):
    manager, stack, store, clock = disk_manager(model, tmp_path, admission=Defer("c", 3))
    prefill(manager, model, "a", prompt(0, 2))
    prefill(manager, model, "b", prompt(20, 4))  # a's 2 blocks on disk, b's 4 in the pool
    for t in range(1, 4):
        clock.set(float(t))
        with pytest.raises(AdmissionDeferred):  # fits, but only by evicting: deferred
            manager.begin(Request("c", tokens=prompt(0, 2)))
        manager.check()
    assert (stack.takes, stack.restored_takes, store.reads) == (3, 3, 0)
    clock.set(4.0)
    seq, _ = prefill(manager, model, "c", prompt(0, 2))
    assert seq.reloaded == (2,)
    assert (stack.takes, stack.restored_takes, stack.reload_batches) == (4, 3, 1)
    assert store.reads == 2  # each disk block read once, at the load
