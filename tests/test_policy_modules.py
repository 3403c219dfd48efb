"""Researchers' workflow: a policy of one's own is usable from every command.

``--policy-module MODULE`` (repeatable) imports a module that registers policies before
``--policies`` is checked, in ``kvevict simulate``, ``kvevict engine-bench`` and
``python -m kvevict.replay``; installed packages can register through the entry-point group
``kvevict.policies``. The recorded command reruns. A policy named twice, and a flag with a
bad value, are errors that name the policy and the flag."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import shlex
import sys

import pytest

from kvevict import replay as replay_module
from kvevict.cli import main
from kvevict.errors import ConfigError
from kvevict.policies import registry
from kvevict.policies.registry import (
    POLICIES,
    load_entry_point_policies,
    load_policy_modules,
)
from kvevict.replay import replay_table
from kvevict.workloads import bundled_trace_path, read_mooncake

POLICY_SOURCE = '''
from kvevict.policies import ScoredPolicy, register_policy


@register_policy("{name}")
class DeepFirst(ScoredPolicy):
    """Keep shallow blocks, drop deep private tails."""

    def score(self, block, now):
        return -block.depth
'''

CLASS_SOURCE = '''
from kvevict.policies import ScoredPolicy


class Shallow(ScoredPolicy):
    """Registered only through an entry point."""

    def score(self, block, now):
        return block.depth
'''

_ids = itertools.count()


def user_error(capsys, run, prefix: str = "kvevict: error: ") -> str:
    rc = run()
    captured = capsys.readouterr()
    assert rc == 2, captured
    message = captured.err.strip()
    assert message.startswith(prefix), message
    assert "\n" not in message and "Traceback" not in captured.err
    return message


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A policy module written to ``tmp_path`` (put on sys.path): (module name, policy name).
    The policy and the module are forgotten afterwards."""
    n = next(_ids)
    module, policy = f"kvevict_user_policies_{n}", f"deep-first-{n}"
    (tmp_path / f"{module}.py").write_text(POLICY_SOURCE.format(name=policy))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, policy
    sys.modules.pop(module, None)
    if policy in POLICIES:
        POLICIES.unregister(policy)


def _forget(module: str, policy: str, path: str) -> None:
    sys.modules.pop(module, None)
    POLICIES.unregister(policy)
    sys.path.remove(path)


SIM = ["simulate", "--workload", "chat", "--duration", "120", "--cache-blocks", "256",
       "--no-sweep", "--quiet"]


def test_unknown_without_the_module(capsys, user_module):
    _, policy = user_module
    message = user_error(capsys, lambda: main([*SIM, "--policies", f"lru,{policy}"]))
    assert f"unknown policy {policy}" in message


def test_simulate_round_trip_and_the_recorded_command_reruns(capsys, tmp_path, user_module):
    module, policy = user_module
    out = tmp_path / "out"
    rc = main([*SIM, "--policies", f"lru,{policy}", "--policy-module", module,
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert policy in captured.out
    first = json.loads((out / "results.json").read_text())
    assert {c["policy"] for c in first["cells"]} == {"lru", policy}
    assert first["policy_modules"] == {module: str(tmp_path / f"{module}.py")}
    decision = (out / "DECISION.md").read_text()
    command = next(line for line in decision.splitlines() if "**Rerun:**" in line)
    command = command.split("`")[1]
    words = shlex.split(command)
    # the module lives outside the installed packages: the command says where
    assert words[0] == f"PYTHONPATH={tmp_path}"
    assert words[1] == "kvevict" and "--policy-module" in words
    assert words[words.index("--policy-module") + 1] == module
    # rerun it as a fresh process would: nothing registered, the module not on sys.path
    _forget(module, policy, str(tmp_path))
    assert policy not in POLICIES
    sys.path.insert(0, words[0].split("=", 1)[1])
    try:
        assert main(words[2:]) == 0
    finally:
        sys.path.remove(str(tmp_path))
    capsys.readouterr()
    assert json.loads((out / "results.json").read_text()) == first


def test_policy_module_is_repeatable(capsys, tmp_path, user_module):
    module, policy = user_module
    other = f"kvevict_user_more_{next(_ids)}"
    (tmp_path / f"{other}.py").write_text(POLICY_SOURCE.format(name=f"{other}-p")
                                          .replace("DeepFirst", "Other"))
    try:
        rc = main([*SIM, "--policies", f"{policy},{other}-p", "--policy-module", module,
                   "--policy-module", other])
        assert rc == 0, capsys.readouterr().err
    finally:
        sys.modules.pop(other, None)
        POLICIES.unregister(f"{other}-p")
    capsys.readouterr()


def test_a_bad_module_is_one_line_naming_the_flag_and_the_module(capsys, tmp_path,
                                                                 user_module):
    message = user_error(capsys, lambda: main([*SIM, "--policy-module", "no_such_mod_xyz"]))
    assert "--policy-module no_such_mod_xyz" in message
    assert "No module named 'no_such_mod_xyz'" in message
    broken = f"kvevict_broken_{next(_ids)}"
    (tmp_path / f"{broken}.py").write_text("raise RuntimeError('boom\\nsecond line')\n")
    message = user_error(capsys, lambda: main([*SIM, "--policy-module", broken]))
    assert f"--policy-module {broken}" in message and "RuntimeError: boom second line" in message
    message = user_error(capsys, lambda: main(["engine-bench", "--policy-module",
                                               "no_such_mod_xyz", "--quiet"]))
    assert "--policy-module no_such_mod_xyz" in message
    message = user_error(capsys, lambda: replay_module.main(
        ["--policy-module", "no_such_mod_xyz", "--policies", "lru"]), prefix="error: ")
    assert "--policy-module no_such_mod_xyz" in message
    with pytest.raises(ConfigError, match="--policy-module"):
        load_policy_modules([""])


def test_replay_round_trip(capsys, tmp_path, user_module):
    module, policy = user_module
    lines = bundled_trace_path("mooncake").read_text().splitlines(keepends=True)[:300]
    trace = tmp_path / "head.jsonl"
    trace.write_text("".join(lines))
    rc = replay_module.main(["--trace", str(trace), "--policy-module", module, "--policies",
                             f"lru,{policy}", "--sizes", "500,2000"])
    out = capsys.readouterr().out
    assert rc == 0
    table = replay_table(read_mooncake(trace), ["lru", policy], [500, 2000])
    assert out.strip() == replay_module.format_table(table)
    assert f"| {policy} |" in out


def test_engine_bench_round_trip(capsys, tmp_path, user_module):
    pytest.importorskip("torch")
    module, policy = user_module
    out = tmp_path / "eb"
    argv = ["engine-bench", "--requests", "6", "--scale", "2", "--max-seqs", "4",
            "--max-batched-tokens", "128", "--cold-requests", "1", "--quiet", "--vocab",
            "128", "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "8", "--intermediate", "32", "--device", "cpu",
            "--time-scale", "10", "--cost-model", str(_cost_model(tmp_path)),
            "--policies", f"lru,{policy}", "--policy-module", module, "--out", str(out)]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc in (0, 1), captured.err
    results = json.loads((out / "results.json").read_text())
    words = shlex.split(results["command"])
    assert words[0] == f"PYTHONPATH={tmp_path}"
    assert words[2:] == argv
    assert results["policy_modules"] == {module: str(tmp_path / f"{module}.py")}
    assert policy in captured.out


def _cost_model(tmp_path):
    from kvevict.cost import CostModel

    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"cost_model": CostModel().to_dict()}))
    return path


# -- entry points ---------------------------------------------------------------------------


def test_entry_points_register_a_class_or_a_module_once(capsys, tmp_path, monkeypatch):
    n = next(_ids)
    cls_mod, mod_mod = f"kvevict_ep_class_{n}", f"kvevict_ep_module_{n}"
    (tmp_path / f"{cls_mod}.py").write_text(CLASS_SOURCE)
    (tmp_path / f"{mod_mod}.py").write_text(POLICY_SOURCE.format(name=f"ep-module-{n}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    group = registry.ENTRY_POINT_GROUP
    eps = [importlib.metadata.EntryPoint(f"ep-class-{n}", f"{cls_mod}:Shallow", group),
           importlib.metadata.EntryPoint(f"ep-mod-{n}", mod_mod, group)]
    calls = []

    def fake_entry_points(**kwargs):
        calls.append(kwargs)
        return eps if kwargs.get("group") == group else []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        for _ in range(2):
            rc = main([*SIM, "--policies", f"lru,ep-class-{n},ep-module-{n}"])
            assert rc == 0, capsys.readouterr().err
        assert calls == [{"group": "kvevict.policies"}]  # loaded once
        assert POLICIES.get(f"ep-class-{n}").__name__ == "Shallow"
        assert load_entry_point_policies() == []
        assert load_entry_point_policies(reload=True) == [f"ep-class-{n}", f"ep-mod-{n}"]
        # the replay command loads them too
        monkeypatch.setattr(registry, "_entry_points_loaded", False)
        rc = replay_module.main(["--trace", "mooncake", "--sizes", "2000", "--policies",
                                 f"ep-class-{n}"])
        assert rc == 0 and f"| ep-class-{n} |" in capsys.readouterr().out
        assert len(calls) == 3
    finally:
        for name in (f"ep-class-{n}", f"ep-module-{n}"):
            if name in POLICIES:
                POLICIES.unregister(name)
        sys.modules.pop(cls_mod, None)
        sys.modules.pop(mod_mod, None)
    capsys.readouterr()


def test_a_broken_entry_point_names_itself(capsys, monkeypatch):
    group = registry.ENTRY_POINT_GROUP
    bad = [importlib.metadata.EntryPoint("broken", "no_such_pkg_xyz.policies:P", group)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: bad)
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    message = user_error(capsys, lambda: main([*SIM, "--policies", "lru"]))
    assert "entry point broken = no_such_pkg_xyz.policies:P" in message
    assert "kvevict.policies" in message
    not_a_policy = [importlib.metadata.EntryPoint("odd", "json:dumps", group)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: not_a_policy)
    with pytest.raises(ConfigError, match="neither a module nor a Policy subclass"):
        load_entry_point_policies(reload=True)


# -- duplicate names and flag names ---------------------------------------------------------


def test_a_policy_named_twice_is_an_error_naming_it(capsys):
    message = user_error(capsys, lambda: main([*SIM, "--policies", "lru,market,lru"]))
    assert "--policies lists lru twice (lru,market,lru)" in message
    message = user_error(capsys, lambda: main([*SIM, "--policies", "lfu,lru,lfu,lfu"]))
    assert "lfu 3 times" in message
    message = user_error(capsys, lambda: main(["engine-bench", "--policies", "market,market",
                                               "--quiet"]))
    assert "--policies lists market twice" in message
    message = user_error(capsys, lambda: replay_module.main(
        ["--policies", "lru,belady,lru", "--sizes", "100"]), prefix="error: ")
    assert "--policies lists lru twice" in message
    with pytest.raises(ConfigError, match="policies lists lru twice"):
        replay_table([], ["lru", "lru"], [10])


@pytest.mark.parametrize("argv,expected", [
    (["--max-batched-tokens", "0"], "--max-batched-tokens (the scheduler's token budget per "
                                    "step) must be a positive int, got 0"),
    (["--max-seqs", "0"], "--max-seqs (the most running requests) must be a positive int"),
    (["--seed", "-1"], "--seed (the generator seed) must be a non-negative int, got -1"),
    (["--duration", "-5"], "--duration (seconds of generated trace) must be a positive"),
    (["--scale", "nan"], "--scale (a rate multiplier) must be a positive finite number"),
    (["--cache-blocks", "0"], "--cache-blocks"),
])
def test_simulate_flag_errors_name_the_flag(capsys, argv, expected):
    message = user_error(capsys, lambda: main([*SIM, "--policies", "lru", *argv]))
    assert expected in message, message
    for field in ("max_num", "ChatParams", "seed must"):
        assert field not in message, message


@pytest.mark.parametrize("argv,expected", [
    (["--max-batched-tokens", "0"], "--max-batched-tokens"),
    (["--max-seqs", "-2"], "--max-seqs"),
    (["--vocab", "1"], "--vocab (the vocabulary size) must be an int >= 2, got 1"),
    (["--hidden", "0"], "--hidden"),
    (["--layers", "0"], "--layers"),
    (["--kv-heads", "0"], "--kv-heads"),
    (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
    (["--head-dim", "7"], "--head-dim must be even"),
    (["--intermediate", "0"], "--intermediate"),
    (["--duration", "0"], "--duration"),
])
def test_engine_bench_flag_errors_name_the_flag(capsys, argv, expected):
    message = user_error(capsys, lambda: main(["engine-bench", "--quiet", *argv]))
    assert expected in message, message
    for field in ("max_num", "vocab_size", "hidden_size", "num_layers", "num_kv_heads",
                  "head_dim", "intermediate_size", "Params."):
        assert field not in message, message


@pytest.mark.parametrize("argv,expected", [
    (["--repeats", "0"], "--repeats"),
    (["--block-size", "0"], "--block-size"),
    (["--prefill-lengths", "0"], "--prefill-lengths must hold ints >= 1, got 0"),
    (["--decode-contexts", "-1"], "--decode-contexts must hold ints >= 0"),
    (["--prefill-lengths", "16", "--cached-lengths", "0"],
     "--prefill-lengths x --cached-lengths give 1 prefill point(s); give at least 3"),
])
def test_calibrate_flag_errors_name_the_flag(capsys, tmp_path, argv, expected):
    message = user_error(capsys, lambda: main(["calibrate", "--quiet", "--out",
                                               str(tmp_path / "c.json"), *argv]))
    assert expected in message, message
    for field in ("repeats must", "block_size", "prefill_lengths", "cached_lengths",
                  "decode_contexts"):
        assert field not in message, message
