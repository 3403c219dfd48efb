"""SessionStore: multi-turn prefix reuse across generate() calls, evicted by a kvevict Policy.

Every turn is checked against a fresh DynamicCache generation over the whole conversation (the
output must not depend on what was reused), and the work is counted exactly: the tokens the
model is fed, the tokens read from the pool, and which blocks the policy evicted.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, build  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
)

from kvevict.adapters.hf import PagedCache, SessionStore  # noqa: E402
from kvevict.errors import ConfigError, OutOfBlocks  # noqa: E402
from kvevict.policies.base import ScoredPolicy  # noqa: E402
from kvevict.types import ManualClock  # noqa: E402

TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def model():
    return build()


@pytest.fixture
def fed(model):
    """Lengths of the inputs the decoder is fed, forward by forward."""
    lengths: list[int] = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True)
    yield lengths
    handle.remove()


def tokens(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=gen)


def run_turn(model, store, session, conversation, fed, new_tokens=5):
    """One turn through the store, checked against DynamicCache; returns (output, cache).

    ``fed`` ends up holding the input lengths of the store's forwards only."""
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    ref = model.generate(conversation, cache=DynamicCache(config=model.config), **kwargs)
    fed.clear()
    with store.cache_for(session, conversation) as cache:
        out = model.generate(conversation, cache=cache, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, **TOL)
    store.manager.check()
    return out.sequences, cache


def test_second_turn_prefills_only_its_new_tokens(model, fed):
    store = SessionStore(model, num_blocks=64, block_size=4, clock=ManualClock())
    conversation = tokens(15, seed=1)
    out, cache = run_turn(model, store, "ann", conversation, fed)
    assert (cache.prompt_tokens, cache.reused_tokens) == (15, 0)
    assert fed == [15, 1, 1, 1, 1]
    conversation = torch.cat([out, tokens(5, seed=2)], dim=1)  # 20 + 5 user tokens
    out, cache = run_turn(model, store, "ann", conversation, fed)
    # turn 1 computed 19 tokens (its last answer token was never fed): 4 whole blocks
    assert (cache.prompt_tokens, cache.reused_tokens) == (25, 16)
    assert fed == [9, 1, 1, 1, 1]
    conversation = torch.cat([out, tokens(3, seed=3)], dim=1)
    out, cache = run_turn(model, store, "ann", conversation, fed)
    assert (cache.prompt_tokens, cache.reused_tokens) == (33, 28)
    assert fed == [5, 1, 1, 1, 1]
    assert (store.prompt_tokens, store.reused_tokens) == (73, 44)
    assert store.stats.requests == 3 and store.stats.evictions == 0


def test_a_shared_system_prompt_hits_for_every_session(model, fed):
    store = SessionStore(model, num_blocks=64, block_size=4)
    system = tokens(12, seed=9)
    for i, session in enumerate(["ann", "bob", "cy"]):
        conversation = torch.cat([system, tokens(6, seed=i)], dim=1)
        _, cache = run_turn(model, store, session, conversation, fed, new_tokens=2)
        assert cache.reused_tokens == (0 if session == "ann" else 12)
        assert fed[0] == 18 - cache.reused_tokens
    assert store.resident_tokens(torch.cat([system, tokens(1, seed=5)], dim=1)) == 12


def test_a_fully_resident_prompt_still_prefills_one_token(model, fed):
    store = SessionStore(model, num_blocks=64, block_size=4)
    conversation = tokens(12, seed=4)
    run_turn(model, store, "ann", conversation, fed, new_tokens=2)
    before = store.pool.kv.clone()
    _, cache = run_turn(model, store, "bob", conversation, fed, new_tokens=2)
    assert cache.reused_tokens == 11 and fed == [1, 1]  # the logits need one forward
    prompt_blocks = store.manager.lookup(conversation[0]).block_ids
    assert len(prompt_blocks) == 3  # token 11 was recomputed, its cached copy left untouched
    assert torch.equal(store.pool.kv[:, :, list(prompt_blocks)],
                       before[:, :, list(prompt_blocks)])


def test_two_open_turns_computing_the_same_blocks_share_them(model):
    """Both sessions start before either computed the shared prompt: the second one's blocks
    are deduplicated to the first one's, which it leaves untouched."""
    store = SessionStore(model, num_blocks=64, block_size=4)
    conversation = tokens(10, seed=1)
    first, second = store.cache_for("ann", conversation), store.cache_for("bob", conversation)
    assert first.reused_tokens == second.reused_tokens == 0
    out_first = model.generate(conversation, cache=first, max_new_tokens=3, do_sample=False)
    before = store.pool.kv.clone()
    out_second = model.generate(conversation, cache=second, max_new_tokens=3, do_sample=False,
                                prefill_chunk_size=3)  # other shapes, other rounding
    assert torch.equal(out_first, out_second)
    assert first.block_tables[0][:3] == second.block_tables[0][:3]  # one copy of each block
    shared = first.block_tables[0][:2]
    assert torch.equal(store.pool.kv[:, :, shared], before[:, :, shared])
    first.close(), second.close()
    store.manager.check()
    assert store.pool.num_used == 3


def test_deprecated_past_key_values_argument_works(model, fed):
    store = SessionStore(model, num_blocks=64, block_size=4)
    conversation = tokens(10, seed=1)
    with store.cache_for("ann", conversation) as cache:
        first = model.generate(conversation, cache=cache, max_new_tokens=4, do_sample=False)
    conversation = torch.cat([first, tokens(3, seed=2)], dim=1)
    fed.clear()
    with store.cache_for("ann", conversation) as cache, pytest.warns(FutureWarning):
        second = model.generate(conversation, past_key_values=cache, max_new_tokens=4,
                                do_sample=False)
    assert cache.reused_tokens == 12 and fed[0] == 17 - 12
    ref = model.generate(conversation, max_new_tokens=4, do_sample=False)
    assert torch.equal(second, ref)


# -- a pool smaller than the sessions: the policy decides, the tail is recomputed --------------


class EvictBobFirst(ScoredPolicy):
    """Bob's blocks go first; otherwise least recently used."""

    def score(self, block, now):
        return (block.session != "bob", block.last_access_tick)


@pytest.mark.parametrize(("policy", "victims", "ann_reuse"), [
    ("lru", [("ann", 3)], 12),
    (EvictBobFirst(), [("bob", 3)], 16),
])
def test_a_small_pool_evicts_by_the_policy_and_recomputes_the_tail(model, fed, policy,
                                                                    victims, ann_reuse):
    """Three sessions share an 8-token system prompt; each turn fills 4 blocks of 4 tokens
    (2 shared, 2 private), but the pool has 7: the third session's decode evicts one block."""
    store = SessionStore(model, num_blocks=7, block_size=4, policy=policy)
    evicted: list[tuple[str, int]] = []
    store.manager.add_eviction_listener(lambda b, now: evicted.append((b.session, b.depth)))
    system = tokens(8, seed=9)
    outputs = {}
    for i, session in enumerate(["ann", "bob", "cy"]):
        conversation = torch.cat([system, tokens(4, seed=i)], dim=1)
        outputs[session], _ = run_turn(model, store, session, conversation, fed)
    assert evicted == victims
    assert store.pool.num_used == 7
    conversation = torch.cat([outputs["ann"], tokens(4, seed=7)], dim=1)  # 17 + 4 tokens
    _, cache = run_turn(model, store, "ann", conversation, fed, new_tokens=1)
    assert cache.reused_tokens == ann_reuse
    assert fed == [21 - ann_reuse]  # an evicted tail is simply computed again


def test_a_turn_larger_than_the_pool_raises_and_leaves_the_store_consistent(model):
    store = SessionStore(model, num_blocks=3, block_size=4)
    conversation = tokens(16, seed=1)
    with pytest.raises(OutOfBlocks), store.cache_for("ann", conversation) as cache:
        model.generate(conversation, cache=cache, max_new_tokens=2, do_sample=False)
    store.manager.check()
    assert store.pool.num_used == 0
    run_turn(model, store, "bob", tokens(9, seed=2), [], new_tokens=2)


def test_the_next_turn_of_a_session_commits_its_open_cache(model):
    store = SessionStore(model, num_blocks=64, block_size=4)
    conversation = tokens(9, seed=1)
    cache = store.cache_for("ann", conversation)
    out = model.generate(conversation, cache=cache, max_new_tokens=4, do_sample=False)
    follow_up = torch.cat([out, tokens(2, seed=3)], dim=1)
    second = store.cache_for("ann", follow_up)  # closes the first cache
    assert second.reused_tokens == 12
    with pytest.raises(ConfigError, match="closed"):
        model.generate(conversation, cache=cache, max_new_tokens=1)
    store.finish(second)
    assert store.manager.sequences == {}
    store.manager.check()


class RecordTurns(ScoredPolicy):
    """LRU that records each request's (session, turn), as the policy receives it."""

    def __init__(self):
        super().__init__()
        self.turns: list[tuple[str, int]] = []

    def on_begin(self, request, hits, new, now):
        self.turns.append((request.session_id, request.turn))

    def score(self, block, now):
        return block.last_access_tick


def test_ending_a_session_commits_its_turn_and_forgets_it_but_not_its_blocks(model):
    policy = RecordTurns()
    store = SessionStore(model, num_blocks=64, block_size=4, policy=policy)
    conversation = tokens(9, seed=1)
    with store.cache_for("ann", conversation) as cache:
        out = model.generate(conversation, cache=cache, max_new_tokens=4, do_sample=False)
    follow_up = torch.cat([out, tokens(2, seed=3)], dim=1)
    open_turn = store.cache_for("ann", follow_up)
    store.cache_for("bob", conversation).close()
    assert store.sessions == ["ann", "bob"]
    assert store.end("ann") == 2  # two turns, the second still open: committed
    with pytest.raises(ConfigError, match="closed"):
        model.generate(follow_up, cache=open_turn, max_new_tokens=1)
    assert store.sessions == ["bob"] and store.manager.sequences == {}
    again = store.cache_for("ann", follow_up)  # a new conversation over cached blocks
    assert again.reused_tokens == 12
    again.close()
    assert policy.turns == [("ann", 0), ("ann", 1), ("bob", 0), ("ann", 0)]
    for i in range(300):  # a long-lived server: the store's state follows the open sessions
        store.cache_for(i, conversation).close()
        store.end(i)
    assert store.sessions == ["bob", "ann"]
    store.manager.check()


# -- bad input ------------------------------------------------------------------------------


def test_bad_input_to_a_session_store(model):
    store = SessionStore(model, num_blocks=16, block_size=4)
    conversation = tokens(9, seed=1)
    with pytest.raises(ConfigError, match="one sequence"):
        store.cache_for("ann", torch.cat([conversation, conversation]))
    with pytest.raises(ConfigError, match="empty"):
        store.cache_for("ann", [])
    cache = store.cache_for("ann", conversation)
    with pytest.raises(ConfigError, match="differ from the prompt"):
        model.generate(tokens(9, seed=2), cache=cache, max_new_tokens=1)
    with pytest.raises(ConfigError, match="holds one sequence"):
        model.generate(conversation, cache=cache, max_new_tokens=2, num_beams=3)
    with pytest.raises(ConfigError, match="cannot be reset"):
        cache.reset()
    assert not cache.is_croppable
    model.generate(conversation, cache=cache, max_new_tokens=2)  # the cache still works
    with pytest.raises(ConfigError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ConfigError, match="returned by this store"):
        store.finish(PagedCache(model))
    with pytest.raises(ConfigError, match="belongs to a SessionStore"):
        PagedCache(model, pool=store.pool)
    cache.close()
    with pytest.raises(ConfigError, match=r"end\('cy'\): no such session"):
        store.end("cy")
    assert store.end("ann") == 1
    with pytest.raises(ConfigError, match=r"end\('ann'\): no such session.*already ended"):
        store.end("ann")
    store.manager.check()


def test_models_with_special_layers_are_rejected():
    qwen = build("qwen2")  # layer 1: a sliding window
    with pytest.raises(ConfigError, match=r"every layer to be full attention.*sliding"):
        SessionStore(qwen, num_blocks=8)
