"""Suspect reports: the fast path out of discovery for a replica that died.

A sender whose connection to a replica was refused or reset reports it
(``POST /v1/instances/{id}/suspect``). The lease would take the replica out after
``lease_ttl_ms``; this takes it out within one probe. The omni-cp that receives the report
does not take the sender's word for it: it probes the instance itself (``GET {address}/health``,
a fresh connection, a short timeout) and isolates it (reason ``unreachable``) only when its own
probe fails at the connection level too (refused, reset, timeout, host unreachable). Any HTTP
answer, whatever its status, means the process is alive: nothing is done. So one confused or
partitioned sender cannot take a healthy replica out of the pool, and an isolated replica that
is in fact alive comes back with its next heartbeat.

Probes are deduplicated per instance within this omni-cp: one probe at a time (concurrent
reports wait for it and share its result), and a result is reused for ``min_interval_s`` so a
burst of reports costs one probe. The probe and the isolation run in a task of their own, so a
reporter that goes away does not cancel them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from dataclasses import dataclass

import aiohttp

from omni_mesh.control_plane.schema import REASON_UNREACHABLE, InstanceInfo, ProbeOutcome
from omni_mesh.control_plane.store.instances import InstanceStore
from omni_mesh.observability.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)

PROBE_PATH = "/health"
PROBE_TIMEOUT_S = 0.4
PROBE_MIN_INTERVAL_S = 0.5
_MAX_REMEMBERED = 4096

_CONNECT_ERRNO = {
    errno.ECONNREFUSED: ProbeOutcome.REFUSED,
    errno.ECONNRESET: ProbeOutcome.RESET,
    errno.EPIPE: ProbeOutcome.RESET,
    errno.ETIMEDOUT: ProbeOutcome.TIMEOUT,
    errno.EHOSTUNREACH: ProbeOutcome.UNREACHABLE,
}


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe's outcome; ``at`` is when it ended (monotonic seconds)."""

    outcome: ProbeOutcome
    detail: str
    at: float


def classify(exc: BaseException, timeout_s: float) -> tuple[ProbeOutcome, str]:
    """(outcome, detail) of a probe that got no HTTP answer."""
    if isinstance(exc, TimeoutError):  # ServerTimeoutError included
        return ProbeOutcome.TIMEOUT, f"no answer within {timeout_s:g}s"
    if isinstance(exc, aiohttp.ClientSSLError):  # something answered the TLS handshake
        return ProbeOutcome.ERROR, f"TLS error: {exc}"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):  # may be this host's DNS, not it
        return ProbeOutcome.ERROR, f"cannot resolve {exc.host}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return ProbeOutcome.RESET, "closed the connection without answering"
    if isinstance(exc, aiohttp.ClientOSError):
        outcome = _CONNECT_ERRNO.get(exc.errno or 0, ProbeOutcome.ERROR)
        return outcome, exc.strerror or str(exc) or type(exc).__name__
    return ProbeOutcome.ERROR, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class SuspectChecker:
    """Probes suspect instances (deduplicated) and isolates those found dead."""

    def __init__(
        self,
        store: InstanceStore,
        metrics: ControlPlaneMetrics,
        *,
        timeout_s: float = PROBE_TIMEOUT_S,
        min_interval_s: float = PROBE_MIN_INTERVAL_S,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._session: aiohttp.ClientSession | None = None
        self._pending: dict[str, asyncio.Task[Probe]] = {}
        self._recent: dict[str, Probe] = {}

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # A fresh connection per probe: a stale keep-alive connection that the instance
            # closed would read as "reset" and isolate a live instance.
            connector = aiohttp.TCPConnector(force_close=True, limit=256)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def close(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def check(self, info: InstanceInfo) -> tuple[Probe, bool]:
        """Probe ``info`` (isolating it if it is dead) unless a probe of it is running or
        ended less than ``min_interval_s`` ago; returns (probe, reused)."""
        instance_id = info.instance_id
        recent = self._recent.get(instance_id)
        if recent is not None and time.monotonic() - recent.at < self.min_interval_s:
            return recent, True
        task = self._pending.get(instance_id)
        reused = task is not None
        if task is None:
            task = asyncio.create_task(self._run(info), name=f"omni-cp-probe-{instance_id}")
            self._pending[instance_id] = task
            task.add_done_callback(lambda t: self._done(instance_id, t))
        return await asyncio.shield(task), reused

    def _done(self, instance_id: str, task: asyncio.Task[Probe]) -> None:
        if self._pending.get(instance_id) is task:
            del self._pending[instance_id]
        if task.cancelled() or task.exception() is not None:
            return  # not remembered: the next report probes again
        now = time.monotonic()
        if len(self._recent) >= _MAX_REMEMBERED:
            self._recent = {
                k: p for k, p in self._recent.items() if now - p.at < self.min_interval_s
            }
        self._recent[instance_id] = task.result()

    async def _run(self, info: InstanceInfo) -> Probe:
        labels = (info.pipeline, str(info.stage_id))
        probe = await self.probe(info.address)
        self._metrics.probes.labels(*labels, probe.outcome.value).inc()
        if not probe.outcome.dead:
            logger.info(
                "suspect instance=%s pipeline=%s stage=%s is alive: probe %s (%s)",
                info.instance_id,
                info.pipeline,
                info.stage_id,
                probe.outcome.value,
                probe.detail,
            )
            return probe
        result = await self._store.isolate_unreachable(info.instance_id)
        if result is not None and result.changed:
            self._metrics.isolations.labels(*labels, REASON_UNREACHABLE).inc()
            logger.warning(
                "probe failed: isolating instance=%s pipeline=%s stage=%s address=%s: %s (%s)",
                info.instance_id,
                info.pipeline,
                info.stage_id,
                info.address,
                probe.outcome.value,
                probe.detail,
            )
        return probe

    async def probe(self, address: str) -> Probe:
        """``GET {address}/health`` on a fresh connection: any HTTP answer means alive."""
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._get_session().get(
                address + PROBE_PATH, timeout=timeout, allow_redirects=False
            ) as resp:
                outcome, detail = ProbeOutcome.ANSWERED, f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            outcome, detail = classify(exc, self.timeout_s)
        ended = time.monotonic()
        self._metrics.probe_duration.observe(ended - started)
        return Probe(outcome, detail, ended)
