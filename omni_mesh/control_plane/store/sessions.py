"""Redis state of realtime sessions: ``omni:session:{id}`` hashes and ``omni:sessions:{pipeline}``
zsets (``keys.py``), every write one Lua script (``session_scripts.py``).

An owned session lives ``OWNED_TTL_MS`` past its last write or touch: an API server that dies
stops touching and its sessions expire unless another claims them. A released one lives for the
release's TTL. Every claim bumps the epoch; writes carrying another epoch are refused
(:class:`SessionFencedOut`), so an old owner that lost its session cannot overwrite it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import JsonValue
from redis.asyncio import Redis

from omni_mesh.control_plane.session_schema import (
    MAX_SESSION_BYTES,
    MAX_SESSION_ITEMS,
    OWNED_TTL_MS,
    RELEASED_TTL_MS,
    SessionCounts,
    SessionItem,
    SessionState,
    SessionSummary,
    SessionTouchResult,
)
from omni_mesh.control_plane.store import session_scripts as scripts
from omni_mesh.control_plane.store.keys import SESSION_ITEM_PREFIX, KeySchema

logger = logging.getLogger(__name__)


# ---- refusals (the routes turn them into 4xx answers) -------------------------------------------


class SessionRefused(Exception):
    """Base of the store's refusals."""


class SessionMissing(SessionRefused):
    pass


class SessionExists(SessionRefused):
    pass


class SessionFencedOut(SessionRefused):
    """The caller's epoch is not the session's (it was claimed since), or it is released."""

    def __init__(self, epoch: int, owner: str) -> None:
        super().__init__(f"session is at epoch {epoch}, owner {owner or '(released)'}")
        self.epoch, self.owner = epoch, owner


class SessionTooLarge(SessionRefused):
    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


class SessionTooManyItems(SessionRefused):
    def __init__(self, count: int) -> None:
        super().__init__(f"{count} items")
        self.count = count


class SessionBadOrder(SessionRefused):
    def __init__(self, item_id: str, why: str) -> None:
        super().__init__(f"{item_id}: {why}")
        self.item_id, self.why = item_id, why


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _dump(value: JsonValue) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _refusal(res: Sequence[Any]) -> SessionRefused:
    kind = _text(res[0])
    if kind == "missing":
        return SessionMissing()
    if kind == "exists":
        return SessionExists()
    if kind == "fenced":
        return SessionFencedOut(int(res[1]), _text(res[2]))
    if kind == "too_large":
        return SessionTooLarge(int(res[1]))
    if kind == "too_many":
        return SessionTooManyItems(int(res[1]))
    if kind == "bad_order":
        return SessionBadOrder(_text(res[1]), _text(res[2]))
    raise RuntimeError(f"unexpected session script answer {kind!r}")


def _summary(session_id: str, res: Sequence[Any]) -> SessionSummary:
    if _text(res[0]) != "ok":
        raise _refusal(res)
    return SessionSummary(
        session_id=session_id,
        pipeline=_text(res[1]),
        owner=_text(res[2]),
        epoch=int(res[3]),
        item_count=int(res[4]),
        size_bytes=int(res[5]),
        updated_ms=int(res[6]),
        ttl_ms=int(res[7]),
    )


def _state(
    summary: SessionSummary, config: Any, order: list[str], raw_items: Sequence[Any]
) -> SessionState:
    items = tuple(
        SessionItem(id=item_id, item=json.loads(raw))
        for item_id, raw in zip(order, raw_items, strict=True)
    )
    return SessionState(**summary.model_dump(), config=json.loads(config), items=items)


class SessionStore:
    """Reads and writes of the ``omni:session:*`` and ``omni:sessions:*`` keys."""

    def __init__(
        self,
        redis: Redis,
        keys: KeySchema,
        *,
        owned_ttl_ms: int = OWNED_TTL_MS,
        max_bytes: int = MAX_SESSION_BYTES,
        max_items: int = MAX_SESSION_ITEMS,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.owned_ttl_ms = owned_ttl_ms
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._create = redis.register_script(scripts.CREATE)
        self._claim = redis.register_script(scripts.CLAIM)
        self._patch = redis.register_script(scripts.PATCH)
        self._release = redis.register_script(scripts.RELEASE)
        self._touch = redis.register_script(scripts.TOUCH)
        self._delete = redis.register_script(scripts.DELETE)
        self._count = redis.register_script(scripts.COUNT)

    async def create(
        self, session_id: str, pipeline: str, owner: str, config: Mapping[str, JsonValue]
    ) -> SessionSummary:
        """A new session at epoch 1; :class:`SessionExists` if the id is taken."""
        k = self.keys
        res = await self._create(
            keys=[k.session(session_id), k.sessions(pipeline)],
            args=[
                session_id,
                pipeline,
                owner,
                _dump(dict(config)),
                self.owned_ttl_ms,
                RELEASED_TTL_MS,
                self.max_bytes,
            ],
        )
        return _summary(session_id, res)

    async def claim(self, session_id: str, owner: str) -> SessionState:
        """``owner`` takes the session (epoch + 1): the whole session, items in order."""
        k = self.keys
        res = await self._claim(
            keys=[k.session(session_id)],
            args=[session_id, owner, self.owned_ttl_ms, k.sessions_prefix],
        )
        summary = _summary(session_id, res)
        order = json.loads(_text(res[9]))
        return _state(summary, _text(res[8]), order, res[10:])

    async def patch(
        self,
        session_id: str,
        epoch: int,
        *,
        config: Mapping[str, JsonValue] | None = None,
        put_items: Mapping[str, Mapping[str, JsonValue]] | None = None,
        delete_items: Sequence[str] = (),
        order: Sequence[str] | None = None,
    ) -> SessionSummary:
        """Apply the owner's changes at once; :class:`SessionFencedOut` unless ``epoch`` is
        the session's and it is owned."""
        k = self.keys
        puts = list((put_items or {}).items())
        args: list[str | int] = [
            session_id,
            str(epoch),
            self.owned_ttl_ms,
            k.sessions_prefix,
            self.max_bytes,
            self.max_items,
            "0" if config is None else "1",
            "" if config is None else _dump(dict(config)),
            "0" if order is None else "1",
            "" if order is None else _dump(list(order)),
            len(puts),
        ]
        for item_id, item in puts:
            args += [item_id, _dump(dict(item))]
        args += list(delete_items)
        res = await self._patch(keys=[k.session(session_id)], args=args)
        return _summary(session_id, res)

    async def release(
        self, session_id: str, epoch: int, ttl_ms: int = RELEASED_TTL_MS
    ) -> SessionSummary:
        """No owner any more; kept ``ttl_ms`` for another API server to claim."""
        k = self.keys
        res = await self._release(
            keys=[k.session(session_id)], args=[session_id, str(epoch), ttl_ms, k.sessions_prefix]
        )
        return _summary(session_id, res)

    async def touch(self, owner: str, session_ids: Sequence[str]) -> SessionTouchResult:
        """Renew the sessions ``owner`` still holds; the others come back as ``lost``."""
        if not session_ids:
            return SessionTouchResult()
        k = self.keys
        renewed, lost = await self._touch(
            keys=[k.session(s) for s in session_ids],
            args=[owner, self.owned_ttl_ms, k.sessions_prefix, *session_ids],
        )
        return SessionTouchResult(
            renewed=tuple(_text(s) for s in renewed), lost=tuple(_text(s) for s in lost)
        )

    async def get(self, session_id: str) -> SessionState | None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys.session(session_id))
            pipe.pttl(self.keys.session(session_id))
            raw, ttl = await pipe.execute()
        fields = {_text(f): _text(v) for f, v in raw.items()}
        if "pipeline" not in fields:
            return None
        order: list[str] = json.loads(fields.get("order", "[]"))
        summary = SessionSummary(
            session_id=session_id,
            pipeline=fields["pipeline"],
            owner=fields.get("owner", ""),
            epoch=int(fields.get("epoch", "0")),
            item_count=len(order),
            size_bytes=int(fields.get("size", "0")),
            updated_ms=int(fields.get("updated_ms", "0")),
            ttl_ms=max(int(ttl), 0),
        )
        items = [fields.get(f"{SESSION_ITEM_PREFIX}{i}", "null") for i in order]
        return _state(summary, fields.get("config", "{}"), order, items)

    async def delete(self, session_id: str) -> bool:
        """Forget the session. True if it existed."""
        k = self.keys
        res = await self._delete(keys=[k.session(session_id)], args=[session_id, k.sessions_prefix])
        return bool(int(res))

    async def counts(self, pipeline: str) -> SessionCounts:
        """Owned and released sessions of the pipeline (expired entries are pruned)."""
        k = self.keys
        owned, released = await self._count(keys=[k.sessions(pipeline)], args=[k.session_prefix])
        return SessionCounts(pipeline=pipeline, owned=int(owned), released=int(released))
