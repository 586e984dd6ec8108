"""A count averaged over time (``observability/time_average.py``), on a clock of the test's
own: the mean since the last reading is the count's area over the interval, whatever instants
the readings fall on; and the mean of the values added since the last reading."""

from __future__ import annotations

import random

import pytest

from omni_mesh.observability.time_average import TimeAverage, WindowMean

pytestmark = pytest.mark.unit


def test_before_anything_happened_the_mean_is_the_count_now() -> None:
    avg = TimeAverage()
    assert avg.take(5.0) == 0.0
    assert avg.take(5.0) == 0.0  # no time passed: the count held now


def test_a_short_request_a_second_is_its_share_of_the_second() -> None:
    avg = TimeAverage()
    avg.take(0.0)
    avg.change(1, 0.30)
    avg.change(0, 0.34)  # 40 ms in flight
    assert avg.take(1.0) == pytest.approx(0.04)
    assert avg.take(2.0) == 0.0  # the next interval saw none


def test_work_across_a_reading_is_split_between_the_intervals() -> None:
    avg = TimeAverage()
    avg.take(0.0)
    avg.change(2, 0.5)
    assert avg.take(1.0) == pytest.approx(1.0)  # 2 for half the interval
    avg.change(0, 1.25)
    assert avg.take(2.0) == pytest.approx(0.5)  # 2 for a quarter of it


def test_a_change_dated_before_the_last_counts_at_the_last() -> None:
    avg = TimeAverage()
    avg.change(1, 1.0)
    avg.change(0, 0.5)  # clocks read on two paths may cross by a hair
    assert avg.take(2.0) == 0.0


def test_the_mean_of_random_work_is_its_area_over_the_time() -> None:
    rng = random.Random(7)
    avg, now, held, area = TimeAverage(), 0.0, 0, 0.0
    avg.take(0.0)
    for _ in range(1000):
        step = rng.uniform(0.0, 0.05)
        area += held * step
        now += step
        held = max(0, held + rng.choice((-1, 1)))
        avg.change(held, now)
    assert avg.take(now) == pytest.approx(area / now)


def test_a_window_mean_is_the_mean_of_what_came_since_the_last_take() -> None:
    waits = WindowMean()
    assert waits.take() == 0.0  # nothing came
    for value in (0.1, 0.2, 0.6):
        waits.add(value)
    assert waits.take() == pytest.approx(0.3)
    waits.add(1.0)
    assert waits.take() == 1.0  # only what came since
