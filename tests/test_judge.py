"""`kvevict.judge` on a seeded random judge-like model, smaller: loading with the checksum,
identity at a budget that holds the whole sequence, the traces and the gated forward."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM

from kvevict.errors import ConfigError
from kvevict.judge import (
    gated_logits,
    judge_accuracy,
    judge_answers,
    judge_traces,
    kv_bytes,
    load_judge,
)
from kvevict.tokens import KVScorer, ScorerShape
from kvevict.tokens.lkv import GatedAttention
from kvevict.tokens.tasks import VOCAB_SIZE, make_items

POLICIES = ("streamingllm", "knorm", "h2o", "snapkv", "tova", "ema", "lkv_t", "kvp")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random judge-like model saved as the judge is (weights + manifest)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("judge")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    (path / "MANIFEST.json").write_text(json.dumps({"sha256": digest}))
    return path


@pytest.fixture(scope="module")
def model(folder):
    return load_judge(folder)


def params(name, model):
    if name in ("lkv_t", "kvp"):
        torch.manual_seed(1)
        return {"scorer": KVScorer(ScorerShape.of(model), hidden=8, per_head=name == "kvp")}
    return {}


def test_a_corrupted_weights_file_is_refused_naming_both_digests(folder, tmp_path):
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    want = json.loads((folder / "MANIFEST.json").read_text())["sha256"]
    got = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(ConfigError, match=f"SHA-256 {got}, but its manifest says {want}"):
        load_judge(tmp_path)
    with pytest.raises(ConfigError, match="no judge weights"):
        load_judge(tmp_path / "missing")


def test_kv_bytes_counts_k_and_v_of_every_layer(model):
    # 2 layers x (K and V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token
    assert kv_bytes(model, 1) == 512 and kv_bytes(model, 100) == 51_200


@pytest.mark.parametrize("name", POLICIES)
def test_a_budget_holding_the_whole_sequence_is_token_identical_to_dynamic_cache(model, name):
    items = make_items("vartrack", 3, length=160, seed=3)
    prompt = torch.tensor([it.prompt for it in items])
    with torch.no_grad():
        plain = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=4,
                               pad_token_id=0)[:, prompt.shape[1]:]
    got = judge_answers(model, items, name, budget=len(items[0].prompt) + 4,
                        **params(name, model))
    assert got == [tuple(r) + (0,) * (4 - len(r)) for r in plain.tolist()]
    assert judge_answers(model, items, None) == got


def test_a_small_budget_changes_answers_and_accuracy_is_exact_match(model):
    items = make_items("recall", 6, length=160, seed=4)
    full = judge_answers(model, items, None)
    kept = judge_answers(model, items, "streamingllm", fraction=0.1)
    assert kept != full  # 16 of 160 tokens: the random model's answers move
    assert judge_accuracy(model, items, None) == sum(
        a == it.answer for a, it in zip(full, items, strict=True)) / 6


def test_items_of_one_batch_must_share_lengths(model):
    mixed = make_items("recall", 1, length=160) + make_items("needle", 1, length=160)
    with pytest.raises(ConfigError, match="share their context and answer lengths"):
        judge_answers(model, mixed, None)


def test_traces_hold_the_future_attention_on_the_context(model):
    items = make_items("needle", 2, length=100, seed=5)
    (trace,) = judge_traces(model, items, batch=2)
    ctx = len(items[0].context)
    ids = torch.tensor([(*it.prompt, *it.answer[:-1]) for it in items])
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    for layer in range(2):
        want = att[layer][:, :, ctx:, :ctx].mean(2).view(2, 2, 2, ctx).mean(2)
        assert torch.allclose(trace["utility"][layer], want, atol=1e-6)
        assert trace["keys"][layer].shape == (2, 2, ctx, 16)
    # the queries after the context give the context at most all of their attention
    assert float(trace["utility"][1].sum(-1).max()) <= 1.0 + 1e-5


def test_traces_of_packed_items_average_every_question_over_the_given_context(model):
    from kvevict.tokens.tasks import packed_items

    items = packed_items("vartrack", 2, length=100, seed=5)
    (trace,) = judge_traces(model, items, batch=2, context=100)
    ids = torch.tensor([(*it.prompt, *it.answer[:-1]) for it in items])
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    want = att[0][:, :, 100:, :100].mean(2).view(2, 2, 2, 100).mean(2)
    assert torch.allclose(trace["utility"][0], want, atol=1e-6)
    assert trace["keys"][0].shape == (2, 2, 100, 16) and ids.shape[1] == 100 + 3 * 6 - 1


def test_the_gated_forward_at_full_retention_is_the_eager_forward(model):
    items = make_items("recall", 2, length=120, seed=6)
    ids = torch.tensor([(*it.prompt, *it.answer[:-1]) for it in items])
    gate = GatedAttention(KVScorer(ScorerShape.of(model), hidden=8))
    gate.context, gate.retention = len(items[0].context), 1.0
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = gated_logits(model, ids, gate)
        gate.retention = 0.2
        cut = gated_logits(model, ids, gate)
        after = model(input_ids=ids).logits  # the model's own attention is back
    assert torch.allclose(got, want, atol=1e-5)
    ctx = len(items[0].context)
    assert torch.allclose(cut[:, :ctx], want[:, :ctx], atol=1e-5)  # the prefill sees all
    assert not torch.allclose(cut[:, ctx:], want[:, ctx:], atol=1e-3)
    assert torch.equal(after, want)
