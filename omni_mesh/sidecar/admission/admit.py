"""Admission of work into this pod: draining → 503, duplicate → 409, full → the admission queue.

A pod runs at most ``max_inflight`` requests at once (``api_max_inflight`` on an API server
without an engine). Past that a request is not refused: it waits in the pod's
:class:`~omni_mesh.sidecar.admission.queue.AdmissionQueue` (its HTTP connection stays open) and
is admitted when a slot frees, in priority / tenant round-robin / FIFO order — no polling
anywhere. A request that cannot be served in time is shed: 503 with ``Retry-After`` computed
from the queue, error type ``shed``, a message saying why (see
:meth:`~omni_mesh.sidecar.admission.queue.Shed.message`), never started. A sender's hop client
tells a shed from a replica failure by that type and tries another replica instead of ejecting
this one.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType

from omni_mesh.data_plane.messages import StageInput
from omni_mesh.sidecar.admission.gate import AdmissionGate
from omni_mesh.sidecar.admission.queue import AdmissionQueue, Priority, Waiter, parse_priority
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)


#: The fewest slots of an API server by default (``api_max_inflight`` unset).
MIN_API_SLOTS = 64


def gate_of(pod: Pod) -> AdmissionGate:
    """The pod's admission gate, built on first use from its deploy config."""
    if pod.gate is None:
        stage = pod.stage_config
        slots = stage.max_inflight if pod.engine is not None else api_slots(pod)
        queue = AdmissionQueue(slots, stage.max_queue, stage.max_queue_wait_s)
        pod.gate = AdmissionGate(queue, pod.metrics, (pod.pipeline.name, str(pod.stage_id)))
        # Read when scraped: no gauge update on every request.
        pod.in_flight_gauge.set_function(lambda: pod.in_flight)
    return pod.gate


def api_slots(pod: Pod) -> int:
    """An engine-less API server's slots: ``api_max_inflight``, by default twice what its entry
    stage's pool runs at once. More would only move the queue to the entry stage's pods and
    flood them with connections in a burst; fewer would leave the pool idle. The rest wait
    here, in the same order (priority, tenant, FIFO)."""
    if pod.settings.api_max_inflight is not None:
        return pod.settings.api_max_inflight
    entry = pod.deploy.stage(pod.pipeline.entry_stage_id)
    return max(MIN_API_SLOTS, 2 * entry.max_inflight * entry.max_pool_size)


def admitted(
    pod: Pod, key: str, route: str, si: StageInput | None = None, *, deadline_ms: int = 0
) -> Admission:
    """Hold one of the pod's slots for a piece of work (``async with``), waiting in the
    admission queue when all are taken; ``key`` names it (the request id, or the
    :func:`~omni_mesh.data_plane.messages.transfer_key` of a stage input) so that the same
    work sent twice to one pod is refused (409) while it runs. Priority, tenant and deadline
    come from ``si`` (normal, anonymous and ``deadline_ms`` without one)."""
    return Admission(pod, key, si, deadline_ms)


class Admission:
    """The async context manager of :func:`admitted` (a class, not an async generator: it
    runs on every hop)."""

    __slots__ = ("_gate", "_waiter", "deadline_ms", "key", "pod", "si")

    def __init__(self, pod: Pod, key: str, si: StageInput | None, deadline_ms: int) -> None:
        self.pod = pod
        self.key = key
        self.si = si
        self.deadline_ms = deadline_ms
        self._gate: AdmissionGate | None = None
        self._waiter: Waiter | None = None

    async def __aenter__(self) -> None:
        pod, key, si = self.pod, self.key, self.si
        if pod.draining:
            pod.metrics.rejected.labels(pod.pipeline.name, str(pod.stage_id), "draining").inc()
            raise ApiError(
                503, "instance is draining", type_="unavailable", headers={"Retry-After": "1"}
            )
        if pod.engine is not None and pod.engine.is_running(key):
            pod.metrics.rejected.labels(pod.pipeline.name, str(pod.stage_id), "duplicate").inc()
            raise ApiError(409, f"request {key} is already running here", type_="conflict")
        gate = gate_of(pod)
        priority, tenant, deadline_ms = Priority.NORMAL, "", self.deadline_ms
        if si is not None:
            priority, tenant, deadline_ms = parse_priority(si.priority), si.tenant, si.deadline_ms
        deadline = time.monotonic() + (deadline_ms / 1000.0 - time.time()) if deadline_ms else 1e18
        self._waiter = await gate.enter(priority, tenant, deadline)
        self._gate = gate
        pod.in_flight += 1
        pod.admitted += 1

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._gate is not None and self._waiter is not None
        self.pod.in_flight -= 1
        self._gate.leave(self._waiter)
