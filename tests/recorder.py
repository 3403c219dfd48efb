"""A recording LRU shared by the vLLM adapter tests (offload and GPU tier).

`Recorder` is kvevict's LRU that logs each block event as ``(label, block id)`` and can
raise in one of them, so a test asserts the exact event sequence an adapter sends and how
it survives a policy that fails. ``LABELS`` names the events in the log (a subclass may
shorten them); ``fail`` names the label (or ``"victim"``) to raise in, after ``after``
successful calls. ``pop_victim`` is off, so ``victim`` and ``on_evict`` both show.
"""

from __future__ import annotations

from typing import ClassVar

from kvevict.policies.lru import LRU


class Recorder(LRU):
    """kvevict's LRU that logs every block event as (label, block id)."""

    LABELS: ClassVar[dict[str, str]] = {
        name: name for name in ("on_insert", "on_hit", "on_candidate", "on_uncandidate",
                                "on_evict")}

    pop_victim = None  # victim + on_evict, so that both show in the log

    def __init__(self, fail: str | None = None, after: int = 0) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []
        self.fail, self.after = fail, after

    def _maybe_fail(self, label: str) -> None:
        if label == self.fail:
            if self.after == 0:
                raise RuntimeError(f"{label} broke")
            self.after -= 1

    def _note(self, event: str, block) -> None:
        label = self.LABELS[event]
        self._maybe_fail(label)
        self.log.append((label, block.block_id))

    def on_insert(self, block, now):
        self._note("on_insert", block)

    def on_hit(self, block, now):
        self._note("on_hit", block)

    def on_candidate(self, block, now):
        self._note("on_candidate", block)
        super().on_candidate(block, now)

    def on_uncandidate(self, block, now):
        self._note("on_uncandidate", block)
        super().on_uncandidate(block, now)

    def on_evict(self, block, now):
        self._note("on_evict", block)
        super().on_evict(block, now)

    def victim(self, now):
        self._maybe_fail("victim")
        return super().victim(now)
