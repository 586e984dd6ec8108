"""Admission of work into this pod: draining → 503, full → 429, duplicate → 409."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.pod import Pod


@contextlib.contextmanager
def admitted(pod: Pod, key: str, route: str) -> Iterator[None]:
    """Count one piece of work in; ``key`` names it (the request id, or the
    :func:`~omni_mesh.data_plane.messages.transfer_key` of a stage input) so that the same
    work sent twice to one pod is refused (409) while it runs."""
    labels = (pod.pipeline.name, str(pod.stage_id))
    if pod.draining:
        pod.metrics.rejected.labels(*labels, "draining").inc()
        raise ApiError(
            503, "instance is draining", type_="unavailable", headers={"Retry-After": "1"}
        )
    capacity = (
        pod.stage_config.max_inflight if pod.engine is not None else pod.settings.api_max_inflight
    )
    if pod.in_flight >= capacity:
        pod.metrics.rejected.labels(*labels, "full").inc()
        raise ApiError(
            429,
            f"stage {pod.stage_id} instance is at capacity ({capacity})",
            type_="rate_limit",
            headers={"Retry-After": "0"},
        )
    if pod.engine is not None and pod.engine.is_running(key):
        pod.metrics.rejected.labels(*labels, "duplicate").inc()
        raise ApiError(409, f"request {key} is already running here", type_="conflict")
    pod.in_flight += 1
    gauge = pod.in_flight_gauge
    gauge.inc()
    try:
        yield
    finally:
        pod.in_flight -= 1
        gauge.dec()
