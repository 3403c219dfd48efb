"""Head-granular token policies (``ema_heads``, ``lkv_h``) through `make_token_policy`, in
`PagedCache` (``generate()``) and in the built-in engine.

- ``ema_heads`` keeps exactly the hand-computed slots per head, and its EMA follows them.
- With a budget at or above the sequence length both give `DynamicCache`'s greedy tokens, in
  ``generate()`` (padded batches included) and in the engine.
- Unequal per-head counts really mask: the logits equal a dense recompute under an explicit
  per-(layer, head) mask, and differ from the same recompute without it.
- On the shipped judge, HF and the engine keep the same positions per (layer, head) and give
  the same answers at 15% of a 1,024-token context.
- A bad ``select`` / ``head_counts`` is a `PolicyError`; a bad budget or parameter a
  `ConfigError`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import build

from kvevict.adapters.hf import PagedCache
from kvevict.engine import run_engine
from kvevict.engine.hf import from_hf
from kvevict.errors import ConfigError, PolicyError
from kvevict.scheduler import SchedulerConfig
from kvevict.tokens import (
    EMAHeads,
    HeadBudgets,
    HeadTokenPolicy,
    KVScorer,
    LKVHeads,
    ScorerShape,
    make_token_policy,
)
from kvevict.tokens.base import eager_attention, head_counts_of
from kvevict.tokens.heads import save_budgets
from kvevict.tokens.learned import save_scorer
from kvevict.types import Request

ONE_CHUNK = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8)
PROMPT, NEW = 30, 8


def peaked(model):
    """``model`` with every parameter redrawn at a larger scale (norms around 1), so its heads
    attend sharply and differently (as tests/test_engine_tokens.py's model)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if "norm" in name else noise)
    return model


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return peaked(build("llama"))  # 2 layers, 4 query and 2 kv heads, sdpa attention


def learned(shape: ScorerShape, seed: int = 1) -> dict:
    """Seeded random LKV-H parameters: budgets far from uniform, a per-head scorer."""
    torch.manual_seed(seed)
    budgets = HeadBudgets(shape)
    with torch.no_grad():
        budgets.logits.copy_(2 * torch.randn_like(budgets.logits))
    return {"scorer": KVScorer(shape, 16, per_head=True).eval(), "budgets": budgets}


def policy(name: str, model, budget: int):
    """``lkv_h`` with `learned` parameters; ``ema_heads`` with a short memory (decay 0.5) and 2
    recent tokens, so that on 30 tokens its heads keep apart (averaging 64 queries, every head
    keeps the first tokens of this random model)."""
    params = (learned(ScorerShape.of(model)) if name == "lkv_h"
              else {"decay": 0.5, "n_recent": 2})
    return make_token_policy(name, budget=budget, **params)


def prompt_ids(n: int = PROMPT, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed))


def per_head_positions(cache: PagedCache, row: int = 0) -> list[list[list[int]]]:
    """Per layer, per kv head, the positions of that head's valid slots in slot order."""
    out = []
    for layer in cache.layers:
        pos, valid = layer.positions[row], layer.valid[row]
        out.append([pos[h][valid[h]].tolist() for h in range(pos.shape[0])])
    return out


def engine_positions(result, rid: str = "a") -> list[list[list[int]]]:
    return [[list(h) for h in layer] for layer in result.token_positions[rid]]


# -- ema_heads on hand-built inputs -----------------------------------------------------------


def inputs(attention: list[list[float]], positions=None):
    """One sequence, 2 kv heads, T = len(attention[0]) slots; ``attention[h]`` is head h's one
    query's probabilities."""
    length = len(attention[0])
    keys = torch.zeros(1, 2, length, 4)
    pos = torch.arange(length).expand(1, 2, length) if positions is None else positions
    valid = torch.ones(1, 2, length, dtype=torch.bool)
    return keys, keys.clone(), pos.clone(), valid, torch.tensor(attention)[None, :, None, :]


def test_ema_heads_keeps_each_heads_top_ema_and_its_state_follows_the_kept_slots():
    ema = EMAHeads(2, decay=0.5, n_recent=0)
    # one query: EMA = 0.5 * p. Head 0 keeps slots 1 and 3; head 1 ties 0.3 at slots 2 and 4
    # and keeps the later one (4) beside 0.4 at slot 0.
    keys, values, pos, valid, att = inputs([[0.1, 0.5, 0.1, 0.2, 0.1],
                                            [0.4, 0.0, 0.3, 0.0, 0.3]])
    kept = ema.select(0, keys, values, pos, valid, att)
    assert kept.tolist() == [[[1, 3], [0, 4]]]
    assert torch.allclose(ema.accumulated(0), torch.tensor([[[0.25, 0.1], [0.2, 0.15]]]))
    # next forward: the kept slots (positions 1, 3 / 0, 4) and a new token at position 5;
    # EMA = 0.5 * old + 0.5 * p, the new slot starting at 0
    pos2 = torch.tensor([[[1, 3, 5], [0, 4, 5]]])
    keys, values, pos2, valid, att = inputs([[0.0, 0.1, 0.9], [0.9, 0.1, 0.0]], pos2)
    kept = ema.select(0, keys, values, pos2, valid, att)
    # head 0: 0.125, 0.1, 0.45 -> slots 0, 2 (positions 1, 5); head 1: 0.55, 0.125, 0 -> 0, 1
    assert kept.tolist() == [[[0, 2], [0, 1]]]
    assert torch.allclose(ema.accumulated(0), torch.tensor([[[0.125, 0.45], [0.55, 0.125]]]))


def test_ema_heads_drops_invalid_slots_first_and_keeps_the_newest_with_n_recent():
    ema = EMAHeads(2, decay=0.5, n_recent=1)
    keys, values, pos, valid, att = inputs([[0.6, 0.3, 0.1, 0.0], [0.1, 0.1, 0.7, 0.1]])
    valid[0, 1, 2] = False  # head 1's best slot is dead (past its count earlier)
    kept = ema.select(0, keys, values, pos, valid, att)
    # newest valid (slot 3) always kept; then head 0's best (slot 0), head 1's best valid
    # (slots 0 and 1 tie at 0.05: the later, 1)
    assert kept.tolist() == [[[0, 3], [1, 3]]]


def test_head_policies_on_an_empty_layer_keep_nothing():
    ema = EMAHeads(4)
    keys = torch.zeros(2, 2, 0, 4)
    pos = torch.zeros(2, 2, 0, dtype=torch.long)
    valid = torch.zeros(2, 2, 0, dtype=torch.bool)
    assert ema.select(0, keys, keys, pos, valid, torch.zeros(2, 2, 1, 0)).shape == (2, 2, 0)


# -- LKV-H counts ----------------------------------------------------------------------------


def test_lkv_h_counts_sum_to_the_budget_and_never_exceed_the_stored_slots(tiny):
    shape = ScorerShape.of(tiny)
    lkv = make_token_policy("lkv_h", budget=6, **learned(shape))
    for length in (7, 20, 200):
        counts = [head_counts_of(lkv, layer, length, shape.kv_heads)
                  for layer in range(shape.layers)]
        assert sum(map(sum, counts)) == 6 * shape.layers * shape.kv_heads
        assert all(1 <= n <= length for row in counts for n in row)
        assert len({n for row in counts for n in row}) > 1  # heads really differ
    # under the budget every head keeps every slot
    assert head_counts_of(lkv, 1, 5, shape.kv_heads) == [5, 5]


# -- a budget at the sequence length changes nothing -----------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_full_budget_is_dynamic_cache_in_generate_with_padding(name, attn):
    torch.set_num_threads(1)
    model = peaked(build("llama", attn_implementation=attn))
    ids = torch.stack([prompt_ids(seed=3), prompt_ids(seed=4)])
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding: invalid slots in every head
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                  min_new_tokens=NEW)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        cache = PagedCache(model, token_policy=policy(name, model, PROMPT + NEW))
        got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, want)
    assert cache.stored_length == PROMPT + NEW - 1  # nothing dropped


@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_full_budget_beam_search_is_dynamic_cache(tiny, name):
    """Beam reorders run through the per-head store (positions, validity, the EMA state)."""
    ids = prompt_ids()[None].repeat(2, 1)
    kwargs = dict(do_sample=False, num_beams=2, max_new_tokens=6, min_new_tokens=6)
    with torch.no_grad():
        want = tiny.generate(ids, **kwargs)
        got = tiny.generate(ids, cache=PagedCache(tiny, token_policy=policy(name, tiny, 60)),
                            **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_full_budget_is_the_full_cache_in_the_engine(tiny, name):
    ids = prompt_ids()
    with torch.no_grad():
        want = tiny.generate(ids[None], do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)[0, PROMPT:].tolist()
    got = run_engine([Request("a", tokens=ids.numpy(), output_len=NEW)], from_hf(tiny),
                     capacity_blocks=64, block_size=4, check=True, config=ONE_CHUNK,
                     token_policy=policy(name, tiny, PROMPT + NEW))
    assert list(got.answers["a"]) == want
    assert got.engine["token_compactions"] == 0


# -- the engine and PagedCache agree; unequal counts really mask ------------------------------


@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_engine_keeps_the_heads_positions_and_tokens_of_paged_cache(tiny, name):
    ids = prompt_ids()
    cache = PagedCache(tiny, token_policy=policy(name, tiny, 9))
    with torch.no_grad():
        out = tiny.generate(ids[None], cache=cache, do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW)
    want = per_head_positions(cache)
    result = run_engine([Request("a", tokens=ids.numpy(), output_len=NEW)], from_hf(tiny),
                        capacity_blocks=64, block_size=4, check=True, config=ONE_CHUNK,
                        token_policy=policy(name, tiny, 9))
    assert engine_positions(result) == want
    assert list(result.answers["a"]) == out[0, PROMPT:].tolist()
    counts = [len(h) for layer in want for h in layer]
    if name == "ema_heads":  # equal counts per head, different tokens
        assert counts == [9] * 4 and want[0][0] != want[0][1]
    else:  # the learned counts: different per head, the budget in total
        assert len(set(counts)) > 1 and sum(counts) == 9 * 4
        assert result.engine["token_freed_blocks"] > 0


@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_masked_sequences_batched_together_answer_as_alone(tiny, name):
    """Three sequences decoding in one engine step (some with per-head masks, run apart from
    the batched decode) answer as each does alone; the manager's invariants hold."""
    model = from_hf(tiny)
    requests = [Request(f"r{i}", tokens=prompt_ids(20 + 5 * i, seed=i).numpy(), output_len=NEW,
                        arrival=0.0) for i in range(3)]
    together = run_engine(requests, model, capacity_blocks=64, block_size=4, check=True,
                          config=ONE_CHUNK, token_policy=policy(name, tiny, 7))
    for r in requests:
        alone = run_engine([r], model, capacity_blocks=64, block_size=4, check=True,
                           config=ONE_CHUNK, token_policy=policy(name, tiny, 7))
        assert together.answers[r.request_id] == alone.answers[r.request_id]
        assert together.token_positions[r.request_id] == alone.token_positions[r.request_id]


def dense_logits(model, ids: torch.Tensor, seen: list[list[set[int]]] | None) -> torch.Tensor:
    """The last token's logits by a full recompute; with ``seen``, its query in layer ``l``,
    kv head ``h`` attends to the positions ``seen[l][h]`` only (every other query causal)."""
    from kvevict.adapters.hf.routed import attention_function

    groups = model.config.num_attention_heads // model.config.num_key_value_heads

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        bias = attention_mask[..., -key.shape[-2]:].expand(
            query.shape[0], query.shape[1], -1, -1).clone()
        if seen is not None:
            for h, allowed in enumerate(seen[module.layer_idx]):
                row = torch.full((key.shape[-2],), torch.finfo(bias.dtype).min)
                row[sorted(allowed)] = 0.0
                bias[:, h * groups:(h + 1) * groups, -1] = row
        return eager_attention(query, key, value, bias, scaling)

    with torch.no_grad(), attention_function(model, "test_heads_dense", attend,
                                             restore="sdpa"):
        return model(input_ids=ids[None]).logits[0, -1].float()


def test_unequal_head_counts_are_masked_as_a_dense_per_head_mask(tiny):
    ids = prompt_ids(PROMPT + 1)
    lkv = policy("lkv_h", tiny, 6)
    cache = PagedCache(tiny, token_policy=lkv)
    with torch.no_grad():
        tiny(input_ids=ids[None, :PROMPT], cache=cache, use_cache=True)  # prefill, evict
        kept = per_head_positions(cache)
        width = cache.stored_length
        got = tiny(input_ids=ids[None, PROMPT:], cache=cache, use_cache=True).logits[0, -1]
    counts = [len(h) for layer in kept for h in layer]
    assert len(set(counts)) > 1 and max(counts) == width  # some heads have dead slots
    seen = [[{*h, PROMPT} for h in layer] for layer in kept]
    want = dense_logits(tiny, ids, seen)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    # the mask matters: the dead slots (the width's other tokens, the same slots in the
    # store) visible to every head gives other logits
    union = [[set().union(*layer) | {PROMPT}] * len(layer) for layer in kept]
    assert not torch.allclose(got, dense_logits(tiny, ids, union), atol=1e-2)
    # and the engine's masked decode computes the same token
    result = run_engine([Request("a", tokens=ids[:PROMPT].numpy(), output_len=2,
                                 output_tokens=np.array([int(ids[PROMPT]), 0]))],
                        from_hf(tiny), capacity_blocks=64, block_size=4, check=True,
                        config=ONE_CHUNK, token_policy=policy("lkv_h", tiny, 6))
    assert result.answers["a"][1] == int(want.argmax())
    assert result.top_logits["a"][1] == pytest.approx(float(want.max()), abs=1e-4)


# -- the shipped judge -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge():
    from kvevict.judge import load_judge

    torch.set_num_threads(1)
    return load_judge()


@pytest.mark.parametrize("name", ["ema_heads", "lkv_h"])
def test_the_judge_keeps_the_same_heads_in_hf_and_the_engine(judge, name):
    """At 15% of a 1,024-token needle context, the shipped judge (and for ``lkv_h`` the
    shipped budgets and per-head scorer, loaded from files by name in both): PagedCache in
    ``generate()`` and the engine keep the same positions per (layer, head) and answer the
    same tokens."""
    from kvevict.judge import JUDGE_DIR
    from kvevict.tokens.tasks import make_items

    item = make_items("needle", 1, length=1024, seed=0)[0]
    ids = torch.tensor(item.prompt)
    budget, new = 154, len(item.answer)
    params = ({"scorer": JUDGE_DIR / "lkv_h_scorer.safetensors",
               "budgets": JUDGE_DIR / "lkv_h.safetensors"} if name == "lkv_h" else {})
    hf_policy = make_token_policy(name, budget=budget, shape=ScorerShape.of(judge), **params) \
        if params else make_token_policy(name, budget=budget)
    cache = PagedCache(judge, token_policy=hf_policy)
    with torch.no_grad():
        out = judge.generate(ids[None], attention_mask=torch.ones_like(ids)[None], cache=cache,
                             do_sample=False, max_new_tokens=new)
    want_tokens, want = out[0, len(ids):].tolist(), per_head_positions(cache)
    result = run_engine([Request("a", tokens=ids.numpy(), output_len=new)], from_hf(judge),
                        capacity_blocks=80, block_size=16, check=True,
                        config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=1),
                        token_policy=name, token_budget=budget, token_params=params)
    assert engine_positions(result) == want
    assert list(result.answers["a"]) == want_tokens
    counts = [len(h) for layer in want for h in layer]
    if name == "lkv_h":
        assert len(set(counts)) > 1 and sum(counts) == budget * 8
        assert want_tokens == list(item.answer)  # LKV-H finds the needle
    else:
        assert counts == [budget] * 8


# -- bad input -------------------------------------------------------------------------------


class Broken(HeadTokenPolicy):
    """A head policy whose select returns what ``mode`` says."""

    needs_attention: ClassVar[bool] = False

    def __init__(self, budget: int, mode: str) -> None:
        super().__init__(budget)
        self.mode = mode

    def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
        return -positions.float()

    def head_counts(self, layer_idx, length, kv_heads):
        if self.mode == "counts":
            return [length + 1] * kv_heads
        return super().head_counts(layer_idx, length, kv_heads)

    def select(self, layer_idx, keys, values, positions, valid, attention=None):
        kept = super().select(layer_idx, keys, values, positions, valid, attention)
        if self.mode == "shape":
            return kept[:, :1]
        if self.mode == "dtype":
            return kept.int()
        if self.mode == "order":
            return kept.flip(-1)
        if self.mode == "range":
            return kept + keys.shape[2]
        return kept


@pytest.mark.parametrize("mode", ["shape", "dtype", "order", "range", "counts"])
def test_a_bad_head_selection_is_a_policy_error_in_both(tiny, mode):
    ids = prompt_ids()
    cache = PagedCache(tiny, token_policy=Broken(4, mode))
    with pytest.raises(PolicyError), torch.no_grad():
        tiny(input_ids=ids[None], cache=cache, use_cache=True)
    with pytest.raises(PolicyError):
        run_engine([Request("a", tokens=ids.numpy(), output_len=2)], from_hf(tiny),
                   capacity_blocks=64, block_size=4, config=ONE_CHUNK,
                   token_policy=Broken(4, mode))


def test_bad_budgets_and_parameters_are_config_errors(tiny, tmp_path):
    shape = ScorerShape.of(tiny)
    params = learned(shape)
    for bad in (0, -3, 2.5, True):
        for name in ("ema_heads", "lkv_h"):
            with pytest.raises(ConfigError, match="budget"):
                make_token_policy(name, budget=bad, **(params if name == "lkv_h" else {}))
    with pytest.raises(ConfigError, match="decay"):
        make_token_policy("ema_heads", budget=4, decay=1.0)
    with pytest.raises(ConfigError, match="n_recent"):
        make_token_policy("ema_heads", budget=4, n_recent=-1)
    with pytest.raises(ConfigError, match="needs scorer= and budgets="):
        make_token_policy("lkv_h", budget=4, scorer=params["scorer"])
    with pytest.raises(ConfigError, match="shape="):
        make_token_policy("lkv_h", budget=4, scorer=tmp_path / "s", budgets=tmp_path / "b")
    with pytest.raises(ConfigError, match="per_head=True"):
        LKVHeads(4, scorer=KVScorer(shape), budgets=params["budgets"])
    # parameter files for another model shape are refused, naming both shapes
    other = ScorerShape(3, 2, shape.key_dim, shape.value_dim)
    save_budgets(HeadBudgets(other), tmp_path / "b.safetensors")
    save_scorer(params["scorer"], tmp_path / "s.safetensors", method="lkv_h")
    with pytest.raises(ConfigError, match="trained for a model of shape"):
        make_token_policy("lkv_h", budget=4, scorer=tmp_path / "s.safetensors",
                          budgets=tmp_path / "b.safetensors", shape=shape)
    with pytest.raises(ConfigError, match="has shape"):
        LKVHeads(4, scorer=params["scorer"], budgets=HeadBudgets(other))
    # a model with a sliding-window layer cannot mask per head
    with pytest.raises(ConfigError, match="full attention in every layer"):
        PagedCache(build("qwen2"), token_policy="ema_heads", budget=4)
    # forward_paged checks the masks it is given
    from kvevict.pool import BlockPool

    model = from_hf(tiny)
    pool = BlockPool(8, 4, layout=model.config.layout(), storage=True)
    table = [pool.allocate(), pool.allocate()]
    with pytest.raises(ConfigError, match="head_masks"):
        model.forward_paged(pool, [(prompt_ids(4), 0, table)], head_masks=[])
    with pytest.raises(ConfigError, match=r"head_masks\[0\]"):
        model.forward_paged(pool, [(prompt_ids(4), 4, table)],
                            head_masks=[torch.ones(2, 2, 3, dtype=torch.bool)])
