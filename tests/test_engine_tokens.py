"""Token eviction in the built-in engine, checked against exact references.

- With a budget at the longest sequence length, every training-free token policy gives the
  tokens and logits of the engine without one, bit for bit, with the same prefix hits.
- The engine and the Hugging Face adapter (`PagedCache` in ``generate()``), with the same
  policy and budget on the same tiny random Llama, keep the same positions in every layer and
  generate the same greedy tokens; the learned policies' parameters load from a file in both.
- A compacted sequence's blocks are never hit: a later request with the same prompt
  recomputes it (exact counts), and the blocks past the budget go back to the pool.
- The manager's invariants hold after every step, preemptions included.
- Bad input is a `ConfigError`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_clock import fake_timer

from kvevict.engine import LlamaModel, ModelConfig, run_engine
from kvevict.engine.executor import EngineExecutor
from kvevict.engine.tokens import TokenEviction
from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.scheduler import Scheduler, SchedulerConfig
from kvevict.tokens import H2O, KVScorer, ScorerShape, make_token_policy
from kvevict.tokens.learned import save_scorer
from kvevict.types import ManualClock, Request

BLOCK = 4
VOCAB = 64
ONE_CHUNK = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8)
#: the policies that need no trained file, with parameters that fit small budgets
HEURISTICS = {"streamingllm": {"n_sink": 2}, "knorm": {}, "h2o": {},
              "snapkv": {"window_size": 4}, "tova": {}, "ema": {}}



@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64)
    return LlamaModel(config, seed=0)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def shared_prefix_requests() -> list[Request]:
    """Three requests sharing a 24-token prefix, arriving together (so some decode while
    others prefill), then one repeating the first prompt after they finished (a full hit)."""
    head = tokens(24, 0)
    prompts = [np.concatenate([head, tokens(k, k)]) for k in (6, 11, 3)]
    reqs = [Request(f"r{i}", tokens=p, output_len=9, arrival=0.01 * i)
            for i, p in enumerate(prompts)]
    return reqs + [Request("again", tokens=prompts[0], output_len=9, arrival=1e3)]


def longest(requests: list[Request]) -> int:
    """The most tokens a request stores: its prompt and every decode but the last."""
    return max(r.prompt_len + r.output_len - 1 for r in requests)


# -- (1) a budget at the sequence length changes nothing -------------------------------------


@pytest.mark.parametrize("name", sorted(HEURISTICS))
def test_budget_at_the_sequence_length_is_token_identical(model, name):
    requests = shared_prefix_requests()
    base = run_engine(requests, model, capacity_blocks=64, block_size=BLOCK, check=True,
                      config=ONE_CHUNK, timer=fake_timer())
    got = run_engine(requests, model, capacity_blocks=64, block_size=BLOCK, check=True,
                     config=ONE_CHUNK, token_policy=name, token_budget=longest(requests),
                     token_params=HEURISTICS[name], timer=fake_timer())
    assert got.answers == base.answers
    assert got.top_logits == base.top_logits  # bit for bit: nothing was rewritten
    assert got.engine_prefill_tokens == base.engine_prefill_tokens
    assert [r.cached_tokens for r in got.sim.records] == \
        [r.cached_tokens for r in base.sim.records] == [0, 24, 24, 28]
    assert got.engine["token_compactions"] == got.engine["token_freed_blocks"] == 0
    # every token stays, at its own position
    assert got.token_positions["r1"] == (tuple(range(35 + 8)),) * 2


def test_one_token_over_the_budget_makes_the_longest_request_uncacheable(model):
    requests = shared_prefix_requests()
    got = run_engine(requests, model, capacity_blocks=64, block_size=BLOCK, check=True,
                     config=ONE_CHUNK, token_policy="knorm",
                     token_budget=longest(requests) - 1)
    # r1 (35 + 8 tokens) may exceed the budget: it neither hits the shared prefix nor is cut
    # more than once (its last decode); the others are untouched
    assert [r.cached_tokens for r in got.sim.records] == [0, 0, 24, 28]
    assert got.engine_prefill_tokens == {"r0": 30, "r1": 35, "r2": 3, "again": 2}
    assert got.engine["token_compactions"] == 1 and got.engine["token_dropped"] == 1
    assert [len(p) for p in got.token_positions["r1"]] == [longest(requests) - 1] * 2


# -- (2) the engine and the Hugging Face adapter agree ---------------------------------------


HF_SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                eos_token_id=None, pad_token_id=0)
PROMPT, NEW, BUDGET = 40, 10, 16


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    from kvevict.engine.hf import from_hf

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter random, norms around 1
        for name, p in hf.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if "norm" in name else noise)
    return hf.eval(), from_hf(hf)


def scorer(shape: ScorerShape, per_head: bool) -> KVScorer:
    torch.manual_seed(5)
    return KVScorer(shape, 16, per_head=per_head).eval()


def hf_run(hf, ids: torch.Tensor, policy) -> tuple[list[int], list[list[int]]]:
    from kvevict.adapters.hf import PagedCache

    cache = PagedCache(hf, token_policy=policy)
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], cache=cache,
                          do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    return out[0, len(ids):].tolist(), [layer.positions[0].tolist() for layer in cache.layers]


def engine_run(model, ids: torch.Tensor, **token) -> tuple[list[int], list[list[int]]]:
    result = run_engine([Request("a", tokens=ids.numpy(), output_len=NEW)], model,
                        capacity_blocks=64, block_size=BLOCK, check=True, config=ONE_CHUNK,
                        **token)
    kept = result.token_positions
    return list(result.answers["a"]), [] if kept is None else [list(p) for p in kept["a"]]


@pytest.mark.parametrize("name", [*sorted(HEURISTICS), "lkv_t", "kvp"])
def test_engine_keeps_the_positions_and_tokens_of_paged_cache(llama, name, tmp_path):
    hf, model = llama
    ids = torch.randint(1, HF_SIZES["vocab_size"], (PROMPT,),
                        generator=torch.Generator().manual_seed(3))
    shape = ScorerShape.of(hf)
    if name == "lkv_t":  # parameters from a file, in both
        path = tmp_path / "lkv_t.safetensors"
        save_scorer(scorer(shape, per_head=False), path, method="lkv_t")
        hf_policy = make_token_policy("lkv_t", budget=BUDGET, scorer=path, shape=shape)
        token = {"token_policy": "lkv_t", "token_budget": BUDGET,
                 "token_params": {"scorer": path}}  # the engine supplies the shape
    elif name == "kvp":
        hf_policy = make_token_policy("kvp", budget=BUDGET, scorer=scorer(shape, True))
        token = {"token_policy": make_token_policy("kvp", budget=BUDGET,
                                                   scorer=scorer(shape, True))}
    else:
        hf_policy = make_token_policy(name, budget=BUDGET, **HEURISTICS[name])
        token = {"token_policy": name, "token_budget": BUDGET,
                 "token_params": HEURISTICS[name]}
    want_tokens, want_positions = hf_run(hf, ids, hf_policy)
    got_tokens, got_positions = engine_run(model, ids, **token)
    assert [len(p) for p in want_positions] == [BUDGET, BUDGET]
    assert got_positions == want_positions
    assert got_tokens == want_tokens


def test_the_policies_change_the_answer_and_layers_choose_apart(llama):
    hf, model = llama
    ids = torch.randint(1, HF_SIZES["vocab_size"], (PROMPT,),
                        generator=torch.Generator().manual_seed(3))
    full, _ = engine_run(model, ids)
    answers, apart = {}, []
    for name, params in HEURISTICS.items():
        answers[name], positions = engine_run(model, ids, token_policy=name,
                                              token_budget=BUDGET, token_params=params)
        if positions[0] != positions[1]:
            apart.append(name)
    # measured: every policy changes the greedy answer of this random model (so the
    # agreement with the adapter is not that of two full caches), and the score-based ones
    # keep different tokens in the two layers
    assert sorted(n for n, a in answers.items() if a != full) == sorted(HEURISTICS)
    assert sorted(apart) == ["ema", "h2o", "knorm", "snapkv", "tova"]


# -- (3) compacted blocks are never hit ------------------------------------------------------


def test_a_compacted_sequence_is_never_hit_and_frees_its_blocks(model):
    prompt = tokens(40, 7)
    requests = [Request("first", tokens=prompt, output_len=8),
                Request("second", tokens=prompt, output_len=8, arrival=1e3),
                Request("short", tokens=prompt[:12], output_len=2, arrival=2e3),
                Request("short2", tokens=prompt[:12], output_len=2, arrival=3e3)]
    plain = run_engine(requests, model, capacity_blocks=64, block_size=BLOCK, check=True,
                       config=ONE_CHUNK)
    assert [r.cached_tokens for r in plain.sim.records] == [0, 40, 12, 12]  # it can fail
    got = run_engine(requests, model, capacity_blocks=64, block_size=BLOCK, check=True,
                     config=ONE_CHUNK, token_policy="snapkv", token_budget=16,
                     token_params={"window_size": 4})
    # the 40-token prompts are compacted, hence uncacheable: the second recomputes all 40;
    # "short" (12 + 1 tokens) fits the budget and is cached, but nothing of the compacted
    # first request was: it hits nothing, and "short2" hits its 3 full blocks
    assert [r.cached_tokens for r in got.sim.records] == [0, 0, 0, 12]
    assert got.engine_prefill_tokens == {"first": 40, "second": 40, "short": 12, "short2": 1}
    assert got.engine["peeks"] == 1  # short2's fully cached prompt: its last token, run once
    assert got.answers["first"] == got.answers["second"]  # no cache state in the answer
    # per long request: the prefill's 10 blocks cut to 4 (6 freed), then every one of the 7
    # decodes opens a fifth block and gives it back
    assert got.engine["token_compactions"] == 2 * 8
    assert got.engine["token_freed_blocks"] == 2 * (6 + 7)
    assert got.engine["token_dropped"] == 2 * (24 + 7)
    assert (got.memory["peak_pool_blocks"], plain.memory["peak_pool_blocks"]) == (10, 12)


def test_compacted_kv_is_the_kept_tokens_kv(model):
    """After the prefill, slot ``i`` of layer ``l`` holds the K/V a full prefill computed for
    the ``i``-th kept position of that layer."""
    prompt = tokens(30, 9)
    pool = BlockPool(32, BLOCK, model.config.layout(), device="cpu")
    clock = ManualClock()
    executor = EngineExecutor(model, pool, clock, token_policy="knorm", token_budget=10)
    manager = KVCacheManager(pool, "lru", clock=clock, uncacheable=executor.uncacheable)
    scheduler = Scheduler(manager, executor, ONE_CHUNK)
    scheduler.add(Request("a", tokens=prompt, output_len=3))
    scheduler.step()  # the prefill, then the cut
    seq = manager.sequence("a")
    assert (seq.num_tokens, seq.num_dropped, seq.num_slots, len(seq.block_table)) == \
        (30, 20, 10, 3)
    full = BlockPool(8, BLOCK, model.config.layout(), device="cpu")
    table = [full.allocate() for _ in range(8)]
    model.forward_paged(full, [(torch.as_tensor(prompt), 0, table)])
    c = model.config
    for li, kept in enumerate(executor.kept_positions("a")):
        assert len(kept) == 10
        got = pool.kv[li].index_select(1, torch.tensor(seq.block_table)).reshape(
            2, -1, c.num_kv_heads, c.head_dim)[:, :10]
        want = full.kv[li].reshape(2, -1, c.num_kv_heads, c.head_dim)[:, list(kept)]
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- (4) invariants --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_invariants_hold_with_compaction_and_preemption(model, name):
    requests = [Request(f"r{i}", tokens=tokens(30 + 3 * i, 20 + i), output_len=12,
                        arrival=0.001 * i) for i in range(5)]
    budget = 12

    def bounded(scheduler):
        for seq in scheduler.manager.sequences.values():
            if seq.status == "running" and not seq.cacheable:
                assert seq.num_slots <= budget
                assert len(seq.block_table) == -(-seq.num_slots // BLOCK)

    # a small pool and 16-token prefill chunks (each chunk is cut to the budget in turn)
    got = run_engine(requests, model, capacity_blocks=14, block_size=BLOCK, check=True,
                     config=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=5),
                     token_policy=name, token_budget=budget,
                     token_params=HEURISTICS[name], on_step=bounded)
    assert sum(r.preemptions for r in got.sim.records) > 0  # resumes recompute from slot 0
    assert all(len(got.answers[r.request_id]) == 12 for r in requests)
    assert all(len(p) == budget for r in requests for p in got.token_positions[r.request_id])


def test_manager_compact(model):
    pool = BlockPool(16, BLOCK, model.config.layout(), device="cpu")
    manager = KVCacheManager(pool, "lru", uncacheable=lambda r: r.request_id != "kept")
    seq = manager.begin(Request("cut", tokens=tokens(14, 1), output_len=4))
    kept = manager.begin(Request("kept", tokens=tokens(8, 2), output_len=1))
    assert (seq.cacheable, kept.cacheable) == (False, True)
    assert manager.num_cached_blocks == 2  # only "kept"'s full blocks
    table = list(seq.block_table)
    assert manager.compact("cut", 6) == table[2:]
    assert (seq.num_tokens, seq.num_dropped, seq.num_slots) == (14, 8, 6)
    assert seq.block_table == table[:2] and pool.num_free == 16 - 2 - 2
    manager.check()
    # slots 6..8: a third block, the last one released (handed out first)
    assert manager.append("cut", [5, 6, 7]) == [table[2]]
    assert (seq.num_tokens, seq.num_slots, len(seq.block_table)) == (17, 9, 3)
    manager.check()
    manager.preempt("cut")
    resumed = manager.resume("cut")
    assert (resumed.num_dropped, resumed.num_slots, len(resumed.block_table)) == (0, 17, 5)
    manager.check()
    with pytest.raises(ConfigError, match="cacheable"):
        manager.compact("kept", 4)
    with pytest.raises(ConfigError, match=r"num_slots must be an int in \[0, 17\]"):
        manager.compact("cut", 18)


# -- (5) bad input ---------------------------------------------------------------------------


def test_bad_input_is_a_config_error(model, llama, tmp_path):
    ok = [Request("a", tokens=tokens(8, 0), output_len=2)]
    run = dict(capacity_blocks=16, block_size=BLOCK)
    with pytest.raises(ConfigError, match="need a token_policy"):
        run_engine(ok, model, token_budget=4, **run)
    with pytest.raises(ConfigError, match="needs a budget"):
        run_engine(ok, model, token_policy="knorm", **run)
    with pytest.raises(ConfigError, match="nope"):
        run_engine(ok, model, token_policy="nope", token_budget=4, **run)
    with pytest.raises(ConfigError, match="budget must be >= 1"):
        run_engine(ok, model, token_policy="knorm", token_budget=0, **run)
    with pytest.raises(ConfigError, match="differs from the token policy's budget"):
        run_engine(ok, model, token_policy=H2O(8), token_budget=4, **run)
    with pytest.raises(ConfigError, match="with a TokenPolicy instance"):
        run_engine(ok, model, token_policy=H2O(8), token_params={"n_recent": 2}, **run)
    with pytest.raises(ConfigError, match="token_policy must be None, a registered name"):
        run_engine(ok, model, token_policy=3, **run)
    with pytest.raises(ConfigError, match="token_params must be a dict"):
        run_engine(ok, model, token_policy="knorm", token_budget=4, token_params=[1], **run)
    windowed = LlamaModel(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2,
                                      num_heads=4, num_kv_heads=2, head_dim=8,
                                      intermediate_size=64, sliding_window=4))
    with pytest.raises(ConfigError, match="sliding window"):
        run_engine(ok, windowed, token_policy="knorm", token_budget=4, **run)
    # a scorer file for another model shape, both shapes named
    hf, _ = llama
    path = tmp_path / "lkv_t.safetensors"
    save_scorer(scorer(ScorerShape.of(hf), per_head=False), path, method="lkv_t")
    with pytest.raises(ConfigError, match=r"key_dim=16.*key_dim=8"):
        run_engine(ok, model, token_policy="lkv_t", token_budget=4,
                   token_params={"scorer": path}, **run)
    # a manager built without the executor's predicate
    pool = BlockPool(16, BLOCK, model.config.layout(), device="cpu")
    clock = ManualClock()
    executor = EngineExecutor(model, pool, clock, token_policy="knorm", token_budget=4)
    scheduler = Scheduler(KVCacheManager(pool, "lru", clock=clock), executor, ONE_CHUNK)
    scheduler.add(ok[0])
    with pytest.raises(ConfigError, match=r"uncacheable=executor\.uncacheable"):
        scheduler.step()
    with pytest.raises(ConfigError, match="uncacheable must be None or a callable"):
        KVCacheManager(pool, "lru", uncacheable=True)
    # forward_paged: a position before the slot, a count of queries past the new tokens
    pool = BlockPool(4, BLOCK, model.config.layout(), device="cpu")
    table = [pool.allocate() for _ in range(2)]
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ConfigError, match=r"positions\[0\] must be an int >= the entry's"):
        model.forward_paged(pool, [(ids, 2, table)], positions=[1])
    with pytest.raises(ConfigError, match=r"queries\[0\] must be an int in \[0, 3\]"):
        model.forward_paged(pool, [(ids, 0, table)], queries=[4])
    assert TokenEviction(model, "tova", 4).queries(3) == 3
