"""Silent replicas on loopback: the hop client's connect timeout, the liveness prober
(``sidecar/hop/liveness.py``) and the kernel's keepalive options.

A *silent* address here is a listening socket whose accept queue is full: the kernel drops
further SYNs without a word, as a host whose link went down does. A *mute* replica accepts
connections but never answers (a hung process, or a host that vanished after the connection
was made).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web
from pydantic import ValidationError

from omni_mesh.configs.stage_settings import StageSettings
from omni_mesh.data_plane import codec
from omni_mesh.data_plane.connectors import HttpConnector
from omni_mesh.data_plane.constants import HOP_FRAMES, MSGPACK
from omni_mesh.data_plane.framing import encode_frame
from omni_mesh.data_plane.messages import HopResult, Payload, StageInput
from omni_mesh.data_plane.shm import ShmReader
from omni_mesh.sidecar.app import liveness_config
from omni_mesh.sidecar.hop.client import HOP_PATH, HopClient
from omni_mesh.sidecar.hop.conn import set_keepalive
from omni_mesh.sidecar.hop.http import HopConnectionError, HopHttpClient, HopReplicaLost
from omni_mesh.sidecar.hop.liveness import HopLiveness, LivenessConfig, probe
from omni_mesh.sidecar.hop.router import Replica, Router
from tests.sidecar.hops import send

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FAST = LivenessConfig(
    probe_after_s=0.2, interval_s=0.2, connect_timeout_s=0.3, answer_timeout_s=0.3
)


@contextlib.asynccontextmanager
async def silent_address() -> AsyncIterator[tuple[str, int]]:
    """A loopback (host, port) that never completes a new connection (full accept queue)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            fillers.append(filler)
        await asyncio.sleep(0.05)  # the fillers' handshakes complete: the queue is full
        yield "127.0.0.1", port
    finally:
        for filler in fillers:
            filler.close()
        server.close()


class Server:
    """An aiohttp replica: ``POST /v1/hop`` answers after ``hop_s`` (never when None); ``GET
    /health`` answers unless ``mute``; counts the probes it got."""

    def __init__(self, hop_s: float | None = 0.0, request_id: str = "r1") -> None:
        self.hop_s = hop_s
        self.request_id = request_id
        self.mute = False
        self.probes = 0
        self.hops = 0
        self.got_hop = asyncio.Event()
        self.stalled = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def hop(self, request: web.Request) -> web.Response:
        await request.read()
        self.hops += 1
        self.got_hop.set()
        if self.hop_s is None:
            await asyncio.Event().wait()  # never answers
        await asyncio.sleep(self.hop_s or 0)
        body = codec.encode(HopResult(request_id=self.request_id))
        return web.Response(body=body, content_type=MSGPACK)

    async def frames(self, request: web.Request) -> web.StreamResponse:
        """A streamed answer: 20 frames 0.05 s apart with ``?flow=1``, else one, then silence."""
        await request.read()
        flow = bool(request.query.get("flow"))
        resp = web.StreamResponse(headers={"Content-Type": HOP_FRAMES})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(20 if flow else 1):
            await resp.write(encode_frame(HopResult(request_id=self.request_id, more=True)))
            await asyncio.sleep(0.05)
        if not flow:
            self.stalled.set()
            await asyncio.Event().wait()
        await resp.write_eof()
        return resp

    async def health(self, _: web.Request) -> web.Response:
        self.probes += 1
        if self.mute:
            await asyncio.Event().wait()
        return web.json_response({"status": "ok"})

    async def start(self) -> Server:
        app = web.Application()
        app.router.add_post(HOP_PATH, self.hop)
        app.router.add_get("/health", self.health)
        app.router.add_post("/frames", self.frames)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@contextlib.asynccontextmanager
async def replicas(*specs: float | None) -> AsyncIterator[list[Server]]:
    started = [await Server(hop_s).start() for hop_s in specs]
    try:
        yield started
    finally:
        for replica in started:
            await replica.stop()


@contextlib.asynccontextmanager
async def prober(http: HopHttpClient, config: LivenessConfig = FAST) -> AsyncIterator[None]:
    liveness = HopLiveness(http, config)
    liveness.start()
    try:
        yield
    finally:
        await liveness.close()
        await http.close()


async def post(http: HopHttpClient, address: str, timeout_s: float = 20.0) -> int:
    resp = await http.post(address, HOP_PATH, b"x", {}, timeout_s=timeout_s, max_bytes=1 << 20)
    return resp.status


# ---- settings ---------------------------------------------------------------------------------


def test_settings_feed_the_prober_and_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert liveness_config(StageSettings(pipeline="synthetic")) == LivenessConfig()
    monkeypatch.setenv("OMNI_STAGE_HOP_PROBE_AFTER_S", "2")
    settings = StageSettings(pipeline="synthetic", hop_connect_timeout_s=1.5)
    assert liveness_config(settings) == LivenessConfig(probe_after_s=2, connect_timeout_s=1.5)
    monkeypatch.delenv("OMNI_STAGE_HOP_PROBE_AFTER_S")
    for field, bad in (
        ("hop_connect_timeout_s", 0),
        ("hop_probe_after_s", 0.01),
        ("hop_probe_interval_s", 100),
        ("hop_probe_timeout_s", -1),
        ("hop_keepalive_s", -1),
    ):
        with pytest.raises(ValidationError, match=field):
            StageSettings(pipeline="synthetic", **{field: bad})


# ---- the probe ---------------------------------------------------------------------------------


async def test_probe_tells_alive_from_silent_refused_and_mute() -> None:
    async with replicas(0.0) as [alive]:
        assert await probe("127.0.0.1", alive.port, connect_timeout_s=1, answer_timeout_s=1) == ""
        alive.mute = True
        t0 = time.monotonic()
        why = await probe("127.0.0.1", alive.port, connect_timeout_s=1, answer_timeout_s=0.2)
        assert why == "connected, but no answer within 0.2s"
        assert time.monotonic() - t0 < 1.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = s.getsockname()[1]
    why = await probe("127.0.0.1", refused, connect_timeout_s=1, answer_timeout_s=1)
    assert why.startswith("cannot connect"), why
    async with silent_address() as (host, port):
        t0 = time.monotonic()
        why = await probe(host, port, connect_timeout_s=0.2, answer_timeout_s=1)
        assert why == "no connection within 0.2s"
        assert time.monotonic() - t0 < 1.0


async def test_any_http_answer_is_alive() -> None:
    async def unavailable(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(unavailable, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        assert await probe("127.0.0.1", port, connect_timeout_s=1, answer_timeout_s=1) == ""
    finally:
        server.close()
        await server.wait_closed()


# ---- the hop client's connect timeout ----------------------------------------------------------


async def test_connect_timeout_is_a_connection_failure_bounded_by_the_deadline() -> None:
    http = HopHttpClient(connect_timeout_s=0.2)
    try:
        async with silent_address() as (host, port):
            t0 = time.monotonic()
            with pytest.raises(HopConnectionError, match=r"no connection within 0\.2s"):
                await post(http, f"http://{host}:{port}")
            assert time.monotonic() - t0 < 1.0
            # A deadline shorter than the connect timeout wins: the caller's TimeoutError.
            slow = HopHttpClient(connect_timeout_s=10)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await post(slow, f"http://{host}:{port}", timeout_s=0.2)
            assert time.monotonic() - t0 < 1.0
            await slow.close()
    finally:
        await http.close()


def test_keepalive_options() -> None:
    with socket.socket() as sock:
        set_keepalive(sock, 5)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        opts = {
            name: sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
            for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")
        }
        assert opts == {
            "TCP_KEEPIDLE": 1,
            "TCP_KEEPINTVL": 1,
            "TCP_KEEPCNT": 4,
            "TCP_USER_TIMEOUT": 0,  # not set: a live receiver may stop reading for long
        }
    with socket.socket() as sock:
        set_keepalive(sock, 60)  # idle 12 s, then 4 probes 12 s apart
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 12
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4


# ---- the prober ----------------------------------------------------------------------------------


async def test_a_slow_answer_is_not_cut_while_the_replica_answers_probes() -> None:
    async with replicas(1.2) as [slow]:
        http = HopHttpClient()
        async with prober(http):
            t0 = time.monotonic()
            statuses = await asyncio.gather(*(post(http, slow.address) for _ in range(3)))
            took = time.monotonic() - t0
        assert statuses == [200, 200, 200]
        assert took >= 1.2
        # One prober for the replica, shared by its three calls: a probe every 0.2 s or so
        # after the first 0.2 s, not three.
        assert 1 <= slow.probes <= 7, slow.probes


async def test_nothing_is_probed_without_calls_outstanding() -> None:
    async with replicas(0.0) as [fast]:
        http = HopHttpClient()
        async with prober(http):
            for _ in range(5):
                assert await post(http, fast.address) == 200
            await asyncio.sleep(0.5)  # an idle kept-alive connection is not outstanding
        assert fast.probes == 0
        assert http.outstanding() == {}


async def test_calls_to_a_replica_that_went_mute_fail_together_within_a_second() -> None:
    async with replicas(None, 1.0) as [mute, slow]:
        http = HopHttpClient()
        async with prober(http):
            assert await post(http, slow.address) == 200  # leaves an idle connection
            mute.mute = True
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(post(http, mute.address) for _ in range(3)),
                post(http, slow.address),  # another replica's call is left alone
                return_exceptions=True,
            )
            took = time.monotonic() - t0
        lost, other = results[:3], results[3]
        assert other == 200
        for exc in lost:
            assert isinstance(exc, HopReplicaLost), exc
            assert "failed a liveness probe (/health: connected, but no answer" in str(exc)
        assert took < 2.0  # the mute calls: 0.2 s + a tick + 0.3 s; the slow one: 1 s
        assert 1 <= mute.probes <= 2, "one prober for the mute replica's three calls"
        assert http.outstanding() == {}


async def test_a_streamed_answer_that_stalls_is_cut_and_one_that_flows_is_not() -> None:
    """Frames are progress: a stream sending one every 0.05 s for 1 s is never probed (after
    0.5 s without one it would be); one that stalls after its first frame on a replica gone
    mute is cut (``HopReplicaLost``)."""
    config = LivenessConfig(probe_after_s=0.5, connect_timeout_s=0.3, answer_timeout_s=0.3)
    async with replicas(0.0) as [server]:
        http = HopHttpClient()
        async with prober(http, config):

            async def read(path: str) -> int:
                resp = await http.post(server.address, path, b"x", {}, timeout_s=20,
                                       max_bytes=1 << 20, stream_type=HOP_FRAMES)  # fmt: skip
                assert resp.frames is not None
                return len([f async for f in resp.frames])

            assert await read("/frames?flow=1") == 20
            assert server.probes == 0, "a stream whose frames keep coming is not probed"
            server.mute = True
            t0 = time.monotonic()
            with pytest.raises(HopReplicaLost, match="streamed answer cut"):
                await read("/frames")
            assert server.stalled.is_set() and time.monotonic() - t0 < 2.0


def _run_abort_mid_send(run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    """A 32 MiB body to a replica that stops reading: abort() fails the send at once."""

    async def main() -> None:
        held: list[asyncio.StreamWriter] = []

        async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)  # reads nothing: the sender's buffers fill up

        server = await asyncio.start_server(stalls, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        http = HopHttpClient()
        call = asyncio.ensure_future(
            http.post(f"http://127.0.0.1:{port}", HOP_PATH, bytes(32 << 20), {},
                      timeout_s=20, max_bytes=1 << 20)
        )  # fmt: skip
        await asyncio.sleep(0.3)
        assert list(http.outstanding()) == [("127.0.0.1", port)]
        assert http.abort(("127.0.0.1", port), "gone silent") == 1
        with pytest.raises(HopReplicaLost, match="gone silent"):
            await asyncio.wait_for(call, 2)
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
        await http.close()

    run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_abort_in_the_middle_of_sending_a_large_body(loop: str) -> None:
    _run_abort_mid_send(asyncio.run if loop == "asyncio" else uvloop.run)


# ---- through the hop client: replayed on another replica -----------------------------------------


class Pools:
    def __init__(self, *members: Replica) -> None:
        self.members = list(members)

    def replicas(self, stage_id: int) -> list[Replica]:
        return [r for r in self.members if r.stage_id == stage_id]


async def test_a_hop_to_a_mute_replica_is_replayed_on_another_within_a_second() -> None:
    ejected: list[tuple[str, str, bool]] = []
    async with replicas(None, 0.0) as [mute, good]:
        mute.mute = True

        def member(name: str, server: Server) -> Replica:
            return Replica(instance_id=name, stage_id=1, address=server.address,
                           host_id="b", capacity=8)  # fmt: skip

        pools = Pools(member("mute", mute))
        router = Router(
            pools,
            host_id="a",
            rng=random.Random(1),
            on_eject=lambda i, why, conn: ejected.append((i, why, conn)),
        )
        si = StageInput(
            pipeline="synthetic",
            request_id="r1",
            stage_id=1,
            from_stage=0,
            deadline_ms=int((time.time() + 20) * 1000),
            seed=1,
            payload=Payload(fields={"prompt": "p"}),
        )
        http = HopHttpClient()
        with ShmReader() as reader:
            async with prober(http):
                hop = HopClient(http, router, lambda a, b: HttpConnector(), reader, retries=2)
                t0 = time.monotonic()
                task = asyncio.ensure_future(send(hop, si))
                await mute.got_hop.wait()  # the hop reached the mute replica: now a second one
                pools.members.append(member("good", good))
                result = await asyncio.wait_for(task, 5)
                took = time.monotonic() - t0
    assert result.error is None and result.request_id == "r1"
    assert took < 1.5, f"replayed after {took:.2f}s"
    assert good.hops == 1
    assert [(i, conn) for i, _, conn in ejected] == [("mute", True)]
    assert "liveness probe" in ejected[0][1]
