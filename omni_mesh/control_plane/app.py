"""The omni-cp aiohttp application: middlewares, routes and resources in ``cleanup_ctx``.

Resources come up in order (Redis client -> store -> change hub -> sweeper -> suspect
prober) and go down in reverse. Several apps may live in one process (tests): each has its
own metrics registry.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from omni_mesh.configs.settings import ControlPlaneSettings
from omni_mesh.control_plane.api import appkeys
from omni_mesh.control_plane.api import routes as api
from omni_mesh.control_plane.api.hub import ChangeHub
from omni_mesh.control_plane.api.middleware import (
    auth_middleware,
    error_middleware,
    metrics_middleware,
)
from omni_mesh.control_plane.liveness.suspects import SuspectChecker
from omni_mesh.control_plane.liveness.sweeper import Sweeper
from omni_mesh.control_plane.redis_conn import close_redis, connect_redis, refuse_cluster
from omni_mesh.control_plane.schema import MAX_BODY_BYTES
from omni_mesh.control_plane.store.instances import InstanceStore
from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.observability.metrics import ControlPlaneMetrics

logger = logging.getLogger(__name__)


async def _redis_ctx(app: web.Application) -> AsyncIterator[None]:
    redis = connect_redis(app[appkeys.REDIS_URL])
    settings = app[appkeys.SETTINGS]
    app[appkeys.STORE] = InstanceStore(
        redis,
        app[appkeys.KEYS],
        lease_ttl_ms=settings.lease_ttl_ms,
        evict_after_ms=settings.evict_after_ms,
    )
    try:
        await redis.ping()
        await refuse_cluster(redis)
    except RedisError as exc:
        logger.warning("redis not reachable at start-up (serving 503 until it is): %s", exc)
    except BaseException:
        await close_redis(redis)
        raise
    try:
        yield
    finally:
        await close_redis(redis)


async def _hub_ctx(app: web.Application) -> AsyncIterator[None]:
    hub = ChangeHub(app[appkeys.STORE].redis, app[appkeys.KEYS])
    app[appkeys.HUB] = hub
    hub.start()
    try:
        yield
    finally:
        await hub.stop()


async def _sweeper_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[appkeys.SETTINGS]
    sweeper = Sweeper(
        app[appkeys.STORE],
        app[appkeys.METRICS],
        interval_ms=settings.sweep_interval_ms,
        lock_ttl_ms=settings.sweeper_lock_ttl_ms,
    )
    app[appkeys.SWEEPER] = sweeper
    sweeper.start()
    try:
        yield
    finally:
        await sweeper.stop()


async def _suspects_ctx(app: web.Application) -> AsyncIterator[None]:
    checker = SuspectChecker(app[appkeys.STORE], app[appkeys.METRICS])
    app[appkeys.SUSPECTS] = checker
    try:
        yield
    finally:
        await checker.close()


async def _wake_watchers(app: web.Application) -> None:
    app[appkeys.HUB].begin_shutdown()


def create_app(
    settings: ControlPlaneSettings,
    redis_url: str,
    *,
    keys: KeySchema | None = None,
    registry: CollectorRegistry | None = None,
) -> web.Application:
    """Build the app; ``redis_url`` overrides ``settings.redis_url`` (embedded Redis)."""
    metrics = ControlPlaneMetrics(registry or CollectorRegistry())
    app = web.Application(
        middlewares=[
            metrics_middleware(metrics),
            error_middleware,
            auth_middleware(settings.token),
        ],
        client_max_size=MAX_BODY_BYTES,
    )
    app[appkeys.SETTINGS] = settings
    app[appkeys.REDIS_URL] = redis_url
    app[appkeys.KEYS] = keys or KeySchema()
    app[appkeys.METRICS] = metrics
    app.cleanup_ctx.extend([_redis_ctx, _hub_ctx, _sweeper_ctx, _suspects_ctx])
    app.on_shutdown.append(_wake_watchers)
    api.add_routes(app)
    return app
