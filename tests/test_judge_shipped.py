"""The shipped judge (`kvevict/data/judge`): its manifest's claims and golden accuracies through
the production path (`judge_accuracy`: `PagedCache` and `generate()`)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvevict.judge import JUDGE_DIR, judge_accuracy, load_judge
from kvevict.tokens.tasks import TASKS, make_items


@pytest.fixture(scope="module")
def judge():
    torch.set_num_threads(1)
    return load_judge()  # checks the weights' SHA-256 against the manifest


def test_the_manifest_records_how_the_judge_was_made_and_what_it_scores():
    """One run from scratch, under an hour on 2 threads (issue 16's "about an hour on 2
    cores"), every task's held-out exact match at least 90%; two heads of 64, a few MB."""
    manifest = json.loads((JUDGE_DIR / "MANIFEST.json").read_text())
    assert manifest["seed"] == 0 and manifest["held_out_items"] == 256
    assert manifest["held_out_exact_match"] == {"recall": 0.99609375, "needle": 0.99609375,
                                               "vartrack": 0.98046875}
    assert all(manifest["held_out_exact_match"][t] >= 0.9 for t in TASKS)
    assert manifest["curriculum"] == {"scale": 1.0, "top": 1280}
    assert len(manifest["history"]) == 1 and "--resume" not in manifest["command"]
    assert "--heads 2 2" in manifest["command"] and manifest["threads"] == 2
    assert sum(h["wall_seconds"] for h in manifest["history"]) == manifest["total_wall_seconds"]
    assert manifest["total_wall_seconds"] == 3049 < 3600
    config = json.loads((JUDGE_DIR / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 2)
    assert (config["head_dim"], config["num_hidden_layers"]) == (64, 4)
    assert (JUDGE_DIR / "model.safetensors").stat().st_size < 8 * 2**20  # a few MB


def test_golden_full_cache_and_streamingllm_accuracy(judge):
    """16 items per task (evaluation seed 0), 1,024-token contexts: the full cache answers
    (nearly) all; StreamingLLM at 15% of the context, which keeps only sinks and the recent
    window, loses the evidence."""
    full, stream = {}, {}
    for task in TASKS:
        items = make_items(task, 16, length=1024, seed=0)
        full[task] = judge_accuracy(judge, items, None)
        stream[task] = judge_accuracy(judge, items, "streamingllm", fraction=0.15)
    assert full == {"recall": 1.0, "needle": 1.0, "vartrack": 0.9375}
    assert stream == {"recall": 0.0625, "needle": 0.0, "vartrack": 0.0}


def test_golden_learned_accuracy_at_15_percent(judge):
    """The shipped LKV-T and KVP at 15% of the context, through the production path (the
    docs' grid, evaluation seed 0): LKV-T keeps the full cache's answers on every task; KVP
    keeps recall and vartrack but loses the needle."""
    from kvevict.tokens import ScorerShape

    got = {}
    for name in ("lkv_t", "kvp"):
        got[name] = {task: judge_accuracy(judge, make_items(task, 16, length=1024, seed=0),
                                          name, fraction=0.15,
                                          scorer=JUDGE_DIR / f"{name}.safetensors",
                                          shape=ScorerShape.of(judge))
                     for task in TASKS}
    assert got["lkv_t"] == {"recall": 1.0, "needle": 1.0, "vartrack": 0.9375}
    assert got["kvp"] == {"recall": 1.0, "needle": 0.0625, "vartrack": 0.9375}


def test_the_learned_token_policies_parameters_load_for_the_judge(judge):
    """LKV-T, KVP and LKV-H were trained on this judge: their files match the report's digests
    and load for its shape (a file for another shape is refused, tests/test_tokens_heads.py)."""
    import hashlib

    from kvevict.tokens import ScorerShape, make_token_policy
    from kvevict.tokens.heads import load_budgets
    from kvevict.tokens.learned import load_scorer

    report = json.loads((JUDGE_DIR / "TOKEN_POLICIES.json").read_text())
    for name in ("lkv_t", "kvp", "lkv_h", "lkv_h_scorer"):
        data = (JUDGE_DIR / f"{name}.safetensors").read_bytes()
        assert hashlib.sha256(data).hexdigest() == report[f"{name}_sha256"]
    shape = ScorerShape.of(judge)
    for name in ("lkv_t", "kvp"):
        policy = make_token_policy(name, budget=154, scorer=JUDGE_DIR / f"{name}.safetensors",
                                   shape=shape)
        assert policy.scorer.shape == shape
    ranking = load_scorer(JUDGE_DIR / "lkv_h_scorer.safetensors", shape, method="lkv_h")
    assert ranking.per_head and ranking.shape == shape
    counts = load_budgets(JUDGE_DIR / "lkv_h.safetensors", shape).counts(0.15, 1024)
    assert int(counts.sum()) == round(0.15 * 1024 * 4 * 2)


@pytest.mark.parametrize(("name", "task"), [("lkv_t", "needle"), ("kvp", "recall")])
def test_the_shipped_learned_parameters_make_the_same_choices_in_hf_and_the_engine(judge, name,
                                                                                  task):
    """The trained files, loaded by name in both: the built-in engine (the judge converted by
    `from_hf`, the whole prompt prefilled in one chunk) and `PagedCache` in ``generate()`` keep
    the same positions in every layer and generate the same greedy tokens, at 15% of a
    1,024-token context (a task each policy answers: KVP loses the needle)."""
    from kvevict.adapters.hf import PagedCache
    from kvevict.engine import run_engine
    from kvevict.engine.hf import from_hf
    from kvevict.scheduler import SchedulerConfig
    from kvevict.tokens import ScorerShape, make_token_policy
    from kvevict.types import Request

    item = make_items(task, 1, length=1024, seed=0)[0]
    ids = torch.tensor(item.prompt)
    budget, new = 154, len(item.answer)
    path = JUDGE_DIR / f"{name}.safetensors"
    policy = make_token_policy(name, budget=budget, scorer=path, shape=ScorerShape.of(judge))
    cache = PagedCache(judge, token_policy=policy)
    with torch.no_grad():
        out = judge.generate(ids[None], attention_mask=torch.ones_like(ids)[None], cache=cache,
                             do_sample=False, max_new_tokens=new)  # the answer ends with EOS
    want_tokens = out[0, len(ids):].tolist()
    want_positions = [layer.positions[0].tolist() for layer in cache.layers]
    result = run_engine([Request("a", tokens=ids.numpy(), output_len=new)], from_hf(judge),
                        capacity_blocks=80, block_size=16, check=True,
                        config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=1),
                        token_policy=name, token_budget=budget, token_params={"scorer": path})
    assert [list(p) for p in result.token_positions["a"]] == want_positions
    assert list(result.answers["a"]) == want_tokens == list(item.answer)  # and it is right
    assert len(want_positions) == 4 and all(len(p) == budget for p in want_positions)
