"""A small reference inference engine on top of the paged KV pool.

- `kvevict.engine.model`: a Llama-style decoder whose attention reads and writes K/V through
  a `kvevict.pool.BlockPool`, plus a dense (cache-free) reference forward to check it.
- `kvevict.engine.executor`: `EngineExecutor`, the shared scheduler's real executor.
- `kvevict.engine.driver`: `run_engine`, which replays requests through scheduler + manager +
  model with the shared run loop (`kvevict.run`) and measures (`kvevict.engine.memory`).
- `kvevict.engine.answers`: `compare_answers`, the losslessness check of two runs' answers.
- `kvevict.engine.calibrate`: `calibrate` fits the simulator's `CostModel` to this engine.
- `kvevict.engine.hf`: `from_hf` / `load_pretrained` copy a transformers Llama, Qwen2 or
  Mistral model into the engine (transformers is imported only when loading from disk).

The engine never imports the simulator (`kvevict.sim`); ``kvevict engine-bench``, which runs
both side by side, is `kvevict.engine_bench`, above the two.
"""

from __future__ import annotations

from kvevict.engine.answers import AnswerCheck, compare_answers
from kvevict.engine.calibrate import Calibration, calibrate
from kvevict.engine.driver import EngineResult, run_engine, unbounded_capacity
from kvevict.engine.executor import EngineExecutor
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
