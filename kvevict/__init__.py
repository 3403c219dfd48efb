"""kvevict: decide which KV-cache state an LLM server keeps resident, and prove it with numbers.

Core objects: `KVLayout` (bytes per token), `BlockPool` (physical blocks), `PrefixTree`
(chained-hash prefix cache), the `Policy` protocol and its registry, and `KVCacheManager`,
the one place that mutates cache state.
"""

from kvevict.admission import Admission, AdmissionDecision, AlwaysAdmit
from kvevict.cost import CostModel
from kvevict.errors import (
    AdmissionDeferred,
    ConfigError,
    KVEvictError,
    OutOfBlocks,
    PolicyError,
    TraceFormatError,
)
from kvevict.layout import KVLayout, from_hf_config
from kvevict.manager import CacheStats, InvariantError, KVCacheManager, LookupResult, Sequence
from kvevict.policies import (
    DBMS,
    LFU,
    LRU,
    BayesReuse,
    Belady,
    Market,
    MarketAdmission,
    Policy,
    RefcountPinned,
    ScoredPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from kvevict.policies.registry import build_policy, is_offline
from kvevict.pool import BlockPool
from kvevict.prefix import PrefixTree, block_hashes, hash_block
from kvevict.run import SimResult
from kvevict.scheduler import Scheduler, SchedulerConfig
from kvevict.sim import simulate
from kvevict.tokens import (
    H2O,
    KeyNorm,
    SnapKV,
    StreamingLLM,
    TokenPolicy,
    available_token_policies,
    make_token_policy,
    register_token_policy,
)
from kvevict.types import BlockInfo, ManualClock, MonotonicClock, Request, RetentionHint

__version__ = "0.1.0"

__all__ = [
    "DBMS",
    "H2O",
    "LFU",
    "LRU",
    "Admission",
    "AdmissionDecision",
    "AdmissionDeferred",
    "AlwaysAdmit",
    "BayesReuse",
    "Belady",
    "BlockInfo",
    "BlockPool",
    "CacheStats",
    "ConfigError",
    "CostModel",
    "InvariantError",
    "KVCacheManager",
    "KVEvictError",
    "KVLayout",
    "KeyNorm",
    "LookupResult",
    "ManualClock",
    "Market",
    "MarketAdmission",
    "MonotonicClock",
    "OutOfBlocks",
    "Policy",
    "PolicyError",
    "PrefixTree",
    "RefcountPinned",
    "Request",
    "RetentionHint",
    "Scheduler",
    "SchedulerConfig",
    "ScoredPolicy",
    "Sequence",
    "SimResult",
    "SnapKV",
    "StreamingLLM",
    "TokenPolicy",
    "TraceFormatError",
    "__version__",
    "available_policies",
    "available_token_policies",
    "block_hashes",
    "build_policy",
    "from_hf_config",
    "hash_block",
    "is_offline",
    "make_policy",
    "make_token_policy",
    "register_policy",
    "register_token_policy",
    "simulate",
]
