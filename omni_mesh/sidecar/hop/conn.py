"""One kept-alive HTTP/1.1 connection between sidecars, at the level of its bytes: the typed
errors a call on it raises, writing a request in as few writes as possible, reading an answer's
head and its chunked body, and the TCP keepalive that closes an idle one whose peer went silent.

The pool of these connections, the calls and the streamed answers are
:mod:`omni_mesh.sidecar.hop.http`'s job.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from omni_mesh.data_plane.wire import READ_CHUNK, ResponseTooLarge

#: The most bytes an answer's head (status line and headers) may take: the stream's buffer limit.
HEAD_LIMIT = 64 * 1024


class HopConnectionError(ConnectionError):
    """The connection was refused, reset, not made in time or closed before the answer ended."""


class HopReplicaLost(HopConnectionError):
    """The call was cut by :meth:`~omni_mesh.sidecar.hop.http.HopHttpClient.abort`: its
    replica stopped answering probes."""


@dataclass(eq=False)  # hashed by identity: kept in the client's set of connections in use
class HopConn:
    """One connection to the replica at ``key`` (``(host, port)``), idle or carrying a call."""

    key: tuple[str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False
    since: float = 0.0  # loop time the call was sent (or its last frame came)
    lost: str = ""  # why abort() cut it

    def close(self) -> None:
        self.writer.close()

    def error(self, exc: BaseException) -> HopConnectionError:
        """The typed error for ``exc`` raised while this connection carried a call."""
        if self.lost:
            return HopReplicaLost(self.lost)
        return HopConnectionError(f"{type(exc).__name__}: {exc}")


def request_head(path: str, host: bytes, headers: dict[str, str], length: int) -> bytes:
    """The head of a POST of ``length`` body bytes to ``path``."""
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: " + host]
    lines += [f"{k}: {v}".encode() for k, v in headers.items()]
    lines.append(f"Content-Length: {length}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def send_request(writer: asyncio.StreamWriter, head: bytes, body: bytes) -> None:
    """Write ``head`` and ``body``: in one write when the body is small, else in pieces of
    ``READ_CHUNK`` bytes, draining between them."""
    if len(body) <= READ_CHUNK:
        writer.write(head + body)  # one write: one segment for small calls
    else:
        writer.write(head)
        view = memoryview(body)
        for start in range(0, len(view), READ_CHUNK):
            if writer.is_closing():  # aborted while draining (uvloop's write would raise)
                raise ConnectionResetError("the connection closed while sending the body")
            writer.write(view[start : start + READ_CHUNK])
            await writer.drain()
    await writer.drain()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, str, int, bool, bool]:
    """An answer's status, content type (no parameters), Content-Length, whether its body is
    chunked and whether the server closes the connection after it."""
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


async def read_chunk(reader: asyncio.StreamReader, max_size: int) -> bytes:
    """The next chunk of a chunked body (``b""`` at the last, empty one; our servers send no
    trailers); :class:`ResponseTooLarge` when it is over ``max_size`` bytes."""
    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
    if size == 0:
        await reader.readuntil(b"\r\n")
        return b""
    if size > max_size:
        raise ResponseTooLarge(f"chunked answer exceeds {max_size} bytes")
    data = await reader.readexactly(size + 2)  # the chunk and its CRLF
    return data[:-2]


async def read_chunked(reader: asyncio.StreamReader, max_bytes: int) -> bytearray:
    """A whole chunked body, at most ``max_bytes`` (else :class:`ResponseTooLarge`)."""
    data = bytearray()
    while chunk := await read_chunk(reader, max_bytes - len(data)):
        data += chunk
    return data


def set_keepalive(sock: socket.socket, seconds: int) -> None:
    """Have the kernel close ``sock`` when it has been idle for about ``seconds`` with its peer
    silent (keepalive probes). No ``TCP_USER_TIMEOUT``: it would also cut a live receiver that
    stops reading a large body for that long (zero window); calls in flight are the prober's."""
    step = max(1, seconds // 5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", step),
        ("TCP_KEEPINTVL", step),
        ("TCP_KEEPCNT", max(1, (seconds - step) // step)),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; others keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
