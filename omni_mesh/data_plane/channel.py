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
from collections import deque
from collections.abc import Callable
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

    def ready(self) -> bool:
        """Whether :meth:`recv` has something to read now (bytes buffered or waiting on the
        socket): a poll without :meth:`recv`'s ``TimeoutError`` when there is nothing."""
        return self._frames.pending > 0 or self._eof or bool(self._poll.poll(0))

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

#: What :meth:`AsyncChannel.listen` delivers: a message, a broken channel, or ``None`` at EOF.
Delivery = EngineMessage | ChannelError | None


class AsyncChannel:
    """Frames over an asyncio transport. Concurrent ``send`` calls never interleave frames
    (each frame is one ``write``). Read with ``recv`` (one reader task), or hand every
    message to a callback as it is read with :meth:`listen` (no reader task: the message
    reaches its consumer in the same turn of the event loop as the bytes)."""

    def __init__(self, protocol: _FrameProtocol) -> None:
        self._protocol = protocol
        self.max_frame = protocol.max_frame

    @classmethod
    async def open(cls, sock: socket.socket, *, max_frame: int = MAX_FRAME) -> AsyncChannel:
        """Wrap the parent end of :func:`make_socketpair` (the event loop takes it over)."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: _FrameProtocol(max_frame), sock=sock
        )
        return cls(protocol)

    async def send(self, msg: EngineMessage) -> None:
        frame = encode_frame(msg, max_frame=self.max_frame)
        try:
            await self._protocol.write(frame)
        except ConnectionError as exc:
            raise ChannelError(f"cannot send {type(msg).__name__}: peer gone ({exc})") from exc

    async def recv(self) -> EngineMessage | None:
        """The next message; ``None`` once the peer has closed the channel."""
        got = await self._protocol.next_delivery()
        if isinstance(got, ChannelError):
            raise got
        return got

    def listen(self, on_message: Callable[[Delivery], None]) -> None:
        """From now on call ``on_message`` with every message (those received and not taken
        by :meth:`recv` first), then once with ``None`` at EOF or a :class:`ChannelError`
        when the channel breaks. It runs inside the transport's read callback: keep it short
        and non-blocking; an exception it raises is logged."""
        self._protocol.listen(on_message)

    async def close(self) -> None:
        await self._protocol.close()


class _FrameProtocol(asyncio.Protocol):
    """Decodes frames as bytes arrive; keeps them for ``recv`` or hands them to a listener."""

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._frames = framing.FrameDecoder(max_frame)
        self._inbox: deque[Delivery] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[Delivery], None] | None = None
        self._transport: asyncio.Transport | None = None
        self._ended = False  # EOF, an error or connection_lost: nothing more is read
        self._lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._paused = False
        self._drained: asyncio.Future[None] | None = None

    # ---- reading -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        self._frames.feed(data)
        while True:
            try:
                body = self._frames.next_frame()
                if body is None:
                    return
                self._deliver(_decode_frame(body))
            except framing.FrameTooLarge as exc:
                self._end(ChannelError(str(exc)))
                return
            except ChannelError as exc:
                self._end(exc)
                return

    def eof_received(self) -> bool:
        self._end(self._truncation())
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(self._truncation())
        if not self._lost.done():
            self._lost.set_result(None)
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the channel closed"))
            self._drained.exception()  # retrieved: no writer may be waiting on it

    def _truncation(self) -> ChannelError | None:
        pending = self._frames.pending
        if not pending:
            return None
        if pending < framing.HEADER_SIZE:
            return ChannelError("peer closed mid-frame (in the length prefix)")
        (size,) = framing.HEADER.unpack_from(self._frames.peek(framing.HEADER_SIZE))
        return ChannelError(f"peer closed mid-frame (expected {size} bytes)")

    def _end(self, last: ChannelError | None) -> None:
        if self._ended:
            return
        self._ended = True
        self._deliver(last)
        if last is not None and self._transport is not None:
            self._transport.close()  # a broken stream cannot be resynchronised

    def _deliver(self, item: Delivery) -> None:
        if self._listener is not None:
            self._call(item)
            return
        self._inbox.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _call(self, item: Delivery) -> None:
        assert self._listener is not None
        try:
            self._listener(item)
        except Exception:  # a consumer bug must not break the channel's read callback
            log.exception("channel listener failed on %s", type(item).__name__)

    async def next_delivery(self) -> Delivery:
        while not self._inbox:
            if self._ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def listen(self, listener: Callable[[Delivery], None]) -> None:
        self._listener = listener
        while self._inbox:
            self._call(self._inbox.popleft())

    # ---- writing -------------------------------------------------------------------------

    async def write(self, frame: bytearray) -> None:
        transport = self._transport
        if transport is None or transport.is_closing() or self._lost.done():
            raise ConnectionResetError("the channel is closed")
        transport.write(frame)
        if self._paused:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            await self._lost
