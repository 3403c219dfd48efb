"""The class-decay market: evict the candidate whose expected reload cost per byte is lowest.

A block's **price** is what keeping it is worth per byte of memory::

    price(b, now) = P(reuse within H | class, turn, idle time, sharers) x cost(depth) / bytes

and the victim is the cheapest candidate (``seeds/003``: "The KV Cache Is a Market, Not a
Cache"; DESIGN.md, "Cost and value").

**Reuse model.** Per workload class ``c`` and *turn bucket* ``b`` (how many turns the session has
had: 1, 2-3, 4-7, 8-15, 16+), a session comes back at all with probability ``p = p_return[c][b]``
and, if it does, after an exponential gap of mean ``mu_c`` ("KVCache Cache in the Wild",
ATC'25, models reuse per request category and turn with exponential reuse times). Given that
it has not come back after an idle time ``t``, the odds it comes back within the horizon ``H``
are (Bayes on the mixture "returns with prob p, exponential gap; else never")::

    q(t) = p (F(t+H) - F(t)) / (1 - p F(t)),   F(t) = 1 - exp(-t / mu)
         = (1 - exp(-H / mu)) * sigmoid(logit(p) - t / mu)

so ``q`` starts near ``p (1 - e^(-H/mu))`` and fades once ``t`` passes a few ``mu``: the session
is *abandoned* (nobody logs out cleanly; a chat user not back after half an hour is gone).
``q`` is strictly decreasing in ``t``. A block used by ``k > 1`` distinct sessions is worth the
union of their odds, ``1 - prod_i (1 - q_i(t_i))``, each sharer with its own class, turn and
idle time ``t_i`` (at least the ``max_sharers`` most recent sharers exactly; older ones, no
longer tracked, count at the oldest tracked sharer's odds, an upper bound). ``cost(depth)`` is
`CostModel.recompute_seconds` of the block (deeper blocks attend to more context); ``bytes`` is
the block's size (``kv_bytes_per_token x block_size`` of the cost model for a metadata-only
pool). Retention hints are not priced: wrap the market in ``pinned`` or use `manager.pin`.

**Defaults** per class are in `DEFAULT_CLASS_PARAMS` (sources in the comment above it and in
docs/policies/market.md); every one of them is corrected online.

**Turns.** A session begins a turn when a request of it hits cached blocks (one ``on_hits``
per begin or resume), or inserts its block 0 (nothing was cached), at a time it had not begun
at before. A later chunk of a chunked prefill inserts deeper blocks only and is not a turn; a
resume after a preemption that hits its prefix is (its hits come as a begin's do). Requests
without a session id are all first turns and teach nothing.

**Learned online.** Each turn of a session is a trial: it succeeds when the session begins
another turn (its gap, from its last release to the new begin, is a reuse-gap sample) and fails
once it has been idle ``abandon_after_s``. Per class and turn bucket, ``p`` is a Beta posterior
mean (``prior_weight`` pseudo-trials at the default); per class, ``mu`` is estimated in log
space (``E[log gap] = log mu - gamma`` for exponential gaps, Euler's gamma), robust to the
heavy tail of human think times, with ``prior_weight`` pseudo-samples at the default. Counts
decay by ``1 - 1/memory`` per observation so the estimates follow a drifting workload. Traces
without class labels (everything "chat") still learn, and the turn buckets separate the
sessions that keep coming back from the ones that never do. Evictions are not counted as
non-returns (that would let the policy confirm its own choices): a session that comes back to
an evicted prefix is still seen, through the blocks it recomputes. New estimates take effect at
the next distinct clock time at which a victim or quote is asked for.

**Victim selection without a scan.** Candidates live in one recency queue (a heap ordered by
``last_access_tick``) per key ``(class, turn bucket, cost bucket)``; shared blocks go to queues
keyed by ``(class, sharer bucket, cost bucket)``. Within a private queue every block has the same
class parameters and (quantized) cost, and ``q`` decreases with idle time, so the head is exactly
the cheapest; the victim is the cheapest head (cf. ATC'25's per-category queues). Costs are
quantized to ``1 / cost_resolution`` of an octave (the price uses the quantized cost, so the
order is exact for the price as defined). Within a shared queue the order by most recent use
is an approximation (the union depends on all sharers' times). Head prices are cached for the
current clock time: a run of evictions at one instant costs O(log Q) each, a new
instant O(Q) once, with Q the number of non-empty queues (a few dozen at most), never O(n).

`MarketAdmission` defers low-value requests (batch, single-shot) whose evictions would destroy
state priced above what the request is worth, for at most ``max_wait`` seconds.

**Modules.** `price` (the reuse and price model: `ClassParams`, `ReuseModel`, the sharer
union, `CostBuckets`), `learner` (`ReuseLearner`: sessions, turns, online estimates), `index`
(`PriceIndex`: the recency queues and the head-price cache), `policy` (`Market`, which turns
block events into the learner's and the index's) and `admission` (`MarketAdmission`). The
public names are re-exported here.
"""

from kvevict.policies.market.admission import MarketAdmission
from kvevict.policies.market.policy import Market
from kvevict.policies.market.price import (
    DEFAULT_CLASS_PARAMS,
    NUM_TURN_BUCKETS,
    ClassEstimate,
    ClassParams,
    Quote,
    turn_bucket,
)

__all__ = [
    "DEFAULT_CLASS_PARAMS",
    "NUM_TURN_BUCKETS",
    "ClassEstimate",
    "ClassParams",
    "Market",
    "MarketAdmission",
    "Quote",
    "turn_bucket",
]
