"""A histogram of the last few seconds (:class:`WindowHistogram`), and the quantile of bucket
counts (:func:`bucket_quantile`) and their merge across processes (:func:`merge_cumulative`).

An API server's heartbeats carry its window of time to first audio (``sidecar/admission/
load_report.py``); the autoscaler merges the windows of a pipeline's API servers and sizes a
pool from their p95 (``autoscale: target_first_audio_p95_ms``). A window is a **snapshot** of
the last ``window_s`` seconds, not the change since the previous reading: a control plane that
reads one report in several decisions (it decides more often than heartbeats arrive, or a
heartbeat is late) counts its samples once in each, never adds them up.

The window is ``slots`` sub-windows of ``window_s / slots`` seconds each, in a ring; a slot
older than the window is emptied before it is reused, so a snapshot holds the samples of the
last ``window_s`` seconds (up to one slot's width more). Pure: no clock of its own (every call
takes ``now``, monotonic seconds), so it is unit-tested with a clock of the test's own.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

#: (upper bound, samples at or below it) pairs, bounds ascending; the last bound may be +inf.
Cumulative = Sequence[tuple[float, int]]


class WindowHistogram:
    """Samples of the last ``window_s`` seconds in buckets of upper ``bounds`` (module
    docstring)."""

    def __init__(self, bounds: Sequence[float], window_s: float = 10.0, slots: int = 10) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError("bounds must be ascending and distinct")
        if window_s <= 0 or slots < 1:
            raise ValueError("window_s must be positive and slots at least 1")
        self.bounds = tuple(float(b) for b in bounds)
        self.window_s = window_s
        self._width = window_s / slots
        # Per slot: the number of the sub-window it holds and its counts (one more: above all).
        self._slot_of = [-1] * slots
        self._counts = [[0] * (len(self.bounds) + 1) for _ in range(slots)]

    def _slot(self, now: float) -> int:
        """The slot of ``now``'s sub-window, emptied first if it held an older one."""
        number = math.floor(now / self._width)
        index = number % len(self._slot_of)
        if self._slot_of[index] != number:
            self._slot_of[index] = number
            self._counts[index] = [0] * (len(self.bounds) + 1)
        return index

    def observe(self, value: float, now: float) -> None:
        """One sample at ``now``: it lands in the first bucket whose bound it does not pass."""
        counts = self._counts[self._slot(now)]
        counts[bisect.bisect_left(self.bounds, value)] += 1

    def snapshot(self, now: float) -> tuple[list[tuple[float, int]], int]:
        """The window's cumulative counts at each bound and its total (the samples above the
        last bound are in the total only, as Prometheus's ``+Inf`` bucket)."""
        current = math.floor(now / self._width)
        oldest = current - len(self._slot_of) + 1
        per_bucket = [0] * (len(self.bounds) + 1)
        for number, counts in zip(self._slot_of, self._counts, strict=True):
            if oldest <= number <= current:
                per_bucket = [a + b for a, b in zip(per_bucket, counts, strict=True)]
        cumulative, running = [], 0
        for bound, count in zip(self.bounds, per_bucket, strict=False):
            running += count
            cumulative.append((bound, running))
        return cumulative, running + per_bucket[-1]


def merge_cumulative(
    windows: Iterable[tuple[Cumulative, int]],
) -> tuple[list[tuple[float, int]], int]:
    """Several windows' cumulative counts summed (API servers of one pipeline) and their total.

    Windows with different bounds (servers of two releases) merge on the union of the bounds:
    at a bound a window does not have, it counts its samples at or below its nearest lower
    bound, which is at most the true count (a quantile read from the merge is never lower than
    the truth's bucket allows)."""
    windows = list(windows)
    bounds = sorted({b for cumulative, _ in windows for b, _ in cumulative})
    merged = []
    for bound in bounds:
        count = 0
        for cumulative, _ in windows:
            below = [c for b, c in cumulative if b <= bound]
            count += max(below, default=0)
        merged.append((bound, count))
    return merged, sum(total for _, total in windows)


def bucket_quantile(q: float, cumulative: Cumulative, total: int) -> float | None:
    """The ``q`` quantile (0..1) of samples counted in buckets, as Prometheus's
    ``histogram_quantile`` reads it: linear within the bucket that holds the rank (the first
    bucket from 0); a rank above the last finite bound gives that bound. None without samples."""
    if total <= 0 or not cumulative:
        return None
    rank = q * total
    lower, below = 0.0, 0
    for bound, count in cumulative:
        if count >= rank and math.isfinite(bound):
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        if not math.isfinite(bound):
            break
        lower, below = bound, count
    return lower
