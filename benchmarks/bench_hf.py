"""The Hugging Face adapter's cost and savings, each against a baseline measured in the same run.

1. ``generate()`` with `PagedCache` versus transformers' `DynamicCache`, same seeded random
   Llama-style model, same prompts, greedy: the time ratio (target <= 1.3x on CPU). Both give
   the same tokens (checked).
2. A multi-turn session mix (sessions sharing a system prompt, each turn = the conversation so
   far + a new user message) through a `SessionStore` versus recomputing every turn with a fresh
   `DynamicCache`: prompt tokens prefilled, tokens saved, and the time ratio; with a pool large
   enough for every session and with one that forces LRU evictions.

As pytest-benchmark tests (groups ``hf-generate`` and ``hf-sessions``)::

    pytest benchmarks/bench_hf.py --benchmark-only

As a script (best of ``--rounds`` interleaved runs, process CPU seconds, one torch thread)::

    python benchmarks/bench_hf.py [--rounds R] [--profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvevict.adapters.hf import PagedCache, SessionStore  # noqa: E402

cpu_time = time.process_time
#: Model sizes: (hidden, layers, heads, kv heads). "tiny" is the test models' scale.
SIZES = {"tiny": (64, 2, 4, 2), "small": (256, 4, 8, 2)}
PROMPT, NEW_TOKENS = 64, 64


@lru_cache(maxsize=4)
def get_model(size: str = "tiny") -> LlamaForCausalLM:
    hidden, layers, heads, kv_heads = SIZES[size]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=1024)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
    return model


def prompts(batch: int, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, length), generator=gen)


def run_generate(model, cache, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                          max_new_tokens=NEW_TOKENS, do_sample=False)


CACHES: dict[str, Callable[[Any], Any]] = {
    "DynamicCache": lambda model: DynamicCache(config=model.config),
    "PagedCache": lambda model: PagedCache(model),
}

# -- the session mix ---------------------------------------------------------------------------


def session_mix(sessions: int = 6, turns: int = 4, system: int = 32, seed: int = 0
                ) -> list[tuple[int, torch.Tensor]]:
    """``(session, user message)`` in arrival order: round-robin over the sessions, messages
    of 8 to 23 tokens; every session's first message follows the same system prompt."""
    gen = torch.Generator().manual_seed(seed)
    system_ids = torch.randint(3, 512, (1, system), generator=gen)
    mix = []
    for turn in range(turns):
        for s in range(sessions):
            n = int(torch.randint(8, 24, (1,), generator=gen))
            message = torch.randint(3, 512, (1, n), generator=gen)
            mix.append((s, torch.cat([system_ids, message], 1) if turn == 0 else message))
    return mix


def replay_sessions(model, mix, store: SessionStore | None, answer: int = 8
                    ) -> tuple[list[torch.Tensor], int]:
    """Run every turn; return the answers and the prompt tokens prefilled. Without a store each
    turn recomputes the whole conversation with a fresh DynamicCache."""
    conversations: dict[int, torch.Tensor] = {}
    answers, prefilled = [], 0
    for session, message in mix:
        previous = conversations.get(session)
        ids = message if previous is None else torch.cat([previous, message], 1)
        if store is None:
            out = model.generate(ids, cache=DynamicCache(config=model.config),
                                 max_new_tokens=answer, do_sample=False)
            prefilled += ids.shape[1]
        else:
            with store.cache_for(session, ids) as cache:
                out = model.generate(ids, cache=cache, max_new_tokens=answer, do_sample=False)
            prefilled += ids.shape[1] - cache.reused_tokens
        conversations[session] = out
        answers.append(out[:, ids.shape[1]:])
    return answers, prefilled


def make_store(model, num_blocks: int) -> SessionStore:
    return SessionStore(model, num_blocks=num_blocks, block_size=16, policy="lru")


# -- pytest ------------------------------------------------------------------------------------


def test_paged_and_dynamic_generate_the_same_tokens() -> None:
    model, ids = get_model(), prompts(2)
    outs = [run_generate(model, make(model), ids) for make in CACHES.values()]
    assert torch.equal(*outs)


def test_sessions_save_prefill_without_changing_answers() -> None:
    model, mix = get_model(), session_mix(sessions=3, turns=3)
    ref, recomputed = replay_sessions(model, mix, None)
    got, prefilled = replay_sessions(model, mix, make_store(model, 256))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert prefilled < recomputed / 2


def _bench_generate(benchmark, name: str) -> None:
    model, ids = get_model(), prompts(1)

    def setup():  # a fresh cache every round
        return (model, CACHES[name](model), ids), {}

    out = benchmark.pedantic(run_generate, setup=setup, rounds=5, iterations=1)
    assert out.shape == (1, PROMPT + NEW_TOKENS)


@pytest.mark.benchmark(group="hf-generate")
def test_generate_dynamic_cache(benchmark) -> None:
    _bench_generate(benchmark, "DynamicCache")


@pytest.mark.benchmark(group="hf-generate")
def test_generate_paged_cache(benchmark) -> None:
    _bench_generate(benchmark, "PagedCache")


def _bench_sessions(benchmark, with_store: bool) -> None:
    model, mix = get_model(), session_mix()

    def setup():
        return (model, mix, make_store(model, 256) if with_store else None), {}

    _, prefilled = benchmark.pedantic(replay_sessions, setup=setup, rounds=3, iterations=1)
    benchmark.extra_info["prefilled_tokens"] = prefilled


@pytest.mark.benchmark(group="hf-sessions")
def test_sessions_recompute_every_turn(benchmark) -> None:
    _bench_sessions(benchmark, with_store=False)


@pytest.mark.benchmark(group="hf-sessions")
def test_sessions_store(benchmark) -> None:
    _bench_sessions(benchmark, with_store=True)


# -- script ------------------------------------------------------------------------------------


def best_of(rounds: int, runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Best process CPU time of each run over ``rounds`` interleaved rounds."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, run in runs.items():
            start = cpu_time()
            run()
            best[name] = min(best[name], cpu_time() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of one PagedCache generate()")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    print(f"generate(): prompt {PROMPT}, {NEW_TOKENS} new tokens, greedy, fp32 CPU, "
          f"{args.threads} thread(s), best of {args.rounds} (process CPU seconds)")
    print(f"{'model':<8}{'batch':>6}{'DynamicCache s':>16}{'PagedCache s':>14}{'ratio':>8}")
    worst = 0.0
    for size in SIZES:
        model = get_model(size)
        for batch in (1, 4):
            ids = prompts(batch)
            outs = [run_generate(model, make(model), ids) for make in CACHES.values()]
            assert torch.equal(*outs), "PagedCache changed the generated tokens"
            best = best_of(args.rounds, {
                name: (lambda make=make, model=model, ids=ids: run_generate(model, make(model),
                                                                            ids))
                for name, make in CACHES.items()})
            ratio = best["PagedCache"] / best["DynamicCache"]
            worst = max(worst, ratio)
            print(f"{size:<8}{batch:>6}{best['DynamicCache']:>16.3f}{best['PagedCache']:>14.3f}"
                  f"{ratio:>7.2f}x")
    print(f"worst PagedCache / DynamicCache = {worst:.2f}x (target <= 1.3x): "
          f"{'OK' if worst <= 1.3 else 'ABOVE TARGET'}")

    model, mix = get_model("tiny"), session_mix()
    total = sum(m.shape[1] for _, m in mix)
    print(f"\nsession mix: 6 sessions x 4 turns round-robin, shared 32-token system prompt, "
          f"8-token answers, {total} new user tokens; block size 16, LRU")
    print(f"{'run':<34}{'prefilled':>10}{'saved':>8}{'CPU s':>8}{'vs recompute':>14}")
    runs = {"recompute every turn (Dynamic)": None, "SessionStore, 256 blocks": 256,
            "SessionStore, 16 blocks (evicts)": 16}
    results = {}
    for name, blocks in runs.items():
        best, prefilled = float("inf"), 0
        for _ in range(max(1, args.rounds // 2)):
            store = None if blocks is None else make_store(model, blocks)
            start = cpu_time()
            answers, prefilled = replay_sessions(model, mix, store)
            best = min(best, cpu_time() - start)
        results[name] = (prefilled, best, answers)
    base_tokens, base_time, base_answers = results["recompute every turn (Dynamic)"]
    for name, (prefilled, seconds, answers) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(answers, base_answers))
        print(f"{name:<34}{prefilled:>10}{1 - prefilled / base_tokens:>8.0%}{seconds:>8.2f}"
              f"{seconds / base_time:>13.2f}x")

    if args.profile:
        import cProfile
        import pstats

        model, ids = get_model("tiny"), prompts(1)
        profiler = cProfile.Profile()
        profiler.runcall(run_generate, model, PagedCache(model), ids)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
