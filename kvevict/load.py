"""The offered load of a trace on a box: how much of the box's time its requests need.

A box has one busy-second per wall second to give. `offered_load` prices every request's
work with the box's `CostModel` and divides by the time the trace spans::

    rho = arrival_rate * mean_work,   arrival_rate = (n - 1) / (last arrival - first arrival)

(``n - 1`` intervals between ``n`` arrivals: for evenly spaced arrivals this is exactly one
over the spacing). A request's work is

- **prefill**: ``cost.prefill_seconds(new, cached)`` for the prompt tokens that an infinite
  cache would not hit (`kvevict.run.InfiniteCache`, at least one token: a fully
  cached prompt still computes the last token's logits, as `kvevict.run.CostModelExecutor`
  charges it), or the whole prompt with ``whole_prompt=True``. No finite cache hits more,
  so this is the least prefill any policy can leave.
- **decode**: ``max(output_len, 1) - 1`` decode steps (the prefill emits the first token),
  the ``k``-th at a context of ``prompt + k`` tokens. `CostModel.decode_batch_seconds`
  prices a step of ``b`` sequences as ``decode_step_s + b * decode_s_per_seq + sum(context)
  * decode_s_per_context_token``: the fixed part (reading the weights) is shared by the
  batch, so one sequence's share of a step is ``decode_step_s / b + decode_s_per_seq +
  context * decode_s_per_context_token``. It is priced at ``b = max_batch``, the scheduler's
  ``max_num_seqs``: the largest batch the box runs, so the least time the decode can take.

Why the largest batch and not the mean running batch: decode is memory-bound, so an engine
that batches continuously steps whenever anything is running, and its running batch grows
with the load until the steps are full. In the fluid model of that engine (steps back to
back, each advancing every running sequence one token), ``N`` sequences running and the box
busy all the time solve ``lambda * D = r * N`` and ``r * decode_step_s + lambda * (P + D *
x) = 1`` (``r`` steps per second, ``D`` decode steps and ``P`` prefill seconds per request,
``x`` the per-sequence part of a step), so ``N = lambda * D * decode_step_s / (1 - lambda *
(P + D * x))``: priced at that mean running batch the box is always exactly full, whatever
the load. The queue stays bounded as long as ``N <= max_batch``, which is exactly
``rho <= 1`` with the decode priced at ``max_batch``. So ``rho`` is the offered rate over the
largest rate the box sustains, and `mean_running_batch` reports ``N``.

``rho`` is a lower bound on the real load: the prefill counts only compulsory misses, a
chunked prefill pays ``prefill_overhead_s`` once per chunk (counted once here), and a
padding engine (``decode_pads_batch``) pays every sequence the batch's longest context (each
its own here). So ``rho >= 1`` means no schedule keeps up: the queue grows without bound
and the latencies a run measures are not steady state (`is_stable`, `instability_message`).

`rate_scaled` stretches or compresses arrivals; `scale_for_load` finds the scale that gives
a target ``rho``. The work of a request does not depend on when it arrives, so ``rho`` is
proportional to the scale and the solution is closed-form.

**Streaming.** `offered_load` (and so `scale_for_load`) reads its requests once, one at a
time: a list, or a stream in arrival order such as a `kvevict.workloads.TraceFile`; it holds
running sums and the infinite cache's seen blocks, not the trace. `iter_rate_scaled` scales
a stream as `rate_scaled` scales a list.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import attrs

from kvevict.cost import CostModel
from kvevict.errors import ConfigError
from kvevict.run import InfiniteCache, in_arrival_order
from kvevict.types import Request

__all__ = ["OfferedLoad", "instability_message", "is_stable", "iter_rate_scaled",
           "offered_load", "rate_scaled", "scale_for_load"]


@attrs.frozen
class OfferedLoad:
    """The work a trace offers a box, per wall second (`offered_load` computes it).

    Attributes:
        requests: requests in the trace.
        duration: seconds from the first arrival to the last.
        arrival_rate: ``(requests - 1) / duration``, requests per second.
        prefill_seconds_per_s: prefill busy-seconds offered per wall second.
        decode_seconds_per_s: decode busy-seconds offered per wall second, at full batches.
        rho: ``prefill_seconds_per_s + decode_seconds_per_s``, the utilization; the box
            gives 1 busy-second per second.
        max_batch: the decode batch the decode is priced at (``max_num_seqs``).
        prefill_tokens: prompt tokens counted as prefill work (all requests).
        decode_tokens: decode steps counted (all requests).
        whole_prompt: True if the prefill counts whole prompts, False if infinite-cache
            misses.
        mean_running_batch: the fluid model's mean decode batch (module docstring), capped
            at ``max_batch``; ``max_batch`` when ``rho >= 1``.
    """

    requests: int
    duration: float
    arrival_rate: float
    prefill_seconds_per_s: float
    decode_seconds_per_s: float
    rho: float
    max_batch: int
    prefill_tokens: int
    decode_tokens: int
    whole_prompt: bool
    mean_running_batch: float

    @property
    def stable(self) -> bool:
        """``rho < 1``: the box can keep up (`is_stable`)."""
        return self.rho < 1

    def text(self) -> str:
        """One line for a person, with the warning when ``rho >= 1``."""
        basis = "whole prompts" if self.whole_prompt else "infinite-cache misses"
        line = (f"offered load \u03c1 = {self.rho:.2f}: prefill {self.prefill_seconds_per_s:.3f}"
                f" + decode {self.decode_seconds_per_s:.3f} busy-seconds per second "
                f"({self.arrival_rate:,.3f} requests/s over {self.duration:,.1f} s; prefill "
                f"of {basis}, decode at batches of {self.max_batch})")
        warning = instability_message(self)
        return line if warning is None else f"{line}\n{warning}"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (rounded for stable output)."""
        out = attrs.asdict(self)
        for key in ("duration", "arrival_rate", "prefill_seconds_per_s",
                    "decode_seconds_per_s", "rho", "mean_running_batch"):
            out[key] = round(out[key], 6)
        out["stable"] = self.stable
        return out


def is_stable(load: OfferedLoad) -> bool:
    """True if ``load.rho < 1``; at ``rho >= 1`` the queue grows without bound."""
    if not isinstance(load, OfferedLoad):
        raise ConfigError(f"load must be an OfferedLoad, got {type(load).__name__}")
    return load.stable


def instability_message(load: OfferedLoad) -> str | None:
    """``"offered load ρ = 1.37 ≥ 1: the queue grows without bound; latencies are not
    steady state"``, or None for a stable load."""
    if is_stable(load):
        return None
    return (f"offered load \u03c1 = {load.rho:.2f} \u2265 1: the queue grows without bound; "
            "latencies are not steady state")


def _check_requests(requests: Any) -> list[Request]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ConfigError(f"requests must be a sequence of Request, got "
                          f"{type(requests).__name__}")
    out = list(requests)
    for r in out:
        if not isinstance(r, Request):
            raise ConfigError(f"requests must hold Request objects, got {type(r).__name__}")
    return out


def _check_iterable(requests: Any) -> None:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise ConfigError(f"requests must be an iterable of Request, got "
                          f"{type(requests).__name__}")


def _check_factor(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def offered_load(requests: Iterable[Request], cost: CostModel, block_size: int, *,
                 hit_tokens: Iterable[int] | None = None, whole_prompt: bool = False,
                 max_batch: int = 64) -> OfferedLoad:
    """The offered load of ``requests`` on the box ``cost`` describes (module docstring).

    ``requests`` is a list (any order: sorted by arrival here) or any other iterable in
    arrival order, read once, one request at a time (a trace file's reader: the pass holds
    the infinite cache's seen blocks, `kvevict.run.InfiniteCache`, not the trace; an arrival
    earlier than the one before it is a `ConfigError` naming both requests).
    ``hit_tokens`` gives each request's cached prompt tokens (in arrival order) instead of
    an infinite cache's (`kvevict.run.InfiniteCache` with ``block_size``);
    ``whole_prompt=True`` counts every prompt token as prefill work. ``max_batch`` is the
    scheduler's ``max_num_seqs`` (kvevict's default 64).

    Raises:
        ConfigError: fewer than two requests, or all arriving at once (no rate), or bad
            arguments.
    """
    listed = isinstance(requests, Sequence) and not isinstance(requests, (str, bytes))
    if listed:
        reqs: Iterable[Request] = sorted(_check_requests(requests), key=lambda r: r.arrival)
    else:
        _check_iterable(requests)
        reqs = requests
    if not isinstance(cost, CostModel):
        raise ConfigError(f"cost must be a CostModel, got {type(cost).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"max_batch must be an int >= 1 (the scheduler's max_num_seqs), "
                          f"got {max_batch!r}")
    if not isinstance(whole_prompt, bool):
        raise ConfigError(f"whole_prompt must be True or False, got {whole_prompt!r}")
    if whole_prompt and hit_tokens is not None:
        raise ConfigError("give hit_tokens= or whole_prompt=True, not both")
    if listed:
        _check_span(reqs)  # type: ignore[arg-type]
        if hit_tokens is not None and isinstance(hit_tokens, Sized) and \
                len(hit_tokens) != len(reqs):  # type: ignore[arg-type]
            raise ConfigError(f"hit_tokens has {len(hit_tokens)} entries for "
                              f"{len(reqs)} requests")  # type: ignore[arg-type]
    cache = None if whole_prompt or hit_tokens is not None else InfiniteCache(block_size)
    given = None if hit_tokens is None else iter(hit_tokens)
    prefill = decode = 0.0
    prefill_tokens = decode_tokens = 0
    decode_x = 0.0  # per-sequence decode seconds, without the shared step
    n = 0
    first = last = 0.0
    for r in in_arrival_order(reqs):
        if cache is not None:
            h: Any = cache.hit_tokens(r)
        elif given is not None:
            h = next(given, _END)
            if h is _END:
                raise ConfigError(f"hit_tokens has {n} entries for more requests")
        else:
            h = 0
        prompt = r.prompt_len
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 0 <= h <= prompt:
            raise ConfigError(f"request {r.request_id!r}: hit tokens must be an int in "
                              f"[0, {prompt}], got {h!r}")
        if not n:
            first = r.arrival
        last = r.arrival
        n += 1
        new = max(prompt - h, 1) if prompt else 0
        prefill += cost.prefill_seconds(new, prompt - new)
        prefill_tokens += new
        steps = max(r.output_len, 1) - 1
        contexts = steps * prompt + steps * (steps + 1) / 2  # sum of prompt + k, k = 1..steps
        x = steps * cost.decode_s_per_seq + contexts * cost.decode_s_per_context_token
        decode_x += x
        decode += steps * cost.decode_step_s / max_batch + x
        decode_tokens += steps
    if given is not None and next(given, _END) is not _END:
        raise ConfigError(f"hit_tokens has more entries than the {n} requests")
    span = _check_span_of(n, first, last)
    rate = (n - 1) / span
    prefill_rate = rate * prefill / n
    decode_rate = rate * decode / n
    rho = prefill_rate + decode_rate
    free = 1 - rate * (prefill + decode_x) / n
    step_demand = rate * decode_tokens / n * cost.decode_step_s
    if free <= 0:
        mean_batch = float(max_batch)
    else:
        mean_batch = min(float(max_batch), step_demand / free)
    return OfferedLoad(requests=n, duration=span, arrival_rate=rate,
                       prefill_seconds_per_s=prefill_rate, decode_seconds_per_s=decode_rate,
                       rho=rho, max_batch=max_batch, prefill_tokens=prefill_tokens,
                       decode_tokens=decode_tokens, whole_prompt=whole_prompt,
                       mean_running_batch=mean_batch)


_END = object()  # the end of hit_tokens


def _check_span(reqs: list[Request]) -> None:
    """A listed trace's rate can be measured (the errors `_check_span_of` gives, before the
    pass)."""
    if reqs:
        _check_span_of(len(reqs), reqs[0].arrival, reqs[-1].arrival)
    else:
        _check_span_of(0, 0.0, 0.0)


def _check_span_of(n: int, first: float, last: float) -> float:
    """``last - first``, the span of ``n`` arrivals, when it gives a rate."""
    if n < 2:
        raise ConfigError(f"an offered load needs at least 2 requests (an arrival rate), got "
                          f"{n}")
    span = last - first
    if not span > 0:
        raise ConfigError(f"all {n} requests arrive at t={first}: no arrival "
                          "rate, so no offered load (stretch the arrivals first)")
    return span


def rate_scaled(requests: Sequence[Request], factor: float) -> list[Request]:
    """The requests with the request rate multiplied by ``factor`` (``--rate-scale X``):
    every inter-arrival time divided by ``factor``, the first arrival kept. ``factor > 1``
    compresses the trace (more load), ``factor < 1`` stretches it. A session's pause before
    a request (``extra["pause"]``, the think time or tool pause that `kvevict.run.SessionGate`
    waits after the answer) is divided by ``factor`` too. The order and every other field are
    kept. `iter_rate_scaled` does the same to a stream.

    Raises:
        ConfigError: ``factor`` is not a positive finite number.
    """
    reqs = _check_requests(requests)
    f = _check_factor("factor (the rate scale)", factor)
    if not reqs:
        return []
    first = min(r.arrival for r in reqs)
    return [_scaled(r, first, f) for r in reqs]


def _scaled(r: Request, first: float, f: float) -> Request:
    """``r`` with its arrival, and its session pause if it has one, scaled by ``1 / f``."""
    changes: dict[str, Any] = {"arrival": first + (r.arrival - first) / f}
    pause = r.extra.get("pause")
    if pause is not None:
        changes["extra"] = {**r.extra, "pause": pause / f}
    return attrs.evolve(r, **changes)


def iter_rate_scaled(requests: Iterable[Request], factor: float) -> Iterator[Request]:
    """`rate_scaled` of requests in arrival order, one at a time (the first arrival, the
    earliest, is kept; the arithmetic is `rate_scaled`'s, so a sorted list gives the same
    requests). An arrival before the first one is a `ConfigError` (the stream is not in
    arrival order). The factor is checked when it is called."""
    _check_iterable(requests)
    f = _check_factor("factor (the rate scale)", factor)
    return _rate_scaled(requests, f)


def _rate_scaled(requests: Iterable[Request], f: float) -> Iterator[Request]:
    first: float | None = None
    for r in requests:
        if not isinstance(r, Request):
            raise ConfigError(f"requests must hold Request objects, got {type(r).__name__}")
        if first is None:
            first = r.arrival
        elif r.arrival < first:
            raise ConfigError(
                f"request {r.request_id!r} arrives at {r.arrival!r} s, before the first "
                f"request's {first!r} s: a rate scale of a stream needs it in arrival order")
        yield _scaled(r, first, f)


def scale_for_load(requests: Iterable[Request], cost: CostModel, block_size: int,
                   target: float, **kwargs: Any) -> float:
    """The rate scale (`rate_scaled`'s ``factor``) at which ``requests`` offer ``target``
    utilization (``--target-load``). ``kwargs`` go to `offered_load`.

    A request's work does not depend on its arrival time and `rate_scaled` divides the span
    by the factor, so ``rho(factor) = factor * rho(1)``: the answer is ``target / rho(1)``.

    Raises:
        ConfigError: ``target`` is not a positive finite number, or no load can be
            measured (see `offered_load`).
    """
    goal = _check_factor("target (the offered load)", target)
    base = offered_load(requests, cost, block_size, **kwargs)
    if not base.rho > 0:
        raise ConfigError("the trace offers no work (rho = 0): no rate scale reaches "
                          f"rho = {goal}")
    return goal / base.rho
