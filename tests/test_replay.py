"""The block-level replay on the bundled Mooncake trace, and the Mooncake reader and writer."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import pytest

from kvevict import ConfigError, Request, TraceFormatError, available_policies, make_policy
from kvevict.cost import CostModel, PrefillLedger
from kvevict.policies.belady import Belady
from kvevict.replay import (
    BATCH_FIELDS,
    MIN_BATCHES,
    Batches,
    ReplayTable,
    Tally,
    compare,
    format_comparison,
    format_table,
    lag1,
    lag1_factor,
    load_results,
    main,
    replay,
    replay_table,
)
from kvevict.stats import interval
from kvevict.workloads import (
    MOONCAKE_BLOCK_SIZE,
    bundled_trace_path,
    iter_mooncake,
    read_mooncake,
    write_mooncake,
)

SIZES = (1000, 2000, 5000, 10000, 20000)

#: An independent replay with the same semantics (issue text): LRU must be within 0.01.
REFERENCE_LRU = (0.083, 0.148, 0.289, 0.430, 0.575)

#: Our block hit ratios (4 decimals) on the bundled trace; `python -m kvevict.replay`.
GOLDEN = {
    "bayes": (0.0746, 0.1345, 0.2738, 0.4239, 0.5718),
    "belady": (0.2691, 0.3742, 0.5256, 0.6174, 0.6396),
    "dbms": (0.0860, 0.1430, 0.2448, 0.3859, 0.5916),
    "lfu": (0.0501, 0.1130, 0.2049, 0.3622, 0.5916),
    "lru": (0.0841, 0.1464, 0.2793, 0.4239, 0.5718),
    "market": (0.0806, 0.1455, 0.2831, 0.4230, 0.5718),
    "pinned": (0.0841, 0.1464, 0.2793, 0.4239, 0.5718),
    # the oracles (tests/test_oracles.py has them on the arrival axis): whether a block comes
    # back does not depend on the axis; within 300 *requests* does
    "reuse-oracle": (0.1229, 0.1995, 0.4022, 0.5904, 0.6396),
    "horizon-oracle": (0.1881, 0.2888, 0.4260, 0.5057, 0.5966),
}

#: The share of the prefill compute saved (`ReplayResult.prefill_saved_ratio`, the default
#: `CostModel`) on the bundled trace: what the cost-aware policies price.
GOLDEN_PREFILL = {
    "lru": (0.0840, 0.1496, 0.2957, 0.4576, 0.6026),
    "learned": (0.1003, 0.1571, 0.3491, 0.4984, 0.6436),
    "gdsf": (0.0940, 0.1988, 0.3366, 0.4767, 0.6283),
    "market": (0.0953, 0.1640, 0.3093, 0.4567, 0.6026),
}

TRACE_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
SHARED_TRACE = Path(__file__).resolve().parents[1].parent / (
    "shared/traces/mooncake_synthetic_trace.jsonl")


@pytest.fixture(scope="module")
def trace() -> list[Request]:
    return read_mooncake(bundled_trace_path("mooncake"))


@pytest.fixture(scope="module")
def table(trace) -> ReplayTable:
    """Every registered policy at every size, computed once for the module."""
    names = [p for p in available_policies() if p != "belady"] + ["belady"]
    return replay_table(trace, names, SIZES)


# -- the replay on the bundled trace --------------------------------------------------------


def test_lru_within_001_of_the_independent_reference(table):
    got = table.ratios()["lru"]
    for size, ours, ref in zip(SIZES, got, REFERENCE_LRU, strict=True):
        assert abs(ours - ref) <= 0.01, f"{size} blocks: {ours:.4f} vs reference {ref}"


def test_golden_block_hit_ratios(table):
    ratios = table.ratios()
    for name, golden in GOLDEN.items():
        assert name in ratios, f"{name} is not registered"
        assert [round(r, 4) for r in ratios[name]] == list(golden), name


def test_golden_prefill_saved_ratios(table):
    ratios = table.ratios("prefill_saved_ratio")
    for name, golden in GOLDEN_PREFILL.items():
        assert [round(r, 4) for r in ratios[name]] == list(golden), name
    lru = table.get("lru", 5000)
    assert lru.prefill_s == pytest.approx(3199.738390451323, rel=1e-12)
    # the same prompts at every size and for every policy: only the saving differs
    assert {round(r.prefill_s, 6) for r in table.results} == {round(lru.prefill_s, 6)}
    assert "| lru | 0.0840 | 0.1496 | 0.2957 | 0.4576 | 0.6026 |" in format_table(
        table, "prefill_saved_ratio")


def test_belady_at_or_above_every_online_policy(table):
    ratios = table.ratios()
    oracle = ratios["belady"]
    for name, values in ratios.items():
        for size, theirs, best in zip(SIZES, values, oracle, strict=True):
            assert theirs <= best, f"{name} beats belady at {size} blocks: {theirs} > {best}"


def test_table_bookkeeping(table, trace):
    accesses = sum(len(r.block_hashes) for r in trace)
    assert accesses == 121_877
    for result in table.results:
        assert result.requests == 3993 and result.rejected == 0
        assert result.accesses == accesses
        assert result.token_queries == sum(r.num_tokens for r in trace)
        assert 0 <= result.hits <= accesses and result.token_hits <= result.token_queries
        assert result.block_size == MOONCAKE_BLOCK_SIZE
    lru = table.get("lru", 1000)
    assert lru.as_dict()["block_hit_ratio"] == lru.block_hit_ratio
    assert len(table.rows()) == len(table.results)
    with pytest.raises(KeyError):
        table.get("lru", 3)
    text = format_table(table)
    assert text.splitlines()[0].startswith("| policy | 1,000 blocks |")
    assert "| lru | 0.0841 | 0.1464 | 0.2793 | 0.4239 | 0.5718 |" in text


def _plain_lru(requests, capacity, block_size=MOONCAKE_BLOCK_SIZE):
    """An independent replay: an OrderedDict of cached blocks by last release, evicting the
    least recent leaf not used by the running request; a prompt's hit stops at its first
    miss; a finished request touches its blocks tail first."""
    parent: dict = {}
    children: dict = {}
    order: OrderedDict = OrderedDict()
    hits = accesses = 0
    for r in requests:
        ids = r.block_hashes
        n = 0
        while n < len(ids) and ids[n] in parent:
            n += 1
        hits += n
        accesses += len(ids)
        need = -(-r.num_tokens // block_size) - n
        held = set(ids[:n])
        for _ in range(max(need - (capacity - len(parent)), 0)):
            victim = next(h for h in order if not children[h] and h not in held)
            del order[victim], children[victim]
            up = parent.pop(victim)
            if up is not None:
                children[up] -= 1
        prev = ids[n - 1] if n else None
        for h in ids[n:]:
            parent[h], children[h], order[h] = prev, 0, None
            if prev is not None:
                children[prev] += 1
            prev = h
        for h in reversed(ids):
            order.move_to_end(h)
    return hits / accesses


@pytest.mark.parametrize("size", [1000, 5000])
def test_lru_matches_an_independent_plain_python_replay(table, trace, size):
    assert table.get("lru", size).block_hit_ratio == pytest.approx(_plain_lru(trace, size),
                                                                   abs=1e-12)


def test_infinite_cache_hits_every_repeat(trace):
    result = replay(trace, "lru", 50_000)
    assert result.evictions == 0
    assert result.hits == 121_877 - 43_924  # accesses - distinct blocks
    assert round(result.block_hit_ratio, 3) == 0.640


def test_arrival_time_axis_gives_the_same_order(trace):
    head = trace[:600]  # the first two requests arrive at the same millisecond
    for name in ("lru", "belady"):
        by_index = replay(head, name, 400)
        by_arrival = replay(head, name, 400, time="arrival")
        assert by_arrival.hits == by_index.hits and by_arrival.evictions == by_index.evictions


# -- replay API -------------------------------------------------------------------------------


def _small():
    return [Request(i, block_hashes=ids, num_tokens=len(ids) * 4) for i, ids in
            enumerate([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [6, 7, 8, 9, 10], [1, 2]])]


def test_replay_accepts_names_instances_and_factories():
    reqs = _small()
    by_name = replay(reqs, "lru", 4, 4, check_every=1)
    assert replay(reqs, make_policy("lru"), 4, 4).hits == by_name.hits
    assert replay(reqs, lambda: make_policy("lru"), 4, 4, label="mine").policy == "mine"
    assert replay(reqs, "lfu", 4, 4, half_life=2.0).policy == "lfu"
    assert replay(reqs, "belady", 4, 4, future={}).hits == by_name.hits  # empty: LRU order
    assert isinstance(make_policy("belady"), Belady)


def test_a_request_larger_than_the_pool_is_rejected_and_counted_as_misses():
    reqs = _small()
    result = replay(reqs, "lru", 3, 4)
    assert result.rejected == 1  # the 5-block request
    assert result.accesses == sum(len(r.block_hashes) for r in reqs)
    assert result.token_queries == sum(r.num_tokens for r in reqs)


def test_a_rejected_request_is_no_ones_next_use():
    """The oracle's future skips requests that cannot run, so they protect nothing."""
    chains = [[1, 2], [3, 4], [5], [1, 2, 7, 8, 9], [3, 4]]  # the 5-block one cannot run
    reqs = [Request(i, block_hashes=c, num_tokens=len(c) * 4) for i, c in enumerate(chains)]
    oracle = replay(reqs, "belady", 4, 4)
    assert oracle.rejected == 1
    assert oracle.hits == 2  # [3, 4] kept at the eviction for [5]; [1, 2] is never run again
    without = replay([r for r in reqs if r.request_id != 3], "belady", 4, 4)
    assert without.hits == oracle.hits


def test_replay_token_mode_requests():
    system = list(range(8))
    reqs = [Request(i, tokens=system + [i] * 6) for i in range(5)]
    result = replay(reqs, "belady", 4, 4, check_every=1)
    assert result.hits == 2 * 4  # the 2-block system prompt, after the first request
    assert result.token_hits == 8 * 4


def test_replay_errors():
    reqs = _small()
    with pytest.raises(ConfigError, match="capacity_blocks"):
        replay(reqs, "lru", 0)
    with pytest.raises(ConfigError, match="unknown policy"):
        replay(reqs, "nope", 4, 4)
    with pytest.raises(ConfigError, match="not a string"):
        replay("trace.jsonl", "lru", 4, 4)
    with pytest.raises(ConfigError, match="Requests"):
        replay([1, 2], "lru", 4, 4)
    with pytest.raises(ConfigError, match="by name"):
        replay(reqs, make_policy("lru"), 4, 4, half_life=1.0)
    with pytest.raises(ConfigError, match=r"policy 'belady' has no parameter\(s\) horizon; it "
                                          r"accepts: future \(policy 'belady' is offline"):
        replay(reqs, "belady", 4, 4, horizon=3)
    with pytest.raises(ConfigError, match="time must be"):
        replay(reqs, "lru", 4, 4, time="wall")
    with pytest.raises(ConfigError, match="not an instance"):
        replay_table(reqs, {"x": make_policy("lru")}, [4], 4)
    with pytest.raises(ConfigError, match="unknown policy"):
        replay_table(reqs, ["lru", "nope"], [4], 4)
    with pytest.raises(ConfigError, match="metric"):
        format_table(replay_table(reqs, ["lru"], [4], 4), "speed")


def test_command_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_mooncake(_small(), path, block_size=4)
    assert main(["--trace", str(path), "--sizes", "4,8", "--policies", "lru,belady",
                 "--block-size", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| policy | 4 blocks | 8 blocks |"
    assert out[2].startswith("| lru | ") and out[3].startswith("| belady | ")
    assert main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "neither" in capsys.readouterr().err
    assert main(["--trace", str(path), "--sizes", "4", "--policies",
                 "lru,horizon-oracle,infinite", "--horizons", "1,2", "--block-size", "4"]) == 0
    rows = [line.split(" | ")[0][2:] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == ["lru", "horizon-oracle H=1", "horizon-oracle H=2", "infinite"]


# -- the Mooncake reader ----------------------------------------------------------------------


def test_bundled_trace_is_the_published_one(trace):
    data = bundled_trace_path("mooncake").read_bytes()
    assert hashlib.sha256(data).hexdigest() == TRACE_SHA256
    if SHARED_TRACE.is_file():
        assert SHARED_TRACE.read_bytes() == data
    assert len(trace) == 3993
    assert len({h for r in trace for h in r.block_hashes}) == 43_924
    first = trace[0]
    assert first.request_id == 0 and first.num_tokens == 40160 and first.output_len == 6
    assert first.block_hashes[:3] == (0, 1, 2) and len(first.block_hashes) == 79
    assert first.workload_class == "chat" and first.session_id is None
    assert trace[5].arrival == pytest.approx(0.529)
    assert all(r.extra == {} for r in trace)  # lengths and ids agree on every line
    with pytest.raises(ConfigError, match="unknown bundled trace"):
        bundled_trace_path("alibaba")


def test_write_read_round_trip_is_byte_identical(trace, tmp_path):
    out = tmp_path / "copy.jsonl"
    assert write_mooncake(trace, out) == 3993
    assert out.read_bytes() == bundled_trace_path().read_bytes()


def _write(tmp_path, *lines) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _line(**fields):
    record = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    record.update(fields)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def test_iter_skips_blank_lines_and_numbers_records(tmp_path):
    path = _write(tmp_path, _line(), "", "   ", _line(timestamp=1500, hash_ids=[1, 3]))
    reqs = list(iter_mooncake(path))
    assert [r.request_id for r in reqs] == [0, 1]
    assert reqs[1].arrival == 1.5 and reqs[1].block_hashes == (1, 3)


def test_short_input_length_is_raised_to_reach_the_last_block(tmp_path):
    path = _write(tmp_path, _line(input_length=100, hash_ids=[1, 2, 3]),
                  _line(input_length=5000, hash_ids=[4]))
    short, long = read_mooncake(path)
    assert short.num_tokens == 2 * 512 + 1 and short.extra == {"input_length": 100}
    assert long.num_tokens == 5000 and long.extra == {}  # a tail beyond the listed block
    result = replay([short, long], "lru", 20)
    assert result.accesses == 4 and result.rejected == 0
    out = tmp_path / "back.jsonl"
    write_mooncake([short, long], out)
    assert out.read_text() == path.read_text()


@pytest.mark.parametrize(("lines", "line", "field", "match"), [
    ([_line(), "{not json"], 2, None, "not valid JSON"),
    (["[1, 2]"], 1, None, "JSON object"),
    ([_line(hash_ids=...)], 1, "hash_ids", "missing"),
    ([_line(timestamp=...)], 1, "timestamp", "missing"),
    ([_line(input_length="600")], 1, "input_length", "positive integer"),
    ([_line(input_length=0)], 1, "input_length", "positive integer"),
    ([_line(input_length=600.0)], 1, "input_length", "positive integer"),
    ([_line(output_length=-1)], 1, "output_length", "non-negative integer"),
    ([_line(output_length=True)], 1, "output_length", "non-negative integer"),
    ([_line(timestamp=-5)], 1, "timestamp", "non-negative number"),
    ([_line(timestamp="0")], 1, "timestamp", "non-negative number"),
    ([_line(hash_ids="1,2")], 1, "hash_ids", "list"),
    ([_line(hash_ids=[1, -2])], 1, "hash_ids", "non-negative integer block ids"),
    ([_line(hash_ids=[1, 2.5])], 1, "hash_ids", "non-negative integer block ids"),
    ([_line(hash_ids=[1, 2, 1])], 1, "hash_ids", "repeats"),
    ([_line(timestamp=10), _line(timestamp=9)], 2, "timestamp", "arrival order"),
    ([_line(), _line(hash_ids=[3, 2])], 2, "hash_ids", "after id 1 on line 1"),
    ([_line(), _line(hash_ids=[2])], 2, "hash_ids", "prefix-chained"),
])
def test_malformed_traces_name_file_line_and_field(tmp_path, lines, line, field, match):
    path = _write(tmp_path, *lines)
    with pytest.raises(TraceFormatError, match=match) as info:
        read_mooncake(path)
    err = info.value
    assert err.path == str(path) and err.line == line and err.field == field
    assert f"{path}:{line}: " in str(err)
    if field is not None:
        assert f"field {field!r}" in str(err)


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(_line().encode() + b"\n" + b'{"timestamp": "\xe9"}\n')
    with pytest.raises(TraceFormatError, match="UTF-8") as info:
        read_mooncake(path)
    assert info.value.line == 2 and info.value.path == str(path)


def test_reader_and_writer_argument_errors(tmp_path):
    path = _write(tmp_path, _line())
    with pytest.raises(ConfigError, match="block_size"):
        read_mooncake(path, block_size=0)
    with pytest.raises(ConfigError, match="workload_class"):
        read_mooncake(path, workload_class="")
    assert read_mooncake(path, workload_class="rag")[0].workload_class == "rag"
    with pytest.raises(FileNotFoundError):
        read_mooncake(tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="non-negative int block ids"):
        write_mooncake([Request(0, block_hashes=["a"], num_tokens=4)], tmp_path / "x.jsonl")
    with pytest.raises(ConfigError, match="arrival order"):
        write_mooncake([Request(0, block_hashes=[1], num_tokens=4, arrival=2.0),
                        Request(1, block_hashes=[2], num_tokens=4, arrival=1.0)],
                       tmp_path / "x.jsonl")


def test_write_token_mode_requests_keeps_shared_prefixes(tmp_path):
    system = list(range(8))
    reqs = [Request(0, block_hashes=[3, 4], num_tokens=8, arrival=0.25),
            Request(1, tokens=system + [1, 1, 1, 1, 7], arrival=0.5),
            Request(2, tokens=system + [2, 2], arrival=0.5)]
    path = tmp_path / "mixed.jsonl"
    write_mooncake(reqs, path, block_size=4)
    back = read_mooncake(path, block_size=4)
    assert [r.block_hashes for r in back] == [(3, 4), (5, 6, 7), (5, 6)]
    assert [r.num_tokens for r in back] == [8, 13, 10]
    assert json.loads(path.read_text().splitlines()[0])["timestamp"] == 250
    assert replay(back, "lru", 10, 4).hits == replay(reqs, "lru", 10, 4).hits


# -- streaming -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lru", "lfu", "market", "bayes", "belady"])
def test_replay_of_an_iterator_equals_replay_of_a_list(trace, name):
    head = trace[:700]
    listed = replay(head, name, 800, records=True)
    for source in (iter(head), (r for r in head), tuple(head)):
        streamed = replay(source, name, 800, records=True)
        assert streamed.records == listed.records
        assert (streamed.hits, streamed.evictions, streamed.token_hits, streamed.requests) == (
            listed.hits, listed.evictions, listed.token_hits, listed.requests)


def test_records_hold_each_request_and_add_up():
    reqs = _small()
    result = replay(reqs, "lru", 3, 4, records=True)
    assert [(r.index, r.request_id, r.blocks, r.block_hits, r.rejected) for r in
            result.records] == [(0, 0, 3, 0, False), (1, 1, 3, 2, False), (2, 2, 1, 0, False),
                                (3, 3, 3, 2, False), (4, 4, 5, 0, True), (5, 5, 2, 2, False)]
    assert sum(r.block_hits for r in result.records) == result.hits
    assert sum(r.tokens for r in result.records) == result.token_queries
    assert result.as_dict()["records"][1] == {"index": 1, "request_id": 1, "blocks": 3,
                                              "block_hits": 2, "tokens": 12, "token_hits": 8,
                                              "rejected": False}
    assert replay(reqs, "lru", 3, 4).records is None


def test_prefill_saved_weighs_a_deep_hit_by_its_attention_context():
    """Two prompts of 512-token blocks, the second extending the first by a block: its
    1,024 cached tokens save their linear cost and the attention over them, and the
    uncached block still attends to them (hand-computed)."""
    reqs = [Request(0, block_hashes=[1, 2], num_tokens=1024),
            Request(1, block_hashes=[1, 2, 3], num_tokens=1536)]
    attn = CostModel(linear_s_per_token=0.0, attn_s_per_pair=1.0, prefill_overhead_s=0.0)
    result = replay(reqs, "lru", 8, 512, cost_model=attn)
    # prefill(n, c) = n * (c + (n + 1) / 2) pairs
    assert result.prefill_s == 1024 * 1025 / 2 + 1536 * 1537 / 2  # 524,800 + 1,180,416
    assert result.prefill_saved_s == 1536 * 1537 / 2 - 512 * (1024 + 513 / 2)  # 524,800
    assert result.prefill_saved_ratio == pytest.approx(524_800 / 1_705_216, rel=1e-15)
    # .308 of the compute against .4 of the tokens: the uncached last block, attending to
    # the most context, is the dearest one
    assert result.token_hit_ratio == 1024 / 2560
    # linear cost only: the saved share is the token hit ratio
    linear = CostModel(linear_s_per_token=1.0, attn_s_per_pair=0.0, prefill_overhead_s=0.0)
    assert replay(reqs, "lru", 8, 512, cost_model=linear).prefill_saved_ratio == 0.4
    # the cost model reaches the ledger, not the policy: the hits are the same
    assert replay(reqs, "lru", 8, 512).hits == result.hits == 2


def test_a_rejected_request_costs_its_whole_prefill_and_saves_nothing():
    reqs = _small()
    cm = CostModel()
    result = replay(reqs, "lru", 3, 4, records=True, cost_model=cm)
    ledger = PrefillLedger(cm)
    for r in result.records:
        ledger.add(r.tokens, r.token_hits)
    assert (result.prefill_s, result.prefill_saved_s) == (ledger.full_s, ledger.saved_s)
    rejected = [r for r in result.records if r.rejected]
    assert rejected and all(r.token_hits == 0 for r in rejected)
    assert result.prefill_s == pytest.approx(sum(cm.prefill_seconds(r.tokens)
                                                 for r in result.records), rel=1e-12)


def test_prefill_ledger_and_cost_model_errors():
    ledger = PrefillLedger(CostModel(linear_s_per_token=1.0, attn_s_per_pair=0.0,
                                     prefill_overhead_s=2.0))
    ledger.add(10, 10)  # served whole: the overhead is saved too
    assert (ledger.full_s, ledger.saved_s) == (12.0, 12.0)
    with pytest.raises(ConfigError, match=r"cached tokens must be in \[0, prompt tokens\], "
                                          r"got 11 of 10"):
        ledger.add(10, 11)
    assert (ledger.full_s, ledger.saved_s) == (12.0, 12.0)  # nothing counted
    with pytest.raises(ConfigError, match="cost_model must be a CostModel, got dict"):
        replay(_small(), "lru", 3, 4, cost_model={})
    with pytest.raises(ConfigError, match="metric must be one of block_hit_ratio, "
                                          "token_hit_ratio, prefill_saved_ratio"):
        format_table(ReplayTable(["lru"], [3]), "seconds")


def test_a_tally_is_its_requests_prefill_batches_and_totals(trace):
    """`Tally` (what every replay keeps): its totals are the sums of what was added, its
    prefill the ledger's, its batches `Batches` of the same rows; the replay's own totals
    (from the manager's statistics) equal its tally's."""
    cm = CostModel()
    empty = Tally(cm)
    assert empty.totals() == (0, 0, 0, 0)
    assert empty.result_fields() == {"prefill_s": 0.0, "prefill_saved_s": 0.0, "batches": ()}
    rows = [(3, 1, 40, 16), (2, 0, 30, 0), (5, 5, 70, 70), (4, 0, 50, 0)]  # one rejected
    tally, ledger, batches = Tally(cm), PrefillLedger(cm), Batches()
    for blocks, hits, tokens, token_hits in rows:
        tally.add(blocks, hits, tokens, token_hits)
        full, saved = ledger.add(tokens, token_hits)
        batches.add((blocks, hits, tokens, token_hits, full, saved))
    assert tally.totals() == (14, 6, 190, 86)
    assert tally.result_fields() == {"prefill_s": ledger.full_s,
                                     "prefill_saved_s": ledger.saved_s,
                                     "batches": batches.result()}
    result = replay(trace[:500], "lru", 300, records=True, cost_model=cm)
    assert result.rejected == 0
    again = Tally(cm)
    for r in result.records:
        again.add(r.blocks, r.block_hits, r.tokens, r.token_hits)
    assert again.totals() == (result.accesses, result.hits, result.token_queries,
                              result.token_hits)
    assert again.result_fields() == {"prefill_s": result.prefill_s,
                                     "prefill_saved_s": result.prefill_saved_s,
                                     "batches": result.batches}


def test_batches_are_equal_runs_of_consecutive_requests_that_add_up(trace):
    """3,993 requests: batches of 1, 2, 4, ... requests merge in pairs at 20, so 15 batches
    of 256 remain (3,840 requests) and the last 153 join the last batch."""
    result = replay(trace, "lru", 2000, records=True)
    batches = result.batches
    assert len(batches) == 15 and MIN_BATCHES <= len(batches) < 2 * MIN_BATCHES
    totals = [sum(b[i] for b in batches) for i in range(len(BATCH_FIELDS))]
    assert totals[:4] == [result.accesses, result.hits, result.token_queries,
                          result.token_hits]
    assert totals[4] == pytest.approx(result.prefill_s, rel=1e-12)
    assert totals[5] == pytest.approx(result.prefill_saved_s, rel=1e-12)
    recs = result.records
    for k, batch in enumerate(batches):  # each batch is its requests' records, in order
        lo, hi = 256 * k, (256 * (k + 1) if k < 14 else len(recs))
        assert batch[:2] == (sum(r.blocks for r in recs[lo:hi]),
                             sum(r.block_hits for r in recs[lo:hi]))
    assert len(replay(trace[:7], "lru", 2000).batches) == 7  # fewer requests: one each


def test_compare_is_the_paired_batch_means_interval(trace):
    """The interval of the per-batch hit difference over the mean accesses per batch: its
    mean is exactly the difference of the hit ratios."""
    table = replay_table(trace, ["lru", "learned", "gdsf"], (2000, 5000), time="arrival")
    rows = {(c.policy, c.capacity_blocks): c for c in compare(table, "lru")}
    assert set(rows) == {("learned", 2000), ("learned", 5000), ("gdsf", 2000),
                         ("gdsf", 5000)}
    c = rows[("learned", 5000)]
    a, b = table.get("learned", 5000), table.get("lru", 5000)
    mean_acc = sum(x[0] for x in b.batches) / len(b.batches)
    diffs = [(x[1] - y[1]) / mean_acc for x, y in zip(a.batches, b.batches)]
    want = interval(diffs)
    assert c.lag1 == lag1(diffs) <= 0  # not correlated: the plain t-interval
    assert c.difference == want and want.n == 15
    assert c.difference.mean == pytest.approx(a.block_hit_ratio - b.block_hit_ratio,
                                              rel=1e-12)
    assert (c.value, c.base, c.ratio) == (a.block_hit_ratio, b.block_hit_ratio,
                                          a.block_hit_ratio / b.block_hit_ratio)
    # golden: learned is 1.136x LRU at 5k beyond its interval, and 1.047x at 2k within it
    assert (round(c.difference.mean, 4), round(c.difference.half, 4), c.significant) == \
        (0.0381, 0.0157, True)
    two = rows[("learned", 2000)]
    plain = interval([(x[1] - y[1]) / mean_acc for x, y in
                      zip(table.get("learned", 2000).batches, table.get("lru", 2000).batches)])
    assert round(two.lag1, 3) == 0.061  # correlated: widened by sqrt(1.061 / 0.939)
    assert two.difference.half == pytest.approx(plain.half * lag1_factor(two.lag1), rel=1e-12)
    assert (round(two.difference.mean, 4), round(plain.half, 4), round(two.difference.half, 4),
            two.significant) == (0.0069, 0.0116, 0.0123, False)
    text = format_comparison(table, "lru")
    assert "| learned | 1.047x (+0.0069 ± 0.0123, n.s.) | **1.136x (+0.0381 ± 0.0157)** |" \
        in text
    # the prefill metric pairs the same batches
    p = {(c.policy, c.capacity_blocks): c
         for c in compare(table, "lru", "prefill_saved_ratio")}[("learned", 5000)]
    assert p.difference.mean == pytest.approx(a.prefill_saved_ratio - b.prefill_saved_ratio,
                                              rel=1e-12)


def test_lag1_and_its_factor():
    assert lag1([1.0, 2.0]) == 0.0 and lag1([3.0, 3.0, 3.0]) == 0.0
    # deviations -1.5, -.5, .5, 1.5: lagged products .75 - .25 + .75 over squares 5
    assert lag1([1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.25)
    assert lag1([1.0, -1.0, 1.0, -1.0]) == pytest.approx(-0.75)
    assert lag1_factor(0.0) == 1.0
    assert lag1_factor(0.6) == pytest.approx(2.0)
    assert lag1_factor(0.99) == lag1_factor(0.9) == pytest.approx(19 ** 0.5)  # capped


def test_compare_errors():
    table = replay_table(_small(), ["lru", "lfu"], (3,), 4)
    with pytest.raises(ConfigError, match=r"compare needs a ratio metric .*got 'hits'"):
        compare(table, "lru", "hits")
    with pytest.raises(ConfigError, match="baseline 'arc' is not a row of the table "
                                          r"\(rows: lru, lfu\)"):
        compare(table, "arc")
    one = replay_table(_small()[:1], ["lru", "lfu"], (3,), 4)
    with pytest.raises(ConfigError, match="lru at 3 blocks has 1 batches; compare needs"):
        compare(one, "lru")
    other = replay_table(_small()[1:], ["lru"], (3,), 4)
    mixed = ReplayTable(["lru", "lfu"], [3], [other.results[0], table.get("lfu", 3)])
    with pytest.raises(ConfigError, match="lfu and lru at 3 blocks were not replayed on the "
                                          "same requests"):
        compare(mixed, "lru")


def test_load_results_is_the_exact_inverse_of_results_json(tmp_path):
    """What ``--out`` writes reads back to equal results (records, tiers and batches
    included), so `compare` against any row after the fact gives what it gave then."""
    from kvevict.tiers import Tier, TierStack

    trace = read_mooncake(bundled_trace_path())[:400]
    table = replay_table(trace, ["lru", "arc"], (300, 900), records=True,
                         tiers=lambda: TierStack([Tier(200, name="host")]))
    payload = {"trace": "head", "engine": "kvevict", "results": table.rows()}
    (tmp_path / "results.json").write_text(json.dumps(payload, indent=2))
    loaded, meta = load_results(tmp_path)  # the directory, or the file
    assert meta == {"trace": "head", "engine": "kvevict"}
    assert loaded == table and load_results(tmp_path / "results.json")[0] == table
    assert loaded.get("arc", 900).tiers["hits"]["host"] > 0
    assert compare(loaded, "arc") == compare(table, "arc")
    assert loaded.select(["arc"], [900]) == ReplayTable(["arc"], [900],
                                                        [table.get("arc", 900)])


def test_load_results_errors_name_the_file_and_the_row(tmp_path):
    table = replay_table(_small(), ["lru", "lfu"], (3, 4), 4)
    rows = table.rows()
    path = tmp_path / "results.json"

    def fails(payload, match):
        path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
        with pytest.raises(ConfigError, match=match):
            load_results(path)

    fails("{", r"cannot read replay results from .*results.json: Expecting")
    fails({"rows": rows}, r"results.json is not a replay's results.json: it has no "
                          r"'results' list")
    fails({"results": []}, "a replay table needs at least one row")
    fails({"results": [dict(rows[0], colour=1)]},
          r"results.json: the row of 'lru' at 3 has unknown fields colour \(a replay result "
          r"has policy, capacity_blocks, ")
    fails({"results": [{k: v for k, v in rows[0].items() if k != "hits"}]},
          "the row of 'lru' at 3 lacks hits")
    fails({"results": [dict(rows[0], hits=rows[0]["hits"] + 1)]},
          r"the row of 'lru' at 3 says block_hit_ratio = .*, but its counts give ")
    fails({"results": [dict(rows[0], hits="many")]},
          "the row of 'lru' at 3 is not a replay result: unsupported operand")
    fails({"results": [dict(rows[0], records=[{"index": 0}])]},
          "the row of 'lru' at 3 is not a replay result: .*missing")
    fails({"results": [rows[0], rows[0]]}, "two rows of 'lru' at 3 blocks")
    fails({"results": rows[:3]}, "'lfu' has no row at 4 blocks \\(the table's sizes: 3, 4\\)")
    with pytest.raises(ConfigError,
                       match=r"no replay results at .*/nowhere \(kvevict replay --out DIR "):
        load_results(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"no row 'arc' in this table \(rows: lru, lfu\)"):
        table.select(["arc"])
    with pytest.raises(ConfigError, match=r"no size 5 in this table \(sizes: 3, 4\)"):
        table.select(None, [5])
    with pytest.raises(ConfigError, match=r"select's policies lists lru twice \(lru,lru\); "
                                          "give each policy once"):
        table.select(["lru", "lru"])
    with pytest.raises(ConfigError, match=r"select's sizes lists 3 twice \(3,4,3\); give "
                                          "each size once"):
        table.select(None, [3, 4, 3])


def test_progress_is_called_per_pass():
    calls = []
    reqs = _small()  # 6 requests: one call per pass, at the end
    replay(reqs, "belady", 4, 4, progress=lambda phase, n: calls.append((phase, n)))
    assert calls == [("future", 6), ("replay", 6)]
    calls.clear()
    replay([Request(i, block_hashes=[i], num_tokens=4) for i in range(2500)], "lru", 4, 4,
           progress=lambda phase, n: calls.append((phase, n)))
    assert calls == [("replay", 1000), ("replay", 2000), ("replay", 2500)]


def test_arrival_axis_needs_arrival_order():
    reqs = [Request(i, block_hashes=[i], num_tokens=4, arrival=t)
            for i, t in enumerate((0.0, 2.0, 2.0, 1.5))]
    with pytest.raises(ConfigError, match=r"request 3 \(number 3 of the trace, from 0\) "
                                          r"arrives at 1\.5 s, before the previous request's "
                                          r"2 s; time='arrival' needs the requests in arrival "
                                          r"order"):
        replay(reqs, "lru", 4, 4, time="arrival")
    assert replay(reqs, "lru", 4, 4).requests == 4  # the index axis does not care
    assert replay(reqs[:3], "belady", 4, 4, time="arrival").requests == 3  # ties are nudged


def test_iter_mooncake_streams_before_a_bad_line(tmp_path):
    path = _write(tmp_path, _line(), _line(timestamp=5, hash_ids=[1, 3]), "{oops")
    it = iter_mooncake(path)
    assert [next(it).request_id, next(it).request_id] == [0, 1]
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        next(it)


def test_a_broken_chain_names_the_line_that_first_listed_the_id(tmp_path):
    path = _write(tmp_path, _line(hash_ids=[4]), _line(hash_ids=[1, 2]), _line(hash_ids=[1, 2]),
                  _line(hash_ids=[9, 2]))
    with pytest.raises(TraceFormatError, match="id 2 comes after id 9 here but after id 1 on "
                                               "line 2") as info:
        read_mooncake(path)
    assert info.value.line == 4


def test_the_chain_check_can_be_skipped_and_then_holds_nothing_per_id(tmp_path):
    import tracemalloc

    path = _write(tmp_path, _line(), _line(hash_ids=[3, 2]))
    with pytest.raises(TraceFormatError, match="prefix-chained"):
        read_mooncake(path)
    assert [r.block_hashes for r in read_mooncake(path, check_chains=False)] == [(1, 2), (3, 2)]
    lines = [_line(timestamp=i, hash_ids=list(range(3 * i, 3 * i + 3))) for i in range(4000)]
    big = _write(tmp_path, *lines)
    for check, at_least in ((True, 8 * 12_000), (False, 0)):
        tracemalloc.start()
        for _ in iter_mooncake(big, check_chains=check):
            pass
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert (peak >= at_least) if check else (peak < 64 * 1024), (check, peak)
