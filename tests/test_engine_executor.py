"""The real executor: the shared scheduler driving a real model over the paged pool.

- the cache's invariants hold after every step when the engine drives the manager, and every
  resident cached block holds exactly the K/V of its tokens;
- a small pool gives the answers of an unbounded pool (eviction is lossless), and a corrupted
  cached block is caught by that comparison;
- a fully cached prompt does not rewrite its shared block, a decode whose block another
  request already computed does not rewrite it either;
- the measurements are consistent, and the answers equal a dense recompute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_clock import fake_timer

from kvevict.cost import CostModel
from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.answers import compare_answers
from kvevict.engine.driver import run_engine, unbounded_capacity
from kvevict.engine.executor import EngineExecutor
from kvevict.engine.memory import process_memory
from kvevict.errors import ConfigError
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.scheduler import Scheduler, SchedulerConfig
from kvevict.types import ManualClock, Request
from kvevict.workloads import generate

BLOCK = 16
VOCAB = 64
CONFIG = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6)



@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64)
    return LlamaModel(config, seed=0)


def chat(seed: int, n: int = 18) -> list[Request]:
    """Busy, short chat sessions: turns overlap, the next turn often arrives while the
    previous one is still decoding."""
    return generate("chat", seed=seed, vocab_size=VOCAB, duration=300, sessions_per_minute=12,
                    output_tokens_mean=20, user_tokens_mean=20, system_prompt_tokens=32,
                    think_time_median=0.5, decode_seconds_per_token=0.001,
                    first_continue_prob=0.8, later_continue_prob=0.8)[:n]


def smallest_pool(requests: list[Request]) -> int:
    return max(-(-(r.prompt_len + r.output_len) // BLOCK) for r in requests)


def prefix_tokens(manager: KVCacheManager, block) -> list[int]:
    """All token ids from position 0 to the end of ``block`` (walking its parents)."""
    chain = [block]
    while chain[-1].parent_hash is not None and chain[-1].depth > 0:
        chain.append(manager.tree.get(chain[-1].parent_hash))
    return [int(t) for b in reversed(chain) for t in b.tokens]


def assert_cached_kv_exact(manager: KVCacheManager, model: LlamaModel) -> None:
    """Every resident cached block holds the K/V a fresh prefill of its prefix computes."""
    pool = manager.pool
    for block in manager.tree:
        ids = torch.tensor(prefix_tokens(manager, block))
        fresh = BlockPool(len(ids) // BLOCK, BLOCK, model.config.layout(), device="cpu")
        table = [fresh.allocate() for _ in range(fresh.num_blocks)]
        model.forward_paged(fresh, [(ids, 0, table)])
        torch.testing.assert_close(pool.kv[:, :, block.block_id], fresh.kv[:, :, table[-1]],
                                   atol=1e-5, rtol=1e-4)


# -- invariants ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed,policy,preemption", [
    (0, "lru", "last-arrived"), (1, "market", "fewest-processed"),
    (2, "lfu", "last-arrived"), (3, "bayes", "last-arrived"),
])
def test_engine_driven_manager_keeps_its_invariants(model, seed, policy, preemption):
    requests = chat(seed)
    config = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=6, preemption=preemption)
    steps = []

    def on_step(scheduler: Scheduler) -> None:
        steps.append(scheduler.steps)
        if len(steps) % 25 == 0:
            assert_cached_kv_exact(scheduler.manager, model)

    result = run_engine(requests, model, policy, capacity_blocks=smallest_pool(requests) + 2,
                        block_size=BLOCK, time_scale=20.0, config=config, check=True,
                        on_step=on_step, timer=fake_timer())
    assert len(steps) == result.engine["steps"] > 0
    assert len(result.sim.records) == len(requests)
    stats = result.sim.manager_stats
    assert stats["evictions"] > 0, "the pool must be under pressure for this test to mean much"
    assert result.engine["stale_items"] == 0


# -- losslessness --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [4, 5])
@pytest.mark.parametrize("closed_loop", [True, False])
def test_small_pool_answers_equal_unbounded_pool(model, seed, closed_loop):
    """Closed loop, a turn waits for the answer it follows (`SessionGate`); open loop, the
    next turn often arrives while the previous one still decodes."""
    requests = chat(seed, n=16)
    ub = unbounded_capacity(requests, BLOCK, CONFIG.max_num_seqs)
    reference = run_engine(requests, model, "lru", capacity_blocks=ub, block_size=BLOCK,
                           time_scale=20.0, config=CONFIG, timer=fake_timer(),
                           closed_loop=closed_loop)
    assert reference.sim.manager_stats["evictions"] == 0
    hits = {}
    for policy in ("lru", "market", "belady"):
        small = run_engine(requests, model, policy, capacity_blocks=smallest_pool(requests),
                           block_size=BLOCK, time_scale=20.0, config=CONFIG,
                           timer=fake_timer(), closed_loop=closed_loop)
        hits[policy] = small.summary()["token_hit_ratio"]
        summary = small.summary()
        assert summary["evictions"] > 0
        assert summary["recomputed_prefill_tokens"] > 0 or closed_loop
        records = {r.request_id: r for r in small.sim.records}  # engine seconds
        if closed_loop:
            assert not any(records[r.request_id].arrival < records[r.extra["parent"]].finish
                           for r in requests if r.extra["parent"] in records)
        else:
            assert summary["held_requests"] == 0
        check = compare_answers(reference, small)
        assert check.identical, check.as_dict()["mismatches"][:5]
        assert check.positions == sum(r.output_len for r in requests)
        assert check.max_logit_deviation < 1e-4
    assert hits["belady"] >= hits["lru"]  # the oracle, built from the run's requests


def test_a_corrupted_cached_block_changes_answers(model):
    """The losslessness check can fail: scribble over a cached block nobody is using, and
    the requests that later hit it answer differently."""
    requests = chat(6, n=16)
    ub = unbounded_capacity(requests, BLOCK, CONFIG.max_num_seqs)
    reference = run_engine(requests, model, "lru", capacity_blocks=ub, block_size=BLOCK,
                           time_scale=20.0, config=CONFIG, timer=fake_timer())
    gen = torch.Generator().manual_seed(0)
    corrupted: set[int] = set()

    def corrupt(scheduler: Scheduler) -> None:
        manager = scheduler.manager
        for block_id in list(manager.tree.candidates):
            if block_id not in corrupted:
                corrupted.add(block_id)
                kv = manager.pool.kv[:, :, block_id]
                kv.copy_(torch.randn(kv.shape, generator=gen))

    broken = run_engine(requests, model, "lru", capacity_blocks=ub, block_size=BLOCK,
                        time_scale=20.0, config=CONFIG, on_step=corrupt, timer=fake_timer())
    check = compare_answers(reference, broken)
    assert corrupted and check.bugs > 0 and not check.lossless
    assert "BUG" in check.verdict()


# -- shared blocks are not rewritten ---------------------------------------------------------


def single_steps(model: LlamaModel, capacity: int = 32):
    clock = ManualClock()
    pool = BlockPool(capacity, BLOCK, model.config.layout(), device="cpu")
    manager = KVCacheManager(pool, "lru", clock=clock)
    executor = EngineExecutor(model, pool, clock, check_tokens=True, timer=fake_timer())
    return Scheduler(manager, executor, CONFIG), executor, pool


def run_all(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        scheduler.step()
        scheduler.manager.check()


def test_fully_cached_prompt_does_not_rewrite_kv(model):
    scheduler, executor, pool = single_steps(model)
    prompt = np.arange(2 * BLOCK) % VOCAB  # exactly two blocks: cacheable whole
    scheduler.add(Request("a", tokens=prompt, output_len=1, output_tokens=[5]))
    run_all(scheduler)
    before = pool.kv.clone()
    scheduler.add(Request("b", tokens=prompt, output_len=1, output_tokens=[5]))
    plan = scheduler.step()
    chunk = plan.prefills[0]
    assert (chunk.start, chunk.end, chunk.samples) == (2 * BLOCK, 2 * BLOCK, True)
    assert executor.peeks == 1
    assert torch.equal(pool.kv, before)  # byte for byte
    assert executor.answers["b"] == executor.answers["a"]
    dense = model.forward_dense(torch.tensor(prompt))[-1]
    assert executor.answers["b"][0] == int(dense.argmax())


def test_decode_into_a_block_the_next_turn_computed_is_not_rewritten(model):
    """Turn 2 prefills turn 1's answer while turn 1 still decodes it: turn 1's decode lands
    in turn 2's cached block, which it must read, not rewrite."""
    scheduler, executor, pool = single_steps(model)
    system = np.arange(BLOCK) % VOCAB
    answer = (np.arange(2 * BLOCK) * 7 + 3) % VOCAB
    user = np.array([1, 2, 3])
    scheduler.add(Request("t1", tokens=system, session_id="s", output_len=len(answer),
                          output_tokens=answer))
    scheduler.step()  # t1's prefill, first answer token
    scheduler.add(Request("t2", tokens=np.concatenate([system, answer, user]),
                          session_id="s", output_len=2, output_tokens=[4, 4]))
    run_all(scheduler)
    assert executor.skipped_tokens > 0 and executor.peeks > 0
    full = torch.tensor(np.concatenate([system, answer[:-1]]))
    dense = model.forward_dense(full)[BLOCK - 1:].argmax(-1).tolist()
    assert executor.answers["t1"] == dense


# -- measurements ----------------------------------------------------------------------------


def test_measurements_are_consistent(model):
    requests = chat(7, n=16)
    result = run_engine(requests, model, "market", capacity_blocks=smallest_pool(requests),
                        block_size=BLOCK, time_scale=30.0, config=CONFIG, cost=CostModel())
    assert result.time_scale == 30.0
    for r in result.sim.records:
        assert 0 <= r.queue_wait <= r.ttft
        assert r.arrival + r.ttft <= r.finish + 1e-12
        extra = 1 if r.cached_tokens == r.prompt_tokens else 0  # the last token's logits
        if r.preemptions == 0:
            assert r.cached_tokens + r.computed_prefill_tokens == r.prompt_tokens + extra
        else:
            assert r.cached_tokens + r.computed_prefill_tokens >= r.prompt_tokens
        assert result.engine_prefill_tokens.get(r.request_id, 0) <= r.computed_prefill_tokens
    rows = result.request_rows()
    assert [row["request_id"] for row in rows] == [r.request_id for r in result.sim.records]
    for row in rows:
        assert row["prefill_s"] == pytest.approx(row["ttft_s"] - row["queue_wait_s"], abs=2e-6)
        assert row["decode_s"] >= 0
        assert (row["decode_tokens_per_s"] > 0) == (row["output_tokens"] > 1)
    s = result.summary(cold_requests=3)
    assert s["cold"]["requests"] == 3 and s["warm"]["requests"] == len(requests) - 3
    engine = result.engine
    assert engine["busy_s"] == pytest.approx(engine["model_s"] + engine["host_s"], abs=1e-5)
    assert engine["decode_tokens"] + len(requests) == sum(r.output_len for r in requests)
    mem = result.memory
    assert 0 < mem["peak_pool_blocks"] <= mem["pool_blocks"] == smallest_pool(requests)
    assert mem["os"]["peak_rss_bytes"] > 0 and mem["torch_peak_allocated_bytes"] is None
    kv = result.kv
    assert (kv["device"], kv["dtype"]) == ("cpu", "float32")
    assert kv["bytes"] == smallest_pool(requests) * kv["bytes_per_block"]
    assert process_memory()["source"] in ("/proc/self/status", "getrusage")


def test_answers_equal_dense_recompute(model):
    """Teacher-forced answers are the dense model's greedy tokens at every position; a
    request without fixed outputs is decoded greedily, its answer fed back."""
    requests = chat(8, n=10)
    free = Request("free", tokens=np.arange(21) % VOCAB, output_len=6,
                   arrival=requests[-1].arrival + 1)
    result = run_engine([*requests, free], model, "lru",
                        capacity_blocks=smallest_pool(requests), block_size=BLOCK,
                        time_scale=20.0, config=CONFIG)
    for r in requests:
        full = torch.tensor(np.concatenate([r.tokens, r.output_tokens[:-1]]))
        logits = model.forward_dense(full)[r.prompt_len - 1:]
        top = logits.topk(2, dim=-1)
        decided = (top.values[:, 0] - top.values[:, 1]) > 1e-4
        answers = torch.tensor(result.answers[r.request_id])
        assert torch.equal(answers[decided], top.indices[decided, 0])
        torch.testing.assert_close(torch.tensor(result.top_logits[r.request_id]),
                                   top.values[:, 0], atol=1e-4, rtol=1e-4)
    tokens = list(range(21))
    for _ in range(6):
        tokens.append(int(model.forward_dense(torch.tensor(tokens))[-1].argmax()))
    assert list(result.answers["free"]) == tokens[21:]


# -- bad input -------------------------------------------------------------------------------


def test_bad_input_is_a_config_error(model):
    ok = [Request("a", tokens=[1, 2, 3], output_len=2)]
    with pytest.raises(ConfigError, match="vocabulary"):
        run_engine([Request("a", tokens=[1, VOCAB], output_len=1)], model, capacity_blocks=4)
    with pytest.raises(ConfigError, match="token ids"):
        run_engine([Request("a", block_hashes=[1], num_tokens=4)], model, capacity_blocks=4)
    with pytest.raises(ConfigError, match="at least one"):
        run_engine([], model, capacity_blocks=4)
    with pytest.raises(ConfigError, match="time_scale"):
        run_engine(ok, model, capacity_blocks=4, time_scale=0)
    with pytest.raises(ConfigError, match="unknown policy"):
        run_engine(ok, model, "nope", capacity_blocks=4)
    other = BlockPool(4, BLOCK, ModelConfig(vocab_size=8, hidden_size=8, num_layers=1,
                                            num_heads=1, num_kv_heads=1, head_dim=8,
                                            intermediate_size=8).layout(), device="cpu")
    with pytest.raises(ConfigError, match="layout"):
        EngineExecutor(model, other, ManualClock())
    with pytest.raises(ConfigError, match="ManualClock"):
        EngineExecutor(model, BlockPool(4, BLOCK, model.config.layout(), device="cpu"),
                       clock=lambda: 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_runs_on_cuda_and_reports_torch_memory():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64)
    cuda_model = LlamaModel(config, seed=0, device="cuda")
    requests = chat(9, n=8)
    result = run_engine(requests, cuda_model, "lru", capacity_blocks=smallest_pool(requests),
                        block_size=BLOCK, time_scale=20.0, config=CONFIG, check=True)
    assert result.kv["device"].startswith("cuda") and result.kv["weights_device"] == \
        result.kv["device"]
    assert result.memory["torch_peak_allocated_bytes"] >= result.kv["bytes"]
    cpu = run_engine(requests, LlamaModel(config, seed=0), "lru",
                     capacity_blocks=smallest_pool(requests), block_size=BLOCK,
                     time_scale=20.0, config=CONFIG)
    assert compare_answers(cpu, result).lossless


# -- the measured load: the engine's own work at its measured speed ------------------------------


def test_the_engine_measured_load_is_its_priced_work_at_its_measured_speed(model):
    """Serial traffic on an unbounded pool: the engine runs the simulator's plans, so its
    pricer (the cost model it is given) prices the simulator's work, and its measured load is
    that work rescaled to the engine's measured speed (busy over priced seconds of the same
    steps), per second of arrivals, in engine seconds at any time scale. ``busy_load`` is the
    busy time over that span (it used to divide engine seconds by workload seconds)."""
    from kvevict.sim import simulate

    cost = CostModel(decode_step_s=0.02, decode_s_per_seq=1e-4,
                     decode_s_per_context_token=1e-7, linear_s_per_token=1e-4,
                     attn_s_per_pair=1e-8)
    reqs = [Request(f"r{i}", tokens=[i % 3 * 20 + k for k in range(20)] + [60 + i % 4] * 8,
                    output_len=5, arrival=10.0 * i) for i in range(8)]
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    sim = simulate(reqs, "lru", capacity_blocks=200, block_size=BLOCK, cost=cost, config=cfg)
    assert sim.limit_batch == 4.0 and sim.load_seconds > 0
    for scale in (1.0, 4.0):
        eng = run_engine(reqs, model, "lru", capacity_blocks=200, block_size=BLOCK,
                         time_scale=scale, config=cfg, cost=cost, timer=fake_timer(0.05))
        summary, engine = eng.summary(), eng.engine
        speed = engine["busy_s"] / engine["predicted_busy_s"]
        span = (reqs[-1].arrival - reqs[0].arrival) / scale  # engine seconds
        assert summary["limit_batch"] == 4.0
        # the simulator's work, in engine seconds, at the engine's speed
        assert eng.sim.load_seconds == pytest.approx(sim.load_seconds / scale * speed,
                                                     rel=1e-5)
        assert summary["measured_load"] == pytest.approx(
            eng.sim.load_seconds * (len(reqs) - 1) / len(reqs) / span, abs=1e-6)
        assert summary["busy_load"] == pytest.approx(engine["busy_s"] / span, abs=1e-6)
        assert speed != pytest.approx(1.0)  # the fake timer's steps are not the priced ones
