"""kvevict policies in vLLM's GPU tier (the prefix cache), against vLLM's real code on CPU.

Marked ``vllm``: skipped where vLLM is not installed (the main suite's venv); run them in the
vLLM venv with ``python -m pytest -m vllm tests/test_vllm_gpu.py`` (docs/vllm.md). The fast
tests drive vLLM's real ``KVCacheManager`` / ``BlockPool`` with the plugin's classes; one
test starts ``LLM()`` on a tiny random Llama three times (stock, ``lru``, ``lfu``) in
subprocesses, the plugin loaded through its ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from typing import ClassVar

import pytest
import recorder

from kvevict.errors import ConfigError, PolicyError
from kvevict.policies.base import ScoredPolicy
from kvevict.policies.lru import LRU
from kvevict.types import ManualClock
from kvevict.types import Request as KRequest


def test_plugin_does_nothing_without_the_variable():
    """The entry point, with KVEVICT_VLLM_POLICY unset, returns without importing vLLM or
    the GPU-tier module (it runs in every vLLM process)."""
    code = (
        "import os, sys; os.environ.pop('KVEVICT_VLLM_POLICY', None)\n"
        "sys.modules['vllm'] = None\n"
        "from kvevict.adapters.vllm import register_gpu_plugin\n"
        "print(register_gpu_plugin())\n"
        "print('kvevict.adapters.vllm.gpu' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVEVICT_VLLM_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert out.splitlines() == ["None", "False"]


# -- everything below needs vLLM ---------------------------------------------------------------

vllm_only = pytest.mark.vllm


@pytest.fixture(scope="module")
def g():
    """vLLM's GPU-tier classes and kvevict's plugin, or a clean skip."""
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    from kvevict.adapters.vllm import gpu, gpu_replay

    class G:
        pass

    ns = G()
    ns.gpu, ns.replay, ns.Request, ns.SamplingParams = gpu, gpu_replay, Request, SamplingParams
    ns.KVCacheManager = KVCacheManager
    return ns


BS = 16


class Recorder(recorder.Recorder):
    """The shared recording LRU, its events logged under short labels."""

    LABELS: ClassVar[dict[str, str]] = {
        "on_insert": "ins", "on_hit": "hit", "on_candidate": "cand", "on_uncandidate": "unc",
        "on_evict": "ev"}


class MRU(ScoredPolicy):
    """Most recently used first: the opposite of vLLM's order."""

    def score(self, block, now):
        return -block.last_access_tick


def manager(g, policy, capacity=5, params=None, block_size=BS, **kw):
    """vLLM's real KVCacheManager; stock for "vllm:lru", else through the plugin."""
    if policy == "vllm:lru":
        return g.replay.make_gpu_manager(policy, capacity, block_size=block_size)
    with g.gpu.gpu_policy(policy, params, clock=ManualClock(), **kw) as slot:
        mgr = g.gpu.KVEvictKVCacheManager(
            g.replay.kv_cache_config(capacity, block_size), max_model_len=2048,
            scheduler_block_size=block_size, hash_block_size=block_size, enable_caching=True)
    return mgr, slot.tiers[0]


def drive(g, mgr, prompts, extra_args=None):
    hasher = g.replay.block_hasher(BS)
    out = []
    for i, tokens in enumerate(prompts):
        sp = g.SamplingParams(max_tokens=1, extra_args=extra_args)
        out.append(g.replay.drive_request(mgr, g.Request(str(i), tokens, sp, None,
                                                         block_hasher=hasher)))
    return out


def queue_state(mgr):
    """vLLM's free queue, front first: (block id, cached)."""
    return [(b.block_id, b.block_hash is not None)
            for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


class RequestEvents(LRU):
    """LRU logging its request events: (event, request id, block ids..., candidates then)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def note(self, name, request, *lists):
        self.events.append((name, request.request_id,
                            *[[b.block_id for b in x] for x in lists], len(self)))

    def on_begin(self, request, hits, new, now):
        self.note("begin", request, hits, new)

    def on_resume(self, request, hits, new, now):
        self.note("resume", request, hits, new)

    def on_preempt(self, request, blocks, now):
        self.note("preempt", request, blocks)

    def on_finish(self, request, blocks, now):
        self.note("finish", request, blocks)


def allocate_slots(mgr, req):
    """One request's lookup and allocation, as the scheduler makes them; its hit tokens."""
    blocks, computed, _ = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - computed, computed, blocks) is not None
    return computed


A = list(range(1, 50))  # 3 full blocks of 16 and one token
B = list(range(100, 133))  # 2 full blocks and one token
SCRIPT = [A, B, A[:33], list(range(200, 233)), A]


@vllm_only
def test_exact_events_and_eviction_order(g):
    """A hand-built case through vLLM's real KVCacheManager, pool of 5 blocks: the events
    the plugin sends, uncached blocks reused first, only leaves offered, and vLLM's order
    kept (the same hits and the same free queue as stock vLLM)."""
    stock, _ = manager(g, "vllm:lru")
    assert drive(g, stock, SCRIPT) == [0, 0, 32, 0, 32]
    rec = Recorder()
    mgr, tier = manager(g, rec)
    assert drive(g, mgr, SCRIPT) == [0, 0, 32, 0, 32]
    assert queue_state(mgr) == queue_state(stock) == [(5, False), (3, True), (4, True),
                                                      (2, True), (1, True)]
    assert rec.log == [
        # A: blocks 1-4 (uncached, from the front); 1, 2, 3 cached; only the leaf 3 offered
        ("ins", 1), ("ins", 2), ("ins", 3), ("cand", 3),
        # B: 4 and 5 uncached first, then the policy's victim 3; its parent 2 a leaf now
        ("ev", 3), ("cand", 2), ("ins", 4), ("ins", 5), ("cand", 5),
        # A's first 32 tokens: hits on 1 and 2 (2 withdrawn first), 2 offered back
        ("hit", 1), ("unc", 2), ("hit", 2), ("cand", 2),
        # new prompt: 5 (older than 2) then its parent 4
        ("ev", 5), ("cand", 4), ("ev", 4), ("ins", 3), ("ins", 5), ("cand", 5),
        # A again: 32 tokens hit, 5 evicted, A's third block cached again in 4
        ("hit", 1), ("unc", 2), ("hit", 2), ("ev", 5), ("cand", 3), ("ins", 4), ("cand", 4),
    ]
    tier.check()
    assert (tier.evictions, tier.policy_evictions, tier.fallback_evictions,
            tier.reused_uncached) == (4, 4, 0, 9)
    # the opposite policy changes vLLM's eviction: A's chain goes, and A misses at the end
    mgr, tier = manager(g, MRU)
    assert drive(g, mgr, SCRIPT) == [0, 0, 32, 0, 0]
    tier.check()


@vllm_only
def test_a_preemption_sends_on_preempt_and_its_resume_on_resume(g):
    """vLLM's scheduler preempts a request by freeing it while its status is still RUNNING
    (`Scheduler._preempt_request`; a finished request is FINISHED_* by its free). The
    plugin sends ``on_preempt`` with the blocks it holds, before they are released, and the
    request's next allocation ``on_resume``, not a second ``on_begin``; a finish after that
    sends ``on_finish``, and a request finished while preempted ``on_finish`` with none."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    source = inspect.getsource(Scheduler._preempt_request)
    assert source.index("_free_request_blocks(request)") < source.index(
        "request.status = RequestStatus.PREEMPTED")

    policy = RequestEvents()
    mgr, tier = manager(g, policy, capacity=8)
    hasher = g.replay.block_hasher(BS)

    a = g.Request("a", A, g.SamplingParams(max_tokens=1), None, block_hasher=hasher)
    b = g.Request("b", B, g.SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert allocate_slots(mgr, a) == 0
    a.status = RequestStatus.RUNNING
    mgr.free(a)  # as _preempt_request frees it
    a.status = RequestStatus.PREEMPTED
    assert allocate_slots(mgr, a) == 48  # its three full blocks
    a.status = RequestStatus.FINISHED_STOPPED
    mgr.free(a)
    assert allocate_slots(mgr, b) == 0
    b.status = RequestStatus.RUNNING
    mgr.free(b)
    b.status = RequestStatus.FINISHED_ABORTED
    mgr.free(b)  # aborted while preempted
    assert policy.events == [  # each with the number of candidates then
        ("begin", "a", [], [1, 2, 3], 0),  # its fourth block is partial: not cached
        ("preempt", "a", [1, 2, 3], 0),  # still held
        ("resume", "a", [1, 2, 3], [], 0),
        ("finish", "a", [1, 2, 3], 1),
        ("begin", "b", [], [4, 5], 1),
        ("preempt", "b", [4, 5], 1),  # a's leaf, 3
        ("finish", "b", [], 2),
    ]
    assert tier.begun == {} and tier.preempted == set()
    tier.check()


@vllm_only
def test_a_deferred_free_sends_its_events_as_a_free_does(g):
    """With several batches in flight, vLLM's scheduler defers a KV-connector consumer's
    frees (`Scheduler._free_request_blocks`): ``pop_blocks_for_free`` takes the blocks from
    the request, and a later step gives them to ``block_pool.free_blocks``, tail first. The
    plugin sends what `free` sends: ``on_preempt`` at once for a running request (before the
    release), and ``on_finish`` for a finished one once its blocks are released; nothing is
    left behind."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    source = inspect.getsource(Scheduler._free_request_blocks)
    assert "self.kv_cache_manager.pop_blocks_for_free(request)" in source
    assert "self.deferred_frees.append((self.sched_step_seq, blocks))" in source
    assert "self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))" in \
        inspect.getsource(Scheduler._drain_deferred_frees)

    policy = RequestEvents()
    mgr, tier = manager(g, policy, capacity=10)
    hasher = g.replay.block_hasher(BS)

    a = g.Request("a", A, g.SamplingParams(max_tokens=1), None, block_hasher=hasher)
    b = g.Request("b", B, g.SamplingParams(max_tokens=1), None, block_hasher=hasher)
    c = g.Request("c", A[:33], g.SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert allocate_slots(mgr, a) == 0
    a.status = RequestStatus.FINISHED_STOPPED
    popped_a = mgr.pop_blocks_for_free(a)  # deferred: its blocks are still held
    assert [blk.block_id for blk in popped_a] == [1, 2, 3, 4]
    assert allocate_slots(mgr, c) == 32  # a later request hits them meanwhile
    assert allocate_slots(mgr, b) == 0
    b.status = RequestStatus.RUNNING
    popped_b = mgr.pop_blocks_for_free(b)  # a deferred preemption
    mgr.block_pool.free_blocks(reversed(popped_a))  # the fence of a's step has passed
    b.status = RequestStatus.PREEMPTED
    mgr.block_pool.free_blocks(reversed(popped_b))
    assert allocate_slots(mgr, b) == 32
    c.status = b.status = RequestStatus.FINISHED_STOPPED
    mgr.free(c)
    mgr.free(b)
    assert policy.events == [  # each with the number of candidates then
        ("begin", "a", [], [1, 2, 3], 0),
        ("begin", "c", [1, 2], [], 0),
        ("begin", "b", [], [6, 7], 0),
        ("preempt", "b", [6, 7], 0),  # at once, before the release
        ("finish", "a", [1, 2, 3], 1),  # once released: its leaf 3 is a candidate
        ("resume", "b", [6, 7], [], 1),  # its leaf 7 was offered, and its hit took it back
        ("finish", "c", [1, 2], 1),  # 2 is inner (3 chains from it): not offered
        ("finish", "b", [6, 7], 2),  # 7 offered
    ]
    assert tier.begun == {} and tier.preempted == set() and tier.finishing == {}
    assert tier.infos == {}
    tier.check()


class OutputLengths(LRU):
    """LRU noting the ``output_len`` of the request each request event carries."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_begin(self, request, hits, new, now):
        self.seen.append(("begin", request.request_id, request.output_len))

    def on_finish(self, request, blocks, now):
        self.seen.append(("finish", request.request_id, request.output_len))


@vllm_only
def test_on_finish_carries_the_generated_length(g):
    """A request's ``output_len`` is its ``max_tokens`` at its begin, and at its finish the
    tokens it generated (the answer's length: `learned` files the request's blocks under
    it); a request that generated none keeps ``max_tokens``."""
    from vllm.v1.request import RequestStatus

    policy = OutputLengths()
    mgr, tier = manager(g, policy, capacity=10)
    hasher = g.replay.block_hasher(BS)
    a = g.Request("a", A, g.SamplingParams(max_tokens=64), None, block_hasher=hasher)
    b = g.Request("b", B, g.SamplingParams(max_tokens=16), None, block_hasher=hasher)
    allocate_slots(mgr, a)
    allocate_slots(mgr, b)
    a.append_output_token_ids([7, 8, 9])
    a.status = b.status = RequestStatus.FINISHED_STOPPED
    mgr.free(a)
    mgr.free(b)
    assert policy.seen == [("begin", "a", 64), ("begin", "b", 16), ("finish", "a", 3),
                           ("finish", "b", 16)]
    tier.check()


@vllm_only
def test_twins_and_leaf_rule(g):
    """A block-aligned prompt sent twice: vLLM recomputes its last block into a twin (same
    hash, another block); either twin may go, and the records stay consistent."""
    aligned = list(range(1, 33))  # 2 full blocks exactly
    for policy in ("lru", MRU):
        mgr, tier = manager(g, policy, capacity=6)
        assert drive(g, mgr, [aligned, aligned, aligned + [7]]) == [0, 16, 32]
        tier.check()
        hashes = [r.block_hash for r in tier.records if r is not None]
        assert len(hashes) == 3 and len(set(hashes)) == 2  # a twin
        stock, _ = manager(g, "vllm:lru", capacity=6)
        drive(g, stock, [aligned, aligned, aligned + [7]])
        if policy == "lru":
            assert queue_state(mgr) == queue_state(stock)


@vllm_only
def test_lru_equals_stock_vllm_on_mooncake(g):
    """kvevict's lru through the plugin hits and evicts exactly as stock vLLM on the first
    600 requests of the bundled Mooncake trace (512-token blocks, tokens derived from the
    ids), and as kvevict's own replay predicts; the plugin's records checked throughout."""
    from kvevict.replay import replay
    from kvevict.workloads.mooncake import bundled_trace_path, read_mooncake

    reqs = read_mooncake(bundled_trace_path("mooncake"))[:600]
    stream = g.replay.GPUStream(reqs, 512)
    for size in (1000, 4000):
        stock = g.replay.replay_gpu(stream, "vllm:lru", size, block_size=512)
        ours = g.replay.replay_gpu(stream, "lru", size, block_size=512, check_every=100,
                                   records=True)
        assert (ours.hits, ours.token_hits, ours.evictions, ours.prefill_saved_s) == \
            (stock.hits, stock.token_hits, stock.evictions, stock.prefill_saved_s)
        assert stock.prefill_saved_s > 0
        # the batches kvevict.replay keeps (600 requests: 18 of 32, the last with 24 more),
        # each its requests' records; the plugin's equal stock vLLM's, batch by batch
        assert ours.batches == stock.batches and len(ours.batches) == 18
        recs = ours.records
        for k, batch in enumerate(ours.batches):
            part = recs[32 * k:32 * (k + 1) if k < 17 else len(recs)]
            assert batch[:4] == (sum(r.blocks for r in part), sum(r.block_hits for r in part),
                                 sum(r.tokens for r in part), sum(r.token_hits for r in part))
        assert [sum(b[i] for b in ours.batches) for i in range(4)] == [
            ours.accesses, ours.hits, ours.token_queries, ours.token_hits]
        assert sum(b[5] for b in ours.batches) == pytest.approx(ours.prefill_saved_s,
                                                                rel=1e-12)
        tree = replay(reqs, "lru", size, 512)
        # vLLM looks up full blocks only (14,273); kvevict's hash mode every listed id, the
        # partial last one too (14,873), which also takes pool space
        assert (size, stock.hits, stock.accesses, tree.hits, tree.accesses) in {
            (1000, 145, 14273, 145, 14873), (4000, 851, 14273, 831, 14873)}
    market = g.replay.replay_gpu(stream, "market", 1000, block_size=512, check_every=100)
    assert (market.hits, market.evictions) == (128, 13146)
    assert replay(reqs, "market", 1000, 512).hits == 128
    # learned files blocks under the answer's length: the replay gives each request the
    # trace's output length as max_tokens, and the plugin passes it on (with max_tokens=1
    # for all, as before, it hit 127 and 950 blocks: below stock vLLM's 145 at 1,000)
    learned = [g.replay.replay_gpu(stream, "learned", size, block_size=512, time="arrival",
                                   check_every=100) for size in (1000, 4000)]
    assert [(r.hits, r.evictions) for r in learned] == [(241, 13033), (1057, 9217)]


class Raising(LRU):
    def __init__(self, event: str, after: int = 0) -> None:
        super().__init__()
        self.event, self.after = event, after

    def _maybe(self, event):
        if event == self.event:
            if self.after == 0:
                raise RuntimeError(f"{event} broke")
            self.after -= 1

    def on_candidate(self, block, now):
        self._maybe("on_candidate")
        super().on_candidate(block, now)

    def pop_victim(self, now):
        self._maybe("pop_victim")
        return super().pop_victim(now)


class NotACandidate(LRU):
    def pop_victim(self, now):
        super().pop_victim(now)
        return 0  # the null block: never a candidate


@vllm_only
@pytest.mark.parametrize("policy", [Raising("on_candidate"), Raising("pop_victim", 3),
                                    NotACandidate()], ids=["candidate", "victim", "bad"])
def test_raising_policy_is_quarantined(g, policy, caplog):
    """A policy that raises (or names a non-candidate) is quarantined, logged, and vLLM
    goes on in its own LRU order: from the start on, exactly stock vLLM's hits."""
    mgr, tier = manager(g, policy)
    with caplog.at_level(logging.ERROR, logger="kvevict.adapters.vllm"):
        got = drive(g, mgr, SCRIPT)
    assert isinstance(tier.policy_error, PolicyError) and tier.policy is None
    assert "now evicts in vLLM's LRU order" in caplog.text
    stock, _ = manager(g, "vllm:lru")
    assert got == drive(g, stock, SCRIPT) == [0, 0, 32, 0, 32]
    assert queue_state(mgr) == queue_state(stock)
    assert tier.fallback_evictions > 0 and tier.metrics()["policy_error"]
    tier.check()


@vllm_only
def test_env_parsing(g):
    """KVEVICT_VLLM_POLICY / _PARAMS / _METRICS_EVERY: None when unset, clear errors."""
    GPUConfig = g.gpu.GPUConfig
    assert GPUConfig.from_env({}) is None
    assert GPUConfig.from_env({"KVEVICT_VLLM_POLICY": "  "}) is None
    config = GPUConfig.from_env({"KVEVICT_VLLM_POLICY": "lfu",
                                 "KVEVICT_VLLM_POLICY_PARAMS": '{"half_life": 30}',
                                 "KVEVICT_VLLM_METRICS": "/tmp/m-{pid}.json",
                                 "KVEVICT_VLLM_METRICS_EVERY": "2.5"})
    assert (config.policy, dict(config.params), config.metrics_path, config.metrics_every) \
        == ("lfu", {"half_life": 30}, "/tmp/m-{pid}.json", 2.5)
    # parameters in the name (`parse_spec`), as `kvevict replay --policies` takes them
    config = GPUConfig.from_env({"KVEVICT_VLLM_POLICY": "lfu(half_life=30)"})
    assert (config.policy, dict(config.params)) == ("lfu(half_life=30)", {})
    bad = [
        ({"KVEVICT_VLLM_POLICY_PARAMS": "{half_life: 30}"}, "must be a JSON object such as"),
        ({"KVEVICT_VLLM_POLICY_PARAMS": "[30]"}, "JSON object of parameter names.*list"),
        ({"KVEVICT_VLLM_POLICY_PARAMS": '{"halflife": 30}'}, "halflife"),
        ({"KVEVICT_VLLM_POLICY": "nosuch"}, "nosuch"),
        ({"KVEVICT_VLLM_POLICY": "belady"}, "offline"),
        ({"KVEVICT_VLLM_POLICY": "horizon-oracle(horizon=5)"}, "offline"),
        ({"KVEVICT_VLLM_POLICY": "lfu(halflife=30)"}, "halflife"),
        ({"KVEVICT_VLLM_POLICY": "lfu(half_life=30)", "KVEVICT_VLLM_POLICY_PARAMS":
          '{"half_life": 30}'}, "half_life given both in the name and as a parameter"),
        ({"KVEVICT_VLLM_METRICS_EVERY": "soon"}, "must be a number of seconds, got 'soon'"),
        ({"KVEVICT_VLLM_METRICS_EVERY": "0"}, "positive number of seconds"),
    ]
    for env, message in bad:
        with pytest.raises(ConfigError, match=message):
            GPUConfig.from_env({"KVEVICT_VLLM_POLICY": "lfu", **env})


@vllm_only
def test_version_refusal_and_upstream_hook(g, monkeypatch):
    """The plugin refuses an unsupported vLLM, and a vLLM with its own GPUCachePolicy."""
    import vllm
    import vllm.v1.core.block_pool as block_pool_module

    from kvevict.adapters.vllm import register_gpu_plugin

    config = g.gpu.GPUConfig("lru")
    assert g.gpu.upstream_gpu_policy() is None  # vLLM 0.32 has none
    monkeypatch.setenv("KVEVICT_VLLM_POLICY", "lru")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.32\.x .* found vLLM 0\.33\.0"):
        register_gpu_plugin()
    with pytest.raises(ConfigError, match=r"found vLLM 0\.33\.0"):
        g.gpu.install(config)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")

    class GPUCachePolicy:
        pass

    monkeypatch.setattr(block_pool_module, "GPUCachePolicy", GPUCachePolicy, raising=False)
    with pytest.raises(ConfigError, match="has its own GPU-tier policy hook"):
        g.gpu.install(config)
    assert g.gpu.installed() is None


@vllm_only
def test_install_replaces_the_schedulers_manager(g):
    import vllm.v1.core.sched.scheduler as sched

    stock = sched.KVCacheManager
    g.gpu.install(g.gpu.GPUConfig("lfu"))
    try:
        assert sched.KVCacheManager is g.gpu.KVEvictKVCacheManager
        mgr = sched.KVCacheManager(g.replay.kv_cache_config(5, BS), max_model_len=96,
                                   scheduler_block_size=BS, hash_block_size=BS)
        assert type(mgr.block_pool).__name__ == "KVEvictBlockPool"
        assert type(mgr.tier.policy).__name__ == "LFU"
    finally:
        g.gpu.uninstall()
    assert sched.KVCacheManager is stock
    with pytest.raises(ConfigError, match="needs a policy"):
        g.gpu.KVEvictKVCacheManager(g.replay.kv_cache_config(5, BS), max_model_len=96,
                                    scheduler_block_size=BS, hash_block_size=BS)


@vllm_only
def test_request_hints_metrics_and_reset(g, tmp_path, caplog):
    """A request's extra_args["kvevict"] reach the records; the metrics file (written when
    the pool goes idle) holds the evictions by class and market's victim prices; a reset
    starts a fresh policy; a malformed hint is logged and ignored."""
    path = tmp_path / "m-{pid}.json"
    mgr, tier = manager(g, "market", metrics_path=str(path))
    hints = {"kvevict": {"session_id": "s1", "workload_class": "agent"}}
    assert drive(g, mgr, SCRIPT, extra_args=hints) == [0, 0, 32, 0, 32]
    assert {(r.session, r.workload_class) for r in tier.records if r is not None} == \
        {("s1", "agent")}
    data = json.loads((tmp_path / f"m-{os.getpid()}.json").read_text())
    assert (data["policy"], data["evictions"], data["evictions_by_class"], data["hits"],
            data["inserts"]) == ("market", tier.evictions, {"agent": tier.evictions}, 4, 8)
    assert len(data["last_victim_prices"]) == tier.policy_evictions > 0
    assert all(isinstance(p, float) for p in data["last_victim_prices"])
    first = tier.policy
    assert mgr.reset_prefix_cache()
    assert tier.policy is not first and not any(tier.records) and tier.num_candidates == 0
    with caplog.at_level(logging.WARNING, logger="kvevict.adapters.vllm"):
        drive(g, mgr, [A], extra_args={"kvevict": {"workload_class": 3}})
    assert "extra_args['kvevict'] ignored" in caplog.text
    assert {r.workload_class for r in tier.records if r is not None} == {"chat"}


@vllm_only
def test_a_policy_instance_keeps_strict_ticks_across_a_reset(g):
    """An instance outlives ``reset_prefix_cache`` (it is told ``on_evict`` for every
    record), so the ticks of the records after it go on from those before."""
    mgr, tier = manager(g, MRU())
    drive(g, mgr, [A])
    before = max(r.last_access_tick for r in tier.records if r is not None)
    assert mgr.reset_prefix_cache() and not any(tier.records)
    drive(g, mgr, [A])
    after = [r.last_access_tick for r in tier.records if r is not None]
    assert len(after) == 3 and min(after) > before
    tier.check()


@vllm_only
def test_connector_evict_blocks(g):
    """``evict_blocks`` (a KV connector dropping hashes): the policy forgets the block, and
    a free one is reused first, as an uncached block."""
    rec = Recorder()
    mgr, tier = manager(g, rec)
    drive(g, mgr, [A])
    rec.log.clear()
    mgr.evict_blocks({3})
    assert rec.log == [("ev", 3), ("cand", 2)]  # 3's parent is a leaf now
    assert queue_state(mgr) == [(3, False), (4, False), (5, False), (2, True), (1, True)]
    tier.check()


@vllm_only
def test_replay_table_and_cli(g, tmp_path, capsys):
    """``kvevict replay --engine vllm`` prints `replay_gpu_table`'s table; errors."""
    from kvevict.cli import main
    from kvevict.replay import compare, format_comparison, format_table
    from kvevict.workloads.mooncake import bundled_trace_path, read_mooncake, write_mooncake

    trace = tmp_path / "t.jsonl"
    write_mooncake(read_mooncake(bundled_trace_path("mooncake"))[:300], trace)
    assert main(["replay", "--engine", "vllm", "--trace", str(trace), "--sizes", "200,1000",
                 "--policies", "vllm:lru,lru,lfu", "--versus", "vllm:lru", "--quiet",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = g.replay.replay_gpu_table(read_mooncake(trace), ["vllm:lru", "lru", "lfu"],
                                      [200, 1000], 512)
    assert format_table(table) in out
    # paired with stock vLLM batch by batch: the plugin's lru is exactly it
    assert format_comparison(table, "vllm:lru") + "\n" in out
    same = [c for c in compare(table, "vllm:lru") if c.policy == "lru"]
    assert [(c.difference.mean, c.difference.half, c.significant) for c in same] == \
        [(0.0, 0.0, False)] * 2
    assert "GPU blocks of 512 tokens" in out and "vLLM's KVCacheManager (GPU tier)" in out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["engine"] == "vllm" and saved["vllm_version"].startswith("0.32")
    assert [r["hits"] for r in saved["results"]] == [r.hits for r in table.results]
    # read back with --from, nothing replayed: the same table, against another row
    assert main(["replay", "--from", str(tmp_path), "--versus", "lfu"]) == 0
    again = capsys.readouterr().out
    assert again.startswith(out.splitlines()[0] + "\n" + format_table(table) + "\n")
    assert again.endswith(format_comparison(table, "lfu") + "\n")
    for argv, message in [(["--policies", "belady"], "online policies"),
                          (["--policies", "vllm:arc"], "unknown policy vllm:arc"),
                          (["--records"], "--records is for --engine kvevict"),
                          (["--policies", "lru", "--versus", "vllm:lru"],
                           "--versus 'vllm:lru' is not a row of this replay (rows: lru)")]:
        assert main(["replay", "--engine", "vllm", "--trace", str(trace), "--sizes", "10",
                     *argv]) == 2
        assert message in capsys.readouterr().err


@vllm_only
def test_a_policy_named_with_parameters_runs_with_them(g, tmp_path, capsys):
    """``lfu(half_life=7)`` (`parse_spec`) builds the plugin's policy with those parameters,
    in the manager and in ``kvevict replay --engine vllm``, where the text is the row."""
    from kvevict.cli import main
    from kvevict.workloads.mooncake import bundled_trace_path, read_mooncake, write_mooncake

    _, tier = g.replay.make_gpu_manager("lfu(half_life=7)", 8, block_size=16)
    assert type(tier.policy).__name__ == "LFU" and tier.policy.half_life == 7.0
    with pytest.raises(ConfigError, match="half_life given both in the name and as a "
                                          "parameter"):
        g.replay.make_gpu_manager("lfu(half_life=7)", 8, block_size=16,
                                  params={"half_life": 7})
    trace = tmp_path / "t.jsonl"
    write_mooncake(read_mooncake(bundled_trace_path("mooncake"))[:300], trace)
    policies = ["lfu", "lfu(half_life=0.5)"]
    assert main(["replay", "--engine", "vllm", "--trace", str(trace), "--sizes", "200",
                 "--policies", ",".join(policies), "--quiet", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    saved = json.loads((tmp_path / "results.json").read_text())
    table = g.replay.replay_gpu_table(read_mooncake(trace), policies, [200], 512)
    assert [r["policy"] for r in saved["results"]] == policies
    assert [r["hits"] for r in saved["results"]] == [r.hits for r in table.results]
    assert main(["replay", "--engine", "vllm", "--trace", str(trace), "--sizes", "10",
                 "--policies", "lfu(halflife=7)"]) == 2
    assert "policy 'lfu' has no parameter(s) halflife" in capsys.readouterr().err


# -- the engine: LLM() on a tiny random Llama --------------------------------------------------

ENGINE = textwrap.dedent('''
    import json, sys

    def main():
        model, workload, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=True,
                  dtype="float32", enforce_eager=True, max_model_len=(blocks - 1) * 32,
                  block_size=32, num_gpu_blocks_override=blocks, disable_log_stats=False,
                  gpu_memory_utilization=0.1, seed=0)
        params = SamplingParams(max_tokens=4, temperature=0)
        out = []
        for prompt in json.load(open(workload)):  # one at a time: a scripted sequence
            o = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            out.append([o.num_cached_tokens, list(o.outputs[0].token_ids)])
        names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
        metrics = {m.name: m.value for m in llm.get_metrics() if m.name in names}
        print("RESULT " + json.dumps({"metrics": metrics, "requests": out}))

    if __name__ == "__main__":
        main()
''')

ENGINE_BLOCK = 32  # the CPU attention backend needs blocks of a multiple of 32 tokens
ENGINE_BLOCKS = 13  # vLLM's override: 12 usable blocks (one is vLLM's null block)


def engine_workload() -> list[list[int]]:
    """Three chat sessions over a shared 128-token document, and one-shot prompts between
    them. Every prompt is 5 tokens past a block boundary, so the 3 decoded tokens whose KV is
    computed (max_tokens=4) never fill a block: the engine caches what the replay does."""
    rnd = random.Random(14)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(1, 512) for _ in range(n)]

    doc = toks(128)
    sessions = {s: doc + toks(5) for s in "abc"}
    order = ["a", "b", "a", "x", "x", "b", "c", "x", "x", "x", "a", "b", "c", "x", "c"]
    prompts = []
    for s in order:
        if s == "x":
            prompts.append(toks(133))
        else:
            prompts.append(list(sessions[s]))
            sessions[s] = sessions[s] + toks(32)
    return prompts


@vllm_only
def test_engine_lru_and_lfu_through_the_plugin(g, tmp_path):
    """LLM() on CPU with the plugin (its entry point, in vLLM's engine-core process):
    ``lru`` gives stock vLLM's hits and output tokens; ``lfu`` changes the hits to exactly
    what ``replay --engine vllm`` and kvevict's own replay predict, with the same output
    tokens (prefix caching is lossless); the metrics file counts the engine's evictions."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from importlib.metadata import entry_points

    from kvevict.replay import replay

    if not any(e.value == "kvevict.adapters.vllm:register_gpu_plugin"
               for e in entry_points(group="vllm.general_plugins")):
        pytest.skip("kvevict's vllm.general_plugins entry point is not installed "
                    "(pip install -e . --no-deps in this venv)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.2, tie_word_embeddings=False)
    model = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    prompts = engine_workload()
    (tmp_path / "w.json").write_text(json.dumps(prompts))
    (tmp_path / "engine.py").write_text(ENGINE)
    metrics = tmp_path / "metrics-{pid}.json"

    def run(policy: str | None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVEVICT_VLLM")}
        if policy is not None:
            env.update(KVEVICT_VLLM_POLICY=policy, KVEVICT_VLLM_METRICS=str(metrics))
        done = subprocess.run([sys.executable, str(tmp_path / "engine.py"), str(model),
                               str(tmp_path / "w.json"), str(ENGINE_BLOCKS)],
                              capture_output=True, text=True, env=env, timeout=900)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        assert lines, done.stderr[-3000:]
        return json.loads(lines[0][len("RESULT "):])

    stock, lru, lfu = run(None), run("lru"), run("lfu")
    hits = {name: [r[0] for r in out["requests"]]
            for name, out in (("stock", stock), ("lru", lru), ("lfu", lfu))}
    tokens = {name: [r[1] for r in out["requests"]]
              for name, out in (("stock", stock), ("lru", lru), ("lfu", lfu))}
    assert hits["lru"] == hits["stock"] and lru["metrics"] == stock["metrics"]
    assert hits["lfu"] != hits["stock"]
    assert tokens["lru"] == tokens["stock"] == tokens["lfu"]
    reqs = [KRequest(i, tokens=p) for i, p in enumerate(prompts)]
    for name, policy in (("stock", "vllm:lru"), ("lru", "lru"), ("lfu", "lfu")):
        predicted = g.replay.replay_gpu(reqs, policy, ENGINE_BLOCKS - 1,
                                        block_size=ENGINE_BLOCK, records=True)
        assert [r.token_hits for r in predicted.records] == hits[name], name
        out = {"stock": stock, "lru": lru, "lfu": lfu}[name]
        assert out["metrics"] == {"vllm:prefix_cache_queries": predicted.token_queries,
                                  "vllm:prefix_cache_hits": predicted.token_hits}
        if name != "stock":
            tree = replay(reqs, policy, ENGINE_BLOCKS - 1, ENGINE_BLOCK, records=True)
            assert [r.token_hits for r in tree.records] == hits[name], name
    files = sorted(tmp_path.glob("metrics-*.json"))
    assert len(files) == 2  # one per plugin run's engine-core process
    written = [json.loads(f.read_text()) for f in files]
    lfu_tier = g.replay.replay_gpu(reqs, "lfu", ENGINE_BLOCKS - 1, block_size=ENGINE_BLOCK)
    assert sorted((m["policy"], m["evictions"]) for m in written) == sorted(
        [("lru", g.replay.replay_gpu(reqs, "lru", ENGINE_BLOCKS - 1,
                                     block_size=ENGINE_BLOCK).evictions),
         ("lfu", lfu_tier.evictions)])
