"""Admission of work into this pod: draining → 503, duplicate → 409, full → the admission queue.

A pod runs at most ``max_inflight`` requests at once (``api_max_inflight`` on an API server
without an engine). Past that a request is not refused: it waits in the pod's
:class:`~omni_mesh.sidecar.admission_queue.AdmissionQueue` (its HTTP connection stays open) and
is admitted when a slot frees, in priority / tenant round-robin / FIFO order — no polling
anywhere. A request that cannot be served in time is shed: 503 with ``Retry-After`` computed
from the queue, error type ``shed``, a message saying why (see
:meth:`~omni_mesh.sidecar.admission_queue.Shed.message`), never started. A sender's hop client
tells a shed from a replica failure by that type and tries another replica instead of ejecting
this one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from types import TracebackType

from aiohttp import web
from prometheus_client import Counter

from omni_mesh.data_plane.messages import PriorityClass, StageInput
from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.admission_queue import (
    PRIORITY_NAMES,
    SHED_TYPE,
    AdmissionQueue,
    Priority,
    Waiter,
    parse_priority,
)
from omni_mesh.sidecar.errors import ApiError, bad_request
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)

SHED_HEADER = "X-Omni-Shed"
PRIORITY_HEADER = "X-Omni-Priority"
TENANT_HEADER = "X-Omni-Tenant"
PRIORITY_NAMES_TYPED: tuple[PriorityClass, ...] = ("high", "normal", "low")
_TENANT = re.compile(r"[\w.:\-]{1,64}")
_PRIORITIES = tuple(Priority)


class AdmissionGate:
    """The asyncio side of one pod's admission queue: futures for the waiters, a timer per
    waiter (shed when its deadline can no longer be met), metrics."""

    def __init__(self, queue: AdmissionQueue, metrics: SidecarMetrics, labels: tuple[str, str]):
        self.queue = queue
        self.metrics = metrics
        self.labels = labels
        self._wakeups: dict[Waiter, asyncio.Future[None]] = {}
        self._lengths = [metrics.queue_length.labels(*labels, p) for p in PRIORITY_NAMES]
        self._waits = [metrics.queue_wait.labels(*labels, p) for p in PRIORITY_NAMES]
        self._admitted = [metrics.admitted.labels(*labels, p) for p in PRIORITY_NAMES]
        self._shown = [0] * len(PRIORITY_NAMES)  # the queue lengths the gauges show
        self._sheds: dict[tuple[str, Priority], Counter] = {}  # label children, made once

    def count_shed(self, reason: str, priority: Priority) -> None:
        """One more request shed for ``reason`` (its label child made on first use)."""
        child = self._sheds.get((reason, priority))
        if child is None:
            child = self.metrics.shed.labels(*self.labels, reason, PRIORITY_NAMES[priority])
            self._sheds[(reason, priority)] = child
        child.inc()

    @property
    def queued(self) -> int:
        return len(self.queue)

    async def enter(self, priority: Priority, tenant: str, deadline: float) -> Waiter:
        """A slot for one request (``deadline``: monotonic seconds); :class:`ApiError` 503
        when it is shed, at once or while it waits."""
        now = time.monotonic()
        w = Waiter(priority, tenant, deadline, now)
        self._settle(self.queue.offer(w, now))
        if w.state == "queued":
            await self._wait(w)
        if w.shed is not None:
            raise self._shed_error(w)
        return w

    def leave(self, w: Waiter) -> None:
        """The work of ``w`` ended: its slot goes to the next waiter."""
        now = time.monotonic()
        self._settle(self.queue.release(now, now - w.admitted_at))

    async def _wait(self, w: Waiter) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wakeups[w] = fut
        try:
            async with asyncio.timeout_at(self._loop_time(self.queue.hopeless_at(w))):
                await fut
        except TimeoutError:
            if w.state == "queued":  # not admitted in the same instant
                self._settle([self.queue.expire(w, time.monotonic())])
        except BaseException:  # cancelled: the client went away
            if w.state == "queued":
                self.queue.cancel(w)
                self._gauges()
            elif w.state == "admitted":
                self.leave(w)
            raise
        finally:
            self._wakeups.pop(w, None)

    def _settle(self, changed: list[Waiter]) -> None:
        """Count and wake the waiters whose state changed."""
        for w in changed:
            if w.state == "admitted":
                self._admitted[w.priority].inc()
                self._waits[w.priority].observe(w.waited_s)
            elif w.shed is not None:
                self.count_shed(w.shed.reason, w.priority)
            fut = self._wakeups.get(w)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._gauges()

    def _gauges(self) -> None:
        """Queue lengths into the gauges; only those that changed (most requests never
        queue: no gauge is touched for them). A free slot means an empty queue (a slot that
        frees goes to the next waiter at once)."""
        queue = self.queue
        if queue.in_use < queue.slots and not any(self._shown):
            return
        for p in _PRIORITIES:
            n = queue.queued(p)
            if n != self._shown[p]:
                self._shown[p] = n
                self._lengths[p].set(n)

    @staticmethod
    def _loop_time(monotonic_s: float) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + (monotonic_s - time.monotonic())

    def _shed_error(self, w: Waiter) -> ApiError:
        assert w.shed is not None
        logger.debug(  # one line per shed would flood the log under overload: see the metrics
            "stage=%s shed a %s-priority request: %s",
            self.labels[1],
            PRIORITY_NAMES[w.priority],
            w.shed.message(),
        )
        return ApiError(
            503,
            w.shed.message(),
            type_=SHED_TYPE,
            headers={"Retry-After": w.shed.retry_after_header, SHED_HEADER: w.shed.reason},
        )


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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._gate is not None and self._waiter is not None
        self.pod.in_flight -= 1
        self._gate.leave(self._waiter)


# ---- a client request's class -------------------------------------------------------------


def request_class(
    pod: Pod, request: web.Request, body_priority: PriorityClass | None = None
) -> tuple[PriorityClass, str]:
    """A client request's priority class and tenant: the ``X-Omni-Priority`` header, else
    ``priority`` in its body, else normal — on every route the header wins, so a gateway in
    front can set the class (400 naming it when bad or not accepted on this route:
    ``priority_classes`` in the deploy config); the tenant is ``X-Omni-Tenant``, else a hash of
    its API key (never the key itself), else anonymous."""
    raw = request.headers.get(PRIORITY_HEADER)
    priority: PriorityClass = "normal"
    if raw is not None:
        try:
            priority = PRIORITY_NAMES_TYPED[parse_priority(raw)]
        except ValueError as exc:
            raise bad_request(f"{PRIORITY_HEADER}: {exc}", PRIORITY_HEADER) from None
    elif body_priority is not None:
        priority = body_priority
    route = request.path  # the client routes are plain paths
    caps = {str(k): v for k, v in pod.deploy.priority_classes.items()}
    allowed = caps.get(route)
    if allowed is not None and priority not in allowed:
        raise bad_request(
            f"priority: {priority!r} is not accepted on {route} (accepted: {', '.join(allowed)})",
            "priority",
        )
    return priority, request_tenant(request)


def openai_priority(request: web.Request, field: PriorityClass | None) -> PriorityClass | None:
    """The priority the OpenAI routes' optional ``priority`` body field asks for, unless the
    ``X-Omni-Priority`` header is given: on these routes the header wins (a gateway in front
    sets it, while the field comes from the client's SDK ``extra_body``)."""
    return None if PRIORITY_HEADER in request.headers else field


def request_tenant(request: web.Request) -> str:
    """A client request's tenant: ``X-Omni-Tenant`` (400 when malformed), else a hash of its
    API key, else anonymous ('')."""
    tenant = request.headers.get(TENANT_HEADER, "").strip()
    if tenant:
        if not _TENANT.fullmatch(tenant):
            raise bad_request(
                f"{TENANT_HEADER}: 1 to 64 characters of letters, digits and ._:-",
                TENANT_HEADER,
            )
        return tenant
    auth = request.headers.get("Authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:16]
    return ""
