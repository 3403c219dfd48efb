"""examples/hf_multiturn.py runs as users run it and prints these exact numbers."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_multiturn.py"

EXPECTED = """\
pool large enough for every session (64 blocks of 8 tokens, LRU)
  ann turn 1: prompt  29 tokens, prefilled  29, saved   0
  bob turn 1: prompt  31 tokens, prefilled   7, saved  24
  ann turn 2: prompt  39 tokens, prefilled   7, saved  32
   cy turn 1: prompt  33 tokens, prefilled   9, saved  24
  bob turn 2: prompt  43 tokens, prefilled  11, saved  32
  ann turn 3: prompt  48 tokens, prefilled   8, saved  40
   cy turn 2: prompt  44 tokens, prefilled  12, saved  32
  total: 267 prompt tokens, 83 prefilled, 184 saved (69%); evictions: 0
pool too small: idle sessions are evicted (8 blocks of 8 tokens, LRU)
  ann turn 1: prompt  29 tokens, prefilled  29, saved   0
  bob turn 1: prompt  31 tokens, prefilled   7, saved  24
  ann turn 2: prompt  39 tokens, prefilled   7, saved  32
   cy turn 1: prompt  33 tokens, prefilled   9, saved  24
  bob turn 2: prompt  43 tokens, prefilled  11, saved  32
  ann turn 3: prompt  48 tokens, prefilled  16, saved  32
   cy turn 2: prompt  44 tokens, prefilled  20, saved  24
  total: 267 prompt tokens, 99 prefilled, 168 saved (63%); evictions: 7
same answers with either pool: True
"""


def test_multiturn_example_prints_the_prefill_saved_per_turn(capsys):
    module = runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert capsys.readouterr().out == EXPECTED
    log, store = module["chat"](64)
    # the second session's first turn reuses exactly the 3 blocks of the shared system prompt
    assert log[1]["saved"] == module["SYSTEM"] == 24
    assert store.stats.prefix_cache_hits == sum(row["saved"] for row in log) == 184
