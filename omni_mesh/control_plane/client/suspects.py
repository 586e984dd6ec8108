"""``SuspectReporter``: tells the control plane about replicas a router could not connect to.

A router ejects a replica from its own pools the moment a connection to it is refused or
reset; the control plane only learns of the death when the lease runs out. Passed to the
router as its ``on_eject`` callback, the reporter sends one suspect report per ejection in a
background task (fire and forget): the control plane probes the replica and takes it out of
everyone's discovery if it is dead. The control plane may be unreachable (invariant 5): a
report that fails is logged at debug level and dropped, the lease still does the job.
"""

from __future__ import annotations

import asyncio
import logging

from omni_mesh.control_plane.client.http import ControlPlaneClient

logger = logging.getLogger(__name__)


class SuspectReporter:
    """``reporter(instance_id, reason, connection_level)``: report connection-level ejections.

    At most one report per instance is in flight, and at most ``max_pending`` in all. Call
    :meth:`close` before closing the client.
    """

    def __init__(
        self,
        client: ControlPlaneClient,
        *,
        reporter: str | None = None,
        max_pending: int = 64,
    ) -> None:
        self.client = client
        self.reporter = reporter
        self.max_pending = max_pending
        self.sent = 0  # reports started (for tests and logs)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def __call__(self, instance_id: str, reason: str, connection_level: bool) -> None:
        if not connection_level or self._closed or instance_id in self._pending:
            return
        if len(self._pending) >= self.max_pending:
            logger.debug("not reporting instance=%s: %d pending", instance_id, self.max_pending)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop: nothing can be sent
            return
        task = loop.create_task(
            self._report(instance_id, reason), name=f"omni-suspect-{instance_id}"
        )
        self._pending[instance_id] = task
        task.add_done_callback(lambda t: self._forget(instance_id, t))
        self.sent += 1

    def _forget(self, instance_id: str, task: asyncio.Task[None]) -> None:
        if self._pending.get(instance_id) is task:
            del self._pending[instance_id]

    async def _report(self, instance_id: str, reason: str) -> None:
        try:
            result = await self.client.suspect(instance_id, reason, reporter=self.reporter)
        except Exception as exc:  # control plane down, instance unknown...: the lease decides
            logger.debug("suspect report of instance=%s not delivered: %s", instance_id, exc)
            return
        if result.isolated and not result.cached:
            logger.info(
                "control plane isolated instance=%s: probe %s (%s)",
                instance_id,
                result.probe.value,
                result.detail,
            )
        else:
            logger.debug(
                "suspect report of instance=%s: isolated=%s probe=%s (%s)",
                instance_id,
                result.isolated,
                result.probe.value,
                result.detail,
            )

    async def close(self) -> None:
        """Stop reporting; cancel the reports in flight (bounded wait)."""
        self._closed = True
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
