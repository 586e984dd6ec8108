"""Server events to one realtime socket through a queue bounded in bytes.

Sending never blocks the session: :meth:`EventSender.send` queues the encoded event and one
writer task hands the queue to the socket. A client that reads slower than the session talks
lets the queue fill; past ``max_bytes`` it is told by an ``error`` event (``code:
slow_consumer``) and disconnected (close code 1008), so a slow reader never grows the server's
memory. Audio deltas are tagged with their response: a barge-in drops the ones not yet written
(:meth:`discard`), so the user stops hearing the answer as soon as the socket allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import WSCloseCode, web

logger = logging.getLogger(__name__)

_ENCODER = msgspec.json.Encoder()
#: How long the last words to a slow reader may take before the socket is closed anyway.
CLOSE_GRACE_S = 2.0


def event_id() -> str:
    return f"event_{secrets.token_hex(10)}"


@dataclass
class _Queued:
    data: bytes
    response_id: str | None  # audio deltas: the response they belong to
    audio_ms: float


class EventSender:
    """One socket's outgoing events (see the module docstring)."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        max_bytes: int,
        abort: Callable[[], None] | None = None,
    ) -> None:
        self.ws = ws
        self.abort = abort  # cuts the connection when even the last words cannot be written
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.overflowed = False
        self._queue: deque[_Queued] = deque()
        self._wake = asyncio.Event()
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._write(), name="realtime-sender")

    @property
    def closed(self) -> bool:
        return self._closed

    def send(
        self, event: dict[str, Any], *, response_id: str | None = None, audio_ms: float = 0.0
    ) -> bool:
        """Queue ``event`` (an ``event_id`` is added); False when the socket is gone or the
        queue overflowed (the client is then being disconnected)."""
        if self._closed:
            return False
        data = _ENCODER.encode({"event_id": event_id(), **event})
        if self.queued_bytes + len(data) > self.max_bytes:
            self._overflow()
            return False
        self._queue.append(_Queued(data, response_id, audio_ms))
        self.queued_bytes += len(data)
        self._wake.set()
        return True

    def discard(self, response_id: str) -> float:
        """Drop the queued audio deltas of ``response_id``; the milliseconds of audio dropped."""
        kept: deque[_Queued] = deque()
        dropped_ms = 0.0
        for q in self._queue:
            if q.response_id == response_id:
                dropped_ms += q.audio_ms
                self.queued_bytes -= len(q.data)
            else:
                kept.append(q)
        self._queue = kept
        return dropped_ms

    def _overflow(self) -> None:
        logger.warning(
            "realtime client reads too slowly: %d bytes queued (limit %d); disconnecting",
            self.queued_bytes,
            self.max_bytes,
        )
        self.overflowed = True
        self._queue.clear()
        self.queued_bytes = 0
        error = {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "code": "slow_consumer",
                "message": f"the client reads events too slowly: more than {self.max_bytes} "
                "bytes of events waited for it; disconnecting",
                "param": None,
                "event_id": None,
            },
        }
        self._queue.append(_Queued(_ENCODER.encode({"event_id": event_id(), **error}), None, 0))
        self._closed = True
        self._wake.set()
        if self.abort is not None:  # a writer stuck on a reader that never reads
            asyncio.get_running_loop().call_later(3 * CLOSE_GRACE_S, self._abort_if_stuck)

    def _abort_if_stuck(self) -> None:
        if self._task is not None and not self._task.done() and self.abort is not None:
            logger.warning("realtime client never read its last events: connection cut")
            self.abort()

    async def _write(self) -> None:
        try:
            while True:
                while not self._queue:
                    if self._closed:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                q = self._queue.popleft()
                self.queued_bytes -= len(q.data)
                if self.overflowed:  # the last words: bounded, then the socket goes
                    with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
                        await asyncio.wait_for(self.ws.send_str(q.data.decode()), CLOSE_GRACE_S)
                    break
                await self.ws.send_str(q.data.decode())
        except (ConnectionError, RuntimeError) as exc:  # the socket closed under us
            logger.debug("realtime socket closed while sending: %s", exc)
        finally:
            self._closed = True
            self._queue.clear()
            self.queued_bytes = 0
        if self.overflowed:
            with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
                await asyncio.wait_for(
                    self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"slow consumer"),
                    CLOSE_GRACE_S,
                )

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s``) until everything queued is written."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._queue and not self._closed:
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop the writer (what is queued is dropped)."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
