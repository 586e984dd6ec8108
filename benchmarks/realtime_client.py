"""A light realtime client for the benchmark: one aiohttp WebSocket per session, a reader task
that stamps every server event with the wall clock on arrival (``time.time_ns``: comparable
with the spans' timestamps of the stage processes on this machine), and waits by event type.

The benchmark uses this rather than the SDK so that thousands of sessions fit in one process
and the client's own parsing stays out of the timings; the tests drive the SDK."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

RATE = 24_000


@dataclass
class Stamped:
    ns: int  # time.time_ns() on arrival
    event: dict[str, Any]

    @property
    def type(self) -> str:
        return str(self.event.get("type"))


@dataclass
class RealtimeConn:
    """One session (see the module docstring)."""

    ws: aiohttp.ClientWebSocketResponse
    events: list[Stamped] = field(default_factory=list)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _seen: int = 0
    _reader: asyncio.Task[None] | None = None

    def start(self) -> RealtimeConn:
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    self.events.append(Stamped(time.time_ns(), json.loads(msg.data)))
                    self._arrived.set()
        finally:
            self.closed.set()
            self._arrived.set()

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    async def until(self, kind: str, within: float = 120.0) -> Stamped:
        """The next event of type ``kind`` (after the last one this returned); an ``error``
        event or a closed socket on the way raises."""
        deadline = time.monotonic() + within
        while True:
            while self._seen < len(self.events):
                got = self.events[self._seen]
                self._seen += 1
                if got.type == kind:
                    return got
                if got.type == "error":
                    raise RuntimeError(f"server error event: {got.event['error']}")
            if self.closed.is_set():
                raise ConnectionError(f"socket closed while waiting for {kind}")
            self._arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind} within {within} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)

    async def append(self, samples: np.ndarray) -> None:
        audio = base64.b64encode(samples.astype("<i2").tobytes()).decode()
        await self.send({"type": "input_audio_buffer.append", "audio": audio})

    async def close(self) -> None:
        await self.ws.close()
        if self._reader is not None:
            await self._reader


async def connect(http: aiohttp.ClientSession, url: str, model: str, **update: Any) -> RealtimeConn:
    """A session on ``url`` (``session.created`` read), updated with ``update`` if given."""
    ws = await http.ws_connect(f"{url}/v1/realtime?model={model}", max_msg_size=0)
    conn = RealtimeConn(ws).start()
    await conn.until("session.created", within=30)
    if update:
        await conn.send({"type": "session.update", "session": {"type": "realtime", **update}})
        await conn.until("session.updated", within=30)
    return conn


async def user_text(conn: RealtimeConn, text: str) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await conn.send({"type": "conversation.item.create", "item": item})
    await conn.until("conversation.item.done")


def audio_deltas(events: list[Stamped], response_id: str) -> list[Stamped]:
    return [
        e
        for e in events
        if e.type == "response.output_audio.delta" and e.event.get("response_id") == response_id
    ]
