"""Weights loaded from transformers give transformers' own greedy tokens and logits.

A tiny random Llama (and Qwen2, Mistral) is built from a transformers config, its weights are
randomised (norms and biases too, so a dropped bias or norm would show), loaded into the engine,
and run through `KVCacheManager` + `LlamaModel.forward_paged`: prefill of the uncached part,
then greedy decode, each decoded token appended to the manager before its K/V is computed.
The reference is ``generate(do_sample=False, output_logits=True)`` with transformers'
``DynamicCache`` (left-padded for a batch) on the full prompt. Tokens must be equal and
float32 logits within ``TOL`` of each other at every step (measured differences: < 1e-6).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvevict import BlockPool, KVCacheManager, Request  # noqa: E402
from kvevict.engine import LlamaModel  # noqa: E402
from kvevict.engine.hf import config_from_hf, from_hf, load_pretrained  # noqa: E402
from kvevict.errors import ConfigError  # noqa: E402

BLOCK = 4
VOCAB = 128
TOL = {"atol": 1e-5, "rtol": 1e-5}
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
             eos_token_id=None, pad_token_id=0)


def randomize(model, seed: int = 0):
    """Every parameter random (norm weights around 1), so each one matters to the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if "norm" in name else noise)
    return model.eval()


def hf_model(kind: str = "llama", **overrides):
    """A tiny random transformers causal LM: llama, llama3-rope (+ all biases), qwen2 (q/k/v
    biases, tied embeddings, a sliding window in layer 1), mistral (sliding window 6 and a
    head_dim other than hidden / heads)."""
    t = transformers
    params = dict(SIZES)
    if kind == "llama":
        cls, cfg_cls = t.LlamaForCausalLM, t.LlamaConfig
        params.update(rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                      rms_norm_eps=1e-5)
    elif kind == "llama3-rope":
        cls, cfg_cls = t.LlamaForCausalLM, t.LlamaConfig
        params.update(attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    elif kind == "qwen2":
        cls, cfg_cls = t.Qwen2ForCausalLM, t.Qwen2Config
        params.update(tie_word_embeddings=True, use_sliding_window=True, sliding_window=5,
                      max_window_layers=1)
    elif kind == "mistral":
        cls, cfg_cls = t.MistralForCausalLM, t.MistralConfig
        params.update(sliding_window=6, head_dim=24)
    else:
        raise ValueError(kind)
    params.update(overrides)
    torch.manual_seed(0)
    return randomize(cls(cfg_cls(**params)))


@pytest.fixture(scope="module")
def llama():
    hf = hf_model("llama")
    return hf, from_hf(hf)


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=gen).tolist()


def hf_generate(model, prompts: list[list[int]], max_new: int):
    """transformers' greedy generate (DynamicCache; left padding for a batch):
    new tokens ``[B, max_new]`` and float32 logits ``[B, max_new, vocab]``."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, output_logits=True,
                         return_dict_in_generate=True, cache=transformers.DynamicCache())
    return out.sequences[:, width:], torch.stack(out.logits, dim=1).float()


def new_manager(model: LlamaModel, num_blocks: int = 64) -> KVCacheManager:
    pool = BlockPool(num_blocks, BLOCK, model.config.layout(), device="cpu")
    return KVCacheManager(pool, "lru")


def engine_generate(model: LlamaModel, manager: KVCacheManager, requests: list[Request],
                    max_new: int):
    """Greedy decode of ``requests`` as one batch: begin each (the manager finds the cached
    prefix), prefill only the uncached tokens, then decode; a token is appended to the manager
    just before its K/V is computed, so the last one is never appended (nor cached).

    Returns new tokens ``[B, max_new]``, logits ``[B, max_new, vocab]``, the number of prompt
    tokens computed per request and the sequences (still running).
    """
    pool = manager.pool
    seqs = [manager.begin(r) for r in requests]
    entries, computed = [], []
    for seq in seqs:
        tokens = torch.as_tensor(seq.request.tokens)
        start = seq.num_hit_slots
        assert start < len(tokens), "a fully cached prompt leaves no token to compute"
        entries.append((tokens[start:], start, seq.block_table))
        computed.append(len(tokens) - start)
    steps = [model.forward_paged(pool, entries)]
    manager.check()
    for _ in range(max_new - 1):
        chosen = steps[-1].argmax(-1).tolist()
        for seq, token in zip(seqs, chosen):
            manager.append(seq.seq_id, [token])
        steps.append(model.forward_paged(pool, [
            (torch.tensor([token]), seq.num_tokens - 1, seq.block_table)
            for seq, token in zip(seqs, chosen)
        ]))
        manager.check()
    logits = torch.stack(steps, dim=1)
    return logits.argmax(-1), logits, computed, seqs


def assert_same_generation(got_tokens, got_logits, want_tokens, want_logits) -> None:
    torch.testing.assert_close(got_logits, want_logits, **TOL)
    assert got_tokens.tolist() == want_tokens.tolist()


# -- config --------------------------------------------------------------------------------


def test_config_from_hf_maps_every_option():
    cfg = config_from_hf(hf_model("llama").config)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size) == (VOCAB, 64, 2, 4, 2, 16, 128)
    assert (cfg.rope_theta, cfg.rms_eps, cfg.rope_scaling, cfg.sliding_window) == \
        (5000.0, 1e-5, None, None)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.tie_embeddings)
    assert cfg.dtype == torch.float32
    cfg = config_from_hf(hf_model("llama3-rope").config)
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.factor == 8.0
    cfg = config_from_hf(hf_model("qwen2").config)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.tie_embeddings
    assert (cfg.sliding_window, cfg.sliding_layers) == (5, (1,))
    cfg = config_from_hf(hf_model("mistral").config, dtype=torch.bfloat16)
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.head_dim) == (6, None, 24)
    assert cfg.dtype == torch.bfloat16
    assert config_from_hf(transformers.Qwen2Config(**SIZES)).sliding_window is None


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "mistral"])
def test_dense_logits_equal_transformers_forward(kind):
    hf = hf_model(kind)
    model = from_hf(hf)
    ids = torch.tensor(prompt(21, seed=1))  # longer than the sliding windows
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(model.forward_dense(ids), want, **TOL)


# -- generation through the manager and the paged pool -------------------------------------


def test_single_prompt_matches_generate(llama):
    hf, model = llama
    p = prompt(13, seed=2)
    want_tokens, want_logits = hf_generate(hf, [p], 10)
    manager = new_manager(model)
    tokens, logits, computed, _ = engine_generate(model, manager, [Request("a", tokens=p)], 10)
    assert computed == [13]
    assert_same_generation(tokens, logits, want_tokens, want_logits)


def test_batch_of_different_lengths_matches_generate(llama):
    hf, model = llama
    prompts = [prompt(n, seed=10 + n) for n in (5, 12, 19, 8)]
    want_tokens, want_logits = hf_generate(hf, prompts, 8)
    manager = new_manager(model)
    requests = [Request(f"r{i}", tokens=p) for i, p in enumerate(prompts)]
    tokens, logits, computed, _ = engine_generate(model, manager, requests, 8)
    assert computed == [5, 12, 19, 8]
    assert_same_generation(tokens, logits, want_tokens, want_logits)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_second_turn_reuses_the_cached_prefix(kind):
    hf = hf_model(kind)
    model = from_hf(hf)
    manager = new_manager(model)
    p1 = prompt(14, seed=3)
    answer, _, _, (seq,) = engine_generate(model, manager, [Request("t1", tokens=p1,
                                                                    session_id="s")], 6)
    manager.finish(seq.seq_id)
    # the last answer token was never fed back, so 14 + 5 = 19 tokens are known: 4 full blocks
    assert manager.num_cached_blocks == 4
    p2 = p1 + answer[0].tolist() + prompt(7, seed=4)
    assert manager.lookup(p2).num_cached_tokens == 16
    want_tokens, want_logits = hf_generate(hf, [p2], 8)
    tokens, logits, computed, (seq2,) = engine_generate(
        model, manager, [Request("t2", tokens=p2, session_id="s")], 8)
    assert seq2.num_cached_tokens == 16
    assert computed == [len(p2) - 16]  # only the uncached rest went through the model
    assert_same_generation(tokens, logits, want_tokens, want_logits)
    manager.finish(seq2.seq_id)
    manager.check()


def test_second_turn_leaves_the_cached_blocks_untouched(llama):
    hf, model = llama
    manager = new_manager(model)
    p1 = prompt(17, seed=5)
    answer, _, _, (seq,) = engine_generate(model, manager, [Request("t1", tokens=p1)], 4)
    manager.finish(seq.seq_id)
    p2 = p1 + answer[0].tolist() + prompt(5, seed=6)
    hit = manager.lookup(p2)
    assert hit.num_cached_tokens == 20
    before = [manager.pool.block_bytes(b) for b in hit.block_ids]
    want_tokens, want_logits = hf_generate(hf, [p2], 5)
    tokens, logits, computed, (seq2,) = engine_generate(model, manager,
                                                        [Request("t2", tokens=p2)], 5)
    assert computed == [len(p2) - 20]
    assert list(seq2.block_table[:5]) == list(hit.block_ids)
    assert [manager.pool.block_bytes(b) for b in hit.block_ids] == before
    assert_same_generation(tokens, logits, want_tokens, want_logits)


def test_partly_evicted_prefix_is_recomputed(llama):
    hf, model = llama
    manager = new_manager(model, num_blocks=24)
    evicted: list[int] = []
    manager.add_eviction_listener(lambda block, now: evicted.append(block.block_id))
    p1 = prompt(22, seed=7)
    answer, _, _, (seq,) = engine_generate(model, manager, [Request("t1", tokens=p1)], 7)
    manager.finish(seq.seq_id)
    assert manager.num_cached_blocks == 7  # 22 + 6 = 28 known tokens
    assert manager.evict(4) == 4  # leaves first: the 4 tail blocks of the conversation
    manager.check()
    # another request takes the freed blocks and overwrites them with its own K/V
    filler, _, _, (fseq,) = engine_generate(model, manager,
                                            [Request("other", tokens=prompt(30, seed=8))], 2)
    assert set(evicted) & set(fseq.block_table), "the filler should reuse evicted blocks"
    manager.finish(fseq.seq_id)
    p2 = p1 + answer[0].tolist() + prompt(6, seed=9)
    want_tokens, want_logits = hf_generate(hf, [p2], 8)
    tokens, logits, computed, (seq2,) = engine_generate(model, manager,
                                                        [Request("t2", tokens=p2)], 8)
    assert seq2.num_cached_tokens == 12  # 3 of the 7 blocks survived
    assert computed == [len(p2) - 12]
    assert_same_generation(tokens, logits, want_tokens, want_logits)
    manager.finish(seq2.seq_id)
    manager.check()


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2", "mistral"])
def test_other_architectures_match_generate(kind):
    hf = hf_model(kind)
    model = from_hf(hf)
    p = prompt(15, seed=11)  # longer than qwen2's and mistral's windows
    want_tokens, want_logits = hf_generate(hf, [p], 10)
    manager = new_manager(model)
    tokens, logits, _, _ = engine_generate(model, manager, [Request("a", tokens=p)], 10)
    assert_same_generation(tokens, logits, want_tokens, want_logits)


def test_load_pretrained_from_a_local_directory(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    ids = torch.tensor(prompt(9, seed=12))
    with torch.no_grad():
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(model.forward_dense(ids), want, **TOL)
    assert LlamaModel.from_pretrained(tmp_path, dtype=torch.bfloat16).config.dtype == \
        torch.bfloat16


def test_bfloat16_conversion_stays_close(llama):
    hf, model = llama
    bf16 = from_hf(hf, dtype=torch.bfloat16)
    assert bf16.config.dtype == torch.bfloat16 and bf16.embed.dtype == torch.bfloat16
    ids = torch.tensor(prompt(11, seed=13))
    torch.testing.assert_close(bf16.forward_dense(ids), model.forward_dense(ids),
                               atol=0.15, rtol=0.05)


# -- bad input -----------------------------------------------------------------------------


def test_unsupported_architecture_is_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        from_hf(gpt2)
    with pytest.raises(ConfigError, match=r"'gpt2'.*Qwen2ForCausalLM"):
        config_from_hf(gpt2.config)
    base = transformers.LlamaModel(transformers.LlamaConfig(**SIZES))  # no LM head
    with pytest.raises(ConfigError, match="unsupported architecture LlamaModel"):
        from_hf(base)
    with pytest.raises(ConfigError, match="expected a transformers causal LM"):
        from_hf({"model.embed_tokens.weight": torch.zeros(2, 2)})


def test_unsupported_rope_and_activation_are_refused():
    yarn = transformers.LlamaConfig(**SIZES, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32})
    with pytest.raises(ConfigError, match=r"'yarn' is not supported; supported: default, "
                                          r"linear, llama3"):
        config_from_hf(yarn)
    gelu = transformers.LlamaConfig(**SIZES, hidden_act="gelu")
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        config_from_hf(gelu)
    linear = transformers.LlamaConfig(**SIZES, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    assert config_from_hf(linear).rope_scaling.factor == 2.0


def test_wrong_dtypes_are_refused(llama):
    hf, _ = llama
    with pytest.raises(ConfigError, match=r"float64.*dtype=torch.float32"):
        from_hf(hf_model("llama").to(torch.float64))
    assert from_hf(hf_model("llama").to(torch.float64), dtype=torch.float32).config.dtype == \
        torch.float32
    with pytest.raises(ConfigError, match="int8"):
        from_hf(hf, dtype=torch.int8)
    with pytest.raises(ConfigError, match=r"must be a torch\.dtype"):
        from_hf(hf, dtype="float32")


def test_weights_that_do_not_match_the_config_are_refused(llama, tmp_path):
    hf, model = llama
    weights = model.weights()
    del weights["layers.1.wk"]
    with pytest.raises(ConfigError, match=r"missing \['layers.1.wk'\]"):
        LlamaModel.from_weights(model.config, weights)
    weights = model.weights()
    weights["layers.0.bq"] = torch.zeros(64)
    with pytest.raises(ConfigError, match=r"unexpected \['layers.0.bq'\]"):
        LlamaModel.from_weights(model.config, weights)
    weights = model.weights()
    weights["embed"] = weights["embed"][:, :10]
    with pytest.raises(ConfigError, match=r"'embed' has shape \(128, 10\)"):
        LlamaModel.from_weights(model.config, weights)
    # a bias the config does not announce would be silently ignored: refused instead
    odd = hf_model("llama")
    odd.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.ones(64))
    with pytest.raises(ConfigError, match=r"does not explain.*q_proj.bias"):
        from_hf(odd)
    with pytest.raises(ConfigError, match=r"no config\.json"):
        load_pretrained(tmp_path)


def test_importing_the_engine_does_not_import_transformers():
    code = ("import sys, kvevict, kvevict.engine, kvevict.engine.hf; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
