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
