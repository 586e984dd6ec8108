"""The sliding-window histogram an API server's heartbeats carry (first audio), the merge of
several servers' windows and the quantile of bucket counts, on a test clock."""

from __future__ import annotations

import math
import random

import pytest

from omni_mesh.observability.window_histogram import (
    WindowHistogram,
    bucket_quantile,
    merge_cumulative,
)

pytestmark = pytest.mark.unit

BOUNDS = (0.1, 0.2, 0.5, 1.0)


def test_a_snapshot_holds_the_last_window_and_reading_it_again_does_not_add_up() -> None:
    h = WindowHistogram(BOUNDS, window_s=10.0, slots=10)
    for value in (0.05, 0.15, 0.15, 0.4, 0.9, 3.0):
        h.observe(value, now=100.2)
    expected = ([(0.1, 1), (0.2, 3), (0.5, 4), (1.0, 5)], 6)
    # A snapshot, not a change since the last reading: the same each time it is read.
    assert h.snapshot(100.5) == expected
    assert h.snapshot(100.5) == expected
    assert h.snapshot(109.9) == expected  # still within 10 s
    h.observe(0.05, now=105.0)
    assert h.snapshot(109.9)[1] == 7
    # The first samples' sub-window leaves the window; the later one stays until it leaves too.
    assert h.snapshot(110.1) == ([(0.1, 1), (0.2, 1), (0.5, 1), (1.0, 1)], 1)
    assert h.snapshot(115.1) == ([(0.1, 0), (0.2, 0), (0.5, 0), (1.0, 0)], 0)


def test_a_slot_reused_after_a_long_silence_starts_empty() -> None:
    h = WindowHistogram(BOUNDS, window_s=1.0, slots=4)
    h.observe(0.15, now=0.1)
    h.observe(0.15, now=100.1)  # the same ring slot, 100 windows later
    assert h.snapshot(100.2) == ([(0.1, 0), (0.2, 1), (0.5, 1), (1.0, 1)], 1)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="ascending"):
        WindowHistogram((0.2, 0.1))
    with pytest.raises(ValueError, match="window_s"):
        WindowHistogram(BOUNDS, window_s=0.0)


def test_the_quantile_reads_within_the_bucket_as_prometheus_does() -> None:
    cumulative = [(0.1, 10), (0.2, 50), (0.5, 90), (1.0, 100)]
    # rank 95 of 100 lies in (0.5, 1.0], 5 of its 10: halfway.
    assert bucket_quantile(0.95, cumulative, 100) == pytest.approx(0.75)
    assert bucket_quantile(0.5, cumulative, 100) == pytest.approx(0.2)
    assert bucket_quantile(0.05, cumulative, 100) == pytest.approx(0.05)  # from 0
    # Above the last bound: that bound (the +Inf bucket has no upper end).
    assert bucket_quantile(0.95, [(0.1, 10), (1.0, 20)], 100) == 1.0
    assert bucket_quantile(0.95, [], 0) is None
    assert bucket_quantile(0.95, [(0.1, 0)], 0) is None


def test_the_quantile_of_bucketed_samples_is_within_their_bucket() -> None:
    rng = random.Random(7)
    bounds = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
    for _ in range(50):
        values = sorted(rng.lognormvariate(-1.0, 1.0) for _ in range(rng.randint(20, 400)))
        h = WindowHistogram(bounds)
        for v in values:
            h.observe(v, 1.0)
        cumulative, total = h.snapshot(1.0)
        truth = values[math.ceil(0.95 * len(values)) - 1]
        got = bucket_quantile(0.95, cumulative, total)
        assert got is not None
        upper = next((b for b in bounds if truth <= b), bounds[-1])
        lower = max((b for b in bounds if b < truth), default=0.0)
        assert lower - 1e-9 <= got <= upper + 1e-9, (truth, got)


def test_windows_merge_by_bound_even_across_releases() -> None:
    a = ([(0.1, 1), (0.5, 3), (1.0, 4)], 5)
    b = ([(0.1, 2), (0.5, 2), (1.0, 6)], 6)
    assert merge_cumulative([a, b]) == ([(0.1, 3), (0.5, 5), (1.0, 10)], 11)
    # A window without a bound counts what lies at or below its nearest lower one there.
    older = ([(0.5, 2), (2.0, 4)], 4)
    merged, total = merge_cumulative([a, older])
    assert merged == [(0.1, 1), (0.5, 5), (1.0, 6), (2.0, 8)] and total == 9
    assert merge_cumulative([]) == ([], 0)
