"""The asyncio side of a pod's admission queue (:class:`AdmissionGate`): a future per waiter,
a timer per waiter (shed when its deadline can no longer be met), the queue's metrics. The
pure order and shedding logic is :mod:`omni_mesh.sidecar.admission.queue`; who may enter and
with which class is :mod:`omni_mesh.sidecar.admission.admit`."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter

from omni_mesh.observability.metrics import SidecarMetrics
from omni_mesh.sidecar.admission.queue import PRIORITY_NAMES, AdmissionQueue, Priority, Waiter
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.hop.shed import SHED_HEADER, SHED_TYPE

logger = logging.getLogger(__name__)

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

    def mean_in_use(self) -> float:
        """Slots held on average since the previous call (the pod's next heartbeat reads it)."""
        return self.queue.mean_in_use(time.monotonic())

    def mean_wait_s(self) -> float:
        """The mean wait in the queue since the previous call, at least the oldest waiter's
        (the pod's next heartbeat reads it)."""
        return self.queue.mean_wait_s(time.monotonic())

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
