"""The control plane's session routes (:class:`SessionsClient`) as the :class:`SessionStore` a
realtime API server writes its sessions to."""

from __future__ import annotations

from typing import Any

from omni_mesh.control_plane.client import SessionFenced, SessionNotFound
from omni_mesh.control_plane.client.http import ControlPlaneClient
from omni_mesh.control_plane.client.sessions import SessionsClient
from omni_mesh.sidecar.api.realtime.persist import Fenced, StoredSession, stored_session


class ControlPlaneSessionStore:
    """Realtime sessions in omni-cp's Redis (see :mod:`.persist`)."""

    def __init__(self, client: ControlPlaneClient) -> None:
        self.sessions = SessionsClient(client)

    async def create(
        self, session_id: str, pipeline: str, owner: str, config: dict[str, Any]
    ) -> int:
        return (await self.sessions.create(session_id, pipeline, owner, config)).epoch

    async def claim(self, session_id: str, owner: str) -> StoredSession | None:
        try:
            state = await self.sessions.claim(session_id, owner)
        except SessionNotFound:
            return None
        items = [(i.id, i.item) for i in state.items]
        return stored_session(session_id, state.pipeline, state.epoch, state.config, items)

    async def holder(self, session_id: str) -> str | None:
        try:
            return (await self.sessions.get(session_id)).owner
        except SessionNotFound:
            return None

    async def patch(
        self,
        session_id: str,
        epoch: int,
        *,
        config: dict[str, Any] | None,
        put_items: dict[str, dict[str, Any]],
        delete_items: list[str],
        order: list[str] | None,
    ) -> None:
        try:
            await self.sessions.patch(
                session_id,
                epoch,
                config=config,
                put_items=put_items,
                delete_items=delete_items,
                order=order,
            )
        except (SessionFenced, SessionNotFound) as exc:
            raise Fenced(str(exc)) from exc

    async def release(self, session_id: str, epoch: int, ttl_ms: int) -> None:
        try:
            await self.sessions.release(session_id, epoch, ttl_ms)
        except (SessionFenced, SessionNotFound) as exc:
            raise Fenced(str(exc)) from exc

    async def touch(self, owner: str, session_ids: list[str]) -> list[str]:
        return list((await self.sessions.touch(owner, session_ids)).lost)
