"""A realtime session kept in the control plane's store, so that a client reconnecting to any
API server with its ``session_id`` continues the same conversation.

:class:`SessionPersister` mirrors one session: it creates (or has claimed) the stored session,
and writes what changed — the configuration, the items added or changed, the items deleted,
the order — in the background, coalesced, one write at a time, so the socket never waits on
the store. Every write carries the session's *epoch*: a socket that claims the session on
another API server bumps it, and the old socket's next write is refused (fenced): that socket
is told and closed. When the socket closes the session is released with a TTL
(``--realtime-session-ttl-s``). While a socket holds it, the API server renews all its
sessions in one call (:class:`SessionRenewer`).

A store that cannot be reached does not stop the session: writes are retried with back-off and
the conversation goes on in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from omni_mesh.control_plane.client import ControlPlaneRequestError
from omni_mesh.sidecar.api.realtime.config import SessionConfig, from_builtins, to_builtins
from omni_mesh.sidecar.api.realtime.conversation import Conversation, Item

if TYPE_CHECKING:
    from omni_mesh.sidecar.api.realtime.session import RealtimeSession

logger = logging.getLogger(__name__)

#: How often an API server renews the sessions its sockets hold (their TTL in the store is
#: several times this).
RENEW_EVERY_S = 30.0
_RETRY_MAX_S = 5.0


class Fenced(Exception):
    """The stored session's epoch moved on: another socket claimed it."""


@dataclass
class StoredSession:
    session_id: str
    pipeline: str
    epoch: int
    config: SessionConfig
    conversation: Conversation
    item_ids: list[str]  # every item the store holds, malformed ones (left out above) too


class SessionStore(Protocol):
    """The control plane's session routes, as a realtime API server uses them."""

    async def create(
        self, session_id: str, pipeline: str, owner: str, config: dict[str, Any]
    ) -> int: ...

    async def claim(self, session_id: str, owner: str) -> StoredSession | None: ...

    async def holder(self, session_id: str) -> str | None:
        """Who holds the session now: its owner, ``""`` once released, None if there is none."""
        ...

    async def patch(
        self,
        session_id: str,
        epoch: int,
        *,
        config: dict[str, Any] | None,
        put_items: dict[str, dict[str, Any]],
        delete_items: list[str],
        order: list[str] | None,
    ) -> None: ...

    async def release(self, session_id: str, epoch: int, ttl_ms: int) -> None: ...

    async def touch(self, owner: str, session_ids: list[str]) -> list[str]: ...


def item_builtins(item: Item) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(item)
    return out


def item_from_builtins(raw: Any) -> Item:
    return msgspec.convert(raw, Item)


def stored_session(
    session_id: str, pipeline: str, epoch: int, config: Any, items: list[tuple[str, Any]]
) -> StoredSession:
    """A claimed session from the store's (item id, JSON) pairs (a malformed item is dropped
    from the conversation, logged; the next write deletes it from the store too)."""
    kept: list[Item] = []
    for _, raw in items:
        try:
            kept.append(item_from_builtins(raw))
        except msgspec.ValidationError as exc:
            logger.warning("session %s: stored item dropped: %s", session_id, exc)
    conversation = Conversation(kept)
    ids = [item_id for item_id, _ in items]
    return StoredSession(session_id, pipeline, epoch, from_builtins(config), conversation, ids)


class SessionPersister:
    """One session's writes to the store (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        session: RealtimeSession,
        owner: str,
        *,
        epoch: int,
        ttl_s: float,
        on_fenced: Any,
    ) -> None:
        self.store, self.session, self.owner = store, session, owner
        self.epoch = epoch
        self.ttl_ms = int(ttl_s * 1000)
        self.on_fenced = on_fenced
        self.writes = 0
        self.failures = 0
        self.fenced = False
        self._config_dirty = False
        self._order_dirty = False
        self._items: set[str] = set()
        self._deleted: set[str] = set()
        #: The item ids the store holds (as far as this socket's writes know): an order sent
        #: to the store may name only those and the ones put with it (the store refuses an
        #: order naming an unknown item).
        self._stored: set[str] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._create = False
        self._task: asyncio.Task[None] | None = None

    def start(self, *, create: bool, stored_ids: list[str] | None = None) -> None:
        """Begin mirroring: ``create`` a new stored session, else one claimed with the items
        ``stored_ids`` (default: the conversation's)."""
        self._create = create
        if not create:  # claimed: what the store holds, as the claim listed it
            ids = self.session.conversation.ids() if stored_ids is None else stored_ids
            self._stored = set(ids)
        if create:
            self._wake.set()
        self._task = asyncio.create_task(self._run(), name=f"realtime-persist-{self.session.id}")

    def changed(self, *, items: list[str], deleted: list[str]) -> None:
        if self.fenced:
            return
        if not items and not deleted:
            self._config_dirty = True
        self._items.update(items)
        self._deleted.update(deleted)
        self._items.difference_update(deleted)
        self._order_dirty = True
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> bool:
        return (
            self._create
            or self._config_dirty
            or self._order_dirty
            or bool(self._items or self._deleted)
        )

    async def _run(self) -> None:
        delay = 0.05
        while not self.fenced:
            if not self.pending:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._write()
                delay = 0.05
            except Fenced:
                self.fenced = True
                logger.info("session %s: claimed by another socket (fenced)", self.session.id)
                self.on_fenced()
            except ControlPlaneRequestError as exc:  # refused (4xx): trying again won't help
                logger.error("session %s: the store refused a write (%s); the session goes "
                             "on unpersisted", self.session.id, exc)  # fmt: skip
                self.fenced = True
            except Exception as exc:  # the store is away: keep the changes, try again
                self.failures += 1
                logger.warning(
                    "session %s: store write failed (%s); retrying", self.session.id, exc
                )
                if self._closing and self.failures > 3:
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
        self._idle.set()

    async def _write(self) -> None:
        session = self.session
        if self._create:
            # what changes while the create is in flight is marked dirty again by changed()
            self._config_dirty = False
            config_now = to_builtins(session.config)
            self.epoch = await self.store.create(
                session.id, session.pod.pipeline.name, self.owner, config_now
            )
            self._create = False
            self._order_dirty = True
            self._items.update(session.conversation.ids())
        config = to_builtins(session.config) if self._config_dirty else None
        items = {
            i: item_builtins(item)
            for i in self._items
            if (item := session.conversation.find(i)) is not None
        }
        order = session.conversation.ids() if self._order_dirty else None
        removed = set(self._deleted)
        if order is not None:  # the order and the items agree whoever changed them
            self._complete(order, items, removed)
        deleted = sorted(removed)
        self._config_dirty, self._order_dirty = False, False
        self._items, self._deleted = set(), set()
        try:
            await self.store.patch(
                session.id,
                self.epoch,
                config=config,
                put_items=items,
                delete_items=deleted,
                order=order,
            )
        except BaseException:  # written again on the next try
            self._config_dirty = self._config_dirty or config is not None
            self._order_dirty = self._order_dirty or order is not None
            self._items.update(items)
            self._deleted.update(deleted)
            raise
        self._stored.update(items)
        self._stored.difference_update(deleted)
        self.writes += 1

    def _complete(
        self, order: list[str], items: dict[str, dict[str, Any]], removed: set[str]
    ) -> None:
        """Make a write that sends ``order`` name only items the store will hold: an item
        added without a change of its own (a response's item, as it begins) is put with it,
        and one that left without a deletion of its own (dropped from a full conversation)
        is deleted. The store refuses an order that disagrees with its items."""
        for item_id in order:
            if item_id not in self._stored and item_id not in items:
                item = self.session.conversation.find(item_id)
                if item is not None:
                    items[item_id] = item_builtins(item)
        removed.update(self._stored.difference(order))

    async def close(self) -> None:
        """The socket closed: what is pending is written (bounded), then the session is
        released with its TTL."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._idle.wait()), 3.0)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.fenced or self.epoch == 0:
            return
        try:
            await self.store.release(self.session.id, self.epoch, self.ttl_ms)
        except Fenced:
            pass
        except Exception as exc:
            logger.warning(
                "session %s: release failed (%s): it expires on its own", self.session.id, exc
            )


class SessionRenewer:
    """One call every :data:`RENEW_EVERY_S` renews every session this API server holds."""

    def __init__(self, store: SessionStore, owner: str, ids: Any, on_lost: Any) -> None:
        self.store, self.owner, self.ids = store, owner, ids
        self.on_lost = on_lost  # called with the ids another socket claimed (or that expired)
        self._task: asyncio.Task[None] | None = None
        self.lost: list[str] = []

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="realtime-renew")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            ids = list(self.ids())
            if not ids:
                continue
            try:
                self.lost = await self.store.touch(self.owner, ids)
                if self.lost:
                    self.on_lost(self.lost)
            except Exception as exc:
                logger.warning("renewing %d realtime session(s) failed: %s", len(ids), exc)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
