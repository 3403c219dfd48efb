"""``kvevict calibrate`` and ``kvevict engine-bench`` on tiny settings: the fit, the exact
structure of what they write (repeats, seeds, intervals over the replicates, the paired
decision), the fidelity comparison on hand-built numbers, and one-line errors (exit status 2)
for bad input."""

from __future__ import annotations

import json
import math
import statistics

import attrs
import numpy as np
import pytest
import torch

from kvevict.cli import main
from kvevict.cost import CostModel
from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.calibrate import fit_decode, fit_prefill
from kvevict.engine_bench import (
    auto_capacity,
    auto_time_scale,
    fidelity,
    interval_dict,
    replicates,
    run_bench,
)
from kvevict.errors import ConfigError
from kvevict.policies import register_policy
from kvevict.policies.registry import POLICIES
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.stats import interval
from kvevict.workloads import generate

TINY_MODEL = ["--vocab", "128", "--hidden", "16", "--layers", "1", "--heads", "2",
              "--kv-heads", "1", "--head-dim", "8", "--intermediate", "32", "--device", "cpu"]
TINY_GRID = ["--prefill-lengths", "8,32", "--cached-lengths", "0,64",
             "--decode-batches", "1,3", "--decode-contexts", "16,64", "--repeats", "1"]
TINY_BENCH = ["engine-bench", "--requests", "10", "--scale", "2", "--max-seqs", "8",
              "--max-batched-tokens", "128", "--cold-requests", "2", "--quiet", *TINY_MODEL]

RUN_KEYS = {"policy", "seed", "repeat", "capacity_blocks", "measured", "predicted", "error_pct",
            "kv", "requests", "answers", "wall_s"}
REQUEST_KEYS = {"request_id", "session_id", "workload_class", "arrival_s", "prompt_tokens",
                "cached_tokens", "computed_prefill_tokens", "engine_prefill_tokens",
                "queue_wait_s", "prefill_s", "ttft_s", "decode_s", "output_tokens",
                "decode_tokens_per_s", "preemptions"}


def user_error(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``: exit status 2 and one ``kvevict: error:`` line, no traceback."""
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    message = captured.err.strip()
    assert message.startswith("kvevict: error: "), message
    assert "\n" not in message and "Traceback" not in captured.err + captured.out
    return message


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- the fit -----------------------------------------------------------------------------------


def test_fits_recover_known_coefficients():
    truth = CostModel(prefill_overhead_s=2e-3, linear_s_per_token=5e-5, attn_s_per_pair=3e-8,
                      decode_step_s=1e-3, decode_s_per_seq=2e-4,
                      decode_s_per_context_token=4e-7)
    prefill = [(n, c, truth.prefill_seconds(n, c)) for n in (8, 64, 512) for c in (0, 1000)]
    got = fit_prefill(prefill)
    assert got == pytest.approx((2e-3, 5e-5, 3e-8), rel=1e-6)
    decode = [(b, c, truth.decode_seconds(c + 1, b)) for b in (1, 4, 16) for c in (10, 900)]
    assert fit_decode(decode) == pytest.approx((1e-3, 2e-4, 4e-7), rel=1e-6)
    # no negative coefficient even when the data pull one below zero
    noisy = [(n, c, 1e-3 + 1e-5 * n - 1e-9 * n * c) for n in (8, 64, 512) for c in (0, 1000)]
    assert min(fit_prefill(noisy)) >= 0
    with pytest.raises(ConfigError, match="at least 3"):
        fit_prefill(prefill[:2])


def test_cost_model_save_load_scale_and_padding(tmp_path):
    cost = CostModel(decode_s_per_seq=1e-4, decode_pads_batch=True)
    path = tmp_path / "cost.json"
    cost.save(path)
    assert CostModel.load(path) == cost
    assert CostModel.from_dict(cost.to_dict()) == cost
    doubled = cost.scaled(2.0)
    assert doubled.prefill_seconds(100, 50) == pytest.approx(2 * cost.prefill_seconds(100, 50))
    assert doubled.decode_batch_seconds([10, 30]) == pytest.approx(
        2 * cost.decode_batch_seconds([10, 30]))
    assert doubled.reload_seconds(10**9) == pytest.approx(2 * cost.reload_seconds(10**9))
    # padding: two sequences cost as two of the longest; without it, the sum of contexts
    assert cost.decode_batch_seconds([10, 30]) == pytest.approx(cost.decode_seconds(30, 2))
    plain = attrs.evolve(cost, decode_pads_batch=False)
    assert plain.decode_batch_seconds([10, 30]) == pytest.approx(plain.decode_seconds(20, 2))
    assert CostModel().decode_batch_seconds([]) == 0.0
    with pytest.raises(ConfigError, match="unknown cost model field"):
        CostModel.from_dict({"speed": 1})
    with pytest.raises(ConfigError, match="does not exist"):
        CostModel.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match=r"bad\.json"):
        CostModel.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="factor"):
        cost.scaled(0)
    with pytest.raises(ConfigError, match="decode_pads_batch"):
        CostModel(decode_pads_batch=1)


def test_auto_time_scale_and_capacity():
    requests = generate("chat-server", seed=0, vocab_size=128, scale=3)[:40]
    cost = CostModel(linear_s_per_token=1e-5, attn_s_per_pair=1e-8, decode_step_s=1e-3)
    scale, busy = auto_time_scale(requests, cost, 16, 0.5)
    span = requests[-1].arrival - requests[0].arrival
    assert busy > 0 and scale == pytest.approx(span * 0.5 / busy)
    config = SchedulerConfig(max_num_batched_tokens=256)
    low = max(-(-(r.prompt_len + r.output_len) // 16) for r in requests)
    cap, hit, inf = auto_capacity(requests, cost.scaled(scale), config, 16, low, 4 * low)
    assert low <= cap <= 4 * low and inf > 0

    def lru(c: int) -> float:
        return simulate(requests, "lru", capacity_blocks=c, block_size=16,
                        cost=cost.scaled(scale), config=config).summary()["token_hit_ratio"]

    assert hit == lru(cap)
    if cap > low:  # the neighbours are no closer to half of the infinite cache
        target = inf / 2
        assert abs(hit - target) <= abs(lru(cap - 1) - target) + 1e-12
        assert abs(hit - target) <= abs(lru(cap + 1) - target) + 1e-12


# -- kvevict calibrate -------------------------------------------------------------------------


def test_calibrate_cli_writes_a_loadable_cost_model(tmp_path, capsys):
    out = tmp_path / "cal" / "calibration.json"
    assert main(["calibrate", *TINY_MODEL, *TINY_GRID, "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "fit error" in printed and str(out) in printed
    data = json.loads(out.read_text())
    assert set(data) == {"cost_model", "engine", "fit", "samples", "seconds"}
    fields = {f.name for f in attrs.fields(CostModel)}
    assert set(data["cost_model"]) == fields
    assert set(data["fit"]) == {f"{k}_{s}_abs_rel_err" for k in ("prefill", "decode",
                                                                  "decode_mixed")
                                for s in ("mean", "max")}
    kinds = [s["kind"] for s in data["samples"]]
    assert kinds.count("prefill") == 4 and kinds.count("decode") == 4
    assert kinds.count("decode_mixed") == 1  # batch 3: one at 64, two at 16
    assert all(s["seconds"] > 0 and s["predicted"] >= 0 for s in data["samples"])
    assert data["engine"]["num_layers"] == 1 and data["engine"]["device"] == "cpu"
    assert {"load_s", "first_forward_s", "torch_threads"} <= set(data["engine"])
    cost = CostModel.load(out)
    assert cost.kv_bytes_per_token == 2 * 1 * 8 * 4  # K and V, 1 layer, 1 head of 8, fp32


# -- kvevict engine-bench ----------------------------------------------------------------------


RESULT_KEYS = {"workload", "workloads", "model", "time_scale", "cache", "cost_model",
               "calibration", "scheduler", "cold_requests", "timer", "repeats", "seeds",
               "policies", "replicates", "runs", "predictions", "summary", "fidelity", "load",
               "decision", "lossless", "command"}
INTERVAL_KEYS = {"mean", "half", "n", "confidence"}


def test_engine_bench_cli_structure(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main([*TINY_BENCH, "--policies", "lru,market", "--repeats", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for text in ("measured on the engine vs predicted by the simulator", "cold start",
                 "paired per-repeat difference against lru (2 repeats", "- market - lru: ",
                 "simulator fidelity (target: within ±10%", "lossless:", "KV tensor: cpu",
                 "answers vs unbounded", "runs: 2 repeats x 1 seed; mean ± 95% CI over the 2 "
                 "repeats", "measured load: ρ = ", "timer: wall", "chosen: "):
        assert text in printed, text
    assert sorted(p.name for p in out.iterdir()) == ["answers.json", "calibration.json",
                                                     "results.json"]
    data = json.loads((out / "results.json").read_text())
    assert set(data) == RESULT_KEYS
    assert data["command"].startswith("kvevict engine-bench --requests 10")
    assert data["workload"]["requests"] == 10 and data["workload"]["name"] == "chat-server"
    assert data["seeds"] == [0] and data["repeats"] == 2 and data["timer"] == "wall"
    assert data["replicates"] == {"unit": "repeat", "n": 2, "confidence": 0.95}
    assert data["lossless"] is True
    # repeats counted: every policy (and the unbounded reference) ran twice, in rounds
    assert [(r["policy"], r["repeat"]) for r in data["runs"]] == [
        ("unbounded", 0), ("unbounded", 1), ("lru", 0), ("lru", 1), ("market", 0),
        ("market", 1)]
    cache = data["cache"]
    assert cache["auto"] and cache["min_blocks"] <= cache["capacity_blocks"]
    assert cache["capacity_blocks"] <= cache["unbounded_blocks"]
    assert data["time_scale"]["auto"] and data["time_scale"]["factor"] > 0
    assert data["calibration"]["source"] == "on the fly"
    assert data["calibration"]["timer"] == "wall"
    for run in data["runs"]:
        assert set(run) == RUN_KEYS
        assert set(run["error_pct"]) == {"ttft_p50", "ttft_p95", "token_hit_ratio"}
        measured, predicted = run["measured"], run["predicted"]
        assert set(predicted) <= set(measured)
        assert {"engine", "memory", "cold", "warm", "decode_tokens_per_s_p50"} <= set(measured)
        assert measured["cold"]["requests"] == 2 and measured["warm"]["requests"] == 8
        assert measured["memory"]["os"]["peak_rss_bytes"] > 0
        assert measured["engine"]["predicted_busy_s"] > 0
        assert len(run["requests"]) == 10
        assert all(set(row) == REQUEST_KEYS for row in run["requests"])
        for key in ("ttft_p50", "ttft_p95", "token_hit_ratio"):
            m, p = measured[key], predicted[key]
            if m:
                assert run["error_pct"][key] == pytest.approx((p / m - 1) * 100, abs=0.06)
        assert run["kv"]["device"] == "cpu" and run["kv"]["dtype"] == "float32"
    # the first unbounded run is the reference; every other run is checked against it
    assert data["runs"][0]["answers"] is None
    assert data["runs"][0]["measured"]["evictions"] == 0
    for run in data["runs"][1:]:
        assert run["answers"]["lossless"] and run["answers"]["bugs"] == 0
        assert run["answers"]["positions"] == data["workload"]["output_tokens"]
    # the spread: intervals over the 2 repeats, recomputed here from the runs
    summary = {row["policy"]: row for row in data["summary"]}
    assert list(summary) == ["unbounded", "lru", "market"]
    for policy, row in summary.items():
        assert row["replicates"] == 2
        runs = [r for r in data["runs"] if r["policy"] == policy]
        for key in ("token_hit_ratio", "ttft_p50", "ttft_p95", "ttft_p99", "preemptions"):
            iv = row["measured"][key]
            assert set(iv) == INTERVAL_KEYS and iv["n"] == 2
            assert iv == interval([r["measured"][key] for r in runs]).as_dict()
        assert set(row["measured"]["engine"]["busy_s"]) == INTERVAL_KEYS
        # the simulator is deterministic: one prediction per seed, so no spread with one seed
        assert row["predicted"]["ttft_p95"] == {"mean": runs[0]["predicted"]["ttft_p95"],
                                                "half": None, "n": 1, "confidence": 0.95}
    fid = {row["policy"]: row for row in data["fidelity"]}
    assert list(fid) == ["unbounded", "lru", "market"]
    for policy, row in fid.items():
        assert row["unit"] == "repeat" and row["n"] == 2 and row["tolerance"] == 0.1
        assert set(row["metrics"]) == {"token_hit_ratio", "ttft_p50", "ttft_p95"}
        for key, m in row["metrics"].items():
            assert m["measured"] == summary[policy]["measured"][key]
            assert set(m["error"]) == INTERVAL_KEYS and m["error"]["n"] == 2
            assert m["verdict"] in ("within", "outside", "unresolved")
    decision = data["decision"]
    assert decision["unit"] == "repeat" and decision["replicates"] == 2
    assert decision["metric"] in ("ttft_p95", "recomputed_prefill_tokens")
    assert [c["policy"] for c in decision["comparisons"]] == ["market"]
    assert set(decision["comparisons"][0]["difference"]) == INTERVAL_KEYS
    assert decision["comparisons"][0]["difference"]["n"] == 2
    load = data["load"]  # lru and market, 2 repeats each (not the unbounded reference)
    runs = {(r["policy"], r["repeat"]): r["measured"] for r in data["runs"]}
    compared = [runs[(p, k)] for p in ("lru", "market") for k in (0, 1)]
    assert load["rho_by_run"] == [round(m["measured_load"], 4) for m in compared]
    assert load["busy_by_run"] == [round(m["busy_load"], 4) for m in compared]
    assert load["rho"] == max(load["rho_by_run"]) > 0
    assert load["stable"] is (load["rho"] < 1)
    answers = json.loads((out / "answers.json").read_text())
    assert set(answers) == {"0"} and set(answers["0"]) == {"unbounded", "lru", "market"}
    assert answers["0"]["lru"].keys() == answers["0"]["unbounded"].keys()
    assert sum(len(v) for v in answers["0"]["lru"].values()) == \
        data["workload"]["output_tokens"]
    # the calibration written by the run is a --cost-model for the next one; LRU, the
    # decision's baseline, is always measured; one repeat reports no interval
    cal = out / "calibration.json"
    out2 = tmp_path / "bench2"
    rc = main([*TINY_BENCH, "--policies", "lfu", "--cost-model", str(cal), "--repeats", "1",
               "--cache-blocks", str(cache["capacity_blocks"]), "--time-scale", "10",
               "--out", str(out2)])
    captured = capsys.readouterr()
    assert rc == 0 and f"cost model: {cal}" in captured.out
    assert "x10.00 faster" in captured.out and "note:" not in captured.err
    assert "runs: 1 repeat x 1 seed; one run per policy, no interval" in captured.out
    assert "1 repeat: the interval is unknown" in captured.out
    data = json.loads((out2 / "results.json").read_text())
    assert data["policies"] == ["lru", "lfu"]
    assert [r["policy"] for r in data["runs"]] == ["unbounded", "lru", "lfu"]
    assert data["decision"]["policy"] == "lru" and not data["decision"]["significant"]
    assert data["summary"][1]["measured"]["ttft_p95"]["half"] is None


def test_engine_bench_cli_seeds_and_cpu_timer(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main([*TINY_BENCH, "--requests", "6", "--policies", "lru", "--seeds", "2",
               "--repeats", "2", "--timer", "cpu", "--time-scale", "20", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "timer: cpu (time.thread_time" in printed
    assert "mean ± 95% CI over the 2 seeds (each seed's repeats averaged)" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["seeds"] == [0, 1] and data["timer"] == "cpu"
    assert data["calibration"]["timer"] == "cpu"
    assert data["replicates"]["unit"] == "seed" and data["replicates"]["n"] == 2
    assert [w["seed"] for w in data["workloads"]] == [0, 1]
    assert len(data["runs"]) == 2 * 2 * 2  # repeats x seeds x (unbounded + lru)
    assert len(data["predictions"]) == 2 * 2  # one per policy and seed: deterministic
    for row in data["summary"]:
        assert row["replicates"] == 2  # seeds: the repeats are averaged within a seed
        for key in ("token_hit_ratio", "ttft_p95"):
            per_seed = [sum(r["measured"][key] for r in data["runs"]
                            if r["policy"] == row["policy"] and r["seed"] == s) / 2
                        for s in (0, 1)]
            assert row["measured"][key] == pytest.approx(interval(per_seed).as_dict())
            preds = [p[key] for p in data["predictions"] if p["policy"] == row["policy"]]
            assert row["predicted"][key] == interval(preds).as_dict()
    # each seed's runs are checked against that seed's first unbounded run
    assert [(r["seed"], r["repeat"]) for r in data["runs"] if r["answers"] is None] == \
        [(0, 0), (1, 0)]
    answers = json.loads((out / "answers.json").read_text())
    assert set(answers) == {"0", "1"} and set(answers["1"]) == {"unbounded", "lru"}
    # a calibration of the other clock is noted
    rc = main([*TINY_BENCH, "--requests", "6", "--policies", "lru", "--repeats", "1",
               "--cost-model", str(out / "calibration.json"), "--time-scale", "20"])
    assert rc == 0
    assert "calibrated with --timer cpu, the runs use --timer wall" in capsys.readouterr().err


# -- replicates, fidelity, the decision on identical policies --------------------------------

T_975_2 = 4.302653  # Student's t, 97.5% quantile, 2 degrees of freedom (tables: 4.3027)
T_975_1 = 12.706205  # 1 degree of freedom (tables: 12.7062)


def _run(policy, seed, repeat, **metrics):
    return {"policy": policy, "capacity_blocks": 100, "seed": seed, "repeat": repeat,
            **metrics}


def test_replicates_one_seed_pairs_repeats():
    runs = [_run("lru", 7, r, ttft_p95=v) for r, v in enumerate((1.0, 2.0, 4.0))]
    unit, cells = replicates(runs)
    assert unit == "repeat"
    assert cells == [{"policy": "lru", "capacity_blocks": 100, "seed": r, "ttft_p95": v,
                      "workload_seed": 7, "repeats": 1}
                     for r, v in enumerate((1.0, 2.0, 4.0))]


def test_replicates_several_seeds_average_the_repeats():
    runs = [_run("lru", 0, 0, ttft_p95=1.0, classes={"chat": {"ttft_p95": 0.5}}, tag="a"),
            _run("lru", 0, 1, ttft_p95=3.0, classes={"chat": {"ttft_p95": 1.5}}, tag="b"),
            _run("lru", 1, 0, ttft_p95=5.0, classes={"chat": {"ttft_p95": 2.0}}, tag="a"),
            _run("lru", 1, 1, ttft_p95=7.0, classes={"chat": {"ttft_p95": 3.0}}, tag="a")]
    unit, cells = replicates(runs)
    assert unit == "seed"
    assert cells == [
        {"policy": "lru", "capacity_blocks": 100, "seed": 0, "ttft_p95": 2.0,
         "classes": {"chat": {"ttft_p95": 1.0}}, "workload_seed": 0, "repeats": 2},
        {"policy": "lru", "capacity_blocks": 100, "seed": 1, "ttft_p95": 6.0,
         "classes": {"chat": {"ttft_p95": 2.5}}, "tag": "a", "workload_seed": 1,
         "repeats": 2}]
    with pytest.raises(ConfigError, match="two runs of policy 'lru' at 100 blocks, seed 0, "
                                          "repeat 1"):
        replicates([*runs, _run("lru", 0, 1, ttft_p95=9.0)])
    with pytest.raises(ConfigError, match="lacks 'repeat'"):
        replicates([{"policy": "lru", "capacity_blocks": 1, "seed": 0}])
    with pytest.raises(ConfigError, match="no runs"):
        replicates([])


def test_fidelity_rows_from_hand_built_numbers():
    measured_p50 = (0.10, 0.125, 0.08)
    runs = [_run("lru", 0, r, token_hit_ratio=0.5, ttft_p50=p50, ttft_p95=0.5)
            for r, p50 in enumerate(measured_p50)]
    runs += [_run("market", 0, r, token_hit_ratio=0.4, ttft_p50=0.1, ttft_p95=p95)
             for r, p95 in enumerate((0.0, 0.2, 0.25))]
    predictions = [{"policy": "lru", "seed": 0, "token_hit_ratio": 0.52, "ttft_p50": 0.10,
                    "ttft_p95": 0.25},
                   {"policy": "market", "seed": 0, "token_hit_ratio": 0.4, "ttft_p50": 0.0,
                    "ttft_p95": 0.21}]
    rows = fidelity(runs, predictions)
    assert [(r["policy"], r["unit"], r["n"]) for r in rows] == [("lru", "repeat", 3),
                                                                ("market", "repeat", 3)]
    lru = rows[0]["metrics"]
    # hit ratio: +4% in every repeat, no spread: within 10%
    hit = lru["token_hit_ratio"]
    assert hit["error"].mean == pytest.approx(0.04) and hit["error"].half == pytest.approx(0)
    assert hit["verdict"] == "within"
    assert hit["predicted"].mean == 0.52 and not hit["predicted"].known
    # p50: per-repeat errors 0, -20% and +25%; mean +1.67%, but the interval is +-56%
    p50 = lru["ttft_p50"]
    errors = [0.10 / m - 1 for m in measured_p50]
    assert errors == pytest.approx([0.0, -0.2, 0.25])
    assert p50["error"].mean == pytest.approx(0.05 / 3)
    assert p50["error"].half == pytest.approx(T_975_2 * statistics.stdev(errors) / math.sqrt(3),
                                              rel=1e-6)
    assert p50["error"].half == pytest.approx(0.560080, abs=1e-6)
    assert p50["measured"].mean == pytest.approx(0.305 / 3)
    assert p50["measured"].half == pytest.approx(
        T_975_2 * statistics.stdev(measured_p50) / math.sqrt(3), rel=1e-6)
    assert p50["verdict"] == "unresolved"
    # p95: -50% in every repeat: outside
    assert lru["ttft_p95"]["error"].mean == pytest.approx(-0.5)
    assert lru["ttft_p95"]["verdict"] == "outside"
    market = rows[1]["metrics"]
    # a replicate measuring 0 has no relative error: left out (n = 2)
    p95 = market["ttft_p95"]
    assert p95["error"].n == 2 and p95["measured"].n == 3
    assert p95["error"].mean == pytest.approx((0.21 / 0.2 + 0.21 / 0.25 - 2) / 2)
    assert p95["error"].half == pytest.approx(T_975_1 * abs(0.21 / 0.2 - 0.21 / 0.25) / 2,
                                              rel=1e-6)
    assert p95["verdict"] == "unresolved"  # mean -2.5%, interval about +-134%
    assert market["token_hit_ratio"]["error"].mean == 0.0
    assert market["token_hit_ratio"]["verdict"] == "within"
    assert market["ttft_p50"]["error"].mean == pytest.approx(-1.0)
    assert market["ttft_p50"]["verdict"] == "outside"
    # JSON-ready
    as_json = interval_dict(rows)
    assert as_json[0]["metrics"]["ttft_p95"]["error"] == {
        "mean": pytest.approx(-0.5), "half": pytest.approx(0.0), "n": 3, "confidence": 0.95}
    json.dumps(as_json)


def test_fidelity_over_seeds_and_its_verdicts():
    runs = [_run("lru", 0, 0, ttft_p50=0.1), _run("lru", 0, 1, ttft_p50=0.3),
            _run("lru", 1, 0, ttft_p50=0.4), _run("lru", 1, 1, ttft_p50=0.4)]
    predictions = [{"policy": "lru", "seed": 0, "ttft_p50": 0.22},
                   {"policy": "lru", "seed": 1, "ttft_p50": 0.36}]
    (row,) = fidelity(runs, predictions, metrics=("ttft_p50",))
    assert row["unit"] == "seed" and row["n"] == 2
    m = row["metrics"]["ttft_p50"]
    # each seed's repeats averaged (0.2 and 0.4); its error +10% and -10%
    assert m["measured"].mean == pytest.approx(0.3)
    assert m["measured"].half == pytest.approx(T_975_1 * 0.1, rel=1e-6)
    assert m["predicted"].mean == pytest.approx(0.29)
    assert m["predicted"].half == pytest.approx(T_975_1 * 0.07, rel=1e-6)
    assert m["error"].mean == pytest.approx(0.0, abs=1e-12)
    assert m["error"].half == pytest.approx(T_975_1 * 0.1, rel=1e-6)
    assert m["verdict"] == "unresolved"
    # one replicate: the mean error decides
    (one,) = fidelity(runs[:1], predictions[:1], metrics=("ttft_p50",))
    assert one["metrics"]["ttft_p50"]["error"].mean == pytest.approx(1.2)
    assert not one["metrics"]["ttft_p50"]["error"].known
    assert one["metrics"]["ttft_p50"]["verdict"] == "outside"
    (loose,) = fidelity(runs[:1], predictions[:1], metrics=("ttft_p50",), tolerance=1.5)
    assert loose["metrics"]["ttft_p50"]["verdict"] == "within"
    with pytest.raises(ConfigError, match="no prediction for policy 'lru', seed 1"):
        fidelity(runs, predictions[:1])
    with pytest.raises(ConfigError, match="has no 'ttft_p95'"):
        fidelity(runs, predictions, metrics=("ttft_p95",))
    with pytest.raises(ConfigError, match="tolerance must be a positive number"):
        fidelity(runs, predictions, tolerance=0)


@pytest.fixture
def lru_copy():
    """A second name for LRU: two policies that make the same choices."""
    from kvevict.policies.lru import LRU

    name = "lru-copy"
    register_policy(name)(type("LRUCopy", (LRU,), {}))
    yield name
    POLICIES.unregister(name)


def _noisy_clock(seed: int):
    """A synthetic clock: every reading advances it by 50-400 us, drawn from a seeded
    generator. Step durations, and so the latencies, vary from run to run as on a busy
    machine, but the whole benchmark is the same on every test run (no real time enters)."""
    rng = np.random.default_rng(seed)
    now = [0.0]

    def clock() -> float:
        now[0] += rng.uniform(50e-6, 400e-6)
        return now[0]

    return clock


TINY_CONFIG = dict(vocab_size=128, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=8, intermediate_size=32)


def test_identical_policies_give_no_significant_difference(lru_copy):
    torch.set_num_threads(1)
    model = LlamaModel(ModelConfig(**TINY_CONFIG), seed=0)
    requests = generate("chat-server", seed=0, vocab_size=128, scale=2)[:5]
    cost = CostModel(linear_s_per_token=2e-6, decode_step_s=2e-4)
    result = run_bench(requests, model, ["lru", lru_copy], repeats=3, capacity_blocks=110,
                       time_scale=40.0, cost=cost, cold_requests=1, timer=_noisy_clock(0),
                       config=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    assert result["timer"] == "custom" and result["lossless"]
    runs = [r for r in result["runs"] if r["policy"] != "unbounded"]
    assert len(runs) == 6 and sorted({r["repeat"] for r in runs}) == [0, 1, 2]
    p95 = {p: [r["measured"]["ttft_p95"] for r in runs if r["policy"] == p]
           for p in ("lru", lru_copy)}
    assert len(set(p95["lru"] + p95[lru_copy])) > 1  # the clock's noise reaches the latencies
    decision = result["decision"]
    assert decision["policy"] == "lru" and not decision["significant"]
    assert decision["reason"].startswith("no significant difference: keep LRU (the simplest)")
    assert "over 3 repeats" in decision["reason"]
    (comparison,) = decision["comparisons"]
    expected = interval([a - b for a, b in zip(p95[lru_copy], p95["lru"], strict=True)])
    assert comparison == {"policy": lru_copy, "difference": expected.as_dict()}
    assert comparison["difference"]["half"] > 0
    # the same synthetic clock gives the same benchmark: the decision is not luck of the day
    again = run_bench(requests, model, ["lru", lru_copy], repeats=3, capacity_blocks=110,
                      time_scale=40.0, cost=cost, cold_requests=1, timer=_noisy_clock(0),
                      config=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    assert again["decision"]["comparisons"] == decision["comparisons"]


def test_same_clock_same_run():
    """The engine is deterministic given its step times: with a clock that advances by the
    same amounts, every repeat hits, waits and answers exactly alike, so every interval has
    half-width 0 and LRU is kept."""
    torch.set_num_threads(1)
    model = LlamaModel(ModelConfig(**TINY_CONFIG), seed=0)
    requests = generate("chat-server", seed=0, vocab_size=128, scale=2)[:6]
    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1e-4
        return ticks[0]

    result = run_bench(requests, model, ["lru", "lfu"], repeats=2, capacity_blocks=110,
                       time_scale=40.0, cost=CostModel(), cold_requests=1, timer=clock,
                       config=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    for row in result["summary"]:
        for key in ("token_hit_ratio", "ttft_p50", "ttft_p95", "preemptions"):
            assert row["measured"][key]["half"] == 0.0, (row["policy"], key)
    assert result["decision"]["policy"] == "lru"
    assert result["lossless"]


@pytest.mark.parametrize("argv,expected", [
    (["--policies", "lru,nope"], "unknown policy nope"),
    (["--policies", "lru,lru"], "twice"),
    (["--requests", "0"], "--requests must be a positive int"),
    (["--requests", "100000"], "has only"),
    (["--cache-blocks", "2"], "cannot hold request"),
    (["--workload", "nope"], "unknown workload 'nope'"),
    (["--kv-heads", "3"], "--heads (2) must be a multiple of --kv-heads (3)"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"],
     "--device"),
    (["--device", "nonsense"], "not a torch device"),
    (["--threads", "0"], "--threads"),
    (["--load", "0"], "target load"),
    (["--time-scale", "-1"], "time scale"),
    (["--cold-requests", "-1"], "--cold-requests"),
    (["--repeats", "0"], "--repeats (engine runs per policy) must be a positive int, got 0"),
    (["--seeds", "0"], "--seeds (workload seeds) must be a positive int, got 0"),
    (["--timer", "cpu", "--threads", "2"], "--timer cpu measures the engine thread's CPU time"),
    (["--timer", "cpu", "--device", "cuda"], "with --threads 1 on --device cpu"),
    (["--seeds", "3", "--requests", "500"], "(seed 2, scale 2.0) has only 467 requests"),
])
def test_engine_bench_bad_input(capsys, argv, expected):
    message = user_error(capsys, [*TINY_BENCH, "--policies", "lru", *argv])
    assert expected in message, message


def test_engine_bench_bad_files(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    message = user_error(capsys, [*TINY_BENCH, "--cost-model", str(missing)])
    assert str(missing) in message and "does not exist" in message
    bad = tmp_path / "bad.json"
    bad.write_text('{"cost_model": {"speed": 3}}')
    assert "unknown cost model field" in user_error(capsys, [*TINY_BENCH, "--cost-model",
                                                             str(bad)])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not a directory" in user_error(capsys, [*TINY_BENCH, "--out", str(a_file)])
    assert "is a directory" in user_error(capsys, ["calibrate", *TINY_MODEL, "--out",
                                                   str(tmp_path)])
    assert "--prefill-lengths" in user_error(capsys, ["calibrate", *TINY_MODEL, "--quiet",
                                                    "--prefill-lengths", "0", "--out",
                                                    str(tmp_path / "c.json")])


def test_time_scale_is_finite_for_a_single_request():
    requests = generate("chat", seed=0, vocab_size=128)[:1]
    scale, _ = auto_time_scale(requests, CostModel(), 16, 0.5)
    assert scale == 1.0 and math.isfinite(scale)
