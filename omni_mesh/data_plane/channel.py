"""The sidecar ⇄ engine control channel: a Unix stream socket carrying :data:`EngineMessage`
frames (headers and wake-ups only; tensors travel through shared memory).

Frames are :mod:`~omni_mesh.data_plane.framing`'s (a 4-byte length, then msgpack); frames over
:data:`MAX_FRAME` are refused on both ends. The engine process (threads, no event loop) uses
:class:`BlockingChannel`; the sidecar uses :class:`AsyncChannel`. Both ends come from
:func:`make_socketpair`; the sidecar hands the child end to the engine with ``pass_fds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from typing import cast

from omni_mesh.data_plane import framing
from omni_mesh.data_plane.codec import CodecError, decode
from omni_mesh.data_plane.messages import EngineMessage

log = logging.getLogger(__name__)

MAX_FRAME = 16 << 20
_RECV_CHUNK = 256 << 10


class ChannelError(RuntimeError):
    """The channel is unusable: oversize or malformed frame, peer gone mid-frame or on send."""


def make_socketpair() -> tuple[socket.socket, socket.socket]:
    """``(parent_end, child_end)`` of a Unix stream socket pair; only the child end is
    inheritable (pass ``child_end.fileno()`` in ``pass_fds``, then close it in the parent)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child.set_inheritable(True)
    return parent, child


def encode_frame(msg: EngineMessage, *, max_frame: int = MAX_FRAME) -> bytearray:
    """Length prefix + msgpack of ``msg``; :class:`ChannelError` when over ``max_frame``."""
    try:
        return framing.encode_frame(msg, max_frame=max_frame)
    except CodecError as exc:
        raise ChannelError(f"cannot send {type(msg).__name__}: {exc}") from exc
    except framing.FrameTooLarge as exc:
        raise ChannelError(
            f"{type(msg).__name__} {exc} (tensors belong in shared memory, not on the channel)"
        ) from None


def _decode_frame(body: bytes) -> EngineMessage:
    try:
        return cast(EngineMessage, decode(body, EngineMessage))
    except CodecError as exc:
        raise ChannelError(f"malformed frame from peer: {exc}") from None


# ---- engine side (blocking) ------------------------------------------------------------------


class BlockingChannel:
    """Frames over a blocking socket. ``send`` is thread-safe; ``recv`` is meant for one
    reader thread (it is serialized too)."""

    def __init__(self, sock: socket.socket, *, max_frame: int = MAX_FRAME) -> None:
        sock.setblocking(True)
        self._sock = sock
        self.max_frame = max_frame
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._frames = framing.FrameDecoder(max_frame)
        self._eof = False
        self._closed = False
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def send(self, msg: EngineMessage) -> None:
        frame = encode_frame(msg, max_frame=self.max_frame)
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as exc:
            raise ChannelError(f"cannot send {type(msg).__name__}: peer gone ({exc})") from exc

    def recv(self, timeout: float | None = None) -> EngineMessage | None:
        """The next message; ``None`` once the peer has closed the channel. With a
        ``timeout`` (seconds, 0 = poll), raises :class:`TimeoutError` when no whole frame
        arrived in time (a partial frame stays buffered for the next call)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._recv_lock:
            while True:
                msg = self._next_frame()
                if msg is not None:
                    return msg
                if self._eof:
                    if self._frames.pending:
                        raise ChannelError(f"peer closed mid-frame ({self._frames.pending} bytes)")
                    return None
                if deadline is not None and not self._wait(deadline):
                    raise TimeoutError(f"no message within {timeout} s")
                self._fill()

    def close(self) -> None:
        """Close the socket; a thread blocked in :meth:`recv` wakes up and gets ``None``."""
        self._closed = True
        with contextlib.suppress(OSError):  # already disconnected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def __enter__(self) -> BlockingChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _next_frame(self) -> EngineMessage | None:
        try:
            body = self._frames.next_frame()
        except framing.FrameTooLarge as exc:
            raise ChannelError(str(exc)) from None
        return None if body is None else _decode_frame(body)

    def _wait(self, deadline: float) -> bool:
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        return bool(self._poll.poll(remaining_ms))

    def _fill(self) -> None:
        try:
            chunk = self._sock.recv(_RECV_CHUNK)
        except ConnectionResetError:
            chunk = b""
        except OSError as exc:
            if not self._closed:
                raise ChannelError(f"cannot receive: {exc}") from exc
            chunk = b""  # closed by another thread of this process
        if chunk:
            self._frames.feed(chunk)
        else:
            self._eof = True


# ---- sidecar side (asyncio) ------------------------------------------------------------------


class AsyncChannel:
    """Frames over asyncio streams. Concurrent ``send`` calls never interleave frames
    (each frame is one ``write``); ``recv`` is for one reader task."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = MAX_FRAME,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.max_frame = max_frame

    @classmethod
    async def open(cls, sock: socket.socket, *, max_frame: int = MAX_FRAME) -> AsyncChannel:
        """Wrap the parent end of :func:`make_socketpair` (the event loop takes it over)."""
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer, max_frame=max_frame)

    async def send(self, msg: EngineMessage) -> None:
        frame = encode_frame(msg, max_frame=self.max_frame)
        try:
            self._writer.write(frame)
            await self._writer.drain()
        except ConnectionError as exc:
            raise ChannelError(f"cannot send {type(msg).__name__}: peer gone ({exc})") from exc

    async def recv(self) -> EngineMessage | None:
        """The next message; ``None`` once the peer has closed the channel."""
        try:
            header = await self._reader.readexactly(framing.HEADER_SIZE)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise ChannelError("peer closed mid-frame (in the length prefix)") from None
            return None
        except ConnectionResetError:
            return None
        try:
            size = framing.frame_size(header, self.max_frame)
        except framing.FrameTooLarge as exc:
            raise ChannelError(str(exc)) from None
        try:
            body = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
            raise ChannelError(f"peer closed mid-frame (expected {size} bytes)") from exc
        return _decode_frame(body)

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError as exc:
            log.debug("engine channel closed with %r", exc)
