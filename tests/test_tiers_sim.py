"""Memory tiers in the simulator (kvevict.sim.TierConfig, kvevict.run.TierTransfers): reloads
queued on a shared link and charged to the TTFT, prefetch overlapping the queue wait, the
policies priced with the tiers' reload costs, untiered runs unchanged, the CLI's tier flags."""

from __future__ import annotations

import math
import re
from typing import ClassVar

import pytest

from kvevict import ConfigError, CostModel, Request
from kvevict.box import Box, gpu_profile
from kvevict.cli import main
from kvevict.layout import preset
from kvevict.policies.lru import LRU
from kvevict.policies.registry import POLICIES, register_policy
from kvevict.run import Link
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import TierConfig, host_link_profile, simulate
from kvevict.study import Cell, Source, Study, run_cell
from kvevict.tiers import TIER_PROFILES, TierPricedCost, TierProfile

BS = 4
#: one second per prompt token, nothing else: a block costs 4 s to recompute
COST = CostModel(linear_s_per_token=1.0, attn_s_per_pair=0.0, prefill_overhead_s=0.0,
                 decode_step_s=0.5, decode_s_per_context_token=0.0, kv_bytes_per_token=100)
#: 400 bytes a block at 400 B/s and 0.5 s per transfer: reloading n blocks takes 0.5 + n s
LINK = TierProfile("test-link", 400.0, 400.0, 0.5)


def req(rid, arrival, *runs, out=1):
    """A request whose prompt is the token ranges ``runs`` (each ``(start, blocks)``)."""
    tokens = [t for start, blocks in runs for t in range(start, start + blocks * BS)]
    return Request(rid, tokens=tokens, arrival=arrival, output_len=out)


def warm_up():
    """a and b cache 4 blocks each (0..36 s); c (10 blocks) fills the 10-block pool at 40 s
    and pushes all 8 down to the host tier (a reload, 1.5 s a block, beats a recompute, 4 s)."""
    return [req("a", 0.0, (0, 4)), req("b", 20.0, (100, 4)), req("c", 40.0, (200, 10))]


def run(requests, *, prefetch=False, seqs=64, host=32, policy="lru"):
    tiers = TierConfig(host, host_profile=LINK, prefetch=prefetch)
    result = simulate(requests, policy, capacity_blocks=10, block_size=BS, cost=COST,
                      config=SchedulerConfig(max_num_seqs=seqs), tiers=tiers)
    return result, {r.request_id: r for r in result.records}


def test_two_reloads_queue_on_one_link():
    # a2 and b2 arrive together at 100 and are admitted in the same pass, each reloading
    # 4 blocks from the host: a2's transfer runs 100 -> 104.5, b2's waits for it and runs
    # 104.5 -> 109. Each then prefills its one new block (4 s).
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1)),
                            req("b2", 100.0, (100, 4), (400, 1))]
    result, recs = run(requests)
    a2, b2 = recs["a2"], recs["b2"]
    assert (a2.cached_tokens, b2.cached_tokens) == (16, 16)
    assert a2.reload_s == pytest.approx(4.5) and a2.prefill_s == pytest.approx(4.0)
    assert a2.ttft == pytest.approx(8.5)
    assert b2.reload_s == pytest.approx(9.0)  # 4.5 of it queued behind a2's transfer
    assert b2.prefill_s == pytest.approx(4.0)
    assert b2.ttft == pytest.approx(13.0)
    for r in (a2, b2):
        assert r.wait_memory == 0 and r.wait_compute == pytest.approx(0.0, abs=1e-9)
        assert r.ttft == pytest.approx(r.wait_memory + r.wait_compute + r.prefill_s
                                       + r.reload_s)
    tiers = result.summary()["tiers"]
    assert tiers["hit_blocks"] == {"device": 0, "host": 8}
    assert tiers["links"]["host"] == {"busy_s": 9.0, "utilization": round(9.0 / 113.0, 6),
                                      "queued_s": 4.5, "transfers": 2, "blocks": 8}
    # a, b and then 10 of c's blocks went down; nothing was dropped
    assert tiers["demotions"] == {"host": 18} and tiers["drops"] == {}
    assert result.summary()["reload_s_mean"] == pytest.approx((4.5 + 9.0) / 5)


def test_a_block_still_on_the_link_is_not_there_for_another_request():
    # a2 reloads blocks 0..3 from the host at 100 (they land at 104.5). b3 arrives at 101 and
    # finds them in the pool, on their way: it waits for them too (3.5 s of reload), then
    # both prefill their one new block in one step (8 tokens, 8 s). Before, b3 ran at 101 on
    # KV that had not arrived and had its first token at 105.
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1)),
                            req("b3", 101.0, (0, 4), (600, 1))]
    _, recs = run(requests)
    a2, b3 = recs["a2"], recs["b3"]
    assert (a2.cached_tokens, b3.cached_tokens) == (16, 16)
    assert a2.reload_s == pytest.approx(4.5) and b3.reload_s == pytest.approx(3.5)
    assert a2.prefill_s == pytest.approx(8.0) and b3.prefill_s == pytest.approx(8.0)
    assert a2.arrival + a2.ttft == pytest.approx(112.5)
    assert b3.arrival + b3.ttft == pytest.approx(112.5)


def test_a_block_no_step_has_computed_is_not_in_the_cache():
    # a2 waits for its reload (100 -> 104.5) before it prefills block 300. c3, the same
    # prompt at 101, cannot hit block 300 before a step computes it: it waits for blocks
    # 0..3 like a2 and computes block 300 itself in the same step. Before, a2's block was
    # cached from its admission on: c3 hit all 20 tokens and had its first token at 102,
    # 6.5 s before a2 computed them (every token served must have been computed: the run's
    # prefill tokens are at least an infinite cache's, 77).
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1)),
                            req("c3", 101.0, (0, 4), (300, 1))]
    result, recs = run(requests)
    c3 = recs["c3"]
    assert c3.cached_tokens == 16 and c3.computed_prefill_tokens == 4
    assert c3.reload_s == pytest.approx(3.5)
    assert c3.arrival + c3.ttft == pytest.approx(112.5)
    summary = result.summary()
    assert (summary["prefill_tokens_computed"], result.infinite_compute_tokens) == (80, 77)
    assert summary["recomputed_prefill_tokens"] == 3


def test_a_request_loading_its_kv_takes_no_seat():
    # one seat. a2 reloads blocks 0..3 from the host (100 -> 104.5) and takes no seat while
    # it waits, as in vLLM (WAITING_FOR_REMOTE_KVS): d, a fresh one-block prompt at 100.5,
    # takes the seat and prefills (4 s). At 104.5 a2's KV is in but d still holds the seat
    # for its second token (0.5 s); a2 takes it at 105 and prefills its new block (4 s).
    # Before, a2 held the seat from 100: d waited for a2's first token at 108.5 and had
    # its own at 112.5.
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1)),
                            req("d", 100.5, (700, 1), out=2)]
    _, recs = run(requests, seqs=1)
    a2, d = recs["a2"], recs["d"]
    assert (d.ttft, d.prefill_s, d.wait_compute) == (4.0, 4.0, 0.0)
    assert d.arrival + d.ttft == 104.5 and d.finish == 105.0
    assert a2.reload_s == pytest.approx(4.5) and a2.wait_compute == pytest.approx(0.5)
    assert a2.prefill_s == pytest.approx(4.0) and a2.arrival + a2.ttft == pytest.approx(109.0)


def test_free_bandwidth_would_not_queue():
    # the same two reloads a minute apart: nothing to queue behind, 4.5 s each
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1)),
                            req("b2", 160.0, (100, 4), (400, 1))]
    _, recs = run(requests)
    assert recs["a2"].reload_s == pytest.approx(4.5)
    assert recs["b2"].reload_s == pytest.approx(4.5)


@pytest.mark.parametrize("new_blocks, wait, reload", [(2, 7.0, 0.0), (1, 3.0, 1.5)])
def test_prefetch_overlaps_the_queue_wait(new_blocks, wait, reload):
    # one seat: x (new_blocks blocks of new tokens, 4 s a block) runs from 100; a2 arrives at
    # 101 and waits for the seat. Its prefetch crosses the link 101 -> 105.5 meanwhile: x
    # ending at 108 hides all of it, x ending at 104 leaves 1.5 s of it.
    requests = warm_up() + [req("x", 100.0, (500, new_blocks)),
                            req("a2", 101.0, (0, 4), (300, 1))]
    _, on = run(requests, prefetch=True, seqs=1)
    _, off = run(requests, prefetch=False, seqs=1)
    a2 = on["a2"]
    assert a2.wait_compute == pytest.approx(wait)
    assert a2.reload_s == pytest.approx(reload, abs=1e-9)
    assert a2.prefill_s == pytest.approx(4.0)
    assert a2.ttft == pytest.approx(wait + reload + 4.0)
    # without prefetch the whole 4.5 s transfer starts at its admission
    assert off["a2"].wait_compute == pytest.approx(wait)
    assert off["a2"].reload_s == pytest.approx(4.5)
    assert off["a2"].ttft - a2.ttft == pytest.approx(4.5 - reload)


def test_prefetch_counts_what_it_staged_and_used():
    requests = warm_up() + [req("x", 100.0, (500, 2)), req("a2", 101.0, (0, 4), (300, 1))]
    result, _ = run(requests, prefetch=True, seqs=1)
    assert result.summary()["tiers"]["prefetch"] == {"enabled": True, "blocks": 4, "used": 4,
                                                     "peak_staged_blocks": 4}


def test_a_reload_from_the_disk_tier_crosses_both_links():
    # a 2-block host tier: a's blocks, demoted first, end in the disk tier below (its own
    # link: 0.25 s a transfer, 1 s a block); a2 reloads its 4 blocks over disk -> host
    # (0.25 + 4 s), then host -> device (0.5 + 4 s)
    disk = TierProfile("test-disk", 400.0, 400.0, 0.25)
    tiers = TierConfig(2, disk_blocks=32, host_profile=LINK, disk_profile=disk)
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1))]
    result = simulate(requests, "lru", capacity_blocks=10, block_size=BS, cost=COST,
                      tiers=tiers)
    a2 = {r.request_id: r for r in result.records}["a2"]
    assert result.summary()["tiers"]["hit_blocks"] == {"device": 0, "host": 0, "disk": 4}
    assert a2.reload_s == pytest.approx(4.25 + 4.5)


def test_a_staged_block_that_moves_down_a_tier_counts_where_it_was_read():
    # an 8-block host tier over a disk tier, one seat. x's blocks (admitted at 100, decoding
    # until 112.5) push a's blocks down: its tail reaches the disk at 100, the other three
    # after 101, when a2 arrives and prefetches them: three over the host link, the tail
    # over the disk's and then the host's. At a2's admission all four are on the disk, and
    # the staged copies serve them (no reload wait): three host reads and one disk read, as
    # the links moved them. (Before: four disk reads, through a disk link that moved one.)
    disk = TierProfile("test-disk", 400.0, 400.0, 0.25)
    tiers = TierConfig(8, disk_blocks=32, host_profile=LINK, disk_profile=disk, prefetch=True)
    requests = warm_up() + [req("x", 100.0, (500, 1), out=17),
                            req("a2", 101.0, (0, 4), (300, 1))]
    result = simulate(requests, "lru", capacity_blocks=10, block_size=BS, cost=COST,
                      config=SchedulerConfig(max_num_seqs=1), tiers=tiers)
    t = result.summary()["tiers"]
    assert t["hit_blocks"] == {"device": 0, "host": 3, "disk": 1}
    assert t["bytes_read"] == {"host": 1200, "disk": 400}
    assert (t["links"]["host"]["blocks"], t["links"]["disk"]["blocks"]) == (4, 1)
    assert t["prefetch"]["used"] == 4
    a2 = {r.request_id: r for r in result.records}["a2"]
    assert a2.cached_tokens == 16 and a2.reload_s == 0.0


def test_untiered_results_are_unchanged_when_nothing_is_evicted():
    # a pool that never evicts: the tiers see nothing, every number is the untiered one
    requests = warm_up() + [req("a2", 100.0, (0, 4), (300, 1), out=3)]
    plain = simulate(requests, "lru", capacity_blocks=64, block_size=BS, cost=COST)
    tiered = simulate(requests, "lru", capacity_blocks=64, block_size=BS, cost=COST,
                      tiers=TierConfig(8, host_profile=LINK))
    a, b = plain.summary(), tiered.summary()
    assert b.pop("tiers")["demotions"] == {}
    assert a == b and plain.records == tiered.records


# -- the policies across tiers ------------------------------------------------------------


class CostCapture(LRU):
    """LRU that keeps the cost model it was built with."""

    built: ClassVar[list] = []

    def __init__(self, cost_model: CostModel | None = None) -> None:
        super().__init__()
        self.cost_model = cost_model
        CostCapture.built.append(cost_model)


@pytest.fixture
def capture():
    if "test-cost-capture" not in POLICIES:
        register_policy("test-cost-capture")(CostCapture)
    CostCapture.built.clear()
    yield CostCapture.built


def test_a_value_aware_policy_prices_with_the_tier_below(capture):
    simulate(warm_up(), "test-cost-capture", capacity_blocks=10, block_size=BS, cost=COST,
             tiers=TierConfig(8, host_profile=LINK))
    host, pool = capture  # the stack builds the host tier's policy first, then the pool's
    assert isinstance(pool, TierPricedCost) and isinstance(host, TierPricedCost)
    # losing a block from the pool costs a reload from the host (1.5 s < a 4 s recompute)
    assert pool.loss_reload_s == pytest.approx(1.5) and pool.kept_reload_s == 0
    assert pool.recompute_seconds(0, BS) == pytest.approx(1.5)
    # losing it from the host (nothing below) costs the recompute, less the reload it costs
    assert math.isinf(host.loss_reload_s) and host.kept_reload_s == pytest.approx(1.5)
    assert host.recompute_seconds(3, BS) == pytest.approx(4.0 - 1.5)


def test_the_tier_policy_can_differ_from_the_pool(capture):
    simulate(warm_up(), "test-cost-capture", capacity_blocks=10, block_size=BS, cost=COST,
             tiers=TierConfig(8, host_profile=LINK, policy="lru"))
    assert len(capture) == 1  # the pool's; the host tier runs LRU


def test_market_in_every_tier():
    result, _ = run(warm_up() + [req("a2", 100.0, (0, 4), (300, 1))], policy="market")
    assert result.summary()["tiers"]["tiers"][0]["policy"] == "market"
    assert result.summary()["tiers"]["hit_blocks"] == {"device": 0, "host": 4}


# -- configuration -------------------------------------------------------------------------


def test_the_host_link_is_the_boxs():
    cost = Box(gpu_profile("l4-24gb")).cost_model(preset("llama-3-8b"))
    link = host_link_profile(cost)
    assert link.read_bytes_per_s == 32e9 == link.write_bytes_per_s  # the L4's PCIe Gen4 x16
    assert link.latency_s == TIER_PROFILES["host-pcie5"].latency_s
    two = Box(gpu_profile("h100-sxm-80gb"), gpus=2).cost_model(preset("llama-3-8b"))
    assert host_link_profile(two).read_bytes_per_s == 2 * 64e9  # a link per GPU


@pytest.mark.parametrize("kwargs, match", [
    ({"host_blocks": 0}, "host_blocks must be an int >= 1"),
    ({"host_blocks": 2.5}, "host_blocks must be an int >= 1"),
    ({"host_blocks": 4, "disk_blocks": -1}, "disk_blocks must be an int >= 0"),
    ({"host_blocks": 4, "host_profile": "pcie9"}, "host_profile must be a TierProfile or one"),
    ({"host_blocks": 4, "prefetch": "yes"}, "prefetch must be True or False"),
    ({"host_blocks": 4, "demote": "never"}, "demote must be one of cost, always"),
    ({"host_blocks": 4, "policy": ""}, "policy must be a registered policy name"),
])
def test_tier_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TierConfig(**kwargs)


def test_simulate_tier_errors():
    with pytest.raises(ConfigError, match="tiers must be a TierConfig"):
        simulate(warm_up(), capacity_blocks=10, block_size=BS, tiers=8)
    with pytest.raises(ConfigError, match="needs a timed run"):
        simulate(warm_up(), capacity_blocks=10, block_size=BS, timing=False,
                 tiers=TierConfig(8))
    with pytest.raises(ConfigError, match="is offline"):
        simulate(warm_up(), capacity_blocks=10, block_size=BS, tiers=TierConfig(8,
                 policy="belady"))


def test_link_serves_in_order():
    link = Link("l", LINK)
    assert link.transfer(10.0, 2, 400) == pytest.approx(12.5)
    assert link.transfer(11.0, 1, 400) == pytest.approx(14.0)  # waits 1.5 s for the first
    assert link.transfer(20.0, 1, 400) == pytest.approx(21.5)  # idle again
    assert link.as_dict(100.0) == {"busy_s": 5.5, "utilization": 0.055, "queued_s": 1.5,
                                   "transfers": 3, "blocks": 4}


def test_a_study_cell_runs_with_its_tiers():
    study = Study(Source(workload="chat-steady", duration=20.0), preset("llama-3-8b"), 16,
                  CostModel(), tiers=TierConfig(256))
    out = run_cell(study, Cell("lru", 600, 0))
    own = run_cell(study, Cell("lru", 600, 0, tiers=TierConfig(128, prefetch=True)))
    assert out["tiers"]["tiers"][0]["capacity_blocks"] == 256
    assert out["tiers"]["prefetch"]["enabled"] is False
    assert own["tiers"]["tiers"][0]["capacity_blocks"] == 128
    assert own["tiers"]["prefetch"]["enabled"] is True
    with pytest.raises(ConfigError, match="only a timed cell has memory tiers"):
        Cell("lru", 64, 0, mode="replay", tiers=TierConfig(64))
    with pytest.raises(ConfigError, match=r"tiers must be a kvevict\.sim\.TierConfig"):
        Study(Source(workload="chat-steady"), preset("llama-3-8b"), 16, CostModel(), tiers=3)


# -- the CLI ---------------------------------------------------------------------------------


def cli(*flags):
    return main(["simulate", "--workload", "chat-steady", "--duration", "20", "--seeds", "1",
                 "--policies", "lru", "--no-sweep", "--quiet", "--jobs", "1", *flags])


@pytest.mark.parametrize("flags, match", [
    (["--host-gib", "0"], "--host-gib takes a positive finite size, got 0.0"),
    (["--host-gib", "-2"], "--host-gib takes a positive finite size, got -2.0"),
    (["--host-x", "inf"], "--host-x takes a positive finite size, got inf"),
    (["--host-x", "nan"], "--host-x takes a positive finite size, got nan"),
    (["--host-x", "4", "--disk-gib", "0"], "--disk-gib takes a positive finite size"),
    (["--disk-gib", "10"], "a disk tier sits below the host tier"),
    (["--prefetch"], "--prefetch applies to memory tiers"),
    (["--tier-policy", "lru"], "--tier-policy applies to memory tiers"),
    (["--host-gib", "0.001"], "--host-gib 0.001 holds no block of 16 tokens of llama-3-8b "
                              r"\(2,097,152 bytes per block\)"),
    (["--host-x", "0.0001"], "--host-x 0.0001 of 2,097 GPU blocks is no block"),
    (["--host-x", "4", "--tier-policy", "nope"], "unknown policy 'nope' for --tier-policy"),
    (["--host-x", "4", "--tier-policy", "belady"], "--tier-policy belady is offline"),
])
def test_cli_rejects_bad_tier_sizes(flags, match, capsys):
    assert cli(*flags) == 2
    err = capsys.readouterr().err
    assert "error:" in err
    assert re.search(match, err), err


def test_cli_host_and_gib_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli("--host-gib", "4", "--host-x", "4")
    assert "not allowed with argument" in capsys.readouterr().err


def test_cli_runs_with_a_host_tier(tmp_path, capsys):
    import json

    assert cli("--host-x", "2", "--prefetch", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "tiers: host 4,194 blocks (8.19 GiB, 2x the GPU's)" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["tiers"]["host_blocks"] == 4194 and data["tiers"]["prefetch"] is True
    assert data["tiers"]["host_memory_bytes"] == 4194 * 2097152
    assert "8.19 GiB host KV tier" in data["box"]["description"]
    assert data["cells"][0]["tiers"]["tiers"][0]["capacity_blocks"] == 4194
