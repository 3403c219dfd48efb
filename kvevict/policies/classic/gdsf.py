"""GDSF: Greedy-Dual-Size-Frequency, a cost- and size-aware frequency policy with aging.

Source: Ludmila Cherkasova, "Improving WWW Proxies Performance with Greedy-Dual-Size-Frequency
Caching Policy", HP Laboratories report HPL-98-69R1, 1998; Greedy-Dual-Size is Cao
and Irani, "Cost-Aware WWW Proxy Caching Algorithms", USENIX USITS'97.

**The algorithm.** Every cached block ``b`` has a priority

    H(b) = L + freq(b) * cost(b) / size(b)

set when the block is inserted (``freq = 1``) and again at each hit (``freq += 1``), with the
inflation value ``L`` of that moment. The block with the lowest ``H`` is evicted and ``L``
becomes its ``H``. ``L`` therefore rises as the cache turns over, and a block not accessed for
a while is overtaken by the newer priorities: the aging that keeps once-popular blocks from
staying forever. ``freq`` counts accesses while the block is cached (forgotten at eviction).

**Cost and size.** ``cost(b)`` is the time to recompute the block, the same figure the market
and dbms policies use: ``CostModel.recompute_seconds(depth, block_size)``, i.e. prefilling its
``block_size`` tokens after ``depth * block_size`` cached ones, which grows with the depth
because of attention (`kvevict.cost`; defaults: Llama-3-8B on an H100). ``size(b)`` is the
block's ``nbytes``, or ``cost_model.kv_bytes_per_token * block_size`` when the pool keeps no KV
(a metadata-only pool, as in the replay). The ratio is kept in seconds per GiB. Every block of
one pool has the same size, so here GDSF ranks by ``freq`` times the depth-dependent recompute
cost, aged by ``L``: LFU with dynamic aging (LFU-DA) in which a deeper block's access counts
for more (with the default cost model block 0 counts 1, block 60 about 2 when blocks hold 512
tokens).

**Adaptation to a KV prefix cache.** The victim is the *candidate* (cached leaf no sequence
uses) with the lowest ``H``, ties to the least recently accessed. An access is an insertion or
a prefix hit (a release ends the request's access). A block can wait outside the candidate set
(in use, or an inner block of a chain) while ``L`` rises past its ``H``; evicting it then
would lower ``L``, so ``L`` never decreases (``L = max(L, H(victim))``). ``L`` also rises when a
block is evicted without being chosen (a pinned block the manager evicts last).

Index: candidates in a `KeyedHeap` by ``(H, access tick)``; ``H`` is fixed while a block is a
candidate (it changes only at a hit, which first takes the block out). O(log n) per event and
per victim.
"""

from __future__ import annotations

from kvevict.cost import CostModel, check_block_size, check_cost_model
from kvevict.policies.base import Policy, register_policy
from kvevict.policies.classic.base import KeyedHeap
from kvevict.types import BlockInfo

__all__ = ["GDSF"]

#: Tokens per block assumed when neither the manager nor the parameter gives one (vLLM's).
DEFAULT_BLOCK_SIZE = 16
_GIB = float(1 << 30)


class _Entry:
    __slots__ = ("block", "freq", "priority")

    def __init__(self, block: BlockInfo) -> None:
        self.block = block
        self.freq = 0
        self.priority = 0.0


@register_policy("gdsf")
class GDSF(Policy):
    """Greedy-Dual-Size-Frequency (Cherkasova 1998) over the candidates of a prefix cache;
    see the module docstring.

    Args:
        cost_model: the `CostModel` giving ``recompute_seconds`` (default: ``CostModel()``).
        block_size: tokens per block for the recompute cost and, for a metadata-only pool,
            the block's bytes; None uses the manager's block size (16 before one is bound).
    """

    def __init__(self, cost_model: CostModel | None = None,
                 block_size: int | None = None) -> None:
        self.cost_model = check_cost_model(cost_model)
        self.block_size = check_block_size(block_size)
        #: the inflation value L
        self.inflation = 0.0
        self._entries: dict[int, _Entry] = {}
        self._index = KeyedHeap()
        self._values: dict[tuple[int, int], float] = {}  # (depth, nbytes) -> cost / size

    def value(self, block: BlockInfo) -> float:
        """``cost / size`` of ``block``, in recompute seconds per GiB."""
        key = (block.depth, block.nbytes)
        value = self._values.get(key)
        if value is None:
            bs = self.block_size or self.manager_block_size or DEFAULT_BLOCK_SIZE
            cm = self.cost_model
            nbytes = block.nbytes or cm.kv_bytes_per_token * bs or 1
            value = cm.recompute_seconds(block.depth, bs) / (nbytes / _GIB)
            self._values[key] = value
        return value

    def priority(self, block_id: int) -> float | None:
        """``H`` of a cached block, None for one the policy does not hold."""
        entry = self._entries.get(block_id)
        return None if entry is None else entry.priority

    def frequency(self, block_id: int) -> int | None:
        """Accesses of a cached block since it was inserted, None if not held."""
        entry = self._entries.get(block_id)
        return None if entry is None else entry.freq

    def _access(self, block: BlockInfo, now: float = 0.0) -> _Entry:
        """One more access of ``block``: ``freq += 1``, ``H = L + freq * cost / size``; also
        ``on_hit``."""
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._entries[block.block_id] = _Entry(block)
        freq = entry.freq = entry.freq + 1
        value = self._values.get((block.depth, block.nbytes))
        if value is None:
            value = self.value(block)
        entry.priority = self.inflation + freq * value
        return entry

    def on_insert(self, block: BlockInfo, now: float) -> None:
        old = self._entries.pop(block.block_id, None)
        if old is not None:  # the id was reused without an on_evict: forget the old block
            self._index.discard(block.block_id)
        self._access(block)

    on_hit = _access  # type: ignore[assignment]

    def on_candidate(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is None or entry.block is not block:
            entry = self._access(block)
        self._index.add(block.block_id, (entry.priority, block.last_access_tick))

    def on_uncandidate(self, block: BlockInfo, now: float) -> None:
        self._index.discard(block.block_id)

    def on_evict(self, block: BlockInfo, now: float) -> None:
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.block is block:
            self._evicted(entry)

    def _evicted(self, entry: _Entry) -> None:
        block_id = entry.block.block_id
        del self._entries[block_id]
        self._index.discard(block_id)
        if entry.priority > self.inflation:
            self.inflation = entry.priority

    def victim(self, now: float) -> int | None:
        return self._index.peek()

    def pop_victim(self, now: float) -> int | None:
        chosen = self._index.pop()
        if chosen is not None:
            entry = self._entries.pop(chosen)
            if entry.priority > self.inflation:
                self.inflation = entry.priority
        return chosen

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"GDSF(block_size={self.block_size})"
