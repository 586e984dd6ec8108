"""Liveness of replicas with hops outstanding: a silent host costs a request about a second.

A hop's answer may legitimately take long (a slow stage sends nothing until its answer), so a
read timeout cannot tell a slow replica from one whose host dropped off the network without a
reset. Instead, while a call to a replica has waited longer than ``probe_after_s`` with no
answer (nor a frame of one), this probes the replica: ``GET /health`` on a fresh connection of
its own, connected within ``connect_timeout_s`` and answered within ``answer_timeout_s``. Any
HTTP answer, whatever its status, means the replica is alive and its hops keep waiting. A probe
that fails (no connection in time, refused, reset, no answer) fails every call outstanding to
that replica at once (:meth:`HopHttpClient.abort`): the hop client sees a connection-level
failure, ejects the replica, reports it as suspect to the control plane (which probes it itself
before isolating it) and replays the hop on another replica, within the request's deadline.

One prober per replica at a time, shared by all its outstanding calls; a replica is probed at
most once per ``interval_s`` while its calls stay outstanding, and not at all otherwise.
Worst case for a hop sent just before its host went silent: ``probe_after_s`` + one tick +
``connect_timeout_s`` (0.5 + 0.1 + 0.3 s by default), then the replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from omni_mesh.sidecar.hop.http import HopHttpClient
from omni_mesh.sidecar.hop.timeouts import within

logger = logging.getLogger(__name__)

PROBE_PATH = "/health"
_MAX_TICK_S = 0.1


@dataclass(frozen=True)
class LivenessConfig:
    """The prober's figures (``StageSettings.hop_*``)."""

    probe_after_s: float = 0.5
    interval_s: float = 0.5
    connect_timeout_s: float = 0.3
    answer_timeout_s: float = 2.0  # after connecting: a hung process, not a silent host

    @property
    def tick_s(self) -> float:
        return min(_MAX_TICK_S, self.probe_after_s / 2, self.interval_s / 2)


async def probe(host: str, port: int, *, connect_timeout_s: float, answer_timeout_s: float) -> str:
    """``GET /health`` on a fresh connection: ``""`` when anything answered over HTTP, else
    why not (for logs and for the error of the calls it fails)."""
    try:
        reader, writer = await within(asyncio.open_connection(host, port), connect_timeout_s)
    except TimeoutError:
        return f"no connection within {connect_timeout_s:g}s"
    except OSError as exc:
        return f"cannot connect: {exc.strerror or exc}"
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"GET {PROBE_PATH} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    try:
        writer.write(request.encode())
        line = await within(reader.readline(), answer_timeout_s)
    except TimeoutError:
        return f"connected, but no answer within {answer_timeout_s:g}s"
    except OSError as exc:
        return f"connection failed: {exc.strerror or exc}"
    finally:
        writer.transport.abort()  # nothing more to read; no lingering close
    if not line.startswith(b"HTTP/"):
        return "closed the connection without answering"
    return ""


class HopLiveness:
    """Probes the replicas that ``http`` has calls outstanding to (see the module doc)."""

    def __init__(self, http: HopHttpClient, config: LivenessConfig) -> None:
        self.http = http
        self.config = config
        self._probing: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._last: dict[tuple[str, int], float] = {}  # when each replica's last probe ended
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._run(), name="hop-liveness")

    async def close(self) -> None:
        tasks = [t for t in (self._ticker, *self._probing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ticker = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self.tick()

    def tick(self) -> None:
        """Start a probe of every replica whose oldest outstanding call waited too long
        (unless one is running or ended less than ``interval_s`` ago)."""
        now = asyncio.get_running_loop().time()
        outstanding = self.http.outstanding()
        for key in [k for k in self._last if k not in outstanding]:
            del self._last[key]  # nothing outstanding: the next wait starts afresh
        for key, since in outstanding.items():
            if now - since < self.config.probe_after_s or key in self._probing:
                continue
            if now - self._last.get(key, -1e9) < self.config.interval_s:
                continue
            self._probing[key] = asyncio.create_task(
                self._probe(key), name=f"hop-probe-{key[0]}:{key[1]}"
            )

    async def _probe(self, key: tuple[str, int]) -> None:
        host, port = key
        try:
            why = await probe(
                host,
                port,
                connect_timeout_s=self.config.connect_timeout_s,
                answer_timeout_s=self.config.answer_timeout_s,
            )
        finally:
            self._last[key] = asyncio.get_running_loop().time()
            del self._probing[key]
        if not why:
            return
        reason = f"{host}:{port} failed a liveness probe ({PROBE_PATH}: {why})"
        cut = self.http.abort(key, reason)
        logger.warning("replica %s: failing its %d outstanding call(s) (replayed)", reason, cut)
