"""Token-level eviction inside PagedCache, checked against exact references.

StreamingLLM keeps a set of tokens that depends only on positions, so a generation with eviction
must equal a full recompute (no cache) where each query sees exactly the tokens the cache held
when that query ran: an explicit 4-D attention mask. The attention handed to attention-based
policies (H2O, SnapKV) must equal the model's own eager attention probabilities.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, WINDOW, build  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
)

from kvevict.adapters.hf import PagedCache  # noqa: E402
from kvevict.errors import ConfigError  # noqa: E402
from kvevict.tokens import H2O, SnapKV, StreamingLLM, TokenPolicy  # noqa: E402

TOL = {"atol": 2e-5, "rtol": 2e-5}


def prompt(batch: int, length: int, pads: tuple[int, ...] = (), seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def generate(model, cache, ids, mask, new_tokens):
    return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                          do_sample=False, return_dict_in_generate=True, output_logits=True)


# -- the StreamingLLM reference ---------------------------------------------------------------


def streaming_visibility(valid: torch.Tensor, forwards: list[tuple[int, int]], budget: int,
                         sinks: int) -> torch.Tensor:
    """Bool ``[B, 1, T, T]``: query ``p`` sees key ``k`` iff the cache held ``k`` when ``p``
    ran. Each forward adds its tokens, then (over budget) the cache keeps the ``sinks`` oldest
    and the newest valid tokens. A padding query sees itself only (it is never read)."""
    batch, length = valid.shape
    seen = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    for b in range(batch):
        kept: list[int] = []  # valid tokens held between forwards
        for start, end in forwards:
            for p in range(start, end):
                for k in kept + list(range(start, p + 1)):
                    seen[b, 0, p, k] = bool(valid[b, k])
                seen[b, 0, p, p] = True
            kept += [k for k in range(start, end) if valid[b, k]]
            if len(kept) > budget:
                kept = kept[:sinks] + kept[len(kept) - (budget - sinks):]
    return seen


def recompute(model, sequences, mask, seen, kind):
    """Logits of a no-cache forward over ``sequences`` with the explicit 4-D mask ``seen``."""
    valid = mask.bool()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    attention = seen
    if kind == "qwen2":  # the sliding layer keeps its own window over every valid token
        idx = torch.arange(seen.shape[-1])
        window = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - WINDOW)
        sliding = window[None, None] & valid[:, None, None, :]
        sliding |= torch.eye(seen.shape[-1], dtype=torch.bool)[None, None]
        attention = {"full_attention": seen, "sliding_attention": sliding}
    with torch.no_grad():
        return model(sequences, attention_mask=attention, position_ids=positions,
                     use_cache=False).logits


def check_against_reference(model, kind, outputs, masks, forwards, budget, sinks):
    """Every generated token and its logits equal the recompute over the kept tokens."""
    sequences, mask = outputs[-1].sequences, masks[-1]
    fed = sequences.shape[1] - 1  # the last generated token was never fed
    seen = streaming_visibility(mask.bool()[:, :fed], forwards, budget, sinks)
    ref = recompute(model, sequences[:, :fed], mask[:, :fed], seen, kind)
    logits = [step for out in outputs for step in out.logits]
    queries = [end - 1 for start, end in forwards if end - start >= 1]
    # forwards whose logits were sampled: the last query of each forward, in order
    assert len(logits) == len(queries)
    for step, query in zip(logits, queries):
        torch.testing.assert_close(step, ref[:, query], **TOL)
    produced = torch.cat([out.sequences[:, -len(out.logits):] for out in outputs], dim=1)
    expected = torch.stack([ref[:, q].argmax(-1) for q in queries], dim=1)
    assert torch.equal(produced, expected)


def decode_forwards(start: int, end: int) -> list[tuple[int, int]]:
    return [(p, p + 1) for p in range(start, end)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_streaming_llm_equals_recompute_over_kept_tokens(kind):
    model = build(kind)
    budget, sinks, n, new = 8, 2, 13, 10
    ids, mask = prompt(1, n)
    cache = PagedCache(model, token_policy=StreamingLLM(budget, n_sink=sinks), block_size=4)
    out = generate(model, cache, ids, mask, new)
    assert cache.stored_length == budget and cache.get_seq_length() == n + new - 1
    assert cache.get_mask_sizes(1, 0) == (budget + 1, n + new - 1 - budget)
    assert cache._paged[0].positions.tolist() == [[0, 1, 16, 17, 18, 19, 20, 21]]
    assert len(cache.block_tables[0]) == 2 and cache.pool.num_used == 2  # budget, not length
    full_mask = torch.ones_like(out.sequences)
    check_against_reference(model, kind, [out], [full_mask],
                            [(0, n)] + decode_forwards(n, n + new - 1), budget, sinks)
    ref = generate(model, DynamicCache(config=model.config), ids, mask, new)
    assert not torch.equal(ref.sequences, out.sequences)  # eviction really changed the output


def test_streaming_llm_multi_turn_equals_recompute():
    model = build()
    budget, sinks = 10, 3
    cache = PagedCache(model, token_policy=StreamingLLM(budget, n_sink=sinks), block_size=4)
    ids, mask = prompt(1, 12)
    first = generate(model, cache, ids, mask, 6)
    user = prompt(1, 5, seed=7)[0]
    turn2 = torch.cat([first.sequences, user], dim=1)
    second = generate(model, cache, turn2, torch.ones_like(turn2), 7)
    end1 = 12 + 6 - 1  # tokens fed in turn 1
    forwards = ([(0, 12)] + decode_forwards(12, end1) + [(end1, turn2.shape[1])]
                + decode_forwards(turn2.shape[1], second.sequences.shape[1] - 1))
    check_against_reference(model, "llama", [first, second],
                            [torch.ones_like(second.sequences)], forwards, budget, sinks)


def test_streaming_llm_left_padded_batch_equals_recompute():
    model = build()
    budget, sinks, n, new = 7, 2, 12, 8
    ids, mask = prompt(3, n, pads=(0, 3, 9))  # row 2 has fewer valid tokens than the budget
    cache = PagedCache(model, token_policy=StreamingLLM(budget, n_sink=sinks))
    out = generate(model, cache, ids, mask, new)
    full_mask = torch.cat([mask, torch.ones(3, new, dtype=mask.dtype)], dim=1)
    check_against_reference(model, "llama", [out], [full_mask],
                            [(0, n)] + decode_forwards(n, n + new - 1), budget, sinks)
    valid = cache._paged[0].valid
    assert valid.shape == (3, budget) and bool(valid.all())  # padding was evicted first


def test_padding_in_the_middle_remaps_the_mask():
    """A row whose padding is not on the left (a batch built by hand): the remapped mask
    keeps the kept padded slot invisible."""
    model = build()
    budget, sinks = 6, 1
    ids, mask = prompt(2, 10)
    mask[1, 4:7] = 0  # row 1 holds 7 valid tokens, padding in the middle
    cache = PagedCache(model, token_policy=StreamingLLM(budget, n_sink=sinks))
    out = generate(model, cache, ids, mask, 5)
    full_mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    check_against_reference(model, "llama", [out], [full_mask],
                            [(0, 10)] + decode_forwards(10, 14), budget, sinks)


# -- attention for H2O and SnapKV -------------------------------------------------------------


class Recorder(TokenPolicy):
    """Keeps everything (a large budget) and records the attention it is given."""

    needs_attention = True

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.calls: list[tuple[int, torch.Tensor]] = []

    def score(self, layer_idx, keys, values, positions, attention=None, *, valid=None):
        self.calls.append((layer_idx, attention.clone()))
        return positions.float()


def test_policies_get_the_models_own_attention_probabilities():
    model = build(attn_implementation="eager")
    ids, mask = prompt(2, 9, pads=(0, 2))
    recorder = Recorder(budget=64)
    cache = PagedCache(model, token_policy=recorder)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache, output_attentions=True)
        step = torch.tensor([[5], [6]])
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        out2 = model(step, attention_mask=mask2, cache=cache, output_attentions=True)
    assert [layer for layer, _ in recorder.calls] == [0, 1, 0, 1]
    valid_rows = mask.bool()
    for (_, got), want in zip(recorder.calls[:2], out.attentions):
        want = want.view(2, 2, 2, 9, 9).mean(dim=2)  # query heads averaged per kv head
        for b in range(2):  # padding queries attend nowhere in the cache's view
            torch.testing.assert_close(got[b][:, valid_rows[b]], want[b][:, valid_rows[b]],
                                       **TOL)
    for (_, got), want in zip(recorder.calls[2:], out2.attentions):
        torch.testing.assert_close(got, want.view(2, 2, 2, 1, 10).mean(dim=2), **TOL)


def test_attention_queries_limits_the_scored_queries():
    model = build()
    recorder = Recorder(budget=64)
    cache = PagedCache(model, token_policy=recorder, attention_queries=3)
    with torch.no_grad():
        model(prompt(1, 9)[0], cache=cache)
    assert [tuple(a.shape) for _, a in recorder.calls] == [(1, 2, 3, 9)] * 2


def test_h2o_keeps_the_budget_and_the_recent_window_in_every_layer():
    model = build()
    ids, mask = prompt(2, 14, pads=(0, 4))
    policy = H2O(budget=8, n_recent=3)
    cache = PagedCache(model, token_policy=policy)
    out = generate(model, cache, ids, mask, 9)
    total = out.sequences.shape[1] - 1
    assert cache.get_seq_length() == total and cache.stored_length == 8
    for layer in cache._paged:
        for row in range(2):
            kept = layer.positions[row].tolist()
            last = total - 1 - (4 if row else 0)  # row 1's positions start after its padding
            assert kept == sorted(kept) and kept[-3:] == [last - 2, last - 1, last]
        assert policy.accumulated(layer.layer_idx).shape == (2, 8)
    assert bool(cache._paged[0].valid.all())


def test_h2o_follows_beam_search():
    model = build()
    ids, mask = prompt(1, 10)
    cache = PagedCache(model, token_policy=H2O(budget=6))
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6,
                         num_beams=3, do_sample=False)
    assert out.shape == (1, 16) and cache.stored_length == 6
    assert cache.token_policy.accumulated(0).shape == (3, 6)


def test_snapkv_compresses_the_prompt_and_keeps_its_window():
    model = build()
    ids, mask = prompt(1, 24)
    cache = PagedCache(model, token_policy=SnapKV(budget=12, window_size=4))
    out = generate(model, cache, ids, mask, 1)  # the prefill only
    for layer in cache._paged:
        kept = layer.positions[0].tolist()
        assert len(kept) == 12 and kept[-4:] == [20, 21, 22, 23]  # the observation window
    with torch.no_grad():  # a decode step votes with one query: the newest token stays
        model(out.sequences[:, -1:], cache=cache)
    assert all(layer.positions[0].tolist()[-1] == 24 for layer in cache._paged)
    assert cache.stored_length == 12 and cache.get_seq_length() == 25


# -- crop and bad input -------------------------------------------------------------------------


def test_eviction_makes_the_cache_not_croppable():
    model = build()
    cache = PagedCache(model, token_policy="streamingllm", budget=6)
    assert cache.token_policy.budget == 6 and not cache.is_croppable
    generate(model, cache, *prompt(1, 9), 2)
    cache.crop(0)
    with pytest.raises(ConfigError, match="cannot be cropped"):
        cache.crop(-1)


def test_bad_token_policy_arguments():
    model = build()
    with pytest.raises(ConfigError, match="differs from the token policy's budget"):
        PagedCache(model, token_policy=StreamingLLM(8), budget=6)
    with pytest.raises(ConfigError, match="TokenPolicy"):
        PagedCache(model, token_policy=object())
    with pytest.raises(ConfigError, match="needs a token_policy"):
        PagedCache(model, budget=8)
    with pytest.raises(ConfigError, match="unknown token policy"):
        PagedCache(model, token_policy="nope", budget=8)
    with pytest.raises(ConfigError, match="attention_queries"):
        PagedCache(model, token_policy=H2O(8), attention_queries=0)
    cache = PagedCache(model, token_policy=StreamingLLM(8))
    ids, mask = prompt(1, 5)
    with pytest.raises(ConfigError, match="2-D padding mask of the whole sequence"):
        with torch.no_grad():
            model(ids, attention_mask=mask[:, 1:], cache=cache)


def test_attention_policies_need_a_q_proj_and_say_so():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64)).eval()
    with pytest.raises(ConfigError, match="q_proj, head_dim and layer_idx"):
        PagedCache(gpt2, token_policy=H2O(8))
    ids = prompt(1, 7)[0]
    cache = PagedCache(gpt2, token_policy=StreamingLLM(5, n_sink=1))  # needs no attention
    with torch.no_grad():
        gpt2(ids, cache=cache)
    assert cache.stored_length == 5 and cache.get_seq_length() == 7
