"""The pod's listening socket: plain hops served by a lean HTTP/1.1 protocol, everything else
by aiohttp.

Hops between sidecars are most of a stage pod's requests, and aiohttp's server is a large part
of what a hop costs: a request and a response object, URL and header objects, routing, two
middlewares, a handler task per connection (docs/benchmarks.md, the hop section). Both ends of
a hop are ours (``hop/http.py`` sends it), so the shape of its request is known.

Every connection starts on :class:`HopProtocol`. A request whose head is exactly
``POST /v1/hop HTTP/1.1`` with a ``Content-Length`` and no ``Transfer-Encoding``,
``Content-Encoding`` or ``Expect`` is served here, through the same :func:`serve_hop` as the
aiohttp route. The first request that is anything else (another route, a chunked or
compressed body, a head that does not parse) hands the connection, with every byte read of
that request, to aiohttp's handler for good: aiohttp answers it, its errors included, as it
answers every other connection. A hop therefore behaves the same on either path.

Answers carry ``Content-Length`` (whole) or are chunked (a stream of frames); errors have the
JSON shape of every other error (``errors.error_response``). A bad hop token, or a body over
the pod's limit, is answered on its head; its body is then read and dropped, and the connection
closed. A connection
idle for :data:`KEEPALIVE_S` is closed, as aiohttp closes its own; a client that goes away
cancels its hop, as aiohttp's ``handler_cancellation`` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive

from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.sidecar.api.hop_route import check_hop, serve_hop
from omni_mesh.sidecar.errors import ApiError, error_body
from omni_mesh.sidecar.hop.client import HOP_PATH
from omni_mesh.sidecar.middleware import api_error_for, internal_error
from omni_mesh.sidecar.pod import Pod

logger = logging.getLogger(__name__)

#: A head longer than this is not a hop: aiohttp answers it.
MAX_HEAD = 16 << 10
#: Seconds an idle connection is kept (aiohttp's default keep-alive timeout).
KEEPALIVE_S = 75.0
#: Bytes read ahead (a pipelined request) while a hop is served before reading pauses.
READ_AHEAD = 64 << 10
#: Seconds a refused request's body is read and dropped before its connection is closed.
DISCARD_S = 10.0
#: Seconds hops still running when the pod stops may take (aiohttp's shutdown timeout).
STOP_GRACE_S = 60.0

_REQUEST_LINE = b"POST " + HOP_PATH.encode() + b" HTTP/1.1"
_TOKEN = b"x-omni-hop-token"
_HANDED_OFF = (b"transfer-encoding", b"content-encoding", b"expect")
_WHOLE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: " + MSGPACK.encode() + b"\r\nContent-Length: "
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: "
    + HOP_FRAMES.encode()
    + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class _Hop:
    """One parsed hop request: its token, body length and whether the client closes after."""

    __slots__ = ("close", "length", "token")

    def __init__(self, token: str, length: int, close: bool) -> None:
        self.token = token
        self.length = length
        self.close = close


def parse_hop_head(head: bytes) -> _Hop | None:
    """The hop ``head`` (without its blank line) asks for; None when it is not a plain hop
    (aiohttp takes it)."""
    lines = head.split(b"\r\n")
    if lines[0] != _REQUEST_LINE:
        return None
    token, length, close = b"", -1, False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name[-1:] in b" \t" or line[:1] in b" \t":
            return None  # malformed, or an obsolete folded line: aiohttp says what is wrong
        name = name.lower()
        value = value.strip()
        if name == b"content-length":
            if length >= 0 or not value.isdigit():
                return None
            length = int(value)
        elif name == _TOKEN:
            token = value
        elif name == b"connection":
            close = value.lower() == b"close"
        elif name in _HANDED_OFF:
            return None
    if length < 0:
        return None
    try:
        return _Hop(token.decode("latin-1"), length, close)
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        return None


class HopProtocol(asyncio.Protocol):
    """One connection, served here while its requests are plain hops (module docstring)."""

    def __init__(
        self,
        pod: Pod,
        fallback: Callable[[], asyncio.Protocol],
        conns: set[HopProtocol],
    ) -> None:
        self._pod = pod
        self._fallback = fallback
        self._conns = conns
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()  # bytes read and not yet parsed
        self._hop: _Hop | None = None  # the request whose body is being read
        self._body = bytearray()
        self._got = 0
        self._task: asyncio.Task[None] | None = None  # the hop being served
        self._answered = False  # its answer (whole, or a stream's head) is on the wire
        self._streaming = False
        self._discard = 0  # body bytes of a refused request still to be read and dropped
        self._paused_reading = False
        self._writable: asyncio.Future[None] | None = None  # set while writing is paused
        self._idle_since = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None

    # ---- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        tcp_keepalive(self._transport)  # as aiohttp's handler does: a silent peer is noticed
        self._conns.add(self)
        self._idle_timer = self._loop.call_later(KEEPALIVE_S, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._conns.discard(self)
        self._transport = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None:
            self._task.cancel()  # the client went away: its hop is abandoned
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the connection closed"))
            self._writable.exception()  # retrieved: the hop may not be writing

    @property
    def busy(self) -> asyncio.Task[None] | None:
        """The hop being served, if any."""
        return self._task

    def close(self) -> None:
        """Close the connection (the pod stops)."""
        if self._transport is not None:
            self._transport.close()

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._transport is None:
            return
        idle_for = self._loop.time() - self._idle_since
        if self._task is None and not self._buf and self._hop is None and idle_for >= KEEPALIVE_S:
            self._transport.close()
            return
        busy = self._task is not None or self._hop is not None
        wait_s = KEEPALIVE_S if busy else max(1.0, KEEPALIVE_S - idle_for)
        self._idle_timer = self._loop.call_later(wait_s, self._check_idle)

    # ---- reading -------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._discard:  # the body of a refused request: read, so that closing sends no RST
            self._discard -= min(self._discard, len(data))
            if not self._discard and self._transport is not None:
                self._transport.close()
            return
        if self._hop is not None:  # a body being read: straight into its buffer
            take = min(len(data), self._hop.length - self._got)
            self._body[self._got : self._got + take] = data[:take]
            self._got += take
            if take < len(data):
                self._buf += data[take:]
            if self._got == self._hop.length:
                self._dispatch()
            return
        self._buf += data
        if self._task is None:
            self._next_request()
        elif len(self._buf) > READ_AHEAD and not self._paused_reading and self._transport:
            self._paused_reading = True
            self._transport.pause_reading()

    def _next_request(self) -> None:
        """Parse the buffered request's head: take its body, or hand the connection over."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD:
                self._hand_off()
            return
        hop = parse_hop_head(bytes(self._buf[:end]))
        if hop is None:
            self._hand_off()
            return
        rest = memoryview(self._buf)[end + 4 :]
        try:
            check_hop(self._pod, hop.token)
            if hop.length > self._pod.settings.max_body_bytes:
                limit = self._pod.settings.max_body_bytes
                raise ApiError(413, f"request body is {hop.length} bytes, the limit is {limit}")
        except ApiError as err:
            self._discard = max(0, hop.length - len(rest))
            rest.release()
            self._buf.clear()
            # Answered on its head; the connection ends after the body is read and dropped
            # (closing with unread bytes would reset it, and the sender would see a dead
            # replica instead of this answer), or after DISCARD_S at most.
            self._write_error(err, closing=True)
            if self._discard:
                self._loop.call_later(DISCARD_S, self.close)
            elif self._transport is not None:
                self._transport.close()
            return
        take = min(len(rest), hop.length)
        self._body = bytearray(hop.length)
        self._body[:take] = rest[:take]
        leftover = bytes(rest[take:])
        rest.release()
        self._buf = bytearray(leftover)
        self._hop, self._got = hop, take
        if take == hop.length:
            self._dispatch()

    def _dispatch(self) -> None:
        hop, body = self._hop, self._body
        assert hop is not None
        self._hop, self._body, self._got = None, bytearray(), 0
        self._task = self._loop.create_task(self._serve(hop, body))

    def _hand_off(self) -> None:
        """Give the connection, with what was read of its current request, to aiohttp."""
        transport = self._transport
        if transport is None:
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._conns.discard(self)
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        handler = self._fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        pending, self._buf = bytes(self._buf), bytearray()
        self._transport = None
        if pending:
            handler.data_received(pending)

    # ---- serving -------------------------------------------------------------------------

    async def _serve(self, hop: _Hop, body: bytearray) -> None:
        try:
            await serve_hop(self._pod, body, self)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._answered:  # a second answer would answer the connection's next request
                logger.exception("hop failed after its answer started")
                self.cut()
            else:
                err = api_error_for(exc)
                if err is None:
                    logger.exception("unhandled error on POST %s", HOP_PATH)
                    err = internal_error()
                self._write_error(err, closing=hop.close)
                self._done(close=hop.close)
                return
        self._done(close=hop.close)

    def _done(self, *, close: bool) -> None:
        self._task = None
        self._answered = self._streaming = False
        self._idle_since = self._loop.time()
        transport = self._transport
        if transport is None or transport.is_closing():  # gone, or cut (a broken stream)
            return
        if close:
            transport.close()
            return
        if self._paused_reading:
            self._paused_reading = False
            transport.resume_reading()
        if self._buf:
            self._next_request()

    # ---- writing (HopAnswer) -------------------------------------------------------------

    def whole(self, body: bytes) -> None:
        self._answered = True
        if self._transport is not None:
            self._transport.writelines((_WHOLE_HEAD, b"%d\r\n\r\n" % len(body), body))

    async def frame(self, frame: bytes | bytearray) -> None:
        transport = self._transport
        if transport is None:
            raise ConnectionResetError("the connection closed")
        if not self._streaming:
            self._answered = self._streaming = True
            transport.write(_STREAM_HEAD)
        transport.writelines((b"%x\r\n" % len(frame), frame, b"\r\n"))
        if self._writable is not None:
            await self._writable

    async def end(self) -> None:
        if self._transport is None:
            raise ConnectionResetError("the connection closed")
        self._transport.write(b"0\r\n\r\n")

    def cut(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def _write_error(self, err: ApiError, *, closing: bool) -> None:
        """Answer ``err`` (``closing``: saying the connection ends after it)."""
        transport = self._transport
        if transport is None:
            return
        body = json.dumps({"error": error_body(err)}).encode()
        try:
            reason = HTTPStatus(err.status).phrase
        except ValueError:
            reason = "Error"
        lines = [
            f"HTTP/1.1 {err.status} {reason}",
            "Content-Type: application/json; charset=utf-8",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in err.headers.items()),
        ]
        if closing:
            lines.append("Connection: close")
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


class HopSite(web.TCPSite):
    """aiohttp's TCP site with :class:`HopProtocol` in front of its handler."""

    def __init__(self, runner: web.AppRunner, pod: Pod, *args: object, **kwargs: object) -> None:
        super().__init__(runner, *args, **kwargs)  # type: ignore[arg-type]
        self._pod = pod
        self._conns: set[HopProtocol] = set()

    async def start(self) -> None:
        # TCPSite.start, with the protocol factory wrapped (pods serve plain HTTP).
        assert self._ssl_context is None
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        pod, conns = self._pod, self._conns
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HopProtocol(pod, server, conns),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        """Close idle connections; give hops still running (a drain that timed out) up to
        :data:`STOP_GRACE_S`, as aiohttp gives its handlers; then close the rest."""
        running = [task for conn in self._conns if (task := conn.busy) is not None]
        for conn in [c for c in self._conns if c.busy is None]:
            conn.close()
        if running:
            await asyncio.wait(running, timeout=STOP_GRACE_S)
        for conn in list(self._conns):
            conn.close()
        await super().stop()
