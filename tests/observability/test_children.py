"""labelled(): the same child as metric.labels(), looked up once."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from omni_mesh.observability.children import labelled

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_labelled_is_the_metrics_own_child_and_counts_there() -> None:
    registry = CollectorRegistry()
    requests = Counter("t_requests_total", "d", ["stage", "outcome"], registry=registry)
    latency = Histogram("t_seconds", "d", ["stage"], registry=registry)
    assert labelled(requests, "1", "ok") is requests.labels("1", "ok")
    labelled(requests, "1", "ok").inc()
    labelled(requests, "1", "ok").inc(2)
    labelled(latency, "1").observe(0.5)
    assert registry.get_sample_value("t_requests_total", {"stage": "1", "outcome": "ok"}) == 3
    assert registry.get_sample_value("t_seconds_count", {"stage": "1"}) == 1


def test_children_of_two_registries_stay_apart() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ca = Counter("t_x_total", "d", ["k"], registry=a)
    cb = Counter("t_x_total", "d", ["k"], registry=b)
    labelled(ca, "v").inc()
    assert labelled(cb, "v") is not labelled(ca, "v")
    assert b.get_sample_value("t_x_total", {"k": "v"}) == 0
