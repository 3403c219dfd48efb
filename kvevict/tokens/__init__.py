"""Token-level eviction: which tokens of one long sequence stay in an attention layer's cache.

A `TokenPolicy` (`kvevict.tokens.base`, where the shapes and the selection rule are
documented) scores the tokens an attention layer stores and keeps ``budget`` of them per
sequence; the caller (the Hugging Face adapter, the engine) gathers the kept keys and values.
The training-free policies are in `kvevict.tokens.heuristics`; the head-granular ones
(``ema_heads``, ``lkv_h``: each kv head keeps its own tokens) in
`kvevict.tokens.head_policies`; MoE-nD's per-layer ratios and bit widths (``moe_nd``) in
`kvevict.tokens.moe_nd`; `kvevict.tokens.tasks` holds the
synthetic long-context tasks the judge model is trained and evaluated on.
"""

from kvevict.tokens.base import (
    TOKEN_POLICIES,
    TokenPolicy,
    available_token_policies,
    make_token_policy,
    register_token_policy,
)
from kvevict.tokens.head_policies import EMAHeads, HeadTokenPolicy, LKVHeads
from kvevict.tokens.heads import EMAAttention, HeadBudgets
from kvevict.tokens.heuristics import H2O, KeyNorm, SnapKV, StreamingLLM
from kvevict.tokens.kvp import KVPolicy
from kvevict.tokens.learned import KVScorer, LearnedTokenPolicy, ScorerShape
from kvevict.tokens.lkv import LKVToken
from kvevict.tokens.moe_nd import MoEND
from kvevict.tokens.tova import TOVA

__all__ = [
    "H2O",
    "TOKEN_POLICIES",
    "TOVA",
    "EMAAttention",
    "EMAHeads",
    "HeadBudgets",
    "HeadTokenPolicy",
    "KVPolicy",
    "KVScorer",
    "KeyNorm",
    "LKVHeads",
    "LKVToken",
    "LearnedTokenPolicy",
    "MoEND",
    "ScorerShape",
    "SnapKV",
    "StreamingLLM",
    "TokenPolicy",
    "available_token_policies",
    "make_token_policy",
    "register_token_policy",
]
