"""`kvevict.study`: the cells of a comparison give the same results serially, in worker
processes and as Ray tasks, cell for cell and in the order given."""

from __future__ import annotations

import pytest

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.layout import preset
from kvevict.study import Cell, Source, Study, run_cell, run_cells

LAYOUT = preset("llama-3-8b")


@pytest.fixture(scope="module")
def study() -> Study:
    return Study(Source(workload="chat-server", duration=30.0), LAYOUT, 16,
                 CostModel.for_model(LAYOUT))


def cells() -> list[Cell]:
    return [Cell(p, 512, s) for s in (0, 1) for p in ("lru", "market", "belady")] + [
        Cell("market", 400, 1), Cell("lru", 400, 0)]


@pytest.fixture(scope="module")
def serial(study: Study) -> list[dict]:
    return run_cells(study, cells())


def test_a_cell_is_its_simulation(study: Study, serial: list[dict]) -> None:
    from kvevict.sim import simulate

    requests = study.source.requests(1)
    direct = simulate(requests, "market", capacity_blocks=400, layout=LAYOUT, block_size=16,
                      cost=study.cost).summary()
    assert serial[cells().index(Cell("market", 400, 1))] == {**direct, "seed": 1}
    assert serial[0]["seed"] == 0 and serial[3]["seed"] == 1
    assert serial[0] != {**serial[3], "seed": 0}  # each seed its own trace


def test_workers_give_the_serial_results_cell_for_cell(study: Study,
                                                       serial: list[dict]) -> None:
    seen: list[Cell] = []
    parallel = run_cells(study, cells(), jobs=2, progress=seen.append)
    assert parallel == serial
    assert sorted(seen) == sorted(cells())


def test_ray_gives_the_serial_results_cell_for_cell(study: Study, serial: list[dict]) -> None:
    pytest.importorskip("ray")
    assert run_cells(study, cells(), ray=True, jobs=2) == serial


def test_records_on_request(study: Study) -> None:
    out = run_cell(study, Cell("lru", 512, 0, records=True))
    assert len(out["records"]) == out["requests"]
    assert {"ttft", "queue_wait", "cached_tokens"} <= set(out["records"][0])
    assert "records" not in run_cell(study, Cell("lru", 512, 0))


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_bad_jobs(study: Study, jobs: object) -> None:
    with pytest.raises(ConfigError, match="jobs must be a positive int"):
        run_cells(study, cells()[:1], jobs=jobs)  # type: ignore[arg-type]


def test_source_needs_one_origin() -> None:
    with pytest.raises(ConfigError, match="exactly one of workload= and trace="):
        Source()
    with pytest.raises(ConfigError, match="unknown trace format 'csv'"):
        Source(trace="x", format="csv")


def test_replay_cells_are_the_exact_untimed_replay(study: Study) -> None:
    from kvevict.replay import replay

    requests = study.source.requests(0)
    out = run_cell(study, Cell("belady", 400, 0, mode="replay"))
    exact = replay(requests, "belady", 400, 16)
    assert out["token_hit_ratio"] == round(exact.token_hit_ratio, 6)
    assert out["block_hit_ratio"] == round(exact.block_hit_ratio, 6)
    infinite = run_cell(study, Cell("lru", None, 0, mode="replay"))
    assert infinite["evictions"] == 0
    assert infinite["token_hit_ratio"] >= out["token_hit_ratio"]
    with pytest.raises(ConfigError, match="only a replay cell may have an unbounded pool"):
        Cell("lru", None, 0)
    with pytest.raises(ConfigError, match="mode is one of timed, replay"):
        Cell("lru", 4, 0, mode="fast")


@pytest.mark.parametrize("value", [1, "yes", None])
def test_closed_loop_must_be_a_bool(value: object) -> None:
    with pytest.raises(ConfigError, match="closed_loop must be True or False"):
        Study(Source(workload="chat-server"), LAYOUT, 16, CostModel(),
              closed_loop=value)  # type: ignore[arg-type]
