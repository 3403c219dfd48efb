"""SessionStore over real tiers: a host tier (a CPU tensor) and a disk tier (checksummed
block files) below the store's pool, and conversations that survive a restart.

- restart: a subprocess runs a 3-turn conversation and closes its store; a new store on the
  same directory serves turn 4 from disk (counted as disk hits), with the logits of a fresh
  full recompute (DynamicCache) within float32 tolerance;
- an evicted session comes back from the host tier, its KV bit-identical per tier, dtype and
  layout;
- a directory written for another model or layout is refused naming both; a corrupted block
  file is a logged miss (recomputed, never served); an unwritable directory is back-pressure.
"""

from __future__ import annotations

import logging
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, build  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvevict.adapters.hf import SessionStore, model_identity  # noqa: E402
from kvevict.errors import ConfigError  # noqa: E402
from kvevict.types import ManualClock  # noqa: E402

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
       torch.bfloat16: {"atol": 5e-2, "rtol": 5e-2}, torch.float16: {"atol": 5e-3, "rtol": 5e-3}}
GENERATE = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                output_logits=True)
TESTS = Path(__file__).parent

#: turns 1-3 of the restart test, run in a process of their own
WRITER = """
import sys
import torch
sys.path.insert(0, {tests!r})
from hf_models import build, VOCAB
from kvevict.adapters.hf import SessionStore
from kvevict.types import ManualClock

def tokens(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))

model = build()
conversation = tokens(15, 1)
with SessionStore(model, num_blocks=64, block_size=4, disk_dir={directory!r},
                  clock=ManualClock()) as store:
    for turn in range(3):
        with store.cache_for("ann", conversation) as cache:
            out = model.generate(conversation, cache=cache, max_new_tokens=5, do_sample=False)
        print("reused", cache.reused_tokens)
        conversation = torch.cat([out, tokens(5, 10 + turn)], dim=1)
torch.save(conversation, {conversation!r})
print("on disk", len(store.tiers.tier("disk")))
"""


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def turn(model, store, session, conversation, tol=TOL[torch.float32]):
    """One turn through the store, checked against a fresh DynamicCache generation over the
    whole conversation; returns (sequences, cache)."""
    ref = model.generate(conversation, cache=DynamicCache(config=model.config), **GENERATE)
    with store.cache_for(session, conversation) as cache:
        out = model.generate(conversation, cache=cache, **GENERATE)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, **tol)
    store.manager.check()
    return out.sequences, cache


# -- restart ----------------------------------------------------------------------------------


def test_a_new_process_resumes_the_conversation_from_disk(tmp_path):
    directory, saved = tmp_path / "kv", tmp_path / "conversation.pt"
    script = WRITER.format(tests=str(TESTS), directory=str(directory),
                           conversation=str(saved))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["reused 0", "reused 16", "reused 28",
                                           "on disk 9"]
    conversation = torch.load(saved)  # turns 1-3 and turn 4's user tokens: 45 tokens
    assert conversation.shape == (1, 45)
    model = build()
    store = SessionStore(model, num_blocks=64, block_size=4, disk_dir=directory,
                         clock=ManualClock())
    assert store.manager.num_cached_blocks == 0 and len(store.tiers) == 9
    _, cache = turn(model, store, "ann", conversation)
    # turn 3 computed 39 tokens (its last answer token was never fed): 9 whole blocks
    assert cache.reused_tokens == 36
    assert store.hits_by_tier() == {"device": 0, "disk": 9}
    stats = store.tier_stats
    assert stats.reloads == 9 and stats.checksum_failures == 0
    assert stats.bytes_read == {"disk": 9 * store.pool.bytes_per_block}


# -- the host tier, per dtype and layout -------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("dtype,kind,kv_heads", [(torch.float32, "llama", 2),
                                                  (torch.bfloat16, "llama", 2),
                                                  (torch.float16, "llama", 2),
                                                  (torch.float32, "mistral", 4),
                                                  (torch.bfloat16, "llama", 1)])
def test_an_evicted_session_reloads_bit_identical_kv(tmp_path, tier, dtype, kind, kv_heads):
    model = build(kind, num_key_value_heads=kv_heads).to(dtype)
    tiers = {"host_blocks": 16} if tier == "host" else {"disk_dir": tmp_path / "kv"}
    store = SessionStore(model, num_blocks=8, block_size=4, clock=ManualClock(),
                         demote="always", **tiers)
    ann = tokens(17, seed=1)
    turn(model, store, "ann", ann, TOL[dtype])
    blocks = list(store.manager.lookup(ann[0]).block_ids)
    assert len(blocks) == 4  # 17 prompt + 4 fed answer tokens: 5 blocks, 4 of the prompt
    written = store.pool.kv[:, :, blocks].clone()
    turn(model, store, "bob", tokens(27, seed=2), TOL[dtype])  # 8 blocks: ann's go down
    assert store.manager.lookup(ann[0]).num_cached_tokens == 0
    cache = store.cache_for("ann", ann)
    assert cache.reused_tokens == 16
    reloaded = store.manager.sequence(("ann", 1)).block_table[:4]
    assert torch.equal(store.pool.kv[:, :, reloaded].view(torch.uint8),
                       written.view(torch.uint8))
    cache.close()
    assert store.hits_by_tier()[tier] == 4
    store.manager.check()


def test_two_sessions_alternating_through_the_host_tier(tmp_path):
    model = build()
    store = SessionStore(model, num_blocks=10, block_size=4, host_blocks=32,
                         clock=ManualClock(), demote="always")
    conversations = {"ann": tokens(13, seed=1), "bob": tokens(13, seed=2)}
    reused = []
    for _ in range(3):
        for name in ("ann", "bob"):
            out, cache = turn(model, store, name, conversations[name])
            reused.append(cache.reused_tokens)
            conversations[name] = torch.cat([out, tokens(3, seed=len(reused))], dim=1)
    assert reused == [0, 0, 16, 16, 24, 24]
    # a 10-block pool cannot hold both: every turn after the first two reloads part of its
    # session from the host tier (golden counts of this fixed sequence)
    assert store.hits_by_tier() == {"device": 11, "host": 9}
    assert store.stats.block_hits == 20
    stats = store.tier_stats
    assert stats.demotions == {"host": 16} and stats.reloads == 9 and stats.drops == {}
    assert stats.bytes_read == {"host": 9 * store.pool.bytes_per_block}


# -- identity and faults ----------------------------------------------------------------------


def written_dir(tmp_path, model=None, block_size=4) -> Path:
    model = model or build()
    directory = tmp_path / "kv"
    with SessionStore(model, num_blocks=16, block_size=block_size, disk_dir=directory,
                      clock=ManualClock()) as store:
        turn(model, store, "ann", tokens(13, seed=1))
    return directory


def test_a_directory_of_another_model_or_layout_is_refused(tmp_path):
    model = build()
    directory = written_dir(tmp_path, model)
    other = build()
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # other weights, same shape
    assert model_identity(other) != model_identity(model)
    assert model_identity(build()) == model_identity(model)  # rebuilt: the same weights
    with pytest.raises(ConfigError) as err:
        SessionStore(other, num_blocks=16, block_size=4, disk_dir=directory)
    text = str(err.value)
    assert model_identity(model) in text and model_identity(other) in text
    with pytest.raises(ConfigError, match=r"block_size 4.*block_size 8"):
        SessionStore(model, num_blocks=16, block_size=8, disk_dir=directory)
    with pytest.raises(ConfigError, match=r"float32.*bfloat16"):
        SessionStore(build().to(torch.bfloat16), num_blocks=16, block_size=4,
                     disk_dir=directory, model_id=model_identity(model))


def test_a_corrupted_block_file_is_recomputed_not_served(tmp_path, caplog):
    model = build()
    directory = written_dir(tmp_path, model)
    store = SessionStore(model, num_blocks=16, block_size=4, disk_dir=directory,
                         clock=ManualClock())
    disk = store.tiers.tier("disk")
    assert sorted(b.depth for b in disk.records.values()) == [0, 1, 2, 3]
    victim = next(b for b in disk.records.values() if b.depth == 2)
    path = disk.store.path_of(victim.block_hash)
    raw = path.read_bytes()
    path.write_bytes(raw[:200] + bytes([raw[200] ^ 0x10]) + raw[201:])
    conversation = torch.cat([tokens(13, seed=1), tokens(4, seed=7)], dim=1)
    with caplog.at_level(logging.WARNING, logger="kvevict.tiers"):
        _, cache = turn(model, store, "ann", conversation)
    assert "failed its checksum" in caplog.text
    assert cache.reused_tokens == 8  # depths 0-1 from disk, 2 onwards recomputed
    assert store.hits_by_tier() == {"device": 0, "disk": 2}
    assert store.tier_stats.checksum_failures == 1
    assert store.tier_stats.drops == {"corrupt": 1, "cascade": 1}


def test_an_unwritable_directory_is_back_pressure(tmp_path):
    model = build()
    directory = tmp_path / "kv"
    store = SessionStore(model, num_blocks=16, block_size=4, disk_dir=directory,
                         clock=ManualClock())
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # every block write fails, even as root
    turn(model, store, "ann", tokens(13, seed=1))
    assert store.persist() == 0
    assert store.tier_stats.drops == {"back_pressure": 4}
    store.manager.check()
    _, cache = turn(model, store, "ann", tokens(13, seed=1))
    assert cache.reused_tokens == 0  # nothing kept: recomputed, the same answer


def test_tier_options_are_checked(tmp_path):
    model = build()
    with pytest.raises(ConfigError, match="host_blocks must be an int >= 0"):
        SessionStore(model, num_blocks=8, host_blocks=-1)
    with pytest.raises(ConfigError, match="disk_blocks= sizes a disk tier"):
        SessionStore(model, num_blocks=8, disk_blocks=4)
    with pytest.raises(ConfigError, match="persist\\(\\) needs a disk tier"):
        SessionStore(model, num_blocks=8, host_blocks=4).persist()
    store = SessionStore(model, num_blocks=8)
    assert store.tiers is None and store.tier_stats is None
    assert store.hits_by_tier() == {"device": 0}


def test_the_restart_example_resumes_from_disk(tmp_path, capfd):
    example = runpy.run_path(str(TESTS.parent / "examples" / "hf_restart.py"))
    diff = example["main"](tmp_path / "kv")  # turns 1-3 in a subprocess, turn 4 here
    assert diff < 1e-5
    assert capfd.readouterr().out.splitlines() == [
        "process 1, turn 1: 21 prompt tokens, 0 reused",
        "process 1, turn 2: 33 prompt tokens, 24 reused",
        "process 1, turn 3: 48 prompt tokens, 32 reused",
        "process 1: closed, 6 blocks on disk",
        "process 2, turn 4: 59 prompt tokens, 48 reused (6 blocks from disk, 0 from memory)",
        f"process 2: answer equals a fresh recompute: True; largest logit difference "
        f"{diff:.1e}",
    ]
