"""Hand-made mutants of the production code, for `test_mutations.py`.

Each mutant replaces one production method with a wrong version (the kind of slip a refactor
makes). ``KVEVICT_MUTANT=<name> pytest ...`` runs the suite against it (see ``conftest.py``);
`test_mutations.py` checks that the suite then fails. Nothing here is imported in production.
"""

from __future__ import annotations

from kvevict.pins import Pins
from kvevict.policies.lru import LRU
from kvevict.prefix import PrefixTree


def _lru_newest_first() -> None:
    """LRU's order reversed: the most recently released candidate goes first."""

    def victim(self, now):
        if self._queue:
            return next(reversed(self._queue))
        return self._late[0][1] if self._late else None

    def pop_victim(self, now):
        chosen = victim(self, now)
        if chosen is not None and self._queue.pop(chosen, None) is None:
            del self._late_ticks[chosen]
        return chosen

    LRU.victim = victim
    LRU.pop_victim = pop_victim


def _lru_late_to_the_back() -> None:
    """A candidate older than the queue (the parent an eviction left a leaf) joins its back,
    as if it had just been released."""

    def on_candidate(self, block, now):
        self._queue[block.block_id] = block.last_access_tick
        self._newest = max(self._newest, block.last_access_tick)

    LRU.on_candidate = on_candidate


def _no_leaf_check() -> None:
    """Every block whose last user left becomes a candidate, leaf or not."""

    def unreferenced(self, blocks):
        self._num_evictable += len(blocks)
        for block in blocks:
            self._candidates[block.block_id] = block
        return list(blocks)

    original_evict = PrefixTree.evict

    def evict(self, block):
        if block.num_children:  # an inner block: take it out, orphaning its children
            self._candidates.pop(block.block_id)
            del self._blocks[block.block_hash]
            self._num_evictable -= 1
            return None
        return original_evict(self, block)

    PrefixTree.unreferenced = unreferenced
    PrefixTree.evict = evict


def _no_pin_withholding() -> None:
    """Pinned candidates are offered to the policy like any other."""
    Pins.withhold = lambda self, block: False


MUTANTS = {
    "lru-newest-first": _lru_newest_first,
    "lru-late-to-the-back": _lru_late_to_the_back,
    "no-leaf-check": _no_leaf_check,
    "no-pin-withholding": _no_pin_withholding,
}

__all__ = ["MUTANTS"]
