"""A small reference inference engine on top of the paged KV pool.

`kvevict.engine.model` holds a Llama-style decoder whose attention reads and writes K/V
through a `kvevict.pool.BlockPool`, plus a dense (cache-free) reference forward to check it.
"""

from __future__ import annotations

from kvevict.engine.model import LlamaModel, ModelConfig

__all__ = ["LlamaModel", "ModelConfig"]
