"""Residency policies: the protocol, the registry and the built-in policies."""

from kvevict.policies.base import (
    Policy,
    ScoredPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from kvevict.policies.bayes import BayesReuse
from kvevict.policies.belady import Belady
from kvevict.policies.classic import ARC, GDSF, S3FIFO, SLRU, TwoQ
from kvevict.policies.dbms import DBMS
from kvevict.policies.learned import LearnedReuse
from kvevict.policies.lfu import LFU
from kvevict.policies.lru import LRU
from kvevict.policies.market import Market, MarketAdmission
from kvevict.policies.oracles import HorizonOracle, ReuseOracle
from kvevict.policies.pinned import RefcountPinned

__all__ = [
    "ARC",
    "DBMS",
    "GDSF",
    "LFU",
    "LRU",
    "S3FIFO",
    "SLRU",
    "BayesReuse",
    "Belady",
    "HorizonOracle",
    "LearnedReuse",
    "Market",
    "MarketAdmission",
    "Policy",
    "RefcountPinned",
    "ReuseOracle",
    "ScoredPolicy",
    "TwoQ",
    "available_policies",
    "make_policy",
    "register_policy",
]
