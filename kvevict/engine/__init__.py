"""A small reference inference engine on top of the paged KV pool.

- `kvevict.engine.model`: a Llama-style decoder whose attention reads and writes K/V through
  a `kvevict.pool.BlockPool`, plus a dense (cache-free) reference forward to check it.
- `kvevict.engine.executor`: `EngineExecutor`, the shared scheduler's real executor, and
  `run_engine`, which replays requests through scheduler + manager + model and measures.
- `kvevict.engine.calibrate`: `calibrate` fits the simulator's `CostModel` to this engine.
- `kvevict.engine.bench`: `run_bench`, behind ``kvevict engine-bench``.
- `kvevict.engine.hf`: `from_hf` / `load_pretrained` copy a transformers Llama, Qwen2 or
  Mistral model into the engine (transformers is imported only when loading from disk).
"""

from __future__ import annotations

from kvevict.engine.calibrate import Calibration, calibrate
from kvevict.engine.executor import (
    AnswerCheck,
    EngineExecutor,
    EngineResult,
    compare_answers,
    run_engine,
    unbounded_capacity,
)
from kvevict.engine.hf import SUPPORTED_ARCHITECTURES, config_from_hf, from_hf, load_pretrained
from kvevict.engine.model import LlamaModel, ModelConfig, RopeScaling

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AnswerCheck",
    "Calibration",
    "EngineExecutor",
    "EngineResult",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "calibrate",
    "compare_answers",
    "config_from_hf",
    "from_hf",
    "load_pretrained",
    "run_engine",
    "unbounded_capacity",
]
