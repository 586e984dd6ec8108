"""Running omni-cp: embedded Redis (when no URL is given), uvloop, AppRunner + TCPSite, signals.

Shutdown on SIGTERM or SIGINT: stop accepting, wake watchers, finish in-flight requests
(bounded), release the sweeper lock, close Redis connections, then stop the embedded Redis.

The embedded Redis is supervised: when it dies unexpectedly it is restarted, empty, on the same
port (logged at ERROR); the sidecars' next heartbeats get 404 and they re-register (DESIGN
invariant 5). When it keeps dying (``REDIS_RESTART_LIMIT`` deaths within
``REDIS_RESTART_WINDOW_S``) omni-cp shuts down and exits non-zero, so that whatever supervises
omni-cp notices and restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvloop
from aiohttp import web

from omni_mesh.configs.settings import ControlPlaneSettings
from omni_mesh.control_plane.app import create_app
from omni_mesh.control_plane.embedded_redis import EmbeddedRedis, EmbeddedRedisError

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
REDIS_WATCH_INTERVAL_S = 0.1
REDIS_RESTART_LIMIT = 3
REDIS_RESTART_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class ServingInfo:
    """What the CLI announces once omni-cp accepts requests."""

    url: str
    redis_url: str
    embedded_redis: bool


class ServeError(RuntimeError):
    """omni-cp could not start (port taken, no redis-server binary, ...)."""


class _Stop(BaseException):
    """Raised by the pre-loop SIGTERM handler to unwind start-up."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop(signum)


async def run_app(
    settings: ControlPlaneSettings,
    redis_url: str,
    stop: asyncio.Event,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``stop`` is set, then shut down gracefully."""
    app = create_app(settings, redis_url)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise ServeError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
        url = f"http://{settings.host}:{settings.port}"
        logger.info("omni-cp serving on %s", url)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
        logger.info("omni-cp shutting down")
    finally:
        await runner.cleanup()


async def supervise_embedded_redis(
    embedded: EmbeddedRedis,
    stop: asyncio.Event,
    *,
    limit: int = REDIS_RESTART_LIMIT,
    window_s: float = REDIS_RESTART_WINDOW_S,
    interval_s: float = REDIS_WATCH_INTERVAL_S,
) -> None:
    """Restart ``embedded`` whenever it dies until ``stop`` is set.

    Raises :class:`ServeError` on the ``limit``-th death (a failed restart counts as one)
    within ``window_s``. Runs on the main thread's loop (see :mod:`.embedded_redis`).
    """
    deaths: deque[float] = deque()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set() or embedded.alive:
            continue
        now = time.monotonic()
        deaths.append(now)
        while now - deaths[0] > window_s:
            deaths.popleft()
        if embedded.pid is None:
            what = "embedded redis-server is not running (its restart failed)"
        else:
            what = f"embedded redis-server pid={embedded.pid} died unexpectedly "
            what += f"({embedded.exit_status()}"
            if embedded.returncode != -signal.SIGKILL:  # its own exit or crash: the log says why
                what += f"; its last log lines: {embedded.log_tail()}"
            what += ")"
        if len(deaths) >= limit:
            message = (
                f"{what}; it died {len(deaths)} times within {window_s:g}s: giving up, "
                "so that the process supervisor restarts omni-cp"
            )
            logger.error("%s", message)
            raise ServeError(message)
        logger.error(
            "%s; restarting it empty on port %s (%d/%d deaths within %gs): its data is lost, "
            "instances re-register on their next heartbeat",
            what,
            embedded.port,
            len(deaths),
            limit,
            window_s,
        )
        try:
            await embedded.restart()
        except EmbeddedRedisError as exc:
            logger.error("embedded redis-server restart failed: %s", exc)


async def _main(
    settings: ControlPlaneSettings,
    redis_url: str,
    on_ready: Callable[[str], None] | None,
    embedded: EmbeddedRedis | None = None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    supervisor: asyncio.Task[None] | None = None
    if embedded is not None:
        supervisor = asyncio.create_task(
            supervise_embedded_redis(embedded, stop), name="omni-cp-redis-supervisor"
        )
        supervisor.add_done_callback(lambda _: stop.set())  # it gave up: shut down
    try:
        await run_app(settings, redis_url, stop, on_ready)
    finally:
        if supervisor is not None and not supervisor.done():
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
    if supervisor is not None and not supervisor.cancelled():
        error = supervisor.exception()
        if error is not None:
            raise error


def serve_forever(
    settings: ControlPlaneSettings, on_ready: Callable[[ServingInfo], None] | None = None
) -> None:
    """Blocking entry point of ``omni-cp serve``. Call from the main thread.

    Raises :class:`ServeError` when it cannot start; returns after a graceful shutdown.
    """
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    embedded: EmbeddedRedis | None = None
    try:
        redis_url = settings.redis_url_str
        if redis_url is None:
            embedded = EmbeddedRedis()
            redis_url = embedded.start()
        announced_redis = redis_url

        def ready(url: str) -> None:
            if on_ready is not None:
                on_ready(ServingInfo(url, announced_redis, embedded is not None))

        uvloop.run(_main(settings, redis_url, ready, embedded))
    except _Stop:
        logger.info("omni-cp stopped during start-up")
    finally:
        for signum in previous:  # cleanup is bounded; do not let a second signal cut it short
            signal.signal(signum, signal.SIG_IGN)
        if embedded is not None:
            embedded.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
