"""``InstanceLease``: keeps one stage instance registered with the control plane.

``start()`` registers (retrying with backoff while the control plane is unreachable), then a
background task heartbeats every ``heartbeat_interval_ms`` (as the control plane asked) with
the load that ``load_fn`` reports. When the control plane answers that it does not know the
instance (404: Redis lost its data, or the record was evicted after a long outage) the lease
registers again and gets a new id and epoch (DESIGN invariant 5). While the control plane is
down it keeps trying, logging once per outage. ``stop()`` deregisters, best effort.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from http import HTTPStatus

from omni_mesh.control_plane.client.backoff import Backoff
from omni_mesh.control_plane.client.http import ControlPlaneClient
from omni_mesh.control_plane.errors import (
    ControlPlaneError,
    ControlPlaneRequestError,
    ControlPlaneUnavailableError,
    InstanceUnknownError,
)
from omni_mesh.control_plane.schema import (
    InstanceState,
    LoadReport,
    RegisterRequest,
    Registration,
)
from omni_mesh.control_plane.tasks import stop_task

#: While the control plane stays unreachable, a warning this often (seconds).
DOWN_LOG_INTERVAL_S = 5.0

logger = logging.getLogger(__name__)


class _Refused(Exception):
    """Re-registration refused with a 409: the lease gives up (``on_refused`` was told)."""


class InstanceLease:
    """Registration + heartbeats of one instance. ``await start()``, later ``await stop()``."""

    def __init__(
        self,
        client: ControlPlaneClient,
        request: RegisterRequest,
        load_fn: Callable[[], LoadReport],
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        on_registered: Callable[[Registration], None] | None = None,
        on_refused: Callable[[ControlPlaneRequestError], None] | None = None,
    ) -> None:
        self.client = client
        self.request = request
        self._load_fn = load_fn
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._on_registered = on_registered
        self._on_refused = on_refused
        self.registration: Registration | None = None
        self.registered = False
        self.state: InstanceState | None = None
        self.registrations = 0  # how many times it (re-)registered
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._cp_down = False
        self._down_since = self._down_logged = 0.0
        self._tag = (
            f"pipeline={request.pipeline} stage={request.stage_id} address={request.address}"
        )

    @property
    def instance_id(self) -> str | None:
        return None if self.registration is None else self.registration.instance_id

    @property
    def epoch(self) -> int | None:
        return None if self.registration is None else self.registration.epoch

    @property
    def heartbeat_interval_s(self) -> float:
        ms = 1000 if self.registration is None else self.registration.heartbeat_interval_ms
        return ms / 1000

    async def start(self) -> Registration:
        """Register (retrying until it succeeds or is cancelled) and start heartbeating.

        A 4xx answer (unknown pipeline, bad address, wrong token) is a configuration error and
        is raised at once.
        """
        if self._task is not None:
            raise RuntimeError("InstanceLease already started")
        registration = await self._register(raise_rejections=True)
        self._task = asyncio.create_task(
            self._heartbeat_loop(), name=f"omni-lease-{registration.instance_id}"
        )
        return registration

    async def stop(self, *, deregister: bool = True) -> None:
        """Stop heartbeating and leave the pool (best effort: errors are logged)."""
        self._stopping = True
        if self._task is not None:
            await stop_task(self._task, grace_s=0.0)
            self._task = None
        instance_id = self.instance_id
        if deregister and self.registered and instance_id is not None:
            try:
                await self.client.deregister(instance_id)
                logger.info("deregistered instance=%s %s", instance_id, self._tag)
            except InstanceUnknownError:
                logger.info("instance=%s already unknown to the control plane", instance_id)
            except ControlPlaneError as exc:
                logger.warning("could not deregister instance=%s: %s", instance_id, exc)
        self.registered = False

    async def _register(self, *, raise_rejections: bool) -> Registration:
        self.registered = False
        while True:
            if self._stopping:
                raise asyncio.CancelledError
            try:
                registration = await self.client.register(self.request)
            except ControlPlaneUnavailableError as exc:
                self._log_down(exc)
            except ControlPlaneRequestError as exc:
                if raise_rejections:
                    raise
                if self._refused(exc):
                    raise _Refused from None
                logger.error("registration rejected %s: %s", self._tag, exc)
            else:
                self._accept(registration)
                return registration
            await asyncio.sleep(self._backoff.next())

    def _accept(self, registration: Registration) -> None:
        self.registration = registration
        self.registered = True
        self.state = InstanceState.STANDBY if self.request.standby else InstanceState.HEALTHY
        self.registrations += 1
        self._backoff.reset()
        self._log_up()
        logger.info(
            "registered instance=%s epoch=%d %s",
            registration.instance_id,
            registration.epoch,
            self._tag,
        )
        if self._on_registered is not None:
            self._on_registered(registration)

    def _load(self) -> LoadReport:
        try:
            return self._load_fn()
        except Exception:  # a broken load_fn must not stop the heartbeats
            logger.exception("load_fn failed %s; reporting no load", self._tag)
            return LoadReport(capacity=self.request.capacity)

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not self._stopping:
            next_at = max(next_at + self.heartbeat_interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())
            instance_id = self.instance_id
            assert instance_id is not None
            try:
                ack = await self.client.heartbeat(instance_id, self._load())
            except InstanceUnknownError:
                logger.warning(
                    "control plane does not know instance=%s %s: registering again",
                    instance_id,
                    self._tag,
                )
                try:
                    await self._register(raise_rejections=False)
                except _Refused:
                    return
                next_at = loop.time()
                continue
            except ControlPlaneUnavailableError as exc:
                self._log_down(exc)
                continue
            except ControlPlaneRequestError as exc:
                if self._refused(exc):
                    return
                logger.error("heartbeat rejected instance=%s: %s", instance_id, exc)
                continue
            self._log_up()
            if ack.state != self.state:
                logger.info(
                    "instance=%s state %s -> %s reason=%s",
                    instance_id,
                    self.state.value if self.state else "-",
                    ack.state.value,
                    ack.reason or "-",
                )
            self.state = ack.state
            if ack.state is InstanceState.HEALTHY and self.request.standby:
                # Promoted: should this pod ever register again (Redis lost its data), it
                # comes back serving, not as a standby.
                self.request = self.request.model_copy(update={"standby": False})

    def _refused(self, exc: ControlPlaneRequestError) -> bool:
        """A 409 (this pod disagrees with its pipeline's pods: a configuration error) after the
        first registration: heartbeats stop and ``on_refused`` decides (the sidecar exits 2).
        True when it was such a refusal; without ``on_refused`` the lease keeps trying."""
        if exc.status != HTTPStatus.CONFLICT or self._on_refused is None:
            return False
        self._stopping = True
        self._on_refused(exc)
        return True

    def _log_down(self, exc: Exception) -> None:
        """A warning when the control plane stops answering, then one every
        :data:`DOWN_LOG_INTERVAL_S` while it stays down (retries go on, each logged at debug)."""
        now = time.monotonic()
        if not self._cp_down:
            self._down_since = self._down_logged = now
            logger.warning("control plane unreachable %s (retrying): %s", self._tag, exc)
        elif now - self._down_logged >= DOWN_LOG_INTERVAL_S:
            self._down_logged = now
            logger.warning(
                "control plane still unreachable after %.0fs %s (retrying): %s",
                now - self._down_since,
                self._tag,
                exc,
            )
        else:
            logger.debug("control plane still unreachable %s: %s", self._tag, exc)
        self._cp_down = True

    def _log_up(self) -> None:
        if self._cp_down:
            logger.info("control plane reachable again %s", self._tag)
        self._cp_down = False
