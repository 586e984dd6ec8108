"""A lean HTTP/1.1 keep-alive client for the control-plane load (simulated instances).

Thousands of simulated instances heartbeating at 1 Hz from one Python process would measure
aiohttp's client (~80 µs of CPU per request) as much as the control plane. This client sends
pre-formatted requests over a pool of persistent loopback connections (one request at a time
per connection, as a real instance does) and reads status, Content-Length and body: a few µs
per request. It talks to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib

LOCALHOST = "127.0.0.1"


class RawHttpError(RuntimeError):
    pass


class RawConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes]:
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        length = 0
        for line in raw.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
                break
        data = await self.reader.readexactly(length) if length else b""
        return status, data

    def close(self) -> None:
        self.writer.close()


class RawHttpPool:
    """At most ``size`` keep-alive connections to ``127.0.0.1:port``."""

    def __init__(self, port: int, size: int) -> None:
        self.port = port
        self.size = size
        self._idle: asyncio.Queue[RawConn] = asyncio.Queue()
        self._open = 0
        self._lock = asyncio.Lock()

    async def _get(self) -> RawConn:
        if self._idle.empty() and self._open < self.size:
            async with self._lock:
                if self._open < self.size:
                    self._open += 1
                    try:
                        reader, writer = await asyncio.open_connection(LOCALHOST, self.port)
                    except OSError:
                        self._open -= 1
                        raise
                    return RawConn(reader, writer)
        return await self._idle.get()

    async def request(
        self, method: str, path: str, body: bytes = b"", limit_s: float = 5.0
    ) -> tuple[int, bytes]:
        """One request; raises on a connection error or a timeout (the connection is then
        dropped, as a real client would)."""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {LOCALHOST}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn = await self._get()
        try:
            async with asyncio.timeout(limit_s):
                result = await conn.request(head, body)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
            conn.close()
            self._open -= 1
            raise RawHttpError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        self._idle.put_nowait(conn)
        return result

    async def close(self) -> None:
        while not self._idle.empty():
            conn = self._idle.get_nowait()
            conn.close()
            with contextlib.suppress(OSError, ConnectionError):
                await conn.writer.wait_closed()
        self._open = 0
