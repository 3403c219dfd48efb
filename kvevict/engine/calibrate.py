"""``kvevict calibrate``: fit the `CostModel` to the built-in engine on this machine.

The simulator charges a step what a `CostModel` says. To compare a simulation with a measured
engine run (fidelity), the cost model must describe *this* engine on *this* machine, so
`calibrate` times the engine's own `LlamaModel.forward_paged` over a `BlockPool`:

- **prefill** of ``n`` new tokens after ``c`` cached ones, for every ``n`` in
  ``prefill_lengths`` and ``c`` in ``cached_lengths``; fitted by non-negative least squares to
  ``prefill(n, c) = prefill_overhead_s + n * linear_s_per_token
  + attn_s_per_pair * n * (c + (n + 1) / 2)``;
- **decode** of a batch of ``B`` sequences with ``ctx`` tokens of context each, for every ``B``
  in ``decode_batches`` and ``ctx`` in ``decode_contexts``; fitted to
  ``decode = decode_step_s + B * decode_s_per_seq + B * (ctx + 1) * decode_s_per_context_token``
  (the simulator's decode step: a fixed part, a per-sequence part, a per-context-token part);
- **mixed decode batches**: one sequence at the longest context and the others at the
  shortest, for every ``B > 1``. Whether such a batch costs like the sum of its contexts (a
  paged kernel) or like ``B`` times the longest (an engine that pads the batch into one dense
  attention call) is measured, not assumed: `CostModel.decode_pads_batch` is set to the
  rule that predicts these points better.

Each point is the median of ``repeats`` timed calls after one untimed warm-up call (the
median, not the minimum: a shared machine's typical speed is what a run will see), timed by
``timer`` (`time.perf_counter` by default; an engine run timed by another clock, such as the
thread's CPU time, is calibrated with the same one). The fit
minimises *relative* error (each equation is divided by its measured time), so short and
long calls count alike; every coefficient is kept >= 0 by trying each subset of free
coefficients and keeping the best non-negative solution (exact for three unknowns).
``kv_bytes_per_token`` comes from the model's layout; the reload bandwidth keeps its default
(the engine has no lower tier).

The K/V the timed calls attend over is whatever the pool holds (zeros): the timing of
attention does not depend on the values.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kvevict.cost import CostModel
from kvevict.engine.model import LlamaModel
from kvevict.errors import ConfigError
from kvevict.pool import BlockPool

__all__ = ["Calibration", "calibrate", "fit_decode", "fit_prefill"]

DEFAULT_PREFILL_LENGTHS = (16, 64, 256, 512)
DEFAULT_CACHED_LENGTHS = (0, 512, 2048)
DEFAULT_DECODE_BATCHES = (1, 4, 16)
DEFAULT_DECODE_CONTEXTS = (64, 512, 2048)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares ``min |a x - b|`` with ``x >= 0``, for a handful of columns: the best
    of the unconstrained solutions on every subset of columns that comes out non-negative."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b * b))
    for mask in itertools.product((False, True), repeat=k):
        cols = [i for i in range(k) if mask[i]]
        if not cols:
            continue
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(sol < 0):
            continue
        x = np.zeros(k)
        x[cols] = sol
        err = float(np.sum((a @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return best


def _relative_fit(columns: list[list[float]], seconds: list[float]) -> np.ndarray:
    a = np.array(columns, dtype=float).T
    y = np.array(seconds, dtype=float)
    if np.any(y <= 0):
        raise ConfigError("calibration timings must be positive")
    return _nnls(a / y[:, None], np.ones_like(y))


def fit_prefill(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """``(prefill_overhead_s, linear_s_per_token, attn_s_per_pair)`` from ``(n, c,
    seconds)`` samples (non-negative, relative least squares)."""
    if len(samples) < 3:
        raise ConfigError(f"a prefill fit needs at least 3 samples, got {len(samples)}")
    cols = [[1.0] * len(samples), [float(n) for n, _, _ in samples],
            [n * (c + (n + 1) / 2) for n, c, _ in samples]]
    x = _relative_fit(cols, [s for _, _, s in samples])
    return float(x[0]), float(x[1]), float(x[2])


def fit_decode(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """``(decode_step_s, decode_s_per_seq, decode_s_per_context_token)`` from ``(batch,
    context, seconds)`` samples; a sequence's context counts its new token too, as the
    simulator counts it."""
    if len(samples) < 3:
        raise ConfigError(f"a decode fit needs at least 3 samples, got {len(samples)}")
    cols = [[1.0] * len(samples), [float(b) for b, _, _ in samples],
            [float(b * (c + 1)) for b, c, _ in samples]]
    x = _relative_fit(cols, [s for _, _, s in samples])
    return float(x[0]), float(x[1]), float(x[2])


@attrs.frozen
class Calibration:
    """A fitted `CostModel` with the measurements behind it.

    ``samples`` are dicts ``{"kind": "prefill", "new_tokens", "cached_tokens", "seconds",
    "predicted"}``, ``{"kind": "decode", "batch", "context", "seconds", "predicted"}`` or
    ``{"kind": "decode_mixed", "batch", "contexts", "seconds", "predicted"}``.
    """

    cost: CostModel
    samples: tuple[dict[str, Any], ...]
    engine: dict[str, Any]
    seconds: float

    def errors(self, kind: str) -> list[float]:
        """Relative errors ``predicted / measured - 1`` of one kind of sample."""
        return [s["predicted"] / s["seconds"] - 1 for s in self.samples if s["kind"] == kind]

    def fit_summary(self) -> dict[str, float]:
        """Mean and worst absolute relative error of the fit, per kind."""
        out = {}
        for kind in ("prefill", "decode", "decode_mixed"):
            errs = [abs(e) for e in self.errors(kind)]
            out[f"{kind}_mean_abs_rel_err"] = round(float(np.mean(errs)), 4) if errs else 0.0
            out[f"{kind}_max_abs_rel_err"] = round(max(errs), 4) if errs else 0.0
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"cost_model": self.cost.to_dict(), "engine": self.engine,
                "fit": self.fit_summary(), "samples": list(self.samples),
                "seconds": round(self.seconds, 3)}

    def save(self, path: str | Path) -> None:
        """Write the calibration as JSON (`CostModel.load` reads the cost model back)."""
        Path(path).write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")


def _check_lengths(name: str, values: Any, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ConfigError(f"{name} must be a non-empty list of ints >= {minimum}, got "
                          f"{values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{name} must hold ints >= {minimum}, got {v!r}")
    return tuple(sorted(set(values)))


def _timed(fn: Any, repeats: int, cuda: bool,
           timer: Callable[[], float] = time.perf_counter) -> float:
    fn()  # warm-up: allocations and kernel selection for this shape
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = timer()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(timer() - t0)
    return statistics.median(times)


def calibrate(model: LlamaModel, *, block_size: int = 16,
              prefill_lengths: Sequence[int] = DEFAULT_PREFILL_LENGTHS,
              cached_lengths: Sequence[int] = DEFAULT_CACHED_LENGTHS,
              decode_batches: Sequence[int] = DEFAULT_DECODE_BATCHES,
              decode_contexts: Sequence[int] = DEFAULT_DECODE_CONTEXTS,
              repeats: int = 3, progress: Any = None,
              timer: Callable[[], float] = time.perf_counter) -> Calibration:
    """Time ``model`` at every grid point and fit a `CostModel` (see the module docstring).

    ``progress`` (optional) is called with a short label before each grid point; ``timer``
    returns seconds (the clock the timed calls are measured with).
    """
    if not isinstance(model, LlamaModel):
        raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an int >= 1, got {repeats!r}")
    if not callable(timer):
        raise ConfigError("timer must be a callable returning seconds")
    prefill_lengths = _check_lengths("prefill_lengths", prefill_lengths, 1)
    cached_lengths = _check_lengths("cached_lengths", cached_lengths, 0)
    decode_batches = _check_lengths("decode_batches", decode_batches, 1)
    decode_contexts = _check_lengths("decode_contexts", decode_contexts, 0)
    if len(prefill_lengths) * len(cached_lengths) < 3:
        raise ConfigError("give at least 3 prefill points (prefill_lengths x cached_lengths)")
    if len(decode_batches) * len(decode_contexts) < 3:
        raise ConfigError("give at least 3 decode points (decode_batches x decode_contexts)")
    start = time.perf_counter()
    bs = block_size
    longest = max(max(prefill_lengths) + max(cached_lengths), max(decode_contexts) + 1)
    shared = -(-longest // bs)
    pool = BlockPool(shared + max(decode_batches), bs, model.config.layout(),
                     device=model.device)
    blocks = [pool.allocate() for _ in range(pool.num_blocks)]
    table, extra = blocks[:shared], blocks[shared:]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (longest,), generator=gen).to(model.device)
    cuda = model.device.type == "cuda"
    samples: list[dict[str, Any]] = []
    prefill_points = []
    for n, c in itertools.product(prefill_lengths, cached_lengths):
        if progress is not None:
            progress(f"prefill {n} after {c}")
        entry = [(ids[c:c + n], c, table)]
        s = _timed(lambda e=entry: model.forward_paged(pool, e), repeats, cuda, timer)
        prefill_points.append((n, c, s))
    decode_points = []
    mixed_points = []
    lo_ctx, hi_ctx = min(decode_contexts), max(decode_contexts)
    for b in decode_batches if lo_ctx < hi_ctx else ():
        if b < 2:
            continue
        if progress is not None:
            progress(f"decode batch {b}: one at context {hi_ctx}, the rest at {lo_ctx}")
        ctxs = [hi_ctx] + [lo_ctx] * (b - 1)
        entries = [(ids[c:c + 1], c, [*table[:c // bs], extra[j]]) for j, c in enumerate(ctxs)]
        s = _timed(lambda e=entries: model.forward_paged(pool, e), repeats, cuda, timer)
        mixed_points.append((ctxs, s))
    for b, ctx in itertools.product(decode_batches, decode_contexts):
        if progress is not None:
            progress(f"decode batch {b} context {ctx}")
        # every sequence reads the shared context and writes its new token into its own
        # last block (one writer per block per call)
        head = ctx // bs
        entries = [(ids[ctx:ctx + 1], ctx, [*table[:head], extra[j]]) for j in range(b)]
        s = _timed(lambda e=entries: model.forward_paged(pool, e), repeats, cuda, timer)
        decode_points.append((b, ctx, s))
    overhead, linear, attn = fit_prefill(prefill_points)
    step, per_seq, per_ctx = fit_decode(decode_points)
    cost = CostModel(linear_s_per_token=linear, attn_s_per_pair=attn,
                     prefill_overhead_s=overhead, decode_step_s=step,
                     decode_s_per_seq=per_seq, decode_s_per_context_token=per_ctx,
                     kv_bytes_per_token=model.config.layout().bytes_per_token)
    if mixed_points:
        padded = attrs.evolve(cost, decode_pads_batch=True)

        def miss(c: CostModel) -> float:
            return sum(abs(c.decode_batch_seconds([x + 1 for x in ctxs]) / s - 1)
                       for ctxs, s in mixed_points)

        if miss(padded) < miss(cost):
            cost = padded
    for n, c, s in prefill_points:
        samples.append({"kind": "prefill", "new_tokens": n, "cached_tokens": c,
                        "seconds": s, "predicted": cost.prefill_seconds(n, c)})
    for b, ctx, s in decode_points:
        samples.append({"kind": "decode", "batch": b, "context": ctx, "seconds": s,
                        "predicted": cost.decode_seconds(ctx + 1, b)})
    for ctxs, s in mixed_points:
        samples.append({"kind": "decode_mixed", "batch": len(ctxs), "contexts": ctxs,
                        "seconds": s,
                        "predicted": cost.decode_batch_seconds([x + 1 for x in ctxs])})
    return Calibration(cost=cost, samples=tuple(samples), engine=engine_description(model,
                                                                                    block_size),
                       seconds=time.perf_counter() - start)


def engine_description(model: LlamaModel, block_size: int | None = None) -> dict[str, Any]:
    """What a calibration or a benchmark ran on: the model's sizes, dtype, device, torch."""
    c = model.config
    params = sum(t.numel() for t in model.weights().values())
    out: dict[str, Any] = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_layers": c.num_layers,
        "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size, "dtype": str(c.dtype).replace("torch.", ""),
        "parameters": params, "device": str(model.device), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": _dt.date.today().isoformat(),
    }
    if block_size is not None:
        out["block_size"] = block_size
    return out
