"""``GET /v1/realtime?model=…[&session_id=…]``: the OpenAI Realtime API (GA) over a WebSocket.

Refusals come before the upgrade, as plain HTTP errors in the API's JSON shape: an unknown
``model`` (404), realtime switched off (``--realtime-max-sessions 0``: 404), this API server at
its session limit (503 with Retry-After: a load balancer tries another one), an unknown or
expired ``session_id`` (404). After the upgrade every problem is an ``error`` event.

A ``session_id`` names a session kept by the control plane (:mod:`.persist`): the new socket
claims it, which fences the socket that held it before (on this API server or another), and
the conversation goes on where it was. A socket that has just closed is given up to
:data:`HANDOVER_WAIT_S` to write its last changes and release the session first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

from aiohttp import WSMsgType, web

from omni_mesh.sidecar.api.realtime.client_events import MAX_EVENT_BYTES, SESSION_ID, EventError
from omni_mesh.sidecar.api.realtime.config import default_config
from omni_mesh.sidecar.api.realtime.conversation import new_id
from omni_mesh.sidecar.api.realtime.persist import (
    SessionPersister,
    SessionRenewer,
    SessionStore,
    StoredSession,
)
from omni_mesh.sidecar.api.realtime.response import ResponseRun
from omni_mesh.sidecar.api.realtime.sender import EventSender
from omni_mesh.sidecar.api.realtime.session import RealtimeSession, SessionHooks
from omni_mesh.sidecar.appkeys import POD
from omni_mesh.sidecar.errors import ApiError
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
STATES = ("idle", "speaking", "responding")
#: Ping interval: a client that stops answering pings is disconnected (its session kept).
HEARTBEAT_S = 30.0
#: How long a resume waits for the socket that held the session to release it (_handover).
HANDOVER_WAIT_S = 2.0
HANDOVER_POLL_S = 0.05


class RealtimeHub(SessionHooks):
    """The realtime sessions of one API server: the limit, the metrics, the store."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self.sessions: set[RealtimeSession] = set()
        self.persisters: dict[str, SessionPersister] = {}
        self.store: SessionStore | None = None  # set when a control plane is configured
        self.renewer: SessionRenewer | None = None
        labels = pod.pipeline.name
        for state in STATES:
            gauge = pod.metrics.realtime_sessions.labels(labels, state)
            gauge.set_function(lambda s=state: float(self.count(s)))  # type: ignore[misc]

    def count(self, state: str | None = None) -> int:
        if state is None:
            return len(self.sessions)
        return sum(1 for s in self.sessions if s.state == state)

    # SessionHooks
    def changed(self, session: RealtimeSession, *, items: list[str], deleted: list[str]) -> None:
        persister = self.persisters.get(session.id)
        if persister is not None:
            persister.changed(items=items, deleted=deleted)

    def response_done(self, session: RealtimeSession, run: ResponseRun) -> None:
        name = self.pod.pipeline.name
        self.pod.metrics.realtime_responses.labels(name, run.status).inc()
        if run.stats.first_audio_s is not None:
            self.pod.metrics.realtime_first_audio.labels(name).observe(run.stats.first_audio_s)
        self.pod.metrics.audio.record(run.playback, name, REALTIME_PATH, run.tenant)

    @property
    def owner(self) -> str:
        """Who holds this server's sessions in the store: its address, which stays the same
        across re-registrations (an instance id would change and fence every session)."""
        return re.sub(r"[^A-Za-z0-9_\-.:]", "_", self.pod.settings.address)

    def attach_store(self, store: SessionStore) -> None:
        self.store = store
        self.renewer = SessionRenewer(
            store, self.owner, lambda: [s.id for s in self.sessions], self._lost
        )
        self.renewer.start()

    def _lost(self, session_ids: list[str]) -> None:
        """Sessions the store says this server no longer holds (claimed elsewhere)."""
        for session in list(self.sessions):
            if session.id in session_ids:
                _fenced(session.sender)

    async def close(self) -> None:
        """Shutdown: every socket closes with 1001 (going away); sessions stay in the store,
        released, for the client to resume elsewhere."""
        for session in list(self.sessions):
            with contextlib.suppress(Exception):
                await session.sender.ws.close(code=1001, message=b"server shutting down")
        if self.renewer is not None:
            await self.renewer.close()


REALTIME: web.AppKey[RealtimeHub] = web.AppKey("realtime", RealtimeHub)


def _refuse(status: int, message: str, type_: str, **headers: str) -> ApiError:
    return ApiError(status, message, type_=type_, headers=headers or None)


async def _handover(hub: RealtimeHub, store: SessionStore, session_id: str, owner: str) -> None:
    """Give the socket that held ``session_id`` up to :data:`HANDOVER_WAIT_S` to let it go:
    a client that closed it and reconnected at once may be faster than that socket's server,
    which writes the session's last changes (the answer that just ended) before it releases
    it. A server that died never releases: the session is taken when the wait is over (and a
    socket still open on it is fenced), so a resume waits at most that long."""
    deadline = time.monotonic() + HANDOVER_WAIT_S
    while time.monotonic() < deadline:
        if session_id in hub.persisters:  # held here: its socket's close is under way
            await asyncio.sleep(HANDOVER_POLL_S)
            continue
        try:
            holder = await store.holder(session_id)
        except Exception as exc:  # the claim that follows says what is wrong
            logger.warning("session %s: its holder is unknown (%s)", session_id, exc)
            return
        if not holder or holder == owner:
            return
        await asyncio.sleep(HANDOVER_POLL_S)
    logger.info("session %s: taken from its holder after %.1f s", session_id, HANDOVER_WAIT_S)


async def _resume(hub: RealtimeHub, session_id: str, owner: str) -> StoredSession:
    if hub.store is None:
        raise _refuse(
            404, f"session_id: {session_id!r}: sessions need a control plane", "not_found"
        )
    await _handover(hub, hub.store, session_id, owner)
    stored = await hub.store.claim(session_id, owner)
    if stored is None:
        raise _refuse(404, f"session_id: no session {session_id!r} (expired?)", "not_found")
    if stored.pipeline != hub.pod.pipeline.name:
        raise _refuse(
            404,
            f"session_id: session {session_id!r} is of pipeline {stored.pipeline!r}",
            "not_found",
        )
    return stored


async def realtime(request: web.Request) -> web.StreamResponse:
    pod = request.app[POD]
    hub = request.app[REALTIME]
    settings = pod.settings
    model = request.query.get("model")
    if model is not None and model != pod.pipeline.name:
        raise _refuse(
            404, f"model: {model!r} is not served here ({pod.pipeline.name!r})", "model_not_found"
        )
    if settings.realtime_max_sessions == 0:
        raise _refuse(404, "realtime sessions are switched off on this server", "not_found")
    if pod.draining:
        raise _refuse(503, "this API server is draining", "unavailable", **{"Retry-After": "1"})
    if hub.count() >= settings.realtime_max_sessions:
        raise _refuse(
            503,
            f"this API server holds its limit of {settings.realtime_max_sessions} realtime "
            "sessions; try again or another server",
            "server_busy",
            **{"Retry-After": "1"},
        )
    session_id = request.query.get("session_id")
    if session_id is not None and not SESSION_ID.match(session_id):
        raise ApiError(400, "session_id: 1-128 of A-Z a-z 0-9 _ - . :", param="session_id")
    owner = hub.owner
    stored = await _resume(hub, session_id, owner) if session_id else None
    ws = web.WebSocketResponse(
        max_msg_size=MAX_EVENT_BYTES + 4096, heartbeat=HEARTBEAT_S, compress=False
    )
    await ws.prepare(request)
    transport = request.transport
    sender = EventSender(
        ws,
        settings.realtime_send_queue_bytes,
        abort=transport.abort if transport is not None else None,
    )
    sender.start()
    if stored is not None:
        session = RealtimeSession(
            pod, request, sender, stored.session_id, stored.config, stored.conversation, hub
        )
    else:
        session = RealtimeSession(
            pod, request, sender, new_id("sess"), default_config(pod.pipeline), None, hub
        )
    persister = None
    if hub.store is not None:
        persister = SessionPersister(
            hub.store,
            session,
            owner,
            epoch=stored.epoch if stored else 0,
            ttl_s=settings.realtime_session_ttl_s,
            on_fenced=lambda: _fenced(sender),
        )
        hub.persisters[session.id] = persister
        persister.start(
            create=stored is None, stored_ids=stored.item_ids if stored is not None else None
        )
    hub.sessions.add(session)
    try:
        session.start(resumed=stored is not None)
        await _read(ws, session)
    finally:
        hub.sessions.discard(session)
        await session.close()
        if persister is not None:
            await persister.close()  # still listed meanwhile: a resume here waits for it
            if hub.persisters.get(session.id) is persister:  # not a newer socket's
                del hub.persisters[session.id]
        await sender.flush(timeout_s=0.5)
        await sender.close()
        if not ws.closed:
            with contextlib.suppress(Exception):
                await ws.close()
    return ws


def _fenced(sender: EventSender) -> None:
    """Another socket claimed this session: tell this one and close it."""
    sender.send(
        {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "code": "session_taken",
                "message": "another connection resumed this session",
                "param": None,
                "event_id": None,
            },
        }
    )
    asyncio.get_running_loop().create_task(sender.ws.close(code=4000, message=b"session taken"))


async def _read(ws: web.WebSocketResponse, session: RealtimeSession) -> None:
    async for msg in ws:
        if session.sender.closed:
            break
        if msg.type is WSMsgType.TEXT:
            await session.handle(msg.data)
        elif msg.type is WSMsgType.BINARY:
            session.error(
                EventError(
                    "binary messages are not served: send JSON events as text",
                    code="invalid_message",
                )
            )
        elif msg.type is WSMsgType.ERROR:
            logger.info("realtime socket of session %s failed: %s", session.id, ws.exception())
            break


async def _shutdown(app: web.Application) -> None:
    await app[REALTIME].close()


def add_routes(app: web.Application) -> None:
    app[REALTIME] = RealtimeHub(app[POD])
    app.on_shutdown.append(_shutdown)
    app.router.add_get(REALTIME_PATH, realtime)
