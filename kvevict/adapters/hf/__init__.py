"""Hugging Face transformers adapter: kvevict decides what stays resident, ``generate()`` runs.

- `PagedCache`: a ``transformers.Cache`` whose full-attention layers store K/V in a kvevict
  `BlockPool` (beam search shares blocks by ref count; optional token-level eviction through a
  `kvevict.tokens.TokenPolicy`).
- `SessionStore`: multi-turn prefix reuse across ``generate()`` calls over a `KVCacheManager`,
  so any kvevict residency `Policy` evicts idle sessions; with ``host_blocks=`` /
  ``disk_dir=`` evicted blocks go down to a host or disk tier, and a new process on the same
  directory resumes the conversations from disk (`model_identity` names the model there).

Targets transformers 5.x (``cache=`` replaces ``past_key_values=``, which still works). This
is the only place kvevict imports transformers; install it with ``pip install "kvevict[hf]"``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError('kvevict.adapters.hf needs transformers: pip install "kvevict[hf]"') \
        from exc

from kvevict.adapters.hf.cache import PagedCache
from kvevict.adapters.hf.hooks import remove_hooks
from kvevict.adapters.hf.layer import PagedLayer
from kvevict.adapters.hf.model import SUPPORTED_DTYPES, ModelSpec, inspect_model
from kvevict.adapters.hf.sessions import SessionStore, model_identity

__all__ = [
    "SUPPORTED_DTYPES",
    "ModelSpec",
    "PagedCache",
    "PagedLayer",
    "SessionStore",
    "inspect_model",
    "model_identity",
    "remove_hooks",
]
