"""``GET /v1/watch?pipeline=P&since=V[&timeout_s=30]``: versioned snapshots of a pipeline's
healthy pools, as a long-poll or (with ``Accept: text/event-stream``) as server-sent events.

Long-poll: when the pipeline's version differs from ``since`` (or ``since`` is absent) the
current snapshot is returned at once, so a watcher that reconnects with an old version never
misses a change. Otherwise the request waits for a change and returns the new snapshot; when
``timeout_s`` passes first it returns **200 with the current, unchanged snapshot** (fresh load
figures, same version) rather than 204, so every answer has the same shape and doubles as a
resync.

SSE: one ``event: snapshot`` (``id`` = version, ``data`` = the snapshot JSON) per version change,
starting with the current one unless it equals ``since`` / ``Last-Event-ID``; a comment line
every 15 s keeps idle connections open. The stream ends when omni-cp shuts down or Redis fails
(the client reconnects with ``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from redis.exceptions import RedisError

from omni_mesh.configs.pipeline_spec import PipelineSpec
from omni_mesh.control_plane.api import appkeys
from omni_mesh.control_plane.api.inputs import float_param, int_param, lookup_pipeline
from omni_mesh.control_plane.errors import BadRequestError
from omni_mesh.control_plane.schema import PipelineSnapshot

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
RECHECK_S = 5.0  # re-read state at least this often, whatever the notifications say
SSE_KEEPALIVE_S = 15.0
_MAX_VERSION = 2**62


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    if timeout_s <= 0:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()


def _since(request: web.Request) -> int | None:
    raw = request.query.get("since") or request.headers.get("Last-Event-ID")
    if raw is None or raw == "":
        return None
    return int_param(raw, "since", low=-1, high=_MAX_VERSION)


async def watch(request: web.Request) -> web.StreamResponse:
    name = request.query.get("pipeline")
    if not name:
        raise BadRequestError("pipeline: query parameter required", field="pipeline")
    spec = lookup_pipeline(name)
    since = _since(request)
    max_timeout = request.app[appkeys.SETTINGS].watch_max_timeout_s
    timeout_s = float_param(
        request.query.get("timeout_s", str(DEFAULT_TIMEOUT_S)), "timeout_s", low=0, high=max_timeout
    )
    sse = "text/event-stream" in request.headers.get("Accept", "")
    mode = "sse" if sse else "longpoll"
    gauge = request.app[appkeys.METRICS].watchers.labels(mode)
    gauge.inc()
    try:
        if sse:
            return await _stream(request, spec, since)
        return await _long_poll(request, spec, since, timeout_s)
    finally:
        gauge.dec()


async def _long_poll(
    request: web.Request, spec: PipelineSpec, since: int | None, timeout_s: float
) -> web.Response:
    app = request.app
    hub, store = app[appkeys.HUB], app[appkeys.STORE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        event = hub.waiter(spec.name)  # before the read: a change after it sets this event
        snapshot = await store.snapshot(spec)
        remaining = deadline - loop.time()
        if snapshot.version != since or remaining <= 0 or hub.closing:
            return web.json_response(text=snapshot.model_dump_json())
        await _wait(event, min(remaining, RECHECK_S))


def _sse_event(snapshot: PipelineSnapshot) -> bytes:
    return (
        f"id: {snapshot.version}\nevent: snapshot\ndata: {snapshot.model_dump_json()}\n\n"
    ).encode()


async def _stream(
    request: web.Request, spec: PipelineSpec, since: int | None
) -> web.StreamResponse:
    app = request.app
    hub, store = app[appkeys.HUB], app[appkeys.STORE]
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await response.prepare(request)
    loop = asyncio.get_running_loop()
    last_sent, last_write = since, loop.time()
    try:
        while not hub.closing:
            event = hub.waiter(spec.name)
            snapshot = await store.snapshot(spec)
            if snapshot.version != last_sent:
                await response.write(_sse_event(snapshot))
                last_sent, last_write = snapshot.version, loop.time()
            elif loop.time() - last_write >= SSE_KEEPALIVE_S:
                await response.write(b": keepalive\n\n")
                last_write = loop.time()
            await _wait(event, min(RECHECK_S, SSE_KEEPALIVE_S))
    except ConnectionResetError:
        logger.debug("sse watcher of pipeline=%s went away", spec.name)
    except RedisError as exc:
        logger.warning("sse watch of pipeline=%s ends: redis unavailable: %s", spec.name, exc)
        with contextlib.suppress(ConnectionResetError):
            await response.write(b'event: error\ndata: {"message": "redis unavailable"}\n\n')
    return response
