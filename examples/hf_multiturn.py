"""Multi-turn chat with transformers' generate() over a kvevict SessionStore.

Three sessions share a system prompt. Each turn passes the whole conversation to generate();
the store hands back a cache already holding the longest resident prefix (the system prompt,
from any session, and the session's own history), so generate() prefills only what is new.
A second run gives the store a pool too small for everyone: LRU evicts the idle sessions'
tails, which are simply recomputed when those sessions come back.

Run: python examples/hf_multiturn.py   (needs: pip install "kvevict[hf]")
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvevict.adapters.hf import SessionStore

BLOCK = 8  # tokens per block; only whole blocks are shared
SYSTEM = 24  # system prompt tokens (3 blocks)
ANSWER = 6  # tokens generated per turn
#: (session, user message length) in arrival order
SCHEDULE = [("ann", 5), ("bob", 7), ("ann", 4), ("cy", 9), ("bob", 6), ("ann", 3), ("cy", 5)]


def tiny_model() -> LlamaForCausalLM:
    """A seeded random Llama: 2 layers, hidden 32, vocabulary 128 (nothing to download)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always ANSWER tokens
    return model


def chat(num_blocks: int = 64) -> tuple[list[dict], SessionStore]:
    """Run `SCHEDULE` through a store of ``num_blocks`` blocks; one record per turn."""
    model = tiny_model()
    store = SessionStore(model, num_blocks=num_blocks, block_size=BLOCK, policy="lru")
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 128, (1, SYSTEM), generator=gen)
    conversations: dict[str, torch.Tensor] = {}
    turns: dict[str, int] = {}
    log = []
    for session, length in SCHEDULE:
        user = torch.randint(3, 128, (1, length), generator=gen)
        prompt = torch.cat([conversations.get(session, system), user], dim=1)
        with store.cache_for(session, prompt) as cache:
            out = model.generate(prompt, cache=cache, max_new_tokens=ANSWER, do_sample=False)
        conversations[session] = out
        turns[session] = turns.get(session, 0) + 1
        log.append({"session": session, "turn": turns[session], "prompt": prompt.shape[1],
                    "saved": cache.reused_tokens,
                    "prefilled": prompt.shape[1] - cache.reused_tokens,
                    "answer": out[0, prompt.shape[1]:].tolist()})
    store.manager.check()
    return log, store


def report(title: str, num_blocks: int) -> list[dict]:
    """Print one line per turn: prompt tokens, tokens prefilled, prefill tokens saved."""
    log, store = chat(num_blocks)
    print(f"{title} ({num_blocks} blocks of {BLOCK} tokens, LRU)")
    for row in log:
        print(f"  {row['session']:>3} turn {row['turn']}: prompt {row['prompt']:3d} tokens, "
              f"prefilled {row['prefilled']:3d}, saved {row['saved']:3d}")
    prompt = sum(row["prompt"] for row in log)
    saved = sum(row["saved"] for row in log)
    print(f"  total: {prompt} prompt tokens, {prompt - saved} prefilled, {saved} saved "
          f"({saved / prompt:.0%}); evictions: {store.stats.evictions}")
    return log


def main() -> None:
    roomy = report("pool large enough for every session", 64)
    tight = report("pool too small: idle sessions are evicted", 8)
    same = [row["answer"] for row in roomy] == [row["answer"] for row in tight]
    print(f"same answers with either pool: {same}")


if __name__ == "__main__":
    main()
