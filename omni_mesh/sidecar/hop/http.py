"""A lean HTTP/1.1 client for calls between sidecars (hops and forwarded ``/v1/run`` calls).

Both ends are ours: requests carry a Content-Length body, answers come from aiohttp handlers
that set Content-Length (chunked answers are read too). An answer of the caller's
``stream_type`` (a streamed hop: length-prefixed frames in a chunked body) is not read whole:
its :class:`FrameReader` yields the frames as they arrive and gives the connection back to the
pool once the body has ended. Connections are kept alive per replica
and a request goes out in one write. Against aiohttp's general-purpose client this saves
about a third of a sidecar's CPU per hop, which is most of what the fabric adds to a hop.

Failures are typed for the replay logic: :class:`HopConnectionError` (refused, reset, closed
before the answer ended, no connection within ``connect_timeout_s``: the replica is gone or out
of reach), ``TimeoutError`` (the caller's deadline),
:class:`~omni_mesh.data_plane.wire.ResponseTooLarge`.

A host that drops off the network silently sends no reset: a request already sent would wait
for its answer until the deadline. The client therefore exposes the connections in use and how
long each has waited (:meth:`HopHttpClient.outstanding`), and :meth:`HopHttpClient.abort` fails
every call in flight to one ``host:port`` with :class:`HopReplicaLost` — what
:class:`~omni_mesh.sidecar.hop.liveness.HopLiveness` does when that replica fails a health probe.
TCP keepalive (``keepalive_s``) is the kernel's second line, for idle pooled connections.

This module is the pool, the calls and the streamed answers; the bytes of one connection
(writing a request, reading a head or a chunk) and the typed errors are
:mod:`omni_mesh.sidecar.hop.conn`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from omni_mesh.data_plane.framing import HEADER_SIZE, FrameDecoder, FrameTooLarge
from omni_mesh.data_plane.wire import READ_CHUNK, ResponseTooLarge
from omni_mesh.sidecar.hop.conn import (
    HEAD_LIMIT,
    HopConn,
    HopConnectionError,
    HopReplicaLost,
    read_chunk,
    read_chunked,
    read_head,
    request_head,
    send_request,
    set_keepalive,
)
from omni_mesh.sidecar.hop.timeouts import within

__all__ = [
    "FrameReader",
    "HopConnectionError",
    "HopHttpClient",
    "HopReplicaLost",
    "HopResponse",
]

logger = logging.getLogger(__name__)


@dataclass
class HopResponse:
    status: int
    content_type: str
    body: bytearray
    frames: FrameReader | None = None  # a streamed answer (``stream_type``): read these


class HopHttpClient:
    """Keep-alive connections per ``host:port``; one request at a time per connection."""

    def __init__(
        self,
        *,
        max_idle_per_host: int = 64,
        connect_timeout_s: float = 0.3,
        keepalive_s: int = 5,
    ) -> None:
        self.max_idle = max_idle_per_host
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[HopConn]] = {}
        self._in_use: set[HopConn] = set()
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
        stream_type: str | None = None,
    ) -> HopResponse:
        """POST ``body``; an answer whose content type is ``stream_type`` comes back with
        :attr:`HopResponse.frames` to read (each frame at most ``max_bytes``, all of them
        within ``timeout_s`` of now); any other answer is read whole."""
        host, port, host_header = self._parse(address)
        head = request_head(path, host_header, headers, len(body))
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with asyncio.timeout_at(deadline):
            conn = await self._connection(host, port)
            try:
                response = await self._exchange(conn, head, body, max_bytes, stream_type, deadline)
            except HopConnectionError as exc:
                if not conn.reused or isinstance(exc, HopReplicaLost):
                    raise
                # A kept-alive connection the server had closed: once more on a fresh one.
                conn = await self._connection(host, port, fresh=True)
                response = await self._exchange(conn, head, body, max_bytes, stream_type, deadline)
        return response

    def outstanding(self) -> dict[tuple[str, int], float]:
        """``(host, port)`` → the loop time since which its longest-waiting call in flight
        has had no answer (nor a frame of one)."""
        oldest: dict[tuple[str, int], float] = {}
        for conn in list(self._in_use):
            if conn.writer.is_closing():  # closed on a path that did not discard it
                self._in_use.discard(conn)
            elif conn.since < oldest.get(conn.key, float("inf")):
                oldest[conn.key] = conn.since
        return oldest

    def abort(self, key: tuple[str, int], reason: str) -> int:
        """Fail every call in flight to ``key`` with :class:`HopReplicaLost` (``reason``) and
        drop its idle connections; returns how many calls were cut."""
        for conn in self._idle.pop(key, []):
            conn.close()
        cut = [conn for conn in self._in_use if conn.key == key]
        for conn in cut:
            conn.lost = reason
            conn.writer.transport.abort()  # the pending read or write fails at once
        return len(cut)

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

    async def _connection(self, host: str, port: int, *, fresh: bool = False) -> HopConn:
        idle = self._idle.get((host, port))
        conn: HopConn | None = None
        while idle and not fresh:
            conn = idle.pop()
            if not conn.writer.is_closing() and not conn.reader.at_eof():
                conn.reused = True
                break
            conn.close()
            conn = None
        if conn is None:
            conn = await self._connect(host, port)
        conn.since = asyncio.get_running_loop().time()
        self._in_use.add(conn)
        return conn

    async def _connect(self, host: str, port: int) -> HopConn:
        """A fresh connection within ``connect_timeout_s`` (the caller's deadline bounds it
        too: that one raises ``TimeoutError``, not :class:`HopConnectionError`)."""
        try:
            reader, writer = await within(
                asyncio.open_connection(host, port, limit=HEAD_LIMIT), self.connect_timeout_s
            )
        except TimeoutError:
            raise HopConnectionError(
                f"cannot connect to {host}:{port}: no connection within "
                f"{self.connect_timeout_s:g}s (hop_connect_timeout_s)"
            ) from None
        except OSError as exc:
            raise HopConnectionError(f"cannot connect to {host}:{port}: {exc}") from exc
        if self.keepalive_s:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                set_keepalive(sock, self.keepalive_s)
        return HopConn((host, port), reader, writer)

    async def _exchange(
        self,
        conn: HopConn,
        head: bytes,
        body: bytes,
        max_bytes: int,
        stream_type: str | None,
        deadline: float,
    ) -> HopResponse:
        """One call on ``conn``; the connection is discarded when it fails."""
        try:
            await send_request(conn.writer, head, body)
            status, content_type, length, chunked, close = await read_head(conn.reader)
            if stream_type is not None and status == 200 and content_type == stream_type:
                frames = FrameReader(self, conn, chunked, length, close, max_bytes, deadline)
                return HopResponse(status, content_type, bytearray(), frames)
            if chunked:
                data = await read_chunked(conn.reader, max_bytes)
            else:
                if length > max_bytes:
                    raise ResponseTooLarge(f"answer of {length} bytes exceeds {max_bytes}")
                data = bytearray(await conn.reader.readexactly(length)) if length else bytearray()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            self._discard(conn)
            raise conn.error(exc) from exc
        except RuntimeError as exc:  # uvloop: a write on a transport closed under the call
            if not conn.writer.is_closing():
                raise
            self._discard(conn)
            raise conn.error(exc) from exc
        except BaseException:  # timeout, cancel, too large: the connection is not reusable
            self._discard(conn)
            raise
        if close:
            self._discard(conn)
        else:
            self._release(conn)
        return HopResponse(status, content_type, data)

    def _discard(self, conn: HopConn) -> None:
        self._in_use.discard(conn)
        conn.close()

    def _release(self, conn: HopConn) -> None:
        self._in_use.discard(conn)
        conn.reused = False
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()


class FrameReader:
    """The frames of a streamed answer (:mod:`~omni_mesh.data_plane.framing`), in a chunked
    (or Content-Length) body. Iterate it, or leave it early with :meth:`aclose` (``async
    with`` does): the connection goes back to the pool only after a clean end.

    A body that ends inside a frame, or a connection that drops, raises
    :class:`HopConnectionError`; reading past the deadline raises ``TimeoutError``."""

    def __init__(
        self,
        client: HopHttpClient,
        conn: HopConn,
        chunked: bool,
        length: int,
        close: bool,
        max_frame: int,
        deadline: float,
    ) -> None:
        self._client = client
        self._conn = conn
        self._chunked = chunked
        self._left = length  # bytes of a Content-Length body not read yet
        self._close = close
        self._max_chunk = max_frame + HEADER_SIZE
        self._frames = FrameDecoder(max_frame)
        self._deadline = deadline
        self._done = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                while (frame := self._frames.next_frame()) is None:
                    data = await self._read_more()
                    if not data:
                        if self._frames.pending:
                            raise asyncio.IncompleteReadError(b"", self._frames.pending)
                        self._finish(reuse=not self._close)
                        raise StopAsyncIteration
                    self._frames.feed(data)
                self._conn.since = asyncio.get_running_loop().time()  # progress: not silent
                return frame
        except FrameTooLarge as exc:
            self._finish(reuse=False)
            raise ResponseTooLarge(str(exc)) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            self._finish(reuse=False)
            if isinstance(exc, ResponseTooLarge):
                raise
            if self._conn.lost:
                raise HopReplicaLost(f"streamed answer cut: {self._conn.lost}") from exc
            raise HopConnectionError(
                f"streamed answer broke off: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            if not self._done:
                self._finish(reuse=False)
            raise

    async def aclose(self) -> None:
        """Stop reading; a connection whose body was not read to its end is closed."""
        if not self._done:
            self._finish(reuse=False)

    async def __aenter__(self) -> FrameReader:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _finish(self, *, reuse: bool) -> None:
        self._done = True
        if reuse:
            self._client._release(self._conn)
        else:
            self._client._discard(self._conn)

    async def _read_more(self) -> bytes:
        """The next piece of the body (a chunk, or up to ``READ_CHUNK`` bytes of a
        Content-Length body); ``b""`` at its end."""
        if self._chunked:
            return await read_chunk(self._conn.reader, self._max_chunk)
        if self._left == 0:
            return b""
        data = await self._conn.reader.read(min(self._left, READ_CHUNK))
        if not data:
            raise asyncio.IncompleteReadError(b"", self._left)
        self._left -= len(data)
        return data
