"""Seeded tiny transformers models shared by the Hugging Face adapter tests (no downloads).

Import it only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
WINDOW = 6  # the sliding window of Qwen2's layer 1


def build(kind: str = "llama", **overrides):
    """A seeded tiny model in eval mode, greedy-ready (pad 0, no EOS): ``llama``, ``qwen2``
    (layer 0 full attention, layer 1 a sliding window of `WINDOW`: a special layer kept by
    transformers) or ``mistral`` (no sliding window). ``overrides`` go to the config
    (sizes, ``attn_implementation``, ...)."""
    torch.manual_seed(0)
    config = {**SIZES, **overrides}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**config))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**config, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=1))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**config, sliding_window=None))
    else:
        raise ValueError(f"unknown tiny model {kind!r}; expected llama, qwen2 or mistral")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def judge_shaped(vocab_size: int):
    """A seeded random Llama like a smaller judge (2 layers, hidden 64, eager attention), with
    the tasks' special tokens (pad 0, BOS 1, EOS 2). It has 4 query and 2 kv heads: grouped-query
    attention, which the shipped judge (2 and 2) does not exercise."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def plain_answers(model, items):
    """The reference: ``generate()`` with a DynamicCache over each item's whole prompt. It stops
    at EOS (the answers end with it); a row that stopped early is padded to the answer length."""
    prompt = torch.tensor([it.prompt for it in items])
    n = len(items[0].answer)
    with torch.no_grad():
        out = model.generate(input_ids=prompt, do_sample=False, max_new_tokens=n,
                             pad_token_id=0)
    return [tuple(r) + (0,) * (n - len(r)) for r in out[:, prompt.shape[1]:].tolist()]
