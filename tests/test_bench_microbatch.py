"""bench/microbatch.py's pure parts: per-bucket means from the ranks' cumulative stats,
and a row's ratios (adaptive's choices valued at the A/B means)."""

from __future__ import annotations

import math
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
import microbatch  # noqa: E402


def test_window_means_come_from_cumulative_stats():
    first = {"microbatch_step_counts": {"3:1": 2, "3:2": 0},
             "microbatch_step_ms": {"3:1": 10.0}}
    last = {"microbatch_step_counts": {"3:1": 4, "3:2": 3, "4:1": 1},
            "microbatch_step_ms": {"3:1": 12.0, "3:2": 9.0, "4:1": 50.0}}
    got = microbatch._delta(first, last, 3)
    assert got[1] == (2, pytest.approx(14.0)) and got[2] == (3, pytest.approx(9.0))
    assert microbatch._delta(last, last, 3) == {}


def test_a_row_values_adaptive_at_the_ab_means():
    r = microbatch.row(2, 64, {1: (10, 100.0), 2: (10, 80.0)}, {1: (1, 0.0), 2: (3, 0.0)})
    assert r["better"] == "two" and r["two_over_one"] == pytest.approx(0.8)
    assert r["adaptive_split_share"] == pytest.approx(0.75)
    assert r["adaptive_over_best"] == pytest.approx((100 + 3 * 80) / 4 / 80)
    single = microbatch.row(2, 1, {1: (5, 7.0)}, {1: (5, 0.0)})
    assert single["two_ms"] == 7.0 and single["adaptive_over_best"] == 1.0
    assert math.isnan(microbatch.row(2, 8, {1: (1, 5.0)}, {})["adaptive_over_best"])
