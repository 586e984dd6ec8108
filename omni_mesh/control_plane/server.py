"""Running omni-cp: embedded Redis (when no URL is given), uvloop, AppRunner + TCPSite, signals.

Shutdown on SIGTERM or SIGINT: stop accepting, wake watchers, finish in-flight requests
(bounded), release the sweeper lock, close Redis connections, then stop the embedded Redis and
remove its directory.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvloop
from aiohttp import web

from omni_mesh.configs.settings import ControlPlaneSettings
from omni_mesh.control_plane.app import create_app
from omni_mesh.control_plane.embedded_redis import EmbeddedRedis

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0


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


async def _main(
    settings: ControlPlaneSettings,
    redis_url: str,
    on_ready: Callable[[str], None] | None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await run_app(settings, redis_url, stop, on_ready)


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

        uvloop.run(_main(settings, redis_url, ready))
    except _Stop:
        logger.info("omni-cp stopped during start-up")
    finally:
        for signum in previous:  # cleanup is bounded; do not let a second signal cut it short
            signal.signal(signum, signal.SIG_IGN)
        if embedded is not None:
            embedded.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
