"""``kvevict calibrate`` and ``kvevict engine-bench`` on tiny settings: the fit, the exact
structure of what they write, and one-line errors (exit status 2) for bad input."""

from __future__ import annotations

import json
import math

import attrs
import pytest
import torch

from kvevict.cli import main
from kvevict.cost import CostModel
from kvevict.engine.calibrate import fit_decode, fit_prefill
from kvevict.engine_bench import auto_capacity, auto_time_scale
from kvevict.errors import ConfigError
from kvevict.scheduler import SchedulerConfig
from kvevict.sim import simulate
from kvevict.workloads import generate

TINY_MODEL = ["--vocab", "128", "--hidden", "16", "--layers", "1", "--heads", "2",
              "--kv-heads", "1", "--head-dim", "8", "--intermediate", "32", "--device", "cpu"]
TINY_GRID = ["--prefill-lengths", "8,32", "--cached-lengths", "0,64",
             "--decode-batches", "1,3", "--decode-contexts", "16,64", "--repeats", "1"]
TINY_BENCH = ["engine-bench", "--requests", "10", "--scale", "2", "--max-seqs", "8",
              "--max-batched-tokens", "128", "--cold-requests", "2", "--quiet", *TINY_MODEL]

RUN_KEYS = {"policy", "capacity_blocks", "measured", "predicted", "error_pct", "kv", "requests",
            "answers", "wall_s"}
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


def test_engine_bench_cli_structure(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main([*TINY_BENCH, "--policies", "lru,market", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    for text in ("measured on the engine vs predicted by the simulator", "cold start",
                 "market vs lru: p95 TTFT", "simulator fidelity", "lossless:", "KV tensor: cpu",
                 "answers vs unbounded"):
        assert text in printed
    assert sorted(p.name for p in out.iterdir()) == ["answers.json", "calibration.json",
                                                     "results.json"]
    data = json.loads((out / "results.json").read_text())
    assert set(data) == {"workload", "model", "time_scale", "cache", "cost_model",
                         "calibration", "scheduler", "cold_requests", "runs", "lossless",
                         "command"}
    assert data["command"].startswith("kvevict engine-bench --requests 10")
    assert data["workload"]["requests"] == 10 and data["workload"]["name"] == "chat-server"
    assert data["lossless"] is True
    assert [r["policy"] for r in data["runs"]] == ["unbounded", "lru", "market"]
    cache = data["cache"]
    assert cache["auto"] and cache["min_blocks"] <= cache["capacity_blocks"]
    assert cache["capacity_blocks"] <= cache["unbounded_blocks"]
    assert data["time_scale"]["auto"] and data["time_scale"]["factor"] > 0
    assert data["calibration"]["source"] == "on the fly"
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
    assert data["runs"][0]["answers"] is None
    assert data["runs"][0]["measured"]["evictions"] == 0
    for run in data["runs"][1:]:
        assert run["answers"]["lossless"] and run["answers"]["bugs"] == 0
        assert run["answers"]["positions"] == data["workload"]["output_tokens"]
    answers = json.loads((out / "answers.json").read_text())
    assert set(answers) == {"unbounded", "lru", "market"}
    assert answers["lru"].keys() == answers["unbounded"].keys()
    assert sum(len(v) for v in answers["lru"].values()) == data["workload"]["output_tokens"]
    # the calibration written by the run is a --cost-model for the next one
    cal = out / "calibration.json"
    rc = main([*TINY_BENCH, "--policies", "lfu", "--cost-model", str(cal),
               "--cache-blocks", str(cache["capacity_blocks"]), "--time-scale", "10"])
    printed = capsys.readouterr().out
    assert rc == 0 and f"cost model: {cal}" in printed
    assert "x10.00 faster" in printed


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
