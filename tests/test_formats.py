"""Trace formats: kvevict JSONL round trips, the Alibaba reader, the ShareGPT reader, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvevict.errors import ConfigError, TraceFormatError
from kvevict.types import Request, RetentionHint
from kvevict.workloads.formats import (
    ALIBABA_CLASSES,
    read_alibaba,
    read_jsonl,
    read_sharegpt,
    request_to_dict,
    synthetic_token_ids,
    trace_digest,
    write_jsonl,
)
from kvevict.workloads.generators import generate


def write_lines(path, lines):
    path.write_text("".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def assert_names(exc: TraceFormatError, path, line, field):
    text = str(exc)
    assert path.name in text
    if line is not None:
        assert f":{line}:" in text
        assert exc.line == line
    if field is not None:
        assert field in text
        assert exc.field == field


# -- kvevict JSONL -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat-server", "agent"])
def test_jsonl_round_trip_of_generated_trace(tmp_path, name):
    reqs = generate(name, seed=1, duration=600, **({"retention_ttl": 20.0}
                                                   if name == "agent" else {}))
    path = tmp_path / "trace.jsonl"
    assert write_jsonl(reqs, path) == len(reqs)
    back = read_jsonl(path)
    assert trace_digest(back) == trace_digest(reqs)
    assert [request_to_dict(r) for r in back] == [request_to_dict(r) for r in reqs]


def test_jsonl_round_trip_of_hand_made_requests(tmp_path):
    reqs = [
        Request(7, block_hashes=(1, 2, 3), num_tokens=40, session_id="s", arrival=1.25,
                output_len=5, turn=2, workload_class="custom",
                retention=RetentionHint(2.5, until=99.0), extra={"a": [1, {"b": None}]}),
        Request("x", tokens=[1, 2, 3], output_len=2, output_tokens=[4, 5],
                block_kinds=("context",), arrival=0.1 + 0.2),
        Request("h", block_hashes=("ab", "cd"), num_tokens=20, session_id=3,
                retention=RetentionHint()),
    ]
    path = tmp_path / "t.jsonl"
    write_jsonl(reqs, path)
    back = read_jsonl(path)
    assert [request_to_dict(r) for r in back] == [request_to_dict(r) for r in reqs]
    assert back[1].arrival == 0.1 + 0.2
    assert back[0].retention == RetentionHint(2.5, until=99.0)
    assert back[1].tokens.dtype == np.int64


def test_jsonl_minimal_line_takes_defaults(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [{"request_id": 1, "tokens": [3, 4]}, ""])
    (req,) = read_jsonl(path)
    assert req.workload_class == "chat" and req.arrival == 0.0 and req.output_len == 0


def test_write_jsonl_rejects_unwritable_fields(tmp_path):
    with pytest.raises(ConfigError):
        write_jsonl([Request(("a", 1), tokens=[1])], tmp_path / "a.jsonl")
    with pytest.raises(ConfigError):
        write_jsonl([Request("a", tokens=[1], extra={"x": object()})], tmp_path / "b.jsonl")
    with pytest.raises(ConfigError):
        write_jsonl([Request("a", block_hashes=(1.5,), num_tokens=3)], tmp_path / "c.jsonl")
    assert not (tmp_path / "a.jsonl").exists()


GOOD = {"request_id": "ok", "tokens": [1, 2, 3]}


@pytest.mark.parametrize("line, field", [
    ("{not json", None),
    ("[1, 2]", None),
    ({"tokens": [1]}, "request_id"),
    ({"request_id": [1], "tokens": [1]}, "request_id"),
    ({"request_id": "a"}, "tokens"),
    ({"request_id": "a", "tokens": "123"}, "tokens"),
    ({"request_id": "a", "tokens": [1, -2]}, "tokens"),
    ({"request_id": "a", "tokens": [1, 2.5]}, "tokens"),
    ({"request_id": "a", "tokens": [1], "block_hashes": [1], "num_tokens": 1},
     "block_hashes"),
    ({"request_id": "a", "block_hashes": [1]}, "num_tokens"),
    ({"request_id": "a", "block_hashes": [[1]], "num_tokens": 4}, "block_hashes"),
    ({"request_id": "a", "block_hashes": [1], "num_tokens": -4}, "num_tokens"),
    ({"request_id": "a", "tokens": [1, 2], "num_tokens": 3}, "num_tokens"),
    ({"request_id": "a", "tokens": [1], "output_len": -1}, "output_len"),
    ({"request_id": "a", "tokens": [1], "output_len": 2, "output_tokens": [1]},
     "output_tokens"),
    ({"request_id": "a", "tokens": [1], "arrival": "soon"}, "arrival"),
    ({"request_id": "a", "tokens": [1], "arrival": -1}, "arrival"),
    ({"request_id": "a", "tokens": [1], "turn": 1.5}, "turn"),
    ({"request_id": "a", "tokens": [1], "workload_class": ""}, "workload_class"),
    ({"request_id": "a", "tokens": [1], "session_id": {"x": 1}}, "session_id"),
    ({"request_id": "a", "tokens": [1], "block_kinds": ["weird"]}, "block_kinds"),
    ({"request_id": "a", "tokens": [1], "retention": {"priority": "high"}}, "retention"),
    ({"request_id": "a", "tokens": [1], "retention": 3}, "retention"),
    ({"request_id": "a", "tokens": [1], "extra": [1]}, "extra"),
    ({"request_id": "a", "tokens": [1], "colour": "red"}, "colour"),
    ({"request_id": "ok", "tokens": [1]}, "request_id"),  # repeats line 1's id
])
def test_jsonl_malformed_line_names_file_line_field(tmp_path, line, field):
    path = write_lines(tmp_path / "bad_trace.jsonl", [GOOD, line])
    with pytest.raises(TraceFormatError) as info:
        read_jsonl(path)
    assert_names(info.value, path, 2, field)


# -- Alibaba -------------------------------------------------------------------------------

ALIBABA = [
    {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40,
     "output_length": 10, "type": "text", "turn": 1, "hash_ids": [0, 1, 2]},
    {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 16,
     "output_length": 3, "type": "image", "turn": 1, "hash_ids": [7]},
    {"chat_id": 3, "parent_chat_id": 1, "timestamp": 30.25, "input_length": 70,
     "output_length": 5, "type": "text", "turn": 2, "hash_ids": [0, 1, 2, 3, 4]},
    {"chat_id": 4, "parent_chat_id": 99, "timestamp": 31.0, "input_length": 17,
     "output_length": 0, "type": "search", "turn": 3, "hash_ids": [8, 9]},
    {"chat_id": 5, "parent_chat_id": 3, "timestamp": 90.0, "input_length": 20,
     "output_length": 8, "type": "text", "turn": 3, "hash_ids": [0, 1, 2, 3, 4, 5],
     "note": "extra fields are ignored"},
    {"chat_id": 6, "parent_chat_id": 4, "timestamp": 95.0, "input_length": 50,
     "output_length": 8, "type": "video", "turn": 4, "hash_ids": [8, 9, 10, 11]},
]


def test_alibaba_sample(tmp_path):
    path = write_lines(tmp_path / "qwen_trace.jsonl", ALIBABA)
    reqs = read_alibaba(path)
    assert [r.request_id for r in reqs] == [1, 2, 3, 4, 5, 6]
    by_id = {r.request_id: r for r in reqs}
    # sessions follow parent_chat_id links to the root
    assert [by_id[i].session_id for i in (1, 3, 5)] == [1, 1, 1]
    assert by_id[2].session_id == 2
    # a parent outside the trace anchors the chain
    assert by_id[4].session_id == 99 and by_id[6].session_id == 99
    assert by_id[1].workload_class == "chat"
    assert by_id[2].workload_class == "single_shot"
    assert by_id[4].workload_class == "rag"
    assert by_id[6].workload_class == "video"  # unknown types keep the raw string
    assert by_id[3].block_hashes == (0, 1, 2, 3, 4) and by_id[3].num_tokens == 70
    assert by_id[3].arrival == 30.25 and by_id[3].turn == 2 and by_id[3].output_len == 5
    assert by_id[3].extra == {"type": "text", "parent_chat_id": 1, "parent": 1}
    # the link a timed run follows (kvevict.run.SessionGate): None for a first turn
    assert by_id[1].extra["parent"] is None and by_id[4].extra["parent"] == 99
    # 6 blocks of 16 need at least 81 tokens: the length is raised, the original kept
    assert by_id[5].num_tokens == 81 and by_id[5].extra["input_length"] == 20
    assert ALIBABA_CLASSES["file"] == "rag"
    custom = read_alibaba(path, classes={"text": "chatbot"})
    assert custom[0].workload_class == "chatbot" and custom[1].workload_class == "image"


def test_alibaba_trace_replays_through_the_manager(tmp_path):
    from kvevict.manager import KVCacheManager
    from kvevict.pool import BlockPool

    reqs = read_alibaba(write_lines(tmp_path / "t.jsonl", ALIBABA))
    manager = KVCacheManager(BlockPool(64, 16), "lru")
    for r in reqs:
        manager.begin(r)
        manager.finish(r.request_id)
    # chat 3 reuses chat 1's three blocks, chat 5 reuses chat 3's five, chat 6 chat 4's two
    assert manager.stats.block_hits == 3 + 5 + 2
    manager.check()


def _alibaba(**changes):
    rec = dict(ALIBABA[0], chat_id=50)
    rec.update(changes)
    return {k: v for k, v in rec.items() if v != "DROP"}


@pytest.mark.parametrize("line, field", [
    ("not json at all", None),
    ('"a string"', None),
    (_alibaba(chat_id="DROP"), "chat_id"),
    (_alibaba(hash_ids="DROP"), "hash_ids"),
    (_alibaba(chat_id="50"), "chat_id"),
    (_alibaba(chat_id=1), "chat_id"),  # already used on line 1
    (_alibaba(parent_chat_id=-5), "parent_chat_id"),
    (_alibaba(parent_chat_id=50), "parent_chat_id"),
    (_alibaba(timestamp=-1.0), "timestamp"),
    (_alibaba(timestamp="noon"), "timestamp"),
    (_alibaba(input_length=-3), "input_length"),
    (_alibaba(input_length=2.5), "input_length"),
    (_alibaba(output_length=-1), "output_length"),
    (_alibaba(type=3), "type"),
    (_alibaba(turn=True), "turn"),
    (_alibaba(hash_ids=5), "hash_ids"),
    (_alibaba(hash_ids=[1, "2"]), "hash_ids"),
    (_alibaba(hash_ids=[1, -2]), "hash_ids"),
    (_alibaba(hash_ids=[1, 2, 1]), "hash_ids"),
])
def test_alibaba_malformed_line_names_file_line_field(tmp_path, line, field):
    path = write_lines(tmp_path / "alibaba_bad.jsonl", [ALIBABA[0], line])
    with pytest.raises(TraceFormatError) as info:
        read_alibaba(path)
    assert_names(info.value, path, 2, field)


def test_alibaba_parent_cycle(tmp_path):
    path = write_lines(tmp_path / "cycle.jsonl", [
        ALIBABA[0], _alibaba(chat_id=60, parent_chat_id=61), _alibaba(chat_id=61,
                                                                      parent_chat_id=60)])
    with pytest.raises(TraceFormatError) as info:
        read_alibaba(path)
    assert_names(info.value, path, 2, "parent_chat_id")


def test_alibaba_bad_arguments(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", ALIBABA)
    with pytest.raises(ConfigError):
        read_alibaba(path, block_size=0)
    with pytest.raises(ConfigError):
        read_alibaba(path, classes={"text": ""})


# -- ShareGPT ------------------------------------------------------------------------------

SHAREGPT = [
    {"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is a KV cache?"},
        {"from": "gpt", "value": "Saved keys and values."},
        {"from": "human", "value": "Why keep it?"},
        {"from": "gpt", "value": "To skip recomputing the prefix."},
    ]},
    {"id": "c2", "conversations": [
        {"from": "gpt", "value": "Hello! (nothing before me: skipped)"},
        {"from": "human", "value": "What is a KV cache?"},
        {"from": "gpt", "value": "A cache."},
    ]},
    {"id": "c1", "conversations": [{"from": "user", "value": "dup id"},
                                   {"from": "assistant", "value": "ok"}]},
]


def fake_tokenizer(text: str) -> list[int]:
    return [ord(c) % 1000 for c in text]


def test_sharegpt_with_tokenizer(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps(SHAREGPT))
    reqs = read_sharegpt(path, tokenizer=fake_tokenizer, block_size=4)
    assert [r.request_id for r in reqs] == ["c1/1", "c2/1", "c1#2/1", "c1/2"]
    one, two = reqs[0], reqs[3]
    msgs = [m["value"] for m in SHAREGPT[0]["conversations"]]
    assert one.tokens.tolist() == fake_tokenizer(msgs[0]) + fake_tokenizer(msgs[1])
    assert one.output_tokens.tolist() == fake_tokenizer(msgs[2])
    assert one.output_len == len(msgs[2])
    head = np.concatenate([one.tokens, one.output_tokens])
    assert np.array_equal(two.tokens[:len(head)], head)
    assert two.turn == 2 and two.session_id == "c1" and two.workload_class == "chat"
    assert two.arrival == 60.0 and reqs[1].arrival == 1.0
    # earlier answers are output blocks, the rest prompt
    start = len(one.tokens) // 4 + 1
    assert set(two.block_kinds[start:len(head) // 4]) == {"output"}
    assert two.block_kinds[0] == "prompt"
    # c2's leading assistant message has no prompt: it makes no request, but the later
    # prompt holds it; turns count the requests made
    c2 = [m["value"] for m in SHAREGPT[1]["conversations"]]
    assert reqs[1].tokens.tolist() == fake_tokenizer(c2[0]) + fake_tokenizer(c2[1])
    assert reqs[1].turn == 1 and reqs[1].block_kinds[0] == "output"


def test_sharegpt_without_tokenizer(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps(SHAREGPT))
    reqs = read_sharegpt(path, chars_per_token=4.0)
    by_id = {r.request_id: r for r in reqs}
    question = "What is a KV cache?"
    q = synthetic_token_ids(question, 4.0)
    assert len(q) == -(-len(question) // 4)
    assert q.max() < 32000
    # the same message gives the same ids in both conversations
    assert np.array_equal(by_id["c2/1"].tokens[-len(q):], q)
    system = synthetic_token_ids("Be brief.", 4.0)
    assert np.array_equal(by_id["c1/1"].tokens, np.concatenate([system, q]))
    # deterministic, and shared leading text gives shared ids
    a = synthetic_token_ids("the same start, then one ending", 3.0)
    b = synthetic_token_ids("the same start, then another", 3.0)
    assert np.array_equal(a[:7], b[:7]) and not np.array_equal(a, b)
    assert np.array_equal(a, synthetic_token_ids("the same start, then one ending", 3.0))
    assert len(read_sharegpt(path, chars_per_token=2.0)[0].tokens) > len(by_id["c1/1"].tokens)
    assert len(read_sharegpt(path, limit=1)) == 2


def test_sharegpt_bad_arguments(tmp_path):
    path = tmp_path / "share.json"
    path.write_text(json.dumps(SHAREGPT))
    with pytest.raises(ConfigError):
        read_sharegpt(path, chars_per_token=0)
    with pytest.raises(ConfigError):
        read_sharegpt(path, tokenizer="gpt2")
    with pytest.raises(ConfigError):
        read_sharegpt(path, tokenizer=lambda s: ["a"])


@pytest.mark.parametrize("conv, field", [
    ("not a conversation", None),
    ({"id": "x"}, "conversations"),
    ({"id": "x", "conversations": "hi"}, "conversations"),
    ({"id": ["x"], "conversations": []}, "id"),
    ({"id": "x", "conversations": [3]}, "conversations[0]"),
    ({"id": "x", "conversations": [{"value": "hi"}]}, "conversations[0].from"),
    ({"id": "x", "conversations": [{"from": "human"}]}, "conversations[0].value"),
    ({"id": "x", "conversations": [{"from": "human", "value": "a"},
                                   {"from": "robot", "value": "b"}]}, "conversations[1].from"),
    ({"id": "x", "conversations": [{"from": "human", "value": 42}]}, "conversations[0].value"),
])
def test_sharegpt_malformed_names_file_conversation_field(tmp_path, conv, field):
    path = tmp_path / "sharegpt_bad.json"
    path.write_text(json.dumps([SHAREGPT[0], conv]))
    with pytest.raises(TraceFormatError) as info:
        read_sharegpt(path)
    assert_names(info.value, path, 1, field)


def test_sharegpt_not_a_list_or_not_json(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(TraceFormatError) as info:
        read_sharegpt(path)
    assert "obj.json" in str(info.value)
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"id": "a",\n   "conversations": [}\n]')
    with pytest.raises(TraceFormatError) as info:
        read_sharegpt(path)
    assert_names(info.value, path, 3, None)


# -- streaming -----------------------------------------------------------------------------


def test_readers_stream_records_before_a_bad_line(tmp_path):
    """The iterators hand out requests as they read: a malformed line is met only when the
    reading reaches it."""
    from kvevict.workloads.formats import iter_alibaba, iter_jsonl

    good = [request_to_dict(Request(i, tokens=[1, 2, i])) for i in range(3)]
    path = write_lines(tmp_path / "t.jsonl", [*good, "{broken", good[0]])
    it = iter_jsonl(path)
    assert [next(it).request_id for _ in range(3)] == [0, 1, 2]
    with pytest.raises(TraceFormatError) as info:
        next(it)
    assert_names(info.value, path, 4, None)
    path = write_lines(tmp_path / "a.jsonl", [ALIBABA[0], ALIBABA[1], "[]"])
    it = iter_alibaba(path)
    assert [next(it).request_id, next(it).request_id] == [1, 2]
    with pytest.raises(TraceFormatError):
        next(it)


def test_iterators_check_their_arguments_when_called(tmp_path):
    from kvevict.workloads.formats import iter_alibaba, iter_sharegpt

    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match="block_size"):
        iter_alibaba(missing, block_size=0)
    with pytest.raises(ConfigError, match="chars_per_token"):
        iter_sharegpt(missing, chars_per_token=0)
    with pytest.raises(FileNotFoundError):
        next(iter_sharegpt(missing))


def test_jsonl_repeated_ids_name_the_first_line_for_every_id_type(tmp_path):
    for first, again in ((7, 7), ("a", "a"), (-3, -3)):
        recs = [request_to_dict(Request(rid, tokens=[1])) for rid in (first, "x", 5, again)]
        path = write_lines(tmp_path / "dup.jsonl", recs)
        with pytest.raises(TraceFormatError, match=f"{first!r} was already used on line 1"):
            read_jsonl(path)
    # an int and a str that print alike are different ids
    recs = [request_to_dict(Request(rid, tokens=[1])) for rid in (7, "7")]
    assert [r.request_id for r in read_jsonl(write_lines(tmp_path / "ok.jsonl", recs))] == [7,
                                                                                          "7"]


def test_jsonl_and_alibaba_check_arrival_order_when_asked(tmp_path):
    from kvevict.workloads.formats import read_alibaba as alibaba

    recs = [request_to_dict(Request(i, tokens=[1], arrival=t)) for i, t in
            enumerate((1.0, 1.0, 0.5))]
    path = write_lines(tmp_path / "t.jsonl", recs)
    assert len(read_jsonl(path)) == 3
    with pytest.raises(TraceFormatError, match=r"0\.5 s is earlier than line 2's 1 s") as info:
        read_jsonl(path, arrival_order=True)
    assert_names(info.value, path, 3, "arrival")
    late = dict(ALIBABA[1], timestamp=0.25)
    path = write_lines(tmp_path / "a.jsonl", [ALIBABA[0], late])
    assert len(alibaba(path)) == 2
    with pytest.raises(TraceFormatError) as info:
        alibaba(path, arrival_order=True)
    assert_names(info.value, path, 2, "timestamp")


def test_alibaba_parent_after_its_child_names_the_child_line(tmp_path):
    child = _alibaba(chat_id=70, parent_chat_id=71)
    parent = _alibaba(chat_id=71, parent_chat_id=-1)
    path = write_lines(tmp_path / "late_parent.jsonl", [ALIBABA[0], child, parent])
    with pytest.raises(TraceFormatError, match="names chat 71, which comes later, on line 3"
                       ) as info:
        read_alibaba(path)
    assert_names(info.value, path, 2, "parent_chat_id")


def _reference_sharegpt_order(reqs):
    """What the reader must produce: the requests sorted by arrival, ties in conversation
    order, then turn (the order they are made in)."""
    return sorted(reqs, key=lambda r: (r.arrival, r.extra["conversation"], r.turn))


@pytest.mark.parametrize(("conversation_interval", "turn_interval"),
                         [(1.0, 60.0), (0.0, 5.0), (7.0, 0.0), (0.3, 1.1), (2.0, 2.0)])
def test_sharegpt_streams_in_arrival_order(tmp_path, conversation_interval, turn_interval):
    import random

    rng = random.Random(int(conversation_interval * 10 + turn_interval))
    convs = []
    for i in range(40):
        msgs = [{"from": "human" if k % 2 == 0 else "gpt", "value": f"m{i}.{k} " * rng.randint(
            0, 3)} for k in range(rng.randint(0, 7))]
        convs.append({"id": f"c{i % 13}", "conversations": msgs})
    path = tmp_path / "share.json"
    path.write_text(json.dumps(convs, indent=rng.choice([None, 1])))
    reqs = read_sharegpt(path, conversation_interval=conversation_interval,
                         turn_interval=turn_interval)
    assert reqs and [r.request_id for r in reqs] == [
        r.request_id for r in _reference_sharegpt_order(reqs)]
    assert len({r.request_id for r in reqs}) == len(reqs)
    per_conv = {}
    for conv_index, conv in enumerate(convs):
        per_conv[conv_index] = sum(1 for k, m in enumerate(conv["conversations"])
                                   if m["from"] == "gpt" and any(
                                       x["value"] for x in conv["conversations"][:k]))
    assert len(reqs) == sum(per_conv.values())


def test_json_array_reads_in_small_chunks_and_reports_json_errors_like_json_load(tmp_path):
    from kvevict.workloads.formats import _json_array

    data = [{"id": i, "v": [1.5, -2, "x\ny", None, True, {"k": 10 ** i}]} for i in range(30)]
    data += [123456789, "tail", [], {}]
    path = tmp_path / "a.json"
    for indent in (None, 2):
        path.write_text(json.dumps(data, indent=indent))
        for chunk in (1, 3, 7, 64, 1 << 20):
            assert list(_json_array(str(path), chunk)) == data
    path.write_text("  [ ]  ")
    assert list(_json_array(str(path), 2)) == []
    text = json.dumps(data, indent=2)
    for cut in (50, 333, len(text) // 2, len(text) - 3):
        broken = text[:cut] + "}" + text[cut:]
        path.write_text(broken)
        try:
            json.loads(broken)
        except json.JSONDecodeError as exc:
            want_line, want_col = exc.lineno, exc.colno
        else:  # pragma: no cover - the cut always breaks it
            raise AssertionError(cut)
        for chunk in (5, 1 << 20):
            with pytest.raises(TraceFormatError) as info:
                list(_json_array(str(path), chunk))
            assert info.value.line == want_line, (cut, chunk)
            assert f"at column {want_col})" in str(info.value), (cut, chunk, str(info.value))


def test_trace_file_reads_again_and_counts(tmp_path):
    from kvevict.workloads import TraceFile

    path = write_lines(tmp_path / "t.jsonl", [*ALIBABA[:3], ""])
    trace = TraceFile(path, "alibaba")
    assert [r.request_id for r in trace] == [r.request_id for r in trace] == [1, 2, 3]
    assert trace.count() == 3 and trace.block_size == 16
    assert TraceFile(path, "alibaba", block_size=32).block_size == 32
    with pytest.raises(ConfigError, match="format must be one of jsonl, mooncake, alibaba, "
                                          "sharegpt, got 'csv'"):
        TraceFile(path, "csv")
    with pytest.raises(ConfigError, match="block_size"):
        TraceFile(path, "alibaba", block_size=-1)  # the options are checked at once
    share = tmp_path / "s.json"
    share.write_text(json.dumps(SHAREGPT))
    assert TraceFile(share, "sharegpt").count() == 4
    assert TraceFile(share, "sharegpt").block_size is None
