"""A Mooncake trace's hash ids are blocks of the trace's size (512 unless the file says
otherwise): every entry point given another block size stops with a `ConfigError` naming
both sizes, instead of replaying nonsense."""

from __future__ import annotations

import json

import pytest

from kvevict import replay as replay_module
from kvevict.cli import main
from kvevict.errors import ConfigError, TraceFormatError
from kvevict.workloads import (
    MOONCAKE_BLOCK_SIZE,
    bundled_trace_path,
    check_block_size,
    iter_mooncake,
    read_mooncake,
    trace_block_size,
    write_mooncake,
)


@pytest.fixture()
def head(tmp_path):
    """The first 40 lines of the bundled trace (512-token blocks, no block_size field)."""
    lines = bundled_trace_path("mooncake").read_text().splitlines(keepends=True)[:40]
    path = tmp_path / "mc_head.jsonl"
    path.write_text("".join(lines))
    return path


@pytest.fixture()
def declared(tmp_path, head):
    """The same requests written with 16-token blocks declared on every line."""
    path = tmp_path / "mc16.jsonl"
    write_mooncake(read_mooncake(head), path, block_size=16)
    return path


def _key(requests):
    return [(r.block_hashes, r.num_tokens, r.arrival, r.output_len) for r in requests]


def _names_both(message: str, given: int, trace: int) -> None:
    assert f"{trace}-token blocks" in message, message
    assert f"not {given}-token ones" in message, message


def test_trace_block_size_is_512_unless_the_file_says_otherwise(head, declared):
    assert trace_block_size(head) == MOONCAKE_BLOCK_SIZE == 512
    assert trace_block_size(bundled_trace_path("mooncake")) == 512
    assert trace_block_size(declared) == 16
    assert json.loads(declared.read_text().splitlines()[0])["block_size"] == 16
    # the default (512) is not written: the published format stays as it is
    out = head.with_name("again.jsonl")
    write_mooncake(read_mooncake(head), out)
    assert out.read_text() == head.read_text()


def test_python_readers_reject_another_block_size(head, declared):
    with pytest.raises(ConfigError) as err:
        read_mooncake(head, block_size=100)
    message = str(err.value)
    _names_both(message, 100, 512)
    assert str(head) in message and "block_size=512" in message
    assert 'declares no "block_size"' in message
    with pytest.raises(ConfigError) as err:
        list(iter_mooncake(declared, block_size=512))
    _names_both(str(err.value), 512, 16)
    assert '"block_size" field' in str(err.value)
    with pytest.raises(ConfigError, match="--block-size 100 does not match"):
        check_block_size(head, 100, flag="--block-size")
    # the trace's own size, given or left out, reads the same requests
    assert _key(read_mooncake(head, block_size=512)) == _key(read_mooncake(head))
    assert _key(read_mooncake(declared, block_size=16)) == _key(read_mooncake(declared))
    assert check_block_size(declared, None) == 16


def test_a_later_line_cannot_change_the_block_size(tmp_path, head):
    lines = head.read_text().splitlines()
    record = json.loads(lines[3])
    record["block_size"] = 64
    lines[3] = json.dumps(record)
    bad = tmp_path / "changes.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_mooncake(bad)
    message = str(err.value)
    assert "changes.jsonl:4" in message and "block_size" in message
    assert "expected 512" in message and "got 64" in message
    record["block_size"] = 0
    lines[3] = json.dumps(record)
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match="positive integer"):
        read_mooncake(bad)


def test_simulate_rejects_another_block_size(capsys, head, declared):
    rc = main(["simulate", "--trace", str(head), "--format", "mooncake", "--block-size",
               "100", "--policies", "lru", "--no-sweep", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith("kvevict: error: --block-size 100 does not match the trace")
    _names_both(err, 100, 512)
    assert "--block-size 512" in err
    rc = main(["simulate", "--trace", str(declared), "--format", "mooncake", "--block-size",
               "512", "--policies", "lru", "--no-sweep", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    _names_both(err, 512, 16)


def test_simulate_uses_the_trace_block_size(capsys, declared):
    rc = main(["simulate", "--trace", str(declared), "--format", "mooncake", "--policies",
               "lru", "--cache-blocks", "20000", "--gpu", "h100-sxm-80gb",
               "--no-sweep", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "20,000 blocks of 16 tokens" in captured.out
    rc = main(["simulate", "--trace", str(declared), "--format", "mooncake", "--block-size",
               "16", "--policies", "lru", "--cache-blocks", "20000", "--gpu", "h100-sxm-80gb",
               "--no-sweep", "--quiet"])
    assert rc == 0, capsys.readouterr().err


def test_replay_command_rejects_another_block_size(capsys, head):
    for trace in (str(head), "mooncake"):
        rc = replay_module.main(["--trace", trace, "--block-size", "100", "--sizes", "100",
                                 "--policies", "lru"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err
        assert err.startswith("error: --block-size 100 does not match the trace"), err
        _names_both(err, 100, 512)
    rc = replay_module.main(["--trace", str(head), "--block-size", "512", "--sizes", "100",
                             "--policies", "lru"])
    assert rc == 0
    assert "| lru |" in capsys.readouterr().out
