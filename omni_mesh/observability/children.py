"""Labelled children of metrics, looked up once: ``metric.labels(...)`` validates and locks on
every call (a few µs), which the hop path pays several times per request. ``labelled(metric,
*values)`` returns the same child as ``metric.labels(*values)``, from a cache after the first
call. The cache holds at most :data:`MAX_CHILDREN` children (least recently used dropped: a
dropped child is only looked up again, never lost, since the metric keeps it)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

MAX_CHILDREN = 4096

if TYPE_CHECKING:

    def labelled(metric: M, *values: str) -> M:
        """``metric.labels(*values)``, cached."""

else:

    @functools.lru_cache(maxsize=MAX_CHILDREN)  # one C call per use: no wrapper around it
    def labelled(metric, *values):
        """``metric.labels(*values)``, cached."""
        return metric.labels(*values)
