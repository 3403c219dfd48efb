"""Hypothesis strategies and a stateful machine that checks any policy against the manager.

Run the shared machine on your own policy with one line in a test module::

    from kvevict.testing import machine_for
    TestMyPolicy = machine_for(lambda: MyPolicy()).TestCase

The machine drives a `KVCacheManager` through random begin / append / finish / preempt /
resume / pin / unpin / lookup / evict / clock steps next to a plain-Python model of what must
be cached, and checks after every step:

- free + used = total, and `KVCacheManager.check()` (ref counts, tree, candidate set);
- each running sequence holds one block per ``block_size`` tokens, its full blocks are the
  cached blocks of its tokens, so ref counts equal the live sequences' use;
- the set of cached blocks equals the model's (inserted by the model's rules, minus
  evictions), so prefix closure holds and lookups equal the model's;
- every eviction (seen when it happens) took a block with no running user that was a leaf,
  and never a pinned block while an unpinned candidate existed;
- ``begin`` hits exactly the model's cached prefix, and raises `OutOfBlocks` exactly when the
  model says the blocks cannot be freed;
- in tensor mode, every cached block still holds the KV bytes written when it was computed.

Hypothesis settings come from the active profile: `register_profiles` adds ``ci`` (fast, the
default of the test suite) and ``stress`` (long runs: ``pytest --hypothesis-profile=stress``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvevict.errors import OutOfBlocks
from kvevict.hashing import ROOT_HASH, block_hashes
from kvevict.layout import KVLayout
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy, make_policy
from kvevict.pool import BlockPool
from kvevict.types import WORKLOAD_CLASSES, BlockInfo, ManualClock, Request, RetentionHint

__all__ = [
    "CacheMachine",
    "machine_for",
    "register_profiles",
    "requests",
    "retention_hints",
    "stress",
    "token_ids",
]

#: A few shared "system prompts" so random requests share prefixes often.
SYSTEM_PROMPTS = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5, 5, 5, 5, 5))


def register_profiles() -> None:
    """Register the ``ci`` and ``stress`` Hypothesis profiles (idempotent)."""
    settings.register_profile(
        "ci", max_examples=20, stateful_step_count=40, deadline=None, derandomize=True,
    )
    settings.register_profile("stress", max_examples=1000, stateful_step_count=120,
                              deadline=None)


def token_ids(max_len: int = 14, vocab: int = 3) -> st.SearchStrategy[list[int]]:
    """Token id lists that often share prefixes: a shared system prompt plus a short tail
    from a tiny vocabulary."""
    tail = st.lists(st.integers(0, vocab - 1), min_size=0, max_size=max_len)
    head = st.sampled_from((*SYSTEM_PROMPTS, ()))
    return st.builds(lambda h, t: list(h) + t, head, tail).filter(lambda x: len(x) > 0)


def retention_hints() -> st.SearchStrategy[RetentionHint | None]:
    """None most of the time, else a hint with a deadline a few seconds ahead."""
    return st.one_of(
        st.none(), st.none(),
        st.builds(RetentionHint, priority=st.floats(0, 1),
                  until=st.one_of(st.none(), st.floats(0, 30))),
    )


def requests(request_id: Any, max_len: int = 14) -> st.SearchStrategy[Request]:
    """Random `Request` objects with shared prefixes, sessions, classes and hints."""
    return st.builds(
        lambda toks, session, cls, hint: Request(
            request_id, tokens=toks, session_id=session, workload_class=cls, retention=hint
        ),
        token_ids(max_len), st.integers(0, 4), st.sampled_from(WORKLOAD_CLASSES),
        retention_hints(),
    )


def _kv_value(parent_hash: int, tokens: list[int]) -> float:
    """A stand-in for the KV of the last token of ``tokens`` given the block's parent: it
    depends on the whole prefix, as real keys and values do."""
    h = hashlib.blake2b(digest_size=4)
    h.update(int(parent_hash).to_bytes(16, "little"))
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return float(int.from_bytes(h.digest(), "little") % 65521)


class _ModelSeq:
    def __init__(self, seq_id: int, tokens: list[int], session: Any, allocated: int) -> None:
        self.seq_id = seq_id
        self.tokens = tokens  # every known token
        self.session = session
        self.allocated = allocated  # token slots allocated (a chunked prefill may lag)
        self.running = True


class CacheMachine(RuleBasedStateMachine):
    """The manager next to a plain-Python model; see the module docstring for the checks.

    Subclass via `machine_for` rather than directly.
    """

    policy_factory: Callable[[], Policy] = staticmethod(lambda: make_policy("lru"))
    num_blocks = 12
    block_size = 4
    tensor = False

    running = Bundle("running")
    preempted = Bundle("preempted")

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        layout = KVLayout.gqa(num_layers=2, num_attention_heads=2, num_kv_heads=1,
                              head_dim=2, dtype="float32")
        self.pool = BlockPool(self.num_blocks, self.block_size, layout if self.tensor else None,
                              device="cpu" if self.tensor else None)
        self.manager = KVCacheManager(self.pool, self.policy_factory(), clock=self.clock)
        self.manager.add_eviction_listener(self._on_evict)
        # the model
        self.cached: dict[int, int] = {}  # hash -> parent hash
        self.pins: dict[int, float] = {}  # hash -> pinned until
        self.seqs: dict[int, _ModelSeq] = {}
        self.pending_hold: set[int] = set()
        self.next_id = 0
        self.evictions = 0

    # -- model helpers ---------------------------------------------------------------------

    def _hashes(self, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, self.block_size)

    def _model_hits(self, tokens: list[int]) -> int:
        n = 0
        for h in self._hashes(tokens):
            if h not in self.cached:
                break
            n += 1
        return n

    def _held(self) -> tuple[set[int], int]:
        """Hashes of full blocks held by running sequences, and their number of partial
        blocks."""
        held: set[int] = set(self.pending_hold)
        partial = 0
        for s in self.seqs.values():
            if s.running:
                held.update(self._hashes(s.tokens[:s.allocated]))
                partial += 1 if s.allocated % self.block_size else 0
        return held, partial

    def _on_evict(self, block: BlockInfo, now: float) -> None:
        h = block.block_hash
        assert h in self.cached, "evicted a block the model does not hold"
        held, _ = self._held()
        assert h not in held, f"evicted block {block.block_id} while a running sequence uses it"
        assert not any(p == h for p in self.cached.values()), "evicted a non-leaf block"
        if self.pins.get(h, -math.inf) > now:
            for other in self.cached:
                is_leaf = not any(p == other for p in self.cached.values())
                if other != h and is_leaf and other not in held:
                    assert self.pins.get(other, -math.inf) > now, (
                        f"evicted pinned block {block.block_id} while candidate "
                        f"{other:#x} was unpinned"
                    )
        del self.cached[h]
        self.pins.pop(h, None)
        self.evictions += 1

    def _insert_chain(self, tokens: list[int]) -> None:
        parent = ROOT_HASH
        for h in self._hashes(tokens):
            self.cached.setdefault(h, parent)
            parent = h

    def _write_kv(self, model: _ModelSeq, start: int) -> None:
        """What an engine does: write KV for allocated tokens ``start..`` into the
        sequence's blocks."""
        if not self.tensor:
            return
        seq = self.manager.sequence(model.seq_id)
        tokens = model.tokens
        hashes = [ROOT_HASH, *self._hashes(tokens)]
        bs = self.block_size
        for pos in range(start, model.allocated):
            d, slot = divmod(pos, bs)
            v = _kv_value(hashes[d], tokens[d * bs:pos + 1])
            key = torch.full((1, 1, 2), v)
            for layer in range(2):
                self.pool.write(seq.block_table[d], layer, key, -key, start=slot)

    # -- rules -----------------------------------------------------------------------------

    @rule(target=running, tokens=token_ids(), session=st.integers(0, 4),
          cls=st.sampled_from(WORKLOAD_CLASSES), hint=retention_hints(),
          chunk=st.one_of(st.none(), st.integers(0, 6)))
    def begin(self, tokens: list[int], session: int, cls: str, hint: RetentionHint | None,
              chunk: int | None):
        seq_id = self.next_id
        self.next_id += 1
        request = Request(seq_id, tokens=tokens, session_id=session, workload_class=cls,
                          retention=hint)
        model = _ModelSeq(seq_id, list(tokens), session, 0)
        seq = self._start(model, lambda: self.manager.begin(request, max_new_tokens=chunk),
                          chunk)
        if seq is None:
            return multiple()
        self.seqs[seq_id] = model
        return seq_id

    def _start(self, model: _ModelSeq, call: Callable[[], Any], chunk: int | None) -> Any:
        """Run a begin/resume, predicting its hits and whether it must fail."""
        tokens = model.tokens
        hashes = self._hashes(tokens)
        hits = self._model_hits(tokens)
        hit_tokens = min(hits * self.block_size, len(tokens))
        target = len(tokens) if chunk is None else min(len(tokens), hit_tokens + chunk)
        held, partial = self._held()
        need = -(-target // self.block_size) - hits
        in_use = len(held | set(hashes[:hits])) + partial
        expect_oob = need > self.num_blocks - in_use
        self.pending_hold = set(hashes[:hits])
        try:
            seq = call()
        except OutOfBlocks:
            assert expect_oob, "OutOfBlocks although the model could free enough blocks"
            return None
        finally:
            self.pending_hold = set()
        assert not expect_oob, "begin/resume succeeded although the model expected OutOfBlocks"
        assert seq.num_cached_tokens == hit_tokens
        model.allocated = target
        model.running = True
        self._insert_chain(tokens[:target])
        self._write_kv(model, hit_tokens)
        return seq

    @rule(seq_id=running, n=st.one_of(st.none(), st.integers(1, 6)))
    def prefill(self, seq_id: int, n: int | None):
        model = self.seqs.get(seq_id)
        if model is None or not model.running or model.allocated == len(model.tokens):
            return
        pending = len(model.tokens) - model.allocated
        n = pending if n is None else min(n, pending)
        old = model.allocated
        held, partial = self._held()
        need = -(-(old + n) // self.block_size) - -(-old // self.block_size)
        expect_oob = need > self.num_blocks - len(held) - partial
        try:
            self.manager.prefill(seq_id, n)
        except OutOfBlocks:
            assert expect_oob, "OutOfBlocks on prefill although blocks could be freed"
            return
        assert not expect_oob, "prefill succeeded although the model expected OutOfBlocks"
        model.allocated = old + n
        self._insert_chain(model.tokens[:model.allocated])
        self._write_kv(model, old)

    @rule(seq_id=running, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, seq_id: int, tokens: list[int]):
        model = self.seqs.get(seq_id)
        if model is None or not model.running or model.allocated < len(model.tokens):
            return
        held, partial = self._held()
        old = len(model.tokens)
        need = -(-(old + len(tokens)) // self.block_size) - -(-old // self.block_size)
        expect_oob = need > self.num_blocks - len(held) - partial
        try:
            self.manager.append(seq_id, tokens)
        except OutOfBlocks:
            assert expect_oob, "OutOfBlocks on append although blocks could be freed"
            return
        assert not expect_oob, "append succeeded although the model expected OutOfBlocks"
        model.tokens.extend(tokens)
        model.allocated = len(model.tokens)
        self._insert_chain(model.tokens)
        self._write_kv(model, old)

    @rule(seq_id=st.one_of(consumes(running), consumes(preempted)))
    def finish(self, seq_id: int):
        if seq_id not in self.seqs:
            return
        self.manager.finish(seq_id)
        del self.seqs[seq_id]

    @rule(target=preempted, seq_id=consumes(running))
    def preempt(self, seq_id: int):
        if seq_id not in self.seqs:
            return multiple()
        self.manager.preempt(seq_id)
        self.seqs[seq_id].running = False
        self.seqs[seq_id].allocated = 0
        return seq_id

    @rule(target=running, seq_id=consumes(preempted),
          chunk=st.one_of(st.none(), st.integers(0, 6)))
    def resume(self, seq_id: int, chunk: int | None):
        model = self.seqs.get(seq_id)
        if model is None:
            return multiple()
        seq = self._start(model, lambda: self.manager.resume(seq_id, max_new_tokens=chunk),
                          chunk)
        if seq is None:  # out of blocks: give up on it
            self.manager.finish(seq_id)
            del self.seqs[seq_id]
            return multiple()
        return seq_id

    @rule(tokens=token_ids(), until=st.one_of(st.none(), st.floats(0, 40)))
    def pin(self, tokens: list[int], until: float | None):
        n = self.manager.pin(tokens, until=until)
        expiry = math.inf if until is None else until
        hashes = self._hashes(tokens)[:self._model_hits(tokens)]
        if expiry <= self.clock.now:
            assert n == 0
            return
        assert n == len(hashes)
        for h in hashes:
            self.pins[h] = max(self.pins.get(h, -math.inf), expiry)

    @rule(tokens=token_ids())
    def unpin(self, tokens: list[int]):
        self.manager.unpin(tokens)
        for h in self._hashes(tokens)[:self._model_hits(tokens)]:
            self.pins.pop(h, None)

    @rule(tokens=token_ids())
    def lookup(self, tokens: list[int]):
        before = self.manager.stats.as_dict()
        result = self.manager.lookup(tokens)
        assert result.num_cached_blocks == self._model_hits(tokens)
        assert self.manager.stats.as_dict() == before, "lookup changed the stats"

    @rule(seconds=st.sampled_from([0.0, 0.5, 3.0, 20.0]))
    def advance(self, seconds: float):
        self.clock.advance(seconds)

    @precondition(lambda self: self.manager.num_evictable_blocks > 0)
    @rule(count=st.integers(1, 3))
    def evict(self, count: int):
        before = self.evictions
        n = self.manager.evict(count)
        assert self.evictions - before == n

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def manager_consistent(self):
        self.manager.check()
        assert self.pool.num_free + self.pool.num_used == self.pool.num_blocks

    @invariant()
    def cached_set_matches_model(self):
        actual = {b.block_hash: b.parent_hash for b in self.manager.tree}
        assert actual == self.cached, "cached blocks differ from the model's"

    @invariant()
    def sequences_match_model(self):
        live = self.manager.sequences
        assert set(live) == set(self.seqs)
        for seq_id, model in self.seqs.items():
            seq = live[seq_id]
            assert seq.tokens == model.tokens
            if not model.running:
                assert seq.block_table == []
                continue
            assert seq.num_tokens == model.allocated
            assert len(seq.block_table) == -(-model.allocated // self.block_size)
            for d, h in enumerate(self._hashes(model.tokens[:model.allocated])):
                block = self.manager.block(seq.block_table[d])
                assert block is not None and block.block_hash == h
                assert block.ref_count >= 1

    @invariant()
    def kv_bytes_unchanged(self):
        if not self.tensor:
            return
        for block in self.manager.tree:
            tokens = block.tokens.tolist()
            for slot in range(self.block_size):
                v = _kv_value(block.parent_hash, tokens[:slot + 1])
                for layer in range(2):
                    k, val = self.pool.read(block.block_id, layer)
                    assert float(k[slot, 0, 0]) == v and float(val[slot, 0, 1]) == -v, (
                        f"KV of cached block {block.block_id} changed"
                    )


def machine_for(policy: str | Callable[[], Policy], *, num_blocks: int = 12,
                block_size: int = 4, tensor: bool = False,
                **policy_params: Any) -> type[CacheMachine]:
    """A `CacheMachine` subclass for ``policy`` (a registered name or a zero-argument factory
    returning a fresh policy). Use its ``TestCase`` attribute as a pytest test class."""
    if isinstance(policy, str):
        name = policy

        def factory() -> Policy:
            return make_policy(name, **policy_params)
    else:
        name = getattr(policy, "__name__", "custom")
        factory = policy  # type: ignore[assignment]
    attrs = {
        "policy_factory": staticmethod(factory),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "tensor": tensor,
    }
    return type(f"CacheMachine_{name}", (CacheMachine,), attrs)


# -- stress: the same machine, driven by a seeded RNG instead of Hypothesis -----------------


def _random_tokens(rng: np.random.Generator, max_len: int = 14, vocab: int = 3) -> list[int]:
    """What `token_ids` draws: a shared system prompt (or none) plus a short tail."""
    while True:
        head = (*SYSTEM_PROMPTS, ())[int(rng.integers(len(SYSTEM_PROMPTS) + 1))]
        tokens = list(head) + rng.integers(0, vocab, size=int(rng.integers(0, max_len + 1)))\
            .tolist()
        if tokens:
            return tokens


def _random_hint(rng: np.random.Generator) -> RetentionHint | None:
    """What `retention_hints` draws: None two times in three, else a hint."""
    if rng.integers(3):
        return None
    until = None if rng.integers(2) else float(rng.uniform(0, 30))
    return RetentionHint(priority=float(rng.uniform(0, 1)), until=until)


def _random_chunk(rng: np.random.Generator) -> int | None:
    return None if rng.integers(2) else int(rng.integers(0, 7))


def _pop(rng: np.random.Generator, ids: list[int]) -> int:
    return ids.pop(int(rng.integers(len(ids))))


def _stress_step(machine: CacheMachine, rng: np.random.Generator, running: list[int],
                 preempted: list[int]) -> str:
    """Run one random rule of ``machine`` (its own method: the same checks as under
    Hypothesis) and keep its bundles; return the rule's name."""
    op = int(rng.integers(11))
    if op <= 1 or (op <= 5 and not running):
        result = machine.begin(_random_tokens(rng), int(rng.integers(5)),
                               WORKLOAD_CLASSES[int(rng.integers(len(WORKLOAD_CLASSES)))],
                               _random_hint(rng), _random_chunk(rng))
        if isinstance(result, int):
            running.append(result)
        return "begin"
    if op == 2:
        n = None if rng.integers(2) else int(rng.integers(1, 7))
        machine.prefill(running[int(rng.integers(len(running)))], n)
        return "prefill"
    if op == 3:
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 7))).tolist()
        machine.append(running[int(rng.integers(len(running)))], tokens)
        return "append"
    if op == 4:
        pool = running if not preempted or rng.integers(2) else preempted
        machine.finish(_pop(rng, pool))
        return "finish"
    if op == 5:
        seq_id = _pop(rng, running)
        machine.preempt(seq_id)
        if seq_id in machine.seqs:
            preempted.append(seq_id)
        return "preempt"
    if op == 6 and preempted:
        seq_id = _pop(rng, preempted)
        machine.resume(seq_id, _random_chunk(rng))
        if seq_id in machine.seqs:
            running.append(seq_id)
        return "resume"
    if op == 7:
        until = None if rng.integers(2) else float(rng.uniform(0, 40))
        machine.pin(_random_tokens(rng), until)
        return "pin"
    if op == 8:
        machine.unpin(_random_tokens(rng))
        return "unpin"
    if op == 9 and machine.manager.num_evictable_blocks > 0:
        machine.evict(int(rng.integers(1, 4)))
        return "evict"
    if op == 10:
        machine.lookup(_random_tokens(rng))
        return "lookup"
    machine.advance([0.0, 0.5, 3.0, 20.0][int(rng.integers(4))])
    return "advance"


def _invariants(machine: CacheMachine) -> None:
    machine.manager_consistent()
    machine.cached_set_matches_model()
    machine.sequences_match_model()
    machine.kv_bytes_unchanged()


def stress(policy: str | Callable[[], Policy], ops: int = 1_000_000, *, seed: int = 0,
           steps_per_run: int = 200, num_blocks: int = 12, block_size: int = 4,
           tensor: bool = False, **policy_params: Any) -> dict[str, Any]:
    """Drive the shared machine's rules with a seeded RNG for ``ops`` operations, checking
    every invariant after each one, on fresh machines of ``steps_per_run`` steps.

    The rules and checks are the machine's own (what `machine_for` runs under Hypothesis),
    so a failure here is a failure there; it raises `AssertionError` naming the seed, the
    run and the step to reproduce it. Returns the counts by rule and the seconds taken.
    """
    import time

    cls = machine_for(policy, num_blocks=num_blocks, block_size=block_size, tensor=tensor,
                      **policy_params)
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    start = time.perf_counter()
    done = 0
    run = 0
    while done < ops:
        machine = cls()
        running: list[int] = []
        preempted: list[int] = []
        for step in range(min(steps_per_run, ops - done)):
            try:
                name = _stress_step(machine, rng, running, preempted)
                _invariants(machine)
            except Exception as exc:
                raise AssertionError(f"stress({policy!r}, seed={seed}): run {run} step {step}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            counts[name] = counts.get(name, 0) + 1
            done += 1
        machine.teardown()
        run += 1
    return {"ops": done, "runs": run, "seconds": time.perf_counter() - start,
            "by_rule": dict(sorted(counts.items()))}


def main(argv: list[str] | None = None) -> int:
    """``python -m kvevict.testing [--ops N] [--policy NAME ...] [--seed S]``: the stress
    run of docs/testing.md, one line per policy."""
    import argparse

    from kvevict.policies.registry import available_policies

    parser = argparse.ArgumentParser(description="Stress the shared stateful machine: random "
                                     "operations per policy, every invariant after each")
    parser.add_argument("--ops", type=int, default=1_000_000, help="operations per policy")
    parser.add_argument("--policy", action="append", help="a registered policy (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor", action="store_true", help="with a real KV tensor")
    args = parser.parse_args(argv)
    for name in args.policy or available_policies():
        out = stress(name, args.ops, seed=args.seed, tensor=args.tensor)
        print(f"{name:<12} {out['ops']:>9} ops in {out['runs']} runs, 0 violations, "
              f"{out['seconds']:.0f} s ({out['ops'] / out['seconds']:.0f} ops/s)  "
              f"{out['by_rule']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
