"""HTTP handlers of realtime sessions (control-plane state an API server may lose and another
resume), served by every omni-cp:

    POST   /v1/sessions                  create (SessionCreateRequest) -> 201 SessionSummary
    POST   /v1/sessions/{id}/claim       take it over, epoch + 1 -> SessionState (items in order)
    PATCH  /v1/sessions/{id}             the owner's changes (SessionPatchRequest) -> summary
    POST   /v1/sessions/{id}/release     no owner, kept ttl_ms -> summary
    POST   /v1/sessions/touch            renew an owner's sessions -> SessionTouchResult
    GET    /v1/sessions/{id}             the whole session -> SessionState
    DELETE /v1/sessions/{id}             forget it -> 204
    GET    /v1/sessions[?pipeline=p]     owned / released counts -> SessionCountList

A write with a stale epoch is a 409 with code ``session_fenced``; an unknown session a 404.
"""

from __future__ import annotations

import logging
import re

from aiohttp import web
from pydantic import BaseModel

from omni_mesh.configs.registry import list_pipelines
from omni_mesh.control_plane.api import appkeys
from omni_mesh.control_plane.api.inputs import lookup_pipeline, read_model
from omni_mesh.control_plane.errors import (
    ApiError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    SessionFencedError,
)
from omni_mesh.control_plane.session_schema import (
    MAX_SESSION_BODY_BYTES,
    MAX_SESSION_BYTES,
    MAX_SESSION_ITEMS,
    MAX_TOUCH_BODY_BYTES,
    SessionClaimRequest,
    SessionCountList,
    SessionCounts,
    SessionCreateRequest,
    SessionPatchRequest,
    SessionReleaseRequest,
    SessionTouchRequest,
)
from omni_mesh.control_plane.store.sessions import (
    SessionBadOrder,
    SessionExists,
    SessionFencedOut,
    SessionMissing,
    SessionRefused,
    SessionStore,
    SessionTooLarge,
    SessionTooManyItems,
)

logger = logging.getLogger(__name__)

SESSIONS_PATH = "/v1/sessions"
SESSION_PATH = SESSIONS_PATH + "/{id}"

_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.:]{1,128}$")


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _store(request: web.Request) -> SessionStore:
    return request.app[appkeys.STORE].sessions


def _session_id(request: web.Request) -> str:
    session_id = request.match_info["id"]
    if not _SESSION_ID.fullmatch(session_id):
        raise NotFoundError(f"unknown session {session_id[:80]!r}", field="session_id")
    return session_id


def _refused(session_id: str, exc: SessionRefused, epoch: int | None = None) -> ApiError:
    """The 4xx answer for one of the store's refusals."""
    if isinstance(exc, SessionMissing):
        return NotFoundError(f"unknown session {session_id!r}", field="session_id")
    if isinstance(exc, SessionExists):
        err = ConflictError(f"session {session_id!r} already exists", field="session_id")
        err.code = "session_exists"
        return err
    if isinstance(exc, SessionFencedOut):
        held = f"held by {exc.owner!r}" if exc.owner else "released (claim it first)"
        return SessionFencedError(
            f"session {session_id!r} is at epoch {exc.epoch}, {held}; "
            f"this write carries epoch {epoch}",
            field="epoch",
        )
    if isinstance(exc, SessionTooLarge):
        return PayloadTooLargeError(
            f"session {session_id!r} would hold {exc.size} bytes; the limit is {MAX_SESSION_BYTES}",
            field="put_items",
        )
    if isinstance(exc, SessionTooManyItems):
        return PayloadTooLargeError(
            f"session {session_id!r} would hold {exc.count} items; the limit is "
            f"{MAX_SESSION_ITEMS}",
            field="put_items",
        )
    if isinstance(exc, SessionBadOrder):
        what = "is not an item of the session" if exc.why == "unknown" else "is missing"
        return BadRequestError(
            f"order: item {exc.item_id!r} {what} (order lists every item once)", field="order"
        )
    raise exc


async def create(request: web.Request) -> web.Response:
    body = await read_model(request, SessionCreateRequest, max_bytes=MAX_SESSION_BODY_BYTES)
    lookup_pipeline(body.pipeline)
    try:
        summary = await _store(request).create(
            body.session_id, body.pipeline, body.owner, body.config
        )
    except SessionRefused as exc:
        raise _refused(body.session_id, exc) from None
    logger.info(
        "session created session=%s pipeline=%s owner=%s",
        body.session_id,
        body.pipeline,
        body.owner or "-",
    )
    return _json(summary, status=201)


async def claim(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    body = await read_model(request, SessionClaimRequest)
    try:
        state = await _store(request).claim(session_id, body.owner)
    except SessionRefused as exc:
        raise _refused(session_id, exc) from None
    logger.info(
        "session claimed session=%s pipeline=%s owner=%s epoch=%d items=%d",
        session_id,
        state.pipeline,
        body.owner,
        state.epoch,
        state.item_count,
    )
    return _json(state)


async def patch(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    body = await read_model(request, SessionPatchRequest, max_bytes=MAX_SESSION_BODY_BYTES)
    try:
        summary = await _store(request).patch(
            session_id,
            body.epoch,
            config=body.config,
            put_items=body.put_items,
            delete_items=body.delete_items,
            order=body.order,
        )
    except SessionRefused as exc:
        raise _refused(session_id, exc, body.epoch) from None
    return _json(summary)


async def release(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    body = await read_model(request, SessionReleaseRequest)
    try:
        summary = await _store(request).release(session_id, body.epoch, body.ttl_ms)
    except SessionRefused as exc:
        raise _refused(session_id, exc, body.epoch) from None
    logger.info(
        "session released session=%s pipeline=%s epoch=%d ttl_ms=%d",
        session_id,
        summary.pipeline,
        summary.epoch,
        body.ttl_ms,
    )
    return _json(summary)


async def touch(request: web.Request) -> web.Response:
    body = await read_model(request, SessionTouchRequest, max_bytes=MAX_TOUCH_BODY_BYTES)
    result = await _store(request).touch(body.owner, body.session_ids)
    if result.lost:
        logger.info(
            "session touch owner=%s lost=%d sessions (first %s)",
            body.owner,
            len(result.lost),
            result.lost[0],
        )
    return _json(result)


async def get_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    state = await _store(request).get(session_id)
    if state is None:
        raise _refused(session_id, SessionMissing())
    return _json(state)


async def delete_session(request: web.Request) -> web.Response:
    session_id = _session_id(request)
    if not await _store(request).delete(session_id):
        raise _refused(session_id, SessionMissing())
    logger.info("session deleted session=%s", session_id)
    return web.Response(status=204)


async def session_counts(store: SessionStore, pipeline: str | None = None) -> list[SessionCounts]:
    """Counts of ``pipeline``, or of every registered pipeline that has sessions."""
    if pipeline is not None:
        return [await store.counts(pipeline)]
    every = [await store.counts(name) for name in list_pipelines()]
    return [c for c in every if c.owned or c.released]


async def counts(request: web.Request) -> web.Response:
    raw = request.query.get("pipeline")
    pipeline = None if raw is None else lookup_pipeline(raw).name
    listing = await session_counts(_store(request), pipeline)
    return _json(SessionCountList(pipelines=tuple(listing)))


async def refresh_gauge(app: web.Application) -> None:
    """``omni_cp_sessions{pipeline,state}`` from Redis (on scrape)."""
    listing = [await app[appkeys.STORE].sessions.counts(name) for name in list_pipelines()]
    gauge = app[appkeys.METRICS].sessions
    gauge.clear()
    for c in listing:
        gauge.labels(c.pipeline, "owned").set(c.owned)
        gauge.labels(c.pipeline, "released").set(c.released)


def add_routes(app: web.Application) -> None:
    app.router.add_post(SESSIONS_PATH, create)
    app.router.add_get(SESSIONS_PATH, counts)
    app.router.add_post(SESSIONS_PATH + "/touch", touch)
    app.router.add_post(SESSION_PATH + "/claim", claim)
    app.router.add_post(SESSION_PATH + "/release", release)
    app.router.add_patch(SESSION_PATH, patch)
    app.router.add_get(SESSION_PATH, get_session)
    app.router.add_delete(SESSION_PATH, delete_session)
