"""Token eviction on the judge kvevict ships: keep 15% of a 1,024-token context, then answer.

The judge (`kvevict.judge`) is a small Llama trained here on recall, needle and variable
tracking; its answers sit in a few tokens far back. Each policy is built by name with
`make_token_policy` and runs in transformers' ``generate()`` through `PagedCache`, keeping 15%
of the context at every step: a recency window (StreamingLLM), the learned token scorer
(LKV-T) and the learned per-head budgets (LKV-H, head-granular). Then LKV-H, by name, answers
one question in ``generate()`` and in kvevict's engine, the prompt in one forward in both.

Run: python examples/token_eviction.py   (needs: pip install "kvevict[hf]")
"""

from __future__ import annotations

import torch

from kvevict.adapters.hf import PagedCache
from kvevict.engine import run_engine
from kvevict.engine.hf import from_hf
from kvevict.judge import JUDGE_DIR, budget_for, judge_accuracy, load_judge
from kvevict.scheduler import SchedulerConfig
from kvevict.tokens import ScorerShape, make_token_policy
from kvevict.tokens.tasks import TASKS, make_items
from kvevict.types import Request

FRACTION = 0.15  # of the context's tokens, in every layer


def policies(judge) -> dict[str, tuple[str | None, dict]]:
    """Name -> (registered token policy, its parameters); None is the full cache."""
    shape = ScorerShape.of(judge)
    return {
        "full cache": (None, {}),
        "streamingllm": ("streamingllm", {}),
        "lkv_t": ("lkv_t", {"scorer": JUDGE_DIR / "lkv_t.safetensors", "shape": shape}),
        "lkv_h": ("lkv_h", {"scorer": JUDGE_DIR / "lkv_h_scorer.safetensors",
                            "budgets": JUDGE_DIR / "lkv_h.safetensors", "shape": shape}),
    }


def main(items: int = 8) -> dict[str, dict[str, float]]:
    """Exact match per policy and task on ``items`` questions per task (evaluation seed 0);
    prints the table and the engine's LKV-H answer to one needle question."""
    judge = load_judge()
    sets = {task: make_items(task, items, length=1024, seed=0) for task in TASKS}
    table: dict[str, dict[str, float]] = {}
    print(f"exact match, {items} questions per task, {FRACTION:.0%} of the context kept")
    print(f"{'policy':<14}" + "".join(f"{t:>10}" for t in TASKS))
    for name, (policy, params) in policies(judge).items():
        table[name] = {task: judge_accuracy(judge, its, policy, fraction=FRACTION, **params)
                       for task, its in sets.items()}
        print(f"{name:<14}" + "".join(f"{table[name][t]:>10.3f}" for t in TASKS))

    # the same learned policy, by name, in generate() and in the engine: the whole prompt in
    # one forward (one prefill chunk), then the answer, 15% kept after every forward
    item = sets["needle"][0]
    prompt = torch.tensor([item.prompt])
    budget = budget_for(FRACTION, len(item.context))
    _, params = policies(judge)["lkv_h"]
    cache = PagedCache(judge, token_policy=make_token_policy("lkv_h", budget, **params))
    with torch.no_grad():
        out = judge.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                             do_sample=False, max_new_tokens=len(item.answer))
    engine = run_engine([Request("q", tokens=list(item.prompt), output_len=len(item.answer))],
                        from_hf(judge), capacity_blocks=80, block_size=16,
                        config=SchedulerConfig(max_num_batched_tokens=2048),
                        token_policy="lkv_h", token_budget=budget,
                        token_params={k: v for k, v in params.items() if k != "shape"})
    print(f"needle, lkv_h keeping {budget} tokens: expected {list(item.answer)}, generate() "
          f"{out[0, prompt.shape[1]:].tolist()}, engine {list(engine.answers['q'])}")
    return table


if __name__ == "__main__":
    main()
