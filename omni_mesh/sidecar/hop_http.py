"""A lean HTTP/1.1 client for calls between sidecars (hops and forwarded ``/v1/run`` calls).

Both ends are ours: requests carry a Content-Length body, answers come from aiohttp handlers
that set Content-Length (chunked answers are read too). Connections are kept alive per replica
and a request goes out in one write. Against aiohttp's general-purpose client this saves
about a third of a sidecar's CPU per hop, which is most of what the fabric adds to a hop.

Failures are typed for the replay logic: :class:`HopConnectionError` (refused, reset, closed
before the answer ended: the replica's process is gone), ``TimeoutError`` (slow: maybe alive),
:class:`~omni_mesh.data_plane.wire.ResponseTooLarge`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

from omni_mesh.data_plane.wire import READ_CHUNK, ResponseTooLarge

logger = logging.getLogger(__name__)

_HEAD_LIMIT = 64 * 1024


class HopConnectionError(ConnectionError):
    """The connection was refused, reset or closed before the answer ended."""


@dataclass
class HopResponse:
    status: int
    content_type: str
    body: bytearray


@dataclass
class _Conn:
    key: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False

    def close(self) -> None:
        self.writer.close()


class HopHttpClient:
    """Keep-alive connections per ``host:port``; one request at a time per connection."""

    def __init__(self, *, max_idle_per_host: int = 64) -> None:
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._hosts: dict[str, tuple[str, int, bytes]] = {}

    async def post(
        self,
        address: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        timeout_s: float,
        max_bytes: int,
    ) -> HopResponse:
        host, port, host_header = self._parse(address)
        head = self._head(path, host_header, headers, len(body))
        async with asyncio.timeout(timeout_s):
            conn = await self._connection(host, port)
            try:
                response = await self._exchange(conn, head, body, max_bytes)
            except HopConnectionError:
                conn.close()
                if not conn.reused:
                    raise
                # A kept-alive connection the server had closed: once more on a fresh one.
                conn = await self._connection(host, port, fresh=True)
                response = await self._exchange(conn, head, body, max_bytes)
            except BaseException:
                conn.close()
                raise
        return response

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    # ---- internals -----------------------------------------------------------------------

    def _parse(self, address: str) -> tuple[str, int, bytes]:
        cached = self._hosts.get(address)
        if cached is None:
            parts = urlsplit(address)
            if parts.scheme != "http" or not parts.hostname or parts.port is None:
                raise ValueError(f"not an http://host:port address: {address!r}")
            cached = (parts.hostname, parts.port, f"{parts.hostname}:{parts.port}".encode())
            self._hosts[address] = cached
        return cached

    @staticmethod
    def _head(path: str, host: bytes, headers: dict[str, str], length: int) -> bytes:
        lines = [f"POST {path} HTTP/1.1".encode(), b"Host: " + host]
        lines += [f"{k}: {v}".encode() for k, v in headers.items()]
        lines.append(f"Content-Length: {length}".encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _connection(self, host: str, port: int, *, fresh: bool = False) -> _Conn:
        idle = self._idle.get((host, port))
        while idle and not fresh:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                return conn
            conn.close()
        try:
            reader, writer = await asyncio.open_connection(host, port, limit=_HEAD_LIMIT)
        except OSError as exc:
            raise HopConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
        return _Conn((host, port), reader, writer)

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes, max_bytes: int) -> HopResponse:
        try:
            await self._send(conn.writer, head, body)
            status, content_type, length, chunked, close = await self._read_head(conn.reader)
            if chunked:
                data = await self._read_chunked(conn.reader, max_bytes)
            else:
                if length > max_bytes:
                    raise ResponseTooLarge(f"answer of {length} bytes exceeds {max_bytes}")
                data = bytearray(await conn.reader.readexactly(length)) if length else bytearray()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise HopConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if close:
            conn.close()
        else:
            self._release(conn)
        return HopResponse(status, content_type, data)

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> None:
        if len(body) <= READ_CHUNK:
            writer.write(head + body)  # one write: one segment for small calls
        else:
            writer.write(head)
            view = memoryview(body)
            for start in range(0, len(view), READ_CHUNK):
                writer.write(view[start : start + READ_CHUNK])
                await writer.drain()
        await writer.drain()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[int, str, int, bool, bool]:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise HopConnectionError(f"malformed status line {lines[0][:80]!r}") from None
        content_type, length, chunked, close = "", 0, False, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"content-type":
                content_type = value.strip().split(b";")[0].decode("latin-1")
            elif key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif key == b"connection":
                close = value.strip().lower() == b"close"
        return status, content_type, length, chunked, close

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int) -> bytearray:
        data = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return data
            if len(data) + size > max_bytes:
                raise ResponseTooLarge(f"chunked answer exceeds {max_bytes} bytes")
            data += await reader.readexactly(size)
            await reader.readexactly(2)

    def _release(self, conn: _Conn) -> None:
        conn.reused = False
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()
