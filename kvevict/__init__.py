"""kvevict: decide which KV-cache state an LLM server keeps resident, and prove it with numbers.

Core objects: `KVLayout` (bytes per token), `BlockPool` (physical blocks), `PrefixTree`
(chained-hash prefix cache), the `Policy` protocol and its registry, and `KVCacheManager`,
the one place that mutates cache state.
"""

from kvevict.errors import ConfigError, KVEvictError, OutOfBlocks, PolicyError, TraceFormatError
from kvevict.layout import KVLayout, from_hf_config
from kvevict.manager import CacheStats, InvariantError, KVCacheManager, LookupResult, Sequence
from kvevict.policies import (
    LFU,
    LRU,
    Policy,
    RefcountPinned,
    ScoredPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from kvevict.pool import BlockPool
from kvevict.prefix import PrefixTree, block_hashes, hash_block
from kvevict.types import BlockInfo, ManualClock, MonotonicClock, Request, RetentionHint

__version__ = "0.1.0"

__all__ = [
    "LFU",
    "LRU",
    "BlockInfo",
    "BlockPool",
    "CacheStats",
    "ConfigError",
    "InvariantError",
    "KVCacheManager",
    "KVEvictError",
    "KVLayout",
    "LookupResult",
    "ManualClock",
    "MonotonicClock",
    "OutOfBlocks",
    "Policy",
    "PolicyError",
    "PrefixTree",
    "RefcountPinned",
    "Request",
    "RetentionHint",
    "ScoredPolicy",
    "Sequence",
    "TraceFormatError",
    "__version__",
    "available_policies",
    "block_hashes",
    "from_hf_config",
    "hash_block",
    "make_policy",
    "register_policy",
]
