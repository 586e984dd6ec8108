"""``SessionsClient``: the typed async client of the realtime-session routes, on top of a
:class:`ControlPlaneClient` (its URLs, failover, token and timeouts).

An API server creates a session at epoch 1 (or claims one a client resumes: epoch + 1), writes
it with the epoch it holds and touches every session it holds well within ``OWNED_TTL_MS``.
A write after another server claimed the session raises :class:`SessionFenced`: the caller has
lost it and must stop. An unknown (or expired) session raises :class:`SessionNotFound`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from pydantic import BaseModel, JsonValue, ValidationError

from omni_mesh.control_plane.client.http import ControlPlaneClient
from omni_mesh.control_plane.errors import (
    ControlPlaneError,
    ControlPlaneRequestError,
    SessionFenced,
    SessionNotFound,
)
from omni_mesh.control_plane.session_schema import (
    MAX_TOUCH_IDS,
    RELEASED_TTL_MS,
    SessionClaimRequest,
    SessionCountList,
    SessionCounts,
    SessionCreateRequest,
    SessionPatchRequest,
    SessionReleaseRequest,
    SessionState,
    SessionSummary,
    SessionTouchRequest,
    SessionTouchResult,
)

__all__ = ["SessionFenced", "SessionNotFound", "SessionsClient"]

M = TypeVar("M", bound=BaseModel)

FENCED_CODE = "session_fenced"


class SessionsClient:
    """One method per session route. Does not own ``client``: close that one yourself."""

    def __init__(self, client: ControlPlaneClient) -> None:
        self.client = client

    async def create(
        self,
        session_id: str,
        pipeline: str,
        owner: str,
        config: Mapping[str, JsonValue] | None = None,
    ) -> SessionSummary:
        """A new session at epoch 1 held by ``owner``; 409 ``ControlPlaneRequestError`` if the
        id exists."""
        req = SessionCreateRequest(
            session_id=session_id, pipeline=pipeline, owner=owner, config=dict(config or {})
        )
        return await self._send(SessionSummary, "POST", "/v1/sessions", req)

    async def claim(self, session_id: str, owner: str) -> SessionState:
        """Take the session over (epoch + 1): its config and items in order."""
        req = SessionClaimRequest(owner=owner)
        return await self._send(SessionState, "POST", f"/v1/sessions/{session_id}/claim", req)

    async def patch(
        self,
        session_id: str,
        epoch: int,
        *,
        config: Mapping[str, JsonValue] | None = None,
        put_items: Mapping[str, Mapping[str, JsonValue]] | None = None,
        delete_items: Iterable[str] = (),
        order: Sequence[str] | None = None,
    ) -> SessionSummary:
        """Write the session as the holder of ``epoch``: raises :class:`SessionFenced` when
        another owner claimed it since (or it was released)."""
        req = SessionPatchRequest(
            epoch=epoch,
            config=None if config is None else dict(config),
            put_items={k: dict(v) for k, v in (put_items or {}).items()},
            delete_items=list(delete_items),
            order=None if order is None else list(order),
        )
        return await self._send(SessionSummary, "PATCH", f"/v1/sessions/{session_id}", req)

    async def release(
        self, session_id: str, epoch: int, ttl_ms: int = RELEASED_TTL_MS
    ) -> SessionSummary:
        """Let the session go; it is kept ``ttl_ms`` for another API server to claim."""
        req = SessionReleaseRequest(epoch=epoch, ttl_ms=ttl_ms)
        path = f"/v1/sessions/{session_id}/release"
        return await self._send(SessionSummary, "POST", path, req)

    async def touch(self, owner: str, session_ids: Sequence[str]) -> SessionTouchResult:
        """Renew the TTL of ``owner``'s sessions; ``lost`` lists those it no longer holds
        (sent in batches of ``MAX_TOUCH_IDS``)."""
        renewed: list[str] = []
        lost: list[str] = []
        ids = list(session_ids)
        for start in range(0, len(ids), MAX_TOUCH_IDS):
            req = SessionTouchRequest(owner=owner, session_ids=ids[start : start + MAX_TOUCH_IDS])
            part = await self._send(SessionTouchResult, "POST", "/v1/sessions/touch", req)
            renewed += part.renewed
            lost += part.lost
        return SessionTouchResult(renewed=tuple(renewed), lost=tuple(lost))

    async def get(self, session_id: str) -> SessionState:
        return await self._send(SessionState, "GET", f"/v1/sessions/{session_id}")

    async def delete(self, session_id: str) -> None:
        await self._raw("DELETE", f"/v1/sessions/{session_id}")

    async def counts(self, pipeline: str | None = None) -> tuple[SessionCounts, ...]:
        """Owned and released sessions of ``pipeline`` (None: of every pipeline that has
        sessions)."""
        params = None if pipeline is None else {"pipeline": pipeline}
        raw = await self._raw("GET", "/v1/sessions", params=params)
        return _parse(SessionCountList, raw).pipelines

    # ---- transport -----------------------------------------------------------------------

    async def _send(
        self, model: type[M], method: str, path: str, body: BaseModel | None = None
    ) -> M:
        return _parse(model, await self._raw(method, path, body=body))

    async def _raw(
        self,
        method: str,
        path: str,
        *,
        body: BaseModel | None = None,
        params: Mapping[str, str] | None = None,
    ) -> bytes:
        try:
            return await self.client.request(method, path, body=body, params=params)
        except ControlPlaneRequestError as exc:
            raise _session_error(exc) from None


def _session_error(exc: ControlPlaneRequestError) -> ControlPlaneRequestError:
    kind: type[ControlPlaneRequestError] | None = None
    if exc.status == 404:
        kind = SessionNotFound
    elif exc.status == 409 and exc.code == FENCED_CODE:
        kind = SessionFenced
    if kind is None or isinstance(exc, kind):
        return exc
    return kind(exc.status, exc.message, field=exc.field, stage=exc.stage, code=exc.code)


def _parse(model: type[M], payload: bytes) -> M:
    try:
        return model.model_validate_json(payload)
    except ValidationError as exc:
        raise ControlPlaneError(f"unexpected answer from the control plane: {exc}") from exc
