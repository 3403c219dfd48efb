"""``kvevict simulate`` on a real box: each of issue 12's "why" items, end to end through the
CLI (an oversized cache, an unstable load, equal policies, the rate scale)."""

from __future__ import annotations

import json

import attrs
import pytest

from kvevict.cli import main
from kvevict.policies import LRU, register_policy
from kvevict.policies.registry import POLICIES
from kvevict.workloads import bundled_trace_path

MOONCAKE = ["simulate", "--trace", str(bundled_trace_path("mooncake")), "--format", "mooncake",
            "--gpu", "h100-sxm-80gb"]


def error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("kvevict: error: ") and "\n" not in message, message
    return message


def test_a_cache_larger_than_the_box_is_an_error_naming_both(capsys):
    # 5,000 blocks of 512 tokens of Llama-3-8B are 312.5 GiB; one H100 leaves 55.5 GiB (at
    # the default 32 running sequences; the decode load of rho is priced at batches of 32 too)
    message = error(capsys, [*MOONCAKE, "--cache-blocks", "5000", "--quiet"])
    assert "--cache-blocks 5,000 (312.5 GiB) is more than the box holds" in message
    assert "1 x H100 SXM 80 GB at 0.9 utilization leaves 888 blocks" in message
    assert "--allow-oversubscribe" in message
    message = error(capsys, ["simulate", "--workload", "chat", "--cache-gib", "80", "--gpu",
                             "h100-sxm-80gb", "--quiet"])
    assert "--cache-gib 80" in message and "more than the box holds" in message


def test_oversubscription_is_allowed_and_recorded(capsys, tmp_path):
    out = tmp_path / "o"
    assert main(["simulate", "--workload", "chat", "--duration", "120", "--gpu", "l4-24gb",
                 "--cache-blocks", "3000", "--allow-oversubscribe", "--policies", "lru",
                 "--no-sweep", "--seeds", "1", "--quiet", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["oversubscribed"] is True
    assert results["capacity_blocks"] == 3000
    assert results["box"]["kv_capacity"]["blocks"] < 3000
    assert "oversubscribed" in capsys.readouterr().out


def test_the_box_sets_the_default_cache(capsys):
    assert main(["simulate", "--workload", "chat", "--duration", "60", "--gpu", "l4-24gb",
                 "--policies", "lru", "--no-sweep", "--seeds", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "1 x L4 24 GB at 0.9 utilization" in out
    # 32 running sequences (the default --max-seqs) leave 2,097 blocks; 64 leave 2,072
    assert "cache: 2,097 blocks of 16 tokens" in out


@pytest.fixture(scope="module")
def unstable(tmp_path_factory):
    out = tmp_path_factory.mktemp("unstable")
    argv = [*MOONCAKE, "--cache-blocks", "800", "--policies", "lru,lfu", "--no-sweep",
            "--quiet", "--out", str(out)]
    return main(argv), out


def test_an_unstable_load_is_said_and_decides_on_no_latency(unstable, capsys):
    rc, out = unstable
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["load"]["rho"] == pytest.approx(1.284, abs=0.001)
    assert results["load"]["stable"] is False
    assert results["decision"]["latency_decision"] is False
    assert results["decision"]["metric"] == "recomputed_prefill_tokens"
    decision = (out / "DECISION.md").read_text()
    assert "unstable" in decision and "the queue grows without bound" in decision


def test_target_load_finds_the_scale_and_the_measured_load_overrules_it(capsys, tmp_path):
    out = tmp_path / "t"
    assert main([*MOONCAKE, "--cache-blocks", "800", "--policies", "lru", "--no-sweep",
                 "--target-load", "0.7", "--quiet", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["load"]["rho"] == pytest.approx(0.7, abs=1e-4)
    assert results["load"]["rate_scale"] == pytest.approx(0.545, abs=0.001)
    # the offered 0.7 prices an infinite cache's misses; at 800 blocks LRU hits a tenth of
    # what it assumed, its own misses keep the box busy longer than the arrivals last, and
    # the run is reported unstable: no latency decision
    assert results["load"]["measured_load"] > 1
    assert results["load"]["stable"] is False
    assert results["decision"]["latency_decision"] is False
    assert "measured load" in capsys.readouterr().out


class SameAsLRU(LRU):
    """LRU under another name: its every number equals LRU's."""


def test_equal_policies_give_no_significant_difference(capsys, tmp_path):
    register_policy("same-as-lru")(SameAsLRU)
    try:
        out = tmp_path / "eq"
        assert main(["simulate", "--workload", "chat", "--duration", "300", "--policies",
                     "lru,same-as-lru", "--cache-blocks", "256", "--no-sweep", "--seeds", "3",
                     "--quiet", "--out", str(out), "--jobs", "1"]) == 0
    finally:
        POLICIES.unregister("same-as-lru")
    results = json.loads((out / "results.json").read_text())
    assert results["chosen"] == "lru"
    assert results["decision"]["significant"] is False
    assert results["decision"]["reason"].startswith(
        "no significant difference: keep LRU (the simplest)")


@pytest.mark.parametrize("argv, flag", [
    (["--sweep", "0,2"], "--sweep"), (["--sweep", "nan"], "--sweep"),
    (["--seeds", "0"], "--seeds"), (["--jobs", "0"], "--jobs"), (["--gpus", "0"], "--gpus"),
    (["--rate-scale", "-1"], "--rate-scale"), (["--target-load", "0"], "--target-load"),
    (["--gpu", "tpu-v9"], "tpu-v9"), (["--ray-address", "x:1"], "--ray"),
])
def test_bad_values_name_the_flag(capsys, argv, flag):
    message = error(capsys, ["simulate", "--workload", "chat", "--duration", "60", *argv,
                             "--quiet"])
    assert flag in message


def test_seeds_do_not_apply_to_a_trace(capsys):
    message = error(capsys, [*MOONCAKE, "--seeds", "3", "--cache-blocks", "800"])
    assert "a trace file is one sample" in message


def test_the_main_job_default_cells_golden():
    """Two cells of the default run (chat-steady, one L4, Llama-3-8B, 32 sequences, seed 0,
    the box's 2,097 blocks), built as `kvevict simulate` builds them: closed loop, 239 turns
    wait for the answer they follow; open loop (``--open-loop``), the earlier numbers."""
    from kvevict.box import Box, gpu_profile, kv_cache_bytes
    from kvevict.layout import preset
    from kvevict.scheduler import SchedulerConfig
    from kvevict.study import Cell, Source, Study, run_cell

    layout = preset("llama-3-8b")
    box = Box(gpu_profile("l4-24gb"))
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)
    capacity = kv_cache_bytes(box, layout, max_num_batched_tokens=2048,
                              max_num_seqs=32).blocks(16)
    assert capacity == 2097
    study = Study(Source(workload="chat-steady"), layout, 16, box.cost_model(layout), config)
    lru = run_cell(study, Cell("lru", capacity, 0))
    lfu = run_cell(study, Cell("lfu", capacity, 0))
    assert (lru["requests"], lru["token_hit_ratio"], lru["ttft_p95"]) == (596, 0.480524, 0.878227)
    assert (lfu["requests"], lfu["token_hit_ratio"], lfu["ttft_p95"]) == (596, 0.425819, 0.934547)
    assert lru["held_requests"] == lfu["held_requests"] == 239
    study = attrs.evolve(study, closed_loop=False)
    lru = run_cell(study, Cell("lru", capacity, 0))
    lfu = run_cell(study, Cell("lfu", capacity, 0))
    assert (lru["requests"], lru["token_hit_ratio"], lru["ttft_p95"]) == (596, 0.512721, 0.849045)
    assert (lfu["requests"], lfu["token_hit_ratio"], lfu["ttft_p95"]) == (596, 0.491179, 0.849594)
    assert lru["held_requests"] == 0
