"""Tests for kvevict.load: the offered load rho of a hand-built trace computed by hand, the
decode pricing against `CostModel.decode_batch_seconds`, the fluid model's batch at rho = 1,
`rate_scaled` arrivals, `scale_for_load` and the instability message."""

from __future__ import annotations

import numpy as np
import pytest

from kvevict.box import Box, gpu_profile
from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.load import (
    OfferedLoad,
    instability_message,
    is_stable,
    offered_load,
    rate_scaled,
    scale_for_load,
)
from kvevict.run import infinite_cache_hits
from kvevict.types import Request
from kvevict.workloads import generate

#: Round numbers, so that every figure below can be done by hand.
COST = CostModel(linear_s_per_token=1e-3, attn_s_per_pair=0.0, prefill_overhead_s=0.0,
                 decode_step_s=0.01, decode_s_per_context_token=1e-5, decode_s_per_seq=1e-4,
                 kv_bytes_per_token=1024)


def trace() -> list[Request]:
    """Three requests of 16-token blocks: r1 shares r0's two blocks, r2 repeats r1."""
    return [
        Request("r0", block_hashes=("a", "b"), num_tokens=32, arrival=0.0, output_len=3),
        Request("r1", block_hashes=("a", "b", "c"), num_tokens=48, arrival=10.0, output_len=1),
        Request("r2", block_hashes=("a", "b", "c"), num_tokens=48, arrival=20.0, output_len=5),
    ]


def test_rho_of_a_hand_built_trace():
    reqs = trace()
    assert infinite_cache_hits(reqs, 16) == [0, 32, 48]
    load = offered_load(reqs, COST, 16, max_batch=4)
    # prefill: r0 all 32 tokens, r1 the 16 past the shared blocks, r2 only the last token
    prefill = (32 + 16 + 1) * 1e-3
    # decode: r0 two steps at contexts 33, 34; r1 none; r2 four steps at 49..52; each
    # sequence's share of a step of 4 is 0.01 / 4 + 1e-4 + context * 1e-5
    decode = (2 * 0.01 / 4 + 2 * 1e-4 + (33 + 34) * 1e-5
              + 4 * 0.01 / 4 + 4 * 1e-4 + (49 + 50 + 51 + 52) * 1e-5)
    rate = 2 / 20  # two intervals over 20 s
    assert load.arrival_rate == pytest.approx(rate, rel=1e-12)
    assert load.duration == 20.0
    assert load.prefill_seconds_per_s == pytest.approx(rate * prefill / 3, rel=1e-12)
    assert load.decode_seconds_per_s == pytest.approx(rate * decode / 3, rel=1e-12)
    assert load.rho == pytest.approx(rate * (prefill + decode) / 3, rel=1e-12)
    assert load.rho == pytest.approx(0.0022430, abs=1e-7)
    assert (load.requests, load.prefill_tokens, load.decode_tokens) == (3, 49, 6)
    assert load.stable and is_stable(load) and instability_message(load) is None
    # the fluid model's running batch: lambda * D * step / (1 - lambda * (P + D * x))
    x = 2 * 1e-4 + 67e-5 + 4 * 1e-4 + 202e-5
    expected = rate * 6 / 3 * 0.01 / (1 - rate * (prefill + x) / 3)
    assert load.mean_running_batch == pytest.approx(expected, rel=1e-12)


def test_decode_is_priced_as_a_share_of_decode_batch_seconds():
    one = [Request("a", block_hashes=("x",), num_tokens=16, arrival=0.0, output_len=7),
           Request("b", block_hashes=("y",), num_tokens=16, arrival=1.0, output_len=1)]
    load = offered_load(one, COST, 16, max_batch=8)
    # request a: six decode steps at contexts 17..22, each priced as 1/8 of a full step
    share = sum(COST.decode_batch_seconds([16 + k] * 8) / 8 for k in range(1, 7))
    assert load.decode_seconds_per_s == pytest.approx(1 / 1 * share / 2, rel=1e-12)
    # a bigger batch shares the weights read more widely: less decode work
    assert offered_load(one, COST, 16, max_batch=64).decode_seconds_per_s < \
        load.decode_seconds_per_s


def test_whole_prompt_and_explicit_hits():
    reqs = trace()
    whole = offered_load(reqs, COST, 16, whole_prompt=True, max_batch=4)
    assert whole.prefill_seconds_per_s == pytest.approx(0.1 * (32 + 48 + 48) * 1e-3 / 3,
                                                        rel=1e-12)
    assert whole.prefill_tokens == 128 and whole.whole_prompt
    given = offered_load(reqs, COST, 16, hit_tokens=[0, 16, np.int64(40)], max_batch=4)
    assert given.prefill_tokens == 32 + 32 + 8
    base = offered_load(reqs, COST, 16, max_batch=4)
    assert whole.rho > given.rho > base.rho  # the infinite cache is the least work
    assert whole.decode_seconds_per_s == base.decode_seconds_per_s


def test_offered_load_errors():
    reqs = trace()
    with pytest.raises(ConfigError, match="at least 2 requests"):
        offered_load(reqs[:1], COST, 16)
    same = [Request(f"s{i}", block_hashes=(f"h{i}",), num_tokens=16, arrival=3.0)
            for i in range(3)]
    with pytest.raises(ConfigError, match=r"all 3 requests arrive at t=3\.0"):
        offered_load(same, COST, 16)
    with pytest.raises(ConfigError, match="hit_tokens has 2 entries for 3 requests"):
        offered_load(reqs, COST, 16, hit_tokens=[0, 0])
    with pytest.raises(ConfigError, match=r"hit tokens must be an int in \[0, 48\]"):
        offered_load(reqs, COST, 16, hit_tokens=[0, 49, 0])
    with pytest.raises(ConfigError, match="not both"):
        offered_load(reqs, COST, 16, hit_tokens=[0, 0, 0], whole_prompt=True)
    with pytest.raises(ConfigError, match="max_batch"):
        offered_load(reqs, COST, 16, max_batch=0)
    with pytest.raises(ConfigError, match="cost must be a CostModel"):
        offered_load(reqs, None, 16)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size"):
        offered_load(reqs, COST, 0)
    with pytest.raises(ConfigError, match="Request objects"):
        offered_load([1, 2], COST, 16)  # type: ignore[list-item]


# ----------------------------------------------------------------------------- rate scale


def test_rate_scaled_arrivals_exact():
    reqs = [Request(i, block_hashes=(i,), num_tokens=16, arrival=a, output_len=2)
            for i, a in (("x", 5.0), ("y", 7.0), ("z", 11.0))]
    assert [r.arrival for r in rate_scaled(reqs, 2)] == [5.0, 6.0, 8.0]
    assert [r.arrival for r in rate_scaled(reqs, 0.5)] == [5.0, 9.0, 17.0]
    assert [r.arrival for r in rate_scaled(reqs, 1)] == [5.0, 7.0, 11.0]
    shuffled = [reqs[2], reqs[0], reqs[1]]
    out = rate_scaled(shuffled, 4)
    assert [(r.request_id, r.arrival) for r in out] == [("z", 6.5), ("x", 5.0), ("y", 5.5)]
    assert all(a.block_hashes == b.block_hashes and a.output_len == b.output_len
               for a, b in zip(out, shuffled, strict=True))
    assert rate_scaled([], 3) == []
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ConfigError, match="rate scale"):
            rate_scaled(reqs, bad)


def test_rho_is_proportional_to_the_rate_scale():
    reqs = trace()
    base = offered_load(reqs, COST, 16, max_batch=4).rho
    for factor in (0.25, 3.0, 40.0):
        assert offered_load(rate_scaled(reqs, factor), COST, 16, max_batch=4).rho == \
            pytest.approx(factor * base, rel=1e-12)


@pytest.mark.parametrize("target", [0.3, 0.7, 1.0, 1.37])
def test_scale_for_load_hits_the_target(target):
    reqs = generate("chat", duration=300.0, seed=3)
    cost = Box(gpu_profile("l4-24gb")).cost_model("llama-3-8b")
    scale = scale_for_load(reqs, cost, 16, target)
    assert offered_load(rate_scaled(reqs, scale), cost, 16).rho == pytest.approx(target,
                                                                                   abs=1e-6)
    with pytest.raises(ConfigError, match="target"):
        scale_for_load(reqs, cost, 16, 0)


def test_at_rho_one_the_running_batch_reaches_max_batch():
    """The fluid model of the module docstring: the queue is bounded while the mean running
    batch stays within max_num_seqs, which is exactly rho <= 1."""
    reqs = trace()
    for batch in (4, 16):
        at_one = offered_load(rate_scaled(reqs, scale_for_load(reqs, COST, 16, 1.0,
                                                               max_batch=batch)),
                              COST, 16, max_batch=batch)
        assert at_one.rho == pytest.approx(1.0, abs=1e-9)
        assert at_one.mean_running_batch == pytest.approx(batch, rel=1e-6)
        half = offered_load(rate_scaled(reqs, scale_for_load(reqs, COST, 16, 0.5,
                                                             max_batch=batch)),
                            COST, 16, max_batch=batch)
        assert half.mean_running_batch < batch


def test_unstable_load_says_so():
    reqs = trace()
    scale = scale_for_load(reqs, COST, 16, 1.37, max_batch=4)
    load = offered_load(rate_scaled(reqs, scale), COST, 16, max_batch=4)
    assert not load.stable and not is_stable(load)
    assert instability_message(load) == (
        "offered load \u03c1 = 1.37 \u2265 1: the queue grows without bound; latencies are "
        "not steady state")
    assert load.mean_running_batch == 4.0
    assert load.text().endswith("\n" + instability_message(load))
    assert load.text().startswith("offered load \u03c1 = 1.37: prefill ")
    d = load.to_dict()
    assert d["rho"] == pytest.approx(1.37, abs=1e-6) and d["stable"] is False
    with pytest.raises(ConfigError, match="OfferedLoad"):
        is_stable(1.37)  # type: ignore[arg-type]


def test_text_line_of_a_stable_load():
    load = offered_load(trace(), COST, 16, max_batch=4)
    assert isinstance(load, OfferedLoad)
    assert load.text() == (
        "offered load \u03c1 = 0.00: prefill 0.002 + decode 0.001 busy-seconds per second "
        "(0.100 requests/s over 20.0 s; prefill of infinite-cache misses, decode at batches "
        "of 4)")


def test_tensor_parallel_box_offers_less_load():
    reqs = generate("chat", duration=300.0, seed=1)
    one = offered_load(reqs, Box(gpu_profile("h100-sxm-80gb")).cost_model("llama-3-8b"), 16)
    two = offered_load(reqs, Box(gpu_profile("h100-sxm-80gb"), gpus=2).cost_model(
        "llama-3-8b"), 16)
    assert two.rho < one.rho
    assert two.prefill_seconds_per_s > one.prefill_seconds_per_s / 2  # the all-reduces
