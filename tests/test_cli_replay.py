"""``kvevict replay`` and ``kvevict export``: results identical to the library calls, every
trace format, errors that name the flag, the progress bar, and the export round trip."""

from __future__ import annotations

import json
import sys

import pytest

from kvevict.cli import main
from kvevict.policies.registry import POLICIES
from kvevict.replay import compare, format_comparison, format_table, replay_table
from kvevict.report import plot_comparison
from kvevict.workloads import (
    TraceFile,
    bundled_trace_path,
    generate,
    read_jsonl,
    read_mooncake,
    trace_digest,
    write_jsonl,
    write_mooncake,
)
from kvevict.workloads.formats import read_alibaba, read_sharegpt

HEAD = 600  # requests of the bundled trace the quick cases use


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """The first requests of the bundled Mooncake trace, as a Mooncake file."""
    path = tmp_path_factory.mktemp("trace") / "head.jsonl"
    write_mooncake(read_mooncake(bundled_trace_path())[:HEAD], path)
    return path


def run(capsys, argv):
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured


def user_error(capsys, argv) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2, captured
    message = captured.err.strip().splitlines()[-1]
    assert "Traceback" not in captured.err
    return message


# -- kvevict replay -------------------------------------------------------------------------


def test_replay_prints_the_library_table_and_writes_results_json(capsys, head, tmp_path):
    out = tmp_path / "out"
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900",
                            "--policies", "lru,lfu,belady", "--out", str(out), "--quiet"])
    table = replay_table(read_mooncake(head), ["lru", "lfu", "belady"], [300, 900])
    lines = captured.out.splitlines()
    assert lines[0] == f"trace {head} (mooncake): {HEAD:,} requests; blocks of 512 tokens; " \
                       "time axis index"
    assert "\n".join(lines[1:6]) == format_table(table)
    assert lines[-1] == f"wrote results.json, hit_ratio.png to {out}"
    assert captured.err == ""  # --quiet
    payload = json.loads((out / "results.json").read_text())
    keys = ("policy", "capacity_blocks", "hits", "accesses", "token_hits", "evictions",
            "rejected", "records", "prefill_s", "prefill_saved_s", "prefill_saved_ratio")
    assert [{k: r[k] for k in keys} for r in payload["results"]] == [
        {k: r[k] for k in keys} for r in table.rows()]
    assert payload["requests"] == HEAD and payload["block_size"] == 512
    assert payload["command"] == (f"kvevict replay --trace {head} --sizes 300,900 --policies "
                                  f"lru,lfu,belady --out {out} --quiet")
    png = (out / "hit_ratio.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_replay_metric_prefill_saved_ratio_prints_the_library_table(capsys, head):
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900",
                            "--policies", "lru,gdsf", "--metric", "prefill_saved_ratio",
                            "--quiet"])
    table = replay_table(read_mooncake(head), ["lru", "gdsf"], [300, 900])
    assert "\n".join(captured.out.splitlines()[1:5]) == format_table(table,
                                                                      "prefill_saved_ratio")
    assert table.get("lru", 300).prefill_saved_ratio > 0


def test_replay_versus_prints_and_draws_the_library_comparison(capsys, head, tmp_path):
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900",
                            "--policies", "lru,gdsf,arc", "--versus", "lru", "--quiet",
                            "--out", str(tmp_path)])
    table = replay_table(read_mooncake(head), ["lru", "gdsf", "arc"], [300, 900])
    out = captured.out
    assert out.endswith(format_comparison(table, "lru") + "\n"
                        f"wrote results.json, hit_ratio.png, versus.png to {tmp_path}\n")
    assert ("against lru: the ratio of the block hit ratio, and the difference with its 95% "
            "interval by batch means (18 batches of consecutive requests, at least 10)") in out
    # the plot is the library's, byte for byte (PNGs are written without a timestamp)
    plot_comparison(compare(table, "lru"), tmp_path / "lib.png",
                    f"{head.name}: exact replay, 512-token blocks, request index clock")
    assert (tmp_path / "versus.png").read_bytes() == (tmp_path / "lib.png").read_bytes()


def test_replay_without_matplotlib_writes_the_results_and_says_so(capsys, head, tmp_path,
                                                                   monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):  # import of either now fails
        monkeypatch.setitem(sys.modules, name, None)
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300",
                            "--policies", "lru,arc", "--versus", "lru", "--quiet",
                            "--out", str(tmp_path)])
    assert captured.err == 'note: plots need matplotlib: pip install "kvevict[plot]"\n'
    assert captured.out.endswith(f"wrote results.json to {tmp_path}\n")
    assert json.loads((tmp_path / "results.json").read_text())["policies"] == ["lru", "arc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_replay_from_saved_results_prints_what_the_replay_did(capsys, head, tmp_path):
    saved = tmp_path / "saved"
    replayed = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900",
                            "--policies", "lru,gdsf,arc", "--versus", "lru", "--quiet",
                            "--out", str(saved)])
    # the same table and comparison, read back from results.json: nothing is replayed
    again = run(capsys, ["replay", "--from", str(saved), "--versus", "lru"])
    assert again.out == replayed.out.replace(f"wrote results.json, hit_ratio.png, versus.png "
                                             f"to {saved}\n", "")
    assert again.err == ""
    # against another row, a subset of rows and sizes, plots only
    plots = tmp_path / "plots"
    captured = run(capsys, ["replay", "--from", str(saved / "results.json"), "--policies",
                            "lru,arc", "--sizes", "900", "--versus", "arc", "--out",
                            str(plots)])
    table = replay_table(read_mooncake(head), ["lru", "arc"], [900])
    assert captured.out.endswith(format_comparison(table, "arc") + "\n"
                                 f"wrote hit_ratio.png, versus.png to {plots}\n")
    assert "\n".join(captured.out.splitlines()[1:5]) == format_table(table)
    assert sorted(p.name for p in plots.iterdir()) == ["hit_ratio.png", "versus.png"]
    plot_comparison(compare(table, "arc"), tmp_path / "lib.png",
                    f"{head.name}: exact replay, 512-token blocks, request index clock")
    assert (plots / "versus.png").read_bytes() == (tmp_path / "lib.png").read_bytes()


def test_replay_from_selects_rows_that_are_not_registered_policies(capsys, head, tmp_path):
    """The rows of saved results are selected by their names, whatever registered them:
    the infinite cache, an oracle sweep's rows, a policy of another process's module."""
    saved = tmp_path / "saved"
    run(capsys, ["replay", "--trace", str(head), "--sizes", "300", "--policies",
                 "lru,horizon-oracle,infinite", "--horizons", "30,300", "--quiet",
                 "--out", str(saved)])
    data = json.loads((saved / "results.json").read_text())
    rows = data["policies"]
    assert rows[0] == "lru" and rows[-1] == "infinite" and len(rows) == 4
    data["policies"] = [("my-policy" if p == "lru" else p) for p in rows]  # not registered
    for row in data["results"]:
        row["policy"] = "my-policy" if row["policy"] == "lru" else row["policy"]
    (saved / "results.json").write_text(json.dumps(data))
    picked = [rows[2], "infinite", "my-policy"]
    captured = run(capsys, ["replay", "--from", str(saved), "--policies", ",".join(picked),
                            "--versus", "my-policy"])
    table_rows = [line.split(" | ")[0][2:] for line in captured.out.splitlines()[3:6]]
    assert table_rows == picked
    for argv, expected in [
        (["--policies", ","], "kvevict: error: --policies names no row (rows: my-policy, "),
        (["--policies", "infinite,infinite"], "kvevict: error: --policies lists infinite "
                                              "twice"),
    ]:
        message = user_error(capsys, ["replay", "--from", str(saved), *argv])
        assert message.startswith(expected), message


def test_replay_from_errors(capsys, head, tmp_path):
    saved = tmp_path / "saved"
    run(capsys, ["replay", "--trace", str(head), "--sizes", "300", "--policies", "lru,arc",
                 "--quiet", "--out", str(saved)])
    cases = [
        (["--trace", str(head)], f"kvevict: error: --trace says how to replay a trace; --from "
                                 f"{saved} replays nothing (it reads the results a replay "
                                 "saved)"),
        (["--time", "arrival"], "kvevict: error: --time says how to replay a trace"),
        (["--host-blocks", "10"], "kvevict: error: --host-blocks says how to replay a trace"),
        (["--versus", "gdsf"], "kvevict: error: --versus 'gdsf' is not a row of these results "
                               "(rows: lru, arc)"),
        (["--policies", "lfu"], "kvevict: error: no row 'lfu' in this table (rows: lru, arc)"),
        (["--sizes", "900"], "kvevict: error: no size 900 in this table (sizes: 300)"),
    ]
    for argv, expected in cases:
        message = user_error(capsys, ["replay", "--from", str(saved), *argv])
        assert message.startswith(expected), message
    message = user_error(capsys, ["replay", "--from", str(tmp_path)])
    assert message == (f"kvevict: error: no replay results at {tmp_path / 'results.json'} "
                       "(kvevict replay --out DIR writes DIR/results.json)")


def test_replay_oracle_rows_horizons_and_the_infinite_cache(capsys, head, tmp_path):
    out = tmp_path / "out"
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900", "--time",
                            "arrival", "--policies", "lru,horizon-oracle,reuse-oracle,infinite",
                            "--horizons", "30,inf", "--out", str(out), "--quiet"])
    table = replay_table(read_mooncake(head), ["lru", "horizon-oracle", "reuse-oracle",
                                               "infinite"], [300, 900], time="arrival",
                         horizons=[30, float("inf")])
    assert table.policies == ["lru", "horizon-oracle H=30", "horizon-oracle H=inf",
                              "reuse-oracle", "infinite"]
    assert format_table(table) in captured.out
    payload = json.loads((out / "results.json").read_text())
    assert payload["policies"] == table.policies and payload["horizons"] == [30.0, "inf"]
    assert [r["hits"] for r in payload["results"]] == [r.hits for r in table.results]
    assert (out / "hit_ratio.png").stat().st_size > 20_000
    # H = inf is the reuse oracle, row for row
    assert table.ratios()["horizon-oracle H=inf"] == table.ratios()["reuse-oracle"]


def test_replay_oracle_flag_errors(capsys, head):
    message = user_error(capsys, ["replay", "--trace", str(head), "--horizons", "-3",
                                  "--policies", "lru", "--quiet"])
    assert "horizon must be >= 0" in message
    with pytest.raises(SystemExit) as info:  # argparse's own error, exit status 2
        main(["replay", "--trace", str(head), "--horizons", "soon"])
    assert info.value.code == 2
    assert "--horizons: expected comma-separated numbers, got 'soon'" in capsys.readouterr().err
    message = user_error(capsys, ["replay", "--trace", str(head), "--policies",
                                  "lru,infinite,infinite", "--quiet"])
    assert "--policies lists infinite twice" in message
    message = user_error(capsys, ["replay", "--trace", str(head), "--engine", "vllm-offload",
                                  "--horizons", "30", "--quiet"])
    assert "--horizons is for --engine kvevict" in message


def test_replay_default_is_the_bundled_trace_and_every_policy(capsys):
    captured = run(capsys, ["replay", "--sizes", "2000", "--quiet", "--metric",
                            "token_hit_ratio"])
    rows = [line for line in captured.out.splitlines() if line.startswith("| ")][1:]
    names = [row.split(" | ")[0][2:] for row in rows]
    assert names[-4:] == ["horizon-oracle", "reuse-oracle", "belady", "infinite"]
    assert {"lru", "lfu", "market"} <= set(names)
    table = replay_table(read_mooncake(bundled_trace_path()), ["lru", "belady"], [2000])
    assert f"| lru | {table.get('lru', 2000).token_hit_ratio:.4f} |" in captured.out
    assert f"| belady | {table.get('belady', 2000).token_hit_ratio:.4f} |" in captured.out


def test_replay_records_per_request(capsys, head, tmp_path):
    run(capsys, ["replay", "--trace", str(head), "--sizes", "400", "--policies", "lru",
                 "--records", "--out", str(tmp_path), "--quiet"])
    (row,) = json.loads((tmp_path / "results.json").read_text())["results"]
    records = row["records"]
    assert len(records) == HEAD and records[0]["index"] == 0
    assert sum(r["block_hits"] for r in records) == row["hits"]
    assert sum(r["tokens"] for r in records) == row["token_queries"]
    first = read_mooncake(head)[0]
    assert records[0] == {"index": 0, "request_id": 0, "blocks": len(first.block_hashes),
                          "block_hits": 0, "tokens": first.num_tokens, "token_hits": 0,
                          "rejected": False}


def test_replay_every_format_gives_the_library_numbers(capsys, tmp_path):
    reqs = generate("chat", seed=2, duration=300)
    jsonl = tmp_path / "t.jsonl"
    write_jsonl(reqs, jsonl)
    expected = replay_table(reqs, ["lru", "belady"], [64], 16)
    out = run(capsys, ["replay", "--trace", str(jsonl), "--format", "jsonl", "--sizes", "64",
                       "--policies", "lru,belady", "--quiet"]).out
    assert format_table(expected) in out and "blocks of 16 tokens" in out
    # Alibaba (16-token blocks by default) and ShareGPT (token mode)
    alibaba = tmp_path / "a.jsonl"
    alibaba.write_text("".join(json.dumps(
        {"chat_id": i, "parent_chat_id": i - 1 if i % 3 else -1, "timestamp": float(i),
         "input_length": 16 * (i % 3 + 1), "output_length": 4, "type": "text",
         "turn": i % 3 + 1, "hash_ids": list(range(3 * (i // 3), 3 * (i // 3) + i % 3 + 1))})
        + "\n" for i in range(30)))
    out = run(capsys, ["replay", "--trace", str(alibaba), "--format", "alibaba", "--sizes",
                       "8", "--policies", "lru", "--quiet"]).out
    assert format_table(replay_table(read_alibaba(alibaba), ["lru"], [8], 16)) in out
    share = tmp_path / "s.json"
    share.write_text(json.dumps([{"id": f"c{i}", "conversations": [
        {"from": "system", "value": "You are brief. " * 8},
        {"from": "human", "value": f"question {i} " * 5},
        {"from": "gpt", "value": "an answer " * 6},
        {"from": "human", "value": "and then?"}, {"from": "gpt", "value": "done"}]}
        for i in range(12)]))
    out = run(capsys, ["replay", "--trace", str(share), "--format", "sharegpt", "--sizes",
                       "20", "--policies", "lru", "--block-size", "8", "--quiet"]).out
    expected = replay_table(read_sharegpt(share, block_size=8), ["lru"], [20], 8)
    assert format_table(expected) in out and expected.get("lru", 20).hits > 0


def test_replay_progress_bars_on_stderr(capsys, head):
    err = run(capsys, ["replay", "--trace", str(head), "--sizes", "500", "--policies",
                       "lru,belady"]).err.splitlines()
    firsts = [line for line in err if "first pass (next uses)" in line]
    replays = [line for line in err if "replay:" in line]
    assert len(firsts) == len(replays) == 10  # a log (not a terminal): 10 lines per pass
    assert firsts[-1].startswith("[########################] 10/10 first pass (next uses): "
                                 f"{HEAD:,} requests")
    assert replays[-1].startswith(f"[########################] 10/10 replay: {HEAD:,} requests")


def test_replay_policies_with_parameters_are_rows_of_their_own(capsys, head, tmp_path):
    """``--policies 'learned(ghost=true)'``: the row is that text, its numbers the policy's
    built with those parameters (the library's table of factories), and ``--versus`` and
    ``--from`` take the text as a row name."""
    from kvevict.policies.learned import LearnedReuse
    from kvevict.policies.lfu import LFU

    out = tmp_path / "out"
    spec = "learned(gaps=empirical, ghost=true)"
    captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "300,900", "--policies",
                            f"lru,learned,{spec},lfu(half_life=50)", "--versus", spec,
                            "--out", str(out), "--quiet"])
    table = replay_table(read_mooncake(head), {
        "lru": "lru", "learned": "learned",
        spec: lambda: LearnedReuse(gaps="empirical", ghost=True),
        "lfu(half_life=50)": lambda: LFU(half_life=50.0)}, [300, 900])
    assert format_table(table) in captured.out
    assert format_comparison(table, spec) in captured.out
    hits = {(r.policy, r.capacity_blocks): r.hits for r in table.results}
    assert hits[(spec, 300)] != hits[("learned", 300)]  # the parameters reached the policy
    assert hits[("lfu(half_life=50)", 300)] != replay_table(
        read_mooncake(head), ["lfu"], [300]).results[0].hits
    payload = json.loads((out / "results.json").read_text())
    assert payload["policies"] == ["lru", "learned", spec, "lfu(half_life=50)"]
    again = run(capsys, ["replay", "--from", str(out), "--policies", f"lru,{spec}",
                         "--versus", spec])
    assert format_table(table.select(["lru", spec], None)) in again.out
    message = user_error(capsys, ["replay", "--trace", str(head), "--policies",
                                  "lru,learned(ghost=true, gapz=empirical)", "--quiet"])
    assert message == ("kvevict: error: policy 'learned' has no parameter(s) gapz; it "
                       "accepts: cost_model, block_size, prior_weight, memory, "
                       "max_conversations, gaps, ghost")
    message = user_error(capsys, ["replay", "--trace", str(head), "--policies",
                                  "lru,learned(ghost=true", "--quiet"])
    assert message == ("kvevict: error: unbalanced parentheses in the policy list "
                       "'lru,learned(ghost=true'")


def test_replay_policy_module_round_trip(capsys, head, tmp_path, monkeypatch):
    (tmp_path / "my_replay_policies.py").write_text(
        "from kvevict.policies import ScoredPolicy, register_policy\n\n\n"
        "@register_policy('deepest-first')\nclass DeepestFirst(ScoredPolicy):\n"
        "    def score(self, block, now):\n        return -block.depth\n")
    monkeypatch.chdir(tmp_path)
    try:
        message = user_error(capsys, ["replay", "--trace", str(head), "--policies",
                                      "deepest-first", "--quiet"])
        assert message.startswith("kvevict: error: unknown policy deepest-first; valid names:")
        out = tmp_path / "o"
        captured = run(capsys, ["replay", "--trace", str(head), "--sizes", "400",
                                "--policies", "lru,deepest-first", "--policy-module",
                                "my_replay_policies", "--out", str(out), "--quiet"])
        table = replay_table(read_mooncake(head), ["lru", "deepest-first"], [400])
        assert format_table(table) in captured.out
        payload = json.loads((out / "results.json").read_text())
        assert payload["policy_modules"] == {
            "my_replay_policies": str(tmp_path / "my_replay_policies.py")}
        assert payload["command"].startswith(f"PYTHONPATH={tmp_path} kvevict replay ")
    finally:
        sys.modules.pop("my_replay_policies", None)
        if "deepest-first" in POLICIES:
            POLICIES.unregister("deepest-first")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--sizes", "0"], "kvevict: error: --sizes must hold positive ints (pool sizes in "
                       "blocks), got 0"),
    (["--sizes", "100,100"], "kvevict: error: --sizes gives a size twice: 100,100"),
    (["--block-size", "0"], "kvevict: error: --block-size (tokens per block) must be a "
                            "positive int, got 0"),
    (["--block-size", "100"], "kvevict: error: --block-size 100 does not match the trace"),
    (["--policies", "lru,lru"], "kvevict: error: --policies lists lru twice (lru,lru)"),
    (["--trace", "nowhere.jsonl"], "kvevict: error: --trace must be a bundled trace "
                                   "(mooncake) or a Mooncake .jsonl file; 'nowhere.jsonl' is "
                                   "neither"),
    (["--trace", "mooncake", "--format", "jsonl"], "kvevict: error: --trace must be a jsonl "
                                                   "trace file; 'mooncake' is not a file"),
    (["--workdir", "/no/such/dir"], "kvevict: error: --workdir /no/such/dir is not a "
                                    "directory"),
    (["--policies", "lru,lfu", "--versus", "arc"], "kvevict: error: --versus 'arc' is not a "
                                                   "row of this replay (rows: lru, lfu)"),
])
def test_replay_errors_name_the_flag(capsys, argv, expected):
    message = user_error(capsys, ["replay", "--quiet", *argv])
    assert message.startswith(expected), message


def test_replay_versus_a_row_that_horizons_replaced_fails_before_the_replay(capsys):
    """--horizons replaces the horizon oracle's row (`row_labels`): --versus naming it is an
    error before anything is replayed, not after the table is printed."""
    rc = main(["replay", "--quiet", "--policies", "lru,horizon-oracle", "--horizons", "30",
               "--sizes", "300", "--versus", "horizon-oracle"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert captured.err.strip().splitlines()[-1] == (
        "kvevict: error: --versus 'horizon-oracle' is not a row of this replay (rows: lru, "
        "horizon-oracle H=30)")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--sizes", "x"], "kvevict replay: error: argument --sizes: expected comma-separated "
                       "integers, got 'x'"),
    (["--format", "csv"], "kvevict replay: error: argument --format: invalid choice: 'csv'"),
    (["--time", "wall"], "kvevict replay: error: argument --time: invalid choice: 'wall'"),
])
def test_replay_parse_errors_name_the_flag(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(["replay", *argv])
    assert info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(expected), message


def test_replay_on_the_arrival_axis_needs_arrival_order(capsys, tmp_path):
    reqs = generate("chat", seed=0, duration=120)
    path = tmp_path / "shuffled.jsonl"
    write_jsonl([reqs[1], reqs[0], *reqs[2:]], path)
    message = user_error(capsys, ["replay", "--trace", str(path), "--format", "jsonl",
                                  "--time", "arrival", "--sizes", "64", "--policies", "lru",
                                  "--quiet"])
    assert message.startswith(f"kvevict: error: {path}:2: field 'arrival': ")
    assert "expected requests in arrival order" in message
    run(capsys, ["replay", "--trace", str(path), "--format", "jsonl", "--sizes", "64",
                 "--policies", "lru", "--quiet"])  # the index axis does not care


# -- kvevict export -------------------------------------------------------------------------


def test_export_writes_the_generated_trace(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    out = run(capsys, ["export", "--workload", "agent", "--seed", "4", "--duration", "300",
                       "--out", str(path)]).out
    reqs = generate("agent", seed=4, duration=300)
    assert out.strip() == (f"wrote {len(reqs):,} requests of agent (seed 4, scale 1, 300 s) to "
                           f"{path} (kvevict JSONL)")
    assert trace_digest(read_jsonl(path)) == trace_digest(reqs)
    mooncake = tmp_path / "trace.mooncake.jsonl"
    run(capsys, ["export", "--workload", "agent", "--seed", "4", "--duration", "300",
                 "--format", "mooncake", "--out", str(mooncake), "--quiet"])
    back = read_mooncake(mooncake)  # 16-token ids, declared on every line
    assert TraceFile(mooncake, "mooncake").block_size == 16
    assert [r.num_tokens for r in back] == [r.prompt_len for r in reqs]
    assert replay_table(back, ["lru"], [256], 16).get("lru", 256).hits == \
        replay_table(reqs, ["lru"], [256], 16).get("lru", 256).hits


def test_export_round_trip_simulate_gives_the_same_results(capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    run(capsys, ["export", "--workload", "chat", "--seed", "5", "--duration", "240",
                 "--scale", "2", "--out", str(path), "--quiet"])
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    # one seed: a trace file is one sample (where simulate repeats seeds, --seeds 1)
    seeds = ["--seeds", "1"] if "--seeds" in capsys.readouterr().out else []
    common = ["--policies", "lru,belady", "--cache-blocks", "300", "--no-sweep", "--quiet"]
    run(capsys, ["simulate", "--workload", "chat", "--seed", "5", "--duration", "240",
                 "--scale", "2", "--out", str(tmp_path / "gen"), *seeds, *common])
    run(capsys, ["simulate", "--trace", str(path), "--out", str(tmp_path / "file"), *common])
    gen = json.loads((tmp_path / "gen" / "results.json").read_text())
    file = json.loads((tmp_path / "file" / "results.json").read_text())
    key = "cells" if "cells" in gen else "results"  # results.json's layout of the version

    def rows(payload):  # the generator's seed is not part of a trace file
        return [{k: v for k, v in row.items() if k != "seed"} for row in payload[key]]

    assert rows(gen) and rows(gen) == rows(file)
    assert len(rows(gen)) == 2 and gen["capacity_blocks"] == file["capacity_blocks"] == 300
    assert sorted(r["policy"] for r in rows(gen)) == ["belady", "lru"]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--workload", "nope"], "kvevict: error: unknown workload 'nope'; valid workloads:"),
    (["--block-size", "8"], "kvevict: error: --block-size applies to --format mooncake only"),
    (["--format", "mooncake", "--block-size", "0"], "kvevict: error: --block-size (tokens "
                                                    "per block) must be a positive int"),
    (["--seed", "-1"], "kvevict: error: --seed (the generator seed) must be a non-negative "
                       "int, got -1"),
    (["--duration", "0"], "kvevict: error: --duration (seconds of generated trace) must be a "
                          "positive finite number, got 0.0"),
])
def test_export_errors_name_the_flag(capsys, tmp_path, argv, expected):
    message = user_error(capsys, ["export", "--out", str(tmp_path / "t.jsonl"), *argv])
    assert message.startswith(expected), message
    assert not (tmp_path / "t.jsonl").exists()


def test_export_out_must_be_a_file_in_an_existing_directory(capsys, tmp_path):
    message = user_error(capsys, ["export", "--out", str(tmp_path)])
    assert message == f"kvevict: error: --out {tmp_path} is a directory; give the trace " \
                      "file's path"
    missing = tmp_path / "no" / "t.jsonl"
    message = user_error(capsys, ["export", "--out", str(missing)])
    assert message == f"kvevict: error: --out {missing}: the directory {missing.parent} " \
                      "does not exist"


def test_replay_engine_vllm_offload_without_vllm_is_one_clear_line():
    """Where vLLM is absent (the main suite's venv; hidden here so the case runs anywhere)."""
    import subprocess

    code = ("import sys; sys.modules['vllm'] = None\n"
            "from kvevict.cli import main\n"
            "sys.exit(main(['replay', '--engine', 'vllm-offload', '--sizes', '100']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        'kvevict: error: --engine vllm-offload: kvevict.adapters.vllm needs vLLM: pip install '
        '"kvevict[vllm]" (on a CPU-only machine: pip install torch==2.13.0 first)']
