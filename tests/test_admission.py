"""Admission that sees prices in the simulator (issue 13): ``kvevict simulate --admission``
and `Study.admission` carry `MarketAdmission` into the market policy's cells; a deferred
request runs within the bound while the pool stays full of high-priced state; interactive
classes never wait; golden per-class numbers of a small seeded run."""

from __future__ import annotations

import json
import pickle

import pytest

from kvevict.admission import Admission, AdmissionDecision
from kvevict.cli import main
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import preset
from kvevict.policies import Market, MarketAdmission
from kvevict.policies.market.admission import (
    ADMISSIONS,
    DEFAULT_MAX_WAIT,
    admission_for,
    check_admission,
    quotes_prices,
)
from kvevict.sim import simulate
from kvevict.study import Cell, Source, Study, run_cell, run_cells
from kvevict.types import Request

LAYOUT = preset("llama-3-8b")
INTERACTIVE = ("chat", "agent", "rag")

#: a small seeded run: 300 s of the mixed workload (170 requests: 4 agent, 26 chat, 57 rag,
#: 83 single-shot) in 300 blocks on one H100, where the pool is full of priced state
SMALL = ["simulate", "--workload", "mixed", "--duration", "300", "--gpu", "h100-sxm-80gb",
         "--cache-blocks", "300", "--policies", "market", "--no-sweep", "--seeds", "1",
         "--jobs", "1", "--quiet"]


def small_study(admission: str) -> Study:
    return Study(Source(workload="mixed", duration=300.0), LAYOUT, 16,
                 CostModel.for_model(LAYOUT), admission=admission)


# -- names ------------------------------------------------------------------------------------


def test_admission_names_and_what_each_builds():
    assert ADMISSIONS == ("always", "market")
    assert check_admission("market") == "market"
    with pytest.raises(ConfigError, match=r"unknown admission 'sometimes'; valid admissions: "
                                          r"always, market"):
        check_admission("sometimes")
    assert quotes_prices("market") and not quotes_prices("lru")
    with pytest.raises(ConfigError, match="unknown policy 'nope'"):
        quotes_prices("nope")
    # always: the name, built by the run; the manager's default AlwaysAdmit
    assert admission_for("always", "market") == ("market", None)
    # market on a policy without prices: the name, admitting always
    assert admission_for("market", "lru") == ("lru", None)
    assert admission_for("market", "belady") == ("belady", None)  # offline: built by the run
    # market on the market: a fresh Market and an admission quoting that same instance
    market, admission = admission_for("market", "market")
    assert type(market) is Market and isinstance(admission, MarketAdmission)
    assert admission.market is market and admission.max_wait == DEFAULT_MAX_WAIT == 30.0
    again, _ = admission_for("market", "market")
    assert again is not market  # each run its own state
    with pytest.raises(ConfigError, match="unknown admission 'yes'"):
        admission_for("yes", "market")


def test_study_carries_the_admission_and_pickles_with_it():
    study = small_study("market")
    assert study.admission == "market" and small_study("always") != study
    assert pickle.loads(pickle.dumps(study)) == study
    assert Study(study.source, LAYOUT, 16, study.cost).admission == "always"
    with pytest.raises(ConfigError, match="unknown admission 'market-ish'"):
        small_study("market-ish")


# -- the bounded wait ---------------------------------------------------------------------------


class Logged(Admission):
    """Delegates to a `MarketAdmission`, logging each decision with the reuse probability of
    the cheapest candidate at that instant."""

    def __init__(self, inner: MarketAdmission) -> None:
        self.inner = inner
        self.log: list[tuple[str, float, AdmissionDecision, float]] = []

    def admit(self, request, num_evictions, manager, now):
        cheapest = min(q.reuse_probability
                       for q in self.inner.market.cheapest(num_evictions, now))
        decision = self.inner.admit(request, num_evictions, manager, now)
        self.log.append((request.request_id, now, decision, cheapest))
        return decision

    def on_admitted(self, request, now):
        self.inner.on_admitted(request, now)


def hot_agent_and_a_batch_request() -> list[Request]:
    """An agent loop re-reads the same 4-block context every 2 s for 80 s, so its blocks stay
    priced high; a 3-block batch request arrives at t=5 in a 6-block pool with 2 free blocks:
    it must evict one of the agent's blocks."""
    agent = [Request(f"a{k}", tokens=list(range(64)), session_id="task",
                     workload_class="agent", output_len=1, arrival=2.0 * k, turn=k + 1)
             for k in range(40)]
    batch = Request("b", tokens=list(range(1000, 1048)), session_id="job",
                    workload_class="batch", output_len=1, arrival=5.0, turn=1)
    return [*agent, batch]


def test_a_deferred_request_runs_within_the_bound_while_the_pool_stays_full_of_priced_state():
    market, admission = admission_for("market", "market")
    logged = Logged(admission)
    result = simulate(hot_agent_and_a_batch_request(), market, capacity_blocks=6,
                      block_size=16, admission=logged)
    batch = [r for r in result.records if r.request_id == "b"]
    assert len(batch) == 1 and batch[0].finish > 0
    b = batch[0]
    # deferred from t=5 on, admitted at t=5+max_wait exactly (the wait counts as memory)
    assert b.queue_wait == b.wait_memory == DEFAULT_MAX_WAIT
    decisions = [(now, d, p) for rid, now, d, p in logged.log if rid == "b"]
    assert decisions[0][0] == 5.0 and not decisions[0][1].admit
    assert all(not d.admit for _, d, _ in decisions[:-1])
    now, last, cheapest = decisions[-1]
    assert last.admit and now == 5.0 + DEFAULT_MAX_WAIT
    assert last.reason == "waited 30 s >= max_wait"
    # admitted by the bound, not by a price drop: the agent's state is still priced far
    # above the 0.1 a batch request is worth, at every try and at the admission
    assert admission.weight("batch") == 0.1
    assert min(p for _, _, p in decisions) > 0.8 and cheapest > 0.9
    # every try was a deferral the scheduler counted, and the agent never waited
    assert b.deferrals == len(decisions) - 1 == admission.deferrals == 45
    assert all(r.deferrals == 0 for r in result.records if r.workload_class == "agent")
    # the agent's next turn (t=36) recomputes the block the batch request took
    cached = {r.request_id: r.cached_tokens for r in result.records}
    assert cached["a17"] == 64 and cached["a18"] == 48 and cached["a19"] == 64
    # without admission control the batch request evicts at once
    plain = simulate(hot_agent_and_a_batch_request(), "market", capacity_blocks=6,
                     block_size=16)
    assert [r.queue_wait for r in plain.records if r.request_id == "b"] == [0.0]


# -- interactive classes never wait -------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_cells() -> dict[str, dict]:
    """The market and LRU cells of the small mixed run, with and without admission."""
    out = {}
    for admission in ADMISSIONS:
        for policy in ("market", "lru"):
            out[f"{policy}/{admission}"] = run_cell(
                small_study(admission), Cell(policy, 300, 0, records=True))
    return out


def test_on_a_mixed_workload_interactive_requests_never_wait_and_single_shot_ones_do(
        mixed_cells):
    cell = mixed_cells["market/market"]
    assert cell["admission"] == "market" and cell["policy"] == "market"
    waited = {}
    for rec in cell["records"]:
        if rec["deferrals"]:
            waited[rec["workload_class"]] = waited.get(rec["workload_class"], 0) + 1
    assert waited == {"single_shot": 8}
    for cls in INTERACTIVE:
        assert cell["classes"][cls]["deferrals"] == 0, cls
    assert cell["classes"]["single_shot"]["deferrals"] == cell["deferrals"] == 843
    # and each single-shot request that waited ran within the bound (plus queueing)
    waits = [r["queue_wait"] for r in cell["records"] if r["deferrals"]]
    assert 0 < max(waits) <= DEFAULT_MAX_WAIT + 1.0
    # nothing defers without admission control, nor in LRU's cells of the market study
    for key in ("market/always", "lru/always", "lru/market"):
        assert mixed_cells[key]["deferrals"] == 0, key
    assert mixed_cells["lru/market"]["admission"] == "always"
    assert "admission" not in mixed_cells["lru/always"]  # a default study's cells as before
    lru = {k: v for k, v in mixed_cells["lru/market"].items() if k != "admission"}
    assert lru == mixed_cells["lru/always"]  # LRU's cell is untouched by --admission market


def test_golden_per_class_numbers_of_the_small_mixed_run(mixed_cells):
    """p95 TTFT (s) and token hit ratio per class, market without and with admission: the
    single-shot requests wait (0.038 -> 0.772 s), chat hits a little more (0.633 -> 0.649)."""
    def per_class(cell):
        return {c: (v["ttft_p95"], v["token_hit_ratio"]) for c, v in cell["classes"].items()}

    assert per_class(mixed_cells["market/always"]) == {
        "agent": (0.054604, 0.48992), "chat": (0.12612, 0.632822),
        "rag": (0.053319, 0.122262), "single_shot": (0.038109, 0.523414)}
    assert per_class(mixed_cells["market/market"]) == {
        "agent": (0.054604, 0.48992), "chat": (0.12599, 0.649013),
        "rag": (0.053003, 0.1244), "single_shot": (0.772293, 0.516183)}


def test_workers_carry_the_admission(mixed_cells):
    cells = [Cell("market", 300, 0), Cell("lru", 300, 0)]
    parallel = run_cells(small_study("market"), cells, jobs=2)
    serial = [{k: v for k, v in mixed_cells[key].items() if k != "records"}
              for key in ("market/market", "lru/market")]
    assert parallel == serial


# -- the flag --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    out = tmp_path_factory.mktemp("admission")
    argv = [*SMALL, "--admission", "market", "--out", str(out)]
    return main(argv), out


def test_the_flag_is_recorded_in_results_and_the_rerun_command(flagged, capsys):
    rc, out = flagged
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["admission"] == "market"
    assert " --admission market " in results["command"] + " "
    decision = (out / "DECISION.md").read_text()
    assert f"- **Rerun:** `{results['command']}`" in decision
    cells = {c["policy"]: c for c in results["cells"]}
    assert set(cells) == {"lru", "market"}
    assert cells["market"]["admission"] == "market" and cells["lru"]["admission"] == "always"
    assert cells["lru"]["deferrals"] == 0
    # the measurement path: the same golden per-class numbers through the command
    single = cells["market"]["classes"]["single_shot"]
    assert (single["ttft_p95"], single["token_hit_ratio"], single["deferrals"]) == (
        0.772293, 0.516183, 843)
    assert all(cells["market"]["classes"][c]["deferrals"] == 0 for c in INTERACTIVE)


def test_the_default_is_always_and_is_recorded(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["simulate", "--workload", "chat", "--duration", "60", "--gpu", "l4-24gb",
                 "--policies", "lru", "--no-sweep", "--seeds", "1", "--quiet",
                 "--out", str(out)]) == 0
    assert "admission: always (every request evicts what the policy picks" in \
        capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["admission"] == "always" and "--admission" not in results["command"]
    assert all("admission" not in c for c in results["cells"])


def test_market_admission_needs_a_policy_that_quotes_prices(capsys):
    assert main(["simulate", "--workload", "chat", "--duration", "60", "--policies", "lru,lfu",
                 "--admission", "market", "--no-sweep", "--seeds", "1", "--quiet"]) == 2
    message = capsys.readouterr().err.strip()
    assert message == (
        "kvevict: error: --admission market defers with the market policy's prices, and no "
        "policy in --policies quotes them (lru, lfu); add market to --policies, or use "
        "--admission always")


def test_an_unknown_admission_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as info:
        main([*SMALL, "--admission", "sometimes"])
    assert info.value.code == 2
    assert "--admission: invalid choice: 'sometimes'" in capsys.readouterr().err
