"""Engine decode step versus transformers with ``DynamicCache``; TTFT with a cached prefix.

**Decode.** One model, two runtimes on the same weights: a random ``LlamaForCausalLM`` (hidden
512, 4 layers, 8 query / 2 KV heads of 64, MLP 1408, vocab 4096: big enough that the matrix
multiplies and the attention over the context, not Python, dominate a step) and the engine
loaded from it (`kvevict.engine.hf.from_hf`). Both start from the same ``context`` tokens of
K/V per sequence (random values, written into the engine's `BlockPool` blocks through a
`KVCacheManager` and into a transformers ``DynamicCache``), then decode greedily. One engine
step = ``manager.append`` of each sequence's token + ``forward_paged`` (batched) + argmax; one
transformers step = the model's forward with the cache (no padding mask, explicit
``position_ids``, ``inference_mode``: its fastest path) + argmax. The first step's logits of
the two must agree (fp32, 1e-4), so both compute the same thing. Reported: milliseconds per
step (best of many short interleaved rounds) and the ratio engine / transformers (median over
rounds of two rounds run back to back, which see about the same load from other work on a
shared machine). Target: <= 1.5x on CPU.

**TTFT.** A ``context``-token prompt whose first 90% (whole blocks) is cached in the pool from
an earlier turn, versus the same length cold: wall time of ``begin`` + ``forward_paged`` of the
uncached tokens + argmax. The ratio warm / cold should approach the uncached fraction (~0.1).

As pytest-benchmark tests (groups ``engine-decode`` and ``engine-ttft``)::

    pytest benchmarks/bench_engine.py --benchmark-only
    KVEVICT_BENCH_ENGINE_CONTEXTS=512 pytest benchmarks/bench_engine.py --benchmark-only

As a script (a table; ~2 minutes on 2 cores)::

    python benchmarks/bench_engine.py [--contexts 512,2048] [--batches 1,8] [--steps 4]
                                      [--rounds 20] [--ttft-rounds 8] [--threads N]
                                      [--profile]

Needs transformers (``pip install "kvevict[hf]"``); skipped without it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import kvevict  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvevict import BlockPool, KVCacheManager, Request
from kvevict.engine import LlamaModel
from kvevict.engine.hf import from_hf

BLOCK = 16
HF_SIZES = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, bos_token_id=None,
                eos_token_id=None, pad_token_id=0)
CONTEXTS = tuple(int(c) for c in os.environ.get("KVEVICT_BENCH_ENGINE_CONTEXTS",
                                                "512,2048").split(","))
BATCHES = (1, 8)
CACHED_FRACTION = 0.9
#: wall time: torch runs matrix multiplies on several threads, which process CPU time would
#: add up; rounds are short and interleaved, to damp other load on the machine
timer = time.perf_counter


@lru_cache(maxsize=1)
def models() -> tuple[Any, LlamaModel]:
    """The transformers model (random, seeded) and the engine loaded from it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than the default init, so greedy tokens are well separated
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return hf, from_hf(hf)


class DecodeCase:
    """``batch`` sequences with ``context`` tokens of identical K/V in the engine's pool and in
    a transformers ``DynamicCache``, each side decoding its own greedy continuation."""

    def __init__(self, batch: int, context: int, max_steps: int = 256, seed: int = 0) -> None:
        import transformers

        self.hf, self.model = models()
        cfg = self.model.config
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = -(-(context + max_steps) // BLOCK)
        self.pool = BlockPool(batch * blocks_per_seq + 1, BLOCK, cfg.layout(), device="cpu")
        self.manager = KVCacheManager(self.pool, "lru")
        self.seqs = []
        for b in range(batch):
            tokens = torch.randint(0, cfg.vocab_size, (context,), generator=gen)
            self.seqs.append(self.manager.begin(Request(f"s{b}", tokens=tokens.tolist())))
        self.cache = transformers.DynamicCache(config=self.hf.config)
        shape = (batch, cfg.num_kv_heads, context, cfg.head_dim)
        kv = self.pool.kv
        assert kv is not None
        for layer in range(cfg.num_layers):
            k = torch.randn(shape, generator=gen)
            v = torch.randn(shape, generator=gen)
            self.cache.update(k, v, layer)
            for b, seq in enumerate(self.seqs):
                pos = torch.arange(context)
                slots = torch.tensor(seq.block_table)[pos // BLOCK] * BLOCK + pos % BLOCK
                kv[layer, 0].view(-1, cfg.num_kv_heads, cfg.head_dim)[slots] = \
                    k[b].transpose(0, 1)
                kv[layer, 1].view(-1, cfg.num_kv_heads, cfg.head_dim)[slots] = \
                    v[b].transpose(0, 1)
        first = torch.randint(0, cfg.vocab_size, (batch,), generator=gen)
        self.engine_tokens = [first.tolist()]  # token fed at each step, per sequence
        self.hf_tokens = [first.tolist()]
        self.hf_position = context
        self.max_steps = max_steps

    def engine_step(self) -> torch.Tensor:
        tokens = self.engine_tokens[-1]
        for seq, token in zip(self.seqs, tokens):
            self.manager.append(seq.seq_id, [token])
        logits = self.model.forward_paged(self.pool, [
            (torch.tensor([token]), seq.num_tokens - 1, seq.block_table)
            for seq, token in zip(self.seqs, tokens)
        ])
        self.engine_tokens.append(logits.argmax(-1).tolist())
        return logits

    def hf_step(self) -> torch.Tensor:
        batch = len(self.hf_tokens[-1])
        with torch.inference_mode():
            out = self.hf(input_ids=torch.tensor(self.hf_tokens[-1])[:, None], cache=self.cache,
                          position_ids=torch.full((batch, 1), self.hf_position),
                          use_cache=True)
        self.hf_position += 1
        logits = out.logits[:, -1].float()
        self.hf_tokens.append(logits.argmax(-1).tolist())
        return logits

    def check_first_step(self) -> float:
        """Run one step on each side; return the max logit difference (must be ~0)."""
        return float((self.engine_step() - self.hf_step()).abs().max())

    def agreement(self) -> float:
        """Fraction of decoded tokens both sides chose alike (over common steps)."""
        n = min(len(self.engine_tokens), len(self.hf_tokens))
        same = sum(a == b for e, h in zip(self.engine_tokens[:n], self.hf_tokens[:n])
                   for a, b in zip(e, h))
        return same / (n * len(self.engine_tokens[0]))


def time_decode(batch: int, context: int, steps: int, rounds: int) -> dict[str, float]:
    """Seconds per step of each side: the best of ``rounds`` interleaved rounds of ``steps``
    steps, and the median over rounds of the ratio engine / transformers of the two rounds
    run back to back (both see about the same load from other work on the machine)."""
    case = DecodeCase(batch, context, max_steps=(rounds + 1) * steps + 2)
    diff = case.check_first_step()
    if diff > 1e-4:
        raise AssertionError(f"engine and transformers disagree on the first step: max logit "
                             f"difference {diff}")
    for _ in range(2):  # warm-up
        case.engine_step()
        case.hf_step()
    times: dict[str, list[float]] = {"engine": [], "transformers": []}
    for _ in range(rounds):
        for name, step in (("engine", case.engine_step), ("transformers", case.hf_step)):
            gc.collect()
            start = timer()
            for _ in range(steps):
                step()
            times[name].append((timer() - start) / steps)
    return {"engine": min(times["engine"]), "transformers": min(times["transformers"]),
            "ratio": statistics.median(e / t for e, t in zip(*times.values())),
            "agreement": case.agreement(), "first_step_diff": diff}


class TTFTCase:
    """A manager whose pool holds the first 90% (whole blocks) of a ``context``-token prefix."""

    def __init__(self, context: int, reps: int, seed: int = 1) -> None:
        _, self.model = models()
        cfg = self.model.config
        self.gen = torch.Generator().manual_seed(seed)
        self.context = context
        self.cached = int(context * CACHED_FRACTION) // BLOCK * BLOCK
        blocks = -(-context // BLOCK)
        self.pool = BlockPool(blocks * (2 * reps + 4), BLOCK, cfg.layout(), device="cpu")
        self.manager = KVCacheManager(self.pool, "lru")
        self.prefix = self.random(self.cached)
        self.turn(self.prefix, "turn-1")  # computes and caches the prefix
        self.count = 0

    def random(self, n: int) -> list[int]:
        return torch.randint(0, self.model.config.vocab_size, (n,), generator=self.gen).tolist()

    def turn(self, prompt: list[int], request_id: str) -> tuple[float, int]:
        """TTFT of one turn (begin + prefill of the uncached rest + argmax) and the tokens
        computed; the turn is then finished."""
        start = timer()
        seq = self.manager.begin(Request(request_id, tokens=prompt))
        rest = prompt[seq.num_hit_slots:]
        logits = self.model.forward_paged(self.pool, [(torch.tensor(rest), seq.num_hit_slots,
                                                        seq.block_table)])
        int(logits[0].argmax())
        elapsed = timer() - start
        self.manager.finish(seq.seq_id)
        return elapsed, len(rest)

    def warm(self) -> tuple[float, int]:
        self.count += 1  # a new suffix each time: only the shared 90% is cached
        return self.turn(self.prefix + self.random(self.context - self.cached),
                         f"warm-{self.count}")

    def cold(self) -> tuple[float, int]:
        self.count += 1
        return self.turn(self.random(self.context), f"cold-{self.count}")


def time_ttft(context: int, rounds: int) -> dict[str, float]:
    """Best warm and cold TTFT over ``rounds`` interleaved pairs, and the median over pairs
    of the ratio warm / cold."""
    case = TTFTCase(context, reps=rounds + 1)
    case.warm()
    case.cold()  # warm-up
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    computed = {}
    for _ in range(rounds):
        for name, run in (("warm", case.warm), ("cold", case.cold)):
            gc.collect()
            seconds, computed[name] = run()
            times[name].append(seconds)
    assert computed == {"warm": context - case.cached, "cold": context}, computed
    case.manager.check()
    return {"warm": min(times["warm"]), "cold": min(times["cold"]),
            "ratio": statistics.median(w / c for w, c in zip(*times.values())),
            "uncached_fraction": (context - case.cached) / context}


# -- pytest ------------------------------------------------------------------------------------


def test_engine_and_transformers_agree_on_the_benchmark_model() -> None:
    """The decode comparison is apples to apples: same logits from the same cache."""
    case = DecodeCase(batch=3, context=40, max_steps=8)
    assert case.check_first_step() < 1e-4
    for _ in range(5):
        case.engine_step()
        case.hf_step()
    assert case.agreement() == 1.0


@cache
def decode_case(batch: int, context: int) -> DecodeCase:
    return DecodeCase(batch, context, max_steps=4096)


@pytest.mark.benchmark(group="engine-decode")
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("runtime", ["engine", "transformers"])
def test_decode_step(benchmark, runtime: str, batch: int, context: int) -> None:
    case = decode_case(batch, context)
    step = case.engine_step if runtime == "engine" else case.hf_step
    benchmark.extra_info.update(batch=batch, context=context)
    benchmark.pedantic(step, rounds=20, iterations=1, warmup_rounds=2)


@pytest.mark.benchmark(group="engine-ttft")
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kind", ["warm", "cold"])
def test_ttft(benchmark, kind: str, context: int) -> None:
    case = TTFTCase(context, reps=8)
    run = case.warm if kind == "warm" else case.cold
    benchmark.extra_info.update(context=context, cached_tokens=case.cached if kind == "warm"
                                else 0)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)


# -- script ------------------------------------------------------------------------------------


def profile_engine_decode(batch: int, context: int, steps: int = 20, top: int = 20) -> None:
    import cProfile
    import pstats

    case = DecodeCase(batch, context, max_steps=steps + 2)
    case.engine_step()
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [case.engine_step() for _ in range(steps)])
    print(f"\n--- cProfile: {steps} engine decode steps, batch {batch}, context {context} ---")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--steps", type=int, default=4, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=20,
                        help="interleaved decode rounds (short ones: load bursts hit fewer)")
    parser.add_argument("--ttft-rounds", type=int, default=8, help="warm/cold TTFT pairs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice); 1 is the most stable "
                        "on a machine shared with other work")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the engine's decode (largest case)")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("bench_engine.py needs transformers: pip install 'kvevict[hf]'")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    hf, model = models()
    c = model.config
    print(f"model: hidden {c.hidden_size}, {c.num_layers} layers, {c.num_heads} query / "
          f"{c.num_kv_heads} KV heads of {c.head_dim}, MLP {c.intermediate_size}, vocab "
          f"{c.vocab_size}, {c.dtype}; torch {torch.__version__} on {torch.get_num_threads()} "
          f"threads; block size {BLOCK}")

    print(f"\ndecode step (ms, best of {args.rounds} interleaved rounds of {args.steps} steps; "
          "ratio: median over rounds of engine / transformers run back to back)")
    print(f"{'batch':>6}{'context':>9}{'engine':>10}{'transformers':>14}{'ratio':>8}"
          f"{'same tokens':>13}")
    worst = 0.0
    for context in contexts:
        for batch in batches:
            r = time_decode(batch, context, args.steps, args.rounds)
            ratio = r["ratio"]
            worst = max(worst, ratio)
            print(f"{batch:>6}{context:>9}{r['engine'] * 1e3:>10.2f}"
                  f"{r['transformers'] * 1e3:>14.2f}{ratio:>7.2f}x{r['agreement']:>13.0%}")
    print(f"worst engine / transformers = {worst:.2f}x (target <= 1.5x): "
          f"{'OK' if worst <= 1.5 else 'ABOVE TARGET'}")

    print(f"\nTTFT (ms, best of {args.ttft_rounds}; ratio: median of warm / cold pairs): a prompt "
          f"with its first {CACHED_FRACTION:.0%} (whole blocks) cached, versus cold")
    print(f"{'context':>8}{'warm':>10}{'cold':>10}{'ratio':>8}{'uncached':>10}")
    for context in contexts:
        r = time_ttft(context, args.ttft_rounds)
        print(f"{context:>8}{r['warm'] * 1e3:>10.2f}{r['cold'] * 1e3:>10.2f}"
              f"{r['ratio']:>8.3f}{r['uncached_fraction']:>10.3f}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.profile:
        profile_engine_decode(max(batches), max(contexts))


if __name__ == "__main__":
    main()
