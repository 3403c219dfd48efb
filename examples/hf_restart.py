"""A conversation that survives a restart: SessionStore(..., disk_dir=D) over transformers.

The first process holds a 3-turn chat and closes its store, which writes every cached block
to the disk tier under D (one checksummed file per block, a manifest naming the model and the
layout). A second process, with the same model, opens a new store on D: turn 4 reloads the
first three turns from disk (counted as disk hits) and prefills only its new tokens. Its
logits are checked against a fresh full recompute (transformers' DynamicCache).

Run: python examples/hf_restart.py [DIR]   (needs: pip install "kvevict[hf]")
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvevict.adapters.hf import SessionStore

BLOCK = 8  # tokens per block; only whole blocks are kept
USER = [21, 6, 9, 5]  # user message lengths of turns 1-4
ANSWER = 6  # tokens generated per turn


def tiny_model() -> LlamaForCausalLM:
    """A seeded random Llama (the same weights in every process; nothing to download)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


def message(turn: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(turn)
    return torch.randint(3, 128, (1, USER[turn]), generator=gen)


def first_process(directory: Path) -> None:
    """Turns 1-3, then close the store: the cache goes to disk."""
    model = tiny_model()
    conversation = torch.zeros((1, 0), dtype=torch.long)
    with SessionStore(model, num_blocks=32, block_size=BLOCK, disk_dir=directory) as store:
        for turn in range(3):
            conversation = torch.cat([conversation, message(turn)], dim=1)
            with store.cache_for("ann", conversation) as cache:
                conversation = model.generate(conversation, cache=cache,
                                              max_new_tokens=ANSWER, do_sample=False)
            print(f"process 1, turn {turn + 1}: {cache.prompt_tokens} prompt tokens, "
                  f"{cache.reused_tokens} reused")
    print(f"process 1: closed, {len(store.tiers.tier('disk'))} blocks on disk")
    torch.save(conversation, directory / "conversation.pt")


def second_process(directory: Path) -> float:
    """Turn 4 in a new store on the same directory; returns the largest logit difference
    from a fresh recompute."""
    model = tiny_model()
    store = SessionStore(model, num_blocks=32, block_size=BLOCK, disk_dir=directory)
    conversation = torch.cat([torch.load(directory / "conversation.pt"), message(3)], dim=1)
    kwargs = dict(max_new_tokens=ANSWER, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    with store.cache_for("ann", conversation) as cache:
        out = model.generate(conversation, cache=cache, **kwargs)
    ref = model.generate(conversation, cache=DynamicCache(config=model.config), **kwargs)
    diff = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
    hits = store.hits_by_tier()
    print(f"process 2, turn 4: {cache.prompt_tokens} prompt tokens, {cache.reused_tokens} "
          f"reused ({hits['disk']} blocks from disk, {hits['device']} from memory)")
    print(f"process 2: answer equals a fresh recompute: "
          f"{torch.equal(out.sequences, ref.sequences)}; largest logit difference {diff:.1e}")
    store.manager.check()
    return diff


def main(directory: Path) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--first", str(directory)], check=True)
    return second_process(directory)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--first"]:
        first_process(Path(sys.argv[2]))
    elif len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
