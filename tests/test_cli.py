"""The ``kvevict`` command: user errors are one clear line and exit status 2 (no traceback);
a small run writes results.json, DECISION.md and the plots, deterministically.

Most cases call `kvevict.cli.main` in-process (fast); one runs the real console script to
check the process exit status and stderr.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvevict.cli import main
from kvevict.layout import PRESETS
from kvevict.policies import available_policies
from kvevict.workloads import available_workloads, bundled_trace_path, generate, write_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SMALL_RUN = ["simulate", "--workload", "chat", "--duration", "300", "--policies",
             "lru,market,belady", "--cache-blocks", "256", "--sweep", "0.5,2", "--seeds", "2",
             "--quiet"]


def user_error(capsys, argv: list[str]) -> str:
    """Run ``main(argv)``; assert exit status 2 and a one-line ``kvevict: error:`` message
    on stderr; return the message."""
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    message = captured.err.strip()
    assert message.startswith("kvevict: error: "), message
    assert "\n" not in message, message
    assert "Traceback" not in captured.err + captured.out
    return message


# -- bad input ---------------------------------------------------------------------------


def test_unknown_workload_lists_the_valid_ones(capsys):
    message = user_error(capsys, ["simulate", "--workload", "nope", "--quiet"])
    assert "'nope'" in message
    for name in available_workloads():
        assert name in message


def test_unknown_policy_lists_the_valid_ones(capsys):
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "60",
                                  "--policies", "lru,nope", "--quiet"])
    assert "nope" in message
    for name in available_policies():
        assert name in message


def test_unknown_model_lists_the_presets(capsys):
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "60",
                                  "--model", "gpt-17", "--quiet"])
    assert "gpt-17" in message
    for name in PRESETS:
        assert name in message


def test_cache_smaller_than_one_request(capsys):
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "300",
                                  "--cache-blocks", "2", "--policies", "lru", "--quiet"])
    assert re.search(r"request 'chat-\d+-t\d+'", message), message
    assert "2 blocks of 16 tokens" in message


def test_nonexistent_trace(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    for fmt in ("jsonl", "mooncake"):
        message = user_error(capsys, ["simulate", "--trace", str(missing), "--format", fmt,
                                      "--quiet"])
        assert str(missing) in message and "does not exist" in message


def test_malformed_mooncake_line_names_file_line_and_field(capsys, tmp_path):
    lines = bundled_trace_path("mooncake").read_text().splitlines()[:5]
    lines.append('{"timestamp": 50000, "input_length": "abc", "output_length": 3, '
                 '"hash_ids": [1]}')
    trace = tmp_path / "broken_mc.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    message = user_error(capsys, ["simulate", "--trace", str(trace), "--format", "mooncake",
                                  "--quiet"])
    assert "broken_mc.jsonl:6" in message
    assert "input_length" in message


def test_malformed_jsonl_lines_name_file_line_and_field(capsys, tmp_path):
    good = tmp_path / "chat.jsonl"
    write_jsonl(generate("chat", seed=1, duration=120), good)
    lines = good.read_text().splitlines()
    assert len(lines) >= 3

    bad_field = tmp_path / "bad_field.jsonl"
    bad_field.write_text("\n".join([lines[0], '{"request_id": "x", "tokens": "oops"}',
                                    *lines[2:]]) + "\n")
    message = user_error(capsys, ["simulate", "--trace", str(bad_field), "--quiet"])
    assert "bad_field.jsonl:2" in message and "'tokens'" in message

    bad_json = tmp_path / "bad_json.jsonl"
    bad_json.write_text("\n".join([*lines[:2], "{broken", *lines[3:]]) + "\n")
    message = user_error(capsys, ["simulate", "--trace", str(bad_json), "--quiet"])
    assert "bad_json.jsonl:3" in message and "JSON" in message


def test_console_script_exit_status_and_stderr():
    script = shutil.which("kvevict")
    cmd = [script] if script else [sys.executable, "-m", "kvevict.cli"]
    proc = subprocess.run([*cmd, "simulate", "--workload", "nope", "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("kvevict: error: unknown workload 'nope'")
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_trace_that_is_a_directory(capsys, tmp_path):
    message = user_error(capsys, ["simulate", "--trace", str(tmp_path), "--quiet"])
    assert str(tmp_path) in message


def test_out_that_is_a_file(capsys, tmp_path):
    target = tmp_path / "results"
    target.write_text("not a directory")
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "60",
                                  "--policies", "lru", "--no-sweep", "--out", str(target),
                                  "--quiet"])
    assert str(target) in message


def test_the_main_job_compares_every_built_in_online_policy_and_belady():
    from kvevict.cli import DEFAULT_POLICIES
    from kvevict.policies.registry import POLICIES, is_offline

    # built in: defined in kvevict (other test files register policies of their own)
    online = {p for p in available_policies() if not is_offline(p)
              and POLICIES.get(p).__module__.startswith("kvevict.")}
    assert set(DEFAULT_POLICIES) == online | {"belady"}
    assert DEFAULT_POLICIES[0] == "lru" and len(set(DEFAULT_POLICIES)) == len(DEFAULT_POLICIES)


def test_only_the_offline_oracle(capsys):
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "60",
                                  "--policies", "belady", "--no-sweep", "--quiet"])
    assert "online" in message


def test_zero_block_size(capsys):
    message = user_error(capsys, ["simulate", "--workload", "chat", "--duration", "60",
                                  "--policies", "lru", "--no-sweep", "--block-size", "0",
                                  "--quiet"])
    assert "--block-size" in message


# -- a successful run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    """The same small comparison written to two directories (stdout kept from the first)."""
    outs = []
    for name in ("run1", "run2"):
        out = tmp_path_factory.mktemp(name)
        assert main([*SMALL_RUN, "--out", str(out)]) == 0
        outs.append(out)
    return outs


def test_small_run_writes_results_json(small_runs):
    results = json.loads((small_runs[0] / "results.json").read_text())
    expected = {"workload", "seeds", "model", "bytes_per_token", "block_size", "box",
                "capacity_blocks", "oversubscribed", "load", "scheduler", "cells", "replay",
                "headroom", "chosen", "decision", "command"}
    assert expected <= set(results)
    assert results["workload"] == "chat" and results["seeds"] == [0, 1]
    assert results["model"] == "llama-3-8b" and results["block_size"] == 16
    assert results["capacity_blocks"] == 256 and results["oversubscribed"] is False
    summary_keys = {"policy", "capacity_blocks", "seed", "requests", "token_hit_ratio",
                    "block_hit_ratio", "infinite_cache_hit_ratio", "prefill_tokens_computed",
                    "recomputed_prefill_tokens", "ttft_p50", "ttft_p95", "ttft_p99",
                    "queue_wait_p95", "wait_memory_p95", "wait_compute_p95", "classes",
                    "evictions", "evictions_by_class", "preemptions", "deferrals",
                    "peak_blocks"}
    cells = {(c["policy"], c["capacity_blocks"], c["seed"]) for c in results["cells"]}
    assert cells == {(p, c, s) for p in ("lru", "market", "belady") for c in (128, 256, 512)
                     for s in (0, 1)}
    for c in results["cells"]:
        assert summary_keys <= set(c)
    # the exact untimed replay at the decided size: LRU, Belady, the infinite cache
    assert {(r["policy"], r["capacity_blocks"], r["seed"]) for r in results["replay"]} == {
        (p, c, s) for p, c in [(p, c) for c in (128, 256, 512) for p in ("lru", "belady")]
        + [("lru", None)] for s in (0, 1)}
    head = results["headroom"]
    assert head["lru"]["mean"] <= head["belady_exact"]["mean"] <= head["infinite"]["mean"]
    assert results["chosen"] in ("lru", "market")  # Belady is offline, never chosen
    assert results["decision"]["policy"] == results["chosen"]
    assert results["load"]["stable"] is True and results["load"]["rate_scale"] == 1.0


def test_small_run_writes_the_decision_record(small_runs):
    results = json.loads((small_runs[0] / "results.json").read_text())
    decision = (small_runs[0] / "DECISION.md").read_text()
    date = re.search(r"\*\*Date:\*\* (\d{4}-\d{2}-\d{2})", decision)
    assert date, decision
    assert abs(dt.date.fromisoformat(date.group(1)) - dt.date.today()) <= dt.timedelta(days=1)
    assert "`chat`" in decision
    assert "llama-3-8b" in decision
    for heading in ("## Decision", "## Headroom", "## Retest when"):
        assert heading in decision
    assert f"## Decision: run `{results['chosen']}`" in decision


def test_small_run_writes_png_plots(small_runs):
    for name in ("hit_ratio.png", "ttft_cdf.png", "class_p95.png"):
        data = (small_runs[0] / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        assert len(data) > 1000


def test_same_command_gives_identical_results_json(small_runs):
    """Two runs differ only in the recorded command (its --out)."""
    first, second = (json.loads((Path(d) / "results.json").read_text()) for d in small_runs)
    assert first.pop("command").replace(str(small_runs[0]), "OUT") == \
        second.pop("command").replace(str(small_runs[1]), "OUT")
    assert first == second


def test_mooncake_trace_slice_uses_512_token_blocks(capsys, tmp_path):
    lines = bundled_trace_path("mooncake").read_text().splitlines(keepends=True)[:200]
    trace = tmp_path / "mooncake_head.jsonl"
    trace.write_text("".join(lines))
    out = tmp_path / "out"
    rc = main(["simulate", "--trace", str(trace), "--format", "mooncake", "--policies",
               "lru,belady", "--gpu", "h100-sxm-80gb", "--cache-blocks", "800", "--no-sweep",
               "--out", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "200 requests" in captured.out
    assert "800 blocks of 512 tokens" in captured.out
    results = json.loads((out / "results.json").read_text())
    assert results["block_size"] == 512 and results["capacity_blocks"] == 800
    assert results["workload"] == "mooncake_head.jsonl (mooncake)"
    assert results["seeds"] == [0]  # a trace file is one sample
    assert [s["requests"] for s in results["cells"]] == [200, 200]
    assert results["chosen"] == "lru"


def test_scale_adds_people_to_a_generated_workload(capsys, tmp_path):
    base = ["simulate", "--workload", "chat", "--duration", "300", "--policies", "lru",
            "--cache-blocks", "512", "--no-sweep", "--seeds", "1", "--quiet"]
    counts = {}
    for scale in ("1", "3"):
        out = tmp_path / scale
        assert main([*base, "--scale", scale, "--out", str(out)]) == 0
        results = json.loads((out / "results.json").read_text())
        counts[scale] = results["cells"][0]["requests"]
        assert counts[scale] == len(generate("chat", seed=0, duration=300, scale=float(scale)))
    assert counts["3"] > 2 * counts["1"]
    assert results["workload"] == "chat (scale 3)"
    capsys.readouterr()


def test_scale_does_not_apply_to_a_trace(capsys):
    message = user_error(capsys, ["simulate", "--trace", str(bundled_trace_path("mooncake")),
                                  "--format", "mooncake", "--scale", "2"])
    assert "do not apply to --trace" in message
    assert "positive" in user_error(capsys, ["simulate", "--scale", "0", "--no-sweep"])


def test_open_loop_sends_every_turn_at_its_trace_arrival(capsys, tmp_path):
    """Closed loop by default (`SessionGate`): at 6x the rate, all 7 follow-up turns of the
    trace arrive before the answer they carry, and wait for it; ``--open-loop`` sends them
    at their (scaled) trace arrivals."""
    from kvevict.load import rate_scaled

    base = ["simulate", "--workload", "chat", "--duration", "300", "--policies", "lru",
            "--cache-blocks", "512", "--no-sweep", "--seeds", "1", "--rate-scale", "6",
            "--quiet"]
    requests = rate_scaled(generate("chat", seed=0, duration=300), 6.0)
    followups = sum(1 for r in requests if r.extra["parent"] is not None)
    assert followups == 7
    for flags, closed in (([], True), (["--open-loop"], False)):
        out = tmp_path / str(closed)
        assert main([*base, *flags, "--out", str(out)]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["closed_loop"] is closed
        assert results["cells"][0]["held_requests"] == (followups if closed else 0)
    capsys.readouterr()
