"""The shipped judge and the token policies on it: checksums, golden accuracies, identity at a
budget that holds the whole sequence, and the learned parameters."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvevict.errors import ConfigError
from kvevict.judge import JUDGE_DIR, judge_accuracy, judge_answers, kv_bytes, load_judge
from kvevict.tokens import ScorerShape
from kvevict.tokens.tasks import TASKS, make_items

pytest.importorskip("transformers")

LEARNED = ("lkv_t", "kvp")
POLICIES = ("streamingllm", "knorm", "h2o", "snapkv", "tova", *LEARNED)


@pytest.fixture(scope="module")
def judge():
    torch.manual_seed(0)
    return load_judge()


def params(name, judge):
    if name in LEARNED:
        return {"scorer": JUDGE_DIR / f"{name}.safetensors", "shape": ScorerShape.of(judge)}
    return {}


def test_the_manifest_names_the_weights_and_a_corrupted_copy_is_refused(tmp_path):
    manifest = json.loads((JUDGE_DIR / "MANIFEST.json").read_text())
    assert manifest["seed"] == 0 and manifest["command"].startswith("python benchmarks/")
    assert min(manifest["held_out_exact_match"].values()) >= 0.9
    copy = tmp_path / "judge"
    shutil.copytree(JUDGE_DIR, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=manifest["sha256"]):
        load_judge(copy)


def test_kv_bytes_of_the_judge(judge):
    # 4 layers x (K and V) x 2 kv heads x 32 dims x 4 bytes = 2048 bytes per token
    assert kv_bytes(judge, 1) == 2048 and kv_bytes(judge, 154) == 154 * 2048


@pytest.mark.parametrize("task", TASKS)
def test_full_cache_answers_are_golden(judge, task):
    items = make_items(task, 16, length=1024, seed=0)
    assert judge_accuracy(judge, items, None) == GOLDEN_FULL[task]


@pytest.mark.parametrize("name", POLICIES)
def test_a_budget_holding_the_whole_sequence_changes_nothing(judge, name):
    """Token-identical to plain generate() with transformers' own DynamicCache."""
    items = make_items("vartrack", 4, length=1024, seed=3)
    prompt = torch.tensor([it.prompt for it in items])
    with torch.no_grad():
        plain = judge.generate(input_ids=prompt, do_sample=False, max_new_tokens=4,
                               min_new_tokens=4, pad_token_id=0)[:, prompt.shape[1]:]
    got = judge_answers(judge, items, name, budget=2048, **params(name, judge))
    assert got == [tuple(r) for r in plain.tolist()]


@pytest.mark.parametrize("name", POLICIES)
def test_accuracy_at_15_percent_is_golden(judge, name):
    items = make_items("recall", 16, length=1024, seed=1)
    got = judge_accuracy(judge, items, name, fraction=0.15, **params(name, judge))
    assert got == GOLDEN_15[name]
