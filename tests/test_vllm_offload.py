"""kvevict policies in vLLM's CPU offload tier, against vLLM's real ``CPUOffloadingManager``.

Marked ``vllm``: skipped where vLLM is not installed (the main suite's venv); run them in the
vLLM venv with ``python -m pytest -m vllm tests/test_vllm_offload.py`` (docs/vllm.md).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from recorder import Recorder

from kvevict.errors import ConfigError, PolicyError
from kvevict.policies.lru import LRU
from kvevict.types import ManualClock


def test_package_imports_without_vllm():
    """``import kvevict.adapters.vllm`` needs no vLLM; using the vLLM parts says how to
    install it."""
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvevict.adapters.vllm as a\n"
        "print(a.SUPPORTED_VLLM)\n"
        "try:\n"
        "    a.KVEvictCachePolicy\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == [
        "('0.32',)",
        'ImportError: kvevict.adapters.vllm needs vLLM: pip install "kvevict[vllm]" (on a '
        "CPU-only machine: pip install torch==2.13.0 first)",
    ]


def test_version_range():
    from kvevict.adapters.vllm import ALLOW_UNTESTED_ENV, check_vllm_version

    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.3+cpu") == "0.32.3+cpu"
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.32\.x .* found vLLM 0\.33\.0"):
        check_vllm_version("0.33.0")
    with pytest.raises(ConfigError, match=r"found vLLM 0\.31\.2"):
        check_vllm_version("0.31.2")
    with pytest.raises(ConfigError, match="must be a string"):
        check_vllm_version(32)  # type: ignore[arg-type]
    import os

    os.environ[ALLOW_UNTESTED_ENV] = "1"
    try:
        assert check_vllm_version("0.40.0") == "0.40.0"
    finally:
        del os.environ[ALLOW_UNTESTED_ENV]


# -- everything below needs vLLM ---------------------------------------------------------------

vllm_only = pytest.mark.vllm


@pytest.fixture(scope="module")
def v():
    """vLLM's offload classes and kvevict's adapter, or a clean skip."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvevict.adapters.vllm import offload, replay

    class V:
        pass

    ns = V()
    ns.LookupResult, ns.ReqContext, ns.key = LookupResult, ReqContext, make_offload_key
    ns.Manager, ns.offload, ns.replay = CPUOffloadingManager, offload, replay
    return ns


def key(v, i: int):
    return v.key(i.to_bytes(8, "big"), 0)


def build(v, capacity: int, policy, params=None, chunk_tokens: int = 16):
    clock = ManualClock()
    with v.offload.offload_policy(policy, params, chunk_tokens=chunk_tokens,
                                  clock=clock) as slot:
        manager = v.Manager(capacity, cache_policy="KVEvictCachePolicy",
                            cache_policy_module_path="kvevict.adapters.vllm.offload")
    return manager, slot.policies[0], clock


def run(v, manager, ids, req_id="r", params=None, chunk_tokens=16):
    """One request of keys ``ids`` through vLLM's manager (replay's steps)."""
    ctx = v.ReqContext(req_id, kv_transfer_params=params)
    keys = [key(v, i) for i in ids]
    return v.replay.drive_request(manager, keys, ctx, chunk_tokens)


def resident(v, manager, ids):
    ctx = v.ReqContext("probe")
    return [i for i in ids if manager.lookup(key(v, i), ctx) is v.LookupResult.HIT]


@vllm_only
def test_config_errors(v):
    with pytest.raises(ConfigError, match="offline"):
        build(v, 4, "belady")
    with pytest.raises(ConfigError, match="halflife"):
        build(v, 4, "lfu", {"halflife": 3})
    with pytest.raises(ConfigError, match="found no configuration"):
        v.Manager(4, cache_policy="KVEvictCachePolicy",
                  cache_policy_module_path="kvevict.adapters.vllm.offload")
    with pytest.raises(ConfigError, match="kvevict_policy"):
        v.offload.OffloadConfig.from_extra_config({"kvevict_policy_params": {}},
                                                  chunk_tokens=16)
    with pytest.raises(ConfigError, match="kvevict_chunk_tokens"):
        v.offload.OffloadConfig.from_extra_config({"kvevict_policy": "lru"})
    with pytest.raises(ConfigError, match="kvevict_chunk_tokens must be a positive int"):
        v.offload.OffloadConfig.from_extra_config({"kvevict_policy": "lru",
                                                   "kvevict_chunk_tokens": 0})
    with pytest.raises(ConfigError, match="mapping"):
        v.offload.OffloadConfig.from_extra_config({"kvevict_policy": "lru",
                                                   "kvevict_policy_params": [1]},
                                                  chunk_tokens=16)



def _spec_config(v, extra):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False, extra_config=extra, engine_id="e0",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))


@vllm_only
def test_official_route_reads_kv_connector_extra_config(v):
    """vLLM's own CPUOffloadingSpec builds the manager from kv_connector_extra_config; the
    adapter finds its policy, parameters and chunk geometry there."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    extra = {"cpu_bytes_to_use": 10 * 8192, "eviction_policy": "KVEvictCachePolicy",
             "cache_policy_module_path": "kvevict.adapters.vllm.offload",
             "kvevict_policy": "lfu", "kvevict_policy_params": {"half_life": 7.0}}
    spec = CPUOffloadingSpec(_spec_config(v, extra))
    manager = spec.get_manager()
    assert spec.num_chunks == 10
    hits, evicted = run(v, manager, [1, 2, 3], chunk_tokens=32)
    assert (hits, evicted) == (0, 0)
    assert resident(v, manager, [1, 2, 3, 4]) == [1, 2, 3]
    # the policy it runs is kvevict's LFU with that half-life, over chunks of 16 x 2 tokens
    with pytest.raises(ConfigError, match="kvevict_policy"):
        CPUOffloadingSpec(_spec_config(v, {**extra, "kvevict_policy": ""})).get_manager()
    cfg = v.offload.OffloadConfig.from_extra_config(extra, chunk_tokens=32, chunk_bytes=8192)
    assert (cfg.policy, dict(cfg.params), cfg.chunk_tokens, cfg.chunk_bytes) == (
        "lfu", {"half_life": 7.0}, 32, 8192)


@vllm_only
def test_lru_order_and_evict_atomic(v):
    manager, adapter, _ = build(v, 4, "lru")
    run(v, manager, [1, 2], "a")
    run(v, manager, [3, 4], "b")
    # a's chunks were released first, tail first: 2 goes, then 1
    assert run(v, manager, [5], "c") == (0, 1)
    assert resident(v, manager, [1, 2, 3, 4, 5]) == [1, 3, 4, 5]
    adapter.check()
    # five new chunks cannot fit in four: None, nothing changed (vLLM skips the store)
    before = dict(adapter.chunks)
    assert run(v, manager, [10, 11, 12, 13, 14], "d") == (0, None)
    assert adapter.chunks == before and resident(v, manager, [1, 3, 4, 5]) == [1, 3, 4, 5]
    assert adapter.evict(5, set()) is None and adapter.evict(0, set()) == []
    adapter.check()


@vllm_only
def test_protected_and_loading_chunks_are_never_evicted(v):
    manager, adapter, _ = build(v, 4, Recorder())
    run(v, manager, [1, 2, 3, 4], "a")  # LRU order now: 4, 3, 2, 1
    ctx = v.ReqContext("loader")
    manager.prepare_load([key(v, 4)], ctx)  # 4 is loading: not evictable
    protected = {key(v, 3)}
    out = adapter.evict(2, protected)
    assert [k for k, _ in out] == [key(v, 2), key(v, 1)]
    # the protected victim was set aside and offered back: it goes first next time
    assert [k for k, _ in adapter.evict(1, set())] == [key(v, 3)]
    assert adapter.evict(1, set()) is None  # only the loading chunk is left
    manager.complete_load([key(v, 4)], ctx)
    assert [k for k, _ in adapter.evict(1, set())] == [key(v, 4)]
    # feasibility counts protected idle chunks out before any event
    run(v, manager, [7, 8], "b")
    events = len(adapter.policy.log)
    assert adapter.evict(2, {key(v, 7)}) is None
    assert len(adapter.policy.log) == events


@vllm_only
def test_reused_and_insertion_only_keys(v):
    """on_request_finished: hits for reused keys only, head first; releases tail first; an
    idle chunk is offered once its request finishes, or before a victim is chosen."""
    policy = Recorder()
    manager, adapter, clock = build(v, 3, policy)
    run(v, manager, [1, 2], "a")
    ids = {i: adapter.chunks[key(v, i)].chunk_id for i in (1, 2)}
    assert policy.log == [("on_insert", ids[1]), ("on_insert", ids[2]),
                          # a's finish: release stamps tail first, each offered once
                          ("on_candidate", ids[2]), ("on_candidate", ids[1])]
    policy.log.clear()
    clock.set(1.0)
    run(v, manager, [1, 2, 3], "b")  # reuses 1 and 2, inserts 3
    ids[3] = adapter.chunks[key(v, 3)].chunk_id
    assert policy.log == [
        ("on_uncandidate", ids[1]), ("on_uncandidate", ids[2]),  # the load
        ("on_insert", ids[3]),  # the store (the loaded chunks wait for b's finish)
        ("on_hit", ids[1]), ("on_hit", ids[2]),  # b's finish: hits, head first
        ("on_candidate", ids[3]), ("on_candidate", ids[2]),  # releases, tail first
        ("on_candidate", ids[1]),
    ]
    records = {i: adapter.records[key(v, i)] for i in (1, 2, 3)}
    assert [r.hit_count for r in records.values()] == [1, 1, 0]
    assert [r.depth for r in records.values()] == [0, 1, 2]
    assert records[1].last_access == 1.0
    assert records[3].last_access_tick < records[2].last_access_tick \
        < records[1].last_access_tick
    adapter.check()
    policy.log.clear()
    clock.set(2.0)
    run(v, manager, [1, 4], "c")  # reuses 1; storing 4 evicts the least recent, 3
    ids[4] = adapter.chunks[key(v, 4)].chunk_id
    assert policy.log == [
        ("on_uncandidate", ids[1]),  # the load
        ("on_candidate", ids[1]),  # loaded, idle: offered before the victim is chosen
        ("on_evict", ids[3]), ("on_insert", ids[4]),
        ("on_uncandidate", ids[1]), ("on_hit", ids[1]),  # c's finish
        ("on_candidate", ids[4]), ("on_candidate", ids[1]),
    ]
    assert key(v, 3) not in adapter.records and adapter.records[key(v, 1)].hit_count == 2
    adapter.check()


@vllm_only
def test_request_context_becomes_session_class_and_hint(v, caplog):
    manager, adapter, _ = build(v, 8, "lru")
    hints = {"kvevict": {"session_id": "s1", "workload_class": "agent", "priority": 2.0,
                         "until": 50.0}}
    run(v, manager, [1, 2], "a", params=hints)
    record = adapter.records[key(v, 2)]
    assert (record.session, record.workload_class, record.depth) == ("s1", "agent", 1)
    assert (record.retention.priority, record.retention.until) == (2.0, 50.0)
    run(v, manager, [1, 2, 3], "b", params={"kvevict": {"session_id": "s2"}})
    assert adapter.records[key(v, 1)].sharers.keys() == {"s1", "s2"}
    assert adapter.records[key(v, 1)].last_hit_session == "s2"
    with caplog.at_level(logging.WARNING, logger="kvevict.adapters.vllm"):
        run(v, manager, [4], "c", params={"kvevict": {"workload_class": "", "x": 1}})
    assert "request c: kv_transfer_params['kvevict'] ignored: unknown keys ['x']" \
        in caplog.text
    assert adapter.records[key(v, 4)].workload_class == "chat"


def _consistent(v, manager, adapter, ids):
    """The manager and the adapter agree after a fault: every resident key is readable,
    loads and stores still work, and the adapter's own books balance."""
    adapter.check()
    ctx = v.ReqContext("check")
    live = resident(v, manager, ids)
    manager.prepare_load([key(v, i) for i in live], ctx)
    manager.complete_load([key(v, i) for i in live], ctx)
    adapter.check()
    stats = manager.get_stats()
    assert stats is not None
    return live


@vllm_only
@pytest.mark.parametrize("event", ["on_insert", "on_candidate", "on_uncandidate", "on_hit",
                                   "on_evict", "victim"])
def test_a_raising_policy_leaves_the_manager_consistent(v, event, caplog):
    policy = Recorder(fail=event, after=1)
    manager, adapter, _ = build(v, 4, policy)
    with caplog.at_level(logging.ERROR, logger="kvevict.adapters.vllm"):
        evicted = sum(run(v, manager, ids, f"r{n}")[1]  # nothing escapes into vLLM
                      for n, ids in enumerate([[1, 2], [1, 2, 3], [4, 5], [6, 7], [1, 8]]))
    error = adapter.policy_error
    assert isinstance(error, PolicyError) and error.event == event
    assert isinstance(error.__cause__, RuntimeError)
    assert adapter.policy is None and f"failed in {event}" in caplog.text
    live = _consistent(v, manager, adapter, range(1, 9))
    assert len(live) == 4  # the tier keeps working: evictions by the fallback order
    assert adapter.fallback_evictions > 0
    assert adapter.evictions == evicted >= 3


@vllm_only
def test_a_victim_that_is_no_candidate_is_a_policy_error(v):
    class Liar(LRU):
        def victim(self, now):
            return 10_000

        pop_victim = None

    manager, adapter, _ = build(v, 2, Liar())
    run(v, manager, [1, 2], "a")
    assert run(v, manager, [3], "b") == (0, 1)
    assert adapter.policy_error.event == "victim"
    assert "victim 10000 is not an idle chunk" in str(adapter.policy_error)
    # the fallback: the order chunks last became idle; a's release went tail first (2, 1)
    assert resident(v, manager, [1, 2, 3]) == [1, 3]
    _consistent(v, manager, adapter, [1, 2, 3])


@vllm_only
def test_clear(v):
    manager, adapter, _ = build(v, 4, "lfu")
    run(v, manager, [1, 2], "a")
    first = adapter.policy
    manager.reset_cache()
    assert len(adapter) == 0 and adapter.policy is not first and len(adapter.policy) == 0
    assert run(v, manager, [1, 2], "b") == (0, 0)
    adapter.check()
    recorder = Recorder()
    manager, adapter, _ = build(v, 4, recorder)
    run(v, manager, [1], "a")
    before = adapter.records[key(v, 1)].last_access_tick
    recorder.log.clear()
    manager.reset_cache()
    assert recorder.log == [("on_evict", 0)] and len(recorder) == 0
    run(v, manager, [1], "b")  # the instance outlives the reset: its ticks stay strict
    assert adapter.records[key(v, 1)].last_access_tick > before


# -- the bundled Mooncake trace through vLLM's real manager --------------------------------

@pytest.fixture(scope="module")
def mooncake(v):
    from kvevict.workloads import bundled_trace_path, read_mooncake

    return read_mooncake(bundled_trace_path("mooncake"))


SIZES = (1000, 5000, 20000)
# chunk hit ratios of vLLM's own policies (issue 14 measured the same) and of kvevict's
# through the adapter, on vLLM's real CPUOffloadingManager
GOLDEN = {
    "vllm:lru": (0.0880, 0.2925, 0.6009),
    "vllm:arc": (0.0820, 0.3045, 0.6132),
    "market": (0.0856, 0.2925, 0.6009),
    "bayes": (0.0107, 0.2520, 0.6009),
}


@vllm_only
def test_kvevict_lru_hits_exactly_what_vllm_lru_hits(v, mooncake):
    for size in SIZES:
        ours = v.replay.replay_offload(mooncake, "lru", size,
                                       check_every=1000 if size == 1000 else 0)
        theirs = v.replay.replay_offload(mooncake, "vllm:lru", size)
        assert (ours.hits, ours.evictions, ours.accesses) == (
            theirs.hits, theirs.evictions, theirs.accesses)
        assert round(theirs.block_hit_ratio, 4) == GOLDEN["vllm:lru"][SIZES.index(size)]
        assert ours.accesses == 117_888 and ours.requests == 2_886  # full chunks only


@vllm_only
@pytest.mark.parametrize("policy", ["vllm:arc", "market", "bayes"])
def test_golden_hit_ratios(v, mooncake, policy):
    got = tuple(round(v.replay.replay_offload(mooncake, policy, size).block_hit_ratio, 4)
                for size in SIZES)
    assert got == GOLDEN[policy]


@vllm_only
def test_offload_requests_keep_full_chunks_only(v):
    from kvevict.types import Request

    reqs = [Request(0, block_hashes=(1, 2, 3), num_tokens=1100),
            Request(1, block_hashes=(1,), num_tokens=300)]
    cut = v.replay.offload_requests(reqs, 512)
    assert [(r.block_hashes, r.num_tokens) for r in cut] == [((1, 2), 1024)]
    # token mode: the chained hashes of the full chunks; a request with none is dropped
    tok = v.replay.offload_requests([Request(2, tokens=[1, 2, 3, 4, 5])], 2)
    assert [(len(r.block_hashes), r.num_tokens) for r in tok] == [(2, 4)]
    assert v.replay.offload_requests([Request(3, tokens=[1, 2, 3])], 512) == []
    with pytest.raises(ConfigError, match="unknown vLLM policy"):
        v.replay.make_manager("vllm:fifo", 10)


# -- kvevict replay --engine vllm-offload ------------------------------------------------------


@vllm_only
def test_cli_engine_vllm_offload_equals_the_library_call(v, tmp_path, capsys):
    import json

    from kvevict.cli import main
    from kvevict.replay import compare, format_comparison, format_table
    from kvevict.workloads import bundled_trace_path, read_mooncake, write_mooncake

    head = tmp_path / "head.jsonl"
    write_mooncake(read_mooncake(bundled_trace_path("mooncake"))[:600], head)
    out = tmp_path / "out"
    policies, sizes = ["vllm:lru", "lru", "market", "vllm:arc"], [200, 800]
    rc = main(["replay", "--engine", "vllm-offload", "--trace", str(head), "--sizes", "200,800",
               "--policies", ",".join(policies), "--versus", "vllm:lru", "--out", str(out),
               "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lib = v.replay.replay_offload_table(read_mooncake(head), policies, sizes)
    for policy in policies:  # the table is the cells replay_offload gives one by one
        for size in sizes:
            one = v.replay.replay_offload(read_mooncake(head), policy, size)
            got = lib.get(policy, size)
            assert (got.hits, got.accesses, got.evictions, got.rejected) == (
                one.hits, one.accesses, one.evictions, one.rejected)
    lines = captured.out.splitlines()
    cut = len(v.replay.offload_requests(read_mooncake(head), 512))
    assert lines[0] == (f"trace {head} (mooncake): {cut:,} requests; offload chunks of 512 "
                        "tokens; time axis index; vLLM's CPUOffloadingManager")
    assert "\n".join(lines[1:7]) == format_table(lib)
    assert lib.get("lru", 800).hits == lib.get("vllm:lru", 800).hits
    # paired with vLLM's own LRU batch by batch: kvevict's lru is exactly it
    assert format_comparison(lib, "vllm:lru") + "\n" in captured.out
    for size in sizes:
        ours, theirs = lib.get("lru", size), lib.get("vllm:lru", size)
        assert ours.batches == theirs.batches and len(ours.batches) == 11  # 358 cut
        assert [sum(b[i] for b in ours.batches) for i in range(4)] == [
            ours.accesses, ours.hits, ours.token_queries, ours.token_hits]
    same = [c for c in compare(lib, "vllm:lru") if c.policy == "lru"]
    assert [c.difference.half for c in same] == [0.0, 0.0]
    payload = json.loads((out / "results.json").read_text())
    assert payload["engine"] == "vllm-offload" and payload["vllm_version"].startswith("0.32")
    keys = ("policy", "capacity_blocks", "hits", "accesses", "evictions", "rejected")
    assert [{k: r[k] for k in keys} for r in payload["results"]] == [
        {k: r[k] for k in keys} for r in lib.rows()]


@vllm_only
def test_cli_engine_vllm_offload_token_mode_and_arrival_clock(v, tmp_path, capsys):
    from kvevict.cli import main
    from kvevict.hashing import block_hashes
    from kvevict.workloads import generate, read_jsonl, write_jsonl

    path = tmp_path / "chat.jsonl"
    write_jsonl(generate("chat", seed=2, duration=300), path)
    reqs = read_jsonl(path)
    cut = v.replay.offload_requests(reqs, 16)
    # token mode: the chained hashes kvevict gives the same full blocks
    assert cut[0].block_hashes == tuple(block_hashes(reqs[0].tokens, 16))
    rc = main(["replay", "--engine", "vllm-offload", "--trace", str(path), "--format", "jsonl",
               "--sizes", "64,256", "--policies", "lru,market", "--time", "arrival",
               "--metric", "hits", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = [line for line in captured.out.splitlines() if line.startswith("| ")][1:]
    got = {row.split(" | ")[0][2:]: row for row in rows}
    for policy in ("lru", "market"):
        cells = [v.replay.replay_offload(reqs, policy, s, chunk_tokens=16,
                                         time="arrival").hits for s in (64, 256)]
        assert got[policy] == f"| {policy} | {cells[0]:,} | {cells[1]:,} |"
    assert v.replay.replay_offload(reqs, "lru", 64, chunk_tokens=16).hits > 0


@vllm_only
def test_cli_engine_vllm_offload_errors(v, capsys):
    from kvevict.cli import main

    def error(argv):
        assert main(argv) == 2
        return capsys.readouterr().err.strip()

    base = ["replay", "--engine", "vllm-offload", "--sizes", "100", "--quiet"]
    assert "belady is offline" in error(base + ["--policies", "lru,belady"])
    assert error(base + ["--policies", "vllm:fifo"]).startswith(
        "kvevict: error: unknown policy vllm:fifo; valid names with --engine vllm-offload: "
        "vllm:lru, vllm:arc, ")
    assert "--records is for --engine kvevict" in error(base + ["--records"])
    with pytest.raises(ConfigError, match="twice"):
        v.replay.replay_offload_table([], ["lru", "lru"], [10])
    with pytest.raises(ConfigError, match="time must be"):
        v.replay.replay_offload([], "lru", 10, time="wall")
