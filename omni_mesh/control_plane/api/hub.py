"""Change notifications: one Redis pub/sub subscription per omni-cp, fanned out to watchers.

Notifications are hints (DESIGN invariant 6): a watcher grabs :meth:`ChangeHub.waiter` *before*
it reads the snapshot, then waits on it, so a change between the read and the wait is never
missed; and it re-reads the state at least every few seconds whatever the hub says. When the
subscription breaks (Redis restarted), the hub wakes every watcher once it is back so they
compare versions again.
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omni_mesh.control_plane.store.keys import KeySchema
from omni_mesh.control_plane.tasks import stop_task

logger = logging.getLogger(__name__)

_RECONNECT_MAX_S = 2.0


class ChangeHub:
    """Wakes the watchers of a pipeline whenever its version changes."""

    def __init__(self, redis: Redis, keys: KeySchema) -> None:
        self._redis = redis
        self._keys = keys
        self._events: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.closing = False
        self.connected = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._listen(), name="omni-cp-change-hub")

    def begin_shutdown(self) -> None:
        """Wake every watcher; they answer with what they have and return."""
        self.closing = True
        self.notify_all()

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._task is not None:
            await stop_task(self._task, grace_s=0.0)
            self._task = None

    def waiter(self, pipeline: str) -> asyncio.Event:
        """The event the next change of ``pipeline`` sets. Take it before reading state."""
        event = self._events.get(pipeline)
        if event is None:
            event = self._events[pipeline] = asyncio.Event()
        return event

    def notify(self, pipeline: str) -> None:
        event = self._events.pop(pipeline, None)
        if event is not None:
            event.set()

    def notify_all(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def _listen(self) -> None:
        delay = 0.05
        while not self.closing:
            try:
                await self._subscribe_and_dispatch()
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if self.connected:
                    logger.warning("change subscription lost (%s); reconnecting", exc)
            except RedisError:
                logger.exception("change subscription failed; reconnecting")
            delay = 0.05 if self.connected else min(delay * 2, _RECONNECT_MAX_S)
            self.connected = False
            await asyncio.sleep(delay)

    async def _subscribe_and_dispatch(self) -> None:
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.psubscribe(self._keys.channel_pattern)
            self.connected = True
            logger.debug("subscribed to %s", self._keys.channel_pattern)
            self.notify_all()  # anything may have changed while we were not listening
            while not self.closing:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is None:
                    continue
                channel = message["channel"]
                if isinstance(channel, bytes):
                    channel = channel.decode()
                pipeline = self._keys.pipeline_of_channel(str(channel))
                if pipeline is not None:
                    self.notify(pipeline)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # redis-py leaves it untyped
