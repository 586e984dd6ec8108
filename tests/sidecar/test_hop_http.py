"""The lean sidecar-to-sidecar HTTP client against a real aiohttp server: keep-alive reuse,
a server that closed an idle connection, chunked answers, large bodies both ways, size limits
and typed failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from omni_mesh.data_plane.wire import ResponseTooLarge
from omni_mesh.sidecar.hop.http import HopConnectionError, HopHttpClient
from tests.procs import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Server:
    def __init__(self) -> None:
        self.peers: set[object] = set()
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        body = await request.read()
        return web.Response(body=body[::-1], content_type="application/x-test")

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b"ab", b"cd", b"ef"):
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def start(self, keepalive_timeout: float = 75.0) -> Server:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/chunked", self.chunked)
        self.runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[HopHttpClient]:
    http = HopHttpClient()
    yield http
    await http.close()


async def test_keep_alive_and_large_bodies(client: HopHttpClient) -> None:
    server = await Server().start()
    try:
        for _ in range(5):
            r = await client.post(
                server.address, "/echo", b"hello", {}, timeout_s=5, max_bytes=1 << 20
            )
            assert (r.status, r.content_type, bytes(r.body)) == (
                200,
                "application/x-test",
                b"olleh",
            )
        assert len(server.peers) == 1  # one connection, reused
        big = bytes(range(256)) * (12 * 4096)  # 12 MiB
        r = await client.post(server.address, "/echo", big, {}, timeout_s=10, max_bytes=1 << 25)
        assert bytes(r.body) == big[::-1]
        with pytest.raises(ResponseTooLarge):
            await client.post(server.address, "/echo", big, {}, timeout_s=10, max_bytes=1 << 20)
    finally:
        await server.stop()


async def test_chunked_answer(client: HopHttpClient) -> None:
    server = await Server().start()
    try:
        r = await client.post(server.address, "/chunked", b"x", {}, timeout_s=5, max_bytes=100)
        assert bytes(r.body) == b"abcdef"
    finally:
        await server.stop()


async def test_a_connection_the_server_closed_is_replaced(client: HopHttpClient) -> None:
    server = await Server().start(keepalive_timeout=0.1)
    try:
        await client.post(server.address, "/echo", b"1", {}, timeout_s=5, max_bytes=100)
        await asyncio.sleep(0.5)  # the server closes the idle connection
        r = await client.post(server.address, "/echo", b"12", {}, timeout_s=5, max_bytes=100)
        assert bytes(r.body) == b"21"
    finally:
        await server.stop()


async def test_refused_is_a_connection_error(client: HopHttpClient) -> None:
    with pytest.raises(HopConnectionError):
        await client.post(
            f"http://127.0.0.1:{free_port()}", "/echo", b"", {}, timeout_s=2, max_bytes=10
        )
