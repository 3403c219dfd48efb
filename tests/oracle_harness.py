"""The hand-built cases of the offline oracles' tests (Belady, reuse and horizon oracles).

`Harness` is a manager on a manual clock that records every eviction, by block hash, in
order; `req` builds a request of block ids (``BS`` tokens each) arriving at ``t``.
"""

from __future__ import annotations

from kvevict import BlockPool, KVCacheManager, ManualClock, Request

BS = 4  # tokens per block in the hand-built cases


def req(i, ids, t=0.0):
    return Request(i, block_hashes=ids, num_tokens=len(ids) * BS, arrival=t)


class Harness:
    """A manager on a manual clock that records every eviction (block hashes, in order)."""

    def __init__(self, num_blocks, policy):
        self.clock = ManualClock()
        self.manager = KVCacheManager(BlockPool(num_blocks, BS), policy, clock=self.clock)
        self.evicted = []
        self.manager.add_eviction_listener(lambda b, now: self.evicted.append(b.block_hash))

    def run(self, t, ids):
        """Begin and finish one request of block ids at clock time ``t``."""
        self.clock.set(t)
        seq = self.manager.begin(req(f"r{t}", ids))
        self.manager.finish(seq.seq_id)
        self.manager.check()
        return seq.num_cached_tokens // BS
