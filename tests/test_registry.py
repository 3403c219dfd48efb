"""One generic registry for block and token policies, and `build_policy`, the one way the
simulator, the replay and the engine build a policy (offline ones from the run's requests)."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest

from kvevict import ConfigError, Request, report
from kvevict.cost import CostModel
from kvevict.engine import LlamaModel, ModelConfig
from kvevict.engine.driver import default_policy_params, run_engine
from kvevict.policies import LFU, LRU, Belady, Policy, ScoredPolicy, available_policies
from kvevict.policies import base as policies_base
from kvevict.policies.learned import LearnedReuse
from kvevict.policies.registry import (
    POLICIES,
    build_policy,
    check_spec,
    is_offline,
    make_policy,
    online_first,
    parse_spec,
    register_policy,
    split_specs,
)
from kvevict.registry import Registry
from kvevict.replay import replay, replay_table
from kvevict.sim import TierConfig, simulate
from kvevict.tokens import TOKEN_POLICIES, StreamingLLM, TokenPolicy, make_token_policy
from kvevict.workloads import generate

BS = 4


def _req(i, ids, t):
    return Request(i, block_hashes=ids, num_tokens=len(ids) * BS, arrival=t)


REQS = [_req(0, [1, 2], 0.5), _req(1, [1, 3], 2.0), _req(2, [1, 2], 7.0)]


# -- the generic registry ----------------------------------------------------------------------


class Thing:
    def __init__(self, size: int = 1, *, color: str = "red") -> None:
        self.size, self.color = size, color


class Flexible(Thing):
    def __init__(self, **anything):
        super().__init__()
        self.anything = anything


def test_one_registry_class_serves_block_and_token_policies():
    assert type(POLICIES) is Registry and type(TOKEN_POLICIES) is Registry
    assert POLICIES.base is Policy and TOKEN_POLICIES.base is TokenPolicy
    assert POLICIES.names() == available_policies()
    assert policies_base.make_policy is make_policy  # the old import path is the same function
    assert policies_base.register_policy is register_policy
    assert "lru" in POLICIES and "streamingllm" in TOKEN_POLICIES and "lru" not in TOKEN_POLICIES
    assert POLICIES.get("lru") is LRU and TOKEN_POLICIES.get("streamingllm") is StreamingLLM


def test_generic_registry_registers_lists_builds_and_forgets():
    things = Registry("thing", Thing)
    assert things.register("thing")(Thing) is Thing and Thing.name == "thing"
    things.register("flexible")(Flexible)
    assert things.names() == ["flexible", "thing"]
    built = things.make("thing", 3, color="blue")
    assert (built.size, built.color) == (3, "blue")
    assert things.make("flexible", whatever=1).anything == {"whatever": 1}  # **kwargs: any
    assert things.parameters("thing") == ["size", "color"]
    things.unregister("flexible")
    assert things.names() == ["thing"]


def test_generic_registry_messages():
    things = Registry("thing", Thing)
    things.register("thing")(Thing)
    with pytest.raises(ConfigError, match=r"^unknown thing 'nope'; valid names: thing$"):
        things.get("nope")
    with pytest.raises(ConfigError, match=r"^unknown thing 'nope'; valid names: thing$"):
        things.unregister("nope")
    with pytest.raises(ConfigError, match=r"^thing 'thing' has no parameter\(s\) colour, x; it "
                                          r"accepts: size, color$"):
        things.make("thing", colour="red", x=1)
    with pytest.raises(ConfigError, match=r"^thing names are non-empty lower-case strings"):
        things.register("Thing")
    with pytest.raises(ConfigError, match="is not a Thing subclass"):
        things.register("other")(int)

    class Other(Thing):
        pass

    with pytest.raises(ConfigError, match=r"^a thing named 'thing' is already registered "
                                          r"\(Thing\)$"):
        things.register("thing")(Other)


def test_block_and_token_registries_speak_alike():
    with pytest.raises(ConfigError) as block:
        make_policy("nope")
    with pytest.raises(ConfigError) as token:
        make_token_policy("nope", budget=4)
    assert str(block.value) == f"unknown policy 'nope'; valid names: {', '.join(POLICIES.names())}"
    assert str(token.value) == ("unknown token policy 'nope'; valid names: "
                                f"{', '.join(TOKEN_POLICIES.names())}")
    with pytest.raises(ConfigError, match=r"^policy 'lru' has no parameter\(s\) budget; it "
                                          r"accepts: no parameters$"):
        make_policy("lru", budget=3)
    with pytest.raises(ConfigError, match=r"^token policy 'streamingllm' has no parameter\(s\) "
                                          r"half_life; it accepts: budget, n_sink$"):
        make_token_policy("streamingllm", budget=8, half_life=3)
    with pytest.raises(ConfigError, match="is not a Policy subclass"):
        register_policy("test-not-a-policy")(StreamingLLM)
    assert "test-not-a-policy" not in POLICIES


# -- build_policy ------------------------------------------------------------------------------


def test_build_policy_from_a_name_with_and_without_params():
    assert type(build_policy("lru")) is LRU
    lfu = build_policy("lfu", {"half_life": 7.0}, requests=REQS, block_size=BS)
    assert type(lfu) is LFU and lfu.half_life == 7.0
    market = build_policy("market", {"block_size": 8})  # a parameter named like a keyword
    assert market.block_size == 8


def test_build_policy_from_an_instance_or_a_factory():
    policy = LFU(half_life=3.0)
    assert build_policy(policy, requests=REQS) is policy
    built = build_policy(LRU)
    assert type(built) is LRU and build_policy(LRU) is not built
    with pytest.raises(ConfigError, match=r"^parameters \(half_life\) were given together with "
                                          "a policy instance or factory; policy parameters need "
                                          "a policy given by name$"):
        build_policy(policy, {"half_life": 4.0})
    with pytest.raises(ConfigError, match=r"^a policy factory returned int, not a Policy$"):
        build_policy(lambda: 3)
    with pytest.raises(ConfigError, match=r"^policy must be a registered name, a Policy or "
                                          r"a factory, got int$"):
        build_policy(3)


def test_build_policy_unknown_name_and_bad_params():
    with pytest.raises(ConfigError) as info:
        build_policy("nope", requests=REQS)
    assert str(info.value) == ("unknown policy 'nope'; valid names: "
                               f"{', '.join(available_policies())}")
    with pytest.raises(ConfigError, match=r"^policy 'lfu' has no parameter\(s\) halflife; it "
                                          r"accepts: half_life$"):
        build_policy("lfu", {"halflife": 3})


def test_a_name_may_carry_the_policys_parameters():
    """``NAME(KEY=VALUE, ...)``: JSON values (and Python's literals), else the bare string;
    built the same as the name with those parameters, by `build_policy` and `make_policy`."""
    assert parse_spec("lru") == ("lru", {})
    assert parse_spec(" learned( gaps=empirical , ghost=true ) ") == (
        "learned", {"gaps": "empirical", "ghost": True})
    assert parse_spec('market(horizon_s=30.5, n=2, a=null, b=False, c="x y", d=None)') == (
        "market", {"horizon_s": 30.5, "n": 2, "a": None, "b": False, "c": "x y", "d": None})
    assert parse_spec("lfu()") == ("lfu", {})
    assert split_specs("lru, learned(gaps=empirical, ghost=true),,lfu(half_life=7)") == [
        "lru", "learned(gaps=empirical, ghost=true)", "lfu(half_life=7)"]
    for build in (build_policy, lambda spec: make_policy(spec)):
        learned = build("learned(gaps=empirical, ghost=true, memory=300)")
        assert type(learned) is LearnedReuse
        assert (learned.gaps, learned.ghost, learned.memory) == ("empirical", True, 300.0)
        lfu = build("lfu(half_life=7)")
        assert type(lfu) is LFU and lfu.half_life == 7.0
    lfu = build_policy("lfu(half_life=7)", {}, requests=REQS, block_size=BS)
    assert lfu.half_life == 7.0
    oracle = build_policy("horizon-oracle(horizon=3)", requests=REQS, block_size=BS)
    assert oracle.horizon == 3.0 and is_offline("horizon-oracle(horizon=3)")
    assert not is_offline("lfu(half_life=7)") and not is_offline("lfu(half_life=")
    assert check_spec("lfu(half_life=7)") == ("lfu", {"half_life": 7})


def test_a_name_with_bad_parameters_is_refused_naming_them():
    form = r"expected NAME\(KEY=VALUE, \.\.\.\), e\.g\. learned\(gaps=empirical, ghost=true\)$"
    for text in ("lfu(", "lfu(half_life=7", "(half_life=7)", "lfu(half_life=7)x",
                 "lfu(a=(1))"):
        with pytest.raises(ConfigError, match=rf"^policy '{re.escape(text)}' is not a name with "
                                              rf"parameters: {form}"):
            parse_spec(text)
    for text, item in (("lfu(half_life)", "half_life"), ("lfu(=7)", "=7"),
                       ("lfu(half_life=)", "half_life="), ("lfu(half-life=7)", "half-life=7")):
        with pytest.raises(ConfigError, match=rf"^policy '{re.escape(text)}': '{item}' is not "
                                              rf"KEY=VALUE; {form}"):
            parse_spec(text)
    with pytest.raises(ConfigError, match=r"^policy 'lfu\(half_life=1, half_life=2\)' gives "
                                          r"half_life twice$"):
        parse_spec("lfu(half_life=1, half_life=2)")
    with pytest.raises(ConfigError, match=r"^policy 'lfu\(half_life=1\)': half_life given both "
                                          r"in the name and as a parameter; give each once$"):
        build_policy("lfu(half_life=1)", {"half_life": 2})
    with pytest.raises(ConfigError, match=r"^policy 'lfu' has no parameter\(s\) halflife; it "
                                          r"accepts: half_life$"):
        build_policy("lfu(halflife=3)")
    with pytest.raises(ConfigError, match=r"^policy 'lfu' has no parameter\(s\) halflife"):
        check_spec("lfu(halflife=3)")
    with pytest.raises(ConfigError, match=r"^unknown policy 'nope'; valid names: "):
        check_spec("nope(a=1)")
    with pytest.raises(ConfigError, match=r"^unbalanced parentheses in the policy list "
                                          r"'lru,lfu\(half_life=7'$"):
        split_specs("lru,lfu(half_life=7")
    with pytest.raises(ConfigError, match=r"^unbalanced parentheses in the policy list "
                                          r"'lru\),lfu\('$"):
        split_specs("lru),lfu(")


def test_a_policy_named_with_parameters_gets_what_its_name_gets_from_the_run():
    """The simulator prices a value-aware policy with the box's cost model, a tier stack with
    its reload-aware one, and the engine gives it its defaults: the same for
    ``learned(ghost=true)`` as for ``learned`` given ``ghost=True``."""
    reqs = generate("chat", seed=0, duration=900)
    cost = CostModel(attn_s_per_pair=1e-6)

    def cached(policy, **kwargs):
        run = simulate(reqs, policy, capacity_blocks=400, block_size=16, cost=cost, **kwargs)
        return [(r.request_id, r.cached_tokens) for r in run.records]

    named = cached("learned(ghost=true)")
    assert named == cached("learned", policy_params={"ghost": True})
    # the box's cost model reached it: another one chooses other victims
    assert named != cached("learned(ghost=true)", policy_params={"cost_model": CostModel()})
    tiers = TierConfig(host_blocks=200)
    assert cached("market(learn=false)", tiers=tiers) == cached(
        "market", policy_params={"learn": False}, tiers=tiers)
    assert default_policy_params("learned(ghost=true)", cost, 16) == default_policy_params(
        "learned", cost, 16) == {"cost_model": cost, "block_size": 16}


def test_build_policy_gives_an_offline_policy_the_future_on_the_time_axis():
    """Each request's accesses leave the future when it begins (`Belady.plan`), so the next
    use is the first planned access of a request that has not begun, at any clock time."""

    def next_uses(policy, block_hash):
        seen = [policy.next_use(block_hash, 100.0)]  # a clock past every planned time
        for r in REQS:
            policy.on_begin(r, [], [], 0.0)
            seen.append(policy.next_use(block_hash, 0.0))
        return seen

    by_index = build_policy("belady", requests=REQS, block_size=BS)
    assert type(by_index) is Belady and by_index.num_blocks_known == 3
    assert next_uses(by_index, 1) == [0.0, 1.0, 2.0, float("inf")]
    by_arrival = build_policy("belady", requests=REQS, block_size=BS, time_axis="arrival")
    assert next_uses(by_arrival, 2) == [0.5, 7.0, 7.0, float("inf")]
    explicit = build_policy("belady", requests=REQS, time_axis=[10.0, 20.0, 30.0])
    assert explicit.next_use(3, 0) == explicit.next_use(3, 25.0) == 20.0
    with pytest.raises(ConfigError, match="time must be one of index, arrival, got 'wall'"):
        build_policy("belady", requests=REQS, time_axis="wall")


def test_build_policy_offline_without_requests_is_a_config_error():
    with pytest.raises(ConfigError, match=re.escape(
            "policy 'belady' is offline: it needs the future; pass requests= (the requests the "
            "run will begin, in order) or its own parameters (future)")):
        build_policy("belady")
    assert type(make_policy("belady")) is Belady  # make_policy builds it without a future


def test_build_policy_offline_with_params_builds_from_them():
    given = build_policy("belady", {"future": {1: [5.0]}}, requests=REQS)
    assert given.num_blocks_known == 1 and given.next_use(1, 0) == 5.0
    with pytest.raises(ConfigError, match=re.escape(
            "policy 'belady' has no parameter(s) horizon; it accepts: future (policy 'belady' "
            "is offline: given by name alone, it is built from the run's requests)")):
        build_policy("belady", {"horizon": 3}, requests=REQS)


# -- the offline attribute ---------------------------------------------------------------------


def test_offline_marks_the_oracles_only():
    assert Belady.offline is True
    assert is_offline("belady") and is_offline(Belady) and is_offline(Belady())
    assert [n for n in available_policies() if is_offline(n)] == ["belady", "horizon-oracle",
                                                                  "reuse-oracle"]
    assert not is_offline("lru") and not is_offline(LRU())
    assert not is_offline("unbounded")  # a label that is no registered name
    assert online_first(["belady", "lru", "lfu"]) == ["lru", "lfu", "belady"]
    assert replay_table(REQS, None, [4], BS).policies[-2:] == ["belady", "infinite"]


def test_an_offline_class_needs_the_from_requests_hook():
    class NoHook(ScoredPolicy):
        offline = True

        def score(self, block, now):
            return 0.0

    with pytest.raises(ConfigError, match="offline policy NoHook needs a classmethod "
                                          "from_requests"):
        register_policy("test-no-hook")(NoHook)
    assert "test-no-hook" not in POLICIES


class RecordingOracle(Belady):
    """Belady that records how it was built: an offline policy other than "belady"."""

    calls: ClassVar[list] = []

    @classmethod
    def from_requests(cls, requests, *, block_size=None, extra_key=None, time="index"):
        reqs = list(requests)
        cls.calls.append(([r.request_id for r in reqs], block_size,
                          time if isinstance(time, str) else list(time)))
        return super().from_requests(reqs, block_size=block_size, extra_key=extra_key,
                                     time=time)


@pytest.fixture
def oracle():
    RecordingOracle.calls = []
    register_policy("test-oracle")(RecordingOracle)
    try:
        yield RecordingOracle
    finally:
        POLICIES.unregister("test-oracle")


def test_sim_replay_and_report_treat_any_offline_policy_as_the_oracle(oracle):
    assert is_offline("test-oracle")
    simulate(REQS, "test-oracle", capacity_blocks=4, block_size=BS)
    simulate(REQS, "test-oracle", capacity_blocks=4, block_size=BS, timing=False)
    replay(REQS, "test-oracle", 4, BS, time="arrival")
    assert oracle.calls == [([0, 1, 2], BS, "arrival"), ([0, 1, 2], BS, "index"),
                            ([0, 1, 2], BS, [0.5, 2.0, 7.0])]
    assert default_policy_params("test-oracle", None, BS) == {}
    names = online_first(["test-oracle", "lru", "belady"])
    assert names == ["lru", "test-oracle", "belady"]
    cells = [{**simulate(REQS, p, capacity_blocks=4, block_size=BS).summary(), "seed": s}
             for p in names for s in (0, 1)]
    # the offline policy is never chosen, even when its numbers are the best
    assert report.choose_policy(cells).policy == "lru"
    with pytest.raises(ConfigError, match="no online policy to choose from"):
        report.choose_policy([c for c in cells if c["policy"] != "lru"])
    record = report.decision_record(cells, workload="w", model="m", layout_desc="l",
                                    capacity_desc="c", command="kvevict simulate")
    assert "test-oracle (approx.)" in record  # a timed offline policy is labelled


def test_the_engine_builds_an_offline_policy_on_the_arrival_axis(oracle):
    config = ModelConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, intermediate_size=32)
    model = LlamaModel(config, seed=0)
    reqs = generate("chat", seed=0, vocab_size=32, duration=60, output_tokens_mean=4,
                    user_tokens_mean=8, system_prompt_tokens=8)[:4]
    result = run_engine(reqs, model, "test-oracle", capacity_blocks=64, block_size=BS)
    ordered = sorted(reqs, key=lambda r: r.arrival)
    assert oracle.calls == [([r.request_id for r in ordered], BS, "arrival")]
    assert result.policy == "test-oracle"


# -- the choice and its reason -----------------------------------------------------------------


def _cells(policy, p95s, recomputed=0):
    return [{"policy": policy, "capacity_blocks": 8, "seed": s, "ttft_p95": p95,
             "recomputed_prefill_tokens": recomputed} for s, p95 in enumerate(p95s)]


def test_choice_a_significant_win_over_lru():
    choice = report.choose_policy(_cells("lru", [1.0, 1.2, 0.9, 1.1, 1.0])
                                  + _cells("lfu", [2.0, 2.2, 1.9, 2.1, 2.0])
                                  + _cells("market", [0.8, 1.0, 0.7, 0.9, 0.8])
                                  + _cells("belady", [0.1] * 5))
    assert choice.policy == "market" and choice.significant
    assert choice.difference.mean == pytest.approx(-0.2)


def test_choice_no_significant_difference_keeps_lru():
    choice = report.choose_policy(_cells("lru", [1.0, 1.2, 0.9, 1.1, 1.0])
                                  + _cells("market", [0.9, 1.3, 0.8, 1.2, 1.0]))
    assert choice.policy == "lru" and not choice.significant
    assert choice.reason.startswith("no significant difference: keep LRU (the simplest)")
