"""Synthetic long-context tasks whose answers depend on tokens far back: the judge's curriculum.

Token eviction is judged by whether a model still answers correctly when most of its KV is gone.
That needs a model whose answers *can* be wrong, and questions whose answer sits in a few tokens
somewhere in a long context. These three task families are the usual probes (Zoology's MQAR,
Arora et al. 2023; the needle-in-a-haystack test; RULER's variable tracking, Hsieh et al. 2024),
written over a small closed vocabulary so that a tiny model trained here on CPU learns them:

- ``recall`` (multi-query associative recall): key–value pairs scattered in filler, then
  queries ``? key`` answered by the pair's value;
- ``needle``: one ``NEEDLE v v v`` record among distractor records with other markers; the
  query ``? NEEDLE`` is answered by the needle's three values;
- ``vartrack`` (variable tracking): assignment chains ``VAR src dst`` (``dst = src``) from a
  root value through three variables, with two distractor chains; the query ``? value`` is
  answered by the chain's variables in order.

Every answer ends with ``EOS``. A `TaskItem` is a prompt (ending with the queried token) and its
answer;
`make_items` draws a seeded, reproducible list of them, and `training_batch` packs prompts with
several queries for the training script (`benchmarks/train_judge.py`).

Vocabulary (`VOCAB_SIZE` = 512): specials 0–17, keys and variable names 32–287, values 288–415,
filler 416–511.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from kvevict.errors import ConfigError

__all__ = [
    "BOS",
    "EOS",
    "FILLER",
    "PAD",
    "QUERY",
    "QUESTION_LENGTH",
    "TASKS",
    "VOCAB_SIZE",
    "TaskItem",
    "batches",
    "make_items",
    "min_length",
    "packed_items",
    "training_batch",
]

PAD, BOS, EOS, QUERY = 0, 1, 2, 3
_TASK_MARK = {"recall": 5, "needle": 6, "vartrack": 7}
NEEDLE = 8
_DISTRACTORS = tuple(range(9, 16))
VAR = 16
_KEYS = (32, 288)
_VALUES = (288, 416)
#: Filler tokens: ``FILLER[0] <= token < FILLER[1]``.
FILLER = (416, 512)
VOCAB_SIZE = 512
#: Tokens of every question: ``QUERY`` and the queried token; the answer follows directly
#: (as in Zoology's MQAR, so the answer is read by one induction step from the queried token).
QUESTION_LENGTH = 2

#: The task names, in the order the docs report them.
TASKS: tuple[str, ...] = ("recall", "needle", "vartrack")

_RECALL_PAIRS = 24
_NEEDLE_DISTRACTORS = 12
_CHAIN = 3
_VT_CHAINS = 3


@attrs.frozen
class TaskItem:
    """One question: ``prompt`` (ends with the queried token) and the expected ``answer`` (ends with
    ``EOS``). ``evidence`` holds the prompt positions of the tokens the answer is read from."""

    task: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    evidence: tuple[int, ...]

    @property
    def context(self) -> tuple[int, ...]:
        """The prompt without its question (the part a compressor sees before the question)."""
        return self.prompt[:-QUESTION_LENGTH]

    @property
    def question(self) -> tuple[int, ...]:
        """The question: ``QUERY`` and the queried token."""
        return self.prompt[-QUESTION_LENGTH:]


def _counts(scale: float) -> tuple[int, int, int]:
    """Records per task at ``scale`` (1 = the evaluated tasks): recall pairs, needle
    distractors, variable-tracking chains."""
    if not 0.0 < scale <= 1.0:
        raise ConfigError(f"scale must be in (0, 1], got {scale!r}")
    return (max(2, round(_RECALL_PAIRS * scale)), max(1, round(_NEEDLE_DISTRACTORS * scale)),
            max(1, round(_VT_CHAINS * scale)))


def _records(task: str, rng: np.random.Generator, scale: float = 1.0
             ) -> tuple[list[list[int]], list[tuple]]:
    """The task's records (token runs placed in the filler) and its questions
    ``(query tokens, answer tokens, index of the record(s) holding the answer)``. ``scale``
    below 1 shrinks the number of records (the training curriculum's easy end)."""
    pairs, distractors, chains = _counts(scale)
    if task == "recall":
        keys = rng.choice(np.arange(*_KEYS), pairs, replace=False)
        values = rng.integers(*_VALUES, size=pairs)
        records = [[int(k), int(v)] for k, v in zip(keys, values, strict=True)]
        questions = [([QUERY, int(keys[i])], [int(values[i]), EOS], (i,))
                     for i in range(pairs)]
        return records, questions
    if task == "needle":
        values = rng.integers(*_VALUES, size=(distractors + 1, 3))
        marks = rng.choice(_DISTRACTORS, distractors)
        records = [[NEEDLE, *map(int, values[0])]]
        records += [[int(m), *map(int, v)] for m, v in zip(marks, values[1:], strict=True)]
        return records, [([QUERY, NEEDLE], [*map(int, values[0]), EOS], (0,))]
    if task == "vartrack":
        names = rng.choice(np.arange(*_KEYS), _CHAIN * chains, replace=False)
        roots = rng.choice(np.arange(*_VALUES), chains, replace=False)
        records, questions = [], []
        for c in range(chains):
            chain = [int(roots[c]), *map(int, names[c * _CHAIN:(c + 1) * _CHAIN])]
            first = len(records)
            records += [[VAR, chain[i], chain[i + 1]] for i in range(_CHAIN)]
            questions.append(([QUERY, chain[0]], [*chain[1:], EOS],
                              tuple(range(first, first + _CHAIN))))
        return records, questions
    raise ConfigError(f"unknown task {task!r}; expected one of {list(TASKS)}")


def _context(task: str, length: int, rng: np.random.Generator, scale: float = 1.0
             ) -> tuple[list[int], list[tuple], list[list[int]]]:
    """A context of about ``length`` tokens: ``BOS``, the task mark, filler with the records at
    random places (a chain's assignments in order). Returns the tokens, the questions and each
    record's token positions."""
    records, questions = _records(task, rng, scale)
    if task != "vartrack":
        order = rng.permutation(len(records))
    else:  # each chain's assignments stay in order; chains interleave
        chains = len(records) // _CHAIN
        owner = np.repeat(np.arange(chains), _CHAIN)
        rng.shuffle(owner)
        nxt = [c * _CHAIN for c in range(chains)]
        order = []
        for c in owner:
            order.append(nxt[c])
            nxt[c] += 1
    body = length - 2 - sum(len(r) for r in records)
    if body < 0:
        raise ConfigError(f"context length {length} is too short for task {task!r}")
    cuts = np.sort(rng.integers(0, body + 1, len(records)))  # records may sit side by side
    filler = rng.integers(*FILLER, size=body)
    tokens = [BOS, _TASK_MARK[task]]
    where: list[list[int]] = [[] for _ in records]
    start = 0
    for cut, r in zip(cuts, order, strict=True):
        tokens += map(int, filler[start:cut])
        where[r] = list(range(len(tokens), len(tokens) + len(records[r])))
        tokens += records[r]
        start = int(cut)
    tokens += map(int, filler[start:])
    return tokens, questions, where


def batches(items: Sequence[TaskItem], size: int) -> list[Sequence[TaskItem]]:
    """``items`` in consecutive batches of at most ``size``, each checked to share its context
    and answer lengths (one unpadded tensor per batch); `ConfigError` otherwise."""
    out = []
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        if any(len(it.context) != len(chunk[0].context) or len(it.answer) != len(chunk[0].answer)
               for it in chunk):
            raise ConfigError("items of one batch must share their context and answer lengths")
        out.append(chunk)
    return out


def _check_items(task: str, count: Any) -> None:
    """`make_items`' and `packed_items`' arguments: a known task, a count >= 1."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count must be an int >= 1, got {count!r}")


def make_items(task: str, count: int, *, length: int = 1024, seed: int = 0) -> list[TaskItem]:
    """``count`` reproducible questions of ``task``, each over its own context of ``length``
    tokens (one question per context)."""
    _check_items(task, count)
    rng = np.random.default_rng([seed, TASKS.index(task), length])
    items = []
    for _ in range(count):
        tokens, questions, where = _context(task, length, rng)
        query, answer, held = questions[int(rng.integers(len(questions)))]
        evidence = tuple(sorted(p for r in held for p in where[r]))
        items.append(TaskItem(task, (*tokens, *query), tuple(answer), evidence))
    return items


def packed_items(task: str, count: int, *, length: int = 1024, seed: int = 0
                 ) -> list[TaskItem]:
    """``count`` contexts of ``length`` tokens, each followed by *every* question of its task with
    its answer (in a seeded order), as one `TaskItem`: the prompt is the context, then each
    question and answer, then the last question; ``answer`` is the last answer; ``evidence``
    holds every record's positions. The judge was trained on several questions per context, so
    this is in its distribution. What it is for: the attention these questions give the
    context (`kvevict.judge.judge_traces` with ``context=length``) is the attention a question
    the compressor cannot know yet gives it, in expectation (recall has 24 questions per
    context, so one question's attention misses 23 of the pairs a compressor must keep).

    The item's ``context`` and ``question`` properties do not apply (the context is the first
    ``length`` tokens)."""
    _check_items(task, count)
    rng = np.random.default_rng([seed, TASKS.index(task), length, 1])
    items = []
    for _ in range(count):
        tokens, questions, where = _context(task, length, rng)
        order = rng.permutation(len(questions))
        for i in order[:-1]:
            query, answer, _ = questions[int(i)]
            tokens += [*query, *answer]
        query, answer, _ = questions[int(order[-1])]
        evidence = tuple(sorted(p for w in where for p in w))
        items.append(TaskItem(task, (*tokens, *query), tuple(answer), evidence))
    return items


def min_length(task: str, scale: float = 1.0) -> int:
    """The shortest context ``task`` fits in at ``scale``: ``BOS``, the mark and the records."""
    pairs, distractors, chains = _counts(scale)
    records = {"recall": 2 * pairs, "needle": 4 * (distractors + 1),
               "vartrack": 3 * _CHAIN * chains}
    if task not in records:
        raise ConfigError(f"unknown task {task!r}; expected one of {list(TASKS)}")
    return 2 + records[task]


def training_batch(tasks: Sequence[str], length: int, rng: np.random.Generator,
                   *, queries: int = 4, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """One sequence per entry of ``tasks``: a context of about ``length`` tokens, then
    ``queries`` questions with their answers. Returns ``(ids, targets)``, int64 ``[B, T]``;
    ``targets`` is -100 except where the next token is an answer token (the training loss).
    ``scale`` in (0, 1] shrinks the number of records per context (recall pairs, needle
    distractors, variable chains) for the curriculum's early steps; evaluation items
    (`make_items`) always use the full tasks."""
    rows = []
    for task in tasks:
        tokens, questions, _ = _context(task, length, rng, scale)
        target = [-100] * len(tokens)
        picks = rng.choice(len(questions), min(queries, len(questions)), replace=False)
        for q in picks:
            query, answer, _ = questions[int(q)]
            tokens += query
            target += [-100] * len(query)
            tokens += answer
            target += list(answer)
        rows.append((tokens, target))
    width = max(len(t) for t, _ in rows)
    ids = np.full((len(rows), width), PAD, dtype=np.int64)
    targets = np.full((len(rows), width), -100, dtype=np.int64)
    for i, (tokens, target) in enumerate(rows):
        ids[i, :len(tokens)] = tokens
        # the target at position t is the token at t + 1 when that token is an answer token
        targets[i, :len(tokens) - 1] = target[1:]
    return ids, targets
