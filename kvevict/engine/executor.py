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
pool; `kvevict.engine.answers.compare_answers` checks it.

**Time.** The scheduler's clock is the manager's clock, a `ManualClock` in *workload
seconds*. Each step's real duration ``s`` is measured with ``time.perf_counter`` (the model
call, and the scheduling and cache management since the previous step: the policy's work is
real time too) and the clock advances by ``s * time_scale``. When nothing can run the clock
jumps to the next arrival (`Executor.idle_until`), without sleeping. So a workload's hour plays
``time_scale`` times faster on the engine while the policies still see the workload's own idle
times (their horizons and decay rates are in human seconds). Latencies in engine seconds are
clock differences divided by ``time_scale`` (`kvevict.engine.driver.EngineResult` reports
them so).

**Token eviction** (``token_policy``, `kvevict.engine.tokens`): after each forward, a
`kvevict.tokens.TokenPolicy` keeps ``token_budget`` tokens of every sequence per layer; the
kept K/V move to the sequence's first slots and the manager takes back the blocks past them
(`KVCacheManager.compact`). A request that may be cut is begun uncacheable: build the manager
with ``uncacheable=executor.uncacheable``. Token eviction is lossy: the answers are the
model's under that policy, not the full cache's.

`kvevict.engine.driver.run_engine` drives a list of requests through scheduler + manager +
this executor with the shared run loop (`kvevict.run`), as the simulator does with the cost
model; `kvevict.engine.answers` checks the answers of two runs against each other.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvevict.cost import CostModel
from kvevict.engine.model import LlamaModel
from kvevict.engine.tokens import TokenEviction
from kvevict.errors import ConfigError, KVEvictError
from kvevict.manager import KVCacheManager
from kvevict.pool import BlockPool
from kvevict.run import CostModelExecutor
from kvevict.scheduler import Executor, RequestState, StepOutput, StepPlan
from kvevict.tokens import TokenPolicy
from kvevict.types import BlockInfo, ManualClock, Request

__all__ = ["EngineExecutor", "check_time_scale"]


def check_time_scale(time_scale: Any) -> None:
    """`ConfigError` unless ``time_scale`` (workload seconds per engine second) is a
    positive finite number."""
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
    #: False for an uncacheable sequence (token eviction): no block of it is shared, and its
    #: table no longer follows positions once tokens were dropped
    cacheable: bool = True

    def __attrs_post_init__(self) -> None:
        self.first = self.start
        self.cacheable = self.state.seq is None or self.state.seq.cacheable

    def written(self, block_size: int) -> range:
        """Indices (in ``table``) of the blocks this work writes (none tracked for an
        uncacheable sequence: it shares none)."""
        if self.start >= self.end or not self.cacheable:
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
        token_policy: token eviction (see the module docstring): a registered
            `kvevict.tokens` name (``"snapkv"``, ``"lkv_t"``, ...) or a `TokenPolicy`; None
            (default) keeps every token. Needs a model without sliding windows.
        token_budget: tokens kept per sequence per layer; required with a name (equal to
            the instance's budget, or None, with an instance).
        token_params: more parameters of a named policy (``{"scorer": path}`` for a learned
            one; its ``shape`` comes from the model).

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
        tokens: the `TokenEviction` (its counters: ``compactions``, ``dropped_tokens``,
            ``freed_blocks``), or None without a token policy.
    """

    def __init__(self, model: LlamaModel, pool: BlockPool, clock: ManualClock, *,
                 time_scale: float = 1.0, teacher_forcing: bool = True,
                 check_tokens: bool = False,
                 timer: Callable[[], float] = time.perf_counter,
                 cost: CostModel | None = None,
                 token_policy: str | TokenPolicy | None = None,
                 token_budget: int | None = None,
                 token_params: dict[str, Any] | None = None) -> None:
        if not isinstance(model, LlamaModel):
            raise ConfigError(f"model must be a LlamaModel, got {type(model).__name__}")
        model.check_pool(pool)
        if token_policy is None:
            if token_budget is not None or token_params:
                raise ConfigError("token_budget / token_params need a token_policy (e.g. "
                                  "'snapkv')")
            self.tokens: TokenEviction | None = None
        else:
            self.tokens = TokenEviction(model, token_policy, token_budget, token_params)
        if not isinstance(clock, ManualClock):
            raise ConfigError(f"clock must be a ManualClock (the manager's), got "
                              f"{type(clock).__name__}")
        check_time_scale(time_scale)
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

    @property
    def work_meter(self) -> CostModelExecutor | None:
        """The pricer of ``predicted_seconds`` (None without ``cost``): it priced every step
        this executor ran, part by part, in engine seconds (`Executor.work_meter`)."""
        return self._pricer

    @property
    def uncacheable(self) -> Callable[[Request], bool] | None:
        """The `KVCacheManager`'s ``uncacheable`` predicate this executor needs: the requests
        token eviction may compact (None without a token policy)."""
        return None if self.tokens is None else self.tokens.uncacheable

    def kept_positions(self, request_id: Any) -> tuple[tuple[int, ...], ...] | None:
        """Per layer, the original positions of the tokens a request stores after its last
        forward (None without a token policy, or for a request never run)."""
        return None if self.tokens is None else self.tokens.kept_positions(request_id)

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
        if self.tokens is not None:
            self.tokens.prune()
        works = self._collect(plan)
        for w in works:
            w.start = self._skip_valid(manager, w)
        self._resolve_shared_writes(works)
        t_model = self.timer()
        logits = self._run(works, manager)
        if self._cuda:
            torch.cuda.synchronize(self.pool.device)
        out = self._sample(works, logits)
        self._mark_valid(manager, works)
        t_end = self.timer()
        model_s = t_end - t_model
        seconds = host + (t_end - t_enter)
        self._mark = t_end
        self.steps += 1
        predicted = 0.0 if self._pricer is None else self._pricer.execute(plan, manager).seconds
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
            if self.tokens is not None:
                self.tokens.check_sequence(seq)
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
        while s < w.end and w.cacheable:
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

    def _run(self, works: list[_Work], manager: KVCacheManager) -> dict[Any, torch.Tensor]:
        """Run all computing works in one model call, then each peek; logits by request.
        With token eviction the policy then sees each computing work's sequence."""
        device = self.model.device
        compute = [w for w in works if w.start < w.end]
        logits: dict[Any, torch.Tensor] = {}
        if compute:
            entries = [(torch.tensor(self._tokens(w.state, w.start, w.end), device=device),
                        w.start, w.table) for w in compute]
            if self.tokens is None:
                rows = self.model.forward_paged(self.pool, entries)
            else:
                rows = self._run_evicting(entries, compute, manager)
            for w, row in zip(compute, rows):
                self._count(w, w.end - w.start)
                if w.samples:
                    logits[w.state.request_id] = row
        for w in works:
            if w.start >= w.end and w.samples:
                logits[w.state.request_id] = self._peek(w)
                self._count(w, 1)
        return logits

    def _run_evicting(self, entries: list[tuple[torch.Tensor, int, list[int]]],
                      compute: list[_Work], manager: KVCacheManager) -> torch.Tensor:
        """One model call with token eviction: each entry at its sequence's next free slot
        (positions past the dropped tokens) and its logical position; then the policy."""
        tokens = self.tokens
        assert tokens is not None
        items = []
        for i, w in enumerate(compute):
            seq = w.state.seq
            assert seq is not None  # _live
            slot = w.start - seq.num_dropped
            fresh = w.kind == "prefill" and w.first == seq.num_hit_slots
            items.append(tokens.item(w.state, seq, slot, w.start, w.end - w.start, w.table,
                                     fresh))
            entries[i] = (entries[i][0], slot, w.table)
        rows, captured = self.model.forward_paged(
            self.pool, entries, positions=[w.start for w in compute],
            queries=[tokens.queries(w.end - w.start) for w in compute],
            head_masks=tokens.head_masks(items), kv_store=tokens.kv_store)
        tokens.after_forward(manager, self.pool, items, captured)
        return rows

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
            store = None if self.tokens is None else self.tokens.kv_store  # as when computed
            row = self.model.forward_paged(self.pool, [(ids, pos, w.table)], kv_store=store)[0]
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
            if not w.cacheable:
                continue
            for k in range(w.first // bs, w.end // bs):
                block = w.table[k]
                record = manager.block(block)
                if record is not None:
                    self._valid[block] = record
