"""The real executor: the shared scheduler's steps run by a `LlamaModel` over a `BlockPool`.

`EngineExecutor` is the engine's half of "one scheduler, two executors" (`kvevict.scheduler`).
For every `StepPlan` it runs the model once over all the step's work, with the K/V written into
and read from the pool through each sequence's block table:

- a **prefill chunk** ``[start, end)`` computes exactly those positions; a cached prefix is
  never touched (the manager handed the chunk out starting after it), an evicted one is
  recomputed because the manager left it in the chunk;
- every **decode** computes the one token the scheduler appended;
- a **fully cached prompt** (``start == end`` with ``samples``) only needs the last prompt
  token's logits: that token is run once and the slot it wrote is restored from a copy taken
  just before, so the shared cached block is left byte for byte as it was ("peek").

Work that would write into a cached block somebody else already computed (a chunk or a decode
whose block the manager swapped for an identical cached copy, e.g. the next turn of a chat
prefilled the answer its previous turn is still decoding) skips the block: it is valid, and
rewriting it would only add rounding noise to shared state.

**Outputs: teacher forcing.** A generated request fixes its answer (``Request.output_tokens``),
and the next turn's prompt repeats that answer, so the cache reuse of the workload depends on
feeding exactly those tokens back. The executor therefore returns the fixed token to the
scheduler (`StepOutput.tokens`) and records the model's own greedy choice (the argmax of the
logits at that position) as the request's **answer**. A request without fixed outputs is
decoded greedily (its answer is what is fed back). Residency eviction is lossless, so the
answers of a run with any policy and pool size must equal those of a run with an unbounded
pool; `compare_answers` checks it.

**Time.** The scheduler's clock is the manager's clock, a `ManualClock` in *workload
seconds*. Each step's real duration ``s`` is measured with ``time.perf_counter`` (the model
call, and the scheduling and cache management since the previous step: the policy's work is
real time too) and the clock advances by ``s * time_scale``. When nothing can run the clock
jumps to the next arrival (`Executor.idle_until`), without sleeping. So a workload's hour plays
``time_scale`` times faster on the engine while the policies still see the workload's own idle
times (their horizons and decay rates are in human seconds). Latencies in engine seconds are
clock differences divided by ``time_scale`` (`EngineResult` reports them so).

`run_engine` drives a list of requests through scheduler + manager + this executor, as
`kvevict.sim.simulate` does with the cost model, and returns an `EngineResult` with the
measurements: per request queue wait, prefill phase, TTFT, decode rate, cached and computed
tokens, answers; per run peak pool blocks, torch and OS memory, where the KV tensor lives.
"""

from __future__ import annotations

import inspect
import math
import resource
import sys
import time
import warnings
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from kvevict.cost import CostModel
from kvevict.engine.model import LlamaModel
from kvevict.errors import ConfigError, KVEvictError
from kvevict.manager import KVCacheManager
from kvevict.policies.base import Policy, make_policy
from kvevict.pool import BlockPool
from kvevict.prefix import block_hashes
from kvevict.scheduler import (
    Executor,
    RequestState,
    Scheduler,
    SchedulerConfig,
    StepOutput,
    StepPlan,
)
from kvevict.sim import (
    CostModelExecutor,
    RequestRecord,
    SimResult,
    collect,
    drive,
)
from kvevict.types import BlockInfo, ManualClock, Request

__all__ = [
    "AnswerCheck",
    "EngineExecutor",
    "EngineResult",
    "compare_answers",
    "default_policy_params",
    "in_engine_seconds",
    "kv_placement",
    "process_memory",
    "run_engine",
    "unbounded_capacity",
]

#: Top-2 logit gap below which a differing greedy token counts as a floating-point near-tie
#: (batch-size-dependent matrix kernels round differently), not as a residency bug.
NEAR_TIE = 1e-4


def _check_time_scale(time_scale: Any) -> None:
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not (
            math.isfinite(time_scale) and time_scale > 0):
        raise ConfigError(f"time_scale must be a positive finite number, got {time_scale!r}")


@attrs.define
class _Work:
    """One sequence's share of a step: positions ``[start, end)`` to compute."""

    state: RequestState
    table: list[int]
    start: int  # first position to compute (moves past blocks that are valid already)
    end: int
    samples: bool
    kind: str  # "prefill" | "decode"
    first: int = -1  # the planned start

    def __attrs_post_init__(self) -> None:
        self.first = self.start

    def written(self, block_size: int) -> range:
        """Indices (in ``table``) of the blocks this work writes."""
        if self.start >= self.end:
            return range(0)
        return range(self.start // block_size, -(-self.end // block_size))


class EngineExecutor(Executor):
    """Runs each `StepPlan` on ``model`` over ``pool`` (see the module docstring).

    Args:
        model: the `LlamaModel`; its K/V layout, dtype and device must match ``pool``.
        pool: the manager's tensor-backed `BlockPool`.
        clock: the manager's `ManualClock` (workload seconds).
        time_scale: workload seconds per engine second (> 0; 1 = real time).
        teacher_forcing: feed back ``Request.output_tokens`` when a request has them (True)
            or always the model's greedy token (False).
        check_tokens: verify every step that the token ids the executor feeds equal the
            manager's record of the sequence (slow; for tests).
        timer: seconds for measuring steps (default `time.perf_counter`; a test can make
            runs reproducible with a fake one).
        cost: a `CostModel` in engine seconds; when given, every executed plan is also
            priced by the simulator's `CostModelExecutor` (``predicted_seconds``), which
            isolates the cost model's error from the scheduling differences of a simulation.

    Attributes (read them after a run):
        answers: request id -> the model's greedy token at every generated position.
        margins: request id -> the top-1 minus top-2 logit at those positions.
        top_logits: request id -> the top-1 logit at those positions.
        engine_prefill_tokens: request id -> prompt positions the model actually computed.
        steps, busy_seconds, model_seconds, host_seconds, first_step_seconds: timing totals
            in engine seconds (``busy = model + host``, host being scheduling and cache
            management between steps).
        predicted_seconds: what ``cost`` says the executed steps should have taken.
        by_kind: the same split into decode-only steps and steps with a prefill chunk.
        prefill_tokens, decode_tokens, skipped_tokens, peeks, stale_items: work counters
            (positions the model ran, peeks included; ``skipped_tokens``: positions not
            recomputed because another sequence's identical block was already valid;
            ``peeks``: last-token logits computed without keeping their K/V;
            ``stale_items``: plan entries whose request was no longer running when the step
            ran, skipped).
    """

    def __init__(self, model: LlamaModel, pool: BlockPool, clock: ManualClock, *,
                 time_scale: float = 1.0, teacher_forcing: bool = True,
                 check_tokens: bool = False,
                 timer: Callable[[], float] = time.perf_counter,
                 cost: CostModel | None = None) -> None:
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
        model.check_pool(pool)
        if not isinstance(clock, ManualClock):
            raise ConfigError(f"clock must be a ManualClock (the manager's), got "
                              f"{type(clock).__name__}")
        _check_time_scale(time_scale)
        self.model = model
        self.pool = pool
        self.clock = clock
        self.time_scale = float(time_scale)
        self.teacher_forcing = bool(teacher_forcing)
        self.check_tokens = bool(check_tokens)
        if not callable(timer):
            raise ConfigError("timer must be a callable returning seconds")
        self.timer = timer
        if cost is not None and not isinstance(cost, CostModel):
            raise ConfigError(f"cost must be a CostModel, got {type(cost).__name__}")
        self._pricer = None if cost is None else CostModelExecutor(cost, ManualClock())
        self.predicted_seconds = 0.0
        #: "decode" (decode-only steps) / "prefill" (steps with a prefill chunk) ->
        #: [steps, measured seconds, predicted seconds]
        self.by_kind: dict[str, list[float]] = {"decode": [0, 0.0, 0.0],
                                                 "prefill": [0, 0.0, 0.0]}
        self.answers: dict[Any, list[int]] = {}
        self.margins: dict[Any, list[float]] = {}
        self.top_logits: dict[Any, list[float]] = {}
        self.engine_prefill_tokens: dict[Any, int] = {}
        self._fed: dict[Any, list[int]] = {}  # tokens returned to the scheduler, in order
        self._valid: dict[int, BlockInfo] = {}  # block id -> the cached record it was valid as
        self._cuda = pool.kv is not None and pool.kv.device.type == "cuda"
        self._mark: float | None = None
        self.steps = 0
        self.busy_seconds = 0.0
        self.model_seconds = 0.0
        self.host_seconds = 0.0
        self.first_step_seconds: float | None = None
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.skipped_tokens = 0
        self.peeks = 0
        self.stale_items = 0

    # -- the Executor protocol -------------------------------------------------------------

    def reset_timer(self) -> None:
        """Forget the end of the last step: the next step is charged its own time only."""
        self._mark = None

    def idle_until(self, t: float) -> None:
        """Jump the clock to ``t`` (no sleeping); idle time is not charged to the next step."""
        if t > self.clock.now:
            self.clock.set(t)
        self._mark = self.timer()

    def execute(self, plan: StepPlan, manager: KVCacheManager) -> StepOutput:
        """Run ``plan``: compute its chunks and decodes, return the tokens to feed back."""
        t_enter = self.timer()
        host = 0.0 if self._mark is None else t_enter - self._mark
        if manager.pool is not self.pool:
            raise ConfigError("the manager's pool is not the pool this executor runs on")
        works = self._collect(plan)
        for w in works:
            w.start = self._skip_valid(manager, w)
        self._resolve_shared_writes(works)
        t_model = self.timer()
        logits = self._run(works)
        if self._cuda:
            torch.cuda.synchronize(self.pool.device)
        out = self._sample(works, logits)
        self._mark_valid(manager, works)
        t_end = self.timer()
        model_s = t_end - t_model
        seconds = host + (t_end - t_enter)
        self._mark = t_end
        self.steps += 1
        predicted = 0.0 if self._pricer is None else self._pricer.step_seconds(plan)
        self.predicted_seconds += predicted
        kind = self.by_kind["prefill" if plan.prefills else "decode"]
        kind[0] += 1
        kind[1] += seconds
        kind[2] += predicted
        self.busy_seconds += seconds
        self.model_seconds += model_s
        self.host_seconds += seconds - model_s
        if self.first_step_seconds is None:
            self.first_step_seconds = seconds
        self.clock.advance(seconds * self.time_scale)
        return StepOutput(out, seconds)

    # -- building the step -----------------------------------------------------------------

    @staticmethod
    def _live(state: RequestState) -> bool:
        return state.seq is not None and state.status == "running" \
            and state.seq.status == "running"

    def _collect(self, plan: StepPlan) -> list[_Work]:
        works: list[_Work] = []
        for chunk in plan.prefills:
            st = chunk.state
            if not self._live(st):
                self._stale(st)
                continue
            if st.request.tokens is None:
                raise ConfigError(f"request {st.request_id!r} has no token ids (block hashes "
                                  "only); the engine needs token ids")
            seq = st.seq
            assert seq is not None  # _live
            works.append(_Work(st, list(seq.block_table), chunk.start, chunk.end,
                               chunk.samples, "prefill"))
        for st in plan.decodes:
            if not self._live(st):
                self._stale(st)
                continue
            seq = st.seq
            assert seq is not None  # _live
            n = seq.num_tokens
            works.append(_Work(st, list(seq.block_table), n - 1, n, True, "decode"))
        return works

    def _stale(self, state: RequestState) -> None:
        self.stale_items += 1
        warnings.warn(f"step plan holds request {state.request_id!r}, which is "
                      f"{state.status}; its work is skipped", RuntimeWarning, stacklevel=3)

    def _skip_valid(self, manager: KVCacheManager, w: _Work) -> int:
        """First position of ``w`` whose block is not already a valid cached block."""
        bs = self.pool.block_size
        s = w.start
        while s < w.end:
            k = s // bs
            record = self._valid.get(w.table[k])
            if record is None or manager.block(w.table[k]) is not record:
                break
            s = (k + 1) * bs
        skipped = min(s, w.end) - w.start
        self.skipped_tokens += skipped
        return w.start + skipped

    def _resolve_shared_writes(self, works: list[_Work]) -> None:
        """When several works would write one block (identical cached copies being computed
        this very step), the one starting earliest in it writes it; the others skip it (it
        is always their leading block: the manager shares whole prefix-closed runs)."""
        bs = self.pool.block_size
        while True:
            writers: dict[int, list[_Work]] = {}
            for w in works:
                for k in w.written(bs):
                    writers.setdefault(w.table[k], []).append(w)
            shared = next(((b, ws) for b, ws in writers.items() if len(ws) > 1), None)
            if shared is None:
                return
            block, ws = shared
            depth = ws[0].table.index(block)
            ws.sort(key=lambda w: max(w.start, depth * bs))
            for w in ws[1:]:
                if w.table[w.start // bs] != block:
                    raise KVEvictError(
                        f"internal error: requests {ws[0].state.request_id!r} and "
                        f"{w.state.request_id!r} both write block {block} mid-chunk (the "
                        "cache's prefix closure is broken); please report this")
                self.skipped_tokens += min((depth + 1) * bs, w.end) - w.start
                w.start = min((depth + 1) * bs, w.end)

    def _tokens(self, state: RequestState, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)``: the prompt, then what was fed back."""
        prompt = state.request.tokens
        assert prompt is not None  # checked in _collect
        p = len(prompt)
        fed = self._fed.get(state.request_id, [])
        ids = prompt[start:min(end, p)].tolist() if start < p else []
        if end > p:
            ids += fed[max(start - p, 0):end - p]
        if len(ids) != end - start:
            raise KVEvictError(f"internal error: request {state.request_id!r} positions "
                               f"[{start}, {end}) are not all known to the executor")
        if self.check_tokens:
            known = state.seq.tokens  # type: ignore[union-attr]
            if known is None or known[start:end] != ids:
                raise KVEvictError(f"request {state.request_id!r}: the executor's tokens at "
                                   f"[{start}, {end}) differ from the manager's")
        return ids

    # -- running ---------------------------------------------------------------------------

    def _run(self, works: list[_Work]) -> dict[Any, torch.Tensor]:
        """Run all computing works in one model call, then each peek; logits by request."""
        device = self.model.device
        compute = [w for w in works if w.start < w.end]
        logits: dict[Any, torch.Tensor] = {}
        if compute:
            entries = [(torch.tensor(self._tokens(w.state, w.start, w.end), device=device),
                        w.start, w.table) for w in compute]
            rows = self.model.forward_paged(self.pool, entries)
            for w, row in zip(compute, rows):
                self._count(w, w.end - w.start)
                if w.samples:
                    logits[w.state.request_id] = row
        for w in works:
            if w.start >= w.end and w.samples:
                logits[w.state.request_id] = self._peek(w)
                self._count(w, 1)
        return logits

    def _count(self, w: _Work, n: int) -> None:
        """Account ``n`` positions the model computed for ``w``."""
        if w.kind == "decode":
            self.decode_tokens += n
        else:
            rid = w.state.request_id
            self.prefill_tokens += n
            self.engine_prefill_tokens[rid] = self.engine_prefill_tokens.get(rid, 0) + n

    def _peek(self, w: _Work) -> torch.Tensor:
        """Logits of position ``end - 1`` (already in the pool) without changing the pool:
        run that token, then put back the slot its K/V overwrote."""
        kv = self.pool.kv
        assert kv is not None
        bs = self.pool.block_size
        pos = w.end - 1
        block, slot = w.table[pos // bs], pos % bs
        saved = kv[:, :, block, slot].clone()
        ids = torch.tensor(self._tokens(w.state, pos, w.end), device=self.model.device)
        try:
            row = self.model.forward_paged(self.pool, [(ids, pos, w.table)])[0]
        finally:
            kv[:, :, block, slot] = saved
        self.peeks += 1
        return row

    def _sample(self, works: list[_Work], logits: dict[Any, torch.Tensor]) -> dict[Any, int]:
        """Greedy answers for every sampling work; the tokens to feed back."""
        sampling = [w for w in works if w.samples]
        if not sampling:
            return {}
        stacked = torch.stack([logits[w.state.request_id] for w in sampling])
        k = min(2, stacked.shape[-1])
        top = stacked.topk(k, dim=-1)
        values = top.values.tolist()
        indices = top.indices.tolist()
        out: dict[Any, int] = {}
        for w, vals, idx in zip(sampling, values, indices):
            st = w.state
            rid = st.request_id
            answers = self.answers.setdefault(rid, [])
            if len(answers) != st.num_output:
                raise KVEvictError(f"internal error: request {rid!r} sampled output "
                                   f"{st.num_output} but the executor holds {len(answers)}")
            answers.append(int(idx[0]))
            self.margins.setdefault(rid, []).append(vals[0] - vals[1] if k > 1 else math.inf)
            self.top_logits.setdefault(rid, []).append(vals[0])
            fixed = st.request.output_tokens
            if self.teacher_forcing and fixed is not None and st.num_output < len(fixed):
                token = int(fixed[st.num_output])
            else:
                token = int(idx[0])
            self._fed.setdefault(rid, []).append(token)
            out[rid] = token
        return out

    def _mark_valid(self, manager: KVCacheManager, works: list[_Work]) -> None:
        """Every cached block a work filled this step holds valid K/V (earlier blocks were
        marked when they filled)."""
        bs = self.pool.block_size
        for w in works:
            for k in range(w.first // bs, w.end // bs):
                block = w.table[k]
                record = manager.block(block)
                if record is not None:
                    self._valid[block] = record


# -- memory and placement ------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / VmSwap of this process in bytes, from /proc (Linux); {} elsewhere."""
    out: dict[str, int] = {}
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "VmSwap"):
            parts = value.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * 1024  # reported in kB
    return out


def reset_peak_rss() -> bool:
    """Reset the OS's peak-RSS counter of this process (Linux ``/proc/self/clear_refs``);
    False when the OS does not allow it (the peak is then the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def process_memory() -> dict[str, Any]:
    """The process's resident memory as the OS reports it (not what torch says):
    ``rss_bytes`` now, ``peak_rss_bytes``, ``swap_bytes`` and where they came from."""
    status = _proc_status()
    if "VmRSS" in status:
        return {"source": "/proc/self/status", "rss_bytes": status["VmRSS"],
                "peak_rss_bytes": status.get("VmHWM"), "swap_bytes": status.get("VmSwap")}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"source": "getrusage", "rss_bytes": None, "peak_rss_bytes": peak,
            "swap_bytes": None}


def kv_placement(pool: BlockPool, model: LlamaModel | None = None) -> dict[str, Any]:
    """Where the KV tensor actually lives: device, dtype, shape, bytes (read off the tensor)."""
    kv = pool.kv
    if kv is None:
        raise ConfigError("pool has no KV tensor (metadata-only)")
    out: dict[str, Any] = {"device": str(kv.device), "dtype": str(kv.dtype).replace("torch.", ""),
                           "shape": list(kv.shape), "bytes": kv.numel() * kv.element_size(),
                           "bytes_per_block": pool.bytes_per_block,
                           "blocks": pool.num_blocks, "block_size": pool.block_size}
    if model is not None:
        weights = model.weights()
        out["weights_device"] = str(next(iter(weights.values())).device)
        out["weights_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
    return out


# -- driving a run -------------------------------------------------------------------------


def unbounded_capacity(requests: SequenceABC[Request], block_size: int,
                       max_num_seqs: int) -> int:
    """Blocks that never run out for ``requests``: one per distinct full block the run can
    cache (prompts and fed-back outputs) plus a partial block per running sequence."""
    distinct: set[Any] = set()
    for r in requests:
        if r.tokens is None:
            raise ConfigError(f"request {r.request_id!r} has no token ids; the engine needs them")
        tokens = r.tokens
        if r.output_tokens is not None and r.output_len > 1:
            tokens = np.concatenate([tokens, r.output_tokens[:r.output_len - 1]])
        distinct.update(block_hashes(tokens, block_size))
    longest = max(-(-(r.prompt_len + r.output_len) // block_size) for r in requests)
    return len(distinct) + max_num_seqs + longest


def _check_requests(requests: SequenceABC[Request], vocab_size: int) -> list[Request]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, SequenceABC):
        raise ConfigError("requests must be a list of Request")
    if not requests:
        raise ConfigError("run_engine() needs at least one request")
    for r in requests:
        if not isinstance(r, Request):
            raise ConfigError(f"requests must hold Request objects, got {type(r).__name__}")
        if r.tokens is None:
            raise ConfigError(f"request {r.request_id!r} is given as block hashes only; the "
                              "engine needs token ids")
        for name, ids in (("prompt", r.tokens), ("output", r.output_tokens)):
            if ids is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ConfigError(
                    f"request {r.request_id!r}: {name} token ids lie in [{ids.min()}, "
                    f"{ids.max()}], outside the model's vocabulary [0, {vocab_size}); "
                    f"generate the workload with vocab_size={vocab_size}")
    return sorted(requests, key=lambda r: r.arrival)


def default_policy_params(policy: str, cost: CostModel | None,
                          block_size: int) -> dict[str, Any]:
    """What `run_engine` gives a named policy unless told otherwise: the cost model (to
    cost-aware policies: market, bayes, dbms) and the block size, where it takes them. Pass
    the same to `kvevict.sim.simulate` for a matching simulation."""
    if policy == "belady":
        return {}
    accepted = inspect.signature(type(make_policy(policy))).parameters
    params: dict[str, Any] = {}
    if cost is not None and "cost_model" in accepted:
        params["cost_model"] = cost
    if "block_size" in accepted:
        params["block_size"] = block_size
    return params


def _policy(policy: str | Policy, ordered: list[Request], block_size: int,
            cost: CostModel | None, params: dict[str, Any] | None) -> Policy:
    """A policy object: Belady gets the future; the others `default_policy_params`
    overridden by ``params``."""
    if isinstance(policy, Policy):
        return make_policy(policy, **(params or {}))
    if policy == "belady":
        from kvevict.policies.belady import Belady

        return Belady.from_requests(ordered, block_size=block_size, time="arrival")
    return make_policy(policy, **{**default_policy_params(policy, cost, block_size),
                                  **(params or {})})


@attrs.frozen
class EngineResult:
    """One engine run: what the simulator reports, measured, plus the engine's own numbers.

    Times in ``records``, ``makespan`` and the summary are **engine seconds** (the clock's
    workload seconds divided by ``time_scale``).
    """

    sim: SimResult  #: the run in the simulator's terms (`SimResult.summary` works)
    time_scale: float
    answers: dict[Any, tuple[int, ...]]
    margins: dict[Any, tuple[float, ...]]
    top_logits: dict[Any, tuple[float, ...]]
    engine_prefill_tokens: dict[Any, int]
    engine: dict[str, Any]  #: steps, busy/model/host seconds, work counters
    memory: dict[str, Any]  #: peak pool blocks, torch peak, OS RSS
    kv: dict[str, Any]  #: `kv_placement`

    @property
    def policy(self) -> str:
        return self.sim.policy

    def summary(self, cold_requests: int = 0) -> dict[str, Any]:
        """`SimResult.summary` of the run plus engine numbers; with ``cold_requests`` the
        first ones (by arrival) are also summarised apart from the rest (``cold`` /
        ``warm``)."""
        out = self.sim.summary()
        recs = self.sim.records
        out["decode_tokens_per_s_p50"] = _p50([_decode_rate(r) for r in recs])
        out["engine"] = dict(self.engine)
        out["memory"] = dict(self.memory)
        if cold_requests:
            out["cold"] = _phase(recs[:cold_requests])
            out["warm"] = _phase(recs[cold_requests:])
        return out

    def request_rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per request (engine seconds)."""
        rows = []
        for r in self.sim.records:
            rows.append({
                "request_id": r.request_id, "session_id": r.session_id,
                "workload_class": r.workload_class, "arrival_s": round(r.arrival, 6),
                "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                "computed_prefill_tokens": r.computed_prefill_tokens,
                "engine_prefill_tokens": self.engine_prefill_tokens.get(r.request_id, 0),
                "queue_wait_s": round(r.queue_wait, 6),
                "prefill_s": round(r.ttft - r.queue_wait, 6), "ttft_s": round(r.ttft, 6),
                "decode_s": round(r.finish - r.arrival - r.ttft, 6),
                "output_tokens": r.output_tokens,
                "decode_tokens_per_s": round(_decode_rate(r), 3),
                "preemptions": r.preemptions,
            })
        return rows


def _p50(values: list[float]) -> float:
    return round(float(np.median(values)), 6) if values else 0.0


def _decode_rate(r: RequestRecord) -> float:
    """Tokens per second after the first one, as the user sees them stream."""
    seconds = r.finish - r.arrival - r.ttft
    return (r.output_tokens - 1) / seconds if r.output_tokens > 1 and seconds > 0 else 0.0


def _phase(recs: SequenceABC[RequestRecord]) -> dict[str, Any]:
    ttft = np.array([r.ttft for r in recs])
    return {
        "requests": len(recs),
        "ttft_p50": round(float(np.percentile(ttft, 50)), 6) if len(ttft) else 0.0,
        "ttft_p95": round(float(np.percentile(ttft, 95)), 6) if len(ttft) else 0.0,
        "queue_wait_p50": _p50([r.queue_wait for r in recs]),
        "prefill_s_p50": _p50([r.ttft - r.queue_wait for r in recs]),
        "decode_tokens_per_s_p50": _p50([_decode_rate(r) for r in recs]),
    }


def in_engine_seconds(result: SimResult, time_scale: float) -> SimResult:
    """``result`` with every time divided by ``time_scale`` (workload to engine seconds)."""
    if time_scale == 1.0:
        return result
    f = time_scale
    records = tuple(attrs.evolve(r, arrival=r.arrival / f, queue_wait=r.queue_wait / f,
                                 ttft=r.ttft / f, finish=r.finish / f) for r in result.records)
    return attrs.evolve(result, records=records, makespan=result.makespan / f)


def run_engine(requests: SequenceABC[Request], model: LlamaModel, policy: str | Policy = "lru",
               *, capacity_blocks: int, block_size: int = 16, time_scale: float = 1.0,
               config: SchedulerConfig | None = None, cost: CostModel | None = None,
               policy_params: dict[str, Any] | None = None, teacher_forcing: bool = True,
               check: bool = False, on_step: Callable[[Scheduler], None] | None = None,
               timer: Callable[[], float] = time.perf_counter) -> EngineResult:
    """Replay ``requests`` through the scheduler, the manager and the real model.

    Args:
        requests: with token ids inside the model's vocabulary (any order; sorted by
            arrival). Arrivals are workload seconds.
        model: the `LlamaModel` (its device holds the pool).
        policy: a registered name (``"belady"`` gets the trace's future) or an instance.
        capacity_blocks: pool size in blocks (`unbounded_capacity` for a pool that never
            evicts).
        block_size: tokens per block.
        time_scale: workload seconds per engine second (see the module docstring).
        config: the scheduler's knobs (default `SchedulerConfig()`).
        cost: a `CostModel` in workload seconds, given to cost-aware policies (market,
            bayes, dbms) as ``cost_model`` unless ``policy_params`` set one.
        policy_params: extra parameters of a named policy.
        teacher_forcing: feed back the requests' fixed output tokens (see the module
            docstring).
        check: call ``manager.check()`` after every step and verify the fed tokens (slow).
        on_step: called with the scheduler after every step.
        timer: the step timer (see `EngineExecutor`).
    """
    if not isinstance(model, LlamaModel):
        raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
    _check_time_scale(time_scale)
    ordered = _check_requests(requests, model.config.vocab_size)
    policy_obj = _policy(policy, ordered, block_size, cost, policy_params)
    name = policy if isinstance(policy, str) else type(policy).__name__.lower()
    clock = ManualClock()
    pool = BlockPool(capacity_blocks, block_size, model.config.layout(), device=model.device)
    manager = KVCacheManager(pool, policy_obj, clock=clock)
    executor = EngineExecutor(model, pool, clock, time_scale=time_scale,
                              teacher_forcing=teacher_forcing, check_tokens=check,
                              timer=timer,
                              cost=None if cost is None else cost.scaled(1 / time_scale))
    scheduler = Scheduler(manager, executor, config or SchedulerConfig())
    cuda = pool.device is not None and pool.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(pool.device)
    rss_reset = reset_peak_rss()
    executor.reset_timer()
    def after_step(s: Scheduler) -> None:
        if check:
            manager.check()
        if on_step is not None:
            on_step(s)

    drive(scheduler, ordered, clock, after_step if check or on_step is not None else None)
    sim = collect(scheduler, ordered, clock, name)
    memory: dict[str, Any] = {"peak_pool_blocks": manager.stats.peak_blocks_used,
                              "pool_blocks": capacity_blocks,
                              "peak_pool_bytes": manager.stats.peak_blocks_used
                              * pool.bytes_per_block}
    if cuda:
        memory["torch_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(pool.device)
        memory["torch_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(pool.device)
    else:
        memory["torch_peak_allocated_bytes"] = None  # the CPU allocator keeps no statistics
    os_mem = process_memory()
    os_mem["peak_is_per_run"] = rss_reset
    memory["os"] = os_mem
    engine = {
        "steps": executor.steps, "busy_s": round(executor.busy_seconds, 6),
        "model_s": round(executor.model_seconds, 6), "host_s": round(executor.host_seconds, 6),
        "first_step_s": round(executor.first_step_seconds or 0.0, 6),
        "predicted_busy_s": round(executor.predicted_seconds, 6) if cost is not None else None,
        "by_step_kind": {k: {"steps": int(v[0]), "busy_s": round(v[1], 6),
                             "predicted_s": round(v[2], 6) if cost is not None else None}
                         for k, v in executor.by_kind.items()},
        "prefill_tokens": executor.prefill_tokens, "decode_tokens": executor.decode_tokens,
        "skipped_tokens": executor.skipped_tokens, "peeks": executor.peeks,
        "stale_items": executor.stale_items,
        "output_tokens_per_busy_s": round(
            sum(r.output_tokens for r in sim.records) / executor.busy_seconds, 3)
        if executor.busy_seconds > 0 else 0.0,
    }
    return EngineResult(
        sim=in_engine_seconds(sim, executor.time_scale), time_scale=executor.time_scale,
        answers={k: tuple(v) for k, v in executor.answers.items()},
        margins={k: tuple(v) for k, v in executor.margins.items()},
        top_logits={k: tuple(v) for k, v in executor.top_logits.items()},
        engine_prefill_tokens=dict(executor.engine_prefill_tokens), engine=engine,
        memory=memory, kv=kv_placement(pool, model),
    )


# -- losslessness ----------------------------------------------------------------------------


@attrs.frozen
class AnswerCheck:
    """Answers of a run against a reference run's (normally an unbounded pool's).

    ``mismatches`` lists ``(request_id, position, reference token, run token, reference
    margin, run margin)``. A mismatch where both runs' top-1 minus top-2 logit margins are
    below ``near_tie`` is a floating-point near-tie (the two runs computed that position
    through differently sized matrix kernels, which round differently); any other is a bug.
    ``max_logit_deviation`` is the largest difference of the top-1 logit at positions where
    both runs chose the same token: the numerical noise between the runs.
    """

    requests: int
    positions: int
    mismatches: tuple[tuple[Any, int, int, int, float, float], ...]
    near_ties: int
    bugs: int
    missing: tuple[Any, ...]
    max_logit_deviation: float
    near_tie: float

    @property
    def identical(self) -> bool:
        return not self.mismatches and not self.missing

    @property
    def lossless(self) -> bool:
        """No mismatch beyond floating-point near-ties, nothing missing."""
        return self.bugs == 0 and not self.missing

    def verdict(self) -> str:
        if self.identical:
            return f"identical ({self.positions:,} tokens)"
        if self.missing:
            return f"BUG: {len(self.missing)} requests have no answer"
        if self.bugs:
            return (f"BUG: {self.bugs} tokens differ from the unbounded run "
                    f"({self.near_ties} more are near-ties)")
        return (f"equal up to {self.near_ties} float near-tie(s) of {self.positions:,} tokens "
                f"(margin < {self.near_tie:g})")

    def as_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical, "lossless": self.lossless, "requests": self.requests,
            "positions": self.positions, "near_ties": self.near_ties, "bugs": self.bugs,
            "missing": list(self.missing), "max_logit_deviation": self.max_logit_deviation,
            "near_tie_margin": self.near_tie,
            "mismatches": [
                {"request_id": rid, "position": pos, "reference": a, "run": b,
                 "reference_margin": ma, "run_margin": mb}
                for rid, pos, a, b, ma, mb in self.mismatches],
        }


def compare_answers(reference: EngineResult, run: EngineResult,
                    near_tie: float = NEAR_TIE) -> AnswerCheck:
    """Compare ``run``'s answers with ``reference``'s, position by position."""
    mismatches = []
    missing = []
    positions = 0
    near = bugs = 0
    deviation = 0.0
    for rid, ref in reference.answers.items():
        got = run.answers.get(rid)
        if got is None or len(got) != len(ref):
            missing.append(rid)
            continue
        ref_m, got_m = reference.margins[rid], run.margins[rid]
        ref_top, got_top = reference.top_logits[rid], run.top_logits[rid]
        for pos, (a, b) in enumerate(zip(ref, got)):
            positions += 1
            if a == b:
                deviation = max(deviation, abs(ref_top[pos] - got_top[pos]))
                continue
            tie = max(ref_m[pos], got_m[pos]) < near_tie
            near += tie
            bugs += not tie
            mismatches.append((rid, pos, a, b, ref_m[pos], got_m[pos]))
    return AnswerCheck(requests=len(reference.answers), positions=positions,
                       mismatches=tuple(mismatches), near_ties=near, bugs=bugs,
                       missing=tuple(missing), max_logit_deviation=deviation,
                       near_tie=near_tie)
