"""kvevict: decide which KV-cache state an LLM server keeps resident, and prove it with numbers.

The layers, top to bottom. Imports point down: a module imports from lower layers and from a
few modules of its own layer, never from a higher one (the diagram, the exact import list and
what each module owns are in ``docs/concepts.md``, "Architecture"; ``tests/test_architecture.py``
checks them against the code):

1. entry points: ``kvevict.cli`` (the ``kvevict`` command), ``kvevict.engine_bench``,
   ``kvevict.sim``, ``kvevict.engine``, ``kvevict.replay``, ``kvevict.testing``,
   ``kvevict.adapters.hf``, and this module, which re-exports the public API. The engine never
   imports the simulator, nor the simulator the engine; ``engine_bench`` runs both.
2. ``kvevict.run``, the run loop the simulator and the engine share, over
   ``kvevict.scheduler`` (continuous batching); beside them ``kvevict.workloads`` (generators,
   traces) and ``kvevict.report`` (tables, plots, the policy choice).
3. ``kvevict.manager``: `KVCacheManager`, the only place that mutates cache state.
4. what the manager composes and consults: ``pool``, ``prefix``, ``pins``, ``invariants``,
   ``policies``, ``admission``; and ``tokens``, the lossy token-level eviction of the adapters.
5. at the bottom: ``layout``, ``cost``, ``types``, ``errors``, ``registry``.

Entry points:

- `KVCacheManager` ``(pool, policy="lru", clock=...)``: ``begin`` / ``append`` / ``finish`` /
  ``preempt`` / ``resume`` a request, ``pin`` / ``unpin``, ``lookup``, ``stats``, ``check()``.
- `BlockPool` ``(num_blocks, block_size, layout, storage=True)``: physical blocks, the free list
  and ref counts; ``storage=False`` keeps metadata only, as the simulator does.
- `PrefixTree`: cached blocks by chained hash (`hash_block`, `block_hashes`), child counts and
  the candidate set (cached, ref 0, a leaf). The manager owns one; a policy never touches it.
- `Policy`: the residency protocol, events in and a victim out, over read-only `BlockInfo`
  records; `ScoredPolicy` evicts the lowest ``score``; `register_policy` names a policy;
  `build_policy` builds one from a name, an instance or a factory (an offline one, Belady,
  from the requests) for the simulator, the replay and the engine alike.
- `simulate` ``(requests, policy, capacity_blocks=...)`` -> `SimResult`: scheduler + manager on
  a virtual clock priced by a `CostModel`.
- ``kvevict.replay.replay(requests, policy, capacity_blocks)``: block-level hit ratios, one
  request at a time, no timing.
- ``kvevict.engine``: the built-in PyTorch engine (``run_engine``, ``LlamaModel``,
  ``calibrate``), the same scheduler with a real model as its executor.
- ``kvevict.adapters.hf``: ``PagedCache`` and ``SessionStore`` for transformers ``generate()``.
- ``kvevict.testing``: ``machine_for(factory)``, the stateful machine that checks any policy.

Usage (runs as is; ``tests/test_architecture.py`` runs it)::

    from kvevict import BlockPool, KVCacheManager, Request, simulate
    from kvevict.workloads import generate
    cache = KVCacheManager(BlockPool(64, 16, storage=False), "lru")  # metadata only, no tensor
    system = list(range(32))                       # two full blocks every request shares
    for i, user in enumerate([range(1000, 1020), range(2000, 2009)]):
        seq = cache.begin(Request(f"r{i}", tokens=system + list(user)))  # hit, allocate, cache
        cache.append(seq.seq_id, [7, 8, 9])        # decode: a block that fills is cached
        cache.finish(seq.seq_id)                   # tail first: cached blocks become candidates
    cache.check(); print(seq.num_cached_tokens)    # 32: r1 hit r0's two system blocks
    print(simulate(generate("chat", duration=600.0), "market", capacity_blocks=256).summary())
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
from kvevict.hashing import block_hashes, hash_block
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
from kvevict.prefix import PrefixTree
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
