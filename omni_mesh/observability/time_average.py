"""A count averaged over time (:class:`TimeAverage`): how many requests (or slots) something
held on average since the last reading, which a count read at one instant misses when each
piece of work is short; and the mean of the values seen since the last reading
(:class:`WindowMean`: a queue's waits, one per request).

Pure: no clock of its own (every call takes ``now``, monotonic seconds), so it is unit-tested
with a clock of the test's own. A pod's heartbeats report two of them: its engine's work in
flight (``EngineClient.mean_in_flight``, the ``occupancy`` figure the autoscaler sizes a pool
from) and a prefill replica's admission slots (``AdmissionQueue.mean_in_use``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TimeAverage:
    """A step function of time (the count held) and its area since the last :meth:`take`:
    the area over that interval is the count held on average (Little's law's L = arrival rate x
    time held). Read at one instant, the count misses work that is there a short time: a
    request of 40 ms a second is there at 4% of instants, and an instant's sample says 0 or 1,
    never 0.04."""

    held: int = 0  # the count now
    since: float | None = None  # start of the current interval (None: nothing happened yet)
    at: float = 0.0  # when ``held`` last changed
    area: float = 0.0  # count-seconds since ``since``

    def change(self, held: int, now: float) -> None:
        """``held`` from ``now`` on (a ``now`` earlier than the last change counts as it)."""
        if self.since is None:
            self.since = self.at = now
        self.area += self.held * max(0.0, now - self.at)
        self.held, self.at = held, max(self.at, now)

    def take(self, now: float) -> float:
        """The mean count since the previous take (at first since the first change; the count
        held now when no time has passed); the next interval starts ``now``."""
        self.change(self.held, now)
        assert self.since is not None
        span = now - self.since
        mean = self.area / span if span > 0 else float(self.held)
        self.since, self.area = now, 0.0
        return mean


@dataclass
class WindowMean:
    """The mean of the values added since the last :meth:`take` (one per request: its wait)."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1

    def take(self) -> float:
        """The mean since the previous take (0 when nothing was added); starts afresh."""
        mean = self.total / self.count if self.count else 0.0
        self.total, self.count = 0.0, 0
        return mean
