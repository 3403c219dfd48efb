"""A user policy in a dozen lines: evict deep, private blocks before shallow, shared ones.

Run: python examples/custom_policy.py
"""

from kvevict import (
    BlockPool,
    KVCacheManager,
    ManualClock,
    Request,
    ScoredPolicy,
    register_policy,
)
from kvevict.testing import machine_for


@register_policy("deep-first")
class DeepFirst(ScoredPolicy):
    """Keep shallow, widely shared blocks (system prompts); drop deep private tails."""

    def score(self, block, now):
        return block.num_sharers - block.depth  # lowest score is evicted first


def victims(policy: str) -> list[tuple[str, int]]:
    """Fill a 6-block pool, then make room for a 5-block request; return who was evicted."""
    clock = ManualClock()
    manager = KVCacheManager(BlockPool(num_blocks=6, block_size=4), policy, clock=clock)
    system = [1, 2, 3, 4]
    for user in ("ann", "bob", "cy"):  # three chats share a one-block system prompt
        manager.begin(Request(user, tokens=system + [ord(user[0])] * 4, session_id=user))
        manager.finish(user)
        clock.advance(1.0)
    manager.begin(Request("dee", tokens=[7] * 8, session_id="dee"))  # a private chat, later
    manager.finish("dee")
    clock.advance(1.0)
    evicted: list[tuple[str, int]] = []
    manager.add_eviction_listener(lambda block, now: evicted.append((block.session,
                                                                      block.depth)))
    manager.begin(Request("batch", tokens=list(range(100, 120)), session_id="batch"))
    return evicted


def main() -> None:
    for policy in ("lru", "deep-first"):
        print(f"{policy:>10}: evicted (session, depth) = {victims(policy)}")
    machine_for(DeepFirst).TestCase().runTest()  # the shared invariants hold for it too
    print("stateful machine on deep-first: passed")


if __name__ == "__main__":
    main()
