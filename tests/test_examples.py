"""The examples run as users run them, with their exact output."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_custom_policy_example_keeps_the_shared_system_prompt():
    module = runpy.run_path(str(EXAMPLES / "custom_policy.py"))
    assert module["victims"]("lru") == [("ann", 1), ("bob", 1), ("cy", 1), ("ann", 0),
                                        ("dee", 1)]
    assert module["victims"]("deep-first") == [("ann", 1), ("bob", 1), ("cy", 1), ("dee", 1),
                                               ("dee", 0)]


def test_custom_policy_is_at_most_twenty_lines():
    source = (EXAMPLES / "custom_policy.py").read_text()
    start = source.index('@register_policy("deep-first")')
    end = source.index("\n\n\n", start)
    assert len(source[start:end].splitlines()) <= 20


def test_custom_policy_example_script_output():
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_policy.py")],
                         capture_output=True, text=True, check=True).stdout
    assert "deep-first: evicted (session, depth) = [('ann', 1), ('bob', 1), ('cy', 1), " \
           "('dee', 1), ('dee', 0)]" in out
    assert "stateful machine on deep-first: passed" in out


def test_simulate_example_runs_and_belady_bounds_the_hit_ratio():
    module = runpy.run_path(str(EXAMPLES / "simulate_workload.py"))
    summaries = module["main"](duration=300.0, capacity_blocks=400)
    by_policy = {s["policy"]: s for s in summaries}
    assert set(by_policy) == {"lru", "market", "belady"}
    assert by_policy["belady"]["token_hit_ratio"] >= by_policy["lru"]["token_hit_ratio"]
    assert by_policy["belady"]["token_hit_ratio"] >= by_policy["market"]["token_hit_ratio"]
    assert summaries == module["main"](duration=300.0, capacity_blocks=400)  # deterministic


def test_token_eviction_example_on_the_shipped_judge(capsys):
    """examples/token_eviction.py on 4 questions per task: both learned policies at 15% of the
    context answer what the full cache answers (all but one vartrack question), StreamingLLM
    none; LKV-H answers the needle the same way in generate() and in the engine."""
    pytest.importorskip("transformers")
    module = runpy.run_path(str(EXAMPLES / "token_eviction.py"))
    table = module["main"](items=4)
    assert table == {
        "full cache": {"recall": 1.0, "needle": 1.0, "vartrack": 0.75},
        "streamingllm": {"recall": 0.0, "needle": 0.0, "vartrack": 0.0},
        "lkv_t": {"recall": 1.0, "needle": 1.0, "vartrack": 0.75},
        "lkv_h": {"recall": 1.0, "needle": 1.0, "vartrack": 0.75},
    }
    out = capsys.readouterr().out
    assert ("needle, lkv_h keeping 154 tokens: expected [403, 321, 347, 2], generate() "
            "[403, 321, 347, 2], engine [403, 321, 347, 2]") in out
