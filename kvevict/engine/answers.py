"""Losslessness: the answers of an engine run against a reference run's.

Residency eviction is lossless, so the model's greedy answers under any policy and pool size
must equal those of a run with an unbounded pool (`kvevict.engine.driver.unbounded_capacity`).
`compare_answers` checks it position by position, telling floating-point near-ties (the two
runs computed a position through differently sized matrix kernels) from real differences.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvevict.engine.driver import EngineResult

__all__ = ["NEAR_TIE", "AnswerCheck", "compare_answers"]

#: Top-2 logit gap below which a differing greedy token counts as a floating-point near-tie
#: (batch-size-dependent matrix kernels round differently), not as a residency bug.
NEAR_TIE = 1e-4


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
